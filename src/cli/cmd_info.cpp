// `dflash info FILE [--json]`: what is in a GGUF file — header, metadata (arrays summarised, long
// strings truncated), the tensor table and byte totals per type.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "gguf/gguf.h"

namespace dflash::cli {
namespace {

using gguf::Value;
using gguf::ValueType;

constexpr size_t kMaxItems = 8;     // array items shown
constexpr size_t kMaxString = 120;  // string bytes shown

std::string human_bytes(uint64_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", n) : fmt::format("{:.2f} {}", v, units[u]);
}

// JSON for a value: scalars as JSON scalars; strings truncated; arrays as {type, length, first}.
nlohmann::json value_json(const Value& v, bool top) {
  if (const auto* u = std::get_if<uint64_t>(&v.data)) return *u;
  if (const auto* i = std::get_if<int64_t>(&v.data)) return *i;
  if (const auto* d = std::get_if<double>(&v.data)) return std::isfinite(*d) ? nlohmann::json(*d) : nlohmann::json(fmt::format("{}", *d));
  if (const auto* b = std::get_if<bool>(&v.data)) return *b;
  if (const auto* s = std::get_if<std::string>(&v.data))
    return s->size() > kMaxString ? s->substr(0, kMaxString) + fmt::format("... ({} bytes)", s->size()) : *s;
  const auto& a = std::get<gguf::Array>(v.data);
  nlohmann::json first = nlohmann::json::array();
  for (size_t i = 0; i < a.items.size() && i < kMaxItems; ++i) first.push_back(value_json(a.items[i], false));
  return {{"type", v.type_string()}, {"length", a.items.size()}, {"first", first}};
}

void print_text(const gguf::File& f) {
  fmt::print("{}\n", f.path());
  fmt::print("  GGUF version {}, alignment {}, {} keys, {} tensors, data at 0x{:x}, file {} bytes ({})\n",
             f.version(), f.alignment(), f.metadata().size(), f.tensors().size(), f.data_offset(), f.file_size(),
             human_bytes(f.file_size()));
  fmt::print("\nmetadata ({} keys):\n", f.metadata().size());
  size_t kw = 3, tw = 4;
  for (const auto& kv : f.metadata()) {
    kw = std::max(kw, kv.key.size());
    tw = std::max(tw, kv.value.type_string().size());
  }
  for (const auto& kv : f.metadata())
    fmt::print("  {:<{}}  {:<{}}  {}\n", kv.key, kw, kv.value.type_string(), tw,
               gguf::format_value(kv.value, kMaxItems, kMaxString));

  fmt::print("\ntensors ({}):\n", f.tensors().size());
  size_t nw = 4, sw = 5;
  for (const auto& t : f.tensors()) {
    nw = std::max(nw, t.name.size());
    sw = std::max(sw, t.shape_string().size());
  }
  fmt::print("  {:<{}}  {:<6}  {:<{}}  {:>14}  {:>12}\n", "name", nw, "type", "shape", sw, "bytes", "offset");
  struct Total {
    uint64_t count = 0, elements = 0, bytes = 0;
  };
  std::map<std::string, Total> totals;
  uint64_t all_bytes = 0, all_elements = 0;
  for (const auto& t : f.tensors()) {
    fmt::print("  {:<{}}  {:<6}  {:<{}}  {:>14}  {:>12}\n", t.name, nw, type_name(t.type), t.shape_string(), sw,
               t.nbytes, fmt::format("0x{:x}", t.offset));
    Total& tot = totals[type_name(t.type)];
    tot.count += 1;
    tot.elements += static_cast<uint64_t>(t.n_elements());
    tot.bytes += t.nbytes;
    all_bytes += t.nbytes;
    all_elements += static_cast<uint64_t>(t.n_elements());
  }
  fmt::print("\ntotals by type:\n");
  for (const auto& [name, tot] : totals)
    fmt::print("  {:<6}  {:>6} tensors  {:>16} elements  {:>16} bytes ({}, {:.3f} bits/element)\n", name, tot.count,
               tot.elements, tot.bytes, human_bytes(tot.bytes),
               tot.elements ? 8.0 * static_cast<double>(tot.bytes) / static_cast<double>(tot.elements) : 0.0);
  fmt::print("  {:<6}  {:>6} tensors  {:>16} elements  {:>16} bytes ({})\n", "all", f.tensors().size(), all_elements,
             all_bytes, human_bytes(all_bytes));
}

void print_json(const gguf::File& f) {
  nlohmann::json j;
  j["file"] = f.path();
  j["version"] = f.version();
  j["alignment"] = f.alignment();
  j["n_kv"] = f.metadata().size();
  j["n_tensors"] = f.tensors().size();
  j["data_offset"] = f.data_offset();
  j["file_size"] = f.file_size();
  nlohmann::json meta = nlohmann::json::array();
  for (const auto& kv : f.metadata())
    meta.push_back({{"key", kv.key}, {"type", kv.value.type_string()}, {"value", value_json(kv.value, true)}});
  j["metadata"] = meta;
  nlohmann::json tensors = nlohmann::json::array();
  std::map<std::string, nlohmann::json> totals;
  for (const auto& t : f.tensors()) {
    std::vector<int64_t> shape(t.ne, t.ne + t.n_dims);
    tensors.push_back({{"name", t.name}, {"type", type_name(t.type)}, {"shape", shape}, {"bytes", t.nbytes},
                       {"offset", t.offset}});
    auto& tot = totals[type_name(t.type)];
    if (tot.is_null()) tot = {{"tensors", 0}, {"elements", 0}, {"bytes", 0}};
    tot["tensors"] = tot["tensors"].get<uint64_t>() + 1;
    tot["elements"] = tot["elements"].get<uint64_t>() + static_cast<uint64_t>(t.n_elements());
    tot["bytes"] = tot["bytes"].get<uint64_t>() + t.nbytes;
  }
  j["tensors"] = tensors;
  j["totals"] = totals;
  // GGUF strings need not be valid UTF-8: replace bad sequences rather than fail.
  fmt::print("{}\n", j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace));
}

}  // namespace

void register_info(CLI::App& app) {
  struct Opts {
    std::string path;
    bool json = false;
  };
  auto opts = std::make_shared<Opts>();
  CLI::App* sub = app.add_subcommand("info", "Show the header, metadata and tensors of a GGUF file");
  sub->add_option("file", opts->path, "GGUF file")->required();
  sub->add_flag("--json", opts->json, "Print JSON instead of text");
  sub->callback([opts] {
    gguf::File f = gguf::File::open(opts->path);
    if (opts->json) print_json(f);
    else print_text(f);
  });
}

}  // namespace dflash::cli
