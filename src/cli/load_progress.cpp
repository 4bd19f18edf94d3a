#include "cli/load_progress.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>

#include <fmt/format.h>

#include "gguf/gguf.h"

namespace dflash::cli {

void prefetch_file(const gguf::File& file, uint64_t min_bytes) {
  const uint8_t* lo = nullptr;
  const uint8_t* hi = nullptr;
  for (const gguf::TensorInfo& t : file.tensors()) {
    if (t.nbytes == 0) continue;
    const std::span<const uint8_t> d = file.tensor_data(t);
    if (!lo || d.data() < lo) lo = d.data();
    if (!hi || d.data() + d.size() > hi) hi = d.data() + d.size();
  }
  if (!lo || static_cast<uint64_t>(hi - lo) < min_bytes) return;

  const uint64_t total = static_cast<uint64_t>(hi - lo);
  const bool tty = ::isatty(STDERR_FILENO) == 1;
  const std::string name = std::filesystem::path(file.path()).filename().string();
  const double gib = 1024.0 * 1024.0 * 1024.0;
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  if (!tty) fmt::print(stderr, "loading {} ({:.2f} GiB)...\n", name, total / gib);

  const long page_l = ::sysconf(_SC_PAGESIZE);
  const uintptr_t page = page_l > 0 ? static_cast<uintptr_t>(page_l) : 4096;
  constexpr uint64_t kWindow = 64ull << 20;
  volatile uint8_t sink = 0;
  uint8_t acc = 0;
  int last_pct = -1;
  for (uint64_t off = 0; off < total; off += kWindow) {
    const uint64_t len = std::min(kWindow, total - off);
    const uintptr_t a = reinterpret_cast<uintptr_t>(lo + off) & ~(page - 1);
    const uintptr_t b = reinterpret_cast<uintptr_t>(lo + off + len);
    ::madvise(reinterpret_cast<void*>(a), b - a, MADV_WILLNEED);  // a hint; failure (not a mapping) is fine
    for (uint64_t p = 0; p < len; p += page) acc ^= lo[off + p];
    acc ^= lo[off + len - 1];
    if (tty) {
      const uint64_t done = off + len;
      const int pct = static_cast<int>(100 * done / total);
      if (pct != last_pct) {
        last_pct = pct;
        constexpr int kWidth = 30;
        const int filled = pct * kWidth / 100;
        const double s = elapsed();
        fmt::print(stderr, "\rloading {} [{}{}] {:3d}% {:.2f}/{:.2f} GiB {:.2f} GiB/s", name, std::string(filled, '#'),
                   std::string(kWidth - filled, '.'), pct, done / gib, total / gib, s > 0 ? done / gib / s : 0.0);
        std::fflush(stderr);
      }
    }
  }
  sink = acc;
  (void)sink;
  if (tty)
    fmt::print(stderr, "\n");
  else
    fmt::print(stderr, "loaded {} in {:.1f} s\n", name, elapsed());
}

void PercentProgress::operator()(uint64_t done, uint64_t total) {
  const int pct = total ? static_cast<int>(100 * done / total) : 100;
  if (pct != last_pct_ && isatty(fileno(stderr))) {
    fmt::print(stderr, "\r{}: {:3d}%", label_, pct);
    last_pct_ = pct;
  }
}

void PercentProgress::finish() {
  if (last_pct_ >= 0) fmt::print(stderr, "\n");
  last_pct_ = -1;
}

}  // namespace dflash::cli
