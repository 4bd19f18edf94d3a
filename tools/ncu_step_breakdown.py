#!/usr/bin/env python3
"""Per-kernel breakdown of one profiled decode step, from `ncu --csv` output (GPU machine).

Usage: ncu --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes.sum --csv \
           bench_cuda_ops --model FILE --model-only --tokens 8 > step.csv   (with DFLASH_PROFILE_STEP=1)
       python3 tools/ncu_step_breakdown.py step.csv FLOOR_GBPS > breakdown.md

Groups the kernels by function name and prints, per group: launches, total and per-launch time, DRAM
bytes moved (read + written), the group's own floor (bytes / FLOOR_GBPS, the streaming-read bandwidth
measured in the same run) and the time as a multiple of that floor. ncu runs every kernel alone
(serialised, no overlap between kernels), so the sum is an upper bound of the step's GPU time.
"""
import csv
import re
import sys
from collections import defaultdict


def short_name(name: str) -> str:
    name = name.replace("(anonymous namespace)::", "")
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"\(.*$", "", name)  # drop the parameter list
    name = re.sub(r"\b\w+::", "", name)  # drop namespaces (also inside template arguments)
    return name


def main() -> None:
    path, floor_gbps = sys.argv[1], float(sys.argv[2])
    rows = []
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]
    for rec in csv.DictReader(lines):
        rows.append(rec)
    per_id = defaultdict(dict)
    names = {}
    for r in rows:
        kid = r["ID"]
        names[kid] = short_name(r["Kernel Name"])
        unit = r["Metric Unit"]
        val = float(r["Metric Value"].replace(",", ""))
        if r["Metric Name"] == "gpu__time_duration.sum":
            scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
            if unit not in scale:
                sys.exit(f"unknown time unit {unit!r} in {path}")
            per_id[kid]["us"] = val * scale[unit]
        elif r["Metric Name"] == "dram__bytes.sum":
            scale = {"byte": 1.0, "B": 1.0, "Kbyte": 1e3, "KB": 1e3, "Mbyte": 1e6, "MB": 1e6, "Gbyte": 1e9, "GB": 1e9}
            if unit not in scale:
                sys.exit(f"unknown byte unit {unit!r} in {path}")
            per_id[kid]["bytes"] = val * scale[unit]
    groups = defaultdict(lambda: [0, 0.0, 0.0])
    for kid, m in per_id.items():
        g = groups[names[kid]]
        g[0] += 1
        g[1] += m.get("us", 0.0)
        g[2] += m.get("bytes", 0.0)
    total_us = sum(g[1] for g in groups.values())
    total_b = sum(g[2] for g in groups.values())
    print(f"one decode step: {sum(g[0] for g in groups.values())} kernels, {total_us:.0f} us summed "
          f"(kernels run alone under ncu), {total_b / 1e9:.3f} GB moved; floor {floor_gbps:.0f} GB/s\n")
    print("| kernel | launches | total us | % of step | us/launch | MB moved | floor us | time / floor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, (n, us, b) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        floor_us = b / (floor_gbps * 1e9) * 1e6
        ratio = us / floor_us if floor_us > 0 else float("inf")
        print(f"| {name} | {n} | {us:.1f} | {100 * us / total_us:.1f} | {us / n:.2f} | {b / 1e6:.2f} | "
              f"{floor_us:.1f} | {ratio:.1f}x |")


if __name__ == "__main__":
    main()
