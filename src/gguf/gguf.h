// GGUF container: a validating, memory-mapped reader and a writer (SPEC 1).
//
// The reader checks everything SPEC 1 lists before it hands out a pointer: a file that passes
// File::open can be indexed by any tensor info without further bounds checks. Every failure throws
// dflash::Error naming the file, the byte offset or the key/tensor, and what was expected.
#pragma once

#include <cstdint>
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

enum class ValueType : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, BOOL = 7,
  STRING = 8, ARRAY = 9, U64 = 10, I64 = 11, F64 = 12,
};
const char* value_type_name(ValueType t);

// A metadata value. Arrays hold a homogeneous element type (possibly ARRAY: nested arrays).
struct Value;
struct Array {
  ValueType elem_type = ValueType::U8;
  std::vector<Value> items;
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
};

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
class Writer {
 public:
  explicit Writer(uint32_t version = 3, uint32_t alignment = kDefaultAlignment);
  // Sets (or replaces) a metadata key; insertion order is kept.
  void set(std::string key, Value value);
  // Adds a tensor; `data` must be exactly row_bytes(type, ne[0]) * rows bytes (checked).
  void add_tensor(std::string name, GgmlType type, std::vector<int64_t> ne, std::span<const uint8_t> data);
  std::vector<uint8_t> to_bytes() const;
  void write(const std::string& path) const;  // throws dflash::Error on I/O failure

 private:
  struct PendingTensor {
    std::string name;
    GgmlType type;
    std::vector<int64_t> ne;
    std::vector<uint8_t> data;
  };
  uint32_t version_;
  uint32_t alignment_;
  std::vector<KeyValue> kvs_;
  std::vector<PendingTensor> tensors_;
};

}  // namespace dflash::gguf
