#include "server/server.h"

#include <fmt/format.h>
#include <httplib.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "gguf/gguf.h"
#include "models/dflash_drafter.h"
#include "models/target.h"
#include "server/api.h"
#include "server/metrics.h"
#include "server/slot_pool.h"
#include "server/stop_matcher.h"
#include "spec/engine.h"
#include "text/chat.h"
#include "text/tokenizer.h"
#include "util/error.h"

namespace dflash::server {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// Strings we send are valid UTF-8 (StreamDecoder), but /detokenize and token pieces may be any bytes:
// never let dump() throw on them.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void send_json(httplib::Response& res, int status, const json& j) {
  res.status = status;
  res.set_content(dump(j), "application/json");
}

void send_error(httplib::Response& res, const ApiError& e) {
  send_json(res, e.status, error_json(e));
  if (e.status == 401) res.set_header("WWW-Authenticate", "Bearer");
}

// Compares without an early exit, so the time taken does not tell how much of the key was right.
bool same_secret(const std::string& given, const std::string& key) {
  if (given.size() != key.size()) return false;
  unsigned diff = 0;
  for (size_t i = 0; i < key.size(); ++i) diff |= static_cast<unsigned char>(given[i] ^ key[i]);
  return diff == 0;
}

std::string random_id(const char* prefix) {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = std::random_device{}() ^ (static_cast<uint64_t>(std::random_device{}()) << 32);
  const uint64_t n = counter.fetch_add(1) + 1;
  return fmt::format("{}{:016x}", prefix, (n * 0x9E3779B97F4A7C15ull) ^ salt);
}

// When the current request started (each request runs start to end on one worker thread).
thread_local Clock::time_point t_request_start;

// A constant table, not a static std::set: worker threads of a server that is still running while
// the process exits (a test's shared server) must not read a container the exit handlers destroyed.
bool is_known_path(std::string_view path) {
  static constexpr std::string_view kPaths[] = {
      "/health", "/metrics", "/v1/models", "/models", "/v1/chat/completions", "/chat/completions",
      "/v1/completions", "/completions", "/tokenize", "/detokenize"};
  for (std::string_view p : kPaths)
    if (p == path) return true;
  return false;
}

// httplib listens with a backlog of 5 (CPPHTTPLIB_LISTEN_BACKLOG, compiled into the Debian library):
// a burst of clients then overflows the accept queue and the kernel resets some connections before
// they are ever accepted. Listening again on the bound socket raises the backlog (Linux allows it).
class HttpServer : public httplib::Server {
 public:
  void raise_backlog() {
    const socket_t fd = svr_sock_;
    if (fd != INVALID_SOCKET) ::listen(fd, SOMAXCONN);
  }
};

struct Model {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<gguf::File> target_file, drafter_file;
  std::unique_ptr<text::Tokenizer> tok;
  std::optional<text::ChatTemplate> tmpl;
  std::string tmpl_error;  // why there is no template
  std::string name;
  int64_t n_ctx = 0, n_vocab = 0, block = 0;
  bool speculative = false;
  std::vector<int32_t> stop_ids;
  int64_t created = 0;
};

struct Slot {
  std::unique_ptr<TargetModel> target;
  std::unique_ptr<DFlashDrafter> drafter;
  std::unique_ptr<Engine> engine;
};

// What one generation produced.
struct Outcome {
  GenerateStats st;
  std::string finish = "length";  // "stop" | "length"
  bool cancelled = false;         // the sink refused text (client gone) or the server is stopping
  std::string error;              // the engine threw
};

}  // namespace

struct Server::Impl {
  explicit Impl(ServerOptions opts) : o(std::move(opts)), pool(std::max(o.n_parallel, 1)) {}

  ServerOptions o;
  Model model;
  std::vector<Slot> slots;
  SlotPool pool;
  Metrics metrics;

  std::atomic<State> state{State::kLoading};
  mutable std::mutex mu;
  std::condition_variable loaded_cv;
  std::string load_error;
  std::atomic<bool> stopping{false};
  std::mutex backend_mu;   // serialises generations when !o.backend_thread_safe
  bool listening = false;  // listen() is inside httplib's accept loop (guarded by mu)
  int port = -1;
  std::thread load_thread, listen_thread;

  HttpServer http;  // last: destroyed (and its workers joined) first

  void log(const std::string& line) const {
    if (o.log) o.log(line);
  }

  // ---- setup ----------------------------------------------------------------------------------

  void setup() {
    DFLASH_CHECK(o.n_parallel >= 1 && o.n_parallel <= 256, "--parallel is {}; use 1..256", o.n_parallel);
    const int workers = o.http_threads > 0 ? o.http_threads : std::max(32, 4 * o.n_parallel + 8);
    http.new_task_queue = [workers] { return new httplib::ThreadPool(static_cast<size_t>(workers)); };
    http.set_payload_max_length(o.max_body_bytes);
    http.set_pre_routing_handler([](const httplib::Request&, httplib::Response&) {
      t_request_start = Clock::now();
      return httplib::Server::HandlerResponse::Unhandled;
    });
    // Statuses httplib sets itself (404 no route, 400 unparsable request line, 413) get an OpenAI body.
    http.set_error_handler(httplib::Server::HandlerWithResponse([](const httplib::Request& req,
                                                                  httplib::Response& res) {
      if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
      std::string msg = res.status == 404   ? fmt::format("no route for {} {}", req.method, req.path)
                        : res.status == 413 ? std::string("the request body is too large")
                                            : fmt::format("HTTP {}", res.status);
      send_json(res, res.status, error_json(ApiError(res.status, msg, "invalid_request_error", {},
                                                     res.status == 404 ? "not_found" : "")));
      return httplib::Server::HandlerResponse::Handled;
    }));
    http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
      std::string what = "unknown error";
      try {
        std::rethrow_exception(ep);
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      send_error(res, ApiError(500, "internal error: " + what, "server_error"));
    });
    http.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
      const std::string endpoint = is_known_path(req.path) ? req.path : "other";
      metrics.count_request(endpoint, res.status);
      if (o.log) {
        const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t_request_start).count();
        log(fmt::format("{} {} {} {:.1f} ms{}", req.method, req.path, res.status, ms,
                        res.content_provider_success_ || !res.is_chunked_content_provider_ ? "" : " (cancelled)"));
      }
    });

    get("/health", false, [this](const httplib::Request&, httplib::Response& res) {
      switch (state.load()) {
        case State::kLoading: send_json(res, 503, {{"status", "loading"}}); break;
        case State::kReady: send_json(res, 200, {{"status", "ok"}}); break;
        case State::kFailed: send_json(res, 500, {{"status", "error"}, {"error", load_error_copy()}}); break;
      }
    });
    get("/metrics", true, [this](const httplib::Request&, httplib::Response& res) {
      Metrics::Gauges g;
      g.slots = pool.size();
      g.slots_busy = pool.busy();
      g.waiting = pool.waiting();
      g.loaded = state.load() == State::kReady;
      res.status = 200;
      res.set_content(metrics.render(g), "text/plain; version=0.0.4; charset=utf-8");
    });
    for (const char* path : {"/v1/models", "/models"}) {
      get(path, true, [this](const httplib::Request&, httplib::Response& res) {
        require_ready();
        json meta = {{"n_ctx", model.n_ctx},
                     {"n_vocab", model.n_vocab},
                     {"n_parallel", pool.size()},
                     {"speculative", model.speculative},
                     {"chat_template", model.tmpl ? model.tmpl->name() : std::string()}};
        if (model.speculative) meta["block"] = model.block;
        send_json(res, 200,
                  {{"object", "list"},
                   {"data", json::array({{{"id", model.name},
                                          {"object", "model"},
                                          {"created", model.created},
                                          {"owned_by", "dflash"},
                                          {"meta", meta}}})}});
      });
    }
    for (const char* path : {"/v1/chat/completions", "/chat/completions"})
      post(path, [this](const httplib::Request&, httplib::Response& res, const std::string& body) {
        completion(res, parse_chat_request(parse_body(body)));
      });
    for (const char* path : {"/v1/completions", "/completions"})
      post(path, [this](const httplib::Request&, httplib::Response& res, const std::string& body) {
        completion(res, parse_completion_request(parse_body(body)));
      });
    post("/tokenize", [this](const httplib::Request&, httplib::Response& res, const std::string& body) {
      const TokenizeRequest r = parse_tokenize_request(parse_body(body));
      text::EncodeOptions eo;
      eo.add_special = r.add_special;
      eo.parse_special = r.parse_special;
      const std::vector<int32_t> ids = model.tok->encode(r.content, eo);
      json tokens = json::array();
      for (int32_t id : ids) {
        if (r.with_pieces)
          tokens.push_back({{"id", id}, {"piece", model.tok->token_to_piece(id)}});
        else
          tokens.push_back(id);
      }
      send_json(res, 200, {{"tokens", tokens}});
    });
    post("/detokenize", [this](const httplib::Request&, httplib::Response& res, const std::string& body) {
      const std::vector<int32_t> ids = parse_detokenize_request(parse_body(body));
      for (int32_t id : ids)
        if (id >= model.n_vocab)
          bad_request(fmt::format("'tokens': token id {} is out of range (vocabulary of {})", id, model.n_vocab),
                      "tokens", "invalid_value");
      send_json(res, 200, {{"content", model.tok->decode(ids, /*special=*/true)}});
    });
  }

  std::string load_error_copy() const {
    std::lock_guard<std::mutex> lock(mu);
    return load_error;
  }

  void require_ready() const {
    switch (state.load()) {
      case State::kReady: return;
      case State::kLoading: throw ApiError(503, "the model is loading; retry shortly", "server_error", {}, "model_loading");
      case State::kFailed:
        throw ApiError(503, "the model failed to load: " + load_error_copy(), "server_error", {}, "model_load_failed");
    }
  }

  void check_auth(const httplib::Request& req) const {
    if (o.api_key.empty()) return;
    const std::string h = req.get_header_value("Authorization");
    const std::string prefix = "Bearer ";
    if (h.size() < prefix.size() || h.compare(0, prefix.size(), prefix) != 0 ||
        !same_secret(h.substr(prefix.size()), o.api_key))
      throw ApiError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'", "invalid_request_error",
                     {}, "invalid_api_key");
  }

  // Runs a handler body, turning exceptions into OpenAI error responses.
  template <typename F>
  void guarded(httplib::Response& res, F&& fn) {
    try {
      fn();
    } catch (const ApiError& e) {
      send_error(res, e);
    } catch (const std::bad_alloc&) {
      send_error(res, ApiError(500, "out of memory", "server_error"));
    } catch (const std::exception& e) {
      send_error(res, ApiError(500, e.what(), "server_error"));
    }
  }

  using Handler = std::function<void(const httplib::Request&, httplib::Response&)>;
  using BodyHandler = std::function<void(const httplib::Request&, httplib::Response&, const std::string&)>;

  void get(const std::string& path, bool auth, Handler fn) {
    http.Get(path, [this, auth, fn](const httplib::Request& req, httplib::Response& res) {
      guarded(res, [&] {
        if (auth) check_auth(req);
        fn(req, res);
      });
    });
  }

  // POST handlers read the body themselves (httplib's own reading has no limit for chunked bodies).
  void post(const std::string& path, BodyHandler fn) {
    http.Post(path, [this, fn](const httplib::Request& req, httplib::Response& res,
                               const httplib::ContentReader& reader) {
      std::string body;
      bool too_big = false;
      size_t discarded = 0;
      const bool ok = reader([&](const char* data, size_t n) {
        if (too_big) {
          // Keep reading (and dropping) so the connection stays in step, up to a point.
          discarded += n;
          return discarded <= 4 * o.max_body_bytes;
        }
        if (body.size() + n > o.max_body_bytes) {
          too_big = true;
          std::string().swap(body);
          return true;
        }
        body.append(data, n);
        return true;
      });
      guarded(res, [&] {
        check_auth(req);
        if (too_big || res.status == 413)
          throw ApiError(413, fmt::format("the request body is larger than the limit of {} bytes", o.max_body_bytes),
                         "invalid_request_error", {}, "request_too_large");
        if (!ok) throw ApiError(400, "could not read the request body", "invalid_request_error", {}, "invalid_body");
        res.status = -1;
        require_ready();
        fn(req, res, body);
      });
      if (!ok || too_big) res.set_header("Connection", "close");
    });
  }

  // ---- loading --------------------------------------------------------------------------------

  void do_load() {
    Model& m = model;
    m.name = o.model_name;
    if (m.name.empty()) {
      m.name = std::filesystem::path(o.model_path).filename().string();
      if (m.name.size() > 5 && m.name.ends_with(".gguf")) m.name.resize(m.name.size() - 5);
    }
    m.created = static_cast<int64_t>(std::time(nullptr));
    log(fmt::format("loading {}{}", o.model_path, o.drafter_path.empty() ? "" : " with drafter " + o.drafter_path));
    m.backend = o.make_backend ? o.make_backend() : make_cpu_backend(o.threads);
    if (pool.size() > 1 && !o.backend_thread_safe)
      log(fmt::format("{} slots on {}: weights are loaded once per slot, and generations run one at a time",
                      pool.size(), m.backend->name()));
    m.target_file = std::make_unique<gguf::File>(gguf::File::open(o.model_path));
    if (o.on_file_open) o.on_file_open(*m.target_file);
    DFLASH_CHECK(m.target_file->has("tokenizer.ggml.tokens"),
                 "{}: the model has no tokenizer (tokenizer.ggml.tokens); the server needs one", o.model_path);
    m.tok = std::make_unique<text::Tokenizer>(text::Tokenizer::from_gguf(*m.target_file));
    try {
      m.tmpl = text::ChatTemplate::from_gguf(*m.target_file, *m.tok);
    } catch (const Error& e) {
      m.tmpl_error = e.what();  // chat requests will say why; /v1/completions still works
      log(fmt::format("no chat template: {}", m.tmpl_error));
    }
    m.stop_ids = m.tok->eog_ids();

    TargetOptions to;
    to.n_ctx = o.n_ctx;
    std::optional<DrafterConfig> dc;
    if (!o.drafter_path.empty() && o.speculative) {
      m.drafter_file = std::make_unique<gguf::File>(gguf::File::open(o.drafter_path));
      if (o.on_file_open) o.on_file_open(*m.drafter_file);
      dc = read_drafter_config(*m.drafter_file);
      check_drafter_fits_target(*dc, o.drafter_path, read_target_config(*m.target_file), o.model_path);
      to.tap_layers = dc->target_layers;
      to.max_undo_rows = dc->block_size;
      m.block = o.block > 0 ? o.block : dc->block_size;
      DFLASH_CHECK(m.block >= 2 && m.block <= dc->block_size,
                   "--block is {}; the drafter {} supports 2..{}", m.block, o.drafter_path, dc->block_size);
      m.speculative = true;
    }
    // One sequence state per slot over the shared mapping and backend.
    slots.resize(static_cast<size_t>(pool.size()));
    for (size_t i = 0; i < slots.size(); ++i) {
      DFLASH_CHECK(!stopping.load(), "the server stopped while loading");
      Slot& s = slots[i];
      s.target = TargetModel::load(*m.target_file, *m.backend, to);
      if (dc) s.drafter = DFlashDrafter::load(*m.drafter_file, *s.target);
      s.engine = std::make_unique<Engine>(*s.target, s.drafter.get());
    }
    m.n_ctx = slots[0].target->n_ctx();
    m.n_vocab = slots[0].target->config().n_vocab;
    log(fmt::format("ready: {} ({} slot{}, context {}, {}{})", m.name, slots.size(), slots.size() == 1 ? "" : "s",
                    m.n_ctx, m.speculative ? fmt::format("speculative, block {}", m.block) : "plain decoding",
                    m.tmpl ? ", chat template " + m.tmpl->name() : ""));
  }

  void finish_loading(bool ok, const std::string& err) {
    {
      std::lock_guard<std::mutex> lock(mu);
      load_error = err;
      state.store(ok ? State::kReady : State::kFailed);
    }
    loaded_cv.notify_all();
  }

  void load_and_report() {
    try {
      do_load();
      finish_loading(true, {});
    } catch (const std::exception& e) {
      log(fmt::format("loading failed: {}", e.what()));
      finish_loading(false, e.what());
    }
  }

  // ---- generation -----------------------------------------------------------------------------

  // Holds a slot; gives it back (with what its cache now holds) when released or destroyed.
  struct Lease {
    Impl* s;
    int index;
    bool held = true;
    Lease(Impl* s, int index) : s(s), index(index) {}
    ~Lease() { release(); }
    Slot& slot() const { return s->slots[static_cast<size_t>(index)]; }
    void release() {
      if (!held) return;
      held = false;
      s->pool.release(index, slot().engine->cached_tokens());
    }
  };

  std::vector<int32_t> build_prompt(const CompletionRequest& r) const {
    std::vector<int32_t> prompt;
    if (r.endpoint == Endpoint::kChat) {
      if (!model.tmpl)
        throw ApiError(400, fmt::format("the model has no usable chat template ({}); use /v1/completions",
                                        model.tmpl_error),
                       "invalid_request_error", "messages", "no_chat_template");
      std::string text;
      try {
        text = model.tmpl->render(r.messages, r.chat);
      } catch (const Error& e) {
        bad_request(fmt::format("the chat template rejected the messages: {}", e.what()), "messages");
      }
      prompt = model.tok->encode(text);
    } else if (r.prompt_is_ids) {
      for (int32_t id : r.prompt_ids)
        if (id >= model.n_vocab)
          bad_request(fmt::format("'prompt' token id {} is out of range (vocabulary of {})", id, model.n_vocab),
                      "prompt", "invalid_value");
      prompt = r.prompt_ids;
    } else {
      prompt = model.tok->encode(r.prompt_text);
    }
    if (prompt.empty()) bad_request("the prompt is empty", r.endpoint == Endpoint::kChat ? "messages" : "prompt");
    if (static_cast<int64_t>(prompt.size()) >= model.n_ctx)
      bad_request(fmt::format("the prompt has {} tokens; this server's context holds {} tokens (prompt + "
                              "generated), so at most {} prompt tokens",
                              prompt.size(), model.n_ctx, model.n_ctx - 1),
                  r.endpoint == Endpoint::kChat ? "messages" : "prompt", "context_length_exceeded");
    return prompt;
  }

  // Generates on a held slot; `emit` gets text as it becomes final (after stop-string hold-back) and
  // returns false when it cannot deliver it (the client is gone).
  Outcome generate(const Lease& lease, const std::vector<int32_t>& prompt, const CompletionRequest& r,
                   const std::function<bool(const std::string&)>& emit) {
    Slot& slot = lease.slot();
    GenerateOptions go;
    go.max_tokens = r.max_tokens.value_or(model.n_ctx);  // the engine stops at a full context anyway
    go.stop_tokens = model.stop_ids;
    go.speculative = model.speculative;
    if (model.speculative) go.block = model.block;
    go.sampling = r.sampling;

    text::StreamDecoder dec(*model.tok, /*special=*/false);
    StopMatcher stops(r.stop);
    Outcome out;
    std::unique_lock<std::mutex> serial(backend_mu, std::defer_lock);
    if (!o.backend_thread_safe) serial.lock();
    try {
      out.st = slot.engine->generate(prompt, go, [&](int32_t t) {
        if (stopping.load()) {
          out.cancelled = true;
          return false;
        }
        const std::string piece = stops.push(dec.push(t));
        if (!piece.empty() && !emit(piece)) {
          out.cancelled = true;
          return false;
        }
        return !stops.stopped();
      });
    } catch (const std::exception& e) {
      slot.engine->reset();  // the caches may be half-updated
      out.error = e.what();
    }
    if (out.error.empty() && !out.cancelled && !stops.stopped()) {
      std::string tail = stops.push(dec.flush());
      if (!stops.stopped()) tail += stops.finish();
      if (!tail.empty() && !emit(tail)) out.cancelled = true;
    }
    out.finish = stops.stopped() || out.st.stopped_by_token ? "stop" : "length";
    metrics.add_generation(out.st, !out.error.empty() ? "error" : out.cancelled ? "cancelled" : out.finish);
    return out;
  }

  json usage_json(const GenerateStats& st) const {
    return {{"prompt_tokens", st.prompt_tokens},
            {"completion_tokens", st.generated},
            {"total_tokens", st.prompt_tokens + st.generated},
            {"prompt_tokens_details", {{"cached_tokens", st.reused_tokens}}}};
  }

  // Engine timings and speculative counters (a dflash extension next to "usage").
  json timings_json(const GenerateStats& st) const {
    json t = {{"prefill_seconds", st.prefill_seconds},
              {"decode_seconds", st.decode_seconds},
              {"decode_tokens_per_second", st.decode_seconds > 0 && st.generated > 1
                                               ? (st.generated - 1) / st.decode_seconds
                                               : 0.0}};
    if (model.speculative) {
      t["spec_cycles"] = st.cycles;
      t["drafted"] = st.drafted;
      t["accepted"] = st.accepted;
      t["acceptance_length"] = st.acceptance_length();
    }
    return t;
  }

  json choice_json(const CompletionRequest& r, const std::string& text, const json& finish) const {
    if (r.endpoint == Endpoint::kChat)
      return {{"index", 0},
              {"message", {{"role", "assistant"}, {"content", text}}},
              {"logprobs", nullptr},
              {"finish_reason", finish}};
    return {{"index", 0}, {"text", text}, {"logprobs", nullptr}, {"finish_reason", finish}};
  }

  json chunk_json(const CompletionRequest& r, const std::string& id, int64_t created, json choices) const {
    return {{"id", id},
            {"object", r.endpoint == Endpoint::kChat ? "chat.completion.chunk" : "text_completion"},
            {"created", created},
            {"model", model.name},
            {"system_fingerprint", "dflash"},
            {"choices", std::move(choices)}};
  }

  json delta_choice(const CompletionRequest& r, const std::string& text, const json& finish) const {
    if (r.endpoint == Endpoint::kChat)
      return {{"index", 0},
              {"delta", text.empty() && finish.is_null() ? json{{"role", "assistant"}, {"content", ""}}
                                                         : finish.is_null() ? json{{"content", text}} : json::object()},
              {"logprobs", nullptr},
              {"finish_reason", finish}};
    return {{"index", 0}, {"text", text}, {"logprobs", nullptr}, {"finish_reason", finish}};
  }

  void completion(httplib::Response& res, CompletionRequest r) {
    const std::vector<int32_t> prompt = build_prompt(r);
    const std::optional<int> index = pool.acquire(prompt);
    if (!index) throw ApiError(503, "the server is shutting down", "server_error", {}, "shutting_down");
    auto lease = std::make_shared<Lease>(this, *index);
    const std::string id = random_id(r.endpoint == Endpoint::kChat ? "chatcmpl-" : "cmpl-");
    const int64_t created = static_cast<int64_t>(std::time(nullptr));

    if (!r.stream) {
      std::string text;
      const Outcome oc = generate(*lease, prompt, r, [&](const std::string& piece) {
        text += piece;
        return true;
      });
      lease->release();
      if (!oc.error.empty()) throw ApiError(500, "generation failed: " + oc.error, "server_error");
      if (oc.cancelled) throw ApiError(503, "the server is shutting down", "server_error", {}, "shutting_down");
      send_json(res, 200,
                {{"id", id},
                 {"object", r.endpoint == Endpoint::kChat ? "chat.completion" : "text_completion"},
                 {"created", created},
                 {"model", model.name},
                 {"system_fingerprint", "dflash"},
                 {"choices", json::array({choice_json(r, text, oc.finish)})},
                 {"usage", usage_json(oc.st)},
                 {"timings", timings_json(oc.st)}});
      return;
    }

    // Streaming: the whole generation runs inside the first call of the content provider (after the
    // 200 header went out); every event is one chunk, so the client sees tokens as they come.
    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");
    auto req = std::make_shared<CompletionRequest>(std::move(r));
    auto toks = std::make_shared<std::vector<int32_t>>(prompt);
    res.set_chunked_content_provider(
        "text/event-stream", [this, lease, req, toks, id, created](size_t, httplib::DataSink& sink) {
          try {
            bool reported = false;
            auto send = [&](const json& j) {
              const std::string ev = "data: " + dump(j) + "\n\n";
              errno = 0;
              const bool ok = sink.write(ev.data(), ev.size());
              if (!ok && !reported) {
                reported = true;
                log(fmt::format("{}: client gone ({})", id, errno ? std::strerror(errno) : "write failed"));
              }
              return ok;
            };
            // Chat streams open with the role; a client that left while queued fails here or at the next write.
            if (req->endpoint == Endpoint::kChat &&
                !send(chunk_json(*req, id, created, json::array({delta_choice(*req, "", nullptr)})))) {
              lease->release();
              return false;
            }
            const Outcome oc = generate(*lease, *toks, *req, [&](const std::string& piece) {
              return send(chunk_json(*req, id, created, json::array({delta_choice(*req, piece, nullptr)})));
            });
            lease->release();
            if (oc.cancelled) return false;  // client gone (or stopping): httplib drops the connection
            if (!oc.error.empty()) {
              send(error_json(ApiError(500, "generation failed: " + oc.error, "server_error")));
            } else {
              send(chunk_json(*req, id, created, json::array({delta_choice(*req, "", oc.finish)})));
              if (req->include_usage) {
                json u = chunk_json(*req, id, created, json::array());
                u["usage"] = usage_json(oc.st);
                u["timings"] = timings_json(oc.st);
                send(u);
              }
            }
            static constexpr std::string_view kDone = "data: [DONE]\n\n";
            sink.write(kDone.data(), kDone.size());
            sink.done();
            return true;
          } catch (...) {
            lease->release();
            return false;
          }
        });
  }
};

Server::Server(ServerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) { impl_->setup(); }

Server::~Server() {
  stop();
  if (impl_->listen_thread.joinable()) impl_->listen_thread.join();
  if (impl_->load_thread.joinable()) impl_->load_thread.join();
}

int Server::bind() {
  Impl& s = *impl_;
  if (s.o.port == 0) {
    s.port = s.http.bind_to_any_port(s.o.host);
  } else {
    s.port = s.http.bind_to_port(s.o.host, s.o.port) ? s.o.port : -1;
  }
  DFLASH_CHECK(s.port > 0, "cannot listen on {}:{} (address in use, or not an address of this machine?)", s.o.host,
               s.o.port);
  s.http.raise_backlog();
  return s.port;
}

void Server::start_loading() {
  impl_->load_thread = std::thread([this] { impl_->load_and_report(); });
}

void Server::load() {
  try {
    impl_->do_load();
  } catch (const std::exception& e) {
    impl_->finish_loading(false, e.what());
    throw;
  }
  impl_->finish_loading(true, {});
}

void Server::listen() {
  Impl& s = *impl_;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.stopping.load()) return;
    s.listening = true;
  }
  s.http.listen_after_bind();
  std::lock_guard<std::mutex> lock(s.mu);
  s.listening = false;
}

void Server::start() {
  auto returned = std::make_shared<std::atomic<bool>>(false);
  impl_->listen_thread = std::thread([this, returned] {
    listen();
    returned->store(true);
  });
  // Return once the accept loop runs (so a client can connect right away), or once listen() gave up
  // (not bound, or stopped).
  while (!impl_->http.is_running() && !returned->load() && !impl_->stopping.load())
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

void Server::stop() {
  Impl& s = *impl_;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.stopping.store(true);
  }
  s.pool.shutdown();
  // httplib's stop() only acts on a running accept loop: wait for a listen() that is starting up.
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (!s.listening) return;
    }
    if (s.http.is_running()) {
      s.http.stop();
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

Server::State Server::wait_loaded() {
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->loaded_cv.wait(lock, [&] { return impl_->state.load() != State::kLoading; });
  return impl_->state.load();
}

Server::State Server::state() const { return impl_->state.load(); }
std::string Server::load_error() const { return impl_->load_error_copy(); }
int Server::port() const { return impl_->port; }

}  // namespace dflash::server
