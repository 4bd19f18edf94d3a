#!/usr/bin/env python3
"""Opcode histogram of one kernel's SASS (GPU machine: cuobjdump is there, not on the build machine).

Usage: cuobjdump -sass BINARY | python3 tools/sass_opcodes.py NAME_PART > sass_NAME.txt

Takes every function whose mangled name contains NAME_PART (e.g. mm_mma_kernel), prints its
instruction count and the count per opcode (the part before the first '.'), most frequent first.
Use it to check a kernel's instructions per unit of work against the estimate in its comments.
"""
import re
import sys
from collections import Counter


def main() -> None:
    part = sys.argv[1]
    funcs, cur = {}, None
    for line in sys.stdin:
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = m.group(1) if part in m.group(1) else None
            if cur:
                funcs[cur] = Counter()
            continue
        if cur is None:
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.[\w.]*)?\b", line)
        if m:
            funcs[cur][m.group(1)] += 1
    if not funcs:
        sys.exit(f"no function containing {part!r} in the SASS")
    for name, ops in funcs.items():
        print(f"{name}: {sum(ops.values())} instructions")
        print("  " + ", ".join(f"{op} {n}" for op, n in ops.most_common()))


if __name__ == "__main__":
    main()
