// `deltamoe serve`: the OpenAI-compatible HTTP server (infer/server.h, docs/serving.md) until
// SIGINT / SIGTERM, then a graceful shutdown.
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <thread>

#include "command.h"
#include "core/error.h"
#include "infer/server.h"
#include "io/tokenizer.h"
#include "model/model.h"

namespace {

volatile std::sig_atomic_t g_serve_stop_signal = 0;
extern "C" void serve_on_signal(int sig) { g_serve_stop_signal = sig; }

dm::cli::Registrar reg("serve", "Serve a model over an OpenAI-compatible HTTP API", [](CLI::App* app) {
  static std::string model_dir, tokenizer_path;
  static dm::ServerOptions so;
  static int64_t prefix_cache_mib = 256;
  static double grace_s = 10;
  so.model_name.clear();  // default: the model directory's name
  app->add_option("--model", model_dir, "Model directory (config.json + safetensors)")->required();
  app->add_option("--tokenizer", tokenizer_path, "tokenizer.json (default: MODEL/tokenizer.json)");
  app->add_option("--host", so.host, "Address to listen on")->default_val("127.0.0.1");
  app->add_option("--port", so.port, "Port (0 = any free port)")->default_val(8000)
      ->check(CLI::Range(0, 65535));
  app->add_option("--model-name", so.model_name, "Model id clients send (default: the directory name)");
  app->add_option("--max-concurrent", so.max_concurrent, "Sequences decoded together (decode slots)")
      ->default_val(16)->check(CLI::Range(int64_t(1), int64_t(4096)));
  app->add_option("--max-context", so.max_context,
                  "Prompt + completion tokens per sequence (default: the model's, at most 32768)")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 30));
  app->add_option("--max-queue", so.max_queue, "Requests waiting for a slot before 503")
      ->default_val(64)->check(CLI::Range(int64_t(0), int64_t(1) << 20));
  app->add_option("--prefix-cache-mib", prefix_cache_mib,
                  "Prefix cache budget in MiB: prompts sharing a cached prefix prefill only the rest (0 = off)")
      ->default_val(256)->check(CLI::Range(int64_t(0), int64_t(1) << 20));
  app->add_option("--device", so.device,
                  "cpu, or cuda: decode on one GPU (bf16 compute, chunked prefill, batched decode "
                  "steps; its prefix cache keeps KDA checkpoints on the host and latent rows on "
                  "the GPU, on a 512-token grid)")
      ->default_val("cpu")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app->add_option("--max-body-bytes", so.max_body_bytes, "Largest request body (413 above)")
      ->default_val(size_t(4) << 20);
  app->add_option("--timeout-s", so.timeout_s, "Per-request timeout, queueing included (0 = none)")
      ->default_val(600)->check(CLI::Range(0.0, 1e9));
  app->add_option("--grace-s", grace_s, "On SIGINT/SIGTERM, let running requests finish this long")
      ->default_val(10)->check(CLI::Range(0.0, 1e6));
  app->callback([] {
    so.prefix_cache_bytes = size_t(prefix_cache_mib) << 20;
#if DELTAMOE_HAVE_HTTPLIB
    namespace fs = std::filesystem;
    auto model = dm::Model::load(model_dir);
    const std::string tp = tokenizer_path.empty() ? model_dir + "/tokenizer.json" : tokenizer_path;
    std::unique_ptr<dm::Tokenizer> tok;
    if (fs::exists(tp))
      tok = std::make_unique<dm::Tokenizer>(dm::Tokenizer::load(tp));
    else
      std::fprintf(stderr, "deltamoe serve: no tokenizer at %s: only /v1/completions with token-id "
                           "prompts will work\n", tp.c_str());
    if (so.model_name.empty())
      so.model_name = fs::path(model_dir).lexically_normal().filename().string();
    if (so.model_name.empty()) so.model_name = "deltamoe";
    const int64_t vocab = model->config().vocab_size;
    dm::Server server(std::move(model), std::move(tok), so);
    std::signal(SIGINT, serve_on_signal);
    std::signal(SIGTERM, serve_on_signal);
    const int port = server.start();
    std::fprintf(stderr,
                 "deltamoe serve: '%s' (vocab %lld) on http://%s:%d — %lld slots, context %lld, "
                 "queue %lld, timeout %.0f s. Ctrl-C stops.\n",
                 so.model_name.c_str(), (long long)vocab, so.host.c_str(), port,
                 (long long)so.max_concurrent, (long long)server.max_context(),
                 (long long)so.max_queue, so.timeout_s);
    while (!g_serve_stop_signal) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::fprintf(stderr, "deltamoe serve: signal %d: shutting down (grace %.0f s)\n",
                 int(g_serve_stop_signal), grace_s);
    server.shutdown(grace_s);
#else
    throw dm::Error("deltamoe serve: this build has no HTTP server (cpp-httplib was not found; on "
                    "Debian install libcpp-httplib-dev and re-run cmake)");
#endif
  });
});

}  // namespace
