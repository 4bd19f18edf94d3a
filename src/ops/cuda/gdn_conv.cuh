// GDN's causal depthwise conv (Backend::gdn_conv) for decode and verify rows, as device functions: the
// conv kernel (norm.cu) and the launch that runs it beside GDN's alpha | beta projections (matmul.cu,
// Backend::gdn_conv_and_matmuls) share them, so both give the same bits.
#pragma once

#include "ops/cuda/common.cuh"

namespace dflash::cuda {

// One thread per channel, rows in order; the last K-1 inputs in a register window (K <= kMaxK).
constexpr int kMaxK = 16;

// One row of a channel: silu(sum_{j<H} w[j] * win[j] + w[H] * xin) in that order, then the window
// moves on by xin. Both conv kernels use it, so they give the same bits.
__device__ __forceinline__ float conv_step(float (&win)[kMaxK], const float (&wc)[kMaxK], int H, float xin) {
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < kMaxK; ++j)
    if (j < H) acc += wc[j] * win[j];
  float wl = 0.0f;
#pragma unroll
  for (int j = 0; j < kMaxK; ++j)
    if (j == H) wl = wc[j];
  acc += wl * xin;
#pragma unroll
  for (int j = 0; j + 1 < kMaxK; ++j)
    if (j + 1 < H) win[j] = win[j + 1];
#pragma unroll
  for (int j = 0; j < kMaxK; ++j)
    if (j == H - 1) win[j] = xin;
  return silu_f(acc);
}
// Channel c of gdn_conv (one thread; c >= C: only the PDL wait). The constants are read before the wait.
template <int kK>
__device__ __forceinline__ void gdn_conv_channel(int64_t c, const float* x, float* state, float* __restrict__ state_before,
                                                 const float* __restrict__ w, float* y, int64_t M, int64_t C, int K_rt) {
  const int K = kK > 0 ? kK : K_rt;
  const int H = K - 1;
  float win[kMaxK];
  float wc[kMaxK];
#pragma unroll
  for (int j = 0; j < kMaxK; ++j) wc[j] = (c < C && j < K) ? w[c * K + j] : 0.0f;  // constants: before the wait
  pdl_wait();
  if (c >= C) return;
#pragma unroll
  for (int j = 0; j < kMaxK; ++j) win[j] = (j < H) ? state[j * C + c] : 0.0f;
  if (state_before)  // the undo checkpoint, from the window just loaded
#pragma unroll
    for (int j = 0; j < kMaxK; ++j)
      if (j < H) state_before[j * C + c] = win[j];
  // Several rows: in batches of kConvBatch, the batch's inputs loaded together (one round trip instead of
  // one per row: verify's 8 rows), then the steps in order. Each input is read before its output row is
  // written (y may be x). One row (decode) keeps the plain step: the batched form made the 27B decode step's
  // conv 1.2 -> 1.9 us (S9-5).
  constexpr int kConvBatch = 8;
  if (M == 1) y[c] = conv_step(win, wc, H, x[c]);
  for (int64_t m0 = 0; M > 1 && m0 < M; m0 += kConvBatch) {
    float xin[kConvBatch];
#pragma unroll
    for (int u = 0; u < kConvBatch; ++u) xin[u] = m0 + u < M ? x[(m0 + u) * C + c] : 0.0f;
#pragma unroll
    for (int u = 0; u < kConvBatch; ++u)
      if (m0 + u < M) y[(m0 + u) * C + c] = conv_step(win, wc, H, xin[u]);
  }
#pragma unroll
  for (int j = 0; j < kMaxK; ++j)
    if (j < H) state[j * C + c] = win[j];
}

}  // namespace dflash::cuda
