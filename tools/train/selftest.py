"""CPU self-tests of the training code against itself and against the dflash binary.

    python3 tools/train/selftest.py --dflash build-xxx/dflash

1. chunked delta rule == recurrent delta rule;  full forward == incremental (cached) forward;
2. a tiny random ternary qwen35 exported with export_target.py: `dflash dump` of every tensor type
   equals our dequantizer; `dflash run --tokens` greedy output == this torch model's greedy output;
3. Q4_K / Q6_K quantizers: `dflash dump` equals our dequantizer, and the error is small.
Exits non-zero on any failure.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf_io as G  # noqa: E402
from model import Target, TargetConfig, gdn_chunked, gdn_recurrent  # noqa: E402
from export_target import export  # noqa: E402
from tokenizer_util import byte_tokenizer  # noqa: E402

FAIL = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        FAIL.append(what)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def test_delta_rule():
    torch.manual_seed(0)
    B, H, T, dk, dv = 2, 3, 150, 16, 8
    q = torch.nn.functional.normalize(torch.randn(B, H, T, dk), dim=-1) / 4
    k = torch.nn.functional.normalize(torch.randn(B, H, T, dk), dim=-1)
    v = torch.randn(B, H, T, dv)
    g = -torch.rand(B, H, T) * 0.5
    beta = torch.rand(B, H, T)
    S0 = torch.randn(B, H, dk, dv) * 0.1
    o1, s1 = gdn_recurrent(q.double(), k.double(), v.double(), g.double(), beta.double(), S0.double())
    o2, s2 = gdn_chunked(q, k, v, g, beta, S0, chunk=32)
    check(rel(o2, o1) < 1e-4 and rel(s2, s1) < 1e-4, f"chunked == recurrent delta rule ({rel(o2, o1):.2e}, {rel(s2, s1):.2e})")


def tiny_cfg(vocab):
    return TargetConfig(n_vocab=vocab, n_embd=256, n_layer=4, n_ff=512, n_head=2, n_head_kv=1, head_dim=128, n_rot=32,
                        ssm_k_heads=2, ssm_v_heads=4, ssm_head_k=32, ssm_head_v=64, prism_block=256, seed=7)


def scramble(m):
    """Random, larger-than-init weights so every part of the forward matters."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name == "tok_embd":
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / p.shape[1] ** 0.5))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


@torch.no_grad()
def greedy(m, prompt, n):
    st = m.new_state()
    ids = torch.tensor([prompt])
    logits, _ = m(ids, state=st, last_only=True)
    out = []
    pos = len(prompt)
    for _ in range(n):
        t = int(logits[0, -1].argmax())
        out.append(t)
        logits, _ = m(torch.tensor([[t]]), state=st, pos0=pos, last_only=True)
        pos += 1
    return out


def test_target(dflash, work):
    tok = byte_tokenizer()
    m = Target(tiny_cfg(len(tok["tokens"])))
    scramble(m)
    m.eval()
    m.freeze()
    ids = torch.randint(0, 256, (2, 70))
    with torch.no_grad():
        full, taps = m(ids, taps=(0, 2, 4))
        st = m.new_state()
        a, _ = m(ids[:, :37], state=st)
        b, _ = m(ids[:, 37:40], state=st, pos0=37)
        c_, _ = m(ids[:, 40:], state=st, pos0=40)
        inc = torch.cat([a, b, c_], 1)
    check(rel(inc, full) < 1e-4, f"incremental forward == full forward ({rel(inc, full):.2e})")
    check(taps.shape == (2, 70, 3 * 256), "taps shape")

    path = os.path.join(work, "tiny.gguf")
    export(m, tok, path)
    r = G.GGUFReader(path)
    # our reader's dequantized tensors vs dflash dump
    for name in ("token_embd.weight", "blk.0.ssm_alpha.weight", "blk.0.ssm_conv1d.weight", "blk.3.attn_q.weight"):
        out = os.path.join(work, "dump.bin")
        subprocess.run([dflash, "dump", path, "--tensor", name, "--out", out], check=True, capture_output=True)
        ref = np.fromfile(out, np.float32)
        ours = r.f32(name).reshape(-1)
        check(ref.size == ours.size and np.array_equal(ref, ours), f"dflash dump == our dequantizer: {name}")
    # the exported ternary weights are exactly the training forward's T(W)
    from model import ternarize
    check(np.array_equal(r.f32("blk.0.ffn_up.weight"), ternarize(m.layers[0].ffn_up).detach().numpy()),
          "exported PTQ1_0 == training forward's ternary weights")

    prompt = [int(t) for t in torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(5))]
    ours = greedy(m, prompt, 24)
    res = subprocess.run([dflash, "run", "-m", path, "--tokens", ",".join(map(str, prompt)), "-n", "24", "--json",
                          "-t", "2"], check=True, capture_output=True, text=True)
    theirs = json.loads(res.stdout)["tokens"]
    check(theirs == ours[:len(theirs)] and len(theirs) > 0, f"dflash greedy == torch greedy\n  dflash {theirs}\n  torch  {ours}")
    # the GGUF loaded back into torch computes the same logits
    from export_target import load_target_gguf
    m2, _ = load_target_gguf(path)
    m2.eval()
    with torch.no_grad():
        back, _ = m2(ids)
    check(rel(back, full) < 1e-5, f"load_target_gguf(export(m)) == m ({rel(back, full):.2e})")
    # no tokenizer -> no stop token: a longer greedy comparison
    path3 = os.path.join(work, "tiny-notok.gguf")
    export(m, None, path3)
    prompt2 = prompt[:5]
    ours2 = greedy(m, prompt2, 48)
    res3 = subprocess.run([dflash, "run", "-m", path3, "--tokens", ",".join(map(str, prompt2)), "-n", "48", "--json",
                           "-t", "2"], check=True, capture_output=True, text=True)
    check(json.loads(res3.stdout)["tokens"] == ours2, "dflash greedy == torch greedy, 48 tokens without a tokenizer")
    # PQ2_0 file: same function
    path2 = os.path.join(work, "tiny-pq2.gguf")
    export(m, tok, path2, G.PQ2_0)
    res2 = subprocess.run([dflash, "run", "-m", path2, "--tokens", ",".join(map(str, prompt)), "-n", "24", "--json",
                           "-t", "2"], check=True, capture_output=True, text=True)
    check(json.loads(res2.stdout)["tokens"] == theirs, "PQ2_0 export: same greedy tokens as PTQ1_0")


def test_drafter(probe, work):
    """A random (scrambled) drafter for the tiny target: the engine's draft trace == our forward."""
    from drafter import Drafter, DrafterConfig, export_drafter, load_drafter_gguf
    from export_target import load_target_gguf
    tpath = os.path.join(work, "tiny.gguf")
    target, tok = load_target_gguf(tpath)
    target.eval()
    target.freeze()
    dc = DrafterConfig(n_embd=256, n_vocab=target.cfg.n_vocab, n_layer=2, n_head=4, n_head_kv=2, head_dim=64,
                       n_ff=512, taps=[3, 1, 2, 0, 2], mask_token=tok["mask"], rank=256, window=20)
    dr = Drafter(dc)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in dr.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif "conv_base" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            elif name in ("pred", "succ"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1] ** 0.5))
    dpath = os.path.join(work, "tiny-drafter.gguf")
    export_drafter(dr, dpath)
    dq = load_drafter_gguf(dpath)
    ids = [int(t) for t in torch.randint(0, 256, (40,), generator=g)]
    P = 33  # > window: the sliding window masks the oldest context rows
    out = os.path.join(work, "probe")
    subprocess.run([probe, tpath, dpath, ",".join(map(str, ids)), str(P), out], check=True)
    hid = np.fromfile(out + ".hidden", np.float32).reshape(8, -1)
    lg = np.fromfile(out + ".logits", np.float32).reshape(7, -1)
    toks = np.fromfile(out + ".tokens", np.int32).tolist()
    with torch.no_grad():
        _, taps = target(torch.tensor([ids[:P]]), taps=tuple(dc.taps), logits=False)
        blk = torch.full((1, 1, 8), dc.mask_token)
        blk[0, 0, 0] = ids[P]
        h = dq(target, taps, blk, torch.tensor([[P]]))[0, 0]
        logits = target.lm_head(h[1:])
        drafts = dq.walk(h[None, 1:], logits[None], torch.tensor([ids[P]]))[0].tolist()
    check(rel(hid, h.numpy()) < 1e-4, f"drafter hidden: engine == torch ({rel(hid, h.numpy()):.2e})")
    check(rel(lg, logits.numpy()) < 1e-4, f"drafter logits: engine == torch ({rel(lg, logits.numpy()):.2e})")
    check(toks == drafts, f"drafter tokens: engine {toks} torch {drafts}")


def test_kquants(dflash, work):
    rng = np.random.default_rng(1)
    w = G.GGUFWriter()
    w.string("general.architecture", "dflash")
    mats = {}
    for t, name in ((G.Q4_K, "a.weight"), (G.Q6_K, "b.weight")):
        x = (rng.standard_normal((6, 512)) * rng.uniform(0.01, 3, (6, 1))).astype(np.float32)
        mats[name] = (t, x)
        w.tensor(name, t, [512, 6], G.quantize(t, x))
    path = os.path.join(work, "k.gguf")
    w.write(path)
    r = G.GGUFReader(path)
    for name, (t, x) in mats.items():
        out = os.path.join(work, "dump.bin")
        subprocess.run([dflash, "dump", path, "--tensor", name, "--out", out], check=True, capture_output=True)
        ref = np.fromfile(out, np.float32)
        ours = r.f32(name).reshape(-1)
        check(np.array_equal(ref, ours), f"dflash dump == our dequantizer: type {t}")
        check(rel(ours, x.reshape(-1)) < (0.1 if t == G.Q4_K else 0.03), f"type {t} error {rel(ours, x.reshape(-1)):.4f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--dflash", required=True)
    ap.add_argument("--probe", help="drafter_probe binary (tools/train/probe/build.sh)")
    a = ap.parse_args()
    test_delta_rule()
    with tempfile.TemporaryDirectory() as work:
        test_target(a.dflash, work)
        test_kquants(a.dflash, work)
        if a.probe:
            test_drafter(a.probe, work)
    print(f"{len(FAIL)} failed")
    sys.exit(1 if FAIL else 0)
