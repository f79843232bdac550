// OpenAI-compatible HTTP server (SPEC §4) over the continuous-batching scheduler, on cpp-httplib
// (built only with DELTAMOE_HAVE_HTTPLIB; otherwise every call throws a dm::Error saying so).
//
// Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (SSE streaming with
// "data: {...}\n\n" chunks ending in "data: [DONE]"), GET /health, GET /metrics (Prometheus).
// Limits: request body bytes (413), context per sequence (400 context_length_exceeded),
// concurrent sequences (= decode slots; more requests wait, up to max_queue, then 503), request
// timeout (504, or an error event in a stream). Every error is
// {"error": {"message", "type", "param", "code"}} and the server keeps serving.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "io/tokenizer.h"
#include "model/model.h"

namespace dm {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                        // 0 = any free port (see Server::port)
  std::string model_name = "deltamoe";    // the id clients pass as "model"
  int64_t max_concurrent = 16;            // decode slots
  int64_t max_context = 0;                // tokens per sequence; 0 = min(model's, 32768)
  int64_t max_queue = 64;                 // requests waiting for a slot before 503
  size_t max_body_bytes = size_t(4) << 20;
  double timeout_s = 600;                 // per request, queueing included; 0 = none
  int64_t prefill_token_budget = 4096;    // prompt tokens prefilled per scheduler iteration
  size_t prefix_cache_bytes = 0;          // hybrid prefix cache budget (0 = off)
  std::string device = "cpu";             // cpu | cuda (SchedulerOptions::device)
  int max_n = 8;                          // choices per request
};

class Server {
 public:
  // tok may be null: then only /v1/completions with token-id prompts works.
  Server(std::unique_ptr<Model> model, std::unique_ptr<Tokenizer> tok, ServerOptions options);
  ~Server();  // shutdown(0)
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds and serves on a background thread; returns the port (the chosen one for port 0).
  int start();
  // Graceful stop: new API requests get 503, running ones may finish for up to grace_s, the
  // rest are cancelled, then the listener closes. Idempotent.
  void shutdown(double grace_s = 5.0);
  int port() const;
  int64_t max_context() const;
  // Whether this build has the HTTP server at all.
  static bool available();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dm
