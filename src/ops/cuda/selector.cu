// The DFlash 2 selector's greedy walk (SPEC 4.2 step 6) on the device, so that a speculative cycle
// keeps its drafts in device memory: the verify reads them from there and the host waits only once per
// cycle, for the accepted count (issue #7 item 3).
//
// The walk is serial (row p's choice is row p + 1's predecessor), but every score it can read is known
// up front: row 0's predecessor is the anchor, row p >= 1's is one of row p - 1's top_k candidates. So
//   selector_pairs_kernel: one thread per (row p, predecessor j, candidate k) (the rows staged in shared
//     memory when a row's pairs fit one CTA: the 27B drafter's 16 x 16) computes
//     e = sum_r (pred_j[r] * g[p][r]) * succ[p][k][r]  serially from 0.0f, S = unary[p][k] + e
//     (no fma: the CPU's selector_walk rounds after every product and sum), into scores[p][j][k];
//   selector_walk_kernel: one thread walks the rows: j = 0 (the anchor) for row 0, then the first k of
//     the largest S[p][j][k] (`k == 0 || S > best`, as the CPU), out[p] = cand[p][k], j = k; from a copy
//     of the scores in shared memory when they fit 48 KB in 16-byte pieces (the 27B drafter's 7 KB).
// 27B drafter (7 rows x 16 x 16 pairs x rank 256): 1552 threads of 256 serial steps in parallel, where the
// one-CTA walk before ran 7 rows x 256 steps one after the other (43 us under ncu). Measured under ncu
// (H200, S6-2) with the rows read from global memory: 34 + 10.6 us, no better; the staged form's time
// alone was not measured (the draft step went 1.338 -> 1.324 ms with it and other changes).
#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace dflash::cuda {
namespace {

constexpr int kPairThreads = 256;
constexpr size_t kPairSmemMax = 48 * 1024;  // the staged path's shared memory (no opt-in needed)

// kStaged: the row's top_k predecessor and top_k successor rows and g go to shared memory first
// (coalesced loads, all in flight at once; row stride rank + 1 so that the threads' serial reads hit
// distinct banks), when a row's top_k^2 pairs fit one CTA and the rows fit kPairSmemMax. Otherwise each
// thread reads its rows from global memory. The same products and sums either way.
template <bool kStaged>
__global__ void __launch_bounds__(kPairThreads)
    selector_pairs_kernel(const float* __restrict__ pred, const float* __restrict__ succ,
                          const float* __restrict__ unary, const float* __restrict__ g, float* __restrict__ scores,
                          int top_k, int rank) {
  extern __shared__ float sm[];
  pdl_wait();
  const int p = blockIdx.x;
  const int i = blockIdx.y * kPairThreads + threadIdx.x, j = i / top_k, k = i % top_k;
  const int npred = p == 0 ? 1 : top_k;  // row 0 has one predecessor, the anchor
  const float* pred0 = pred + (p == 0 ? 0 : 1 + static_cast<int64_t>(p - 1) * top_k) * rank;
  const float* succ0 = succ + static_cast<int64_t>(p) * top_k * rank;
  const float* gp = g + static_cast<int64_t>(p) * rank;
  const float *pj, *sk, *gs;
  int stride = rank;
  if constexpr (kStaged) {
    stride = rank + 1;
    float* sp = sm;                                          // [npred][rank + 1]
    float* ss = sp + static_cast<int64_t>(top_k) * stride;  // [top_k][rank + 1]
    float* sg = ss + static_cast<int64_t>(top_k) * stride;  // [rank]
    for (int e = threadIdx.x; e < npred * rank; e += kPairThreads) sp[(e / rank) * stride + e % rank] = pred0[e];
    for (int e = threadIdx.x; e < top_k * rank; e += kPairThreads) ss[(e / rank) * stride + e % rank] = succ0[e];
    for (int e = threadIdx.x; e < rank; e += kPairThreads) sg[e] = gp[e];
    __syncthreads();
    pj = sp + static_cast<int64_t>(j) * stride;
    sk = ss + static_cast<int64_t>(k) * stride;
    gs = sg;
  } else {
    pj = pred0 + static_cast<int64_t>(j) * rank;
    sk = succ0 + static_cast<int64_t>(k) * rank;
    gs = gp;
  }
  if (j >= npred) return;
  float e = 0.0f;
#pragma unroll 8
  for (int r = 0; r < rank; ++r) e = __fadd_rn(e, __fmul_rn(__fmul_rn(pj[r], gs[r]), sk[r]));
  scores[(static_cast<int64_t>(p) * top_k + j) * top_k + k] = __fadd_rn(unary[static_cast<int64_t>(p) * top_k + k], e);
}

// kStaged (scores 16-byte aligned, a multiple of 4 floats, <= 48 KB): the warp copies every row's scores
// to shared memory first (one round trip, all pieces in flight), so the walk's rows, each chosen by the
// previous row's best, are not a chain of global loads (7 dependent trips at the 27B drafter's shape).
// Otherwise thread 0 reads them from global memory.
template <bool kStaged>
__global__ void selector_walk_kernel(const float* __restrict__ scores, const int32_t* __restrict__ cand,
                                     int32_t* __restrict__ out, int rows, int top_k) {
  extern __shared__ __align__(16) float staged[];
  pdl_wait();
  const float* src = scores;
  if constexpr (kStaged) {
    // cp.async: every 16-byte piece is in flight at once, no registers held (a plain copy loop waited for
    // each load before its store: 56 round trips at the 27B shape, S24-5).
    const int pieces = rows * top_k * top_k / 4;
    for (int e = static_cast<int>(threadIdx.x); e < pieces; e += static_cast<int>(blockDim.x))
      cp_async16(staged + 4 * e, scores + 4 * e);
    cp_async_commit();
    cp_async_wait<0>();
    __syncwarp();
    src = staged;
  }
  if (threadIdx.x != 0) return;
  int j = 0;
  for (int p = 0; p < rows; ++p) {
    const float* S = src + (static_cast<int64_t>(p) * top_k + j) * top_k;
    int best = 0;
    float best_score = 0.0f;
    for (int k = 0; k < top_k; ++k)
      if (k == 0 || S[k] > best_score) {
        best = k;
        best_score = S[k];
      }
    out[p] = cand[static_cast<int64_t>(p) * top_k + best];
    j = best;
  }
}

}  // namespace

size_t selector_walk_scratch_bytes(int64_t rows, int64_t top_k) {
  return sizeof(float) * static_cast<size_t>(rows * top_k * top_k);
}

void launch_selector_walk(const float* pred, const float* succ, const int32_t* cand, const float* unary, const float* g,
                          int32_t* out, int64_t rows, int64_t top_k, int64_t rank, void* scratch, cudaStream_t s) {
  if (rows <= 0) return;
  auto* scores = static_cast<float*>(scratch);
  const dim3 grid(static_cast<unsigned>(rows), ceil_div_u(top_k * top_k, kPairThreads));
  const size_t staged = sizeof(float) * static_cast<size_t>(2 * top_k * (rank + 1) + rank);
  if (top_k * top_k <= kPairThreads && staged <= kPairSmemMax)
    launch_pdl(selector_pairs_kernel<true>, grid, dim3(kPairThreads), staged, s, pred, succ, unary, g, scores,
               static_cast<int>(top_k), static_cast<int>(rank));
  else
    launch_pdl(selector_pairs_kernel<false>, grid, dim3(kPairThreads), 0, s, pred, succ, unary, g, scores,
               static_cast<int>(top_k), static_cast<int>(rank));
  const size_t walk_bytes = selector_walk_scratch_bytes(rows, top_k);
  if (walk_bytes <= kPairSmemMax && walk_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(scores) % 16 == 0)
    launch_pdl(selector_walk_kernel<true>, dim3(1), dim3(32), walk_bytes, s, scores, cand, out,
               static_cast<int>(rows), static_cast<int>(top_k));
  else
    launch_pdl(selector_walk_kernel<false>, dim3(1), dim3(32), 0, s, scores, cand, out, static_cast<int>(rows),
               static_cast<int>(top_k));
}

}  // namespace dflash::cuda
