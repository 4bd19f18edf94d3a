// util/parallel.h: parallel_ranges covers every row exactly once with contiguous ranges, respects the
// thread count and the minimum range length, and rethrows a range's exception on the caller's thread.
#include "util/parallel.h"

#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

namespace dflash {
namespace {

struct Calls {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  std::vector<std::thread::id> threads;
};

Calls run(int64_t begin, int64_t end, int threads, int64_t min_rows) {
  Calls c;
  std::mutex mu;
  parallel_ranges(begin, end, threads, min_rows, [&](int64_t a, int64_t b) {
    std::lock_guard<std::mutex> lock(mu);
    c.ranges.emplace_back(a, b);
    c.threads.push_back(std::this_thread::get_id());
  });
  return c;
}

TEST(ParallelRanges, CoversEveryRowOnceInContiguousRanges) {
  for (auto [begin, end, threads, min_rows] : std::vector<std::tuple<int64_t, int64_t, int, int64_t>>{
           {0, 1000, 7, 1}, {5, 17, 4, 1}, {100, 103, 8, 1}, {0, 64, 3, 4}, {-10, 10, 16, 2}}) {
    const Calls c = run(begin, end, threads, min_rows);
    std::vector<int> seen(static_cast<size_t>(end - begin), 0);
    for (auto [a, b] : c.ranges) {
      ASSERT_LT(a, b) << "empty range";
      ASSERT_GE(a, begin);
      ASSERT_LE(b, end);
      for (int64_t r = a; r < b; ++r) ++seen[static_cast<size_t>(r - begin)];
    }
    for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i], 1) << "row " << begin + static_cast<int64_t>(i);
    EXPECT_LE(c.ranges.size(), static_cast<size_t>(threads));
  }
}

TEST(ParallelRanges, ThreadCountAndMinimumRows) {
  EXPECT_EQ(run(0, 1000, 4, 1).ranges.size(), 4u);
  EXPECT_EQ(run(0, 1000, 1, 1).ranges.size(), 1u);
  EXPECT_EQ(run(0, 1000, 0, 1).ranges.size(), 1u);  // a non-positive count runs on the caller
  EXPECT_EQ(run(0, 12, 8, 4).ranges.size(), 3u);    // 12 rows, at least 4 each
  EXPECT_EQ(run(0, 3, 8, 4).ranges.size(), 1u);     // shorter than one minimum range: one range
  const Calls one = run(0, 50, 1, 1);
  ASSERT_EQ(one.threads.size(), 1u);
  EXPECT_EQ(one.threads[0], std::this_thread::get_id());  // a single range runs on the caller
  EXPECT_TRUE(run(7, 7, 4, 1).ranges.empty());
  EXPECT_TRUE(run(9, 3, 4, 1).ranges.empty());
}

TEST(ParallelRanges, RethrowsTheExceptionOfARangeAfterAllFinish) {
  std::atomic<int64_t> rows{0};
  EXPECT_THROW(parallel_ranges(0, 800, 8, 1,
                               [&](int64_t a, int64_t b) {
                                 rows += b - a;
                                 if (a <= 450 && 450 < b) throw std::runtime_error("row 450");
                               }),
               std::runtime_error);
  EXPECT_EQ(rows.load(), 800);  // every range ran: the throw did not abandon the others
  // on the caller's own range too
  EXPECT_THROW(parallel_ranges(0, 800, 8, 1, [&](int64_t a, int64_t) {
                 if (a == 0) throw std::invalid_argument("first range");
               }),
               std::invalid_argument);
}

}  // namespace
}  // namespace dflash
