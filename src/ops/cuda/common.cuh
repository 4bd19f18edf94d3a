// Device helpers shared by the kernels of the CUDA backend.
//
// Precision notes: activations are fp32; exp/log use the accurate expf/logf (never the __expf fast
// path), so results stay within a few ulp of the CPU reference. Reductions use fixed trees (warp
// butterflies, then warps in index order), never atomics on floats, so a result depends only on the
// row's data and the op's sizes (SPEC 5.5).
#pragma once

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include <cstdint>

namespace dflash::cuda {

constexpr int kWarp = 32;

__device__ __forceinline__ float fp16_to_f32(uint16_t h) { return __half2float(__ushort_as_half(h)); }
__device__ __forceinline__ float bf16_to_f32(uint16_t h) { return __uint_as_float(static_cast<uint32_t>(h) << 16); }

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float softplus_f(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Sum over the 32 lanes by an xor butterfly: every lane ends with the same bits (each step adds the
// same two values in either order, and fp addition is commutative).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block sum in a fixed order: warp butterflies, then warp partials summed by warp 0 in a butterfly
// over the (up to 32) warps. `sh` holds >= 32 floats. Every thread returns the total.
__device__ __forceinline__ float block_sum(float v, float* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // sh may still be read by a previous call
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  float t = lane < nw ? sh[lane] : 0.0f;
  t = warp_sum(t);
  return t;
}

inline unsigned ceil_div_u(int64_t a, int64_t b) { return static_cast<unsigned>((a + b - 1) / b); }

}  // namespace dflash::cuda
