#include "server/api.h"

#include <random>

#include <fmt/format.h>

#include <cmath>
#include <limits>

namespace dflash::server {
namespace {

using json = nlohmann::json;

// The field `key` of an object, or null when absent or JSON null (OpenAI treats null as "not given").
const json* field(const json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

[[noreturn]] void wrong_type(const char* key, const char* want, const json& got) {
  bad_request(fmt::format("'{}' must be {}, got {}", key, want, got.type_name()), key, "invalid_type");
}

std::optional<bool> get_bool(const json& obj, const char* key) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) wrong_type(key, "a boolean", *v);
  return v->get<bool>();
}

std::optional<double> get_number(const json& obj, const char* key) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) wrong_type(key, "a number", *v);
  return v->get<double>();
}

// An integer; a float is accepted when it is integral (some clients send 100.0).
int64_t as_int(const json& v, const char* key) {
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15) return static_cast<int64_t>(d);
  }
  wrong_type(key, "an integer", v);
}

std::optional<int64_t> get_int(const json& obj, const char* key) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  return as_int(*v, key);
}

std::optional<std::string> get_string(const json& obj, const char* key) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_string()) wrong_type(key, "a string", *v);
  return v->get<std::string>();
}

// The fields both endpoints share.
void parse_common(const json& b, CompletionRequest& r) {
  if (auto m = get_string(b, "model")) r.model = *m;
  if (auto s = get_bool(b, "stream")) r.stream = *s;
  if (const json* so = field(b, "stream_options")) {
    if (!so->is_object()) wrong_type("stream_options", "an object", *so);
    if (auto u = get_bool(*so, "include_usage")) r.include_usage = *u;
  }

  // max_completion_tokens is the newer name; it wins when both are given.
  for (const char* key : {"max_tokens", "max_completion_tokens"}) {
    if (auto n = get_int(b, key)) {
      if (*n < 1) bad_request(fmt::format("'{}' must be at least 1, got {}", key, *n), key, "invalid_value");
      r.max_tokens = *n;
    }
  }

  if (const json* st = field(b, "stop")) {
    if (st->is_string()) {
      r.stop.push_back(st->get<std::string>());
    } else if (st->is_array()) {
      if (st->size() > 16) bad_request(fmt::format("'stop' has {} strings; at most 16 are allowed", st->size()), "stop");
      for (const json& s : *st) {
        if (!s.is_string()) wrong_type("stop", "a string or an array of strings", s);
        r.stop.push_back(s.get<std::string>());
      }
    } else {
      wrong_type("stop", "a string or an array of strings", *st);
    }
    for (const std::string& s : r.stop)
      if (s.empty()) bad_request("'stop' strings must not be empty", "stop", "invalid_value");
  }

  // Sampling. Without a temperature (or with 0) decoding is greedy; temperature > 0 samples with the
  // other knobs (speculative sampling when a drafter is loaded).
  SamplingParams& sp = r.sampling;
  if (auto t = get_number(b, "temperature")) sp.temperature = *t;
  if (auto p = get_number(b, "top_p")) sp.top_p = *p;
  if (auto k = get_int(b, "top_k")) sp.top_k = *k == -1 ? 0 : *k;  // -1: off, as in vLLM
  if (auto m = get_number(b, "min_p")) sp.min_p = *m;
  if (auto s = get_int(b, "seed"))
    sp.seed = static_cast<uint64_t>(*s);
  else
    sp.seed = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();  // no seed: a fresh draw
  if (const std::string err = sp.check(); !err.empty()) {
    const char* param = err.rfind("temperature", 0) == 0 ? "temperature"
                        : err.rfind("top_k", 0) == 0     ? "top_k"
                        : err.rfind("top_p", 0) == 0     ? "top_p"
                                                         : "min_p";
    bad_request(err, param, "invalid_value");
  }
  for (const char* key : {"frequency_penalty", "presence_penalty"})
    if (auto p = get_number(b, key); p && *p != 0.0)
      bad_request(fmt::format("'{}' is not supported (only 0)", key), key, "unsupported_value");
  if (auto p = get_number(b, "repetition_penalty"); p && *p != 1.0)
    bad_request("'repetition_penalty' is not supported (only 1)", "repetition_penalty", "unsupported_value");
  for (const char* key : {"n", "best_of"})
    if (auto n = get_int(b, key); n && *n != 1)
      bad_request(fmt::format("'{}' must be 1: one choice per request is supported", key), key, "unsupported_value");
  if (const json* lb = field(b, "logit_bias")) {
    if (!lb->is_object()) wrong_type("logit_bias", "an object", *lb);
    if (!lb->empty()) bad_request("'logit_bias' is not supported", "logit_bias", "unsupported_value");
  }
  (void)get_string(b, "user");  // accepted and ignored
  if (const json* rf = field(b, "response_format")) {
    if (!rf->is_object()) wrong_type("response_format", "an object", *rf);
    const std::optional<std::string> type = get_string(*rf, "type");
    if (type && *type != "text")
      bad_request(fmt::format("response_format '{}' is not supported (only 'text')", *type), "response_format",
                  "unsupported_value");
  }
  for (const char* key : {"tools", "functions"}) {
    if (const json* t = field(b, key)) {
      if (!t->is_array()) wrong_type(key, "an array", *t);
      if (!t->empty()) bad_request(fmt::format("'{}' (tool calling) is not supported", key), key, "unsupported_value");
    }
  }
  if (auto n = get_int(b, "top_logprobs"); n && *n > 0)
    bad_request("'top_logprobs' is not supported", "top_logprobs", "unsupported_value");
}

// A message's content: a string, or an array of text parts (joined by newlines).
std::string message_content(const json& c, size_t index) {
  if (c.is_string()) return c.get<std::string>();
  const std::string param = fmt::format("messages[{}].content", index);
  if (!c.is_array())
    bad_request(fmt::format("{} must be a string or an array of content parts, got {}", param, c.type_name()), param,
                "invalid_type");
  std::string out;
  for (size_t i = 0; i < c.size(); ++i) {
    const json& part = c[i];
    if (!part.is_object())
      bad_request(fmt::format("{}[{}] must be an object, got {}", param, i, part.type_name()), param, "invalid_type");
    const json* type = field(part, "type");
    if (!type || !type->is_string() || type->get<std::string>() != "text")
      bad_request(fmt::format("{}[{}]: only text content parts are supported", param, i), param, "unsupported_value");
    const json* text = field(part, "text");
    if (!text || !text->is_string())
      bad_request(fmt::format("{}[{}].text must be a string", param, i), param, "invalid_type");
    if (i) out += '\n';
    out += text->get<std::string>();
  }
  return out;
}

}  // namespace

void bad_request(std::string message, std::string param, std::string code) {
  throw ApiError(400, std::move(message), "invalid_request_error", std::move(param), std::move(code));
}

nlohmann::json error_json(const ApiError& e) {
  json err = {{"message", e.message}, {"type", e.type}, {"param", nullptr}, {"code", nullptr}};
  if (!e.param.empty()) err["param"] = e.param;
  if (!e.code.empty()) err["code"] = e.code;
  return json{{"error", err}};
}

nlohmann::json parse_body(const std::string& body) {
  json j;
  try {
    j = json::parse(body);
  } catch (const json::parse_error& e) {
    bad_request(fmt::format("the request body is not valid JSON: {}", e.what()), {}, "invalid_json");
  }
  if (!j.is_object()) bad_request(fmt::format("the request body must be a JSON object, got {}", j.type_name()), {},
                                  "invalid_json");
  return j;
}

CompletionRequest parse_chat_request(const nlohmann::json& b) {
  CompletionRequest r;
  r.endpoint = Endpoint::kChat;
  parse_common(b, r);
  if (auto lp = get_bool(b, "logprobs"); lp && *lp) bad_request("'logprobs' is not supported", "logprobs",
                                                                "unsupported_value");

  const json* msgs = field(b, "messages");
  if (!msgs) bad_request("'messages' is required", "messages", "missing_field");
  if (!msgs->is_array()) wrong_type("messages", "an array", *msgs);
  if (msgs->empty()) bad_request("'messages' must not be empty", "messages", "invalid_value");
  for (size_t i = 0; i < msgs->size(); ++i) {
    const json& m = (*msgs)[i];
    const std::string param = fmt::format("messages[{}]", i);
    if (!m.is_object())
      bad_request(fmt::format("{} must be an object, got {}", param, m.type_name()), param, "invalid_type");
    const json* role = field(m, "role");
    if (!role) bad_request(fmt::format("{}.role is required", param), param + ".role", "missing_field");
    if (!role->is_string())
      bad_request(fmt::format("{}.role must be a string, got {}", param, role->type_name()), param + ".role",
                  "invalid_type");
    text::ChatMessage msg;
    msg.role = role->get<std::string>();
    if (msg.role == "developer") msg.role = "system";  // OpenAI's newer name for the system role
    if (msg.role != "system" && msg.role != "user" && msg.role != "assistant" && msg.role != "tool")
      bad_request(fmt::format("{}.role '{}' is not one of system, developer, user, assistant, tool", param, msg.role),
                  param + ".role", "invalid_value");
    const json* content = field(m, "content");
    if (content) {
      msg.content = message_content(*content, i);
    } else if (msg.role != "assistant") {
      bad_request(fmt::format("{}.content is required", param), param + ".content", "missing_field");
    }
    if (const json* tc = field(m, "tool_calls")) {
      if (!tc->is_array() || !tc->empty())
        bad_request(fmt::format("{}.tool_calls: tool calling is not supported", param), param + ".tool_calls",
                    "unsupported_value");
    }
    for (const char* key : {"reasoning_content", "reasoning"}) {
      if (const json* rc = field(m, key)) {
        if (!rc->is_string())
          bad_request(fmt::format("{}.{} must be a string, got {}", param, key, rc->type_name()), param + "." + key,
                      "invalid_type");
        msg.reasoning_content = rc->get<std::string>();
      }
    }
    r.messages.push_back(std::move(msg));
  }

  // vLLM-style template switches, plus OpenAI's top-level reasoning_effort.
  if (auto e = get_string(b, "reasoning_effort")) r.chat.reasoning_effort = *e;
  if (const json* kw = field(b, "chat_template_kwargs")) {
    if (!kw->is_object()) wrong_type("chat_template_kwargs", "an object", *kw);
    if (auto t = get_bool(*kw, "enable_thinking")) r.chat.enable_thinking = *t;
    if (auto p = get_bool(*kw, "preserve_thinking")) r.chat.preserve_thinking = *p;
    if (auto e = get_string(*kw, "reasoning_effort")) r.chat.reasoning_effort = *e;
  }
  return r;
}

CompletionRequest parse_completion_request(const nlohmann::json& b) {
  CompletionRequest r;
  r.endpoint = Endpoint::kCompletion;
  parse_common(b, r);
  if (auto lp = get_int(b, "logprobs"); lp && *lp > 0) bad_request("'logprobs' is not supported", "logprobs",
                                                                    "unsupported_value");
  if (auto e = get_bool(b, "echo"); e && *e) bad_request("'echo' is not supported", "echo", "unsupported_value");
  if (auto s = get_string(b, "suffix"); s && !s->empty())
    bad_request("'suffix' is not supported", "suffix", "unsupported_value");

  const json* p = field(b, "prompt");
  if (!p) bad_request("'prompt' is required", "prompt", "missing_field");
  auto ids_of = [](const json& arr) {
    std::vector<int32_t> ids;
    for (const json& v : arr) {
      const int64_t id = as_int(v, "prompt");
      if (id < 0 || id > std::numeric_limits<int32_t>::max())
        bad_request(fmt::format("'prompt' token id {} is out of range", id), "prompt", "invalid_value");
      ids.push_back(static_cast<int32_t>(id));
    }
    return ids;
  };
  if (p->is_string()) {
    r.prompt_text = p->get<std::string>();
  } else if (p->is_array()) {
    if (p->empty()) bad_request("'prompt' must not be empty", "prompt", "invalid_value");
    if ((*p)[0].is_number()) {
      r.prompt_ids = ids_of(*p);
      r.prompt_is_ids = true;
    } else {
      if (p->size() != 1)
        bad_request(fmt::format("'prompt' has {} prompts; one prompt per request is supported", p->size()), "prompt",
                    "unsupported_value");
      const json& one = (*p)[0];
      if (one.is_string()) {
        r.prompt_text = one.get<std::string>();
      } else if (one.is_array()) {
        r.prompt_ids = ids_of(one);
        r.prompt_is_ids = true;
      } else {
        wrong_type("prompt", "a string, an array of token ids, or an array of one of those", one);
      }
    }
  } else {
    wrong_type("prompt", "a string or an array of token ids", *p);
  }
  return r;
}

TokenizeRequest parse_tokenize_request(const nlohmann::json& b) {
  TokenizeRequest r;
  const std::optional<std::string> c = get_string(b, "content");
  if (!c) bad_request("'content' is required", "content", "missing_field");
  r.content = *c;
  if (auto v = get_bool(b, "add_special")) r.add_special = *v;
  if (auto v = get_bool(b, "parse_special")) r.parse_special = *v;
  if (auto v = get_bool(b, "with_pieces")) r.with_pieces = *v;
  return r;
}

std::vector<int32_t> parse_detokenize_request(const nlohmann::json& b) {
  const json* t = field(b, "tokens");
  if (!t) bad_request("'tokens' is required", "tokens", "missing_field");
  if (!t->is_array()) wrong_type("tokens", "an array of token ids", *t);
  std::vector<int32_t> ids;
  for (const json& v : *t) {
    const int64_t id = as_int(v, "tokens");
    if (id < 0 || id > std::numeric_limits<int32_t>::max())
      bad_request(fmt::format("'tokens': token id {} is out of range", id), "tokens", "invalid_value");
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

}  // namespace dflash::server
