// `dflash dump FILE --tensor NAME [--out PATH] [--limit N]`: one tensor dequantized to f32, either as
// raw little-endian floats to PATH (row after row, ne[0] floats each) or as text: one row per line,
// at most N rows, then a summary (min, max, mean, rms over the whole tensor).
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "cli/commands.h"
#include "gguf/gguf.h"
#include "util/error.h"

namespace dflash::cli {
namespace {

// One row of a tensor as floats: the codec for float/quantized types, a cast for integer types.
void row_to_f32(GgmlType type, const uint8_t* src, float* dst, int64_t n) {
  auto cast = [&](auto tag) {
    using T = decltype(tag);
    for (int64_t i = 0; i < n; ++i) {
      T v;
      std::memcpy(&v, src + static_cast<size_t>(i) * sizeof(T), sizeof(T));
      dst[i] = static_cast<float>(v);
    }
  };
  switch (type) {
    case GgmlType::I8: return cast(int8_t{});
    case GgmlType::I16: return cast(int16_t{});
    case GgmlType::I32: return cast(int32_t{});
    case GgmlType::I64: return cast(int64_t{});
    case GgmlType::F64: return cast(double{});
    default: dequantize_row(type, src, dst, n);
  }
}

struct Opts {
  std::string path, tensor, out;
  int64_t limit = 16;
};

void run_dump(const Opts& o) {
  gguf::File f = gguf::File::open(o.path);
  const gguf::TensorInfo& t = f.tensor(o.tensor);
  const uint8_t* src = f.tensor_data(t).data();
  const size_t src_row = row_bytes(t.type, t.ne[0]);
  const int64_t ne0 = t.ne[0], rows = t.n_rows();
  std::vector<float> row(static_cast<size_t>(ne0));

  if (!o.out.empty()) {
    std::FILE* out = std::fopen(o.out.c_str(), "wb");
    if (!out) fail("{}: cannot create: {}", o.out, std::strerror(errno));
    for (int64_t r = 0; r < rows; ++r) {
      row_to_f32(t.type, src + static_cast<size_t>(r) * src_row, row.data(), ne0);
      if (std::fwrite(row.data(), sizeof(float), row.size(), out) != row.size()) {
        std::fclose(out);
        fail("{}: write failed: {}", o.out, std::strerror(errno));
      }
    }
    if (std::fclose(out) != 0) fail("{}: write failed: {}", o.out, std::strerror(errno));
    fmt::print(stderr, "{}: {} {} -> {} ({} floats)\n", t.name, type_name(t.type), t.shape_string(), o.out,
               t.n_elements());
    return;
  }

  fmt::print("# {} {} {}\n", t.name, type_name(t.type), t.shape_string());
  double sum = 0, sum2 = 0;
  float lo = std::numeric_limits<float>::infinity(), hi = -lo;
  for (int64_t r = 0; r < rows; ++r) {
    row_to_f32(t.type, src + static_cast<size_t>(r) * src_row, row.data(), ne0);
    for (float v : row) {
      sum += v;
      sum2 += static_cast<double>(v) * v;
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    if (o.limit < 0 || r < o.limit) {
      std::string line;
      for (int64_t i = 0; i < ne0; ++i) {
        if (i) line += ' ';
        line += fmt::format("{:.9g}", row[static_cast<size_t>(i)]);
      }
      fmt::print("{}\n", line);
    }
  }
  if (o.limit >= 0 && rows > o.limit) fmt::print("... ({} more rows)\n", rows - o.limit);
  const double n = static_cast<double>(t.n_elements());
  if (n > 0)
    fmt::print("# {} elements: min {:.9g} max {:.9g} mean {:.9g} rms {:.9g}\n", t.n_elements(), lo, hi, sum / n,
               std::sqrt(sum2 / n));
}

}  // namespace

void register_dump(CLI::App& app) {
  auto opts = std::make_shared<Opts>();
  CLI::App* sub = app.add_subcommand("dump", "Print or save one tensor dequantized to f32");
  sub->add_option("file", opts->path, "GGUF file")->required();
  sub->add_option("--tensor", opts->tensor, "Tensor name")->required();
  sub->add_option("--out,-o", opts->out, "Write raw little-endian f32 to this file instead of text");
  sub->add_option("--limit", opts->limit, "Rows printed as text (default 16; -1 for all)");
  sub->callback([opts] { run_dump(*opts); });
}

}  // namespace dflash::cli
