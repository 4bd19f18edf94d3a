// The prism Hadamard transform (SPEC 3), host side: used by the CPU backend and by the converter.
//
//   H[r][c] = (-1)^popcount(r & c) / sqrt(1024)   (Sylvester order; symmetric, orthogonal: H H = I)
// applied independently to each 1024-element chunk of a row ("H_blk").
//
//   forward (a rotated matmul's input):  y = H_blk(s (.) P x)      P: y'[i] = x[perm[i]] (identity if null)
//   inverse (an embedding row):          y = s (.) H_blk(x)        (no permutation)
//
// Rotating a weight for storage. The runtime computes y = W_stored . H_blk(s (.) x) and must get W . x:
//   W_stored H D x = W x for all x   (D = diag(s), per chunk)
//   => W_stored = W D^-1 H^-1 = W D H          (D^-1 = D, H^-1 = H)
//   => each stored row w_s = H(s (.) w)^T      (H symmetric): the FORWARD transform of the row.
// (Note W (H D) would be wrong: W H D H D != W in general.) For ssm_out with gdn_v_grouped the
// original W's input columns are in grouped (HF) order and the runtime permutes x into that order,
// so the weight rows are rotated as they are, with no permutation.
// An embedding row e is stored as H(s (.) e) too: the runtime's inverse gives s (.) H H (s (.) e) = e.
#pragma once

#include <cstdint>

namespace dflash::prism {

constexpr int64_t kHadamardBlock = 1024;

// In-place normalised Walsh-Hadamard transform of x[0..n), n a power of two: x <- H_n x with
// H_n = Sylvester / sqrt(n). Butterflies in a fixed order, then one scale (exact for n = 1024: 1/32).
void fwht(float* x, int64_t n);

// y = H_blk(s (.) P x) over one row of n elements, H_blk = H_block on each `block`-chunk (block a power
// of two dividing n: 1024 in Bonsai files, smaller in tiny test models). signs and perm may be null.
// y may equal x.
void hadamard_forward_row(const float* x, const float* signs, const int32_t* perm, float* y, int64_t n,
                          int64_t block = kHadamardBlock);
// y = s (.) H_blk(x) over one row. signs may be null. y may equal x.
void hadamard_inverse_row(const float* x, const float* signs, float* y, int64_t n, int64_t block = kHadamardBlock);

// The converter's weight rotation: w_stored = H_blk(s (.) w) for one weight row of n inputs (see above).
inline void rotate_weight_row(const float* w, const float* signs, float* w_stored, int64_t n,
                              int64_t block = kHadamardBlock) {
  hadamard_forward_row(w, signs, nullptr, w_stored, n, block);
}

}  // namespace dflash::prism
