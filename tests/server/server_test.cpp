// A real server in-process on 127.0.0.1 (ephemeral port) over the tiny synthetic pair, driven with
// httplib::Client: answers equal the plain greedy output (the served pair decodes speculatively, so
// this also checks that the served path is lossless), streaming equals non-streaming, stop strings,
// limits, errors in OpenAI's shape, auth, tokenize, metrics, the loading state and cache reuse.
#include <memory>
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

#include "server/server_fixture.h"

namespace dflash::server_test {
namespace {

const char* kPrompts[] = {"hello", "Tell me a story about a cat.", "1 2 3 4", "x", "What is DFlash?"};

httplib::Headers no_headers() { return {}; }

json post_json(httplib::Client& c, const std::string& path, const json& body, int* status = nullptr,
               const httplib::Headers& headers = no_headers()) {
  auto r = c.Post(path, headers, body.dump(), "application/json");
  EXPECT_TRUE(r) << "no response from " << path;
  if (!r) return {};
  if (status) *status = r->status;
  return json::parse(r->body, nullptr, false);
}

// One shared server for the tests that do not need special options. It is stopped by a gtest
// environment's TearDown, before static destruction: its worker threads must not outlive the
// process-wide objects they use (the quant thread pool, ...).
class SharedServerEnv : public ::testing::Environment {
 public:
  void TearDown() override { server.reset(); }
  std::unique_ptr<TestServer> server;
};
SharedServerEnv* const g_shared_env =
    static_cast<SharedServerEnv*>(::testing::AddGlobalTestEnvironment(new SharedServerEnv));

TestServer& shared() {
  if (!g_shared_env->server) {
    server::ServerOptions o;
    o.n_parallel = 2;
    g_shared_env->server = std::make_unique<TestServer>(o);
  }
  return *g_shared_env->server;
}

TEST(Server, HealthAndModels) {
  auto c = shared().client();
  auto h = c->Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  EXPECT_EQ(json::parse(h->body)["status"], "ok");
  auto m = c->Get("/v1/models");
  ASSERT_TRUE(m);
  ASSERT_EQ(m->status, 200);
  const json j = json::parse(m->body);
  EXPECT_EQ(j["object"], "list");
  ASSERT_EQ(j["data"].size(), 1u);
  EXPECT_EQ(j["data"][0]["id"], "target");
  EXPECT_EQ(j["data"][0]["object"], "model");
  EXPECT_EQ(j["data"][0]["meta"]["speculative"], true);
  EXPECT_EQ(j["data"][0]["meta"]["n_ctx"], 4096);
}

TEST(Server, ChatEqualsGreedyReference) {
  auto c = shared().client();
  for (const char* p : kPrompts) {
    const Reference ref = reference().chat(p, 40);
    int status = 0;
    const json j = post_json(*c, "/v1/chat/completions", chat_body(p, 40), &status);
    ASSERT_EQ(status, 200) << j.dump();
    EXPECT_EQ(j["object"], "chat.completion");
    EXPECT_EQ(j["model"], "target");
    EXPECT_TRUE(j["id"].get<std::string>().rfind("chatcmpl-", 0) == 0);
    ASSERT_EQ(j["choices"].size(), 1u);
    EXPECT_EQ(j["choices"][0]["index"], 0);
    EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
    EXPECT_EQ(j["choices"][0]["message"]["content"], ref.text) << p;
    EXPECT_EQ(j["choices"][0]["finish_reason"], ref.finish);
    EXPECT_EQ(j["usage"]["prompt_tokens"], ref.prompt.size());
    EXPECT_EQ(j["usage"]["completion_tokens"], ref.tokens.size());
    EXPECT_EQ(j["usage"]["total_tokens"], ref.prompt.size() + ref.tokens.size());
  }
}

TEST(Server, StreamingEqualsNonStreaming) {
  auto c = shared().client();
  for (const char* p : kPrompts) {
    const Reference ref = reference().chat(p, 40);
    json body = chat_body(p, 40, true);
    body["stream_options"] = {{"include_usage", true}};
    auto r = c->Post("/v1/chat/completions", body.dump(), "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(r->get_header_value("Content-Type"), "text/event-stream");
    const SseStream s = parse_sse(r->body);
    EXPECT_TRUE(s.well_formed) << r->body;
    EXPECT_TRUE(s.done);
    EXPECT_EQ(s.text, ref.text) << p;
    EXPECT_EQ(s.finish, ref.finish);
    ASSERT_FALSE(s.usage.is_null());
    EXPECT_EQ(s.usage["completion_tokens"], ref.tokens.size());
    EXPECT_EQ(s.usage["prompt_tokens"], ref.prompt.size());
    // The first chunk carries the role; every chunk is a chat.completion.chunk with the same id.
    ASSERT_GE(s.events.size(), 3u);
    EXPECT_EQ(s.events[0]["choices"][0]["delta"]["role"], "assistant");
    for (const json& e : s.events) {
      EXPECT_EQ(e["object"], "chat.completion.chunk");
      EXPECT_EQ(e["id"], s.events[0]["id"]);
    }
  }
}

TEST(Server, CompletionsEqualGreedyReference) {
  auto c = shared().client();
  for (const char* p : kPrompts) {
    const Reference ref = reference().raw(p, 30);
    int status = 0;
    const json j = post_json(*c, "/v1/completions", {{"prompt", p}, {"max_tokens", 30}}, &status);
    ASSERT_EQ(status, 200) << j.dump();
    EXPECT_EQ(j["object"], "text_completion");
    EXPECT_EQ(j["choices"][0]["text"], ref.text);
    EXPECT_EQ(j["choices"][0]["finish_reason"], ref.finish);
    EXPECT_EQ(j["usage"]["completion_tokens"], ref.tokens.size());

    auto r = c->Post("/v1/completions", json{{"prompt", p}, {"max_tokens", 30}, {"stream", true}}.dump(),
                     "application/json");
    ASSERT_TRUE(r);
    const SseStream s = parse_sse(r->body);
    EXPECT_TRUE(s.done && s.well_formed) << r->body;
    EXPECT_EQ(s.text, ref.text);
    EXPECT_EQ(s.finish, ref.finish);
  }
  // A prompt of token ids.
  const std::vector<int32_t> ids = reference().tokenizer().encode("token ids");
  const Reference ref = reference().generate(ids, 20);
  const json j = post_json(*c, "/v1/completions", {{"prompt", ids}, {"max_tokens", 20}});
  EXPECT_EQ(j["choices"][0]["text"], ref.text);
}

// A stop string taken from the middle of the reference answer: the text ends right before its first
// occurrence, streamed or not, and finish_reason is "stop".
TEST(Server, StopStrings) {
  auto c = shared().client();
  int tested = 0;
  for (const char* p : kPrompts) {
    const Reference ref = reference().chat(p, 60);
    // Two ASCII characters at least 5 bytes in.
    size_t at = std::string::npos;
    for (size_t i = 5; i + 1 < ref.text.size(); ++i)
      if (static_cast<unsigned char>(ref.text[i]) < 0x80 && static_cast<unsigned char>(ref.text[i + 1]) < 0x80 &&
          ref.text[i] != ref.text[i + 1]) {
        at = i;
        break;
      }
    if (at == std::string::npos) continue;
    const std::string stop = ref.text.substr(at, 2);
    const std::string want = ref.text.substr(0, ref.text.find(stop));
    json body = chat_body(p, 60);
    body["stop"] = json::array({"never-in-the-text", stop});
    int status = 0;
    const json j = post_json(*c, "/v1/chat/completions", body, &status);
    ASSERT_EQ(status, 200);
    EXPECT_EQ(j["choices"][0]["message"]["content"], want) << "stop " << json(stop).dump();
    EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
    EXPECT_LE(j["usage"]["completion_tokens"].get<size_t>(), ref.tokens.size());

    body["stream"] = true;
    body["stop"] = stop;  // a plain string works too
    auto r = c->Post("/v1/chat/completions", body.dump(), "application/json");
    ASSERT_TRUE(r);
    const SseStream s = parse_sse(r->body);
    EXPECT_TRUE(s.done && s.well_formed);
    EXPECT_EQ(s.text, want);
    EXPECT_EQ(s.finish, "stop");
    // Nothing streamed ever contained the start of the stop string past the cut.
    for (const json& e : s.events) {
      if (e["choices"].size() && e["choices"][0]["delta"].contains("content")) {
        EXPECT_EQ(e["choices"][0]["delta"]["content"].get<std::string>().find(stop), std::string::npos);
      }
    }
    ++tested;
  }
  EXPECT_GE(tested, 3);
}

TEST(Server, MaxTokens) {
  auto c = shared().client();
  const Reference ref = reference().chat("count", 200);
  for (int n : {1, 2, 7}) {
    if (static_cast<size_t>(n) > ref.tokens.size()) continue;
    const Reference cut = reference().chat("count", n);
    json body = chat_body("count", 1000);
    body["max_completion_tokens"] = n;  // wins over max_tokens
    const json j = post_json(*c, "/v1/chat/completions", body);
    EXPECT_EQ(j["usage"]["completion_tokens"], cut.tokens.size());
    EXPECT_EQ(j["choices"][0]["message"]["content"], cut.text);
    EXPECT_EQ(j["choices"][0]["finish_reason"], cut.finish);
  }
}

TEST(Server, BadRequestsGetOpenAIErrors) {
  auto c = shared().client();
  struct Case {
    std::string path, body;
    int status;
    std::string param;
  };
  const std::vector<Case> cases = {
      {"/v1/chat/completions", "{not json", 400, ""},
      {"/v1/chat/completions", "[1, 2]", 400, ""},
      {"/v1/chat/completions", R"({"messages": "hi"})", 400, "messages"},
      {"/v1/chat/completions", R"({"model": "x"})", 400, "messages"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"})", 400,
       "max_tokens"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "temperature": 2.5})", 400,
       "temperature"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "n": 3})", 400, "n"},
      {"/v1/completions", R"({"prompt": 12})", 400, "prompt"},
      {"/v1/completions", R"({"prompt": [100000]})", 400, "prompt"},
      {"/v1/completions", R"({"prompt": ""})", 400, "prompt"},
      {"/tokenize", R"({"text": "x"})", 400, "content"},
      {"/detokenize", R"({"tokens": [1, 99999]})", 400, "tokens"},
  };
  for (const Case& k : cases) {
    auto r = c->Post(k.path, k.body, "application/json");
    ASSERT_TRUE(r) << k.body;
    EXPECT_EQ(r->status, k.status) << k.path << " " << k.body << " -> " << r->body;
    const json j = json::parse(r->body, nullptr, false);
    ASSERT_TRUE(j.is_object() && j.contains("error")) << r->body;
    EXPECT_TRUE(j["error"]["message"].is_string());
    EXPECT_EQ(j["error"]["type"], "invalid_request_error");
    EXPECT_TRUE(j["error"].contains("param") && j["error"].contains("code"));
    if (!k.param.empty()) {
      EXPECT_EQ(j["error"]["param"], k.param) << r->body;
    }
  }
  auto t = c->Post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "temperature": 2.5})",
                   "application/json");
  EXPECT_NE(t->body.find("temperature must be in [0, 2]"), std::string::npos) << t->body;
  // Unknown routes: 404 with a JSON error too.
  auto nf = c->Get("/v2/nothing");
  ASSERT_TRUE(nf);
  EXPECT_EQ(nf->status, 404);
  EXPECT_EQ(json::parse(nf->body)["error"]["code"], "not_found");
  // The server still answers normally afterwards.
  EXPECT_EQ(c->Get("/health")->status, 200);
}

TEST(Server, OversizedBodies) {
  TestServer ts([] {
    server::ServerOptions o;
    o.max_body_bytes = 64 * 1024;
    o.drafter_path = "-";
    return o;
  }());
  auto c = ts.client();
  std::string big = R"({"messages": [{"role": "user", "content": ")" + std::string(100 * 1024, 'a') + R"("}]})";
  auto r = c->Post("/v1/chat/completions", big, "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 413);
  EXPECT_EQ(json::parse(r->body)["error"]["code"], "request_too_large");
  // Chunked upload (no Content-Length) of the same body: also refused.
  auto c2 = ts.client();
  size_t sent = 0;
  auto rc = c2->Post(
      "/v1/chat/completions",
      [&](size_t, httplib::DataSink& sink) {
        const size_t n = std::min<size_t>(8192, big.size() - sent);
        sink.write(big.data() + sent, n);
        sent += n;
        if (sent == big.size()) sink.done();
        return true;
      },
      "application/json");
  ASSERT_TRUE(rc);
  EXPECT_EQ(rc->status, 413);
  // And the default limit (8 MiB) on the shared server.
  auto c3 = shared().client();
  std::string huge = R"({"messages": [{"role": "user", "content": ")" + std::string(9u << 20, 'b') + R"("}]})";
  auto rh = c3->Post("/v1/chat/completions", huge, "application/json");
  ASSERT_TRUE(rh);
  EXPECT_EQ(rh->status, 413);
  EXPECT_EQ(shared().client()->Get("/health")->status, 200);
}

TEST(Server, ContextOverflow) {
  TestServer ts([] {
    server::ServerOptions o;
    o.n_ctx = 64;
    o.drafter_path = "-";
    return o;
  }());
  auto c = ts.client();
  int status = 0;
  const json j = post_json(*c, "/v1/chat/completions", chat_body(std::string(100, 'z'), 4), &status);
  EXPECT_EQ(status, 400);
  EXPECT_EQ(j["error"]["code"], "context_length_exceeded");
  EXPECT_EQ(j["error"]["param"], "messages");
  const json k = post_json(*c, "/v1/completions", {{"prompt", std::string(64, 'q')}}, &status);
  EXPECT_EQ(status, 400);
  EXPECT_EQ(k["error"]["code"], "context_length_exceeded");
  // A prompt that fits generates until the context is full: finish_reason "length". (The last token
  // is yielded without entering the cache, so prompt + completion can reach n_ctx + 1.)
  const std::vector<int32_t> fits = reference().tokenizer().encode(std::string(50, 'q'));
  ASSERT_LT(fits.size(), 64u);
  const Reference ref = RefModel(Files::get().target, 64).generate(fits, 1000);
  const json ok = post_json(*c, "/v1/completions", {{"prompt", fits}, {"max_tokens", 1000}}, &status);
  EXPECT_EQ(status, 200) << ok.dump();
  EXPECT_EQ(ok["choices"][0]["text"], ref.text);
  EXPECT_EQ(ok["choices"][0]["finish_reason"], ref.finish);
  EXPECT_LE(ok["usage"]["total_tokens"].get<int>(), 65);
}

TEST(Server, ApiKey) {
  TestServer ts([] {
    server::ServerOptions o;
    o.api_key = "sekrit-key";
    o.drafter_path = "-";
    return o;
  }());
  auto c = ts.client();
  const std::string body = chat_body("hi", 3).dump();
  auto none = c->Post("/v1/chat/completions", body, "application/json");
  ASSERT_TRUE(none);
  EXPECT_EQ(none->status, 401);
  EXPECT_EQ(json::parse(none->body)["error"]["code"], "invalid_api_key");
  auto wrong = c->Post("/v1/chat/completions", {{"Authorization", "Bearer sekrit-kez"}}, body, "application/json");
  EXPECT_EQ(wrong->status, 401);
  auto basic = c->Post("/v1/chat/completions", {{"Authorization", "sekrit-key"}}, body, "application/json");
  EXPECT_EQ(basic->status, 401);
  EXPECT_EQ(c->Get("/v1/models")->status, 401);
  EXPECT_EQ(c->Get("/metrics")->status, 401);
  EXPECT_EQ(c->Get("/health")->status, 200);  // health stays open for supervisors
  const httplib::Headers auth = {{"Authorization", "Bearer sekrit-key"}};
  auto ok = c->Post("/v1/chat/completions", auth, body, "application/json");
  EXPECT_EQ(ok->status, 200) << ok->body;
  EXPECT_EQ(c->Get("/v1/models", auth)->status, 200);
  // Unauthenticated bodies are read in full: the keep-alive connection stays in step.
  auto again = c->Post("/tokenize", auth, R"({"content": "ab"})", "application/json");
  EXPECT_EQ(again->status, 200);
}

TEST(Server, TokenizeDetokenize) {
  auto c = shared().client();
  const std::string text = "Hello <|im_start|> w\xc3\xb6rld";
  const json t = post_json(*c, "/tokenize", {{"content", text}});
  const std::vector<int32_t> want = reference().tokenizer().encode(text, {.add_special = false});
  EXPECT_EQ(t["tokens"].get<std::vector<int32_t>>(), want);
  const json d = post_json(*c, "/detokenize", {{"tokens", want}});
  EXPECT_EQ(d["content"], text);
  const json p = post_json(*c, "/tokenize", {{"content", "Hello world"}, {"with_pieces", true}});
  std::string joined;
  std::vector<int32_t> ids;
  for (const json& t : p["tokens"]) {
    joined += t["piece"].get<std::string>();
    ids.push_back(t["id"]);
  }
  EXPECT_EQ(joined, "Hello world");
  EXPECT_EQ(ids, reference().tokenizer().encode("Hello world", {.add_special = false}));
  const json ns = post_json(*c, "/tokenize", {{"content", "<|im_start|>"}, {"parse_special", false}});
  EXPECT_GT(ns["tokens"].size(), 1u);
}

// /health answers 503 {"status":"loading"} while the model loads (here: before load() is called),
// and the generation endpoints 503 too; then 200.
TEST(Server, LoadingState) {
  TestServer ts(server::ServerOptions{}, /*load=*/false);
  auto c = ts.client();
  auto h = c->Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 503);
  EXPECT_EQ(json::parse(h->body)["status"], "loading");
  auto r = c->Post("/v1/chat/completions", chat_body("hi", 2).dump(), "application/json");
  EXPECT_EQ(r->status, 503);
  EXPECT_EQ(json::parse(r->body)["error"]["code"], "model_loading");
  ts.srv->start_loading();
  EXPECT_EQ(ts.srv->wait_loaded(), server::Server::State::kReady);
  EXPECT_EQ(c->Get("/health")->status, 200);
  EXPECT_EQ(c->Post("/v1/chat/completions", chat_body("hi", 2).dump(), "application/json")->status, 200);
}

TEST(Server, LoadFailureIsReported) {
  server::ServerOptions o;
  o.model_path = temp_path("does-not-exist.gguf");
  o.drafter_path = "-";
  TestServer ts(o, /*load=*/false);
  ts.srv->start_loading();
  EXPECT_EQ(ts.srv->wait_loaded(), server::Server::State::kFailed);
  EXPECT_NE(ts.srv->load_error().find("does-not-exist"), std::string::npos);
  auto h = ts.client()->Get("/health");
  EXPECT_EQ(h->status, 500);
  EXPECT_EQ(json::parse(h->body)["status"], "error");
}

// Multi-turn reuse: a follow-up whose prompt extends the previous prompt + answer prefills only the
// new tokens, lands on the slot holding that conversation, and still gives the greedy answer.
TEST(Server, FollowUpsReuseTheirSlotsCache) {
  TestServer ts([] {
    server::ServerOptions o;
    o.n_parallel = 2;
    return o;
  }());
  auto c = ts.client();
  const auto& tok = reference().tokenizer();
  std::vector<int32_t> conv[2] = {tok.encode("first conversation"), tok.encode("second one, different")};
  const std::vector<int32_t> more[2] = {tok.encode("xyz"), tok.encode("abc")};
  for (int turn = 0; turn < 3; ++turn) {
    for (int k = 0; k < 2; ++k) {
      const Reference ref = reference().generate(conv[k], 12);
      const json j = post_json(*c, "/v1/completions", {{"prompt", conv[k]}, {"max_tokens", 12}});
      EXPECT_EQ(j["choices"][0]["text"], ref.text) << "turn " << turn << " conversation " << k;
      const int64_t cached = j["usage"]["prompt_tokens_details"]["cached_tokens"];
      if (turn == 0) {
        EXPECT_EQ(cached, 0);
      } else {
        // The cache holds the previous prompt + answer minus its last token.
        EXPECT_EQ(cached, static_cast<int64_t>(conv[k].size() - 1 - more[k].size()))
            << "turn " << turn << " conversation " << k;
      }
      // Next turn: the answer's tokens plus three new ones.
      conv[k].insert(conv[k].end(), ref.tokens.begin(), ref.tokens.end());
      conv[k].insert(conv[k].end(), more[k].begin(), more[k].end());
    }
  }
  const std::string m = ts.client()->Get("/metrics")->body;
  EXPECT_GT(metric(m, "dflash_prompt_tokens_reused_total"), 0);
}

// With the bundled trained pair (real text, so an answer re-tokenizes to the tokens that produced
// it): chat follow-ups that repeat the conversation reuse their slot's cache, two conversations
// interleaved on two slots each keep theirs, and every answer equals the plain greedy reference.
TEST(Server, ChatFollowUpsReuseTheCacheOnTheBundledPair) {
  const std::string target = DFLASH_SOURCE_DIR "/models/target.gguf";
  const std::string drafter = DFLASH_SOURCE_DIR "/models/drafter.gguf";
  if (!std::filesystem::exists(target) || !std::filesystem::exists(drafter)) GTEST_SKIP() << "no bundled pair";
  TestServer ts([&] {
    server::ServerOptions o;
    o.model_path = target;
    o.drafter_path = drafter;
    o.n_parallel = 2;
    return o;
  }());
  RefModel ref(target);
  auto c = ts.client(120);
  const std::vector<std::string> firsts = {"Write a Python function `add`: add two numbers",
                                           "Write a Python function `is_even`: tell whether n is even"};
  const std::vector<std::string> seconds = {"Write a Python function `sub`: subtract", "Now for odd numbers"};
  std::vector<text::ChatMessage> conv[2];
  for (int turn = 0; turn < 2; ++turn) {
    for (int k = 0; k < 2; ++k) {
      conv[k].push_back({"user", turn == 0 ? firsts[k] : seconds[k], std::nullopt});
      const Reference want = ref.generate(ref.chat_prompt(conv[k]), 48);
      json msgs = json::array();
      for (const auto& m : conv[k]) msgs.push_back({{"role", m.role}, {"content", m.content}});
      const json j = post_json(*c, "/v1/chat/completions", {{"messages", msgs}, {"max_tokens", 48}});
      const std::string got = j["choices"][0]["message"]["content"];
      EXPECT_EQ(got, want.text) << "turn " << turn << " conversation " << k;
      const int64_t cached = j["usage"]["prompt_tokens_details"]["cached_tokens"];
      if (turn == 0) {
        EXPECT_EQ(cached, 0);
      } else {
        // The previous turn's prompt + answer, minus the answer's last token, was in this slot.
        const std::vector<text::ChatMessage> before(conv[k].begin(), conv[k].end() - 2);
        const Reference prev = ref.generate(ref.chat_prompt(before), 48);
        EXPECT_EQ(cached, static_cast<int64_t>(prev.prompt.size() + prev.tokens.size() - 1))
            << "conversation " << k;
      }
      conv[k].push_back({"assistant", got, std::nullopt});
    }
  }
}

}  // namespace
}  // namespace dflash::server_test
