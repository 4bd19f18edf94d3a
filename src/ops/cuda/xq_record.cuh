// The integer matmuls' activation record (mma_gemv.cuh) written by one warp for one block of 128 inputs,
// for kernels that produce a matmul input and quantize it on the way out (the chains, the drafter's
// conv): the next ternary / K-quant matmul then skips its quantize launch (the backend's xq cache).
// Byte for byte what quantize_xq_kernel writes for the same 128 floats: E = (frexp exponent of the
// block's largest |x|) - 6, so that largest |x| 2^-E lies in [32, 64); u = rint(x 2^(kXqShift-E)); the
// kXqPlanes signed digit planes in mma B-fragment order; the meta (S, 2^(E-kXqShift), 0, 0) with S = sum u,
// the block's digit sum, which the ternary matmul subtracts to turn its codes c = w + 1 back into w.
//
// Precision (kXqPlanes). Each plane is one more mma n-tile per 8 activation rows and one more plane
// sum per output, so the planes are what an 8-row (verify, draft) matmul's instruction count grows
// with (S24-2, S27-3: those kernels are issue-bound). 2 planes: u = rint(x 2^(8-E)), |u| < 2^14, a
// rounding error <= 2^-14 of the block's largest |x| (the integer matmuls' NMSE against the CPU's fp32
// ~1e-9; bf16 activations would be 2^-9 of each element, llama.cpp's q8_1 2^-8 of the block's
// largest). 3 planes (the rounds 3-28 records): |u| < 2^22, <= 2^-22, fp32 level (NMSE ~1e-14).
// Either way the integer sums are exact and the per-row arithmetic does not depend on M, so rows stay
// bit-identical to single-row calls.
//
// Layout: block-major, [dim / 128][rows][kXqRecordBytes] records, then meta [dim / 128][rows][4]
// (xq_meta()), so the rows of one block that a matmul CTA stages (up to 8) are one contiguous run of
// records: its copy is a fixed set of 16-byte pieces from one base pointer per block.
#pragma once

#include "ops/cuda/common.cuh"

namespace dflash::cuda {

constexpr int kXqPlanes = 2;                          // digit planes per record (2 or 3, above)
constexpr int kXqShift = 8 * (kXqPlanes - 1);         // u = rint(x 2^(kXqShift - E))
constexpr int kXqRecordBytes = 128 * kXqPlanes;       // one plane: 128 signed bytes
static_assert(kXqPlanes == 2 || kXqPlanes == 3, "the matmuls combine 2 or 3 digit planes");

// E of a block whose largest |x| is amax: amax 2^-E lies in [32, 64) (E = -6 for a zero or non-finite amax).
__device__ __forceinline__ int xq_exponent(float amax) {
  int ex = 0;
  if (amax > 0.0f && isfinite(amax)) frexpf(amax, &ex);  // amax = f 2^ex, f in [0.5, 1)
  return ex - 6;
}
// u = rint(x 2^(kXqShift-E)) (|u| < 2^(kXqShift+6)) as kXqPlanes signed bytes, most significant first:
// u = 256 d[0] + d[1] (2 planes) or 65536 d[0] + 256 d[1] + d[2] (3), |d[0]| <= 64; returns u (the
// records' digit sum S adds these).
__device__ __forceinline__ int xq_digits(float x, int E, int (&d)[kXqPlanes]) {
  int u = __float2int_rn(ldexpf(x, kXqShift - E));
  const int r = u;
#pragma unroll
  for (int p = kXqPlanes - 1; p > 0; --p) {
    d[p] = static_cast<int8_t>(u & 0xff);
    u = (u - d[p]) >> 8;
  }
  d[0] = u;
  return r;
}
// 2^(E - kXqShift): the value of one unit of u (the meta's scale).
__device__ __forceinline__ float xq_unit(int E) { return ldexpf(1.0f, E - kXqShift); }

// Record index of (row, block b) among `rows` rows: block-major.
__device__ __forceinline__ int64_t xq_record_index(int64_t row, int64_t b, int64_t rows) { return b * rows + row; }

// The two 16-byte halves of each 32-byte lane-quad chunk of a plane (words 0-3 | 4-7) trade places in
// the records of odd rows. The matmul stages a CTA's records at a kXqRecordBytes row stride (a multiple of
// the 128-byte bank period), so without it the 8 rows' lanes of a B-fragment load hit the same 4 banks:
// 8 shared wavefronts per 16-byte load instead of 4 (ncu at 8 rows: 25 % of the kernel's shared
// wavefronts). Rows are counted from the launch's first (a multiple of 8: kCols), so parity is the
// stage row's. A layout only: the digits are the same.
__host__ __device__ constexpr int xq_half_swizzle(int64_t row) { return (row & 1) ? 16 : 0; }

// Lane L holds elements 4L .. 4L + 3 of the block in e4; rec: the block's record of activation row
// `row`; meta: its 4 ints.
__device__ __forceinline__ void warp_quantize_xq(const float (&e4)[4], int lane, int64_t row, uint8_t* rec,
                                                 int32_t* meta) {
  float amax = fmaxf(fmaxf(fabsf(e4[0]), fabsf(e4[1])), fmaxf(fabsf(e4[2]), fabsf(e4[3])));
  const int E = xq_exponent(warp_max(amax));
  uint32_t plane[kXqPlanes] = {};
  int s = 0;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    int d[kXqPlanes];
    s += xq_digits(e4[e], E, d);
#pragma unroll
    for (int p = 0; p < kXqPlanes; ++p) plane[p] |= static_cast<uint32_t>(d[p] & 0xff) << (8 * e);
  }
  // Element k = 4L + e of the block sits at byte t*32 + ((2j + h)*4 ^ swizzle) + e (k = 32j + 16h + 4t + e).
  uint8_t* at = rec + (lane & 3) * 32 + ((((lane >> 3) * 2 + ((lane >> 2) & 1)) * 4) ^ xq_half_swizzle(row));
#pragma unroll
  for (int p = 0; p < kXqPlanes; ++p) *reinterpret_cast<uint32_t*>(at + 128 * p) = plane[p];
  const int total = __reduce_add_sync(0xffffffffu, s);
  if (lane == 0) *reinterpret_cast<int4*>(meta) = make_int4(total, __float_as_int(xq_unit(E)), 0, 0);
}

// The records' meta follows the digit planes: [dim / 128][rows][4] after [dim / 128][rows][kXqRecordBytes]; null
// without records.
inline int32_t* xq_meta(uint8_t* xq, int64_t rows, int64_t dim) {
  return xq ? reinterpret_cast<int32_t*>(xq + static_cast<size_t>(rows) * (dim / 128) * kXqRecordBytes) : nullptr;
}

}  // namespace dflash::cuda
