// OpenAI-compatible request handling without HTTP (so it is unit-testable): parse and validate
// the JSON of /v1/completions and /v1/chat/completions into an ApiRequest, and turn that into the
// prompt token ids the scheduler runs (chat markup, tool declarations, forced tool-call
// openings). Every wrong type, missing field or out-of-range value becomes an ApiError carrying
// the HTTP status and the OpenAI error object fields. The output side (detokenising, stop
// strings, tool-call parsing, response JSON) is infer/openai_output.h.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "infer/sampler.h"
#include "io/tokenizer.h"

namespace dm {

// An error answered to the client: {"error": {"message", "type", "param", "code"}}.
class ApiError : public std::runtime_error {
 public:
  ApiError(int http_status, const std::string& message,
           std::string type = "invalid_request_error", std::string param = "",
           std::string code = "")
      : std::runtime_error(message), http_status(http_status), type(std::move(type)),
        param(std::move(param)), code(std::move(code)) {}
  int http_status;
  std::string type;   // invalid_request_error, not_found_error, server_error, ...
  std::string param;  // the offending field ("" → null)
  std::string code;   // e.g. context_length_exceeded ("" → null)
};

// {"error": {...}} with empty param / code as null.
nlohmann::json api_error_body(const ApiError& e);

enum class ApiEndpoint { Completions, ChatCompletions };
enum class ApiToolChoice { None, Auto, Required, Named };

struct ApiTool {
  std::string name;
  std::string description;
  nlohmann::json parameters;  // JSON schema object (may be null)
};

// What the server allows; the parser checks requests against it.
struct ApiLimits {
  std::string model_name = "deltamoe";  // the one model served (others → 404)
  int64_t max_context = 4096;           // prompt + completion tokens per sequence
  int64_t vocab_size = 0;               // token ids in prompts must be below this
  int max_n = 8;                        // choices per request
  int max_stop = 16;                    // stop strings per request
  int max_top_logprobs = 20;
};

struct ApiRequest {
  ApiEndpoint endpoint = ApiEndpoint::ChatCompletions;
  std::string model;
  // /v1/completions: text, or token ids when prompt_is_ids.
  std::string prompt_text;
  std::vector<int32_t> prompt_ids;
  bool prompt_is_ids = false;
  // /v1/chat/completions. Tool results are rendered into the tool message's content.
  std::vector<ChatMessage> messages;
  std::vector<ApiTool> tools;
  ApiToolChoice tool_choice = ApiToolChoice::Auto;
  std::string tool_choice_name;  // for Named
  int n = 1;
  std::vector<std::string> stop;
  bool has_seed = false;
  uint64_t seed = 0;
  int64_t max_tokens = -1;  // −1: not given (completions: 16; chat: the rest of the context)
  SamplingParams sampling;
  bool logprobs = false;
  int top_logprobs = 0;  // alternatives per token when logprobs
  bool stream = false;
  bool include_usage = false;
  bool return_token_ids = false;  // extension: choices[i].token_ids
};

// Parses a request body (JSON text) for `endpoint`. Throws ApiError: 400 for malformed JSON,
// wrong types, missing or out-of-range fields; 404 for a model other than limits.model_name.
ApiRequest api_parse_request(std::string_view body, ApiEndpoint endpoint,
                             const ApiLimits& limits);
ApiRequest api_parse_request_json(const nlohmann::json& body, ApiEndpoint endpoint,
                                  const ApiLimits& limits);

// The token ids to run for a request.
struct ApiPrompt {
  std::vector<int32_t> ids;         // everything the model reads (forced ids included)
  std::vector<int32_t> forced_ids;  // suffix of `ids` the server forced (a tool-call opening):
                                    // output parsing starts from these
  std::vector<int32_t> stop_ids;    // end-of-turn / end-of-text ids that end generation
  int64_t max_tokens = 0;           // resolved completion budget
};

// Tokenises the request (chat markup + tool declaration for chat, text or ids for completions),
// adds the forced tool-call opening for tool_choice required / named, resolves max_tokens and
// checks prompt + max_tokens ≤ limits.max_context (400, code context_length_exceeded).
// `tok` may be null only for completions with token-id prompts.
ApiPrompt api_build_prompt(const ApiRequest& request, const Tokenizer* tok,
                           const ApiLimits& limits);

// The tool declaration block placed before the chat (Kimi style):
// <|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{...}}, ...]<|im_end|>
std::vector<int32_t> api_encode_tool_declaration(const std::vector<ApiTool>& tools,
                                                 const Tokenizer& tok);

}  // namespace dm
