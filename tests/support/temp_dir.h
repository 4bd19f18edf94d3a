// Per-process scratch files for tests: temp_path(suite, name) is <tmp>/dflash_<suite>_<pid>/<name>. The
// directory is created on first use and removed, with everything in it, when the process exits, so
// parallel ctest processes never share files and reruns leave nothing behind in /tmp. (Children started
// with posix_spawn or std::system do not run the parent's exit handlers; the removal also checks the pid.)
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

namespace dflash::testing {

namespace detail {
struct TempDirs {
  std::mutex mu;
  std::vector<std::filesystem::path> dirs;
  pid_t owner = ::getpid();
};
inline TempDirs& temp_dirs() {
  static TempDirs* t = [] {
    auto* p = new TempDirs;  // never destroyed: the exit handler below still needs it
    std::atexit([] {
      TempDirs& d = temp_dirs();
      if (::getpid() != d.owner) return;
      std::error_code ec;
      for (const auto& dir : d.dirs) std::filesystem::remove_all(dir, ec);
    });
    return p;
  }();
  return *t;
}
}  // namespace detail

inline std::string temp_path(const std::string& suite, const std::string& name) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("dflash_" + suite + "_" + std::to_string(::getpid()));
  detail::TempDirs& t = detail::temp_dirs();
  {
    std::lock_guard<std::mutex> lock(t.mu);
    bool known = false;
    for (const auto& d : t.dirs) known = known || d == dir;
    if (!known) t.dirs.push_back(dir);
  }
  fs::create_directories(dir);
  return (dir / name).string();
}

}  // namespace dflash::testing
