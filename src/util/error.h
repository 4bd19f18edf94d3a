// dflash::Error — the one exception type the engine throws for bad input or failed invariants.
//
// Messages carry their context (file, offset, key or tensor, what was expected) so a user can act on
// them: "model.gguf: tensor 'blk.3.attn_q.weight' at offset 0x1a2b: expected shape [512, 1024], got
// [512, 512]". Front ends catch Error at the top, print what(), and exit non-zero.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace dflash {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Throws Error with a fmt-formatted message.
template <typename... Args>
[[noreturn]] inline void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

// Checks a condition that bad input can break; throws Error with the message when it fails.
#define DFLASH_CHECK(cond, ...)                 \
  do {                                          \
    if (!(cond)) ::dflash::fail(__VA_ARGS__);   \
  } while (0)

}  // namespace dflash
