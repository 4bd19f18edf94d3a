// test_cuda's main: creates the CPU reference and the CUDA backend, runs the gtest suite, prints the
// per-op table (op, shape, NMSE vs bound) and writes it to $DFLASH_CUDA_REPORT when set.
#include <gtest/gtest.h>

#include <cstdio>
#include <fmt/format.h>
#include <cstdlib>
#include <fstream>
#include <memory>

#include "cuda_test_util.h"
#include "ops/cuda/cuda_backend.h"

namespace dflash::cudatest {
namespace {
std::unique_ptr<Backend> g_gpu, g_cpu;
std::vector<Record> g_records;
}  // namespace

Backend& gpu() { return *g_gpu; }
Backend& cpu() { return *g_cpu; }
bool have_gpu() { return g_gpu != nullptr; }
void record(const Record& r) { g_records.push_back(r); }
const std::vector<Record>& records() { return g_records; }

}  // namespace dflash::cudatest

int main(int argc, char** argv) {
  using namespace dflash;
  ::testing::InitGoogleTest(&argc, argv);
  cudatest::g_cpu = make_cpu_backend(0);
  if (cuda_device_count() > 0) {
    cudatest::g_gpu = make_cuda_backend(0);
    std::printf("test_cuda: %s\n", cuda_device_description(0).c_str());
  } else {
    std::printf("test_cuda: no CUDA device; every test is skipped\n");
  }
  const int rc = RUN_ALL_TESTS();

  std::string table = "| op | shape | NMSE vs CPU | max abs | bound | result | note |\n|---|---|---|---|---|---|---|\n";
  int fails = 0;
  for (const auto& r : cudatest::records()) {
    char line[512];
    std::snprintf(line, sizeof line, "| %s | %s | %.3g | %.3g | %s | %s | %s |\n", r.op.c_str(), r.shape.c_str(),
                  r.nmse, r.max_abs,
                  r.bound < 0 ? "n/a" : r.bound == 0 ? "bit-exact" : fmt::format("{:.0e}", r.bound).c_str(),
                  r.pass ? "ok" : "FAIL", r.note.c_str());
    table += line;
    fails += !r.pass;
  }
  std::printf("\n%s\n%zu checks, %d failed\n", table.c_str(), cudatest::records().size(), fails);
  if (const char* path = std::getenv("DFLASH_CUDA_REPORT")) {
    std::ofstream f(path);
    f << table << "\n" << cudatest::records().size() << " checks, " << fails << " failed\n";
  }
  cudatest::g_gpu.reset();
  return rc;
}
