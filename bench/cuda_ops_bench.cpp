// bench_cuda_ops: CUDA backend throughput against the measured streaming-read floor.
//
//   bench_cuda_ops [--quick] [--model FILE.gguf [--model-only] [--tokens N]] [--gdn] [--prefill] [--attn-prefill]
//                  [--attention [--keys N] [--case decode|verify|drafter]] [--boundary] [--persistent] [--matmul TYPE[:SHAPE] [--warm-l2] [--rows N]] [--out FILE.md]
//
// --matmul runs section 2 alone for one type (and shape, e.g. ptq1_0:attn_qkv: a target for ncu; or shapes of
// one's own, ptq1_0:5120x33792,5120x34816: launch sizes either side of a wave boundary);
// --warm-l2 then times one copy of the matrix, served from L2 when it fits (latency vs bandwidth).
//
// 1. The floor: a 16-byte-load read kernel over 2 GiB, median of 20 runs (GB/s = 1e9 B/s).
// 2. matmul at the 27B shapes (SPEC 2.3) for PTQ1_0, PQ2_0, Q4_K, Q6_K, BF16 (and F16, Q8_0) at M = 1
//    and M = 8: the time of one call inside a CUDA graph of >= 8 back-to-back calls (as in a decode graph); GB/s counts the weight bytes of the FILE format once per call (the bytes
//    a decode step must read), % of floor = that / floor; "dev GB/s" counts the device layout (PTQ1_0
//    is transcoded to 2-bit codes, 21 % more bytes). Each timing rotates over enough copies of the
//    matrix (>= 256 MB) that L2 (50 MB) cannot serve repeats. M8/M1 = cost ratio of a verify block;
//    --rows N times N rows instead of 8 (the drafter's lm_head runs 7).
// 3. Other decode-step ops at 27B shapes (times only); the attention rows alone with --attention (--keys N:
//    one context length only, --case decode|verify|drafter one row, e.g. to profile its launches with ncu).
// 4. With --model: whole-model decode tok/s (1-row forwards, logits of the last row + argmax) and
//    8-row verify forwards, against the floor (bytes the step reads / floor).
// 5. Prefill GDN (bench_gdn_prefill, also alone with --gdn): gdn_chunked (WY kernels) against the
//    sequential recurrence at the 27B shape for M = 64..512, and tok/s of 48 GDN layers alone.
// 6. Prefill matmul (bench_matmul_prefill, also alone with --prefill): matmul_prefill at the 27B
//    shapes for M = 64..512 in us and TFLOP/s, against the GEMV fallback.
// 8. Kernel boundaries (--boundary, alone): what one dependent kernel costs inside a CUDA graph, per
//    link of a 600-kernel chain whose kernels each read the whole previous output, for three ways of
//    waiting (stream order, programmatic dependent launch, arrival counters in global memory) and three
//    grid patterns (132 CTAs, 5 CTAs like the residual norm chain, a decode-like mix). The floor under
//    the one-kernel-per-op design: a step of ~670 kernels cannot take less than ~670 of these.
// 9. Persistent streaming (--persistent, alone): the byte ranges of a 27B decode step (weights, state) read
//    in order with a grid-wide hand-off between consecutive ranges, (a) one kernel per range in a PDL graph
//    (bare reads: the kernel-per-op design with ideal matmuls) and (b) one persistent kernel whose CTAs
//    hand off through arrival counters and copy the head of their next range into shared memory before
//    they wait. What a one-kernel decode step could stream against the floor, before any arithmetic.
// 7. Prefill attention (bench_attention_prefill, also alone with --attn-prefill, and with --prefill):
//    attention_prefill at the 27B shape (24 / 4 heads x 256, causal, M rows at the end of the cache)
//    against attention() (the decode / verify kernel prefill used before).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gguf/gguf.h"
#include "models/dflash_drafter.h"
#include "models/synth.h"
#include "models/target.h"
#include "ops/cuda/cuda_backend.h"
#include "quant/types.h"
#include "step_timeline.h"
#include "util/error.h"

using namespace dflash;

namespace {

std::vector<uint8_t> make_weight(GgmlType t, int64_t in, int64_t out, uint32_t seed) {
  const size_t rb = row_bytes(t, in);
  std::vector<uint8_t> bytes(rb * out);
  const int nt = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  std::vector<std::thread> th;
  for (int k = 0; k < nt; ++k)
    th.emplace_back([&, k] {
      std::vector<float> row(in);
      std::mt19937 rng(seed * 7919u + k);
      std::normal_distribution<float> d(0.0f, 1.0f);
      for (int64_t o = k; o < out; o += nt) {
        for (auto& v : row) v = d(rng);
        quantize_row(t, row.data(), bytes.data() + rb * o, in);
      }
    });
  for (auto& x : th) x.join();
  return bytes;
}

struct Out {
  std::string md;
  void line(const std::string& s) {
    fmt::print("{}\n", s);
    std::fflush(stdout);
    md += s + "\n";
  }
};

// Prefill GDN at the 27B shape (16 K heads, 48 V heads, 128 x 128 state per head): the chunked WY
// kernels against the recurrence (what gdn_chunked ran before), median of 20 calls each. The state
// evolves across calls (the delta rule with unit keys, beta < 1 and decay <= 1 keeps it bounded).
// "GDN-only tok/s" = M / (48 layers x the chunked time): the prefill ceiling if GDN were all there is.
void bench_gdn_prefill(Backend& be, Out& out) {
  const GdnShape s{16, 48, 128, 128};
  constexpr int64_t kMaxM = 512, kLayers = 48;
  std::mt19937 rng(77);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ug(-0.3f, -0.01f), ub(0.05f, 0.95f);
  auto upload = [&](const std::vector<float>& h) {
    float* d = static_cast<float*>(be.alloc(h.size() * 4));
    be.upload(d, h.data(), h.size() * 4);
    return d;
  };
  auto unit_rows = [&](int64_t rows, int64_t n, float scale) {  // l2-normed rows, like the model's q and k
    std::vector<float> h(rows * n);
    for (int64_t r = 0; r < rows; ++r) {
      double ss = 0;
      for (int64_t i = 0; i < n; ++i) {
        h[r * n + i] = nd(rng);
        ss += double(h[r * n + i]) * h[r * n + i];
      }
      for (int64_t i = 0; i < n; ++i) h[r * n + i] = static_cast<float>(h[r * n + i] / std::sqrt(ss) * scale);
    }
    return h;
  };
  auto fill = [&](size_t n, auto& dist) {
    std::vector<float> h(n);
    for (auto& x : h) x = dist(rng);
    return h;
  };
  float* q = upload(unit_rows(kMaxM * s.n_k_heads, s.head_k, 1.0f / std::sqrt(128.0f)));
  float* k = upload(unit_rows(kMaxM * s.n_k_heads, s.head_k, 1.0f));
  float* v = upload(fill(kMaxM * s.n_v_heads * s.head_v, nd));
  float* g = upload(fill(kMaxM * s.n_v_heads, ug));
  float* b = upload(fill(kMaxM * s.n_v_heads, ub));
  std::vector<float> st_h = fill(s.n_v_heads * s.head_k * s.head_v, nd);
  for (auto& x : st_h) x *= 0.1f;
  float* st = upload(st_h);
  float* o = static_cast<float*>(be.alloc(kMaxM * s.n_v_heads * s.head_v * 4));
  out.line("| GDN prefill, 27B shape (48 V heads, 128x128) | M | recurrence us | chunked us | speed-up | "
           "chunked x 48 layers ms | GDN-only tok/s (48 layers) |");
  out.line("|---|---|---|---|---|---|---|");
  for (int64_t M : {64, 128, 256, 512}) {
    const double rec = 1e3 * cuda::time_ms(be, 3, 20, [&] { be.gdn_recurrent(q, k, v, g, b, st, st, o, nullptr, M, s); });
    const double chk = 1e3 * cuda::time_ms(be, 3, 20, [&] { be.gdn_chunked(q, k, v, g, b, st, o, M, s); });
    out.line(fmt::format("| gdn_chunked vs gdn_recurrent | {} | {:.1f} | {:.1f} | {:.1f}x | {:.2f} | {:.0f} |", M, rec,
                         chk, rec / chk, kLayers * chk * 1e-3, M / (kLayers * chk * 1e-6)));
  }
  out.line("");
  for (float* p : {q, k, v, g, b, st, o}) be.release(p);
}


// Prefill matmul (bench_matmul_prefill, also alone with --prefill): matmul_prefill (gemm_prefill.cu, bf16
// wgmma on Hopper, mma.sync elsewhere) of PTQ1_0 at the 27B shapes for M = 64..512, median of 20 calls on
// one weight (compute bound: a ternary matrix is <= 23 MB and may stay in L2, which changes little here),
// TFLOP/s = 2 M in out / time, against the H200's ~790 TFLOP/s dense bf16 and against matmul (the GEMV
// tiles the prefill path falls back to) at M = 64 and 512.
void bench_matmul_prefill(Backend& be, Out& out) {
  struct Shape {
    const char* name;
    int64_t in, out;
  };
  const Shape shapes[] = {{"attn_qkv", 5120, 10240}, {"attn_q", 5120, 12288}, {"ssm_in", 5120, 6144},
                          {"ffn_up", 5120, 17408},   {"ffn_down", 17408, 5120}, {"ssm_out", 6144, 5120},
                          {"attn_kv", 5120, 1024},   {"ssm_ab", 5120, 48}};
  constexpr int64_t kMaxM = 512;
  constexpr double kPeakTflops = 790.0;
  {
    const std::vector<uint8_t> h = make_weight(GgmlType::PTQ1_0, 128, 16, 1);
    const WeightRef w = be.upload_weight(h.data(), GgmlType::PTQ1_0, 128, 16);
    out.line(fmt::format("prefill matmul, ternary layout {} (gemm_prefill.cu covers ternary-mma, the default; "
                         "DFLASH_CUDA_TERNARY_MMA=0 selects planar-2bit, which falls back to the GEMV)",
                         cuda::weight_layout(be, w)));
  }
  out.line("| prefill matmul PTQ1_0 | in x out | M | matmul_prefill us | TFLOP/s | % of 790 | GEMV us | speed-up |");
  out.line("|---|---|---|---|---|---|---|---|");
  std::mt19937 rng(91);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  uint32_t seed = 300;
  double total_us[2] = {0, 0};
  for (const Shape& s : shapes) {
    const std::vector<uint8_t> host = make_weight(GgmlType::PTQ1_0, s.in, s.out, seed++);
    const WeightRef w = be.upload_weight(host.data(), GgmlType::PTQ1_0, s.in, s.out);
    std::vector<float> xh(kMaxM * s.in);
    for (auto& v : xh) v = nd(rng);
    float* x = static_cast<float*>(be.alloc(xh.size() * 4));
    be.upload(x, xh.data(), xh.size() * 4);
    float* y = static_cast<float*>(be.alloc(kMaxM * s.out * 4));
    for (int64_t M : {64, 128, 256, 512}) {
      const double us = 1e3 * cuda::time_ms(be, 3, 20, [&] { be.matmul_prefill(w, x, y, M); });
      const double tflops = 2.0 * M * s.in * s.out / (us * 1e-6) / 1e12;
      std::string gemv = "-", speed = "-";
      if (M == 64 || M == 512) {
        const double g = 1e3 * cuda::time_ms(be, 1, 5, [&] { be.matmul(w, x, y, M); });
        gemv = fmt::format("{:.1f}", g);
        speed = fmt::format("{:.1f}x", g / us);
        total_us[M == 64 ? 0 : 1] += us;
      }
      out.line(fmt::format("| {} | {}x{} | {} | {:.1f} | {:.0f} | {:.0f}% | {} | {} |", s.name, s.in, s.out, M, us,
                           tflops, 100.0 * tflops / kPeakTflops, gemv, speed));
    }
    be.release(x);
    be.release(y);
  }
  out.line(fmt::format("sum of the 8 shapes: M=64 {:.1f} us, M=512 {:.1f} us", total_us[0], total_us[1]));
  out.line("");
}

// Section 3's table: an op's time as one launch (events) and per call inside a graph of 20.
void op_table_header(Out& out) {
  out.line("| op | shape | us (one launch, events) | us (in a graph of 20) |");
  out.line("|---|---|---|---|");
}
void op_table_row(Backend& be, Out& out, const std::string& op, const std::string& shape,
                  const std::function<void()>& fn) {
  out.line(fmt::format("| {} | {} | {:.1f} | {:.1f} |", op, shape, 1e3 * cuda::time_ms(be, 3, 50, fn),
                       1e3 * cuda::time_graph_ms(be, 20, 10, fn)));
}
// n normal floats (times scale) in new device memory.
float* dev_randn(Backend& be, std::mt19937& rng, size_t n, float scale = 1.0f) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> h(n);
  for (auto& v : h) v = nd(rng) * scale;
  float* d = static_cast<float*>(be.alloc(n * 4));
  be.upload(d, h.data(), n * 4);
  return d;
}

// The context lengths of the decode / verify attention table (--keys picks one).
constexpr int64_t kAttentionKeys[] = {100, 576, 1024, 4096, 32768};

// Decode / verify attention (Backend::attention) at the 27B shape and the 27B drafter's block: M = 1
// and M = 8 causal rows at the end of the cache, from short to long contexts. Rows of section 3's table
// (also alone with --attention).
void bench_attention_decode(Backend& be, Out& out, int64_t only_keys = 0, const std::string& only_case = "") {
  std::mt19937 rng(5);
  auto dev_rand = [&](size_t n, float scale = 1.0f) { return dev_randn(be, rng, n, scale); };
  // (case: decode, verify or drafter; --case keeps one, so that ncu's matching launches are its own)
  auto row = [&](const std::string& c, const std::string& shape, const std::function<void()>& fn) {
    if (only_case.empty() || only_case == c) op_table_row(be, out, "attention", shape, fn);
  };
  for (int64_t keys : kAttentionKeys) {
    if (only_keys > 0 && keys != only_keys) continue;
    float* kc = dev_rand(keys * 4 * 256);
    float* vc = dev_rand(keys * 4 * 256);
    float* q = dev_rand(8 * 24 * 256, 0.06f);
    float* o = dev_rand(8 * 24 * 256);
    int32_t* rng_d = static_cast<int32_t*>(be.alloc(16 * 4));
    std::vector<int32_t> hr;
    for (int m = 0; m < 8; ++m) hr.insert(hr.end(), {0, static_cast<int32_t>(keys - 8 + m + 1)});
    be.upload(rng_d, hr.data(), hr.size() * 4);
    row("decode", fmt::format("M=1, 24/4 heads x 256, {} keys", keys),
        [&] { be.attention(q, kc, vc, rng_d + 14, o, 1, 24, 4, 256, 0.0625f); });
    row("verify", fmt::format("M=8, {} keys", keys),
        [&] { be.attention(q, kc, vc, rng_d, o, 8, 24, 4, 256, 0.0625f); });
    // the 27B drafter's block: 8 rows over the whole context, 32 / 8 heads x 128 (same cache bytes)
    std::vector<int32_t> hd(16);
    for (int m = 0; m < 8; ++m) hd[2 * m] = 0, hd[2 * m + 1] = static_cast<int32_t>(keys);
    int32_t* rng_dr = static_cast<int32_t*>(be.alloc(16 * 4));
    be.upload(rng_dr, hd.data(), hd.size() * 4);
    row("drafter", fmt::format("M=8 drafter 32/8 heads x 128, {} keys", keys),
        [&] { be.attention(q, kc, vc, rng_dr, o, 8, 32, 8, 128, 0.0884f); });
    be.release(rng_dr);
    for (float* p : {kc, vc, q, o}) be.release(p);
    be.release(rng_d);
  }
}

// Prefill attention at the 27B shape: attention_prefill (attention_prefill.cu, tf32 mma) against attention()
// for M causal rows at the end of a cache of `keys` keys, median of 20 calls (10 for attention()).
// TFLOP/s counts the causal work only: 4 D H sum over rows of (keys seen).
void bench_attention_prefill(Backend& be, Out& out) {
  constexpr int64_t H = 24, Hkv = 4, D = 256;
  out.line("| prefill attention 27B (24/4 heads x 256) | M | keys | attention_prefill us | TFLOP/s | attention us | speed-up |");
  out.line("|---|---|---|---|---|---|---|");
  std::mt19937 rng(93);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto dev = [&](size_t n) {
    std::vector<float> h(n);
    for (auto& v : h) v = nd(rng);
    float* p = static_cast<float*>(be.alloc(n * 4));
    be.upload(p, h.data(), n * 4);
    return p;
  };
  for (auto [M, keys] : {std::pair<int64_t, int64_t>{512, 512}, {128, 512}, {512, 1536}, {512, 4096}}) {
    float* q = dev(M * H * D);
    float* k = dev(keys * Hkv * D);
    float* v = dev(keys * Hkv * D);
    float* o = static_cast<float*>(be.alloc(M * H * D * 4));
    std::vector<int32_t> hr;
    double work = 0;
    for (int64_t m = 0; m < M; ++m) {
      hr.insert(hr.end(), {0, static_cast<int32_t>(keys - M + m + 1)});
      work += static_cast<double>(keys - M + m + 1);
    }
    int32_t* r = static_cast<int32_t*>(be.alloc(hr.size() * 4));
    be.upload(r, hr.data(), hr.size() * 4);
    const float scale = 1.0f / 16.0f;
    const double us = 1e3 * cuda::time_ms(be, 3, 20, [&] { be.attention_prefill(q, k, v, r, o, M, H, Hkv, D, scale); });
    const double old_us = 1e3 * cuda::time_ms(be, 1, 10, [&] { be.attention(q, k, v, r, o, M, H, Hkv, D, scale); });
    const double tflops = 4.0 * D * H * work / (us * 1e-6) / 1e12;
    out.line(fmt::format("| attention_prefill | {} | {} | {:.1f} | {:.1f} | {:.1f} | {:.1f}x |", M, keys, us, tflops,
                         old_us, old_us / us));
    for (float* p : {q, k, v, o}) be.release(p);
    be.release(r);
  }
  out.line("");
}

}  // namespace

// Section 9: the byte ranges a 27B PTQ1_0 decode step reads, in order (the device layout: 2-bit codes and an
// fp16 scale per 128 weights; alpha | beta in BF16; the GDN state), with today's dependent steps between
// them (0-byte ops: norms, the conv, attention, SwiGLU, ...: ~660 in all), or only one hand-off per
// weight read (`with_steps` false: every norm and nonlinearity fused into a neighbour).
std::vector<size_t> decode_step_ops(bool with_steps) {
  const SynthTargetSpec c = SynthTargetSpec::bonsai_27b(GgmlType::PTQ1_0);
  const auto ternary = cuda::ternary_device_bytes;
  std::vector<size_t> ops;
  const auto step = [&](size_t bytes) {
    if (bytes > 0 || with_steps) ops.push_back(bytes);
  };
  const int64_t E = c.n_embd, q_width = c.n_head * c.head_dim, kv_width = c.n_head_kv * c.head_dim;
  const int64_t inner = c.ssm_v_heads * c.ssm_head_v, conv = 2 * c.ssm_k_heads * c.ssm_head_k + inner;
  for (int64_t il = 0; il < c.n_layer; ++il) {
    step(0);  // the residual norm
    if ((il + 1) % c.full_attn_interval == 0) {
      step(ternary(E, 2 * q_width) + 2 * ternary(E, kv_width));  // q (with its gate) | k | v
      for (int k = 0; k < 4; ++k) step(0);                         // prep, segments, merge, gate
      step(ternary(q_width, E));                                   // wo
    } else {
      step(ternary(E, conv) + ternary(E, inner));                          // qkv | z
      step(static_cast<size_t>(2 * c.ssm_v_heads * E * 2));                // alpha | beta (BF16), beside the conv
      step(static_cast<size_t>(c.ssm_v_heads * c.ssm_head_k * c.ssm_head_v * 4));  // the recurrence's state
      step(0);                                                             // gated norm
      step(ternary(inner, E));                                             // ssm_out
    }
    step(0);                                                     // the residual norm
    step(ternary(E, c.n_ff) * 2);                                // gate | up
    step(0);                                                     // SwiGLU
    step(ternary(c.n_ff, E));                                    // down
  }
  step(0);                            // the output norm
  step(ternary(E, c.n_vocab));        // lm_head
  step(0);                            // argmax
  return ops;
}

void bench_persistent(Backend& be, Out& out) {
  const double floor_gbps = cuda::read_bandwidth_gbps(be, size_t(2) << 30, 20);
  out.line(fmt::format("streaming-read floor (16-byte loads, 2 GiB, median of 20): {:.0f} GB/s", floor_gbps));
  out.line("");
  out.line("| schedule | ops | hand-offs between weight reads | GB | ms | GB/s | % of floor |");
  out.line("|---|---:|---|---:|---:|---:|---:|");
  constexpr int kIters = 10;
  {  // the calibration: every byte as one range, no hand-off
    const std::vector<size_t> all = decode_step_ops(false);
    double bytes = 0;
    for (size_t b : all) bytes += static_cast<double>(b);
    const std::vector<size_t> one{static_cast<size_t>(bytes) / 16 * 16};
    int ctas = 0;
    const double ms = cuda::persistent_stream_ms(be, one, 4, 0, false, kIters, &ctas);
    const double gbs = bytes / (ms * 1e-3) / 1e9;
    out.line(fmt::format("| persistent, {} CTAs, the same bytes as one range | 1 | none | {:.2f} | {:.3f} | {:.0f} | {:.1f} |",
                         ctas, bytes / 1e9, ms, gbs, 100.0 * gbs / floor_gbps));
  }
  for (const bool with_steps : {true, false}) {
    const std::vector<size_t> ops = decode_step_ops(with_steps);
    double bytes = 0;
    for (size_t b : ops) bytes += static_cast<double>(b);
    const char* steps = with_steps ? "today's dependent steps" : "one per weight read";
    const auto row = [&](const std::string& name, double ms) {
      if (ms <= 0) {
        out.line(fmt::format("| {} | {} | {} | {:.2f} | (does not fit) | | |", name, ops.size(), steps, bytes / 1e9));
        return;
      }
      const double gbs = bytes / (ms * 1e-3) / 1e9;
      out.line(fmt::format("| {} | {} | {} | {:.2f} | {:.3f} | {:.0f} | {:.1f} |", name, ops.size(), steps,
                           bytes / 1e9, ms, gbs, 100.0 * gbs / floor_gbps));
    };
    row("kernel per op (PDL graph, bare reads)", cuda::op_chain_stream_ms(be, ops, kIters));
    struct Cfg {
      int per_sm, head_kb;
    };
    for (const Cfg cfg : {Cfg{4, 0}, Cfg{4, 16}, Cfg{4, 48}, Cfg{2, 96}, Cfg{1, 200}})
      for (const bool release : {false, true}) {
        int ctas = 0;
        const double ms = cuda::persistent_stream_ms(be, ops, cfg.per_sm, cfg.head_kb * 1024, release, kIters, &ctas);
        row(fmt::format("persistent, {} CTAs ({} per SM), {} KB head per CTA, {}", ctas, cfg.per_sm, cfg.head_kb,
                        release ? "red.release add" : "fence + atomicAdd"),
            ms);
      }
  }
}

// Section 8: microseconds per kernel of a 600-kernel dependent chain in one graph (median of 20 replays).
void bench_boundary(Backend& be, Out& out) {
  struct Pattern {
    const char* name;
    std::vector<int> ctas;
  };
  const std::vector<Pattern> patterns = {{"132 CTAs each", {132}},
                                         {"5 CTAs each (the residual norm chain's grid)", {5}},
                                         {"5, 264, 5, 48 CTAs in turn (a decode-like mix)", {5, 264, 5, 48}}};
  constexpr int kLinks = 600, kIters = 20;
  out.line("| grids | stream order us | PDL us | PDL + arrival counters us |");
  out.line("|---|---:|---:|---:|");
  for (const Pattern& p : patterns) {
    double us[3];
    for (int sync = 0; sync < 3; ++sync) us[sync] = cuda::kernel_boundary_us(be, sync, p.ctas, kLinks, kIters);
    out.line(fmt::format("| {} | {:.2f} | {:.2f} | {:.2f} |", p.name, us[0], us[1], us[2]));
  }
}

int main(int argc, char** argv) {
  bool quick = false, model_only = false, gdn_only = false, prefill_only = false, attn_prefill_only = false,
       attn_only = false, boundary_only = false, persistent_only = false;
  std::string model_path, drafter_path, out_path, only_type, only_shape;  // --matmul TYPE[:SHAPE]: that matmul alone
  bool warm_l2 = false;  // --warm-l2: one copy of the matrix (served from L2 when it fits): the L2 bound
  int n_tokens = 64;
  int wide_rows = 8;  // --rows N: the matmul table's second row count (the drafter's lm_head has 7)
  int64_t only_keys = 0;  // --keys N: the attention table at that context length only (100 .. 32768)
  std::string only_case;  // --case decode|verify|drafter: that row of the attention table only
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") quick = true;
    else if (a == "--warm-l2") warm_l2 = true;
    else if (a == "--model-only") model_only = true;
    else if (a == "--gdn") gdn_only = true;
    else if (a == "--prefill") prefill_only = true;
    else if (a == "--attn-prefill") attn_prefill_only = true;
    else if (a == "--attention") attn_only = true;
    else if (a == "--boundary") boundary_only = true;
    else if (a == "--persistent") persistent_only = true;
    else if (a == "--model" && i + 1 < argc) model_path = argv[++i];
    else if (a == "--drafter" && i + 1 < argc) drafter_path = argv[++i];
    else if (a == "--out" && i + 1 < argc) out_path = argv[++i];
    else if (a == "--tokens" && i + 1 < argc) n_tokens = std::atoi(argv[++i]);
    else if (a == "--rows" && i + 1 < argc) wide_rows = std::clamp(std::atoi(argv[++i]), 2, 8);
    else if (a == "--keys" && i + 1 < argc) only_keys = std::atoll(argv[++i]);
    else if (a == "--case" && i + 1 < argc) only_case = argv[++i];
    else if (a == "--matmul" && i + 1 < argc) {
      const std::string v = argv[++i];
      const size_t colon = v.find(':');
      only_type = v.substr(0, colon);
      if (colon != std::string::npos) only_shape = v.substr(colon + 1);
    } else if (a == "--keys") {  // without a value
      only_keys = -1;
    } else {
      fmt::print(stderr,
                 "usage: bench_cuda_ops [--quick] [--model FILE [--drafter FILE] [--model-only]] [--tokens N] [--gdn] [--prefill] [--attn-prefill] [--attention [--keys N] [--case decode|verify|drafter]] [--boundary] [--persistent] [--matmul TYPE[:SHAPE|:INxOUT,...] [--warm-l2] [--rows N]] [--out FILE.md]\n");
      return 2;
    }
  }
  if (!only_case.empty() && only_case != "decode" && only_case != "verify" && only_case != "drafter") {
    fmt::print(stderr, "bench_cuda_ops: --case takes decode, verify or drafter (got '{}')\n", only_case);
    return 2;
  }
  if (only_keys != 0 && std::find(std::begin(kAttentionKeys), std::end(kAttentionKeys), only_keys) ==
                             std::end(kAttentionKeys)) {
    fmt::print(stderr, "bench_cuda_ops: --keys takes one of the table's context lengths: {}\n",
               fmt::join(kAttentionKeys, ", "));
    return 2;
  }
  try {
    if (cuda_device_count() == 0) {
      fmt::print(stderr, "bench_cuda_ops: no CUDA device\n");
      return 1;
    }
    Out out;
    auto be = make_cuda_backend(0);
    out.line(fmt::format("device: {}", cuda_device_description(0)));
    if (attn_only) {  // the decode / verify attention rows of section 3 alone
      op_table_header(out);
      bench_attention_decode(*be, out, only_keys, only_case);
      if (!out_path.empty()) std::ofstream(out_path) << out.md;
      return 0;
    }
    if (boundary_only) {  // section 8
      bench_boundary(*be, out);
      if (!out_path.empty()) std::ofstream(out_path) << out.md;
      return 0;
    }
    if (persistent_only) {  // section 9
      bench_persistent(*be, out);
      if (!out_path.empty()) std::ofstream(out_path) << out.md;
      return 0;
    }
    if (attn_prefill_only) {  // section 7 alone
      bench_attention_prefill(*be, out);
      if (!out_path.empty()) std::ofstream(out_path) << out.md;
      return 0;
    }
    if (prefill_only) {  // sections 6 and 7 alone
      bench_matmul_prefill(*be, out);
      bench_attention_prefill(*be, out);
      if (!out_path.empty()) std::ofstream(out_path) << out.md;
      return 0;
    }
    if (gdn_only) {  // section 5 alone
      bench_gdn_prefill(*be, out);
      if (!out_path.empty()) std::ofstream(out_path) << out.md;
      return 0;
    }
    const double floor_gbps = cuda::read_bandwidth_gbps(*be, size_t(2) << 30, 20);
    out.line(fmt::format("streaming-read floor (16-byte loads, 2 GiB, median of 20): {:.0f} GB/s", floor_gbps));
    out.line("");

    // ---- matmul
    struct Shape {
      const char* name;
      int64_t in, out;
    };
    std::vector<Shape> shapes = {{"attn_qkv", 5120, 10240}, {"ffn_up", 5120, 17408}, {"ffn_down", 17408, 5120},
                                 {"ssm_out", 6144, 5120},   {"attn_q", 5120, 12288}, {"output", 5120, 248320}};
    // --matmul TYPE:INxOUT[,INxOUT...]: shapes of one's own (e.g. the launch sizes around a wave boundary)
    std::vector<std::string> custom_names;
    if (!only_shape.empty() && only_shape.find('x') != std::string::npos) {
      size_t at = 0;
      while (at <= only_shape.size()) {
        const size_t end = std::min(only_shape.find(',', at), only_shape.size());
        custom_names.push_back(only_shape.substr(at, end - at));
        at = end + 1;
      }
      shapes.clear();
      for (const std::string& c : custom_names) {
        const size_t x = c.find('x');
        const int64_t in = x == std::string::npos ? 0 : std::atoll(c.c_str());
        const int64_t outs = x == std::string::npos ? 0 : std::atoll(c.c_str() + x + 1);
        if (in <= 0 || outs <= 0 || in % 256 != 0) {
          fmt::print(stderr, "bench_cuda_ops: shape '{}' is not INxOUT with IN a positive multiple of 256\n", c);
          return 2;
        }
        shapes.push_back({c.c_str(), in, outs});
      }
      only_shape.clear();
    }
    std::vector<GgmlType> types = {GgmlType::PTQ1_0, GgmlType::PQ2_0, GgmlType::Q4_K, GgmlType::Q6_K,
                                   GgmlType::BF16,   GgmlType::F16,   GgmlType::Q8_0};
    if (quick) types = {GgmlType::PTQ1_0, GgmlType::PQ2_0, GgmlType::Q4_K};
    if (model_only) types.clear();
    if (!only_type.empty()) {  // one type (and shape) alone, e.g. for ncu
      const auto t = type_from_name(only_type);
      if (!t) {
        fmt::print(stderr, "bench_cuda_ops: unknown type '{}'\n", only_type);
        return 2;
      }
      types = {*t};
    }
    if (!types.empty()) {
      out.line(fmt::format("| type | matrix | in x out | MB (file) | layout | M=1 us | GB/s | % floor | dev GB/s | M={0} us | "
                           "M{0}/M1 |", wide_rows));
      out.line("|---|---|---|---|---|---|---|---|---|---|---|");
    }
    uint32_t seed = 1;
    for (GgmlType t : types) {
      for (const Shape& s : shapes) {
        if (!only_shape.empty() && only_shape != s.name) continue;
        const bool big = s.out > 100000;
        if (big && !(t == GgmlType::PTQ1_0 || t == GgmlType::PQ2_0)) continue;
        if (t == GgmlType::BF16 && s.in * s.out > 5120 * 17408) continue;
        const std::vector<uint8_t> host = make_weight(t, s.in, s.out, seed++);
        const double mb = host.size() / 1e6;
        const int copies = warm_l2 ? 1 : std::max(1, static_cast<int>(std::ceil(256.0 / mb)));
        std::vector<WeightRef> ws;
        for (int c = 0; c < copies; ++c) ws.push_back(be->upload_weight(host.data(), t, s.in, s.out));
        const size_t dev_bytes = cuda::weight_device_bytes(*be, ws[0]);
        std::mt19937 rng(seed);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        std::vector<float> x(8 * s.in);
        for (auto& v : x) v = nd(rng);
        float* dx = static_cast<float*>(be->alloc(x.size() * 4));
        be->upload(dx, x.data(), x.size() * 4);
        float* dy = static_cast<float*>(be->alloc(8 * s.out * 4));
        double us[2];
        for (int mi = 0; mi < 2; ++mi) {
          const int64_t M = mi == 0 ? 1 : wide_rows;
          int k = 0;
          // one graph of `copies` back-to-back calls (each on another copy of the matrix), as in a decode graph
          us[mi] = 1e3 * cuda::time_graph_ms(*be, std::max(copies, 8), 10,
                                             [&] { be->matmul(ws[k++ % copies], dx, dy, M); });
        }
        const double gbs = host.size() / (us[0] * 1e-6) / 1e9;
        const double dev_gbs = dev_bytes / (us[0] * 1e-6) / 1e9;
        out.line(fmt::format("| {} | {} | {}x{} | {:.1f} | {} | {:.1f} | {:.0f} | {:.0f}% | {:.0f} | {:.1f} | {:.2f} |",
                             type_name(t), s.name, s.in, s.out, mb, cuda::weight_layout(*be, ws[0]), us[0], gbs,
                             100.0 * gbs / floor_gbps, dev_gbs, us[1], us[1] / us[0]));
        be->release(dx);
        be->release(dy);
        // weights stay until the backend goes (no per-weight release in the interface); keep memory bounded
        if (copies > 1) {
          be.reset();
          be = make_cuda_backend(0);
        }
      }
    }
    out.line("");
    if (!only_type.empty()) {  // --matmul: nothing else
      if (!out_path.empty()) std::ofstream(out_path) << out.md;
      return 0;
    }

    // ---- other ops at decode shapes (M = 1 unless noted)
    if (!model_only) {
      op_table_header(out);
      std::mt19937 rng(5);
      auto dev_rand = [&](size_t n, float scale = 1.0f) { return dev_randn(*be, rng, n, scale); };
      const int64_t E = 5120, V = 248320;
      float* x = dev_rand(8 * 17408);
      float* y = dev_rand(8 * 17408);
      float* w = dev_rand(17408);
      auto row = [&](const std::string& op, const std::string& shape, const std::function<void()>& fn) {
        op_table_row(*be, out, op, shape, fn);
      };
      row("rms_norm", "1x5120", [&] { be->rms_norm(x, w, y, 1, E, 1e-6f); });
      row("add", "5120", [&] { be->add(x, y, y, E); });
      row("swiglu", "17408", [&] { be->swiglu(x, y, y, 17408); });
      float* signs = dev_rand(17408);
      row("hadamard fwd", "1x5120 (block 1024)", [&] { be->hadamard(x, signs, nullptr, y, 1, E, 1024, false); });
      row("hadamard fwd", "1x17408", [&] { be->hadamard(x, signs, nullptr, y, 1, 17408, 1024, false); });
      {  // matmul-input chains (Backend::residual_norm_rotate etc.: their op sequences on CUDA)
        float* xr = dev_rand(17408);
        float* n = dev_rand(17408);
        float* z = dev_rand(17408);
        std::vector<int32_t> hperm(6144);
        for (int i = 0; i < 6144; ++i) hperm[i] = (i * 7) % 6144;  // a permutation (7 is coprime to 6144)
        int32_t* perm = static_cast<int32_t*>(be->alloc(6144 * 4));
        be->upload(perm, hperm.data(), 6144 * 4);
        const Backend::Rotation rot{signs, nullptr, 1024}, rot_perm{signs, perm, 1024};
        row("residual_norm_rotate", "1x5120 (+res, block 1024)",
            [&] { be->residual_norm_rotate(xr, y, 1, w, n, z, rot, 1, E, 1e-6f); });
        row("swiglu_rotate", "1x17408 (block 1024)", [&] { be->swiglu_rotate(x, y, z, rot, 1, 17408); });
        row("gated_norm_rotate", "1x6144, heads of 128, perm", [&] {
          be->gated_norm_rotate(x, w, y, z, rot_perm, 1, 6144, 128, 1e-6f);
        });
      }
      int32_t* pos = static_cast<int32_t*>(be->alloc(64 * 4));
      std::vector<int32_t> hp(8);
      for (int i = 0; i < 8; ++i) hp[i] = 4000 + i;
      be->upload(pos, hp.data(), 32);
      row("rope_neox", "1x24x256 (64 rot)", [&] { be->rope_neox(x, pos, 1, 24, 256, 64, 1e7f); });
      bench_attention_decode(*be, out);
      {
        const GdnShape s{16, 48, 128, 128};
        float* st = dev_rand(48 * 128 * 128, 0.1f);
        float* q = dev_rand(8 * 16 * 128, 0.05f);
        float* k = dev_rand(8 * 16 * 128, 0.08f);
        float* v = dev_rand(8 * 48 * 128);
        float* g = dev_rand(8 * 48, 0.1f);
        float* b = dev_rand(8 * 48, 0.1f);
        float* o = dev_rand(8 * 48 * 128);
        float* snaps = dev_rand(8 * 48 * 128 * 128);
        row("gdn_recurrent", "M=1, 48 heads 128x128", [&] { be->gdn_recurrent(q, k, v, g, b, st, st, o, nullptr, 1, s); });
        row("gdn_recurrent", "M=8 + snapshots", [&] { be->gdn_recurrent(q, k, v, g, b, st, st, o, snaps, 8, s); });
        {  // the decode / verify op from raw conv rows [M, 10240] (q | k | v), and the ops it replaces
          const int64_t C = 2 * 16 * 128 + 48 * 128;
          float* cv = dev_rand(8 * C);
          float* a = dev_rand(8 * 48);
          float* dt = dev_rand(48);
          float* sa = dev_rand(48, 0.1f);
          float* pq = dev_rand(8 * 16 * 128);
          float* pk = dev_rand(8 * 16 * 128);
          float* pg = dev_rand(8 * 48);
          float* pb = dev_rand(8 * 48);
          const Backend::GdnRawInputs raw{cv, C, cv + 16 * 128, C, cv + 32 * 128, C, a, b, dt, sa};
          const Backend::GdnPrepared prep{pq, pk, pg, pb};
          row("gdn_prepare_recurrent", "M=1, conv rows, 48 heads 128x128",
              [&] { be->gdn_prepare_recurrent(raw, st, o, nullptr, 1, s); });
          row("gdn_prepare_recurrent", "M=8 + prepared (verify)",
              [&] { be->gdn_prepare_recurrent(raw, st, o, &prep, 8, s); });
          row("l2_norm x2 + gdn_gates + gdn_recurrent", "M=1 (what gdn_prepare_recurrent replaces)", [&] {
            be->l2_norm(cv, pq, 16, 128, 1e-6f, 0.088f);
            be->l2_norm(cv + 16 * 128, pk, 16, 128, 1e-6f, 1.0f);
            be->gdn_gates(pg, pb, dt, sa, 1, 48);
            be->gdn_recurrent(pq, pk, cv + 32 * 128, pg, pb, st, st, o, nullptr, 1, s);
          });
          for (float* p : {cv, a, dt, sa, pq, pk, pg, pb}) be->release(p);
        }
        float* cst = dev_rand(3 * 10240);
        float* cw = dev_rand(4 * 10240);
        row("gdn_conv", "M=1, 10240 ch, K=4", [&] { be->gdn_conv(x, cst, nullptr, cw, y, 1, 10240, 4); });
        for (float* p : {st, q, k, v, g, b, o, snaps, cst, cw}) be->release(p);
      }
      float* logits = dev_rand(8 * V);
      int32_t* ids = static_cast<int32_t*>(be->alloc(8 * 64 * 4));
      float* vals = static_cast<float*>(be->alloc(8 * 64 * 4));
      row("argmax", "1x248320", [&] { be->argmax(logits, ids, 1, V); });
      row("argmax", "8x248320", [&] { be->argmax(logits, ids, 8, V); });
      row("top_k k=16", "7x248320", [&] { be->top_k(logits, ids, vals, 7, V, 16); });
      out.line("");
    }

    // ---- prefill GDN
    if (!model_only) bench_gdn_prefill(*be, out);
    if (!model_only) bench_matmul_prefill(*be, out);
    if (!model_only) bench_attention_prefill(*be, out);

    // ---- whole model
    if (!model_path.empty()) {
      be.reset();
      be = make_cuda_backend(0);
      gguf::File file = gguf::File::open(model_path);
      size_t weight_bytes = 0;
      for (const auto& t : file.tensors()) weight_bytes += t.nbytes;
      const auto t0 = std::chrono::steady_clock::now();
      TargetOptions topts;
      topts.n_ctx = 4096;
      std::unique_ptr<gguf::File> dfile;  // --drafter: its taps and block size shape the target
      if (!drafter_path.empty()) {
        dfile = std::make_unique<gguf::File>(gguf::File::open(drafter_path));
        const DrafterConfig dc = read_drafter_config(*dfile);
        topts.tap_layers = dc.target_layers;
        topts.max_undo_rows = dc.block_size;
      }
      // 8 rows (decode / verify), or the backend's prefill chunk when a prefill chunk is profiled
      const char* pstep = std::getenv("DFLASH_PROFILE_STEP");
      topts.max_rows = pstep != nullptr && std::string(pstep) == "prefill" ? 0 : 8;
      auto model = TargetModel::load(file, *be, topts);
      be->synchronize();
      const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const TargetConfig& cfg = model->config();
      // bytes one decode step must read: every weight once except the embedding (one row), plus the
      // GDN state read + written
      size_t embd_bytes = 0;
      if (const auto* te = file.find_tensor("token_embd.weight")) embd_bytes = te->nbytes;
      size_t state_bytes = 0;
      for (int64_t il = 0; il < cfg.n_layer; ++il)
        if (!cfg.is_attention_layer(il)) state_bytes += 2 * 4 * cfg.ssm_v_heads * cfg.ssm_head_k * cfg.ssm_head_v();
      const size_t step_bytes = weight_bytes - embd_bytes + state_bytes;
      out.line(fmt::format("model: {} ({} layers, {:.2f} GB of tensors, loaded in {:.1f} s)", model_path, cfg.n_layer,
                           weight_bytes / 1e9, load_s));
      std::vector<int32_t> prompt(16);
      for (int i = 0; i < 16; ++i) prompt[i] = 1000 + 37 * i;
      prefill(*model, prompt);
      ForwardOptions last;
      last.logits = LogitRows::kLast;
      int32_t tok = 1234;
      for (int i = 0; i < 3; ++i) tok = model->forward(std::span(&tok, 1), last).argmax[0];  // warm-up
      be->synchronize();
      const auto d0 = std::chrono::steady_clock::now();
      for (int i = 0; i < n_tokens; ++i) tok = model->forward(std::span(&tok, 1), last).argmax[0];
      const double dec_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - d0).count();
      const double ms_tok = 1e3 * dec_s / n_tokens;
      const double floor_ms = step_bytes / (floor_gbps * 1e9) * 1e3;
      out.line(fmt::format("decode (1 row/step, step graph replayed, argmax downloaded each step): {:.2f} ms/token = "
                           "{:.1f} tok/s; floor {:.2f} ms ({:.2f} GB read / {:.0f} GB/s) -> {:.0f}% of floor",
                           ms_tok, 1e3 / ms_tok, floor_ms, step_bytes / 1e9, floor_gbps, 100.0 * floor_ms / ms_tok));
      // DFLASH_PROFILE_STEP: one step inside a profiler range for ncu --profile-from-start off: the
      // decode step (any value), "verify" (8 rows, undoable) or "prefill" (one chunk of max_rows rows).
      const char* profile_step = std::getenv("DFLASH_PROFILE_STEP");
      const bool profile_verify = profile_step != nullptr && std::string(profile_step) == "verify";
      const bool profile_prefill = profile_step != nullptr && std::string(profile_step) == "prefill";
      if (profile_prefill) {
        std::vector<int32_t> chunk(static_cast<size_t>(model->max_rows()));
        for (size_t i = 0; i < chunk.size(); ++i) chunk[i] = static_cast<int32_t>(1000 + 37 * i % 50000);
        ForwardOptions pf;
        pf.logits = LogitRows::kLast;
        model->reset();
        model->forward(chunk, pf);  // warm-up (scratch sizes)
        model->reset();
        be->synchronize();
        cuda::profiler_range(true);
        model->forward(chunk, pf);
        cuda::profiler_range(false);
        model->reset();
        prefill(*model, prompt);
      }
      const bool profile_draft = profile_step != nullptr && std::string(profile_step) == "draft";
      if (profile_step != nullptr && !profile_verify && !profile_prefill && !profile_draft) {  // one decode step
        be->synchronize();
        cuda::profiler_range(true);
        tok = model->forward(std::span(&tok, 1), last).argmax[0];
        cuda::profiler_range(false);
      }
      // DFLASH_STEP_TIMELINE=1: the real (overlapped) kernel timeline of one decode, verify and draft step
      // through CUPTI (step_timeline.h), after the timed runs, each step recorded once warm.
      const bool want_timeline = std::getenv("DFLASH_STEP_TIMELINE") != nullptr;
      // step: what is recorded; after: run after each step, not recorded (the verify's rollback)
      const auto record_timeline = [&](const std::string& title, const std::function<void()>& step,
                                       const std::function<void()>& after) {
        if (!want_timeline) return;
        bench::StepTimeline tl;
        step();
        if (after) after();
        be->synchronize();
        tl.begin();
        step();
        be->synchronize();
        out.line(bench::timeline_report(tl.end(), title));
        if (after) after();
      };
      record_timeline(
          "timeline: one decode step", [&] { tok = model->forward(std::span(&tok, 1), last).argmax[0]; }, nullptr);
      // verify: 8 rows, undoable, then roll back 4
      std::vector<int32_t> block(8);
      for (int i = 0; i < 8; ++i) block[i] = 2000 + 11 * i;
      ForwardOptions ver;
      ver.logits = LogitRows::kAll;
      ver.undoable = true;
      const int n_ver = std::max(4, n_tokens / 4);
      model->forward(block, ver);
      model->rollback(4);
      be->synchronize();
      const auto v0 = std::chrono::steady_clock::now();
      for (int i = 0; i < n_ver; ++i) {
        model->forward(block, ver);
        model->rollback(4);
      }
      be->synchronize();
      const double ver_ms = 1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - v0).count() / n_ver;
      if (profile_verify) {  // one verify step (8 rows, undoable) for ncu --profile-from-start off
        cuda::profiler_range(true);
        model->forward(block, ver);
        cuda::profiler_range(false);
        model->rollback(4);
      }
      out.line(fmt::format("verify (8 rows, undoable, + rollback): {:.2f} ms/step = {:.2f}x a decode step", ver_ms,
                           ver_ms / ms_tok));
      record_timeline(
          "timeline: one verify step (8 rows, undoable; the rollback not recorded)",
          [&] { model->forward(block, ver); }, [&] { model->rollback(4); });
      if (want_timeline) {  // the rollback alone (keeping 4 of the 8 rows), after an unrecorded verify
        bench::StepTimeline tl;
        model->forward(block, ver);
        be->synchronize();
        tl.begin();
        model->rollback(4);
        be->synchronize();
        out.line(bench::timeline_report(tl.end(), "timeline: one rollback (4 of 8 rows kept)"));
      }
      if (dfile) {  // the draft step (device-resident: draft_device, no download), after 64 context rows
        auto drafter = DFlashDrafter::load(*dfile, *model);
        const DrafterConfig& dc = drafter->config();
        std::vector<float> taps(static_cast<size_t>(64 * dc.n_taps() * dc.n_embd));
        std::mt19937 rng(3);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        for (float& t : taps) t = nd(rng);
        drafter->append_context(taps, 64);
        for (int i = 0; i < 3; ++i) drafter->draft_device(1234);  // direct run, capture, replay
        be->synchronize();
        const int n_draft = std::max(8, n_tokens / 2);
        const auto r0 = std::chrono::steady_clock::now();
        for (int i = 0; i < n_draft; ++i) drafter->draft_device(1234);
        be->synchronize();
        const double dr_ms =
            1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - r0).count() / n_draft;
        if (profile_step != nullptr && std::string(profile_step) == "draft") {
          cuda::profiler_range(true);
          drafter->draft_device(1234);
          cuda::profiler_range(false);
        }
        out.line(fmt::format("draft step ({} rows, {} layers, graph replayed, no download): {:.3f} ms = {:.3f}x a "
                             "decode step", dc.block_size, dc.n_layer, dr_ms, dr_ms / ms_tok));
        record_timeline("timeline: one draft step", [&] { drafter->draft_device(1234); }, nullptr);
        // One device-resident speculative cycle as Engine::generate_speculative runs it at tau 1 (the drafts of
        // random weights are never accepted): the verify of the device draft block with taps and the host's one
        // wait (its download), rollback(1), the drafter's context append of the kept row's taps, the next draft.
        // Against the steps above it shows what the context append and the hand-offs between the steps add
        // (S34-4: 5.36 ms, of which the append ~89 us of kernels, its 25600 -> 5120 Q4_K projection 29 us). Not
        // a timeline: CUPTI's recording stretches the host's wait inside the cycle.
        ForwardOptions cyc;
        cyc.logits = LogitRows::kAll;
        cyc.want_taps = true;
        cyc.taps_on_device = true;
        cyc.undoable = true;
        const int32_t* d_block = drafter->draft_device(1234);
        const auto cycle = [&] {
          const int32_t next = model->forward_device(d_block, dc.block_size, cyc).argmax[0];
          model->rollback(1);
          drafter->append_context_device(model->device_taps(), 1);
          d_block = drafter->draft_device(next);
        };
        for (int i = 0; i < 3; ++i) cycle();  // captures
        be->synchronize();
        const int n_cyc = std::max(8, n_tokens / 2);
        const auto c0 = std::chrono::steady_clock::now();
        for (int i = 0; i < n_cyc; ++i) cycle();
        be->synchronize();
        const double cyc_ms =
            1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count() / n_cyc;
        out.line(fmt::format("speculative cycle (verify {} rows with taps + rollback(1) + context append + draft, one "
                             "host wait): {:.3f} ms = {:.3f}x a decode step",
                             dc.block_size, cyc_ms, cyc_ms / ms_tok));
      }
    }
    if (!out_path.empty()) {
      std::ofstream f(out_path);
      f << out.md;
    }
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_cuda_ops: error: {}\n", e.what());
    return 1;
  }
}
