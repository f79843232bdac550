// Benchmark of the CUDA KDA kernels (ops/cuda/kda.h): chunked forward and forward+backward at
// the shapes of issue 5, bf16 and fp32 inputs, plus one recurrent decode step of many sequences.
// The backward is timed with both paths (KdaBackwardPath) for bf16 inputs, and with the tensor-core
// paths (fused and split stage 4) reusing the forward's workspace (workspace_holds_forward).
// Plain main (no Google Benchmark fixtures): CUDA-event timing, 2 warm-up runs, median of 10.
// Without a GPU (or without the CUDA backend) it prints why and exits 0.
//   bench_cuda_kda [--shapes BxTxHxD,...] [--reps N] [--bf16-only] [--phases]
// --phases: after each bf16 shape, the SM-cycle split of one block of the backward's stage 4 and
// of the forward's prepare stage.
// (fewer shapes and repetitions keep a kernel profiler's run short, e.g. under ncu).
//
// FLOP convention (shared with bench/peers/kda_peers.py so the columns compare): per chunk of
// C = 64 tokens of one head, the chunked form's products
//   2C²K (L, P) + C²(K+V) (forward substitution for W, U) + 6CKV (W·S, Keᵀ·V', Qd·S) + C²V (P·V'),
// and the backward counted as twice the forward (fwd+bwd = 3 × fwd).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <string>
#include <vector>

#if DELTAMOE_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda_bench_util.h"
#include "ops/cuda/device.h"
#include "ops/cuda/kda.h"

namespace {

namespace cu = dm::cuda;

struct BenchShape {
  int64_t B, T, H, D;
};

double chunked_forward_flops(const BenchShape& s) {
  const double C = 64, K = double(s.D), V = double(s.D);
  const double chunks = std::ceil(double(s.T) / C) * double(s.B * s.H);
  return chunks * (2 * C * C * K + C * C * (K + V) + 6 * C * K * V + C * C * V);
}

// Deterministic pseudo-random fill without <random>'s cost on 10⁸ elements.
struct Lcg {
  uint64_t state;
  float uniform() {  // [0, 1)
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return float(state >> 40) * (1.0f / 16777216.0f);
  }
  float centered() { return 2.0f * uniform() - 1.0f; }
};

// Median of `reps` timings of fn() in milliseconds, after `warmup` untimed runs.
int g_reps = 10;
bool g_phases = false;  // --phases: print the stage-4 phase clock after each bf16 shape

template <typename Fn>
double time_median_ms(Fn&& fn, int warmup = 2, int reps = g_reps) {
  return dm::bench::median_ms(fn, reps, warmup);
}

// All device buffers of one shape in one arena; Storage = float or uint16_t (bf16).
// Prints one block's phase clock (cycles since its start; per phase its own cycles and share).
template <typename Read>
void print_phases(const char* what, Read&& read) {
  long long cycles[32];
  const char* names[32];
  const int n = read(cycles, names, 32);
  std::printf("%s, one block (cycles since its start; phase: its own cycles):", what);
  for (int i = 1; i < n; ++i)
    std::printf(" %s: %lld (%.0f%%);", names[i], cycles[i] - cycles[i - 1],
                100.0 * double(cycles[i] - cycles[i - 1]) / double(cycles[n - 1]));
  std::printf(" total %lld\n", cycles[n - 1]);
}

template <typename Storage>
void bench_shape(const BenchShape& bs, const char* dtype) {
  const dm::KdaShape s{bs.B, bs.T, bs.H, bs.D, bs.D};
  const size_t n_qk = size_t(s.B * s.T * s.H * s.K), n_beta = size_t(s.B * s.T * s.H);
  const size_t n_state = size_t(s.B * s.H * s.K * s.V);
  const size_t ws_forward = cu::kda_chunk_forward_workspace_bytes(s);
  const size_t ws_backward =
      cu::kda_chunk_backward_workspace_bytes(s, cu::KdaBackwardPath::TensorCoreSplit);
  const size_t bytes = 6 * n_qk * sizeof(Storage) + n_beta * sizeof(Storage) +
                       (4 * n_qk + 2 * n_beta) * sizeof(float) + 4 * n_state * sizeof(float) +
                       std::max(ws_forward, ws_backward) + (size_t(64) << 20);
  cu::DeviceArena arena(bytes);
  auto upload = [&](size_t n, auto&& draw) {
    std::vector<Storage> host(n);
    for (auto& e : host) {
      const float x = draw();
      if constexpr (sizeof(Storage) == 2) e = cu::float_to_bf16(x);
      else e = x;
    }
    Storage* device = arena.alloc<Storage>(n);
    cu::copy_to_device(device, host.data(), n * sizeof(Storage));
    return device;
  };
  Lcg rng{12345};
  const Storage* q = upload(n_qk, [&] { return rng.centered(); });
  const Storage* k = upload(n_qk, [&] { return rng.centered(); });
  const Storage* v = upload(n_qk, [&] { return rng.centered(); });
  // Log-decays −e^{U(−6, 0.5)} ∈ [−1.6, −0.0025] per step and channel.
  const Storage* g = upload(n_qk, [&] { return -std::exp(-6.0f + 6.5f * rng.uniform()); });
  const Storage* beta = upload(n_beta, [&] { return rng.uniform(); });
  const Storage* d_o = upload(n_qk, [&] { return rng.centered(); });
  Storage* o = arena.alloc<Storage>(n_qk);
  float* s0 = arena.alloc<float>(n_state);
  float* sT = arena.alloc<float>(n_state);
  float* ds0 = arena.alloc<float>(n_state);
  float* dq = arena.alloc<float>(n_qk);
  float* dk = arena.alloc<float>(n_qk);
  float* dv = arena.alloc<float>(n_qk);
  float* dg = arena.alloc<float>(n_qk);
  float* dbeta = arena.alloc<float>(n_beta);
  void* ws = arena.alloc_bytes(std::max(ws_forward, ws_backward));
  cu::fill_zero(s0, n_state * sizeof(float));
  const float scale = 1.0f / std::sqrt(float(s.K));

  const double forward_ms = time_median_ms([&] {
    cu::kda_chunk_forward(q, k, v, g, beta, s0, o, sT, s, scale, ws);
  });
  cu::check_last_error("bench kda_chunk_forward");
  // fwd+bwd with each stage-4 path of the backward (fp32 inputs have the reference path only).
  auto time_forward_backward = [&](cu::KdaBackwardPath path, bool reuse_forward = false) {
    return time_median_ms([&] {
      cu::kda_chunk_forward(q, k, v, g, beta, s0, o, sT, s, scale, ws);
      if constexpr (sizeof(Storage) == 2)
        cu::kda_chunk_backward(q, k, v, g, beta, s0, d_o, nullptr, dq, dk, dv, dg, dbeta, ds0, s,
                               scale, ws, nullptr, nullptr, path, reuse_forward);
      else
        cu::kda_chunk_backward(q, k, v, g, beta, s0, d_o, nullptr, dq, dk, dv, dg, dbeta, ds0, s,
                               scale, ws);
    });
  };
  const double reference_ms = time_forward_backward(cu::KdaBackwardPath::Reference);
  cu::check_last_error("bench kda_chunk_backward (reference)");
  double tensor_core_ms = NAN, reuse_ms = NAN, split_ms = NAN;
  if constexpr (sizeof(Storage) == 2) {
    tensor_core_ms = time_forward_backward(cu::KdaBackwardPath::TensorCore);
    reuse_ms = time_forward_backward(cu::KdaBackwardPath::TensorCore, true);
    split_ms = time_forward_backward(cu::KdaBackwardPath::TensorCoreSplit, true);
    cu::check_last_error("bench kda_chunk_backward (tensor cores)");
    if (g_phases) {  // one more reusing backward (and forward) with each phase clock on
      cu::kda_stage4_phase_clock(true);
      time_forward_backward(cu::KdaBackwardPath::TensorCore, true);
      cu::kda_stage4_phase_clock(false);
      print_phases("stage 4 phases", cu::kda_stage4_phase_cycles);
      cu::kda_stage4_split_phase_clock(true);
      time_forward_backward(cu::KdaBackwardPath::TensorCoreSplit, true);
      cu::kda_stage4_split_phase_clock(false);
      print_phases("split stage 4, value kernel phases", [](long long* c, const char** n, int m) {
        return cu::kda_stage4_split_phase_cycles(0, c, n, m);
      });
      print_phases("split stage 4, key kernel phases", [](long long* c, const char** n, int m) {
        return cu::kda_stage4_split_phase_cycles(1, c, n, m);
      });
      cu::kda_prepare_phase_clock(true);
      time_forward_backward(cu::KdaBackwardPath::TensorCore, true);
      cu::kda_prepare_phase_clock(false);
      print_phases("prepare phases", cu::kda_prepare_phase_cycles);
    }
  }
  double best_ms = reference_ms;
  for (double t : {tensor_core_ms, reuse_ms, split_ms})
    if (!std::isnan(t)) best_ms = std::min(best_ms, t);
  const double flops = chunked_forward_flops(bs);
  // fp32 inputs have no tensor-core stage 4: "—" in that column.
  auto cell = [](double ms, int width) {
    char text[32];
    if (std::isnan(ms)) std::snprintf(text, sizeof text, "%*s", width, "—");
    else std::snprintf(text, sizeof text, "%*.3f", width, ms);
    return std::string(text);
  };
  std::printf("| %-22s | %-4s | %9.3f | %14.3f | %s | %s | %s | %9.2f | %13.2f |\n",
              ("(" + std::to_string(bs.B) + "," + std::to_string(bs.T) + "," +
               std::to_string(bs.H) + "," + std::to_string(bs.D) + ")")
                  .c_str(),
              dtype, forward_ms, reference_ms, cell(tensor_core_ms, 13).c_str(),
              cell(reuse_ms, 16).c_str(), cell(split_ms, 16).c_str(), flops / (forward_ms * 1e9),
              3 * flops / (best_ms * 1e9));
  std::fflush(stdout);
}

// One decode step (T = 1) of `sequences` sequences, state in place; memory-bound: each state
// element is read and written once (8 bytes).
void bench_decode(int64_t sequences, int64_t H, int64_t D) {
  const dm::KdaShape s{sequences, 1, H, D, D};
  const size_t n_qk = size_t(sequences * H * D), n_state = size_t(sequences * H * D * D);
  cu::DeviceArena arena(n_state * 4 + 6 * n_qk * 2 + (size_t(16) << 20));
  float* state = arena.alloc<float>(n_state);
  uint16_t* inputs = arena.alloc<uint16_t>(5 * n_qk);
  uint16_t* o = arena.alloc<uint16_t>(n_qk);
  cu::fill_zero(state, n_state * 4);
  cu::fill_zero(inputs, 5 * n_qk * 2);  // zeros: g = 0 (no decay), the timing does not depend on values
  const double ms = time_median_ms([&] {
    cu::kda_recurrent_forward(inputs, inputs + n_qk, inputs + 2 * n_qk, inputs + 3 * n_qk,
                              inputs + 4 * n_qk, state, o, state, s, 0.088f);
  });
  cu::check_last_error("bench kda_recurrent_forward");
  std::printf("decode step: %lld sequences x %lld heads x %lldx%lld fp32 state: %.3f ms, %.0f GB/s "
              "of state traffic\n",
              (long long)sequences, (long long)H, (long long)D, (long long)D, ms,
              double(n_state) * 8.0 / (ms * 1e6));
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<BenchShape> shapes = {{1, 8192, 16, 128}, {1, 8192, 96, 128}, {2, 16384, 16, 128}};
  bool bf16_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--bf16-only") {
      bf16_only = true;
    } else if (arg == "--phases") {
      g_phases = true;
    } else if (arg == "--reps" && i + 1 < argc) {
      g_reps = std::max(1, std::atoi(argv[++i]));
    } else if (arg == "--shapes" && i + 1 < argc) {
      shapes.clear();
      std::string list = argv[++i];
      for (size_t at = 0; at <= list.size();) {
        const size_t end = std::min(list.find(',', at), list.size());
        BenchShape s{};
        long long b, t, h, d;
        if (std::sscanf(list.substr(at, end - at).c_str(), "%lldx%lldx%lldx%lld", &b, &t, &h, &d) != 4 ||
            b < 1 || t < 1 || h < 1 || d < 1 || d > 128) {
          std::fprintf(stderr, "bench_cuda_kda: bad shape in '%s' (BxTxHxD, D <= 128)\n", list.c_str());
          return 2;
        }
        s = {b, t, h, d};
        shapes.push_back(s);
        at = end + 1;
      }
    } else {
      std::fprintf(stderr, "usage: bench_cuda_kda [--shapes BxTxHxD,...] [--reps N] [--bf16-only] [--phases]\n");
      return 2;
    }
  }
  if (!cu::device_available()) {
    std::printf("bench_cuda_kda: skipped (%s)\n", cu::device_description().c_str());
    return 0;
  }
  std::printf("bench_cuda_kda on %s\n", cu::device_description().c_str());
  std::printf("ours: chunked KDA, C=64; TFLOP/s by the nominal chunked-form count (see source)\n");
  std::printf(
      "fwd+bwd ms per path of the backward: ref (fp32 CUDA cores), tc (tensor cores, bf16 "
      "only), tc reusing the forward's workspace (no recompute of the prepare and state "
      "stages, as in training), the split stage 4 (value and key kernels) reusing it; "
      "fwd+bwd TF/s from the fastest\n");
  std::printf(
      "| (B,T,H,D)              | in   |    fwd ms | fwd+bwd ms ref | fwd+bwd ms tc | fwd+bwd tc "
      "reuse | split tc reuse   | fwd TF/s  | fwd+bwd TF/s  |\n");
  std::printf(
      "|------------------------|------|-----------|----------------|---------------|--------------"
      "----|------------------|-----------|---------------|\n");
  for (const BenchShape& s : shapes) bench_shape<uint16_t>(s, "bf16");
  if (bf16_only) return 0;
  for (const BenchShape& s : shapes) bench_shape<float>(s, "fp32");
  bench_decode(128, 96, 128);
  return 0;
}
#else
int main(int, char**) {
  std::printf("bench_cuda_kda: skipped (built without the CUDA backend)\n");
  return 0;
}
#endif
