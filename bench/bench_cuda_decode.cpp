// Decode-step time of a large MoE shape on one GPU against the HBM floor (by default SPEC §1.8's
// Kimi-Linear-48B-A3B, configs/kimi_linear_48b.json, on one H200):
//   bench_cuda_decode --config configs/kimi_linear_48b.json \
//                     --cases 1x32768,64x32768,1x1048576 --steps 10 [--warmup 2] [--seed 1] \
//                     [--graphs on|off] [--moe auto|grouped|gathered]
//                     [--skip kda,mla,moe,lm_head] [--logits rows|copy]
// --graphs / --moe pick how a step runs (GpuDecodeOptions; defaults from DM_DECODE_GRAPHS and
// DM_DECODE_MOE, else graphs on and the gathered MoE kernels for small batches): each case
// prints a "mode:" line saying what ran. `--graphs off --moe grouped` is the pre-graph decoder.
// --skip leaves parts out of every step (outputs zeroed; wrong tokens): what a part costs in a
// graphed, PDL-overlapped step is the difference (per-kernel timings cannot show overlap).
// With DM_DECODE_PROFILE=1 each case also prints the device time of the timed steps' phases
// (GpuDecoder::profile_report: KDA / MLA mixers, MoE / dense FFNs, the rest), graphs included.
// Weights are random bf16 drawn on the device: DeviceWeights(…, RandomInit) over a
// ReservedWeights layout (48B parameters are 196 GB in fp32, more than the host holds, and a
// host-side init would take minutes). Each slot's cache is filled to the context length by the
// benchmark-only GpuDecoder::fill_for_benchmark (random latent rows, KDA states and conv tails:
// prefilling 1M tokens would take minutes; the step time does not depend on the values).
//
// Per case B×L: a decoder of B slots × (L + warmup + steps) tokens (L lowered when that would
// pass the config's context limit; the table prints the L used), every slot filled to L tokens,
// `warmup` steps, then `steps` timed steps: host wall clock around GpuDecoder::step_rows (the
// server's call), which ends with the logits' copy into the decoder's pinned host buffer;
// `--logits copy` times step instead, which also copies them into the caller's array (42 MB of
// host memcpy at batch 64 on a 163840-token vocabulary); median ms/step. With graphs, a batch
// size's first step runs directly and its second captures the graph: keep --warmup ≥ 2 so only
// replays are timed. A case whose cache (estimated from the config) does not fit the free device
// memory is skipped with the sizes that decide it.
//
// HBM floor = bytes one step must move (model/plan.h decode_step_bytes: the non-routed weights,
// the routed experts the batch is expected to hit, KDA states read and written, the latent rows
// read) / the device-to-device copy bandwidth measured in the same run (cudaMemcpy of 1 GiB timed
// with CUDA events, median of 5; 2 GiB of traffic per copy: read + write). Not in the floor:
// the logits' device→host copy (B × V × 4 B over PCIe, printed per case), launch and host
// overheads.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#if DELTAMOE_HAVE_CUDA
#include <cuda_runtime.h>

#include "core/error.h"
#include "cuda_bench_util.h"
#include "io/config.h"
#include "model/cuda/decode_gpu.h"
#include "model/cuda/gpu_run.h"
#include "model/plan.h"
#include "model/weights.h"
#include "ops/cuda/device.h"

namespace {

namespace cu = dm::cuda;

using dm::bench::cuda_check;

struct Case {
  int64_t batch, context;
};

std::vector<Case> parse_cases(const std::string& s) {
  std::vector<Case> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const auto x = item.find('x');
    DM_CHECK(x != std::string::npos, "--cases: expected BATCHxCONTEXT items, got '", item, "'");
    v.push_back({std::atoll(item.substr(0, x).c_str()), std::atoll(item.substr(x + 1).c_str())});
    DM_CHECK(v.back().batch > 0 && v.back().context > 0, "--cases: bad item '", item, "'");
  }
  return v;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Device-to-device copy bandwidth in bytes/s, counting read + write (2 × size per copy).
double copy_bandwidth(size_t size) {
  cu::DeviceArena arena(2 * size + 512);
  void* src = arena.alloc_bytes(size);
  void* dst = arena.alloc_bytes(size);
  cu::fill_zero(src, size);
  cudaEvent_t start, stop;
  cuda_check(cudaEventCreate(&start), "event");
  cuda_check(cudaEventCreate(&stop), "event");
  std::vector<double> ms;
  for (int r = 0; r < 7; ++r) {
    cuda_check(cudaEventRecord(start), "record");
    cuda_check(cudaMemcpyAsync(dst, src, size, cudaMemcpyDeviceToDevice), "copy");
    cuda_check(cudaEventRecord(stop), "record");
    cuda_check(cudaEventSynchronize(stop), "sync");
    float t = 0;
    cuda_check(cudaEventElapsedTime(&t, start, stop), "elapsed");
    if (r >= 2) ms.push_back(t);  // two warm-ups
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return 2.0 * double(size) / (ms[ms.size() / 2] * 1e-3);
}

const char* moe_path_name(dm::cuda::MoeExpertsPath path) {
  switch (path) {
    case dm::cuda::MoeExpertsPath::Gathered:
      return "gathered";
    case dm::cuda::MoeExpertsPath::GroupedCublas:
      return "grouped (cuBLAS)";
    case dm::cuda::MoeExpertsPath::Grouped:
      break;
  }
  return "grouped";
}

}  // namespace

int main(int argc, char** argv) {
  std::string config = "configs/kimi_linear_48b.json", cases_arg = "1x32768,64x32768,1x1048576";
  int steps = 10, warmup = 2;
  uint64_t seed = 1;
  std::string graphs_arg, moe_arg, skip_arg, logits_arg = "rows";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--config")) config = argv[i + 1];
    else if (!std::strcmp(argv[i], "--cases")) cases_arg = argv[i + 1];
    else if (!std::strcmp(argv[i], "--steps")) steps = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--warmup")) warmup = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--seed")) seed = std::strtoull(argv[i + 1], nullptr, 10);
    else if (!std::strcmp(argv[i], "--graphs")) graphs_arg = argv[i + 1];
    else if (!std::strcmp(argv[i], "--moe")) moe_arg = argv[i + 1];
    else if (!std::strcmp(argv[i], "--skip"))
      skip_arg = argv[i + 1];
  }
  try {
    cu::GpuDecodeOptions options = cu::GpuDecodeOptions::from_env();
    if (!graphs_arg.empty()) {
      DM_CHECK(graphs_arg == "on" || graphs_arg == "off", "--graphs: expected on or off, got '",
               graphs_arg, "'");
      options.graphs = graphs_arg == "on";
    }
    if (!moe_arg.empty()) {
      if (moe_arg == "auto") options.moe = cu::GpuDecodeOptions::Moe::Auto;
      else if (moe_arg == "grouped") options.moe = cu::GpuDecodeOptions::Moe::Grouped;
      else if (moe_arg == "gathered") options.moe = cu::GpuDecodeOptions::Moe::Gathered;
      else DM_CHECK(false, "--moe: expected auto, grouped or gathered, got '", moe_arg, "'");
    }
    DM_CHECK(logits_arg == "rows" || logits_arg == "copy", "--logits: expected rows or copy, got '",
             logits_arg, "'");
    const bool copy_logits = logits_arg == "copy";
    for (size_t at = 0; at < skip_arg.size();) {  // --skip kda,mla,moe,lm_head
      const size_t comma = std::min(skip_arg.find(',', at), skip_arg.size());
      const std::string part = skip_arg.substr(at, comma - at);
      using O = cu::GpuDecodeOptions;
      if (part == "kda")
        options.skip |= O::kSkipKda;
      else if (part == "mla")
        options.skip |= O::kSkipMla;
      else if (part == "moe")
        options.skip |= O::kSkipMoe;
      else if (part == "lm_head")
        options.skip |= O::kSkipLmHead;
      else
        DM_CHECK(false, "--skip: expected kda, mla, moe or lm_head, got '", part, "'");
      at = comma + 1;
    }
    if (options.skip)
      std::printf("--skip %s: timing attribution only, the tokens are wrong\n", skip_arg.c_str());
    if (!cu::device_available()) {
      std::printf("no GPU: %s\n", cu::device_description().c_str());
      return 0;
    }
    DM_CHECK(steps >= 1 && warmup >= 0, "need --steps ≥ 1 and --warmup ≥ 0");
    const std::vector<Case> cases = parse_cases(cases_arg);
    const dm::ModelConfig c = dm::load_config(config);
    dm::ReservedWeights layout(c);
    dm::ModelWeights& W = layout.get();
    std::printf("%s on %s: %.2fB parameters\n", config.c_str(), cu::device_description().c_str(),
                double(W.numel()) / 1e9);
    auto t0 = std::chrono::steady_clock::now();
    cu::DeviceWeights dw(W, cu::RandomInit{seed});
    std::printf("weights: %.2f GB on the device (bf16 mirror + fp32 element-wise copies), random "
                "init on the device in %.2f s\n", double(dw.bytes()) / 1e9, seconds_since(t0));
    const size_t copy_size = size_t(1) << 30;
    const double bw = copy_bandwidth(copy_size);
    std::printf("device-to-device copy bandwidth: %.0f GB/s (cudaMemcpy of %.2f GB, read + write "
                "counted)\n", bw / 1e9, double(copy_size) / 1e9);
    std::printf("floor assumption: routed experts hit per MoE layer = E·(1 − (1 − k/E)^B), "
                "E = %d, k = %d (uniform routing; exactly k at B = 1)\n",
                c.moe.num_experts, c.moe.top_k);
    // Columns after the ratio: the floor's bytes per step (total, weights, KDA state, latent
    // rows), routed experts per MoE layer it assumes, and the decoder's cache allocation.
    std::printf("\n%6s %9s %10s %11s %9s %7s | %8s %8s %7s %8s | %8s | %9s\n", "batch", "context",
                "ms/step", "tokens/s", "floor ms", "ratio", "GB/step", "weights", "kda", "latent",
                "experts", "cache GB");
    const int64_t V = c.vocab_size;
    std::mt19937_64 rng(seed + 1);
    for (const Case& cs : cases) {
      const int64_t B = cs.batch;
      const int64_t Lmax = std::min<int64_t>(cs.context + warmup + steps, c.max_context);
      const int64_t L = Lmax - warmup - steps;
      if (L <= 0) {
        std::printf("skip %lldx%lld: the context limit %lld leaves no room for %d steps\n",
                    (long long)B, (long long)cs.context, (long long)c.max_context, warmup + steps);
        continue;
      }
      size_t free_bytes = 0, total_bytes = 0;
      cuda_check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
      // Headroom for the step scratch, cuBLAS workspaces and the MoE plan: 2 GiB.
      const double need = dm::decode_cache_bytes(c, B, Lmax), headroom = double(size_t(2) << 30);
      if (need + headroom > double(free_bytes)) {
        std::printf(
            "skip %lldx%lld: its cache needs %.1f GB (%lld slots × %lld tokens × %.0f B of "
            "latent rows per token, plus %.1f MB of KDA state per slot) + %.1f GB "
            "headroom, but only %.1f of %.1f GB are free after the weights\n",
            (long long)B, (long long)cs.context, need / 1e9, (long long)B, (long long)Lmax,
            dm::latent_bytes_per_token(c), dm::kda_state_bytes_per_sequence(c) / 1e6,
            headroom / 1e9, double(free_bytes) / 1e9, double(total_bytes) / 1e9);
        continue;
      }
      cu::GpuDecoder dec(dw, B, Lmax, options);
      for (int64_t s = 0; s < B; ++s) dec.fill_for_benchmark(s, L, seed * 1000003 + uint64_t(s));
      std::vector<int32_t> tok(static_cast<size_t>(B));
      std::vector<float> logits(static_cast<size_t>(B * V));
      std::vector<double> ms;
      const float* rows = nullptr;
      for (int s = 0; s < warmup + steps; ++s) {
        if (s == warmup) dec.profile_report();  // DM_DECODE_PROFILE: time the measured steps only
        for (auto& x : tok) x = int32_t(rng() % uint64_t(V));
        const auto ts = std::chrono::steady_clock::now();
        if (copy_logits)
          dec.step(tok.data(), logits.data());
        else
          rows = dec.step_rows(tok.data());
        if (s >= warmup) ms.push_back(seconds_since(ts) * 1e3);
      }
      if (!copy_logits) std::copy(rows, rows + B * V, logits.begin());
      bool finite = true;
      for (float x : logits) finite &= std::isfinite(x);
      std::sort(ms.begin(), ms.end());
      const double med = ms[ms.size() / 2];
      const dm::DecodeStepBytes sb = dm::decode_step_bytes(W, B, L + warmup + steps / 2);
      const double floor_ms = sb.total() / bw * 1e3;
      std::printf("%6lld %9lld %10.3f %11.1f %9.3f %7.2f | %8.2f %8.2f %7.3f %8.2f | %8.1f | %9.2f%s\n",
                  (long long)B, (long long)L, med, double(B) / (med * 1e-3), floor_ms,
                  med / floor_ms, sb.total() / 1e9, sb.weights / 1e9, sb.kda / 1e9,
                  sb.cache / 1e9, sb.experts_per_layer, double(dec.cache_bytes()) / 1e9,
                  finite ? "" : "  (NON-FINITE logits)");
      std::printf("       (min %.3f / max %.3f ms; logits to host %.1f MB per step; step scratch "
                  "%.2f GB)\n", ms.front(), ms.back(), double(B * V * 4) / 1e6,
                  double(dec.scratch_bytes()) / 1e9);
      std::printf("       mode: %s; MoE at batch %lld: %s\n", dec.mode().c_str(), (long long)B,
                  moe_path_name(dec.moe_path(B)));
      const std::string profile = dec.profile_report();
      if (!profile.empty()) std::printf("       %s\n", profile.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda_decode: %s\n", e.what());
    return 1;
  }
  return 0;
}
#else
int main() {
  std::printf("built without the CUDA backend\n");
  return 0;
}
#endif
