// GPU benchmark of the MLA / MoE kernels (ops/cuda): one table, CUDA-event timing (warm-up, then
// the median of --reps runs). Skips with a message when built without CUDA or run without a GPU.
//   bench_cuda_mla [--reps 15] [--quick] [--decode-only]
// Rows:
//   gemm      cuBLASLt bf16 8192³ (bf16 out): the measured peak every other row is compared to.
//   mla fwd   causal prefill forward, B = 1, Dqk = 192 (128 nope + 64 rope), Dv = 128.
//   mla bwd   its backward (dQ, dK, dV; includes the Δ preprocessing).
//   ... 8 docs  the same over a row of 8 packed documents (doc_start), ours and cuDNN's ragged
//             batch; FLOP counted over the pairs inside documents.
//             FLOP counted: causal pairs P = T(T+1)/2 per head;
//               forward  = 2·H·P·(Dqk + Dv)          (S = QKᵀ and O = PV)
//               backward = 2·H·P·(3·Dqk + 2·Dv)      (S, dP = dO Vᵀ, dV, dK, dQ: 5 products;
//                          our deterministic two-pass kernels recompute S and dP once more,
//                          which is not counted)
//   decode    absorbed MLA decode step over a paged latent cache (Dk 576, Dv 512) of 32K tokens
//             (S = 1, 64) and of 1M tokens (S = 1; not with --quick), µs per step;
//             FLOP = 2·S·H·L·(Dk + Dv); GB/s = cache bytes read / time. --decode-only: these
//             rows alone (after the GEMM peak).
//   moe       grouped expert forward (gather, gate+up GEMMs, SiTU-GLU, down GEMM, combine) at a
//             K3-like expert shape (Din = ℓ = 3584, F = 3072), 64 local experts, top-16 routing;
//             FLOP = 2·rows·3·Din·F (rows = N·k).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#if DELTAMOE_HAVE_CUDA
#include <cuda_runtime.h>

#include "core/error.h"
#include "cuda_bench_util.h"
#include "io/config.h"
#include "ops/cpu/attention.h"
#include "ops/cpu/ffn.h"
#include "ops/cuda/attention.h"
#include "ops/cuda/attention_cudnn.h"
#include "ops/cuda/device.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/moe.h"

namespace {

using dm::bench::cuda_check;
using dm::bench::fill_random_bf16;
using dm::bench::median_ms;

struct Row {
  std::string item, shape;
  double ms, flop, bytes;
};

void print_table(const std::vector<Row>& rows, double peak_tflops) {
  std::printf("\n| item | shape | time | TFLOP/s | %% of GEMM peak | GB/s |\n");
  std::printf("|---|---|---:|---:|---:|---:|\n");
  for (const Row& r : rows) {
    const double tflops = r.flop / (r.ms * 1e-3) / 1e12;
    const std::string time = r.ms < 1.0 ? dm::str_cat(r.ms * 1e3, " us") : dm::str_cat(r.ms, " ms");
    char gbs[32] = "-";
    if (r.bytes > 0) std::snprintf(gbs, sizeof(gbs), "%.0f", r.bytes / (r.ms * 1e-3) / 1e9);
    std::printf("| %s | %s | %s | %.1f | %.1f%% | %s |\n", r.item.c_str(), r.shape.c_str(),
                time.c_str(), tflops, peak_tflops > 0 ? 100.0 * tflops / peak_tflops : 0.0, gbs);
  }
}

int run(int reps, bool quick, bool decode_only) {
  using namespace dm;
  std::printf("device: %s\n", cuda::device_description().c_str());
  std::vector<Row> rows;
  cuda::GemmContext gemm;
  cuda::DeviceArena arena(size_t(8) << 30);

  // ---- GEMM peak
  double peak = 0;
  {
    const int64_t n = quick ? 4096 : 8192;
    auto* A = arena.alloc<uint16_t>(size_t(n * n));
    auto* B = arena.alloc<uint16_t>(size_t(n * n));
    auto* C = arena.alloc<uint16_t>(size_t(n * n));
    fill_random_bf16(A, size_t(n * n), 1);
    fill_random_bf16(B, size_t(n * n), 2);
    const double ms = median_ms([&] {
      gemm.gemm_bf16(false, false, n, n, n, 1.0f, A, n, B, n, 0.0f, C, cuda::GemmOutType::Bf16, n);
    }, reps);
    const double flop = 2.0 * double(n) * n * n;
    peak = flop / (ms * 1e-3) / 1e12;
    rows.push_back({"gemm bf16 (cuBLASLt)", str_cat(n, "^3"), ms, flop, 0});
    arena.reset();
  }

  // ---- MLA prefill forward / backward: one row of T tokens, one document or `docs` equal packed
  // documents (doc_start; the training layout, attention restarting at each). Ours takes
  // doc_start in its tiles; cuDNN runs packed documents as one ragged batch (attention_cudnn.h).
  // FLOP counted over the causal pairs inside documents.
  const int64_t Dqk = 192, Dv = 128;
  auto prefill = [&](int64_t T, int64_t H, int64_t docs) {
    const AttnShape s{1, T, H, Dqk, Dv};
    const int64_t L = T / docs;
    const size_t qk = size_t(T * H * Dqk), vo = size_t(T * H * Dv);
    auto* q = arena.alloc<uint16_t>(qk);
    auto* k = arena.alloc<uint16_t>(qk);
    auto* v = arena.alloc<uint16_t>(vo);
    auto* o = arena.alloc<uint16_t>(vo);
    auto* dout = arena.alloc<uint16_t>(vo);
    auto* dq = arena.alloc<uint16_t>(qk);
    auto* dk = arena.alloc<uint16_t>(qk);
    auto* dv = arena.alloc<uint16_t>(vo);
    auto* lse = arena.alloc<float>(size_t(H * T));
    void* ws = arena.alloc_bytes(cuda::attention_causal_backward_workspace_bytes(s));
    int32_t* doc_start = nullptr;
    if (docs > 1) {
      std::vector<int32_t> starts(static_cast<size_t>(T));
      for (int64_t t = 0; t < T; ++t) starts[size_t(t)] = int32_t(t / L * L);
      doc_start = arena.alloc<int32_t>(starts.size());
      cuda::copy_to_device(doc_start, starts.data(), starts.size() * sizeof(int32_t));
    }
    fill_random_bf16(q, qk, 3);
    fill_random_bf16(k, qk, 4);
    fill_random_bf16(v, vo, 5);
    fill_random_bf16(dout, vo, 6);
    const double scale = 1.0 / std::sqrt(double(Dqk));
    const double pairs = double(docs) * double(L) * double(L + 1) / 2.0;
    const int bwd_reps = T > 8192 ? std::max(10, reps / 2) : reps;
    const std::string what = docs > 1 ? str_cat(", ", docs, " docs") : std::string();
    // Ours (tiled) and cuDNN's fused engines side by side, when this build and GPU have cuDNN.
    std::vector<std::pair<cuda::AttentionKernel, const char*>> kernels{
        {cuda::AttentionKernel::Tiled, "ours"}};
    if (cuda::cudnn_attention_available()) kernels.push_back({cuda::AttentionKernel::Cudnn, "cuDNN"});
    for (auto [kernel, name] : kernels) {
      const double fwd_ms = median_ms([&] {
        cuda::attention_causal_forward(q, k, v, o, lse, s, scale, doc_start, nullptr, kernel);
      }, reps);
      rows.push_back({str_cat("mla prefill fwd", what, " (", name, ")"), str_cat("T=", T, " H=", H),
                      fwd_ms, 2.0 * H * pairs * double(Dqk + Dv), 0});
      const double bwd_ms = median_ms([&] {
        cuda::attention_causal_backward(q, k, v, o, lse, dout, dq, dk, dv, s, scale, ws,
                                        doc_start, nullptr, kernel);
      }, bwd_reps, 2);
      rows.push_back({str_cat("mla prefill bwd", what, " (", name, ")"), str_cat("T=", T, " H=", H),
                      bwd_ms, 2.0 * H * pairs * double(3 * Dqk + 2 * Dv), 0});
      if (kernel == cuda::AttentionKernel::Cudnn && docs == 1)
        std::printf("cuDNN T=%lld H=%lld: forward %s, backward %s\n", (long long)T,
                    (long long)H, cuda::cudnn_attention_engine(false, s, scale).c_str(),
                    cuda::cudnn_attention_engine(true, s, scale).c_str());
    }
    arena.reset();
  };
  const std::vector<int64_t> lengths =
      quick ? std::vector<int64_t>{4096} : std::vector<int64_t>{4096, 32768};
  if (!decode_only) {
    for (int64_t T : lengths)
      for (int64_t H : {16, 32}) prefill(T, H, 1);
    for (int64_t T : lengths) prefill(T, 32, 8);
  }

  // ---- absorbed decode: (context, S) = (32K, 1), (32K, 64), (1M, 1)
  struct DecodeCase {
    int context, S;
  };
  std::vector<DecodeCase> decode_cases{{32768, 1}, {32768, 64}};
  if (!quick) decode_cases.push_back({1 << 20, 1});
  for (const DecodeCase& dc : decode_cases) {
    const int Dk = 576, Dvl = 512, context = dc.context, S = dc.S;
    const int max_pages = context / cuda::kMlaDecodePageTokens;
    for (int H : {16, 32}) {
      const size_t pool_rows = size_t(S) * context;
      auto* cache = arena.alloc<uint16_t>(pool_rows * Dk);
      auto* q = arena.alloc<uint16_t>(size_t(S) * H * Dk);
      auto* out = arena.alloc<uint16_t>(size_t(S) * H * Dvl);
      fill_random_bf16(cache, pool_rows * Dk, 7);
      fill_random_bf16(q, size_t(S) * H * Dk, 8, 0.05f);
      // Pages of each sequence scattered over the pool (stride-7 permutation).
      std::vector<int32_t> table(static_cast<size_t>(S) * max_pages),
          lens(static_cast<size_t>(S), context);
      const int64_t pool_pages = int64_t(S) * max_pages;
      for (int64_t i = 0; i < pool_pages; ++i) table[size_t(i)] = int32_t((i * 7) % pool_pages);
      auto* table_dev = arena.alloc<int32_t>(table.size());
      auto* lens_dev = arena.alloc<int32_t>(lens.size());
      cuda::copy_to_device(table_dev, table.data(), table.size() * 4);
      cuda::copy_to_device(lens_dev, lens.data(), lens.size() * 4);
      const cuda::MlaDecodePlan plan = cuda::mla_decode_plan(S, H, max_pages);
      void* ws =
          arena.alloc_bytes(std::max<size_t>(1, cuda::mla_decode_workspace_bytes(plan, S, H, Dvl)));
      cuda::MlaDecodeArgs args;
      args.q = q;
      args.cache = cache;
      args.page_table = table_dev;
      args.seq_len = lens_dev;
      args.out = out;
      args.S = S;
      args.H = H;
      args.Dk = Dk;
      args.Dv = Dvl;
      args.scale = 1.0 / std::sqrt(192.0);
      const double ms = median_ms([&] { cuda::mla_decode_absorbed(args, plan, ws); }, reps);
      rows.push_back(
          {"mla decode (absorbed)",
           str_cat("S=", S, " H=", H, " L=", context >> 10, "K splits=", plan.num_splits), ms,
           2.0 * S * H * double(context) * (Dk + Dvl), double(pool_rows) * Dk * 2.0});
      arena.reset();
    }
  }

  // ---- grouped MoE experts, K3-like expert shape
  if (!decode_only) {
    const int64_t E = 64, Din = 3584, F = 3072;
    const int k = 16;
    GluActivation act;
    act.kind = Activation::SiTU;
    // Weights in their own allocation (3 × 64 × 3584 × 3072 bf16 = 4.2 GB); per-N buffers in
    // `arena`, reset after each N.
    cuda::DeviceArena weights(size_t(3 * E * F * Din) * 2 + 4096);
    auto* gate_w = weights.alloc<uint16_t>(size_t(E * F * Din));
    auto* up_w = weights.alloc<uint16_t>(size_t(E * F * Din));
    auto* down_w = weights.alloc<uint16_t>(size_t(E * Din * F));
    fill_random_bf16(gate_w, size_t(E * F * Din), 9, 0.02f);
    fill_random_bf16(up_w, size_t(E * F * Din), 10, 0.02f);
    fill_random_bf16(down_w, size_t(E * Din * F), 11, 0.02f);
    const cuda::ExpertWeightsBf16 ew{gate_w, up_w, down_w, E, Din, F};
    for (int64_t N : {int64_t(64), int64_t(512)}) {
      std::mt19937 rng(12);
      std::vector<int32_t> experts(static_cast<size_t>(E)), idx(static_cast<size_t>(N * k));
      for (int64_t e = 0; e < E; ++e) experts[size_t(e)] = int32_t(e);
      for (int64_t t = 0; t < N; ++t) {
        std::shuffle(experts.begin(), experts.end(), rng);
        std::sort(experts.begin(), experts.begin() + k);
        std::copy(experts.begin(), experts.begin() + k, idx.begin() + t * k);
      }
      std::vector<float> w(static_cast<size_t>(N * k), 1.0f / k);
      auto* idx_dev = arena.alloc<int32_t>(idx.size());
      auto* w_dev = arena.alloc<float>(w.size());
      auto* x = arena.alloc<uint16_t>(size_t(N * Din));
      auto* y = arena.alloc<uint16_t>(size_t(N * Din));
      cuda::copy_to_device(idx_dev, idx.data(), idx.size() * 4);
      cuda::copy_to_device(w_dev, w.data(), w.size() * 4);
      fill_random_bf16(x, size_t(N * Din), 13);
      std::vector<int64_t> host_offsets(static_cast<size_t>(E) + 1);
      cuda::MoeDispatchPlan plan;
      cuda::moe_dispatch_plan_build(idx_dev, N, k, int(E), &plan, arena, host_offsets.data());
      void* ws = arena.alloc_bytes(cuda::moe_experts_forward_workspace_bytes(N, k, ew));
      for (auto path : {cuda::MoeGemmPath::Grouped, cuda::MoeGemmPath::Loop}) {
        const double ms = median_ms([&] {
          cuda::moe_experts_forward(gemm, x, plan, w_dev, ew, act, y, cuda::GemmOutType::Bf16, ws,
                                    path);
        }, reps);
        rows.push_back({path == cuda::MoeGemmPath::Grouped ? "moe experts (grouped)"
                                                           : "moe experts (loop)",
                        str_cat("E=64 k=16 N=", N, " rows/expert=", N * k / E), ms,
                        2.0 * double(N * k) * 3.0 * double(Din * F), 0});
      }
      arena.reset();
    }
  }

  print_table(rows, peak);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 15;
  bool quick = false, decode_only = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::max(10, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--decode-only"))
      decode_only = true;
    else {
      std::fprintf(stderr, "usage: bench_cuda_mla [--reps N] [--quick] [--decode-only]\n");
      return 2;
    }
  }
  if (!dm::cuda::device_available()) {
    std::printf("bench_cuda_mla: skipped, %s\n", dm::cuda::device_description().c_str());
    return 0;
  }
  try {
    return run(reps, quick, decode_only);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda_mla: %s\n", e.what());
    return 1;
  }
}
#else
int main() {
  std::printf("bench_cuda_mla: skipped, built without the CUDA backend\n");
  return 0;
}
#endif
