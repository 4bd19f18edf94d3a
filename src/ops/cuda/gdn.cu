// Gated DeltaNet delta-rule recurrence (SPEC 2.4), sequential over the rows.
//
// Columns j of a head's state S[i][j] (i = key dim, j = value dim) evolve independently given the
// sums over i, so a block takes one V head and 32 value columns: thread (g, jl) owns column j0 + jl and
// the key rows i = g, g + 4, g + 8, ... in registers (4 row groups). Per row:
//   S *= exp(g);  kv = S^T k;  delta = (v - kv) * beta;  S += k delta^T;  o = S^T q
// each sum over i = the group's partial (its rows in increasing order) combined as (g0 + g1) + (g2 + g3).
// The state stays in registers across the M rows; snapshots (verify's undo) get the state after each row.
// The rows' q, k, v, decay and beta are staged in shared memory kStageRows rows at a time.
#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace dflash::cuda {
namespace {

constexpr int kGroups = 4;

constexpr int kStageRows = 8;  // rows whose inputs are staged in shared memory at once (the verify block)

template <int kRPT>  // rows per thread: head_k <= kGroups * kRPT
__global__ void __launch_bounds__(kGroups * 32)
gdn_recurrent_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                     const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ state,
                     float* __restrict__ out, float* __restrict__ snapshots, int64_t M, int Hk, int Hv, int dk, int dv) {
  pdl_wait();
  constexpr int D = kGroups * kRPT;
  // Inputs of up to kStageRows rows at a time: their loads are all in flight together, instead of one
  // global round trip per row (verify's 8 rows).
  __shared__ float ks[kStageRows][D], qs[kStageRows][D], vs[kStageRows][32], decays[kStageRows], betas[kStageRows];
  __shared__ float red[2][kGroups][32];
  const int p = blockIdx.x;
  const int kh = p % Hk;
  const int jl = threadIdx.x & 31, grp = threadIdx.x >> 5;
  const int j = blockIdx.y * 32 + jl;
  const bool col_ok = j < dv;
  const int64_t head_state = static_cast<int64_t>(dk) * dv;
  float* S0 = state + p * head_state;

  float S[kRPT];
#pragma unroll
  for (int r = 0; r < kRPT; ++r) {
    const int i = grp + kGroups * r;
    S[r] = (col_ok && i < dk) ? S0[static_cast<int64_t>(i) * dv + j] : 0.0f;
  }

  for (int64_t m0 = 0; m0 < M; m0 += kStageRows) {
    const int rows = static_cast<int>(M - m0 < kStageRows ? M - m0 : kStageRows);
    __syncthreads();  // the previous stage's rows are done with ks / qs / vs
    for (int t = threadIdx.x; t < rows * dk; t += blockDim.x) {
      const int mm = t / dk, i = t % dk;
      ks[mm][i] = k[((m0 + mm) * Hk + kh) * dk + i];
      qs[mm][i] = q[((m0 + mm) * Hk + kh) * dk + i];
    }
    for (int t = threadIdx.x; t < rows * 32; t += blockDim.x) {
      const int mm = t / 32, jj = t % 32;
      const int jc = blockIdx.y * 32 + jj;
      vs[mm][jj] = jc < dv ? v[((m0 + mm) * Hv + p) * dv + jc] : 0.0f;
    }
    if (threadIdx.x < rows) {
      decays[threadIdx.x] = expf(g[(m0 + threadIdx.x) * Hv + p]);
      betas[threadIdx.x] = beta[(m0 + threadIdx.x) * Hv + p];
    }
    __syncthreads();
    for (int mm = 0; mm < rows; ++mm) {
      const int64_t m = m0 + mm;
      const float decay = decays[mm];
      const float b = betas[mm];
      const float vj = vs[mm][jl];
      float kv = 0.0f;
#pragma unroll
      for (int r = 0; r < kRPT; ++r) {
        const int i = grp + kGroups * r;
        if (i < dk) {
          S[r] *= decay;
          kv = fmaf(S[r], ks[mm][i], kv);
        }
      }
      red[0][grp][jl] = kv;
      __syncthreads();
      const float kv_all = (red[0][0][jl] + red[0][1][jl]) + (red[0][2][jl] + red[0][3][jl]);
      const float delta = (vj - kv_all) * b;
      float o = 0.0f;
#pragma unroll
      for (int r = 0; r < kRPT; ++r) {
        const int i = grp + kGroups * r;
        if (i < dk) {
          S[r] = fmaf(ks[mm][i], delta, S[r]);
          o = fmaf(S[r], qs[mm][i], o);
        }
      }
      red[1][grp][jl] = o;
      if (snapshots && col_ok) {
        float* snap = snapshots + m * static_cast<int64_t>(Hv) * head_state + p * head_state;
#pragma unroll
        for (int r = 0; r < kRPT; ++r) {
          const int i = grp + kGroups * r;
          if (i < dk) snap[static_cast<int64_t>(i) * dv + j] = S[r];
        }
      }
      __syncthreads();
      if (grp == 0 && col_ok)
        out[(m * Hv + p) * dv + j] = (red[1][0][jl] + red[1][1][jl]) + (red[1][2][jl] + red[1][3][jl]);
      // the next row overwrites red[0]; red[1] is read above before the next row's second barrier
      __syncthreads();
    }
  }
  if (col_ok) {
#pragma unroll
    for (int r = 0; r < kRPT; ++r) {
      const int i = grp + kGroups * r;
      if (i < dk) S0[static_cast<int64_t>(i) * dv + j] = S[r];
    }
  }
}

}  // namespace

void launch_gdn_recurrent(const float* q, const float* k, const float* v, const float* g, const float* beta,
                          float* state, float* out, float* snapshots, int64_t M, int64_t n_k_heads, int64_t n_v_heads,
                          int64_t head_k, int64_t head_v, cudaStream_t s) {
  if (M <= 0) return;
  const dim3 grid(static_cast<unsigned>(n_v_heads), ceil_div_u(head_v, 32));
  const int Hk = static_cast<int>(n_k_heads), Hv = static_cast<int>(n_v_heads);
  const int dk = static_cast<int>(head_k), dv = static_cast<int>(head_v);
  if (head_k <= 4 * 4)
    launch_pdl(gdn_recurrent_kernel<4>, grid, 128, 0, s, q, k, v, g, beta, state, out, snapshots, M, Hk, Hv, dk, dv);
  else if (head_k <= 4 * 8)
    launch_pdl(gdn_recurrent_kernel<8>, grid, 128, 0, s, q, k, v, g, beta, state, out, snapshots, M, Hk, Hv, dk, dv);
  else if (head_k <= 4 * 16)
    launch_pdl(gdn_recurrent_kernel<16>, grid, 128, 0, s, q, k, v, g, beta, state, out, snapshots, M, Hk, Hv, dk, dv);
  else if (head_k <= 4 * 32)
    launch_pdl(gdn_recurrent_kernel<32>, grid, 128, 0, s, q, k, v, g, beta, state, out, snapshots, M, Hk, Hv, dk, dv);
  else
    launch_pdl(gdn_recurrent_kernel<64>, grid, 128, 0, s, q, k, v, g, beta, state, out, snapshots, M, Hk, Hv, dk, dv);
}

}  // namespace dflash::cuda
