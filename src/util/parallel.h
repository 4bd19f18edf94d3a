// Row-parallel loops for the offline tools (convert, quantize, synth): contiguous ranges of rows on
// short-lived threads, the first exception rethrown on the caller's thread. The inference kernels use
// the persistent pool of quant/thread_pool.h instead; these loops run once per tensor chunk, where a
// thread start costs nothing next to the work.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace dflash {

// Calls fn(a, b) on contiguous ranges [a, b) that cover [begin, end), on up to `threads` threads (the
// calling thread runs the first range), each range at least `min_rows` long unless the whole is
// shorter. Returns once every range is done; rethrows the first exception a range threw. A range's
// work must not depend on which thread runs it (each output row is computed whole, so the result is
// the same for every thread count).
template <typename F>
void parallel_ranges(int64_t begin, int64_t end, int threads, int64_t min_rows, F&& fn) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t by_size = std::max<int64_t>(1, n / std::max<int64_t>(1, min_rows));
  const int64_t t = std::clamp<int64_t>(threads, 1, by_size);
  if (t == 1) {
    fn(begin, end);
    return;
  }
  std::exception_ptr err;
  std::mutex mu;
  auto run = [&](int64_t a, int64_t b) {
    try {
      fn(a, b);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!err) err = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(t - 1));
  for (int64_t i = 1; i < t; ++i) pool.emplace_back(run, begin + n * i / t, begin + n * (i + 1) / t);
  run(begin, begin + n / t);
  for (auto& th : pool) th.join();
  if (err) std::rethrow_exception(err);
}

// The machine's hardware threads (at least 1), for a --threads option's default.
inline int hardware_threads() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

}  // namespace dflash
