// CUDA twins of the CPU row/element ops (SPEC §1, §1.4, §2): RMSNorm, GLU (SwiGLU, SiTU),
// fused softmax cross-entropy, AdamW. Plain C++ header (no CUDA includes); kernels in
// elementwise.cu. Same shapes and semantics as ops/cpu/{rmsnorm,ffn,loss}.h and the AdamW of
// train/optimizer.h; every pointer here is a DEVICE pointer unless its comment says host.
//
// Element types: `float`, or bf16 passed as its uint16_t bit pattern (device.h float_to_bf16).
// All math is fp32 whatever the storage type (statistics in fp32, sums of squares in fp32).
// `stream` is a cudaStream_t (nullptr = the default stream); nothing here synchronises except
// the host-returning cross_entropy_forward_backward overload.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

struct CUstream_st;  // = cudaStream_t's pointee (cuda_runtime.h), so no CUDA include is needed

namespace dm {
struct GluActivation;  // ops/cpu/ffn.h (C++20; this header stays C++17 for nvcc)
}

namespace dm::cuda {

using Stream = CUstream_st*;

// ---- RMSNorm: y[n,:] = x[n,:] · r_n · w,  r_n = 1/sqrt(mean(x[n,:]²) + eps) ----------------
//   x, y [N, D] (float or bf16), w [D] (same type as x). y may alias x.
void rmsnorm_forward(const float* x, const float* w, float* y, int64_t N, int64_t D, double eps,
                     Stream stream = nullptr);
void rmsnorm_forward(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t N, int64_t D,
                     double eps, Stream stream = nullptr);

// Backward, ACCUMULATING like the CPU op (docs/backward.md):
//   dx[n,i] += r_n·w_i·dy[n,i] − x[n,i]·r_n³·(Σ_k dy[n,k]·w_k·x[n,k])/D   (dx same type as x)
//   dw[i]   += Σ_n dy[n,i]·x[n,i]·r_n                                      (dw always fp32)
// dw is summed in a fixed order (deterministic). `workspace` holds
// rmsnorm_backward_workspace_bytes(N, D) bytes of device scratch (dead after the call's kernels).
// dx must not alias x or dy; dx or dw may be nullptr (not wanted). accumulate_dx = false STORES
// dx (= the gradient alone: no zeroed buffer to write first, no read of it), dw still accumulates.
size_t rmsnorm_backward_workspace_bytes(int64_t N, int64_t D);
void rmsnorm_backward(const float* x, const float* w, const float* dy, float* dx, float* dw,
                      int64_t N, int64_t D, double eps, void* workspace, Stream stream = nullptr,
                      bool accumulate_dx = true);
void rmsnorm_backward(const uint16_t* x, const uint16_t* w, const uint16_t* dy, uint16_t* dx,
                      float* dw, int64_t N, int64_t D, double eps, void* workspace,
                      Stream stream = nullptr, bool accumulate_dx = true);

// ---- GLU: h = act(g, u) (SwiGLU: SiLU(g)·u; SiTU: [β1 tanh(g/β1) σ(g)]·[β2 tanh(u/β2)]) ----
//   g, u, h [n]; h may alias g or u. The GluActivation overloads (elementwise.cpp) check β and
//   forward to the GluKernelParams ones (callable from .cu files, which cannot include ffn.h).
struct GluKernelParams {
  bool situ = false;  // false: SwiGLU
  float beta1 = 4.0f, beta2 = 25.0f;
};
// The plain parameters of a GluActivation (elementwise.cpp; for C++20 callers that hand them to
// .cu code).
GluKernelParams glu_kernel_params(const GluActivation& a);
// bf16 g and u (and dg, du) as column blocks of wider rows: element i of the [n / width, width]
// operand sits at (i / width)·ld + i % width (width 0: contiguous). The gated FFNs' one gate/up
// GEMM writes [N, 2F] rows, g in columns [0, F) and u in [F, 2F): width F, ld 2F, u = g + F.
// h and dh stay contiguous, except that the forward writes h as a column block of rows h_ld
// apart when h_ld > 0 (h_ld ≥ width; e.g. the MoE's joint [bf16(u') | h] output operand), and
// the backward writes dg, du at rows d_ld apart when d_ld > 0 (else in g's and u's layout; e.g.
// into the MoE backward's joint input-gradient operand).
struct GluRows {
  int64_t width = 0, ld = 0, h_ld = 0, d_ld = 0;
};
void glu_forward(const float* g, const float* u, float* h, int64_t n, const GluKernelParams& a,
                 Stream stream = nullptr);
void glu_forward(const uint16_t* g, const uint16_t* u, uint16_t* h, int64_t n,
                 const GluKernelParams& a, Stream stream = nullptr, GluRows rows = {});
void glu_backward(const float* g, const float* u, const float* dh, float* dg, float* du,
                  int64_t n, const GluKernelParams& a, Stream stream = nullptr);
void glu_backward(const uint16_t* g, const uint16_t* u, const uint16_t* dh, uint16_t* dg,
                  uint16_t* du, int64_t n, const GluKernelParams& a, Stream stream = nullptr,
                  GluRows rows = {});
void glu_forward(const float* g, const float* u, float* h, int64_t n, const GluActivation& a,
                 Stream stream = nullptr);
void glu_forward(const uint16_t* g, const uint16_t* u, uint16_t* h, int64_t n,
                 const GluActivation& a, Stream stream = nullptr, GluRows rows = {});
// dg = dh·∂act/∂g, du = dh·∂act/∂u, OVERWRITING like the CPU op (dg may alias g or dh, du may
// alias u: with rows, dg and du take g's and u's layout).
void glu_backward(const float* g, const float* u, const float* dh, float* dg, float* du,
                  int64_t n, const GluActivation& a, Stream stream = nullptr);
void glu_backward(const uint16_t* g, const uint16_t* u, const uint16_t* dh, uint16_t* dg,
                  uint16_t* du, int64_t n, const GluActivation& a, Stream stream = nullptr,
                  GluRows rows = {});

// ---- Softmax cross-entropy over logits [N, V], targets [N] (int64; outside [0, V) = ignored) ---
// Per counted row: loss = logsumexp(z) − z_target, and dlogits = (softmax(z) − onehot)·scale
// (WRITTEN, 0 for ignored rows; dlogits may be nullptr, may alias logits). The sums land in a
// device-side result (copy it back with copy_to_host when the host needs it).
struct CrossEntropyDeviceResult {
  double loss_sum;   // Σ over counted rows, summed in row order (deterministic)
  int64_t count;     // counted rows
  int64_t correct;   // counted rows whose argmax (first maximum) equals the target
};
size_t cross_entropy_workspace_bytes(int64_t N);
// Asynchronous: *result_device (device memory) receives the sums. workspace:
// cross_entropy_workspace_bytes(N) bytes of device scratch.
void cross_entropy_forward_backward(const float* logits, const int64_t* targets, float* dlogits,
                                    int64_t N, int64_t V, double scale,
                                    CrossEntropyDeviceResult* result_device, void* workspace,
                                    Stream stream = nullptr);
void cross_entropy_forward_backward(const uint16_t* logits, const int64_t* targets,
                                    uint16_t* dlogits, int64_t N, int64_t V, double scale,
                                    CrossEntropyDeviceResult* result_device, void* workspace,
                                    Stream stream = nullptr);
// fp32 logits, bf16 gradient (the fp32 gradient rounded once, as a separate conversion would):
// the training LM head's tile, whose gradient feeds bf16 GEMMs.
void cross_entropy_forward_backward(const float* logits, const int64_t* targets, uint16_t* dlogits,
                                    int64_t N, int64_t V, double scale,
                                    CrossEntropyDeviceResult* result_device, void* workspace,
                                    Stream stream = nullptr);

// ---- AdamW on fp32 master weights (train/optimizer.h, Optimizer::adamw_update) -------------
//   m ← β1 m + (1−β1) g;  v ← β2 v + (1−β2) g²;  p ← p − lr·(m/c1)/(sqrt(v/c2) + eps) − wd·p
//   with c1 = 1 − β1^step, c2 = 1 − β2^step (step ≥ 1, counted by the caller), wd = lr·weight_decay
//   when `decay`, else 0. p, m, v [n] fp32; g [n] fp32 or bf16; p_bf16 [n] (nullable) receives
//   the updated weights rounded to bf16 (the compute copy).
struct AdamWStep {
  float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
  int64_t step = 1;
  bool decay = true;
};
void adamw_update(float* p, const float* g, float* m, float* v, uint16_t* p_bf16, int64_t n,
                  const AdamWStep& s, Stream stream = nullptr);
void adamw_update(float* p, const uint16_t* g, float* m, float* v, uint16_t* p_bf16, int64_t n,
                  const AdamWStep& s, Stream stream = nullptr);

// ---- AdamW over many parameters in one launch (the GPU optimizer step) ----------------------
// The parameters are element ranges [begin, end) of arenas that share one layout: master p,
// gradient g (fp32), moments m, v and the bf16 copy p_bf16 (nullable). Each range gets exactly
// adamw_update's update with its own `decay` (s.decay is ignored), after its gradient is
// multiplied by grad_scale (global-norm clipping folded into the step: one pass fewer over the
// gradients; 1 leaves them as they are). Elements outside the ranges are not touched.
// Work is cut into tiles of ≤ 16K elements, one block each, with 16-byte loads where aligned:
// one launch instead of one per parameter, at ~30 bytes of traffic per element.
// Mirrors: elements [begin, end) that also have an fp32 copy at p_f32[packed + (i − begin)]
// (DeviceWeights' packed copies of the element-wise parameters): the update writes those too,
// in the same pass, instead of a copy per parameter after it (~300 small copies a step, 1.1 ms
// of the gpu_1b step on an H200).
struct AdamWRange {
  int64_t begin = 0, end = 0;
  bool decay = true;
};
struct AdamWMirror {
  int64_t begin = 0, end = 0, packed = 0;
};
class DeviceArena;
class AdamWRangePlan {  // the ranges' tile table in device memory, built once per layout
 public:
  // Disjoint ranges; disjoint mirrors (sorted or not; the parts outside every range are unused).
  explicit AdamWRangePlan(const std::vector<AdamWRange>& ranges,
                          const std::vector<AdamWMirror>& mirrors = {});
  ~AdamWRangePlan();
  int64_t tiles() const { return tiles_; }
  int64_t elements() const { return elements_; }
  const void* device_tiles() const { return device_tiles_; }

 private:
  std::unique_ptr<DeviceArena> table_;
  const void* device_tiles_ = nullptr;
  int64_t tiles_ = 0, elements_ = 0;
};
// p_f32: the mirrors' fp32 array (nullptr: the plan has none, or they are not wanted).
void adamw_update_ranges(const AdamWRangePlan& plan, float* p, const float* g, float* m, float* v,
                         uint16_t* p_bf16, float* p_f32, const AdamWStep& s, float grad_scale,
                         Stream stream = nullptr);

}  // namespace dm::cuda
