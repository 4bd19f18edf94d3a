// Backend::attention_gate_rotate on the GPU (the gated attention output of decode and verify): the fused
// path (the segment kernel, then one kernel that merges, gates, rotates and quantizes) against the op
// sequence it replaces (Backend's default: attention, then sigmoid_gate_rotate, run on the GPU too) bit
// for bit, against the CPU within the attention bound, M rows against M one-row calls bit for bit, and
// its records against a fresh quantization (the wo matmul after it must equal a matmul of a copy of y).
// Shapes: the 27B target's (24 query heads of 256, 4 KV heads; 6144 = 6 rotation chunks), with and
// without rotation and with y == out (no rotation, in place, as the model calls it unrotated), at
// decode (1 row, 1 .. 600 keys) and verify (8 causal rows, rows of different ranges, an empty row); head
// dim 128 (8 heads per chunk); and shapes the fused kernel does not take (head dim 64, M > 64), which must
// fall back to the sequence.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <random>

#include "cuda_test_util.h"
#include "ops/cuda/cuda_backend.h"

namespace dflash::cudatest {
namespace {

struct GateCase {
  const char* name;
  int64_t M, H, Hkv, D, n_keys;
  std::vector<int32_t> ranges;  // [M][2]
  int64_t block;                // rotation block (0: none)
  bool in_place;                // y == out (only without rotation)
  bool fused;                   // the fused kernel takes this shape
};

struct GateBufs {
  std::unique_ptr<Buf<float>> q, k, v, gate, out, y, signs;
  std::unique_ptr<Buf<int32_t>> range;
  Backend::Rotation rot;
  bool in_place;
  GateBufs(Backend& be, const GateCase& c, uint32_t seed) : in_place(c.in_place) {
    std::mt19937 rng(seed);
    const int64_t dim = c.H * c.D;
    q = std::make_unique<Buf<float>>(be, randn_vec(rng, c.M * dim));
    k = std::make_unique<Buf<float>>(be, randn_vec(rng, c.n_keys * c.Hkv * c.D));
    v = std::make_unique<Buf<float>>(be, randn_vec(rng, c.n_keys * c.Hkv * c.D));
    gate = std::make_unique<Buf<float>>(be, randn_vec(rng, c.M * dim));
    out = std::make_unique<Buf<float>>(be, c.M * dim);
    y = std::make_unique<Buf<float>>(be, c.M * dim);
    std::vector<float> sg(dim);
    for (auto& s : sg) s = (rng() & 1) ? 1.0f : -1.0f;
    signs = std::make_unique<Buf<float>>(be, sg);
    range = std::make_unique<Buf<int32_t>>(be, c.ranges);
    if (c.block > 0) rot = {*signs, nullptr, c.block, 0};
  }
  float* dst() const { return *(in_place ? out : y); }
  void run(Backend& be, const GateCase& c, bool sequence) {
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.D));
    if (sequence)
      be.Backend::attention_gate_rotate(*q, *k, *v, *range, *out, *gate, dst(), rot, c.M, c.H, c.Hkv, c.D, scale);
    else
      be.attention_gate_rotate(*q, *k, *v, *range, *out, *gate, dst(), rot, c.M, c.H, c.Hkv, c.D, scale);
  }
  // {y, out} (in place: y is out)
  std::vector<std::vector<float>> outputs() const {
    if (in_place) return {out->get()};
    return {y->get(), out->get()};
  }
};

bool segments_enabled() {
  const char* e = std::getenv("DFLASH_CUDA_ATTN_SEGMENTS");
  return e == nullptr || std::string(e) != "0";
}

std::vector<int32_t> causal(int64_t M, int32_t past) {
  std::vector<int32_t> r(2 * M, 0);
  for (int64_t m = 0; m < M; ++m) r[2 * m + 1] = past + static_cast<int32_t>(m) + 1;
  return r;
}

TEST(CudaAttentionGate, FusedEqualsTheOpSequence) {
  REQUIRE_GPU();
  const GateCase cases[] = {
      {"27B decode, 16 keys", 1, 24, 4, 256, 40, {0, 16}, 1024, false, true},
      {"27B decode, 1 key", 1, 24, 4, 256, 40, {0, 1}, 1024, false, true},
      {"27B decode, 600 keys", 1, 24, 4, 256, 620, {0, 600}, 1024, false, true},
      {"27B verify, 8 causal rows", 8, 24, 4, 256, 400, causal(8, 300), 1024, false, true},
      {"27B verify, ranges differ, an empty row", 8, 24, 4, 256, 700,
       {0, 1, 0, 0, 5, 37, 31, 33, 0, 513, 100, 700, 699, 700, 0, 640}, 1024, false, true},
      {"27B 3 rows, no rotation", 3, 24, 4, 256, 200, causal(3, 150), 0, false, true},
      {"27B 3 rows, no rotation, in place", 3, 24, 4, 256, 200, causal(3, 150), 0, true, true},
      {"head dim 128, 8 rows", 8, 32, 8, 128, 300, causal(8, 250), 1024, false, true},
      {"head dim 64 (sequence)", 2, 32, 8, 64, 100, causal(2, 60), 1024, false, false},
      {"70 rows (sequence)", 70, 8, 2, 128, 200, causal(70, 100), 1024, false, false},
  };
  uint32_t seed = 1700;
  for (const GateCase& c : cases) {
    const std::string shp = fmt::format("{} (M {}, {} x {} heads of {})", c.name, c.M, c.H, c.Hkv, c.D);
    GateBufs fused(gpu(), c, seed), seq(gpu(), c, seed), ref(cpu(), c, seed);
    const int64_t fused0 = cuda::gated_attention_launches(gpu());
    fused.run(gpu(), c, false);
    const bool ran_fused = cuda::gated_attention_launches(gpu()) == fused0 + 1;
    // (DFLASH_CUDA_ATTN_SEGMENTS=0, the generic attention kernel, leaves every shape to the sequence)
    const bool expect_fused = c.fused && segments_enabled();
    record({"attention_gate_rotate takes the fused kernel where it should", shp, 0, 0, 0, ran_fused == expect_fused,
            ran_fused ? "fused" : "op sequence"});
    EXPECT_EQ(ran_fused, expect_fused) << shp;
    seq.run(gpu(), c, true);
    ref.run(cpu(), c, false);
    const auto a = fused.outputs(), b = seq.outputs(), r = ref.outputs();
    const char* names[] = {"y", "out"};
    for (size_t i = 0; i < a.size(); ++i) {
      check(fmt::format("attention_gate_rotate {} fused == sequence", names[i]), shp, a[i], b[i], 0, true);
      check(fmt::format("attention_gate_rotate {} vs CPU", names[i]), shp, a[i], r[i], 1e-10);
    }
    // M rows == M one-row calls, bit for bit (each row alone with its own range)
    bool rows_same = true;
    const int64_t dim = c.H * c.D;
    const auto q = fused.q->get(), gate = fused.gate->get(), k = fused.k->get(), v = fused.v->get(),
               signs = fused.signs->get();
    for (int64_t m = 0; m < c.M && c.M > 1; ++m) {
      GateCase one = c;
      one.M = 1;
      one.ranges = {c.ranges[2 * m], c.ranges[2 * m + 1]};
      GateBufs o(gpu(), one, seed);
      o.q->set(std::vector<float>(q.begin() + m * dim, q.begin() + (m + 1) * dim));
      o.gate->set(std::vector<float>(gate.begin() + m * dim, gate.begin() + (m + 1) * dim));
      o.k->set(k);
      o.v->set(v);
      o.signs->set(signs);
      o.run(gpu(), one, false);
      rows_same = rows_same && std::memcmp(o.outputs()[0].data(), a[0].data() + m * dim, dim * 4) == 0;
    }
    record({"attention_gate_rotate M-row==1-row", shp, 0, 0, 0, rows_same, rows_same ? "memcmp equal" : "differs"});
    EXPECT_TRUE(rows_same) << shp;
    ++seed;
  }
}

// The fused kernel's records of y are wo's input quantization: the matmul that follows must reuse them
// and equal, bit for bit, a matmul of a fresh copy of y (which quantizes y itself).
TEST(CudaAttentionGate, RecordsFeedTheTernaryMatmul) {
  REQUIRE_GPU();
  for (int64_t M : {1, 8}) {
    const GateCase c{"27B", M, 24, 4, 256, 300, causal(M, 200), 1024, false, true};
    const std::string shp = fmt::format("27B gated attention output M={}", M);
    const HostWeight hw = make_weight(GgmlType::PTQ1_0, c.H * c.D, 320, 1800 + static_cast<uint32_t>(M));
    const WeightRef wg = gpu().upload_weight(hw.bytes.data(), hw.type, c.H * c.D, 320);
    GateBufs g(gpu(), c, 1810 + static_cast<uint32_t>(M));
    Buf<float> out_fused(gpu(), M * 320), out_fresh(gpu(), M * 320);  // before the op: uploads drop the cache
    g.run(gpu(), c, false);
    const int64_t reused0 = cuda::quantizations_reused(gpu());
    gpu().matmul(wg, *g.y, out_fused, M);
    const bool reused = cuda::quantizations_reused(gpu()) == reused0 + 1;
    Buf<float> y2(gpu(), g.y->get());
    gpu().matmul(wg, y2, out_fresh, M);
    check("attention_gate_rotate -> ternary matmul == fresh matmul", shp, out_fused.get(), out_fresh.get(), 0,
          out_fused.guard_ok());
    record({"attention_gate_rotate records reused by the matmul", shp, 0, 0, 0, reused, reused ? "reused" : "quantized again"});
    EXPECT_TRUE(reused) << shp;
  }
}

}  // namespace
}  // namespace dflash::cudatest
