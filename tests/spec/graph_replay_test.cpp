// Step graphs on the CPU: a backend whose captures record the ops (with their pointers and sizes) and
// whose graph launches replay them, as a CUDA graph does. The decode, verify, draft, rollback and
// context-append steps then run from recordings, so anything a step takes from the host at capture
// time instead of from backend memory (a position, a slot, a row count baked into a recorded op)
// shows up as a wrong token here, in CI, without a GPU.
#include <gtest/gtest.h>

#include <functional>
#include <random>
#include <memory>
#include <span>
#include <vector>

#include "spec/spec_fixture.h"
#include "util/error.h"

namespace dflash {
namespace {

using namespace spec_test;

class ReplayGraphBackend final : public Backend {
 public:
  ReplayGraphBackend() : cpu_(make_cpu_backend(1)) {}
  std::string name() const override { return "cpu-replay-graphs"; }
  // As CUDA: 5..7 rows run as 8 where the caller has the room (the drafter's lm_head then computes its anchor
  // row too), so the lockstep test below checks that the drafter reads its 7 rows of logits from the right
  // place.
  int64_t matmul_rows_for(int64_t rows, int64_t room) const override { return rows_as_full_tile(rows, room); }

  // Memory: never recorded; allocation and host transfers are errors inside a capture (as on CUDA).
  void* alloc(size_t b) override {
    no_capture("alloc");
    return cpu_->alloc(b);
  }
  void release(void* p) override { cpu_->release(p); }
  void upload(void* d, const void* s, size_t b) override {
    no_capture("upload");
    cpu_->upload(d, s, b);
  }
  void download(void* d, const void* s, size_t b) override {
    no_capture("download");
    cpu_->download(d, s, b);
  }
  void synchronize() override { no_capture("synchronize"); }
  WeightRef upload_weight(const void* h, GgmlType t, int64_t in, int64_t out) override {
    no_capture("upload_weight");
    return cpu_->upload_weight(h, t, in, out);
  }
  void copy(void* d, const void* s, size_t b) override {
    op([=, this] { cpu_->copy(d, s, b); });
  }
  void fill_zero(void* d, size_t b) override {
    op([=, this] { cpu_->fill_zero(d, b); });
  }

  // Ops: run now, or recorded while capturing.
  void matmul(const WeightRef& w, const float* x, float* y, int64_t M) override {
    op([=, this] { cpu_->matmul(w, x, y, M); });
  }
  void get_rows(const WeightRef& w, const int32_t* ids, float* y, int64_t M) override {
    op([=, this] { cpu_->get_rows(w, ids, y, M); });
  }
  void rms_norm(const float* x, const float* w, float* y, int64_t r, int64_t n, float e) override {
    op([=, this] { cpu_->rms_norm(x, w, y, r, n, e); });
  }
  void l2_norm(const float* x, float* y, int64_t r, int64_t n, float e, float s) override {
    op([=, this] { cpu_->l2_norm(x, y, r, n, e, s); });
  }
  void rms_norm_gated(const float* x, const float* w, const float* z, float* y, int64_t r, int64_t n,
                      float e) override {
    op([=, this] { cpu_->rms_norm_gated(x, w, z, y, r, n, e); });
  }
  void add(const float* a, const float* b, float* y, int64_t n) override {
    op([=, this] { cpu_->add(a, b, y, n); });
  }
  void swiglu(const float* g, const float* u, float* y, int64_t n) override {
    op([=, this] { cpu_->swiglu(g, u, y, n); });
  }
  void mul_sigmoid(const float* x, const float* g, float* y, int64_t n) override {
    op([=, this] { cpu_->mul_sigmoid(x, g, y, n); });
  }
  void copy_rows(float* d, int64_t ds, const float* s, int64_t ss, int64_t r, int64_t c) override {
    op([=, this] { cpu_->copy_rows(d, ds, s, ss, r, c); });
  }
  void scatter_rows(float* d, int64_t ds, int64_t dr, const int32_t* i, const float* s, int64_t ss, int64_t M,
                    int64_t c) override {
    op([=, this] { cpu_->scatter_rows(d, ds, dr, i, s, ss, M, c); });
  }
  void hadamard(const float* x, const float* s, const int32_t* p, float* y, int64_t r, int64_t n, int64_t b,
                bool inv) override {
    op([=, this] { cpu_->hadamard(x, s, p, y, r, n, b, inv); });
  }
  void rope_neox(float* x, const int32_t* p, int64_t M, int64_t h, int64_t d, int64_t nr, float t) override {
    op([=, this] { cpu_->rope_neox(x, p, M, h, d, nr, t); });
  }
  void attention(const float* q, const float* k, const float* v, const int32_t* r, float* o, int64_t M, int64_t h,
                 int64_t hk, int64_t d, float s) override {
    op([=, this] { cpu_->attention(q, k, v, r, o, M, h, hk, d, s); });
  }
  void gdn_conv(const float* x, float* st, float* sb, const float* w, float* y, int64_t M, int64_t C,
                int64_t K) override {
    op([=, this] { cpu_->gdn_conv(x, st, sb, w, y, M, C, K); });
  }
  void gdn_gates(float* a, float* b, const float* dt, const float* sa, int64_t M, int64_t h) override {
    op([=, this] { cpu_->gdn_gates(a, b, dt, sa, M, h); });
  }
  void gdn_recurrent(const float* q, const float* k, const float* v, const float* g, const float* b,
                     const float* si, float* st, float* o, float* sn, int64_t M, const GdnShape& s) override {
    op([=, this] { cpu_->gdn_recurrent(q, k, v, g, b, si, st, o, sn, M, s); });
  }
  void gdn_prepare_recurrent(const GdnRawInputs& in, float* st, float* o, const GdnPrepared* p, int64_t M,
                             const GdnShape& s) override {
    const bool has = p != nullptr;
    const GdnPrepared prep = has ? *p : GdnPrepared{};
    op([=, this] { cpu_->gdn_prepare_recurrent(in, st, o, has ? &prep : nullptr, M, s); });
  }
  void gdn_apply_rows_batch(std::span<const GdnApplyJob> jobs, int64_t M, const GdnShape& s) override {
    std::vector<GdnApplyJob> copy(jobs.begin(), jobs.end());  // the span does not outlive the capture
    op([=, this] { cpu_->gdn_apply_rows_batch(copy, M, s); });
  }
  void gdn_chunked(const float* q, const float* k, const float* v, const float* g, const float* b, float* st,
                   float* o, int64_t M, const GdnShape& s) override {
    op([=, this] { cpu_->gdn_chunked(q, k, v, g, b, st, o, M, s); });
  }
  void argmax(const float* x, int32_t* ids, int64_t M, int64_t n) override {
    op([=, this] { cpu_->argmax(x, ids, M, n); });
  }
  void top_k(const float* x, int32_t* ids, float* v, int64_t M, int64_t n, int64_t k) override {
    op([=, this] { cpu_->top_k(x, ids, v, M, n, k); });
  }
  void dflash_conv(const float* x, const float* b, const float* d, int64_t ds, const float* r, float* y, int64_t M,
                   int64_t C, int64_t K, int64_t g) override {
    op([=, this] { cpu_->dflash_conv(x, b, d, ds, r, y, M, C, K, g); });
  }
  void selector_walk(const float* pr, const float* su, const int32_t* c, const float* u, const float* g, int32_t* o,
                     int64_t rows, int64_t k, int64_t r) override {
    op([=, this] { cpu_->selector_walk(pr, su, c, u, g, o, rows, k, r); });
  }

  bool begin_capture() override {
    DFLASH_CHECK(!recording_, "nested capture");
    recording_ = std::make_shared<std::vector<std::function<void()>>>();
    ++captures;
    return true;
  }
  std::unique_ptr<StepGraph> end_capture() override {
    DFLASH_CHECK(recording_ != nullptr, "end_capture without begin_capture");
    auto g = std::make_unique<Graph>(*this, std::move(recording_));
    recording_ = nullptr;
    return g;
  }

  int captures = 0, replays = 0;

 private:
  struct Graph final : StepGraph {
    Graph(ReplayGraphBackend& be, std::shared_ptr<std::vector<std::function<void()>>> ops)
        : be_(be), ops_(std::move(ops)) {}
    void launch() override {
      ++be_.replays;
      for (const auto& f : *ops_) f();
    }
    ReplayGraphBackend& be_;
    std::shared_ptr<std::vector<std::function<void()>>> ops_;
  };
  template <typename F>
  void op(F&& f) {
    if (recording_)
      recording_->emplace_back(std::forward<F>(f));
    else
      f();
  }
  void no_capture(const char* what) const {
    DFLASH_CHECK(recording_ == nullptr, "{} inside a step-graph capture", what);
  }
  std::unique_ptr<Backend> cpu_;
  std::shared_ptr<std::vector<std::function<void()>>> recording_;
};

// A tiny synthetic target + drafter written under `tag`: {target path, drafter path, target spec}.
struct PairFiles {
  std::string tp, dp;
  SynthTargetSpec ts;
};
PairFiles synth_pair(const std::string& tag) {
  PairFiles f{temp_path(tag + "_target.gguf"), temp_path(tag + "_drafter.gguf"), tiny_target()};
  synth_target(f.ts, f.tp);
  synth_drafter(tiny_drafter(f.ts), f.dp);
  return f;
}

Pair load_replay_pair(const std::string& tp, const std::string& dp, int64_t max_rows, ReplayGraphBackend*& be) {
  Pair p;
  auto rb = std::make_unique<ReplayGraphBackend>();
  be = rb.get();
  p.be = std::move(rb);
  p.target_file = std::make_unique<gguf::File>(gguf::File::open(tp));
  p.drafter_file = std::make_unique<gguf::File>(gguf::File::open(dp));
  const DrafterConfig dc = read_drafter_config(*p.drafter_file);
  TargetOptions to;
  to.n_ctx = 512;
  to.max_rows = max_rows;
  to.tap_layers = dc.target_layers;
  p.target = TargetModel::load(*p.target_file, *p.be, to);
  p.drafter = DFlashDrafter::load(*p.drafter_file, *p.target, {});
  return p;
}

// Plain and speculative generation through replayed graphs == plain generation on the CPU backend.
TEST(GraphReplay, StepsFromRecordingsMatchDirectRuns) {
  const PairFiles f = synth_pair("replay");
  const SynthTargetSpec& ts = f.ts;
  Pair ref = load_pair(f.tp, f.dp, 8);
  ReplayGraphBackend* rb = nullptr;
  Pair rep = load_replay_pair(f.tp, f.dp, 8, rb);
  Engine plain_ref(*ref.target);
  Engine plain_rep(*rep.target);
  Engine spec_rep(*rep.target, rep.drafter.get());
  int64_t accepted = 0;
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    const auto prompt = random_tokens(5 + seed, seed, static_cast<int32_t>(ts.n_vocab));
    GenerateOptions o;
    o.max_tokens = 40;
    o.speculative = false;
    plain_ref.reset();
    const auto want = run(plain_ref, prompt, o);
    plain_rep.reset();
    ASSERT_EQ(run(plain_rep, prompt, o), want) << "plain decode from recordings, seed " << seed;
    for (int64_t B : {3, 8}) {
      o.speculative = true;
      o.block = B;
      spec_rep.reset();
      GenerateStats st;
      ASSERT_EQ(run(spec_rep, prompt, o, &st), want) << "speculative from recordings, seed " << seed << " B " << B;
      accepted += st.accepted;
    }
  }
  // Every kind of step was captured and then replayed many times.
  EXPECT_GE(rb->captures, 5);
  EXPECT_GT(rb->replays, 100);
  std::cout << "replay backend: " << rb->captures << " captures, " << rb->replays << " replays, " << accepted
            << " drafts accepted\n";
}

// The drafter and the target's undo driven in lockstep on both backends: appends of 1..8 rows with
// drafts in between (the draft and append graphs; the replay backend's lm_head takes 8 rows where the CPU's
// takes 7, matmul_rows_for), and verify + rollback of every kept-row count (the rollback graphs): the same
// drafts and the same argmax, step for step. (Speculative output is the
// plain output whatever the drafter proposes, so the test above cannot see a drafter-side fault.)
TEST(GraphReplay, DrafterAndRollbackInLockstep) {
  const PairFiles f = synth_pair("replay2");
  const SynthTargetSpec& ts = f.ts;
  Pair ref = load_pair(f.tp, f.dp, 8);
  ReplayGraphBackend* rb = nullptr;
  Pair rep = load_replay_pair(f.tp, f.dp, 8, rb);
  const DrafterConfig& dc = ref.drafter->config();
  const int64_t width = dc.n_taps() * dc.n_embd;
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int step = 0; step < 40; ++step) {
    const int64_t rows = 1 + static_cast<int64_t>(rng() % 8);
    std::vector<float> taps(static_cast<size_t>(rows * width));
    for (float& t : taps) t = nd(rng);
    ref.drafter->append_context(taps, rows);
    rep.drafter->append_context(taps, rows);
    const int32_t anchor = static_cast<int32_t>(rng() % ts.n_vocab);
    ASSERT_EQ(rep.drafter->draft(anchor), ref.drafter->draft(anchor)) << "step " << step;
  }
  ForwardOptions undo;
  undo.logits = LogitRows::kAll;
  undo.undoable = true;
  ForwardOptions last;
  last.logits = LogitRows::kLast;
  const auto prompt = random_tokens(9, 3, static_cast<int32_t>(ts.n_vocab));
  ASSERT_EQ(prefill(*rep.target, prompt), prefill(*ref.target, prompt));
  for (int step = 0; step < 30; ++step) {
    const auto block = random_tokens(8, 100 + step, static_cast<int32_t>(ts.n_vocab));
    ASSERT_EQ(rep.target->forward(block, undo).argmax, ref.target->forward(block, undo).argmax) << "step " << step;
    const int64_t keep = 1 + step % 8;
    rep.target->rollback(keep);
    ref.target->rollback(keep);
    const int32_t next[1] = {block[static_cast<size_t>(keep - 1)]};
    ASSERT_EQ(rep.target->forward(next, last).argmax, ref.target->forward(next, last).argmax) << "step " << step;
  }
  EXPECT_GT(rb->replays, 50);
}

}  // namespace
}  // namespace dflash
