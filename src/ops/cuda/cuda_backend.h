// The CUDA backend (src/ops/cuda/): every Backend op on one NVIDIA GPU, enqueued on one stream.
//
// This header is plain C++ (no CUDA headers), so the CLI, tests and benchmarks include it whatever
// compiler builds them. It exists in builds with DFLASH_HAVE_CUDA only.
//
// Design (see each .cu file for its kernels):
//  - memory: cudaMalloc'd device memory (never managed memory); upload/copy/fill are async on the
//    backend's stream; download and synchronize wait.
//  - weights: upload_weight copies the file's bytes to the device. PQ2_0 and PTQ1_0 are transcoded
//    on the device to 2-bit codes in the tensor-core fragment order of matmul_ternary.cu (PTQ1_0's
//    base-3 trits too: SPEC 8, the base-3 unpack is ALU-heavy; an H200 has memory to spare). Every
//    other type keeps the file's block layout.
//  - lossless (SPEC 5.5): every kernel computes one output row from that row's data with a reduction
//    order fixed by the op's sizes; the number of rows M only changes the grid. In particular each
//    matmul output y[m][o] is one fixed sequence of fp32 fmas (lane -> K positions fixed by K, fixed
//    per-lane order, fixed warp butterfly), so M rows give the bits of M one-row calls.
//  - CUDA results are not the CPU's bits (other reduction orders); tests/cuda bounds the difference.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ops/backend.h"

namespace dflash {

// Number of usable CUDA devices (0 when there is no driver or no GPU; never throws).
int cuda_device_count();
// "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB)" — throws dflash::Error for a bad device.
std::string cuda_device_description(int device);

// The CUDA backend on `device`. Throws dflash::Error when the device does not exist or CUDA fails.
// Environment: DFLASH_CUDA_DEBUG=1 synchronizes after every op so an asynchronous error names the op.
std::unique_ptr<Backend> make_cuda_backend(int device = 0);

namespace cuda {

// Diagnostics for tests and benchmarks (the backend must be a CUDA backend).
// Bytes of device memory the backend holds for weights (after any transcoding).
size_t weight_device_bytes(Backend& be, const WeightRef& w);
// A description of the device layout used for a weight ("planar-2bit", "blocks", ...).
std::string weight_layout(Backend& be, const WeightRef& w);

// matmul_prefill takes the tensor-core GEMM from this many rows (below: the GEMV tiles); matmul-input
// chains of at least this many rows leave no quantized records (their matmul is the GEMM).
constexpr int64_t kMatmulPrefillMinRows = 32;

// Ternary matmuls so far whose input's quantization was already there (a matmul before them with the
// same input, or a fused matmul-input chain), so they skipped their quantize launch.
int64_t quantizations_reused(Backend& be);
// gdn_input calls that ran as one launch (the conv and alpha | beta in the projections' launch; tests).
int64_t gdn_input_launches(Backend& be);
// attention_gate_rotate calls that ran fused (the merge and the gated output chain in one kernel; tests).
int64_t gated_attention_launches(Backend& be);
// Integer-mma matmul launches so far, in this process, whose groups past one wave ran as tail pieces
// (mma_gemv.cuh, MmaTail; tests).
int64_t matmul_tail_launches();
// Streaming multiprocessors of the current device; 0 when the runtime cannot say (also in kernels.h).
int current_sm_count();

// The decode / verify attention's segment kernel variant (attention_segments.cu: 0 slice-parallel scores,
// 1 lane scores with single K / V buffers, both fp32 FMA with the same bits; 2 scores and P . V on the
// tensor cores in 3xTF32, head dims 128 and 256 only (the default at 256), other bits): v = 0, 1 or 2 makes later attention
// calls take it, -1 restores the default (DFLASH_CUDA_ATTN_VARIANT, else a rule of the head shape). For tests.
void set_attention_segment_variant(int v);

// Event timing on the backend's stream: returns the median milliseconds of `iters` runs of fn()
// (after `warmup` runs), each run bracketed by events.
double time_ms(Backend& be, int warmup, int iters, const std::function<void()>& fn);

// The same with fn() called `batch` times inside one CUDA graph (captured once, replayed): returns the
// median milliseconds of ONE fn() as it runs in a decode graph, without launch or event overhead
// between the calls. fn must enqueue ops only (no allocation, upload or download).
double time_graph_ms(Backend& be, int batch, int iters, const std::function<void()>& fn);

// Marks a profiled range (cudaProfilerStart / Stop) for `ncu --profile-from-start off`.
void profiler_range(bool start);

// Streaming-read bandwidth floor measured on the backend's device: a kernel reading `bytes`
// (16-byte loads, every byte once, a checksum written so nothing is elided), median of iters runs.
// Returns GB/s (1e9 bytes per second).
double read_bandwidth_gbps(Backend& be, size_t bytes, int iters);

// What one dependent kernel boundary costs in a CUDA graph: a chain of `links` kernels (CTA counts cycling
// through `ctas`), each reading the whole previous output (5120 floats) before writing its own, captured
// once and replayed; returns the median microseconds per link. sync: 0 stream order (no PDL attribute),
// 1 programmatic dependent launch (griddepcontrol.wait), 2 PDL launch with arrival counters in global
// memory (the grid-wide hand-off a persistent kernel would use).
double kernel_boundary_us(Backend& be, int sync, const std::vector<int>& ctas, int links, int iters);

// Bytes a ternary weight (PTQ1_0 / PQ2_0, in x out) occupies on the device: the tensor-core layout's codes and
// fp16 scales (matmul_ternary.cu), what a matmul of it reads.
size_t ternary_device_bytes(int64_t in, int64_t out);

// What a decode step could stream, as two schedules of the same byte ranges ("ops", in order; an op of 0
// bytes is a pure dependency, like a norm between two matmuls). Each returns the median milliseconds of
// `iters` runs.
// persistent_stream_ms: one persistent kernel (cooperative launch, up to ctas_per_sm CTAs per SM); every
// op is a grid-wide hand-off through arrival counters, and each CTA copies the first head_bytes of its
// share of the next op into shared memory before it waits (-1 when that does not fit; *ctas_used gets
// the grid). release: each CTA arrives with one red.release add, else with __threadfence() and atomicAdd.
// Includes a small memset of the counters per run.
double persistent_stream_ms(Backend& be, const std::vector<size_t>& op_bytes, int ctas_per_sm, int head_bytes,
                            bool release, int iters, int* ctas_used = nullptr);
// op_chain_stream_ms: one kernel per op in a CUDA graph with programmatic dependent launch (a read of the
// op's bytes whose loads start before the wait, as DFLASH_CUDA_SKIP=stream's; an empty kernel for a
// 0-byte op): the kernel-per-op design with every matmul as fast as a bare read.
double op_chain_stream_ms(Backend& be, const std::vector<size_t>& op_bytes, int iters);

}  // namespace cuda
}  // namespace dflash
