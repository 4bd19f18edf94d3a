// The tail plan of the integer-mma matmul (mma_gemv.cuh): which 64-row groups of a launch a little over one
// wave run as k-range pieces, and the scratch their sums go through. Plain C++ (no CUDA types), so the CPU
// tests check its rules (tests/ops/mma_tail_plan_test.cpp); the kernels and the launcher are mma_gemv.cuh's.
#pragma once

#include <algorithm>
#include <cstddef>

namespace dflash::cuda {

// At most kTailMaxPieces pieces per launch and kTailRowTiles row tiles of 8 rows per launch (more rows take
// more launches over the same quantized input): the scratch, arrivals then sums, is sized for that.
constexpr int kTailMaxPieces = 512;
constexpr int kTailRowTiles = 8;
constexpr size_t kTailArrivalBytes = sizeof(unsigned) * kTailRowTiles * kTailMaxPieces;
constexpr size_t mma_tail_scratch_bytes() {
  return kTailArrivalBytes + sizeof(float) * kTailRowTiles * kTailMaxPieces * 8 * 64;
}

// A launch's tail (mma_tail_plan): a launch of G 64-row groups, G a little more than the S CTAs one wave of
// the 8-row kernel holds, would spend a second wave on G - S whole groups. Instead groups [begin, begin +
// groups) = [S, G) are each cut into `pieces` k ranges (kb), one CTA per piece (grid.x = S + groups *
// pieces), so the second wave is that much shorter. A piece stores its sums in `partials`; the group's last
// piece to arrive (arrivals, an atomic count it resets) adds them in piece order. The plan is a function of
// the weights' shapes and the GPU, never of M, so every row has the same bits at every M.
struct MmaTail {
  int begin = 0x7fffffff;  // the first tail CTA (the whole groups before it); no tail: past every CTA
  int pieces = 1, groups = 0;
  int kb[9] = {};          // piece q takes blocks kb[q] .. kb[q + 1]
  float* partials = nullptr;     // [row tiles of the launch][groups][pieces][kCols rows][64]
  unsigned* arrivals = nullptr;  // [row tiles of the launch][groups], zero between launches
};

// The tail of a launch of `groups` 64-row groups over nblk blocks (MmaTail): when the groups exceed one wave
// of the 8-row kernel (`slots`) by at most half a wave, the groups past the wave are cut into as many pieces
// as the idle slots of the second wave take (<= 8, >= kWarps blocks each, <= kTailMaxPieces in all). Else
// none, and none when the whole groups fit one wave of the one-row kernel (`slots_one_row`, more CTAs per SM):
// there the pieces would only add a second wave to every one-row launch (H200, Q4_K 5120 x 33792, 528
// groups: 26.3 -> 32.1 us at one row with pieces, S35-1).
inline MmaTail mma_tail_plan(int groups, int nblk, int slots, int slots_one_row, int warps) {
  MmaTail tail;
  if (slots <= 0 || groups <= slots || groups <= slots_one_row || 2 * (groups - slots) > slots) return tail;
  const int extra = groups - slots;
  const int pieces = std::min({8, slots / extra, nblk / warps, kTailMaxPieces / extra});
  if (pieces < 2) return tail;
  tail.begin = slots;
  tail.groups = extra;
  tail.pieces = pieces;
  for (int q = 0; q <= pieces; ++q) tail.kb[q] = nblk * q / pieces;
  return tail;
}

}  // namespace dflash::cuda
