// BPE training. The corpus is pre-tokenised (in parallel) into unique pieces ("words") with
// counts; each merge then touches only the words that contain the winning pair, updating the
// pair counts by the difference between each word's old and new pairs, so a merge costs the size
// of its words rather than a recount of the corpus. A max-heap with lazy deletion picks the next
// pair: stale entries (whose count changed since they were pushed) are skipped when popped.
#include <omp.h>

#include <algorithm>
#include <exception>
#include <queue>
#include <unordered_map>

#include "core/error.h"
#include "io/tokenizer.h"

namespace dm {

namespace {
inline uint64_t bpe_pair_key(int32_t left, int32_t right) {
  return (uint64_t(uint32_t(left)) << 32) | uint32_t(right);
}
inline int32_t bpe_pair_left(uint64_t key) { return int32_t(key >> 32); }
inline int32_t bpe_pair_right(uint64_t key) { return int32_t(key & 0xffffffffu); }

struct BpeHeapEntry {
  int64_t count;
  uint64_t key;
  // priority_queue pops the largest: highest count, then the smallest (left, right) pair.
  bool operator<(const BpeHeapEntry& o) const {
    return count != o.count ? count < o.count : key > o.key;
  }
};

// Texts are cut into pieces of about this many bytes (after a newline) so one large text still
// spreads over threads; the cut points depend only on the text, keeping training deterministic.
constexpr size_t kTrainChunkBytes = 1 << 20;

std::vector<std::string_view> bpe_train_chunks(const std::vector<std::string>& texts) {
  std::vector<std::string_view> chunks;
  for (const std::string& t : texts) {
    std::string_view rest(t);
    while (rest.size() > kTrainChunkBytes) {
      size_t cut = rest.find('\n', kTrainChunkBytes);
      if (cut == std::string_view::npos) break;
      // Keep a newline run together (the regex treats "\n\n" as one piece).
      while (cut + 1 < rest.size() && rest[cut + 1] == '\n') ++cut;
      chunks.push_back(rest.substr(0, cut + 1));
      rest.remove_prefix(cut + 1);
    }
    if (!rest.empty()) chunks.push_back(rest);
  }
  return chunks;
}

// Unique pieces of the corpus with their counts, sorted by bytes (deterministic order).
std::vector<std::pair<std::string_view, int64_t>> bpe_count_pieces(
    const std::vector<std::string>& texts, const PreTokenizer& pretokenizer) {
  const std::vector<std::string_view> chunks = bpe_train_chunks(texts);
  const int threads = omp_get_max_threads();
  std::vector<std::unordered_map<std::string_view, int64_t>> per_thread(size_t(std::max(1, threads)));
  std::exception_ptr failure;
#pragma omp parallel
  {
    auto& counts = per_thread[size_t(omp_get_thread_num())];
    std::vector<std::string_view> pieces;
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < int64_t(chunks.size()); ++c) {
      try {
        pieces.clear();
        pretokenizer.split(chunks[size_t(c)], pieces);
        for (std::string_view p : pieces) ++counts[p];
      } catch (...) {
#pragma omp critical
        failure = std::current_exception();
      }
    }
  }
  if (failure) std::rethrow_exception(failure);
  std::unordered_map<std::string_view, int64_t> total = std::move(per_thread[0]);
  for (size_t t = 1; t < per_thread.size(); ++t)
    for (const auto& [piece, count] : per_thread[t]) total[piece] += count;
  std::vector<std::pair<std::string_view, int64_t>> sorted(total.begin(), total.end());
  std::sort(sorted.begin(), sorted.end());
  return sorted;
}
}  // namespace

Tokenizer Tokenizer::train(const std::vector<std::string>& texts, int64_t vocab_size,
                           const std::vector<std::string>& special_tokens,
                           const std::string& pattern) {
  const int64_t num_specials = int64_t(special_tokens.size());
  DM_CHECK(vocab_size >= 256 + num_specials, "tokenizer training: vocab_size ", vocab_size,
           " is below 256 byte tokens + ", num_specials, " special tokens");
  const int64_t target_ranks = vocab_size - num_specials;
  const std::string pattern_text = tokenizer_pattern_by_name(pattern);
  PreTokenizer pretokenizer(pattern_text);

  // Vocabulary so far: rank → bytes, and bytes → rank to catch a merge that rebuilds an existing
  // token through a different split (it then reuses that token's id instead of adding a rank).
  std::vector<std::string> rank_bytes(256);
  std::unordered_map<std::string, int32_t> bytes_rank;
  for (int b = 0; b < 256; ++b) {
    rank_bytes[size_t(b)] = std::string(1, char(b));
    bytes_rank[rank_bytes[size_t(b)]] = b;
  }

  // Words: symbol sequences of the unique pieces, each with its corpus count.
  const auto pieces = bpe_count_pieces(texts, pretokenizer);
  std::vector<std::vector<int32_t>> words;
  std::vector<int64_t> word_count;
  words.reserve(pieces.size());
  for (const auto& [piece, count] : pieces) {
    if (piece.size() < 2) continue;  // no pairs: nothing to learn from it
    words.emplace_back(piece.begin(), piece.end());
    for (auto& s : words.back()) s = int32_t(uint8_t(s));
    word_count.push_back(count);
  }

  // Pair counts and, per pair, the words it (may) occur in. A word index can be listed twice or
  // after the pair left it; both are filtered when the pair is merged.
  std::unordered_map<uint64_t, int64_t> pair_count;
  std::unordered_map<uint64_t, std::vector<int32_t>> pair_words;
  pair_count.reserve(words.size() * 4);
  pair_words.reserve(words.size() * 4);
  for (size_t w = 0; w < words.size(); ++w) {
    const auto& s = words[w];
    for (size_t i = 0; i + 1 < s.size(); ++i) {
      const uint64_t key = bpe_pair_key(s[i], s[i + 1]);
      pair_count[key] += word_count[w];
      auto& list = pair_words[key];
      if (list.empty() || list.back() != int32_t(w)) list.push_back(int32_t(w));
    }
  }
  std::priority_queue<BpeHeapEntry> heap;
  for (const auto& [key, count] : pair_count) heap.push({count, key});

  std::vector<std::pair<int32_t, int32_t>> merges;
  std::unordered_map<uint64_t, int64_t> delta;  // pair-count changes of one merge
  std::vector<int32_t> merged_symbols;
  while (int64_t(rank_bytes.size()) < target_ranks && !heap.empty()) {
    const BpeHeapEntry top = heap.top();
    heap.pop();
    auto count_it = pair_count.find(top.key);
    if (count_it == pair_count.end() || count_it->second != top.count) continue;  // stale
    const int32_t left = bpe_pair_left(top.key), right = bpe_pair_right(top.key);
    const std::string joined = rank_bytes[size_t(left)] + rank_bytes[size_t(right)];
    int32_t merged_id;
    if (auto existing = bytes_rank.find(joined); existing != bytes_rank.end()) {
      merged_id = existing->second;
    } else {
      merged_id = int32_t(rank_bytes.size());
      rank_bytes.push_back(joined);
      bytes_rank.emplace(joined, merged_id);
    }
    merges.emplace_back(left, right);

    std::vector<int32_t> affected = std::move(pair_words[top.key]);
    pair_words.erase(top.key);
    std::sort(affected.begin(), affected.end());
    affected.erase(std::unique(affected.begin(), affected.end()), affected.end());
    delta.clear();
    for (int32_t w : affected) {
      std::vector<int32_t>& s = words[size_t(w)];
      bool contains = false;
      for (size_t i = 0; i + 1 < s.size() && !contains; ++i)
        contains = s[i] == left && s[i + 1] == right;
      if (!contains) continue;
      const int64_t cnt = word_count[size_t(w)];
      for (size_t i = 0; i + 1 < s.size(); ++i) delta[bpe_pair_key(s[i], s[i + 1])] -= cnt;
      merged_symbols.clear();
      for (size_t i = 0; i < s.size(); ++i) {  // left to right, non-overlapping
        if (i + 1 < s.size() && s[i] == left && s[i + 1] == right) {
          merged_symbols.push_back(merged_id);
          ++i;
        } else {
          merged_symbols.push_back(s[i]);
        }
      }
      s.swap(merged_symbols);
      for (size_t i = 0; i + 1 < s.size(); ++i) {
        const uint64_t key = bpe_pair_key(s[i], s[i + 1]);
        delta[key] += cnt;
        if (s[i] == merged_id || s[i + 1] == merged_id) {
          auto& list = pair_words[key];
          if (list.empty() || list.back() != w) list.push_back(w);
        }
      }
    }
    // Apply in key order so heap pushes (and thus everything) are independent of hash order.
    std::vector<std::pair<uint64_t, int64_t>> changes;
    changes.reserve(delta.size());
    for (const auto& [key, d] : delta)
      if (d != 0) changes.emplace_back(key, d);
    std::sort(changes.begin(), changes.end());
    for (const auto& [key, d] : changes) {
      int64_t& c = pair_count[key];
      c += d;
      if (c <= 0) {
        pair_count.erase(key);
        pair_words.erase(key);
      } else {
        heap.push({c, key});
      }
    }
    pair_count.erase(top.key);
  }

  Tokenizer t = from_ranks(std::move(rank_bytes), pattern_text, special_tokens, "trained tokenizer");
  t.merges_ = std::move(merges);
  return t;
}

}  // namespace dm
