// Serving throughput on configs/demo.json with random weights (CPU): prefill tokens/s for a
// 512-token prompt, batched decode tokens/s at batch 1 and 16, and the HTTP server under a
// bounded loopback load (clients × requests, streamed, fixed new tokens): throughput and
// time-to-first-token / total latency percentiles measured by the clients.
//   bench_serve [--config configs/demo.json] [--clients 16] [--requests 4] [--new-tokens 64]
//               [--prompt 64]        (run from the repository root)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/gemm.h"
#include "infer/decode.h"
#include "infer/server.h"
#include "io/config.h"
#include "model/model.h"
#include "model/weights.h"

#if DELTAMOE_HAVE_HTTPLIB
#include <httplib.h>

#include <nlohmann/json.hpp>
#endif

namespace {

using Clock = std::chrono::steady_clock;
double bench_seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string g_bench_config = "configs/demo.json";

std::unique_ptr<dm::Model> bench_demo_model() {
  const dm::ModelConfig cfg = dm::load_config(g_bench_config);
  auto w = dm::weights_allocate(cfg);
  dm::weights_init(*w, 1);
  return std::make_unique<dm::Model>(std::move(w));
}

std::vector<int32_t> bench_random_ids(std::mt19937& rng, int64_t n, int64_t vocab) {
  std::uniform_int_distribution<int32_t> id(0, int32_t(vocab - 1));
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& t : ids) t = id(rng);
  return ids;
}

double bench_percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, size_t(q * double(v.size() - 1) + 0.5));
  return v[i];
}

// Prefill and decode straight on the decode API (no scheduler, no HTTP).
void bench_prefill_and_decode(dm::Model& model) {
  const dm::ModelConfig& c = model.config();
  const int64_t V = c.vocab_size, S = 16, L = 1024;
  std::mt19937 rng(5);
  dm::DecodeState state(c, S, L);
  std::vector<float> logits(size_t(S * V));
  const auto prompt = bench_random_ids(rng, 512, V);
  dm::prefill(model, state, 0, prompt.data(), 512, logits.data());  // warm-up (sizes the scratch)
  const int reps = 3;
  auto t0 = Clock::now();
  for (int r = 0; r < reps; ++r) dm::prefill(model, state, 0, prompt.data(), 512, logits.data());
  const double prefill_s = bench_seconds_since(t0) / reps;
  std::printf("%-34s %10.0f tok/s   (%.1f ms per 512-token prompt)\n", "prefill, prompt 512",
              512 / prefill_s, prefill_s * 1e3);

  const auto short_prompt = bench_random_ids(rng, 32, V);
  std::vector<int32_t> next(static_cast<size_t>(S), 7);
  for (int64_t batch : {int64_t(1), S}) {
    for (int64_t s = 0; s < S; ++s) dm::prefill(model, state, s, short_prompt.data(), 32, logits.data() + s * V);
    std::vector<int> active(static_cast<size_t>(S), 0);
    for (int64_t s = 0; s < batch; ++s) active[size_t(s)] = 1;
    dm::decode_step(model, state, next.data(), active.data(), logits.data());  // warm-up
    const int steps = 64;
    t0 = Clock::now();
    for (int k = 0; k < steps; ++k) dm::decode_step(model, state, next.data(), active.data(), logits.data());
    const double s_per_step = bench_seconds_since(t0) / steps;
    std::printf("decode, batch %-20lld %10.0f tok/s   (%.2f ms per step)\n", (long long)batch,
                double(batch) / s_per_step, s_per_step * 1e3);
  }
}

#if DELTAMOE_HAVE_HTTPLIB
void bench_server(int clients, int requests, int new_tokens, int prompt_len) {
  dm::ServerOptions so;
  so.port = 0;
  so.model_name = "demo";
  so.max_concurrent = 16;
  so.max_queue = 64;
  so.max_context = 1024;
  so.timeout_s = 0;
  auto model = bench_demo_model();
  const int64_t V = model->config().vocab_size;
  dm::Server server(std::move(model), nullptr, so);
  const int port = server.start();
  std::mutex mu;
  std::vector<double> ttft, total;
  int64_t tokens = 0, failures = 0;
  const auto t0 = Clock::now();
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c)
    threads.emplace_back([&, c] {
      std::mt19937 rng(uint32_t(100 + c));
      httplib::Client cli("127.0.0.1", port);
      cli.set_read_timeout(600, 0);
      for (int r = 0; r < requests; ++r) {
        const nlohmann::json body = {{"model", "demo"},
                                     {"prompt", bench_random_ids(rng, prompt_len, V)},
                                     {"max_tokens", new_tokens},
                                     {"temperature", 0.8},
                                     {"seed", c * 1000 + r},
                                     {"stream", true},
                                     {"return_token_ids", true}};
        httplib::Request req;
        req.method = "POST";
        req.path = "/v1/completions";
        req.body = body.dump();
        req.set_header("Content-Type", "application/json");
        const auto start = Clock::now();
        double first = -1;
        int64_t got = 0;
        std::string pending;
        req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
          pending.append(data, n);
          size_t end;
          while ((end = pending.find("\n\n")) != std::string::npos) {
            const std::string event = pending.substr(6, end - 6);
            pending.erase(0, end + 2);
            if (event == "[DONE]") continue;
            const auto j = nlohmann::json::parse(event, nullptr, false);
            if (j.is_discarded() || !j.contains("choices") || j["choices"].empty()) continue;
            const auto& ch = j["choices"][0];
            if (ch.contains("token_ids") && !ch["token_ids"].empty()) {
              if (first < 0) first = bench_seconds_since(start);
              got += int64_t(ch["token_ids"].size());
            }
          }
          return true;
        };
        auto res = cli.send(req);
        const double done = bench_seconds_since(start);
        std::lock_guard<std::mutex> lk(mu);
        if (!res || res->status != 200 || first < 0) {
          if (failures++ == 0)
            std::fprintf(stderr, "  first failure after %.3f s, %lld tokens: %s\n", done, (long long)got,
                         !res ? httplib::to_string(res.error()).c_str()
                              : res->status != 200 ? res->body.c_str() : "no tokens streamed");
          continue;
        }
        ttft.push_back(first);
        total.push_back(done);
        tokens += got;
      }
    });
  for (auto& t : threads) t.join();
  const double wall = bench_seconds_since(t0);
  server.shutdown(0);
  std::printf("server: %d clients x %d requests, prompt %d, %d new tokens (streamed, loopback)\n",
              clients, requests, prompt_len, new_tokens);
  std::printf("  %-32s %10.0f tok/s   (%lld tokens in %.1f s, %lld failed)\n", "throughput",
              double(tokens) / wall, (long long)tokens, wall, (long long)failures);
  std::printf("  %-32s p50 %7.3f s   p90 %7.3f s   p99 %7.3f s\n", "time to first token",
              bench_percentile(ttft, 0.5), bench_percentile(ttft, 0.9), bench_percentile(ttft, 0.99));
  std::printf("  %-32s p50 %7.3f s   p90 %7.3f s   p99 %7.3f s\n", "request latency",
              bench_percentile(total, 0.5), bench_percentile(total, 0.9), bench_percentile(total, 0.99));
}
#endif

}  // namespace

int main(int argc, char** argv) {
  dm::blas_ensure_fast_kernels(argc, argv);
  int clients = 16, requests = 4, new_tokens = 64, prompt = 64;
  for (int i = 1; i + 1 < argc; i += 2) {
    const int v = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--config")) g_bench_config = argv[i + 1];
    else if (!std::strcmp(argv[i], "--clients")) clients = v;
    else if (!std::strcmp(argv[i], "--requests")) requests = v;
    else if (!std::strcmp(argv[i], "--new-tokens")) new_tokens = v;
    else if (!std::strcmp(argv[i], "--prompt")) prompt = v;
    else { std::fprintf(stderr, "unknown option %s\n", argv[i]); return 2; }
  }
  std::printf("bench_serve: %s, random weights, %d threads, BLAS %s\n", g_bench_config.c_str(),
              dm::num_threads(), dm::blas_core_name());
  auto model = bench_demo_model();
  bench_prefill_and_decode(*model);
#if DELTAMOE_HAVE_HTTPLIB
  bench_server(clients, requests, new_tokens, prompt);
#else
  (void)clients, (void)requests, (void)new_tokens, (void)prompt;
  std::printf("server: skipped (built without cpp-httplib)\n");
#endif
  return 0;
}
