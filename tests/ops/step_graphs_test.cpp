// StepGraphCache (ops/step_graphs.h) and the indexed store scatter_rows, on the CPU.
//
// The CPU backend has no graphs, so a step always runs directly there; the capture logic is checked
// with a backend that records "captures" itself: run 1 direct, run 2 captured and launched, runs 3+
// replayed, one entry per key, and a step that throws while being captured leaves no capture open.
#include <gtest/gtest.h>

#include <memory>
#include <stdexcept>
#include <vector>

#include "ops/backend.h"
#include "ops/step_graphs.h"
#include "util/error.h"

namespace dflash {
namespace {

// Every op of the CPU backend, plus fake step graphs: a capture records the ops' side effect
// (the step's counter) so that a launch can replay it.
class FakeGraphBackend final : public Backend {
 public:
  FakeGraphBackend() : cpu_(make_cpu_backend(1)) {}
  std::string name() const override { return "fake-graphs"; }
  void* alloc(size_t b) override { return cpu_->alloc(b); }
  void release(void* p) override { cpu_->release(p); }
  void upload(void* d, const void* s, size_t b) override { cpu_->upload(d, s, b); }
  void download(void* d, const void* s, size_t b) override { cpu_->download(d, s, b); }
  void copy(void* d, const void* s, size_t b) override { cpu_->copy(d, s, b); }
  void fill_zero(void* d, size_t b) override { cpu_->fill_zero(d, b); }
  void synchronize() override {}
  WeightRef upload_weight(const void* h, GgmlType t, int64_t in, int64_t out) override {
    return cpu_->upload_weight(h, t, in, out);
  }
  void matmul(const WeightRef& w, const float* x, float* y, int64_t M) override { cpu_->matmul(w, x, y, M); }
  void get_rows(const WeightRef& w, const int32_t* ids, float* y, int64_t M) override { cpu_->get_rows(w, ids, y, M); }
  void rms_norm(const float* x, const float* w, float* y, int64_t r, int64_t n, float e) override {
    cpu_->rms_norm(x, w, y, r, n, e);
  }
  void l2_norm(const float* x, float* y, int64_t r, int64_t n, float e, float s) override {
    cpu_->l2_norm(x, y, r, n, e, s);
  }
  void rms_norm_gated(const float* x, const float* w, const float* z, float* y, int64_t r, int64_t n,
                      float e) override {
    cpu_->rms_norm_gated(x, w, z, y, r, n, e);
  }
  void add(const float* a, const float* b, float* y, int64_t n) override { cpu_->add(a, b, y, n); }
  void swiglu(const float* g, const float* u, float* y, int64_t n) override { cpu_->swiglu(g, u, y, n); }
  void mul_sigmoid(const float* x, const float* g, float* y, int64_t n) override { cpu_->mul_sigmoid(x, g, y, n); }
  void copy_rows(float* d, int64_t ds, const float* s, int64_t ss, int64_t r, int64_t c) override {
    cpu_->copy_rows(d, ds, s, ss, r, c);
  }
  void scatter_rows(float* d, int64_t ds, int64_t dr, const int32_t* i, const float* s, int64_t ss, int64_t M,
                    int64_t c) override {
    cpu_->scatter_rows(d, ds, dr, i, s, ss, M, c);
  }
  void hadamard(const float* x, const float* s, const int32_t* p, float* y, int64_t r, int64_t n, int64_t b,
                bool inv) override {
    cpu_->hadamard(x, s, p, y, r, n, b, inv);
  }
  void rope_neox(float* x, const int32_t* p, int64_t M, int64_t h, int64_t d, int64_t nr, float t) override {
    cpu_->rope_neox(x, p, M, h, d, nr, t);
  }
  void attention(const float* q, const float* k, const float* v, const int32_t* r, float* o, int64_t M, int64_t h,
                 int64_t hk, int64_t d, float s) override {
    cpu_->attention(q, k, v, r, o, M, h, hk, d, s);
  }
  void gdn_conv(const float* x, float* st, float* sb, const float* w, float* y, int64_t M, int64_t C,
                int64_t K) override {
    cpu_->gdn_conv(x, st, sb, w, y, M, C, K);
  }
  void gdn_gates(float* a, float* b, const float* dt, const float* sa, int64_t M, int64_t h) override {
    cpu_->gdn_gates(a, b, dt, sa, M, h);
  }
  void gdn_recurrent(const float* q, const float* k, const float* v, const float* g, const float* b,
                     const float* si, float* st, float* o, float* sn, int64_t M, const GdnShape& s) override {
    cpu_->gdn_recurrent(q, k, v, g, b, si, st, o, sn, M, s);
  }
  void gdn_prepare_recurrent(const GdnRawInputs& in, float* st, float* o, const GdnPrepared* p, int64_t M,
                             const GdnShape& s) override {
    cpu_->gdn_prepare_recurrent(in, st, o, p, M, s);
  }
  void gdn_apply_rows_batch(std::span<const GdnApplyJob> jobs, int64_t M, const GdnShape& s) override {
    cpu_->gdn_apply_rows_batch(jobs, M, s);
  }
  void gdn_chunked(const float* q, const float* k, const float* v, const float* g, const float* b, float* st,
                   float* o, int64_t M, const GdnShape& s) override {
    cpu_->gdn_chunked(q, k, v, g, b, st, o, M, s);
  }
  void argmax(const float* x, int32_t* ids, int64_t M, int64_t n) override { cpu_->argmax(x, ids, M, n); }
  void top_k(const float* x, int32_t* ids, float* v, int64_t M, int64_t n, int64_t k) override {
    cpu_->top_k(x, ids, v, M, n, k);
  }
  void dflash_conv(const float* x, const float* b, const float* d, int64_t ds, const float* r, float* y, int64_t M,
                   int64_t C, int64_t K, int64_t g) override {
    cpu_->dflash_conv(x, b, d, ds, r, y, M, C, K, g);
  }
  void selector_walk(const float* pr, const float* su, const int32_t* c, const float* u, const float* g, int32_t* o,
                     int64_t rows, int64_t k, int64_t r) override {
    cpu_->selector_walk(pr, su, c, u, g, o, rows, k, r);
  }

  bool begin_capture() override {
    DFLASH_CHECK(!capturing, "nested capture");
    capturing = true;
    ++captures;
    return true;
  }
  std::unique_ptr<StepGraph> end_capture() override {
    DFLASH_CHECK(capturing, "end_capture without begin_capture");
    capturing = false;
    return std::make_unique<Graph>(*this);
  }

  bool capturing = false;
  int captures = 0, launches = 0;

 private:
  struct Graph final : StepGraph {
    explicit Graph(FakeGraphBackend& be) : be_(be) {}
    void launch() override { ++be_.launches; }
    FakeGraphBackend& be_;
  };
  std::unique_ptr<Backend> cpu_;
};

TEST(StepGraphCache, RunsDirectlyThenCapturesThenReplays) {
  FakeGraphBackend be;
  StepGraphCache cache(be);
  int direct_or_captured = 0;  // times the step's ops were issued (direct runs + the capture)
  auto step = [&] { ++direct_or_captured; };
  cache.run(7, step);  // 1: direct
  EXPECT_EQ(direct_or_captured, 1);
  EXPECT_EQ(be.captures, 0);
  EXPECT_EQ(be.launches, 0);
  cache.run(7, step);  // 2: captured, then launched
  EXPECT_EQ(direct_or_captured, 2);
  EXPECT_EQ(be.captures, 1);
  EXPECT_EQ(be.launches, 1);
  for (int i = 0; i < 5; ++i) cache.run(7, step);  // replays only
  EXPECT_EQ(direct_or_captured, 2);
  EXPECT_EQ(be.captures, 1);
  EXPECT_EQ(be.launches, 6);
  EXPECT_EQ(cache.graphs(), 1u);
  cache.run(8, step);  // another shape: its own entry, direct first
  EXPECT_EQ(direct_or_captured, 3);
  EXPECT_EQ(be.launches, 6);
  cache.clear();
  EXPECT_EQ(cache.graphs(), 0u);
  cache.run(7, step);  // after clear: direct again
  EXPECT_EQ(direct_or_captured, 4);
  EXPECT_EQ(be.captures, 1);
}

TEST(StepGraphCache, AStepThatThrowsDuringCaptureClosesTheCapture) {
  FakeGraphBackend be;
  StepGraphCache cache(be);
  int calls = 0;
  auto step = [&] {
    if (++calls == 2) throw std::runtime_error("op failed");
  };
  cache.run(1, step);
  EXPECT_THROW(cache.run(1, step), std::runtime_error);
  EXPECT_FALSE(be.capturing);
  EXPECT_EQ(cache.graphs(), 0u);
  cache.run(1, step);  // captured now (third call), and launched
  EXPECT_EQ(be.captures, 2);
  EXPECT_EQ(be.launches, 1);
  EXPECT_EQ(cache.graphs(), 1u);
}

TEST(StepGraphCache, CpuBackendAlwaysRunsDirectly) {
  auto be = make_cpu_backend(1);
  StepGraphCache cache(*be);
  int calls = 0;
  for (int i = 0; i < 4; ++i) cache.run(3, [&] { ++calls; });
  EXPECT_EQ(calls, 4);
  EXPECT_EQ(cache.graphs(), 0u);
}

TEST(CpuScatterRows, StoresRowsAtIndicesAndRejectsOutOfRange) {
  auto be = make_cpu_backend(1);
  // 3 source rows of 4 (stride 5) into a destination of 6 rows (stride 4) at rows 4, 0, 2.
  std::vector<float> src(3 * 5), dst(6 * 4, -1.0f);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<float>(i);
  const std::vector<int32_t> idx = {4, 0, 2};
  be->scatter_rows(dst.data(), 4, 6, idx.data(), src.data(), 5, 3, 4);
  for (int m = 0; m < 3; ++m)
    for (int c = 0; c < 4; ++c) EXPECT_EQ(dst[idx[m] * 4 + c], src[m * 5 + c]) << m << "," << c;
  for (int r : {1, 3, 5})
    for (int c = 0; c < 4; ++c) EXPECT_EQ(dst[r * 4 + c], -1.0f);  // untouched rows
  const std::vector<int32_t> bad = {1, 6};
  EXPECT_THROW(be->scatter_rows(dst.data(), 4, 6, bad.data(), src.data(), 5, 2, 4), Error);
}

}  // namespace
}  // namespace dflash
