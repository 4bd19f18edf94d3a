#include "server/metrics.h"

#include <fmt/format.h>

#include <algorithm>

namespace dflash::server {

void Metrics::count_request(const std::string& endpoint, int status) {
  std::lock_guard<std::mutex> lock(mu_);
  ++requests_[{endpoint, status}];
}

int64_t Metrics::requests(const std::string& endpoint, int status) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = requests_.find({endpoint, status});
  return it == requests_.end() ? 0 : it->second;
}

void Metrics::add_generation(const GenerateStats& st, const std::string& outcome) {
  std::lock_guard<std::mutex> lock(mu_);
  ++outcomes_[outcome];
  prompt_tokens_ += st.prompt_tokens;
  reused_tokens_ += st.reused_tokens;
  generated_ += st.generated;
  if (st.decode_seconds > 0 && st.generated > 1) last_decode_tps_ = (st.generated - 1) / st.decode_seconds;
  if (st.prefill_seconds > 0) last_prefill_tps_ = (st.prompt_tokens - st.reused_tokens) / st.prefill_seconds;
  if (st.cycles > 0) {
    cycles_ += st.cycles;
    drafted_ += st.drafted;
    accepted_ += st.accepted;
    spec_generated_ += st.generated - 1;  // the anchor comes before the first cycle
  }
  const size_t n = std::max(st.drafted_at.size(), st.accepted_at.size());
  if (drafted_at_.size() < n) drafted_at_.resize(n, 0), accepted_at_.resize(n, 0);
  for (size_t i = 0; i < st.drafted_at.size(); ++i) drafted_at_[i] += st.drafted_at[i];
  for (size_t i = 0; i < st.accepted_at.size(); ++i) accepted_at_[i] += st.accepted_at[i];
}

std::string Metrics::render(const Gauges& g) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string o;
  auto head = [&](const char* name, const char* type, const char* help) {
    o += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  };
  auto line = [&](const std::string& name, auto value) { o += fmt::format("{} {}\n", name, value); };

  head("dflash_requests_total", "counter", "HTTP requests answered, by endpoint and status code.");
  for (const auto& [key, n] : requests_)
    line(fmt::format("dflash_requests_total{{endpoint=\"{}\",status=\"{}\"}}", key.first, key.second), n);
  head("dflash_generations_total", "counter", "Generations by outcome (stop, length, cancelled, error).");
  for (const auto& [outcome, n] : outcomes_) line(fmt::format("dflash_generations_total{{outcome=\"{}\"}}", outcome), n);
  head("dflash_prompt_tokens_total", "counter", "Prompt tokens of generations.");
  line("dflash_prompt_tokens_total", prompt_tokens_);
  head("dflash_prompt_tokens_reused_total", "counter", "Prompt tokens found in a slot's cache (not prefilled again).");
  line("dflash_prompt_tokens_reused_total", reused_tokens_);
  head("dflash_generated_tokens_total", "counter", "Tokens generated.");
  line("dflash_generated_tokens_total", generated_);
  head("dflash_decode_tokens_per_second", "gauge", "Decode speed of the last generation (tokens/s).");
  line("dflash_decode_tokens_per_second", last_decode_tps_);
  head("dflash_prefill_tokens_per_second", "gauge", "Prefill speed of the last generation (tokens/s).");
  line("dflash_prefill_tokens_per_second", last_prefill_tps_);
  head("dflash_spec_cycles_total", "counter", "Speculative draft + verify cycles.");
  line("dflash_spec_cycles_total", cycles_);
  head("dflash_draft_tokens_total", "counter", "Draft tokens proposed by the drafter.");
  line("dflash_draft_tokens_total", drafted_);
  head("dflash_draft_accepted_tokens_total", "counter", "Draft tokens accepted by the target.");
  line("dflash_draft_accepted_tokens_total", accepted_);
  head("dflash_acceptance_length", "gauge", "Tokens per speculative cycle (accepted drafts + 1), over all generations.");
  line("dflash_acceptance_length", cycles_ ? static_cast<double>(spec_generated_) / cycles_ : 0.0);
  head("dflash_draft_tokens_at_position_total", "counter", "Cycles that drafted a token at each draft position.");
  for (size_t i = 0; i < drafted_at_.size(); ++i)
    line(fmt::format("dflash_draft_tokens_at_position_total{{position=\"{}\"}}", i + 1), drafted_at_[i]);
  head("dflash_draft_accepted_at_position_total", "counter", "Cycles whose draft at each position was accepted.");
  for (size_t i = 0; i < accepted_at_.size(); ++i)
    line(fmt::format("dflash_draft_accepted_at_position_total{{position=\"{}\"}}", i + 1), accepted_at_[i]);
  head("dflash_draft_acceptance_rate", "gauge", "Accepted / drafted at each draft position.");
  for (size_t i = 0; i < drafted_at_.size(); ++i)
    line(fmt::format("dflash_draft_acceptance_rate{{position=\"{}\"}}", i + 1),
         drafted_at_[i] ? static_cast<double>(accepted_at_[i]) / drafted_at_[i] : 0.0);
  head("dflash_slots", "gauge", "Slots (parallel sequences).");
  line("dflash_slots", g.slots);
  head("dflash_slots_busy", "gauge", "Slots generating now.");
  line("dflash_slots_busy", g.slots_busy);
  head("dflash_requests_waiting", "gauge", "Requests waiting for a slot.");
  line("dflash_requests_waiting", g.waiting);
  head("dflash_model_loaded", "gauge", "1 once the model is loaded.");
  line("dflash_model_loaded", g.loaded ? 1 : 0);
  return o;
}

}  // namespace dflash::server
