// Target model tests on tiny synthetic qwen35 / qwen3 files: row-count independence (the
// lossless contract), rollback, chunked prefill, prefix reuse, taps, shape errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include "gguf/gguf.h"
#include "models/synth.h"
#include "models/target.h"
#include "prism/hadamard.h"
#include "spec/engine.h"
#include "support/temp_dir.h"
#include "util/error.h"

namespace dflash {
namespace {

namespace fs = std::filesystem;

// Per-process directory: ctest runs every test case as its own process, in parallel.
std::string temp_path(const std::string& name) { return dflash::testing::temp_path("models_test", name); }

SynthTargetSpec tiny(const std::string& arch, GgmlType t = GgmlType::F32, bool prism = false) {
  SynthTargetSpec s;
  s.arch = arch;
  s.n_layer = 4;
  s.n_embd = 256;
  s.n_ff = 512;
  s.n_vocab = 512;
  s.n_head = 4;
  s.n_head_kv = 2;
  s.head_dim = 64;  // q width 256 and GDN inner 256: every matmul input a multiple of 256 (K-quants)
  s.n_rot = arch == "qwen35" ? 16 : 64;
  s.ssm_k_heads = 2;
  s.ssm_v_heads = 4;
  s.ssm_head_k = 32;
  s.ssm_head_v = 64;
  s.matmul_type = t;
  s.prism = prism;
  s.prism_block = 128;
  s.seed = 7;
  return s;
}

struct Loaded {
  std::unique_ptr<Backend> be;
  std::unique_ptr<gguf::File> file;
  std::unique_ptr<TargetModel> model;
};

Loaded load(const SynthTargetSpec& spec, const std::string& name, TargetOptions opts = {}) {
  const std::string path = temp_path(name);
  synth_target(spec, path);
  Loaded l;
  l.be = make_cpu_backend(2);
  l.file = std::make_unique<gguf::File>(gguf::File::open(path));
  if (opts.tap_layers.empty()) opts.tap_layers = {1, 3, static_cast<int64_t>(spec.n_layer)};
  opts.n_ctx = 512;
  l.model = TargetModel::load(*l.file, *l.be, opts);
  return l;
}

std::vector<int32_t> random_tokens(size_t n, uint32_t seed, int32_t vocab) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

struct Case {
  const char* arch;
  GgmlType type;
  bool prism;
};

class TargetModelTest : public ::testing::TestWithParam<Case> {};

// Two copies of the case's tiny model, both prefilled with `prompt`: one takes the path under test, the
// other the reference path.
struct Twins {
  Loaded a, b;
};
Twins load_prefilled_twins(const Case& c, const std::string& name, std::span<const int32_t> prompt) {
  Twins t{load(tiny(c.arch, c.type, c.prism), name + "_" + c.arch + ".gguf"),
          load(tiny(c.arch, c.type, c.prism), name + "_b_" + c.arch + ".gguf")};
  prefill(*t.a.model, prompt);
  prefill(*t.b.model, prompt);
  return t;
}

// Each row of an M-row forward gets the same logits and taps, bit for bit, as one-row forwards.
TEST_P(TargetModelTest, MultiRowForwardIsBitIdenticalToSingleRows) {
  auto [a, b] = load_prefilled_twins(GetParam(), "rows", random_tokens(13, 1, 500));
  const auto block = random_tokens(8, 2, 500);
  ForwardOptions all;
  all.logits = LogitRows::kAll;
  all.want_logits = true;
  all.want_taps = true;
  all.undoable = true;
  const ForwardResult multi = a.model->forward(block, all);
  const int64_t V = a.model->config().n_vocab;
  const size_t tap_w = multi.taps.size() / block.size();
  for (size_t m = 0; m < block.size(); ++m) {
    ForwardOptions one = all;
    one.undoable = false;
    const ForwardResult r = b.model->forward(std::span(block).subspan(m, 1), one);
    ASSERT_EQ(0, std::memcmp(r.logits.data(), multi.logits.data() + m * V, V * sizeof(float))) << "row " << m;
    ASSERT_EQ(0, std::memcmp(r.taps.data(), multi.taps.data() + m * tap_w, tap_w * sizeof(float))) << "row " << m;
    EXPECT_EQ(r.argmax[0], multi.argmax[m]);
  }
}

// After rollback(k), the state equals that of a run that only ever saw the first k rows.
TEST_P(TargetModelTest, RollbackEqualsNeverSeeingTheRows) {
  auto [a, b] = load_prefilled_twins(GetParam(), "undo", random_tokens(9, 3, 500));
  for (int64_t keep = 1; keep <= 6; ++keep) {
    const auto block = random_tokens(6, 10 + keep, 500);
    ForwardOptions u;
    u.undoable = true;
    a.model->forward(block, u);
    a.model->rollback(keep);
    ForwardOptions plain;
    b.model->forward(std::span(block).subspan(0, keep), plain);
    ASSERT_EQ(a.model->n_past(), b.model->n_past());
    // Continue both with the same next tokens: identical logits prove identical state.
    const auto next = random_tokens(3, 100 + keep, 500);
    ForwardOptions lo;
    lo.want_logits = true;
    lo.undoable = true;
    const ForwardResult ra = a.model->forward(next, lo);
    const ForwardResult rb = b.model->forward(next, lo);
    ASSERT_EQ(ra.logits, rb.logits) << "keep " << keep;
    a.model->rollback(1);
    b.model->rollback(1);
  }
  // After a rollback whatever forward comes next starts from the kept rows' state: a one-row decode step,
  // and a prefill chunk (the chunked GDN form).
  ForwardOptions lo;
  lo.want_logits = true;
  for (int64_t rows : {int64_t{1}, int64_t{40}}) {
    ForwardOptions u;
    u.undoable = true;
    const auto block = random_tokens(5, 300 + rows, 500);
    a.model->forward(block, u);
    a.model->rollback(2);
    b.model->forward(std::span(block).subspan(0, 2), ForwardOptions{});
    const auto next = random_tokens(rows, 400 + rows, 500);
    const ForwardResult ra = a.model->forward(next, lo);
    const ForwardResult rb = b.model->forward(next, lo);
    ASSERT_EQ(ra.logits, rb.logits) << rows << " rows after a rollback";
  }
}

// An undoable forward whose rows are all kept needs no rollback: whatever forward comes next (another
// undoable block, a one-row decode step, a prefill chunk, or a rollback keeping every row) sees the
// state of a plain forward of those rows. (An undoable forward leaves the GDN states as they were and
// records the rows' updates; they are applied when the next call needs them.)
TEST_P(TargetModelTest, UndoableForwardWithoutRollbackKeepsEveryRow) {
  auto [a, b] = load_prefilled_twins(GetParam(), "keep", random_tokens(7, 5, 500));
  ForwardOptions u, lo;
  u.undoable = true;
  lo.want_logits = true;
  int64_t seed = 600;
  for (int64_t next_rows : {int64_t{4}, int64_t{1}, int64_t{40}, int64_t{0}}) {
    const auto block = random_tokens(5, seed++, 500);
    a.model->forward(block, u);
    b.model->forward(block, ForwardOptions{});
    if (next_rows == 0) {  // a rollback that keeps every row, then one decode step
      a.model->rollback(5);
      next_rows = 1;
    }
    const auto next = random_tokens(next_rows, seed++, 500);
    ForwardOptions nu = lo;
    nu.undoable = next_rows <= 8;  // the next block undoable too (and left without a rollback again)
    const ForwardResult ra = a.model->forward(next, nu);
    const ForwardResult rb = b.model->forward(next, lo);
    ASSERT_EQ(a.model->n_past(), b.model->n_past());
    ASSERT_EQ(ra.logits, rb.logits) << next_rows << " rows after an undoable forward without a rollback";
  }
}

// Prefill in chunks of any size gives the same greedy continuation (chunked GDN is exact up to
// rounding, so compare argmax sequences rather than bits).
TEST_P(TargetModelTest, ChunkedPrefillMatchesTokenByToken) {
  const Case c = GetParam();
  TargetOptions big;
  big.max_rows = 64;
  TargetOptions one;
  one.max_rows = 1;
  Loaded a = load(tiny(c.arch, c.type, c.prism), std::string("chunk_") + c.arch + ".gguf", big);
  Loaded b = load(tiny(c.arch, c.type, c.prism), std::string("chunk_b_") + c.arch + ".gguf", one);
  const auto prompt = random_tokens(150, 5, 500);
  Engine ea(*a.model), eb(*b.model);
  GenerateOptions go;
  go.max_tokens = 12;
  std::vector<int32_t> outa, outb;
  ea.generate(prompt, go, [&](int32_t t) { outa.push_back(t); return true; });
  eb.generate(prompt, go, [&](int32_t t) { outb.push_back(t); return true; });
  EXPECT_EQ(outa, outb);
}

// A second turn that extends the first reuses the cache and produces what a fresh run produces.
TEST_P(TargetModelTest, PrefixReuseAcrossTurns) {
  const Case c = GetParam();
  Loaded a = load(tiny(c.arch, c.type, c.prism), std::string("reuse_") + c.arch + ".gguf");
  Loaded b = load(tiny(c.arch, c.type, c.prism), std::string("reuse_b_") + c.arch + ".gguf");
  Engine ea(*a.model), eb(*b.model);
  GenerateOptions go;
  go.max_tokens = 6;
  auto prompt = random_tokens(20, 9, 500);
  std::vector<int32_t> out1;
  ea.generate(prompt, go, [&](int32_t t) { out1.push_back(t); return true; });
  // Turn 2 = turn 1's prompt + its answer + a new user message.
  std::vector<int32_t> prompt2 = prompt;
  prompt2.insert(prompt2.end(), out1.begin(), out1.end());
  const auto more = random_tokens(7, 11, 500);
  prompt2.insert(prompt2.end(), more.begin(), more.end());
  std::vector<int32_t> out2, fresh;
  const GenerateStats st = ea.generate(prompt2, go, [&](int32_t t) { out2.push_back(t); return true; });
  eb.generate(prompt2, go, [&](int32_t t) { fresh.push_back(t); return true; });
  EXPECT_EQ(st.reused_tokens, static_cast<int64_t>(prompt.size() + out1.size() - 1));
  EXPECT_EQ(out2, fresh);
}

INSTANTIATE_TEST_SUITE_P(Archs, TargetModelTest,
                         ::testing::Values(Case{"qwen35", GgmlType::F32, false}, Case{"qwen3", GgmlType::F32, false},
                                           Case{"qwen35", GgmlType::Q8_0, true},
                                           Case{"qwen35", GgmlType::PTQ1_0, true},
                                           Case{"qwen35", GgmlType::Q4_K, false}),
                         [](const auto& info) {
                           return std::string(info.param.arch) + "_" + type_name(info.param.type) +
                                  (info.param.prism ? "_prism" : "");
                         });

// ---- error paths ------------------------------------------------------------------------------

std::string load_error(const std::function<void(gguf::Writer&)>& mutate, const SynthTargetSpec& spec,
                       const std::string& skip_tensor = "") {
  // Rebuild the synthetic file through a Writer copy with one change.
  const std::string src = temp_path("err_src.gguf");
  synth_target(spec, src);
  gguf::File f = gguf::File::open(src);
  gguf::Writer w;
  for (const auto& kv : f.metadata())
    if (kv.key != "general.alignment") w.set(kv.key, kv.value);
  for (const auto& t : f.tensors()) {
    if (t.name == skip_tensor) continue;
    auto d = f.tensor_data(t);
    std::vector<int64_t> ne(t.ne, t.ne + t.n_dims);
    w.add_tensor(t.name, t.type, ne, d);
  }
  mutate(w);
  const std::string dst = temp_path("err_dst.gguf");
  w.write(dst);
  auto be = make_cpu_backend(1);
  gguf::File g = gguf::File::open(dst);
  try {
    TargetModel::load(g, *be, {});
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(TargetModelErrors, WrongShapeNamesTensorAndShape) {
  SynthTargetSpec s = tiny("qwen35");
  const std::string msg = load_error(
      [&](gguf::Writer& w) {
        std::vector<float> bad(256 * 100, 0.0f);
        w.add_tensor("blk.1.ffn_up.weight", GgmlType::F32, {256, 100},
                     std::span(reinterpret_cast<const uint8_t*>(bad.data()), bad.size() * 4));
      },
      s, "blk.1.ffn_up.weight");
  EXPECT_NE(msg.find("blk.1.ffn_up.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[256, 512]"), std::string::npos) << msg;
}

TEST(TargetModelErrors, MissingKeyIsNamed) {
  SynthTargetSpec s = tiny("qwen35");
  const std::string msg = load_error(
      [&](gguf::Writer& w) { w.set("qwen35.ssm.group_count", gguf::Value::string("sixteen")); }, s);
  EXPECT_NE(msg.find("qwen35.ssm.group_count"), std::string::npos) << msg;
}

TEST(TargetModelErrors, ContextOverflowIsAClearError) {
  Loaded a = load(tiny("qwen3"), "ctx.gguf");
  const auto prompt = random_tokens(64, 1, 500);
  for (int i = 0; i < 8; ++i) prefill(*a.model, prompt);  // 512 = n_ctx
  try {
    prefill(*a.model, prompt);
    FAIL() << "no error on context overflow";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("context"), std::string::npos) << e.what();
  }
}

TEST(TargetModelErrors, UnknownArchitecture) {
  SynthTargetSpec s = tiny("qwen3");
  const std::string msg =
      load_error([&](gguf::Writer& w) { w.set("general.architecture", gguf::Value::string("llama")); }, s);
  EXPECT_NE(msg.find("llama"), std::string::npos) << msg;
}

}  // namespace
}  // namespace dflash

namespace dflash {
namespace {

// A tied lm_head over a prism-rotated embedding (stored rows H(s (.) e), no output.weight) must
// give the logits of the plain tied model: the lm_head input takes the forward rotation.
TEST(TargetModelPrism, TiedEmbeddingRotatedGivesPlainLogits) {
  SynthTargetSpec s = tiny("qwen3");
  s.tied_output = true;
  const std::string plain_path = temp_path("tied_plain.gguf");
  synth_target(s, plain_path);
  gguf::File plain = gguf::File::open(plain_path);

  const int64_t E = s.n_embd, block = 128;
  std::vector<float> signs(E);
  for (int64_t i = 0; i < E; ++i) signs[i] = (i * 7 + 3) % 5 < 2 ? -1.0f : 1.0f;
  gguf::Writer w;
  for (const auto& kv : plain.metadata())
    if (kv.key != "general.alignment") w.set(kv.key, kv.value);
  std::vector<gguf::Value> sv;
  for (float x : signs) sv.push_back(gguf::Value::f32(x));
  w.set("prism.hadamard.version", gguf::Value::u32(1));
  w.set("prism.hadamard.block_size", gguf::Value::u32(block));
  w.set("prism.hadamard.transform", gguf::Value::string("normalized-sylvester-walsh-hadamard"));
  w.set("prism.hadamard.axis", gguf::Value::string("input-last-dimension"));
  w.set("prism.hadamard.sign_mode", gguf::Value::string("explicit"));
  w.set("prism.hadamard.sign_widths", gguf::Value::array(gguf::ValueType::U32, {gguf::Value::u32(E)}));
  w.set("prism.hadamard.sign_values", gguf::Value::array(gguf::ValueType::F32, sv));
  w.set("prism.hadamard.weight_names", gguf::Value::array(gguf::ValueType::STRING, {}));
  w.set("prism.hadamard.inverse_weight_names",
        gguf::Value::array(gguf::ValueType::STRING, {gguf::Value::string("token_embd.weight")}));
  for (const auto& t : plain.tensors()) {
    auto d = plain.tensor_data(t);
    std::vector<int64_t> ne(t.ne, t.ne + t.n_dims);
    if (t.name != "token_embd.weight") {
      w.add_tensor(t.name, t.type, ne, d);
      continue;
    }
    ASSERT_EQ(t.type, GgmlType::F32);
    std::vector<float> rows(d.size() / 4);
    std::memcpy(rows.data(), d.data(), d.size());
    for (int64_t r = 0; r < t.ne[1]; ++r) prism::rotate_weight_row(&rows[r * E], signs.data(), &rows[r * E], E, block);
    w.add_tensor(t.name, t.type, ne, std::span(reinterpret_cast<const uint8_t*>(rows.data()), rows.size() * 4));
  }
  const std::string rot_path = temp_path("tied_rot.gguf");
  w.write(rot_path);
  gguf::File rotated = gguf::File::open(rot_path);

  auto be = make_cpu_backend(2);
  auto a = TargetModel::load(plain, *be, {});
  auto b = TargetModel::load(rotated, *be, {});
  const auto prompt = random_tokens(10, 4, 500);
  ForwardOptions o;
  o.want_logits = true;
  const ForwardResult ra = a->forward(prompt, o), rb = b->forward(prompt, o);
  ASSERT_EQ(ra.logits.size(), rb.logits.size());
  double max_err = 0, max_ref = 0;
  for (size_t i = 0; i < ra.logits.size(); ++i) {
    max_err = std::max(max_err, (double)std::fabs(ra.logits[i] - rb.logits[i]));
    max_ref = std::max(max_ref, (double)std::fabs(ra.logits[i]));
  }
  EXPECT_LT(max_err, 1e-4 * max_ref) << "max abs error " << max_err << " of max |logit| " << max_ref;
  EXPECT_EQ(ra.argmax, rb.argmax);
}

}  // namespace
}  // namespace dflash
