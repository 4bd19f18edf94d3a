// Norms, elementwise ops, strided copies, the GDN gates and short conv, the DFlash grouped conv.
//
// Norms: one block per row; thread t sums elements t, t + T, ... in order, then block_sum's fixed
// tree. T depends on the row length only, never on the number of rows.
#include <algorithm>
#include <type_traits>

#include "ops/cuda/common.cuh"
#include "ops/cuda/gdn_conv.cuh"
#include "ops/cuda/kernels.h"
#include "ops/cuda/xq_record.cuh"

namespace dflash::cuda {
namespace {

// Threads per row: a function of the row length only (the lossless contract). Long rows use 1024
// threads so that each thread loads at most kNormRegs values, all issued before the first is used
// (a 5120-row norm was latency-bound at ~8 us with 256 threads walking 20 dependent loads).
constexpr int kNormRegs = 8;
inline int norm_threads(int64_t n) { return n >= 4096 ? 1024 : n >= 1024 ? 256 : 128; }

// mode 0: rms (mean of squares), 1: l2 (sum of squares, times scale), 2: rms gated by silu(z).
// Thread t takes elements t, t + T, ... (in that order for its sum of squares), then block_sum's tree.
// kMode 3: rms of x + z (z the residual), x_out = x + z (may be x itself).
template <int kMode>
__global__ void norm_kernel(const float* x, const float* __restrict__ w, const float* __restrict__ z, float* y,
                            int64_t n, float eps, float scale, float* x_out) {
  const int T = blockDim.x;
  if (w && kMode != 1)  // the weight is a constant: its lines are on their way during the wait
    for (int64_t i = threadIdx.x * 32; i < n; i += static_cast<int64_t>(T) * 32) prefetch_l2(w + i);
  pdl_wait();
  __shared__ float sh[32];
  const int64_t r = blockIdx.x;
  const float* xr = x + r * n;
  float* yr = y + r * n;
  float v[kNormRegs];
  float ss = 0.0f;
  const bool in_regs = n <= static_cast<int64_t>(kNormRegs) * T;
  if (in_regs) {
#pragma unroll
    for (int j = 0; j < kNormRegs; ++j) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(j) * T;
      v[j] = i < n ? xr[i] : 0.0f;
      if (kMode == 3) v[j] = i < n ? v[j] + z[r * n + i] : 0.0f;
    }
    if (kMode == 3)
#pragma unroll
      for (int j = 0; j < kNormRegs; ++j) {
        const int64_t i = threadIdx.x + static_cast<int64_t>(j) * T;
        if (i < n) x_out[r * n + i] = v[j];
      }
#pragma unroll
    for (int j = 0; j < kNormRegs; ++j)
      if (threadIdx.x + static_cast<int64_t>(j) * T < n) ss = fmaf(v[j], v[j], ss);
  } else {
    for (int64_t i = threadIdx.x; i < n; i += T) {
      float xi = xr[i];
      if (kMode == 3) {
        xi = xi + z[r * n + i];
        x_out[r * n + i] = xi;
      }
      ss = fmaf(xi, xi, ss);
    }
  }
  ss = block_sum(ss, sh);
  float inv;
  if (kMode == 1)
    inv = 1.0f / sqrtf(ss + eps);
  else
    inv = 1.0f / sqrtf(ss / static_cast<float>(n) + eps);
  auto out = [&](int64_t i, float xi) {
    const float q = xi * inv;
    if (kMode == 0 || kMode == 3)
      yr[i] = w ? q * w[i] : q;
    else if (kMode == 1)
      yr[i] = q * scale;
    else
      yr[i] = q * w[i] * silu_f(z[r * n + i]);
  };
  if (in_regs) {
#pragma unroll
    for (int j = 0; j < kNormRegs; ++j) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(j) * T;
      if (i < n) out(i, v[j]);
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += T) out(i, kMode == 3 ? x_out[r * n + i] : xr[i]);
  }
}

__global__ void add_kernel(const float* a, const float* b, float* y, int64_t n) {
  pdl_wait();
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    y[i] = a[i] + b[i];
}

// parts[i] = ((p0[i] + p1[i]) + p2[i]) + ... (Backend::sum_parts; parts n floats apart).
__global__ void sum_parts_kernel(float* parts, int count, int64_t n) {
  pdl_wait();
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    parts[i] = load_parts(parts, i, count, n);
}
__global__ void swiglu_kernel(const float* g, const float* u, float* y, int64_t n) {
  pdl_wait();
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    y[i] = silu_f(g[i]) * u[i];
}
__global__ void mul_sigmoid_kernel(const float* x, const float* g, float* y, int64_t n) {
  pdl_wait();
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    y[i] = x[i] * sigmoid_f(g[i]);
}

__global__ void copy_rows_kernel(float* dst, int64_t ds, const float* src, int64_t ss, int64_t rows, int64_t cols) {
  pdl_wait();
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
    for (int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; c < cols; c += (int64_t)gridDim.x * blockDim.x)
      dst[r * ds + c] = src[r * ss + c];
}

// Backend::copy on the device: a kernel rather than a memcpy node. In a step graph a memcpy node breaks
// the chain of programmatic dependent launches (the kernel after it cannot start early) and costs a
// launch of its own: verify's per-layer undo copies (the GDN and conv states before the block, the conv
// inputs) showed as 288 us of idle gaps in a 7.9 ms step (round 8 timeline; since round 32 the GDN state
// needs no checkpoint at all), and a rollback ran ~240 copies then (now one copy_batch launch).
template <typename T>
__global__ void copy_kernel(T* __restrict__ dst, const T* __restrict__ src, size_t n) {
  pdl_wait();
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

// Backend::copy_batch: job blockIdx.y's 16-byte pieces, grid-stride over blockIdx.x.
struct CopyBatch {
  uint4* dst[kMaxCopyJobs];
  const uint4* src[kMaxCopyJobs];
  size_t n16[kMaxCopyJobs];
};
__global__ void copy_batch_kernel(const CopyBatch b) {
  pdl_wait();
  const int j = static_cast<int>(blockIdx.y);
  uint4* __restrict__ dst = b.dst[j];
  const uint4* __restrict__ src = b.src[j];
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < b.n16[j];
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

__global__ void scatter_rows_kernel(float* dst, int64_t ds, int64_t dst_rows, const int32_t* __restrict__ idx,
                                    const float* src, int64_t ss, int64_t rows, int64_t cols) {
  pdl_wait();
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const int64_t to = idx[r];
    if (to < 0 || to >= dst_rows) continue;
    for (int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; c < cols; c += (int64_t)gridDim.x * blockDim.x)
      dst[to * ds + c] = src[r * ss + c];
  }
}

__global__ void gdn_gates_kernel(float* a, float* b, const float* dt_bias, const float* ssm_a, int64_t M, int64_t H) {
  pdl_wait();
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= M * H) return;
  const int64_t h = i % H;
  b[i] = sigmoid_f(b[i]);
  a[i] = ssm_a[h] * softplus_f(a[i] + dt_bias[h]);
}

template <int kK>
__global__ void gdn_conv_kernel(const float* x, float* state, float* __restrict__ state_before,
                                const float* __restrict__ w, float* y, int64_t M, int64_t C, int K_rt) {
  gdn_conv_channel<kK>(blockIdx.x * (int64_t)blockDim.x + threadIdx.x, x, state, state_before, w, y, M, C, K_rt);
}

// Prefill form (M >= kConvRowsPerThread): threads over (channel, run of kConvRowsPerThread rows), each
// row's sum in the decode kernel's order (so the same bits); the window of a run starts from the K-1
// inputs before it (the state for the first rows). The state is updated afterwards by
// gdn_conv_state_kernel (another launch: a CTA here cannot know when the first run has read the old
// state).
constexpr int kConvRowsPerThread = 16;
template <int kK>
__global__ void gdn_conv_rows_kernel(const float* x, const float* state, const float* __restrict__ w, float* y,
                                     int64_t M, int64_t C, int K_rt) {
  pdl_wait();
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int K = kK > 0 ? kK : K_rt;
  const int H = K - 1;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kConvRowsPerThread;
  const int64_t m1 = m0 + kConvRowsPerThread < M ? m0 + kConvRowsPerThread : M;
  float win[kMaxK];
  float wc[kMaxK];
#pragma unroll
  for (int j = 0; j < kMaxK; ++j) {
    const int64_t src = m0 - H + j;  // input row of window slot j (negative: the state's rows)
    win[j] = j < H ? (src < 0 ? state[(H + src) * C + c] : x[src * C + c]) : 0.0f;
    wc[j] = (j < K) ? w[c * K + j] : 0.0f;
  }
  for (int64_t m = m0; m < m1; ++m) {
    y[m * C + c] = conv_step(win, wc, H, x[m * C + c]);
  }
}
// state = the last K-1 input rows (M >= K-1); state_before (null or) receives the old state first.
__global__ void gdn_conv_state_kernel(const float* x, float* state, float* __restrict__ state_before, int64_t M,
                                      int64_t C, int H) {
  pdl_wait();
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= H * C) return;
  const int64_t j = i / C, c = i % C;
  if (state_before) state_before[i] = state[i];
  state[j * C + c] = x[(M - H + j) * C + c];
}

// Channel c of row t of dflash_conv (Backend::dflash_conv), taps o = 0, 1, .. in order; dt: row t's
// coefficients; x as `parts` parts (1: x itself). Both conv kernels use it, so their outputs have the
// same bits. kTaps > 0: K == kTaps at compile time (the DFlash 2 drafter's 2), so the taps' loads are
// issued together and the loop leaves no unrolled remainder copies; 0: any K (a run-time loop).
template <int kTaps = 0>
__device__ __forceinline__ float dflash_conv_channel(const float* __restrict__ x, const float* __restrict__ base,
                                                     const float* __restrict__ dt, int64_t t, int64_t c, int64_t C,
                                                     int64_t K, int64_t G, int64_t group, int parts = 1,
                                                     int64_t part_stride = 0) {
  const int64_t g = static_cast<int>(c) / static_cast<int>(group);  // 32-bit: C < 2^31 (launchers check)
  float acc = 0.0f;
  if constexpr (kTaps > 0) {
#pragma unroll
    for (int o = 0; o < kTaps; ++o)
      if (o <= t) acc += (base[o * C + c] + dt[o * G + g]) * load_parts(x, (t - o) * C + c, parts, part_stride);
  } else {
    for (int64_t o = 0; o < K && o <= t; ++o)
      acc += (base[o * C + c] + dt[o * G + g]) * load_parts(x, (t - o) * C + c, parts, part_stride);
  }
  return acc;
}

// x: x_parts parts [x_parts][M][C] (Backend::dflash_conv_parts; 1: x itself).
__global__ void dflash_conv_kernel(const float* __restrict__ x, int x_parts, const float* __restrict__ base,
                                   const float* __restrict__ d, int64_t d_stride, const float* res, float* y, int64_t M,
                                   int64_t C, int64_t K, int64_t group, int64_t G) {
  pdl_wait();
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  const int64_t t = blockIdx.y;
  if (c >= C || t >= M) return;
  const float acc = dflash_conv_channel(x, base, d + t * d_stride, t, c, C, K, G, group, x_parts, M * C);
  y[t * C + c] = res ? acc + res[t * C + c] : acc;
}

// dflash_conv with the next integer matmul's activation records (res == null: the conv output feeds the
// attention's q | k | v or the FFN's gate | up). Thread t of a CTA holds channels 4t .. 4t + 3 of a
// 1024-channel slice, so warp w quantizes the slice's 128-block w (xq_record.cuh); each channel is
// dflash_conv_channel, as in dflash_conv_kernel. xq null: y only.
template <int kTaps>
__global__ void dflash_conv_quantize_kernel(const float* __restrict__ x, const float* __restrict__ base,
                                            const float* __restrict__ d, int64_t d_stride, float* y, int64_t M,
                                            int64_t C, int64_t K, int64_t group, int64_t G, uint8_t* xq,
                                            int32_t* meta) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * 1024 + 4 * threadIdx.x;
  const int64_t t = blockIdx.y;
  if ((threadIdx.x & 7) == 0 && c0 < C)  // the conv's base taps (constants) on their way during the wait
    for (int64_t o = 0; o < K; ++o) prefetch_l2(base + o * C + c0);
  pdl_wait();
  if (c0 >= C) return;  // C % 128 == 0: whole warps leave
  float e4[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) e4[e] = dflash_conv_channel<kTaps>(x, base, d + t * d_stride, t, c0 + e, C, K, G, group);
  *reinterpret_cast<float4*>(y + t * C + c0) = make_float4(e4[0], e4[1], e4[2], e4[3]);
  if (!xq) return;
  const int64_t blk = xq_record_index(t, blockIdx.x * 8 + warp, M);
  warp_quantize_xq(e4, lane, t, xq + blk * kXqRecordBytes, meta + blk * 4);
}

inline unsigned elem_blocks(int64_t n) {
  const int64_t b = (n + 255) / 256;
  return static_cast<unsigned>(b < 65536 ? (b > 0 ? b : 1) : 65536);
}

// ---- attention_prep: the attention block's input preparation in one kernel --------------------------
// Per CTA one unit of one row: a query head (gate copy, rms norm, rope), a key head (rms norm, rope,
// store into the cache) or the row's values (store into the cache). The norm is norm_kernel<0>'s
// in-register path with the same thread count (norm_threads(head_dim)), so the same sums in the same
// order, and the rope is rope_pair: every element has the bits of the op sequence.

// norm_kernel's in-register path for one row of n <= kNormRegs * blockDim.x elements, in two steps (a
// caller may put work between them while the loads are in flight): the thread's elements t, t + T, ...
// (zero past n), then the row's sum of their squares (each thread's by fma in order, then block_sum's tree).
__device__ __forceinline__ void load_row_regs(const float* xr, int64_t n, float (&v)[kNormRegs]) {
  const int T = blockDim.x;
#pragma unroll
  for (int j = 0; j < kNormRegs; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * T;
    v[j] = i < n ? xr[i] : 0.0f;
  }
}
__device__ __forceinline__ float row_sum_squares(const float (&v)[kNormRegs], int64_t n, float* sh) {
  const int T = blockDim.x;
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kNormRegs; ++j)
    if (threadIdx.x + static_cast<int64_t>(j) * T < n) ss = fmaf(v[j], v[j], ss);
  return block_sum(ss, sh);
}

// The l2 norm of one row (sum of squares) times scale, as norm_kernel<1> (gdn_split_qkv).
__device__ __forceinline__ void l2_norm_row_regs(const float* xr, float scale, float* yr, int64_t n, float eps,
                                                 float* sh) {
  const int T = blockDim.x;
  float v[kNormRegs];
  load_row_regs(xr, n, v);
  const float inv = 1.0f / sqrtf(row_sum_squares(v, n, sh) + eps);
#pragma unroll
  for (int j = 0; j < kNormRegs; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * T;
    if (i < n) yr[i] = v[j] * inv * scale;
  }
}

// A q or k head of attention_prep: norm_kernel<0>'s rms norm (load_row_regs, row_sum_squares) staged in
// shared memory, then rope_rotate of the thread's pairs d = t, t + T, ... (< half) from there with the
// cos / sin it computed while the row was in flight, into yr and the cache row (k heads; null: none).
// Elements past the pairs keep the norm's value. The same bits as the norm op, then the rope op (test_cuda
// CudaAttentionPrep): only where the values wait differs (no global round trip between the norm and the
// rope, nor before the cache copy).
__device__ __forceinline__ void norm_rope_head(const float* xr, const float (&wv)[kNormRegs], bool has_w,
                                               float* yr, float* cache, int64_t n, int64_t half, int32_t pos,
                                               const float (&inv_freq)[kNormRegs / 2], float eps, float* sh,
                                               float* row) {
  const int T = blockDim.x;
  float v[kNormRegs];
  load_row_regs(xr, n, v);
  float c[kNormRegs / 2], s[kNormRegs / 2];  // the thread's pairs (half <= n / 2 <= kNormRegs * T / 2)
#pragma unroll
  for (int k = 0; k < kNormRegs / 2; ++k)
    if (threadIdx.x + static_cast<int64_t>(k) * T < half) rope_cos_sin(inv_freq[k], pos, c[k], s[k]);
  const float ss = row_sum_squares(v, n, sh);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(n) + eps);
#pragma unroll
  for (int j = 0; j < kNormRegs; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * T;
    if (i < n) {
      const float q = v[j] * inv;
      v[j] = has_w ? q * wv[j] : q;
      row[i] = v[j];
      if (i >= 2 * half) {  // not in a pair
        yr[i] = v[j];
        if (cache) cache[i] = v[j];
      }
    }
  }
  __syncthreads();  // the pairs span other threads' elements
#pragma unroll
  for (int k = 0; k < kNormRegs / 2; ++k) {
    const int64_t d = threadIdx.x + static_cast<int64_t>(k) * T;
    if (d < half) {
      float a = row[d], b = row[d + half];
      rope_rotate(a, b, c[k], s[k]);
      yr[d] = a;
      yr[d + half] = b;
      if (cache) {
        cache[d] = a;
        cache[d + half] = b;
      }
    }
  }
}

__global__ void attention_prep_kernel(const AttentionPrepArgs a) {
  __shared__ float sh[32];
  __shared__ float row[kAttentionPrepMaxHeadDim];
  const int64_t hd = a.head_dim, half = a.n_rot / 2, kvw = a.n_head_kv * hd;
  const int64_t u = blockIdx.y;
  const int T = blockDim.x;
  // Before the wait, what depends on no kernel of the step: the head's norm weights and the rope's
  // frequencies (a double pow per pair).
  const float* nw = u < a.n_head ? a.q_norm : u < a.n_head + a.n_head_kv ? a.k_norm : nullptr;
  float wv[kNormRegs], inv_freq[kNormRegs / 2];
#pragma unroll
  for (int j = 0; j < kNormRegs; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * T;
    wv[j] = nw && i < hd ? nw[i] : 1.0f;
  }
#pragma unroll
  for (int k = 0; k < kNormRegs / 2; ++k) {
    const int64_t d = threadIdx.x + static_cast<int64_t>(k) * T;
    const bool roped = u < a.n_head + a.n_head_kv && d < half;  // a q or k head's pair
    inv_freq[k] = roped ? rope_inv_freq(d, a.n_rot, static_cast<double>(a.theta)) : 0.0f;
  }
  pdl_wait();
  const int64_t m = blockIdx.x;
  const int32_t slot = a.slot[m];
  const bool store = slot >= 0 && slot < a.cache_rows;  // as scatter_rows: a row outside the cache is skipped
  if (u < a.n_head) {
    const int64_t qh = m * a.n_head + u;
    const float* src = a.gate ? a.qg + qh * 2 * hd : a.qg + qh * hd;
    float* dst = a.q + qh * hd;
    if (a.gate)
      for (int64_t i = threadIdx.x; i < hd; i += T) a.gate[qh * hd + i] = src[hd + i];
    norm_rope_head(src, wv, a.q_norm != nullptr, dst, nullptr, hd, half, a.pos[m], inv_freq, a.eps, sh, row);
  } else if (u < a.n_head + a.n_head_kv) {
    float* kr = a.k + m * kvw + (u - a.n_head) * hd;
    float* kc = store ? a.k_cache + slot * kvw + (u - a.n_head) * hd : nullptr;
    norm_rope_head(kr, wv, a.k_norm != nullptr, kr, kc, hd, half, a.pos[m], inv_freq, a.eps, sh, row);
  } else if (store) {
    const float* vr = a.v + m * kvw;
    float* vc = a.v_cache + slot * kvw;
    for (int64_t i = threadIdx.x; i < kvw; i += T) vc[i] = vr[i];
  }
}

// ---- gdn_split_qkv: prefill's q | k | v split with the two l2 norms, one kernel ---------------------
// Per CTA one unit of one conv row: a q head (l2 norm x q_scale), a k head (l2 norm) or the row's v
// (copy). The norm is norm_kernel<1>'s in-register path with the same thread count (norm_threads(dk)):
// the same sums in the same order, so every element has the bits of the op sequence.
__global__ void gdn_split_qkv_kernel(const float* __restrict__ conv, float* __restrict__ q, float* __restrict__ k,
                                     float* __restrict__ v, int64_t Hk, int64_t dk, int64_t vw, float eps,
                                     float q_scale) {
  pdl_wait();
  __shared__ float sh[32];
  const int64_t m = blockIdx.x, u = blockIdx.y, qw = Hk * dk, C = 2 * qw + vw;
  const int T = blockDim.x;
  const float* row = conv + m * C;
  if (u < 2 * Hk) {
    const bool is_q = u < Hk;
    const float* xr = row + u * dk;  // k heads follow the q heads in the row
    float* yr = (is_q ? q : k) + m * qw + (is_q ? u : u - Hk) * dk;
    l2_norm_row_regs(xr, is_q ? q_scale : 1.0f, yr, dk, eps, sh);
  } else {
    const float* src = row + 2 * qw;
    float* dst = v + m * vw;
    for (int64_t i = threadIdx.x; i < vw; i += T) dst[i] = src[i];
  }
}

}  // namespace

bool launch_gdn_split_qkv(const float* conv, float* q, float* k, float* v, int64_t M, int64_t Hk, int64_t dk,
                          int64_t vw, float eps, float q_scale, cudaStream_t s) {
  const int T = norm_threads(dk);
  if (dk > static_cast<int64_t>(kNormRegs) * T || M > 0x7fffffff || 2 * Hk + 1 > 65535) return false;
  if (M <= 0) return true;
  const dim3 grid(static_cast<unsigned>(M), static_cast<unsigned>(2 * Hk + 1));
  launch_pdl(gdn_split_qkv_kernel, grid, T, 0, s, conv, q, k, v, Hk, dk, vw, eps, q_scale);
  return true;
}

void launch_attention_prep(const AttentionPrepArgs& a, cudaStream_t s) {
  if (a.M <= 0) return;
  const dim3 grid(static_cast<unsigned>(a.M), static_cast<unsigned>(a.n_head + a.n_head_kv + 1));
  launch_pdl(attention_prep_kernel, grid, norm_threads(a.head_dim), 0, s, a);
}

void launch_rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps, cudaStream_t s) {
  if (rows <= 0 || n <= 0) return;
  launch_pdl(norm_kernel<0>, static_cast<unsigned>(rows), norm_threads(n), 0, s, x, w, nullptr, y, n, eps, 1.0f, nullptr);
}
void launch_rms_norm_residual(float* x, const float* res, const float* w, float* y, int64_t rows, int64_t n, float eps,
                              cudaStream_t s) {
  if (rows <= 0 || n <= 0) return;
  launch_pdl(norm_kernel<3>, static_cast<unsigned>(rows), norm_threads(n), 0, s, x, w, res, y, n, eps, 1.0f, x);
}
void launch_l2_norm(const float* x, float* y, int64_t rows, int64_t n, float eps, float scale, cudaStream_t s) {
  if (rows <= 0 || n <= 0) return;
  launch_pdl(norm_kernel<1>, static_cast<unsigned>(rows), norm_threads(n), 0, s, x, nullptr, nullptr, y, n, eps, scale, nullptr);
}
void launch_rms_norm_gated(const float* x, const float* w, const float* z, float* y, int64_t rows, int64_t n,
                           float eps, cudaStream_t s) {
  if (rows <= 0 || n <= 0) return;
  launch_pdl(norm_kernel<2>, static_cast<unsigned>(rows), norm_threads(n), 0, s, x, w, z, y, n, eps, 1.0f, nullptr);
}
void launch_add(const float* a, const float* b, float* y, int64_t n, cudaStream_t s) {
  if (n > 0) launch_pdl(add_kernel, elem_blocks(n), 256, 0, s, a, b, y, n);
}
void launch_sum_parts(float* parts, int count, int64_t n, cudaStream_t s) {
  if (n > 0 && count > 1) launch_pdl(sum_parts_kernel, elem_blocks(n), 256, 0, s, parts, count, n);
}
void launch_swiglu(const float* g, const float* u, float* y, int64_t n, cudaStream_t s) {
  if (n > 0) launch_pdl(swiglu_kernel, elem_blocks(n), 256, 0, s, g, u, y, n);
}
void launch_mul_sigmoid(const float* x, const float* g, float* y, int64_t n, cudaStream_t s) {
  if (n > 0) launch_pdl(mul_sigmoid_kernel, elem_blocks(n), 256, 0, s, x, g, y, n);
}
void launch_copy(void* dst, const void* src, size_t bytes, cudaStream_t s) {
  if (bytes == 0) return;
  // the widest element that the addresses and the size allow; up to 1024 CTAs, grid-stride
  const uintptr_t align = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes;
  const auto go = [&](auto* d, const auto* from, size_t n) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(from)>>;
    const unsigned blocks = static_cast<unsigned>(std::min<size_t>((n + 255) / 256, 1024));
    launch_pdl(copy_kernel<T>, blocks, 256, 0, s, d, from, n);
  };
  if (align % 16 == 0)
    go(static_cast<uint4*>(dst), static_cast<const uint4*>(src), bytes / 16);
  else if (align % 4 == 0)
    go(static_cast<uint32_t*>(dst), static_cast<const uint32_t*>(src), bytes / 4);
  else
    go(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), bytes);
}
void launch_copy_batch(void* const* dst, const void* const* src, const size_t* bytes, int n, cudaStream_t s) {
  for (int j0 = 0; j0 < n; j0 += kMaxCopyJobs) {
    const int nj = std::min(n - j0, kMaxCopyJobs);
    CopyBatch b{};
    size_t most = 0;
    for (int j = 0; j < nj; ++j) {
      b.dst[j] = static_cast<uint4*>(dst[j0 + j]);
      b.src[j] = static_cast<const uint4*>(src[j0 + j]);
      b.n16[j] = bytes[j0 + j] / 16;
      most = std::max(most, b.n16[j]);
    }
    if (most == 0) continue;
    const unsigned blocks = static_cast<unsigned>(std::min<size_t>((most + 255) / 256, 256));
    launch_pdl(copy_batch_kernel, dim3(blocks, static_cast<unsigned>(nj)), 256, 0, s, b);
  }
}
void launch_copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                      int64_t cols, cudaStream_t s) {
  if (rows <= 0 || cols <= 0) return;
  const unsigned gx = static_cast<unsigned>(std::min<int64_t>((cols + 255) / 256, 1024));
  const unsigned gy = static_cast<unsigned>(std::min<int64_t>(rows, 65535));
  launch_pdl(copy_rows_kernel, dim3(gx, gy), 256, 0, s, dst, dst_stride, src, src_stride, rows, cols);
}
void launch_scatter_rows(float* dst, int64_t dst_stride, int64_t dst_rows, const int32_t* idx, const float* src,
                         int64_t src_stride, int64_t rows, int64_t cols, cudaStream_t s) {
  if (rows <= 0 || cols <= 0) return;
  const unsigned gx = static_cast<unsigned>(std::min<int64_t>((cols + 255) / 256, 1024));
  const unsigned gy = static_cast<unsigned>(std::min<int64_t>(rows, 65535));
  launch_pdl(scatter_rows_kernel, dim3(gx, gy), 256, 0, s, dst, dst_stride, dst_rows, idx, src, src_stride, rows, cols);
}
void launch_gdn_gates(float* a, float* b, const float* dt_bias, const float* ssm_a, int64_t M, int64_t n_v_heads,
                      cudaStream_t s) {
  const int64_t n = M * n_v_heads;
  if (n > 0) launch_pdl(gdn_gates_kernel, ceil_div_u(n, 256), 256, 0, s, a, b, dt_bias, ssm_a, M, n_v_heads);
}
void launch_gdn_conv(const float* x, float* state, float* state_before, const float* w, float* y, int64_t M,
                     int64_t C, int64_t K, cudaStream_t s) {
  if (C <= 0) return;
  if (M >= 2 * kConvRowsPerThread && M >= K - 1 && x != y) {  // prefill: runs of rows in parallel
    const dim3 grid(ceil_div_u(C, 128), ceil_div_u(M, kConvRowsPerThread));
    if (K == 4)
      launch_pdl(gdn_conv_rows_kernel<4>, grid, 128, 0, s, x, state, w, y, M, C, 4);
    else
      launch_pdl(gdn_conv_rows_kernel<0>, grid, 128, 0, s, x, state, w, y, M, C, static_cast<int>(K));
    if (K > 1) launch_pdl(gdn_conv_state_kernel, ceil_div_u((K - 1) * C, 256), 256, 0, s, x, state, state_before, M,
                          C, static_cast<int>(K - 1));
    return;
  }
  if (K == 4)
    launch_pdl(gdn_conv_kernel<4>, ceil_div_u(C, 128), 128, 0, s, x, state, state_before, w, y, M, C, 4);
  else
    launch_pdl(gdn_conv_kernel<0>, ceil_div_u(C, 128), 128, 0, s, x, state, state_before, w, y, M, C,
               static_cast<int>(K));
}
bool dflash_conv_quantize_supported(int64_t C, int64_t M) { return C > 0 && C % 128 == 0 && M > 0 && M <= 65535; }
void launch_dflash_conv_quantize(const float* x, const float* base, const float* d, int64_t d_stride, float* y,
                                 void* xq, int64_t M, int64_t C, int64_t K, int64_t group, cudaStream_t s) {
  if (M <= 0 || C <= 0) return;
  auto* q = static_cast<uint8_t*>(xq);
  // K = 2 (the DFlash 2 drafter) as a compile-time tap count: the taps' loads go out together and the code
  // is 6.9 KB instead of 39.7 (the run-time loop's unrolled copies); 2.77 -> 2.24-2.31 us exposed per launch
  // in the 27B draft step (S23-1).
  const auto kernel = K == 2 ? dflash_conv_quantize_kernel<2> : dflash_conv_quantize_kernel<0>;
  launch_pdl(kernel, dim3(ceil_div_u(C, 1024), static_cast<unsigned>(M)), 256, 0, s, x, base, d, d_stride, y, M, C, K,
             group, C / group, q, xq_meta(q, M, C));
}
void launch_dflash_conv(const float* x, int x_parts, const float* base, const float* d, int64_t d_stride,
                        const float* res, float* y, int64_t M, int64_t C, int64_t K, int64_t group, cudaStream_t s) {
  if (M <= 0 || C <= 0) return;
  launch_pdl(dflash_conv_kernel, dim3(ceil_div_u(C, 256), static_cast<unsigned>(M)), 256, 0, s, x, x_parts, base, d,
             d_stride, res, y, M, C, K, group, C / group);
}

}  // namespace dflash::cuda
