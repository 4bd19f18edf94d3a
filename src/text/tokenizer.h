// GPT-2 byte-level BPE tokenizer with the Qwen2 / Qwen3.5 pre-tokenizers (GGUF
// tokenizer.ggml.model = "gpt2", tokenizer.ggml.pre = "qwen2" | "qwen35").
//
// encode: text -> split out special tokens (leftmost-longest match, like HF's added-token
//         matcher; CONTROL tokens only when parse_special, USER_DEFINED always) -> per fragment
//         pre_tokenize -> per piece: bytes -> byte tokens -> merges by rank (lowest first, leftmost
//         on ties) -> ids. Results per piece are cached.
// decode: ids -> token text -> bytes through the inverse byte map (CONTROL / USER_DEFINED tokens
//         are emitted verbatim). decode() returns the raw bytes; StreamDecoder emits only whole
//         UTF-8 characters.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "text/pretokenize.h"

namespace dflash::gguf {
class File;
}

namespace dflash::text {

// tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
enum class TokenType : uint8_t {
  Undefined = 0,
  Normal = 1,
  Unknown = 2,
  Control = 3,
  UserDefined = 4,
  Unused = 5,
  Byte = 6,
};

// Everything a tokenizer is made of, as plain vectors (what the GGUF metadata holds).
struct TokenizerConfig {
  std::vector<std::string> tokens;   // id -> text (byte-level alphabet for normal tokens)
  std::vector<TokenType> types;      // empty: every token Normal
  std::vector<std::string> merges;   // "left right", rank = index
  PreTokenizer pre = PreTokenizer::Qwen35;
  int32_t bos_id = -1, eos_id = -1, eot_id = -1, pad_id = -1, unk_id = -1;
  bool add_bos = false;
  bool add_eos = false;
  bool ignore_merges = false;  // emit a piece whose whole text is a token without merging (llama3-style)
};

struct EncodeOptions {
  bool add_special = true;    // add BOS/EOS where the vocabulary asks for them (add_bos/add_eos)
  bool parse_special = true;  // recognise CONTROL tokens written in the text ("<|im_start|>")
};

class Tokenizer {
 public:
  // Validates the configuration (types length, ids in range, merges over known tokens whose
  // concatenation is a token) and throws dflash::Error naming the problem.
  explicit Tokenizer(TokenizerConfig config);
  // Reads tokenizer.ggml.* from a GGUF file. Throws dflash::Error naming the file and key.
  static Tokenizer from_gguf(const gguf::File& file);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  std::vector<int32_t> encode(std::string_view text, EncodeOptions opts = {}) const;
  void encode(std::string_view text, std::vector<int32_t>& out, EncodeOptions opts = {}) const;

  // The pieces encode() runs BPE on, as [begin, end) byte spans of `text` (a special token is one
  // span). For debugging against a reference pre-tokenizer.
  std::vector<std::pair<size_t, size_t>> split(std::string_view text, EncodeOptions opts = {}) const;

  // Concatenated bytes of the tokens (not necessarily valid UTF-8 when cut mid-character).
  // special=false drops CONTROL (and UNKNOWN) tokens. Throws on an id out of range.
  std::string decode(std::span<const int32_t> ids, bool special = true) const;
  // The bytes one token stands for (see decode).
  std::string token_to_piece(int32_t id, bool special = true) const;

  int32_t n_vocab() const;
  const std::string& token_text(int32_t id) const;  // the raw vocabulary entry
  TokenType token_type(int32_t id) const;
  std::optional<int32_t> find_token(std::string_view text) const;  // by raw vocabulary text
  PreTokenizer pre_tokenizer() const;
  size_t n_merges() const;

  int32_t bos_id() const;
  int32_t eos_id() const;
  int32_t pad_id() const;
  bool add_bos() const;
  // End of generation: EOS, EOT, and the control tokens <|im_end|> and <|endoftext|>.
  bool is_eog(int32_t id) const;
  const std::vector<int32_t>& eog_ids() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Turns a stream of token ids into text without ever splitting a UTF-8 character: bytes of an
// incomplete character are held until the next token completes them. Invalid sequences are
// replaced by U+FFFD (one per maximal invalid subpart), so everything emitted is valid UTF-8.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, bool special = true);
  // The text that became complete with this token (may be empty).
  std::string push(int32_t id);
  // Emits what is held back (an incomplete character becomes U+FFFD) and resets.
  std::string flush();
  void reset();
  size_t pending_bytes() const { return pending_.size(); }

 private:
  const Tokenizer* tok_;
  bool special_;
  std::string pending_;
};

}  // namespace dflash::text
