// AVX2 + FMA + F16C kernels (compiled with -mavx2 -mfma -mf16c; called only after a CPUID check).
//
// Each dequantizer produces the same bits as its portable twin in kernels_scalar.cpp (same float
// operations: an integer converted exactly, then the same multiplies/subtracts, never fused), and the
// dot tile follows the lane contract of kernels.h. Keep this file free of C++ library templates and
// external inline functions: their AVX2 instantiations could be shared with portable code by the linker.
#include "quant/kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

#include <immintrin.h>

#include <cstring>

#include "quant/layout.h"

namespace dflash::quant_detail {
namespace {

inline __m256i load8_u8_epi32(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 i32_to_ps(__m256i v) { return _mm256_cvtepi32_ps(v); }
inline __m256i shr32(__m256i v, int count) { return _mm256_srl_epi32(v, _mm_cvtsi32_si128(count)); }

// ---- plain types ----------------------------------------------------------------------------

void dq_f32(const uint8_t* src, float* dst, int64_t n) { std::memcpy(dst, src, static_cast<size_t>(n) * 4); }

void dq_f16(const uint8_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i))));
  for (; i < n; ++i) dst[i] = fp16_to_fp32(load_u16(src + 2 * i));
}

void dq_bf16(const uint8_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
  }
  for (; i < n; ++i) dst[i] = bf16_to_fp32(load_u16(src + 2 * i));
}

// ---- 32-element blocks ----------------------------------------------------------------------

void dq_q8_0(const uint8_t* src, float* dst, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, src += 34, dst += 32) {
    const __m256 d = _mm256_set1_ps(load_half(src));
    for (int k = 0; k < 4; ++k) {
      const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 2 + 8 * k)));
      _mm256_storeu_ps(dst + 8 * k, _mm256_mul_ps(i32_to_ps(q), d));
    }
  }
}

void dq_q4_0(const uint8_t* src, float* dst, int64_t nb) {
  const __m256i low4 = _mm256_set1_epi32(0xF), eight = _mm256_set1_epi32(8);
  for (int64_t b = 0; b < nb; ++b, src += 18, dst += 32) {
    const __m256 d = _mm256_set1_ps(load_half(src));
    for (int k = 0; k < 2; ++k) {
      const __m256i q = load8_u8_epi32(src + 2 + 8 * k);
      const __m256i lo = _mm256_sub_epi32(_mm256_and_si256(q, low4), eight);
      const __m256i hi = _mm256_sub_epi32(_mm256_srli_epi32(q, 4), eight);
      _mm256_storeu_ps(dst + 8 * k, _mm256_mul_ps(i32_to_ps(lo), d));
      _mm256_storeu_ps(dst + 16 + 8 * k, _mm256_mul_ps(i32_to_ps(hi), d));
    }
  }
}

// ---- 256-element K blocks -------------------------------------------------------------------

void dq_q4_k(const uint8_t* src, float* dst, int64_t nb) {
  const __m256i low4 = _mm256_set1_epi32(0xF);
  for (int64_t b = 0; b < nb; ++b, src += 144, dst += 256) {
    const float d = load_half(src);
    const float dmin = load_half(src + 2);
    const uint8_t* scales = src + 4;
    const uint8_t* qs = src + 16;
    for (int c = 0; c < 4; ++c) {
      const KScaleMin lo = k_scale_min(scales, 2 * c);
      const KScaleMin hi = k_scale_min(scales, 2 * c + 1);
      const __m256 d1 = _mm256_set1_ps(d * lo.scale), m1 = _mm256_set1_ps(dmin * lo.min);
      const __m256 d2 = _mm256_set1_ps(d * hi.scale), m2 = _mm256_set1_ps(dmin * hi.min);
      float* y = dst + 64 * c;
      for (int k = 0; k < 4; ++k) {
        const __m256i q = load8_u8_epi32(qs + 32 * c + 8 * k);
        const __m256 ql = i32_to_ps(_mm256_and_si256(q, low4));
        const __m256 qh = i32_to_ps(_mm256_srli_epi32(q, 4));
        _mm256_storeu_ps(y + 8 * k, _mm256_sub_ps(_mm256_mul_ps(d1, ql), m1));
        _mm256_storeu_ps(y + 32 + 8 * k, _mm256_sub_ps(_mm256_mul_ps(d2, qh), m2));
      }
    }
  }
}

void dq_q5_k(const uint8_t* src, float* dst, int64_t nb) {
  const __m256i low4 = _mm256_set1_epi32(0xF), one = _mm256_set1_epi32(1);
  for (int64_t b = 0; b < nb; ++b, src += 176, dst += 256) {
    const float d = load_half(src);
    const float dmin = load_half(src + 2);
    const uint8_t* scales = src + 4;
    const uint8_t* qh = src + 16;
    const uint8_t* qs = src + 48;
    for (int c = 0; c < 4; ++c) {
      const KScaleMin lo = k_scale_min(scales, 2 * c);
      const KScaleMin hi = k_scale_min(scales, 2 * c + 1);
      const __m256 d1 = _mm256_set1_ps(d * lo.scale), m1 = _mm256_set1_ps(dmin * lo.min);
      const __m256 d2 = _mm256_set1_ps(d * hi.scale), m2 = _mm256_set1_ps(dmin * hi.min);
      float* y = dst + 64 * c;
      for (int k = 0; k < 4; ++k) {
        const __m256i q = load8_u8_epi32(qs + 32 * c + 8 * k);
        const __m256i h = load8_u8_epi32(qh + 8 * k);
        const __m256i hb_lo = _mm256_slli_epi32(_mm256_and_si256(shr32(h, 2 * c), one), 4);
        const __m256i hb_hi = _mm256_slli_epi32(_mm256_and_si256(shr32(h, 2 * c + 1), one), 4);
        const __m256 vl = i32_to_ps(_mm256_add_epi32(_mm256_and_si256(q, low4), hb_lo));
        const __m256 vh = i32_to_ps(_mm256_add_epi32(_mm256_srli_epi32(q, 4), hb_hi));
        _mm256_storeu_ps(y + 8 * k, _mm256_sub_ps(_mm256_mul_ps(d1, vl), m1));
        _mm256_storeu_ps(y + 32 + 8 * k, _mm256_sub_ps(_mm256_mul_ps(d2, vh), m2));
      }
    }
  }
}

void dq_q6_k(const uint8_t* src, float* dst, int64_t nb) {
  const __m256i low4 = _mm256_set1_epi32(0xF), three = _mm256_set1_epi32(3), off = _mm256_set1_epi32(32);
  for (int64_t b = 0; b < nb; ++b, src += 210, dst += 256) {
    const float d = load_half(src + 208);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = src + 64 * h;
      const uint8_t* qh = src + 128 + 32 * h;
      const int8_t* sc = reinterpret_cast<const int8_t*>(src + 192 + 8 * h);
      float* y = dst + 128 * h;
      for (int l = 0; l < 32; l += 8) {
        const int is = l / 16;
        const __m256i a = load8_u8_epi32(ql + l);
        const __m256i c = load8_u8_epi32(ql + 32 + l);
        const __m256i hh = load8_u8_epi32(qh + l);
        const __m256i q1 = _mm256_sub_epi32(
            _mm256_or_si256(_mm256_and_si256(a, low4), _mm256_slli_epi32(_mm256_and_si256(hh, three), 4)), off);
        const __m256i q2 = _mm256_sub_epi32(
            _mm256_or_si256(_mm256_and_si256(c, low4),
                            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hh, 2), three), 4)),
            off);
        const __m256i q3 = _mm256_sub_epi32(
            _mm256_or_si256(_mm256_srli_epi32(a, 4),
                            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hh, 4), three), 4)),
            off);
        const __m256i q4 = _mm256_sub_epi32(
            _mm256_or_si256(_mm256_srli_epi32(c, 4), _mm256_slli_epi32(_mm256_srli_epi32(hh, 6), 4)), off);
        // (d * sc) first, then * q: the reference's left-to-right order.
        _mm256_storeu_ps(y + l, _mm256_mul_ps(_mm256_set1_ps(d * static_cast<float>(sc[is])), i32_to_ps(q1)));
        _mm256_storeu_ps(y + l + 32,
                         _mm256_mul_ps(_mm256_set1_ps(d * static_cast<float>(sc[is + 2])), i32_to_ps(q2)));
        _mm256_storeu_ps(y + l + 64,
                         _mm256_mul_ps(_mm256_set1_ps(d * static_cast<float>(sc[is + 4])), i32_to_ps(q3)));
        _mm256_storeu_ps(y + l + 96,
                         _mm256_mul_ps(_mm256_set1_ps(d * static_cast<float>(sc[is + 6])), i32_to_ps(q4)));
      }
    }
  }
}

// ---- ternary and binary types ---------------------------------------------------------------

// Base-3 digits in 16-bit lanes: lane = ((uint8)(byte * pow3) * 3) >> 8, minus 1 (see base3_trit).
inline __m256i trit16_minus1(__m256i bytes_times_pow) {
  const __m256i t = _mm256_srli_epi16(
      _mm256_mullo_epi16(_mm256_and_si256(bytes_times_pow, _mm256_set1_epi16(0xFF)), _mm256_set1_epi16(3)), 8);
  return _mm256_sub_epi16(t, _mm256_set1_epi16(1));
}
inline __m128i trit8_minus1(__m128i bytes_times_pow) {
  const __m128i t =
      _mm_srli_epi16(_mm_mullo_epi16(_mm_and_si128(bytes_times_pow, _mm_set1_epi16(0xFF)), _mm_set1_epi16(3)), 8);
  return _mm_sub_epi16(t, _mm_set1_epi16(1));
}
// Stores 16 signed 16-bit lanes times d as floats.
inline void store16_scaled(__m256i v16, __m256 d, float* y) {
  _mm256_storeu_ps(y, _mm256_mul_ps(i32_to_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(v16))), d));
  _mm256_storeu_ps(y + 8, _mm256_mul_ps(i32_to_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(v16, 1))), d));
}
inline void store8_scaled(__m128i v16, __m256 d, float* y) {
  _mm256_storeu_ps(y, _mm256_mul_ps(i32_to_ps(_mm256_cvtepi16_epi32(v16)), d));
}

// 16 base-3 bytes with 5 digits: value n*stride + m (m < 16) = digit n of byte m.
inline void trits5_x16(const uint8_t* q, __m256 d, float* y, int stride) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  for (int n = 0; n < 5; ++n)
    store16_scaled(trit16_minus1(_mm256_mullo_epi16(b, _mm256_set1_epi16(kPow3[n]))), d, y + n * stride);
}
// 8 base-3 bytes with 5 digits: value 8n + m = digit n of byte m.
inline void trits5_x8(const uint8_t* q, __m256 d, float* y) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  for (int n = 0; n < 5; ++n) store8_scaled(trit8_minus1(_mm_mullo_epi16(b, _mm_set1_epi16(kPow3[n]))), d, y + 8 * n);
}

void dq_tq1_0(const uint8_t* src, float* dst, int64_t nb) {
  const __m256i pow_qh = _mm256_setr_epi16(1, 1, 1, 1, 3, 3, 3, 3, 9, 9, 9, 9, 27, 27, 27, 27);
  for (int64_t b = 0; b < nb; ++b, src += 54, dst += 256) {
    const __m256 d = _mm256_set1_ps(load_half(src + 52));
    trits5_x16(src, d, dst, 32);  // values 32n + m, m < 16
    trits5_x16(src + 16, d, dst + 16, 32);  // m = 16..31
    trits5_x16(src + 32, d, dst + 160, 16);
    // qh: value 240 + 4n + j = digit n of qh[j]; lanes hold qh[0..3] four times.
    uint32_t qh4;
    std::memcpy(&qh4, src + 48, 4);
    const __m256i bq = _mm256_cvtepu8_epi16(_mm_set1_epi32(static_cast<int>(qh4)));
    store16_scaled(trit16_minus1(_mm256_mullo_epi16(bq, pow_qh)), d, dst + 240);
  }
}

void dq_ptq1_0(const uint8_t* src, float* dst, int64_t nb) {
  const __m128i pow_qh = _mm_setr_epi16(1, 1, 3, 3, 9, 9, 27, 27);
  for (int64_t b = 0; b < nb; ++b, src += 28, dst += 128) {
    const __m256 d = _mm256_set1_ps(load_half(src + 26));
    trits5_x16(src, d, dst, 16);
    trits5_x8(src + 16, d, dst + 80);
    // qh: value 120 + 2n + h = digit n of qh[h]; lanes hold qh[0..1] four times.
    const __m128i bq = _mm_cvtepu8_epi16(_mm_set1_epi16(static_cast<short>(load_u16(src + 24))));
    store8_scaled(trit8_minus1(_mm_mullo_epi16(bq, pow_qh)), d, dst + 120);
  }
}

void dq_tq2_0(const uint8_t* src, float* dst, int64_t nb) {
  const __m256i three = _mm256_set1_epi32(3), one = _mm256_set1_epi32(1);
  for (int64_t b = 0; b < nb; ++b, src += 66, dst += 256) {
    const __m256 d = _mm256_set1_ps(load_half(src + 64));
    for (int j = 0; j < 64; j += 32)
      for (int m = 0; m < 32; m += 8) {
        const __m256i q = load8_u8_epi32(src + j + m);
        for (int l = 0; l < 4; ++l) {
          const __m256i v = _mm256_sub_epi32(_mm256_and_si256(shr32(q, 2 * l), three), one);
          _mm256_storeu_ps(dst + 4 * j + 32 * l + m, _mm256_mul_ps(i32_to_ps(v), d));
        }
      }
  }
}

// Q2_0 / PQ2_0: 8 consecutive elements are the 16 bits of two bytes, element i at bits 2i.
template <int kElems>
void dq_2bit_linear(const uint8_t* src, float* dst, int64_t nb) {
  const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
  const __m256i three = _mm256_set1_epi32(3), one = _mm256_set1_epi32(1);
  for (int64_t b = 0; b < nb; ++b, src += 2 + kElems / 4, dst += kElems) {
    const __m256 d = _mm256_set1_ps(load_half(src));
    for (int g = 0; g < kElems / 8; ++g) {
      const __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32(load_u16(src + 2 + 2 * g)), shifts);
      const __m256i q = _mm256_sub_epi32(_mm256_and_si256(v, three), one);
      _mm256_storeu_ps(dst + 8 * g, _mm256_mul_ps(i32_to_ps(q), d));
    }
  }
}

void dq_q1_0(const uint8_t* src, float* dst, int64_t nb) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (int64_t b = 0; b < nb; ++b, src += 18, dst += 128) {
    const float dv = load_half(src);
    const __m256 d = _mm256_set1_ps(dv), neg_d = _mm256_set1_ps(-dv);
    for (int g = 0; g < 16; ++g) {
      const __m256i m = _mm256_and_si256(_mm256_set1_epi32(src[2 + g]), bits);
      const __m256 set = _mm256_castsi256_ps(_mm256_cmpeq_epi32(m, bits));
      _mm256_storeu_ps(dst + 8 * g, _mm256_blendv_ps(neg_d, d, set));
    }
  }
}

}  // namespace

bool avx2_built() { return true; }

DequantFn avx2_dequant_fn(GgmlType type) {
  switch (type) {
    case GgmlType::F32: return dq_f32;
    case GgmlType::F16: return dq_f16;
    case GgmlType::BF16: return dq_bf16;
    case GgmlType::Q8_0: return dq_q8_0;
    case GgmlType::Q4_0: return dq_q4_0;
    case GgmlType::Q4_K: return dq_q4_k;
    case GgmlType::Q5_K: return dq_q5_k;
    case GgmlType::Q6_K: return dq_q6_k;
    case GgmlType::TQ1_0: return dq_tq1_0;
    case GgmlType::TQ2_0: return dq_tq2_0;
    case GgmlType::Q1_0: return dq_q1_0;
    case GgmlType::Q2_0: return dq_2bit_linear<64>;
    case GgmlType::PQ2_0: return dq_2bit_linear<128>;
    case GgmlType::PTQ1_0: return dq_ptq1_0;
    default: return nullptr;
  }
}

void avx2_dot_tile(DequantFn dq, int64_t block_elems, int64_t block_bytes, const uint8_t* w, int64_t n,
                   const float* x, int64_t ldx, int rows, float* out) {
  alignas(32) float tmp[kChunkElems];
  alignas(32) float lanes[kTileRows][kLanes];
  for (int r = 0; r < rows; ++r)
    for (int k = 0; k < kLanes; ++k) lanes[r][k] = 0.0f;
  const int64_t nblocks = n / block_elems;
  const int64_t chunk_blocks = block_elems >= kChunkElems ? 1 : kChunkElems / block_elems;
  for (int64_t b0 = 0; b0 < nblocks; b0 += chunk_blocks) {
    const int64_t nb = nblocks - b0 < chunk_blocks ? nblocks - b0 : chunk_blocks;
    dq(w + b0 * block_bytes, tmp, nb);
    const int64_t len = nb * block_elems;
    const int64_t base = b0 * block_elems;  // a multiple of kLanes for every chunk but the last
    for (int r = 0; r < rows; ++r) {
      const float* xr = x + r * ldx + base;
      float* L = lanes[r];
      __m256 a0 = _mm256_load_ps(L), a1 = _mm256_load_ps(L + 8);
      __m256 a2 = _mm256_load_ps(L + 16), a3 = _mm256_load_ps(L + 24);
      int64_t j = 0;
      for (; j + kLanes <= len; j += kLanes) {
        a0 = _mm256_fmadd_ps(_mm256_load_ps(tmp + j), _mm256_loadu_ps(xr + j), a0);
        a1 = _mm256_fmadd_ps(_mm256_load_ps(tmp + j + 8), _mm256_loadu_ps(xr + j + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_load_ps(tmp + j + 16), _mm256_loadu_ps(xr + j + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_load_ps(tmp + j + 24), _mm256_loadu_ps(xr + j + 24), a3);
      }
      _mm256_store_ps(L, a0);
      _mm256_store_ps(L + 8, a1);
      _mm256_store_ps(L + 16, a2);
      _mm256_store_ps(L + 24, a3);
      for (; j < len; ++j) L[j % kLanes] = __builtin_fmaf(tmp[j], xr[j], L[j % kLanes]);
    }
  }
  for (int r = 0; r < rows; ++r) out[r] = reduce_lanes(lanes[r]);
}

}  // namespace dflash::quant_detail

#else  // no AVX2 build: the dispatcher never calls these

namespace dflash::quant_detail {
bool avx2_built() { return false; }
DequantFn avx2_dequant_fn(GgmlType) { return nullptr; }
void avx2_dot_tile(DequantFn, int64_t, int64_t, const uint8_t*, int64_t, const float*, int64_t, int, float*) {}
}  // namespace dflash::quant_detail

#endif
