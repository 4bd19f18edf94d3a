#include "step_timeline.h"

#include <cxxabi.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <regex>
#include <stdexcept>

#ifdef DFLASH_HAVE_CUPTI
#include <cupti.h>
#endif

namespace dflash::bench {

std::string short_kernel_name(const char* mangled) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> dem(abi::__cxa_demangle(mangled, nullptr, nullptr, &status), std::free);
  std::string s = status == 0 && dem ? dem.get() : mangled;
  s = std::regex_replace(s, std::regex(R"(\(anonymous namespace\)::)"), "");  // before the '(' cut below
  const size_t paren = s.find('(');
  if (paren != std::string::npos) s.resize(paren);  // the parameter list
  if (s.rfind("void ", 0) == 0) s.erase(0, 5);
  s = std::regex_replace(s, std::regex(R"(\b\w+::)"), "");  // namespaces, also inside template arguments
  return s;
}

std::string timeline_report(std::vector<KernelSpan> spans, const std::string& title) {
  if (spans.empty()) return fmt::format("### {}\n\nno kernels recorded\n", title);
  std::sort(spans.begin(), spans.end(), [](const KernelSpan& a, const KernelSpan& b) {
    return a.start_ns != b.start_ns ? a.start_ns < b.start_ns : a.end_ns < b.end_ns;
  });
  struct Group {
    int launches = 0;
    double duration_ns = 0, exposed_ns = 0;
  };
  std::map<std::pair<std::string, std::string>, Group> groups;
  const uint64_t t0 = spans.front().start_ns;
  uint64_t run_end = t0, last_end = t0;
  double gaps = 0, durations = 0;
  for (const KernelSpan& k : spans) {
    if (k.start_ns > run_end) gaps += static_cast<double>(k.start_ns - run_end);
    const uint64_t from = std::max(run_end, k.start_ns);
    Group& g = groups[{k.name, fmt::format("{}x{}x{}", k.grid_x, k.grid_y, k.grid_z)}];
    g.launches += 1;
    g.duration_ns += static_cast<double>(k.end_ns - k.start_ns);
    g.exposed_ns += k.end_ns > from ? static_cast<double>(k.end_ns - from) : 0.0;
    durations += static_cast<double>(k.end_ns - k.start_ns);
    run_end = std::max(run_end, k.end_ns);
    last_end = std::max(last_end, k.end_ns);
  }
  const double span = static_cast<double>(last_end - t0);
  std::vector<std::pair<std::pair<std::string, std::string>, Group>> rows(groups.begin(), groups.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.exposed_ns > b.second.exposed_ns; });
  std::string out = fmt::format(
      "### {}\n\n{} kernels, span {:.1f} us, idle gaps {:.1f} us, summed durations {:.1f} us (kernels overlap: "
      "a duration includes the time a kernel's CTAs wait in griddepcontrol.wait)\n\n",
      title, spans.size(), span / 1e3, gaps / 1e3, durations / 1e3);
  out += "| kernel | grid | launches | exposed us (% of span) | exposed us / launch | duration us / launch |\n";
  out += "|---|---|---:|---:|---:|---:|\n";
  for (const auto& [key, g] : rows)
    out += fmt::format("| {} | {} | {} | {:.1f} ({:.1f} %) | {:.2f} | {:.2f} |\n", key.first, key.second, g.launches,
                       g.exposed_ns / 1e3, 100.0 * g.exposed_ns / span, g.exposed_ns / g.launches / 1e3,
                       g.duration_ns / g.launches / 1e3);
  return out;
}

#ifdef DFLASH_HAVE_CUPTI
namespace {

std::mutex g_mutex;
std::vector<KernelSpan> g_spans;
constexpr size_t kBufferBytes = 8 << 20;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  std::lock_guard<std::mutex> lock(g_mutex);
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && record->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
    g_spans.push_back(KernelSpan{k->start, k->end, short_kernel_name(k->name), k->gridX, k->gridY, k->gridZ});
  }
  std::free(buffer);
}

void check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  throw std::runtime_error(fmt::format("CUPTI {}: {}", what, msg ? msg : "unknown error"));
}

}  // namespace

bool StepTimeline::available() { return true; }

void StepTimeline::begin() {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_spans.clear();
  }
  static const bool registered = [] {
    check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "register callbacks");
    return true;
  }();
  (void)registered;
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernel activity");
}

std::vector<KernelSpan> StepTimeline::end() {
  check(cuptiActivityFlushAll(1), "flush");
  check(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "disable kernel activity");
  std::lock_guard<std::mutex> lock(g_mutex);
  return std::move(g_spans);
}
#else
bool StepTimeline::available() { return false; }
void StepTimeline::begin() { throw std::runtime_error("bench_cuda_ops was built without CUPTI (no step timeline)"); }
std::vector<KernelSpan> StepTimeline::end() { return {}; }
#endif

}  // namespace dflash::bench
