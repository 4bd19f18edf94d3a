// Writer -> reader round trips: every value type, nested arrays, alignments, many tensors, version 2,
// lazy and row-chunked tensors, the mmap path, and the typed getters.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>

#include "gguf/gguf_test_util.h"

namespace dflash::gguf::test {
namespace {

Writer all_types_writer(uint32_t version = 3, uint32_t alignment = kDefaultAlignment) {
  Writer w(version, alignment);
  w.set("t.u8", Value::u8(255));
  w.set("t.i8", Value::i8(-128));
  w.set("t.u16", Value::u16(65535));
  w.set("t.i16", Value::i16(-32768));
  w.set("t.u32", Value::u32(4294967295u));
  w.set("t.i32", Value::i32(std::numeric_limits<int32_t>::min()));
  w.set("t.u64", Value::u64(std::numeric_limits<uint64_t>::max()));
  w.set("t.i64", Value::i64(std::numeric_limits<int64_t>::min()));
  w.set("t.f32", Value::f32(3.14159274f));
  w.set("t.f64", Value::f64(2.718281828459045));
  w.set("t.true", Value::boolean(true));
  w.set("t.false", Value::boolean(false));
  w.set("t.string", Value::string(std::string("h\xc3\xa9llo\0world", 12)));
  w.set("t.empty", Value::string(""));
  w.set("t.arr.u8", Value::array(ValueType::U8, {Value::u8(1), Value::u8(2), Value::u8(255)}));
  w.set("t.arr.i8", Value::array(ValueType::I8, {Value::i8(-1), Value::i8(127)}));
  w.set("t.arr.u16", Value::array(ValueType::U16, {Value::u16(7)}));
  w.set("t.arr.i16", Value::array(ValueType::I16, {Value::i16(-7), Value::i16(9)}));
  w.set("t.arr.u32", Value::array(ValueType::U32, {Value::u32(1u << 31)}));
  w.set("t.arr.i32", Value::i32_array({-5, 0, 5, 1 << 30}));
  w.set("t.arr.u64", Value::array(ValueType::U64, {Value::u64(1ull << 63)}));
  w.set("t.arr.i64", Value::array(ValueType::I64, {Value::i64(-(1ll << 62))}));
  w.set("t.arr.f32", Value::f32_array({0.5f, -1.25f, 1e-30f}));
  w.set("t.arr.f64", Value::array(ValueType::F64, {Value::f64(1e300), Value::f64(-0.0)}));
  w.set("t.arr.bool", Value::array(ValueType::BOOL, {Value::boolean(true), Value::boolean(false)}));
  w.set("t.arr.string", Value::string_array({"a", "", "ccc"}));
  w.set("t.arr.empty", Value::array(ValueType::F32, {}));
  // Nested: array<array<array<i32>>> and array<array<string>> with an empty inner array.
  w.set("t.arr.nested",
        Value::array(ValueType::ARRAY, {Value::array(ValueType::ARRAY, {Value::i32_array({1, 2}), Value::i32_array({})}),
                                        Value::array(ValueType::ARRAY, {Value::i32_array({3})})}));
  w.set("t.arr.nested_str", Value::array(ValueType::ARRAY, {Value::string_array({"x", "y"}), Value::string_array({})}));
  return w;
}

void expect_same_value(const Value& a, const Value& b, const std::string& key) {
  ASSERT_EQ(a.type, b.type) << key;
  if (a.type == ValueType::ARRAY) {
    const Array& x = std::get<Array>(a.data);
    const Array& y = std::get<Array>(b.data);
    ASSERT_EQ(x.elem_type, y.elem_type) << key;
    ASSERT_EQ(x.items.size(), y.items.size()) << key;
    for (size_t i = 0; i < x.items.size(); ++i) expect_same_value(x.items[i], y.items[i], key + "[" + std::to_string(i) + "]");
    return;
  }
  if (a.is_float()) {
    double p = std::get<double>(a.data), q = std::get<double>(b.data);
    EXPECT_EQ(std::memcmp(&p, &q, sizeof p), 0) << key << ": " << p << " vs " << q;
    return;
  }
  EXPECT_TRUE(a.data == b.data) << key;
}

TEST(GgufRoundTrip, EveryValueType) {
  Writer w = all_types_writer();
  File f = File::from_bytes(w.to_bytes());
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_TRUE(f.tensors().empty());
  Writer ref = all_types_writer();
  File g = File::from_bytes(ref.to_bytes());
  ASSERT_EQ(f.metadata().size(), 29u);
  for (size_t i = 0; i < f.metadata().size(); ++i) {
    EXPECT_EQ(f.metadata()[i].key, g.metadata()[i].key);
    expect_same_value(f.metadata()[i].value, g.metadata()[i].value, f.metadata()[i].key);
  }
  EXPECT_EQ(f.get_uint("t.u8"), 255u);
  EXPECT_EQ(f.get_int("t.i8"), -128);
  EXPECT_EQ(f.get_int("t.u16"), 65535);
  EXPECT_EQ(f.get_int("t.i16"), -32768);
  EXPECT_EQ(f.get_uint("t.u32"), 4294967295u);
  EXPECT_EQ(f.get_int("t.i32"), std::numeric_limits<int32_t>::min());
  EXPECT_EQ(f.get_uint("t.u64"), std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(f.get_int("t.i64"), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(static_cast<float>(f.get_float("t.f32")), 3.14159274f);
  EXPECT_EQ(f.get_float("t.f64"), 2.718281828459045);
  EXPECT_TRUE(f.get_bool("t.true"));
  EXPECT_FALSE(f.get_bool("t.false"));
  EXPECT_EQ(f.get_string("t.string"), std::string("h\xc3\xa9llo\0world", 12));
  EXPECT_EQ(f.get_string("t.empty"), "");
  EXPECT_EQ(f.get_int_array("t.arr.u8"), (std::vector<int64_t>{1, 2, 255}));
  EXPECT_EQ(f.get_int_array("t.arr.i8"), (std::vector<int64_t>{-1, 127}));
  EXPECT_EQ(f.get_int_array("t.arr.i32"), (std::vector<int64_t>{-5, 0, 5, 1 << 30}));
  EXPECT_EQ(f.get_float_array("t.arr.f32"), (std::vector<double>{0.5, -1.25, double(1e-30f)}));
  EXPECT_EQ(f.get_float_array("t.arr.i16"), (std::vector<double>{-7, 9}));
  EXPECT_EQ(f.get_string_array("t.arr.string"), (std::vector<std::string>{"a", "", "ccc"}));
  EXPECT_TRUE(f.get_float_array("t.arr.empty").empty());
  const Array& nested = std::get<Array>(f.find("t.arr.nested")->data);
  ASSERT_EQ(nested.items.size(), 2u);
  const Array& inner = std::get<Array>(nested.items[0].data);
  EXPECT_EQ(inner.elem_type, ValueType::ARRAY);
  EXPECT_EQ(std::get<Array>(inner.items[0].data).items.size(), 2u);
  EXPECT_EQ(std::get<int64_t>(std::get<Array>(inner.items[0].data).items[1].data), 2);
}

TEST(GgufRoundTrip, WriterIsDeterministicAndReencodes) {
  // Reading then writing the metadata again gives the same bytes.
  Bytes a = all_types_writer().to_bytes();
  File f = File::from_bytes(a);
  Writer w;
  for (const auto& kv : f.metadata()) w.set(kv.key, kv.value);
  EXPECT_EQ(w.to_bytes(), a);
}

TEST(GgufRoundTrip, Getters) {
  Writer w;
  w.set("big", Value::u64(1ull << 63));
  w.set("neg", Value::i32(-3));
  w.set("s", Value::string("x"));
  w.set("flag", Value::boolean(true));
  w.set("f", Value::f32(1.5f));
  w.set("mixed", Value::string_array({"a"}));
  File f = File::from_bytes(w.to_bytes(), "g.gguf");
  auto msg = [&](auto fn) -> std::string {
    try {
      fn();
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  std::string m = msg([&] { f.get_int("big"); });
  EXPECT_NE(m.find("out of range"), std::string::npos) << m;
  EXPECT_NE(m.find("'big'"), std::string::npos) << m;
  EXPECT_EQ(f.get_uint("big"), 1ull << 63);
  m = msg([&] { f.get_uint("neg"); });
  EXPECT_NE(m.find("non-negative"), std::string::npos) << m;
  EXPECT_EQ(f.get_int("flag"), 1);
  EXPECT_EQ(f.get_float("neg"), -3.0);
  m = msg([&] { f.get_int("s"); });
  EXPECT_NE(m.find("g.gguf: key 's': expected an integer, got string"), std::string::npos) << m;
  m = msg([&] { f.get_string("neg"); });
  EXPECT_NE(m.find("key 'neg': expected string, got i32"), std::string::npos) << m;
  m = msg([&] { f.get_bool("f"); });
  EXPECT_NE(m.find("expected bool, got f32"), std::string::npos) << m;
  m = msg([&] { f.get_int_array("mixed"); });
  EXPECT_NE(m.find("got array<string>[1]"), std::string::npos) << m;
  m = msg([&] { f.get_string_array("s"); });
  EXPECT_NE(m.find("expected array<string>, got string"), std::string::npos) << m;
  m = msg([&] { f.get_string("absent"); });
  EXPECT_NE(m.find("key 'absent' not found"), std::string::npos) << m;
  EXPECT_EQ(f.get_int_or("absent", 7), 7);
  EXPECT_EQ(f.get_string_or("absent", "d"), "d");
  EXPECT_EQ(f.get_float_or("absent", 2.5), 2.5);
  EXPECT_TRUE(f.get_bool_or("absent", true));
  EXPECT_THROW(f.get_int_or("s", 7), Error);  // present with the wrong type still throws
  EXPECT_THROW(f.get_float("s"), Error);
  EXPECT_FALSE(f.has("absent"));
  EXPECT_TRUE(f.has("s"));
  m = msg([&] { f.tensor("nope"); });
  EXPECT_NE(m.find("tensor 'nope' not found"), std::string::npos) << m;
}

struct TensorSpec {
  std::string name;
  GgmlType type;
  std::vector<int64_t> ne;
};

size_t spec_bytes(const TensorSpec& s) {
  size_t rows = 1;
  for (size_t d = 1; d < s.ne.size(); ++d) rows *= static_cast<size_t>(s.ne[d]);
  return row_bytes(s.type, s.ne[0]) * rows;
}

void check_tensors(uint32_t version, uint32_t alignment) {
  std::vector<TensorSpec> specs = {
      {"a.weight", GgmlType::F32, {3, 5}},
      {"b", GgmlType::Q8_0, {64, 2, 3}},
      {"c", GgmlType::F16, {7}},
      {"d", GgmlType::Q4_K, {256, 1, 1, 2}},
      {"e", GgmlType::PTQ1_0, {128, 3}},
      {"f", GgmlType::I8, {5}},
      {"empty", GgmlType::F32, {0, 4}},
  };
  Writer w(version, alignment);
  w.set("general.name", Value::string("t"));
  std::vector<std::vector<uint8_t>> data;
  for (size_t i = 0; i < specs.size(); ++i) {
    data.push_back(pattern(spec_bytes(specs[i]), static_cast<uint32_t>(i)));
    w.add_tensor(specs[i].name, specs[i].type, specs[i].ne, data.back());
  }
  File f = File::from_bytes(w.to_bytes());
  EXPECT_EQ(f.version(), version);
  EXPECT_EQ(f.alignment(), alignment);
  EXPECT_EQ(f.data_offset() % alignment, 0u);
  if (alignment != kDefaultAlignment) EXPECT_EQ(f.get_uint("general.alignment"), alignment);
  else EXPECT_FALSE(f.has("general.alignment"));
  ASSERT_EQ(f.tensors().size(), specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorInfo& t = f.tensors()[i];
    EXPECT_EQ(&f.tensor(specs[i].name), &t);
    EXPECT_EQ(t.name, specs[i].name);
    EXPECT_EQ(t.type, specs[i].type);
    EXPECT_EQ(t.n_dims, specs[i].ne.size());
    for (size_t d = 0; d < 4; ++d) EXPECT_EQ(t.ne[d], d < specs[i].ne.size() ? specs[i].ne[d] : 1);
    EXPECT_EQ(t.offset % alignment, 0u);
    EXPECT_EQ(t.nbytes, data[i].size());
    auto span = f.tensor_data(t);
    ASSERT_EQ(span.size(), data[i].size());
    EXPECT_TRUE(std::equal(span.begin(), span.end(), data[i].begin())) << t.name;
  }
  EXPECT_EQ(f.tensors()[0].shape_string(), "[3, 5]");
  EXPECT_EQ(f.tensors()[0].n_elements(), 15);
  EXPECT_EQ(f.tensors()[1].n_rows(), 6);
}

TEST(GgufRoundTrip, Alignment1) { check_tensors(3, 1); }
TEST(GgufRoundTrip, Alignment32) { check_tensors(3, 32); }
TEST(GgufRoundTrip, Alignment64) { check_tensors(3, 64); }
TEST(GgufRoundTrip, Alignment4096) { check_tensors(3, 4096); }
TEST(GgufRoundTrip, Version2) { check_tensors(2, 32); }

TEST(GgufRoundTrip, AlignmentFromSetKey) {
  Writer w;
  w.set("general.alignment", Value::u32(128));
  EXPECT_EQ(w.alignment(), 128u);
  w.add_tensor("x", GgmlType::F32, {3}, pattern(12, 1));
  w.add_tensor("y", GgmlType::F32, {1}, pattern(4, 2));
  File f = File::from_bytes(w.to_bytes());
  EXPECT_EQ(f.alignment(), 128u);
  EXPECT_EQ(f.tensor("y").offset, 128u);
  EXPECT_EQ(f.data_offset() % 128, 0u);
}

TEST(GgufRoundTrip, ManyTensors) {
  Writer w(3, 64);
  const int n = 1000;
  for (int i = 0; i < n; ++i)
    w.add_tensor("blk." + std::to_string(i) + ".w", GgmlType::F32, {i % 7 + 1, 2}, pattern(size_t(i % 7 + 1) * 8, i));
  File f = File::from_bytes(w.to_bytes());
  ASSERT_EQ(f.tensors().size(), size_t(n));
  for (int i = 0; i < n; i += 37) {
    const TensorInfo& t = f.tensor("blk." + std::to_string(i) + ".w");
    auto d = f.tensor_data(t);
    auto want = pattern(size_t(i % 7 + 1) * 8, i);
    EXPECT_TRUE(std::equal(d.begin(), d.end(), want.begin(), want.end())) << i;
  }
}

TEST(GgufRoundTrip, LazyAndRowChunkedTensorsMatchEager) {
  // 10 rows of Q8_0[64] = 68 bytes each; chunks of 150 bytes -> 2 rows per chunk.
  const auto bytes = pattern(680, 9);
  Writer eager, lazy;
  eager.add_tensor("q", GgmlType::Q8_0, {64, 10}, bytes);
  eager.add_tensor("r", GgmlType::Q8_0, {64, 10}, bytes);
  lazy.add_tensor_lazy("q", GgmlType::Q8_0, {64, 10}, [&](uint8_t* dst, size_t n) {
    ASSERT_EQ(n, bytes.size());
    std::memcpy(dst, bytes.data(), n);
  });
  std::vector<std::pair<int64_t, int64_t>> calls;
  lazy.add_tensor_rows(
      "r", GgmlType::Q8_0, {64, 10},
      [&](int64_t r0, int64_t n, uint8_t* dst) {
        calls.emplace_back(r0, n);
        std::memcpy(dst, bytes.data() + r0 * 68, size_t(n) * 68);
      },
      150);
  EXPECT_EQ(lazy.to_bytes(), eager.to_bytes());
  EXPECT_EQ(calls, (std::vector<std::pair<int64_t, int64_t>>{{0, 2}, {2, 2}, {4, 2}, {6, 2}, {8, 2}}));
}

TEST(GgufRoundTrip, WriteAndMmap) {
  namespace fs = std::filesystem;
  const fs::path path = fs::temp_directory_path() / ("dflash_gguf_rt_" + std::to_string(::getpid()) + ".gguf");
  Writer w(3, 64);
  w.set("general.architecture", Value::string("test"));
  const auto data = pattern(4 * 1000 * 3, 4);
  w.add_tensor_rows("big", GgmlType::F32, {1000, 3}, [&](int64_t r0, int64_t n, uint8_t* dst) {
    std::memcpy(dst, data.data() + r0 * 4000, size_t(n) * 4000);
  }, 4000);
  w.write(path.string());
  EXPECT_FALSE(fs::exists(path.string() + ".tmp"));
  {
    File f = File::open(path.string());
    EXPECT_EQ(f.path(), path.string());
    EXPECT_EQ(f.file_size(), fs::file_size(path));
    EXPECT_EQ(f.get_string("general.architecture"), "test");
    auto d = f.tensor_data(f.tensor("big"));
    EXPECT_TRUE(std::equal(d.begin(), d.end(), data.begin(), data.end()));
    File moved = std::move(f);
    EXPECT_EQ(moved.tensor("big").nbytes, data.size());
  }
  fs::remove(path);
  try {
    File::open(path.string());
    ADD_FAILURE() << "opening a missing file did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot open"), std::string::npos) << e.what();
  }
}

TEST(GgufRoundTrip, EmptyFile) {
  Writer w(2);
  Bytes b = w.to_bytes();
  EXPECT_EQ(b.size(), 32u);  // 24-byte header padded to the alignment
  File f = File::from_bytes(b);
  EXPECT_TRUE(f.metadata().empty());
  EXPECT_TRUE(f.tensors().empty());
  b.resize(24);  // no padding after the header is fine without tensors
  EXPECT_NO_THROW(File::from_bytes(b));
}

TEST(GgufRoundTrip, WriterRejectsBadInput) {
  EXPECT_THROW(Writer(1), Error);
  EXPECT_THROW(Writer(3, 3), Error);
  EXPECT_THROW(Writer(3, 0), Error);
  Writer w;
  EXPECT_THROW(w.add_tensor("x", GgmlType::F32, {4}, pattern(15, 0)), Error);  // wrong size
  EXPECT_EQ(w.n_tensors(), 0u);
  w.add_tensor("x", GgmlType::F32, {4}, pattern(16, 0));
  EXPECT_THROW(w.add_tensor("x", GgmlType::F32, {4}, pattern(16, 0)), Error);  // duplicate
  EXPECT_THROW(w.add_tensor("q", GgmlType::Q8_0, {33}, pattern(34, 0)), Error); // not a block multiple
  EXPECT_THROW(w.add_tensor("z", GgmlType::F32, {}, {}), Error);
  EXPECT_THROW(w.add_tensor("z", GgmlType::F32, {1, 1, 1, 1, 1}, pattern(4, 0)), Error);
  EXPECT_THROW(w.add_tensor("z", GgmlType::F32, {-1}, {}), Error);
  w.set("bad", Value::array(ValueType::I32, {Value::u8(1)}));
  EXPECT_THROW(w.to_bytes(), Error);
}

TEST(GgufRoundTrip, FormatValue) {
  EXPECT_EQ(format_value(Value::u32(5)), "5");
  EXPECT_EQ(format_value(Value::i8(-5)), "-5");
  EXPECT_EQ(format_value(Value::boolean(true)), "true");
  EXPECT_EQ(format_value(Value::f32(0.5f)), "0.5");
  EXPECT_EQ(format_value(Value::string("a\"b\n")), "\"a\\\"b\\n\"");
  EXPECT_EQ(format_value(Value::string(std::string(100, 'x')), 8, 4), "\"xxxx\"... (100 bytes)");
  EXPECT_EQ(format_value(Value::i32_array({1, 2, 3}), 2), "[1, 2, ... (3 items)]");
  EXPECT_EQ(Value::i32_array({1, 2, 3}).type_string(), "array<i32>[3]");
}

}  // namespace
}  // namespace dflash::gguf::test
