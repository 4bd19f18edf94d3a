// The reader parses GGUF files written by ggml's own writer (the shared quantization test vectors).
#include <filesystem>

#include "gguf/gguf_test_util.h"

namespace dflash::gguf::test {
namespace {

namespace fs = std::filesystem;
const fs::path kDir = DFLASH_SOURCE_DIR "/../shared/testdata/quants";

TEST(GgufTestVectors, AllFilesParse) {
  const std::vector<std::string> names = {"f16",  "bf16", "q8_0",  "q4_0",  "q4_k",  "q5_k",   "q6_k",
                                          "tq1_0", "tq2_0", "q1_0", "q2_0", "pq2_0", "ptq1_0"};
  int files = 0;
  for (const auto& entry : fs::directory_iterator(kDir))
    if (entry.path().extension() == ".gguf") ++files;
  EXPECT_EQ(files, static_cast<int>(names.size())) << "test vectors in " << kDir;
  for (const auto& name : names) {
    SCOPED_TRACE(name);
    File f = File::open((kDir / (name + ".gguf")).string());
    EXPECT_EQ(f.version(), 3u);
    EXPECT_EQ(f.get_string("test.type_name"), name);
    const auto type = type_from_name(name);
    ASSERT_TRUE(type.has_value());
    const TypeTraits& tr = type_traits(*type);
    EXPECT_EQ(f.get_int("test.ggml_type"), static_cast<int64_t>(tr.type));
    EXPECT_EQ(f.get_int("test.block_elems"), tr.block_elems);
    EXPECT_EQ(f.get_int("test.block_bytes"), tr.block_bytes);
    EXPECT_FALSE(f.get_string("test.reference").empty());
    const bool raw = f.get_bool("test.quant_is_raw_bytes");
    EXPECT_EQ(raw, name == "pq2_0" || name == "ptq1_0");

    ASSERT_EQ(f.tensors().size(), 3u);
    const TensorInfo& in = f.tensor("input");
    const TensorInfo& q = f.tensor("quant");
    const TensorInfo& dq = f.tensor("dequant");
    for (const TensorInfo* t : {&in, &dq}) {
      EXPECT_EQ(t->type, GgmlType::F32);
      EXPECT_EQ(t->shape_string(), "[1024, 20]");
      EXPECT_EQ(f.tensor_data(*t).size(), 1024u * 20u * 4u);
    }
    const size_t qrow = row_bytes(tr.type, 1024);
    if (raw) {
      EXPECT_EQ(q.type, GgmlType::I8);
      EXPECT_EQ(q.ne[0], static_cast<int64_t>(qrow));
    } else {
      EXPECT_EQ(q.type, tr.type);
      EXPECT_EQ(q.ne[0], 1024);
    }
    EXPECT_EQ(q.ne[1], 20);
    EXPECT_EQ(f.tensor_data(q).size(), qrow * 20);
    EXPECT_EQ(f.data_offset() % f.alignment(), 0u);
  }
}

}  // namespace
}  // namespace dflash::gguf::test
