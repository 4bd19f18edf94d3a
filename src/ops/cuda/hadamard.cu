// Prism Hadamard (SPEC 3): one block per (row, chunk); the chunk is transformed in shared memory with
// the same butterflies, in the same order, as prism::fwht, then scaled by 1/sqrt(block). So the GPU
// result has the CPU's bits (no reduction trees are involved, only the same adds and products).
#include <cmath>

#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace dflash::cuda {
namespace {

__global__ void hadamard_kernel(const float* x, const float* __restrict__ signs, const int32_t* __restrict__ perm,
                                float* y, int64_t n, int block, bool inverse, float scale) {
  pdl_wait();
  extern __shared__ float a[];
  const int64_t r = blockIdx.y;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * block;
  const float* xr = x + r * n;
  for (int i = threadIdx.x; i < block; i += blockDim.x) {
    const int64_t g = c0 + i;
    if (inverse) {
      a[i] = xr[g];
    } else {
      const float v = xr[perm ? perm[g] : g];
      a[i] = signs ? signs[g] * v : v;
    }
  }
  __syncthreads();
  const int half = block / 2;
  for (int h = 1; h < block; h *= 2) {
    for (int p = threadIdx.x; p < half; p += blockDim.x) {
      const int i = (p / h) * 2 * h + (p % h);
      const float u = a[i], v = a[i + h];
      a[i] = u + v;
      a[i + h] = u - v;
    }
    __syncthreads();
  }
  float* yr = y + r * n;
  for (int i = threadIdx.x; i < block; i += blockDim.x) {
    const float v = a[i] * scale;
    yr[c0 + i] = (inverse && signs) ? v * signs[c0 + i] : v;
  }
}

}  // namespace

void launch_hadamard(const float* x, const float* signs, const int32_t* perm, float* y, int64_t rows, int64_t n,
                     int64_t block, bool inverse, cudaStream_t s) {
  if (rows <= 0 || n <= 0) return;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(block)));
  const int threads = static_cast<int>(block / 2 < 512 ? (block / 2 < 32 ? 32 : block / 2) : 512);
  const dim3 grid(static_cast<unsigned>(n / block), static_cast<unsigned>(rows));
  launch_pdl(hadamard_kernel, grid, threads, static_cast<size_t>(block) * sizeof(float), s, 
      x, signs, perm, y, n, static_cast<int>(block), inverse, scale);
}

}  // namespace dflash::cuda
