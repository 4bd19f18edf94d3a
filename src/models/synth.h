// Random-weight target models of any qwen35 / qwen3 shape: tiny ones for tests, the full Ternary
// Bonsai 2 27B layout (851 tensors, PTQ1_0 or PQ2_0, prism metadata) for benchmarks.
//
// Values are a deterministic function of (seed, tensor name, row), so a file is reproducible and
// can be written in row chunks by several threads.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "quant/types.h"

namespace dflash {

struct SynthTargetSpec {
  std::string arch = "qwen35";  // "qwen35" (hybrid) or "qwen3" (dense)
  int64_t n_layer = 4;
  int64_t n_embd = 64;
  int64_t n_ff = 128;
  int64_t n_vocab = 512;
  int64_t n_head = 4;
  int64_t n_head_kv = 2;
  int64_t head_dim = 16;
  int64_t n_rot = 8;             // qwen35: partial RoPE; qwen3 uses head_dim
  int64_t n_ctx_train = 4096;
  double rope_theta = 1e7;
  double rms_eps = 1e-6;
  int64_t full_attn_interval = 4;
  int64_t ssm_conv_kernel = 4;
  int64_t ssm_k_heads = 2;
  int64_t ssm_v_heads = 4;
  int64_t ssm_head_k = 16;
  int64_t ssm_head_v = 16;
  GgmlType matmul_type = GgmlType::F32;  // every layer matmul + token_embd + output
  GgmlType alpha_beta_type = GgmlType::F32;
  bool tied_output = false;     // omit output.weight (lm_head = token_embd)
  bool prism = false;           // write prism metadata (random signs; the weights are random anyway)
  int64_t prism_block = 1024;   // Hadamard block (1024 in Bonsai files; tiny models may use less)
  bool tokenizer = true;        // byte-level GPT-2 vocabulary (needs n_vocab >= 262)
  uint64_t seed = 1;
  double logit_scale = 4.0;     // output weights scaled up so greedy paths are not near-ties

  // The Ternary Bonsai 2 27B layout of SPEC 2.1-2.3.
  static SynthTargetSpec bonsai_27b(GgmlType matmul_type);
};

// Writes the model to `path`. progress(done_bytes, total_bytes) is called as tensors are written.
void synth_target(const SynthTargetSpec& spec, const std::string& path,
                  const std::function<void(uint64_t, uint64_t)>& progress = {});

// The deterministic value generator (exposed for tests): approximately N(0, 1).
float synth_normal(uint64_t seed, uint64_t index);

}  // namespace dflash
