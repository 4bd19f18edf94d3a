// The tail every matmul-input chain shares (chain.cu's kernels, the gated attention output in
// attention_segments.cu): the prism rotation of one 1024-chunk of a row held 4 elements per thread by a
// CTA of 256 threads (thread t: elements 4t .. 4t + 3), then the 1/32 scale, the rotated row and the
// integer matmuls' activation records (xq_record.cuh).
//
// The rotation: the signs, then the butterflies of prism::fwht (stage h = 1 .. 512, (a, b) -> (a + b,
// a - b), lower index first): h = 1, 2 in registers, h = 4 .. 64 across the lanes (shuffles), h = 128 ..
// 512 across the warps through shared memory (thread c < 128 takes elements c + 128 k, k = 0..7). Each
// stage completes before the next and every butterfly is prism::fwht's, so the bits are the hadamard
// op's. Warp w then holds quantization block w (elements 128 w .. 128 w + 127) from the first load to
// the records.
#pragma once

#include "ops/cuda/common.cuh"
#include "ops/cuda/xq_record.cuh"

namespace dflash::cuda {

constexpr int kChainChunk = 1024;   // rotation block of the chains
constexpr int kChainThreads = 256;  // 8 warps: one 128-element quantization block each

// 4 consecutive floats (one 16-byte access when p is aligned; p's alignment is the same in every
// thread of a launch, so the branch is uniform).
__device__ __forceinline__ void ld4(const float* p, float (&v)[4]) {
  if ((reinterpret_cast<uintptr_t>(p) & 15) == 0) {
    const float4 q = *reinterpret_cast<const float4*>(p);
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  } else {
    v[0] = p[0], v[1] = p[1], v[2] = p[2], v[3] = p[3];
  }
}
__device__ __forceinline__ void st4(float* p, const float (&v)[4]) {
  if ((reinterpret_cast<uintptr_t>(p) & 15) == 0) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    p[0] = v[0], p[1] = v[1], p[2] = v[2], p[3] = v[3];
  }
}
// One butterfly of prism::fwht: (a, b) -> (a + b, a - b), a the lower index.
__device__ __forceinline__ void butterfly(float& a, float& b) {
  const float u = a;
  a = __fadd_rn(u, b);
  b = __fsub_rn(u, b);
}

// The chunk's rotation in place (without the 1/32 scale): v times the signs sg when `signs`, then the
// 10 butterfly stages. buf: the CTA's shared [kChainChunk] floats. Every thread of the CTA calls it.
__device__ __forceinline__ void chunk_rotate(float (&v)[4], const float (&sg)[4], bool signs, float* buf, int tid,
                                             int lane) {
  if (signs)
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = __fmul_rn(sg[k], v[k]);
  butterfly(v[0], v[1]);  // h = 1
  butterfly(v[2], v[3]);
  butterfly(v[0], v[2]);  // h = 2
  butterfly(v[1], v[3]);
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {  // h = 4 m: the partner is lane ^ m
    const bool upper = lane & m;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float p = __shfl_xor_sync(0xffffffffu, v[k], m);
      v[k] = upper ? __fsub_rn(p, v[k]) : __fadd_rn(v[k], p);
    }
  }
  st4(buf + 4 * tid, v);
  __syncthreads();
  if (tid < kChainChunk / 8) {  // h = 128, 256, 512: elements tid + 128 k
    float u[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) u[k] = buf[tid + 128 * k];
#pragma unroll
    for (int h = 1; h < 8; h <<= 1)
#pragma unroll
      for (int k = 0; k < 8; ++k)
        if (!(k & h)) butterfly(u[k], u[k + h]);
#pragma unroll
    for (int k = 0; k < 8; ++k) buf[tid + 128 * k] = u[k];
  }
  __syncthreads();
  ld4(buf + 4 * tid, v);
}

// The chunk's output: v times 1/32 when rotated (exact; unrotated the values as they are), stored to y
// (the row's chunk, null: not stored) and, with xq, quantized by warp w as block (chunk c0 / 128 + w) of
// activation row r among `rows` (the records of quantize_xq_kernel, byte for byte).
__device__ __forceinline__ void chunk_store_quantize(const float (&v)[4], bool rotated, float* y, uint8_t* xq,
                                                     int32_t* meta, int64_t r, int64_t c0, int64_t rows, int tid,
                                                     int lane) {
  constexpr float kScale = 0.03125f;  // 1 / sqrt(1024), exact
  const float sc = rotated ? kScale : 1.0f;
  float e4[4] = {__fmul_rn(v[0], sc), __fmul_rn(v[1], sc), __fmul_rn(v[2], sc), __fmul_rn(v[3], sc)};
  if (y) st4(y + 4 * tid, e4);
  if (xq) {  // prefill leaves them out: the next matmul is the bf16 tensor-core GEMM, which reads y itself
    const int64_t blk = xq_record_index(r, c0 / 128 + (tid >> 5), rows);
    warp_quantize_xq(e4, lane, r, xq + blk * kXqRecordBytes, meta + blk * 4);
  }
}

}  // namespace dflash::cuda
