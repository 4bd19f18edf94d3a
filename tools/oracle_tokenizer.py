#!/usr/bin/env python3
"""Tokenizer oracle: dflash's tokenizer against Hugging Face `tokenizers` on real text.

No model is downloaded (the machine it runs on has no network). Instead the script
  1. gathers a corpus from this machine: source and docs of the installed Python packages (code in
     several languages), translations from gettext .mo catalogs when there are any, and constructed
     multilingual text (words built from the letters of ~20 scripts via `unicodedata`), emoji
     (ZWJ sequences, flags, skin tones), combining marks (NFD), long whitespace runs, digits,
     \\r\\n mixes, tabs, unusual spaces, contractions and special tokens inside text;
  2. TRAINS a byte-level BPE with HF tokenizers (Qwen2 or Qwen3.5 pre-tokenizer split + ByteLevel,
     ~16k vocabulary, specials <|endoftext|> <|im_start|> <|im_end|>, plus the non-special added
     tokens <think> </think>), or loads a given tokenizer.json;
  3. writes the vocabulary into a GGUF (tokenizer.ggml.* keys, no tensors) with its own writer;
  4. encodes >= 5 MB of held-out documents with HF and with `dflash tokenize --batch`, and checks
     per document that the ids are identical and that decode(encode(x)) == x;
  5. writes a summary (summary.json, summary.txt, mismatches.jsonl) into the work folder and exits
     non-zero on any mismatch.

Run from the repository root, e.g.
    python3 tools/oracle_tokenizer.py --dflash build/dflash
    python3 tools/oracle_tokenizer.py --dflash build/dflash --pre qwen2 --corpus-mb 8
    python3 tools/oracle_tokenizer.py --dflash build/dflash --tokenizer-json path/to/tokenizer.json
Without `tokenizers` installed, --regex-only still checks the pre-tokenizer split and the byte
fallback against the Python `regex` module (a byte-only vocabulary, no merges).
"""

import argparse
import json
import os
import random
import struct
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

# The pre-tokenizer regexes (tokenizer.json "Split" patterns of Qwen2 and Qwen3.5).
PATTERNS = {
    "qwen2": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
    "qwen35": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<think>", "</think>"]

CODE_EXTS = {".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".cuh", ".js", ".ts", ".rs", ".go",
             ".java", ".sh", ".pyx", ".pxd", ".f90", ".jl", ".lua", ".rb", ".sql", ".cmake", ".proto"}
DOC_EXTS = {".md", ".rst", ".txt", ".html", ".css", ".json", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".xml",
            ".csv", ".tex", ".ipynb"}


def log(msg):
    print(f"[oracle] {msg}", file=sys.stderr, flush=True)


# =============================================================================================
# Corpus

def python_roots():
    """Folders holding the installed Python packages and the standard library."""
    roots = []
    for p in sys.path:
        if p and os.path.isdir(p) and (p.endswith("site-packages") or p.endswith("dist-packages")):
            roots.append(p)
    std = os.path.dirname(os.__file__)
    if os.path.isdir(std):
        roots.append(std)
    seen, out = set(), []
    for r in roots:
        r = os.path.realpath(r)
        if r not in seen:
            seen.add(r)
            out.append(r)
    return out


def collect_files(roots, max_files=200000):
    files = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and not d.startswith(".")]
            for f in filenames:
                ext = os.path.splitext(f)[1].lower()
                if ext in CODE_EXTS or ext in DOC_EXTS or f.upper().startswith(("LICENSE", "README", "COPYING")):
                    files.append(os.path.join(dirpath, f))
                    if len(files) >= max_files:
                        return files
    return files


def read_text(path, max_bytes):
    try:
        with open(path, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError:
        return None
    if len(data) > max_bytes:
        data = data[:max_bytes]
        # Cut at a line end so the document stays well-formed UTF-8.
        cut = data.rfind(b"\n")
        if cut > 0:
            data = data[:cut + 1]
    if not data or b"\x00" in data:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text


def gettext_catalogs(max_total):
    """Translated strings from the .mo files on this machine (real text in many languages)."""
    import gettext
    texts, total = [], 0
    for base in ["/usr/share/locale", "/usr/local/share/locale", "/usr/share/locale-langpack"] + [
            os.path.join(r, "locale") for r in python_roots()]:
        if not os.path.isdir(base):
            continue
        for dirpath, _, filenames in os.walk(base):
            for f in filenames:
                if not f.endswith(".mo"):
                    continue
                try:
                    with open(os.path.join(dirpath, f), "rb") as fh:
                        cat = gettext.GNUTranslations(fh)
                    msgs = [v for v in cat._catalog.values() if isinstance(v, str) and v.strip()]
                except Exception:
                    continue
                if msgs:
                    t = "\n".join(msgs)
                    texts.append(t)
                    total += len(t.encode("utf-8"))
                    if total >= max_total:
                        return texts
    return texts


SCRIPTS = ["LATIN SMALL LETTER", "LATIN CAPITAL LETTER", "GREEK SMALL LETTER", "CYRILLIC SMALL LETTER",
           "CYRILLIC CAPITAL LETTER", "ARABIC LETTER", "HEBREW LETTER", "DEVANAGARI LETTER", "DEVANAGARI VOWEL SIGN",
           "BENGALI LETTER", "TAMIL LETTER", "THAI CHARACTER", "GEORGIAN LETTER", "ARMENIAN SMALL LETTER",
           "ETHIOPIC SYLLABLE", "HIRAGANA LETTER", "KATAKANA LETTER", "HANGUL SYLLABLE", "CJK UNIFIED IDEOGRAPH",
           "KHMER LETTER", "TIBETAN LETTER", "GUJARATI LETTER", "TELUGU LETTER", "MYANMAR LETTER", "SINHALA LETTER"]


def script_letters():
    """Letters per script, from the BMP, by their Unicode names. CJK ideographs and Hangul
    syllables have generated names, so they are taken from their blocks directly."""
    by_script = {s: [] for s in SCRIPTS}
    for cp in range(0x20, 0x10000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        ch = chr(cp)
        name = unicodedata.name(ch, "")
        for s in SCRIPTS:
            if name.startswith(s):
                by_script[s].append(ch)
                break
    by_script["CJK UNIFIED IDEOGRAPH"] = [chr(c) for c in range(0x4E00, 0x9FA6)]
    by_script["HANGUL SYLLABLE"] = [chr(c) for c in range(0xAC00, 0xD7A4)]
    return {k: v for k, v in by_script.items() if v}


def zipf_words(rng, letters, n_words, min_len, max_len):
    """A vocabulary of pseudo-words, sampled with a Zipf-like law so BPE finds merges."""
    vocab = ["".join(rng.choice(letters) for _ in range(rng.randint(min_len, max_len))) for _ in range(n_words)]
    weights = [1.0 / (i + 1) for i in range(n_words)]
    return vocab, weights


def multilingual_docs(rng, size_bytes):
    letters = script_letters()
    punct = {"CJK UNIFIED IDEOGRAPH": ["。", "、", "！", "？", "「", "」"], "HIRAGANA LETTER": ["。", "、"],
             "KATAKANA LETTER": ["・", "。"], "ARABIC LETTER": ["،", "؛", "؟", "."], "DEVANAGARI LETTER": ["।", ","],
             "THAI CHARACTER": [" ", "ๆ"], "HEBREW LETTER": [".", ",", "״"]}
    docs, total = [], 0
    scripts = sorted(letters)
    while total < size_bytes:
        s = rng.choice(scripts)
        cjk = s in ("CJK UNIFIED IDEOGRAPH", "HIRAGANA LETTER", "KATAKANA LETTER", "THAI CHARACTER")
        vocab, weights = zipf_words(rng, letters[s], 300, 1, 3 if cjk else 8)
        sents = []
        for _ in range(rng.randint(5, 40)):
            words = rng.choices(vocab, weights, k=rng.randint(3, 18))
            sep = "" if cjk else " "
            p = rng.choice(punct.get(s, [".", ",", "!", "?", ";", ":"]))
            sents.append(sep.join(words) + p)
        # Mixed-script lines, numbers and Latin words now and then, like real multilingual prose.
        if rng.random() < 0.5:
            sents.insert(rng.randrange(len(sents) + 1), f"(ver. {rng.randint(1, 99)}.{rng.randint(0, 9)}, {rng.randint(1900, 2030)})")
        text = (" " if not cjk else "").join(sents)
        if rng.random() < 0.3:
            text = unicodedata.normalize("NFD", text)  # combining marks as separate code points
        docs.append(text + "\n")
        total += len(text.encode("utf-8"))
    return docs


EMOJI = ["😀", "👋🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇯🇵", "🇩🇪", "1️⃣", "❤️", "🧑🏿‍💻", "🤷‍♀️", "✨", "🚀", "👍🏻", "©️", "™"]
SPACES = [" ", "  ", "\t", "\u00a0", "\u2003", "\u3000", "\u202f", "\u2009", "\u200b", "\u205f", "\u1680",
          "\u0085", "\u2028", "\u2029", "\x0b", "\x0c", "\x1c", "\x1f"]


def tricky_docs(rng, n):
    """Small documents aimed at the pre-tokenizer's corners."""
    docs = [
        "I'm can't WE'LL they're I'D you've it's 'sup ''s 'x 'ſt 'S 'Ll O'Neil rock'n'roll",
        # Contractions right after a letter (a space before the apostrophe would join the punctuation
        # run instead): case-insensitive matching, and U+017F (long s) which folds to 's'.
        "'ſt", "a'ſt", "It'ſ", "don'T", "x'LL y'Re z'VE w'M v'D", "Kelvin'K", "'s", "'S'", "ſ'ſ'ſ",
        "12345 3.14159 1,000,000 0x1F 1e-9 ½ Ⅻ ٣٤ ௰ 𝟙𝟚𝟛 x² ₃",
        "a  b   c    d\n\n\ne \r\n\r\n f\r\rg\n \n \n h\t\t\ti   \n",
        "    def f(x):\n        return x  # comment\n\n\n\tint main() {\r\n\treturn 0;\r\n}\r\n",
        "café naïve résumé Ångström Zürich ﬁ ﬂ ẞ ǅ",
        unicodedata.normalize("NFD", "café naïve résumé Ångström Tiếng Việt"),
        "नमस्ते दुनिया क्षत्रिय ক্ষ தமிழ் ಕನ್ನಡ",
        "\u0301\u0301abc \u0301 \u0308x",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nhello<|endoftext|>",
        "text<|im_end|>text <|im_start|> <think>x</think><|im_end|><|im_end|><|im_e",
        "".join(EMOJI) + " " + " ".join(EMOJI),
        "!!!???...,,,;;;:::---___===+++***&&&^^^%%%$$$###@@@~~~```|||\\\\\\///",
        "   leading spaces", "trailing spaces   ", " ", "\n", "\r\n", "\t", "x",
        "mixed中文English混合テキスト한국어 text",
    ]
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(5, 60)):
            r = rng.random()
            if r < 0.3:
                parts.append(rng.choice(SPACES) * rng.randint(1, 12))
            elif r < 0.45:
                parts.append(rng.choice(EMOJI))
            elif r < 0.6:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 12))))
            elif r < 0.7:
                parts.append(rng.choice(["\r\n", "\n", "\r", "\n\n", " \n", "\t\n"]))
            elif r < 0.8:
                parts.append(rng.choice(["'s", "'T", "'re", "'VE", "'m", "'ll", "'D", "'", "''"]))
            elif r < 0.85:
                parts.append(rng.choice(SPECIALS + USER_DEFINED))
            else:
                parts.append(rng.choice(["hello", "World", "naïve", "日本", "ñ", "x", "_y", "(z)", "-", "Ωμέγα"]))
        docs.append("".join(parts))
    # Long runs.
    docs.append(" " * 5000 + "x" + "\n" * 3000 + "y" + "\t" * 1000)
    docs.append("a" * 20000)
    docs.append("9" * 5000)
    return docs


def unicode_sweep_docs():
    """Every assigned BMP character in runs of 64: sensitive to the Unicode version of the category
    tables (utf8proc vs Oniguruma), reported separately."""
    chars = []
    for cp in range(0x20, 0x10000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        ch = chr(cp)
        if unicodedata.category(ch) != "Cn":
            chars.append(ch)
    return ["".join(chars[i:i + 64]) for i in range(0, len(chars), 64)]


def build_corpus(args, rng):
    roots = python_roots()
    log(f"scanning {len(roots)} package folders: {', '.join(roots[:4])}{' ...' if len(roots) > 4 else ''}")
    files = collect_files(roots)
    rng.shuffle(files)
    log(f"{len(files)} candidate source/doc files")
    code, prose = [], []
    for f in files:
        ext = os.path.splitext(f)[1].lower()
        (code if ext in CODE_EXTS else prose).append(f)

    def take(paths, budget, max_file):
        out, total = [], 0
        for p in paths:
            t = read_text(p, max_file)
            if t is None or len(t) < 32:
                continue
            out.append(t)
            total += len(t.encode("utf-8"))
            if total >= budget:
                break
        return out, total

    mb = 1 << 20
    # Disjoint halves of the file list: one trains the BPE, the other is the test set.
    half_code, half_prose = len(code) // 2, len(prose) // 2
    train_code, _ = take(code[:half_code], int(args.train_mb * mb * 0.6), 200_000)
    train_prose, _ = take(prose[:half_prose], int(args.train_mb * mb * 0.2), 200_000)
    test_code, tc = take(code[half_code:], int(args.corpus_mb * mb * 0.55), 100_000)
    test_prose, tp = take(prose[half_prose:], int(args.corpus_mb * mb * 0.15), 100_000)
    log(f"test code {tc / mb:.2f} MB in {len(test_code)} files, docs/prose {tp / mb:.2f} MB in {len(test_prose)} files")

    mo = gettext_catalogs(int(args.corpus_mb * mb * 0.2))
    rng.shuffle(mo)
    log(f"gettext catalogs: {len(mo)} ({sum(len(t.encode()) for t in mo) / mb:.2f} MB)")
    train_mo, test_mo = mo[: len(mo) // 2], mo[len(mo) // 2:]

    train_ml = multilingual_docs(random.Random(args.seed + 1), int(args.train_mb * mb * 0.2))
    test_ml = multilingual_docs(random.Random(args.seed + 2), int(args.corpus_mb * mb * 0.2))
    tricky = tricky_docs(rng, 400)

    train = train_code + train_prose + train_mo + train_ml + tricky[:50]
    test = {"code": test_code, "prose": test_prose, "gettext": test_mo, "multilingual": test_ml, "tricky": tricky}
    if not args.no_sweep:
        test["unicode-sweep"] = unicode_sweep_docs()
    # Real files mix \r\n and \n: convert a share of the code documents.
    for i in range(0, len(test_code), 7):
        test_code[i] = test_code[i].replace("\n", "\r\n")
    return train, test


# =============================================================================================
# GGUF writer (only what a tokenizer needs: strings, u32/i32 scalars and arrays, bools)

GGUF_U32, GGUF_I32, GGUF_BOOL, GGUF_STRING, GGUF_ARRAY = 4, 5, 7, 8, 9


def gguf_string(s):
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def gguf_value(vtype, value):
    if vtype == GGUF_U32:
        return struct.pack("<I", value)
    if vtype == GGUF_I32:
        return struct.pack("<i", value)
    if vtype == GGUF_BOOL:
        return struct.pack("<B", 1 if value else 0)
    if vtype == GGUF_STRING:
        return gguf_string(value)
    raise ValueError(vtype)


def write_gguf(path, kvs):
    """kvs: list of (key, type, value) where an array is (key, (GGUF_ARRAY, elem_type), list)."""
    out = bytearray()
    out += struct.pack("<IIQQ", 0x46554747, 3, 0, len(kvs))
    for key, vtype, value in kvs:
        out += gguf_string(key)
        if isinstance(vtype, tuple):
            _, et = vtype
            out += struct.pack("<IIQ", GGUF_ARRAY, et, len(value))
            for v in value:
                out += gguf_value(et, v)
        else:
            out += struct.pack("<I", vtype) + gguf_value(vtype, value)
    out += b"\x00" * ((-len(out)) % 32)  # the (empty) data section starts aligned
    Path(path).write_bytes(bytes(out))


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def gguf_from_tokenizer_json(tj, pre, path):
    """Vocabulary, merges and token types from a tokenizer.json (dict) into a GGUF."""
    model = tj["model"]
    assert model["type"] == "BPE", f"expected a BPE model, got {model['type']}"
    id_to_tok = {}
    for tok, i in model["vocab"].items():
        id_to_tok[i] = tok
    types = {}
    for at in tj.get("added_tokens", []):
        id_to_tok[at["id"]] = at["content"]
        types[at["id"]] = 3 if at.get("special") else 4
    n = max(id_to_tok) + 1
    tokens, token_types = [], []
    for i in range(n):
        if i in id_to_tok:
            tokens.append(id_to_tok[i])
            token_types.append(types.get(i, 1))
        else:
            tokens.append(f"<|dflash_unused_{i}|>")
            token_types.append(5)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    ids = {t: i for i, t in enumerate(tokens)}
    kvs = [
        ("general.architecture", GGUF_STRING, "qwen35"),
        ("general.name", GGUF_STRING, "dflash tokenizer oracle"),
        ("tokenizer.ggml.model", GGUF_STRING, "gpt2"),
        ("tokenizer.ggml.pre", GGUF_STRING, pre),
        ("tokenizer.ggml.tokens", (GGUF_ARRAY, GGUF_STRING), tokens),
        ("tokenizer.ggml.token_type", (GGUF_ARRAY, GGUF_I32), token_types),
        ("tokenizer.ggml.merges", (GGUF_ARRAY, GGUF_STRING), merges),
        ("tokenizer.ggml.add_bos_token", GGUF_BOOL, False),
    ]
    if "<|endoftext|>" in ids:
        kvs += [("tokenizer.ggml.bos_token_id", GGUF_U32, ids["<|endoftext|>"]),
                ("tokenizer.ggml.padding_token_id", GGUF_U32, ids["<|endoftext|>"])]
    if "<|im_end|>" in ids:
        kvs.append(("tokenizer.ggml.eos_token_id", GGUF_U32, ids["<|im_end|>"]))
    write_gguf(path, kvs)
    return tokens, token_types


# =============================================================================================
# HF tokenizer

def train_hf(train_texts, pre, vocab_size, min_frequency):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERNS[pre]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=[AddedToken(s, special=True, normalized=False) for s in SPECIALS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(train_texts, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in USER_DEFINED])
    return tok


# =============================================================================================
# Comparison

def run_dflash(args, gguf_path, docs, work, tag, split=False):
    inp = work / f"docs-{tag}.jsonl"
    out = work / f"dflash-{tag}.jsonl"
    with open(inp, "w", encoding="utf-8") as fh:
        for d in docs:
            fh.write(json.dumps(d, ensure_ascii=True) + "\n")
    cmd = [args.dflash, "tokenize", "-m", str(gguf_path), "--batch", str(inp), "--out", str(out)]
    if split:
        cmd.append("--split")
    t0 = time.time()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=args.timeout)
    dt = time.time() - t0
    if p.returncode != 0:
        raise SystemExit(f"dflash failed (exit {p.returncode}): {' '.join(cmd)}\n{p.stderr.decode(errors='replace')}")
    results = [json.loads(line) for line in open(out, encoding="utf-8")]
    if len(results) != len(docs):
        raise SystemExit(f"dflash returned {len(results)} results for {len(docs)} documents")
    return results, p.stderr.decode(errors="replace").strip(), dt


def describe_mismatch(doc, ref_ids, our_ids, tokens, b2u_inv):
    k = next((i for i, (a, b) in enumerate(zip(ref_ids, our_ids)) if a != b), min(len(ref_ids), len(our_ids)))
    lo = max(0, k - 3)

    def show(ids):
        return [tokens[i] if 0 <= i < len(tokens) else f"<bad {i}>" for i in ids[lo:k + 4]]
    return {"first_diff": k, "n_ref": len(ref_ids), "n_ours": len(our_ids), "ref": show(ref_ids),
            "ours": show(our_ids), "ref_ids": ref_ids[lo:k + 4], "our_ids": our_ids[lo:k + 4],
            "text_head": doc[:200]}


def regex_split(pattern, specials, text):
    """Reference split: special tokens first (leftmost-longest), then the regex on each fragment."""
    import regex
    rx = regex.compile(pattern)
    specials = sorted(specials, key=len, reverse=True)
    pieces, i, seg = [], 0, 0
    while i < len(text):
        hit = next((s for s in specials if text.startswith(s, i)), None)
        if hit:
            pieces += rx.findall(text[seg:i])
            pieces.append(hit)
            i += len(hit)
            seg = i
        else:
            i += 1
    pieces += rx.findall(text[seg:])
    return pieces


def regex_only(args, rng, work):
    """No HF here: check the split against the `regex` module, with a byte-only vocabulary."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)] + SPECIALS + USER_DEFINED
    types = [1] * 256 + [3] * len(SPECIALS) + [4] * len(USER_DEFINED)
    _, test = build_corpus(args, rng)
    docs = [d for group in test.values() for d in group]
    failures, summary = 0, {}
    for pre in args.pre:
        g = work / f"bytes-{pre}.gguf"
        write_gguf(g, [("tokenizer.ggml.model", GGUF_STRING, "gpt2"), ("tokenizer.ggml.pre", GGUF_STRING, pre),
                       ("tokenizer.ggml.tokens", (GGUF_ARRAY, GGUF_STRING), tokens),
                       ("tokenizer.ggml.token_type", (GGUF_ARRAY, GGUF_I32), types),
                       ("tokenizer.ggml.merges", (GGUF_ARRAY, GGUF_STRING), [])])
        results, stats, _ = run_dflash(args, g, docs, work, f"regex-{pre}", split=True)
        bad = 0
        for d, r in zip(docs, results):
            data = d.encode("utf-8")
            ours = [data[b:e].decode("utf-8", errors="replace") for b, e in r["pieces"]]
            ref = regex_split(PATTERNS[pre], SPECIALS + USER_DEFINED, d)
            ids_ok = r["roundtrip"]
            if ours != ref or not ids_ok:
                bad += 1
                if bad <= 5:
                    k = next((i for i, (a, b) in enumerate(zip(ref, ours)) if a != b), min(len(ref), len(ours)))
                    log(f"{pre}: split differs at piece {k}: regex {ref[max(0, k - 2):k + 3]!r} ours {ours[max(0, k - 2):k + 3]!r}")
        log(f"{pre}: {len(docs) - bad}/{len(docs)} documents split identically ({stats})")
        summary[pre] = {"documents": len(docs), "split_mismatches": bad, "dflash": stats}
        failures += bad
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    return 1 if failures else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dflash", required=True, help="path of the dflash binary")
    ap.add_argument("--work", default="build-oracle-tokenizer", help="folder for the corpus, GGUFs and reports")
    ap.add_argument("--pre", nargs="+", default=["qwen35", "qwen2"], choices=sorted(PATTERNS))
    ap.add_argument("--vocab-size", type=int, default=16000)
    ap.add_argument("--min-frequency", type=int, default=2)
    ap.add_argument("--corpus-mb", type=float, default=6.0, help="size of the test documents")
    ap.add_argument("--train-mb", type=float, default=6.0, help="size of the BPE training text")
    ap.add_argument("--tokenizer-json", help="use this tokenizer.json instead of training one (one --pre)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=1200)
    ap.add_argument("--no-sweep", action="store_true", help="leave out the all-BMP-characters documents")
    ap.add_argument("--regex-only", action="store_true", help="no HF: check the split against the regex module")
    args = ap.parse_args()

    args.dflash = os.path.abspath(args.dflash)
    if not os.access(args.dflash, os.X_OK):
        raise SystemExit(f"not an executable: {args.dflash}")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    log(f"python {sys.version.split()[0]}, unicodedata {unicodedata.unidata_version}, work folder {work}")

    if args.regex_only:
        sys.exit(regex_only(args, rng, work))

    try:
        import tokenizers
        from tokenizers import Tokenizer
    except ImportError:
        raise SystemExit("the Python package `tokenizers` is not installed (use --regex-only for the split check)")
    log(f"tokenizers {tokenizers.__version__}")

    train, test = build_corpus(args, rng)
    docs, groups = [], []
    for g, ds in test.items():
        for d in ds:
            docs.append(d)
            groups.append(g)
    total_bytes = sum(len(d.encode("utf-8")) for d in docs)
    log(f"{len(docs)} test documents, {total_bytes / 1e6:.2f} MB; training text {sum(len(t) for t in train) / 1e6:.2f} M chars")

    summary = {"tokenizers": tokenizers.__version__, "unicodedata": unicodedata.unidata_version,
               "documents": len(docs), "bytes": total_bytes, "runs": {}}
    failures = 0
    mismatch_log = open(work / "mismatches.jsonl", "w", encoding="utf-8")
    for pre in (args.pre[:1] if args.tokenizer_json else args.pre):
        t0 = time.time()
        if args.tokenizer_json:
            hf = Tokenizer.from_file(args.tokenizer_json)
        else:
            hf = train_hf(train, pre, args.vocab_size, args.min_frequency)
        train_s = time.time() - t0
        tj = json.loads(hf.to_str())
        (work / f"tokenizer-{pre}.json").write_text(hf.to_str())
        gguf_path = work / f"vocab-{pre}.gguf"
        tokens, _ = gguf_from_tokenizer_json(tj, pre, gguf_path)
        log(f"{pre}: vocabulary {len(tokens)} tokens, {len(tj['model']['merges'])} merges (trained in {train_s:.1f} s) -> {gguf_path}")

        t0 = time.time()
        ref = [e.ids for e in hf.encode_batch(docs, add_special_tokens=False)]
        hf_s = time.time() - t0
        ours, stats, our_s = run_dflash(args, gguf_path, docs, work, pre)
        log(f"{pre}: HF {hf_s:.2f} s (batch, all cores); dflash {our_s:.2f} s wall: {stats}")

        per_group = {}
        n_bad = n_rt = 0
        for i, (d, g, r, o) in enumerate(zip(docs, groups, ref, ours)):
            s = per_group.setdefault(g, {"documents": 0, "bytes": 0, "tokens": 0, "id_mismatches": 0,
                                         "roundtrip_failures": 0, "hf_roundtrip_failures": 0})
            s["documents"] += 1
            s["bytes"] += len(d.encode("utf-8"))
            s["tokens"] += len(r)
            if o["ids"] != r:
                s["id_mismatches"] += 1
                n_bad += 1
                rec = {"pre": pre, "doc": i, "group": g, **describe_mismatch(d, r, o["ids"], tokens, None)}
                mismatch_log.write(json.dumps(rec, ensure_ascii=False) + "\n")
                if n_bad <= 5:
                    log(f"{pre}: MISMATCH doc {i} ({g}) at token {rec['first_diff']}: HF {rec['ref']} vs dflash {rec['ours']}")
            if not o["roundtrip"]:
                s["roundtrip_failures"] += 1
                n_rt += 1
            if hf.decode(r, skip_special_tokens=False) != d:
                s["hf_roundtrip_failures"] += 1
        summary["runs"][pre] = {"vocab": len(tokens), "merges": len(tj["model"]["merges"]), "hf_seconds": hf_s,
                                "dflash_wall_seconds": our_s, "dflash_stats": stats, "id_mismatches": n_bad,
                                "roundtrip_failures": n_rt, "groups": per_group}
        # A mismatch confined to the all-characters sweep points at Unicode table versions.
        sweep_bad = per_group.get("unicode-sweep", {}).get("id_mismatches", 0)
        failures += n_bad - sweep_bad + n_rt + (sweep_bad if args.no_sweep else 0)
        if sweep_bad:
            log(f"{pre}: {sweep_bad} unicode-sweep documents differ (Unicode version of the category tables?)")
        log(f"{pre}: {len(docs) - n_bad}/{len(docs)} documents with identical ids, {n_rt} round-trip failures")
    mismatch_log.close()

    (work / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False))
    lines = [f"tokenizer oracle: {len(docs)} documents, {total_bytes / 1e6:.2f} MB, tokenizers {summary['tokenizers']}"]
    for pre, r in summary["runs"].items():
        lines.append(f"  {pre}: vocab {r['vocab']}, ids identical in {len(docs) - r['id_mismatches']}/{len(docs)}, "
                     f"round-trip failures {r['roundtrip_failures']}; {r['dflash_stats']}")
        for g, s in r["groups"].items():
            lines.append(f"    {g:<14} {s['documents']:>6} docs {s['bytes'] / 1e6:8.2f} MB {s['tokens']:>9} tokens  "
                         f"id mismatches {s['id_mismatches']}, round-trip failures {s['roundtrip_failures']}")
    lines.append("PASS" if failures == 0 else f"FAIL ({failures} failing documents; see mismatches.jsonl)")
    (work / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    sys.exit(0 if failures == 0 else 1)


if __name__ == "__main__":
    main()
