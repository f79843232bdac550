// DeviceWeights (bf16 mirror of the host arena + packed fp32 copies of the element-wise
// parameters) and the dense linear helper.
#include "model/cuda/gpu_run.h"

#include <algorithm>
#include <iterator>
#include <vector>

#include "core/error.h"
#include "ops/cuda/gemv.h"
#include "ops/cuda/random_fill.h"

namespace dm::cuda {

namespace {
// Parameters kept in fp32 as well: the ones read element-wise (not the N(0,σ) matrices).
bool needs_f32(const ParamEntry& e) {
  const bool matrix = e.init == ParamInit::Normal || e.init == ParamInit::NormalOut ||
                      e.init == ParamInit::Router;
  return !matrix;
}
int64_t arena_numel(const ModelWeights& w) {
  // Parameters are laid out back to back from arena_base(); the mirror spans the last one's end.
  int64_t end = 0;
  for (const auto& e : w.params) end = std::max(end, w.offset_of(e.data) + e.numel());
  return end;
}

std::vector<DeviceWeights::F32Range> f32_ranges_of(const ModelWeights& w) {
  std::vector<DeviceWeights::F32Range> r;
  int64_t packed = 0;
  for (const auto& e : w.params)
    if (needs_f32(e)) {
      const int64_t b = w.offset_of(e.data);
      r.push_back({b, b + e.numel(), packed});
      packed += e.numel();
    }
  std::sort(r.begin(), r.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
  return r;
}
int64_t f32_total(const ModelWeights& w) {
  int64_t total = 0;
  for (const auto& e : w.params)
    if (needs_f32(e)) total += e.numel();
  return total;
}

// The fp32 mode's one range: the whole arena, packed at its own offsets.
std::vector<DeviceWeights::F32Range> whole_arena(const ModelWeights& w) {
  return {DeviceWeights::F32Range{0, arena_numel(w), 0}};
}

}  // namespace

DeviceWeights::DeviceWeights(const ModelWeights& host, WeightPrecision precision)
    : host_(host),
      numel_(arena_numel(host)),
      f32_ranges_(precision == WeightPrecision::F32 ? whole_arena(host) : f32_ranges_of(host)),
      f32_numel_(precision == WeightPrecision::F32 ? arena_numel(host) : f32_total(host)),
      arena_(
          (precision == WeightPrecision::F32 ? 0 : size_t(arena_numel(host)) * sizeof(uint16_t)) +
          256 + size_t(f32_numel_) * sizeof(float)) {
  if (precision == WeightPrecision::Bf16) bf16_ = arena_.alloc<uint16_t>(size_t(numel_));
  f32_ = arena_.alloc<float>(size_t(f32_numel_));
  sync_from_host();
}

DeviceWeights::DeviceWeights(ModelWeights& host, RandomInit init)
    : host_(host),
      numel_(arena_numel(host)),
      f32_ranges_(f32_ranges_of(host)),
      f32_numel_(f32_total(host)),
      arena_(size_t(arena_numel(host)) * sizeof(uint16_t) + 256 +
             size_t(f32_total(host)) * sizeof(float)) {
  bf16_ = arena_.alloc<uint16_t>(size_t(numel_));
  f32_ = arena_.alloc<float>(size_t(f32_numel_));
  if (numel_ == 0) return;
  // Zero first so the alignment gaps between parameters hold defined bytes (as after
  // sync_from_host); one memset of the whole allocation, ~2 bytes per parameter.
  fill_zero(bf16_, size_t(numel_) * sizeof(uint16_t));
  // Matrices: one launch per run of adjacent parameters with the same σ (a layer's stacked
  // experts [E, F, ℓ] are one run per projection). The counter is the host arena offset, so an
  // element's value does not depend on how the runs are grouped.
  const ModelConfig& c = host.cfg;
  int64_t run_begin = 0, run_end = 0;
  float run_std = 0.0f;
  auto flush = [&] {
    if (run_end > run_begin)
      random_normal_bf16(bf16_ + run_begin, run_end - run_begin, run_std, init.seed,
                         uint64_t(run_begin));
  };
  for (const ParamEntry& e : host.params) {
    if (needs_f32(e)) continue;
    const int64_t b = host.offset_of(e.data);
    const float sd = param_init_std(c, e.init, e.shape);
    if (b == run_end && sd == run_std && run_end > run_begin) {
      run_end = b + e.numel();
      continue;
    }
    flush();
    run_begin = b;
    run_end = b + e.numel();
    run_std = sd;
  }
  flush();
  check_last_error("DeviceWeights random init (matrices)");
  // Element-wise parameters: host rules, then both mirrors (upload_param synchronises first).
  weights_init_elementwise(host, init.seed);
  for (const ParamEntry& e : host.params)
    if (needs_f32(e)) upload_param(e.data, e.numel());
  synchronize();
  check_last_error("DeviceWeights random init");
}

const uint16_t* DeviceWeights::bf16(const float* host_view) const {
  DM_CHECK(bf16_ != nullptr,
           "DeviceWeights: fp32 weights have no bf16 copy (the fp32 GPU mode "
           "runs the fp32 layer paths)");
  return bf16_ + offset(host_view);
}

const float* DeviceWeights::f32(const float* host_view) const {
  const int64_t o = offset(host_view);
  auto it = std::upper_bound(f32_ranges_.begin(), f32_ranges_.end(), o,
                             [](int64_t v, const F32Range& r) { return v < r.begin; });
  DM_CHECK(it != f32_ranges_.begin() && o < std::prev(it)->end,
           "DeviceWeights: no fp32 copy of this parameter (a matrix: use bf16())");
  return f32_ + std::prev(it)->packed + (o - std::prev(it)->begin);
}

int64_t DeviceWeights::offset(const float* p) const {
  const int64_t o = host_.offset_of(p);
  DM_CHECK(p != nullptr && o >= 0 && o < numel_, "DeviceWeights: pointer outside the weights");
  return o;
}

void DeviceWeights::sync_from_host() {
  if (numel_ == 0) return;
  const float* base = static_cast<const float*>(host_.arena_base());
  for (const F32Range& r : f32_ranges_)
    copy_to_device(f32_ + r.packed, base + r.begin, size_t(r.end - r.begin) * sizeof(float));
  if (!bf16_) return;  // the fp32 mode: the range above was the whole arena
  // Round on the host in slabs (the host arena is fp32); one staging buffer per call.
  const int64_t slab = int64_t(1) << 22;
  std::vector<uint16_t> staging(size_t(std::min(slab, numel_)));
  for (int64_t s = 0; s < numel_; s += slab) {
    const int64_t n = std::min(slab, numel_ - s);
    for (int64_t i = 0; i < n; ++i) staging[size_t(i)] = float_to_bf16(base[s + i]);
    copy_to_device(bf16_ + s, staging.data(), size_t(n) * sizeof(uint16_t));
  }
}

DeviceParamArena::DeviceParamArena(const ModelWeights& host)
    : host_(host), numel_(arena_numel(host)), arena_(size_t(arena_numel(host)) * sizeof(float) + 256) {
  data_ = arena_.alloc<float>(size_t(numel_));
  zero();
}

float* DeviceParamArena::at(const float* host_view) const {
  const int64_t o = host_.offset_of(host_view);
  DM_CHECK(host_view != nullptr && o >= 0 && o < numel_,
           "DeviceParamArena: pointer outside the weights");
  return data_ + o;
}

void DeviceParamArena::zero(CUstream_st* stream) {
  if (numel_ > 0) fill_zero_async(data_, size_t(numel_) * sizeof(float), stream);
  pending_.assign(store_first_.size(), false);
}

void DeviceParamArena::add_store_first(const float* host_view, int64_t n) {
  const int64_t begin = at(host_view) - data_;
  DM_CHECK(n > 0 && begin + n <= numel_, "DeviceParamArena::add_store_first: range outside");
  const StoreFirstRange r{begin, begin + n};
  auto it = std::lower_bound(
      store_first_.begin(), store_first_.end(), r,
      [](const StoreFirstRange& a, const StoreFirstRange& b) { return a.begin < b.begin; });
  DM_CHECK((it == store_first_.end() || r.end <= it->begin) &&
               (it == store_first_.begin() || std::prev(it)->end <= r.begin),
           "DeviceParamArena::add_store_first: overlapping ranges");
  store_first_.insert(it, r);
  pending_.assign(store_first_.size(), false);
  gaps_.reset();
}

void DeviceParamArena::zero_deferred(CUstream_st* stream) {
  if (!gaps_) {  // the gaps between the store-first ranges, as one launch's tile table
    std::vector<cuda::ZeroRange> gaps;
    int64_t from = 0;
    for (const StoreFirstRange& r : store_first_) {
      if (r.begin > from) gaps.push_back({from, r.begin});
      from = r.end;
    }
    if (numel_ > from) gaps.push_back({from, numel_});
    gaps_ = std::make_unique<cuda::ZeroRangesPlan>(gaps);
  }
  cuda::zero_ranges(*gaps_, data_, stream);
  pending_.assign(store_first_.size(), true);
}

bool DeviceParamArena::take_pending(const float* host_view) const {
  const int64_t begin = at(host_view) - data_;
  for (size_t i = 0; i < store_first_.size(); ++i)
    if (store_first_[i].begin == begin) {
      const bool was = pending_[i];
      pending_[i] = false;
      return was;
    }
  return false;  // not a store-first range: always accumulate
}

void DeviceParamArena::settle(CUstream_st* stream) const {
  for (size_t i = 0; i < store_first_.size(); ++i)
    if (pending_[i]) {
      const StoreFirstRange& r = store_first_[i];
      fill_zero_async(data_ + r.begin, size_t(r.end - r.begin) * sizeof(float), stream);
      pending_[i] = false;
    }
}

void DeviceParamArena::download(ModelWeights& dst) const {
  DM_CHECK(arena_numel(dst) == numel_, "DeviceParamArena::download: layout mismatch");
  synchronize();
  copy_to_host(const_cast<void*>(dst.arena_base()), data_, size_t(numel_) * sizeof(float));
}

void DeviceParamArena::upload(const ModelWeights& src) {
  DM_CHECK(arena_numel(src) == numel_, "DeviceParamArena::upload: layout mismatch");
  synchronize();
  copy_to_device(data_, src.arena_base(), size_t(numel_) * sizeof(float));
}

void DeviceWeights::refresh_f32_from_master(const float* master, CUstream_st* stream) {
  for (const F32Range& r : f32_ranges_)
    copy_device_to_device_async(f32_ + r.packed, master + r.begin,
                                size_t(r.end - r.begin) * sizeof(float), stream);
}

void DeviceWeights::upload_param(const float* host_view, int64_t n, CUstream_st* stream) {
  const int64_t o = offset(host_view);
  DM_CHECK(n >= 0 && o + n <= numel_, "DeviceWeights::upload_param: range outside the weights");
  stream_synchronize(stream);  // the staging copies below are synchronous
  if (bf16_) {
    std::vector<uint16_t> staging(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) staging[size_t(i)] = float_to_bf16(host_view[i]);
    copy_to_device(bf16_ + o, staging.data(), size_t(n) * sizeof(uint16_t));
  }
  for (const F32Range& r : f32_ranges_) {  // the fp32 copy, where the parameter has one
    const int64_t b = std::max(o, r.begin), e = std::min(o + n, r.end);
    if (b < e)
      copy_to_device(f32_ + r.packed + (b - r.begin), host_view + (b - o),
                     size_t(e - b) * sizeof(float));
  }
}

void linear_backward(GpuRun& run, const uint16_t* x, const uint16_t* W, const uint16_t* dy,
                     int64_t N, int64_t in, int64_t out, void* dx, GemmOutType dx_type,
                     float dx_beta, const DeviceGrads& grads, const float* W_host) {
  // dx[N, in] = dy[N, out]·W[out, in];  dW[out, in] = beta·dW + dy[N, out]ᵀ·x[N, in], beta 0 on
  // the slot's first product since zero_deferred (store-first), else 1.
  if (dx)
    run.gemm.gemm_bf16(false, false, N, in, out, 1.0f, dy, out, W, in, dx_beta, dx, dx_type, in,
                       run.stream);
  if (W_host) weight_gradient(run, grads, W_host, dy, out, x, N, in, out);
}

void weight_gradient(GpuRun& run, const DeviceGrads& grads, const float* W_host, const uint16_t* dy,
                     int64_t ldy, const uint16_t* x, int64_t N, int64_t in, int64_t rows) {
  const float beta = grads.take_pending(W_host) ? 0.0f : 1.0f;
  run.gemm.gemm_bf16(true, false, rows, in, N, 1.0f, dy, ldy, x, in, beta, grads.at(W_host),
                     GemmOutType::F32, in, run.stream);
}

void stacked_weight_gradients(GpuRun& run, const DeviceGrads& grads, const float* const* stacked,
                              const int64_t* rows, int count, const uint16_t* dy, int64_t ldy,
                              const uint16_t* x, int64_t N, int64_t in) {
  constexpr int kMaxStacked = 8;
  DM_CHECK(count >= 1 && count <= kMaxStacked, "stacked_weight_gradients: ", count, " matrices");
  bool store[kMaxStacked];
  int64_t total = 0;
  for (int i = 0; i < count; ++i) {
    DM_CHECK(grads.at(stacked[i]) == grads.at(stacked[0]) + total * in,
             "stacked_weight_gradients: matrix ", i, "'s gradient slot does not follow the last");
    store[i] = grads.take_pending(stacked[i]);
    total += rows[i];
  }
  if (std::all_of(store, store + count, [&](bool s) { return s == store[0]; })) {
    run.gemm.gemm_bf16(true, false, total, in, N, 1.0f, dy, ldy, x, in, store[0] ? 0.0f : 1.0f,
                       grads.at(stacked[0]), GemmOutType::F32, in, run.stream);
    return;
  }
  int64_t col = 0;
  for (int i = 0; i < count; col += rows[i], ++i)
    run.gemm.gemm_bf16(true, false, rows[i], in, N, 1.0f, dy + col, ldy, x, in,
                       store[i] ? 0.0f : 1.0f, grads.at(stacked[i]), GemmOutType::F32, in,
                       run.stream);
}

void linear(GpuRun& run, const uint16_t* x, const uint16_t* W, int64_t N, int64_t in, int64_t out,
            void* y, GemmOutType y_type, float beta) {
  run.gemm.gemm_bf16(false, true, N, out, in, 1.0f, x, in, W, in, beta, y, y_type, out,
                     run.stream);
}

void linear(GpuRun& run, const float* x, const float* W, int64_t N, int64_t in, int64_t out,
            void* y, GemmOutType y_type, float beta) {
  DM_CHECK(y_type == GemmOutType::F32, "linear (fp32): the output of an fp32 GEMM is fp32");
  run.gemm.gemm_f32(false, true, N, out, in, 1.0f, x, in, W, in, beta, static_cast<float*>(y), out,
                    run.stream);
}

void linear_plus(GpuRun& run, const uint16_t* x, const uint16_t* W, int64_t N, int64_t in,
                 int64_t out, float* y, const float* residual) {
  run.gemm.gemm_bf16(false, true, N, out, in, 1.0f, x, in, W, in, residual ? 1.0f : 0.0f, y,
                     GemmOutType::F32, out, run.stream, residual);
}

void linear_plus(GpuRun& run, const float* x, const float* W, int64_t N, int64_t in, int64_t out,
                 float* y, const float* residual) {
  if (residual && residual != y)
    copy_device_to_device_async(y, residual, size_t(N) * size_t(out) * sizeof(float), run.stream);
  linear(run, x, W, N, in, out, y, GemmOutType::F32, residual ? 1.0f : 0.0f);
}

void linear_many(GpuRun& run, const uint16_t* x, int64_t N, int64_t in, const LinearOut* outs,
                 int count) {
  DM_CHECK(count >= 0 && count <= kGemvMaxOutputs, "linear_many: ", count, " outputs");
  bool one_launch = N > 0;
  for (int i = 0; i < count && one_launch; ++i)
    one_launch = gemv_applies(N, in, x, in, outs[i].W, in);
  if (!one_launch) {
    for (int i = 0; i < count; ++i)
      linear(run, x, outs[i].W, N, in, outs[i].out, outs[i].y, outs[i].y_type);
    return;
  }
  GemvOutput g[kGemvMaxOutputs];
  for (int i = 0; i < count; ++i)
    g[i] = GemvOutput{outs[i].W, in, outs[i].out, outs[i].y, outs[i].y_type, outs[i].out};
  launch_gemv_bf16_many(N, in, x, in, g, count, run.stream);
}

}  // namespace dm::cuda
