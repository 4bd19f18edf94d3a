// Random-weight target models of any qwen35 / qwen3 shape: tiny ones for tests, the full Ternary
// Bonsai 2 27B layout (851 tensors, PTQ1_0 or PQ2_0, prism metadata) for benchmarks.
//
// Values are a deterministic function of (seed, tensor name, row), so a file is reproducible and
// can be written in row chunks by several threads.
#pragma once

#include <cstdint>
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gguf/gguf.h"
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
  // Every later layer of a kind (GDN or attention) gets the first such layer's tensors, byte for byte:
  // the same layout and size, written several times faster (the 27B: ~1/7 of the values drawn). For speed
  // benchmarks, where the kernels' work does not depend on the values; the model itself is then a
  // repetition of two random layers.
  bool repeat_layers = false;

  // The Ternary Bonsai 2 27B layout of SPEC 2.1-2.3.
  static SynthTargetSpec bonsai_27b(GgmlType matmul_type);
};

// Writes the model to `path`. progress(done_bytes, total_bytes) is called as tensors are written.
void synth_target(const SynthTargetSpec& spec, const std::string& path,
                  const std::function<void(uint64_t, uint64_t)>& progress = {});

// The deterministic value generator (exposed for tests): approximately N(0, 1).
float synth_normal(uint64_t seed, uint64_t index);

// Writing random tensors in parallel row chunks (shared by the target and drafter synths).
class SynthTensorWriter {
 public:
  // fill_row(row, out[n]) writes one row's float values; it must be thread-safe and deterministic.
  using RowValues = std::function<void(int64_t row, float* out)>;
  // progress(done_bytes, total_bytes) is called as chunks are written (after every add()).
  SynthTensorWriter(gguf::Writer& writer, std::function<void(uint64_t, uint64_t)> progress) : writer_(writer) {
    shared_->progress = std::move(progress);
  }
  // Queues a tensor; its rows are generated and quantized to `type` when the writer writes. With `keep`,
  // the tensor's bytes are also kept there as they are written (for add_copy).
  void add(const std::string& name, GgmlType type, const std::vector<int64_t>& ne, RowValues fill_row,
           std::shared_ptr<std::vector<uint8_t>> keep = nullptr);
  // Queues a tensor whose bytes are those another tensor of the same type and shape kept (add's `keep`),
  // which must be queued earlier: the writer writes tensors in order.
  void add_copy(const std::string& name, GgmlType type, const std::vector<int64_t>& ne,
                std::shared_ptr<const std::vector<uint8_t>> bytes);

 private:
  struct Shared {
    std::atomic<uint64_t> done{0};
    uint64_t total = 0;
    std::function<void(uint64_t, uint64_t)> progress;
  };
  gguf::Writer& writer_;
  std::shared_ptr<Shared> shared_ = std::make_shared<Shared>();
};

}  // namespace dflash
