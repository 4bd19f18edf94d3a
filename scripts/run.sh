#!/usr/bin/env bash
# Sets up, builds and runs the main job: DFlash 2 speculative generation with the bundled model pair
# (models/target.gguf: a 40M-parameter ternary qwen35 code model; models/drafter.gguf: its DFlash 2
# drafter; see models/README.md). Without the bundled pair (a checkout without models/) it falls back
# to a random-weight model that `dflash synth` writes (gibberish text, same pipeline).
# Usage: bash scripts/run.sh [PROMPT]     (environment: JOBS, BUILD_DIR)
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}
BUILD_DIR=${BUILD_DIR:-build}
PROMPT=${1:-"Write a function that reverses a string."}

bash scripts/setup.sh
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS" --target dflash

if [ -f models/target.gguf ]; then
  echo "== dflash run (bundled target + drafter)"
  "$BUILD_DIR/dflash" run -p "$PROMPT" -n 128
else
  model="$BUILD_DIR/tiny-random.gguf"
  [ -f "$model" ] || "$BUILD_DIR/dflash" synth "$model" --preset tiny --type q8_0 --layers 8 --prism
  echo "== dflash run -m $model"
  "$BUILD_DIR/dflash" run -m "$model" -p "$PROMPT" -n 64
fi
