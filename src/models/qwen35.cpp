// qwen35: the Qwen3.5 / Qwen3.8 hybrid (Gated DeltaNet + gated full attention), as shipped in
// Ternary Bonsai 2 (prism-rotated PTQ1_0 / PQ2_0) and in stock llama.cpp-style GGUF files.
// qwen3 (dense) is the degenerate case: every layer attention, no output gate, full RoPE
// (see qwen3.cpp for its hyper-parameters).
//
// Shapes (27B values in comments; every number comes from the file):
//   x        [M, n_embd=5120]                     residual stream
//   attention: q|gate [M, n_head=24, 2*256], k/v [M, n_head_kv=4, 256], KV cache [n_ctx, 4, 256]
//   GDN:     qkv [M, conv_dim=10240] = q [16 heads x 128] | k [16 x 128] | v [48 x 128]
//            state [48, 128, 128] per layer, conv state [K-1=3, 10240]
//   FFN:     gate/up [M, n_ff=17408]
#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <span>

#include "models/target.h"
#include "models/weights.h"
#include "ops/step_graphs.h"
#include "prism/rotation.h"
#include "util/error.h"

namespace dflash {

// ---------------------------------------------------------------------------------------------
// Hyper-parameters (a missing required key: gguf::File::get_int names it)

TargetConfig read_target_config(const gguf::File& f) {
  TargetConfig c;
  c.arch = f.get_string("general.architecture");
  DFLASH_CHECK(c.arch == "qwen35" || c.arch == "qwen3",
               "{}: general.architecture is '{}'; dflash runs 'qwen35' and 'qwen3' targets", f.path(), c.arch);
  const std::string p = c.arch + ".";
  c.n_layer = f.get_int(p + "block_count");
  c.n_embd = f.get_int(p + "embedding_length");
  c.n_ff = f.get_int(p + "feed_forward_length");
  c.n_ctx_train = f.get_int_or(p + "context_length", 4096);
  c.n_head = f.get_int(p + "attention.head_count");
  c.n_head_kv = f.get_int_or(p + "attention.head_count_kv", c.n_head);
  DFLASH_CHECK(c.n_head > 0 && c.n_head_kv > 0 && c.n_head % c.n_head_kv == 0,
               "{}: attention.head_count {} is not a positive multiple of head_count_kv {}", f.path(), c.n_head,
               c.n_head_kv);
  c.head_dim = f.get_int_or(p + "attention.key_length", c.n_embd / c.n_head);
  const int64_t value_length = f.get_int_or(p + "attention.value_length", c.head_dim);
  DFLASH_CHECK(value_length == c.head_dim, "{}: attention.value_length {} != key_length {} is not supported",
               f.path(), value_length, c.head_dim);
  c.rms_eps = static_cast<float>(f.get_float_or(p + "attention.layer_norm_rms_epsilon", 1e-6));
  c.rope_theta = static_cast<float>(f.get_float_or(p + "rope.freq_base", c.arch == "qwen35" ? 1e7 : 1e6));
  c.n_rot = f.get_int_or(p + "rope.dimension_count", c.head_dim);
  DFLASH_CHECK(c.n_rot > 0 && c.n_rot <= c.head_dim && c.n_rot % 2 == 0,
               "{}: rope.dimension_count {} must be even and <= head dim {}", f.path(), c.n_rot, c.head_dim);
  DFLASH_CHECK(c.n_layer > 0 && c.n_embd > 0 && c.n_ff > 0 && c.head_dim > 0,
               "{}: block_count, embedding_length, feed_forward_length and head dim must be positive", f.path());
  if (c.arch == "qwen35") {
    c.attn_output_gate = true;
    c.full_attn_interval = f.get_int_or(p + "full_attention_interval", 4);
    DFLASH_CHECK(c.full_attn_interval > 0, "{}: full_attention_interval must be positive", f.path());
    c.ssm_conv_kernel = f.get_int(p + "ssm.conv_kernel");
    c.ssm_inner = f.get_int(p + "ssm.inner_size");
    c.ssm_head_k = f.get_int(p + "ssm.state_size");
    c.ssm_v_heads = f.get_int(p + "ssm.time_step_rank");
    c.ssm_k_heads = f.get_int(p + "ssm.group_count");
    DFLASH_CHECK(c.ssm_conv_kernel >= 1 && c.ssm_conv_kernel <= 16, "{}: ssm.conv_kernel {} out of range", f.path(),
                 c.ssm_conv_kernel);
    DFLASH_CHECK(c.ssm_k_heads > 0 && c.ssm_v_heads > 0 && c.ssm_v_heads % c.ssm_k_heads == 0 &&
                     c.ssm_inner % c.ssm_v_heads == 0 && c.ssm_head_k > 0,
                 "{}: GDN sizes inconsistent: group_count {}, time_step_rank {}, inner_size {}, state_size {}",
                 f.path(), c.ssm_k_heads, c.ssm_v_heads, c.ssm_inner, c.ssm_head_k);
  }
  return c;
}

namespace {

// ---------------------------------------------------------------------------------------------
// Weights of one layer (unused members stay invalid / null)

struct LayerWeights {
  bool attention = false;
  float* attn_norm = nullptr;       // [n_embd]
  float* post_attn_norm = nullptr;  // [n_embd]
  // attention
  WeightRef wq, wk, wv, wo;         // q: [n_embd, n_head*hd*(gate?2:1)]
  float* q_norm = nullptr;          // [hd]
  float* k_norm = nullptr;          // [hd]
  // Gated DeltaNet
  WeightRef w_qkv, w_gate, w_alpha, w_beta, w_ssm_out;
  float* conv1d = nullptr;          // [conv_dim, K] (ggml ne = [K, conv_dim])
  float* dt_bias = nullptr;         // [Hv]
  float* ssm_a = nullptr;           // [Hv]
  float* ssm_norm = nullptr;        // [head_v]
  // FFN
  WeightRef ffn_gate, ffn_up, ffn_down;
  // prism: which inputs are rotated
  bool rot_attn_in = false, rot_attn_out = false, rot_ffn_in = false, rot_ffn_down = false;
  bool rot_alpha_beta = false;
};

// Per-layer sequence state.
struct LayerState {
  float* k_cache = nullptr;      // [n_ctx, n_head_kv, hd]
  float* v_cache = nullptr;
  float* conv_state = nullptr;   // [K-1, conv_dim]
  float* ssm_state = nullptr;    // [Hv, head_k, head_v]
  // Undo support for the last undoable forward. The conv: its state before the rows and the rows'
  // inputs, so that rollback(n) rebuilds the window of the n kept rows. The recurrence: an undoable
  // forward leaves ssm_state as it was and records each row's update (k, decay, delta); rollback(n), or
  // the next forward when no rollback came, applies the first n of them (the recurrence's own
  // arithmetic, so the same bits as if the rest had never been seen).
  float* conv_state_before = nullptr;  // [K-1, conv_dim]
  float* conv_inputs = nullptr;        // [max_undo_rows, conv_dim]
  float* undo_q = nullptr;             // [max_undo_rows, Hk*head_k] (l2-normed, scaled)
  float* undo_k = nullptr;             // [max_undo_rows, Hk*head_k] (l2-normed)
  float* undo_g = nullptr;             // [max_undo_rows, Hv] log-decay
  float* undo_beta = nullptr;          // [max_undo_rows, Hv]
  float* undo_delta = nullptr;         // [max_undo_rows, Hv*head_v] the rows' updates
};

constexpr int64_t kChunkedThreshold = 32;  // prefill chunks at least this long use the chunked GDN form
constexpr uint64_t kRollbackKey = 1ull << 50;  // graph keys of rollback(n_keep) (forward keys stay below 2^42)

class Qwen35Model final : public TargetModel {
 public:
  Qwen35Model(const gguf::File& file, Backend& be, const TargetOptions& opts) : be_(be), arena_(be), graphs_(be) {
    cfg_ = read_target_config(file);
    n_ctx_ = std::min<int64_t>(std::max<int64_t>(opts.n_ctx, 1), std::max<int64_t>(cfg_.n_ctx_train, 1));
    max_undo_rows_ = std::max<int64_t>(1, opts.max_undo_rows);
    max_rows_ = std::max(opts.max_rows > 0 ? opts.max_rows : be.prefill_rows(), max_undo_rows_);
    taps_ = opts.tap_layers;
    for (int64_t t : taps_)
      DFLASH_CHECK(t >= 0 && t <= cfg_.n_layer, "tap layer {} is outside 0..{} (the target has {} layers)", t,
                   cfg_.n_layer, cfg_.n_layer);
    load_weights(file);
    allocate_state();
  }


  const TargetConfig& config() const override { return cfg_; }
  int64_t n_ctx() const override { return n_ctx_; }
  int64_t n_past() const override { return n_past_; }
  int64_t max_rows() const override { return max_rows_; }
  const std::vector<int64_t>& tap_layers() const override { return taps_; }
  Backend& backend() override { return be_; }

  void reset() override {
    n_past_ = 0;
    last_start_ = -1;
    last_rows_ = 0;
    last_undoable_ = false;  // its recorded rows are of the sequence being cleared
    for (auto& s : state_) {
      if (s.conv_state) be_.fill_zero(s.conv_state, conv_state_bytes());
      if (s.ssm_state) be_.fill_zero(s.ssm_state, ssm_state_bytes());
    }
  }

  ForwardResult forward(std::span<const int32_t> tokens, const ForwardOptions& opts) override;
  ForwardResult forward_device(const int32_t* tokens, int64_t M, const ForwardOptions& opts) override;
  const float* device_taps() const override { return taps_buf_; }
  void rollback(int64_t n_keep) override;
  void embed(const int32_t* ids, float* out, int64_t M) override;
  void lm_head(const float* h, float* logits, int64_t M) override;

 private:
  // ---- sizes
  int64_t q_width() const { return cfg_.n_head * cfg_.head_dim; }
  int64_t kv_width() const { return cfg_.n_head_kv * cfg_.head_dim; }
  int64_t conv_dim() const { return cfg_.ssm_conv_dim(); }
  size_t conv_state_bytes() const { return sizeof(float) * (cfg_.ssm_conv_kernel - 1) * conv_dim(); }
  size_t ssm_state_elems() const { return (size_t)cfg_.ssm_v_heads * cfg_.ssm_head_k * cfg_.ssm_head_v(); }
  size_t ssm_state_bytes() const { return sizeof(float) * ssm_state_elems(); }

  template <typename T>
  T* alloc(size_t count) {
    return arena_.alloc_array<T>(count);
  }

  void load_weights(const gguf::File& file);
  void allocate_state();
  // Advances the GDN states over the first n_keep rows of the last (undoable) forward and, when rows are
  // dropped, rebuilds the conv windows: the end of rollback(), or of a verify whose rows are all kept
  // (the next forward calls it when no rollback came).
  void keep_undo_rows(int64_t n_keep);
  // Returns x rotated for a matmul with `in` inputs when `rotate` (into scratch), else x itself.
  const float* rotated(const float* x, int64_t M, int64_t in, bool rotate, float* scratch, const int32_t* perm = nullptr);
  // The rotation of a matmul input of width `in` (block 0 when not rotated).
  Backend::Rotation rotation(int64_t in, bool rotate, const int32_t* perm = nullptr) const;
  // x_ += res (when res; res_parts: the parts of a block output, mm_residual), n_ = rms_norm(x_) * norm;
  // returns the matmul input: rot_ (rotated) or n_.
  const float* norm_input(float* res, int res_parts, const float* norm, bool rotate, int64_t M);
  // n: the normed block input; nin: the same rotated for the block's input matmuls (or n). Each block
  // writes its output to y (y_, y_rows_ rows) and returns its parts (mm_residual).
  int attention_block(int il, const float* nin, float* y, int64_t M);
  int gdn_block(int il, const float* n, const float* nin, float* y, int64_t M, bool undoable);
  int ffn_block(int il, const float* nin, float* y, int64_t M);
  // The ops of one forward after its inputs are uploaded: embedding .. argmax (no host waits).
  void forward_ops(int64_t M, const ForwardOptions& opts, int64_t first_logit_row);
  void check_forward(int64_t M, const ForwardOptions& opts) const;
  // The forward of the M ids in d_ids_: positions and key ranges, the ops (a graph for decode and
  // verify shapes), then the downloads `opts` asks for (with the ids too when tokens_back).
  ForwardResult run_forward(int64_t M, const ForwardOptions& opts, bool tokens_back);
  // A block's output y = x . w^T (through the prefill kernel during a long non-undoable chunk). Only the
  // next residual op reads it, so the backend may leave it as partial products (Backend::matmul_parts;
  // the residual op adds them in order: the same bits). y is y_ (y_rows_ rows). Returns the parts.
  int mm_residual(const WeightRef& w, const float* x, float* y, int64_t M) {
    if (prefill_chunk_) {
      be_.matmul_prefill(w, x, y, M);
      return 1;
    }
    return be_.matmul_parts(w, x, y, M, y_rows_);
  }
  // The matmuls that share the input x (one launch on CUDA), through the prefill kernel during a long
  // non-undoable chunk.
  void mm_group(std::initializer_list<Backend::MatmulOut> outs, const float* x, int64_t M) {
    if (prefill_chunk_) {
      be_.matmul_prefill_group(std::span<const Backend::MatmulOut>(outs.begin(), outs.size()), x, M);
    } else {
      be_.matmul_group(std::span<const Backend::MatmulOut>(outs.begin(), outs.size()), x, M);
    }
  }

  Backend& be_;
  BackendArena arena_;  // every backend allocation of the model (released even if loading throws)
  StepGraphCache graphs_;  // decode / verify steps replayed as graphs (CUDA)
  bool prefill_chunk_ = false;
  TargetConfig cfg_;
  int64_t n_ctx_ = 0, max_rows_ = 0, max_undo_rows_ = 0;
  int64_t y_rows_ = 0;  // rows of y_ (>= max_rows_: room for matmul_parts' parts)
  std::vector<int64_t> taps_;

  // global weights
  WeightRef tok_embd_, output_;
  float* output_norm_ = nullptr;
  std::optional<prism::PrismRotation> prism_;
  bool rot_embd_ = false, rot_output_ = false;
  const float* signs_embd_ = nullptr;   // [n_embd] backend copies of the sign vectors by width
  const float* signs_ff_ = nullptr;     // [n_ff]
  const float* signs_q_ = nullptr;      // [n_head*hd] attn_output input
  const float* signs_inner_ = nullptr;  // [ssm_inner]
  int32_t* ssm_out_perm_ = nullptr;     // [ssm_inner] tiled -> grouped (gdn_v_grouped)
  std::vector<LayerWeights> layers_;

  // state
  std::vector<LayerState> state_;
  int64_t n_past_ = 0;
  int64_t last_start_ = -1, last_rows_ = 0;
  bool last_undoable_ = false;
  bool has_gdn_ = false;  // any Gated DeltaNet layer (qwen3: none, nothing to keep or apply)

  // scratch, [max_rows, ...]
  int32_t* d_ids_ = nullptr;     // [max_rows], followed by d_argmax_ (one download reads both)
  int32_t* d_argmax_ = nullptr;  // [max_rows]
  int32_t* d_pos_ = nullptr;
  int32_t* d_kv_range_ = nullptr;  // [max_rows, 2]
  float *x_ = nullptr, *n_ = nullptr, *y_ = nullptr, *rot_ = nullptr, *rot2_ = nullptr;
  float *big0_ = nullptr, *big1_ = nullptr, *big2_ = nullptr;  // [max_rows, max(...)]
  float *q_ = nullptr, *k_ = nullptr, *v_ = nullptr, *gate_ = nullptr, *attn_ = nullptr;
  float *a_ = nullptr, *b_ = nullptr;
  float* logits_ = nullptr;  // [max_rows, n_vocab]
  float* taps_buf_ = nullptr;  // [max_rows, n_taps*n_embd]
};

// ---------------------------------------------------------------------------------------------
// Loading

void Qwen35Model::load_weights(const gguf::File& file) {
  WeightLoader L(file, arena_);
  const int64_t E = cfg_.n_embd;
  const gguf::TensorInfo& te = file.tensor("token_embd.weight");
  DFLASH_CHECK(te.n_dims == 2 && te.ne[0] == E, "{}: tensor 'token_embd.weight' has shape {}, expected [{}, n_vocab]",
               file.path(), te.shape_string(), E);
  cfg_.n_vocab = te.ne[1];
  tok_embd_ = L.matrix("token_embd.weight", E, cfg_.n_vocab);
  output_norm_ = L.vector("output_norm.weight", E);
  // Tied embeddings when output.weight is absent.
  output_ = file.find_tensor("output.weight") ? L.matrix("output.weight", E, cfg_.n_vocab) : tok_embd_;

  prism_ = prism::PrismRotation::from_gguf(file);
  if (prism_) {
    rot_embd_ = prism_->is_inverse("token_embd.weight");
    // A tied lm_head reads the embedding rows, stored as H(s (.) e): H(s (.) e) . H(s (.) h) = e . h, so
    // it takes the forward-rotated input exactly when the embedding is inverse-listed.
    rot_output_ = file.find_tensor("output.weight") ? prism_->is_rotated("output.weight") : rot_embd_;
  }
  auto is_rot = [&](const std::string& name) { return prism_ && prism_->is_rotated(name); };
  auto upload_signs = [&](int64_t width) -> const float* {
    if (!prism_ || !prism_->has_width(width)) return nullptr;
    const std::vector<float>& s = prism_->signs_for_width(width);
    float* d = alloc<float>(s.size());
    be_.upload(d, s.data(), s.size() * sizeof(float));
    return d;
  };

  const int64_t hd = cfg_.head_dim;
  const int64_t q_out = q_width() * (cfg_.attn_output_gate ? 2 : 1);
  layers_.resize(cfg_.n_layer);
  for (int64_t il = 0; il < cfg_.n_layer; ++il) {
    LayerWeights& w = layers_[il];
    const std::string p = "blk." + std::to_string(il) + ".";
    w.attention = cfg_.is_attention_layer(il);
    w.attn_norm = L.vector(p + "attn_norm.weight", E);
    // qwen35 GGUFs name the pre-FFN norm post_attention_norm; qwen3 ffn_norm.
    w.post_attn_norm = file.find_tensor(p + "post_attention_norm.weight") ? L.vector(p + "post_attention_norm.weight", E)
                                                                          : L.vector(p + "ffn_norm.weight", E);
    if (w.attention) {
      w.wq = L.matrix(p + "attn_q.weight", E, q_out);
      w.wk = L.matrix(p + "attn_k.weight", E, kv_width());
      w.wv = L.matrix(p + "attn_v.weight", E, kv_width());
      w.wo = L.matrix(p + "attn_output.weight", q_width(), E);
      w.q_norm = L.vector(p + "attn_q_norm.weight", hd);
      w.k_norm = L.vector(p + "attn_k_norm.weight", hd);
      w.rot_attn_in = is_rot(p + "attn_q.weight");
      DFLASH_CHECK(w.rot_attn_in == is_rot(p + "attn_k.weight") && w.rot_attn_in == is_rot(p + "attn_v.weight"),
                   "{}: prism.hadamard.weight_names rotates only some of {}attn_q/k/v; they share one input",
                   file.path(), p);
      w.rot_attn_out = is_rot(p + "attn_output.weight");
    } else {
      const int64_t inner = cfg_.ssm_inner, Hv = cfg_.ssm_v_heads;
      w.w_qkv = L.matrix(p + "attn_qkv.weight", E, conv_dim());
      w.w_gate = L.matrix(p + "attn_gate.weight", E, inner);
      w.w_alpha = L.matrix(p + "ssm_alpha.weight", E, Hv);
      w.w_beta = L.matrix(p + "ssm_beta.weight", E, Hv);
      w.w_ssm_out = L.matrix(p + "ssm_out.weight", inner, E);
      L.expect_shape(p + "ssm_conv1d.weight", {cfg_.ssm_conv_kernel, conv_dim()});
      w.conv1d = L.vector(p + "ssm_conv1d.weight", cfg_.ssm_conv_kernel * conv_dim());
      w.dt_bias = L.vector(p + "ssm_dt.bias", Hv);
      w.ssm_a = L.vector(p + "ssm_a", Hv);
      w.ssm_norm = L.vector(p + "ssm_norm.weight", cfg_.ssm_head_v());
      w.rot_attn_in = is_rot(p + "attn_qkv.weight");
      DFLASH_CHECK(w.rot_attn_in == is_rot(p + "attn_gate.weight"),
                   "{}: prism rotates only one of {}attn_qkv / attn_gate; they share one input", file.path(), p);
      w.rot_alpha_beta = is_rot(p + "ssm_alpha.weight");
      DFLASH_CHECK(w.rot_alpha_beta == is_rot(p + "ssm_beta.weight"),
                   "{}: prism rotates only one of {}ssm_alpha / ssm_beta", file.path(), p);
      w.rot_attn_out = is_rot(p + "ssm_out.weight");
    }
    w.ffn_gate = L.matrix(p + "ffn_gate.weight", E, cfg_.n_ff);
    w.ffn_up = L.matrix(p + "ffn_up.weight", E, cfg_.n_ff);
    w.ffn_down = L.matrix(p + "ffn_down.weight", cfg_.n_ff, E);
    w.rot_ffn_in = is_rot(p + "ffn_gate.weight");
    DFLASH_CHECK(w.rot_ffn_in == is_rot(p + "ffn_up.weight"),
                 "{}: prism rotates only one of {}ffn_gate / ffn_up; they share one input", file.path(), p);
    w.rot_ffn_down = is_rot(p + "ffn_down.weight");
  }

  if (prism_) {
    signs_embd_ = upload_signs(E);
    signs_ff_ = upload_signs(cfg_.n_ff);
    signs_q_ = upload_signs(q_width());
    if (cfg_.arch == "qwen35") {
      signs_inner_ = upload_signs(cfg_.ssm_inner);
      if (prism_->gdn_v_grouped) {
        std::vector<int32_t> perm = prism::ssm_out_permutation(cfg_.ssm_k_heads, cfg_.ssm_v_heads, cfg_.ssm_head_v());
        ssm_out_perm_ = alloc<int32_t>(perm.size());
        be_.upload(ssm_out_perm_, perm.data(), perm.size() * sizeof(int32_t));
      }
    }
    // Every rotated matmul needs the sign vector of its input width.
    auto need = [&](bool rotated, const float* signs, int64_t width, const char* what) {
      DFLASH_CHECK(!rotated || signs != nullptr,
                   "{}: prism rotates {} (input width {}) but prism.hadamard.sign_widths has no such width",
                   file.path(), what, width);
    };
    need(rot_embd_ || rot_output_, signs_embd_, E, "token_embd/output");
    for (const LayerWeights& w : layers_) {
      need(w.rot_attn_in || w.rot_ffn_in || w.rot_alpha_beta, signs_embd_, E, "a layer input");
      need(w.rot_ffn_down, signs_ff_, cfg_.n_ff, "ffn_down");
      if (w.attention) need(w.rot_attn_out, signs_q_, q_width(), "attn_output");
      else need(w.rot_attn_out, signs_inner_, cfg_.ssm_inner, "ssm_out");
    }
  }
}

void Qwen35Model::allocate_state() {
  const int64_t E = cfg_.n_embd, R = max_rows_;
  state_.resize(cfg_.n_layer);
  int64_t widest = std::max<int64_t>(cfg_.n_ff, q_width() * 2);
  for (int64_t il = 0; il < cfg_.n_layer; ++il) {
    LayerState& s = state_[il];
    if (layers_[il].attention) {
      s.k_cache = alloc<float>((size_t)n_ctx_ * kv_width());
      s.v_cache = alloc<float>((size_t)n_ctx_ * kv_width());
    } else {
      const int64_t km1 = cfg_.ssm_conv_kernel - 1;
      s.conv_state = alloc<float>((size_t)km1 * conv_dim());
      s.ssm_state = alloc<float>(ssm_state_elems());
      s.conv_state_before = alloc<float>((size_t)km1 * conv_dim());
      s.conv_inputs = alloc<float>((size_t)max_undo_rows_ * conv_dim());
      const int64_t U = max_undo_rows_, Hk = cfg_.ssm_k_heads, Hv = cfg_.ssm_v_heads;
      s.undo_q = alloc<float>((size_t)U * Hk * cfg_.ssm_head_k);
      s.undo_k = alloc<float>((size_t)U * Hk * cfg_.ssm_head_k);
      s.undo_g = alloc<float>((size_t)U * Hv);
      s.undo_beta = alloc<float>((size_t)U * Hv);
      s.undo_delta = alloc<float>((size_t)U * cfg_.ssm_inner);
      has_gdn_ = true;
      widest = std::max(widest, conv_dim());
    }
  }
  widest = std::max(widest, E);
  d_ids_ = alloc<int32_t>(2 * R);
  d_argmax_ = d_ids_ + R;
  d_pos_ = alloc<int32_t>(R);
  d_kv_range_ = alloc<int32_t>(2 * R);
  x_ = alloc<float>(R * E);
  n_ = alloc<float>(R * E);
  // y_ holds a block output, or its matmul_parts parts: room for the most parts of a decode or verify
  // forward (up to max_undo_rows_ rows; longer forwards get fewer parts, or one).
  y_rows_ = std::max(R, Backend::kMaxMatmulParts * std::min(R, std::max<int64_t>(max_undo_rows_, 1)));
  y_ = alloc<float>(y_rows_ * E);
  rot_ = alloc<float>(R * widest);
  rot2_ = alloc<float>(R * widest);
  big0_ = alloc<float>(R * widest);
  big1_ = alloc<float>(R * widest);
  big2_ = alloc<float>(R * widest);
  q_ = alloc<float>(R * widest);
  k_ = alloc<float>(R * widest);
  v_ = alloc<float>(R * widest);
  gate_ = alloc<float>(R * widest);
  attn_ = alloc<float>(R * widest);
  a_ = alloc<float>(R * std::max<int64_t>(cfg_.ssm_v_heads, 1));
  b_ = alloc<float>(R * std::max<int64_t>(cfg_.ssm_v_heads, 1));
  logits_ = alloc<float>((size_t)R * cfg_.n_vocab);
  taps_buf_ = alloc<float>((size_t)R * E * std::max<size_t>(taps_.size(), 1));
}

// ---------------------------------------------------------------------------------------------
// Forward

const float* Qwen35Model::rotated(const float* x, int64_t M, int64_t in, bool rotate, float* scratch,
                                  const int32_t* perm) {
  if (!rotate) return x;
  const Backend::Rotation r = rotation(in, true, perm);
  be_.hadamard(x, r.signs, r.perm, scratch, M, in, r.block, /*inverse=*/false);
  return scratch;
}

Backend::Rotation Qwen35Model::rotation(int64_t in, bool rotate, const int32_t* perm) const {
  Backend::Rotation r;
  if (!rotate) return r;
  r.signs = in == cfg_.n_embd ? signs_embd_ : in == cfg_.n_ff ? signs_ff_ : in == q_width() ? signs_q_ : signs_inner_;
  r.perm = perm;
  r.perm_group = perm ? cfg_.ssm_head_v() : 0;  // the only perm: ssm_out's, which moves whole V heads
  r.block = prism_->block_size;
  return r;
}

const float* Qwen35Model::norm_input(float* res, int res_parts, const float* norm, bool rotate, int64_t M) {
  be_.residual_norm_rotate(x_, res, res_parts, norm, n_, rot_, rotation(cfg_.n_embd, rotate), M, cfg_.n_embd,
                           cfg_.rms_eps);
  return rotate ? rot_ : n_;
}

void Qwen35Model::embed(const int32_t* ids, float* out, int64_t M) {
  be_.get_rows(tok_embd_, ids, out, M);
  if (rot_embd_) be_.hadamard(out, signs_embd_, nullptr, out, M, cfg_.n_embd, prism_->block_size, /*inverse=*/true);
}

void Qwen35Model::lm_head(const float* h, float* logits, int64_t M) {
  // Process in slices of max_rows so the rotation scratch suffices.
  for (int64_t r0 = 0; r0 < M; r0 += max_rows_) {
    const int64_t m = std::min(max_rows_, M - r0);
    const float* hin = rotated(h + r0 * cfg_.n_embd, m, cfg_.n_embd, rot_output_, rot2_);
    be_.matmul(output_, hin, logits + r0 * cfg_.n_vocab, m);
  }
}

int Qwen35Model::attention_block(int il, const float* nin, float* y, int64_t M) {
  const LayerWeights& w = layers_[il];
  LayerState& s = state_[il];
  const int64_t hd = cfg_.head_dim, H = cfg_.n_head, Hkv = cfg_.n_head_kv;
  // attn_q rows are [q(hd) | gate(hd)] per head when the output is gated: split as [M*H, 2*hd] -> q,
  // gate [M*H, hd] below.
  mm_group({{&w.wq, cfg_.attn_output_gate ? big0_ : q_}, {&w.wk, k_}, {&w.wv, v_}}, nin, M);
  // Split q | gate, q and k norms and rope; the new keys and values go to the cache rows d_pos_
  // (device memory, so the step is one graph).
  Backend::AttentionPrep prep;
  prep.qg = cfg_.attn_output_gate ? big0_ : q_;
  prep.q = q_;
  prep.gate = cfg_.attn_output_gate ? gate_ : nullptr;
  prep.k = k_;
  prep.v = v_;
  prep.q_norm = w.q_norm;
  prep.k_norm = w.k_norm;
  prep.pos = d_pos_;
  prep.slot = d_pos_;
  prep.k_cache = s.k_cache;
  prep.v_cache = s.v_cache;
  prep.cache_rows = n_ctx_;
  prep.M = M;
  prep.n_head = H;
  prep.n_head_kv = Hkv;
  prep.head_dim = hd;
  prep.n_rot = cfg_.n_rot;
  prep.theta = cfg_.rope_theta;
  prep.eps = cfg_.rms_eps;
  be_.attention_prep(prep);
  // A long non-undoable chunk takes the prefill kernel (tensor cores on CUDA; rounds differently).
  const float scale = 1.0f / std::sqrt((float)hd);
  if (cfg_.attn_output_gate && !prefill_chunk_) {
    // decode / verify: the attention, attn * sigmoid(gate) and (prism) wo's input rotation as one op
    float* dst = w.rot_attn_out ? rot_ : attn_;
    be_.attention_gate_rotate(q_, s.k_cache, s.v_cache, d_kv_range_, attn_, gate_, dst,
                              rotation(q_width(), w.rot_attn_out), M, H, Hkv, hd, scale);
    return mm_residual(w.wo, dst, y, M);
  }
  if (prefill_chunk_)
    be_.attention_prefill(q_, s.k_cache, s.v_cache, d_kv_range_, attn_, M, H, Hkv, hd, scale);
  else
    be_.attention(q_, s.k_cache, s.v_cache, d_kv_range_, attn_, M, H, Hkv, hd, scale);
  const float* oin = attn_;
  if (cfg_.attn_output_gate) {
    // attn * sigmoid(gate), then (prism) the rotation of wo's input: one op (CUDA: one kernel with wo's
    // activation quantization)
    float* dst = w.rot_attn_out ? rot_ : attn_;
    be_.sigmoid_gate_rotate(attn_, gate_, dst, rotation(q_width(), w.rot_attn_out), M, q_width());
    oin = dst;
  } else {
    oin = rotated(attn_, M, q_width(), w.rot_attn_out, rot_);
  }
  return mm_residual(w.wo, oin, y, M);
}

int Qwen35Model::gdn_block(int il, const float* n, const float* nin, float* y, int64_t M, bool undoable) {
  const LayerWeights& w = layers_[il];
  LayerState& s = state_[il];
  const int64_t Hk = cfg_.ssm_k_heads, Hv = cfg_.ssm_v_heads, dk = cfg_.ssm_head_k, dv = cfg_.ssm_head_v();
  const int64_t C = conv_dim(), K = cfg_.ssm_conv_kernel;
  // An undoable forward keeps its conv inputs for rollback: the qkv matmul writes them straight into
  // the layer's undo buffer, and the conv leaves its state before the rows in conv_state_before.
  float* conv_in = undoable ? s.conv_inputs : big0_;
  const float* nab = w.rot_alpha_beta ? (w.rot_attn_in ? nin : rotated(n, M, cfg_.n_embd, true, rot2_)) : n;
  // [M, C] pre-conv, z [M, inner]; [M, Hv] beta logits, [M, Hv] alpha; silu(conv) [M, C] (one launch on
  // CUDA, except in prefill chunks)
  const Backend::MatmulOut ab[] = {{&w.w_beta, b_}, {&w.w_alpha, a_}};
  float* conv_before = undoable ? s.conv_state_before : nullptr;
  if (prefill_chunk_) {
    mm_group({{&w.w_qkv, conv_in}, {&w.w_gate, gate_}}, nin, M);
    mm_group({ab[0], ab[1]}, nab, M);
    be_.gdn_conv(conv_in, s.conv_state, conv_before, w.conv1d, big1_, M, C, K);
  } else {
    be_.gdn_input(w.w_qkv, w.w_gate, nin, conv_in, gate_, ab, nab, s.conv_state, conv_before, w.conv1d, big1_, M, C,
                  K);
  }
  // One conv row is [q | k | v]: the recurrence reads the three pieces with row stride C.
  const float *q = big1_, *k = big1_ + Hk * dk, *v = big1_ + 2 * Hk * dk;
  const GdnShape shape{Hk, Hv, dk, dv};
  if (!undoable && M >= kChunkedThreshold) {
    // prefill: split q | k | v, prepare them and the gates, then the chunked form
    be_.gdn_split_qkv(big1_, q_, k_, v_, M, shape, Backend::kGdnL2Eps, 1.0f / std::sqrt((float)dk));
    be_.gdn_gates(a_, b_, w.dt_bias, w.ssm_a, M, Hv);  // alpha -> g (log-decay), b -> beta
    be_.gdn_chunked(q_, k_, v_, a_, b_, s.ssm_state, attn_, M, shape);
  } else {
    // decode and verify: norms, gates and recurrence in one op. An undoable forward leaves the state
    // as it was and the rows' updates (prepared k, g and the deltas) in the undo buffers, for
    // keep_undo_rows.
    const Backend::GdnPrepared undo{s.undo_q, s.undo_k, s.undo_g, s.undo_beta, s.undo_delta};
    be_.gdn_prepare_recurrent({q, C, k, C, v, C, a_, b_, w.dt_bias, w.ssm_a}, s.ssm_state, attn_,
                              undoable ? &undo : nullptr, M, shape);
  }
  // rms_norm_gated per V head, then (prism) the rotation of ssm_out's input, in grouped V order
  float* oin = w.rot_attn_out ? rot_ : attn_;
  be_.gated_norm_rotate(attn_, w.ssm_norm, gate_, oin, rotation(cfg_.ssm_inner, w.rot_attn_out, ssm_out_perm_), M,
                        Hv * dv, dv, cfg_.rms_eps);
  return mm_residual(w.w_ssm_out, oin, y, M);
}

int Qwen35Model::ffn_block(int il, const float* nin, float* y, int64_t M) {
  const LayerWeights& w = layers_[il];
  mm_group({{&w.ffn_gate, big0_}, {&w.ffn_up, big1_}}, nin, M);
  float* din = w.rot_ffn_down ? rot_ : big2_;
  be_.swiglu_rotate(big0_, big1_, din, rotation(cfg_.n_ff, w.rot_ffn_down), M, cfg_.n_ff);
  return mm_residual(w.ffn_down, din, y, M);
}

void Qwen35Model::forward_ops(int64_t M, const ForwardOptions& opts, int64_t first) {
  const int64_t E = cfg_.n_embd;
  embed(d_ids_, x_, M);
  const int64_t n_taps = static_cast<int64_t>(taps_.size());
  auto capture_taps = [&](int64_t layer_input) {
    if (!opts.want_taps) return;
    for (int64_t t = 0; t < n_taps; ++t)
      if (taps_[t] == layer_input) be_.copy_rows(taps_buf_ + t * E, n_taps * E, x_, E, M, E);
  };

  // Each block's output y_ (res_parts parts: mm_residual) joins the residual x_ in the next norm
  // (residual_norm_rotate).
  float* res = nullptr;
  int res_parts = 1;
  for (int64_t il = 0; il < cfg_.n_layer; ++il) {
    const LayerWeights& w = layers_[il];
    const float* nin = norm_input(res, res_parts, w.attn_norm, w.rot_attn_in, M);
    capture_taps(il);  // x_ is layer il's input now
    const int parts = w.attention ? attention_block(il, nin, y_, M) : gdn_block(il, n_, nin, y_, M, opts.undoable);
    nin = norm_input(y_, parts, w.post_attn_norm, w.rot_ffn_in, M);
    res_parts = ffn_block(il, nin, y_, M);
    res = y_;
  }
  if (res) {
    if (res_parts > 1) be_.sum_parts(res, res_parts, M * E);
    be_.add(x_, res, x_, M * E);
  }
  capture_taps(cfg_.n_layer);
  if (opts.logits != LogitRows::kNone) {
    const int64_t rows = M - first;
    be_.rms_norm(x_ + first * E, output_norm_, n_, rows, E, cfg_.rms_eps);
    lm_head(n_, logits_, rows);
    be_.argmax(logits_, d_argmax_, rows, cfg_.n_vocab);
  }
}

void Qwen35Model::check_forward(int64_t M, const ForwardOptions& opts) const {
  DFLASH_CHECK(M >= 1 && M <= max_rows_, "forward of {} rows: must be 1..{}", M, max_rows_);
  DFLASH_CHECK(!opts.undoable || M <= max_undo_rows_,
               "an undoable forward takes at most {} rows (TargetOptions.max_undo_rows), got {}", max_undo_rows_, M);
  DFLASH_CHECK(n_past_ + M <= n_ctx_, "context full: {} cached + {} new tokens exceed the context of {} tokens",
               n_past_, M, n_ctx_);
}

ForwardResult Qwen35Model::forward(std::span<const int32_t> tokens, const ForwardOptions& opts) {
  const int64_t M = static_cast<int64_t>(tokens.size());
  check_forward(M, opts);
  for (int64_t m = 0; m < M; ++m)
    DFLASH_CHECK(tokens[m] >= 0 && tokens[m] < cfg_.n_vocab, "token id {} at row {} is outside the vocabulary (0..{})",
                 tokens[m], m, cfg_.n_vocab - 1);
  be_.upload(d_ids_, tokens.data(), M * sizeof(int32_t));
  return run_forward(M, opts, false);
}

ForwardResult Qwen35Model::forward_device(const int32_t* tokens, int64_t M, const ForwardOptions& opts) {
  check_forward(M, opts);
  DFLASH_CHECK(tokens != nullptr, "forward_device: null token pointer");
  be_.copy(d_ids_, tokens, M * sizeof(int32_t));
  ForwardResult res = run_forward(M, opts, true);
  for (int64_t m = 0; m < M; ++m)  // the rows ran already: a bad id means the drafter wrote garbage
    DFLASH_CHECK(res.tokens[m] >= 0 && res.tokens[m] < cfg_.n_vocab,
                 "internal: device token id {} at row {} is outside the vocabulary (0..{})", res.tokens[m], m,
                 cfg_.n_vocab - 1);
  return res;
}

ForwardResult Qwen35Model::run_forward(int64_t M, const ForwardOptions& opts, bool tokens_back) {
  const int64_t E = cfg_.n_embd;
  if (last_undoable_) keep_undo_rows(last_rows_);  // no rollback came: every row of that forward stays
  std::vector<int32_t> pos(M), range(2 * M);
  for (int64_t m = 0; m < M; ++m) {
    pos[m] = static_cast<int32_t>(n_past_ + m);
    range[2 * m] = 0;
    range[2 * m + 1] = static_cast<int32_t>(n_past_ + m + 1);  // causal: keys 0..pos
  }
  be_.upload(d_pos_, pos.data(), M * sizeof(int32_t));
  be_.upload(d_kv_range_, range.data(), 2 * M * sizeof(int32_t));

  const int64_t first = opts.logits == LogitRows::kLast ? M - 1 : 0;  // first row that gets logits
  prefill_chunk_ = !opts.undoable && M >= kChunkedThreshold;
  if (M <= max_undo_rows_) {
    // Decode and verify shapes replay as graphs; prefill chunks (long, few) run directly.
    const uint64_t key = static_cast<uint64_t>(M) | static_cast<uint64_t>(opts.logits) << 32 |
                         static_cast<uint64_t>(opts.want_taps) << 40 | static_cast<uint64_t>(opts.undoable) << 41;
    graphs_.run(key, [&] { forward_ops(M, opts, first); });
  } else {
    forward_ops(M, opts, first);
  }
  prefill_chunk_ = false;

  ForwardResult res;
  const int64_t rows = opts.logits != LogitRows::kNone ? M - first : 0;
  if (tokens_back) {  // ids and argmax in one download (d_argmax_ = d_ids_ + max_rows_)
    const int64_t R = max_rows_;
    std::vector<int32_t> io(static_cast<size_t>(R + rows));
    be_.download(io.data(), d_ids_, io.size() * sizeof(int32_t));
    res.tokens.assign(io.begin(), io.begin() + M);
    res.argmax.assign(io.begin() + R, io.end());
  }
  if (opts.logits != LogitRows::kNone) {
    if (!tokens_back) {
      res.argmax.resize(rows);
      be_.download(res.argmax.data(), d_argmax_, rows * sizeof(int32_t));
    }
    if (opts.want_logits) {
      res.logits.resize((size_t)rows * cfg_.n_vocab);
      be_.download(res.logits.data(), logits_, res.logits.size() * sizeof(float));
    }
  }
  if (opts.want_taps && !opts.taps_on_device) {
    res.taps.resize((size_t)M * taps_.size() * E);
    if (!res.taps.empty()) be_.download(res.taps.data(), taps_buf_, res.taps.size() * sizeof(float));
  }
  last_start_ = n_past_;
  last_rows_ = M;
  last_undoable_ = opts.undoable;
  n_past_ += M;
  return res;
}

void Qwen35Model::rollback(int64_t n_keep) {
  DFLASH_CHECK(last_start_ >= 0 && last_undoable_, "rollback needs an undoable forward just before it");
  DFLASH_CHECK(n_keep >= 1 && n_keep <= last_rows_, "rollback keeps {} rows of a {}-row forward", n_keep, last_rows_);
  // KV rows past the kept ones are simply overwritten later (attention never reads beyond n_past).
  n_past_ = last_start_ + n_keep;
  keep_undo_rows(n_keep);
}

void Qwen35Model::keep_undo_rows(int64_t n_keep) {
  const int64_t C = conv_dim(), km1 = cfg_.ssm_conv_kernel - 1;
  const bool drop = n_keep < last_rows_;  // the conv ran over every row: its windows go back only then
  last_rows_ = n_keep;
  last_undoable_ = false;  // a second rollback would need the states before this one
  if (!has_gdn_) return;
  auto ops = [&] {
    // Every GDN layer is independent of the others: the recurrent states advanced over the kept rows'
    // recorded updates in one batch, then (rows dropped) the conv states.
    std::vector<Backend::GdnApplyJob> applies;
    std::vector<Backend::CopyJob> copies;
    for (int64_t il = 0; il < cfg_.n_layer; ++il) {
      if (layers_[il].attention) continue;
      LayerState& s = state_[il];
      applies.push_back({s.undo_k, s.undo_g, s.undo_delta, s.ssm_state});
      if (!drop) continue;
      // conv state = the last K-1 rows of [state_before ; inputs[0..n_keep)]: rows n_keep .. n_keep + K-2 of
      // that concatenation, at most two contiguous runs (one when n_keep >= K-1)
      const int64_t from_before = std::max<int64_t>(0, km1 - n_keep);  // leading rows still from state_before
      if (from_before > 0)
        copies.push_back({s.conv_state, s.conv_state_before + n_keep * C, sizeof(float) * from_before * C});
      if (km1 - from_before > 0)
        copies.push_back({s.conv_state + from_before * C, s.conv_inputs + (n_keep + from_before - km1) * C,
                          sizeof(float) * (km1 - from_before) * C});
    }
    const GdnShape shape{cfg_.ssm_k_heads, cfg_.ssm_v_heads, cfg_.ssm_head_k, cfg_.ssm_head_v()};
    if (!applies.empty()) be_.gdn_apply_rows_batch(applies, n_keep, shape);
    if (!copies.empty()) be_.copy_batch(copies);
  };
  // Every pointer and size above depends only on n_keep and whether rows are dropped: one graph each
  // (27B: ~100 jobs per cycle, launched one by one they cost more than their work).
  graphs_.run(kRollbackKey | static_cast<uint64_t>(n_keep) | static_cast<uint64_t>(drop) << 32, ops);
}

}  // namespace

// ---------------------------------------------------------------------------------------------

std::unique_ptr<TargetModel> TargetModel::load(const gguf::File& file, Backend& backend, const TargetOptions& options) {
  return std::make_unique<Qwen35Model>(file, backend, options);
}

namespace {

// The chunk loop of prefill() / prefill_device_taps(): taps to the host (taps_out) or in backend
// memory (on_taps), or neither.
int32_t prefill_chunks(TargetModel& model, std::span<const int32_t> tokens, std::vector<float>* taps_out,
                       const std::function<void(const float*, int64_t)>* on_taps, std::vector<float>* last_logits) {
  DFLASH_CHECK(!tokens.empty(), "prefill of an empty prompt");
  int32_t last = -1;
  for (size_t i = 0; i < tokens.size(); i += model.max_rows()) {
    const size_t m = std::min<size_t>(model.max_rows(), tokens.size() - i);
    ForwardOptions o;
    o.logits = i + m == tokens.size() ? LogitRows::kLast : LogitRows::kNone;
    o.want_taps = taps_out != nullptr || on_taps != nullptr;
    o.taps_on_device = on_taps != nullptr;
    o.want_logits = last_logits != nullptr && i + m == tokens.size();
    ForwardResult r = model.forward(tokens.subspan(i, m), o);
    if (o.want_logits) *last_logits = std::move(r.logits);
    if (taps_out) taps_out->insert(taps_out->end(), r.taps.begin(), r.taps.end());
    if (on_taps) (*on_taps)(model.device_taps(), static_cast<int64_t>(m));
    if (!r.argmax.empty()) last = r.argmax.back();
  }
  return last;
}

}  // namespace

int32_t prefill(TargetModel& model, std::span<const int32_t> tokens, std::vector<float>* taps_out,
                std::vector<float>* last_logits) {
  return prefill_chunks(model, tokens, taps_out, nullptr, last_logits);
}

int32_t prefill_device_taps(TargetModel& model, std::span<const int32_t> tokens,
                            const std::function<void(const float*, int64_t)>& on_taps,
                            std::vector<float>* last_logits) {
  return prefill_chunks(model, tokens, nullptr, &on_taps, last_logits);
}

}  // namespace dflash
