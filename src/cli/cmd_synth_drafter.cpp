// `dflash synth-drafter OUT.gguf`: random-weight DFlash drafters (arch `dflash`) for any target shape.
//
//   dflash synth-drafter d.gguf                         (fits `dflash synth`'s tiny target)
//   dflash synth-drafter d.gguf --target t.gguf         (shaped for an existing target file)
//   dflash synth-drafter d.gguf --preset qwen38-27b     (the 81-tensor Q4_K/Q6_K 27B drafter, ~1.1 GB;
//                                                       with --target, the target is only checked to fit)
//   dflash synth-drafter d.gguf --v1 --layers 1         (a DFlash v1 drafter: no conv, no selector)
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <sstream>

#include "cli/commands.h"
#include "cli/synth_options.h"
#include "gguf/gguf.h"
#include "models/synth_drafter.h"
#include "models/target.h"
#include "util/error.h"

namespace dflash::cli {
namespace {

struct SynthDrafterArgs {
  std::string out;
  std::string preset = "tiny";
  std::string target;
  std::string type, codebook_type;
  std::string taps;
  SynthShapeArgs shape;
  int64_t block = 0, rank = 0, top_k = 0, window = -1, group = 0, kernel = 0, mask = -1;
  double theta = 0;
  uint64_t seed = 7;
  bool v1 = false, causal = false;
};

GgmlType parse_type(const std::string& name) {
  return parse_synth_type(name, "use f32 f16 bf16 q8_0 q4_0 q4_k q5_k q6_k ...");
}

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      v.push_back(std::stoll(item));
    } catch (const std::exception&) {
      fail("--taps: '{}' is not a layer id", item);
    }
  }
  DFLASH_CHECK(!v.empty(), "--taps: no layer ids");
  return v;
}

// `dflash synth`'s tiny target, so that the default pair works together.
SynthTargetSpec tiny_target() {
  SynthTargetSpec t;
  t.n_embd = 256;
  t.n_ff = 512;
  t.head_dim = 64;
  t.n_rot = 16;
  return t;
}

void synth(const SynthDrafterArgs& a) {
  SynthDrafterSpec s;
  if (a.preset == "qwen38-27b") {
    // The published 27B drafter's shape; a --target must fit it (it only names the file to check).
    s = SynthDrafterSpec::qwen38_27b();
    if (!a.target.empty()) {
      const gguf::File f = gguf::File::open(a.target);
      const TargetConfig tc = read_target_config(f);
      const int64_t vocab = f.tensor("token_embd.weight").ne[1];
      DFLASH_CHECK(tc.n_embd == s.n_embd && vocab == s.n_vocab && tc.n_layer > s.target_layers.back(),
                   "synth-drafter: the qwen38-27b preset (hidden {}, vocabulary {}, taps up to layer {}) does not fit "
                   "target {} (hidden {}, vocabulary {}, {} layers); drop --preset to shape the drafter for it",
                   s.n_embd, s.n_vocab, s.target_layers.back(), a.target, tc.n_embd, vocab, tc.n_layer);
    }
  } else if (!a.target.empty()) {
    // Shape the drafter for an existing target: hidden size, vocabulary, layers (taps), rope, mask token.
    const gguf::File f = gguf::File::open(a.target);
    const TargetConfig tc = read_target_config(f);
    SynthTargetSpec t;
    t.n_layer = tc.n_layer;
    t.n_embd = tc.n_embd;
    t.n_vocab = f.tensor("token_embd.weight").ne[1];
    t.rope_theta = tc.rope_theta;
    t.rms_eps = tc.rms_eps;
    t.n_ctx_train = tc.n_ctx_train;
    t.tokenizer = false;
    s = SynthDrafterSpec::for_target(t);
    if (f.has("tokenizer.ggml.mask_token_id")) s.mask_token = static_cast<int32_t>(f.get_int("tokenizer.ggml.mask_token_id"));
  } else {
    DFLASH_CHECK(a.preset == "tiny", "unknown preset '{}' (tiny or qwen38-27b)", a.preset);
    s = SynthDrafterSpec::for_target(tiny_target());
  }
  apply_synth_shape(a.shape, s);
  override_if_set(a.block, s.block_size);
  override_if_set(a.rank, s.selector_rank);
  override_if_set(a.top_k, s.selector_top_k);
  override_if_set(a.group, s.conv_group);
  override_if_set(a.kernel, s.conv_kernel);
  if (a.window >= 0) s.sliding_window = a.window;
  if (a.mask >= 0) s.mask_token = static_cast<int32_t>(a.mask);
  if (a.theta > 0) s.rope_theta = a.theta;
  if (!a.taps.empty()) s.target_layers = parse_list(a.taps);
  if (!a.type.empty()) s.matmul_type = s.heavy_type = parse_type(a.type);
  if (!a.codebook_type.empty()) s.codebook_type = parse_type(a.codebook_type);
  s.dflash2 = !a.v1;
  s.causal = a.causal;
  s.seed = a.seed;

  const double secs =
      timed_synth_write(a.out, [&](const SynthProgress& progress) { synth_drafter(s, a.out, progress); });
  fmt::print("wrote {} ({} drafter, {} layers, hidden {}, vocab {}, taps [{}], {}) in {:.1f} s\n", a.out,
             s.dflash2 ? "DFlash 2" : "DFlash v1", s.n_layer, s.n_embd, s.n_vocab, fmt::join(s.target_layers, ", "),
             type_name(s.matmul_type), secs);
}

}  // namespace

void register_synth_drafter(CLI::App& app) {
  auto a = std::make_shared<SynthDrafterArgs>();
  CLI::App* cmd = app.add_subcommand("synth-drafter", "Write a random-weight DFlash drafter (tests, benchmarks)");
  cmd->add_option("out", a->out, "output GGUF path")->required();
  cmd->add_option("--preset", a->preset, "tiny (fits `dflash synth`'s tiny target, default) or qwen38-27b");
  cmd->add_option("--target", a->target, "shape the drafter for this target GGUF (hidden, vocab, taps, rope)");
  cmd->add_option("--type", a->type, "type of every matmul (default f32; 27B: q4_k with q6_k in layers 2, 4)");
  cmd->add_option("--codebook-type", a->codebook_type, "type of the selector codebooks");
  add_synth_shape_options(cmd, a->shape,
                          {.layers = "drafter layers",
                           .embd = "hidden size (must equal the target's)",
                           .vocab = "vocabulary (must equal the target's)"});
  cmd->add_option("--taps", a->taps, "target layer-input tap ids, comma-separated (SPEC 2.5)");
  cmd->add_option("--block", a->block, "trained block size (default 8)");
  cmd->add_option("--rank", a->rank, "selector rank");
  cmd->add_option("--top-k", a->top_k, "selector top-k");
  cmd->add_option("--conv-kernel", a->kernel, "conv taps (default 2)");
  cmd->add_option("--conv-group", a->group, "channels per dynamic conv coefficient (default 16)");
  cmd->add_option("--window", a->window, "attention sliding window (0: none; default 2048)");
  cmd->add_option("--mask-token", a->mask, "mask token id");
  cmd->add_option("--rope-theta", a->theta, "rope.freq_base (default: the target's, 1e7)");
  cmd->add_option("--ctx", a->shape.ctx, "context_length");
  cmd->add_option("--seed", a->seed, "random seed");
  cmd->add_flag("--v1", a->v1, "a DFlash v1 drafter (no conv, no selector)");
  cmd->add_flag("--causal", a->causal, "causal attention inside the block");
  cmd->callback([a] { synth(*a); });
}

}  // namespace dflash::cli
