#include "spec/engine.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>

#include "models/dflash_drafter.h"
#include "util/error.h"

namespace dflash {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

bool is_stop(const GenerateOptions& o, int32_t t) {
  return std::find(o.stop_tokens.begin(), o.stop_tokens.end(), t) != o.stop_tokens.end();
}

}  // namespace

Engine::Engine(TargetModel& target, Drafter* drafter) : target_(target), drafter_(drafter) {}
Engine::~Engine() = default;

void Engine::reset() {
  target_.reset();
  if (drafter_) drafter_->reset_context();
  cached_.clear();
}

int32_t Engine::prepare(std::span<const int32_t> prompt, GenerateStats& st, bool want_taps, Sampler* sampler) {
  DFLASH_CHECK(!prompt.empty(), "the prompt is empty");
  DFLASH_CHECK(static_cast<int64_t>(prompt.size()) < target_.n_ctx(),
               "the prompt has {} tokens; the context holds {} (prompt + generated tokens)", prompt.size(),
               target_.n_ctx());
  // Reuse the cache when it holds a strict prefix of the prompt (at least one new token is needed
  // to get the next logits; recurrent state cannot be truncated, so anything else starts over).
  const bool reuse = !cached_.empty() && cached_.size() < prompt.size() &&
                     std::equal(cached_.begin(), cached_.end(), prompt.begin()) &&
                     target_.n_past() == static_cast<int64_t>(cached_.size()) &&
                     // the drafter context must mirror the cache: its rows come from taps we no longer have
                     (!want_taps || drafter_->context_end() == static_cast<int64_t>(cached_.size()));
  if (!reuse) reset();
  st.prompt_tokens = static_cast<int64_t>(prompt.size());
  st.reused_tokens = static_cast<int64_t>(cached_.size());
  const auto t0 = std::chrono::steady_clock::now();
  prompt_taps_.clear();
  std::vector<float> logits;
  const std::span<const int32_t> rest = prompt.subspan(cached_.size());
  int32_t first = -1;
  if (want_taps && drafter_->drafts_on_device()) {
    // Each chunk's taps go to the drafter in backend memory. As one append of the whole prompt would,
    // only the last context_keep() rows are projected; the drafter skips the older ones.
    const int64_t n = static_cast<int64_t>(rest.size());
    const int64_t keep = drafter_->context_keep();
    const int64_t from = keep < n ? n - keep : 0;  // first row that needs its features
    const int64_t width = static_cast<int64_t>(target_.tap_layers().size()) * target_.config().n_embd;
    int64_t done = 0;
    first = prefill_device_taps(
        target_, rest,
        [&](const float* taps, int64_t rows) {
          const int64_t lo = std::clamp(from, done, done + rows);
          drafter_->skip_context(lo - done);
          if (done + rows > lo) drafter_->append_context_device(taps + (lo - done) * width, done + rows - lo);
          done += rows;
        },
        sampler ? &logits : nullptr);
  } else {
    first = prefill(target_, rest, want_taps ? &prompt_taps_ : nullptr, sampler ? &logits : nullptr);
    if (want_taps) drafter_->append_context(prompt_taps_, static_cast<int64_t>(rest.size()));
  }
  if (sampler) first = sampler->sample(logits);
  st.prefill_seconds = seconds_since(t0);
  cached_.assign(prompt.begin(), prompt.end());
  return first;
}

GenerateStats Engine::generate(std::span<const int32_t> prompt, const GenerateOptions& opts,
                               const TokenCallback& on_token) {
  DFLASH_CHECK(opts.max_tokens >= 1, "max_tokens must be at least 1, got {}", opts.max_tokens);
  const std::string bad = opts.sampling.check();
  DFLASH_CHECK(bad.empty(), "sampling: {}", bad);
  GenerateStats st;
  std::optional<Sampler> sampler;
  if (!opts.sampling.greedy()) sampler.emplace(opts.sampling);
  const bool spec = opts.speculative && drafter_ != nullptr;
  const int32_t anchor = prepare(prompt, st, spec, sampler ? &*sampler : nullptr);
  const auto t0 = std::chrono::steady_clock::now();
  if (spec)
    generate_speculative(anchor, opts, on_token, st, sampler ? &*sampler : nullptr);
  else
    generate_plain(anchor, opts, on_token, st, sampler ? &*sampler : nullptr);
  st.decode_seconds = seconds_since(t0);
  return st;
}

// Plain decode: yield the anchor, feed it, take the argmax (or a draw), repeat.
void Engine::generate_plain(int32_t token, const GenerateOptions& opts, const TokenCallback& cb, GenerateStats& st,
                            Sampler* sampler) {
  for (;;) {
    ++st.generated;
    const bool stop = is_stop(opts, token);
    st.stopped_by_token = stop;
    if (!cb(token) || stop || st.generated >= opts.max_tokens) return;
    if (target_.n_past() >= target_.n_ctx()) {  // the context is full: stop like max_tokens does
      st.context_full = true;
      return;
    }
    const int32_t in[1] = {token};
    ForwardOptions fo;
    fo.logits = LogitRows::kLast;
    fo.want_logits = sampler != nullptr;
    const ForwardResult r = target_.forward(in, fo);
    cached_.push_back(token);
    token = sampler ? sampler->sample(r.logits) : r.argmax.back();
  }
}

}  // namespace dflash
