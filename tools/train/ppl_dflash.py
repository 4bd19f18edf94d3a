"""Held-out perplexity of a GGUF target computed BY DFLASH (teacher-forced logits, `run --dump-logits`),
next to our torch reference forward of the same file (fp32, CPU).

    python3 tools/train/ppl_dflash.py --dflash build/dflash --tokens heldout_eval.bin [--windows 40] [--seq 512]

Windows: tokens[j*seq : j*seq + seq + 1] for j < windows (the same windows train_target.py evaluates);
the logits of rows 0..seq-1 score tokens 1..seq.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from export_target import load_target_gguf  # noqa: E402


def nll(logits, y):
    lg = torch.from_numpy(logits).double()
    return float(torch.nn.functional.cross_entropy(lg, torch.from_numpy(y).long(), reduction="sum"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dflash", required=True)
    ap.add_argument("--model", default="models/target.gguf")
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-torch", action="store_true")
    a = ap.parse_args()
    data = np.fromfile(a.tokens, np.uint16).astype(np.int64)
    T = a.seq
    ref = None
    if not a.no_torch:
        ref, _ = load_target_gguf(a.model)
        ref.eval()
        ref.freeze()
    tot_d = tot_t = 0.0
    cnt = 0
    max_diff = 0.0
    agree = 0
    with tempfile.TemporaryDirectory() as work:
        for j in range(a.windows):
            w = data[j * T:j * T + T + 1]
            out = os.path.join(work, "logits.bin")
            subprocess.run([a.dflash, "run", "-m", a.model, "--tokens", ",".join(map(str, w.tolist())), "-n", "1",
                            "--dump-logits", out, "-t", str(a.threads), "--json"], check=True, capture_output=True)
            lg = np.fromfile(out, np.float32).reshape(T + 1, -1)[:T]
            tot_d += nll(lg, w[1:])
            cnt += T
            if ref is not None:
                with torch.no_grad():
                    lt, _ = ref(torch.from_numpy(w[None, :T]))
                lt = lt[0].numpy()
                tot_t += nll(lt, w[1:])
                max_diff = max(max_diff, float(np.abs(lt - lg).max()))
                agree += int((lt.argmax(-1) == lg.argmax(-1)).sum())
            print(f"window {j + 1}/{a.windows}: dflash ppl so far {math.exp(tot_d / cnt):.3f}"
                  + (f", torch {math.exp(tot_t / cnt):.3f}" if ref is not None else ""), file=sys.stderr, flush=True)
    res = {"model": a.model, "tokens": cnt, "windows": a.windows, "seq": T,
           "dflash_nll": tot_d / cnt, "dflash_ppl": math.exp(tot_d / cnt)}
    if ref is not None:
        res.update({"torch_fp32_nll": tot_t / cnt, "torch_fp32_ppl": math.exp(tot_t / cnt),
                    "max_abs_logit_diff": max_diff, "argmax_agreement": agree / cnt})
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
