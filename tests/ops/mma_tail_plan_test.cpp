// The integer-mma matmul's tail plan (src/ops/cuda/mma_tail_plan.h): which launches cut their groups past one
// wave into k-range pieces, and how. Plain C++, so it runs in every build; the kernels that execute a plan are
// checked on the GPU (tests/cuda: CudaMatmul.TailPieces).
#include <gtest/gtest.h>

#include "ops/cuda/mma_tail_plan.h"

namespace dflash::cuda {
namespace {

bool has_tail(const MmaTail& t) { return t.groups > 0; }

// Every piece covers >= warps blocks, the pieces tile [0, nblk) in order, and the grid holds them all.
void expect_well_formed(const MmaTail& t, int groups, int nblk, int slots, int warps) {
  ASSERT_TRUE(has_tail(t));
  EXPECT_EQ(t.begin, slots);
  EXPECT_EQ(t.groups, groups - slots);
  EXPECT_GE(t.pieces, 2);
  EXPECT_LE(t.pieces, 8);
  EXPECT_LE(t.groups * t.pieces, kTailMaxPieces);
  EXPECT_LE(t.groups * t.pieces, slots) << "the pieces must fit the second wave's slots";
  EXPECT_EQ(t.kb[0], 0);
  EXPECT_EQ(t.kb[t.pieces], nblk);
  for (int q = 0; q < t.pieces; ++q) EXPECT_GE(t.kb[q + 1] - t.kb[q], warps) << "piece " << q;
}

TEST(MmaTailPlan, DrafterGateUpOnH200) {
  // Q4_K 5120 x 34816: 544 groups of 64 rows, 40 blocks of 128 inputs; 3 x 132 CTAs per wave at 8 rows,
  // 4 x 132 at one row: 396 whole groups, 148 groups in two halves of 20 blocks.
  const MmaTail t = mma_tail_plan(544, 40, 396, 528, 4);
  expect_well_formed(t, 544, 40, 396, 4);
  EXPECT_EQ(t.pieces, 2);
  EXPECT_EQ(t.kb[1], 20);
}

TEST(MmaTailPlan, NoneWithinOneWave) {
  EXPECT_FALSE(has_tail(mma_tail_plan(396, 40, 396, 528, 4)));  // exactly one 8-row wave
  EXPECT_FALSE(has_tail(mma_tail_plan(100, 40, 396, 528, 4)));
  // one wave of the one-row kernel holds them (Q4_K 5120 x 33792: pieces gave one row a second wave)
  EXPECT_FALSE(has_tail(mma_tail_plan(528, 40, 396, 528, 4)));
  EXPECT_FALSE(has_tail(mma_tail_plan(500, 40, 396, 528, 4)));
  EXPECT_TRUE(has_tail(mma_tail_plan(500, 40, 396, 0, 4)));  // the same launch where one row fits no more
}

TEST(MmaTailPlan, NoneBeyondHalfAWaveOrWithoutSlots) {
  EXPECT_FALSE(has_tail(mma_tail_plan(3880, 40, 528, 660, 4)));  // the lm_head: 7 waves
  EXPECT_FALSE(has_tail(mma_tail_plan(800, 40, 528, 660, 4)));   // 272 past a wave of 528
  EXPECT_FALSE(has_tail(mma_tail_plan(544, 40, 0, 0, 4)));       // the occupancy query failed
}

TEST(MmaTailPlan, PieceCountLimits) {
  // 4 groups past a wave of 528: the second wave could take 132 pieces each, 8 is the cap
  MmaTail t = mma_tail_plan(532, 40, 528, 0, 4);
  expect_well_formed(t, 532, 40, 528, 4);
  EXPECT_EQ(t.pieces, 8);
  // few blocks: 12 blocks and 4 warps allow 3 pieces of 4 blocks
  t = mma_tail_plan(532, 12, 528, 0, 4);
  expect_well_formed(t, 532, 12, 528, 4);
  EXPECT_EQ(t.pieces, 3);
  // too few blocks to split among 4 warps twice: no tail
  EXPECT_FALSE(has_tail(mma_tail_plan(532, 7, 528, 0, 4)));
  // kTailMaxPieces: 300 groups past a wave of 1000 would need 600 pieces for two each
  EXPECT_FALSE(has_tail(mma_tail_plan(1300, 40, 1000, 0, 4)));
  // 200 groups past a wave of 1000: two pieces each (400 <= kTailMaxPieces), not five
  t = mma_tail_plan(1200, 40, 1000, 0, 4);
  expect_well_formed(t, 1200, 40, 1000, 4);
  EXPECT_EQ(t.pieces, 2);
}

TEST(MmaTailPlan, UnevenBlocksStillCoverTheRange) {
  const MmaTail t = mma_tail_plan(530, 45, 528, 0, 4);  // 45 blocks in 8 pieces: 5 or 6 each
  expect_well_formed(t, 530, 45, 528, 4);
  int total = 0;
  for (int q = 0; q < t.pieces; ++q) total += t.kb[q + 1] - t.kb[q];
  EXPECT_EQ(total, 45);
}

TEST(MmaTailPlan, EveryPlanOfASweepIsWellFormed) {
  // Waves of 1..8 CTAs per SM on 132 SMs, one-row waves as big or bigger, 1..2 waves of groups, 4..160 blocks:
  // every plan made is well formed, and each launch with one is more than a wave of both kernels.
  int plans = 0;
  for (int per_sm = 1; per_sm <= 8; ++per_sm)
    for (int one_row = per_sm; one_row <= per_sm + 2; ++one_row) {
      const int slots = per_sm * 132, slots1 = one_row * 132;
      for (int groups = 1; groups <= 2 * slots; groups += 7)
        for (int nblk : {4, 8, 12, 40, 136, 160}) {
          const MmaTail t = mma_tail_plan(groups, nblk, slots, slots1, 4);
          if (!has_tail(t)) continue;
          ++plans;
          expect_well_formed(t, groups, nblk, slots, 4);
          EXPECT_GT(groups, slots1);
          EXPECT_LE(2 * (groups - slots), slots);
        }
    }
  EXPECT_GT(plans, 100);
}

}  // namespace
}  // namespace dflash::cuda
