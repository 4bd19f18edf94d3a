// The metadata of DFlash drafter files (write_drafter_metadata, shared by synth_drafter and
// `dflash convert` of z-lab checkpoints): every key, its GGUF type and value, in file order, written
// out here by hand so that a change to any of them fails (the reader, read_drafter_config, ignores
// keys it does not need, so the loading tests would not notice).
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "gguf/gguf.h"
#include "models/drafter_metadata.h"
#include "models/synth_drafter.h"
#include "support/temp_dir.h"

namespace dflash {
namespace {

namespace fs = std::filesystem;
using Kv = std::pair<std::string, std::string>;  // key, "type = value"

std::string temp_file(const std::string& name) { return dflash::testing::temp_path("drafter_metadata_test", name); }

std::vector<Kv> metadata_of(const gguf::File& f) {
  std::vector<Kv> out;
  for (const gguf::KeyValue& kv : f.metadata()) {
    if (kv.key == "general.alignment") continue;
    out.emplace_back(kv.key, kv.value.type_string() + " = " + gguf::format_value(kv.value));
  }
  return out;
}

std::vector<Kv> metadata_of(const gguf::Writer& w) {
  const std::vector<uint8_t> bytes = w.to_bytes();
  return metadata_of(gguf::File::from_bytes(bytes, "drafter"));
}

// A DFlash 2 spec with a distinct value in every field, so a key written from the wrong field shows.
SynthDrafterSpec distinct_spec() {
  SynthDrafterSpec s;
  s.n_layer = 3;
  s.n_embd = 64;
  s.n_ff = 96;
  s.n_head = 4;
  s.n_head_kv = 2;
  s.head_dim = 16;
  s.n_vocab = 300;
  s.n_ctx_train = 12345;
  s.rope_theta = 5e5;
  s.rms_eps = 1e-5;
  s.block_size = 4;
  s.target_layers = {2, 5, 9};
  s.dflash2 = true;
  s.conv_kernel = 3;
  s.conv_group = 8;
  s.selector_rank = 12;
  s.selector_top_k = 5;
  s.sliding_window = 640;
  s.causal = true;
  s.mask_token = 299;
  return s;
}

TEST(DrafterMetadata, SynthDrafterWritesEveryKeyInOrder) {
  const std::string path = temp_file("v2.gguf");
  synth_drafter(distinct_spec(), path);
  const std::vector<Kv> expected = {
      {"general.architecture", "string = \"dflash\""},
      {"general.name", "string = \"dflash synthetic DFlash 2 drafter\""},
      {"general.type", "string = \"model\""},
      {"dflash.block_count", "u32 = 3"},
      {"dflash.context_length", "u32 = 12345"},
      {"dflash.embedding_length", "u32 = 64"},
      {"dflash.feed_forward_length", "u32 = 96"},
      {"dflash.attention.head_count", "u32 = 4"},
      {"dflash.attention.head_count_kv", "u32 = 2"},
      {"dflash.attention.key_length", "u32 = 16"},
      {"dflash.attention.value_length", "u32 = 16"},
      {"dflash.attention.layer_norm_rms_epsilon", "f32 = " + gguf::format_value(gguf::Value::f32(1e-5f))},
      {"dflash.rope.freq_base", "f32 = 500000"},
      {"dflash.block_size", "u32 = 4"},
      {"dflash.target_layers", "array<i32>[3] = [2, 5, 9]"},
      {"dflash.conv_kernel_size", "u32 = 3"},
      {"dflash.conv_group_size", "u32 = 8"},
      {"dflash.selector_rank", "u32 = 12"},
      {"dflash.selector_top_k", "u32 = 5"},
      {"dflash.attention.sliding_window", "u32 = 640"},
      {"dflash.attention.causal", "bool = true"},
      {"dflash.vocab_size", "u32 = 300"},
      {"tokenizer.ggml.mask_token_id", "u32 = 299"},
  };
  EXPECT_EQ(metadata_of(gguf::File::open(path)), expected);
}

TEST(DrafterMetadata, V1DrafterHasNoConvSelectorOrWindowKeys) {
  SynthDrafterSpec s = distinct_spec();
  s.dflash2 = false;  // selector_top_k etc. keep their values: the flag alone decides
  s.sliding_window = 0;
  s.causal = false;
  const std::string path = temp_file("v1.gguf");
  synth_drafter(s, path);
  const std::vector<Kv> got = metadata_of(gguf::File::open(path));
  std::vector<std::string> keys;
  for (const Kv& kv : got) keys.push_back(kv.first);
  EXPECT_EQ(keys, (std::vector<std::string>{
                      "general.architecture", "general.name", "general.type", "dflash.block_count",
                      "dflash.context_length", "dflash.embedding_length", "dflash.feed_forward_length",
                      "dflash.attention.head_count", "dflash.attention.head_count_kv", "dflash.attention.key_length",
                      "dflash.attention.value_length", "dflash.attention.layer_norm_rms_epsilon",
                      "dflash.rope.freq_base", "dflash.block_size", "dflash.target_layers", "dflash.attention.causal",
                      "dflash.vocab_size", "tokenizer.ggml.mask_token_id"}));
  EXPECT_EQ(got[1].second, "string = \"dflash synthetic DFlash drafter\"");
  EXPECT_EQ(got[15].second, "bool = false");
}

TEST(DrafterMetadata, WriterStoresValuesAsGivenAndSkipsZeroVocabulary) {
  DrafterMetadata m;
  m.name = "d";
  m.n_layer = 1;
  m.n_ctx = (int64_t{1} << 32) + 7;  // u32 as given: the convert caller clamps, synth_drafter does not
  m.target_layers = {0};
  m.n_vocab = 0;                     // a DFlash v1 checkpoint without vocab_size: no key
  m.mask_token = 3;
  gguf::Writer w;
  write_drafter_metadata(w, m);
  const std::vector<Kv> got = metadata_of(w);
  ASSERT_EQ(got.size(), 17u);
  EXPECT_EQ(got[4], Kv("dflash.context_length", "u32 = 7"));
  EXPECT_EQ(got[14], Kv("dflash.target_layers", "array<i32>[1] = [0]"));
  EXPECT_EQ(got[15], Kv("dflash.attention.causal", "bool = false"));
  EXPECT_EQ(got[16], Kv("tokenizer.ggml.mask_token_id", "u32 = 3"));
}

}  // namespace
}  // namespace dflash
