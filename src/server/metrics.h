// Counters of `dflash serve`, rendered in the Prometheus text exposition format (GET /metrics).
//
//   dflash_requests_total{endpoint,status}     HTTP requests answered (endpoint: a known path or "other")
//   dflash_prompt_tokens_total                 prompt tokens of finished generations
//   dflash_prompt_tokens_reused_total          ... of them found in a slot's cache (not prefilled)
//   dflash_generated_tokens_total              tokens generated (completion_tokens)
//   dflash_generations_total{outcome}          generations by outcome: stop | length | cancelled | error
//   dflash_decode_tokens_per_second            gauge: decode speed of the last generation
//   dflash_prefill_tokens_per_second           gauge: prefill speed of the last generation
//   dflash_spec_cycles_total, dflash_draft_tokens_total, dflash_draft_accepted_tokens_total
//   dflash_acceptance_length                   gauge: tokens per draft + verify cycle, over all generations
//   dflash_draft_tokens_at_position_total{position}, dflash_draft_accepted_at_position_total{position}
//   dflash_draft_acceptance_rate{position}     gauge: accepted / drafted at draft position 1..B-1
//   dflash_slots, dflash_slots_busy, dflash_requests_waiting, dflash_model_loaded (gauges, from outside)
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "spec/engine.h"

namespace dflash::server {

class Metrics {
 public:
  struct Gauges {
    int slots = 0, slots_busy = 0, waiting = 0;
    bool loaded = false;
  };

  void count_request(const std::string& endpoint, int status);
  // outcome: "stop", "length", "cancelled" or "error".
  void add_generation(const GenerateStats& st, const std::string& outcome);
  std::string render(const Gauges& g) const;

  // For tests: requests counted for (endpoint, status).
  int64_t requests(const std::string& endpoint, int status) const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, int64_t> requests_;
  std::map<std::string, int64_t> outcomes_;
  int64_t prompt_tokens_ = 0, reused_tokens_ = 0, generated_ = 0;
  double last_decode_tps_ = 0, last_prefill_tps_ = 0;
  int64_t cycles_ = 0, drafted_ = 0, accepted_ = 0, spec_generated_ = 0;
  std::vector<int64_t> drafted_at_, accepted_at_;
};

}  // namespace dflash::server
