// Quantized matmul (GEMV / small M), embedding lookup and the load-time weight transcodes.
//
// The lossless contract (SPEC 5.5) decides the structure. For an output y[m][o]:
//   - the K inputs are cut into units of 32 elements; lane L of the warp that owns output row o takes
//     units L, L + 32, L + 64, ... (this depends on K only);
//   - each lane accumulates its units in that order with fp32 fmas, elements of a unit in order;
//   - the 32 lane sums are added by the xor butterfly of warp_sum.
// Activation rows go in tiles of at most 8 (a kernel template parameter R); R changes how many rows
// share each weight load, never the arithmetic of one (m, o). So M rows give the bits of M calls of
// one row. Weight values are the CPU's dequantized values bit for bit (same float operations, written
// with __fmul_rn / __fsub_rn so no fma contraction can change them); only the summation order
// differs from the CPU (which uses 32 interleaved lanes per row and one thread).
//
// Kernels:
//   mm_planar2  the hot path for the ternary Bonsai types (PQ2_0, PTQ1_0 transcoded): 2-bit codes,
//               one fp16 scale per 128. A unit is 8 bytes of codes; a warp computes several output rows
//               so each activation load feeds them all. Codes become floats without conversions:
//               0x4B000000 | (word & (3 << s)) is the float 2^23 + c * 2^s, minus (2^23 + 2^s) it is
//               exactly (c - 1) * 2^s, and the activation is pre-scaled by 2^-s (exact), so each fma
//               adds exactly (c - 1) * x. Per unit: p = sum of the 32 products, then acc += d * p.
//   mm_blocks   every file block format (and plain f32/f16/bf16): one warp per output row, a unit
//               dequantized into 32 registers, then one fma chain per activation row.
//   mm_naive    plain types with K not a multiple of 32: lane L takes elements L, L + 32, ...
#include <algorithm>

#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace dflash::cuda {
namespace {

// GgmlType ids (quant/types.h), repeated here so this file does not include host headers.
enum TypeId : int {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kBF16 = 30,
  kTQ1_0 = 34, kTQ2_0 = 35, kQ1_0 = 41, kQ2_0 = 42, kPQ2_0 = 142, kPTQ1_0 = 143,
};

constexpr int kMaxR = 8;       // activation rows per tile
constexpr int kWarpsPerBlock = 4;

__device__ __forceinline__ float ld_half(const uint8_t* p) {
  return fp16_to_f32(static_cast<uint16_t>(p[0] | (p[1] << 8)));
}
__device__ __forceinline__ float dq(float d, int q) { return __fmul_rn(static_cast<float>(q), d); }

// Trit n of a base-3 byte (TQ1_0 / PTQ1_0): ((uint8)(b * 3^n) * 3) >> 8, in 0..2.
__device__ __forceinline__ int trit(uint32_t b, int n) {
  const uint32_t pw = n == 0 ? 1u : n == 1 ? 3u : n == 2 ? 9u : n == 3 ? 27u : 81u;
  return static_cast<int>((((b * pw) & 0xffu) * 3u) >> 8);
}

// Loads 8 consecutive activations (16-byte loads when aligned).
__device__ __forceinline__ void load8(const float* p, bool vec, float* o) {
  if (vec) {
    const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
    o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w; o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = p[i];
  }
}

// ------------------------------------------------------------------------------------------------
// Unit loaders: the 32 dequantized weights of unit u (elements 32u .. 32u + 31) of one row, with the
// CPU dequantizers' float operations (quant/kernels_scalar.cpp).

template <int T>
__device__ __forceinline__ void load_unit(const uint8_t* __restrict__ row, int64_t u, float* w);

template <>
__device__ __forceinline__ void load_unit<kF32>(const uint8_t* __restrict__ row, int64_t u, float* w) {
  const float4* p = reinterpret_cast<const float4*>(row + u * 128);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float4 v = p[i];
    w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
  }
}
template <>
__device__ __forceinline__ void load_unit<kF16>(const uint8_t* __restrict__ row, int64_t u, float* w) {
  const uint4* p = reinterpret_cast<const uint4*>(row + u * 64);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint4 v = p[i];
    const uint32_t a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      w[8 * i + 2 * j] = fp16_to_f32(static_cast<uint16_t>(a[j] & 0xffff));
      w[8 * i + 2 * j + 1] = fp16_to_f32(static_cast<uint16_t>(a[j] >> 16));
    }
  }
}
template <>
__device__ __forceinline__ void load_unit<kBF16>(const uint8_t* __restrict__ row, int64_t u, float* w) {
  const uint4* p = reinterpret_cast<const uint4*>(row + u * 64);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint4 v = p[i];
    const uint32_t a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      w[8 * i + 2 * j] = __uint_as_float(a[j] << 16);
      w[8 * i + 2 * j + 1] = __uint_as_float(a[j] & 0xffff0000u);
    }
  }
}
// Q8_0: half d | i8 q[32]
template <>
__device__ __forceinline__ void load_unit<kQ8_0>(const uint8_t* __restrict__ row, int64_t u, float* w) {
  const uint8_t* b = row + u * 34;
  const float d = ld_half(b);
#pragma unroll
  for (int i = 0; i < 32; ++i) w[i] = dq(d, static_cast<int8_t>(b[2 + i]));
}
// Q4_0: half d | u8 qs[16], low nibbles 0..15, high 16..31, (q - 8) * d
template <>
__device__ __forceinline__ void load_unit<kQ4_0>(const uint8_t* __restrict__ row, int64_t u, float* w) {
  const uint8_t* b = row + u * 18;
  const float d = ld_half(b);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int q = b[2 + i];
    w[i] = dq(d, (q & 0xF) - 8);
    w[i + 16] = dq(d, (q >> 4) - 8);
  }
}
__device__ __forceinline__ void k_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}
// Q4_K (144 B / 256): unit j = u % 8 is sub-block j: chunk c = j / 2, low (even j) or high nibbles.
template <>
__device__ __forceinline__ void load_unit<kQ4_K>(const uint8_t* __restrict__ row, int64_t u, float* w) {
  const uint8_t* b = row + (u >> 3) * 144;
  const int j = static_cast<int>(u & 7), c = j >> 1;
  const float d = ld_half(b), dmin = ld_half(b + 2);
  int sc, mn;
  k_scale_min(b + 4, j, sc, mn);
  const float d1 = __fmul_rn(d, static_cast<float>(sc)), m1 = __fmul_rn(dmin, static_cast<float>(mn));
  const uint4* q4 = reinterpret_cast<const uint4*>(b + 16 + 32 * c);
  const int shift = (j & 1) * 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint4 v = q4[h];
    const uint32_t a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      const int q = (a[k >> 2] >> (8 * (k & 3) + shift)) & 0xF;
      w[16 * h + k] = __fsub_rn(__fmul_rn(d1, static_cast<float>(q)), m1);
    }
  }
}
// Q5_K (176 B / 256): as Q4_K plus bit 2c / 2c+1 of qh[l] (+16).
template <>
__device__ __forceinline__ void load_unit<kQ5_K>(const uint8_t* __restrict__ row, int64_t u, float* w) {
  const uint8_t* b = row + (u >> 3) * 176;
  const int j = static_cast<int>(u & 7), c = j >> 1;
  const float d = ld_half(b), dmin = ld_half(b + 2);
  int sc, mn;
  k_scale_min(b + 4, j, sc, mn);
  const float d1 = __fmul_rn(d, static_cast<float>(sc)), m1 = __fmul_rn(dmin, static_cast<float>(mn));
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48 + 32 * c;
  const int shift = (j & 1) * 4;
#pragma unroll
  for (int l = 0; l < 32; ++l) {
    const int q = ((qs[l] >> shift) & 0xF) + (((qh[l] >> j) & 1) << 4);
    w[l] = __fsub_rn(__fmul_rn(d1, static_cast<float>(q)), m1);
  }
}
// Q6_K (210 B / 256): unit j = u % 8: half h = j / 4, group g = j % 4 (which of l, l+32 low/high).
template <>
__device__ __forceinline__ void load_unit<kQ6_K>(const uint8_t* __restrict__ row, int64_t u, float* w) {
  const uint8_t* b = row + (u >> 3) * 210;
  const int j = static_cast<int>(u & 7), h = j >> 2, g = j & 3;
  const float d = ld_half(b + 208);
  const uint8_t* ql = b + 64 * h + ((g & 1) ? 32 : 0);
  const uint8_t* qh = b + 128 + 32 * h;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192 + 8 * h);
  const int lshift = (g >> 1) * 4, hshift = 2 * g;
  const float s0 = __fmul_rn(d, static_cast<float>(sc[2 * g])), s1 = __fmul_rn(d, static_cast<float>(sc[2 * g + 1]));
#pragma unroll
  for (int l = 0; l < 32; ++l) {
    const int q = (((ql[l] >> lshift) & 0xF) | (((qh[l] >> hshift) & 3) << 4)) - 32;
    w[l] = __fmul_rn(l < 16 ? s0 : s1, static_cast<float>(q));
  }
}
// TQ1_0 (54 B / 256): qs[0..31] digits 0..4 -> elems 32n + m; qs[32..47] digits 0..4 -> 160 + 16n + m;
// qh[0..3] digits 0..3 -> 240 + 4n + j.
template <>
__device__ __forceinline__ void load_unit<kTQ1_0>(const uint8_t* __restrict__ row, int64_t u, float* w) {
  const uint8_t* b = row + (u >> 3) * 54;
  const int j = static_cast<int>(u & 7);
  const float d = ld_half(b + 52);
  if (j < 5) {
#pragma unroll
    for (int m = 0; m < 32; ++m) w[m] = dq(d, trit(b[m], j) - 1);
  } else if (j < 7) {
    const int n0 = 2 * (j - 5);
#pragma unroll
    for (int m = 0; m < 16; ++m) {
      w[m] = dq(d, trit(b[32 + m], n0) - 1);
      w[16 + m] = dq(d, trit(b[32 + m], n0 + 1) - 1);
    }
  } else {
#pragma unroll
    for (int m = 0; m < 16; ++m) w[m] = dq(d, trit(b[32 + m], 4) - 1);
#pragma unroll
    for (int e = 0; e < 16; ++e) w[16 + e] = dq(d, trit(b[48 + (e & 3)], e >> 2) - 1);
  }
}
// TQ2_0 (66 B / 256): y[4j + 32l + m] = (((qs[j+m] >> 2l) & 3) - 1) * d, j in {0, 32}
template <>
__device__ __forceinline__ void load_unit<kTQ2_0>(const uint8_t* __restrict__ row, int64_t u, float* w) {
  const uint8_t* b = row + (u >> 3) * 66;
  const int jj = static_cast<int>(u & 7);
  const float d = ld_half(b + 64);
  const uint8_t* qs = b + (jj >> 2) * 32;
  const int sh = 2 * (jj & 3);
#pragma unroll
  for (int m = 0; m < 32; ++m) w[m] = dq(d, ((qs[m] >> sh) & 3) - 1);
}
// Q1_0 (18 B / 128): half d | bits; bit set -> +d else -d
template <>
__device__ __forceinline__ void load_unit<kQ1_0>(const uint8_t* __restrict__ row, int64_t u, float* w) {
  const uint8_t* b = row + (u >> 2) * 18;
  const float d = ld_half(b);
  const uint8_t* qs = b + 2 + 4 * (u & 3);
#pragma unroll
  for (int e = 0; e < 32; ++e) w[e] = ((qs[e >> 3] >> (e & 7)) & 1) ? d : -d;
}
// Q2_0 (18 B / 64) and PQ2_0 (34 B / 128): half d | codes, element e at bits 2(e%4) of byte e/4.
template <>
__device__ __forceinline__ void load_unit<kQ2_0>(const uint8_t* __restrict__ row, int64_t u, float* w) {
  const uint8_t* b = row + (u >> 1) * 18;
  const float d = ld_half(b);
  const uint8_t* qs = b + 2 + 8 * (u & 1);
#pragma unroll
  for (int e = 0; e < 32; ++e) w[e] = dq(d, ((qs[e >> 2] >> (2 * (e & 3))) & 3) - 1);
}
template <>
__device__ __forceinline__ void load_unit<kPQ2_0>(const uint8_t* __restrict__ row, int64_t u, float* w) {
  const uint8_t* b = row + (u >> 2) * 34;
  const float d = ld_half(b);
  const uint8_t* qs = b + 2 + 8 * (u & 3);
#pragma unroll
  for (int e = 0; e < 32; ++e) w[e] = dq(d, ((qs[e >> 2] >> (2 * (e & 3))) & 3) - 1);
}
// PTQ1_0 (28 B / 128): elems 0..79 digit n of qs[m] (16n + m); 80..119 digit n of qs[16 + m]
// (80 + 8n + m); 120..127 digit n of qh[h] (120 + 2n + h).
__device__ __forceinline__ int ptq1_code(const uint8_t* b, int e) {
  if (e < 80) return trit(b[e & 15], e >> 4);
  if (e < 120) return trit(b[16 + ((e - 80) & 7)], (e - 80) >> 3);
  return trit(b[24 + ((e - 120) & 1)], (e - 120) >> 1);
}
template <>
__device__ __forceinline__ void load_unit<kPTQ1_0>(const uint8_t* __restrict__ row, int64_t u, float* w) {
  const uint8_t* b = row + (u >> 2) * 28;
  const float d = ld_half(b + 26);
  const int e0 = 32 * static_cast<int>(u & 3);
#pragma unroll
  for (int e = 0; e < 32; ++e) w[e] = dq(d, ptq1_code(b, e0 + e) - 1);
}

// ------------------------------------------------------------------------------------------------
// mm_blocks: one warp per output row.

template <int T, int R>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
mm_blocks_kernel(const uint8_t* __restrict__ W, size_t row_stride, int64_t K, int64_t N, const float* __restrict__ x,
                 float* __restrict__ y, int64_t M, bool xvec) {
  const int lane = threadIdx.x & 31;
  const int64_t o = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kMaxR;
  if (o >= N) return;
  const uint8_t* row = W + o * row_stride;
  const float* xt = x + m0 * K;
  const int64_t U = K / 32;
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  for (int64_t u = lane; u < U; u += 32) {
    float w[32];
    load_unit<T>(row, u, w);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float* xr = xt + r * K + u * 32;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        float xv[8];
        load8(xr + 8 * q, xvec, xv);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[r] = __fmaf_rn(w[8 * q + e], xv[e], acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float s = warp_sum(acc[r]);
    if (lane == 0) y[(m0 + r) * N + o] = s;
  }
}

// ------------------------------------------------------------------------------------------------
// mm_planar2: NR output rows per warp; a unit is 8 bytes (two words of 16 codes) of each row.

template <int R>
struct Planar2Cfg {
  static constexpr int NR = R <= 2 ? 8 : R <= 4 ? 4 : 2;
};

template <int R>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
mm_planar2_kernel(const uint8_t* __restrict__ codes, const uint16_t* __restrict__ scales, int64_t K, int64_t N,
                  const float* __restrict__ x, float* __restrict__ y, int64_t M, bool xvec) {
  constexpr int NR = Planar2Cfg<R>::NR;
  const int lane = threadIdx.x & 31;
  const int64_t o0 = (static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5)) * NR;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kMaxR;
  if (o0 >= N) return;
  const int64_t U = K / 32;           // units per row
  const int64_t row_words = K / 16;   // 32-bit code words per row
  const int64_t row_scales = K / 128;
  const float* xt = x + m0 * K;
  const uint2* cw = reinterpret_cast<const uint2*>(codes);

  float acc[NR][R];
#pragma unroll
  for (int i = 0; i < NR; ++i)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[i][r] = 0.0f;

  for (int64_t u = lane; u < U; u += 32) {
    uint2 c[NR];
    float d[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      const int64_t o = o0 + i < N ? o0 + i : N - 1;  // rows past N compute a copy of the last (not stored)
      c[i] = cw[(o * row_words) / 2 + u];
      d[i] = fp16_to_f32(scales[o * row_scales + (u >> 2)]);
    }
    float p[NR][R];
#pragma unroll
    for (int i = 0; i < NR; ++i)
#pragma unroll
      for (int r = 0; r < R; ++r) p[i][r] = 0.0f;
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // 8 elements at a time: word q / 2, half (q & 1)
      float xv[R][8];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        load8(xt + r * K + u * 32 + 8 * q, xvec, xv[r]);
#pragma unroll
        for (int e = 0; e < 8; ++e) xv[r][e] = __fmul_rn(xv[r][e], __int_as_float((127 - 2 * e) << 23));
      }
#pragma unroll
      for (int i = 0; i < NR; ++i) {
        const uint32_t word = (q < 2) ? c[i].x : c[i].y;
        const uint32_t bits = (q & 1) ? (word >> 16) : word;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float wv = __fsub_rn(__uint_as_float(0x4B000000u | (bits & (3u << (2 * e)))),
                                     8388608.0f + static_cast<float>(1 << (2 * e)));
#pragma unroll
          for (int r = 0; r < R; ++r) p[i][r] = __fmaf_rn(wv, xv[r][e], p[i][r]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < NR; ++i)
#pragma unroll
      for (int r = 0; r < R; ++r) acc[i][r] = __fmaf_rn(d[i], p[i][r], acc[i][r]);
  }
#pragma unroll
  for (int i = 0; i < NR; ++i) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float s = warp_sum(acc[i][r]);
      if (lane == 0 && o0 + i < N) y[(m0 + r) * N + o0 + i] = s;
    }
  }
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
                                const float* __restrict__ x, float* __restrict__ y, int64_t M) {
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
// get_rows

template <int T>
__global__ void get_rows_blocks_kernel(const uint8_t* __restrict__ W, size_t row_stride, int64_t K, int64_t N,
                                       const int32_t* __restrict__ ids, float* __restrict__ y) {
  const int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t m = blockIdx.y;
  if (u >= K / 32) return;
  const int32_t id = ids[m];
  float* out = y + m * K + u * 32;
  if (id < 0 || id >= N) {
#pragma unroll
    for (int e = 0; e < 32; ++e) out[e] = __int_as_float(0x7fc00000);
    return;
  }
  float w[32];
  load_unit<T>(W + id * row_stride, u, w);
#pragma unroll
  for (int e = 0; e < 32; ++e) out[e] = w[e];
}

template <int T>
__global__ void get_rows_naive_kernel(const uint8_t* __restrict__ W, size_t row_stride, int64_t K, int64_t N,
                                      const int32_t* __restrict__ ids, float* __restrict__ y) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t m = blockIdx.y;
  if (i >= K) return;
  const int32_t id = ids[m];
  y[m * K + i] = (id < 0 || id >= N) ? __int_as_float(0x7fc00000) : plain_elem<T>(W + id * row_stride, i);
}

__global__ void get_rows_planar2_kernel(const uint8_t* __restrict__ codes, const uint16_t* __restrict__ scales,
                                        int64_t K, int64_t N, const int32_t* __restrict__ ids, float* __restrict__ y) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t m = blockIdx.y;
  if (i >= K) return;
  const int32_t id = ids[m];
  if (id < 0 || id >= N) {
    y[m * K + i] = __int_as_float(0x7fc00000);
    return;
  }
  const uint8_t byte = codes[id * (K / 4) + i / 4];
  const int c = (byte >> (2 * (i & 3))) & 3;
  y[m * K + i] = dq(fp16_to_f32(scales[id * (K / 128) + i / 128]), c - 1);
}

// ------------------------------------------------------------------------------------------------
// load-time transcodes: one thread per 128-element block

__global__ void ptq1_to_planar2_kernel(const uint8_t* __restrict__ src, uint8_t* __restrict__ codes,
                                       uint16_t* __restrict__ scales, int64_t nblocks) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= nblocks) return;
  const uint8_t* s = src + b * 28;
  uint8_t* c = codes + b * 32;
  for (int byte = 0; byte < 32; ++byte) {
    uint32_t v = 0;
    for (int t = 0; t < 4; ++t) v |= static_cast<uint32_t>(ptq1_code(s, 4 * byte + t)) << (2 * t);
    c[byte] = static_cast<uint8_t>(v);
  }
  scales[b] = static_cast<uint16_t>(s[26] | (s[27] << 8));
}

__global__ void pq2_to_planar2_kernel(const uint8_t* __restrict__ src, uint8_t* __restrict__ codes,
                                      uint16_t* __restrict__ scales, int64_t nblocks) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= nblocks) return;
  const uint8_t* s = src + b * 34;
  for (int i = 0; i < 32; ++i) codes[b * 32 + i] = s[2 + i];
  scales[b] = static_cast<uint16_t>(s[0] | (s[1] << 8));
}

// ------------------------------------------------------------------------------------------------
// dispatch

template <int T, int R>
void run_blocks_R(const DevWeight& w, const float* x, float* y, int64_t M, int64_t tiles, bool xvec, cudaStream_t s) {
  const dim3 grid(ceil_div_u(w.out, kWarpsPerBlock), static_cast<unsigned>(tiles));
  mm_blocks_kernel<T, R><<<grid, kWarpsPerBlock * 32, 0, s>>>(w.data, w.row_stride, w.in, w.out, x, y, M, xvec);
}

// Full tiles of 8 rows with R = 8, then the remaining rows (at offset 8 * full) with R = M % 8.
template <int T>
void run_blocks(const DevWeight& w, const float* x, float* y, int64_t M, bool xvec, cudaStream_t s) {
  const int64_t full = M / kMaxR, rest = M % kMaxR;
  if (full > 0) run_blocks_R<T, 8>(w, x, y, M, full, xvec, s);
  if (rest > 0) {
    const float* xr = x + full * kMaxR * w.in;
    float* yr = y + full * kMaxR * w.out;
    switch (rest) {
      case 1: run_blocks_R<T, 1>(w, xr, yr, rest, 1, xvec, s); break;
      case 2: run_blocks_R<T, 2>(w, xr, yr, rest, 1, xvec, s); break;
      case 3: run_blocks_R<T, 3>(w, xr, yr, rest, 1, xvec, s); break;
      case 4: run_blocks_R<T, 4>(w, xr, yr, rest, 1, xvec, s); break;
      case 5: run_blocks_R<T, 5>(w, xr, yr, rest, 1, xvec, s); break;
      case 6: run_blocks_R<T, 6>(w, xr, yr, rest, 1, xvec, s); break;
      default: run_blocks_R<T, 7>(w, xr, yr, rest, 1, xvec, s); break;
    }
  }
}

template <int R>
void run_planar2_R(const DevWeight& w, const float* x, float* y, int64_t M, int64_t tiles, bool xvec, cudaStream_t s) {
  constexpr int NR = Planar2Cfg<R>::NR;
  const dim3 grid(ceil_div_u(w.out, kWarpsPerBlock * NR), static_cast<unsigned>(tiles));
  mm_planar2_kernel<R><<<grid, kWarpsPerBlock * 32, 0, s>>>(w.data, w.scales, w.in, w.out, x, y, M, xvec);
}

void run_planar2(const DevWeight& w, const float* x, float* y, int64_t M, bool xvec, cudaStream_t s) {
  const int64_t full = M / kMaxR, rest = M % kMaxR;
  if (full > 0) run_planar2_R<8>(w, x, y, M, full, xvec, s);
  if (rest > 0) {
    const float* xr = x + full * kMaxR * w.in;
    float* yr = y + full * kMaxR * w.out;
    switch (rest) {
      case 1: run_planar2_R<1>(w, xr, yr, rest, 1, xvec, s); break;
      case 2: run_planar2_R<2>(w, xr, yr, rest, 1, xvec, s); break;
      case 3: run_planar2_R<3>(w, xr, yr, rest, 1, xvec, s); break;
      case 4: run_planar2_R<4>(w, xr, yr, rest, 1, xvec, s); break;
      case 5: run_planar2_R<5>(w, xr, yr, rest, 1, xvec, s); break;
      case 6: run_planar2_R<6>(w, xr, yr, rest, 1, xvec, s); break;
      default: run_planar2_R<7>(w, xr, yr, rest, 1, xvec, s); break;
    }
  }
}

template <int T>
void run_naive(const DevWeight& w, const float* x, float* y, int64_t M, cudaStream_t s) {
  const dim3 grid(ceil_div_u(w.out, kWarpsPerBlock), static_cast<unsigned>(M));
  mm_naive_kernel<T><<<grid, kWarpsPerBlock * 32, 0, s>>>(w.data, w.row_stride, w.in, w.out, x, y, M);
}

template <int T>
void get_rows_blocks(const DevWeight& w, const int32_t* ids, float* y, int64_t M, cudaStream_t s) {
  get_rows_blocks_kernel<T><<<dim3(ceil_div_u(w.in / 32, 128), static_cast<unsigned>(M)), 128, 0, s>>>(
      w.data, w.row_stride, w.in, w.out, ids, y);
}

}  // namespace

bool matmul_supported(int type) {
  switch (type) {
    case kF32: case kF16: case kBF16: case kQ8_0: case kQ4_0: case kQ4_K: case kQ5_K: case kQ6_K:
    case kTQ1_0: case kTQ2_0: case kQ1_0: case kQ2_0: case kPQ2_0: case kPTQ1_0:
      return true;
    default:
      return false;
  }
}

void launch_matmul(const DevWeight& w, const float* x, float* y, int64_t M, cudaStream_t s) {
  if (M <= 0 || w.out <= 0) return;
  // M rows in grid.y tiles: the largest grid.y is 65535 tiles of 8 rows; larger M goes in slices.
  constexpr int64_t kMaxSlice = 65535 * kMaxR;
  if (M > kMaxSlice) {
    for (int64_t m0 = 0; m0 < M; m0 += kMaxSlice)
      launch_matmul(w, x + m0 * w.in, y + m0 * w.out, std::min(kMaxSlice, M - m0), s);
    return;
  }
  // 16-byte activation loads need every row start aligned: x aligned and K a multiple of 4 floats.
  // The arithmetic is the same either way.
  const bool xvec = reinterpret_cast<uintptr_t>(x) % 16 == 0 && w.in % 4 == 0;
  if (w.layout == Layout::kPlanar2) {
    run_planar2(w, x, y, M, xvec, s);
    return;
  }
  if (w.in % 32 != 0) {  // plain types only (every block type has K % 32 == 0)
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
  if (w.layout == Layout::kPlanar2) {
    get_rows_planar2_kernel<<<dim3(ceil_div_u(w.in, 256), static_cast<unsigned>(M)), 256, 0, s>>>(
        w.data, w.scales, w.in, w.out, ids, y);
    return;
  }
  if (w.in % 32 != 0) {
    const dim3 grid(ceil_div_u(w.in, 256), static_cast<unsigned>(M));
    switch (w.type) {
      case kF32: get_rows_naive_kernel<kF32><<<grid, 256, 0, s>>>(w.data, w.row_stride, w.in, w.out, ids, y); break;
      case kF16: get_rows_naive_kernel<kF16><<<grid, 256, 0, s>>>(w.data, w.row_stride, w.in, w.out, ids, y); break;
      default: get_rows_naive_kernel<kBF16><<<grid, 256, 0, s>>>(w.data, w.row_stride, w.in, w.out, ids, y); break;
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
  const int64_t nb = in / 128 * out;
  if (nb > 0) ptq1_to_planar2_kernel<<<ceil_div_u(nb, 256), 256, 0, s>>>(src, codes, scales, nb);
}

void launch_pq2_to_planar2(const uint8_t* src, uint8_t* codes, uint16_t* scales, int64_t in, int64_t out,
                           cudaStream_t s) {
  const int64_t nb = in / 128 * out;
  if (nb > 0) pq2_to_planar2_kernel<<<ceil_div_u(nb, 256), 256, 0, s>>>(src, codes, scales, nb);
}

}  // namespace dflash::cuda
