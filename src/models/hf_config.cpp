#include "models/hf_config.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "models/safetensors.h"
#include "util/error.h"

namespace dflash::hf {

using json = nlohmann::json;

json read_config_json(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  DFLASH_CHECK(std::filesystem::exists(path), "{}: no config.json", dir);
  return read_json_file(path, 16ull << 20, 16);
}

std::string architectures(const json& top) {
  std::string archs;
  if (auto it = top.find("architectures"); it != top.end() && it->is_array())
    for (const json& a : *it) {
      if (!a.is_string()) continue;
      if (!archs.empty()) archs += ',';
      archs += a.get_ref<const std::string&>();
    }
  return archs;
}

std::string rope_type(const json* params) {
  std::string type = "default";
  if (!params || !params->is_object()) return type;
  for (const char* k : {"rope_type", "type"})  // a later key wins
    if (params->contains(k) && (*params)[k].is_string()) type = (*params)[k].get<std::string>();
  return type;
}

const json* ConfigFields::get(const char* key) const {
  for (const json* s : scopes) {
    if (!s) continue;
    auto it = s->find(key);
    if (it != s->end() && !it->is_null()) return &*it;
  }
  return nullptr;
}

int64_t ConfigFields::integer(const char* key) const {
  const json* v = get(key);
  DFLASH_CHECK(v != nullptr, "{}: missing '{}'{}", where, key, missing_note);
  DFLASH_CHECK(v->is_number_integer(), "{}: '{}' is {}, expected an integer", where, key, v->dump());
  const int64_t x = v->get<int64_t>();
  DFLASH_CHECK(x >= min_integer && x < (int64_t{1} << 40), "{}: '{}' = {} is out of range", where, key, x);
  return x;
}

int64_t ConfigFields::integer_or(const char* key, int64_t def) const { return get(key) ? integer(key) : def; }

double ConfigFields::number_or(const char* key, double def) const {
  const json* v = get(key);
  if (!v) return def;
  DFLASH_CHECK(v->is_number(), "{}: '{}' is {}, expected a number", where, key, v->dump());
  return v->get<double>();
}

bool ConfigFields::boolean_or(const char* key, bool def) const {
  const json* v = get(key);
  if (!v) return def;
  DFLASH_CHECK(v->is_boolean(), "{}: '{}' is {}, expected true or false", where, key, v->dump());
  return v->get<bool>();
}

std::string ConfigFields::string_or(const char* key, std::string def) const {
  const json* v = get(key);
  if (!v) return def;
  DFLASH_CHECK(v->is_string(), "{}: '{}' is {}, expected a string", where, key, v->dump());
  return v->get<std::string>();
}

}  // namespace dflash::hf
