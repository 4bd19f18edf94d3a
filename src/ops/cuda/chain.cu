// Matmul-input chains in one kernel: (residual add +) RMS norm, or SwiGLU, then the prism rotation
// (1024-chunks; or none) and the integer matmuls' activation quantization (mma_gemv.cuh's xq
// records), so the next ternary / K-quant matmul skips its quantize launch (the backend's xq cache).
// Without rotation the records quantize the norm (n) or SwiGLU (y) output itself: the DFlash drafter's
// norms and SwiGLU, unrotated models.
//
// Why: at decode one row gives the separate kernels (norm, rotation, quantize) a few warps each and
// three round trips of launch latency per matmul input; an earlier fusion into one CTA per row was
// slower (one CTA's serial chain). Here one CTA of 256 threads owns one 1024-chunk of one row, thread t
// its elements 4t .. 4t + 3:
//   norm mode: the chunks of a row form a thread-block cluster (dim / 1024 <= 8 CTAs); each CTA sums
//     its chunk's squares (thread t: its 4 elements by fma in order, then the warp butterfly and the 8
//     warp sums in a fixed tree), the cluster adds the chunk sums in chunk order through distributed
//     shared memory, and every CTA normalises its own chunk. The rotation is linear and 1 / rms a scalar,
//     so the CTA rotates x * w while the sums are exchanged and scales the rotated values after (n itself
//     is (x * (1 / rms)) * w, as the norm op's);
//   swiglu / sigmoid-gate modes: no cluster (elementwise); gated norm: per head, inside the CTA.
// Then (chunk_rotation.cuh, shared with the gated attention output) the signs, the butterflies of
// prism::fwht (stage h = 1 .. 512, (a, b) -> (a + b, a - b), lower index first; in registers, across
// lanes, then across warps through shared memory) and the 1/32
// scale: the rotation's bits are exactly the hadamard op's (norm mode: of x * w, then times 1 / rms,
// which rounds differently from rotating n: within the ops' bound of the CPU). Warp w then quantizes the
// chunk's 128-block w as quantize_xq_kernel does (the same exponent, rounding and digit split): byte for
// byte the same records. Nothing depends on the number of rows: a row's bits are the same alone or in a verify block.
// Measured on the H200 (S7-2, 27B decode step): each chain kernel cost ~3 us of body on top of one more
// kernel boundary (~1.4 us) with the earlier layout (strided elements, 10 shared-memory stages).
#include <cooperative_groups.h>

#include "ops/cuda/chunk_rotation.cuh"
#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"

namespace dflash::cuda {
namespace {

namespace cg = cooperative_groups;

struct ChainArgs {
  const float* gx;     // gated norm, sigmoid gate: the input [rows, dim] (heads of head_dim)
  const float* z;      // gated norm, sigmoid gate: the gate [rows, dim]
  const int32_t* perm; // gated norm: null, or the rotation's gather (whole heads: perm[i] % head_dim == i % head_dim)
  int64_t head_dim;    // gated norm: the norm's group, a multiple of 32 dividing 1024
  float* x;            // norm: the residual stream [rows, dim] (x += res when res)
  const float* res;    // norm: null or the residual [rows, dim], as res_parts parts [res_parts][rows][dim]
  int res_parts;       // norm: 1, or the parts of a matmul_parts product (added in part order, then to x)
  int64_t res_stride;  // norm: floats from one part to the next (rows * dim)
  const float* w;      // norm: null or the weight [dim]
  float* n;            // norm: the normed row [rows, dim] (unrotated; other matmuls read it)
  const float* gate;   // swiglu: [rows, dim]
  const float* up;     // swiglu: [rows, dim]
  const float* signs;  // null or [dim]
  float* y;            // the rotated row [rows, dim]; without rotation: swiglu's output, null for norm
  bool rotate;         // false: no rotation, the records quantize the norm / swiglu output itself
  uint8_t* xq;         // [dim / 128][rows] records of kXqRecordBytes, then meta [dim / 128][rows][4] (xq_record.cuh)
  int32_t* meta;
  int64_t dim;
  float eps;
  bool local_norm;  // norm: DFLASH_CUDA_SKIP=normcluster (a diagnostic): no cluster, the chunk's own sum
};

// kMode 0: (residual +) RMS norm over the row; 1: SwiGLU; 2: RMS norm per head gated by silu(z)
// (rms_norm_gated), the rotation's gather applied while loading (heads move whole, so a chunk holds
// whole heads and each CTA normalises its own); 3: gx * sigmoid(z) (the gated attention output).
//
// Thread tid holds elements 4 tid .. 4 tid + 3 of its chunk, so warp w holds the quantization block w
// from the first load to the records. The rotation's 10 butterfly stages run where the partners are:
// stages h = 1, 2 in registers, h = 4 .. 64 across the lanes (shuffles), h = 128 .. 512 across the
// warps (one pass through shared memory: thread c < 128 takes elements c + 128 k, k = 0..7). Each stage
// completes before the next and every butterfly is prism::fwht's, so the bits are the hadamard op's.
// The constants (norm weight, signs, the gather) are read before the wait: they depend on no kernel of
// the step, so their latency hides behind the previous kernel.
template <int kMode>
__global__ void __launch_bounds__(kChainThreads) chain_kernel(const ChainArgs a) {
  __shared__ __align__(16) float buf[kChainChunk];
  __shared__ float wsum[kChainThreads / 32];
  __shared__ float chunk_ss;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int chunk = blockIdx.x;
  const int64_t r = blockIdx.y;
  const int64_t c0 = static_cast<int64_t>(chunk) * kChainChunk;
  const int64_t base = r * a.dim + c0;
  const int i0 = 4 * tid;  // this thread's first element in the chunk
  float sg[4] = {1.0f, 1.0f, 1.0f, 1.0f}, wv[4] = {1.0f, 1.0f, 1.0f, 1.0f};
  int64_t src[4] = {};
  if (a.rotate && a.signs) ld4(a.signs + c0 + i0, sg);
  if constexpr (kMode == 0) {
    if (a.w) ld4(a.w + c0 + i0, wv);
  } else if constexpr (kMode == 2) {
    ld4(a.w + i0 % a.head_dim, wv);  // head_dim is a multiple of 32: the 4 elements share a head
#pragma unroll
    for (int k = 0; k < 4; ++k) src[k] = r * a.dim + (a.perm ? a.perm[c0 + i0 + k] : c0 + i0 + k);
  }
  pdl_wait();
  float v[4];
  float xv[4], xinv = 1.0f;  // norm mode: the row x (after the residual) and, with local_norm, 1 / rms
  if constexpr (kMode == 2) {
    // rms_norm_gated per head: the head's hd / 4 threads are consecutive lanes (hd <= 128: a butterfly
    // over them) or whole warps (hd > 128: warp sums, then the head's warps in order).
    const int hd = static_cast<int>(a.head_dim), lanes = hd / 4;
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[k] = a.gx[src[k]];
      ss = fmaf(v[k], v[k], ss);
    }
    if (lanes <= 32) {
      for (int o = lanes / 2; o >= 1; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    } else {
      ss = warp_sum(ss);
      if (lane == 0) wsum[warp] = ss;
      __syncthreads();
      const int per = lanes / 32, h0 = (warp / per) * per;
      ss = wsum[h0];
      for (int w = 1; w < per; ++w) ss += wsum[h0 + w];
    }
    const float inv = 1.0f / sqrtf(ss / static_cast<float>(hd) + a.eps);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float q = v[k] * inv;
      v[k] = q * wv[k] * silu_f(a.z[src[k]]);
    }
  } else if constexpr (kMode == 0) {
    ld4(a.x + base + i0, v);
    if (a.res) {
      // The residual: matmul_parts' parts summed in part order, ((p0 + p1) + p2) + ..., the bits the
      // matmul's own reduction would have stored.
      // Every part's load is issued before the first add (common.cuh's load_parts).
      float rv[4], pv[kMaxParts][4];
      ld4(a.res + base + i0, rv);
#pragma unroll
      for (int p = 1; p < kMaxParts; ++p)
        if (p < a.res_parts) ld4(a.res + p * a.res_stride + base + i0, pv[p]);
#pragma unroll
      for (int p = 1; p < kMaxParts; ++p)
        if (p < a.res_parts)
#pragma unroll
          for (int k = 0; k < 4; ++k) rv[k] = rv[k] + pv[p][k];
#pragma unroll
      for (int k = 0; k < 4; ++k) v[k] = v[k] + rv[k];
      st4(a.x + base + i0, v);
    }
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) ss = fmaf(v[k], v[k], ss);
    ss = warp_sum(ss);
    if (lane == 0) wsum[warp] = ss;
    __syncthreads();
    if (tid == 0) chunk_ss = ((wsum[0] + wsum[1]) + (wsum[2] + wsum[3])) + ((wsum[4] + wsum[5]) + (wsum[6] + wsum[7]));
    if (a.local_norm) {  // the diagnostic (wrong results): what the norm costs without the exchange
      __syncthreads();
      xinv = 1.0f / sqrtf(chunk_ss * static_cast<float>(gridDim.x) / static_cast<float>(a.dim) + a.eps);
    } else {
      // Publish the chunk's sum (every thread arrives; tid 0's store is released with its arrival) and
      // rotate x * w while the other chunks' sums arrive: the norm's 1 / rms is a scalar, so it is applied
      // after the rotation (below), and the exchange's latency hides behind the butterflies.
      asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      xv[k] = v[k];
      if (a.w) v[k] = v[k] * wv[k];
    }
  } else if constexpr (kMode == 1) {
    float g[4], u[4];
    ld4(a.gate + base + i0, g);
    ld4(a.up + base + i0, u);
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = silu_f(g[k]) * u[k];
  } else {  // kMode 3: the gated attention output, as mul_sigmoid_kernel
    float x[4], z[4];
    ld4(a.gx + base + i0, x);
    ld4(a.z + base + i0, z);
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = x[k] * sigmoid_f(z[k]);
  }
  if (a.rotate) chunk_rotate(v, sg, a.signs != nullptr, buf, tid, lane);
  if constexpr (kMode == 0) {
    // The norm: every chunk's sum of squares (in chunk order), 1 / rms, n = (x * inv) * w, and the rotated
    // x * w times inv (the rotation is linear); unrotated, the records quantize n itself.
    float inv = xinv;
    if (!a.local_norm) {
      cg::cluster_group cluster = cg::this_cluster();
      asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");  // every chunk's sum is published
      const unsigned nb = cluster.num_blocks();
      float part[8];
#pragma unroll
      for (unsigned s = 0; s < 8; ++s) part[s] = s < nb ? *cluster.map_shared_rank(&chunk_ss, s) : 0.0f;
      float tot = part[0];
#pragma unroll
      for (unsigned s = 1; s < 8; ++s)
        if (s < nb) tot += part[s];
      // No CTA may leave while another still reads its chunk_ss: this CTA arrives at the closing cluster
      // barrier now and waits for the others at its end, so its quantization runs meanwhile (a full
      // cluster.sync() instead of the split: slower, S12-6).
      asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
      inv = 1.0f / sqrtf(tot / static_cast<float>(a.dim) + a.eps);
    }
    float nv[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float q = xv[k] * inv;
      nv[k] = a.w ? q * wv[k] : q;
      v[k] = a.rotate ? v[k] * inv : nv[k];  // unrotated, the records quantize n itself
    }
    st4(a.n + base + i0, nv);
  }
  // Warp w: quantization block w (elements 128 w .. 128 w + 127 of the chunk), lane L elements 4L .. 4L+3.
  chunk_store_quantize(v, a.rotate, a.y ? a.y + base : nullptr, a.xq, a.meta, r, c0, gridDim.y, tid, lane);
  if constexpr (kMode == 0)
    if (!a.local_norm) asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

}  // namespace

bool gated_chain_supported(int64_t dim, int64_t block, int64_t head_dim) {
  return (block == kChainChunk || block == 0) && dim > 0 && dim % kChainChunk == 0 && head_dim >= 32 && head_dim % 32 == 0 &&
         kChainChunk % head_dim == 0;
}

bool chain_supported(int64_t dim, int64_t block, bool norm) {
  return (block == kChainChunk || block == 0) && dim > 0 && dim % kChainChunk == 0 && (!norm || dim / kChainChunk <= 8);
}

void launch_norm_rotate_quantize(float* x, const float* res, int res_parts, const float* w, float* n,
                                 const float* signs, float* y, void* xq, int64_t rows, int64_t dim, float eps,
                                 bool rotate, bool local_norm, cudaStream_t s) {
  if (rows <= 0) return;
  ChainArgs a{};
  a.x = x, a.res = res, a.res_parts = res_parts, a.res_stride = rows * dim, a.w = w, a.n = n, a.signs = signs, a.y = rotate ? y : nullptr, a.dim = dim, a.eps = eps;
  a.rotate = rotate;
  a.local_norm = local_norm;
  a.xq = static_cast<uint8_t*>(xq);
  a.meta = xq_meta(a.xq, rows, dim);
  const unsigned chunks = static_cast<unsigned>(dim / kChainChunk);
  (void)launch_ex(chain_kernel<0>, dim3(chunks, static_cast<unsigned>(rows)), dim3(kChainThreads), 0, s,
                  dim3(local_norm ? 1 : chunks, 1, 1), pdl_enabled(), a);
}

// The elementwise chains (no cluster): kMode 1 SwiGLU (in0 = gate, in1 = up), 3 the sigmoid gate
// (in0 = x, in1 = gate).
template <int kMode>
void launch_elementwise_chain(const float* in0, const float* in1, const float* signs, float* y, void* xq, int64_t rows,
                              int64_t dim, bool rotate, cudaStream_t s) {
  static_assert(kMode == 1 || kMode == 3, "elementwise chain modes");
  if (rows <= 0) return;
  ChainArgs a{};
  if constexpr (kMode == 1)
    a.gate = in0, a.up = in1;
  else
    a.gx = in0, a.z = in1;
  a.signs = signs, a.y = y, a.dim = dim;
  a.rotate = rotate;
  a.xq = static_cast<uint8_t*>(xq);
  a.meta = xq_meta(a.xq, rows, dim);
  launch_pdl(chain_kernel<kMode>, dim3(static_cast<unsigned>(dim / kChainChunk), static_cast<unsigned>(rows)),
             dim3(kChainThreads), 0, s, a);
}

void launch_swiglu_rotate_quantize(const float* gate, const float* up, const float* signs, float* y, void* xq,
                                   int64_t rows, int64_t dim, bool rotate, cudaStream_t s) {
  launch_elementwise_chain<1>(gate, up, signs, y, xq, rows, dim, rotate, s);
}

void launch_sigmoid_gate_rotate_quantize(const float* x, const float* gate, const float* signs, float* y, void* xq,
                                         int64_t rows, int64_t dim, bool rotate, cudaStream_t s) {
  launch_elementwise_chain<3>(x, gate, signs, y, xq, rows, dim, rotate, s);
}

void launch_gated_norm_rotate_quantize(const float* x, const float* w, const float* z, const float* signs,
                                       const int32_t* perm, float* y, void* xq, int64_t rows, int64_t dim,
                                       int64_t head_dim, float eps, bool rotate, cudaStream_t s) {
  if (rows <= 0) return;
  ChainArgs a{};
  a.gx = x, a.w = w, a.z = z, a.signs = signs, a.perm = perm, a.y = y, a.dim = dim, a.eps = eps;
  a.head_dim = head_dim;
  a.rotate = rotate;
  a.xq = static_cast<uint8_t*>(xq);
  a.meta = xq_meta(a.xq, rows, dim);
  launch_pdl(chain_kernel<2>, dim3(static_cast<unsigned>(dim / kChainChunk), static_cast<unsigned>(rows)), dim3(kChainThreads),
             0, s, a);
}

}  // namespace dflash::cuda
