// Where one step's wall time goes on the GPU, from the real (overlapped) kernel timeline.
//
// ncu runs every kernel alone, so it cannot show what programmatic dependent launch overlaps, and the
// GPU machine has no nsys. StepTimeline records the kernels of a stretch of work through CUPTI's
// activity API (kernel start / end timestamps, graph-launched kernels included) and reports, per
// kernel name and grid, the *exposed* time: how far each kernel's end moves the running end of the
// step (kernels in start order). Exposed times plus idle gaps add up to the step's span.
// A benchmark diagnostic only (bench_cuda_ops, DFLASH_STEP_TIMELINE); built when CMake finds CUPTI.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dflash::bench {

struct KernelSpan {
  uint64_t start_ns = 0, end_ns = 0;
  std::string name;  // demangled, without namespaces and parameter list
  int grid_x = 0, grid_y = 0, grid_z = 0;
};

// A kernel's mangled name as the report shows it: demangled, without namespaces, "void" and parameters.
std::string short_kernel_name(const char* mangled);

// The report over recorded spans (also used by the tests of the analysis on the CPU).
std::string timeline_report(std::vector<KernelSpan> spans, const std::string& title);

class StepTimeline {
 public:
  static bool available();  // false when built without CUPTI
  void begin();             // start recording kernel activity
  // Stops recording (flushes CUPTI's buffers) and returns the kernels recorded since begin().
  std::vector<KernelSpan> end();
};

}  // namespace dflash::bench
