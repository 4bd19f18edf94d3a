"""Corpus + tokenizer: source code and text files of the installed Python packages, split BY PACKAGE.

    python3 tools/train/corpus.py --out WORK [--train-mb 120] [--tok-mb 32] [--vocab 12288] [--byte-tokenizer]

Writes into WORK: train.bin / heldout.bin (uint16 token ids, each document starts with <|endoftext|>),
tok_gguf.json (the GGUF tokenizer fields), tokenizer.json (HF), heldout_prompts.jsonl (held-out code
snippets for the acceptance benchmark), corpus_stats.json.

Packages = top-level entries of every site-packages / dist-packages folder and of the standard library
(stdlib modules count as packages named "stdlib.<name>"). HELDOUT packages never reach the tokenizer or
training: neither their files, nor any training file with the same content, nor vendored copies
(a path component equal to a held-out package name, e.g. pip/_vendor/rich).
A share of the training part is chat-formatted: Python functions with a docstring become
  <|im_start|>user\\nWrite a Python function `name`: <docstring summary><|im_end|>\\n
  <|im_start|>assistant\\n```python\\n<function source>\\n```<|im_end|>
so the shipped model answers `dflash run -p ...` (chat template) with code.
"""
import argparse
import ast
import hashlib
import json
import os
import random
import sys
import textwrap
import time
from multiprocessing import Pool

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tokenizer_util import SPECIALS, ByteEncoder, byte_tokenizer, train_bpe  # noqa: E402

HELDOUT = ["networkx", "rich", "requests", "click", "jinja2", "markdown", "tabulate", "sortedcontainers"]
CODE_EXT = {".py", ".pyi", ".pyx", ".pxd", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".cuh", ".sh"}
TEXT_EXT = {".md", ".rst", ".txt", ".toml", ".cfg"}
MIN_BYTES, MAX_BYTES, MAX_LINE = 200, 300_000, 1000


def log(msg):
    print(f"[corpus {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def roots():
    out = []
    for p in sys.path:
        if p and os.path.isdir(p) and (p.endswith("site-packages") or p.endswith("dist-packages")):
            out.append(("", os.path.realpath(p)))
    std = os.path.dirname(os.__file__)
    out.append(("stdlib.", os.path.realpath(std)))
    seen, res = set(), []
    for pre, r in out:
        if r not in seen:
            seen.add(r)
            res.append((pre, r))
    return res


def list_files():
    """[(package, relpath, abspath)]"""
    files = []
    for pre, root in roots():
        for dp, dns, fns in os.walk(root):
            rel = os.path.relpath(dp, root)
            top = rel.split(os.sep)[0] if rel != "." else ""
            if top.endswith((".dist-info", ".egg-info")) or top in ("__pycache__", "site-packages", "dist-packages"):
                dns[:] = []
                continue
            dns[:] = [d for d in dns if d != "__pycache__"]
            for fn in fns:
                ext = os.path.splitext(fn)[1].lower()
                if ext not in CODE_EXT and ext not in TEXT_EXT:
                    continue
                pkg = top if top else os.path.splitext(fn)[0]
                files.append((pre + pkg, os.path.join(rel, fn) if rel != "." else fn, os.path.join(dp, fn)))
    return files


def read_ok(path):
    try:
        sz = os.path.getsize(path)
        if sz < MIN_BYTES or sz > MAX_BYTES:
            return None
        with open(path, "rb") as fh:
            raw = fh.read()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if "\x00" in text or any(s in text for s in SPECIALS):
        return None
    if max((len(line) for line in text.split("\n")), default=0) > MAX_LINE:
        return None
    return text.replace("\r\n", "\n")


def is_heldout_path(pkg, rel):
    base = pkg.split(".", 1)[-1] if pkg.startswith("stdlib.") else pkg
    parts = set(rel.split(os.sep)) | {base}
    return any(h in parts or h + ".py" in parts for h in HELDOUT)


def chat_samples(args):
    """Functions with docstrings from one Python file -> chat-formatted texts."""
    text, = args
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    lines = text.split("\n")
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or node.name.startswith("_") or not getattr(node, "end_lineno", None):
            continue
        summary = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
        if len(summary) < 20 or len(summary) > 300:
            continue
        start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
        src = textwrap.dedent("\n".join(lines[start:node.end_lineno]))
        if len(src) > 4000 or len(src) < 80:
            continue
        out.append(f"<|im_start|>user\nWrite a Python function `{node.name}`: {summary}<|im_end|>\n"
                   f"<|im_start|>assistant\n```python\n{src}\n```<|im_end|>\n")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--train-mb", type=float, default=120)
    ap.add_argument("--tok-mb", type=float, default=32)
    ap.add_argument("--heldout-mb", type=float, default=16)
    ap.add_argument("--chat-share", type=float, default=0.12, help="share of training bytes in chat format")
    ap.add_argument("--vocab", type=int, default=12288)
    ap.add_argument("--byte-tokenizer", action="store_true", help="no `tokenizers`: bytes only (smoke tests)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--drafter-prompts", type=int, default=20000)
    ap.add_argument("--drafter-eval-prompts", type=int, default=512)
    ap.add_argument("--heldout-eval-tokens", type=int, default=400_000)
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rng = random.Random(a.seed)
    t0 = time.time()

    files = list_files()
    files.sort()
    log(f"{len(files)} candidate files in {len(set(f[0] for f in files))} packages")
    # held-out: the packages themselves; vendored copies elsewhere are dropped from both parts
    held = [f for f in files if f[0] in HELDOUT]
    train = [f for f in files if not is_heldout_path(f[0], f[1])]
    rng.shuffle(held)
    rng.shuffle(train)

    seen = set()
    held_docs, held_bytes, held_pkgs = [], 0, {}
    for pkg, rel, path in held:
        text = read_ok(path)
        if text is None:
            continue
        h = hashlib.sha1(text.encode()).digest()
        if h in seen:
            continue
        seen.add(h)  # every held-out text blocks its duplicates in training, also past the budget
        if held_bytes < a.heldout_mb * 1e6:
            held_docs.append((pkg, rel, text))
            held_bytes += len(text)
            held_pkgs[pkg] = held_pkgs.get(pkg, 0) + len(text)
    train_docs, train_bytes, train_pkgs = [], 0, {}
    for pkg, rel, path in train:
        if train_bytes >= a.train_mb * 1e6:
            break
        text = read_ok(path)
        if text is None:
            continue
        h = hashlib.sha1(text.encode()).digest()
        if h in seen:
            continue
        seen.add(h)
        train_docs.append((pkg, rel, text))
        train_bytes += len(text)
        train_pkgs[pkg] = train_pkgs.get(pkg, 0) + len(text)
    log(f"train: {len(train_docs)} files {train_bytes / 1e6:.1f} MB from {len(train_pkgs)} packages; "
        f"held-out: {len(held_docs)} files {held_bytes / 1e6:.1f} MB from {sorted(held_pkgs)}")

    def doc_text(pkg, rel, text):
        return (f"# {rel}\n" if rel.endswith(".py") else "") + text

    # chat samples from training Python files
    py = [(t,) for _, rel, t in train_docs if rel.endswith(".py")]
    with Pool(a.workers) as pool:
        chats = [s for lst in pool.imap_unordered(chat_samples, py, chunksize=16) for s in lst]
    rng.shuffle(chats)
    budget = a.chat_share * train_bytes
    used, chat_docs = 0, []
    for s in chats:
        if used >= budget:
            break
        chat_docs.append(s)
        used += len(s)
    log(f"chat samples: {len(chats)} functions with docstrings, using {len(chat_docs)} ({used / 1e6:.1f} MB)")

    train_texts = [doc_text(*d) for d in train_docs] + chat_docs
    rng.shuffle(train_texts)
    held_texts = [doc_text(*d) for d in held_docs]

    # tokenizer
    if a.byte_tokenizer:
        tok = byte_tokenizer()
        enc = ByteEncoder(tok)
        log("byte tokenizer (fallback)")
    else:
        sample, sb = [], 0
        for t in train_texts:
            if sb >= a.tok_mb * 1e6:
                break
            sample.append(t)
            sb += len(t)
        t1 = time.time()
        enc, tok = train_bpe(sample, a.vocab)
        enc.save(os.path.join(a.out, "tokenizer.json"))
        log(f"BPE trained on {sb / 1e6:.1f} MB in {time.time() - t1:.1f} s: {len(tok['tokens'])} tokens, "
            f"{len(tok['merges'])} merges")
    json.dump(tok, open(os.path.join(a.out, "tok_gguf.json"), "w"))
    eot = tok["eot_text"]

    def encode_all(texts):
        t1 = time.time()
        out = []
        B = 4096
        for i in range(0, len(texts), B):
            res = enc.encode_batch(texts[i:i + B])
            for r in res:
                ids = r.ids if hasattr(r, "ids") else r
                out.append(np.asarray([eot] + list(ids), np.uint16))
        arr = np.concatenate(out) if out else np.zeros(0, np.uint16)
        return arr, time.time() - t1

    assert len(tok["tokens"]) < 65536
    tr, s1 = encode_all(train_texts)
    ho, s2 = encode_all(held_texts)
    tr.tofile(os.path.join(a.out, "train.bin"))
    ho.tofile(os.path.join(a.out, "heldout.bin"))
    log(f"encoded: train {tr.size} tokens ({s1:.1f} s, {sum(map(len, train_texts)) / max(tr.size, 1):.2f} B/token), "
        f"held-out {ho.size} tokens ({s2:.1f} s)")

    # drafter prompts: windows of train.bin (half at a document start) and of heldout.bin (evaluation)
    def windows(arr, n, P, seed):
        g = np.random.default_rng(seed)
        starts = np.flatnonzero(arr[:len(arr) - P - 1] == eot)
        k = n // 2
        s1 = g.choice(starts, k) if len(starts) else g.integers(0, len(arr) - P - 1, k)
        s2 = g.integers(0, len(arr) - P - 1, n - k)
        st = np.concatenate([s1, s2])
        return np.stack([arr[i:i + P] for i in st]).astype(np.uint16)

    windows(tr, a.drafter_prompts, a.prompt_len, 11).tofile(os.path.join(a.out, "drafter_prompts.bin"))
    windows(ho, a.drafter_eval_prompts, a.prompt_len, 12).tofile(os.path.join(a.out, "drafter_eval_prompts.bin"))
    ho[:a.heldout_eval_tokens].tofile(os.path.join(a.out, "heldout_eval.bin"))

    # held-out prompts for the acceptance benchmark: the first lines of held-out Python files
    prng = random.Random(a.seed + 1)
    prompts = []
    cands = [d for d in held_docs if d[1].endswith(".py")]
    prng.shuffle(cands)
    for pkg, rel, text in cands:
        lines = doc_text(pkg, rel, text).split("\n")
        if len(lines) < 40:
            continue
        k = prng.randint(12, 30)
        prompts.append({"package": pkg, "file": rel, "prompt": "\n".join(lines[:k]) + "\n"})
        if len(prompts) >= 64:
            break
    with open(os.path.join(a.out, "heldout_prompts.jsonl"), "w") as fh:
        for p in prompts:
            fh.write(json.dumps(p) + "\n")
    stats = {"train_files": len(train_docs), "train_bytes": train_bytes, "train_packages": len(train_pkgs),
             "train_top_packages": sorted(train_pkgs.items(), key=lambda x: -x[1])[:30],
             "chat_samples": len(chat_docs), "chat_bytes": used,
             "heldout_packages_requested": HELDOUT, "heldout_package_bytes": held_pkgs,
             "heldout_files": len(held_docs), "heldout_bytes": held_bytes,
             "train_tokens": int(tr.size), "heldout_tokens": int(ho.size), "vocab": len(tok["tokens"]),
             "merges": len(tok["merges"]), "seconds": time.time() - t0}
    json.dump(stats, open(os.path.join(a.out, "corpus_stats.json"), "w"), indent=1)
    log(f"done in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
