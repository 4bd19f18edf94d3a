// Where the bundled default model pair is found when no -m / -d is given.
//
// Search order: $DFLASH_MODELS_DIR, then <dir of the dflash binary>/../models and
// <dir of the binary>/models (a build tree inside the checkout, an installed tree), then ./models.
// The pair is models/target.gguf and models/drafter.gguf.
#pragma once

#include <optional>
#include <string>

namespace dflash::cli {

// The bundled target; throws dflash::Error listing the places searched when there is none.
std::string default_target_path();
// The bundled drafter next to the bundled target, if present.
std::optional<std::string> default_drafter_path();

}  // namespace dflash::cli
