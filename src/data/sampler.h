// PackedSampler: batches of B rows × T positions packed from whole documents, deterministic from
// a seed and resumable from a JSON state.
//
// Each row holds T+1 tokens; position t's input is row[t] and its target row[t+1] when both
// belong to the same document, else −1 (so no position learns across a document boundary, and
// padding has no targets). doc_start[t] is the row index of the first token of t's document:
// KDA resets its state there and MLA masks keys before it (varlen attention).
//
// Packing, per row: documents are taken in a shuffled order (a fresh permutation per epoch).
// A document that fits in the room left is placed whole. One that does not: first the next
// `lookahead_documents` documents are searched for one that fits (placed whole, out of order);
// if none does, a document longer than T+1 — or any document with split_short_documents — is
// split at the row end and continues at the start of the next row, repeating its last token
// there so every within-document transition is trained exactly once; otherwise the rest of the
// row is padding. Short documents (≤ T+1 tokens) therefore stay whole by default, which the
// long-context tasks (builtin.h) need: a retrieval document cut in half teaches nothing.
//
// Mixtures: a sampler draws whole rows from several sources (datasets with weights): replay of
// the earlier stages' data (progressive context, SPEC §2), or task data beside text. Each source
// keeps its own packing cursor; every row is packed from one source. With stratified_mixture
// (default) the row's source is chosen by smooth weighted round-robin on integer credits: every
// run of n consecutive rows holds ⌊n·w⌋ or ⌈n·w⌉ rows of a source of weight w, so the mix of a
// batch — and with it the expert loads that Quantile Balancing must predict from one step to the
// next — does not swing from batch to batch. Otherwise a seeded coin per row picks the source.
//
// Data parallel: world_size ranks each build the same global row stream and keep rows
// r ≡ rank (mod world_size), so ranks see disjoint rows with no communication.
//
// State (state_json / restore): per source epoch, position in the permutation, offset into a
// split document, the documents taken ahead and the mixture credit; the coin's rng; rows emitted. Restoring
// continues the identical stream (batch size may change in between: the row stream does not
// depend on it; the sequence length may change at a stage transition, continuing the cursor).
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "data/shard.h"

namespace dm {

struct PackedSamplerOptions {
  int64_t batch_size = 1;        // B rows per batch (per rank)
  int64_t seq_len = 256;         // T positions per row
  uint64_t seed = 0;
  bool shuffle = true;           // false: documents in dataset order every epoch
  int64_t lookahead_documents = 64;
  bool split_short_documents = false;
  int32_t pad_token = 0;         // input id of padding positions (their targets are −1)
  double replay_fraction = 0.0;  // in [0, 1]; the two-source constructor's replay weight
  bool stratified_mixture = true; // false: a seeded coin per row picks its source
  int rank = 0, world_size = 1;
};

struct PackedBatch {
  int64_t batch_size = 0, seq_len = 0;
  std::vector<int64_t> tokens;         // [B, T]
  std::vector<int64_t> targets;        // [B, T]; −1 = no target (document end, padding)
  std::vector<int32_t> doc_start;      // [B·T]; row index of the first token of t's document
  std::vector<int32_t> row_source;     // [B]; index of the source the row was packed from
  int64_t num_targets() const;         // positions with a target (what the loss averages over)
};

// Packing cursor of one source (public for tests and logging).
struct PackingCursor {
  uint64_t epoch = 0;
  uint64_t position = 0;         // first not-yet-used index into this epoch's document order
  uint64_t head_offset = 0;      // tokens of the document at `position` already emitted (split)
  std::vector<uint64_t> taken_ahead;  // sorted positions ≥ `position` already placed (lookahead)
};

// One source of a mixture and its share of the rows (weights are normalised; 0 = unused).
struct SamplerSource {
  std::shared_ptr<const TokenDataset> data;
  double weight = 1.0;
};

class PackedSampler {
 public:
  PackedSampler(std::vector<SamplerSource> sources, const PackedSamplerOptions& options);
  // Two sources: primary with weight 1 − replay_fraction, replay (if any) with replay_fraction.
  PackedSampler(std::shared_ptr<const TokenDataset> primary, const PackedSamplerOptions& options,
                std::shared_ptr<const TokenDataset> replay = nullptr);

  PackedBatch next_batch();
  void next_batch(PackedBatch& out);  // reuses out's buffers

  nlohmann::json state_json() const;
  // Throws dm::Error if the state is malformed or was made for different datasets.
  void restore(const nlohmann::json& state);

  const PackedSamplerOptions& options() const { return options_; }
  // Changes B / T / replay fraction between batches (e.g. at a stage transition).
  void set_batch_shape(int64_t batch_size, int64_t seq_len);
  void set_replay_fraction(double fraction);          // two-source form: weights {1 − f, f}
  void set_source_weights(const std::vector<double>& weights);
  int num_sources() const { return int(sources_.size()); }
  uint64_t epoch() const { return sources_[0].cursor.epoch; }
  uint64_t rows_emitted() const { return rows_emitted_; }  // global rows, all ranks

 private:
  struct Source {
    std::shared_ptr<const TokenDataset> data;
    uint64_t seed_tag = 0;
    int64_t quota = 0;   // weight in integer units (kMixtureUnits = weight 1)
    int64_t credit = 0;  // smooth weighted round-robin credit
    PackingCursor cursor;
    std::vector<uint32_t> order;  // document order of cursor.epoch
  };
  // Segment of a row: `length` tokens of document `doc` from `offset`; doc < 0 is padding.
  struct RowSegment {
    int64_t doc, offset, length;
  };
  int pick_source();
  void build_order(Source& s) const;
  void skip_used_positions(Source& s) const;
  void pack_row(Source& s, int64_t row_tokens, std::vector<RowSegment>& segments) const;
  void write_row(const Source& s, const std::vector<RowSegment>& segments, int64_t row,
                 PackedBatch& out) const;

  PackedSamplerOptions options_;
  std::vector<Source> sources_;
  uint64_t mix_rng_state_ = 0;
  uint64_t rows_emitted_ = 0;
};

}  // namespace dm
