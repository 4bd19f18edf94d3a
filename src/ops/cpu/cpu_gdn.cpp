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
void CpuBackend::gdn_conv(const float* x, float* state, float* state_before, const float* w, float* y, int64_t M,
                          int64_t C, int64_t K) {
  DFLASH_CHECK(K >= 1, "cpu gdn_conv: kernel size {}", K);
  const int64_t H = K - 1;  // history rows
  if (state_before && H > 0) std::memcpy(state_before, state, static_cast<size_t>(H * C) * sizeof(float));
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

// The state's two per-row steps, shared by the recurrence and gdn_apply_rows_batch so that both round
// alike: the decay of a state row Si [dv], and the update k_i delta^T added to it after the decay.
static inline void decay_state_row(float* Si, float decay, int64_t dv) {
  for (int64_t j = 0; j < dv; ++j) Si[j] *= decay;
}
static inline void add_state_update(float* Si, float ki, const float* delta, int64_t dv) {
  for (int64_t j = 0; j < dv; ++j) Si[j] += ki * delta[j];
}

// Per V head p (one task each), per row in order, with S = state[p] of [head_k][head_v]:
//   S *= exp(g);  kv = S^T k;  delta = (v - kv) * beta;  S += k delta^T;  o = S^T q
// Sums over the key dim i run in increasing i (two passes over S per row). deltas: null, or [M, Hv, dv]
// receives each row's delta.
void CpuBackend::recurrence(const float* q, const float* k, const float* v, const float* g, const float* beta,
                            float* state, float* out, float* snapshots, float* deltas, int64_t M,
                            const GdnShape& shape) {
  const int64_t Hk = shape.n_k_heads, Hv = shape.n_v_heads, dk = shape.head_k, dv = shape.head_v;
  const int64_t head_state = dk * dv;
  pool_.parallel_for(Hv, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> kv(static_cast<size_t>(dv)), delta(static_cast<size_t>(dv)), unwanted(out ? 0 : dv);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t kh = p % Hk;
      float* S = state + p * head_state;
      for (int64_t m = 0; m < M; ++m) {
        const float* qm = q + (m * Hk + kh) * dk;
        const float* km = k + (m * Hk + kh) * dk;
        const float* vm = v + (m * Hv + p) * dv;
        float* om = out ? out + (m * Hv + p) * dv : unwanted.data();  // out null: the outputs are not wanted
        const float decay = std::exp(g[m * Hv + p]);
        const float b = beta[m * Hv + p];
        std::fill(kv.begin(), kv.end(), 0.0f);
        for (int64_t i = 0; i < dk; ++i) {
          float* Si = S + i * dv;
          const float ki = km[i];
          decay_state_row(Si, decay, dv);
          for (int64_t j = 0; j < dv; ++j) kv[j] += Si[j] * ki;
        }
        for (int64_t j = 0; j < dv; ++j) delta[j] = (vm[j] - kv[j]) * b;
        if (deltas) std::copy(delta.begin(), delta.end(), deltas + (m * Hv + p) * dv);
        std::fill(om, om + dv, 0.0f);
        for (int64_t i = 0; i < dk; ++i) {
          float* Si = S + i * dv;
          const float qi = qm[i];
          add_state_update(Si, km[i], delta.data(), dv);
          for (int64_t j = 0; j < dv; ++j) om[j] += Si[j] * qi;
        }
        if (snapshots) std::memcpy(snapshots + m * Hv * head_state + p * head_state, S, head_state * sizeof(float));
      }
    }
  });
}

void CpuBackend::gdn_recurrent(const float* q, const float* k, const float* v, const float* g, const float* beta,
                               const float* state_in, float* state, float* out, float* snapshots, int64_t M,
                               const GdnShape& shape) {
  check_shape(shape, "gdn_recurrent");
  const int64_t head_state = shape.head_k * shape.head_v;
  if (state_in != state)
    std::memcpy(state, state_in, static_cast<size_t>(shape.n_v_heads * head_state) * sizeof(float));
  recurrence(q, k, v, g, beta, state, out, snapshots, nullptr, M, shape);
}

void CpuBackend::gdn_apply_rows_batch(std::span<const GdnApplyJob> jobs, int64_t M, const GdnShape& shape) {
  if (jobs.empty() || M <= 0) return;
  check_shape(shape, "gdn_apply_rows_batch");
  const int64_t Hk = shape.n_k_heads, Hv = shape.n_v_heads, dk = shape.head_k, dv = shape.head_v;
  const int64_t n_jobs = static_cast<int64_t>(jobs.size());
  for (int64_t t = 0; t < n_jobs; ++t)
    DFLASH_CHECK(jobs[t].k && jobs[t].g && jobs[t].delta && jobs[t].state,
                 "cpu gdn_apply_rows_batch: job {} has a null input or state", t);
  // One task per (job, V head): the rows of a head run in order, its key rows independently.
  pool_.parallel_for(n_jobs * Hv, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const GdnApplyJob& job = jobs[t / Hv];
      const int64_t p = t % Hv, kh = p % Hk;
      float* S = job.state + p * dk * dv;
      for (int64_t m = 0; m < M; ++m) {
        const float decay = std::exp(job.g[m * Hv + p]);
        const float* km = job.k + (m * Hk + kh) * dk;
        const float* dm = job.delta + (m * Hv + p) * dv;
        for (int64_t i = 0; i < dk; ++i) {
          decay_state_row(S + i * dv, decay, dv);
          add_state_update(S + i * dv, km[i], dm, dv);
        }
      }
    }
  });
}

// The op sequence itself (l2_norm, l2_norm, gdn_gates, gdn_recurrent), on packed copies of the inputs:
// into the caller's `prepared` buffers when given, else into scratch. v is copied only when strided.
// Undoable (prepared->delta): the recurrence runs on a copy of the state, which stays as it was.
void CpuBackend::gdn_prepare_recurrent(const GdnRawInputs& in, float* state, float* out, const GdnPrepared* prepared,
                                       int64_t M, const GdnShape& shape) {
  check_shape(shape, "gdn_prepare_recurrent");
  if (M <= 0) return;
  const int64_t Hk = shape.n_k_heads, Hv = shape.n_v_heads, dk = shape.head_k, dv = shape.head_v;
  const int64_t nqk = Hk * dk, nv = Hv * dv;
  DFLASH_CHECK(in.q_stride >= nqk && in.k_stride >= nqk && in.v_stride >= nv,
               "cpu gdn_prepare_recurrent: row strides q {} k {} v {} below the row widths {} / {}", in.q_stride,
               in.k_stride, in.v_stride, nqk, nv);
  const auto sz = [](int64_t n) { return static_cast<size_t>(n); };
  std::vector<float> scratch(prepared ? 0 : sz(M * (2 * nqk + 2 * Hv)));
  float* q = prepared ? prepared->q : scratch.data();
  float* k = prepared ? prepared->k : q + M * nqk;
  float* g = prepared ? prepared->g : k + M * nqk;
  float* beta = prepared ? prepared->beta : g + M * Hv;
  copy_rows(q, nqk, in.q, in.q_stride, M, nqk);
  copy_rows(k, nqk, in.k, in.k_stride, M, nqk);
  l2_norm(q, q, M * Hk, dk, kGdnL2Eps, 1.0f / std::sqrt(static_cast<float>(dk)));
  l2_norm(k, k, M * Hk, dk, kGdnL2Eps, 1.0f);
  std::memcpy(g, in.a, sz(M * Hv) * sizeof(float));
  std::memcpy(beta, in.b, sz(M * Hv) * sizeof(float));
  gdn_gates(g, beta, in.dt_bias, in.ssm_a, M, Hv);
  std::vector<float> v_packed(in.v_stride == nv ? 0 : sz(M * nv));
  const float* v = in.v;
  if (!v_packed.empty()) {
    copy_rows(v_packed.data(), nv, in.v, in.v_stride, M, nv);
    v = v_packed.data();
  }
  float* deltas = prepared ? prepared->delta : nullptr;
  std::vector<float> work(deltas ? sz(Hv * dk * dv) : 0);  // undoable: the state's copy the rows run on
  if (deltas) std::memcpy(work.data(), state, work.size() * sizeof(float));
  recurrence(q, k, v, g, beta, deltas ? work.data() : state, out, nullptr, deltas, M, shape);
}

// ---- chunked (WY / UT transform) form -------------------------------------------------------------

// Rows go in chunks of kChunk (the last one may be shorter). Within a chunk of L rows, with S0 the
// state entering it, G_t = g_0 + ... + g_t (cumulative log-decay, t = 0..L-1) and Gam_t = exp(G_t),
// unrolling the recurrence gives for the per-row update u_t (S_t = exp(g_t) S_{t-1} + k_t u_t^T):
//   u_t = beta_t (v_t - Gam_t S0^T k_t - sum_{s<t} exp(G_t - G_s) (k_t . k_s) u_s)
// i.e. (I + A) U = diag(beta) V - diag(beta Gam) K S0 with A[t][s] = beta_t exp(G_t - G_s) k_t.k_s (s < t).
// UT transform: T = (I + A)^-1 (unit lower triangular, by forward substitution), then the WY factors
//   W = T diag(beta Gam) K   [L, head_k],   U~ = T diag(beta) V   [L, head_v]
// depend only on the chunk's own inputs (a GPU computes them for all chunks in parallel); the state
// enters only through
//   U   = U~ - W S0
//   O_t = Gam_t S0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t . k_s) u_s
//   S_L = Gam_{L-1} S0 + sum_s exp(G_{L-1} - G_s) k_s u_s^T.
// Only differences G_t - G_s (<= 0) are exponentiated, never 1/Gam, so nothing overflows. G is summed
// in double: differences of long fp32 prefix sums would lose the small per-row decays.
// A row's output depends on the rows before it in its chunk and on where chunks start (multiples of
// kChunk from the first row), so unlike gdn_recurrent this op is not bit-identical across M; it is
// meant for prefill, where no other pass has to reproduce its bits.
constexpr int64_t kChunk = 64;

void CpuBackend::gdn_chunked(const float* q, const float* k, const float* v, const float* g, const float* beta,
                             float* state, float* out, int64_t M, const GdnShape& shape) {
  check_shape(shape, "gdn_chunked");
  const int64_t Hk = shape.n_k_heads, Hv = shape.n_v_heads, dk = shape.head_k, dv = shape.head_v;
  pool_.parallel_for(Hv, 1, [&](int64_t p0, int64_t p1) {
    const auto sz = [](int64_t n) { return static_cast<size_t>(n); };
    std::vector<float> Kc(sz(kChunk * dk)), Qc(sz(kChunk * dk)), Vc(sz(kChunk * dv));  // chunk rows, contiguous
    std::vector<float> W(sz(kChunk * dk)), U(sz(kChunk * dv));
    std::vector<float> A(sz(kChunk * kChunk)), T(sz(kChunk * kChunk)), QK(sz(kChunk * kChunk));
    double G[kChunk];
    float gam[kChunk], B[kChunk], dlast[kChunk];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t kh = p % Hk;
      float* S = state + p * dk * dv;
      for (int64_t t0 = 0; t0 < M; t0 += kChunk) {
        const int64_t L = std::min(kChunk, M - t0);
        double cum = 0.0;
        for (int64_t t = 0; t < L; ++t) {
          const int64_t m = t0 + t;
          std::memcpy(&Kc[t * dk], k + (m * Hk + kh) * dk, sz(dk) * sizeof(float));
          std::memcpy(&Qc[t * dk], q + (m * Hk + kh) * dk, sz(dk) * sizeof(float));
          std::memcpy(&Vc[t * dv], v + (m * Hv + p) * dv, sz(dv) * sizeof(float));
          cum += g[m * Hv + p];
          G[t] = cum;
          gam[t] = static_cast<float>(std::exp(cum));
          B[t] = beta[m * Hv + p];
        }
        // A (strictly lower) and the decayed q.k scores QK (lower, diagonal included).
        for (int64_t t = 0; t < L; ++t)
          for (int64_t s = 0; s <= t; ++s) {
            const float decay = static_cast<float>(std::exp(G[t] - G[s]));
            if (s < t) A[t * kChunk + s] = B[t] * decay * dot_f32(&Kc[t * dk], &Kc[s * dk], dk);
            QK[t * kChunk + s] = dot_f32(&Qc[t * dk], &Kc[s * dk], dk) * decay;
          }
        // T = (I + A)^-1: T[t][s] = -sum_{r=s}^{t-1} A[t][r] T[r][s].
        for (int64_t t = 0; t < L; ++t) {
          for (int64_t s = 0; s < t; ++s) {
            float acc = 0.0f;
            for (int64_t r = s; r < t; ++r) acc += A[t * kChunk + r] * T[r * kChunk + s];
            T[t * kChunk + s] = -acc;
          }
          T[t * kChunk + t] = 1.0f;
        }
        // WY factors: W = T diag(beta Gam) K, U~ = T diag(beta) V.
        for (int64_t t = 0; t < L; ++t) {
          float* Wt = &W[t * dk];
          float* Ut = &U[t * dv];
          std::fill(Wt, Wt + dk, 0.0f);
          std::fill(Ut, Ut + dv, 0.0f);
          for (int64_t s = 0; s <= t; ++s) {
            const float cu = T[t * kChunk + s] * B[s];
            const float cw = cu * gam[s];
            const float* Ks = &Kc[s * dk];
            const float* Vs = &Vc[s * dv];
            for (int64_t i = 0; i < dk; ++i) Wt[i] += cw * Ks[i];
            for (int64_t j = 0; j < dv; ++j) Ut[j] += cu * Vs[j];
          }
        }
        // The state enters: U = U~ - W S0, then O = diag(Gam) Q S0 + QK U.
        for (int64_t t = 0; t < L; ++t) {
          float* Ut = &U[t * dv];
          const float* Wt = &W[t * dk];
          for (int64_t i = 0; i < dk; ++i) {
            const float wi = Wt[i];
            const float* Si = S + i * dv;
            for (int64_t j = 0; j < dv; ++j) Ut[j] -= wi * Si[j];
          }
        }
        for (int64_t t = 0; t < L; ++t) {
          float* o = out + ((t0 + t) * Hv + p) * dv;
          std::fill(o, o + dv, 0.0f);
          const float* Qt = &Qc[t * dk];
          for (int64_t i = 0; i < dk; ++i) {
            const float qi = Qt[i];
            const float* Si = S + i * dv;
            for (int64_t j = 0; j < dv; ++j) o[j] += qi * Si[j];
          }
          for (int64_t j = 0; j < dv; ++j) o[j] *= gam[t];
          for (int64_t s = 0; s <= t; ++s) {
            const float c = QK[t * kChunk + s];
            const float* Us = &U[s * dv];
            for (int64_t j = 0; j < dv; ++j) o[j] += c * Us[j];
          }
        }
        // S_L = Gam_{L-1} S0 + K^T diag(exp(G_{L-1} - G_s)) U.
        for (int64_t s = 0; s < L; ++s) dlast[s] = static_cast<float>(std::exp(G[L - 1] - G[s]));
        for (int64_t i = 0; i < dk; ++i) {
          float* Si = S + i * dv;
          for (int64_t j = 0; j < dv; ++j) Si[j] *= gam[L - 1];
          for (int64_t s = 0; s < L; ++s) {
            const float c = Kc[s * dk + i] * dlast[s];
            const float* Us = &U[s * dv];
            for (int64_t j = 0; j < dv; ++j) Si[j] += c * Us[j];
          }
        }
      }
    }
  });
}

}  // namespace dflash::cpu
