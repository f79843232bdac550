#include "data/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "data/random.h"

namespace dm {

int64_t PackedBatch::num_targets() const {
  int64_t n = 0;
  for (int64_t t : targets) n += t >= 0;
  return n;
}

namespace {
constexpr uint64_t kSamplerMixSeedTag = 0x6d69782d726f7773ull;   // "mix-rows"
constexpr uint64_t kSamplerSourceSeedTag = 0x736f757263652d30ull;  // "source-0"

// nlohmann stores a value assigned from a signed integer as signed, parsed text as unsigned.
bool json_is_non_negative_integer(const nlohmann::json& v) {
  return v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0);
}
}  // namespace

namespace {
constexpr int64_t kMixtureUnits = int64_t(1) << 30;  // integer weight of a source of weight 1
}  // namespace

PackedSampler::PackedSampler(std::vector<SamplerSource> sources, const PackedSamplerOptions& options)
    : options_(options) {
  DM_CHECK(!sources.empty(), "packed sampler: no dataset");
  DM_CHECK(options.world_size >= 1 && options.rank >= 0 && options.rank < options.world_size,
           "packed sampler: rank ", options.rank, " outside world size ", options.world_size);
  DM_CHECK(options.lookahead_documents >= 0, "packed sampler: lookahead_documents must be >= 0");
  std::vector<double> weights;
  for (size_t i = 0; i < sources.size(); ++i) {
    DM_CHECK(sources[i].data != nullptr, "packed sampler: source ", i, " has no dataset");
    sources_.push_back({std::move(sources[i].data), kSamplerSourceSeedTag + i, 0, 0, {}, {}});
    weights.push_back(sources[i].weight);
  }
  set_batch_shape(options.batch_size, options.seq_len);
  set_source_weights(weights);
  for (auto& s : sources_) {
    DM_CHECK(s.data->num_tokens() > 0, "packed sampler: dataset has no tokens");
    DM_CHECK(s.data->num_documents() < (int64_t(1) << 32), "packed sampler: more than 2^32 documents");
    build_order(s);
  }
  mix_rng_state_ = seed_mix(options_.seed, kSamplerMixSeedTag);
}

PackedSampler::PackedSampler(std::shared_ptr<const TokenDataset> primary,
                             const PackedSamplerOptions& options,
                             std::shared_ptr<const TokenDataset> replay)
    : PackedSampler(
          replay ? std::vector<SamplerSource>{{std::move(primary), 1.0 - options.replay_fraction},
                                              {std::move(replay), options.replay_fraction}}
                 : std::vector<SamplerSource>{{std::move(primary), 1.0}},
          options) {
  DM_CHECK(options.replay_fraction >= 0.0 && options.replay_fraction <= 1.0,
           "packed sampler: replay fraction ", options.replay_fraction, " outside [0, 1]");
  DM_CHECK(options.replay_fraction == 0.0 || sources_.size() != 1, "packed sampler: replay fraction ",
           options.replay_fraction, " needs a replay dataset");
}

void PackedSampler::set_batch_shape(int64_t batch_size, int64_t seq_len) {
  DM_CHECK(batch_size >= 1 && seq_len >= 1, "packed sampler: batch size ", batch_size,
           " and sequence length ", seq_len, " must be >= 1");
  options_.batch_size = batch_size;
  options_.seq_len = seq_len;
}

void PackedSampler::set_replay_fraction(double fraction) {
  DM_CHECK(fraction >= 0.0 && fraction <= 1.0, "packed sampler: replay fraction ", fraction,
           " outside [0, 1]");
  DM_CHECK(fraction == 0.0 || sources_.size() == 2, "packed sampler: replay fraction ", fraction,
           " needs a replay dataset");
  options_.replay_fraction = fraction;
  if (sources_.size() == 2) set_source_weights({1.0 - fraction, fraction});
}

void PackedSampler::set_source_weights(const std::vector<double>& weights) {
  DM_CHECK(weights.size() == sources_.size(), "packed sampler: ", weights.size(),
           " weights for ", sources_.size(), " sources");
  double total = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    DM_CHECK(std::isfinite(weights[i]) && weights[i] >= 0, "packed sampler: source ", i, " weight ",
             weights[i], " must be finite and >= 0");
    total += weights[i];
  }
  DM_CHECK(total > 0, "packed sampler: every source weight is 0");
  for (size_t i = 0; i < weights.size(); ++i) {
    sources_[i].quota = int64_t(std::llround(weights[i] / total * double(kMixtureUnits)));
    sources_[i].credit = 0;
  }
}

// Smooth weighted round-robin: every source earns its quota, the richest is picked and pays the
// total. Over any window the picks of a source differ from window·weight by less than one.
int PackedSampler::pick_source() {
  if (sources_.size() == 1) return 0;
  if (!options_.stratified_mixture) {
    DataRng coin(mix_rng_state_);
    double u = coin.uniform_double() * double(kMixtureUnits);
    mix_rng_state_ = coin.state();
    for (size_t i = 0; i < sources_.size(); ++i) {
      if (sources_[i].quota > 0 && u < double(sources_[i].quota)) return int(i);
      u -= double(sources_[i].quota);
    }
    for (size_t i = sources_.size(); i-- > 0;)
      if (sources_[i].quota > 0) return int(i);
  }
  int64_t total = 0;
  int best = -1;
  for (size_t i = 0; i < sources_.size(); ++i) {
    sources_[i].credit += sources_[i].quota;
    total += sources_[i].quota;
    if (sources_[i].quota > 0 && (best < 0 || sources_[i].credit > sources_[size_t(best)].credit))
      best = int(i);
  }
  sources_[size_t(best)].credit -= total;
  return best;
}

void PackedSampler::build_order(Source& s) const {
  s.order.resize(size_t(s.data->num_documents()));
  std::iota(s.order.begin(), s.order.end(), 0u);
  if (options_.shuffle) {
    DataRng rng(seed_mix(options_.seed, s.seed_tag, s.cursor.epoch));
    rng.shuffle(s.order);
  }
}

// Moves the cursor to the next document that is neither empty nor already placed, rolling over
// to the next epoch at the end of the order.
void PackedSampler::skip_used_positions(Source& s) const {
  PackingCursor& c = s.cursor;
  while (true) {
    while (!c.taken_ahead.empty() && c.taken_ahead.front() <= c.position) {
      if (c.taken_ahead.front() == c.position) ++c.position;
      c.taken_ahead.erase(c.taken_ahead.begin());
    }
    if (c.position >= s.order.size()) {
      ++c.epoch;
      c.position = 0;
      c.head_offset = 0;
      c.taken_ahead.clear();
      build_order(s);
      continue;
    }
    if (s.data->document_length(s.order[c.position]) == 0) {
      ++c.position;
      continue;
    }
    return;
  }
}

void PackedSampler::pack_row(Source& s, int64_t row_tokens, std::vector<RowSegment>& segments) const {
  segments.clear();
  PackingCursor& c = s.cursor;
  int64_t room = row_tokens;
  while (room > 0) {
    skip_used_positions(s);
    const int64_t doc = s.order[c.position];
    const int64_t length = s.data->document_length(doc);
    const int64_t remaining = length - int64_t(c.head_offset);
    if (remaining <= room) {
      segments.push_back({doc, int64_t(c.head_offset), remaining});
      room -= remaining;
      ++c.position;
      c.head_offset = 0;
      continue;
    }
    // The head does not fit. A fresh head looks ahead for a document that does; a split
    // document's continuation never waits (its pieces stay in consecutive rows).
    if (c.head_offset == 0 && options_.lookahead_documents > 0) {
      int64_t checked = 0;
      uint64_t fit = 0;
      for (uint64_t p = c.position + 1; p < s.order.size() && checked < options_.lookahead_documents; ++p) {
        if (std::binary_search(c.taken_ahead.begin(), c.taken_ahead.end(), p)) continue;
        ++checked;
        const int64_t l = s.data->document_length(s.order[p]);
        if (l > 0 && l <= room) {
          fit = p;
          break;
        }
      }
      if (fit != 0) {
        const int64_t l = s.data->document_length(s.order[fit]);
        segments.push_back({int64_t(s.order[fit]), 0, l});
        c.taken_ahead.insert(std::upper_bound(c.taken_ahead.begin(), c.taken_ahead.end(), fit), fit);
        room -= l;
        continue;
      }
    }
    if (length > row_tokens || options_.split_short_documents) {
      // Split at the row end; the next row repeats this piece's last token as its first input.
      segments.push_back({doc, int64_t(c.head_offset), room});
      c.head_offset += uint64_t(room - 1);
    } else {
      segments.push_back({-1, 0, room});  // padding: the short head starts the next row whole
    }
    room = 0;
  }
}

void PackedSampler::write_row(const Source& s, const std::vector<RowSegment>& segments, int64_t row,
                              PackedBatch& out) const {
  const int64_t T = options_.seq_len;
  int64_t* tokens = out.tokens.data() + row * T;
  int64_t* targets = out.targets.data() + row * T;
  int32_t* doc_start = out.doc_start.data() + row * T;
  int64_t pos = 0;  // row position of the segment's first token (the row has T+1 positions)
  for (size_t k = 0; k < segments.size(); ++k) {
    const RowSegment& seg = segments[k];
    const bool pad = seg.doc < 0;
    std::span<const uint32_t> ids;
    if (!pad) ids = s.data->document(seg.doc).subspan(size_t(seg.offset), size_t(seg.length));
    for (int64_t i = 0; i < seg.length; ++i) {
      const int64_t t = pos + i;
      if (t >= T) break;  // position T is only the last target
      tokens[t] = pad ? options_.pad_token : int64_t(ids[size_t(i)]);
      targets[t] = (!pad && i + 1 < seg.length) ? int64_t(ids[size_t(i + 1)]) : -1;
      doc_start[t] = int32_t(pos);
    }
    pos += seg.length;
  }
}

void PackedSampler::next_batch(PackedBatch& out) {
  const int64_t B = options_.batch_size, T = options_.seq_len;
  out.batch_size = B;
  out.seq_len = T;
  out.tokens.assign(size_t(B * T), 0);
  out.targets.assign(size_t(B * T), -1);
  out.doc_start.assign(size_t(B * T), 0);
  out.row_source.assign(size_t(B), 0);
  std::vector<RowSegment> segments;
  for (int64_t b = 0; b < B;) {
    const int source = pick_source();
    Source& s = sources_[size_t(source)];
    pack_row(s, T + 1, segments);
    const bool mine = rows_emitted_ % uint64_t(options_.world_size) == uint64_t(options_.rank);
    ++rows_emitted_;
    if (!mine) continue;
    write_row(s, segments, b, out);
    out.row_source[size_t(b)] = source;
    ++b;
  }
}

PackedBatch PackedSampler::next_batch() {
  PackedBatch b;
  next_batch(b);
  return b;
}

// ---------------------------------------------------------------------------------------------
nlohmann::json PackedSampler::state_json() const {
  nlohmann::json j;
  j["format"] = "deltamoe-packed-sampler";
  j["version"] = 2;
  j["seed"] = options_.seed;
  j["rows_emitted"] = rows_emitted_;
  j["mix_rng_state"] = mix_rng_state_;
  j["sources"] = nlohmann::json::array();
  for (const auto& s : sources_) {
    j["sources"].push_back({{"num_documents", s.data->num_documents()},
                            {"num_tokens", s.data->num_tokens()},
                            {"epoch", s.cursor.epoch},
                            {"position", s.cursor.position},
                            {"head_offset", s.cursor.head_offset},
                            {"taken_ahead", s.cursor.taken_ahead},
                            {"credit", s.credit}});
  }
  return j;
}

void PackedSampler::restore(const nlohmann::json& j) {
  const char* what = "packed sampler state";
  auto u64_field = [&](const nlohmann::json& obj, const char* name, const std::string& where) {
    DM_CHECK(obj.is_object() && obj.contains(name) && json_is_non_negative_integer(obj.at(name)), what,
             ": field '", where, name, "' must be a non-negative integer");
    return obj.at(name).get<uint64_t>();
  };
  DM_CHECK(j.is_object() && j.value("format", "") == "deltamoe-packed-sampler", what,
           ": field 'format' must be \"deltamoe-packed-sampler\"");
  const uint64_t version = u64_field(j, "version", "");
  DM_CHECK(version == 1 || version == 2, what, ": field 'version': only 1 and 2 are supported");
  DM_CHECK(j.contains("sources") && j["sources"].is_array() && j["sources"].size() == sources_.size(),
           what, ": field 'sources' must list ", sources_.size(), " source(s)");
  std::vector<PackingCursor> cursors;
  std::vector<int64_t> credits(sources_.size(), 0);
  for (size_t i = 0; i < sources_.size(); ++i) {
    const auto& js = j["sources"][i];
    const std::string where = str_cat("sources[", i, "].");
    DM_CHECK(int64_t(u64_field(js, "num_documents", where)) == sources_[i].data->num_documents() &&
                 int64_t(u64_field(js, "num_tokens", where)) == sources_[i].data->num_tokens(),
             what, ": source ", i, " was saved for a dataset of ", js["num_documents"], " documents / ",
             js["num_tokens"], " tokens, this one has ", sources_[i].data->num_documents(), " / ",
             sources_[i].data->num_tokens());
    PackingCursor c;
    c.epoch = u64_field(js, "epoch", where);
    c.position = u64_field(js, "position", where);
    c.head_offset = u64_field(js, "head_offset", where);
    DM_CHECK(c.position <= uint64_t(sources_[i].data->num_documents()), what, ": field '", where,
             "position' past the number of documents");
    DM_CHECK(js.contains("taken_ahead") && js["taken_ahead"].is_array(), what, ": field '", where,
             "taken_ahead' must be an array");
    for (const auto& p : js["taken_ahead"]) {
      DM_CHECK(json_is_non_negative_integer(p) && p.get<uint64_t>() >= c.position &&
                   p.get<uint64_t>() < uint64_t(sources_[i].data->num_documents()) &&
                   (c.taken_ahead.empty() || p.get<uint64_t>() > c.taken_ahead.back()),
               what, ": field '", where, "taken_ahead' must hold increasing positions from 'position' on");
      c.taken_ahead.push_back(p.get<uint64_t>());
    }
    if (version >= 2) {
      DM_CHECK(js.contains("credit") && js["credit"].is_number_integer(), what, ": field '", where,
               "credit' must be an integer");
      credits[i] = js["credit"].get<int64_t>();
      DM_CHECK(std::abs(credits[i]) <= 2 * kMixtureUnits, what, ": field '", where,
               "credit' out of range");
    }
    cursors.push_back(std::move(c));
  }
  options_.seed = u64_field(j, "seed", "");
  rows_emitted_ = u64_field(j, "rows_emitted", "");
  mix_rng_state_ = u64_field(j, "mix_rng_state", "");
  for (size_t i = 0; i < sources_.size(); ++i) {
    sources_[i].cursor = std::move(cursors[i]);
    sources_[i].credit = credits[i];
    build_order(sources_[i]);
    if (sources_[i].cursor.position < sources_[i].order.size())
      DM_CHECK(sources_[i].cursor.head_offset <
                   uint64_t(std::max<int64_t>(1, sources_[i].data->document_length(
                                                     sources_[i].order[sources_[i].cursor.position]))),
               what, ": field 'sources[", i, "].head_offset' past the end of its document");
  }
}

}  // namespace dm
