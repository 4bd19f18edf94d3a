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
// Exactness. Activations are block fixed point per (row, block of 128), split into kXqPlanes signed
// bytes, u = 256 u0 + u1 at 2 planes (mma_gemv.cuh, xq_record.cuh). With the weight codes c in {0,1,2}
// as unsigned bytes, mma.s32.u8.s8 gives D_i = sum c * u_i exactly in int32, and v = D0 * 256 + D1 - S,
// S = sum u the record's digit sum, is the integer sum (c - 1) u = sum w u (computed modulo 2^32, so
// exact; at 2 planes |v| < 2^21, so float(v) is exact too). Where S is subtracted is scheduling only:
// at one activation row the last plane's accumulator starts at -S (the lane that holds that column
// needs no extra instruction); at more rows the accumulators start at zero and S comes off after the
// plane combination (a -S start per column had cost register-quad copies for every tile's mma:
// S13-1). Per block: acc = fma(d * 2^(E-kXqShift), float(v), acc). Integer sums do not depend on
// order, so the only roundings are the quantization, float(v) and the block fmas, in a fixed order:
// nothing depends on M, the number of activation rows (tested bit for bit).
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
// The activation quantizer, the staging ring, the column map, the k split and the reduction are the
// shared integer tensor-core pipeline of mma_gemv.cuh; this file holds the ternary format (layout,
// load-time transcodes, block_compute, get_rows).
#include "ops/cuda/mma_gemv.cuh"

namespace dflash::cuda {
namespace {

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

// The format: 512 bytes of codes and 32 of scales per tile and block of 128.
struct TernaryFmt {
  static constexpr int kCodeBytes = 512, kScaleBytes = 32;
  static constexpr bool kEpilogues = true;  // GDN's input side in the projections' launch (launch_gdn_input)
  static constexpr bool kFixedRows = true;
  // No tail pieces (mma_gemv.cuh, MmaTail): FFN gate | up's 16 groups past the 8-row wave cut into 8 pieces
  // each were slower, alone 19.3 -> 19.8 us at 8 rows and 15.1 -> 16.0 at one row (656 CTAs), in the step
  // verify 4.65-4.75 -> 4.72-4.91 ms, decode 3.43-3.44 -> 3.46-3.48 (S35-1): a piece in the second wave
  // costs a DRAM round trip and the reduction's, about what the whole groups there did.
  static constexpr bool kTailPieces = false;
  static constexpr bool kL2Hint = true;  // evict-first weights (round 22)
  static constexpr bool kShuffleScaleDst = false;  // its builds are clean without (mma_gemv.cuh's issue_weights)
  // 4 warps: 8 per CTA (2 CTAs per SM, half the blocks per warp) made attn_qkv 10.0 -> 8.4 us alone but
  // the decode step 4.91 -> 5.28 ms and verify 9.1 -> 10.1 ms (S7-5).
  static constexpr int kWarps = 4;
  // 4-5 CTAs fit per SM (31 KB decode, 52 KB verify rings at 2 activation planes; the k-split launches are
  // padded to kWave per SM, mma_capped_smem). kWave, the CTAs per SM the k split aims at,
  // only decides the split of the 80-CTA launches (5120 outputs: ffn_down, the attention and GDN output
  // projections; every other 27B launch has more CTAs than one wave): 2 gives them 3 splits, 3 gave 4.
  // Round 5-7 had measured 3 best (S7-7: 2 slower); on the later rounds' kernels 2 is faster (S25-4,
  // --env-ab DFLASH_CUDA_TERNARY_WAVE=2: verify 5.62 / 5.64 vs 6.01 / 5.74 ms; S25-5, this default against
  // 3 alternating: verify 5.62-5.75 vs 5.75-5.83 ms, decode the same). Scheduling and the order of the
  // split sums: it never depends on M.
  static constexpr int kMinBlocks = 4, kWave = 2;
  // (5 CTAs per SM at one row, 96 registers, so that FFN gate | up's 544 CTAs fit one wave: decode
  // 4.97 -> 5.33 ms and every matmul alone slower, S7-4; not kept.)
  // Ring depth (H200, 27B PTQ1_0 in the model, S7-3): at one row 6 and 8 stages were faster alone
  // (ffn_up 15.8 -> 13.0 us at 6) but slower in the decode step (6.05 -> 6.2 ms: bigger rings leave no
  // room for the next kernel's early CTAs); at 8 rows 3 stages made the verify step faster (S7-4, A/B on
  // one machine with DFLASH_CUDA_WIDE_STAGES_ALT=1: 9.15, 9.07 vs 9.63, 9.39 ms).
  // At one row 3 stages since the aligned ring (S15-1 / S15-2, decode 4.13-4.17 -> 4.08-4.13 ms, 4 stages
  // with DFLASH_CUDA_MM_ONE_ROW_RING=0; 5 and 6 slower in the step, 6 faster alone: ffn_up 12.3 -> 9.5 us).
  static constexpr int kStagesOneRow = 3, kStagesNarrow = 4, kStagesWide = 3, kStagesWideAlt = 2;

  // One staged block for the CTA's tiles: acc[i][jj] += d 2^(E-kXqShift) * v for the lane's owned (weight
  // row, activation row) pairs (d2d3 rows g, g + 8 x d0d1 columns 2t, 2t + 1). Straight-line code over
  // all 4 tiles (a short last tile column computes copies of its last tile and stores nothing for them).
  template <int R>
  static __device__ __forceinline__ void block_compute(const uint8_t* stage, int mc, int g, int t,
                                                       const LaneCols<R>& lc, float (&acc)[kTilesPerCta][4]) {
    constexpr int NT = ColMap<R>::kNt;
    const uint8_t* xs = stage_acts<TernaryFmt>(stage);
    const int32_t* meta = reinterpret_cast<const int32_t*>(xs + mc * kXqBytes);  // [mc][S, 2^(E-kXqShift), 0, 0]
    uint32_t bq[NT][8];
    float sx[2];
    int su[2];
    load_acts<R>(xs, meta, lc, bq, sx, su);
    // Accumulator start: zero, or -S in the last plane's columns where they are the lane's own rows: at one
    // row (kXqPlanes - 1: lane t = 0's registers 1 and 3 at 2 planes, lane t = 1's registers 0 and 2 at 3),
    // and at 8 rows with 2 planes (n-tile 1 is plane 1 of rows 0..7: registers 0 / 2 of row 2t, 1 / 3 of
    // row 2t + 1). v = 256 D0 + (D1 - S) is the same integer as (256 D0 + D1) - S (exact modulo 2^32), so the
    // bits are the other row counts'; it saves the 16 subtractions per block of the 8-row epilogue.
    int cinit[4] = {0, 0, 0, 0};
    if constexpr (R == 1) {
      constexpr int kLast = kXqPlanes - 1;
      if (t == kLast / 2) cinit[kLast & 1] = cinit[(kLast & 1) + 2] = -meta[0];
    }
    constexpr bool kSInit8 = R == 8 && kXqPlanes == 2;
    const int cinit8[4] = {-su[0], -su[1], -su[0], -su[1]};
#pragma unroll
    for (int i = 0; i < kTilesPerCta; ++i) {
      const uint32_t* cw = reinterpret_cast<const uint32_t*>(stage + i * kCodeBytes);
      const uint2 rg = *reinterpret_cast<const uint2*>(cw + g * 8 + 2 * t);
      const uint2 rg8 = *reinterpret_cast<const uint2*>(cw + (g + 8) * 8 + 2 * t);
      const uint32_t sc = reinterpret_cast<const uint32_t*>(stage + kTilesPerCta * kCodeBytes)[i * 8 + g];
      int d[NT][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int q = 2 * (j & 1);  // registers q (h = 0) and q + 1 (h = 1) of word j / 2
        const uint32_t wg = j < 2 ? rg.x : rg.y, wg8 = j < 2 ? rg8.x : rg8.y;
        const uint32_t a0 = (wg >> (2 * q)) & 0x03030303u, a1 = (wg8 >> (2 * q)) & 0x03030303u;
        const uint32_t a2 = (wg >> (2 * q + 2)) & 0x03030303u, a3 = (wg8 >> (2 * q + 2)) & 0x03030303u;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          if (j == 0 && kSInit8 && nt == 1)
            mma_u8s8(d[nt], a0, a1, a2, a3, bq[nt][0], bq[nt][1], cinit8);
          else if (j == 0)
            mma_u8s8(d[nt], a0, a1, a2, a3, bq[nt][0], bq[nt][1], cinit);
          else
            mma_u8s8(d[nt], a0, a1, a2, a3, bq[nt][2 * j], bq[nt][2 * j + 1], d[nt]);
        }
      }
      const float dg = fp16_to_f32(static_cast<uint16_t>(sc & 0xffffu));
      const float dg8 = fp16_to_f32(static_cast<uint16_t>(sc >> 16));
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        if (!row_col_used<R>(jj)) continue;
        // The plane sums of the owned column (|D| <= 2 * 128 * 128), then v exactly (the unsigned
        // arithmetic wraps where sum c u would not fit).
        int D[kXqPlanes];
        gather_planes<R>(d, jj, D);
        const int v = planes_int(D, R == 1 || kSInit8 ? 0 : su[jj & 1]);
        acc[i][jj] = __fmaf_rn(__fmul_rn(jj < 2 ? dg : dg8, sx[jj & 1]), static_cast<float>(v), acc[i][jj]);
      }
    }
  }
};

// ---- get_rows: one thread per element --------------------------------------------------------------

__global__ void get_rows_ternary_kernel(const uint32_t* __restrict__ codes, const uint32_t* __restrict__ scales,
                                        int64_t K, int64_t N, int nblk, const int32_t* __restrict__ ids,
                                        float* __restrict__ y) {
  pdl_wait();
  int64_t e, m;
  int32_t id;
  if (!get_rows_element(K, N, ids, y, e, m, id)) return;
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

TernaryScratch ternary_scratch(int64_t in, int64_t M) { return TernaryScratch{mma_xq_bytes(in, M)}; }

int launch_matmul_ternary_group(const DevWeight* const* ws, float* const* ys, int n, const float* x, int64_t M,
                                const TernaryBuffers& buf, int num_sms, cudaStream_t s, int max_parts) {
  return launch_mma_group<TernaryFmt>(ws, ys, n, x, M, buf, num_sms, s, max_parts);
}

int launch_matmul_ternary(const DevWeight& w, const float* x, float* y, int64_t M, const TernaryBuffers& buf,
                          int num_sms, cudaStream_t s, int max_parts) {
  const DevWeight* one[1] = {&w};
  float* const ys[1] = {y};
  return launch_matmul_ternary_group(one, ys, 1, x, M, buf, num_sms, s, max_parts);
}

bool gdn_input_fusable(const DevWeight& w_qkv, const DevWeight& w_z, const DevWeight* const* ab, int n_ab, int64_t M,
                       int64_t C, int64_t K, int num_sms) {
  if (w_qkv.layout != Layout::kTernaryMma || w_z.layout != Layout::kTernaryMma || w_qkv.in != w_z.in ||
      w_qkv.out != C || M < 1 || M > kCols || K != 4 || n_ab < 1 || n_ab > kTernaryMaxGroup)
    return false;
  for (int k = 0; k < n_ab; ++k)
    if (ab[k]->layout != Layout::kBlocks || ab[k]->type != kBF16 || ab[k]->in != ab[0]->in || ab[k]->in % 8 != 0 ||
        !use_split(ab[k]->in, ab[k]->out))
      return false;
  // the projections' k split (launch_mma_group's rule) must be 1: the conv needs whole sums in its CTA
  return mma_splits_for(mma_ctas(w_qkv.out) + mma_ctas(w_z.out), w_qkv.in, num_sms,
                        mma_ctas_per_sm(TernaryFmt::kWave), TernaryFmt::kWarps) == 1;
}

bool launch_gdn_input(const DevWeight& w_qkv, const DevWeight& w_z, const float* x, float* conv_in, float* z,
                      const DevWeight* const* ab, float* const* ab_y, int n_ab, const float* mx, float* state,
                      float* state_before, const float* conv_w, float* conv_out, int64_t M, int64_t C, int64_t K,
                      const TernaryBuffers& buf, int num_sms, cudaStream_t s) {
  if (!gdn_input_fusable(w_qkv, w_z, ab, n_ab, M, C, K, num_sms)) return false;
  const DevWeight* ws[2] = {&w_qkv, &w_z};
  float* const ys[2] = {conv_in, z};
  const GdnInputSide side{ab, ab_y, n_ab, mx, conv_w, state, state_before, conv_out};
  return launch_mma_group<TernaryFmt>(ws, ys, 2, x, M, buf, num_sms, s, 1, &side) != 0;
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
