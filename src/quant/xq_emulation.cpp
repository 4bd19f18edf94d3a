#include "quant/xq_emulation.h"

#include <cmath>
#include <cstdlib>

#include "util/error.h"

namespace dflash {

void round_to_xq_planes(const float* x, float* out, int64_t n, int planes) {
  DFLASH_CHECK(planes >= 1 && planes <= 3, "round_to_xq_planes: {} planes (1, 2 or 3)", planes);
  DFLASH_CHECK(n % 128 == 0, "round_to_xq_planes: {} values are not whole blocks of 128", n);
  // 1 plane (a what-if): the block's largest |x| scaled into [64, 128), u clamped to a signed byte
  const int shift = planes == 1 ? 1 : 8 * (planes - 1);
  for (int64_t b = 0; b < n; b += 128) {
    float amax = 0.0f;
    for (int i = 0; i < 128; ++i) amax = std::fmax(amax, std::fabs(x[b + i]));
    if (!(amax > 0.0f) || !std::isfinite(amax)) {  // as the CUDA record: nothing to scale
      for (int i = 0; i < 128; ++i) out[b + i] = x[b + i];
      continue;
    }
    int ex = 0;
    std::frexp(amax, &ex);  // amax = f 2^ex, f in [0.5, 1)
    const int E = ex - 6;
    for (int i = 0; i < 128; ++i) {
      float u = std::nearbyint(std::ldexp(x[b + i], shift - E));  // round half to even, as __float2int_rn
      if (planes == 1) u = std::fmin(std::fmax(u, -127.0f), 127.0f);
      out[b + i] = std::ldexp(u, E - shift);
    }
  }
}

int cpu_xq_planes_from_env() {
  const char* env = std::getenv("DFLASH_CPU_XQ_PLANES");
  if (env == nullptr) return 0;
  const int p = std::atoi(env);
  return p >= 1 && p <= 3 ? p : 0;
}

}  // namespace dflash
