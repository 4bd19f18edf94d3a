// `dflash convert`: a Hugging Face checkpoint (safetensors + config.json [+ tokenizer.json]) of a
// Qwen3.5 hybrid (model_type qwen3_5 / qwen3_5_text) or a dense Qwen3 (qwen3) -> our GGUF, in the
// llama.cpp conventions of SPEC 2.3-2.6, optionally prism-rotated (SPEC 3) and quantized.
//
// What changes between the two layouts (HF -> GGUF):
//   * names: model.layers.N.self_attn.q_proj.weight -> blk.N.attn_q.weight, ... (see convert.cpp);
//   * qwen35 RMSNorm weights are zero-centred in HF ((1 + w) at run time): GGUF stores 1 + w for every
//     *norm.weight except ssm_norm (HF's gated norm multiplies by plain w). qwen3 norms are plain w;
//   * ssm_a = -exp(A_log); ssm_conv1d [C, 1, K] -> ne [K, C];
//   * GDN V heads are TILED (SPEC 2.4): GGUF head g = r * n_k + k holds HF head k * (n_v / n_k) + r.
//     The reorder touches the V rows of attn_qkv, attn_gate, ssm_alpha, ssm_beta, ssm_a, ssm_dt, the V
//     channels of ssm_conv1d and the input columns of ssm_out; with --prism ssm_out keeps its columns
//     in grouped (HF) order, because the runtime permutes its input tiled -> grouped before the
//     Hadamard transform (prism.hadamard.gdn_v_grouped = true).
//   * --prism: every layer matmul except ssm_alpha/ssm_beta, and output.weight, is stored as
//     H_blk(s (.) w_row) (prism/hadamard.h derives it); token_embd rows too (the inverse list). Signs
//     are random +-1 per input width from the seed. The block is 1024, or for small widths the largest
//     power of two <= 1024 dividing every width (written to prism.hadamard.block_size).
//
// Tensors are produced row chunk by row chunk from the memory-mapped checkpoint while the GGUF is
// written (gguf::Writer::add_tensor_rows): the model is never held in memory.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "quant/types.h"

namespace dflash {

struct ConvertOptions {
  // Type of the weight matrices (every 2-D .weight whose row length is a multiple of the type's block;
  // others stay F32). With a block-quantized type ssm_alpha/ssm_beta are BF16, as in Bonsai 2 files.
  GgmlType type = GgmlType::F32;
  bool prism = false;
  uint64_t seed = 1;   // prism sign vectors
  int threads = 0;     // 0: all cores
  std::function<void(const std::string&)> log;  // one line per event (tensor written, notes)
};

struct ConvertReport {
  std::string arch;                 // "qwen35" or "qwen3"
  int64_t n_tensors = 0;
  uint64_t data_bytes = 0;
  int64_t prism_block = 0;          // 0 without --prism
  bool tokenizer = false;           // tokenizer.json was converted
  std::vector<std::string> unused;  // checkpoint tensors that were not converted (vision tower, mtp, ...)
};

// Converts the checkpoint in `hf_dir` to `out_path`. Throws dflash::Error naming the file, key or
// tensor on unsupported architectures, missing or misshapen tensors, unsupported dtypes and malformed
// files.
ConvertReport convert_hf_to_gguf(const std::string& hf_dir, const std::string& out_path, const ConvertOptions& opts);

// ---- pieces exposed for tests and tools

// The HF V head stored at GGUF head position g (tiled order, SPEC 2.4): with r = g / n_k, k = g % n_k,
// returns k * (n_v / n_k) + r.
int64_t tiled_source_head(int64_t g, int64_t n_k_heads, int64_t n_v_heads);
// The largest power of two <= 1024 that divides every width (1 if none larger does).
int64_t prism_block_size(const std::vector<int64_t>& widths);
// The sign vectors for `widths` (in the given order, concatenated) drawn from `seed`.
std::vector<float> prism_sign_values(uint64_t seed, const std::vector<int64_t>& widths);

}  // namespace dflash
