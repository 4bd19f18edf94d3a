// Runs the built `dflash` binary on generated files: info (text and JSON), error exits, usage exits,
// and the quantization acceptance check against the shared ggml test vectors: quantize `input` with
// `dflash quantize`, compare the bytes with the reference `quant`, dump them with `dflash dump` and
// compare the floats with the reference `dequant`, bit for bit.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "gguf/gguf.h"
#include "support/run_binary.h"
#include "util/error.h"

namespace dflash::cli::test {
namespace {

namespace fs = std::filesystem;
using gguf::File;
using gguf::Value;
using gguf::Writer;

const fs::path kVectors = DFLASH_SOURCE_DIR "/../shared/testdata/quants";

using testing::shell_quote;
using testing::slurp;
using Result = testing::RunResult;
std::string quote(const std::string& s) { return shell_quote(s); }

using Cli = testing::BinaryTest;

std::vector<uint8_t> bytes_of(std::span<const uint8_t> s) { return {s.begin(), s.end()}; }

fs::path write_small(const fs::path& p) {
  Writer w;
  w.set("general.architecture", Value::string("test"));
  w.set("general.name", Value::string(std::string(300, 'n')));
  w.set("tokenizer.ggml.tokens", Value::string_array({"a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k"}));
  w.set("test.scale", Value::f32(0.5f));
  std::vector<float> x(64 * 3);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i) * 0.25f - 3.0f;
  w.add_tensor("blk.0.ffn_up.weight", GgmlType::F32, {64, 3},
               {reinterpret_cast<const uint8_t*>(x.data()), x.size() * sizeof(float)});
  w.add_tensor("blk.0.norm.weight", GgmlType::F32, {64}, {reinterpret_cast<const uint8_t*>(x.data()), 64 * 4});
  w.add_tensor("blk.0.odd.weight", GgmlType::F32, {3, 2}, {reinterpret_cast<const uint8_t*>(x.data()), 6 * 4});
  w.write(p.string());
  return p;
}

TEST_F(Cli, HelpAndVersion) {
  Result r = run("--help");
  EXPECT_EQ(r.code, 0) << r.err;
  for (const char* sub : {"info", "quantize", "dump"}) EXPECT_NE(r.out.find(sub), std::string::npos) << r.out;
  r = run("--version");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("dflash "), std::string::npos) << r.out;
}

TEST_F(Cli, UsageErrorsExit2) {
  EXPECT_EQ(run("").code, 2);
  EXPECT_EQ(run("no-such-command").code, 2);
  EXPECT_EQ(run("info").code, 2);                       // missing FILE
  EXPECT_EQ(run("info a.gguf --bogus").code, 2);        // unknown option
  EXPECT_EQ(run("quantize a.gguf b.gguf").code, 2);     // missing --type
  EXPECT_EQ(run("dump a.gguf").code, 2);                // missing --tensor
  EXPECT_EQ(run("dump a.gguf --tensor x --limit abc").code, 2);
}

TEST_F(Cli, InfoText) {
  const fs::path p = write_small(path("small.gguf"));
  Result r = run("info " + quote(p.string()));
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* want : {"GGUF version 3", "alignment 32", "4 keys", "3 tensors", "general.architecture",
                           "\"test\"", "array<string>[11]", "... (11 items)", "... (300 bytes)",
                           "blk.0.ffn_up.weight", "[64, 3]", "768", "totals by type", "f32"})
    EXPECT_NE(r.out.find(want), std::string::npos) << want << "\n" << r.out;
}

TEST_F(Cli, InfoJson) {
  const fs::path p = write_small(path("small.gguf"));
  Result r = run("info --json " + quote(p.string()));
  ASSERT_EQ(r.code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["version"], 3);
  EXPECT_EQ(j["n_tensors"], 3);
  EXPECT_EQ(j["n_kv"], 4);
  EXPECT_EQ(j["file_size"], fs::file_size(p));
  EXPECT_EQ(j["metadata"][0]["key"], "general.architecture");
  EXPECT_EQ(j["metadata"][0]["value"], "test");
  EXPECT_EQ(j["metadata"][2]["value"]["length"], 11);
  EXPECT_EQ(j["metadata"][2]["value"]["first"][0], "a");
  EXPECT_EQ(j["metadata"][3]["value"], 0.5);
  EXPECT_EQ(j["tensors"][0]["shape"], nlohmann::json({64, 3}));
  EXPECT_EQ(j["tensors"][0]["bytes"], 768);
  EXPECT_EQ(j["totals"]["f32"]["tensors"], 3);
}

TEST_F(Cli, InfoOnRealTestVector) {
  Result r = run("info " + quote((kVectors / "q4_k.gguf").string()));
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* want : {"test.type_name", "\"q4_k\"", "quant", "q4_k", "[1024, 20]", "11520"})
    EXPECT_NE(r.out.find(want), std::string::npos) << want << "\n" << r.out;
}

TEST_F(Cli, BrokenFileExits1WithReason) {
  fs::path p = write_small(path("broken.gguf"));
  {
    std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
    f.write("XXXX", 4);
  }
  Result r = run("info " + quote(p.string()));
  EXPECT_EQ(r.code, 1);
  EXPECT_EQ(r.err.rfind("dflash: error: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find("bad magic"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(p.string()), std::string::npos) << r.err;

  r = run("info " + quote(path("missing.gguf").string()));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("cannot open"), std::string::npos) << r.err;

  r = run("dump " + quote(write_small(path("ok.gguf")).string()) + " --tensor nope");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("tensor 'nope' not found"), std::string::npos) << r.err;
}

TEST_F(Cli, QuantizeUnknownTypeListsValidNames) {
  const fs::path p = write_small(path("small.gguf"));
  Result r = run("quantize " + quote(p.string()) + " " + quote(path("out.gguf").string()) + " --type q3_z");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("unknown quantization type 'q3_z'"), std::string::npos) << r.err;
  for (const char* name : {"q4_k", "q8_0", "ptq1_0", "pq2_0", "f16"})
    EXPECT_NE(r.err.find(name), std::string::npos) << r.err;
  r = run("quantize " + quote(p.string()) + " " + quote(path("out.gguf").string()) + " --type i8");
  EXPECT_EQ(r.code, 1) << "i8 has no codec";
}

TEST_F(Cli, QuantizeSelectsWeightMatrices) {
  const fs::path in = write_small(path("small.gguf"));
  const fs::path out = path("out.gguf");
  Result r = run("quantize " + quote(in.string()) + " " + quote(out.string()) + " --type q8_0 -j 3");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("size ratio"), std::string::npos) << r.out;
  File a = File::open(in.string());
  File b = File::open(out.string());
  EXPECT_EQ(b.metadata().size(), a.metadata().size());
  EXPECT_EQ(b.get_string("general.architecture"), "test");
  EXPECT_EQ(b.tensor("blk.0.ffn_up.weight").type, GgmlType::Q8_0);   // converted
  EXPECT_EQ(b.tensor("blk.0.norm.weight").type, GgmlType::F32);      // 1-D: kept
  EXPECT_EQ(b.tensor("blk.0.odd.weight").type, GgmlType::F32);       // 3 not a multiple of 32: kept
  EXPECT_EQ(bytes_of(b.tensor_data(b.tensor("blk.0.norm.weight"))),
            bytes_of(a.tensor_data(a.tensor("blk.0.norm.weight"))));
  // Dump as text: one row per line plus header and summary.
  r = run("dump " + quote(out.string()) + " --tensor blk.0.ffn_up.weight --limit 2");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("# blk.0.ffn_up.weight q8_0 [64, 3]"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("... (1 more rows)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("192 elements"), std::string::npos) << r.out;
  // F32 dump of the untouched tensor gives the exact input values.
  r = run("dump " + quote(out.string()) + " --tensor blk.0.odd.weight");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("-3 -2.75 -2.5\n-2.25 -2 -1.75\n"), std::string::npos) << r.out;
}

// The acceptance check: `dflash quantize` + `dflash dump` reproduce ggml's reference quantizer and
// dequantizer on the shared test vectors, bit for bit.
TEST_F(Cli, QuantizeAndDumpMatchReferenceVectors) {
  int checked = 0;
  for (const auto& entry : fs::directory_iterator(kVectors)) {
    if (entry.path().extension() != ".gguf") continue;
    SCOPED_TRACE(entry.path().filename().string());
    File ref = File::open(entry.path().string());
    const std::string type = ref.get_string("test.type_name");
    const GgmlType t = *type_from_name(type);
    const gguf::TensorInfo& input = ref.tensor("input");
    ASSERT_EQ(input.type, GgmlType::F32);

    const fs::path in = path(type + "_in.gguf"), out = path(type + "_out.gguf"), raw = path(type + "_dq.bin");
    Writer w;
    w.add_tensor("input.weight", GgmlType::F32, {input.ne[0], input.ne[1]}, ref.tensor_data(input));
    w.write(in.string());

    Result r = run(fmt::format("quantize {} {} --type {}", quote(in.string()), quote(out.string()), type));
    ASSERT_EQ(r.code, 0) << r.err;
    File q = File::open(out.string());
    const gguf::TensorInfo& qt = q.tensor("input.weight");
    EXPECT_EQ(qt.type, t);
    EXPECT_EQ(qt.shape_string(), "[1024, 20]");
    const auto got = bytes_of(q.tensor_data(qt));
    const auto want = bytes_of(ref.tensor_data(ref.tensor("quant")));  // raw block bytes (also the I8 case)
    ASSERT_EQ(got.size(), want.size());
    size_t first_diff = got.size();
    for (size_t i = 0; i < got.size(); ++i)
      if (got[i] != want[i]) {
        first_diff = i;
        break;
      }
    EXPECT_EQ(first_diff, got.size()) << type << ": quantized bytes differ first at byte " << first_diff
                                      << " (row " << first_diff / row_bytes(t, 1024) << ")";

    r = run(fmt::format("dump {} --tensor input.weight --out {}", quote(out.string()), quote(raw.string())));
    ASSERT_EQ(r.code, 0) << r.err;
    const std::string floats = slurp(raw);
    const auto dq = bytes_of(ref.tensor_data(ref.tensor("dequant")));
    ASSERT_EQ(floats.size(), dq.size());
    // Dequantizing the reference bytes must give the reference floats; when the quantized bytes
    // matched, our dump is exactly that.
    if (first_diff == got.size()) {
      EXPECT_EQ(std::memcmp(floats.data(), dq.data(), dq.size()), 0) << type << ": dequantized floats differ";
    }
    ++checked;
  }
  EXPECT_EQ(checked, 13);
}

// The 27B drafter preset keeps its shape with --target: a target that does not fit is an error naming
// both shapes (it used to be silently replaced by a drafter shaped for the target).
TEST_F(Cli, SynthDrafterPresetWithATargetThatDoesNotFit) {
  const std::string t = path("tiny_target.gguf").string(), d = path("preset_drafter.gguf").string();
  ASSERT_EQ(run("synth " + quote(t)).code, 0);
  const Result r = run("synth-drafter " + quote(d) + " --preset qwen38-27b --target " + quote(t));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("qwen38-27b preset (hidden 5120"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(d));
  EXPECT_EQ(run("synth-drafter " + quote(d) + " --target " + quote(t)).code, 0);  // shaped for it
}

}  // namespace
}  // namespace dflash::cli::test
