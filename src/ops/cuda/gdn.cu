// Gated DeltaNet delta-rule recurrence (SPEC 2.4), sequential over the rows.
//
// Columns j of a head's state S[i][j] (i = key dim, j = value dim) evolve independently given the
// sums over i, so a block takes one V head and 32 value columns: thread (g, jl) owns column j0 + jl and
// the key rows i = g R .. g R + R - 1 (R = kRPT, a contiguous run: its k / q come as 16-byte shared
// loads) in registers (G = kG row groups, one warp each). Per row, with S' the state after the row:
//   S *= exp(g);  kv = S^T k;  sq = S^T q;  delta = (v - kv) * beta;  S' = S + k delta^T;
//   o = S'^T q = sq + delta (k . q)
// so every sum over i (kv, sq, k . q) comes from values known before the update and one barrier per row
// exchanges them (the groups' partials double-buffered in shared memory). Each sum over i = the group's
// partial (two interleaved chains over its rows, then added), the G partials added in a fixed pairwise
// tree (G = 8: ((g0 + g1) + (g2 + g3)) + ((g4 + g5) + (g6 + g7))). G is a device setting (gdn_groups()),
// never a function of M, so one row and a verify block get the same bits.
// The state is read from state_in (in place when state_in == state), stays in registers across the M
// rows and is written to state; snapshots get the state after each row. An undoable step (the prepare
// path with a delta buffer: verify) writes each row's delta instead and leaves the state as it was;
// gdn_apply_rows_batch_kernel later advances it over the kept rows with the same per-element arithmetic.
// The rows' q, k, v, decay and beta are staged in shared memory kStageRows rows at a time.
// gdn_prepare_recurrent runs the same kernel with kPrepare: it l2-norms q / k and computes the gates
// while staging (one launch instead of l2_norm, l2_norm, gdn_gates, gdn_recurrent and the q/k/v copies).
#include <cstdlib>

#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace dflash::cuda {
namespace {

// Row groups (warps) per CTA: DFLASH_CUDA_GDN_GROUPS=4 or 8 (default 8: twice the warps and half the
// serial chain per row of the 4 of rounds 2-8; the sums are grouped differently, so the bits differ
// between the two settings, never between row counts).
int gdn_groups() {
  static const int v = env_int("DFLASH_CUDA_GDN_GROUPS", 8) == 4 ? 4 : 8;
  return v;
}

// kG partial sums in a fixed pairwise tree (G = 8: ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7))).
template <int kG>
__device__ __forceinline__ float tree_sum(float (&v)[kG]) {
#pragma unroll
  for (int w = 1; w < kG; w <<= 1)
#pragma unroll
    for (int g = 0; g + w < kG; g += 2 * w) v[g] += v[g + w];
  return v[0];
}
// The kG partial sums of column jl.
template <int kG>
__device__ __forceinline__ float group_sum(const float (&red)[kG][32], int jl) {
  float v[kG];
#pragma unroll
  for (int g = 0; g < kG; ++g) v[g] = red[g][jl];
  return tree_sum<kG>(v);
}

constexpr int kStageRows = 8;  // rows whose inputs are staged in shared memory at once (the verify block)

// The kernel's arguments (one struct: the prepare path adds ten). q, k, v rows are *_stride floats apart.
struct RecurrentArgs {
  const float* q;
  const float* k;
  const float* v;
  int64_t q_stride, k_stride, v_stride;
  const float* g;     // kPrepare: the raw alpha a [M, Hv]; else the log-decay
  const float* beta;  // kPrepare: the raw beta logits b [M, Hv]; else beta
  const float* dt_bias;  // kPrepare only [Hv]
  const float* ssm_a;    // kPrepare only [Hv]
  float eps, q_scale;    // kPrepare only: the l2 norms' eps, q's scale
  const float* state_in;  // the state before the rows (== state: in place; else read only)
  float* state;
  float* out;
  float* snapshots;
  float* pq;  // kPrepare: null, or the prepared q, k [M, Hk*dk], g, beta [M, Hv] (packed)
  float* pk;
  float* pg;
  float* pbeta;
  float* pdelta;  // kPrepare: null, or the rows' deltas [M, Hv*dv] (each CTA its own 32 columns); the
                  // state is then not written (undoable)
  int64_t M;
  int Hk, Hv, dk, dv;
  bool prefetch_state;  // gdn_state_prefetch()
};

// The state is last written one step earlier (decode, verify) or by the verify before a rollback: ~60
// kernels and a full pass over the weights ago, so it comes from DRAM. Each thread asks L2 for one
// 128-byte line of its CTA's state (a row i, the CTA's 32 columns) before pdl_wait(), so that
// the load overlaps the previous kernel (a prefetch is only a hint: the values are read after the wait).
// DFLASH_CUDA_GDN_STATE_PREFETCH=0 leaves it out (for an A/B).
bool gdn_state_prefetch() {
  static const bool v = env_flag("DFLASH_CUDA_GDN_STATE_PREFETCH", true);
  return v;
}

// kPrepare: q, k, a, b arrive raw and are prepared while they are staged (gdn_prepare_recurrent):
// the staged q / k rows are l2-normed in shared memory (one warp per vector: lane l sums the squares
// of elements l, l + 32, ... in order, then warp_sum's butterfly; the same order whatever M is), and
// the decay and beta come from a, b, dt_bias, ssm_a as in gdn_gates. The recurrence below then reads
// exactly the values written to pq / pk / pg / pbeta, so gdn_recurrent over those (the same code with
// kPrepare false) reproduces the state and output bit for bit. Every CTA of a V head recomputes its K
// head's norms; only the CTA with blockIdx.y == 0 and p < Hk (p is then its own K head) writes the
// prepared q / k, and only blockIdx.y == 0 writes g / beta, so each value has one writer.
// kExactK: head_k == kG * kRPT, and kDv > 0: head_v == kDv, known at compile time (the 27B's 128 x 128
// heads): the staging's divisions by head_k and the state offsets' multiplies by head_v fold away (ncu of
// the 8-row verify step, S18-10: ~1100 of a warp's ~2550 instructions ran once per warp, mostly that
// integer arithmetic, with half the stall samples).
// One CTA's work: V head blockIdx.x, value columns blockIdx.y * 32 .. + 31.
template <int kG, int kRPT, bool kPrepare, bool kExactK, int kDv>
__device__ __forceinline__ void recurrent_cta(const RecurrentArgs& args) {
  constexpr int kGroups = kG;
  if (args.prefetch_state)
    for (int i = threadIdx.x; i < args.dk; i += blockDim.x)  // the line of (row i, this CTA's first column)
      prefetch_l2(args.state_in + static_cast<int64_t>(blockIdx.x) * args.dk * args.dv +
                  static_cast<int64_t>(i) * args.dv + blockIdx.y * 32);
  pdl_wait();
  constexpr int D = kGroups * kRPT;
  const float* __restrict__ q = args.q;
  const float* __restrict__ k = args.k;
  const float* __restrict__ v = args.v;
  const float* __restrict__ g = args.g;
  const float* __restrict__ beta = args.beta;
  float* __restrict__ snapshots = args.snapshots;
  const int64_t M = args.M;
  const int Hk = args.Hk, Hv = args.Hv;
  const int dk = kExactK ? kGroups * kRPT : args.dk, dv = kDv > 0 ? kDv : args.dv;
  // Inputs of up to kStageRows rows at a time: their loads are all in flight together, instead of one
  // global round trip per row (verify's 8 rows).
  __shared__ __align__(16) float ks[kStageRows][D], qs[kStageRows][D];
  __shared__ float vs[kStageRows][32], decays[kStageRows], betas[kStageRows];
  // The groups' partials of kv ([b][0]) and sq ([b][1]); row m uses buffer b = m & 1, so a row's writes
  // never meet the previous row's reads: the one barrier per row orders them. k . q does not depend on the
  // column: each stage's group partials of it are computed once (kq[row][group], by rows x kG threads,
  // ordered before their one reader by the first row's barrier) instead of by every thread in every row.
  __shared__ float red[2][2][kGroups][32];
  __shared__ float kq_part[kStageRows][kGroups];
  const int p = blockIdx.x;
  const int kh = p % Hk;
  const int jl = threadIdx.x & 31, grp = threadIdx.x >> 5;
  const int j = blockIdx.y * 32 + jl;
  const bool col_ok = j < dv;
  const int64_t head_state = static_cast<int64_t>(dk) * dv;
  const float* Sin = args.state_in + p * head_state;
  float* S0 = args.state + p * head_state;
  // The thread's state element r is (i, j) = (i0 + r, j), i0 = grp kRPT: offset e0 + r * dv within a head
  // (int: a head is dk * dv <= 2^16 floats). One offset for every state-shaped buffer (in, out,
  // snapshots), so their addresses share the arithmetic.
  const int i0 = grp * kRPT;
  const int e0 = i0 * dv + j;
  // The thread's state elements (rows below dk) into one state-shaped buffer of this head.
  const auto store_state = [&](float* head, const float (&st)[kRPT]) {
#pragma unroll
    for (int r = 0; r < kRPT; ++r)
      if (i0 + r < dk) head[e0 + r * dv] = st[r];
  };

  float S[kRPT];
#pragma unroll
  for (int r = 0; r < kRPT; ++r) {
    S[r] = (col_ok && i0 + r < dk) ? Sin[e0 + r * dv] : 0.0f;
  }
  // Key rows dk .. D - 1 of the staging (head_k below kGroups * kRPT) stay zero, as S does there: the
  // row loop below runs over all D rows without a branch. (Ordered before use by the stage's barrier.)
  if constexpr (!kExactK)
    for (int t = threadIdx.x; t < kStageRows * (D - dk); t += blockDim.x) {
      const int mm = t / (D - dk), i = dk + t % (D - dk);
      ks[mm][i] = 0.0f;
      qs[mm][i] = 0.0f;
    }
  for (int64_t m0 = 0; m0 < M; m0 += kStageRows) {
    const int rows = static_cast<int>(M - m0 < kStageRows ? M - m0 : kStageRows);
    __syncthreads();  // the previous stage's rows are done with ks / qs / vs
    // The rows' inputs: every load of the thread is issued before its first shared-memory store (a loop
    // of load-then-store waits one L2 round trip per iteration: 4 at verify's 8 rows).
    constexpr int kThreads = kGroups * 32;
    constexpr int kQkPer = (kStageRows * D + kThreads - 1) / kThreads;
    constexpr int kVPer = (kStageRows * 32 + kThreads - 1) / kThreads;
    float kt[kQkPer], qt[kQkPer], vt[kVPer];
#pragma unroll
    for (int u = 0; u < kQkPer; ++u) {
      const int t = threadIdx.x + u * kThreads;
      if (t < rows * dk) {
        const int mm = t / dk, i = t % dk;
        kt[u] = k[(m0 + mm) * args.k_stride + kh * dk + i];
        qt[u] = q[(m0 + mm) * args.q_stride + kh * dk + i];
      }
    }
#pragma unroll
    for (int u = 0; u < kVPer; ++u) {
      const int t = threadIdx.x + u * kThreads;
      const int jc = blockIdx.y * 32 + t % 32;
      vt[u] = t < rows * 32 && jc < dv ? v[(m0 + t / 32) * args.v_stride + static_cast<int64_t>(p) * dv + jc] : 0.0f;
    }
    float gt = 0.0f, bt_raw = 0.0f;
    if (threadIdx.x < rows) {
      const int64_t gi = (m0 + threadIdx.x) * Hv + p;
      gt = g[gi];
      bt_raw = beta[gi];
    }
#pragma unroll
    for (int u = 0; u < kQkPer; ++u) {
      const int t = threadIdx.x + u * kThreads;
      if (t < rows * dk) {
        ks[t / dk][t % dk] = kt[u];
        qs[t / dk][t % dk] = qt[u];
      }
    }
#pragma unroll
    for (int u = 0; u < kVPer; ++u) {
      const int t = threadIdx.x + u * kThreads;
      if (t < rows * 32) vs[t / 32][t % 32] = vt[u];
    }
    if (threadIdx.x < rows) {
      const int64_t gi = (m0 + threadIdx.x) * Hv + p;
      if constexpr (kPrepare) {
        const float bt = sigmoid_f(bt_raw);
        const float lg = args.ssm_a[p] * softplus_f(gt + args.dt_bias[p]);
        decays[threadIdx.x] = expf(lg);
        betas[threadIdx.x] = bt;
        if (args.pg && blockIdx.y == 0) {
          args.pg[gi] = lg;
          args.pbeta[gi] = bt;
        }
      } else {
        decays[threadIdx.x] = expf(gt);
        betas[threadIdx.x] = bt_raw;
      }
    }
    if constexpr (kPrepare) {
      __syncthreads();  // the raw rows are staged
      // vector u: row u / 2, k (even u) or q (odd u); a lane rewrites only the elements it summed
      for (int u = grp; u < 2 * rows; u += kGroups) {
        float* x = (u & 1) ? qs[u >> 1] : ks[u >> 1];
        const float scale = (u & 1) ? args.q_scale : 1.0f;
        float ss = 0.0f;
        for (int i = jl; i < dk; i += 32) ss = fmaf(x[i], x[i], ss);
        ss = warp_sum(ss);
        const float inv = 1.0f / sqrtf(ss + args.eps);
        for (int i = jl; i < dk; i += 32) x[i] = x[i] * inv * scale;
      }
    }
    __syncthreads();
    if constexpr (kPrepare) {
      if (args.pq && blockIdx.y == 0 && p < Hk) {
        for (int t = threadIdx.x; t < rows * dk; t += blockDim.x) {
          const int mm = t / dk, i = t % dk;
          const int64_t o = ((m0 + mm) * Hk + kh) * dk + i;
          args.pk[o] = ks[mm][i];
          args.pq[o] = qs[mm][i];
        }
      }
    }
    if (static_cast<int>(threadIdx.x) < rows * kGroups) {  // row t / kG, group t % kG: two chains, then added
      const int mm = threadIdx.x / kGroups, g0 = (threadIdx.x % kGroups) * kRPT;
      float kq[2] = {0.0f, 0.0f};
#pragma unroll
      for (int r = 0; r < kRPT; ++r) kq[r & 1] = fmaf(ks[mm][g0 + r], qs[mm][g0 + r], kq[r & 1]);
      kq_part[mm][threadIdx.x % kGroups] = kq[0] + kq[1];
    }
    for (int mm = 0; mm < rows; ++mm) {
      const int64_t m = m0 + mm;
      const int b = static_cast<int>(m & 1);
      const float decay = decays[mm];
      const float bt = betas[mm];
      const float vj = vs[mm][jl];
      // Straight-line over all kRPT rows: past dk, S and the staged k / q are zero (see above), so those
      // terms add nothing (a branch per row made the chain's code depend on ptxas' if-conversion).
      float kr[kRPT], qr[kRPT];
#pragma unroll
      for (int r = 0; r < kRPT; r += 4) {
        const float4 k4 = *reinterpret_cast<const float4*>(&ks[mm][i0 + r]);
        const float4 q4 = *reinterpret_cast<const float4*>(&qs[mm][i0 + r]);
        kr[r] = k4.x, kr[r + 1] = k4.y, kr[r + 2] = k4.z, kr[r + 3] = k4.w;
        qr[r] = q4.x, qr[r + 1] = q4.y, qr[r + 2] = q4.z, qr[r + 3] = q4.w;
      }
      float kv[2] = {0.0f, 0.0f}, sq[2] = {0.0f, 0.0f};  // even / odd r: two chains each
#pragma unroll
      for (int r = 0; r < kRPT; ++r) {
        S[r] *= decay;
        kv[r & 1] = fmaf(S[r], kr[r], kv[r & 1]);
        sq[r & 1] = fmaf(S[r], qr[r], sq[r & 1]);
      }
      red[b][0][grp][jl] = kv[0] + kv[1];
      red[b][1][grp][jl] = sq[0] + sq[1];
      __syncthreads();
      const float kv_all = group_sum<kGroups>(red[b][0], jl);
      const float sq_all = group_sum<kGroups>(red[b][1], jl);
      const float delta = (vj - kv_all) * bt;
#pragma unroll
      for (int r = 0; r < kRPT; ++r) S[r] = fmaf(kr[r], delta, S[r]);
      if (grp == 0 && col_ok && args.out) {
        float kq[kGroups];
#pragma unroll
        for (int g = 0; g < kGroups; ++g) kq[g] = kq_part[mm][g];
        args.out[(m * Hv + p) * dv + j] = fmaf(delta, tree_sum<kGroups>(kq), sq_all);
      }
      if constexpr (kPrepare)
        if (grp == 1 % kGroups && col_ok && args.pdelta) args.pdelta[(m * Hv + p) * dv + j] = delta;
      if (snapshots && col_ok) store_state(snapshots + m * static_cast<int64_t>(Hv) * head_state + p * head_state, S);
    }
  }
  const bool undoable = kPrepare && args.pdelta;
  if (col_ok && !undoable) store_state(S0, S);
}

template <int kG, int kRPT, bool kPrepare, bool kExactK = false, int kDv = 0>
__global__ void __launch_bounds__(kG * 32, 1) gdn_recurrent_kernel(const RecurrentArgs args) {
  recurrent_cta<kG, kRPT, kPrepare, kExactK, kDv>(args);
}

// DFLASH_CUDA_GDN_CONST_SHAPES=0: 128 x 128 heads take the generic kernel (shapes read at run time), for
// comparison; the bits are the same.
bool gdn_const_shapes() {
  static const bool v = env_flag("DFLASH_CUDA_GDN_CONST_SHAPES", true);
  return v;
}

// One V head per blockIdx.x, 32 value columns per blockIdx.y, kG warps; kRPT the fewest rows per thread
// that cover head_k (<= kGdnMaxHeadK).
template <int kG, bool kPrepare>
void launch_recurrent_groups(const RecurrentArgs& a, cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>(a.Hv), ceil_div_u(a.dv, 32));
  if constexpr (kG * 16 == 128)
    if (a.dk == 128 && a.dv == 128 && gdn_const_shapes()) {  // the 27B's heads: shapes as constants
      launch_pdl(gdn_recurrent_kernel<kG, 16, kPrepare, true, 128>, grid, kG * 32, 0, s, a);
      return;
    }
  if (a.dk <= kG * 4)
    launch_pdl(gdn_recurrent_kernel<kG, 4, kPrepare>, grid, kG * 32, 0, s, a);
  else if (a.dk <= kG * 8)
    launch_pdl(gdn_recurrent_kernel<kG, 8, kPrepare>, grid, kG * 32, 0, s, a);
  else if (a.dk <= kG * 16)
    launch_pdl(gdn_recurrent_kernel<kG, 16, kPrepare>, grid, kG * 32, 0, s, a);
  else if (a.dk <= kG * 32)
    launch_pdl(gdn_recurrent_kernel<kG, 32, kPrepare>, grid, kG * 32, 0, s, a);
  else
    launch_pdl(gdn_recurrent_kernel<kG, 64, kPrepare>, grid, kG * 32, 0, s, a);
}
template <bool kPrepare>
void launch_recurrent(RecurrentArgs a, cudaStream_t s) {
  if (a.M <= 0) return;
  a.prefetch_state = gdn_state_prefetch();
  if (gdn_groups() == 4)
    launch_recurrent_groups<4, kPrepare>(a, s);
  else
    launch_recurrent_groups<8, kPrepare>(a, s);
}


// Backend::gdn_apply_rows_batch: job blockIdx.y's state, V head p = blockIdx.x / tiles, a tile of that
// head's elements (e = i * dv + j). Per row m and element: S *= exp(g[m][p]); S = fma(k[m][kh][i],
// delta[m][p][j], S), the recurrence's two steps with its rounding (its decay multiply, then its fmaf),
// so the bits are the recurrence's.
// 128 x 128 heads (gdn_apply_rows_exact_kernel): a tile is 32 whole key rows (16 KB); thread t holds
// columns 4 (t % 32) .. + 3 of rows t / 32 + 8 u (u < 4) as float4s, loaded first; then the rows' k (the
// tile's 32), delta (128 columns) and decay are staged in shared memory kApplyRows rows at a time, every
// load in flight together, so a CTA waits about one round trip whatever the row count. (S32-5: scalar
// elements with k and delta read row by row from L2 inside the loop took 142 us for the 27B's
// rollback(4); S32-6: staged, 2048-element tiles, 106 us.) Other shapes: gdn_apply_rows_kernel, scalar,
// reading k and delta directly (small heads: tests, small models).
constexpr int kApplyThreads = 256;
constexpr int kApplyRows = 8;      // pending rows staged at once (exact kernel)
constexpr int kApplyPer = 8;       // elements per thread (generic kernel)
constexpr int kApplyTile = kApplyThreads * kApplyPer;
constexpr int kMaxApplyJobs = 64;  // the kernel's parameters stay under 4 KB
struct ApplyBatch {
  const float* k[kMaxApplyJobs];
  const float* g[kMaxApplyJobs];
  const float* delta[kMaxApplyJobs];
  float* state[kMaxApplyJobs];
  int64_t M;
  int Hk, Hv, dk, dv, tiles;  // tiles: tiles per head
};

constexpr int kExactTileRows = 32, kExactTiles = 128 / kExactTileRows, kExactPer = kExactTileRows * 32 / kApplyThreads;

__global__ void __launch_bounds__(kApplyThreads) gdn_apply_rows_exact_kernel(const ApplyBatch b) {
  __shared__ float sk[kApplyRows][kExactTileRows], sdecay[kApplyRows];
  __shared__ __align__(16) float sd[kApplyRows][128];
  const int z = static_cast<int>(blockIdx.y);
  const int p = static_cast<int>(blockIdx.x) / kExactTiles, tile = static_cast<int>(blockIdx.x) % kExactTiles;
  float* S = b.state[z] + static_cast<int64_t>(p) * 128 * 128;
  const float* __restrict__ k = b.k[z];
  const float* __restrict__ g = b.g[z];
  const float* __restrict__ delta = b.delta[z];
  const int kh = p % b.Hk, Hk = b.Hk, Hv = b.Hv;
  const int tid = static_cast<int>(threadIdx.x), c4 = 4 * (tid % 32), r0 = tid / 32;  // rows r0 + 8 u of the tile
  const int i_tile = tile * kExactTileRows;
  pdl_wait();
  float4 st[kExactPer];
#pragma unroll
  for (int u = 0; u < kExactPer; ++u)
    st[u] = *reinterpret_cast<const float4*>(S + (i_tile + r0 + 8 * u) * 128 + c4);
  for (int64_t m0 = 0; m0 < b.M; m0 += kApplyRows) {
    const int rows = static_cast<int>(b.M - m0 < kApplyRows ? b.M - m0 : kApplyRows);
    // all of the chunk's loads first (delta: rows x 128, k: rows x 32, g: rows), then the stores
    constexpr int kDPer = kApplyRows * 128 / kApplyThreads;
    float dvv[kDPer], kv = 0.0f, gv = 0.0f;
#pragma unroll
    for (int u = 0; u < kDPer; ++u) {
      const int t = tid + u * kApplyThreads, mm = t / 128;
      dvv[u] = mm < rows ? delta[(m0 + mm) * Hv * 128 + p * 128 + t % 128] : 0.0f;
    }
    if (tid < rows * kExactTileRows)
      kv = k[(m0 + tid / kExactTileRows) * Hk * 128 + kh * 128 + i_tile + tid % kExactTileRows];
    if (tid < rows) gv = g[(m0 + tid) * Hv + p];
    __syncthreads();  // the previous chunk's rows are done with sk / sd / sdecay
#pragma unroll
    for (int u = 0; u < kDPer; ++u) {
      const int t = tid + u * kApplyThreads;
      sd[t / 128][t % 128] = dvv[u];
    }
    if (tid < rows * kExactTileRows) sk[tid / kExactTileRows][tid % kExactTileRows] = kv;
    if (tid < rows) sdecay[tid] = expf(gv);
    __syncthreads();
    for (int mm = 0; mm < rows; ++mm) {
      const float decay = sdecay[mm];
      const float4 d = *reinterpret_cast<const float4*>(&sd[mm][c4]);
#pragma unroll
      for (int u = 0; u < kExactPer; ++u) {
        const float ki = sk[mm][r0 + 8 * u];
        st[u].x *= decay, st[u].y *= decay, st[u].z *= decay, st[u].w *= decay;
        st[u].x = fmaf(ki, d.x, st[u].x), st[u].y = fmaf(ki, d.y, st[u].y);
        st[u].z = fmaf(ki, d.z, st[u].z), st[u].w = fmaf(ki, d.w, st[u].w);
      }
    }
  }
#pragma unroll
  for (int u = 0; u < kExactPer; ++u) *reinterpret_cast<float4*>(S + (i_tile + r0 + 8 * u) * 128 + c4) = st[u];
}

// Any shape: thread t takes elements tile * kApplyTile + t + 256 u, u < kApplyPer (coalesced per u).
__global__ void __launch_bounds__(kApplyThreads) gdn_apply_rows_kernel(const ApplyBatch b) {
  const int z = static_cast<int>(blockIdx.y);
  const int dk = b.dk, dv = b.dv;
  const int p = static_cast<int>(blockIdx.x) / b.tiles, tile = static_cast<int>(blockIdx.x) % b.tiles;
  const int head_elems = dk * dv;
  float* S = b.state[z] + static_cast<int64_t>(p) * head_elems;
  const float* __restrict__ k = b.k[z];
  const float* __restrict__ g = b.g[z];
  const float* __restrict__ delta = b.delta[z];
  const int kh = p % b.Hk, Hk = b.Hk, Hv = b.Hv;
  const int e0 = tile * kApplyTile + static_cast<int>(threadIdx.x);
  pdl_wait();
  float st[kApplyPer];
  int ii[kApplyPer], jj[kApplyPer];
#pragma unroll
  for (int u = 0; u < kApplyPer; ++u) {
    const int e = e0 + u * kApplyThreads;
    ii[u] = e / dv, jj[u] = e % dv;
    st[u] = e < head_elems ? S[e] : 0.0f;
  }
  for (int64_t m = 0; m < b.M; ++m) {
    const float decay = expf(g[m * Hv + p]);
    const float* km = k + (m * Hk + kh) * dk;
    const float* dm = delta + (m * Hv + p) * dv;
#pragma unroll
    for (int u = 0; u < kApplyPer; ++u) {
      const bool ok = e0 + u * kApplyThreads < head_elems;
      const float ki = ok ? km[ii[u]] : 0.0f, dj = ok ? dm[jj[u]] : 0.0f;
      st[u] *= decay;
      st[u] = fmaf(ki, dj, st[u]);
    }
  }
#pragma unroll
  for (int u = 0; u < kApplyPer; ++u)
    if (e0 + u * kApplyThreads < head_elems) S[e0 + u * kApplyThreads] = st[u];
}

}  // namespace

void launch_gdn_recurrent(const float* q, const float* k, const float* v, const float* g, const float* beta,
                          const float* state_in, float* state, float* out, float* snapshots, int64_t M,
                          int64_t n_k_heads, int64_t n_v_heads, int64_t head_k, int64_t head_v, cudaStream_t s) {
  RecurrentArgs a{};
  a.q = q, a.k = k, a.v = v;
  a.q_stride = a.k_stride = n_k_heads * head_k;
  a.v_stride = n_v_heads * head_v;
  a.g = g, a.beta = beta;
  a.state_in = state_in, a.state = state, a.out = out, a.snapshots = snapshots;
  a.M = M;
  a.Hk = static_cast<int>(n_k_heads), a.Hv = static_cast<int>(n_v_heads);
  a.dk = static_cast<int>(head_k), a.dv = static_cast<int>(head_v);
  launch_recurrent<false>(a, s);
}

void launch_gdn_prepare_recurrent(const float* q, int64_t q_stride, const float* k, int64_t k_stride, const float* v,
                                  int64_t v_stride, const float* a, const float* b, const float* dt_bias,
                                  const float* ssm_a, float eps, float q_scale, float* state, float* out,
                                  float* prep_q, float* prep_k, float* prep_g, float* prep_beta, float* delta,
                                  int64_t M, int64_t n_k_heads, int64_t n_v_heads, int64_t head_k, int64_t head_v,
                                  cudaStream_t s) {
  RecurrentArgs r{};
  r.q = q, r.k = k, r.v = v;
  r.q_stride = q_stride, r.k_stride = k_stride, r.v_stride = v_stride;
  r.g = a, r.beta = b, r.dt_bias = dt_bias, r.ssm_a = ssm_a;
  r.eps = eps, r.q_scale = q_scale;
  r.state_in = state, r.state = state, r.out = out, r.snapshots = nullptr;
  r.pq = prep_q, r.pk = prep_k, r.pg = prep_g, r.pbeta = prep_beta, r.pdelta = delta;
  r.M = M;
  r.Hk = static_cast<int>(n_k_heads), r.Hv = static_cast<int>(n_v_heads);
  r.dk = static_cast<int>(head_k), r.dv = static_cast<int>(head_v);
  launch_recurrent<true>(r, s);
}

void launch_gdn_apply_rows_batch(const GdnApplyJobRef* jobs, int n, int64_t M, int64_t n_k_heads, int64_t n_v_heads,
                                 int64_t head_k, int64_t head_v, cudaStream_t s) {
  if (M <= 0 || n <= 0) return;
  for (int j0 = 0; j0 < n; j0 += kMaxApplyJobs) {
    const int nj = n - j0 < kMaxApplyJobs ? n - j0 : kMaxApplyJobs;
    ApplyBatch b{};
    b.M = M;
    b.Hk = static_cast<int>(n_k_heads), b.Hv = static_cast<int>(n_v_heads);
    b.dk = static_cast<int>(head_k), b.dv = static_cast<int>(head_v);
    bool exact = head_k == 128 && head_v == 128;  // and every state 16-byte aligned (float4 accesses)
    for (int j = 0; j < nj; ++j) {
      const GdnApplyJobRef& r = jobs[j0 + j];
      b.k[j] = r.k, b.g[j] = r.g, b.delta[j] = r.delta, b.state[j] = r.state;
      exact = exact && reinterpret_cast<uintptr_t>(r.state) % 16 == 0;
    }
    b.tiles = exact ? kExactTiles : static_cast<int>(ceil_div_u(head_k * head_v, kApplyTile));
    const dim3 grid(static_cast<unsigned>(b.Hv * b.tiles), static_cast<unsigned>(nj));
    if (exact)
      launch_pdl(gdn_apply_rows_exact_kernel, grid, kApplyThreads, 0, s, b);
    else
      launch_pdl(gdn_apply_rows_kernel, grid, kApplyThreads, 0, s, b);
  }
}

}  // namespace dflash::cuda
