// Differential op tests: CUDA vs the CPU reference for every Backend op at several shapes (the 27B
// shapes included), plus the lossless checks ON THE GPU: an M-row call gives each row the bits of a
// one-row call (memcmp).
//
// Bounds (NMSE vs the CPU, see cuda_test_util.h), and why:
//   bit-exact: get_rows, copy_rows, hadamard (same butterflies in the same order), argmax, top_k
//              (exact selections), gdn_gates/elementwise are NOT claimed exact (expf/log1pf differ
//              from glibc by an ulp or two)
//   1e-10    : matmul (same dequantized weights; only the fp32 summation order differs: expected
//              NMSE ~ eps^2 * K / 1000 ~ 1e-13)
//   1e-7     : matmul of the integer tensor-core formats (ternary, Q4_K, Q6_K: exact integer sums over
//              activations quantized to 2 digit planes per 128-block: measured 3.6e-9 .. 7.4e-9; matmul_bound())
//   1e-11    : norms, elementwise, rope, convs (a few ulp per element)
//   1e-10    : attention (online vs two-pass softmax; split-key merge; at head dim 256 3xTF32 tensor-core
//              products, ~2^-19 of each product: measured within the bound, single tf32 fails it, S26-5)
//   1e-9     : gdn_recurrent, gdn_prepare_recurrent (8-row recurrence of a 128x128 state, different sum
//              trees; the latter's prepared q, k, g, beta at 1e-11 like the norms and gates)
//   1e-7     : gdn_chunked (both run the chunked WY form, CUDA with 3xTF32 tensor-core products:
//              equal up to fp32 rounding; measured 1e-12)
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <thread>

#include "cuda_test_util.h"
#include "ops/cuda/cuda_backend.h"
#include "quant/types.h"

namespace dflash::cudatest {
namespace {

const GgmlType kAllTypes[] = {GgmlType::F32,   GgmlType::F16,   GgmlType::BF16,  GgmlType::Q8_0, GgmlType::Q4_0,
                              GgmlType::Q4_K,  GgmlType::Q5_K,  GgmlType::Q6_K,  GgmlType::TQ1_0, GgmlType::TQ2_0,
                              GgmlType::Q1_0,  GgmlType::Q2_0,  GgmlType::PQ2_0, GgmlType::PTQ1_0};

void matmul_case(GgmlType t, int64_t in, int64_t out, const std::vector<int64_t>& Ms, uint32_t seed) {
  const HostWeight hw = make_weight(t, in, out, seed);
  const WeightRef wg = gpu().upload_weight(hw.bytes.data(), t, in, out);
  const WeightRef wc = cpu().upload_weight(hw.bytes.data(), t, in, out);
  std::mt19937 rng(seed);
  for (int64_t M : Ms) {
    const auto x = randn_vec(rng, M * in);
    Buf<float> xg(gpu(), x), yg(gpu(), M * out);
    Buf<float> xc(cpu(), x), yc(cpu(), M * out);
    gpu().matmul(wg, xg, yg, M);
    cpu().matmul(wc, xc, yc, M);
    check(std::string("matmul ") + type_name(t), shape_str({M, in, out}), yg.get(), yc.get(), matmul_bound(t),
          yg.guard_ok(), cuda::weight_layout(gpu(), wg));
  }
}

// out = 96 takes the small-output (k-split) kernel, out = 600 the warp-per-rows one (matmul.cu).
TEST(CudaMatmul, AllTypesSmall) {
  REQUIRE_GPU();
  uint32_t seed = 1;
  for (GgmlType t : kAllTypes) matmul_case(t, 512, 96, {1, 3, 8, 13}, seed++);
  for (GgmlType t : kAllTypes) matmul_case(t, 512, 600, {1, 3, 8}, seed++);
}

// The small-output kernel's k split: K with a partial last 256-chunk (1000), more chunks than warps
// and not a multiple of them (2056: 9 chunks, 2304: 9 full chunks), an odd out (2 outputs per CTA
// from 3 rows on: the last CTA's second row is past N).
TEST(CudaMatmul, SmallOutSplitK) {
  REQUIRE_GPU();
  uint32_t seed = 40;
  for (GgmlType t : {GgmlType::F32, GgmlType::F16, GgmlType::BF16})
    for (int64_t in : {1000, 2056}) matmul_case(t, in, 37, {1, 2, 3, 9}, seed++);
  for (GgmlType t : {GgmlType::Q4_K, GgmlType::Q8_0, GgmlType::TQ1_0}) matmul_case(t, 2304, 37, {1, 4, 9}, seed++);
}

TEST(CudaMatmul, PlainTypesOddK) {
  REQUIRE_GPU();
  for (GgmlType t : {GgmlType::F32, GgmlType::F16, GgmlType::BF16}) matmul_case(t, 80, 37, {1, 5, 9}, 7);
}

// The planar 2-bit layout with full 1024-chunks, a tail chunk, or both.
TEST(CudaMatmul, PlanarChunksAndTails) {
  REQUIRE_GPU();
  uint32_t seed = 50;
  for (GgmlType t : {GgmlType::PQ2_0, GgmlType::PTQ1_0})
    for (int64_t in : {128, 1024, 1536, 3200}) matmul_case(t, in, 70, {1, 8, 11}, seed++);
}

// The 27B shapes (SPEC 2.3) for the types that matter.
TEST(CudaMatmul, Bonsai27BShapes) {
  REQUIRE_GPU();
  struct S {
    int64_t in, out;
  };
  const S shapes[] = {{5120, 10240}, {5120, 17408}, {17408, 5120}, {6144, 5120}};
  uint32_t seed = 100;
  for (GgmlType t : {GgmlType::PTQ1_0, GgmlType::PQ2_0, GgmlType::Q4_K, GgmlType::Q6_K})
    for (const S& s : shapes) matmul_case(t, s.in, s.out, {1, 8}, seed++);
  matmul_case(GgmlType::BF16, 5120, 48, {1, 2, 8}, seed++);   // ssm_alpha / ssm_beta
  matmul_case(GgmlType::F32, 5120, 1024, {1, 8}, seed++);
  matmul_case(GgmlType::F16, 5120, 1024, {1, 8}, seed++);
  matmul_case(GgmlType::PTQ1_0, 5120, 248320, {1}, seed++);  // lm_head
}

// Lossless on the GPU: each row of an M-row matmul equals the 1-row matmul of that row, bit for bit.
void rows_identical_case(GgmlType t, int64_t in, int64_t out, const std::vector<int64_t>& Ms, uint32_t seed) {
  const HostWeight hw = make_weight(t, in, out, seed);
  const WeightRef w = gpu().upload_weight(hw.bytes.data(), t, in, out);
  std::mt19937 rng(seed + 1);
  bool all_same = true;
  std::string where, ms;
  for (int64_t M : Ms) {
    ms += fmt::format("{}{}", ms.empty() ? "" : ",", M);
    const auto x = randn_vec(rng, M * in);
    Buf<float> xm(gpu(), x), ym(gpu(), M * out);
    gpu().matmul(w, xm, ym, M);
    const auto multi = ym.get();
    for (int64_t m = 0; m < M; ++m) {
      Buf<float> x1(gpu(), std::vector<float>(x.begin() + m * in, x.begin() + (m + 1) * in)), y1(gpu(), out);
      gpu().matmul(w, x1, y1, 1);
      const auto one = y1.get();
      if (std::memcmp(one.data(), multi.data() + m * out, out * 4) != 0) {
        all_same = false;
        where += fmt::format(" M={},row={}", M, m);
      }
    }
  }
  record({std::string("matmul M-row==1-row ") + type_name(t), fmt::format("M in {{{}}}, {}x{}", ms, in, out), 0, 0,
          0, all_same, all_same ? std::string("memcmp equal") : fmt::format("differs at{}", where)});
  EXPECT_TRUE(all_same) << type_name(t) << " " << in << "x" << out << where;
}

// out = 200: the small-output (k-split) kernel; out = 600: the warp-per-rows one.
TEST(CudaMatmul, RowsBitIdenticalToSingleRows) {
  REQUIRE_GPU();
  uint32_t seed = 500;
  for (GgmlType t : kAllTypes) {
    rows_identical_case(t, 1024, 200, {2, 5, 8, 13, 64}, seed);
    seed += 2;
    rows_identical_case(t, 1024, 600, {2, 5, 8, 13}, seed);
    seed += 2;
  }
  rows_identical_case(GgmlType::BF16, 5120, 48, {2, 3, 8, 11}, seed);  // ssm_alpha / ssm_beta
  // The integer-mma tiles at 27B shapes with a k split over a cluster (17408 and 6144 inputs: 4 CTAs
  // per 64 rows) and without (5120): 1, 2 and 8 rows take different kernel instances (ring depth,
  // column map), which must sum the same blocks in the same order.
  for (GgmlType t : {GgmlType::PTQ1_0, GgmlType::PQ2_0}) {
    rows_identical_case(t, 17408, 5120, {2, 8}, seed += 2);
    rows_identical_case(t, 6144, 5120, {8}, seed += 2);
    rows_identical_case(t, 5120, 17408, {2, 8}, seed += 2);
  }
}

// matmul_group (one launch for the weights that share an input): each output against the CPU's
// matmul, and each row of an M-row group call == the 1-row group call, bit for bit. Shapes: the 27B
// GDN qkv | z and FFN gate | up pairs (ternary: one launch), a triple with a short last weight, and a
// mixed-type pair (falls back to one matmul each).
void group_case(const std::vector<std::pair<GgmlType, int64_t>>& parts, int64_t in, const std::vector<int64_t>& Ms,
                uint32_t seed) {
  std::vector<HostWeight> hws;  // the CPU backend reads the host bytes in place: they must outlive it
  std::vector<WeightRef> wg, wc;
  std::string shape;
  for (const auto& [t, out] : parts) hws.push_back(make_weight(t, in, out, seed++));
  for (const HostWeight& hw : hws) {
    const GgmlType t = hw.type;
    const int64_t out = hw.out;
    wg.push_back(gpu().upload_weight(hw.bytes.data(), t, in, out));
    wc.push_back(cpu().upload_weight(hw.bytes.data(), t, in, out));
    shape += fmt::format("{}{}:{}", shape.empty() ? "" : "+", type_name(t), out);
  }
  std::mt19937 rng(seed);
  bool all_same = true;
  std::string where;
  for (int64_t M : Ms) {
    const auto x = randn_vec(rng, M * in);
    Buf<float> xg(gpu(), x), xc(cpu(), x);
    std::vector<std::unique_ptr<Buf<float>>> yg, yc;
    std::vector<Backend::MatmulOut> og, oc;
    for (size_t i = 0; i < parts.size(); ++i) {
      yg.push_back(std::make_unique<Buf<float>>(gpu(), M * parts[i].second));
      yc.push_back(std::make_unique<Buf<float>>(cpu(), M * parts[i].second));
      og.push_back({&wg[i], *yg.back()});
      oc.push_back({&wc[i], *yc.back()});
    }
    gpu().matmul_group(og, xg, M);
    cpu().matmul_group(oc, xc, M);
    for (size_t i = 0; i < parts.size(); ++i) {
      const auto multi = yg[i]->get();
      check(fmt::format("matmul_group part {}", i), fmt::format("{} M={} in={}", shape, M, in), multi, yc[i]->get(),
            matmul_bound(hws[i].type), yg[i]->guard_ok());
    }
    if (M == 1) continue;
    for (int64_t m = 0; m < M; ++m) {
      Buf<float> x1(gpu(), std::vector<float>(x.begin() + m * in, x.begin() + (m + 1) * in));
      std::vector<std::unique_ptr<Buf<float>>> y1;
      std::vector<Backend::MatmulOut> o1;
      for (size_t i = 0; i < parts.size(); ++i) {
        y1.push_back(std::make_unique<Buf<float>>(gpu(), parts[i].second));
        o1.push_back({&wg[i], *y1.back()});
      }
      gpu().matmul_group(o1, x1, 1);
      for (size_t i = 0; i < parts.size(); ++i) {
        const int64_t out = parts[i].second;
        if (std::memcmp(y1[i]->get().data(), yg[i]->get().data() + m * out, out * 4) != 0) {
          all_same = false;
          where += fmt::format(" M={},row={},part={}", M, m, i);
        }
      }
    }
  }
  record({"matmul_group M-row==1-row", shape, 0, 0, 0, all_same,
          all_same ? std::string("memcmp equal") : fmt::format("differs at{}", where)});
  EXPECT_TRUE(all_same) << shape << where;
}

TEST(CudaMatmul, GroupSharedInput) {
  REQUIRE_GPU();
  group_case({{GgmlType::PTQ1_0, 10240}, {GgmlType::PTQ1_0, 6144}}, 5120, {1, 2, 8}, 700);  // GDN qkv | z
  group_case({{GgmlType::PQ2_0, 17408}, {GgmlType::PQ2_0, 17408}}, 5120, {1, 5}, 710);      // FFN gate | up
  group_case({{GgmlType::PTQ1_0, 200}, {GgmlType::PTQ1_0, 72}, {GgmlType::PTQ1_0, 24}}, 1024, {1, 3, 8, 13}, 720);
  group_case({{GgmlType::PTQ1_0, 96}, {GgmlType::Q4_K, 64}}, 512, {1, 4}, 730);  // mixed: one matmul each
}

// Launches a little over one wave of the 8-row kernel cut their last groups into k-range pieces whose last
// CTA adds the pieces (mma_gemv.cuh, MmaTail; the formats with kTailPieces): the drafter's Q4_K FFN gate | up
// (544 groups for 3 x 132 CTAs on an H200). The pieces' sums against the CPU, and every row of 8, 13 and 70
// rows (70: two launches of at most kTailRowTiles row tiles) == the one-row call, bit for bit. The 27B
// target's PTQ1_0 gate | up (no tail pieces) at the fixed 8-row kernel beside it.
TEST(CudaMatmul, TailPieces) {
  REQUIRE_GPU();
  const int64_t before = cuda::matmul_tail_launches();
  group_case({{GgmlType::Q4_K, 17408}, {GgmlType::Q4_K, 17408}}, 5120, {1, 8, 13, 70}, 750);
  const int64_t tails = cuda::matmul_tail_launches() - before;
  group_case({{GgmlType::PTQ1_0, 17408}, {GgmlType::PTQ1_0, 17408}}, 5120, {1, 8}, 740);
  record({"matmul tail launches", "Q4_K 5120 x (17408 + 17408)", 0, 0, 0, true, fmt::format("{}", tails)});
  // One wave's slots depend on the GPU; on the H200 (132 SMs) the shape has a tail.
  if (cuda::current_sm_count() == 132) {
    EXPECT_GT(tails, 0) << "no launch ran tail pieces";
  }
}

// ---- matmul-input chains (residual_norm_rotate, swiglu_rotate, gated_norm_rotate) ---------------
// On CUDA the residual add joins the norm kernel. Checked: every output (x updated, n, y) against the
// CPU's op sequences within 1e-11, and M-row == 1-row bit for bit.
struct ChainCase {
  int mode;  // 0 residual norm, 1 swiglu, 2 gated norm, 3 sigmoid gate (gated attention output)
  int64_t dim, block, head_dim;
  bool res, perm;
  bool head_perm = false;  // perm moves whole heads (as ssm_out's) and the Rotation says so (perm_group)
};

std::string chain_name(const ChainCase& c) {
  static const char* names[] = {"residual_norm_rotate", "swiglu_rotate", "gated_norm_rotate", "sigmoid_gate_rotate"};
  return fmt::format("{} dim {} block {}{}{}{}", names[c.mode], c.dim, c.block, c.res ? " +res" : "",
                     c.perm ? " +perm" : "", c.head_perm ? " (whole heads)" : "");
}

// Runs the chain on `be` for M rows; returns the outputs {x after, n, y} (residual) or {y}.
std::vector<std::vector<float>> run_chain(Backend& be, const ChainCase& c, int64_t M, const std::vector<float>& a,
                                          const std::vector<float>& b, const std::vector<float>& w,
                                          const std::vector<float>& signs, const std::vector<int32_t>& perm) {
  Buf<float> x(be, a), r(be, b), wb(be, w), sg(be, signs), n(be, M * c.dim), y(be, M * c.dim);
  Buf<int32_t> pm(be, perm);
  Backend::Rotation rot;
  if (c.block > 0) rot = {sg, c.perm ? pm.get_ptr() : nullptr, c.block, c.head_perm ? c.head_dim : 0};
  if (c.mode == 0) {
    be.residual_norm_rotate(x, c.res ? r.get_ptr() : nullptr, 1, wb, n, y, rot, M, c.dim, 1e-6f);
    return {x.get(), n.get(), c.block > 0 ? y.get() : std::vector<float>()};
  }
  if (c.mode == 1) {
    be.swiglu_rotate(x, r, y, rot, M, c.dim);
    return {y.get()};
  }
  if (c.mode == 3) {
    be.sigmoid_gate_rotate(x, r, y, rot, M, c.dim);
    return {y.get()};
  }
  be.gated_norm_rotate(x, wb, r, y, rot, M, c.dim, c.head_dim, 1e-6f);
  return {y.get()};
}

TEST(CudaOps, MatmulInputChains) {
  REQUIRE_GPU();
  const ChainCase cases[] = {
      {0, 5120, 1024, 0, true, false}, {0, 5120, 1024, 0, false, false}, {0, 5120, 0, 0, true, false},
      {0, 256, 128, 0, true, false},   {1, 17408, 1024, 0, false, false}, {1, 1024, 256, 0, false, false},
      {1, 640, 0, 0, false, false},    {2, 6144, 1024, 128, false, true}, {2, 6144, 1024, 128, false, false},
      {2, 512, 512, 64, false, true},  {2, 384, 0, 128, false, false},    {0, 2048, 64, 0, true, false},
      {1, 17408, 0, 0, false, false},  {0, 5120, 0, 0, false, false},     // no rotation: the plain chain kernels
      {2, 6144, 1024, 128, false, true, true}, {2, 6144, 0, 128, false, false},  // the gated chain (GDN output)
      {2, 2048, 1024, 64, false, true, true},
      {3, 6144, 1024, 0, false, false}, {3, 6144, 0, 0, false, false}, {3, 2048, 256, 0, false, false}};  // attention output
  uint32_t seed = 900;
  for (const ChainCase& c : cases) {
    std::mt19937 rng(seed++);
    const int64_t wn = c.mode == 2 ? c.head_dim : c.dim;
    std::vector<float> w = randn_vec(rng, wn), signs(c.dim);
    for (auto& v : signs) v = (rng() & 1) ? 1.0f : -1.0f;
    std::vector<int32_t> perm(c.dim);
    std::iota(perm.begin(), perm.end(), 0);
    if (c.head_perm) {  // shuffle whole heads
      std::vector<int32_t> heads(c.dim / c.head_dim);
      std::iota(heads.begin(), heads.end(), 0);
      std::shuffle(heads.begin(), heads.end(), rng);
      for (int64_t i = 0; i < c.dim; ++i)
        perm[i] = static_cast<int32_t>(heads[i / c.head_dim] * c.head_dim + i % c.head_dim);
    } else {
      std::shuffle(perm.begin(), perm.end(), rng);
    }
    bool rows_same = true;
    for (int64_t M : {1, 3, 8}) {
      const auto a = randn_vec(rng, M * c.dim), b = randn_vec(rng, M * c.dim);
      const auto got = run_chain(gpu(), c, M, a, b, w, signs, perm);
      const auto ref = run_chain(cpu(), c, M, a, b, w, signs, perm);
      for (size_t o = 0; o < got.size(); ++o)
        if (!got[o].empty())
          check(chain_name(c) + fmt::format(" out {}", o), fmt::format("M={}", M), got[o], ref[o], 1e-11);
      for (int64_t m = 0; m < M && M > 1; ++m) {
        const std::vector<float> a1(a.begin() + m * c.dim, a.begin() + (m + 1) * c.dim),
            b1(b.begin() + m * c.dim, b.begin() + (m + 1) * c.dim);
        const auto one = run_chain(gpu(), c, 1, a1, b1, w, signs, perm);
        for (size_t o = 0; o < one.size(); ++o)
          if (!one[o].empty() && std::memcmp(one[o].data(), got[o].data() + m * c.dim, c.dim * 4) != 0)
            rows_same = false;
      }
    }
    record({"chain M-row==1-row", chain_name(c), 0, 0, 0, rows_same, rows_same ? "memcmp equal" : "differs"});
    EXPECT_TRUE(rows_same) << chain_name(c);
  }
}

// The fused chains (chain.cu: norm or SwiGLU, rotation of 1024-blocks, and the ternary matmul's
// activation quantization in one kernel) leave y's quantization for the next ternary matmul: its
// result must equal, bit for bit, the matmul of a fresh copy of y (which quantizes y itself).
TEST(CudaOps, ChainQuantizationFeedsTheTernaryMatmul) {
  REQUIRE_GPU();
  const ChainCase cases[] = {{0, 5120, 1024, 0, true, false},
                             {0, 5120, 1024, 0, false, false},
                             {0, 8192, 1024, 0, true, false},
                             {1, 17408, 1024, 0, false, false},
                             {1, 1024, 1024, 0, false, false},
                             {2, 6144, 1024, 128, false, true, true},  // GDN output: gated norm + whole-head gather
                             {3, 6144, 1024, 0, false, false}};        // gated attention output
  uint32_t seed = 1500;
  for (const ChainCase& c : cases) {
    std::mt19937 rng(seed++);
    const HostWeight hw = make_weight(GgmlType::PTQ1_0, c.dim, 320, seed++);
    const WeightRef wg = gpu().upload_weight(hw.bytes.data(), hw.type, c.dim, 320);
    std::vector<float> w = randn_vec(rng, c.dim), signs(c.dim);
    for (auto& v : signs) v = (rng() & 1) ? 1.0f : -1.0f;
    std::vector<int32_t> perm(c.dim);  // whole heads in reverse order
    for (int64_t i = 0; i < c.dim; ++i)
      perm[i] = c.head_perm ? static_cast<int32_t>((c.dim / c.head_dim - 1 - i / c.head_dim) * c.head_dim + i % c.head_dim)
                            : static_cast<int32_t>(i);
    // M = 40: a prefill-sized input (>= kMatmulPrefillMinRows rows) goes to the bf16 GEMM, so the chain
    // writes no records and a GEMV that does get it quantizes it itself
    for (int64_t M : {1, 3, 8, 40}) {
      const bool expect_records = M < cuda::kMatmulPrefillMinRows;
      const auto a = randn_vec(rng, M * c.dim), b = randn_vec(rng, M * c.dim);
      Buf<float> x(gpu(), a), r(gpu(), b), wb(gpu(), w), sg(gpu(), signs), n(gpu(), M * c.dim), y(gpu(), M * c.dim);
      Buf<int32_t> pm(gpu(), perm);
      Buf<float> out_chain(gpu(), M * 320), out_fresh(gpu(), M * 320);  // before the chain: uploads drop the cache
      const Backend::Rotation rot{sg, c.head_perm ? pm.get_ptr() : nullptr, c.block, c.head_perm ? c.head_dim : 0};
      if (c.mode == 0)
        gpu().residual_norm_rotate(x, c.res ? r.get_ptr() : nullptr, 1, wb, n, y, rot, M, c.dim, 1e-6f);
      else if (c.mode == 1)
        gpu().swiglu_rotate(x, r, y, rot, M, c.dim);
      else if (c.mode == 3)
        gpu().sigmoid_gate_rotate(x, r, y, rot, M, c.dim);
      else
        gpu().gated_norm_rotate(x, wb, r, y, rot, M, c.dim, c.head_dim, 1e-6f);
      const int64_t reused0 = cuda::quantizations_reused(gpu());
      gpu().matmul(wg, y, out_chain, M);  // reads the chain's quantization of y
      const bool used_chain = cuda::quantizations_reused(gpu()) == reused0 + 1;
      Buf<float> y2(gpu(), y.get());
      gpu().matmul(wg, y2, out_fresh, M);  // quantizes y2 itself
      const std::string shp = fmt::format("{} M={}", chain_name(c), M);
      check("chain -> ternary matmul == fresh matmul", shp, out_chain.get(), out_fresh.get(), 0, out_chain.guard_ok());
      const bool as_expected = used_chain == expect_records;
      record({expect_records ? "chain quantization reused by the matmul" : "prefill-sized chain leaves no records", shp, 0,
              0, 0, as_expected, used_chain ? "reused" : "quantized again"});
      EXPECT_TRUE(as_expected) << shp << (expect_records ? ": the matmul quantized y again (the chain's records were not used)"
                                                         : ": a prefill-sized chain wrote records");
    }
  }
}

// Without a rotation (the DFlash drafter's norms and SwiGLU, unrotated models) the chain quantizes the
// matmul input itself: n for the norm, y for SwiGLU. The next integer matmul (Q4_K / Q6_K / ternary)
// must reuse those records and give the bits of a matmul of a fresh copy.
TEST(CudaOps, PlainChainQuantizationFeedsTheMatmul) {
  REQUIRE_GPU();
  struct C {
    int mode;  // 0 norm, 1 swiglu
    int64_t dim;
    GgmlType t;
  };
  const C cases[] = {{0, 5120, GgmlType::Q4_K}, {0, 5120, GgmlType::PTQ1_0}, {1, 17408, GgmlType::Q6_K},
                     {1, 2048, GgmlType::Q4_K}};
  uint32_t seed = 1700;
  for (const C& c : cases) {
    std::mt19937 rng(seed++);
    const HostWeight hw = make_weight(c.t, c.dim, 192, seed++);
    const WeightRef wg = gpu().upload_weight(hw.bytes.data(), hw.type, c.dim, 192);
    const std::vector<float> w = randn_vec(rng, c.dim);
    for (int64_t M : {1, 8}) {
      const auto a = randn_vec(rng, M * c.dim), b = randn_vec(rng, M * c.dim);
      Buf<float> x(gpu(), a), r(gpu(), b), wb(gpu(), w), n(gpu(), M * c.dim), y(gpu(), M * c.dim);
      Buf<float> out_chain(gpu(), M * 192), out_fresh(gpu(), M * 192);
      const Backend::Rotation none{};
      if (c.mode == 0)
        gpu().residual_norm_rotate(x, nullptr, 1, wb, n, nullptr, none, M, c.dim, 1e-6f);
      else
        gpu().swiglu_rotate(x, r, y, none, M, c.dim);
      const float* in = c.mode == 0 ? n.get_ptr() : y.get_ptr();
      const int64_t reused0 = cuda::quantizations_reused(gpu());
      gpu().matmul(wg, in, out_chain, M);
      const bool used_chain = cuda::quantizations_reused(gpu()) == reused0 + 1;
      Buf<float> in2(gpu(), c.mode == 0 ? n.get() : y.get());
      gpu().matmul(wg, in2, out_fresh, M);
      const std::string shp = fmt::format("{} {} M={} -> {}", c.mode == 0 ? "norm" : "swiglu", c.dim, M, type_name(c.t));
      check("plain chain -> matmul == fresh matmul", shp, out_chain.get(), out_fresh.get(), 0, out_chain.guard_ok());
      record({"plain chain quantization reused by the matmul", shp, 0, 0, 0, used_chain, used_chain ? "yes" : "NO"});
      EXPECT_TRUE(used_chain) << shp;
    }
  }
}

// ---- copy -----------------------------------------------------------------------------------------
// Backend::copy runs as a kernel (16-, 4- or 1-byte elements by the alignment of both pointers and the
// size): every byte of the range arrives, nothing around it is touched.
TEST(CudaOps, CopyEveryAlignment) {
  REQUIRE_GPU();
  const size_t kBuf = 3u << 20;
  std::vector<uint8_t> src(kBuf), ref(kBuf, 0xA5);
  std::mt19937 rng(7);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  auto* dsrc = static_cast<uint8_t*>(gpu().alloc(kBuf));
  auto* ddst = static_cast<uint8_t*>(gpu().alloc(kBuf));
  gpu().upload(dsrc, src.data(), kBuf);
  struct C {
    size_t dst_off, src_off, bytes;
  };
  // 16-aligned (the GDN state's size), 4-aligned, odd offsets and sizes, one byte
  const C cases[] = {{0, 0, 3145728}, {64, 128, 4096}, {4, 8, 1000}, {3, 5, 777}, {1, 0, 1}, {16, 32, 17}};
  bool ok = true;
  std::string where;
  for (const C& c : cases) {
    std::vector<uint8_t> out(kBuf);
    gpu().upload(ddst, ref.data(), kBuf);
    gpu().copy(ddst + c.dst_off, dsrc + c.src_off, c.bytes);
    gpu().download(out.data(), ddst, kBuf);
    std::vector<uint8_t> want = ref;
    std::memcpy(want.data() + c.dst_off, src.data() + c.src_off, c.bytes);
    if (out != want) {
      ok = false;
      where += fmt::format(" ({}, {}, {})", c.dst_off, c.src_off, c.bytes);
    }
  }
  gpu().release(dsrc);
  gpu().release(ddst);
  record({"copy", "16-, 4-, 1-byte paths", 0, 0, 0, ok, ok ? std::string("bytes equal, guards intact") : "differs at" + where});
  EXPECT_TRUE(ok) << where;
}

// ---- Hadamard -------------------------------------------------------------------------------------

TEST(CudaOps, Hadamard) {
  REQUIRE_GPU();
  std::mt19937 rng(13);
  struct C {
    int64_t rows, n, block;
  };
  // Blocks 32 .. 1024 run the register (warp-shuffle) kernel; 16 and 2048 the shared-memory one.
  for (const C c : {C{3, 6144, 1024}, C{8, 17408, 1024}, C{2, 256, 128}, C{5, 5120, 1024}, C{1, 5120, 1024},
                    C{1, 12288, 1024}, C{3, 2048, 32}, C{2, 1024, 64}, C{3, 1536, 512}, C{2, 4096, 2048},
                    C{2, 256, 16}}) {
    const auto x = randn_vec(rng, c.rows * c.n);
    std::vector<float> signs(c.n);
    for (auto& s : signs) s = (rng() & 1) ? 1.0f : -1.0f;
    std::vector<int32_t> perm(c.n);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    Buf<float> sg(gpu(), signs), sc(cpu(), signs);
    Buf<int32_t> pg(gpu(), perm), pc(cpu(), perm);
    const std::string shp = shape_str({c.rows, c.n, c.block});
    // forward, forward+perm, forward+perm in place, inverse, forward in place, inverse in place
    for (int mode = 0; mode < 6; ++mode) {
      Buf<float> xg(gpu(), x), yg(gpu(), c.rows * c.n), xc(cpu(), x), yc(cpu(), c.rows * c.n);
      const bool inverse = mode == 3 || mode == 5, use_perm = mode == 1 || mode == 2;
      const bool in_place = mode == 2 || mode == 4 || mode == 5;
      float* outg = in_place ? xg.get_ptr() : yg.get_ptr();
      float* outc = in_place ? xc.get_ptr() : yc.get_ptr();
      gpu().hadamard(xg, sg, use_perm ? pg.get_ptr() : nullptr, outg, c.rows, c.n, c.block, inverse);
      cpu().hadamard(xc, sc, use_perm ? pc.get_ptr() : nullptr, outc, c.rows, c.n, c.block, inverse);
      const char* names[] = {"hadamard fwd",     "hadamard fwd+perm",     "hadamard fwd+perm in place",
                             "hadamard inverse", "hadamard fwd in place", "hadamard inverse in place"};
      check(names[mode], shp, in_place ? xg.get() : yg.get(), in_place ? xc.get() : yc.get(), 0,
            in_place ? xg.guard_ok() : yg.guard_ok());
    }
  }
}

// ---- attention ------------------------------------------------------------------------------------

TEST(CudaOps, Rope) {
  REQUIRE_GPU();
  std::mt19937 rng(14);
  for (auto [heads, hd, rot] : {std::tuple<int64_t, int64_t, int64_t>{24, 256, 64}, {4, 64, 16}, {32, 128, 128}}) {
    const int64_t M = 6;
    const auto x = randn_vec(rng, M * heads * hd);
    const std::vector<int32_t> pos = {0, 1, 77, 4095, 131071, 262143};
    Buf<float> xg(gpu(), x), xc(cpu(), x);
    Buf<int32_t> pg(gpu(), pos), pc(cpu(), pos);
    gpu().rope_neox(xg, pg, M, heads, hd, rot, 1e7f);
    cpu().rope_neox(xc, pc, M, heads, hd, rot, 1e7f);
    check("rope_neox", shape_str({M, heads, hd, rot}), xg.get(), xc.get(), 1e-11, xg.guard_ok());
  }
}

void attention_case(int64_t M, int64_t H, int64_t Hkv, int64_t D, int64_t n_keys, std::vector<int32_t> ranges,
                    uint32_t seed, const std::string& what) {
  std::mt19937 rng(seed);
  const auto q = randn_vec(rng, M * H * D), k = randn_vec(rng, n_keys * Hkv * D), v = randn_vec(rng, n_keys * Hkv * D);
  Buf<float> qg(gpu(), q), kg(gpu(), k), vg(gpu(), v);
  Buf<float> qc(cpu(), q), kc(cpu(), k), vc(cpu(), v), oc(cpu(), M * H * D);
  Buf<int32_t> rg(gpu(), ranges), rc(cpu(), ranges);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  cpu().attention(qc, kc, vc, rc, oc, M, H, Hkv, D, scale);
  const auto ref = oc.get();
  // the decode / verify segment kernel's variants (cuda::set_attention_segment_variant; -1 the default):
  // 0 and 1 (fp32 FMA; scores layout and staging only) give the same bits, 2 (tensor cores, head dims 128
  // and 256, the default at 256; other head dims fall back to the rule) its own; each within the bound,
  // each lossless: every row alone (same range) gives the M-row call's bits
  const bool mma_shape = D == 128 || D == 256, mma_default = D == 256;
  std::vector<std::vector<float>> outs;
  for (int v : {-1, 0, 1, 2}) {
    cuda::set_attention_segment_variant(v);
    const std::string name = v < 0 ? what : fmt::format("{} variant {}", what, v);
    Buf<float> og(gpu(), M * H * D);
    gpu().attention(qg, kg, vg, rg, og, M, H, Hkv, D, scale);
    const auto multi = og.get();
    check(fmt::format("attention {}", name), shape_str({M, H, Hkv, D, n_keys}), multi, ref, 1e-10, og.guard_ok());
    bool same = true;
    for (int64_t m = 0; m < M; ++m) {
      Buf<float> q1(gpu(), std::vector<float>(q.begin() + m * H * D, q.begin() + (m + 1) * H * D)), o1(gpu(), H * D);
      Buf<int32_t> r1(gpu(), std::vector<int32_t>{ranges[2 * m], ranges[2 * m + 1]});
      gpu().attention(q1, kg, vg, r1, o1, 1, H, Hkv, D, scale);
      same = same && std::memcmp(o1.get().data(), multi.data() + m * H * D, H * D * 4) == 0;
    }
    cuda::set_attention_segment_variant(-1);
    record({fmt::format("attention M-row==1-row {}", name), shape_str({M, H, Hkv, D}), 0, 0, 0, same,
            same ? "memcmp equal" : "differs"});
    EXPECT_TRUE(same) << name;
    outs.push_back(multi);
  }
  const auto bits_equal = [&](const std::string& op, const std::vector<float>& x, const std::vector<float>& y) {
    const bool eq = std::memcmp(x.data(), y.data(), x.size() * 4) == 0;
    record({op, shape_str({M, H, Hkv, D}), 0, 0, 0, eq, eq ? "memcmp equal" : "differs"});
    EXPECT_TRUE(eq) << op;
  };
  bits_equal(fmt::format("attention variant 1 == variant 0 {}", what), outs[2], outs[1]);
  bits_equal(fmt::format("attention default == variant {} {}", mma_default ? 2 : 0, what), outs[0],
             mma_default ? outs[3] : outs[1]);
  if (!mma_shape) bits_equal(fmt::format("attention variant 2 == variant 0 {} (no mma shape)", what), outs[3], outs[1]);
}

TEST(CudaOps, Attention) {
  REQUIRE_GPU();
  // verify: 8 causal rows after 300 cached keys (27B shape)
  std::vector<int32_t> r;
  for (int m = 0; m < 8; ++m) r.insert(r.end(), {0, 300 + m + 1});
  attention_case(8, 24, 4, 256, 400, r, 21, "verify 27B");
  attention_case(1, 24, 4, 256, 5000, {0, 4999}, 22, "decode long");
  attention_case(3, 32, 8, 128, 100, {0, 1, 5, 60, 0, 100}, 23, "drafter-like");
  attention_case(4, 4, 2, 64, 50, {0, 0, 0, 7, 3, 9, 0, 50}, 24, "tiny with empty range");
  attention_case(2, 4, 2, 16, 40, {0, 33, 0, 40}, 25, "head_dim 16");
  // Tile and segment edges (the segment kernel: keys in tiles of 32 at absolute positions, 32 segments
  // of ceil(tiles / 32) tiles per row). 27B shape, decode: 1 key, 32, a range starting mid-tile, 19 tiles.
  attention_case(1, 24, 4, 256, 40, {0, 1}, 26, "decode 1 key");
  attention_case(1, 24, 4, 256, 64, {0, 32}, 27, "decode 32 keys");
  attention_case(1, 24, 4, 256, 100, {17, 50}, 28, "decode mid-tile range");
  attention_case(1, 24, 4, 256, 600, {0, 577}, 29, "decode 577 keys");
  // verify rows with different ranges (union of tiles shared, each row masked to its own), empty rows
  attention_case(8, 24, 4, 256, 700, {0, 1, 0, 0, 5, 37, 31, 33, 0, 513, 100, 700, 699, 700, 0, 640}, 30,
                 "verify rows of different ranges");
  // verify rows of many tile counts in one call: odd counts, ranges starting and ending mid-tile, one
  // tile, 17 tiles, a row of 54 tiles (two-tile segments, the last ones empty)
  attention_case(8, 24, 4, 256, 1700,
                 {0, 9 * 32 - 5, 40, 600, 0, 33, 31, 32, 0, 17 * 32, 3, 16 * 32 + 1, 100, 1700, 0, 35 * 32 + 7}, 37,
                 "verify segment pairs");
  // the 27B drafter's block: 8 rows of 32 / 8 heads x 128 in one CTA (the 8-row verify layout), every row
  // over the whole context, then rows of different ranges (the union's tiles, each row masked to its own)
  std::vector<int32_t> rd;
  for (int m = 0; m < 8; ++m) rd.insert(rd.end(), {0, 588});
  attention_case(8, 32, 8, 128, 620, rd, 38, "drafter block 8 rows");
  attention_case(8, 32, 8, 128, 620, {0, 588, 0, 1, 31, 33, 100, 620, 0, 0, 5, 600, 64, 96, 0, 300}, 39,
                 "drafter 8 rows of different ranges");
  // 16 causal rows across 1024 keys: ceil(tiles / 32) changes between rows (segment bounds differ)
  std::vector<int32_t> r16;
  for (int m = 0; m < 16; ++m) r16.insert(r16.end(), {0, 1017 + m});
  attention_case(16, 24, 4, 256, 1040, r16, 31, "verify 16 rows across 1024");
  // many rows, small heads: 8 rows per item (16 queries of 2 heads)
  std::vector<int32_t> r32;
  for (int m = 0; m < 32; ++m) r32.insert(r32.end(), {m % 5 == 4 ? 3 : 0, 200 + 7 * m});
  attention_case(32, 4, 2, 64, 420, r32, 32, "verify 32 rows head_dim 64");
  // The generic split kernel's shapes: head_dim not a multiple of 4, and 512; 12 and 9 heads per KV head
  // (one head chunk of the segment kernel)
  attention_case(5, 6, 2, 10, 90, {0, 90, 7, 8, 31, 33, 33, 64, 40, 41}, 33, "head_dim 10");
  attention_case(6, 24, 2, 48, 700, {0, 1, 0, 700, 650, 700, 1, 513, 31, 32, 0, 0}, 34, "12 heads per kv head");
  attention_case(3, 9, 1, 32, 200, {5, 199, 0, 200, 64, 96}, 35, "9 heads, 1 kv head");
  attention_case(2, 8, 2, 512, 300, {0, 300, 3, 270}, 36, "head_dim 512");
  // Segment kernel (attention_segments.cu): 32 segments of ceil(tiles / 32) tiles per row. Long ranges
  // (several tiles per segment, the last segments shorter), causal verify rows whose tile counts cross a
  // multiple of 32 (rows of one CTA with segments of different lengths: the CTA streams the union), a
  // row starting mid-segment, and the drafter's shape over a long context.
  std::vector<int32_t> rl;
  for (int m = 0; m < 8; ++m) rl.insert(rl.end(), {0, 9000 - 7 + m});
  attention_case(8, 24, 4, 256, 9001, rl, 40, "verify 8 rows over 9000 keys");
  attention_case(1, 24, 4, 256, 9001, {0, 8999}, 41, "decode 8999 keys");
  std::vector<int32_t> rx;
  for (int m = 0; m < 8; ++m) rx.insert(rx.end(), {m == 5 ? 700 : 0, 2045 + m});
  attention_case(8, 24, 4, 256, 2060, rx, 42, "verify rows across 64 tiles");
  std::vector<int32_t> rdl;
  for (int m = 0; m < 8; ++m) rdl.insert(rdl.end(), {0, 3000 + 8 * m});
  attention_case(8, 32, 8, 128, 3100, rdl, 43, "drafter block over 3000 keys");
  // more rows than one launch of the segment kernel takes (64): two launches sharing the scratch
  std::vector<int32_t> r70;
  for (int m = 0; m < 70; ++m) r70.insert(r70.end(), {m % 7 == 3 ? 40 : 0, 100 + 3 * m});
  attention_case(70, 4, 2, 64, 320, r70, 44, "70 rows, two launches");
}

// ---- Gated DeltaNet -------------------------------------------------------------------------------

TEST(CudaOps, GdnConvAndGates) {
  REQUIRE_GPU();
  std::mt19937 rng(31);
  // M >= 32 (out of place) runs the prefill kernel (runs of 16 rows in parallel, then the state
  // update): it must give the serial kernel's bits (the in-place call below) and the row-by-row bits.
  for (auto [M, C, K] : {std::tuple<int64_t, int64_t, int64_t>{8, 10240, 4}, {1, 10240, 4}, {5, 300, 3},
                         {100, 10240, 4}, {512, 1024, 4}, {37, 300, 3}}) {
    const auto x = randn_vec(rng, M * C), st = randn_vec(rng, (K - 1) * C), w = randn_vec(rng, C * K, 0.5f);
    Buf<float> xg(gpu(), x), sg(gpu(), st), wg(gpu(), w), yg(gpu(), M * C), bg(gpu(), (K - 1) * C);
    Buf<float> xc(cpu(), x), sc(cpu(), st), wc(cpu(), w), yc(cpu(), M * C);
    gpu().gdn_conv(xg, sg, bg, wg, yg, M, C, K);
    cpu().gdn_conv(xc, sc, nullptr, wc, yc, M, C, K);
    check("gdn_conv out", shape_str({M, C, K}), yg.get(), yc.get(), 1e-11, yg.guard_ok());
    check("gdn_conv state", shape_str({M, C, K}), sg.get(), sc.get(), 0, sg.guard_ok());
    // the undo checkpoint: the state as it was before the rows, exactly
    check("gdn_conv state_before", shape_str({M, C, K}), bg.get(), st, 0, bg.guard_ok());
    // in place (y == x), and M rows == M one-row calls (state carried)
    Buf<float> x2(gpu(), x), s2(gpu(), st);
    gpu().gdn_conv(x2, s2, nullptr, wg, x2, M, C, K);
    Buf<float> s3(gpu(), st), y3(gpu(), C);
    std::vector<float> rows;
    for (int64_t m = 0; m < M; ++m) {
      Buf<float> x1(gpu(), std::vector<float>(x.begin() + m * C, x.begin() + (m + 1) * C));
      gpu().gdn_conv(x1, s3, nullptr, wg, y3, 1, C, K);
      const auto y = y3.get();
      rows.insert(rows.end(), y.begin(), y.end());
    }
    const bool same = x2.get() == yg.get() && rows == yg.get();
    record({"gdn_conv in-place & M-row==1-row", shape_str({M, C, K}), 0, 0, 0, same, same ? "equal" : "differs"});
    EXPECT_TRUE(same);
  }
  {
    const int64_t M = 8, H = 48;
    const auto a = randn_vec(rng, M * H, 3.0f), b = randn_vec(rng, M * H, 3.0f), dt = randn_vec(rng, H),
               sa = rand_vec(rng, H, -8.0f, -0.01f);
    Buf<float> ag(gpu(), a), bg(gpu(), b), dg(gpu(), dt), sg(gpu(), sa);
    Buf<float> ac(cpu(), a), bc(cpu(), b), dc(cpu(), dt), sc(cpu(), sa);
    gpu().gdn_gates(ag, bg, dg, sg, M, H);
    cpu().gdn_gates(ac, bc, dc, sc, M, H);
    check("gdn_gates g", shape_str({M, H}), ag.get(), ac.get(), 1e-11, ag.guard_ok());
    check("gdn_gates beta", shape_str({M, H}), bg.get(), bc.get(), 1e-11, bg.guard_ok());
  }
}

struct GdnInputs {
  std::vector<float> q, k, v, g, beta, state;
};
GdnInputs gdn_inputs(const GdnShape& s, int64_t M, std::mt19937& rng) {
  GdnInputs in;
  auto l2 = [&](std::vector<float>& x, int64_t rows, int64_t n, float scale) {
    for (int64_t r = 0; r < rows; ++r) {
      double ss = 0;
      for (int64_t i = 0; i < n; ++i) ss += double(x[r * n + i]) * x[r * n + i];
      for (int64_t i = 0; i < n; ++i) x[r * n + i] = static_cast<float>(x[r * n + i] / std::sqrt(ss + 1e-6) * scale);
    }
  };
  in.q = randn_vec(rng, M * s.n_k_heads * s.head_k);
  in.k = randn_vec(rng, M * s.n_k_heads * s.head_k);
  l2(in.q, M * s.n_k_heads, s.head_k, 1.0f / std::sqrt(float(s.head_k)));
  l2(in.k, M * s.n_k_heads, s.head_k, 1.0f);
  in.v = randn_vec(rng, M * s.n_v_heads * s.head_v);
  in.g = rand_vec(rng, M * s.n_v_heads, -0.7f, -0.001f);
  in.beta = rand_vec(rng, M * s.n_v_heads, 0.05f, 0.95f);
  in.state = randn_vec(rng, s.n_v_heads * s.head_k * s.head_v, 0.3f);
  return in;
}

TEST(CudaOps, GdnRecurrent) {
  REQUIRE_GPU();
  std::mt19937 rng(32);
  for (const GdnShape s : {GdnShape{16, 48, 128, 128}, GdnShape{2, 4, 32, 64}, GdnShape{2, 4, 16, 16}}) {
    const int64_t M = 8;
    const GdnInputs in = gdn_inputs(s, M, rng);
    const int64_t hs = s.n_v_heads * s.head_k * s.head_v;
    Buf<float> qg(gpu(), in.q), kg(gpu(), in.k), vg(gpu(), in.v), gg(gpu(), in.g), bg(gpu(), in.beta),
        sg(gpu(), in.state), og(gpu(), M * s.n_v_heads * s.head_v), snapg(gpu(), M * hs);
    Buf<float> qc(cpu(), in.q), kc(cpu(), in.k), vc(cpu(), in.v), gc(cpu(), in.g), bc(cpu(), in.beta),
        sc(cpu(), in.state), oc(cpu(), M * s.n_v_heads * s.head_v), snapc(cpu(), M * hs);
    gpu().gdn_recurrent(qg, kg, vg, gg, bg, sg, sg, og, snapg, M, s);
    cpu().gdn_recurrent(qc, kc, vc, gc, bc, sc, sc, oc, snapc, M, s);
    const std::string shp = shape_str({M, s.n_k_heads, s.n_v_heads, s.head_k, s.head_v});
    check("gdn_recurrent out", shp, og.get(), oc.get(), 1e-9, og.guard_ok());
    check("gdn_recurrent state", shp, sg.get(), sc.get(), 1e-9, sg.guard_ok());
    check("gdn_recurrent snapshots", shp, snapg.get(), snapc.get(), 1e-9, snapg.guard_ok());
    // out of place (state_in != state): the in-place bits, state_in untouched
    {
      Buf<float> s_in(gpu(), in.state), s_out(gpu(), hs), o2(gpu(), M * s.n_v_heads * s.head_v);
      gpu().gdn_recurrent(qg, kg, vg, gg, bg, s_in, s_out, o2, nullptr, M, s);
      const bool same = s_out.get() == sg.get() && o2.get() == og.get() && s_in.get() == in.state &&
                        s_in.guard_ok() && s_out.guard_ok();
      record({"gdn_recurrent state_in != state", shp, 0, 0, 0, same, same ? "equal to in place" : "differs"});
      EXPECT_TRUE(same);
    }
    // verify == decode: M one-row calls carrying the state give the same bits as the M-row call
    Buf<float> s1(gpu(), in.state), o1(gpu(), s.n_v_heads * s.head_v);
    std::vector<float> outs;
    bool snaps_same = true;
    const auto snap_multi = snapg.get();
    for (int64_t m = 0; m < M; ++m) {
      auto row = [&](const std::vector<float>& a, int64_t w) {
        return std::vector<float>(a.begin() + m * w, a.begin() + (m + 1) * w);
      };
      Buf<float> q1(gpu(), row(in.q, s.n_k_heads * s.head_k)), k1(gpu(), row(in.k, s.n_k_heads * s.head_k)),
          v1(gpu(), row(in.v, s.n_v_heads * s.head_v)), g1(gpu(), row(in.g, s.n_v_heads)),
          b1(gpu(), row(in.beta, s.n_v_heads));
      gpu().gdn_recurrent(q1, k1, v1, g1, b1, s1, s1, o1, nullptr, 1, s);
      const auto o = o1.get();
      outs.insert(outs.end(), o.begin(), o.end());
      snaps_same = snaps_same && std::memcmp(s1.get().data(), snap_multi.data() + m * hs, hs * 4) == 0;
    }
    const bool same = outs == og.get() && snaps_same;
    record({"gdn_recurrent M-row==1-row", shp, 0, 0, 0, same, same ? "out + per-row state memcmp equal" : "differs"});
    EXPECT_TRUE(same);
  }
}

// gdn_apply_rows_batch (rollback: every GDN layer's state advanced over the kept rows in one launch):
// each job's rows recorded by an undoable gdn_prepare_recurrent of its own random inputs; applying the
// first n gives bit for bit the state the plain op leaves after those n rows (so the same as if the
// other rows had never been seen), for n = 1 .. M; the guards hold; more jobs than one launch takes (64)
// go in several. The last job against the CPU's apply at gdn_recurrent's bound.
TEST(CudaOps, GdnApplyRowsBatch) {
  REQUIRE_GPU();
  std::mt19937 rng(33);
  struct Case {
    GdnShape s;
    int64_t M;
    int jobs;
  };
  const GdnShape big{16, 48, 128, 128};
  const Case cases[] = {{big, 1, 3}, {big, 8, 3}, {{2, 4, 32, 64}, 3, 4}, {{2, 4, 16, 16}, 2, 70}, {{1, 2, 40, 24}, 3, 2}};
  auto bits = [](const std::vector<float>& x, const std::vector<float>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
  };
  for (const Case& cs : cases) {
    const GdnShape& s = cs.s;
    const int64_t M = cs.M, Hk = s.n_k_heads, Hv = s.n_v_heads, nqk = Hk * s.head_k, nv = Hv * s.head_v;
    const int64_t C = 2 * nqk + nv, hs = Hv * s.head_k * s.head_v;
    struct Job {
      std::vector<float> conv, a, b, dt, sa, st0;
      std::unique_ptr<Buf<float>> xg, ag, bg, dg, sag, pq, pk, pg, pb, delta;
    };
    std::vector<Job> js(static_cast<size_t>(cs.jobs));
    auto raw = [&](Job& x) {  // the job's rows (the first n of them for n-row calls)
      const float* c = x.xg->get_ptr();
      return Backend::GdnRawInputs{c, C, c + nqk, C, c + 2 * nqk, C, x.ag->get_ptr(), x.bg->get_ptr(),
                                   x.dg->get_ptr(), x.sag->get_ptr()};
    };
    bool untouched = true;
    for (Job& x : js) {
      x.conv = randn_vec(rng, M * C), x.a = randn_vec(rng, M * Hv, 3.0f), x.b = randn_vec(rng, M * Hv, 3.0f);
      x.dt = randn_vec(rng, Hv), x.sa = rand_vec(rng, Hv, -8.0f, -0.01f), x.st0 = randn_vec(rng, hs, 0.3f);
      x.xg = std::make_unique<Buf<float>>(gpu(), x.conv), x.ag = std::make_unique<Buf<float>>(gpu(), x.a);
      x.bg = std::make_unique<Buf<float>>(gpu(), x.b), x.dg = std::make_unique<Buf<float>>(gpu(), x.dt);
      x.sag = std::make_unique<Buf<float>>(gpu(), x.sa);
      x.pq = std::make_unique<Buf<float>>(gpu(), M * nqk), x.pk = std::make_unique<Buf<float>>(gpu(), M * nqk);
      x.pg = std::make_unique<Buf<float>>(gpu(), M * Hv), x.pb = std::make_unique<Buf<float>>(gpu(), M * Hv);
      x.delta = std::make_unique<Buf<float>>(gpu(), M * nv);
      Buf<float> st(gpu(), x.st0), out(gpu(), M * nv);
      const Backend::GdnPrepared undo{x.pq->get_ptr(), x.pk->get_ptr(), x.pg->get_ptr(), x.pb->get_ptr(),
                                      x.delta->get_ptr()};
      gpu().gdn_prepare_recurrent(raw(x), st, out, &undo, M, s);
      untouched = untouched && bits(st.get(), x.st0) && st.guard_ok();
    }
    const std::string shp0 = shape_str({cs.jobs, M, Hk, Hv, s.head_k, s.head_v});
    record({"gdn_prepare_recurrent undoable: state untouched", shp0, 0, 0, 0, untouched,
            untouched ? "states memcmp equal to before" : "a state changed"});
    EXPECT_TRUE(untouched) << shp0;
    for (int64_t n = 1; n <= M; ++n) {
      const std::string shp = shp0 + fmt::format(" keep {}", n);
      std::vector<std::unique_ptr<Buf<float>>> states;
      std::vector<Backend::GdnApplyJob> jobs;
      for (Job& x : js) {
        states.push_back(std::make_unique<Buf<float>>(gpu(), x.st0));
        jobs.push_back({x.pk->get_ptr(), x.pg->get_ptr(), x.delta->get_ptr(), states.back()->get_ptr()});
      }
      gpu().gdn_apply_rows_batch(jobs, n, s);
      bool same = true;
      for (size_t j = 0; j < js.size(); ++j) {  // the plain op over the first n rows
        Buf<float> want(gpu(), js[j].st0), out(gpu(), n * nv);
        gpu().gdn_prepare_recurrent(raw(js[j]), want, out, nullptr, n, s);
        same = same && bits(states[j]->get(), want.get()) && states[j]->guard_ok();
      }
      record({"gdn_apply_rows_batch == the op over the kept rows", shp, 0, 0, 0, same,
              same ? "every job's state memcmp equal, guards intact" : "differs"});
      EXPECT_TRUE(same) << shp;
      // the last job against the CPU: its own undoable op and apply
      Job& x = js.back();
      Buf<float> xc(cpu(), x.conv), ac(cpu(), x.a), bc(cpu(), x.b), dc(cpu(), x.dt), sac(cpu(), x.sa),
          sc(cpu(), x.st0), oc(cpu(), M * nv), pqc(cpu(), M * nqk), pkc(cpu(), M * nqk), pgc(cpu(), M * Hv),
          pbc(cpu(), M * Hv), dlc(cpu(), M * nv);
      const Backend::GdnPrepared undo_c{pqc, pkc, pgc, pbc, dlc};
      cpu().gdn_prepare_recurrent({xc, C, xc.get_ptr() + nqk, C, xc.get_ptr() + 2 * nqk, C, ac, bc, dc, sac}, sc, oc,
                                  &undo_c, M, s);
      if (n == 1) check("gdn_prepare_recurrent undoable delta", shp0, x.delta->get(), dlc.get(), 1e-9, x.delta->guard_ok());
      const Backend::GdnApplyJob cj[] = {{pkc, pgc, dlc, sc}};
      cpu().gdn_apply_rows_batch(cj, n, s);
      check("gdn_apply_rows_batch state", shp, states.back()->get(), sc.get(), 1e-9, states.back()->guard_ok());
    }
  }
}

// copy_batch: every job's bytes where copy() puts them, nothing past them (guards); sets with an
// unaligned job (one copy at a time) and more jobs than one launch takes (96).
TEST(CudaOps, CopyBatch) {
  REQUIRE_GPU();
  std::mt19937 rng(35);
  for (const auto& [njobs, misalign] : {std::pair{3, 0}, std::pair{5, 1}, std::pair{100, 0}}) {
    std::vector<std::unique_ptr<Buf<float>>> src, dst;
    std::vector<Backend::CopyJob> jobs;
    std::vector<std::vector<float>> want;
    for (int j = 0; j < njobs; ++j) {
      const size_t n = 4 * (1 + rng() % 3000);  // floats: a multiple of 16 bytes
      src.push_back(std::make_unique<Buf<float>>(gpu(), randn_vec(rng, n)));
      dst.push_back(std::make_unique<Buf<float>>(gpu(), std::vector<float>(n, -1.0f)));
      const size_t off = misalign && j == 1 ? 1 : 0;  // one job 4-byte aligned only
      jobs.push_back({dst.back()->get_ptr() + off, src.back()->get_ptr() + off, (n - off) * sizeof(float)});
      std::vector<float> w = src.back()->get();
      if (off) w[0] = -1.0f;
      want.push_back(w);
    }
    gpu().copy_batch(jobs);
    bool same = true;
    for (int j = 0; j < njobs; ++j) same = same && dst[j]->get() == want[j] && dst[j]->guard_ok();
    const std::string shp = fmt::format("{} jobs{}", njobs, misalign ? ", one unaligned" : "");
    record({"copy_batch", shp, 0, 0, 0, same, same ? "equal, guards intact" : "differs"});
    EXPECT_TRUE(same) << shp;
  }
}

// gdn_prepare_recurrent (decode / verify: l2 norms, gates and the recurrence in one kernel) from raw
// conv rows [M, C] (q | k | v read with row stride C) against the CPU's op sequence: out and state at
// gdn_recurrent's bound, the prepared q, k, g, beta at the norms' / gates' bound. On the GPU, bit for
// bit: the inputs are left as they were, M rows == M one-row calls (state carried, prepared values
// too), no `prepared` gives the same out and state, and the undoable form (GdnPrepared::delta) the same
// out with the state untouched (its deltas: CudaOps.GdnApplyRowsBatch). M = 11 spans two staging blocks.
TEST(CudaOps, GdnPrepareRecurrent) {
  REQUIRE_GPU();
  std::mt19937 rng(34);
  struct Case {
    GdnShape s;
    int64_t M;
  };
  const GdnShape big{16, 48, 128, 128};
  const Case cases[] = {{big, 1}, {big, 2}, {big, 8}, {big, 11}, {{2, 4, 32, 64}, 3}, {{2, 4, 16, 16}, 9}};
  for (const Case& cs : cases) {
    const GdnShape& s = cs.s;
    const int64_t M = cs.M, Hk = s.n_k_heads, Hv = s.n_v_heads;
    const int64_t nqk = Hk * s.head_k, nv = Hv * s.head_v, C = 2 * nqk + nv, hs = Hv * s.head_k * s.head_v;
    const auto conv = randn_vec(rng, M * C), a = randn_vec(rng, M * Hv, 3.0f), b = randn_vec(rng, M * Hv, 3.0f),
               dt = randn_vec(rng, Hv), sa = rand_vec(rng, Hv, -8.0f, -0.01f), st0 = randn_vec(rng, hs, 0.3f);
    const std::string shp = shape_str({M, Hk, Hv, s.head_k, s.head_v});
    auto bits = [](const std::vector<float>& x, const std::vector<float>& y) {
      return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
    };
    auto raw = [&](const float* x, const float* av, const float* bv, const float* d, const float* A) {
      return Backend::GdnRawInputs{x, C, x + nqk, C, x + 2 * nqk, C, av, bv, d, A};
    };
    Buf<float> xg(gpu(), conv), ag(gpu(), a), bg(gpu(), b), dg(gpu(), dt), sag(gpu(), sa), sg(gpu(), st0),
        og(gpu(), M * nv), pqg(gpu(), M * nqk), pkg(gpu(), M * nqk), pgg(gpu(), M * Hv), pbg(gpu(), M * Hv);
    Buf<float> xc(cpu(), conv), ac(cpu(), a), bc(cpu(), b), dc(cpu(), dt), sac(cpu(), sa), sc(cpu(), st0),
        oc(cpu(), M * nv), pqc(cpu(), M * nqk), pkc(cpu(), M * nqk), pgc(cpu(), M * Hv), pbc(cpu(), M * Hv);
    const Backend::GdnPrepared prep_g{pqg, pkg, pgg, pbg}, prep_c{pqc, pkc, pgc, pbc};
    gpu().gdn_prepare_recurrent(raw(xg, ag, bg, dg, sag), sg, og, &prep_g, M, s);
    cpu().gdn_prepare_recurrent(raw(xc, ac, bc, dc, sac), sc, oc, &prep_c, M, s);
    const auto out = og.get(), st = sg.get(), pq = pqg.get(), pk = pkg.get(), pg = pgg.get(), pb = pbg.get();
    check("gdn_prepare_recurrent out", shp, out, oc.get(), 1e-9, og.guard_ok());
    check("gdn_prepare_recurrent state", shp, st, sc.get(), 1e-9, sg.guard_ok());
    check("gdn_prepare_recurrent prepared q", shp, pq, pqc.get(), 1e-11, pqg.guard_ok());
    check("gdn_prepare_recurrent prepared k", shp, pk, pkc.get(), 1e-11, pkg.guard_ok());
    check("gdn_prepare_recurrent prepared g", shp, pg, pgc.get(), 1e-11, pgg.guard_ok());
    check("gdn_prepare_recurrent prepared beta", shp, pb, pbc.get(), 1e-11, pbg.guard_ok());
    {  // the inputs are read only
      const bool same = bits(xg.get(), conv) && bits(ag.get(), a) && bits(bg.get(), b);
      record({"gdn_prepare_recurrent inputs unchanged", shp, 0, 0, 0, same,
              same ? "conv rows, a, b memcmp equal" : "changed"});
      EXPECT_TRUE(same) << shp;
    }
    {  // without `prepared`: the same out and state
      Buf<float> s2(gpu(), st0), o2(gpu(), M * nv);
      gpu().gdn_prepare_recurrent(raw(xg, ag, bg, dg, sag), s2, o2, nullptr, M, s);
      const bool same = bits(o2.get(), out) && bits(s2.get(), st);
      record({"gdn_prepare_recurrent no prepared == prepared", shp, 0, 0, 0, same,
              same ? "out + state memcmp equal" : "differs"});
      EXPECT_TRUE(same) << shp;
    }
    {  // verify == decode: M one-row calls carrying the state give the bits of the M-row call
      Buf<float> s1(gpu(), st0), o1(gpu(), M * nv), q1(gpu(), M * nqk), k1(gpu(), M * nqk), g1(gpu(), M * Hv),
          b1(gpu(), M * Hv);
      for (int64_t m = 0; m < M; ++m) {
        const Backend::GdnPrepared p1{q1.get_ptr() + m * nqk, k1.get_ptr() + m * nqk, g1.get_ptr() + m * Hv,
                                      b1.get_ptr() + m * Hv};
        gpu().gdn_prepare_recurrent(raw(xg.get_ptr() + m * C, ag.get_ptr() + m * Hv, bg.get_ptr() + m * Hv, dg, sag),
                                    s1, o1.get_ptr() + m * nv, &p1, 1, s);
      }
      const bool same = bits(o1.get(), out) && bits(s1.get(), st) && bits(q1.get(), pq) && bits(k1.get(), pk) &&
                        bits(g1.get(), pg) && bits(b1.get(), pb);
      record({"gdn_prepare_recurrent M-row==1-row", shp, 0, 0, 0, same,
              same ? "out + state + prepared memcmp equal" : "differs"});
      EXPECT_TRUE(same) << shp;
    }
    {  // undoable (a delta buffer): the same out and prepared values, the state left as it was
      Buf<float> s3(gpu(), st0), o3(gpu(), M * nv), q3(gpu(), M * nqk), k3(gpu(), M * nqk), g3(gpu(), M * Hv),
          b3(gpu(), M * Hv), d3(gpu(), M * nv);
      const Backend::GdnPrepared undo{q3, k3, g3, b3, d3};
      gpu().gdn_prepare_recurrent(raw(xg, ag, bg, dg, sag), s3, o3, &undo, M, s);
      const bool same = bits(o3.get(), out) && bits(s3.get(), st0) && bits(q3.get(), pq) && bits(k3.get(), pk) &&
                        bits(g3.get(), pg) && bits(b3.get(), pb) && s3.guard_ok() && d3.guard_ok();
      record({"gdn_prepare_recurrent undoable", shp, 0, 0, 0, same,
              same ? "out + prepared memcmp equal, state untouched" : "differs"});
      EXPECT_TRUE(same) << shp;
    }
  }
}

TEST(CudaOps, GdnChunked) {
  // CUDA runs the chunked WY kernels (3xTF32 tensor-core products, fp32 accumulation): compared with
  // the CPU chunked form (same algebra) and the CPU recurrence (same math, other rounding), out and
  // state, at 1e-7 NMSE. M covers a lone partial chunk (33), exact chunks (64, 128, 512), a partial
  // last chunk (70, 130) and the backend's 512-row slicing (520); small heads go through the padded
  // (32 / 64) kernels.
  REQUIRE_GPU();
  std::mt19937 rng(33);
  struct Case {
    GdnShape s;
    int64_t M;
  };
  const GdnShape big{16, 48, 128, 128}, tiny{2, 4, 16, 16}, mid{2, 4, 32, 64};
  const Case cases[] = {{big, 33},  {big, 64},  {big, 70},   {big, 128},  {big, 512}, {big, 520},
                        {tiny, 33}, {tiny, 64}, {tiny, 130}, {mid, 100}};
  for (const Case& cs : cases) {
    const GdnShape& s = cs.s;
    const int64_t M = cs.M;
    const GdnInputs in = gdn_inputs(s, M, rng);
    const int64_t no = M * s.n_v_heads * s.head_v;
    Buf<float> qg(gpu(), in.q), kg(gpu(), in.k), vg(gpu(), in.v), gg(gpu(), in.g), bg(gpu(), in.beta),
        sg(gpu(), in.state), og(gpu(), no);
    Buf<float> qc(cpu(), in.q), kc(cpu(), in.k), vc(cpu(), in.v), gc(cpu(), in.g), bc(cpu(), in.beta),
        sc(cpu(), in.state), oc(cpu(), no), sr(cpu(), in.state), orr(cpu(), no);
    gpu().gdn_chunked(qg, kg, vg, gg, bg, sg, og, M, s);
    cpu().gdn_chunked(qc, kc, vc, gc, bc, sc, oc, M, s);
    cpu().gdn_recurrent(qc, kc, vc, gc, bc, sr, sr, orr, nullptr, M, s);
    const std::string shp = shape_str({M, s.n_k_heads, s.n_v_heads, s.head_k, s.head_v});
    const auto o = og.get(), st = sg.get();
    check("gdn_chunked out (vs CPU chunked)", shp, o, oc.get(), 1e-7, og.guard_ok(), "3xTF32 WY kernels");
    check("gdn_chunked state (vs CPU chunked)", shp, st, sc.get(), 1e-7, sg.guard_ok());
    check("gdn_chunked out (vs CPU recurrent)", shp, o, orr.get(), 1e-7);
    check("gdn_chunked state (vs CPU recurrent)", shp, st, sr.get(), 1e-7);
    {  // for the record: how far the two CPU forms are apart (not a check of this backend)
      const Diff d = diff(oc.get(), orr.get());
      record({"cpu gdn_chunked vs cpu gdn_recurrent out (info)", shp, d.nmse, d.max_abs, -1, true, "reference spread"});
    }
    // Chunk boundaries sit at multiples of 64 from the first row, so splitting a call at a multiple of
    // 64 (the state passing through memory between the calls) gives the bits of one call.
    if (M > 64) {
      const int64_t M1 = 64, M2 = M - 64;
      const int64_t qk1 = M1 * s.n_k_heads * s.head_k, v1 = M1 * s.n_v_heads * s.head_v, h1 = M1 * s.n_v_heads;
      Buf<float> s2(gpu(), in.state), o2(gpu(), no);
      gpu().gdn_chunked(qg, kg, vg, gg, bg, s2, o2, M1, s);
      gpu().gdn_chunked(qg.get_ptr() + qk1, kg.get_ptr() + qk1, vg.get_ptr() + v1, gg.get_ptr() + h1,
                        bg.get_ptr() + h1, s2, o2.get_ptr() + v1, M2, s);
      const bool same = o2.get() == o && s2.get() == st;
      record({"gdn_chunked 64 + (M-64) rows == M rows", shp, 0, 0, 0, same, same ? "out + state equal" : "differs"});
      EXPECT_TRUE(same) << shp;
    }
  }
}

// ---- sampling -------------------------------------------------------------------------------------

TEST(CudaOps, ArgmaxTopK) {
  REQUIRE_GPU();
  std::mt19937 rng(41);
  const int64_t M = 7, n = 248320;
  auto x = randn_vec(rng, M * n, 3.0f);
  // ties: row 1 has its max twice, row 2 has many equal values around the top
  const float top = 100.0f;
  x[1 * n + 5000] = top;
  x[1 * n + 200] = top;
  for (int i = 0; i < 40; ++i) x[2 * n + 1000 * i + 7] = 50.0f;
  x[3 * n + n - 1] = top;  // max at the very end
  Buf<float> xg(gpu(), x), xc(cpu(), x);
  Buf<int32_t> ag(gpu(), M), ac(cpu(), M);
  gpu().argmax(xg, ag, M, n);
  cpu().argmax(xc, ac, M, n);
  const bool am = ag.get() == ac.get();
  record({"argmax", shape_str({M, n}), 0, 0, 0, am && ag.guard_ok(), am ? "ids equal" : "ids differ"});
  EXPECT_TRUE(am);
  // top_k: k <= 32 runs the warp-selection path (chunks of 2048 per warp, rounds over the candidates:
  // k = 32 at n = 248320 takes three rounds), k = 64 the bitonic sort. Both must give the CPU's ids and
  // value bits exactly. NaN ranks as -inf and comes back as -inf: the CPU comparator is no strict weak
  // order with NaN, so its reference runs on a copy with NaN replaced by -inf. -0 ties with +0 (lower
  // index first) and keeps its sign, hence the comparison of bits.
  auto bits = [](const std::vector<float>& v) {
    std::vector<uint32_t> b(v.size());
    std::memcpy(b.data(), v.data(), v.size() * sizeof(float));
    return b;
  };
  auto top_k_case = [&](const std::string& what, const std::vector<float>& data, int64_t rows, int64_t len,
                        int64_t k) {
    std::vector<float> ref = data;
    for (float& f : ref)
      if (std::isnan(f)) f = -INFINITY;
    Buf<float> dg(gpu(), data), dc(cpu(), ref);
    Buf<int32_t> ig(gpu(), rows * k), ic(cpu(), rows * k);
    Buf<float> vg(gpu(), rows * k), vc(cpu(), rows * k);
    gpu().top_k(dg, ig, vg, rows, len, k);
    cpu().top_k(dc, ic, vc, rows, len, k);
    const bool same = ig.get() == ic.get() && bits(vg.get()) == bits(vc.get());
    const bool guards = ig.guard_ok() && vg.guard_ok();
    record({fmt::format("top_k {} k={}", what, k), shape_str({rows, len}), 0, 0, 0, same && guards,
            same ? "ids and value bits equal" : "differ"});
    EXPECT_TRUE(same && guards) << what << " k=" << k;
  };
  for (int64_t k : {1, 16, 32, 64}) top_k_case("randn", x, M, n, k);
  {  // few levels (many ties inside and across chunks), -0 / +0, NaN, -inf, rows with < k finite values
    std::vector<float> q(x.size());
    for (int64_t m = 0; m < M; ++m)
      for (int64_t i = 0; i < n; ++i) {
        const float v = x[m * n + i];
        float& o = q[m * n + i];
        if (m < 3) o = std::round(v * 0.5f);                  // ~13 levels, the top one rare
        else if (m < 5) o = std::min(std::round(v * 0.5f), 1.0f);  // a third of the row at the top level
        else if (m == 5) o = std::round(v) > 0 ? -std::round(v) : std::round(v);  // max 0: -0 and +0 mixed
        else o = (i % 3 == 0) ? NAN : -INFINITY;               // NaN and -inf only ...
      }
    q[0] = NAN;                      // NaN at index 0 and among the top level
    q[1 * n + 777] = NAN;
    q[2 * n + 5] = INFINITY;         // +inf first, then the top level
    q[2 * n + n - 1] = INFINITY;
    std::mt19937 r2(43);
    for (int j = 0; j < 10; ++j) q[6 * n + r2() % n] = static_cast<float>(j % 4);  // ... plus 10 finite (ties)
    q[6 * n + 12345] = -0.0f;
    q[6 * n + 12346] = 0.0f;
    for (int64_t k : {1, 16, 32, 64}) top_k_case("levels/nan/-0", q, M, n, k);
  }
  {  // ties that the threshold path sorts (keys >= the k-th lane maximum, <= 64 of them): 20 equal maxima in
     // one chunk (the first round), and 20 in 20 chunks (the second round, one per chunk); equal keys go by
     // lower index
    auto t = randn_vec(rng, 2 * n, 0.1f);
    for (int i = 0; i < 20; ++i) t[4096 + 37 * i] = 5.0f;
    for (int i = 0; i < 20; ++i) t[n + 3 + 12007 * i] = 5.0f;
    for (int64_t k : {1, 16, 20, 32}) top_k_case("ties at the top", t, 2, n, k);
  }
  {  // short rows: one full chunk and a partial one, a chunk of one value, k == n
    auto y = randn_vec(rng, 3 * 3000);
    y[1 * 3000 + 2999] = 50.0f;
    y[2 * 3000 + 2048] = 50.0f;
    y[2 * 3000 + 17] = NAN;
    y[2 * 3000 + 18] = -INFINITY;
    for (int64_t k : {1, 16, 32}) top_k_case("partial chunk", y, 3, 3000, k);
    auto z = randn_vec(rng, 2 * 2049);
    z[2048] = 50.0f;  // the only value of row 0's second chunk is its max
    for (int64_t k : {1, 32}) top_k_case("chunk of one", z, 2, 2049, k);
    top_k_case("n=100", randn_vec(rng, 3 * 100), 3, 100, 20);
    top_k_case("k=n", randn_vec(rng, 2 * 32), 2, 32, 32);
    top_k_case("n=1", randn_vec(rng, 3), 3, 1, 1);
  }
}

// ---- DFlash conv ----------------------------------------------------------------------------------

TEST(CudaOps, DflashConv) {
  REQUIRE_GPU();
  std::mt19937 rng(51);
  const int64_t M = 8, C = 5120, K = 2, group = 16, G = C / group;
  const int64_t d_stride = 2 * K * G;  // conv_proj output [M, 2 stages * K * G]
  const auto x = randn_vec(rng, M * C), base = randn_vec(rng, 2 * K * C, 0.5f), d = randn_vec(rng, M * d_stride, 0.2f),
             res = randn_vec(rng, M * C);
  for (int stage = 0; stage < 2; ++stage)
    for (bool with_res : {false, true}) {
      Buf<float> xg(gpu(), x), bg(gpu(), base), dg(gpu(), d), rg(gpu(), res), yg(gpu(), M * C);
      Buf<float> xc(cpu(), x), bc(cpu(), base), dc(cpu(), d), rc(cpu(), res), yc(cpu(), M * C);
      gpu().dflash_conv(xg, bg.get_ptr() + stage * K * C, dg.get_ptr() + stage * K * G, d_stride,
                        with_res ? rg.get_ptr() : nullptr, yg, M, C, K, group);
      cpu().dflash_conv(xc, bc.get_ptr() + stage * K * C, dc.get_ptr() + stage * K * G, d_stride,
                        with_res ? rc.get_ptr() : nullptr, yc, M, C, K, group);
      check(fmt::format("dflash_conv stage {}{}", stage, with_res ? " +res" : ""),
            shape_str({M, C, K, group}), yg.get(), yc.get(), 1e-11, yg.guard_ok());
    }
}

// Without a residual the conv quantizes its output for the next integer matmul (the drafter's q | k | v and
// gate | up): a Q4_K matmul of y must reuse those records and give the bits of a matmul of a fresh copy
// of y; prefill-sized blocks leave no records. y itself against the CPU. K = 2 (the drafter's) takes the
// kernel with the taps as a compile-time count, K = 3 the run-time loop.
TEST(CudaOps, DflashConvQuantizationFeedsTheMatmul) {
  REQUIRE_GPU();
  std::mt19937 rng(52);
  const int64_t C = 5120, group = 16, G = C / group, N = 256;
  const HostWeight hw = make_weight(GgmlType::Q4_K, C, N, 1700);
  const WeightRef wg = gpu().upload_weight(hw.bytes.data(), hw.type, C, N);
  for (int64_t K : {2, 3}) {
    for (int64_t M : {1, 7, 8, 40}) {
      const int64_t d_stride = 2 * K * G;
      const bool expect_records = M < cuda::kMatmulPrefillMinRows;
      const auto x = randn_vec(rng, M * C), base = randn_vec(rng, K * C, 0.5f), d = randn_vec(rng, M * d_stride, 0.2f);
      Buf<float> xg(gpu(), x), bg(gpu(), base), dg(gpu(), d), yg(gpu(), M * C);
      Buf<float> xc(cpu(), x), bc(cpu(), base), dc(cpu(), d), yc(cpu(), M * C);
      Buf<float> out_conv(gpu(), M * N), out_fresh(gpu(), M * N);  // before the conv: uploads drop the cache
      gpu().dflash_conv(xg, bg, dg, d_stride, nullptr, yg, M, C, K, group);
      cpu().dflash_conv(xc, bc, dc, d_stride, nullptr, yc, M, C, K, group);
      const std::string shp = shape_str({M, C, K, group});
      check("dflash_conv (quantizing)", shp, yg.get(), yc.get(), 1e-11, yg.guard_ok());
      const int64_t reused0 = cuda::quantizations_reused(gpu());
      gpu().matmul(wg, yg, out_conv, M);  // reads the conv's quantization of y
      const bool used_conv = cuda::quantizations_reused(gpu()) == reused0 + 1;
      Buf<float> y2(gpu(), yg.get());
      gpu().matmul(wg, y2, out_fresh, M);  // quantizes y2 itself
      check("dflash_conv -> Q4_K matmul == fresh matmul", shp, out_conv.get(), out_fresh.get(), 0, out_conv.guard_ok());
      const bool as_expected = used_conv == expect_records;
      record({expect_records ? "dflash_conv quantization reused by the matmul" : "prefill-sized conv leaves no records",
              shp, 0, 0, 0, as_expected, used_conv ? "reused" : "quantized again"});
      EXPECT_TRUE(as_expected) << shp;
    }
  }
}

// ---- DFlash 2 selector walk ------------------------------------------------------------------------
// The device walk must pick the CPU's path exactly (the same products and sums in the same order, no
// fma): 27B shape (7 rows x 16 candidates x rank 256), odd shapes, ties (the first candidate wins), NaN.
TEST(CudaOps, SelectorWalk) {
  std::mt19937 rng(123);
  struct Shape {
    int64_t rows, top_k, rank;
  };
  const Shape shapes[] = {{7, 16, 256}, {1, 1, 1}, {3, 5, 33}, {15, 64, 100}, {7, 256, 24}, {2, 16, 1024}};
  int case_no = 0;
  for (const Shape& sh : shapes)
    for (int variant = 0; variant < 3; ++variant, ++case_no) {
      const int64_t rows = sh.rows, K = sh.top_k, R = sh.rank;
      const int64_t np = 1 + (rows - 1) * K;
      auto pred = randn_vec(rng, np * R), succ = randn_vec(rng, rows * K * R), g = randn_vec(rng, rows * R);
      auto unary = randn_vec(rng, rows * K, 3.0f);
      std::vector<int32_t> cand(rows * K);
      for (auto& c : cand) c = static_cast<int32_t>(rng() % 248320);
      if (variant == 1) {  // every candidate of a row scores the same
        std::fill(succ.begin(), succ.end(), 0.25f);
        std::fill(unary.begin(), unary.end(), -1.0f);
      }
      if (variant == 2) unary[rng() % unary.size()] = NAN;
      Buf<float> pg(gpu(), pred), sg(gpu(), succ), gg(gpu(), g), ug(gpu(), unary);
      Buf<float> pc(cpu(), pred), sc(cpu(), succ), gc(cpu(), g), uc(cpu(), unary);
      Buf<int32_t> cg(gpu(), cand), cc(cpu(), cand), og(gpu(), rows), oc(cpu(), rows);
      gpu().selector_walk(pg, sg, cg, ug, gg, og, rows, K, R);
      cpu().selector_walk(pc, sc, cc, uc, gc, oc, rows, K, R);
      const bool same = og.get() == oc.get();
      const bool guards = og.guard_ok();
      record({fmt::format("selector_walk {}", variant == 0 ? "randn" : variant == 1 ? "ties" : "nan"),
              shape_str({rows, K, R}), 0, 0, 0, same && guards, same ? "path equal" : "path differs"});
      EXPECT_TRUE(same && guards) << "case " << case_no;
    }
}


// ---- prefill matmul on the tensor cores -----------------------------------------------------------
//
// matmul_prefill of the ternary types (PQ2_0, PTQ1_0) in the ternary-mma layout (the default;
// DFLASH_CUDA_TERNARY_MMA=0 selects the planar one) runs gemm_prefill.cu for M >= 32: bf16 activations and bf16 scales into wgmma (Hopper) or mma.sync with fp32
// accumulation (the planar-2bit layout falls back to the GEMV tiles: the same checks, GEMV-exact).
// Bound 2e-5 NMSE vs the CPU's fp32 reference: bf16 keeps 8 significant bits, so each of the two
// roundings (activation, block scale) has a relative error <= 2^-8, mean square ~0.36 (2^-8)^2 over
// random mantissas; together ~5.5e-6 (measured on the H200: 5.4e-6 .. 5.9e-6 at every shape here).
// 2e-5 leaves a 3.5x margin while one wrong code, scale, block or row tile moves the NMSE above 1e-3.
// In the ternary-mma layout the result must also NOT be GEMV-exact (NMSE > 1e-9: the tensor-core path
// ran, it did not fall back); every output is written (poisoned buffers: a missed element stays NaN),
// the guard survives, two calls give the same bits (the split-K sum has a fixed order), and M < 32
// gives exactly matmul's result (no tensor-core kernel below 32 rows).
void prefill_case(GgmlType t, int64_t in, int64_t out, const std::vector<int64_t>& Ms, uint32_t seed,
                  bool repeat = false) {
  const HostWeight hw = make_weight(t, in, out, seed);
  const WeightRef wg = gpu().upload_weight(hw.bytes.data(), t, in, out);
  const WeightRef wc = cpu().upload_weight(hw.bytes.data(), t, in, out);
  std::mt19937 rng(seed);
  for (int64_t M : Ms) {
    const auto x = randn_vec(rng, M * in);
    Buf<float> xg(gpu(), x), yg(gpu(), M * out);
    Buf<float> xc(cpu(), x), yc(cpu(), M * out);
    gpu().matmul_prefill(wg, xg, yg, M);
    cpu().matmul(wc, xc, yc, M);
    const auto got = yg.get(), ref = yc.get();
    const std::string op = std::string("matmul_prefill ") + type_name(t), shp = shape_str({M, in, out});
    const Diff d = diff(got, ref);
    if (M < 32) {  // no tensor-core kernel: exactly the GEMV of matmul
      Buf<float> y1(gpu(), M * out);
      gpu().matmul(wg, xg, y1, M);
      check(op + " (M < 32) == matmul", shp, got, y1.get(), 0, yg.guard_ok());
      continue;
    }
    const std::string layout = cuda::weight_layout(gpu(), wg);
    check(op, shp, got, ref, 2e-5, yg.guard_ok(), layout);
    if (layout == "ternary-mma") {  // the layout gemm_prefill.cu covers; planar-2bit falls back to the GEMV
      EXPECT_GT(d.nmse, 1e-9) << op << " " << shp << ": GEMV-exact result, the tensor-core path did not run";
    }
    if (repeat) {
      Buf<float> y2(gpu(), M * out);
      gpu().matmul_prefill(wg, xg, y2, M);
      const bool same = y2.get() == got;
      record({op + " repeat == first call", shp, 0, 0, 0, same, same ? "memcmp equal" : "differs"});
      EXPECT_TRUE(same) << op << " " << shp;
    }
  }
}

// matmul_prefill_group: the weights' row tiles in one tensor-core launch (GDN qkv | z, FFN gate | up at
// the 27B shapes, and a short tail group), each output against the CPU's matmul at matmul_prefill's bound
// (the group may pick another k split than a weight alone: same arithmetic otherwise), every output
// written (poisoned buffers), guards kept, two calls the same bits. A group with a weight the kernel
// does not take (BF16) goes weight by weight: the bits of matmul_prefill of each.
TEST(CudaMatmul, PrefillGroupOneLaunch) {
  REQUIRE_GPU();
  struct G {
    std::vector<std::pair<GgmlType, int64_t>> parts;
    int64_t in, M;
  };
  const G groups[] = {{{{GgmlType::PTQ1_0, 10240}, {GgmlType::PTQ1_0, 6144}}, 5120, 512},
                      {{{GgmlType::PTQ1_0, 17408}, {GgmlType::PTQ1_0, 17408}}, 5120, 100},
                      {{{GgmlType::PQ2_0, 200}, {GgmlType::PQ2_0, 70}, {GgmlType::PQ2_0, 1000}}, 512, 33},
                      {{{GgmlType::PTQ1_0, 96}, {GgmlType::BF16, 48}}, 512, 64}};
  uint32_t seed = 1600;
  for (const G& grp : groups) {
    std::mt19937 rng(seed);
    const auto x = randn_vec(rng, grp.M * grp.in);
    Buf<float> xg(gpu(), x), xc(cpu(), x);
    std::vector<HostWeight> hws;  // alive for the whole case: the CPU backend may read the host bytes in place
    std::vector<WeightRef> wg, wc;
    std::vector<std::unique_ptr<Buf<float>>> yg, y2, y1, yc;
    std::string shp = fmt::format("M={} in={} out=", grp.M, grp.in);
    for (const auto& [t, out] : grp.parts) {
      hws.push_back(make_weight(t, grp.in, out, seed++));
      wg.push_back(gpu().upload_weight(hws.back().bytes.data(), t, grp.in, out));
      wc.push_back(cpu().upload_weight(hws.back().bytes.data(), t, grp.in, out));
      yg.push_back(std::make_unique<Buf<float>>(gpu(), grp.M * out));
      y2.push_back(std::make_unique<Buf<float>>(gpu(), grp.M * out));
      y1.push_back(std::make_unique<Buf<float>>(gpu(), grp.M * out));
      yc.push_back(std::make_unique<Buf<float>>(cpu(), grp.M * out));
      shp += fmt::format("{}{}", out, type_name(t)[0] == 'B' ? "(bf16) " : " ");
    }
    std::vector<Backend::MatmulOut> outs, outs2;
    for (size_t i = 0; i < wg.size(); ++i) {
      outs.push_back({&wg[i], *yg[i]});
      outs2.push_back({&wg[i], *y2[i]});
    }
    gpu().matmul_prefill_group(outs, xg, grp.M);
    gpu().matmul_prefill_group(outs2, xg, grp.M);
    const bool mixed = grp.parts.back().first == GgmlType::BF16;
    for (size_t i = 0; i < wg.size(); ++i) {
      cpu().matmul(wc[i], xc, *yc[i], grp.M);
      const auto got = yg[i]->get();
      const std::string op = fmt::format("matmul_prefill_group part {}", i);
      check(op, shp, got, yc[i]->get(), grp.parts[i].first == GgmlType::BF16 ? 1e-10 : 2e-5, yg[i]->guard_ok());
      const bool same = y2[i]->get() == got;
      record({op + " repeat == first call", shp, 0, 0, 0, same, same ? "memcmp equal" : "differs"});
      EXPECT_TRUE(same) << op << " " << shp;
      if (mixed) {  // weight by weight: matmul_prefill's bits
        gpu().matmul_prefill(wg[i], xg, *y1[i], grp.M);
        check(op + " (mixed group) == matmul_prefill", shp, got, y1[i]->get(), 0, true);
      }
    }
  }
}

// matmul_prefill of small dense weights (F32, F16, BF16 rows with out <= 128: GDN's alpha and beta)
// runs matmul.cu's shared-memory tile kernel at M >= 32: fp32 products and sums in another order than
// the CPU's, so NMSE ~1e-14; bound 1e-10 (a wrong k-tile, row or output is > 1e-3). It must not be the
// GEMV's result bit for bit at the 27B shape (the kernel ran, no silent fallback); every output is
// written (poisoned buffers), guards survive, a second call gives the same bits (the k split adds its
// partial tiles in rank order).
TEST(CudaMatmul, PrefillTensorCores) {
  REQUIRE_GPU();
  uint32_t seed = 900;
  for (GgmlType t : {GgmlType::PQ2_0, GgmlType::PTQ1_0}) {
    // row tails (M = 33, 100), out not a multiple of the 128 / 256-row CTA tile nor of 16 (200, 70),
    // one block (in = 128), k-tiles not filling a split evenly (3200)
    prefill_case(t, 512, 200, {8, 32, 33, 64, 100, 512}, seed++);
    prefill_case(t, 128, 70, {32, 33, 100}, seed++);
    prefill_case(t, 3200, 1000, {33, 64, 100, 512}, seed++, true);
  }
  // the 27B shapes (in x out)
  struct S {
    int64_t in, out;
  };
  const S shapes[] = {{5120, 10240}, {5120, 6144}, {5120, 17408}, {17408, 5120},
                      {6144, 5120},  {5120, 12288}, {5120, 1024}, {5120, 48}};
  for (const S& s : shapes) prefill_case(GgmlType::PTQ1_0, s.in, s.out, {64}, seed++, s.in == 17408);
  prefill_case(GgmlType::PQ2_0, 17408, 5120, {100}, seed++);
  prefill_case(GgmlType::PQ2_0, 5120, 6144, {512}, seed++, true);
  prefill_case(GgmlType::PTQ1_0, 5120, 1024, {512}, seed++);
}

// ---- prefill attention -----------------------------------------------------------------------------
// attention_prefill (attention_prefill.cu): tf32 tensor-core flash attention for prefill chunks, not
// lossless. Bound 1e-6 NMSE against the CPU's attention(): q, k, p and v are rounded to tf32 (unit
// roundoff 2^-11, ~2e-4 RMS relative per input, products and sums in fp32), so at unit-variance scores
// each score is off by ~3e-4 absolute (a relative error of each p) and each p v product by ~3e-4
// relative: NMSE ~ 2 x (3e-4)^2 ~ 2e-7 (a host emulation of the kernel's fragments measured 0.8e-7 ..
// 1.6e-7); 1e-6 leaves 5x for the tensor cores' own accumulation rounding. A silent fallback to
// attention() would pass that bound too, so the result must also differ from attention()'s bits where
// the kernel applies (head dims 64, 128, 256; M >= 16) and equal them where it does not (fallback).
std::vector<int32_t> causal_ranges(int64_t M, int64_t n_keys, int32_t lo = 0) {
  std::vector<int32_t> r;
  for (int64_t m = 0; m < M; ++m) r.insert(r.end(), {lo, static_cast<int32_t>(n_keys - M + m + 1)});
  return r;
}

void attention_prefill_case(int64_t M, int64_t H, int64_t Hkv, int64_t D, int64_t n_keys,
                            const std::vector<int32_t>& ranges, uint32_t seed, const std::string& what,
                            bool kernel = true) {
  std::mt19937 rng(seed);
  const auto q = randn_vec(rng, M * H * D), k = randn_vec(rng, n_keys * Hkv * D), v = randn_vec(rng, n_keys * Hkv * D);
  Buf<float> qg(gpu(), q), kg(gpu(), k), vg(gpu(), v), og(gpu(), M * H * D), oa(gpu(), M * H * D);
  Buf<float> qc(cpu(), q), kc(cpu(), k), vc(cpu(), v), oc(cpu(), M * H * D);
  Buf<int32_t> rg(gpu(), ranges), rc(cpu(), ranges);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  gpu().attention_prefill(qg, kg, vg, rg, og, M, H, Hkv, D, scale);
  cpu().attention(qc, kc, vc, rc, oc, M, H, Hkv, D, scale);
  const std::string shp = shape_str({M, H, Hkv, D, n_keys});
  const auto got = og.get();
  check(fmt::format("attention_prefill {}", what), shp, got, oc.get(), 1e-6, og.guard_ok());
  gpu().attention(qg, kg, vg, rg, oa, M, H, Hkv, D, scale);
  const bool same = std::memcmp(got.data(), oa.get().data(), got.size() * 4) == 0;
  const bool ok = kernel ? !same : same;
  record({fmt::format("attention_prefill {} {}", kernel ? "kernel ran" : "falls back", what), shp, 0, 0, -1, ok,
          same ? "bits equal attention()" : "bits differ from attention()"});
  EXPECT_TRUE(ok) << what << (kernel ? ": the tensor-core kernel did not run" : ": the fallback differs");
}

TEST(CudaOps, AttentionPrefill) {
  REQUIRE_GPU();
  // 27B shape (24 query heads, 4 KV heads, head_dim 256): chunks at the end of the cache, causal;
  // 512 keys = a chunk from an empty cache (M = 512), 1500 = a later chunk. M = 100: a 64-row tile
  // half full (rows past M neither read nor written: guard).
  uint32_t seed = 950;
  for (int64_t keys : {512, 1500})
    for (int64_t M : {32, 100, 512})
      attention_prefill_case(M, 24, 4, 256, keys, causal_ranges(M, keys), seed++,
                             fmt::format("27B causal M={} keys={}", M, keys));
  // ranges starting above 0 (a tile-aligned and a mid-tile start: keys before lo never read)
  attention_prefill_case(100, 24, 4, 256, 700, causal_ranges(100, 700, 320), seed++, "27B lo=320");
  attention_prefill_case(70, 24, 4, 256, 700, causal_ranges(70, 700, 301), seed++, "27B lo=301");
  // mixed rows: empty, one key, mid-tile, a key range far from the others (the CTA's key union has
  // keys no row reads), a whole warp (rows 48..63) empty, then causal rows in the second 64-row tile
  {
    std::vector<int32_t> r = causal_ranges(80, 600);
    const int32_t odd[] = {5, 37, 0, 0, 599, 600, 40, 41, 0, 1, 31, 33, 200, 233, 550, 551};
    std::copy(std::begin(odd), std::end(odd), r.begin());
    for (int m = 48; m < 64; ++m) r[2 * m] = r[2 * m + 1] = 20;
    attention_prefill_case(80, 24, 4, 256, 600, r, seed++, "27B mixed ranges");
  }
  // qwen3-like shapes: the tiny test models (4 / 2 heads x 64) and 32 / 8 heads x 128
  attention_prefill_case(40, 4, 2, 64, 100, causal_ranges(40, 100), seed++, "head_dim 64");
  attention_prefill_case(200, 4, 2, 64, 200, causal_ranges(200, 200), seed++, "head_dim 64 from empty");
  attention_prefill_case(64, 32, 8, 128, 300, causal_ranges(64, 300), seed++, "head_dim 128");
  // no kernel: head_dim 80, or M below kAttentionPrefillMinRows -> attention(), same bits
  attention_prefill_case(40, 4, 2, 80, 100, causal_ranges(40, 100), seed++, "head_dim 80", false);
  attention_prefill_case(8, 24, 4, 256, 300, causal_ranges(8, 300), seed++, "M=8", false);
}

}  // namespace
}  // namespace dflash::cudatest
