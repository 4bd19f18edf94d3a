#include "models/drafter_metadata.h"

#include <utility>

#include "gguf/gguf.h"

namespace dflash {

void write_drafter_metadata(gguf::Writer& w, const DrafterMetadata& m) {
  using gguf::Value;
  using gguf::ValueType;
  auto u32 = [](int64_t v) { return Value::u32(static_cast<uint32_t>(v)); };
  const std::string p = "dflash.";
  w.set("general.architecture", Value::string("dflash"));
  w.set("general.name", Value::string(m.name));
  w.set("general.type", Value::string("model"));
  w.set(p + "block_count", u32(m.n_layer));
  w.set(p + "context_length", u32(m.n_ctx));
  w.set(p + "embedding_length", u32(m.n_embd));
  w.set(p + "feed_forward_length", u32(m.n_ff));
  w.set(p + "attention.head_count", u32(m.n_head));
  w.set(p + "attention.head_count_kv", u32(m.n_head_kv));
  w.set(p + "attention.key_length", u32(m.head_dim));
  w.set(p + "attention.value_length", u32(m.head_dim));
  w.set(p + "attention.layer_norm_rms_epsilon", Value::f32(static_cast<float>(m.rms_eps)));
  w.set(p + "rope.freq_base", Value::f32(static_cast<float>(m.rope_theta)));
  w.set(p + "block_size", u32(m.block_size));
  std::vector<Value> taps;
  for (int64_t t : m.target_layers) taps.push_back(Value::i32(static_cast<int32_t>(t)));
  w.set(p + "target_layers", Value::array(ValueType::I32, std::move(taps)));
  if (m.dflash2) {
    w.set(p + "conv_kernel_size", u32(m.conv_kernel));
    w.set(p + "conv_group_size", u32(m.conv_group));
    w.set(p + "selector_rank", u32(m.selector_rank));
    w.set(p + "selector_top_k", u32(m.selector_top_k));
  }
  if (m.sliding_window > 0) w.set(p + "attention.sliding_window", u32(m.sliding_window));
  w.set(p + "attention.causal", Value::boolean(m.causal));
  if (m.n_vocab > 0) w.set(p + "vocab_size", u32(m.n_vocab));
  w.set("tokenizer.ggml.mask_token_id", u32(m.mask_token));
}

}  // namespace dflash
