#include "quant/thread_pool.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DFLASH_CPU_RELAX() _mm_pause()
#else
#define DFLASH_CPU_RELAX() std::this_thread::yield()
#endif

namespace dflash {
namespace {
thread_local bool t_inside_pool = false;  // set while this thread runs a range

// How long an idle worker (or the caller waiting for the last ranges) spins before sleeping. Decode
// calls matmul_rows hundreds of times per token, microseconds apart; a condition-variable wake-up
// costs tens of microseconds, so a short spin keeps the workers hot between back-to-back calls.
// DFLASH_SPIN_US overrides it (0: never spin, for oversubscribed machines).
std::chrono::microseconds spin_time() {
  static const std::chrono::microseconds t = [] {
    if (const char* env = std::getenv("DFLASH_SPIN_US")) return std::chrono::microseconds(std::atoi(env));
    return std::chrono::microseconds(100);
  }();
  return t;
}

template <typename Pred>
bool spin_until(Pred done) {
  const auto limit = spin_time();
  if (limit.count() <= 0) return done();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0;; ++i) {
    if (done()) return true;
    DFLASH_CPU_RELAX();
    if ((i & 63) == 63 && std::chrono::steady_clock::now() - start > limit) return done();
  }
}
}  // namespace

// One parallel_for call. Owned by shared_ptr: a worker that wakes late still holds a valid Job, finds
// no range left and never touches `fn`, so the caller only waits for the ranges, not for every worker.
struct ThreadPool::Job {
  const std::function<void(int64_t, int64_t)>* fn = nullptr;
  int64_t n = 0;
  int64_t grain = 1;
  std::atomic<int64_t> next{0};  // first unclaimed index
  std::atomic<int64_t> done{0};  // indices finished
  std::mutex error_mutex;
  std::exception_ptr error;
};

ThreadPool::ThreadPool(int threads) {
  const int extra = std::max(threads, 1) - 1;
  workers_.reserve(static_cast<size_t>(extra));
  for (int i = 0; i < extra; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_.store(true);
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

// Returns true when this thread finished the job's last indices.
bool ThreadPool::run_ranges(Job& job) {
  const bool was_inside = t_inside_pool;
  t_inside_pool = true;
  bool finished_last = false;
  for (;;) {
    const int64_t begin = job.next.fetch_add(job.grain, std::memory_order_relaxed);
    if (begin >= job.n) break;
    const int64_t end = std::min(job.n, begin + job.grain);
    try {
      (*job.fn)(begin, end);
    } catch (...) {
      std::lock_guard<std::mutex> lock(job.error_mutex);
      if (!job.error) job.error = std::current_exception();
    }
    if (job.done.fetch_add(end - begin, std::memory_order_acq_rel) + (end - begin) == job.n) finished_last = true;
  }
  t_inside_pool = was_inside;
  return finished_last;
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    // Spin briefly for the next job, then sleep on the condition variable.
    if (!spin_until([&] {
          return stop_.load(std::memory_order_relaxed) || generation_.load(std::memory_order_acquire) != seen;
        })) {
      std::unique_lock<std::mutex> lock(mutex_);
      work_cv_.wait(lock, [&] { return stop_.load() || generation_.load() != seen; });
    }
    std::shared_ptr<Job> job;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stop_.load()) return;
      seen = generation_.load();
      job = job_;
    }
    if (job && run_ranges(*job)) {
      std::lock_guard<std::mutex> lock(mutex_);  // pairs with the caller's wait
      done_cv_.notify_all();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  std::unique_lock<std::mutex> run_lock(run_mutex_, std::defer_lock);
  if (workers_.empty() || n <= grain || t_inside_pool || !run_lock.try_lock()) {
    for (int64_t begin = 0; begin < n; begin += grain) fn(begin, std::min(n, begin + grain));
    return;
  }
  auto job = std::make_shared<Job>();
  job->fn = &fn;
  job->n = n;
  job->grain = grain;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = job;
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  work_cv_.notify_all();
  run_ranges(*job);
  auto all_done = [&] { return job->done.load(std::memory_order_acquire) == n; };
  if (!spin_until(all_done)) {
    std::unique_lock<std::mutex> lock(mutex_);
    done_cv_.wait(lock, all_done);
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_.reset();  // late workers keep their own reference
  }
  if (job->error) std::rethrow_exception(job->error);
}

ThreadPool& ThreadPool::global() {
  static ThreadPool pool([] {
    if (const char* env = std::getenv("DFLASH_THREADS")) {
      const int v = std::atoi(env);
      if (v > 0) return v;
    }
    const unsigned hc = std::thread::hardware_concurrency();
    return hc > 0 ? static_cast<int>(hc) : 1;
  }());
  return pool;
}

}  // namespace dflash
