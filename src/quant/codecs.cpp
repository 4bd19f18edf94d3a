// Public row functions of quant/types.h: argument checks, then dispatch to the ISA kernels.
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "quant/kernels.h"
#include "util/error.h"

namespace dflash {
namespace quant_detail {
namespace {

const TypeTraits& codec_traits(GgmlType type, int64_t n, const char* what) {
  const TypeTraits* t = type_traits(static_cast<uint32_t>(type));
  DFLASH_CHECK(t != nullptr, "{}: unknown ggml type id {}", what, static_cast<uint32_t>(type));
  DFLASH_CHECK(t->has_codec, "{}: type {} has no codec", what, t->name);
  DFLASH_CHECK(n >= 0 && n % t->block_elems == 0,
               "{}: row of {} elements is not a multiple of the {} block size {}", what, n, t->name, t->block_elems);
  return *t;
}

Isa resolve(Isa isa) { return (isa == Isa::Avx2 && !avx2_available()) ? Isa::Scalar : isa; }

}  // namespace

bool avx2_available() {
  static const bool ok = [] {
#if defined(__x86_64__) || defined(__i386__)
    return avx2_built() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#else
    return false;
#endif
  }();
  return ok;
}

Isa default_isa() {
  static const Isa isa = [] {
    const char* env = std::getenv("DFLASH_QUANT_ISA");
    if (env != nullptr && std::string_view(env) == "scalar") return Isa::Scalar;
    return avx2_available() ? Isa::Avx2 : Isa::Scalar;
  }();
  return isa;
}

DequantFn dequant_fn(Isa isa, GgmlType type) {
  return resolve(isa) == Isa::Avx2 ? avx2_dequant_fn(type) : scalar_dequant_fn(type);
}

void dot_tile(Isa isa, GgmlType type, const uint8_t* w, int64_t n, const float* x, int64_t ldx, int rows,
              float* out) {
  const TypeTraits& t = type_traits(type);
  isa = resolve(isa);
  if (isa == Isa::Avx2)
    avx2_dot_tile(avx2_dequant_fn(type), t.block_elems, t.block_bytes, w, n, x, ldx, rows, out);
  else
    scalar_dot_tile(scalar_dequant_fn(type), t.block_elems, t.block_bytes, w, n, x, ldx, rows, out);
}

void dequantize_row_isa(Isa isa, GgmlType type, const void* src, float* dst, int64_t n) {
  const TypeTraits& t = codec_traits(type, n, "dequantize_row");
  if (n == 0) return;
  dequant_fn(isa, type)(static_cast<const uint8_t*>(src), dst, n / t.block_elems);
}

float dot_row_isa(Isa isa, GgmlType type, const void* w, const float* x, int64_t n) {
  codec_traits(type, n, "dot_row");
  float out = 0.0f;
  dot_tile(isa, type, static_cast<const uint8_t*>(w), n, x, n, 1, &out);
  return out;
}

}  // namespace quant_detail

void dequantize_row(GgmlType type, const void* src, float* dst, int64_t n) {
  quant_detail::dequantize_row_isa(quant_detail::default_isa(), type, src, dst, n);
}

void quantize_row(GgmlType type, const float* src, void* dst, int64_t n) {
  const TypeTraits& t = quant_detail::codec_traits(type, n, "quantize_row");
  if (n == 0) return;
  quant_detail::ref_quant_fn(type)(src, static_cast<uint8_t*>(dst), n / t.block_elems);
}

float dot_row(GgmlType type, const void* w, const float* x, int64_t n) {
  return quant_detail::dot_row_isa(quant_detail::default_isa(), type, w, x, n);
}

}  // namespace dflash
