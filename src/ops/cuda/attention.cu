// RoPE (NeoX) and softmax attention over a KV cache (decode and verify).
//
// Attention (cluster kernel). The arithmetic of one (row, head) is a function of the row's own range
// [lo, hi) and its data only, never of M, the other rows or which CTA does what:
//   * keys go in tiles of 32 aligned to absolute key positions (tile t = keys 32t .. 32t+31); the row's
//     tiles [lo/32, ceil(hi/32)) are cut into S segments of ceil(tiles / S) whole tiles (S = 16 where
//     16-CTA clusters run, else 8; fixed per device, never per call);
//   * a score is q . k over the head dim zero-padded to 8 slices of cps float4 chunks: per slice four
//     fma chains (one per float4 component, chunks in order) summed as (a0 + a1) + (a2 + a3), the slices
//     summed left to right, then times scale;
//   * per tile an online softmax: masked keys (outside the row's segment) score -inf, tile max by a
//     warp butterfly, corr = expf(old max - new max), p = expf(s - new max), sum by a warp butterfly,
//     l = l * corr + sum; acc = acc * corr, then acc = fma(p_j, v_j, acc) for the row's keys j of the
//     tile in order (keys outside the row's range are skipped, never multiplied by 0); a segment starts
//     from m = -inf, l = 0, acc = 0;
//   * the S segment partials (max, l, acc) are merged in segment order through distributed shared
//     memory: w_s = expf(m_s - max), tot = fma(l_s, w_s, tot), out = fold fma(acc_s, w_s) * (1 / tot).
// Work layout (free to depend on M): a cluster of S / spc CTAs (256 threads) per (kv head, chunk of <= 8
// of its query heads, row group); CTA c takes segments c spc .. c spc + spc - 1 (spc = 1 or 2) of every
// row of its group, streams the union of their tiles through shared memory (cp.async, up to 3 stages)
// and all the chunk's heads of all its rows read the tile there (GQA: K/V read once per cluster, not
// once per head; verify rows share the tiles: causal rows hi, hi + 1, ... have the same segments unless
// ceil(tiles / S) differs). With spc 2 a row's two segments are adjacent tiles of the one stream: at the
// second's first tile the row's state is stored as the first segment's partial and restarted.
//   decode layout (1 row): score slice w in warp w, lane = key, every head of the chunk per thread;
//   verify layout (<= 8 rows, <= 32 queries): each thread 3 queries x 1 key over all 8 slices (4 x 8 lanes
//   per warp). 8 rows let the 27B drafter's block (4 heads per KV head) take one cluster per KV head.
// Both compute the same per-score operations (the decode layout keeps slice sums in shared memory and
// folds them in the softmax warp), so a verify row equals the same row decoded alone, bit for bit.
// Why spc 2: clusters of 16 one-CTA-per-SM blocks are resident only 7 at a time on an H200 (a cluster
// needs 16 free SMs of one GPC; 8-CTA clusters: 15), so 8 clusters of 16 ran as two waves, each paying
// the whole fixed cost (ranges, queries, first tile's latency, merge). choose_layout estimates waves x
// CTA time over the layouts, head chunks, rows per CTA and spc (27B, S = 16: decode 4 clusters of 16 =
// 64 CTAs of 6 heads; verify 8 rows: 8 clusters of 8 CTAs x 2 segments, 4 rows x 6 heads = 64 CTAs, one
// wave). No scratch, no second kernel, no counters.
// Without clusters (never on Hopper) the older split + merge kernels run instead.
#include <cooperative_groups.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>

#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace dflash::cuda {
namespace {

namespace cg = cooperative_groups;

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

// ---- attention: cluster kernel ------------------------------------------------------------------------

constexpr int kTile = 32;      // keys per tile (one lane each in the softmax)
constexpr int kSlices = 8;     // score slices of the padded head dim
constexpr int kThreads = 256;  // 8 warps
constexpr int kWarps = kThreads / 32;
constexpr int kSStride = kTile + 1;  // score rows in shared memory
constexpr int kMaxSeg = 16;          // cluster size (non-portable; 8 where 16 does not fit)

struct Attn {
  const float* q;
  const float* k;
  const float* v;
  const int32_t* kv_range;
  float* out;
  int64_t M, n_heads, kv_stride;  // kv_stride = n_kv_heads * D floats between keys
  int D, d4, cps, d4p;            // d4 = ceil(D / 4) chunks; cps chunks per slice; d4p = 8 * cps
  int group, hc, hchunks;         // heads per KV head; heads per CTA (<= 8); CTAs over a group's heads
  int rows;                       // rows per CTA
  int nseg;                       // segments per row (S: 16, or 8 where 16-CTA clusters do not fit)
  int spc;                        // segments per CTA (1 or 2): the cluster has nseg / spc CTAs
  int nstage;                     // tile buffers (1..3)
  float scale;
  int vec;   // 16-byte copies (D % 4 == 0, 16-byte aligned k/v)
  int qvec;  // 16-byte query loads (D % 4 == 0, 16-byte aligned q)
  // shared memory layout, in floats from the base
  int kst, vst, qst;   // row strides of the K, V and Q tiles
  int stage_floats;    // one K tile + one V tile
  int nq_max;          // queries per CTA (partials)
  int off_q, off_s, off_p, off_corr, off_w, off_inv, off_rows;
  int off_pa0;  // spc 2: the first segment's partials (the second's lie over the tile buffers)
};

constexpr int kRI = 8;  // ints per row in the row table: ka, kb, ta, tb, tsp (first tile of the second segment)

// Per-layout constants. kQO heads of one row per PV item (their P/corr entries padded to kQOP floats),
// kIPT PV items per thread, kPst floats per P row, kSoft queries per warp in the softmax.
template <bool kVer>
struct AttnLayout;
template <>
struct AttnLayout<false> {  // decode: one row, <= 8 heads
  static constexpr int kRows = 1, kQO = 3, kQOP = 4, kIPT = 2, kSoft = 1, kPst = 12;
};
template <>
struct AttnLayout<true> {  // verify: <= 8 rows x <= 8 heads, <= 32 queries
  static constexpr int kRows = 8, kQO = 6, kQOP = 8, kIPT = 2, kSoft = 4, kNQMax = 32, kPst = 68;
  static constexpr int kQT = 3;                            // queries per thread in the scores
  static constexpr int kQPad = (kNQMax + 11) / 12 * 12;  // Q rows read by the 12-query warp tiles
};

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void st4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }

__device__ __forceinline__ void cp_async16(float* dst, const float* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async4(float* dst, const float* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most n (runtime, 0..2) groups are pending.
__device__ __forceinline__ void cp_async_wait(int n) {
  if (n >= 2)
    asm volatile("cp.async.wait_group 2;\n" ::: "memory");
  else if (n == 1)
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
  else
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

// Tile t's keys in [ka, kb) of KV head g -> K [32][kst], V [32][vst]. Other keys are not loaded (their
// scores are masked, their V rows never read). A partial last chunk (D % 4 != 0) is zero-filled.
__device__ __forceinline__ void load_tile(const Attn& a, float* Ks, float* Vs, int64_t t, int64_t ka, int64_t kb,
                                          int64_t g) {
  const int64_t key0 = t * kTile;
  const float* kbase = a.k + g * a.D;
  const float* vbase = a.v + g * a.D;
  if (a.vec && kThreads % a.d4 == 0) {  // a thread keeps one chunk of its keys: no division per copy
    const int c = static_cast<int>(threadIdx.x) % a.d4, step = kThreads / a.d4;
    for (int j = static_cast<int>(threadIdx.x) / a.d4; j < kTile; j += step) {
      const int64_t key = key0 + j;
      if (key < ka || key >= kb) continue;
      const int64_t src = key * a.kv_stride + 4 * c;
      cp_async16(Ks + j * a.kst + 4 * c, kbase + src);
      cp_async16(Vs + j * a.vst + 4 * c, vbase + src);
    }
  } else if (a.vec) {
    const int n = kTile * a.d4;
    for (int i = threadIdx.x; i < 2 * n; i += kThreads) {
      const bool isv = i >= n;
      const int ii = isv ? i - n : i;
      const int j = ii / a.d4, c = ii - j * a.d4;
      const int64_t key = key0 + j;
      if (key < ka || key >= kb) continue;
      const int64_t src = key * a.kv_stride + 4 * c;
      if (isv)
        cp_async16(Vs + j * a.vst + 4 * c, vbase + src);
      else
        cp_async16(Ks + j * a.kst + 4 * c, kbase + src);
    }
  } else {
    const int w = 4 * a.d4, n = kTile * w;
    for (int i = threadIdx.x; i < 2 * n; i += kThreads) {
      const bool isv = i >= n;
      const int ii = isv ? i - n : i;
      const int j = ii / w, d = ii - j * w;
      const int64_t key = key0 + j;
      if (key < ka || key >= kb) continue;
      float* dst = isv ? Vs + j * a.vst + d : Ks + j * a.kst + d;
      if (d < a.D)
        cp_async4(dst, (isv ? vbase : kbase) + key * a.kv_stride + d);
      else
        *dst = 0.0f;
    }
  }
}

// Slice sums of NQ queries (rows qrow[i] of Qs) with one key row: chunks [c0, c1), four fma chains per
// query (one per float4 component), then (a0 + a1) + (a2 + a3). Both layouts call this.
template <int NQ>
__device__ __forceinline__ void slice_dots(const float* Qs, int qst, const int (&qrow)[NQ], const float* krow, int c0,
                                           int c1, float (&out)[NQ]) {
  float acc[NQ][4];
#pragma unroll
  for (int i = 0; i < NQ; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
#pragma unroll 4
  for (int c = c0; c < c1; ++c) {
    const float4 kk = ld4(krow + 4 * c);
#pragma unroll
    for (int i = 0; i < NQ; ++i) {
      const float4 qv = ld4(Qs + qrow[i] * qst + 4 * c);
      acc[i][0] = fmaf(qv.x, kk.x, acc[i][0]);
      acc[i][1] = fmaf(qv.y, kk.y, acc[i][1]);
      acc[i][2] = fmaf(qv.z, kk.z, acc[i][2]);
      acc[i][3] = fmaf(qv.w, kk.w, acc[i][3]);
    }
  }
#pragma unroll
  for (int i = 0; i < NQ; ++i) out[i] = __fadd_rn(__fadd_rn(acc[i][0], acc[i][1]), __fadd_rn(acc[i][2], acc[i][3]));
}

// Segment partials -> out. Segment s lies in CTA s / spc of the cluster: its last segment in PA [q][4 d4p],
// PM [q], PL [q], its first (spc 2) in PA0, PM0, PL0 (the same offsets in every CTA). w_s = expf(m_s -
// max) (0 for an empty segment), tot = fold fma(l_s, w_s), then for this CTA's dims o = fold fma(acc_s,
// w_s) in segment order, out = o * (1 / tot); an empty range gives 0.
template <int NS>
__device__ __forceinline__ void merge_segments(const Attn& a, cg::cluster_group& cluster, int rank, int nq, int hcount,
                                               int64_t r0, int64_t h0, float* PA, float* PM, float* PL, float* PA0,
                                               float* PM0, float* PL0, float* Ws, float* Is) {
  const int tid = threadIdx.x;
  const bool two = a.spc > 1;
  for (int q = tid; q < nq; q += kThreads) {
    float ms[NS], ls[NS];
#pragma unroll
    for (int s = 0; s < NS; ++s) {
      const bool first = two && (s & 1) == 0;
      const int cta = two ? s >> 1 : s;
      ms[s] = cluster.map_shared_rank(first ? PM0 : PM, cta)[q];
      ls[s] = cluster.map_shared_rank(first ? PL0 : PL, cta)[q];
    }
    float mx = -INFINITY;
#pragma unroll
    for (int s = 0; s < NS; ++s) mx = fmaxf(mx, ms[s]);
    float tot = 0.0f;
#pragma unroll
    for (int s = 0; s < NS; ++s) {
      const float w = ms[s] == -INFINITY ? 0.0f : expf(ms[s] - mx);
      tot = fmaf(ls[s], w, tot);
      Ws[q * NS + s] = w;
    }
    Is[q] = mx == -INFINITY ? 0.0f : 1.0f / tot;  // 0: empty range (tot >= 1 otherwise)
  }
  __syncthreads();
  const int ncta = NS / a.spc;
  const int pas = 4 * a.d4p, ds = (a.D + ncta - 1) / ncta;
  for (int i = tid; i < nq * ds; i += kThreads) {
    const int q = i / ds, d = rank * ds + (i - q * ds);
    if (d >= a.D) continue;
    float x[NS];
#pragma unroll
    for (int s = 0; s < NS; ++s) {
      const bool first = two && (s & 1) == 0;
      const int cta = two ? s >> 1 : s;
      x[s] = cluster.map_shared_rank(first ? PA0 : PA, cta)[q * pas + d];
    }
    float o = 0.0f;
#pragma unroll
    for (int s = 0; s < NS; ++s) o = fmaf(x[s], Ws[q * NS + s], o);
    const int r = q / hcount, h = q - r * hcount;
    a.out[((r0 + r) * a.n_heads + h0 + h) * a.D + d] = Is[q] == 0.0f ? 0.0f : __fmul_rn(o, Is[q]);
  }
}

// kVer = false: decode layout (one row, kNQ >= its heads); true: verify layout (<= 4 rows).
// Grid (nseg / spc, n_kv_heads * hchunks, row groups), cluster (nseg / spc, 1, 1): CTA `rank` of a
// cluster takes segments rank * spc .. rank * spc + spc - 1 of every row of its group. With spc 2 the two
// segments of a row are adjacent tiles: one stream, the row's state saved and restarted where the second
// begins (tile tsp), so each segment's arithmetic is that of a CTA of its own.
template <bool kVer, int kNQ>
__global__ void __launch_bounds__(kThreads, 1) attention_cluster_kernel(const Attn a) {
  using L = AttnLayout<kVer>;
  extern __shared__ __align__(16) float sm[];
  cg::cluster_group cluster = cg::this_cluster();
  pdl_wait();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rank = static_cast<int>(cluster.block_rank());
  const int g = blockIdx.y / a.hchunks, hcix = blockIdx.y - g * a.hchunks;
  const int hcount = min(a.hc, a.group - hcix * a.hc);
  const int64_t h0 = static_cast<int64_t>(g) * a.group + static_cast<int64_t>(hcix) * a.hc;
  const int64_t r0 = static_cast<int64_t>(blockIdx.z) * a.rows;
  const int nr = static_cast<int>(a.M - r0 < a.rows ? a.M - r0 : a.rows);
  const int nq = nr * hcount;                      // query q = row * hcount + head
  const int nhb = (hcount + L::kQO - 1) / L::kQO;  // PV head blocks per row
  float* Qs = sm + a.off_q;
  float* Ss = sm + a.off_s;
  float* Ps = sm + a.off_p;
  float* Cs = sm + a.off_corr;
  int* ri = reinterpret_cast<int*>(sm + a.off_rows);  // row r: ka, kb, ta, tb, tsp; then the union's
  const int pas = 4 * a.d4p;
  float* PA0 = sm + a.off_pa0;  // spc 2: first segment's partials
  float* PM0 = PA0 + a.nq_max * pas;
  float* PL0 = PM0 + a.nq_max;

  // ---- the rows' ranges, loaded while the queries are (every CTA takes them: they come from L2 and
  // the ranges are not known yet)
  int64_t lo = 0, hi = 0;
  if (tid < nr) {
    lo = a.kv_range[2 * (r0 + tid)];
    hi = a.kv_range[2 * (r0 + tid) + 1];
  }
  {
    constexpr int kQRows = kVer ? AttnLayout<true>::kQPad : kNQ;  // rows past nq: zeros
    if (a.qvec) {
      for (int i = tid; i < kQRows * a.d4; i += kThreads) {
        const int qq = i / a.d4, c = i - qq * a.d4;
        float4 val = make_float4(0.f, 0.f, 0.f, 0.f);
        if (qq < nq) {
          const int r = qq / hcount, h = qq - r * hcount;
          val = ld4(a.q + ((r0 + r) * a.n_heads + h0 + h) * a.D + 4 * c);
        }
        st4(Qs + qq * a.qst + 4 * c, val);
      }
    } else {
      const int w = 4 * a.d4;
      for (int i = tid; i < kQRows * w; i += kThreads) {
        const int qq = i / w, d = i - qq * w;
        float val = 0.0f;
        if (qq < nq && d < a.D) {
          const int r = qq / hcount, h = qq - r * hcount;
          val = a.q[((r0 + r) * a.n_heads + h0 + h) * a.D + d];
        }
        Qs[qq * a.qst + d] = val;
      }
    }
  }

  // ---- this CTA's segments of every row: tiles [ta, tb), keys [ka, kb); tsp = first tile of the
  // second segment, tb when there is none (spc 1, or the row's second segment is empty)
  if (tid < nr) {
    int64_t ka = 0, kb = 0, ta = 0, tb = 0, tsp = 0;
    if (hi > lo) {
      const int64_t t0 = lo >= 0 ? lo / kTile : -((-lo + kTile - 1) / kTile), t1 = (hi + kTile - 1) / kTile;
      const int64_t tps = (t1 - t0 + a.nseg - 1) / a.nseg;
      const int64_t sa = t0 + static_cast<int64_t>(rank) * a.spc * tps;
      const int64_t s1 = min(sa + tps, t1), sb = min(sa + a.spc * tps, t1);
      if (sa < sb) {
        ta = sa;
        tb = sb;
        tsp = s1 < sb ? s1 : sb;
        ka = max(lo, sa * kTile);
        kb = min(hi, sb * kTile);
      }
    }
    ri[kRI * tid] = static_cast<int>(ka);
    ri[kRI * tid + 1] = static_cast<int>(kb);
    ri[kRI * tid + 2] = static_cast<int>(ta);
    ri[kRI * tid + 3] = static_cast<int>(tb);
    ri[kRI * tid + 4] = static_cast<int>(tsp);
  }
  __syncthreads();
  if (tid == 0) {
    int uka = 0, ukb = 0, uta = 0, utb = 0;
    bool any = false;
    for (int r = 0; r < nr; ++r) {
      if (ri[kRI * r + 3] <= ri[kRI * r + 2]) continue;
      uka = any ? min(uka, ri[kRI * r]) : ri[kRI * r];
      ukb = any ? max(ukb, ri[kRI * r + 1]) : ri[kRI * r + 1];
      uta = any ? min(uta, ri[kRI * r + 2]) : ri[kRI * r + 2];
      utb = any ? max(utb, ri[kRI * r + 3]) : ri[kRI * r + 3];
      any = true;
    }
    ri[kRI * L::kRows] = uka;
    ri[kRI * L::kRows + 1] = ukb;
    ri[kRI * L::kRows + 2] = uta;
    ri[kRI * L::kRows + 3] = utb;
  }
  __syncthreads();
  const int64_t uka = ri[kRI * L::kRows], ukb = ri[kRI * L::kRows + 1];
  const int uta = ri[kRI * L::kRows + 2], utb = ri[kRI * L::kRows + 3];

  // ---- start streaming K/V
  const int nstage = a.nstage;
  auto stage_k = [&](int s) { return sm + s * a.stage_floats; };
  auto stage_v = [&](int s) { return sm + s * a.stage_floats + kTile * a.kst; };
  for (int i = 0; i < nstage - 1; ++i) {
    if (uta + i < utb) load_tile(a, stage_k(i), stage_v(i), uta + i, uka, ukb, g);
    cp_async_commit();
  }

  // ---- per-thread state: softmax (warp w owns queries w, w + 8, ...), PV accumulators
  float rmax[L::kSoft], rsum[L::kSoft];
#pragma unroll
  for (int i = 0; i < L::kSoft; ++i) {
    rmax[i] = -INFINITY;
    rsum[i] = 0.0f;
  }
  const int items = a.d4p * nr * nhb;  // PV items: (row, head block, chunk)
  int it_c[L::kIPT], it_rb[L::kIPT];
  float4 acc[L::kIPT][L::kQO];
#pragma unroll
  for (int k = 0; k < L::kIPT; ++k) {
    const int it = tid + k * kThreads;
    it_rb[k] = it < items ? it / a.d4p : -1;
    it_c[k] = it < items ? it - it_rb[k] * a.d4p : 0;
    if (it_c[k] >= a.d4) it_rb[k] = -1;  // padding chunk
#pragma unroll
    for (int i = 0; i < L::kQO; ++i) acc[k][i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }

  for (int t = uta; t < utb; ++t) {
    const int it = t - uta;
    if (t + nstage - 1 < utb) {
      const int s = (it + nstage - 1) % nstage;
      load_tile(a, stage_k(s), stage_v(s), t + nstage - 1, uka, ukb, g);
    }
    cp_async_commit();
    cp_async_wait(nstage - 1);
    __syncthreads();
    const float* Ks = stage_k(it % nstage);
    const float* Vs = stage_v(it % nstage);

    // ---- scores
    if constexpr (!kVer) {
      // warp = slice, lane = key: slice sums of every head -> Ss[slice][q][key]
      int qrow[kNQ];
#pragma unroll
      for (int i = 0; i < kNQ; ++i) qrow[i] = i;
      float sv[kNQ];
      const int c0 = warp * a.cps, c1 = min(c0 + a.cps, a.d4);
      slice_dots<kNQ>(Qs, a.qst, qrow, Ks + lane * a.kst, c0, c1, sv);
#pragma unroll
      for (int i = 0; i < kNQ; ++i) Ss[(warp * kNQ + i) * kSStride + lane] = sv[i];
    } else {
      // warp tiles of 12 queries x 8 keys: lane = 4 query lanes x 8 key lanes, 3 queries per thread
      constexpr int QT = AttnLayout<true>::kQT;
      const int ql = lane >> 3, kl = lane & 7;
      const int nqb = (nq + 4 * QT - 1) / (4 * QT);
      for (int wt = warp; wt < nqb * 4; wt += kWarps) {
        const int qb = wt >> 2, j = (wt & 3) * 8 + kl;
        int qrow[QT];
#pragma unroll
        for (int i = 0; i < QT; ++i) qrow[i] = qb * 4 * QT + ql + 4 * i;
        float s[QT], tv[QT];
        for (int sl = 0; sl < kSlices; ++sl) {
          const int c0 = sl * a.cps, c1 = min(c0 + a.cps, a.d4);
          slice_dots<QT>(Qs, a.qst, qrow, Ks + j * a.kst, c0, c1, tv);
#pragma unroll
          for (int i = 0; i < QT; ++i) s[i] = sl == 0 ? tv[i] : __fadd_rn(s[i], tv[i]);
        }
#pragma unroll
        for (int i = 0; i < QT; ++i)
          if (qrow[i] < nq) Ss[qrow[i] * kSStride + j] = __fmul_rn(s[i], a.scale);
      }
    }
    __syncthreads();

    // ---- online softmax: warp w takes queries w, w + 8, ...; lane = key
#pragma unroll
    for (int i = 0; i < L::kSoft; ++i) {
      const int q = warp + kWarps * i;
      if (q >= nq) break;
      const int r = q / hcount, h = q - r * hcount;
      const int ka = ri[kRI * r], kb = ri[kRI * r + 1], ta = ri[kRI * r + 2], tb = ri[kRI * r + 3];
      if (t < ta || t >= tb) continue;  // not one of this row's tiles
      if (t == ri[kRI * r + 4]) {       // the row's second segment starts: the first one's state is final
        if (lane == 0) {
          PM0[q] = rmax[i];
          PL0[q] = rsum[i];
        }
        rmax[i] = -INFINITY;
        rsum[i] = 0.0f;
      }
      const int64_t key = static_cast<int64_t>(t) * kTile + lane;
      const bool valid = key >= ka && key < kb;
      float s;
      if constexpr (!kVer) {
        s = Ss[q * kSStride + lane];
#pragma unroll
        for (int sl = 1; sl < kSlices; ++sl) s = __fadd_rn(s, Ss[(sl * kNQ + q) * kSStride + lane]);
        s = __fmul_rn(s, a.scale);
      } else {
        s = Ss[q * kSStride + lane];
      }
      s = valid ? s : -INFINITY;
      const float nm = fmaxf(rmax[i], warp_max(s));
      const float corr = expf(rmax[i] - nm);  // old max -inf: 0
      const float p = valid ? expf(s - nm) : 0.0f;
      rsum[i] = __fadd_rn(__fmul_rn(rsum[i], corr), warp_sum(p));
      rmax[i] = nm;
      const int qp = (r * nhb + h / L::kQO) * L::kQOP + h % L::kQO;
      Ps[lane * L::kPst + qp] = p;
      if (lane == 0) Cs[qp] = corr;
    }
    __syncthreads();

    // ---- acc = acc * corr + sum_j p_j v_j over the row's keys of the tile, in key order
#pragma unroll
    for (int k = 0; k < L::kIPT; ++k) {
      const int rb = it_rb[k];
      if (rb < 0) continue;
      const int r = rb / nhb;
      const int ka = ri[kRI * r], kb = ri[kRI * r + 1], ta = ri[kRI * r + 2], tb = ri[kRI * r + 3];
      if (t < ta || t >= tb) continue;
      const int qp0 = rb * L::kQOP, c = it_c[k];
      if (t == ri[kRI * r + 4]) {  // the row's second segment starts: store the first one's acc, restart at 0
        const int hb = rb - r * nhb;
#pragma unroll
        for (int i = 0; i < L::kQO; ++i) {
          const int h = hb * L::kQO + i;
          if (h < hcount) st4(PA0 + (r * hcount + h) * pas + 4 * c, acc[k][i]);
          acc[k][i] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
      }
      const int64_t key0 = static_cast<int64_t>(t) * kTile;
      const int j0 = static_cast<int>(max(static_cast<int64_t>(ka) - key0, int64_t{0}));
      const int j1 = static_cast<int>(min(static_cast<int64_t>(kb) - key0, int64_t{kTile}));
      float pv[L::kQOP];
#pragma unroll
      for (int u = 0; u < L::kQOP / 4; ++u) {
        const float4 cc = ld4(Cs + qp0 + 4 * u);
        pv[4 * u] = cc.x;
        pv[4 * u + 1] = cc.y;
        pv[4 * u + 2] = cc.z;
        pv[4 * u + 3] = cc.w;
      }
#pragma unroll
      for (int i = 0; i < L::kQO; ++i) {
        acc[k][i].x = __fmul_rn(acc[k][i].x, pv[i]);
        acc[k][i].y = __fmul_rn(acc[k][i].y, pv[i]);
        acc[k][i].z = __fmul_rn(acc[k][i].z, pv[i]);
        acc[k][i].w = __fmul_rn(acc[k][i].w, pv[i]);
      }
#pragma unroll 4
      for (int j = j0; j < j1; ++j) {
        const float4 vv = ld4(Vs + j * a.vst + 4 * c);
#pragma unroll
        for (int u = 0; u < L::kQOP / 4; ++u) {
          const float4 pp = ld4(Ps + j * L::kPst + qp0 + 4 * u);
          pv[4 * u] = pp.x;
          pv[4 * u + 1] = pp.y;
          pv[4 * u + 2] = pp.z;
          pv[4 * u + 3] = pp.w;
        }
#pragma unroll
        for (int i = 0; i < L::kQO; ++i) {
          acc[k][i].x = fmaf(pv[i], vv.x, acc[k][i].x);
          acc[k][i].y = fmaf(pv[i], vv.y, acc[k][i].y);
          acc[k][i].z = fmaf(pv[i], vv.z, acc[k][i].z);
          acc[k][i].w = fmaf(pv[i], vv.w, acc[k][i].w);
        }
      }
    }
    __syncthreads();
  }

  // ---- partials -> shared memory: the last segment's over the tile buffers (acc [nq_max][4 d4p], max,
  // l), the first one's (spc 2) in PA0. A row whose second segment is empty ends in its first: its
  // state goes to PA0 and the second gets the empty partial (m = -inf, l = 0, acc = 0).
  cp_async_wait(0);
  __syncthreads();
  float* PA = sm;
  float* PM = sm + a.nq_max * pas;
  float* PL = PM + a.nq_max;
  const bool two = a.spc > 1;
#pragma unroll
  for (int i = 0; i < L::kSoft; ++i) {
    const int q = warp + kWarps * i;
    if (q < nq && lane == 0) {
      const int r = q / hcount;
      if (two && ri[kRI * r + 4] >= ri[kRI * r + 3]) {
        PM0[q] = rmax[i];
        PL0[q] = rsum[i];
        PM[q] = -INFINITY;
        PL[q] = 0.0f;
      } else {
        PM[q] = rmax[i];
        PL[q] = rsum[i];
      }
    }
  }
#pragma unroll
  for (int k = 0; k < L::kIPT; ++k) {
    const int rb = it_rb[k];
    if (rb < 0) continue;
    const int r = rb / nhb, hb = rb - r * nhb;
    const bool first = two && ri[kRI * r + 4] >= ri[kRI * r + 3];
#pragma unroll
    for (int i = 0; i < L::kQO; ++i) {
      const int h = hb * L::kQO + i;
      if (h >= hcount) continue;
      const int o = (r * hcount + h) * pas + 4 * it_c[k];
      if (first) {
        st4(PA0 + o, acc[k][i]);
        st4(PA + o, make_float4(0.f, 0.f, 0.f, 0.f));
      } else {
        st4(PA + o, acc[k][i]);
      }
    }
  }
  cluster.sync();

  // ---- merge the segments in order; CTA c writes dims [c ds, (c + 1) ds) of every query
  if (a.nseg == kMaxSeg)
    merge_segments<kMaxSeg>(a, cluster, rank, nq, hcount, r0, h0, PA, PM, PL, PA0, PM0, PL0, sm + a.off_w,
                            sm + a.off_inv);
  else
    merge_segments<kMaxSeg / 2>(a, cluster, rank, nq, hcount, r0, h0, PA, PM, PL, PA0, PM0, PL0, sm + a.off_w,
                                sm + a.off_inv);
  cluster.sync();  // no CTA leaves while another still reads its partials
}

// ---- attention without clusters (fallback): 16 fixed key splits per (row, head), then a merge kernel ----

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

// ---- host side of the cluster kernel -------------------------------------------------------------------

// What a device allows, found once per device: how many clusters of 16 and of 8 one-CTA-per-SM blocks
// are resident at once (H200: 7 and 15), and the segments per row (16 where 16-CTA clusters run, else 8;
// 0: no clusters, use the fallback).
struct DeviceAttn {
  bool init = false;
  int nseg = 0;
  int clusters16 = 0, clusters8 = 0;
  int optin = 0;  // shared memory per block
};

template <bool kVer, int kNQ>
bool set_attrs(int optin) {
  auto kern = attention_cluster_kernel<kVer, kNQ>;
  return cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, optin) == cudaSuccess &&
         cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess;
}

const DeviceAttn& device_attn() {
  static std::mutex mu;
  static DeviceAttn devs[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
    (void)cudaGetLastError();
    static const DeviceAttn none;
    return none;
  }
  std::lock_guard<std::mutex> lock(mu);
  DeviceAttn& d = devs[dev];
  if (d.init) return d;
  d.init = true;
  if (cudaDeviceGetAttribute(&d.optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess ||
      !set_attrs<false, 2>(d.optin) || !set_attrs<false, 3>(d.optin) || !set_attrs<false, 4>(d.optin) || !set_attrs<false, 6>(d.optin) ||
      !set_attrs<false, 8>(d.optin) || !set_attrs<true, 32>(d.optin)) {
    (void)cudaGetLastError();
    return d;  // nseg 0
  }
  int* counts[2] = {&d.clusters16, &d.clusters8};
  for (int i = 0; i < 2; ++i) {
    const int cs = kMaxSeg >> i;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(cs), 1, 1);
    cfg.blockDim = dim3(kThreads, 1, 1);
    cfg.dynamicSmemBytes = static_cast<size_t>(d.optin);  // the largest block: one per SM
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = static_cast<unsigned>(cs);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, attention_cluster_kernel<false, 8>, &cfg) != cudaSuccess) {
      (void)cudaGetLastError();
      n = 0;
    }
    *counts[i] = n;
  }
  d.nseg = d.clusters16 >= 1 ? 16 : d.clusters8 >= 1 ? 8 : 0;
  return d;
}

int round4(int64_t n) { return static_cast<int>((n + 3) / 4 * 4); }

// Shared memory layout of one layout choice; false when it does not fit in `optin` bytes.
bool plan_smem(Attn& a, bool ver, int nq_rows, int optin, size_t* bytes) {
  const int pst = ver ? AttnLayout<true>::kPst : AttnLayout<false>::kPst;
  const int qrows = ver ? AttnLayout<true>::kQPad : nq_rows;
  const int s_floats = ver ? AttnLayout<true>::kNQMax * kSStride : kSlices * nq_rows * kSStride;
  const int rows_ints = kRI * ((ver ? AttnLayout<true>::kRows : AttnLayout<false>::kRows) + 1);
  a.kst = 4 * a.d4p + 4;  // 16 bytes mod 128: 8 keys' float4 of one chunk fall in distinct banks
  a.vst = 4 * a.d4p;
  a.qst = 4 * a.d4p + 4;
  a.stage_floats = kTile * (a.kst + a.vst);
  const int64_t merge_floats = static_cast<int64_t>(a.nq_max) * 4 * a.d4p + 2 * a.nq_max;
  for (int ns = 3; ns >= 1; --ns) {
    int64_t off = round4(std::max<int64_t>(static_cast<int64_t>(ns) * a.stage_floats, merge_floats));
    a.off_q = static_cast<int>(off);
    off += round4(static_cast<int64_t>(qrows) * a.qst);
    a.off_s = static_cast<int>(off);
    off += round4(s_floats);
    a.off_p = static_cast<int>(off);
    off += round4(kTile * pst);
    a.off_corr = static_cast<int>(off);
    off += round4(pst);
    a.off_w = static_cast<int>(off);
    off += round4(static_cast<int64_t>(a.nq_max) * kMaxSeg);
    a.off_inv = static_cast<int>(off);
    off += round4(a.nq_max);
    a.off_rows = static_cast<int>(off);
    off += round4(rows_ints);
    a.off_pa0 = static_cast<int>(off);
    if (a.spc > 1) off += round4(merge_floats);
    if (off * 4 <= optin) {
      a.nstage = ns;
      *bytes = static_cast<size_t>(off) * 4;
      return true;
    }
  }
  return false;
}

struct Choice {
  Attn a;
  bool ver = false;
  int nq = 0;  // decode layout: queries per CTA (template)
  size_t smem = 0;
  unsigned groups = 0;  // grid y: KV heads x head chunks
};

// One layout: hc heads of a KV head per CTA (chunks of hc, the last may be shorter), `rows` rows per
// CTA (verify layout, 2..8) or one (decode layout), spc segments per CTA. False when it does not fit.
bool make_choice(const Attn& base, int64_t n_kv_heads, bool ver, int hc, int rows, int spc, int optin, Choice* out) {
  using V = AttnLayout<true>;
  Attn a = base;
  if (hc < 1 || hc > 8 || spc < 1 || spc > 2 || a.nseg % spc != 0) return false;
  a.hc = hc;
  a.hchunks = (a.group + hc - 1) / hc;
  a.spc = spc;
  if (ver) {
    const int nhb = (hc + V::kQO - 1) / V::kQO;
    if (rows < 2 || rows > V::kRows || rows * hc > V::kNQMax || a.d4p * rows * nhb > kThreads * V::kIPT ||
        rows * nhb * V::kQOP > V::kPst)  // P / corr entries of every (row, head block)
      return false;
    a.rows = rows;
    a.nq_max = rows * hc;
  } else {
    a.rows = 1;
    a.nq_max = hc <= 2 ? 2 : hc <= 4 ? hc : hc <= 6 ? 6 : 8;
  }
  size_t smem = 0;
  if (!plan_smem(a, ver, a.nq_max, optin, &smem)) return false;
  *out = Choice{a, ver, ver ? 0 : a.nq_max, smem, static_cast<unsigned>(n_kv_heads * a.hchunks)};
  return true;
}

// The layout only moves work between threads and CTAs (each row's arithmetic is fixed by its range and
// the device's segment count), so it may follow M and the device: the candidate with the least
// estimated time = waves x CTA time, where a wave is as many clusters as are resident at once (16-CTA
// clusters: 7 on an H200, so 8 clusters take two waves) and a CTA costs a fixed part (ranges, queries,
// first tile's latency, merge: ~8 us) plus spc x its time per segment. Per segment (27B shape on the
// H200, 2 tiles a segment): decode layout ~4 + hc / 3 us, verify layout ~6 + 5 per 12 queries (its
// score warp tiles hold 12 queries). Candidates: a KV head's query heads in one CTA (<= 8) or split
// over several (more CTAs streaming the same tiles, the repeats from L2), 1-8 rows per CTA, one segment
// per CTA (nseg-CTA clusters) or two (half as many CTAs per cluster, clusters that fit where 16 do not).
bool choose_layout(const Attn& base, int64_t M, int64_t n_kv_heads, const DeviceAttn& dev, Choice* out) {
  int64_t best = -1;
  for (int spc = 1; spc <= 2; ++spc) {
    const int csize = base.nseg / spc;
    const int resident = csize == 16 ? dev.clusters16 : csize == 8 ? dev.clusters8 : 0;
    if (resident < 1) continue;
    auto waves = [&](int64_t clusters) { return (clusters + resident - 1) / resident; };
    for (int hc = std::min(base.group, 8); hc >= 1; --hc) {
      const int chunks = (base.group + hc - 1) / hc;
      if ((base.group + chunks - 1) / chunks != hc) continue;  // the same chunks as a larger hc
      for (int rows = static_cast<int>(std::min<int64_t>(M, AttnLayout<true>::kRows)); rows >= 1; --rows) {
        const bool ver = rows > 1;
        Choice c;
        if (!make_choice(base, n_kv_heads, ver, hc, rows, spc, dev.optin, &c)) continue;
        const int64_t seg_cost = ver ? 60 + 50 * ((rows * hc + 11) / 12) : 40 + (10 * hc) / 3;  // 0.1 us
        const int64_t cost = waves(static_cast<int64_t>(c.groups) * ((M + rows - 1) / rows)) * (80 + spc * seg_cost);
        if (best < 0 || cost < best) {
          best = cost;
          *out = c;
        }
      }
    }
  }
  return best >= 0;
}

template <bool kVer, int kNQ>
void launch_cluster(const Attn& a, size_t smem, unsigned groups, cudaStream_t s) {
  const unsigned csize = static_cast<unsigned>(a.nseg / a.spc);
  const dim3 grid(csize, groups, static_cast<unsigned>((a.M + a.rows - 1) / a.rows));
  const dim3 cluster(csize, 1, 1);
  // A runtime that refuses PDL on a cluster launch gets the cluster alone (the first launch, made before
  // any graph capture, finds out). Other errors: the backend's cudaGetLastError.
  static std::atomic<bool> no_pdl{false};
  if (pdl_enabled() && !no_pdl.load(std::memory_order_relaxed)) {
    if (launch_ex(attention_cluster_kernel<kVer, kNQ>, grid, dim3(kThreads), smem, s, cluster, true, a) == cudaSuccess)
      return;
    (void)cudaGetLastError();
    no_pdl.store(true, std::memory_order_relaxed);
  }
  (void)launch_ex(attention_cluster_kernel<kVer, kNQ>, grid, dim3(kThreads), smem, s, cluster, false, a);
}

void launch_choice(const Choice& c, cudaStream_t s) {
  if (c.ver) {
    launch_cluster<true, 32>(c.a, c.smem, c.groups, s);
    return;
  }
  switch (c.nq) {
    case 2: launch_cluster<false, 2>(c.a, c.smem, c.groups, s); break;
    case 3: launch_cluster<false, 3>(c.a, c.smem, c.groups, s); break;
    case 4: launch_cluster<false, 4>(c.a, c.smem, c.groups, s); break;
    case 6: launch_cluster<false, 6>(c.a, c.smem, c.groups, s); break;
    default: launch_cluster<false, 8>(c.a, c.smem, c.groups, s); break;
  }
}

}  // namespace

void launch_rope_neox(float* x, const int32_t* pos, int64_t M, int64_t heads, int64_t head_dim, int64_t n_rot,
                      float theta, cudaStream_t s) {
  const int64_t n = heads * (n_rot / 2);
  if (M <= 0 || n <= 0) return;
  launch_pdl(rope_kernel, dim3(ceil_div_u(n, 128), static_cast<unsigned>(M)), 128, 0, s, x, pos, M, heads, head_dim, n_rot,
                                                                                static_cast<double>(theta));
}

// Partials of the fallback kernels (the cluster kernel needs none).
size_t attention_scratch_floats(int64_t M, int64_t n_heads, int64_t head_dim) {
  return std::max(static_cast<size_t>(M) * n_heads * kSplits * (head_dim + 2),
                  attention_segments_scratch_floats(M, n_heads, head_dim));
}

void launch_attention(const float* q, const float* k, const float* v, const int32_t* kv_range, float* out,
                      int64_t M, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale, float* scratch,
                      cudaStream_t s) {
  if (M <= 0 || n_heads <= 0) return;
  static const bool segments = env_flag("DFLASH_CUDA_ATTN_SEGMENTS", true);
  if (segments && launch_attention_segments(q, k, v, kv_range, out, M, n_heads, n_kv_heads, head_dim, scale, scratch, s))
    return;
  const DeviceAttn& dev = device_attn();
  if (dev.nseg == 0) {
    launch_attention_splits(q, k, v, kv_range, out, M, n_heads, n_kv_heads, head_dim, scale, scratch, s);
    return;
  }
  Attn a = {};
  a.q = q;
  a.k = k;
  a.v = v;
  a.kv_range = kv_range;
  a.out = out;
  a.M = M;
  a.n_heads = n_heads;
  a.kv_stride = n_kv_heads * head_dim;
  a.D = static_cast<int>(head_dim);
  a.d4 = (a.D + 3) / 4;
  a.cps = (a.d4 + kSlices - 1) / kSlices;
  a.d4p = kSlices * a.cps;
  a.group = static_cast<int>(n_heads / n_kv_heads);
  a.nseg = dev.nseg;
  a.spc = 1;
  a.scale = scale;
  a.vec = a.D % 4 == 0 && reinterpret_cast<uintptr_t>(k) % 16 == 0 && reinterpret_cast<uintptr_t>(v) % 16 == 0;
  a.qvec = a.D % 4 == 0 && reinterpret_cast<uintptr_t>(q) % 16 == 0;
  Choice c;
  if (!choose_layout(a, M, n_kv_heads, dev, &c)) {
    launch_attention_splits(q, k, v, kv_range, out, M, n_heads, n_kv_heads, head_dim, scale, scratch, s);
    return;
  }
  launch_choice(c, s);
}

}  // namespace dflash::cuda
