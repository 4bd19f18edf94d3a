// The metadata of a DFlash drafter GGUF (arch `dflash`, SPEC 4.1): one writer for every producer —
// `dflash convert` of a z-lab checkpoint (convert_dflash.cpp) and the random-weight drafters of
// synth_drafter.cpp — so the files they write carry the same keys, types and order.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dflash {

namespace gguf {
class Writer;
}

// The drafter's hyper-parameters as written; the comments name the keys ("dflash." prefix omitted).
struct DrafterMetadata {
  std::string name;                    // general.name
  int64_t n_layer = 0;                 // block_count
  int64_t n_ctx = 0;                   // context_length (u32: a caller clamps larger values if it must)
  int64_t n_embd = 0;                  // embedding_length (== the target's hidden size)
  int64_t n_ff = 0;                    // feed_forward_length
  int64_t n_head = 0;                  // attention.head_count
  int64_t n_head_kv = 0;               // attention.head_count_kv
  int64_t head_dim = 0;                // attention.key_length and attention.value_length
  double rms_eps = 1e-6;               // attention.layer_norm_rms_epsilon (f32)
  double rope_theta = 0;               // rope.freq_base (f32)
  int64_t block_size = 0;              // block_size
  std::vector<int64_t> target_layers;  // target_layers (i32): layer-INPUT tap ids (SPEC 2.5)
  bool dflash2 = false;                // DFlash 2: writes the four conv / selector keys below
  int64_t conv_kernel = 0;             // conv_kernel_size
  int64_t conv_group = 0;              // conv_group_size
  int64_t selector_rank = 0;           // selector_rank
  int64_t selector_top_k = 0;          // selector_top_k
  int64_t sliding_window = 0;          // attention.sliding_window; 0: no key
  bool causal = false;                 // attention.causal
  int64_t n_vocab = 0;                 // vocab_size; 0: no key
  int64_t mask_token = 0;              // tokenizer.ggml.mask_token_id (u32)
};

// Sets general.architecture = "dflash", general.name, general.type = "model" and the dflash.* keys
// above, in that order. Integers are stored as u32 / i32 as given (no range check: the producers
// have checked their sizes).
void write_drafter_metadata(gguf::Writer& w, const DrafterMetadata& m);

}  // namespace dflash
