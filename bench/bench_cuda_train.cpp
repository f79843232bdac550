// GPU training throughput (train/train_bench.h on the "cuda" engine, as `deltamoe bench train
// --device cuda`): random init, random tokens, forward + backward (per-layer recompute) + clip +
// AdamW per step; median tokens/s over --steps steps after --warmup (2) steps, MFU, device memory,
// and one JSON line for scripts/device-summary.py. Mirrors
// `bench/peers/deltamoe_torch.py train-bench --device cuda --dtype bfloat16`.
//   bench_cuda_train --config configs/gpu_1b.json --batch 1 --seq 4096 --steps 5 [--recompute off]
//                    [--accum 1] [--ab NAME=v1,v2,... [--rounds 2]]
// --recompute off: the KDA, MLA and MoE layers keep their forward internals instead of
// recomputing them.
// --accum K: K micro-batches of batch × seq per optimizer step (gradients accumulated), so the
// optimizer's fixed cost (~14 ms for gpu_1b's 1.4B fp32 parameters) is paid once per K.
// --ab NAME=v1,v2: after one set-up, `rounds` rounds each measuring every value of the environment
// switch NAME in turn (kernels read their switches at each call), one line per measurement and a
// median per value at the end: an A/B on one machine without paying the init per variant.
// MFU counts the model FLOPs of the step (no recompute; model/plan.h train_flops_per_token:
// 6 · active parameters per token for the matrices, plus the MLA layers' causal attention), over
// the H200's dense bf16 peak of 989 TFLOP/s.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if DELTAMOE_HAVE_CUDA
#include "core/error.h"
#include "io/config.h"
#include "model/params.h"
#include "ops/cuda/device.h"
#include "train/train_bench.h"

namespace {

// --ab: one line per measurement, then each value's median step.
int run_ab(dm::TrainBench& bench, const std::string& spec, int rounds, double peak_tflops) {
  dm::TrainBenchAb ab = dm::parse_train_bench_ab(spec);
  dm::run_train_bench_ab(
      bench, ab, rounds, [&](int round, size_t v, const dm::TrainBenchResult& r) {
        std::printf(
            "round %d %s=%s: step %.2f ms (fwd+bwd %.2f), %.0f tokens/s, "
            "MFU %.2f%%\n",
            round, ab.name.c_str(), ab.values[v].c_str(), r.step_s * 1e3,
            r.forward_backward_s * 1e3, r.tokens_per_s(), 100.0 * r.model_tflops() / peak_tflops);
        std::fflush(stdout);
      });
  for (size_t v = 0; v < ab.values.size(); ++v) {
    const auto& ms = ab.step_ms[v];
    std::printf("%s=%s: median step %.2f ms over %d rounds (min %.2f, max %.2f)\n", ab.name.c_str(),
                ab.values[v].c_str(), ab.median_ms(v), rounds,
                *std::min_element(ms.begin(), ms.end()), *std::max_element(ms.begin(), ms.end()));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string config = "configs/gpu_1b.json";
  int64_t B = 1, T = 4096, accum = 1;
  int steps = 5, warmup = 2;
  double peak_tflops = 989.0;
  bool recompute = true;
  std::string ab;  // NAME=v1,v2,...
  int rounds = 2;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--config")) config = argv[i + 1];
    else if (!std::strcmp(argv[i], "--batch")) B = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--seq")) T = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--accum"))
      accum = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--steps")) steps = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--warmup"))
      warmup = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--peak-tflops")) peak_tflops = std::atof(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--recompute")) recompute = std::strcmp(argv[i + 1], "off") != 0;
    else if (!std::strcmp(argv[i], "--ab"))
      ab = argv[i + 1];
    else if (!std::strcmp(argv[i], "--rounds"))
      rounds = std::atoi(argv[i + 1]);
  }
  try {
    if (!dm::cuda::device_available()) {
      std::printf("no GPU: %s\n", dm::cuda::device_description().c_str());
      return 0;
    }
    const dm::ModelConfig c = dm::load_config(config);
    dm::TrainBenchOptions o;
    o.device = "cuda";
    o.batch = B;
    o.seq = T;
    o.accum = accum;
    o.steps = steps;
    o.warmup = warmup;
    o.recompute = recompute;
    dm::TrainBench bench(c, o);
    if (!ab.empty()) return run_ab(bench, ab, rounds, peak_tflops);
    const dm::TrainBenchResult r = bench.measure();
    const double t = r.step_s, tflops = r.model_tflops();
    std::printf("%s on %s: %s parameters, %s active; B=%lld T=%lld accum=%lld; recompute %s\n",
                config.c_str(), dm::cuda::device_description().c_str(),
                dm::format_param_count(r.params).c_str(),
                dm::format_param_count(r.active_params).c_str(), (long long)B, (long long)T,
                (long long)accum, recompute ? "on" : "off (mixer and MoE internals kept)");
    std::printf("forward+backward %.1f ms, optimizer (norm, clip, AdamW) %.1f ms\n",
                r.forward_backward_s * 1e3, (t - r.forward_backward_s) * 1e3);
    std::printf(
        "train step (fwd+bwd+AdamW, bf16 compute, fp32 master): %.1f ms, %.0f tokens/s, "
        "%.1f model TFLOP/s, MFU %.1f%% of %.0f; loss %.3f; device memory: activations "
        "peak %.2f GB, optimizer %.2f GB\n",
        t * 1e3, r.tokens_per_s(), tflops, 100.0 * tflops / peak_tflops, peak_tflops, r.loss,
        double(r.activation_peak) / 1e9, double(r.optimizer_bytes) / 1e9);
    std::printf(
        "{\"impl\": \"deltamoe\", \"tokens_per_s\": %.1f, \"step_ms\": %.2f, \"mfu\": %.4f, "
        "\"recompute\": %s}\n",
        r.tokens_per_s(), t * 1e3, tflops / peak_tflops, recompute ? "true" : "false");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
#else
int main() {
  std::printf("built without the CUDA backend\n");
  return 0;
}
#endif
