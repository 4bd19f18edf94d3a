// DFlash drafter tests: the conv op and the selector against direct computations, the whole drafter
// forward against a naive host implementation of SPEC 4.2, the context window (masking, eviction,
// sink/window), loading and fit errors, the synthetic 27B layout.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "spec/spec_fixture.h"
#include "util/error.h"

namespace dflash {
namespace {

using namespace spec_test;

std::vector<float> randn(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// ---------------------------------------------------------------------------------------------
// dflash_conv

TEST(DflashConv, MatchesDirectComputation) {
  auto be = make_cpu_backend(2);
  for (int64_t K : {1, 2, 3}) {
    for (bool with_res : {false, true}) {
      const int64_t M = 8, C = 48, group = 16, G = C / group, stride = 2 * K * G + 3;
      const auto x = randn(M * C, 1 + K), base = randn(2 * K * C, 2 + K), d = randn(M * stride, 3 + K);
      const auto res = randn(M * C, 4 + K);
      std::vector<float> y(M * C), y_alias = res;
      for (int s = 0; s < 2; ++s) {
        be->dflash_conv(x.data(), base.data() + s * K * C, d.data() + s * K * G, stride,
                        with_res ? res.data() : nullptr, y.data(), M, C, K, group);
        if (with_res)  // the residual may alias the output
          be->dflash_conv(x.data(), base.data() + s * K * C, d.data() + s * K * G, stride, y_alias.data(),
                          y_alias.data(), M, C, K, group);
        for (int64_t t = 0; t < M; ++t)
          for (int64_t c = 0; c < C; ++c) {
            double acc = 0;
            for (int64_t o = 0; o < K; ++o) {
              if (t - o < 0) continue;  // row 0 reads zero padding
              const double k = base[s * K * C + o * C + c] + d[t * stride + s * K * G + o * G + c / group];
              acc += k * x[(t - o) * C + c];
            }
            if (with_res) acc += res[t * C + c];
            ASSERT_NEAR(y[t * C + c], acc, 1e-5 * (1 + std::abs(acc))) << "K " << K << " s " << s << " t " << t;
            if (with_res) {
              ASSERT_EQ(y[t * C + c], y_alias[t * C + c]);
            }
          }
        if (with_res) y_alias = res;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Selector

TEST(Selector, WalkMatchesDirectComputation) {
  const int64_t rows = 7, top_k = 16, rank = 24, vocab = 200;
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 50; ++trial) {
    const auto pred = randn(vocab * rank, 100 + trial), succ = randn(vocab * rank, 200 + trial);
    const auto g = randn(rows * rank, 300 + trial), unary = randn(rows * top_k, 400 + trial, 3.0f);
    std::vector<int32_t> cand(rows * top_k);
    for (int64_t p = 0; p < rows; ++p) {
      std::vector<int32_t> ids(vocab);
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      std::copy(ids.begin(), ids.begin() + top_k, cand.begin() + p * top_k);
    }
    const int32_t anchor = static_cast<int32_t>(rng() % vocab);
    const auto path = selector_walk(anchor, rows, top_k, rank, cand.data(), unary.data(), g.data(),
                                    [&](int which, int32_t tok, float* out) {
                                      const auto& cb = which == 0 ? pred : succ;
                                      std::copy(cb.begin() + tok * rank, cb.begin() + (tok + 1) * rank, out);
                                    });
    // Direct: S[k] = U[k] + sum_r pred[prev][r] g[r] succ[cand_k][r], in double.
    int32_t prev = anchor;
    for (int64_t p = 0; p < rows; ++p) {
      std::vector<double> S(top_k);
      for (int64_t k = 0; k < top_k; ++k) {
        double e = 0;
        for (int64_t r = 0; r < rank; ++r)
          e += static_cast<double>(pred[prev * rank + r]) * g[p * rank + r] * succ[cand[p * top_k + k] * rank + r];
        S[k] = unary[p * top_k + k] + e;
      }
      const int64_t best = std::max_element(S.begin(), S.end()) - S.begin();
      ASSERT_EQ(path[p], cand[p * top_k + best]) << "trial " << trial << " row " << p;
      prev = path[p];
    }
  }
}

// The backend op (Backend::selector_walk, over gathered codebook rows) picks exactly the host
// reference's path, also when scores tie (the lowest k wins) or are NaN.
TEST(Selector, BackendWalkEqualsHostWalk) {
  auto be = make_cpu_backend(2);
  std::mt19937_64 rng(9);
  for (int trial = 0; trial < 60; ++trial) {
    const int64_t rows = 1 + trial % 8, top_k = 1 + (trial * 5) % 17, rank = 1 + (trial * 7) % 40, vocab = 64;
    auto pred = randn(vocab * rank, 500 + trial), succ = randn(vocab * rank, 600 + trial);
    const auto g = randn(rows * rank, 700 + trial);
    auto unary = randn(rows * top_k, 800 + trial, 3.0f);
    std::vector<int32_t> cand(rows * top_k);
    for (auto& c : cand) c = static_cast<int32_t>(rng() % vocab);  // repeated candidates are allowed
    if (trial % 3 == 1) {  // ties: every candidate scores the same
      std::fill(succ.begin(), succ.end(), 0.5f);
      std::fill(unary.begin(), unary.end(), 1.0f);
    }
    if (trial % 5 == 2) unary[rng() % unary.size()] = std::nanf("");
    const int32_t anchor = static_cast<int32_t>(rng() % vocab);
    const auto want = selector_walk(anchor, rows, top_k, rank, cand.data(), unary.data(), g.data(),
                                    [&](int which, int32_t tok, float* out) {
                                      const auto& cb = which == 0 ? pred : succ;
                                      std::copy(cb.begin() + tok * rank, cb.begin() + (tok + 1) * rank, out);
                                    });
    // the gathered rows, as the drafter lays them out with get_rows
    std::vector<float> pr((1 + (rows - 1) * top_k) * rank), su(rows * top_k * rank);
    std::copy(pred.begin() + anchor * rank, pred.begin() + (anchor + 1) * rank, pr.begin());
    for (int64_t i = 0; i < (rows - 1) * top_k; ++i)
      std::copy(pred.begin() + cand[i] * rank, pred.begin() + (cand[i] + 1) * rank, pr.begin() + (1 + i) * rank);
    for (int64_t i = 0; i < rows * top_k; ++i)
      std::copy(succ.begin() + cand[i] * rank, succ.begin() + (cand[i] + 1) * rank, su.begin() + i * rank);
    std::vector<int32_t> got(rows, -1);
    be->selector_walk(pr.data(), su.data(), cand.data(), unary.data(), g.data(), got.data(), rows, top_k, rank);
    ASSERT_EQ(got, want) << "trial " << trial;
    if (trial % 3 == 1) {
      for (int64_t p = 0; p < rows; ++p) EXPECT_EQ(got[p], cand[p * top_k]) << "a tie goes to the first candidate";
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The drafter forward against a naive host implementation of SPEC 4.2

// Host copies of a file's tensors, dequantized.
struct HostWeights {
  const gguf::File& f;
  std::vector<float> get(const std::string& name) const {
    const gguf::TensorInfo& t = f.tensor(name);
    std::vector<float> out(static_cast<size_t>(t.n_elements()));
    const size_t rb = row_bytes(t.type, t.ne[0]);
    const uint8_t* data = f.tensor_data(t).data();
    for (int64_t r = 0; r < t.n_rows(); ++r) dequantize_row(t.type, data + r * rb, out.data() + r * t.ne[0], t.ne[0]);
    return out;
  }
};

// y[out] = W x, W with ne = [in, out] (row o holds `in` elements).
std::vector<double> matvec(const std::vector<float>& W, const std::vector<double>& x, int64_t in, int64_t out) {
  std::vector<double> y(out);
  for (int64_t o = 0; o < out; ++o) {
    double acc = 0;
    for (int64_t i = 0; i < in; ++i) acc += static_cast<double>(W[o * in + i]) * x[i];
    y[o] = acc;
  }
  return y;
}

void rmsnorm(std::vector<double>& x, size_t off, int64_t n, const std::vector<float>& w, double eps) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += x[off + i] * x[off + i];
  const double r = 1.0 / std::sqrt(ss / n + eps);
  for (int64_t i = 0; i < n; ++i) x[off + i] = x[off + i] * r * w[i];
}

void rope(std::vector<double>& x, size_t off, int64_t n_rot, double theta, int64_t pos) {
  const int64_t half = n_rot / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double a = pos * std::pow(theta, -2.0 * i / n_rot);
    const double x0 = x[off + i], x1 = x[off + i + half];
    x[off + i] = x0 * std::cos(a) - x1 * std::sin(a);
    x[off + i + half] = x1 * std::cos(a) + x0 * std::sin(a);
  }
}

struct NaiveDrafter {
  const DrafterConfig& c;
  HostWeights dw, tw;
  std::vector<std::vector<double>> ctx;  // c_j for every position j

  void append(const std::vector<float>& taps, int64_t rows) {
    const int64_t E = c.n_embd, W = c.n_taps() * E;
    const auto fc = dw.get("fc.weight"), nw = dw.get("enc.output_norm.weight");
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<double> t(taps.begin() + r * W, taps.begin() + (r + 1) * W);
      auto cj = matvec(fc, t, W, E);
      rmsnorm(cj, 0, E, nw, c.rms_eps);
      ctx.push_back(cj);
    }
  }

  // Hidden states [B, E] after output_norm for the block at P = ctx.size().
  std::vector<double> forward(int32_t anchor) {
    const int64_t B = c.block_size, E = c.n_embd, hd = c.head_dim, H = c.n_head, Hkv = c.n_head_kv;
    const int64_t P = static_cast<int64_t>(ctx.size()), K = c.conv_kernel, G = c.conv_groups();
    const auto embd = tw.get("token_embd.weight");
    std::vector<std::vector<double>> x(B, std::vector<double>(E));
    for (int64_t i = 0; i < B; ++i) {
      const int32_t tok = i == 0 ? anchor : c.mask_token;
      for (int64_t e = 0; e < E; ++e) x[i][e] = embd[tok * E + e];
    }
    // Conv(y)[t][c] = sum_o (base[s][o][c] + d[t][s][o][c/group]) y[t-o][c]
    auto conv = [&](const std::vector<std::vector<double>>& y, const std::vector<float>& base,
                    const std::vector<std::vector<double>>& d, int s) {
      std::vector<std::vector<double>> out(B, std::vector<double>(E, 0.0));
      for (int64_t t = 0; t < B; ++t)
        for (int64_t ch = 0; ch < E; ++ch)
          for (int64_t o = 0; o < K && o <= t; ++o)
            out[t][ch] += (base[s * K * E + o * E + ch] + d[t][s * K * G + o * G + ch / c.conv_group]) * y[t - o][ch];
      return out;
    };
    for (int64_t l = 0; l < c.n_layer; ++l) {
      const std::string b = "blk." + std::to_string(l) + ".";
      const auto wq = dw.get(b + "attn_q.weight"), wk = dw.get(b + "attn_k.weight"), wv = dw.get(b + "attn_v.weight");
      const auto wo = dw.get(b + "attn_output.weight"), qn = dw.get(b + "attn_q_norm.weight"),
                 kn = dw.get(b + "attn_k_norm.weight");
      // context keys/values of this layer
      std::vector<std::vector<double>> kc(P), vc(P);
      for (int64_t j = 0; j < P; ++j) {
        kc[j] = matvec(wk, ctx[j], E, Hkv * hd);
        for (int64_t h = 0; h < Hkv; ++h) {
          rmsnorm(kc[j], h * hd, hd, kn, c.rms_eps);
          rope(kc[j], h * hd, c.n_rot, c.rope_theta, j);
        }
        vc[j] = matvec(wv, ctx[j], E, Hkv * hd);
      }
      std::vector<std::vector<double>> n(B), u;
      for (int64_t i = 0; i < B; ++i) {
        n[i] = x[i];
        rmsnorm(n[i], 0, E, dw.get(b + "attn_norm.weight"), c.rms_eps);
      }
      std::vector<std::vector<double>> d(B);
      std::vector<float> base;
      if (K > 0) {
        const auto proj = dw.get(b + "attn_conv_proj.weight");
        base = dw.get(b + "attn_conv_base");
        for (int64_t i = 0; i < B; ++i) d[i] = matvec(proj, n[i], E, c.conv_proj_out());
        u = conv(n, base, d, 0);
      } else {
        u = n;
      }
      std::vector<std::vector<double>> q(B), k(B), v(B);
      for (int64_t i = 0; i < B; ++i) {
        q[i] = matvec(wq, u[i], E, H * hd);
        k[i] = matvec(wk, u[i], E, Hkv * hd);
        v[i] = matvec(wv, u[i], E, Hkv * hd);
        for (int64_t h = 0; h < H; ++h) {
          rmsnorm(q[i], h * hd, hd, qn, c.rms_eps);
          rope(q[i], h * hd, c.n_rot, c.rope_theta, P + i);
        }
        for (int64_t h = 0; h < Hkv; ++h) {
          rmsnorm(k[i], h * hd, hd, kn, c.rms_eps);
          rope(k[i], h * hd, c.n_rot, c.rope_theta, P + i);
        }
      }
      std::vector<std::vector<double>> o(B);
      for (int64_t i = 0; i < B; ++i) {
        std::vector<double> att(H * hd, 0.0);
        for (int64_t h = 0; h < H; ++h) {
          const int64_t kvh = h / (H / Hkv);
          std::vector<double> sc;
          std::vector<const std::vector<double>*> vs;
          auto key = [&](const std::vector<double>& kk, const std::vector<double>& vv) {
            double s = 0;
            for (int64_t e = 0; e < hd; ++e) s += q[i][h * hd + e] * kk[kvh * hd + e];
            sc.push_back(s / std::sqrt(static_cast<double>(hd)));
            vs.push_back(&vv);
          };
          for (int64_t j = 0; j < P; ++j)
            if (c.sliding_window == 0 || (P + i) - j < c.sliding_window) key(kc[j], vc[j]);
          for (int64_t j = 0; j < B; ++j)
            if (!c.causal || j <= i) key(k[j], v[j]);
          const double mx = *std::max_element(sc.begin(), sc.end());
          double sum = 0;
          for (double& s : sc) sum += (s = std::exp(s - mx));
          for (size_t j = 0; j < sc.size(); ++j)
            for (int64_t e = 0; e < hd; ++e) att[h * hd + e] += sc[j] / sum * (*vs[j])[kvh * hd + e];
        }
        o[i] = matvec(wo, att, H * hd, E);
      }
      if (K > 0) o = conv(o, base, d, 1);
      for (int64_t i = 0; i < B; ++i)
        for (int64_t e = 0; e < E; ++e) x[i][e] += o[i][e];
      // MLP
      for (int64_t i = 0; i < B; ++i) {
        n[i] = x[i];
        rmsnorm(n[i], 0, E, dw.get(b + "ffn_norm.weight"), c.rms_eps);
      }
      if (K > 0) {
        const auto proj = dw.get(b + "ffn_conv_proj.weight");
        base = dw.get(b + "ffn_conv_base");
        for (int64_t i = 0; i < B; ++i) d[i] = matvec(proj, n[i], E, c.conv_proj_out());
        u = conv(n, base, d, 0);
      } else {
        u = n;
      }
      const auto wg = dw.get(b + "ffn_gate.weight"), wu = dw.get(b + "ffn_up.weight"),
                 wd = dw.get(b + "ffn_down.weight");
      for (int64_t i = 0; i < B; ++i) {
        auto gt = matvec(wg, u[i], E, c.n_ff), up = matvec(wu, u[i], E, c.n_ff);
        for (int64_t f = 0; f < c.n_ff; ++f) gt[f] = gt[f] / (1 + std::exp(-gt[f])) * up[f];
        o[i] = matvec(wd, gt, c.n_ff, E);
      }
      if (K > 0) o = conv(o, base, d, 1);
      for (int64_t i = 0; i < B; ++i)
        for (int64_t e = 0; e < E; ++e) x[i][e] += o[i][e];
    }
    std::vector<double> h(B * E);
    const auto on = dw.get("output_norm.weight");
    for (int64_t i = 0; i < B; ++i) {
      rmsnorm(x[i], 0, E, on, c.rms_eps);
      std::copy(x[i].begin(), x[i].end(), h.begin() + i * E);
    }
    return h;
  }
};

struct ForwardCase {
  bool dflash2;
  bool causal;
  int64_t window;
  GgmlType type;
};

class DrafterForwardTest : public ::testing::TestWithParam<ForwardCase> {};

TEST_P(DrafterForwardTest, MatchesNaiveReference) {
  const ForwardCase fc = GetParam();
  const SynthTargetSpec ts = tiny_target();
  SynthDrafterSpec ds = tiny_drafter(ts, fc.dflash2);
  ds.causal = fc.causal;
  ds.sliding_window = fc.window;
  ds.matmul_type = ds.codebook_type = ds.heavy_type = fc.type;
  const std::string tp = temp_path("fwd_target.gguf"), dp = temp_path("fwd_drafter.gguf");
  synth_target(ts, tp);
  synth_drafter(ds, dp);
  Pair p = load_pair(tp, dp, 8);
  p.drafter->set_keep_trace(true);
  const DrafterConfig& c = p.drafter->config();
  NaiveDrafter ref{c, HostWeights{*p.drafter_file}, HostWeights{*p.target_file}, {}};
  const int64_t W = c.n_taps() * c.n_embd;

  // Append context in uneven batches, draft after each.
  int64_t appended = 0;
  uint64_t seed = 50;
  for (int64_t batch : {5, 1, 3, 7, 2}) {
    const auto taps = randn(batch * W, seed++);
    p.drafter->append_context(taps, batch);
    ref.append(taps, batch);
    appended += batch;
    ASSERT_EQ(p.drafter->context_end(), appended);
    const int32_t anchor = static_cast<int32_t>(seed * 7 % ts.n_vocab);
    const std::vector<int32_t> tokens = p.drafter->draft(anchor);
    {  // the device-resident block of the same draft: [anchor, tokens...]
      const int32_t* blk = p.drafter->draft_device(anchor);
      std::vector<int32_t> block(static_cast<size_t>(c.block_size));
      p.target->backend().download(block.data(), blk, sizeof(int32_t) * block.size());
      ASSERT_EQ(block[0], anchor);
      ASSERT_EQ(std::vector<int32_t>(block.begin() + 1, block.end()), tokens);
    }
    const auto h = ref.forward(anchor);
    const DraftTrace& tr = p.drafter->last_trace();
    ASSERT_EQ(tr.hidden.size(), h.size());
    ASSERT_EQ(tr.position, appended);
    const double tol = fc.type == GgmlType::F32 ? 2e-4 : 2e-3;
    for (size_t i = 0; i < h.size(); ++i)
      ASSERT_NEAR(tr.hidden[i], h[i], tol * (1 + std::abs(h[i]))) << "element " << i << " after " << appended;

    // logits = target lm_head(h rows 1..B-1); drafts: argmax (v1) or the selector walk over top-k.
    const int64_t V = ts.n_vocab, B = c.block_size, E = c.n_embd;
    const auto out_w = HostWeights{*p.target_file}.get("output.weight");
    for (int64_t r = 0; r < B - 1; ++r) {
      std::vector<double> hr(tr.hidden.begin() + (r + 1) * E, tr.hidden.begin() + (r + 2) * E);
      const auto lg = matvec(out_w, hr, E, V);
      for (int64_t v = 0; v < V; ++v) ASSERT_NEAR(tr.logits[r * V + v], lg[v], 1e-4 * (1 + std::abs(lg[v])));
    }
    ASSERT_EQ(static_cast<int64_t>(tokens.size()), B - 1);
    if (!c.dflash2()) {
      for (int64_t r = 0; r < B - 1; ++r) {
        const float* row = tr.logits.data() + r * V;
        EXPECT_EQ(tokens[r], std::max_element(row, row + V) - row);
      }
      continue;
    }
    const int64_t k = c.selector_top_k, R = c.selector_rank;
    const auto sel = HostWeights{*p.drafter_file}.get("selector_hidden.weight");
    const auto pred = HostWeights{*p.drafter_file}.get("selector_predecessor.weight");
    const auto succ = HostWeights{*p.drafter_file}.get("selector_successor.weight");
    int32_t prev = anchor;
    for (int64_t r = 0; r < B - 1; ++r) {
      // candidates: the top-k of the row's logits, descending
      std::vector<int32_t> order(V);
      std::iota(order.begin(), order.end(), 0);
      const float* row = tr.logits.data() + r * V;
      std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });
      for (int64_t j = 0; j < k; ++j) {
        ASSERT_EQ(tr.candidates[r * k + j], order[j]);
        ASSERT_EQ(tr.candidate_logits[r * k + j], row[order[j]]);
      }
      std::vector<double> hr(tr.hidden.begin() + (r + 1) * E, tr.hidden.begin() + (r + 2) * E);
      const auto g = matvec(sel, hr, E, R);
      for (int64_t j = 0; j < R; ++j) ASSERT_NEAR(tr.selector_hidden[r * R + j], g[j], 1e-4 * (1 + std::abs(g[j])));
      std::vector<double> S(k);
      for (int64_t j = 0; j < k; ++j) {
        double e = 0;
        for (int64_t q = 0; q < R; ++q) e += double(pred[prev * R + q]) * g[q] * succ[tr.candidates[r * k + j] * R + q];
        S[j] = row[tr.candidates[r * k + j]] + e;
      }
      prev = tr.candidates[r * k + (std::max_element(S.begin(), S.end()) - S.begin())];
      EXPECT_EQ(tokens[r], prev) << "row " << r;
      prev = tokens[r];  // follow the drafter's path (a near-tie must not cascade)
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, DrafterForwardTest,
                         ::testing::Values(ForwardCase{true, false, 2048, GgmlType::F32},
                                           ForwardCase{true, false, 6, GgmlType::F32},
                                           ForwardCase{true, true, 4, GgmlType::F32},
                                           ForwardCase{false, false, 0, GgmlType::F32},
                                           ForwardCase{true, false, 9, GgmlType::Q8_0}),
                         [](const ::testing::TestParamInfo<ForwardCase>& i) {
                           const ForwardCase& c = i.param;
                           return std::string(c.dflash2 ? "dflash2" : "dflash1") + (c.causal ? "_causal" : "") +
                                  "_window" + std::to_string(c.window) + "_" + type_name(c.type);
                         });

// ---------------------------------------------------------------------------------------------
// Context window

struct WindowPair {
  std::string tp, dp;
  WindowPair(int64_t window, const std::string& tag) {
    const SynthTargetSpec ts = tiny_target();
    SynthDrafterSpec ds = tiny_drafter(ts);
    ds.sliding_window = window;
    tp = temp_path("win_target_" + tag + ".gguf");
    dp = temp_path("win_drafter_" + tag + ".gguf");
    synth_target(ts, tp);
    synth_drafter(ds, dp);
  }
};

TEST(DrafterContext, KeyRangesFollowTheSlidingWindow) {
  const int64_t W = 6;
  WindowPair files(W, "ranges");
  Pair p = load_pair(files.tp, files.dp, 8);
  const int64_t width = p.drafter->config().n_taps() * p.drafter->config().n_embd, B = 8;
  for (int64_t P = 0; P < 30; ++P) {
    const auto pos = p.drafter->context_positions();
    ASSERT_EQ(p.drafter->context_end(), P);
    for (int64_t i = 0; i < B; ++i) {
      const auto [lo, hi] = p.drafter->key_range(P, i);
      const int64_t C = p.drafter->context_rows();
      ASSERT_EQ(hi, C + B);  // non-causal: every block row
      for (int64_t j = 0; j < C; ++j) {
        const bool visible = (P + i) - pos[j] < W;
        ASSERT_EQ(visible, j >= lo) << "P " << P << " row " << i << " key " << j << " at " << pos[j];
      }
    }
    p.drafter->append_context(randn(width, 900 + P), 1);
  }
}

// Dropping invisible rows (at any schedule) gives the same bits as keeping them.
TEST(DrafterContext, EvictionKeepsTheVisibleRowsBitExact) {
  const int64_t W = 6;
  WindowPair files(W, "evict");
  DrafterOptions often, never;
  often.append_chunk = 2;
  often.context_slack = 3;
  never.append_chunk = 64;
  never.context_slack = 4096;
  Pair a = load_pair(files.tp, files.dp, 8, 512, often);
  Pair b = load_pair(files.tp, files.dp, 8, 512, never);
  a.drafter->set_keep_trace(true);
  b.drafter->set_keep_trace(true);
  const int64_t width = a.drafter->config().n_taps() * a.drafter->config().n_embd;
  std::mt19937_64 rng(17);
  int64_t end = 0;
  for (int step = 0; step < 40; ++step) {
    const int64_t rows = step == 20 ? 40 : 1 + static_cast<int64_t>(rng() % 9);  // one batch longer than the window
    const auto taps = randn(rows * width, 2000 + step);
    a.drafter->append_context(taps, rows);
    b.drafter->append_context(taps, rows);
    end += rows;
    ASSERT_EQ(a.drafter->context_end(), end);
    ASSERT_LE(a.drafter->context_rows(), W - 1 + 3);
    const auto& pos = a.drafter->context_positions();
    ASSERT_TRUE(std::is_sorted(pos.begin(), pos.end()));
    ASSERT_GE(a.drafter->context_rows(), std::min<int64_t>(end, W - 1));
    ASSERT_EQ(pos.back(), end - 1);
    const int32_t anchor = static_cast<int32_t>(rng() % 96);
    EXPECT_EQ(a.drafter->draft(anchor), b.drafter->draft(anchor)) << "step " << step;
    const auto& ha = a.drafter->last_trace().hidden;
    const auto& hb = b.drafter->last_trace().hidden;
    ASSERT_EQ(0, std::memcmp(ha.data(), hb.data(), ha.size() * sizeof(float))) << "step " << step;
  }
}

TEST(DrafterContext, SinkWindowKeepsSinkAndRecentRows) {
  WindowPair files(2048, "sink");
  DrafterOptions o;
  o.context = DrafterContextMode::kSinkWindow;
  o.sink = 2;
  o.window = 4;
  o.append_chunk = 3;
  Pair p = load_pair(files.tp, files.dp, 8, 512, o);
  const int64_t width = p.drafter->config().n_taps() * p.drafter->config().n_embd;
  for (int i = 0; i < 7; ++i) p.drafter->append_context(randn(3 * width, 70 + i), 3);
  EXPECT_EQ(p.drafter->context_end(), 21);
  EXPECT_EQ(p.drafter->context_positions(), (std::vector<int64_t>{0, 1, 17, 18, 19, 20}));
  p.drafter->draft(5);  // runs over the kept rows
  // Like the seed, a batch longer than sink + window keeps only its last sink + window rows.
  p.drafter->reset_context();
  p.drafter->append_context(randn(10 * width, 99), 10);
  EXPECT_EQ(p.drafter->context_positions(), (std::vector<int64_t>{4, 5, 6, 7, 8, 9}));
}

// The engine feeds a prompt's taps to a device-resident drafter chunk by chunk (only the rows the
// context can keep, skipping the rest), and to a host drafter in one append. Both must leave the same
// context: the same drafts, hence the same acceptance per cycle, for long prompts in every context
// mode (reference with a sliding window, sink + window, unbounded), also across turns.
class HostOnlyDrafter final : public Drafter {  // the same drafter, through the host path
 public:
  explicit HostOnlyDrafter(Drafter& d) : d_(d) {}
  int64_t block_size() const override { return d_.block_size(); }
  int64_t context_end() const override { return d_.context_end(); }
  void reset_context() override { d_.reset_context(); }
  void append_context(std::span<const float> taps, int64_t rows) override { d_.append_context(taps, rows); }
  std::vector<int32_t> draft(int32_t anchor) override { return d_.draft(anchor); }

 private:
  Drafter& d_;
};

TEST(DrafterContext, ChunkedPromptAppendsEqualOneAppend) {
  struct Mode {
    int64_t window;
    bool sink;
  };
  for (const Mode md : {Mode{16, false}, Mode{16, true}, Mode{0, false}}) {
    WindowPair files(md.window, md.sink ? "chunked_sink" : "chunked_" + std::to_string(md.window));
    DrafterOptions o;
    if (md.sink) {
      o.context = DrafterContextMode::kSinkWindow;
      o.sink = 3;
      o.window = 9;
    }
    Pair dev = load_pair(files.tp, files.dp, 8, 512, o), host = load_pair(files.tp, files.dp, 8, 512, o);
    ASSERT_LT(dev.target->max_rows(), 40);  // prompts go in several chunks
    ASSERT_TRUE(dev.drafter->drafts_on_device());
    HostOnlyDrafter host_path(*host.drafter);
    Engine a(*dev.target, dev.drafter.get()), b(*host.target, &host_path);
    std::vector<int32_t> prompt = random_tokens(150, 17, 96);
    for (int turn = 0; turn < 3; ++turn) {
      GenerateOptions g;
      g.max_tokens = 20;
      GenerateStats sa, sb;
      const auto out_a = run(a, prompt, g, &sa), out_b = run(b, prompt, g, &sb);
      ASSERT_EQ(out_a, out_b);
      EXPECT_EQ(sa.accepted_per_cycle, sb.accepted_per_cycle) << "window " << md.window << " sink " << md.sink
                                                              << " turn " << turn;
      EXPECT_EQ(dev.drafter->context_positions(), host.drafter->context_positions()) << "turn " << turn;
      EXPECT_EQ(dev.drafter->draft(7), host.drafter->draft(7)) << "turn " << turn;
      prompt.insert(prompt.end(), out_a.begin(), out_a.end());
      const auto more = random_tokens(40 + 13 * turn, 50 + turn, 96);  // the next turn's new text
      prompt.insert(prompt.end(), more.begin(), more.end());
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Loading

TEST(DrafterLoad, ConfigRoundTrip) {
  const SynthTargetSpec ts = tiny_target();
  for (bool v2 : {true, false}) {
    SynthDrafterSpec ds = tiny_drafter(ts, v2);
    const std::string dp = temp_path(v2 ? "rt2.gguf" : "rt1.gguf");
    synth_drafter(ds, dp);
    const gguf::File f = gguf::File::open(dp);
    const DrafterConfig c = read_drafter_config(f);
    EXPECT_EQ(c.n_layer, ds.n_layer);
    EXPECT_EQ(c.n_embd, ds.n_embd);
    EXPECT_EQ(c.target_layers, ds.target_layers);
    EXPECT_EQ(c.block_size, 8);
    EXPECT_EQ(c.mask_token, ds.mask_token);
    EXPECT_EQ(c.dflash2(), v2);
    EXPECT_EQ(c.conv_kernel, v2 ? 2 : 0);
    EXPECT_EQ(c.n_vocab, ts.n_vocab);
    EXPECT_EQ(c.sliding_window, 2048);
    EXPECT_FLOAT_EQ(c.rope_theta, 1e7f);
  }
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(DrafterLoad, FitErrorsNameWhatMismatched) {
  TargetConfig t;
  t.arch = "qwen35";
  t.n_layer = 4;
  t.n_embd = 64;
  t.n_vocab = 96;
  DrafterConfig d;
  d.n_embd = 64;
  d.n_vocab = 96;
  d.target_layers = {1, 2, 3};
  d.mask_token = 95;
  EXPECT_EQ(error_of([&] { check_drafter_fits_target(d, "d.gguf", t, "t.gguf"); }), "");
  auto bad = d;
  bad.n_embd = 128;
  EXPECT_NE(error_of([&] { check_drafter_fits_target(bad, "d.gguf", t, "t.gguf"); }).find("hidden size 128"),
            std::string::npos);
  bad = d;
  bad.n_vocab = 100;
  EXPECT_NE(error_of([&] { check_drafter_fits_target(bad, "d.gguf", t, "t.gguf"); }).find("vocabulary"),
            std::string::npos);
  bad = d;
  bad.target_layers = {1, 4};
  const std::string taps = error_of([&] { check_drafter_fits_target(bad, "d.gguf", t, "t.gguf"); });
  EXPECT_NE(taps.find("tap id 4"), std::string::npos) << taps;
  EXPECT_NE(taps.find("target_layers[1]"), std::string::npos) << taps;
  bad = d;
  bad.mask_token = 96;
  EXPECT_NE(error_of([&] { check_drafter_fits_target(bad, "d.gguf", t, "t.gguf"); }).find("mask token 96"),
            std::string::npos);
}

TEST(DrafterLoad, RealFilesThatDoNotFit) {
  const SynthTargetSpec ts = tiny_target();
  const std::string tp = temp_path("fit_target.gguf");
  synth_target(ts, tp);
  auto be = make_cpu_backend(1);
  const gguf::File tf = gguf::File::open(tp);
  // hidden size
  {
    SynthDrafterSpec ds = tiny_drafter(ts);
    ds.n_embd = 128;
    const std::string dp = temp_path("fit_hidden.gguf");
    synth_drafter(ds, dp);
    const gguf::File df = gguf::File::open(dp);
    TargetOptions to;
    to.tap_layers = ds.target_layers;
    auto target = TargetModel::load(tf, *be, to);
    const std::string e = error_of([&] { DFlashDrafter::load(df, *target); });
    EXPECT_NE(e.find("hidden size 128"), std::string::npos) << e;
    EXPECT_NE(e.find("fit_hidden.gguf"), std::string::npos) << e;
  }
  // a target loaded without the drafter's taps
  {
    const SynthDrafterSpec ds = tiny_drafter(ts);
    const std::string dp = temp_path("fit_taps.gguf");
    synth_drafter(ds, dp);
    const gguf::File df = gguf::File::open(dp);
    auto target = TargetModel::load(tf, *be, TargetOptions{});
    const std::string e = error_of([&] { DFlashDrafter::load(df, *target); });
    EXPECT_NE(e.find("tap layers"), std::string::npos) << e;
  }
  // a target is not a drafter
  {
    const std::string e = error_of([&] { read_drafter_config(tf); });
    EXPECT_NE(e.find("'dflash'"), std::string::npos) << e;
  }
}

TEST(DrafterLoad, MissingConvTensorIsNamed) {
  // A DFlash 2 header over v1 tensors: write a v1 file, then claim a conv in the metadata.
  const SynthTargetSpec ts = tiny_target();
  SynthDrafterSpec v1 = tiny_drafter(ts, false);
  const std::string p1 = temp_path("v1.gguf");
  synth_drafter(v1, p1);
  const gguf::File f1 = gguf::File::open(p1);
  gguf::Writer w;
  for (const auto& kv : f1.metadata()) w.set(kv.key, kv.value);
  w.set("dflash.conv_kernel_size", gguf::Value::u32(2));
  w.set("dflash.conv_group_size", gguf::Value::u32(16));
  for (const auto& t : f1.tensors()) {
    std::vector<int64_t> ne(t.ne, t.ne + t.n_dims);
    const auto data = f1.tensor_data(t);
    w.add_tensor(t.name, t.type, ne, data);
  }
  const std::string p2 = temp_path("v1_conv.gguf");
  w.write(p2);
  const std::string tp = temp_path("miss_target.gguf");
  synth_target(ts, tp);
  auto be = make_cpu_backend(1);
  const gguf::File tf = gguf::File::open(tp), df = gguf::File::open(p2);
  TargetOptions to;
  to.tap_layers = v1.target_layers;
  auto target = TargetModel::load(tf, *be, to);
  const std::string e = error_of([&] { DFlashDrafter::load(df, *target); });
  EXPECT_NE(e.find("blk.0.attn_conv_base"), std::string::npos) << e;
}

// ---------------------------------------------------------------------------------------------
// The synthetic 27B drafter layout (SPEC 4.1), checked on the plan (the file is 1.1 GB)

TEST(SynthDrafter, Qwen38Layout) {
  const auto tensors = synth_drafter_tensors(SynthDrafterSpec::qwen38_27b());
  ASSERT_EQ(tensors.size(), 81u);
  int q4 = 0, q6 = 0, f32 = 0;
  uint64_t bytes = 0;
  for (const auto& t : tensors) {
    q4 += t.type == GgmlType::Q4_K;
    q6 += t.type == GgmlType::Q6_K;
    f32 += t.type == GgmlType::F32;
    int64_t rows = 1;
    for (size_t i = 1; i < t.ne.size(); ++i) rows *= t.ne[i];
    bytes += row_bytes(t.type, t.ne[0]) * rows;
    if (t.type == GgmlType::Q6_K) {
      EXPECT_TRUE(t.name == "blk.2.attn_v.weight" || t.name == "blk.4.attn_v.weight" ||
                  t.name == "blk.2.ffn_down.weight" || t.name == "blk.4.ffn_down.weight")
          << t.name;
    }
  }
  EXPECT_EQ(q4, 45);
  EXPECT_EQ(q6, 4);
  EXPECT_EQ(f32, 32);
  // Tensor data of the layout; the published file (1,143,006,816 bytes) adds ~10.9 MB of header
  // (its metadata carries the tokenizer's vocabulary and merges).
  EXPECT_EQ(bytes, 1132057600u);
  auto find = [&](const std::string& n) {
    return *std::find_if(tensors.begin(), tensors.end(), [&](const SynthTensor& t) { return t.name == n; });
  };
  EXPECT_EQ(find("fc.weight").ne, (std::vector<int64_t>{25600, 5120}));
  EXPECT_EQ(find("selector_predecessor.weight").ne, (std::vector<int64_t>{256, 248320}));
  EXPECT_EQ(find("blk.3.attn_conv_base").ne, (std::vector<int64_t>{5120, 2, 2}));
  EXPECT_EQ(find("blk.3.attn_conv_proj.weight").ne, (std::vector<int64_t>{5120, 1280}));
  EXPECT_EQ(find("blk.0.attn_q.weight").ne, (std::vector<int64_t>{5120, 4096}));
  EXPECT_EQ(find("blk.4.ffn_down.weight").ne, (std::vector<int64_t>{17408, 5120}));
}

}  // namespace
}  // namespace dflash
