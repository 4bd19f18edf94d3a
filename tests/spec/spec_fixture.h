// Tiny synthetic target + drafter pairs for the speculative-decoding tests.
//
// Every test process writes its own files (ctest runs tests as separate processes, maybe in
// parallel), into a per-process temp directory.
#pragma once

#include <gtest/gtest.h>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gguf/gguf.h"
#include "models/dflash_drafter.h"
#include "models/synth.h"
#include "models/synth_drafter.h"
#include "models/target.h"
#include "spec/engine.h"
#include "support/temp_dir.h"

namespace dflash::spec_test {

inline std::string temp_path(const std::string& name) { return dflash::testing::temp_path("spec_test", name); }

// A qwen35 hybrid of 4 layers (3 GDN + 1 attention), hidden 64, vocabulary 96 (no tokenizer).
inline SynthTargetSpec tiny_target(GgmlType type = GgmlType::F32, uint64_t seed = 3) {
  SynthTargetSpec s;
  s.arch = "qwen35";
  s.n_layer = 4;
  s.n_embd = 64;
  s.n_ff = 128;
  s.n_vocab = 96;
  s.n_head = 4;
  s.n_head_kv = 2;
  s.head_dim = 16;
  s.n_rot = 8;
  s.ssm_k_heads = 2;
  s.ssm_v_heads = 4;
  s.ssm_head_k = 16;
  s.ssm_head_v = 16;
  s.full_attn_interval = 4;
  s.matmul_type = type;
  s.tokenizer = false;
  s.seed = seed;
  return s;
}

inline SynthDrafterSpec tiny_drafter(const SynthTargetSpec& t, bool dflash2 = true, uint64_t seed = 11) {
  SynthDrafterSpec d = SynthDrafterSpec::for_target(t);
  d.dflash2 = dflash2;
  d.seed = seed;
  return d;
}

// A loaded pair (files stay mapped while the pair lives).
struct Pair {
  std::unique_ptr<Backend> be;
  std::unique_ptr<gguf::File> target_file, drafter_file;
  std::unique_ptr<TargetModel> target;
  std::unique_ptr<DFlashDrafter> drafter;
};

inline Pair load_pair(const std::string& target_path, const std::string& drafter_path, int64_t max_rows,
                      int64_t n_ctx = 512, const DrafterOptions& dopts = {}) {
  Pair p;
  p.be = make_cpu_backend(1);
  p.target_file = std::make_unique<gguf::File>(gguf::File::open(target_path));
  p.drafter_file = std::make_unique<gguf::File>(gguf::File::open(drafter_path));
  const DrafterConfig dc = read_drafter_config(*p.drafter_file);
  TargetOptions to;
  to.n_ctx = n_ctx;
  to.max_rows = max_rows;
  to.tap_layers = dc.target_layers;
  p.target = TargetModel::load(*p.target_file, *p.be, to);
  p.drafter = DFlashDrafter::load(*p.drafter_file, *p.target, dopts);
  return p;
}

inline std::vector<int32_t> random_tokens(size_t n, uint64_t seed, int32_t vocab) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return t;
}

// Runs one generation and returns the yielded tokens.
inline std::vector<int32_t> run(Engine& e, const std::vector<int32_t>& prompt, const GenerateOptions& o,
                                GenerateStats* stats = nullptr) {
  std::vector<int32_t> out;
  GenerateStats st = e.generate(prompt, o, [&](int32_t t) {
    out.push_back(t);
    return true;
  });
  if (stats) *stats = st;
  return out;
}

}  // namespace dflash::spec_test
