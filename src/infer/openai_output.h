// Output side of the OpenAI-compatible API (no HTTP): generated tokens → text with stop strings
// and tool calls, and the JSON of responses and SSE stream chunks.
//
// Tool calls are parsed on token ids (the markers are special tokens, so message text that
// happens to spell a marker cannot open a call). The model writes, after its content:
//   <|tool_calls_section_begin|>
//     <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>
//     ... more calls ...
//   <|tool_calls_section_end|>
// which becomes tool_calls [{id: "functions.NAME:IDX", type: "function",
// function: {name: NAME, arguments: "{json}"}}] and finish_reason "tool_calls".
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "infer/openai_api.h"
#include "infer/scheduler.h"
#include "io/tokenizer.h"

namespace dm {

struct ApiToolCall {
  std::string id;         // as the model wrote it, e.g. "functions.get_weather:0"
  std::string name;       // "get_weather"
  std::string arguments;  // JSON text as written (not re-validated)
};

// Turns one choice's tokens into content text incrementally.
class ApiChoiceText {
 public:
  // tok may be null (then the text stays empty); stop strings are matched on the content bytes.
  ApiChoiceText(const Tokenizer* tok, std::vector<std::string> stop, bool parse_tool_calls);
  // Feeds one token (forced ones first). Returns false once a stop string has matched: the
  // content is cut before the match and later tokens are ignored.
  bool add(int32_t id);
  // Content bytes that can be sent now (streaming). Held back: an incomplete UTF-8 sequence at
  // the end and the longest tail that may still grow into a stop string.
  std::string take_ready();
  // Generation ended: nothing is held back any more (take_ready returns the rest).
  void finish();

  const std::string& content() const { return content_; }
  // Complete calls, plus (after finish) one the output left unterminated.
  const std::vector<ApiToolCall>& tool_calls() const { return calls_; }
  bool stopped_by_string() const { return stopped_; }

 private:
  enum class State { Content, Section, CallId, CallArgs };
  size_t held_back() const;
  void close_call();

  const Tokenizer* tok_;
  std::vector<std::string> stop_;
  size_t longest_stop_ = 0;
  bool parse_tools_;
  int32_t section_begin_ = -1, section_end_ = -1, call_begin_ = -1, arg_begin_ = -1,
          call_end_ = -1;
  State state_ = State::Content;
  std::string content_;
  size_t sent_ = 0;
  bool stopped_ = false, finished_ = false;
  std::string call_id_, call_args_;
  bool call_open_ = false;
  std::vector<ApiToolCall> calls_;
};

// Length of an incomplete UTF-8 sequence at the end of `s` (0 when it ends on a boundary).
size_t utf8_incomplete_tail(const std::string& s);

// One token's log-probability record for the response.
struct ApiTokenLogprob {
  int32_t id = 0;
  float logprob = 0;
  std::vector<TokenLogprob> top;
};

struct ApiChoiceResult {
  int index = 0;
  std::string text;
  std::vector<ApiToolCall> tool_calls;
  std::string finish_reason;  // stop | length | tool_calls
  std::vector<int32_t> token_ids;
  std::vector<ApiTokenLogprob> logprobs;
};

struct ApiUsage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
};

// OpenAI finish_reason for a scheduler outcome ("stop" becomes "tool_calls" when calls were made).
std::string api_finish_reason(FinishReason reason, bool has_tool_calls);

// The text of a token for logprobs (its bytes, a special token's name, "" outside the tokenizer).
std::string api_token_text(const Tokenizer* tok, int32_t id);

// with_index: stream deltas number the calls; whole messages do not.
nlohmann::json api_tool_calls_json(const std::vector<ApiToolCall>& calls, bool with_index);
nlohmann::json api_usage_json(const ApiUsage& usage);

// Whole responses (non-streaming).
nlohmann::json api_completion_response(const ApiRequest& req, const std::string& id,
                                       int64_t created, const std::vector<ApiChoiceResult>& choices,
                                       const ApiUsage& usage, const Tokenizer* tok);
nlohmann::json api_chat_response(const ApiRequest& req, const std::string& id, int64_t created,
                                 const std::vector<ApiChoiceResult>& choices,
                                 const ApiUsage& usage, const Tokenizer* tok);

// Stream chunks. finish_reason "" → null; logprobs may be empty.
nlohmann::json api_chat_chunk(const ApiRequest& req, const std::string& id, int64_t created,
                              int index, nlohmann::json delta, const std::string& finish_reason,
                              const std::vector<ApiTokenLogprob>& logprobs, const Tokenizer* tok);
nlohmann::json api_completion_chunk(const ApiRequest& req, const std::string& id,
                                    int64_t created, int index, const std::string& text,
                                    const std::string& finish_reason,
                                    const std::vector<ApiTokenLogprob>& logprobs,
                                    const Tokenizer* tok);
// The last chunk when stream_options.include_usage: "choices": [] and the usage.
nlohmann::json api_usage_chunk(const ApiRequest& req, const std::string& id, int64_t created,
                               const ApiUsage& usage);

// JSON text with invalid UTF-8 replaced by U+FFFD (model output may split characters).
std::string api_json_text(const nlohmann::json& j);
// "data: <json>\n\n"
std::string api_sse_event(const nlohmann::json& j);

}  // namespace dm
