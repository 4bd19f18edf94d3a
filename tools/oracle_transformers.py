#!/usr/bin/env python3
"""Hugging Face transformers oracle for `dflash convert` + the target runtime (SPEC 9).

Runs on the GPU machine (Python 3.12, torch 2.11, transformers 5.17; no network):
  1. builds tiny random Qwen3.5 hybrid (Qwen3_5ForCausalLM: Gated DeltaNet + gated attention, V heads =
     3 x K heads as in the 27B) and dense Qwen3 (tied embeddings) models with transformers, seeded, with
     weights scaled so activations are O(1) and greedy paths are not near-ties; saves them with
     save_pretrained (safetensors; the hybrid sharded);
  2. converts each with `dflash convert` (f32; --prism f32; --prism --type ptq1_0; --prism --type pq2_0);
  3. runs `dflash run --tokens ... -n 64 --json --dump-logits` on 64-token prompts and compares with HF:
       float files     vs the original HF model: max relative logit error per position (target <= 1e-4)
                       and 64 greedy tokens identical;
       ternary files   vs an HF model loaded with OUR GGUF's weights dequantized (`dflash dump`), rotated
                       back (w = s (.) H_blk(w_stored)) and put back in HF layout (target <= 1e-3) and
                       64 greedy tokens identical;
  4. checks the converter's weight mapping on its own: GGUF -> HF state dict round trip (f32, f32 prism);
  5. SPEC 3's ssm_out question: rebuilds layer 0 with ssm_out read with the tiled -> grouped permutation
     and without it, and reports which matches the original layer-0 output;
  6. converts a checkpoint carrying a real `tokenizers` BPE (qwen2 split, trained here) and compares
     `dflash tokenize` with the HF tokenizer on a few strings.
It prints a summary and writes a JSON result file; the exit status is 0 only when every check passes.

    python3 tools/oracle_transformers.py --dflash build/dflash --out oracle_result.json
"""

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

TOL_FLOAT = 1e-4
TOL_TERNARY = 1e-3


def log(msg):
    print(f"[oracle] {msg}", flush=True)


# =============================================================================================
# GGUF metadata + tensor infos (the data is read through `dflash dump`)

GGUF_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class GGUF:
    def __init__(self, path):
        self.path = str(path)
        with open(path, "rb") as f:
            self.buf = f.read()
        self.pos = 0
        magic, version = struct.unpack_from("<II", self.buf, 0)
        if magic != 0x46554747:
            raise ValueError(f"{path}: not a GGUF file")
        n_tensors, n_kv = struct.unpack_from("<QQ", self.buf, 8)
        self.pos = 24
        self.kv = {}
        for _ in range(n_kv):
            key = self._str()
            (t,) = struct.unpack_from("<I", self.buf, self.pos)
            self.pos += 4
            self.kv[key] = self._value(t)
        self.tensors = {}
        for _ in range(n_tensors):
            name = self._str()
            (nd,) = struct.unpack_from("<I", self.buf, self.pos)
            self.pos += 4
            ne = list(struct.unpack_from(f"<{nd}Q", self.buf, self.pos))
            self.pos += 8 * nd
            ttype, off = struct.unpack_from("<IQ", self.buf, self.pos)
            self.pos += 12
            self.tensors[name] = {"ne": ne, "type": ttype, "offset": off}

    def _str(self):
        (n,) = struct.unpack_from("<Q", self.buf, self.pos)
        s = self.buf[self.pos + 8:self.pos + 8 + n].decode("utf-8", errors="replace")
        self.pos += 8 + n
        return s

    def _value(self, t):
        if t == 8:
            return self._str()
        if t == 9:
            et, n = struct.unpack_from("<IQ", self.buf, self.pos)
            self.pos += 12
            return [self._value(et) for _ in range(n)]
        fmt = GGUF_SCALAR[t]
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v


class Dumper:
    """Tensors of a GGUF as float32 numpy arrays, dequantized by `dflash dump` (our codecs, bit-exact
    with ggml's reference dequantizers)."""

    def __init__(self, dflash, gguf_path, tmp):
        self.dflash, self.path, self.tmp = dflash, str(gguf_path), Path(tmp)
        self.g = GGUF(gguf_path)
        self.tmp.mkdir(parents=True, exist_ok=True)

    def __call__(self, name):
        info = self.g.tensors[name]
        out = self.tmp / "t.bin"
        run_cmd([self.dflash, "dump", self.path, "--tensor", name, "--out", str(out)])
        a = np.fromfile(out, dtype=np.float32)
        ne = info["ne"]
        return a.reshape(list(reversed(ne))) if len(ne) > 1 else a


def run_cmd(cmd, timeout=1800):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"command failed ({r.returncode}): {' '.join(map(str, cmd))}\n{r.stderr[-4000:]}")
    return r


# =============================================================================================
# Models

def build_models(seed):
    import torch
    import transformers
    try:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    except ImportError:
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    from transformers import Qwen3Config, Qwen3ForCausalLM

    models = {}
    # Hybrid: 8 layers (full attention at 3 and 7), value heads = 3 x key heads like the 27B.
    c35 = Qwen3_5TextConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [3, 3, 2], "mrope_interleaved": True},
        attn_implementation="eager")
    models["qwen35"] = (Qwen3_5ForCausalLM, c35)
    c3 = Qwen3Config(
        vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
        rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1000000.0, attention_bias=False,
        attn_implementation="eager")
    models["qwen3"] = (Qwen3ForCausalLM, c3)

    out = {}
    for i, (name, (cls, cfg)) in enumerate(models.items()):
        torch.manual_seed(seed + i)
        model = cls(cfg).eval()
        randomize(model, seed + 100 + i)
        out[name] = model
    return out


def randomize(model, seed):
    """Every parameter random and O(1)-scaled, so each tensor matters and logits have a clear top-1:
    matrices ~ N(0, 1/in), embedding N(0, 1), lm_head x4, zero-centred norms (Qwen3.5 RMSNorm) N(0, .1),
    plain norms 1 + N(0, .1), A_log = log U(0.5, 16), dt_bias N(0, .5), conv N(0, 1/K)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    zero_centred = set()
    for mname, mod in model.named_modules():
        if type(mod).__name__ == "Qwen3_5RMSNorm":
            zero_centred.add(mname + ".weight")
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(p.shape)
            r = lambda: torch.randn(shape, generator=g)  # noqa: E731
            if name in zero_centred:
                v = 0.1 * r()
            elif "norm" in name:
                v = 1.0 + 0.1 * r()
            elif name.endswith("A_log"):
                v = torch.log(torch.rand(shape, generator=g) * 15.5 + 0.5)
            elif name.endswith("dt_bias"):
                v = 0.5 * r()
            elif "conv1d" in name:
                v = r() / math.sqrt(shape[-1])
            elif "embed_tokens" in name:
                v = r()
            elif name.startswith("lm_head"):
                v = 4.0 * r() / math.sqrt(shape[1])
            elif p.dim() == 2:
                v = r() / math.sqrt(shape[1])
            else:
                raise RuntimeError(f"randomize: unexpected parameter {name} {shape}")
            p.copy_(v.to(p.dtype))
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()


# =============================================================================================
# HF side

def hf_logits(model, ids, device):
    import torch
    with torch.no_grad():
        x = torch.tensor([ids], device=device)
        return model(x).logits[0].float().cpu().numpy()


def hf_greedy(model, ids, n, device):
    """Greedy decode by recomputing the whole sequence each step (no cache: nothing to get wrong).
    Returns the tokens and, per step, the gap between the top-2 logits."""
    import torch
    seq = list(ids)
    toks, gaps = [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq], device=device)).logits[0, -1].float()
            top = torch.topk(logits, 2)
            toks.append(int(top.indices[0]))
            gaps.append(float(top.values[0] - top.values[1]))
            seq.append(toks[-1])
    return toks, gaps


def hf_layer0(model, ids, device):
    import torch
    with torch.no_grad():
        out = model(torch.tensor([ids], device=device), output_hidden_states=True)
        return out.hidden_states[1][0].float().cpu().numpy()


# =============================================================================================
# dflash side

def ours(dflash, gguf_path, ids, n, tmp, threads):
    logits_path = Path(tmp) / "logits.bin"
    cmd = [dflash, "run", "-m", gguf_path, "--tokens", ",".join(map(str, ids)), "-n", str(n), "--json",
           "--dump-logits", logits_path]
    if threads:
        cmd += ["-t", str(threads)]
    r = run_cmd(cmd)
    j = json.loads(r.stdout)
    logits = np.fromfile(logits_path, dtype=np.float32)
    return j["tokens"], logits.reshape(len(ids), -1)


def rel_err(a, b):
    """max over positions of max_v |a - b| / max_v |b| (the stricter per-position form)."""
    num = np.abs(a.astype(np.float64) - b.astype(np.float64)).max(axis=-1)
    den = np.maximum(np.abs(b.astype(np.float64)).max(axis=-1), 1e-30)
    return float((num / den).max())


# =============================================================================================
# GGUF -> HF state dict (the inverse of convert.cpp), for the ternary comparison and round trips

def hadamard(block):
    idx = np.arange(block)
    x = idx[:, None] & idx[None, :]
    pc = np.zeros_like(x)
    for k in range(int(block).bit_length()):
        pc += (x >> k) & 1
    return (1 - 2 * (pc & 1)).astype(np.float64) / math.sqrt(block)


def unrotate(w, signs, block):
    """w_stored rows = H_blk(s (.) w)  =>  w = s (.) H_blk(w_stored)  (H symmetric, H H = I)."""
    rows, n = w.shape
    h = hadamard(block)
    x = (w.astype(np.float64).reshape(rows, n // block, block) @ h).reshape(rows, n)
    return x * signs[None, :]


def tiled_src(g, nk, nv):
    return (g % nk) * (nv // nk) + g // nk


def gguf_to_state(dump, cfg, arch, ssm_out_perm=True):
    """Rebuilds the HF state dict from our GGUF. ssm_out_perm: read a prism-rotated ssm_out with the
    runtime's tiled -> grouped input permutation (gdn_v_grouped); False reads its columns as tiled."""
    import torch
    kv = dump.g.kv
    hybrid = arch == "qwen35"
    prism = "prism.hadamard.version" in kv
    rotated, signs, block = set(), {}, 0
    if prism:
        block = kv["prism.hadamard.block_size"]
        rotated = set(kv["prism.hadamard.weight_names"]) | set(kv["prism.hadamard.inverse_weight_names"])
        vals = np.array(kv["prism.hadamard.sign_values"], dtype=np.float64)
        at = 0
        for w in kv["prism.hadamard.sign_widths"]:
            signs[w] = vals[at:at + w]
            at += w

    def get(name):
        a = dump(name).astype(np.float64)
        if name in rotated:
            a = unrotate(a.reshape(-1, a.shape[-1]), signs[a.shape[-1]], block).reshape(a.shape)
        return a

    nb = (lambda a: a - 1.0) if hybrid else (lambda a: a)
    sd = {}
    sd["model.embed_tokens.weight"] = get("token_embd.weight")
    sd["model.norm.weight"] = nb(get("output_norm.weight"))
    if "output.weight" in dump.g.tensors:
        sd["lm_head.weight"] = get("output.weight")
    elif getattr(cfg, "tie_word_embeddings", False):
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    for il in range(cfg.num_hidden_layers):
        b, h = f"blk.{il}.", f"model.layers.{il}."
        sd[h + "input_layernorm.weight"] = nb(get(b + "attn_norm.weight"))
        sd[h + "post_attention_layernorm.weight"] = nb(get(b + ("post_attention_norm.weight" if hybrid else "ffn_norm.weight")))
        sd[h + "mlp.gate_proj.weight"] = get(b + "ffn_gate.weight")
        sd[h + "mlp.up_proj.weight"] = get(b + "ffn_up.weight")
        sd[h + "mlp.down_proj.weight"] = get(b + "ffn_down.weight")
        attn = (not hybrid) or cfg.layer_types[il] == "full_attention"
        if attn:
            a = h + "self_attn."
            sd[a + "q_proj.weight"] = get(b + "attn_q.weight")
            sd[a + "k_proj.weight"] = get(b + "attn_k.weight")
            sd[a + "v_proj.weight"] = get(b + "attn_v.weight")
            sd[a + "o_proj.weight"] = get(b + "attn_output.weight")
            sd[a + "q_norm.weight"] = nb(get(b + "attn_q_norm.weight"))
            sd[a + "k_norm.weight"] = nb(get(b + "attn_k_norm.weight"))
            continue
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dv, kd = cfg.linear_value_head_dim, cfg.linear_num_key_heads * cfg.linear_key_head_dim
        # HF V row/channel for each GGUF (tiled) one
        vmap = np.array([tiled_src(g, nk, nv) * dv + d for g in range(nv) for d in range(dv)])
        heads = np.array([tiled_src(g, nk, nv) for g in range(nv)])
        chan = np.concatenate([np.arange(2 * kd), 2 * kd + vmap])

        def untile_rows(a, m):
            out = np.empty_like(a)
            out[m] = a
            return out

        l = h + "linear_attn."
        sd[l + "in_proj_qkv.weight"] = untile_rows(get(b + "attn_qkv.weight"), chan)
        sd[l + "in_proj_z.weight"] = untile_rows(get(b + "attn_gate.weight"), vmap)
        sd[l + "in_proj_a.weight"] = untile_rows(get(b + "ssm_alpha.weight"), heads)
        sd[l + "in_proj_b.weight"] = untile_rows(get(b + "ssm_beta.weight"), heads)
        sd[l + "dt_bias"] = untile_rows(get(b + "ssm_dt.bias"), heads)
        sd[l + "A_log"] = untile_rows(np.log(-get(b + "ssm_a")), heads)
        conv = untile_rows(get(b + "ssm_conv1d.weight"), chan)  # [C, K]
        sd[l + "conv1d.weight"] = conv[:, None, :]
        sd[l + "norm.weight"] = get(b + "ssm_norm.weight")
        out = get(b + "ssm_out.weight")  # [E, inner]
        grouped = (b + "ssm_out.weight") in rotated and kv.get("prism.hadamard.gdn_v_grouped", False) and ssm_out_perm
        if not grouped:  # columns in tiled order
            o2 = np.empty_like(out)
            o2[:, vmap] = out
            out = o2
        sd[l + "out_proj.weight"] = out
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in sd.items()}


def load_state(model_cls, cfg, sd, device):
    import torch
    m = model_cls(cfg).eval()
    missing, unexpected = m.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if getattr(cfg, "tie_word_embeddings", False):
        m.tie_weights()
    return m.to(device)


# =============================================================================================
# Cases

VARIANTS = [
    # name, convert args, compare against, tolerance
    ("f32", ["--type", "f32"], "hf", TOL_FLOAT),
    ("f32-prism", ["--type", "f32", "--prism", "--seed", "7"], "hf", TOL_FLOAT),
    ("ptq1_0-prism", ["--type", "ptq1_0", "--prism", "--seed", "7"], "dequant", TOL_TERNARY),
    ("pq2_0-prism", ["--type", "pq2_0", "--prism", "--seed", "7"], "dequant", TOL_TERNARY),
]


HF_CACHE = {}


def check_case(args, name, model, hf_dir, variant, prompts, device, work):
    import torch
    vname, conv_args, against, tol = variant
    res = {"model": name, "variant": vname, "tolerance": tol, "against": against}
    gg = work / f"{name}-{vname}.gguf"
    t0 = time.time()
    r = run_cmd([args.dflash, "convert", hf_dir, gg, "-q"] + conv_args)
    res["convert_seconds"] = round(time.time() - t0, 2)
    res["convert_output"] = r.stdout.strip()
    dump = Dumper(args.dflash, gg, work / "dump")
    arch = dump.g.kv["general.architecture"]
    ref = model
    if against == "dequant":
        ref = load_state(type(model), model.config, gguf_to_state(dump, model.config, arch), device)
    # The rotary width the converter wrote is the one HF uses.
    rot = dump.g.kv.get(f"{arch}.rope.dimension_count")
    hf_rot = 2 * model.model.rotary_emb.inv_freq.numel()
    res["rope_dims"] = {"gguf": rot, "hf": hf_rot}
    per_prompt = []
    ok = rot == hf_rot
    for pi, ids in enumerate(prompts):
        toks, logits = ours(args.dflash, gg, ids, args.gen, work, args.threads)
        key = (name, pi)
        if against == "hf" and key in HF_CACHE:  # the original model's answers are shared by the float variants
            ref_logits, ref_toks, gaps = HF_CACHE[key]
        else:
            ref_logits = hf_logits(ref, ids, device)
            ref_toks, gaps = hf_greedy(ref, ids, args.gen, device)
            if against == "hf":
                HF_CACHE[key] = (ref_logits, ref_toks, gaps)
        err = rel_err(logits, ref_logits)
        first = next((i for i, (a, b) in enumerate(zip(toks, ref_toks)) if a != b), None)
        if first is None and len(toks) != len(ref_toks):
            first = min(len(toks), len(ref_toks))
        same = first is None
        p = {"prompt": pi, "max_rel_logit_err": err, "greedy_identical": same, "first_mismatch": first,
             "min_top2_gap": min(gaps), "ours_tokens": toks[:16], "hf_tokens": ref_toks[:16]}
        if not same and first < len(gaps):
            p["top2_gap_at_mismatch"] = gaps[first]
        per_prompt.append(p)
        ok = ok and err <= tol and same
    res["prompts"] = per_prompt
    res["max_rel_logit_err"] = max(p["max_rel_logit_err"] for p in per_prompt)
    res["greedy_identical"] = all(p["greedy_identical"] for p in per_prompt)
    res["pass"] = bool(ok)
    del ref
    torch.cuda.empty_cache() if device != "cpu" else None
    return res, gg


def roundtrip(args, name, model, gg, work):
    """GGUF -> HF state dict == the original weights (the converter's mapping, no runtime involved)."""
    dump = Dumper(args.dflash, gg, work / "dump")
    sd = gguf_to_state(dump, model.config, dump.g.kv["general.architecture"])
    orig = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    worst, worst_name = 0.0, None
    for k, v in sd.items():
        if k not in orig:
            raise RuntimeError(f"round trip: {k} is not an HF parameter")
        d = float((v - orig[k]).abs().max() / max(float(orig[k].abs().max()), 1e-30))
        if d > worst:
            worst, worst_name = d, k
    missing = [k for k in orig if k not in sd and not k.endswith("inv_freq")]
    return {"file": gg.name, "max_rel_weight_err": worst, "worst_tensor": worst_name, "missing": missing,
            "pass": worst < 1e-5 and not missing}


def ssm_out_question(args, model, gg_list, ids, device, work):
    """SPEC 3: is a prism-rotated ssm_out's input permuted tiled -> grouped (gdn_v_grouped) or not?
    Rebuild the model from the prism GGUF both ways and compare layer 0 (a Gated DeltaNet layer) with
    the original model's layer 0."""
    ref = hf_layer0(model, ids, device)
    out = {}
    for gg in gg_list:
        dump = Dumper(args.dflash, gg, work / "dump")
        arch = dump.g.kv["general.architecture"]
        r = {}
        for perm in (True, False):
            m = load_state(type(model), model.config, gguf_to_state(dump, model.config, arch, ssm_out_perm=perm),
                           device)
            h = hf_layer0(m, ids, device)
            r["with_permutation" if perm else "without_permutation"] = float(
                np.abs(h - ref).max() / np.abs(ref).max())
            del m
        r["matches"] = "with_permutation" if r["with_permutation"] < r["without_permutation"] else "without_permutation"
        out[gg.name] = r
    return out


def tokenizer_check(args, model, hf_dir, work):
    """A checkpoint with a real `tokenizers` BPE (trained here, qwen2 split): convert, then compare
    `dflash tokenize` with the HF tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    corpus = [("The quick brown fox jumps over the lazy dog. " * 3 + f"Line {i}: it's {i * 37} o'clock, "
               "naïve café déjà vu — Grüße! def f(x):\n    return x ** 2\n") for i in range(400)]
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens(["<think>", "</think>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    d = work / "qwen3-tok"
    if d.exists():
        shutil.rmtree(d)
    shutil.copytree(hf_dir, d)
    fast.save_pretrained(d)
    gg = work / "qwen3-tok.gguf"
    run_cmd([args.dflash, "convert", d, gg, "-q"])
    g = GGUF(gg)
    texts = ["The quick brown fox, it's 12:30!", "naïve café — Grüße\n\n  def f(x):\n\treturn x**2",
             "<|im_start|>user\nhello<|im_end|>\n<think>ok</think>", "   spaces   and\r\nnewlines\n", "数字 12345 émoji 🙂"]
    res = {"tokens": len(g.kv["tokenizer.ggml.tokens"]), "merges": len(g.kv["tokenizer.ggml.merges"]),
           "pre": g.kv.get("tokenizer.ggml.pre"), "eos": g.kv.get("tokenizer.ggml.eos_token_id"),
           "has_chat_template": "tokenizer.chat_template" in g.kv, "cases": []}
    ok = res["pre"] == "qwen2" and res["eos"] == fast.convert_tokens_to_ids("<|im_end|>") and res["has_chat_template"]
    for t in texts:
        want = fast(t, add_special_tokens=False)["input_ids"]
        r = run_cmd([args.dflash, "tokenize", "-m", gg, "--json", t])
        got = json.loads(r.stdout)["ids"]
        res["cases"].append({"text": t, "identical": got == want, "ours": got[:24], "hf": want[:24]})
        ok = ok and got == want
    res["pass"] = bool(ok)
    return res


# =============================================================================================

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dflash", required=True, help="path of the dflash binary")
    ap.add_argument("--out", default="oracle_transformers.json", help="JSON result file")
    ap.add_argument("--work", default=None, help="work folder (default: next to --out)")
    ap.add_argument("--device", default="auto", help="cuda, cpu or auto")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--prompts", type=int, default=3, help="64-token prompts per case")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen", type=int, default=64, help="greedy tokens compared")
    ap.add_argument("--threads", type=int, default=0, help="dflash CPU threads (0 = all)")
    ap.add_argument("--only", default=None, help="comma-separated variant names to run (default: all)")
    args = ap.parse_args()

    out_path = Path(args.out).resolve()
    work = Path(args.work).resolve() if args.work else out_path.parent / "oracle_transformers_work"
    work.mkdir(parents=True, exist_ok=True)
    args.dflash = str(Path(args.dflash).resolve())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    result = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "pass": False, "cases": [], "errors": []}

    def save():
        out_path.write_text(json.dumps(result, indent=2))

    try:
        import torch
        import transformers
        device = args.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        # fp32 reference: no TF32 anywhere.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        result["versions"] = {"python": sys.version.split()[0], "torch": torch.__version__,
                              "transformers": transformers.__version__, "device": device,
                              "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None}
        log(f"torch {torch.__version__}, transformers {transformers.__version__}, device {device}")
        run_cmd([args.dflash, "--version"])

        models = build_models(args.seed)
        rng = np.random.default_rng(args.seed)
        hf_dirs = {}
        for name, model in models.items():
            d = work / f"hf-{name}"
            if d.exists():
                shutil.rmtree(d)
            # the hybrid sharded (index + several files), the dense one as a single file
            model.save_pretrained(d, max_shard_size="2MB" if name == "qwen35" else "1GB")
            hf_dirs[name] = d
            model.to(device)
            log(f"built {name}: {sum(p.numel() for p in model.parameters())} parameters -> {d}")
        vocab = models["qwen35"].config.vocab_size
        prompts = [rng.integers(0, vocab, size=args.prompt_len).tolist() for _ in range(args.prompts)]
        result["prompts"] = prompts

        only = set(args.only.split(",")) if args.only else None
        ggufs = {}
        for name, model in models.items():
            for variant in VARIANTS:
                if only and variant[0] not in only:
                    continue
                tag = f"{name}/{variant[0]}"
                try:
                    res, gg = check_case(args, name, model, hf_dirs[name], variant, prompts, device, work)
                    ggufs[(name, variant[0])] = gg
                except Exception as e:  # one broken case must not hide the others
                    res = {"model": name, "variant": variant[0], "pass": False, "error": str(e)[-3000:]}
                    traceback.print_exc()
                result["cases"].append(res)
                log(f"{tag}: {'PASS' if res['pass'] else 'FAIL'}"
                    + (f"  max rel logit err {res['max_rel_logit_err']:.2e} (tol {res['tolerance']:.0e}),"
                       f" greedy identical: {res['greedy_identical']}" if "max_rel_logit_err" in res else
                       f"  {res.get('error', '')[:300]}"))
                save()

        result["roundtrip"] = []
        for (name, vname), gg in ggufs.items():
            if vname in ("f32", "f32-prism"):
                try:
                    r = roundtrip(args, name, models[name], gg, work)
                except Exception as e:
                    r = {"file": gg.name, "pass": False, "error": str(e)[-3000:]}
                result["roundtrip"].append(r)
                log(f"round trip {gg.name}: {'PASS' if r['pass'] else 'FAIL'} "
                    f"{r.get('max_rel_weight_err', r.get('error'))}")
        save()

        prism35 = [gg for (n, v), gg in ggufs.items() if n == "qwen35" and "prism" in v]
        if prism35:
            try:
                q = ssm_out_question(args, models["qwen35"], prism35, prompts[0], device, work)
                f32 = q.get("qwen35-f32-prism.gguf")
                # The float file decides (a ternary file's quantization error blurs the contrast).
                q["verdict"] = f32["matches"] if f32 else None
                q["pass"] = q["verdict"] in (None, "with_permutation")
            except Exception as e:
                q = {"pass": False, "error": str(e)[-3000:]}
                traceback.print_exc()
            result["ssm_out_permutation"] = q
            log(f"ssm_out permutation (layer 0): {json.dumps(q)}")
            save()

        try:
            result["tokenizer"] = tokenizer_check(args, models["qwen3"], hf_dirs["qwen3"], work)
        except ImportError as e:
            result["tokenizer"] = {"skipped": str(e), "pass": True}
        except Exception as e:
            result["tokenizer"] = {"pass": False, "error": str(e)[-3000:]}
            traceback.print_exc()
        log(f"tokenizer: {'PASS' if result['tokenizer']['pass'] else 'FAIL'}")

        checks = [c["pass"] for c in result["cases"]] + [r["pass"] for r in result["roundtrip"]]
        checks.append(result["tokenizer"]["pass"])
        if "ssm_out_permutation" in result:
            checks.append(result["ssm_out_permutation"]["pass"])
        result["pass"] = bool(checks) and all(checks)
    except Exception as e:
        result["errors"].append(traceback.format_exc()[-4000:])
        traceback.print_exc()
    result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    save()

    print("\n=== oracle_transformers summary ===")
    for c in result["cases"]:
        if "max_rel_logit_err" in c:
            print(f"  {c['model']:7s} {c['variant']:13s} {'PASS' if c['pass'] else 'FAIL'}  "
                  f"max rel logit err {c['max_rel_logit_err']:.2e} (tol {c['tolerance']:.0e}), "
                  f"greedy {args.gen} identical: {c['greedy_identical']}")
        else:
            print(f"  {c['model']:7s} {c['variant']:13s} FAIL  {c.get('error', '')[:200]}")
    for r in result.get("roundtrip", []):
        print(f"  round trip {r['file']}: {'PASS' if r['pass'] else 'FAIL'} "
              f"(max rel weight err {r.get('max_rel_weight_err', 'n/a')})")
    if "ssm_out_permutation" in result:
        print(f"  ssm_out permutation: {json.dumps(result['ssm_out_permutation'])}")
    if "tokenizer" in result:
        print(f"  tokenizer: {'PASS' if result['tokenizer']['pass'] else 'FAIL'}")
    for e in result["errors"]:
        print(f"  ERROR: {e[-500:]}")
    print(f"  overall: {'PASS' if result['pass'] else 'FAIL'}  -> {out_path}")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
