// The device's L2 cache policy encodings (kernels.h: L2Policies), made by createpolicy once.
#include <mutex>

#include "ops/cuda/kernels.h"

namespace dflash::cuda {
namespace {

// out[0] evict_first, out[1] evict_normal (fraction 1.0: every access of the copy carries the policy).
__global__ void l2_policy_kernel(uint64_t* out) {
  uint64_t first, normal;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(first));
  asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(normal));
  out[0] = first;
  out[1] = normal;
}

L2Policies g_policies;
cudaError_t g_status = cudaSuccess;
std::once_flag g_once;

// Runs on its own stream with this thread's capture mode relaxed: a graph being captured elsewhere
// (another stream, global capture mode) would otherwise turn the allocation into a capture error.
cudaError_t make_policies() {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaError_t e = cudaThreadExchangeStreamCaptureMode(&mode);
  if (e != cudaSuccess) return e;
  cudaStream_t s = nullptr;
  uint64_t* d = nullptr;
  uint64_t h[2] = {0, 0};
  e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = cudaMalloc(&d, sizeof h);
  if (e == cudaSuccess) {
    l2_policy_kernel<<<1, 1, 0, s>>>(d);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) e = cudaMemcpyAsync(h, d, sizeof h, cudaMemcpyDeviceToHost, s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  if (d != nullptr) (void)cudaFree(d);
  if (s != nullptr) (void)cudaStreamDestroy(s);
  (void)cudaThreadExchangeStreamCaptureMode(&mode);
  if (e == cudaSuccess) g_policies = L2Policies{h[0], h[1]};
  return e;
}

}  // namespace

cudaError_t init_l2_policies() {
  std::call_once(g_once, [] { g_status = make_policies(); });
  return g_status;
}

const L2Policies& l2_policies() {
  (void)init_l2_policies();
  return g_policies;
}

}  // namespace dflash::cuda
