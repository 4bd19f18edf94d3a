// Launchers of the CUDA kernels (defined in the .cu files of this folder), called by cuda_backend.cpp.
//
// Plain C++ with CUDA runtime types only: the backend class (cuda_backend.cpp, compiled by the host
// compiler) checks arguments, throws dflash::Error and checks cudaGetLastError() after each launcher;
// the launchers only compute grids and enqueue kernels on `s`. All pointers are device pointers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "ops/cuda/mma_tail_plan.h"

namespace dflash::cuda {

// A runtime switch from the environment (cuda_backend.cpp): unset or empty -> dflt, "0" -> false, anything
// else -> true. Callers read it once (a function-local static): the switches are per process.
bool env_flag(const char* name, bool dflt);
// An integer runtime setting: unset or empty -> dflt, else its atoi value (callers clamp it).
int env_int(const char* name, int dflt);
// Streaming multiprocessors of the current device (cuda_backend.cpp); 0 when the runtime cannot say.
int current_sm_count();

// ---- weight layouts (matmul.cu) -----------------------------------------------------------------
// How a weight lives on the device.
enum class Layout : int {
  kBlocks = 0,      // the file's blocks, rows `row_stride` bytes apart (row_stride >= the file's row bytes)
  kPlanar2 = 2,     // (DFLASH_CUDA_TERNARY_MMA=0, round 1) 2-bit codes, value (code - 1) * d: codes [out][in/4] in the lane-interleaved
                    // order of matmul.cu (mm_planar2), then fp16 scales [out][in/128]
  kTernaryMma = 1,  // ternary 2-bit codes (value = (code - 1) * d) in the tensor-core fragment order of
                    // matmul_ternary.cu: codes [Np/16][in/128][16][32 B], fp16 scales [Np/16][in/128][16]
  kKQuantMma = 3,   // Q4_K / Q6_K in the tensor-core fragment order of matmul_kquant.cu: codes
                    // [Np/16][in/128][1 or 2 KB], scales [Np/16][in/128][16 rows][12 B]
};

// Rows of a kTernaryMma weight on the device: out padded to a multiple of 16 (one mma tile).
inline int64_t padded_rows(int64_t out) { return (out + 15) / 16 * 16; }

struct DevWeight {
  const uint8_t* data = nullptr;     // kBlocks: rows; kPlanar2, kTernaryMma: codes
  const uint16_t* scales = nullptr;  // kPlanar2, kTernaryMma: fp16 d per 128 elements; kKQuantMma: records
  int type = 0;                    // GgmlType id of the FILE (for kBlocks: the block format)
  Layout layout = Layout::kBlocks;
  int64_t in = 0, out = 0;
  size_t row_stride = 0;  // bytes between rows (kBlocks: file row bytes; kPlanar2: in / 4; kTernaryMma: unused)
};

// True when matmul/get_rows have a kernel for this (file type, layout).
bool matmul_supported(int type);
// y[M, out] = x[M, in] . W^T. M any; rows go in tiles of at most 8 through the same per-row arithmetic.
// Scratch of the ternary kernel: the quantized activations (its k split reduces inside a thread-block
// cluster, or leaves its parts in y for launch_matmul_parts: no memory of its own).
struct TernaryScratch {
  size_t xq_bytes = 0;
};
struct TernaryBuffers {
  void* xq = nullptr;
  bool xq_ready = false;  // xq already holds these activations (the caller's cache): skip quantizing
  // mma_tail_scratch_bytes() (mma_tail_plan.h), zeroed when allocated (the kernels leave its counts at zero): the pieces of
  // launches a little over one wave (mma_gemv.cuh, MmaTail). Null: no launch is cut into pieces.
  void* tail = nullptr;
};
// Host-side count of matmul launches with tail pieces in this process (tests check the path runs).
void note_tail_launch();
int64_t mma_tail_launches();
TernaryScratch matmul_scratch(const DevWeight& w, int64_t M);
// num_sms: the device's multiprocessors (it sets the k split of a weight, never M).
void launch_matmul(const DevWeight& w, const float* x, float* y, int64_t M, const TernaryBuffers& buf, int num_sms,
                   cudaStream_t s);
// Backend::matmul_parts: the integer-mma layouts whose k split is 2 .. max_parts write that many partial
// products [parts][M][out] to y (y must hold max_parts * M * out floats), the sum of which in part
// order has launch_matmul's bits; everything else is launch_matmul. Returns the parts written.
int launch_matmul_parts(const DevWeight& w, const float* x, float* y, int64_t M, const TernaryBuffers& buf,
                        int num_sms, int max_parts, cudaStream_t s);
// Up to kTernaryMaxGroup weights in the file's block layout, of one type (F32, F16, BF16, Q8_0) and
// input width, each with few outputs (the small-output k-split kernel: GDN alpha / beta), sharing x:
// one launch, each output's bits as its own matmul. Returns false (nothing launched) otherwise.
bool launch_matmul_split_group(const DevWeight* const* ws, float* const* ys, int n, const float* x, int64_t M,
                               cudaStream_t s);
// launch_matmul_split_group's weights over mx and, in the same launch, launch_gdn_conv over x (up to 8 rows,
// 4 taps): Backend::gdn_conv_and_matmuls. Returns false (nothing launched) when either part does not fit.
bool launch_split_group_gdn_conv(const DevWeight* const* ws, float* const* ys, int n, const float* mx, int64_t M,
                                 const float* x, float* state, float* state_before, const float* w, float* y,
                                 int64_t C, int64_t K, cudaStream_t s);
// Prefill product (Backend::matmul_prefill): a tensor-core kernel whose rounding may depend on M. The
// backend calls it from kMatmulPrefillMinRows rows (cuda_backend.h). Returns false when it has no kernel
// for this weight (the caller then uses launch_matmul).
bool launch_matmul_prefill(const DevWeight& w, const float* x, float* y, int64_t M, cudaStream_t s);
// Up to kTernaryMaxGroup ternary weights with the same `in` sharing the input x in one launch (their row
// tiles fill the same waves). Returns false when any of them has no kernel (nothing is launched then).
bool launch_matmul_prefill_group(const DevWeight* const* ws, float* const* ys, int n, const float* x, int64_t M,
                                 cudaStream_t s);
// y[M, in] = dequantized rows ids[M] (ids checked on the device: an id outside [0, out) writes NaN).
void launch_get_rows(const DevWeight& w, const int32_t* ids, float* y, int64_t M, cudaStream_t s);
// PTQ1_0 blocks (28 B / 128) -> planar 2-bit codes + scales, on the device. src: out rows of in/128 blocks.
void launch_ptq1_to_planar2(const uint8_t* src, uint8_t* codes, uint16_t* scales, int64_t in, int64_t out,
                            cudaStream_t s);
// PQ2_0 blocks (34 B / 128) -> planar 2-bit codes + scales.
void launch_pq2_to_planar2(const uint8_t* src, uint8_t* codes, uint16_t* scales, int64_t in, int64_t out,
                           cudaStream_t s);

// ---- ternary weights on tensor cores (matmul_ternary.cu) ------------------------------------------
// Device bytes of the kTernaryMma codes and scales of an out x in weight.
size_t ternary_code_bytes(int64_t in, int64_t out);
size_t ternary_scale_bytes(int64_t in, int64_t out);
// PTQ1_0 (28 B / 128, ptq1) or PQ2_0 (34 B / 128) blocks, out rows of in/128 blocks on the device ->
// kTernaryMma codes + scales.
void launch_to_ternary_mma(const uint8_t* src, bool ptq1, uint8_t* codes, uint8_t* scales, int64_t in, int64_t out,
                           cudaStream_t s);
// The activation scratch of an M-row ternary matmul (or group) with `in` inputs.
TernaryScratch ternary_scratch(int64_t in, int64_t M);
// Up to kTernaryMaxGroup ternary weights with the same `in` that share the input x, in one launch
// (y_k = x . w_k^T). The k split (CTAs per 64-row tile) is a function of the group's shapes and the
// device's SM count only, never of M, so a row's bits depend on the group, not on M; a weight in a
// group may round differently than alone.
constexpr int kTernaryMaxGroup = 4;
// The most parts of a matmul_parts product that a reader (the residual norm chain, dflash_conv_parts)
// adds: Backend::kMaxMatmulParts (cuda_backend.cpp checks that the two agree).
constexpr int kMaxParts = 8;
// max_parts > 1 (one weight): the parts of launch_matmul_parts; returns the parts written.
int launch_matmul_ternary_group(const DevWeight* const* ws, float* const* ys, int n, const float* x, int64_t M,
                                const TernaryBuffers& buf, int num_sms, cudaStream_t s, int max_parts = 1);
int launch_matmul_ternary(const DevWeight& w, const float* x, float* y, int64_t M, const TernaryBuffers& buf,
                          int num_sms, cudaStream_t s, int max_parts = 1);
void launch_get_rows_ternary(const DevWeight& w, const int32_t* ids, float* y, int64_t M, cudaStream_t s);
// Backend::gdn_input in one launch of the ternary kernel: conv_in = x . w_qkv^T and z = x . w_z^T (the
// ternary group's tiles and bits); beside them the split group's CTAs for ab (GDN beta | alpha of mx, the
// split kernel's bits); and each qkv CTA then runs gdn_conv on its channels (conv_out, state,
// state_before; the conv kernel's bits). Needs both projections kTernaryMma with w_qkv.out == C, ab BF16
// in the block layout with the split kernel's shapes, M <= 8, K == 4 and a k split of 1 for the
// projections (a function of their shapes and the device's num_sms): gdn_input_fusable. launch_gdn_input
// returns false, launching nothing, when that does not hold.
bool gdn_input_fusable(const DevWeight& w_qkv, const DevWeight& w_z, const DevWeight* const* ab, int n_ab, int64_t M,
                       int64_t C, int64_t K, int num_sms);
bool launch_gdn_input(const DevWeight& w_qkv, const DevWeight& w_z, const float* x, float* conv_in, float* z,
                      const DevWeight* const* ab, float* const* ab_y, int n_ab, const float* mx, float* state,
                      float* state_before, const float* conv_w, float* conv_out, int64_t M, int64_t C, int64_t K,
                      const TernaryBuffers& buf, int num_sms, cudaStream_t s);
// ---- Q4_K / Q6_K on tensor cores (matmul_kquant.cu) -----------------------------------------------------
// True for the types and shapes the kKQuantMma layout takes (Q4_K, Q6_K with in % 256 == 0).
bool kquant_mma_supported(int type, int64_t in);
size_t kquant_code_bytes(int type, int64_t in, int64_t out);
size_t kquant_scale_bytes(int64_t in, int64_t out);
// The file's Q4_K / Q6_K blocks (out rows on the device) -> kKQuantMma codes + scales.
void launch_to_kquant_mma(const uint8_t* src, int type, uint8_t* codes, uint8_t* scales, int64_t in, int64_t out,
                          cudaStream_t s);
// Up to kTernaryMaxGroup kKQuantMma weights of ONE type sharing the input x (the same activation
// scratch as the ternary kernel: ternary_scratch(in, M)); rows bit-identical to single-row calls.
// max_parts: as launch_matmul_ternary_group.
int launch_matmul_kquant_group(const DevWeight* const* ws, float* const* ys, int n, const float* x, int64_t M,
                               const TernaryBuffers& buf, int num_sms, cudaStream_t s, int max_parts = 1);
void launch_get_rows_kquant(const DevWeight& w, const int32_t* ids, float* y, int64_t M, cudaStream_t s);

// ---- norms and elementwise (norm.cu) --------------------------------------------------------------
void launch_rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps, cudaStream_t s);
void launch_l2_norm(const float* x, float* y, int64_t rows, int64_t n, float eps, float scale, cudaStream_t s);
void launch_rms_norm_gated(const float* x, const float* w, const float* z, float* y, int64_t rows, int64_t n,
                           float eps, cudaStream_t s);
void launch_add(const float* a, const float* b, float* y, int64_t n, cudaStream_t s);
// parts[0 .. n) = the sum of `count` parts [count][n] in part order (Backend::sum_parts).
void launch_sum_parts(float* parts, int count, int64_t n, cudaStream_t s);
void launch_swiglu(const float* g, const float* u, float* y, int64_t n, cudaStream_t s);
void launch_mul_sigmoid(const float* x, const float* g, float* y, int64_t n, cudaStream_t s);
// Device-to-device copy of `bytes` (non-overlapping) as a PDL kernel (Backend::copy).
void launch_copy(void* dst, const void* src, size_t bytes, cudaStream_t s);
// Backend::copy_batch: n copies, each 16-byte aligned with a size a multiple of 16 (the caller checks), in
// launches of up to kMaxCopyJobs (grid.y = the job).
constexpr int kMaxCopyJobs = 96;
void launch_copy_batch(void* const* dst, const void* const* src, const size_t* bytes, int n, cudaStream_t s);
void launch_copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                      int64_t cols, cudaStream_t s);
void launch_scatter_rows(float* dst, int64_t dst_stride, int64_t dst_rows, const int32_t* idx, const float* src,
                         int64_t src_stride, int64_t rows, int64_t cols, cudaStream_t s);
void launch_gdn_gates(float* a, float* b, const float* dt_bias, const float* ssm_a, int64_t M, int64_t n_v_heads,
                      cudaStream_t s);
void launch_gdn_conv(const float* x, float* state, float* state_before, const float* w, float* y, int64_t M,
                     int64_t C, int64_t K, cudaStream_t s);
// x: x_parts parts [x_parts][M][C] summed in part order as they are read (Backend::dflash_conv_parts).
void launch_dflash_conv(const float* x, int x_parts, const float* base, const float* d, int64_t d_stride,
                        const float* res, float* y, int64_t M, int64_t C, int64_t K, int64_t group, cudaStream_t s);
// dflash_conv without a residual that also writes the next integer matmul's activation records into xq
// (null: y only): y's bits are launch_dflash_conv's. Needs C % 128 == 0, M <= 65535, y 16-byte aligned.
bool dflash_conv_quantize_supported(int64_t C, int64_t M);
void launch_dflash_conv_quantize(const float* x, const float* base, const float* d, int64_t d_stride, float* y,
                                 void* xq, int64_t M, int64_t C, int64_t K, int64_t group, cudaStream_t s);

// Backend::attention_prep in one kernel (norm.cu): one CTA of norm_threads(head_dim) threads per (row,
// query head), (row, key head) and (row: the value copy). Needs head_dim <= kAttentionPrepMaxHeadDim.
struct AttentionPrepArgs {
  const float* qg;
  float* q;
  float* gate;
  float* k;
  const float* v;
  const float* q_norm;
  const float* k_norm;
  const int32_t* pos;
  const int32_t* slot;
  float* k_cache;
  float* v_cache;
  int64_t cache_rows, M, n_head, n_head_kv, head_dim, n_rot;
  float theta, eps;
};
constexpr int64_t kAttentionPrepMaxHeadDim = 1024;
void launch_attention_prep(const AttentionPrepArgs& a, cudaStream_t s);
// Backend::gdn_split_qkv in one kernel (norm.cu): conv rows [q | k | v] (Hk heads of dk, then vw floats)
// -> l2-normed q (x q_scale), k, and v. False when dk is too wide for it (the caller runs the op sequence).
bool launch_gdn_split_qkv(const float* conv, float* q, float* k, float* v, int64_t M, int64_t Hk, int64_t dk,
                          int64_t vw, float eps, float q_scale, cudaStream_t s);
// ---- Hadamard (hadamard.cu) -------------------------------------------------------------------------
// x may equal y when perm is null; with a perm the caller passes a copy of x (gather reads the whole row).
void launch_hadamard(const float* x, const float* signs, const int32_t* perm, float* y, int64_t rows, int64_t n,
                     int64_t block, bool inverse, cudaStream_t s);
// rms_norm of x + res (x updated to x + res, as add() then rms_norm() would leave it): y = norm * w.
void launch_rms_norm_residual(float* x, const float* res, const float* w, float* y, int64_t rows, int64_t n, float eps,
                              cudaStream_t s);
constexpr int64_t kHadamardMaxBlock = 8192;  // FWHT block held in shared memory

// ---- attention (attention.cu) -----------------------------------------------------------------------
void launch_rope_neox(float* x, const int32_t* pos, int64_t M, int64_t heads, int64_t head_dim, int64_t n_rot,
                      float theta, cudaStream_t s);
// Scratch floats the attention needs for M rows and n_heads heads (split-key partials).
size_t attention_scratch_floats(int64_t M, int64_t n_heads, int64_t head_dim);
void launch_attention(const float* q, const float* k, const float* v, const int32_t* kv_range, float* out,
                      int64_t M, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale, float* scratch,
                      cudaStream_t s);
constexpr int64_t kAttentionMaxHeadDim = 512;
// The segment kernels (attention_segments.cu), which launch_attention runs for head dims that are
// multiples of 4 up to kSegMaxHeadDim (DFLASH_CUDA_ATTN_SEGMENTS=0: the generic split kernel for every shape).
// False when the shape or the pointers' alignment does not suit them (nothing launched).
constexpr int64_t kSegMaxHeadDim = 256;
bool attention_segments_supported(int64_t head_dim);
bool attention_segments_enabled();  // false with DFLASH_CUDA_ATTN_SEGMENTS=0 (every shape: the generic kernel)
size_t attention_segments_scratch_floats(int64_t M, int64_t n_heads, int64_t head_dim);
bool launch_attention_segments(const float* q, const float* k, const float* v, const int32_t* kv_range, float* out,
                               int64_t M, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale,
                               float* scratch, cudaStream_t s);
// Backend::attention_gate_rotate (attention_segments.cu): the segment kernel, then one kernel that merges
// the segments, gates (out * sigmoid(gate)), rotates (prism 1024-chunks, signs; or not) and writes y and
// wo's activation records xq (null: none) for M rows. Fusable: M <= 64, head dims 128 or 256, n_heads *
// head_dim a multiple of 1024, the segment kernels enabled. Returns false (nothing launched) otherwise.
bool attention_gate_fusable(int64_t M, int64_t n_heads, int64_t head_dim);
bool launch_attention_gate_rotate(const float* q, const float* k, const float* v, const int32_t* kv_range, float* out,
                                  const float* gate, const float* signs, float* y, void* xq, int64_t M,
                                  int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale, float* scratch,
                                  bool rotate, cudaStream_t s);

// Prefill attention (attention_prefill.cu, Backend::attention_prefill): a tensor-core flash-attention kernel
// (tf32 mma, rounding that depends on the rows sharing a CTA: not lossless). Head dims 64, 128, 256 and
// M >= kAttentionPrefillMinRows; returns false for anything else (the caller runs launch_attention).
// No scratch. kv_range rows with hi <= lo (or lo < 0) get zeros.
constexpr int64_t kAttentionPrefillMinRows = 16;
bool launch_attention_prefill(const float* q, const float* k, const float* v, const int32_t* kv_range, float* out,
                              int64_t M, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale,
                              cudaStream_t s);

// ---- Gated DeltaNet recurrence (gdn.cu) ---------------------------------------------------------------
void launch_gdn_recurrent(const float* q, const float* k, const float* v, const float* g, const float* beta,
                          const float* state_in, float* state, float* out, float* snapshots, int64_t M,
                          int64_t n_k_heads, int64_t n_v_heads, int64_t head_k, int64_t head_v, cudaStream_t s);
// Backend::gdn_prepare_recurrent: the same kernel, preparing q, k (l2 norm, q * q_scale) and the gates
// from a, b while staging; prep_*: all null, or the packed prepared q, k, g, beta. delta: null, or
// [M, Hv*head_v] receives the rows' updates and the state is left as it was (an undoable step).
void launch_gdn_prepare_recurrent(const float* q, int64_t q_stride, const float* k, int64_t k_stride, const float* v,
                                  int64_t v_stride, const float* a, const float* b, const float* dt_bias,
                                  const float* ssm_a, float eps, float q_scale, float* state, float* out,
                                  float* prep_q, float* prep_k, float* prep_g, float* prep_beta, float* delta,
                                  int64_t M, int64_t n_k_heads, int64_t n_v_heads, int64_t head_k, int64_t head_v,
                                  cudaStream_t s);
// Backend::gdn_apply_rows_batch: n states advanced over M recorded rows (k, g, delta as the undoable
// prepare leaves them), each element with the recurrence's arithmetic; every job in one launch.
struct GdnApplyJobRef {
  const float *k, *g, *delta;
  float* state;
};
void launch_gdn_apply_rows_batch(const GdnApplyJobRef* jobs, int n, int64_t M, int64_t n_k_heads, int64_t n_v_heads,
                                 int64_t head_k, int64_t head_v, cudaStream_t s);
constexpr int64_t kGdnMaxHeadK = 256;
// Chunked (WY) form for prefill (gdn_chunked.cu), heads up to kGdnChunkedMaxHead: scratch is
// gdn_chunked_scratch_floats(...) floats of device memory (W, U~, QK of every chunk and head).
void launch_gdn_chunked(const float* q, const float* k, const float* v, const float* g, const float* beta,
                        float* state, float* out, int64_t M, int64_t n_k_heads, int64_t n_v_heads, int64_t head_k,
                        int64_t head_v, float* scratch, cudaStream_t s);
size_t gdn_chunked_scratch_floats(int64_t M, int64_t n_v_heads, int64_t head_k, int64_t head_v);
constexpr int64_t kGdnChunkedMaxHead = 128;

// ---- sampling (topk.cu) -------------------------------------------------------------------------------
// scratch: at least argmax_scratch_bytes(M) bytes.
size_t argmax_scratch_bytes(int64_t M);
void launch_argmax(const float* x, int32_t* ids, int64_t M, int64_t n, void* scratch, cudaStream_t s);
size_t topk_scratch_bytes(int64_t M, int64_t n, int64_t k);
void launch_top_k(const float* x, int32_t* ids, float* vals, int64_t M, int64_t n, int64_t k, void* scratch,
                  cudaStream_t s);
constexpr int64_t kTopKMax = 64;

// ---- matmul-input chains (chain.cu): rotation blocks of 1024, quantized for the ternary matmul --------
// xq: ternary_scratch(dim, rows).xq_bytes of scratch, written as the ternary matmul's activation records;
// null: no records (prefill chunks, whose bf16 tensor-core GEMM reads the float rows).
// The norm chain needs dim / 1024 <= 8 (one cluster per row). block: 1024 (rotate) or 0 (no rotation:
// xq holds the quantization of n (norm) or y (swiglu); the norm chain then leaves y untouched).
bool chain_supported(int64_t dim, int64_t block, bool norm);
// res: null, or the residual as res_parts parts [res_parts][rows][dim] (Backend::matmul_parts), added
// in part order. local_norm: a timing diagnostic (DFLASH_CUDA_SKIP=normcluster, wrong results): no
// cluster, each 1024-chunk normed by its own sum of squares.
void launch_norm_rotate_quantize(float* x, const float* res, int res_parts, const float* w, float* n,
                                 const float* signs, float* y, void* xq, int64_t rows, int64_t dim, float eps,
                                 bool rotate, bool local_norm, cudaStream_t s);
void launch_swiglu_rotate_quantize(const float* gate, const float* up, const float* signs, float* y, void* xq,
                                   int64_t rows, int64_t dim, bool rotate, cudaStream_t s);
// Backend::sigmoid_gate_rotate: y = x * sigmoid(gate), rotated (rotate) and quantized (xq not null).
void launch_sigmoid_gate_rotate_quantize(const float* x, const float* gate, const float* signs, float* y, void* xq,
                                         int64_t rows, int64_t dim, bool rotate, cudaStream_t s);
// Backend::gated_norm_rotate as one kernel: rms_norm_gated per head of head_dim (a multiple of 32
// dividing 1024), the rotation's gather perm (null, or one that moves whole heads) applied on load,
// then the rotation (rotate) and the quantization of y. y must not overlap x when perm is set.
bool gated_chain_supported(int64_t dim, int64_t block, int64_t head_dim);
void launch_gated_norm_rotate_quantize(const float* x, const float* w, const float* z, const float* signs,
                                       const int32_t* perm, float* y, void* xq, int64_t rows, int64_t dim,
                                       int64_t head_dim, float eps, bool rotate, cudaStream_t s);

// ---- DFlash 2 selector walk (selector.cu): Backend::selector_walk, all pair scores then the walk -------
// scratch: selector_walk_scratch_bytes(rows, top_k) (the scores of every (row, predecessor, candidate)).
size_t selector_walk_scratch_bytes(int64_t rows, int64_t top_k);
constexpr int64_t kSelectorMaxTopK = 256;
void launch_selector_walk(const float* pred, const float* succ, const int32_t* cand, const float* unary, const float* g,
                          int32_t* out, int64_t rows, int64_t top_k, int64_t rank, void* scratch, cudaStream_t s);

// ---- diagnostics (bench.cu) -----------------------------------------------------------------------------
// Reads n16 16-byte words of src, writes one checksum word per block into sink (grid-stride).
void launch_read_kernel(const void* src, size_t n16, unsigned* sink, cudaStream_t s);
// DFLASH_CUDA_SKIP=stream: a matmul replaced by a plain read of its weights' bytes (up to 4 ranges of
// n16[i] 16-byte words), launched with programmatic dependent launch like the matmuls: the time a step
// would take if every matmul streamed its weights at the speed of a bare read kernel.
void launch_stream_weights(const void* const* src, const size_t* n16, int n, unsigned* sink, cudaStream_t s);
// DFLASH_CUDA_SKIP=chainbody: an empty one-warp kernel (PDL wait and trigger only) in place of each chain.
void launch_empty(cudaStream_t s);
// One link of kernel_boundary_us's chain (bench.cu): `ctas` CTAs read all kBoundaryWidth floats of in and
// write their share of out, after waiting for link - 1 (sync 0 stream order, 1 PDL, 2 arrival counters:
// arrivals[link - 1] == prev_ctas; arrivals zeroed before link 0).
// persistent_stream_ms (bench.cu): CTAs of the persistent streaming kernel that fit (at most ctas_per_sm per SM
// with head_bytes of shared memory each; 0 if none); the words of its hand-off counters for n_ops ops (zeroed
// before each launch); its cooperative launch over ops [bounds[i], bounds[i + 1]) (16-byte words of base;
// release: the arrivals are red.release adds, else __threadfence() and atomicAdd).
int persistent_stream_ctas(int ctas_per_sm, int head_bytes);
size_t persistent_stream_counter_words(int n_ops);
cudaError_t launch_persistent_stream(const void* base, const unsigned long long* bounds, int n_ops,
                                     unsigned* counters, int head_bytes, int ctas, bool release, unsigned* sink,
                                     cudaStream_t s);
constexpr int kBoundaryWidth = 5120;
void launch_boundary_link(int sync, int ctas, const float* in, float* out, unsigned* arrivals, int link,
                          int prev_ctas, cudaStream_t s);

}  // namespace dflash::cuda
