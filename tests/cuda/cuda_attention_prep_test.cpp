// Backend::attention_prep on the GPU: the fused kernel (one launch) against the op sequence it replaces
// (Backend's default: copy_rows, rms_norm, rope_neox, scatter_rows, run on the GPU too), bit for bit,
// and against the CPU within the norm / rope bound. Shapes: the 27B target's gated attention (24 query
// heads of 256 with a q | gate split, 4 KV heads, rope over 64 of the 256 dims), the 27B drafter's
// (32 / 8 heads of 128, full rope), keys only (a drafter context append), and a row whose cache slot
// is outside the cache (skipped by both, like scatter_rows).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "cuda_test_util.h"
#include "ops/cuda/cuda_backend.h"

namespace dflash::cudatest {
namespace {

struct PrepCase {
  const char* name;
  int64_t M, H, Hkv, hd, n_rot;
  bool gated;
  bool bad_slot;  // row 1's slot outside the cache
};

// The op's buffers on one backend, filled from the same host data.
struct PrepBufs {
  std::unique_ptr<Buf<float>> qg, q, gate, k, v, qn, kn, kc, vc;
  std::unique_ptr<Buf<int32_t>> pos, slot;
  Backend::AttentionPrep p;
  PrepBufs(Backend& be, const PrepCase& c, uint32_t seed) {
    std::mt19937 rng(seed);
    const int64_t rows = 40, kvw = c.Hkv * c.hd;
    const int64_t qgw = c.H * c.hd * (c.gated ? 2 : 1);
    qg = std::make_unique<Buf<float>>(be, randn_vec(rng, std::max<int64_t>(c.M * qgw, 1)));
    q = std::make_unique<Buf<float>>(be, std::max<int64_t>(c.M * c.H * c.hd, 1));
    gate = std::make_unique<Buf<float>>(be, std::max<int64_t>(c.M * c.H * c.hd, 1));
    k = std::make_unique<Buf<float>>(be, randn_vec(rng, c.M * kvw));
    v = std::make_unique<Buf<float>>(be, randn_vec(rng, c.M * kvw));
    qn = std::make_unique<Buf<float>>(be, randn_vec(rng, c.hd, 0.3f));
    kn = std::make_unique<Buf<float>>(be, randn_vec(rng, c.hd, 0.3f));
    kc = std::make_unique<Buf<float>>(be, randn_vec(rng, rows * kvw));
    vc = std::make_unique<Buf<float>>(be, randn_vec(rng, rows * kvw));
    std::vector<int32_t> ps(c.M), sl(c.M);
    for (int64_t m = 0; m < c.M; ++m) {
      ps[m] = static_cast<int32_t>(1000 + 37 * m);  // positions far from the slots: rope angles vary
      sl[m] = static_cast<int32_t>((7 * m + 3) % rows);
    }
    if (c.bad_slot && c.M > 1) sl[1] = static_cast<int32_t>(rows + 5);
    pos = std::make_unique<Buf<int32_t>>(be, ps);
    slot = std::make_unique<Buf<int32_t>>(be, sl);
    if (c.H > 0) {
      p.qg = c.gated ? static_cast<const float*>(*qg) : static_cast<const float*>(*q);
      p.q = *q;
      p.gate = c.gated ? static_cast<float*>(*gate) : nullptr;
      p.q_norm = *qn;
      if (!c.gated) q->set(qg->get());  // ungated: the queries are q itself (in place)
    }
    p.k = *k;
    p.v = *v;
    p.k_norm = *kn;
    p.pos = *pos;
    p.slot = *slot;
    p.k_cache = *kc;
    p.v_cache = *vc;
    p.cache_rows = rows;
    p.M = c.M;
    p.n_head = c.H;
    p.n_head_kv = c.Hkv;
    p.head_dim = c.hd;
    p.n_rot = c.n_rot;
    p.theta = 1e7f;
    p.eps = 1e-6f;
  }
  std::vector<std::vector<float>> outputs(const PrepCase& c) const {
    std::vector<std::vector<float>> o = {k->get(), kc->get(), vc->get()};
    if (c.H > 0) o.push_back(q->get());
    if (c.gated) o.push_back(gate->get());
    return o;
  }
};

TEST(CudaAttentionPrep, FusedEqualsTheOpSequence) {
  REQUIRE_GPU();
  const PrepCase cases[] = {
      {"27B target, gated, 1 row", 1, 24, 4, 256, 64, true, false},
      {"27B target, gated, 8 rows", 8, 24, 4, 256, 64, true, false},
      {"27B drafter block", 8, 32, 8, 128, 128, false, false},
      {"keys only (context append)", 5, 0, 8, 128, 128, false, false},
      {"slot outside the cache", 3, 4, 2, 64, 32, true, true},
  };
  const char* names[] = {"k", "k_cache", "v_cache", "q", "gate"};
  uint32_t seed = 1200;
  for (const PrepCase& c : cases) {
    PrepBufs fused(gpu(), c, seed), seq(gpu(), c, seed), ref(cpu(), c, seed);
    ++seed;
    gpu().attention_prep(fused.p);
    gpu().Backend::attention_prep(seq.p);  // the op sequence, on the GPU
    if (!c.bad_slot) cpu().attention_prep(ref.p);  // the CPU rejects a slot outside the cache
    const auto a = fused.outputs(c), b = seq.outputs(c);
    for (size_t i = 0; i < a.size(); ++i) {
      const std::string op = fmt::format("attention_prep {} fused == sequence", names[i]);
      check(op, c.name, a[i], b[i], 0, true);
      if (!c.bad_slot) check(fmt::format("attention_prep {} vs CPU", names[i]), c.name, a[i], ref.outputs(c)[i], 1e-11);
    }
  }
}

// Backend::gdn_split_qkv (prefill's q | k | v split and l2 norms) on the GPU: the fused kernel against
// the op sequence on the GPU bit for bit, and against the CPU within the norm bound. Shapes: the 27B
// target's GDN (16 K heads of 128, 48 V heads of 128) at a prefill chunk's and a tail's rows, and a
// small odd one (3 heads of 64, v 320 wide).
TEST(CudaGdnSplit, FusedEqualsTheOpSequence) {
  REQUIRE_GPU();
  struct C {
    int64_t M, Hk, Hv, dk, dv;
  };
  const C cases[] = {{512, 16, 48, 128, 128}, {37, 16, 48, 128, 128}, {33, 3, 5, 64, 64}};
  uint32_t seed = 1300;
  for (const C& c : cases) {
    const GdnShape sh{c.Hk, c.Hv, c.dk, c.dv};
    const int64_t qw = c.Hk * c.dk, vw = c.Hv * c.dv, C = 2 * qw + vw;
    std::mt19937 rng(seed++);
    const auto conv = randn_vec(rng, c.M * C);
    Buf<float> in_g(gpu(), conv), in_c(cpu(), conv);
    Buf<float> qf(gpu(), c.M * qw), kf(gpu(), c.M * qw), vf(gpu(), c.M * vw);
    Buf<float> qs(gpu(), c.M * qw), ks(gpu(), c.M * qw), vs(gpu(), c.M * vw);
    Buf<float> qc(cpu(), c.M * qw), kc(cpu(), c.M * qw), vc(cpu(), c.M * vw);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.dk));
    gpu().gdn_split_qkv(in_g, qf, kf, vf, c.M, sh, 1e-6f, scale);
    gpu().Backend::gdn_split_qkv(in_g, qs, ks, vs, c.M, sh, 1e-6f, scale);  // the op sequence, on the GPU
    cpu().gdn_split_qkv(in_c, qc, kc, vc, c.M, sh, 1e-6f, scale);
    const std::string shp = shape_str({c.M, c.Hk, c.Hv, c.dk, c.dv});
    const Buf<float>* fused[] = {&qf, &kf, &vf};
    const Buf<float>* seq[] = {&qs, &ks, &vs};
    const Buf<float>* ref[] = {&qc, &kc, &vc};
    const char* names[] = {"q", "k", "v"};
    for (int i = 0; i < 3; ++i) {
      check(fmt::format("gdn_split_qkv {} fused == sequence", names[i]), shp, fused[i]->get(), seq[i]->get(), 0,
            fused[i]->guard_ok());
      check(fmt::format("gdn_split_qkv {} vs CPU", names[i]), shp, fused[i]->get(), ref[i]->get(), 1e-11);
    }
  }
}

}  // namespace
}  // namespace dflash::cudatest
