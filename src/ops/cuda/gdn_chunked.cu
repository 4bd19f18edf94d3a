// Gated DeltaNet delta rule in chunked (WY / UT transform) form for prefill (SPEC 2.4; the algebra is
// the CPU reference's, src/ops/cpu/cpu_gdn.cpp, CpuBackend::gdn_chunked).
//
// Rows go in chunks of C = 64 (chunk boundaries at multiples of 64 from the call's first row; the
// last chunk is zero-padded: k = q = v = 0, beta = 0, g = 0, so padded rows add nothing and the
// cumulative decay of row 63 equals that of the last real row). Per V head p and chunk, with S0 the
// state entering the chunk and G_t the cumulative log-decay (summed in double, like the CPU):
//   A[t][s] = beta_t exp(G_t - G_s) k_t.k_s (s < t),   T = (I + A)^-1   (unit lower triangular)
//   W  = T diag(beta Gam) K   [C, dk],   U~ = T diag(beta) V   [C, dv]
//   QK[t][s] = exp(G_t - G_s) q_t.k_s (s <= t)
//   U  = U~ - W S0,   O = diag(Gam) Q S0 + QK U,   S = Gam_{C-1} S0 + K^T diag(exp(G_{C-1} - G_s)) U
//
// Two kernels:
//  1. gdn_chunk_prep, grid (chunks, V heads): everything that does not depend on the state (A, T, W,
//     U~, QK), for all chunks at once; W, U~ and QK go to a scratch buffer (L2-resident at prefill
//     sizes: 48 heads x 512 rows = 31 MB).
//  2. gdn_chunk_state, grid (V heads, dv / CS column slices): the sequential part. Columns of the state
//     evolve independently given W, K, Q, QK, so a block owns a [dk, CS] slice of one head's state (in
//     shared memory, fp32) and walks the chunks in order: U, O, then the state update.
//
// Products run on tensor cores (mma.sync m16n8k8 tf32) in the error-compensated 3xTF32 form: each
// fp32 operand x = hi + lo with hi = tf32(x), lo = tf32(x - hi), and a.b ~ a_lo b_hi + a_hi b_lo +
// a_hi b_hi with fp32 accumulation. That keeps ~21 bits per product (plain tf32 keeps 11: ~1e-7 NMSE
// per product, and the state feeds its own error back chunk after chunk), so the result stays within
// fp32 rounding of the CPU forms. The triangular solve for T (64 x 64) is fp32 forward substitution.
// Head dims are padded to P = 32, 64 or 128 with zeros (zero key dims add nothing to any sum; zero value
// columns are never stored). Larger heads use the recurrence (the backend decides).
#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"
#include "ops/cuda/tf32_mma.cuh"

namespace dflash::cuda {
namespace {

constexpr int kC = 64;         // chunk rows
constexpr int kThreads = 256;  // 8 warps per block, both kernels
constexpr int kLA = kC + 4;    // row stride of the 64 x 64 tiles in shared memory

// ---- 3xTF32 warp tiles ----------------------------------------------------------------------------

// One warp: c[16 x 8*NT] += A[16 x K] . B[K x 8*NT] (K a multiple of 8), operands in shared memory.
//   A(r, k) = TA ? A[k*lda + r] : A[r*lda + k], times ka[k] when SCALE_A (a diagonal on the right of A)
//   B(k, n) = TB ? B[n*ldb + k] : B[k*ldb + n]
// Only the first n_active n-tiles are computed (the others are left as they are).
// Fragment layout (PTX m16n8k8 .tf32): lane = 4 g + t; a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4);
// b0 (k t, n g), b1 (k t+4, n g); c0/c1 (g, 2t / 2t+1), c2/c3 (g+8, 2t / 2t+1).
// Bank-conflict-free strides: row-major A and TB B want lda/ldb = 4 mod 32; TA A and row-major B want 8 mod 32.
template <int NT, bool TA, bool TB, bool SCALE_A = false>
__device__ __forceinline__ void warp_mma(float (&c)[NT][4], const float* A, int lda, const float* B, int ldb, int K,
                                         int n_active = NT, const float* ka = nullptr) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  for (int k0 = 0; k0 < K; k0 += 8) {
    float af[4];
    if (TA) {
      af[0] = A[(k0 + t) * lda + g];
      af[1] = A[(k0 + t) * lda + g + 8];
      af[2] = A[(k0 + t + 4) * lda + g];
      af[3] = A[(k0 + t + 4) * lda + g + 8];
    } else {
      af[0] = A[g * lda + k0 + t];
      af[1] = A[(g + 8) * lda + k0 + t];
      af[2] = A[g * lda + k0 + t + 4];
      af[3] = A[(g + 8) * lda + k0 + t + 4];
    }
    if (SCALE_A) {
      const float s0 = ka[k0 + t], s1 = ka[k0 + t + 4];
      af[0] *= s0;
      af[1] *= s0;
      af[2] *= s1;
      af[3] *= s1;
    }
    uint32_t ah[4], al[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) split_tf32_rna(af[e], ah[e], al[e]);
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      if (n < n_active) {
        float b0, b1;
        if (TB) {
          b0 = B[(n * 8 + g) * ldb + k0 + t];
          b1 = B[(n * 8 + g) * ldb + k0 + t + 4];
        } else {
          b0 = B[(k0 + t) * ldb + n * 8 + g];
          b1 = B[(k0 + t + 4) * ldb + n * 8 + g];
        }
        uint32_t bh0, bl0, bh1, bl1;
        split_tf32_rna(b0, bh0, bl0);
        split_tf32_rna(b1, bh1, bl1);
        mma_tf32(c[n], al, bh0, bh1);  // small terms first
        mma_tf32(c[n], ah, bl0, bl1);
        mma_tf32(c[n], ah, bh0, bh1);
      }
    }
  }
}

// Row / column (within the warp's 16 x 8 tile) of accumulator element e.
__device__ __forceinline__ int frag_row(int e) { return ((threadIdx.x & 31) >> 2) + (e >> 1) * 8; }
__device__ __forceinline__ int frag_col(int e) { return 2 * (threadIdx.x & 3) + (e & 1); }

// ---- loads ----------------------------------------------------------------------------------------

// dst[r][c] (row stride LD, NC columns, 64 rows) = src[r*stride + c] for r < rows and c < cols, else 0.
// 16-byte loads when whole rows are valid and aligned.
template <int NC, int LD>
__device__ __forceinline__ void load_tile(float* dst, const float* __restrict__ src, int64_t stride, int rows,
                                          int cols) {
  static_assert(NC % 4 == 0 && LD % 4 == 0, "tile widths are float4 multiples");
  const bool vec = cols == NC && stride % 4 == 0 && (reinterpret_cast<uintptr_t>(src) & 15) == 0;
  if (vec) {
    constexpr int NV = NC / 4;
    for (int idx = threadIdx.x; idx < kC * NV; idx += kThreads) {
      const int r = idx / NV, c4 = idx % NV;
      float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (r < rows) x = reinterpret_cast<const float4*>(src + r * stride)[c4];
      *reinterpret_cast<float4*>(dst + r * LD + c4 * 4) = x;
    }
  } else {
    for (int idx = threadIdx.x; idx < kC * NC; idx += kThreads) {
      const int r = idx / NC, c = idx % NC;
      dst[r * LD + c] = (r < rows && c < cols) ? src[r * stride + c] : 0.0f;
    }
  }
}

// Warp 0 only: Gd[t] = g_0 + ... + g_t in double (g = 0 past the L real rows), gam[t] = exp(Gd[t]).
__device__ __forceinline__ void chunk_decay(const float* __restrict__ g, int64_t t0, int L, int Hv, int p, double* Gd,
                                            float* gam) {
  const int lane = threadIdx.x & 31;
  gam[lane] = lane < L ? g[(t0 + lane) * Hv + p] : 0.0f;  // gam holds g until the sum is done
  gam[lane + 32] = lane + 32 < L ? g[(t0 + lane + 32) * Hv + p] : 0.0f;
  __syncwarp();
  if (lane == 0) {
    double cum = 0.0;
    for (int t = 0; t < kC; ++t) {
      cum += gam[t];
      Gd[t] = cum;
    }
  }
  __syncwarp();
  gam[lane] = static_cast<float>(exp(Gd[lane]));
  gam[lane + 32] = static_cast<float>(exp(Gd[lane + 32]));
}

// ---- kernel 1: per-chunk WY factors ---------------------------------------------------------------

template <int P>
constexpr size_t prep_smem_bytes() {
  return sizeof(float) * (kC * (P + 4) + kC * (P + 8) + 2 * kC * kLA + 2 * kC) + sizeof(double) * kC;
}

// Block (chunk c, V head p). Scratch: Wg, Ug [Hv][nc][64][P], QKg [Hv][nc][64][64].
template <int P>
__global__ void __launch_bounds__(kThreads, 2)
gdn_chunk_prep(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
               const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ Wg,
               float* __restrict__ Ug, float* __restrict__ QKg, int64_t M, int Hk, int Hv, int dk, int dv, int nc) {
  pdl_wait();
  constexpr int LK = P + 4, LV = P + 8;
  extern __shared__ __align__(16) float sm[];
  float* Ks = sm;              // [64][LK]  k rows, later scaled by beta Gam
  float* QV = Ks + kC * LK;    // [64][LV]  q rows (stride LK), then v rows (stride LV) scaled by beta
  float* Am = QV + kC * LV;    // [64][kLA] A
  float* Tm = Am + kC * kLA;   // [64][kLA] T = (I + A)^-1
  double* Gd = reinterpret_cast<double*>(Tm + kC * kLA);
  float* bet = reinterpret_cast<float*>(Gd + kC);
  float* gam = bet + kC;

  const int c = blockIdx.x, p = blockIdx.y, kh = p % Hk;
  const int64_t t0 = static_cast<int64_t>(c) * kC;
  const int L = static_cast<int>(M - t0 < kC ? M - t0 : kC);
  const int tid = threadIdx.x, warp = tid >> 5;
  const int64_t blk = static_cast<int64_t>(p) * nc + c;

  load_tile<P, LK>(Ks, k + (t0 * Hk + kh) * dk, static_cast<int64_t>(Hk) * dk, L, dk);
  load_tile<P, LK>(QV, q + (t0 * Hk + kh) * dk, static_cast<int64_t>(Hk) * dk, L, dk);
  if (warp == 0) {
    chunk_decay(g, t0, L, Hv, p, Gd, gam);
    const int lane = tid & 31;
    bet[lane] = lane < L ? beta[(t0 + lane) * Hv + p] : 0.0f;
    bet[lane + 32] = lane + 32 < L ? beta[(t0 + lane + 32) * Hv + p] : 0.0f;
  }
  __syncthreads();

  // K K^T -> A (warps 0-3) and Q K^T -> QK (warps 4-7), one 16-row strip each; n-tiles above the
  // diagonal are all masked and skipped.
  {
    const int mat = warp >> 2, rs = warp & 3;
    float acc[8][4] = {};
    warp_mma<8, false, true>(acc, (mat ? QV : Ks) + rs * 16 * LK, LK, Ks, LK, P, 2 * rs + 2);
    float* qk = QKg + blk * kC * kC;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int r = rs * 16 + frag_row(e), s = n * 8 + frag_col(e);
        float o[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int sc = s + h;
          const bool keep = mat ? sc <= r : sc < r;
          const float decay = keep ? static_cast<float>(exp(Gd[r] - Gd[sc])) : 0.0f;
          o[h] = !keep ? 0.0f : mat ? acc[n][e + h] * decay : bet[r] * decay * acc[n][e + h];
        }
        if (mat)
          *reinterpret_cast<float2*>(qk + r * kC + s) = make_float2(o[0], o[1]);
        else
          *reinterpret_cast<float2*>(Am + r * kLA + s) = make_float2(o[0], o[1]);
      }
    }
  }
  __syncthreads();

  // v rows into QV (q is done) while warps 0-1 solve (I + A) T = I one column each:
  //   T[t][s] = -sum_{r<t} A[t][r] T[r][s] (t > s), T[s][s] = 1, T[t][s] = 0 (t < s).
  // Every lane runs the same r range (T[r][s] = 0 for r < s adds nothing), so A[t][r] is a broadcast.
  load_tile<P, LV>(QV, v + (t0 * Hv + p) * dv, static_cast<int64_t>(Hv) * dv, L, dv);
  if (tid < kC) {
    const int s = tid;
    for (int t = 0; t < kC; ++t) {
      float val;
      if (t <= s) {
        val = t == s ? 1.0f : 0.0f;
      } else {
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
        const float* At = Am + t * kLA;
        int r = 0;
        for (; r + 4 <= t; r += 4) {
          const float4 a = *reinterpret_cast<const float4*>(At + r);
          a0 = fmaf(a.x, Tm[r * kLA + s], a0);
          a1 = fmaf(a.y, Tm[(r + 1) * kLA + s], a1);
          a2 = fmaf(a.z, Tm[(r + 2) * kLA + s], a2);
          a3 = fmaf(a.w, Tm[(r + 3) * kLA + s], a3);
        }
        for (; r < t; ++r) a0 = fmaf(At[r], Tm[r * kLA + s], a0);
        val = -((a0 + a1) + (a2 + a3));
      }
      Tm[t * kLA + s] = val;
    }
  }
  __syncthreads();
  // diag(beta Gam) K and diag(beta) V, in place
  for (int idx = tid; idx < kC * P; idx += kThreads) {
    const int r = idx / P, i = idx % P;
    Ks[r * LK + i] *= bet[r] * gam[r];
    QV[r * LV + i] *= bet[r];
  }
  __syncthreads();

  // W = T (beta Gam K) (warps 0-3), U~ = T (beta V) (warps 4-7); T is lower triangular, so a strip of
  // rows rs needs only the first (rs + 1) * 16 columns of T.
  {
    const int mat = warp >> 2, rs = warp & 3;
    float acc[P / 8][4] = {};
    warp_mma<P / 8, false, false>(acc, Tm + rs * 16 * kLA, kLA, mat ? QV : Ks, mat ? LV : LK, (rs + 1) * 16);
    float* dst = (mat ? Ug : Wg) + blk * kC * P;
#pragma unroll
    for (int n = 0; n < P / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int r = rs * 16 + frag_row(e), col = n * 8 + frag_col(e);
        *reinterpret_cast<float2*>(dst + r * P + col) = make_float2(acc[n][e], acc[n][e + 1]);
      }
  }
}

// ---- kernel 2: the state, chunk after chunk -------------------------------------------------------

template <int P, int CS>
constexpr size_t state_smem_bytes() {
  return sizeof(float) * (2 * kC * (P + 4) + kC * (P + 8) + kC * kLA + kC * (CS + 8) + P * (CS + 8) + 2 * kC) +
         sizeof(double) * kC;
}

// Block (V head p, value columns [j0, j0 + CS)).
template <int P, int CS>
__global__ void __launch_bounds__(kThreads, 1)
gdn_chunk_state(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ g,
                const float* __restrict__ Wg, const float* __restrict__ Ug, const float* __restrict__ QKg,
                float* __restrict__ state, float* __restrict__ out, int64_t M, int Hk, int Hv, int dk, int dv, int nc) {
  pdl_wait();
  constexpr int LW = P + 4, LKT = P + 8, LU = CS + 8;
  constexpr int NTO = CS / 16;                   // U / O: 4 strips x CS/8 n-tiles over 8 warps
  constexpr int NTS = (P / 16) * (CS / 8) / 8;   // S: P/16 strips x CS/8 n-tiles over 8 warps
  constexpr int WPS = (CS / 8) / NTS;            // warps per S strip
  static_assert(NTO >= 1 && NTS >= 1 && WPS * NTS == CS / 8, "tile split");
  extern __shared__ __align__(16) float sm[];
  float* Ws = sm;                // [64][LW]
  float* Qs = Ws + kC * LW;      // [64][LW]
  float* Ks = Qs + kC * LW;      // [64][LKT] (read transposed)
  float* QKs = Ks + kC * LKT;    // [64][kLA]
  float* Us = QKs + kC * kLA;    // [64][LU]  U~, then U
  float* Ss = Us + kC * LU;      // [P][LU]   the state slice S[i][j0 + j]
  double* Gd = reinterpret_cast<double*>(Ss + P * LU);
  float* gam = reinterpret_cast<float*>(Gd + kC);
  float* dl = gam + kC;          // exp(G_63 - G_s)

  const int p = blockIdx.x, j0 = blockIdx.y * CS, kh = p % Hk;
  const int tid = threadIdx.x, warp = tid >> 5;
  float* S0 = state + static_cast<int64_t>(p) * dk * dv;
  for (int idx = tid; idx < P * CS; idx += kThreads) {
    const int i = idx / CS, j = idx % CS;
    Ss[i * LU + j] = (i < dk && j0 + j < dv) ? S0[static_cast<int64_t>(i) * dv + j0 + j] : 0.0f;
  }

  const int rs = warp & 3, n0 = (warp >> 2) * NTO;             // U / O tiles
  const int ss = warp / WPS, n0s = (warp % WPS) * NTS;         // S tiles
  for (int c = 0; c < nc; ++c) {
    const int64_t t0 = static_cast<int64_t>(c) * kC;
    const int L = static_cast<int>(M - t0 < kC ? M - t0 : kC);
    const int64_t blk = static_cast<int64_t>(p) * nc + c;
    load_tile<P, LW>(Ws, Wg + blk * kC * P, P, kC, P);
    load_tile<P, LW>(Qs, q + (t0 * Hk + kh) * dk, static_cast<int64_t>(Hk) * dk, L, dk);
    load_tile<P, LKT>(Ks, k + (t0 * Hk + kh) * dk, static_cast<int64_t>(Hk) * dk, L, dk);
    load_tile<kC, kLA>(QKs, QKg + blk * kC * kC, kC, kC, kC);
    load_tile<CS, LU>(Us, Ug + blk * kC * P + j0, P, kC, CS);
    if (warp == 0) {
      chunk_decay(g, t0, L, Hv, p, Gd, gam);
      __syncwarp();
      const int lane = tid & 31;
      dl[lane] = static_cast<float>(exp(Gd[kC - 1] - Gd[lane]));
      dl[lane + 32] = static_cast<float>(exp(Gd[kC - 1] - Gd[lane + 32]));
    }
    __syncthreads();

    // U = U~ - W S0
    {
      float acc[NTO][4] = {};
      warp_mma<NTO, false, false>(acc, Ws + rs * 16 * LW, LW, Ss + n0 * 8, LU, P);
#pragma unroll
      for (int n = 0; n < NTO; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) Us[(rs * 16 + frag_row(e)) * LU + (n0 + n) * 8 + frag_col(e)] -= acc[n][e];
    }
    __syncthreads();

    // O = diag(Gam) Q S0 + QK U (QK lower triangular: strip rs needs columns < (rs + 1) * 16)
    {
      float acc[NTO][4] = {};
      warp_mma<NTO, false, false>(acc, Qs + rs * 16 * LW, LW, Ss + n0 * 8, LU, P);
#pragma unroll
      for (int n = 0; n < NTO; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] *= gam[rs * 16 + frag_row(e)];
      warp_mma<NTO, false, false>(acc, QKs + rs * 16 * kLA, kLA, Us + n0 * 8, LU, (rs + 1) * 16);
#pragma unroll
      for (int n = 0; n < NTO; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = rs * 16 + frag_row(e), j = j0 + (n0 + n) * 8 + frag_col(e);
          if (r < L && j < dv) out[((t0 + r) * Hv + p) * dv + j] = acc[n][e];
        }
    }
    // S = Gam_63 S0 + (K diag(dl))^T U, into registers until every warp has read S0
    float accS[NTS][4];
    {
      const float gl = gam[kC - 1];
#pragma unroll
      for (int n = 0; n < NTS; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) accS[n][e] = gl * Ss[(ss * 16 + frag_row(e)) * LU + (n0s + n) * 8 + frag_col(e)];
      warp_mma<NTS, true, false, true>(accS, Ks + ss * 16, LKT, Us + n0s * 8, LU, kC, NTS, dl);
    }
    __syncthreads();
#pragma unroll
    for (int n = 0; n < NTS; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) Ss[(ss * 16 + frag_row(e)) * LU + (n0s + n) * 8 + frag_col(e)] = accS[n][e];
    // the next chunk's loads touch only Ws..Us and Gd/gam/dl, which no warp reads after the barrier above
  }
  __syncthreads();
  for (int idx = tid; idx < P * CS; idx += kThreads) {
    const int i = idx / CS, j = idx % CS;
    if (i < dk && j0 + j < dv) S0[static_cast<int64_t>(i) * dv + j0 + j] = Ss[i * LU + j];
  }
}

int padded_head(int64_t head_k, int64_t head_v) {
  const int64_t h = head_k > head_v ? head_k : head_v;
  return h <= 32 ? 32 : h <= 64 ? 64 : 128;
}

template <int P>
void launch_p(const float* q, const float* k, const float* v, const float* g, const float* beta, float* state,
              float* out, int64_t M, int Hk, int Hv, int dk, int dv, float* scratch, cudaStream_t s) {
  constexpr int CS = P < 64 ? P : 64;
  constexpr size_t prep_bytes = prep_smem_bytes<P>(), state_bytes = state_smem_bytes<P, CS>();
  static const bool attrs_set = [] {
    cudaFuncSetAttribute(gdn_chunk_prep<P>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(prep_bytes));
    cudaFuncSetAttribute(gdn_chunk_state<P, CS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         static_cast<int>(state_bytes));
    return true;
  }();
  (void)attrs_set;
  const int nc = static_cast<int>((M + kC - 1) / kC);
  float* Wg = scratch;
  float* Ug = Wg + static_cast<int64_t>(Hv) * nc * kC * P;
  float* QKg = Ug + static_cast<int64_t>(Hv) * nc * kC * P;
  launch_pdl(gdn_chunk_prep<P>, dim3(nc, Hv), kThreads, prep_bytes, s, q, k, v, g, beta, Wg, Ug, QKg, M, Hk, Hv, dk, dv, nc);
  launch_pdl(gdn_chunk_state<P, CS>, dim3(Hv, P / CS), kThreads, state_bytes, s, q, k, g, Wg, Ug, QKg, state, out, M, Hk, Hv,
                                                                         dk, dv, nc);
}

}  // namespace

size_t gdn_chunked_scratch_floats(int64_t M, int64_t n_v_heads, int64_t head_k, int64_t head_v) {
  const int64_t P = padded_head(head_k, head_v);
  const int64_t nc = (M + kC - 1) / kC;
  return static_cast<size_t>(n_v_heads * nc * kC * (2 * P + kC));
}

void launch_gdn_chunked(const float* q, const float* k, const float* v, const float* g, const float* beta,
                        float* state, float* out, int64_t M, int64_t n_k_heads, int64_t n_v_heads, int64_t head_k,
                        int64_t head_v, float* scratch, cudaStream_t s) {
  if (M <= 0) return;
  const int Hk = static_cast<int>(n_k_heads), Hv = static_cast<int>(n_v_heads);
  const int dk = static_cast<int>(head_k), dv = static_cast<int>(head_v);
  switch (padded_head(head_k, head_v)) {
    case 32: launch_p<32>(q, k, v, g, beta, state, out, M, Hk, Hv, dk, dv, scratch, s); break;
    case 64: launch_p<64>(q, k, v, g, beta, state, out, M, Hk, Hv, dk, dv, scratch, s); break;
    default: launch_p<128>(q, k, v, g, beta, state, out, M, Hk, Hv, dk, dv, scratch, s); break;
  }
}

}  // namespace dflash::cuda
