// Prefill attention (Backend::attention_prefill): flash-attention on the tensor cores for long prefill
// chunks. Same arguments and result as attention.cu's kernels (out = softmax(q . K^T * scale) V over
// each row's keys [lo, hi), GQA: head h reads KV head h / (n_heads / n_kv_heads), an empty range gives
// zeros), but the rounding differs and depends on which rows share a CTA, so the lossless contract
// does not hold: the model calls it for non-undoable chunks of >= 32 rows only (Qwen35Model).
//
// Arithmetic (why ~2e-7 NMSE from the fp32 reference, not bit-exact):
//   - S = Q . K^T and O = P . V on mma.sync.m16n8k8 tf32 with fp32 accumulators. The inputs q, k, p, v
//     are rounded fp32 -> tf32 to nearest (cvt.rna: 10 explicit mantissa bits, relative error <= 2^-11,
//     ~2e-4 RMS), products exact, sums in fp32. A product of two rounded inputs is off by ~2.9e-4 RMS
//     relative; a score of 256 random terms (scaled by 1/16) by ~3e-4 absolute, i.e. ~3e-4 relative on
//     each p, and the same again for each p v product: NMSE of the output ~ 2 x (3e-4)^2 ~ 2e-7 on random
//     data (cuda_ops_test bounds it at 1e-6). bf16 inputs (8 bits) would be 64x worse (~1e-5): more than
//     the model tests' 1e-6 logits bound leaves, so tf32 (half the bf16 mma rate, still far from the
//     bound here: the kernel is shared-memory bound) is the choice.
//   - online softmax in fp32 per key tile: masked keys score -inf, row max over the tile (a quad
//     butterfly), corr = expf(old max - new max), p = expf(s - new max) (accurate expf), l = l * corr +
//     sum p, acc = acc * corr + P . V; out = acc * (1 / l) (0 for an empty row).
//
// Work layout: one CTA (4 warps) per (64 query rows, query head); warp w owns rows 16w .. 16w + 15 (one
// m16 tile). Heavy (late, causal) row tiles are launched first. The CTA streams the union of its rows'
// key ranges in tiles of 32 keys aligned to absolute key positions through shared memory (cp.async,
// double-buffered; keys outside the union are zero-filled, never read from memory); a warp skips the
// tiles outside its own rows' union (causal: the upper triangle). Per tile a warp computes S [16 x 32]
// (4 n8 tiles, head_dim / 8 k-steps: A = Q from shared memory, pre-rounded to tf32 when staged; B = K
// rows, "col" layout = k-contiguous key rows), the softmax in registers, then P . V with P straight from
// the accumulator registers: the C fragment gives lane (g, t) keys 2t, 2t + 1 of rows g, g + 8, while the
// A fragment wants k = t and t + 4, so mma k t plays key 2t and k t + 4 plays key 2t + 1 (a sum over k is
// the same in any order of k applied to both operands) and the V fragment is read in that order.
// Shared rows are head_dim + 4 floats apart (stride = 4 mod 32 banks): the Q, K and V fragment reads are
// conflict-free. Shared memory at head_dim 256: Q 65 KB + 2 stages x (K + V) 130 KB = 195 KB (one CTA
// per SM); the O accumulator is 16 x head_dim per warp (128 registers per thread at 256).
#include <climits>
#include <cstdint>

#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"
#include "ops/cuda/tf32_mma.cuh"

namespace dflash::cuda {
namespace {

// ---- device helpers ------------------------------------------------------------------------------------

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// ---- the kernel ----------------------------------------------------------------------------------------

constexpr int kPRows = 64;      // query rows per CTA (4 warps x 16)
constexpr int kPKeys = 32;      // keys per tile
constexpr int kPThreads = 128;  // 4 warps

struct PrefillAttnArgs {
  const float* q;
  const float* k;
  const float* v;
  const int32_t* kv_range;
  float* out;
  int64_t M;
  int64_t n_heads;
  int64_t group;      // query heads per KV head
  int64_t kv_stride;  // floats between keys: n_kv_heads * D
  float scale;
};

template <int D>
struct PrefillSmem {
  static constexpr int kStride = D + 4;  // floats per shared row (bank offset 4 per row)
  static constexpr int kQ = kPRows * kStride;
  static constexpr int kKV = kPKeys * kStride;  // one K (or V) tile
  static constexpr size_t kBytes = sizeof(float) * (kQ + 4 * kKV) + sizeof(int) * 2 * kPRows;
};

template <int D>
__global__ void __launch_bounds__(kPThreads, 1) attention_prefill_kernel(PrefillAttnArgs a) {
  static_assert(D % 8 == 0 && D <= 256, "head_dim: a multiple of 8, at most 256");
  using L = PrefillSmem<D>;
  constexpr int S = L::kStride;
  constexpr int C4 = D / 4;  // 16-byte chunks per row
  constexpr int NO = D / 8;  // n8 tiles of the output (head dims)
  extern __shared__ __align__(16) float smem[];
  float* sQ = smem;                                           // [kPRows][S], tf32-rounded
  float* sK = sQ + L::kQ;                                     // [2][kPKeys][S]
  float* sV = sK + 2 * L::kKV;                                // [2][kPKeys][S]
  int* sR = reinterpret_cast<int*>(sV + 2 * L::kKV);          // [kPRows][2]: each row's [lo, hi)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int64_t h = blockIdx.x;
  const int64_t r0 = static_cast<int64_t>(gridDim.y - 1 - blockIdx.y) * kPRows;  // late (long) rows first
  const int64_t kvh = h / a.group;

  pdl_wait();
  if (tid < kPRows) {
    const int64_t r = r0 + tid;
    int lo = 0, hi = 0;
    if (r < a.M) {
      lo = a.kv_range[2 * r];
      hi = a.kv_range[2 * r + 1];
      if (lo < 0 || hi <= lo) lo = hi = 0;  // empty (a negative start is invalid: zeros, never a read)
    }
    sR[2 * tid] = lo;
    sR[2 * tid + 1] = hi;
  }
  for (int i = tid; i < kPRows * C4; i += kPThreads) {
    const int r = i / C4, c = i % C4;
    float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (r0 + r < a.M) x = *reinterpret_cast<const float4*>(a.q + ((r0 + r) * a.n_heads + h) * D + 4 * c);
    x.x = __uint_as_float(to_tf32(x.x));
    x.y = __uint_as_float(to_tf32(x.y));
    x.z = __uint_as_float(to_tf32(x.z));
    x.w = __uint_as_float(to_tf32(x.w));
    *reinterpret_cast<float4*>(sQ + r * S + 4 * c) = x;
  }
  __syncthreads();

  // The CTA's key union [ulo, uhi) and this warp's [wlo, whi) (empty: lo > hi).
  int ulo = INT_MAX, uhi = INT_MIN, wlo = INT_MAX, whi = INT_MIN;
  for (int r = 0; r < kPRows; ++r) {
    const int lo = sR[2 * r], hi = sR[2 * r + 1];
    if (hi <= lo) continue;
    ulo = min(ulo, lo);
    uhi = max(uhi, hi);
    if (r / 16 == warp) {
      wlo = min(wlo, lo);
      whi = max(whi, hi);
    }
  }
  const int ra = warp * 16 + g, rb = ra + 8;  // this thread's rows (C fragment rows g, g + 8)
  const int loA = sR[2 * ra], hiA = sR[2 * ra + 1], loB = sR[2 * rb], hiB = sR[2 * rb + 1];
  const int t_begin = ulo < uhi ? ulo / kPKeys : 0;
  const int t_end = ulo < uhi ? (uhi + kPKeys - 1) / kPKeys : 0;

  // Stage key tile t (keys 32t .. 32t + 31) into buffer `stage`: keys outside [ulo, uhi) become zeros
  // (never read: they may lie past the cache; zero V keeps 0 * v finite in P . V).
  auto load_tile = [&](int t, int stage) {
    float* dk = sK + stage * L::kKV;
    float* dv = sV + stage * L::kKV;
    for (int i = tid; i < kPKeys * C4; i += kPThreads) {
      const int j = i / C4, c = i % C4;
      const int key = t * kPKeys + j;
      float* pk = dk + j * S + 4 * c;
      float* pv = dv + j * S + 4 * c;
      if (key >= ulo && key < uhi) {
        const int64_t off = static_cast<int64_t>(key) * a.kv_stride + kvh * D + 4 * c;
        cp_async16(pk, a.k + off);
        cp_async16(pv, a.v + off);
      } else {
        *reinterpret_cast<float4*>(pk) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        *reinterpret_cast<float4*>(pv) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    }
  };

  float acc[NO][4];
#pragma unroll
  for (int i = 0; i < NO; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  float mA = -INFINITY, mB = -INFINITY, lA = 0.0f, lB = 0.0f;  // running max and sum of rows ra, rb

  if (t_begin < t_end) load_tile(t_begin, 0);
  cp_async_commit();
  for (int t = t_begin; t < t_end; ++t) {
    const int stage = (t - t_begin) & 1;
    if (t + 1 < t_end) load_tile(t + 1, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();  // tile t has landed (only the group of tile t + 1 may be pending)
    __syncthreads();
    const int kb = t * kPKeys;
    if (kb < whi && kb + kPKeys > wlo) {
      const float* ks = sK + stage * L::kKV;
      const float* vs = sV + stage * L::kKV;
      // S = Q . K^T: rows ra, rb x keys n*8 + 2 t4 + {0, 1} in s[n][{0, 1}] / s[n][{2, 3}].
      float s[4][4];
#pragma unroll
      for (int n = 0; n < 4; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
      const float* qa = sQ + ra * S + t4;
      const float* qb = sQ + rb * S + t4;
#pragma unroll
      for (int kk = 0; kk < D / 8; ++kk) {
        const uint32_t af[4] = {__float_as_uint(qa[8 * kk]), __float_as_uint(qb[8 * kk]),
                                __float_as_uint(qa[8 * kk + 4]), __float_as_uint(qb[8 * kk + 4])};
#pragma unroll
        for (int n = 0; n < 4; ++n) {
          const float* kr = ks + (n * 8 + g) * S + 8 * kk + t4;  // B (k = dim t4 / t4 + 4, n = key g)
          mma_tf32(s[n], af, to_tf32(kr[0]), to_tf32(kr[4]));
        }
      }
      // Online softmax over this tile.
      float xA = -INFINITY, xB = -INFINITY;
#pragma unroll
      for (int n = 0; n < 4; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = kb + n * 8 + 2 * t4 + (e & 1);
          const bool in = e < 2 ? (key >= loA && key < hiA) : (key >= loB && key < hiB);
          const float x = in ? s[n][e] * a.scale : -INFINITY;
          s[n][e] = x;
          if (e < 2)
            xA = fmaxf(xA, x);
          else
            xB = fmaxf(xB, x);
        }
      }
      const float nA = fmaxf(mA, quad_max(xA)), nB = fmaxf(mB, quad_max(xB));
      const float uA = nA == -INFINITY ? 0.0f : nA, uB = nB == -INFINITY ? 0.0f : nB;  // no inf - inf
      const float cA = expf(mA - uA), cB = expf(mB - uB);
      float sA = 0.0f, sB = 0.0f;
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        s[n][0] = expf(s[n][0] - uA);
        s[n][1] = expf(s[n][1] - uA);
        s[n][2] = expf(s[n][2] - uB);
        s[n][3] = expf(s[n][3] - uB);
        sA += s[n][0] + s[n][1];
        sB += s[n][2] + s[n][3];
      }
      lA = lA * cA + quad_sum(sA);
      lB = lB * cB + quad_sum(sB);
      mA = nA;
      mB = nB;
#pragma unroll
      for (int i = 0; i < NO; ++i) {
        acc[i][0] *= cA;
        acc[i][1] *= cA;
        acc[i][2] *= cB;
        acc[i][3] *= cB;
      }
      // O += P . V: mma k t4 <-> key 2 t4, k t4 + 4 <-> key 2 t4 + 1 (see the header).
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const uint32_t pf[4] = {to_tf32(s[n][0]), to_tf32(s[n][2]), to_tf32(s[n][1]), to_tf32(s[n][3])};
        const float* v0 = vs + (n * 8 + 2 * t4) * S + g;  // key 2 t4 of the n8 group, dim g of each n8 tile
        const float* v1 = v0 + S;                         // key 2 t4 + 1
#pragma unroll
        for (int i = 0; i < NO; ++i) mma_tf32(acc[i], pf, to_tf32(v0[8 * i]), to_tf32(v1[8 * i]));
      }
    }
    __syncthreads();  // everyone is done with `stage` before tile t + 2 is staged into it
  }

  const float iA = lA > 0.0f ? 1.0f / lA : 0.0f, iB = lB > 0.0f ? 1.0f / lB : 0.0f;
  if (r0 + ra < a.M) {
    float* o = a.out + ((r0 + ra) * a.n_heads + h) * D + 2 * t4;
#pragma unroll
    for (int i = 0; i < NO; ++i) *reinterpret_cast<float2*>(o + 8 * i) = make_float2(acc[i][0] * iA, acc[i][1] * iA);
  }
  if (r0 + rb < a.M) {
    float* o = a.out + ((r0 + rb) * a.n_heads + h) * D + 2 * t4;
#pragma unroll
    for (int i = 0; i < NO; ++i) *reinterpret_cast<float2*>(o + 8 * i) = make_float2(acc[i][2] * iB, acc[i][3] * iB);
  }
}

// ---- launch --------------------------------------------------------------------------------------------

template <int D>
bool launch_d(const PrefillAttnArgs& a, int64_t tiles, cudaStream_t s) {
  auto kernel = attention_prefill_kernel<D>;
  const size_t smem = PrefillSmem<D>::kBytes;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) !=
      cudaSuccess) {
    (void)cudaGetLastError();  // more shared memory than the device has: the caller falls back
    return false;
  }
  if (launch_ex(kernel, dim3(static_cast<unsigned>(a.n_heads), static_cast<unsigned>(tiles)), dim3(kPThreads), smem,
                s, dim3(1, 1, 1), pdl_enabled(), a) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return true;
}

}  // namespace

bool launch_attention_prefill(const float* q, const float* k, const float* v, const int32_t* kv_range, float* out,
                              int64_t M, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale,
                              cudaStream_t s) {
  if (M < kAttentionPrefillMinRows || n_kv_heads <= 0 || n_heads % n_kv_heads != 0) return false;
  if (head_dim != 64 && head_dim != 128 && head_dim != 256) return false;
  const auto misaligned = [](const void* p, uintptr_t n) { return reinterpret_cast<uintptr_t>(p) % n != 0; };
  if (misaligned(q, 16) || misaligned(k, 16) || misaligned(v, 16) || misaligned(out, 8)) return false;
  const int64_t tiles = (M + kPRows - 1) / kPRows;
  if (tiles > 65535 || n_heads > INT_MAX) return false;
  PrefillAttnArgs a{q, k, v, kv_range, out, M, n_heads, n_heads / n_kv_heads, n_kv_heads * head_dim, scale};
  switch (head_dim) {
    case 64: return launch_d<64>(a, tiles, s);
    case 128: return launch_d<128>(a, tiles, s);
    default: return launch_d<256>(a, tiles, s);
  }
}

}  // namespace dflash::cuda
