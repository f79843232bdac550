#include "infer/openai_output.h"

#include <algorithm>

#include "core/error.h"

namespace dm {
using json = nlohmann::json;

size_t utf8_incomplete_tail(const std::string& s) {
  const size_t n = s.size();
  for (size_t back = 1; back <= std::min<size_t>(4, n); ++back) {
    const uint8_t b = uint8_t(s[n - back]);
    if ((b & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
    size_t need = 1;
    if ((b & 0xE0) == 0xC0) need = 2;
    else if ((b & 0xF0) == 0xE0) need = 3;
    else if ((b & 0xF8) == 0xF0) need = 4;
    return back < need ? back : 0;
  }
  return 0;  // only continuation bytes: invalid, nothing to wait for
}

ApiChoiceText::ApiChoiceText(const Tokenizer* tok, std::vector<std::string> stop,
                             bool parse_tool_calls)
    : tok_(tok), stop_(std::move(stop)), parse_tools_(parse_tool_calls) {
  for (const auto& s : stop_) longest_stop_ = std::max(longest_stop_, s.size());
  if (tok_) {
    auto id_of = [&](const char* name) { return tok_->has_special(name) ? tok_->special_id(name) : -1; };
    section_begin_ = id_of("<|tool_calls_section_begin|>");
    section_end_ = id_of("<|tool_calls_section_end|>");
    call_begin_ = id_of("<|tool_call_begin|>");
    arg_begin_ = id_of("<|tool_call_argument_begin|>");
    call_end_ = id_of("<|tool_call_end|>");
  }
}

namespace {
std::string api_trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t\r\n");
  if (a == std::string::npos) return "";
  const size_t b = s.find_last_not_of(" \t\r\n");
  return s.substr(a, b - a + 1);
}

// "functions.get_weather:0" → "get_weather"; anything else is taken as the name itself.
std::string api_tool_name_from_call_id(const std::string& id) {
  std::string name = id;
  if (name.rfind("functions.", 0) == 0) name = name.substr(10);
  const size_t colon = name.rfind(':');
  if (colon != std::string::npos && colon + 1 < name.size() &&
      std::all_of(name.begin() + std::ptrdiff_t(colon) + 1, name.end(),
                  [](char c) { return c >= '0' && c <= '9'; }))
    name.resize(colon);
  return name;
}
}  // namespace

void ApiChoiceText::close_call() {
  if (!call_open_) return;
  ApiToolCall call;
  call.id = api_trim(call_id_);
  call.name = api_tool_name_from_call_id(call.id);
  call.arguments = api_trim(call_args_);
  if (call.id.empty()) call.id = str_cat("functions.", call.name, ":", calls_.size());
  calls_.push_back(std::move(call));
  call_open_ = false;
  call_id_.clear();
  call_args_.clear();
}

bool ApiChoiceText::add(int32_t id) {
  if (stopped_) return false;
  if (!tok_ || id < 0 || id >= tok_->vocab_size()) return true;  // ids the tokenizer lacks
  if (parse_tools_) {
    if (id == section_begin_) {
      state_ = State::Section;
      return true;
    }
    if (state_ != State::Content) {
      if (id == call_begin_) {
        close_call();
        call_open_ = true;
        state_ = State::CallId;
      } else if (id == arg_begin_ && state_ == State::CallId) {
        state_ = State::CallArgs;
      } else if (id == call_end_) {
        close_call();
        state_ = State::Section;
      } else if (id == section_end_) {
        close_call();
        state_ = State::Content;
      } else if (!tok_->is_special(id)) {
        if (state_ == State::CallId) call_id_ += tok_->token_bytes(id);
        else if (state_ == State::CallArgs) call_args_ += tok_->token_bytes(id);
      }
      return true;
    }
  }
  if (tok_->is_special(id)) return true;  // markers are not content
  const size_t before = content_.size();
  content_ += tok_->token_bytes(id);
  if (stop_.empty()) return true;
  // A new match must end inside the new bytes.
  const size_t from = before >= longest_stop_ ? before - longest_stop_ + 1 : 0;
  size_t cut = std::string::npos;
  for (const auto& s : stop_) {
    const size_t at = content_.find(s, from);
    if (at != std::string::npos) cut = std::min(cut, at);
  }
  if (cut == std::string::npos) return true;
  content_.resize(std::max(cut, sent_));
  stopped_ = true;
  return false;
}

size_t ApiChoiceText::held_back() const {
  if (finished_ || stopped_) return 0;
  size_t hold = utf8_incomplete_tail(content_);
  for (const auto& s : stop_) {
    for (size_t k = std::min(s.size() - 1, content_.size()); k > hold; --k) {
      if (content_.compare(content_.size() - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
    }
  }
  return std::min(hold, content_.size() - sent_);
}

std::string ApiChoiceText::take_ready() {
  const size_t end = content_.size() - held_back();
  if (end <= sent_) return "";
  std::string out = content_.substr(sent_, end - sent_);
  sent_ = end;
  return out;
}

void ApiChoiceText::finish() {
  finished_ = true;
  close_call();
}

std::string api_finish_reason(FinishReason reason, bool has_tool_calls) {
  switch (reason) {
    case FinishReason::Stop: return has_tool_calls ? "tool_calls" : "stop";
    case FinishReason::Length: return "length";
    default: return finish_reason_name(reason);
  }
}

std::string api_token_text(const Tokenizer* tok, int32_t id) {
  if (!tok || id < 0 || id >= tok->vocab_size()) return "";
  if (tok->is_special(id)) return tok->special_tokens()[size_t(id - tok->num_ranks())];
  return tok->token_bytes(id);
}

namespace {
json api_bytes_json(const std::string& s) {
  json b = json::array();
  for (char c : s) b.push_back(int(uint8_t(c)));
  return b;
}

json api_chat_logprobs_json(const std::vector<ApiTokenLogprob>& lps, const Tokenizer* tok) {
  json content = json::array();
  for (const auto& lp : lps) {
    const std::string t = api_token_text(tok, lp.id);
    json top = json::array();
    for (const auto& alt : lp.top) {
      const std::string at = api_token_text(tok, alt.id);
      top.push_back({{"token", at}, {"logprob", alt.logprob}, {"bytes", api_bytes_json(at)}});
    }
    content.push_back({{"token", t}, {"logprob", lp.logprob}, {"bytes", api_bytes_json(t)},
                       {"top_logprobs", std::move(top)}});
  }
  return json{{"content", std::move(content)}};
}

json api_completion_logprobs_json(const std::vector<ApiTokenLogprob>& lps, const Tokenizer* tok) {
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
       offsets = json::array();
  size_t offset = 0;
  for (const auto& lp : lps) {
    const std::string t = api_token_text(tok, lp.id);
    tokens.push_back(t);
    token_logprobs.push_back(lp.logprob);
    json alts = json::object();
    for (const auto& alt : lp.top) alts[api_token_text(tok, alt.id)] = alt.logprob;
    top.push_back(std::move(alts));
    offsets.push_back(offset);
    offset += t.size();
  }
  return json{{"tokens", std::move(tokens)}, {"token_logprobs", std::move(token_logprobs)},
              {"top_logprobs", std::move(top)}, {"text_offset", std::move(offsets)}};
}
}  // namespace

json api_tool_calls_json(const std::vector<ApiToolCall>& calls, bool with_index) {
  json arr = json::array();
  for (size_t i = 0; i < calls.size(); ++i) {
    json call = {{"id", calls[i].id},
                 {"type", "function"},
                 {"function", {{"name", calls[i].name}, {"arguments", calls[i].arguments}}}};
    if (with_index) call["index"] = i;
    arr.push_back(std::move(call));
  }
  return arr;
}

json api_usage_json(const ApiUsage& u) {
  return json{{"prompt_tokens", u.prompt_tokens},
              {"completion_tokens", u.completion_tokens},
              {"total_tokens", u.prompt_tokens + u.completion_tokens}};
}

json api_completion_response(const ApiRequest& req, const std::string& id, int64_t created,
                             const std::vector<ApiChoiceResult>& choices, const ApiUsage& usage,
                             const Tokenizer* tok) {
  json arr = json::array();
  for (const auto& c : choices) {
    json choice = {{"index", c.index},
                   {"text", c.text},
                   {"logprobs", req.logprobs ? api_completion_logprobs_json(c.logprobs, tok) : json(nullptr)},
                   {"finish_reason", c.finish_reason}};
    if (req.return_token_ids) choice["token_ids"] = c.token_ids;
    arr.push_back(std::move(choice));
  }
  return json{{"id", id},           {"object", "text_completion"}, {"created", created},
              {"model", req.model}, {"choices", std::move(arr)},   {"usage", api_usage_json(usage)}};
}

json api_chat_response(const ApiRequest& req, const std::string& id, int64_t created,
                       const std::vector<ApiChoiceResult>& choices, const ApiUsage& usage,
                       const Tokenizer* tok) {
  json arr = json::array();
  for (const auto& c : choices) {
    json message = {{"role", "assistant"},
                    {"content", c.text.empty() && !c.tool_calls.empty() ? json(nullptr) : json(c.text)}};
    if (!c.tool_calls.empty()) message["tool_calls"] = api_tool_calls_json(c.tool_calls, false);
    json choice = {{"index", c.index},
                   {"message", std::move(message)},
                   {"logprobs", req.logprobs ? api_chat_logprobs_json(c.logprobs, tok) : json(nullptr)},
                   {"finish_reason", c.finish_reason}};
    if (req.return_token_ids) choice["token_ids"] = c.token_ids;
    arr.push_back(std::move(choice));
  }
  return json{{"id", id},           {"object", "chat.completion"}, {"created", created},
              {"model", req.model}, {"choices", std::move(arr)},   {"usage", api_usage_json(usage)}};
}

json api_chat_chunk(const ApiRequest& req, const std::string& id, int64_t created, int index,
                    json delta, const std::string& finish_reason,
                    const std::vector<ApiTokenLogprob>& logprobs, const Tokenizer* tok) {
  json choice = {{"index", index},
                 {"delta", std::move(delta)},
                 {"logprobs", req.logprobs && !logprobs.empty() ? api_chat_logprobs_json(logprobs, tok)
                                                                : json(nullptr)},
                 {"finish_reason", finish_reason.empty() ? json(nullptr) : json(finish_reason)}};
  return json{{"id", id},           {"object", "chat.completion.chunk"}, {"created", created},
              {"model", req.model}, {"choices", json::array({std::move(choice)})}};
}

json api_completion_chunk(const ApiRequest& req, const std::string& id, int64_t created,
                          int index, const std::string& text, const std::string& finish_reason,
                          const std::vector<ApiTokenLogprob>& logprobs, const Tokenizer* tok) {
  json choice = {{"index", index},
                 {"text", text},
                 {"logprobs", req.logprobs && !logprobs.empty()
                                  ? api_completion_logprobs_json(logprobs, tok)
                                  : json(nullptr)},
                 {"finish_reason", finish_reason.empty() ? json(nullptr) : json(finish_reason)}};
  return json{{"id", id},           {"object", "text_completion"}, {"created", created},
              {"model", req.model}, {"choices", json::array({std::move(choice)})}};
}

json api_usage_chunk(const ApiRequest& req, const std::string& id, int64_t created,
                     const ApiUsage& usage) {
  const char* object = req.endpoint == ApiEndpoint::ChatCompletions ? "chat.completion.chunk"
                                                                     : "text_completion";
  return json{{"id", id},           {"object", object},           {"created", created},
              {"model", req.model}, {"choices", json::array()}, {"usage", api_usage_json(usage)}};
}

std::string api_json_text(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string api_sse_event(const json& j) { return "data: " + api_json_text(j) + "\n\n"; }

}  // namespace dm
