// `dflash tokenize` and `dflash detokenize`: the model's tokenizer (GGUF tokenizer.ggml.*) on the
// command line.
//
//   dflash tokenize -m MODEL TEXT [--verbose] [--no-special] [--no-bos] [--json] [--split]
//   dflash tokenize -m MODEL --file F ...          (F's bytes are the text)
//   dflash tokenize -m MODEL --batch F.jsonl       (one JSON string or {"text": ...} per line ->
//                                                   one {"ids": [...], "roundtrip": bool} per line)
//   dflash detokenize -m MODEL IDS... [--no-special]
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "gguf/gguf.h"
#include "text/token_ids.h"
#include "text/tokenizer.h"
#include "text/unicode.h"
#include "util/error.h"

namespace dflash::cli {
namespace {

using text::Tokenizer;

struct TokenizeArgs {
  std::string model;
  std::string text;
  std::string file;
  std::string batch;
  std::string out;
  bool verbose = false;
  bool no_special = false;
  bool no_bos = false;
  bool json = false;
  bool split = false;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  DFLASH_CHECK(in.good(), "cannot open '{}'", path);
  std::stringstream ss;
  ss << in.rdbuf();
  DFLASH_CHECK(!in.bad(), "error reading '{}'", path);
  return ss.str();
}

void write_stdout(std::string_view s) { std::fwrite(s.data(), 1, s.size(), stdout); }

// A piece for display: JSON string syntax (quotes, escapes; invalid UTF-8 shown as U+FFFD).
std::string json_quoted(std::string_view bytes) { return nlohmann::json(text::utf8_sanitize(bytes)).dump(); }

const char* type_name(text::TokenType t) {
  switch (t) {
    case text::TokenType::Normal: return "normal";
    case text::TokenType::Unknown: return "unknown";
    case text::TokenType::Control: return "control";
    case text::TokenType::UserDefined: return "user";
    case text::TokenType::Unused: return "unused";
    case text::TokenType::Byte: return "byte";
    default: return "undefined";
  }
}

Tokenizer load_tokenizer(const std::string& model) {
  const gguf::File file = gguf::File::open(model);
  return Tokenizer::from_gguf(file);
}

void run_batch(const Tokenizer& tok, const TokenizeArgs& a, text::EncodeOptions opts) {
  std::ifstream in(a.batch, std::ios::binary);
  DFLASH_CHECK(in.good(), "cannot open '{}'", a.batch);
  std::FILE* out = stdout;
  if (!a.out.empty()) {
    out = std::fopen(a.out.c_str(), "wb");
    DFLASH_CHECK(out != nullptr, "cannot create '{}'", a.out);
  }
  size_t docs = 0, bytes = 0, tokens = 0, roundtrip_failures = 0;
  double encode_seconds = 0;
  std::string line;
  std::vector<int32_t> ids;
  size_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty()) continue;
    std::string doc;
    try {
      const auto j = nlohmann::json::parse(line);
      if (j.is_string()) doc = j.get<std::string>();
      else if (j.is_object() && j.contains("text") && j["text"].is_string()) doc = j["text"].get<std::string>();
      else fail("expected a JSON string or an object with a \"text\" string");
    } catch (const nlohmann::json::exception& e) {
      fail("{}:{}: not a JSON document: {}", a.batch, line_no, e.what());
    } catch (const Error& e) {
      fail("{}:{}: {}", a.batch, line_no, e.what());
    }
    ids.clear();
    const auto t0 = std::chrono::steady_clock::now();
    tok.encode(doc, ids, opts);
    encode_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const bool roundtrip = tok.decode(ids) == doc;
    roundtrip_failures += roundtrip ? 0 : 1;
    nlohmann::json r = {{"ids", ids}, {"roundtrip", roundtrip}};
    if (a.split) r["pieces"] = tok.split(doc, opts);
    const std::string s = r.dump() + "\n";
    std::fwrite(s.data(), 1, s.size(), out);
    ++docs;
    bytes += doc.size();
    tokens += ids.size();
  }
  if (out != stdout) DFLASH_CHECK(std::fclose(out) == 0, "error writing '{}'", a.out);
  std::fprintf(stderr, "tokenize: %zu documents, %zu bytes, %zu tokens, %.3f s encoding (%.1f MB/s), %zu round-trip failures\n",
               docs, bytes, tokens, encode_seconds, encode_seconds > 0 ? bytes / encode_seconds / 1e6 : 0.0,
               roundtrip_failures);
}

void run_tokenize(const TokenizeArgs& a) {
  const Tokenizer tok = load_tokenizer(a.model);
  const text::EncodeOptions opts{.add_special = !a.no_bos, .parse_special = !a.no_special};
  if (!a.batch.empty()) {
    run_batch(tok, a, opts);
    return;
  }
  DFLASH_CHECK(a.file.empty() || a.text.empty(), "give the text either as an argument or with --file, not both");
  const std::string input = a.file.empty() ? a.text : read_file(a.file);
  if (a.split) {
    nlohmann::json pieces = nlohmann::json::array();
    for (auto [b, e] : tok.split(input, opts)) pieces.push_back(text::utf8_sanitize(input.substr(b, e - b)));
    write_stdout(pieces.dump() + "\n");
    return;
  }
  const std::vector<int32_t> ids = tok.encode(input, opts);
  if (a.json) {
    nlohmann::json j = {{"ids", ids}};
    if (a.verbose) {
      nlohmann::json pieces = nlohmann::json::array();
      for (int32_t id : ids) pieces.push_back(text::utf8_sanitize(tok.token_to_piece(id)));
      j["pieces"] = pieces;
    }
    write_stdout(j.dump() + "\n");
  } else if (a.verbose) {
    std::string out;
    for (int32_t id : ids) {
      out += fmt::format("{:>8} {:<8} {}\n", id, type_name(tok.token_type(id)), json_quoted(tok.token_to_piece(id)));
    }
    out += fmt::format("{} tokens\n", ids.size());
    write_stdout(out);
  } else {
    write_stdout(fmt::format("{}\n", fmt::join(ids, " ")));
  }
}


}  // namespace

void register_tokenize(CLI::App& app) {
  auto args = std::make_shared<TokenizeArgs>();
  CLI::App* t = app.add_subcommand("tokenize", "Token ids of a text with the model's tokenizer");
  t->add_option("-m,--model", args->model, "GGUF model file (only its tokenizer metadata is read)")->required();
  t->add_option("text", args->text, "The text to tokenize");
  t->add_option("-f,--file", args->file, "Tokenize the bytes of this file instead");
  t->add_option("--batch", args->batch,
                "JSON Lines file: one JSON string (or {\"text\": ...}) per line; prints one "
                "{\"ids\": [...], \"roundtrip\": decode(ids) == text} per line and a summary on stderr");
  t->add_option("-o,--out", args->out, "With --batch: write the results to this file instead of stdout");
  t->add_flag("-v,--verbose", args->verbose, "One line per token: id, type and the text it stands for");
  t->add_flag("--no-special", args->no_special, "Treat control tokens written in the text (<|im_start|>) as plain text");
  t->add_flag("--no-bos", args->no_bos, "Do not add BOS/EOS even where the vocabulary asks for them");
  t->add_flag("--json", args->json, "Print {\"ids\": [...]} (with --verbose also \"pieces\")");
  t->add_flag("--split", args->split, "Print the pre-tokenizer pieces instead (with --batch: add byte spans)");
  t->callback([args] { run_tokenize(*args); });

  auto model = std::make_shared<std::string>();
  auto ids = std::make_shared<std::vector<std::string>>();
  auto no_special = std::make_shared<bool>(false);
  CLI::App* d = app.add_subcommand("detokenize", "The text of token ids with the model's tokenizer");
  d->add_option("-m,--model", *model, "GGUF model file")->required();
  d->add_option("ids", *ids, "Token ids (\"1 2 3\", \"1,2,3\" or \"[1, 2, 3]\")")->required();
  d->add_flag("--no-special", *no_special, "Leave out control tokens");
  d->callback([model, ids, no_special] {
    const Tokenizer tok = load_tokenizer(*model);
    write_stdout(tok.decode(parse_token_ids(fmt::format("{}", fmt::join(*ids, " ")), "detokenize"), !*no_special));
    write_stdout("\n");
  });
}

}  // namespace dflash::cli
