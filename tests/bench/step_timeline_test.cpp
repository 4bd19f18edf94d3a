// The step timeline's analysis (bench/step_timeline.cpp) on hand-made spans: exposed time per kernel,
// idle gaps and the span, with overlapping kernels (PDL) and out-of-order records.
#include "step_timeline.h"

#include <gtest/gtest.h>

namespace dflash::bench {
namespace {

TEST(StepTimeline, ExposedTimeCountsOnlyWhatMovesTheEnd) {
  // a: 0..10 us; b starts early (PDL) at 2 and ends at 14 (4 us exposed); c lies inside b (0 exposed);
  // after a 6 us gap d runs 20..25 (5 exposed); a second b 25..30 (5 exposed). Recorded out of order.
  std::vector<KernelSpan> spans = {
      {20000, 25000, "d", 1, 1, 1}, {0, 10000, "a", 4, 1, 1},   {2000, 14000, "b", 8, 1, 2},
      {3000, 9000, "c", 1, 1, 1},   {25000, 30000, "b", 8, 1, 2},
  };
  const std::string r = timeline_report(spans, "test");
  EXPECT_NE(r.find("5 kernels, span 30.0 us, idle gaps 6.0 us, summed durations 38.0 us"), std::string::npos) << r;
  EXPECT_NE(r.find("| a | 4x1x1 | 1 | 10.0 (33.3 %) | 10.00 | 10.00 |"), std::string::npos) << r;
  EXPECT_NE(r.find("| b | 8x1x2 | 2 | 9.0 (30.0 %) | 4.50 | 8.50 |"), std::string::npos) << r;
  EXPECT_NE(r.find("| c | 1x1x1 | 1 | 0.0 (0.0 %) | 0.00 | 6.00 |"), std::string::npos) << r;
  EXPECT_NE(r.find("| d | 1x1x1 | 1 | 5.0 (16.7 %) | 5.00 | 5.00 |"), std::string::npos) << r;
  // rows by exposed time, largest first
  EXPECT_LT(r.find("| a |"), r.find("| b |"));
  EXPECT_LT(r.find("| b |"), r.find("| d |"));
  EXPECT_LT(r.find("| d |"), r.find("| c |"));
}

// What CUPTI reports for the matmul: a kernel template in an anonymous namespace.
TEST(StepTimeline, KernelNamesLoseNamespacesAndParameters) {
  EXPECT_EQ(short_kernel_name("_ZN6dflash4cuda50_GLOBAL__N__4bbf75e6_17_matmul_ternary_cu_0550917913mm_mma_kernelINS1_"
                              "10TernaryFmtELi4ELi2EEEvNS1_7MmaArgsE"),
            "mm_mma_kernel<TernaryFmt, 4, 2>");
  EXPECT_EQ(short_kernel_name("not_mangled"), "not_mangled");
}

TEST(StepTimeline, EmptyRecording) {
  EXPECT_NE(timeline_report({}, "nothing").find("no kernels recorded"), std::string::npos);
}

}  // namespace
}  // namespace dflash::bench
