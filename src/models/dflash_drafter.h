// The DFlash block drafter (arch `dflash`, SPEC 4): DFlash 2 (grouped dynamic conv + codebook
// selector) and DFlash v1 (neither).
//
// A drafter proposes block_size - 1 tokens in ONE forward over block_size rows [anchor, MASK, ...]:
// its attention keys are context rows projected from the target's tapped hidden states (one row
// per committed position, appended as the target commits them) plus the block itself; the target's
// own embedding and lm_head (with their prism rotations) are shared. Like a TargetModel, a Drafter
// owns ONE sequence's state: its context cache. The selector walk runs on the backend
// (Backend::selector_walk), so a draft can stay in backend memory (draft_device).
//
// Shapes (27B drafter values in comments; every number comes from the file):
//   x, n, u     [B=8, n_embd=5120]              block rows (B = block_size, always the trained size)
//   taps        [rows, n_taps=5 * n_embd]        target features of committed positions
//   Kctx, Vctx  [cap + B, n_head_kv=8, hd=128]   per layer; block keys are written after the context
//   conv coeffs [B, 2 stages * K=2 taps * G=320] G = n_embd / conv_group_size(16)
//   logits      [B-1, n_vocab=248320]            rows 1..B-1 through the target's lm_head
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gguf/gguf.h"
#include "models/target.h"
#include "ops/backend.h"
#include "ops/step_graphs.h"

namespace dflash {

// Hyper-parameters of a `dflash` file (keys "dflash.*", SPEC 4.1).
struct DrafterConfig {
  int64_t n_layer = 0;        // block_count
  int64_t n_embd = 0;         // embedding_length (== the target's hidden size)
  int64_t n_ff = 0;           // feed_forward_length
  int64_t n_head = 0;         // attention.head_count
  int64_t n_head_kv = 0;      // attention.head_count_kv
  int64_t head_dim = 0;       // attention.key_length (== value_length)
  int64_t n_rot = 0;          // rope.dimension_count (default: head_dim, full RoPE)
  float rms_eps = 1e-6f;      // attention.layer_norm_rms_epsilon
  float rope_theta = 1e7f;    // rope.freq_base
  int64_t block_size = 8;     // trained block: the drafter always runs this many rows
  std::vector<int64_t> target_layers;  // layer-INPUT tap ids of the target (SPEC 2.5), in feature order
  int64_t conv_kernel = 0;    // conv_kernel_size (taps K); 0 = no conv (DFlash v1)
  int64_t conv_group = 0;     // conv_group_size: channels sharing one dynamic coefficient
  int64_t selector_rank = 0;  // selector_rank (codebook row length)
  int64_t selector_top_k = 0; // selector_top_k; 0 = no selector (DFlash v1: argmax drafts)
  int64_t sliding_window = 0; // attention.sliding_window; 0 = every context row visible
  bool causal = false;        // attention.causal: block rows see only earlier block rows
  int32_t mask_token = -1;    // tokenizer.ggml.mask_token_id
  int64_t n_vocab = 0;        // codebook rows (DFlash 2); 0 when the file has no vocabulary tensor

  bool dflash2() const { return selector_top_k > 0; }
  int64_t n_taps() const { return static_cast<int64_t>(target_layers.size()); }
  int64_t conv_groups() const { return conv_group ? n_embd / conv_group : 0; }
  int64_t conv_proj_out() const { return 2 * conv_kernel * conv_groups(); }
};

// Reads and checks the hyper-parameters of a drafter file (general.architecture == "dflash").
DrafterConfig read_drafter_config(const gguf::File& file);

// Checks that a drafter can serve a target: hidden size, vocabulary, tap ids (< the target's layer
// count: a tap is the input of a layer), mask token. Throws naming both files and what mismatched.
void check_drafter_fits_target(const DrafterConfig& drafter, const std::string& drafter_name,
                               const TargetConfig& target, const std::string& target_name);

// The selector's greedy walk (SPEC 4.2 step 6), on the host: the reference for Backend::selector_walk. For each row p (0-based, = block row p+1):
//   S[k] = unary[p][k] + sum_r pred[prev][r] * g[p][r] * succ[cand[p][k]][r],  draft_p = cand[p][argmax S]
// starting with prev = anchor (ties: the lowest k). `row(which, token, out)` writes codebook row
// `token` (which 0 = predecessor, 1 = successor) as `rank` floats. Returns `rows` tokens.
template <typename RowFn>
std::vector<int32_t> selector_walk(int32_t anchor, int64_t rows, int64_t top_k, int64_t rank, const int32_t* cand,
                                   const float* unary, const float* g, RowFn&& row);

// The drafter's context cache policy (SPEC 4.3).
enum class DrafterContextMode {
  kReference,   // the trained semantics: keep the last window-1 rows, mask by absolute position
  kSinkWindow,  // the seed's / MLX runtime's: the first `sink` rows + the last `window` rows
};

struct DrafterOptions {
  DrafterContextMode context = DrafterContextMode::kReference;
  int64_t sink = 64;       // kSinkWindow only
  int64_t window = 1024;   // kSinkWindow only
  int64_t append_chunk = 64;   // context rows projected per batch (scratch size)
  int64_t context_slack = 256; // kReference: rows stored beyond window-1 before old rows are dropped
};

// The abstract drafter the engine drives (tests plug in scripted drafters).
class Drafter {
 public:
  virtual ~Drafter() = default;
  // Rows of one drafter forward; the engine verifies at most this many rows per cycle.
  virtual int64_t block_size() const = 0;
  // Positions 0..context_end()-1 have been appended; the next block's anchor sits at context_end().
  virtual int64_t context_end() const = 0;
  virtual void reset_context() = 0;
  // Appends the target features of positions context_end()..+rows: taps [rows, n_taps * n_embd] (host).
  virtual void append_context(std::span<const float> taps, int64_t rows) = 0;
  // Proposes block_size() - 1 tokens for the block whose anchor `anchor` sits at context_end().
  virtual std::vector<int32_t> draft(int32_t anchor) = 0;

  // Device-resident drafting (a greedy speculative cycle whose drafts never visit the host; the
  // engine then waits once per cycle, for the verify's result). A drafter that supports it runs on
  // the target's backend and overrides all three.
  virtual bool drafts_on_device() const { return false; }
  // draft() without the download: [anchor, d_1 .. d_{block_size()-1}] in backend memory, valid until
  // the next draft. Enqueued work only: the host does not wait.
  virtual const int32_t* draft_device(int32_t anchor);
  // append_context() from backend memory: taps [rows, n_taps * n_embd] on the target's backend.
  virtual void append_context_device(const float* taps, int64_t rows);
  // Of a batch of appended rows, the trailing ones that can still matter (a sliding window, or sink +
  // window; INT64_MAX when every row stays visible). append_context() of n rows is the same as
  // skip_context(n - keep) then appending the last keep rows, so a prompt fed in chunks need not
  // project its older rows.
  virtual int64_t context_keep() const { return INT64_MAX; }
  // Advances the context past `rows` positions without their features (only as described above).
  virtual void skip_context(int64_t rows);
};

// What one DFlash forward computed, kept for tests and the oracle (host copies).
struct DraftTrace {
  int64_t position = 0;               // P, the anchor's position
  std::vector<float> hidden;          // [B, n_embd] after output_norm (rows 0..B-1; keep_trace only)
  std::vector<float> logits;          // [B-1, n_vocab] (keep_trace only)
  std::vector<int32_t> candidates;    // [B-1, top_k] (DFlash 2) sorted by logit, descending
  std::vector<float> candidate_logits;  // [B-1, top_k]
  std::vector<float> selector_hidden;   // [B-1, rank]: g = selector_hidden . h_p
  std::vector<int32_t> tokens;        // [B-1] the proposals
};

class DFlashDrafter final : public Drafter {
 public:
  // Loads a drafter for `target` (which must have been loaded with tap_layers = the drafter's
  // target_layers). The file must outlive the drafter (weights and codebooks are read in place on
  // the CPU backend). Weights keep their file types, the selector codebooks too (rows are gathered
  // with get_rows for the walk).
  static std::unique_ptr<DFlashDrafter> load(const gguf::File& file, TargetModel& target,
                                             const DrafterOptions& options = {});
  ~DFlashDrafter() override;

  const DrafterConfig& config() const { return cfg_; }
  int64_t block_size() const override { return cfg_.block_size; }
  int64_t context_end() const override { return ctx_end_; }
  // Context rows currently stored (after eviction), and their positions (ascending).
  int64_t context_rows() const { return static_cast<int64_t>(ctx_pos_.size()); }
  const std::vector<int64_t>& context_positions() const { return ctx_pos_; }
  void reset_context() override;
  void append_context(std::span<const float> taps, int64_t rows) override;
  std::vector<int32_t> draft(int32_t anchor) override;
  bool drafts_on_device() const override { return true; }
  const int32_t* draft_device(int32_t anchor) override;
  void append_context_device(const float* taps, int64_t rows) override;
  int64_t context_keep() const override;
  void skip_context(int64_t rows) override;

  // Diagnostics: the last draft's trace (candidates, selector inputs, tokens; hidden states and
  // logits only with set_keep_trace(true), since they cost a download per draft).
  const DraftTrace& last_trace() const { return trace_; }
  void set_keep_trace(bool keep) { keep_trace_ = keep; }
  // Key range [lo, hi) of block row i for a block at position P over the stored context rows
  // (context rows are indices 0..context_rows()-1, block keys follow them).
  std::pair<int32_t, int32_t> key_range(int64_t P, int64_t i) const;

 private:
  DFlashDrafter(const gguf::File& file, TargetModel& target, const DrafterOptions& options);
  struct Layer;
  void load_weights(const gguf::File& file);
  void allocate();
  // taps: host memory, or backend memory when on_device
  void append_rows(const float* taps, bool on_device, int64_t rows);
  void append_chunk(const float* taps, bool on_device, int64_t rows);
  void evict(int64_t incoming);
  void move_rows(int64_t dst, int64_t src, int64_t n);
  // The draft's ops after its inputs are uploaded: embedding .. top-k and selector features.
  void draft_ops();
  Backend::AttentionPrep kv_prep(Layer& w, int64_t n_head, const int32_t* slots, int64_t rows);

  TargetModel& target_;
  Backend& be_;
  BackendArena arena_;  // every backend allocation (released even if loading throws)
  DrafterConfig cfg_;
  DrafterOptions opts_;
  std::string name_;
  std::vector<Layer> layers_;
  WeightRef fc_, sel_hidden_;
  WeightRef sel_pred_, sel_succ_;  // selector codebooks [n_vocab rows of selector_rank] (DFlash 2)
  float* enc_norm_ = nullptr;     // [n_embd]
  float* out_norm_ = nullptr;     // [n_embd]

  // context cache
  int64_t cap_ = 0;               // context rows the K/V buffers hold (block rows come after)
  int64_t keep_ = 0;              // rows kept after an eviction (kReference: window-1)
  int64_t ctx_end_ = 0;
  std::vector<int64_t> ctx_pos_;  // position of each stored row (ascending)

  // scratch (backend)
  int32_t* d_ids_ = nullptr;      // [B]
  int32_t* d_pos_ = nullptr;      // [max(B, chunk)]
  int32_t* d_range_ = nullptr;    // [B, 2]
  int32_t* d_slot_ = nullptr;     // [B] K/V store rows of the block's keys (context rows .. + B - 1)
  int32_t* d_ctx_slot_ = nullptr; // [chunk] K/V store rows of appended context rows
  float *kb_ = nullptr, *vb_ = nullptr;  // [max(B, chunk), n_head_kv*hd] new keys / values (block or append)
  int32_t* d_topk_ids_ = nullptr; // [B-1, top_k]
  float *d_topk_vals_ = nullptr;  // [B-1, top_k]
  float *taps_ = nullptr, *c_ = nullptr;  // [chunk, n_taps*n_embd], [chunk, n_embd]
  float *x_ = nullptr, *n_ = nullptr, *u_ = nullptr, *o_ = nullptr;  // [B, n_embd]
  float *dyn_ = nullptr;          // [B, 2*K*G]
  float *q_ = nullptr, *attn_ = nullptr;  // [B, n_head*hd]
  float *gate_ = nullptr, *up_ = nullptr, *act_ = nullptr;  // [B, n_ff]: gate, up, swiglu(gate, up)
  float *logits_ = nullptr;       // [B-1, n_vocab], after head_extra_ rows the head also writes
  int64_t head_extra_ = 0;        // rows before row 1 the lm_head also takes (Backend::matmul_rows_for)
  float *g_ = nullptr;            // [B-1, rank]
  float *pred_rows_ = nullptr;    // [1 + (B-2) * top_k, rank] gathered predecessor rows (Backend::selector_walk)
  float *succ_rows_ = nullptr;    // [(B-1) * top_k, rank] gathered successor rows
  int32_t* d_block_ = nullptr;    // [B] the verify block: anchor, then the B-1 drafts
  bool keep_trace_ = false;
  DraftTrace trace_;
  StepGraphCache graphs_{be_};  // the draft step as a graph (CUDA)
};

// ---------------------------------------------------------------------------------------------
// selector_walk (template: tests call it with their own row lookups)

template <typename RowFn>
std::vector<int32_t> selector_walk(int32_t anchor, int64_t rows, int64_t top_k, int64_t rank, const int32_t* cand,
                                   const float* unary, const float* g, RowFn&& row) {
  std::vector<int32_t> path(static_cast<size_t>(rows));
  std::vector<float> pred(static_cast<size_t>(rank)), succ(static_cast<size_t>(rank)), pg(static_cast<size_t>(rank));
  int32_t prev = anchor;
  for (int64_t p = 0; p < rows; ++p) {
    row(0, prev, pred.data());
    for (int64_t r = 0; r < rank; ++r) pg[r] = pred[r] * g[p * rank + r];
    int64_t best = 0;
    float best_score = 0.0f;
    for (int64_t k = 0; k < top_k; ++k) {
      const int32_t tok = cand[p * top_k + k];
      row(1, tok, succ.data());
      float e = 0.0f;
      for (int64_t r = 0; r < rank; ++r) e += pg[r] * succ[r];
      const float s = unary[p * top_k + k] + e;
      if (k == 0 || s > best_score) {
        best = k;
        best_score = s;
      }
    }
    prev = cand[p * top_k + best];
    path[p] = prev;
  }
  return path;
}

}  // namespace dflash
