// `dflash draft -m TARGET -d DRAFTER --tokens IDS --out TRACE.json`: one drafter forward after a prompt,
// with everything it computed, for the z-lab oracle (tools/oracle_dflash.py) and for debugging.
//
// The target prefills the prompt with taps; their context rows go to the drafter; the target's argmax
// after the prompt is the anchor; the drafter runs its block at position P = prompt length. The JSON
// holds: position, anchor, block, hidden [B, n_embd] (after output_norm), logits [B-1, n_vocab] (the
// target head on rows 1..B-1), candidates / candidate_logits [B-1, top_k], selector_hidden [B-1, rank]
// (DFlash 2), tokens [B-1] (the proposals), and the drafter context's stored positions.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "gguf/gguf.h"
#include "models/dflash_drafter.h"
#include "models/target.h"
#include "text/token_ids.h"
#include "util/error.h"

namespace dflash::cli {
namespace {

struct DraftArgs {
  std::string model, drafter, tokens, out;
  int64_t n_ctx = 4096;
  int threads = 0;
  std::string context = "reference";
};


void draft(const DraftArgs& a) {
  const gguf::File tf = gguf::File::open(a.model), df = gguf::File::open(a.drafter);
  const DrafterConfig dc = read_drafter_config(df);
  check_drafter_fits_target(dc, a.drafter, read_target_config(tf), a.model);
  auto backend = make_cpu_backend(a.threads);
  TargetOptions to;
  to.n_ctx = a.n_ctx;
  to.tap_layers = dc.target_layers;
  to.max_undo_rows = dc.block_size;
  auto target = TargetModel::load(tf, *backend, to);
  DrafterOptions dopts;
  DFLASH_CHECK(a.context == "reference" || a.context == "sink-window",
               "--draft-context is '{}'; use reference or sink-window", a.context);
  if (a.context == "sink-window") dopts.context = DrafterContextMode::kSinkWindow;
  auto drafter = DFlashDrafter::load(df, *target, dopts);
  drafter->set_keep_trace(true);

  const std::vector<int32_t> prompt = parse_token_ids(a.tokens, "--tokens");
  DFLASH_CHECK(!prompt.empty(), "--tokens: no token ids given");
  std::vector<float> taps;
  const int32_t anchor = prefill(*target, prompt, &taps);
  drafter->append_context(taps, static_cast<int64_t>(prompt.size()));
  drafter->draft(anchor);
  const DraftTrace& t = drafter->last_trace();

  nlohmann::json j;
  j["position"] = t.position;
  j["anchor"] = anchor;
  j["block"] = dc.block_size;
  j["n_embd"] = dc.n_embd;
  j["n_vocab"] = target->config().n_vocab;
  j["top_k"] = dc.selector_top_k;
  j["rank"] = dc.selector_rank;
  j["hidden"] = t.hidden;
  j["logits"] = t.logits;
  j["candidates"] = t.candidates;
  j["candidate_logits"] = t.candidate_logits;
  j["selector_hidden"] = t.selector_hidden;
  j["tokens"] = t.tokens;
  j["context_positions"] = drafter->context_positions();
  std::ofstream out(a.out);
  DFLASH_CHECK(out.good(), "--out: cannot create '{}'", a.out);
  out << j.dump();
  DFLASH_CHECK(out.good(), "--out: writing '{}' failed", a.out);
  fmt::print("anchor {} at position {}: drafts [{}]\n", anchor, t.position, fmt::join(t.tokens, ", "));
}

}  // namespace

void register_draft(CLI::App& app) {
  auto a = std::make_shared<DraftArgs>();
  CLI::App* cmd = app.add_subcommand("draft", "One drafter forward after a prompt, traced to JSON (oracle, debugging)");
  cmd->add_option("-m,--model", a->model, "target model GGUF")->required();
  cmd->add_option("-d,--drafter", a->drafter, "DFlash drafter GGUF")->required();
  cmd->add_option("--tokens", a->tokens, "prompt as comma-separated token ids")->required();
  cmd->add_option("-o,--out", a->out, "output JSON path")->required();
  cmd->add_option("-c,--ctx", a->n_ctx, "context length")->check(CLI::Range(16, 1 << 22));
  cmd->add_option("-t,--threads", a->threads, "CPU threads (0 = all cores)")->check(CLI::Range(0, 1024));
  cmd->add_option("--draft-context", a->context, "reference (default) or sink-window");
  cmd->callback([a] { draft(*a); });
}

}  // namespace dflash::cli
