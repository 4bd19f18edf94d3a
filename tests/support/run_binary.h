// Running the built `dflash` binary from a test: shell quoting, a per-test scratch directory, and
// the exit code with captured stdout / stderr.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace dflash::testing {

inline std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct RunResult {
  int code = -1;
  std::string out, err;
};

// A fixture with a fresh scratch directory per test case (removed when the case passes) and run().
class BinaryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::temp_directory_path() /
           fmt::format("dflash_{}_{}_{}", ::getpid(), info->test_suite_name(), info->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override {
    if (!HasFailure()) std::filesystem::remove_all(dir_);
  }
  std::filesystem::path path(const std::string& name) const { return dir_ / name; }

  // Runs `dflash <args>` (args already shell-quoted where needed), optionally with `env` prefixed.
  RunResult run(const std::string& args, const std::string& env = "") {
    const auto out = path("stdout.txt"), err = path("stderr.txt");
    const std::string cmd = fmt::format("{}{} {} </dev/null >{} 2>{}", env.empty() ? "" : env + " ",
                                        shell_quote(DFLASH_BINARY), args, shell_quote(out.string()),
                                        shell_quote(err.string()));
    const int status = std::system(cmd.c_str());
    RunResult r;
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    r.out = slurp(out);
    r.err = slurp(err);
    return r;
  }

  std::filesystem::path dir_;
};

}  // namespace dflash::testing
