"""Drafter data + training + evaluation + export (SPEC 6).

    python3 tools/train/train_drafter.py --target OUT/target.gguf --prompts WORK/drafter_prompts.bin \
        --eval-prompts WORK/drafter_eval_prompts.bin --out OUT --seconds 150 [--tiny]

1. Data: the target's OWN greedy continuations (fp32, from the shipped GGUF loaded back into torch) of
   training-part prompts (uint16 [N, P] windows of train.bin), --gen-len tokens each.
2. Training: per sequence, the frozen target's taps (layer inputs dflash.target_layers) over prompt +
   continuation; random anchors in the continuation; block [anchor, MASK x 7]; row k predicts the token
   at anchor + k with weight exp(-(k-1)/gamma); + lambda * selector CE over the top-k candidates with the
   true predecessor (rows whose true token is not a candidate skipped). AdamW, warm-up 4 %, cosine, clip 1.
   The learning-rate schedule runs on elapsed time.
3. Evaluation on held-out prompts' continuations: per-position acceptance and the mean acceptance length
   tau = 1 + accepted prefix, over every anchor of the continuation (float drafter and Q4_K/Q6_K round trip).
4. Export OUT/drafter.gguf (Q4_K, attn_v/ffn_down Q6_K in layers 2 and 4).
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
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from drafter import Drafter, DrafterConfig, export_drafter, quantize_in_place, tap_layers  # noqa: E402
from export_target import load_target_gguf  # noqa: E402


def log(msg, fh=None):
    line = f"[drafter {time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if fh:
        fh.write(line + "\n")
        fh.flush()


@torch.no_grad()
def generate(target, prompts, gen_len, batch, eog):
    """Greedy continuations (fp32). prompts [N, P] long -> [N, P + gen_len], and valid lengths [N]
    (up to and including the first end-of-generation token of the continuation)."""
    outs = []
    for i in range(0, prompts.shape[0], batch):
        x = prompts[i:i + batch]
        st = target.new_state()
        logits, _ = target(x, state=st, last_only=True)
        toks = [logits[:, -1].argmax(-1)]
        pos = x.shape[1]
        for _ in range(gen_len - 1):
            logits, _ = target(toks[-1][:, None], state=st, pos0=pos, last_only=True)
            toks.append(logits[:, -1].argmax(-1))
            pos += 1
        outs.append(torch.cat([x, torch.stack(toks, 1)], 1))
    seqs = torch.cat(outs, 0)
    P = prompts.shape[1]
    gen = seqs[:, P:]
    is_eog = torch.zeros_like(gen, dtype=torch.bool)
    for e in eog:
        is_eog |= gen == e
    first = torch.where(is_eog.any(1), is_eog.float().argmax(1) + 1, torch.full_like(gen[:, 0], gen.shape[1]))
    return seqs, P + first


def block_batch(seqs, valid, P, A, R, mask_tok, gen):
    """Random anchors in the continuation: anchors [B, A], block ids [B, A, R], labels [B, A, R], label mask."""
    B, L = seqs.shape
    hi = (valid - 1).clamp(min=P + 1)  # anchor < valid - 1 so that row 1 has a label
    u = torch.rand(B, A, device=seqs.device, generator=gen)
    anchors = (P + (u * (hi - P)[:, None].float()).long()).clamp(max=L - 1)
    idx = anchors[..., None] + torch.arange(R, device=seqs.device)
    lab_ok = idx < valid[:, None, None]
    labels = seqs.gather(1, idx.clamp(max=L - 1).reshape(B, -1)).reshape(B, A, R)
    ids = torch.full_like(labels, mask_tok)
    ids[..., 0] = labels[..., 0]
    return anchors, ids, labels, lab_ok


def losses(dr, target, taps, seqs, valid, P, A, lam, gamma, gen):
    c = dr.cfg
    R = c.block
    anchors, ids, labels, ok = block_batch(seqs, valid, P, A, R, c.mask_token, gen)
    h = dr(target, taps, ids, anchors)  # [B, A, R, E]
    hr = h[:, :, 1:]
    logits = target.lm_head(hr).float()  # [B, A, R-1, V]
    lab = labels[:, :, 1:]
    okr = ok[:, :, 1:].float()
    wk = torch.exp(-(torch.arange(1, R, device=h.device).float() - 1) / gamma)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab.reshape(-1), reduction="none").reshape(lab.shape)
    wt = okr * wk
    block_loss = (ce * wt).sum() / wt.sum().clamp(min=1)
    # selector CE, teacher forcing (true predecessor)
    vals, cand = logits.detach().topk(c.top_k, -1)
    prev = labels[:, :, :-1]
    S = dr.selector_scores(hr, cand, vals, prev)
    hit = cand == lab[..., None]
    present = hit.any(-1) & ok[:, :, 1:]
    tgt = hit.float().argmax(-1)
    sel = F.cross_entropy(S[present], tgt[present]) if present.any() else S.sum() * 0
    acc = ((logits.argmax(-1) == lab).float() * okr).sum(dim=(0, 1)) / okr.sum(dim=(0, 1)).clamp(min=1)
    return block_loss + lam * sel, block_loss, sel, acc


@torch.no_grad()
def evaluate(dr, target, seqs, valid, P, batch, taps_ids):
    """Every anchor a in [P, valid-2]: drafts via the selector walk; accepted prefix vs the true greedy tokens."""
    c = dr.cfg
    R = c.block
    acc_len, pos_hits, pos_tot = [], torch.zeros(R - 1), torch.zeros(R - 1)
    for i in range(0, seqs.shape[0], batch):
        s, v = seqs[i:i + batch], valid[i:i + batch]
        B, L = s.shape
        _, taps = target(s, taps=taps_ids, logits=False)
        anchors = torch.arange(P, L - 1, device=s.device)[None].expand(B, -1)
        A = anchors.shape[1]
        idx = anchors[..., None] + torch.arange(R, device=s.device)
        labels = s.gather(1, idx.clamp(max=L - 1).reshape(B, -1)).reshape(B, A, R)
        ok = idx < v[:, None, None]
        ids = torch.full_like(labels, c.mask_token)
        ids[..., 0] = labels[..., 0]
        for a0 in range(0, A, 64):
            sl = slice(a0, min(A, a0 + 64))
            h = dr(target, taps, ids[:, sl], anchors[:, sl])
            hr = h[:, :, 1:]
            logits = target.lm_head(hr).float()
            nb, na = hr.shape[0], hr.shape[1]
            drafts = dr.walk(hr.reshape(nb * na, R - 1, -1), logits.reshape(nb * na, R - 1, -1),
                             labels[:, sl, 0].reshape(-1)).reshape(nb, na, R - 1)
            good = (drafts == labels[:, sl, 1:]) & ok[:, sl, 1:]
            row_ok = ok[:, sl, 1].reshape(-1)  # anchors with at least one label
            pref = good.long().cumprod(-1)
            acc_len.append((1 + pref.sum(-1)).reshape(-1)[row_ok].float().cpu())
            # per-position acceptance: P(draft p accepted | reached p)
            reach = torch.cat([torch.ones_like(pref[..., :1]), pref[..., :-1]], -1)
            m = reach.bool() & ok[:, sl, 1:]
            pos_hits += (good & m).sum(dim=(0, 1)).float().cpu()
            pos_tot += m.sum(dim=(0, 1)).float().cpu()
    al = torch.cat(acc_len)
    return {"tau": float(al.mean()), "anchors": int(al.numel()),
            "per_position_acceptance": (pos_hits / pos_tot.clamp(min=1)).tolist(),
            "tau_hist": torch.bincount(al.long(), minlength=R + 1).tolist()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--eval-prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--n-train", type=int, default=16384)
    ap.add_argument("--n-eval", type=int, default=256)
    ap.add_argument("--gen-batch", type=int, default=2048)
    ap.add_argument("--seconds", type=float, default=150)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--lam", type=float, default=0.5)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--ckpt", default="/tmp/drafter.pt", help="where the float drafter checkpoint goes")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    fh = open(os.path.join(a.out, "drafter_train.log"), "w")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    t_start = time.time()

    target, tok = load_target_gguf(a.target, dev)
    target.eval()
    for p_ in target.parameters():
        p_.requires_grad_(False)
    target.freeze()
    tc = target.cfg
    taps_ids = tuple(tap_layers(tc.n_layer))
    eog = [i for i, t in enumerate(tok["tokens"]) if t in ("<|endoftext|>", "<|im_end|>")]
    P = a.prompt_len
    pr = np.fromfile(a.prompts, np.uint16).reshape(-1, P)[:a.n_train]
    pe = np.fromfile(a.eval_prompts, np.uint16).reshape(-1, P)[:a.n_eval]
    log(f"target {tc.n_layer} layers, vocab {tc.n_vocab}; taps {taps_ids}; prompts {pr.shape}, eval {pe.shape}", fh)

    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # greedy data in full fp32, like dflash on the CPU
    t0 = time.time()
    seqs, valid = generate(target, torch.from_numpy(pr.astype(np.int64)).to(dev), a.gen_len, a.gen_batch, eog)
    eseqs, evalid = generate(target, torch.from_numpy(pe.astype(np.int64)).to(dev), a.gen_len, a.gen_batch, eog)
    log(f"generated {seqs.shape} + eval {eseqs.shape} in {time.time() - t0:.1f} s; mean valid continuation "
        f"{float((valid - P).float().mean()):.1f} tokens", fh)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True

    dc = DrafterConfig(n_embd=tc.n_embd, n_vocab=tc.n_vocab, taps=list(taps_ids), mask_token=tok["mask"],
                       n_ctx_train=tc.n_ctx_train)
    if a.tiny:
        dc.n_layer, dc.n_ff, dc.n_head, dc.n_head_kv, dc.head_dim = 2, 256, 4, 2, 64
    dr = Drafter(dc).to(dev)
    n_params = sum(p_.numel() for p_ in dr.parameters())
    log(f"drafter {asdict(dc)}; {n_params / 1e6:.2f} M params", fh)
    opt = torch.optim.AdamW(dr.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01,
                            **({"fused": True} if cuda else {}))
    gen = torch.Generator(device=dev).manual_seed(5)
    gamma = 4.0 if dc.block == 8 else 7.0
    t0 = time.time()
    step = 0
    budget = a.seconds - (time.time() - t_start) if a.seconds > 0 else 0
    budget = max(budget, 10)
    while True:
        el = time.time() - t0
        if el >= budget:
            break
        frac = el / budget
        lr = a.lr * (frac / 0.04 if frac < 0.04 else 0.5 * (1 + math.cos(math.pi * (frac - 0.04) / 0.96)))
        for g in opt.param_groups:
            g["lr"] = lr
        sel = torch.randint(0, seqs.shape[0], (a.batch,), device=dev, generator=gen)
        s, v = seqs[sel], valid[sel]
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            _, taps = target(s, taps=taps_ids, logits=False)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            loss, bl, sl, acc = losses(dr, target, taps.float(), s, v, P, a.anchors, a.lam, gamma, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(dr.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 25 == 0 or step == 1:
            log(f"step {step} t {el:.0f}s lr {lr:.2e} loss {float(loss):.4f} block {float(bl):.4f} sel {float(sl):.4f} "
                f"gnorm {float(gn):.2f} acc/pos {' '.join(f'{x:.2f}' for x in acc.tolist())}", fh)
    log(f"trained {step} steps in {time.time() - t0:.0f} s", fh)

    dr.eval()
    res = {"steps": step, "train_seconds": time.time() - t0, "params": n_params, "config": asdict(dc)}
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
    res["eval_float"] = evaluate(dr, target, eseqs, evalid, P, 16, taps_ids)
    log(f"eval float: {json.dumps(res['eval_float'])}", fh)
    torch.save({"cfg": asdict(dc), "model": dr.state_dict()}, a.ckpt)
    export_drafter(dr, os.path.join(a.out, "drafter.gguf"))
    log(f"exported {os.path.getsize(os.path.join(a.out, 'drafter.gguf'))} bytes", fh)
    quantize_in_place(dr)
    res["eval_quantized"] = evaluate(dr, target, eseqs, evalid, P, 16, taps_ids)
    log(f"eval Q4_K/Q6_K: {json.dumps(res['eval_quantized'])}", fh)
    json.dump(res, open(os.path.join(a.out, "drafter_eval.json"), "w"), indent=1)
    log(f"total {time.time() - t_start:.0f} s", fh)


if __name__ == "__main__":
    main()
