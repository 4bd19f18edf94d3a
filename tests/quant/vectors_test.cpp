// The shared quantization test vectors (testdata/quants, written by ggml's own reference code):
// our quantize_row must reproduce `quant` byte for byte and our dequantize_row must reproduce
// `dequant` bit for bit, row by row, for every type of SPEC 1.1 and every ISA we build.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "gguf/gguf.h"
#include "quant/kernels.h"
#include "quant/types.h"

namespace dflash {
namespace {

using quant_detail::Isa;

struct VectorFile {
  gguf::File file;
  const gguf::TensorInfo* input;
  const gguf::TensorInfo* quant;
  const gguf::TensorInfo* dequant;
};

std::string vector_path(const std::string& name) {
  return std::string(DFLASH_SOURCE_DIR) + "/../shared/testdata/quants/" + name + ".gguf";
}

class QuantVectors : public ::testing::TestWithParam<GgmlType> {};

TEST_P(QuantVectors, QuantizeAndDequantizeAreBitExact) {
  const GgmlType type = GetParam();
  const TypeTraits& tt = type_traits(type);
  gguf::File f = gguf::File::open(vector_path(tt.name));
  ASSERT_EQ(f.get_int("test.ggml_type"), static_cast<int64_t>(type));
  ASSERT_EQ(f.get_int("test.block_elems"), tt.block_elems);
  ASSERT_EQ(f.get_int("test.block_bytes"), tt.block_bytes);

  const gguf::TensorInfo& input = f.tensor("input");
  const gguf::TensorInfo& quant = f.tensor("quant");
  const gguf::TensorInfo& dequant = f.tensor("dequant");
  ASSERT_EQ(input.type, GgmlType::F32);
  ASSERT_EQ(dequant.type, GgmlType::F32);
  const int64_t n = input.ne[0], rows = input.n_rows();
  ASSERT_EQ(n, 1024);
  ASSERT_EQ(rows, 20);
  const size_t rb = row_bytes(type, n);
  const bool raw = f.get_bool_or("test.quant_is_raw_bytes", false);
  if (raw) {
    ASSERT_EQ(quant.type, GgmlType::I8);
    ASSERT_EQ(quant.ne[0], static_cast<int64_t>(rb));
  } else {
    ASSERT_EQ(quant.type, type);
    ASSERT_EQ(quant.ne[0], n);
  }
  ASSERT_EQ(quant.n_rows(), rows);

  const float* in = reinterpret_cast<const float*>(f.tensor_data(input).data());
  const uint8_t* q = f.tensor_data(quant).data();
  const float* dq = reinterpret_cast<const float*>(f.tensor_data(dequant).data());

  std::vector<uint8_t> ours(rb);
  std::vector<float> back(static_cast<size_t>(n));
  int quant_bad = 0, dequant_bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    quantize_row(type, in + r * n, ours.data(), n);
    const uint8_t* want = q + r * rb;
    if (std::memcmp(ours.data(), want, rb) != 0) {
      ++quant_bad;
      size_t at = 0;
      while (ours[at] == want[at]) ++at;
      ADD_FAILURE() << tt.name << " quantize row " << r << ": first differing byte " << at << " (block "
                    << at / tt.block_bytes << ", offset " << at % tt.block_bytes << "): ours "
                    << int(ours[at]) << " want " << int(want[at]);
    }
    for (Isa isa : {Isa::Scalar, Isa::Avx2}) {
      if (isa == Isa::Avx2 && !quant_detail::avx2_available()) continue;
      quant_detail::dequantize_row_isa(isa, type, want, back.data(), n);
      if (std::memcmp(back.data(), dq + r * n, static_cast<size_t>(n) * 4) != 0) {
        ++dequant_bad;
        int64_t at = 0;
        while (std::memcmp(&back[at], dq + r * n + at, 4) == 0) ++at;
        ADD_FAILURE() << tt.name << (isa == Isa::Avx2 ? " avx2" : " scalar") << " dequantize row " << r
                      << ": first differing element " << at << ": ours " << back[at] << " want " << dq[r * n + at];
      }
    }
  }
  EXPECT_EQ(quant_bad, 0) << tt.name << ": rows whose quantization differs";
  EXPECT_EQ(dequant_bad, 0) << tt.name << ": rows whose dequantization differs";
}

INSTANTIATE_TEST_SUITE_P(AllTypes, QuantVectors,
                         ::testing::Values(GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0,
                                           GgmlType::Q4_0, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K,
                                           GgmlType::TQ1_0, GgmlType::TQ2_0, GgmlType::Q1_0, GgmlType::Q2_0,
                                           GgmlType::PQ2_0, GgmlType::PTQ1_0),
                         [](const ::testing::TestParamInfo<GgmlType>& info) {
                           return std::string(type_name(info.param));
                         });

}  // namespace
}  // namespace dflash
