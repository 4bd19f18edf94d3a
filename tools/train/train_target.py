"""Trains the ternary-aware qwen35 target on WORK/train.bin for a fixed wall-clock budget, evaluates it on
WORK/heldout.bin, exports the GGUF.

    python3 tools/train/train_target.py --work WORK --out OUTDIR --seconds 200 [--tiny]

The learning-rate schedule runs on elapsed time (warm-up over the first 3 %, cosine to 10 % at the end),
so a run fills its budget whatever the throughput. Writes OUTDIR/target.gguf (PTQ1_0),
OUTDIR/target_eval.json and the log; WORK/target.pt (the latent fp32 checkpoint).
"""
import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf_io as G  # noqa: E402
from model import Target, TargetConfig, param_groups  # noqa: E402
from export_target import export  # noqa: E402


def log(msg, fh=None):
    line = f"[target {time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if fh:
        fh.write(line + "\n")
        fh.flush()


@torch.no_grad()
def evaluate(model, data, T, max_tokens, batch, device, autocast):
    """Mean NLL (nats/token) over non-overlapping windows of T+1 tokens (first max_tokens tokens)."""
    n = min(len(data) - 1, max_tokens)
    nw = n // T
    tot, cnt = 0.0, 0
    model.eval()
    for i in range(0, nw, batch):
        idx = torch.arange(i, min(i + batch, nw))
        x = torch.stack([data[j * T:j * T + T] for j in idx.tolist()]).to(device).long()
        y = torch.stack([data[j * T + 1:j * T + T + 1] for j in idx.tolist()]).to(device).long()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits, _ = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                 reduction="sum")
        tot += float(loss)
        cnt += y.numel()
    model.train()
    return tot / max(cnt, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=200)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--eval-tokens", type=int, default=400_000)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke-test sizes")
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    fh = open(os.path.join(a.out, "target_train.log"), "w")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    tok = json.load(open(os.path.join(a.work, "tok_gguf.json")))
    V = len(tok["tokens"])
    if a.tiny:
        cfg = TargetConfig(n_vocab=V, n_embd=256, n_layer=4, n_ff=512, n_head=2, n_head_kv=1, head_dim=128, n_rot=32,
                           ssm_k_heads=2, ssm_v_heads=4, ssm_head_k=32, ssm_head_v=64, prism_block=256)
    else:
        cfg = TargetConfig(n_vocab=V)
    torch.manual_seed(cfg.seed)
    model = Target(cfg).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    n_emb = model.tok_embd.numel() + model.output.numel()
    log(f"config {asdict(cfg)}", fh)
    log(f"params {n_params / 1e6:.2f} M ({(n_params - n_emb) / 1e6:.2f} M without embedding/output); device {dev}", fh)

    train = torch.from_numpy(np.fromfile(os.path.join(a.work, "train.bin"), np.uint16).astype(np.int32))
    held = torch.from_numpy(np.fromfile(os.path.join(a.work, "heldout.bin"), np.uint16).astype(np.int32))
    if cuda:
        train = train.to(dev)
    log(f"train tokens {train.numel()}, held-out tokens {held.numel()}", fh)

    opt = torch.optim.AdamW(param_groups(model, a.wd), lr=a.lr, betas=(0.9, 0.95), eps=1e-8,
                            **({"fused": True} if cuda else {}))
    fwd = torch.compile(model) if a.compile else model
    T, B = a.seq, a.batch
    gen = torch.Generator(device=train.device).manual_seed(1)
    t0 = time.time()
    step, tokens, ema = 0, 0, None
    while True:
        el = time.time() - t0
        if el >= a.seconds:
            break
        frac = el / a.seconds
        lr = a.lr * (frac / 0.03 if frac < 0.03 else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (frac - 0.03) / 0.97)))
        for g in opt.param_groups:
            g["lr"] = lr
        off = torch.randint(0, train.numel() - T - 1, (B,), device=train.device, generator=gen)
        ar = torch.arange(T + 1, device=train.device)
        chunk = train[off[:, None] + ar[None, :]].long().to(dev)
        x, y = chunk[:, :-1], chunk[:, 1:]
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            logits, _ = fwd(x)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, V), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += B * T
        if step % 25 == 0 or step == 1:
            lv = float(loss)
            ema = lv if ema is None else 0.9 * ema + 0.1 * lv
            log(f"step {step} t {el:.0f}s lr {lr:.2e} loss {lv:.4f} (ema {ema:.4f}) gnorm {float(gn):.2f} "
                f"tok/s {tokens / max(el, 1e-9):.0f}", fh)
    train_s = time.time() - t0
    log(f"trained {step} steps, {tokens} tokens in {train_s:.0f} s", fh)

    ev = {"steps": step, "tokens": tokens, "train_seconds": train_s, "params": n_params,
          "params_non_embedding": n_params - n_emb, "config": asdict(cfg)}
    et = a.eval_tokens if not a.tiny else 4096
    t1 = time.time()
    ev["heldout_nll_ternary_bf16"] = evaluate(model, held, T, et, 32, dev, cuda)
    ev["train_nll_ternary_bf16"] = evaluate(model, train.cpu()[-et * 2:], T, et // 4, 32, dev, cuda)
    model.cfg.ternary = False
    ev["heldout_nll_latent_float_bf16"] = evaluate(model, held, T, et, 32, dev, cuda)
    model.cfg.ternary = True
    for k in list(ev):
        if k.endswith("_bf16"):
            ev[k.replace("nll", "ppl")] = math.exp(ev[k])
    log(f"eval ({time.time() - t1:.0f} s): {json.dumps({k: v for k, v in ev.items() if 'pl' in k or 'nll' in k})}", fh)
    torch.save({"cfg": asdict(cfg), "model": model.state_dict()}, os.path.join(a.work, "target.pt"))
    export(model, tok, os.path.join(a.out, "target.gguf"), G.PTQ1_0, name="dflash tiny qwen35 (trained, ternary)")
    log(f"exported {os.path.getsize(os.path.join(a.out, 'target.gguf'))} bytes", fh)
    json.dump(ev, open(os.path.join(a.out, "target_eval.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
