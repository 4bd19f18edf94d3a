// The op interface: everything a model forward needs, implemented once per backend.
//
// Models (src/models/*.cpp) are written once against this interface; the CPU backend
// (src/ops/cpu/) is the reference, the CUDA backend (src/ops/cuda/) is checked against it.
//
// Conventions
//  - All activations are float32, row-major. A "row" is one token position. Shapes are written
//    [rows, cols]; a per-head view [M, heads, head_dim] is the same memory as [M, heads*head_dim].
//  - Every pointer is a backend pointer (device memory for CUDA) obtained from alloc(), including
//    the int32 arrays (token ids, positions, key ranges): a step has fixed shapes and pointers, so it
//    can be captured in a CUDA graph and replayed.
//  - Ops are enqueued in order; the CPU backend runs them immediately. download() and
//    synchronize() are the only points where the host waits.
//  - Lossless contract (SPEC 5.5): every op computes each row with a reduction order that depends
//    only on that row's data and the op's fixed sizes, never on the number of rows M. So a row
//    gets the same bits whether it is processed alone (decode) or in a block (verify).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "quant/types.h"

namespace dflash {

// A weight matrix in its file type: `out` rows of `in` elements each (GGUF ne = [in, out]).
struct WeightRef {
  const void* data = nullptr;  // backend pointer to out * row_bytes bytes
  GgmlType type = GgmlType::F32;
  int64_t in = 0;
  int64_t out = 0;
  size_t row_bytes = 0;
  bool valid() const { return data != nullptr; }
};

// Parameters of the Gated DeltaNet recurrence (SPEC 2.4), per layer.
struct GdnShape {
  int64_t n_k_heads = 16;   // K (and Q) heads
  int64_t n_v_heads = 48;   // V heads (a multiple of n_k_heads); V head p reads K head p % n_k_heads
  int64_t head_k = 128;     // key dim per head (state rows)
  int64_t head_v = 128;     // value dim per head (state cols)
};

// ---- step graphs ---------------------------------------------------------------------------------
// A recorded sequence of ops (a CUDA graph): replaying it runs the same kernels on the same pointers
// and sizes; the values in backend memory (token ids, positions, key ranges) may change between
// replays. Made by Backend::end_capture().
class StepGraph {
 public:
  virtual ~StepGraph() = default;
  virtual void launch() = 0;  // enqueue one replay (asynchronous, like any op)
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;

  // ---- memory -------------------------------------------------------------------------------
  virtual void* alloc(size_t bytes) = 0;  // zero-initialised
  virtual void release(void* ptr) = 0;
  virtual void upload(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void download(void* host_dst, const void* src, size_t bytes) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;  // device to device
  // Independent copies (no job's range overlaps another's): each as copy(); a backend may run them
  // together (CUDA: one launch).
  struct CopyJob {
    void* dst = nullptr;
    const void* src = nullptr;
    size_t bytes = 0;
  };
  virtual void copy_batch(std::span<const CopyJob> jobs) {
    for (const CopyJob& j : jobs) copy(j.dst, j.src, j.bytes);
  }
  virtual void fill_zero(void* dst, size_t bytes) = 0;
  virtual void synchronize() = 0;
  // Weights: the backend may keep the file's bytes in place (CPU, mmap) or upload them (CUDA).
  virtual WeightRef upload_weight(const void* host_data, GgmlType type, int64_t in, int64_t out) = 0;

  // Rows per prefill forward that suit this backend (TargetOptions::max_rows = 0): the CPU gains
  // little past 64; CUDA's tensor-core prefill kernels want long chunks (pp512 on the 27B, H200:
  // 1830 tok/s at 64 rows, 2295 at 256, 2449 at 512).
  virtual int64_t prefill_rows() const { return 64; }

  // The row count at which a matmul of `rows` rows runs fastest when up to `room` rows are available
  // (>= rows, <= room): a caller that holds spare input rows (the drafter's lm_head: 7 rows of a block of
  // 8) may compute these extra rows and ignore them. Each row's bits never depend on M, so this is speed
  // only. CPU: rows (every row costs). CUDA: 8 for 5..7 rows (the kernels built for exactly 8 rows; the
  // drafter's 7-row lm_head, RESULTS round 30).
  virtual int64_t matmul_rows_for(int64_t rows, int64_t room) const {
    (void)room;
    return rows;
  }
  // The rule of a backend whose kernels are built for exactly 8 rows (CUDA; the test backend that replays
  // recordings as CUDA does): 5..7 rows run as 8 where the caller has the room.
  static int64_t rows_as_full_tile(int64_t rows, int64_t room) {
    return rows >= 5 && rows < 8 && room >= 8 ? 8 : rows;
  }

  // ---- linear algebra -----------------------------------------------------------------------
  // y[M, w.out] = x[M, w.in] . w^T  (each y[m][o] = dot_row(w row o, x row m)).
  virtual void matmul(const WeightRef& w, const float* x, float* y, int64_t M) = 0;
  // The same product for prefill chunks, whose rows are never compared with one-row results: a
  // backend may use a kernel whose rounding depends on M (tensor cores on CUDA). The lossless
  // contract does not hold here; decode and verify use matmul(). Default: matmul().
  virtual void matmul_prefill(const WeightRef& w, const float* x, float* y, int64_t M) { matmul(w, x, y, M); }
  // One input, several weights (attention q|k|v, GDN qkv|z, FFN gate|up): y_i[M, w_i.out] =
  // x[M, in] . w_i^T, every w_i.in the same, no y_i overlapping x. Row m of each y_i depends only on
  // row m of x and on the group (never on M), but a backend may sum in another order than matmul()
  // of w_i alone (CUDA: one launch with one k split for the whole group). Default: matmul() each.
  struct MatmulOut {
    const WeightRef* w;
    float* y;
  };
  virtual void matmul_group(std::span<const MatmulOut> outs, const float* x, int64_t M) {
    for (const MatmulOut& o : outs) matmul(*o.w, x, o.y, M);
  }
  // matmul_prefill of weights sharing the input (prefill chunks; rounding may depend on M and the group).
  // Default: matmul_prefill() each.
  virtual void matmul_prefill_group(std::span<const MatmulOut> outs, const float* x, int64_t M) {
    for (const MatmulOut& o : outs) matmul_prefill(*o.w, x, o.y, M);
  }
  // matmul() for a product that only a residual op reads (residual_norm_rotate's res, add_parts): y
  // receives it whole (returns 1) or as `parts` partial products over a split of w.in, [parts][M][w.out]
  // (part stride M * w.out floats), whose sum in part order, ((p0 + p1) + p2) + ..., has the bits of
  // matmul()'s y; parts * M <= y_rows, the rows y holds. CUDA: the k-split matmul leaves its reduction
  // to the norm kernel that reads the residual anyway (no cluster, no reduction step). Default: matmul().
  static constexpr int kMaxMatmulParts = 8;  // the most parts any backend returns
  virtual int matmul_parts(const WeightRef& w, const float* x, float* y, int64_t M, int64_t y_rows) {
    (void)y_rows;
    matmul(w, x, y, M);
    return 1;
  }
  // parts[0 .. n) = ((p0 + p1) + p2) + ... of `count` parts [count][n] (matmul_parts' product, written
  // over the first part). Default: add() in part order.
  virtual void sum_parts(float* parts, int count, int64_t n) {
    for (int p = 1; p < count; ++p) add(parts, parts + p * n, parts, n);
  }
  // y[M, w.in] = rows ids[M] of w, dequantized (embedding lookup).
  virtual void get_rows(const WeightRef& w, const int32_t* ids, float* y, int64_t M) = 0;

  // ---- normalisation ------------------------------------------------------------------------
  // y[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * (w ? w : 1), rows of n, for `rows` rows (in-place ok).
  virtual void rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps) = 0;
  // y[r] = x[r] * rsqrt(sum(x[r]^2) + eps) * scale  (GDN q/k l2norm; in-place ok).
  virtual void l2_norm(const float* x, float* y, int64_t rows, int64_t n, float eps, float scale) = 0;
  // GDN output norm: y[r] = rms_norm(x[r]) * w * silu(z[r]), rows of n (one V head per row).
  virtual void rms_norm_gated(const float* x, const float* w, const float* z, float* y, int64_t rows, int64_t n,
                              float eps) = 0;

  // ---- elementwise --------------------------------------------------------------------------
  virtual void add(const float* a, const float* b, float* y, int64_t n) = 0;             // y = a + b
  virtual void swiglu(const float* gate, const float* up, float* y, int64_t n) = 0;      // y = silu(g) * u
  virtual void mul_sigmoid(const float* x, const float* gate, float* y, int64_t n) = 0;  // y = x * sigmoid(g)
  // Strided 2-D copy: dst[r][0..cols) = src[r][0..cols), for `rows` rows with the given row strides.
  virtual void copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                         int64_t cols) = 0;
  // Indexed store: dst[idx[m]][0..cols) = src[m][0..cols) for m < M, rows dst_stride floats apart in a
  // destination of dst_rows rows. idx is backend memory, so a step that writes its keys to a moving
  // cache position stays the same graph every step. An index outside [0, dst_rows) is an error (CPU)
  // or skips that row (CUDA: device memory is not checked on the host).
  virtual void scatter_rows(float* dst, int64_t dst_stride, int64_t dst_rows, const int32_t* idx, const float* src,
                            int64_t src_stride, int64_t M, int64_t cols) = 0;

  // ---- prism Hadamard (SPEC 3) ---------------------------------------------------------------
  // Forward, for a rotated matmul's input: y[r] = H_blk(signs (.) x[r]) per `block`-chunk (1024 in
  // Bonsai files; prism.hadamard.block_size, a power of two dividing n).
  // Inverse, for an embedding row: y[r] = signs (.) H_blk(x[r]). signs may be null (all +1).
  // `perm` (may be null; forward only, an inverse with a perm is rejected): x is first gathered,
  // x'[i] = x[perm[i]] (ssm_out's grouped V order, prism::ssm_out_permutation). n: a multiple of block.
  // y may equal x.
  virtual void hadamard(const float* x, const float* signs, const int32_t* perm, float* y, int64_t rows, int64_t n,
                        int64_t block, bool inverse) = 0;

  // ---- matmul inputs: norm or gate, then rotation (SPEC 3: rotate once per input) -------------------
  // Each writes a matmul's input row by row; with rot.block > 0 the row is then rotated (the forward
  // hadamard() above, with rot.signs and rot.perm) into y. The defaults are the op sequences written
  // out below; a backend may fuse them (CUDA: one kernel that also quantizes the matmul input for the
  // ternary kernel that reads it next). Rows are independent: nothing depends on the number of rows.
  struct Rotation {
    const float* signs = nullptr;    // may be null (all +1)
    const int32_t* perm = nullptr;   // may be null
    int64_t block = 0;               // 0: no rotation
    // A promise about perm: it moves whole groups of perm_group consecutive elements (perm[i] -
    // perm[i - i % perm_group] == i % perm_group); 0: no promise. Lets a backend fuse a per-head op
    // with the gather (gated_norm_rotate with perm_group == head_dim).
    int64_t perm_group = 0;
  };
  // if res: x += res (x updated); n = rms_norm(x, w, eps); if rot: y = H(n), else y unused (may be
  // null; the matmul input is n). x, n, y distinct. res_parts > 1: res holds matmul_parts' parts
  // [res_parts][rows][dim] and the residual is their sum in part order (the parts may be overwritten).
  virtual void residual_norm_rotate(float* x, float* res, int res_parts, const float* w, float* n, float* y,
                                    const Rotation& rot, int64_t rows, int64_t dim, float eps) {
    if (res && res_parts > 1) sum_parts(res, res_parts, rows * dim);
    if (res) add(x, res, x, rows * dim);
    rms_norm(x, w, n, rows, dim, eps);
    if (rot.block > 0) hadamard(n, rot.signs, rot.perm, y, rows, dim, rot.block, /*inverse=*/false);
  }
  // y = swiglu(gate, up), then rotated in place when rot. y distinct from gate and up.
  virtual void swiglu_rotate(const float* gate, const float* up, float* y, const Rotation& rot, int64_t rows,
                             int64_t dim) {
    swiglu(gate, up, y, rows * dim);
    if (rot.block > 0) hadamard(y, rot.signs, rot.perm, y, rows, dim, rot.block, /*inverse=*/false);
  }
  // y = x * sigmoid(gate) (the gated attention output), then rotated in place when rot. y may equal x.
  virtual void sigmoid_gate_rotate(const float* x, const float* gate, float* y, const Rotation& rot, int64_t rows,
                                   int64_t dim) {
    mul_sigmoid(x, gate, y, rows * dim);
    if (rot.block > 0) hadamard(y, rot.signs, rot.perm, y, rows, dim, rot.block, /*inverse=*/false);
  }
  // y = rms_norm_gated(x, w, z) over heads of head_dim (w has head_dim values), then rotated in place
  // when rot. y may equal x.
  virtual void gated_norm_rotate(const float* x, const float* w, const float* z, float* y, const Rotation& rot,
                                 int64_t rows, int64_t dim, int64_t head_dim, float eps) {
    rms_norm_gated(x, w, z, y, rows * (dim / head_dim), head_dim, eps);
    if (rot.block > 0) hadamard(y, rot.signs, rot.perm, y, rows, dim, rot.block, /*inverse=*/false);
  }

  // ---- attention ----------------------------------------------------------------------------
  // NeoX RoPE in place on x[M, heads, head_dim]: the first n_rot dims of each head, pairs (i, i + n_rot/2),
  // angle pos[m] * theta^(-2i/n_rot).
  virtual void rope_neox(float* x, const int32_t* pos, int64_t M, int64_t heads, int64_t head_dim, int64_t n_rot,
                         float theta) = 0;
  // The attention block's inputs prepared in one op (CUDA: one kernel where the sequence below takes up
  // to eight). M rows, n_head query heads and n_head_kv key/value heads of head_dim:
  //   qg: with gate != null, rows [n_head][q | gate] (2 head_dim per head): gate gets the second halves
  //       (copy) and the first halves are the queries; else qg holds the queries [n_head][head_dim] and
  //       may equal q. n_head may be 0 (keys and values only: q, qg, gate, q_norm unused).
  //   q = rope(rms_norm(query, q_norm)), k = rope(rms_norm(k, k_norm)) in place (NeoX, n_rot dims,
  //   positions pos), then k_cache[slot[m]] = k[m] and v_cache[slot[m]] = v[m] (rows of
  //   n_head_kv * head_dim floats in caches of cache_rows rows, as scatter_rows).
  // The default is that op sequence; a backend that fuses it gives every element the same bits.
  struct AttentionPrep {
    const float* qg = nullptr;
    float* q = nullptr;
    float* gate = nullptr;
    float* k = nullptr;
    const float* v = nullptr;
    const float* q_norm = nullptr;
    const float* k_norm = nullptr;
    const int32_t* pos = nullptr;   // [M], backend memory
    const int32_t* slot = nullptr;  // [M], backend memory: cache rows
    float* k_cache = nullptr;
    float* v_cache = nullptr;
    int64_t cache_rows = 0;
    int64_t M = 0, n_head = 0, n_head_kv = 0, head_dim = 0, n_rot = 0;
    float theta = 0.0f, eps = 0.0f;
  };
  virtual void attention_prep(const AttentionPrep& p) {
    const int64_t hd = p.head_dim, kvw = p.n_head_kv * p.head_dim;
    if (p.n_head > 0) {
      const float* query = p.qg;
      if (p.gate) {
        copy_rows(p.q, hd, p.qg, 2 * hd, p.M * p.n_head, hd);
        copy_rows(p.gate, hd, p.qg + hd, 2 * hd, p.M * p.n_head, hd);
        query = p.q;
      }
      rms_norm(query, p.q_norm, p.q, p.M * p.n_head, hd, p.eps);
    }
    rms_norm(p.k, p.k_norm, p.k, p.M * p.n_head_kv, hd, p.eps);
    if (p.n_head > 0) rope_neox(p.q, p.pos, p.M, p.n_head, hd, p.n_rot, p.theta);
    rope_neox(p.k, p.pos, p.M, p.n_head_kv, hd, p.n_rot, p.theta);
    scatter_rows(p.k_cache, kvw, p.cache_rows, p.slot, p.k, kvw, p.M, kvw);
    scatter_rows(p.v_cache, kvw, p.cache_rows, p.slot, p.v, kvw, p.M, kvw);
  }
  // out[M, n_heads, head_dim] = softmax(q . K^T * scale) V over the keys kv_range[m] = [lo, hi) of the
  // caches k/v [n_keys, n_kv_heads, head_dim] (row stride n_kv_heads*head_dim). Head h reads KV head
  // h / (n_heads / n_kv_heads). kv_range is an int32 array [M, 2].
  virtual void attention(const float* q, const float* k, const float* v, const int32_t* kv_range, float* out,
                         int64_t M, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale) = 0;
  // attention(), then sigmoid_gate_rotate(out, gate, y, rot, M, n_heads * head_dim): the gated attention
  // output and wo's input rotation as one op (CUDA: the key segments' merge, the gate, the rotation and
  // wo's activation quantization in one kernel). out gets the attention output unless y == out.
  virtual void attention_gate_rotate(const float* q, const float* k, const float* v, const int32_t* kv_range,
                                     float* out, const float* gate, float* y, const Rotation& rot, int64_t M,
                                     int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale) {
    attention(q, k, v, kv_range, out, M, n_heads, n_kv_heads, head_dim, scale);
    sigmoid_gate_rotate(out, gate, y, rot, M, n_heads * head_dim);
  }
  // The same attention for long prefill chunks, whose rows are never compared with one-row results
  // (like matmul_prefill): a backend may use a kernel whose rounding depends on M and on which rows
  // share a tile (CUDA: tf32 tensor cores, ~1e-7 NMSE from attention()). The lossless contract does not
  // hold here; decode and verify use attention(). Default: attention().
  virtual void attention_prefill(const float* q, const float* k, const float* v, const int32_t* kv_range, float* out,
                                 int64_t M, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale) {
    attention(q, k, v, kv_range, out, M, n_heads, n_kv_heads, head_dim, scale);
  }

  // ---- Gated DeltaNet (SPEC 2.4) ------------------------------------------------------------
  // Causal depthwise conv over time + SiLU: for each channel c and row m,
  //   y[m][c] = silu( sum_{j<K} w[c][j] * in[m - (K-1) + j][c] ),
  // where rows before 0 come from state[K-1, C] (oldest first). w is the GGUF conv1d [K, C]
  // (ne = [K, C]: K taps contiguous per channel). Updates state to the last K-1 inputs. y may equal x.
  // state_before: null, or [K-1, C] that receives the state as it was before the rows (verify's undo
  // checkpoint; must not overlap state). CUDA writes it from the window it loads anyway (no copy launch).
  virtual void gdn_conv(const float* x, float* state, float* state_before, const float* w, float* y, int64_t M,
                        int64_t C, int64_t K) = 0;
  // gdn_conv (above) and, beside it, matmul_group(outs, mx, M): GDN's alpha | beta projections of the layer
  // input. Neither reads what the other writes and the recurrence reads both, so a backend may run them
  // as one launch (CUDA: the projections' CTAs beside the conv's). Default: matmul_group, then gdn_conv.
  virtual void gdn_conv_and_matmuls(std::span<const MatmulOut> outs, const float* mx, const float* x, float* state,
                                    float* state_before, const float* w, float* y, int64_t M, int64_t C, int64_t K) {
    matmul_group(outs, mx, M);
    gdn_conv(x, state, state_before, w, y, M, C, K);
  }
  // GDN's input side of a decode / verify step: matmul_group({w_qkv -> conv_in, w_z -> z}, x, M), then
  // gdn_conv_and_matmuls(ab, mx, conv_in, state, state_before, conv_w, conv_out, M, C, K) (C = w_qkv's
  // out). A backend may run it as one launch (CUDA: alpha | beta's CTAs beside the projections', and each
  // qkv tile's conv of its channels after its stores) with the bits of the ops apart. Default: that op
  // sequence.
  virtual void gdn_input(const WeightRef& w_qkv, const WeightRef& w_z, const float* x, float* conv_in, float* z,
                         std::span<const MatmulOut> ab, const float* mx, float* state, float* state_before,
                         const float* conv_w, float* conv_out, int64_t M, int64_t C, int64_t K) {
    const MatmulOut outs[2] = {{&w_qkv, conv_in}, {&w_z, z}};
    matmul_group(outs, x, M);
    gdn_conv_and_matmuls(ab, mx, conv_in, state, state_before, conv_w, conv_out, M, C, K);
  }
  // Gates: beta[M, Hv] = sigmoid(b), g[M, Hv] = a_log_decay * softplus(a + dt_bias) (in place into b, a).
  virtual void gdn_gates(float* a, float* b, const float* dt_bias, const float* ssm_a, int64_t M,
                         int64_t n_v_heads) = 0;
  // Prefill's split of the conv output rows [q | k | v] (row stride C = 2 Hk dk + Hv dv, heads of dk / dv)
  // into contiguous q [M, Hk dk] = l2_norm(q) * q_scale, k [M, Hk dk] = l2_norm(k) and v [M, Hv dv], per
  // head as l2_norm(x, y, rows, dk, eps, scale). The default is that op sequence (3 copy_rows, 2
  // l2_norm); a backend that fuses it gives every element the same bits.
  virtual void gdn_split_qkv(const float* conv, float* q, float* k, float* v, int64_t M, const GdnShape& sh,
                             float eps, float q_scale) {
    const int64_t C = 2 * sh.n_k_heads * sh.head_k + sh.n_v_heads * sh.head_v, qw = sh.n_k_heads * sh.head_k;
    copy_rows(q, qw, conv, C, M, qw);
    copy_rows(k, qw, conv + qw, C, M, qw);
    copy_rows(v, sh.n_v_heads * sh.head_v, conv + 2 * qw, C, M, sh.n_v_heads * sh.head_v);
    l2_norm(q, q, M * sh.n_k_heads, sh.head_k, eps, q_scale);
    l2_norm(k, k, M * sh.n_k_heads, sh.head_k, eps, 1.0f);
  }
  // The delta-rule recurrence over M rows, sequentially (q, k already l2-normed and q scaled):
  //   q, k [M, n_k_heads, head_k]; v [M, n_v_heads, head_v]; g, beta [M, n_v_heads]
  //   state_in [n_v_heads, head_k, head_v] (S[p][i][j], i = key dim, j = value dim): the state before
  //     the rows, left as it is; state receives the state after them. state_in == state updates in
  //     place; otherwise they must not overlap.
  //   out [M, n_v_heads, head_v], or null when the outputs are not wanted
  //   snapshots: null, or [M, n_v_heads*head_k*head_v]: the state after each row.
  virtual void gdn_recurrent(const float* q, const float* k, const float* v, const float* g, const float* beta,
                             const float* state_in, float* state, float* out, float* snapshots, int64_t M,
                             const GdnShape& shape) = 0;
  // gdn_prepare_recurrent's inputs as they come out of the conv and the alpha/beta matmuls. q, k, v
  // are read with row strides (floats between rows) so they may point into the conv output [M, C]
  // without copies.
  struct GdnRawInputs {
    const float* q = nullptr;  // [M, n_k_heads*head_k], rows q_stride apart, not yet l2-normed
    int64_t q_stride = 0;
    const float* k = nullptr;  // [M, n_k_heads*head_k], rows k_stride apart, not yet l2-normed
    int64_t k_stride = 0;
    const float* v = nullptr;  // [M, n_v_heads*head_v], rows v_stride apart
    int64_t v_stride = 0;
    const float* a = nullptr;  // [M, n_v_heads] alpha (packed rows)
    const float* b = nullptr;  // [M, n_v_heads] beta logits (packed rows)
    const float* dt_bias = nullptr;  // [n_v_heads]
    const float* ssm_a = nullptr;    // [n_v_heads]
  };
  // Where gdn_prepare_recurrent leaves the inputs it prepared (all packed rows) and, for an undoable
  // step (verify), the rows' updates, so that the state can be advanced over the rows that are kept.
  struct GdnPrepared {
    float* q = nullptr;     // [M, n_k_heads*head_k]
    float* k = nullptr;     // [M, n_k_heads*head_k]
    float* g = nullptr;     // [M, n_v_heads]
    float* beta = nullptr;  // [M, n_v_heads]
    // optional: [M, n_v_heads*head_v] receives each row's update delta = (v - S^T k) * beta, the vector
    // the recurrence adds as k delta^T to the decayed state. With it the op leaves `state` as it was
    // before the rows (the undo checkpoint is the state itself, nothing is copied) and
    // gdn_apply_rows_batch(k, g, delta) later advances it over the kept rows with the recurrence's bits.
    float* delta = nullptr;
  };
  static constexpr float kGdnL2Eps = 1e-6f;  // the eps of GDN's q/k l2 norms
  // The recurrence with its inputs prepared in the same op, for decode and verify (CUDA: one kernel
  // where the op sequence takes four, the q/k/v split copies included):
  //   q = l2_norm(in.q) * (1/sqrt(head_k)), k = l2_norm(in.k)  (per K head, eps kGdnL2Eps; as l2_norm)
  //   beta = sigmoid(in.b), g = ssm_a * softplus(in.a + dt_bias)  (as gdn_gates)
  //   then gdn_recurrent(q, k, v, g, beta, state, state, out, nullptr, M, shape).
  // The inputs are not modified. prepared: null, or the buffers that receive the prepared q, k, g,
  // beta: the exact values the recurrence used, so gdn_recurrent over them (and v) from the same state
  // gives this op's state and out bit for bit. With prepared->delta the op is undoable: out as always,
  // the state left as it was, the rows' updates in delta (see GdnPrepared). The buffers must not
  // overlap the inputs. Each row's prepared values depend only on that row (never on M); the backend
  // may round them differently from the separate l2_norm / gdn_gates ops (CUDA sums the squares in
  // another order).
  virtual void gdn_prepare_recurrent(const GdnRawInputs& in, float* state, float* out, const GdnPrepared* prepared,
                                     int64_t M, const GdnShape& shape) = 0;
  // Advances states over the first M rows of an undoable gdn_prepare_recurrent (rollback; and a verify
  // step whose rows are all kept): per job, for m = 0 .. M-1 in order, every element
  //   S[p][i][j] *= exp(g[m][p]);  S[p][i][j] += k[m][p % n_k_heads][i] * delta[m][p][j]
  // rounded as the backend's recurrence rounds that update, so the state is bit for bit the one the
  // recurrence over those rows leaves. k, g, delta are the op's GdnPrepared buffers. Elementwise (the
  // sums over the key dim are in delta already): CUDA runs every job in one bandwidth-bound launch.
  struct GdnApplyJob {
    const float* k = nullptr;      // [M, n_k_heads*head_k] (l2-normed, as prepared)
    const float* g = nullptr;      // [M, n_v_heads] log-decay
    const float* delta = nullptr;  // [M, n_v_heads*head_v]
    float* state = nullptr;        // [n_v_heads, head_k, head_v], advanced in place
  };
  virtual void gdn_apply_rows_batch(std::span<const GdnApplyJob> jobs, int64_t M, const GdnShape& shape) = 0;
  // The same computation in chunked (WY / UT) form for prefill: equal to gdn_recurrent up to fp32
  // rounding, much faster for long M. Backends may fall back to the recurrence. Unlike the other ops
  // its bits depend on M (a row's result depends on its chunk), so it is for prefill only; decode and
  // verify use gdn_recurrent.
  virtual void gdn_chunked(const float* q, const float* k, const float* v, const float* g, const float* beta,
                           float* state, float* out, int64_t M, const GdnShape& shape) = 0;

  // ---- sampling helpers ---------------------------------------------------------------------
  // ids[m] = argmax over x[m][0..n) (lowest index wins ties).
  virtual void argmax(const float* x, int32_t* ids, int64_t M, int64_t n) = 0;
  // The k largest of each row, sorted descending (ties: lower index first): ids[M, k], vals[M, k].
  virtual void top_k(const float* x, int32_t* ids, float* vals, int64_t M, int64_t n, int64_t k) = 0;

  // ---- step graphs (see StepGraph) -----------------------------------------------------------
  // Between begin_capture() returning true and end_capture(), ops are recorded, not run; the calls
  // that allocate or wait (alloc, release, upload, download, synchronize) are errors then. A backend
  // without graphs (the CPU) returns false and the caller runs its ops directly.
  virtual bool begin_capture() { return false; }
  virtual std::unique_ptr<StepGraph> end_capture() { return nullptr; }

  // ---- DFlash drafter (SPEC 4.2) ------------------------------------------------------------
  // Grouped dynamic causal conv over the M rows of one drafter block (row 0 reads zero padding:
  // the conv never sees the context):
  //   y[t][c] = sum_{o<K} (base[o*C + c] + d[t*d_stride + o*G + c/group]) * x[t-o][c]  (+ res[t][c])
  // with G = C / group dynamic coefficients per tap, accumulated o = 0, 1, .. K-1, then res.
  //   base: one stage of the GGUF conv_base (ne = [C, K, 2]; stage s starts at s*K*C), [K, C]
  //   d:    the stage's K*G coefficients of row 0 in conv_proj's output [M, 2*K*G] (stage s at
  //         offset s*K*G), rows d_stride floats apart
  //   res:  null, or a residual [M, C] added last (may alias y); x must not alias y.
  virtual void dflash_conv(const float* x, const float* base, const float* d, int64_t d_stride, const float* res,
                           float* y, int64_t M, int64_t C, int64_t K, int64_t group) = 0;
  // dflash_conv of an x that matmul_parts wrote as x_parts parts [x_parts][M][C]: the conv reads their
  // sum in part order (the parts may be overwritten). Default: sum_parts, then dflash_conv.
  virtual void dflash_conv_parts(float* x, int x_parts, const float* base, const float* d, int64_t d_stride,
                                 const float* res, float* y, int64_t M, int64_t C, int64_t K, int64_t group) {
    if (x_parts > 1) sum_parts(x, x_parts, M * C);
    dflash_conv(x, base, d, d_stride, res, y, M, C, K, group);
  }
  // The DFlash 2 selector's greedy walk (SPEC 4.2 step 6) over codebook rows gathered beforehand
  // with get_rows, so that drafts never visit the host inside a speculative cycle (and the walk needs
  // no codebook type):
  //   pred  [1 + (rows - 1) * top_k, rank]: row 0 is the anchor's predecessor row, row 1 + p*top_k + k
  //         the predecessor row of candidate k of block row p (p < rows - 1)
  //   succ  [rows * top_k, rank]: row p*top_k + k is the successor row of candidate k of block row p
  //   cand, unary [rows, top_k] (candidate ids and logits), g [rows, rank]
  //   out   [rows]: out[p] = cand[p][k*] with k* = argmax_k S[k] (ties and NaN: the lowest k wins, as
  //         `k == 0 || S > best`), S[k] = unary[p][k] + sum_r (pred[prev][r] * g[p][r]) * succ[p][k][r]
  //         summed over r in order from 0.0f, without fused multiply-adds; prev is the anchor for p = 0,
  //         then the previous row's choice. The host reference is selector_walk() (models/dflash_drafter.h).
  virtual void selector_walk(const float* pred, const float* succ, const int32_t* cand, const float* unary,
                             const float* g, int32_t* out, int64_t rows, int64_t top_k, int64_t rank) = 0;
};

// The CPU reference backend (always available).
std::unique_ptr<Backend> make_cpu_backend(int n_threads = 0);

// Owns a set of backend allocations and releases them when destroyed. As a member of a model it
// frees what a constructor allocated before it threw (a half-built object's destructor never runs).
class BackendArena {
 public:
  explicit BackendArena(Backend& be) : be_(be) {}
  BackendArena(const BackendArena&) = delete;
  BackendArena& operator=(const BackendArena&) = delete;
  ~BackendArena() {
    for (auto it = ptrs_.rbegin(); it != ptrs_.rend(); ++it) be_.release(*it);
  }
  // Zero-initialised backend memory of at least one byte.
  void* alloc(size_t bytes) {
    ptrs_.reserve(ptrs_.size() + 1);  // so push_back cannot throw after the allocation
    void* p = be_.alloc(bytes ? bytes : 1);
    ptrs_.push_back(p);
    return p;
  }
  template <typename T>
  T* alloc_array(size_t count) {
    return static_cast<T*>(alloc(count * sizeof(T)));
  }
  Backend& backend() const { return be_; }

 private:
  Backend& be_;
  std::vector<void*> ptrs_;
};

// RAII backend allocation of `count` elements of T.
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  DeviceArray(Backend& be, size_t count) : be_(&be), ptr_(static_cast<T*>(be.alloc(count * sizeof(T)))), n_(count) {}
  DeviceArray(DeviceArray&& o) noexcept { *this = std::move(o); }
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    if (this != &o) {
      reset();
      be_ = o.be_;
      ptr_ = o.ptr_;
      n_ = o.n_;
      o.ptr_ = nullptr;
      o.n_ = 0;
    }
    return *this;
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { reset(); }
  void reset() {
    if (ptr_) be_->release(ptr_);
    ptr_ = nullptr;
    n_ = 0;
  }
  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  size_t bytes() const { return n_ * sizeof(T); }

 private:
  Backend* be_ = nullptr;
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

}  // namespace dflash
