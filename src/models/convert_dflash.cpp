#include "models/convert_dflash.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "gguf/gguf.h"
#include "models/drafter_metadata.h"
#include "models/hf_config.h"
#include "models/safetensors.h"
#include "util/error.h"
#include "util/parallel.h"

namespace dflash {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// config.json

// The drafter config as the GGUF metadata will say it (general.name and the clamping of n_ctx are
// the caller's). z-lab's target_layer_ids are layer outputs; target_layers holds layer inputs (+1).
DrafterMetadata read_draft_config(const std::string& dir) {
  const json top = hf::read_config_json(dir);
  const std::string path = (fs::path(dir) / "config.json").string();
  const json* dc = nullptr;
  if (auto it = top.find("dflash_config"); it != top.end() && it->is_object()) dc = &*it;
  // A value of the drafter config: dflash_config first, then the top level (z-lab's _draft_value).
  // Zero is a valid integer here (mask_token_id, selector_top_k = 0 for v1).
  const hf::ConfigFields r(path, {dc, &top}, /*min_integer=*/0, " (in dflash_config or at the top level)");
  const std::string archs = hf::architectures(top);
  DrafterMetadata c;
  c.dflash2 = archs.find("DFlash2DraftModel") != std::string::npos || r.integer_or("selector_top_k", 0) > 0;

  c.n_layer = r.integer("num_hidden_layers");
  c.n_embd = r.integer("hidden_size");
  c.n_ff = r.integer("intermediate_size");
  c.n_head = r.integer("num_attention_heads");
  c.n_head_kv = r.integer_or("num_key_value_heads", c.n_head);
  c.head_dim = r.integer_or("head_dim", c.n_head ? c.n_embd / c.n_head : 0);
  c.n_vocab = r.integer_or("vocab_size", 0);
  c.n_ctx = r.integer_or("max_position_embeddings", 4096);
  c.rms_eps = r.number_or("rms_norm_eps", 1e-6);
  DFLASH_CHECK(c.n_layer > 0 && c.n_embd > 0 && c.n_ff > 0 && c.n_head > 0 && c.n_head_kv > 0 && c.head_dim > 0 &&
                   c.n_head % c.n_head_kv == 0,
               "{}: inconsistent sizes: {} layers, hidden {}, ffn {}, heads {}/{} (kv), head_dim {}", path, c.n_layer,
               c.n_embd, c.n_ff, c.n_head, c.n_head_kv, c.head_dim);
  {
    const json* act = r.get("hidden_act");
    DFLASH_CHECK(!act || (act->is_string() && act->get<std::string>() == "silu"),
                 "{}: hidden_act {} is not supported (silu only)", path, act ? act->dump() : "");
  }
  DFLASH_CHECK(!r.boolean_or("attention_bias", false), "{}: attention_bias = true is not supported", path);
  DFLASH_CHECK(r.number_or("input_embedding_scale", 1.0) == 1.0, "{}: input_embedding_scale {} is not supported (1.0)",
               path, r.number_or("input_embedding_scale", 1.0));
  DFLASH_CHECK(r.number_or("output_multiplier", 1.0) == 1.0, "{}: output_multiplier {} is not supported (1.0)", path,
               r.number_or("output_multiplier", 1.0));
  DFLASH_CHECK(r.number_or("final_logit_softcapping", 0.0) <= 0.0, "{}: final_logit_softcapping {} is not supported",
               path, r.number_or("final_logit_softcapping", 0.0));

  // RoPE: transformers 5 keeps rope_theta in rope_parameters; older configs at the top level.
  const json* rp = r.get("rope_parameters");
  const json* rs = r.get("rope_scaling");
  for (const json* p : {rp, rs}) {
    const std::string type = hf::rope_type(p);
    DFLASH_CHECK(type == "default", "{}: RoPE type '{}' is not supported (plain RoPE only)", path, type);
  }
  if (rp && rp->is_object() && rp->contains("rope_theta") && (*rp)["rope_theta"].is_number())
    c.rope_theta = (*rp)["rope_theta"].get<double>();
  if (c.rope_theta <= 0) c.rope_theta = r.number_or("rope_theta", 0);
  DFLASH_CHECK(c.rope_theta > 0, "{}: no rope_theta (in rope_parameters or at the top level)", path);
  if (rp && rp->is_object() && rp->contains("partial_rotary_factor"))
    DFLASH_CHECK((*rp)["partial_rotary_factor"] == 1.0, "{}: partial_rotary_factor is not supported for drafters", path);

  // Attention pattern: one layer type for every layer.
  std::vector<std::string> types;
  if (const json* lt = r.get("layer_types")) {
    DFLASH_CHECK(lt->is_array() && static_cast<int64_t>(lt->size()) == c.n_layer,
                 "{}: layer_types must list {} layer types", path, c.n_layer);
    for (const json& t : *lt) {
      DFLASH_CHECK(t.is_string() && (t == "sliding_attention" || t == "full_attention"),
                   "{}: layer_types entry {} (sliding_attention or full_attention)", path, t.dump());
      types.push_back(t.get<std::string>());
    }
  } else if (r.boolean_or("use_sliding_window", false) && r.get("sliding_window")) {
    // transformers' Qwen3Config rule: layers from max_window_layers on slide
    const int64_t from = r.integer_or("max_window_layers", 28);
    for (int64_t i = 0; i < c.n_layer; ++i) types.push_back(i >= from ? "sliding_attention" : "full_attention");
  } else {
    types.assign(static_cast<size_t>(c.n_layer), "full_attention");
  }
  for (const std::string& t : types)
    DFLASH_CHECK(t == types[0], "{}: layer_types mixes sliding and full attention; the runtime has one pattern", path);
  const bool sliding = types[0] == "sliding_attention";
  if (sliding) {
    c.sliding_window = r.integer("sliding_window");
    DFLASH_CHECK(c.sliding_window > 0, "{}: sliding_window must be positive", path);
  }
  c.causal = r.get("is_causal") ? r.boolean_or("is_causal", false) : sliding;

  c.block_size = r.integer_or("block_size", 16);
  DFLASH_CHECK(c.block_size >= 2 && c.block_size <= 64, "{}: block_size {} must be 2..64", path, c.block_size);
  const json* ids = r.get("target_layer_ids");
  DFLASH_CHECK(ids && ids->is_array() && !ids->empty() && ids->size() <= 64,
               "{}: dflash_config.target_layer_ids must list the tapped target layers", path);
  for (const json& id : *ids) {
    DFLASH_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() < (1 << 20),
                 "{}: target_layer_ids entry {} is not a layer id", path, id.dump());
    c.target_layers.push_back(id.get<int64_t>() + 1);  // SPEC 2.5
  }
  DFLASH_CHECK(r.get("mask_token_id") != nullptr, "{}: dflash_config.mask_token_id is missing", path);
  c.mask_token = r.integer("mask_token_id");
  if (c.dflash2) {
    c.conv_kernel = r.integer("conv_kernel_size");
    c.conv_group = r.integer("conv_group_size");
    c.selector_rank = r.integer("selector_rank");
    c.selector_top_k = r.integer("selector_top_k");
    DFLASH_CHECK(c.conv_kernel >= 1 && c.conv_kernel <= 16 && c.conv_group >= 1 && c.n_embd % c.conv_group == 0,
                 "{}: conv_kernel_size {} / conv_group_size {} invalid for hidden {}", path, c.conv_kernel,
                 c.conv_group, c.n_embd);
    DFLASH_CHECK(c.selector_rank >= 1 && c.selector_top_k >= 1, "{}: selector_rank / selector_top_k must be positive",
                 path);
  }
  return c;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// One output tensor: rows of ne[0] floats read straight from the source (same row-major memory).
struct Plan {
  std::string name;
  GgmlType type;
  std::vector<int64_t> ne;
  const hf::StTensor* src;
};

}  // namespace

bool is_dflash_checkpoint(const std::string& dir) {
  if (!fs::exists(fs::path(dir) / "config.json")) return false;
  const json top = hf::read_config_json(dir);
  return hf::architectures(top).find("DFlash") != std::string::npos || top.contains("dflash_config");
}

ConvertReport convert_dflash_to_gguf(const std::string& dir, const std::string& out_path, const ConvertOptions& opts) {
  auto log = [&](const std::string& s) {
    if (opts.log) opts.log(s);
  };
  DFLASH_CHECK(fs::is_directory(dir), "{}: not a directory (expected a DFlash drafter folder)", dir);
  DFLASH_CHECK(!opts.prism, "{}: --prism does not apply to drafters (they are not rotated)", dir);
  const DrafterMetadata c = read_draft_config(dir);
  const hf::Checkpoint ck = hf::Checkpoint::open(dir);
  const TypeTraits& tt = type_traits(opts.type);
  DFLASH_CHECK(tt.has_codec, "convert: type {} cannot be written (no quantizer)", tt.name);
  const int n_threads = opts.threads > 0 ? opts.threads : hardware_threads();
  const int64_t E = c.n_embd, hd = c.head_dim, n_taps = static_cast<int64_t>(c.target_layers.size());

  // Some exports nest the drafter under "model."; z-lab's do not.
  const std::string pre = ck.find("fc.weight") ? "" : (ck.find("model.fc.weight") ? "model." : "");
  std::set<std::string> used;
  auto find = [&](std::initializer_list<std::string> names) -> const hf::StTensor* {
    for (const std::string& n : names)
      if (const hf::StTensor* t = ck.find(pre + n)) return t;
    return nullptr;
  };
  auto src = [&](std::initializer_list<std::string> names, const std::string& gguf_name,
                 const std::vector<int64_t>& shape) -> const hf::StTensor* {
    const hf::StTensor* t = find(names);
    if (!t) (void)ck.require(pre + *names.begin(), gguf_name);  // throws naming the tensor
    DFLASH_CHECK(hf::dtype_is_float(t->dtype), "{}: tensor '{}' has dtype {}; convert reads F32, F16 and BF16",
                 ck.file_of(*t), t->name, t->dtype);
    DFLASH_CHECK(t->shape == shape, "{}: tensor '{}' has shape {}, expected {} (from config.json)", ck.file_of(*t),
                 t->name, t->shape_string(), shape_str(shape));
    used.insert(t->name);
    return t;
  };
  std::vector<Plan> plans;
  auto matrix = [&](const std::string& name, std::initializer_list<std::string> hf, int64_t in, int64_t out) {
    const GgmlType type = in % tt.block_elems == 0 ? opts.type : GgmlType::F32;
    if (type != opts.type)
      log(fmt::format("note: {} stays f32 (row length {} is not a multiple of {}'s block {})", name, in, tt.name,
                      tt.block_elems));
    plans.push_back({name, type, {in, out}, src(hf, name, {out, in})});
  };
  auto vec = [&](const std::string& name, std::initializer_list<std::string> hf, std::vector<int64_t> ne,
                 std::vector<int64_t> hf_shape) { plans.push_back({name, GgmlType::F32, std::move(ne), src(hf, name, hf_shape)}); };

  // ---- the SPEC 4.1 tensor order
  matrix("fc.weight", {"fc.weight"}, n_taps * E, E);
  vec("enc.output_norm.weight", {"hidden_norm.weight"}, {E}, {E});
  vec("output_norm.weight", {"norm.weight"}, {E}, {E});
  int64_t n_vocab = c.n_vocab;
  if (c.dflash2) {
    const int64_t R = c.selector_rank;
    const hf::StTensor* pc = find({"candidate_selector.predecessor_codebook", "candidate_selector.predecessor_codebook.weight"});
    DFLASH_CHECK(pc && pc->shape.size() == 2 && pc->shape[1] == R,
                 "{}: candidate_selector.predecessor_codebook must be [vocab, {}]{}", dir, R,
                 pc ? ", got " + pc->shape_string() : " (missing)");
    n_vocab = pc->shape[0];
    matrix("selector_hidden.weight", {"candidate_selector.hidden_projection.weight"}, E, R);
    matrix("selector_predecessor.weight",
           {"candidate_selector.predecessor_codebook", "candidate_selector.predecessor_codebook.weight"}, R, n_vocab);
    matrix("selector_successor.weight",
           {"candidate_selector.successor_codebook", "candidate_selector.successor_codebook.weight"}, R, n_vocab);
  }
  DFLASH_CHECK(n_vocab <= 0 || c.mask_token < n_vocab, "{}: mask_token_id {} is outside the vocabulary of {}", dir,
               c.mask_token, n_vocab);
  const int64_t K = c.conv_kernel, G = c.dflash2 ? E / c.conv_group : 0;
  for (int64_t il = 0; il < c.n_layer; ++il) {
    const std::string h = "layers." + std::to_string(il) + ".", b = "blk." + std::to_string(il) + ".";
    vec(b + "attn_norm.weight", {h + "input_layernorm.weight"}, {E}, {E});
    if (c.dflash2) {
      vec(b + "attn_conv_base", {h + "attention_conv.base_kernel"}, {E, K, 2}, {2, K, E});
      matrix(b + "attn_conv_proj.weight", {h + "attention_conv.kernel_projection.weight"}, E, 2 * K * G);
    }
    matrix(b + "attn_q.weight", {h + "self_attn.q_proj.weight"}, E, c.n_head * hd);
    matrix(b + "attn_k.weight", {h + "self_attn.k_proj.weight"}, E, c.n_head_kv * hd);
    matrix(b + "attn_v.weight", {h + "self_attn.v_proj.weight"}, E, c.n_head_kv * hd);
    vec(b + "attn_q_norm.weight", {h + "self_attn.q_norm.weight"}, {hd}, {hd});
    vec(b + "attn_k_norm.weight", {h + "self_attn.k_norm.weight"}, {hd}, {hd});
    matrix(b + "attn_output.weight", {h + "self_attn.o_proj.weight"}, c.n_head * hd, E);
    vec(b + "ffn_norm.weight", {h + "post_attention_layernorm.weight"}, {E}, {E});
    if (c.dflash2) {
      vec(b + "ffn_conv_base", {h + "mlp_conv.base_kernel"}, {E, K, 2}, {2, K, E});
      matrix(b + "ffn_conv_proj.weight", {h + "mlp_conv.kernel_projection.weight"}, E, 2 * K * G);
    }
    matrix(b + "ffn_gate.weight", {h + "mlp.gate_proj.weight"}, E, c.n_ff);
    matrix(b + "ffn_up.weight", {h + "mlp.up_proj.weight"}, E, c.n_ff);
    matrix(b + "ffn_down.weight", {h + "mlp.down_proj.weight"}, c.n_ff, E);
  }

  // ---- metadata
  gguf::Writer w;
  DrafterMetadata meta = c;
  meta.name = fs::path(dir).filename().string();
  meta.n_ctx = std::min<int64_t>(c.n_ctx, UINT32_MAX);
  meta.n_vocab = n_vocab;  // DFlash 2: the codebook rows, whatever vocab_size said
  write_drafter_metadata(w, meta);
  if (c.rope_theta != 1e7)
    log(fmt::format("note: rope theta {} (the Qwen3.8-27B drafter uses 1e7; a mismatch with training ruins "
                    "acceptance)", c.rope_theta));

  // ---- data, streamed row chunks
  ConvertReport rep;
  rep.arch = "dflash";
  for (const Plan& pl : plans) {
    const size_t rb = row_bytes(pl.type, pl.ne[0]);
    const int64_t n = pl.ne[0];
    rep.data_bytes += rb * (pl.src->n_elements() / n);
    w.add_tensor_rows(pl.name, pl.type, pl.ne, [&ck, pl, rb, n, n_threads](int64_t row0, int64_t n_rows, uint8_t* dst) {
      parallel_ranges(row0, row0 + n_rows, n_threads, 4, [&](int64_t a, int64_t b) {
        std::vector<float> row(n);
        for (int64_t r = a; r < b; ++r) {
          ck.read(*pl.src, r * n, n, row.data());
          quantize_row(pl.type, row.data(), dst + (r - row0) * rb, n);
        }
      });
    });
    log(fmt::format("{} {} {}", pl.name, type_name(pl.type), shape_str(pl.ne)));
  }
  rep.n_tensors = static_cast<int64_t>(plans.size());
  for (const std::string& n : ck.names())
    if (!used.count(n)) rep.unused.push_back(n);
  for (const std::string& n : rep.unused) log("note: checkpoint tensor not converted: " + n);
  w.write(out_path);
  return rep;
}

}  // namespace dflash
