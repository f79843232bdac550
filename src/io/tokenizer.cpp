// Byte-level BPE tokenizer: encode / decode, our JSON format, tiktoken files, chat markup.
// Training lives in tokenizer_train.cpp, pre-tokenisation in tokenizer_pretokenize.cpp.
#include "io/tokenizer.h"

#include <algorithm>
#include <climits>
#include <fstream>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>

#include "core/error.h"
#include "io/safetensors.h"  // write_file_atomic

namespace dm {
using ordered_json = nlohmann::ordered_json;

const std::vector<std::string>& tokenizer_default_special_tokens() {
  static const std::vector<std::string> names = {
      "<|im_system|>",      "<|im_user|>",     "<|im_assistant|>",
      "<|im_middle|>",      "<|im_end|>",      "<|media_start|>",
      "<|media_content|>",  "<|media_end|>",   "<|media_row_break|>",
      "<|tool_calls_section_begin|>",          "<|tool_calls_section_end|>",
      "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
      "<|tool_call_end|>",  "<|endoftext|>",   "<|pad|>"};
  return names;
}

// ---------------------------------------------------------------------------------------------
// base64 (RFC 4648, with padding): the tiktoken format stores token bytes this way, and so do we
// in JSON, since token bytes need not be valid UTF-8.
namespace {
constexpr char kBase64Alphabet[] =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string base64_encode(std::string_view bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    const uint32_t v = (uint8_t(bytes[i]) << 16) | (uint8_t(bytes[i + 1]) << 8) | uint8_t(bytes[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out.push_back(kBase64Alphabet[(v >> s) & 63]);
  }
  const size_t rest = bytes.size() - i;
  if (rest == 1) {
    const uint32_t v = uint8_t(bytes[i]) << 16;
    out += {kBase64Alphabet[(v >> 18) & 63], kBase64Alphabet[(v >> 12) & 63], '=', '='};
  } else if (rest == 2) {
    const uint32_t v = (uint8_t(bytes[i]) << 16) | (uint8_t(bytes[i + 1]) << 8);
    out += {kBase64Alphabet[(v >> 18) & 63], kBase64Alphabet[(v >> 12) & 63],
            kBase64Alphabet[(v >> 6) & 63], '='};
  }
  return out;
}

// false on any malformed input (bad length, character, or padding).
bool base64_decode(std::string_view text, std::string& out) {
  out.clear();
  if (text.size() % 4 != 0) return false;
  auto value_of = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  for (size_t i = 0; i < text.size(); i += 4) {
    const bool last = i + 4 == text.size();
    int v[4];
    int pad = 0;
    for (int k = 0; k < 4; ++k) {
      if (text[i + k] == '=' && last && k >= 2) {
        v[k] = 0;
        ++pad;
      } else {
        if (pad) return false;  // data after padding
        v[k] = value_of(text[i + k]);
        if (v[k] < 0) return false;
      }
    }
    const uint32_t w = (v[0] << 18) | (v[1] << 12) | (v[2] << 6) | v[3];
    out.push_back(char((w >> 16) & 255));
    if (pad < 2) out.push_back(char((w >> 8) & 255));
    if (pad < 1) out.push_back(char(w & 255));
  }
  return true;
}
}  // namespace

// ---------------------------------------------------------------------------------------------
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

const std::string& Tokenizer::pattern() const {
  static const std::string none;
  return pretokenizer_ ? pretokenizer_->pattern() : none;
}

void Tokenizer::build_indexes(const std::string& origin) {
  DM_CHECK(rank_bytes_.size() < size_t(INT32_MAX) / 2, origin, ": too many tokens");
  bytes_rank_.clear();
  bytes_rank_.reserve(rank_bytes_.size() * 2);
  std::fill(std::begin(byte_rank_), std::end(byte_rank_), -1);
  for (size_t r = 0; r < rank_bytes_.size(); ++r) {
    const std::string& b = rank_bytes_[r];
    DM_CHECK(!b.empty(), origin, ": token of rank ", r, " is empty");
    const bool inserted = bytes_rank_.emplace(b, int32_t(r)).second;
    DM_CHECK(inserted, origin, ": token of rank ", r, " duplicates rank ", bytes_rank_.at(b));
    if (b.size() == 1) byte_rank_[uint8_t(b[0])] = int32_t(r);
  }
  for (int b = 0; b < 256; ++b)
    DM_CHECK(byte_rank_[b] >= 0, origin, ": byte 0x", std::hex, b,
             " has no token (a byte-level vocabulary needs all 256 single bytes)");
  for (size_t i = 0; i < special_names_.size(); ++i) {
    DM_CHECK(!special_names_[i].empty(), origin, ": special token ", i, " has an empty name");
    for (size_t j = 0; j < i; ++j)
      DM_CHECK(special_names_[i] != special_names_[j], origin, ": special token '",
               special_names_[i], "' listed twice");
  }
}

Tokenizer Tokenizer::from_ranks(std::vector<std::string> ranked_tokens, const std::string& pattern,
                                const std::vector<std::string>& special_tokens,
                                const std::string& origin) {
  Tokenizer t;
  t.rank_bytes_ = std::move(ranked_tokens);
  t.special_names_ = special_tokens;
  t.build_indexes(origin);
  t.pretokenizer_ = std::make_unique<PreTokenizer>(tokenizer_pattern_by_name(pattern));
  return t;
}

int32_t Tokenizer::rank_of(std::string_view bytes) const {
  auto it = bytes_rank_.find(bytes);
  return it == bytes_rank_.end() ? -1 : it->second;
}

const std::string& Tokenizer::token_bytes(int32_t id) const {
  DM_CHECK(id >= 0 && id < vocab_size(), "token id ", id, " out of range [0, ", vocab_size(), ")");
  if (id < num_ranks()) return rank_bytes_[size_t(id)];
  return special_names_[size_t(id - num_ranks())];
}

bool Tokenizer::has_special(std::string_view name) const {
  return std::find(special_names_.begin(), special_names_.end(), name) != special_names_.end();
}

int32_t Tokenizer::special_id(std::string_view name) const {
  auto it = std::find(special_names_.begin(), special_names_.end(), name);
  DM_CHECK(it != special_names_.end(), "tokenizer has no special token '", name, "'");
  return int32_t(num_ranks() + (it - special_names_.begin()));
}

// ---------------------------------------------------------------------------------------------
// BPE of one piece. Pieces above this length take the heap path: the scan below is O(n²).
constexpr size_t kBpeScanMaxPieceBytes = 128;

void Tokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  const size_t n = piece.size();
  if (n == 0) return;
  if (n == 1) {
    out.push_back(byte_rank_[uint8_t(piece[0])]);
    return;
  }
  if (const int32_t whole = rank_of(piece); whole >= 0) {
    out.push_back(whole);
    return;
  }
  if (n > kBpeScanMaxPieceBytes) {
    encode_piece_heap(piece, out);
    return;
  }
  // part_start[i]: byte where part i begins; pair_rank[i]: rank of parts i and i+1 joined (INT_MAX
  // = not a token). The two sentinels at the end keep the neighbour look-ups branch-free.
  int32_t part_start[kBpeScanMaxPieceBytes + 2];
  int32_t pair_rank[kBpeScanMaxPieceBytes + 2];
  size_t parts = n + 1;
  for (size_t i = 0; i + 1 < n; ++i) {
    const int32_t r = rank_of(piece.substr(i, 2));
    part_start[i] = int32_t(i);
    pair_rank[i] = r < 0 ? INT_MAX : r;
  }
  part_start[n - 1] = int32_t(n - 1);
  pair_rank[n - 1] = INT_MAX;
  part_start[n] = int32_t(n);
  pair_rank[n] = INT_MAX;
  // Rank of parts i, i+1 joined, once part i+1 has absorbed part i+2.
  auto joined_rank_after_merge = [&](size_t i) -> int32_t {
    if (i + 3 >= parts) return INT_MAX;
    const int32_t r = rank_of(piece.substr(size_t(part_start[i]), size_t(part_start[i + 3] - part_start[i])));
    return r < 0 ? INT_MAX : r;
  };
  while (true) {
    int32_t best_rank = INT_MAX;
    size_t best = 0;
    for (size_t i = 0; i + 1 < parts; ++i)
      if (pair_rank[i] < best_rank) {
        best_rank = pair_rank[i];
        best = i;
      }
    if (best_rank == INT_MAX) break;
    if (best > 0) pair_rank[best - 1] = joined_rank_after_merge(best - 1);
    pair_rank[best] = joined_rank_after_merge(best);
    std::copy(part_start + best + 2, part_start + parts, part_start + best + 1);
    std::copy(pair_rank + best + 2, pair_rank + parts, pair_rank + best + 1);
    --parts;
  }
  for (size_t i = 0; i + 1 < parts; ++i)
    out.push_back(rank_of(piece.substr(size_t(part_start[i]), size_t(part_start[i + 1] - part_start[i]))));
}

void Tokenizer::encode_piece_heap(std::string_view piece, std::vector<int32_t>& out) const {
  const int32_t n = int32_t(piece.size());
  if (n == 0) return;
  // Parts as a linked list over their start bytes; next_start[s] == n ends the list; a part that
  // was absorbed by its left neighbour has alive[s] == 0.
  const size_t n_bytes = piece.size();
  std::vector<int32_t> next_start(n_bytes), prev_start(n_bytes);
  std::vector<uint8_t> alive(n_bytes, 1);
  for (int32_t i = 0; i < n; ++i) {
    next_start[size_t(i)] = i + 1;
    prev_start[size_t(i)] = i - 1;
  }
  struct Candidate {
    int32_t rank, left, right, right_end;  // parts [left,right) and [right,right_end)
    bool operator>(const Candidate& o) const {  // lowest rank first, then leftmost (= tiktoken)
      return rank != o.rank ? rank > o.rank : left > o.left;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  auto push_pair = [&](int32_t left) {
    if (left < 0 || left >= n) return;
    const int32_t right = next_start[size_t(left)];
    if (right >= n) return;
    const int32_t right_end = next_start[size_t(right)];
    const int32_t r = rank_of(piece.substr(size_t(left), size_t(right_end - left)));
    if (r >= 0) heap.push({r, left, right, right_end});
  };
  for (int32_t i = 0; i + 1 < n; ++i) push_pair(i);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    // Stale if either part changed since the candidate was pushed.
    if (!alive[size_t(c.left)] || !alive[size_t(c.right)] || next_start[size_t(c.left)] != c.right ||
        next_start[size_t(c.right)] != c.right_end)
      continue;
    alive[size_t(c.right)] = 0;
    next_start[size_t(c.left)] = c.right_end;
    if (c.right_end < n) prev_start[size_t(c.right_end)] = c.left;
    push_pair(prev_start[size_t(c.left)]);
    push_pair(c.left);
  }
  for (int32_t s = 0; s < n; s = next_start[size_t(s)])
    out.push_back(rank_of(piece.substr(size_t(s), size_t(next_start[size_t(s)] - s))));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool allow_special) const {
  DM_CHECK(pretokenizer_ != nullptr, "tokenizer: encode on an empty (default-constructed) tokenizer");
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  std::vector<std::string_view> pieces;
  auto encode_ordinary = [&](std::string_view segment) {
    pieces.clear();
    pretokenizer_->split(segment, pieces);
    for (std::string_view p : pieces) encode_piece(p, ids);
  };
  if (!allow_special || special_names_.empty()) {
    encode_ordinary(text);
    return ids;
  }
  // Split at special-token occurrences (the longest name wins where several start at one byte).
  bool is_first_byte[256] = {};
  for (const auto& s : special_names_) is_first_byte[uint8_t(s[0])] = true;
  size_t segment_begin = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    if (!is_first_byte[uint8_t(text[i])]) continue;
    int32_t found = -1;
    size_t found_len = 0;
    for (size_t k = 0; k < special_names_.size(); ++k) {
      const std::string& s = special_names_[k];
      if (s.size() > found_len && text.substr(i, s.size()) == s) {
        found = int32_t(k);
        found_len = s.size();
      }
    }
    if (found < 0) continue;
    encode_ordinary(text.substr(segment_begin, i - segment_begin));
    ids.push_back(int32_t(num_ranks()) + found);
    segment_begin = i + found_len;
    i = segment_begin - 1;
  }
  encode_ordinary(text.substr(segment_begin));
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) out += token_bytes(id);
  return out;
}

// ---------------------------------------------------------------------------------------------
void Tokenizer::save(const std::string& path) const {
  ordered_json j;
  j["format"] = "deltamoe-bpe";
  j["version"] = 1;
  j["pattern"] = pattern();
  ordered_json tokens = ordered_json::array();
  for (const auto& b : rank_bytes_) tokens.push_back(base64_encode(b));
  j["tokens"] = std::move(tokens);
  ordered_json merges = ordered_json::array();
  for (const auto& m : merges_) merges.push_back({m.first, m.second});
  j["merges"] = std::move(merges);
  ordered_json specials = ordered_json::array();
  for (size_t i = 0; i < special_names_.size(); ++i)
    specials.push_back({{"name", special_names_[i]}, {"id", num_ranks() + int64_t(i)}});
  j["special_tokens"] = std::move(specials);
  const std::string text = j.dump(1);
  write_file_atomic(path, text.data(), text.size());
}

Tokenizer Tokenizer::load(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  DM_CHECK(f.good(), path, ": cannot open tokenizer file");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    throw Error(str_cat(path, ": not valid JSON (", e.what(), ")"));
  }
  DM_CHECK(j.is_object(), path, ": tokenizer file is not a JSON object");
  auto field = [&](const char* name) -> const nlohmann::json& {
    DM_CHECK(j.contains(name), path, ": missing field '", name, "'");
    return j.at(name);
  };
  DM_CHECK(field("format").is_string() && field("format").get<std::string>() == "deltamoe-bpe",
           path, ": field 'format' must be \"deltamoe-bpe\"");
  DM_CHECK(field("version").is_number_integer() && field("version").get<int64_t>() == 1, path,
           ": field 'version': only version 1 is supported");
  DM_CHECK(field("pattern").is_string(), path, ": field 'pattern' must be a string");
  const auto& tokens = field("tokens");
  DM_CHECK(tokens.is_array(), path, ": field 'tokens' must be an array");
  std::vector<std::string> ranked(tokens.size());
  for (size_t r = 0; r < tokens.size(); ++r) {
    DM_CHECK(tokens[r].is_string() && base64_decode(tokens[r].get<std::string>(), ranked[r]), path,
             ": field 'tokens[", r, "]' is not a base64 string");
  }
  std::vector<std::string> specials;
  if (j.contains("special_tokens")) {
    const auto& sp = j.at("special_tokens");
    DM_CHECK(sp.is_array(), path, ": field 'special_tokens' must be an array");
    for (size_t i = 0; i < sp.size(); ++i) {
      const auto& e = sp[i];
      DM_CHECK(e.is_object() && e.contains("name") && e["name"].is_string() && e.contains("id") &&
                   e["id"].is_number_integer(),
               path, ": field 'special_tokens[", i, "]' needs a string 'name' and an integer 'id'");
      DM_CHECK(e["id"].get<int64_t>() == int64_t(ranked.size() + i), path, ": field 'special_tokens[",
               i, "].id' is ", e["id"].get<int64_t>(), ", expected ", ranked.size() + i,
               " (special ids follow the BPE ranks in order)");
      specials.push_back(e["name"].get<std::string>());
    }
  }
  Tokenizer t = from_ranks(std::move(ranked), j["pattern"].get<std::string>(), specials, path);
  if (j.contains("merges")) {
    const auto& m = j.at("merges");
    DM_CHECK(m.is_array(), path, ": field 'merges' must be an array");
    for (size_t i = 0; i < m.size(); ++i) {
      DM_CHECK(m[i].is_array() && m[i].size() == 2 && m[i][0].is_number_integer() &&
                   m[i][1].is_number_integer(),
               path, ": field 'merges[", i, "]' must be a pair of integers");
      const int64_t a = m[i][0].get<int64_t>(), b = m[i][1].get<int64_t>();
      DM_CHECK(a >= 0 && b >= 0 && a < t.num_ranks() && b < t.num_ranks(), path, ": field 'merges[",
               i, "]' names a token outside the vocabulary");
      t.merges_.emplace_back(int32_t(a), int32_t(b));
    }
  }
  return t;
}

Tokenizer Tokenizer::load_tiktoken(const std::string& path, const std::string& pattern,
                                   const std::vector<std::string>& special_tokens) {
  std::ifstream f(path, std::ios::binary);
  DM_CHECK(f.good(), path, ": cannot open tiktoken file");
  std::vector<std::string> ranked;
  std::vector<uint8_t> seen;
  std::string line, bytes;
  size_t line_no = 0;
  while (std::getline(f, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    const size_t space = line.find(' ');
    DM_CHECK(space != std::string::npos, path, ":", line_no, ": expected 'base64 rank'");
    DM_CHECK(base64_decode(std::string_view(line).substr(0, space), bytes), path, ":", line_no,
             ": token is not valid base64");
    int64_t rank = -1;
    try {
      size_t used = 0;
      const std::string rank_text = line.substr(space + 1);
      rank = std::stoll(rank_text, &used);
      DM_CHECK(used == rank_text.size(), path, ":", line_no, ": rank is not an integer");
    } catch (const std::logic_error&) {
      throw Error(str_cat(path, ":", line_no, ": rank is not an integer"));
    }
    DM_CHECK(rank >= 0 && rank < (int64_t(1) << 30), path, ":", line_no, ": rank ", rank, " out of range");
    if (size_t(rank) >= ranked.size()) {
      ranked.resize(size_t(rank) + 1);
      seen.resize(size_t(rank) + 1, 0);
    }
    DM_CHECK(!seen[size_t(rank)], path, ":", line_no, ": rank ", rank, " appears twice");
    seen[size_t(rank)] = 1;
    ranked[size_t(rank)] = bytes;
  }
  for (size_t r = 0; r < seen.size(); ++r)
    DM_CHECK(seen[r], path, ": rank ", r, " is missing (ranks must be 0..N-1)");
  DM_CHECK(!ranked.empty(), path, ": no tokens");
  return from_ranks(std::move(ranked), pattern, special_tokens, path);
}

Tokenizer Tokenizer::load_auto(const std::string& path, const std::string& tiktoken_pattern) {
  std::ifstream f(path, std::ios::binary);
  DM_CHECK(f.good(), path, ": cannot open tokenizer file");
  char first = 0;
  while (f.get(first) && (first == ' ' || first == '\n' || first == '\r' || first == '\t')) {}
  if (first == '{') return load(path);
  return load_tiktoken(path, tiktoken_pattern);
}

// ---------------------------------------------------------------------------------------------
// Chat markup (Kimi style). One description of the layout serves both the text form and the id
// form: a list of segments, each either a marker (special token) or ordinary text.
namespace {
struct ChatSegment {
  bool is_marker;
  std::string text;
  bool assistant;  // counts towards the assistant mask
};

std::vector<ChatSegment> chat_segments(const std::vector<ChatMessage>& messages,
                                       bool add_generation_prompt) {
  std::vector<ChatSegment> seg;
  for (size_t m = 0; m < messages.size(); ++m) {
    const ChatMessage& msg = messages[m];
    std::string header_marker;
    if (msg.role == "system" || msg.role == "tool") header_marker = "<|im_system|>";
    else if (msg.role == "user") header_marker = "<|im_user|>";
    else if (msg.role == "assistant") header_marker = "<|im_assistant|>";
    else throw Error(str_cat("chat message ", m, ": unknown role '", msg.role,
                             "' (expected system, user, assistant or tool)"));
    DM_CHECK(msg.tool_calls.empty() || msg.role == "assistant", "chat message ", m,
             ": only assistant messages carry tool calls");
    const bool reply = msg.role == "assistant";
    seg.push_back({true, header_marker, false});
    seg.push_back({false, msg.role, false});
    seg.push_back({true, "<|im_middle|>", false});
    if (!msg.content.empty()) seg.push_back({false, msg.content, reply});
    if (!msg.tool_calls.empty()) {
      seg.push_back({true, "<|tool_calls_section_begin|>", true});
      for (size_t c = 0; c < msg.tool_calls.size(); ++c) {
        const ChatToolCall& call = msg.tool_calls[c];
        const std::string id =
            call.id.empty() ? str_cat("functions.", call.name, ":", c) : call.id;
        seg.push_back({true, "<|tool_call_begin|>", true});
        seg.push_back({false, id, true});
        seg.push_back({true, "<|tool_call_argument_begin|>", true});
        seg.push_back({false, call.arguments_json, true});
        seg.push_back({true, "<|tool_call_end|>", true});
      }
      seg.push_back({true, "<|tool_calls_section_end|>", true});
    }
    seg.push_back({true, "<|im_end|>", reply});
  }
  if (add_generation_prompt) {
    seg.push_back({true, "<|im_assistant|>", false});
    seg.push_back({false, "assistant", false});
    seg.push_back({true, "<|im_middle|>", false});
  }
  return seg;
}
}  // namespace

std::string Tokenizer::chat_template(const std::vector<ChatMessage>& messages,
                                     bool add_generation_prompt) const {
  std::string out;
  for (const auto& s : chat_segments(messages, add_generation_prompt)) out += s.text;
  return out;
}

ChatEncoding Tokenizer::encode_chat(const std::vector<ChatMessage>& messages,
                                    bool add_generation_prompt) const {
  ChatEncoding enc;
  for (const auto& s : chat_segments(messages, add_generation_prompt)) {
    const size_t before = enc.ids.size();
    if (s.is_marker) enc.ids.push_back(special_id(s.text));
    else {
      const std::vector<int32_t> ids = encode(s.text, /*allow_special=*/false);
      enc.ids.insert(enc.ids.end(), ids.begin(), ids.end());
    }
    enc.assistant_mask.resize(enc.ids.size(), 0);
    std::fill(enc.assistant_mask.begin() + std::ptrdiff_t(before), enc.assistant_mask.end(),
              uint8_t(s.assistant));
  }
  return enc;
}

}  // namespace dm
