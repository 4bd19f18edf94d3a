// `dflash bench`: a llama-bench-like table for one target (and drafter) on one backend.
//
//   dflash bench [-m TARGET] [-d DRAFTER] [--device cpu|cuda[:N]] [-p 512] [-n 128] [--block 8] [-r 3]
//                [--depth D]
//
// Rows (with --depth D each test runs after D tokens already in the cache, and its name ends in
// " @ dD", as llama-bench's -d: attention reads more keys, the drafter's context is longer):
//   pp<P>      prefill of P prompt tokens from an empty cache (chunks of --ubatch rows), with the
//              weight matmuls' TFLOP/s
//   tg<N>      plain greedy decode of N tokens (one row per step)
//   verify<B>  one undoable B-row target forward + rollback, against one decode step
//   draft<B>   one drafter step (with a drafter; device-resident, as in a speculative cycle), against
//              one decode step
//   spec<N>    DFlash speculative generation of N tokens (with a drafter): tok/s, acceptance length
// Every rate is the mean over --reps runs (± standard deviation), after one untimed warm-up run of the
// test (--no-warmup: none). Decode rows also give the bytes a
// step must move (every weight once, the embedding's one row, GDN state read + write, KV cache read)
// over the measured time, against the streaming-read bandwidth measured in the same run: the
// bandwidth floor.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>
#include <filesystem>
#include <thread>

#include "cli/backend_select.h"
#include "cli/commands.h"
#include "cli/load_progress.h"
#include "cli/model_paths.h"
#include "gguf/gguf.h"
#include "models/dflash_drafter.h"
#include "models/target.h"
#include "spec/engine.h"
#include "text/tokenizer.h"
#include "util/error.h"

#ifdef DFLASH_HAVE_CUDA
#include "ops/cuda/cuda_backend.h"
#endif

namespace dflash::cli {
namespace {

using Clock = std::chrono::steady_clock;

struct BenchArgs {
  std::string model;
  std::string drafter;
  std::string device = "cpu";
  int threads = 0;
  int64_t n_prompt = 512;
  int64_t n_gen = 128;
  int64_t ubatch = 0;  // 0: the backend's prefill_rows() (64 on the CPU, 512 on CUDA)
  int64_t block = 8;
  int64_t depth = 0;  // tokens in the cache before each test
  int reps = 3;
  bool no_spec = false;
  bool no_warmup = false;  // skip the untimed run before each test (lazy kernel loading, graph captures)
  bool json = false;
};

double seconds(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct Stat {
  double mean = 0, sd = 0;
};
Stat stat_of(const std::vector<double>& v) {
  Stat s;
  if (v.empty()) return s;
  s.mean = std::accumulate(v.begin(), v.end(), 0.0) / v.size();
  double var = 0;
  for (double x : v) var += (x - s.mean) * (x - s.mean);
  s.sd = v.size() > 1 ? std::sqrt(var / (v.size() - 1)) : 0.0;
  return s;
}

// Streaming-read bandwidth of host memory: every thread sums its slice of a 1 GiB buffer (much larger
// than any cache); the best of 5 passes, in GB/s.
double cpu_read_bandwidth_gbps(int threads) {
  const size_t n = (size_t{1} << 30) / sizeof(uint64_t);
  std::vector<uint64_t> buf(n);
  for (size_t i = 0; i < n; ++i) buf[i] = i * 0x9e3779b97f4a7c15ull;
  const unsigned nt = threads > 0 ? static_cast<unsigned>(threads) : std::max(1u, std::thread::hardware_concurrency());
  double best = 0;
  volatile uint64_t sink = 0;
  for (int pass = 0; pass < 5; ++pass) {
    std::vector<uint64_t> partial(nt, 0);
    const auto t0 = Clock::now();
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < nt; ++t)
      pool.emplace_back([&, t] {
        const size_t b = n * t / nt, e = n * (t + 1) / nt;
        uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
        size_t i = b;
        for (; i + 4 <= e; i += 4) {
          a0 += buf[i];
          a1 += buf[i + 1];
          a2 += buf[i + 2];
          a3 += buf[i + 3];
        }
        for (; i < e; ++i) a0 += buf[i];
        partial[t] = a0 + a1 + a2 + a3;
      });
    for (auto& th : pool) th.join();
    const double s = seconds(t0);
    for (uint64_t p : partial) sink = sink + p;
    best = std::max(best, static_cast<double>(n * sizeof(uint64_t)) / s / 1e9);
  }
  (void)sink;
  return best;
}

double read_bandwidth_gbps(Backend& be, const std::string& device, int threads) {
#ifdef DFLASH_HAVE_CUDA
  if (device.rfind("cuda", 0) == 0) return cuda::read_bandwidth_gbps(be, size_t{2} << 30, 20);
#endif
  (void)be;
  (void)device;
  return cpu_read_bandwidth_gbps(threads);
}

// Bytes one decode step at position `pos` must move through memory (SPEC 7's floor).
double decode_bytes(const gguf::File& f, const TargetConfig& c, int64_t pos) {
  double bytes = 0;
  const bool tied = f.find_tensor("output.weight") == nullptr;
  for (const auto& t : f.tensors()) {
    if (t.name == "token_embd.weight" && !tied) {
      bytes += static_cast<double>(t.nbytes) / static_cast<double>(t.ne[1]);  // one row
    } else {
      bytes += static_cast<double>(t.nbytes);
    }
  }
  int64_t n_attn = 0, n_gdn = 0;
  for (int64_t il = 0; il < c.n_layer; ++il) (c.is_attention_layer(il) ? n_attn : n_gdn)++;
  const double state = 4.0 * c.ssm_v_heads * c.ssm_head_k * c.ssm_head_v();  // f32 recurrent state
  bytes += n_gdn * 2.0 * state;                                               // read + write
  bytes += n_attn * 2.0 * 4.0 * c.n_head_kv * c.head_dim * static_cast<double>(pos);  // K and V, f32
  return bytes;
}

// Multiply-adds per prompt token in the weight matmuls: the elements of every weight matrix (2-D, rows
// of >= 64; not the embedding, a lookup, nor the output head, which a prefill applies to its last row
// only). The pp row's TFLOP/s = 2 x this x tokens/s (attention's score and value products not counted).
double matmul_params(const gguf::File& f) {
  double n = 0;
  for (const auto& t : f.tensors()) {
    if (t.name == "token_embd.weight" || t.name == "output.weight" || t.n_dims != 2 || t.ne[0] < 64) continue;
    n += static_cast<double>(t.ne[0]) * static_cast<double>(t.ne[1]);
  }
  return n;
}

struct Row {
  std::string test;
  Stat tok_s;
  double ms_per_tok = 0;
  double gb_s = 0;
  double pct_floor = -1;  // < 0: not applicable
  bool verify = false;    // ms_per_tok is ms per step; no tokens/s
  std::string extra;
  nlohmann::json j;
};

void bench(const BenchArgs& a) {
  const std::string model_path = a.model.empty() ? default_target_path() : a.model;
  gguf::File file = gguf::File::open(model_path);
  prefetch_file(file);
  auto be = make_backend(a.device, a.threads);

  std::string drafter_path = a.drafter;
  if (drafter_path.empty() && a.model.empty()) drafter_path = default_drafter_path().value_or("");
  if (a.no_spec) drafter_path.clear();
  std::optional<gguf::File> dfile;
  TargetOptions topts;
  // the deepest test: depth + the prompt (pp; spec's prompt is shorter than 256) + the generated tokens
  topts.n_ctx = a.depth + std::max<int64_t>(a.n_prompt, 256) + a.n_gen + 64;
  topts.max_rows = a.ubatch;
  if (!drafter_path.empty()) {
    dfile.emplace(gguf::File::open(drafter_path));
    const DrafterConfig dc = read_drafter_config(*dfile);
    check_drafter_fits_target(dc, drafter_path, read_target_config(file), model_path);
    topts.tap_layers = dc.target_layers;
    topts.max_undo_rows = dc.block_size;
  }
  const auto t_load = Clock::now();
  auto model = TargetModel::load(file, *be, topts);
  std::unique_ptr<DFlashDrafter> drafter;
  if (dfile) drafter = DFlashDrafter::load(*dfile, *model);
  const double load_s = seconds(t_load);
  const TargetConfig& cfg = model->config();
  const double floor_gbs = read_bandwidth_gbps(*be, a.device, a.threads);

  std::mt19937 rng(1234);
  auto random_ids = [&](int64_t n) {
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (auto& x : v) x = static_cast<int32_t>(rng() % static_cast<uint32_t>(cfg.n_vocab));
    return v;
  };
  // A code prompt when the model has a tokenizer (speculation needs text the model can predict).
  std::vector<int32_t> spec_prompt;
  if (file.has("tokenizer.ggml.tokens")) {
    const text::Tokenizer tok = text::Tokenizer::from_gguf(file);
    spec_prompt = tok.encode("import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the arguments and run.\"\"\"\n");
  }
  if (spec_prompt.empty()) spec_prompt = random_ids(32);

  // The cache before each test: `depth` random tokens (at least `least`), prefilled untimed.
  const std::string at_depth = a.depth > 0 ? fmt::format(" @ d{}", a.depth) : "";
  auto fill_cache = [&](int64_t least) {
    model->reset();
    return prefill(*model, random_ids(std::max(a.depth, least)));
  };
  if (a.depth > 0) {  // spec: the code prompt after `depth` random tokens
    std::vector<int32_t> p = random_ids(a.depth);
    p.insert(p.end(), spec_prompt.begin(), spec_prompt.end());
    spec_prompt = std::move(p);
  }

  std::vector<Row> rows;
  // Each test first runs once untimed (unless --no-warmup), as llama-bench does: the first run pays
  // one-time costs (CUDA loads each kernel at its first launch, step graphs are captured at their
  // first use, scratch buffers grow) that would otherwise land in the first repetition.
  const bool warm = !a.no_warmup;
  // ---- pp
  {
    std::vector<double> rates;
    if (warm) {
      model->reset();
      if (a.depth > 0) prefill(*model, random_ids(a.depth));
      prefill(*model, random_ids(a.n_prompt));
      be->synchronize();
    }
    for (int r = 0; r < a.reps; ++r) {
      const auto prompt = random_ids(a.n_prompt);
      model->reset();
      if (a.depth > 0) prefill(*model, random_ids(a.depth));
      be->synchronize();
      const auto t0 = Clock::now();
      prefill(*model, prompt);
      be->synchronize();
      rates.push_back(a.n_prompt / seconds(t0));
    }
    Row row;
    row.test = fmt::format("pp{}{}", a.n_prompt, at_depth);
    row.tok_s = stat_of(rates);
    row.ms_per_tok = 1e3 / row.tok_s.mean;
    const double params = matmul_params(file), tflops = 2.0 * params * row.tok_s.mean / 1e12;
    row.extra = fmt::format("{:.3g} TFLOP/s in the weight matmuls ({:.3g} G params)", tflops, params / 1e9);
    row.j["matmul_tflops"] = tflops;
    rows.push_back(row);
  }
  // ---- tg: decode after a 16-token prompt (or the depth); the floor at the middle position
  double decode_ms = 0;
  {
    std::vector<double> rates;
    for (int r = warm ? -1 : 0; r < a.reps; ++r) {  // r = -1: the warm-up (4 steps, not recorded)
      int32_t tok = fill_cache(16);
      ForwardOptions fo;
      fo.logits = LogitRows::kLast;
      if (r < 0) {
        for (int i = 0; i < 4; ++i) tok = model->forward(std::span(&tok, 1), fo).argmax[0];
        continue;
      }
      const auto t0 = Clock::now();
      for (int64_t i = 0; i < a.n_gen; ++i) tok = model->forward(std::span(&tok, 1), fo).argmax[0];
      rates.push_back(a.n_gen / seconds(t0));
    }
    Row row;
    row.test = fmt::format("tg{}{}", a.n_gen, at_depth);
    row.tok_s = stat_of(rates);
    row.ms_per_tok = decode_ms = 1e3 / row.tok_s.mean;
    const double bytes = decode_bytes(file, cfg, std::max<int64_t>(a.depth, 16) + a.n_gen / 2);
    row.gb_s = bytes * row.tok_s.mean / 1e9;
    row.pct_floor = 100.0 * row.gb_s / floor_gbs;
    row.extra = fmt::format("{:.1f} MB/token, floor {:.3f} ms", bytes / 1e6, bytes / floor_gbs / 1e6);
    rows.push_back(row);
  }
  // ---- verify: an undoable B-row forward + rollback(1), relative to one decode step
  {
    std::vector<double> ms;
    fill_cache(16);
    ForwardOptions fo;
    fo.logits = LogitRows::kAll;
    fo.undoable = true;
    fo.want_taps = !topts.tap_layers.empty();
    fo.taps_on_device = true;  // as in a speculative cycle: the taps go to the drafter on the device
    const int iters = std::max<int>(8, static_cast<int>(a.n_gen / 4));
    if (warm) {
      const auto block = random_ids(a.block);
      for (int i = 0; i < 2; ++i) {
        model->forward(block, fo);
        model->rollback(1);
      }
    }
    for (int r = 0; r < a.reps; ++r) {
      const auto block = random_ids(a.block);
      const auto t0 = Clock::now();
      for (int i = 0; i < iters; ++i) {
        model->forward(block, fo);
        model->rollback(1);
      }
      ms.push_back(1e3 * seconds(t0) / iters);
    }
    // The split (one more run, not in the figure above): the pass alone (its download waits for it) and the
    // rollback after it, waited for on its own. The pass leaves the recurrent states as they were; the rollback
    // advances them over the kept row (a full read and write of every GDN state), so the step's cost is their sum.
    double pass_s = 0, rollback_s = 0;
    {
      const auto block = random_ids(a.block);
      for (int i = 0; i < iters; ++i) {
        const auto t0 = Clock::now();
        model->forward(block, fo);
        const auto t1 = Clock::now();
        model->rollback(1);
        model->backend().synchronize();
        pass_s += std::chrono::duration<double>(t1 - t0).count();
        rollback_s += seconds(t1);
      }
    }
    const double pass_ms = 1e3 * pass_s / iters, rollback_ms = 1e3 * rollback_s / iters;
    Row row;
    row.test = fmt::format("verify{}{}", a.block, at_depth);
    const Stat s = stat_of(ms);
    row.verify = true;
    row.tok_s = {a.block * 1e3 / s.mean, 0};  // rows verified per second (JSON only)
    row.ms_per_tok = s.mean;
    row.extra = fmt::format("{:.2f} ms per {}-row step = {:.2f}x a decode step (apart: the pass {:.3f} ms = {:.3f}x, the "
                            "rollback {:.3f} ms)",
                            s.mean, a.block, s.mean / decode_ms, pass_ms, pass_ms / decode_ms, rollback_ms);
    row.j["verify_over_decode"] = s.mean / decode_ms;
    row.j["pass_ms"] = pass_ms;
    row.j["rollback_ms"] = rollback_ms;
    rows.push_back(row);
  }
  // ---- draft: the drafter's step alone (device-resident: no download), relative to one decode step
  if (drafter) {
    model->reset();
    drafter->reset_context();
    prefill_device_taps(*model, random_ids(std::max<int64_t>(a.depth, 64)),
                        [&](const float* taps, int64_t n) { drafter->append_context_device(taps, n); });
    const int iters = std::max<int>(8, static_cast<int>(a.n_gen / 4));
    std::vector<double> ms;
    for (int i = 0; i < 3; ++i) drafter->draft_device(1);  // direct run, graph capture, replay
    be->synchronize();
    for (int r = 0; r < a.reps; ++r) {
      const auto t0 = Clock::now();
      for (int i = 0; i < iters; ++i) drafter->draft_device(static_cast<int32_t>(rng() % cfg.n_vocab));
      be->synchronize();
      ms.push_back(1e3 * seconds(t0) / iters);
    }
    Row row;
    row.test = fmt::format("draft{}{}", drafter->block_size(), at_depth);
    const Stat s = stat_of(ms);
    row.verify = true;  // a step time, not a token rate
    row.tok_s = {1e3 / s.mean, 0};
    row.ms_per_tok = s.mean;
    row.extra = fmt::format("{:.2f} ms per draft of {} rows ({} layers) = {:.2f}x a decode step", s.mean,
                            drafter->block_size(), drafter->config().n_layer, s.mean / decode_ms);
    row.j["draft_over_decode"] = s.mean / decode_ms;
    rows.push_back(row);
  }
  // ---- spec
  if (drafter) {
    std::vector<double> rates, taus, draft_ms, verify_ms;
    // reps runs for the speed (the host waits once per cycle), then one with timed phases (waits
    // around each draft too) for the split of a cycle into draft and verify time.
    for (int r = warm ? -1 : 0; r <= a.reps; ++r) {  // r = -1: the warm-up (not recorded)
      Engine engine(*model, drafter.get());
      engine.reset();
      GenerateOptions go;
      go.max_tokens = r < 0 ? std::min<int64_t>(a.n_gen, 32) : a.n_gen;
      go.block = a.block;
      go.speculative = true;
      go.time_phases = r == a.reps;
      const GenerateStats st = engine.generate(spec_prompt, go, [](int32_t) { return true; });
      if (r < 0) continue;
      if (go.time_phases) {
        draft_ms.push_back(st.cycles ? 1e3 * st.draft_seconds / st.cycles : 0);
        verify_ms.push_back(st.cycles ? 1e3 * st.verify_seconds / st.cycles : 0);
        continue;
      }
      rates.push_back((st.generated - 1) / st.decode_seconds);
      taus.push_back(st.acceptance_length());
    }
    Row row;
    row.test = fmt::format("spec{} b{}{}", a.n_gen, a.block, at_depth);
    row.tok_s = stat_of(rates);
    row.ms_per_tok = 1e3 / row.tok_s.mean;
    const double tau = stat_of(taus).mean;
    row.extra = fmt::format("tau {:.2f}; per cycle (timed run): draft {:.2f} ms, verify {:.2f} ms; {:.2f}x tg", tau,
                            stat_of(draft_ms).mean, stat_of(verify_ms).mean, row.tok_s.mean / rows[1].tok_s.mean);
    row.j["acceptance_length"] = tau;
    row.j["draft_ms_per_cycle"] = stat_of(draft_ms).mean;
    row.j["verify_ms_per_cycle"] = stat_of(verify_ms).mean;
    row.j["speedup_over_tg"] = row.tok_s.mean / rows[1].tok_s.mean;
    rows.push_back(row);
  }

  // ---- report
  double file_gb = 0;
  for (const auto& t : file.tensors()) file_gb += static_cast<double>(t.nbytes) / 1e9;
  const std::string name = std::filesystem::path(model_path).filename().string();
  if (a.json) {
    nlohmann::json j;
    j["model"] = model_path;
    j["drafter"] = drafter_path;
    j["device"] = a.device;
    j["backend"] = be->name();
    j["tensor_gb"] = file_gb;
    j["load_seconds"] = load_s;
    j["read_bandwidth_gbs"] = floor_gbs;
    for (const Row& r : rows) {
      nlohmann::json o = r.j;
      o["test"] = r.test;
      o["tokens_per_second"] = r.tok_s.mean;
      o["tokens_per_second_sd"] = r.tok_s.sd;
      o[r.verify ? "ms_per_step" : "ms_per_token"] = r.ms_per_tok;
      if (r.gb_s > 0) o["gb_per_second"] = r.gb_s;
      if (r.pct_floor >= 0) o["percent_of_floor"] = r.pct_floor;
      j["rows"].push_back(o);
    }
    fmt::print("{}\n", j.dump(2));
    return;
  }
  fmt::print("model {} ({} {} layers, hidden {}, {:.3f} GB of tensors), drafter {}, backend {}, loaded in {:.1f} s\n",
             model_path, cfg.arch, cfg.n_layer, cfg.n_embd, file_gb, drafter_path.empty() ? "none" : drafter_path,
             be->name(), load_s);
  fmt::print("streaming-read bandwidth measured now: {:.1f} GB/s ({} reps per test)\n\n", floor_gbs, a.reps);
  fmt::print("| model | backend | test | t/s | ms/tok (verify, draft: ms/step) | GB/s | % floor | notes |\n");
  fmt::print("|---|---|---|---:|---:|---:|---:|---|\n");
  for (const Row& r : rows)
    fmt::print("| {} | {} | {} | {} | {:.3f} | {} | {} | {} |\n", name, be->name(), r.test,
               r.verify ? "" : fmt::format("{:.1f} ± {:.1f}", r.tok_s.mean, r.tok_s.sd), r.ms_per_tok,
               r.gb_s > 0 ? fmt::format("{:.1f}", r.gb_s) : "", r.pct_floor >= 0 ? fmt::format("{:.1f}", r.pct_floor) : "",
               r.extra);
}

}  // namespace

void register_bench(CLI::App& app) {
  auto a = std::make_shared<BenchArgs>();
  CLI::App* cmd = app.add_subcommand("bench", "Measure prefill, decode, verify, draft and speculative speed (a table)");
  cmd->add_option("-m,--model", a->model, "target model GGUF (default: the bundled model)");
  cmd->add_option("-d,--drafter", a->drafter, "DFlash drafter GGUF (default: the bundled one with the bundled model)");
  cmd->add_option("--device", a->device, kDeviceHelp);
  cmd->add_option("-t,--threads", a->threads, "CPU threads (0 = all cores)")->check(CLI::Range(0, 1024));
  cmd->add_option("-p,--n-prompt", a->n_prompt, "prompt tokens of the prefill test")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("-n,--n-gen", a->n_gen, "tokens of the decode and speculative tests")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("-u,--ubatch", a->ubatch, "rows per prefill forward (default: 64 on the CPU, 512 on CUDA)")
      ->check(CLI::Range(0, 4096));
  cmd->add_option("--block", a->block, "verify width B (2..8)")->check(CLI::Range(2, 16));
  cmd->add_option("-r,--reps", a->reps, "repetitions of each test")->check(CLI::Range(1, 100));
  cmd->add_option("--depth", a->depth, "tokens already in the cache before each test (llama-bench's -d)")
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_flag("--no-spec", a->no_spec, "skip the speculative test");
  cmd->add_flag("--no-warmup", a->no_warmup, "time the first run of each test too (no untimed warm-up run)");
  cmd->add_flag("--json", a->json, "print the results as JSON");
  cmd->callback([a] { bench(*a); });
}

}  // namespace dflash::cli
