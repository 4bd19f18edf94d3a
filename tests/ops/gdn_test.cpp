// CPU backend: Gated DeltaNet conv, gates, sequential recurrence (with snapshots) and chunked form.
#include <gtest/gtest.h>

#include <cstdio>

#include "ops/backend.h"
#include "ops_test_util.h"
#include "util/error.h"

namespace dflash::test {
namespace {

double silu_d(double x) { return x / (1.0 + std::exp(-x)); }

// ---- conv -----------------------------------------------------------------------------------------

TEST(CpuGdnConv, MatchesReferenceUpdatesStateAndRowsAreBitIdentical) {
  std::mt19937 rng(20);
  auto be = make_cpu_backend(3);
  for (auto [M, C, K] : {std::tuple{1, 10, 4}, {7, 600, 4}, {3, 33, 2}, {2, 5, 1}}) {
    SCOPED_TRACE(testing::Message() << "M " << M << " C " << C << " K " << K);
    auto x = random_vec(rng, M * C, -2, 2);
    auto w = random_vec(rng, C * K);
    auto state0 = random_vec(rng, (K - 1) * C, -2, 2);
    // Reference over the concatenated history.
    std::vector<float> seq = state0;
    seq.insert(seq.end(), x.begin(), x.end());
    std::vector<double> ref(M * C);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < C; ++c) {
        double acc = 0;
        for (int64_t j = 0; j < K; ++j) acc += double(w[c * K + j]) * seq[(m + j) * C + c];
        ref[m * C + c] = silu_d(acc);
      }
    std::vector<float> state_ref(seq.end() - (K - 1) * C, seq.end());

    std::vector<float> state = state0, y(M * C), before((K - 1) * C, -1.0f);
    be->gdn_conv(x.data(), state.data(), before.data(), w.data(), y.data(), M, C, K);
    expect_close(y, ref, 1e-6, 1e-5, "conv out");
    EXPECT_EQ(state, state_ref);
    EXPECT_EQ(before, state0) << "state_before: the state as it was before the rows";

    // One row at a time, and in place, give the same bits and state.
    std::vector<float> s1 = state0, y1(M * C);
    for (int64_t m = 0; m < M; ++m)
      be->gdn_conv(x.data() + m * C, s1.data(), nullptr, w.data(), y1.data() + m * C, 1, C, K);
    EXPECT_TRUE(same_bits(y1.data(), y.data(), y.size()));
    EXPECT_EQ(s1, state_ref);
    std::vector<float> si = state0, xi = x;
    be->gdn_conv(xi.data(), si.data(), nullptr, w.data(), xi.data(), M, C, K);
    EXPECT_TRUE(same_bits(xi.data(), y.data(), y.size()));
    EXPECT_EQ(si, state_ref);
  }
}

TEST(CpuGdnGates, MatchesReference) {
  std::mt19937 rng(21);
  auto be = make_cpu_backend(1);
  const int64_t M = 4, H = 6;
  auto a = random_vec(rng, M * H, -30, 30), b = random_vec(rng, M * H, -8, 8);
  auto dt = random_vec(rng, H), A = random_vec(rng, H, -4, -0.1f);
  std::vector<float> ga = a, gb = b;
  be->gdn_gates(ga.data(), gb.data(), dt.data(), A.data(), M, H);
  std::vector<double> ra(M * H), rb(M * H);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t h = 0; h < H; ++h) {
      const double u = double(a[m * H + h]) + dt[h];
      ra[m * H + h] = A[h] * (u > 20 ? u : std::log1p(std::exp(u)));
      rb[m * H + h] = 1.0 / (1.0 + std::exp(-double(b[m * H + h])));
    }
  expect_close(ga, ra, 1e-6, 1e-5, "g");
  expect_close(gb, rb, 1e-7, 1e-6, "beta");
}

// ---- recurrence -----------------------------------------------------------------------------------

struct GdnInputs {
  GdnShape shape;
  int64_t M;
  std::vector<float> q, k, v, g, beta, state;
};

void l2norm_heads(std::vector<float>& x, int64_t d, float scale) {
  for (size_t o = 0; o < x.size(); o += d) {
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += double(x[o + i]) * x[o + i];
    for (int64_t i = 0; i < d; ++i) x[o + i] = float(x[o + i] / std::sqrt(ss + 1e-6) * scale);
  }
}

// Realistic ranges: l2-normed q (scaled by 1/sqrt(head_k)) and k, g in [-5, 0], beta in (0, 1),
// and a nonzero incoming state of the size a trained model carries.
// `correlated_keys`: every key is a shared direction plus 30% noise (nearly collinear keys make
// I + A in the UT transform far from the identity).
GdnInputs make_gdn(std::mt19937& rng, GdnShape s, int64_t M, bool correlated_keys = false) {
  GdnInputs in{s, M, {}, {}, {}, {}, {}, {}};
  in.q = random_vec(rng, M * s.n_k_heads * s.head_k);
  in.k = random_vec(rng, M * s.n_k_heads * s.head_k);
  if (correlated_keys) {
    auto base = random_vec(rng, s.n_k_heads * s.head_k);
    for (size_t i = 0; i < in.k.size(); ++i) in.k[i] = base[i % base.size()] + 0.3f * in.k[i];
  }
  l2norm_heads(in.q, s.head_k, 1.0f / std::sqrt(float(s.head_k)));
  l2norm_heads(in.k, s.head_k, 1.0f);
  in.v = random_vec(rng, M * s.n_v_heads * s.head_v, -2, 2);
  in.g = random_vec(rng, M * s.n_v_heads, -5, 0);
  // Include slow-decay heads (g near 0), the case where errors accumulate the longest.
  for (int64_t m = 0; m < M; ++m) in.g[m * s.n_v_heads] *= 0.01f;
  in.beta = random_vec(rng, M * s.n_v_heads, 0.01f, 0.99f);
  in.state = random_vec(rng, s.n_v_heads * s.head_k * s.head_v, -0.5f, 0.5f);
  return in;
}

// Double-precision sequential reference; returns outputs, updates `state`.
std::vector<double> gdn_ref(const GdnInputs& in, std::vector<double>& S) {
  const auto& s = in.shape;
  const int64_t Hk = s.n_k_heads, Hv = s.n_v_heads, dk = s.head_k, dv = s.head_v;
  std::vector<double> out(in.M * Hv * dv);
  for (int64_t p = 0; p < Hv; ++p) {
    const int64_t kh = p % Hk;
    double* Sp = S.data() + p * dk * dv;
    for (int64_t m = 0; m < in.M; ++m) {
      const float* q = in.q.data() + (m * Hk + kh) * dk;
      const float* k = in.k.data() + (m * Hk + kh) * dk;
      const float* v = in.v.data() + (m * Hv + p) * dv;
      const double decay = std::exp(double(in.g[m * Hv + p])), b = in.beta[m * Hv + p];
      for (int64_t i = 0; i < dk * dv; ++i) Sp[i] *= decay;
      for (int64_t j = 0; j < dv; ++j) {
        double kv = 0;
        for (int64_t i = 0; i < dk; ++i) kv += Sp[i * dv + j] * k[i];
        const double delta = (v[j] - kv) * b;
        for (int64_t i = 0; i < dk; ++i) Sp[i * dv + j] += k[i] * delta;
      }
      for (int64_t j = 0; j < dv; ++j) {
        double o = 0;
        for (int64_t i = 0; i < dk; ++i) o += Sp[i * dv + j] * q[i];
        out[(m * Hv + p) * dv + j] = o;
      }
    }
  }
  return out;
}

struct GdnResult {
  std::vector<float> out, state, snapshots;
};

GdnResult run_gdn(Backend& be, const GdnInputs& in, bool chunked, bool snapshots = false, int64_t row0 = 0,
                  int64_t rows = -1, const std::vector<float>* state0 = nullptr) {
  const auto& s = in.shape;
  if (rows < 0) rows = in.M - row0;
  GdnResult r;
  r.state = state0 ? *state0 : in.state;
  r.out.assign(rows * s.n_v_heads * s.head_v, 0.0f);
  if (snapshots) r.snapshots.assign(rows * s.n_v_heads * s.head_k * s.head_v, 0.0f);
  const int64_t qk = row0 * s.n_k_heads * s.head_k, vv = row0 * s.n_v_heads * s.head_v, gg = row0 * s.n_v_heads;
  if (chunked)
    be.gdn_chunked(in.q.data() + qk, in.k.data() + qk, in.v.data() + vv, in.g.data() + gg, in.beta.data() + gg,
                   r.state.data(), r.out.data(), rows, s);
  else
    be.gdn_recurrent(in.q.data() + qk, in.k.data() + qk, in.v.data() + vv, in.g.data() + gg, in.beta.data() + gg,
                     r.state.data(), r.state.data(), r.out.data(), snapshots ? r.snapshots.data() : nullptr, rows, s);
  return r;
}

TEST(CpuGdnRecurrent, MatchesDoubleReference) {
  std::mt19937 rng(22);
  auto be = make_cpu_backend(3);
  for (auto [shape, M] : {std::pair{GdnShape{1, 1, 16, 8}, 3}, {GdnShape{2, 6, 64, 32}, 20}, {GdnShape{2, 4, 128, 128}, 9}}) {
    SCOPED_TRACE(testing::Message() << "Hk " << shape.n_k_heads << " Hv " << shape.n_v_heads << " M " << M);
    auto in = make_gdn(rng, shape, M);
    auto r = run_gdn(*be, in, false);
    std::vector<double> S(in.state.begin(), in.state.end());
    auto ref = gdn_ref(in, S);
    expect_close(r.out, ref, 2e-5, 1e-4, "out");
    expect_close(r.state, S, 2e-5, 1e-4, "state");
  }
}

TEST(CpuGdnRecurrent, RowsAtOnceEqualRowByRowAndSnapshotsEqualShorterRuns) {
  std::mt19937 rng(23);
  auto be = make_cpu_backend(3);
  const GdnShape shape{2, 6, 32, 16};
  const int64_t M = 6;
  auto in = make_gdn(rng, shape, M);
  auto all = run_gdn(*be, in, false, /*snapshots=*/true);
  const int64_t vrow = shape.n_v_heads * shape.head_v, srow = shape.n_v_heads * shape.head_k * shape.head_v;
  std::vector<float> state = in.state;
  for (int64_t m = 0; m < M; ++m) {
    auto one = run_gdn(*be, in, false, false, m, 1, &state);
    EXPECT_TRUE(same_bits(one.out.data(), all.out.data() + m * vrow, vrow)) << "row " << m;
    state = one.state;
    // The snapshot after row m is the state of a run that stopped after row m.
    auto prefix = run_gdn(*be, in, false, false, 0, m + 1);
    EXPECT_TRUE(same_bits(all.snapshots.data() + m * srow, prefix.state.data(), srow)) << "snapshot " << m;
  }
  EXPECT_TRUE(same_bits(state.data(), all.state.data(), srow));
  auto be1 = make_cpu_backend(1);
  auto t1 = run_gdn(*be1, in, false, true);
  EXPECT_TRUE(same_bits(t1.out.data(), all.out.data(), all.out.size()));
  EXPECT_TRUE(same_bits(t1.snapshots.data(), all.snapshots.data(), all.snapshots.size()));
}

// ---- undo: the recorded rows' updates (rollback) ------------------------------------------------------

// An undoable gdn_prepare_recurrent (GdnPrepared::delta) leaves the state as it was and its out as the
// plain op's; gdn_apply_rows_batch over its first n rows gives, for every n and in one batch of jobs with
// their own data, bit for bit the state of gdn_recurrent over those n rows.
TEST(CpuGdnApplyRows, KeptRowsEqualTheRecurrence) {
  std::mt19937 rng(27);
  auto be = make_cpu_backend(2);
  for (const GdnShape& s : {GdnShape{2, 4, 32, 16}, GdnShape{1, 3, 128, 64}}) {
    SCOPED_TRACE(testing::Message() << "Hk " << s.n_k_heads << " Hv " << s.n_v_heads << " dk " << s.head_k);
    const int64_t M = 5, Hv = s.n_v_heads, nqk = s.n_k_heads * s.head_k, nv = Hv * s.head_v;
    const int64_t hs = Hv * s.head_k * s.head_v;
    struct Job {
      std::vector<float> q, k, v, a, b, dt, A, state0, pq, pk, pg, pb, delta;
    };
    std::vector<Job> js(3);
    for (Job& x : js) {
      x.q = random_vec(rng, M * nqk, -2, 2), x.k = random_vec(rng, M * nqk, -2, 2), x.v = random_vec(rng, M * nv);
      x.a = random_vec(rng, M * Hv, -6, 6), x.b = random_vec(rng, M * Hv, -6, 6);
      x.dt = random_vec(rng, Hv), x.A = random_vec(rng, Hv, -4, -0.1f);
      x.state0 = random_vec(rng, hs, -0.5f, 0.5f);
      x.pq.assign(M * nqk, 0.0f), x.pk.assign(M * nqk, 0.0f), x.pg.assign(M * Hv, 0.0f), x.pb.assign(M * Hv, 0.0f);
      x.delta.assign(M * nv, -1.0f);
      const Backend::GdnRawInputs in{x.q.data(), nqk, x.k.data(), nqk, x.v.data(), nv,
                                     x.a.data(), x.b.data(), x.dt.data(), x.A.data()};
      const Backend::GdnPrepared undo{x.pq.data(), x.pk.data(), x.pg.data(), x.pb.data(), x.delta.data()};
      std::vector<float> st = x.state0, out(M * nv), st_plain = x.state0, out_plain(M * nv);
      be->gdn_prepare_recurrent(in, st.data(), out.data(), &undo, M, s);
      be->gdn_prepare_recurrent(in, st_plain.data(), out_plain.data(), nullptr, M, s);
      EXPECT_EQ(st, x.state0) << "an undoable step leaves the state as it was";
      EXPECT_TRUE(same_bits(out.data(), out_plain.data(), out.size())) << "undoable out == plain out";
    }
    for (int64_t n = 1; n <= M; ++n) {
      SCOPED_TRACE(testing::Message() << "kept rows " << n);
      std::vector<std::vector<float>> states;
      std::vector<Backend::GdnApplyJob> jobs;
      for (const Job& x : js) states.push_back(x.state0);
      for (size_t j = 0; j < js.size(); ++j)
        jobs.push_back({js[j].pk.data(), js[j].pg.data(), js[j].delta.data(), states[j].data()});
      be->gdn_apply_rows_batch(jobs, n, s);
      for (size_t j = 0; j < js.size(); ++j) {
        const Job& x = js[j];
        std::vector<float> want = x.state0;  // the recurrence over the first n rows, from the prepared inputs
        be->gdn_recurrent(x.pq.data(), x.pk.data(), x.v.data(), x.pg.data(), x.pb.data(), want.data(), want.data(),
                          nullptr, nullptr, n, s);
        EXPECT_TRUE(same_bits(states[j].data(), want.data(), want.size())) << "job " << j;
      }
    }
  }

  std::vector<float> a = random_vec(rng, 37), b = random_vec(rng, 5), a2(37, 0.0f), b2(5, 0.0f);
  const Backend::CopyJob copies[] = {{a2.data(), a.data(), a.size() * sizeof(float)},
                                     {b2.data(), b.data(), b.size() * sizeof(float)}};
  be->copy_batch(copies);
  EXPECT_EQ(a2, a);
  EXPECT_EQ(b2, b);
}

// ---- recurrence with prepared inputs ---------------------------------------------------------------

// gdn_prepare_recurrent from raw conv rows equals the op sequence it replaces (copy_rows, l2_norm,
// l2_norm, gdn_gates, gdn_recurrent) bit for bit: out, state and the prepared q, k, g, beta. Two input
// layouts: q | k | v pieces of one conv row (row stride C plus padding), and separate packed arrays.
TEST(CpuGdnPrepareRecurrent, EqualsOpSequenceBitForBit) {
  std::mt19937 rng(26);
  auto be = make_cpu_backend(3);
  for (const GdnShape& s : {GdnShape{2, 6, 32, 16}, GdnShape{1, 3, 128, 64}})
    for (int64_t M : {1, 3, 8})
      for (bool conv_rows : {true, false}) {
        SCOPED_TRACE(testing::Message() << "Hk " << s.n_k_heads << " Hv " << s.n_v_heads << " dk " << s.head_k
                                        << " dv " << s.head_v << " M " << M << (conv_rows ? " conv rows" : " packed"));
        const int64_t Hk = s.n_k_heads, Hv = s.n_v_heads, nqk = Hk * s.head_k, nv = Hv * s.head_v;
        const int64_t C = 2 * nqk + nv + 5;  // padded, so the strides are not the row widths
        const auto conv = random_vec(rng, M * C, -2, 2);
        auto qp = random_vec(rng, M * nqk, -2, 2), kp = random_vec(rng, M * nqk, -2, 2);
        auto vp = random_vec(rng, M * nv, -2, 2);
        const auto a = random_vec(rng, M * Hv, -6, 6), b = random_vec(rng, M * Hv, -6, 6);
        const auto dt = random_vec(rng, Hv), A = random_vec(rng, Hv, -4, -0.1f);
        const auto state0 = random_vec(rng, Hv * s.head_k * s.head_v, -0.5f, 0.5f);
        Backend::GdnRawInputs in{qp.data(), nqk, kp.data(), nqk, vp.data(), nv,
                                 a.data(), b.data(), dt.data(), A.data()};
        if (conv_rows) in.q = conv.data(), in.k = conv.data() + nqk, in.v = conv.data() + 2 * nqk;
        if (conv_rows) in.q_stride = in.k_stride = in.v_stride = C;

        // the op sequence on packed copies
        std::vector<float> q(M * nqk), k(M * nqk), v(M * nv), g = a, beta = b;
        be->copy_rows(q.data(), nqk, in.q, in.q_stride, M, nqk);
        be->copy_rows(k.data(), nqk, in.k, in.k_stride, M, nqk);
        be->copy_rows(v.data(), nv, in.v, in.v_stride, M, nv);
        be->l2_norm(q.data(), q.data(), M * Hk, s.head_k, 1e-6f, 1.0f / std::sqrt(float(s.head_k)));
        be->l2_norm(k.data(), k.data(), M * Hk, s.head_k, 1e-6f, 1.0f);
        be->gdn_gates(g.data(), beta.data(), dt.data(), A.data(), M, Hv);
        std::vector<float> st_ref = state0, out_ref(M * nv);
        be->gdn_recurrent(q.data(), k.data(), v.data(), g.data(), beta.data(), st_ref.data(), st_ref.data(),
                          out_ref.data(), nullptr, M, s);

        // the op, with and without `prepared`; the inputs stay as they were
        const auto conv_in = conv, qp_in = qp, kp_in = kp, vp_in = vp;
        std::vector<float> pq(M * nqk), pk(M * nqk), pg(M * Hv), pb(M * Hv);
        const Backend::GdnPrepared prep{pq.data(), pk.data(), pg.data(), pb.data()};
        std::vector<float> st = state0, out(M * nv, -1.0f);
        be->gdn_prepare_recurrent(in, st.data(), out.data(), &prep, M, s);
        EXPECT_TRUE(same_bits(out.data(), out_ref.data(), out.size())) << "out";
        EXPECT_TRUE(same_bits(st.data(), st_ref.data(), st.size())) << "state";
        EXPECT_TRUE(same_bits(pq.data(), q.data(), q.size())) << "prepared q";
        EXPECT_TRUE(same_bits(pk.data(), k.data(), k.size())) << "prepared k";
        EXPECT_TRUE(same_bits(pg.data(), g.data(), g.size())) << "prepared g";
        EXPECT_TRUE(same_bits(pb.data(), beta.data(), beta.size())) << "prepared beta";
        std::vector<float> st2 = state0, out2(M * nv, -1.0f);
        be->gdn_prepare_recurrent(in, st2.data(), out2.data(), nullptr, M, s);
        EXPECT_TRUE(same_bits(out2.data(), out_ref.data(), out2.size())) << "out (no prepared)";
        EXPECT_TRUE(same_bits(st2.data(), st_ref.data(), st2.size())) << "state (no prepared)";
        EXPECT_EQ(conv, conv_in);
        EXPECT_EQ(qp, qp_in);
        EXPECT_EQ(kp, kp_in);
        EXPECT_EQ(vp, vp_in);

        // The prepared values against double references (so the sequence above cannot be wrong in
        // the same way as the op): |q| = 1/sqrt(head_k) and |k| = 1 per head, the gates' formulas.
        std::vector<double> qn(M * nqk), kn(M * nqk), gr(M * Hv), br(M * Hv);
        for (int64_t m = 0; m < M; ++m) {
          for (int64_t h = 0; h < Hk; ++h) {
            const float* rq = in.q + m * in.q_stride + h * s.head_k;
            const float* rk = in.k + m * in.k_stride + h * s.head_k;
            double sq = 0, sk = 0;
            for (int64_t i = 0; i < s.head_k; ++i) sq += double(rq[i]) * rq[i], sk += double(rk[i]) * rk[i];
            for (int64_t i = 0; i < s.head_k; ++i) {
              qn[m * nqk + h * s.head_k + i] = rq[i] / std::sqrt(sq + 1e-6) / std::sqrt(double(s.head_k));
              kn[m * nqk + h * s.head_k + i] = rk[i] / std::sqrt(sk + 1e-6);
            }
          }
          for (int64_t h = 0; h < Hv; ++h) {
            const double u = double(a[m * Hv + h]) + dt[h];
            gr[m * Hv + h] = A[h] * (u > 20 ? u : std::log1p(std::exp(u)));
            br[m * Hv + h] = 1.0 / (1.0 + std::exp(-double(b[m * Hv + h])));
          }
        }
        expect_close(pq, qn, 1e-7, 1e-5, "prepared q vs double");
        expect_close(pk, kn, 1e-7, 1e-5, "prepared k vs double");
        expect_close(pg, gr, 1e-6, 1e-5, "prepared g vs double");
        expect_close(pb, br, 1e-7, 1e-6, "prepared beta vs double");

        // gdn_recurrent over the prepared values (and v) gives the op's state
        std::vector<float> st3 = state0, out3(M * nv);
        be->gdn_recurrent(pq.data(), pk.data(), v.data(), pg.data(), pb.data(), st3.data(), st3.data(), out3.data(),
                          nullptr, M, s);
        EXPECT_TRUE(same_bits(st3.data(), st.data(), st.size())) << "recurrence over the prepared values";

        // the lossless contract: M rows at once == one row at a time (state carried)
        std::vector<float> st1 = state0, out1(M * nv), pq1(M * nqk), pk1(M * nqk), pg1(M * Hv), pb1(M * Hv);
        for (int64_t m = 0; m < M; ++m) {
          Backend::GdnRawInputs r = in;
          r.q += m * in.q_stride, r.k += m * in.k_stride, r.v += m * in.v_stride, r.a += m * Hv, r.b += m * Hv;
          const Backend::GdnPrepared p1{pq1.data() + m * nqk, pk1.data() + m * nqk, pg1.data() + m * Hv,
                                        pb1.data() + m * Hv};
          be->gdn_prepare_recurrent(r, st1.data(), out1.data() + m * nv, &p1, 1, s);
        }
        EXPECT_TRUE(same_bits(out1.data(), out.data(), out.size())) << "out, row by row";
        EXPECT_TRUE(same_bits(st1.data(), st.data(), st.size())) << "state, row by row";
        EXPECT_TRUE(same_bits(pq1.data(), pq.data(), pq.size()) && same_bits(pk1.data(), pk.data(), pk.size()) &&
                    same_bits(pg1.data(), pg.data(), pg.size()) && same_bits(pb1.data(), pb.data(), pb.size()))
            << "prepared, row by row";
      }
}

// ---- chunked form ---------------------------------------------------------------------------------

double max_abs(const std::vector<float>& x) {
  double m = 0;
  for (float v : x) m = std::max(m, double(std::fabs(v)));
  return m;
}

TEST(CpuGdnChunked, EqualsRecurrenceToFp32Rounding) {
  std::mt19937 rng(24);
  auto be = make_cpu_backend(3);
  // Observed errors are ~1e-7 (state entries ~1, outputs ~0.1); the bounds leave a 10x margin.
  const double atol = 2e-6, rtol = 1e-5;
  for (bool correlated : {false, true})
    for (const GdnShape& shape : {GdnShape{2, 6, 64, 32}, GdnShape{1, 3, 128, 128}}) {
      for (int64_t M : {1, 5, 64, 100, 200}) {
        SCOPED_TRACE(testing::Message() << "head_k " << shape.head_k << " head_v " << shape.head_v << " M " << M
                                        << " correlated keys " << correlated);
        auto in = make_gdn(rng, shape, M, correlated);
        auto rec = run_gdn(*be, in, false);
        auto chk = run_gdn(*be, in, true);
        std::vector<double> S(in.state.begin(), in.state.end());
        auto ref = gdn_ref(in, S);
        const double e_out = expect_close(chk.out, std::vector<double>(rec.out.begin(), rec.out.end()), atol, rtol,
                                          "chunked vs recurrent out");
        const double e_state = expect_close(chk.state, std::vector<double>(rec.state.begin(), rec.state.end()), atol,
                                            rtol, "chunked vs recurrent state");
        const double r_out = expect_close(chk.out, ref, atol, rtol, "chunked vs double out");
        const double r_state = expect_close(chk.state, S, atol, rtol, "chunked vs double state");
        const double q_out = expect_close(rec.out, ref, atol, rtol, "recurrent vs double out");
        const double q_state = expect_close(rec.state, S, atol, rtol, "recurrent vs double state");
        std::printf(
            "[gdn_chunked] %s dk=%lld dv=%lld M=%3lld max|out| %.2f max|S| %.2f | max|chunked-recurrent| out %.1e "
            "state %.1e | vs double: chunked %.1e / %.1e, recurrent %.1e / %.1e\n",
            correlated ? "corr" : "rand", (long long)shape.head_k, (long long)shape.head_v, (long long)M,
            max_abs(rec.out), max_abs(rec.state), e_out, e_state, r_out, r_state, q_out, q_state);
      }
    }
}

TEST(CpuGdnChunked, ChunkedPrefillThenRecurrentDecodeContinues) {
  // A prefill of 100 rows in chunked form followed by recurrent rows equals all-recurrent.
  std::mt19937 rng(25);
  auto be = make_cpu_backend(3);
  const GdnShape shape{2, 4, 64, 64};
  auto in = make_gdn(rng, shape, 103);
  auto all = run_gdn(*be, in, false);
  auto pre = run_gdn(*be, in, true, false, 0, 100);
  auto tail = run_gdn(*be, in, false, false, 100, 3, &pre.state);
  const int64_t vrow = shape.n_v_heads * shape.head_v;
  std::vector<float> got_tail = tail.out, want_tail(all.out.end() - 3 * vrow, all.out.end());
  expect_close(got_tail, want_tail, 2e-6, 1e-5, "decode after chunked prefill");
  expect_close(tail.state, all.state, 2e-6, 1e-5, "state after chunked prefill + decode");
}

}  // namespace
}  // namespace dflash::test
