// tf32 tensor-core helpers (attention_prefill.cu: single tf32; attention_segments.cu's mma variant and
// gdn_chunked.cu: 3xTF32, fp32-like accuracy).
#pragma once

#include <cstdint>

namespace dflash::cuda {

// x rounded to tf32 (cvt.rna: to nearest, 10 explicit mantissa bits; the low 13 bits of the result are 0).
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

// x = hi + lo for 3xTF32: hi = x truncated to tf32 (the low 13 bits cleared), lo = x - hi (exact in
// fp32), passed as is: the mma reads a tf32 operand's top 19 bits and ignores the rest (round toward zero),
// so lo loses < 2^-10 of itself, < 2^-20 of x. An and and a subtraction per value instead of two cvt.rna
// and a subtraction. hi . hi + hi . lo + lo . hi: ~2^-19 of each product.
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = __float_as_uint(x) & 0xffffe000u;
  lo = __float_as_uint(x - __uint_as_float(hi));
}

// x = hi + lo with both parts rounded to nearest tf32 (two cvt.rna): gdn_chunked.cu's split (its bits).
__device__ __forceinline__ void split_tf32_rna(float x, uint32_t& hi, uint32_t& lo) {
  hi = to_tf32(x);
  lo = to_tf32(x - __uint_as_float(hi));
}

// d += a . b, m16n8k8, tf32 inputs, fp32 accumulators. Fragments (g = lane / 4, t = lane % 4):
// a0 (row g, k t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4); b0 (k t, col g), b1 (t + 4, g);
// d0 (row g, col 2t), d1 (g, 2t + 1), d2 (g + 8, 2t), d3 (g + 8, 2t + 1). An element of d depends only on
// its own row of a, its own column of b and its own d.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += a . b in 3xTF32 (a = ah + al, b = bh + bl): the small terms first, then ah . bh; al . bl dropped.
__device__ __forceinline__ void mma_3xtf32(float (&d)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4],
                                           const uint32_t (&bh)[2], const uint32_t (&bl)[2]) {
  mma_tf32(d, al, bh[0], bh[1]);
  mma_tf32(d, ah, bl[0], bl[1]);
  mma_tf32(d, ah, bh[0], bh[1]);
}

}  // namespace dflash::cuda
