#!/usr/bin/env python3
"""Where one kernel's instructions and stalls go, from ncu's per-instruction source counters.

Usage (GPU machine; ncu is there):
    ncu --clock-control none --kernel-name-base demangled -k "regex:TernaryFmt, .int.3, .int.8>" \
        --launch-skip 12 --launch-count 1 --section SourceCounters --section WarpStateStats \
        -o rep -f bench_cuda_ops --matmul ptq1_0:ffn_up
    ncu -i rep.ncu-rep --page source --print-source sass --csv | gzip > sass.csv.gz
    python3 tools/ncu_source_counts.py sass.csv.gz [LOOP_COUNT]

Prints the warp-stall reasons (share of all samples), the opcode mix (share of executed instructions
and of stall samples), and the instructions grouped by how often each ran: in a loop kernel the
largest groups are the loop body (executed once per iteration and warp), its conditional parts and
the once-per-warp prologue / epilogue, so instructions per unit of work can be read off directly
(bench/RESULTS.md round 13). With LOOP_COUNT, the instructions executed exactly that many times are
listed in program order with their stall samples. Reads a plain or gzipped CSV.
"""
import csv
import gzip
import sys
from collections import Counter


def opcode(source: str) -> str:
    words = source.split()
    if not words:
        return "?"
    op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return op.split(".")[0]


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    path = sys.argv[1]
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    header_at = next((i for i, r in enumerate(rows) if "Source" in r and "Instructions Executed" in r), None)
    if header_at is None:
        sys.exit(f"{path}: no 'Source' / 'Instructions Executed' header (is it ncu --page source --csv output?)")
    hdr = rows[header_at]
    col = {h: i for i, h in enumerate(hdr)}
    data = [r for r in rows[header_at + 1:] if len(r) >= len(hdr)]
    stall_cols = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    samples_col = "Warp Stall Sampling (All Samples)"

    def num(r, name):
        v = r[col[name]] if name in col else ""
        return int(v) if v.strip().isdigit() else 0

    total_samples = sum(num(r, samples_col) for r in data) or 1
    stalls = Counter()
    executed, op_samples, by_count = Counter(), Counter(), Counter()
    for r in data:
        op, n = opcode(r[col["Source"]].strip()), num(r, "Instructions Executed")
        executed[op] += n
        op_samples[op] += num(r, samples_col)
        by_count[n] += 1
        for c in stall_cols:
            stalls[c] += num(r, c)
    total_exec = sum(executed.values()) or 1
    print(f"instructions executed: {total_exec}, stall samples: {total_samples}")
    print("stall reasons:")
    for c, v in stalls.most_common(10):
        print(f"  {c:28s} {100 * v / total_samples:5.1f} %")
    print("opcodes (executed, stall samples):")
    for op, v in executed.most_common(20):
        print(f"  {op:10s} {100 * v / total_exec:5.1f} %  {100 * op_samples[op] / total_samples:5.1f} %")
    print("instructions by execution count (count x instructions = share):")
    for n, k in sorted(by_count.items(), key=lambda x: -x[0] * x[1])[:8]:
        if n:
            print(f"  {n:9d} x {k:5d}  {100 * n * k / total_exec:5.1f} %")
    if len(sys.argv) > 2:
        want = int(sys.argv[2])
        for r in data:
            if num(r, "Instructions Executed") == want:
                print(f"{num(r, samples_col):5d}  {r[col['Source']].strip()}")


if __name__ == "__main__":
    main()
