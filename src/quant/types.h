// Number formats: the ggml tensor types dflash reads and writes (SPEC 1.1).
//
// Every quantized type is a sequence of fixed-size blocks; a row's length must be a multiple of the
// block's element count. Each type has three operations, all on one row:
//   dequantize_row  blocks -> floats (bit-exact with ggml's reference dequantizer)
//   quantize_row    floats -> blocks (bit-exact with ggml's / PrismML's reference quantizer)
//   dot_row         <blocks, floats> in a fixed reduction order, so a matmul over M rows gives
//                   each row the same bits as M = 1 (the lossless-speculation contract, SPEC 5.5)
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace dflash {

// ggml type ids as stored in GGUF tensor infos. PQ2_0/PTQ1_0 are PrismML's fork types.
enum class GgmlType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q8_0 = 8,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  I8 = 24,
  I16 = 25,
  I32 = 26,
  I64 = 27,
  F64 = 28,
  BF16 = 30,
  TQ1_0 = 34,
  TQ2_0 = 35,
  Q1_0 = 41,
  Q2_0 = 42,
  PQ2_0 = 142,
  PTQ1_0 = 143,
};

struct TypeTraits {
  GgmlType type;
  const char* name;      // lower-case ggml name: "f32", "q4_k", "ptq1_0", ...
  int64_t block_elems;   // elements per block (1 for plain types)
  int64_t block_bytes;   // bytes per block
  bool has_codec;        // dequantize/quantize/dot are implemented (false for I8..F64)
};

// Traits of a type id read from a file; nullptr when the id is unknown.
const TypeTraits* type_traits(uint32_t id);
const TypeTraits& type_traits(GgmlType type);
// Parses "q4_k", "Q4_K", "pq2_0", ...; nullopt when unknown.
std::optional<GgmlType> type_from_name(std::string_view name);
const char* type_name(GgmlType type);

// Bytes of a row of n elements; throws dflash::Error when n is not a multiple of the block size.
size_t row_bytes(GgmlType type, int64_t n);

// n must be a multiple of the type's block size (throws dflash::Error otherwise).
void dequantize_row(GgmlType type, const void* src, float* dst, int64_t n);
void quantize_row(GgmlType type, const float* src, void* dst, int64_t n);
// sum_i dequant(w)[i] * x[i] in a fixed order that depends on n only: element i is fma'd into lane
// i % 32 (lanes take their elements in increasing i), then the 32 lanes are summed by one fixed tree
// (quant/kernels.h). dequant(w) has exactly dequantize_row's bits, so dot_row(T, w, x, n) ==
// dot_row(F32, dequantize_row(T, w), x, n) bit for bit, on every ISA (AVX2 and the portable path).
float dot_row(GgmlType type, const void* w, const float* x, int64_t n);

// y[m * n_out + o] = dot_row(type, row o of W, row m of x, n_in) for m < M, o < n_out.
// W holds n_out rows of row_bytes(type, n_in) bytes; x is M rows of n_in floats. Runs on the shared
// thread pool (quant/thread_pool.h), split over output rows; every y value has the same bits as the
// single dot_row call, whatever M, the thread count or the split.
void matmul_rows(GgmlType type, const void* W, int64_t n_in, int64_t n_out, const float* x, int64_t M, float* y);

// Scalar conversions (round to nearest even; NaN stays NaN with its payload, made quiet).
float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);
float bf16_to_fp32(uint16_t h);
uint16_t fp32_to_bf16(float f);

}  // namespace dflash
