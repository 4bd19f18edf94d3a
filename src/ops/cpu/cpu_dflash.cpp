// CPU backend: the DFlash 2 drafter's grouped dynamic causal conv and the selector walk (SPEC 4.2).
//
// The conv mixes each channel with the previous block row through a kernel that is a learned base
// plus a per-row, per-group dynamic part (projected from the normed input). K = 2 taps in every
// published drafter; any K works here.
#include <algorithm>
#include <vector>

#include "ops/cpu/cpu_backend.h"
#include "util/error.h"

namespace dflash::cpu {

// y[t][c] = sum_{o<K} (base[o*C + c] + d[t*d_stride + o*G + c/group]) * x[t-o][c]  (+ res[t][c])
// Parallel over rows; each element accumulates o = 0..K-1 in order, then the residual, so the
// result does not depend on the split. Row t reads x rows t-K+1..t only (never y), so y may be
// written while other rows are in flight; res is read at the element being written (y may alias it).
void CpuBackend::dflash_conv(const float* x, const float* base, const float* d, int64_t d_stride, const float* res,
                             float* y, int64_t M, int64_t C, int64_t K, int64_t group) {
  DFLASH_CHECK(K >= 1 && group >= 1 && C % group == 0, "cpu dflash_conv: C {} not a multiple of group {} (K {})", C,
               group, K);
  DFLASH_CHECK(x != y, "cpu dflash_conv: x must not alias y");
  const int64_t G = C / group;
  DFLASH_CHECK(d_stride >= K * G, "cpu dflash_conv: coefficient row stride {} < K*G = {}", d_stride, K * G);
  if (M <= 0) return;
  pool_.parallel_for(M, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* dt = d + t * d_stride;
      float* yt = y + t * C;
      const float* rt = res ? res + t * C : nullptr;
      for (int64_t c = 0; c < C; ++c) {
        const int64_t g = c / group;
        float acc = 0.0f;
        for (int64_t o = 0; o < K && o <= t; ++o) acc += (base[o * C + c] + dt[o * G + g]) * x[(t - o) * C + c];
        yt[c] = rt ? acc + rt[c] : acc;
      }
    }
  });
}

// One thread: rows * top_k dot products of `rank`, a few microseconds for the 27B drafter. The
// arithmetic is selector_walk()'s (models/dflash_drafter.h) exactly: pg[r] = pred[r] * g[r], then
// e += pg[r] * succ[r] from 0.0f in order (this file is built with -ffp-contract=off), S = unary + e.
void CpuBackend::selector_walk(const float* pred, const float* succ, const int32_t* cand, const float* unary,
                               const float* g, int32_t* out, int64_t rows, int64_t top_k, int64_t rank) {
  DFLASH_CHECK(rows >= 1 && top_k >= 1 && rank >= 1, "cpu selector_walk: rows {}, top_k {}, rank {}", rows, top_k,
               rank);
  std::vector<float> pg(static_cast<size_t>(rank));
  const float* prev = pred;  // the anchor's row
  for (int64_t p = 0; p < rows; ++p) {
    for (int64_t r = 0; r < rank; ++r) pg[r] = prev[r] * g[p * rank + r];
    int64_t best = 0;
    float best_score = 0.0f;
    for (int64_t k = 0; k < top_k; ++k) {
      const float* s = succ + (p * top_k + k) * rank;
      float e = 0.0f;
      for (int64_t r = 0; r < rank; ++r) e += pg[r] * s[r];
      const float score = unary[p * top_k + k] + e;
      if (k == 0 || score > best_score) {
        best = k;
        best_score = score;
      }
    }
    out[p] = cand[p * top_k + best];
    prev = pred + (1 + p * top_k + best) * rank;  // read only while p + 1 < rows
  }
}

}  // namespace dflash::cpu
