// A visible wait while a large model loads: TargetModel::load on the CPU backend only keeps pointers
// into the GGUF mapping, so the real cost of a big file is faulting its pages in. prefetch_file()
// reads every page of the tensor data once (madvise(WILLNEED) per 64 MiB window, then one byte per
// page) and draws a progress bar on stderr while it does, so the first token does not stall on disk.
//
// (A progress callback inside TargetModel::load would need TargetOptions to carry one; on the CPU
// backend there is little else to report, and a GPU backend's uploads could report the same way.)
#pragma once

#include <cstdint>
#include <string>

namespace dflash::gguf {
class File;
}

namespace dflash::cli {

// Prefetches the tensor data of `file`. Files smaller than `min_bytes` are skipped. The bar is drawn
// (with \r) only when stderr is a terminal; otherwise one line is printed at the start and the end.
void prefetch_file(const gguf::File& file, uint64_t min_bytes = 256ull << 20);

// "\r<label>: NN%" on stderr while a long job (writing a file) makes progress, on a terminal only;
// usable as a progress(done, total) callback. finish() ends the line if one was drawn.
class PercentProgress {
 public:
  explicit PercentProgress(std::string label) : label_(std::move(label)) {}
  void operator()(uint64_t done, uint64_t total);
  void finish();

 private:
  std::string label_;
  int last_pct_ = -1;
};

}  // namespace dflash::cli
