// A small persistent thread pool for the CPU kernels (matmul_rows and friends).
//
// parallel_for splits [0, n) into disjoint ranges handed out dynamically; the caller's thread takes
// part. Idle workers spin for ~100 us (DFLASH_SPIN_US) before sleeping, so back-to-back calls (decode)
// skip the wake-up. Work items must not depend on which thread runs them (they never do in dflash: each output row
// is computed whole by one thread), so results are independent of the thread count.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace dflash {

class ThreadPool {
 public:
  // `threads` is the total including the calling thread (>= 1).
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(begin, end) over disjoint ranges of at most `grain` items covering [0, n); returns when all
  // are done. Rethrows the first exception a range threw. A call from inside a range, or while another
  // thread's call is running on this pool, runs serially on the calling thread.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

  // The process-wide pool: DFLASH_THREADS threads if set, else std::thread::hardware_concurrency().
  static ThreadPool& global();

 private:
  struct Job;
  void worker_loop();
  static bool run_ranges(Job& job);

  std::vector<std::thread> workers_;
  std::mutex mutex_;  // guards sleeping on the condition variables
  std::condition_variable work_cv_, done_cv_;
  std::atomic<uint64_t> generation_{0};  // bumped once per job
  std::atomic<bool> stop_{false};
  std::shared_ptr<Job> job_;  // the current job (guarded by mutex_)
  std::mutex run_mutex_;  // one parallel_for at a time
};

}  // namespace dflash
