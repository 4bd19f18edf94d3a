#include "models/convert.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <unordered_map>

#include "gguf/gguf.h"
#include "models/hf_config.h"
#include "models/safetensors.h"
#include "prism/hadamard.h"
#include "util/error.h"
#include "util/parallel.h"

namespace dflash {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using gguf::Value;
using gguf::ValueType;

// ---------------------------------------------------------------------------------------------
// config.json

// The hyper-parameters we need, read from config.json (the text part of a multimodal config).
struct HfConfig {
  std::string model_type;
  bool hybrid = false;  // qwen35 (else qwen3)
  int64_t n_layer = 0, n_embd = 0, n_ff = 0, n_vocab = 0, n_head = 0, n_head_kv = 0, head_dim = 0, n_ctx = 0;
  double rms_eps = 1e-6, rope_theta = 0;
  int64_t n_rot = 0;
  bool tied = false;
  int64_t interval = 0;                // layer i is attention iff (i+1) % interval == 0
  std::vector<int32_t> rope_sections;  // qwen35 mrope sections, padded to 4
  int64_t conv_k = 0, k_heads = 0, v_heads = 0, head_k = 0, head_v = 0;
  std::optional<int64_t> bos_id, eos_id;
  bool is_attention(int64_t il) const { return (il + 1) % interval == 0; }
  int64_t key_dim() const { return k_heads * head_k; }
  int64_t inner() const { return v_heads * head_v; }
  int64_t conv_dim() const { return 2 * key_dim() + inner(); }
  int64_t q_width() const { return n_head * head_dim; }
};

std::optional<int64_t> token_id_field(const json& o, const char* key) {
  auto it = o.find(key);
  if (it == o.end() || it->is_null()) return std::nullopt;
  if (it->is_number_integer() && it->get<int64_t>() >= 0) return it->get<int64_t>();
  if (it->is_array() && !it->empty() && (*it)[0].is_number_integer() && (*it)[0].get<int64_t>() >= 0)
    return (*it)[0].get<int64_t>();  // eos_token_id may be a list: the first is the primary one
  return std::nullopt;
}

HfConfig read_config(const std::string& dir) {
  const std::string path = (fs::path(dir) / "config.json").string();
  const json top = hf::read_config_json(dir);
  HfConfig c;
  const json* text = &top;
  std::string where = "config.json";
  if (auto it = top.find("text_config"); it != top.end() && it->is_object()) {
    text = &*it;
    where = "config.json text_config";
  }
  const hf::ConfigFields r(where, {text});
  const hf::ConfigFields rt("config.json", {&top});
  c.model_type = r.string_or("model_type", rt.string_or("model_type", ""));
  const std::string archs = hf::architectures(top);
  const std::string mt = c.model_type, top_mt = rt.string_or("model_type", "");
  if (mt == "qwen3_5" || mt == "qwen3_5_text" || top_mt == "qwen3_5") {
    c.hybrid = true;
  } else if (mt == "qwen3") {
    c.hybrid = false;
  } else {
    fail("{}: model_type '{}' (architectures [{}]) is not supported: dflash convert handles qwen3_5 (the Qwen3.5 "
         "hybrid with a dense MLP) and qwen3 (dense){}",
         path, mt, archs,
         mt == "qwen3_next" || mt == "qwen3_5_moe" || mt == "qwen3_moe" ? "; mixture-of-experts models are not" : "");
  }

  c.n_layer = r.integer("num_hidden_layers");
  c.n_embd = r.integer("hidden_size");
  c.n_ff = r.integer("intermediate_size");
  c.n_head = r.integer("num_attention_heads");
  c.n_head_kv = r.integer_or("num_key_value_heads", c.n_head);
  c.head_dim = r.integer_or("head_dim", c.n_embd / c.n_head);
  c.n_ctx = r.integer_or("max_position_embeddings", 4096);
  c.rms_eps = r.number_or("rms_norm_eps", 1e-6);
  DFLASH_CHECK(c.n_head % c.n_head_kv == 0, "{}: num_attention_heads {} is not a multiple of num_key_value_heads {}",
               where, c.n_head, c.n_head_kv);
  DFLASH_CHECK(r.string_or("hidden_act", "silu") == "silu", "{}: hidden_act '{}' is not supported (silu only)", where,
               r.string_or("hidden_act", ""));
  DFLASH_CHECK(!r.boolean_or("attention_bias", false), "{}: attention_bias = true is not supported", where);
  DFLASH_CHECK(r.boolean_or("attn_output_gate", c.hybrid) == c.hybrid,
               "{}: attn_output_gate = {} is not supported for {} (the runtime expects {})", where, !c.hybrid,
               c.model_type, c.hybrid);
  if (r.get("tie_word_embeddings")) c.tied = r.boolean_or("tie_word_embeddings", false);
  else c.tied = rt.boolean_or("tie_word_embeddings", false);

  // RoPE: transformers 5 keeps rope_theta / partial_rotary_factor / mrope_section in rope_parameters
  // (older configs: top-level rope_theta and rope_scaling).
  const json* rp = r.get("rope_parameters");
  if (rp && rp->is_object() && !rp->contains("rope_theta") && rp->contains("full_attention"))
    rp = &(*rp)["full_attention"];  // per-layer-type parameters
  if (rp) DFLASH_CHECK(rp->is_object(), "{}: rope_parameters is not an object", where);
  const json* rs = r.get("rope_scaling");
  for (const json* p : {rp, rs}) {
    const std::string type = hf::rope_type(p);
    DFLASH_CHECK(type == "default" || type == "mrope", "{}: RoPE type '{}' is not supported (plain RoPE only)", where,
                 type);
  }
  const hf::ConfigFields rr(where + " rope_parameters", {rp});  // rp null: every key absent
  c.rope_theta = rr.number_or("rope_theta", r.number_or("rope_theta", 0));
  DFLASH_CHECK(c.rope_theta > 0, "{}: no rope_theta (in rope_parameters or at the top level)", where);
  const double prf = rr.number_or("partial_rotary_factor", r.number_or("partial_rotary_factor", c.hybrid ? 0.25 : 1.0));
  c.n_rot = static_cast<int64_t>(static_cast<double>(c.head_dim) * prf);
  DFLASH_CHECK(c.n_rot > 0 && c.n_rot <= c.head_dim && c.n_rot % 2 == 0,
               "{}: partial_rotary_factor {} gives {} rotary dims of head_dim {} (must be even, 2..head_dim)", where,
               prf, c.n_rot, c.head_dim);

  // Layer pattern.
  std::vector<std::string> types;
  if (const json* lt = r.get("layer_types")) {
    DFLASH_CHECK(lt->is_array() && static_cast<int64_t>(lt->size()) == c.n_layer,
                 "{}: layer_types must list {} layer types", where, c.n_layer);
    for (const json& t : *lt) {
      DFLASH_CHECK(t.is_string(), "{}: layer_types has a non-string entry {}", where, t.dump());
      types.push_back(t.get<std::string>());
    }
  }
  if (c.hybrid) {
    if (types.empty()) {
      c.interval = r.integer_or("full_attention_interval", 4);
    } else {
      int64_t first = -1;
      for (int64_t i = 0; i < c.n_layer; ++i) {
        DFLASH_CHECK(types[i] == "full_attention" || types[i] == "linear_attention",
                     "{}: layer_types[{}] = '{}' (expected full_attention or linear_attention)", where, i, types[i]);
        if (first < 0 && types[i] == "full_attention") first = i;
      }
      DFLASH_CHECK(first >= 0, "{}: layer_types has no full_attention layer; the runtime needs the pattern "
                   "'attention iff (i+1) % interval == 0'", where);
      c.interval = first + 1;
    }
    for (int64_t i = 0; i < c.n_layer && !types.empty(); ++i)
      DFLASH_CHECK((types[i] == "full_attention") == c.is_attention(i),
                   "{}: layer_types does not follow 'layer i is full attention iff (i+1) % {} == 0' (layer {} is {}); "
                   "the GGUF key full_attention_interval cannot express it",
                   where, c.interval, i, types[i]);
    c.conv_k = r.integer("linear_conv_kernel_dim");
    c.k_heads = r.integer("linear_num_key_heads");
    c.v_heads = r.integer("linear_num_value_heads");
    c.head_k = r.integer("linear_key_head_dim");
    c.head_v = r.integer("linear_value_head_dim");
    DFLASH_CHECK(c.v_heads % c.k_heads == 0, "{}: linear_num_value_heads {} is not a multiple of linear_num_key_heads {}",
                 where, c.v_heads, c.k_heads);
    c.rope_sections = {11, 11, 10, 0};
    const json* ms = rp && rp->contains("mrope_section") ? &(*rp)["mrope_section"]
                     : rs && rs->is_object() && rs->contains("mrope_section") ? &(*rs)["mrope_section"]
                                                                              : nullptr;
    if (ms) {
      DFLASH_CHECK(ms->is_array() && ms->size() <= 4, "{}: mrope_section {} is not a list of <= 4 integers", where,
                   ms->dump());
      c.rope_sections = {0, 0, 0, 0};
      for (size_t i = 0; i < ms->size(); ++i) {
        DFLASH_CHECK((*ms)[i].is_number_integer(), "{}: mrope_section {} is not a list of integers", where, ms->dump());
        c.rope_sections[i] = (*ms)[i].get<int32_t>();
      }
    }
  } else {
    for (int64_t i = 0; i < static_cast<int64_t>(types.size()); ++i)
      DFLASH_CHECK(types[i] == "full_attention", "{}: layer_types[{}] = '{}': only full attention is supported for qwen3",
                   where, i, types[i]);
    DFLASH_CHECK(!r.boolean_or("use_sliding_window", false), "{}: use_sliding_window = true is not supported", where);
    c.interval = 1;
  }
  c.bos_id = token_id_field(*text, "bos_token_id");
  if (!c.bos_id) c.bos_id = token_id_field(top, "bos_token_id");
  c.eos_id = token_id_field(*text, "eos_token_id");
  if (!c.eos_id) c.eos_id = token_id_field(top, "eos_token_id");
  return c;
}

// ---------------------------------------------------------------------------------------------
// Tensor plans

enum class Op { kCopy, kPlusOne, kNegExp };

// One GGUF tensor: out row r of ne[0] elements comes from source row row_map[r] (identity when empty)
// of the HF tensor viewed as [rows, src_row_len], element c from source column col_map[c] (identity
// when empty); then op, then the prism rotation when signs is set, then quantization to `type`.
struct Plan {
  std::string name;
  GgmlType type = GgmlType::F32;
  std::vector<int64_t> ne;
  const hf::StTensor* src = nullptr;
  int64_t src_row_len = 0;
  std::vector<int32_t> row_map, col_map;
  Op op = Op::kCopy;
  const std::vector<float>* signs = nullptr;
  int64_t block = 0;
  int64_t n_rows() const {
    int64_t n = 1;
    for (size_t i = 1; i < ne.size(); ++i) n *= ne[i];
    return n;
  }
};

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// Produces one output row (f32) of a plan into `row`, using `tmp` as scratch.
void make_row(const hf::Checkpoint& ck, const Plan& p, int64_t r, std::vector<float>& row, std::vector<float>& tmp) {
  const int64_t n = p.ne[0];
  const int64_t sr = p.row_map.empty() ? r : p.row_map[static_cast<size_t>(r)];
  row.resize(static_cast<size_t>(n));
  if (p.col_map.empty()) {
    ck.read(*p.src, sr * p.src_row_len, n, row.data());
  } else {
    tmp.resize(static_cast<size_t>(p.src_row_len));
    ck.read(*p.src, sr * p.src_row_len, p.src_row_len, tmp.data());
    for (int64_t c = 0; c < n; ++c) row[c] = tmp[p.col_map[c]];
  }
  if (p.op == Op::kPlusOne)
    for (float& v : row) v = 1.0f + v;
  else if (p.op == Op::kNegExp)
    for (float& v : row) v = -std::exp(v);
  if (p.signs) {
    // w_stored = H_blk(s (.) w) (prism/hadamard.h): the runtime's y = W_stored . H_blk(s (.) x) = W x.
    prism::rotate_weight_row(row.data(), p.signs->data(), row.data(), n, p.block);
  }
}

// ---------------------------------------------------------------------------------------------
// tokenizer.json -> tokenizer.ggml.*

// The two pre-tokenizer regexes our tokenizer implements (src/text/pretokenize.h).
constexpr const char* kQwen2Regex =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
    "\\s+(?!\\S)|\\s+";
constexpr const char* kQwen35Regex =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

void collect_regexes(const json& j, std::vector<std::string>& out) {
  if (j.is_object()) {
    if (j.value("type", "") == "Split" && j.contains("pattern") && j["pattern"].is_object() &&
        j["pattern"].contains("Regex") && j["pattern"]["Regex"].is_string())
      out.push_back(j["pattern"]["Regex"].get<std::string>());
    for (const auto& [k, v] : j.items()) collect_regexes(v, out);
  } else if (j.is_array()) {
    for (const json& v : j) collect_regexes(v, out);
  }
}

std::optional<std::string> special_token_content(const json& cfg, const char* key) {
  auto it = cfg.find(key);
  if (it == cfg.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
    return (*it)["content"].get<std::string>();
  return std::nullopt;
}

bool add_tokenizer(gguf::Writer& w, const std::string& dir, int64_t n_vocab, const HfConfig& cfg,
                   const std::function<void(const std::string&)>& log) {
  const fs::path tj_path = fs::path(dir) / "tokenizer.json";
  if (!fs::exists(tj_path)) {
    if (log) log("note: no tokenizer.json; the GGUF has no tokenizer (run it with --tokens)");
    return false;
  }
  const std::string tp = tj_path.string();
  const json tj = hf::read_json_file(tp, 1ull << 30, 32);
  DFLASH_CHECK(tj.contains("model") && tj["model"].is_object(), "{}: missing object 'model'", tp);
  const json& model = tj["model"];
  const std::string mtype = model.value("type", "BPE");
  DFLASH_CHECK(mtype == "BPE", "{}: model type '{}' is not supported (byte-level BPE only)", tp, mtype);
  DFLASH_CHECK(!(model.contains("ignore_merges") && model["ignore_merges"] == true) &&
                   !(model.contains("byte_fallback") && model["byte_fallback"] == true),
               "{}: BPE with ignore_merges or byte_fallback is not supported (byte-level BPE with merges only)", tp);
  if (tj.contains("normalizer") && !tj["normalizer"].is_null() && log)
    log(fmt::format("note: tokenizer.json has a {} normalizer, which dflash's tokenizer does not apply (as llama.cpp); "
                    "text that is not already normalized may tokenize differently",
                    tj["normalizer"].is_object() ? tj["normalizer"].value("type", "?") : "?"));

  // Pre-tokenizer: must be one of the two regexes we implement.
  std::vector<std::string> regexes;
  if (tj.contains("pre_tokenizer")) collect_regexes(tj["pre_tokenizer"], regexes);
  std::string pre;
  for (const std::string& re : regexes) {
    if (re == kQwen2Regex) pre = "qwen2";
    else if (re == kQwen35Regex) pre = "qwen35";
  }
  DFLASH_CHECK(!pre.empty(), "{}: the pre-tokenizer {} is not one dflash implements (the qwen2 / qwen35 Split regex)",
               tp, regexes.empty() ? std::string("(no Split regex)") : "regex '" + regexes[0] + "'");

  std::vector<std::string> tokens(static_cast<size_t>(n_vocab));
  std::vector<int32_t> types(static_cast<size_t>(n_vocab), 0);
  std::unordered_map<std::string, int64_t> by_text;
  DFLASH_CHECK(model.contains("vocab") && model["vocab"].is_object(), "{}: model.vocab is not an object", tp);
  for (const auto& [text, idv] : model["vocab"].items()) {
    DFLASH_CHECK(idv.is_number_integer(), "{}: vocab['{}'] is not an integer id", tp, text);
    const int64_t id = idv.get<int64_t>();
    DFLASH_CHECK(id >= 0 && id < n_vocab, "{}: vocab['{}'] = {} is outside the model's {} embedding rows", tp, text, id,
                 n_vocab);
    DFLASH_CHECK(types[id] == 0, "{}: token id {} appears twice in the vocabulary", tp, id);
    tokens[id] = text;
    types[id] = 1;  // normal
    by_text[text] = id;
  }
  if (tj.contains("added_tokens")) {
    DFLASH_CHECK(tj["added_tokens"].is_array(), "{}: added_tokens is not an array", tp);
    for (const json& a : tj["added_tokens"]) {
      DFLASH_CHECK(a.is_object() && a.contains("id") && a["id"].is_number_integer() && a.contains("content") &&
                       a["content"].is_string(),
                   "{}: an added_tokens entry lacks an integer id or a string content: {}", tp, a.dump());
      const int64_t id = a["id"].get<int64_t>();
      const std::string text = a["content"].get<std::string>();
      DFLASH_CHECK(id >= 0 && id < n_vocab, "{}: added token '{}' has id {}, outside the model's {} embedding rows", tp,
                   text, id, n_vocab);
      const bool looks_special = text.size() >= 4 && text.rfind("<|", 0) == 0 && text.substr(text.size() - 2) == "|>";
      tokens[id] = text;
      types[id] = a.value("special", false) || looks_special ? 3 : 4;  // control : user-defined
      by_text[text] = id;
    }
  }
  int64_t n_pad = 0;
  for (int64_t i = 0; i < n_vocab; ++i) {
    if (types[i] != 0) continue;
    tokens[i] = "[PAD" + std::to_string(i) + "]";
    types[i] = 5;  // unused
    ++n_pad;
  }

  std::vector<Value> merges;
  if (model.contains("merges")) {
    DFLASH_CHECK(model["merges"].is_array(), "{}: model.merges is not an array", tp);
    merges.reserve(model["merges"].size());
    for (const json& m : model["merges"]) {
      if (m.is_string()) {
        merges.push_back(Value::string(m.get<std::string>()));
      } else {
        DFLASH_CHECK(m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string(),
                     "{}: a merge is neither \"a b\" nor [\"a\", \"b\"]: {}", tp, m.dump());
        const std::string a = m[0].get<std::string>(), b = m[1].get<std::string>();
        DFLASH_CHECK(a.find(' ') == std::string::npos && b.find(' ') == std::string::npos,
                     "{}: merge [{}] has a space inside a part, which 'a b' merges cannot express", tp, m.dump());
        merges.push_back(Value::string(a + " " + b));
      }
    }
  }

  std::vector<Value> tv, ty;
  tv.reserve(tokens.size());
  ty.reserve(types.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    tv.push_back(Value::string(std::move(tokens[i])));
    ty.push_back(Value::i32(types[i]));
  }
  w.set("tokenizer.ggml.model", Value::string("gpt2"));
  w.set("tokenizer.ggml.pre", Value::string(pre));
  w.set("tokenizer.ggml.tokens", Value::array(ValueType::STRING, std::move(tv)));
  w.set("tokenizer.ggml.token_type", Value::array(ValueType::I32, std::move(ty)));
  w.set("tokenizer.ggml.merges", Value::array(ValueType::STRING, std::move(merges)));

  // Special ids: tokenizer_config.json first, config.json's ids as the fallback (as llama.cpp does).
  json tc = json::object();
  const fs::path tc_path = fs::path(dir) / "tokenizer_config.json";
  if (fs::exists(tc_path)) tc = hf::read_json_file(tc_path.string(), 64ull << 20, 16);
  auto id_of = [&](const char* key) -> std::optional<int64_t> {
    const auto content = special_token_content(tc, key);
    if (!content) return std::nullopt;
    auto it = by_text.find(*content);
    if (it == by_text.end()) {
      if (log) log(fmt::format("note: tokenizer_config.json {} '{}' is not in the vocabulary; ignored", key, *content));
      return std::nullopt;
    }
    return it->second;
  };
  std::optional<int64_t> bos = id_of("bos_token"), eos = id_of("eos_token"), pad = id_of("pad_token"),
                         unk = id_of("unk_token");
  if (!bos) bos = cfg.bos_id;
  if (!eos) eos = cfg.eos_id;
  auto set_id = [&](const char* key, std::optional<int64_t> id) {
    if (!id) return;
    DFLASH_CHECK(*id >= 0 && *id < n_vocab, "{}: {} {} is outside the vocabulary ({} tokens)", dir, key, *id, n_vocab);
    w.set(key, Value::u32(static_cast<uint32_t>(*id)));
  };
  set_id("tokenizer.ggml.bos_token_id", bos);
  set_id("tokenizer.ggml.eos_token_id", eos);
  set_id("tokenizer.ggml.padding_token_id", pad);
  set_id("tokenizer.ggml.unknown_token_id", unk);
  if (auto it = by_text.find("<|im_end|>"); it != by_text.end()) set_id("tokenizer.ggml.eot_token_id", it->second);
  w.set("tokenizer.ggml.add_bos_token", Value::boolean(tc.value("add_bos_token", false) == true));
  if (tc.contains("add_eos_token") && tc["add_eos_token"].is_boolean())
    w.set("tokenizer.ggml.add_eos_token", Value::boolean(tc["add_eos_token"].get<bool>()));

  // Chat template: transformers 5 writes chat_template.jinja; older files keep it in tokenizer_config.
  std::string tmpl;
  const fs::path jinja = fs::path(dir) / "chat_template.jinja";
  if (fs::exists(jinja)) {
    std::ifstream in(jinja, std::ios::binary);
    tmpl.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  } else if (tc.contains("chat_template")) {
    const json& ct = tc["chat_template"];
    if (ct.is_string()) {
      tmpl = ct.get<std::string>();
    } else if (ct.is_array()) {  // [{name, template}]: the default one
      for (const json& e : ct)
        if (e.is_object() && e.value("name", "") == "default" && e.contains("template") && e["template"].is_string())
          tmpl = e["template"].get<std::string>();
    }
  }
  if (!tmpl.empty()) w.set("tokenizer.chat_template", Value::string(tmpl));
  if (log)
    log(fmt::format("tokenizer: {} tokens ({} padding), {} merges, pre-tokenizer {}{}", n_vocab, n_pad,
                    model.contains("merges") ? model["merges"].size() : 0, pre, tmpl.empty() ? "" : ", chat template"));
  return true;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

int64_t tiled_source_head(int64_t g, int64_t n_k, int64_t n_v) {
  const int64_t ratio = n_v / n_k;
  return (g % n_k) * ratio + g / n_k;
}

int64_t prism_block_size(const std::vector<int64_t>& widths) {
  int64_t b = prism::kHadamardBlock;
  while (b > 1 && std::any_of(widths.begin(), widths.end(), [&](int64_t w) { return w % b != 0; })) b /= 2;
  return b;
}

std::vector<float> prism_sign_values(uint64_t seed, const std::vector<int64_t>& widths) {
  // mt19937_64 is specified bit for bit by the standard (distributions are not): the top bit of each
  // draw is the sign, so the same seed gives the same file everywhere.
  std::mt19937_64 gen(seed);
  std::vector<float> s;
  for (int64_t w : widths)
    for (int64_t i = 0; i < w; ++i) s.push_back((gen() >> 63) ? -1.0f : 1.0f);
  return s;
}

ConvertReport convert_hf_to_gguf(const std::string& dir, const std::string& out_path, const ConvertOptions& opts) {
  auto log = [&](const std::string& s) {
    if (opts.log) opts.log(s);
  };
  DFLASH_CHECK(fs::is_directory(dir), "{}: not a directory (expected a Hugging Face model folder)", dir);
  const HfConfig c = read_config(dir);
  const hf::Checkpoint ck = hf::Checkpoint::open(dir);
  const TypeTraits& tt = type_traits(opts.type);
  DFLASH_CHECK(tt.has_codec, "convert: type {} cannot be written (no quantizer)", tt.name);
  const int n_threads = opts.threads > 0 ? opts.threads : hardware_threads();

  // Checkpoint key prefix: Qwen3_5ForConditionalGeneration nests the text model.
  std::string pre;
  for (const char* p : {"model.language_model.", "model."})
    if (ck.find(std::string(p) + "embed_tokens.weight")) {
      pre = p;
      break;
    }
  DFLASH_CHECK(!pre.empty(), "{}: the checkpoint has neither 'model.embed_tokens.weight' nor "
               "'model.language_model.embed_tokens.weight'", dir);

  std::set<std::string> used;
  auto src = [&](const std::string& hf_name, const std::string& gguf_name,
                 const std::vector<int64_t>& shape) -> const hf::StTensor* {
    const hf::StTensor& t = ck.require(hf_name, gguf_name);
    DFLASH_CHECK(hf::dtype_is_float(t.dtype), "{}: tensor '{}' has dtype {}; convert reads F32, F16 and BF16",
                 ck.file_of(t), hf_name, t.dtype);
    DFLASH_CHECK(t.shape == shape, "{}: tensor '{}' has shape {}, expected {} (from config.json)", ck.file_of(t), hf_name,
                 t.shape_string(), shape_str(shape));
    used.insert(hf_name);
    return &t;
  };

  const hf::StTensor& emb = ck.require(pre + "embed_tokens.weight");
  DFLASH_CHECK(emb.shape.size() == 2 && emb.shape[1] == c.n_embd, "{}: '{}embed_tokens.weight' has shape {}, expected "
               "[vocab, {}]", ck.file_of(emb), pre, emb.shape_string(), c.n_embd);
  const int64_t n_vocab = emb.shape[0];

  // ---- prism: widths, block, signs
  std::map<int64_t, std::vector<float>> signs;
  std::vector<int64_t> widths;
  int64_t block = 0;
  bool any_attn = false, any_gdn = false;
  for (int64_t il = 0; il < c.n_layer; ++il) (c.is_attention(il) ? any_attn : any_gdn) = true;
  if (opts.prism) {
    widths = {c.n_embd, c.n_ff};
    if (any_attn) widths.push_back(c.q_width());
    if (any_gdn) widths.push_back(c.inner());
    std::sort(widths.begin(), widths.end());
    widths.erase(std::unique(widths.begin(), widths.end()), widths.end());
    block = prism_block_size(widths);
    if (block < prism::kHadamardBlock)
      log(fmt::format("note: prism block size {} (the input widths are not all multiples of {})", block,
                      prism::kHadamardBlock));
    const std::vector<float> all = prism_sign_values(opts.seed, widths);
    size_t k = 0;
    for (int64_t wd : widths) {
      signs[wd].assign(all.begin() + k, all.begin() + k + wd);
      k += wd;
    }
  }

  // ---- plans
  std::vector<Plan> plans;
  std::vector<std::string> rotated;
  auto matrix_type = [&](int64_t in) { return in % tt.block_elems == 0 ? opts.type : GgmlType::F32; };
  // A weight matrix: HF [out, in] -> GGUF ne [in, out].
  auto add_matrix = [&](const std::string& name, const std::string& hf_name, int64_t in, int64_t out, bool rotate,
                        std::vector<int32_t> row_map = {}, std::vector<int32_t> col_map = {}) -> Plan& {
    Plan p;
    p.name = name;
    p.type = matrix_type(in);
    if (p.type != opts.type) log(fmt::format("note: {} stays f32 (row length {} is not a multiple of {}'s block {})",
                                             name, in, tt.name, tt.block_elems));
    p.ne = {in, out};
    p.src = src(hf_name, name, {out, in});
    p.src_row_len = in;
    p.row_map = std::move(row_map);
    p.col_map = std::move(col_map);
    if (rotate && opts.prism) {
      p.signs = &signs.at(in);
      p.block = block;
      rotated.push_back(name);
    }
    plans.push_back(std::move(p));
    return plans.back();
  };
  auto add_vector = [&](const std::string& name, const std::string& hf_name, int64_t n, Op op,
                        std::vector<int32_t> col_map = {}) {
    Plan p;
    p.name = name;
    p.ne = {n};
    p.src = src(hf_name, name, {n});
    p.src_row_len = n;
    p.op = op;
    p.col_map = std::move(col_map);
    plans.push_back(std::move(p));
  };
  const Op norm_op = c.hybrid ? Op::kPlusOne : Op::kCopy;  // qwen35 RMSNorm weights are zero-centred

  {
    Plan p;
    p.name = "token_embd.weight";
    p.type = matrix_type(c.n_embd);
    p.ne = {c.n_embd, n_vocab};
    p.src = src(pre + "embed_tokens.weight", p.name, {n_vocab, c.n_embd});
    p.src_row_len = c.n_embd;
    if (opts.prism) {  // the inverse list: stored as H(s (.) e), read back as s (.) H(row)
      p.signs = &signs.at(c.n_embd);
      p.block = block;
    }
    plans.push_back(std::move(p));
  }
  add_vector("output_norm.weight", pre + "norm.weight", c.n_embd, norm_op);
  if (!c.tied) {
    add_matrix("output.weight", "lm_head.weight", c.n_embd, n_vocab, true);
  } else if (opts.prism) {
    // A tied lm_head would read token_embd, which prism lists as an inverse (embedding) tensor; a
    // tensor cannot be in both lists, so the rotated lm_head gets its own copy (as in Bonsai files).
    add_matrix("output.weight", pre + "embed_tokens.weight", c.n_embd, n_vocab, true);
    log("note: tied embeddings with --prism: output.weight is written as a rotated copy of the embedding");
  }

  // V-head tiling (SPEC 2.4): index maps over heads, channels and rows.
  std::vector<int32_t> v_rows_inner, v_heads_map, conv_rows;
  if (any_gdn) {
    const int64_t Hk = c.k_heads, Hv = c.v_heads, dv = c.head_v;
    for (int64_t g = 0; g < Hv; ++g) {
      const int64_t h = tiled_source_head(g, Hk, Hv);
      v_heads_map.push_back(static_cast<int32_t>(h));
      for (int64_t d = 0; d < dv; ++d) v_rows_inner.push_back(static_cast<int32_t>(h * dv + d));
    }
    for (int64_t i = 0; i < 2 * c.key_dim(); ++i) conv_rows.push_back(static_cast<int32_t>(i));
    for (int32_t v : v_rows_inner) conv_rows.push_back(static_cast<int32_t>(2 * c.key_dim() + v));
  }

  for (int64_t il = 0; il < c.n_layer; ++il) {
    const std::string b = "blk." + std::to_string(il) + ".";
    const std::string h = pre + "layers." + std::to_string(il) + ".";
    add_vector(b + "attn_norm.weight", h + "input_layernorm.weight", c.n_embd, norm_op);
    if (c.is_attention(il)) {
      const std::string a = h + "self_attn.";
      // qwen35's q_proj rows are already [q(hd) | gate(hd)] per head, the order attn_q keeps.
      add_matrix(b + "attn_q.weight", a + "q_proj.weight", c.n_embd, c.q_width() * (c.hybrid ? 2 : 1), true);
      add_matrix(b + "attn_k.weight", a + "k_proj.weight", c.n_embd, c.n_head_kv * c.head_dim, true);
      add_matrix(b + "attn_v.weight", a + "v_proj.weight", c.n_embd, c.n_head_kv * c.head_dim, true);
      add_matrix(b + "attn_output.weight", a + "o_proj.weight", c.q_width(), c.n_embd, true);
      add_vector(b + "attn_q_norm.weight", a + "q_norm.weight", c.head_dim, norm_op);
      add_vector(b + "attn_k_norm.weight", a + "k_norm.weight", c.head_dim, norm_op);
    } else {
      const std::string l = h + "linear_attn.";
      const int64_t C = c.conv_dim(), inner = c.inner(), Hv = c.v_heads;
      const GgmlType ab_type = tt.block_elems > 1 ? GgmlType::BF16 : opts.type;
      add_matrix(b + "attn_qkv.weight", l + "in_proj_qkv.weight", c.n_embd, C, true, conv_rows);
      add_matrix(b + "attn_gate.weight", l + "in_proj_z.weight", c.n_embd, inner, true, v_rows_inner);
      {
        // conv1d [C, 1, K] (depthwise) -> ne [K, C]
        const hf::StTensor& t = ck.require(l + "conv1d.weight", b + "ssm_conv1d.weight");
        std::vector<int64_t> want = {C, 1, c.conv_k};
        if (t.shape.size() == 2) want = {C, c.conv_k};
        Plan p;
        p.name = b + "ssm_conv1d.weight";
        p.ne = {c.conv_k, C};
        p.src = src(l + "conv1d.weight", p.name, want);
        p.src_row_len = c.conv_k;
        p.row_map = conv_rows;
        plans.push_back(std::move(p));
      }
      add_vector(b + "ssm_dt.bias", l + "dt_bias", Hv, Op::kCopy, v_heads_map);
      add_vector(b + "ssm_a", l + "A_log", Hv, Op::kNegExp, v_heads_map);
      add_matrix(b + "ssm_alpha.weight", l + "in_proj_a.weight", c.n_embd, Hv, false, v_heads_map).type = ab_type;
      add_matrix(b + "ssm_beta.weight", l + "in_proj_b.weight", c.n_embd, Hv, false, v_heads_map).type = ab_type;
      add_vector(b + "ssm_norm.weight", l + "norm.weight", c.head_v, Op::kCopy);  // plain w (gated norm)
      // ssm_out's input columns: tiled like every other V-head tensor, except with prism, where the
      // runtime permutes its (tiled) input back to grouped order before signs and H.
      add_matrix(b + "ssm_out.weight", l + "out_proj.weight", inner, c.n_embd, true, {},
                 opts.prism ? std::vector<int32_t>{} : v_rows_inner);
    }
    add_vector(b + (c.hybrid ? "post_attention_norm.weight" : "ffn_norm.weight"), h + "post_attention_layernorm.weight",
               c.n_embd, norm_op);
    add_matrix(b + "ffn_gate.weight", h + "mlp.gate_proj.weight", c.n_embd, c.n_ff, true);
    add_matrix(b + "ffn_up.weight", h + "mlp.up_proj.weight", c.n_embd, c.n_ff, true);
    add_matrix(b + "ffn_down.weight", h + "mlp.down_proj.weight", c.n_ff, c.n_embd, true);
  }

  // ---- metadata
  gguf::Writer w;
  const std::string arch = c.hybrid ? "qwen35" : "qwen3";
  const std::string p = arch + ".";
  w.set("general.architecture", Value::string(arch));
  w.set("general.name", Value::string(fs::path(dir).filename().empty() ? fs::path(dir).parent_path().filename().string()
                                                                       : fs::path(dir).filename().string()));
  w.set("general.type", Value::string("model"));
  w.set(p + "block_count", Value::u32(static_cast<uint32_t>(c.n_layer)));
  w.set(p + "context_length", Value::u32(static_cast<uint32_t>(c.n_ctx)));
  w.set(p + "embedding_length", Value::u32(static_cast<uint32_t>(c.n_embd)));
  w.set(p + "feed_forward_length", Value::u32(static_cast<uint32_t>(c.n_ff)));
  w.set(p + "attention.head_count", Value::u32(static_cast<uint32_t>(c.n_head)));
  w.set(p + "attention.head_count_kv", Value::u32(static_cast<uint32_t>(c.n_head_kv)));
  w.set(p + "attention.key_length", Value::u32(static_cast<uint32_t>(c.head_dim)));
  w.set(p + "attention.value_length", Value::u32(static_cast<uint32_t>(c.head_dim)));
  w.set(p + "attention.layer_norm_rms_epsilon", Value::f32(static_cast<float>(c.rms_eps)));
  w.set(p + "rope.freq_base", Value::f32(static_cast<float>(c.rope_theta)));
  w.set(p + "rope.dimension_count", Value::u32(static_cast<uint32_t>(c.n_rot)));
  if (c.hybrid) {
    std::vector<Value> sec;
    for (int32_t s : c.rope_sections) sec.push_back(Value::i32(s));
    w.set(p + "rope.dimension_sections", Value::array(ValueType::I32, std::move(sec)));
    w.set(p + "ssm.conv_kernel", Value::u32(static_cast<uint32_t>(c.conv_k)));
    w.set(p + "ssm.inner_size", Value::u32(static_cast<uint32_t>(c.inner())));
    w.set(p + "ssm.state_size", Value::u32(static_cast<uint32_t>(c.head_k)));
    w.set(p + "ssm.time_step_rank", Value::u32(static_cast<uint32_t>(c.v_heads)));
    w.set(p + "ssm.group_count", Value::u32(static_cast<uint32_t>(c.k_heads)));
    w.set(p + "full_attention_interval", Value::u32(static_cast<uint32_t>(c.interval)));
  }
  ConvertReport rep;
  rep.arch = arch;
  rep.tokenizer = add_tokenizer(w, dir, n_vocab, c, opts.log);
  if (opts.prism) {
    std::vector<Value> wv, sv, names;
    for (int64_t wd : widths) {
      wv.push_back(Value::u32(static_cast<uint32_t>(wd)));
      for (float s : signs.at(wd)) sv.push_back(Value::i8(s < 0 ? -1 : 1));
    }
    for (const std::string& n : rotated) names.push_back(Value::string(n));
    w.set("prism.hadamard.version", Value::u32(1));
    w.set("prism.hadamard.block_size", Value::u32(static_cast<uint32_t>(block)));
    w.set("prism.hadamard.transform", Value::string("normalized-sylvester-walsh-hadamard"));
    w.set("prism.hadamard.axis", Value::string("input-last-dimension"));
    w.set("prism.hadamard.sign_mode", Value::string("explicit"));
    w.set("prism.hadamard.sign_widths", Value::array(ValueType::U32, std::move(wv)));
    w.set("prism.hadamard.sign_values", Value::array(ValueType::I8, std::move(sv)));
    w.set("prism.hadamard.weight_names", Value::array(ValueType::STRING, std::move(names)));
    w.set("prism.hadamard.inverse_weight_names", Value::array(ValueType::STRING, {Value::string("token_embd.weight")}));
    w.set("prism.hadamard.gdn_v_grouped", Value::boolean(c.hybrid));
    rep.prism_block = block;
  }

  // ---- data, streamed
  const auto n_plans = static_cast<int64_t>(plans.size());
  auto counter = std::make_shared<int64_t>(0);
  for (const Plan& pl : plans) {
    const size_t rb = row_bytes(pl.type, pl.ne[0]);
    rep.data_bytes += rb * static_cast<uint64_t>(pl.n_rows());
    const Plan* pp = &pl;
    const hf::Checkpoint* ckp = &ck;
    w.add_tensor_rows(pl.name, pl.type, pl.ne, [pp, ckp, rb, n_threads, counter, n_plans, &opts](int64_t r0, int64_t n,
                                                                                                 uint8_t* dst) {
      const Plan& P = *pp;
      if (r0 == 0 && opts.log)
        opts.log(fmt::format("[{}/{}] {} {} {}", ++*counter, n_plans, P.name, type_name(P.type), shape_str(P.ne)));
      parallel_ranges(r0, r0 + n, n_threads, 4, [&](int64_t a, int64_t b) {
        std::vector<float> row, tmp;
        for (int64_t r = a; r < b; ++r) {
          make_row(*ckp, P, r, row, tmp);
          quantize_row(P.type, row.data(), dst + static_cast<size_t>(r - r0) * rb, P.ne[0]);
        }
      });
    });
  }
  rep.n_tensors = n_plans;
  for (const std::string& n : ck.names())
    if (!used.count(n)) rep.unused.push_back(n);
  if (!rep.unused.empty()) {
    std::string list;
    for (size_t i = 0; i < rep.unused.size() && i < 6; ++i) list += (i ? ", " : "") + rep.unused[i];
    log(fmt::format("note: {} checkpoint tensors are not part of the text model and were skipped ({}{})",
                    rep.unused.size(), list, rep.unused.size() > 6 ? ", ..." : ""));
  }
  w.write(out_path);
  return rep;
}

}  // namespace dflash
