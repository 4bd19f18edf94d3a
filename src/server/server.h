// `dflash serve`: an OpenAI-compatible HTTP server over the engine (cpp-httplib + nlohmann::json).
//
//   POST /v1/chat/completions, /v1/completions   OpenAI shapes; stream: true -> server-sent events
//                                                 "data: {chunk}\n\n" ... "data: [DONE]\n\n"
//   GET  /v1/models                               the one served model
//   GET  /health                                  503 {"status":"loading"} until the model is loaded, then 200
//   GET  /metrics                                 Prometheus text (server/metrics.h)
//   POST /tokenize, /detokenize                   llama.cpp server shapes
//
// Threads: the socket listens at once; the model loads on a background thread (start_loading) so a
// supervisor can poll /health. Each request runs on an HTTP worker thread: it is parsed and
// validated (every 4xx is decided before queueing), then waits for a slot (server/slot_pool.h: first
// come first served, longest cached prefix wins among free slots) and generates on that slot's
// Engine. A streaming client that goes away makes the next write fail; the token callback then
// returns false and the slot is freed at once.
//
// Slots: each is a TargetModel + Engine (+ DFlashDrafter) over ONE shared gguf::File mapping and
// one Backend. On the CPU backend the weights stay in the mapping (upload_weight keeps pointers), so
// a slot costs its own state: KV cache (n_ctx x kv width per attention layer), GDN conv/recurrent
// state with what a rollback needs, and the forward scratch (max_rows x n_vocab logits); plus the
// drafter's context cache when one is loaded.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace dflash {
class Backend;
}
namespace dflash::gguf {
class File;
}

namespace dflash::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;                  // 0: any free port (see Server::port())
  std::string model_path;           // target GGUF (must have a tokenizer)
  std::string drafter_path;         // DFlash drafter GGUF; "" = plain greedy decoding
  std::string model_name;           // id in responses and /v1/models; "" = the target's file name sans .gguf
  int64_t n_ctx = 4096;             // per slot: prompt + generated tokens
  int n_parallel = 1;               // slots
  int threads = 0;                  // CPU backend threads (0 = all cores)
  // The compute backend (null: the CPU backend with `threads`). Every slot loads onto this one backend.
  std::function<std::unique_ptr<Backend>()> make_backend;
  // False for a backend whose ops must not be enqueued from several threads at once (the CUDA
  // backend runs everything on one stream): generations then run one at a time (slots still keep
  // their own caches). The CPU backend is stateless and can be shared.
  bool backend_thread_safe = true;
  bool speculative = true;          // use the drafter when one is given
  int64_t block = 0;                // verify width (0 = the drafter's trained block size)
  std::string api_key;              // non-empty: every endpoint but /health needs "Authorization: Bearer KEY"
  size_t max_body_bytes = 8u << 20; // larger request bodies get a 413
  int http_threads = 0;             // HTTP worker threads (0 = max(32, 4 * n_parallel + 8))
  // Called with each GGUF file right after it is opened (the CLI prefetches it with a progress bar).
  std::function<void(const gguf::File&)> on_file_open;
  // One line per request and per event (loading, ready); null = quiet.
  std::function<void(const std::string&)> log;
};

class Server {
 public:
  enum class State { kLoading, kReady, kFailed };

  explicit Server(ServerOptions options);
  ~Server();  // stop()s and joins
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds the listening socket; returns the port. Throws dflash::Error when it cannot.
  int bind();
  // Loads the model (and the slots) on a background thread; /health says 503 until it is done.
  void start_loading();
  // Loads in the calling thread; throws dflash::Error on failure.
  void load();
  // Serves until stop() (blocks). bind() first.
  void listen();
  // listen() on a background thread.
  void start();
  // Stops serving: running generations stop at their next token, waiting requests get a 503.
  void stop();

  // Blocks until loading finished (kReady or kFailed).
  State wait_loaded();
  State state() const;
  std::string load_error() const;
  int port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dflash::server
