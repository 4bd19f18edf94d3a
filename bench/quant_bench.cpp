// Quant kernel throughput: GB/s of weight bytes streamed by dot_row (one thread, scalar and AVX2) and
// by matmul_rows (thread pool, M = 1 and 8 activation rows), per type.
//   ./bench_quant --benchmark_filter=dot/q4_k
#include <benchmark/benchmark.h>

#include <random>
#include <string>
#include <vector>

#include "quant/kernels.h"
#include "quant/types.h"

namespace {

using dflash::GgmlType;
using dflash::quant_detail::Isa;

constexpr int64_t kIn = 4096;   // row length
constexpr int64_t kOut = 1024;  // rows: 4096 x 1024 weights, 2.3 MB at Q4_K, 16 MB at F32

struct Matrix {
  std::vector<uint8_t> w;
  std::vector<float> x;
  size_t row_bytes;
};

Matrix make_matrix(GgmlType t, int64_t M) {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  Matrix m;
  m.row_bytes = dflash::row_bytes(t, kIn);
  m.w.resize(m.row_bytes * kOut);
  std::vector<float> row(kIn);
  for (int64_t o = 0; o < kOut; ++o) {
    for (auto& v : row) v = nd(rng);
    dflash::quantize_row(t, row.data(), m.w.data() + o * m.row_bytes, kIn);
  }
  m.x.resize(static_cast<size_t>(M * kIn));
  for (auto& v : m.x) v = nd(rng);
  return m;
}

void bm_dot(benchmark::State& state, GgmlType t, Isa isa) {
  if (isa == Isa::Avx2 && !dflash::quant_detail::avx2_available()) {
    state.SkipWithError("no AVX2");
    return;
  }
  const Matrix m = make_matrix(t, 1);
  float sink = 0;
  for (auto _ : state) {
    for (int64_t o = 0; o < kOut; ++o)
      sink += dflash::quant_detail::dot_row_isa(isa, t, m.w.data() + o * m.row_bytes, m.x.data(), kIn);
    benchmark::DoNotOptimize(sink);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(m.w.size()));
}

void bm_matmul(benchmark::State& state, GgmlType t, int64_t M) {
  const Matrix m = make_matrix(t, M);
  std::vector<float> y(static_cast<size_t>(M * kOut));
  for (auto _ : state) {
    dflash::matmul_rows(t, m.w.data(), kIn, kOut, m.x.data(), M, y.data());
    benchmark::DoNotOptimize(y.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(m.w.size()));
}

}  // namespace

int main(int argc, char** argv) {
  const GgmlType types[] = {GgmlType::F32,  GgmlType::F16,   GgmlType::BF16,  GgmlType::Q8_0, GgmlType::Q4_0,
                            GgmlType::Q4_K, GgmlType::Q5_K,  GgmlType::Q6_K,  GgmlType::TQ1_0, GgmlType::TQ2_0,
                            GgmlType::Q1_0, GgmlType::Q2_0,  GgmlType::PQ2_0, GgmlType::PTQ1_0};
  for (GgmlType t : types) {
    const std::string name = dflash::type_name(t);
    benchmark::RegisterBenchmark(("dot/" + name + "/scalar").c_str(), bm_dot, t, Isa::Scalar)->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("dot/" + name + "/avx2").c_str(), bm_dot, t, Isa::Avx2)->Unit(benchmark::kMillisecond);
    for (int64_t M : {1, 8})
      benchmark::RegisterBenchmark(("matmul/" + name + "/M" + std::to_string(M)).c_str(), bm_matmul, t, M)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
