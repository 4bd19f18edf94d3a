// `dflash run`: generation from a prompt, plain or speculative (when a drafter is given): greedy, or
// sampled with --temp > 0 (--top-k, --top-p, --min-p, --seed).
//
//   dflash run [-m TARGET] -p PROMPT [-n N] [--raw] [--system S] [--no-think] [--json]
//   dflash run -m TARGET --tokens 1,2,3 [-n N] [--json]         (token ids in, ids out)
//   dflash run -m TARGET -d DRAFTER [--block B] [--no-spec] ...   (DFlash speculative decoding; the
//                                                                 bundled pair uses its drafter by default)
//   dflash run [-m TARGET] --chat [--system S] [-p FIRST] [--stats]  (interactive multi-turn chat: one
//                                                                 user message per stdin line; /exit or EOF ends)
//
// With a tokenizer and a chat template in the model, -p is the user turn of a chat (like vLLM's
// chat endpoint); --raw sends the prompt text as it is. Text streams to stdout as it is decoded.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <unistd.h>

#include "cli/backend_select.h"
#include "cli/commands.h"
#include "cli/load_progress.h"
#include "cli/model_paths.h"
#include "gguf/gguf.h"
#include "models/dflash_drafter.h"
#include "models/target.h"
#include "spec/engine.h"
#include "text/chat.h"
#include "text/token_ids.h"
#include "text/tokenizer.h"
#include "util/error.h"

namespace dflash::cli {
namespace {

struct RunArgs {
  std::string model;
  std::string prompt;
  std::string prompt_file;
  std::string tokens;
  std::string system;
  int64_t max_tokens = 128;
  int64_t n_ctx = 4096;
  int threads = 0;
  std::string device = "cpu";
  bool raw = false;
  bool no_think = false;
  bool json = false;
  // speculative decoding
  std::string drafter;
  bool no_spec = false;
  int64_t block = 8;
  std::string draft_context = "reference";
  std::string dump_logits;  // --dump-logits PATH (the HF oracle, tools/oracle_transformers.py)
  bool chat = false;        // --chat: multi-turn REPL on stdin
  bool stats = false;       // --stats: acceptance / timing summary on stderr
  SamplingParams sampling;  // --temp > 0: sampled decoding (speculative sampling with a drafter)
  std::optional<uint64_t> seed;  // --seed; without it a fresh one each run
};

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  DFLASH_CHECK(in.good(), "cannot open prompt file '{}'", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// --dump-logits: one teacher-forced pass over the prompt; row i holds the logits after prompt[0..i]
// (raw little-endian f32, [n_prompt, n_vocab]). The sequence state is reset afterwards.
void dump_prompt_logits(TargetModel& model, const std::vector<int32_t>& prompt, const std::string& path) {
  std::ofstream out(path, std::ios::binary);
  DFLASH_CHECK(out.good(), "--dump-logits: cannot create '{}'", path);
  model.reset();
  for (size_t i = 0; i < prompt.size(); i += static_cast<size_t>(model.max_rows())) {
    const size_t m = std::min<size_t>(static_cast<size_t>(model.max_rows()), prompt.size() - i);
    ForwardOptions fo;
    fo.logits = LogitRows::kAll;
    fo.want_logits = true;
    const ForwardResult r = model.forward(std::span<const int32_t>(prompt).subspan(i, m), fo);
    out.write(reinterpret_cast<const char*>(r.logits.data()), static_cast<std::streamsize>(r.logits.size() * 4));
  }
  DFLASH_CHECK(out.good(), "--dump-logits: writing '{}' failed", path);
  model.reset();
}

// --stats: where the time went and how the drafts fared, on stderr.
void print_stats(const GenerateStats& st, bool speculative) {
  const int64_t prefilled = st.prompt_tokens - st.reused_tokens;
  fmt::print(stderr, "[stats] prompt {} tokens ({} reused from the cache, {} prefilled in {:.3f} s = {:.1f} tok/s)\n",
             st.prompt_tokens, st.reused_tokens, prefilled, st.prefill_seconds,
             st.prefill_seconds > 0 ? prefilled / st.prefill_seconds : 0.0);
  fmt::print(stderr, "[stats] generated {} tokens in {:.3f} s = {:.1f} tok/s ({})\n", st.generated, st.decode_seconds,
             st.decode_seconds > 0 && st.generated > 1 ? (st.generated - 1) / st.decode_seconds : 0.0,
             st.stopped_by_token ? "end of turn" : st.context_full ? "context full" : "max tokens");
  if (!speculative || st.cycles == 0) return;
  fmt::print(stderr, "[stats] {} cycles, acceptance length {:.2f} tokens/cycle, {}/{} drafts accepted ({:.1f}%)\n",
             st.cycles, st.acceptance_length(), st.accepted, st.drafted,
             st.drafted ? 100.0 * st.accepted / st.drafted : 0.0);
  std::string rates;
  for (size_t i = 0; i < st.drafted_at.size(); ++i)
    rates += fmt::format("{}{:.2f}", i ? " " : "", st.acceptance_rate_at(i));
  fmt::print(stderr, "[stats] acceptance by draft position 1..{}: {}\n", st.drafted_at.size(), rates);
  std::vector<int64_t> hist;
  for (int32_t k : st.accepted_per_cycle) {
    if (static_cast<size_t>(k) >= hist.size()) hist.resize(static_cast<size_t>(k) + 1, 0);
    ++hist[static_cast<size_t>(k)];
  }
  std::string h;
  for (size_t k = 0; k < hist.size(); ++k) h += fmt::format("{}{}:{}", k ? " " : "", k, hist[k]);
  fmt::print(stderr, "[stats] cycles by drafts accepted: {}\n", h);
  fmt::print(stderr, "[stats] time: draft {:.3f} s, verify {:.3f} s, other {:.3f} s\n", st.draft_seconds,
             st.verify_seconds, st.other_seconds);
}

// --chat: one user message per stdin line, the reply streamed to stdout (then a newline). Every turn
// renders the whole conversation, and the same Engine reuses its cache for the part the previous
// turn already processed. /exit (or EOF) ends, /reset starts a new conversation. A turn that fails
// (e.g. the conversation outgrew the context) is reported and dropped; the exit status is then 1.
void chat_repl(const RunArgs& a, const gguf::File& file, const text::Tokenizer& tok, Engine& engine,
               GenerateOptions go) {
  const text::ChatTemplate tmpl = text::ChatTemplate::from_gguf(file, tok);
  text::ChatOptions co;
  co.enable_thinking = !a.no_think;
  std::vector<text::ChatMessage> history;
  if (!a.system.empty()) history.push_back({"system", a.system, std::nullopt});
  const bool interactive = ::isatty(STDIN_FILENO) == 1;
  if (interactive)
    fmt::print(stderr, "[chat: {} template; one message per line, /reset for a new conversation, /exit to quit]\n",
               tmpl.name());
  int failed_turns = 0;
  std::string first = a.prompt_file.empty() ? a.prompt : read_text_file(a.prompt_file);
  for (;;) {
    std::string line;
    if (!first.empty()) {
      line.swap(first);
    } else {
      if (interactive) {
        fmt::print(stderr, "> ");
        std::fflush(stderr);
      }
      if (!std::getline(std::cin, line)) break;
      if (!line.empty() && line.back() == '\r') line.pop_back();
    }
    if (line == "/exit" || line == "/quit") break;
    if (line == "/reset") {
      history.resize(a.system.empty() ? 0 : 1);
      engine.reset();
      continue;
    }
    if (line.empty()) continue;
    history.push_back({"user", line, std::nullopt});
    std::string reply;
    try {
      const std::vector<int32_t> prompt = tok.encode(tmpl.render(history, co));
      text::StreamDecoder dec(tok, /*special=*/false);
      auto emit = [&](const std::string& piece) {
        reply += piece;
        std::fwrite(piece.data(), 1, piece.size(), stdout);
        std::fflush(stdout);
      };
      const GenerateStats st = engine.generate(prompt, go, [&](int32_t t) {
        emit(dec.push(t));
        return true;
      });
      emit(dec.flush());
      fmt::print("\n");
      std::fflush(stdout);
      if (a.stats) print_stats(st, go.speculative);
      history.push_back({"assistant", reply, std::nullopt});
    } catch (const Error& e) {
      if (!reply.empty()) fmt::print("\n");
      std::fflush(stdout);
      fmt::print(stderr, "dflash: error: {}\n", e.what());
      history.pop_back();
      engine.reset();
      ++failed_turns;
    }
  }
  if (interactive) fmt::print(stderr, "\n");
  DFLASH_CHECK(failed_turns == 0, "{} chat turn(s) failed", failed_turns);
}

void run(RunArgs a) {
  a.sampling.seed = a.seed ? *a.seed : (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  const std::string model_path = a.model.empty() ? default_target_path() : a.model;
  gguf::File file = gguf::File::open(model_path);
  prefetch_file(file);  // a progress bar while a large file's pages come in
  auto backend = make_backend(a.device, a.threads);
  TargetOptions topts;
  topts.n_ctx = a.n_ctx;
  // The drafter: -d, else the bundled one when the bundled target runs; --no-spec: plain decoding.
  std::string drafter_path = a.drafter;
  if (drafter_path.empty() && a.model.empty()) drafter_path = default_drafter_path().value_or("");
  std::optional<gguf::File> drafter_file;
  if (!drafter_path.empty() && !a.no_spec) {
    drafter_file.emplace(gguf::File::open(drafter_path));
    prefetch_file(*drafter_file);
    const DrafterConfig dc = read_drafter_config(*drafter_file);
    check_drafter_fits_target(dc, drafter_path, read_target_config(file), model_path);
    topts.tap_layers = dc.target_layers;
    topts.max_undo_rows = dc.block_size;
  }
  auto model = TargetModel::load(file, *backend, topts);
  std::unique_ptr<DFlashDrafter> drafter;
  if (drafter_file) {
    DrafterOptions dopts;
    DFLASH_CHECK(a.draft_context == "reference" || a.draft_context == "sink-window",
                 "--draft-context is '{}'; use reference or sink-window", a.draft_context);
    if (a.draft_context == "sink-window") dopts.context = DrafterContextMode::kSinkWindow;
    drafter = DFlashDrafter::load(*drafter_file, *model, dopts);
  }

  std::optional<text::Tokenizer> tok;
  if (file.has("tokenizer.ggml.tokens")) tok.emplace(text::Tokenizer::from_gguf(file));

  if (a.chat) {
    DFLASH_CHECK(tok.has_value(), "{}: --chat needs a model with a tokenizer", model_path);
    DFLASH_CHECK(a.dump_logits.empty(), "--dump-logits does not combine with --chat");
    GenerateOptions go;
    go.max_tokens = a.max_tokens;
    go.speculative = drafter != nullptr;
    go.block = a.block;
    go.sampling = a.sampling;
    go.time_phases = a.stats;  // the draft / verify split of --stats costs a wait after each draft
    go.stop_tokens = tok->eog_ids();
    Engine engine(*model, drafter.get());
    chat_repl(a, file, *tok, engine, go);
    return;
  }

  // ---- the prompt
  std::vector<int32_t> prompt;
  const bool text_prompt = a.tokens.empty();
  if (!text_prompt) {
    prompt = parse_token_ids(a.tokens, "--tokens");
    DFLASH_CHECK(!prompt.empty(), "--tokens: no token ids given");
  } else {
    DFLASH_CHECK(tok.has_value(), "{}: the model has no tokenizer; give the prompt as --tokens ids", model_path);
    std::string text = a.prompt_file.empty() ? a.prompt : read_text_file(a.prompt_file);
    DFLASH_CHECK(!text.empty(), "no prompt: give -p TEXT, -f FILE or --tokens IDS");
    if (!a.raw && file.has("tokenizer.chat_template")) {
      const text::ChatTemplate tmpl = text::ChatTemplate::from_gguf(file, *tok);
      std::vector<text::ChatMessage> msgs;
      if (!a.system.empty()) msgs.push_back({"system", a.system, std::nullopt});
      msgs.push_back({"user", text, std::nullopt});
      text::ChatOptions co;
      co.enable_thinking = !a.no_think;
      text = tmpl.render(msgs, co);
    }
    prompt = tok->encode(text);
  }

  if (!a.dump_logits.empty()) dump_prompt_logits(*model, prompt, a.dump_logits);

  GenerateOptions go;
  go.max_tokens = a.max_tokens;
  go.speculative = drafter != nullptr;
  go.block = a.block;
  go.sampling = a.sampling;
  go.time_phases = a.stats || a.json;  // the draft / verify split costs a wait after each draft
  if (tok) {
    go.stop_tokens = tok->eog_ids();
  } else if (file.has("tokenizer.ggml.eos_token_id")) {
    go.stop_tokens = {static_cast<int32_t>(file.get_int("tokenizer.ggml.eos_token_id"))};
  }

  // ---- generate, streaming
  Engine engine(*model, drafter.get());
  std::vector<int32_t> out;
  std::string text_out;
  std::optional<text::StreamDecoder> dec;
  if (tok && text_prompt) dec.emplace(*tok, /*special=*/false);
  const GenerateStats st = engine.generate(prompt, go, [&](int32_t t) {
    out.push_back(t);
    if (dec) {
      const std::string piece = dec->push(t);
      text_out += piece;
      if (!a.json) {
        std::fwrite(piece.data(), 1, piece.size(), stdout);
        std::fflush(stdout);
      }
    } else if (!a.json) {
      fmt::print("{}{}", out.size() > 1 ? "," : "", t);
      std::fflush(stdout);
    }
    return true;
  });
  if (dec) {
    const std::string tail = dec->flush();
    text_out += tail;
    if (!a.json) std::fwrite(tail.data(), 1, tail.size(), stdout);
  }

  const double gen_tps = st.decode_seconds > 0 ? (st.generated - 1) / st.decode_seconds : 0;
  const double pp_tps = st.prefill_seconds > 0 ? (st.prompt_tokens - st.reused_tokens) / st.prefill_seconds : 0;
  if (a.json) {
    nlohmann::json j;
    j["model"] = model_path;
    j["prompt_tokens"] = st.prompt_tokens;
    j["prompt"] = prompt;
    j["tokens"] = out;
    if (dec) j["text"] = text_out;
    j["finish_reason"] = st.stopped_by_token ? "stop" : "length";
    j["timings"] = {{"prefill_seconds", st.prefill_seconds},   {"decode_seconds", st.decode_seconds},
                    {"prefill_tokens_per_second", pp_tps}, {"decode_tokens_per_second", gen_tps}};
    if (!a.sampling.greedy())
      j["sampling"] = {{"temperature", a.sampling.temperature}, {"top_k", a.sampling.top_k},
                       {"top_p", a.sampling.top_p},             {"min_p", a.sampling.min_p},
                       {"seed", a.sampling.seed}};
    if (drafter) {
      std::vector<double> rate;
      for (size_t i = 0; i < st.drafted_at.size(); ++i) rate.push_back(st.acceptance_rate_at(i));
      j["speculative"] = {{"drafter", drafter_path},
                          {"block", a.block},
                          {"cycles", st.cycles},
                          {"drafted", st.drafted},
                          {"accepted", st.accepted},
                          {"acceptance_length", st.acceptance_length()},
                          {"acceptance_rate_per_position", rate},
                          {"accepted_per_cycle", st.accepted_per_cycle},
                          {"draft_seconds", st.draft_seconds},
                          {"verify_seconds", st.verify_seconds},
                          {"other_seconds", st.other_seconds}};
    }
    fmt::print("{}\n", j.dump(2));
  } else {
    fmt::print("\n");
    fmt::print(stderr, "\n[{} prompt tokens, {:.1f} tok/s prefill; {} generated, {:.1f} tok/s decode; {}]\n",
               st.prompt_tokens, pp_tps, st.generated, gen_tps,
               st.stopped_by_token ? "stopped at end of turn" : st.context_full ? "context full" : "max tokens");
    if (!a.sampling.greedy())
      fmt::print(stderr, "[sampled: temperature {}, top-k {}, top-p {}, min-p {}, seed {}]\n", a.sampling.temperature,
                 a.sampling.top_k, a.sampling.top_p, a.sampling.min_p, a.sampling.seed);
    if (drafter)
      fmt::print(stderr, "[speculative, block {}: {} cycles, {:.2f} tokens per cycle, {}/{} drafts accepted; "
                 "draft {:.3f} s, verify {:.3f} s, other {:.3f} s]\n",
                 a.block, st.cycles, st.acceptance_length(), st.accepted, st.drafted, st.draft_seconds,
                 st.verify_seconds, st.other_seconds);
  }
  if (a.stats) print_stats(st, drafter != nullptr);
}

}  // namespace

void register_run(CLI::App& app) {
  auto a = std::make_shared<RunArgs>();
  CLI::App* cmd = app.add_subcommand("run", "Generate text greedily from a prompt");
  cmd->add_option("-m,--model", a->model, "target model GGUF (default: the bundled model)");
  cmd->add_option("-p,--prompt", a->prompt, "prompt text (a user message when the model has a chat template)");
  cmd->add_option("-f,--file", a->prompt_file, "read the prompt text from a file");
  cmd->add_option("--tokens", a->tokens, "prompt as comma-separated token ids (output as ids)");
  cmd->add_option("-n,--max-tokens", a->max_tokens, "tokens to generate at most")->check(CLI::Range(1, 1 << 24));
  cmd->add_option("-c,--ctx", a->n_ctx, "context length in tokens (prompt + generated)")->check(CLI::Range(16, 1 << 22));
  cmd->add_option("-t,--threads", a->threads, "CPU threads (0 = all cores)")->check(CLI::Range(0, 1024));
  cmd->add_option("--device", a->device, kDeviceHelp);
  cmd->add_option("--system", a->system, "system message for the chat template");
  cmd->add_flag("--raw", a->raw, "send the prompt text as is, without the chat template");
  cmd->add_flag("--no-think", a->no_think, "chat template with thinking switched off");
  cmd->add_flag("--json", a->json, "print token ids, text and timings as JSON");
  cmd->add_option("-d,--drafter", a->drafter, "DFlash drafter GGUF: speculative decoding (same output, faster)");
  cmd->add_flag("--no-spec", a->no_spec, "plain decoding even with a drafter");
  cmd->add_option("--temp", a->sampling.temperature,
                  "sampling temperature (default 0: greedy; > 0 samples, speculative sampling with a drafter)")
      ->check(CLI::Range(0.0, 2.0));
  cmd->add_option("--top-k", a->sampling.top_k, "sample from the k most likely tokens (0: off)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  cmd->add_option("--top-p", a->sampling.top_p, "sample from the smallest set whose mass reaches p (1: off)")
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--min-p", a->sampling.min_p, "drop tokens below min-p x the most likely one's probability")
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--seed", a->seed, "random seed for sampling (same seed, prompt and model: same output; default: a fresh one)");
  cmd->add_option("--block", a->block, "verify block width B (2..8): B-1 drafted tokens per cycle")
      ->check(CLI::Range(2, 64));
  cmd->add_option("--draft-context", a->draft_context,
                  "drafter context: reference (trained 2048 window, default) or sink-window (the seed's 64 + 1024)");
  cmd->add_option("--dump-logits", a->dump_logits,
                  "write the prompt's teacher-forced logits to PATH (raw f32, [prompt tokens, n_vocab])");
  CLI::Option* chat =
      cmd->add_flag("--chat", a->chat,
                    "interactive multi-turn chat: one user message per stdin line (-p: the first), the cache "
                    "reused across turns; /reset starts over, /exit or EOF ends");
  chat->excludes("--tokens")->excludes("--raw")->excludes("--json");
  cmd->add_flag("--stats", a->stats, "print a timing and draft-acceptance summary on stderr (per turn with --chat)");
  cmd->callback([a] { run(*a); });
}

}  // namespace dflash::cli
