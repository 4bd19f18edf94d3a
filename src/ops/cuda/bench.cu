// Diagnostics: a streaming-read kernel, the bandwidth floor the benchmarks compare against; the kernel
// chain that measures what one dependent kernel boundary costs inside a CUDA graph; the persistent
// streaming kernel that measures what a one-kernel decode step could stream.
#include <algorithm>

#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace dflash::cuda {
namespace {

// Words i, i + stride, i + 2 stride, ... of src[0, n): 16-byte loads, four in flight per iteration,
// XORed together so the loads cannot be dropped.
__device__ __forceinline__ unsigned xor_strided(const uint4* __restrict__ src, size_t n, size_t i, size_t stride) {
  unsigned acc = 0;
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
// This thread's grid-stride share of src[0, n).
__device__ __forceinline__ unsigned xor_stream(const uint4* __restrict__ src, size_t n) {
  return xor_strided(src, n, static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                     static_cast<size_t>(gridDim.x) * blockDim.x);
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


// ---- persistent streaming (persistent_stream_ms) ----------------------------------------------------------

// The hand-off between two ops of the persistent kernel: op i's arrival count at counters[i * kHandoffStride]
// (its own 256-byte line), polled by thread 0 of every CTA with ld.acquire. kRelease false: the arrival is
// __threadfence() then atomicAdd; true: one red.release.gpu add (orders the CTA's earlier writes without
// the full fence). (A done flag on another line, set by the last CTA to arrive and polled with a
// nanosleep back-off, was slower than both: S19-5.)
constexpr int kHandoffStride = 64;
template <bool kRelease>
__device__ __forceinline__ void arrive_gpu(unsigned* count) {
  __syncthreads();  // every thread of the CTA is done with the op
  if (threadIdx.x == 0) {
    if constexpr (kRelease) {
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(count) : "memory");
    } else {
      __threadfence();  // a real op's results would have to be visible before the arrival
      atomicAdd(count, 1u);
    }
  }
}
__device__ __forceinline__ void wait_all_arrived(const unsigned* count, unsigned ctas) {
  if (threadIdx.x == 0)
    while (load_acquire_gpu(count) < ctas) {
    }
  __syncthreads();
}

// One persistent grid (every CTA resident: a cooperative launch) streams op 0, 1, .. n_ops - 1: op i is
// the 16-byte words [bounds[i], bounds[i + 1]) of base, each CTA an even contiguous share. Between op i and
// op i + 1 every CTA arrives at counters[i] and waits until all have (the grid-wide dependency a decode
// kernel has between a matmul and the next op that needs its whole output). Before that wait the CTA
// copies the first head16 words of its share of the next op that has bytes into shared memory
// (cp.async: weights depend on no earlier op), so DRAM keeps streaming across the hand-off; after the
// wait it consumes them and streams the rest of its share (4 loads in flight per thread).
template <bool kRelease>
__global__ void __launch_bounds__(256) persistent_stream_kernel(const uint4* __restrict__ base,
                                                                const unsigned long long* __restrict__ bounds,
                                                                int n_ops, unsigned* counters, int head16,
                                                                unsigned* __restrict__ sink) {
  extern __shared__ __align__(16) uint4 head[];
  const unsigned ctas = gridDim.x;
  const auto share = [&](int i, unsigned long long& lo, unsigned long long& hi) {
    const unsigned long long b = bounds[i], len = bounds[i + 1] - b;
    lo = b + len * blockIdx.x / ctas;
    hi = b + len * (blockIdx.x + 1) / ctas;
  };
  // the head of op i's share into shared memory; returns its length in words
  const auto issue_head = [&](int i) {
    unsigned long long lo, hi;
    share(i, lo, hi);
    const unsigned long long len = hi - lo;
    const int n = len < static_cast<unsigned long long>(head16) ? static_cast<int>(len) : head16;
    for (int w = threadIdx.x; w < n; w += blockDim.x) cp_async16(head + w, base + lo + w);
    cp_async_commit();
    return n;
  };
  const auto has_bytes = [&](int i) { return bounds[i + 1] > bounds[i]; };
  const auto next_with_bytes = [&](int i) {  // the first op at or after i with bytes (n_ops: none)
    while (i < n_ops && !has_bytes(i)) ++i;
    return i;
  };
  unsigned acc = 0;
  int staged = 0;  // words of the staged head
  if (const int first = next_with_bytes(0); first < n_ops) staged = issue_head(first);
  for (int i = 0; i < n_ops; ++i) {
    if (i > 0) wait_all_arrived(counters + (i - 1) * kHandoffStride, ctas);
    const bool streams = has_bytes(i);
    if (streams) {
      cp_async_wait<0>();
      __syncthreads();
      for (int w = threadIdx.x; w < staged; w += blockDim.x) {
        const uint4 v = head[w];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
      }
      unsigned long long lo, hi;
      share(i, lo, hi);
      acc ^= xor_strided(base + lo + staged, hi - lo - staged, threadIdx.x, blockDim.x);  // the rest of the share
    }
    arrive_gpu<kRelease>(counters + i * kHandoffStride);  // (its barrier also frees the head buffer)
    // the next op's head is requested now, before this CTA waits for the others
    if (streams)
      if (const int j = next_with_bytes(i + 1); j < n_ops) staged = issue_head(j);
  }
  sink_xor(acc, sink);
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

int persistent_stream_ctas(int ctas_per_sm, int head_bytes) {
  for (auto* k : {persistent_stream_kernel<false>, persistent_stream_kernel<true>})
    if (cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, head_bytes) != cudaSuccess) return 0;
  int fit = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, persistent_stream_kernel<false>, 256, head_bytes) !=
      cudaSuccess)
    return 0;
  return std::min(fit, ctas_per_sm) * current_sm_count();
}

size_t persistent_stream_counter_words(int n_ops) { return static_cast<size_t>(n_ops) * kHandoffStride; }

cudaError_t launch_persistent_stream(const void* base, const unsigned long long* bounds, int n_ops,
                                     unsigned* counters, int head_bytes, int ctas, bool release, unsigned* sink,
                                     cudaStream_t s) {
  const auto* src = static_cast<const uint4*>(base);
  int head16 = head_bytes / 16;
  void* args[] = {&src, &bounds, &n_ops, &counters, &head16, &sink};
  // cooperative: the launch fails instead of deadlocking when the CTAs cannot all be resident
  const void* k = release ? reinterpret_cast<const void*>(persistent_stream_kernel<true>)
                       : reinterpret_cast<const void*>(persistent_stream_kernel<false>);
  return cudaLaunchCooperativeKernel(k, dim3(ctas), dim3(256), args, static_cast<size_t>(head_bytes), s);
}

}  // namespace dflash::cuda
