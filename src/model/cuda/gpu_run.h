// What a model forward on the GPU shares across its layers (SPEC §5 GPU path): the device copy of
// the weights and the per-run resources (cuBLAS handles, one scratch arena, the stream).
//
// DeviceWeights mirrors the host weight arena as bf16 (GEMM operands, the embedding table) at the
// SAME element offsets as the host arena, and keeps an fp32 copy of the parameters read
// element-wise (norm weights, gates, biases, A_log, dt_bias, short-conv kernels, AttnRes
// pseudo-queries: everything but the N(0,σ)-initialised matrices), packed. A layer keeps using
// the host views of model/weights.h (LayerWeights::kda.q_proj …) and maps each to its device twin
// with bf16(p) / f32(p); f32() of a matrix is an error. Weights cost 2 bytes per parameter plus 4
// per element-wise one; one cudaMalloc for both. The routing bias changes during training:
// sync_from_host() re-uploads everything.
//
// The fp32 GPU mode (WeightPrecision::F32, docs/gpu.md) mirrors EVERY parameter in fp32 instead,
// at the host offsets (4 bytes per parameter, no bf16 copy): f32(p) then takes any parameter and
// bf16(p) is an error. Layers templated on their activation type A read their matrices with
// operand<A>(p), which is bf16(p) for bf16 activations and f32(p) for fp32 ones.
#pragma once
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "model/weights.h"
#include "ops/cuda/device.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/zero_ranges.h"

namespace dm::cuda {

// Selects DeviceWeights' device-side random initialisation.
struct RandomInit {
  uint64_t seed = 1;
};

// bf16: the compute copy of the matrices is bf16 (the default, every fast path); f32: every
// parameter in fp32 (the fp32 GPU mode: inference checked against the CPU float engine).
enum class WeightPrecision : uint8_t { Bf16, F32 };

class DeviceWeights {
 public:
  // One fp32-mirrored parameter: host offsets [begin, end) → packed offset.
  struct F32Range {
    int64_t begin, end, packed;
  };
  explicit DeviceWeights(const ModelWeights& host,
                         WeightPrecision precision = WeightPrecision::Bf16);
  // Random initialisation on the device, for models larger than host memory (bench_cuda_decode;
  // `host` is typically a ReservedWeights layout): each N(0,σ) matrix (σ = param_init_std) is
  // drawn straight into the bf16 mirror by a device kernel, arena element i from a hash of
  // (seed, i) (ops/cuda/random_fill.h); the element-wise parameters are initialised on the host
  // by weights_init_elementwise(host, seed) — WRITTEN into `host`, they are small — and uploaded
  // to both mirrors. The host matrices are never read or written (no loop over the arena), so
  // they stay zero there: never call sync_from_host() on such a mirror. The values follow
  // weights_init's rules but are not weights_init's values (different generators).
  DeviceWeights(ModelWeights& host, RandomInit init);
  // Device twin of a host parameter view (any pointer inside the host arena).
  const uint16_t* bf16(const float* host_view) const;
  const float* f32(const float* host_view) const;
  // The GEMM operand of a matrix for activations of type A (uint16_t: bf16, float: fp32).
  template <typename A>
  const A* operand(const float* host_view) const {
    static_assert(std::is_same_v<A, uint16_t> || std::is_same_v<A, float>);
    if constexpr (std::is_same_v<A, float>)
      return f32(host_view);
    else
      return bf16(host_view);
  }
  WeightPrecision precision() const { return bf16_ ? WeightPrecision::Bf16 : WeightPrecision::F32; }
  const ModelWeights& host() const { return host_; }
  const ModelConfig& config() const { return host_.cfg; }
  void sync_from_host();
  // Training: the optimizer writes the bf16 mirror in place (same offsets as the host arena) and
  // the packed fp32 copies (f32_data()[r.packed + (i − r.begin)] mirrors host element i of range
  // r) in the same pass (GpuOptimizer's AdamW), or refreshes those from the device master weights
  // (host offsets) after an update that does not write them (Muon).
  uint16_t* bf16_data() { return bf16_; }
  float* f32_data() { return f32_; }
  const std::vector<F32Range>& f32_ranges() const { return f32_ranges_; }
  void refresh_f32_from_master(const float* master, CUstream_st* stream = nullptr);
  // Re-uploads one parameter of n elements from its host view into both mirrors (a routing bias
  // Quantile Balancing set on the host).
  void upload_param(const float* host_view, int64_t n, CUstream_st* stream = nullptr);
  size_t bytes() const { return arena_.capacity(); }

 private:
  int64_t offset(const float* p) const;
  const ModelWeights& host_;
  int64_t numel_ = 0;
  std::vector<F32Range> f32_ranges_;  // sorted by begin
  int64_t f32_numel_;
  DeviceArena arena_;
  uint16_t* bf16_ = nullptr;
  float* f32_ = nullptr;
};

// An fp32 tensor on the device at the SAME element offsets as the host weight arena: the device
// twin of a ModelWeights arena. The trainer keeps four: the gradients (DeviceGrads: at(w.q_proj)
// is ∂L/∂q_proj; layers ACCUMULATE into it and the trainer zeroes it once per step), the fp32
// master weights and the two optimizer moments. One cudaMalloc each.
class DeviceParamArena {
 public:
  explicit DeviceParamArena(const ModelWeights& host);
  float* at(const float* host_view) const;
  float* data() const { return data_; }
  int64_t numel() const { return numel_; }
  void zero(CUstream_st* stream = nullptr);

  // Store-first ranges (the gradient arena: the MoE experts' stacked weights, more than half of
  // the parameters, each written by one grouped product a micro-batch). zero_deferred() zeroes
  // every element except these ranges and marks them pending; the first writer of a pending range
  // asks take_pending() (true once, then false until the next zero_deferred) and stores instead
  // of accumulating; settle() zeroes whatever is still pending before anything reads the arena
  // (the norm, the optimizer). This skips the ranges' memset and the first product's read of
  // them. zero() clears every pending mark. The marks are host-side bookkeeping of stream-ordered
  // state, so take_pending and settle are const (the layers get the arena by const reference).
  void add_store_first(const float* host_view, int64_t n);
  void zero_deferred(CUstream_st* stream = nullptr);
  bool take_pending(const float* host_view) const;
  void settle(CUstream_st* stream = nullptr) const;
  // Whole-arena copies to / from a host arena of the same layout (synchronous).
  void download(ModelWeights& dst) const;
  void upload(const ModelWeights& src);

 private:
  struct StoreFirstRange {
    int64_t begin, end;  // element offsets
  };
  const ModelWeights& host_;
  int64_t numel_ = 0;
  DeviceArena arena_;
  float* data_ = nullptr;
  std::vector<StoreFirstRange> store_first_;  // sorted, disjoint
  mutable std::vector<bool> pending_;         // per store_first_ range
  std::unique_ptr<cuda::ZeroRangesPlan> gaps_;  // the rest of the arena, built at first use
};
using DeviceGrads = DeviceParamArena;

// Per-run resources: cuBLAS(Lt) handles + workspace, one scratch arena that layers carve their
// temporaries from inside a DeviceArenaScope, and the stream everything is queued on.
struct GpuRun {
  explicit GpuRun(size_t scratch_bytes, CUstream_st* stream_ = nullptr)
      : scratch(scratch_bytes), stream(stream_) {}
  GemmContext gemm;
  DeviceArena scratch;
  CUstream_st* stream = nullptr;
};

// y[N, out] = x[N, in] · W[out, in]ᵀ (bf16 operands, fp32 accumulate; y bf16 or fp32 per y_type;
// beta = 1 accumulates into an fp32/bf16 y).
void linear(GpuRun& run, const uint16_t* x, const uint16_t* W, int64_t N, int64_t in, int64_t out,
            void* y, GemmOutType y_type, float beta = 0.0f);
// The fp32 GPU mode's linear: x, W, y fp32 (full-precision multiplies, no TF32); y_type must be
// F32 (the argument keeps one call shape for layers templated on their activation type).
void linear(GpuRun& run, const float* x, const float* W, int64_t N, int64_t in, int64_t out,
            void* y, GemmOutType y_type, float beta = 0.0f);
// y[N, out] = residual[N, out] + x·Wᵀ, fp32 y (residual nullable: y = x·Wᵀ). The bf16 path adds
// the residual in the GEMM's epilogue (the residual stream's add without a pass of its own);
// the fp32 mode copies it into y first. y must not alias x; it may alias residual.
void linear_plus(GpuRun& run, const uint16_t* x, const uint16_t* W, int64_t N, int64_t in,
                 int64_t out, float* y, const float* residual);
void linear_plus(GpuRun& run, const float* x, const float* W, int64_t N, int64_t in, int64_t out,
                 float* y, const float* residual);
// What a GEMM writes for activations of type A: bf16 rows, or fp32 in the fp32 mode.
template <typename A>
constexpr GemmOutType activation_out() {
  return std::is_same_v<A, float> ? GemmOutType::F32 : GemmOutType::Bf16;
}

// Several linears of the same x: y_i[N, out_i] = x[N, in]·W_iᵀ (beta 0). At decode sizes
// (N ≤ kGemvMaxRows) one GEMV launch computes them all (ops/cuda/gemv.h); otherwise one GEMM
// each. At most kGemvMaxOutputs outputs.
struct LinearOut {
  const uint16_t* W;  // [out, in] bf16
  int64_t out;
  void* y;            // [N, out]
  GemmOutType y_type;
};
void linear_many(GpuRun& run, const uint16_t* x, int64_t N, int64_t in, const LinearOut* outs,
                 int count);

// Backward of y = x·Wᵀ given dy [N, out] bf16:
//   dx [N, in] (x_type fp32 or bf16) = dy·W, ACCUMULATED when dx_beta = 1 (else written; dx may
//   be nullptr: not wanted);
//   dW [out, in] fp32 = the gradient slot of the host matrix W_host in `grads` += dyᵀ·x, STORED
//   (beta 0) instead when that slot is a pending store-first range (the matrix's first product
//   since zero_deferred: the step neither zeroes it nor reads it back). W_host nullptr: no dW.
void linear_backward(GpuRun& run, const uint16_t* x, const uint16_t* W, const uint16_t* dy,
                     int64_t N, int64_t in, int64_t out, void* dx, GemmOutType dx_type,
                     float dx_beta, const DeviceGrads& grads, const float* W_host);

// The weight-gradient half of linear_backward for a dy held in a wider buffer: dW [rows, in] of
// the host matrix W_host (+)= dy[N, rows]ᵀ·x[N, in], dy's rows ldy elements apart (a column block
// of a joint [dy_a | dy_b] operand); stored instead of added on the slot's first product since
// zero_deferred (take_pending).
void weight_gradient(GpuRun& run, const DeviceGrads& grads, const float* W_host, const uint16_t* dy,
                     int64_t ldy, const uint16_t* x, int64_t N, int64_t in, int64_t rows);

// The gradients of `count` matrices that lie one after another in the weights (and gradient
// slots), stacked[i] of rows[i] rows of `in`, from one dy [N, Σ rows] (row stride ldy) whose
// column blocks are theirs: ONE [Σ rows, in] product when every slot is store-first or every one
// accumulates (take_pending agrees), else one product per matrix.
void stacked_weight_gradients(GpuRun& run, const DeviceGrads& grads, const float* const* stacked,
                              const int64_t* rows, int count, const uint16_t* dy, int64_t ldy,
                              const uint16_t* x, int64_t N, int64_t in);

}  // namespace dm::cuda
