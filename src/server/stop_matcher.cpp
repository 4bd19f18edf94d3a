#include "server/stop_matcher.h"

#include <algorithm>

namespace dflash::server {

StopMatcher::StopMatcher(std::vector<std::string> stops) {
  for (auto& s : stops)
    if (!s.empty()) stops_.push_back(std::move(s));
}

std::string StopMatcher::push(std::string_view text) {
  if (stopped_) return {};
  held_.append(text);
  if (stops_.empty()) {
    std::string out;
    out.swap(held_);
    return out;
  }
  // The earliest complete stop string. held_ is short before the append (< the longest stop), so
  // the search costs O(|text| * stops).
  size_t cut = std::string::npos;
  for (const std::string& s : stops_) cut = std::min(cut, held_.find(s));
  if (cut != std::string::npos) {
    std::string out = held_.substr(0, cut);
    held_.clear();
    stopped_ = true;
    return out;
  }
  // Keep the longest suffix that is a proper prefix of a stop string.
  size_t keep = 0;
  for (const std::string& s : stops_) {
    for (size_t k = std::min(s.size() - 1, held_.size()); k > keep; --k) {
      if (std::string_view(held_).substr(held_.size() - k) == std::string_view(s).substr(0, k)) {
        keep = k;
        break;
      }
    }
  }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopMatcher::finish() {
  std::string out;
  if (!stopped_) out.swap(held_);
  held_.clear();
  return out;
}

}  // namespace dflash::server
