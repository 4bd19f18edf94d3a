#!/usr/bin/env bash
# Sets up, builds and runs the main job: greedy generation with the bundled default model.
# Until the trained model pair ships (models/target.gguf, models/drafter.gguf), the default is a
# small random-weight model that `dflash synth` writes deterministically (its text is gibberish;
# it shows the whole pipeline: GGUF load, tokenizer, chat template, generation, timings).
# Usage: bash scripts/run.sh [PROMPT]     (environment: JOBS, BUILD_DIR)
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}
BUILD_DIR=${BUILD_DIR:-build}
PROMPT=${1:-"Write a function that reverses a string."}

bash scripts/setup.sh
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS" --target dflash

model=models/target.gguf
if [ ! -f "$model" ]; then
  model="$BUILD_DIR/tiny-random.gguf"
  [ -f "$model" ] || "$BUILD_DIR/dflash" synth "$model" --preset tiny --type q8_0 --layers 8 --prism
fi
echo "== dflash run -m $model"
"$BUILD_DIR/dflash" run -m "$model" -p "$PROMPT" -n 64
