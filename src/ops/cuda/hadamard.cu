// Prism Hadamard (SPEC 3): every chunk of `block` elements goes through the same butterflies, in the
// same order, as prism::fwht (stage h = 1, 2, ..., block / 2; (a[i], a[i + h]) -> (a[i] + a[i + h],
// a[i] - a[i + h]) for i the lower index), then is scaled by 1/sqrt(block). So the GPU result has the
// CPU's bits (no reduction trees are involved, only the same adds and products).
//   hadamard_warp_kernel  block 32 .. 1024: one warp per chunk, in registers. Lane L holds elements
//                         32 j + L (j = 0 .. block/32 - 1; coalesced loads): the stages h = 1 .. 16 pair
//                         lanes L and L ^ h (shuffles), the stages h = 32 .. block/2 pair registers j
//                         and j + h/32 of one lane. No shared memory, no barriers.
//   hadamard_kernel       any other block (2 .. 16, 2048 .. 8192): one CTA per chunk, in shared memory.
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

constexpr int kHadamardWarps = 4;  // chunks (warps) per CTA of the register kernel

// E = block / 32 elements per lane. Chunk g of the launch (g = row * chunks_per_row + chunk) is warp
// g % kHadamardWarps of CTA g / kHadamardWarps. x may equal y (a warp reads only its own chunk before
// writing it) unless perm is set (the caller passes a copy then).
template <int E>
__global__ void __launch_bounds__(kHadamardWarps * 32)
hadamard_warp_kernel(const float* x, const float* __restrict__ signs, const int32_t* __restrict__ perm, float* y,
                     int64_t n, int64_t chunks_per_row, int64_t chunks, bool inverse, float scale) {
  pdl_wait();
  const int lane = threadIdx.x & 31;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kHadamardWarps + (threadIdx.x >> 5);
  if (g >= chunks) return;  // whole warps only (no barriers below)
  const int64_t r = g / chunks_per_row;
  const int64_t c0 = (g % chunks_per_row) * (32 * E) + lane;  // element c0 + 32 j of the row is v[j]
  const float* xr = x + r * n;
  float v[E];
  // Products with __fmul_rn: never contracted into the butterflies' adds (the CPU rounds each one).
  if (inverse || (!perm && !signs)) {
#pragma unroll
    for (int j = 0; j < E; ++j) v[j] = xr[c0 + 32 * j];
  } else if (!perm) {
#pragma unroll
    for (int j = 0; j < E; ++j) v[j] = __fmul_rn(signs[c0 + 32 * j], xr[c0 + 32 * j]);
  } else {
    int32_t p[E];
#pragma unroll
    for (int j = 0; j < E; ++j) p[j] = perm[c0 + 32 * j];
#pragma unroll
    for (int j = 0; j < E; ++j) v[j] = signs ? __fmul_rn(signs[c0 + 32 * j], xr[p[j]]) : xr[p[j]];
  }
  // Stages h = 1 .. 16: element i = 32 j + L pairs with i ^ h = 32 j + (L ^ h). The lower lane keeps
  // u + v (its own value first, as the CPU's a[i] + a[i + h]), the upper one u - v with u the partner's.
#pragma unroll
  for (int h = 1; h < 32; h <<= 1) {
    const bool upper = (lane & h) != 0;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const float o = __shfl_xor_sync(0xffffffffu, v[j], h);
      v[j] = upper ? __fsub_rn(o, v[j]) : __fadd_rn(v[j], o);
    }
  }
  // Stages h = 32 hh (hh = 1 .. E/2): registers j and j + hh of the same lane.
#pragma unroll
  for (int hh = 1; hh < E; hh <<= 1)
#pragma unroll
    for (int j = 0; j < E; ++j)
      if ((j & hh) == 0) {
        const float a = v[j], b = v[j + hh];
        v[j] = __fadd_rn(a, b);
        v[j + hh] = __fsub_rn(a, b);
      }
  float* yr = y + r * n;
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const float t = __fmul_rn(v[j], scale);
    yr[c0 + 32 * j] = (inverse && signs) ? __fmul_rn(t, signs[c0 + 32 * j]) : t;
  }
}

template <int E>
void launch_warp(const float* x, const float* signs, const int32_t* perm, float* y, int64_t rows, int64_t n,
                 bool inverse, float scale, cudaStream_t s) {
  const int64_t per_row = n / (32 * E), chunks = rows * per_row;
  launch_pdl(hadamard_warp_kernel<E>, dim3(ceil_div_u(chunks, kHadamardWarps)), kHadamardWarps * 32, 0, s, x, signs,
             perm, y, n, per_row, chunks, inverse, scale);
}

}  // namespace

void launch_hadamard(const float* x, const float* signs, const int32_t* perm, float* y, int64_t rows, int64_t n,
                     int64_t block, bool inverse, cudaStream_t s) {
  if (rows <= 0 || n <= 0) return;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(block)));
  switch (block) {
    case 32: launch_warp<1>(x, signs, perm, y, rows, n, inverse, scale, s); return;
    case 64: launch_warp<2>(x, signs, perm, y, rows, n, inverse, scale, s); return;
    case 128: launch_warp<4>(x, signs, perm, y, rows, n, inverse, scale, s); return;
    case 256: launch_warp<8>(x, signs, perm, y, rows, n, inverse, scale, s); return;
    case 512: launch_warp<16>(x, signs, perm, y, rows, n, inverse, scale, s); return;
    case 1024: launch_warp<32>(x, signs, perm, y, rows, n, inverse, scale, s); return;
    default: break;
  }
  const int threads = static_cast<int>(block / 2 < 512 ? (block / 2 < 32 ? 32 : block / 2) : 512);
  const dim3 grid(static_cast<unsigned>(n / block), static_cast<unsigned>(rows));
  launch_pdl(hadamard_kernel, grid, threads, static_cast<size_t>(block) * sizeof(float), s,
      x, signs, perm, y, n, static_cast<int>(block), inverse, scale);
}

}  // namespace dflash::cuda
