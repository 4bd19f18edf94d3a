// Target models: the LLMs that DFlash speculates for (qwen35 hybrid, qwen3 dense).
//
// A TargetModel owns its weights (on a Backend) and ONE sequence's state: the KV cache of the
// attention layers and the conv + recurrent state of the Gated DeltaNet layers. forward() appends M
// rows at positions n_past()..n_past()+M-1; rollback() undoes the tail of the last forward so that
// the state equals that of a run that never saw those rows (SPEC 5.2).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gguf/gguf.h"
#include "ops/backend.h"

namespace dflash {

// Hyper-parameters, read from "<arch>.*" metadata (SPEC 2.2). Names follow the GGUF keys.
struct TargetConfig {
  std::string arch;            // "qwen35" or "qwen3"
  int64_t n_layer = 0;         // block_count
  int64_t n_embd = 0;          // embedding_length (hidden)
  int64_t n_ff = 0;            // feed_forward_length
  int64_t n_vocab = 0;         // rows of token_embd
  int64_t n_ctx_train = 0;     // context_length
  int64_t n_head = 0;          // attention.head_count
  int64_t n_head_kv = 0;       // attention.head_count_kv
  int64_t head_dim = 0;        // attention.key_length (== value_length)
  float rms_eps = 1e-6f;       // attention.layer_norm_rms_epsilon
  float rope_theta = 1e7f;     // rope.freq_base
  int64_t n_rot = 0;           // rope.dimension_count (64 of 256 for qwen35; head_dim for qwen3)
  bool attn_output_gate = false;  // qwen35: attn_q holds [q | gate] per head
  // Gated DeltaNet (qwen35 only)
  int64_t full_attn_interval = 0;  // layer i is attention iff (i+1) % interval == 0; 0 = all attention
  int64_t ssm_conv_kernel = 0;     // ssm.conv_kernel (4)
  int64_t ssm_inner = 0;           // ssm.inner_size = n_v_heads * head_v (6144)
  int64_t ssm_head_k = 0;          // ssm.state_size (128)
  int64_t ssm_v_heads = 0;         // ssm.time_step_rank (48)
  int64_t ssm_k_heads = 0;         // ssm.group_count (16)

  bool is_attention_layer(int64_t il) const {
    return full_attn_interval == 0 || (il + 1) % full_attn_interval == 0;
  }
  int64_t ssm_head_v() const { return ssm_v_heads ? ssm_inner / ssm_v_heads : 0; }
  int64_t ssm_conv_dim() const { return 2 * ssm_k_heads * ssm_head_k + ssm_inner; }
};

struct TargetOptions {
  int64_t n_ctx = 4096;      // KV cache length (clamped to the trained context)
  int64_t max_rows = 0;      // the most rows one forward() processes (prefill chunk size); 0: the
                             // backend's Backend::prefill_rows(); never below max_undo_rows
  std::vector<int64_t> tap_layers;  // layer-input ids whose residual stream forward() returns (SPEC 2.5)
  // The most rows an undoable (verify) forward takes: the GDN layers keep these rows' conv inputs and
  // recurrence updates for rollback (27B: ~80 KiB x 48 layers per row; the state is its own checkpoint).
  // Set it to the drafter's block size.
  int64_t max_undo_rows = 16;
};

enum class LogitRows { kNone, kLast, kAll };

struct ForwardOptions {
  LogitRows logits = LogitRows::kAll;  // which rows get lm_head + argmax
  bool want_logits = false;            // also copy logits [rows, n_vocab] to the host
  bool want_taps = false;              // copy taps [M, n_taps * n_embd] to the host
  bool taps_on_device = false;         // with want_taps: leave them in backend memory (device_taps())
  bool undoable = false;               // keep what rollback() needs to undo rows (M <= max_undo_rows)
};

struct ForwardResult {
  std::vector<int32_t> argmax;  // one per row that got logits
  std::vector<float> logits;    // [rows, n_vocab] when want_logits
  std::vector<float> taps;      // [M, n_taps * n_embd] when want_taps (and not taps_on_device)
  std::vector<int32_t> tokens;  // forward_device(): the M input tokens, read back with the argmax
};

class TargetModel {
 public:
  // Loads a qwen35 or qwen3 file; checks every tensor's presence and shape.
  static std::unique_ptr<TargetModel> load(const gguf::File& file, Backend& backend, const TargetOptions& options);
  virtual ~TargetModel() = default;

  virtual const TargetConfig& config() const = 0;
  virtual int64_t n_ctx() const = 0;
  virtual int64_t n_past() const = 0;
  virtual int64_t max_rows() const = 0;
  virtual const std::vector<int64_t>& tap_layers() const = 0;

  // Clears the sequence state (n_past = 0).
  virtual void reset() = 0;
  // Appends tokens (M = tokens.size() <= max_rows) at positions n_past().. and returns what
  // `opts` asks for. Throws dflash::Error when the context would overflow.
  virtual ForwardResult forward(std::span<const int32_t> tokens, const ForwardOptions& opts) = 0;
  // forward() of M tokens already in backend memory (a device-resident draft block): no upload of
  // them, and ForwardResult::tokens brings them back in the same download as the argmax (the one
  // wait of a speculative cycle). Their range is checked after the forward (a bad id throws then).
  virtual ForwardResult forward_device(const int32_t* tokens, int64_t M, const ForwardOptions& opts) = 0;
  // The taps of the last forward that had want_taps and taps_on_device: [M, n_taps * n_embd] in
  // backend memory, valid until the next forward.
  virtual const float* device_taps() const = 0;
  // Keeps the first n_keep (>= 1) rows of the last forward (which must have been undoable) and
  // undoes the rest: afterwards n_past() == position of the last kept row + 1.
  virtual void rollback(int64_t n_keep) = 0;

  // Pieces the drafter shares (SPEC 4.2): the embedding (with the prism inverse rotation) and the
  // lm_head (with the forward rotation). Backend pointers: ids [M], out [M, n_embd]; h [M, n_embd],
  // logits [M, n_vocab].
  virtual void embed(const int32_t* ids, float* out, int64_t M) = 0;
  virtual void lm_head(const float* h, float* logits, int64_t M) = 0;
  virtual Backend& backend() = 0;
};

// Prefills `tokens` in chunks of max_rows; returns the argmax after the last token and, when
// taps_out is given, appends the taps of every row ([n, n_taps * n_embd]); when last_logits is
// given, it receives the logits of the last token ([n_vocab], for sampling).
int32_t prefill(TargetModel& model, std::span<const int32_t> tokens, std::vector<float>* taps_out = nullptr,
                std::vector<float>* last_logits = nullptr);

// prefill() for a drafter on the target's backend: each chunk's taps stay in backend memory and go to
// on_taps(taps [rows, n_taps * n_embd], rows) right after the chunk, before the next one overwrites them.
int32_t prefill_device_taps(TargetModel& model, std::span<const int32_t> tokens,
                            const std::function<void(const float* taps, int64_t rows)>& on_taps,
                            std::vector<float>* last_logits = nullptr);

// Reads the hyper-parameters of a qwen35 / qwen3 file (throws naming the missing key).
TargetConfig read_target_config(const gguf::File& file);

}  // namespace dflash
