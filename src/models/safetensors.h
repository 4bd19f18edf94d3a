// Hugging Face safetensors checkpoints: a validating reader for single files and sharded sets
// (model.safetensors.index.json), used by `dflash convert`.
//
// File layout: u64 N (little-endian) | N bytes of JSON header | data. The header maps each tensor name
// to {"dtype", "shape", "data_offsets": [begin, end]} with offsets relative to the data start, plus an
// optional "__metadata__" object of strings. The reader treats every file as hostile: the header length
// is bounded by the file and by kMaxHeaderBytes, the JSON must be one object (no duplicate names, no
// deep nesting), every dtype is known, every shape's byte size matches its offsets without overflow,
// and the tensors' byte ranges lie inside the data section without overlapping. Failures throw
// dflash::Error naming the file, the tensor and what was expected.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace dflash::hf {

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // the reference implementation's limit
constexpr int kMaxShapeDims = 8;

struct StTensor {
  std::string name;
  std::string dtype;            // as written in the header: "F32", "BF16", ...
  int64_t elem_size = 0;        // bytes per element of dtype
  std::vector<int64_t> shape;   // row-major, outermost first (PyTorch order)
  uint64_t begin = 0, end = 0;  // byte range inside the data section
  int64_t n_elements() const;
  std::string shape_string() const;  // "[248320, 5120]"
};

// Bytes per element of a safetensors dtype name; 0 when the name is unknown.
int64_t dtype_size(std::string_view dtype);
// True for the dtypes `dflash convert` reads (F32, F16, BF16).
bool dtype_is_float(std::string_view dtype);

class SafetensorsFile {
 public:
  // Memory-maps and validates `path`.
  static SafetensorsFile open(const std::string& path);
  // Validates an in-memory image (tests). `name` appears in error messages.
  static SafetensorsFile from_bytes(std::vector<uint8_t> bytes, std::string name = "<memory>");

  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::string& path() const;
  const std::vector<StTensor>& tensors() const;  // in header order
  const StTensor* find(std::string_view name) const;
  const std::map<std::string, std::string>& metadata() const;
  // The tensor's bytes (inside the mapping; valid while the file lives).
  std::span<const uint8_t> data(const StTensor& t) const;

 private:
  SafetensorsFile();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Reads a JSON file that must hold one object (config.json, tokenizer.json, ...), refusing files over
// max_bytes, nesting deeper than max_depth and duplicate top-level keys. Errors name the file.
nlohmann::json read_json_file(const std::string& path, uint64_t max_bytes, int max_depth);

// A checkpoint directory: model.safetensors, or the shards listed by model.safetensors.index.json.
class Checkpoint {
 public:
  static Checkpoint open(const std::string& dir);

  Checkpoint(Checkpoint&&) noexcept;
  Checkpoint& operator=(Checkpoint&&) noexcept;
  ~Checkpoint();

  const std::string& dir() const;
  const StTensor* find(std::string_view name) const;  // nullptr when absent
  // Throws naming the tensor (and `what_for`, e.g. "blk.3.attn_q.weight") when absent.
  const StTensor& require(std::string_view name, std::string_view what_for = {}) const;
  std::vector<std::string> names() const;  // sorted
  // The file holding a tensor (for error messages).
  const std::string& file_of(const StTensor& t) const;

  // Reads elements [elem0, elem0 + n) of a float tensor (F32/F16/BF16), flattened row-major, as f32.
  // Throws for other dtypes, naming the tensor.
  void read(const StTensor& t, int64_t elem0, int64_t n, float* out) const;

 private:
  Checkpoint();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dflash::hf
