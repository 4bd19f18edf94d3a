// The prism rotation metadata of a Bonsai 2 GGUF (SPEC 3): which tensors were stored rotated, the
// explicit sign vectors per input width, and ssm_out's V-head permutation.
//
// A rotated matmul computes y = W_stored . H_blk(s_w (.) P x) (forward hadamard, s_w = the signs of
// the input width w); an inverse-listed embedding row gives e = s (.) H_blk(row). See hadamard.h.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

namespace dflash::gguf {
class File;
}

namespace dflash::prism {

// Metadata keys (prefix "prism.hadamard.").
inline constexpr std::string_view kKeyPrefix = "prism.hadamard.";
inline constexpr std::string_view kTransform = "normalized-sylvester-walsh-hadamard";
inline constexpr std::string_view kAxis = "input-last-dimension";
inline constexpr std::string_view kSignMode = "explicit";

struct PrismRotation {
  int64_t version = 1;
  int64_t block_size = 1024;                  // Hadamard block (1024 in Bonsai files)
  std::vector<int64_t> sign_widths;           // e.g. [5120, 6144, 17408]
  std::vector<std::vector<float>> signs;      // signs[i]: sign_widths[i] values, each +1 or -1
  std::vector<std::string> weight_names;      // tensors stored as W . diag(s) . H (forward at run time)
  std::vector<std::string> inverse_weight_names;  // embeddings stored rotated (inverse at run time)
  bool gdn_v_grouped = false;                 // ssm_out's input is permuted tiled -> grouped before s, H

  // Reads and validates the prism.hadamard.* keys. Returns nullopt when the file has no
  // prism.hadamard.version (a plain model). Throws dflash::Error naming the key on anything else
  // unexpected. Required: version (1), block_size (a power of two: 1024 in Bonsai files, smaller in
  // tiny test models), transform, axis, sign_mode (the values
  // above), sign_widths (positive multiples of block_size, distinct), sign_values (sum of widths
  // values, each exactly +1 or -1, float or integer array), weight_names. Optional:
  // inverse_weight_names (default empty), gdn_v_grouped (default false).
  static std::optional<PrismRotation> from_gguf(const gguf::File& file);

  // The sign vector for an input width; throws dflash::Error when the file has none for it.
  const std::vector<float>& signs_for_width(int64_t width) const;
  bool has_width(int64_t width) const;
  bool is_rotated(std::string_view tensor_name) const;  // in weight_names
  bool is_inverse(std::string_view tensor_name) const;  // in inverse_weight_names

  // Rebuilds the name lookups (call after editing the vectors by hand, e.g. in a converter).
  void index_names();

 private:
  std::unordered_set<std::string> rotated_, inverse_;
};

// ssm_out's input permutation, usable as `perm` in Backend::hadamard (x'[i] = x[perm[i]]).
// The runtime keeps V heads TILED (gguf head r * n_k + k for K head k, repeat r); HF groups them
// (head k * R + r, R = n_v / n_k). For output index i = (k * R + r) * head_v + j in grouped order,
// perm[i] = (r * n_k + k) * head_v + j. Throws when n_v is not a multiple of n_k.
std::vector<int32_t> ssm_out_permutation(int64_t n_k_heads, int64_t n_v_heads, int64_t head_v);

}  // namespace dflash::prism
