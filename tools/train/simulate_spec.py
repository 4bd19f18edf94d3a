"""Simulates the speculative loop (SPEC 5) in torch on the target's greedy output, from the shipped GGUFs,
and prints accepted_per_cycle, to compare with `dflash run -d ... --json` (same prompt).

    python3 tools/train/simulate_spec.py TARGET DRAFTER RUN.json   (RUN.json: dflash run --json output)
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from drafter import load_drafter_gguf  # noqa: E402
from export_target import load_target_gguf  # noqa: E402


@torch.no_grad()
def simulate(target, dr, prompt, out, block=8):
    seq = prompt + out
    _, taps = target(torch.tensor([seq]), taps=tuple(dr.cfg.taps), logits=False)
    P = len(prompt)  # the anchor (first generated token) sits at position P
    acc = []
    while P < len(seq) - 1:
        ids = torch.full((1, 1, dr.cfg.block), dr.cfg.mask_token)
        ids[0, 0, 0] = seq[P]
        h = dr(target, taps[:, :P], ids, torch.tensor([[P]]))[0, 0]
        logits = target.lm_head(h[1:])
        drafts = dr.walk(h[None, 1:], logits[None], torch.tensor([seq[P]]))[0].tolist()[:block - 1]
        k = 0
        while k < len(drafts) and P + 1 + k < len(seq) and drafts[k] == seq[P + 1 + k]:
            k += 1
        acc.append(k)
        P += k + 1
    return acc


if __name__ == "__main__":
    target, _ = load_target_gguf(sys.argv[1])
    target.eval()
    target.freeze()
    dr = load_drafter_gguf(sys.argv[2])
    dr.eval()
    r = json.load(open(sys.argv[3]))
    acc = simulate(target, dr, r["prompt"], r["tokens"])
    print("torch  accepted_per_cycle", acc)
    if "speculative" in r:
        print("dflash accepted_per_cycle", r["speculative"]["accepted_per_cycle"])
