// DFlash speculative generation (SPEC 5): draft, verify, accept, bonus, undo.
//
// One cycle, with the anchor a (already yielded, not yet in the target cache) at position P:
//   drafts  d_1..d_{w-1} = the drafter's proposals (it always runs its trained block), cut to the
//           verify width w = min(B, room in the context, tokens still wanted, target max_rows)
//   verify  [a, d_1..d_{w-1}] in ONE undoable target forward with taps: argmax_i per row
//   accept  k = longest prefix with d_i == argmax_{i-1}; bonus = argmax_k
//   yield   d_1..d_k, bonus, one at a time, with exactly plain decoding's stop rules (stop token,
//           max_tokens, callback), so the output is the target's greedy output token for token
//   commit  n = tokens yielded: the target keeps rows 0..n-1 (rollback), the drafter context takes
//           their taps; the next anchor is the last yielded token at P + n.
// The target's multi-row forward gives every row the bits of a one-row forward (SPEC 5.5), so the
// accepted tokens are the plain decode's tokens exactly, not up to ties.
//
// Device-resident cycle (greedy, with a drafter that drafts on the target's backend, #7 item 3): the
// draft block [a, d_1..] stays in backend memory, the verify reads it there, and the verify's one
// download brings back the block with the argmax; the taps go from the target to the drafter in
// backend memory too. So the host waits once per cycle, to learn what was accepted.
//
// Sampling (temperature > 0): the draft is deterministic, so d_i is accepted with probability
// p_{i-1}(d_i) under row i-1's filtered, tempered distribution; at the first rejection the bonus is
// drawn from p_{i-1} without d_i (renormalised), else from p_{w-1}. This is speculative sampling
// (Leviathan et al. 2023, Chen et al. 2023) with a point-mass proposal: each yielded token is
// distributed as plain sampling's.
#include <algorithm>
#include <chrono>
#include <span>

#include "models/dflash_drafter.h"
#include "spec/engine.h"
#include "util/error.h"

namespace dflash {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

bool is_stop_token(const GenerateOptions& o, int32_t t) {
  return std::find(o.stop_tokens.begin(), o.stop_tokens.end(), t) != o.stop_tokens.end();
}

}  // namespace

void Engine::generate_speculative(int32_t anchor, const GenerateOptions& opts, const TokenCallback& cb,
                                  GenerateStats& st, Sampler* sampler) {
  Drafter& dr = *drafter_;
  const int64_t B = opts.block;
  DFLASH_CHECK(B >= 2 && B <= dr.block_size(),
               "the verify block width is {}; it must be 2..{} (the drafter's trained block size)", B,
               dr.block_size());
  st.accepted_at.assign(static_cast<size_t>(B - 1), 0);
  st.drafted_at.assign(static_cast<size_t>(B - 1), 0);
  const auto t_begin = Clock::now();

  // Yields t with plain decoding's rules; false when generation ends here.
  auto yield = [&](int32_t t) {
    ++st.generated;
    const bool stop = is_stop_token(opts, t);
    st.stopped_by_token = stop;
    return cb(t) && !stop && st.generated < opts.max_tokens;
  };

  const bool on_device = sampler == nullptr && dr.drafts_on_device();
  auto run = [&] {
    if (!yield(anchor)) return;
    ForwardOptions fo;
    fo.logits = LogitRows::kAll;
    fo.want_taps = true;
    fo.taps_on_device = on_device;
    fo.undoable = true;
    fo.want_logits = sampler != nullptr;
    std::vector<int32_t> block;
    block.reserve(static_cast<size_t>(B));
    for (;;) {
      const int64_t P = target_.n_past();
      if (P >= target_.n_ctx()) {  // the context is full: stop like plain decoding does
        st.context_full = true;
        return;
      }
      DFLASH_CHECK(dr.context_end() == P, "internal: drafter context ends at {} but the target cache at {}",
                   dr.context_end(), P);
      const int64_t w = std::min({B, target_.n_ctx() - P, opts.max_tokens - st.generated, target_.max_rows()});
      block.assign(1, anchor);
      ForwardResult r;
      if (on_device && w >= 2) {
        // timed phases: the previous cycle's rollback and appends finish first (they count as other)
        if (opts.time_phases) target_.backend().synchronize();
        const auto t0 = Clock::now();
        const int32_t* d_block = dr.draft_device(anchor);  // enqueued, not waited for
        if (opts.time_phases) target_.backend().synchronize();
        const auto t1 = Clock::now();
        st.draft_seconds += seconds_between(t0, t1);
        r = target_.forward_device(d_block, w, fo);
        st.verify_seconds += seconds_between(t1, Clock::now());
        DFLASH_CHECK(static_cast<int64_t>(r.tokens.size()) == w && r.tokens[0] == anchor,
                     "internal: the device draft block starts with {}, not the anchor {}",
                     r.tokens.empty() ? -1 : r.tokens[0], anchor);
        block = r.tokens;
      } else {
        if (w >= 2) {
          const auto t0 = Clock::now();
          const std::vector<int32_t> d = dr.draft(anchor);
          DFLASH_CHECK(static_cast<int64_t>(d.size()) >= w - 1, "internal: the drafter proposed {} tokens, need {}",
                       d.size(), w - 1);
          block.insert(block.end(), d.begin(), d.begin() + (w - 1));
          st.draft_seconds += seconds_between(t0, Clock::now());
        }
        const auto t1 = Clock::now();
        r = target_.forward(block, fo);
        st.verify_seconds += seconds_between(t1, Clock::now());
      }
      DFLASH_CHECK(static_cast<int64_t>(r.argmax.size()) == w, "internal: verify returned {} argmax rows for {}",
                   r.argmax.size(), w);

      int64_t k = 0;
      int32_t bonus = -1;
      if (!sampler) {
        while (k < w - 1 && block[k + 1] == r.argmax[k]) ++k;
        bonus = r.argmax[k];
      } else {
        const size_t V = r.logits.size() / static_cast<size_t>(w);
        auto row = [&](int64_t i) { return std::span<const float>(r.logits.data() + V * i, V); };
        for (; k < w - 1; ++k)
          if (!sampler->accept_draft(row(k), block[k + 1], &bonus)) break;
        if (bonus < 0) bonus = sampler->sample(row(k));
      }
      ++st.cycles;
      st.drafted += w - 1;
      st.accepted += k;
      st.accepted_per_cycle.push_back(static_cast<int32_t>(k));
      for (int64_t i = 0; i < k; ++i) ++st.accepted_at[i];
      for (int64_t i = 0; i < w - 1; ++i) ++st.drafted_at[i];

      // Yield d_1..d_k, bonus. Before token j is yielded, row j-1's token enters the cache.
      int64_t n = 0;
      bool more = true;
      for (int64_t j = 0; j <= k && more; ++j) {
        const int32_t t = j < k ? block[j + 1] : bonus;
        cached_.push_back(block[j]);
        ++n;
        anchor = t;
        more = yield(t);
      }
      target_.rollback(n);  // keep rows 0..n-1: the cache holds everything yielded but the last token
      if (on_device) {
        dr.append_context_device(target_.device_taps(), n);
      } else {
        const size_t width = r.taps.size() / static_cast<size_t>(w);
        dr.append_context(std::span<const float>(r.taps.data(), width * n), n);
      }
      if (!more) return;
    }
  };
  run();
  st.other_seconds = std::max(0.0, seconds_between(t_begin, Clock::now()) - st.draft_seconds - st.verify_seconds);
}

}  // namespace dflash
