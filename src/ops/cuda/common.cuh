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
#include <utility>

#include "ops/cuda/kernels.h"

namespace dflash::cuda {

constexpr int kWarp = 32;

__device__ __forceinline__ float fp16_to_f32(uint16_t h) { return __half2float(__ushort_as_half(h)); }
__device__ __forceinline__ float bf16_to_f32(uint16_t h) { return __uint_as_float(static_cast<uint32_t>(h) << 16); }

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K superblock from its 12 packed bytes
// (the 12-byte packing of SPEC 1.1: j < 4 in the low 6 bits, j >= 4 split over nibbles and top bits).
__device__ __forceinline__ void kquant_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

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

// NeoX RoPE of the pair (xh[d], xh[d + half]), half = n_rot / 2, at position pos. Same recipe as the
// CPU (Hugging Face's fp32 angles): inv_freq in double rounded to fp32, the angle pos * inv_freq in
// fp32, cos/sin in double of that angle, rounded; the rotation without fma. Shared by rope_kernel and
// the fused attention_prep kernel, so both give the same bits.
// The recipe in three steps, so that a kernel can take the parts that need no data early: rope_inv_freq
// (pair d), rope_cos_sin (at pos), rope_rotate (the pair's values a = x[d], b = x[d + half]).
__device__ __forceinline__ float rope_inv_freq(int64_t d, int64_t n_rot, double theta) {
  return static_cast<float>(1.0 / pow(theta, static_cast<double>(2 * d) / static_cast<double>(n_rot)));
}
__device__ __forceinline__ void rope_cos_sin(float inv_freq, int32_t pos, float& c, float& s) {
  const float angle = __fmul_rn(static_cast<float>(pos), inv_freq);
  double sd, cd;
  sincos(static_cast<double>(angle), &sd, &cd);
  c = static_cast<float>(cd), s = static_cast<float>(sd);
}
__device__ __forceinline__ void rope_rotate(float& a, float& b, float c, float s) {
  const float a0 = a, b0 = b;
  a = __fsub_rn(__fmul_rn(a0, c), __fmul_rn(b0, s));
  b = __fadd_rn(__fmul_rn(b0, c), __fmul_rn(a0, s));
}
__device__ __forceinline__ void rope_pair(float* xh, int64_t d, int64_t half, int64_t n_rot, int32_t pos,
                                          double theta) {
  float c, s;
  rope_cos_sin(rope_inv_freq(d, n_rot, theta), pos, c, s);
  float a = xh[d], b = xh[d + half];
  rope_rotate(a, b, c, s);
  xh[d] = a;
  xh[d + half] = b;
}

// Grouped launches (several weights sharing one input in one grid): part k owns the grid indices
// [parts[k - 1].cta_end, parts[k].cta_end) along one grid dimension. Returns the part that index b falls
// in and sets begin to its first index. Unrolled copies, no dynamic index into the kernel parameters.
template <class Part, int N>
__device__ __forceinline__ Part group_part(const Part (&parts)[N], int nparts, int b, int& begin) {
  Part pt = parts[0];
  begin = 0;
#pragma unroll
  for (int k = 1; k < N; ++k)
    if (k < nparts && b >= parts[k - 1].cta_end) {
      begin = parts[k - 1].cta_end;
      pt = parts[k];
    }
  return pt;
}

// get_rows kernels with one thread per element: element e of output row m = blockIdx.y, its id. The ids
// are device memory (the host cannot check them): an id outside [0, N) writes NaN. False when the thread
// has nothing more to do (e past K, or the NaN written).
__device__ __forceinline__ bool get_rows_element(int64_t K, int64_t N, const int32_t* __restrict__ ids,
                                                 float* __restrict__ y, int64_t& e, int64_t& m, int32_t& id) {
  e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  m = blockIdx.y;
  if (e >= K) return false;
  id = ids[m];
  if (id < 0 || id >= N) {
    y[m * K + e] = __int_as_float(0x7fc00000);
    return false;
  }
  return true;
}

// The sum of the parts ((p0 + p1) + p2) + ... of element i, parts part_stride floats apart. Every part's
// load is issued before the first add (a loop of load-then-add waits one L2 round trip per part: the
// residual norm after a 4-way k split paid ~0.9 us per launch for it, S16-4 against S15-4).
__device__ __forceinline__ float load_parts(const float* __restrict__ x, int64_t i, int parts, int64_t part_stride) {
  float v[kMaxParts];
  v[0] = x[i];
#pragma unroll
  for (int p = 1; p < kMaxParts; ++p)
    if (p < parts) v[p] = x[p * part_stride + i];
  float sum = v[0];
#pragma unroll
  for (int p = 1; p < kMaxParts; ++p)
    if (p < parts) sum = sum + v[p];
  return sum;
}

inline unsigned ceil_div_u(int64_t a, int64_t b) { return static_cast<unsigned>((a + b - 1) / b); }

// Programmatic dependent launch (SPEC 8): kernels are launched so that the next one may start while
// the previous one drains (its launch and ramp-up overlap the tail), and every kernel begins with
// pdl_wait(), which returns once the previous grid has completed and its writes are visible. Work
// that reads nothing the previous kernels wrote (the matmul's weight prefetch) may come before it.
// Rule: a kernel launched by launch_pdl must call pdl_wait() before it reads or writes data shared
// with earlier kernels, in every thread (a no-op when launched without the attribute).
// DFLASH_CUDA_PDL=0 launches without the attribute.
// After the wait, each CTA may also signal launch_dependents (trigger): once every CTA of this grid has
// (so all of them are resident), the next kernel's CTAs may be scheduled into the SMs' free slots while
// this one still runs. They do their independent prologue (the matmuls' first weight loads) and then
// block in their own pdl_wait() until this grid has completed and its writes are visible, so
// correctness does not depend on the signal; only how early the next weights stream does. Without it the
// next grid starts as this one's last CTAs exit (only the launch latency is hidden). Measured on the
// H200 (27B PTQ1_0): signalling in every kernel took decode from 6.11 to 5.88 ms but verify (8 rows) from
// 10.39 to 10.61 ms (round 6). The integer-mma matmul and its activation quantizer therefore signalled only
// at one row; every other kernel always does (round 8: the small kernels signalling at 8 rows too made
// verify 9.07 -> 8.97 ms and the draft step 1.29 -> 1.31 ms, decode unchanged). Round 15 measured the
// matmul signalling at up to 8 rows faster again (mma_signals in mma_gemv.cuh); the quantizer still
// signals at one row only.
__device__ __forceinline__ void pdl_wait(bool trigger = true) {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  if (trigger) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// Asynchronous 16-byte global -> shared copies (cp.async.cg: L2 only), their commit groups and the wait
// for all but the newest N groups. The "memory" clobbers keep the compiler from moving shared-memory
// accesses across them.
// kL1: through L1 instead (cp.async.ca), for data that the SM's other CTAs read too.
template <bool kL1 = false>
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (kL1)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Asks L2 for the 128-byte line holding p (no register, no wait). Kernels issue it before pdl_wait() for
// the constants they read late (norm weights): the weights of a decode step stream through L2, so a
// small weight read after the wait would otherwise pay a DRAM round trip on the step's critical path.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

bool pdl_enabled();  // cuda_backend.cpp (reads DFLASH_CUDA_PDL once)

// A kernel launch with programmatic dependent launch when `pdl` (the attribute is left out otherwise)
// and, when `cluster` has more than one CTA, as thread-block clusters of that shape. Returns the
// launch's error (launch_pdl leaves it to the backend's cudaGetLastError).
template <typename... Params, typename... Args>
inline cudaError_t launch_ex(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                             dim3 cluster, bool pdl, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (cluster.x * cluster.y * cluster.z > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster.x;
    attr[n].val.clusterDim.y = cluster.y;
    attr[n].val.clusterDim.z = cluster.z;
    ++n;
  }
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

template <typename... Params, typename... Args>
inline void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                       Args&&... args) {
  (void)launch_ex(kernel, grid, block, smem, s, dim3(1, 1, 1), pdl_enabled(), std::forward<Args>(args)...);
}

}  // namespace dflash::cuda
