// `dflash serve`: the OpenAI-compatible HTTP server (src/server/server.h).
//
//   dflash serve [-m TARGET] [-d DRAFTER] [--host 127.0.0.1] [--port 8080] [--ctx N] [--parallel N]
//                [--api-key K] [--threads T] [--device cpu|cuda[:N]] [--no-spec] [--block B] [--alias NAME]
//                [--max-body BYTES] [--quiet]
//
// The socket listens first; the model loads in the background (GET /health: 503 until ready). With
// no -m the bundled pair is served (its drafter too). SIGINT / SIGTERM stop the server (exit 0); a
// model that fails to load stops it with exit 1.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>

#include "cli/backend_select.h"
#include "cli/commands.h"
#include "cli/load_progress.h"
#include "cli/model_paths.h"
#include "server/server.h"
#include "util/error.h"

namespace dflash::cli {
namespace {

struct ServeArgs {
  std::string model;
  std::string drafter;
  std::string host = "127.0.0.1";
  int port = 8080;
  int64_t n_ctx = 4096;
  int parallel = 1;
  std::string api_key;
  int threads = 0;
  std::string device = "cpu";
  bool no_spec = false;
  int64_t block = 0;
  std::string alias;
  size_t max_body = 8u << 20;
  bool quiet = false;
};

void serve(const ServeArgs& a) {
  server::ServerOptions o;
  o.host = a.host;
  o.port = a.port;
  o.model_path = a.model.empty() ? default_target_path() : a.model;
  o.drafter_path = a.drafter;
  if (o.drafter_path.empty() && a.model.empty()) o.drafter_path = default_drafter_path().value_or("");
  o.speculative = !a.no_spec;
  o.block = a.block;
  o.model_name = a.alias;
  o.n_ctx = a.n_ctx;
  o.n_parallel = a.parallel;
  o.threads = a.threads;
  o.make_backend = [device = a.device, threads = a.threads] { return make_backend(device, threads); };
  o.backend_thread_safe = a.device == "cpu";
  o.api_key = a.api_key;
  o.max_body_bytes = a.max_body;
  // Missing files are usage-level mistakes: say so before listening rather than from /health.
  for (const std::string& path : {o.model_path, o.drafter_path}) {
    std::error_code ec;
    DFLASH_CHECK(path.empty() || std::filesystem::is_regular_file(path, ec), "{}: no such file", path);
  }
  o.on_file_open = [](const gguf::File& f) { prefetch_file(f); };
  auto log_mu = std::make_shared<std::mutex>();
  if (!a.quiet)
    o.log = [log_mu](const std::string& line) {
      std::lock_guard<std::mutex> lock(*log_mu);
      fmt::print(stderr, "dflash serve: {}\n", line);
      std::fflush(stderr);
    };

  // SIGINT / SIGTERM go to one waiting thread (blocked everywhere else: threads inherit the mask);
  // SIGUSR1 wakes it when the server ends for another reason.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGUSR1);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);

  server::Server srv(o);
  const int port = srv.bind();
  fmt::print(stderr, "dflash serve: listening on http://{}:{} (model loading: GET /health says 503 until ready)\n",
             a.host.find(':') != std::string::npos ? "[" + a.host + "]" : a.host, port);
  std::fflush(stderr);
  srv.start_loading();

  std::atomic<int> got_signal{0};
  std::thread sig_thread([&] {
    int sig = 0;
    sigwait(&set, &sig);
    if (sig != SIGUSR1) {
      got_signal = sig;
      srv.stop();
    }
  });
  std::thread monitor([&] {
    if (srv.wait_loaded() == server::Server::State::kFailed) srv.stop();
  });

  srv.listen();
  pthread_kill(sig_thread.native_handle(), SIGUSR1);
  sig_thread.join();
  monitor.join();
  // A signal is a requested stop (exit 0), also when it comes while the model is still loading.
  if (srv.state() == server::Server::State::kFailed && !got_signal) fail("{}", srv.load_error());
  if (got_signal)
    fmt::print(stderr, "dflash serve: stopped ({}){}\n", got_signal == SIGINT ? "SIGINT" : "SIGTERM",
               srv.state() == server::Server::State::kReady ? "" : " before the model finished loading");
}

}  // namespace

void register_serve(CLI::App& app) {
  auto a = std::make_shared<ServeArgs>();
  CLI::App* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (chat/completions, completions, metrics)");
  cmd->add_option("-m,--model", a->model, "target model GGUF (default: the bundled model and its drafter)");
  cmd->add_option("-d,--drafter", a->drafter, "DFlash drafter GGUF: speculative decoding (same output, faster)");
  cmd->add_option("--host", a->host, "address to listen on (default 127.0.0.1: this machine only)");
  cmd->add_option("--port", a->port, "TCP port (0: any free port, printed on stderr)")->check(CLI::Range(0, 65535));
  cmd->add_option("-c,--ctx", a->n_ctx, "context length per slot in tokens (prompt + generated)")
      ->check(CLI::Range(16, 1 << 22));
  cmd->add_option("--parallel", a->parallel, "slots: requests generated at the same time (others queue)")
      ->check(CLI::Range(1, 256));
  cmd->add_option("--api-key", a->api_key, "require 'Authorization: Bearer KEY' (all endpoints but /health)")
      ->envname("DFLASH_API_KEY");
  cmd->add_option("-t,--threads", a->threads, "CPU threads (0 = all cores)")->check(CLI::Range(0, 1024));
  cmd->add_option("--device", a->device, kDeviceHelp);
  cmd->add_flag("--no-spec", a->no_spec, "plain decoding even with a drafter");
  cmd->add_option("--block", a->block, "verify block width B (2..the drafter's block; default: the drafter's block)")
      ->check(CLI::Range(2, 64));
  cmd->add_option("--alias", a->alias, "model id in responses and /v1/models (default: the file name)");
  cmd->add_option("--max-body", a->max_body, "largest accepted request body in bytes (larger: 413)")
      ->check(CLI::Range(size_t{1024}, size_t{1} << 31));
  cmd->add_flag("-q,--quiet", a->quiet, "no request log on stderr");
  cmd->callback([a] { serve(*a); });
}

}  // namespace dflash::cli
