// Byte-level BPE tokenizer (tiktoken semantics): a token is a byte string with a rank; ranks
// are the token ids; encoding a pre-tokenised piece starts from its single bytes and repeatedly
// merges the adjacent pair whose concatenation is the lowest-ranked token (leftmost on ties), so
// "merges are implied by ranks" and one algorithm serves both vocabularies we train and
// tiktoken files we load. Special tokens take the ids right after the BPE ranks.
//
// Pre-tokenisation splits text with a Unicode-aware regex (PCRE2 in UTF + UCP mode, when built
// with DELTAMOE_HAVE_PCRE2) before BPE, so merges never cross word / number / punctuation
// boundaries. Bytes the regex cannot match (invalid UTF-8) become pieces of their own, which is
// what makes decode(encode(x)) == x for arbitrary bytes. Without PCRE2 a built-in splitter with
// ASCII classes (UTF-8 multibyte sequences count as letters) is used instead.
//
// Files:
//   - our JSON (save / load): {"format": "deltamoe-bpe", "version": 1, "pattern": "...",
//     "tokens": [base64 of each rank's bytes, in rank order], "merges": [[left, right], ...]
//     (informational: the pair each trained rank ≥ 256 was made from), "special_tokens":
//     [{"name": "<|im_end|>", "id": N}, ...]}
//   - tiktoken (load_tiktoken): one "base64 rank" per line; the caller supplies the pattern and
//     the special tokens.
// Implementation: tokenizer.cpp (encode/decode/files/chat), tokenizer_train.cpp (BPE training),
// tokenizer_pretokenize.cpp (regex and built-in splitters).
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace dm {

// Pre-tokenisation patterns (PCRE2 syntax). Kimi's pattern written without the `&&` class
// intersection that PCRE2 lacks: Han runs, letter runs with an optional leading non-letter and an
// English contraction suffix, numbers in groups of up to 3 digits, punctuation runs, whitespace.
extern const char* const kTokenizerPatternKimi;
// GPT-4's cl100k_base pattern.
extern const char* const kTokenizerPatternCl100k;
// Resolves "kimi" / "cl100k" to the pattern text; anything else is returned as a regex.
std::string tokenizer_pattern_by_name(const std::string& name_or_regex);

// The fixed special tokens for chat, media and tool calls, in id order.
const std::vector<std::string>& tokenizer_default_special_tokens();

// Splits text into pre-token pieces (views into `text`) that cover it exactly, in order.
class PreTokenizer {
 public:
  // pattern: PCRE2 regex (ignored without PCRE2, where the built-in splitter runs).
  explicit PreTokenizer(const std::string& pattern);
  ~PreTokenizer();
  PreTokenizer(const PreTokenizer&) = delete;
  PreTokenizer& operator=(const PreTokenizer&) = delete;

  // Thread-safe (each thread uses its own match data).
  void split(std::string_view text, std::vector<std::string_view>& pieces) const;
  const std::string& pattern() const { return pattern_; }
  // True when the regex engine is PCRE2; false for the built-in ASCII-class splitter.
  static bool regex_available();

 private:
  std::string pattern_;
  void* compiled_ = nullptr;  // pcre2_code_8*
};

// The built-in splitter (always compiled, used when PCRE2 is absent; exposed for tests).
void pretokenize_builtin_split(std::string_view text, std::vector<std::string_view>& pieces);

struct ChatToolCall {
  std::string id;              // e.g. "functions.search:0"; empty → "functions.<name>:<index>"
  std::string name;
  std::string arguments_json;  // the JSON object as text
};

struct ChatMessage {
  std::string role;     // "system" | "user" | "assistant" | "tool"
  std::string content;
  std::vector<ChatToolCall> tool_calls;  // assistant only
};

// Token ids of a chat plus, per token, whether it belongs to an assistant reply (the tokens a
// supervised / RL loss is taken on: content, tool calls and the closing <|im_end|>).
struct ChatEncoding {
  std::vector<int32_t> ids;
  std::vector<uint8_t> assistant_mask;
};

class Tokenizer {
 public:
  Tokenizer() = default;
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Trains on `texts`. vocab_size counts everything: 256 byte tokens + merges + specials; it
  // stops early (smaller vocabulary) if the corpus runs out of pairs. Deterministic: the pair
  // with the highest count wins, ties go to the smallest (left id, right id). Pre-tokenisation
  // runs on OpenMP threads; merging uses incremental pair-count updates.
  static Tokenizer train(const std::vector<std::string>& texts, int64_t vocab_size,
                         const std::vector<std::string>& special_tokens =
                             tokenizer_default_special_tokens(),
                         const std::string& pattern = kTokenizerPatternKimi);
  // Our JSON format (see the top of this file); errors name the file and field.
  static Tokenizer load(const std::string& path);
  // tiktoken vocabulary file; `pattern` is a regex or "kimi" / "cl100k"; specials get ids
  // starting at the number of ranks.
  static Tokenizer load_tiktoken(const std::string& path, const std::string& pattern,
                                 const std::vector<std::string>& special_tokens =
                                     tokenizer_default_special_tokens());
  // Our JSON if the file starts with '{', else a tiktoken file read with `tiktoken_pattern`.
  static Tokenizer load_auto(const std::string& path, const std::string& tiktoken_pattern = "kimi");
  // Builds from ranked byte strings (rank = index); every single byte must be present.
  static Tokenizer from_ranks(std::vector<std::string> ranked_tokens, const std::string& pattern,
                              const std::vector<std::string>& special_tokens,
                              const std::string& origin = "<memory>");
  void save(const std::string& path) const;  // atomic write

  // Special-token strings become their single ids only when allow_special; otherwise they are
  // encoded as ordinary text. Thread-safe.
  std::vector<int32_t> encode(std::string_view text, bool allow_special = false) const;
  // Bytes of the ids (special tokens as their names). Throws dm::Error on an id out of range.
  std::string decode(std::span<const int32_t> ids) const;
  std::string decode(const std::vector<int32_t>& ids) const {
    return decode(std::span<const int32_t>(ids));
  }
  // The bytes of one token.
  const std::string& token_bytes(int32_t id) const;

  int64_t vocab_size() const { return int64_t(rank_bytes_.size() + special_names_.size()); }
  int64_t num_ranks() const { return int64_t(rank_bytes_.size()); }
  // Id of a special token; throws dm::Error naming it if absent.
  int32_t special_id(std::string_view name) const;
  bool has_special(std::string_view name) const;
  bool is_special(int32_t id) const { return id >= num_ranks() && id < vocab_size(); }
  const std::vector<std::string>& special_tokens() const { return special_names_; }
  const std::string& pattern() const;
  // The pairs merged in training, in order (a merge that rebuilt an existing token through a
  // different split adds no rank); empty for tiktoken files.
  const std::vector<std::pair<int32_t, int32_t>>& merges() const { return merges_; }

  // BPE of one pre-token piece (no regex, no specials), appended to `out`.
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
  // The same through the O(n log n) heap algorithm used for long pieces (tests compare the two).
  void encode_piece_heap(std::string_view piece, std::vector<int32_t>& out) const;

  // Kimi-style chat markup as text: <|im_system|>system<|im_middle|>…<|im_end|> per message,
  // tool calls inside <|tool_calls_section_begin|>…; add_generation_prompt appends
  // <|im_assistant|>assistant<|im_middle|>. Meant for display / logs: encode_chat() is the safe
  // way to tokenise, since message text containing marker strings stays ordinary text there.
  std::string chat_template(const std::vector<ChatMessage>& messages,
                            bool add_generation_prompt = true) const;
  ChatEncoding encode_chat(const std::vector<ChatMessage>& messages,
                           bool add_generation_prompt = true) const;

 private:
  void build_indexes(const std::string& origin);
  int32_t rank_of(std::string_view bytes) const;  // −1 if not a token

  struct StringViewHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::vector<std::string> rank_bytes_;  // rank → bytes
  std::unordered_map<std::string, int32_t, StringViewHash, std::equal_to<>> bytes_rank_;
  int32_t byte_rank_[256] = {};          // single byte → its rank
  std::vector<std::string> special_names_;
  std::vector<std::pair<int32_t, int32_t>> merges_;
  std::unique_ptr<PreTokenizer> pretokenizer_;
};

}  // namespace dm
