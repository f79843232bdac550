// Muon update on the GPU (muon.h). Layout: the iterate X stays in p's row-major layout
// [heads, hr, cols] for every block shape. The CPU transposes a tall block (hr > cols) to
// [cols, hr] and iterates X' ← a·X' + B X' with A = X' X'ᵀ; here the same iteration is written on
// X = X'ᵀ directly (A = Xᵀ X [cols, cols], X ← a·X + X Bᵀ), which is the CPU's computation up to
// the summation order inside the GEMMs — and needs no transpose kernels.
#include <algorithm>
#include <cmath>

#include <cublas_v2.h>

#include "ops/cuda/cuda_common.cuh"
#include "ops/cuda/device.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/muon.h"

namespace dm::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxNormBlocksPerHead = 64;

size_t align256(size_t bytes) { return (bytes + 255) & ~size_t(255); }

// Block decomposition of one Muon matrix, as Optimizer::muon_update decides it.
struct MuonShape {
  int64_t hr = 0;     // rows per block (head)
  int64_t heads = 0;  // rows / hr
  int64_t r = 0;      // Gram size: min(hr, cols)
  bool tall = false;  // hr > cols: the CPU transposes this block
  int64_t norm_blocks = 0;  // Frobenius-norm partials per head (a function of the shape only)
};

MuonShape muon_shape(int64_t rows, int64_t cols, int64_t head_rows) {
  DM_CHECK(rows > 0 && cols > 0 && rows < (int64_t(1) << 31) && cols < (int64_t(1) << 31),
           "muon_update (CUDA): bad shape ", rows, "x", cols);
  MuonShape s;
  s.hr = head_rows > 0 && rows % head_rows == 0 ? head_rows : rows;
  s.heads = rows / s.hr;
  s.tall = s.hr > cols;
  s.r = std::min(s.hr, cols);
  s.norm_blocks = std::clamp<int64_t>((s.hr * cols + 8191) / 8192, 1, kMaxNormBlocksPerHead);
  DM_CHECK(s.heads <= 65535, "muon_update (CUDA): ", s.heads, " heads (≤ 65535 supported)");
  return s;
}

unsigned elementwise_blocks(int64_t n) {
  return unsigned(std::min<int64_t>((n + kThreads - 1) / kThreads, 8192));
}

// m ← μ·m + g;  X = g + μ·m (Nesterov look-ahead), element-wise over [rows·cols].
__global__ void muon_momentum_kernel(const float* g, float* m, float* X, int64_t n, float mu) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float mi = mu * m[i] + g[i];
    m[i] = mi;
    X[i] = g[i] + mu * mi;
  }
}

// Σ X² of head blockIdx.y over the grid-stride share of block blockIdx.x (fp64), into
// partial[head · gridDim.x + blockIdx.x]. per_head = hr·cols elements, heads contiguous.
__global__ void muon_norm_partial_kernel(const float* X, int64_t per_head, double* partial) {
  __shared__ double scratch[32];
  const float* x = X + int64_t(blockIdx.y) * per_head;
  double acc = 0.0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < per_head;
       i += int64_t(gridDim.x) * blockDim.x) {
    const double v = x[i];
    acc += v * v;
  }
  acc = block_sum(acc, scratch);
  if (threadIdx.x == 0) partial[int64_t(blockIdx.y) * gridDim.x + blockIdx.x] = acc;
}

// X_h *= 1/(‖X_h‖_F + 1e-7) for head blockIdx.y: every block first sums the head's
// norm_blocks partials in index order (deterministic, ≤ 64 values), then scales its share.
// The factor is rounded to fp32 before use, as the CPU does.
__global__ void muon_normalise_kernel(float* X, int64_t per_head, const double* partial,
                                      int64_t norm_blocks) {
  __shared__ float inv;
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int64_t b = 0; b < norm_blocks; ++b) total += partial[int64_t(blockIdx.y) * norm_blocks + b];
    inv = float(1.0 / (sqrt(total) + 1e-7));
  }
  __syncthreads();
  float* x = X + int64_t(blockIdx.y) * per_head;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < per_head;
       i += int64_t(gridDim.x) * blockDim.x)
    x[i] *= inv;
}

// p ← p − lr_scale·X − wd·p (the CPU's `w -= lr * scale * o + wd * w`), and the bf16 copy.
__global__ void muon_apply_kernel(float* p, __nv_bfloat16* p_bf16, const float* X, int64_t n,
                                  float lr_scale, float wd) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    float w = p[i];
    w -= lr_scale * X[i] + wd * w;
    p[i] = w;
    if (p_bf16) p_bf16[i] = __float2bfloat16(w);
  }
}

// Row-major, strided-batched C[M,N] = alpha·op(A)·op(B) + beta·C in fp32 through column-major
// cuBLAS: a row-major matrix is its transpose in column-major, so solve Cᵀ = op(B)ᵀ·op(A)ᵀ.
void sgemm_row_major(cublasHandle_t handle, bool trans_a, bool trans_b, int64_t M, int64_t N,
                     int64_t K, float alpha, const float* A, int64_t lda, int64_t stride_a,
                     const float* B, int64_t ldb, int64_t stride_b, float beta, float* C,
                     int64_t ldc, int64_t stride_c, int64_t batch) {
  const cublasStatus_t status = cublasSgemmStridedBatched(
      handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, int(N),
      int(M), int(K), &alpha, B, int(ldb), stride_b, A, int(lda), stride_a, &beta, C, int(ldc),
      stride_c, int(batch));
  DM_CHECK(status == CUBLAS_STATUS_SUCCESS, "muon_update (CUDA): cublasSgemmStridedBatched (",
           M, "x", N, "x", K, ", batch ", batch, ") failed: cuBLAS status ", int(status));
}

// Workspace carving, shared by muon_workspace_bytes and muon_update.
struct MuonWorkspace {
  size_t x_bytes, gram_bytes, partial_bytes;
  size_t total() const { return 2 * x_bytes + 2 * gram_bytes + partial_bytes; }
};
MuonWorkspace muon_workspace_layout(int64_t rows, int64_t cols, const MuonShape& s) {
  MuonWorkspace w;
  w.x_bytes = align256(size_t(rows) * size_t(cols) * sizeof(float));
  w.gram_bytes = align256(size_t(s.heads) * size_t(s.r) * size_t(s.r) * sizeof(float));
  w.partial_bytes = align256(size_t(s.heads) * size_t(s.norm_blocks) * sizeof(double));
  return w;
}

}  // namespace

size_t muon_workspace_bytes(int64_t rows, int64_t cols, int64_t head_rows) {
  return muon_workspace_layout(rows, cols, muon_shape(rows, cols, head_rows)).total();
}

void muon_update(GemmContext& gemm, float* p, const float* g, float* m, uint16_t* p_bf16,
                 int64_t rows, int64_t cols, int64_t head_rows, const MuonStep& params,
                 void* workspace, CUstream_st* stream) {
  const MuonShape s = muon_shape(rows, cols, head_rows);
  DM_CHECK(params.ns_steps >= 0, "muon_update (CUDA): ns_steps=", params.ns_steps);
  DM_CHECK(workspace != nullptr, "muon_update (CUDA): workspace is null");
  const MuonWorkspace layout = muon_workspace_layout(rows, cols, s);
  char* base = static_cast<char*>(workspace);
  float* X = reinterpret_cast<float*>(base);
  float* Y = reinterpret_cast<float*>(base + layout.x_bytes);
  float* A = reinterpret_cast<float*>(base + 2 * layout.x_bytes);
  float* B = reinterpret_cast<float*>(base + 2 * layout.x_bytes + layout.gram_bytes);
  double* partial =
      reinterpret_cast<double*>(base + 2 * layout.x_bytes + 2 * layout.gram_bytes);
  const int64_t n = rows * cols, per_head = s.hr * cols, gram = s.r * s.r;

  muon_momentum_kernel<<<elementwise_blocks(n), kThreads, 0, stream>>>(g, m, X, n,
                                                                       params.momentum);
  check_last_error("muon_update (momentum)");
  const dim3 head_grid(unsigned(s.norm_blocks), unsigned(s.heads));
  muon_norm_partial_kernel<<<head_grid, kThreads, 0, stream>>>(X, per_head, partial);
  check_last_error("muon_update (norm)");
  muon_normalise_kernel<<<head_grid, kThreads, 0, stream>>>(X, per_head, partial, s.norm_blocks);
  check_last_error("muon_update (normalise)");

  // Quintic Newton–Schulz, the CPU's coefficients; all heads in one strided-batched GEMM each.
  const float ca = 3.4445f, cb = -4.7750f, cc = 2.0315f;
  cublasHandle_t handle = static_cast<cublasHandle_t>(gemm.cublas_handle());
  const cublasStatus_t set_status = cublasSetStream(handle, stream);
  DM_CHECK(set_status == CUBLAS_STATUS_SUCCESS, "cublasSetStream failed: ", int(set_status));
  // alpha / beta below are host scalars (the handle's default; stated in case a user changed it).
  const cublasStatus_t mode_status = cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_HOST);
  DM_CHECK(mode_status == CUBLAS_STATUS_SUCCESS, "cublasSetPointerMode failed: ", int(mode_status));
  const size_t x_used = size_t(n) * sizeof(float), gram_used = size_t(s.heads * gram) * sizeof(float);
  for (int step = 0; step < params.ns_steps; ++step) {
    // A = X Xᵀ [hr, hr] (wide block) or Xᵀ X [cols, cols] (tall block: the CPU's X' X'ᵀ).
    if (s.tall)
      sgemm_row_major(handle, true, false, cols, cols, s.hr, 1.0f, X, cols, per_head, X, cols,
                      per_head, 0.0f, A, cols, gram, s.heads);
    else
      sgemm_row_major(handle, false, true, s.hr, s.hr, cols, 1.0f, X, cols, per_head, X, cols,
                      per_head, 0.0f, A, s.hr, gram, s.heads);
    // B = c·A² + b·A.
    DM_CUDA_CHECK(cudaMemcpyAsync(B, A, gram_used, cudaMemcpyDeviceToDevice, stream));
    sgemm_row_major(handle, false, false, s.r, s.r, s.r, cc, A, s.r, gram, A, s.r, gram, cb, B,
                    s.r, gram, s.heads);
    // Y = a·X + B X (wide) or a·X + X Bᵀ (tall: (B X')ᵀ), then X ← Y by swapping buffers.
    DM_CUDA_CHECK(cudaMemcpyAsync(Y, X, x_used, cudaMemcpyDeviceToDevice, stream));
    if (s.tall)
      sgemm_row_major(handle, false, true, s.hr, cols, cols, 1.0f, X, cols, per_head, B, cols,
                      gram, ca, Y, cols, per_head, s.heads);
    else
      sgemm_row_major(handle, false, false, s.hr, cols, s.hr, 1.0f, B, s.hr, gram, X, cols,
                      per_head, ca, Y, cols, per_head, s.heads);
    std::swap(X, Y);
  }

  // Match AdamW's update RMS (≈0.2) so the same LR works for both (Moonlight's rule; CPU).
  const float scale = 0.2f * std::sqrt(float(std::max(s.hr, cols)));
  const float lr = params.lr;
  const float wd = lr * params.weight_decay;  // the CPU's `decay ? lr·weight_decay : 0`
  muon_apply_kernel<<<elementwise_blocks(n), kThreads, 0, stream>>>(
      p, reinterpret_cast<__nv_bfloat16*>(p_bf16), X, n, lr * scale, wd);
  check_last_error("muon_update (apply)");
}

}  // namespace dm::cuda
