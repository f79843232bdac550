// The real HTTP server (infer/server.h) on a loopback port with a tiny random model written to a
// temp dir, driven by httplib::Client: chat (whole and SSE-streamed) and completions give the
// greedy tokens of dm::generate; a forced tool call names the function; 16 concurrent clients
// all get their own correct answers; malformed requests get 4xx JSON errors while the next good
// request still succeeds; timeouts give 504, a full server 503; shutdown ends a running stream;
// /health, /metrics, /v1/models answer. Also `deltamoe chat` over a pipe.
#include <gtest/gtest.h>

#include "infer/server.h"

#if DELTAMOE_HAVE_HTTPLIB
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "infer/generate.h"
#include "infer/openai_output.h"
#include "serve_test_util.h"

using namespace dm;
using json = nlohmann::json;

namespace {

struct ServerTestResponse {
  int status = 0;  // 0: no HTTP answer
  std::string body;
  json parsed() const { return json::parse(body, nullptr, false); }
};

class ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = test::temp_dir("serve");
    const ModelConfig cfg = load_config(test::source_dir() + "/configs/test.json");
    auto w = weights_allocate(cfg);
    weights_init(*w, 11);
    weights_save(*w, dir_);
    test::serve_test_tokenizer().save(dir_ + "/tokenizer.json");
    ServerOptions so;
    so.port = 0;
    so.model_name = "tiny";
    so.max_concurrent = 16;
    so.max_queue = 16;
    so.max_context = 512;
    so.max_body_bytes = 64 << 10;
    so.timeout_s = 120;
    server_ = new Server(Model::load(dir_), std::make_unique<Tokenizer>(Tokenizer::load(dir_ + "/tokenizer.json")), so);
    port_ = server_->start();
    reference_ = Model::load(dir_).release();
    tok_ = new Tokenizer(Tokenizer::load(dir_ + "/tokenizer.json"));
  }
  static void TearDownTestSuite() {
    delete server_;
    delete reference_;
    delete tok_;
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  static ServerTestResponse post(const std::string& path, const std::string& body, int port = 0) {
    httplib::Client cli("127.0.0.1", port ? port : port_);
    cli.set_read_timeout(120, 0);
    auto res = cli.Post(path.c_str(), body, "application/json");
    if (!res) return {};
    return {res->status, res->body};
  }
  static ServerTestResponse get(const std::string& path) {
    httplib::Client cli("127.0.0.1", port_);
    auto res = cli.Get(path.c_str());
    if (!res) return {};
    return {res->status, res->body};
  }
  // Greedy reference with the stops the server adds.
  static std::vector<int32_t> greedy(const std::vector<int32_t>& prompt, int64_t max_tokens,
                                     bool chat) {
    GenerateOptions go;
    go.max_new_tokens = max_tokens;
    go.sampling.temperature = 0;
    if (chat) go.stop_ids.push_back(tok_->special_id("<|im_end|>"));
    go.stop_ids.push_back(tok_->special_id("<|endoftext|>"));
    return generate(*reference_, prompt, go);
  }
  static std::string expected_finish(const std::vector<int32_t>& out, int64_t max_tokens, bool chat) {
    const int32_t last = out.back();
    const bool stop = last == tok_->special_id("<|endoftext|>") ||
                      (chat && last == tok_->special_id("<|im_end|>"));
    return stop ? "stop" : (int64_t(out.size()) == max_tokens ? "length" : "?");
  }
  // "data: ..." payloads of an SSE body, in order.
  static std::vector<std::string> sse_payloads(const std::string& body) {
    std::vector<std::string> out;
    size_t pos = 0;
    while (pos < body.size()) {
      const size_t end = body.find("\n\n", pos);
      if (end == std::string::npos) break;
      const std::string event = body.substr(pos, end - pos);
      EXPECT_EQ(event.rfind("data: ", 0), 0u) << event;
      out.push_back(event.substr(6));
      pos = end + 2;
    }
    EXPECT_EQ(pos, body.size()) << "trailing bytes after the last event";
    return out;
  }

  static std::string dir_;
  static Server* server_;
  static int port_;
  static Model* reference_;
  static Tokenizer* tok_;
};
std::string ServerTest::dir_;
Server* ServerTest::server_ = nullptr;
int ServerTest::port_ = 0;
Model* ServerTest::reference_ = nullptr;
Tokenizer* ServerTest::tok_ = nullptr;

const char* const kServerChatHello =
    R"({"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "temperature": 0,
        "max_tokens": 10, "return_token_ids": true)";

}  // namespace

TEST_F(ServerTest, HealthModelsAndMetricsAnswer) {
  const auto health = get("/health");
  EXPECT_EQ(health.status, 200);
  EXPECT_EQ(health.parsed()["status"], "ok");
  const auto models = get("/v1/models");
  ASSERT_EQ(models.status, 200);
  EXPECT_EQ(models.parsed()["data"][0]["id"], "tiny");
  EXPECT_EQ(models.parsed()["data"][0]["max_model_len"], 512);
  const auto metrics = get("/metrics");
  ASSERT_EQ(metrics.status, 200);
  for (const char* name : {"deltamoe_requests_active ", "deltamoe_requests_queued ", "deltamoe_slots 16",
                           "deltamoe_generation_tokens_total ", "deltamoe_time_to_first_token_seconds_bucket",
                           "deltamoe_request_latency_seconds_count", "deltamoe_http_responses_total"})
    EXPECT_NE(metrics.body.find(name), std::string::npos) << name;
  const auto missing = get("/v1/nothing");
  EXPECT_EQ(missing.status, 404);
  EXPECT_TRUE(missing.parsed()["error"]["message"].is_string());
}

TEST_F(ServerTest, ChatWholeAndStreamedGiveTheGreedyTokens) {
  const std::vector<ChatMessage> msgs = {{"user", "Hello there", {}}};
  const std::vector<int32_t> prompt = tok_->encode_chat(msgs).ids;
  const std::vector<int32_t> expected = greedy(prompt, 10, true);

  const auto whole = post("/v1/chat/completions", std::string(kServerChatHello) + "}");
  ASSERT_EQ(whole.status, 200) << whole.body;
  const json w = whole.parsed();
  EXPECT_EQ(w["object"], "chat.completion");
  EXPECT_EQ(w["model"], "tiny");
  EXPECT_EQ(w["choices"][0]["message"]["role"], "assistant");
  EXPECT_TRUE(w["choices"][0]["message"]["content"].is_string());
  EXPECT_EQ(w["choices"][0]["token_ids"].get<std::vector<int32_t>>(), expected);
  EXPECT_EQ(w["choices"][0]["finish_reason"], expected_finish(expected, 10, true));
  EXPECT_EQ(w["usage"]["prompt_tokens"], prompt.size());
  EXPECT_EQ(w["usage"]["completion_tokens"], expected.size());
  EXPECT_EQ(w["usage"]["total_tokens"], prompt.size() + expected.size());

  const auto stream = post("/v1/chat/completions", std::string(kServerChatHello) +
                                                       R"(, "stream": true, "stream_options": {"include_usage": true}})");
  ASSERT_EQ(stream.status, 200) << stream.body;
  const auto events = sse_payloads(stream.body);
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events.back(), "[DONE]");
  std::string content;
  std::vector<int32_t> ids;
  std::string finish;
  bool saw_role = false, saw_usage = false;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    const json c = json::parse(events[i]);
    EXPECT_EQ(c["object"], "chat.completion.chunk");
    if (c.contains("usage")) {
      EXPECT_EQ(i + 2, events.size()) << "usage comes last";
      EXPECT_TRUE(c["choices"].empty());
      EXPECT_EQ(c["usage"]["completion_tokens"], expected.size());
      EXPECT_EQ(c["usage"]["prompt_tokens"], prompt.size());
      saw_usage = true;
      continue;
    }
    const json& ch = c["choices"][0];
    if (ch["delta"].contains("role")) saw_role = true;
    if (ch["delta"].contains("content")) content += ch["delta"]["content"].get<std::string>();
    if (ch.contains("token_ids"))
      for (int32_t t : ch["token_ids"].get<std::vector<int32_t>>()) ids.push_back(t);
    if (!ch["finish_reason"].is_null()) finish = ch["finish_reason"];
  }
  EXPECT_TRUE(saw_role);
  EXPECT_TRUE(saw_usage);
  EXPECT_EQ(ids, expected);
  EXPECT_EQ(content, w["choices"][0]["message"]["content"].get<std::string>());
  EXPECT_EQ(finish, w["choices"][0]["finish_reason"]);
}

TEST_F(ServerTest, CompletionsWithPromptIdsEqualGenerate) {
  const std::vector<int32_t> prompt = {5, 17, 3, 99, 260, 300, 41};
  const std::vector<int32_t> expected = greedy(prompt, 12, false);
  const auto r = post("/v1/completions", json{{"model", "tiny"},
                                              {"prompt", prompt},
                                              {"max_tokens", 12},
                                              {"temperature", 0},
                                              {"return_token_ids", true},
                                              {"logprobs", 2}}
                                             .dump());
  ASSERT_EQ(r.status, 200) << r.body;
  const json j = r.parsed();
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["choices"][0]["token_ids"].get<std::vector<int32_t>>(), expected);
  EXPECT_EQ(j["choices"][0]["finish_reason"], expected_finish(expected, 12, false));
  EXPECT_EQ(j["choices"][0]["logprobs"]["token_logprobs"].size(), expected.size());
  EXPECT_EQ(j["usage"]["prompt_tokens"], prompt.size());
}

TEST_F(ServerTest, ForcedToolCallNamesTheFunction) {
  const std::string tools = R"("tools": [{"type": "function", "function": {"name": "get_weather",
      "description": "Current weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])";
  const auto named = post("/v1/chat/completions",
                          R"({"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], )" + tools +
                              R"(, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 8, "temperature": 0})");
  ASSERT_EQ(named.status, 200) << named.body;
  const json n = named.parsed();
  const json& msg = n["choices"][0]["message"];
  ASSERT_TRUE(msg.contains("tool_calls")) << named.body;
  ASSERT_EQ(msg["tool_calls"].size(), 1u);
  EXPECT_EQ(msg["tool_calls"][0]["type"], "function");
  EXPECT_EQ(msg["tool_calls"][0]["id"], "functions.get_weather:0");
  EXPECT_EQ(msg["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_TRUE(msg["tool_calls"][0]["function"]["arguments"].is_string());
  const std::string finish = n["choices"][0]["finish_reason"];
  EXPECT_TRUE(finish == "tool_calls" || finish == "length") << finish;
  // Streamed: the call arrives as one tool_calls delta (numbered), the same as the whole answer.
  const auto streamed = post("/v1/chat/completions",
                             R"({"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], )" + tools +
                                 R"(, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 8, "temperature": 0, "stream": true})");
  ASSERT_EQ(streamed.status, 200) << streamed.body;
  json streamed_call;
  std::string streamed_finish;
  for (const auto& e : sse_payloads(streamed.body)) {
    if (e == "[DONE]") continue;
    const json chunk = json::parse(e);
    const json& ch = chunk["choices"][0];
    if (ch["delta"].contains("tool_calls")) streamed_call = ch["delta"]["tool_calls"];
    if (!ch["finish_reason"].is_null()) streamed_finish = ch["finish_reason"];
  }
  ASSERT_EQ(streamed_call.size(), 1u) << streamed.body;
  EXPECT_EQ(streamed_call[0]["index"], 0);
  EXPECT_EQ(streamed_call[0]["function"], msg["tool_calls"][0]["function"]);
  EXPECT_EQ(streamed_finish, finish);
  // "required": the model picks the name after the forced opening; a call is always returned.
  const auto required = post("/v1/chat/completions",
                             R"({"model": "tiny", "messages": [{"role": "user", "content": "Weather?"}], )" + tools +
                                 R"(, "tool_choice": "required", "max_tokens": 4, "temperature": 0})");
  ASSERT_EQ(required.status, 200) << required.body;
  EXPECT_EQ(required.parsed()["choices"][0]["message"]["tool_calls"].size(), 1u);
}

TEST_F(ServerTest, SixteenConcurrentClientsAllAnsweredCorrectly) {
  const int clients = 16;
  std::vector<std::vector<int32_t>> prompts, expected;
  for (int i = 0; i < clients; ++i) {
    std::vector<int32_t> p;
    for (int k = 0; k < 3 + (i * 5) % 23; ++k) p.push_back(int32_t((i * 31 + k * 17 + 7) % 500));
    prompts.push_back(p);
    expected.push_back(greedy(p, 16, false));
  }
  std::vector<ServerTestResponse> answers(static_cast<size_t>(clients));
  std::vector<std::thread> threads;
  for (int i = 0; i < clients; ++i)
    threads.emplace_back([&, i] {
      answers[size_t(i)] = post("/v1/completions", json{{"model", "tiny"},
                                                        {"prompt", prompts[size_t(i)]},
                                                        {"max_tokens", 16},
                                                        {"temperature", 0},
                                                        {"return_token_ids", true}}
                                                       .dump());
    });
  for (auto& t : threads) t.join();
  for (int i = 0; i < clients; ++i) {
    ASSERT_EQ(answers[size_t(i)].status, 200) << "client " << i << ": " << answers[size_t(i)].body;
    EXPECT_EQ(answers[size_t(i)].parsed()["choices"][0]["token_ids"].get<std::vector<int32_t>>(),
              expected[size_t(i)])
        << "client " << i;
  }
  const std::string metrics = get("/metrics").body;
  const size_t at = metrics.find("\ndeltamoe_requests_active_peak ");
  ASSERT_NE(at, std::string::npos);
  EXPECT_GE(std::stoi(metrics.substr(at + 31)), 2) << "requests never shared a decode step";
}

TEST_F(ServerTest, MalformedRequestsGetJsonErrorsAndTheServerKeepsServing) {
  struct Case {
    std::string path, body;
    int status;
    std::string code;
  };
  const std::string chat = "/v1/chat/completions";
  const std::vector<Case> cases = {
      {chat, "{\"messages\": [", 400, ""},
      {chat, R"({"model": "tiny", "messages": "hi"})", 400, ""},
      {chat, R"({"model": "tiny", "messages": [{"role": "user", "content": ["x"]}]})", 400, ""},
      {chat, R"({"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})", 404, "model_not_found"},
      {chat, R"({"model": "tiny", "messages": [{"role": "user", "content": ")" + std::string(70000, 'a') + "\"}]}",
       413, "request_too_large"},
      {chat, R"({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000})", 400,
       "context_length_exceeded"},
      {chat, R"({"model": "tiny", "messages": [{"role": "user", "content": ")" + std::string(600, 'a') + "\"}]}",
       400, "context_length_exceeded"},
      {chat, R"({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -4})", 400, ""},
      {chat, R"({"model": "tiny"})", 400, ""},
      {"/v1/completions", R"({"model": "tiny", "prompt": [1, 9999]})", 400, ""},
      {"/v1/completions", R"({"model": "tiny", "prompt": true})", 400, ""},
  };
  const std::string good = R"({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0})";
  for (const Case& c : cases) {
    const auto r = post(c.path, c.body);
    EXPECT_EQ(r.status, c.status) << c.body.substr(0, 120) << " → " << r.body;
    const json e = r.parsed();
    ASSERT_TRUE(e.is_object() && e.contains("error")) << r.body;
    EXPECT_TRUE(e["error"]["message"].is_string()) << r.body;
    EXPECT_TRUE(e["error"]["type"].is_string()) << r.body;
    EXPECT_TRUE(e["error"].contains("param") && e["error"].contains("code")) << r.body;
    if (!c.code.empty()) {
      EXPECT_EQ(e["error"]["code"], c.code) << r.body;
    }
    const auto ok = post("/v1/completions", good);
    EXPECT_EQ(ok.status, 200) << "after " << c.body.substr(0, 80) << ": " << ok.body;
  }
}

// `deltamoe chat` over a pipe: the reply is the greedy continuation of the chat template, and
// after /reset the same question gets the same reply.
TEST_F(ServerTest, ChatCliRepliesGreedilyAndResets) {
  const std::vector<int32_t> prompt = tok_->encode_chat({{"user", "Hello", {}}}).ids;
  const std::vector<int32_t> out = greedy(prompt, 6, true);
  ApiChoiceText reply(tok_, {}, false);
  for (int32_t t : out) reply.add(t);
  reply.finish();
  const std::string input = dir_ + "/chat_input.txt";
  {
    std::ofstream f(input);
    f << "Hello\n/reset\nHello\n/exit\nnot read\n";
  }
  const auto r = test::run_cli("chat --model " + dir_ + " --temperature 0 --max-new-tokens 6 < " + input);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output, reply.content() + "\n[conversation cleared]\n" + reply.content() + "\n");
}

// More servers: a request timeout gives 504; a full server gives 503; shutting down ends a
// running stream cleanly.
TEST_F(ServerTest, TimeoutAndGracefulShutdown) {
  ServerOptions so;
  so.port = 0;
  so.model_name = "tiny";
  so.max_concurrent = 2;
  so.max_context = 4096;
  so.timeout_s = 0.02;
  {
    // No tokenizer: with one, the random model's greedy text can reach a stop (a tool call, an
    // end-of-text token) before the timeout on a fast machine (782 tokens in < 50 ms, CI
    // 2026-11-30); without, the 4000 tokens take far longer than 20 ms.
    Server s(Model::load(dir_), nullptr, so);
    const int port = s.start();
    const auto timed_out = post("/v1/completions",
                                R"({"model": "tiny", "prompt": [1, 2], "max_tokens": 4000, "temperature": 0})", port);
    EXPECT_EQ(timed_out.status, 504) << timed_out.body;
    EXPECT_EQ(timed_out.parsed()["error"]["code"], "timeout");
  }
  so.timeout_s = 0;
  so.max_concurrent = 1;  // one slot and no queue: a second request while the stream runs → 503
  so.max_queue = 0;
  // No tokenizer, so no <|endoftext|> stop: the 4000-token stream surely outlives the shutdown.
  Server s(Model::load(dir_), nullptr, so);
  const int port = s.start();
  std::atomic<size_t> received{0};
  std::string body;
  std::thread client([&] {
    httplib::Client cli("127.0.0.1", port);
    cli.set_read_timeout(60, 0);
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/completions";
    req.body = R"({"model": "tiny", "prompt": [1, 2], "max_tokens": 4000, "stream": true, "return_token_ids": true})";
    req.set_header("Content-Type", "application/json");
    req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
      body.append(data, n);
      received += n;
      return true;
    };
    cli.send(req);
  });
  const auto t0 = std::chrono::steady_clock::now();
  while (received == 0 && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30))
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_GT(received.load(), 0u);
  const auto busy = post("/v1/completions", R"({"model": "tiny", "prompt": [1], "max_tokens": 1})", port);
  EXPECT_EQ(busy.status, 503) << busy.body;
  EXPECT_EQ(busy.parsed()["error"]["code"], "server_overloaded") << busy.body;
  const auto t1 = std::chrono::steady_clock::now();
  s.shutdown(0);  // no grace: the running stream is cancelled at once
  client.join();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count(), 10.0);
  const auto events = sse_payloads(body);
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events.back(), "[DONE]");
  EXPECT_EQ(json::parse(events[events.size() - 2])["error"]["code"], "cancelled") << events[events.size() - 2];
  const auto after = post("/v1/completions", R"({"model": "tiny", "prompt": [1], "max_tokens": 1})", port);
  EXPECT_EQ(after.status, 0) << "the listener is closed after shutdown";
}

#else

TEST(ServerTest, SkippedWithoutHttplib) {
  EXPECT_FALSE(dm::Server::available());
  GTEST_SKIP() << "built without cpp-httplib";
}

#endif
