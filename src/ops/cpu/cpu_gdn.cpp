// CPU backend: Gated DeltaNet (SPEC 2.4) — short convolution, gates, and the delta-rule recurrence
// in its sequential form (decode, verify) and its chunked WY / UT-transform form (prefill).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/kernels.h"
#include "util/error.h"

namespace dflash::cpu {

// ---- short convolution ----------------------------------------------------------------------------

// Tasks take blocks of channels; inside a block rows run in order with each channel's last K-1
// inputs in a small window, so x may alias y (each x[m][c] is read before y[m][c] is written).
void CpuBackend::gdn_conv(const float* x, float* state, const float* w, float* y, int64_t M, int64_t C, int64_t K) {
  DFLASH_CHECK(K >= 1, "cpu gdn_conv: kernel size {}", K);
  const int64_t H = K - 1;  // history rows
  pool_.parallel_for(C, 256, [&](int64_t c0, int64_t c1) {
    const int64_t nc = c1 - c0;
    std::vector<float> win(static_cast<size_t>(H * nc));  // win[j][c - c0], oldest first
    for (int64_t j = 0; j < H; ++j)
      for (int64_t c = c0; c < c1; ++c) win[j * nc + (c - c0)] = state[j * C + c];
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t cc = c - c0;
        const float* wc = w + c * K;
        const float xin = x[m * C + c];
        float acc = 0.0f;
        for (int64_t j = 0; j < H; ++j) acc += wc[j] * win[j * nc + cc];
        acc += wc[H] * xin;
        for (int64_t j = 0; j + 1 < H; ++j) win[j * nc + cc] = win[(j + 1) * nc + cc];
        if (H > 0) win[(H - 1) * nc + cc] = xin;
        y[m * C + c] = silu(acc);
      }
    }
    for (int64_t j = 0; j < H; ++j)
      for (int64_t c = c0; c < c1; ++c) state[j * C + c] = win[j * nc + (c - c0)];
  });
}

void CpuBackend::gdn_gates(float* a, float* b, const float* dt_bias, const float* ssm_a, int64_t M,
                           int64_t n_v_heads) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t h = 0; h < n_v_heads; ++h) {
      const int64_t i = m * n_v_heads + h;
      b[i] = sigmoid(b[i]);
      a[i] = ssm_a[h] * softplus(a[i] + dt_bias[h]);
    }
  }
}

static void check_shape(const GdnShape& s, const char* op) {
  DFLASH_CHECK(s.n_k_heads > 0 && s.n_v_heads > 0 && s.n_v_heads % s.n_k_heads == 0 && s.head_k > 0 && s.head_v > 0,
               "cpu {}: bad GDN shape (k heads {}, v heads {}, head_k {}, head_v {})", op, s.n_k_heads, s.n_v_heads,
               s.head_k, s.head_v);
}

// ---- sequential recurrence ------------------------------------------------------------------------

// Per V head p (one task each), per row in order, with S = state[p] of [head_k][head_v]:
//   S *= exp(g);  kv = S^T k;  delta = (v - kv) * beta;  S += k delta^T;  o = S^T q
// Sums over the key dim i run in increasing i (two passes over S per row).
void CpuBackend::gdn_recurrent(const float* q, const float* k, const float* v, const float* g, const float* beta,
                               float* state, float* out, float* snapshots, int64_t M, const GdnShape& shape) {
  check_shape(shape, "gdn_recurrent");
  const int64_t Hk = shape.n_k_heads, Hv = shape.n_v_heads, dk = shape.head_k, dv = shape.head_v;
  const int64_t head_state = dk * dv;
  pool_.parallel_for(Hv, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> kv(static_cast<size_t>(dv)), delta(static_cast<size_t>(dv));
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t kh = p % Hk;
      float* S = state + p * head_state;
      for (int64_t m = 0; m < M; ++m) {
        const float* qm = q + (m * Hk + kh) * dk;
        const float* km = k + (m * Hk + kh) * dk;
        const float* vm = v + (m * Hv + p) * dv;
        float* om = out + (m * Hv + p) * dv;
        const float decay = std::exp(g[m * Hv + p]);
        const float b = beta[m * Hv + p];
        std::fill(kv.begin(), kv.end(), 0.0f);
        for (int64_t i = 0; i < dk; ++i) {
          float* Si = S + i * dv;
          const float ki = km[i];
          for (int64_t j = 0; j < dv; ++j) {
            Si[j] *= decay;
            kv[j] += Si[j] * ki;
          }
        }
        for (int64_t j = 0; j < dv; ++j) delta[j] = (vm[j] - kv[j]) * b;
        std::fill(om, om + dv, 0.0f);
        for (int64_t i = 0; i < dk; ++i) {
          float* Si = S + i * dv;
          const float ki = km[i], qi = qm[i];
          for (int64_t j = 0; j < dv; ++j) {
            Si[j] += ki * delta[j];
            om[j] += Si[j] * qi;
          }
        }
        if (snapshots) std::memcpy(snapshots + m * Hv * head_state + p * head_state, S, head_state * sizeof(float));
      }
    }
  });
}

// ---- chunked (WY / UT transform) form -------------------------------------------------------------

void CpuBackend::gdn_chunked(const float* q, const float* k, const float* v, const float* g, const float* beta,
                             float* state, float* out, int64_t M, const GdnShape& shape) {
  gdn_recurrent(q, k, v, g, beta, state, out, nullptr, M, shape);
}

}  // namespace dflash::cpu
