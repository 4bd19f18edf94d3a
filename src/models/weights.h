// Helpers every model file uses to take tensors out of a GGUF file onto a backend, checking shapes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gguf/gguf.h"
#include "ops/backend.h"

namespace dflash {

class WeightLoader {
 public:
  // Vectors are allocated in `arena` (owned by the model being loaded).
  WeightLoader(const gguf::File& file, BackendArena& arena) : file_(file), backend_(arena.backend()), arena_(arena) {}

  // A matrix with GGUF ne = [in, out]; throws naming the tensor and the expected shape.
  WeightRef matrix(const std::string& name, int64_t in, int64_t out);
  // Same, or an invalid WeightRef when the tensor is absent.
  WeightRef optional_matrix(const std::string& name, int64_t in, int64_t out);
  // A vector/tensor of `n` elements (any shape with that many elements, F32/F16/BF16) as backend f32.
  float* vector(const std::string& name, int64_t n);
  float* optional_vector(const std::string& name, int64_t n);
  // Host copy of a small tensor as f32 (any float type), shape-checked by element count.
  std::vector<float> host_vector(const std::string& name, int64_t n);
  // Checks the exact shape (ne order) of a tensor.
  void expect_shape(const std::string& name, const std::vector<int64_t>& ne);

  const gguf::File& file() const { return file_; }

 private:
  const gguf::File& file_;
  Backend& backend_;
  BackendArena& arena_;
};

}  // namespace dflash
