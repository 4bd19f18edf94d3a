// Stop sequences over streamed text (OpenAI `stop`): the text is cut right before the first stop
// string, and while streaming, text that could be the start of a stop string is held back until the
// following text shows that it is not.
//
// Invariant: the held-back text is the longest suffix of everything pushed that is a proper prefix
// of some stop string. So an occurrence of a stop string always begins inside the held-back text
// (or in the newly pushed text), and emitted text never contains (the start of) a matched stop.
// Text comes from text::StreamDecoder (whole UTF-8 characters); a held-back suffix that matches the
// start of a valid UTF-8 stop string begins at a character boundary, so emitted pieces stay valid.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace dflash::server {

class StopMatcher {
 public:
  // Empty strings are ignored (callers reject them earlier with a 400).
  explicit StopMatcher(std::vector<std::string> stops = {});

  // Appends decoded text; returns the part that can be emitted now. When a stop string completes,
  // stopped() becomes true and the returned text ends right before it; later pushes return "".
  std::string push(std::string_view text);
  // End of generation without a stop: returns (and forgets) the held-back text.
  std::string finish();

  bool stopped() const { return stopped_; }
  size_t held_bytes() const { return held_.size(); }
  const std::vector<std::string>& stops() const { return stops_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace dflash::server
