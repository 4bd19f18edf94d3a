// drafter_probe: one DFlash draft through the engine, with its trace, for tools/train/selftest.py.
//   drafter_probe TARGET.gguf DRAFTER.gguf IDS P OUT_PREFIX
// IDS: comma-separated tokens; the context is IDS[0..P), the anchor IDS[P]. Writes OUT_PREFIX.hidden
// ([B, E] f32 after output_norm), .logits ([B-1, V] f32) and .tokens (the B-1 drafts, int32).
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gguf/gguf.h"
#include "models/dflash_drafter.h"
#include "models/target.h"
#include "ops/backend.h"

using namespace dflash;

template <typename T>
void dump(const std::string& path, const std::vector<T>& v) {
  std::ofstream o(path, std::ios::binary);
  o.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
}

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: drafter_probe TARGET DRAFTER IDS P OUT_PREFIX\n");
    return 2;
  }
  try {
    gguf::File tf = gguf::File::open(argv[1]);
    gguf::File df = gguf::File::open(argv[2]);
    std::vector<int32_t> ids;
    std::stringstream ss(argv[3]);
    std::string item;
    while (std::getline(ss, item, ',')) ids.push_back(std::stoi(item));
    const int64_t P = std::stoll(argv[4]);
    const std::string out = argv[5];
    auto be = make_cpu_backend(1);
    DrafterConfig dc = read_drafter_config(df);
    TargetOptions to;
    to.tap_layers = dc.target_layers;
    to.n_ctx = 1024;
    auto target = TargetModel::load(tf, *be, to);
    auto dr = DFlashDrafter::load(df, *target);
    std::vector<float> taps;
    prefill(*target, std::span<const int32_t>(ids.data(), P), &taps);
    dr->append_context(taps, P);
    dr->set_keep_trace(true);
    std::vector<int32_t> drafts = dr->draft(ids[P]);
    const DraftTrace& t = dr->last_trace();
    dump(out + ".hidden", t.hidden);
    dump(out + ".logits", t.logits);
    dump(out + ".tokens", drafts);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "drafter_probe: %s\n", e.what());
    return 1;
  }
}
