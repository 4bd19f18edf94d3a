// RoPE (NeoX) and the dispatch of softmax attention over a KV cache (decode and verify).
//
// launch_attention runs the segment kernels (attention_segments.cu) for head dims that are multiples of
// 4 up to kSegMaxHeadDim (every model we run), and the generic split kernel below for the other shapes
// (and for every shape with DFLASH_CUDA_ATTN_SEGMENTS=0). Either way the arithmetic of a (row, head)
// depends only on the row's key range and data, never on M: a verify row has the bits of the same row
// decoded alone (test_cuda checks it for both kernels).
//
// The generic split kernel: per (row, head), the row's keys [lo, hi) cut into kSplits = 16 equal
// runs; each run in a CTA of 4 warps (a warp takes tiles of 32 keys, lane = key; online softmax per
// tile; the warps' partials merged in warp order), then a merge kernel folds the 16 runs in order.
// Slow (one CTA per (row, head, run), K and V read once per query head), but any head dim <= 512.
// (Until round 10 a cluster kernel ran here: removed, the segment kernels are faster at every measured
// shape, bench/RESULTS.md round 10.)
#include <algorithm>
#include <cmath>

#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace dflash::cuda {
namespace {

// One thread per (row, head, pair); the arithmetic is rope_pair's (common.cuh).
__global__ void rope_kernel(float* x, const int32_t* __restrict__ pos, int64_t M, int64_t heads, int64_t head_dim,
                            int64_t n_rot, double theta) {
  pdl_wait();
  const int64_t half = n_rot / 2;
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;  // over heads * half
  const int64_t m = blockIdx.y;
  if (i >= heads * half || m >= M) return;
  const int64_t h = i / half, d = i % half;
  rope_pair(x + (m * heads + h) * head_dim, d, half, n_rot, pos[m], theta);
}

// ---- generic attention: 16 key runs per (row, head), then a merge kernel -----------------------------

constexpr int kSplits = 16;
constexpr int kAttnWarps = 4;

// Partial results per (m, h, split): [max, sum, acc[D]] (unnormalised).
template <int kDPL>  // dims per lane: D <= 32 * kDPL
__global__ void __launch_bounds__(kAttnWarps * 32)
attention_split_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                       const int32_t* __restrict__ kv_range, float* __restrict__ part, int64_t n_heads,
                       int64_t n_kv_heads, int D, float scale, bool vec4) {
  pdl_wait();
  extern __shared__ float sm[];  // q [D] | per warp: max, sum, acc[D]
  const int h = blockIdx.x, sp = blockIdx.z;
  const int64_t m = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t group = n_heads / n_kv_heads, kvh = h / group;
  const int64_t kv_stride = n_kv_heads * D;
  const int64_t lo = kv_range[2 * m], hi = kv_range[2 * m + 1];
  const int64_t L = hi > lo ? hi - lo : 0;
  const int64_t s0 = lo + (L * sp) / kSplits, s1 = lo + (L * (sp + 1)) / kSplits;

  float* qs = sm;
  const float* qh = q + (m * n_heads + h) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) qs[d] = qh[d];
  __syncthreads();

  float run_max = -INFINITY, run_sum = 0.0f;
  float acc[kDPL];
#pragma unroll
  for (int i = 0; i < kDPL; ++i) acc[i] = 0.0f;

  for (int64_t t0 = s0 + 32 * warp; t0 < s1; t0 += 32 * kAttnWarps) {
    const int64_t key = t0 + lane;
    float sc = -INFINITY;
    if (key < s1) {
      const float* kr = k + key * kv_stride + kvh * D;
      float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
      if (vec4) {
        for (int d = 0; d < D; d += 4) {
          const float4 kk = *reinterpret_cast<const float4*>(kr + d);
          a0 = fmaf(qs[d], kk.x, a0);
          a1 = fmaf(qs[d + 1], kk.y, a1);
          a2 = fmaf(qs[d + 2], kk.z, a2);
          a3 = fmaf(qs[d + 3], kk.w, a3);
        }
      } else {
        for (int d = 0; d < D; ++d) a0 = fmaf(qs[d], kr[d], a0);
      }
      sc = ((a0 + a1) + (a2 + a3)) * scale;
    }
    const float tile_max = warp_max(sc);
    const float new_max = fmaxf(run_max, tile_max);
    const float corr = expf(run_max - new_max);  // run_max = -inf: 0
    const float p = key < s1 ? expf(sc - new_max) : 0.0f;
    run_sum = run_sum * corr + warp_sum(p);
#pragma unroll
    for (int i = 0; i < kDPL; ++i) acc[i] *= corr;
    const int64_t nk = s1 - t0 < 32 ? s1 - t0 : 32;
    for (int j = 0; j < nk; ++j) {
      const float pj = __shfl_sync(0xffffffffu, p, j);
      const float* vr = v + (t0 + j) * kv_stride + kvh * D;
#pragma unroll
      for (int i = 0; i < kDPL; ++i) {
        const int d = lane + 32 * i;
        if (d < D) acc[i] = fmaf(pj, vr[d], acc[i]);
      }
    }
    run_max = new_max;
  }
  // merge the warps in index order
  float* ws = sm + D;
  const int wstride = D + 2;
  if (lane == 0) {
    ws[warp * wstride] = run_max;
    ws[warp * wstride + 1] = run_sum;
  }
#pragma unroll
  for (int i = 0; i < kDPL; ++i) {
    const int d = lane + 32 * i;
    if (d < D) ws[warp * wstride + 2 + d] = acc[i];
  }
  __syncthreads();
  float gmax = -INFINITY;
  for (int w = 0; w < kAttnWarps; ++w) gmax = fmaxf(gmax, ws[w * wstride]);
  float* out = part + ((m * n_heads + h) * kSplits + sp) * wstride;
  if (threadIdx.x == 0) {
    float tot = 0.0f;
    for (int w = 0; w < kAttnWarps; ++w) {
      const float mw = ws[w * wstride];
      tot += mw == -INFINITY ? 0.0f : ws[w * wstride + 1] * expf(mw - gmax);
    }
    out[0] = gmax;
    out[1] = tot;
  }
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float a = 0.0f;
    for (int w = 0; w < kAttnWarps; ++w) {
      const float mw = ws[w * wstride];
      a += mw == -INFINITY ? 0.0f : ws[w * wstride + 2 + d] * expf(mw - gmax);
    }
    out[2 + d] = a;
  }
}

__global__ void attention_merge_kernel(const float* __restrict__ part, float* __restrict__ out, int64_t n_heads, int D) {
  pdl_wait();
  const int h = blockIdx.x;
  const int64_t m = blockIdx.y;
  const int wstride = D + 2;
  const float* p = part + ((m * n_heads + h) * kSplits) * wstride;
  float gmax = -INFINITY;
  for (int s = 0; s < kSplits; ++s) gmax = fmaxf(gmax, p[s * wstride]);
  float* o = out + (m * n_heads + h) * D;
  if (gmax == -INFINITY) {  // empty key range
    for (int d = threadIdx.x; d < D; d += blockDim.x) o[d] = 0.0f;
    return;
  }
  float tot = 0.0f;
  for (int s = 0; s < kSplits; ++s) {
    const float ms = p[s * wstride];
    tot += ms == -INFINITY ? 0.0f : p[s * wstride + 1] * expf(ms - gmax);
  }
  const float inv = 1.0f / tot;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float a = 0.0f;
    for (int s = 0; s < kSplits; ++s) {
      const float ms = p[s * wstride];
      a += ms == -INFINITY ? 0.0f : p[s * wstride + 2 + d] * expf(ms - gmax);
    }
    o[d] = a * inv;
  }
}


void launch_attention_splits(const float* q, const float* k, const float* v, const int32_t* kv_range, float* out,
                             int64_t M, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale,
                             float* scratch, cudaStream_t s) {
  const int D = static_cast<int>(head_dim);
  const dim3 grid(static_cast<unsigned>(n_heads), static_cast<unsigned>(M), kSplits);
  const size_t smem = sizeof(float) * (D + kAttnWarps * (D + 2));
  const int threads = kAttnWarps * 32;
  const bool vec4 = D % 4 == 0 && reinterpret_cast<uintptr_t>(k) % 16 == 0;
  if (D <= 32)
    launch_pdl(attention_split_kernel<1>, grid, threads, smem, s, q, k, v, kv_range, scratch, n_heads, n_kv_heads, D, scale, vec4);
  else if (D <= 64)
    launch_pdl(attention_split_kernel<2>, grid, threads, smem, s, q, k, v, kv_range, scratch, n_heads, n_kv_heads, D, scale, vec4);
  else if (D <= 128)
    launch_pdl(attention_split_kernel<4>, grid, threads, smem, s, q, k, v, kv_range, scratch, n_heads, n_kv_heads, D, scale, vec4);
  else if (D <= 256)
    launch_pdl(attention_split_kernel<8>, grid, threads, smem, s, q, k, v, kv_range, scratch, n_heads, n_kv_heads, D, scale, vec4);
  else
    launch_pdl(attention_split_kernel<16>, grid, threads, smem, s, q, k, v, kv_range, scratch, n_heads, n_kv_heads, D, scale, vec4);
  launch_pdl(attention_merge_kernel, dim3(static_cast<unsigned>(n_heads), static_cast<unsigned>(M)), 128, 0, s, scratch, out,
                                                                                                     n_heads, D);
}
}  // namespace

void launch_rope_neox(float* x, const int32_t* pos, int64_t M, int64_t heads, int64_t head_dim, int64_t n_rot,
                      float theta, cudaStream_t s) {
  const int64_t n = heads * (n_rot / 2);
  if (M <= 0 || n <= 0) return;
  launch_pdl(rope_kernel, dim3(ceil_div_u(n, 128), static_cast<unsigned>(M)), 128, 0, s, x, pos, M, heads, head_dim, n_rot,
                                                                                static_cast<double>(theta));
}

// Partials of the segment kernels or of the split kernel, whichever runs.
size_t attention_scratch_floats(int64_t M, int64_t n_heads, int64_t head_dim) {
  return std::max(static_cast<size_t>(M) * n_heads * kSplits * (head_dim + 2),
                  attention_segments_scratch_floats(M, n_heads, head_dim));
}

void launch_attention(const float* q, const float* k, const float* v, const int32_t* kv_range, float* out,
                      int64_t M, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale, float* scratch,
                      cudaStream_t s) {
  if (M <= 0 || n_heads <= 0) return;
  if (attention_segments_enabled() &&
      launch_attention_segments(q, k, v, kv_range, out, M, n_heads, n_kv_heads, head_dim, scale, scratch, s))
    return;
  launch_attention_splits(q, k, v, kv_range, out, M, n_heads, n_kv_heads, head_dim, scale, scratch, s);
}

}  // namespace dflash::cuda
