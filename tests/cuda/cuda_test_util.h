// The differential GPU test suite (test_cuda): shared helpers.
//
// Every op runs on the CUDA backend and on the CPU reference backend with the same random inputs;
// the CUDA result must be within a per-op bound of the CPU's (normalised mean squared error,
// NMSE = sum (gpu - cpu)^2 / sum cpu^2; bound 0 means bit-exact), NaN/Inf fails, and a guard region
// after every GPU output (poisoned, like the output itself, before the run) must come back untouched.
// Results go into a table printed at the end (cuda_test_main.cpp) and written to $DFLASH_CUDA_REPORT.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ops/backend.h"
#include "quant/types.h"
#include "quant/xq_emulation.h"

namespace dflash::cudatest {

// The two backends (created in main; the CUDA tests are skipped when there is no GPU).
Backend& gpu();
Backend& cpu();
bool have_gpu();

#define REQUIRE_GPU()                                 \
  do {                                                \
    if (!::dflash::cudatest::have_gpu()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

struct Record {
  std::string op, shape;
  double nmse = 0, max_abs = 0, bound = 0;  // bound 0: bit-exact; < 0: not an NMSE check (see note)
  bool pass = true;
  std::string note;
};
void record(const Record& r);
const std::vector<Record>& records();

// NMSE bound of a matmul of weight type t against the CPU's. The integer tensor-core formats (ternary
// PQ2_0 / PTQ1_0, Q4_K, Q6_K: mma_gemv.cuh) sum exact integers over activations quantized to 2 digit
// planes per 128-block (xq_record.cuh: rounding <= 2^-14 of the block's largest |x|; N(0, 1) inputs
// give 3.6e-9 .. 7.4e-9, S29-7 in bench/RESULTS.md), so 1e-7; every other layout dequantizes to the CPU's
// floats and differs by the fp32 summation order only (~1e-13): 1e-10. A wrong code, scale, block or
// row moves the NMSE above 1e-3 either way.
inline double matmul_bound(GgmlType t) { return xq_rounded_type(t) ? 1e-7 : 1e-10; }

// A weight as the file holds it: random N(0,1) rows quantized by the reference quantizers (threads
// over rows; row o's values depend on seed and o only).
struct HostWeight {
  GgmlType type;
  int64_t in, out;
  std::vector<uint8_t> bytes;
};
inline HostWeight make_weight(GgmlType t, int64_t in, int64_t out, uint32_t seed) {
  HostWeight w{t, in, out, {}};
  const size_t rb = row_bytes(t, in);
  w.bytes.resize(rb * out);
  const int nt = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  std::vector<std::thread> th;
  for (int k = 0; k < nt; ++k)
    th.emplace_back([&, k] {
      std::vector<float> row(in);
      for (int64_t o = k; o < out; o += nt) {
        std::mt19937 rng(seed * 1000003u + static_cast<uint32_t>(o));
        std::normal_distribution<float> d(0.0f, 1.0f);
        for (auto& v : row) v = d(rng);
        quantize_row(t, row.data(), w.bytes.data() + rb * o, in);
      }
    });
  for (auto& x : th) x.join();
  return w;
}

inline std::vector<float> rand_vec(std::mt19937& rng, size_t n, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}
inline std::vector<float> randn_vec(std::mt19937& rng, size_t n, float sigma = 1.0f) {
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

constexpr size_t kGuard = 64;  // elements of guard after every output buffer
constexpr uint32_t kPoison = 0x7fbadbadu;  // a NaN with a recognisable payload

// A backend buffer of n elements of T plus a guard region, poisoned before use.
template <typename T>
class Buf {
 public:
  static_assert(sizeof(T) == 4, "Buf holds 4-byte elements");
  Buf(Backend& be, size_t n) : be_(&be), n_(n) {
    ptr_ = static_cast<T*>(be.alloc((n + kGuard) * sizeof(T)));
    poison();
  }
  Buf(Backend& be, const std::vector<T>& host) : Buf(be, host.size()) { set(host); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  ~Buf() { be_->release(ptr_); }
  void poison() {
    std::vector<uint32_t> p(n_ + kGuard, kPoison);
    be_->upload(ptr_, p.data(), p.size() * 4);
  }
  void set(const std::vector<T>& host) { be_->upload(ptr_, host.data(), host.size() * sizeof(T)); }
  std::vector<T> get() const {
    std::vector<T> h(n_);
    be_->download(h.data(), ptr_, n_ * sizeof(T));
    return h;
  }
  // True when the guard region still holds the poison pattern.
  bool guard_ok() const {
    std::vector<uint32_t> g(kGuard);
    be_->download(g.data(), ptr_ + n_, kGuard * 4);
    for (uint32_t v : g)
      if (v != kPoison) return false;
    return true;
  }
  T* get_ptr() const { return ptr_; }
  operator T*() const { return ptr_; }
  size_t size() const { return n_; }

 private:
  Backend* be_;
  T* ptr_;
  size_t n_;
};

struct Diff {
  double nmse = 0, max_abs = 0;
  size_t non_finite = 0;
};
inline Diff diff(const std::vector<float>& got, const std::vector<float>& ref) {
  Diff d;
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size() && i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) {
      ++d.non_finite;
      continue;
    }
    const double e = static_cast<double>(got[i]) - ref[i];
    num += e * e;
    den += static_cast<double>(ref[i]) * ref[i];
    d.max_abs = std::max(d.max_abs, std::fabs(e));
  }
  d.nmse = den > 0 ? num / den : num;
  return d;
}

// Compares and records: fails on non-finite values, a size mismatch or nmse > bound.
inline void check(const std::string& op, const std::string& shape, const std::vector<float>& got,
                  const std::vector<float>& ref, double bound, bool guard_ok = true, const std::string& note = "") {
  const Diff d = diff(got, ref);
  Record r{op, shape, d.nmse, d.max_abs, bound, true, note};
  r.pass = got.size() == ref.size() && d.non_finite == 0 && guard_ok &&
           (bound == 0 ? std::memcmp(got.data(), ref.data(), got.size() * 4) == 0 : d.nmse <= bound);
  if (!guard_ok) r.note += " GUARD OVERWRITTEN";
  if (d.non_finite) {
    r.note += ' ';
    r.note += std::to_string(d.non_finite);
    r.note += " non-finite";
  }
  record(r);
  EXPECT_TRUE(r.pass) << op << " " << shape << ": nmse " << d.nmse << " (bound " << bound << "), max abs "
                      << d.max_abs << ", non-finite " << d.non_finite << (guard_ok ? "" : ", guard overwritten");
}

inline std::string shape_str(std::initializer_list<int64_t> dims) {
  std::string s;
  for (int64_t d : dims) {
    if (!s.empty()) s += 'x';
    s += std::to_string(d);
  }
  return s;
}

}  // namespace dflash::cudatest
