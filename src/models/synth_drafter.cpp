#include "models/synth_drafter.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <thread>

#include "gguf/gguf.h"
#include "models/drafter_metadata.h"
#include "util/error.h"
#include "util/hash.h"

namespace dflash {
namespace {

uint64_t tensor_seed(const std::string& name, uint64_t seed) {
  return splitmix64(name_hash(name, splitmix64(seed ^ 0xd4f1a5)));
}

// How a tensor's rows are drawn.
enum class Fill {
  kMatrix,    // N(0, 1) * scale
  kNorm,      // 1 + N(0, 1) * scale
  kConvBase,  // rows (stage s, tap o): tap 0 ~ 1 + noise, later taps ~ noise (identity-like, SPEC 6)
};

struct Plan {
  std::string name;
  GgmlType type;
  std::vector<int64_t> ne;
  Fill fill;
  float scale;
};

}  // namespace

SynthDrafterSpec SynthDrafterSpec::for_target(const SynthTargetSpec& t) {
  SynthDrafterSpec s;
  s.n_embd = t.n_embd;
  s.n_vocab = t.n_vocab;
  s.n_ctx_train = t.n_ctx_train;
  s.rope_theta = t.rope_theta;
  s.rms_eps = t.rms_eps;
  s.mask_token = t.tokenizer ? 259 : static_cast<int32_t>(t.n_vocab - 1);
  s.target_layers.clear();
  if (t.n_layer >= 8) {
    for (int i = 0; i < 5; ++i)
      s.target_layers.push_back(static_cast<int64_t>(std::lround(1.0 + i * (t.n_layer - 4) / 4.0)) + 1);
  } else {
    for (int64_t l = 1; l < t.n_layer && s.target_layers.size() < 3; ++l) s.target_layers.push_back(l);
    if (s.target_layers.empty()) s.target_layers.push_back(0);
  }
  s.head_dim = std::min<int64_t>(128, std::max<int64_t>(16, t.n_embd / 4));
  s.n_head = std::max<int64_t>(2, t.n_embd / s.head_dim);
  s.n_head_kv = std::max<int64_t>(1, s.n_head / 2);
  s.n_ff = 2 * t.n_embd;
  s.conv_group = t.n_embd % 16 == 0 ? 16 : 1;
  s.matmul_type = t.matmul_type == GgmlType::F32 ? GgmlType::F32 : GgmlType::Q8_0;
  s.codebook_type = s.matmul_type;
  s.heavy_type = s.matmul_type;
  return s;
}

SynthDrafterSpec SynthDrafterSpec::qwen38_27b() {
  SynthDrafterSpec s;
  s.n_layer = 5;
  s.n_embd = 5120;
  s.n_ff = 17408;
  s.n_head = 32;
  s.n_head_kv = 8;
  s.head_dim = 128;
  s.n_vocab = 248320;
  s.n_ctx_train = 262144;
  s.rope_theta = 1e7;
  s.rms_eps = 1e-6;
  s.block_size = 8;
  s.target_layers = {6, 20, 34, 48, 62};
  s.dflash2 = true;
  s.conv_kernel = 2;
  s.conv_group = 16;
  s.selector_rank = 256;
  s.selector_top_k = 16;
  s.sliding_window = 2048;
  s.causal = false;
  s.mask_token = 248070;
  s.matmul_type = GgmlType::Q4_K;
  s.codebook_type = GgmlType::Q4_K;
  s.heavy_type = GgmlType::Q6_K;
  s.heavy_layers = {2, 4};
  return s;
}

namespace {

std::vector<Plan> make_plan(const SynthDrafterSpec& s) {
  DFLASH_CHECK(s.n_layer > 0 && s.n_embd > 0 && s.n_ff > 0 && s.n_head > 0 && s.n_head_kv > 0 && s.head_dim > 0,
               "synth-drafter: sizes must be positive");
  DFLASH_CHECK(s.n_head % s.n_head_kv == 0, "synth-drafter: head_count {} not a multiple of head_count_kv {}",
               s.n_head, s.n_head_kv);
  DFLASH_CHECK(!s.target_layers.empty(), "synth-drafter: no target layers");
  DFLASH_CHECK(s.mask_token >= 0 && s.mask_token < s.n_vocab, "synth-drafter: mask token {} outside the vocabulary {}",
               s.mask_token, s.n_vocab);
  DFLASH_CHECK(s.block_size >= 2, "synth-drafter: block size {} < 2", s.block_size);
  if (s.dflash2)
    DFLASH_CHECK(s.conv_kernel >= 1 && s.conv_group >= 1 && s.n_embd % s.conv_group == 0 && s.selector_rank > 0 &&
                     s.selector_top_k > 0 && s.selector_top_k <= s.n_vocab,
                 "synth-drafter: conv kernel {} / group {} / selector rank {} / top-k {} invalid for hidden {}",
                 s.conv_kernel, s.conv_group, s.selector_rank, s.selector_top_k, s.n_embd);
  const int64_t E = s.n_embd, hd = s.head_dim, n_taps = static_cast<int64_t>(s.target_layers.size());
  const int64_t K = s.conv_kernel, G = s.dflash2 ? E / s.conv_group : 0;

  // ---- the tensor plan (SPEC 4.1 order)
  std::vector<Plan> plan;
  auto mat = [&](const std::string& name, int64_t in, int64_t out, GgmlType t, float extra = 1.0f) {
    plan.push_back({name, t, {in, out}, Fill::kMatrix, extra / std::sqrt(static_cast<float>(in))});
  };
  auto norm = [&](const std::string& name, int64_t n) { plan.push_back({name, GgmlType::F32, {n}, Fill::kNorm, 0.1f}); };
  mat("fc.weight", n_taps * E, E, s.matmul_type);
  norm("enc.output_norm.weight", E);
  norm("output_norm.weight", E);
  if (s.dflash2) {
    mat("selector_hidden.weight", E, s.selector_rank, s.matmul_type);
    plan.push_back({"selector_predecessor.weight", s.codebook_type, {s.selector_rank, s.n_vocab}, Fill::kMatrix, 1.0f});
    plan.push_back({"selector_successor.weight", s.codebook_type, {s.selector_rank, s.n_vocab}, Fill::kMatrix, 1.0f});
  }
  for (int64_t il = 0; il < s.n_layer; ++il) {
    const std::string b = "blk." + std::to_string(il) + ".";
    const bool heavy = std::find(s.heavy_layers.begin(), s.heavy_layers.end(), il) != s.heavy_layers.end();
    const GgmlType vt = heavy ? s.heavy_type : s.matmul_type;
    norm(b + "attn_norm.weight", E);
    if (s.dflash2) {
      plan.push_back({b + "attn_conv_base", GgmlType::F32, {E, K, 2}, Fill::kConvBase, 0.05f});
      mat(b + "attn_conv_proj.weight", E, 2 * K * G, s.matmul_type, 0.05f);
    }
    mat(b + "attn_q.weight", E, s.n_head * hd, s.matmul_type);
    mat(b + "attn_k.weight", E, s.n_head_kv * hd, s.matmul_type);
    mat(b + "attn_v.weight", E, s.n_head_kv * hd, vt);
    norm(b + "attn_q_norm.weight", hd);
    norm(b + "attn_k_norm.weight", hd);
    mat(b + "attn_output.weight", s.n_head * hd, E, s.matmul_type);
    norm(b + "ffn_norm.weight", E);
    if (s.dflash2) {
      plan.push_back({b + "ffn_conv_base", GgmlType::F32, {E, K, 2}, Fill::kConvBase, 0.05f});
      mat(b + "ffn_conv_proj.weight", E, 2 * K * G, s.matmul_type, 0.05f);
    }
    mat(b + "ffn_gate.weight", E, s.n_ff, s.matmul_type);
    mat(b + "ffn_up.weight", E, s.n_ff, s.matmul_type);
    mat(b + "ffn_down.weight", s.n_ff, E, vt);
  }

  for (const Plan& t : plan) {
    const int64_t be = type_traits(t.type).block_elems;
    DFLASH_CHECK(t.ne[0] % be == 0, "synth-drafter: tensor '{}' has rows of {} elements, not a multiple of {}'s block "
                 "of {} (pick another type)", t.name, t.ne[0], type_name(t.type), be);
  }
  return plan;
}

// The spec as file metadata. make_plan has checked it: mask_token < n_vocab, so n_vocab > 0.
DrafterMetadata metadata_of(const SynthDrafterSpec& s) {
  DrafterMetadata m;
  m.name = s.dflash2 ? "dflash synthetic DFlash 2 drafter" : "dflash synthetic DFlash drafter";
  m.n_layer = s.n_layer;
  m.n_ctx = s.n_ctx_train;
  m.n_embd = s.n_embd;
  m.n_ff = s.n_ff;
  m.n_head = s.n_head;
  m.n_head_kv = s.n_head_kv;
  m.head_dim = s.head_dim;
  m.rms_eps = s.rms_eps;
  m.rope_theta = s.rope_theta;
  m.block_size = s.block_size;
  m.target_layers = s.target_layers;  // already layer-input ids
  m.dflash2 = s.dflash2;
  m.conv_kernel = s.conv_kernel;
  m.conv_group = s.conv_group;
  m.selector_rank = s.selector_rank;
  m.selector_top_k = s.selector_top_k;
  m.sliding_window = s.sliding_window;
  m.causal = s.causal;
  m.n_vocab = s.n_vocab;
  m.mask_token = s.mask_token;
  return m;
}

}  // namespace

std::vector<SynthTensor> synth_drafter_tensors(const SynthDrafterSpec& spec) {
  std::vector<SynthTensor> out;
  for (const Plan& p : make_plan(spec)) out.push_back({p.name, p.type, p.ne});
  return out;
}

void synth_drafter(const SynthDrafterSpec& s, const std::string& path,
                   const std::function<void(uint64_t, uint64_t)>& progress) {
  const std::vector<Plan> plan = make_plan(s);
  gguf::Writer w;
  write_drafter_metadata(w, metadata_of(s));

  // ---- data: rows generated in parallel, deterministically
  SynthTensorWriter tw(w, progress);
  for (const Plan& t : plan) {
    const uint64_t tseed = tensor_seed(t.name, s.seed);
    const int64_t n = t.ne[0];
    const int64_t K_taps = t.ne.size() > 1 ? t.ne[1] : 1;
    tw.add(t.name, t.type, t.ne, [t, tseed, n, K_taps](int64_t r, float* row) {
      for (int64_t i = 0; i < n; ++i) {
        const float z = synth_normal(tseed, static_cast<uint64_t>(r) * n + i);
        switch (t.fill) {
          case Fill::kMatrix: row[i] = t.scale * z; break;
          case Fill::kNorm: row[i] = 1.0f + t.scale * z; break;
          case Fill::kConvBase: row[i] = (r % K_taps == 0 ? 1.0f : 0.0f) + t.scale * z; break;
        }
      }
    });
  }
  w.write(path);
}

}  // namespace dflash
