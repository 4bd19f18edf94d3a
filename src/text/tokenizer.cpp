#include "text/tokenizer.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "gguf/gguf.h"
#include "text/unicode.h"
#include "util/error.h"

namespace dflash::text {

namespace {

// ---------------------------------------------------------------------------------------------
// Merge table: (left id, right id) -> (rank, merged id), open addressing with linear probing.
// The BPE inner loop asks it once per adjacent pair, so it avoids std::unordered_map's nodes.
class PairMap {
 public:
  struct Entry {
    uint64_t key = kEmpty;
    int32_t rank = 0;
    int32_t id = 0;
  };
  static constexpr uint64_t kEmpty = ~uint64_t{0};

  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    slots_.assign(cap, Entry{});
    mask_ = cap - 1;
  }
  // Returns false when the pair is already present (the first rank wins, as in llama.cpp).
  bool insert(int32_t a, int32_t b, int32_t rank, int32_t id) {
    const uint64_t key = make_key(a, b);
    for (size_t h = hash(key);; h = (h + 1) & mask_) {
      Entry& e = slots_[h];
      if (e.key == key) return false;
      if (e.key == kEmpty) {
        e = Entry{key, rank, id};
        return true;
      }
    }
  }
  const Entry* find(int32_t a, int32_t b) const {
    if (slots_.empty()) return nullptr;
    const uint64_t key = make_key(a, b);
    for (size_t h = hash(key);; h = (h + 1) & mask_) {
      const Entry& e = slots_[h];
      if (e.key == key) return &e;
      if (e.key == kEmpty) return nullptr;
    }
  }

 private:
  static uint64_t make_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  size_t hash(uint64_t key) const { return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> 20) & mask_; }
  std::vector<Entry> slots_;
  size_t mask_ = 0;
};

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

// A special token the matcher looks for in raw text.
struct Special {
  std::string_view text;
  int32_t id;
  bool control;  // CONTROL / UNKNOWN: only matched when parse_special
};

bool is_special_type(TokenType t) {
  return t == TokenType::Control || t == TokenType::Unknown || t == TokenType::UserDefined;
}

// "<0x0A>" -> 0x0A (the SentencePiece spelling of BYTE tokens); -1 otherwise.
int parse_byte_token(std::string_view s) {
  if (s.size() != 6 || s.substr(0, 3) != "<0x" || s[5] != '>') return -1;
  int v = 0;
  for (char c : s.substr(3, 2)) {
    v <<= 4;
    if (c >= '0' && c <= '9') v |= c - '0';
    else if (c >= 'A' && c <= 'F') v |= c - 'A' + 10;
    else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
    else return -1;
  }
  return v;
}

// The bytes a byte-level token text stands for; nullopt when a character is outside the GPT-2
// alphabet (then HF's ByteLevel decoder keeps the token's text as it is, and so do we).
std::optional<std::string> byte_level_decode(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    uint32_t cp = 0;
    const size_t len = utf8_decode(text, i, cp);
    if (len == 0) return std::nullopt;
    const int b = byte_from_unicode(cp);
    if (b < 0) return std::nullopt;
    out.push_back(static_cast<char>(b));
    i += len;
  }
  return out;
}

constexpr size_t kMaxCachedPiece = 64;      // longer pieces are rare; don't let them fill the cache
constexpr size_t kMaxCacheEntries = 1 << 18;

}  // namespace

// =============================================================================================

struct Tokenizer::Impl {
  TokenizerConfig cfg;
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> text_to_id;
  PairMap merges;
  size_t n_merges = 0;
  std::array<int32_t, 256> byte_id{};  // the token of each single byte (-1: not in the vocabulary)
  std::vector<std::string> pieces;      // id -> decoded bytes (verbatim text for special tokens)
  std::vector<Special> specials;        // sorted by first byte, then longest first
  std::array<bool, 256> special_first{};
  std::vector<int32_t> eog;

  // Piece -> ids cache (pieces repeat a lot in real text: " the", "\n", "    ").
  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> cache;

  void build();
  void bpe(std::string_view piece, std::vector<int32_t>& out) const;
  void bpe_uncached(std::string_view piece, std::vector<int32_t>& out) const;
  void encode_fragment(std::string_view text, std::vector<int32_t>& out) const;
  template <typename Fragment, typename SpecialFn>
  void segment(std::string_view text, bool parse_special, Fragment&& fragment, SpecialFn&& special) const;
};

void Tokenizer::Impl::build() {
  const size_t n = cfg.tokens.size();
  DFLASH_CHECK(n > 0, "tokenizer: the vocabulary is empty");
  DFLASH_CHECK(n <= static_cast<size_t>(INT32_MAX), "tokenizer: {} tokens exceed the int32 id range", n);
  if (cfg.types.empty()) cfg.types.assign(n, TokenType::Normal);
  DFLASH_CHECK(cfg.types.size() == n, "tokenizer: {} token types for {} tokens (expected one per token)",
               cfg.types.size(), n);
  for (size_t i = 0; i < n; ++i) {
    DFLASH_CHECK(static_cast<uint8_t>(cfg.types[i]) <= 6, "tokenizer: token {} ('{}') has unknown type {} (expected 0..6)",
                 i, cfg.tokens[i], static_cast<int>(cfg.types[i]));
  }
  auto check_id = [&](int32_t id, const char* what) {
    DFLASH_CHECK(id >= -1 && id < static_cast<int64_t>(n), "tokenizer: {} id {} is out of range (n_vocab {})", what, id, n);
  };
  check_id(cfg.bos_id, "bos");
  check_id(cfg.eos_id, "eos");
  check_id(cfg.eot_id, "eot");
  check_id(cfg.pad_id, "padding");
  check_id(cfg.unk_id, "unknown");

  // Text -> id. A duplicated text keeps its first id.
  text_to_id.reserve(n);
  for (size_t i = 0; i < n; ++i) text_to_id.emplace(cfg.tokens[i], static_cast<int32_t>(i));

  // Byte tokens: the one-character texts of the byte alphabet.
  for (int b = 0; b < 256; ++b) {
    std::string s;
    utf8_append(s, byte_to_unicode(static_cast<uint8_t>(b)));
    auto it = text_to_id.find(s);
    byte_id[b] = it == text_to_id.end() ? -1 : it->second;
  }

  // Merges "left right": both sides and their concatenation must be tokens.
  merges.reserve(cfg.merges.size());
  std::string joined;
  for (size_t r = 0; r < cfg.merges.size(); ++r) {
    const std::string& m = cfg.merges[r];
    const size_t sp = m.find(' ', 1);  // from 1: a side is never empty
    DFLASH_CHECK(sp != std::string::npos && sp + 1 < m.size() && m.find(' ', sp + 1) == std::string::npos,
                 "tokenizer: merge #{} '{}' is not of the form 'left right'", r, m);
    const std::string_view left(m.data(), sp), right(m.data() + sp + 1, m.size() - sp - 1);
    auto lt = text_to_id.find(left);
    DFLASH_CHECK(lt != text_to_id.end(), "tokenizer: merge #{} '{}': '{}' is not a token", r, m, left);
    auto rt = text_to_id.find(right);
    DFLASH_CHECK(rt != text_to_id.end(), "tokenizer: merge #{} '{}': '{}' is not a token", r, m, right);
    joined.assign(left);
    joined.append(right);
    auto jt = text_to_id.find(joined);
    DFLASH_CHECK(jt != text_to_id.end(), "tokenizer: merge #{} '{}': the merged text '{}' is not a token", r, m, joined);
    if (merges.insert(lt->second, rt->second, static_cast<int32_t>(r), jt->second)) ++n_merges;
  }

  // Decoded pieces.
  pieces.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const std::string& t = cfg.tokens[i];
    const TokenType type = cfg.types[i];
    if (is_special_type(type)) {
      pieces[i] = t;
    } else if (type == TokenType::Byte && parse_byte_token(t) >= 0) {
      pieces[i] = std::string(1, static_cast<char>(parse_byte_token(t)));
    } else if (auto bytes = byte_level_decode(t)) {
      pieces[i] = std::move(*bytes);
    } else {
      pieces[i] = t;
    }
  }

  // Special tokens for the splitter.
  for (size_t i = 0; i < n; ++i) {
    const TokenType type = cfg.types[i];
    if (!is_special_type(type) || cfg.tokens[i].empty()) continue;
    specials.push_back({cfg.tokens[i], static_cast<int32_t>(i), type != TokenType::UserDefined});
  }
  std::sort(specials.begin(), specials.end(), [](const Special& a, const Special& b) {
    if (a.text[0] != b.text[0]) return static_cast<uint8_t>(a.text[0]) < static_cast<uint8_t>(b.text[0]);
    if (a.text.size() != b.text.size()) return a.text.size() > b.text.size();
    return a.id < b.id;
  });
  special_first.fill(false);
  for (const Special& s : specials) special_first[static_cast<uint8_t>(s.text[0])] = true;

  // End-of-generation tokens.
  auto add_eog = [&](int32_t id) {
    if (id >= 0 && std::find(eog.begin(), eog.end(), id) == eog.end()) eog.push_back(id);
  };
  add_eog(cfg.eos_id);
  add_eog(cfg.eot_id);
  for (const char* t : {"<|im_end|>", "<|endoftext|>"}) {
    auto it = text_to_id.find(std::string_view(t));
    if (it != text_to_id.end()) add_eog(it->second);
  }
}

// ---------------------------------------------------------------------------------------------
// BPE on one pre-token piece.

void Tokenizer::Impl::bpe_uncached(std::string_view piece, std::vector<int32_t>& out) const {
  // Symbols form a linked list over the piece's bytes; a merge keeps the left symbol and unlinks
  // the right one. Candidate pairs wait in a min-heap ordered by (rank, position); an entry is
  // stale when either side has changed since it was pushed (ids only ever get longer, so comparing
  // the two ids is an exact test).
  struct Sym {
    int32_t id, prev, next;
  };
  struct Cand {
    int32_t rank, pos, left, right;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  thread_local std::vector<Sym> sym;
  thread_local std::vector<Cand> heap;
  const int32_t n = static_cast<int32_t>(piece.size());
  sym.resize(n);
  for (int32_t i = 0; i < n; ++i) sym[i] = {byte_id[static_cast<uint8_t>(piece[i])], i - 1, i + 1 < n ? i + 1 : -1};
  heap.clear();
  auto push_pair = [&](int32_t pos) {
    const int32_t nx = sym[pos].next;
    if (nx < 0 || sym[pos].id < 0 || sym[nx].id < 0) return;
    if (const PairMap::Entry* e = merges.find(sym[pos].id, sym[nx].id)) {
      heap.push_back({e->rank, pos, sym[pos].id, sym[nx].id});
      std::push_heap(heap.begin(), heap.end(), std::greater<>{});
    }
  };
  for (int32_t i = 0; i + 1 < n; ++i) push_pair(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>{});
    const Cand c = heap.back();
    heap.pop_back();
    Sym& s = sym[c.pos];
    if (s.id != c.left || s.next < 0 || sym[s.next].id != c.right) continue;
    const PairMap::Entry* e = merges.find(c.left, c.right);
    const int32_t gone = s.next;
    s.id = e->id;
    s.next = sym[gone].next;
    if (s.next >= 0) sym[s.next].prev = c.pos;
    sym[gone].id = -2;
    if (s.prev >= 0) push_pair(s.prev);
    push_pair(c.pos);
  }
  for (int32_t i = 0; i >= 0 && i < n; i = sym[i].next) {
    if (sym[i].id >= 0) out.push_back(sym[i].id);
    else if (cfg.unk_id >= 0) out.push_back(cfg.unk_id);  // a byte the vocabulary lacks
  }
}

void Tokenizer::Impl::bpe(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.size() == 1 && byte_id[static_cast<uint8_t>(piece[0])] >= 0) {
    out.push_back(byte_id[static_cast<uint8_t>(piece[0])]);
    return;
  }
  if (cfg.ignore_merges) {
    std::string mapped;
    for (char ch : piece) utf8_append(mapped, byte_to_unicode(static_cast<uint8_t>(ch)));
    auto it = text_to_id.find(mapped);
    if (it != text_to_id.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (piece.size() > kMaxCachedPiece) {
    bpe_uncached(piece, out);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    auto it = cache.find(piece);
    if (it != cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t start = out.size();
  bpe_uncached(piece, out);
  std::vector<int32_t> ids(out.begin() + static_cast<std::ptrdiff_t>(start), out.end());
  std::lock_guard<std::mutex> lock(cache_mutex);
  if (cache.size() >= kMaxCacheEntries) cache.clear();
  cache.emplace(std::string(piece), std::move(ids));
}

void Tokenizer::Impl::encode_fragment(std::string_view text, std::vector<int32_t>& out) const {
  if (text.empty()) return;
  thread_local std::vector<std::pair<uint32_t, uint32_t>> spans;
  spans.clear();
  pre_tokenize(text, cfg.pre, spans);
  for (auto [b, e] : spans) bpe(text.substr(b, e - b), out);
}

// =============================================================================================

Tokenizer::Tokenizer(TokenizerConfig config) : impl_(std::make_unique<Impl>()) {
  impl_->cfg = std::move(config);
  impl_->build();
}

Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_gguf(const gguf::File& file) {
  const std::string& path = file.path();
  TokenizerConfig cfg;
  try {
    const std::string model = file.get_string("tokenizer.ggml.model");
    DFLASH_CHECK(model == "gpt2", "tokenizer.ggml.model is '{}': only 'gpt2' (byte-level BPE) is supported", model);
    const std::string pre = file.get_string_or("tokenizer.ggml.pre", "");
    if (pre == "qwen2") cfg.pre = PreTokenizer::Qwen2;
    else if (pre == "qwen35") cfg.pre = PreTokenizer::Qwen35;
    else fail("tokenizer.ggml.pre is '{}': supported pre-tokenizers are 'qwen2' and 'qwen35'", pre);

    cfg.tokens = file.get_string_array("tokenizer.ggml.tokens");
    const int64_t n = static_cast<int64_t>(cfg.tokens.size());
    if (file.has("tokenizer.ggml.token_type")) {
      const std::vector<int64_t> types = file.get_int_array("tokenizer.ggml.token_type");
      DFLASH_CHECK(static_cast<int64_t>(types.size()) == n,
                   "tokenizer.ggml.token_type has {} entries for {} tokens (expected one per token)", types.size(), n);
      cfg.types.resize(types.size());
      for (size_t i = 0; i < types.size(); ++i) {
        DFLASH_CHECK(types[i] >= 0 && types[i] <= 6, "tokenizer.ggml.token_type[{}] is {} (expected 0..6)", i, types[i]);
        cfg.types[i] = static_cast<TokenType>(types[i]);
      }
    }
    cfg.merges = file.get_string_array("tokenizer.ggml.merges");
    auto read_id = [&](const char* key) -> int32_t {
      const int64_t v = file.get_int_or(key, -1);
      DFLASH_CHECK(v >= -1 && v < n, "{} is {}: not a token id (n_vocab {})", key, v, n);
      return static_cast<int32_t>(v);
    };
    cfg.bos_id = read_id("tokenizer.ggml.bos_token_id");
    cfg.eos_id = read_id("tokenizer.ggml.eos_token_id");
    cfg.eot_id = read_id("tokenizer.ggml.eot_token_id");
    cfg.pad_id = read_id("tokenizer.ggml.padding_token_id");
    cfg.unk_id = read_id("tokenizer.ggml.unknown_token_id");
    cfg.add_bos = file.get_bool_or("tokenizer.ggml.add_bos_token", false);
    cfg.add_eos = file.get_bool_or("tokenizer.ggml.add_eos_token", false);
    return Tokenizer(std::move(cfg));
  } catch (const Error& e) {
    throw Error(fmt::format("{}: {}", path, e.what()));
  }
}

// Walks `text` splitting out special tokens (leftmost, then longest): calls fragment(begin, end) for
// the text between them and special(id, begin, end) for each match.
template <typename Fragment, typename SpecialFn>
void Tokenizer::Impl::segment(std::string_view text, bool parse_special, Fragment&& fragment, SpecialFn&& special) const {
  size_t seg = 0;
  if (!specials.empty()) {
    size_t i = 0;
    while (i < text.size()) {
      if (!special_first[static_cast<uint8_t>(text[i])]) {
        ++i;
        continue;
      }
      // Candidates sharing the first byte are sorted longest first: the first hit is the longest.
      const Special* hit = nullptr;
      auto lo = std::lower_bound(specials.begin(), specials.end(), text[i], [](const Special& s, char c) {
        return static_cast<uint8_t>(s.text[0]) < static_cast<uint8_t>(c);
      });
      for (auto it = lo; it != specials.end() && it->text[0] == text[i]; ++it) {
        if (it->control && !parse_special) continue;
        if (it->text.size() <= text.size() - i && std::memcmp(it->text.data(), text.data() + i, it->text.size()) == 0) {
          hit = &*it;
          break;
        }
      }
      if (!hit) {
        ++i;
        continue;
      }
      if (i > seg) fragment(seg, i);
      special(hit->id, i, i + hit->text.size());
      i += hit->text.size();
      seg = i;
    }
  }
  if (text.size() > seg) fragment(seg, text.size());
}

void Tokenizer::encode(std::string_view text, std::vector<int32_t>& out, EncodeOptions opts) const {
  DFLASH_CHECK(text.size() < (uint64_t{1} << 32), "tokenizer: text of {} bytes is too long (limit 4 GiB)", text.size());
  const Impl& m = *impl_;
  if (opts.add_special && m.cfg.add_bos && m.cfg.bos_id >= 0) out.push_back(m.cfg.bos_id);
  m.segment(
      text, opts.parse_special, [&](size_t b, size_t e) { m.encode_fragment(text.substr(b, e - b), out); },
      [&](int32_t id, size_t, size_t) { out.push_back(id); });
  if (opts.add_special && m.cfg.add_eos && m.cfg.eos_id >= 0) out.push_back(m.cfg.eos_id);
}

std::vector<std::pair<size_t, size_t>> Tokenizer::split(std::string_view text, EncodeOptions opts) const {
  DFLASH_CHECK(text.size() < (uint64_t{1} << 32), "tokenizer: text of {} bytes is too long (limit 4 GiB)", text.size());
  const Impl& m = *impl_;
  std::vector<std::pair<size_t, size_t>> out;
  std::vector<std::pair<uint32_t, uint32_t>> spans;
  m.segment(
      text, opts.parse_special,
      [&](size_t b, size_t e) {
        spans.clear();
        pre_tokenize(text.substr(b, e - b), m.cfg.pre, spans);
        for (auto [pb, pe] : spans) out.emplace_back(b + pb, b + pe);
      },
      [&](int32_t, size_t b, size_t e) { out.emplace_back(b, e); });
  return out;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, EncodeOptions opts) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  encode(text, out, opts);
  return out;
}

std::string Tokenizer::token_to_piece(int32_t id, bool special) const {
  DFLASH_CHECK(id >= 0 && id < n_vocab(), "tokenizer: token id {} is out of range (n_vocab {})", id, n_vocab());
  const TokenType t = impl_->cfg.types[id];
  if (!special && (t == TokenType::Control || t == TokenType::Unknown)) return {};
  return impl_->pieces[id];
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool special) const {
  std::string out;
  for (int32_t id : ids) {
    DFLASH_CHECK(id >= 0 && id < n_vocab(), "tokenizer: token id {} is out of range (n_vocab {})", id, n_vocab());
    const TokenType t = impl_->cfg.types[id];
    if (!special && (t == TokenType::Control || t == TokenType::Unknown)) continue;
    out += impl_->pieces[id];
  }
  return out;
}

int32_t Tokenizer::n_vocab() const { return static_cast<int32_t>(impl_->cfg.tokens.size()); }
const std::string& Tokenizer::token_text(int32_t id) const {
  DFLASH_CHECK(id >= 0 && id < n_vocab(), "tokenizer: token id {} is out of range (n_vocab {})", id, n_vocab());
  return impl_->cfg.tokens[id];
}
TokenType Tokenizer::token_type(int32_t id) const {
  DFLASH_CHECK(id >= 0 && id < n_vocab(), "tokenizer: token id {} is out of range (n_vocab {})", id, n_vocab());
  return impl_->cfg.types[id];
}
std::optional<int32_t> Tokenizer::find_token(std::string_view text) const {
  auto it = impl_->text_to_id.find(text);
  if (it == impl_->text_to_id.end()) return std::nullopt;
  return it->second;
}
PreTokenizer Tokenizer::pre_tokenizer() const { return impl_->cfg.pre; }
size_t Tokenizer::n_merges() const { return impl_->n_merges; }
int32_t Tokenizer::bos_id() const { return impl_->cfg.bos_id; }
int32_t Tokenizer::eos_id() const { return impl_->cfg.eos_id; }
int32_t Tokenizer::pad_id() const { return impl_->cfg.pad_id; }
bool Tokenizer::add_bos() const { return impl_->cfg.add_bos; }
bool Tokenizer::is_eog(int32_t id) const {
  return std::find(impl_->eog.begin(), impl_->eog.end(), id) != impl_->eog.end();
}
const std::vector<int32_t>& Tokenizer::eog_ids() const { return impl_->eog; }

// =============================================================================================
// StreamDecoder

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool special) : tok_(&tokenizer), special_(special) {}

std::string StreamDecoder::push(int32_t id) {
  pending_ += tok_->token_to_piece(id, special_);
  const size_t hold = utf8_incomplete_tail(pending_);
  std::string ready = utf8_sanitize(std::string_view(pending_).substr(0, pending_.size() - hold));
  pending_.erase(0, pending_.size() - hold);
  return ready;
}

std::string StreamDecoder::flush() {
  std::string rest = utf8_sanitize(pending_);
  pending_.clear();
  return rest;
}

void StreamDecoder::reset() { pending_.clear(); }

}  // namespace dflash::text
