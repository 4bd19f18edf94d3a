#include "cli/synth_options.h"

#include <CLI/CLI.hpp>

#include <chrono>

#include "cli/load_progress.h"
#include "util/error.h"

namespace dflash::cli {

void add_synth_shape_options(CLI::App* cmd, SynthShapeArgs& a, const SynthShapeHelp& help) {
  cmd->add_option("--layers", a.layers, help.layers);
  cmd->add_option("--embd", a.embd, help.embd);
  cmd->add_option("--ff", a.ff, "feed_forward_length");
  cmd->add_option("--vocab", a.vocab, help.vocab);
  cmd->add_option("--heads", a.heads, "attention heads");
  cmd->add_option("--heads-kv", a.heads_kv, "attention KV heads");
  cmd->add_option("--head-dim", a.head_dim, "attention head dim");
}

GgmlType parse_synth_type(const std::string& name, const char* choices) {
  auto t = type_from_name(name);
  DFLASH_CHECK(t && type_traits(*t).has_codec, "unknown type '{}'; {}", name, choices);
  return *t;
}

double timed_synth_write(const std::string& out, const std::function<void(const SynthProgress&)>& write) {
  const auto t0 = std::chrono::steady_clock::now();
  PercentProgress progress("writing " + out);
  write(SynthProgress(std::ref(progress)));
  progress.finish();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace dflash::cli
