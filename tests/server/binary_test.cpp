// The built `dflash` binary: `serve` as a process (port 0, /health, answers equal to what `dflash
// run` prints for the same chat, SIGTERM -> exit 0, exit codes 1 and 2), and `run --chat` (multi-turn
// replies equal the greedy reference for the growing conversation, cache reuse across turns, /exit,
// failing turns, usage errors), plus `--help` of every command.
#include <gtest/gtest.h>
#include <signal.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <chrono>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "server/server_fixture.h"

extern char** environ;

namespace dflash::server_test {
namespace {

using Clock = std::chrono::steady_clock;

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct Result {
  int code = -1;
  std::string out, err;
};

// Runs `dflash <args>` through the shell with `input` on stdin.
Result run_dflash(const std::string& args, const std::string& input = {}) {
  static int n = 0;
  const std::string base = temp_path("run" + std::to_string(n++));
  std::ofstream(base + ".in", std::ios::binary) << input;
  const std::string cmd = quote(DFLASH_BINARY) + " " + args + " <" + quote(base + ".in") + " >" +
                          quote(base + ".out") + " 2>" + quote(base + ".err");
  const int status = std::system(cmd.c_str());
  Result r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = slurp(base + ".out");
  r.err = slurp(base + ".err");
  return r;
}

// `dflash serve` as a child process, stderr to a file.
class ServeProcess {
 public:
  explicit ServeProcess(const std::vector<std::string>& args) {
    err_path_ = temp_path("serve" + std::to_string(::getpid()) + "_" + std::to_string(counter_++) + ".err");
    std::vector<std::string> argv_s = {DFLASH_BINARY, "serve"};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& s : argv_s) argv.push_back(s.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 2, err_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    const int rc = posix_spawn(&pid_, DFLASH_BINARY, &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    EXPECT_EQ(rc, 0);
  }
  ~ServeProcess() {
    if (pid_ > 0 && !exited_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  // The port from the "listening on" line (0 when it does not come within the deadline).
  int wait_port(double seconds = 20) {
    const std::regex re("listening on http://127\\.0\\.0\\.1:([0-9]+)");
    const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
    while (Clock::now() < deadline) {
      std::smatch m;
      const std::string e = slurp(err_path_);
      if (std::regex_search(e, m, re)) return std::stoi(m[1]);
      if (exited()) return 0;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return 0;
  }
  bool exited() {
    if (exited_) return true;
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      exited_ = true;
      code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    return exited_;
  }
  // Waits for the exit (SIGKILL after the deadline); returns the exit code.
  int wait_exit(double seconds = 20) {
    const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
    while (!exited() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (!exited()) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      exited_ = true;
      code_ = -1;
    }
    return code_;
  }
  void signal(int sig) { ::kill(pid_, sig); }
  std::string err() const { return slurp(err_path_); }

 private:
  static inline int counter_ = 0;
  pid_t pid_ = -1;
  bool exited_ = false;
  int code_ = -1;
  std::string err_path_;
};

TEST(Binary, ServeAnswersLikeRun) {
  const Files& f = Files::get();
  ServeProcess p({"-m", f.target, "-d", f.drafter, "--port", "0", "--parallel", "2", "-t", "1"});
  const int port = p.wait_port();
  ASSERT_GT(port, 0) << p.err();
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(30, 0);
  // /health: 503 while loading (maybe too quick to see), then 200.
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  int health = 0;
  while (Clock::now() < deadline) {
    auto h = c.Get("/health");
    if (h) {
      health = h->status;
      ASSERT_TRUE(health == 200 || health == 503) << h->body;
      if (health == 503) {
        EXPECT_EQ(json::parse(h->body)["status"], "loading");
      }
      if (health == 200) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(health, 200) << p.err();

  for (const std::string prompt : {"hello", "Explain speculative decoding."}) {
    const Result r = run_dflash("run -m " + quote(f.target) + " -d " + quote(f.drafter) + " -t 1 -n 24 -p " +
                                quote(prompt));
    ASSERT_EQ(r.code, 0) << r.err;
    ASSERT_FALSE(r.out.empty());
    const std::string want = r.out.substr(0, r.out.size() - 1);  // run ends the text with a newline
    auto a = c.Post("/v1/chat/completions", chat_body(prompt, 24).dump(), "application/json");
    ASSERT_TRUE(a);
    ASSERT_EQ(a->status, 200) << a->body;
    EXPECT_EQ(json::parse(a->body)["choices"][0]["message"]["content"], want) << prompt;
    auto s = c.Post("/v1/chat/completions", chat_body(prompt, 24, true).dump(), "application/json");
    ASSERT_TRUE(s);
    EXPECT_EQ(parse_sse(s->body).text, want) << prompt;
  }
  p.signal(SIGTERM);
  EXPECT_EQ(p.wait_exit(), 0) << p.err();
  EXPECT_NE(p.err().find("stopped (SIGTERM)"), std::string::npos) << p.err();
  EXPECT_NE(p.err().find("POST /v1/chat/completions 200"), std::string::npos) << p.err();
}

TEST(Binary, ServeExitCodes) {
  // A missing model: exit 1 with the reason.
  ServeProcess missing({"-m", temp_path("nope.gguf"), "--port", "0"});
  EXPECT_EQ(missing.wait_exit(), 1);
  EXPECT_NE(missing.err().find("nope.gguf"), std::string::npos) << missing.err();
  // A file that is not a model: it listens, fails to load, exits 1.
  const std::string junk = temp_path("junk.gguf");
  std::ofstream(junk) << "this is not a gguf file";
  ServeProcess bad({"-m", junk, "--port", "0"});
  EXPECT_EQ(bad.wait_exit(), 1);
  EXPECT_NE(bad.err().find("loading failed"), std::string::npos) << bad.err();
  // Usage errors: exit 2.
  EXPECT_EQ(run_dflash("serve --port 70000").code, 2);
  EXPECT_EQ(run_dflash("serve --parallel 0").code, 2);
  EXPECT_EQ(run_dflash("serve --bogus").code, 2);
  // SIGINT stops a loaded server cleanly.
  ServeProcess ok({"-m", Files::get().target, "--port", "0", "-q"});
  ASSERT_GT(ok.wait_port(), 0) << ok.err();
  ok.signal(SIGINT);
  EXPECT_EQ(ok.wait_exit(), 0) << ok.err();
}

TEST(Binary, HelpForEveryCommand) {
  const Result top = run_dflash("--help");
  EXPECT_EQ(top.code, 0);
  EXPECT_NE(top.out.find("Exit status"), std::string::npos) << top.out;
  const std::regex sub("\n  ([a-z][a-z-]+) {2,}");
  std::vector<std::string> commands;
  for (std::sregex_iterator it(top.out.begin(), top.out.end(), sub), end; it != end; ++it) commands.push_back((*it)[1]);
  EXPECT_GE(commands.size(), 8u) << top.out;
  for (const char* want : {"run", "serve", "info"})
    EXPECT_NE(std::find(commands.begin(), commands.end(), want), commands.end()) << top.out;
  for (const std::string& cmd : commands) {
    const Result r = run_dflash(cmd + " --help");
    EXPECT_EQ(r.code, 0) << cmd;
    EXPECT_NE(r.out.find("Usage: dflash " + cmd), std::string::npos) << cmd << ":\n" << r.out;
  }
  EXPECT_EQ(run_dflash("").code, 2);
  EXPECT_EQ(run_dflash("no-such-command").code, 2);
}

// The greedy replies of a conversation, turn by turn, with a plain Engine (what --chat must print).
std::vector<Reference> chat_reference(const std::vector<std::string>& user_turns, int64_t n,
                                      const std::string& system = {}) {
  std::vector<text::ChatMessage> msgs;
  if (!system.empty()) msgs.push_back({"system", system, std::nullopt});
  std::vector<Reference> out;
  for (const std::string& u : user_turns) {
    msgs.push_back({"user", u, std::nullopt});
    out.push_back(reference().generate(reference().chat_prompt(msgs), n));
    msgs.push_back({"assistant", out.back().text, std::nullopt});
  }
  return out;
}

TEST(Binary, RunChatMultiTurn) {
  const Files& f = Files::get();
  const std::vector<std::string> turns = {"hello there", "and a second question", "third"};
  const auto refs = chat_reference(turns, 16, "be brief");
  std::string want;
  for (const Reference& r : refs) want += r.text + "\n";
  for (const std::string& drafter : {std::string(), f.drafter}) {
    const std::string d = drafter.empty() ? "" : " -d " + quote(drafter);
    const Result r = run_dflash("run -m " + quote(f.target) + d + " -t 1 -n 16 --chat --system 'be brief'",
                                turns[0] + "\n" + turns[1] + "\n\n" + turns[2] + "\n/exit\nnot a turn\n");
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(r.out, want);
  }
  // -p gives the first turn; EOF ends.
  const Result p = run_dflash("run -m " + quote(f.target) + " -t 1 -n 16 --chat --system 'be brief' -p " +
                              quote(turns[0]), turns[1] + "\n" + turns[2]);
  ASSERT_EQ(p.code, 0) << p.err;
  EXPECT_EQ(p.out, want);
  // /reset starts a new conversation: the second reply is the first turn's reply to a fresh chat.
  const auto fresh = chat_reference({turns[1]}, 16);
  const Result reset = run_dflash("run -m " + quote(f.target) + " -t 1 -n 16 --chat",
                                  turns[0] + "\n/reset\n" + turns[1] + "\n");
  ASSERT_EQ(reset.code, 0) << reset.err;
  EXPECT_EQ(reset.out, chat_reference({turns[0]}, 16)[0].text + "\n" + fresh[0].text + "\n");
}

// Cache reuse across --chat turns: with a first reply that re-tokenizes to the same tokens (printable
// single-byte tokens), the second turn prefills only what is new.
TEST(Binary, RunChatReusesTheCache) {
  const auto& tok = reference().tokenizer();
  std::string first;
  for (int i = 0; i < 200 && first.empty(); ++i) {
    const std::string u = fmt::format("q{}", i);  // (not "q" + to_string: a GCC 12 -Wrestrict false positive)
    const Reference r = reference().chat(u, 3);
    bool ok = r.tokens.size() == 3;
    for (int32_t t : r.tokens) {
      const std::string piece = tok.decode(std::vector<int32_t>{t});
      ok = ok && piece.size() == 1 && piece[0] >= 0x21 && piece[0] < 0x7f && tok.encode(piece) == std::vector<int32_t>{t};
    }
    if (ok) first = u;
  }
  ASSERT_FALSE(first.empty()) << "no prompt with a printable 3-token reply";
  const Result r = run_dflash("run -m " + quote(Files::get().target) + " -t 1 -n 3 --chat --stats", first + "\nnext\n");
  ASSERT_EQ(r.code, 0) << r.err;
  std::smatch m;
  std::vector<int> reused;
  const std::regex re("\\(([0-9]+) reused from the cache");
  for (std::sregex_iterator it(r.err.begin(), r.err.end(), re), end; it != end; ++it) reused.push_back(std::stoi((*it)[1]));
  ASSERT_EQ(reused.size(), 2u) << r.err;
  EXPECT_EQ(reused[0], 0);
  // Turn 1's prompt + its reply minus the last token.
  const auto refs = chat_reference({first, "next"}, 3);
  EXPECT_EQ(reused[1], static_cast<int>(refs[0].prompt.size() + refs[0].tokens.size() - 1)) << r.err;
  EXPECT_EQ(r.out, refs[0].text + "\n" + refs[1].text + "\n");
}

TEST(Binary, RunChatErrors) {
  const Files& f = Files::get();
  // A turn that does not fit the context is reported, dropped, and the chat goes on; exit 1 at the end.
  const Result r = run_dflash("run -m " + quote(f.target) + " -t 1 -n 4 -c 48 --chat",
                              std::string(80, 'x') + "\nhi\n");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("context"), std::string::npos) << r.err;
  EXPECT_EQ(r.out, chat_reference({"hi"}, 4)[0].text + "\n");
  EXPECT_EQ(run_dflash("run -m " + quote(f.target) + " --chat --json").code, 2);
  EXPECT_EQ(run_dflash("run -m " + quote(f.target) + " --chat --tokens 1,2").code, 2);
}

TEST(Binary, RunStats) {
  const Files& f = Files::get();
  const Result r = run_dflash("run -m " + quote(f.target) + " -d " + quote(f.drafter) + " -t 1 -n 20 --stats -p hi");
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* want : {"[stats] prompt", "[stats] generated 20 tokens", "acceptance length",
                           "acceptance by draft position 1..7", "cycles by drafts accepted", "[stats] time: draft"})
    EXPECT_NE(r.err.find(want), std::string::npos) << want << "\n" << r.err;
}

}  // namespace
}  // namespace dflash::server_test
