// PrismRotation: metadata written with gguf::Writer and read back, and every rejected variant.
#include <gtest/gtest.h>

#include <functional>

#include "gguf/gguf.h"
#include "prism/rotation.h"
#include "util/error.h"

namespace dflash::prism {
namespace {

using gguf::Value;
using gguf::ValueType;

Value strings(std::vector<std::string> v) {
  std::vector<Value> items;
  for (auto& s : v) items.push_back(Value::string(std::move(s)));
  return Value::array(ValueType::STRING, std::move(items));
}

Value ints(std::vector<int64_t> v, ValueType t = ValueType::U32) {
  std::vector<Value> items;
  for (int64_t x : v) items.push_back(t == ValueType::I8 ? Value::i8(int8_t(x)) : Value::u32(uint32_t(x)));
  return Value::array(t, std::move(items));
}

Value floats(const std::vector<float>& v) {
  std::vector<Value> items;
  for (float x : v) items.push_back(Value::f32(x));
  return Value::array(ValueType::F32, std::move(items));
}

// Signs for widths 1024 and 2048: alternating per width so each vector is recognisable.
std::vector<float> test_signs() {
  std::vector<float> s;
  for (int i = 0; i < 1024; ++i) s.push_back(i % 3 == 0 ? -1.0f : 1.0f);
  for (int i = 0; i < 2048; ++i) s.push_back(i % 2 == 0 ? 1.0f : -1.0f);
  return s;
}

gguf::Writer good_writer() {
  gguf::Writer w;
  w.set("general.architecture", Value::string("qwen35"));
  w.set("prism.hadamard.version", Value::u32(1));
  w.set("prism.hadamard.block_size", Value::u32(1024));
  w.set("prism.hadamard.transform", Value::string("normalized-sylvester-walsh-hadamard"));
  w.set("prism.hadamard.axis", Value::string("input-last-dimension"));
  w.set("prism.hadamard.sign_mode", Value::string("explicit"));
  w.set("prism.hadamard.sign_widths", ints({1024, 2048}));
  w.set("prism.hadamard.sign_values", floats(test_signs()));
  w.set("prism.hadamard.weight_names", strings({"blk.0.attn_qkv.weight", "blk.0.ssm_out.weight", "output.weight"}));
  w.set("prism.hadamard.inverse_weight_names", strings({"token_embd.weight"}));
  w.set("prism.hadamard.gdn_v_grouped", Value::boolean(true));
  return w;
}

std::optional<PrismRotation> read(const gguf::Writer& w) {
  return PrismRotation::from_gguf(gguf::File::from_bytes(w.to_bytes(), "prism-test.gguf"));
}

TEST(PrismRotationMeta, ReadsWhatWasWritten) {
  auto r = read(good_writer());
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->version, 1);
  EXPECT_EQ(r->block_size, 1024);
  EXPECT_EQ(r->sign_widths, (std::vector<int64_t>{1024, 2048}));
  EXPECT_TRUE(r->gdn_v_grouped);
  const auto all = test_signs();
  EXPECT_EQ(r->signs_for_width(1024), std::vector<float>(all.begin(), all.begin() + 1024));
  EXPECT_EQ(r->signs_for_width(2048), std::vector<float>(all.begin() + 1024, all.end()));
  EXPECT_TRUE(r->has_width(2048));
  EXPECT_FALSE(r->has_width(5120));
  EXPECT_THROW(r->signs_for_width(5120), Error);
  EXPECT_TRUE(r->is_rotated("blk.0.ssm_out.weight"));
  EXPECT_TRUE(r->is_rotated("output.weight"));
  EXPECT_FALSE(r->is_rotated("token_embd.weight"));
  EXPECT_FALSE(r->is_rotated("blk.0.ssm_alpha.weight"));
  EXPECT_TRUE(r->is_inverse("token_embd.weight"));
  EXPECT_FALSE(r->is_inverse("output.weight"));
}

TEST(PrismRotationMeta, PlainFileHasNoRotationAndOptionalKeysDefault) {
  gguf::Writer plain;
  plain.set("general.architecture", Value::string("qwen35"));
  EXPECT_FALSE(read(plain).has_value());

  // Integer sign values are accepted; inverse names and gdn_v_grouped are optional.
  std::vector<int64_t> iv;
  for (float f : test_signs()) iv.push_back(int64_t(f));
  gguf::Writer w2;
  for (const auto& key : {"prism.hadamard.version", "prism.hadamard.block_size", "prism.hadamard.transform",
                          "prism.hadamard.axis", "prism.hadamard.sign_mode", "prism.hadamard.sign_widths",
                          "prism.hadamard.weight_names"}) {
    const auto bytes = good_writer().to_bytes();
    w2.set(key, *gguf::File::from_bytes(bytes).find(key));
  }
  w2.set("prism.hadamard.sign_values", ints(iv, ValueType::I8));
  auto r = read(w2);
  ASSERT_TRUE(r.has_value());
  EXPECT_FALSE(r->gdn_v_grouped);
  EXPECT_TRUE(r->inverse_weight_names.empty());
  EXPECT_EQ(r->signs_for_width(1024)[0], -1.0f);
}

TEST(PrismRotationMeta, SmallerPowerOfTwoBlockForTinyModels) {
  gguf::Writer w = good_writer();
  w.set("prism.hadamard.block_size", Value::u32(256));
  auto r = read(w);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->block_size, 256);
  // Widths must be multiples of the block.
  w.set("prism.hadamard.block_size", Value::u32(2048));
  EXPECT_THROW(read(w), Error);
}

// Each broken variant must throw an Error whose message names the offending key.
TEST(PrismRotationMeta, RejectsBadMetadataNamingTheKey) {
  struct Bad {
    std::string key;
    std::function<void(gguf::Writer&)> edit;
  };
  auto bad_signs = test_signs();
  bad_signs[1500] = 0.5f;
  std::vector<Bad> cases = {
      {"prism.hadamard.version", [](gguf::Writer& w) { w.set("prism.hadamard.version", Value::u32(2)); }},
      {"prism.hadamard.block_size", [](gguf::Writer& w) { w.set("prism.hadamard.block_size", Value::u32(1000)); }},
      {"prism.hadamard.transform",
       [](gguf::Writer& w) { w.set("prism.hadamard.transform", Value::string("randomized-hadamard")); }},
      {"prism.hadamard.axis", [](gguf::Writer& w) { w.set("prism.hadamard.axis", Value::string("output")); }},
      {"prism.hadamard.sign_mode", [](gguf::Writer& w) { w.set("prism.hadamard.sign_mode", Value::string("seed")); }},
      {"prism.hadamard.sign_widths", [](gguf::Writer& w) { w.set("prism.hadamard.sign_widths", ints({1024, 2000})); }},
      {"prism.hadamard.sign_widths", [](gguf::Writer& w) { w.set("prism.hadamard.sign_widths", ints({1024, 1024})); }},
      {"prism.hadamard.sign_values",
       [bad_signs](gguf::Writer& w) { w.set("prism.hadamard.sign_values", floats(bad_signs)); }},
      {"prism.hadamard.sign_values",
       [](gguf::Writer& w) { w.set("prism.hadamard.sign_values", floats(std::vector<float>(3000, 1.0f))); }},
      {"prism.hadamard.sign_values",
       [](gguf::Writer& w) { w.set("prism.hadamard.sign_values", Value::string("+-+-")); }},
      {"prism.hadamard.weight_names", [](gguf::Writer& w) { w.set("prism.hadamard.weight_names", ints({1})); }},
      {"prism.hadamard.inverse_weight_names",
       [](gguf::Writer& w) { w.set("prism.hadamard.inverse_weight_names", strings({"output.weight"})); }},
      {"prism.hadamard.gdn_v_grouped", [](gguf::Writer& w) { w.set("prism.hadamard.gdn_v_grouped", Value::u32(7)); }},
  };
  for (const auto& c : cases) {
    gguf::Writer w = good_writer();
    c.edit(w);
    try {
      read(w);
      ADD_FAILURE() << "accepted a bad " << c.key;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(c.key), std::string::npos) << "message: " << e.what();
    }
  }
  // A missing required key is named too.
  gguf::Writer w;
  w.set("prism.hadamard.version", Value::u32(1));
  try {
    read(w);
    ADD_FAILURE() << "accepted metadata without block_size";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("prism.hadamard.block_size"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dflash::prism
