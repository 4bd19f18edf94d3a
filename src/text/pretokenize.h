// Pre-tokenizer: splits text (one fragment between special tokens) into the pieces BPE runs on.
//
// A hand-written scanner equivalent to the Hugging Face `Split` regex (behaviour "isolated") of
//   qwen2 : (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*
//           |\s*[\r\n]+|\s+(?!\S)|\s+
//   qwen35: the same with combining marks joining letters:
//           ...|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|...
// (llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN2 / _QWEN35). `\s` is Oniguruma's Unicode \s (what HF
// tokenizers uses), categories come from utf8proc. `(?i:'s)` also matches "'ſ" (U+017F folds to s).
//
// Bytes that are not valid UTF-8 are each their own piece (BPE turns them into their byte token),
// so arbitrary bytes round-trip through encode/decode.
#pragma once

#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

namespace dflash::text {

enum class PreTokenizer : uint8_t {
  Qwen2,   // tokenizer.ggml.pre = "qwen2"
  Qwen35,  // tokenizer.ggml.pre = "qwen35"
};

const char* pre_tokenizer_name(PreTokenizer p);

// Appends the pieces of `text` as [begin, end) byte offsets; the pieces tile `text` exactly.
void pre_tokenize(std::string_view text, PreTokenizer kind, std::vector<std::pair<uint32_t, uint32_t>>& out);

// Convenience for tests and tools: the pieces as string views into `text`.
std::vector<std::string_view> pre_tokenize(std::string_view text, PreTokenizer kind);

}  // namespace dflash::text
