#!/usr/bin/env python3
"""Checks that every memory descriptor a kernel's SASS reads is written somewhere in that kernel.

Usage: cuobjdump -sass BINARY... | python3 tools/sass_check_descriptors.py [--show NAME_PART]

Why: on sm_90 every global access names a 64-bit uniform-register descriptor (`desc[URn]`); an L2 cache
hint (`cp.async ... L2::cache_hint`) is carried in it. ptxas 13.0 has been seen leaving such a descriptor
register unwritten while keeping the accesses that read it; the kernel then traps with "illegal
instruction" at the first copy. Here: Q6_K's fixed-row 8-row matmul build (rounds 27-28: UR1 read by 18
copies, written nowhere, with the policy made by createpolicy in the kernel or taken from a parameter
alike); the IST-DASLab/marlin issue 44 report describes the same with createpolicy. Round 33 found the
shape that triggers it: a predicated copy whose shared address has the form [R + UR] (`@!P1 LDGSTS.E.BYPASS.128
[R39+UR0], desc[UR1][R22.64]`, the scales' copy in a block loop); a shared address passed through a shuffle
avoids that form (mma_gemv.cuh's kShuffleScaleDst, RESULTS round 33). The check is static,
so it covers every kernel of a build that cuobjdump can read (the GPU machine has cuobjdump; the build
machine does not).

For each function: the uniform registers written (the first operand of an instruction; a .64 / .128
destination writes the following registers too) and those read as `desc[URn]`. A descriptor register
with no write anywhere in the function is an error (exit status 1, one line per function and register).
Any write counts (a register reused for another value too): the check finds descriptors that nothing
materialises, the failure seen, not every wrong one; the GPU tests run the kernels for the rest.
--show NAME_PART also prints, for the functions whose name contains it, the instructions that write the
descriptor registers (what the cache policy compiled to).
"""
import argparse
import re
import sys

FUNC = re.compile(r"\s*Function : (\S+)")
# /*0070*/   @!P0 LDGSTS.E.BYPASS.LTC128B.128 [R5], desc[UR4][R2.64] ;
INSN = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)((?:\.[\w]+)*)\s*([^;]*);")
DESC = re.compile(r"desc\[UR(\d+)\]")
DEST_UR = re.compile(r"\s*UR(\d+)\b")


def writes(mods: str, operands: str) -> list[int]:
    m = DEST_UR.match(operands)
    if not m:
        return []
    n = int(m.group(1))
    width = 4 if ".128" in mods else 2 if ".64" in mods else 1
    return list(range(n, n + width))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--show", default=None, help="print the descriptor writes of functions containing this")
    args = ap.parse_args()

    funcs: dict[str, dict] = {}
    cur = None
    for line in sys.stdin:
        m = FUNC.match(line)
        if m:
            name = m.group(1)
            cur = funcs.setdefault(name, {"written": set(), "desc": {}, "insns": []})
            continue
        if cur is None:
            continue
        m = INSN.match(line)
        if not m:
            continue
        opcode, mods, operands = m.group(1), m.group(2), m.group(3)
        w = writes(mods, operands)
        cur["written"].update(w)
        if w and args.show and args.show in name:  # kept only for --show
            cur["insns"].append((f"{opcode}{mods} {operands.strip()}", w))
        for d in DESC.findall(operands):
            cur["desc"][int(d)] = cur["desc"].get(int(d), 0) + 1

    if not funcs:
        print("no functions in the input (is it cuobjdump -sass output?)", file=sys.stderr)
        return 2
    bad = 0
    uses = 0
    for name, f in funcs.items():
        for r, n in sorted(f["desc"].items()):
            uses += n
            if r not in f["written"]:
                bad += 1
                print(f"UNDEFINED descriptor UR{r}: {n} accesses read it, nothing writes it, in {name}")
        if args.show and args.show in name:
            regs = set(f["desc"])
            counts = ", ".join("UR%d x%d" % (r, f["desc"][r]) for r in sorted(regs))
            print(f"{name}: descriptors {counts}")
            for text, w in f["insns"]:
                if regs & set(w):
                    print(f"    {text}")
    print(f"{len(funcs)} functions, {uses} descriptor reads, {bad} undefined descriptor registers")
    return 1 if bad else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # piped into head
        sys.exit(1)
