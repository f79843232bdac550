#include "infer/openai_api.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace dm {
using json = nlohmann::json;

json api_error_body(const ApiError& e) {
  json err = {{"message", e.what()},
              {"type", e.type},
              {"param", e.param.empty() ? json(nullptr) : json(e.param)},
              {"code", e.code.empty() ? json(nullptr) : json(e.code)}};
  return json{{"error", std::move(err)}};
}

namespace {

[[noreturn]] void api_bad_field(const std::string& param, const std::string& message) {
  throw ApiError(400, message, "invalid_request_error", param);
}

// The value of obj[key], or nullptr when the key is absent or null (OpenAI treats both as unset).
const json* api_field(const json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

std::string api_path(const std::string& prefix, const char* key) {
  return prefix.empty() ? std::string(key) : prefix + "." + key;
}

bool api_get_bool(const json& obj, const char* key, bool fallback, const std::string& prefix = "") {
  const json* v = api_field(obj, key);
  if (!v) return fallback;
  if (!v->is_boolean())
    api_bad_field(api_path(prefix, key), str_cat("'", api_path(prefix, key), "' must be a boolean, not ",
                                                 v->type_name()));
  return v->get<bool>();
}

double api_get_number(const json& obj, const char* key, double fallback, double lo, double hi,
                      bool lo_open = false) {
  const json* v = api_field(obj, key);
  if (!v) return fallback;
  if (!v->is_number())
    api_bad_field(key, str_cat("'", key, "' must be a number, not ", v->type_name()));
  const double x = v->get<double>();
  if (!std::isfinite(x) || x < lo || x > hi || (lo_open && x == lo))
    api_bad_field(key, str_cat("'", key, "' must be in ", lo_open ? "(" : "[", lo, ", ", hi,
                               "] (got ", v->dump(), ")"));
  return x;
}

int64_t api_get_int(const json& obj, const char* key, int64_t fallback, int64_t lo, int64_t hi) {
  const json* v = api_field(obj, key);
  if (!v) return fallback;
  if (!v->is_number_integer())
    api_bad_field(key, str_cat("'", key, "' must be an integer, not ",
                               v->is_number() ? "a fraction" : v->type_name()));
  if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(INT64_MAX))
    api_bad_field(key, str_cat("'", key, "' is out of range (got ", v->dump(), ")"));
  const int64_t x = v->get<int64_t>();
  if (x < lo || x > hi)
    api_bad_field(key, str_cat("'", key, "' must be in [", lo, ", ", hi, "] (got ", x, ")"));
  return x;
}

std::string api_get_string(const json& obj, const char* key, const std::string& prefix,
                           bool required) {
  const json* v = api_field(obj, key);
  const std::string path = api_path(prefix, key);
  if (!v) {
    if (required) api_bad_field(path, str_cat("'", path, "' is required"));
    return "";
  }
  if (!v->is_string())
    api_bad_field(path, str_cat("'", path, "' must be a string, not ", v->type_name()));
  return v->get<std::string>();
}

bool api_valid_function_name(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  return std::all_of(name.begin(), name.end(), [](char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
           ch == '_' || ch == '-';
  });
}

// message content: a string, or an array of parts of which only text parts are supported.
std::string api_parse_content(const json& content, const std::string& path) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array())
    api_bad_field(path, str_cat("'", path, "' must be a string or an array of content parts, not ",
                                content.type_name()));
  std::string text;
  for (size_t j = 0; j < content.size(); ++j) {
    const json& part = content[j];
    const std::string pp = str_cat(path, "[", j, "]");
    if (!part.is_object()) api_bad_field(pp, str_cat("'", pp, "' must be an object"));
    const std::string type = api_get_string(part, "type", pp, true);
    if (type != "text")
      api_bad_field(pp, str_cat("'", pp, "': content part type '", type,
                                "' is not supported by this server (text only)"));
    text += api_get_string(part, "text", pp, true);
  }
  return text;
}

ChatToolCall api_parse_tool_call(const json& call, const std::string& path) {
  if (!call.is_object()) api_bad_field(path, str_cat("'", path, "' must be an object"));
  ChatToolCall out;
  out.id = api_get_string(call, "id", path, false);
  const std::string type = api_get_string(call, "type", path, false);
  if (!type.empty() && type != "function")
    api_bad_field(path + ".type", str_cat("'", path, ".type' must be \"function\""));
  const json* fn = api_field(call, "function");
  if (!fn || !fn->is_object())
    api_bad_field(path + ".function", str_cat("'", path, ".function' must be an object"));
  out.name = api_get_string(*fn, "name", path + ".function", true);
  const json* args = api_field(*fn, "arguments");
  if (!args) out.arguments_json = "{}";
  else if (args->is_string()) out.arguments_json = args->get<std::string>();
  else if (args->is_object()) out.arguments_json = args->dump();
  else
    api_bad_field(path + ".function.arguments",
                  str_cat("'", path, ".function.arguments' must be a JSON string"));
  return out;
}

std::vector<ChatMessage> api_parse_messages(const json& body) {
  const json* msgs = api_field(body, "messages");
  if (!msgs) api_bad_field("messages", "'messages' is required");
  if (!msgs->is_array()) api_bad_field("messages", str_cat("'messages' must be an array, not ", msgs->type_name()));
  if (msgs->empty()) api_bad_field("messages", "'messages' must not be empty");
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < msgs->size(); ++i) {
    const json& m = (*msgs)[i];
    const std::string path = str_cat("messages[", i, "]");
    if (!m.is_object()) api_bad_field(path, str_cat("'", path, "' must be an object"));
    ChatMessage msg;
    msg.role = api_get_string(m, "role", path, true);
    if (msg.role == "developer") msg.role = "system";
    if (msg.role != "system" && msg.role != "user" && msg.role != "assistant" && msg.role != "tool")
      api_bad_field(path + ".role", str_cat("'", path, ".role' must be system, developer, user, "
                                            "assistant or tool (got '", msg.role, "')"));
    if (const json* tc = api_field(m, "tool_calls")) {
      if (msg.role != "assistant")
        api_bad_field(path + ".tool_calls", str_cat("'", path, ".tool_calls' is only allowed on assistant messages"));
      if (!tc->is_array())
        api_bad_field(path + ".tool_calls", str_cat("'", path, ".tool_calls' must be an array"));
      for (size_t c = 0; c < tc->size(); ++c)
        msg.tool_calls.push_back(api_parse_tool_call((*tc)[c], str_cat(path, ".tool_calls[", c, "]")));
    }
    const json* content = api_field(m, "content");
    if (content) msg.content = api_parse_content(*content, path + ".content");
    else if (msg.role != "assistant" || msg.tool_calls.empty())
      api_bad_field(path + ".content", str_cat("'", path, ".content' is required"));
    if (msg.role == "tool") {
      // Kimi renders a tool result as "## Return of <call id>" followed by the result text.
      const std::string call_id = api_get_string(m, "tool_call_id", path, true);
      msg.content = str_cat("## Return of ", call_id, "\n", msg.content);
    }
    out.push_back(std::move(msg));
  }
  return out;
}

void api_parse_tools(const json& body, ApiRequest& r) {
  if (const json* tools = api_field(body, "tools")) {
    if (!tools->is_array()) api_bad_field("tools", "'tools' must be an array");
    for (size_t i = 0; i < tools->size(); ++i) {
      const json& t = (*tools)[i];
      const std::string path = str_cat("tools[", i, "]");
      if (!t.is_object()) api_bad_field(path, str_cat("'", path, "' must be an object"));
      if (api_get_string(t, "type", path, true) != "function")
        api_bad_field(path + ".type", str_cat("'", path, ".type' must be \"function\""));
      const json* fn = api_field(t, "function");
      if (!fn || !fn->is_object())
        api_bad_field(path + ".function", str_cat("'", path, ".function' must be an object"));
      ApiTool tool;
      tool.name = api_get_string(*fn, "name", path + ".function", true);
      if (!api_valid_function_name(tool.name))
        api_bad_field(path + ".function.name",
                      str_cat("'", path, ".function.name' must be 1-64 characters of a-z, A-Z, "
                              "0-9, _ or - (got '", tool.name, "')"));
      for (const ApiTool& other : r.tools)
        if (other.name == tool.name)
          api_bad_field(path + ".function.name", str_cat("tool '", tool.name, "' is declared twice"));
      tool.description = api_get_string(*fn, "description", path + ".function", false);
      if (const json* params = api_field(*fn, "parameters")) {
        if (!params->is_object())
          api_bad_field(path + ".function.parameters",
                        str_cat("'", path, ".function.parameters' must be a JSON schema object"));
        tool.parameters = *params;
      }
      r.tools.push_back(std::move(tool));
    }
  }
  r.tool_choice = r.tools.empty() ? ApiToolChoice::None : ApiToolChoice::Auto;
  const json* choice = api_field(body, "tool_choice");
  if (!choice) return;
  if (choice->is_string()) {
    const std::string s = choice->get<std::string>();
    if (s == "none") r.tool_choice = ApiToolChoice::None;
    else if (s == "auto") r.tool_choice = r.tools.empty() ? ApiToolChoice::None : ApiToolChoice::Auto;
    else if (s == "required") r.tool_choice = ApiToolChoice::Required;
    else api_bad_field("tool_choice", str_cat("'tool_choice' must be none, auto, required or "
                                              "{\"type\": \"function\", ...} (got '", s, "')"));
  } else if (choice->is_object()) {
    if (api_get_string(*choice, "type", "tool_choice", true) != "function")
      api_bad_field("tool_choice.type", "'tool_choice.type' must be \"function\"");
    const json* fn = api_field(*choice, "function");
    if (!fn || !fn->is_object())
      api_bad_field("tool_choice.function", "'tool_choice.function' must be an object");
    r.tool_choice = ApiToolChoice::Named;
    r.tool_choice_name = api_get_string(*fn, "name", "tool_choice.function", true);
    const bool known = std::any_of(r.tools.begin(), r.tools.end(),
                                   [&](const ApiTool& t) { return t.name == r.tool_choice_name; });
    if (!known)
      api_bad_field("tool_choice.function.name",
                    str_cat("tool_choice names '", r.tool_choice_name, "', which is not in 'tools'"));
  } else {
    api_bad_field("tool_choice", str_cat("'tool_choice' must be a string or an object, not ",
                                         choice->type_name()));
  }
  if ((r.tool_choice == ApiToolChoice::Required) && r.tools.empty())
    api_bad_field("tool_choice", "tool_choice 'required' needs at least one entry in 'tools'");
}

void api_parse_prompt(const json& body, const ApiLimits& limits, ApiRequest& r) {
  const json* p = api_field(body, "prompt");
  if (!p) api_bad_field("prompt", "'prompt' is required");
  auto take_ids = [&](const json& arr) {
    for (size_t i = 0; i < arr.size(); ++i) {
      if (!arr[i].is_number_integer())
        api_bad_field("prompt", str_cat("'prompt[", i, "]' must be an integer token id"));
      const int64_t id = arr[i].get<int64_t>();
      if (id < 0 || (limits.vocab_size > 0 && id >= limits.vocab_size))
        api_bad_field("prompt", str_cat("prompt token ", id, " at position ", i,
                                        " is outside the vocabulary [0, ", limits.vocab_size, ")"));
      r.prompt_ids.push_back(int32_t(id));
    }
    r.prompt_is_ids = true;
  };
  if (p->is_string()) {
    r.prompt_text = p->get<std::string>();
  } else if (p->is_array()) {
    if (p->empty()) api_bad_field("prompt", "'prompt' must not be empty");
    const json& first = (*p)[0];
    if (first.is_number()) {
      take_ids(*p);
    } else if (p->size() == 1 && first.is_string()) {
      r.prompt_text = first.get<std::string>();
    } else if (p->size() == 1 && first.is_array()) {
      take_ids(first);
    } else if (first.is_string() || first.is_array()) {
      api_bad_field("prompt", "batched prompts are not supported: send one prompt per request "
                              "(use 'n' for several completions)");
    } else {
      api_bad_field("prompt", "'prompt' must be a string or an array of token ids");
    }
  } else {
    api_bad_field("prompt", str_cat("'prompt' must be a string or an array of token ids, not ",
                                    p->type_name()));
  }
  if (r.prompt_is_ids ? r.prompt_ids.empty() : r.prompt_text.empty())
    api_bad_field("prompt", "'prompt' must not be empty");
}

}  // namespace

ApiRequest api_parse_request(std::string_view body, ApiEndpoint endpoint,
                             const ApiLimits& limits) {
  json j = json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded())
    throw ApiError(400, "the request body is not valid JSON", "invalid_request_error");
  return api_parse_request_json(j, endpoint, limits);
}

ApiRequest api_parse_request_json(const json& body, ApiEndpoint endpoint,
                                  const ApiLimits& limits) {
  if (!body.is_object())
    throw ApiError(400, str_cat("the request body must be a JSON object, not ", body.type_name()));
  ApiRequest r;
  r.endpoint = endpoint;
  r.model = api_get_string(body, "model", "", false);
  if (r.model.empty()) r.model = limits.model_name;
  if (r.model != limits.model_name)
    throw ApiError(404, str_cat("The model '", r.model, "' does not exist (this server serves '",
                                limits.model_name, "')"),
                   "invalid_request_error", "model", "model_not_found");

  const bool chat = endpoint == ApiEndpoint::ChatCompletions;
  if (chat) {
    r.messages = api_parse_messages(body);
    api_parse_tools(body, r);
  } else {
    api_parse_prompt(body, limits, r);
    if (api_get_bool(body, "echo", false))
      api_bad_field("echo", "'echo' is not supported by this server");
    if (!api_get_string(body, "suffix", "", false).empty())
      api_bad_field("suffix", "'suffix' is not supported by this server");
  }

  r.n = int(api_get_int(body, "n", 1, 1, limits.max_n));
  if (const json* stop = api_field(body, "stop")) {
    if (stop->is_string()) {
      r.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (size_t i = 0; i < stop->size(); ++i) {
        if (!(*stop)[i].is_string())
          api_bad_field("stop", str_cat("'stop[", i, "]' must be a string"));
        r.stop.push_back((*stop)[i].get<std::string>());
      }
    } else {
      api_bad_field("stop", str_cat("'stop' must be a string or an array of strings, not ",
                                    stop->type_name()));
    }
    if (int(r.stop.size()) > limits.max_stop)
      api_bad_field("stop", str_cat("at most ", limits.max_stop, " stop strings are allowed"));
    for (const auto& s : r.stop)
      if (s.empty()) api_bad_field("stop", "stop strings must not be empty");
  }
  if (const json* seed = api_field(body, "seed")) {
    if (!seed->is_number_integer()) api_bad_field("seed", "'seed' must be an integer");
    r.has_seed = true;
    r.seed = seed->is_number_unsigned() ? seed->get<uint64_t>() : uint64_t(seed->get<int64_t>());
  }
  r.max_tokens = api_get_int(body, "max_tokens", -1, 1, INT64_MAX);
  r.max_tokens = api_get_int(body, "max_completion_tokens", r.max_tokens, 1, INT64_MAX);

  SamplingParams& sp = r.sampling;
  sp.temperature = float(api_get_number(body, "temperature", 1.0, 0.0, 2.0));
  sp.top_p = float(api_get_number(body, "top_p", 1.0, 0.0, 1.0, /*lo_open=*/true));
  const int64_t top_k = api_get_int(body, "top_k", 0, -1, INT32_MAX);
  sp.top_k = top_k < 0 ? 0 : int(top_k);
  sp.min_p = float(api_get_number(body, "min_p", 0.0, 0.0, 1.0));
  sp.repetition_penalty = float(api_get_number(body, "repetition_penalty", 1.0, 0.0, 100.0, true));
  for (const char* additive : {"frequency_penalty", "presence_penalty"})
    if (api_get_number(body, additive, 0.0, -2.0, 2.0) != 0.0)
      api_bad_field(additive, str_cat("'", additive, "' is not supported by this server; use "
                                      "'repetition_penalty' (> 1 discourages repeats)"));

  if (chat) {
    r.logprobs = api_get_bool(body, "logprobs", false);
    r.top_logprobs = int(api_get_int(body, "top_logprobs", 0, 0, limits.max_top_logprobs));
    if (api_field(body, "top_logprobs") && !r.logprobs)
      api_bad_field("top_logprobs", "'top_logprobs' needs 'logprobs': true");
  } else if (api_field(body, "logprobs")) {
    // Completions: logprobs is the number of alternatives per token (0..5).
    r.top_logprobs = int(api_get_int(body, "logprobs", 0, 0, 5));
    r.logprobs = true;
  }
  r.stream = api_get_bool(body, "stream", false);
  if (const json* so = api_field(body, "stream_options")) {
    if (!so->is_object()) api_bad_field("stream_options", "'stream_options' must be an object");
    if (!r.stream) api_bad_field("stream_options", "'stream_options' needs 'stream': true");
    r.include_usage = api_get_bool(*so, "include_usage", false, "stream_options");
  }
  if (const json* rf = api_field(body, "response_format")) {
    if (!rf->is_object()) api_bad_field("response_format", "'response_format' must be an object");
    if (api_get_string(*rf, "type", "response_format", true) != "text")
      api_bad_field("response_format.type", "only 'response_format': {\"type\": \"text\"} is supported");
  }
  r.return_token_ids = api_get_bool(body, "return_token_ids", false);
  return r;
}

std::vector<int32_t> api_encode_tool_declaration(const std::vector<ApiTool>& tools,
                                                 const Tokenizer& tok) {
  json list = json::array();
  for (const ApiTool& t : tools) {
    json fn = {{"name", t.name}};
    if (!t.description.empty()) fn["description"] = t.description;
    if (!t.parameters.is_null()) fn["parameters"] = t.parameters;
    list.push_back({{"type", "function"}, {"function", std::move(fn)}});
  }
  std::vector<int32_t> ids;
  ids.push_back(tok.special_id("<|im_system|>"));
  const auto role = tok.encode("tool_declare");
  ids.insert(ids.end(), role.begin(), role.end());
  ids.push_back(tok.special_id("<|im_middle|>"));
  const auto body = tok.encode(list.dump());
  ids.insert(ids.end(), body.begin(), body.end());
  ids.push_back(tok.special_id("<|im_end|>"));
  return ids;
}

ApiPrompt api_build_prompt(const ApiRequest& r, const Tokenizer* tok, const ApiLimits& limits) {
  ApiPrompt out;
  const bool chat = r.endpoint == ApiEndpoint::ChatCompletions;
  if (chat || !r.prompt_is_ids) {
    if (!tok)
      throw ApiError(400, chat ? "this model has no tokenizer, so chat is unavailable"
                               : "this model has no tokenizer: send the prompt as token ids",
                     "invalid_request_error", chat ? "messages" : "prompt");
  }
  try {
    if (chat) {
      for (const char* s : {"<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>",
                            "<|im_end|>"})
        if (!tok->has_special(s))
          throw ApiError(400, str_cat("the tokenizer has no chat token ", s), "invalid_request_error",
                         "messages");
      if (!r.tools.empty() && r.tool_choice != ApiToolChoice::None)
        out.ids = api_encode_tool_declaration(r.tools, *tok);
      const ChatEncoding enc = tok->encode_chat(r.messages, /*add_generation_prompt=*/true);
      out.ids.insert(out.ids.end(), enc.ids.begin(), enc.ids.end());
      out.stop_ids.push_back(tok->special_id("<|im_end|>"));
      if (r.tool_choice == ApiToolChoice::Required || r.tool_choice == ApiToolChoice::Named) {
        // Force the opening of a tool call (and the function's name): the model only writes the
        // name (required) and the arguments.
        out.forced_ids.push_back(tok->special_id("<|tool_calls_section_begin|>"));
        out.forced_ids.push_back(tok->special_id("<|tool_call_begin|>"));
        if (r.tool_choice == ApiToolChoice::Named) {
          const auto name = tok->encode(str_cat("functions.", r.tool_choice_name, ":0"));
          out.forced_ids.insert(out.forced_ids.end(), name.begin(), name.end());
          out.forced_ids.push_back(tok->special_id("<|tool_call_argument_begin|>"));
          out.stop_ids.push_back(tok->special_id("<|tool_call_end|>"));  // exactly one call
        } else {
          out.stop_ids.push_back(tok->special_id("<|tool_calls_section_end|>"));
        }
        out.ids.insert(out.ids.end(), out.forced_ids.begin(), out.forced_ids.end());
      }
    } else if (r.prompt_is_ids) {
      out.ids = r.prompt_ids;
    } else {
      out.ids = tok->encode(r.prompt_text, /*allow_special=*/true);
    }
  } catch (const ApiError&) {
    throw;
  } catch (const Error& e) {
    throw ApiError(400, e.what(), "invalid_request_error", chat ? "messages" : "prompt");
  }
  if (tok && tok->has_special("<|endoftext|>")) out.stop_ids.push_back(tok->special_id("<|endoftext|>"));
  const char* prompt_param = chat ? "messages" : "prompt";
  if (out.ids.empty()) throw ApiError(400, "the prompt is empty", "invalid_request_error", prompt_param);
  for (size_t i = 0; i < out.ids.size(); ++i)
    if (limits.vocab_size > 0 && out.ids[i] >= limits.vocab_size)
      throw ApiError(400, str_cat("prompt token ", out.ids[i], " at position ", i,
                                  " is outside the model's vocabulary [0, ", limits.vocab_size, ")"),
                     "invalid_request_error", prompt_param);
  const int64_t P = int64_t(out.ids.size());
  const int64_t rest = limits.max_context - P;
  if (r.max_tokens < 0) out.max_tokens = chat ? rest : std::min<int64_t>(16, rest);
  else out.max_tokens = r.max_tokens;
  if (rest < 1 || out.max_tokens > rest)
    throw ApiError(400, str_cat("This model's maximum context length is ", limits.max_context,
                                " tokens. However, you requested ", P + std::max<int64_t>(out.max_tokens, 1),
                                " tokens (", P, " in the ", chat ? "messages" : "prompt", ", ",
                                std::max<int64_t>(out.max_tokens, 1),
                                " in the completion). Please reduce the length of the ",
                                chat ? "messages" : "prompt", " or completion."),
                   "invalid_request_error", prompt_param, "context_length_exceeded");
  return out;
}

}  // namespace dm
