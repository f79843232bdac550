// The residual stream of SPEC §1.3 on the GPU: token embedding gather, Block AttnRes mixing,
// RMSNorm from the fp32 stream into the bf16 rows the sub-layers take, and the stream add.
// Twins of ops/cpu/attnres.h, ops/cpu/rmsnorm.h and the copies in model/residual.h. Plain C++
// (no CUDA headers); kernels in residual_ops.cu. Every pointer is a DEVICE pointer; the residual
// stream is fp32 [N, D], bf16 tensors are their uint16_t bit patterns.
#pragma once
#include <cstddef>
#include <cstdint>

struct CUstream_st;

namespace dm::cuda {

// out[n, :] = fp32(table[tokens[n], :]) (bf16 table [V, D], the weights' compute copy; fp32
// stream). Token ids are checked on the host first. int64 ids (prefill) or int32 (decode).
void embedding_gather(const uint16_t* table, const int64_t* tokens, int64_t N, int64_t D,
                      float* out, CUstream_st* stream = nullptr);
void embedding_gather(const uint16_t* table, const int32_t* tokens, int64_t N, int64_t D,
                      float* out, CUstream_st* stream = nullptr);

// y[n, :] = bf16(x[n, :] · r_n · w),  r_n = 1/sqrt(mean(x[n,:]²) + eps); x fp32, w fp32 [D].
void rmsnorm_to_bf16(const float* x, const float* w, uint16_t* y, int64_t N, int64_t D, float eps,
                     CUstream_st* stream = nullptr);

// dst[i] = a[i] + b[i] (fp32); dst may be a (or b).
void add(float* dst, const float* a, const float* b, int64_t n, CUstream_st* stream = nullptr);
// dst[i] += src[i] (fp32).
void add_inplace(float* dst, const float* src, int64_t n, CUstream_st* stream = nullptr);

// p[n, :] += out[n, :], then y[n, :] = bf16(p[n, :] · r_n · w) as rmsnorm_to_bf16, in one pass
// (the residual walk's add_rmsnorm: one launch instead of two per sub-layer of a decode step).
void add_rmsnorm_to_bf16(float* p, const float* out, const float* w, uint16_t* y, int64_t N,
                         int64_t D, float eps, CUstream_st* stream = nullptr);

// fp32 twins for the fp32 GPU mode (the normed rows stay fp32; fp32 embedding table):
void embedding_gather(const float* table, const int64_t* tokens, int64_t N, int64_t D, float* out,
                      CUstream_st* stream = nullptr);
void embedding_gather(const float* table, const int32_t* tokens, int64_t N, int64_t D, float* out,
                      CUstream_st* stream = nullptr);
void rmsnorm_to_f32(const float* x, const float* w, float* y, int64_t N, int64_t D, float eps,
                    CUstream_st* stream = nullptr);
void add_rmsnorm_to_f32(float* p, const float* out, const float* w, float* y, int64_t N, int64_t D,
                        float eps, CUstream_st* stream = nullptr);

// Block AttnRes (ops/cpu/attnres.h): for each row n over S sources V_j = src[j][n, :],
//   logit_j = r_j · Σ_d V_jd γ_d w_d,  r_j = rsqrt(mean(V_j²) + eps),
//   out[n] = Σ_j softmax_j(logit) V_j.
// src: S device pointers held in a HOST array (passed to the kernel by value); S ≤ 64,
// D ≤ 16384. One warp per row from 1024 rows on (training), one block per row below that
// (decode batches: a warp per row would leave the GPU idle); row sums in fp64, weighted sum fp32.
// out may alias a source (a row's sources are all read before any of its out row is written,
// and each thread writes only elements it has read from every source).
inline constexpr int kAttnResCudaMaxSources = 64;
void attnres_forward(const float* const* src, int S, const float* query, const float* norm_w,
                     float* out, int64_t N, int64_t D, float eps, CUstream_st* stream = nullptr);

// attnres_forward, then rmsnorm_to_bf16(out, out_w, normed, norm_eps) of its output (every
// training site's mix is followed by its norm). Rows of one float4 tile (D ≤ 2048, 16-byte
// aligned, N ≥ 1024) are normed from the mix's registers in the same kernel: out is written but
// not read back; other shapes run the two ops. The fused norm sums squares per warp instead of
// per block of 256 threads, so its bf16 bits may differ from rmsnorm_to_bf16's in the last place.
void attnres_forward_norm(const float* const* src, int S, const float* query, const float* norm_w,
                          float* out, const float* out_w, uint16_t* normed, int64_t N, int64_t D,
                          float eps, float norm_eps, CUstream_st* stream = nullptr);

// ---- Training (backward) side of the residual stream and the global gradient norm ----------
// Every backward ACCUMULATES into its gradients (docs/backward.md); nothing here synchronises
// or allocates: scratch comes in through `workspace` (device memory, ≥ the matching
// *_workspace_bytes, 256-byte aligned as DeviceArena hands it out).

// Backward of attnres_forward (twin of ops/cpu/attnres.h attnres_backward): recomputes the
// softmax per row, then
//   dsrc[j][n, :] += a_j·dout[n] + c_j·γ⊙w − c3_j·V_j     (c_j = dlogit_j·r_j, c3_j = dlogit_j·s_j·r_j³/D)
//   dquery += G⊙γ,  dnorm_w += G⊙w,   G[d] = Σ_n Σ_j c_nj V_njd.
// src / dsrc: S device pointers in HOST arrays (dsrc[j] == nullptr skips source j); dsrc must
// not alias any src[k] or dout. dquery / dnorm_w [D] may each be nullptr. D ≤ 16384.
// One warp per row: row statistics, the softmax and its backward are recomputed in fp64 (as
// the CPU), the element updates run in fp32. G is reduced deterministically: each warp owns a
// fixed set of rows and an fp32 partial of G in shared memory, each block (≤ 512 of them, a
// function of N and D) sums its warps' partials in warp order in fp64 into its slice of the
// workspace, then a second kernel sums the block partials in a fixed order (no atomics:
// bit-identical run to run). The workspace is a function of (N, D) only, never larger than
// 512·D doubles (S is accepted for callers' convenience).
size_t attnres_backward_workspace_bytes(int64_t N, int64_t D, int S);
void attnres_backward(const float* const* src, int S, const float* query, const float* norm_w,
                      const float* dout, float* const* dsrc, float* dquery, float* dnorm_w,
                      int64_t N, int64_t D, float eps, void* workspace,
                      CUstream_st* stream = nullptr);

// The backward of RMSNorm(attnres_forward(src)) in one pass, for training's sites, whose mix is
// always followed by the norm: given mixed = the mix's output [N, D] (fp32), the norm's weight
// out_w [D] and dy = ∂L/∂(normed rows) [N, D] (fp32), each row's
//   dout = r·out_w⊙dy − mixed·r³·(Σ_k dy_k·out_w_k·mixed_k)/D,  r = rsqrt(mean(mixed²) + norm_eps)
// is formed in shared memory and goes into attnres_backward's updates as its dout; d_out_w
// (nullptr: not wanted) += Σ_n dy⊙mixed·r, summed like G (fixed order, bit-identical reruns).
// Same as rmsnorm_backward (elementwise.h) into a dout buffer, then attnres_backward, without
// that buffer: the rows of mixed and dy are read once. dsrc must not alias src, mixed or dy.
// Fewer rows run side by side per block than in attnres_backward (each warp also holds its dout
// row and a partial of d_out_w in shared memory), so G's partial sums, hence its low bits,
// differ from attnres_backward's.
// Rows up to kAttnResNormInMaxWidth (one warp's γ⊙w, G partial, dout row and d_out_w partial fit
// an SM's shared memory); wider ones take rmsnorm_backward + attnres_backward.
inline constexpr int64_t kAttnResNormInMaxWidth = 12288;
size_t attnres_norm_backward_workspace_bytes(int64_t N, int64_t D, int S);
void attnres_norm_backward(const float* const* src, int S, const float* query, const float* norm_w,
                           const float* mixed, const float* out_w, const float* dy,
                           float* const* dsrc, float* dquery, float* dnorm_w, float* d_out_w,
                           int64_t N, int64_t D, float eps, float norm_eps, void* workspace,
                           CUstream_st* stream = nullptr);

// attnres_norm_backward with the updates of its `deferred` leading sources (the sealed blocks,
// which the next sites update again) left for attnres_flush: their dsrc and their share of
// dquery / dnorm_w are not touched here; the rows' dout goes to dout_keep [N, D] and the sources'
// fp32 coefficients to coef_keep [3, deferred, N]. Every other output as attnres_norm_backward
// (the other sources' dsrc, their share of dquery / dnorm_w, d_out_w). 1 ≤ deferred < S.
void attnres_norm_backward_deferred(const float* const* src, int S, int deferred,
                                    const float* query, const float* norm_w, const float* mixed,
                                    const float* out_w, const float* dy, float* const* dsrc,
                                    float* dquery, float* dnorm_w, float* d_out_w, int64_t N,
                                    int64_t D, float eps, float norm_eps, float* dout_keep,
                                    float* coef_keep, void* workspace,
                                    CUstream_st* stream = nullptr);

// One deferred site for attnres_flush: what attnres_norm_backward_deferred kept, its pseudo-query
// and key-norm weight, and the gradients of those (nullptr: not wanted).
struct AttnResFlushSite {
  const float* dout = nullptr;  // [N, D]
  const float* coef = nullptr;  // [3, deferred, N]
  int deferred = 0;
  const float* query = nullptr;
  const float* norm_w = nullptr;
  float* dquery = nullptr;
  float* dnorm_w = nullptr;
};
// The deferred updates of P sites (1 ≤ P ≤ kAttnResFlushMaxSites) that all deferred the same
// J sources src[0..J) (1 ≤ J ≤ kAttnResFlushMaxSources): dsrc[j] += Σ_p (a·dout_p + c·γ_p⊙w_p −
// c3·V_j) and each site's dquery / dnorm_w += its G over those sources, in one pass over the
// rows (each dsrc row read and written once for all P sites, where the sites' own kernels would
// each have read and written it). Together with the deferred calls, equal to P calls of
// attnres_norm_backward up to fp32 rounding. D % 4 == 0; the rows of src, dsrc and dout 16-byte
// aligned (query and norm_w need not be). Deterministic.
inline constexpr int kAttnResFlushMaxSites = 8;
inline constexpr int kAttnResFlushMaxSources = 16;
size_t attnres_flush_workspace_bytes(int64_t N, int64_t D, int P);
void attnres_flush(const AttnResFlushSite* sites, int P, const float* const* src,
                   float* const* dsrc, int J, int64_t N, int64_t D, void* workspace,
                   CUstream_st* stream = nullptr);

// Backward of embedding_gather into the fp32 table gradient: dtable[tokens[n], :] += dp[n, :]
// (dtable [V, D], dp [N, D]). Deterministic: the (token, n) pairs are radix-sorted by token
// (stable, so equal tokens keep n order), then one block per distinct token sums its rows in
// that order in fp64 and adds once. Ids outside [0, V) are skipped (the forward checked them on
// the host). N < 2^31, V < 2^31.
size_t embedding_backward_workspace_bytes(int64_t N, int64_t V);
void embedding_backward(const int64_t* tokens, const float* dp, int64_t N, int64_t D, int64_t V,
                        float* dtable, void* workspace, CUstream_st* stream = nullptr);
// Atomic variant (no V, no workspace): fp32 atomicAdd per element, so the order in which
// repeated ids add up — hence the low bits of dtable — may change from run to run. Ids are
// trusted (no range check). Prefer the deterministic overload above.
void embedding_backward(const int64_t* tokens, const float* dp, int64_t N, int64_t D,
                        float* dtable, CUstream_st* stream = nullptr);

// *result_device = Σ_i x[i]² (fp32 inputs, fp64 sums; OVERWRITES the result, does not add).
// Deterministic two-stage reduction: a fixed number of blocks (a function of n only) write fp64
// partials to the workspace, one block sums them in a fixed tree order. n = 0 gives 0.
size_t sum_squares_workspace_bytes(int64_t n);
void sum_squares(const float* x, int64_t n, double* result_device, void* workspace,
                 CUstream_st* stream = nullptr);

// x[i] *= s (gradient clipping by the global norm).
void scale_inplace(float* x, int64_t n, float s, CUstream_st* stream = nullptr);

}  // namespace dm::cuda
