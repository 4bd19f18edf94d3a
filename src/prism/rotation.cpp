#include "prism/rotation.h"

#include <algorithm>
#include <numeric>

#include "gguf/gguf.h"
#include "util/error.h"

namespace dflash::prism {
namespace {

std::string key(std::string_view name) { return std::string(kKeyPrefix) + std::string(name); }

void expect_string(const gguf::File& f, std::string_view name, std::string_view want) {
  const std::string k = key(name);
  const std::string got = f.get_string(k);
  DFLASH_CHECK(got == want, "{}: metadata key '{}' is \"{}\", expected \"{}\"", f.path(), k, got, want);
}

}  // namespace

std::optional<PrismRotation> PrismRotation::from_gguf(const gguf::File& f) {
  if (!f.has(key("version"))) return std::nullopt;
  PrismRotation r;
  r.version = f.get_int(key("version"));
  DFLASH_CHECK(r.version == 1, "{}: metadata key '{}' is {}, only version 1 is supported", f.path(), key("version"),
               r.version);
  r.block_size = f.get_int(key("block_size"));
  // Bonsai files use 1024; tiny test models use a smaller power of two dividing their widths.
  DFLASH_CHECK(r.block_size >= 2 && r.block_size <= 65536 && (r.block_size & (r.block_size - 1)) == 0,
               "{}: metadata key '{}' is {}, expected a power of two (1024 in Bonsai files)", f.path(),
               key("block_size"), r.block_size);
  expect_string(f, "transform", kTransform);
  expect_string(f, "axis", kAxis);
  expect_string(f, "sign_mode", kSignMode);

  r.sign_widths = f.get_int_array(key("sign_widths"));
  DFLASH_CHECK(!r.sign_widths.empty(), "{}: metadata key '{}' is empty", f.path(), key("sign_widths"));
  int64_t total = 0;
  for (size_t i = 0; i < r.sign_widths.size(); ++i) {
    const int64_t w = r.sign_widths[i];
    DFLASH_CHECK(w > 0 && w % r.block_size == 0,
                 "{}: metadata key '{}' [{}] = {} is not a positive multiple of the block size {}", f.path(),
                 key("sign_widths"), i, w, r.block_size);
    DFLASH_CHECK(std::count(r.sign_widths.begin(), r.sign_widths.end(), w) == 1,
                 "{}: metadata key '{}' lists width {} twice", f.path(), key("sign_widths"), w);
    total += w;
  }
  const std::vector<double> values = f.get_float_array(key("sign_values"));
  DFLASH_CHECK(static_cast<int64_t>(values.size()) == total,
               "{}: metadata key '{}' has {} values, expected {} (the sum of sign_widths)", f.path(),
               key("sign_values"), values.size(), total);
  size_t at = 0;
  for (int64_t w : r.sign_widths) {
    std::vector<float> s(static_cast<size_t>(w));
    for (int64_t i = 0; i < w; ++i, ++at) {
      const double v = values[at];
      DFLASH_CHECK(v == 1.0 || v == -1.0, "{}: metadata key '{}' [{}] = {} is not +1 or -1", f.path(),
                   key("sign_values"), at, v);
      s[static_cast<size_t>(i)] = static_cast<float>(v);
    }
    r.signs.push_back(std::move(s));
  }

  r.weight_names = f.get_string_array(key("weight_names"));
  if (f.has(key("inverse_weight_names"))) r.inverse_weight_names = f.get_string_array(key("inverse_weight_names"));
  r.gdn_v_grouped = f.get_bool_or(key("gdn_v_grouped"), false);
  r.index_names();
  for (const auto& name : r.inverse_weight_names)
    DFLASH_CHECK(!r.is_rotated(name), "{}: tensor '{}' is in both '{}' and '{}'", f.path(), name, key("weight_names"),
                 key("inverse_weight_names"));
  return r;
}

void PrismRotation::index_names() {
  rotated_ = {weight_names.begin(), weight_names.end()};
  inverse_ = {inverse_weight_names.begin(), inverse_weight_names.end()};
}

bool PrismRotation::has_width(int64_t width) const {
  return std::find(sign_widths.begin(), sign_widths.end(), width) != sign_widths.end();
}

const std::vector<float>& PrismRotation::signs_for_width(int64_t width) const {
  const auto it = std::find(sign_widths.begin(), sign_widths.end(), width);
  DFLASH_CHECK(it != sign_widths.end() && static_cast<size_t>(it - sign_widths.begin()) < signs.size(),
               "prism rotation: no sign vector for input width {} (prism.hadamard.sign_widths = [{}])", width,
               fmt::join(sign_widths, ", "));
  return signs[static_cast<size_t>(it - sign_widths.begin())];
}

bool PrismRotation::is_rotated(std::string_view name) const { return rotated_.contains(std::string(name)); }
bool PrismRotation::is_inverse(std::string_view name) const { return inverse_.contains(std::string(name)); }

std::vector<int32_t> ssm_out_permutation(int64_t n_k_heads, int64_t n_v_heads, int64_t head_v) {
  DFLASH_CHECK(n_k_heads > 0 && head_v > 0 && n_v_heads > 0 && n_v_heads % n_k_heads == 0,
               "ssm_out permutation: {} V heads are not a multiple of {} K heads (head_v {})", n_v_heads, n_k_heads,
               head_v);
  const int64_t R = n_v_heads / n_k_heads;
  std::vector<int32_t> perm(static_cast<size_t>(n_v_heads * head_v));
  for (int64_t k = 0; k < n_k_heads; ++k)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < head_v; ++j)
        perm[static_cast<size_t>((k * R + r) * head_v + j)] = static_cast<int32_t>((r * n_k_heads + k) * head_v + j);
  return perm;
}

}  // namespace dflash::prism
