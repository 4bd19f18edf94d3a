#!/usr/bin/env bash
# GPU call 2: the target's greedy continuations + drafter training + evaluation + export.
#   bash tools/train/gpu_drafter.sh OUTDIR TARGET.gguf PROMPTS_DIR [SECONDS]
# PROMPTS_DIR holds drafter_prompts.bin and drafter_eval_prompts.bin (written by corpus.py).
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${1:?outdir}; TARGET=${2:?target}; PD=${3:?prompts dir}; SECS=${4:-200}
D=$(dirname "$0")
mkdir -p "$OUT"
python3 "$D/train_drafter.py" --target "$TARGET" --prompts "$PD/drafter_prompts.bin" \
  --eval-prompts "$PD/drafter_eval_prompts.bin" --out "$OUT" --seconds "$SECS" ${DRAFTER_ARGS:-} 2>&1 \
  | grep -v "UserWarning\|lv = float\|Consider using"
# the float drafter (fp16) in parts that fit the transfer limits, to re-export without a GPU
python3 - "$OUT" <<'PY'
import sys, torch
ck = torch.load("/tmp/drafter.pt")
ck["model"] = {k: v.half() for k, v in ck["model"].items()}
torch.save(ck, "/tmp/drafter_fp16.pt")
PY
split -b 12m -d /tmp/drafter_fp16.pt "$OUT/drafter_fp16.pt.part"
ls -la "$OUT"
