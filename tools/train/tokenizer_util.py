"""Tokenizer helpers: HF `tokenizers` byte-level BPE (Qwen2 split + ByteLevel) training and its GGUF
fields, and a byte-only fallback (no merges) for machines without `tokenizers` (smoke tests)."""
import json

QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]


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


def _finish(tokens, types, merges):
    ids = {t: i for i, t in enumerate(tokens)}
    return {"tokens": tokens, "token_type": types, "merges": merges, "bos": ids["<|endoftext|>"],
            "eos": ids["<|im_end|>"], "pad": ids["<|endoftext|>"], "mask": ids["<|mask|>"],
            "eot_text": ids["<|endoftext|>"], "im_start": ids["<|im_start|>"]}


def byte_tokenizer():
    """256 byte tokens (id = byte) + the specials; no merges."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)] + SPECIALS
    types = [1] * 256 + [3] * len(SPECIALS)
    return _finish(tokens, types, [])


class ByteEncoder:
    """encode(text) for the byte tokenizer (specials parsed)."""

    def __init__(self, tok):
        self.tok = tok
        self.special = {s: tok["tokens"].index(s) for s in SPECIALS}

    def encode(self, text):
        out = []
        i = 0
        while i < len(text):
            hit = None
            if text[i] == "<":
                for s, sid in self.special.items():
                    if text.startswith(s, i):
                        hit = (s, sid)
                        break
            if hit:
                out.append(hit[1])
                i += len(hit[0])
            else:
                j = text.find("<|", i + 1)
                j = len(text) if j < 0 else j
                out.extend(text[i:j].encode("utf-8"))
                i = j
        return out

    def encode_batch(self, texts):
        return [self.encode(t) for t in texts]

    def decode(self, ids):
        bs = bytearray()
        for t in ids:
            if t < 256:
                bs.append(t)
            else:
                bs += self.tok["tokens"][t].encode()
        return bs.decode("utf-8", "replace")


def train_bpe(texts, vocab_size):
    """Returns (hf Tokenizer, tok dict for the GGUF)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[AddedToken(s, special=True, normalized=False) for s in SPECIALS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(texts, trainer=trainer)
    return tk, gguf_fields(json.loads(tk.to_str()))


def gguf_fields(tj):
    model = tj["model"]
    id_to_tok, types = {}, {}
    for t, i in model["vocab"].items():
        id_to_tok[i] = t
    for at in tj.get("added_tokens", []):
        id_to_tok[at["id"]] = at["content"]
        types[at["id"]] = 3 if at.get("special") else 4
    n = max(id_to_tok) + 1
    tokens, tt = [], []
    for i in range(n):
        tokens.append(id_to_tok.get(i, f"<|unused_{i}|>"))
        tt.append(types.get(i, 1 if i in id_to_tok else 5))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return _finish(tokens, tt, merges)
