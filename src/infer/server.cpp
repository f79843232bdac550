#include "infer/server.h"

#include "core/error.h"

#if DELTAMOE_HAVE_HTTPLIB
#include <httplib.h>

#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <ctime>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "infer/openai_api.h"
#include "infer/openai_output.h"
#include "infer/scheduler.h"

namespace dm {
using json = nlohmann::json;

namespace {

constexpr const char* kJsonType = "application/json";

// One API request in flight: its choices' text assemblers and results, shared by the HTTP
// thread (which answers) and the engine thread (whose callbacks fill it). Held by shared_ptr in
// both; the in-flight counter drops when the last holder lets go.
struct ServerApiCall {
  struct Choice {
    explicit Choice(const Tokenizer* tok, const ApiRequest& req)
        : text(tok, req.stop, req.tool_choice != ApiToolChoice::None) {}
    ApiChoiceText text;
    std::vector<int32_t> token_ids;
    std::vector<ApiTokenLogprob> logprobs;
    size_t logprobs_sent = 0, token_ids_sent = 0;  // streamed so far
    uint64_t scheduler_id = 0;
    bool submitted = false, finished = false, role_sent = false, final_sent = false;
    RequestOutcome outcome;
  };

  explicit ServerApiCall(std::atomic<int64_t>& counter) : in_flight(counter) { ++in_flight; }
  ~ServerApiCall() { --in_flight; }

  std::atomic<int64_t>& in_flight;
  std::mutex mu;
  std::condition_variable changed_cv;
  bool changed = false;
  ApiRequest request;
  ApiPrompt prompt;
  std::vector<Choice> choices;  // sized once before any callback can run
  int finished = 0;
  std::string id;
  int64_t created = 0;
};

ApiError api_error_from_outcome(const RequestOutcome& o) {
  switch (o.finish_reason) {
    case FinishReason::Timeout:
      return ApiError(504, "the request timed out (" + o.error + ")", "timeout_error", "", "timeout");
    case FinishReason::Cancelled:
      return ApiError(503, "the request was cancelled (" + o.error + ")", "server_error", "",
                      "cancelled");
    default:
      return ApiError(500, "generation failed: " + o.error, "server_error");
  }
}

bool outcome_is_error(const RequestOutcome& o) {
  return o.finish_reason != FinishReason::Stop && o.finish_reason != FinishReason::Length;
}

// cpp-httplib 0.11 listens with a backlog of 5 (fixed inside the compiled library). With more
// clients connecting at once the accept queue overflows and some connections stall for a SYN
// retransmit and then fail (measured: ~1 in 250 requests of 16 concurrent clients). Linux
// lets listen() be called again on a listening socket to change its backlog, so find our
// listening socket on `port` among this process's descriptors and raise it. Returns false when
// it is not found (the server still works, with the small backlog).
bool server_raise_listen_backlog(int port, int backlog) {
  DIR* fds = opendir("/proc/self/fd");
  if (!fds) return false;
  bool raised = false;
  while (dirent* entry = readdir(fds)) {
    char* end = nullptr;
    const long fd = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || fd == dirfd(fds)) continue;
    int listening = 0;
    socklen_t len = sizeof(listening);
    if (getsockopt(int(fd), SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || !listening) continue;
    sockaddr_storage addr{};
    socklen_t addr_len = sizeof(addr);
    if (getsockname(int(fd), reinterpret_cast<sockaddr*>(&addr), &addr_len) != 0) continue;
    int bound = -1;
    if (addr.ss_family == AF_INET) bound = ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
    else if (addr.ss_family == AF_INET6) bound = ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
    if (bound == port && ::listen(int(fd), backlog) == 0) raised = true;
  }
  closedir(fds);
  return raised;
}

}  // namespace

struct Server::Impl {
  Impl(std::unique_ptr<Model> model, std::unique_ptr<Tokenizer> t, ServerOptions o);
  void install_routes();
  void handle_api(const httplib::Request& req, httplib::Response& res, ApiEndpoint endpoint);
  void answer_whole(const std::shared_ptr<ServerApiCall>& call, httplib::Response& res);
  void answer_stream(const std::shared_ptr<ServerApiCall>& call, httplib::Response& res);
  // Appends to `out` the SSE events that became ready since the last call (call->mu held).
  void collect_stream_events(ServerApiCall& call, std::string& out);
  void cancel_unfinished(ServerApiCall& call);
  std::string metrics_text();

  ServerOptions opt;
  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<Scheduler> scheduler;
  ApiLimits limits;
  httplib::Server http;
  std::thread listener;
  int bound_port = 0;
  bool started = false, stopped = false;
  std::atomic<bool> draining{false};
  std::atomic<int64_t> in_flight{0};
  std::atomic<uint64_t> next_call{1};
  std::mutex status_mu;
  std::map<int, uint64_t> responses_by_status;
  std::mutex shutdown_mu;
};

Server::Impl::Impl(std::unique_ptr<Model> model, std::unique_ptr<Tokenizer> t, ServerOptions o)
    : opt(std::move(o)), tok(std::move(t)) {
  DM_CHECK(model, "server: no model");
  const ModelConfig& c = model->config();
  DM_CHECK(opt.max_context >= 0 && opt.max_context <= c.max_context, "server: --max-context ",
           opt.max_context, " exceeds the model's context limit ", c.max_context);
  DM_CHECK(opt.max_body_bytes >= 64, "server: --max-body-bytes must be ≥ 64");
  DM_CHECK(opt.timeout_s >= 0, "server: --timeout-s must be ≥ 0");
  DM_CHECK(!opt.model_name.empty(), "server: the model name is empty");
  if (tok)
    DM_CHECK(tok->vocab_size() <= c.vocab_size, "server: the tokenizer has ", tok->vocab_size(),
             " tokens but the model only ", c.vocab_size);
  SchedulerOptions so;
  so.max_concurrent = opt.max_concurrent;
  so.max_context = opt.max_context > 0 ? opt.max_context : std::min<int64_t>(c.max_context, 32768);
  so.max_queue = opt.max_queue;
  so.prefill_token_budget = opt.prefill_token_budget;
  so.prefix_cache_bytes = opt.prefix_cache_bytes;
  so.device = opt.device;
  limits.model_name = opt.model_name;
  limits.max_context = so.max_context;
  limits.vocab_size = c.vocab_size;
  limits.max_n = opt.max_n;
  scheduler = std::make_unique<Scheduler>(std::move(model), so);
  install_routes();
}

void Server::Impl::install_routes() {
  // Each waiting or streaming request holds an HTTP thread: enough for every slot and the whole
  // queue, plus a few for /health and /metrics.
  const size_t threads = size_t(opt.max_concurrent + opt.max_queue + 8);
  http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  http.set_payload_max_length(opt.max_body_bytes);
  http.set_error_handler(httplib::Server::HandlerWithResponse(
      [this](const httplib::Request&, httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    ApiError e(res.status, "request failed");
    if (res.status == 413)
      e = ApiError(413, str_cat("the request body exceeds the limit of ", opt.max_body_bytes, " bytes"),
                   "invalid_request_error", "", "request_too_large");
    else if (res.status == 404)
      e = ApiError(404, "no such endpoint", "not_found_error");
    else if (res.status == 400)
      e = ApiError(400, "malformed HTTP request", "invalid_request_error");
    res.set_content(api_json_text(api_error_body(e)), kJsonType);
    return httplib::Server::HandlerResponse::Handled;
  }));
  http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "internal error";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    res.status = 500;
    res.set_content(api_json_text(api_error_body(ApiError(500, what, "server_error"))), kJsonType);
  });
  http.set_logger([this](const httplib::Request&, const httplib::Response& res) {
    std::lock_guard<std::mutex> lk(status_mu);
    ++responses_by_status[res.status];
  });
  http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (draining) {
      res.status = 503;
      res.set_content(R"({"status":"shutting_down"})", kJsonType);
    } else {
      res.set_content(R"({"status":"ok"})", kJsonType);
    }
  });
  http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_text(), "text/plain; version=0.0.4");
  });
  http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    const json model = {{"id", opt.model_name},     {"object", "model"},
                        {"created", 0},             {"owned_by", "deltamoe"},
                        {"max_model_len", limits.max_context}};
    res.set_content(api_json_text(json{{"object", "list"}, {"data", json::array({model})}}),
                    kJsonType);
  });
  http.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    handle_api(req, res, ApiEndpoint::Completions);
  });
  http.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    handle_api(req, res, ApiEndpoint::ChatCompletions);
  });
}

std::string Server::Impl::metrics_text() {
  std::string out = scheduler_stats_prometheus(scheduler->stats());
  out += "# HELP deltamoe_http_responses_total HTTP responses, by status.\n"
         "# TYPE deltamoe_http_responses_total counter\n";
  std::lock_guard<std::mutex> lk(status_mu);
  for (const auto& [status, count] : responses_by_status)
    out += str_cat("deltamoe_http_responses_total{status=\"", status, "\"} ", count, "\n");
  out += str_cat("# HELP deltamoe_http_requests_in_flight API requests being answered.\n"
                 "# TYPE deltamoe_http_requests_in_flight gauge\ndeltamoe_http_requests_in_flight ",
                 in_flight.load(), "\n");
  return out;
}

void Server::Impl::cancel_unfinished(ServerApiCall& call) {
  for (auto& c : call.choices)
    if (c.submitted && !c.finished) scheduler->cancel(c.scheduler_id);
}

void Server::Impl::handle_api(const httplib::Request& req, httplib::Response& res,
                              ApiEndpoint endpoint) {
  auto fail = [&](const ApiError& e) {
    res.status = e.http_status;
    res.set_content(api_json_text(api_error_body(e)), kJsonType);
  };
  try {
    if (draining) throw ApiError(503, "the server is shutting down", "server_error", "", "shutting_down");
    if (req.body.size() > opt.max_body_bytes)
      throw ApiError(413, str_cat("the request body exceeds the limit of ", opt.max_body_bytes, " bytes"),
                     "invalid_request_error", "", "request_too_large");
    auto call = std::make_shared<ServerApiCall>(in_flight);
    call->request = api_parse_request(req.body, endpoint, limits);
    call->prompt = api_build_prompt(call->request, tok.get(), limits);
    const ApiRequest& r = call->request;
    const bool chat = endpoint == ApiEndpoint::ChatCompletions;
    call->id = str_cat(chat ? "chatcmpl-" : "cmpl-", std::hex, next_call++, "-", std::time(nullptr));
    call->created = int64_t(std::time(nullptr));
    call->choices.reserve(size_t(r.n));
    for (int i = 0; i < r.n; ++i) {
      call->choices.emplace_back(tok.get(), r);
      for (int32_t id : call->prompt.forced_ids) call->choices.back().text.add(id);
    }
    const uint64_t base_seed = r.has_seed ? r.seed : std::random_device{}();
    for (int i = 0; i < r.n; ++i) {
      GenerationRequest g;
      g.prompt = call->prompt.ids;
      g.sampling = r.sampling;
      g.sampling.seed = base_seed + uint64_t(i);
      g.max_tokens = call->prompt.max_tokens;
      g.stop_ids = call->prompt.stop_ids;
      g.top_logprobs = r.logprobs ? r.top_logprobs : -1;
      g.timeout_s = opt.timeout_s;
      ServerApiCall* raw = call.get();
      g.on_token = [call, raw, i](const GeneratedToken& t) {
        std::lock_guard<std::mutex> lk(raw->mu);
        ServerApiCall::Choice& c = raw->choices[size_t(i)];
        c.token_ids.push_back(t.id);
        if (raw->request.logprobs)
          c.logprobs.push_back({t.id, t.logprob, std::vector<TokenLogprob>(t.top.begin(), t.top.end())});
        const bool keep_going = c.text.add(t.id);
        raw->changed = true;
        raw->changed_cv.notify_all();
        return keep_going;
      };
      g.on_finish = [call, raw, i](const RequestOutcome& o) {
        std::lock_guard<std::mutex> lk(raw->mu);
        ServerApiCall::Choice& c = raw->choices[size_t(i)];
        c.finished = true;
        c.outcome = o;
        c.text.finish();
        ++raw->finished;
        raw->changed = true;
        raw->changed_cv.notify_all();
      };
      try {
        std::lock_guard<std::mutex> lk(call->mu);
        call->choices[size_t(i)].scheduler_id = scheduler->submit(std::move(g));
        call->choices[size_t(i)].submitted = true;
      } catch (const SubmitError& e) {
        {
          std::lock_guard<std::mutex> lk(call->mu);
          cancel_unfinished(*call);
        }
        switch (e.kind) {
          case SubmitError::Kind::ContextLength:
            throw ApiError(400, e.what(), "invalid_request_error", chat ? "messages" : "prompt",
                           "context_length_exceeded");
          case SubmitError::Kind::Invalid: throw ApiError(400, e.what(), "invalid_request_error");
          case SubmitError::Kind::QueueFull:
            throw ApiError(503, e.what(), "server_error", "", "server_overloaded");
          case SubmitError::Kind::ShuttingDown:
            throw ApiError(503, e.what(), "server_error", "", "shutting_down");
        }
      }
    }
    if (r.stream) answer_stream(call, res);
    else answer_whole(call, res);
  } catch (const ApiError& e) {
    fail(e);
  } catch (const Error& e) {
    fail(ApiError(400, e.what(), "invalid_request_error"));
  } catch (const std::exception& e) {
    fail(ApiError(500, e.what(), "server_error"));
  }
}

void Server::Impl::answer_whole(const std::shared_ptr<ServerApiCall>& call, httplib::Response& res) {
  std::unique_lock<std::mutex> lk(call->mu);
  const int n = int(call->choices.size());
  call->changed_cv.wait(lk, [&] { return call->finished == n; });
  const ApiRequest& r = call->request;
  std::vector<ApiChoiceResult> results;
  ApiUsage usage;
  usage.prompt_tokens = int64_t(call->prompt.ids.size());
  for (int i = 0; i < n; ++i) {
    ServerApiCall::Choice& c = call->choices[size_t(i)];
    if (outcome_is_error(c.outcome)) throw api_error_from_outcome(c.outcome);
    ApiChoiceResult out;
    out.index = i;
    out.text = c.text.content();
    out.tool_calls = c.text.tool_calls();
    out.finish_reason = api_finish_reason(c.outcome.finish_reason, !out.tool_calls.empty());
    out.token_ids = c.token_ids;
    out.logprobs = c.logprobs;
    usage.completion_tokens += c.outcome.completion_tokens;
    results.push_back(std::move(out));
  }
  const json body = r.endpoint == ApiEndpoint::ChatCompletions
                        ? api_chat_response(r, call->id, call->created, results, usage, tok.get())
                        : api_completion_response(r, call->id, call->created, results, usage, tok.get());
  res.set_content(api_json_text(body), kJsonType);
}

void Server::Impl::collect_stream_events(ServerApiCall& call, std::string& out) {
  const ApiRequest& r = call.request;
  const bool chat = r.endpoint == ApiEndpoint::ChatCompletions;
  for (size_t i = 0; i < call.choices.size(); ++i) {
    ServerApiCall::Choice& c = call.choices[i];
    if (c.final_sent) continue;
    const int index = int(i);
    if (chat && !c.role_sent) {
      out += api_sse_event(api_chat_chunk(r, call.id, call.created, index,
                                          json{{"role", "assistant"}, {"content", ""}}, "", {}, tok.get()));
      c.role_sent = true;
    }
    const std::string text = c.text.take_ready();
    std::vector<ApiTokenLogprob> fresh(c.logprobs.begin() + std::ptrdiff_t(c.logprobs_sent), c.logprobs.end());
    c.logprobs_sent = c.logprobs.size();
    const bool fresh_ids = r.return_token_ids && c.token_ids_sent < c.token_ids.size();
    if (!text.empty() || !fresh.empty() || fresh_ids) {
      json chunk = chat ? api_chat_chunk(r, call.id, call.created, index, json{{"content", text}}, "",
                                         fresh, tok.get())
                        : api_completion_chunk(r, call.id, call.created, index, text, "", fresh,
                                               tok.get());
      if (r.return_token_ids)
        chunk["choices"][0]["token_ids"] = std::vector<int32_t>(
            c.token_ids.begin() + std::ptrdiff_t(c.token_ids_sent), c.token_ids.end());
      c.token_ids_sent = c.token_ids.size();
      out += api_sse_event(chunk);
    }
    if (!c.finished) continue;
    c.final_sent = true;
    if (outcome_is_error(c.outcome)) {
      out += api_sse_event(api_error_body(api_error_from_outcome(c.outcome)));
      continue;
    }
    const auto& calls = c.text.tool_calls();
    if (chat && !calls.empty())
      out += api_sse_event(api_chat_chunk(r, call.id, call.created, index,
                                          json{{"tool_calls", api_tool_calls_json(calls, true)}}, "", {}, tok.get()));
    const std::string reason = api_finish_reason(c.outcome.finish_reason, !calls.empty());
    out += api_sse_event(chat ? api_chat_chunk(r, call.id, call.created, index, json::object(),
                                               reason, {}, tok.get())
                              : api_completion_chunk(r, call.id, call.created, index, "", reason,
                                                     {}, tok.get()));
  }
}

void Server::Impl::answer_stream(const std::shared_ptr<ServerApiCall>& call, httplib::Response& res) {
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, call](size_t, httplib::DataSink& sink) {
        std::unique_lock<std::mutex> lk(call->mu);
        const int n = int(call->choices.size());
        for (;;) {
          call->changed_cv.wait_for(lk, std::chrono::milliseconds(250), [&] { return call->changed; });
          call->changed = false;
          std::string events;
          collect_stream_events(*call, events);
          const bool all_done = call->finished == n;
          if (all_done) {
            if (call->request.include_usage) {
              ApiUsage usage;
              usage.prompt_tokens = int64_t(call->prompt.ids.size());
              for (const auto& c : call->choices) usage.completion_tokens += c.outcome.completion_tokens;
              events += api_sse_event(api_usage_chunk(call->request, call->id, call->created, usage));
            }
            events += "data: [DONE]\n\n";
          }
          lk.unlock();
          const bool ok = (events.empty() || sink.write(events.data(), events.size())) &&
                          (!sink.is_writable || sink.is_writable());
          lk.lock();
          if (!ok) {  // the client went away
            cancel_unfinished(*call);
            return false;
          }
          if (all_done) {
            lk.unlock();
            sink.done();
            return true;
          }
        }
      },
      [this, call](bool success) {
        if (success) return;
        std::lock_guard<std::mutex> lk(call->mu);
        cancel_unfinished(*call);
      });
}

Server::Server(std::unique_ptr<Model> model, std::unique_ptr<Tokenizer> tok, ServerOptions options)
    : impl_(std::make_unique<Impl>(std::move(model), std::move(tok), std::move(options))) {}

Server::~Server() { shutdown(0); }

int Server::start() {
  Impl& s = *impl_;
  DM_CHECK(!s.started, "server: already started");
  if (s.opt.port == 0) {
    s.bound_port = s.http.bind_to_any_port(s.opt.host);
    DM_CHECK(s.bound_port > 0, "server: cannot bind to ", s.opt.host, " on any port");
  } else {
    DM_CHECK(s.http.bind_to_port(s.opt.host, s.opt.port), "server: cannot bind to ", s.opt.host,
             ":", s.opt.port, " (in use, or not an address of this machine)");
    s.bound_port = s.opt.port;
  }
  server_raise_listen_backlog(s.bound_port, 1024);
  s.started = true;
  s.listener = std::thread([&s] { s.http.listen_after_bind(); });
  return s.bound_port;
}

void Server::shutdown(double grace_s) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lk(s.shutdown_mu);
  if (s.stopped) return;
  s.stopped = true;
  s.draining = true;
  const auto until = std::chrono::steady_clock::now() +
                     std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                         std::chrono::duration<double>(std::max(grace_s, 0.0)));
  while (s.in_flight > 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  s.scheduler->stop();  // cancels what is left, so every waiting handler returns
  if (s.started) {
    s.http.stop();
    if (s.listener.joinable()) s.listener.join();
  }
}

int Server::port() const { return impl_->bound_port; }
int64_t Server::max_context() const { return impl_->limits.max_context; }
bool Server::available() { return true; }

}  // namespace dm

#else  // !DELTAMOE_HAVE_HTTPLIB

namespace dm {
namespace {
[[noreturn]] void server_unavailable() {
  throw Error("this deltamoe was built without cpp-httplib (Debian: libcpp-httplib-dev), so the "
              "HTTP server is unavailable; install it and re-run cmake");
}
}  // namespace
struct Server::Impl {};
Server::Server(std::unique_ptr<Model>, std::unique_ptr<Tokenizer>, ServerOptions) {
  server_unavailable();
}
Server::~Server() = default;
int Server::start() { server_unavailable(); }
void Server::shutdown(double) {}
int Server::port() const { return 0; }
int64_t Server::max_context() const { return 0; }
bool Server::available() { return false; }
}  // namespace dm

#endif
