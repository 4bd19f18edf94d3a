// The compute backend a CLI command runs on: `--device cpu` (default) or `--device cuda[:N]`.
#pragma once

#include <memory>
#include <string>

#include "ops/backend.h"

namespace dflash::cli {

// "cpu" -> the CPU backend with `threads` threads (0 = all cores); "cuda" or "cuda:N" -> the CUDA
// backend on device N (0 by default). Throws dflash::Error naming the problem when the binary was
// built without CUDA, no GPU is present, or the name is unknown.
std::unique_ptr<Backend> make_backend(const std::string& device, int threads);

// The help text of a --device option.
constexpr const char* kDeviceHelp = "compute device: cpu, or cuda[:N] (an NVIDIA GPU)";

}  // namespace dflash::cli
