// Many clients at once against slots: 16 concurrent streaming clients with random disconnects and bad
// requests interleaved; every answer must equal the single-client greedy answer for its prompt
// (nothing lost, nothing mixed between slots), /metrics must count what was sent, and a client that
// disconnects mid-stream must free its slot at once.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <map>
#include <random>
#include <thread>

#include "server/server_fixture.h"

namespace dflash::server_test {
namespace {

using Clock = std::chrono::steady_clock;

// Streams a request and hangs up after `events` server-sent events; returns the events seen.
int stream_and_hang_up(const TestServer& ts, const json& body, int events) {
  auto c = ts.client();
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/chat/completions";
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  std::string got;
  int seen = 0;
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    got.append(data, n);
    size_t pos = 0;
    seen = 0;
    while ((pos = got.find("\n\n", pos)) != std::string::npos) {
      ++seen;
      pos += 2;
    }
    return seen < events;  // false: cancel, the client closes the connection
  };
  auto res = c->send(req);
  EXPECT_FALSE(res) << "the stream ended before the client hung up";
  if (!res) {
    EXPECT_EQ(res.error(), httplib::Error::Canceled);
  }
  return seen;
}

// Polls /metrics until `ok(body)` or the deadline.
std::string wait_metrics(const TestServer& ts, const std::function<bool(const std::string&)>& ok, double seconds = 10) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  std::string body;
  do {
    auto r = ts.client()->Get("/metrics");
    if (r && r->status == 200) {
      body = r->body;
      if (ok(body)) return body;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  } while (Clock::now() < deadline);
  return body;
}

// Prompts whose greedy answer runs at least 200 tokens without an end-of-turn token, so a hang-up
// after a few events always happens mid-generation.
std::vector<std::string> long_prompts() {
  static const std::vector<std::string> found = [] {
    std::vector<std::string> out;
    for (int i = 0; i < 40 && out.size() < 3; ++i) {
      const std::string p = "long answer number " + std::to_string(i);
      if (reference().chat(p, 200).finish == "length") out.push_back(p);
    }
    return out;
  }();
  return found;
}

TEST(Concurrency, DisconnectFreesTheSlotAtOnce) {
  const auto prompts = long_prompts();
  ASSERT_FALSE(prompts.empty());
  TestServer ts([] {
    server::ServerOptions o;
    o.n_parallel = 1;
    return o;
  }());
  const int seen = stream_and_hang_up(ts, chat_body(prompts[0], 4000, true), 3);
  EXPECT_EQ(seen, 3);
  // The only slot is free again: the next request is served, with the right answer.
  const auto t0 = Clock::now();
  const Reference ref = reference().chat("after the hang-up", 8);
  auto r = ts.client()->Post("/v1/chat/completions", chat_body("after the hang-up", 8).dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  EXPECT_EQ(json::parse(r->body)["choices"][0]["message"]["content"], ref.text);
  const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
  // The abandoned generation stopped within a few tokens of the hang-up (not after its 4000).
  const std::string m = wait_metrics(ts, [](const std::string& b) {
    return metric(b, "dflash_generations_total{outcome=\"cancelled\"}") == 1;
  });
  EXPECT_EQ(metric(m, "dflash_generations_total{outcome=\"cancelled\"}"), 1) << m;
  const double generated = metric(m, "dflash_generated_tokens_total") - static_cast<double>(ref.tokens.size());
  EXPECT_LT(generated, 500) << "tokens generated for the client that left";
  EXPECT_EQ(metric(m, "dflash_slots_busy"), 0);
  std::cout << "[ info ] hang-up after 3 events: " << generated << " tokens generated; next request served in "
            << waited << " s\n";
}

// 16 clients x 3 requests each, on 3 slots: streams (checked against the reference), plain requests,
// hang-ups mid-stream and bad requests, all interleaved. Then /metrics must add up.
TEST(Concurrency, SixteenStreamingClients) {
  const auto t_start = Clock::now();
  const auto hangup_prompts = long_prompts();
  ASSERT_FALSE(hangup_prompts.empty());
  const std::vector<std::string> prompts = {"alpha", "How are you?", "Summarise the news.", "42", "zebra crossing",
                                            "Write a haiku"};
  const std::vector<int> lengths = {12, 24, 40};
  // The single-client answers.
  std::map<std::pair<std::string, int>, Reference> refs;
  for (const auto& p : prompts)
    for (int n : lengths) refs[{p, n}] = reference().chat(p, n);

  TestServer ts([] {
    server::ServerOptions o;
    o.n_parallel = 3;
    return o;
  }());

  const std::vector<std::string> bad_bodies = {
      "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"temperature\": 9, \"stream\": true}",
      "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"stream\": \"yes\"}",
      "{this is not json",
      "{\"messages\": 7}",
      "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"max_tokens\": -3}",
  };

  constexpr int kClients = 16, kRounds = 3;
  std::atomic<int> ok_stream{0}, ok_plain{0}, hangups{0}, bad{0}, failures{0};
  std::atomic<int64_t> ok_prompt_tokens{0}, ok_completion_tokens{0};
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int ci = 0; ci < kClients; ++ci) {
    threads.emplace_back([&, ci] {
      std::mt19937 rng(1000 + ci);
      ++ready;
      while (ready.load() < kClients) std::this_thread::yield();  // start together
      auto c = ts.client(60);
      for (int round = 0; round < kRounds; ++round) {
        const int kind = static_cast<int>(rng() % 10);
        const std::string& p = prompts[rng() % prompts.size()];
        const int n = lengths[rng() % lengths.size()];
        const Reference& ref = refs.at({p, n});
        if (kind <= 4) {  // a stream, compared with the single-client answer
          json body = chat_body(p, n, true);
          body["stream_options"] = {{"include_usage", true}};
          const auto t0 = Clock::now();
          auto r = c->Post("/v1/chat/completions", body.dump(), "application/json");
          if (!r || r->status != 200) {
            ++failures;
            ADD_FAILURE() << "client " << ci << ": stream failed after "
                          << std::chrono::duration<double>(Clock::now() - t0).count() << " s: "
                          << (r ? std::to_string(r->status) + " " + r->body : httplib::to_string(r.error()));
            continue;
          }
          const SseStream s = parse_sse(r->body);
          EXPECT_TRUE(s.done && s.well_formed) << r->body;
          EXPECT_EQ(s.text, ref.text) << "client " << ci << " prompt '" << p << "' n=" << n;
          EXPECT_EQ(s.finish, ref.finish);
          EXPECT_EQ(s.usage["completion_tokens"], ref.tokens.size());
          if (s.text != ref.text) ++failures;
          ++ok_stream;
          ok_prompt_tokens += static_cast<int64_t>(ref.prompt.size());
          ok_completion_tokens += static_cast<int64_t>(ref.tokens.size());
        } else if (kind == 5) {  // not streamed
          auto r = c->Post("/v1/chat/completions", chat_body(p, n).dump(), "application/json");
          if (!r || r->status != 200) {
            ++failures;
            ADD_FAILURE() << "client " << ci << ": request failed: "
                          << (r ? std::to_string(r->status) + " " + r->body : httplib::to_string(r.error()));
            continue;
          }
          EXPECT_EQ(json::parse(r->body)["choices"][0]["message"]["content"], ref.text);
          ++ok_plain;
          ok_prompt_tokens += static_cast<int64_t>(ref.prompt.size());
          ok_completion_tokens += static_cast<int64_t>(ref.tokens.size());
        } else if (kind <= 7) {  // hang up after 1..4 events of a long answer
          const std::string& hp = hangup_prompts[rng() % hangup_prompts.size()];
          stream_and_hang_up(ts, chat_body(hp, 3000, true), 1 + static_cast<int>(rng() % 4));
          ++hangups;
        } else {  // a bad request
          auto r = c->Post("/v1/chat/completions", bad_bodies[rng() % bad_bodies.size()], "application/json");
          if (!r) {
            ++failures;
            ADD_FAILURE() << "client " << ci << ": no answer to a bad request";
            continue;
          }
          EXPECT_EQ(r->status, 400) << r->body;
          EXPECT_TRUE(json::parse(r->body, nullptr, false).contains("error")) << r->body;
          ++bad;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(ok_stream + ok_plain + hangups + bad, kClients * kRounds);

  // The counters add up (the request log runs just after a response is written, so poll briefly).
  const int served = ok_stream + ok_plain + hangups;
  const std::string m = wait_metrics(ts, [&](const std::string& b) {
    return metric(b, "dflash_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"}") == served &&
           metric(b, "dflash_slots_busy") == 0;
  });
  EXPECT_EQ(metric(m, "dflash_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"}"), served) << m;
  EXPECT_EQ(metric(m, "dflash_requests_total{endpoint=\"/v1/chat/completions\",status=\"400\"}"), bad.load()) << m;
  const double finished = metric(m, "dflash_generations_total{outcome=\"stop\"}") +
                          metric(m, "dflash_generations_total{outcome=\"length\"}");
  const double cancelled = metric(m, "dflash_generations_total{outcome=\"cancelled\"}");
  EXPECT_EQ(finished, ok_stream + ok_plain) << m;
  EXPECT_LE(cancelled, hangups.load());  // a client that left while queued may never start generating
  EXPECT_EQ(metric(m, "dflash_generations_total{outcome=\"error\"}"), 0);
  EXPECT_GE(metric(m, "dflash_prompt_tokens_total"), static_cast<double>(ok_prompt_tokens.load()));
  EXPECT_GE(metric(m, "dflash_generated_tokens_total"), static_cast<double>(ok_completion_tokens.load()));
  EXPECT_EQ(metric(m, "dflash_slots"), 3);
  EXPECT_EQ(metric(m, "dflash_slots_busy"), 0);
  EXPECT_EQ(metric(m, "dflash_requests_waiting"), 0);
  EXPECT_GT(metric(m, "dflash_spec_cycles_total"), 0);
  EXPECT_GT(metric(m, "dflash_draft_tokens_total"), 0);
  EXPECT_NE(m.find("dflash_draft_acceptance_rate{position=\"1\"}"), std::string::npos);

  const double secs = std::chrono::duration<double>(Clock::now() - t_start).count();
  std::cout << "[ info ] " << ok_stream << " streams, " << ok_plain << " plain, " << hangups << " hang-ups, " << bad
            << " bad requests in " << secs << " s\n";
  EXPECT_LT(secs, 60.0);
}

}  // namespace
}  // namespace dflash::server_test
