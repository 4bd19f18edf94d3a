// CPU backend: rotary embedding and softmax attention over a KV cache.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/kernels.h"
#include "util/error.h"

namespace dflash::cpu {

// The angles follow Hugging Face's fp32 recipe so that our numbers sit next to the oracle's:
// inv_freq[i] = fp32(theta^(-2i/n_rot)), angle = fp32(pos) * inv_freq[i] rounded to fp32, and
// cos/sin of that fp32 angle (evaluated in double, then rounded).
void CpuBackend::rope_neox(float* x, const int32_t* pos, int64_t M, int64_t heads, int64_t head_dim, int64_t n_rot,
                           float theta) {
  DFLASH_CHECK(n_rot > 0 && n_rot % 2 == 0 && n_rot <= head_dim, "cpu rope: n_rot {} invalid for head_dim {}", n_rot,
               head_dim);
  const int64_t half = n_rot / 2;
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i)
    inv_freq[i] = static_cast<float>(1.0 / std::pow(static_cast<double>(theta), static_cast<double>(2 * i) / n_rot));
  pool_.parallel_for(M, 1, [&](int64_t m0, int64_t m1) {
    std::vector<float> c(static_cast<size_t>(half)), s(static_cast<size_t>(half));
    for (int64_t m = m0; m < m1; ++m) {
      const float p = static_cast<float>(pos[m]);
      for (int64_t i = 0; i < half; ++i) {
        const float angle = p * inv_freq[i];
        c[i] = static_cast<float>(std::cos(static_cast<double>(angle)));
        s[i] = static_cast<float>(std::sin(static_cast<double>(angle)));
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* xh = x + (m * heads + h) * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float a = xh[i], b = xh[i + half];
          xh[i] = a * c[i] - b * s[i];
          xh[i + half] = b * c[i] + a * s[i];
        }
      }
    }
  });
}

// One task per (row, head). Scores in key order, max subtracted, exp, sum in key order; the output
// accumulates p_j * v_j in key order and divides by the sum at the end.
void CpuBackend::attention(const float* q, const float* k, const float* v, const int32_t* kv_range, float* out,
                           int64_t M, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale) {
  DFLASH_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0, "cpu attention: {} heads not a multiple of {} kv heads",
               n_heads, n_kv_heads);
  for (int64_t m = 0; m < M; ++m)
    DFLASH_CHECK(kv_range[2 * m] >= 0 && kv_range[2 * m] <= kv_range[2 * m + 1],
                 "cpu attention: row {} has key range [{}, {})", m, kv_range[2 * m], kv_range[2 * m + 1]);
  const int64_t group = n_heads / n_kv_heads;
  const int64_t kv_stride = n_kv_heads * head_dim;
  pool_.parallel_for(M * n_heads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    std::vector<float> acc(static_cast<size_t>(head_dim));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m = t / n_heads, h = t % n_heads, kvh = h / group;
      const int64_t lo = kv_range[2 * m], hi = kv_range[2 * m + 1];
      const float* qh = q + (m * n_heads + h) * head_dim;
      float* oh = out + (m * n_heads + h) * head_dim;
      if (hi == lo) {
        std::fill(oh, oh + head_dim, 0.0f);
        continue;
      }
      scores.resize(static_cast<size_t>(hi - lo));
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = lo; j < hi; ++j) {
        const float sc = dot_f32(qh, k + j * kv_stride + kvh * head_dim, head_dim) * scale;
        scores[j - lo] = sc;
        mx = std::max(mx, sc);
      }
      float sum = 0.0f;
      for (auto& sc : scores) {
        sc = std::exp(sc - mx);
        sum += sc;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = lo; j < hi; ++j) {
        const float p = scores[j - lo];
        const float* vj = v + j * kv_stride + kvh * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) acc[d] += p * vj[d];
      }
      const float inv = 1.0f / sum;
      for (int64_t d = 0; d < head_dim; ++d) oh[d] = acc[d] * inv;
    }
  });
}

}  // namespace dflash::cpu
