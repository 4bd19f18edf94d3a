"""Acceptance benchmark on held-out code prompts with dflash on the CPU (bench/acceptance.md).

    python3 tools/train/bench_acceptance.py --dflash build/dflash --prompts tools/train/heldout_prompts.jsonl \
        [-n 256] [--count 16] [--block 8] [--out result.json]

For each prompt: `dflash run --raw` plain and with the drafter; checks the token ids are identical;
aggregates the mean acceptance length tau = sum(generated - 1) / sum(cycles) (the anchor excluded, the
bonus included; SPEC 5.4) and the per-position acceptance P(draft i accepted | drafts < i accepted)
from accepted_per_cycle.
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time


def run(dflash, args):
    res = subprocess.run([dflash, "run"] + args + ["--json"], check=True, capture_output=True, text=True)
    return json.loads(res.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dflash", required=True)
    ap.add_argument("--target", default="models/target.gguf")
    ap.add_argument("--drafter", default="models/drafter.gguf")
    ap.add_argument("--prompts", default="tools/train/heldout_prompts.jsonl")
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--count", type=int, default=16)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="dflash run --device (cpu, cuda)")
    ap.add_argument("--chat", action="store_true", help="prompts through the chat template instead of --raw")
    ap.add_argument("--out")
    a = ap.parse_args()
    prompts = [json.loads(l) for l in open(a.prompts)][:a.count]
    B = a.block
    rows = []
    tot_gen, tot_cyc = 0, 0
    reach, hit = [0] * (B - 1), [0] * (B - 1)
    hist = [0] * B
    all_equal = True
    t_plain = t_spec = 0.0
    for i, p in enumerate(prompts):
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as fh:
            fh.write(p["prompt"])
            fh.flush()
            common = ["-m", a.target, "-f", fh.name, "-n", str(a.n), "-t", str(a.threads), "--device", a.device]
            if not a.chat:
                common.append("--raw")
            plain = run(a.dflash, common)
            spec = run(a.dflash, common + ["-d", a.drafter, "--block", str(B)])
        eq = plain["tokens"] == spec["tokens"]
        all_equal &= eq
        s = spec["speculative"]
        gen = len(spec["tokens"])
        tot_gen += gen - 1
        tot_cyc += s["cycles"]
        for k in s["accepted_per_cycle"]:
            hist[k] += 1
            for j in range(B - 1):
                if k >= j:
                    reach[j] += 1
                if k > j:
                    hit[j] += 1
        t_plain += plain["timings"]["decode_seconds"]
        t_spec += spec["timings"]["decode_seconds"]
        rows.append({"file": p["file"], "generated": gen, "cycles": s["cycles"], "tau": s["acceptance_length"],
                     "identical": eq, "plain_tok_s": plain["timings"]["decode_tokens_per_second"],
                     "spec_tok_s": spec["timings"]["decode_tokens_per_second"]})
        print(f"[{i + 1}/{len(prompts)}] {p['file']}: {gen} tokens, tau {s['acceptance_length']:.2f}, "
              f"identical {eq}", file=sys.stderr, flush=True)
    res = {"prompts": len(prompts), "block": B, "max_tokens": a.n, "all_identical": all_equal,
           "tau": tot_gen / max(tot_cyc, 1), "cycles": tot_cyc, "generated_after_anchor": tot_gen,
           "per_position_acceptance": [h / r if r else 0.0 for h, r in zip(hit, reach)],
           "per_position_reached": reach, "accepted_hist": hist,
           "decode_seconds_plain": t_plain, "decode_seconds_spec": t_spec, "rows": rows}
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}, indent=1))
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
