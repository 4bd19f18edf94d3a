#!/usr/bin/env python3
"""Kernel-by-kernel comparison of two step timelines (bench_cuda_ops with DFLASH_STEP_TIMELINE=1).

Usage: python3 tools/timeline_diff.py NEW.md OLD.md [--top N]

scripts/gpu_test.sh --ab NAME --timeline TYPE writes both files (timeline_TYPE.md for the current build,
timeline_TYPE_NAME.md for the other) and runs this on them. For each step the two files share (decode,
verify, rollback, draft), it prints the span of each and, for the kernels of either, the exposed time per
launch and over all launches (exposed: the wall time during which the kernel was the one the step waited
for), sorted by the largest change. Rows are matched by kernel name and grid; a kernel only one build has
shows "-" for the other. Why: a kernel that gets faster alone can make its neighbours slower in the step
(RESULTS round 33: wider matmul CTAs, then slower norm chains after them), and the step's span only says
that something moved, not what.
"""
import argparse
import re
import sys


def parse(path):
    """{step title: {"span": us, "kernels": n, "rows": {(kernel, grid): (launches, exposed_total, per_launch)}}}"""
    steps, cur = {}, None
    for line in open(path, encoding="utf-8"):
        m = re.match(r"### timeline: one (.+?) step", line) or re.match(r"### timeline: one (rollback)", line)
        if m:
            cur = {"span": None, "kernels": None, "rows": {}}
            steps[m.group(1)] = cur
            continue
        if cur is None:
            continue
        m = re.match(r"(\d+) kernels, span ([\d.]+) us", line)
        if m:
            cur["kernels"], cur["span"] = int(m.group(1)), float(m.group(2))
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 5 and cells[0] not in ("kernel", "") and not cells[0].startswith("---"):
            try:
                launches = int(cells[2])
                exposed = float(cells[3].split()[0])
                per = float(cells[4])
            except ValueError:
                continue
            cur["rows"][(cells[0], cells[1])] = (launches, exposed, per)
    return steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("new")
    ap.add_argument("old")
    ap.add_argument("--top", type=int, default=12, help="rows per step (largest changes first)")
    a = ap.parse_args()
    new, old = parse(a.new), parse(a.old)
    if not new or not old:
        sys.exit(f"timeline_diff: no timeline sections in {a.new if not new else a.old}")
    for step in new:
        if step not in old:
            continue
        n, o = new[step], old[step]
        print(f"### {step}: span {n['span']} vs {o['span']} us ({n['span'] - o['span']:+.1f}), "
              f"{n['kernels']} vs {o['kernels']} kernels")
        print("| kernel | grid | launches new / old | exposed us per launch new / old | total change us |")
        print("|---|---|---|---|---:|")
        keys = set(n["rows"]) | set(o["rows"])
        rows = []
        for k in keys:
            ln, en, pn = n["rows"].get(k, (0, 0.0, None))
            lo, eo, po = o["rows"].get(k, (0, 0.0, None))
            rows.append((en - eo, k, ln, lo, pn, po))
        rows.sort(key=lambda r: -abs(r[0]))
        for d, (kernel, grid), ln, lo, pn, po in rows[: a.top]:
            fmt = lambda v: "-" if v is None else f"{v:.2f}"
            print(f"| {kernel} | {grid} | {ln} / {lo} | {fmt(pn)} / {fmt(po)} | {d:+.1f} |")
        print()


if __name__ == "__main__":
    main()
