// End-to-end GPU throughput of the whole model (bf16 compute): prefill forward of B×T tokens
// (model/cuda/model_gpu.h) and cached decode steps of S sequences at once (model/cuda/
// decode_gpu.h), on a randomly initialised model of the given config. Median of timed repeats
// after a warm-up; each timed region ends with a device synchronisation (the logits are copied
// back to the host, as a user of the forward would).
//   bench_cuda_model --config configs/demo.json --tokens 4096 --batch 1 --slots 1,64 \
//                    --context 1024 [--reps 5]
// The peer is bench/peers/deltamoe_torch.py forward-bench --device cuda --dtype bfloat16.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#if DELTAMOE_HAVE_CUDA
#include "core/error.h"
#include "io/config.h"
#include "model/cuda/decode_gpu.h"
#include "model/cuda/model_gpu.h"
#include "ops/cuda/device.h"

namespace {
std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::atoll(item.c_str()));
  return v;
}
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

int main(int argc, char** argv) {
  std::string config = "configs/demo.json", tokens = "4096", slots = "1,64";
  int64_t batch = 1, context = 1024;
  int reps = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--config")) config = argv[i + 1];
    else if (!std::strcmp(argv[i], "--tokens")) tokens = argv[i + 1];
    else if (!std::strcmp(argv[i], "--batch")) batch = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--slots")) slots = argv[i + 1];
    else if (!std::strcmp(argv[i], "--context")) context = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
  }
  try {
    if (!dm::cuda::device_available()) {
      std::printf("no GPU: %s\n", dm::cuda::device_description().c_str());
      return 0;
    }
    const dm::ModelConfig c = dm::load_config(config);
    auto W = dm::weights_allocate<float>(c);
    dm::weights_init(*W, 1);
    const int64_t V = c.vocab_size;
    std::printf("%s on %s: %.1fM parameters (bf16 compute)\n", config.c_str(),
                dm::cuda::device_description().c_str(), double(W->numel()) / 1e6);
    std::mt19937_64 rng(2);
    dm::cuda::GpuModel model(*W);
    for (int64_t T : parse_list(tokens)) {
      std::vector<int64_t> ids(size_t(batch * T));
      for (auto& t : ids) t = int64_t(rng() % uint64_t(V));
      std::vector<float> logits(size_t(batch * T * V));
      model.forward(ids.data(), batch, T, logits.data());  // warm-up (sizes the arenas)
      std::vector<double> times;
      for (int r = 0; r < reps; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        model.forward(ids.data(), batch, T, logits.data());
        times.push_back(seconds_since(t0));
      }
      std::sort(times.begin(), times.end());
      const double med = times[times.size() / 2];
      std::printf("prefill  B=%lld T=%-6lld %8.2f ms  %10.0f tokens/s  (weights %.0f MB, "
                  "activations+scratch %.0f MB)\n",
                  (long long)batch, (long long)T, med * 1e3, double(batch * T) / med,
                  model.weight_bytes() / 1e6, model.activation_bytes() / 1e6);
    }
    for (int64_t S : parse_list(slots)) {
      const int64_t steps = 32;
      dm::cuda::GpuDecoder dec(*W, S, context + steps + 1);
      // Fill every slot's cache to `context` tokens with the chunked prefill (timed), then time
      // decode steps at that context.
      std::vector<int32_t> tok(static_cast<size_t>(S)), prompt(static_cast<size_t>(context));
      std::vector<float> last(static_cast<size_t>(V));
      double prefill_s = 0;
      for (int64_t slot = 0; slot < S; ++slot) {
        for (auto& x : prompt) x = int32_t(rng() % uint64_t(V));
        const auto t0 = std::chrono::steady_clock::now();
        dec.prefill(slot, prompt.data(), context, last.data());
        prefill_s += seconds_since(t0);
      }
      std::printf("decoder prefill of %lld tokens: %.2f ms per sequence (%.0f tokens/s; first "
                  "includes sizing)\n", (long long)context, prefill_s / double(S) * 1e3,
                  double(S * context) / prefill_s);
      std::vector<float> logits(size_t(S * V));
      dm::cuda::synchronize();
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t s = 0; s < steps; ++s) {
        for (auto& x : tok) x = int32_t(rng() % uint64_t(V));
        dec.step(tok.data(), logits.data());
      }
      const double dt = seconds_since(t0) / double(steps);
      std::printf("decode   S=%-4lld context %-6lld %8.3f ms/step %10.0f tokens/s  (cache %.0f MB)\n",
                  (long long)S, (long long)context, dt * 1e3, double(S) / dt, dec.cache_bytes() / 1e6);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda_model: %s\n", e.what());
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
