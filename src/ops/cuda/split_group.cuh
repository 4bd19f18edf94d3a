// The k-split matmul of small block-layout weights (GDN alpha | beta: 48 x 5120 BF16), as device code that
// other kernels run too: mm_blocks_split_kernel and split_gdn_conv_kernel (matmul.cu) and the GDN input
// launch of the ternary kernel (mma_gemv.cuh, kEpiGdnConv) compute their split CTAs with
// split_group_cta, so every path gives the same bits. Also the file block formats' shared element
// loaders (load_w8 of F32, F16, BF16, Q8_0; matmul.cu has the others).
#pragma once

#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace dflash::cuda {
namespace {

// GgmlType ids (quant/types.h), repeated here so this file does not include host headers.
enum TypeId : int {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kBF16 = 30,
  kTQ1_0 = 34, kTQ2_0 = 35, kQ1_0 = 41, kQ2_0 = 42, kPQ2_0 = 142, kPTQ1_0 = 143,
};

constexpr int kMaxR = 8;  // activation rows per tile

__device__ __forceinline__ float ld_half(const uint8_t* p) {
  return fp16_to_f32(static_cast<uint16_t>(p[0] | (p[1] << 8)));
}
__device__ __forceinline__ float dq(float d, int q) { return __fmul_rn(static_cast<float>(q), d); }

// Four / eight consecutive activations (16-byte loads when aligned).
__device__ __forceinline__ float4 load4(const float* p, bool vec) {
  if (vec) return *reinterpret_cast<const float4*>(p);
  return make_float4(p[0], p[1], p[2], p[3]);
}
__device__ __forceinline__ void load8(const float* p, bool vec, float* o) {
  const float4 a = load4(p, vec), b = load4(p + 4, vec);
  o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w; o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
}
__device__ __forceinline__ uint32_t ld_u16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }
// 8 bytes from a 2-byte aligned address, as two little-endian words.
__device__ __forceinline__ uint2 ld8_a2(const uint8_t* p) {
  return make_uint2(ld_u16(p) | (ld_u16(p + 2) << 16), ld_u16(p + 4) | (ld_u16(p + 6) << 16));
}
__device__ __forceinline__ uint32_t byte_of(const uint2& v, int i) { return ((i < 4 ? v.x : v.y) >> (8 * (i & 3))) & 0xff; }

// ------------------------------------------------------------------------------------------------
// Element loaders: the 8 dequantized weights e0 .. e0 + 7 of one row (e0 a multiple of 8, so the 8
// never straddle a block), with the CPU dequantizers' float operations (quant/kernels_scalar.cpp).

template <int T>
__device__ __forceinline__ void load_w8(const uint8_t* __restrict__ row, int64_t e0, float* w);

template <>
__device__ __forceinline__ void load_w8<kF32>(const uint8_t* __restrict__ row, int64_t e0, float* w) {
  const float4* p = reinterpret_cast<const float4*>(row + e0 * 4);
  const float4 a = p[0], b = p[1];
  w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w; w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
}
// F16 / BF16: one 16-byte load of 8 halves, widened in order (low half of each word first).
template <int T>
__device__ __forceinline__ void load_w8_halves(const uint8_t* __restrict__ row, int64_t e0, float* w) {
  const uint4 v = *reinterpret_cast<const uint4*>(row + e0 * 2);
  const uint32_t a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint16_t lo = static_cast<uint16_t>(a[j] & 0xffff), hi = static_cast<uint16_t>(a[j] >> 16);
    w[2 * j] = T == kBF16 ? bf16_to_f32(lo) : fp16_to_f32(lo);
    w[2 * j + 1] = T == kBF16 ? bf16_to_f32(hi) : fp16_to_f32(hi);
  }
}
template <>
__device__ __forceinline__ void load_w8<kF16>(const uint8_t* __restrict__ row, int64_t e0, float* w) {
  load_w8_halves<kF16>(row, e0, w);
}
template <>
__device__ __forceinline__ void load_w8<kBF16>(const uint8_t* __restrict__ row, int64_t e0, float* w) {
  load_w8_halves<kBF16>(row, e0, w);
}
// Q8_0: half d | i8 q[32]
template <>
__device__ __forceinline__ void load_w8<kQ8_0>(const uint8_t* __restrict__ row, int64_t e0, float* w) {
  const uint8_t* b = row + (e0 >> 5) * 34;
  const float d = ld_half(b);
  const uint2 q = ld8_a2(b + 2 + (e0 & 31));
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = dq(d, static_cast<int8_t>(byte_of(q, i)));
}

// ------------------------------------------------------------------------------------------------
// mm_blocks_split: the small-output path (w.out <= kSplitMaxOut, e.g. ssm_alpha / ssm_beta, 48 x 5120).
// The warp-per-rows kernel (matmul.cu) gives such a weight only out / 8 CTAs, each warp walking all of K;
// here one CTA computes NR outputs (o0 .. o0 + NR - 1) with nw = min(8, chunks) warps, warp w taking
// the contiguous 256-element chunks [chunks * w / nw, chunks * (w + 1) / nw). Lane L of a warp takes
// elements 256 c + 8 L .. + 7 of its chunks c (ascending), the same fp32 fma chain as mm_blocks; the
// 32 lane sums go through warp_sum, then the nw warp sums are added in warp order by one thread.
// nw depends on K only and the path on (in, out) only; R, NR and U (chunks whose loads are issued
// together) change which values share a load, never the arithmetic of one (m, o): M-independent.

constexpr int kSplitWarps = 8;
// Outputs up to which the split path is used (shape only: the rule must not look at M). At 512 the
// warp-per-rows kernel would launch 64 CTAs of 4 warps: under half of an H200's 132 SMs.
constexpr int64_t kSplitMaxOut = 512;

inline bool use_split(int64_t in, int64_t out) { return in > 0 && out <= kSplitMaxOut; }
__host__ __device__ inline int split_warps(int64_t in) {
  const int64_t chunks = (in + 255) / 256;
  return static_cast<int>(chunks < kSplitWarps ? chunks : kSplitWarps);
}

template <int T, int R>
struct SplitCfg {
  // Outputs per CTA: 2 at 3-4 rows; 1 at 5-8 rows, where the registers go to loading 2 chunks at once
  // instead (GDN alpha | beta in verify: 2-3 chunks per warp, each a serial L2 round trip at U = 1).
  static constexpr int NR = R <= 2 || R > 4 ? 1 : 2;
  // Chunks per load batch (registers: 8 U (NR + R)). The base-3 decoders (TQ1_0, PTQ1_0) are too long
  // to unroll U times: their weight arrays would go to local memory, so they load one chunk at a time.
  static constexpr int U = (T == kTQ1_0 || T == kPTQ1_0) ? 1 : R <= 2 ? 4 : 2;
};

// Up to kTernaryMaxGroup weights of one type and K that share the input x, in one launch (matmul_group:
// GDN's alpha and beta): CTAs [cta_end of the previous weight, cta_end) compute this weight's outputs.
// A CTA's arithmetic is the single-weight kernel's, so grouping changes no bits.
struct SplitPart {
  const uint8_t* W;
  size_t row_stride;
  int64_t N;
  float* y;
  int cta_end;
};
struct SplitGroup {
  SplitPart part[kTernaryMaxGroup];
  int nparts;
};

// The CTA (bx, by) of the split kernel's grid (a device function: split_gdn_conv_kernel and the GDN input
// launch of the ternary kernel run it too).
//   kVirtual false: the CTA has the nw = split_warps(K) warps of the arithmetic, one each;
//   kVirtual true: its warps run the nw warps' shares one after another (warp w takes w, w + its CTA's
//     warps, ...: a CTA of another kernel with fewer warps), each share's sums as that warp's.
// mc <= R: the rows of the tile (rows mc .. R - 1 are neither read nor stored). Neither changes the
// arithmetic of an output, so every path gives mm_blocks_split_kernel's bits.
// kVirtual also loads one chunk at a time (U = 1, a load batch changes no arithmetic): the host kernel's
// registers are capped for its own work.
template <int T, int R, bool kVirtual = false>
__device__ __forceinline__ void split_group_cta(const SplitGroup& grp, int64_t K, const float* __restrict__ x, bool xvec,
                                                int bx, int by, int mc = R) {
  constexpr int NR = SplitCfg<T, R>::NR, U = kVirtual ? 1 : SplitCfg<T, R>::U;
  __shared__ float part[kSplitWarps][NR][R];
  const int lane = threadIdx.x & 31, cta_warps = blockDim.x >> 5;
  const int nw = kVirtual ? split_warps(K) : cta_warps;
  int cta_begin;
  const SplitPart sp = group_part(grp.part, grp.nparts, bx, cta_begin);
  const uint8_t* __restrict__ W = sp.W;
  const size_t row_stride = sp.row_stride;
  const int64_t N = sp.N;
  float* __restrict__ y = sp.y;
  const int64_t o0 = static_cast<int64_t>(bx - cta_begin) * NR;
  const int64_t m0 = static_cast<int64_t>(by) * kMaxR;
  const int64_t chunks = (K + 255) / 256;
  for (int warp = threadIdx.x >> 5; warp < nw; warp += cta_warps) {
    const int64_t c_begin = chunks * warp / nw, c_end = chunks * (warp + 1) / nw;  // >= 1 chunk (nw <= chunks)
    const uint8_t* rows[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) rows[i] = W + (o0 + i < N ? o0 + i : N - 1) * row_stride;  // past N: not stored
    const float* xt = x + m0 * K;
    float acc[NR][R];
#pragma unroll
    for (int i = 0; i < NR; ++i)
#pragma unroll
      for (int r = 0; r < R; ++r) acc[i][r] = 0.0f;

    // A chunk u of the batch at c is live when c + u < c_end and the lane's 8 elements are inside K
    // (only the last chunk of the row can be partial; K % 8 == 0 here).
    float w[U][NR][8];
    auto load_weights = [&](int64_t c) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t e0 = (c + u) * 256 + 8 * lane;
        if (c + u < c_end && e0 < K) {
#pragma unroll
          for (int i = 0; i < NR; ++i) load_w8<T>(rows[i], e0, w[u][i]);
        }
      }
    };
    // The weights never come from an earlier kernel (uploaded and synchronized): the first batch's loads
    // start before pdl_wait(), while the previous kernel drains.
    load_weights(c_begin);
    pdl_wait();
    for (int64_t c = c_begin;;) {
      float xv[U][R][8];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t e0 = (c + u) * 256 + 8 * lane;
        if (c + u < c_end && e0 < K) {
#pragma unroll
          for (int r = 0; r < R; ++r)
            if (r < mc) load8(xt + r * K + e0, xvec, xv[u][r]);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t e0 = (c + u) * 256 + 8 * lane;
        if (c + u < c_end && e0 < K) {
#pragma unroll
          for (int r = 0; r < R; ++r)
#pragma unroll
            for (int i = 0; i < NR; ++i)
#pragma unroll
              for (int e = 0; e < 8; ++e) acc[i][r] = __fmaf_rn(w[u][i][e], xv[u][r][e], acc[i][r]);
        }
      }
      c += U;
      if (c >= c_end) break;
      load_weights(c);
    }
#pragma unroll
    for (int i = 0; i < NR; ++i)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float s = warp_sum(acc[i][r]);
        if (lane == 0) part[warp][i][r] = s;
      }
    if (!kVirtual) break;
  }
  __syncthreads();
  if (threadIdx.x < NR * R) {
    const int i = threadIdx.x / R, r = threadIdx.x % R;
    float t = part[0][i][r];
    for (int k = 1; k < nw; ++k) t += part[k][i][r];
    if (o0 + i < N && r < mc) y[(m0 + r) * N + o0 + i] = t;
  }
}

// The split kernel's group of n weights (outputs ys) at R rows per tile; gx receives its CTAs per tile.
template <int T, int R>
SplitGroup split_group_of(const DevWeight* const* ws, float* const* ys, int n, unsigned& gx) {
  constexpr int NS = SplitCfg<T, R>::NR;
  SplitGroup g{};
  g.nparts = n;
  gx = 0;
  for (int k = 0; k < n; ++k) {
    gx += ceil_div_u(ws[k]->out, NS);
    g.part[k] = SplitPart{ws[k]->data, ws[k]->row_stride, ws[k]->out, ys[k], static_cast<int>(gx)};
  }
  return g;
}

}  // namespace
}  // namespace dflash::cuda
