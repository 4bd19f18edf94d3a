// The CUDA integer matmuls' activation rounding, on the CPU, for precision studies.
//
// The CUDA backend's ternary / Q4_K / Q6_K matmuls (src/ops/cuda/xq_record.cuh) quantize their input per
// block of 128 values to a block fixed point: E = (frexp exponent of the block's largest |x|) - 6, so that
// largest |x| 2^-E lies in [32, 64); u = rint(x 2^(8 (P - 1) - E)) as P signed bytes (P = 2: |u| < 2^14,
// a step of 2^(E - 8) <= 2^-13 of the block's largest |x|). Their integer sums are then exact, so this
// rounding is the CUDA result's difference from the CPU's fp32 dot products, up to fp32 rounding.
// round_to_xq_planes gives the CPU the same rounded inputs, so the effect of P on whole-model output
// (greedy tokens, logits, the drafter's acceptance) can be measured on any machine:
// DFLASH_CPU_XQ_PLANES=2 (or 3) makes the CPU backend round the inputs of those weight types this way
// (ops/cpu/cpu_backend.cpp). Off by default: the CPU stays the fp32 reference. P = 1 is a what-if that no
// CUDA kernel implements (8-bit activations, as llama.cpp's q8_1 but per 128): the largest |x| 2^-E in
// [64, 128), u = rint(x 2^-E) clamped to [-127, 127], a step of 2^E <= 2^-6 of the block's largest |x|.
#pragma once

#include <cstdint>

#include "quant/types.h"

namespace dflash {

// The weight types whose CUDA matmuls run on the integer tensor cores over these records (the ternary
// PQ2_0 / PTQ1_0, Q4_K, Q6_K; ops/cuda/cuda_backend.cpp's kTernaryMma / kKQuantMma layouts).
inline bool xq_rounded_type(GgmlType t) {
  return t == GgmlType::PQ2_0 || t == GgmlType::PTQ1_0 || t == GgmlType::Q4_K || t == GgmlType::Q6_K;
}

// out[i] = x rounded as the CUDA matmul's P-plane activation record holds it (P = 2, 3; 1: the what-if
// above; n a multiple of 128; out may equal x). Zero or non-finite blocks pass through unchanged.
void round_to_xq_planes(const float* x, float* out, int64_t n, int planes);

// The planes DFLASH_CPU_XQ_PLANES asks for (1, 2 or 3), or 0 (unset, or any other value: no rounding).
int cpu_xq_planes_from_env();

}  // namespace dflash
