// Quantized matmul (GEMV / small M), embedding lookup and the load-time weight transcodes.
//
// The lossless contract (SPEC 5.5) decides the structure. An output y[m][o] is computed by one warp:
//   - lane L owns a fixed set of the K inputs (below; it depends on K and the layout only);
//   - the lane accumulates its inputs in a fixed order with fp32 fmas;
//   - the 32 lane sums are added by the xor butterfly of warp_sum.
// Activation rows go in tiles of at most 8 (template parameter R); R and the number of weight rows a
// warp computes (NR) change which values share a load, never the arithmetic of one (m, o). So M rows
// give the bits of M calls of one row. Weight values are the CPU's dequantized values bit for bit
// (same float operations, written with __fmul_rn / __fsub_rn so no fma contraction can change them);
// only the summation order differs from the CPU's.
//
// Both layouts give each lane consecutive 16- or 32-byte pieces of the activation row, so a warp's
// activation loads are coalesced (512 B or 1 KB per instruction):
//   mm_planar2  the ternary Bonsai types (PQ2_0, and PTQ1_0 transcoded at load): 2-bit codes in a
//               lane-interleaved order. K is cut into chunks of 1024 (8 blocks of 128); in chunk c
//               lane L takes elements 128j + 4L + t (j = 0..7 blocks, t = 0..3) and finds their 32
//               codes in 8 consecutive bytes (byte j: codes t at bits 2t). A last chunk of b < 8
//               blocks stores b bytes per lane. Per (block j): p = sum_t (c_t - 1) x_t (fma chain),
//               acc = fma(d_j, p, acc). Codes become floats without conversions: 0x4B000000 |
//               (w & (3 << s)) is the float 2^23 + c 2^s, minus (2^23 + 2^s) it is exactly (c - 1) 2^s,
//               and the activation is pre-scaled by 2^-s (exact), so each fma adds exactly (c - 1) x.
//   mm_blocks   every file block format (and plain f32/f16/bf16) in the file's layout: lane L takes
//               the 8 consecutive elements 256 s + 8 L (s = 0, 1, ...), dequantized, fma chain.
//               Weights with few outputs (out <= 512, a rule on the shape alone) use mm_blocks_split
//               instead: the same lane layout, but K is cut into contiguous chunk ranges, one per warp
//               of a CTA, and the warp sums are added in warp order (so y[m][o] is one CTA's, not one
//               warp's; still a fixed order that depends on K only).
//   mm_naive    plain types with K not a multiple of 8: lane L takes elements L, L + 32, ...
#include <algorithm>
#include <atomic>
#include <type_traits>

#include <cooperative_groups.h>

#include "ops/cuda/common.cuh"
#include "ops/cuda/gdn_conv.cuh"
#include "ops/cuda/kernels.h"
#include "ops/cuda/split_group.cuh"

namespace dflash::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kWarpsPerBlock = 4;

// Trit n of a base-3 byte (TQ1_0 / PTQ1_0): ((uint8)(b * 3^n) * 3) >> 8, in 0..2.
__device__ __forceinline__ int trit(uint32_t b, int n) {
  const uint32_t pw = n == 0 ? 1u : n == 1 ? 3u : n == 2 ? 9u : n == 3 ? 27u : 81u;
  return static_cast<int>((((b * pw) & 0xffu) * 3u) >> 8);
}
// PTQ1_0 (28 B / 128): elems 0..79 digit n of qs[m] (16n + m); 80..119 digit n of qs[16 + m]
// (80 + 8n + m); 120..127 digit n of qh[h] (120 + 2n + h).
__device__ __forceinline__ int ptq1_code(const uint8_t* b, int e) {
  if (e < 80) return trit(b[e & 15], e >> 4);
  if (e < 120) return trit(b[16 + ((e - 80) & 7)], (e - 80) >> 3);
  return trit(b[24 + ((e - 120) & 1)], (e - 120) >> 1);
}

// Q4_0: half d | u8 qs[16]; low nibbles are elements 0..15, high nibbles 16..31; (q - 8) * d
template <>
__device__ __forceinline__ void load_w8<kQ4_0>(const uint8_t* __restrict__ row, int64_t e0, float* w) {
  const uint8_t* b = row + (e0 >> 5) * 18;
  const float d = ld_half(b);
  const int off = static_cast<int>(e0 & 31);
  const uint2 q = ld8_a2(b + 2 + (off & 15));
  const int sh = off >= 16 ? 4 : 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = dq(d, static_cast<int>((byte_of(q, i) >> sh) & 0xF) - 8);
}
// Q4_K (144 B / 256): sub-block j = (e % 256) / 32 of chunk c = j / 2: low (even j) or high nibbles of
// qs[32c + l]; y = (d * sc) * q - (dmin * m).
template <>
__device__ __forceinline__ void load_w8<kQ4_K>(const uint8_t* __restrict__ row, int64_t e0, float* w) {
  const uint8_t* b = row + (e0 >> 8) * 144;
  const int within = static_cast<int>(e0 & 255), j = within >> 5, l0 = within & 31;
  const float d = ld_half(b), dmin = ld_half(b + 2);
  int sc, mn;
  kquant_scale_min(b + 4, j, sc, mn);
  const float d1 = __fmul_rn(d, static_cast<float>(sc)), m1 = __fmul_rn(dmin, static_cast<float>(mn));
  const uint2 q = *reinterpret_cast<const uint2*>(b + 16 + 32 * (j >> 1) + l0);
  const int sh = (j & 1) * 4;
#pragma unroll
  for (int i = 0; i < 8; ++i)
    w[i] = __fsub_rn(__fmul_rn(d1, static_cast<float>((byte_of(q, i) >> sh) & 0xF)), m1);
}
// Q5_K (176 B / 256): as Q4_K plus 16 when bit j of qh[l] is set.
template <>
__device__ __forceinline__ void load_w8<kQ5_K>(const uint8_t* __restrict__ row, int64_t e0, float* w) {
  const uint8_t* b = row + (e0 >> 8) * 176;
  const int within = static_cast<int>(e0 & 255), j = within >> 5, l0 = within & 31;
  const float d = ld_half(b), dmin = ld_half(b + 2);
  int sc, mn;
  kquant_scale_min(b + 4, j, sc, mn);
  const float d1 = __fmul_rn(d, static_cast<float>(sc)), m1 = __fmul_rn(dmin, static_cast<float>(mn));
  const uint2 qh = *reinterpret_cast<const uint2*>(b + 16 + l0);
  const uint2 q = *reinterpret_cast<const uint2*>(b + 48 + 32 * (j >> 1) + l0);
  const int sh = (j & 1) * 4;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int v = static_cast<int>((byte_of(q, i) >> sh) & 0xF) + static_cast<int>(((byte_of(qh, i) >> j) & 1) << 4);
    w[i] = __fsub_rn(__fmul_rn(d1, static_cast<float>(v)), m1);
  }
}
// Q6_K (210 B / 256): sub-block j: half h = j / 4, group g = j % 4 (ql[l] / ql[l + 32], low / high
// nibble, qh bits 2g), scale sc[8h + 2g + l / 16]; y = (d * sc) * (q - 32).
template <>
__device__ __forceinline__ void load_w8<kQ6_K>(const uint8_t* __restrict__ row, int64_t e0, float* w) {
  const uint8_t* b = row + (e0 >> 8) * 210;
  const int within = static_cast<int>(e0 & 255), j = within >> 5, l0 = within & 31;
  const int h = j >> 2, g = j & 3;
  const float d = ld_half(b + 208);
  const uint2 ql = ld8_a2(b + 64 * h + ((g & 1) ? 32 : 0) + l0);
  const uint2 qh = ld8_a2(b + 128 + 32 * h + l0);
  const int sc = static_cast<int8_t>(b[192 + 8 * h + 2 * g + (l0 >> 4)]);
  const float s = __fmul_rn(d, static_cast<float>(sc));
  const int lshift = (g >> 1) * 4, hshift = 2 * g;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int q = static_cast<int>(((byte_of(ql, i) >> lshift) & 0xF) | (((byte_of(qh, i) >> hshift) & 3) << 4)) - 32;
    w[i] = __fmul_rn(s, static_cast<float>(q));
  }
}
// The rarely used types, element by element.
// TQ1_0 (54 B / 256): qs[0..31] digits 0..4 -> 32n + m; qs[32..47] -> 160 + 16n + m; qh[0..3] -> 240 + 4n + j.
__device__ __forceinline__ int tq1_code(const uint8_t* b, int i) {
  if (i < 160) return trit(b[i & 31], i >> 5);
  if (i < 240) return trit(b[32 + ((i - 160) & 15)], (i - 160) >> 4);
  return trit(b[48 + ((i - 240) & 3)], (i - 240) >> 2);
}
template <>
__device__ __forceinline__ void load_w8<kTQ1_0>(const uint8_t* __restrict__ row, int64_t e0, float* w) {
  const uint8_t* b = row + (e0 >> 8) * 54;
  const float d = ld_half(b + 52);
  const int i0 = static_cast<int>(e0 & 255);
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = dq(d, tq1_code(b, i0 + i) - 1);
}
// TQ2_0 (66 B / 256): y[128 jj + 32 l + m] = (((qs[32 jj + m] >> 2l) & 3) - 1) * d
template <>
__device__ __forceinline__ void load_w8<kTQ2_0>(const uint8_t* __restrict__ row, int64_t e0, float* w) {
  const uint8_t* b = row + (e0 >> 8) * 66;
  const float d = ld_half(b + 64);
  const int i0 = static_cast<int>(e0 & 255);
  const uint8_t* qs = b + 32 * (i0 >> 7) + (i0 & 31);
  const int sh = 2 * ((i0 >> 5) & 3);
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = dq(d, ((qs[i] >> sh) & 3) - 1);
}
// Q1_0 (18 B / 128): half d | bits; bit set -> +d else -d
template <>
__device__ __forceinline__ void load_w8<kQ1_0>(const uint8_t* __restrict__ row, int64_t e0, float* w) {
  const uint8_t* b = row + (e0 >> 7) * 18;
  const float d = ld_half(b);
  const uint32_t bits = b[2 + ((e0 & 127) >> 3)];
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = ((bits >> i) & 1) ? d : -d;
}
// Q2_0 (18 B / 64) and PQ2_0 (34 B / 128): half d | codes, element e at bits 2(e%4) of byte e/4.
template <>
__device__ __forceinline__ void load_w8<kQ2_0>(const uint8_t* __restrict__ row, int64_t e0, float* w) {
  const uint8_t* b = row + (e0 >> 6) * 18;
  const float d = ld_half(b);
  const uint32_t q = ld_u16(b + 2 + ((e0 & 63) >> 2));
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = dq(d, static_cast<int>((q >> (2 * i)) & 3) - 1);
}
template <>
__device__ __forceinline__ void load_w8<kPQ2_0>(const uint8_t* __restrict__ row, int64_t e0, float* w) {
  const uint8_t* b = row + (e0 >> 7) * 34;
  const float d = ld_half(b);
  const uint32_t q = ld_u16(b + 2 + ((e0 & 127) >> 2));
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = dq(d, static_cast<int>((q >> (2 * i)) & 3) - 1);
}
template <>
__device__ __forceinline__ void load_w8<kPTQ1_0>(const uint8_t* __restrict__ row, int64_t e0, float* w) {
  const uint8_t* b = row + (e0 >> 7) * 28;
  const float d = ld_half(b + 26);
  const int i0 = static_cast<int>(e0 & 127);
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = dq(d, ptq1_code(b, i0 + i) - 1);
}

// ------------------------------------------------------------------------------------------------
// mm_blocks: NR weight rows per warp; lane L takes elements 256 s + 8 L .. + 7.

template <int R>
struct BlocksCfg {
  static constexpr int NR = R <= 2 ? 2 : 4;
};

template <int T, int R>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
mm_blocks_kernel(const uint8_t* __restrict__ W, size_t row_stride, int64_t K, int64_t N, const float* __restrict__ x,
                 float* __restrict__ y, bool xvec) {
  pdl_wait();
  constexpr int NR = BlocksCfg<R>::NR;
  const int lane = threadIdx.x & 31;
  const int64_t o0 = (static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5)) * NR;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kMaxR;
  if (o0 >= N) return;
  const uint8_t* rows[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) rows[i] = W + (o0 + i < N ? o0 + i : N - 1) * row_stride;
  const float* xt = x + m0 * K;
  float acc[NR][R];
#pragma unroll
  for (int i = 0; i < NR; ++i)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[i][r] = 0.0f;
  for (int64_t e0 = 8 * lane; e0 < K; e0 += 256) {
    float w[NR][8];
#pragma unroll
    for (int i = 0; i < NR; ++i) load_w8<T>(rows[i], e0, w[i]);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float xv[8];
      load8(xt + r * K + e0, xvec, xv);
#pragma unroll
      for (int i = 0; i < NR; ++i)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[i][r] = __fmaf_rn(w[i][e], xv[e], acc[i][r]);
    }
  }
#pragma unroll
  for (int i = 0; i < NR; ++i)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float s = warp_sum(acc[i][r]);
      if (lane == 0 && o0 + i < N) y[(m0 + r) * N + o0 + i] = s;
    }
}

template <int T, int R>
__global__ void __launch_bounds__(kSplitWarps * 32)
mm_blocks_split_kernel(const SplitGroup grp, int64_t K, const float* __restrict__ x, bool xvec) {
  split_group_cta<T, R>(grp, K, x, xvec, static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y));
}


// Backend::gdn_conv_and_matmuls in one launch (up to 8 rows): CTAs [0, split_ctas) are the split group's
// (GDN alpha | beta of the layer input), the rest run gdn_conv over the conv input, blockDim.x channels each.
// Neither reads what the other writes, so the projections no longer wait for the conv's launch or the conv
// for theirs; every CTA computes what it would in its own kernel (the same bits).
struct ConvArgs {
  const float* x;
  float* state;
  float* state_before;
  const float* w;
  float* y;
  int64_t M, C;
};
template <int T, int R, int kK>
__global__ void __launch_bounds__(kSplitWarps * 32)
split_gdn_conv_kernel(const SplitGroup grp, int64_t K, const float* __restrict__ x, bool xvec, int split_ctas,
                      const ConvArgs conv) {
  const int b = static_cast<int>(blockIdx.x);
  if (b < split_ctas) {
    split_group_cta<T, R>(grp, K, x, xvec, b, 0);
    return;
  }
  gdn_conv_channel<kK>(static_cast<int64_t>(b - split_ctas) * blockDim.x + threadIdx.x, conv.x, conv.state,
                       conv.state_before, conv.w, conv.y, conv.M, conv.C, kK);
}

// ------------------------------------------------------------------------------------------------
// mm_planar2 (layout in the header comment)

template <int R>
struct Planar2Cfg {
  static constexpr int NR = 4;
};

// (c - 1) * 2^s for the code at bits s..s+1 of `bits` (s <= 14), exactly.
template <int S>
__device__ __forceinline__ float code_f(uint32_t bits) {
  return __fsub_rn(__uint_as_float(0x4B000000u | (bits & (3u << S))), 8388608.0f + static_cast<float>(1 << S));
}

// One block of 4 codes per lane: bits holds them at shift `base` (0 or 8); x4 the 4 activations of
// each row, pre-scaled by 2^-(base + 2t).
template <int R, int NR, int kBase>
__device__ __forceinline__ void planar2_block(const uint32_t (&bits)[NR], const float (&d)[NR], const float4 (&x4)[R],
                                              float (&acc)[NR][R]) {
#pragma unroll
  for (int i = 0; i < NR; ++i) {
    const float w0 = code_f<kBase>(bits[i]), w1 = code_f<kBase + 2>(bits[i]), w2 = code_f<kBase + 4>(bits[i]),
                w3 = code_f<kBase + 6>(bits[i]);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float p = __fmul_rn(w0, x4[r].x);
      p = __fmaf_rn(w1, x4[r].y, p);
      p = __fmaf_rn(w2, x4[r].z, p);
      p = __fmaf_rn(w3, x4[r].w, p);
      acc[i][r] = __fmaf_rn(d[i], p, acc[i][r]);
    }
  }
}

template <int kBase>
__device__ __forceinline__ float4 prescale(float4 v) {
  // 2^-(kBase + 2t), exact
  v.x = __fmul_rn(v.x, __int_as_float((127 - kBase) << 23));
  v.y = __fmul_rn(v.y, __int_as_float((127 - kBase - 2) << 23));
  v.z = __fmul_rn(v.z, __int_as_float((127 - kBase - 4) << 23));
  v.w = __fmul_rn(v.w, __int_as_float((127 - kBase - 6) << 23));
  return v;
}

template <int R>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
mm_planar2_kernel(const uint8_t* __restrict__ codes, const uint16_t* __restrict__ scales, int64_t K, int64_t N,
                  const float* __restrict__ x, float* __restrict__ y, bool xvec) {
  pdl_wait();
  constexpr int NR = Planar2Cfg<R>::NR;
  const int lane = threadIdx.x & 31;
  const int64_t o0 = (static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5)) * NR;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kMaxR;
  if (o0 >= N) return;
  const int64_t n_full = K >> 10;
  const int tail = static_cast<int>((K & 1023) >> 7);
  const int64_t row_bytes = K >> 2, row_scales = K >> 7;
  const uint8_t* crow[NR];
  const uint16_t* srow[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) {
    const int64_t o = o0 + i < N ? o0 + i : N - 1;  // rows past N compute a copy of the last (not stored)
    crow[i] = codes + o * row_bytes;
    srow[i] = scales + o * row_scales;
  }
  const float* xt = x + m0 * K + 4 * lane;
  float acc[NR][R];
#pragma unroll
  for (int i = 0; i < NR; ++i)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[i][r] = 0.0f;

  for (int64_t c = 0; c < n_full; ++c) {
    uint2 cw[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) cw[i] = *reinterpret_cast<const uint2*>(crow[i] + c * 256 + 8 * lane);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float d[NR];
      uint32_t bits[NR];
#pragma unroll
      for (int i = 0; i < NR; ++i) {
        d[i] = fp16_to_f32(srow[i][8 * c + j]);
        const uint32_t word = j < 4 ? cw[i].x : cw[i].y;
        bits[i] = (j & 2) ? (word >> 16) : word;  // byte j % 4 now at bits 8 (j & 1)
      }
      float4 x4[R];
      if (j & 1) {
#pragma unroll
        for (int r = 0; r < R; ++r) x4[r] = prescale<8>(load4(xt + r * K + c * 1024 + j * 128, xvec));
        planar2_block<R, NR, 8>(bits, d, x4, acc);
      } else {
#pragma unroll
        for (int r = 0; r < R; ++r) x4[r] = prescale<0>(load4(xt + r * K + c * 1024 + j * 128, xvec));
        planar2_block<R, NR, 0>(bits, d, x4, acc);
      }
    }
  }
  for (int j = 0; j < tail; ++j) {  // last chunk of tail < 8 blocks: tail bytes per lane
    float d[NR];
    uint32_t bits[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      d[i] = fp16_to_f32(srow[i][8 * n_full + j]);
      bits[i] = crow[i][n_full * 256 + tail * lane + j];
    }
    float4 x4[R];
#pragma unroll
    for (int r = 0; r < R; ++r) x4[r] = prescale<0>(load4(xt + r * K + n_full * 1024 + j * 128, xvec));
    planar2_block<R, NR, 0>(bits, d, x4, acc);
  }
#pragma unroll
  for (int i = 0; i < NR; ++i)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float s = warp_sum(acc[i][r]);
      if (lane == 0 && o0 + i < N) y[(m0 + r) * N + o0 + i] = s;
    }
}

// Byte offset, in a planar row, of the code byte holding element e (and the element's bit shift).
__device__ __forceinline__ int64_t planar2_byte(int64_t K, int64_t e, int& shift) {
  const int64_t c = e >> 10;
  const int rem = static_cast<int>(e & 1023);
  const int j = rem >> 7, l = (rem & 127) >> 2;
  shift = 2 * static_cast<int>(e & 3);
  const int64_t n_full = K >> 10;
  const int per_lane = c < n_full ? 8 : static_cast<int>((K & 1023) >> 7);
  return c * 256 + static_cast<int64_t>(l) * per_lane + j;
}

// ------------------------------------------------------------------------------------------------
// mm_naive: plain types, any K. Lane L takes elements L, L + 32, ... in order.

template <int T>
__device__ __forceinline__ float plain_elem(const uint8_t* row, int64_t i) {
  if (T == kF32) return reinterpret_cast<const float*>(row)[i];
  const uint16_t h = reinterpret_cast<const uint16_t*>(row)[i];
  return T == kF16 ? fp16_to_f32(h) : bf16_to_f32(h);
}

template <int T>
__global__ void mm_naive_kernel(const uint8_t* __restrict__ W, size_t row_stride, int64_t K, int64_t N,
                                const float* __restrict__ x, float* __restrict__ y) {
  pdl_wait();
  const int lane = threadIdx.x & 31;
  const int64_t o = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t m = blockIdx.y;
  if (o >= N) return;
  const uint8_t* row = W + o * row_stride;
  float acc = 0.0f;
  for (int64_t i = lane; i < K; i += 32) acc = __fmaf_rn(plain_elem<T>(row, i), x[m * K + i], acc);
  acc = warp_sum(acc);
  if (lane == 0) y[m * N + o] = acc;
}

// ------------------------------------------------------------------------------------------------
// get_rows: one thread per 8 elements (blocks), per element (naive, planar)

template <int T>
__global__ void get_rows_blocks_kernel(const uint8_t* __restrict__ W, size_t row_stride, int64_t K, int64_t N,
                                       const int32_t* __restrict__ ids, float* __restrict__ y) {
  pdl_wait();
  const int64_t e0 = 8 * (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x);
  const int64_t m = blockIdx.y;
  if (e0 >= K) return;
  const int32_t id = ids[m];
  float* out = y + m * K + e0;
  if (id < 0 || id >= N) {
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = __int_as_float(0x7fc00000);
    return;
  }
  float w[8];
  load_w8<T>(W + id * row_stride, e0, w);
#pragma unroll
  for (int e = 0; e < 8; ++e) out[e] = w[e];
}

template <int T>
__global__ void get_rows_naive_kernel(const uint8_t* __restrict__ W, size_t row_stride, int64_t K, int64_t N,
                                      const int32_t* __restrict__ ids, float* __restrict__ y) {
  pdl_wait();
  int64_t i, m;
  int32_t id;
  if (get_rows_element(K, N, ids, y, i, m, id)) y[m * K + i] = plain_elem<T>(W + id * row_stride, i);
}

__global__ void get_rows_planar2_kernel(const uint8_t* __restrict__ codes, const uint16_t* __restrict__ scales,
                                        int64_t K, int64_t N, const int32_t* __restrict__ ids, float* __restrict__ y) {
  pdl_wait();
  int64_t i, m;
  int32_t id;
  if (!get_rows_element(K, N, ids, y, i, m, id)) return;
  int shift;
  const int64_t byte = planar2_byte(K, i, shift);
  const int c = (codes[id * (K / 4) + byte] >> shift) & 3;
  y[m * K + i] = dq(fp16_to_f32(scales[id * (K / 128) + i / 128]), c - 1);
}

// ------------------------------------------------------------------------------------------------
// load-time transcodes: one thread per destination code byte (4 elements)

template <bool kPtq1>
__global__ void to_planar2_kernel(const uint8_t* __restrict__ src, uint8_t* __restrict__ codes,
                                  uint16_t* __restrict__ scales, int64_t K, int64_t total_bytes) {
  pdl_wait();
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= total_bytes) return;
  const int64_t rb = K / 4;
  const int64_t o = g / rb, byte = g % rb;
  const int64_t c = byte >> 8;
  const int rem = static_cast<int>(byte & 255);
  const int per_lane = c < (K >> 10) ? 8 : static_cast<int>((K & 1023) >> 7);
  const int l = rem / per_lane, j = rem % per_lane;
  const int64_t blk = o * (K / 128) + c * 8 + j;  // source block
  uint32_t v;
  if (kPtq1) {
    const uint8_t* s = src + blk * 28;
    v = 0;
    for (int t = 0; t < 4; ++t) v |= static_cast<uint32_t>(ptq1_code(s, 4 * l + t)) << (2 * t);
    if (l == 0) scales[blk] = static_cast<uint16_t>(s[26] | (s[27] << 8));
  } else {
    const uint8_t* s = src + blk * 34;
    v = s[2 + l];  // PQ2_0 byte l holds elements 4l .. 4l + 3 at bits 2t
    if (l == 0) scales[blk] = static_cast<uint16_t>(s[0] | (s[1] << 8));
  }
  codes[g] = static_cast<uint8_t>(v);
}

// ------------------------------------------------------------------------------------------------
// dispatch: full tiles of 8 rows with R = 8, then the remaining rows (at offset 8 * full) with R = M % 8

template <template <int> class Runner, typename... Args>
void dispatch_tiles(int64_t M, int64_t in, int64_t out, const float* x, float* y, Args... args) {
  const int64_t full = M / kMaxR, rest = M % kMaxR;
  if (full > 0) Runner<8>::run(x, y, full, args...);
  if (rest > 0) {
    const float* xr = x + full * kMaxR * in;
    float* yr = y + full * kMaxR * out;
    switch (rest) {
      case 1: Runner<1>::run(xr, yr, 1, args...); break;
      case 2: Runner<2>::run(xr, yr, 1, args...); break;
      case 3: Runner<3>::run(xr, yr, 1, args...); break;
      case 4: Runner<4>::run(xr, yr, 1, args...); break;
      case 5: Runner<5>::run(xr, yr, 1, args...); break;
      case 6: Runner<6>::run(xr, yr, 1, args...); break;
      default: Runner<7>::run(xr, yr, 1, args...); break;
    }
  }
}

template <int T, int R>
void launch_split_group(const DevWeight* const* ws, float* const* ys, int n, const float* x, int64_t tiles, bool xvec,
                        cudaStream_t s) {
  unsigned gx = 0;
  const SplitGroup g = split_group_of<T, R>(ws, ys, n, gx);
  launch_pdl(mm_blocks_split_kernel<T, R>, dim3(gx, static_cast<unsigned>(tiles)), split_warps(ws[0]->in) * 32, 0, s,
             g, ws[0]->in, x, xvec);
}

// f(std::integral_constant<int, R>{}) for R = rows, 1 .. kMaxR (the split kernel's rows per tile).
template <class F>
void with_split_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// Whether n weights can go through the split kernel as one group (launch_matmul_split_group's rule), and
// then f(std::integral_constant<int, T>{}) for their type T.
template <class F>
bool with_split_group_type(const DevWeight* const* ws, int n, F&& f) {
  if (n < 1 || n > kTernaryMaxGroup) return false;
  for (int k = 0; k < n; ++k)
    if (ws[k]->layout != Layout::kBlocks || ws[k]->type != ws[0]->type || ws[k]->in != ws[0]->in ||
        ws[k]->in % 8 != 0 || !use_split(ws[k]->in, ws[k]->out))
      return false;
  switch (ws[0]->type) {
    case kF32: f(std::integral_constant<int, kF32>{}); return true;
    case kF16: f(std::integral_constant<int, kF16>{}); return true;
    case kBF16: f(std::integral_constant<int, kBF16>{}); return true;
    case kQ8_0: f(std::integral_constant<int, kQ8_0>{}); return true;
    default: return false;  // the other types: one matmul each
  }
}

template <int T>
struct BlocksRun {
  template <int R>
  struct At {
    static void run(const float* x, float* y, int64_t tiles, const DevWeight& w, bool xvec, cudaStream_t s) {
      if (use_split(w.in, w.out)) {
        const DevWeight* one[1] = {&w};
        float* const ys[1] = {y};
        launch_split_group<T, R>(one, ys, 1, x, tiles, xvec, s);
        return;
      }
      constexpr int NR = BlocksCfg<R>::NR;
      const dim3 grid(ceil_div_u(w.out, kWarpsPerBlock * NR), static_cast<unsigned>(tiles));
      launch_pdl(mm_blocks_kernel<T, R>, grid, kWarpsPerBlock * 32, 0, s, w.data, w.row_stride, w.in, w.out, x, y, xvec);
    }
  };
};

template <int R>
struct Planar2Run {
  static void run(const float* x, float* y, int64_t tiles, const DevWeight& w, bool xvec, cudaStream_t s) {
    constexpr int NR = Planar2Cfg<R>::NR;
    const dim3 grid(ceil_div_u(w.out, kWarpsPerBlock * NR), static_cast<unsigned>(tiles));
    launch_pdl(mm_planar2_kernel<R>, grid, kWarpsPerBlock * 32, 0, s, w.data, w.scales, w.in, w.out, x, y, xvec);
  }
};

template <int T>
void run_blocks(const DevWeight& w, const float* x, float* y, int64_t M, bool xvec, cudaStream_t s) {
  dispatch_tiles<BlocksRun<T>::template At>(M, w.in, w.out, x, y, w, xvec, s);
}

template <int T>
void run_naive(const DevWeight& w, const float* x, float* y, int64_t M, cudaStream_t s) {
  const dim3 grid(ceil_div_u(w.out, kWarpsPerBlock), static_cast<unsigned>(M));
  launch_pdl(mm_naive_kernel<T>, grid, kWarpsPerBlock * 32, 0, s, w.data, w.row_stride, w.in, w.out, x, y);
}

template <int T>
void get_rows_blocks(const DevWeight& w, const int32_t* ids, float* y, int64_t M, cudaStream_t s) {
  launch_pdl(get_rows_blocks_kernel<T>, dim3(ceil_div_u(w.in / 8, 128), static_cast<unsigned>(M)), 128, 0, s, 
      w.data, w.row_stride, w.in, w.out, ids, y);
}

template <int T>
void run_split_group(const DevWeight* const* ws, float* const* ys, int n, const float* x, int64_t M, bool xvec,
                     cudaStream_t s) {
  const int64_t in = ws[0]->in, full = M / kMaxR, rest = M % kMaxR;
  if (full > 0) launch_split_group<T, 8>(ws, ys, n, x, full, xvec, s);
  if (rest == 0) return;
  float* yr[kTernaryMaxGroup];
  for (int k = 0; k < n; ++k) yr[k] = ys[k] + full * kMaxR * ws[k]->out;
  const float* xr = x + full * kMaxR * in;
  with_split_rows(rest, [&](auto R) { launch_split_group<T, decltype(R)::value>(ws, yr, n, xr, 1, xvec, s); });
}

}  // namespace

bool launch_matmul_split_group(const DevWeight* const* ws, float* const* ys, int n, const float* x, int64_t M,
                               cudaStream_t s) {
  if (M <= 0 || M > 65535 * kMaxR) return false;
  const bool xvec = reinterpret_cast<uintptr_t>(x) % 16 == 0 && n > 0 && ws[0]->in % 4 == 0;
  return with_split_group_type(ws, n, [&](auto T) { run_split_group<decltype(T)::value>(ws, ys, n, x, M, xvec, s); });
}

bool launch_split_group_gdn_conv(const DevWeight* const* ws, float* const* ys, int n, const float* mx, int64_t M,
                                 const float* x, float* state, float* state_before, const float* w, float* y,
                                 int64_t C, int64_t K, cudaStream_t s) {
  // The split group's own rule, one row tile, and the conv's decode form with 4 taps (Qwen3.5's).
  if (M < 1 || M > kMaxR || C <= 0 || K != 4) return false;
  const bool xvec = reinterpret_cast<uintptr_t>(mx) % 16 == 0 && n > 0 && ws[0]->in % 4 == 0;
  const ConvArgs conv{x, state, state_before, w, y, M, C};
  return with_split_group_type(ws, n, [&](auto T) {
    with_split_rows(M, [&](auto R) {
      unsigned gx = 0;
      const SplitGroup g = split_group_of<decltype(T)::value, decltype(R)::value>(ws, ys, n, gx);
      const int threads = split_warps(ws[0]->in) * 32;
      launch_pdl(split_gdn_conv_kernel<decltype(T)::value, decltype(R)::value, 4>, dim3(gx + ceil_div_u(C, threads)),
                 threads, 0, s, g, ws[0]->in, mx, xvec, static_cast<int>(gx), conv);
    });
  });
}

bool matmul_supported(int type) {
  switch (type) {
    case kF32: case kF16: case kBF16: case kQ8_0: case kQ4_0: case kQ4_K: case kQ5_K: case kQ6_K:
    case kTQ1_0: case kTQ2_0: case kQ1_0: case kQ2_0: case kPQ2_0: case kPTQ1_0:
      return true;
    default:
      return false;
  }
}

namespace {
std::atomic<int64_t> g_tail_launches{0};
}  // namespace
void note_tail_launch() { g_tail_launches.fetch_add(1, std::memory_order_relaxed); }
int64_t mma_tail_launches() { return g_tail_launches.load(std::memory_order_relaxed); }

TernaryScratch matmul_scratch(const DevWeight& w, int64_t M) {
  return w.layout == Layout::kTernaryMma || w.layout == Layout::kKQuantMma ? ternary_scratch(w.in, M)
                                                                            : TernaryScratch{};
}

int launch_matmul_parts(const DevWeight& w, const float* x, float* y, int64_t M, const TernaryBuffers& buf,
                        int num_sms, int max_parts, cudaStream_t s) {
  if (M <= 0 || w.out <= 0) return 1;
  if (w.layout == Layout::kTernaryMma) return launch_matmul_ternary(w, x, y, M, buf, num_sms, s, max_parts);
  if (w.layout == Layout::kKQuantMma) {
    const DevWeight* one[1] = {&w};
    float* const ys[1] = {y};
    return launch_matmul_kquant_group(one, ys, 1, x, M, buf, num_sms, s, max_parts);
  }
  launch_matmul(w, x, y, M, buf, num_sms, s);
  return 1;
}

void launch_matmul(const DevWeight& w, const float* x, float* y, int64_t M, const TernaryBuffers& buf, int num_sms,
                   cudaStream_t s) {
  if (M <= 0 || w.out <= 0) return;
  if (w.layout == Layout::kTernaryMma || w.layout == Layout::kKQuantMma) {  // one part: y itself
    (void)launch_matmul_parts(w, x, y, M, buf, num_sms, 1, s);
    return;
  }
  // M rows in grid.y tiles: the largest grid.y is 65535 tiles of 8 rows; larger M goes in slices.
  constexpr int64_t kMaxSlice = 65535 * kMaxR;
  if (M > kMaxSlice) {
    for (int64_t m0 = 0; m0 < M; m0 += kMaxSlice)
      launch_matmul(w, x + m0 * w.in, y + m0 * w.out, std::min(kMaxSlice, M - m0), buf, num_sms, s);
    return;
  }
  // 16-byte activation loads need every row start aligned: x aligned and K a multiple of 4 floats.
  // The arithmetic is the same either way.
  const bool xvec = reinterpret_cast<uintptr_t>(x) % 16 == 0 && w.in % 4 == 0;
  if (w.layout == Layout::kPlanar2) {
    dispatch_tiles<Planar2Run>(M, w.in, w.out, x, y, w, xvec, s);
    return;
  }
  if (w.in % 8 != 0) {  // plain types only (every block type has K % 32 == 0)
    switch (w.type) {
      case kF32: run_naive<kF32>(w, x, y, M, s); break;
      case kF16: run_naive<kF16>(w, x, y, M, s); break;
      default: run_naive<kBF16>(w, x, y, M, s); break;
    }
    return;
  }
  switch (w.type) {
    case kF32: run_blocks<kF32>(w, x, y, M, xvec, s); break;
    case kF16: run_blocks<kF16>(w, x, y, M, xvec, s); break;
    case kBF16: run_blocks<kBF16>(w, x, y, M, xvec, s); break;
    case kQ8_0: run_blocks<kQ8_0>(w, x, y, M, xvec, s); break;
    case kQ4_0: run_blocks<kQ4_0>(w, x, y, M, xvec, s); break;
    case kQ4_K: run_blocks<kQ4_K>(w, x, y, M, xvec, s); break;
    case kQ5_K: run_blocks<kQ5_K>(w, x, y, M, xvec, s); break;
    case kQ6_K: run_blocks<kQ6_K>(w, x, y, M, xvec, s); break;
    case kTQ1_0: run_blocks<kTQ1_0>(w, x, y, M, xvec, s); break;
    case kTQ2_0: run_blocks<kTQ2_0>(w, x, y, M, xvec, s); break;
    case kQ1_0: run_blocks<kQ1_0>(w, x, y, M, xvec, s); break;
    case kQ2_0: run_blocks<kQ2_0>(w, x, y, M, xvec, s); break;
    case kPQ2_0: run_blocks<kPQ2_0>(w, x, y, M, xvec, s); break;
    case kPTQ1_0: run_blocks<kPTQ1_0>(w, x, y, M, xvec, s); break;
    default: break;
  }
}

void launch_get_rows(const DevWeight& w, const int32_t* ids, float* y, int64_t M, cudaStream_t s) {
  if (M <= 0) return;
  if (w.layout == Layout::kTernaryMma) {
    launch_get_rows_ternary(w, ids, y, M, s);
    return;
  }
  if (w.layout == Layout::kKQuantMma) {
    launch_get_rows_kquant(w, ids, y, M, s);
    return;
  }
  if (w.layout == Layout::kPlanar2) {
    launch_pdl(get_rows_planar2_kernel, dim3(ceil_div_u(w.in, 256), static_cast<unsigned>(M)), 256, 0, s, 
        w.data, w.scales, w.in, w.out, ids, y);
    return;
  }
  if (w.in % 8 != 0) {
    const dim3 grid(ceil_div_u(w.in, 256), static_cast<unsigned>(M));
    switch (w.type) {
      case kF32: launch_pdl(get_rows_naive_kernel<kF32>, grid, 256, 0, s, w.data, w.row_stride, w.in, w.out, ids, y); break;
      case kF16: launch_pdl(get_rows_naive_kernel<kF16>, grid, 256, 0, s, w.data, w.row_stride, w.in, w.out, ids, y); break;
      default: launch_pdl(get_rows_naive_kernel<kBF16>, grid, 256, 0, s, w.data, w.row_stride, w.in, w.out, ids, y); break;
    }
    return;
  }
  switch (w.type) {
    case kF32: get_rows_blocks<kF32>(w, ids, y, M, s); break;
    case kF16: get_rows_blocks<kF16>(w, ids, y, M, s); break;
    case kBF16: get_rows_blocks<kBF16>(w, ids, y, M, s); break;
    case kQ8_0: get_rows_blocks<kQ8_0>(w, ids, y, M, s); break;
    case kQ4_0: get_rows_blocks<kQ4_0>(w, ids, y, M, s); break;
    case kQ4_K: get_rows_blocks<kQ4_K>(w, ids, y, M, s); break;
    case kQ5_K: get_rows_blocks<kQ5_K>(w, ids, y, M, s); break;
    case kQ6_K: get_rows_blocks<kQ6_K>(w, ids, y, M, s); break;
    case kTQ1_0: get_rows_blocks<kTQ1_0>(w, ids, y, M, s); break;
    case kTQ2_0: get_rows_blocks<kTQ2_0>(w, ids, y, M, s); break;
    case kQ1_0: get_rows_blocks<kQ1_0>(w, ids, y, M, s); break;
    case kQ2_0: get_rows_blocks<kQ2_0>(w, ids, y, M, s); break;
    case kPQ2_0: get_rows_blocks<kPQ2_0>(w, ids, y, M, s); break;
    case kPTQ1_0: get_rows_blocks<kPTQ1_0>(w, ids, y, M, s); break;
    default: break;
  }
}

void launch_ptq1_to_planar2(const uint8_t* src, uint8_t* codes, uint16_t* scales, int64_t in, int64_t out,
                            cudaStream_t s) {
  const int64_t total = in / 4 * out;
  if (total > 0) launch_pdl(to_planar2_kernel<true>, ceil_div_u(total, 256), 256, 0, s, src, codes, scales, in, total);
}

void launch_pq2_to_planar2(const uint8_t* src, uint8_t* codes, uint16_t* scales, int64_t in, int64_t out,
                           cudaStream_t s) {
  const int64_t total = in / 4 * out;
  if (total > 0) launch_pdl(to_planar2_kernel<false>, ceil_div_u(total, 256), 256, 0, s, src, codes, scales, in, total);
}

}  // namespace dflash::cuda
