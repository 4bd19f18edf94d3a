// The request queue of `dflash serve`: N slots (one sequence each: TargetModel + Engine + drafter),
// handed out first come, first served.
//
// Fairness: every request takes a ticket; only the oldest waiting ticket may take a free slot, so a
// request is never overtaken. Placement: among the free slots, the one whose cached tokens are the
// longest strict prefix of the new prompt (the Engine reuses exactly that case: the recurrent state
// cannot be cut back, so anything else starts over); on a tie the least recently used, which keeps
// other conversations' caches alive. The pool only keeps a copy of each slot's cached tokens (given
// back on release); it knows nothing of models, so it can be tested on its own.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <span>
#include <vector>

namespace dflash::server {

class SlotPool {
 public:
  explicit SlotPool(int n_slots);

  // Blocks until this request's turn and a free slot; returns the slot index, or nullopt once the
  // pool is shut down.
  std::optional<int> acquire(std::span<const int32_t> prompt);
  // Frees a slot; `cached` is what its cache now holds (Engine::cached_tokens(), empty after a reset).
  void release(int slot, std::vector<int32_t> cached);
  // Wakes every waiter (acquire returns nullopt from now on).
  void shutdown();

  int size() const { return static_cast<int>(slots_.size()); }
  int busy() const;
  int waiting() const;
  // Tokens the prompt would reuse from `cached` (its length when it is a strict prefix, else 0).
  static size_t reusable(const std::vector<int32_t>& cached, std::span<const int32_t> prompt);

 private:
  struct State {
    bool busy = false;
    uint64_t last_used = 0;
    std::vector<int32_t> cached;
  };
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<State> slots_;
  std::deque<uint64_t> queue_;  // waiting tickets, oldest first
  uint64_t next_ticket_ = 0;
  uint64_t clock_ = 0;
  bool shutdown_ = false;
};

}  // namespace dflash::server
