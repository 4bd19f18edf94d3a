#include "models/weights.h"

#include "util/error.h"

namespace dflash {
namespace {

std::string shape_of(const std::vector<int64_t>& ne) {
  std::string s = "[";
  for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "]";
}

}  // namespace

void WeightLoader::expect_shape(const std::string& name, const std::vector<int64_t>& ne) {
  const gguf::TensorInfo& t = file_.tensor(name);
  bool ok = t.n_dims == ne.size();
  for (size_t i = 0; ok && i < ne.size(); ++i) ok = t.ne[i] == ne[i];
  DFLASH_CHECK(ok, "{}: tensor '{}' has shape {}, expected {}", file_.path(), name, t.shape_string(), shape_of(ne));
}

WeightRef WeightLoader::matrix(const std::string& name, int64_t in, int64_t out) {
  DFLASH_CHECK(file_.find_tensor(name) != nullptr, "{}: required tensor '{}' (shape [{}, {}]) is missing",
               file_.path(), name, in, out);
  const gguf::TensorInfo& t = file_.tensor(name);
  const bool ok = (t.n_dims == 2 && t.ne[0] == in && t.ne[1] == out) || (t.n_dims == 1 && out == 1 && t.ne[0] == in);
  DFLASH_CHECK(ok, "{}: tensor '{}' has shape {}, expected [{}, {}]", file_.path(), name, t.shape_string(), in, out);
  DFLASH_CHECK(type_traits(t.type).has_codec, "{}: tensor '{}' has type {}, which dflash cannot compute with",
               file_.path(), name, type_name(t.type));
  return backend_.upload_weight(file_.tensor_data(t).data(), t.type, in, out);
}

WeightRef WeightLoader::optional_matrix(const std::string& name, int64_t in, int64_t out) {
  if (!file_.find_tensor(name)) return {};
  return matrix(name, in, out);
}

std::vector<float> WeightLoader::host_vector(const std::string& name, int64_t n) {
  DFLASH_CHECK(file_.find_tensor(name) != nullptr, "{}: required tensor '{}' ({} elements) is missing", file_.path(),
               name, n);
  const gguf::TensorInfo& t = file_.tensor(name);
  DFLASH_CHECK(t.n_elements() == n, "{}: tensor '{}' has shape {} ({} elements), expected {} elements", file_.path(),
               name, t.shape_string(), t.n_elements(), n);
  DFLASH_CHECK(t.type == GgmlType::F32 || t.type == GgmlType::F16 || t.type == GgmlType::BF16,
               "{}: tensor '{}' has type {}, expected f32, f16 or bf16", file_.path(), name, type_name(t.type));
  std::vector<float> host(static_cast<size_t>(n));
  dequantize_row(t.type, file_.tensor_data(t).data(), host.data(), n);
  return host;
}

float* WeightLoader::vector(const std::string& name, int64_t n) {
  std::vector<float> host = host_vector(name, n);
  float* dev = arena_.alloc_array<float>(host.size());
  backend_.upload(dev, host.data(), host.size() * sizeof(float));
  return dev;
}

float* WeightLoader::optional_vector(const std::string& name, int64_t n) {
  if (!file_.find_tensor(name)) return nullptr;
  return vector(name, n);
}

}  // namespace dflash
