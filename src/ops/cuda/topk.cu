// argmax and top-k over long rows (the 248320-entry vocabulary).
//
// argmax: blocks scan chunks of a row; a block's best (value, lowest index) becomes a 64-bit key
// (order-preserving value bits << 32 | ~index) and atomicMax merges the blocks. A max is exact, so the
// result does not depend on the order in which blocks finish. NaN is treated as the smallest value
// (the CPU reference skips NaN unless it sits at index 0) and -0 as +0.
//
// top_k: rounds of "sort chunks of 4096 (value, index) pairs in shared memory by a bitonic network and
// keep each chunk's first k" until one chunk per row remains. The order is total (larger value first,
// then lower index), so the result is exact: the CPU's ids and values. NaN is sorted as -inf.
#include <cfloat>
#include <climits>

#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace dflash::cuda {
namespace {

constexpr int kArgmaxChunk = 8192;
constexpr int kSortN = 4096;
constexpr int kSortThreads = 512;

__device__ __forceinline__ uint32_t ordered_bits(float f) {
  if (f != f) return 0u;   // NaN: below everything
  if (f == 0.0f) f = 0.0f;  // -0 == +0
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__global__ void argmax_kernel(const float* __restrict__ x, unsigned long long* __restrict__ best, int64_t n) {
  pdl_wait();
  const int64_t m = blockIdx.y;
  const float* xr = x + m * n;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kArgmaxChunk;
  const int64_t c1 = c0 + kArgmaxChunk < n ? c0 + kArgmaxChunk : n;
  unsigned long long key = 0;
  for (int64_t i = c0 + threadIdx.x; i < c1; i += blockDim.x) {
    const unsigned long long kk =
        (static_cast<unsigned long long>(ordered_bits(xr[i])) << 32) | (0xffffffffu - static_cast<uint32_t>(i));
    key = kk > key ? kk : key;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, o);
    key = other > key ? other : key;
  }
  __shared__ unsigned long long sh[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sh[warp] = key;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) key = sh[w] > key ? sh[w] : key;
    atomicMax(best + m, key);
  }
}

__global__ void argmax_finish_kernel(const unsigned long long* __restrict__ best, int32_t* ids, int64_t M) {
  pdl_wait();
  const int64_t m = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (m < M) ids[m] = static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(best[m] & 0xffffffffu));
}

struct Entry {
  float v;
  int32_t i;
};

__device__ __forceinline__ bool before(const Entry& a, const Entry& b) { return a.v > b.v || (a.v == b.v && a.i < b.i); }

// One block sorts chunk blockIdx.x of row blockIdx.y (count entries of the row; src_idx null means the
// index is the position) and writes its first k entries to dst [rows][n_chunks][k].
__global__ void __launch_bounds__(kSortThreads)
topk_chunk_kernel(const float* __restrict__ src_v, const int32_t* __restrict__ src_i, int64_t count,
                  int64_t row_stride, float* __restrict__ dst_v, int32_t* __restrict__ dst_i, int k, int n_chunks) {
  pdl_wait();
  __shared__ Entry a[kSortN];
  const int64_t m = blockIdx.y;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kSortN;
  for (int t = threadIdx.x; t < kSortN; t += blockDim.x) {
    const int64_t g = c0 + t;
    Entry e{-INFINITY, INT_MAX};
    if (g < count) {
      float v = src_v[m * row_stride + g];
      if (v != v) v = -INFINITY;
      e.v = v;
      e.i = src_i ? src_i[m * row_stride + g] : static_cast<int32_t>(g);
    }
    a[t] = e;
  }
  __syncthreads();
  for (int size = 2; size <= kSortN; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int t = threadIdx.x; t < kSortN; t += blockDim.x) {
        const int u = t ^ stride;
        if (u > t) {
          const bool first_half = (t & size) == 0;
          const Entry x = a[t], y = a[u];
          const bool swap = first_half ? before(y, x) : before(x, y);
          if (swap) {
            a[t] = y;
            a[u] = x;
          }
        }
      }
      __syncthreads();
    }
  }
  for (int t = threadIdx.x; t < k; t += blockDim.x) {
    const int64_t o = (m * n_chunks + blockIdx.x) * k + t;
    dst_v[o] = a[t].v;
    dst_i[o] = a[t].i;
  }
}

}  // namespace

size_t argmax_scratch_bytes(int64_t M) { return static_cast<size_t>(M) * sizeof(unsigned long long); }

void launch_argmax(const float* x, int32_t* ids, int64_t M, int64_t n, void* scratch, cudaStream_t s) {
  if (M <= 0) return;
  auto* best = static_cast<unsigned long long*>(scratch);
  cudaMemsetAsync(best, 0, argmax_scratch_bytes(M), s);
  launch_pdl(argmax_kernel, dim3(ceil_div_u(n, kArgmaxChunk), static_cast<unsigned>(M)), 256, 0, s, x, best, n);
  launch_pdl(argmax_finish_kernel, ceil_div_u(M, 128), 128, 0, s, best, ids, M);
}

// Two ping-pong candidate buffers of M * ceil(n / kSortN) * k entries each.
size_t topk_scratch_bytes(int64_t M, int64_t n, int64_t k) {
  const int64_t chunks = (n + kSortN - 1) / kSortN;
  return 2 * static_cast<size_t>(M) * chunks * k * (sizeof(float) + sizeof(int32_t)) + 256;
}

void launch_top_k(const float* x, int32_t* ids, float* vals, int64_t M, int64_t n, int64_t k, void* scratch,
                  cudaStream_t s) {
  if (M <= 0) return;
  const int64_t max_chunks = (n + kSortN - 1) / kSortN;
  const size_t cap = static_cast<size_t>(M) * max_chunks * k;
  float* bv[2];
  int32_t* bi[2];
  char* p = static_cast<char*>(scratch);
  bv[0] = reinterpret_cast<float*>(p);
  bi[0] = reinterpret_cast<int32_t*>(p + cap * 4);
  bv[1] = reinterpret_cast<float*>(p + cap * 8);
  bi[1] = reinterpret_cast<int32_t*>(p + cap * 12);
  const float* cur_v = x;
  const int32_t* cur_i = nullptr;
  int64_t count = n, stride = n;
  int which = 0;
  while (true) {
    const int64_t chunks = (count + kSortN - 1) / kSortN;
    const bool last = chunks == 1;
    float* dv = last ? vals : bv[which];
    int32_t* di = last ? ids : bi[which];
    launch_pdl(topk_chunk_kernel, dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(M)), kSortThreads, 0, s, 
        cur_v, cur_i, count, stride, dv, di, static_cast<int>(k), static_cast<int>(chunks));
    if (last) break;
    cur_v = bv[which];
    cur_i = bi[which];
    count = chunks * k;
    stride = chunks * k;
    which ^= 1;
  }
}

}  // namespace dflash::cuda
