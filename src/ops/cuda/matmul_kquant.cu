// Q4_K and Q6_K matmul on integer tensor cores (the 27B drafter's file is Q4_K_M: Q4_K, and Q6_K for
// attn_v / ffn_down of some layers), transcoded at load time into mma fragment order; the pipeline
// (activation quantizer, staging ring, k split, reduction) is mma_gemv.cuh's.
//
// Why. The block-format GEMV (matmul.cu, mm_blocks) dequantizes every weight to fp32 and spends one
// fma per weight and activation row: at the 8-row draft block ~13 instructions per weight, 15x the
// bandwidth floor on the H200 (ncu, S5 run 2: 3.8 of the draft step's 4.7 ms). Here the codes go
// into mma.sync as bytes against the activation digits: a weight costs ~0.1 instructions for
// any number of rows up to 8.
//
// Arithmetic (per weight row, activation row, block of 128 inputs; u the activation digits,
// 2^(E-kXqShift) the activation block's scale, the digit planes p kept apart until the end of the block):
//   Q4_K   w = d sc_j q - dmin m_j over sub-blocks j of 32 (q 4-bit, sc_j m_j 6-bit, d dmin fp16):
//          P_p = sum_j sc_j sum_{k in j} q_k u_pk    (mma of the codes per j, then an integer multiply-add)
//          N_p = sum_j m_j sum_{k in j} u_pk          (mma of m_j broadcast over the sub-block, chained)
//          y += 2^(E-kXqShift) (d V(P) - dmin V(N)),  V(X) = 256 X_0 + X_1 in int32 (2 planes; planes_int:
//          |u| <= 2^14, so |V(P)| <= 63 * 15 * 128 * 2^14 < 2^31, |V(N)| < 2^27), then one rounding to fp32
//   Q6_K   w = d sc_i (q - 32) over sub-blocks i of 16 (q 6-bit, sc_i int8, d fp16): the codes are stored
//          as the signed bytes q - 32, one mma.m16n8k16 per sub-block;
//          P_p = sum_i sc_i sum_{k in i} (q_k - 32) u_pk,   y += 2^(E-kXqShift) d V(P)
// Every integer sum is exact (|P_p| < 2^27, |N_p| < 2^21, Q4_K's V(P), V(N)) and order-free; the floats are rounded in a
// fixed order per (weight row, activation row, block), the same for every M (rows are bit-identical
// to single-row calls, tested). Against the CPU's fp32 dequantize-and-fma the difference is the
// activation quantization (<= 2^-14 of a block's largest |x| at 2 planes) and fp32 rounding.
//
// Layouts (Layout::kKQuantMma; rows padded to Np = 16 ceil(out / 16), pad rows all zero):
//   Q4_K  codes [Np/16][nblk][16 rows r][4 t][4 words w]: byte e of word w holds q of k = 32 w + 4 t + e
//         (low nibble, A registers a0 / a1 of k32 step w) and of k + 16 (high nibble: a2 / a3);
//         scales [Np/16][nblk][16 rows][12 B]: sc_j (4 B, j = the block's 4 sub-blocks), m_j (4 B),
//         d, dmin (fp16 bits).
//   Q6_K  codes [Np/16][nblk][16 rows r][2 halves][4 t][4 words]: word s % 4 of half s / 4 holds q - 32
//         of k = 16 s + 4 t + e (k16 step s); the halves of odd rows are swapped, so a lane quad's two
//         rows read different banks; scales [Np/16][nblk][16 rows][12 B]: sc_i (8 B), d (fp16), 2 B pad.
#include "ops/cuda/mma_gemv.cuh"

namespace dflash::cuda {
namespace {

// Element e (0..255) of a Q4_K superblock (144 B: d, dmin, scales[12], qs[128]): its 4-bit code.
__device__ __forceinline__ uint32_t q4k_code(const uint8_t* b, int e) {
  const int j = e >> 5, l = e & 31;
  return (b[16 + 32 * (j >> 1) + l] >> (4 * (j & 1))) & 0xFu;
}
// Element e of a Q6_K superblock (210 B: ql[128], qh[64], scales[16] int8, d): q - 32 in -32..31.
__device__ __forceinline__ int q6k_value(const uint8_t* b, int e) {
  const int n = e >> 7, within = e & 127, g4 = within >> 5, l = within & 31;
  const int lo = (b[64 * n + l + 32 * (g4 & 1)] >> (4 * (g4 >> 1))) & 0xF;
  const int hi = (b[128 + 32 * n + l] >> (2 * g4)) & 3;
  return (lo | (hi << 4)) - 32;
}

constexpr int kQ4kBytes = 144, kQ6kBytes = 210;

// Byte offset (within a tile's 128-block) of code k (0..127) of tile row r, and the nibble shift (Q4_K).
__device__ __forceinline__ int q4k_pos(int r, int k, int& shift) {
  const int w = k >> 5, h = (k >> 4) & 1, t = (k >> 2) & 3, e = k & 3;
  shift = 4 * h;
  return r * 64 + t * 16 + w * 4 + e;
}
__device__ __forceinline__ int q6k_pos(int r, int k) {
  const int s = k >> 4, t = (k >> 2) & 3, e = k & 3, half = (s >> 2) ^ (r & 1);
  return r * 128 + half * 64 + t * 16 + (s & 3) * 4 + e;
}

// ---- load-time transcode: one thread per (tile, block, row) -----------------------------------------

template <bool kQ6>
__global__ void to_kquant_mma_kernel(const uint8_t* __restrict__ src, uint8_t* __restrict__ codes,
                                     uint8_t* __restrict__ scales, int64_t N, int nblk, int64_t total) {
  pdl_wait();
  const int64_t gid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (gid >= total) return;  // gid = (tile * nblk + b) * 16 + r
  const int r = static_cast<int>(gid & 15);
  const int64_t tb = gid >> 4;
  const int b = static_cast<int>(tb % nblk);
  const int64_t row = (tb / nblk) * 16 + r;
  constexpr int kCode = kQ6 ? 2048 : 1024;
  uint8_t* c = codes + tb * kCode;
  uint8_t* sc = scales + tb * 192 + r * 12;
  if (row >= N) {  // pad row: codes 0, scales 0 (contributes nothing)
    for (int k = 0; k < 128; ++k) {
      if (kQ6) {
        c[q6k_pos(r, k)] = 0;
      } else {
        int sh;
        const int p = q4k_pos(r, k, sh);
        if (sh == 0) c[p] = 0;
      }
    }
    for (int i = 0; i < 12; ++i) sc[i] = 0;
    return;
  }
  const int nsb = nblk / 2;  // superblocks per row
  const uint8_t* sb = src + (row * nsb + b / 2) * (kQ6 ? kQ6kBytes : kQ4kBytes);
  const int half = b & 1;
  if (kQ6) {
    for (int k = 0; k < 128; ++k) c[q6k_pos(r, k)] = static_cast<uint8_t>(static_cast<int8_t>(q6k_value(sb, 128 * half + k)));
    for (int i = 0; i < 8; ++i) sc[i] = sb[192 + 8 * half + i];
    sc[8] = sb[208];
    sc[9] = sb[209];
    sc[10] = sc[11] = 0;
  } else {
    for (int k = 0; k < 128; ++k) {
      if ((k >> 4) & 1) continue;  // the low-nibble k writes the byte with both codes
      int sh;
      const int p = q4k_pos(r, k, sh);
      c[p] = static_cast<uint8_t>(q4k_code(sb, 128 * half + k) | (q4k_code(sb, 128 * half + k + 16) << 4));
    }
    for (int j = 0; j < 4; ++j) {
      int s, m;
      kquant_scale_min(sb + 4, 4 * half + j, s, m);
      sc[j] = static_cast<uint8_t>(s);
      sc[4 + j] = static_cast<uint8_t>(m);
    }
    sc[8] = sb[0];
    sc[9] = sb[1];
    sc[10] = sb[2];
    sc[11] = sb[3];
  }
}

struct Q4kFmt {
  static constexpr bool kEpilogues = false;
  static constexpr bool kFixedRows = true;
  // Tail pieces (mma_gemv.cuh, MmaTail): the drafter's FFN gate | up (544 groups, 396 CTAs per wave) runs
  // its last 148 groups as 296 half-k pieces: alone 39.0 -> 37.0 us at 8 rows, 34.4 -> 33.1 at one row; in
  // the draft step 39.2 -> 36.1 us exposed x 5, draft 0.808-0.811 -> 0.798-0.800 ms (S35-1).
  static constexpr bool kTailPieces = true;
  static constexpr bool kL2Hint = true;
  static constexpr bool kShuffleScaleDst = false;  // their builds are clean without (mma_gemv.cuh's issue_weights)
  static constexpr int kCodeBytes = 1024, kScaleBytes = 192;
  // Rings: 2 stages of 5.1 KB (decode) / 7.0 KB (8 rows) per warp (2 activation planes); 3 CTAs per SM
  // (the 8-row kernels take 138-144 registers). kMinBlocks 4 (128 registers, 24-48 bytes of spill, 4 CTAs
  // per SM: the drafter's FFN gate | up in 1.03 waves instead of 1.37) was slower: gate | up 42.2 vs
  // 38.9 us, draft 0.879-0.880 vs 0.830-0.834 ms (S29-6).
  static constexpr int kWarps = 4, kMinBlocks = 3, kWave = 3;
  static constexpr int kStagesOneRow = 2, kStagesNarrow = 2, kStagesWide = 2, kStagesWideAlt = 2;

  template <int R>
  static __device__ __forceinline__ void block_compute(const uint8_t* stage, int mc, int g, int t,
                                                       const LaneCols<R>& lc, float (&acc)[kTilesPerCta][4]) {
    constexpr int NT = ColMap<R>::kNt;
    const uint8_t* xs = stage_acts<Q4kFmt>(stage);
    const int32_t* meta = reinterpret_cast<const int32_t*>(xs + mc * kXqBytes);
    uint32_t bq[NT][8];
    float sx[2];
    int su[2];  // unused: the K-quant sums need no code offset
    load_acts<R>(xs, meta, lc, bq, sx, su);
    constexpr int kZero[4] = {0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < kTilesPerCta; ++i) {
      const uint8_t* cs = stage + i * kCodeBytes;
      const uint4 cg = *reinterpret_cast<const uint4*>(cs + g * 64 + t * 16);
      const uint4 cg8 = *reinterpret_cast<const uint4*>(cs + (g + 8) * 64 + t * 16);
      const uint32_t* ss = reinterpret_cast<const uint32_t*>(stage + kTilesPerCta * kCodeBytes + i * kScaleBytes);
      const uint32_t scg = ss[g * 3], mng = ss[g * 3 + 1], ddg = ss[g * 3 + 2];
      const uint32_t scg8 = ss[(g + 8) * 3], mng8 = ss[(g + 8) * 3 + 1], ddg8 = ss[(g + 8) * 3 + 2];
      // At 8 rows (2 planes) the lane holds both planes of its (weight row, activation row) pairs: n-tile 0
      // plane 0, n-tile 1 plane 1, the same registers. Their P is then kept as V(P) = 256 P_0 + P_1 directly
      // (VP; the same integer, |V(P)| < 2^31), one integer multiply-add per mma output as before and none
      // after the block.
      constexpr bool kV8 = R == 8 && kXqPlanes == 2;
      int P[NT][4], N[NT][4], VP[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t w = j == 0 ? cg.x : j == 1 ? cg.y : j == 2 ? cg.z : cg.w;
        const uint32_t w8 = j == 0 ? cg8.x : j == 1 ? cg8.y : j == 2 ? cg8.z : cg8.w;
        const uint32_t a0 = w & 0x0f0f0f0fu, a2 = (w >> 4) & 0x0f0f0f0fu;
        const uint32_t a1 = w8 & 0x0f0f0f0fu, a3 = (w8 >> 4) & 0x0f0f0f0fu;
        const int s0 = static_cast<int>((scg >> (8 * j)) & 0xffu), s8 = static_cast<int>((scg8 >> (8 * j)) & 0xffu);
        const uint32_t m0 = __byte_perm(mng, 0, 0x1111u * j), m8 = __byte_perm(mng8, 0, 0x1111u * j);
        if constexpr (kV8) {
          int d0[4], d1[4];
          mma_u8s8(d0, a0, a1, a2, a3, bq[0][2 * j], bq[0][2 * j + 1], kZero);
          mma_u8s8(d1, a0, a1, a2, a3, bq[1][2 * j], bq[1][2 * j + 1], kZero);
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int v = d0[r] * 256 + d1[r], sr = r < 2 ? s0 : s8;
            VP[r] = j == 0 ? sr * v : VP[r] + sr * v;
          }
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            if (j == 0)
              mma_u8s8(N[nt], m0, m8, m0, m8, bq[nt][0], bq[nt][1], kZero);
            else
              mma_u8s8(N[nt], m0, m8, m0, m8, bq[nt][2 * j], bq[nt][2 * j + 1], N[nt]);
          }
        } else {
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            int d[4];
            mma_u8s8(d, a0, a1, a2, a3, bq[nt][2 * j], bq[nt][2 * j + 1], kZero);
            if (j == 0) {
              P[nt][0] = s0 * d[0], P[nt][1] = s0 * d[1], P[nt][2] = s8 * d[2], P[nt][3] = s8 * d[3];
              mma_u8s8(N[nt], m0, m8, m0, m8, bq[nt][0], bq[nt][1], kZero);
            } else {
              P[nt][0] += s0 * d[0], P[nt][1] += s0 * d[1], P[nt][2] += s8 * d[2], P[nt][3] += s8 * d[3];
              mma_u8s8(N[nt], m0, m8, m0, m8, bq[nt][2 * j], bq[nt][2 * j + 1], N[nt]);
            }
          }
        }
      }
      const float dg = fp16_to_f32(static_cast<uint16_t>(ddg & 0xffffu));
      const float ng = fp16_to_f32(static_cast<uint16_t>(ddg >> 16));
      const float dg8 = fp16_to_f32(static_cast<uint16_t>(ddg8 & 0xffffu));
      const float ng8 = fp16_to_f32(static_cast<uint16_t>(ddg8 >> 16));
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        if (!row_col_used<R>(jj)) continue;
        int Pp[kXqPlanes], Np[kXqPlanes];
        if constexpr (!kV8) gather_planes<R>(P, jj, Pp);
        gather_planes<R>(N, jj, Np);
        const float s = sx[jj & 1];
        // V(P), V(N) as exact integers at 2 planes (|V(P)| <= 63 * 15 * 128 * 2^14 < 2^31), one rounding each
        // (two conversions and an fma fewer per value than fp32 planes; 3 planes would not fit int32). The
        // block's value d V(P) - dmin V(N) is formed first and scaled by 2^(E-kXqShift) in the fma that adds
        // it (the same steps at every R: one multiply fewer per value than scaling d and dmin apart).
        if constexpr (kXqPlanes == 2) {
          float vp;
          if constexpr (kV8)
            vp = static_cast<float>(VP[jj]);
          else
            vp = static_cast<float>(planes_int(Pp, 0));
          const float vn = static_cast<float>(planes_int(Np, 0));
          const float blk = __fmaf_rn(jj < 2 ? dg : dg8, vp, __fmul_rn(-(jj < 2 ? ng : ng8), vn));
          acc[i][jj] = __fmaf_rn(s, blk, acc[i][jj]);
        } else {
          const float dd = __fmul_rn(jj < 2 ? dg : dg8, s), dn = __fmul_rn(jj < 2 ? ng : ng8, s);
          acc[i][jj] = __fmaf_rn(dd, planes_value(Pp), acc[i][jj]);
          acc[i][jj] = __fmaf_rn(-dn, planes_value(Np), acc[i][jj]);
        }
      }
    }
  }
};

struct Q6kFmt {
  static constexpr bool kEpilogues = false;
  // The weights stream with the L2 evict-first hint again since round 33, their scales' shared address
  // through a shuffle (kShuffleScaleDst). ptxas 13.0 had miscompiled Q6_K's hinted kernels now and then:
  // their SASS read the policy's descriptor register (desc[UR1]) in a weight copy and never wrote it, so they
  // trapped with "illegal instruction" (the fixed-M 8-row build in rounds 27-28, also with the policy taken
  // from a kernel parameter; the general 2-row build in round 29), and rounds 29-32 copied without the hint.
  // Round 33 found the pattern in a hinted ternary build (RESULTS, S33-9): the predicated copy of the scales
  // with a shared address of the form [R + UR]; through the shuffle that form cannot arise, and every Q6_K
  // build is clean (tools/sass_check_descriptors.py, run by gpu_test.sh). Draft step 0.817-0.820 -> 0.806-0.809
  // ms, the Q6_K ffn_down 28.70 -> 26.05 us exposed (S33-11). The kernels built for exactly 1 or 8 rows gained
  // nothing measurable without the hint (draft timelines, fixed / general: S29-5 29.2 / 29.0 and 8.1 / 7.8 us,
  // one machine; S29-6 29.6 / 30.6 and 8.1 / 7.9, two builds alternating), so Q6_K keeps the general ones.
  static constexpr bool kL2Hint = true, kShuffleScaleDst = true;
  static constexpr bool kFixedRows = false;
  static constexpr bool kTailPieces = false;  // not measured: no 27B launch of Q6_K is 1-1.5 waves
  static constexpr int kCodeBytes = 2048, kScaleBytes = 192;
  // Rings: 2 stages of 9.2 KB (decode) / 11.1 KB (8 rows) per warp (2 activation planes); 2 CTAs per SM.
  static constexpr int kWarps = 4, kMinBlocks = 2, kWave = 2;
  static constexpr int kStagesOneRow = 2, kStagesNarrow = 2, kStagesWide = 2, kStagesWideAlt = 2;

  template <int R>
  static __device__ __forceinline__ void block_compute(const uint8_t* stage, int mc, int g, int t,
                                                       const LaneCols<R>& lc, float (&acc)[kTilesPerCta][4]) {
    constexpr int NT = ColMap<R>::kNt;
    const uint8_t* xs = stage_acts<Q6kFmt>(stage);
    const int32_t* meta = reinterpret_cast<const int32_t*>(xs + mc * kXqBytes);
    uint32_t bq[NT][8];
    float sx[2];
    int su[2];  // unused: the K-quant sums need no code offset
    load_acts<R>(xs, meta, lc, bq, sx, su);
    const int swap = (g & 1) * 64;  // rows g and g + 8 have the same parity
#pragma unroll
    for (int i = 0; i < kTilesPerCta; ++i) {
      const uint8_t* cs = stage + i * kCodeBytes;
      const uint4 lo = *reinterpret_cast<const uint4*>(cs + g * 128 + swap + t * 16);
      const uint4 hi = *reinterpret_cast<const uint4*>(cs + g * 128 + (64 - swap) + t * 16);
      const uint4 lo8 = *reinterpret_cast<const uint4*>(cs + (g + 8) * 128 + swap + t * 16);
      const uint4 hi8 = *reinterpret_cast<const uint4*>(cs + (g + 8) * 128 + (64 - swap) + t * 16);
      const uint32_t wg[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      const uint32_t wg8[8] = {lo8.x, lo8.y, lo8.z, lo8.w, hi8.x, hi8.y, hi8.z, hi8.w};
      const uint32_t* ss = reinterpret_cast<const uint32_t*>(stage + kTilesPerCta * kCodeBytes + i * kScaleBytes);
      const uint32_t sc_g[2] = {ss[g * 3], ss[g * 3 + 1]}, sc_g8[2] = {ss[(g + 8) * 3], ss[(g + 8) * 3 + 1]};
      const uint32_t ddg = ss[g * 3 + 2], ddg8 = ss[(g + 8) * 3 + 2];
      int P[NT][4];
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        const int s0 = static_cast<int8_t>((sc_g[s >> 2] >> (8 * (s & 3))) & 0xffu);
        const int s8 = static_cast<int8_t>((sc_g8[s >> 2] >> (8 * (s & 3))) & 0xffu);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          int d[4];
          mma_s8s8_k16(d, wg[s], wg8[s], bq[nt][s]);
          if (s == 0) {
            P[nt][0] = s0 * d[0], P[nt][1] = s0 * d[1], P[nt][2] = s8 * d[2], P[nt][3] = s8 * d[3];
          } else {
            P[nt][0] += s0 * d[0], P[nt][1] += s0 * d[1], P[nt][2] += s8 * d[2], P[nt][3] += s8 * d[3];
          }
        }
      }
      const float dg = fp16_to_f32(static_cast<uint16_t>(ddg & 0xffffu));
      const float dg8 = fp16_to_f32(static_cast<uint16_t>(ddg8 & 0xffffu));
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        if (!row_col_used<R>(jj)) continue;
        int Pp[kXqPlanes];
        gather_planes<R>(P, jj, Pp);
        acc[i][jj] = __fmaf_rn(__fmul_rn(jj < 2 ? dg : dg8, sx[jj & 1]), planes_value(Pp), acc[i][jj]);
      }
    }
  }
};

// ---- get_rows: one thread per element, the CPU's dequantized value bit for bit -------------------------

template <bool kQ6>
__global__ void get_rows_kquant_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                                       int64_t K, int64_t N, int nblk, const int32_t* __restrict__ ids,
                                       float* __restrict__ y) {
  pdl_wait();
  int64_t e, m;
  int32_t id;
  if (!get_rows_element(K, N, ids, y, e, m, id)) return;
  const int r = id & 15;
  const int64_t tb = (static_cast<int64_t>(id) >> 4) * nblk + (e >> 7);
  const int k = static_cast<int>(e & 127);
  const uint8_t* sc = scales + tb * 192 + r * 12;
  if (kQ6) {
    const int q = static_cast<int8_t>(codes[tb * 2048 + q6k_pos(r, k)]);
    const float d = fp16_to_f32(static_cast<uint16_t>(sc[8] | (sc[9] << 8)));
    const float s = __fmul_rn(d, static_cast<float>(static_cast<int8_t>(sc[k >> 4])));
    y[m * K + e] = __fmul_rn(s, static_cast<float>(q));
  } else {
    int sh;
    const int q = (codes[tb * 1024 + q4k_pos(r, k, sh)] >> sh) & 0xF;
    const float d = fp16_to_f32(static_cast<uint16_t>(sc[8] | (sc[9] << 8)));
    const float dmin = fp16_to_f32(static_cast<uint16_t>(sc[10] | (sc[11] << 8)));
    const int j = k >> 5;
    const float d1 = __fmul_rn(d, static_cast<float>(sc[j])), m1 = __fmul_rn(dmin, static_cast<float>(sc[4 + j]));
    y[m * K + e] = __fsub_rn(__fmul_rn(d1, static_cast<float>(q)), m1);
  }
}

}  // namespace

bool kquant_mma_supported(int type, int64_t in) { return (type == 12 || type == 14) && in > 0 && in % 256 == 0; }

size_t kquant_code_bytes(int type, int64_t in, int64_t out) {
  return static_cast<size_t>(padded_rows(out) / 16) * (in / 128) * (type == 14 ? Q6kFmt::kCodeBytes : Q4kFmt::kCodeBytes);
}
size_t kquant_scale_bytes(int64_t in, int64_t out) {
  return static_cast<size_t>(padded_rows(out) / 16) * (in / 128) * Q4kFmt::kScaleBytes;
}

void launch_to_kquant_mma(const uint8_t* src, int type, uint8_t* codes, uint8_t* scales, int64_t in, int64_t out,
                          cudaStream_t s) {
  const int nblk = static_cast<int>(in / 128);
  const int64_t total = padded_rows(out) * nblk;  // one thread per (tile, block, row)
  if (total <= 0) return;
  if (type == 14)
    launch_pdl(to_kquant_mma_kernel<true>, ceil_div_u(total, 128), 128, 0, s, src, codes, scales, out, nblk, total);
  else
    launch_pdl(to_kquant_mma_kernel<false>, ceil_div_u(total, 128), 128, 0, s, src, codes, scales, out, nblk, total);
}

int launch_matmul_kquant_group(const DevWeight* const* ws, float* const* ys, int n, const float* x, int64_t M,
                               const TernaryBuffers& buf, int num_sms, cudaStream_t s, int max_parts) {
  if (ws[0]->type == 14) return launch_mma_group<Q6kFmt>(ws, ys, n, x, M, buf, num_sms, s, max_parts);
  return launch_mma_group<Q4kFmt>(ws, ys, n, x, M, buf, num_sms, s, max_parts);
}

void launch_get_rows_kquant(const DevWeight& w, const int32_t* ids, float* y, int64_t M, cudaStream_t s) {
  const dim3 grid(ceil_div_u(w.in, 256), static_cast<unsigned>(M));
  const auto* sc = reinterpret_cast<const uint8_t*>(w.scales);
  if (w.type == 14)
    launch_pdl(get_rows_kquant_kernel<true>, grid, 256, 0, s, w.data, sc, w.in, w.out, static_cast<int>(w.in / 128),
               ids, y);
  else
    launch_pdl(get_rows_kquant_kernel<false>, grid, 256, 0, s, w.data, sc, w.in, w.out, static_cast<int>(w.in / 128),
               ids, y);
}

}  // namespace dflash::cuda
