// The engine's generate API: one sequence, greedy decoding, plain or speculative (DFlash 2).
//
// Tokens stream out through a callback as they are accepted. Invariant (SPEC 5.3): whenever the
// callback runs, the target cache holds the prompt plus every yielded token except the last, so a
// following turn whose prompt extends this text reuses the cache (only the new tokens are
// prefilled).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "models/target.h"
#include "spec/sampler.h"

namespace dflash {

class Drafter;  // src/models/dflash_drafter.h

struct GenerateOptions {
  int64_t max_tokens = 128;            // generated tokens at most (the anchor counts)
  std::vector<int32_t> stop_tokens;    // end-of-generation ids (the stop token is yielded, then we stop)
  bool speculative = true;             // use the drafter when one is attached
  int64_t block = 8;                   // verify width B (2..8): B-1 drafted tokens per cycle
  // temperature 0 (the default) is greedy: speculative output == plain output token for token.
  // temperature > 0 samples; speculative sampling then accepts a draft with the target's probability
  // of it, so its output is distributed as plain sampling's (the same seed gives other tokens).
  SamplingParams sampling;
  // Wait for the backend before and after each draft so that draft_seconds and verify_seconds split
  // a cycle's time (the rollback and context appends land in other_seconds). Off, a device-resident
  // cycle (greedy, drafter on the target's backend) waits only for the verify, and draft_seconds
  // counts only the host's time to enqueue the draft.
  bool time_phases = false;
};

struct GenerateStats {
  int64_t prompt_tokens = 0;           // tokens in the prompt
  int64_t reused_tokens = 0;           // prompt tokens found in the cache (not prefilled again)
  int64_t generated = 0;               // tokens yielded
  double prefill_seconds = 0, decode_seconds = 0;
  // speculative only
  int64_t cycles = 0;                  // draft + verify cycles
  int64_t drafted = 0;                 // draft tokens proposed
  int64_t accepted = 0;                // draft tokens accepted
  std::vector<int64_t> accepted_at;    // [B-1]: cycles whose draft position i was accepted
  std::vector<int64_t> drafted_at;     // [B-1]: cycles that proposed a token at position i (narrower
                                       // near max_tokens or a full context)
  std::vector<int32_t> accepted_per_cycle;  // accepted drafts of each cycle
  double draft_seconds = 0, verify_seconds = 0, other_seconds = 0;  // see GenerateOptions::time_phases
  bool stopped_by_token = false;       // a stop token ended the generation
  bool context_full = false;           // the context filled up before max_tokens
  double acceptance_length() const { return cycles ? static_cast<double>(generated - 1) / cycles : 0.0; }
  // Accepted / proposed at draft position i (SPEC 5.4), 0 when the position was never drafted.
  double acceptance_rate_at(size_t i) const {
    return i < drafted_at.size() && drafted_at[i] ? static_cast<double>(accepted_at[i]) / drafted_at[i] : 0.0;
  }
};

// Return false to stop early.
using TokenCallback = std::function<bool(int32_t token)>;

class Engine {
 public:
  explicit Engine(TargetModel& target, Drafter* drafter = nullptr);
  ~Engine();

  TargetModel& target() { return target_; }
  Drafter* drafter() { return drafter_; }
  // Generates from `prompt` (token ids). Reuses the cached prefix when the prompt extends it.
  GenerateStats generate(std::span<const int32_t> prompt, const GenerateOptions& opts, const TokenCallback& on_token);
  // Forgets the cached sequence.
  void reset();
  // Tokens whose state the target cache holds (prompt + yielded except the last).
  const std::vector<int32_t>& cached_tokens() const { return cached_; }

 private:
  // Brings the caches to `prompt` (reuse or reset + prefill); returns the first generated token (the
  // argmax, or a draw from `sampler` when given).
  int32_t prepare(std::span<const int32_t> prompt, GenerateStats& stats, bool want_taps, Sampler* sampler);
  void generate_plain(int32_t anchor, const GenerateOptions& opts, const TokenCallback& cb, GenerateStats& st,
                      Sampler* sampler);
  void generate_speculative(int32_t anchor, const GenerateOptions& opts, const TokenCallback& cb,
                            GenerateStats& st, Sampler* sampler);

  TargetModel& target_;
  Drafter* drafter_;
  std::vector<int32_t> cached_;
  std::vector<float> prompt_taps_;  // taps of the rows prefilled by the last prepare()
};

}  // namespace dflash
