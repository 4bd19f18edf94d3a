// Prefill matmul (Backend::matmul_prefill): many activation rows against one weight. Not yet a
// tensor-core kernel: every call falls back to the GEMV tiles of matmul.cu.
#include "ops/cuda/kernels.h"

namespace dflash::cuda {

bool launch_matmul_prefill(const DevWeight&, const float*, float*, int64_t, cudaStream_t) { return false; }

}  // namespace dflash::cuda
