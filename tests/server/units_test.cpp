// The server's parts on their own: stop-string hold-back, the slot queue (fairness, prefix
// placement), request validation, the metrics text.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "cli/load_progress.h"
#include "gguf/gguf.h"
#include "server/api.h"
#include "server/metrics.h"
#include "server/slot_pool.h"
#include "server/stop_matcher.h"

namespace dflash::server {
namespace {

using json = nlohmann::json;

// ---- StopMatcher ---------------------------------------------------------------------------------

// Pushes `text` split at the given cut points; returns everything emitted.
std::string run_matcher(StopMatcher& m, const std::string& text, const std::vector<size_t>& cuts, bool finish = true) {
  std::string out;
  size_t prev = 0;
  for (size_t c : cuts) {
    out += m.push(std::string_view(text).substr(prev, c - prev));
    prev = c;
  }
  out += m.push(std::string_view(text).substr(prev));
  if (finish) out += m.finish();
  return out;
}

TEST(StopMatcher, NoStopsPassesThrough) {
  StopMatcher m;
  EXPECT_EQ(m.push("abc"), "abc");
  EXPECT_EQ(m.push(""), "");
  EXPECT_EQ(m.finish(), "");
  EXPECT_FALSE(m.stopped());
}

TEST(StopMatcher, CutsBeforeTheStopAcrossPieces) {
  StopMatcher m({"END"});
  EXPECT_EQ(m.push("hello E"), "hello ");  // "E" could start END: held back
  EXPECT_EQ(m.held_bytes(), 1u);
  EXPECT_EQ(m.push("N"), "");
  EXPECT_EQ(m.push("D and more"), "");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.push("later"), "");
  EXPECT_EQ(m.finish(), "");
}

TEST(StopMatcher, ReleasesAFalseStart) {
  StopMatcher m({"END"});
  EXPECT_EQ(m.push("xEN"), "x");
  EXPECT_EQ(m.push("x"), "ENx");
  EXPECT_FALSE(m.stopped());
  EXPECT_EQ(m.push("EN"), "");
  EXPECT_EQ(m.finish(), "EN");  // the end of generation releases what was held
}

TEST(StopMatcher, EarliestOfSeveralStops) {
  StopMatcher m({"world", "lo w", "zzz"});
  EXPECT_EQ(m.push("hello world"), "hel");
  EXPECT_TRUE(m.stopped());
}

TEST(StopMatcher, OverlappingPrefixes) {
  // "aab" inside "aaab": the held suffix must be the LONGEST prefix match, not the first found.
  StopMatcher m({"aab"});
  EXPECT_EQ(m.push("a"), "");
  EXPECT_EQ(m.push("a"), "");
  EXPECT_EQ(m.push("a"), "a");
  EXPECT_EQ(m.push("b"), "");
  EXPECT_TRUE(m.stopped());
}

// Against the definition on random strings over a small alphabet and random splits into pieces
// (tokens): after the first piece whose end completes a stop string, the text is cut at the earliest
// start among the stop occurrences completed so far; without one, everything comes out. Emitted text
// is always a prefix of that result (never past a cut).
TEST(StopMatcher, RandomisedAgainstDefinition) {
  std::mt19937 rng(5);
  for (int iter = 0; iter < 5000; ++iter) {
    auto rand_str = [&](size_t lo, size_t hi) {
      std::string s(lo + rng() % (hi - lo + 1), 'a');
      for (char& c : s) c = "abc"[rng() % 3];
      return s;
    };
    std::vector<std::string> stops;
    const int n = 1 + static_cast<int>(rng() % 3);
    for (int i = 0; i < n; ++i) stops.push_back(rand_str(1, 4));
    const std::string text = rand_str(0, 30);
    std::vector<size_t> ends;
    for (size_t i = 1; i < text.size(); ++i)
      if (rng() % 3 == 0) ends.push_back(i);
    ends.push_back(text.size());

    std::string want = text;
    bool want_stop = false;
    for (size_t e : ends) {
      size_t first = std::string::npos;
      for (const auto& s : stops) first = std::min(first, text.substr(0, e).find(s));
      if (first != std::string::npos) {
        want = text.substr(0, first);
        want_stop = true;
        break;
      }
    }

    StopMatcher m(stops);
    std::string out;
    size_t prev = 0;
    for (size_t e : ends) {
      out += m.push(std::string_view(text).substr(prev, e - prev));
      prev = e;
      ASSERT_EQ(want.compare(0, out.size(), out), 0) << "emitted past a stop: text=" << text << " out=" << out;
    }
    out += m.finish();
    ASSERT_EQ(out, want) << "text=" << text << " stops[0]=" << stops[0];
    ASSERT_EQ(m.stopped(), want_stop);
  }
}

TEST(StopMatcher, MultibyteStopsStayOnCharacterBoundaries) {
  StopMatcher m({"\xc3\xa9t\xc3\xa9"});  // "été"
  const std::string text = "un \xc3\xa9l\xc3\xa9phant, un \xc3\xa9t\xc3\xa9 chaud";
  std::vector<size_t> cuts;
  for (size_t i = 1; i < text.size(); ++i) cuts.push_back(i);
  StopMatcher m2({"\xc3\xa9t\xc3\xa9"});
  EXPECT_EQ(run_matcher(m2, text, {}), "un \xc3\xa9l\xc3\xa9phant, un ");
  EXPECT_EQ(run_matcher(m, text, cuts), "un \xc3\xa9l\xc3\xa9phant, un ");
}

// ---- SlotPool ------------------------------------------------------------------------------------

TEST(SlotPool, ReusableIsAStrictPrefix) {
  const std::vector<int32_t> p = {1, 2, 3, 4};
  EXPECT_EQ(SlotPool::reusable({1, 2}, p), 2u);
  EXPECT_EQ(SlotPool::reusable({1, 2, 3, 4}, p), 0u);  // equal: nothing left to prefill, the engine restarts
  EXPECT_EQ(SlotPool::reusable({1, 9}, p), 0u);
  EXPECT_EQ(SlotPool::reusable({}, p), 0u);
  EXPECT_EQ(SlotPool::reusable({1, 2, 3, 4, 5}, p), 0u);
}

TEST(SlotPool, PrefersLongestPrefixThenLeastRecentlyUsed) {
  SlotPool pool(3);
  const std::vector<int32_t> a = {1, 2, 3}, b = {7, 8, 9}, c = {4, 4};
  // Fill the slots: LRU order hands out 0, 1, 2.
  EXPECT_EQ(pool.acquire(a), 0);
  EXPECT_EQ(pool.acquire(b), 1);
  EXPECT_EQ(pool.acquire(c), 2);
  pool.release(0, {1, 2, 3});
  pool.release(1, {7, 8, 9});
  pool.release(2, {4, 4});
  // A follow-up of b goes back to slot 1, of a to slot 0.
  EXPECT_EQ(pool.acquire(std::vector<int32_t>{7, 8, 9, 10}), 1);
  EXPECT_EQ(pool.acquire(std::vector<int32_t>{1, 2, 3, 5}), 0);
  // Something new takes the only free slot.
  EXPECT_EQ(pool.acquire(std::vector<int32_t>{99}), 2);
  EXPECT_EQ(pool.busy(), 3);
  pool.release(0, {});
  pool.release(1, {});
  pool.release(2, {});
  // All empty: least recently used first (slot 1 was used before 0, then 2).
  EXPECT_EQ(pool.acquire(std::vector<int32_t>{5}), 1);
}

TEST(SlotPool, FirstComeFirstServed) {
  SlotPool pool(1);
  ASSERT_EQ(pool.acquire(std::vector<int32_t>{1}), 0);
  std::vector<int> order;
  std::mutex mu;
  std::vector<std::thread> waiters;
  for (int i = 0; i < 8; ++i) {
    waiters.emplace_back([&, i] {
      const std::vector<int32_t> p = {static_cast<int32_t>(i)};
      auto s = pool.acquire(p);
      ASSERT_TRUE(s.has_value());
      {
        std::lock_guard<std::mutex> lock(mu);
        order.push_back(i);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      pool.release(*s, {});
    });
    // Wait until this waiter has queued, so the arrival order is known.
    while (pool.waiting() < i + 1) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  pool.release(0, {});
  for (auto& t : waiters) t.join();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(pool.busy(), 0);
  EXPECT_EQ(pool.waiting(), 0);
}

TEST(SlotPool, ShutdownWakesWaiters) {
  SlotPool pool(1);
  ASSERT_TRUE(pool.acquire(std::vector<int32_t>{1}).has_value());
  std::atomic<int> woke{0};
  std::thread t([&] {
    if (!pool.acquire(std::vector<int32_t>{2}).has_value()) ++woke;
  });
  while (pool.waiting() < 1) std::this_thread::sleep_for(std::chrono::microseconds(200));
  pool.shutdown();
  t.join();
  EXPECT_EQ(woke.load(), 1);
  EXPECT_FALSE(pool.acquire(std::vector<int32_t>{3}).has_value());
}

TEST(SlotPool, ManyThreadsNeverShareASlot) {
  SlotPool pool(3);
  std::vector<std::atomic<int>> users(3);
  std::atomic<bool> clash{false};
  std::vector<std::thread> ts;
  for (int i = 0; i < 12; ++i) {
    ts.emplace_back([&, i] {
      std::mt19937 rng(i);
      for (int k = 0; k < 200; ++k) {
        const std::vector<int32_t> p = {static_cast<int32_t>(rng() % 4), 1, 2};
        auto s = pool.acquire(p);
        ASSERT_TRUE(s.has_value());
        if (users[*s].fetch_add(1) != 0) clash = true;
        std::this_thread::yield();
        users[*s].fetch_sub(1);
        pool.release(*s, {p[0]});
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_FALSE(clash.load());
}

// ---- request validation --------------------------------------------------------------------------

ApiError error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const ApiError& e) {
    return e;
  }
  ADD_FAILURE() << "no ApiError thrown";
  return ApiError(0, "");
}

TEST(Api, ParsesAChatRequest) {
  const json b = json::parse(R"({
    "model": "m", "stream": true, "stream_options": {"include_usage": true},
    "messages": [{"role": "developer", "content": "be brief"},
                 {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                 {"role": "assistant", "content": null, "reasoning_content": "hmm"},
                 {"role": "user", "content": "c"}],
    "max_tokens": 5, "max_completion_tokens": 7, "stop": ["x", "yz"], "temperature": 0, "top_p": 0.9,
    "seed": 3, "n": 1, "chat_template_kwargs": {"enable_thinking": false}, "unknown_extra": [1, 2]})");
  const CompletionRequest r = parse_chat_request(b);
  EXPECT_EQ(r.model, "m");
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_EQ(r.max_tokens, 7);
  EXPECT_EQ(r.stop, (std::vector<std::string>{"x", "yz"}));
  ASSERT_EQ(r.messages.size(), 4u);
  EXPECT_EQ(r.messages[0].role, "system");
  EXPECT_EQ(r.messages[1].content, "a\nb");
  EXPECT_EQ(r.messages[2].content, "");
  EXPECT_EQ(r.messages[2].reasoning_content, "hmm");
  EXPECT_FALSE(r.chat.enable_thinking);
}

TEST(Api, RejectsWhatCannotBeServed) {
  struct Case {
    const char* body;
    const char* param;
  };
  const Case cases[] = {
      {R"({})", "messages"},
      {R"({"messages": "hi"})", "messages"},
      {R"({"messages": []})", "messages"},
      {R"({"messages": [1]})", "messages[0]"},
      {R"({"messages": [{"content": "x"}]})", "messages[0].role"},
      {R"({"messages": [{"role": "wizard", "content": "x"}]})", "messages[0].role"},
      {R"({"messages": [{"role": "user"}]})", "messages[0].content"},
      {R"({"messages": [{"role": "user", "content": 5}]})", "messages[0].content"},
      {R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})", "messages[0].content"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"})", "max_tokens"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0})", "max_tokens"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5})", "max_tokens"},
      {R"({"messages": [{"role": "user", "content": "x"}], "stream": "yes"})", "stream"},
      {R"({"messages": [{"role": "user", "content": "x"}], "temperature": 2.5})", "temperature"},
      {R"({"messages": [{"role": "user", "content": "x"}], "temperature": -0.1})", "temperature"},
      {R"({"messages": [{"role": "user", "content": "x"}], "temperature": "0"})", "temperature"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_p": 0})", "top_p"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_p": 1.5})", "top_p"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_k": -2})", "top_k"},
      {R"({"messages": [{"role": "user", "content": "x"}], "min_p": 1})", "min_p"},
      {R"({"messages": [{"role": "user", "content": "x"}], "n": 2})", "n"},
      {R"({"messages": [{"role": "user", "content": "x"}], "stop": 5})", "stop"},
      {R"({"messages": [{"role": "user", "content": "x"}], "stop": [""]})", "stop"},
      {R"({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5})", "presence_penalty"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true})", "logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]})", "tools"},
      {R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}})",
       "response_format"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 1}})", "logit_bias"},
  };
  for (const Case& c : cases) {
    const ApiError e = error_of([&] { parse_chat_request(json::parse(c.body)); });
    EXPECT_EQ(e.status, 400) << c.body;
    EXPECT_EQ(e.param, c.param) << c.body << ": " << e.message;
    EXPECT_EQ(e.type, "invalid_request_error");
  }
  const ApiError t = error_of([&] { parse_chat_request(json::parse(cases[13].body)); });
  EXPECT_NE(t.message.find("temperature must be in [0, 2], got 2.5"), std::string::npos) << t.message;
}

TEST(Api, SamplingParameters) {
  // No temperature: greedy. With one: the knobs as given (top_k -1 means off, as in vLLM), the seed kept.
  const CompletionRequest g = parse_chat_request(json::parse(R"({"messages": [{"role": "user", "content": "x"}]})"));
  EXPECT_TRUE(g.sampling.greedy());
  const CompletionRequest s = parse_chat_request(json::parse(
      R"({"messages": [{"role": "user", "content": "x"}], "temperature": 0.7, "top_p": 0.9, "top_k": -1,
          "min_p": 0.05, "seed": 42})"));
  EXPECT_FALSE(s.sampling.greedy());
  EXPECT_DOUBLE_EQ(s.sampling.temperature, 0.7);
  EXPECT_DOUBLE_EQ(s.sampling.top_p, 0.9);
  EXPECT_EQ(s.sampling.top_k, 0);
  EXPECT_DOUBLE_EQ(s.sampling.min_p, 0.05);
  EXPECT_EQ(s.sampling.seed, 42u);
  const CompletionRequest k = parse_completion_request(json::parse(R"({"prompt": "x", "temperature": 1, "top_k": 40})"));
  EXPECT_EQ(k.sampling.top_k, 40);
}

TEST(Api, CompletionPrompts) {
  EXPECT_EQ(parse_completion_request(json::parse(R"({"prompt": "hi"})")).prompt_text, "hi");
  EXPECT_EQ(parse_completion_request(json::parse(R"({"prompt": ["hi"]})")).prompt_text, "hi");
  const CompletionRequest ids = parse_completion_request(json::parse(R"({"prompt": [1, 2, 3]})"));
  EXPECT_TRUE(ids.prompt_is_ids);
  EXPECT_EQ(ids.prompt_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(parse_completion_request(json::parse(R"({"prompt": [[4, 5]]})")).prompt_ids, (std::vector<int32_t>{4, 5}));
  for (const char* bad : {R"({})", R"({"prompt": 5})", R"({"prompt": []})", R"({"prompt": ["a", "b"]})",
                          R"({"prompt": [1, "a"]})", R"({"prompt": [-1]})", R"({"prompt": "x", "echo": true})",
                          R"({"prompt": "x", "best_of": 3})", R"({"prompt": "x", "logprobs": 2})"}) {
    const ApiError e = error_of([&] { parse_completion_request(json::parse(bad)); });
    EXPECT_EQ(e.status, 400) << bad;
  }
}

TEST(Api, BodyMustBeAJsonObject) {
  for (const char* bad : {"", "{", "[1]", "\"x\"", "{\"a\": }", "nul"}) {
    const ApiError e = error_of([&] { parse_body(bad); });
    EXPECT_EQ(e.status, 400) << bad;
    EXPECT_EQ(e.code, "invalid_json") << bad;
  }
  EXPECT_TRUE(parse_body(R"({"a": 1})").is_object());
}

TEST(Api, ErrorJsonShape) {
  const json j = error_json(ApiError(400, "bad", "invalid_request_error", "stop", "invalid_value"));
  EXPECT_EQ(j["error"]["message"], "bad");
  EXPECT_EQ(j["error"]["type"], "invalid_request_error");
  EXPECT_EQ(j["error"]["param"], "stop");
  EXPECT_EQ(j["error"]["code"], "invalid_value");
  const json n = error_json(ApiError(500, "x", "server_error"));
  EXPECT_TRUE(n["error"]["param"].is_null());
  EXPECT_TRUE(n["error"]["code"].is_null());
}

TEST(Api, TokenizeRequests) {
  const TokenizeRequest t = parse_tokenize_request(json::parse(R"({"content": "ab", "with_pieces": true})"));
  EXPECT_EQ(t.content, "ab");
  EXPECT_TRUE(t.with_pieces);
  EXPECT_FALSE(t.add_special);
  EXPECT_EQ(parse_detokenize_request(json::parse(R"({"tokens": [1, 2]})")), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(error_of([] { parse_tokenize_request(json::parse(R"({"content": 1})")); }).status, 400);
  EXPECT_EQ(error_of([] { parse_detokenize_request(json::parse(R"({"tokens": "1"})")); }).status, 400);
  EXPECT_EQ(error_of([] { parse_detokenize_request(json::parse(R"({"tokens": [1, -2]})")); }).status, 400);
}

// ---- metrics -------------------------------------------------------------------------------------

TEST(Metrics, RendersPrometheusText) {
  Metrics m;
  m.count_request("/v1/chat/completions", 200);
  m.count_request("/v1/chat/completions", 200);
  m.count_request("/v1/chat/completions", 400);
  GenerateStats st;
  st.prompt_tokens = 10;
  st.reused_tokens = 4;
  st.generated = 9;
  st.decode_seconds = 0.5;
  st.cycles = 4;
  st.drafted = 21;
  st.accepted = 4;
  st.drafted_at = {4, 4, 4, 3, 3, 2, 1};
  st.accepted_at = {3, 1, 0, 0, 0, 0, 0};
  m.add_generation(st, "length");
  const std::string t = m.render({2, 1, 3, true});
  for (const char* want :
       {"dflash_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 2\n",
        "dflash_requests_total{endpoint=\"/v1/chat/completions\",status=\"400\"} 1\n",
        "dflash_generations_total{outcome=\"length\"} 1\n", "dflash_prompt_tokens_total 10\n",
        "dflash_prompt_tokens_reused_total 4\n", "dflash_generated_tokens_total 9\n",
        "dflash_decode_tokens_per_second 16\n", "dflash_spec_cycles_total 4\n", "dflash_draft_tokens_total 21\n",
        "dflash_draft_accepted_tokens_total 4\n", "dflash_acceptance_length 2\n",
        "dflash_draft_accepted_at_position_total{position=\"1\"} 3\n",
        "dflash_draft_acceptance_rate{position=\"1\"} 0.75\n", "dflash_slots 2\n", "dflash_slots_busy 1\n",
        "dflash_requests_waiting 3\n", "dflash_model_loaded 1\n", "# TYPE dflash_requests_total counter\n",
        "# TYPE dflash_acceptance_length gauge\n"})
    EXPECT_NE(t.find(want), std::string::npos) << want << "\n" << t;
  EXPECT_EQ(m.requests("/v1/chat/completions", 200), 2);
}

// ---- the CLI's model prefetch (src/cli/load_progress.cpp) ---------------------------------------

TEST(Prefetch, ReadsTheTensorDataAndReportsWithoutATerminal) {
  const std::string path = testing::TempDir() + "dflash_prefetch_test.gguf";
  gguf::Writer w;
  w.set("general.architecture", gguf::Value::string("test"));
  std::vector<float> x(1 << 16, 0.5f);
  w.add_tensor("a.weight", GgmlType::F32, {256, 256},
               {reinterpret_cast<const uint8_t*>(x.data()), x.size() * sizeof(float)});
  w.write(path);
  const gguf::File f = gguf::File::open(path);
  testing::internal::CaptureStderr();
  cli::prefetch_file(f, /*min_bytes=*/1 << 30);  // below the threshold: silent
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
  testing::internal::CaptureStderr();
  cli::prefetch_file(f, /*min_bytes=*/0);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("loading dflash_prefetch_test.gguf"), std::string::npos) << err;
  EXPECT_NE(err.find("loaded dflash_prefetch_test.gguf in"), std::string::npos) << err;
  std::remove(path.c_str());
}

}  // namespace
}  // namespace dflash::server
