#include "cli/model_paths.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <vector>

#include "util/error.h"

namespace dflash::cli {
namespace {

namespace fs = std::filesystem;

std::vector<fs::path> model_dirs() {
  std::vector<fs::path> dirs;
  if (const char* env = std::getenv("DFLASH_MODELS_DIR"); env && *env) dirs.emplace_back(env);
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    dirs.push_back(exe.parent_path().parent_path() / "models");
    dirs.push_back(exe.parent_path() / "models");
  }
  dirs.emplace_back("models");
  return dirs;
}

std::optional<std::string> find_model(const char* name) {
  for (const fs::path& d : model_dirs()) {
    std::error_code ec;
    if (fs::is_regular_file(d / name, ec)) return (d / name).string();
  }
  return std::nullopt;
}

}  // namespace

std::string default_target_path() {
  if (auto p = find_model("target.gguf")) return *p;
  std::string searched;
  for (const fs::path& d : model_dirs()) searched += "\n  " + (d / "target.gguf").string();
  fail("no model given (-m) and no bundled model found; searched:{}", searched);
}

std::optional<std::string> default_drafter_path() { return find_model("drafter.gguf"); }

}  // namespace dflash::cli
