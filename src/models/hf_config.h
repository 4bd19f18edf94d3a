// Typed reads of a Hugging Face config.json, shared by `dflash convert` for targets (convert.cpp) and
// for DFlash drafters (convert_dflash.cpp). Errors name the file (or section) and the key, and say
// what was expected: "config.json text_config: 'hidden_size' is "4096", expected an integer".
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <utility>
#include <vector>

namespace dflash::hf {

// <dir>/config.json as one JSON object (at most 16 MiB, nesting depth 16). Errors: "<dir>: no config.json".
nlohmann::json read_config_json(const std::string& dir);

// The config's "architectures" list joined by commas ("Qwen3ForCausalLM,Other"); "" when absent.
std::string architectures(const nlohmann::json& top);

// The RoPE type a rope_parameters / rope_scaling object names: its "type", else its "rope_type"; "default"
// when `params` is null, not an object, or names none.
std::string rope_type(const nlohmann::json* params);

// Typed fields of a config. A key is looked up in each scope in turn (a drafter's dflash_config, then
// the top level); a missing key, a null value and a null scope all count as absent.
struct ConfigFields {
  ConfigFields(std::string where, std::vector<const nlohmann::json*> scopes, int64_t min_integer = 1,
               std::string missing_note = "")
      : where(std::move(where)),
        scopes(std::move(scopes)),
        min_integer(min_integer),
        missing_note(std::move(missing_note)) {}

  std::string where;                          // names the source in errors: "config.json", a path, ...
  std::vector<const nlohmann::json*> scopes;  // searched in order; the objects must outlive this view
  int64_t min_integer;                        // integer() accepts min_integer .. 2^40 - 1
  std::string missing_note;                   // appended to "missing 'key'", e.g. where it was looked for

  // The value of `key` in the first scope that has it non-null; nullptr when none does.
  const nlohmann::json* get(const char* key) const;
  // A required integer in range; errors name missing, non-integer and out-of-range values.
  int64_t integer(const char* key) const;
  // The optional forms: `def` when the key is absent, an error when it is present with the wrong type.
  int64_t integer_or(const char* key, int64_t def) const;
  double number_or(const char* key, double def) const;
  bool boolean_or(const char* key, bool def) const;
  std::string string_or(const char* key, std::string def) const;
};

}  // namespace dflash::hf
