// GGUF container: a validating, memory-mapped reader and a writer (SPEC 1).
//
// The reader checks everything SPEC 1 lists before it hands out a pointer: a file that passes
// File::open can be indexed by any tensor info without further bounds checks. Every failure throws
// dflash::Error naming the file, the byte offset or the key/tensor, and what was expected.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "quant/types.h"

namespace dflash::gguf {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" little-endian
constexpr uint32_t kDefaultAlignment = 32;
constexpr uint32_t kMaxAlignment = 1u << 20;  // general.alignment must be a power of two <= 1 MiB
constexpr int kMaxArrayDepth = 8;             // nested arrays deeper than this are rejected
constexpr int kMaxDims = 4;
// Bound on the total number of array items in one file (besides "each item takes >= 1 byte of the
// file"): a Value costs ~56 bytes of memory, so this caps what a hostile file can make us allocate.
constexpr uint64_t kMaxArrayItems = 1ull << 26;

enum class ValueType : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, BOOL = 7,
  STRING = 8, ARRAY = 9, U64 = 10, I64 = 11, F64 = 12,
};
const char* value_type_name(ValueType t);  // "u8", ..., "string", "array"; "unknown" otherwise

// A metadata value. Arrays hold a homogeneous element type (possibly ARRAY: nested arrays).
struct Value;
struct Array {
  ValueType elem_type = ValueType::U8;
  std::vector<Value> items;
  bool operator==(const Array& o) const;  // same element type and items
};
struct Value {
  ValueType type = ValueType::U8;
  std::variant<uint64_t, int64_t, double, bool, std::string, Array> data;
  // Constructors for writers/tests.
  static Value u8(uint8_t v); static Value i8(int8_t v); static Value u16(uint16_t v);
  static Value i16(int16_t v); static Value u32(uint32_t v); static Value i32(int32_t v);
  static Value u64(uint64_t v); static Value i64(int64_t v); static Value f32(float v);
  static Value f64(double v); static Value boolean(bool v); static Value string(std::string v);
  static Value array(ValueType elem_type, std::vector<Value> items);
  // Convenience array builders.
  static Value string_array(const std::vector<std::string>& items);
  static Value i32_array(const std::vector<int32_t>& items);
  static Value f32_array(const std::vector<float>& items);

  bool is_integer() const;  // U8..I64 (not BOOL)
  bool is_float() const { return type == ValueType::F32 || type == ValueType::F64; }
  // "array<string>[3]", "u32", ...: the type as error messages and `dflash info` name it.
  std::string type_string() const;
  bool operator==(const Value& o) const;  // same type and data (floats compare with ==)
};

// Human-readable rendering for `dflash info`: scalars as is, strings quoted (truncated to
// max_string bytes, control characters escaped), arrays as `[a, b, c, ... (N items)]` with at most
// max_items items shown.
std::string format_value(const Value& v, size_t max_items = 8, size_t max_string = 64);

struct KeyValue {
  std::string key;
  Value value;
};

struct TensorInfo {
  std::string name;
  uint32_t n_dims = 0;
  int64_t ne[4] = {1, 1, 1, 1};  // ggml order: ne[0] is the row length
  GgmlType type = GgmlType::F32;
  uint64_t offset = 0;           // relative to the data section start
  uint64_t nbytes = 0;
  uint64_t info_offset = 0;      // where the tensor info starts in the file (for error messages)
  int64_t n_elements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
  int64_t n_rows() const { return ne[1] * ne[2] * ne[3]; }
  std::string shape_string() const;  // "[5120, 248320]"
};

class File {
 public:
  // Memory-maps and validates `path`. Throws dflash::Error on any problem.
  static File open(const std::string& path);
  // Validates an in-memory image (tests, the fuzzer). `name` is used in error messages.
  static File from_bytes(std::vector<uint8_t> bytes, std::string name = "<memory>");

  File(File&&) noexcept;
  File& operator=(File&&) noexcept;
  ~File();

  const std::string& path() const;
  uint32_t version() const;
  uint32_t alignment() const;
  uint64_t data_offset() const;   // file offset of the data section
  uint64_t file_size() const;

  // ---- metadata ----
  const std::vector<KeyValue>& metadata() const;
  const Value* find(std::string_view key) const;          // nullptr when absent
  bool has(std::string_view key) const { return find(key) != nullptr; }
  // Typed getters: throw dflash::Error naming the key when it is absent or of an incompatible type.
  // get_int accepts any integer type (and bool) and range-checks into int64; get_float accepts
  // F32/F64 and integers.
  std::string get_string(std::string_view key) const;
  int64_t get_int(std::string_view key) const;
  uint64_t get_uint(std::string_view key) const;
  double get_float(std::string_view key) const;
  bool get_bool(std::string_view key) const;
  std::vector<std::string> get_string_array(std::string_view key) const;
  std::vector<int64_t> get_int_array(std::string_view key) const;
  std::vector<double> get_float_array(std::string_view key) const;
  // Variants with a default for optional keys (still throw on a present key of the wrong type).
  std::string get_string_or(std::string_view key, std::string def) const;
  int64_t get_int_or(std::string_view key, int64_t def) const;
  double get_float_or(std::string_view key, double def) const;
  bool get_bool_or(std::string_view key, bool def) const;

  // ---- tensors ----
  const std::vector<TensorInfo>& tensors() const;
  const TensorInfo* find_tensor(std::string_view name) const;  // nullptr when absent
  const TensorInfo& tensor(std::string_view name) const;       // throws naming the tensor
  // Raw bytes of a tensor (inside the mapping; valid while the File lives).
  std::span<const uint8_t> tensor_data(const TensorInfo& t) const;

 private:
  File();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Builds a GGUF file in memory and writes it out. Round-trips everything File reads.
//
// Tensor data can be given up front (add_tensor, copied) or produced while writing (add_tensor_lazy,
// add_tensor_rows), so a multi-GB file streams to disk without all its data in memory at once.
// A non-default alignment is recorded as general.alignment (u32); setting general.alignment to a
// valid u32 changes the layout alignment. Other values are stored as given (tests build broken files).
class Writer {
 public:
  explicit Writer(uint32_t version = 3, uint32_t alignment = kDefaultAlignment);
  // Sets (or replaces) a metadata key; insertion order is kept.
  void set(std::string key, Value value);
  // Adds a tensor; `data` must be exactly row_bytes(type, ne[0]) * rows bytes (checked).
  void add_tensor(std::string name, GgmlType type, std::vector<int64_t> ne, std::span<const uint8_t> data);
  // Adds a tensor whose bytes are produced at write time: `fill(dst, nbytes)` writes the whole tensor
  // (nbytes = its byte size) into a temporary buffer that is freed after the tensor is written.
  void add_tensor_lazy(std::string name, GgmlType type, std::vector<int64_t> ne,
                       std::function<void(uint8_t* dst, size_t nbytes)> fill);
  // Like add_tensor_lazy, in chunks of whole rows: `fill(row0, n_rows, dst)` writes rows
  // [row0, row0 + n_rows) (n_rows * row_bytes bytes). Chunks hold about chunk_bytes (at least one row)
  // and come in order. Rows are ne[1]*ne[2]*ne[3] rows of ne[0] elements.
  using RowFill = std::function<void(int64_t row0, int64_t n_rows, uint8_t* dst)>;
  void add_tensor_rows(std::string name, GgmlType type, std::vector<int64_t> ne, RowFill fill,
                       size_t chunk_bytes = size_t{64} << 20);

  size_t n_tensors() const { return tensors_.size(); }
  uint32_t alignment() const { return alignment_; }
  std::vector<uint8_t> to_bytes() const;
  // Writes to `path` (through `path`.tmp, renamed on success). Throws dflash::Error on I/O failure.
  void write(const std::string& path) const;

 private:
  struct PendingTensor {
    std::string name;
    GgmlType type;
    std::vector<int64_t> ne;
    std::vector<uint8_t> data;   // when fill is empty
    RowFill fill;                // lazy data
    size_t chunk_bytes = 0;
    uint64_t nbytes = 0;
    uint64_t row_bytes = 0;
    int64_t n_rows = 0;
  };
  PendingTensor& check_new_tensor(std::string name, GgmlType type, std::vector<int64_t> ne);
  void emit(const std::function<void(const void*, size_t)>& out) const;
  uint32_t version_;
  uint32_t alignment_;
  std::vector<KeyValue> kvs_;
  std::vector<PendingTensor> tensors_;
};

}  // namespace dflash::gguf
