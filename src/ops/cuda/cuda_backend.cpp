// The CUDA backend class: argument checks (the CPU backend's), memory, weight upload, and the op
// methods, each a launcher from kernels.h followed by a launch check. Host code only (g++).
#include "ops/cuda/cuda_backend.h"

#include <cuda_profiler_api.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "ops/cuda/kernels.h"
#include "util/error.h"

static_assert(dflash::cuda::kMaxParts == dflash::Backend::kMaxMatmulParts, "the parts readers add kMaxParts at most");

namespace dflash {
namespace {

#define DFLASH_CUDA_CALL(call, ...)                                                                        \
  do {                                                                                                     \
    const cudaError_t err_ = (call);                                                                       \
    if (err_ != cudaSuccess)                                                                               \
      ::dflash::fail("cuda: {} failed: {} ({}) [{}:{}]", #call, cudaGetErrorString(err_),                  \
                     cudaGetErrorName(err_), __FILE__, __LINE__);                                          \
  } while (0)

// One instantiated step graph, replayed on the backend's stream.
class CudaStepGraph final : public StepGraph {
 public:
  // cache_valid: the backend's quantized-activation cache flag, cleared at each launch (the graph
  // writes device memory the cache may describe)
  CudaStepGraph(cudaGraphExec_t exec, cudaStream_t stream, bool* cache_valid)
      : exec_(exec), stream_(stream), cache_valid_(cache_valid) {}
  ~CudaStepGraph() override { cudaGraphExecDestroy(exec_); }
  void launch() override {
    *cache_valid_ = false;
    const cudaError_t err = cudaGraphLaunch(exec_, stream_);
    if (err != cudaSuccess) fail("cuda: graph launch failed: {} ({})", cudaGetErrorString(err), cudaGetErrorName(err));
  }

 private:
  cudaGraphExec_t exec_;
  cudaStream_t stream_;
  bool* cache_valid_;
};

// Whether the float ranges [a, a + n) and [b, b + n) share an element.
bool ranges_overlap(const float* a, const float* b, size_t n) {
  const auto ab = reinterpret_cast<uintptr_t>(a), bb = reinterpret_cast<uintptr_t>(b);
  const size_t bytes = sizeof(float) * n;
  return ab < bb + bytes && bb < ab + bytes;
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    const int n = cuda_device_count();
    DFLASH_CHECK(device >= 0 && device < n, "cuda: no CUDA device {} ({} device(s) found)", device, n);
    DFLASH_CUDA_CALL(cudaSetDevice(device));
    DFLASH_CUDA_CALL(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    cudaDeviceProp prop{};
    DFLASH_CUDA_CALL(cudaGetDeviceProperties(&prop, device));
    desc_ = prop.name;
    num_sms_ = prop.multiProcessorCount;
    smem_optin_ = prop.sharedMemPerBlockOptin;
    debug_ = cuda::env_flag("DFLASH_CUDA_DEBUG", false);
    // Graphs replay what was captured, so a fault would name no op: debug mode runs ops directly.
    graphs_ = cuda::env_flag("DFLASH_CUDA_GRAPHS", true) && !debug_;
    // PQ2_0 / PTQ1_0 layout: integer tensor cores (default), or DFLASH_CUDA_TERNARY_MMA=0 for the
    // planar CUDA-core layout of round 1 (kept for comparison).
    ternary_mma_ = cuda::env_flag("DFLASH_CUDA_TERNARY_MMA", true);
    // Matmul-input chains (norm or SwiGLU, rotation, quantization) as one kernel (chain.cu);
    // DFLASH_CUDA_CHAIN=0 runs the separate kernels (for comparison).
    chain_ = cuda::env_flag("DFLASH_CUDA_CHAIN", true);
    // Q4_K / Q6_K layout: integer tensor cores (default), or DFLASH_CUDA_KQUANT_MMA=0 for the file's
    // blocks and the CUDA-core dequantize-and-fma kernel (kept for comparison).
    kquant_mma_ = cuda::env_flag("DFLASH_CUDA_KQUANT_MMA", true);
    // attention_prep as one kernel; DFLASH_CUDA_FUSED_PREP=0 runs the op sequence (for comparison).
    fused_prep_ = cuda::env_flag("DFLASH_CUDA_FUSED_PREP", true);
    // matmul_group of small block-layout weights (GDN alpha | beta) in one launch; =0: one each.
    split_group_ = cuda::env_flag("DFLASH_CUDA_SPLIT_GROUP", true);
    chain_plain_ = cuda::env_flag("DFLASH_CUDA_CHAIN_PLAIN", true);
    // gated_norm_rotate (GDN's output norm, the ssm_out gather, rotation, quantization) as one kernel.
    gated_chain_ = cuda::env_flag("DFLASH_CUDA_CHAIN_GATED", true);
    prefill_xq_ = cuda::env_flag("DFLASH_CUDA_PREFILL_XQ", false);
    // sigmoid_gate_rotate (the gated attention output, wo's rotation and quantization) as one kernel.
    sigmoid_chain_ = cuda::env_flag("DFLASH_CUDA_CHAIN_SIGMOID", true);
    // matmul_prefill_group as one tensor-core launch; =0: one launch per weight.
    prefill_group_ = cuda::env_flag("DFLASH_CUDA_PREFILL_GROUP", true);
    // matmul_parts leaves the k split's partial sums to the residual's norm kernel; =0: the matmul adds
    // them itself (a thread-block cluster), for comparison. The bits are the same (S16-3, 27B decode
    // 4.10-4.14 -> 3.94-3.96 ms with the parts).
    mm_parts_ = cuda::env_flag("DFLASH_CUDA_MM_PARTS", true);
    // gdn_conv_and_matmuls as one launch (GDN alpha | beta beside the conv); =0: two, for comparison.
    conv_matmuls_ = cuda::env_flag("DFLASH_CUDA_CONV_MATMULS", true);
    // gdn_input as one launch (alpha | beta and the conv in the qkv | z projections' launch); =0: the qkv | z
    // group, then gdn_conv_and_matmuls, for comparison. The bits are the same.
    gdn_input_fused_ = cuda::env_flag("DFLASH_CUDA_GDN_INPUT_FUSED", true);
    // attention_gate_rotate's merge and gated output chain as one kernel; =0: attention() then
    // sigmoid_gate_rotate(), for comparison. The bits are the same.
    gated_attention_ = cuda::env_flag("DFLASH_CUDA_ATTN_GATE_FUSED", true);
    skip_ = parse_skip();
  }

  ~CudaBackend() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    for (void* p : weight_allocs_) cudaFree(p);
    for (auto& sb : scratch_)
      if (sb.ptr) cudaFree(sb.ptr);
    for (void* p : retired_) cudaFree(p);
    cudaStreamDestroy(stream_);
  }

  std::string name() const override { return fmt::format("cuda ({}, device {})", desc_, device_); }

  // ---- memory ---------------------------------------------------------------------------------
  void* alloc(size_t bytes) override {
    not_capturing("alloc");
    const size_t padded = std::max<size_t>(256, (bytes + 255) / 256 * 256);
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, padded);
    DFLASH_CHECK(err == cudaSuccess, "cuda: out of device memory allocating {} bytes: {}", bytes,
                 cudaGetErrorString(err));
    DFLASH_CUDA_CALL(cudaMemsetAsync(p, 0, padded, stream_));
    return p;
  }
  void release(void* ptr) override {
    if (!ptr) return;
    not_capturing("release");
    DFLASH_CUDA_CALL(cudaStreamSynchronize(stream_));  // in-flight work may still read it
    DFLASH_CUDA_CALL(cudaFree(ptr));
  }
  void upload(void* dst, const void* host_src, size_t bytes) override {
    // From pageable memory the call returns once the source is staged, so host_src may go away.
    not_capturing("upload");
    if (bytes) DFLASH_CUDA_CALL(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_));
    after("upload");
  }
  void download(void* host_dst, const void* src, size_t bytes) override {
    not_capturing("download");
    if (bytes) DFLASH_CUDA_CALL(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    DFLASH_CUDA_CALL(cudaStreamSynchronize(stream_));
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (!bytes || dst == src) return;
    const auto d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
    DFLASH_CHECK(d + bytes <= s || s + bytes <= d, "cuda copy: overlapping ranges ({} bytes)", bytes);
    cuda::launch_copy(dst, src, bytes, stream_);  // a kernel: it keeps a step graph's PDL chain
    after("copy");
  }
  void copy_batch(std::span<const CopyJob> jobs) override {
    // One launch when every job is 16-byte aligned with a size a multiple of 16 (rollback's conv states);
    // any other job set goes one copy at a time.
    bool aligned = true;
    for (const CopyJob& j : jobs)
      aligned = aligned && (reinterpret_cast<uintptr_t>(j.dst) | reinterpret_cast<uintptr_t>(j.src) | j.bytes) % 16 == 0;
    if (!aligned || jobs.size() < 2) {
      Backend::copy_batch(jobs);
      return;
    }
    std::vector<void*> dst;
    std::vector<const void*> src;
    std::vector<size_t> bytes;
    for (const CopyJob& j : jobs) {
      const auto d = reinterpret_cast<uintptr_t>(j.dst), s = reinterpret_cast<uintptr_t>(j.src);
      DFLASH_CHECK(!j.bytes || d + j.bytes <= s || s + j.bytes <= d, "cuda copy_batch: overlapping ranges ({} bytes)",
                   j.bytes);
      dst.push_back(j.dst);
      src.push_back(j.src);
      bytes.push_back(j.bytes);
    }
    cuda::launch_copy_batch(dst.data(), src.data(), bytes.data(), static_cast<int>(jobs.size()), stream_);
    after("copy_batch");
  }
  void fill_zero(void* dst, size_t bytes) override {
    if (bytes) DFLASH_CUDA_CALL(cudaMemsetAsync(dst, 0, bytes, stream_));
    after("fill_zero");
  }
  void synchronize() override {
    not_capturing("synchronize");
    DFLASH_CUDA_CALL(cudaStreamSynchronize(stream_));
    DFLASH_CUDA_CALL(cudaGetLastError());
  }

  WeightRef upload_weight(const void* host_data, GgmlType type, int64_t in, int64_t out) override {
    DFLASH_CHECK(host_data != nullptr, "cuda backend: upload_weight of a null pointer ({} x {} {})", out, in,
                 type_name(type));
    DFLASH_CHECK(in > 0 && out > 0, "cuda backend: upload_weight with shape [{}, {}]", in, out);
    not_capturing("upload_weight");
    DFLASH_CHECK(type_traits(type).has_codec && cuda::matmul_supported(static_cast<int>(type)),
                 "cuda backend: no kernel for weight type {}", type_name(type));
    const size_t rb = row_bytes(type, in);  // checks in % block
    const size_t file_bytes = rb * static_cast<size_t>(out);
    cuda::DevWeight dw;
    dw.type = static_cast<int>(type);
    dw.in = in;
    dw.out = out;
    if ((type == GgmlType::PQ2_0 || type == GgmlType::PTQ1_0) && !ternary_mma_) {
      // planar 2-bit: codes [out][in/4] then fp16 scales [out][in/128]
      const size_t code_bytes = static_cast<size_t>(out) * (in / 4);
      const size_t scale_off = (code_bytes + 255) / 256 * 256;
      const size_t total = scale_off + static_cast<size_t>(out) * (in / 128) * 2;
      uint8_t* buf = upload_transcoded(host_data, file_bytes, total, [&](const uint8_t* raw, uint8_t* dst) {
        auto* sc = reinterpret_cast<uint16_t*>(dst + scale_off);
        if (type == GgmlType::PTQ1_0)
          cuda::launch_ptq1_to_planar2(raw, dst, sc, in, out, stream_);
        else
          cuda::launch_pq2_to_planar2(raw, dst, sc, in, out, stream_);
      });
      dw.data = buf;
      dw.scales = reinterpret_cast<const uint16_t*>(buf + scale_off);
      dw.layout = cuda::Layout::kPlanar2;
      dw.row_stride = static_cast<size_t>(in / 4);
      weight_bytes_[buf] = total;
    } else if (type == GgmlType::PQ2_0 || type == GgmlType::PTQ1_0) {
      // ternary: transcoded on the device to the tensor-core layout (matmul_ternary.cu)
      const size_t code_bytes = cuda::ternary_code_bytes(in, out);
      const size_t scale_off = (code_bytes + 255) / 256 * 256;
      const size_t total = scale_off + cuda::ternary_scale_bytes(in, out);
      uint8_t* buf = upload_transcoded(host_data, file_bytes, total, [&](const uint8_t* raw, uint8_t* dst) {
        cuda::launch_to_ternary_mma(raw, type == GgmlType::PTQ1_0, dst, dst + scale_off, in, out, stream_);
      });
      dw.data = buf;
      dw.scales = reinterpret_cast<const uint16_t*>(buf + scale_off);
      dw.layout = cuda::Layout::kTernaryMma;
      weight_bytes_[buf] = total;
    } else if (kquant_mma_ && cuda::kquant_mma_supported(static_cast<int>(type), in)) {
      // Q4_K / Q6_K: transcoded on the device to the tensor-core layout (matmul_kquant.cu)
      const size_t code_bytes = cuda::kquant_code_bytes(static_cast<int>(type), in, out);
      const size_t scale_off = (code_bytes + 255) / 256 * 256;
      const size_t total = scale_off + cuda::kquant_scale_bytes(in, out);
      uint8_t* buf = upload_transcoded(host_data, file_bytes, total, [&](const uint8_t* raw, uint8_t* dst) {
        cuda::launch_to_kquant_mma(raw, static_cast<int>(type), dst, dst + scale_off, in, out, stream_);
      });
      dw.data = buf;
      dw.scales = reinterpret_cast<const uint16_t*>(buf + scale_off);
      dw.layout = cuda::Layout::kKQuantMma;
      weight_bytes_[buf] = total;
    } else {
      uint8_t* buf = static_cast<uint8_t*>(device_alloc(file_bytes, "weight"));
      // On the backend's stream (a non-blocking stream is not ordered after plain cudaMemcpy), then
      // wait: the caller's host bytes may go away after we return.
      DFLASH_CUDA_CALL(cudaMemcpyAsync(buf, host_data, file_bytes, cudaMemcpyHostToDevice, stream_));
      DFLASH_CUDA_CALL(cudaStreamSynchronize(stream_));
      dw.data = buf;
      dw.layout = cuda::Layout::kBlocks;
      dw.row_stride = rb;
      weight_bytes_[buf] = file_bytes;
    }
    weight_allocs_.push_back(const_cast<uint8_t*>(dw.data));
    weights_[dw.data] = dw;
    WeightRef w;
    w.data = dw.data;
    w.type = type;
    w.in = in;
    w.out = out;
    w.row_bytes = rb;
    return w;
  }

  // A weight transcoded on the device: the file's bytes go to a staging buffer, transcode(raw, dst)
  // enqueues the kernels that write the `total` bytes of the new allocation, and the staging buffer is
  // freed once they are done (the caller's host bytes may go away after upload_weight returns).
  template <class Transcode>
  uint8_t* upload_transcoded(const void* host_data, size_t file_bytes, size_t total, Transcode&& transcode) {
    uint8_t* buf = static_cast<uint8_t*>(device_alloc(total, "weight"));
    void* raw = device_alloc(file_bytes, "weight staging");
    DFLASH_CUDA_CALL(cudaMemcpyAsync(raw, host_data, file_bytes, cudaMemcpyHostToDevice, stream_));
    transcode(static_cast<const uint8_t*>(raw), buf);
    after("upload_weight transcode");
    DFLASH_CUDA_CALL(cudaStreamSynchronize(stream_));
    DFLASH_CUDA_CALL(cudaFree(raw));
    return buf;
  }

  // ---- linear algebra ---------------------------------------------------------------------------
  void matmul(const WeightRef& w, const float* x, float* y, int64_t M) override {
    const cuda::DevWeight dw = dev_weight(w, "matmul");
    if (skipped_matmul(&dw, 1)) return;
    run_matmul(dw, x, y, M);
    after("matmul");
  }
  int matmul_parts(const WeightRef& w, const float* x, float* y, int64_t M, int64_t y_rows) override {
    const cuda::DevWeight dw = dev_weight(w, "matmul_parts");
    if (skipped_matmul(&dw, 1)) return 1;
    // Parts only where their reader adds them as it loads them: the norm chain (the target's residual)
    // or dflash_conv (the drafter's), rows the norm chain takes (otherwise the residual op would need a
    // sum_parts launch, slower than the matmul's own reduction).
    const bool chained = chain_ && chain_plain_ && M <= 65535 && cuda::chain_supported(dw.out, 0, true);
    const int max_parts =
        mm_parts_ && chained && M > 0 ? static_cast<int>(std::min<int64_t>(kMaxMatmulParts, y_rows / M)) : 1;
    const int parts = run_matmul(dw, x, y, M, max_parts);
    after("matmul_parts");
    return parts;
  }
  int64_t prefill_rows() const override { return 512; }
  // 5..7 rows run on the general 8-column kernels; exactly 8 take the ones built for 8 (mma_gemv.cuh's
  // kFixedM), which are faster (H200: the drafter's lm_head 105.6 us at 7 rows, 101.5 at 8; the draft step
  // -0.6 %, S30-1).
  // DFLASH_CUDA_MM_FIXED_M=0 (no fixed kernels) or DFLASH_CUDA_MM_PAD_ROWS=0 keeps the rows as asked.
  int64_t matmul_rows_for(int64_t rows, int64_t room) const override {
    static const bool pad =
        cuda::env_flag("DFLASH_CUDA_MM_PAD_ROWS", true) && cuda::env_flag("DFLASH_CUDA_MM_FIXED_M", true);
    return pad ? rows_as_full_tile(rows, room) : rows;
  }
  // Whether weights a and b can share one tensor-core launch (matmul_group): both ternary, or both K-quant
  // of one type, with the same input width.
  static bool one_mma_launch(const cuda::DevWeight& a, const cuda::DevWeight& b) {
    const bool mma = b.layout == cuda::Layout::kTernaryMma || (b.layout == cuda::Layout::kKQuantMma && b.type == a.type);
    return mma && b.layout == a.layout && b.in == a.in;
  }
  // A group of mixed layouts: one launch for each set of weights that can share one (one_mma_launch), the
  // rest one matmul each. A Q4_K_M file's attention q | k are Q4_K and its v Q6_K in some layers (the 27B
  // drafter's, S33): q | k in one launch, v in another, where one matmul each took three. An output has the
  // bits of the launch it is in (a group's k split is the group's own: q | k may round differently from q
  // alone; each row's bits still do not depend on M, tested), and later launches reuse the quantized input (xq_).
  void matmul_group_by_layout(std::span<const MatmulOut> outs, const cuda::DevWeight* dws, const float* x, int64_t M) {
    const size_t n = outs.size();
    std::array<bool, cuda::kTernaryMaxGroup> done{};
    for (size_t i = 0; i < n; ++i) {
      if (done[i]) continue;
      std::array<MatmulOut, cuda::kTernaryMaxGroup> sub{};
      size_t k = 0;
      for (size_t j = i; j < n; ++j)
        if (!done[j] && (j == i || one_mma_launch(dws[i], dws[j]))) {
          sub[k++] = outs[j];
          done[j] = true;
        }
      if (k > 1 && one_mma_launch(dws[i], dws[i]))
        matmul_group(std::span<const MatmulOut>(sub.data(), k), x, M);
      else
        for (size_t j = 0; j < k; ++j) matmul(*sub[j].w, x, sub[j].y, M);
    }
  }
  void matmul_group(std::span<const MatmulOut> outs, const float* x, int64_t M) override {
    // One launch when every weight is in one tensor-core layout (ternary, or K-quant of one type) with the
    // same input width.
    const cuda::DevWeight* ws[cuda::kTernaryMaxGroup];
    float* ys[cuda::kTernaryMaxGroup];
    cuda::DevWeight dws[cuda::kTernaryMaxGroup];
    if (skip_ & (kSkipMatmul | kSkipStream)) {  // diagnostics (see parse_skip)
      const int n = static_cast<int>(std::min<size_t>(outs.size(), cuda::kTernaryMaxGroup));
      for (int i = 0; i < n; ++i) dws[i] = dev_weight(*outs[i].w, "matmul_group");
      skipped_matmul(dws, n);
      return;
    }
    if (outs.size() < 2 || outs.size() > static_cast<size_t>(cuda::kTernaryMaxGroup)) {
      Backend::matmul_group(outs, x, M);
      return;
    }
    gather_group(outs, "matmul_group", dws, ws, ys);
    bool one_launch = true;
    for (size_t i = 0; i < outs.size(); ++i) one_launch = one_launch && one_mma_launch(dws[0], dws[i]);
    if (!one_launch) {
      // Small block-layout weights of one type (GDN alpha | beta): one launch of the k-split kernel.
      if (split_group_ && cuda::launch_matmul_split_group(ws, ys, static_cast<int>(outs.size()), x, M, stream_)) {
        note_group_writes(dws, ys, static_cast<int>(outs.size()), M);
        after("matmul");
        return;
      }
      matmul_group_by_layout(outs, dws, x, M);
      return;
    }
    const int n = static_cast<int>(outs.size());
    const cuda::TernaryScratch need = cuda::ternary_scratch(dws[0].in, M);
    cuda::TernaryBuffers buf = matmul_buffers(need, x, M, dws[0].in);
    if (dws[0].layout == cuda::Layout::kKQuantMma)
      cuda::launch_matmul_kquant_group(ws, ys, n, x, M, buf, num_sms_, stream_);
    else
      cuda::launch_matmul_ternary_group(ws, ys, n, x, M, buf, num_sms_, stream_);
    xq_ = XqKey{x, M, dws[0].in, buf.xq, true};
    note_group_writes(dws, ys, n, M);
    after("matmul");
  }
  // The residual add joins the norm kernel (one launch fewer). Measured slower at decode than the
  // separate kernels, and not kept: the rotation with the ternary kernel's activation quantization
  // (one warp quantizing its 1024-chunk's 8 blocks), SwiGLU inside the rotation's loads (32 silu per
  // lane: 8.4 us against 3.6), and the whole chain in one CTA per row. One row leaves those kernels a
  // few warps with long serial chains.
  void residual_norm_rotate(float* x, float* res, int res_parts, const float* w, float* n, float* y, const Rotation& rot,
                            int64_t rows, int64_t dim, float eps) override {
    if (skipped_chain()) return;
    if (!res) res_parts = 1;
    if (use_chain(rot, rows) && cuda::chain_supported(dim, rot.block, true)) {
      // one kernel: (residual +) norm, rotation, and the next integer matmul's quantization of its input
      // (y, or n without rotation)
      const bool rotate = rot.block > 0;
      run_chain(rotate ? y : n, rows, dim, "residual_norm_rotate", [&](void* xq) {
        cuda::launch_norm_rotate_quantize(x, res, res_parts, w, n, rot.signs, y, xq, rows, dim, eps, rotate,
                                          (skip_ & kSkipNormCluster) != 0, stream_);
      });
      return;
    }
    if (!res) {
      Backend::residual_norm_rotate(x, res, 1, w, n, y, rot, rows, dim, eps);
      return;
    }
    if (res_parts > 1) sum_parts(res, res_parts, rows * dim);
    for_row_slices(rows, [&](int64_t r0, int64_t nr) {
      cuda::launch_rms_norm_residual(x + r0 * dim, res + r0 * dim, w, n + r0 * dim, nr, dim, eps, stream_);
    });
    after("residual_norm_rotate");
    if (rot.block > 0) hadamard(n, rot.signs, rot.perm, y, rows, dim, rot.block, /*inverse=*/false);
  }
  void swiglu_rotate(const float* gate, const float* up, float* y, const Rotation& rot, int64_t rows,
                     int64_t dim) override {
    if (skipped_chain()) return;
    if (use_chain(rot, rows) && cuda::chain_supported(dim, rot.block, false)) {
      run_chain(y, rows, dim, "swiglu_rotate", [&](void* xq) {
        cuda::launch_swiglu_rotate_quantize(gate, up, rot.signs, y, xq, rows, dim, rot.block > 0, stream_);
      });
      return;
    }
    Backend::swiglu_rotate(gate, up, y, rot, rows, dim);
  }
  void sigmoid_gate_rotate(const float* x, const float* gate, float* y, const Rotation& rot, int64_t rows,
                           int64_t dim) override {
    if (skipped_chain()) return;
    const bool overlap = x != y && ranges_overlap(x, y, rows * dim);  // in place is fine (elementwise load first)
    if (sigmoid_chain_ && use_chain(rot, rows) && !overlap && cuda::chain_supported(dim, rot.block, false)) {
      run_chain(y, rows, dim, "sigmoid_gate_rotate", [&](void* xq) {
        cuda::launch_sigmoid_gate_rotate_quantize(x, gate, rot.signs, y, xq, rows, dim, rot.block > 0, stream_);
      });
      return;
    }
    Backend::sigmoid_gate_rotate(x, gate, y, rot, rows, dim);
  }
  void gated_norm_rotate(const float* x, const float* w, const float* z, float* y, const Rotation& rot, int64_t rows,
                         int64_t dim, int64_t head_dim, float eps) override {
    if (skipped_chain()) return;
    const bool overlap = ranges_overlap(x, y, rows * dim);
    const bool perm_ok = !rot.perm || (rot.perm_group == head_dim && !overlap);  // the gather crosses chunks
    if (chain_ && gated_chain_ && perm_ok && rows <= 65535 && (rot.block > 0 || chain_plain_) &&
        cuda::gated_chain_supported(dim, rot.block, head_dim)) {
      run_chain(y, rows, dim, "gated_norm_rotate", [&](void* xq) {
        cuda::launch_gated_norm_rotate_quantize(x, w, z, rot.signs, rot.perm, y, xq, rows, dim, head_dim, eps,
                                                rot.block > 0, stream_);
      });
      return;
    }
    Backend::gated_norm_rotate(x, w, z, y, rot, rows, dim, head_dim, eps);
  }
  // The chains quantize their output for the GEMV tiles' integer matmuls. A prefill-sized input goes to
  // the bf16 tensor-core GEMM instead, which reads the floats: no records then (the chain writes ~3 bytes
  // per element fewer; a GEMV that does get such an input quantizes it itself). DFLASH_CUDA_PREFILL_XQ=1
  // keeps the records (for comparison).
  void* chain_xq(int64_t rows, int64_t dim) {
    if (rows >= cuda::kMatmulPrefillMinRows && !prefill_xq_) return nullptr;
    return scratch(kScratchMatmulXq, cuda::ternary_scratch(dim, rows).xq_bytes);
  }
  // One chain kernel writing y [rows, dim] (launch(xq) launches it): its quantization records go to the
  // matmul scratch (none at prefill sizes) and the xq cache then points at them.
  template <typename Launch>
  void run_chain(const float* y, int64_t rows, int64_t dim, const char* op, Launch&& launch) {
    void* xq = chain_xq(rows, dim);
    launch(xq);
    after(op);
    if (xq) xq_ = XqKey{y, rows, dim, xq, true};
  }
  // The fused chain kernels (chain.cu) take rotations of 1024-blocks without a permutation, and no
  // rotation at all unless DFLASH_CUDA_CHAIN_PLAIN=0.
  bool use_chain(const Rotation& rot, int64_t rows) const {
    return chain_ && !rot.perm && rows <= 65535 && (rot.block > 0 || chain_plain_);
  }
  void matmul_prefill(const WeightRef& w, const float* x, float* y, int64_t M) override {
    const cuda::DevWeight dw = dev_weight(w, "matmul_prefill");
    // Small dense weights (GDN alpha, beta) stay on the GEMV tiles: two shared-memory tile kernels for
    // them (one per weight, then alpha | beta in one launch) were slower at 512 rows (pp512 5073 vs 5122,
    // then 5383 vs 5419 tok/s, H200, S7-1 / S7-5), and were removed.
    if (M >= cuda::kMatmulPrefillMinRows && cuda::launch_matmul_prefill(dw, x, y, M, stream_))
      note_write(y, sizeof(float) * M * dw.out);
    else
      run_matmul(dw, x, y, M);
    after("matmul_prefill");
  }
  // The weights' row tiles in one tensor-core launch (they fill the same waves); weights it has no kernel
  // for (or DFLASH_CUDA_PREFILL_GROUP=0) go one by one through matmul_prefill.
  void matmul_prefill_group(std::span<const MatmulOut> outs, const float* x, int64_t M) override {
    cuda::DevWeight dws[cuda::kTernaryMaxGroup];
    const cuda::DevWeight* ws[cuda::kTernaryMaxGroup] = {};
    float* ys[cuda::kTernaryMaxGroup] = {};
    const int n = static_cast<int>(outs.size());
    if (prefill_group_ && n >= 2 && n <= cuda::kTernaryMaxGroup && M >= cuda::kMatmulPrefillMinRows) {
      for (int i = 0; i < n; ++i) {
        dws[i] = dev_weight(*outs[i].w, "matmul_prefill_group");
        ws[i] = &dws[i];
        ys[i] = outs[i].y;
      }
      if (cuda::launch_matmul_prefill_group(ws, ys, n, x, M, stream_)) {
        for (int i = 0; i < n; ++i) note_write(ys[i], sizeof(float) * M * dws[i].out);
        after("matmul_prefill_group");
        return;
      }
    }
    Backend::matmul_prefill_group(outs, x, M);
  }
  // ids are device memory: an id outside [0, out) cannot be checked here; its row comes out NaN.
  void get_rows(const WeightRef& w, const int32_t* ids, float* y, int64_t M) override {
    const cuda::DevWeight dw = dev_weight(w, "get_rows");
    cuda::launch_get_rows(dw, ids, y, M, stream_);
    after("get_rows");
  }

  // ---- normalisation ----------------------------------------------------------------------------
  void rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps) override {
    for_row_slices(rows, [&](int64_t r0, int64_t nr) {
      cuda::launch_rms_norm(x + r0 * n, w, y + r0 * n, nr, n, eps, stream_);
    });
    after("rms_norm");
  }
  void l2_norm(const float* x, float* y, int64_t rows, int64_t n, float eps, float scale) override {
    for_row_slices(rows, [&](int64_t r0, int64_t nr) {
      cuda::launch_l2_norm(x + r0 * n, y + r0 * n, nr, n, eps, scale, stream_);
    });
    after("l2_norm");
  }
  void rms_norm_gated(const float* x, const float* w, const float* z, float* y, int64_t rows, int64_t n,
                      float eps) override {
    for_row_slices(rows, [&](int64_t r0, int64_t nr) {
      cuda::launch_rms_norm_gated(x + r0 * n, w, z + r0 * n, y + r0 * n, nr, n, eps, stream_);
    });
    after("rms_norm_gated");
  }

  // ---- elementwise ------------------------------------------------------------------------------
  void add(const float* a, const float* b, float* y, int64_t n) override {
    cuda::launch_add(a, b, y, n, stream_);
    after("add");
  }
  void sum_parts(float* parts, int count, int64_t n) override {
    cuda::launch_sum_parts(parts, count, n, stream_);
    note_write(parts, sizeof(float) * n);
    after("sum_parts");
  }
  void swiglu(const float* gate, const float* up, float* y, int64_t n) override {
    cuda::launch_swiglu(gate, up, y, n, stream_);
    after("swiglu");
  }
  void mul_sigmoid(const float* x, const float* gate, float* y, int64_t n) override {
    cuda::launch_mul_sigmoid(x, gate, y, n, stream_);
    after("mul_sigmoid");
  }
  void copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                 int64_t cols) override {
    cuda::launch_copy_rows(dst, dst_stride, src, src_stride, rows, cols, stream_);
    after("copy_rows");
  }

  void scatter_rows(float* dst, int64_t dst_stride, int64_t dst_rows, const int32_t* idx, const float* src,
                    int64_t src_stride, int64_t M, int64_t cols) override {
    cuda::launch_scatter_rows(dst, dst_stride, dst_rows, idx, src, src_stride, M, cols, stream_);
    after("scatter_rows");
  }

  // ---- step graphs ------------------------------------------------------------------------------
  bool begin_capture() override {
    if (!graphs_) return false;
    DFLASH_CHECK(!capturing_, "cuda: begin_capture inside a capture");
    // Relaxed: the launchers' cudaGetLastError checks are fine during capture.
    DFLASH_CUDA_CALL(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed));
    capturing_ = true;
    xq_.valid = false;  // the capture must hold its own quantization
    return true;
  }
  std::unique_ptr<StepGraph> end_capture() override {
    DFLASH_CHECK(capturing_, "cuda: end_capture without begin_capture");
    capturing_ = false;
    xq_.valid = false;
    cudaGraph_t graph = nullptr;
    DFLASH_CUDA_CALL(cudaStreamEndCapture(stream_, &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    DFLASH_CHECK(err == cudaSuccess, "cuda: instantiating a step graph failed: {}", cudaGetErrorString(err));
    return std::make_unique<CudaStepGraph>(exec, stream_, &xq_.valid);
  }

  // ---- prism Hadamard ---------------------------------------------------------------------------
  void hadamard(const float* x, const float* signs, const int32_t* perm, float* y, int64_t rows, int64_t n,
                int64_t block, bool inverse) override {
    DFLASH_CHECK(!(inverse && perm), "cuda hadamard: a permutation is only defined for the forward transform");
    DFLASH_CHECK(block >= 2 && block <= cuda::kHadamardMaxBlock && (block & (block - 1)) == 0,
                 "cuda hadamard: block size {} is not a power of two in 2..{}", block, cuda::kHadamardMaxBlock);
    DFLASH_CHECK(n > 0 && n % block == 0, "cuda hadamard: row length {} is not a multiple of the block size {}", n,
                 block);
    if (rows <= 0) return;
    const float* src = x;
    if (perm && ranges_overlap(x, y, rows * n)) {  // the gather reads the whole row: work from a copy
      float* tmp = static_cast<float*>(scratch(kScratchHadamard, sizeof(float) * rows * n));
      DFLASH_CUDA_CALL(cudaMemcpyAsync(tmp, x, sizeof(float) * rows * n, cudaMemcpyDeviceToDevice, stream_));
      src = tmp;
    }
    for_row_slices(rows, [&](int64_t r0, int64_t nr) {
      cuda::launch_hadamard(src + r0 * n, signs, perm, y + r0 * n, nr, n, block, inverse, stream_);
    });
    after("hadamard");
  }

  // ---- attention --------------------------------------------------------------------------------
  void rope_neox(float* x, const int32_t* pos, int64_t M, int64_t heads, int64_t head_dim, int64_t n_rot,
                 float theta) override {
    DFLASH_CHECK(n_rot > 0 && n_rot % 2 == 0 && n_rot <= head_dim, "cuda rope: n_rot {} invalid for head_dim {}",
                 n_rot, head_dim);
    for_row_slices(M, [&](int64_t r0, int64_t nr) {
      cuda::launch_rope_neox(x + r0 * heads * head_dim, pos + r0, nr, heads, head_dim, n_rot, theta, stream_);
    });
    after("rope_neox");
  }
  void attention_prep(const AttentionPrep& p) override {
    if (skip_ & kSkipAttention) return;
    const bool fits = p.head_dim > 0 && p.head_dim <= cuda::kAttentionPrepMaxHeadDim && p.n_rot > 0 &&
                      p.n_rot % 2 == 0 && p.n_rot <= p.head_dim && p.n_head_kv > 0 && p.n_head >= 0 &&
                      p.n_head + p.n_head_kv < 65535 && (p.n_head == 0 || (p.q && p.qg));
    if (!fused_prep_ || !fits || p.M > 0x7fffffff) {
      Backend::attention_prep(p);  // the op sequence (and its argument checks)
      return;
    }
    const cuda::AttentionPrepArgs a{p.qg,      p.q,       p.gate,       p.k, p.v,    p.q_norm,  p.k_norm,
                                    p.pos,     p.slot,    p.k_cache,    p.v_cache,   p.cache_rows, p.M,
                                    p.n_head,  p.n_head_kv, p.head_dim, p.n_rot,     p.theta,   p.eps};
    cuda::launch_attention_prep(a, stream_);
    after("attention_prep");
  }
  // kv_range is device memory: a row with hi <= lo gets zeros (the CPU rejects hi < lo).
  void attention(const float* q, const float* k, const float* v, const int32_t* kv_range, float* out, int64_t M,
                 int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale) override {
    DFLASH_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0,
                 "cuda attention: {} heads not a multiple of {} kv heads", n_heads, n_kv_heads);
    DFLASH_CHECK(head_dim > 0 && head_dim <= cuda::kAttentionMaxHeadDim, "cuda attention: head_dim {} outside 1..{}",
                 head_dim, cuda::kAttentionMaxHeadDim);
    DFLASH_CHECK(n_heads <= 65535, "cuda attention: {} heads", n_heads);
    if (M <= 0 || (skip_ & kSkipAttention)) return;
    for_row_slices(M, [&](int64_t r0, int64_t nr) {
      float* part = static_cast<float*>(
          scratch(kScratchAttention, sizeof(float) * cuda::attention_scratch_floats(nr, n_heads, head_dim)));
      cuda::launch_attention(q + r0 * n_heads * head_dim, k, v, kv_range + 2 * r0, out + r0 * n_heads * head_dim, nr,
                             n_heads, n_kv_heads, head_dim, scale, part, stream_);
    });
    after("attention");
  }
  // The segment kernel, then the merge, the gate, the rotation and wo's quantization in one kernel
  // (attention_segments.cu) where the shapes allow (the 27B's 24 heads of 256: one kernel boundary less
  // per attention layer); else attention() and sigmoid_gate_rotate().
  void attention_gate_rotate(const float* q, const float* k, const float* v, const int32_t* kv_range, float* out,
                             const float* gate, float* y, const Rotation& rot, int64_t M, int64_t n_heads,
                             int64_t n_kv_heads, int64_t head_dim, float scale) override {
    const int64_t dim = n_heads * head_dim;
    const bool overlap = out != y && ranges_overlap(out, y, M * dim);  // y == out is fine
    if (gated_attention_ && sigmoid_chain_ && skip_ == 0 && !overlap && n_kv_heads > 0 && n_heads % n_kv_heads == 0 &&
        use_chain(rot, M) && cuda::chain_supported(dim, rot.block, false) &&
        cuda::attention_gate_fusable(M, n_heads, head_dim)) {
      auto* part = static_cast<float*>(
          scratch(kScratchAttention, sizeof(float) * cuda::attention_scratch_floats(M, n_heads, head_dim)));
      void* xq = chain_xq(M, dim);
      if (cuda::launch_attention_gate_rotate(q, k, v, kv_range, out, gate, rot.signs, y, xq, M, n_heads, n_kv_heads,
                                             head_dim, scale, part, rot.block > 0, stream_)) {
        after("attention_gate_rotate");
        if (xq) xq_ = XqKey{y, M, dim, xq, true};
        ++gated_attention_count_;
        return;
      }
    }
    Backend::attention_gate_rotate(q, k, v, kv_range, out, gate, y, rot, M, n_heads, n_kv_heads, head_dim, scale);
  }
  // Prefill chunks: the tensor-core kernel (attention_prefill.cu) where it has one (head dims 64, 128,
  // 256; M >= kAttentionPrefillMinRows), else attention(). No scratch, one launch for all M rows.
  void attention_prefill(const float* q, const float* k, const float* v, const int32_t* kv_range, float* out,
                         int64_t M, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale) override {
    DFLASH_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0,
                 "cuda attention_prefill: {} heads not a multiple of {} kv heads", n_heads, n_kv_heads);
    if (M <= 0) return;
    if (!cuda::launch_attention_prefill(q, k, v, kv_range, out, M, n_heads, n_kv_heads, head_dim, scale, stream_)) {
      attention(q, k, v, kv_range, out, M, n_heads, n_kv_heads, head_dim, scale);
      return;
    }
    after("attention_prefill");
  }

  // ---- Gated DeltaNet ---------------------------------------------------------------------------
  // prefill's q | k | v split and l2 norms as one kernel (DFLASH_CUDA_FUSED_PREP=0: the op sequence)
  void gdn_split_qkv(const float* conv, float* q, float* k, float* v, int64_t M, const GdnShape& sh, float eps,
                     float q_scale) override {
    const int64_t vw = sh.n_v_heads * sh.head_v;
    if (fused_prep_ && cuda::launch_gdn_split_qkv(conv, q, k, v, M, sh.n_k_heads, sh.head_k, vw, eps, q_scale, stream_)) {
      after("gdn_split_qkv");
      return;
    }
    Backend::gdn_split_qkv(conv, q, k, v, M, sh, eps, q_scale);
  }
  void gdn_conv(const float* x, float* state, float* state_before, const float* w, float* y, int64_t M, int64_t C,
                int64_t K) override {
    DFLASH_CHECK(K >= 1 && K <= 16, "cuda gdn_conv: kernel size {} outside 1..16", K);
    if (skip_ & kSkipGdn) return;
    cuda::launch_gdn_conv(x, state, state_before, w, y, M, C, K, stream_);
    after("gdn_conv");
  }
  // One launch for the small projections (the split group's kernel) and the conv, up to 8 rows
  // (DFLASH_CUDA_CONV_MATMULS=0: matmul_group, then gdn_conv).
  void gdn_conv_and_matmuls(std::span<const MatmulOut> outs, const float* mx, const float* x, float* state,
                            float* state_before, const float* w, float* y, int64_t M, int64_t C, int64_t K) override {
    const bool skipping = skip_ & (kSkipMatmul | kSkipStream | kSkipGdn);  // diagnostics: the ops apart
    if (conv_matmuls_ && split_group_ && !skipping && outs.size() <= static_cast<size_t>(cuda::kTernaryMaxGroup)) {
      cuda::DevWeight dws[cuda::kTernaryMaxGroup];
      const cuda::DevWeight* ws[cuda::kTernaryMaxGroup] = {};
      float* ys[cuda::kTernaryMaxGroup] = {};
      gather_group(outs, "gdn_conv_and_matmuls", dws, ws, ys);
      const int n = static_cast<int>(outs.size());
      if (cuda::launch_split_group_gdn_conv(ws, ys, n, mx, M, x, state, state_before, w, y, C, K, stream_)) {
        note_group_writes(dws, ys, n, M);
        note_write(y, sizeof(float) * M * C);
        after("gdn_conv_and_matmuls");
        return;
      }
    }
    Backend::gdn_conv_and_matmuls(outs, mx, x, state, state_before, w, y, M, C, K);
  }
  void gdn_input(const WeightRef& w_qkv, const WeightRef& w_z, const float* x, float* conv_in, float* z,
                 std::span<const MatmulOut> ab, const float* mx, float* state, float* state_before, const float* conv_w,
                 float* conv_out, int64_t M, int64_t C, int64_t K) override {
    const cuda::DevWeight dq = dev_weight(w_qkv, "gdn_input"), dz = dev_weight(w_z, "gdn_input");
    cuda::DevWeight dws[cuda::kTernaryMaxGroup];
    const cuda::DevWeight* ws[cuda::kTernaryMaxGroup] = {};
    float* ys[cuda::kTernaryMaxGroup] = {};
    const int n = static_cast<int>(ab.size());
    // skip_: the diagnostics time the ops apart
    bool fused = gdn_input_fused_ && !skip_ && n >= 1 && n <= cuda::kTernaryMaxGroup;
    if (fused) {
      gather_group(ab, "gdn_input", dws, ws, ys);
      fused = cuda::gdn_input_fusable(dq, dz, ws, n, M, C, K, num_sms_);
    }
    if (!fused) {
      Backend::gdn_input(w_qkv, w_z, x, conv_in, z, ab, mx, state, state_before, conv_w, conv_out, M, C, K);
      return;
    }
    const cuda::TernaryBuffers buf = matmul_buffers(cuda::ternary_scratch(dq.in, M), x, M, dq.in);
    const bool launched = cuda::launch_gdn_input(dq, dz, x, conv_in, z, ws, ys, n, mx, state, state_before, conv_w,
                                                 conv_out, M, C, K, buf, num_sms_, stream_);
    DFLASH_CHECK(launched, "cuda gdn_input: the launch refused shapes gdn_input_fusable accepted");
    after("gdn_input");
    ++gdn_input_fused_count_;
  }
  void gdn_gates(float* a, float* b, const float* dt_bias, const float* ssm_a, int64_t M,
                 int64_t n_v_heads) override {
    cuda::launch_gdn_gates(a, b, dt_bias, ssm_a, M, n_v_heads, stream_);
    after("gdn_gates");
  }
  void gdn_recurrent(const float* q, const float* k, const float* v, const float* g, const float* beta,
                     const float* state_in, float* state, float* out, float* snapshots, int64_t M,
                     const GdnShape& s) override {
    check_gdn(s, "gdn_recurrent");
    if (skip_ & kSkipGdn) return;
    cuda::launch_gdn_recurrent(q, k, v, g, beta, state_in, state, out, snapshots, M, s.n_k_heads, s.n_v_heads,
                               s.head_k, s.head_v, stream_);
    after("gdn_recurrent");
  }
  void gdn_apply_rows_batch(std::span<const GdnApplyJob> jobs, int64_t M, const GdnShape& s) override {
    if (jobs.empty() || M <= 0) return;  // a model without GDN layers (qwen3) keeps no recurrent rows
    check_gdn(s, "gdn_apply_rows_batch");
    if (skip_ & kSkipGdn) return;
    std::vector<cuda::GdnApplyJobRef> refs;
    refs.reserve(jobs.size());
    for (const GdnApplyJob& j : jobs) {
      DFLASH_CHECK(j.k && j.g && j.delta && j.state, "cuda gdn_apply_rows_batch: job {} has a null input or state",
                   refs.size());
      refs.push_back({j.k, j.g, j.delta, j.state});
    }
    cuda::launch_gdn_apply_rows_batch(refs.data(), static_cast<int>(refs.size()), M, s.n_k_heads, s.n_v_heads,
                                      s.head_k, s.head_v, stream_);
    after("gdn_apply_rows_batch");
  }
  void gdn_prepare_recurrent(const GdnRawInputs& in, float* state, float* out, const GdnPrepared* prepared,
                             int64_t M, const GdnShape& s) override {
    check_gdn(s, "gdn_prepare_recurrent");
    if (skip_ & kSkipGdn) return;
    const int64_t nqk = s.n_k_heads * s.head_k, nv = s.n_v_heads * s.head_v;
    DFLASH_CHECK(in.q_stride >= nqk && in.k_stride >= nqk && in.v_stride >= nv,
                 "cuda gdn_prepare_recurrent: row strides q {} k {} v {} below the row widths {} / {}", in.q_stride,
                 in.k_stride, in.v_stride, nqk, nv);
    const GdnPrepared none;
    const GdnPrepared& p = prepared ? *prepared : none;
    DFLASH_CHECK(!prepared || (p.q && p.k && p.g && p.beta),
                 "cuda gdn_prepare_recurrent: prepared needs all four buffers (q, k, g, beta)");
    cuda::launch_gdn_prepare_recurrent(in.q, in.q_stride, in.k, in.k_stride, in.v, in.v_stride, in.a, in.b, in.dt_bias,
                                       in.ssm_a, kGdnL2Eps, 1.0f / std::sqrt(static_cast<float>(s.head_k)), state, out,
                                       p.q, p.k, p.g, p.beta, p.delta, M, s.n_k_heads, s.n_v_heads,
                                       s.head_k, s.head_v, stream_);
    after("gdn_prepare_recurrent");
  }
  // Prefill: the chunked WY kernels (gdn_chunked.cu) for heads up to 128, else the recurrence (allowed
  // by the contract). Rows go in slices of 512 (a multiple of the 64-row chunk, so slicing does not move
  // a chunk boundary and gives the bits of one call) to bound the scratch: 48 heads x 512 rows = 31 MB.
  // The scratch shares the attention slot: both are used only inside their own op on this stream.
  void gdn_chunked(const float* q, const float* k, const float* v, const float* g, const float* beta, float* state,
                   float* out, int64_t M, const GdnShape& s) override {
    check_gdn(s, "gdn_chunked");
    if (s.head_k <= cuda::kGdnChunkedMaxHead && s.head_v <= cuda::kGdnChunkedMaxHead) {
      constexpr int64_t kSlice = 512;
      for (int64_t r0 = 0; r0 < M; r0 += kSlice) {
        const int64_t nr = std::min(kSlice, M - r0);
        float* tmp = static_cast<float*>(scratch(
            kScratchAttention, sizeof(float) * cuda::gdn_chunked_scratch_floats(nr, s.n_v_heads, s.head_k, s.head_v)));
        cuda::launch_gdn_chunked(q + r0 * s.n_k_heads * s.head_k, k + r0 * s.n_k_heads * s.head_k,
                                 v + r0 * s.n_v_heads * s.head_v, g + r0 * s.n_v_heads, beta + r0 * s.n_v_heads, state,
                                 out + r0 * s.n_v_heads * s.head_v, nr, s.n_k_heads, s.n_v_heads, s.head_k, s.head_v,
                                 tmp, stream_);
      }
    } else {
      cuda::launch_gdn_recurrent(q, k, v, g, beta, state, state, out, nullptr, M, s.n_k_heads, s.n_v_heads,
                                 s.head_k, s.head_v, stream_);
    }
    after("gdn_chunked");
  }

  // ---- sampling ---------------------------------------------------------------------------------
  void argmax(const float* x, int32_t* ids, int64_t M, int64_t n) override {
    DFLASH_CHECK(n > 0 && n <= INT32_MAX, "cuda argmax: row length {}", n);
    for_row_slices(M, [&](int64_t r0, int64_t nr) {
      void* s = scratch(kScratchArgmax, cuda::argmax_scratch_bytes(nr));
      cuda::launch_argmax(x + r0 * n, ids + r0, nr, n, s, stream_);
    });
    after("argmax");
  }
  void top_k(const float* x, int32_t* ids, float* vals, int64_t M, int64_t n, int64_t k) override {
    DFLASH_CHECK(k > 0 && k <= n, "cuda top_k: k = {} outside [1, {}]", k, n);
    DFLASH_CHECK(k <= cuda::kTopKMax, "cuda top_k: k = {} above the supported {}", k, cuda::kTopKMax);
    DFLASH_CHECK(n <= INT32_MAX, "cuda top_k: row length {}", n);
    for_row_slices(M, [&](int64_t r0, int64_t nr) {
      void* s = scratch(kScratchTopK, cuda::topk_scratch_bytes(nr, n, k));
      cuda::launch_top_k(x + r0 * n, ids + r0 * k, vals + r0 * k, nr, n, k, s, stream_);
    });
    after("top_k");
  }

  // ---- DFlash drafter ---------------------------------------------------------------------------
  void dflash_conv(const float* x, const float* base, const float* d, int64_t d_stride, const float* res, float* y,
                   int64_t M, int64_t C, int64_t K, int64_t group) override {
    run_dflash_conv(x, 1, base, d, d_stride, res, y, M, C, K, group);
  }
  void dflash_conv_parts(float* x, int x_parts, const float* base, const float* d, int64_t d_stride, const float* res,
                         float* y, int64_t M, int64_t C, int64_t K, int64_t group) override {
    run_dflash_conv(x, std::max(x_parts, 1), base, d, d_stride, res, y, M, C, K, group);
  }
  // dflash_conv of x given as x_parts parts [x_parts][M][C] (1: x itself).
  void run_dflash_conv(const float* x, int x_parts, const float* base, const float* d, int64_t d_stride,
                       const float* res, float* y, int64_t M, int64_t C, int64_t K, int64_t group) {
    DFLASH_CHECK(K >= 1 && group >= 1 && C % group == 0, "cuda dflash_conv: C {} not a multiple of group {} (K {})",
                 C, group, K);
    DFLASH_CHECK(C < (int64_t{1} << 31), "cuda dflash_conv: {} channels (the kernels' channel index is 32-bit)", C);
    DFLASH_CHECK(x != y, "cuda dflash_conv: x must not alias y");
    DFLASH_CHECK(d_stride >= K * (C / group), "cuda dflash_conv: coefficient row stride {} < K*G = {}", d_stride,
                 K * (C / group));
    DFLASH_CHECK(M <= 65535, "cuda dflash_conv: {} rows", M);
    // Without a residual the output feeds q | k | v or gate | up: quantize it for them in the same kernel
    // (a plain chain; DFLASH_CUDA_CHAIN_PLAIN=0 leaves it to the matmul). 10 launches fewer per draft step
    // of the 27B drafter; the step's time moved by less than the noise (1.301, 1.298 vs 1.299-1.304 ms, S7-9).
    if (x_parts == 1 && !res && chain_ && chain_plain_ && cuda::dflash_conv_quantize_supported(C, M) &&
        reinterpret_cast<uintptr_t>(y) % 16 == 0) {
      run_chain(y, M, C, "dflash_conv", [&](void* xq) {
        cuda::launch_dflash_conv_quantize(x, base, d, d_stride, y, xq, M, C, K, group, stream_);
      });
      return;
    }
    cuda::launch_dflash_conv(x, x_parts, base, d, d_stride, res, y, M, C, K, group, stream_);
    after("dflash_conv");
  }
  void selector_walk(const float* pred, const float* succ, const int32_t* cand, const float* unary, const float* g,
                     int32_t* out, int64_t rows, int64_t top_k, int64_t rank) override {
    DFLASH_CHECK(rows >= 1 && top_k >= 1 && rank >= 1 && rows <= INT32_MAX && rank <= INT32_MAX,
                 "cuda selector_walk: rows {}, top_k {}, rank {}", rows, top_k, rank);
    DFLASH_CHECK(top_k <= cuda::kSelectorMaxTopK, "cuda selector_walk: top_k {} above the supported {}", top_k,
                 cuda::kSelectorMaxTopK);
    void* scores = scratch(kScratchSelector, cuda::selector_walk_scratch_bytes(rows, top_k));
    cuda::launch_selector_walk(pred, succ, cand, unary, g, out, rows, top_k, rank, scores, stream_);
    after("selector_walk");
  }

  // ---- diagnostics ------------------------------------------------------------------------------
  cudaStream_t stream() const { return stream_; }
  size_t weight_bytes(const WeightRef& w) const {
    auto it = weight_bytes_.find(w.data);
    return it == weight_bytes_.end() ? w.row_bytes * w.out : it->second;
  }
  std::string layout_name(const WeightRef& w) const {
    auto it = weights_.find(w.data);
    if (it == weights_.end()) return "blocks (raw)";
    switch (it->second.layout) {
      case cuda::Layout::kTernaryMma: return "ternary-mma";
      case cuda::Layout::kKQuantMma: return "kquant-mma";
      case cuda::Layout::kPlanar2: return "planar-2bit";
      default: return "blocks";
    }
  }
  void* bench_scratch(size_t bytes) { return scratch(kScratchBench, bytes); }
  int64_t xq_reused() const { return xq_reused_; }
  int64_t gdn_input_fused_count() const { return gdn_input_fused_count_; }
  int64_t gated_attention_count() const { return gated_attention_count_; }

 private:
  enum ScratchSlot {
    kScratchHadamard,
    kScratchAttention,
    kScratchArgmax,
    kScratchTopK,
    kScratchMatmulXq,
    kScratchMatmulTail,
    kScratchBench,
    kScratchSelector,
    kScratchSink,
    kNumScratch
  };
  struct ScratchBuf {
    void* ptr = nullptr;
    size_t bytes = 0;
  };

  void* device_alloc(size_t bytes, const char* what) {
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, std::max<size_t>(bytes, 256));
    DFLASH_CHECK(err == cudaSuccess, "cuda: out of device memory allocating {} bytes for {}: {}", bytes, what,
                 cudaGetErrorString(err));
    return p;
  }

  // Grow-only scratch per slot (a step's shapes are fixed, so this settles after the first step).
  // A buffer that is outgrown stays allocated until the backend goes: a captured graph may hold it.
  void* scratch(ScratchSlot slot, size_t bytes) {
    ScratchBuf& b = scratch_[slot];
    if (b.bytes < bytes) {
      DFLASH_CHECK(!capturing_, "cuda: scratch grows from {} to {} bytes during a graph capture (run the step once "
                   "before capturing it)", b.bytes, bytes);
      if (b.ptr) retired_.push_back(b.ptr);
      b.ptr = device_alloc(bytes, "scratch");
      DFLASH_CUDA_CALL(cudaMemsetAsync(b.ptr, 0, bytes, stream_));  // scratch starts zeroed
      b.bytes = bytes;
    }
    return b.ptr;
  }

  // Quantized-activation cache: consecutive ternary matmuls of the same input (qkv, gate, alpha, beta;
  // ffn gate, up; attention q, k, v) quantize it once. Any op that may write device memory drops it
  // (after(), captures, graph launches); a matmul drops it when its output overlaps the input.
  struct XqKey {
    const float* x = nullptr;
    int64_t M = 0, K = 0;
    const void* buf = nullptr;
    bool valid = false;
  };

  // Returns the parts written to y (launch_matmul_parts; max_parts 1: y itself).
  int run_matmul(const cuda::DevWeight& dw, const float* x, float* y, int64_t M, int max_parts = 1) {
    const cuda::TernaryScratch need = cuda::matmul_scratch(dw, M);
    cuda::TernaryBuffers buf = matmul_buffers(need, x, M, dw.in);
    const int parts = cuda::launch_matmul_parts(dw, x, y, M, buf, num_sms_, max_parts, stream_);
    if (need.xq_bytes) xq_ = XqKey{x, M, dw.in, buf.xq, true};
    note_write(y, sizeof(float) * parts * M * dw.out);
    return parts;
  }
  // The ternary kernel's scratch; xq_ready when the cache holds x's quantization already.
  cuda::TernaryBuffers matmul_buffers(const cuda::TernaryScratch& need, const float* x, int64_t M, int64_t K) {
    cuda::TernaryBuffers buf;
    if (need.xq_bytes) {
      buf.xq = scratch(kScratchMatmulXq, need.xq_bytes);
      buf.xq_ready = xq_.valid && xq_.x == x && xq_.M == M && xq_.K == K && xq_.buf == buf.xq && M <= 65535;
      xq_reused_ += buf.xq_ready;
      buf.tail = scratch(kScratchMatmulTail, cuda::mma_tail_scratch_bytes());
    }
    return buf;
  }
  // The device weights of a group's outputs (outs.size() <= kTernaryMaxGroup): dws[i], ws[i] = &dws[i], ys[i].
  void gather_group(std::span<const MatmulOut> outs, const char* op, cuda::DevWeight* dws,
                    const cuda::DevWeight** ws, float** ys) const {
    for (size_t i = 0; i < outs.size(); ++i) {
      dws[i] = dev_weight(*outs[i].w, op);
      ws[i] = &dws[i];
      ys[i] = outs[i].y;
    }
  }
  void note_group_writes(const cuda::DevWeight* dws, float* const* ys, int n, int64_t M) {
    for (int i = 0; i < n; ++i) note_write(ys[i], sizeof(float) * M * dws[i].out);
  }
  // Drops the quantized-activation cache when [p, p + bytes) overlaps the cached input.
  void note_write(const void* p, size_t bytes) {
    const auto xb = reinterpret_cast<uintptr_t>(xq_.x), pb = reinterpret_cast<uintptr_t>(p);
    if (xq_.valid && pb < xb + sizeof(float) * xq_.M * xq_.K && xb < pb + bytes) xq_.valid = false;
  }

  cuda::DevWeight dev_weight(const WeightRef& w, const char* op) const {
    DFLASH_CHECK(w.valid(), "cuda {}: invalid weight", op);
    auto it = weights_.find(w.data);
    if (it != weights_.end()) return it->second;
    // A WeightRef not made by upload_weight: the file's block layout in backend memory.
    DFLASH_CHECK(cuda::matmul_supported(static_cast<int>(w.type)), "cuda {}: no kernel for weight type {}", op,
                 type_name(w.type));
    cuda::DevWeight dw;
    dw.data = static_cast<const uint8_t*>(w.data);
    dw.type = static_cast<int>(w.type);
    dw.layout = cuda::Layout::kBlocks;
    dw.in = w.in;
    dw.out = w.out;
    dw.row_stride = w.row_bytes ? w.row_bytes : row_bytes(w.type, w.in);
    return dw;
  }

  static void check_gdn(const GdnShape& s, const char* op) {
    DFLASH_CHECK(s.n_k_heads > 0 && s.n_v_heads > 0 && s.n_v_heads % s.n_k_heads == 0 && s.head_k > 0 &&
                     s.head_v > 0,
                 "cuda {}: bad GDN shape (k heads {}, v heads {}, head_k {}, head_v {})", op, s.n_k_heads,
                 s.n_v_heads, s.head_k, s.head_v);
    DFLASH_CHECK(s.head_k <= cuda::kGdnMaxHeadK && s.n_v_heads <= 65535, "cuda {}: head_k {} above {}", op, s.head_k,
                 cuda::kGdnMaxHeadK);
  }

  // Ops that put rows on grid.y run in slices of at most 65535 rows.
  template <typename F>
  void for_row_slices(int64_t rows, F&& f) {
    constexpr int64_t kSlice = 65535;
    for (int64_t r0 = 0; r0 < rows; r0 += kSlice) f(r0, std::min(kSlice, rows - r0));
  }

  // Diagnostics, never for results: DFLASH_CUDA_SKIP=matmul,chain,attention,gdn (any of them) leaves
  // those ops out (their outputs keep whatever the buffers held), =stream replaces each decode / verify
  // matmul (and group) by a bare read of its weights' bytes, =chainbody each chain by an empty kernel,
  // =normcluster the residual norm chain's cluster by a CTA-local sum (each chunk normed by its own
  // sum of squares: what the chain would cost if it needed no exchange between its CTAs).
  // Timing the step graphs with one class left out places that class's share of the real, overlapped
  // step, which ncu (kernels run alone) cannot.
  enum : unsigned { kSkipMatmul = 1, kSkipStream = 2, kSkipChain = 4, kSkipAttention = 8, kSkipGdn = 16,
                    kSkipChainBody = 32, kSkipNormCluster = 64 };
  static unsigned parse_skip() {
    const char* v = std::getenv("DFLASH_CUDA_SKIP");
    if (!v) return 0;
    unsigned m = 0;
    std::string_view s(v);
    while (!s.empty()) {
      const size_t c = s.find(',');
      const std::string_view t = s.substr(0, c);
      if (t == "matmul") m |= kSkipMatmul;
      else if (t == "stream") m |= kSkipStream;
      else if (t == "chain") m |= kSkipChain;
      else if (t == "attention") m |= kSkipAttention;
      else if (t == "gdn") m |= kSkipGdn;
      else if (t == "chainbody") m |= kSkipChainBody;
      else if (t == "normcluster") m |= kSkipNormCluster;
      else if (!t.empty())
        fail("DFLASH_CUDA_SKIP: unknown class '{}' (matmul, stream, chain, chainbody, normcluster, attention, gdn)", t);
      s = c == std::string_view::npos ? std::string_view() : s.substr(c + 1);
    }
    if (m) fmt::print(stderr, "warning: DFLASH_CUDA_SKIP={} (a timing diagnostic: results are wrong)\n", v);
    return m;
  }
  // True when the chain is left out (chain) or replaced by an empty kernel (chainbody: the cost of one
  // more kernel boundary in the step).
  bool skipped_chain() {
    if (skip_ & kSkipChainBody) cuda::launch_empty(stream_);
    return skip_ & (kSkipChain | kSkipChainBody);
  }
  // True when the matmul of these weights is left out or replaced by a read of their bytes.
  bool skipped_matmul(const cuda::DevWeight* dws, int n) {
    if (!(skip_ & (kSkipMatmul | kSkipStream))) return false;
    if (skip_ & kSkipStream) {
      const void* src[cuda::kTernaryMaxGroup];
      size_t n16[cuda::kTernaryMaxGroup];
      n = std::min(n, cuda::kTernaryMaxGroup);
      for (int i = 0; i < n; ++i) {
        auto it = weight_bytes_.find(dws[i].data);
        src[i] = dws[i].data;
        n16[i] = (it == weight_bytes_.end() ? 0 : it->second) / 16;
      }
      auto* sink = static_cast<unsigned*>(scratch(kScratchSink, sizeof(unsigned) * 4096));
      cuda::launch_stream_weights(src, n16, n, sink, stream_);
    }
    after("matmul");
    return true;
  }

  void not_capturing(const char* what) const {
    DFLASH_CHECK(!capturing_, "cuda: {} is not allowed while a step graph is being captured", what);
  }

  // Launch check after every op; with DFLASH_CUDA_DEBUG also waits so a fault names its op.
  void after(const char* op) {
    if (std::string_view(op) != "matmul" && std::string_view(op) != "matmul_prefill") xq_.valid = false;
    cudaError_t err = cudaGetLastError();
    if (err == cudaSuccess && debug_) err = cudaStreamSynchronize(stream_);
    if (err != cudaSuccess) fail("cuda {}: {} ({})", op, cudaGetErrorString(err), cudaGetErrorName(err));
  }

  int device_ = 0;
  int num_sms_ = 1;
  size_t smem_optin_ = 48 * 1024;  // shared memory per block with the opt-in attribute
  cudaStream_t stream_ = nullptr;
  std::string desc_;
  bool debug_ = false;
  std::unordered_map<const void*, cuda::DevWeight> weights_;
  std::unordered_map<const void*, size_t> weight_bytes_;
  std::vector<void*> weight_allocs_;
  ScratchBuf scratch_[kNumScratch];
  std::vector<void*> retired_;  // outgrown scratch buffers (graphs may still read them)
  XqKey xq_;
  int64_t gated_attention_count_ = 0;  // attention_gate_rotate calls run fused (diagnostics, tests)
  int64_t gdn_input_fused_count_ = 0;  // gdn_input calls run as one launch (diagnostics, tests)
  int64_t xq_reused_ = 0;  // ternary matmuls that found their input quantized already (diagnostics)
  bool graphs_ = true;
  bool ternary_mma_ = true;
  bool chain_ = true;
  bool conv_matmuls_ = true;
  bool gdn_input_fused_ = true;
  bool gated_attention_ = true;
  bool kquant_mma_ = true;
  bool fused_prep_ = true;
  bool split_group_ = true;
  bool mm_parts_ = true;
  bool chain_plain_ = true;
  bool gated_chain_ = true;
  bool prefill_xq_ = false;
  bool sigmoid_chain_ = true;
  bool prefill_group_ = true;
  unsigned skip_ = 0;
  bool capturing_ = false;
};

CudaBackend& as_cuda(Backend& be) {
  auto* c = dynamic_cast<CudaBackend*>(&be);
  DFLASH_CHECK(c != nullptr, "not a CUDA backend: {}", be.name());
  return *c;
}

}  // namespace

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

std::string cuda_device_description(int device) {
  const int n = cuda_device_count();
  DFLASH_CHECK(device >= 0 && device < n, "cuda: no CUDA device {} ({} device(s) found)", device, n);
  cudaDeviceProp p{};
  DFLASH_CUDA_CALL(cudaGetDeviceProperties(&p, device));
  return fmt::format("{} (sm_{}{}, {} SMs, {:.1f} GiB, L2 {} MiB)", p.name, p.major, p.minor, p.multiProcessorCount,
                     static_cast<double>(p.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0), p.l2CacheSize >> 20);
}

std::unique_ptr<Backend> make_cuda_backend(int device) { return std::make_unique<CudaBackend>(device); }

namespace cuda {

bool env_flag(const char* name, bool dflt) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return dflt;
  return std::string_view(v) != "0";
}

int env_int(const char* name, int dflt) {
  const char* v = std::getenv(name);
  return v == nullptr || *v == '\0' ? dflt : std::atoi(v);
}

int current_sm_count() {
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

bool pdl_enabled() {
  static const bool on = env_flag("DFLASH_CUDA_PDL", true);
  return on;
}

size_t weight_device_bytes(Backend& be, const WeightRef& w) { return as_cuda(be).weight_bytes(w); }
std::string weight_layout(Backend& be, const WeightRef& w) { return as_cuda(be).layout_name(w); }
int64_t quantizations_reused(Backend& be) { return as_cuda(be).xq_reused(); }
int64_t gdn_input_launches(Backend& be) { return as_cuda(be).gdn_input_fused_count(); }
int64_t gated_attention_launches(Backend& be) { return as_cuda(be).gated_attention_count(); }
int64_t matmul_tail_launches() { return mma_tail_launches(); }


double time_ms(Backend& be, int warmup, int iters, const std::function<void()>& fn) {
  CudaBackend& c = as_cuda(be);
  for (int i = 0; i < warmup; ++i) fn();
  c.synchronize();
  cudaEvent_t a, b;
  DFLASH_CUDA_CALL(cudaEventCreate(&a));
  DFLASH_CUDA_CALL(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = 0; i < iters; ++i) {
    DFLASH_CUDA_CALL(cudaEventRecord(a, c.stream()));
    fn();
    DFLASH_CUDA_CALL(cudaEventRecord(b, c.stream()));
    DFLASH_CUDA_CALL(cudaEventSynchronize(b));
    float ms = 0;
    DFLASH_CUDA_CALL(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t.empty() ? 0.0 : t[t.size() / 2];
}

double time_graph_ms(Backend& be, int batch, int iters, const std::function<void()>& fn) {
  CudaBackend& c = as_cuda(be);
  batch = std::max(batch, 1);
  fn();  // once directly: scratch buffers reach their size outside the capture
  c.synchronize();
  std::unique_ptr<StepGraph> graph;
  if (c.begin_capture()) {
    try {
      for (int i = 0; i < batch; ++i) fn();
    } catch (...) {
      c.end_capture();
      throw;
    }
    graph = c.end_capture();
  }
  const double ms = time_ms(be, 2, iters, [&] {
    if (graph)
      graph->launch();
    else
      for (int i = 0; i < batch; ++i) fn();  // graphs disabled (DFLASH_CUDA_GRAPHS=0): plain launches
  });
  return ms / batch;
}

void profiler_range(bool start) {
  if (start)
    cudaProfilerStart();
  else
    cudaProfilerStop();
}

double read_bandwidth_gbps(Backend& be, size_t bytes, int iters) {
  CudaBackend& c = as_cuda(be);
  bytes = bytes / 16 * 16;
  void* buf = c.alloc(bytes);
  DFLASH_CUDA_CALL(cudaMemsetAsync(buf, 0x5a, bytes, c.stream()));
  auto* sink = static_cast<unsigned*>(c.alloc(sizeof(unsigned) * 65536));
  const double ms = time_ms(be, 2, iters, [&] {
    launch_read_kernel(buf, bytes / 16, sink, c.stream());
    const cudaError_t err = cudaGetLastError();
    DFLASH_CHECK(err == cudaSuccess, "cuda read kernel: {}", cudaGetErrorString(err));
  });
  c.release(sink);
  c.release(buf);
  return static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
}

double kernel_boundary_us(Backend& be, int sync, const std::vector<int>& ctas, int links, int iters) {
  CudaBackend& c = as_cuda(be);
  DFLASH_CHECK(!ctas.empty() && links > 0 && sync >= 0 && sync <= 2, "kernel_boundary_us: bad arguments");
  const size_t row = sizeof(float) * kBoundaryWidth;
  auto* a = static_cast<float*>(c.alloc(row));
  auto* b = static_cast<float*>(c.alloc(row));
  auto* arrivals = static_cast<unsigned*>(c.alloc(sizeof(unsigned) * links));
  DFLASH_CUDA_CALL(cudaMemsetAsync(a, 0, row, c.stream()));
  DFLASH_CUDA_CALL(cudaMemsetAsync(b, 0, row, c.stream()));
  const auto n = static_cast<int>(ctas.size());
  const double ms = time_graph_ms(be, 1, iters, [&] {
    if (sync == 2) DFLASH_CUDA_CALL(cudaMemsetAsync(arrivals, 0, sizeof(unsigned) * links, c.stream()));
    for (int i = 0; i < links; ++i)
      launch_boundary_link(sync, ctas[i % n], (i & 1) ? b : a, (i & 1) ? a : b, arrivals, i,
                           ctas[(i + n - 1) % n], c.stream());
    const cudaError_t err = cudaGetLastError();
    DFLASH_CHECK(err == cudaSuccess, "cuda boundary chain: {}", cudaGetErrorString(err));
  });
  c.synchronize();
  c.release(arrivals);
  c.release(b);
  c.release(a);
  return ms * 1e3 / links;
}


namespace {
// One device buffer holding every op's bytes back to back (16-byte words), and the op bounds.
struct OpBuffers {
  CudaBackend& c;
  void* data = nullptr;
  unsigned long long* bounds = nullptr;
  std::vector<unsigned long long> host_bounds;
  OpBuffers(CudaBackend& be, const std::vector<size_t>& op_bytes) : c(be) {
    host_bounds.push_back(0);
    for (size_t b : op_bytes) host_bounds.push_back(host_bounds.back() + b / 16);
    data = c.alloc(std::max<size_t>(16, host_bounds.back() * 16));
    DFLASH_CUDA_CALL(cudaMemsetAsync(data, 0x5a, host_bounds.back() * 16, c.stream()));
    bounds = static_cast<unsigned long long*>(c.alloc(host_bounds.size() * sizeof(unsigned long long)));
    c.upload(bounds, host_bounds.data(), host_bounds.size() * sizeof(unsigned long long));
  }
  ~OpBuffers() {
    c.release(bounds);
    c.release(data);
  }
};
}  // namespace

size_t ternary_device_bytes(int64_t in, int64_t out) { return ternary_code_bytes(in, out) + ternary_scale_bytes(in, out); }

double persistent_stream_ms(Backend& be, const std::vector<size_t>& op_bytes, int ctas_per_sm, int head_bytes,
                            bool release, int iters, int* ctas_used) {
  CudaBackend& c = as_cuda(be);
  DFLASH_CHECK(!op_bytes.empty() && ctas_per_sm > 0 && head_bytes >= 0 && head_bytes % 16 == 0,
               "persistent_stream_ms: bad arguments");
  const int ctas = persistent_stream_ctas(ctas_per_sm, head_bytes);
  if (ctas_used) *ctas_used = ctas;
  if (ctas <= 0) return -1.0;  // that much shared memory does not fit
  OpBuffers ops(c, op_bytes);
  const int n = static_cast<int>(op_bytes.size());
  const size_t counter_bytes = sizeof(unsigned) * persistent_stream_counter_words(n);
  auto* counters = static_cast<unsigned*>(c.alloc(counter_bytes));
  auto* sink = static_cast<unsigned*>(c.alloc(sizeof(unsigned) * ctas));
  const double ms = time_ms(be, 2, iters, [&] {
    DFLASH_CUDA_CALL(cudaMemsetAsync(counters, 0, counter_bytes, c.stream()));
    DFLASH_CUDA_CALL(
        launch_persistent_stream(ops.data, ops.bounds, n, counters, head_bytes, ctas, release, sink, c.stream()));
  });
  c.synchronize();
  c.release(sink);
  c.release(counters);
  return ms;
}

double op_chain_stream_ms(Backend& be, const std::vector<size_t>& op_bytes, int iters) {
  CudaBackend& c = as_cuda(be);
  DFLASH_CHECK(!op_bytes.empty(), "op_chain_stream_ms: no ops");
  OpBuffers ops(c, op_bytes);
  auto* sink = static_cast<unsigned*>(c.alloc(sizeof(unsigned) * 4096));
  const double ms = time_graph_ms(be, 1, iters, [&] {
    for (size_t i = 0; i < op_bytes.size(); ++i) {
      const size_t n16 = ops.host_bounds[i + 1] - ops.host_bounds[i];
      if (n16 == 0) {
        launch_empty(c.stream());
      } else {
        const void* src = static_cast<const uint8_t*>(ops.data) + ops.host_bounds[i] * 16;
        launch_stream_weights(&src, &n16, 1, sink, c.stream());
      }
    }
    const cudaError_t err = cudaGetLastError();
    DFLASH_CHECK(err == cudaSuccess, "cuda op chain: {}", cudaGetErrorString(err));
  });
  c.synchronize();
  c.release(sink);
  return ms;
}

}  // namespace cuda
}  // namespace dflash
