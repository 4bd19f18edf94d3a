// Diagnostics: a streaming-read kernel, the bandwidth floor the benchmarks compare against.
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

}  // namespace

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
