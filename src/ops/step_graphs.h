// Replays a model step (decode, verify, draft) as a backend graph, keyed by the step's shape.
//
// A step's ops have fixed sizes and pointers once its shape (rows, options) is fixed; everything that
// changes from step to step (token ids, positions, key ranges, cache slots) is in backend memory,
// uploaded before the step. So the ops can be recorded once and replayed (CUDA graphs: ~1000 kernel
// launches per 27B token cost more than the bandwidth floor when launched one by one, SPEC 8).
//
// The first run of a key runs the ops directly, so that scratch buffers reach their size and a
// fault names its op; the second run captures them and launches the capture; later runs replay it.
// On a backend without graphs (the CPU) every run is direct.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <unordered_map>

#include "ops/backend.h"

namespace dflash {

class StepGraphCache {
 public:
  explicit StepGraphCache(Backend& be) : be_(be) {}

  void run(uint64_t key, const std::function<void()>& ops) {
    Entry& e = entries_[key];
    if (e.graph) {
      e.graph->launch();
      return;
    }
    if (e.seen && be_.begin_capture()) {
      try {
        ops();
      } catch (...) {
        try {
          be_.end_capture();  // leave the backend usable; the step's own error is the one to report
        } catch (...) {
        }
        throw;
      }
      e.graph = be_.end_capture();
      e.graph->launch();
      return;
    }
    e.seen = true;
    ops();
  }
  // Drops every graph (after the pointers or sizes a step uses have changed).
  void clear() { entries_.clear(); }
  size_t graphs() const {
    size_t n = 0;
    for (const auto& kv : entries_) n += kv.second.graph != nullptr;
    return n;
  }

 private:
  struct Entry {
    bool seen = false;
    std::unique_ptr<StepGraph> graph;
  };
  Backend& be_;
  std::unordered_map<uint64_t, Entry> entries_;
};

}  // namespace dflash
