// Muon on the GPU: the twin of Optimizer::muon_update (train/optimizer.cpp), on fp32 master
// weights with an fp32 momentum buffer. Plain C++ (no CUDA headers); kernels in muon.cu.
//
// For a [rows, cols] matrix split into row blocks of hr rows (hr = head_rows when head_rows > 0
// and divides rows — the per-head Q/K/V blocks of SPEC §2 — else the whole matrix):
//   m ← μ·m + g;   U = g + μ·m                                    (Nesterov look-ahead)
//   per block: X = U_h (transposed to [cols, hr] when hr > cols, so X is [r, c] with r ≤ c),
//              X ← X / (‖X‖_F + 1e-7)   (norm in fp64, as the CPU)
//              ns_steps × { A = X Xᵀ;  B = c·A² + b·A;  X ← a·X + B X }   (a, b, c = 3.4445,
//              −4.7750, 2.0315), then un-transposed;
//   p ← p − lr·scale·X − wd·p,   scale = 0.2·sqrt(max(hr, cols)),  wd = lr·weight_decay.
// The Newton–Schulz GEMMs run in fp32 (cublasSgemmStridedBatched, all blocks of a matrix in one
// batched call) on the legacy cuBLAS handle of the GemmContext, whose stream is set to `stream`
// here (the handle is shared: set again by every user). Matches the CPU within ~1e-6 relative.
#pragma once
#include <cstddef>
#include <cstdint>

struct CUstream_st;

namespace dm::cuda {

class GemmContext;

// One step's scalars. weight_decay is the decoupled decay coefficient of THIS matrix (0 = no
// decay, i.e. the CPU's `decay ? weight_decay : 0`); the step applies wd = lr·weight_decay.
struct MuonStep {
  float lr = 0.0f;
  float momentum = 0.95f;
  float weight_decay = 0.0f;
  int ns_steps = 5;
};

// Device scratch for one muon_update of this shape: two [rows·cols] fp32 iterates, two
// [blocks, r, r] fp32 Gram buffers (r = min(hr, cols)), the norm partials. head_rows as below.
size_t muon_workspace_bytes(int64_t rows, int64_t cols, int64_t head_rows);

// One Muon step for the matrix p [rows, cols] (fp32, row-major) from its gradient g (not
// modified) and momentum m (updated). head_rows: rows per Newton–Schulz block, exactly what the
// CPU's muon_head_rows() gives (0 = the whole matrix). p_bf16 [rows, cols] (nullable) receives
// the updated weights rounded to bf16 (the compute copy). workspace ≥ muon_workspace_bytes(...),
// 256-byte aligned. Nothing synchronises; no device allocation.
void muon_update(GemmContext& gemm, float* p, const float* g, float* m, uint16_t* p_bf16,
                 int64_t rows, int64_t cols, int64_t head_rows, const MuonStep& step,
                 void* workspace, CUstream_st* stream = nullptr);

}  // namespace dm::cuda
