// `dflash convert` for DFlash drafters: a z-lab checkpoint (config.json with architectures
// DFlashDraftModel / DFlash2DraftModel + safetensors) -> our `dflash` GGUF (SPEC 4.1).
//
// What changes between the two layouts (HF -> GGUF):
//   * names: fc.weight (same), hidden_norm -> enc.output_norm, norm -> output_norm,
//     layers.N.input_layernorm / post_attention_layernorm -> blk.N.attn_norm / ffn_norm,
//     self_attn.{q,k,v,o}_proj -> attn_{q,k,v,output}, {q,k}_norm -> attn_{q,k}_norm,
//     mlp.{gate,up,down}_proj -> ffn_{gate,up,down},
//     attention_conv / mlp_conv .base_kernel [2, K, H] -> attn_conv_base / ffn_conv_base (ne [H, K, 2]),
//       .kernel_projection.weight [2*K*G, H] -> attn_conv_proj.weight / ffn_conv_proj.weight,
//     candidate_selector.hidden_projection.weight [R, H] -> selector_hidden.weight (ne [H, R]),
//     candidate_selector.{predecessor,successor}_codebook[.weight] [V, R] -> selector_{predecessor,successor}.weight;
//   * dflash_config.target_layer_ids are layer OUTPUT ids (z-lab reads hidden_states[id + 1]): the GGUF
//     key dflash.target_layers stores layer-INPUT ids, id + 1 (SPEC 2.5);
//   * RMSNorm weights are plain Qwen3 weights (x * w): stored as they are (no 1 + w);
//   * the attention pattern: dflash.attention.sliding_window from layer_types / sliding_window (one type
//     for every layer), dflash.attention.causal from is_causal (z-lab's default: causal iff the layers
//     are sliding_attention).
// Options the runtime does not implement (input_embedding_scale != 1, output_multiplier != 1, a logit
// softcap, RoPE scaling, attention bias) are rejected with an error naming the config key.
#pragma once

#include <string>

#include "models/convert.h"

namespace dflash {

// True when `hf_dir`/config.json names a DFlash drafter architecture (or has a dflash_config).
bool is_dflash_checkpoint(const std::string& hf_dir);

// Converts a drafter checkpoint. opts.type applies to the weight matrices (and the selector codebooks)
// whose row length is a multiple of the type's block; norms and conv bases stay F32. No prism rotation
// (drafters are not rotated; they share the target's rotated embedding and head at run time).
ConvertReport convert_dflash_to_gguf(const std::string& hf_dir, const std::string& out_path,
                                     const ConvertOptions& opts);

}  // namespace dflash
