// Attention for decode and verify (a few rows over a KV cache): key segments in parallel, then a merge
// kernel (or, for Backend::attention_gate_rotate, a kernel that merges and then gates, rotates and
// quantizes the output for wo). launch_attention runs it for head dims that are multiples of 4 up to
// kSegMaxHeadDim; the generic split kernel (attention.cu) takes the other shapes, and every shape with
// DFLASH_CUDA_ATTN_SEGMENTS=0.
//
// Why. The cluster kernel of rounds 4-9 ran every (KV head, row group) in one cluster of 8-16 CTAs: 64 CTAs on the
// H200 whatever the context, so an 8-row verify at 4096 keys took 125 us (one row: 29 us, a quarter of
// the bandwidth) and at 32768 keys 926 us (bench/RESULTS.md, round 10). Here the work grows with the
// context: 32 segments per row, and the partials of a row are merged by a second kernel.
//
// Two arithmetic families: the fp32 FMA kernel below (variants 0 and 1, same bits; every head dim that is a
// multiple of 4 up to kSegMaxHeadDim) and the tensor-core kernel (variant 2, attention_segment_mma_kernel:
// 3xTF32, head dims 128 and 256; the default at 256). Which one runs depends on the head shape only.
//
// Arithmetic of one (row, head) in the FMA kernel: a function of the row's range [lo, hi) and its data only, never of M,
// of the other rows or of which CTA does what (so a verify row has the bits of the same row decoded
// alone; test_cuda's M-row == 1-row checks):
//   * keys go in tiles of 32 at absolute positions (tile t = keys 32t .. 32t + 31). The row's tiles
//     [lo / 32, ceil(hi / 32)) are cut into kSegs = 32 segments of spt = ceil(tiles / 32) tiles each
//     (the last ones shorter or empty);
//   * a score is q . k over the head dim zero-padded to 8 slices of CPS float4 chunks: per slice four
//     fma chains (one per float4 component, chunks in order) added as (a0 + a1) + (a2 + a3); the slices
//     added left to right; times scale;
//   * per tile an online softmax over the row's keys in the tile (a tile without any leaves the state
//     alone): tile max m_t by a warp butterfly, m' = max(m, m_t), c = expf(m - m'), p = expf(s - m')
//     (0 for keys outside the row's segment), l = l c + (the xor-butterfly sum of p over the 32 tile
//     positions), acc = acc c, then acc = fma(p_j, v_j, acc) for the row's keys j of the tile in order
//     (keys outside the row's range are skipped, never multiplied by 0); a segment starts from m = -inf,
//     l = 0, acc = 0;
//   * merge: m* = max of the non-empty segments' m; w_z = expf(m_z - m*); tot = fma(l_z, w_z, tot) and
//     o = fma(acc_z, w_z, o) in segment order from 0; out = o * (1 / tot). An empty range gives zeros.
//
// Work layout (free to depend on M). An item is (row group, segment, KV head x head chunk): `rows` rows
// x `hc` query heads of one KV head (NQ = rows x hc <= kSegMaxQ = 24 queries). A grid of the CTAs that
// fit at once (8 warps each; one per SM at head dim 256) works through the items segment-major, so a
// short context's few non-empty items spread over the SMs and its empty ones cost a check each. An item
// streams the union of its rows' segment tiles through shared memory (cp.async): K and V of a tile are
// read once for all its queries (GQA). Per tile: scores (variant 0: warp = slice, lane = key, the slice
// partials through shared memory; variant 1: warp = query, lane = key), softmax (warp per query, lane =
// key), P . V (thread = float4 chunk of the head dim x a group of 1, 2, 4, 6 or 8 queries, accumulators
// in registers across the segment's tiles). Above attention_segment_kernel: the two variants and when
// each runs.
#include <algorithm>
#include <type_traits>

#include "ops/cuda/chunk_rotation.cuh"
#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"
#include "ops/cuda/tf32_mma.cuh"

namespace dflash::cuda {
namespace {

constexpr int kSegs = 32;         // segments per row
constexpr int kSegTile = 32;      // keys per tile
constexpr int kSegThreads = 256;  // 8 warps: one score slice each
constexpr int kSegMaxQ = 24;      // queries per item
constexpr int kSoftQ = kSegMaxQ / 8;  // softmax queries per warp
constexpr int kSegMaxRows = 16;   // rows per item (hc = 1)
constexpr int kSegMaxM = 64;      // rows per launch (the range table in shared memory)

struct SegArgs {
  const float* q;
  const float* k;
  const float* v;
  const int32_t* kv_range;
  float* part_ml;   // [M][H][kSegs][2]: m, l of each non-empty segment
  float* part_acc;  // [M][H][kSegs][D]
  float* out;
  int64_t M, n_heads, kv_stride;  // kv_stride = n_kv_heads * D floats between keys
  int D, d4;                      // d4 = D / 4 chunks (D % 4 == 0)
  int group, hc, hchunks, rows;   // heads per KV head; heads per item; head chunks per KV head; rows per item
  float scale;
};

// The row's segment z: keys [ka, kb) (ka >= kb: empty). lo, hi: the row's range.
__device__ __forceinline__ void segment_keys(int lo, int hi, int z, int& ka, int& kb) {
  ka = kb = 0;
  if (lo < 0 || hi <= lo) return;
  const int t_lo = lo / kSegTile, t_hi = (hi + kSegTile - 1) / kSegTile;
  const int spt = (t_hi - t_lo + kSegs - 1) / kSegs;
  const int ta = t_lo + z * spt, tb = min(ta + spt, t_hi);
  if (ta >= t_hi) return;
  ka = max(lo, ta * kSegTile);
  kb = min(hi, tb * kSegTile);
}

// Non-empty segments of a row (0 for an empty range): z < this count.
__device__ __forceinline__ int segment_count(int lo, int hi) {
  if (lo < 0 || hi <= lo) return 0;
  const int t_lo = lo / kSegTile, t_hi = (hi + kSegTile - 1) / kSegTile;
  const int spt = (t_hi - t_lo + kSegs - 1) / kSegs;
  return (t_hi - t_lo + spt - 1) / spt;
}

// P.V's query group for nq queries of d4 float4 chunks: 1, 2, 4, (lane scores with up to 8) 6 or 8
// queries per thread, the smallest that fits the CTA (fewer queries per thread: more threads; more: fewer
// V reads). Any group at least this large gives the same bits (a query's accumulation runs over the keys
// in order whatever its group), so a launch may fix one for all its items (attention_segment_kernel's kQG).
__host__ __device__ constexpr int seg_query_group(int d4, int nq, bool lane, int max_qg) {
  return d4 * nq <= kSegThreads                                  ? 1
         : d4 * ((nq + 1) / 2) <= kSegThreads                    ? 2
         : d4 * ((nq + 3) / 4) <= kSegThreads                    ? 4
         : lane && max_qg == 8 && d4 * ((nq + 5) / 6) <= kSegThreads ? 6
                                                                 : 8;
}

// Shared-memory layout (floats) for CPS float4 chunks per slice. kLane (variant 1): one K / V stage and
// no slice partials; otherwise two stages and the slice-partials buffer of the slice-parallel scores.
template <int CPS, bool kLane>
struct SegSmem {
  static constexpr int kStages = kLane ? 1 : 2;
  static constexpr int kDp = 32 * CPS;      // padded head dim (8 slices x CPS chunks x 4)
  static constexpr int kKst = kDp + 4;      // K rows: lane = key, 16-byte reads spread over the banks
  static constexpr int kVst = kDp;          // V rows: lanes read consecutive chunks
  static constexpr int kQ = 0;                                   // [kSegMaxQ][kDp]
  static constexpr int kK = kQ + kSegMaxQ * kDp;                 // [kStages][kSegTile][kKst]
  static constexpr int kV = kK + kStages * kSegTile * kKst;      // [kStages][kSegTile][kVst]
  static constexpr int kSp = kV + kStages * kSegTile * kVst;     // slice partials [kSegMaxQ][8][33]
  static constexpr int kPst = kSegMaxQ + 4;                      // p rows: float4s of a query group's p
  static constexpr int kP = kSp + (kLane ? 0 : kSegMaxQ * 8 * 33);  // p [kSegTile][kPst]
  static constexpr int kCorr = kP + kSegTile * kPst;             // corr [kSegMaxQ]
  static constexpr int kInts = kCorr + kSegMaxQ;                 // ints: ja, jb, upd [kSegMaxQ]; ranges [2 kSegMaxM]
  static constexpr int kFloats = kInts + 3 * kSegMaxQ + 2 * kSegMaxM;
  static constexpr size_t kBytes = sizeof(float) * kFloats;
};

// One CTA works through the (row group, segment, KV head x head chunk) items blockIdx.x, + gridDim.x, ...
// (segment-major, so a short context's few non-empty items go to different CTAs): a grid of as many CTAs
// as are resident at once (one per SM at head dim 256, two at 128), so the empty segments of a short
// context cost a check each, not a CTA launch.
//
// kVariant 0: slice-parallel scores (warp = slice of the head dim, lane = key, the slice partials through
// shared memory), K and V of two tiles in flight (one CTA per SM at head dim 256).
// kVariant 1: lane scores: a warp computes the scores of its softmax queries (warp, warp + 8, ...), lane =
// key, each over the whole head dim in the same slice order, so they stay in registers for the softmax
// (no slice partials, one barrier less per tile); one K and one V buffer (~95 KB at head dim 256: two CTAs
// per SM), the next tile's K copied while this tile's P.V runs and its V while the next scores run; P.V
// may take groups of 6 queries (the 27B's 24 queries of a 4-row item on all 256 threads).
// Only the layout differs: every score and output has the same bits in both (test_cuda compares them).
// Measured on the H200 (S12-2, bench_cuda_ops --attention, us in a graph, variant 0 / 1): 27B verify
// (M = 8, 24 queries per item) 66.0 / 59.4 at 4096 keys, 428.8 / 361.5 at 32768, 15.1 / 16.2 at 100;
// 27B decode (6 queries) 19.6 / 27.4 at 4096, 99.5 / 161.6 at 32768 (a lane's whole-head dot product
// of one query is load-bound); the drafter's block (head dim 128, already two CTAs per SM with
// variant 0) 50.0 / 60.5 at 4096. launch_attention_segments picks 1 for head dims above 128 with at
// least 16 queries per item, 0 otherwise (DFLASH_CUDA_ATTN_VARIANT=0/1 forces one).
template <int CPS, int kVariant>
using SegLayout = SegSmem<CPS, kVariant == 1>;

// kQG > 0: every item's P.V takes query groups of kQG (the launch's largest item needs no more), and the
// kernel holds that one P.V loop instead of all five: ~40 % less code for the 27B decode's kernel, whose
// ~99 KB of instructions are fetched afresh at every launch (measured: 8.17 -> 6.55 us exposed per decode
// launch with the P.V of groups of 2 only, S22-7). kQG = 0: the group per item, every loop compiled in.
template <int CPS, int kVariant, int kQG>
__global__ void __launch_bounds__(kSegThreads, kVariant == 1 ? 2 : 1) attention_segment_kernel(const SegArgs a) {
  constexpr bool kLane = kVariant == 1;  // lane scores, single K / V buffers
  using L = SegLayout<CPS, kVariant>;
  // P.V queries per thread at most: ceil(kSegMaxQ / (kSegThreads / d4)) with d4 <= 8 CPS chunks
  constexpr int kMaxQg = CPS >= 8 ? 8 : 4;
  extern __shared__ __align__(16) float sm[];
  float* qs = sm + L::kQ;
  float* ks = sm + L::kK;
  float* vs = sm + L::kV;
  float* sp = sm + L::kSp;
  float* ps = sm + L::kP;
  float* corr = sm + L::kCorr;
  int* ja_s = reinterpret_cast<int*>(sm + L::kInts);
  int* jb_s = ja_s + kSegMaxQ;
  int* upd_s = jb_s + kSegMaxQ;
  int* rng = upd_s + kSegMaxQ;  // [M][2]: the rows' ranges

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // The K pad columns of every stage (never written by the tile copies) are zero for the whole kernel.
  if (a.d4 < L::kDp / 4)
    for (int i = tid; i < L::kStages * kSegTile * (L::kDp / 4 - a.d4); i += kSegThreads) {
      const int pad = L::kDp / 4 - a.d4, key = i / pad, c = a.d4 + i % pad;
      *reinterpret_cast<float4*>(ks + key * L::kKst + 4 * c) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  pdl_wait();
  for (int i = tid; i < 2 * a.M; i += kSegThreads) rng[i] = a.kv_range[i];
  __syncthreads();

  const int row_groups = static_cast<int>((a.M + a.rows - 1) / a.rows);
  const int kv_items = static_cast<int>(a.n_heads / a.group) * a.hchunks;
  const int items = row_groups * kSegs * kv_items;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int rg = item % row_groups, rest = item / row_groups;
    const int kvi = rest % kv_items, z = rest / kv_items;
    const int kvh = kvi / a.hchunks, hchunk = kvi % a.hchunks;
    const int h0 = kvh * a.group + hchunk * a.hc;
    const int hc = min(a.hc, a.group - hchunk * a.hc);
    const int m0 = rg * a.rows;
    const int rows = min(a.rows, static_cast<int>(a.M) - m0);
    const int nq = rows * hc;
    // the rows' keys in segment z and their union [kmin, kmax) (every thread, from the range table)
    int kmin = 0x7fffffff, kmax = 0;
    for (int r = 0; r < rows; ++r) {
      int ka, kb;
      segment_keys(rng[2 * (m0 + r)], rng[2 * (m0 + r) + 1], z, ka, kb);
      if (ka < kb) {
        kmin = min(kmin, ka);
        kmax = max(kmax, kb);
      }
    }
    if (kmin >= kmax) continue;  // no row has keys in this segment
    const int ta = kmin / kSegTile, tb = (kmax + kSegTile - 1) / kSegTile;

    // ---- queries (zero-padded to kDp; copied with the first tile)
    for (int i = tid; i < kSegMaxQ * (L::kDp / 4); i += kSegThreads) {
      const int q = i / (L::kDp / 4), c = i % (L::kDp / 4);
      float* dst = qs + q * L::kDp + 4 * c;
      if (q < nq && c < a.d4) {
        const int64_t row = m0 + q / hc, head = h0 + q % hc;
        cp_async16(dst, a.q + (row * a.n_heads + head) * a.D + 4 * c);
      } else {
        *reinterpret_cast<float4*>(dst) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    }

    // K and V of tile t (keys inside [kmin, kmax) only: the rest of the cache may not exist) -> stage st.
    const float* kbase = a.k + static_cast<int64_t>(kvh) * a.D;
    const float* vbase = a.v + static_cast<int64_t>(kvh) * a.D;
    // (kv: 1 K only, 2 V only, 3 both)
    auto load_tile = [&](int t, int st, int kv = 3) {  // warp per key, lane per chunk
      const int k0 = max(t * kSegTile, kmin), k1 = min(t * kSegTile + kSegTile, kmax);
      for (int key = k0 + warp; key < k1; key += kSegThreads / 32) {
        const int j = key - t * kSegTile;
        const float* kg = kbase + key * a.kv_stride;
        const float* vg = vbase + key * a.kv_stride;
        for (int c = lane; c < a.d4; c += 32) {
          if (kv & 1) cp_async16(ks + (st * kSegTile + j) * L::kKst + 4 * c, kg + 4 * c);
          if (kv & 2) cp_async16(vs + (st * kSegTile + j) * L::kVst + 4 * c, vg + 4 * c);
        }
      }
    };
    // the segment keys of query q's row
    auto query_keys = [&](int q, int& ka, int& kb) {
      const int r = m0 + q / hc;
      segment_keys(rng[2 * r], rng[2 * r + 1], z, ka, kb);
    };

    // softmax state of queries warp, warp + 8, ... (every lane holds the same values)
    float m_run[kSoftQ], l_run[kSoftQ];
#pragma unroll
    for (int i = 0; i < kSoftQ; ++i) m_run[i] = -INFINITY, l_run[i] = 0.0f;
    // P.V: chunk pv_c of the query group pv_g (queries qg pv_g .. qg pv_g + qg - 1; seg_query_group)
    const int qg = kQG > 0 ? kQG : seg_query_group(a.d4, nq, kLane, kMaxQg);
    const int pv_c = tid % a.d4, pv_g = tid / a.d4;
    const bool pv_on = pv_g < (nq + qg - 1) / qg;
    float4 acc[kMaxQg];
#pragma unroll
    for (int i = 0; i < kMaxQg; ++i) acc[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);

    if constexpr (kLane) {  // groups: K(ta) (with the queries), V(ta), then per tile K(t + 1), V(t + 1)
      load_tile(ta, 0, 1);
      cp_async_commit();
      load_tile(ta, 0, 2);
      cp_async_commit();
    } else {
      load_tile(ta, 0);
      cp_async_commit();
    }
    for (int t = ta; t < tb; ++t) {
      const int st = kLane ? 0 : (t - ta) & 1;
      if constexpr (!kLane) {
        if (t + 1 < tb) load_tile(t + 1, st ^ 1);
        cp_async_commit();
      }
      cp_async_wait<1>();  // kLane: K(t) has landed (V(t) may not have)
      __syncthreads();

      // ---- scores
      float lane_s[kSoftQ];  // variant 1: this lane's key's score of the warp's queries (unscaled)
      if constexpr (kLane) {
        // warp per query (warp, warp + 8, ...), lane = key: slice w's four chains over its CPS chunks,
        // (a0 + a1) + (a2 + a3), the slices added left to right, as the slice-parallel scores do
        const float* kr = ks + (st * kSegTile + lane) * L::kKst;
#pragma unroll
        for (int qi = 0; qi < kSoftQ; ++qi) lane_s[qi] = 0.0f;
#pragma unroll 1
        for (int w = 0; w < 8; ++w) {
          float acc4[kSoftQ][4];
#pragma unroll
          for (int qi = 0; qi < kSoftQ; ++qi) acc4[qi][0] = acc4[qi][1] = acc4[qi][2] = acc4[qi][3] = 0.0f;
#pragma unroll
          for (int c = 0; c < CPS; ++c) {
            const float4 kk = *reinterpret_cast<const float4*>(kr + (w * CPS + c) * 4);
#pragma unroll
            for (int qi = 0; qi < kSoftQ; ++qi) {
              const int q = warp + 8 * qi;
              if (q >= nq) continue;  // uniform in the warp
              const float4 qq = *reinterpret_cast<const float4*>(qs + q * L::kDp + (w * CPS + c) * 4);
              acc4[qi][0] = __fmaf_rn(qq.x, kk.x, acc4[qi][0]);
              acc4[qi][1] = __fmaf_rn(qq.y, kk.y, acc4[qi][1]);
              acc4[qi][2] = __fmaf_rn(qq.z, kk.z, acc4[qi][2]);
              acc4[qi][3] = __fmaf_rn(qq.w, kk.w, acc4[qi][3]);
            }
          }
#pragma unroll
          for (int qi = 0; qi < kSoftQ; ++qi) {
            const float part = __fadd_rn(__fadd_rn(acc4[qi][0], acc4[qi][1]), __fadd_rn(acc4[qi][2], acc4[qi][3]));
            lane_s[qi] = w == 0 ? part : __fadd_rn(lane_s[qi], part);
          }
        }
      } else {  // warp = slice, lane = key; the slice partials of every query, two at a time
        const float* kr = ks + (st * kSegTile + lane) * L::kKst + warp * CPS * 4;
        float4 kk[CPS];
#pragma unroll
        for (int c = 0; c < CPS; ++c) kk[c] = *reinterpret_cast<const float4*>(kr + 4 * c);
        for (int q = 0; q < nq; q += 2) {
          const int q2 = q + 1 < nq ? q + 1 : q;  // an odd last query computes itself twice
          const float* qr = qs + q * L::kDp + warp * CPS * 4;
          const float* qr2 = qs + q2 * L::kDp + warp * CPS * 4;
          float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f, b0 = 0.0f, b1 = 0.0f, b2 = 0.0f, b3 = 0.0f;
#pragma unroll
          for (int c = 0; c < CPS; ++c) {
            const float4 qq = *reinterpret_cast<const float4*>(qr + 4 * c);
            const float4 qq2 = *reinterpret_cast<const float4*>(qr2 + 4 * c);
            a0 = __fmaf_rn(qq.x, kk[c].x, a0);
            a1 = __fmaf_rn(qq.y, kk[c].y, a1);
            a2 = __fmaf_rn(qq.z, kk[c].z, a2);
            a3 = __fmaf_rn(qq.w, kk[c].w, a3);
            b0 = __fmaf_rn(qq2.x, kk[c].x, b0);
            b1 = __fmaf_rn(qq2.y, kk[c].y, b1);
            b2 = __fmaf_rn(qq2.z, kk[c].z, b2);
            b3 = __fmaf_rn(qq2.w, kk[c].w, b3);
          }
          sp[(q * 8 + warp) * 33 + lane] = __fadd_rn(__fadd_rn(a0, a1), __fadd_rn(a2, a3));
          sp[(q2 * 8 + warp) * 33 + lane] = __fadd_rn(__fadd_rn(b0, b1), __fadd_rn(b2, b3));
        }
        __syncthreads();
      }

      // ---- softmax: warp per query (warp, warp + 8, ...), lane = key
#pragma unroll
      for (int qi = 0; qi < kSoftQ; ++qi) {
        const int q = warp + 8 * qi;
        if (q >= nq) break;
        int ka, kb;
        query_keys(q, ka, kb);
        const int key = t * kSegTile + lane;
        const bool valid = key >= ka && key < kb;
        float s;
        if constexpr (kLane) {
          s = lane_s[qi];
        } else {
          s = sp[(q * 8) * 33 + lane];
#pragma unroll
          for (int w = 1; w < 8; ++w) s = __fadd_rn(s, sp[(q * 8 + w) * 33 + lane]);
        }
        s = valid ? __fmul_rn(s, a.scale) : -INFINITY;
        const float tmax = warp_max(s);
        if (tmax == -INFINITY) {  // no key of this row in the tile: state unchanged
          if (lane == 0) upd_s[q] = 0;
          continue;
        }
        const float mn = fmaxf(m_run[qi], tmax);
        const float c = expf(m_run[qi] - mn);
        const float p = valid ? expf(s - mn) : 0.0f;
        const float sum = warp_sum(p);
        l_run[qi] = __fadd_rn(__fmul_rn(l_run[qi], c), sum);
        m_run[qi] = mn;
        ps[lane * L::kPst + q] = p;
        if (lane == 0) {
          upd_s[q] = 1;
          corr[q] = c;
          ja_s[q] = max(ka - t * kSegTile, 0);
          jb_s[q] = min(kb - t * kSegTile, kSegTile);
        }
      }
      if constexpr (kLane) {
        __syncthreads();  // every warp is done with K(t): its buffer takes K(t + 1)
        if (t + 1 < tb) load_tile(t + 1, 0, 1);
        cp_async_commit();
        cp_async_wait<1>();  // V(t) has landed (K(t + 1) may not have)
      }
      __syncthreads();

      // ---- P.V: chunk pv_c of the group's QG queries; one V read and one p load per key. Keys that every
      // updated query of the group takes run without predicates, the rest with one per query (a key
      // outside a row's range is skipped, never multiplied by 0: the cache there may hold anything)
      const auto pv_tile = [&](auto qg_c) {
        constexpr int QG = decltype(qg_c)::value;
        int ja[QG], jb[QG];
        int jlo = kSegTile, jhi = 0, ia = 0, ib = kSegTile;
#pragma unroll
        for (int i = 0; i < QG; ++i) {
          const int q = QG * pv_g + i;
          ja[i] = jb[i] = 0;
          if (q < nq && upd_s[q]) {
            const float c = corr[q];
            acc[i].x = __fmul_rn(acc[i].x, c);
            acc[i].y = __fmul_rn(acc[i].y, c);
            acc[i].z = __fmul_rn(acc[i].z, c);
            acc[i].w = __fmul_rn(acc[i].w, c);
            ja[i] = ja_s[q];
            jb[i] = jb_s[q];
            jlo = min(jlo, ja[i]);
            jhi = max(jhi, jb[i]);
          }
          ia = max(ia, ja[i]);
          ib = min(ib, jb[i]);
        }
        if (ib < ia) ib = ia;
        const float* vcol = vs + st * kSegTile * L::kVst + 4 * pv_c;
        const float* pcol = ps + QG * pv_g;
        const auto step = [&](int j, bool all) {
          const float4 vv = *reinterpret_cast<const float4*>(vcol + j * L::kVst);
          float pp[QG];
          if constexpr (QG == 8) {
            const float4 p4 = *reinterpret_cast<const float4*>(pcol + j * L::kPst);
            const float4 p8 = *reinterpret_cast<const float4*>(pcol + j * L::kPst + 4);
            pp[0] = p4.x, pp[1] = p4.y, pp[2] = p4.z, pp[3] = p4.w;
            pp[4] = p8.x, pp[5] = p8.y, pp[6] = p8.z, pp[7] = p8.w;
          } else if constexpr (QG == 6) {  // 6 pv_g floats: 8-byte aligned
            const float2 p0 = *reinterpret_cast<const float2*>(pcol + j * L::kPst);
            const float2 p1 = *reinterpret_cast<const float2*>(pcol + j * L::kPst + 2);
            const float2 p2 = *reinterpret_cast<const float2*>(pcol + j * L::kPst + 4);
            pp[0] = p0.x, pp[1] = p0.y, pp[2] = p1.x, pp[3] = p1.y, pp[4] = p2.x, pp[5] = p2.y;
          } else if constexpr (QG == 4) {
            const float4 p4 = *reinterpret_cast<const float4*>(pcol + j * L::kPst);
            pp[0] = p4.x, pp[1] = p4.y, pp[2] = p4.z, pp[3] = p4.w;
          } else if constexpr (QG == 2) {
            const float2 p2 = *reinterpret_cast<const float2*>(pcol + j * L::kPst);
            pp[0] = p2.x, pp[1] = p2.y;
          } else {
            pp[0] = pcol[j * L::kPst];
          }
#pragma unroll
          for (int i = 0; i < QG; ++i) {
            if (!all && (j < ja[i] || j >= jb[i])) continue;
            acc[i].x = __fmaf_rn(pp[i], vv.x, acc[i].x);
            acc[i].y = __fmaf_rn(pp[i], vv.y, acc[i].y);
            acc[i].z = __fmaf_rn(pp[i], vv.z, acc[i].z);
            acc[i].w = __fmaf_rn(pp[i], vv.w, acc[i].w);
          }
        };
        for (int j = jlo; j < ia; ++j) step(j, false);
#pragma unroll 4
        for (int j = ia; j < ib; ++j) step(j, true);
        for (int j = max(ib, jlo); j < jhi; ++j) step(j, false);
      };
      if constexpr (kQG > 0) {
        if (pv_on) pv_tile(std::integral_constant<int, kQG>{});
      } else if (pv_on) {
        if (qg == 1)
          pv_tile(std::integral_constant<int, 1>{});
        else if (qg == 2)
          pv_tile(std::integral_constant<int, 2>{});
        else if (kMaxQg == 4 || qg == 4)
          pv_tile(std::integral_constant<int, 4>{});
        else if constexpr (kMaxQg == 8) {
          if (kLane && qg == 6)
            pv_tile(std::integral_constant<int, 6>{});
          else
            pv_tile(std::integral_constant<int, 8>{});
        }
      }
      __syncthreads();  // the next tile's (or item's) copies overwrite what was read here
      if constexpr (kLane) {
        if (t + 1 < tb) load_tile(t + 1, 0, 2);
        cp_async_commit();
      }
    }
    if constexpr (kLane) cp_async_wait<0>();  // no copy of this item lands in the next item's buffers

    // ---- partials of the rows with keys in this segment
#pragma unroll
    for (int qi = 0; qi < kSoftQ; ++qi) {
      const int q = warp + 8 * qi;
      if (q >= nq || lane != 0) continue;
      int ka, kb;
      query_keys(q, ka, kb);
      if (ka >= kb) continue;
      const int64_t idx = ((m0 + q / hc) * a.n_heads + h0 + q % hc) * kSegs + z;
      a.part_ml[2 * idx] = m_run[qi];
      a.part_ml[2 * idx + 1] = l_run[qi];
    }
    if (pv_on)
#pragma unroll
      for (int i = 0; i < kMaxQg; ++i) {
        const int q = qg * pv_g + i;
        if (i >= qg || q >= nq) continue;
        int ka, kb;
        query_keys(q, ka, kb);
        if (ka >= kb) continue;
        const int64_t idx = ((m0 + q / hc) * a.n_heads + h0 + q % hc) * kSegs + z;
        *reinterpret_cast<float4*>(a.part_acc + idx * a.D + 4 * pv_c) = acc[i];
      }
  }
}

// ---- variant 2: scores and P . V on the tensor cores (3xTF32) ----------------------------------------
//
// Why. The 8-row verify's lane-score kernel at 32768 keys spends 366 us per layer against the one-row
// decode's 102 us for the same K / V read: it is bound by its fp32 FMA and shared-memory instructions
// (5.8x the one-row kernel's, S25-9), not by the read. Here both products run on mma.m16n8k8 tf32 with
// each operand split into tf32 hi + lo parts (split_tf32; three mma per product: lo . hi, hi . lo,
// hi . hi), which keeps fp32-like accuracy (the attention bound against the CPU is 1e-10 NMSE) with 0.37x
// the instructions (ncu, 8 rows at 32768 keys: 80 M against 214 M) and 279 vs 367 us there, 49 vs 60 us
// at 4096 keys (S26-2, S26-4).
//
// Arithmetic of one (row, head), a function of the row's range and its data only (every M, row group and
// n-tile position gives the same bits; an mma output element depends on its own row, column and
// accumulator only, and adding a product of p = 0 leaves an accumulator's bits alone):
//   * tiles and segments as above;
//   * score of (key, query): S^T = K . Q^T over the head dim cut into 8 slices of 8 KS dims (KS k-steps
//     of 8); per slice an accumulator from 0 over its k-steps in order, each k-step mma_3xtf32; the 8
//     slice sums added left to right; times scale;
//   * the online softmax per tile as above (p = 0 for keys outside the row's segment);
//   * O^T += V^T . P^T per tile: every output element's accumulator first times the row's corr (a tile
//     without the row's keys: corr 1, p 0), then the tile's 4 k-steps of 8 keys in order, mma_3xtf32 each;
//   * the merge as above.
// Keys of a tile outside the item's union [kmin, kmax) have V zeroed in shared memory (a p of 0 times
// stale shared memory could be NaN); their K rows are stale, their scores masked.
//
// Work layout: 8 warps; warp w owns the dims [8 KS w, 8 KS (w + 1)): the score slice w (2 m-tiles of 16
// keys x nt n-tiles of 8 queries, partials through shared memory: the K stage just read holds them after
// a barrier) and the P . V rows of those dims (KS / 2 m-tiles of 16 dims x nt n-tiles, accumulators in
// registers across the segment's tiles). Q^T's fragments of the warp's slice stay in registers for the
// whole item. K and V of two tiles in flight. Shared rows are padded so that every fragment read and
// partial store is conflict-free: K rows D + 4 floats (lanes read key g, dim t), V rows D + 8 (key t,
// dim g), score and p rows 36 (query 2t / g, key g / t). 138 KB of shared memory at head dim 256: one CTA
// per SM. Measured and not kept (S26-2, S26-3): a third K / V stage (the same times), 16 warps with Q^T
// read from shared memory per tile (slower: 316 vs 279 us at 32768 keys, 8 rows).
//
// Where it runs: head dim 256 (the 27B target). At 128 (the 27B drafter's block) the FMA kernel is faster
// (S26-2: 50 vs 60 us at 4096 keys), so the rule keeps it there; variant 2 forces this kernel at 128 too.
constexpr int kMmaNt = kSegMaxQ / 8;  // n-tiles of 8 queries per item, at most

template <int KS>
struct MmaSmem {
  static constexpr int kD = 64 * KS;
  static constexpr int kKst = kD + 4;
  static constexpr int kVst = kD + 8;
  static constexpr int kSst = 36;
  static constexpr int kSpFloats = 8 * kSegMaxQ * kSst;      // slice partials [8][kSegMaxQ][kSst]
  // the partials go in the K stage just read (after a barrier) where they fit (head dim 256)
  static constexpr bool kSpInK = kSpFloats <= kSegTile * kKst;
  static constexpr int kK = 0;                                // [2][kSegTile][kKst]
  static constexpr int kV = kK + 2 * kSegTile * kKst;         // [2][kSegTile][kVst]
  static constexpr int kSp = kV + 2 * kSegTile * kVst;        // (unless kSpInK)
  static constexpr int kP = kSp + (kSpInK ? 0 : kSpFloats);   // p [kSegMaxQ][kSst]
  static constexpr int kCorr = kP + kSegMaxQ * kSst;          // corr [kSegMaxQ]
  static constexpr int kInts = kCorr + kSegMaxQ;              // ints: upd [kSegMaxQ]; ranges [2 kSegMaxM]
  static constexpr int kFloats = kInts + kSegMaxQ + 2 * kSegMaxM;
  static constexpr size_t kBytes = sizeof(float) * kFloats;
};

template <int KS>
__global__ void __launch_bounds__(kSegThreads, 1) attention_segment_mma_kernel(const SegArgs a) {
  static_assert(KS % 2 == 0, "P . V m-tiles of 16 dims per warp");
  using L = MmaSmem<KS>;
  constexpr int kD = L::kD;
  constexpr int kPvT = KS / 2;  // P . V m-tiles per warp
  extern __shared__ __align__(16) float sm[];
  float* ks = sm + L::kK;
  float* vs = sm + L::kV;
  float* ps = sm + L::kP;
  float* corr = sm + L::kCorr;
  int* upd_s = reinterpret_cast<int*>(sm + L::kInts);
  int* rng = upd_s + kSegMaxQ;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  const int d0 = 8 * KS * warp;  // the warp's dims
  pdl_wait();
  for (int i = tid; i < 2 * a.M; i += kSegThreads) rng[i] = a.kv_range[i];
  __syncthreads();

  const int row_groups = static_cast<int>((a.M + a.rows - 1) / a.rows);
  const int kv_items = static_cast<int>(a.n_heads / a.group) * a.hchunks;
  const int items = row_groups * kSegs * kv_items;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int rg = item % row_groups, rest = item / row_groups;
    const int kvi = rest % kv_items, z = rest / kv_items;
    const int kvh = kvi / a.hchunks, hchunk = kvi % a.hchunks;
    const int h0 = kvh * a.group + hchunk * a.hc;
    const int hc = min(a.hc, a.group - hchunk * a.hc);
    const int m0 = rg * a.rows;
    const int rows = min(a.rows, static_cast<int>(a.M) - m0);
    const int nq = rows * hc, nt = (nq + 7) / 8;
    int kmin = 0x7fffffff, kmax = 0;
    for (int r = 0; r < rows; ++r) {
      int ka, kb;
      segment_keys(rng[2 * (m0 + r)], rng[2 * (m0 + r) + 1], z, ka, kb);
      if (ka < kb) {
        kmin = min(kmin, ka);
        kmax = max(kmax, kb);
      }
    }
    if (kmin >= kmax) continue;
    const int ta = kmin / kSegTile, tb = (kmax + kSegTile - 1) / kSegTile;

    const float* kbase = a.k + static_cast<int64_t>(kvh) * kD;
    const float* vbase = a.v + static_cast<int64_t>(kvh) * kD;
    auto load_tile = [&](int t, int st) {  // warp per key, lane per chunk; V outside [kmin, kmax) zeroed
      const int k0 = max(t * kSegTile, kmin), k1 = min(t * kSegTile + kSegTile, kmax);
      for (int j = warp; j < kSegTile; j += kSegThreads / 32) {
        const int key = t * kSegTile + j;
        float* kd = ks + (st * kSegTile + j) * L::kKst;
        float* vd = vs + (st * kSegTile + j) * L::kVst;
        if (key >= k0 && key < k1) {
          const float* kg = kbase + key * a.kv_stride;
          const float* vg = vbase + key * a.kv_stride;
#pragma unroll
          for (int c = lane; c < kD / 4; c += 32) {
            cp_async16(kd + 4 * c, kg + 4 * c);
            cp_async16(vd + 4 * c, vg + 4 * c);
          }
        } else {
#pragma unroll
          for (int c = lane; c < kD / 4; c += 32)
            *reinterpret_cast<float4*>(vd + 4 * c) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
      }
    };
    auto query_keys = [&](int q, int& ka, int& kb) {
      const int r = m0 + q / hc;
      segment_keys(rng[2 * r], rng[2 * r + 1], z, ka, kb);
    };
    load_tile(ta, 0);
    cp_async_commit();

    // Q^T fragments of the warp's slice (B of the scores): query 8 j + g, dims d0 + 8 s + t4 and + 4
    uint32_t qh[KS][kMmaNt][2], ql[KS][kMmaNt][2];
#pragma unroll
    for (int j = 0; j < kMmaNt; ++j) {
      const int q = 8 * j + g;
      const float* qr = nullptr;
      if (q < nq) qr = a.q + ((static_cast<int64_t>(m0) + q / hc) * a.n_heads + h0 + q % hc) * kD + d0 + t4;
#pragma unroll
      for (int s = 0; s < KS; ++s) {
        split_tf32(qr ? qr[8 * s] : 0.0f, qh[s][j][0], ql[s][j][0]);
        split_tf32(qr ? qr[8 * s + 4] : 0.0f, qh[s][j][1], ql[s][j][1]);
      }
    }
    // p rows of the padding queries [nq, 8 nt) stay 0 for the item (the softmax writes rows < nq only)
    for (int i = tid; i < (8 * nt - nq) * kSegTile; i += kSegThreads) ps[(nq + i / kSegTile) * L::kSst + i % kSegTile] = 0.0f;

    float m_run[kSoftQ], l_run[kSoftQ];
#pragma unroll
    for (int i = 0; i < kSoftQ; ++i) m_run[i] = -INFINITY, l_run[i] = 0.0f;
    float acc[kPvT][kMmaNt][4];  // O^T: dims d0 + 16 i + g (+ 8), queries 8 j + 2 t4 (+ 1)
#pragma unroll
    for (int i = 0; i < kPvT; ++i)
#pragma unroll
      for (int j = 0; j < kMmaNt; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;

    for (int t = ta; t < tb; ++t) {
      const int st = (t - ta) & 1;
      if (t + 1 < tb) load_tile(t + 1, st ^ 1);
      cp_async_commit();
      cp_async_wait<1>();  // tile t has landed
      __syncthreads();
      float* sp = L::kSpInK ? ks + st * kSegTile * L::kKst : sm + L::kSp;

      // ---- scores: slice `warp` of S^T = K . Q^T for keys 16 mt + g (+ 8), queries 8 j + 2 t4 (+ 1)
      {
        float sc[2][kMmaNt][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int j = 0; j < kMmaNt; ++j) sc[mt][j][0] = sc[mt][j][1] = sc[mt][j][2] = sc[mt][j][3] = 0.0f;
        const float* kb = ks + (st * kSegTile + g) * L::kKst + d0 + t4;
#pragma unroll
        for (int s = 0; s < KS; ++s)
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            const float* kr = kb + 16 * mt * L::kKst + 8 * s;
            uint32_t ah[4], al[4];
            split_tf32(kr[0], ah[0], al[0]);
            split_tf32(kr[8 * L::kKst], ah[1], al[1]);
            split_tf32(kr[4], ah[2], al[2]);
            split_tf32(kr[8 * L::kKst + 4], ah[3], al[3]);
#pragma unroll
            for (int j = 0; j < kMmaNt; ++j)
              if (j < nt) mma_3xtf32(sc[mt][j], ah, al, qh[s][j], ql[s][j]);
          }
        if (L::kSpInK) __syncthreads();  // every warp is done with K(t): the partials overwrite it
        float* spw = sp + warp * kSegMaxQ * L::kSst;
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int j = 0; j < kMmaNt; ++j) {
            if (j >= nt) continue;
            float* o = spw + (8 * j + 2 * t4) * L::kSst + 16 * mt + g;
            o[0] = sc[mt][j][0];
            o[L::kSst] = sc[mt][j][1];
            o[8] = sc[mt][j][2];
            o[L::kSst + 8] = sc[mt][j][3];
          }
      }
      __syncthreads();

      // ---- softmax: warp per query (warp, warp + 8, ...), lane = key
#pragma unroll
      for (int qi = 0; qi < kSoftQ; ++qi) {
        const int q = warp + 8 * qi;
        if (q >= nq) break;
        int ka, kb;
        query_keys(q, ka, kb);
        const int key = t * kSegTile + lane;
        const bool valid = key >= ka && key < kb;
        float s = sp[q * L::kSst + lane];
#pragma unroll
        for (int w = 1; w < 8; ++w) s = __fadd_rn(s, sp[(w * kSegMaxQ + q) * L::kSst + lane]);
        s = valid ? __fmul_rn(s, a.scale) : -INFINITY;
        const float tmax = warp_max(s);
        if (tmax == -INFINITY) {  // no key of this row in the tile: p = 0, the state unchanged
          ps[q * L::kSst + lane] = 0.0f;
          if (lane == 0) upd_s[q] = 0;
          continue;
        }
        const float mn = fmaxf(m_run[qi], tmax);
        const float c = expf(m_run[qi] - mn);
        const float p = valid ? expf(s - mn) : 0.0f;
        const float sum = warp_sum(p);
        l_run[qi] = __fadd_rn(__fmul_rn(l_run[qi], c), sum);
        m_run[qi] = mn;
        ps[q * L::kSst + lane] = p;
        if (lane == 0) {
          upd_s[q] = 1;
          corr[q] = c;
        }
      }
      __syncthreads();

      // ---- P . V: O^T += V^T . P^T for the warp's dims
      {
#pragma unroll
        for (int j = 0; j < kMmaNt; ++j) {
          if (j >= nt) continue;
          const int q = 8 * j + 2 * t4;
          const float c0 = q < nq && upd_s[q] ? corr[q] : 1.0f;
          const float c1 = q + 1 < nq && upd_s[q + 1] ? corr[q + 1] : 1.0f;
#pragma unroll
          for (int i = 0; i < kPvT; ++i) {
            acc[i][j][0] = __fmul_rn(acc[i][j][0], c0);
            acc[i][j][1] = __fmul_rn(acc[i][j][1], c1);
            acc[i][j][2] = __fmul_rn(acc[i][j][2], c0);
            acc[i][j][3] = __fmul_rn(acc[i][j][3], c1);
          }
        }
        const float* vb = vs + (st * kSegTile + t4) * L::kVst + d0 + g;
#pragma unroll
        for (int s = 0; s < kSegTile / 8; ++s) {
          uint32_t bh[kMmaNt][2], bl[kMmaNt][2];  // P^T: key 8 s + t4 (+ 4), query 8 j + g
#pragma unroll
          for (int j = 0; j < kMmaNt; ++j) {
            if (j >= nt) continue;
            const float* pr = ps + (8 * j + g) * L::kSst + 8 * s + t4;
            split_tf32(pr[0], bh[j][0], bl[j][0]);
            split_tf32(pr[4], bh[j][1], bl[j][1]);
          }
#pragma unroll
          for (int i = 0; i < kPvT; ++i) {
            const float* vr = vb + 8 * s * L::kVst + 16 * i;  // V^T: dim g (+ 8), key t4 (+ 4)
            uint32_t ah[4], al[4];
            split_tf32(vr[0], ah[0], al[0]);
            split_tf32(vr[8], ah[1], al[1]);
            split_tf32(vr[4 * L::kVst], ah[2], al[2]);
            split_tf32(vr[4 * L::kVst + 8], ah[3], al[3]);
#pragma unroll
            for (int j = 0; j < kMmaNt; ++j)
              if (j < nt) mma_3xtf32(acc[i][j], ah, al, bh[j], bl[j]);
          }
        }
      }
      __syncthreads();  // the next tile's copies (and the next item's p padding) overwrite what was read here
    }

    // ---- partials of the rows with keys in this segment
#pragma unroll
    for (int qi = 0; qi < kSoftQ; ++qi) {
      const int q = warp + 8 * qi;
      if (q >= nq || lane != 0) continue;
      int ka, kb;
      query_keys(q, ka, kb);
      if (ka >= kb) continue;
      const int64_t idx = ((m0 + q / hc) * a.n_heads + h0 + q % hc) * kSegs + z;
      a.part_ml[2 * idx] = m_run[qi];
      a.part_ml[2 * idx + 1] = l_run[qi];
    }
#pragma unroll
    for (int j = 0; j < kMmaNt; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int q = 8 * j + 2 * t4 + e;
        if (j >= nt || q >= nq) continue;
        int ka, kb;
        query_keys(q, ka, kb);
        if (ka >= kb) continue;
        float* o = a.part_acc + (((m0 + q / hc) * a.n_heads + h0 + q % hc) * kSegs + z) * kD + d0 + g;
#pragma unroll
        for (int i = 0; i < kPvT; ++i) {
          o[16 * i] = acc[i][j][e];
          o[16 * i + 8] = acc[i][j][e + 2];
        }
      }
  }
}

// The merged output of (row m, head h), float4 chunk c of the head dim. Every lane of the warp calls it
// (shuffles); lanes past the head dim pass active = false and get zeros. Each lane reads the row's (m, l)
// pairs one per lane (<= 32 segments), so the max is a butterfly and the weights are computed once per
// lane; the folds over the segments run in segment order. The row's range, the lane's (m, l) slot and
// segment 0's partial are requested together, before the segment count is known (the slots exist for
// all kSegs segments; those of empty segments are never used): one global round trip instead of three.
__device__ __forceinline__ float4 merge_chunk(const SegArgs& a, int h, int64_t m, int c, int lane, bool active) {
  const int64_t base = (m * a.n_heads + h) * kSegs;
  const int lo = a.kv_range[2 * m], hi = a.kv_range[2 * m + 1];
  const float2 ml_slot = reinterpret_cast<const float2*>(a.part_ml)[base + lane];
  const float4* acc = reinterpret_cast<const float4*>(a.part_acc + base * a.D) + c;
  const float4 acc0 = active ? acc[0] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const int nz = segment_count(lo, hi);
  float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (nz == 0) return o;
  const float2 ml = lane < nz ? ml_slot : make_float2(-INFINITY, 0.0f);
  const float mx = warp_max(ml.x);
  const float w = lane < nz ? expf(ml.x - mx) : 0.0f;
  float tot = 0.0f;
  const int stride = a.d4;  // float4s between segments
#pragma unroll 8
  for (int zz = 0; zz < nz; ++zz) {
    const float wz = __shfl_sync(0xffffffffu, w, zz), lz = __shfl_sync(0xffffffffu, ml.y, zz);
    tot = __fmaf_rn(lz, wz, tot);
    if (active) {
      const float4 v = zz == 0 ? acc0 : acc[zz * stride];
      o.x = __fmaf_rn(v.x, wz, o.x);
      o.y = __fmaf_rn(v.y, wz, o.y);
      o.z = __fmaf_rn(v.z, wz, o.z);
      o.w = __fmaf_rn(v.w, wz, o.w);
    }
  }
  if (!active) return o;
  const float inv = __fdiv_rn(1.0f, tot);
  return make_float4(__fmul_rn(o.x, inv), __fmul_rn(o.y, inv), __fmul_rn(o.z, inv), __fmul_rn(o.w, inv));
}

// One CTA per (head, row), one thread per float4 chunk of the head dim (rounded up to whole warps).
__global__ void attention_segment_merge_kernel(const SegArgs a) {
  pdl_wait();
  const int c = threadIdx.x;
  const float4 o = merge_chunk(a, blockIdx.x, blockIdx.y, c, threadIdx.x & 31, c < a.d4);
  const int64_t head = static_cast<int64_t>(blockIdx.y) * a.n_heads + blockIdx.x;  // (row, head)
  if (c < a.d4) reinterpret_cast<float4*>(a.out + head * a.D)[c] = o;
}

// The gated attention output after the merge (Backend::attention_gate_rotate): y = out * sigmoid(gate),
// rotated and quantized for wo (chunk_rotation.cuh).
struct GateOut {
  const float* gate;   // [M][n_heads * D]
  const float* signs;  // null or [n_heads * D]
  float* y;            // [M][n_heads * D]
  bool rotate;
  bool keep_out;       // also store the merged attention output in a.out (when y is another buffer)
  uint8_t* xq;         // records of y (xq_record.cuh), null: none
  int32_t* meta;
};

// The merge, the sigmoid gate, the rotation and the quantization of one 1024-chunk of a row (4 or 8
// whole heads: head dims 256 or 128, so each warp's 32 float4 chunks belong to one head, as in the merge
// kernel): one kernel boundary less than the merge kernel + chain_kernel<3>, with their bits (the same
// merge_chunk, the same gate expression, the same chunk_rotate).
__global__ void __launch_bounds__(kChainThreads) attention_merge_gate_kernel(const SegArgs a, const GateOut g) {
  __shared__ __align__(16) float buf[kChainChunk];
  const int tid = threadIdx.x, lane = tid & 31;
  const int64_t m = blockIdx.y;
  const int64_t dim = a.n_heads * a.D;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kChainChunk;
  const int e = static_cast<int>(c0) + 4 * tid;  // this thread's first element of the row
  float sg[4] = {1.0f, 1.0f, 1.0f, 1.0f};
  if (g.rotate && g.signs) ld4(g.signs + e, sg);
  pdl_wait();
  float z[4];
  ld4(g.gate + m * dim + e, z);  // in flight with the merge's loads
  const float4 o = merge_chunk(a, e / a.D, m, (e % a.D) / 4, lane, true);
  if (g.keep_out) *reinterpret_cast<float4*>(a.out + m * dim + e) = o;
  float v[4] = {o.x * sigmoid_f(z[0]), o.y * sigmoid_f(z[1]), o.z * sigmoid_f(z[2]), o.w * sigmoid_f(z[3])};
  if (g.rotate) chunk_rotate(v, sg, g.signs != nullptr, buf, tid, lane);
  chunk_store_quantize(v, g.rotate, g.y + m * dim + c0, g.xq, g.meta, m, c0, gridDim.y, tid, lane);
}

// The segment kernel's variant forced by set_attention_segment_variant() (tests), else by
// DFLASH_CUDA_ATTN_VARIANT=0/1 (measurements); -1: launch_attention_segments' rule. The bits are the same.
int g_variant_override = -1;
int attn_variant_forced() {
  static const int v = std::clamp(env_int("DFLASH_CUDA_ATTN_VARIANT", -1), -1, 2);
  return g_variant_override >= 0 ? g_variant_override : v;
}

// CTAs per SM of the segment kernel with CPS chunks per slice (its shared memory decides), once.
template <int CPS, int kVar, int kQG>
int segment_ctas_per_sm() {
  using L = SegLayout<CPS, kVar>;
  static const int n = [] {
    if (cudaFuncSetAttribute(attention_segment_kernel<CPS, kVar, kQG>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(L::kBytes)) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, attention_segment_kernel<CPS, kVar, kQG>, kSegThreads,
                                                      L::kBytes) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return per_sm;
  }();
  return n;
}

void launch_merge(const SegArgs& a, const GateOut* gate, cudaStream_t s);

// One launch of at most kSegMaxM rows: the segment kernel (at most `ctas` CTAs), then the merge (with
// gate: the merge and the gated output chain, attention_merge_gate_kernel).
template <int CPS, int kVar, int kQG>
void launch_segments_cps(const SegArgs& a, int64_t n_kv_heads, int ctas, const GateOut* gate, cudaStream_t s) {
  const int64_t items = (a.M + a.rows - 1) / a.rows * kSegs * n_kv_heads * a.hchunks;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(items, ctas));
  launch_pdl(attention_segment_kernel<CPS, kVar, kQG>, dim3(grid), dim3(kSegThreads), SegLayout<CPS, kVar>::kBytes, s,
             a);
  launch_merge(a, gate, s);
}

// CTAs per SM of the mma kernel (head dim 64 KS), once.
template <int KS>
int segment_mma_ctas_per_sm() {
  static const int n = [] {
    if (cudaFuncSetAttribute(attention_segment_mma_kernel<KS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(MmaSmem<KS>::kBytes)) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, attention_segment_mma_kernel<KS>, kSegThreads,
                                                      MmaSmem<KS>::kBytes) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return per_sm;
  }();
  return n;
}

template <int KS>
void launch_segments_mma(const SegArgs& a, int64_t n_kv_heads, int ctas, const GateOut* gate, cudaStream_t s) {
  const int64_t items = (a.M + a.rows - 1) / a.rows * kSegs * n_kv_heads * a.hchunks;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(items, ctas));
  launch_pdl(attention_segment_mma_kernel<KS>, dim3(grid), dim3(kSegThreads), MmaSmem<KS>::kBytes, s, a);
  launch_merge(a, gate, s);
}

// The merge after a segment kernel (with gate: the merge and the gated output chain).
void launch_merge(const SegArgs& a, const GateOut* gate, cudaStream_t s) {
  if (gate) {
    launch_pdl(attention_merge_gate_kernel,
               dim3(static_cast<unsigned>(a.n_heads * a.D / kChainChunk), static_cast<unsigned>(a.M)),
               dim3(kChainThreads), 0, s, a, *gate);
    return;
  }
  const unsigned mt = static_cast<unsigned>((a.d4 + 31) / 32 * 32);
  launch_pdl(attention_segment_merge_kernel, dim3(static_cast<unsigned>(a.n_heads), static_cast<unsigned>(a.M)),
             dim3(mt), 0, s, a);
}

}  // namespace

// Declared in cuda_backend.h (C++20, not for nvcc).
void set_attention_segment_variant(int v) { g_variant_override = v >= 0 && v <= 2 ? v : -1; }

size_t attention_segments_scratch_floats(int64_t M, int64_t n_heads, int64_t head_dim) {
  return static_cast<size_t>(std::min<int64_t>(M, kSegMaxM)) * n_heads * kSegs * (head_dim + 2);
}

bool attention_segments_enabled() {
  static const bool v = env_flag("DFLASH_CUDA_ATTN_SEGMENTS", true);
  return v;
}

bool attention_segments_supported(int64_t head_dim) {
  return head_dim % 4 == 0 && head_dim <= kSegMaxHeadDim;
}

namespace {

// launch_attention_segments, with gate: the gated output chain in place of the merge (one launch of at
// most kSegMaxM rows; the caller checked attention_gate_fusable).
bool launch_segments(const float* q, const float* k, const float* v, const int32_t* kv_range, float* out, int64_t M,
                     int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale, float* scratch,
                     const GateOut* gate, cudaStream_t s) {
  if (!attention_segments_supported(head_dim) || n_heads > 65535) return false;
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (!aligned(q) || !aligned(k) || !aligned(v) || !aligned(out) || !aligned(scratch)) return false;
  SegArgs a{};
  a.q = q;
  a.k = k;
  a.v = v;
  a.kv_range = kv_range;
  a.out = out;
  a.M = M;
  a.n_heads = n_heads;
  a.kv_stride = n_kv_heads * head_dim;
  a.D = static_cast<int>(head_dim);
  a.d4 = a.D / 4;
  a.group = static_cast<int>(n_heads / n_kv_heads);
  a.hchunks = (a.group + kSegMaxQ - 1) / kSegMaxQ;
  a.hc = (a.group + a.hchunks - 1) / a.hchunks;
  // Rows per item: as many as fill kSegMaxQ queries (each K/V tile read serves them all), spread evenly.
  // Measured on the H200 (attention alone, M = 8): the drafter's 4 heads per KV head at 4 rows instead of
  // 2 took 68.9 -> 49.7 us at 4096 keys and 458 -> 321 at 32768 (S10-8); the 27B's 6 heads at 4 rows (24
  // queries) instead of 2 took 83.1 -> 66.2 us at 4096 keys and 546 -> 428 at 32768, tie at 576 keys,
  // and lose at 100 (12.2 -> 15.0 us: fewer CTAs for a short context; S10-12). DFLASH_CUDA_ATTN_ROWS=N
  // sets it (clamped; a layout switch for measurements: the bits do not change).
  static const int rows_env = env_int("DFLASH_CUDA_ATTN_ROWS", 0);
  const int most = std::min(std::max(1, kSegMaxQ / a.hc), kSegMaxRows);
  // the fewest row groups of at most `most` rows, the rows spread evenly over them
  const int64_t groups = (std::min<int64_t>(M, kSegMaxM) + most - 1) / most;
  const int even = static_cast<int>((std::min<int64_t>(M, kSegMaxM) + groups - 1) / groups);
  a.rows = std::clamp(rows_env > 0 ? rows_env : even, 1, most);
  a.part_ml = scratch;
  a.part_acc = scratch + 2 * static_cast<size_t>(std::min<int64_t>(M, kSegMaxM)) * n_heads * kSegs;
  a.scale = scale;
  const int cps = (a.d4 + 7) / 8;  // chunks per slice, rounded up to a power of two
  using Launch = void (*)(const SegArgs&, int64_t, int, const GateOut*, cudaStream_t);
  Launch launch = nullptr;
  int per_sm = 0;
  // The tensor-core kernel (variant 2) for head dim 256 (128 when forced), whatever M (its bits differ from
  // variants 0 and 1, so the choice may depend on the shape of a head and the device only: a verify row
  // keeps its decoded bits). A device whose CTA cannot hold its shared memory (per_sm 0) takes the FMA
  // kernels. DFLASH_CUDA_ATTN_MMA=0 keeps head dim 256 on them too (a switch for measurements).
  const int forced = attn_variant_forced();
  static const bool mma_default = env_flag("DFLASH_CUDA_ATTN_MMA", true);
  const bool mma_ok = a.D == 128 || a.D == 256;
  if ((forced == 2 && mma_ok) || (forced < 0 && mma_default && a.D == 256)) {
    if (a.D == 256) launch = launch_segments_mma<4>, per_sm = segment_mma_ctas_per_sm<4>();
    if (a.D == 128) launch = launch_segments_mma<2>, per_sm = segment_mma_ctas_per_sm<2>();
    if (per_sm < 1) launch = nullptr;
  }
  // lane scores where the scores of an item keep all 8 warps busy and the single buffers double the CTAs
  // per SM (head dims above 128; the measurements above attention_segment_kernel)
  const int variant = forced == 0 || forced == 1 ? forced : (cps == 8 && a.rows * a.hc >= 16 ? 1 : 0);
  // the P.V group of the launch's largest item: a kernel with only that loop for the shapes of the models
  // we run (27B decode, 27B verify, the 27B drafter's block), every loop otherwise
  const int qg = seg_query_group(a.d4, a.rows * a.hc, variant == 1, cps > 4 ? 8 : 4);
  const auto pick = [&](auto var_c) {
    constexpr int kVar = decltype(var_c)::value;
    if constexpr (kVar == 0) {
      if (cps > 4 && qg == 2) {
        launch = launch_segments_cps<8, 0, 2>, per_sm = segment_ctas_per_sm<8, 0, 2>();
        return;
      }
      if (cps > 2 && cps <= 4 && qg == 2) {
        launch = launch_segments_cps<4, 0, 2>, per_sm = segment_ctas_per_sm<4, 0, 2>();
        return;
      }
    } else if (cps > 4 && qg == 6) {
      launch = launch_segments_cps<8, 1, 6>, per_sm = segment_ctas_per_sm<8, 1, 6>();
      return;
    }
    if (cps <= 1) launch = launch_segments_cps<1, kVar, 0>, per_sm = segment_ctas_per_sm<1, kVar, 0>();
    else if (cps <= 2) launch = launch_segments_cps<2, kVar, 0>, per_sm = segment_ctas_per_sm<2, kVar, 0>();
    else if (cps <= 4) launch = launch_segments_cps<4, kVar, 0>, per_sm = segment_ctas_per_sm<4, kVar, 0>();
    else launch = launch_segments_cps<8, kVar, 0>, per_sm = segment_ctas_per_sm<8, kVar, 0>();
  };
  if (launch == nullptr) {
    if (variant == 1)
      pick(std::integral_constant<int, 1>{});
    else
      pick(std::integral_constant<int, 0>{});
  }
  const int ctas = per_sm * current_sm_count();
  if (ctas < 1) return false;
  // At most kSegMaxM rows per launch (the range table); the launches share the scratch in stream order.
  for (int64_t r0 = 0; r0 < M; r0 += kSegMaxM) {
    SegArgs part = a;
    part.M = std::min<int64_t>(kSegMaxM, M - r0);
    part.q = q + r0 * n_heads * head_dim;
    part.out = out + r0 * n_heads * head_dim;
    part.kv_range = kv_range + 2 * r0;
    launch(part, n_kv_heads, ctas, gate, s);
  }
  return true;
}

}  // namespace

bool launch_attention_segments(const float* q, const float* k, const float* v, const int32_t* kv_range, float* out,
                               int64_t M, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale,
                               float* scratch, cudaStream_t s) {
  return launch_segments(q, k, v, kv_range, out, M, n_heads, n_kv_heads, head_dim, scale, scratch, nullptr, s);
}

bool attention_gate_fusable(int64_t M, int64_t n_heads, int64_t head_dim) {
  return M >= 1 && M <= kSegMaxM && attention_segments_enabled() && attention_segments_supported(head_dim) &&
         head_dim % 128 == 0 && kChainChunk % head_dim == 0 && (n_heads * head_dim) % kChainChunk == 0 &&
         n_heads <= 65535;
}

bool launch_attention_gate_rotate(const float* q, const float* k, const float* v, const int32_t* kv_range, float* out,
                                  const float* gate, const float* signs, float* y, void* xq, int64_t M,
                                  int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale, float* scratch,
                                  bool rotate, cudaStream_t s) {
  if (!attention_gate_fusable(M, n_heads, head_dim)) return false;
  GateOut g{};
  g.gate = gate;
  g.signs = rotate ? signs : nullptr;
  g.y = y;
  g.rotate = rotate;
  g.keep_out = out != y;
  g.xq = static_cast<uint8_t*>(xq);
  g.meta = xq_meta(g.xq, M, n_heads * head_dim);
  return launch_segments(q, k, v, kv_range, out, M, n_heads, n_kv_heads, head_dim, scale, scratch, &g, s);
}

}  // namespace dflash::cuda
