// hf::ConfigFields and friends (models/hf_config.h), the config.json reading shared by `dflash convert`
// for targets and for DFlash drafters: lookup order over scopes, null as absent, the integer range,
// and the exact error messages users see.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "models/hf_config.h"
#include "util/error.h"

namespace dflash {
namespace {

using json = nlohmann::json;

template <typename F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(HfConfig, ScopesAreSearchedInOrderAndNullMeansAbsent) {
  const json top = {{"a", 1}, {"b", 2}, {"c", nullptr}, {"d", 4}};
  const json dc = {{"a", 10}, {"d", nullptr}};
  const hf::ConfigFields r("cfg", {nullptr, &dc, &top});
  EXPECT_EQ(r.integer("a"), 10);  // the first scope wins
  EXPECT_EQ(r.integer("b"), 2);
  EXPECT_EQ(r.integer("d"), 4);   // null in the first scope: looked up further
  EXPECT_EQ(r.get("c"), nullptr);
  EXPECT_EQ(r.integer_or("c", 7), 7);
  EXPECT_EQ(r.integer_or("zz", 8), 8);
  EXPECT_EQ(r.number_or("b", 0.5), 2.0);
  EXPECT_EQ(r.string_or("zz", "dflt"), "dflt");
  EXPECT_TRUE(r.boolean_or("zz", true));
  EXPECT_EQ(hf::ConfigFields("x", {nullptr}).get("a"), nullptr);
}

TEST(HfConfig, ErrorsNameTheSourceAndTheKey) {
  const json o = {{"s", "x"}, {"i", 1.5}, {"z", 0}, {"big", int64_t{1} << 40}, {"n", -1}, {"b", "yes"}, {"v", 3}};
  const hf::ConfigFields r("config.json text_config", {&o});
  EXPECT_EQ(error_of([&] { r.integer("missing"); }), "config.json text_config: missing 'missing'");
  EXPECT_EQ(error_of([&] { r.integer("s"); }), "config.json text_config: 's' is \"x\", expected an integer");
  EXPECT_EQ(error_of([&] { r.integer("i"); }), "config.json text_config: 'i' is 1.5, expected an integer");
  EXPECT_EQ(error_of([&] { r.integer("z"); }), "config.json text_config: 'z' = 0 is out of range");
  EXPECT_EQ(error_of([&] { r.integer_or("big", 1); }),
            "config.json text_config: 'big' = 1099511627776 is out of range");
  EXPECT_EQ(error_of([&] { r.number_or("s", 1); }), "config.json text_config: 's' is \"x\", expected a number");
  EXPECT_EQ(error_of([&] { r.boolean_or("b", false); }),
            "config.json text_config: 'b' is \"yes\", expected true or false");
  EXPECT_EQ(error_of([&] { r.string_or("v", ""); }), "config.json text_config: 'v' is 3, expected a string");

  // The drafter form: zero allowed, negatives not, and the note on a missing key.
  const hf::ConfigFields d("d/config.json", {&o}, 0, " (in dflash_config or at the top level)");
  EXPECT_EQ(d.integer("z"), 0);
  EXPECT_EQ(error_of([&] { d.integer("n"); }), "d/config.json: 'n' = -1 is out of range");
  EXPECT_EQ(error_of([&] { d.integer("missing"); }),
            "d/config.json: missing 'missing' (in dflash_config or at the top level)");
}

TEST(HfConfig, ArchitecturesAndRopeType) {
  EXPECT_EQ(hf::architectures(json{{"architectures", {"A", 3, "B"}}}), "A,B");
  EXPECT_EQ(hf::architectures(json{{"architectures", "A"}}), "");
  EXPECT_EQ(hf::architectures(json::object()), "");

  EXPECT_EQ(hf::rope_type(nullptr), "default");
  const json s = "yarn", none = json::object(), rt = {{"rope_type", "yarn"}},
             both = {{"rope_type", "linear"}, {"type", "mrope"}}, bad = {{"type", 1}};
  EXPECT_EQ(hf::rope_type(&s), "default");  // not an object
  EXPECT_EQ(hf::rope_type(&none), "default");
  EXPECT_EQ(hf::rope_type(&rt), "yarn");
  EXPECT_EQ(hf::rope_type(&both), "mrope");  // "type" wins over "rope_type"
  EXPECT_EQ(hf::rope_type(&bad), "default");
}

TEST(HfConfig, ReadConfigJsonNamesAMissingFile) {
  EXPECT_EQ(error_of([] { hf::read_config_json("no/such/dir"); }), "no/such/dir: no config.json");
}

}  // namespace
}  // namespace dflash
