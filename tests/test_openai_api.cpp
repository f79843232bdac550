// OpenAI-compatible request/response handling without HTTP (infer/openai_api.h,
// infer/openai_output.h): the validator turns every malformed request into the right
// status / param / code; a valid request's fields land in the internal request; chat prompts are
// the tokenizer's chat encoding plus the tool declaration and forced tool-call openings; stop
// strings cut the text (and hold back partial matches while streaming); tool-call markup becomes
// tool_calls; responses and chunks have the OpenAI shapes.
#include <gtest/gtest.h>

#include "infer/openai_api.h"
#include "infer/openai_output.h"
#include "serve_test_util.h"

using namespace dm;
using json = nlohmann::json;

namespace {

ApiLimits openai_test_limits() {
  ApiLimits l;
  l.model_name = "tiny";
  l.max_context = 256;
  l.vocab_size = 512;
  return l;
}

// The ApiError a body raises (status 0 when it parses).
ApiError openai_parse_error(const std::string& body, ApiEndpoint ep = ApiEndpoint::ChatCompletions) {
  try {
    api_parse_request(body, ep, openai_test_limits());
  } catch (const ApiError& e) {
    return e;
  }
  return ApiError(0, "parsed");
}

const char* const kUserHi = R"("messages": [{"role": "user", "content": "hi"}])";

std::vector<int32_t> openai_ids(const Tokenizer& tok, const std::string& text) {
  return tok.encode(text, /*allow_special=*/true);
}

}  // namespace

TEST(OpenAiApi, MalformedRequestsNameTheField) {
  struct Case {
    std::string body;
    int status;
    std::string param;
    std::string code;
  };
  const std::string hi = kUserHi;
  const std::vector<Case> cases = {
      {"{not json", 400, "", ""},
      {"[1, 2]", 400, "", ""},
      {"{}", 400, "messages", ""},
      {R"({"messages": "hello"})", 400, "messages", ""},
      {R"({"messages": []})", 400, "messages", ""},
      {R"({"messages": [{"content": "x"}]})", 400, "messages[0].role", ""},
      {R"({"messages": [{"role": "wizard", "content": "x"}]})", 400, "messages[0].role", ""},
      {R"({"messages": [{"role": "user", "content": 5}]})", 400, "messages[0].content", ""},
      {R"({"messages": [{"role": "user"}]})", 400, "messages[0].content", ""},
      {R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})",
       400, "messages[0].content[0]", ""},
      {R"({"messages": [{"role": "tool", "content": "42"}]})", 400, "messages[0].tool_call_id", ""},
      {"{" + hi + R"(, "model": "gpt-4"})", 404, "model", "model_not_found"},
      {"{" + hi + R"(, "model": 7})", 400, "model", ""},
      {"{" + hi + R"(, "max_tokens": -1})", 400, "max_tokens", ""},
      {"{" + hi + R"(, "max_tokens": 0})", 400, "max_tokens", ""},
      {"{" + hi + R"(, "max_tokens": "10"})", 400, "max_tokens", ""},
      {"{" + hi + R"(, "max_completion_tokens": 2.5})", 400, "max_completion_tokens", ""},
      {"{" + hi + R"(, "temperature": 3})", 400, "temperature", ""},
      {"{" + hi + R"(, "temperature": "hot"})", 400, "temperature", ""},
      {"{" + hi + R"(, "top_p": 0})", 400, "top_p", ""},
      {"{" + hi + R"(, "min_p": 1.5})", 400, "min_p", ""},
      {"{" + hi + R"(, "top_k": -2})", 400, "top_k", ""},
      {"{" + hi + R"(, "repetition_penalty": 0})", 400, "repetition_penalty", ""},
      {"{" + hi + R"(, "frequency_penalty": 0.5})", 400, "frequency_penalty", ""},
      {"{" + hi + R"(, "n": 0})", 400, "n", ""},
      {"{" + hi + R"(, "n": 100})", 400, "n", ""},
      {"{" + hi + R"(, "stop": 3})", 400, "stop", ""},
      {"{" + hi + R"(, "stop": ["a", 1]})", 400, "stop", ""},
      {"{" + hi + R"(, "stop": [""]})", 400, "stop", ""},
      {"{" + hi + R"(, "seed": "x"})", 400, "seed", ""},
      {"{" + hi + R"(, "stream": "yes"})", 400, "stream", ""},
      {"{" + hi + R"(, "stream_options": {"include_usage": true}})", 400, "stream_options", ""},
      {"{" + hi + R"(, "top_logprobs": 3})", 400, "top_logprobs", ""},
      {"{" + hi + R"(, "logprobs": true, "top_logprobs": 50})", 400, "top_logprobs", ""},
      {"{" + hi + R"(, "tools": {}})", 400, "tools", ""},
      {"{" + hi + R"(, "tools": [{"type": "function", "function": {"name": "bad name!"}}]})", 400,
       "tools[0].function.name", ""},
      {"{" + hi + R"(, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}})",
       400, "tool_choice.function.name", ""},
      {"{" + hi + R"(, "tool_choice": "required"})", 400, "tool_choice", ""},
      {"{" + hi + R"(, "tool_choice": "sometimes", "tools": [{"type": "function", "function": {"name": "f"}}]})",
       400, "tool_choice", ""},
      {"{" + hi + R"(, "response_format": {"type": "json_object"}})", 400, "response_format.type", ""},
  };
  for (const Case& c : cases) {
    const ApiError e = openai_parse_error(c.body);
    EXPECT_EQ(e.http_status, c.status) << c.body << " → " << e.what();
    EXPECT_EQ(e.param, c.param) << c.body << " → " << e.what();
    EXPECT_EQ(e.code, c.code) << c.body;
    const json body = api_error_body(e);
    ASSERT_TRUE(body["error"].is_object());
    EXPECT_TRUE(body["error"]["message"].is_string());
    EXPECT_TRUE(body["error"]["type"].is_string());
    EXPECT_TRUE(body["error"].contains("param") && body["error"].contains("code"));
  }
  // Completions.
  const std::vector<Case> completions = {
      {"{}", 400, "prompt", ""},
      {R"({"prompt": 5})", 400, "prompt", ""},
      {R"({"prompt": []})", 400, "prompt", ""},
      {R"({"prompt": [1, 512]})", 400, "prompt", ""},
      {R"({"prompt": [1, -1]})", 400, "prompt", ""},
      {R"({"prompt": [1, "a"]})", 400, "prompt", ""},
      {R"({"prompt": ["a", "b"]})", 400, "prompt", ""},
      {R"({"prompt": "x", "logprobs": 9})", 400, "logprobs", ""},
      {R"({"prompt": "x", "echo": true})", 400, "echo", ""},
  };
  for (const Case& c : completions) {
    const ApiError e = openai_parse_error(c.body, ApiEndpoint::Completions);
    EXPECT_EQ(e.http_status, c.status) << c.body << " → " << e.what();
    EXPECT_EQ(e.param, c.param) << c.body << " → " << e.what();
  }
}

TEST(OpenAiApi, ValidRequestFieldsAreParsed) {
  const std::string body = R"({
    "model": "tiny",
    "messages": [
      {"role": "developer", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
      {"role": "assistant", "content": null, "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
      {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18C"}
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "n": 2, "stop": "END", "seed": -3, "max_completion_tokens": 17, "temperature": 0.5,
    "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "logprobs": true,
    "top_logprobs": 4, "stream": true, "stream_options": {"include_usage": true},
    "frequency_penalty": 0, "user": "ignored"
  })";
  const ApiRequest r = api_parse_request(body, ApiEndpoint::ChatCompletions, openai_test_limits());
  ASSERT_EQ(r.messages.size(), 4u);
  EXPECT_EQ(r.messages[0].role, "system");
  EXPECT_EQ(r.messages[1].content, "Weather in Paris?");
  ASSERT_EQ(r.messages[2].tool_calls.size(), 1u);
  EXPECT_EQ(r.messages[2].tool_calls[0].name, "get_weather");
  EXPECT_EQ(r.messages[2].tool_calls[0].arguments_json, "{\"city\": \"Paris\"}");
  EXPECT_EQ(r.messages[3].content, "## Return of functions.get_weather:0\n18C");
  ASSERT_EQ(r.tools.size(), 1u);
  EXPECT_EQ(r.tool_choice, ApiToolChoice::Named);
  EXPECT_EQ(r.tool_choice_name, "get_weather");
  EXPECT_EQ(r.n, 2);
  EXPECT_EQ(r.stop, std::vector<std::string>{"END"});
  EXPECT_TRUE(r.has_seed);
  EXPECT_EQ(r.seed, uint64_t(int64_t(-3)));
  EXPECT_EQ(r.max_tokens, 17);
  EXPECT_FLOAT_EQ(r.sampling.temperature, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 0.9f);
  EXPECT_EQ(r.sampling.top_k, 40);
  EXPECT_FLOAT_EQ(r.sampling.min_p, 0.05f);
  EXPECT_FLOAT_EQ(r.sampling.repetition_penalty, 1.1f);
  EXPECT_TRUE(r.logprobs);
  EXPECT_EQ(r.top_logprobs, 4);
  EXPECT_TRUE(r.stream && r.include_usage);
  EXPECT_EQ(r.model, "tiny");

  const ApiRequest c = api_parse_request(R"({"prompt": [[4, 5, 6]], "logprobs": 2, "max_tokens": 3})",
                                         ApiEndpoint::Completions, openai_test_limits());
  EXPECT_TRUE(c.prompt_is_ids);
  EXPECT_EQ(c.prompt_ids, (std::vector<int32_t>{4, 5, 6}));
  EXPECT_TRUE(c.logprobs);
  EXPECT_EQ(c.top_logprobs, 2);
  EXPECT_EQ(c.model, "tiny");  // absent → the served model
}

TEST(OpenAiApi, PromptsAreTheChatEncodingWithToolsAndForcedOpenings) {
  const Tokenizer tok = test::serve_test_tokenizer();
  const ApiLimits limits = openai_test_limits();
  const std::string tools = R"("tools": [{"type": "function", "function": {"name": "get_weather"}}])";
  // No tools: exactly encode_chat, stop at <|im_end|> / <|endoftext|>, max_tokens = the rest.
  ApiRequest r = api_parse_request("{" + std::string(kUserHi) + "}", ApiEndpoint::ChatCompletions, limits);
  ApiPrompt p = api_build_prompt(r, &tok, limits);
  const ChatEncoding enc = tok.encode_chat(r.messages);
  EXPECT_EQ(p.ids, enc.ids);
  EXPECT_TRUE(p.forced_ids.empty());
  EXPECT_EQ(p.stop_ids, (std::vector<int32_t>{tok.special_id("<|im_end|>"), tok.special_id("<|endoftext|>")}));
  EXPECT_EQ(p.max_tokens, limits.max_context - int64_t(enc.ids.size()));

  // Tools (auto): the declaration block, then the chat.
  r = api_parse_request("{" + std::string(kUserHi) + ", " + tools + "}", ApiEndpoint::ChatCompletions, limits);
  p = api_build_prompt(r, &tok, limits);
  const auto decl = api_encode_tool_declaration(r.tools, tok);
  ASSERT_EQ(p.ids.size(), decl.size() + enc.ids.size());
  EXPECT_TRUE(std::equal(decl.begin(), decl.end(), p.ids.begin()));
  EXPECT_TRUE(std::equal(enc.ids.begin(), enc.ids.end(), p.ids.begin() + std::ptrdiff_t(decl.size())));
  EXPECT_EQ(tok.decode(decl),
            R"(<|im_system|>tool_declare<|im_middle|>[{"function":{"name":"get_weather"},"type":"function"}]<|im_end|>)");

  // Named: the opening and the name are forced; one call, so <|tool_call_end|> stops.
  r = api_parse_request("{" + std::string(kUserHi) + ", " + tools +
                            R"(, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})",
                        ApiEndpoint::ChatCompletions, limits);
  p = api_build_prompt(r, &tok, limits);
  EXPECT_EQ(tok.decode(p.forced_ids),
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>");
  EXPECT_TRUE(std::equal(p.forced_ids.begin(), p.forced_ids.end(), p.ids.end() - std::ptrdiff_t(p.forced_ids.size())));
  EXPECT_NE(std::find(p.stop_ids.begin(), p.stop_ids.end(), tok.special_id("<|tool_call_end|>")), p.stop_ids.end());
  // Required: only the opening.
  r = api_parse_request("{" + std::string(kUserHi) + ", " + tools + R"(, "tool_choice": "required"})",
                        ApiEndpoint::ChatCompletions, limits);
  p = api_build_prompt(r, &tok, limits);
  EXPECT_EQ(tok.decode(p.forced_ids), "<|tool_calls_section_begin|><|tool_call_begin|>");

  // Context overflow: 400 with code context_length_exceeded.
  r = api_parse_request("{" + std::string(kUserHi) + R"(, "max_tokens": 250})", ApiEndpoint::ChatCompletions, limits);
  try {
    api_build_prompt(r, &tok, limits);
    ADD_FAILURE() << "no context error";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.http_status, 400);
    EXPECT_EQ(e.code, "context_length_exceeded");
    EXPECT_EQ(e.param, "messages");
  }
  // Completions: text via the tokenizer (default 16 tokens), ids as given, no tokenizer for text → 400.
  r = api_parse_request(R"({"prompt": "abc"})", ApiEndpoint::Completions, limits);
  p = api_build_prompt(r, &tok, limits);
  EXPECT_EQ(p.ids, (std::vector<int32_t>{'a', 'b', 'c'}));
  EXPECT_EQ(p.max_tokens, 16);
  EXPECT_THROW(api_build_prompt(r, nullptr, limits), ApiError);
  r = api_parse_request(R"({"prompt": [300, 2]})", ApiEndpoint::Completions, limits);
  EXPECT_EQ(api_build_prompt(r, nullptr, limits).ids, (std::vector<int32_t>{300, 2}));
}

TEST(OpenAiOutput, StopStringsCutTheTextAndHoldBackPartialMatches) {
  const Tokenizer tok = test::serve_test_tokenizer();
  const int32_t hello = 256, world = 257, sto = 258, p_bang = 259;  // serve_test_extra_tokens()
  ASSERT_EQ(tok.token_bytes(sto), "sto");
  {
    ApiChoiceText t(&tok, {"stop!"}, false);
    EXPECT_TRUE(t.add(hello));
    EXPECT_TRUE(t.add(world));
    EXPECT_EQ(t.take_ready(), "Hello world");
    EXPECT_TRUE(t.add(' '));
    EXPECT_TRUE(t.add('s'));   // " s" could start "stop!": "s" is held back
    EXPECT_EQ(t.take_ready(), " ");
    EXPECT_TRUE(t.add('x'));   // "sx" cannot: released
    EXPECT_EQ(t.take_ready(), "sx");
    EXPECT_TRUE(t.add(' '));
    EXPECT_TRUE(t.add(sto));   // the match spans two multi-character tokens
    EXPECT_EQ(t.take_ready(), " ");
    EXPECT_FALSE(t.add(p_bang));
    EXPECT_TRUE(t.stopped_by_string());
    EXPECT_FALSE(t.add('z'));  // ignored after the stop
    t.finish();
    EXPECT_EQ(t.take_ready(), "");
    EXPECT_EQ(t.content(), "Hello world sx ");
  }
  {
    // Several stop strings: the earliest match wins; a partial match is released at the end.
    ApiChoiceText t(&tok, {"cd", "bcx"}, false);
    for (char ch : std::string("abcd")) {
      const bool go_on = t.add(int32_t(uint8_t(ch)));
      EXPECT_EQ(go_on, ch != 'd');
    }
    EXPECT_EQ(t.content(), "ab");
    ApiChoiceText u(&tok, {"xyz"}, false);
    for (char ch : std::string("abxy")) u.add(int32_t(uint8_t(ch)));
    EXPECT_EQ(u.take_ready(), "ab");
    u.finish();
    EXPECT_EQ(u.take_ready(), "xy");
  }
  {
    // UTF-8: a 2-byte character split over two byte tokens is sent whole.
    ApiChoiceText t(&tok, {}, false);
    const std::string e_acute = "\xC3\xA9";
    t.add(int32_t(uint8_t(e_acute[0])));
    EXPECT_EQ(t.take_ready(), "");
    t.add(int32_t(uint8_t(e_acute[1])));
    EXPECT_EQ(t.take_ready(), e_acute);
    EXPECT_EQ(utf8_incomplete_tail("ab\xE2\x82"), 2u);
    EXPECT_EQ(utf8_incomplete_tail("ab\xE2\x82\xAC"), 0u);
    EXPECT_EQ(utf8_incomplete_tail("\x80\x80"), 0u);
  }
  {
    // Special tokens and ids beyond the tokenizer are not content.
    ApiChoiceText t(&tok, {}, false);
    t.add('a');
    t.add(tok.special_id("<|im_user|>"));
    t.add(500);
    t.add('b');
    t.finish();
    EXPECT_EQ(t.content(), "ab");
  }
}

TEST(OpenAiOutput, ToolCallMarkupBecomesToolCalls) {
  const Tokenizer tok = test::serve_test_tokenizer();
  // What encode_chat writes for an assistant turn with two calls is what the parser reads back.
  std::vector<ChatMessage> chat = {{"user", "weather?", {}},
                                   {"assistant", "Let me check.",
                                    {{"functions.get_weather:0", "get_weather", R"({"city": "Paris"})"},
                                     {"", "search", R"({"q": "rain"})"}}}};
  const ChatEncoding enc = tok.encode_chat(chat, /*add_generation_prompt=*/false);
  // The assistant reply is the masked part (content, calls, <|im_end|>).
  std::vector<int32_t> reply;
  for (size_t i = 0; i < enc.ids.size(); ++i)
    if (enc.assistant_mask[i]) reply.push_back(enc.ids[i]);
  ApiChoiceText t(&tok, {}, /*parse_tool_calls=*/true);
  for (int32_t id : reply) t.add(id);
  t.finish();
  EXPECT_EQ(t.content(), "Let me check.");
  ASSERT_EQ(t.tool_calls().size(), 2u);
  EXPECT_EQ(t.tool_calls()[0].id, "functions.get_weather:0");
  EXPECT_EQ(t.tool_calls()[0].name, "get_weather");
  EXPECT_EQ(t.tool_calls()[0].arguments, R"({"city": "Paris"})");
  EXPECT_EQ(t.tool_calls()[1].id, "functions.search:1");
  EXPECT_EQ(t.tool_calls()[1].name, "search");
  EXPECT_EQ(t.tool_calls()[1].arguments, R"({"q": "rain"})");
  EXPECT_EQ(api_finish_reason(FinishReason::Stop, true), "tool_calls");
  EXPECT_EQ(api_finish_reason(FinishReason::Stop, false), "stop");
  EXPECT_EQ(api_finish_reason(FinishReason::Length, true), "length");

  // An unterminated call (the budget ran out) still yields its name and partial arguments.
  ApiChoiceText u(&tok, {}, true);
  for (int32_t id : openai_ids(tok, "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
                                    "<|tool_call_argument_begin|>{\"a\": 1"))
    u.add(id);
  EXPECT_TRUE(u.tool_calls().empty());
  u.finish();
  ASSERT_EQ(u.tool_calls().size(), 1u);
  EXPECT_EQ(u.tool_calls()[0].name, "f");
  EXPECT_EQ(u.tool_calls()[0].arguments, "{\"a\": 1");
  // With tool parsing off (tool_choice none) markers are dropped and nothing is parsed.
  ApiChoiceText v(&tok, {}, false);
  for (int32_t id : openai_ids(tok, "x<|tool_calls_section_begin|><|tool_call_begin|>f")) v.add(id);
  v.finish();
  EXPECT_TRUE(v.tool_calls().empty());
  EXPECT_EQ(v.content(), "xf");
}

TEST(OpenAiOutput, ResponseAndChunkShapes) {
  const Tokenizer tok = test::serve_test_tokenizer();
  ApiRequest r = api_parse_request("{" + std::string(kUserHi) + R"(, "logprobs": true, "top_logprobs": 1})",
                                   ApiEndpoint::ChatCompletions, openai_test_limits());
  ApiChoiceResult c;
  c.tool_calls = {{"functions.f:0", "f", "{}"}};
  c.finish_reason = "tool_calls";
  c.logprobs = {{'a', -0.5f, {{'a', -0.5f}}}};
  const json resp = api_chat_response(r, "chatcmpl-1", 7, {c}, {10, 3}, &tok);
  EXPECT_EQ(resp["object"], "chat.completion");
  EXPECT_EQ(resp["model"], "tiny");
  EXPECT_TRUE(resp["choices"][0]["message"]["content"].is_null());
  EXPECT_EQ(resp["choices"][0]["message"]["tool_calls"][0]["function"]["name"], "f");
  EXPECT_EQ(resp["choices"][0]["message"]["tool_calls"][0]["type"], "function");
  EXPECT_EQ(resp["choices"][0]["finish_reason"], "tool_calls");
  EXPECT_EQ(resp["choices"][0]["logprobs"]["content"][0]["token"], "a");
  EXPECT_EQ(resp["choices"][0]["logprobs"]["content"][0]["top_logprobs"].size(), 1u);
  EXPECT_EQ(resp["usage"]["total_tokens"], 13);
  const json chunk = api_chat_chunk(r, "chatcmpl-1", 7, 0, json{{"content", "hi"}}, "", {}, &tok);
  EXPECT_EQ(chunk["object"], "chat.completion.chunk");
  EXPECT_TRUE(chunk["choices"][0]["finish_reason"].is_null());
  EXPECT_EQ(chunk["choices"][0]["delta"]["content"], "hi");
  const json usage = api_usage_chunk(r, "chatcmpl-1", 7, {10, 3});
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 3);
  // Invalid UTF-8 in model output never breaks the JSON.
  const std::string event = api_sse_event(json{{"text", std::string("a\xC3")}});
  EXPECT_EQ(event.rfind("data: ", 0), 0u);
  EXPECT_EQ(event.substr(event.size() - 2), "\n\n");
  EXPECT_TRUE(json::accept(event.substr(6)));
  ApiRequest cr = api_parse_request(R"({"prompt": [1], "logprobs": 1, "return_token_ids": true})",
                                    ApiEndpoint::Completions, openai_test_limits());
  ApiChoiceResult cc;
  cc.text = "ab";
  cc.finish_reason = "length";
  cc.token_ids = {'a', 'b'};
  cc.logprobs = {{'a', -1.f, {{'a', -1.f}}}, {'b', -2.f, {{'c', -0.1f}}}};
  const json cresp = api_completion_response(cr, "cmpl-1", 7, {cc}, {1, 2}, &tok);
  EXPECT_EQ(cresp["object"], "text_completion");
  EXPECT_EQ(cresp["choices"][0]["text"], "ab");
  EXPECT_EQ(cresp["choices"][0]["token_ids"].get<std::vector<int32_t>>(), (std::vector<int32_t>{'a', 'b'}));
  EXPECT_EQ(cresp["choices"][0]["logprobs"]["tokens"].get<std::vector<std::string>>(),
            (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(cresp["choices"][0]["logprobs"]["text_offset"].get<std::vector<int>>(), (std::vector<int>{0, 1}));
  EXPECT_FLOAT_EQ(cresp["choices"][0]["logprobs"]["top_logprobs"][1]["c"].get<float>(), -0.1f);
}
