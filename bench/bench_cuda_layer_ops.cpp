// GPU benchmark of the memory-bound element kernels of the KDA and MLA layers at one training
// step's shape (gpu_1b by default: 4096 tokens, 16 heads of 128, the KDA short conv over 2048
// channels with 4 taps, MLA nope 128 / rope 64 / v 128, latent 512, packed documents). One row per
// kernel: the median of --reps CUDA-event timings, the bytes it must move (each input read once,
// each output written once) and the bandwidth those give, against the measured device-to-device
// copy of the same byte count as the ceiling.
//   bench_cuda_layer_ops [--tokens 4096] [--heads 16] [--reps 50]
// DM_SHORT_CONV_WIDE=0 runs the short conv's one-channel kernels (the wide ones are the default).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#if DELTAMOE_HAVE_CUDA
#include "core/error.h"
#include "cuda_bench_util.h"
#include "ops/cuda/device.h"
#include "ops/cuda/kda_layer_backward_ops.h"
#include "ops/cuda/kda_layer_ops.h"
#include "ops/cuda/mla_layer_ops.h"

namespace {

using dm::bench::fill_random_bf16;
using dm::bench::median_ms;
namespace cuda = dm::cuda;

struct Row {
  std::string name;
  double ms, bytes;
};

int run(int argc, char** argv) {
  int64_t N = 4096, H = 16;
  int reps = 50;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--tokens"))
      N = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--heads"))
      H = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--reps"))
      reps = std::atoi(argv[i + 1]);
    else
      throw dm::Error(dm::str_cat("bench_cuda_layer_ops: unknown option ", argv[i]));
  }
  const int64_t D = 128, C = H * D, Kc = 4;                  // KDA
  const int64_t nope = 128, rope = 64, dv = 128, kvl = 512;  // MLA
  const int64_t dq = nope + rope, kv_width = nope + dv, a_width = kvl + rope;
  cuda::DeviceArena arena(size_t(2) << 30);
  auto bf16 = [&](size_t n, uint32_t seed) {
    uint16_t* p = arena.alloc<uint16_t>(n);
    fill_random_bf16(p, n, seed);
    return p;
  };
  auto f32 = [&](size_t n, float value) {
    std::vector<float> host(n, value);
    float* p = arena.alloc<float>(n);
    cuda::copy_to_device(p, host.data(), n * 4);
    return p;
  };
  // Packed documents of 1000 tokens (the kernels' document-start reads are part of the cost).
  std::vector<int32_t> starts(static_cast<size_t>(N));
  for (int64_t t = 0; t < N; ++t) starts[size_t(t)] = int32_t(t - t % 1000);
  int32_t* doc_start = arena.alloc<int32_t>(size_t(N));
  cuda::copy_to_device(doc_start, starts.data(), size_t(N) * 4);

  std::vector<Row> rows;
  auto time = [&](const std::string& name, double bytes, const std::function<void()>& fn) {
    rows.push_back({name, median_ms(fn, reps), bytes});
  };
  const size_t nc = size_t(N * C);

  // ---- KDA: short conv + SiLU over q, k or v [N, C]; gated RMSNorm over [N·H, D].
  {
    const uint16_t* x = bf16(nc, 1);
    uint16_t* y = arena.alloc<uint16_t>(nc);
    const float* w = f32(size_t(C * Kc), 0.25f);
    const float* dy = f32(nc, 0.01f);
    uint16_t* dx = arena.alloc<uint16_t>(nc);
    float* dw = f32(size_t(C * Kc), 0.0f);
    float* partial =
        arena.alloc<float>(cuda::kda_short_conv_silu_backward_partial_floats(N, C, Kc));
    time("KDA short conv + SiLU forward", nc * 4.0,
         [&] { cuda::kda_short_conv_silu_forward(x, w, y, 1, N, C, int(Kc), doc_start); });
    time("KDA short conv + SiLU backward", nc * 8.0, [&] {
      cuda::kda_short_conv_silu_backward(x, w, dy, dx, dw, partial, 1, N, C, int(Kc), doc_start);
    });
  }
  {
    const int64_t rows_n = N * H;
    const uint16_t* x = bf16(nc, 2);
    const uint16_t* gate = bf16(nc, 3);
    const float* w = f32(size_t(D), 1.0f);
    const float* dy = f32(nc, 0.01f);
    uint16_t* y = arena.alloc<uint16_t>(nc);
    uint16_t* dx = arena.alloc<uint16_t>(nc);
    uint16_t* dgate = arena.alloc<uint16_t>(nc);
    float* dw = f32(size_t(D), 0.0f);
    float* partial = arena.alloc<float>(cuda::kda_rmsnorm_gated_backward_partial_floats(rows_n, D));
    time("KDA gated RMSNorm forward", nc * 6.0,
         [&] { cuda::kda_rmsnorm_gated_forward(x, w, gate, y, rows_n, D, 1e-5f); });
    time("KDA gated RMSNorm backward", nc * 12.0, [&] {
      cuda::kda_rmsnorm_gated_backward(x, w, gate, dy, dx, dgate, dw, partial, rows_n, D, 1e-5f);
    });
  }
  // ---- MLA: key/value assembly and its transpose; the output gate's kernels over [N, H·dv].
  {
    const size_t kv_n = size_t(N * H * kv_width), k_n = size_t(N * H * dq),
                 v_n = size_t(N * H * dv);
    const uint16_t* kv = bf16(kv_n, 4);
    const float* kv_a = f32(size_t(N * a_width), 0.5f);
    float* cos = f32(size_t(N * rope / 2), 0.8f);
    float* sin = f32(size_t(N * rope / 2), 0.6f);
    uint16_t* k = arena.alloc<uint16_t>(k_n);
    uint16_t* v = arena.alloc<uint16_t>(v_n);
    uint16_t* d_kv = arena.alloc<uint16_t>(kv_n);
    uint16_t* d_kv_a = arena.alloc<uint16_t>(size_t(N * a_width));
    time("MLA assemble k, v", (kv_n + k_n + v_n) * 2.0 + N * rope * 4.0, [&] {
      cuda::mla_assemble_kv(kv, kv_a, 1, N, H, nope, rope, dv, kvl, cos, sin, doc_start, k, v);
    });
    time("MLA split k, v gradients", (k_n + v_n + kv_n) * 2.0 + N * rope * 2.0, [&] {
      cuda::mla_split_kv_grad(k, v, 1, N, H, nope, rope, dv, kvl, cos, sin, doc_start, d_kv,
                              d_kv_a);
    });
    const uint16_t* g = bf16(v_n, 5);
    const float* d_out = f32(v_n, 0.01f);
    uint16_t* out = arena.alloc<uint16_t>(v_n);
    uint16_t* dg = arena.alloc<uint16_t>(v_n);
    time("MLA output gate (into)", v_n * 6.0,
         [&] { cuda::mla_gate_multiply_into(v, g, out, int64_t(v_n)); });
    time("MLA output gate backward", v_n * 12.0,
         [&] { cuda::mla_gate_backward(d_out, v, g, dg, out, int64_t(v_n)); });
  }
  // The ceiling: a device-to-device copy moving 64 MB (read + write).
  {
    const size_t bytes = size_t(32) << 20;
    void* a = arena.alloc_bytes(bytes);
    void* b = arena.alloc_bytes(bytes);
    time("device-to-device copy (ceiling)", bytes * 2.0,
         [&] { cuda::copy_device_to_device(b, a, bytes); });
  }

  std::printf("bench_cuda_layer_ops on %s: %lld tokens, %lld heads of %lld; median of %d\n",
              cuda::device_description().c_str(), (long long)N, (long long)H, (long long)D, reps);
  std::printf("| kernel | µs | MB moved | GB/s |\n|---|---:|---:|---:|\n");
  for (const Row& r : rows)
    std::printf("| %s | %.1f | %.1f | %.0f |\n", r.name.c_str(), r.ms * 1e3, r.bytes / 1e6,
                r.bytes / (r.ms * 1e-3) / 1e9);
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
