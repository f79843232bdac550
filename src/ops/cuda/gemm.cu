// cuBLASLt dense GEMM, row-major like core/gemm.h: bf16 operands with fp32 accumulation and
// bf16/fp32 output (gemm_bf16*), and all-fp32 products with full-precision multiplies (gemm_f32,
// the fp32 GPU mode). Both go through one cuBLASLt call and one algorithm cache.
//
// Tuning (GemmContext::set_tuning, DM_GEMM_TUNE=1, or =accumulating for the beta ≠ 0 products
// only): on a cache miss outside graph capture, the
// heuristic's first kTuneCandidates algorithms run on the call's own operands (one warm-up, the
// median of kTuneTimedRuns, CUDA events on the call's stream) and the fastest is cached. A beta ≠ 0
// product accumulates into C, so C is saved to the context's tuning scratch before and restored
// after; then the chosen algorithm runs once for the real result. DM_GEMM_TUNE_LOG=1 prints one
// line per tuned key to stderr.
//
// Row-major → column-major mapping: a row-major [r, c] matrix with leading dimension ld is the
// column-major [c, r] matrix with the same ld, so C = op(A)·op(B) (row-major) is computed as the
// column-major product Cᵀ = op(B)ᵀ·op(A)ᵀ: cuBLAS's "A" is our B, its "B" is our A, m = N, n = M.
#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/env.h"
#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/device.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/gemv.h"

namespace dm::cuda {

namespace {

#define DM_CUBLAS_CHECK(expr)                                                              \
  do {                                                                                     \
    const cublasStatus_t dm_cublas_status_ = (expr);                                       \
    if (dm_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                        \
      throw ::dm::Error(::dm::str_cat(#expr, ": cuBLAS status ", int(dm_cublas_status_))); \
  } while (0)

constexpr int kAlgoCacheCapacity = 256;
constexpr size_t kHostScratchBytes = size_t(1) << 20;
constexpr int kTuneCandidates = 8;  // heuristic results timed per key
constexpr int kTuneTimedRuns = 3;   // after one warm-up; the median counts

// Largest power of two (≤ 256) dividing the address: the alignment cuBLASLt may assume.
uint32_t pointer_alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && (a % align) != 0) align >>= 1;
  return align;
}

// C[M,N] (row-major, ld ldc) ← beta·C; beta = 0 writes zeros (C may hold NaN garbage).
template <typename OutT>
__global__ void gemm_scale_output_kernel(OutT* C, int64_t M, int64_t N, int64_t ldc, float beta) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= M * N) return;
  OutT* c = C + (i / N) * ldc + (i % N);
  if constexpr (sizeof(OutT) == 4) {
    *c = beta == 0.0f ? 0.0f : beta * *c;
  } else {
    *c = __float2bfloat16(beta == 0.0f ? 0.0f : beta * __bfloat162float(*c));
  }
}

// K = 0: C ← beta·C (no product to run; beta = 1 leaves C alone).
template <typename OutT>
void scale_output(const char* who, OutT* C, int64_t M, int64_t N, int64_t ldc, float beta,
                  CUstream_st* stream) {
  if (beta == 1.0f) return;
  const int threads = 256;
  const int blocks = ceil_div(M * N, threads);
  gemm_scale_output_kernel<<<blocks, threads, 0, stream>>>(C, M, N, ldc, beta);
  check_last_error(who);
}

// Shape checks shared by every entry point; false when the product is empty (M or N = 0).
bool check_gemm_shape(const char* who, int64_t M, int64_t N, int64_t K, int64_t ldc) {
  DM_CHECK(M >= 0 && N >= 0 && K >= 0, who, ": negative shape M=", M, " N=", N, " K=", K);
  if (M == 0 || N == 0) return false;
  DM_CHECK(ldc >= N, who, ": ldc=", ldc, " < N=", N);
  return true;
}

void check_gemm_operands(const char* who, bool trans_a, bool trans_b, int64_t M, int64_t N,
                         int64_t K, const void* A, int64_t lda, const void* B, int64_t ldb,
                         const void* C) {
  DM_CHECK(lda >= (trans_a ? M : K), who, ": lda=", lda, " too small (ta=", trans_a, ", M=", M,
           ", K=", K, ")");
  DM_CHECK(ldb >= (trans_b ? K : N), who, ": ldb=", ldb, " too small (tb=", trans_b, ", K=", K,
           ", N=", N, ")");
  DM_CHECK(A && B && C, who, ": null matrix pointer");
}

// One checked cuBLASLt product (row-major, as the public calls take it; K ≥ 1). A and B share
// one element type (bf16 or fp32), C has its own; compute is always CUBLAS_COMPUTE_32F (fp32
// accumulation, and for fp32 operands full-precision multiplies: TF32 would be
// CUBLAS_COMPUTE_32F_FAST_TF32).
struct LtProduct {
  const char* who;
  bool trans_a, trans_b;
  int64_t M, N, K;
  float alpha, beta;
  const void* A;
  int64_t lda, stride_a;
  const void* B;
  int64_t ldb, stride_b;
  void* C;
  int64_t ldc, stride_c;
  int64_t batch;
  cudaDataType_t ab_type, c_type;
  const void* C_in = nullptr;  // the beta·C term's matrix when it is not C itself (same layout)
};

// Cache key of a product: transposes, power-of-two buckets of M, N, K, leading dims, the operand
// and output element types, beta ≠ 0, alignments, batch and strides.
constexpr int kAlgoKeyLength = 18;

size_t element_bytes(cudaDataType_t type) { return type == CUDA_R_32F ? 4 : 2; }

// What a tuning GemmContext lends lt_matmul_cached (null when tuning is off): the log switch
// and its device scratch for C, grown here (free + malloc) when a larger C is tuned. Tuning runs
// only on a key's first call, so the scratch never changes in steady state.
struct LtTuner {
  bool log;
  void*& scratch;
  size_t& scratch_bytes;
};

// Whether work queued on `stream` would be recorded into a CUDA graph rather than run: timing
// cannot happen then. The legacy stream answers with an error while another stream captures in
// global mode; that counts as capturing (and the error is not left for the next check).
bool stream_capturing(CUstream_st* stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

// The 1 + kTuneTimedRuns events of one candidate's timing, destroyed on every exit.
struct TuneEvents {
  cudaEvent_t at[kTuneTimedRuns + 1] = {};
  TuneEvents() {
    for (cudaEvent_t& e : at) DM_CUDA_CHECK(cudaEventCreate(&e));
  }
  ~TuneEvents() {
    for (cudaEvent_t e : at)
      if (e) cudaEventDestroy(e);
  }
  TuneEvents(const TuneEvents&) = delete;
  TuneEvents& operator=(const TuneEvents&) = delete;
};

// Bytes of C that copy_tuned_c moves: M·N elements for one product; for a batch the span from
// the lowest element any batch writes to the highest.
size_t scratch_bytes_for_c(const LtProduct& p) {
  const size_t elem = element_bytes(p.c_type);
  if (p.batch == 1) return size_t(p.M) * size_t(p.N) * elem;
  return (size_t(std::abs((p.batch - 1) * p.stride_c)) + size_t((p.M - 1) * p.ldc + p.N)) * elem;
}

// Saves (save = true) or restores the part of p's C that its products write, through `scratch`.
// One product: the M×N block (pitch ldc) as a packed M×N copy. Batched: the contiguous span from
// the lowest to the highest element any batch writes (elements in between that no batch writes
// get their own values back).
void copy_tuned_c(const LtProduct& p, void* scratch, bool save, CUstream_st* stream) {
  const size_t elem = element_bytes(p.c_type);
  if (p.batch == 1) {
    const size_t width = size_t(p.N) * elem, pitch = size_t(p.ldc) * elem;
    if (save)
      DM_CUDA_CHECK(cudaMemcpy2DAsync(scratch, width, p.C, pitch, width, size_t(p.M),
                                      cudaMemcpyDeviceToDevice, stream));
    else
      DM_CUDA_CHECK(cudaMemcpy2DAsync(p.C, pitch, scratch, width, width, size_t(p.M),
                                      cudaMemcpyDeviceToDevice, stream));
    return;
  }
  const int64_t last_batch = (p.batch - 1) * p.stride_c;
  char* lo = static_cast<char*>(p.C) + std::min<int64_t>(0, last_batch) * int64_t(elem);
  DM_CUDA_CHECK(cudaMemcpyAsync(save ? scratch : lo, save ? lo : scratch, scratch_bytes_for_c(p),
                                cudaMemcpyDeviceToDevice, stream));
}

// Runs each candidate whose state is CUBLAS_STATUS_SUCCESS (run(&algo) → cuBLAS status) on p's
// operands: one warm-up, then kTuneTimedRuns timed on `stream`; a candidate that cuBLASLt
// rejects is skipped. Returns the fastest by median (candidates[0], the heuristic's choice, when
// none ran). C is saved first and restored last when beta ≠ 0; waits for the stream.
template <typename Run>
cublasLtMatmulAlgo_t fastest_algorithm(const LtProduct& p,
                                       const cublasLtMatmulHeuristicResult_t* candidates, int count,
                                       const Run& run, LtTuner& tuner, CUstream_st* stream) {
  TuneEvents events;
  const bool keep_c = p.beta != 0.0f && p.C_in == nullptr;  // else C is only written
  if (keep_c) {
    const size_t bytes = scratch_bytes_for_c(p);
    if (bytes > tuner.scratch_bytes) {
      // cudaFree waits for the device, so no earlier restore still reads the old scratch.
      if (tuner.scratch) DM_CUDA_CHECK(cudaFree(tuner.scratch));
      tuner.scratch = nullptr;
      tuner.scratch_bytes = 0;
      DM_CUDA_CHECK(cudaMalloc(&tuner.scratch, bytes));
      tuner.scratch_bytes = bytes;
    }
    copy_tuned_c(p, tuner.scratch, /*save=*/true, stream);
  }
  int best = -1;
  float best_ms = NAN, heuristic_ms = NAN;  // NaN in the log: the candidate did not run
  for (int i = 0; i < count; ++i) {
    if (candidates[i].state != CUBLAS_STATUS_SUCCESS) continue;
    if (run(&candidates[i].algo) != CUBLAS_STATUS_SUCCESS) continue;  // warm-up
    bool ok = true;
    DM_CUDA_CHECK(cudaEventRecord(events.at[0], stream));
    for (int r = 0; r < kTuneTimedRuns; ++r) {
      ok = ok && run(&candidates[i].algo) == CUBLAS_STATUS_SUCCESS;
      DM_CUDA_CHECK(cudaEventRecord(events.at[r + 1], stream));
    }
    DM_CUDA_CHECK(cudaEventSynchronize(events.at[kTuneTimedRuns]));
    if (!ok) continue;
    float ms[kTuneTimedRuns];
    for (int r = 0; r < kTuneTimedRuns; ++r)
      DM_CUDA_CHECK(cudaEventElapsedTime(&ms[r], events.at[r], events.at[r + 1]));
    std::sort(ms, ms + kTuneTimedRuns);
    const float median = ms[kTuneTimedRuns / 2];
    if (i == 0) heuristic_ms = median;
    if (best < 0 || median < best_ms) {
      best = i;
      best_ms = median;
    }
  }
  if (keep_c) {
    copy_tuned_c(p, tuner.scratch, /*save=*/false, stream);
    // The scratch is free again only once the restore has run (the next tuned key may be on
    // another stream).
    DM_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  if (tuner.log) {
    const double flops = 2.0 * double(p.M) * double(p.N) * double(p.K) * double(p.batch);
    std::fprintf(stderr,
                 "gemm tune: ta=%d tb=%d M=%lld N=%lld K=%lld batch=%lld ab=%s c=%s beta!=0=%d "
                 "candidates=%d heuristic=%.1fus best=%.1fus pick=%d %.1f TFLOP/s\n",
                 int(p.trans_a), int(p.trans_b), (long long)p.M, (long long)p.N, (long long)p.K,
                 (long long)p.batch, p.ab_type == CUDA_R_32F ? "f32" : "bf16",
                 p.c_type == CUDA_R_32F ? "f32" : "bf16", int(keep_c), count,
                 1e3 * double(heuristic_ms), 1e3 * double(best_ms), best,
                 best < 0 ? 0.0 : flops / (1e-3 * double(best_ms)) * 1e-12);
  }
  return candidates[best < 0 ? 0 : best].algo;
}

// Runs p through cuBLASLt with the algorithm cached for its key (on a miss: the heuristic's
// choice, or with a tuner and outside graph capture the fastest of its candidates).
// CacheEntry is GemmContext::AlgoCacheEntry {key, algo} (private to the class, so deduced here
// rather than named); cache holds kAlgoCacheCapacity entries, cache_used / cache_next are the
// context's fill count and round-robin cursor.
template <typename CacheEntry>
void lt_matmul_cached(const LtProduct& p, cublasLtHandle_t lt, void* workspace,
                      size_t workspace_bytes, CacheEntry* cache, int& cache_used, int& cache_next,
                      LtTuner* tuner, CUstream_st* stream) {
  // Column-major problem: m' = N, n' = M, A' = B (op = tb), B' = A (op = ta).
  const cublasOperation_t op_a = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const uint64_t a_rows = p.trans_b ? p.K : p.N, a_cols = p.trans_b ? p.N : p.K;
  const uint64_t b_rows = p.trans_a ? p.M : p.K, b_cols = p.trans_a ? p.K : p.M;

  cublasLtMatmulDescOpaque_t op_desc;
  DM_CUBLAS_CHECK(cublasLtMatmulDescInit(&op_desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  DM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(&op_desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a,
                                                 sizeof(op_a)));
  DM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(&op_desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b,
                                                 sizeof(op_b)));
  cublasLtMatrixLayoutOpaque_t a_layout, b_layout, c_layout;
  DM_CUBLAS_CHECK(cublasLtMatrixLayoutInit(&a_layout, p.ab_type, a_rows, a_cols, p.ldb));
  DM_CUBLAS_CHECK(cublasLtMatrixLayoutInit(&b_layout, p.ab_type, b_rows, b_cols, p.lda));
  DM_CUBLAS_CHECK(
      cublasLtMatrixLayoutInit(&c_layout, p.c_type, uint64_t(p.N), uint64_t(p.M), p.ldc));
  if (p.batch > 1) {  // batch i reads A + i·stride_a, B + i·stride_b and writes C + i·stride_c
    const int32_t count = int32_t(p.batch);
    const struct {
      cublasLtMatrixLayoutOpaque_t* layout;
      int64_t stride;
    } strided[3] = {{&a_layout, p.stride_b}, {&b_layout, p.stride_a}, {&c_layout, p.stride_c}};
    for (const auto& l : strided) {
      DM_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
          l.layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
      DM_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
          l.layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &l.stride, sizeof(l.stride)));
    }
  }

  // Batched: every batch's matrix starts stride elements further, so the stride's byte offset
  // bounds the alignment too.
  const int64_t ab_bytes = int64_t(element_bytes(p.ab_type)),
                c_bytes = int64_t(element_bytes(p.c_type));
  auto aligned_with = [](const void* ptr, int64_t offset_bytes) {
    const uint32_t a = pointer_alignment(ptr);
    const uint32_t o = pointer_alignment(reinterpret_cast<const void*>(uintptr_t(offset_bytes)));
    return a < o ? a : o;
  };
  const uint32_t align_a = aligned_with(p.B, p.stride_b * ab_bytes),
                 align_b = aligned_with(p.A, p.stride_a * ab_bytes),
                 align_c =
                     std::min(aligned_with(p.C, p.stride_c * c_bytes),
                              p.C_in ? aligned_with(p.C_in, p.stride_c * c_bytes) : uint32_t(256));
  // The cache is keyed on the power-of-two bucket of each dimension, not its exact value: the
  // MoE's per-expert GEMMs change M (rows of an expert) or K (its rows, for weight gradients)
  // every call, and a heuristic query per call costs more than the GEMM. An algorithm chosen for
  // one shape of a bucket is reused for the others; if cuBLASLt rejects it for a shape, that call
  // queries its own (uncached). The element types are part of the key: a bf16 algorithm must
  // never run an fp32 product of the same shape.
  auto bucket = [](int64_t x) { return int64_t(64 - __builtin_clzll(uint64_t(x))); };
  const int64_t key[kAlgoKeyLength] = {p.trans_a,
                                       p.trans_b,
                                       bucket(p.M),
                                       bucket(p.N),
                                       bucket(p.K),
                                       p.lda,
                                       p.ldb,
                                       p.ldc,
                                       int64_t(p.ab_type),
                                       int64_t(p.c_type),
                                       p.beta != 0.0f,
                                       int64_t(align_a),
                                       int64_t(align_b),
                                       int64_t(align_c),
                                       p.batch,
                                       p.stride_a,
                                       p.stride_b,
                                       p.stride_c};
  static_assert(sizeof(key) == sizeof(cache[0].key), "cache key length");
  const cublasLtMatmulAlgo_t* algo = nullptr;
  for (int i = 0; i < cache_used; ++i)
    if (std::memcmp(cache[i].key, key, sizeof(key)) == 0) {
      algo = &cache[i].algo;
      break;
    }
  // Up to `requested` algorithms, best first by the heuristic; returns how many (≥ 1).
  auto heuristic = [&](cublasLtMatmulHeuristicResult_t* results, int requested) {
    cublasLtMatmulPreferenceOpaque_t preference;
    DM_CUBLAS_CHECK(cublasLtMatmulPreferenceInit(&preference));
    const uint64_t max_workspace = workspace_bytes;
    DM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        &preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_workspace,
        sizeof(max_workspace)));
    DM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        &preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a)));
    DM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        &preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b)));
    DM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        &preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof(align_c)));
    DM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        &preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, sizeof(align_c)));
    int returned = 0;
    DM_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt, &op_desc, &a_layout, &b_layout, &c_layout,
                                                   &c_layout, &preference, requested, results,
                                                   &returned));
    DM_CHECK(returned > 0, p.who, ": cuBLASLt found no algorithm for M=", p.M, " N=", p.N,
             " K=", p.K, " lda=", p.lda, " ldb=", p.ldb, " ldc=", p.ldc);
    return returned;
  };
  auto run = [&](const cublasLtMatmulAlgo_t* a) {
    return cublasLtMatmul(lt, &op_desc, &p.alpha, p.B, &a_layout, p.A, &b_layout, &p.beta,
                          p.C_in ? p.C_in : p.C, &c_layout, p.C, &c_layout, a,
                          static_cast<char*>(workspace), workspace_bytes, stream);
  };
  if (!algo) {
    cublasLtMatmulHeuristicResult_t candidates[kTuneCandidates] = {};
    const bool tune = tuner && !stream_capturing(stream);
    const int count = heuristic(candidates, tune ? kTuneCandidates : 1);
    const cublasLtMatmulAlgo_t chosen =
        tune ? fastest_algorithm(p, candidates, count, run, *tuner, stream) : candidates[0].algo;
    // Fixed-capacity cache, round-robin replacement once full.
    const int slot = cache_used < kAlgoCacheCapacity ? cache_used++ : cache_next++;
    if (cache_next >= kAlgoCacheCapacity) cache_next = 0;
    std::memcpy(cache[slot].key, key, sizeof(key));
    cache[slot].algo = chosen;
    DM_CUBLAS_CHECK(run(&cache[slot].algo));
    return;
  }
  if (run(algo) == CUBLAS_STATUS_SUCCESS) return;
  cublasLtMatmulHeuristicResult_t exact{};  // the bucket's algorithm does not apply to this shape
  heuristic(&exact, 1);
  DM_CUBLAS_CHECK(run(&exact.algo));
}

}  // namespace

// DM_GEMM_SHAPES=FILE: every cuBLASLt product's shape, one line each in call order, written to
// FILE when the context is destroyed. With the kernel trace of the same run
// (bench/kernel_trace.cpp) scripts/gemm-shapes.py gives each shape its kernels' time and
// TFLOP/s: events around the products would time the host's launch gaps and the streams'
// waits as well.
struct GemmContext::ShapeLog {
  std::string path;
  std::vector<std::array<int64_t, 9>> shapes;  // ta, tb, M, N, K, batch, beta ≠ 0, c fp32, ab fp32
  static constexpr size_t kMaxShapes = 1 << 20;

  void record(const LtProduct& p) {
    if (shapes.size() < kMaxShapes)
      shapes.push_back({p.trans_a, p.trans_b, p.M, p.N, p.K, p.batch, p.beta != 0.0f,
                        p.c_type == CUDA_R_32F, p.ab_type == CUDA_R_32F});
  }
  void write() const {
    if (shapes.empty()) return;  // another context of the process may have logged
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (!f) {
      std::fprintf(stderr, "DM_GEMM_SHAPES: cannot write %s\n", path.c_str());
      return;
    }
    std::fprintf(f, "ta tb M N K batch beta c32 f32\n");
    for (const auto& v : shapes)
      std::fprintf(f, "%lld %lld %lld %lld %lld %lld %lld %lld %lld\n", (long long)v[0],
                   (long long)v[1], (long long)v[2], (long long)v[3], (long long)v[4],
                   (long long)v[5], (long long)v[6], (long long)v[7], (long long)v[8]);
    std::fclose(f);
  }
};

// DM_GEMM_TUNE: unset, 0 → Off; 1, all → All; accumulating → Accumulating.
static GemmTuning tuning_from_env() {
  const char* env = std::getenv("DM_GEMM_TUNE");
  if (env == nullptr || env[0] == '\0' || std::strcmp(env, "0") == 0) return GemmTuning::Off;
  if (std::strcmp(env, "1") == 0 || std::strcmp(env, "all") == 0) return GemmTuning::All;
  DM_CHECK(std::strcmp(env, "accumulating") == 0,
           "DM_GEMM_TUNE must be 0, 1, all or accumulating, got '", env, "'");
  return GemmTuning::Accumulating;
}

// Whether a cache miss of p is tuned under t.
static bool tuned(GemmTuning t, const LtProduct& p) {
  return t == GemmTuning::All || (t == GemmTuning::Accumulating && p.beta != 0.0f);
}

struct GemmContext::AlgoCacheEntry {
  int64_t key[kAlgoKeyLength];
  cublasLtMatmulAlgo_t algo;
};

GemmContext::GemmContext(size_t workspace_bytes) {
  tuning_ = tuning_from_env();
  tuning_log_ = env_flag("DM_GEMM_TUNE_LOG", false);
  if (const char* shapes = std::getenv("DM_GEMM_SHAPES"); shapes && *shapes)
    shape_log_ = new ShapeLog{shapes, {}};
  workspace_bytes = (workspace_bytes + 511) & ~size_t(511);
  cublasLtHandle_t lt = nullptr;
  DM_CUBLAS_CHECK(cublasLtCreate(&lt));
  lt_ = lt;
  cublasHandle_t handle = nullptr;
  DM_CUBLAS_CHECK(cublasCreate(&handle));
  cublas_ = handle;
  if (workspace_bytes > 0) DM_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes));
  lt_workspace_bytes_ = workspace_bytes / 2;
  if (workspace_bytes > 0)
    DM_CUBLAS_CHECK(cublasSetWorkspace(handle, static_cast<char*>(workspace_) + lt_workspace_bytes_,
                                       workspace_bytes - lt_workspace_bytes_));
  cache_ = new AlgoCacheEntry[kAlgoCacheCapacity];
  host_scratch_ = std::malloc(kHostScratchBytes);
  host_scratch_bytes_ = kHostScratchBytes;
}

GemmContext::~GemmContext() {
  if (shape_log_) shape_log_->write();
  delete shape_log_;
  if (lt_) cublasLtDestroy(static_cast<cublasLtHandle_t>(lt_));
  if (cublas_) cublasDestroy(static_cast<cublasHandle_t>(cublas_));
  if (workspace_) cudaFree(workspace_);
  if (tune_scratch_) cudaFree(tune_scratch_);
  delete[] cache_;
  std::free(host_scratch_);
}

void* GemmContext::host_scratch(size_t bytes) {
  DM_CHECK(bytes <= host_scratch_bytes_, "GemmContext::host_scratch: ", bytes,
           " bytes requested, capacity ", host_scratch_bytes_);
  return host_scratch_;
}

void GemmContext::gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                            float alpha, const uint16_t* A, int64_t lda, const uint16_t* B,
                            int64_t ldb, float beta, void* C, GemmOutType c_type, int64_t ldc,
                            CUstream_st* stream, const void* c_in) {
  gemm_bf16_strided_batched(trans_a, trans_b, M, N, K, alpha, A, lda, 0, B, ldb, 0, beta, C, c_type,
                            ldc, 0, 1, stream, c_in);
}

void GemmContext::gemm_bf16_strided_batched(bool trans_a, bool trans_b, int64_t M, int64_t N,
                                            int64_t K, float alpha, const uint16_t* A, int64_t lda,
                                            int64_t stride_a, const uint16_t* B, int64_t ldb,
                                            int64_t stride_b, float beta, void* C,
                                            GemmOutType c_type, int64_t ldc, int64_t stride_c,
                                            int64_t batch, CUstream_st* stream, const void* c_in) {
  DM_CHECK(batch >= 1 && batch <= (int64_t(1) << 30), "gemm_bf16: batch ", batch, " out of range");
  if (!check_gemm_shape("gemm_bf16", M, N, K, ldc)) return;
  const bool out_f32 = c_type == GemmOutType::F32;
  if (c_in == C) c_in = nullptr;
  if (c_in &&
      (K == 0 || (batch == 1 && !trans_a && trans_b && gemv_applies(M, K, A, lda, B, ldb)))) {
    // The paths below that take C in place: copy c_in's M×N block (batch 1) into C first.
    DM_CHECK(batch == 1, "gemm_bf16: a separate C input needs K > 0 when batched");
    const size_t elem = out_f32 ? 4 : 2;
    DM_CUDA_CHECK(cudaMemcpy2DAsync(C, size_t(ldc) * elem, c_in, size_t(ldc) * elem,
                                    size_t(N) * elem, size_t(M), cudaMemcpyDeviceToDevice,
                                    reinterpret_cast<cudaStream_t>(stream)));
    c_in = nullptr;
  }
  if (K == 0) {
    DM_CHECK(batch == 1, "gemm_bf16: K = 0 is not supported batched");
    if (out_f32)
      scale_output("gemm_bf16 (K = 0 scale)", static_cast<float*>(C), M, N, ldc, beta, stream);
    else
      scale_output("gemm_bf16 (K = 0 scale)", static_cast<__nv_bfloat16*>(C), M, N, ldc, beta,
                   stream);
    return;
  }
  check_gemm_operands("gemm_bf16", trans_a, trans_b, M, N, K, A, lda, B, ldb, C);
  // Few-row linear layers (decoding): bandwidth-bound, our GEMV streams the weights faster than
  // the tiles cuBLASLt picks for them (gemv.h).
  if (batch == 1 && !trans_a && trans_b && gemv_applies(M, K, A, lda, B, ldb)) {
    launch_gemv_bf16(M, N, K, alpha, A, lda, B, ldb, beta, C, c_type, ldc, stream);
    return;
  }
  const LtProduct p{"gemm_bf16", trans_a,  trans_b, M,           N,
                    K,           alpha,    beta,    A,           lda,
                    stride_a,    B,        ldb,     stride_b,    C,
                    ldc,         stride_c, batch,   CUDA_R_16BF, out_f32 ? CUDA_R_32F : CUDA_R_16BF,
                    c_in};
  LtTuner tuner{tuning_log_, tune_scratch_, tune_scratch_bytes_};
  if (shape_log_) shape_log_->record(p);
  lt_matmul_cached(p, static_cast<cublasLtHandle_t>(lt_), workspace_, lt_workspace_bytes_, cache_,
                   cache_used_, cache_next_, tuned(tuning_, p) ? &tuner : nullptr, stream);
}

void GemmContext::gemm_f32(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                           const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                           float* C, int64_t ldc, CUstream_st* stream) {
  if (!check_gemm_shape("gemm_f32", M, N, K, ldc)) return;
  if (K == 0) {
    scale_output("gemm_f32 (K = 0 scale)", C, M, N, ldc, beta, stream);
    return;
  }
  check_gemm_operands("gemm_f32", trans_a, trans_b, M, N, K, A, lda, B, ldb, C);
  // No GEMV shortcut: gemv.h reads bf16 weights only; cuBLASLt takes every fp32 shape.
  const LtProduct p{"gemm_f32", trans_a, trans_b, M, N, K,   alpha, beta, A,          lda,
                    0,          B,       ldb,     0, C, ldc, 0,     1,    CUDA_R_32F, CUDA_R_32F};
  LtTuner tuner{tuning_log_, tune_scratch_, tune_scratch_bytes_};
  if (shape_log_) shape_log_->record(p);
  lt_matmul_cached(p, static_cast<cublasLtHandle_t>(lt_), workspace_, lt_workspace_bytes_, cache_,
                   cache_used_, cache_next_, tuned(tuning_, p) ? &tuner : nullptr, stream);
}

}  // namespace dm::cuda
