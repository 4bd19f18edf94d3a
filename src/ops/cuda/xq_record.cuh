// The integer matmuls' activation record (mma_gemv.cuh) written by one warp for one block of 128 inputs,
// for kernels that produce a matmul input and quantize it on the way out (the chains, the drafter's
// conv): the next ternary / K-quant matmul then skips its quantize launch (the backend's xq cache).
// Byte for byte what quantize_x24_kernel writes for the same 128 floats: E = (frexp exponent of the
// block's largest |x|) - 6, so that largest |x| 2^-E lies in [32, 64); u = rint(x 2^(16-E)); the three
// signed digit planes in mma B-fragment order; the meta (S, 2^(E-16), 0, 0) with S = sum u, the block's
// digit sum (|S| < 2^29), which the ternary matmul subtracts to turn its codes c = w + 1 back into w.
//
// Layout: block-major, [dim / 128][rows][384 B] records, then meta [dim / 128][rows][4] (xq_meta()), so
// the rows of one block that a matmul CTA stages (up to 8) are one contiguous run of 384-byte records:
// its copy is a fixed set of 16-byte pieces from one base pointer per block.
#pragma once

#include "ops/cuda/common.cuh"

namespace dflash::cuda {

constexpr int kXqRecordBytes = 384;  // 3 digit planes of 128 bytes

// E of a block whose largest |x| is amax: amax 2^-E lies in [32, 64) (E = -6 for a zero or non-finite amax).
__device__ __forceinline__ int x24_exponent(float amax) {
  int ex = 0;
  if (amax > 0.0f && isfinite(amax)) frexpf(amax, &ex);  // amax = f 2^ex, f in [0.5, 1)
  return ex - 6;
}
// u = rint(x 2^(16-E)) (|u| < 2^22) as three signed bytes, u = 65536 d0 + 256 d1 + d2 (|d0| <= 64);
// returns u (the records' digit sum S adds these).
__device__ __forceinline__ int x24_digits(float x, int E, int& d0, int& d1, int& d2) {
  const int u = __float2int_rn(ldexpf(x, 16 - E));
  d2 = static_cast<int8_t>(u & 0xff);
  const int u1 = (u - d2) >> 8;
  d1 = static_cast<int8_t>(u1 & 0xff);
  d0 = (u1 - d1) >> 8;
  return u;
}

// Record index of (row, block b) among `rows` rows: block-major.
__device__ __forceinline__ int64_t xq_record_index(int64_t row, int64_t b, int64_t rows) { return b * rows + row; }

// The two 16-byte halves of each 32-byte lane-quad chunk of a plane (words 0-3 | 4-7) trade places in
// the records of odd rows. The matmul stages a CTA's records at a 384-byte row stride (a multiple of the
// 128-byte bank period), so without it the 8 rows' lanes of a B-fragment load hit the same 4 banks:
// 8 shared wavefronts per 16-byte load instead of 4 (ncu at 8 rows: 25 % of the kernel's shared
// wavefronts). Rows are counted from the launch's first (a multiple of 8: kCols), so parity is the
// stage row's. A layout only: the digits are the same.
__host__ __device__ constexpr int xq_half_swizzle(int64_t row) { return (row & 1) ? 16 : 0; }

// Lane L holds elements 4L .. 4L + 3 of the block in e4; rec: the block's 384-byte record of activation
// row `row`; meta: its 4 ints.
__device__ __forceinline__ void warp_quantize_x24(const float (&e4)[4], int lane, int64_t row, uint8_t* rec,
                                                  int32_t* meta) {
  float amax = fmaxf(fmaxf(fabsf(e4[0]), fabsf(e4[1])), fmaxf(fabsf(e4[2]), fabsf(e4[3])));
  const int E = x24_exponent(warp_max(amax));
  uint32_t plane[3] = {0, 0, 0};
  int s = 0;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    int d0, d1, d2;
    s += x24_digits(e4[e], E, d0, d1, d2);
    plane[0] |= static_cast<uint32_t>(d0 & 0xff) << (8 * e);
    plane[1] |= static_cast<uint32_t>(d1 & 0xff) << (8 * e);
    plane[2] |= static_cast<uint32_t>(d2 & 0xff) << (8 * e);
  }
  // Element k = 4L + e of the block sits at byte t*32 + ((2j + h)*4 ^ swizzle) + e (k = 32j + 16h + 4t + e).
  uint8_t* at = rec + (lane & 3) * 32 + ((((lane >> 3) * 2 + ((lane >> 2) & 1)) * 4) ^ xq_half_swizzle(row));
#pragma unroll
  for (int p = 0; p < 3; ++p) *reinterpret_cast<uint32_t*>(at + 128 * p) = plane[p];
  const int total = __reduce_add_sync(0xffffffffu, s);
  if (lane == 0) *reinterpret_cast<int4*>(meta) = make_int4(total, __float_as_int(ldexpf(1.0f, E - 16)), 0, 0);
}

// The records' meta follows the digit planes: [dim / 128][rows][4] after [dim / 128][rows][384 B]; null
// without records.
inline int32_t* xq_meta(uint8_t* xq, int64_t rows, int64_t dim) {
  return xq ? reinterpret_cast<int32_t*>(xq + static_cast<size_t>(rows) * (dim / 128) * kXqRecordBytes) : nullptr;
}

}  // namespace dflash::cuda
