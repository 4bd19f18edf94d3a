// Token ids written as text, as users give them on the command line: `dflash run --tokens 1,2,3`,
// `dflash draft --tokens ...`, `dflash detokenize 1 2 3` or `[1, 2, 3]` pasted from JSON.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace dflash {

// The ids in `text`: decimal numbers separated by commas, white space or the brackets of a JSON
// array, in order (no ids: an empty vector). Throws dflash::Error naming `what` (the option or
// command) and the offending item for anything else: a sign, a letter, a number above INT32_MAX.
std::vector<int32_t> parse_token_ids(std::string_view text, std::string_view what);

}  // namespace dflash
