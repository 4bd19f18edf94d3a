// Portable kernels: block dequantizers (the reference for every other ISA: same float operations, in
// the same order, as ggml's dequantize_row_*) and the lane-emulating dot product (kernels.h).
#include <cmath>
#include <cstring>

#include "quant/kernels.h"
#include "quant/layout.h"

namespace dflash::quant_detail {
namespace {

// ---- plain types ----------------------------------------------------------------------------

void dq_f32(const uint8_t* src, float* dst, int64_t n) { std::memcpy(dst, src, static_cast<size_t>(n) * 4); }

void dq_f16(const uint8_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_fp32(load_u16(src + 2 * i));
}

void dq_bf16(const uint8_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_fp32(load_u16(src + 2 * i));
}

// ---- 32-element blocks ----------------------------------------------------------------------

// Q8_0: half d | i8 q[32];  y = q * d
void dq_q8_0(const uint8_t* src, float* dst, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, src += 34, dst += 32) {
    const float d = load_half(src);
    const int8_t* q = reinterpret_cast<const int8_t*>(src + 2);
    for (int j = 0; j < 32; ++j) dst[j] = static_cast<float>(q[j]) * d;
  }
}

// Q4_0: half d | u8 qs[16]; low nibbles are elements 0..15, high nibbles 16..31; y = (nibble - 8) * d
void dq_q4_0(const uint8_t* src, float* dst, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, src += 18, dst += 32) {
    const float d = load_half(src);
    const uint8_t* qs = src + 2;
    for (int j = 0; j < 16; ++j) {
      dst[j] = static_cast<float>((qs[j] & 0xF) - 8) * d;
      dst[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
    }
  }
}

// ---- 256-element K blocks -------------------------------------------------------------------

// Q4_K: half d | half dmin | u8 scales[12] | u8 qs[128]. Four 64-element chunks, each two sub-blocks
// (low nibbles of 32 bytes, then high nibbles): y = (d*sc) * q - (dmin*m).
void dq_q4_k(const uint8_t* src, float* dst, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, src += 144, dst += 256) {
    const float d = load_half(src);
    const float dmin = load_half(src + 2);
    const uint8_t* scales = src + 4;
    const uint8_t* qs = src + 16;
    for (int c = 0; c < 4; ++c) {
      const KScaleMin lo = k_scale_min(scales, 2 * c);
      const KScaleMin hi = k_scale_min(scales, 2 * c + 1);
      const float d1 = d * lo.scale, m1 = dmin * lo.min;
      const float d2 = d * hi.scale, m2 = dmin * hi.min;
      const uint8_t* q = qs + 32 * c;
      float* y = dst + 64 * c;
      for (int l = 0; l < 32; ++l) y[l] = d1 * static_cast<float>(q[l] & 0xF) - m1;
      for (int l = 0; l < 32; ++l) y[32 + l] = d2 * static_cast<float>(q[l] >> 4) - m2;
    }
  }
}

// Q5_K: half d | half dmin | u8 scales[12] | u8 qh[32] | u8 qs[128]. As Q4_K, plus 16 when bit 2c (low
// nibble) / 2c+1 (high nibble) of qh[l] is set.
void dq_q5_k(const uint8_t* src, float* dst, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, src += 176, dst += 256) {
    const float d = load_half(src);
    const float dmin = load_half(src + 2);
    const uint8_t* scales = src + 4;
    const uint8_t* qh = src + 16;
    const uint8_t* qs = src + 48;
    for (int c = 0; c < 4; ++c) {
      const KScaleMin lo = k_scale_min(scales, 2 * c);
      const KScaleMin hi = k_scale_min(scales, 2 * c + 1);
      const float d1 = d * lo.scale, m1 = dmin * lo.min;
      const float d2 = d * hi.scale, m2 = dmin * hi.min;
      const uint8_t* q = qs + 32 * c;
      float* y = dst + 64 * c;
      for (int l = 0; l < 32; ++l) {
        const int v = (q[l] & 0xF) + (((qh[l] >> (2 * c)) & 1) << 4);
        y[l] = d1 * static_cast<float>(v) - m1;
      }
      for (int l = 0; l < 32; ++l) {
        const int v = (q[l] >> 4) + (((qh[l] >> (2 * c + 1)) & 1) << 4);
        y[32 + l] = d2 * static_cast<float>(v) - m2;
      }
    }
  }
}

// Q6_K: u8 ql[128] | u8 qh[64] | i8 scales[16] | half d. Two halves of 128; y = (d*sc) * (q6 - 32).
void dq_q6_k(const uint8_t* src, float* dst, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, src += 210, dst += 256) {
    const float d = load_half(src + 208);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = src + 64 * h;
      const uint8_t* qh = src + 128 + 32 * h;
      const int8_t* sc = reinterpret_cast<const int8_t*>(src + 192 + 8 * h);
      float* y = dst + 128 * h;
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * static_cast<float>(sc[is]) * static_cast<float>(q1);
        y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
        y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
        y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
      }
    }
  }
}

// ---- ternary and binary types ---------------------------------------------------------------

// Writes the 5*count values held by `count` base-3 bytes: value n*count + m is trit n of byte m.
inline void unpack_trits5(const uint8_t* q, int count, float d, float* y) {
  for (int n = 0; n < 5; ++n)
    for (int m = 0; m < count; ++m) y[n * count + m] = static_cast<float>(base3_trit(q[m], n) - 1) * d;
}
// The 4-trit bytes (qh): value n*count + m is trit n of byte m, n < 4.
inline void unpack_trits4(const uint8_t* q, int count, float d, float* y) {
  for (int n = 0; n < 4; ++n)
    for (int m = 0; m < count; ++m) y[n * count + m] = static_cast<float>(base3_trit(q[m], n) - 1) * d;
}

// TQ1_0: u8 qs[48] | u8 qh[4] | half d; stages of 32 and 16 qs bytes, then 4 qh bytes.
void dq_tq1_0(const uint8_t* src, float* dst, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, src += 54, dst += 256) {
    const float d = load_half(src + 52);
    unpack_trits5(src, 32, d, dst);
    unpack_trits5(src + 32, 16, d, dst + 160);
    unpack_trits4(src + 48, 4, d, dst + 240);
  }
}

// PTQ1_0: u8 qs[24] | u8 qh[2] | half d; stages of 16 and 8 qs bytes, then 2 qh bytes.
void dq_ptq1_0(const uint8_t* src, float* dst, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, src += 28, dst += 128) {
    const float d = load_half(src + 26);
    unpack_trits5(src, 16, d, dst);
    unpack_trits5(src + 16, 8, d, dst + 80);
    unpack_trits4(src + 24, 2, d, dst + 120);
  }
}

// TQ2_0: u8 qs[64] | half d; y[4j + 32l + m] = (((qs[j+m] >> 2l) & 3) - 1) * d for j in {0, 32}.
void dq_tq2_0(const uint8_t* src, float* dst, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, src += 66, dst += 256) {
    const float d = load_half(src + 64);
    for (int j = 0; j < 64; j += 32)
      for (int l = 0; l < 4; ++l)
        for (int m = 0; m < 32; ++m)
          dst[4 * j + 32 * l + m] = static_cast<float>(((src[j + m] >> (2 * l)) & 3) - 1) * d;
  }
}

// Q2_0 (64 elements) and PQ2_0 (128): half d | 2-bit codes, element j at bits 2(j%4) of byte j/4.
template <int kElems>
void dq_2bit_linear(const uint8_t* src, float* dst, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, src += 2 + kElems / 4, dst += kElems) {
    const float d = load_half(src);
    const uint8_t* qs = src + 2;
    for (int j = 0; j < kElems; ++j) dst[j] = static_cast<float>(((qs[j / 4] >> (2 * (j % 4))) & 3) - 1) * d;
  }
}

// Q1_0: half d | u8 qs[16]; bit j%8 of byte j/8 set -> +d, else -d.
void dq_q1_0(const uint8_t* src, float* dst, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, src += 18, dst += 128) {
    const float d = load_half(src);
    const float pick[2] = {-d, d};  // indexed, not branched: the bits are random, a branch mispredicts
    const uint8_t* qs = src + 2;
    for (int j = 0; j < 128; ++j) dst[j] = pick[(qs[j / 8] >> (j % 8)) & 1];
  }
}

}  // namespace

float reduce_lanes(const float* L) {
  // 32 -> 8: the four 8-lane registers, (r0 + r1) + (r2 + r3); then 8 -> 4 -> 2 -> 1 by halves.
  float v[8];
  for (int k = 0; k < 8; ++k) v[k] = (L[k] + L[k + 8]) + (L[k + 16] + L[k + 24]);
  float s[4];
  for (int k = 0; k < 4; ++k) s[k] = v[k] + v[k + 4];
  const float t0 = s[0] + s[2];
  const float t1 = s[1] + s[3];
  return t0 + t1;
}

DequantFn scalar_dequant_fn(GgmlType type) {
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

void scalar_dot_tile(DequantFn dq, int64_t block_elems, int64_t block_bytes, const uint8_t* w, int64_t n,
                     const float* x, int64_t ldx, int rows, float* out) {
  float tmp[kChunkElems];
  float lanes[kTileRows][kLanes] = {};
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
      for (int64_t j = 0; j < len; ++j) L[j % kLanes] = std::fma(tmp[j], xr[j], L[j % kLanes]);
    }
  }
  for (int r = 0; r < rows; ++r) out[r] = reduce_lanes(lanes[r]);
}

}  // namespace dflash::quant_detail
