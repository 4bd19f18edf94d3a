// A small persistent thread pool for the CPU backend.
//
// parallel_for splits [0, n) into contiguous ranges and runs them on the workers and the calling
// thread. Every op that uses it computes each output element from its own inputs only, so how the
// range is split never changes a result (the lossless contract, SPEC 5.5): the pool decides speed,
// never bits. A parallel_for called from inside a task runs inline on that thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace dflash::cpu {

class ThreadPool {
 public:
  // n_threads counts the calling thread; 0 means std::thread::hardware_concurrency().
  explicit ThreadPool(int n_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  // Runs fn(begin, end) over disjoint ranges covering [0, n). Ranges hold at least `grain` items
  // (except the last); with n <= grain or one thread, fn(0, n) runs on the caller. The first
  // exception thrown by a task is rethrown here after all tasks finish.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void worker_loop();
  void run_tasks();

  int n_threads_ = 1;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_work_;
  std::condition_variable cv_done_;
  uint64_t generation_ = 0;  // bumped for each job
  bool stop_ = false;

  // The current job (guarded by mu_ for setup; tasks are claimed with next_task_ under mu_).
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  int64_t chunk_ = 0;
  int64_t n_tasks_ = 0;
  int64_t next_task_ = 0;
  int64_t pending_ = 0;  // tasks not yet finished
  std::exception_ptr error_;
  std::mutex job_mu_;  // one parallel_for at a time (the backend is used from one thread, but be safe)
};

}  // namespace dflash::cpu
