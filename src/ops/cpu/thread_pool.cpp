#include "ops/cpu/thread_pool.h"

#include <algorithm>

namespace dflash::cpu {
namespace {
thread_local bool t_in_task = false;  // true on any thread while it runs a task of some pool
}

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  n_threads_ = n_threads;
  for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  for (auto& t : workers_) t.join();
}

// Claims tasks of the current job until none are left. Called with mu_ unlocked.
void ThreadPool::run_tasks() {
  for (;;) {
    int64_t task;
    const std::function<void(int64_t, int64_t)>* fn;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (next_task_ >= n_tasks_) return;
      task = next_task_++;
      fn = fn_;
    }
    const int64_t begin = task * chunk_;
    const int64_t end = std::min(n_, begin + chunk_);
    std::exception_ptr err;
    t_in_task = true;
    try {
      (*fn)(begin, end);
    } catch (...) {
      err = std::current_exception();
    }
    t_in_task = false;
    std::lock_guard<std::mutex> lock(mu_);
    if (err && !error_) error_ = err;
    if (--pending_ == 0) cv_done_.notify_all();
  }
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_work_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    run_tasks();
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  if (n_threads_ == 1 || n <= grain || t_in_task) {
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> job_lock(job_mu_);
  // A few tasks per thread balances uneven work; never below `grain` items per task.
  int64_t n_tasks = std::min<int64_t>((n + grain - 1) / grain, int64_t{n_threads_} * 4);
  const int64_t chunk = (n + n_tasks - 1) / n_tasks;
  n_tasks = (n + chunk - 1) / chunk;
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    chunk_ = chunk;
    n_tasks_ = n_tasks;
    next_task_ = 0;
    pending_ = n_tasks;
    error_ = nullptr;
    ++generation_;
  }
  cv_work_.notify_all();
  run_tasks();
  std::exception_ptr err;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_done_.wait(lock, [&] { return pending_ == 0; });
    err = error_;
    error_ = nullptr;
    fn_ = nullptr;
  }
  if (err) std::rethrow_exception(err);
}

}  // namespace dflash::cpu
