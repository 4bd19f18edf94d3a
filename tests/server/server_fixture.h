// Shared pieces of the server tests: tiny synthetic target + drafter files (with the byte-level
// tokenizer and the ChatML template), an in-process server on 127.0.0.1 with an ephemeral port, the
// reference greedy output computed with a plain Engine, and a server-sent-events parser.
#pragma once

#include <gtest/gtest.h>
#include <httplib.h>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gguf/gguf.h"
#include "models/dflash_drafter.h"
#include "models/synth.h"
#include "models/synth_drafter.h"
#include "models/target.h"
#include "server/server.h"
#include "spec/engine.h"
#include "support/temp_dir.h"
#include "text/chat.h"
#include "text/tokenizer.h"

namespace dflash::server_test {

using json = nlohmann::json;

// A per-process temp directory (ctest runs each test as its own process, maybe in parallel), removed
// when the process exits.
inline std::string temp_path(const std::string& name) { return dflash::testing::temp_path("server_test", name); }

// A qwen35 hybrid of 4 layers, hidden 64, the 512-token byte-level vocabulary (+ ChatML template).
inline SynthTargetSpec tiny_target() {
  SynthTargetSpec s;
  s.n_layer = 4;
  s.n_embd = 64;
  s.n_ff = 128;
  s.n_vocab = 512;
  s.tokenizer = true;
  s.seed = 21;
  return s;
}

struct Files {
  std::string target, drafter;
  static const Files& get() {
    static const Files f = [] {
      Files f;
      f.target = temp_path("target.gguf");
      f.drafter = temp_path("drafter.gguf");
      const SynthTargetSpec ts = tiny_target();
      synth_target(ts, f.target);
      SynthDrafterSpec ds = SynthDrafterSpec::for_target(ts);
      ds.seed = 23;
      synth_drafter(ds, f.drafter);
      return f;
    }();
    return f;
  }
};

// What `dflash run` prints for a prompt: plain greedy decoding (no drafter), text decoded without
// special tokens, generation ending at an end-of-generation token or max_tokens.
struct Reference {
  std::vector<int32_t> prompt;
  std::vector<int32_t> tokens;
  std::string text;
  std::string finish;  // "stop" | "length"
};

class RefModel {
 public:
  explicit RefModel(const std::string& path, int64_t n_ctx = 4096)
      : file_(gguf::File::open(path)), backend_(make_cpu_backend(1)), tok_(text::Tokenizer::from_gguf(file_)),
        tmpl_(text::ChatTemplate::from_gguf(file_, tok_)) {
    TargetOptions to;
    to.n_ctx = n_ctx;
    model_ = TargetModel::load(file_, *backend_, to);
    engine_ = std::make_unique<Engine>(*model_);
  }

  const text::Tokenizer& tokenizer() const { return tok_; }

  std::vector<int32_t> chat_prompt(const std::vector<text::ChatMessage>& msgs, const text::ChatOptions& co = {}) const {
    return tok_.encode(tmpl_.render(msgs, co));
  }

  Reference generate(const std::vector<int32_t>& prompt, int64_t max_tokens) {
    std::lock_guard<std::mutex> lock(mu_);
    Reference r;
    r.prompt = prompt;
    GenerateOptions go;
    go.max_tokens = max_tokens;
    go.stop_tokens = tok_.eog_ids();
    engine_->reset();
    text::StreamDecoder dec(tok_, /*special=*/false);
    const GenerateStats st = engine_->generate(prompt, go, [&](int32_t t) {
      r.tokens.push_back(t);
      r.text += dec.push(t);
      return true;
    });
    r.text += dec.flush();
    r.finish = st.stopped_by_token ? "stop" : "length";
    return r;
  }

  Reference chat(const std::string& user, int64_t max_tokens, const std::string& system = {}) {
    std::vector<text::ChatMessage> msgs;
    if (!system.empty()) msgs.push_back({"system", system, std::nullopt});
    msgs.push_back({"user", user, std::nullopt});
    return generate(chat_prompt(msgs), max_tokens);
  }

  Reference raw(const std::string& prompt, int64_t max_tokens) { return generate(tok_.encode(prompt), max_tokens); }

 private:
  gguf::File file_;
  std::unique_ptr<Backend> backend_;
  text::Tokenizer tok_;
  text::ChatTemplate tmpl_;
  std::unique_ptr<TargetModel> model_;
  std::unique_ptr<Engine> engine_;
  std::mutex mu_;
};

// The process-wide reference model over Files::get().target.
inline RefModel& reference() {
  static RefModel ref(Files::get().target);
  return ref;
}

// A server on 127.0.0.1 with an ephemeral port, serving the tiny pair (speculative by default).
struct TestServer {
  std::unique_ptr<server::Server> srv;
  int port = 0;

  explicit TestServer(server::ServerOptions o = {}, bool load = true) {
    o.host = "127.0.0.1";
    o.port = 0;
    if (o.model_path.empty()) o.model_path = Files::get().target;
    if (o.drafter_path == "-")
      o.drafter_path.clear();
    else if (o.drafter_path.empty())
      o.drafter_path = Files::get().drafter;
    if (o.threads == 0) o.threads = 1;
    if (std::getenv("DFLASH_TEST_SERVER_LOG"))  // debugging: the server's request log on stderr
      o.log = [](const std::string& line) { std::fprintf(stderr, "[server] %s\n", line.c_str()); };
    srv = std::make_unique<server::Server>(o);
    port = srv->bind();
    srv->start();
    if (load) srv->load();
  }
  ~TestServer() { srv->stop(); }

  std::unique_ptr<httplib::Client> client(int timeout_s = 30) const {
    auto c = std::make_unique<httplib::Client>("127.0.0.1", port);
    c->set_read_timeout(timeout_s, 0);
    c->set_write_timeout(timeout_s, 0);
    c->set_connection_timeout(5, 0);
    return c;
  }
};

// A parsed SSE body: each "data: ..." event, the concatenated text, the finish reason.
struct SseStream {
  std::vector<json> events;
  bool done = false;         // ended with data: [DONE]
  bool well_formed = true;   // every event was "data: <json>\n\n" and nothing followed [DONE]
  std::string text;          // concatenated delta.content / text
  std::string finish;        // the finish_reason of the last choice that had one
  json usage;                // from an include_usage chunk
  std::string error;         // an error event's message
};

inline SseStream parse_sse(const std::string& body) {
  SseStream s;
  size_t pos = 0;
  while (pos < body.size()) {
    const size_t end = body.find("\n\n", pos);
    if (end == std::string::npos) {
      s.well_formed = false;
      break;
    }
    const std::string ev = body.substr(pos, end - pos);
    pos = end + 2;
    if (ev.rfind("data: ", 0) != 0 || s.done) {
      s.well_formed = false;
      continue;
    }
    const std::string data = ev.substr(6);
    if (data == "[DONE]") {
      s.done = true;
      continue;
    }
    json j = json::parse(data, nullptr, false);
    if (j.is_discarded()) {
      s.well_formed = false;
      continue;
    }
    if (j.contains("error")) s.error = j["error"].value("message", "");
    if (j.contains("usage") && !j["usage"].is_null()) s.usage = j["usage"];
    if (j.contains("choices")) {
      for (const json& c : j["choices"]) {
        if (c.contains("delta") && c["delta"].contains("content")) s.text += c["delta"]["content"].get<std::string>();
        if (c.contains("text")) s.text += c["text"].get<std::string>();
        if (c.contains("finish_reason") && !c["finish_reason"].is_null()) s.finish = c["finish_reason"];
      }
    }
    s.events.push_back(std::move(j));
  }
  return s;
}

inline json chat_body(const std::string& user, int64_t max_tokens, bool stream = false) {
  json b = {{"model", "tiny"}, {"messages", json::array({{{"role", "user"}, {"content", user}}})},
            {"max_tokens", max_tokens}};
  if (stream) b["stream"] = true;
  return b;
}

// The value of a metric line "name{labels} value" in a /metrics body (0 when absent).
inline double metric(const std::string& body, const std::string& name_and_labels) {
  const std::string key = name_and_labels + " ";
  size_t pos = 0;
  while ((pos = body.find(key, pos)) != std::string::npos) {
    if (pos == 0 || body[pos - 1] == '\n') return std::stod(body.substr(pos + key.size()));
    pos += key.size();
  }
  return 0;
}

}  // namespace dflash::server_test
