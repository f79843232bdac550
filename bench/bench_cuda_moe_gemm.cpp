// GPU benchmark of the grouped expert GEMMs of one MoE layer's training step (moe_kernels.h), at
// the gpu_1b shape by default: 4096 tokens × top-6 over 32 experts (24576 rows, uneven like a
// random router), Din 512, F 1024. One row per product and kernel: the mma.sync kernels, the
// warpgroup-MMA ones in both schedules (moe.h moe_wgmma_overlap), the forward's 128 × 256-tile
// versions (moe.h moe_wgmma_wide) in both, the TMA-fed kernels (moe.h moe_wgmma_tma; the
// forward's at both widths), the persistent pingpong kernels (moe.h moe_wgmma_pingpong; the
// launchers' own dispatch to them is off here, each has its row), and, as the ceiling, one dense
// cuBLASLt GEMM of the same total size. CUDA-event timing, median of --reps runs; each wgmma
// result is also checked against the mma.sync one (relative RMS).
//   bench_cuda_moe_gemm [--tokens 4096] [--top-k 6] [--experts 32] [--din 512] [--ffn 1024]
//                       [--reps 20] [--only SUBSTRING]
// --only: run only the products whose name contains SUBSTRING (e.g. dW, for a profiler).
// A second table times the GLU's two places (moe.h moe_wgmma_fused_glu): the forward's gate and
// up products + the element-wise GLU against the one kernel with the GLU in its epilogue, and the
// backward's dh product + the GLU backward against the dh kernel that applies it (SiTU), each
// also on the pingpong kernels.
// FLOP counted: rows products 2·R·K·N (dx has two), weight gradients 2·R·M·N.
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
#include "ops/cuda/device.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/moe.h"
#include "ops/cuda/moe_kernels.h"

namespace {

using dm::bench::cuda_check;
using dm::bench::fill_random_bf16;
using dm::bench::median_ms;

// Relative RMS of a against b (host copies of two device arrays of n floats or bf16).
double rel_rms_device(const void* a, const void* b, size_t n, bool bf16) {
  std::vector<double> x(n), y(n);
  if (bf16) {
    std::vector<uint16_t> ha(n), hb(n);
    dm::cuda::copy_to_host(ha.data(), a, n * 2);
    dm::cuda::copy_to_host(hb.data(), b, n * 2);
    for (size_t i = 0; i < n; ++i) {
      x[i] = dm::cuda::bf16_to_float(ha[i]);
      y[i] = dm::cuda::bf16_to_float(hb[i]);
    }
  } else {
    std::vector<float> ha(n), hb(n);
    dm::cuda::copy_to_host(ha.data(), a, n * 4);
    dm::cuda::copy_to_host(hb.data(), b, n * 4);
    for (size_t i = 0; i < n; ++i) {
      x[i] = ha[i];
      y[i] = hb[i];
    }
  }
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (x[i] - y[i]) * (x[i] - y[i]);
    den += y[i] * y[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

int run(int argc, char** argv) {
  using namespace dm;
  int64_t tokens = 4096, top_k = 6, E = 32, Din = 512, F = 1024;
  int reps = 20;
  std::string only;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const int64_t v = std::atoll(argv[i + 1]);
    if (a == "--only")
      only = argv[i + 1];
    else if (a == "--tokens")
      tokens = v;
    else if (a == "--top-k")
      top_k = v;
    else if (a == "--experts")
      E = v;
    else if (a == "--din")
      Din = v;
    else if (a == "--ffn")
      F = v;
    else if (a == "--reps")
      reps = int(v);
    else
      throw Error(str_cat("unknown option ", a));
  }
  std::printf("device: %s\n", cuda::device_description().c_str());
  // Rows per expert: top_k distinct experts per token, uniformly at random.
  std::mt19937 rng(7);
  std::vector<int64_t> counts(size_t(E), 0);
  std::vector<int> experts(static_cast<size_t>(E));
  for (int e = 0; e < int(E); ++e) experts[size_t(e)] = e;
  for (int64_t t = 0; t < tokens; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int64_t s = 0; s < top_k; ++s) ++counts[size_t(experts[size_t(s)])];
  }
  std::vector<int64_t> offsets(size_t(E) + 1, 0);
  for (int64_t e = 0; e < E; ++e) offsets[size_t(e) + 1] = offsets[size_t(e)] + counts[size_t(e)];
  const int64_t R = offsets[size_t(E)];
  const auto [lo, hi] = std::minmax_element(counts.begin(), counts.end());
  std::printf("%lld rows over %lld experts (%lld … %lld each), Din %lld, F %lld\n", (long long)R,
              (long long)E, (long long)*lo, (long long)*hi, (long long)Din, (long long)F);

  cuda::DeviceArena arena(size_t(4) << 30);
  auto bf16 = [&](size_t n, uint32_t seed) {
    uint16_t* p = arena.alloc<uint16_t>(n);
    fill_random_bf16(p, n, seed);
    return p;
  };
  int64_t* d_offsets = arena.alloc<int64_t>(offsets.size());
  cuda::copy_to_device(d_offsets, offsets.data(), offsets.size() * sizeof(int64_t));
  const uint16_t* x = bf16(size_t(R * Din), 1);  // sorted token rows
  const uint16_t* h = bf16(size_t(R * F), 2);    // GLU output rows
  const uint16_t* dg = bf16(size_t(R * F), 3);   // gate / up gradients
  const uint16_t* du = bf16(size_t(R * F), 4);
  const uint16_t* dout = bf16(size_t(R * Din), 5);        // output-row gradients
  const uint16_t* w_gate = bf16(size_t(E * F * Din), 6);  // [E, F, Din]
  const uint16_t* w_up = bf16(size_t(E * F * Din), 7);
  const uint16_t* w_down = bf16(size_t(E * Din * F), 8);  // [E, Din, F]
  const size_t big = size_t(std::max(R * F, E * F * Din));
  float* ref_f32 = arena.alloc<float>(big);
  float* out_f32 = arena.alloc<float>(big);
  uint16_t* ref_bf16 = arena.alloc<uint16_t>(big);
  uint16_t* out_bf16 = arena.alloc<uint16_t>(big);
  cuda::GemmContext gemm;

  struct Product {
    const char* name;
    double flop;
    bool bf16_out;
    size_t out_elems;
    std::function<void(bool wgmma, void* out)> run;
    std::function<void()> dense;  // the same FLOPs as one cuBLASLt GEMM
    std::function<void(void* out)> wide = nullptr;  // the 128 × 256-tile wgmma kernel, if any
    std::function<void(bool wide, void* out)> tma = nullptr;  // the TMA-fed kernel, if any
    std::function<void(void* out)> pingpong = nullptr;  // the persistent pingpong kernel, if any
  };
  const double rows = double(R);
  std::vector<Product> products = {
      {"fwd gate (x·W_gateᵀ)", 2 * rows * Din * F, true, size_t(R * F),
       [&](bool w, void* o) {
         auto f = w ? cuda::moe_detail::launch_grouped_rows_nk_bf16_wgmma
                    : cuda::moe_detail::launch_grouped_rows_nk_bf16;
         f(x, w_gate, d_offsets, int(E), R, Din, F, static_cast<uint16_t*>(o), nullptr);
       },
       [&] {
         gemm.gemm_bf16(false, true, R, F, Din, 1.0f, x, Din, w_gate, Din, 0.0f, out_bf16,
                        cuda::GemmOutType::Bf16, F);
       },
       [&](void* o) {
         cuda::moe_detail::launch_grouped_rows_nk_bf16_wgmma_wide(
             x, w_gate, d_offsets, int(E), R, Din, F, static_cast<uint16_t*>(o), nullptr);
       },
       [&](bool wide, void* o) {
         cuda::moe_detail::launch_grouped_rows_nk_bf16_tma(
             x, w_gate, d_offsets, int(E), R, Din, F, static_cast<uint16_t*>(o), wide, nullptr);
       },
       [&](void* o) {
         cuda::moe_detail::launch_grouped_rows_nk_bf16_pingpong(
             x, w_gate, d_offsets, int(E), R, Din, F, static_cast<uint16_t*>(o), nullptr);
       }},
      {"fwd down (h·W_downᵀ)", 2 * rows * F * Din, true, size_t(R * Din),
       [&](bool w, void* o) {
         auto f = w ? cuda::moe_detail::launch_grouped_rows_nk_bf16_wgmma
                    : cuda::moe_detail::launch_grouped_rows_nk_bf16;
         f(h, w_down, d_offsets, int(E), R, F, Din, static_cast<uint16_t*>(o), nullptr);
       },
       [&] {
         gemm.gemm_bf16(false, true, R, Din, F, 1.0f, h, F, w_down, F, 0.0f, out_bf16,
                        cuda::GemmOutType::Bf16, Din);
       },
       [&](void* o) {
         cuda::moe_detail::launch_grouped_rows_nk_bf16_wgmma_wide(
             h, w_down, d_offsets, int(E), R, F, Din, static_cast<uint16_t*>(o), nullptr);
       },
       [&](bool wide, void* o) {
         cuda::moe_detail::launch_grouped_rows_nk_bf16_tma(
             h, w_down, d_offsets, int(E), R, F, Din, static_cast<uint16_t*>(o), wide, nullptr);
       },
       [&](void* o) {
         cuda::moe_detail::launch_grouped_rows_nk_bf16_pingpong(
             h, w_down, d_offsets, int(E), R, F, Din, static_cast<uint16_t*>(o), nullptr);
       }},
      {"bwd dh (dout·W_down)", 2 * rows * Din * F, true, size_t(R * F),
       [&](bool w, void* o) {
         auto f = w ? cuda::moe_detail::launch_grouped_rows_bf16_wgmma
                    : cuda::moe_detail::launch_grouped_rows_bf16;
         f(dout, w_down, d_offsets, int(E), R, Din, F, static_cast<uint16_t*>(o), nullptr);
       },
       [&] {
         gemm.gemm_bf16(false, false, R, F, Din, 1.0f, dout, Din, w_down, F, 0.0f, out_bf16,
                        cuda::GemmOutType::Bf16, F);
       },
       nullptr, nullptr,
       [&](void* o) {
         cuda::moe_detail::launch_grouped_rows_backward_pingpong(
             dout, w_down, nullptr, nullptr, d_offsets, int(E), R, Din, F, o, false, nullptr,
             nullptr, nullptr, nullptr);
       }},
      {"bwd dx (dg·W_gate + du·W_up)", 4 * rows * F * Din, false, size_t(R * Din),
       [&](bool w, void* o) {
         auto f = w ? cuda::moe_detail::launch_grouped_rows_f32_wgmma
                    : cuda::moe_detail::launch_grouped_rows_f32;
         f(dg, w_gate, du, w_up, d_offsets, int(E), R, F, Din, static_cast<float*>(o), nullptr);
       },
       [&] {
         gemm.gemm_bf16(false, false, R, Din, 2 * F, 1.0f, dg, 2 * F, w_gate, Din, 0.0f, out_f32,
                        cuda::GemmOutType::F32, Din);
       },
       nullptr, nullptr,
       [&](void* o) {
         cuda::moe_detail::launch_grouped_rows_backward_pingpong(
             dg, w_gate, du, w_up, d_offsets, int(E), R, F, Din, o, true, nullptr, nullptr, nullptr,
             nullptr);
       }},
      {"bwd dW_gate (dgᵀ·x)", 2 * rows * F * Din, false, size_t(E * F * Din),
       [&](bool w, void* o) {
         if (w)  // accumulating (store = false), as the mma.sync kernel
           cuda::moe_detail::launch_grouped_weight_grad_wgmma(
               dg, F, x, Din, d_offsets, int(E), R, F, Din, static_cast<float*>(o), nullptr);
         else
           cuda::moe_detail::launch_grouped_weight_grad(dg, F, x, Din, d_offsets, int(E), F, Din,
                                                        static_cast<float*>(o), nullptr);
       },
       [&] {
         gemm.gemm_bf16(true, false, F, Din, R, 1.0f, dg, F, x, Din, 0.0f, out_f32,
                        cuda::GemmOutType::F32, Din);
       },
       nullptr, nullptr,
       [&](void* o) {  // accumulating, as the others
         cuda::moe_detail::launch_grouped_weight_grad_pingpong(
             dg, F, x, Din, d_offsets, int(E), R, F, Din, static_cast<float*>(o), nullptr);
       }},
      {"bwd dW_down (doutᵀ·h)", 2 * rows * Din * F, false, size_t(E * Din * F),
       [&](bool w, void* o) {
         if (w)  // accumulating (store = false), as the mma.sync kernel
           cuda::moe_detail::launch_grouped_weight_grad_wgmma(
               dout, Din, h, F, d_offsets, int(E), R, Din, F, static_cast<float*>(o), nullptr);
         else
           cuda::moe_detail::launch_grouped_weight_grad(dout, Din, h, F, d_offsets, int(E), Din, F,
                                                        static_cast<float*>(o), nullptr);
       },
       [&] {
         gemm.gemm_bf16(true, false, Din, F, R, 1.0f, dout, Din, h, F, 0.0f, out_f32,
                        cuda::GemmOutType::F32, F);
       },
       nullptr, nullptr,
       [&](void* o) {
         cuda::moe_detail::launch_grouped_weight_grad_pingpong(
             dout, Din, h, F, d_offsets, int(E), R, Din, F, static_cast<float*>(o), nullptr);
       }},
  };

  // The cp.async-fed kernels unless a row says TMA (moe.h moe_wgmma_tma, which is restored).
  const bool tma_before = cuda::moe_wgmma_tma();
  cuda::moe_set_wgmma_tma(false);
  // The launchers' own dispatch to the pingpong kernels off: it has its own rows below.
  const bool pingpong_before = cuda::moe_wgmma_pingpong();
  cuda::moe_set_wgmma_pingpong(false);
  std::printf(
      "\n| product | kernel | µs | TFLOP/s | rel RMS vs mma.sync |\n|---|---|---:|---:|---:|\n");
  for (const Product& p : products) {
    if (!only.empty() && std::string(p.name).find(only) == std::string::npos) continue;
    void* ref = p.bf16_out ? static_cast<void*>(ref_bf16) : static_cast<void*>(ref_f32);
    void* out = p.bf16_out ? static_cast<void*>(out_bf16) : static_cast<void*>(out_f32);
    auto row = [&](const char* kernel, double ms, const char* err) {
      std::printf("| %s | %s | %.1f | %.1f | %s |\n", p.name, kernel, ms * 1e3,
                  p.flop / (ms * 1e-3) / 1e12, err);
    };
    // The weight gradients accumulate into C: each check starts from zero and runs once, before
    // any timing.
    auto zero = [&](void* o) { cuda_check(cudaMemset(o, 0, p.out_elems * 4), "memset"); };
    zero(ref);
    p.run(false, ref);
    cuda_check(cudaDeviceSynchronize(), "mma.sync");
    // wgmma in both schedules (moe.h moe_wgmma_overlap), fed by cp.async, and (the backward's
    // products) fed by the TMA: checked first, then timed.
    char err[3][32];
    for (int variant = 0; variant < 3; ++variant) {
      const int overlap = variant == 1;
      cuda::moe_set_wgmma_overlap(overlap);
      cuda::moe_set_wgmma_tma(variant == 2);
      if (variant == 2 && p.tma) break;
      zero(out);
      p.run(true, out);
      cuda_check(cudaDeviceSynchronize(), "wgmma");
      std::snprintf(err[variant], sizeof(err[variant]), "%.2e",
                    rel_rms_device(out, ref, p.out_elems, p.bf16_out));
    }
    cuda::moe_set_wgmma_tma(false);
    // The pingpong kernel, checked here too (before the timing accumulates into ref).
    char pingpong_err[32] = "-";
    if (p.pingpong) {
      zero(out);
      p.pingpong(out);
      cuda_check(cudaDeviceSynchronize(), "pingpong");
      std::snprintf(pingpong_err, sizeof(pingpong_err), "%.2e",
                    rel_rms_device(out, ref, p.out_elems, p.bf16_out));
    }
    row("mma.sync", median_ms([&] { p.run(false, ref); }, reps), "-");
    for (int overlap = 0; overlap < 2; ++overlap) {
      cuda::moe_set_wgmma_overlap(overlap == 1);
      row(overlap ? "wgmma, overlapped schedule" : "wgmma",
          median_ms([&] { p.run(true, out); }, reps), err[overlap]);
    }
    // The 128 × 256 tiles (moe.h moe_wgmma_wide), both schedules: checked, then timed.
    for (int overlap = 0; p.wide && overlap < 2; ++overlap) {
      cuda::moe_set_wgmma_overlap(overlap == 1);
      p.wide(out);
      cuda_check(cudaDeviceSynchronize(), "wgmma wide");
      char wide_err[32];
      std::snprintf(wide_err, sizeof(wide_err), "%.2e",
                    rel_rms_device(out, ref, p.out_elems, p.bf16_out));
      row(overlap ? "wgmma 128 × 256, overlapped schedule" : "wgmma 128 × 256",
          median_ms([&] { p.wide(out); }, reps), wide_err);
    }
    cuda::moe_set_wgmma_overlap(false);
    // The TMA-fed kernels (moe.h moe_wgmma_tma): the forward's at 128 × 128 and 128 × 256
    // (their own launcher), the backward's through the same launchers with the switch on (its
    // check ran with the others', before ref was accumulated into by the timing).
    if (!p.tma) {
      cuda::moe_set_wgmma_tma(true);
      row("TMA-fed", median_ms([&] { p.run(true, out); }, reps), err[2]);
      cuda::moe_set_wgmma_tma(false);
    }
    for (int wide = 0; p.tma && wide < 2; ++wide) {
      p.tma(wide == 1, out);
      cuda_check(cudaDeviceSynchronize(), "tma");
      char tma_err[32];
      std::snprintf(tma_err, sizeof(tma_err), "%.2e",
                    rel_rms_device(out, ref, p.out_elems, p.bf16_out));
      row(wide ? "TMA-fed 128 × 256" : "TMA-fed 128 × 128",
          median_ms([&] { p.tma(wide == 1, out); }, reps), tma_err);
    }
    if (p.pingpong)
      row("pingpong, persistent", median_ms([&] { p.pingpong(out); }, reps), pingpong_err);
    row("cuBLASLt, one dense GEMM of the same size", median_ms(p.dense, reps), "-");
  }

  cuda::moe_set_wgmma_tma(tma_before);
  cuda::moe_set_wgmma_pingpong(pingpong_before);

  // The GLU apart vs in the products' epilogues (SiTU, the gpu_1b activation). Outputs of the
  // fused kernels checked against the separate passes' (relative RMS over h, and dg + du).
  if (only.empty() || std::string("GLU").find(only) != std::string::npos) {
    cuda::GluKernelParams act;
    act.situ = true;
    uint16_t* gate = arena.alloc<uint16_t>(size_t(R * F));
    uint16_t* up = arena.alloc<uint16_t>(size_t(R * F));
    uint16_t* h_separate = arena.alloc<uint16_t>(size_t(R * F));
    uint16_t* h_fused = arena.alloc<uint16_t>(size_t(R * F));
    auto forward_separate = [&] {
      cuda::moe_detail::launch_grouped_rows_nk_bf16_wgmma(x, w_gate, d_offsets, int(E), R, Din, F,
                                                          gate, nullptr);
      cuda::moe_detail::launch_grouped_rows_nk_bf16_wgmma(x, w_up, d_offsets, int(E), R, Din, F, up,
                                                          nullptr);
      cuda::glu_forward(gate, up, h_separate, R * F, act);
    };
    auto forward_fused = [&] {  // g and u kept, as the training forward does
      cuda::moe_detail::launch_grouped_gate_up_glu_wgmma(x, w_gate, w_up, d_offsets, int(E), R, Din,
                                                         F, gate, up, h_fused, act, nullptr);
    };
    auto forward_pingpong = [&] {  // the persistent kernel, g and u kept
      cuda::moe_detail::launch_grouped_gate_up_glu_pingpong(
          x, w_gate, w_up, d_offsets, int(E), R, Din, F, gate, up, h_fused, act, nullptr);
    };
    auto forward_pingpong_separate = [&] {
      cuda::moe_detail::launch_grouped_rows_nk_bf16_pingpong(x, w_gate, d_offsets, int(E), R, Din,
                                                             F, gate, nullptr);
      cuda::moe_detail::launch_grouped_rows_nk_bf16_pingpong(x, w_up, d_offsets, int(E), R, Din, F,
                                                             up, nullptr);
      cuda::glu_forward(gate, up, h_separate, R * F, act);
    };
    forward_separate();
    forward_pingpong();
    cuda_check(cudaDeviceSynchronize(), "GLU forward, pingpong");
    const double pingpong_err = rel_rms_device(h_fused, h_separate, size_t(R * F), true);
    forward_fused();
    cuda_check(cudaDeviceSynchronize(), "GLU forward");
    const double forward_err = rel_rms_device(h_fused, h_separate, size_t(R * F), true);
    // Backward: from the (g, u) just computed; dh over a scratch, du over a copy of u.
    uint16_t* up_copy = arena.alloc<uint16_t>(size_t(R * F));
    uint16_t* dg_separate = arena.alloc<uint16_t>(size_t(R * F));
    uint16_t* du_separate = arena.alloc<uint16_t>(size_t(R * F));
    uint16_t* dg_fused = arena.alloc<uint16_t>(size_t(R * F));
    auto backward_separate = [&] {
      cuda::moe_detail::launch_grouped_rows_bf16_wgmma(dout, w_down, d_offsets, int(E), R, Din, F,
                                                       dg_separate, nullptr);
      cuda::glu_backward(gate, up, dg_separate, dg_separate, du_separate, R * F, act);
    };
    auto backward_fused = [&] {  // du over up_copy: refreshed before the check run only
      cuda::moe_detail::launch_grouped_rows_glu_backward_wgmma(
          dout, w_down, d_offsets, int(E), R, Din, F, gate, up_copy, dg_fused, act, nullptr);
    };
    auto backward_pingpong = [&] {  // du over up_copy, as backward_fused
      cuda::moe_detail::launch_grouped_rows_backward_pingpong(
          dout, w_down, nullptr, nullptr, d_offsets, int(E), R, Din, F, dg_fused, false, gate,
          up_copy, &act, nullptr);
    };
    // The wgmma launchers' own dispatch to the pingpong kernel off: it has its own row.
    const bool pingpong_glu_before = cuda::moe_wgmma_pingpong();
    cuda::moe_set_wgmma_pingpong(false);
    cuda_check(cudaMemcpy(up_copy, up, size_t(R * F) * 2, cudaMemcpyDeviceToDevice), "copy");
    backward_separate();
    backward_pingpong();
    cuda_check(cudaDeviceSynchronize(), "GLU backward, pingpong");
    const double dg_pingpong_err = rel_rms_device(dg_fused, dg_separate, size_t(R * F), true);
    const double du_pingpong_err = rel_rms_device(up_copy, du_separate, size_t(R * F), true);
    cuda_check(cudaMemcpy(up_copy, up, size_t(R * F) * 2, cudaMemcpyDeviceToDevice), "copy");
    backward_fused();
    cuda_check(cudaDeviceSynchronize(), "GLU backward");
    const double dg_err = rel_rms_device(dg_fused, dg_separate, size_t(R * F), true);
    const double du_err = rel_rms_device(up_copy, du_separate, size_t(R * F), true);
    std::printf("\n| GLU | kernels | µs | rel RMS fused vs separate |\n|---|---|---:|---:|\n");
    std::printf("| forward | gate, up products + GLU pass | %.1f | - |\n",
                median_ms(forward_separate, reps) * 1e3);
    std::printf("| forward | one product, GLU in its epilogue | %.1f | %.2e |\n",
                median_ms(forward_fused, reps) * 1e3, forward_err);
    std::printf("| forward | pingpong: gate, up products + GLU pass | %.1f | - |\n",
                median_ms(forward_pingpong_separate, reps) * 1e3);
    std::printf("| forward | pingpong: one product, GLU in its epilogue | %.1f | %.2e |\n",
                median_ms(forward_pingpong, reps) * 1e3, pingpong_err);
    // The parts of the separate forward: what the fused epilogue is measured against.
    std::printf("| forward, part | gate, up products alone | %.1f | - |\n",
                median_ms(
                    [&] {
                      cuda::moe_detail::launch_grouped_rows_nk_bf16_wgmma(
                          x, w_gate, d_offsets, int(E), R, Din, F, gate, nullptr);
                      cuda::moe_detail::launch_grouped_rows_nk_bf16_wgmma(
                          x, w_up, d_offsets, int(E), R, Din, F, up, nullptr);
                    },
                    reps) *
                    1e3);
    std::printf(
        "| forward, part | GLU pass alone | %.1f | - |\n",
        median_ms([&] { cuda::glu_forward(gate, up, h_separate, R * F, act); }, reps) * 1e3);
    std::printf("| backward | dh product + GLU backward pass | %.1f | - |\n",
                median_ms(backward_separate, reps) * 1e3);
    std::printf(
        "| backward | dh product, GLU backward in its epilogue | %.1f | dg %.2e, du %.2e |\n",
        median_ms(backward_fused, reps) * 1e3, dg_err, du_err);
    std::printf(
        "| backward | pingpong: dh product, GLU backward in its epilogue | %.1f | dg %.2e, du "
        "%.2e |\n",
        median_ms(backward_pingpong, reps) * 1e3, dg_pingpong_err, du_pingpong_err);
    std::printf("| backward, part | dh product alone | %.1f | - |\n",
                median_ms(
                    [&] {
                      cuda::moe_detail::launch_grouped_rows_bf16_wgmma(
                          dout, w_down, d_offsets, int(E), R, Din, F, dg_separate, nullptr);
                    },
                    reps) *
                    1e3);
    std::printf(
        "| backward, part | GLU backward pass alone | %.1f | - |\n",
        median_ms(
            [&] { cuda::glu_backward(gate, up, dg_separate, dg_fused, du_separate, R * F, act); },
            reps) *
            1e3);
    cuda::moe_set_wgmma_pingpong(pingpong_glu_before);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return dm::bench::run_on_gpu(argc, argv, run); }
#else
int main() {
  std::printf("built without the CUDA backend\n");
  return 0;
}
#endif
