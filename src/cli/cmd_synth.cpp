// `dflash synth OUT.gguf`: random-weight target models of any qwen35 / qwen3 shape.
//
//   dflash synth tiny.gguf                                   (a small qwen35 with a byte tokenizer)
//   dflash synth bonsai.gguf --preset bonsai-27b --type ptq1_0   (the 851-tensor 27B layout, ~6 GB)
//   dflash synth x.gguf --arch qwen3 --layers 2 --embd 256 --ff 512 --type q8_0
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "cli/commands.h"
#include "cli/synth_options.h"
#include "models/synth.h"
#include "util/error.h"

namespace dflash::cli {
namespace {

struct SynthArgs {
  std::string out;
  std::string preset = "tiny";
  std::string arch;
  std::string type;
  std::string alpha_beta_type;
  SynthShapeArgs shape;
  int64_t rot = 0;
  int64_t ssm_k_heads = 0, ssm_v_heads = 0, ssm_head = 0, interval = 0, prism_block = 0;
  uint64_t seed = 1;
  bool prism = false;
  bool no_prism = false;
  bool no_tokenizer = false;
  bool repeat_layers = false;
  bool tied = false;
};

GgmlType parse_type(const std::string& name) {
  return parse_synth_type(name, "use one of f32 f16 bf16 q8_0 q4_0 q4_k q5_k q6_k tq1_0 tq2_0 q1_0 q2_0 pq2_0 ptq1_0");
}

void synth(const SynthArgs& a) {
  SynthTargetSpec s;
  if (a.preset == "bonsai-27b") {
    s = SynthTargetSpec::bonsai_27b(a.type.empty() ? GgmlType::PTQ1_0 : parse_type(a.type));
  } else {
    DFLASH_CHECK(a.preset == "tiny", "unknown preset '{}' (tiny or bonsai-27b)", a.preset);
    s.n_embd = 256;
    s.n_ff = 512;
    s.head_dim = 64;
    s.n_rot = 16;
    s.ssm_head_k = 32;
    s.ssm_head_v = 64;
    s.prism_block = 256;
  }
  if (!a.arch.empty()) s.arch = a.arch;
  if (s.arch == "qwen3") s.n_rot = s.head_dim;
  if (!a.type.empty()) s.matmul_type = parse_type(a.type);
  if (!a.alpha_beta_type.empty()) s.alpha_beta_type = parse_type(a.alpha_beta_type);
  apply_synth_shape(a.shape, s);
  override_if_set(a.rot, s.n_rot);
  override_if_set(a.ssm_k_heads, s.ssm_k_heads);
  override_if_set(a.ssm_v_heads, s.ssm_v_heads);
  override_if_set(a.ssm_head, s.ssm_head_k);
  override_if_set(a.ssm_head, s.ssm_head_v);
  override_if_set(a.interval, s.full_attn_interval);
  override_if_set(a.prism_block, s.prism_block);
  s.seed = a.seed;
  if (a.prism) s.prism = true;
  if (a.no_prism) s.prism = false;
  s.tokenizer = !a.no_tokenizer;
  s.repeat_layers = a.repeat_layers;
  s.tied_output = a.tied;

  const double secs =
      timed_synth_write(a.out, [&](const SynthProgress& progress) { synth_target(s, a.out, progress); });
  fmt::print("wrote {} ({} {} layers, hidden {}, vocab {}, {}{}) in {:.1f} s\n", a.out, s.arch, s.n_layer, s.n_embd,
             s.n_vocab, type_name(s.matmul_type), s.prism ? ", prism" : "", secs);
}

}  // namespace

void register_synth(CLI::App& app) {
  auto a = std::make_shared<SynthArgs>();
  CLI::App* cmd = app.add_subcommand("synth", "Write a random-weight qwen35 / qwen3 model (tests, benchmarks)");
  cmd->add_option("out", a->out, "output GGUF path")->required();
  cmd->add_option("--preset", a->preset, "tiny (default) or bonsai-27b (the Ternary Bonsai 2 27B layout)");
  cmd->add_option("--arch", a->arch, "qwen35 (hybrid, default) or qwen3 (dense)");
  cmd->add_option("--type", a->type, "type of every layer matmul, token_embd and output (default f32; 27B: ptq1_0)");
  cmd->add_option("--alpha-beta-type", a->alpha_beta_type, "type of ssm_alpha / ssm_beta (27B: bf16)");
  add_synth_shape_options(
      cmd, a->shape, {.layers = "block_count", .embd = "embedding_length (hidden size)", .vocab = "vocabulary size"});
  cmd->add_option("--rope-dims", a->rot, "rotary dims per head (qwen35: partial RoPE)");
  cmd->add_option("--ssm-k-heads", a->ssm_k_heads, "GDN key heads (group_count)");
  cmd->add_option("--ssm-v-heads", a->ssm_v_heads, "GDN value heads (time_step_rank)");
  cmd->add_option("--ssm-head-dim", a->ssm_head, "GDN head dim (key and value)");
  cmd->add_option("--attn-interval", a->interval, "full_attention_interval (qwen35)");
  cmd->add_option("--ctx", a->shape.ctx, "context_length");
  cmd->add_option("--prism-block", a->prism_block, "Hadamard block size of the prism metadata");
  cmd->add_option("--seed", a->seed, "random seed");
  cmd->add_flag("--prism", a->prism, "write prism rotation metadata");
  cmd->add_flag("--no-prism", a->no_prism, "no prism metadata (also for the 27B preset)");
  cmd->add_flag("--no-tokenizer", a->no_tokenizer, "omit the byte-level tokenizer");
  cmd->add_flag("--repeat-layers", a->repeat_layers,
                "later layers of a kind (GDN / attention) repeat the first one's bytes: several times faster to "
                "write, for speed benchmarks (the kernels' work does not depend on the values)");
  cmd->add_flag("--tied", a->tied, "tie output to token_embd (no output.weight)");
  cmd->callback([a] { synth(*a); });
}

}  // namespace dflash::cli
