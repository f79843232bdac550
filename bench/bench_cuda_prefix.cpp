// The GPU prefix cache (infer/cuda/prefix_cache_gpu.h) end to end: time to prefill a prompt
// cold (GpuDecoder::prefill), cold through the cache (the same pass plus its checkpoint copies:
// the cache's overhead on a miss), and for prompts that share `--shared` tokens with it (a hit:
// restore + extend of the rest). Wall clock around each call, which ends with the logits on the
// host; the median of --reps runs after one warm-up of each.
//
//   bench_cuda_prefix [--config configs/gpu_1b.json] [--prompt 8192] [--shared 7936]
//                     [--budget-mib 2048] [--reps 3] [--seed 1]
//
// Weights are random bf16 drawn on the device (DeviceWeights with RandomInit over a
// ReservedWeights layout, as bench_cuda_decode): the timings do not depend on their values.
#if DELTAMOE_HAVE_CUDA
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "cuda_bench_util.h"
#include "infer/cuda/prefix_cache_gpu.h"
#include "io/config.h"
#include "model/cuda/decode_gpu.h"
#include "model/weights.h"
#include "ops/cuda/device.h"

namespace cu = dm::cuda;

namespace {

template <typename F>
double median_wall_ms(int reps, F&& f) {
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f(r);
    t.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int run(int argc, char** argv) {
  std::string config = "configs/gpu_1b.json";
  int64_t prompt_len = 8192, shared = 7936, budget_mib = 2048, reps = 3, seed = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--config") {
      config = argv[i + 1];
      continue;
    }
    const int64_t v = std::atoll(argv[i + 1]);
    if (a == "--prompt")
      prompt_len = v;
    else if (a == "--shared")
      shared = v;
    else if (a == "--budget-mib")
      budget_mib = v;
    else if (a == "--reps")
      reps = v;
    else if (a == "--seed")
      seed = v;
    else
      DM_CHECK(false, "unknown option ", a);
  }
  DM_CHECK(shared > 0 && shared < prompt_len && reps >= 1, "need 0 < --shared < --prompt");
  const dm::ModelConfig c = dm::load_config(config);
  dm::ReservedWeights layout(c);
  dm::ModelWeights& W = layout.get();
  cu::DeviceWeights dw(W, cu::RandomInit{uint64_t(seed)});
  const int64_t V = c.vocab_size;
  cu::GpuDecoder dec(dw, 2, prompt_len + 16);
  std::mt19937_64 rng(static_cast<uint64_t>(seed));
  auto random_ids = [&](int64_t n) {
    std::vector<int32_t> ids(static_cast<size_t>(n));
    for (auto& t : ids) t = int32_t(rng() % uint64_t(V));
    return ids;
  };
  std::vector<float> logits(static_cast<size_t>(V));
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t r = 0; r <= reps; ++r) prompts.push_back(random_ids(prompt_len));

  dec.prefill(0, prompts[0].data(), prompt_len, logits.data());  // warm-up
  const double cold = median_wall_ms(int(reps), [&](int r) {
    dec.prefill(0, prompts[size_t(r) + 1].data(), prompt_len, logits.data());
  });
  cu::GpuPrefixCache cache(dec, size_t(budget_mib) << 20);
  cache.prefill(dec, 0, prompts[0].data(), prompt_len, logits.data());  // warm-up
  const double cold_cached = median_wall_ms(int(reps), [&](int r) {
    cache.prefill(dec, 0, prompts[size_t(r) + 1].data(), prompt_len, logits.data());
  });
  // Hits: the last cold prompt's first `shared` tokens, then fresh ones.
  const std::vector<int32_t>& base = prompts.back();
  std::vector<std::vector<int32_t>> hits;
  for (int64_t r = 0; r <= reps; ++r) {
    std::vector<int32_t> p(base.begin(), base.begin() + shared);
    const std::vector<int32_t> rest = random_ids(prompt_len - shared);
    p.insert(p.end(), rest.begin(), rest.end());
    hits.push_back(p);
  }
  int64_t restored = cache.prefill(dec, 1, hits[0].data(), prompt_len, logits.data());
  const double hit = median_wall_ms(int(reps), [&](int r) {
    restored = cache.prefill(dec, 1, hits[size_t(r) + 1].data(), prompt_len, logits.data());
  });
  std::printf(
      "%s on %s: prompt %lld tokens, %lld shared, grid %lld, cache %lld entries "
      "(%.1f MB each)\n",
      config.c_str(), cu::device_description().c_str(), (long long)prompt_len, (long long)shared,
      (long long)cu::GpuPrefixCache::kDefaultGridTokens, (long long)cache.index().capacity(),
      double(cache.index().entry_bytes()) / 1e6);
  std::printf("\n| prefill | ms | tokens/s |\n|---|---:|---:|\n");
  std::printf("| cold (GpuDecoder::prefill) | %.1f | %.0f |\n", cold, 1e3 * prompt_len / cold);
  std::printf("| cold through the cache (+ checkpoints) | %.1f | %.0f |\n", cold_cached,
              1e3 * prompt_len / cold_cached);
  std::printf("| hit: %lld restored, %lld computed | %.1f | %.0f |\n", (long long)restored,
              (long long)(prompt_len - restored), hit, 1e3 * prompt_len / hit);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return dm::bench::run_on_gpu(argc, argv, run); }
#else
#include <cstdio>
int main() {
  std::printf("built without the CUDA backend\n");
  return 0;
}
#endif
