// GGUF reader: memory-maps a file and validates every field SPEC 1 lists before exposing it.
//
// Parsing goes front to back through a bounds-checked cursor. Every count and length read from the
// file is checked against the bytes that are left before anything is allocated for it, so a hostile
// file cannot make us allocate more than a small multiple of its own size.
#include "gguf/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>

#include "util/error.h"

static_assert(std::endian::native == std::endian::little, "the GGUF reader assumes a little-endian host");

namespace dflash::gguf {

// ---- values ------------------------------------------------------------------------------------

const char* value_type_name(ValueType t) {
  switch (t) {
    case ValueType::U8: return "u8";
    case ValueType::I8: return "i8";
    case ValueType::U16: return "u16";
    case ValueType::I16: return "i16";
    case ValueType::U32: return "u32";
    case ValueType::I32: return "i32";
    case ValueType::F32: return "f32";
    case ValueType::BOOL: return "bool";
    case ValueType::STRING: return "string";
    case ValueType::ARRAY: return "array";
    case ValueType::U64: return "u64";
    case ValueType::I64: return "i64";
    case ValueType::F64: return "f64";
  }
  return "unknown";
}

Value Value::u8(uint8_t v) { return {ValueType::U8, uint64_t{v}}; }
Value Value::i8(int8_t v) { return {ValueType::I8, int64_t{v}}; }
Value Value::u16(uint16_t v) { return {ValueType::U16, uint64_t{v}}; }
Value Value::i16(int16_t v) { return {ValueType::I16, int64_t{v}}; }
Value Value::u32(uint32_t v) { return {ValueType::U32, uint64_t{v}}; }
Value Value::i32(int32_t v) { return {ValueType::I32, int64_t{v}}; }
Value Value::u64(uint64_t v) { return {ValueType::U64, uint64_t{v}}; }
Value Value::i64(int64_t v) { return {ValueType::I64, int64_t{v}}; }
Value Value::f32(float v) { return {ValueType::F32, double{v}}; }
Value Value::f64(double v) { return {ValueType::F64, double{v}}; }
Value Value::boolean(bool v) { return {ValueType::BOOL, v}; }
Value Value::string(std::string v) { return {ValueType::STRING, std::move(v)}; }
Value Value::array(ValueType elem_type, std::vector<Value> items) {
  return {ValueType::ARRAY, Array{elem_type, std::move(items)}};
}
Value Value::string_array(const std::vector<std::string>& items) {
  std::vector<Value> v;
  v.reserve(items.size());
  for (const auto& s : items) v.push_back(Value::string(s));
  return array(ValueType::STRING, std::move(v));
}
Value Value::i32_array(const std::vector<int32_t>& items) {
  std::vector<Value> v;
  v.reserve(items.size());
  for (int32_t x : items) v.push_back(Value::i32(x));
  return array(ValueType::I32, std::move(v));
}
Value Value::f32_array(const std::vector<float>& items) {
  std::vector<Value> v;
  v.reserve(items.size());
  for (float x : items) v.push_back(Value::f32(x));
  return array(ValueType::F32, std::move(v));
}

bool Array::operator==(const Array& o) const { return elem_type == o.elem_type && items == o.items; }
bool Value::operator==(const Value& o) const { return type == o.type && data == o.data; }

bool Value::is_integer() const {
  switch (type) {
    case ValueType::U8: case ValueType::I8: case ValueType::U16: case ValueType::I16:
    case ValueType::U32: case ValueType::I32: case ValueType::U64: case ValueType::I64:
      return true;
    default:
      return false;
  }
}

std::string Value::type_string() const {
  if (type != ValueType::ARRAY) return value_type_name(type);
  const Array* a = std::get_if<Array>(&data);
  if (!a) return "array";
  std::string elem = value_type_name(a->elem_type);
  if (a->elem_type == ValueType::ARRAY && !a->items.empty()) elem = a->items[0].type_string();
  return fmt::format("array<{}>[{}]", elem, a->items.size());
}

namespace {

std::string quote(std::string_view s, size_t max_string) {
  std::string out = "\"";
  size_t n = std::min(s.size(), max_string);
  for (size_t i = 0; i < n; ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      out += fmt::format("\\x{:02x}", c);
    } else {
      out += static_cast<char>(c);
    }
  }
  out += '"';
  if (s.size() > n) out += fmt::format("... ({} bytes)", s.size());
  return out;
}

}  // namespace

std::string format_value(const Value& v, size_t max_items, size_t max_string) {
  if (const auto* u = std::get_if<uint64_t>(&v.data)) return fmt::format("{}", *u);
  if (const auto* i = std::get_if<int64_t>(&v.data)) return fmt::format("{}", *i);
  if (const auto* d = std::get_if<double>(&v.data)) {
    if (v.type == ValueType::F32) return fmt::format("{}", static_cast<float>(*d));
    return fmt::format("{}", *d);
  }
  if (const auto* b = std::get_if<bool>(&v.data)) return *b ? "true" : "false";
  if (const auto* s = std::get_if<std::string>(&v.data)) return quote(*s, max_string);
  const Array& a = std::get<Array>(v.data);
  std::string out = "[";
  size_t n = std::min(a.items.size(), max_items);
  for (size_t i = 0; i < n; ++i) {
    if (i) out += ", ";
    out += format_value(a.items[i], max_items, max_string);
  }
  if (a.items.size() > n) out += fmt::format(", ... ({} items)", a.items.size());
  out += "]";
  return out;
}

std::string TensorInfo::shape_string() const {
  std::string s = "[";
  for (uint32_t i = 0; i < n_dims && i < 4; ++i) {
    if (i) s += ", ";
    s += fmt::format("{}", ne[i]);
  }
  return s + "]";
}

// ---- the parsed file ---------------------------------------------------------------------------

struct File::Impl {
  std::string path;
  std::vector<uint8_t> owned;  // from_bytes
  void* map = nullptr;         // open(): the mmap'ed file
  size_t map_len = 0;
  const uint8_t* data = nullptr;
  uint64_t size = 0;
  uint32_t version = 0;
  uint32_t alignment = kDefaultAlignment;
  uint64_t data_offset = 0;
  std::vector<KeyValue> kvs;
  std::map<std::string, size_t, std::less<>> kv_index;
  std::vector<TensorInfo> tensors;
  std::map<std::string, size_t, std::less<>> tensor_index;

  ~Impl() {
    if (map) munmap(map, map_len);
  }
  void parse();
};

namespace {

// Minimum encoded sizes, used to bound counts read from the file by the bytes left.
constexpr uint64_t kMinKvBytes = 8 + 4 + 1;              // key length, value type, 1-byte value
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 8 + 4 + 8;  // name length, n_dims, ne[0], type, offset

uint64_t min_value_bytes(ValueType t) {
  switch (t) {
    case ValueType::U8: case ValueType::I8: case ValueType::BOOL: return 1;
    case ValueType::U16: case ValueType::I16: return 2;
    case ValueType::U32: case ValueType::I32: case ValueType::F32: return 4;
    case ValueType::U64: case ValueType::I64: case ValueType::F64: return 8;
    case ValueType::STRING: return 8;
    case ValueType::ARRAY: return 4 + 8;
  }
  return 1;
}

bool known_value_type(uint32_t t) { return t <= static_cast<uint32_t>(ValueType::F64); }

class Parser {
 public:
  Parser(const std::string& path, const uint8_t* data, uint64_t size) : path_(path), data_(data), size_(size) {}

  uint64_t pos() const { return pos_; }
  uint64_t left() const { return size_ - pos_; }
  void set_context(std::string ctx) { ctx_ = std::move(ctx); }

  [[noreturn]] void fail(uint64_t off, std::string_view what, std::string_view expected, std::string_view got) const {
    throw Error(fmt::format("{}: {} at offset 0x{:x}{}: expected {}, got {}", path_, what, off, ctx_, expected, got));
  }

  void need(uint64_t n, std::string_view what) const {
    if (n > left())
      fail(pos_, fmt::format("truncated file while reading {}", what), fmt::format("{} more bytes", n),
           fmt::format("{} bytes left", left()));
  }

  template <typename T>
  T read(std::string_view what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

  std::string read_string(std::string_view what) {
    uint64_t at = pos_;
    uint64_t len = read<uint64_t>(what);
    if (len > left())
      fail(at, fmt::format("{} length exceeds the file", what), fmt::format("at most {} bytes", left()),
           fmt::format("{} bytes", len));
    std::string s(reinterpret_cast<const char*>(data_ + pos_), static_cast<size_t>(len));
    pos_ += len;
    return s;
  }

  Value read_value(ValueType t, int depth, uint64_t& array_items) {
    const uint64_t at = pos_;
    switch (t) {
      case ValueType::U8: return Value::u8(read<uint8_t>("a u8 value"));
      case ValueType::I8: return Value::i8(read<int8_t>("an i8 value"));
      case ValueType::U16: return Value::u16(read<uint16_t>("a u16 value"));
      case ValueType::I16: return Value::i16(read<int16_t>("an i16 value"));
      case ValueType::U32: return Value::u32(read<uint32_t>("a u32 value"));
      case ValueType::I32: return Value::i32(read<int32_t>("an i32 value"));
      case ValueType::U64: return Value::u64(read<uint64_t>("a u64 value"));
      case ValueType::I64: return Value::i64(read<int64_t>("an i64 value"));
      case ValueType::F32: return Value::f32(read<float>("an f32 value"));
      case ValueType::F64: return Value::f64(read<double>("an f64 value"));
      case ValueType::BOOL: {
        uint8_t b = read<uint8_t>("a bool value");
        if (b > 1) fail(at, "invalid bool value", "0 or 1", fmt::format("{}", b));
        return Value::boolean(b != 0);
      }
      case ValueType::STRING: return Value::string(read_string("string"));
      case ValueType::ARRAY: {
        if (depth >= kMaxArrayDepth)
          fail(at, "arrays nested too deep", fmt::format("at most {} levels", kMaxArrayDepth),
               fmt::format("level {}", depth + 1));
        uint32_t et = read<uint32_t>("an array element type");
        if (!known_value_type(et))
          fail(at, "unknown value type in array", "an element type 0..12", fmt::format("{}", et));
        const auto elem = static_cast<ValueType>(et);
        const uint64_t count_at = pos_;
        uint64_t count = read<uint64_t>("an array length");
        const uint64_t min_bytes = min_value_bytes(elem);
        if (count > left() / min_bytes)
          fail(count_at, "array length exceeds the file",
               fmt::format("at most {} {} items", left() / min_bytes, value_type_name(elem)),
               fmt::format("{}", count));
        array_items += count;
        if (array_items > kMaxArrayItems)
          fail(count_at, "too many array items in the file", fmt::format("at most {} in total", kMaxArrayItems),
               fmt::format("{}", array_items));
        Array a;
        a.elem_type = elem;
        a.items.reserve(static_cast<size_t>(count));
        for (uint64_t i = 0; i < count; ++i) a.items.push_back(read_value(elem, depth + 1, array_items));
        return Value{ValueType::ARRAY, std::move(a)};
      }
    }
    fail(at, "unknown value type", "a type 0..12", fmt::format("{}", static_cast<uint32_t>(t)));
  }

 private:
  const std::string& path_;
  const uint8_t* data_;
  uint64_t size_;
  uint64_t pos_ = 0;
  std::string ctx_;
};

}  // namespace

void File::Impl::parse() {
  Parser p(path, data, size);

  // ---- header
  const uint32_t magic = p.read<uint32_t>("the magic");
  if (magic != kMagic) p.fail(0, "bad magic", "\"GGUF\" (0x46554747)", fmt::format("0x{:08x}", magic));
  version = p.read<uint32_t>("the version");
  if (version == 1)
    p.fail(4, "unsupported GGUF version 1 (32-bit counts; re-convert the file)", "version 2 or 3", "1");
  if (version != 2 && version != 3)
    p.fail(4, "unsupported GGUF version", "version 2 or 3", fmt::format("{}", version));
  const uint64_t n_tensors = p.read<uint64_t>("the tensor count");
  const uint64_t n_kv = p.read<uint64_t>("the key-value count");
  if (n_tensors > p.left() / kMinTensorInfoBytes)
    p.fail(8, "tensor count exceeds the file",
           fmt::format("at most {} tensors in {} bytes", p.left() / kMinTensorInfoBytes, p.left()),
           fmt::format("{}", n_tensors));
  if (n_kv > p.left() / kMinKvBytes)
    p.fail(16, "key-value count exceeds the file",
           fmt::format("at most {} keys in {} bytes", p.left() / kMinKvBytes, p.left()), fmt::format("{}", n_kv));
  if (n_kv * kMinKvBytes + n_tensors * kMinTensorInfoBytes > p.left())
    p.fail(8, "tensor and key-value counts exceed the file", fmt::format("at most {} bytes of infos", p.left()),
           fmt::format("{} tensors and {} keys", n_tensors, n_kv));

  // ---- metadata
  uint64_t array_items = 0;
  kvs.reserve(static_cast<size_t>(n_kv));
  for (uint64_t i = 0; i < n_kv; ++i) {
    p.set_context("");
    const uint64_t key_at = p.pos();
    std::string key = p.read_string("key");
    p.set_context(fmt::format(" (key '{}')", key));
    if (kv_index.count(key)) p.fail(key_at, "duplicate key", "unique keys", "a second definition");
    const uint64_t type_at = p.pos();
    const uint32_t t = p.read<uint32_t>("a value type");
    if (!known_value_type(t)) p.fail(type_at, "unknown value type", "a type 0..12", fmt::format("{}", t));
    const uint64_t value_at = p.pos();
    Value v = p.read_value(static_cast<ValueType>(t), 0, array_items);
    if (key == "general.alignment") {
      if (v.type != ValueType::U32)
        p.fail(type_at, "general.alignment has the wrong type", "u32", v.type_string());
      const uint64_t a = std::get<uint64_t>(v.data);
      if (a == 0 || !std::has_single_bit(a) || a > kMaxAlignment)
        p.fail(value_at, "invalid alignment", fmt::format("a power of two in 1..{}", kMaxAlignment),
               fmt::format("{}", a));
      alignment = static_cast<uint32_t>(a);
    }
    kv_index.emplace(key, kvs.size());
    kvs.push_back(KeyValue{std::move(key), std::move(v)});
  }

  // ---- tensor infos
  tensors.reserve(static_cast<size_t>(n_tensors));
  for (uint64_t i = 0; i < n_tensors; ++i) {
    p.set_context("");
    TensorInfo t;
    t.info_offset = p.pos();
    t.name = p.read_string("tensor name");
    p.set_context(fmt::format(" (tensor '{}')", t.name));
    if (tensor_index.count(t.name)) p.fail(t.info_offset, "duplicate tensor name", "unique names", "a second tensor");
    const uint64_t dims_at = p.pos();
    t.n_dims = p.read<uint32_t>("n_dims");
    if (t.n_dims < 1 || t.n_dims > static_cast<uint32_t>(kMaxDims))
      p.fail(dims_at, "invalid n_dims", fmt::format("1..{}", kMaxDims), fmt::format("{}", t.n_dims));
    int64_t n_elements = 1;
    for (uint32_t d = 0; d < t.n_dims; ++d) {
      const uint64_t ne_at = p.pos();
      uint64_t ne = p.read<uint64_t>("a dimension");
      if (ne > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        p.fail(ne_at, fmt::format("negative dimension ne[{}]", d), "ne >= 0", fmt::format("{}", static_cast<int64_t>(ne)));
      t.ne[d] = static_cast<int64_t>(ne);
      if (__builtin_mul_overflow(n_elements, t.ne[d], &n_elements))
        p.fail(ne_at, "element count overflows int64", "a product of dimensions < 2^63", t.shape_string());
    }
    const uint64_t type_at = p.pos();
    const uint32_t type_id = p.read<uint32_t>("a tensor type");
    const TypeTraits* traits = type_traits(type_id);
    if (!traits) p.fail(type_at, "unknown tensor type", "a known ggml type id", fmt::format("{}", type_id));
    t.type = traits->type;
    if (t.ne[0] % traits->block_elems != 0)
      p.fail(dims_at, fmt::format("row length is not a multiple of the {} block size", traits->name),
             fmt::format("ne[0] a multiple of {}", traits->block_elems), fmt::format("{}", t.ne[0]));
    // Rows of ne[0] elements; each dimension was checked non-negative and the product fits int64.
    uint64_t row = static_cast<uint64_t>(t.ne[0] / traits->block_elems) * static_cast<uint64_t>(traits->block_bytes);
    uint64_t nbytes = row;
    for (uint32_t d = 1; d < t.n_dims; ++d)
      if (__builtin_mul_overflow(nbytes, static_cast<uint64_t>(t.ne[d]), &nbytes))
        p.fail(dims_at, "tensor byte size overflows", "a size < 2^64 bytes", t.shape_string());
    t.nbytes = nbytes;
    const uint64_t off_at = p.pos();
    t.offset = p.read<uint64_t>("a tensor offset");
    if (t.offset % alignment != 0)
      p.fail(off_at, "tensor data offset is not aligned", fmt::format("a multiple of {}", alignment),
             fmt::format("0x{:x}", t.offset));
    tensor_index.emplace(t.name, tensors.size());
    tensors.push_back(std::move(t));
  }
  p.set_context("");

  // ---- data section: starts at the next multiple of the alignment after the infos
  data_offset = (p.pos() + alignment - 1) / alignment * alignment;  // pos <= size < 2^63: no overflow
  const uint64_t data_size = size > data_offset ? size - data_offset : 0;
  for (const auto& t : tensors) {
    if (t.offset > data_size || t.nbytes > data_size - t.offset) {
      p.set_context(fmt::format(" (tensor '{}')", t.name));
      p.fail(t.info_offset, "tensor data lies outside the file",
             fmt::format("data within the {} bytes after the data section start 0x{:x}", data_size, data_offset),
             fmt::format("offset 0x{:x} + {} bytes", t.offset, t.nbytes));
    }
  }
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return tensors[a].offset < tensors[b].offset; });
  for (size_t i = 1; i < order.size(); ++i) {
    const TensorInfo& a = tensors[order[i - 1]];
    const TensorInfo& b = tensors[order[i]];
    if (a.offset + a.nbytes > b.offset) {
      p.set_context(fmt::format(" (tensor '{}')", b.name));
      p.fail(b.info_offset, fmt::format("tensor data overlaps tensor '{}'", a.name),
             fmt::format("an offset >= 0x{:x}", a.offset + a.nbytes), fmt::format("0x{:x}", b.offset));
    }
  }
}

// ---- File --------------------------------------------------------------------------------------

File::File() : impl_(std::make_unique<Impl>()) {}
File::File(File&&) noexcept = default;
File& File::operator=(File&&) noexcept = default;
File::~File() = default;

File File::open(const std::string& path) {
  File f;
  f.impl_->path = path;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("{}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    fail("{}: cannot stat: {}", path, std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("{}: not a regular file", path);
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > 0) {
    void* m = mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      fail("{}: cannot mmap {} bytes: {}", path, size, std::strerror(e));
    }
    f.impl_->map = m;
    f.impl_->map_len = static_cast<size_t>(size);
    f.impl_->data = static_cast<const uint8_t*>(m);
  }
  ::close(fd);  // the mapping stays valid
  f.impl_->size = size;
  f.impl_->parse();
  return f;
}

File File::from_bytes(std::vector<uint8_t> bytes, std::string name) {
  File f;
  f.impl_->path = std::move(name);
  f.impl_->owned = std::move(bytes);
  f.impl_->data = f.impl_->owned.data();
  f.impl_->size = f.impl_->owned.size();
  f.impl_->parse();
  return f;
}

const std::string& File::path() const { return impl_->path; }
uint32_t File::version() const { return impl_->version; }
uint32_t File::alignment() const { return impl_->alignment; }
uint64_t File::data_offset() const { return impl_->data_offset; }
uint64_t File::file_size() const { return impl_->size; }
const std::vector<KeyValue>& File::metadata() const { return impl_->kvs; }
const std::vector<TensorInfo>& File::tensors() const { return impl_->tensors; }

const Value* File::find(std::string_view key) const {
  auto it = impl_->kv_index.find(key);
  return it == impl_->kv_index.end() ? nullptr : &impl_->kvs[it->second].value;
}

const TensorInfo* File::find_tensor(std::string_view name) const {
  auto it = impl_->tensor_index.find(name);
  return it == impl_->tensor_index.end() ? nullptr : &impl_->tensors[it->second];
}

const TensorInfo& File::tensor(std::string_view name) const {
  const TensorInfo* t = find_tensor(name);
  if (!t) fail("{}: tensor '{}' not found", impl_->path, name);
  return *t;
}

std::span<const uint8_t> File::tensor_data(const TensorInfo& t) const {
  // Infos from tensors() were validated at open; this guards against a TensorInfo built elsewhere.
  const uint64_t data_size = impl_->size > impl_->data_offset ? impl_->size - impl_->data_offset : 0;
  if (t.offset > data_size || t.nbytes > data_size - t.offset)
    fail("{}: tensor '{}': data range 0x{:x} + {} bytes lies outside the file", impl_->path, t.name, t.offset,
         t.nbytes);
  if (t.nbytes == 0) return {};
  return {impl_->data + impl_->data_offset + t.offset, static_cast<size_t>(t.nbytes)};
}

// ---- typed getters -----------------------------------------------------------------------------

namespace {

[[noreturn]] void wrong_type(const std::string& path, std::string_view key, std::string_view expected, const Value& v) {
  fail("{}: key '{}': expected {}, got {}", path, key, expected, v.type_string());
}

// Integer value of an integer or bool Value, range-checked into int64. nullopt for other types.
std::optional<int64_t> as_int(const std::string& path, std::string_view key, const Value& v) {
  if (v.type == ValueType::BOOL) return std::get<bool>(v.data) ? 1 : 0;
  if (!v.is_integer()) return std::nullopt;
  if (const auto* u = std::get_if<uint64_t>(&v.data)) {
    if (*u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      fail("{}: key '{}': value {} out of range, expected at most {}", path, key, *u,
           std::numeric_limits<int64_t>::max());
    return static_cast<int64_t>(*u);
  }
  if (const auto* i = std::get_if<int64_t>(&v.data)) return *i;
  fail("{}: key '{}': malformed {} value", path, key, v.type_string());
}

std::optional<double> as_float(const std::string& path, std::string_view key, const Value& v) {
  if (v.is_float()) {
    if (const auto* d = std::get_if<double>(&v.data)) return *d;
    fail("{}: key '{}': malformed {} value", path, key, v.type_string());
  }
  if (const auto* u = std::get_if<uint64_t>(&v.data); u && v.is_integer()) return static_cast<double>(*u);
  if (const auto* i = std::get_if<int64_t>(&v.data); i && v.is_integer()) return static_cast<double>(*i);
  return std::nullopt;
}

const Array& as_array(const std::string& path, std::string_view key, const Value& v, std::string_view expected) {
  const Array* a = v.type == ValueType::ARRAY ? std::get_if<Array>(&v.data) : nullptr;
  if (!a) wrong_type(path, key, expected, v);
  return *a;
}

}  // namespace

static const Value& require(const File& f, std::string_view key) {
  const Value* v = f.find(key);
  if (!v) fail("{}: key '{}' not found", f.path(), key);
  return *v;
}

std::string File::get_string(std::string_view key) const {
  const Value& v = require(*this, key);
  const auto* s = v.type == ValueType::STRING ? std::get_if<std::string>(&v.data) : nullptr;
  if (!s) wrong_type(path(), key, "string", v);
  return *s;
}

int64_t File::get_int(std::string_view key) const {
  const Value& v = require(*this, key);
  auto i = as_int(path(), key, v);
  if (!i) wrong_type(path(), key, "an integer", v);
  return *i;
}

uint64_t File::get_uint(std::string_view key) const {
  const Value& v = require(*this, key);
  if (const auto* u = std::get_if<uint64_t>(&v.data); u && v.is_integer()) return *u;
  auto i = as_int(path(), key, v);
  if (!i) wrong_type(path(), key, "an unsigned integer", v);
  if (*i < 0) fail("{}: key '{}': expected a non-negative integer, got {}", path(), key, *i);
  return static_cast<uint64_t>(*i);
}

double File::get_float(std::string_view key) const {
  const Value& v = require(*this, key);
  auto d = as_float(path(), key, v);
  if (!d) wrong_type(path(), key, "a number (f32, f64 or integer)", v);
  return *d;
}

bool File::get_bool(std::string_view key) const {
  const Value& v = require(*this, key);
  const auto* b = v.type == ValueType::BOOL ? std::get_if<bool>(&v.data) : nullptr;
  if (!b) wrong_type(path(), key, "bool", v);
  return *b;
}

std::vector<std::string> File::get_string_array(std::string_view key) const {
  const Value& v = require(*this, key);
  const Array& a = as_array(path(), key, v, "array<string>");
  if (a.elem_type != ValueType::STRING) wrong_type(path(), key, "array<string>", v);
  std::vector<std::string> out;
  out.reserve(a.items.size());
  for (const Value& it : a.items) {
    const auto* s = std::get_if<std::string>(&it.data);
    if (!s) wrong_type(path(), key, "array<string>", v);
    out.push_back(*s);
  }
  return out;
}

std::vector<int64_t> File::get_int_array(std::string_view key) const {
  const Value& v = require(*this, key);
  const Array& a = as_array(path(), key, v, "an integer array");
  std::vector<int64_t> out;
  out.reserve(a.items.size());
  for (const Value& it : a.items) {
    auto i = as_int(path(), key, it);
    if (!i) wrong_type(path(), key, "an integer array", v);
    out.push_back(*i);
  }
  return out;
}

std::vector<double> File::get_float_array(std::string_view key) const {
  const Value& v = require(*this, key);
  const Array& a = as_array(path(), key, v, "a numeric array");
  std::vector<double> out;
  out.reserve(a.items.size());
  for (const Value& it : a.items) {
    auto d = as_float(path(), key, it);
    if (!d) wrong_type(path(), key, "a numeric array", v);
    out.push_back(*d);
  }
  return out;
}

std::string File::get_string_or(std::string_view key, std::string def) const {
  return has(key) ? get_string(key) : std::move(def);
}
int64_t File::get_int_or(std::string_view key, int64_t def) const { return has(key) ? get_int(key) : def; }
double File::get_float_or(std::string_view key, double def) const { return has(key) ? get_float(key) : def; }
bool File::get_bool_or(std::string_view key, bool def) const { return has(key) ? get_bool(key) : def; }

}  // namespace dflash::gguf
