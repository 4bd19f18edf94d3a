#include "cli/backend_select.h"

#include <cstdlib>

#include "util/error.h"
#ifdef DFLASH_HAVE_CUDA
#include "ops/cuda/cuda_backend.h"
#endif

namespace dflash::cli {

std::unique_ptr<Backend> make_backend(const std::string& device, int threads) {
  if (device == "cpu") return make_cpu_backend(threads);
  if (device == "cuda" || device.rfind("cuda:", 0) == 0) {
    int index = 0;
    if (device.size() > 5) {
      char* end = nullptr;
      const long v = std::strtol(device.c_str() + 5, &end, 10);
      DFLASH_CHECK(end && *end == '\0' && v >= 0 && v < 1024, "--device {}: expected cuda or cuda:N", device);
      index = static_cast<int>(v);
    }
#ifdef DFLASH_HAVE_CUDA
    const int n = cuda_device_count();
    DFLASH_CHECK(n > 0, "--device {}: no CUDA device found (no NVIDIA driver or GPU on this machine)", device);
    DFLASH_CHECK(index < n, "--device {}: only {} CUDA device(s) (cuda:0..cuda:{})", device, n, n - 1);
    return make_cuda_backend(index);
#else
    (void)index;
    fail("--device {}: this dflash was built without CUDA (nvcc was not found at build time); use --device cpu",
         device);
#endif
  }
  fail("--device '{}': unknown device; use cpu or cuda[:N]", device);
}

}  // namespace dflash::cli
