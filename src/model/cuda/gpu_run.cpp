// DeviceWeights (bf16 mirror of the host arena + packed fp32 copies of the element-wise
// parameters) and the dense linear helper.
#include "model/cuda/gpu_run.h"

#include <algorithm>
#include <vector>

#include "core/error.h"

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

}  // namespace

DeviceWeights::DeviceWeights(const ModelWeights& host)
    : host_(host),
      numel_(arena_numel(host)),
      f32_ranges_(f32_ranges_of(host)),
      f32_numel_(f32_total(host)),
      arena_(size_t(arena_numel(host)) * sizeof(uint16_t) + 256 +
             size_t(f32_total(host)) * sizeof(float)) {
  bf16_ = arena_.alloc<uint16_t>(size_t(numel_));
  f32_ = arena_.alloc<float>(size_t(f32_numel_));
  sync_from_host();
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
  // Round on the host in slabs (the host arena is fp32); one staging buffer per call.
  const int64_t slab = int64_t(1) << 22;
  std::vector<uint16_t> staging(size_t(std::min(slab, numel_)));
  for (int64_t s = 0; s < numel_; s += slab) {
    const int64_t n = std::min(slab, numel_ - s);
    for (int64_t i = 0; i < n; ++i) staging[size_t(i)] = float_to_bf16(base[s + i]);
    copy_to_device(bf16_ + s, staging.data(), size_t(n) * sizeof(uint16_t));
  }
}

void linear(GpuRun& run, const uint16_t* x, const uint16_t* W, int64_t N, int64_t in, int64_t out,
            void* y, GemmOutType y_type, float beta) {
  run.gemm.gemm_bf16(false, true, N, out, in, 1.0f, x, in, W, in, beta, y, y_type, out,
                     run.stream);
}

}  // namespace dm::cuda
