// Ternary matmul on integer tensor cores (PQ2_0, and PTQ1_0 transcoded at load time): the device
// layout, the load-time transcodes, the activation quantizer, the 8-column matmul tiles and get_rows.
//
// Why tensor cores for a GEMV. At the H200's ~4.5 TB/s a 2-bit weight arrives every ~0.06 ns and
// the chip issues ~1 warp-instruction per ns per 2 SMs: a kernel has ~2 thread-instructions per
// weight before it is ALU-bound. A CUDA-core dot product spends ~3 per weight at one activation row
// and ~10 at eight (the verify block); an f16 mma path (codes to f16, activations split hi + lo)
// measured ~4 per weight. Here a weight costs ~0.5 instructions to unpack for any number of
// activation rows up to 8 (the n of mma.m16n8k32), so the kernel can stay memory-bound and an
// 8-row verify costs about what one row does.
//
// Exactness. Activations are quantized per (row, block of 128) to a 24-bit block floating point:
// u = rint(x * 2^(16 - E)) with 2^E the power of two that puts the block's largest |x| in [32, 64),
// so |u| < 2^22 and the rounding error is <= 2^-23 of the block's largest |x| (fp32 level). u is
// split into three signed bytes, u = 65536 u0 + 256 u1 + u2. With the weight codes c in {0,1,2}
// as unsigned bytes, mma.s32.u8.s8 gives sum c * u_i exactly in int32, the accumulator starts at
// -S_i = -sum u_i (so it ends at sum (c - 1) u_i), and v = (D0 * 256 + D1) * 256 + D2 is the exact
// integer sum (c - 1) u (|v| < 2^31). Per block: acc = fma(d * 2^(E-16), float(v), acc). Integer
// sums do not depend on order, so the only roundings are the quantization, float(v) and the block
// fmas, in a fixed order: nothing depends on M, the number of activation rows (tested bit for bit).
//
// Layout "ternary-mma" (Layout::kTernaryMma). Rows are padded to Np = 16 * ceil(out / 16) (pad rows:
// codes 0 and scale 0, never stored); nblk = in / 128 blocks of 128 inputs share one fp16 scale d.
//   codes  u32 [Np/16 tiles][nblk][16 rows r][8 words]        32 bytes per row and block
//   scales u32 [Np/16 tiles][nblk][8 g] = fp16x2 (d of tile row g, d of tile row g + 8)
// Words 2t and 2t + 1 of a row block serve lane-quad position t (= lane & 3). Word w holds 16 codes:
// register q = 0..3 of it is (word >> 2q) & 0x03030303, the 4 codes (bytes e = 0..3) of
// k = 32 j + 16 h + 4 t + e with j = 2w + q / 2 (the k32 step) and h = q % 2. That is what lane
// (g, t) holds of A in mma.m16n8k32 (PTX ISA, "Matrix Fragments for mma.m16n8k32"): a0 = (row g,
// k 4t..4t+3), a1 = (row g+8, same k), a2 = (row g, k 4t+16..4t+19), a3 = (row g+8, k 4t+16..);
// B (activations, col-major) b0 = (k 4t..4t+3; n = g), b1 = (k 4t+16..; n = g); D: d0d1 = (row g,
// n 2t, 2t+1), d2d3 = (row g+8, n 2t, 2t+1).
//
// Work split: a CTA (4 warps) owns 4 tiles (64 weight rows) x 8 activation rows x a k-range; warp w
// takes blocks b_lo + w, + 4, ... of it in order; the 4 warp sums are added in warp order; with a
// k split over CTAs (ks <= 8, a function of the weights' shapes and the GPU, never of M) the ks CTAs
// of a (tile, rows) pair form one thread-block cluster, and CTA 0 of the cluster adds the ks partial
// sums in split order, reading them from the others' shared memory (no global round trip, no
// atomics). A launch may cover up to 4 weights that share the input (matmul_group), each weight's
// tiles a range of grid.x. Each warp streams its blocks through a
// cp.async ring in shared memory (4 stages up to 4 activation rows, 2 beyond), so the next blocks' loads
// are in flight while one computes.
#include <algorithm>
#include <cstdlib>

#include <cooperative_groups.h>

#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace dflash::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kTilesPerCta = 4;  // 16-row tiles per CTA (64 weight rows)
constexpr int kWarpsPerCta = 4;  // warps per CTA, splitting the CTA's blocks
constexpr int kCols = 8;         // activation rows per CTA (the n of the mma)
constexpr int kXqBytes = 3 * 128;  // one (row, block) of quantized activations: 3 digit planes
constexpr int kXqMeta = 16;        // and its S0, S1, S2, 2^(E-16)

// Trit n of a base-3 byte (PTQ1_0): ((uint8)(b * 3^n) * 3) >> 8, in 0..2.
__device__ __forceinline__ uint32_t trit3(uint32_t b, int n) {
  const uint32_t pw = n == 0 ? 1u : n == 1 ? 3u : n == 2 ? 9u : n == 3 ? 27u : 81u;
  return (((b * pw) & 0xffu) * 3u) >> 8;
}
// Code (0..2) of element e of a PTQ1_0 block (28 B / 128): elems 0..79 digit n of qs[m] (16n + m);
// 80..119 digit n of qs[16 + m] (80 + 8n + m); 120..127 digit n of qh[h] (120 + 2n + h).
__device__ __forceinline__ uint32_t ptq1_code_of(const uint8_t* b, int e) {
  if (e < 80) return trit3(b[e & 15], e >> 4);
  if (e < 120) return trit3(b[16 + ((e - 80) & 7)], (e - 80) >> 3);
  return trit3(b[24 + ((e - 120) & 1)], (e - 120) >> 1);
}
// PQ2_0 (34 B / 128): fp16 d, then element e at bits 2 (e % 4) of byte 2 + e / 4.
__device__ __forceinline__ uint32_t pq2_code_of(const uint8_t* b, int e) { return (b[2 + (e >> 2)] >> (2 * (e & 3))) & 3u; }

// Position of element k (0..127) of a row block in the layout: word index (0..7) and bit of its code.
__device__ __forceinline__ void code_position(int k, int& word, int& bit) {
  const int j = k >> 5, h = (k >> 4) & 1, t = (k >> 2) & 3, e = k & 3;
  word = 2 * t + (j >> 1);
  bit = 8 * e + 2 * (2 * (j & 1) + h);
}

// ---- load-time transcode: one thread per destination code word -----------------------------------

template <bool kPtq1>
__global__ void to_ternary_mma_kernel(const uint8_t* __restrict__ src, uint32_t* __restrict__ codes,
                                      uint32_t* __restrict__ scales, int64_t N, int nblk, int64_t total_words) {
  pdl_wait();
  const int64_t gid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (gid >= total_words) return;
  const int wi = static_cast<int>(gid & 7), r = static_cast<int>((gid >> 3) & 15);
  const int64_t rest = gid >> 7;
  const int b = static_cast<int>(rest % nblk);
  const int64_t tile = rest / nblk;
  const int64_t row = tile * 16 + r;
  const int t = wi >> 1, w = wi & 1;
  uint32_t word = 0;
  uint16_t d = 0;
  if (row < N) {
    const uint8_t* blk = src + (row * nblk + b) * (kPtq1 ? 28 : 34);
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int k = 32 * (2 * w + (q >> 1)) + 16 * (q & 1) + 4 * t + e;
        const uint32_t c = kPtq1 ? ptq1_code_of(blk, k) : pq2_code_of(blk, k);
        word |= c << (8 * e + 2 * q);
      }
    d = kPtq1 ? static_cast<uint16_t>(blk[26] | (blk[27] << 8)) : static_cast<uint16_t>(blk[0] | (blk[1] << 8));
  }
  codes[gid] = word;
  if (wi == 0) reinterpret_cast<uint16_t*>(scales)[((tile * nblk + b) * 8 + (r & 7)) * 2 + (r >> 3)] = d;
}

// ---- activation quantizer: one CTA of 128 threads per (row, block) ---------------------------------
// xq: [M][nblk] records of 3 digit planes, each in B-fragment order (lane-quad t's 8 words: word
// 2j + h holds bytes k = 32 j + 16 h + 4 t + e), then meta [M][nblk] = (S0, S1, S2, float 2^(E-16)).

__global__ void __launch_bounds__(128) quantize_x24_kernel(const float* __restrict__ x, int64_t K, int nblk,
                                                           uint8_t* __restrict__ xq, int32_t* __restrict__ meta) {
  pdl_wait();
  __shared__ float smax[4];
  __shared__ int ssum[3][4];
  const int k = threadIdx.x, lane = k & 31, warp = k >> 5;
  const int b = blockIdx.x;
  const int64_t m = blockIdx.y;
  const float v = x[m * K + static_cast<int64_t>(b) * 128 + k];
  float amax = fabsf(v);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (lane == 0) smax[warp] = amax;
  __syncthreads();
  amax = fmaxf(fmaxf(smax[0], smax[1]), fmaxf(smax[2], smax[3]));
  int ex = 0;
  if (amax > 0.0f && isfinite(amax)) frexpf(amax, &ex);  // amax = f 2^ex, f in [0.5, 1)
  const int E = ex - 6;                                   // |x| / 2^E < 64
  const int u = __float2int_rn(ldexpf(v, 16 - E));         // |u| < 2^22, exact product
  const int d2 = static_cast<int8_t>(u & 0xff);
  const int u1 = (u - d2) >> 8;
  const int d1 = static_cast<int8_t>(u1 & 0xff);
  const int d0 = (u1 - d1) >> 8;  // |d0| <= 64
  const int j = k >> 5, h = (k >> 4) & 1, t = (k >> 2) & 3, e = k & 3;
  uint8_t* rec = xq + (m * nblk + b) * kXqBytes + t * 32 + (2 * j + h) * 4 + e;
  rec[0] = static_cast<uint8_t>(d0);
  rec[128] = static_cast<uint8_t>(d1);
  rec[256] = static_cast<uint8_t>(d2);
  const int s0 = __reduce_add_sync(0xffffffffu, d0), s1 = __reduce_add_sync(0xffffffffu, d1),
            s2 = __reduce_add_sync(0xffffffffu, d2);
  if (lane == 0) {
    ssum[0][warp] = s0;
    ssum[1][warp] = s1;
    ssum[2][warp] = s2;
  }
  __syncthreads();
  if (k < 3) meta[(m * nblk + b) * 4 + k] = ssum[k][0] + ssum[k][1] + ssum[k][2] + ssum[k][3];
  if (k == 3) meta[(m * nblk + b) * 4 + 3] = __float_as_int(ldexpf(1.0f, E - 16));
}

// ---- matmul --------------------------------------------------------------------------------------

// One weight of a launch. A launch covers up to kTernaryMaxGroup weights that share the input (one
// grid: CTAs [cta_end of the previous part, cta_end) are this part's 64-row tiles).
struct TernaryPart {
  const uint32_t* codes;
  const uint32_t* scales;
  float* y;
  int64_t N;    // rows (outputs)
  int tiles;    // 16-row tiles (Np / 16)
  int cta_end;  // one past this part's last CTA (blockIdx.x)
};
struct TernaryArgs {
  TernaryPart part[kTernaryMaxGroup];
  int nparts;
  const uint8_t* xq;    // quantized activations [M][nblk][384 B]
  const int32_t* meta;  // [M][nblk][4]
  int64_t M;
  int nblk, ks;
  int kb[9];  // the k split's block boundaries: CTA z takes blocks kb[z] .. kb[z + 1] (no division on the device)
};

__device__ __forceinline__ void mma_u8s8(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1, const int (&c)[4]) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]));
}

// Stage layout: codes [4 tiles][16 rows][8 words] | scales [4 tiles][8] | xq [mc][384 B] | meta [mc][4].
__host__ __device__ constexpr int stage_bytes(int mc) {
  return kTilesPerCta * 512 + kTilesPerCta * 32 + mc * (kXqBytes + kXqMeta);
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Per-warp source pointers of block b_lo (advanced by kWarpsPerCta blocks per issue).
struct BlockSrc {
  const uint32_t* codes[kTilesPerCta];  // this lane's 16-byte piece of each tile's block
  const uint32_t* scales;               // lanes < 2 nt: one 16-byte piece of the scales
  const uint8_t* xq;                    // activation record of row m0 (rows nblk records apart)
  const int32_t* meta;
};

// One warp copies one block (codes and scales of the CTA's tiles, quantized activations of its mc
// rows) into a stage: 16-byte pieces, lane-strided.
__device__ __forceinline__ void issue_weights(const BlockSrc& src, int64_t boff, int lane, uint8_t* stage) {
#pragma unroll
  for (int i = 0; i < kTilesPerCta; ++i)  // tiles past the last one re-read it (pointers clamped)
    cp_async16(stage + i * 512 + lane * 16, src.codes[i] + boff * 128);
  if (lane < 2 * kTilesPerCta) cp_async16(stage + kTilesPerCta * 512 + lane * 16, src.scales + boff * 8);
}
__device__ __forceinline__ void issue_acts(const BlockSrc& src, int64_t boff, int nblk, int mc, int lane,
                                           uint8_t* stage) {
  uint8_t* xs = stage + kTilesPerCta * 544;
  for (int p = lane; p < mc * (kXqBytes / 16); p += 32) {  // 24 pieces per row
    const int r = p / (kXqBytes / 16), q = p % (kXqBytes / 16);
    cp_async16(xs + r * kXqBytes + q * 16, src.xq + (static_cast<int64_t>(r) * nblk + boff) * kXqBytes + q * 16);
  }
  if (lane < mc) cp_async16(xs + mc * kXqBytes + lane * 16, src.meta + (static_cast<int64_t>(lane) * nblk + boff) * 4);
}
__device__ __forceinline__ void issue_block(const BlockSrc& src, int64_t boff, int nblk, int mc, int lane,
                                            uint8_t* stage) {
  issue_weights(src, boff, lane, stage);
  issue_acts(src, boff, nblk, mc, lane, stage);
}

// Columns of the mma's B (n = 8 per n-tile): the 3 digit planes of the activation rows, column
// c = R p + m for plane p of row m (R = 2, 4 or 8 rows per plane group, NT = ceil(3R / 8) n-tiles).
// One or two activation rows (decode) fill one n-tile: 16 mma per block for 4 tiles instead of the
// 48 that a plane per n-tile costs. Lane quad position t < R / 2 owns rows m = 2t, 2t + 1 (D's
// columns 2t, 2t + 1): it gathers the 3 plane sums of its rows (its own n-tiles, or through a
// shuffle from lane t + 1 or t + 2 of the quad) into the exact v = (D0 * 256 + D1) * 256 + D2. So the
// float steps of a row, acc = fma(d * 2^(E-16), float(v), acc) per block, are the same for every R
// and M: row m has the same bits whatever M is.
template <int R>
struct ColMap {
  static constexpr int kNt = (3 * R + 7) / 8;
};

// Per-lane constants of the column map for one CTA (mc activation rows).
template <int R>
struct LaneCols {
  static constexpr int NT = ColMap<R>::kNt;
  int b_off[NT];      // B: byte offset of (row, plane) of column 8 nt + g in an xq stage, -1 if empty
  int d_meta[NT][2];  // D: columns 8 nt + 2t + {0, 1}: int index of S_p in the stage's meta, -1 if empty
  int sx_meta[2];     // owned rows 2t, 2t + 1: int index of 2^(E-16) in the meta, -1 if none
  __device__ __forceinline__ LaneCols(int mc, int g, int t) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int cb = 8 * nt + g, pb = cb / R, mb = cb % R;
      b_off[nt] = pb < 3 && mb < mc ? mb * kXqBytes + pb * 128 + t * 32 : -1;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int c = 8 * nt + 2 * t + h, p = c / R, m = c % R;
        d_meta[nt][h] = p < 3 && m < mc ? m * 4 + p : -1;
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) sx_meta[h] = 2 * t < R && 2 * t + h < mc ? (2 * t + h) * 4 + 3 : -1;
  }
};

// One staged block for the CTA's tiles: acc[i][jj] += d 2^(E-16) * v for the lane's owned (weight
// row, activation row) pairs (d2d3 rows g, g + 8 x d0d1 columns 2t, 2t + 1). Straight-line code over
// all 4 tiles (a short last tile column computes copies of its last tile and stores nothing for them).
template <int R>
__device__ __forceinline__ void block_compute(const uint8_t* stage, int mc, int g, int t, const LaneCols<R>& lc,
                                              float (&acc)[kTilesPerCta][4]) {
  constexpr int NT = ColMap<R>::kNt;
  const uint8_t* xs = stage + kTilesPerCta * 544;
  const int32_t* meta = reinterpret_cast<const int32_t*>(xs + mc * kXqBytes);  // [mc][S0, S1, S2, 2^(E-16)]
  uint32_t bq[NT][8];
  int cinit[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    uint4 lo = make_uint4(0, 0, 0, 0), hi = make_uint4(0, 0, 0, 0);
    if (lc.b_off[nt] >= 0) {
      const uint4* src = reinterpret_cast<const uint4*>(xs + lc.b_off[nt]);
      lo = src[0];
      hi = src[1];
    }
    bq[nt][0] = lo.x, bq[nt][1] = lo.y, bq[nt][2] = lo.z, bq[nt][3] = lo.w;
    bq[nt][4] = hi.x, bq[nt][5] = hi.y, bq[nt][6] = hi.z, bq[nt][7] = hi.w;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int mi = lc.d_meta[nt][h];
      cinit[nt][h] = cinit[nt][h + 2] = mi >= 0 ? -meta[mi] : 0;
    }
  }
  float sx[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) sx[h] = lc.sx_meta[h] >= 0 ? __int_as_float(meta[lc.sx_meta[h]]) : 0.0f;
#pragma unroll
  for (int i = 0; i < kTilesPerCta; ++i) {
    const uint32_t* cw = reinterpret_cast<const uint32_t*>(stage + i * 512);
    const uint2 rg = *reinterpret_cast<const uint2*>(cw + g * 8 + 2 * t);
    const uint2 rg8 = *reinterpret_cast<const uint2*>(cw + (g + 8) * 8 + 2 * t);
    const uint32_t sc = reinterpret_cast<const uint32_t*>(stage + kTilesPerCta * 512)[i * 8 + g];
    int d[NT][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int q = 2 * (j & 1);  // registers q (h = 0) and q + 1 (h = 1) of word j / 2
      const uint32_t wg = j < 2 ? rg.x : rg.y, wg8 = j < 2 ? rg8.x : rg8.y;
      const uint32_t a0 = (wg >> (2 * q)) & 0x03030303u, a1 = (wg8 >> (2 * q)) & 0x03030303u;
      const uint32_t a2 = (wg >> (2 * q + 2)) & 0x03030303u, a3 = (wg8 >> (2 * q + 2)) & 0x03030303u;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (j == 0)
          mma_u8s8(d[nt], a0, a1, a2, a3, bq[nt][0], bq[nt][1], cinit[nt]);
        else
          mma_u8s8(d[nt], a0, a1, a2, a3, bq[nt][2 * j], bq[nt][2 * j + 1], d[nt]);
      }
    }
    const float dg = fp16_to_f32(static_cast<uint16_t>(sc & 0xffffu));
    const float dg8 = fp16_to_f32(static_cast<uint16_t>(sc >> 16));
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      // The plane sums of the owned column (|D| <= 128 * 128), then v exactly (|v| < 2^31).
      int D0, D1, D2;
      if constexpr (R == 2) {
        D0 = d[0][jj];
        D1 = __shfl_down_sync(0xffffffffu, d[0][jj], 1);
        D2 = __shfl_down_sync(0xffffffffu, d[0][jj], 2);
      } else if constexpr (R == 4) {
        D0 = d[0][jj];
        D1 = __shfl_down_sync(0xffffffffu, d[0][jj], 2);
        D2 = d[1][jj];
      } else {
        D0 = d[0][jj];
        D1 = d[1][jj];
        D2 = d[2][jj];
      }
      const int v = (D0 * 256 + D1) * 256 + D2;
      acc[i][jj] = __fmaf_rn(__fmul_rn(jj < 2 ? dg : dg8, sx[jj & 1]), static_cast<float>(v), acc[i][jj]);
    }
  }
}

template <int kStages, int R>
__global__ void __launch_bounds__(kWarpsPerCta * 32, 4) mm_ternary_kernel(const TernaryArgs a) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  // This CTA's weight (part) and its first tile in that weight.
  TernaryPart pt = a.part[0];
  int cta_begin = 0;
#pragma unroll
  for (int k = 1; k < kTernaryMaxGroup; ++k)
    if (k < a.nparts && static_cast<int>(blockIdx.x) >= a.part[k - 1].cta_end) {
      cta_begin = a.part[k - 1].cta_end;
      pt = a.part[k];
    }
  const int tiles = pt.tiles;
  const int tile0 = (blockIdx.x - cta_begin) * kTilesPerCta;
  const int nt_rows = min(kTilesPerCta, tiles - tile0) * 16;  // weight rows of this CTA (<= 64)
  const int ntile = nt_rows / 16;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kCols;
  const int mc = a.M - m0 < kCols ? static_cast<int>(a.M - m0) : kCols;
  const int z = blockIdx.z;
  const int b_lo = a.kb[z], b_hi = a.kb[z + 1];
  const int sb = stage_bytes(mc);
  uint8_t* ring = smem + warp * kStages * sb;
  const LaneCols<R> lc(mc, g, t);

  float acc[kTilesPerCta][4];
#pragma unroll
  for (int i = 0; i < kTilesPerCta; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

  // This warp's blocks: first + kWarpsPerCta * j, j < nj.
  const int first = b_lo + warp;
  const int nj = first < b_hi ? (b_hi - first + kWarpsPerCta - 1) / kWarpsPerCta : 0;
  BlockSrc src;
#pragma unroll
  for (int i = 0; i < kTilesPerCta; ++i)
    src.codes[i] = pt.codes + ((static_cast<int64_t>(tile0 + min(i, ntile - 1)) * a.nblk + first) * 128 + lane * 4);
  src.scales =
      pt.scales + ((static_cast<int64_t>(tile0 + min(lane >> 1, ntile - 1)) * a.nblk + first) * 8 + (lane & 1) * 4);
  src.xq = a.xq + (m0 * a.nblk + first) * kXqBytes;
  src.meta = a.meta + (m0 * a.nblk + first) * 4;
  // The first stages' weights do not depend on earlier kernels: their loads start before pdl_wait(),
  // while the previous kernel drains (they land in the first commit group).
#pragma unroll
  for (int q = 0; q < kStages - 1; ++q)
    if (q < nj) issue_weights(src, static_cast<int64_t>(q) * kWarpsPerCta, lane, ring + q * sb);
  pdl_wait();
#pragma unroll
  for (int q = 0; q < kStages - 1; ++q) {
    if (q < nj) issue_acts(src, static_cast<int64_t>(q) * kWarpsPerCta, a.nblk, mc, lane, ring + q * sb);
    cp_async_commit();
  }
  for (int j = 0; j < nj; ++j) {
    cp_async_wait<kStages - 2>();
    __syncwarp();
    block_compute<R>(ring + (j % kStages) * sb, mc, g, t, lc, acc);
    __syncwarp();  // every lane is done with the stage that the next issue overwrites
    const int jn = j + kStages - 1;
    if (jn < nj)
      issue_block(src, static_cast<int64_t>(jn) * kWarpsPerCta, a.nblk, mc, lane, ring + (jn % kStages) * sb);
    cp_async_commit();
  }
  cp_async_wait<0>();
  __syncthreads();  // the rings are free: the warp sums go there

  // red[w][m][row]: warp w's sum for activation row m (< R) and CTA weight row (< 64).
  float* red = reinterpret_cast<float*>(smem);
  if (2 * t < R)
#pragma unroll
    for (int i = 0; i < kTilesPerCta; ++i)
#pragma unroll
      for (int jj = 0; jj < 4; ++jj)
        red[(warp * R + 2 * t + (jj & 1)) * 64 + 16 * i + g + (jj >= 2 ? 8 : 0)] = acc[i][jj];
  __syncthreads();
  // Output (row, m): the warps' sums in warp order.
  constexpr int kOutPerThread = (64 * kCols + kWarpsPerCta * 32 - 1) / (kWarpsPerCta * 32);
  float out[kOutPerThread];
#pragma unroll
  for (int k = 0; k < kOutPerThread; ++k) {
    const int o = threadIdx.x + k * kWarpsPerCta * 32, row = o & 63, m = o >> 6;
    out[k] = 0.0f;
    if (m < mc && row < nt_rows) {
      float s = red[m * 64 + row];
#pragma unroll
      for (int w = 1; w < kWarpsPerCta; ++w) s += red[(w * R + m) * 64 + row];
      out[k] = s;
    }
  }

  if (a.ks > 1) {
    // k split over the ks CTAs of a cluster (1, 1, ks): each publishes its sums in its shared memory,
    // CTA 0 adds the ks parts in split order (distributed shared memory) and stores y; the others
    // wait at a second barrier until it has read them.
    cg::cluster_group cluster = cg::this_cluster();
    float* fin = reinterpret_cast<float*>(smem) + kWarpsPerCta * R * 64;  // [kOutPerThread][128 threads]
#pragma unroll
    for (int k = 0; k < kOutPerThread; ++k) fin[k * kWarpsPerCta * 32 + threadIdx.x] = out[k];
    cluster.sync();
    const bool lead = cluster.block_rank() == 0;
    if (lead)
#pragma unroll
      for (int k = 0; k < kOutPerThread; ++k) {
        float s = out[k];
        for (int zz = 1; zz < a.ks; ++zz) s += cluster.map_shared_rank(fin, zz)[k * kWarpsPerCta * 32 + threadIdx.x];
        out[k] = s;
      }
    cluster.sync();
    if (!lead) return;
  }
#pragma unroll
  for (int k = 0; k < kOutPerThread; ++k) {
    const int o = threadIdx.x + k * kWarpsPerCta * 32, row = o & 63, m = o >> 6;
    const int64_t grow = static_cast<int64_t>(tile0) * 16 + row;
    if (m < mc && row < nt_rows && grow < pt.N) pt.y[(m0 + m) * pt.N + grow] = out[k];
  }
}

// ---- get_rows: one thread per element --------------------------------------------------------------

__global__ void get_rows_ternary_kernel(const uint32_t* __restrict__ codes, const uint32_t* __restrict__ scales,
                                        int64_t K, int64_t N, int nblk, const int32_t* __restrict__ ids,
                                        float* __restrict__ y) {
  pdl_wait();
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t m = blockIdx.y;
  if (e >= K) return;
  const int32_t id = ids[m];
  if (id < 0 || id >= N) {
    y[m * K + e] = __int_as_float(0x7fc00000);
    return;
  }
  const int64_t tile = id >> 4;
  const int r = id & 15;
  const int b = static_cast<int>(e >> 7);
  int word, bit;
  code_position(static_cast<int>(e & 127), word, bit);
  const int64_t tb = tile * nblk + b;
  const int c = static_cast<int>((codes[tb * 128 + r * 8 + word] >> bit) & 3u);
  const uint32_t dd = scales[tb * 8 + (r & 7)];
  const float d = fp16_to_f32(static_cast<uint16_t>(r < 8 ? dd & 0xffffu : dd >> 16));
  y[m * K + e] = __fmul_rn(static_cast<float>(c - 1), d);
}

}  // namespace

// The matmul launch: clusters of the ks split CTAs (grid.z = ks), with programmatic dependent launch.
void launch_split(void (*kernel)(TernaryArgs), dim3 grid, size_t smem, cudaStream_t s, const TernaryArgs& a) {
  (void)launch_ex(kernel, grid, dim3(kWarpsPerCta * 32), smem, s, dim3(1, 1, grid.z), pdl_enabled(), a);
}

// CTAs (64-row tiles) of an out-row weight.
static int64_t ternary_ctas(int64_t out) { return (padded_rows(out) / 16 + kTilesPerCta - 1) / kTilesPerCta; }

// CTAs per SM that the k split aims at (one wave): DFLASH_CUDA_TERNARY_WAVE (default 3), read once.
// A device setting, like the SM count: it never depends on M. Measured on the H200 (27B decode step,
// commit after 1744dbf): 4 -> 7.52 ms, 3 -> 6.95 ms, 2 -> 7.09 ms (fewer, longer-lived warps amortise
// each warp's fixed prologue and epilogue; 2 leaves SMs short of bytes in flight).
static int ternary_ctas_per_sm() {
  static const int v = [] {
    const char* e = std::getenv("DFLASH_CUDA_TERNARY_WAVE");
    const int n = e ? std::atoi(e) : 0;
    return n >= 1 && n <= 8 ? n : 3;
  }();
  return v;
}

static int ternary_splits_for(int64_t ctas, int64_t in, int num_sms) {
  const int64_t nblk = in / 128;
  // As many CTAs as fit in one wave at ternary_ctas_per_sm() CTAs per SM: a GEMV needs warps for bytes
  // in flight, and a second wave would double the time.
  const int64_t want = ternary_ctas_per_sm() * static_cast<int64_t>(std::max(num_sms, 1)) / std::max<int64_t>(ctas, 1);
  const int64_t most = std::max<int64_t>(1, nblk / (2 * kWarpsPerCta));  // >= 2 blocks per warp
  // <= 8: the split CTAs form one cluster (8 is the portable cluster size)
  return static_cast<int>(std::clamp<int64_t>(want, 1, std::min<int64_t>(most, 8)));
}

constexpr int64_t kMaxRowsPerLaunch = 65535;  // grid.y of the activation quantizer

TernaryScratch ternary_scratch(int64_t in, int64_t M) {
  TernaryScratch need;
  const int64_t rows = std::min(M, kMaxRowsPerLaunch);
  need.xq_bytes = static_cast<size_t>(std::max<int64_t>(rows, 0)) * (in / 128) * (kXqBytes + kXqMeta);
  return need;
}

void launch_matmul_ternary_group(const DevWeight* const* ws, float* const* ys, int n, const float* x,
                                 int64_t M, const TernaryBuffers& buf, int num_sms, cudaStream_t s) {
  if (n <= 0 || n > kTernaryMaxGroup || M <= 0) return;
  TernaryArgs a{};
  a.nparts = n;
  const int64_t in = ws[0]->in;
  a.nblk = static_cast<int>(in / 128);
  int64_t gx = 0;
  for (int k = 0; k < n; ++k) {
    TernaryPart& p = a.part[k];
    p.codes = reinterpret_cast<const uint32_t*>(ws[k]->data);
    p.scales = reinterpret_cast<const uint32_t*>(ws[k]->scales);
    p.N = ws[k]->out;
    p.tiles = static_cast<int>(padded_rows(ws[k]->out) / 16);
    gx += ternary_ctas(ws[k]->out);
    p.cta_end = static_cast<int>(gx);
  }
  a.ks = ternary_splits_for(gx, in, num_sms);
  for (int z = 0; z <= a.ks; ++z) a.kb[z] = static_cast<int>(static_cast<int64_t>(a.nblk) * z / a.ks);
  static bool attr_set = false;
  if (!attr_set) {  // rings above the 48 KB default; the largest shared-memory carveout so 4 CTAs fit
    const auto setup = [](auto kernel, int bytes) {
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
    };
    setup(mm_ternary_kernel<4, 2>, kWarpsPerCta * 4 * stage_bytes(2));
    setup(mm_ternary_kernel<4, 4>, kWarpsPerCta * 4 * stage_bytes(4));
    setup(mm_ternary_kernel<2, 8>, kWarpsPerCta * 2 * stage_bytes(kCols));
    attr_set = true;
  }
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRowsPerLaunch) {
    a.M = std::min(kMaxRowsPerLaunch, M - m0);
    for (int k = 0; k < n; ++k) a.part[k].y = ys[k] + m0 * ws[k]->out;
    auto* xq = static_cast<uint8_t*>(buf.xq);
    auto* meta = reinterpret_cast<int32_t*>(xq + static_cast<size_t>(a.M) * a.nblk * kXqBytes);
    if (!buf.xq_ready || m0 > 0)
      launch_pdl(quantize_x24_kernel, dim3(static_cast<unsigned>(a.nblk), static_cast<unsigned>(a.M)), 128, 0, s,
                 x + m0 * in, in, a.nblk, xq, meta);
    a.xq = xq;
    a.meta = meta;
    const int64_t gy = (a.M + kCols - 1) / kCols;
    const int mc = static_cast<int>(std::min<int64_t>(a.M, kCols));  // rows staged: the largest tile's
    const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy), static_cast<unsigned>(a.ks));
    // Ring depth: 4 stages up to 4 activation rows (decode: 41 KB per CTA), 2 beyond (verify: 43 KB),
    // so that 4 CTAs fit per SM either way; R (rows per plane group) from the widest tile. Scheduling
    // and column placement only: the arithmetic of a row is the same.
    if (mc <= 2)
      launch_split(mm_ternary_kernel<4, 2>, grid, kWarpsPerCta * 4 * stage_bytes(mc), s, a);
    else if (mc <= 4)
      launch_split(mm_ternary_kernel<4, 4>, grid, kWarpsPerCta * 4 * stage_bytes(mc), s, a);
    else
      launch_split(mm_ternary_kernel<2, 8>, grid, kWarpsPerCta * 2 * stage_bytes(mc), s, a);
  }
}

void launch_matmul_ternary(const DevWeight& w, const float* x, float* y, int64_t M, const TernaryBuffers& buf,
                           int num_sms, cudaStream_t s) {
  const DevWeight* one[1] = {&w};
  float* const ys[1] = {y};
  launch_matmul_ternary_group(one, ys, 1, x, M, buf, num_sms, s);
}

void launch_get_rows_ternary(const DevWeight& w, const int32_t* ids, float* y, int64_t M, cudaStream_t s) {
  launch_pdl(get_rows_ternary_kernel, dim3(ceil_div_u(w.in, 256), static_cast<unsigned>(M)), 256, 0, s, 
      reinterpret_cast<const uint32_t*>(w.data), reinterpret_cast<const uint32_t*>(w.scales), w.in, w.out,
      static_cast<int>(w.in / 128), ids, y);
}

size_t ternary_code_bytes(int64_t in, int64_t out) { return static_cast<size_t>(padded_rows(out)) * (in / 4); }
size_t ternary_scale_bytes(int64_t in, int64_t out) { return static_cast<size_t>(padded_rows(out)) * (in / 128) * 2; }

void launch_to_ternary_mma(const uint8_t* src, bool ptq1, uint8_t* codes, uint8_t* scales, int64_t in, int64_t out,
                           cudaStream_t s) {
  const int nblk = static_cast<int>(in / 128);
  const int64_t words = padded_rows(out) * nblk * 8;
  if (words <= 0) return;
  auto* c = reinterpret_cast<uint32_t*>(codes);
  auto* sc = reinterpret_cast<uint32_t*>(scales);
  if (ptq1)
    launch_pdl(to_ternary_mma_kernel<true>, ceil_div_u(words, 256), 256, 0, s, src, c, sc, out, nblk, words);
  else
    launch_pdl(to_ternary_mma_kernel<false>, ceil_div_u(words, 256), 256, 0, s, src, c, sc, out, nblk, words);
}

}  // namespace dflash::cuda
