// Reference quantizers: floats -> blocks, bit-exact with ggml's quantize_row_*_ref (and PrismML's for
// PQ2_0/PTQ1_0). Bit-exactness means the same float operations in the same order: every expression
// below keeps the reference's evaluation order, and the module is compiled with -ffp-contract=off so
// no multiply-add is fused behind our back.
#include <cmath>
#include <cstring>

#include "quant/kernels.h"
#include "quant/layout.h"

namespace dflash::quant_detail {
namespace {

constexpr float kGroupMaxEps = 1e-15f;  // below this a group counts as all zero (ggml GROUP_MAX_EPS)

// Round to nearest, ties to even, for |v| < 2^22: adding 1.5 * 2^23 puts the integer in the low
// mantissa bits. (The reference uses this trick; std::nearbyint would agree in range but not beyond.)
inline int round_even(float v) {
  const float shifted = v + 12582912.f;
  int32_t bits;
  std::memcpy(&bits, &shifted, 4);
  return (bits & 0x007fffff) - 0x00400000;
}

inline float max_abs(const float* x, int n) {
  float amax = 0.0f;
  for (int j = 0; j < n; ++j) {
    const float a = std::fabs(x[j]);
    amax = amax > a ? amax : a;
  }
  return amax;
}

// ---- plain types ----------------------------------------------------------------------------

void q_f32(const float* src, uint8_t* dst, int64_t n) { std::memcpy(dst, src, static_cast<size_t>(n) * 4); }
void q_f16(const float* src, uint8_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store_u16(dst + 2 * i, fp32_to_fp16(src[i]));
}
void q_bf16(const float* src, uint8_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store_u16(dst + 2 * i, fp32_to_bf16(src[i]));
}

// ---- 32-element blocks ----------------------------------------------------------------------

// Q8_0: d = max|x| / 127, q = round-half-away(x / d) (as x * (1/d)).
void q_q8_0(const float* x, uint8_t* dst, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 32, dst += 34) {
    const float d = max_abs(x, 32) / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    store_u16(dst, fp32_to_fp16(d));
    for (int j = 0; j < 32; ++j) dst[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(std::round(x[j] * id)));
  }
}

// Q4_0: d = (the signed value of largest magnitude, first one wins) / -8; q = trunc(x/d + 8.5) capped at 15.
void q_q4_0(const float* x, uint8_t* dst, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 32, dst += 18) {
    float amax = 0.0f, vmax = 0.0f;
    for (int j = 0; j < 32; ++j) {
      if (amax < std::fabs(x[j])) {
        amax = std::fabs(x[j]);
        vmax = x[j];
      }
    }
    const float d = vmax / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    store_u16(dst, fp32_to_fp16(d));
    for (int j = 0; j < 16; ++j) {
      const int lo = static_cast<int8_t>(static_cast<int>(x[j] * id + 8.5f));
      const int hi = static_cast<int8_t>(static_cast<int>(x[j + 16] * id + 8.5f));
      const uint8_t q0 = static_cast<uint8_t>(lo < 15 ? lo : 15);
      const uint8_t q1 = static_cast<uint8_t>(hi < 15 ? hi : 15);
      dst[2 + j] = static_cast<uint8_t>(q0 | (q1 << 4));
    }
  }
}

// ---- K-quant searches -----------------------------------------------------------------------

// Affine fit of n values to levels 0..nmax: x ~ scale * L - neg_min, with weights w. Starts from the
// min/max grid, then tries nstep+1 stretched grids (nmax + rmin + rdelta*k levels over the range),
// refitting scale and min by weighted least squares on each and keeping the lowest weighted squared
// error. Returns the scale; L receives the levels, *neg_min the (non-negative) offset. The float
// arithmetic order is the reference's (ggml make_qkx2_quants with squared error).
float fit_affine(int n, int nmax, const float* x, const float* w, uint8_t* L, float* neg_min, float rmin,
                 float rdelta, int nstep) {
  float lo = x[0], hi = x[0];
  float sum_w = w[0];
  float sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < lo) lo = x[i];
    if (x[i] > hi) hi = x[i];
    sum_w += w[i];
    sum_x += w[i] * x[i];
  }
  if (lo > 0) lo = 0;
  if (hi == lo) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    *neg_min = -lo;
    return 0.0f;
  }
  float inv = static_cast<float>(nmax) / (hi - lo);
  float scale = 1.0f / inv;
  float best_err = 0.0f;
  for (int i = 0; i < n; ++i) {
    const int l = round_even(inv * (x[i] - lo));
    L[i] = static_cast<uint8_t>(l < 0 ? 0 : (l > nmax ? nmax : l));
    float diff = scale * static_cast<float>(L[i]) + lo - x[i];
    diff = diff * diff;
    best_err += w[i] * diff;
  }
  uint8_t trial[32];
  for (int k = 0; k <= nstep; ++k) {
    inv = (rmin + rdelta * static_cast<float>(k) + static_cast<float>(nmax)) / (hi - lo);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      int l = round_even(inv * (x[i] - lo));
      l = l < 0 ? 0 : (l > nmax ? nmax : l);
      trial[i] = static_cast<uint8_t>(l);
      const float fl = static_cast<float>(l);
      sum_l += w[i] * fl;
      sum_l2 += w[i] * fl * fl;
      sum_xl += w[i] * fl * x[i];
    }
    const float det = sum_w * sum_l2 - sum_l * sum_l;
    if (det > 0) {
      float this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
      float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
      if (this_min > 0) {
        this_min = 0;
        this_scale = sum_xl / sum_l2;
      }
      float err = 0.0f;
      for (int i = 0; i < n; ++i) {
        float diff = this_scale * static_cast<float>(trial[i]) + this_min - x[i];
        diff = diff * diff;
        err += w[i] * diff;
      }
      if (err < best_err) {
        for (int i = 0; i < n; ++i) L[i] = trial[i];
        best_err = err;
        scale = this_scale;
        lo = this_min;
      }
    }
  }
  *neg_min = -lo;
  return scale;
}

// Symmetric fit of n values to levels -nmax..nmax-1 weighted by x^2 (ggml make_qx_quants, rmse type 1,
// no importance weights): tries 19 scales around nmax/max and keeps the best least-squares one.
// L receives level + nmax (0 for an all-zero group).
float fit_symmetric(int n, int nmax, const float* x, int8_t* L) {
  float vmax = 0, amax = 0;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) {
      amax = ax;
      vmax = x[i];
    }
  }
  if (amax < kGroupMaxEps) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    return 0.0f;
  }
  auto level = [nmax](float v) {
    const int l = round_even(v);
    return l < -nmax ? -nmax : (l > nmax - 1 ? nmax - 1 : l);
  };
  float inv = static_cast<float>(-nmax) / vmax;
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) {
    const int l = level(inv * x[i]);
    L[i] = static_cast<int8_t>(l + nmax);
    const float w = x[i] * x[i];
    const float fl = static_cast<float>(l);
    sumlx += w * x[i] * fl;
    suml2 += w * fl * fl;
  }
  float scale = suml2 != 0.0f ? sumlx / suml2 : 0.0f;
  float best = scale * sumlx;
  for (int k = -9; k <= 9; ++k) {
    if (k == 0) continue;
    inv = -(static_cast<float>(nmax) + 0.1f * static_cast<float>(k)) / vmax;
    sumlx = suml2 = 0;
    for (int i = 0; i < n; ++i) {
      const float fl = static_cast<float>(level(inv * x[i]));
      const float w = x[i] * x[i];
      sumlx += w * x[i] * fl;
      suml2 += w * fl * fl;
    }
    if (suml2 > 0 && sumlx * sumlx > best * suml2) {
      for (int i = 0; i < n; ++i) L[i] = static_cast<int8_t>(nmax + level(inv * x[i]));
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

// Shared by Q4_K (nmax 15) and Q5_K (nmax 31): per 32-element sub-block an affine fit, then the eight
// scales and mins quantized to 6 bits against the block maxima, then the levels recomputed from the
// stored (rounded) scales. Writes d, dmin, scales[12] at dst and the 256 levels to L.
void quantize_k_affine(const float* x, uint8_t* dst, uint8_t* L, int nmax, float rmin, int nstep) {
  float scales[8], mins[8], weights[32];
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < 8; ++j) {
    const float* xs = x + 32 * j;
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += xs[l] * xs[l];
    const float av_x = std::sqrt(sum_x2 / 32.0f);
    for (int l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(xs[l]);
    scales[j] = fit_affine(32, nmax, xs, weights, L + 32 * j, &mins[j], rmin, 0.1f, nstep);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
  const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
  uint8_t* sc = dst + 4;
  for (int j = 0; j < 8; ++j) {
    uint8_t ls = static_cast<uint8_t>(round_even(inv_scale * scales[j]));
    uint8_t lm = static_cast<uint8_t>(round_even(inv_min * mins[j]));
    ls = ls < 63 ? ls : 63;
    lm = lm < 63 ? lm : 63;
    if (j < 4) {
      sc[j] = ls;
      sc[j + 4] = lm;
    } else {
      sc[j + 4] = static_cast<uint8_t>((ls & 0xF) | ((lm & 0xF) << 4));
      sc[j - 4] |= static_cast<uint8_t>((ls >> 4) << 6);
      sc[j] |= static_cast<uint8_t>((lm >> 4) << 6);
    }
  }
  store_u16(dst, fp32_to_fp16(max_scale / 63.f));
  store_u16(dst + 2, fp32_to_fp16(max_min / 63.f));
  const float d_all = load_half(dst), dmin_all = load_half(dst + 2);
  for (int j = 0; j < 8; ++j) {
    const KScaleMin sm = k_scale_min(sc, j);
    const float d = d_all * sm.scale;
    if (d == 0.0f) continue;  // keeps the fit's levels, as the reference does
    const float dm = dmin_all * sm.min;
    for (int i = 0; i < 32; ++i) {
      const int l = round_even((x[32 * j + i] + dm) / d);
      L[32 * j + i] = static_cast<uint8_t>(l < 0 ? 0 : (l > nmax ? nmax : l));
    }
  }
}

// Q4_K: half d | half dmin | scales[12] | qs[128]; chunk c of 64: qs[32c + l] = L[64c+l] | L[64c+32+l] << 4.
void q_q4_k(const float* x, uint8_t* dst, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 256, dst += 144) {
    std::memset(dst, 0, 144);
    uint8_t L[256];
    quantize_k_affine(x, dst, L, 15, -1.0f, 20);
    uint8_t* qs = dst + 16;
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) qs[32 * c + l] = static_cast<uint8_t>(L[64 * c + l] | (L[64 * c + 32 + l] << 4));
  }
}

// Q5_K: as Q4_K with 5-bit levels; bit 4 of the low/high element of chunk c goes to bit 2c/2c+1 of qh[l].
void q_q5_k(const float* x, uint8_t* dst, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 256, dst += 176) {
    std::memset(dst, 0, 176);
    uint8_t L[256];
    quantize_k_affine(x, dst, L, 31, -0.5f, 15);
    uint8_t* qh = dst + 16;
    uint8_t* qs = dst + 48;
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) {
        const int lo = L[64 * c + l], hi = L[64 * c + 32 + l];
        qh[l] |= static_cast<uint8_t>(((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1)));
        qs[32 * c + l] = static_cast<uint8_t>((lo & 0xF) | ((hi & 0xF) << 4));
      }
  }
}

// Q6_K: 16 symmetric sub-blocks of 16; their scales quantized to int8 against the largest-magnitude one.
void q_q6_k(const float* x, uint8_t* dst, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 256, dst += 210) {
    std::memset(dst, 0, 210);
    int8_t L[256];
    float scales[16];
    float max_scale = 0, max_abs_scale = 0;
    for (int ib = 0; ib < 16; ++ib) {
      scales[ib] = fit_symmetric(16, 32, x + 16 * ib, L + 16 * ib);
      const float a = std::fabs(scales[ib]);
      if (a > max_abs_scale) {
        max_abs_scale = a;
        max_scale = scales[ib];
      }
    }
    if (max_abs_scale < kGroupMaxEps) continue;  // all zero (d = +0 too)
    const float inv = -128.f / max_scale;
    store_u16(dst + 208, fp32_to_fp16(1.0f / inv));
    int8_t* sc = reinterpret_cast<int8_t*>(dst + 192);
    for (int ib = 0; ib < 16; ++ib) {
      const int v = round_even(inv * scales[ib]);
      sc[ib] = static_cast<int8_t>(v < 127 ? v : 127);
    }
    const float d_all = load_half(dst + 208);
    for (int j = 0; j < 16; ++j) {
      const float d = d_all * static_cast<float>(sc[j]);
      if (d == 0.0f) continue;
      for (int i = 0; i < 16; ++i) {
        int l = round_even(x[16 * j + i] / d);
        l = l < -32 ? -32 : (l > 31 ? 31 : l);
        L[16 * j + i] = static_cast<int8_t>(l + 32);
      }
    }
    uint8_t* ql = dst;
    uint8_t* qh = dst + 128;
    for (int h = 0; h < 2; ++h) {
      const int8_t* Lh = L + 128 * h;
      for (int l = 0; l < 32; ++l) {
        const int v0 = Lh[l], v1 = Lh[l + 32], v2 = Lh[l + 64], v3 = Lh[l + 96];
        ql[64 * h + l] = static_cast<uint8_t>((v0 & 0xF) | ((v2 & 0xF) << 4));
        ql[64 * h + l + 32] = static_cast<uint8_t>((v1 & 0xF) | ((v3 & 0xF) << 4));
        qh[32 * h + l] = static_cast<uint8_t>((v0 >> 4) | ((v1 >> 4) << 2) | ((v2 >> 4) << 4) | ((v3 >> 4) << 6));
      }
    }
  }
}

// ---- ternary and binary types ---------------------------------------------------------------

// Ternary code of x for scale inverse id: round-half-away(x * id) + 1, clamped to 0..2. Where |x * id|
// <= 2 (always, when d = max|x| is a normal number) comparisons decide it with lround's bits (half away
// from zero: 0.5 -> 1, -0.5 -> -1) and without its libm call, which had made PTQ1_0 the slowest part
// of writing a synthetic 27B file (19.7 of 44 ns per weight); anything else (NaN, infinities, an id
// that overflowed) still goes through std::lround, as the reference does.
inline int ternary_code(float x, float id) {
  const float t = x * id;
  if (std::fabs(t) <= 2.0f) return static_cast<int>(t >= 0.5f) + static_cast<int>(t > -0.5f);  // no branch on t
  const long v = std::lround(t) + 1;
  return v < 0 ? 0 : (v > 2 ? 2 : static_cast<int>(v));
}

// Packs base-3 digits: value n*count + m becomes digit n (most significant first) of byte m, as the
// fixed-point fraction ceil(v * 256 / 243). `digits` is 5, or 4 for the qh bytes (whose value is then
// shifted up one digit so the digit positions match the 5-digit bytes).
inline void pack_trits(const float* x, float id, int count, int digits, uint8_t* out) {
  for (int m = 0; m < count; ++m) {
    int v = 0;
    for (int n = 0; n < digits; ++n) v = v * 3 + ternary_code(x[n * count + m], id);
    if (digits == 4) v *= 3;
    out[m] = static_cast<uint8_t>((v * 256 + 242) / 243);
  }
}

// TQ1_0: d = max|x|; qs stages of 32 and 16 bytes (values 0..159, 160..239), qh 4 bytes (240..255).
void q_tq1_0(const float* x, uint8_t* dst, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 256, dst += 54) {
    const float d = max_abs(x, 256);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    pack_trits(x, id, 32, 5, dst);
    pack_trits(x + 160, id, 16, 5, dst + 32);
    pack_trits(x + 240, id, 4, 4, dst + 48);
    store_u16(dst + 52, fp32_to_fp16(d));
  }
}

// PTQ1_0: d = max|x| over 128; qs stages of 16 and 8 bytes (values 0..79, 80..119), qh 2 bytes (120..127).
void q_ptq1_0(const float* x, uint8_t* dst, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 128, dst += 28) {
    const float d = max_abs(x, 128);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    pack_trits(x, id, 16, 5, dst);
    pack_trits(x + 80, id, 8, 5, dst + 16);
    pack_trits(x + 120, id, 2, 4, dst + 24);
    store_u16(dst + 26, fp32_to_fp16(d));
  }
}

// TQ2_0: d = max|x|; qs[j + m] holds values 4j + 32l + m at bits 2l (j in {0, 32}).
void q_tq2_0(const float* x, uint8_t* dst, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 256, dst += 66) {
    const float d = max_abs(x, 256);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < 64; j += 32)
      for (int m = 0; m < 32; ++m) {
        int q = 0;
        for (int l = 0; l < 4; ++l) q |= ternary_code(x[4 * j + 32 * l + m], id) << (2 * l);
        dst[j + m] = static_cast<uint8_t>(q);
      }
    store_u16(dst + 64, fp32_to_fp16(d));
  }
}

// Q2_0 (64) / PQ2_0 (128): d = max|x|; code = round-half-away(x/d) + 1 clamped to 0..3.
template <int kElems>
void q_2bit_linear(const float* x, uint8_t* dst, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += kElems, dst += 2 + kElems / 4) {
    const float d = max_abs(x, kElems);
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    store_u16(dst, fp32_to_fp16(d));
    uint8_t* qs = dst + 2;
    std::memset(qs, 0, kElems / 4);
    for (int j = 0; j < kElems; ++j) {
      const float t = x[j] * id;
      int q;
      if (std::fabs(t) <= 2.0f) {  // std::round's bits (half away from zero), by comparisons: no libm call
        q = static_cast<int>(t >= 1.5f) + static_cast<int>(t >= 0.5f) + static_cast<int>(t > -0.5f);
      } else {  // NaN, infinities, an id that overflowed: as the reference
        q = static_cast<int>(std::round(t)) + 1;
        q = q < 0 ? 0 : (q > 3 ? 3 : q);
      }
      qs[j / 4] |= static_cast<uint8_t>(q << (2 * (j % 4)));
    }
  }
}

// Q1_0: d = mean |x| over 128; bit set where x >= 0.
void q_q1_0(const float* x, uint8_t* dst, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 128, dst += 18) {
    float sum_abs = 0.0f;
    for (int j = 0; j < 128; ++j) sum_abs += std::fabs(x[j]);
    store_u16(dst, fp32_to_fp16(sum_abs / 128.0f));
    uint8_t* qs = dst + 2;
    std::memset(qs, 0, 16);
    for (int j = 0; j < 128; ++j)
      if (x[j] >= 0.0f) qs[j / 8] |= static_cast<uint8_t>(1u << (j % 8));
  }
}

}  // namespace

QuantFn ref_quant_fn(GgmlType type) {
  switch (type) {
    case GgmlType::F32: return q_f32;
    case GgmlType::F16: return q_f16;
    case GgmlType::BF16: return q_bf16;
    case GgmlType::Q8_0: return q_q8_0;
    case GgmlType::Q4_0: return q_q4_0;
    case GgmlType::Q4_K: return q_q4_k;
    case GgmlType::Q5_K: return q_q5_k;
    case GgmlType::Q6_K: return q_q6_k;
    case GgmlType::TQ1_0: return q_tq1_0;
    case GgmlType::TQ2_0: return q_tq2_0;
    case GgmlType::Q1_0: return q_q1_0;
    case GgmlType::Q2_0: return q_2bit_linear<64>;
    case GgmlType::PQ2_0: return q_2bit_linear<128>;
    case GgmlType::PTQ1_0: return q_ptq1_0;
    default: return nullptr;
  }
}

}  // namespace dflash::quant_detail
