// The DFlash 2 selector's greedy walk (SPEC 4.2 step 6) on the device, so that a speculative cycle
// keeps its drafts in device memory: the verify reads them from there and the host waits only once per
// cycle, for the accepted count (issue #7 item 3).
//
// One CTA walks the block rows in order (row p's choice is row p + 1's predecessor). Per row p:
//   pg[r] = pred[prev][r] * g[p][r]                          (all threads, elementwise)
//   the top_k successor rows of row p are staged in shared memory (coalesced; row stride rank + 1 so
//   that thread k's serial reads hit distinct banks)
//   thread k < top_k: e = sum_r pg[r] * succ[k][r] serially from 0.0f, S = unary + e (no fma: the
//   CPU's selector_walk rounds after every product and sum)
//   thread 0: the first k of the largest S (`k == 0 || S > best`, as the CPU), out[p] = cand[p][k]
// 27B drafter (7 rows x 16 candidates x rank 256): a few microseconds, against a host round trip.
#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace dflash::cuda {
namespace {

constexpr int kSelectorThreads = 256;

__global__ void __launch_bounds__(kSelectorThreads)
    selector_walk_kernel(const float* __restrict__ pred, const float* __restrict__ succ,
                         const int32_t* __restrict__ cand, const float* __restrict__ unary,
                         const float* __restrict__ g, int32_t* __restrict__ out, int rows, int top_k, int rank) {
  pdl_wait();
  extern __shared__ float sm[];
  float* pg = sm;                    // [rank]
  float* score = pg + rank;          // [top_k]
  float* srows = score + top_k;      // [top_k][rank + 1]
  __shared__ int best_k;
  const int tid = threadIdx.x;
  const float* prev = pred;  // the anchor's predecessor row
  for (int p = 0; p < rows; ++p) {
    for (int r = tid; r < rank; r += kSelectorThreads) pg[r] = __fmul_rn(prev[r], g[static_cast<int64_t>(p) * rank + r]);
    const float* sp = succ + static_cast<int64_t>(p) * top_k * rank;
    for (int i = tid; i < top_k * rank; i += kSelectorThreads) srows[(i / rank) * (rank + 1) + i % rank] = sp[i];
    __syncthreads();
    if (tid < top_k) {
      const float* s = srows + tid * (rank + 1);
      float e = 0.0f;
      for (int r = 0; r < rank; ++r) e = __fadd_rn(e, __fmul_rn(pg[r], s[r]));
      score[tid] = __fadd_rn(unary[static_cast<int64_t>(p) * top_k + tid], e);
    }
    __syncthreads();
    if (tid == 0) {
      int best = 0;
      float best_score = 0.0f;
      for (int k = 0; k < top_k; ++k)
        if (k == 0 || score[k] > best_score) {
          best = k;
          best_score = score[k];
        }
      best_k = best;
      out[p] = cand[static_cast<int64_t>(p) * top_k + best];
    }
    __syncthreads();  // best_k is set; pg, score and srows are free for the next row
    prev = pred + (1 + static_cast<int64_t>(p) * top_k + best_k) * rank;  // read only while p + 1 < rows
  }
}

}  // namespace

size_t selector_walk_smem_bytes(int64_t top_k, int64_t rank) {
  return sizeof(float) * static_cast<size_t>(rank + top_k + top_k * (rank + 1));
}

void launch_selector_walk(const float* pred, const float* succ, const int32_t* cand, const float* unary, const float* g,
                          int32_t* out, int64_t rows, int64_t top_k, int64_t rank, cudaStream_t s) {
  if (rows <= 0) return;
  const size_t smem = selector_walk_smem_bytes(top_k, rank);
  static size_t allowed = 48 * 1024;  // dynamic shared memory the kernel may take (raised on demand)
  if (smem > allowed) {
    cudaFuncSetAttribute(selector_walk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    allowed = smem;
  }
  launch_pdl(selector_walk_kernel, dim3(1), dim3(kSelectorThreads), smem, s, pred,
             succ, cand, unary, g, out, static_cast<int>(rows), static_cast<int>(top_k), static_cast<int>(rank));
}

}  // namespace dflash::cuda
