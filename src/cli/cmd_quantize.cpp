// `dflash quantize IN OUT --type T`: re-quantizes every weight matrix of a GGUF file to T and copies
// everything else (metadata, other tensors) as is.
//
// A tensor is converted when it is a matrix (n_dims == 2), its name ends in ".weight", its row length
// is a multiple of T's block, and its own type has a codec. Ternary and 1-bit targets (tq1_0, tq2_0,
// q1_0, q2_0, pq2_0, ptq1_0) leave the Gated DeltaNet gate projections (ssm_alpha, ssm_beta) as they are,
// as Ternary Bonsai 2 files do (BF16): ternary gates change the model's output; --all-matrices
// converts them too. Each row goes dequantize_row -> f32 ->
// quantize_row, split over threads; the output streams to disk in row chunks (Writer::add_tensor_rows)
// so a file larger than memory can be converted.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "cli/commands.h"
#include "gguf/gguf.h"
#include "util/error.h"
#include "util/parallel.h"

namespace dflash::cli {
namespace {

std::string codec_type_names() {
  std::string names;
  for (uint32_t id = 0; id < 256; ++id) {
    const TypeTraits* t = type_traits(id);
    if (t && t->has_codec) names += (names.empty() ? "" : ", ") + std::string(t->name);
  }
  return names;
}

// Types of at most ~2 bits per weight, where the GDN gates stay at their own precision.
bool low_bit(GgmlType t) {
  switch (t) {
    case GgmlType::TQ1_0: case GgmlType::TQ2_0: case GgmlType::Q1_0: case GgmlType::Q2_0:
    case GgmlType::PQ2_0: case GgmlType::PTQ1_0: return true;
    default: return false;
  }
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

struct Opts {
  std::string in, out, type;
  int threads = 0;
  bool all_matrices = false;
};

void run_quantize(const Opts& o) {
  const auto target = type_from_name(o.type);
  if (!target || !type_traits(*target).has_codec)
    fail("unknown quantization type '{}': expected one of {}", o.type, codec_type_names());
  const TypeTraits& to = type_traits(*target);
  const int n_threads = o.threads > 0 ? o.threads : hardware_threads();

  auto in = std::make_shared<gguf::File>(gguf::File::open(o.in));
  gguf::Writer w(3, in->alignment());
  for (const auto& kv : in->metadata()) w.set(kv.key, kv.value);

  struct Row {
    std::string name, from, to;
    uint64_t before, after;
  };
  std::vector<Row> table;
  uint64_t total_before = 0, total_after = 0;
  for (const gguf::TensorInfo& t : in->tensors()) {
    const TypeTraits& from = type_traits(t.type);
    const bool gate = ends_with(t.name, ".ssm_alpha.weight") || ends_with(t.name, ".ssm_beta.weight");
    const bool convert = t.n_dims == 2 && ends_with(t.name, ".weight") && t.ne[0] % to.block_elems == 0 &&
                         from.has_codec && t.type != to.type && (o.all_matrices || !(gate && low_bit(to.type)));
    std::vector<int64_t> ne(t.ne, t.ne + t.n_dims);
    const uint8_t* src = in->tensor_data(t).data();
    const size_t src_row = row_bytes(t.type, t.ne[0]);
    uint64_t after = t.nbytes;
    if (!convert) {
      w.add_tensor_rows(t.name, t.type, ne, [src, src_row](int64_t r0, int64_t n, uint8_t* dst) {
        std::memcpy(dst, src + static_cast<size_t>(r0) * src_row, static_cast<size_t>(n) * src_row);
      });
    } else {
      const int64_t ne0 = t.ne[0];
      const size_t dst_row = row_bytes(to.type, ne0);
      after = static_cast<uint64_t>(dst_row) * static_cast<uint64_t>(t.n_rows());
      const GgmlType from_type = t.type, to_type = to.type;
      w.add_tensor_rows(t.name, to.type, ne,
                        [=](int64_t r0, int64_t n, uint8_t* dst) {
                          parallel_ranges(r0, r0 + n, n_threads, 1, [&](int64_t a, int64_t b) {
                            std::vector<float> buf(static_cast<size_t>(ne0));
                            for (int64_t r = a; r < b; ++r) {
                              dequantize_row(from_type, src + static_cast<size_t>(r) * src_row, buf.data(), ne0);
                              quantize_row(to_type, buf.data(), dst + static_cast<size_t>(r - r0) * dst_row, ne0);
                            }
                          });
                        });
    }
    table.push_back({t.name, from.name, convert ? to.name : from.name, t.nbytes, after});
    total_before += t.nbytes;
    total_after += after;
  }
  w.write(o.out);

  size_t nw = 6;
  for (const auto& r : table) nw = std::max(nw, r.name.size());
  fmt::print("{:<{}}  {:<6}  {:<6}  {:>14}  {:>14}\n", "tensor", nw, "from", "to", "bytes before", "bytes after");
  for (const auto& r : table)
    fmt::print("{:<{}}  {:<6}  {:<6}  {:>14}  {:>14}\n", r.name, nw, r.from, r.to, r.before, r.after);
  fmt::print("{:<{}}  {:<6}  {:<6}  {:>14}  {:>14}\n", "total", nw, "", "", total_before, total_after);
  fmt::print("size ratio {:.4f} ({} -> {})\n",
             total_before ? static_cast<double>(total_after) / static_cast<double>(total_before) : 1.0, o.in, o.out);
}

}  // namespace

void register_quantize(CLI::App& app) {
  auto opts = std::make_shared<Opts>();
  CLI::App* sub = app.add_subcommand("quantize", "Re-quantize the weight matrices of a GGUF file");
  sub->add_option("in", opts->in, "Input GGUF file")->required();
  sub->add_option("out", opts->out, "Output GGUF file")->required();
  sub->add_option("--type,-t", opts->type, "Target type (" + codec_type_names() + ")")->required();
  sub->add_option("--threads,-j", opts->threads, "Threads (default: all cores)");
  sub->add_flag("--all-matrices", opts->all_matrices,
                "also convert ssm_alpha/ssm_beta to a ternary or 1-bit type (kept as they are by default)");
  sub->callback([opts] { run_quantize(*opts); });
}

}  // namespace dflash::cli
