#include "models/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_map>

#include "quant/types.h"
#include "util/error.h"

namespace dflash::hf {
namespace {

using json = nlohmann::json;

constexpr int kMaxHeaderDepth = 8;  // {name: {shape: [..]}} needs 3

struct DtypeInfo {
  const char* name;
  int64_t size;
};
constexpr DtypeInfo kDtypes[] = {
    {"F64", 8}, {"F32", 4}, {"F16", 2},  {"BF16", 2}, {"I64", 8},     {"I32", 4},     {"I16", 2},     {"I8", 1},
    {"U64", 8}, {"U32", 4}, {"U16", 2},  {"U8", 1},   {"BOOL", 1},    {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"F8_E8M0", 1},
};

// Rejects JSON nested deeper than max_depth before handing it to a parser (a hostile header of
// a million '[' must not cost a million parser frames or allocations). Strings are skipped with their
// escapes so brackets inside names do not count.
void check_json_depth(std::string_view s, const std::string& what, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    else if (c == '{' || c == '[') {
      DFLASH_CHECK(++depth <= max_depth, "{}: JSON nested deeper than {} levels at byte {}", what, max_depth, i);
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
}

// Parses `text` as one JSON object whose top-level keys are unique.
json parse_object(std::string_view text, const std::string& what, int max_depth = kMaxHeaderDepth) {
  check_json_depth(text, what, max_depth);
  std::string dup;
  json j;
  try {
    std::set<std::string> seen;
    j = json::parse(text.begin(), text.end(), [&](int depth, json::parse_event_t ev, json& parsed) {
      if (depth == 1 && ev == json::parse_event_t::key && parsed.is_string()) {
        if (!seen.insert(parsed.get<std::string>()).second && dup.empty()) dup = parsed.get<std::string>();
      }
      return true;
    });
  } catch (const json::exception& e) {
    fail("{}: invalid JSON: {}", what, e.what());
  }
  DFLASH_CHECK(dup.empty(), "{}: key '{}' appears more than once", what, dup);
  DFLASH_CHECK(j.is_object(), "{}: expected a JSON object, got {}", what, j.type_name());
  return j;
}

std::string read_small_file(const std::string& path, uint64_t max_bytes) {
  std::error_code ec;
  const uint64_t size = std::filesystem::file_size(path, ec);
  DFLASH_CHECK(!ec, "{}: cannot read: {}", path, ec.message());
  DFLASH_CHECK(size <= max_bytes, "{}: {} bytes is larger than the {} bytes allowed for this file", path, size,
               max_bytes);
  std::ifstream in(path, std::ios::binary);
  DFLASH_CHECK(in.good(), "{}: cannot open: {}", path, std::strerror(errno));
  std::string s(size, '\0');
  in.read(s.data(), static_cast<std::streamsize>(size));
  DFLASH_CHECK(in.gcount() == static_cast<std::streamsize>(size), "{}: short read", path);
  return s;
}

bool mul_overflows(uint64_t a, uint64_t b, uint64_t* out) { return __builtin_mul_overflow(a, b, out); }

}  // namespace

json read_json_file(const std::string& path, uint64_t max_bytes, int max_depth) {
  return parse_object(read_small_file(path, max_bytes), path, max_depth);
}

int64_t dtype_size(std::string_view dtype) {
  for (const DtypeInfo& d : kDtypes)
    if (dtype == d.name) return d.size;
  return 0;
}

bool dtype_is_float(std::string_view dtype) { return dtype == "F32" || dtype == "F16" || dtype == "BF16"; }

int64_t StTensor::n_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string StTensor::shape_string() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

struct SafetensorsFile::Impl {
  std::string path;
  std::vector<uint8_t> owned;  // from_bytes
  void* map = nullptr;
  size_t map_size = 0;
  const uint8_t* base = nullptr;
  uint64_t size = 0;
  uint64_t data_start = 0;
  std::vector<StTensor> tensors;
  std::unordered_map<std::string, size_t> index;
  std::map<std::string, std::string> metadata;

  ~Impl() {
    if (map) munmap(map, map_size);
  }

  void parse();
};

void SafetensorsFile::Impl::parse() {
  const std::string& p = path;
  DFLASH_CHECK(size >= 8, "{}: {} bytes is too short for a safetensors file (8-byte header length first)", p, size);
  uint64_t n = 0;
  std::memcpy(&n, base, 8);  // little-endian hosts only (x86-64, aarch64)
  DFLASH_CHECK(n <= size - 8, "{}: header length {} runs past the end of the file ({} bytes)", p, n, size);
  DFLASH_CHECK(n <= kMaxHeaderBytes, "{}: header length {} exceeds the {} byte limit", p, n, kMaxHeaderBytes);
  DFLASH_CHECK(n >= 2, "{}: header length {} is too short for a JSON object", p, n);
  const std::string_view text(reinterpret_cast<const char*>(base + 8), n);
  DFLASH_CHECK(text[0] == '{', "{}: header does not start with '{{' (byte 8 is 0x{:02x})", p,
               static_cast<unsigned>(static_cast<uint8_t>(text[0])));
  data_start = 8 + n;
  const uint64_t data_size = size - data_start;
  const json j = parse_object(text, p + ": header");

  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      DFLASH_CHECK(v.is_object(), "{}: __metadata__ must be an object of strings", p);
      for (auto m = v.begin(); m != v.end(); ++m) {
        DFLASH_CHECK(m.value().is_string(), "{}: __metadata__['{}'] is not a string", p, m.key());
        metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = fmt::format("{}: tensor '{}'", p, name);
    DFLASH_CHECK(v.is_object(), "{}: entry is not an object", where);
    DFLASH_CHECK(v.contains("dtype") && v["dtype"].is_string(), "{}: missing string 'dtype'", where);
    DFLASH_CHECK(v.contains("shape") && v["shape"].is_array(), "{}: missing array 'shape'", where);
    DFLASH_CHECK(v.contains("data_offsets") && v["data_offsets"].is_array() && v["data_offsets"].size() == 2,
                 "{}: missing 'data_offsets' [begin, end]", where);
    StTensor t;
    t.name = name;
    t.dtype = v["dtype"].get<std::string>();
    t.elem_size = dtype_size(t.dtype);
    DFLASH_CHECK(t.elem_size > 0, "{}: unknown dtype '{}'", where, t.dtype);
    const json& shape = v["shape"];
    DFLASH_CHECK(shape.size() <= static_cast<size_t>(kMaxShapeDims), "{}: {} dimensions (at most {})", where,
                 shape.size(), kMaxShapeDims);
    uint64_t count = 1;
    for (const json& d : shape) {
      DFLASH_CHECK(d.is_number_unsigned(), "{}: shape entry {} is not a non-negative integer", where, d.dump());
      const uint64_t dim = d.get<uint64_t>();
      DFLASH_CHECK(dim <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) && !mul_overflows(count, dim, &count),
                   "{}: shape {} overflows", where, shape.dump());
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    uint64_t bytes = 0;
    DFLASH_CHECK(!mul_overflows(count, static_cast<uint64_t>(t.elem_size), &bytes) &&
                     count <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                 "{}: shape {} overflows", where, shape.dump());
    const json& off = v["data_offsets"];
    DFLASH_CHECK(off[0].is_number_unsigned() && off[1].is_number_unsigned(),
                 "{}: data_offsets {} are not non-negative integers", where, off.dump());
    t.begin = off[0].get<uint64_t>();
    t.end = off[1].get<uint64_t>();
    DFLASH_CHECK(t.begin <= t.end, "{}: data_offsets [{}, {}] end before they begin", where, t.begin, t.end);
    DFLASH_CHECK(t.end <= data_size, "{}: data_offsets [{}, {}] run past the data section ({} bytes)", where, t.begin,
                 t.end, data_size);
    DFLASH_CHECK(t.end - t.begin == bytes, "{}: shape {} of {} needs {} bytes but data_offsets [{}, {}] hold {}", where,
                 t.shape_string(), t.dtype, bytes, t.begin, t.end, t.end - t.begin);
    index[name] = tensors.size();
    tensors.push_back(std::move(t));
  }

  // No two tensors may share bytes (a hostile file could alias one buffer under two names).
  std::vector<const StTensor*> order;
  for (const StTensor& t : tensors)
    if (t.end > t.begin) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const StTensor* a, const StTensor* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < order.size(); ++i)
    DFLASH_CHECK(order[i]->begin >= order[i - 1]->end, "{}: tensors '{}' [{}, {}) and '{}' [{}, {}) overlap", p,
                 order[i - 1]->name, order[i - 1]->begin, order[i - 1]->end, order[i]->name, order[i]->begin,
                 order[i]->end);
}

SafetensorsFile::SafetensorsFile() : impl_(std::make_unique<Impl>()) {}
SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&&) noexcept = default;
SafetensorsFile::~SafetensorsFile() = default;

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  Impl& m = *f.impl_;
  m.path = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DFLASH_CHECK(fd >= 0, "{}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("{}: not a regular file", path);
  }
  m.size = static_cast<uint64_t>(st.st_size);
  if (m.size > 0) {
    m.map = mmap(nullptr, m.size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m.map == MAP_FAILED) {
      m.map = nullptr;
      ::close(fd);
      fail("{}: mmap of {} bytes failed: {}", path, m.size, std::strerror(errno));
    }
    m.map_size = m.size;
    m.base = static_cast<const uint8_t*>(m.map);
  }
  ::close(fd);
  m.parse();
  return f;
}

SafetensorsFile SafetensorsFile::from_bytes(std::vector<uint8_t> bytes, std::string name) {
  SafetensorsFile f;
  Impl& m = *f.impl_;
  m.path = std::move(name);
  m.owned = std::move(bytes);
  m.base = m.owned.data();
  m.size = m.owned.size();
  m.parse();
  return f;
}

const std::string& SafetensorsFile::path() const { return impl_->path; }
const std::vector<StTensor>& SafetensorsFile::tensors() const { return impl_->tensors; }
const std::map<std::string, std::string>& SafetensorsFile::metadata() const { return impl_->metadata; }

const StTensor* SafetensorsFile::find(std::string_view name) const {
  auto it = impl_->index.find(std::string(name));
  return it == impl_->index.end() ? nullptr : &impl_->tensors[it->second];
}

std::span<const uint8_t> SafetensorsFile::data(const StTensor& t) const {
  return {impl_->base + impl_->data_start + t.begin, static_cast<size_t>(t.end - t.begin)};
}

// ---------------------------------------------------------------------------------------------
// Checkpoint

struct Checkpoint::Impl {
  std::string dir;
  std::vector<SafetensorsFile> files;
  std::unordered_map<std::string, std::pair<size_t, const StTensor*>> tensors;  // name -> (file, tensor)
  std::unordered_map<const StTensor*, size_t> file_of;
};

Checkpoint::Checkpoint() : impl_(std::make_unique<Impl>()) {}
Checkpoint::Checkpoint(Checkpoint&&) noexcept = default;
Checkpoint& Checkpoint::operator=(Checkpoint&&) noexcept = default;
Checkpoint::~Checkpoint() = default;

Checkpoint Checkpoint::open(const std::string& dir) {
  namespace fs = std::filesystem;
  Checkpoint c;
  Impl& m = *c.impl_;
  m.dir = dir;
  DFLASH_CHECK(fs::is_directory(dir), "{}: not a directory (expected a Hugging Face model folder)", dir);
  const fs::path single = fs::path(dir) / "model.safetensors";
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";

  auto add_file = [&](SafetensorsFile f) {
    const size_t fi = m.files.size();
    m.files.push_back(std::move(f));
    for (const StTensor& t : m.files[fi].tensors()) {
      auto [it, fresh] = m.tensors.emplace(t.name, std::make_pair(fi, &t));
      DFLASH_CHECK(fresh, "{}: tensor '{}' is in both {} and {}", dir, t.name, m.files[it->second.first].path(),
                   m.files[fi].path());
      m.file_of[&t] = fi;
    }
  };

  if (fs::exists(index)) {
    const std::string ipath = index.string();
    const json j = parse_object(read_small_file(ipath, 64ull << 20), ipath);
    DFLASH_CHECK(j.contains("weight_map") && j["weight_map"].is_object(), "{}: missing object 'weight_map'", ipath);
    std::map<std::string, std::vector<std::string>> by_shard;  // shard file -> tensor names it should hold
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      DFLASH_CHECK(it.value().is_string(), "{}: weight_map['{}'] is not a file name", ipath, it.key());
      const std::string shard = it.value().get<std::string>();
      // Shards are plain file names next to the index: no way out of the folder.
      const bool plain = !shard.empty() && shard != "." && shard != ".." &&
                         shard.find_first_of(std::string("/\\\0", 3)) == std::string::npos;
      DFLASH_CHECK(plain, "{}: weight_map['{}'] = '{}' is not a plain file name in the model folder", ipath, it.key(),
                   shard);
      by_shard[shard].push_back(it.key());
    }
    DFLASH_CHECK(!by_shard.empty(), "{}: weight_map is empty", ipath);
    for (const auto& [shard, names] : by_shard) {
      add_file(SafetensorsFile::open((fs::path(dir) / shard).string()));
      const SafetensorsFile& f = m.files.back();
      for (const std::string& n : names)
        DFLASH_CHECK(f.find(n) != nullptr, "{}: the index puts tensor '{}' in {}, which has no such tensor", ipath, n,
                     f.path());
    }
  } else if (fs::exists(single)) {
    add_file(SafetensorsFile::open(single.string()));
  } else {
    fail("{}: no model.safetensors or model.safetensors.index.json (only safetensors checkpoints are supported)", dir);
  }
  return c;
}

const std::string& Checkpoint::dir() const { return impl_->dir; }

const StTensor* Checkpoint::find(std::string_view name) const {
  auto it = impl_->tensors.find(std::string(name));
  return it == impl_->tensors.end() ? nullptr : it->second.second;
}

const StTensor& Checkpoint::require(std::string_view name, std::string_view what_for) const {
  const StTensor* t = find(name);
  if (!t) {
    if (what_for.empty()) fail("{}: the checkpoint has no tensor '{}'", impl_->dir, name);
    fail("{}: the checkpoint has no tensor '{}' (needed for {})", impl_->dir, name, what_for);
  }
  return *t;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> v;
  for (const auto& [n, _] : impl_->tensors) v.push_back(n);
  std::sort(v.begin(), v.end());
  return v;
}

const std::string& Checkpoint::file_of(const StTensor& t) const { return impl_->files.at(impl_->file_of.at(&t)).path(); }

void Checkpoint::read(const StTensor& t, int64_t elem0, int64_t n, float* out) const {
  const SafetensorsFile& f = impl_->files.at(impl_->file_of.at(&t));
  DFLASH_CHECK(dtype_is_float(t.dtype), "{}: tensor '{}' has dtype {}; convert reads F32, F16 and BF16", f.path(),
               t.name, t.dtype);
  DFLASH_CHECK(elem0 >= 0 && n >= 0 && elem0 + n <= t.n_elements(), "{}: read of elements [{}, {}) outside tensor '{}' {}",
               f.path(), elem0, elem0 + n, t.name, t.shape_string());
  const uint8_t* src = f.data(t).data() + static_cast<size_t>(elem0) * t.elem_size;
  if (t.dtype == "F32") {
    std::memcpy(out, src, static_cast<size_t>(n) * 4);
  } else if (t.dtype == "F16") {
    for (int64_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      out[i] = fp16_to_fp32(h);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      out[i] = bf16_to_fp32(h);
    }
  }
}

}  // namespace dflash::hf
