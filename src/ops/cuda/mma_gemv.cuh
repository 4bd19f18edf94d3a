// Small-M matmul on the integer tensor cores (M <= 8 activation rows per CTA): the pipeline shared by
// the weight formats that feed mma.sync with byte codes. matmul_ternary.cu (PQ2_0, PTQ1_0) and
// matmul_kquant.cu (Q4_K, Q6_K) each define a format (its device layout and its block_compute) and
// instantiate mm_mma_kernel<Format, ...> here; everything about activations, staging, the k split and
// the reduction is common.
//
// Activations (shared by every format): quantize_xq_kernel writes, per (row, block of 128 inputs), a
// block fixed point: u = rint(x * 2^(kXqShift - E)) with 2^E the power of two that puts the block's
// largest |x| in [32, 64), split into kXqPlanes signed bytes (the digit planes; 2 planes: u = 256 u0 +
// u1, |u| < 2^14, the rounding error <= 2^-14 of the block's largest |x|; xq_record.cuh says why 2 and
// what 3 would give), stored in mma B-fragment order (lane-quad position t's 8 words: word 2j + h holds
// the bytes k = 32 j + 16 h + 4 t + e, e = 0..3; words 0-3 and 4-7 swapped in odd rows, xq_half_swizzle),
// with meta (S, 2^(E-kXqShift), 0, 0): the digit sum S = sum u and the scale; records and meta are
// block-major ([nblk][M], xq_record.cuh), so a CTA's rows of one block are one contiguous run.
// Integer products of weight codes and digits are exact and order-free; a format's block_compute
// turns them into floats in a fixed order per (weight row, activation row), so nothing depends on M.
//
// Columns of the mma's B (n = 8 per n-tile): the digit planes of the activation rows, column c = R p + m
// for plane p of row m (R = 1, 2, 4 or 8 rows per plane group, NT = ceil(kXqPlanes R / 8) n-tiles: at
// 2 planes the 8-row block is 2 n-tiles, at 3 it was 3). One or two activation rows (decode) fill one
// n-tile. Lane quad position t < R / 2 owns rows m = 2t, 2t + 1 (D's columns 2t, 2t + 1):
// gather_planes() brings it the plane sums of its rows (its own n-tiles, or through a shuffle from a
// lane t + 1 or t + 2 of the quad), so the float steps of a row are the same for every R and M. R = 1
// (one activation row, the decode step) is the exception: lane t = 0 owns row 0 through D's columns 0
// and 1 (planes 0 and 1; a third plane would come from lane t = 1), so a tile's block needs 2 plane
// combinations and no shuffle instead of R = 2's 4 and 4 (half of them for a row that does not exist).
// The plane sums are exact integers, so the map changes no bits.
// row_col_used<R>(jj) says whether accumulator register jj (D's jj) belongs to an owned row.
//
// Work split: a CTA (F::kWarps warps) owns 4 tiles (64 weight rows) x 8 activation rows x a k-range;
// warp w takes blocks b_lo + w, + kWarps, ... of it in order; the warp sums are added in warp order; with a k
// split over CTAs (ks <= 8, a function of the weights' shapes and the GPU, never of M) the ks CTAs of a
// (tile, rows) pair form one thread-block cluster, and CTA 0 of the cluster adds the ks partial sums in
// split order, reading them from the others' shared memory (no global round trip, no atomics). Or, for
// an output only a residual op reads (matmul_parts), each CTA stores its partial sums as part z of y and
// exits: no cluster, no reduction here; the residual's norm kernel adds the parts in the same order, so
// the bits are the same (H200, 27B PTQ1_0, S16-3 against the cluster reduction: decode 4.10-4.14 ->
// 3.94-3.96 ms, verify 6.44-6.53 -> 6.23-6.38, draft 1.055-1.059 -> 1.011). Global partials with arrival
// counters (the last CTA adds them) were slower than the cluster (S16-1). A
// launch may cover up to 4 weights of one format that share the input (matmul_group), each weight's
// tiles a range of grid.x. Each warp streams its blocks through a cp.async ring in shared memory, so
// the next blocks' loads are in flight while one computes.
//
// A format F provides:
//   kCodeBytes, kScaleBytes  bytes of one 16-row tile's block of 128 inputs (multiples of 16; codes a
//                            multiple of 512): the device layout is codes [tiles][nblk][kCodeBytes],
//                            scales [tiles][nblk][kScaleBytes]
//   kWarps                   warps per CTA (they split the CTA's k-range block by block)
//   kMinBlocks               CTAs per SM for __launch_bounds__ (caps the registers)
//   kWave                    CTAs per SM the k split aims at (one wave; what its shared-memory ring allows)
//   kStagesOneRow            ring depth at one activation row (the decode step; DFLASH_CUDA_MM_ONE_ROW_RING=0
//                            takes kStagesNarrow instead, for comparison)
//   kStagesNarrow, kStagesWide   ring depth up to 4 activation rows, and beyond (kStagesWideAlt: another
//                            depth for 5-8 rows, chosen at run time by DFLASH_CUDA_WIDE_STAGES_ALT=1)
//   block_compute<R>(stage, mc, g, t, lc, acc)   one staged block: acc[i][jj] += the block's part of
//                            (weight row g / g + 8 of tile i) x (activation row 2t / 2t + 1), jj as D.
//   kL2Hint                  whether the weights' copies carry the L2 cache policy (mma_weights_evict_first);
//                            false: plain cp.async.cg
//   kShuffleScaleDst         whether the scales' copies take their shared address through a shuffle
//                            (issue_weights: ptxas 13.0 lost the policy register of a predicated copy otherwise)
//   kFixedRows               whether launches of exactly 1 or 8 rows take the kernels built for that M
//                            (mm_mma_kernel's kFixedM)
//   kTailPieces              whether launches a little over one wave of the 8-row kernel cut their last
//                            groups into k-range pieces (MmaTail, mma_tail_plan)
//   kEpilogues               whether its kernels are also built with GDN's input side (kEpiGdnInput: the
//                            alpha | beta split group's CTAs beside the tiles and the conv after the qkv
//                            tiles' stores, Backend::gdn_input; the ternary format only).
#pragma once
#include <algorithm>
#include <array>
#include <cstdlib>

#include <cooperative_groups.h>

#include "ops/cuda/common.cuh"
#include "ops/cuda/gdn_conv.cuh"
#include "ops/cuda/kernels.h"
#include "ops/cuda/mma_tail_plan.h"
#include "ops/cuda/split_group.cuh"
#include "ops/cuda/xq_record.cuh"

namespace dflash::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kTilesPerCta = 4;    // 16-row tiles per CTA (64 weight rows)
constexpr int kCols = 8;           // activation rows per CTA (the n of the mma)
constexpr int kXqBytes = kXqRecordBytes;  // one (row, block) of quantized activations: kXqPlanes digit planes
constexpr int kXqMeta = 16;        // and its S = sum u, 2^(E-kXqShift), 0, 0

// ---- activation quantizer: one CTA of 128 threads per (row, block) ---------------------------------
// xq: [nblk][M] records of kXqPlanes digit planes, each in B-fragment order (lane-quad t's 8 words: word
// 2j + h holds bytes k = 32 j + 16 h + 4 t + e), then meta [nblk][M] = (S, float 2^(E-kXqShift), 0, 0).

__global__ void __launch_bounds__(128) quantize_xq_kernel(const float* __restrict__ x, int64_t K,
                                                           uint8_t* __restrict__ xq, int32_t* __restrict__ meta) {
  pdl_wait(gridDim.y == 1);
  __shared__ float smax[4];
  __shared__ int ssum[4];
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
  const int E = xq_exponent(amax);  // |x| / 2^E < 64
  int d[kXqPlanes];
  const int u = xq_digits(v, E, d);
  const int j = k >> 5, h = (k >> 4) & 1, t = (k >> 2) & 3, e = k & 3;
  const int64_t rec_index = xq_record_index(m, b, gridDim.y);
  uint8_t* rec = xq + rec_index * kXqBytes + t * 32 + (((2 * j + h) * 4) ^ xq_half_swizzle(m)) + e;
#pragma unroll
  for (int p = 0; p < kXqPlanes; ++p) rec[128 * p] = static_cast<uint8_t>(d[p]);
  const int s = __reduce_add_sync(0xffffffffu, u);  // sum u of the warp's 32
  if (lane == 0) ssum[warp] = s;
  __syncthreads();
  if (k == 0)
    *reinterpret_cast<int4*>(meta + rec_index * 4) =
        make_int4(ssum[0] + ssum[1] + ssum[2] + ssum[3], __float_as_int(xq_unit(E)), 0, 0);
}

// ---- the matmul ------------------------------------------------------------------------------------

// One weight of a launch. A launch covers up to kTernaryMaxGroup weights of one format that share the
// input (one grid: CTAs [cta_end of the previous part, cta_end) are this part's 64-row tiles).
struct MmaPart {
  const uint8_t* codes;
  const uint8_t* scales;
  float* y;
  int64_t N;    // rows (outputs)
  int tiles;    // 16-row tiles (Np / 16)
  int cta_end;  // one past this part's last CTA (blockIdx.x)
};
struct MmaArgs {
  MmaPart part[kTernaryMaxGroup];
  int nparts;
  const uint8_t* xq;    // quantized activations [nblk][M][kXqBytes]
  const int32_t* meta;  // [nblk][M][4]
  int64_t M;
  int row_tile0;  // blockIdx.y's first row tile (a tail launch covers at most kTailRowTiles per launch)
  MmaTail tail;
  int nblk, ks;
  int kb[9];  // the k split's block boundaries: CTA z takes blocks kb[z] .. kb[z + 1] (no division on the device)
  int stage_stride;  // bytes from one ring stage to the next: ring_stride<F>(mc)
  bool signal;       // let the next kernel's CTAs launch once every CTA is past its wait (mma_signals)
  bool weights_evict_first;  // the weights' copies ask L2 to evict them first (mma_weights_evict_first)
  // 0: the ks partial sums are added here (a cluster); else CTA z stores its partial sums as part z of
  // y, at y + z * part_stride (matmul_parts: the kernel that reads y adds the parts in split order).
  int64_t part_stride;
  // kEpiGdnInput launches (GDN's input projections, Backend::gdn_input: part 0 qkv -> the conv input, part 1
  // z; one row tile, no k split): CTAs from side_begin on run the split group `side` (alpha | beta of side_x,
  // BF16, split_group_cta) instead of tiles, and part 0's CTAs then run the causal conv of their 64 channels
  // (gdn_conv_channel, 4 taps) on the rows they have just stored.
  SplitGroup side;
  const float* side_x;
  int64_t side_K;
  bool side_xvec;
  int side_begin;
  const float* conv_w;    // [C][4]
  float* conv_state;      // [3][C]
  float* conv_before;     // null or [3][C]: the state before the rows (the undo checkpoint)
  float* conv_y;          // [M][C]
};

// What a launch does besides its tiles: nothing, or GDN's input side (above).
constexpr int kEpiNone = 0, kEpiGdnInput = 1;

// d = a . b + c on m16n8k32, A unsigned bytes (weight codes), B signed bytes (activation digits).
__device__ __forceinline__ void mma_u8s8(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1, const int (&c)[4]) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]));
}
// d = a . b on m16n8k16, both signed bytes: a0 (row g, k 4t..4t+3), a1 (row g + 8); b0 (k 4t.., col g).
__device__ __forceinline__ void mma_s8s8_k16(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%7,%7,%7};\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a0), "r"(a1), "r"(b0), "r"(0));
}

// Stage layout: codes [4 tiles][kCodeBytes] | scales [4 tiles][kScaleBytes] | xq [mc][kXqBytes] | meta [mc][4];
// the ring steps by ring_stride<F>(mc) (128-byte aligned, MmaArgs::stage_stride).
template <class F>
__host__ __device__ constexpr int stage_bytes(int mc) {
  return kTilesPerCta * (F::kCodeBytes + F::kScaleBytes) + mc * (kXqBytes + kXqMeta);
}
template <class F>
__device__ __forceinline__ const uint8_t* stage_acts(const uint8_t* stage) {
  return stage + kTilesPerCta * (F::kCodeBytes + F::kScaleBytes);
}

// Per-lane source pointers of block b_lo (advanced by F::kWarps blocks per issue): the lane's
// 16-byte pieces of the tiles' codes and of the CTA's scales.
template <class F>
struct BlockSrc {
  static constexpr int kScalePieces = kTilesPerCta * F::kScaleBytes / 16;  // per block, for the CTA
  static constexpr int kScaleIssues = (kScalePieces + 31) / 32;             // per lane
  const uint8_t* codes[kTilesPerCta];    // piece `lane` of each tile's block (then + 512 per round)
  const uint8_t* scales[kScaleIssues];   // piece lane + 32 q of the CTA's scales, null past the last
  const uint8_t* xq;                     // piece `lane` of the block's run of records (rows m0 ..)
  const int32_t* meta;                   // row m0 + lane's meta of the block
};

// The L2 policy of the weights' copies: evict_first when `first` (every weight byte is read once per
// step, so a line of it need not outlive its copy), else evict_normal (what an unhinted copy gets).
__device__ __forceinline__ uint64_t weights_l2_policy(bool first) {
  uint64_t p;
  if (first)
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
  else
    asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}
// cp_async16 (L2 only) with an L2 cache policy.
__device__ __forceinline__ void cp_async16_policy(void* smem, const void* gmem, uint64_t policy) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "l"(policy)
               : "memory");
}

// A weight piece: with the format's L2 policy, or a plain L2-only copy (F::kL2Hint false).
template <class F>
__device__ __forceinline__ void cp_async16_weights(void* smem, const void* gmem, uint64_t policy) {
  if constexpr (F::kL2Hint)
    cp_async16_policy(smem, gmem, policy);
  else
    cp_async16<false>(smem, gmem);
}
// One warp copies one block (codes and scales of the CTA's tiles, quantized activations of its mc
// rows) into a stage: 16-byte pieces, lane-strided.
template <class F>
__device__ __forceinline__ void issue_weights(const BlockSrc<F>& src, int64_t boff, int lane, uint8_t* stage,
                                              uint64_t policy) {
#pragma unroll
  for (int i = 0; i < kTilesPerCta; ++i)  // tiles past the last one re-read it (pointers clamped)
#pragma unroll
    for (int q = 0; q < F::kCodeBytes / 512; ++q)
      cp_async16_weights<F>(stage + i * F::kCodeBytes + q * 512 + lane * 16,
                            src.codes[i] + boff * F::kCodeBytes + q * 512, policy);
  // F::kShuffleScaleDst: the scales' shared address goes through a shuffle of the lane's own value (one SHFL
  // per block), a plain register. ptxas 13.0 gave a predicated, L2-hinted copy a shared address of the form
  // [R + UR] and read its policy from a uniform register nothing writes ("illegal instruction"; RESULTS
  // round 33, S33-9: a wide ternary build; the hinted Q6_K builds of rounds 27-29 failed the same way and
  // are clean with the shuffle, S33-11). The other formats' builds are clean without it and keep their code.
  if constexpr (F::kShuffleScaleDst) {
    uint8_t* const dst = reinterpret_cast<uint8_t*>(
        __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(stage + kTilesPerCta * F::kCodeBytes + lane * 16), lane));
#pragma unroll
    for (int q = 0; q < BlockSrc<F>::kScaleIssues; ++q)
      if (lane + 32 * q < BlockSrc<F>::kScalePieces)
        cp_async16_weights<F>(dst + 32 * q * 16, src.scales[q] + boff * F::kScaleBytes, policy);
  } else {
#pragma unroll
    for (int q = 0; q < BlockSrc<F>::kScaleIssues; ++q)
      if (lane + 32 * q < BlockSrc<F>::kScalePieces)
        cp_async16_weights<F>(stage + kTilesPerCta * F::kCodeBytes + (lane + 32 * q) * 16,
                              src.scales[q] + boff * F::kScaleBytes, policy);
  }
}
// The activations of one staged block: the mc rows' records are one contiguous run (block-major xq), so
// piece p = lane + 32 it (< mc * kXqBytes / 16 pieces of 16 B) lands at p * 16 in the stage's xq area from
// the same offset of the run; lanes < mc copy their row's meta. (Row-major records had cost a division by 24 and
// 64-bit row offsets per piece: ~70 of the ~470 instructions per block at 8 rows, S13-1.)
template <int R>
constexpr int kActIters = (R * (kXqBytes / 16) + 31) / 32;  // <= 4 (R = 8, 2 planes)

template <class F, int R>
__device__ __forceinline__ void issue_acts(const BlockSrc<F>& src, int64_t boff, uint32_t M, int mc, int lane,
                                           uint8_t* stage) {
  // One activation row: the records go through L1 (cp.async.ca), where the SM's other CTAs (5 per SM at one
  // row), which read the same blocks at about the same time, find them. H200, 27B PTQ1_0, alternating
  // (S17-3): decode 3.87-3.88 -> 3.78-3.80 ms. At 8 rows (3 CTAs per SM, 28 KB of L1 left beside the
  // rings) the same made verify slower (S17-2: 6.51-6.59 -> 6.55-6.73 ms), so wider launches keep L2 only.
  constexpr bool l1 = R == 1;
  uint8_t* xs = stage + kTilesPerCta * (F::kCodeBytes + F::kScaleBytes);
  const uint32_t bo = static_cast<uint32_t>(boff) * M;  // records from the first block's (< 2^32: M <= 65535)
  const uint8_t* xq = src.xq + static_cast<uint64_t>(bo) * kXqBytes;
#pragma unroll
  for (int it = 0; it < kActIters<R>; ++it)
    if (lane + 32 * it < mc * (kXqBytes / 16)) cp_async16<l1>(xs + (lane + 32 * it) * 16, xq + 512 * it);
  if (lane < mc) cp_async16<l1>(xs + mc * kXqBytes + lane * 16, src.meta + static_cast<uint64_t>(bo) * 4);
}

template <int R>
struct ColMap {
  static constexpr int kNt = (kXqPlanes * R + 7) / 8;
};

// Per-lane constants of the column map for one CTA (mc activation rows).
template <int R>
struct LaneCols {
  static constexpr int NT = ColMap<R>::kNt;
  // Columns without a (row < mc, plane < kXqPlanes) of their own, and rows 2t + h >= mc, read the last
  // staged row's data instead of zeros: a column of D depends on its own column of B alone, and those
  // columns and rows are never stored, so the loads need no branch and no zeroed registers (at 8 rows
  // the zeroing and predication had cost ~25 of the ~460 instructions per block, S18-2).
  int b_off[NT];      // B: byte offset of (row, plane) of column 8 nt + g in an xq stage (words 0-3 of the
                      // lane's chunk; words 4-7 at b_off ^ 16)
  int row_meta[2];    // owned rows 2t, 2t + 1: int index of their (S, 2^(E-kXqShift)) in the meta
  __device__ __forceinline__ LaneCols(int mc, int g, int t) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int cb = 8 * nt + g, pb = min(cb / R, kXqPlanes - 1), mb = min(cb % R, mc - 1);
      b_off[nt] = mb * kXqBytes + pb * 128 + t * 32 + xq_half_swizzle(mb);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) row_meta[h] = min(2 * t + h, mc - 1) * 4;
  }
};

// The B fragments of a staged block (bq[nt][w]: word w = 2j + h of the lane's column; a copy of the last
// row's for columns no row fills), and the 2^(E-kXqShift) (sx) and digit sum S (su) of the lane's owned
// rows.
template <int R>
__device__ __forceinline__ void load_acts(const uint8_t* xs, const int32_t* meta, const LaneCols<R>& lc,
                                          uint32_t (&bq)[ColMap<R>::kNt][8], float (&sx)[2], int (&su)[2]) {
#pragma unroll
  for (int nt = 0; nt < ColMap<R>::kNt; ++nt) {
    const uint4 lo = *reinterpret_cast<const uint4*>(xs + lc.b_off[nt]);
    const uint4 hi = *reinterpret_cast<const uint4*>(xs + (lc.b_off[nt] ^ 16));
    bq[nt][0] = lo.x, bq[nt][1] = lo.y, bq[nt][2] = lo.z, bq[nt][3] = lo.w;
    bq[nt][4] = hi.x, bq[nt][5] = hi.y, bq[nt][6] = hi.z, bq[nt][7] = hi.w;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int2 m = *reinterpret_cast<const int2*>(meta + lc.row_meta[h]);
    su[h] = m.x;
    sx[h] = __int_as_float(m.y);
  }
}

// The plane sums P[p] of accumulator register jj of the lane's owned column (valid on lanes with
// 2t < R; every lane takes part in the shuffles). Plane p of the lane's row is column R p + 2t (+ 1 for
// the odd registers): n-tile R p / 8, held by lane t + (R p % 8) / 2 of the quad; at R = 1 column p,
// register jj + p % 2 of lane t + p / 2.
template <int R>
__device__ __forceinline__ void gather_planes(const int (&d)[ColMap<R>::kNt][4], int jj, int (&P)[kXqPlanes]) {
#pragma unroll
  for (int p = 0; p < kXqPlanes; ++p) {
    const int nt = R * p / 8, from = (R * p % 8) / 2, reg = R == 1 ? jj + (p & 1) : jj;
    P[p] = from == 0 ? d[nt][reg] : __shfl_down_sync(0xffffffffu, d[nt][reg], from);
  }
}
// The exact integer u-sum of the planes (sum_p P[p] 256^(kXqPlanes-1-p), modulo 2^32), minus `offset`.
__device__ __forceinline__ int planes_int(const int (&P)[kXqPlanes], int offset) {
  uint32_t v = static_cast<uint32_t>(P[0]);
#pragma unroll
  for (int p = 1; p < kXqPlanes; ++p) v = v * 256u + static_cast<uint32_t>(P[p]);
  return static_cast<int>(v - static_cast<uint32_t>(offset));
}
// The same in fp32 where the integer may not fit (the K-quant sums): 256^k P[p] is exact, one rounding
// per plane after the first, in a fixed order.
__device__ __forceinline__ float planes_value(const int (&P)[kXqPlanes]) {
  float v = static_cast<float>(P[kXqPlanes - 1]);
#pragma unroll
  for (int p = kXqPlanes - 2; p >= 0; --p)
    v = __fmaf_rn(kXqPlanes - 1 - p == 1 ? 256.0f : 65536.0f, static_cast<float>(P[p]), v);
  return v;
}

// Whether accumulator register jj (rows g / g + 8 x columns 2t, 2t + 1) holds an owned (weight row,
// activation row) pair's sum: at R = 1 only the even registers (activation row 0; the odd ones are
// plane 1, folded into the even ones by gather_planes).
template <int R>
__device__ __forceinline__ constexpr bool row_col_used(int jj) {
  return R != 1 || (jj & 1) == 0;
}

// kFixedM: the launch has exactly R activation rows (R = 1: every one-row launch; R = 8: the verify and
// draft blocks), so M, mc and the row offsets are compile-time constants (fewer instructions per block).
template <class F, int kStages, int R, int kEpi = kEpiNone, bool kFixedM = false>
__global__ void __launch_bounds__(F::kWarps * 32, F::kMinBlocks) mm_mma_kernel(const MmaArgs a) {
  // The ring stages are 128-byte aligned from the start of dynamic shared memory (stage_stride_for). A
  // static __shared__ variable here would come first and shift the ring off that alignment (S15-7: a build
  // with one 4-byte flag here was slower in every matmul, decode 4.12 -> 4.87 ms, most likely for that
  // reason); the declared alignment keeps the base aligned whatever is added.
  extern __shared__ __align__(128) uint8_t smem[];
  if constexpr (kEpi == kEpiGdnInput) {
    if (static_cast<int>(blockIdx.x) >= a.side_begin) {  // alpha | beta: the split kernel's CTA, 8 warps' work
      split_group_cta<kBF16, R, true>(a.side, a.side_K, a.side_x, a.side_xvec,
                                      static_cast<int>(blockIdx.x) - a.side_begin, 0, static_cast<int>(a.M));
      return;
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  // This CTA's 64-row group (blockIdx.x, or for a tail piece its group: MmaTail) and k range.
  int group = static_cast<int>(blockIdx.x), piece = -1;
  int b_lo = a.kb[blockIdx.z], b_hi = a.kb[blockIdx.z + 1];
  if constexpr (kEpi == kEpiNone && F::kTailPieces) {
    if (group >= a.tail.begin) {
      const int p = group - a.tail.begin;
      group = a.tail.begin + p / a.tail.pieces;
      piece = p % a.tail.pieces;
      b_lo = a.tail.kb[piece], b_hi = a.tail.kb[piece + 1];
    }
  }
  // This CTA's weight (part) and its first tile in that weight.
  int cta_begin;
  const MmaPart pt = group_part(a.part, a.nparts, group, cta_begin);
  const int tiles = pt.tiles;
  const int tile0 = (group - cta_begin) * kTilesPerCta;
  const int nt_rows = min(kTilesPerCta, tiles - tile0) * 16;  // weight rows of this CTA (<= 64)
  const int ntile = nt_rows / 16;
  static_assert(!kFixedM || R == 1 || R == kCols, "a fixed M is one row or one full row tile");
  const int64_t M = kFixedM ? R : a.M;
  const int64_t m0 = kFixedM ? 0 : static_cast<int64_t>(blockIdx.y + a.row_tile0) * kCols;
  const int mc = kFixedM ? R : a.M - m0 < kCols ? static_cast<int>(a.M - m0) : kCols;
  const int z = blockIdx.z;
  const int sb = a.stage_stride;
  uint8_t* ring = smem + warp * kStages * sb;
  const LaneCols<R> lc(mc, g, t);

  float acc[kTilesPerCta][4];
#pragma unroll
  for (int i = 0; i < kTilesPerCta; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

  // This warp's blocks: first + F::kWarps * j, j < nj.
  const int first = b_lo + warp;
  const int nj = first < b_hi ? (b_hi - first + F::kWarps - 1) / F::kWarps : 0;
  BlockSrc<F> src;
#pragma unroll
  for (int i = 0; i < kTilesPerCta; ++i)
    src.codes[i] = pt.codes + (static_cast<int64_t>(tile0 + min(i, ntile - 1)) * a.nblk + first) * F::kCodeBytes + lane * 16;
#pragma unroll
  for (int q = 0; q < BlockSrc<F>::kScaleIssues; ++q) {
    constexpr int kPer = F::kScaleBytes / 16;  // pieces per tile
    const int p = lane + 32 * q, i = min(p / kPer, ntile - 1);
    src.scales[q] = pt.scales + (static_cast<int64_t>(tile0 + i) * a.nblk + first) * F::kScaleBytes + (p % kPer) * 16;
  }
  src.xq = a.xq + (static_cast<int64_t>(first) * M + m0) * kXqBytes + lane * 16;
  src.meta = a.meta + (static_cast<int64_t>(first) * M + m0 + lane) * 4;
  // The first stages' weights do not depend on earlier kernels: their loads start before pdl_wait(),
  // while the previous kernel drains (they land in the first commit group).
  const uint64_t wpol = F::kL2Hint ? weights_l2_policy(a.weights_evict_first) : 0;
#pragma unroll
  for (int q = 0; q < kStages - 1; ++q)
    if (q < nj) issue_weights<F>(src, static_cast<int64_t>(q) * F::kWarps, lane, ring + q * sb, wpol);
  if constexpr (kEpi == kEpiGdnInput) {
    // The conv's inputs for this CTA's channels, read in its epilogue: the state (written a whole step
    // ago) and the weights, asked of L2 now (a hint; the values are read after the wait).
    const int64_t c0 = static_cast<int64_t>(tile0) * 16;
    if (static_cast<int>(blockIdx.x) < a.part[0].cta_end && threadIdx.x < 14) {
      const int k = threadIdx.x;
      if (k < 6 && c0 + 32 * (k & 1) < pt.N) prefetch_l2(a.conv_state + (k >> 1) * pt.N + c0 + 32 * (k & 1));
      if (k >= 6 && c0 + 8 * (k - 6) < pt.N) prefetch_l2(a.conv_w + (c0 + 8 * (k - 6)) * 4);
    }
  }
  pdl_wait(a.signal);
#pragma unroll
  for (int q = 0; q < kStages - 1; ++q) {
    if (q < nj) issue_acts<F, R>(src, static_cast<int64_t>(q) * F::kWarps, static_cast<uint32_t>(M), mc, lane, ring + q * sb);
    cp_async_commit();
  }
  // Stage offsets of block j (cur) and of block j + kStages - 1 (nxt), stepped round the ring (no
  // division by kStages per block).
  const int ring_bytes = kStages * sb;
  int cur = 0, nxt = (kStages - 1) * sb;
  for (int j = 0; j < nj; ++j) {
    cp_async_wait<kStages - 2>();
    __syncwarp();
    F::template block_compute<R>(ring + cur, mc, g, t, lc, acc);
    __syncwarp();  // every lane is done with the stage that the next issue overwrites
    const int jn = j + kStages - 1;
    if (jn < nj) {
      issue_weights<F>(src, static_cast<int64_t>(jn) * F::kWarps, lane, ring + nxt, wpol);
      issue_acts<F, R>(src, static_cast<int64_t>(jn) * F::kWarps, static_cast<uint32_t>(M), mc, lane, ring + nxt);
    }
    cp_async_commit();
    cur = cur + sb == ring_bytes ? 0 : cur + sb;
    nxt = nxt + sb == ring_bytes ? 0 : nxt + sb;
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
        if (row_col_used<R>(jj)) red[(warp * R + 2 * t + (jj & 1)) * 64 + 16 * i + g + (jj >= 2 ? 8 : 0)] = acc[i][jj];
  __syncthreads();
  // Output (row, m): the warps' sums in warp order.
  constexpr int kOutPerThread = (64 * kCols + F::kWarps * 32 - 1) / (F::kWarps * 32);
  float out[kOutPerThread];
#pragma unroll
  for (int k = 0; k < kOutPerThread; ++k) {
    const int o = threadIdx.x + k * F::kWarps * 32, row = o & 63, m = o >> 6;
    out[k] = 0.0f;
    if (m < mc && row < nt_rows) {
      float s = red[m * 64 + row];
#pragma unroll
      for (int w = 1; w < F::kWarps; ++w) s += red[(w * R + m) * 64 + row];
      out[k] = s;
    }
  }

  if (a.ks > 1 && a.part_stride == 0) {
    // k split over the ks CTAs of a cluster (1, 1, ks): each publishes its sums in its shared memory,
    // CTA 0 adds the ks parts in split order (distributed shared memory) and stores y; the others
    // wait at a second barrier until it has read them.
    cg::cluster_group cluster = cg::this_cluster();
    float* fin = reinterpret_cast<float*>(smem) + F::kWarps * R * 64;  // [kOutPerThread][F::kWarps * 32 threads]
#pragma unroll
    for (int k = 0; k < kOutPerThread; ++k) fin[k * F::kWarps * 32 + threadIdx.x] = out[k];
    cluster.sync();
    const bool lead = cluster.block_rank() == 0;
    if (lead)
#pragma unroll
      for (int k = 0; k < kOutPerThread; ++k) {
        float s = out[k];
        for (int zz = 1; zz < a.ks; ++zz) s += cluster.map_shared_rank(fin, zz)[k * F::kWarps * 32 + threadIdx.x];
        out[k] = s;
      }
    cluster.sync();
    if (!lead) return;
  }
  if constexpr (kEpi == kEpiNone && F::kTailPieces) {
    if (piece >= 0) {
      // A tail piece (MmaTail): its sums go to global memory; the group's last piece to arrive adds the
      // pieces in piece order (the same order whichever arrives last) and stores y.
      const int slot = static_cast<int>(blockIdx.y) * a.tail.groups + (group - a.tail.begin);
      float* const parts = a.tail.partials + static_cast<int64_t>(slot) * a.tail.pieces * (64 * kCols);
#pragma unroll
      for (int k = 0; k < kOutPerThread; ++k) {
        const int o = threadIdx.x + k * F::kWarps * 32;
        if (o < 64 * kCols) parts[piece * (64 * kCols) + o] = out[k];
      }
      __threadfence();  // this CTA's sums are visible device-wide before its arrival is counted
      __syncthreads();
      int* const last = reinterpret_cast<int*>(smem) + F::kWarps * R * 64;  // past the warp sums in `red`
      if (threadIdx.x == 0) {
        const unsigned before = atomicAdd(a.tail.arrivals + slot, 1u);
        const bool is_last = before + 1 == static_cast<unsigned>(a.tail.pieces);
        if (is_last) a.tail.arrivals[slot] = 0;  // ready for the next launch (it runs after this grid)
        *last = is_last;
      }
      __syncthreads();
      if (!*last) return;
      __threadfence();
#pragma unroll
      for (int k = 0; k < kOutPerThread; ++k) {
        const int o = threadIdx.x + k * F::kWarps * 32;
        if (o < 64 * kCols) {
          float s = __ldcg(parts + o);
          for (int q = 1; q < a.tail.pieces; ++q) s += __ldcg(parts + q * (64 * kCols) + o);
          out[k] = s;
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kOutPerThread; ++k) {
    const int o = threadIdx.x + k * F::kWarps * 32, row = o & 63, m = o >> 6;
    const int64_t grow = static_cast<int64_t>(tile0) * 16 + row;
    if (m < mc && row < nt_rows && grow < pt.N) pt.y[z * a.part_stride + (m0 + m) * pt.N + grow] = out[k];
  }
  if constexpr (kEpi == kEpiGdnInput) {
    // The conv of this CTA's channels (qkv rows) over the rows just stored: one thread per channel, the
    // conv kernel's own device function (the same bits). The barrier makes the stores visible here.
    if (static_cast<int>(blockIdx.x) < a.part[0].cta_end) {
      __syncthreads();
      if (threadIdx.x < 64)
        gdn_conv_channel<4>(static_cast<int64_t>(tile0) * 16 + threadIdx.x, pt.y, a.conv_state, a.conv_before,
                            a.conv_w, a.conv_y, M, pt.N, 4);
    }
  }
}

// ---- host side ----------------------------------------------------------------------------------------

// CTAs (64-row tiles) of an out-row weight.
inline int64_t mma_ctas(int64_t out) { return (padded_rows(out) / 16 + kTilesPerCta - 1) / kTilesPerCta; }

// CTAs per SM that the k split aims at (one wave): DFLASH_CUDA_TERNARY_WAVE when set (1..8), else the
// format's. A device setting, like the SM count: it never depends on M. Measured on the H200 for the
// ternary format (27B decode step, commit after 1744dbf): 4 -> 7.52 ms, 3 -> 6.95 ms, 2 -> 7.09 ms
// (fewer, longer-lived warps amortise each warp's fixed prologue and epilogue; 2 leaves SMs short of
// bytes in flight). Measured again in round 25 on the later kernels: 2 is now faster for the ternary
// format (TernaryFmt::kWave).
inline int mma_ctas_per_sm(int format_default) {
  static const int v = [] {
    const int n = env_int("DFLASH_CUDA_TERNARY_WAVE", 0);
    return n >= 1 && n <= 8 ? n : 0;
  }();
  return v ? v : format_default;
}

// A k-split launch is sized for F::kWave CTAs per SM (mma_splits_for). When more of its CTAs would fit
// on an SM, the block scheduler packs some SMs beyond kWave and leaves others short; the launch then lasts
// as long as its busiest SMs. Since the activation records went to 2 planes (round 29) the 8-row ternary
// ring is 52 KB, so 4 CTAs fit instead of 3, and the verify step's k-split launches (ffn_down, ssm_out,
// attention out: 80 x 3 CTAs) went 8.1 -> 8.8 us. Padding the launch's dynamic shared memory so that at
// most kWave CTAs fit restores the spread (S29-3 with a fixed pad: verify 5.03-5.05 -> 4.77-4.78 ms).
// Scheduling only: the bits are the same. DFLASH_CUDA_MM_SPLIT_CAP: 1 (default) every k-split launch,
// 2 only launches of more than one activation row, 0 none (for comparison).
inline int mma_split_cap_mode() {
  static const int v = env_int("DFLASH_CUDA_MM_SPLIT_CAP", 1);
  return v;
}
// Dynamic shared memory for a launch whose ring is `bytes` and of which at most `per_sm` CTAs may share an
// SM (the k split's mma_ctas_per_sm).
inline int mma_capped_smem(int bytes, int per_sm) {
  static const auto attrs = [] {
    int dev = 0, sm = 0, reserved = 0, optin = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev);
    cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev);
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    return std::array<int, 3>{sm, reserved, optin};
  }();
  // per_sm + 1 CTAs of (want + reserved) bytes must not fit in the SM's shared memory
  const int want = attrs[0] / (per_sm + 1) - attrs[1] + 128;
  return std::min(std::max(bytes, want), std::max(bytes, attrs[2]));
}
// DFLASH_CUDA_WIDE_STAGES_ALT=1: the format's alternative ring depth for 5-8 activation rows
// (kStagesWideAlt; scheduling only, the bits are the same), for comparison.
inline bool mma_wide_alt() {
  static const bool v = env_flag("DFLASH_CUDA_WIDE_STAGES_ALT", false);
  return v;
}

// Whether a launch of M activation rows signals launch_dependents (common.cuh): at up to kCols rows, one
// row tile. Round 6 had measured signalling at 8 rows slower (verify 10.39 -> 10.61 ms) and only one row
// signalled since; after the aligned ring stages and swizzled records the 8-row kernels leave room for the
// next kernel's early CTAs: verify 6.67-6.74 -> 6.47-6.56 ms, the draft step 1.103-1.109 -> 1.059-1.062 ms,
// decode unchanged (S15-2, alternating on one H200). DFLASH_CUDA_MM_SIGNAL_ROWS=1 restores the old rule.
// Scheduling only: the bits are the same.
inline bool mma_signals(int64_t M) {
  static const int rows = env_int("DFLASH_CUDA_MM_SIGNAL_ROWS", kCols);
  return M <= rows;
}

// The weights stream through L2 once per step (~6 GB against its 60 MB at 27B), so with the default
// policy they evict everything else there between two uses: the activations, the residual and the
// norm weights the small kernels read, and the kernels' code and parameters (ncu of the decode
// attention and GDN kernels: instruction-fetch and constant-cache misses among their top stalls).
// Copied as evict_first, they replace one another instead. DFLASH_CUDA_MM_EVICT_FIRST=0 for comparison.
inline bool mma_weights_evict_first() {
  static const bool v = env_flag("DFLASH_CUDA_MM_EVICT_FIRST", true);
  return v;
}

// Ring depth at one activation row: F::kStagesOneRow, or F::kStagesNarrow with
// DFLASH_CUDA_MM_ONE_ROW_RING=0 (for comparison).
inline bool mma_one_row_ring() {
  static const bool v = env_flag("DFLASH_CUDA_MM_ONE_ROW_RING", true);
  return v;
}

// DFLASH_CUDA_MM_ONE_ROW_MAP=0: one activation row takes R = 2's column map (two rows' columns, one
// empty) instead of R = 1's, for comparison; the bits are the same.
inline bool mma_one_row_map() {
  static const bool v = env_flag("DFLASH_CUDA_MM_ONE_ROW_MAP", true);
  return v;
}

// The kernels with M fixed at 1 or 8 rows (mm_mma_kernel's kFixedM) for launches of exactly that many;
// DFLASH_CUDA_MM_FIXED_M=0 takes the general ones, for comparison. Scheduling only: the bits are the same.
// H200, 27B PTQ1_0 pair, alternating (round 27, S27-7): decode 3.46 / 3.46 vs 3.50 / 3.50 ms, verify 5.29 /
// 5.32 vs 5.50 / 5.47, draft 0.924 / 0.931 vs 0.934 / 0.938; the 8-row lm_head alone 123.9 vs 130.5 us.
inline bool mma_fixed_m() {
  static const bool v = env_flag("DFLASH_CUDA_MM_FIXED_M", true);
  return v;
}

// Ring stages start on 128-byte boundaries: a stage of 7 or 1 activation rows (4976 / 2576 bytes for
// PTQ1_0) otherwise starts mid-line, and every 512-byte cp.async of its weight codes costs ~10 shared
// wavefronts instead of 4 (ncu, ffn_up alone at 7 rows: 50 % of the shared wavefronts excessive, 25.95
// vs 22.91 us at 8 rows, whose 5376-byte stages are aligned; the 8-row kernel's own 25 % were the B
// loads' bank conflicts, see xq_half_swizzle). The 27B decode step went 4.56-4.62 -> 4.11-4.12 ms
// (RESULTS round 14). DFLASH_CUDA_MM_STAGE_ALIGN=0 keeps the unpadded stride, for comparison.
// Scheduling only: the bits are the same.
inline int stage_stride_for(int bytes) {
  static const bool align = env_flag("DFLASH_CUDA_MM_STAGE_ALIGN", true);
  return align ? (bytes + 127) / 128 * 128 : bytes;
}
// The ring stride of format F with mc activation rows staged.
template <class F>
inline int ring_stride(int mc) {
  return stage_stride_for(stage_bytes<F>(mc));
}

inline int mma_splits_for(int64_t ctas, int64_t in, int num_sms, int ctas_per_sm, int warps) {
  const int64_t nblk = in / 128;
  // As many CTAs as fit in one wave: a GEMV needs warps for bytes in flight, and a second wave would
  // double the time.
  const int64_t want = ctas_per_sm * static_cast<int64_t>(std::max(num_sms, 1)) / std::max<int64_t>(ctas, 1);
  const int64_t most = std::max<int64_t>(1, nblk / (2 * warps));  // >= 2 blocks per warp
  // <= 8: the split CTAs form one cluster (8 is the portable cluster size)
  return static_cast<int>(std::clamp<int64_t>(want, 1, std::min<int64_t>(most, 8)));
}

constexpr int64_t kMaxRowsPerLaunch = 65535;  // grid.y of the activation quantizer

inline size_t mma_xq_bytes(int64_t in, int64_t M) {
  const int64_t rows = std::min(M, kMaxRowsPerLaunch);
  return static_cast<size_t>(std::max<int64_t>(rows, 0)) * (in / 128) * (kXqBytes + kXqMeta);
}

// R (rows per plane group) of a launch whose widest tile stages mc rows (launch_mma_kernel's choice).
inline int mma_rows_of(int mc) { return mc == 1 && mma_one_row_map() ? 1 : mc <= 2 ? 2 : mc <= 4 ? 4 : 8; }

// Once per format and epilogue, before the first launch or occupancy query: every kernel variant may take
// rings above the 48 KB default (and mma_capped_smem's padding), with the largest shared-memory carveout.
template <class F, int kEpi>
void mma_kernel_attributes() {
  constexpr int S1 = F::kStagesOneRow, SN = F::kStagesNarrow, SW = F::kStagesWide, SW2 = F::kStagesWideAlt;
  static bool attr_set = false;
  if (!attr_set) {
    const auto setup = [](auto kernel, int bytes) {  // room for mma_capped_smem's padding too
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, mma_capped_smem(bytes, 1));
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
    };
    setup(mm_mma_kernel<F, S1, 1, kEpi>, F::kWarps * S1 * ring_stride<F>(1));
    if constexpr (S1 != SN) setup(mm_mma_kernel<F, SN, 1, kEpi>, F::kWarps * SN * ring_stride<F>(1));
    setup(mm_mma_kernel<F, SN, 2, kEpi>, F::kWarps * SN * ring_stride<F>(2));
    setup(mm_mma_kernel<F, SN, 4, kEpi>, F::kWarps * SN * ring_stride<F>(4));
    setup(mm_mma_kernel<F, SW, 8, kEpi>, F::kWarps * SW * ring_stride<F>(kCols));
    if constexpr (SW2 != SW) setup(mm_mma_kernel<F, SW2, 8, kEpi>, F::kWarps * SW2 * ring_stride<F>(kCols));
    if constexpr (F::kFixedRows) {
      setup(mm_mma_kernel<F, S1, 1, kEpi, true>, F::kWarps * S1 * ring_stride<F>(1));
      setup(mm_mma_kernel<F, SW, 8, kEpi, true>, F::kWarps * SW * ring_stride<F>(kCols));
    }
    attr_set = true;
  }
}

// The kernel for a launch of mc staged rows: R (rows per plane group) and the ring depth are scheduling
// and column placement only, the arithmetic of a row is the same.
template <class F, int kEpi>
void launch_mma_kernel(const MmaArgs& a, int mc, dim3 grid, dim3 cluster, cudaStream_t s) {
  constexpr int S1 = F::kStagesOneRow, SN = F::kStagesNarrow, SW = F::kStagesWide, SW2 = F::kStagesWideAlt;
  const dim3 block(F::kWarps * 32);
  mma_kernel_attributes<F, kEpi>();
  const int sb = a.stage_stride, r = mma_rows_of(mc);
  const int cap = mma_split_cap_mode();
  const bool capped = a.ks > 1 && (cap == 1 || (cap == 2 && mc > 1));
  const int per_sm = mma_ctas_per_sm(F::kWave);
  const auto go = [&](auto kernel, int stages) {
    const int bytes = F::kWarps * stages * sb;
    (void)launch_ex(kernel, grid, block, capped ? mma_capped_smem(bytes, per_sm) : bytes, s, cluster, pdl_enabled(), a);
  };
  // Exactly r rows (r = 1 or 8): the kernels built for that M, where the format has them.
  const bool fixed = F::kFixedRows && mma_fixed_m() && a.M == r;
  if (r == 1 && (S1 == SN || mma_one_row_ring())) {
    if constexpr (F::kFixedRows)
      if (fixed) return go(mm_mma_kernel<F, S1, 1, kEpi, true>, S1);
    go(mm_mma_kernel<F, S1, 1, kEpi>, S1);
  } else if (r == 1) {
    go(mm_mma_kernel<F, SN, 1, kEpi>, SN);
  } else if (r == 2) {
    go(mm_mma_kernel<F, SN, 2, kEpi>, SN);
  } else if (r == 4) {
    go(mm_mma_kernel<F, SN, 4, kEpi>, SN);
  } else if (SW2 != SW && mma_wide_alt()) {
    go(mm_mma_kernel<F, SW2, 8, kEpi>, SW2);
  } else {
    if constexpr (F::kFixedRows)
      if (fixed) return go(mm_mma_kernel<F, SW, 8, kEpi, true>, SW);
    go(mm_mma_kernel<F, SW, 8, kEpi>, SW);
  }
}

// CTAs that one wave of format F's kernel for R = 8 (or 1) activation rows holds (CTAs per SM by its
// registers and ring x SMs): MmaTail's S. A property of the kernels and the GPU, the same for every M.
template <class F, int R>
int mma_wave_slots(int num_sms) {
  static_assert(R == 1 || R == kCols, "the 1-row or the 8-row kernel");
  static const int per_sm = [] {
    mma_kernel_attributes<F, kEpiNone>();
    constexpr int stages = R == 1 ? F::kStagesOneRow : F::kStagesWide;
    // the kernel a launch of exactly R rows takes (launch_mma_kernel)
    const auto kernel = mm_mma_kernel<F, stages, R, kEpiNone, F::kFixedRows>;
    int n = 0;
    const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &n, kernel, F::kWarps * 32, F::kWarps * stages * ring_stride<F>(R));
    return err == cudaSuccess ? n : 0;
  }();
  return per_sm * num_sms;
}

// DFLASH_CUDA_MM_TAIL=0: no tail pieces (every group one CTA), for comparison; the tail groups' bits change.
inline bool mma_tail_enabled() {
  static const bool v = env_flag("DFLASH_CUDA_MM_TAIL", true);
  return v;
}

// GDN's input side in the projections' launch (launch_mma_group's gdn): the split group of BF16 alpha |
// beta weights and the conv (4 taps) of part 0's output.
struct GdnInputSide {
  const DevWeight* const* ws;  // alpha | beta ...: kBlocks BF16, one `in`, split-sized (use_split)
  float* const* ys;
  int n;
  const float* x;  // their input [M][ws[0]->in]
  const float* conv_w;
  float* conv_state;
  float* conv_before;
  float* conv_y;
};

// One launch of up to kTernaryMaxGroup weights of format F sharing the input x (M rows). Returns the
// parts written to each y: 1 (y = x . W^T), or, when the k split is 2 .. max_parts, ks partial products
// [ks][M][out] whose sum in part order has the bits of y (matmul_parts).
// gdn (two parts, qkv then z; F::kEpilogues): the launch runs GDN's input side too (kEpiGdnInput; the
// caller checked the rest of its rules: gdn_input_fusable); returns 0, launching nothing, when the
// projections' k split is not 1.
template <class F>
int launch_mma_group(const DevWeight* const* ws, float* const* ys, int n, const float* x, int64_t M,
                     const TernaryBuffers& buf, int num_sms, cudaStream_t s, int max_parts = 1,
                     const GdnInputSide* gdn = nullptr) {
  if (n <= 0 || n > kTernaryMaxGroup || M <= 0) return 1;
  MmaArgs a{};
  a.nparts = n;
  const int64_t in = ws[0]->in;
  a.nblk = static_cast<int>(in / 128);
  int64_t gx = 0;
  for (int k = 0; k < n; ++k) {
    MmaPart& p = a.part[k];
    p.codes = ws[k]->data;
    p.scales = reinterpret_cast<const uint8_t*>(ws[k]->scales);
    p.N = ws[k]->out;
    p.tiles = static_cast<int>(padded_rows(ws[k]->out) / 16);
    gx += mma_ctas(ws[k]->out);
    p.cta_end = static_cast<int>(gx);
  }
  a.ks = mma_splits_for(gx, in, num_sms, mma_ctas_per_sm(F::kWave), F::kWarps);
  for (int z = 0; z <= a.ks; ++z) a.kb[z] = static_cast<int>(static_cast<int64_t>(a.nblk) * z / a.ks);
  const bool parts = n == 1 && a.ks > 1 && a.ks <= max_parts;
  if (gdn && a.ks != 1) return 0;
  if constexpr (F::kTailPieces) {
    if (!gdn && a.ks == 1 && buf.tail && mma_tail_enabled()) {
      a.tail = mma_tail_plan(static_cast<int>(gx), a.nblk, mma_wave_slots<F, kCols>(num_sms),
                             mma_wave_slots<F, 1>(num_sms), F::kWarps);
      if (a.tail.groups > 0) {
        a.tail.arrivals = static_cast<unsigned*>(buf.tail);
        a.tail.partials = reinterpret_cast<float*>(static_cast<uint8_t*>(buf.tail) + kTailArrivalBytes);
        note_tail_launch();
      }
    }
  }
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRowsPerLaunch) {
    a.M = std::min(kMaxRowsPerLaunch, M - m0);
    for (int k = 0; k < n; ++k) a.part[k].y = ys[k] + m0 * ws[k]->out;
    a.part_stride = parts ? M * ws[0]->out : 0;  // matmul_parts: one weight
    auto* xq = static_cast<uint8_t*>(buf.xq);
    auto* meta = reinterpret_cast<int32_t*>(xq + static_cast<size_t>(a.M) * a.nblk * kXqBytes);
    if (!buf.xq_ready || m0 > 0)
      launch_pdl(quantize_xq_kernel, dim3(static_cast<unsigned>(a.nblk), static_cast<unsigned>(a.M)), 128, 0, s,
                 x + m0 * in, in, xq, meta);
    a.xq = xq;
    a.meta = meta;
    const int64_t gy = (a.M + kCols - 1) / kCols;
    const int mc = static_cast<int>(std::min<int64_t>(a.M, kCols));  // rows staged: the largest tile's
    a.stage_stride = ring_stride<F>(mc);
    a.signal = mma_signals(a.M);
    a.weights_evict_first = mma_weights_evict_first();
    const dim3 cluster(1, 1, parts ? 1 : static_cast<unsigned>(a.ks));
    if constexpr (F::kEpilogues) {
      if (gdn) {
        unsigned side = 0;  // the split group's CTAs at the kernel's R (its outputs per CTA depend on R)
        switch (mma_rows_of(mc)) {
          case 1: a.side = split_group_of<kBF16, 1>(gdn->ws, gdn->ys, gdn->n, side); break;
          case 2: a.side = split_group_of<kBF16, 2>(gdn->ws, gdn->ys, gdn->n, side); break;
          case 4: a.side = split_group_of<kBF16, 4>(gdn->ws, gdn->ys, gdn->n, side); break;
          default: a.side = split_group_of<kBF16, 8>(gdn->ws, gdn->ys, gdn->n, side); break;
        }
        a.side_x = gdn->x;
        a.side_K = gdn->ws[0]->in;
        a.side_xvec = reinterpret_cast<uintptr_t>(gdn->x) % 16 == 0 && gdn->ws[0]->in % 4 == 0;
        a.side_begin = static_cast<int>(gx);
        a.conv_w = gdn->conv_w, a.conv_state = gdn->conv_state, a.conv_before = gdn->conv_before;
        a.conv_y = gdn->conv_y;
        const dim3 grid(static_cast<unsigned>(gx) + side, static_cast<unsigned>(gy), 1);
        launch_mma_kernel<F, kEpiGdnInput>(a, mc, grid, cluster, s);
        continue;
      }
    }
    if (a.tail.groups > 0) {
      // whole groups, then the tail's pieces; at most kTailRowTiles row tiles per launch (its scratch)
      const unsigned gxt = static_cast<unsigned>(a.tail.begin + a.tail.groups * a.tail.pieces);
      for (int64_t r0 = 0; r0 < gy; r0 += kTailRowTiles) {
        a.row_tile0 = static_cast<int>(r0);
        const dim3 grid(gxt, static_cast<unsigned>(std::min<int64_t>(kTailRowTiles, gy - r0)), 1);
        launch_mma_kernel<F, kEpiNone>(a, mc, grid, cluster, s);
      }
      a.row_tile0 = 0;
      continue;
    }
    const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy), static_cast<unsigned>(a.ks));
    launch_mma_kernel<F, kEpiNone>(a, mc, grid, cluster, s);
  }
  return parts ? a.ks : 1;
}

}  // namespace
}  // namespace dflash::cuda
