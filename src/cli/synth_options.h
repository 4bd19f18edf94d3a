// What `dflash synth` (cmd_synth.cpp) and `dflash synth-drafter` (cmd_synth_drafter.cpp) share: the
// transformer-shape options and how they override a preset, the type parser, and the timed write with
// a progress display. The commands keep their own help texts where the meaning differs (a drafter's
// hidden size and vocabulary must equal its target's).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "quant/types.h"

namespace CLI {
class App;
}

namespace dflash::cli {

// Shape overrides from the command line; 0 (the default) keeps the preset's value.
struct SynthShapeArgs {
  int64_t layers = 0, embd = 0, ff = 0, vocab = 0, heads = 0, heads_kv = 0, head_dim = 0;
  int64_t ctx = 0;  // --ctx: each command registers it itself (it stands elsewhere in their help)
};

// The help texts of the options whose meaning differs between the commands.
struct SynthShapeHelp {
  const char* layers;  // --layers
  const char* embd;    // --embd
  const char* vocab;   // --vocab
};

// Adds --layers --embd --ff --vocab --heads --heads-kv --head-dim (in that order) to `cmd`.
void add_synth_shape_options(CLI::App* cmd, SynthShapeArgs& a, const SynthShapeHelp& help);

// dst = v when v > 0 (the option was given).
inline void override_if_set(int64_t v, int64_t& dst) {
  if (v > 0) dst = v;
}

// Applies the shape overrides to a SynthTargetSpec or SynthDrafterSpec (same field names).
template <typename Spec>
void apply_synth_shape(const SynthShapeArgs& a, Spec& s) {
  override_if_set(a.layers, s.n_layer);
  override_if_set(a.embd, s.n_embd);
  override_if_set(a.ff, s.n_ff);
  override_if_set(a.vocab, s.n_vocab);
  override_if_set(a.heads, s.n_head);
  override_if_set(a.heads_kv, s.n_head_kv);
  override_if_set(a.head_dim, s.head_dim);
  override_if_set(a.ctx, s.n_ctx_train);
}

// The type named `name`, which must have a quantizer; the error lists `choices` ("unknown type 'x'; <choices>").
GgmlType parse_synth_type(const std::string& name, const char* choices);

// Runs write(progress), showing "writing <out>" with a percentage, and returns the seconds it took.
using SynthProgress = std::function<void(uint64_t done, uint64_t total)>;
double timed_synth_write(const std::string& out, const std::function<void(const SynthProgress&)>& write);

}  // namespace dflash::cli
