#include "prism/hadamard.h"

#include <cmath>
#include <vector>

#include "util/error.h"

namespace dflash::prism {

void fwht(float* x, int64_t n) {
  DFLASH_CHECK(n > 0 && (n & (n - 1)) == 0, "fwht: length {} is not a power of two", n);
  for (int64_t h = 1; h < n; h *= 2) {
    for (int64_t i = 0; i < n; i += 2 * h) {
      float* a = x + i;
      float* b = x + i + h;
      for (int64_t j = 0; j < h; ++j) {
        const float u = a[j], v = b[j];
        a[j] = u + v;
        b[j] = u - v;
      }
    }
  }
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  for (int64_t i = 0; i < n; ++i) x[i] *= scale;
}

static void check_width(int64_t n, int64_t block) {
  DFLASH_CHECK(block >= 2 && block <= 65536 && (block & (block - 1)) == 0,
               "prism hadamard: block size {} is not a power of two in 2..65536", block);
  DFLASH_CHECK(n > 0 && n % block == 0, "prism hadamard: row length {} is not a multiple of the block size {}", n,
               block);
}

void hadamard_forward_row(const float* x, const float* signs, const int32_t* perm, float* y, int64_t n,
                          int64_t block) {
  check_width(n, block);
  if (perm) {
    // Gather needs the whole source row intact; go through a copy when y aliases x.
    std::vector<float> tmp;
    if (x == y) {
      tmp.assign(x, x + n);
      x = tmp.data();
    }
    for (int64_t i = 0; i < n; ++i) {
      const int32_t j = perm[i];
      DFLASH_CHECK(j >= 0 && j < n, "prism hadamard: perm[{}] = {} outside [0, {})", i, j, n);
      y[i] = signs ? signs[i] * x[j] : x[j];
    }
  } else {
    for (int64_t i = 0; i < n; ++i) y[i] = signs ? signs[i] * x[i] : x[i];
  }
  for (int64_t c = 0; c < n; c += block) fwht(y + c, block);
}

void hadamard_inverse_row(const float* x, const float* signs, float* y, int64_t n, int64_t block) {
  check_width(n, block);
  if (y != x)
    for (int64_t i = 0; i < n; ++i) y[i] = x[i];
  for (int64_t c = 0; c < n; c += block) fwht(y + c, block);
  if (signs)
    for (int64_t i = 0; i < n; ++i) y[i] *= signs[i];
}

}  // namespace dflash::prism
