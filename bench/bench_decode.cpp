// Cached inference throughput (SPEC §5) on a randomly initialised model:
//   prefill tokens/s at the given prompt lengths (one slot, cold);
//   decode tokens/s at the given batch sizes, every slot at the given context;
//   a prompt of --hit-prompt tokens whose first --hit-prefix tokens are a prefix-cache hit, timed
//   against the same prompt cold.
//   bench_decode --config configs/demo.json [--prompts 512,2048] [--batches 1,16]
//                [--context 512] [--steps 32] [--hit-prompt 2048] [--hit-prefix 1984] [--reps 3]
// Prints medians of --reps timed runs after a warm-up.
#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/gemm.h"
#include "infer/decode.h"
#include "infer/prefix_cache.h"
#include "io/config.h"
#include "model/model.h"

namespace {

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::atoll(item.c_str()));
  return out;
}

std::vector<int32_t> random_ids(int64_t n, int64_t vocab, std::mt19937& rng) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& t : ids) t = int32_t(rng() % uint32_t(vocab));
  return ids;
}

// Wall and process-CPU milliseconds of one call of f (median of `reps` after one warm-up call).
// On a shared machine the CPU time of a single-threaded run is the steadier figure: it does not
// count time the process waited for a core.
struct Timing {
  double wall_ms = 0, cpu_ms = 0;
};
double cpu_now_ms() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) * 1e3 + double(ts.tv_nsec) / 1e6;
}
Timing median_ms(int reps, const std::function<void()>& f) {
  f();
  std::vector<double> wall, cpu;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    const double c0 = cpu_now_ms();
    f();
    cpu.push_back(cpu_now_ms() - c0);
    wall.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(wall.begin(), wall.end());
  std::sort(cpu.begin(), cpu.end());
  return Timing{wall[wall.size() / 2], cpu[cpu.size() / 2]};
}

}  // namespace

int main(int argc, char** argv) {
  dm::blas_ensure_fast_kernels(argc, argv);
  std::string config = "configs/demo.json", prompts = "512,2048", batches = "1,16";
  int64_t context = 512, steps = 32, hit_prompt = 2048, hit_prefix = 1984;
  int reps = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--config")) config = argv[i + 1];
    else if (!std::strcmp(argv[i], "--prompts")) prompts = argv[i + 1];
    else if (!std::strcmp(argv[i], "--batches")) batches = argv[i + 1];
    else if (!std::strcmp(argv[i], "--context")) context = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--steps")) steps = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--hit-prompt")) hit_prompt = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--hit-prefix")) hit_prefix = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
    else { std::fprintf(stderr, "unknown option %s\n", argv[i]); return 2; }
  }
  try {
    const dm::ModelConfig cfg = dm::load_config(config);
    auto w = dm::weights_allocate(cfg);
    dm::weights_init(*w, 1);
    const double params = double(w->numel());
    dm::Model model(std::move(w));
    const int64_t V = cfg.vocab_size;
    std::mt19937 rng(7);
    std::printf("config %s: %.2fM params, %d threads, BLAS kernels %s\n", config.c_str(),
                params / 1e6, dm::num_threads(), dm::blas_core_name());

    std::vector<float> logits;
    for (const int64_t T : parse_list(prompts)) {
      dm::DecodeState st(cfg, 1, T);
      const std::vector<int32_t> ids = random_ids(T, V, rng);
      logits.resize(size_t(V));
      const Timing t = median_ms(reps, [&] { dm::prefill(model, st, 0, ids.data(), T, logits.data()); });
      std::printf("prefill %6lld tokens: wall %9.1f ms %8.0f tokens/s | cpu %9.1f ms %8.0f tokens/s"
                  "  (cache %.1f MB)\n", (long long)T, t.wall_ms, double(T) / (t.wall_ms / 1e3),
                  t.cpu_ms, double(T) / (t.cpu_ms / 1e3), double(st.cache.capacity()) / 1e6);
    }

    for (const int64_t B : parse_list(batches)) {
      dm::DecodeState st(cfg, B, context + (reps + 1) * steps + 1);
      logits.resize(size_t(B * V));
      for (int64_t s = 0; s < B; ++s) {
        const std::vector<int32_t> ids = random_ids(context, V, rng);
        dm::prefill(model, st, s, ids.data(), context, logits.data() + s * V);
      }
      std::vector<int32_t> next(static_cast<size_t>(B));
      const Timing t = median_ms(reps, [&] {
        for (int64_t k = 0; k < steps; ++k) {
          for (int64_t s = 0; s < B; ++s) next[size_t(s)] = int32_t((s * 31 + k * 7) % V);
          dm::decode_step(model, st, next.data(), nullptr, logits.data());
        }
      });
      std::printf("decode batch %3lld at context %lld: wall %7.2f ms/step %8.0f tokens/s | cpu "
                  "%7.2f ms/step %8.0f tokens/s\n", (long long)B, (long long)context,
                  t.wall_ms / double(steps), double(B * steps) / (t.wall_ms / 1e3),
                  t.cpu_ms / double(steps), double(B * steps) / (t.cpu_ms / 1e3));
    }

    if (hit_prompt > 0 && hit_prefix > 0 && hit_prefix < hit_prompt) {
      // The cached prompt shares hit_prefix tokens (a grid multiple) with the timed one.
      const std::vector<int32_t> first = random_ids(hit_prompt, V, rng);
      std::vector<int32_t> second(first.begin(), first.begin() + hit_prefix);
      for (int32_t t : random_ids(hit_prompt - hit_prefix, V, rng)) second.push_back(t);
      logits.resize(size_t(V));
      dm::DecodeState cold(cfg, 1, hit_prompt);
      const Timing cold_t =
          median_ms(reps, [&] { dm::prefill(model, cold, 0, second.data(), hit_prompt, logits.data()); });
      // Room for the slot and the cached prompt's pages (the default pool fits the slot only).
      dm::DecodeStateOptions pool_for_cache;
      pool_for_cache.page_pool_bytes =
          3 * size_t((hit_prompt + 63) / 64) * dm::DecodeState::page_bytes(cfg, 64);
      dm::DecodeState cached(cfg, 1, hit_prompt, pool_for_cache);
      cached.enable_prefix_cache(size_t(64) << 20);
      dm::prefill(model, cached, 0, first.data(), hit_prompt, logits.data());
      const Timing hit_t = median_ms(
          reps, [&] { dm::prefill(model, cached, 0, second.data(), hit_prompt, logits.data()); });
      std::printf("prompt %lld tokens: cold wall %.1f ms (cpu %.1f), prefix-cache hit of %lld "
                  "tokens wall %.1f ms (cpu %.1f): %.1fx; cache %lld entries, %.1f MB of %.1f MB "
                  "budget\n", (long long)hit_prompt, cold_t.wall_ms, cold_t.cpu_ms,
                  (long long)cached.cached_tokens[0], hit_t.wall_ms, hit_t.cpu_ms,
                  cold_t.cpu_ms / hit_t.cpu_ms, (long long)cached.prefix_cache->size(),
                  double(cached.prefix_cache->bytes_used()) / 1e6,
                  double(cached.prefix_cache->budget_bytes()) / 1e6);
    }
  } catch (const dm::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
