// `dflash convert` of DFlash drafter checkpoints: a synthetic drafter exported to the z-lab layout
// (safetensors + config.json with dflash_config) converts back to the same GGUF, bit for bit; options
// the runtime does not implement are rejected naming the config key.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "models/convert_dflash.h"
#include "spec/spec_fixture.h"
#include "util/error.h"

namespace dflash {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace spec_test;

// GGUF name -> z-lab checkpoint name.
std::string hf_name(const std::string& g, bool codebook_suffix) {
  static const std::pair<const char*, const char*> global[] = {
      {"fc.weight", "fc.weight"},
      {"enc.output_norm.weight", "hidden_norm.weight"},
      {"output_norm.weight", "norm.weight"},
      {"selector_hidden.weight", "candidate_selector.hidden_projection.weight"},
      {"selector_predecessor.weight", "candidate_selector.predecessor_codebook"},
      {"selector_successor.weight", "candidate_selector.successor_codebook"}};
  for (const auto& [a, b] : global)
    if (g == a) return std::string(b) + (codebook_suffix && g.find("selector_p") == 0 ? ".weight" : "") +
                       (codebook_suffix && g.find("selector_s") == 0 ? ".weight" : "");
  static const std::pair<const char*, const char*> layer[] = {
      {"attn_norm.weight", "input_layernorm.weight"},
      {"ffn_norm.weight", "post_attention_layernorm.weight"},
      {"attn_q.weight", "self_attn.q_proj.weight"},
      {"attn_k.weight", "self_attn.k_proj.weight"},
      {"attn_v.weight", "self_attn.v_proj.weight"},
      {"attn_output.weight", "self_attn.o_proj.weight"},
      {"attn_q_norm.weight", "self_attn.q_norm.weight"},
      {"attn_k_norm.weight", "self_attn.k_norm.weight"},
      {"ffn_gate.weight", "mlp.gate_proj.weight"},
      {"ffn_up.weight", "mlp.up_proj.weight"},
      {"ffn_down.weight", "mlp.down_proj.weight"},
      {"attn_conv_base", "attention_conv.base_kernel"},
      {"attn_conv_proj.weight", "attention_conv.kernel_projection.weight"},
      {"ffn_conv_base", "mlp_conv.base_kernel"},
      {"ffn_conv_proj.weight", "mlp_conv.kernel_projection.weight"}};
  const size_t dot = g.find('.', 4);  // "blk.N."
  const std::string il = g.substr(4, dot - 4), rest = g.substr(dot + 1);
  for (const auto& [a, b] : layer)
    if (rest == a) return "layers." + il + "." + b;
  ADD_FAILURE() << "no checkpoint name for " << g;
  return g;
}

// Writes a drafter GGUF (F32 tensors) as a z-lab checkpoint folder; returns the folder.
fs::path export_checkpoint(const std::string& gguf_path, const std::string& name, const json& extra_config,
                           bool codebook_suffix = false) {
  const gguf::File f = gguf::File::open(gguf_path);
  const DrafterConfig c = read_drafter_config(f);
  const fs::path dir = fs::path(temp_path(name));
  fs::create_directories(dir);
  // safetensors: u64 header length | JSON header | data
  json header = json::object();
  std::vector<uint8_t> data;
  for (const auto& t : f.tensors()) {
    EXPECT_EQ(t.type, GgmlType::F32);
    std::vector<int64_t> shape(t.ne, t.ne + t.n_dims);
    std::reverse(shape.begin(), shape.end());  // ggml ne [in, out] -> torch [out, in]
    const auto bytes = f.tensor_data(t);
    header[hf_name(t.name, codebook_suffix)] = {
        {"dtype", "F32"}, {"shape", shape}, {"data_offsets", {data.size(), data.size() + bytes.size()}}};
    data.insert(data.end(), bytes.begin(), bytes.end());
  }
  const std::string hs = header.dump();
  std::ofstream out(dir / "model.safetensors", std::ios::binary);
  const uint64_t n = hs.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out.write(hs.data(), hs.size());
  out.write(reinterpret_cast<const char*>(data.data()), data.size());
  out.close();

  json cfg = {{"architectures", {c.dflash2() ? "DFlash2DraftModel" : "DFlashDraftModel"}},
              {"model_type", "qwen3"},
              {"hidden_size", c.n_embd},
              {"intermediate_size", c.n_ff},
              {"num_hidden_layers", c.n_layer},
              {"num_attention_heads", c.n_head},
              {"num_key_value_heads", c.n_head_kv},
              {"head_dim", c.head_dim},
              {"rms_norm_eps", c.rms_eps},
              {"hidden_act", "silu"},
              {"vocab_size", c.n_vocab},
              {"max_position_embeddings", 4096},
              {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", c.rope_theta}}},
              {"sliding_window", c.sliding_window},
              {"layer_types", std::vector<std::string>(c.n_layer, "sliding_attention")},
              {"is_causal", c.causal}};
  std::vector<int64_t> ids;
  for (int64_t t : c.target_layers) ids.push_back(t - 1);  // z-lab ids are layer outputs
  json dc = {{"block_size", c.block_size}, {"target_layer_ids", ids}, {"mask_token_id", c.mask_token}};
  if (c.dflash2()) {
    dc["conv_kernel_size"] = c.conv_kernel;
    dc["conv_group_size"] = c.conv_group;
    dc["selector_rank"] = c.selector_rank;
    dc["selector_top_k"] = c.selector_top_k;
  }
  cfg["dflash_config"] = dc;
  cfg.update(extra_config);
  std::ofstream(dir / "config.json") << cfg.dump(2);
  return dir;
}

void expect_same_file(const std::string& a_path, const std::string& b_path) {
  const gguf::File a = gguf::File::open(a_path), b = gguf::File::open(b_path);
  ASSERT_EQ(a.tensors().size(), b.tensors().size());
  for (size_t i = 0; i < a.tensors().size(); ++i) {
    const auto& ta = a.tensors()[i];
    const gguf::TensorInfo* tb = b.find_tensor(ta.name);
    ASSERT_NE(tb, nullptr) << ta.name;
    EXPECT_EQ(ta.name, b.tensors()[i].name) << "tensor order";
    ASSERT_EQ(ta.shape_string(), tb->shape_string()) << ta.name;
    ASSERT_EQ(ta.type, tb->type) << ta.name;
    const auto da = a.tensor_data(ta), db = b.tensor_data(*tb);
    ASSERT_EQ(0, std::memcmp(da.data(), db.data(), da.size())) << ta.name;
  }
  // Every metadata key, in order, with its type and value: both files come from write_drafter_metadata,
  // and the checkpoint round trip must not lose or change any of them (general.name is the folder's).
  ASSERT_EQ(a.metadata().size(), b.metadata().size());
  for (size_t i = 0; i < a.metadata().size(); ++i) {
    const gguf::KeyValue &ka = a.metadata()[i], &kb = b.metadata()[i];
    EXPECT_EQ(ka.key, kb.key) << "metadata order at " << i;
    if (ka.key == "general.name") continue;
    EXPECT_TRUE(ka.value == kb.value) << ka.key << ": " << gguf::format_value(ka.value) << " vs "
                                      << gguf::format_value(kb.value);
  }
  const DrafterConfig ca = read_drafter_config(a), cb = read_drafter_config(b);
  EXPECT_EQ(ca.target_layers, cb.target_layers);
  EXPECT_EQ(ca.n_layer, cb.n_layer);
  EXPECT_EQ(ca.n_head_kv, cb.n_head_kv);
  EXPECT_EQ(ca.block_size, cb.block_size);
  EXPECT_EQ(ca.conv_kernel, cb.conv_kernel);
  EXPECT_EQ(ca.conv_group, cb.conv_group);
  EXPECT_EQ(ca.selector_rank, cb.selector_rank);
  EXPECT_EQ(ca.selector_top_k, cb.selector_top_k);
  EXPECT_EQ(ca.sliding_window, cb.sliding_window);
  EXPECT_EQ(ca.causal, cb.causal);
  EXPECT_EQ(ca.mask_token, cb.mask_token);
  EXPECT_EQ(ca.n_vocab, cb.n_vocab);
  EXPECT_FLOAT_EQ(ca.rope_theta, cb.rope_theta);
  EXPECT_FLOAT_EQ(ca.rms_eps, cb.rms_eps);
}

TEST(ConvertDflash, RoundTripsASyntheticDrafter) {
  const SynthTargetSpec ts = tiny_target();
  for (bool v2 : {true, false}) {
    for (bool suffix : {false, true}) {
      SynthDrafterSpec ds = tiny_drafter(ts, v2);
      ds.target_layers = {1, 3};
      const std::string orig = temp_path("orig.gguf"), conv = temp_path("conv.gguf");
      synth_drafter(ds, orig);
      const fs::path dir = export_checkpoint(orig, v2 ? "ckpt2" : "ckpt1", json::object(), suffix);
      ASSERT_TRUE(is_dflash_checkpoint(dir.string()));
      const ConvertReport r = convert_dflash_to_gguf(dir.string(), conv, {});
      EXPECT_EQ(r.arch, "dflash");
      EXPECT_TRUE(r.unused.empty());
      expect_same_file(orig, conv);
    }
  }
}

TEST(ConvertDflash, QuantizesMatricesAndKeepsNormsAndConvF32) {
  const SynthTargetSpec ts = tiny_target();
  const std::string orig = temp_path("q_orig.gguf"), conv = temp_path("q_conv.gguf");
  synth_drafter(tiny_drafter(ts), orig);
  const fs::path dir = export_checkpoint(orig, "ckpt_q", json::object());
  ConvertOptions o;
  o.type = GgmlType::Q8_0;
  convert_dflash_to_gguf(dir.string(), conv, o);
  const gguf::File f = gguf::File::open(conv);
  EXPECT_EQ(f.tensor("fc.weight").type, GgmlType::Q8_0);
  EXPECT_EQ(f.tensor("selector_predecessor.weight").type, GgmlType::Q8_0);
  EXPECT_EQ(f.tensor("blk.1.ffn_down.weight").type, GgmlType::Q8_0);
  EXPECT_EQ(f.tensor("blk.0.attn_conv_base").type, GgmlType::F32);
  EXPECT_EQ(f.tensor("blk.0.attn_k_norm.weight").type, GgmlType::F32);
  // and it runs with a target
  const std::string tp = temp_path("q_target.gguf");
  synth_target(ts, tp);
  Pair p = load_pair(tp, conv, 8);
  EXPECT_EQ(p.drafter->draft(3).size(), 7u);
}

TEST(ConvertDflash, UnsupportedOptionsAreNamed) {
  const SynthTargetSpec ts = tiny_target();
  const std::string orig = temp_path("e_orig.gguf"), conv = temp_path("e_conv.gguf");
  synth_drafter(tiny_drafter(ts), orig);
  auto error_for = [&](const json& extra) {
    const fs::path dir = export_checkpoint(orig, "ckpt_e", extra);
    try {
      convert_dflash_to_gguf(dir.string(), conv, {});
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error_for({{"output_multiplier", 2.0}}).find("output_multiplier"), std::string::npos);
  EXPECT_NE(error_for({{"final_logit_softcapping", 30.0}}).find("final_logit_softcapping"), std::string::npos);
  EXPECT_NE(error_for({{"rope_parameters", {{"rope_type", "yarn"}, {"rope_theta", 1e7}}}}).find("yarn"),
            std::string::npos);
  EXPECT_NE(error_for({{"layer_types", {"sliding_attention", "full_attention"}}}).find("mixes"), std::string::npos);
  json no_mask = {{"dflash_config", {{"block_size", 8}, {"target_layer_ids", {0, 1}}}}};
  EXPECT_NE(error_for(no_mask).find("mask_token_id"), std::string::npos);
  EXPECT_NE(error_for({{"hidden_size", 128}}).find("fc.weight"), std::string::npos);
}

}  // namespace
}  // namespace dflash
