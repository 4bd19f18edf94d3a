// Random-weight DFlash drafters (arch `dflash`) for any target shape: tiny ones for tests, the
// Qwen3.8-27B DFlash 2 layout of SPEC 4.1 (81 tensors: 45 Q4_K, 4 Q6_K, 32 F32) for benchmarks.
//
// Values are a deterministic function of (seed, tensor name, element), so files are reproducible.
// The conv starts near its training initialisation (tap 0 ~ 1, tap 1 ~ 0, small projection), so
// the drafter's hidden states stay in a sane range; the drafts themselves are of course random.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "models/synth.h"
#include "quant/types.h"

namespace dflash {

struct SynthDrafterSpec {
  int64_t n_layer = 2;
  int64_t n_embd = 64;          // must equal the target's hidden size
  int64_t n_ff = 128;
  int64_t n_head = 4;
  int64_t n_head_kv = 2;
  int64_t head_dim = 16;
  int64_t n_vocab = 512;        // the target's vocabulary (codebook rows)
  int64_t n_ctx_train = 4096;
  double rope_theta = 1e7;
  double rms_eps = 1e-6;
  int64_t block_size = 8;
  std::vector<int64_t> target_layers = {1, 2, 3};  // layer-input tap ids (SPEC 2.5)
  bool dflash2 = true;          // conv + selector; false writes a DFlash v1 drafter
  int64_t conv_kernel = 2;
  int64_t conv_group = 16;
  int64_t selector_rank = 32;
  int64_t selector_top_k = 16;
  int64_t sliding_window = 2048;  // 0: no key
  bool causal = false;
  int32_t mask_token = 259;
  GgmlType matmul_type = GgmlType::F32;     // every matmul (fc, attention, FFN, conv_proj, selector_hidden)
  GgmlType codebook_type = GgmlType::F32;   // selector_predecessor / successor
  GgmlType heavy_type = GgmlType::F32;      // attn_v + ffn_down of the layers in heavy_layers
  std::vector<int64_t> heavy_layers;        // 27B: Q6_K in layers 2 and 4
  uint64_t seed = 7;

  // A drafter shaped for `target` (hidden size, vocabulary, mask token, taps spread over its layers
  // like DFlash training does: round(1 + i (N-4)/4) + 1 for 5 taps when N >= 8).
  static SynthDrafterSpec for_target(const SynthTargetSpec& target);
  // The Qwen3.8-27B DFlash 2 drafter of SPEC 4.1 (for the Ternary Bonsai 2 27B target).
  static SynthDrafterSpec qwen38_27b();
};

// The tensors synth_drafter writes, in file order (name, type, ggml shape), without any data.
struct SynthTensor {
  std::string name;
  GgmlType type;
  std::vector<int64_t> ne;
};
std::vector<SynthTensor> synth_drafter_tensors(const SynthDrafterSpec& spec);

// Writes the drafter to `path`; progress(done_bytes, total_bytes) as tensors are written.
void synth_drafter(const SynthDrafterSpec& spec, const std::string& path,
                   const std::function<void(uint64_t, uint64_t)>& progress = {});

}  // namespace dflash
