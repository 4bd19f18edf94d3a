#!/usr/bin/env bash
# GPU call 1: corpus + tokenizer + target training + export, inside a wall-clock budget.
#   bash tools/train/gpu_target.sh OUTDIR [BUDGET_SECONDS]
# Everything that comes back lands in OUTDIR (8 files at most); the work folder stays on the machine.
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${1:?outdir}; BUDGET=${2:-320}
W=${WORK:-/tmp/dflash-train}
mkdir -p "$OUT" "$W"
t0=$(date +%s)
D=$(dirname "$0")
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__)"; python3 -c "import tokenizers; print('tokenizers', tokenizers.__version__)" || true
python3 "$D/corpus.py" --out "$W" --train-mb ${TRAIN_MB:-120} --tok-mb ${TOK_MB:-32} --vocab ${VOCAB:-12288} ${CORPUS_ARGS:-} 2>&1 | tee "$OUT/corpus.log"
now=$(date +%s)
secs=$(( BUDGET - (now - t0) - ${TAIL_SECONDS:-45} ))
echo "corpus took $((now - t0)) s; training for $secs s"
python3 "$D/train_target.py" --work "$W" --out "$OUT" --seconds "$secs" ${TRAIN_ARGS:-}
cp "$W/drafter_prompts.bin" "$W/drafter_eval_prompts.bin" "$W/heldout_eval.bin" "$OUT/"
(cd "$W" && tar czf "$OUT/meta.tgz" corpus_stats.json tok_gguf.json heldout_prompts.jsonl $(ls tokenizer.json 2>/dev/null))
ls -la "$OUT"
echo "total $(( $(date +%s) - t0 )) s"
