// dflash: the DFlash 2 / DFlash v1 block drafter (SPEC 4), written once against the op interface.
//
// One draft = one forward over the B trained block rows [anchor, MASK x B-1] at positions P..P+B-1:
//   per layer  n = attn_norm(x); d = conv_proj(n); u = Conv(n; base0, d0)
//              q = RoPE(qnorm(Wq u)); k = RoPE(knorm(Wk u)); v = Wv u     (block keys after the context)
//              o = softmax(q [Kctx; k]^T / sqrt(hd) + mask) [Vctx; v]
//              x = x + Conv(Wo o; base1, d1)
//              n2 = ffn_norm(x); d2 = conv_proj2(n2); u2 = Conv(n2; base0', d2_0)
//              x = x + Conv(down(silu(gate u2) * up u2); base1', d2_1)
//   h = output_norm(x); logits = target.lm_head(h[1..B-1]); top-k; selector walk (or argmax, v1).
// The context rows (one per committed position j) are projected once when appended:
//   c_j = enc_norm(fc . taps_j);  Kctx_j = RoPE_j(knorm(Wk c_j));  Vctx_j = Wv c_j   (every layer)
#include "models/dflash_drafter.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/ranges.h>

#include "models/weights.h"
#include "util/error.h"

namespace dflash {

namespace {
constexpr uint64_t kAppendGraphKey = 1ull << 32;  // graph keys of context appends (the draft is key 0)
}  // namespace

// ---------------------------------------------------------------------------------------------
// Hyper-parameters

DrafterConfig read_drafter_config(const gguf::File& f) {
  const std::string arch = f.get_string_or("general.architecture", "");
  DFLASH_CHECK(arch == "dflash", "{}: general.architecture is '{}'; a drafter file has 'dflash'", f.path(), arch);
  const std::string p = "dflash.";
  DrafterConfig c;
  c.n_layer = f.get_int(p + "block_count");
  c.n_embd = f.get_int(p + "embedding_length");
  c.n_ff = f.get_int(p + "feed_forward_length");
  c.n_head = f.get_int(p + "attention.head_count");
  c.n_head_kv = f.get_int_or(p + "attention.head_count_kv", c.n_head);
  DFLASH_CHECK(c.n_layer > 0 && c.n_embd > 0 && c.n_ff > 0,
               "{}: dflash.block_count, embedding_length and feed_forward_length must be positive", f.path());
  DFLASH_CHECK(c.n_head > 0 && c.n_head_kv > 0 && c.n_head % c.n_head_kv == 0,
               "{}: dflash.attention.head_count {} is not a positive multiple of head_count_kv {}", f.path(), c.n_head,
               c.n_head_kv);
  c.head_dim = f.get_int_or(p + "attention.key_length", c.n_embd / c.n_head);
  const int64_t value_length = f.get_int_or(p + "attention.value_length", c.head_dim);
  DFLASH_CHECK(c.head_dim > 0 && value_length == c.head_dim,
               "{}: dflash.attention.key_length {} and value_length {} must be equal and positive", f.path(), c.head_dim,
               value_length);
  c.rms_eps = static_cast<float>(f.get_float_or(p + "attention.layer_norm_rms_epsilon", 1e-6));
  // No default: a wrong theta (1e6 baked in for a 1e7 model) silently ruins acceptance (SPEC 8).
  DFLASH_CHECK(f.has(p + "rope.freq_base"), "{}: required metadata key 'dflash.rope.freq_base' is missing", f.path());
  c.rope_theta = static_cast<float>(f.get_float(p + "rope.freq_base"));
  c.n_rot = f.get_int_or(p + "rope.dimension_count", c.head_dim);
  DFLASH_CHECK(c.rope_theta > 0 && c.n_rot > 0 && c.n_rot % 2 == 0 && c.n_rot <= c.head_dim,
               "{}: dflash.rope.freq_base {} / dimension_count {} invalid for head dim {}", f.path(), c.rope_theta,
               c.n_rot, c.head_dim);
  c.block_size = f.get_int(p + "block_size");
  DFLASH_CHECK(c.block_size >= 2 && c.block_size <= 64, "{}: dflash.block_size {} must be 2..64", f.path(),
               c.block_size);
  DFLASH_CHECK(f.has(p + "target_layers"), "{}: required metadata key 'dflash.target_layers' is missing", f.path());
  c.target_layers = f.get_int_array(p + "target_layers");
  DFLASH_CHECK(!c.target_layers.empty() && c.target_layers.size() <= 64,
               "{}: dflash.target_layers has {} entries; expected 1..64 tap ids", f.path(), c.target_layers.size());
  for (int64_t t : c.target_layers)
    DFLASH_CHECK(t >= 0, "{}: dflash.target_layers holds a negative tap id {}", f.path(), t);
  c.conv_kernel = f.get_int_or(p + "conv_kernel_size", 0);
  c.conv_group = f.get_int_or(p + "conv_group_size", 0);
  if (c.conv_kernel > 0) {
    DFLASH_CHECK(c.conv_kernel <= 16, "{}: dflash.conv_kernel_size {} out of range 1..16", f.path(), c.conv_kernel);
    DFLASH_CHECK(c.conv_group > 0 && c.n_embd % c.conv_group == 0,
                 "{}: dflash.conv_group_size {} must divide embedding_length {}", f.path(), c.conv_group, c.n_embd);
  } else {
    c.conv_kernel = 0;
  }
  c.selector_top_k = f.get_int_or(p + "selector_top_k", 0);
  c.selector_rank = f.get_int_or(p + "selector_rank", 0);
  if (c.selector_top_k > 0) {
    DFLASH_CHECK(c.selector_top_k <= 1024 && c.selector_rank > 0 && c.selector_rank <= 65536,
                 "{}: dflash.selector_top_k {} / selector_rank {} out of range", f.path(), c.selector_top_k,
                 c.selector_rank);
  } else {
    c.selector_top_k = 0;
  }
  c.sliding_window = f.get_int_or(p + "attention.sliding_window", 0);
  DFLASH_CHECK(c.sliding_window >= 0, "{}: dflash.attention.sliding_window {} is negative", f.path(), c.sliding_window);
  c.causal = f.get_bool_or(p + "attention.causal", false);
  const double embed_scale = f.get_float_or(p + "input_embedding_scale", 1.0);
  DFLASH_CHECK(embed_scale == 1.0, "{}: dflash.input_embedding_scale {} is not supported (only 1.0)", f.path(),
               embed_scale);
  DFLASH_CHECK(f.has("tokenizer.ggml.mask_token_id"), "{}: required metadata key 'tokenizer.ggml.mask_token_id' is missing",
               f.path());
  const int64_t mask = f.get_int("tokenizer.ggml.mask_token_id");
  DFLASH_CHECK(mask >= 0 && mask < (int64_t{1} << 31), "{}: tokenizer.ggml.mask_token_id {} out of range", f.path(), mask);
  c.mask_token = static_cast<int32_t>(mask);
  if (const gguf::TensorInfo* t = f.find_tensor("selector_predecessor.weight"); t && t->n_dims == 2)
    c.n_vocab = t->ne[1];
  else
    c.n_vocab = f.get_int_or(p + "vocab_size", 0);
  DFLASH_CHECK(c.n_vocab == 0 || c.mask_token < c.n_vocab, "{}: mask token {} is outside the drafter's vocabulary of {}",
               f.path(), c.mask_token, c.n_vocab);
  return c;
}

void check_drafter_fits_target(const DrafterConfig& d, const std::string& dn, const TargetConfig& t,
                               const std::string& tn) {
  DFLASH_CHECK(d.n_embd == t.n_embd,
               "drafter {} does not fit target {}: drafter hidden size {} (dflash.embedding_length) != target hidden "
               "size {} ({}.embedding_length)",
               dn, tn, d.n_embd, t.n_embd, t.arch);
  if (d.n_vocab > 0 && t.n_vocab > 0)
    DFLASH_CHECK(d.n_vocab == t.n_vocab,
                 "drafter {} does not fit target {}: the drafter's vocabulary has {} tokens (selector codebook rows), "
                 "the target's {} (token_embd rows)",
                 dn, tn, d.n_vocab, t.n_vocab);
  for (size_t i = 0; i < d.target_layers.size(); ++i)
    DFLASH_CHECK(d.target_layers[i] < t.n_layer,
                 "drafter {} does not fit target {}: tap id {} (dflash.target_layers[{}]) must be below the target's "
                 "{} layers (a tap is the input of a layer, SPEC 2.5)",
                 dn, tn, d.target_layers[i], i, t.n_layer);
  if (t.n_vocab > 0)
    DFLASH_CHECK(d.mask_token < t.n_vocab,
                 "drafter {} does not fit target {}: mask token {} (tokenizer.ggml.mask_token_id) is outside the "
                 "target's vocabulary of {} tokens",
                 dn, tn, d.mask_token, t.n_vocab);
}

// ---------------------------------------------------------------------------------------------
// Loading

struct DFlashDrafter::Layer {
  float* attn_norm = nullptr;  // [n_embd]
  float* ffn_norm = nullptr;   // [n_embd]
  WeightRef wq, wk, wv, wo;    // [n_embd -> n_head*hd], [n_embd -> n_head_kv*hd] x2, [n_head*hd -> n_embd]
  float* q_norm = nullptr;     // [hd]
  float* k_norm = nullptr;     // [hd]
  WeightRef ffn_gate, ffn_up, ffn_down;
  // DFlash 2 conv
  WeightRef attn_conv_proj, ffn_conv_proj;      // [n_embd -> 2*K*G]
  float* attn_conv_base = nullptr;              // [2 stages, K, n_embd]
  float* ffn_conv_base = nullptr;
  // context + block keys/values: [cap + B, n_head_kv, hd]
  float* k = nullptr;
  float* v = nullptr;
};

std::unique_ptr<DFlashDrafter> DFlashDrafter::load(const gguf::File& file, TargetModel& target,
                                                   const DrafterOptions& options) {
  return std::unique_ptr<DFlashDrafter>(new DFlashDrafter(file, target, options));
}

DFlashDrafter::DFlashDrafter(const gguf::File& file, TargetModel& target, const DrafterOptions& options)
    : target_(target), be_(target.backend()), arena_(target.backend()), opts_(options), name_(file.path()) {
  cfg_ = read_drafter_config(file);
  check_drafter_fits_target(cfg_, name_, target.config(), "(loaded target)");
  DFLASH_CHECK(target.tap_layers() == cfg_.target_layers,
               "drafter {}: the target was loaded with tap layers [{}]; the drafter needs [{}] "
               "(TargetOptions.tap_layers = dflash.target_layers)",
               name_, fmt::join(target.tap_layers(), ", "), fmt::join(cfg_.target_layers, ", "));
  DFLASH_CHECK(opts_.append_chunk >= 1, "drafter: append_chunk must be positive");
  if (opts_.context == DrafterContextMode::kSinkWindow)
    DFLASH_CHECK(opts_.sink >= 0 && opts_.window >= 1, "drafter: sink {} / window {} invalid", opts_.sink,
                 opts_.window);
  load_weights(file);
  allocate();
}

DFlashDrafter::~DFlashDrafter() = default;

void DFlashDrafter::load_weights(const gguf::File& file) {
  WeightLoader L(file, arena_);
  const int64_t E = cfg_.n_embd, hd = cfg_.head_dim;
  const int64_t qw = cfg_.n_head * hd, kvw = cfg_.n_head_kv * hd;
  fc_ = L.matrix("fc.weight", cfg_.n_taps() * E, E);
  enc_norm_ = L.vector("enc.output_norm.weight", E);
  out_norm_ = L.vector("output_norm.weight", E);
  const bool conv = cfg_.conv_kernel > 0;
  const int64_t K = cfg_.conv_kernel;
  layers_.resize(cfg_.n_layer);
  for (int64_t il = 0; il < cfg_.n_layer; ++il) {
    Layer& w = layers_[il];
    const std::string b = "blk." + std::to_string(il) + ".";
    w.attn_norm = L.vector(b + "attn_norm.weight", E);
    w.ffn_norm = L.vector(b + "ffn_norm.weight", E);
    w.wq = L.matrix(b + "attn_q.weight", E, qw);
    w.wk = L.matrix(b + "attn_k.weight", E, kvw);
    w.wv = L.matrix(b + "attn_v.weight", E, kvw);
    w.wo = L.matrix(b + "attn_output.weight", qw, E);
    w.q_norm = L.vector(b + "attn_q_norm.weight", hd);
    w.k_norm = L.vector(b + "attn_k_norm.weight", hd);
    w.ffn_gate = L.matrix(b + "ffn_gate.weight", E, cfg_.n_ff);
    w.ffn_up = L.matrix(b + "ffn_up.weight", E, cfg_.n_ff);
    w.ffn_down = L.matrix(b + "ffn_down.weight", cfg_.n_ff, E);
    if (conv) {
      for (const char* s : {"attn_conv_base", "ffn_conv_base"}) {
        DFLASH_CHECK(file.find_tensor(b + s) != nullptr,
                     "{}: required tensor '{}{}' (shape [{}, {}, 2]) is missing (dflash.conv_kernel_size is {})",
                     file.path(), b, s, E, K, K);
        L.expect_shape(b + s, {E, K, 2});
      }
      w.attn_conv_base = L.vector(b + "attn_conv_base", 2 * K * E);
      w.ffn_conv_base = L.vector(b + "ffn_conv_base", 2 * K * E);
      w.attn_conv_proj = L.matrix(b + "attn_conv_proj.weight", E, cfg_.conv_proj_out());
      w.ffn_conv_proj = L.matrix(b + "ffn_conv_proj.weight", E, cfg_.conv_proj_out());
    } else {
      DFLASH_CHECK(file.find_tensor(b + "attn_conv_base") == nullptr,
                   "{}: tensor '{}attn_conv_base' present but dflash.conv_kernel_size is missing or 0", file.path(), b);
    }
  }
  if (cfg_.dflash2()) {
    const int64_t R = cfg_.selector_rank;
    sel_hidden_ = L.matrix("selector_hidden.weight", E, R);
    const char* names[2] = {"selector_predecessor.weight", "selector_successor.weight"};
    for (int i = 0; i < 2; ++i) {
      DFLASH_CHECK(file.find_tensor(names[i]) != nullptr,
                   "{}: required tensor '{}' (shape [{}, n_vocab]) is missing (dflash.selector_top_k is {})",
                   file.path(), names[i], R, cfg_.selector_top_k);
      const gguf::TensorInfo& t = file.tensor(names[i]);
      DFLASH_CHECK(t.n_dims == 2 && t.ne[0] == R && t.ne[1] == cfg_.n_vocab,
                   "{}: tensor '{}' has shape {}, expected [{}, {}] (selector_rank, n_vocab)", file.path(), names[i],
                   t.shape_string(), R, cfg_.n_vocab);
    }
    sel_pred_ = L.matrix(names[0], R, cfg_.n_vocab);  // rows are looked up (get_rows), never multiplied
    sel_succ_ = L.matrix(names[1], R, cfg_.n_vocab);
    DFLASH_CHECK(cfg_.selector_top_k <= cfg_.n_vocab, "{}: selector_top_k {} exceeds the vocabulary of {}",
                 file.path(), cfg_.selector_top_k, cfg_.n_vocab);
  }
}

void DFlashDrafter::allocate() {
  const int64_t B = cfg_.block_size, E = cfg_.n_embd;
  const int64_t kvw = cfg_.n_head_kv * cfg_.head_dim, qw = cfg_.n_head * cfg_.head_dim;
  const int64_t chunk = opts_.append_chunk;
  if (opts_.context == DrafterContextMode::kSinkWindow) {
    keep_ = opts_.sink + opts_.window;
    cap_ = keep_ + chunk;
  } else if (cfg_.sliding_window > 0) {
    keep_ = cfg_.sliding_window - 1;  // a block at P (row 0) sees positions P-window+1 .. P-1
    cap_ = keep_ + std::max(chunk, opts_.context_slack);  // evict (move rows) once per ~slack appended rows
  } else {
    keep_ = target_.n_ctx();  // every committed position stays visible
    cap_ = target_.n_ctx();
  }
  auto alloc = [&](size_t bytes) {
    return arena_.alloc(std::max<size_t>(bytes, 4));
  };
  for (Layer& w : layers_) {
    w.k = static_cast<float*>(alloc(sizeof(float) * (cap_ + B) * kvw));
    w.v = static_cast<float*>(alloc(sizeof(float) * (cap_ + B) * kvw));
  }
  const int64_t n_vocab = target_.config().n_vocab;
  const int64_t rows = B - 1;
  const int64_t topk = std::max<int64_t>(cfg_.selector_top_k, 1);
  d_ids_ = static_cast<int32_t*>(alloc(sizeof(int32_t) * B));
  d_pos_ = static_cast<int32_t*>(alloc(sizeof(int32_t) * std::max(B, chunk)));
  d_range_ = static_cast<int32_t*>(alloc(sizeof(int32_t) * 2 * B));
  d_slot_ = static_cast<int32_t*>(alloc(sizeof(int32_t) * B));
  kb_ = static_cast<float*>(alloc(sizeof(float) * std::max(B, chunk) * kvw));  // block or appended rows
  vb_ = static_cast<float*>(alloc(sizeof(float) * std::max(B, chunk) * kvw));
  d_ctx_slot_ = static_cast<int32_t*>(alloc(sizeof(int32_t) * chunk));
  d_topk_ids_ = static_cast<int32_t*>(alloc(sizeof(int32_t) * rows * topk));
  d_topk_vals_ = static_cast<float*>(alloc(sizeof(float) * rows * topk));
  taps_ = static_cast<float*>(alloc(sizeof(float) * chunk * cfg_.n_taps() * E));
  c_ = static_cast<float*>(alloc(sizeof(float) * chunk * E));
  x_ = static_cast<float*>(alloc(sizeof(float) * B * E));
  n_ = static_cast<float*>(alloc(sizeof(float) * B * E));
  u_ = static_cast<float*>(alloc(sizeof(float) * B * E));
  // o_: the attention / FFN output, or its matmul_parts parts (the conv reads them)
  o_ = static_cast<float*>(alloc(sizeof(float) * Backend::kMaxMatmulParts * B * E));
  dyn_ = static_cast<float*>(alloc(sizeof(float) * B * std::max<int64_t>(cfg_.conv_proj_out(), 1)));
  q_ = static_cast<float*>(alloc(sizeof(float) * B * qw));
  attn_ = static_cast<float*>(alloc(sizeof(float) * B * qw));
  gate_ = static_cast<float*>(alloc(sizeof(float) * B * cfg_.n_ff));
  up_ = static_cast<float*>(alloc(sizeof(float) * B * cfg_.n_ff));
  act_ = static_cast<float*>(alloc(sizeof(float) * B * cfg_.n_ff));
  head_extra_ = be_.matmul_rows_for(rows, B) - rows;  // the head's rows before row 1 (draft_ops)
  logits_ = static_cast<float*>(alloc(sizeof(float) * (head_extra_ + rows) * n_vocab)) + head_extra_ * n_vocab;
  g_ = static_cast<float*>(alloc(sizeof(float) * rows * std::max<int64_t>(cfg_.selector_rank, 1)));
  if (cfg_.dflash2()) {
    const int64_t R = cfg_.selector_rank;
    pred_rows_ = static_cast<float*>(alloc(sizeof(float) * (1 + (rows - 1) * topk) * R));
    succ_rows_ = static_cast<float*>(alloc(sizeof(float) * rows * topk * R));
  }
  d_block_ = static_cast<int32_t*>(alloc(sizeof(int32_t) * B));
}

// ---------------------------------------------------------------------------------------------
// Context cache

void DFlashDrafter::reset_context() {
  ctx_end_ = 0;
  ctx_pos_.clear();
}

// Moves stored rows [src, src+n) down to [dst, dst+n) (dst < src) in every layer, in pieces that do
// not overlap (backends need not support overlapping copies).
void DFlashDrafter::move_rows(int64_t dst, int64_t src, int64_t n) {
  if (n <= 0 || dst == src) return;
  const int64_t kvw = cfg_.n_head_kv * cfg_.head_dim;
  const int64_t step = src - dst;
  for (int64_t done = 0; done < n; done += step) {
    const int64_t m = std::min(step, n - done);
    const size_t bytes = sizeof(float) * m * kvw;
    for (Layer& w : layers_) {
      be_.copy(w.k + (dst + done) * kvw, w.k + (src + done) * kvw, bytes);
      be_.copy(w.v + (dst + done) * kvw, w.v + (src + done) * kvw, bytes);
    }
  }
  std::copy(ctx_pos_.begin() + src, ctx_pos_.begin() + src + n, ctx_pos_.begin() + dst);
  ctx_pos_.resize(dst + n);
}

// Makes room for `incoming` rows.
void DFlashDrafter::evict(int64_t incoming) {
  const int64_t C = context_rows();
  if (C + incoming <= cap_) return;
  if (opts_.context == DrafterContextMode::kSinkWindow) {
    // Only reached when appended rows overflow between evictions (cannot happen: append_chunk
    // evicts after each chunk); kept for safety.
    move_rows(opts_.sink, C - opts_.window, opts_.window);
    return;
  }
  // Reference: rows that no future block can see (position <= end_after - window) go.
  const int64_t end_after = ctx_end_ + incoming;
  const int64_t first_visible = end_after - keep_;  // positions >= this stay
  const auto it = std::lower_bound(ctx_pos_.begin(), ctx_pos_.end(), first_visible);
  const int64_t drop = it - ctx_pos_.begin();
  move_rows(0, drop, C - drop);
  DFLASH_CHECK(context_rows() + incoming <= cap_, "drafter context: {} rows + {} incoming exceed the capacity {}",
               context_rows(), incoming, cap_);
}

void DFlashDrafter::append_chunk(const float* taps, bool on_device, int64_t rows) {
  const int64_t E = cfg_.n_embd, B = cfg_.block_size;
  evict(rows);
  const int64_t C = context_rows();
  std::vector<int32_t> pos(rows), slot(rows);
  for (int64_t r = 0; r < rows; ++r) {
    pos[r] = static_cast<int32_t>(ctx_end_ + r);
    slot[r] = static_cast<int32_t>(C + r);  // K/V store rows: the stored context grows by `rows`
  }
  const size_t tap_bytes = sizeof(float) * rows * cfg_.n_taps() * E;
  if (on_device)
    be_.copy(taps_, taps, tap_bytes);  // ~1 us: the ops below then read one fixed buffer
  else
    be_.upload(taps_, taps, tap_bytes);
  be_.upload(d_pos_, pos.data(), sizeof(int32_t) * rows);
  be_.upload(d_ctx_slot_, slot.data(), sizeof(int32_t) * rows);
  auto ops = [&] {
    be_.matmul(fc_, taps_, c_, rows);  // [rows, E]
    be_.rms_norm(c_, enc_norm_, c_, rows, E, cfg_.rms_eps);
    for (Layer& w : layers_) {
      const Backend::MatmulOut kv[] = {{&w.wk, kb_}, {&w.wv, vb_}};
      be_.matmul_group(kv, c_, rows);
      be_.attention_prep(kv_prep(w, 0, d_ctx_slot_, rows));  // k norm + rope, both into the context rows
    }
  };
  // A speculative cycle appends 1..B rows: every pointer is fixed (positions and store rows are in
  // backend memory), so these replay as graphs, one per row count; longer (prompt) chunks run directly.
  if (rows <= B)
    graphs_.run(kAppendGraphKey | static_cast<uint64_t>(rows), ops);
  else
    ops();
  for (int64_t r = 0; r < rows; ++r) ctx_pos_.push_back(ctx_end_ + r);
  ctx_end_ += rows;
  if (opts_.context == DrafterContextMode::kSinkWindow && context_rows() > keep_)
    move_rows(opts_.sink, context_rows() - opts_.window, opts_.window);
}

void DFlashDrafter::append_context(std::span<const float> taps, int64_t rows) {
  const int64_t width = cfg_.n_taps() * cfg_.n_embd;
  DFLASH_CHECK(rows >= 0 && static_cast<int64_t>(taps.size()) == rows * width,
               "drafter context: {} floats of taps for {} rows of {} features", taps.size(), rows, width);
  append_rows(taps.data(), false, rows);
}

void DFlashDrafter::append_context_device(const float* taps, int64_t rows) {
  DFLASH_CHECK(rows >= 0 && (rows == 0 || taps != nullptr), "drafter context: {} rows of device taps at null",
               rows);
  append_rows(taps, true, rows);
}

int64_t DFlashDrafter::context_keep() const {
  const bool bounded = opts_.context == DrafterContextMode::kSinkWindow || cfg_.sliding_window > 0;
  return bounded ? keep_ : INT64_MAX;
}

void DFlashDrafter::skip_context(int64_t rows) {
  if (rows == 0) return;
  DFLASH_CHECK(rows > 0 && context_keep() != INT64_MAX,
               "drafter context: skipping {} rows needs a bounded context (sliding window or sink + window)", rows);
  // Everything stored is older than the skipped rows, hence dead too (reference mode).
  if (opts_.context == DrafterContextMode::kReference) ctx_pos_.clear();
  ctx_end_ += rows;
}

void DFlashDrafter::append_rows(const float* taps, bool on_device, int64_t rows) {
  const int64_t width = cfg_.n_taps() * cfg_.n_embd;
  // Rows that are dead as soon as this append ends are skipped (a long prompt projects only its
  // tail): reference mode keeps the last window-1 positions; sink/window mode, like the seed,
  // appends only the last sink+window rows of a batch.
  const int64_t keep = context_keep();
  const int64_t skip = keep < rows ? rows - keep : 0;
  skip_context(skip);
  for (int64_t r = skip; r < rows; r += opts_.append_chunk) {
    const int64_t m = std::min(opts_.append_chunk, rows - r);
    append_chunk(taps + r * width, on_device, m);
  }
}

std::pair<int32_t, int32_t> DFlashDrafter::key_range(int64_t P, int64_t i) const {
  const int64_t C = context_rows();
  int64_t lo = 0;
  if (cfg_.sliding_window > 0) {
    // context key j is visible iff (P + i) - pos_j < window
    const int64_t first = P + i - cfg_.sliding_window + 1;
    lo = std::lower_bound(ctx_pos_.begin(), ctx_pos_.end(), first) - ctx_pos_.begin();
  }
  const int64_t hi = cfg_.causal ? C + i + 1 : C + cfg_.block_size;
  return {static_cast<int32_t>(lo), static_cast<int32_t>(hi)};
}

// ---------------------------------------------------------------------------------------------
// Forward

const int32_t* Drafter::draft_device(int32_t) {
  throw Error("internal: this drafter drafts on the host only (drafts_on_device() is false)");
}
void Drafter::append_context_device(const float*, int64_t) {
  throw Error("internal: this drafter takes host taps only (drafts_on_device() is false)");
}
void Drafter::skip_context(int64_t) {
  throw Error("internal: this drafter keeps every context row (context_keep() is unbounded)");
}

const int32_t* DFlashDrafter::draft_device(int32_t anchor) {
  const int64_t B = cfg_.block_size, E = cfg_.n_embd;
  const int64_t V = target_.config().n_vocab, rows = B - 1;
  DFLASH_CHECK(anchor >= 0 && anchor < V, "drafter: anchor token {} outside the vocabulary of {}", anchor, V);
  const int64_t P = ctx_end_, C = context_rows();

  std::vector<int32_t> ids(B, cfg_.mask_token), pos(B), range(2 * B), slot(B);
  ids[0] = anchor;
  for (int64_t i = 0; i < B; ++i) {
    pos[i] = static_cast<int32_t>(P + i);
    slot[i] = static_cast<int32_t>(C + i);  // block keys/values follow the context rows
    const auto [lo, hi] = key_range(P, i);
    range[2 * i] = lo;
    range[2 * i + 1] = hi;
  }
  be_.upload(d_ids_, ids.data(), sizeof(int32_t) * B);
  be_.upload(d_pos_, pos.data(), sizeof(int32_t) * B);
  be_.upload(d_range_, range.data(), sizeof(int32_t) * 2 * B);
  be_.upload(d_slot_, slot.data(), sizeof(int32_t) * B);
  graphs_.run(0, [&] { draft_ops(); });

  trace_ = DraftTrace{};
  trace_.position = P;
  if (keep_trace_) {  // diagnostics: the host waits here
    trace_.hidden.resize(static_cast<size_t>(B * E));
    be_.download(trace_.hidden.data(), n_, sizeof(float) * B * E);
    trace_.logits.resize(static_cast<size_t>(rows * V));
    be_.download(trace_.logits.data(), logits_, sizeof(float) * rows * V);
    if (cfg_.dflash2()) {
      const int64_t k = cfg_.selector_top_k, R = cfg_.selector_rank;
      trace_.candidates.resize(rows * k);
      trace_.candidate_logits.resize(rows * k);
      trace_.selector_hidden.resize(rows * R);
      be_.download(trace_.candidates.data(), d_topk_ids_, sizeof(int32_t) * rows * k);
      be_.download(trace_.candidate_logits.data(), d_topk_vals_, sizeof(float) * rows * k);
      be_.download(trace_.selector_hidden.data(), g_, sizeof(float) * rows * R);
    }
  }
  return d_block_;
}

std::vector<int32_t> DFlashDrafter::draft(int32_t anchor) {
  const int32_t* block = draft_device(anchor);
  trace_.tokens.resize(static_cast<size_t>(cfg_.block_size - 1));
  be_.download(trace_.tokens.data(), block + 1, sizeof(int32_t) * trace_.tokens.size());
  return trace_.tokens;
}

// The attention inputs of layer w for `rows` rows (keys at d_pos_, cache rows `slots`): with n_head > 0
// also the block's queries q_ (in place).
Backend::AttentionPrep DFlashDrafter::kv_prep(Layer& w, int64_t n_head, const int32_t* slots, int64_t rows) {
  Backend::AttentionPrep p;
  if (n_head > 0) {
    p.qg = q_;
    p.q = q_;
    p.q_norm = w.q_norm;
  }
  p.k = kb_;
  p.v = vb_;
  p.k_norm = w.k_norm;
  p.pos = d_pos_;
  p.slot = slots;
  p.k_cache = w.k;
  p.v_cache = w.v;
  p.cache_rows = cap_ + cfg_.block_size;
  p.M = rows;
  p.n_head = n_head;
  p.n_head_kv = cfg_.n_head_kv;
  p.head_dim = cfg_.head_dim;
  p.n_rot = cfg_.n_rot;
  p.theta = cfg_.rope_theta;
  p.eps = cfg_.rms_eps;
  return p;
}

void DFlashDrafter::draft_ops() {
  const int64_t B = cfg_.block_size, E = cfg_.n_embd, hd = cfg_.head_dim;
  const int64_t H = cfg_.n_head, Hkv = cfg_.n_head_kv;
  const int64_t K = cfg_.conv_kernel, G = cfg_.conv_groups(), P2 = cfg_.conv_proj_out();
  const int64_t V = target_.config().n_vocab, rows = B - 1;
  target_.embed(d_ids_, x_, B);  // the target's embedding (prism inverse rotation included)
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (Layer& w : layers_) {
    // ---- attention
    // the norm (CUDA: with the next matmul's activation quantization in the same kernel)
    be_.residual_norm_rotate(x_, nullptr, 1, w.attn_norm, n_, nullptr, {}, B, E, cfg_.rms_eps);
    const float* ain = n_;
    if (K > 0) {
      be_.matmul(w.attn_conv_proj, n_, dyn_, B);  // [B, 2 stages, K, G]
      be_.dflash_conv(n_, w.attn_conv_base, dyn_, P2, nullptr, u_, B, E, K, cfg_.conv_group);
      ain = u_;
    }
    // q, k, v share their input: one launch where the backend can (same values as three matmuls)
    const Backend::MatmulOut qkv[] = {{&w.wq, q_}, {&w.wk, kb_}, {&w.wv, vb_}};
    be_.matmul_group(qkv, ain, B);
    // q and k norms and rope; block keys/values go after the context rows (slots in device memory: one
    // graph every draft)
    be_.attention_prep(kv_prep(w, H, d_slot_, B));
    be_.attention(q_, w.k, w.v, d_range_, attn_, B, H, Hkv, hd, scale);
    if (K > 0) {  // the conv reads the output (as matmul_parts' parts) and adds the residual
      const int parts = be_.matmul_parts(w.wo, attn_, o_, B, Backend::kMaxMatmulParts * B);
      be_.dflash_conv_parts(o_, parts, w.attn_conv_base + K * E, dyn_ + K * G, P2, x_, x_, B, E, K, cfg_.conv_group);
    } else {
      be_.matmul(w.wo, attn_, o_, B);
      be_.add(x_, o_, x_, B * E);
    }
    // ---- MLP
    be_.residual_norm_rotate(x_, nullptr, 1, w.ffn_norm, n_, nullptr, {}, B, E, cfg_.rms_eps);
    const float* fin = n_;
    if (K > 0) {
      be_.matmul(w.ffn_conv_proj, n_, dyn_, B);
      be_.dflash_conv(n_, w.ffn_conv_base, dyn_, P2, nullptr, u_, B, E, K, cfg_.conv_group);
      fin = u_;
    }
    const Backend::MatmulOut gate_up[] = {{&w.ffn_gate, gate_}, {&w.ffn_up, up_}};
    be_.matmul_group(gate_up, fin, B);
    be_.swiglu_rotate(gate_, up_, act_, {}, B, cfg_.n_ff);
    if (K > 0) {
      const int parts = be_.matmul_parts(w.ffn_down, act_, o_, B, Backend::kMaxMatmulParts * B);
      be_.dflash_conv_parts(o_, parts, w.ffn_conv_base + K * E, dyn_ + K * G, P2, x_, x_, B, E, K, cfg_.conv_group);
    } else {
      be_.matmul(w.ffn_down, act_, o_, B);
      be_.add(x_, o_, x_, B * E);
    }
  }
  be_.rms_norm(x_, out_norm_, n_, B, E, cfg_.rms_eps);  // h [B, E]
  const float* h1 = n_ + E;                              // rows 1..B-1 predict the block's tokens
  // The target's head, no target final norm. Where the backend runs more rows faster (CUDA: 8), the
  // head also takes head_extra_ rows before row 1 (the anchor's) into the logits rows before logits_.
  target_.lm_head(h1 - head_extra_ * E, logits_ - head_extra_ * V, rows + head_extra_);
  be_.copy(d_block_, d_ids_, sizeof(int32_t));  // the verify block starts with the anchor
  if (!cfg_.dflash2()) {
    be_.argmax(logits_, d_block_ + 1, rows, V);
    return;
  }
  const int64_t k = cfg_.selector_top_k, R = cfg_.selector_rank;
  be_.top_k(logits_, d_topk_ids_, d_topk_vals_, rows, V, k);
  be_.matmul(sel_hidden_, h1, g_, rows);  // g = selector_hidden . h_p  [rows, R]
  // The codebook rows the walk can touch: the anchor's and every candidate's predecessor row (but the
  // last block row's: nothing follows it), every candidate's successor row.
  be_.get_rows(sel_pred_, d_ids_, pred_rows_, 1);
  if (rows > 1) be_.get_rows(sel_pred_, d_topk_ids_, pred_rows_ + R, (rows - 1) * k);
  be_.get_rows(sel_succ_, d_topk_ids_, succ_rows_, rows * k);
  be_.selector_walk(pred_rows_, succ_rows_, d_topk_ids_, d_topk_vals_, g_, d_block_ + 1, rows, k, R);
}

}  // namespace dflash
