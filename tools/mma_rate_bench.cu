// mma.sync issue rate on the GPU: int8 m16n8k32 (what the small-M matmul uses) against int4 m16n8k64
// (an idea for a cheaper 2-bit unpack: 16 codes to 4-bit operands in 3 instructions instead of 7 to
// bytes). Each warp runs kChains independent accumulator chains so that the tensor pipe, not the
// latency of one chain, sets the rate. A developer's measurement, not part of the build:
//   nvcc -gencode arch=compute_90a,code=sm_90a -O3 -o mma_rate_bench tools/mma_rate_bench.cu && ./mma_rate_bench
#include <cstdio>
#include <cuda_runtime.h>

constexpr int kChains = 8, kIters = 4096;

template <bool kInt4>
__global__ void mma_loop(int* out, unsigned seed) {
  unsigned a0 = seed ^ threadIdx.x, a1 = a0 * 3u, a2 = a0 * 5u, a3 = a0 * 7u, b0 = a0 * 11u, b1 = a0 * 13u;
  int d[kChains][4] = {};
  for (int it = 0; it < kIters; ++it) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      if constexpr (kInt4)
        asm volatile(
            "mma.sync.aligned.m16n8k64.row.col.s32.u4.s4.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+r"(d[c][0]), "+r"(d[c][1]), "+r"(d[c][2]), "+r"(d[c][3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
      else
        asm volatile(
            "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+r"(d[c][0]), "+r"(d[c][1]), "+r"(d[c][2]), "+r"(d[c][3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
  }
  int s = 0;
#pragma unroll
  for (int c = 0; c < kChains; ++c) s += d[c][0] + d[c][1] + d[c][2] + d[c][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

template <bool kInt4>
void run(const char* name, int sms, int warps_per_sm) {
  const int threads = 128, blocks = sms * warps_per_sm / 4;
  int* out = nullptr;
  cudaMalloc(&out, sizeof(int) * blocks * threads);
  mma_loop<kInt4><<<blocks, threads>>>(out, 1);  // warm-up
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  mma_loop<kInt4><<<blocks, threads>>>(out, 2);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  const double mmas = static_cast<double>(blocks) * (threads / 32) * kChains * kIters;
  const double macs = mmas * 16 * 8 * (kInt4 ? 64 : 32);
  std::printf("%-28s %2d warps/SM: %8.3f ms, %6.3f mma per SM-cycle at 1.98 GHz, %7.1f T MAC/s (%s)\n", name,
              warps_per_sm, ms, mmas / sms / (ms * 1e-3 * 1.98e9), macs / (ms * 1e-3) / 1e12,
              cudaGetErrorString(cudaGetLastError()));
  cudaFree(out);
}

int main() {
  cudaDeviceProp p{};
  cudaGetDeviceProperties(&p, 0);
  std::printf("%s, %d SMs\n", p.name, p.multiProcessorCount);
  for (int w : {4, 8, 16}) {
    run<false>("m16n8k32 u8 x s8", p.multiProcessorCount, w);
    run<true>("m16n8k64 u4 x s4", p.multiProcessorCount, w);
  }
  return 0;
}
