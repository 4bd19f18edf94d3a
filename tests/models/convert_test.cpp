// `dflash convert` on tiny fake Hugging Face checkpoints written here (safetensors + config.json +
// tokenizer.json with known values): names, shapes, the 1 + w norms, -exp(A_log), the V-head tiling
// of every affected tensor, the conv squeeze, the tokenizer fields, the prism rotation (stored rows
// give the original matmul through the runtime's transform), the runtime running the result, and
// malformed safetensors files rejected with clear messages.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "gguf/gguf.h"
#include "models/convert.h"
#include "models/safetensors.h"
#include "models/target.h"
#include "ops/backend.h"
#include "prism/hadamard.h"
#include "prism/rotation.h"
#include "support/temp_dir.h"
#include "util/error.h"

namespace dflash {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

fs::path temp_dir(const std::string& name) {
  fs::path d = dflash::testing::temp_path("convert_test", name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

void write_file(const fs::path& p, const std::string& s) {
  std::ofstream out(p, std::ios::binary);
  out.write(s.data(), static_cast<std::streamsize>(s.size()));
}
void write_file(const fs::path& p, const std::vector<uint8_t>& b) {
  write_file(p, std::string(b.begin(), b.end()));
}

template <typename F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// Fake checkpoints

// Known values k / denom with |k| <= 100 and denom a power of two: exact in F32, F16 and BF16.
float known(const std::string& name, int64_t i, float denom) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  h ^= static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull;
  h = (h ^ (h >> 31)) * 0xbf58476d1ce4e5b9ull;
  h ^= h >> 29;
  return static_cast<float>(static_cast<int64_t>(h % 201) - 100) / denom;
}

struct StEntry {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::vector<float> values;
};

std::vector<uint8_t> make_safetensors(const std::vector<StEntry>& es) {
  json h = json::object();
  std::vector<uint8_t> data;
  for (const StEntry& e : es) {
    const size_t esz = e.dtype == "F32" ? 4 : 2;
    const uint64_t begin = data.size();
    for (float v : e.values) {
      if (e.dtype == "F32") {
        uint8_t b[4];
        std::memcpy(b, &v, 4);
        data.insert(data.end(), b, b + 4);
      } else {
        const uint16_t x = e.dtype == "F16" ? fp32_to_fp16(v) : fp32_to_bf16(v);
        data.push_back(static_cast<uint8_t>(x & 0xFF));
        data.push_back(static_cast<uint8_t>(x >> 8));
      }
    }
    h[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {begin, begin + e.values.size() * esz}}};
  }
  h["__metadata__"] = {{"format", "pt"}};
  std::string hs = h.dump();
  while (hs.size() % 8) hs += ' ';
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((hs.size() >> (8 * i)) & 0xFF);
  s += hs;
  std::vector<uint8_t> out(s.begin(), s.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

// The GPT-2 byte-to-symbol map (the strings byte-level BPE vocabularies use).
std::string byte_symbol(int b) {
  const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
  int cp = b;
  if (!printable) {
    int n = 0;
    for (int x = 0; x < b; ++x) {
      const bool p = (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255);
      if (!p) ++n;
    }
    cp = 256 + n;
  }
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

constexpr const char* kQwen2Regex =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
    "\\s+(?!\\S)|\\s+";

struct FakeModel {
  bool hybrid = true;
  int64_t n_layer = 4, E = 64, FF = 128, V = 300, H = 2, Hkv = 1, hd = 16;
  int64_t Hk = 2, Hv = 6, dk = 8, dv = 8, K = 4;
  bool tied = false;
  bool tokenizer = true;
  bool sharded = false;
  std::map<std::string, StEntry> tensors;  // HF name -> entry

  int64_t key_dim() const { return Hk * dk; }
  int64_t inner() const { return Hv * dv; }
  int64_t conv_dim() const { return 2 * key_dim() + inner(); }
  bool is_attn(int64_t il) const { return !hybrid || (il + 1) % 4 == 0; }
  // HF head stored at tiled GGUF position g (written out here, independent of the converter).
  int64_t src_head(int64_t g) const { return (g % Hk) * (Hv / Hk) + g / Hk; }

  void add(const std::string& name, std::vector<int64_t> shape, float denom, const std::string& dtype = "F32") {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    StEntry e{name, dtype, shape, {}};
    for (int64_t i = 0; i < n; ++i) e.values.push_back(known(name, i, denom));
    tensors[name] = std::move(e);
  }
  const std::vector<float>& hf(const std::string& name) const { return tensors.at(name).values; }

  void build() {
    tensors.clear();
    const std::string m = "model.";
    add(m + "embed_tokens.weight", {V, E}, 64, "BF16");
    add(m + "norm.weight", {E}, 64);
    if (!tied) add("lm_head.weight", {V, E}, 256, "F16");
    for (int64_t il = 0; il < n_layer; ++il) {
      const std::string h = m + "layers." + std::to_string(il) + ".";
      add(h + "input_layernorm.weight", {E}, 64);
      add(h + "post_attention_layernorm.weight", {E}, 64);
      add(h + "mlp.gate_proj.weight", {FF, E}, 512, "BF16");
      add(h + "mlp.up_proj.weight", {FF, E}, 512, "F16");
      add(h + "mlp.down_proj.weight", {E, FF}, 512);
      if (is_attn(il)) {
        const std::string a = h + "self_attn.";
        add(a + "q_proj.weight", {H * hd * (hybrid ? 2 : 1), E}, 512);
        add(a + "k_proj.weight", {Hkv * hd, E}, 512);
        add(a + "v_proj.weight", {Hkv * hd, E}, 512);
        add(a + "o_proj.weight", {E, H * hd}, 512);
        add(a + "q_norm.weight", {hd}, 64);
        add(a + "k_norm.weight", {hd}, 64);
      } else {
        const std::string l = h + "linear_attn.";
        add(l + "in_proj_qkv.weight", {conv_dim(), E}, 512);
        add(l + "in_proj_z.weight", {inner(), E}, 512);
        add(l + "in_proj_a.weight", {Hv, E}, 512);
        add(l + "in_proj_b.weight", {Hv, E}, 512);
        add(l + "conv1d.weight", {conv_dim(), 1, K}, 64);
        add(l + "dt_bias", {Hv}, 64);
        add(l + "A_log", {Hv}, 64);
        add(l + "norm.weight", {dv}, 64);
        add(l + "out_proj.weight", {E, inner()}, 512);
      }
    }
    add("mtp.fc.weight", {E, 2 * E}, 64);  // not part of the text model: skipped with a note
  }

  json config() const {
    json c;
    if (hybrid) {
      std::vector<std::string> types;
      for (int64_t il = 0; il < n_layer; ++il) types.push_back(is_attn(il) ? "full_attention" : "linear_attention");
      c = {{"architectures", {"Qwen3_5ForCausalLM"}},
           {"model_type", "qwen3_5_text"},
           {"hidden_size", E},
           {"intermediate_size", FF},
           {"num_hidden_layers", n_layer},
           {"num_attention_heads", H},
           {"num_key_value_heads", Hkv},
           {"head_dim", hd},
           {"vocab_size", V},
           {"max_position_embeddings", 2048},
           {"rms_norm_eps", 1e-6},
           {"hidden_act", "silu"},
           {"tie_word_embeddings", tied},
           {"layer_types", types},
           {"linear_conv_kernel_dim", K},
           {"linear_key_head_dim", dk},
           {"linear_value_head_dim", dv},
           {"linear_num_key_heads", Hk},
           {"linear_num_value_heads", Hv},
           {"rope_parameters",
            {{"rope_type", "default"}, {"rope_theta", 10000000.0}, {"partial_rotary_factor", 0.25},
             {"mrope_section", {2, 1, 1}}, {"mrope_interleaved", true}}},
           {"bos_token_id", 258},
           {"eos_token_id", 258}};
    } else {
      c = {{"architectures", {"Qwen3ForCausalLM"}},
           {"model_type", "qwen3"},
           {"hidden_size", E},
           {"intermediate_size", FF},
           {"num_hidden_layers", n_layer},
           {"num_attention_heads", H},
           {"num_key_value_heads", Hkv},
           {"head_dim", hd},
           {"vocab_size", V},
           {"max_position_embeddings", 4096},
           {"rms_norm_eps", 1e-6},
           {"hidden_act", "silu"},
           {"tie_word_embeddings", tied},
           {"rope_theta", 1000000.0},
           {"attention_bias", false},
           {"bos_token_id", 258},
           {"eos_token_id", 260}};
    }
    return c;
  }

  void write(const fs::path& dir) const {
    write_file(dir / "config.json", config().dump(2));
    std::vector<StEntry> all;
    for (const auto& [n, e] : tensors) all.push_back(e);
    if (!sharded) {
      write_file(dir / "model.safetensors", make_safetensors(all));
    } else {
      std::vector<StEntry> a(all.begin(), all.begin() + all.size() / 2), b(all.begin() + all.size() / 2, all.end());
      write_file(dir / "model-00001-of-00002.safetensors", make_safetensors(a));
      write_file(dir / "model-00002-of-00002.safetensors", make_safetensors(b));
      json idx = {{"metadata", {{"total_size", 0}}}, {"weight_map", json::object()}};
      for (const StEntry& e : a) idx["weight_map"][e.name] = "model-00001-of-00002.safetensors";
      for (const StEntry& e : b) idx["weight_map"][e.name] = "model-00002-of-00002.safetensors";
      write_file(dir / "model.safetensors.index.json", idx.dump());
    }
    if (tokenizer) {
      json vocab = json::object();
      for (int b = 0; b < 256; ++b) vocab[byte_symbol(b)] = b;
      vocab[byte_symbol(' ') + "t"] = 256;
      vocab["he"] = 257;
      json tj = {
          {"version", "1.0"},
          {"added_tokens",
           {{{"id", 258}, {"content", "<|endoftext|>"}, {"special", true}},
            {{"id", 259}, {"content", "<|im_start|>"}, {"special", true}},
            {{"id", 260}, {"content", "<|im_end|>"}, {"special", true}},
            {{"id", 261}, {"content", "<think>"}, {"special", false}}}},
          {"normalizer", {{"type", "NFC"}}},
          {"pre_tokenizer",
           {{"type", "Sequence"},
            {"pretokenizers",
             {{{"type", "Split"}, {"pattern", {{"Regex", kQwen2Regex}}}, {"behavior", "Isolated"}, {"invert", false}},
              {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}}}}},
          {"model",
           {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array({json::array({byte_symbol(' '), "t"}), json::array({"h", "e"})})}}}};
      write_file(dir / "tokenizer.json", tj.dump());
      json tc = {{"eos_token", "<|im_end|>"},
                 {"pad_token", {{"content", "<|endoftext|>"}, {"special", true}}},
                 {"bos_token", nullptr},
                 {"add_bos_token", false},
                 {"chat_template", "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"}};
      write_file(dir / "tokenizer_config.json", tc.dump());
    }
  }
};

struct Converted {
  fs::path dir;
  std::string path;
  std::unique_ptr<gguf::File> file;
  ConvertReport report;
};

Converted convert(const FakeModel& m, const std::string& name, ConvertOptions opts = {}) {
  Converted c;
  c.dir = temp_dir(name);
  fs::create_directories(c.dir / "hf");
  m.write(c.dir / "hf");
  c.path = (c.dir / "out.gguf").string();
  opts.threads = 2;
  c.report = convert_hf_to_gguf((c.dir / "hf").string(), c.path, opts);
  c.file = std::make_unique<gguf::File>(gguf::File::open(c.path));
  return c;
}

// A tensor of the GGUF as f32 (row-major over ne: element (row r, col c) at r * ne[0] + c).
std::vector<float> read_f32(const gguf::File& f, const std::string& name) {
  const gguf::TensorInfo& t = f.tensor(name);
  std::vector<float> out(static_cast<size_t>(t.n_elements()));
  const auto data = f.tensor_data(t);
  const size_t rb = row_bytes(t.type, t.ne[0]);
  for (int64_t r = 0; r < t.n_rows(); ++r) dequantize_row(t.type, data.data() + r * rb, out.data() + r * t.ne[0], t.ne[0]);
  return out;
}

std::vector<int64_t> shape_of(const gguf::TensorInfo& t) { return std::vector<int64_t>(t.ne, t.ne + t.n_dims); }

std::vector<float> plus_one(std::vector<float> v) {
  for (float& x : v) x += 1.0f;
  return v;
}

// ---------------------------------------------------------------------------------------------
// The plain conversion

TEST(Convert, Qwen35NamesShapesAndValues) {
  FakeModel m;
  m.sharded = true;
  m.build();
  const Converted c = convert(m, "qwen35_plain");
  const gguf::File& f = *c.file;

  EXPECT_EQ(f.get_string("general.architecture"), "qwen35");
  EXPECT_EQ(f.get_int("qwen35.block_count"), 4);
  EXPECT_EQ(f.get_int("qwen35.embedding_length"), 64);
  EXPECT_EQ(f.get_int("qwen35.feed_forward_length"), 128);
  EXPECT_EQ(f.get_int("qwen35.context_length"), 2048);
  EXPECT_EQ(f.get_int("qwen35.attention.head_count"), 2);
  EXPECT_EQ(f.get_int("qwen35.attention.head_count_kv"), 1);
  EXPECT_EQ(f.get_int("qwen35.attention.key_length"), 16);
  EXPECT_EQ(f.get_int("qwen35.attention.value_length"), 16);
  EXPECT_EQ(f.get_int("qwen35.rope.dimension_count"), 4);  // 16 * 0.25
  EXPECT_FLOAT_EQ(f.get_float("qwen35.rope.freq_base"), 1e7f);
  EXPECT_EQ(f.get_int_array("qwen35.rope.dimension_sections"), (std::vector<int64_t>{2, 1, 1, 0}));
  EXPECT_EQ(f.get_int("qwen35.ssm.conv_kernel"), 4);
  EXPECT_EQ(f.get_int("qwen35.ssm.inner_size"), 48);
  EXPECT_EQ(f.get_int("qwen35.ssm.state_size"), 8);
  EXPECT_EQ(f.get_int("qwen35.ssm.time_step_rank"), 6);
  EXPECT_EQ(f.get_int("qwen35.ssm.group_count"), 2);
  EXPECT_EQ(f.get_int("qwen35.full_attention_interval"), 4);
  EXPECT_FALSE(f.has("prism.hadamard.version"));
  // read back by the runtime's reader
  const TargetConfig tc = read_target_config(f);
  EXPECT_EQ(tc.ssm_head_v(), 8);
  EXPECT_TRUE(tc.is_attention_layer(3));
  EXPECT_FALSE(tc.is_attention_layer(2));

  // Every tensor, with its shape (ggml order).
  std::map<std::string, std::vector<int64_t>> want = {
      {"token_embd.weight", {64, 300}}, {"output_norm.weight", {64}}, {"output.weight", {64, 300}}};
  for (int il = 0; il < 4; ++il) {
    const std::string b = "blk." + std::to_string(il) + ".";
    want[b + "attn_norm.weight"] = {64};
    want[b + "post_attention_norm.weight"] = {64};
    want[b + "ffn_gate.weight"] = {64, 128};
    want[b + "ffn_up.weight"] = {64, 128};
    want[b + "ffn_down.weight"] = {128, 64};
    if (il == 3) {
      want[b + "attn_q.weight"] = {64, 64};
      want[b + "attn_k.weight"] = {64, 16};
      want[b + "attn_v.weight"] = {64, 16};
      want[b + "attn_output.weight"] = {32, 64};
      want[b + "attn_q_norm.weight"] = {16};
      want[b + "attn_k_norm.weight"] = {16};
    } else {
      want[b + "attn_qkv.weight"] = {64, 80};
      want[b + "attn_gate.weight"] = {64, 48};
      want[b + "ssm_conv1d.weight"] = {4, 80};
      want[b + "ssm_dt.bias"] = {6};
      want[b + "ssm_a"] = {6};
      want[b + "ssm_alpha.weight"] = {64, 6};
      want[b + "ssm_beta.weight"] = {64, 6};
      want[b + "ssm_norm.weight"] = {8};
      want[b + "ssm_out.weight"] = {48, 64};
    }
  }
  ASSERT_EQ(f.tensors().size(), want.size());
  for (const auto& [name, ne] : want) {
    const gguf::TensorInfo* t = f.find_tensor(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(shape_of(*t), ne) << name;
    EXPECT_EQ(t->type, GgmlType::F32) << name;
  }
  EXPECT_EQ(c.report.unused, (std::vector<std::string>{"mtp.fc.weight"}));

  // Values: copies, 1 + w norms (not ssm_norm), F16/BF16 sources.
  EXPECT_EQ(read_f32(f, "token_embd.weight"), m.hf("model.embed_tokens.weight"));
  EXPECT_EQ(read_f32(f, "output.weight"), m.hf("lm_head.weight"));
  EXPECT_EQ(read_f32(f, "output_norm.weight"), plus_one(m.hf("model.norm.weight")));
  for (int il = 0; il < 4; ++il) {
    const std::string b = "blk." + std::to_string(il) + ".", h = "model.layers." + std::to_string(il) + ".";
    EXPECT_EQ(read_f32(f, b + "attn_norm.weight"), plus_one(m.hf(h + "input_layernorm.weight")));
    EXPECT_EQ(read_f32(f, b + "post_attention_norm.weight"), plus_one(m.hf(h + "post_attention_layernorm.weight")));
    EXPECT_EQ(read_f32(f, b + "ffn_gate.weight"), m.hf(h + "mlp.gate_proj.weight"));
    EXPECT_EQ(read_f32(f, b + "ffn_up.weight"), m.hf(h + "mlp.up_proj.weight"));
    EXPECT_EQ(read_f32(f, b + "ffn_down.weight"), m.hf(h + "mlp.down_proj.weight"));
    if (il == 3) {
      EXPECT_EQ(read_f32(f, b + "attn_q.weight"), m.hf(h + "self_attn.q_proj.weight"));  // [q | gate] per head kept
      EXPECT_EQ(read_f32(f, b + "attn_k.weight"), m.hf(h + "self_attn.k_proj.weight"));
      EXPECT_EQ(read_f32(f, b + "attn_v.weight"), m.hf(h + "self_attn.v_proj.weight"));
      EXPECT_EQ(read_f32(f, b + "attn_output.weight"), m.hf(h + "self_attn.o_proj.weight"));
      EXPECT_EQ(read_f32(f, b + "attn_q_norm.weight"), plus_one(m.hf(h + "self_attn.q_norm.weight")));
      EXPECT_EQ(read_f32(f, b + "attn_k_norm.weight"), plus_one(m.hf(h + "self_attn.k_norm.weight")));
      continue;
    }
    // Gated DeltaNet: V heads tiled, gguf head g <- hf head src_head(g).
    const std::string l = h + "linear_attn.";
    const int64_t E = m.E, kd = m.key_dim(), dv = m.dv, C = m.conv_dim();
    const auto qkv = read_f32(f, b + "attn_qkv.weight"), hqkv = m.hf(l + "in_proj_qkv.weight");
    const auto gate = read_f32(f, b + "attn_gate.weight"), hz = m.hf(l + "in_proj_z.weight");
    const auto conv = read_f32(f, b + "ssm_conv1d.weight"), hconv = m.hf(l + "conv1d.weight");
    const auto out = read_f32(f, b + "ssm_out.weight"), hout = m.hf(l + "out_proj.weight");
    // conv channel map: q, k channels as is, V channels tiled
    std::vector<int64_t> chan(C);
    for (int64_t i = 0; i < 2 * kd; ++i) chan[i] = i;
    for (int64_t g = 0; g < m.Hv; ++g)
      for (int64_t d = 0; d < dv; ++d) chan[2 * kd + g * dv + d] = 2 * kd + m.src_head(g) * dv + d;
    for (int64_t ch = 0; ch < C; ++ch) {
      for (int64_t e = 0; e < E; ++e) ASSERT_EQ(qkv[ch * E + e], hqkv[chan[ch] * E + e]) << b << " qkv " << ch;
      for (int64_t j = 0; j < m.K; ++j) ASSERT_EQ(conv[ch * m.K + j], hconv[chan[ch] * m.K + j]) << b << " conv " << ch;
    }
    for (int64_t g = 0; g < m.Hv; ++g) {
      const int64_t s = m.src_head(g);
      for (int64_t d = 0; d < dv; ++d) {
        for (int64_t e = 0; e < E; ++e) ASSERT_EQ(gate[(g * dv + d) * E + e], hz[(s * dv + d) * E + e]);
        for (int64_t o = 0; o < E; ++o)
          ASSERT_EQ(out[o * m.inner() + g * dv + d], hout[o * m.inner() + s * dv + d]) << b << " ssm_out col";
      }
      for (int64_t e = 0; e < E; ++e) {
        ASSERT_EQ(read_f32(f, b + "ssm_alpha.weight")[g * E + e], m.hf(l + "in_proj_a.weight")[s * E + e]);
        ASSERT_EQ(read_f32(f, b + "ssm_beta.weight")[g * E + e], m.hf(l + "in_proj_b.weight")[s * E + e]);
      }
      EXPECT_EQ(read_f32(f, b + "ssm_dt.bias")[g], m.hf(l + "dt_bias")[s]);
      EXPECT_FLOAT_EQ(read_f32(f, b + "ssm_a")[g], -std::exp(m.hf(l + "A_log")[s]));
      EXPECT_LT(read_f32(f, b + "ssm_a")[g], 0.0f);
    }
    EXPECT_EQ(read_f32(f, b + "ssm_norm.weight"), m.hf(l + "norm.weight"));  // plain w
  }
  // The tiling is a real permutation here (R = 3): head 1 comes from HF head 3.
  EXPECT_EQ(tiled_source_head(1, 2, 6), 3);
  EXPECT_EQ(tiled_source_head(2, 2, 6), 1);
}

TEST(Convert, TokenizerFields) {
  FakeModel m;
  m.build();
  const Converted c = convert(m, "tokenizer");
  const gguf::File& f = *c.file;
  EXPECT_TRUE(c.report.tokenizer);
  EXPECT_EQ(f.get_string("tokenizer.ggml.model"), "gpt2");
  EXPECT_EQ(f.get_string("tokenizer.ggml.pre"), "qwen2");
  const auto tokens = f.get_string_array("tokenizer.ggml.tokens");
  const auto types = f.get_int_array("tokenizer.ggml.token_type");
  ASSERT_EQ(tokens.size(), 300u);  // padded to the embedding rows
  ASSERT_EQ(types.size(), 300u);
  EXPECT_EQ(tokens[65], "A");
  EXPECT_EQ(tokens[32], "\xC4\xA0");  // byte 0x20 -> U+0120
  EXPECT_EQ(tokens[256], "\xC4\xA0t");
  EXPECT_EQ(tokens[258], "<|endoftext|>");
  EXPECT_EQ(tokens[260], "<|im_end|>");
  EXPECT_EQ(tokens[261], "<think>");
  EXPECT_EQ(tokens[299], "[PAD299]");
  EXPECT_EQ(types[65], 1);
  EXPECT_EQ(types[258], 3);
  EXPECT_EQ(types[261], 4);
  EXPECT_EQ(types[262], 5);
  EXPECT_EQ(f.get_string_array("tokenizer.ggml.merges"), (std::vector<std::string>{"\xC4\xA0 t", "h e"}));
  EXPECT_EQ(f.get_int("tokenizer.ggml.bos_token_id"), 258);  // config.json fallback
  EXPECT_EQ(f.get_int("tokenizer.ggml.eos_token_id"), 260);  // tokenizer_config.json
  EXPECT_EQ(f.get_int("tokenizer.ggml.padding_token_id"), 258);
  EXPECT_EQ(f.get_int("tokenizer.ggml.eot_token_id"), 260);
  EXPECT_FALSE(f.get_bool("tokenizer.ggml.add_bos_token"));
  EXPECT_NE(f.get_string("tokenizer.chat_template").find("<|im_start|>"), std::string::npos);

  // transformers 5 writes the template to chat_template.jinja; a qwen35-style regex selects "qwen35".
  fs::path hf = c.dir / "hf";
  write_file(hf / "chat_template.jinja", std::string("JINJA {{ messages }}"));
  std::ifstream tin(hf / "tokenizer.json");
  json tj = json::parse(tin);
  std::string re = kQwen2Regex;
  const std::string letters = "\\p{L}+", punct = "[^\\s\\p{L}\\p{N}]";
  re.replace(re.find(letters), letters.size(), "[\\p{L}\\p{M}]+");
  re.replace(re.find(punct), punct.size(), "[^\\s\\p{L}\\p{M}\\p{N}]");
  tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = re;
  write_file(hf / "tokenizer.json", tj.dump());
  const std::string out2 = (c.dir / "out2.gguf").string();
  convert_hf_to_gguf(hf.string(), out2, {});
  const gguf::File f2 = gguf::File::open(out2);
  EXPECT_EQ(f2.get_string("tokenizer.ggml.pre"), "qwen35");
  EXPECT_EQ(f2.get_string("tokenizer.chat_template"), "JINJA {{ messages }}");

  // An unknown pre-tokenizer regex is refused rather than silently mis-tokenized.
  tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\w+";
  write_file(hf / "tokenizer.json", tj.dump());
  expect_error([&] { convert_hf_to_gguf(hf.string(), out2, {}); }, "pre-tokenizer");
}

TEST(Convert, Qwen3DenseTied) {
  FakeModel m;
  m.hybrid = false;
  m.n_layer = 2;
  m.H = 4;
  m.Hkv = 2;
  m.tied = true;
  m.build();
  const Converted c = convert(m, "qwen3");
  const gguf::File& f = *c.file;
  EXPECT_EQ(f.get_string("general.architecture"), "qwen3");
  EXPECT_EQ(f.get_int("qwen3.rope.dimension_count"), 16);
  EXPECT_FLOAT_EQ(f.get_float("qwen3.rope.freq_base"), 1e6f);
  EXPECT_FALSE(f.has("qwen3.ssm.inner_size"));
  EXPECT_EQ(f.find_tensor("output.weight"), nullptr);  // tied
  // qwen3 norms are plain w (Qwen3RMSNorm multiplies by w, not 1 + w)
  EXPECT_EQ(read_f32(f, "blk.1.ffn_norm.weight"), m.hf("model.layers.1.post_attention_layernorm.weight"));
  EXPECT_EQ(read_f32(f, "blk.0.attn_q_norm.weight"), m.hf("model.layers.0.self_attn.q_norm.weight"));
  EXPECT_EQ(read_f32(f, "output_norm.weight"), m.hf("model.norm.weight"));
  EXPECT_EQ(shape_of(f.tensor("blk.0.attn_q.weight")), (std::vector<int64_t>{64, 64}));
  EXPECT_EQ(f.find_tensor("blk.0.post_attention_norm.weight"), nullptr);
}

TEST(Convert, QuantizedTypesAndFallbacks) {
  FakeModel m;
  m.build();
  ConvertOptions o;
  o.type = GgmlType::Q8_0;
  const Converted c = convert(m, "q8", o);
  const gguf::File& f = *c.file;
  EXPECT_EQ(f.tensor("token_embd.weight").type, GgmlType::Q8_0);
  EXPECT_EQ(f.tensor("blk.0.attn_qkv.weight").type, GgmlType::Q8_0);
  EXPECT_EQ(f.tensor("blk.0.ffn_down.weight").type, GgmlType::Q8_0);
  EXPECT_EQ(f.tensor("blk.0.ssm_out.weight").type, GgmlType::F32);  // row length 48 is not a multiple of 32
  EXPECT_EQ(f.tensor("blk.3.attn_output.weight").type, GgmlType::Q8_0);
  EXPECT_EQ(f.tensor("blk.0.ssm_alpha.weight").type, GgmlType::BF16);  // like Bonsai
  EXPECT_EQ(f.tensor("blk.0.ssm_beta.weight").type, GgmlType::BF16);
  EXPECT_EQ(f.tensor("blk.0.ssm_conv1d.weight").type, GgmlType::F32);
  EXPECT_EQ(f.tensor("blk.0.attn_norm.weight").type, GgmlType::F32);
  // Q8_0 of the known values is close to them.
  const auto q = read_f32(f, "blk.0.ffn_down.weight");
  const auto& ref = m.hf("model.layers.0.mlp.down_proj.weight");
  for (size_t i = 0; i < q.size(); ++i) ASSERT_NEAR(q[i], ref[i], 0.2 / 127);
}

// ---------------------------------------------------------------------------------------------
// prism

double dot(const float* a, const float* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

TEST(Convert, PrismStoredRowsGiveTheOriginalMatmul) {
  FakeModel m;
  m.build();
  const Converted plain = convert(m, "prism_ref");
  ConvertOptions o;
  o.prism = true;
  o.seed = 42;
  const Converted rot = convert(m, "prism", o);
  const gguf::File& f = *rot.file;
  const auto pr = prism::PrismRotation::from_gguf(f);
  ASSERT_TRUE(pr.has_value());
  // widths 32 (q), 48 (inner), 64, 128: the largest power of two dividing all is 16.
  EXPECT_EQ(pr->block_size, 16);
  EXPECT_EQ(rot.report.prism_block, 16);
  EXPECT_EQ(pr->sign_widths, (std::vector<int64_t>{32, 48, 64, 128}));
  EXPECT_TRUE(pr->gdn_v_grouped);
  EXPECT_EQ(pr->inverse_weight_names, (std::vector<std::string>{"token_embd.weight"}));
  int n_minus = 0;
  for (float s : pr->signs_for_width(64)) n_minus += s < 0;
  EXPECT_GT(n_minus, 10);
  EXPECT_LT(n_minus, 54);

  // The rotated list: every layer matmul except ssm_alpha / ssm_beta, and output.weight.
  std::set<std::string> want = {"output.weight"};
  for (int il = 0; il < 4; ++il) {
    const std::string b = "blk." + std::to_string(il) + ".";
    for (const char* n : {"ffn_gate", "ffn_up", "ffn_down"}) want.insert(b + n + ".weight");
    if (il == 3)
      for (const char* n : {"attn_q", "attn_k", "attn_v", "attn_output"}) want.insert(b + n + ".weight");
    else
      for (const char* n : {"attn_qkv", "attn_gate", "ssm_out"}) want.insert(b + n + ".weight");
  }
  EXPECT_EQ(std::set<std::string>(pr->weight_names.begin(), pr->weight_names.end()), want);

  // For every rotated tensor: <stored row, H_blk(s (.) P x)> == <unrotated GGUF row, x> for random x.
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  const std::vector<int32_t> perm = prism::ssm_out_permutation(m.Hk, m.Hv, m.dv);
  for (const std::string& name : pr->weight_names) {
    const gguf::TensorInfo& t = f.tensor(name);
    const int64_t n = t.ne[0];
    const auto stored = read_f32(f, name), orig = read_f32(*plain.file, name);
    const bool is_ssm_out = name.find("ssm_out") != std::string::npos;
    for (int trial = 0; trial < 3; ++trial) {
      std::vector<float> x(n), y(n);
      for (float& v : x) v = nd(rng);
      prism::hadamard_forward_row(x.data(), pr->signs_for_width(n).data(), is_ssm_out ? perm.data() : nullptr,
                                  y.data(), n, pr->block_size);
      for (int64_t r = 0; r < t.n_rows(); ++r) {
        const double want_v = dot(orig.data() + r * n, x.data(), n);
        const double got_v = dot(stored.data() + r * n, y.data(), n);
        ASSERT_NEAR(got_v, want_v, 1e-4 * (1 + std::abs(want_v))) << name << " row " << r;
      }
    }
  }
  // token_embd (inverse list): s (.) H_blk(stored row) == the embedding row.
  const auto se = read_f32(f, "token_embd.weight"), pe = read_f32(*plain.file, "token_embd.weight");
  std::vector<float> e(m.E);
  for (int64_t r = 0; r < m.V; ++r) {
    prism::hadamard_inverse_row(se.data() + r * m.E, pr->signs_for_width(m.E).data(), e.data(), m.E, pr->block_size);
    for (int64_t i = 0; i < m.E; ++i) ASSERT_NEAR(e[i], pe[r * m.E + i], 1e-5) << "token_embd row " << r;
  }
  // Not rotated: ssm_alpha / ssm_beta and the vectors.
  EXPECT_EQ(read_f32(f, "blk.0.ssm_alpha.weight"), read_f32(*plain.file, "blk.0.ssm_alpha.weight"));
  EXPECT_EQ(read_f32(f, "blk.0.ssm_conv1d.weight"), read_f32(*plain.file, "blk.0.ssm_conv1d.weight"));
  // The same seed gives the same file; another seed other signs.
  EXPECT_EQ(prism_sign_values(42, {64}), prism_sign_values(42, {64}));
  EXPECT_NE(prism_sign_values(42, {64}), prism_sign_values(43, {64}));
  EXPECT_EQ(prism_block_size({5120, 6144, 17408}), 1024);
  EXPECT_EQ(prism_block_size({256, 512}), 256);
}

// ---------------------------------------------------------------------------------------------
// The runtime on converted files: plain vs prism give the same logits (the rotation and the ssm_out
// permutation cancel), for qwen35 and for a tied qwen3.

std::vector<float> run_logits(const std::string& path, const std::vector<int32_t>& tokens) {
  auto be = make_cpu_backend(2);
  const gguf::File f = gguf::File::open(path);
  TargetOptions to;
  to.n_ctx = 64;
  to.max_rows = 16;
  auto model = TargetModel::load(f, *be, to);
  ForwardOptions fo;
  fo.logits = LogitRows::kAll;
  fo.want_logits = true;
  return model->forward(tokens, fo).logits;
}

void expect_close_logits(const std::vector<float>& a, const std::vector<float>& b, double rel) {
  ASSERT_EQ(a.size(), b.size());
  double mx = 0, diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(std::isfinite(a[i]) && std::isfinite(b[i])) << i;
    mx = std::max(mx, static_cast<double>(std::abs(a[i])));
    diff = std::max(diff, static_cast<double>(std::abs(a[i] - b[i])));
  }
  EXPECT_GT(mx, 0.0);
  EXPECT_LE(diff, rel * mx) << "max |diff| " << diff << " max |logit| " << mx;
}

TEST(Convert, RuntimeGivesTheSameLogitsWithAndWithoutPrism) {
  const std::vector<int32_t> tokens = {1, 65, 258, 7, 299, 100, 3, 42, 260, 11};
  for (bool hybrid : {true, false}) {
    FakeModel m;
    m.hybrid = hybrid;
    if (!hybrid) {
      m.n_layer = 2;
      m.tied = true;
    }
    m.build();
    const std::string tag = hybrid ? "rt35" : "rt3";
    const Converted plain = convert(m, tag + "_plain");
    ConvertOptions o;
    o.prism = true;
    const Converted rot = convert(m, tag + "_prism", o);
    if (!hybrid) {
      EXPECT_NE(rot.file->find_tensor("output.weight"), nullptr);  // tied + prism: rotated copy
    }
    SCOPED_TRACE(tag);
    expect_close_logits(run_logits(plain.path, tokens), run_logits(rot.path, tokens), 1e-4);
  }
}

TEST(Convert, PrismTernaryRuns) {
  // A Bonsai-layout file (prism + PTQ1_0 on rows that are multiples of 128) loads and runs.
  FakeModel m;
  m.E = 128;
  m.FF = 256;
  m.hd = 64;  // q width 128
  m.dv = 16;
  m.dk = 16;
  m.Hk = 2;
  m.Hv = 8;  // inner 128
  m.build();
  ConvertOptions o;
  o.prism = true;
  o.type = GgmlType::PTQ1_0;
  const Converted c = convert(m, "ptq1", o);
  EXPECT_EQ(c.file->tensor("blk.0.ssm_out.weight").type, GgmlType::PTQ1_0);
  EXPECT_EQ(c.file->tensor("token_embd.weight").type, GgmlType::PTQ1_0);
  EXPECT_EQ(c.file->tensor("blk.0.ssm_alpha.weight").type, GgmlType::BF16);
  EXPECT_EQ(c.report.prism_block, 128);
  const auto logits = run_logits(c.path, {1, 2, 3, 4});
  for (float v : logits) ASSERT_TRUE(std::isfinite(v));
}

TEST(Convert, BonsaiLayoutCounts) {
  // The 27B's structure (64 layers, attention every 4th) at tiny widths: with --prism --type ptq1_0 the
  // file has Ternary Bonsai 2's layout (SPEC 2.1, 3): 851 tensors = 402 PTQ1_0 (every layer matmul,
  // token_embd, output) + 96 BF16 (ssm_alpha/beta) + 353 F32; 401 rotated names.
  FakeModel m;
  m.n_layer = 64;
  m.E = 128;
  m.FF = 256;
  m.hd = 64;
  m.Hk = 2;
  m.Hv = 8;
  m.dk = 16;
  m.dv = 16;
  m.V = 64;
  m.tokenizer = false;
  m.build();
  ConvertOptions o;
  o.prism = true;
  o.type = GgmlType::PTQ1_0;
  const Converted c = convert(m, "bonsai_layout", o);
  std::map<GgmlType, int> by_type;
  for (const gguf::TensorInfo& t : c.file->tensors()) ++by_type[t.type];
  EXPECT_EQ(c.file->tensors().size(), 851u);
  EXPECT_EQ(by_type[GgmlType::PTQ1_0], 402);
  EXPECT_EQ(by_type[GgmlType::BF16], 96);
  EXPECT_EQ(by_type[GgmlType::F32], 353);
  EXPECT_EQ(c.file->get_string_array("prism.hadamard.weight_names").size(), 401u);
  EXPECT_EQ(c.file->get_int("qwen35.full_attention_interval"), 4);
}

// ---------------------------------------------------------------------------------------------
// Errors

TEST(Convert, UnsupportedOrBrokenCheckpoints) {
  FakeModel m;
  m.build();
  const fs::path dir = temp_dir("errors");
  const fs::path hf = dir / "hf";
  const std::string out = (dir / "out.gguf").string();
  auto rewrite = [&](const FakeModel& mm, const std::function<void(json&)>& edit_config = {}) {
    fs::remove_all(hf);
    fs::create_directories(hf);
    mm.write(hf);
    if (edit_config) {
      json cfg = mm.config();
      edit_config(cfg);
      write_file(hf / "config.json", cfg.dump());
    }
  };
  rewrite(m, [](json& c) { c["model_type"] = "qwen3_moe"; });
  expect_error([&] { convert_hf_to_gguf(hf.string(), out, {}); }, "model_type 'qwen3_moe'");
  rewrite(m, [](json& c) { c.erase("hidden_size"); });
  expect_error([&] { convert_hf_to_gguf(hf.string(), out, {}); }, "missing 'hidden_size'");
  rewrite(m, [](json& c) { c["layer_types"][0] = "full_attention"; });
  expect_error([&] { convert_hf_to_gguf(hf.string(), out, {}); }, "full_attention_interval");
  rewrite(m, [](json& c) { c["rope_parameters"]["rope_type"] = "yarn"; });
  expect_error([&] { convert_hf_to_gguf(hf.string(), out, {}); }, "RoPE type 'yarn'");

  FakeModel missing = m;
  missing.tensors.erase("model.layers.1.linear_attn.in_proj_z.weight");
  rewrite(missing);
  expect_error([&] { convert_hf_to_gguf(hf.string(), out, {}); }, "model.layers.1.linear_attn.in_proj_z.weight");

  FakeModel bad_shape = m;
  bad_shape.tensors["model.layers.0.mlp.up_proj.weight"].shape = {64, 128};  // transposed
  rewrite(bad_shape);
  expect_error([&] { convert_hf_to_gguf(hf.string(), out, {}); }, "expected [128, 64]");

  // An integer dtype where a weight should be.
  FakeModel ints = m;
  rewrite(ints);
  {
    std::vector<StEntry> all;
    for (const auto& [n, e] : ints.tensors) all.push_back(e);
    std::vector<uint8_t> bytes = make_safetensors(all);
    // Patch the header: "F32" of the norm -> "I32" (same size, so offsets stay valid).
    std::string s(bytes.begin(), bytes.end());
    const size_t at = s.find("\"model.norm.weight\":{\"data_offsets\"");
    ASSERT_NE(at, std::string::npos);
    const size_t d = s.find("\"dtype\":\"F32\"", at);
    s.replace(d, 13, "\"dtype\":\"I32\"");
    write_file(hf / "model.safetensors", s);
  }
  expect_error([&] { convert_hf_to_gguf(hf.string(), out, {}); }, "dtype I32");

  expect_error([&] { convert_hf_to_gguf((dir / "nope").string(), out, {}); }, "not a directory");
  fs::remove(hf / "model.safetensors");
  expect_error([&] { convert_hf_to_gguf(hf.string(), out, {}); }, "no model.safetensors");
  // A shard name that leaves the folder.
  write_file(hf / "model.safetensors.index.json", std::string(R"({"weight_map": {"a": "../x.safetensors"}})"));
  expect_error([&] { convert_hf_to_gguf(hf.string(), out, {}); }, "not a plain file name");
  write_file(hf / "model.safetensors.index.json", std::string(R"({"weight_map": {"a": "other.safetensors"}})"));
  write_file(hf / "other.safetensors", make_safetensors({{"b", "F32", {1}, {1.0f}}}));
  expect_error([&] { convert_hf_to_gguf(hf.string(), out, {}); }, "has no such tensor");
}

std::vector<uint8_t> with_header(const std::string& header, size_t data_bytes = 0, int64_t len_override = -1) {
  const uint64_t n = len_override >= 0 ? static_cast<uint64_t>(len_override) : header.size();
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  s += header;
  s.append(data_bytes, '\0');
  return std::vector<uint8_t>(s.begin(), s.end());
}

TEST(Safetensors, ValidFileReads) {
  const auto bytes = make_safetensors({{"a", "F32", {2, 3}, {1, 2, 3, 4, 5, 6}}, {"b", "BF16", {2}, {0.5f, -2.0f}}});
  const hf::SafetensorsFile f = hf::SafetensorsFile::from_bytes(bytes, "ok.safetensors");
  ASSERT_EQ(f.tensors().size(), 2u);
  const hf::StTensor* a = f.find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a->n_elements(), 6);
  EXPECT_EQ(f.data(*a).size(), 24u);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.find("c"), nullptr);
}

TEST(Safetensors, MalformedFilesAreRejected) {
  auto bad = [](const std::vector<uint8_t>& b, const std::string& needle) {
    expect_error([&] { hf::SafetensorsFile::from_bytes(b, "bad.safetensors"); }, needle);
  };
  bad({1, 2, 3}, "too short");
  bad(with_header("{}", 0, 1000), "runs past the end");
  bad(with_header(std::string(16, ' '), 0, int64_t{1} << 62), "runs past the end");
  bad(with_header("[1, 2]"), "does not start with '{'");
  bad(with_header("{\"a\": "), "invalid JSON");
  bad(with_header("{" + std::string(100, '[') + std::string(100, ']') + "}"), "nested deeper");
  bad(with_header(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                      "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", 8),
      "more than once");
  bad(with_header(R"({"a": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 4]}})", 4), "unknown dtype 'Q4'");
  bad(with_header(R"({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4), "not a non-negative");
  bad(with_header(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}})", 8), "needs 8 bytes");
  bad(with_header(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 8), "past the data section");
  bad(with_header(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})", 8), "end before they begin");
  bad(with_header(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})", 12),
      "overlap");
  bad(with_header(R"({"a": {"dtype": "F32", "shape": [4294967296, 4294967296, 16], "data_offsets": [0, 0]}})"),
      "overflows");
  bad(with_header(R"({"a": {"dtype": "F32", "shape": [1]}})", 4), "data_offsets");
  bad(with_header(R"({"a": 5})"), "not an object");
  bad(with_header(R"({"__metadata__": {"x": 1}})"), "__metadata__");
  // Every truncation of a valid file is rejected cleanly (never a crash).
  const auto good = make_safetensors({{"a", "F32", {2, 3}, {1, 2, 3, 4, 5, 6}}});
  for (size_t n = 0; n < good.size(); ++n) {
    std::vector<uint8_t> cut(good.begin(), good.begin() + n);
    EXPECT_THROW(hf::SafetensorsFile::from_bytes(cut, "cut"), Error) << n;
  }
}

}  // namespace
}  // namespace dflash
