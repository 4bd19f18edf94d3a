// The OpenAI-compatible request side of `dflash serve`: errors in OpenAI's shape, and the parsing and
// validation of /v1/chat/completions and /v1/completions bodies into one CompletionRequest.
//
// Validation follows what the engine can do: greedy decoding (temperature 0 or absent) or sampling
// (temperature in (0, 2] with top_k, top_p, min_p, seed), speculative when a drafter is loaded;
// n = 1, no penalties, logprobs, tools or structured output. Everything else gets a 400
// naming the parameter.
// Unknown fields are ignored (clients send extras); known fields of the wrong type are a 400.
#pragma once

#include <cstdint>
#include <exception>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "spec/sampler.h"
#include "text/chat.h"

namespace dflash::server {

// An error answered to the client: HTTP status + OpenAI error object
// {"error": {"message", "type", "param", "code"}}.
struct ApiError : std::exception {
  ApiError(int status, std::string message, std::string type = "invalid_request_error", std::string param = {},
           std::string code = {})
      : status(status), message(std::move(message)), type(std::move(type)), param(std::move(param)),
        code(std::move(code)) {}
  const char* what() const noexcept override { return message.c_str(); }

  int status;
  std::string message;
  std::string type;   // invalid_request_error | authentication_error | server_error | ...
  std::string param;  // the offending request field, "" = null
  std::string code;   // machine-readable reason ("context_length_exceeded"), "" = null
};

// A 400 invalid_request_error naming the parameter.
[[noreturn]] void bad_request(std::string message, std::string param = {}, std::string code = {});

nlohmann::json error_json(const ApiError& e);

// Parses a request body; a 400 with the parser's message when it is not JSON or not an object.
nlohmann::json parse_body(const std::string& body);

enum class Endpoint { kChat, kCompletion };

struct CompletionRequest {
  Endpoint endpoint = Endpoint::kChat;
  std::string model;                    // as sent (informational; one model is served)
  bool stream = false;
  bool include_usage = false;           // stream_options.include_usage
  std::optional<int64_t> max_tokens;    // max_completion_tokens, else max_tokens; nullopt = up to the context
  std::vector<std::string> stop;        // stop strings (non-empty)
  SamplingParams sampling;              // temperature 0 (the default): greedy
  // chat
  std::vector<text::ChatMessage> messages;
  text::ChatOptions chat;
  // completion: text, or token ids when the prompt was given as ids
  std::string prompt_text;
  std::vector<int32_t> prompt_ids;
  bool prompt_is_ids = false;
};

CompletionRequest parse_chat_request(const nlohmann::json& body);
CompletionRequest parse_completion_request(const nlohmann::json& body);

// /tokenize {"content": str, "add_special": bool = false, "parse_special": bool = true,
// "with_pieces": bool = false}; /detokenize {"tokens": [int]}.
struct TokenizeRequest {
  std::string content;
  bool add_special = false;
  bool parse_special = true;
  bool with_pieces = false;
};
TokenizeRequest parse_tokenize_request(const nlohmann::json& body);
std::vector<int32_t> parse_detokenize_request(const nlohmann::json& body);

}  // namespace dflash::server
