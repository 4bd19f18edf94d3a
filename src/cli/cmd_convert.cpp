// `dflash convert HF_DIR OUT.gguf [--type T] [--prism] [--seed S]`: a Hugging Face checkpoint
// (safetensors, config.json, tokenizer.json) of a Qwen3.5 hybrid or a dense Qwen3 -> our GGUF
// (src/models/convert.h says what changes between the two layouts).
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "models/convert.h"
#include "models/convert_dflash.h"
#include "util/error.h"

namespace dflash::cli {
namespace {

struct ConvertCliOptions {
  std::string in, out, type = "f32";
  bool prism = false;
  uint64_t seed = 1;
  int threads = 0;
  bool quiet = false;
};

std::string codec_names() {
  std::string names;
  for (uint32_t id = 0; id < 256; ++id) {
    const TypeTraits* t = type_traits(id);
    if (t && t->has_codec) names += (names.empty() ? "" : ", ") + std::string(t->name);
  }
  return names;
}

void run_convert(const ConvertCliOptions& o) {
  const auto type = type_from_name(o.type);
  if (!type || !type_traits(*type).has_codec) fail("unknown type '{}': expected one of {}", o.type, codec_names());
  ConvertOptions opts;
  opts.type = *type;
  opts.prism = o.prism;
  opts.seed = o.seed;
  opts.threads = o.threads;
  if (!o.quiet) opts.log = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  // DFlash drafter checkpoints (z-lab DFlashDraftModel / DFlash2DraftModel) have their own converter.
  const ConvertReport r =
      is_dflash_checkpoint(o.in) ? convert_dflash_to_gguf(o.in, o.out, opts) : convert_hf_to_gguf(o.in, o.out, opts);
  fmt::print("{}: {} {} tensors, {:.1f} MiB of tensor data, type {}{}{}\n", o.out, r.arch, r.n_tensors,
             static_cast<double>(r.data_bytes) / (1024.0 * 1024.0), type_name(*type),
             r.prism_block ? fmt::format(", prism-rotated (block {})", r.prism_block) : "",
             r.tokenizer ? ", with tokenizer" : "");
}

}  // namespace

void register_convert(CLI::App& app) {
  auto o = std::make_shared<ConvertCliOptions>();
  CLI::App* sub = app.add_subcommand("convert", "Convert a Hugging Face Qwen3.5 / Qwen3 checkpoint or a DFlash drafter to GGUF");
  sub->add_option("hf_dir", o->in, "Hugging Face model folder (config.json, *.safetensors, tokenizer.json)")->required();
  sub->add_option("out", o->out, "Output GGUF file")->required();
  sub->add_option("--type,-t", o->type,
                  "Type of the weight matrices (default f32; " + codec_names() +
                      "). Matrices whose row length is not a multiple of the type's block stay f32");
  sub->add_flag("--prism", o->prism, "Hadamard-rotate the weights as in Ternary Bonsai 2 files (SPEC 3)");
  sub->add_option("--seed", o->seed, "Seed of the prism sign vectors (default 1)");
  sub->add_option("--threads,-j", o->threads, "Threads (default: all cores)");
  sub->add_flag("--quiet,-q", o->quiet, "No per-tensor progress on stderr");
  sub->callback([o] { run_convert(*o); });
}

}  // namespace dflash::cli
