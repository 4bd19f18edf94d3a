// libFuzzer target for the GGUF reader: any byte string must either parse or throw dflash::Error,
// never crash, hang, leak or read out of bounds. When it parses, every getter is exercised on every
// key (so type mismatches must throw cleanly too) and every tensor's data span is read end to end.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "gguf/gguf.h"
#include "util/error.h"

using namespace dflash;
using namespace dflash::gguf;

namespace {

template <typename F>
void quietly(F&& f) {
  try {
    f();
  } catch (const Error&) {
  }
}

volatile uint64_t g_sink;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    File f = File::from_bytes(std::vector<uint8_t>(data, data + size), "fuzz.gguf");
    uint64_t acc = f.version() + f.alignment() + f.data_offset() + f.file_size();
    for (const auto& kv : f.metadata()) {
      const std::string& k = kv.key;
      acc += format_value(kv.value, 4, 16).size() + kv.value.type_string().size();
      quietly([&] { acc += f.get_string(k).size(); });
      quietly([&] { acc += static_cast<uint64_t>(f.get_int(k)); });
      quietly([&] { acc += f.get_uint(k); });
      quietly([&] { acc += static_cast<uint64_t>(f.get_float(k) != 0.0); });
      quietly([&] { acc += f.get_bool(k); });
      quietly([&] { acc += f.get_string_array(k).size(); });
      quietly([&] { acc += f.get_int_array(k).size(); });
      quietly([&] { acc += f.get_float_array(k).size(); });
      quietly([&] { acc += f.get_int_or(k, 0) + f.get_string_or(k, "").size(); });
      acc += f.has(k);
    }
    for (const auto& t : f.tensors()) {
      acc += (f.find_tensor(t.name) == &t) + t.shape_string().size() + static_cast<uint64_t>(t.n_rows());
      for (uint8_t b : f.tensor_data(t)) acc += b;
    }
    g_sink = acc;
  } catch (const Error&) {
  }
  return 0;
}
