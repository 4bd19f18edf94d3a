// Diagnostics: a streaming-read kernel, the bandwidth floor the benchmarks compare against; the kernel
// chain that measures what one dependent kernel boundary costs inside a CUDA graph.
#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace dflash::cuda {
namespace {

// This thread's grid-stride share of src[0, n): 16-byte loads, four in flight per iteration, XORed
// together so the loads cannot be dropped.
__device__ __forceinline__ unsigned xor_stream(const uint4* __restrict__ src, size_t n) {
  unsigned acc = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = __ldcs(src + i), b = __ldcs(src + i + stride), c = __ldcs(src + i + 2 * stride),
                d = __ldcs(src + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n; i += stride) {
    const uint4 a = __ldcs(src + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  return acc;
}
// One word per block into the sink: the warps' XORs.
__device__ __forceinline__ void sink_xor(unsigned acc, unsigned* __restrict__ sink) {
  acc = __reduce_xor_sync(0xffffffffu, acc);
  if ((threadIdx.x & 31) == 0) atomicXor(sink + blockIdx.x, acc);
}

__global__ void read_kernel(const uint4* __restrict__ src, size_t n, unsigned* __restrict__ sink) {
  sink_xor(xor_stream(src, n), sink);
}

struct StreamRanges {
  const uint4* src[4];
  size_t n[4];
};

// The ranges one after the other. The loads start before the wait (weights depend on no earlier
// kernel, as in the matmuls) and the grid signals its dependents at once; it waits for its predecessor
// before it finishes, so a step stays ordered.
__global__ void stream_weights_kernel(const StreamRanges r, int nr, unsigned* __restrict__ sink) {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  unsigned acc = 0;
  for (int k = 0; k < 4 && k < nr; ++k) acc ^= xor_stream(r.src[k], r.n[k]);
  pdl_wait(false);
  sink_xor(acc, sink);
}

__global__ void empty_kernel() { pdl_wait(); }

__device__ __forceinline__ unsigned load_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// One link of the boundary chain: every CTA reads all kBoundaryWidth floats of `in` (the previous
// link's output; like a norm, it needs the whole row), sums them, and writes its grid-stride share of
// `out`. kSync says how it waits for the previous link: 0 stream order (launched without PDL), 1 PDL
// (griddepcontrol.wait: the previous grid has completed and flushed), 2 PDL launch and arrival counters
// (thread 0 spins on ld.acquire until the previous link's CTAs have all arrived; each CTA arrives after
// its stores with a fence and an atomic add), the synchronisation a persistent kernel would use.
template <int kSync>
__global__ void __launch_bounds__(256) boundary_kernel(const float* __restrict__ in, float* __restrict__ out,
                                                       unsigned* __restrict__ arrivals, int link, unsigned prev_ctas) {
  if constexpr (kSync == 1) pdl_wait();
  if constexpr (kSync == 2) {
    if (threadIdx.x == 0 && link > 0)
      while (load_acquire_gpu(arrivals + link - 1) < prev_ctas) {
      }
    __syncthreads();
  }
  if constexpr (kSync != 0) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  __shared__ float warp_sums[8];
  float s = 0.0f;
  for (int k = threadIdx.x; k < kBoundaryWidth; k += 256) s += in[k];
  s = warp_sum(s);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = s;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < 8; ++w) total += warp_sums[w];
  for (int k = blockIdx.x * 256 + threadIdx.x; k < kBoundaryWidth; k += gridDim.x * 256)
    out[k] = __fmaf_rn(in[k], 0.5f, total * 1e-9f);
  if constexpr (kSync == 2) {
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(arrivals + link, 1u);
    }
  }
}

}  // namespace

void launch_boundary_link(int sync, int ctas, const float* in, float* out, unsigned* arrivals, int link,
                          int prev_ctas, cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>(ctas)), block(256);
  const auto prev = static_cast<unsigned>(prev_ctas);
  if (sync == 0)
    (void)launch_ex(boundary_kernel<0>, grid, block, 0, s, dim3(1, 1, 1), false, in, out, arrivals, link, prev);
  else if (sync == 1)
    (void)launch_ex(boundary_kernel<1>, grid, block, 0, s, dim3(1, 1, 1), true, in, out, arrivals, link, prev);
  else
    (void)launch_ex(boundary_kernel<2>, grid, block, 0, s, dim3(1, 1, 1), true, in, out, arrivals, link, prev);
}

void launch_empty(cudaStream_t s) { launch_pdl(empty_kernel, dim3(1), dim3(32), 0, s); }

void launch_stream_weights(const void* const* src, const size_t* n16, int n, unsigned* sink, cudaStream_t s) {
  StreamRanges r{};
  n = n < 4 ? n : 4;
  for (int k = 0; k < n; ++k) {
    r.src[k] = static_cast<const uint4*>(src[k]);
    r.n[k] = n16[k];
  }
  launch_pdl(stream_weights_kernel, dim3(current_sm_count() * 4), dim3(512), 0, s, r, n, sink);
}

void launch_read_kernel(const void* src, size_t n16, unsigned* sink, cudaStream_t s) {
  read_kernel<<<current_sm_count() * 8, 512, 0, s>>>(static_cast<const uint4*>(src), n16, sink);
}

}  // namespace dflash::cuda
