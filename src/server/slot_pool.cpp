#include "server/slot_pool.h"

#include <algorithm>

#include "util/error.h"

namespace dflash::server {

SlotPool::SlotPool(int n_slots) : slots_(static_cast<size_t>(n_slots)) {
  DFLASH_CHECK(n_slots >= 1, "the server needs at least one slot, got {}", n_slots);
}

size_t SlotPool::reusable(const std::vector<int32_t>& cached, std::span<const int32_t> prompt) {
  if (cached.empty() || cached.size() >= prompt.size()) return 0;
  return std::equal(cached.begin(), cached.end(), prompt.begin()) ? cached.size() : 0;
}

std::optional<int> SlotPool::acquire(std::span<const int32_t> prompt) {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t ticket = next_ticket_++;
  queue_.push_back(ticket);
  int chosen = -1;
  cv_.wait(lock, [&] {
    if (shutdown_) return true;
    if (queue_.front() != ticket) return false;
    chosen = -1;
    size_t best_reuse = 0;
    for (size_t i = 0; i < slots_.size(); ++i) {
      const State& s = slots_[i];
      if (s.busy) continue;
      const size_t reuse = reusable(s.cached, prompt);
      if (chosen < 0 || reuse > best_reuse ||
          (reuse == best_reuse && s.last_used < slots_[static_cast<size_t>(chosen)].last_used)) {
        chosen = static_cast<int>(i);
        best_reuse = reuse;
      }
    }
    return chosen >= 0;
  });
  queue_.erase(std::find(queue_.begin(), queue_.end(), ticket));
  if (shutdown_) {
    cv_.notify_all();
    return std::nullopt;
  }
  State& s = slots_[static_cast<size_t>(chosen)];
  s.busy = true;
  s.last_used = ++clock_;
  // The next ticket may be able to take another free slot right away.
  cv_.notify_all();
  return chosen;
}

void SlotPool::release(int slot, std::vector<int32_t> cached) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    State& s = slots_.at(static_cast<size_t>(slot));
    s.busy = false;
    s.cached = std::move(cached);
  }
  cv_.notify_all();
}

void SlotPool::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_ = true;
  }
  cv_.notify_all();
}

int SlotPool::busy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(std::count_if(slots_.begin(), slots_.end(), [](const State& s) { return s.busy; }));
}

int SlotPool::waiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(queue_.size());
}

}  // namespace dflash::server
