#!/usr/bin/env bash
# Builds drafter_probe against an existing dflash build folder: bash tools/train/probe/build.sh BUILD_DIR
set -euo pipefail
cd "$(dirname "$0")/../../.."
B=${1:?build dir}
libs="$B/libdflash_spec.a $B/libdflash_models.a $B/libdflash_text.a $B/libdflash_prism.a $B/libdflash_ops.a $B/libdflash_quant.a $B/libdflash_gguf.a"
g++ -std=c++20 -O2 -Isrc tools/train/probe/drafter_probe.cpp -Wl,--start-group $libs -Wl,--end-group -lfmt -lpthread -o "$B/drafter_probe"
echo "$B/drafter_probe"
