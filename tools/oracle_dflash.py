#!/usr/bin/env python3
"""z-lab DFlash reference oracle for the drafter, the selector and the speculative loop (SPEC 9).

Runs on the GPU machine (Python 3.12, torch 2.11, transformers 5.17; no network). z-lab's public
reference code (github z-lab/dflash, dflash/model.py: DFlashDraftModel, DFlash2DraftModel,
dflash_generate) is NOT part of this project: put a copy in an ignored folder and point --zlab at it
(default .oracle/dflash, i.e. .oracle/dflash/dflash/model.py).

  1. builds a tiny random dense Qwen3 target (transformers Qwen3ForCausalLM; z-lab's loop crops its
     cache, which needs a dense target) and tiny random z-lab drafters: DFlash 2 (conv + selector) with
     the trained 2048 window, DFlash 2 with a 12-position window (so masking matters on short prompts),
     and DFlash v1; weights O(1)-scaled, the conv near its identity initialisation; saves them with
     save_pretrained;
  2. converts all of them with `dflash convert` (the drafter converter: taps +1, names, conv layout);
  3. one draft per prompt prefix: the reference drafter in float64 (target hidden states -> taps at
     hidden_states[id + 1] -> DFlash forward over [anchor, MASK x 7] -> the target's lm_head -> top-k +
     selector walk) against `dflash draft` (our trace): hidden states and logits (max relative error per
     row <= 1e-4), the top-k candidate sets, the selector path;
  4. whole generations: `dflash run -d` (speculative, block 8 and 4) and `dflash run --no-spec` against
     the HF target's own greedy decode (float64, recomputed without a cache) and z-lab's dflash_generate
     (block 8): identical tokens; acceptance lengths per cycle compared with z-lab's (informative: our
     drafter always runs its 8 trained rows, z-lab's narrows near the end; random drafters accept little).

transformers 5.17 notes (SPEC 9): DynamicCache.activate_past_recording is missing (a no-op stand-in is
installed); the drafter config is a Qwen3Config with use_sliding_window=True and layer_types
sliding_attention, or the window is dropped.

    python3 tools/oracle_dflash.py --dflash build/dflash --out oracle_dflash.json

The exit status is 0 only when every check passes.
"""

import argparse
import importlib.util
import inspect
import json
import math
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

TOL = 1e-4


def log(msg):
    print(f"[oracle-dflash] {msg}", flush=True)


def run_cmd(cmd, timeout=1800):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"command failed ({r.returncode}): {' '.join(map(str, cmd))}\n{r.stderr[-4000:]}")
    return r


def rel_rows(a, b):
    """max over rows of max |a - b| / max |b| (per-row relative error)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    num = np.abs(a - b).max(axis=-1)
    den = np.maximum(np.abs(b).max(axis=-1), 1e-30)
    return float((num / den).max())


# =============================================================================================
# z-lab reference

def load_zlab(root):
    path = Path(root) / "dflash" / "model.py"
    if not path.exists():
        raise SystemExit(f"z-lab reference not found at {path}: copy github z-lab/dflash's dflash/model.py "
                         f"(with DFlash2DraftModel) there (an ignored folder; never into the project)")
    from transformers import DynamicCache
    if not hasattr(DynamicCache, "activate_past_recording"):
        DynamicCache.activate_past_recording = lambda self: None  # missing in transformers 5.17 (SPEC 9)
    spec = importlib.util.spec_from_file_location("zlab_dflash_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# =============================================================================================
# Models

VOCAB, HIDDEN, FFN, TARGET_LAYERS = 2048, 256, 512, 6
MASK_TOKEN = VOCAB - 1


def qwen3_config(**kw):
    """A Qwen3Config; rope theta through rope_parameters when this transformers has them."""
    from transformers import Qwen3Config
    theta = kw.pop("rope_theta")
    params = inspect.signature(Qwen3Config.__init__).parameters
    if "rope_parameters" in params:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    else:
        kw["rope_theta"] = theta
    c = Qwen3Config(**kw)
    if not hasattr(c, "rope_parameters") or c.rope_parameters is None:
        c.rope_theta = theta
    return c


def build_target(seed):
    import torch
    from transformers import Qwen3ForCausalLM
    cfg = qwen3_config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=TARGET_LAYERS,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                       rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1000000.0, attention_bias=False,
                       bos_token_id=None, eos_token_id=None, attn_implementation="eager")
    torch.manual_seed(seed)
    m = Qwen3ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            r = torch.randn(tuple(p.shape), generator=g)
            if "norm" in name:
                v = 1.0 + 0.1 * r
            elif "embed_tokens" in name:
                v = r
            elif name.startswith("lm_head"):
                v = 4.0 * r / math.sqrt(p.shape[1])  # clear top-1: greedy paths are not near-ties
            else:
                v = r / math.sqrt(p.shape[1])
            p.copy_(v)
    return m


def build_drafter(zm, kind, window, seed):
    """kind: 'v2' (DFlash2DraftModel) or 'v1' (DFlashDraftModel). Taps: z-lab ids (layer outputs)."""
    import torch
    cfg = qwen3_config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                       rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000000.0, attention_bias=False,
                       use_sliding_window=True, sliding_window=window, max_window_layers=0,
                       layer_types=["sliding_attention"] * 2)
    cfg.sliding_window = window
    cfg.layer_types = ["sliding_attention"] * 2
    dc = {"block_size": 8, "target_layer_ids": [0, 2, 4], "mask_token_id": MASK_TOKEN}
    if kind == "v2":
        dc.update({"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 32, "selector_top_k": 16})
    cfg.dflash_config = dc
    cfg.is_causal = False
    cfg.block_size = 8
    cls = zm.DFlash2DraftModel if kind == "v2" else zm.DFlashDraftModel
    cfg.architectures = [cls.__name__]
    torch.manual_seed(seed)
    m = cls(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            shape = tuple(p.shape)
            r = torch.randn(shape, generator=g)
            if name.endswith("base_kernel"):  # [2 stages, K taps, H]: near identity (tap 0 ~ 1)
                v = 0.1 * r
                v[:, 0] += 1.0
            elif "kernel_projection" in name:
                v = 0.3 * r / math.sqrt(shape[1])
            elif "codebook" in name:
                v = r
            elif "norm" in name:
                v = 1.0 + 0.1 * r
            elif p.dim() == 2:
                v = r / math.sqrt(shape[1])
            else:
                raise RuntimeError(f"unexpected drafter parameter {name} {shape}")
            p.copy_(v)
    return m


# =============================================================================================
# Reference computations (float64)

def ref_draft(zm, draft, target, ids):
    import torch
    with torch.no_grad():
        out = target(torch.tensor([ids]), output_hidden_states=True)
        anchor = int(out.logits[0, -1].argmax())
        th = zm.extract_context_feature(out.hidden_states, draft.target_layer_ids)
        B = draft.block_size
        blk = torch.tensor([[anchor] + [draft.mask_token_id] * (B - 1)])
        noise = zm._raw_input_embeddings(target, blk)
        pos = torch.arange(len(ids) + B)[None]
        h = draft(target_hidden=th, noise_embedding=noise, position_ids=pos)
        hid = h[:, 1 - B:, :]
        head = zm._output_head(target)
        logits = draft.compute_logits(hid, head)
        cands = None
        if isinstance(draft, zm.DFlash2DraftModel):
            toks, cands, _ = draft.propose(hid, blk[:, 0], head, 0.0)
            cands = cands[0].numpy()
        else:
            toks = logits.argmax(-1)
    return anchor, h[0].numpy(), logits[0].numpy(), toks[0].tolist(), cands


def hf_greedy(model, ids, n):
    import torch
    seq, toks = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq])).logits[0, -1]
            toks.append(int(logits.argmax()))
            seq.append(toks[-1])
    return toks


# =============================================================================================
# Checks

def check_single_drafts(args, zm, name, draft, target, target_gguf, drafter_gguf, prompts, work):
    res = {"drafter": name, "cases": []}
    ok = True
    for pi, prompt in enumerate(prompts):
        for P in sorted({1, 5, 13, len(prompt) // 2, len(prompt)}):
            ids = prompt[:P]
            anchor, h, logits, toks, cands = ref_draft(zm, draft, target, ids)
            tr = work / "trace.json"
            cmd = [args.dflash, "draft", "-m", target_gguf, "-d", drafter_gguf, "--tokens", ",".join(map(str, ids)),
                   "-o", tr]
            if args.threads:
                cmd += ["-t", str(args.threads)]
            run_cmd(cmd)
            t = json.loads(tr.read_text())
            B, E, V = t["block"], t["n_embd"], t["n_vocab"]
            ours_h = np.array(t["hidden"]).reshape(B, E)
            ours_l = np.array(t["logits"]).reshape(B - 1, V)
            case = {"prompt": pi, "P": P, "anchor_ok": t["anchor"] == anchor,
                    "hidden_rel": rel_rows(ours_h, h), "logits_rel": rel_rows(ours_l, logits),
                    "tokens_ours": t["tokens"], "tokens_ref": toks}
            case["tokens_ok"] = t["tokens"] == toks
            good = case["anchor_ok"] and case["hidden_rel"] <= TOL and case["logits_rel"] <= TOL and case["tokens_ok"]
            if cands is not None:
                k = t["top_k"]
                ours_c = np.array(t["candidates"]).reshape(B - 1, k)
                case["candidates_ok"] = all(set(ours_c[r].tolist()) == set(cands[r].tolist()) for r in range(B - 1))
                good = good and case["candidates_ok"]
            case["ok"] = good
            ok = ok and good
            res["cases"].append(case)
            log(f"{name} prompt {pi} P={P}: hidden {case['hidden_rel']:.2e} logits {case['logits_rel']:.2e} "
                f"tokens {'ok' if case['tokens_ok'] else 'DIFFER'}{'' if good else '  <-- FAIL'}")
    res["ok"] = ok
    return res


def ours_run(args, target_gguf, drafter_gguf, ids, n, block, spec):
    cmd = [args.dflash, "run", "-m", target_gguf, "--tokens", ",".join(map(str, ids)), "-n", str(n), "--json"]
    if spec:
        cmd += ["-d", drafter_gguf, "--block", str(block)]
    else:
        cmd += ["--no-spec"]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    return json.loads(run_cmd(cmd).stdout)


def same_output(ours, want):
    """Our run may stop early at an end-of-generation token the converted file declares; HF's greedy
    reference does not stop: compare the prefix then."""
    toks = ours["tokens"]
    return toks == want or (ours.get("finish_reason") == "stop" and toks == want[:len(toks)])


def check_generations(args, zm, name, draft, target, target_gguf, drafter_gguf, prompts):
    import torch
    res = {"drafter": name, "cases": []}
    ok = True
    for pi, ids in enumerate(prompts):
        want = hf_greedy(target, ids, args.gen)
        plain_j = ours_run(args, target_gguf, drafter_gguf, ids, args.gen, 8, False)
        plain = plain_j["tokens"]
        case = {"prompt": pi, "plain_ok": same_output(plain_j, want)}
        zl_tokens = []
        try:
            zl = zm.dflash_generate(draft, target, torch.tensor([ids]), args.gen, None, 0.0, block_size=8,
                                    return_stats=True)
            zl_tokens = zl.output_ids[0, len(ids):].tolist()
            case["zlab_acceptance"] = list(map(int, zl.acceptance_lengths))
        except Exception as e:  # noqa: BLE001  (the reference loop itself failing is reported, not fatal)
            case["zlab_error"] = f"{type(e).__name__}: {e}"
            case["zlab_acceptance"] = []
            log(f"z-lab dflash_generate failed: {case['zlab_error']}")
        case["zlab_ok"] = zl_tokens == want
        for block in (8, 4):
            j = ours_run(args, target_gguf, drafter_gguf, ids, args.gen, block, True)
            sp = j.get("speculative", {})
            case[f"spec{block}_ok"] = same_output(j, want) and j["tokens"] == plain
            case[f"spec{block}_acceptance"] = [k + 1 for k in sp.get("accepted_per_cycle", [])]
        # acceptance lengths at block 8, all cycles but z-lab's narrowed tail
        a, b = case["spec8_acceptance"], case["zlab_acceptance"]
        n_cmp = max(0, min(len(a), len(b)) - 2)
        case["acceptance_agree"] = sum(int(x == y) for x, y in zip(a[:n_cmp], b[:n_cmp]))
        case["acceptance_compared"] = n_cmp
        good = case["plain_ok"] and case["zlab_ok"] and case["spec8_ok"] and case["spec4_ok"]
        if not good:
            first = lambda t: next((i for i, (x, y) in enumerate(zip(t, want)) if x != y), None)  # noqa: E731
            case["first_divergence"] = {"plain": first(plain), "zlab": first(zl_tokens)}
        case["ok"] = good
        ok = ok and good
        res["cases"].append(case)
        log(f"{name} generation {pi}: plain {case['plain_ok']} spec8 {case['spec8_ok']} spec4 {case['spec4_ok']} "
            f"zlab {case['zlab_ok']}; acceptance agrees on {case['acceptance_agree']}/{n_cmp} cycles "
            f"(ours tau {np.mean(a) if a else 0:.2f}, z-lab {np.mean(b) if b else 0:.2f})")
    res["ok"] = ok
    return res


# =============================================================================================

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dflash", default="build/dflash")
    ap.add_argument("--zlab", default=".oracle/dflash", help="folder holding z-lab's dflash/model.py")
    ap.add_argument("--out", default="oracle_dflash.json")
    ap.add_argument("--work", default=None, help="working folder (kept)")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--gen", type=int, default=48)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()

    import tempfile
    import torch
    torch.set_default_dtype(torch.float64)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="oracle_dflash_"))
    work.mkdir(parents=True, exist_ok=True)
    result = {"ok": False, "tolerance": TOL, "checks": []}
    t0 = time.time()
    try:
        import transformers
        result["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
        zm = load_zlab(args.zlab)
        target = build_target(args.seed).double().eval()
        tdir = work / "target_hf"
        target.float().save_pretrained(tdir)
        target.double()
        target_gguf = work / "target.gguf"
        run_cmd([args.dflash, "convert", tdir, target_gguf, "-q"])
        rng = np.random.default_rng(args.seed)
        prompts = [rng.integers(0, VOCAB - 1, size=args.prompt_len).tolist() for _ in range(args.prompts)]
        drafters = [("dflash2-w2048", "v2", 2048), ("dflash2-w12", "v2", 12), ("dflash1-w2048", "v1", 2048)]
        for i, (name, kind, window) in enumerate(drafters):
            draft = build_drafter(zm, kind, window, args.seed + 10 + i)
            ddir = work / f"{name}_hf"
            draft.float().save_pretrained(ddir)
            draft.double().eval()
            dgguf = work / f"{name}.gguf"
            conv = run_cmd([args.dflash, "convert", ddir, dgguf, "-q"])
            log(conv.stdout.strip())
            for check in (lambda: check_single_drafts(args, zm, name, draft, target, target_gguf, dgguf, prompts, work),
                          lambda: check_generations(args, zm, name, draft, target, target_gguf, dgguf, prompts)):
                try:
                    result["checks"].append(check())
                except Exception as e:  # noqa: BLE001
                    result["checks"].append({"drafter": name, "ok": False, "error": f"{type(e).__name__}: {e}",
                                             "traceback": traceback.format_exc()})
                    log(traceback.format_exc())
        result["ok"] = all(c["ok"] for c in result["checks"])
    except Exception as e:  # noqa: BLE001
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
        log(result["traceback"])
    result["seconds"] = round(time.time() - t0, 1)
    Path(args.out).write_text(json.dumps(result, indent=1))
    log(f"{'PASS' if result['ok'] else 'FAIL'} ({result['seconds']} s); details in {args.out}")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
