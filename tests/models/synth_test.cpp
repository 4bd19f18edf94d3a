// dflash synth's repeat_layers: the same file layout as a plain write, the first layer of each kind
// (GDN, attention) with the plain write's bytes, every later layer of that kind a byte copy of it.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>

#include "gguf/gguf.h"
#include "models/synth.h"
#include "support/temp_dir.h"

namespace dflash {
namespace {

namespace fs = std::filesystem;

std::string temp_path(const std::string& name) { return dflash::testing::temp_path("synth_test", name); }

SynthTargetSpec eight_layers(GgmlType t) {
  SynthTargetSpec s;
  s.n_layer = 8;  // hybrid, attention every 4th layer: GDN 0-2, 4-6, attention 3, 7
  s.n_embd = 256;
  s.n_ff = 512;
  s.n_vocab = 512;
  s.head_dim = 64;
  s.ssm_head_k = 32;
  s.ssm_head_v = 64;
  s.matmul_type = t;
  s.prism = true;
  s.prism_block = 128;
  s.seed = 11;
  return s;
}

bool same_bytes(const gguf::File& a, const std::string& na, const gguf::File& b, const std::string& nb) {
  const auto da = a.tensor_data(a.tensor(na)), db = b.tensor_data(b.tensor(nb));
  return da.size() == db.size() && std::equal(da.begin(), da.end(), db.begin());
}

TEST(SynthRepeatLayers, LaterLayersCopyTheFirstOfTheirKind) {
  for (GgmlType t : {GgmlType::PTQ1_0, GgmlType::Q8_0}) {
    SynthTargetSpec spec = eight_layers(t);
    const std::string plain_path = temp_path("plain.gguf"), rep_path = temp_path("repeat.gguf");
    synth_target(spec, plain_path);
    spec.repeat_layers = true;
    synth_target(spec, rep_path);
    const gguf::File plain = gguf::File::open(plain_path), rep = gguf::File::open(rep_path);

    ASSERT_EQ(plain.tensors().size(), rep.tensors().size());
    EXPECT_EQ(fs::file_size(plain_path), fs::file_size(rep_path));
    int copies = 0, differs_from_plain = 0;
    for (size_t i = 0; i < plain.tensors().size(); ++i) {
      const gguf::TensorInfo& p = plain.tensors()[i];
      const gguf::TensorInfo& r = rep.tensors()[i];
      ASSERT_EQ(p.name, r.name);
      ASSERT_EQ(p.type, r.type);
      ASSERT_EQ(p.shape_string(), r.shape_string()) << p.name;
      ASSERT_EQ(p.offset, r.offset) << p.name;
      if (p.name.rfind("blk.", 0) != 0) {  // embeddings, output, final norm: as the plain write
        EXPECT_TRUE(same_bytes(plain, p.name, rep, r.name)) << p.name;
        continue;
      }
      const size_t dot = p.name.find('.', 4);
      const int il = std::stoi(p.name.substr(4, dot - 4));
      const std::string rest = p.name.substr(dot + 1);
      const int first = (il + 1) % 4 == 0 ? 3 : 0;  // the first layer of this one's kind
      const std::string source = "blk." + std::to_string(first) + "." + rest;
      // the first layers are the plain write's; the others are their copies, which the plain write's are not
      EXPECT_TRUE(same_bytes(plain, source, rep, r.name)) << p.name << " vs plain " << source;
      if (il != first) {
        ++copies;
        if (!same_bytes(plain, p.name, rep, r.name)) ++differs_from_plain;
      }
    }
    EXPECT_EQ(copies, 5 * 14 + 1 * 11) << "layers 1, 2, 4, 5, 6 (14 tensors each) and 7 (11) are copies";
    EXPECT_GT(differs_from_plain, 0);  // the copies really replace the plain write's own values
    fs::remove(plain_path);
    fs::remove(rep_path);
  }
}

}  // namespace
}  // namespace dflash
