#include "models/synth.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <vector>

#include "gguf/gguf.h"
#include "util/error.h"
#include "util/hash.h"
#include "util/parallel.h"

namespace dflash {
namespace {

uint64_t hash_name(const std::string& s, uint64_t seed) { return splitmix64(name_hash(s, seed)); }

float synth_uniform(uint64_t seed, uint64_t index) {  // [0, 1)
  return static_cast<float>(splitmix64(seed ^ splitmix64(index)) >> 40) * (1.0f / 16777216.0f);
}

// How a tensor's values are drawn.
enum class Dist { kNormal, kNorm, kUniform, kNegExp };

struct TensorPlan {
  std::string name;
  GgmlType type;
  std::vector<int64_t> ne;
  Dist dist;
  float scale;
};

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// GPT-2 byte-level vocabulary: the 256 byte symbols, chat specials, then unused fillers.
void add_byte_tokenizer(gguf::Writer& w, int64_t n_vocab) {
  using gguf::Value;
  using gguf::ValueType;
  std::vector<uint32_t> byte_cp(256);
  int next = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    byte_cp[b] = printable ? b : 256 + next++;
  }
  std::vector<Value> tokens, types;
  for (int b = 0; b < 256; ++b) {
    tokens.push_back(Value::string(utf8(byte_cp[b])));
    types.push_back(Value::i32(1));
  }
  const char* specials[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>", "<think>", "</think>"};
  for (const char* s : specials) {
    tokens.push_back(Value::string(s));
    types.push_back(Value::i32(std::string(s)[0] == '<' && std::string(s)[1] == '|' ? 3 : 4));
  }
  // The rest: two-symbol merges of letters and the space symbol (U+0120), most common first, so
  // that BPE has real merges to apply and random models print word-like text.
  const std::string letters = " etaoinshrdlucmfwypvbgkjqxz";
  auto sym = [&](char c) { return utf8(byte_cp[static_cast<unsigned char>(c)]); };
  std::vector<Value> merges;
  for (size_t a = 0; a < letters.size() && static_cast<int64_t>(tokens.size()) < n_vocab; ++a)
    for (size_t b = 1; b < letters.size() && static_cast<int64_t>(tokens.size()) < n_vocab; ++b) {
      tokens.push_back(Value::string(sym(letters[a]) + sym(letters[b])));
      types.push_back(Value::i32(1));
      merges.push_back(Value::string(sym(letters[a]) + " " + sym(letters[b])));
    }
  for (int64_t i = static_cast<int64_t>(tokens.size()); i < n_vocab; ++i) {
    tokens.push_back(Value::string("<|unused_" + std::to_string(i) + "|>"));
    types.push_back(Value::i32(5));
  }
  w.set("tokenizer.ggml.model", Value::string("gpt2"));
  w.set("tokenizer.ggml.pre", Value::string("qwen2"));
  w.set("tokenizer.ggml.tokens", Value::array(ValueType::STRING, std::move(tokens)));
  w.set("tokenizer.ggml.token_type", Value::array(ValueType::I32, std::move(types)));
  w.set("tokenizer.ggml.merges", Value::array(ValueType::STRING, std::move(merges)));
  w.set("tokenizer.ggml.bos_token_id", Value::u32(256));
  w.set("tokenizer.ggml.eos_token_id", Value::u32(258));
  w.set("tokenizer.ggml.padding_token_id", Value::u32(256));
  w.set("tokenizer.ggml.mask_token_id", Value::u32(259));
  w.set("tokenizer.ggml.add_bos_token", Value::boolean(false));
  w.set("tokenizer.chat_template",
        Value::string("{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
                      "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- "
                      "'<|im_start|>assistant\\n' }}{%- endif %}"));
}

}  // namespace

void SynthTensorWriter::add(const std::string& name, GgmlType type, const std::vector<int64_t>& ne,
                            RowValues fill_row, std::shared_ptr<std::vector<uint8_t>> keep) {
  const int64_t n = ne.at(0);
  const size_t rb = row_bytes(type, n);
  int64_t rows = 1;
  for (size_t i = 1; i < ne.size(); ++i) rows *= ne[i];
  shared_->total += rb * static_cast<uint64_t>(rows);
  if (keep) keep->assign(rb * static_cast<size_t>(rows), 0);
  writer_.add_tensor_rows(name, type, ne, [type, n, rb, fill_row = std::move(fill_row), shared = shared_, keep](
                                              int64_t row0, int64_t n_rows, uint8_t* dst) {
    parallel_ranges(row0, row0 + n_rows, std::min(16, hardware_threads()), 4, [&](int64_t a, int64_t b) {
      std::vector<float> row(n);
      for (int64_t r = a; r < b; ++r) {
        fill_row(r, row.data());
        quantize_row(type, row.data(), dst + (r - row0) * rb, n);
      }
    });
    if (keep) std::memcpy(keep->data() + static_cast<size_t>(row0) * rb, dst, rb * static_cast<size_t>(n_rows));
    const uint64_t d = shared->done.fetch_add(rb * n_rows) + rb * n_rows;
    if (shared->progress) shared->progress(d, shared->total);
  });
}

void SynthTensorWriter::add_copy(const std::string& name, GgmlType type, const std::vector<int64_t>& ne,
                                 std::shared_ptr<const std::vector<uint8_t>> bytes) {
  const size_t rb = row_bytes(type, ne.at(0));
  int64_t rows = 1;
  for (size_t i = 1; i < ne.size(); ++i) rows *= ne[i];
  DFLASH_CHECK(bytes && bytes->size() == rb * static_cast<size_t>(rows), "synth: {} copies a tensor of another size",
               name);
  shared_->total += rb * static_cast<uint64_t>(rows);
  writer_.add_tensor_rows(name, type, ne, [rb, bytes = std::move(bytes), shared = shared_](
                                              int64_t row0, int64_t n_rows, uint8_t* dst) {
    std::memcpy(dst, bytes->data() + static_cast<size_t>(row0) * rb, rb * static_cast<size_t>(n_rows));
    const uint64_t d = shared->done.fetch_add(rb * n_rows) + rb * n_rows;
    if (shared->progress) shared->progress(d, shared->total);
  });
}

float synth_normal(uint64_t seed, uint64_t index) {
  // Irwin-Hall with 4 uniforms: cheap, bounded, close enough to normal for random weights.
  float s = 0;
  for (uint64_t j = 0; j < 4; ++j) s += synth_uniform(seed, index * 4 + j);
  return (s - 2.0f) * 1.7320508f;
}

SynthTargetSpec SynthTargetSpec::bonsai_27b(GgmlType t) {
  SynthTargetSpec s;
  s.arch = "qwen35";
  s.n_layer = 64;
  s.n_embd = 5120;
  s.n_ff = 17408;
  s.n_vocab = 248320;
  s.n_head = 24;
  s.n_head_kv = 4;
  s.head_dim = 256;
  s.n_rot = 64;
  s.n_ctx_train = 262144;
  s.rope_theta = 1e7;
  s.full_attn_interval = 4;
  s.ssm_conv_kernel = 4;
  s.ssm_k_heads = 16;
  s.ssm_v_heads = 48;
  s.ssm_head_k = 128;
  s.ssm_head_v = 128;
  s.matmul_type = t;
  s.alpha_beta_type = GgmlType::BF16;
  s.prism = true;
  s.prism_block = 1024;
  return s;
}

void synth_target(const SynthTargetSpec& s, const std::string& path,
                  const std::function<void(uint64_t, uint64_t)>& progress) {
  using gguf::Value;
  using gguf::ValueType;
  const bool hybrid = s.arch == "qwen35";
  DFLASH_CHECK(hybrid || s.arch == "qwen3", "synth: unknown architecture '{}' (qwen35 or qwen3)", s.arch);
  DFLASH_CHECK(s.n_head % s.n_head_kv == 0, "synth: head_count {} not a multiple of head_count_kv {}", s.n_head,
               s.n_head_kv);
  const int64_t n_rot = hybrid ? s.n_rot : s.head_dim;
  const int64_t inner = s.ssm_v_heads * s.ssm_head_v;
  const int64_t conv_dim = 2 * s.ssm_k_heads * s.ssm_head_k + inner;
  const int64_t q_width = s.n_head * s.head_dim;

  gguf::Writer w;
  const std::string p = s.arch + ".";
  w.set("general.architecture", Value::string(s.arch));
  w.set("general.name", Value::string("dflash synthetic " + s.arch));
  w.set("general.type", Value::string("model"));
  w.set(p + "block_count", Value::u32(s.n_layer));
  w.set(p + "context_length", Value::u32(s.n_ctx_train));
  w.set(p + "embedding_length", Value::u32(s.n_embd));
  w.set(p + "feed_forward_length", Value::u32(s.n_ff));
  w.set(p + "attention.head_count", Value::u32(s.n_head));
  w.set(p + "attention.head_count_kv", Value::u32(s.n_head_kv));
  w.set(p + "attention.key_length", Value::u32(s.head_dim));
  w.set(p + "attention.value_length", Value::u32(s.head_dim));
  w.set(p + "attention.layer_norm_rms_epsilon", Value::f32(static_cast<float>(s.rms_eps)));
  w.set(p + "rope.freq_base", Value::f32(static_cast<float>(s.rope_theta)));
  w.set(p + "rope.dimension_count", Value::u32(n_rot));
  if (hybrid) {
    w.set(p + "rope.dimension_sections",
          Value::array(ValueType::I32, {Value::i32(11), Value::i32(11), Value::i32(10), Value::i32(0)}));
    w.set(p + "ssm.conv_kernel", Value::u32(s.ssm_conv_kernel));
    w.set(p + "ssm.inner_size", Value::u32(inner));
    w.set(p + "ssm.state_size", Value::u32(s.ssm_head_k));
    w.set(p + "ssm.time_step_rank", Value::u32(s.ssm_v_heads));
    w.set(p + "ssm.group_count", Value::u32(s.ssm_k_heads));
    w.set(p + "full_attention_interval", Value::u32(s.full_attn_interval));
  }
  if (s.tokenizer) {
    DFLASH_CHECK(s.n_vocab >= 262, "synth: a tokenizer needs n_vocab >= 262, got {}", s.n_vocab);
    add_byte_tokenizer(w, s.n_vocab);
  }

  // ---- the tensor plan, in the order llama.cpp writes them
  std::vector<TensorPlan> plan;
  const float e_scale = 1.0f;
  auto mat = [&](const std::string& name, int64_t in, int64_t out, GgmlType t, float extra = 1.0f) {
    plan.push_back({name, t, {in, out}, Dist::kNormal, extra / std::sqrt(static_cast<float>(in))});
  };
  auto vec = [&](const std::string& name, std::vector<int64_t> ne, Dist d, float scale) {
    plan.push_back({name, GgmlType::F32, std::move(ne), d, scale});
  };
  plan.push_back({"token_embd.weight", s.matmul_type, {s.n_embd, s.n_vocab}, Dist::kNormal, e_scale});
  vec("output_norm.weight", {s.n_embd}, Dist::kNorm, 0.1f);
  if (!s.tied_output) mat("output.weight", s.n_embd, s.n_vocab, s.matmul_type, static_cast<float>(s.logit_scale));
  std::vector<std::string> rotated;
  for (int64_t il = 0; il < s.n_layer; ++il) {
    const std::string b = "blk." + std::to_string(il) + ".";
    const bool attn = !hybrid || (il + 1) % s.full_attn_interval == 0;
    vec(b + "attn_norm.weight", {s.n_embd}, Dist::kNorm, 0.1f);
    if (attn) {
      mat(b + "attn_q.weight", s.n_embd, q_width * (hybrid ? 2 : 1), s.matmul_type);
      mat(b + "attn_k.weight", s.n_embd, s.n_head_kv * s.head_dim, s.matmul_type);
      mat(b + "attn_v.weight", s.n_embd, s.n_head_kv * s.head_dim, s.matmul_type);
      mat(b + "attn_output.weight", q_width, s.n_embd, s.matmul_type);
      vec(b + "attn_q_norm.weight", {s.head_dim}, Dist::kNorm, 0.1f);
      vec(b + "attn_k_norm.weight", {s.head_dim}, Dist::kNorm, 0.1f);
      for (const char* n : {"attn_q", "attn_k", "attn_v", "attn_output"}) rotated.push_back(b + n + ".weight");
    } else {
      mat(b + "attn_qkv.weight", s.n_embd, conv_dim, s.matmul_type);
      mat(b + "attn_gate.weight", s.n_embd, inner, s.matmul_type);
      vec(b + "ssm_conv1d.weight", {s.ssm_conv_kernel, conv_dim}, Dist::kUniform, 0.5f);
      vec(b + "ssm_dt.bias", {s.ssm_v_heads}, Dist::kUniform, 1.0f);
      vec(b + "ssm_a", {s.ssm_v_heads}, Dist::kNegExp, 1.0f);
      mat(b + "ssm_alpha.weight", s.n_embd, s.ssm_v_heads, s.alpha_beta_type);
      mat(b + "ssm_beta.weight", s.n_embd, s.ssm_v_heads, s.alpha_beta_type);
      vec(b + "ssm_norm.weight", {s.ssm_head_v}, Dist::kNorm, 0.1f);
      mat(b + "ssm_out.weight", inner, s.n_embd, s.matmul_type);
      for (const char* n : {"attn_qkv", "attn_gate", "ssm_out"}) rotated.push_back(b + n + ".weight");
    }
    vec(b + (hybrid ? "post_attention_norm.weight" : "ffn_norm.weight"), {s.n_embd}, Dist::kNorm, 0.1f);
    mat(b + "ffn_gate.weight", s.n_embd, s.n_ff, s.matmul_type);
    mat(b + "ffn_up.weight", s.n_embd, s.n_ff, s.matmul_type);
    mat(b + "ffn_down.weight", s.n_ff, s.n_embd, s.matmul_type);
    for (const char* n : {"ffn_gate", "ffn_up", "ffn_down"}) rotated.push_back(b + n + ".weight");
  }
  if (!s.tied_output) rotated.push_back("output.weight");

  if (s.prism) {
    std::vector<int64_t> widths = {s.n_embd};
    for (int64_t wd : {inner, q_width, s.n_ff})
      if (std::find(widths.begin(), widths.end(), wd) == widths.end() && (hybrid || wd != inner)) widths.push_back(wd);
    for (int64_t wd : widths)
      DFLASH_CHECK(wd % s.prism_block == 0, "synth: prism needs every input width ({}) to be a multiple of the "
                   "Hadamard block {}", wd, s.prism_block);
    std::vector<Value> wv, sv, names;
    uint64_t k = 0;
    for (int64_t wd : widths) {
      wv.push_back(Value::u32(wd));
      for (int64_t i = 0; i < wd; ++i) sv.push_back(Value::i8(synth_uniform(s.seed ^ 0x5157, k++) < 0.5f ? -1 : 1));
    }
    for (const std::string& n : rotated) names.push_back(Value::string(n));
    w.set("prism.hadamard.version", Value::u32(1));
    w.set("prism.hadamard.block_size", Value::u32(s.prism_block));
    w.set("prism.hadamard.transform", Value::string("normalized-sylvester-walsh-hadamard"));
    w.set("prism.hadamard.axis", Value::string("input-last-dimension"));
    w.set("prism.hadamard.sign_mode", Value::string("explicit"));
    w.set("prism.hadamard.sign_widths", Value::array(ValueType::U32, std::move(wv)));
    w.set("prism.hadamard.sign_values", Value::array(ValueType::I8, std::move(sv)));
    w.set("prism.hadamard.weight_names", Value::array(ValueType::STRING, std::move(names)));
    w.set("prism.hadamard.inverse_weight_names",
          Value::array(ValueType::STRING, {Value::string("token_embd.weight")}));
    w.set("prism.hadamard.gdn_v_grouped", Value::boolean(hybrid));
  }

  // ---- data: rows generated in parallel chunks, deterministically
  SynthTensorWriter tw(w, progress);
  // repeat_layers: "blk.<il>.<rest>" of a layer takes the bytes the first layer of its kind wrote for <rest>.
  std::map<std::string, std::shared_ptr<std::vector<uint8_t>>> first_of_kind;
  for (const TensorPlan& t : plan) {
    std::shared_ptr<std::vector<uint8_t>> keep;
    if (s.repeat_layers && t.name.rfind("blk.", 0) == 0) {
      const size_t dot = t.name.find('.', 4);
      const int64_t il = std::stoll(t.name.substr(4, dot - 4));
      const bool attn = !hybrid || (il + 1) % s.full_attn_interval == 0;
      const std::string key = (attn ? "attention " : "gdn ") + t.name.substr(dot + 1);
      auto [it, first] = first_of_kind.try_emplace(key, nullptr);
      if (!first) {
        tw.add_copy(t.name, t.type, t.ne, it->second);
        continue;
      }
      keep = it->second = std::make_shared<std::vector<uint8_t>>();
    }
    const uint64_t tseed = hash_name(t.name, s.seed);
    const int64_t n = t.ne[0];
    tw.add(t.name, t.type, t.ne, [t, tseed, n](int64_t r, float* row) {
      for (int64_t i = 0; i < n; ++i) {
        const uint64_t idx = static_cast<uint64_t>(r) * n + i;
        switch (t.dist) {
          case Dist::kNormal: row[i] = t.scale * synth_normal(tseed, idx); break;
          case Dist::kNorm: row[i] = 1.0f + t.scale * synth_normal(tseed, idx); break;
          case Dist::kUniform: row[i] = t.scale * (2.0f * synth_uniform(tseed, idx) - 1.0f); break;
          case Dist::kNegExp: row[i] = -std::exp(3.0f * synth_uniform(tseed, idx) - 2.5f); break;
        }
      }
    }, keep);
  }
  w.write(path);
}

}  // namespace dflash
