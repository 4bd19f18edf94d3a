// GGUF writer: header, metadata, tensor infos, then each tensor's data at the next multiple of the
// alignment. Tensor data is either owned (add_tensor) or produced chunk by chunk while writing
// (add_tensor_lazy / add_tensor_rows), so a multi-GB file never has to sit in memory.
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

#include "gguf/gguf.h"
#include "util/error.h"

namespace dflash::gguf {

namespace {

using Out = std::function<void(const void*, size_t)>;

template <typename T>
void put(const Out& out, T v) {
  out(&v, sizeof(T));
}

void put_string(const Out& out, std::string_view s) {
  put<uint64_t>(out, s.size());
  if (!s.empty()) out(s.data(), s.size());
}

[[noreturn]] void bad_value(std::string_view key, const Value& v) {
  fail("gguf writer: key '{}': value of type {} holds data of another type", key, value_type_name(v.type));
}

uint64_t get_u(std::string_view key, const Value& v) {
  const auto* u = std::get_if<uint64_t>(&v.data);
  if (!u) bad_value(key, v);
  return *u;
}
int64_t get_i(std::string_view key, const Value& v) {
  const auto* i = std::get_if<int64_t>(&v.data);
  if (!i) bad_value(key, v);
  return *i;
}
double get_d(std::string_view key, const Value& v) {
  const auto* d = std::get_if<double>(&v.data);
  if (!d) bad_value(key, v);
  return *d;
}

void put_value(const Out& out, std::string_view key, const Value& v, int depth) {
  switch (v.type) {
    case ValueType::U8: put<uint8_t>(out, static_cast<uint8_t>(get_u(key, v))); return;
    case ValueType::I8: put<int8_t>(out, static_cast<int8_t>(get_i(key, v))); return;
    case ValueType::U16: put<uint16_t>(out, static_cast<uint16_t>(get_u(key, v))); return;
    case ValueType::I16: put<int16_t>(out, static_cast<int16_t>(get_i(key, v))); return;
    case ValueType::U32: put<uint32_t>(out, static_cast<uint32_t>(get_u(key, v))); return;
    case ValueType::I32: put<int32_t>(out, static_cast<int32_t>(get_i(key, v))); return;
    case ValueType::U64: put<uint64_t>(out, get_u(key, v)); return;
    case ValueType::I64: put<int64_t>(out, get_i(key, v)); return;
    case ValueType::F32: put<float>(out, static_cast<float>(get_d(key, v))); return;
    case ValueType::F64: put<double>(out, get_d(key, v)); return;
    case ValueType::BOOL: {
      const auto* b = std::get_if<bool>(&v.data);
      if (!b) bad_value(key, v);
      put<uint8_t>(out, *b ? 1 : 0);
      return;
    }
    case ValueType::STRING: {
      const auto* s = std::get_if<std::string>(&v.data);
      if (!s) bad_value(key, v);
      put_string(out, *s);
      return;
    }
    case ValueType::ARRAY: {
      const auto* a = std::get_if<Array>(&v.data);
      if (!a) bad_value(key, v);
      DFLASH_CHECK(depth < kMaxArrayDepth, "gguf writer: key '{}': arrays nested deeper than {}", key, kMaxArrayDepth);
      put<uint32_t>(out, static_cast<uint32_t>(a->elem_type));
      put<uint64_t>(out, a->items.size());
      for (const Value& it : a->items) {
        DFLASH_CHECK(it.type == a->elem_type, "gguf writer: key '{}': array of {} holds a {} item", key,
                     value_type_name(a->elem_type), value_type_name(it.type));
        put_value(out, key, it, depth + 1);
      }
      return;
    }
  }
  fail("gguf writer: key '{}': unknown value type {}", key, static_cast<uint32_t>(v.type));
}

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

void put_zeros(const Out& out, uint64_t n) {
  static const uint8_t zeros[256] = {};
  while (n > 0) {
    size_t k = static_cast<size_t>(std::min<uint64_t>(n, sizeof zeros));
    out(zeros, k);
    n -= k;
  }
}

}  // namespace

Writer::Writer(uint32_t version, uint32_t alignment) : version_(version), alignment_(alignment) {
  DFLASH_CHECK(version == 2 || version == 3, "gguf writer: version must be 2 or 3, got {}", version);
  DFLASH_CHECK(alignment >= 1 && alignment <= kMaxAlignment && std::has_single_bit(alignment),
               "gguf writer: alignment must be a power of two in 1..{}, got {}", kMaxAlignment, alignment);
  if (alignment != kDefaultAlignment) set("general.alignment", Value::u32(alignment));
}

void Writer::set(std::string key, Value value) {
  if (key == "general.alignment" && value.type == ValueType::U32) {
    if (const auto* u = std::get_if<uint64_t>(&value.data);
        u && *u >= 1 && *u <= kMaxAlignment && std::has_single_bit(*u))
      alignment_ = static_cast<uint32_t>(*u);
  }
  for (auto& kv : kvs_) {
    if (kv.key == key) {
      kv.value = std::move(value);
      return;
    }
  }
  kvs_.push_back(KeyValue{std::move(key), std::move(value)});
}

Writer::PendingTensor& Writer::check_new_tensor(std::string name, GgmlType type, std::vector<int64_t> ne) {
  for (const auto& t : tensors_)
    DFLASH_CHECK(t.name != name, "gguf writer: duplicate tensor name '{}'", name);
  DFLASH_CHECK(!ne.empty() && ne.size() <= static_cast<size_t>(kMaxDims),
               "gguf writer: tensor '{}': expected 1..{} dimensions, got {}", name, kMaxDims, ne.size());
  const TypeTraits* tr = type_traits(static_cast<uint32_t>(type));
  DFLASH_CHECK(tr != nullptr, "gguf writer: tensor '{}': unknown type id {}", name, static_cast<uint32_t>(type));
  int64_t rows = 1;
  for (size_t d = 0; d < ne.size(); ++d) {
    DFLASH_CHECK(ne[d] >= 0, "gguf writer: tensor '{}': negative dimension ne[{}] = {}", name, d, ne[d]);
    if (d > 0) DFLASH_CHECK(!__builtin_mul_overflow(rows, ne[d], &rows), "gguf writer: tensor '{}': too many rows", name);
  }
  DFLASH_CHECK(ne[0] % tr->block_elems == 0,
               "gguf writer: tensor '{}': row length {} is not a multiple of the {} block size {}", name, ne[0],
               tr->name, tr->block_elems);
  PendingTensor t;
  t.row_bytes = static_cast<uint64_t>(ne[0] / tr->block_elems) * static_cast<uint64_t>(tr->block_bytes);
  DFLASH_CHECK(!__builtin_mul_overflow(t.row_bytes, static_cast<uint64_t>(rows), &t.nbytes),
               "gguf writer: tensor '{}': byte size overflows", name);
  t.n_rows = rows;
  t.name = std::move(name);
  t.type = type;
  t.ne = std::move(ne);
  tensors_.push_back(std::move(t));
  return tensors_.back();
}

void Writer::add_tensor(std::string name, GgmlType type, std::vector<int64_t> ne, std::span<const uint8_t> data) {
  PendingTensor& t = check_new_tensor(std::move(name), type, std::move(ne));
  if (data.size() != t.nbytes) {
    std::string n = t.name;
    uint64_t want = t.nbytes;
    tensors_.pop_back();
    fail("gguf writer: tensor '{}': expected {} bytes of data, got {}", n, want, data.size());
  }
  t.data.assign(data.begin(), data.end());
}

void Writer::add_tensor_lazy(std::string name, GgmlType type, std::vector<int64_t> ne,
                             std::function<void(uint8_t* dst, size_t nbytes)> fill) {
  PendingTensor& t = check_new_tensor(std::move(name), type, std::move(ne));
  const uint64_t nbytes = t.nbytes;
  t.chunk_bytes = static_cast<size_t>(std::max<uint64_t>(nbytes, 1));  // one chunk: the whole tensor
  t.fill = [fill = std::move(fill), nbytes](int64_t, int64_t, uint8_t* dst) { fill(dst, static_cast<size_t>(nbytes)); };
}

void Writer::add_tensor_rows(std::string name, GgmlType type, std::vector<int64_t> ne, RowFill fill,
                             size_t chunk_bytes) {
  DFLASH_CHECK(fill != nullptr, "gguf writer: add_tensor_rows needs a fill function");
  PendingTensor& t = check_new_tensor(std::move(name), type, std::move(ne));
  t.fill = std::move(fill);
  t.chunk_bytes = std::max<size_t>(chunk_bytes, 1);
}

void Writer::emit(const Out& out) const {
  uint64_t pos = 0;
  Out counted = [&](const void* p, size_t n) {
    out(p, n);
    pos += n;
  };
  put<uint32_t>(counted, kMagic);
  put<uint32_t>(counted, version_);
  put<uint64_t>(counted, tensors_.size());
  put<uint64_t>(counted, kvs_.size());
  for (const auto& kv : kvs_) {
    put_string(counted, kv.key);
    put<uint32_t>(counted, static_cast<uint32_t>(kv.value.type));
    put_value(counted, kv.key, kv.value, 0);
  }
  uint64_t offset = 0;
  for (const auto& t : tensors_) {
    put_string(counted, t.name);
    put<uint32_t>(counted, static_cast<uint32_t>(t.ne.size()));
    for (int64_t n : t.ne) put<uint64_t>(counted, static_cast<uint64_t>(n));
    put<uint32_t>(counted, static_cast<uint32_t>(t.type));
    put<uint64_t>(counted, offset);
    offset = align_up(offset + t.nbytes, alignment_);
  }
  put_zeros(counted, align_up(pos, alignment_) - pos);
  const uint64_t data_start = pos;
  std::vector<uint8_t> buf;
  for (const auto& t : tensors_) {
    put_zeros(counted, align_up(pos - data_start, alignment_) - (pos - data_start));
    if (!t.fill) {
      if (!t.data.empty()) counted(t.data.data(), t.data.size());
      continue;
    }
    if (t.nbytes == 0) continue;
    const int64_t rows_per_chunk = std::max<int64_t>(1, static_cast<int64_t>(t.chunk_bytes / std::max<uint64_t>(t.row_bytes, 1)));
    for (int64_t r0 = 0; r0 < t.n_rows; r0 += rows_per_chunk) {
      const int64_t n = std::min(rows_per_chunk, t.n_rows - r0);
      const size_t bytes = static_cast<size_t>(n) * static_cast<size_t>(t.row_bytes);
      buf.assign(bytes, 0);
      t.fill(r0, n, buf.data());
      counted(buf.data(), bytes);
    }
    std::vector<uint8_t>().swap(buf);  // free a big tensor's buffer before the next one
  }
}

std::vector<uint8_t> Writer::to_bytes() const {
  std::vector<uint8_t> bytes;
  emit([&](const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    bytes.insert(bytes.end(), b, b + n);
  });
  return bytes;
}

void Writer::write(const std::string& path) const {
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) fail("{}: cannot create: {}", tmp, std::strerror(errno));
  std::unique_ptr<char[]> iobuf(new char[1 << 20]);
  std::setvbuf(f, iobuf.get(), _IOFBF, 1 << 20);
  try {
    emit([&](const void* p, size_t n) {
      if (std::fwrite(p, 1, n, f) != n) fail("{}: write failed: {}", tmp, std::strerror(errno));
    });
  } catch (...) {
    std::fclose(f);
    std::remove(tmp.c_str());
    throw;
  }
  if (std::fclose(f) != 0) {
    int e = errno;
    std::remove(tmp.c_str());
    fail("{}: write failed: {}", tmp, std::strerror(e));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    int e = errno;
    std::remove(tmp.c_str());
    fail("{}: cannot rename to {}: {}", tmp, path, std::strerror(e));
  }
}

}  // namespace dflash::gguf
