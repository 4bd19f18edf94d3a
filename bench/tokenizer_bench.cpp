// Tokenizer throughput (MB/s of input text, one core): encode with a warm and a cold piece cache,
// the pre-tokenizer alone, and decode.
//
// Text: the project's own sources and docs (code + English prose) plus generated CJK, Cyrillic and
// emoji lines, ~4 MB; or the file named by DFLASH_BENCH_TEXT. Vocabulary: the GGUF named by
// DFLASH_BENCH_VOCAB (a real model, or the oracle's vocab-qwen35.gguf); else one built here from the
// text: every frequent pre-token piece becomes a token through a left-to-right chain of merges, so
// BPE does real merge work (a piece of n bytes needs n-1 merges).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "gguf/gguf.h"
#include "text/pretokenize.h"
#include "text/tokenizer.h"
#include "text/unicode.h"

namespace {

using namespace dflash::text;
namespace fs = std::filesystem;

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string make_text() {
  if (const char* f = std::getenv("DFLASH_BENCH_TEXT")) return slurp(f);
  std::string text;
  const fs::path root = DFLASH_SOURCE_DIR;
  for (const char* dir : {"src", "tests", "docs"}) {
    if (!fs::exists(root / dir)) continue;
    for (const auto& e : fs::recursive_directory_iterator(root / dir)) {
      const auto ext = e.path().extension();
      if (e.is_regular_file() && (ext == ".cpp" || ext == ".h" || ext == ".cu" || ext == ".md")) text += slurp(e.path());
    }
  }
  for (const char* f : {"../shared/docs/SPEC.md", "../shared/docs/STYLE.md", "../shared/seed/ternary_bonsai_2_dflash.js"}) {
    if (fs::exists(root / f)) text += slurp(root / f);
  }
  std::mt19937 rng(7);
  std::string other;
  for (int line = 0; line < 4000; ++line) {
    for (int w = 0; w < 12; ++w) {
      const int kind = line % 3;
      const int len = 1 + static_cast<int>(rng() % 4);
      for (int k = 0; k < len; ++k) {
        const uint32_t cp = kind == 0 ? 0x4E00 + rng() % 500 : kind == 1 ? 0x430 + rng() % 32 : 0x1F600 + rng() % 40;
        utf8_append(other, cp);
      }
      other += kind == 0 ? "" : " ";
    }
    other += line % 3 == 0 ? "\xE3\x80\x82\n" : ".\n";
  }
  const std::string base = text + other;
  std::string out;
  while (out.size() < (4u << 20)) out += base;
  return out;
}

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& text) {
  if (const char* v = std::getenv("DFLASH_BENCH_VOCAB")) {
    return std::make_unique<Tokenizer>(Tokenizer::from_gguf(dflash::gguf::File::open(v)));
  }
  TokenizerConfig cfg;
  std::unordered_map<std::string, int32_t> ids;
  auto add = [&](const std::string& t) {
    auto [it, fresh] = ids.emplace(t, static_cast<int32_t>(cfg.tokens.size()));
    if (fresh) cfg.tokens.push_back(t);
    return fresh;
  };
  for (int b = 0; b < 256; ++b) {
    std::string s;
    utf8_append(s, byte_to_unicode(static_cast<uint8_t>(b)));
    add(s);
  }
  std::unordered_map<std::string_view, int> counts;
  for (std::string_view p : pre_tokenize(text, PreTokenizer::Qwen35)) ++counts[p];
  std::vector<std::pair<int, std::string_view>> freq;
  for (auto [p, c] : counts) freq.emplace_back(c, p);
  std::sort(freq.begin(), freq.end(), [](auto& a, auto& b) { return a.first != b.first ? a.first > b.first : a.second < b.second; });
  if (freq.size() > 40000) freq.resize(40000);
  for (auto& [c, piece] : freq) {
    if (piece.size() > 24) continue;
    std::string left;
    utf8_append(left, byte_to_unicode(static_cast<uint8_t>(piece[0])));
    for (size_t i = 1; i < piece.size(); ++i) {
      std::string right;
      utf8_append(right, byte_to_unicode(static_cast<uint8_t>(piece[i])));
      if (add(left + right)) cfg.merges.push_back(left + " " + right);
      left += right;
    }
  }
  cfg.pre = PreTokenizer::Qwen35;
  for (const char* s : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}) {
    cfg.tokens.push_back(s);
  }
  cfg.types.assign(cfg.tokens.size(), TokenType::Normal);
  for (size_t i = cfg.tokens.size() - 3; i < cfg.tokens.size(); ++i) cfg.types[i] = TokenType::Control;
  return std::make_unique<Tokenizer>(std::move(cfg));
}

struct Fixture {
  std::string text = make_text();
  std::unique_ptr<Tokenizer> tok = make_tokenizer(text);
};

Fixture& fixture() {
  static Fixture f;
  return f;
}

void BM_EncodeWarm(benchmark::State& state) {
  Fixture& f = fixture();
  std::vector<int32_t> ids;
  f.tok->encode(f.text, ids);  // fill the piece cache
  for (auto _ : state) {
    ids.clear();
    f.tok->encode(f.text, ids);
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * f.text.size()));
  state.counters["tokens"] = static_cast<double>(ids.size());
  state.counters["vocab"] = f.tok->n_vocab();
}

void BM_EncodeCold(benchmark::State& state) {
  // A fresh tokenizer (empty cache) per iteration; only the first 1 MB of text, so the cache
  // never warms up across repetitions of the generated text.
  Fixture& f = fixture();
  const std::string_view text = std::string_view(f.text).substr(0, 1 << 20);
  std::vector<int32_t> ids;
  for (auto _ : state) {
    state.PauseTiming();
    auto tok = make_tokenizer(f.text);
    ids.clear();
    state.ResumeTiming();
    tok->encode(text, ids);
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
}

void BM_PreTokenize(benchmark::State& state) {
  Fixture& f = fixture();
  std::vector<std::pair<uint32_t, uint32_t>> spans;
  for (auto _ : state) {
    spans.clear();
    pre_tokenize(f.text, PreTokenizer::Qwen35, spans);
    benchmark::DoNotOptimize(spans.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * f.text.size()));
}

void BM_Decode(benchmark::State& state) {
  Fixture& f = fixture();
  const std::vector<int32_t> ids = f.tok->encode(f.text);
  for (auto _ : state) {
    std::string s = f.tok->decode(ids);
    benchmark::DoNotOptimize(s.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * f.text.size()));
}

BENCHMARK(BM_EncodeWarm)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_EncodeCold)->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK(BM_PreTokenize)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Decode)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
