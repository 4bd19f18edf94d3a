// Internal interface between the quant front end (codecs.cpp, matmul.cpp) and the per-ISA kernels
// (kernels_scalar.cpp, kernels_avx2.cpp). Included by tests to compare the ISAs with each other.
//
// The dot-product contract, identical for every ISA and every type:
//   * the weight row is dequantized to floats exactly as dequantize_row does (same bits);
//   * element i of the row is accumulated into lane i % kLanes with a correctly rounded fma, lanes
//     taking their elements in increasing i;
//   * the kLanes lanes are summed by reduce_lanes (one fixed tree).
// So the result depends on n and the data only: not on the ISA, the number of activation rows in the
// call, the thread count or how the rows were split between threads.
//
// Nothing in this header may be an inline function with external linkage: it is included by files
// compiled with -mavx2, and the linker could otherwise pick an AVX2 copy for the portable path.
#pragma once

#include <cstdint>

#include "quant/types.h"

namespace dflash {
class ThreadPool;
}

namespace dflash::quant_detail {

constexpr int kLanes = 32;            // 4 AVX2 registers of 8 floats
constexpr int64_t kChunkElems = 256;  // elements dequantized at a time: a multiple of every block size
constexpr int kTileRows = 8;          // activation rows sharing one dequantized weight chunk

enum class Isa { Scalar, Avx2 };

// Dequantizes `nblocks` whole blocks of a type into floats (block_elems floats per block).
using DequantFn = void (*)(const uint8_t* src, float* dst, int64_t nblocks);

// The fixed reduction tree over kLanes lanes (defined once, in kernels_scalar.cpp).
float reduce_lanes(const float* lanes);

// Per-ISA block dequantizers; nullptr for a type without a codec (or an ISA not built/available).
DequantFn dequant_fn(Isa isa, GgmlType type);

// One weight row (n elements of `type`) against `rows` (1..kTileRows) activation rows x + r*ldx;
// out[r] = the contract's dot product. No argument checks (the front end checks).
void dot_tile(Isa isa, GgmlType type, const uint8_t* w, int64_t n, const float* x, int64_t ldx, int rows,
              float* out);

// True when the AVX2 kernels are built and this CPU has AVX2, FMA and F16C.
bool avx2_available();
// The ISA the public functions use: AVX2 when available, unless DFLASH_QUANT_ISA=scalar is set.
Isa default_isa();

// ---- entry points of kernels_avx2.cpp (only called when avx2_available()) ----
DequantFn avx2_dequant_fn(GgmlType type);
void avx2_dot_tile(DequantFn dq, int64_t block_elems, int64_t block_bytes, const uint8_t* w, int64_t n,
                   const float* x, int64_t ldx, int rows, float* out);
bool avx2_built();

// ---- reference quantizers (quantize.cpp): `nblocks` blocks of floats -> block bytes ----
using QuantFn = void (*)(const float* src, uint8_t* dst, int64_t nblocks);
QuantFn ref_quant_fn(GgmlType type);

// ---- entry points of kernels_scalar.cpp ----
DequantFn scalar_dequant_fn(GgmlType type);
void scalar_dot_tile(DequantFn dq, int64_t block_elems, int64_t block_bytes, const uint8_t* w, int64_t n,
                     const float* x, int64_t ldx, int rows, float* out);

// Explicit-ISA versions of the public row functions (tests, benchmarks). Same checks as the public ones.
void dequantize_row_isa(Isa isa, GgmlType type, const void* src, float* dst, int64_t n);
float dot_row_isa(Isa isa, GgmlType type, const void* w, const float* x, int64_t n);
// `pool` nullptr means ThreadPool::global().
void matmul_rows_isa(Isa isa, GgmlType type, const void* W, int64_t n_in, int64_t n_out, const float* x, int64_t M,
                     float* y, ThreadPool* pool = nullptr);

}  // namespace dflash::quant_detail
