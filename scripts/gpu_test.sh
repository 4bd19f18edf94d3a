#!/usr/bin/env bash
# The CUDA backend's GPU run: differential test suite + benchmarks, in one command.
#
# Two halves, because the GPU machine builds nothing (nvcc is slow; the build machine has it):
#
#   scripts/gpu_test.sh --stage
#       on the build machine: builds test_cuda, bench_cuda_ops and dflash in build-cuda (or $BUILD) (Release,
#       -j${JOBS:-2}) and stages them with their non-system shared libraries (libfmt, libutf8proc)
#       in build-cuda/gpu/ and a stripped, xz-compressed copy build-cuda/gpu.txz (~27 MB; ignored by git;
#       carry the .txz to the GPU machine: the folder plus the tree pass the device tool's 64 MiB carry
#       limit, and the .txz leaves room for an A/B pack).
#
#   scripts/gpu_test.sh [--no-test] [--no-bench] [--model27 ptq1_0|pq2_0] [--tokens N]
#       on the GPU machine, from the repository root: runs test_cuda and bench_cuda_ops from
#       build-cuda/gpu/, writes logs and tables under $OUT (default ./out-gpu), prints a summary last.
#       The 27B files are written with --repeat-layers (later layers of a kind copy the first one's bytes:
#       2 of the 64 layers drawn; a full draw took 62 s of a fresh machine's device time; the kernels' work
#       does not depend on the values); SYNTH_ARGS replaces that (SYNTH_ARGS= draws every layer, as before
#       round 18).
#       --model27 TYPE also writes the synthetic 27B file (dflash synth --preset bonsai-27b, ~6-7 GB,
#       into /tmp, never carried) and measures whole-model decode on it.
#       --dflash-bench TYPE writes the synthetic 27B target of TYPE and the 27B-shaped drafter
#       (`dflash synth-drafter --preset qwen38-27b`) and runs `dflash bench --device cuda` on the pair
#       (repetitions $DBENCH_REPS, default 2; extra bench options in $DBENCH_ARGS), then once more for
#       each context depth in $DBENCH_DEPTHS (e.g. DBENCH_DEPTHS='4096 32768': `--depth D`).
#       --attention times the decode / verify attention alone (bench_cuda_ops --attention) with the
#       default kernels, with the generic split kernel (DFLASH_CUDA_ATTN_SEGMENTS=0) and with each ';'-separated
#       set of assignments in $ATTN_ENV (e.g. ATTN_ENV='DFLASH_CUDA_ATTN_ROWS=1'): $OUT/attention.md.
#       With the tests (unless --no-test) every memory descriptor read in dflash's SASS is checked to be
#       written in its kernel (tools/sass_check_descriptors.py: ptxas 13.0 left one unwritten in Q6_K's fixed-row build
#       and in a wide ternary build, round 33).
#       --sass NAME writes the opcode histogram of the kernels whose name contains NAME
#       (tools/sass_opcodes.py; e.g. --sass mm_mma_kernel).
#       --profile-step TYPE profiles one decode step of that 27B target with ncu and writes the
#       per-kernel breakdown (tools/ncu_step_breakdown.py) to $OUT/step_breakdown_TYPE.md;
#       --profile-verify TYPE does the same for one 8-row verify step, --profile-prefill TYPE for one
#       prefill chunk (the backend's prefill_rows() rows), --profile-draft TYPE for one draft step of
#       the 27B-shaped drafter.
#       --ncu-source 'REGEX;REGEX...' profiles the first launch of each kernel matching a REGEX (ncu -k
#       regex:..., demangled names) in one step of the synthetic 27B PTQ1_0 pair ($NCU_STEP: decode
#       (default), verify, draft), with the warp-state, scheduler, memory and source-counter sections,
#       and writes the details page ($OUT/ncu_<step>_<n>.txt) and the per-SASS-instruction source page
#       with its stall samples ($OUT/ncu_<step>_<n>_sass.csv.gz) of each.
#       --timeline TYPE records one decode, one 8-row verify, one rollback (4 of 8 rows kept) and one draft
#       step of that 27B pair through CUPTI (bench_cuda_ops with DFLASH_STEP_TIMELINE=1: the real,
#       PDL-overlapped timeline, which ncu cannot show; the GPU machine has no nsys) and writes where each
#       step's wall time goes to $OUT/timeline_TYPE.md.
#
#   scripts/gpu_test.sh --stage-ab NAME
#       on the build machine: packs the current build's bench_cuda_ops (stripped, with its libraries;
#       dflash too with AB_DFLASH=1) as build-cuda/gpu_NAME.txz (~10 MB), a second build to compare on the
#       same GPU machine (a change without a runtime switch: stage the old tree and --stage-ab it, then
#       stage the new one; carry both .txz: tree ~26 MB + 27 + 10 fit the 64 MiB carry).
#   scripts/gpu_test.sh --ab NAME [--ab-runs N]   (with --dflash-bench TYPE, or after it on the machine)
#       on the GPU machine: alternates the current build and gpu_NAME N times (default 2) on the 27B pair:
#       bench_cuda_ops --model-only (decode, verify, draft) and dflash bench pp512. With --timeline TYPE
#       also gpu_NAME's timeline ($OUT/timeline_TYPE_NAME.md) and the two compared kernel by kernel
#       (tools/timeline_diff.py: $OUT/timeline_diff_NAME.log, printed).
#   scripts/gpu_test.sh --env-ab 'A=0;B=1 C=2' [--ab-runs N] [--pp]   (with --dflash-bench TYPE)
#       on the GPU machine: bench_cuda_ops --model-only on the 27B pair with no extra environment, then with
#       each ';'-separated set of assignments (runtime switches, DFLASH_CUDA_SKIP=... diagnostics), N rounds;
#       --pp adds dflash bench pp512 to each.
#
# Through the device tool:  run(command="bash scripts/gpu_test.sh", carry=["build-cuda/gpu.txz"])
# (a pack from before round 29, gpu.tgz / gpu_NAME.tgz, is unpacked too when no .txz is there).
set -uo pipefail
cd "$(dirname "$0")/.."
# BUILD names the build folder (default build-cuda): concurrent engineers each stage their own.
BD=${BUILD:-build-cuda}
G=$BD/gpu
# --repeat-layers unless SYNTH_ARGS is set (even to nothing): see the 27B files above.
SYNTH_ARGS=${SYNTH_ARGS---repeat-layers}

if [ "${1:-}" = "--stage-ab" ]; then
  set -e
  NAME=${2:?--stage-ab NAME}
  [ -x "$G/bench_cuda_ops" ] || { echo "no $G/bench_cuda_ops: run --stage first" >&2; exit 2; }
  T=$(mktemp -d)
  mkdir -p "$T/gpu_$NAME/lib"
  cp "$G/bench_cuda_ops" "$G/COMMIT" "$T/gpu_$NAME/"
  # dflash (pp512 in --ab) only with AB_DFLASH=1: with it the pack is ~18 MB, and the tree (~26 MB),
  # gpu.txz (~27 MB) and the pack no longer fit the device tool's 64 MiB carry
  [ "${AB_DFLASH:-0}" = 1 ] && [ -f "$G/dflash" ] && cp "$G/dflash" "$T/gpu_$NAME/"
  cp "$G"/lib/* "$T/gpu_$NAME/lib/" 2>/dev/null || true
  strip "$T/gpu_$NAME/bench_cuda_ops" "$T/gpu_$NAME/dflash" 2>/dev/null || true
  rm -f "$BD/gpu_$NAME.tgz"  # the .txz replaces a pre-round-29 pack
  tar cJf "$BD/gpu_$NAME.txz" -C "$T" "gpu_$NAME"
  rm -rf "$T"
  du -sh "$BD/gpu_$NAME.txz"
  exit 0
fi

if [ "${1:-}" = "--stage" ]; then
  set -e
  cmake -S . -B $BD -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
  ninja -C $BD -j "${JOBS:-2}" test_cuda bench_cuda_ops
  rm -rf "$G" && mkdir -p "$G/lib"
  cp $BD/tests/cuda/test_cuda $BD/tests/cuda/bench_cuda_ops "$G/"
  # dflash (for `dflash synth` of the 27B file) is optional: the tree may be mid-edit elsewhere
  if ninja -C $BD -j "${JOBS:-2}" dflash; then cp $BD/dflash "$G/"; else echo "warning: dflash not built"; fi
  for b in "$G"/test_cuda "$G"/bench_cuda_ops "$G"/dflash; do
    [ -f "$b" ] || continue
    ldd "$b" | awk '/=> \// {print $3}' | grep -E 'libfmt|libutf8proc|libgtest|libbenchmark|httplib|libcupti' || true
  done | sort -u | while read -r lib; do cp -L "$lib" "$G/lib/"; done
  git rev-parse HEAD >"$G/COMMIT"
  git status --porcelain -- src/ops/cuda tests/cuda bench/cuda_ops_bench.cpp | grep -q . && echo "+dirty" >>"$G/COMMIT"
  du -sh "$G"
  # The tree (with the bundled models) and gpu/ together pass the device tool's 64 MiB carry limit:
  # carry the stripped, xz-compressed copy instead (gpu/ keeps the symbols); the GPU-side run unpacks it.
  # Stripping leaves the device code alone (cuobjdump, CUPTI and ncu read it as before).
  T=$(mktemp -d)
  cp -r "$G" "$T/gpu"
  strip "$T/gpu/test_cuda" "$T/gpu/bench_cuda_ops" "$T/gpu/dflash" 2>/dev/null || true
  rm -f $BD/gpu.tgz
  tar cJf $BD/gpu.txz -C "$T" gpu
  rm -rf "$T"
  du -sh $BD/gpu.txz
  exit 0
fi

ATTN=0 TIMELINE="" RUN_TEST=1 RUN_BENCH=1 MODEL27="" TOKENS=64 DBENCH="" PROFILE="" PROFILE_KIND=decode SASS="" AB="" AB_RUNS=2 ENVAB="" ENVAB_PP=0 NCU_SRC=""
while [ $# -gt 0 ]; do
  case "$1" in
    --no-test) RUN_TEST=0 ;;
    --no-bench) RUN_BENCH=0 ;;
    --model27) MODEL27="$2"; shift ;;
    --tokens) TOKENS="$2"; shift ;;
    --dflash-bench) DBENCH="$2"; shift ;;
    --profile-step) PROFILE="$2"; shift ;;
    --profile-verify) PROFILE="$2"; PROFILE_KIND=verify; shift ;;
    --profile-prefill) PROFILE="$2"; PROFILE_KIND=prefill; shift ;;
    --profile-draft) PROFILE="$2"; PROFILE_KIND=draft; shift ;;
    --timeline) TIMELINE="$2"; shift ;;
    --ncu-source) NCU_SRC="$2"; shift ;;
    --attention) ATTN=1 ;;
    --sass) SASS="$2"; shift ;;
    --ab) AB="$2"; shift ;;
    --ab-runs) AB_RUNS="$2"; shift ;;
    --env-ab) ENVAB="$2"; shift ;;
    --pp) ENVAB_PP=1 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
# Every log and table goes to ./out-gpu. When the device tool's $OUT is set (it returns at most 8 files),
# the end of the run copies the tables there (at most 7) and packs every log into $OUT/gpu_logs.tgz.
DEST=${OUT:-}
OUT=$PWD/out-gpu
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$G/lib:${LD_LIBRARY_PATH:-}"
# A warm machine keeps the last call's gpu/: unpack the carried build again when it is another commit.
fresh_unpack() {  # $1: the pack without its extension (.txz, else .tgz), $2: the folder it holds
  local pack=$1.txz z=J
  [ -f "$pack" ] || { pack=$1.tgz z=z; }
  [ -f "$pack" ] || return 0
  [ -f "$2/COMMIT" ] && [ "$(tar x${z}f "$pack" -O "$(basename "$2")/COMMIT" 2>/dev/null)" = "$(cat "$2/COMMIT")" ] &&
    return 0
  rm -rf "$2" && tar x${z}f "$pack" -C "$(dirname "$2")"
}
fresh_unpack $BD/gpu "$G"
[ -x "$G/test_cuda" ] || { echo "no $G/test_cuda: run scripts/gpu_test.sh --stage first and carry $G" >&2; exit 2; }
{
  echo "commit: $(cat $G/COMMIT | tr '\n' ' ')"
  echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

rc=0
# The synthetic 27B target of type $1 (/tmp/bonsai27-$1.gguf) and, unless $2 = target-only, the 27B-shaped
# drafter (/tmp/drafter27.gguf), each written only when missing (a warm machine keeps /tmp).
ensure_27b() {
  local f=/tmp/bonsai27-$1.gguf
  [ -f "$f" ] || timeout 200 "$G/dflash" synth "$f" --preset bonsai-27b --type "$1" $SYNTH_ARGS >"$OUT/synth_$1.log" 2>&1
  [ "${2:-}" = target-only ] || [ -f /tmp/drafter27.gguf ] ||
    timeout 120 "$G/dflash" synth-drafter /tmp/drafter27.gguf --preset qwen38-27b --target "$f" \
      >"$OUT/synth_drafter.log" 2>&1
}
if [ $RUN_TEST = 1 ]; then
  t0=$(date +%s)
  DFLASH_CUDA_REPORT="$OUT/test_cuda_table.md" timeout 600 "$G/test_cuda" --gtest_brief=1 >"$OUT/test_cuda.log" 2>&1
  rt=$?
  echo "test_cuda: exit $rt in $(( $(date +%s) - t0 )) s"
  [ $rt = 0 ] || rc=1
  # The generic attention kernel serves only odd head dims by default: run every attention case on it too.
  DFLASH_CUDA_ATTN_SEGMENTS=0 timeout 300 "$G/test_cuda" --gtest_brief=1 --gtest_filter='*Attention*' \
    >"$OUT/test_cuda_attn_generic.log" 2>&1
  ra=$?
  echo "test_cuda attention cases, DFLASH_CUDA_ATTN_SEGMENTS=0: exit $ra"
  [ $ra = 0 ] || rc=1
  # Every memory descriptor the shipped kernels read must be written in them (ptxas 13.0 left one
  # unwritten in Q6_K's fixed-row build: tools/sass_check_descriptors.py); static, so checks every kernel.
  if command -v cuobjdump >/dev/null; then
    cuobjdump -sass "$G/dflash" | python3 tools/sass_check_descriptors.py >"$OUT/sass_descriptors.txt" 2>&1
    rs=$?
    echo "sass descriptor check: exit $rs ($(tail -1 "$OUT/sass_descriptors.txt"))"
    [ $rs = 0 ] || rc=1
  else
    echo "sass descriptor check: no cuobjdump, skipped"
  fi
fi
if [ $RUN_BENCH = 1 ]; then
  t0=$(date +%s)
  timeout 600 "$G/bench_cuda_ops" --out "$OUT/bench.md" >"$OUT/bench.log" 2>&1
  rb=$?
  echo "bench_cuda_ops: exit $rb in $(( $(date +%s) - t0 )) s"
  [ $rb = 0 ] || rc=1
fi
if [ -n "$MODEL27" ]; then
  t0=$(date +%s)
  F=/tmp/bonsai27-$MODEL27.gguf
  timeout 200 "$G/dflash" synth "$F" --preset bonsai-27b --type "$MODEL27" $SYNTH_ARGS >"$OUT/synth.log" 2>&1
  echo "synth $MODEL27: exit $? in $(( $(date +%s) - t0 )) s"
  t0=$(date +%s)
  timeout 150 "$G/bench_cuda_ops" --model "$F" --model-only --tokens "$TOKENS" --out "$OUT/bench_model_$MODEL27.md" \
    >"$OUT/bench_model_$MODEL27.log" 2>&1
  rm_=$?
  echo "bench model $MODEL27: exit $rm_ in $(( $(date +%s) - t0 )) s"
  [ $rm_ = 0 ] || rc=1
fi

if [ -n "$DBENCH" ]; then
  # `dflash bench` on the synthetic 27B pair: target of type $DBENCH + the 27B-shaped drafter.
  F=/tmp/bonsai27-$DBENCH.gguf D=/tmp/drafter27.gguf
  t0=$(date +%s)
  ensure_27b "$DBENCH"
  echo "synth pair $DBENCH: $(( $(date +%s) - t0 )) s"
  t0=$(date +%s)
  timeout 300 "$G/dflash" bench --device cuda -m "$F" -d "$D" -p 512 -n "$TOKENS" -r "${DBENCH_REPS:-2}" ${DBENCH_ARGS:-} \
    >"$OUT/dflash_bench_$DBENCH.md" 2>"$OUT/dflash_bench_$DBENCH.log"
  echo "dflash bench $DBENCH: exit $? in $(( $(date +%s) - t0 )) s"
  cat "$OUT/dflash_bench_$DBENCH.md"; tail -5 "$OUT/dflash_bench_$DBENCH.log"
  for depth in ${DBENCH_DEPTHS:-}; do  # the same table after `depth` tokens in the cache
    t0=$(date +%s)
    timeout 300 "$G/dflash" bench --device cuda -m "$F" -d "$D" -p 512 -n "$TOKENS" -r "${DBENCH_REPS:-2}" \
      --depth "$depth" ${DBENCH_ARGS:-} >"$OUT/dflash_bench_${DBENCH}_d$depth.md" 2>"$OUT/dflash_bench_${DBENCH}_d$depth.log"
    echo "dflash bench $DBENCH --depth $depth: exit $? in $(( $(date +%s) - t0 )) s"
    cat "$OUT/dflash_bench_${DBENCH}_d$depth.md"; tail -3 "$OUT/dflash_bench_${DBENCH}_d$depth.log"
  done
fi

if [ $ATTN = 1 ]; then
  # Decode / verify attention alone (bench_cuda_ops --attention): the default kernels, then the generic
  # split kernel (DFLASH_CUDA_ATTN_SEGMENTS=0) and each set in $ATTN_ENV, one table each in $OUT/attention.md.
  t0=$(date +%s)
  IFS=';' read -r -a AENV <<<"DFLASH_CUDA_ATTN_SEGMENTS=0${ATTN_ENV:+;$ATTN_ENV}"
  { echo "### attention: defaults"; timeout 200 "$G/bench_cuda_ops" --attention; echo
    for E in "${AENV[@]}"; do
      echo "### attention: $E"; env $E timeout 200 "$G/bench_cuda_ops" --attention; echo
    done; } >"$OUT/attention.md" 2>&1
  echo "attention: $(( $(date +%s) - t0 )) s"
  cat "$OUT/attention.md"
fi

if [ -n "$SASS" ]; then
  # Opcode histogram of the kernels whose name contains $SASS (cuobjdump is on the GPU machine).
  cuobjdump -sass "$G/test_cuda" | python3 tools/sass_opcodes.py "$SASS" >"$OUT/sass_$SASS.txt" 2>&1
  cat "$OUT/sass_$SASS.txt"
fi

if [ -n "$PROFILE" ]; then
  # Per-kernel breakdown of one decode step of the synthetic 27B target of type $PROFILE (ncu).
  F=/tmp/bonsai27-$PROFILE.gguf
  ensure_27b "$PROFILE" target-only
  t0=$(date +%s)
  DARG=()
  if [ "$PROFILE_KIND" = draft ]; then
    ensure_27b "$PROFILE"
    DARG=(--drafter /tmp/drafter27.gguf)
  fi
  DFLASH_PROFILE_STEP=$PROFILE_KIND timeout 300 ncu --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes.sum \
    --print-units base --csv --log-file "$OUT/step_$PROFILE.csv" "$G/bench_cuda_ops" --model "$F" "${DARG[@]}" --model-only --tokens 4 \
    >"$OUT/step_app_$PROFILE.log" 2>&1
  echo "ncu step $PROFILE: exit $? in $(( $(date +%s) - t0 )) s"
  # The floor for the table: FLOOR_GBPS if given (the streaming read measured without ncu attached:
  # under ncu the app's own floor measurement reads low), else the app's.
  FLOOR=${FLOOR_GBPS:-$(grep -o 'floor[^:]*: [0-9]* GB/s' "$OUT/step_app_$PROFILE.log" | grep -o '[0-9]* GB/s' | grep -o '[0-9]*' | head -1)}
  python3 tools/ncu_step_breakdown.py "$OUT/step_$PROFILE.csv" "${FLOOR:-4500}" >"$OUT/step_breakdown_$PROFILE.md"
  cat "$OUT/step_breakdown_$PROFILE.md"
  gzip -f "$OUT/step_$PROFILE.csv"
fi

if [ -n "$NCU_SRC" ]; then
  # One ncu run per regex: the first matching launch of one step, its report imported twice (details,
  # the SASS source page with per-instruction stall samples).
  F=/tmp/bonsai27-ptq1_0.gguf D=/tmp/drafter27.gguf
  ensure_27b ptq1_0
  IFS=';' read -r -a KRX <<<"$NCU_SRC"
  n=0
  for rx in "${KRX[@]}"; do
    n=$((n + 1))
    R="$OUT/ncu_${NCU_STEP:-decode}_$n"
    t0=$(date +%s)
    DFLASH_PROFILE_STEP=${NCU_STEP:-decode} timeout 300 ncu --profile-from-start off --kernel-name-base demangled \
      -k "regex:$rx" -c 1 --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
      --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters --import-source no \
      -f -o "$R" "$G/bench_cuda_ops" --model "$F" --drafter "$D" --model-only --tokens 4 >"$R.app.log" 2>&1
    echo "ncu $rx (${NCU_STEP:-decode}): exit $? in $(( $(date +%s) - t0 )) s"
    ncu --import "$R.ncu-rep" --page details >"$R.txt" 2>&1
    ncu --import "$R.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip >"$R"_sass.csv.gz
    rm -f "$R.ncu-rep"  # (not readable on the build machine; the two pages keep what is used)
    grep -E "Duration|Registers Per|Achieved Active Warps|Warp Cycles Per Issued|Issued Ipc" "$R.txt" | head -8
  done
fi

if [ -n "$TIMELINE" ]; then
  F=/tmp/bonsai27-$TIMELINE.gguf D=/tmp/drafter27.gguf
  ensure_27b "$TIMELINE"
  t0=$(date +%s)
  DFLASH_STEP_TIMELINE=1 timeout 200 "$G/bench_cuda_ops" --model "$F" --drafter "$D" --model-only \
    --out "$OUT/timeline_$TIMELINE.md" >"$OUT/timeline_$TIMELINE.log" 2>&1
  echo "timeline $TIMELINE: exit $? in $(( $(date +%s) - t0 )) s"
  grep -E "^decode|^verify|^draft|^###|kernels, span" "$OUT/timeline_$TIMELINE.md"
fi

if [ -n "$AB" ]; then
  # The current build against gpu_$AB (--stage-ab), alternating, on the 27B pair (written if missing).
  F=/tmp/bonsai27-${DBENCH:-ptq1_0}.gguf D=/tmp/drafter27.gguf
  ensure_27b "${DBENCH:-ptq1_0}"
  fresh_unpack "$BD/gpu_$AB" "$BD/gpu_$AB"
  if [ -n "$TIMELINE" ]; then  # the other build's timeline too, for a kernel-by-kernel comparison
    DFLASH_STEP_TIMELINE=1 LD_LIBRARY_PATH="$PWD/$BD/gpu_$AB/lib" timeout 200 "$BD/gpu_$AB/bench_cuda_ops" --model "$F" \
      --drafter "$D" --model-only --out "$OUT/timeline_${TIMELINE}_$AB.md" >"$OUT/timeline_${TIMELINE}_$AB.log" 2>&1
    echo "timeline $TIMELINE of gpu_$AB: exit $?"
    grep -E "^decode|^verify|^draft|kernels, span" "$OUT/timeline_${TIMELINE}_$AB.md"
    # kernel by kernel, the largest changes first (in the logs pack, and printed)
    python3 tools/timeline_diff.py "$OUT/timeline_$TIMELINE.md" "$OUT/timeline_${TIMELINE}_$AB.md" --top 8 \
      >"$OUT/timeline_diff_$AB.log" 2>&1 && cat "$OUT/timeline_diff_$AB.log"
  fi
  for i in $(seq 1 "$AB_RUNS"); do
    for B in "$G" "$BD/gpu_$AB"; do
      echo "== $B ($(tr '\n' ' ' <"$B/COMMIT"))"
      LD_LIBRARY_PATH="$PWD/$B/lib" timeout 150 "$B/bench_cuda_ops" --model "$F" --drafter "$D" --model-only 2>&1 |
        grep -E "^decode|^verify|^draft step"
      [ -x "$B/dflash" ] && LD_LIBRARY_PATH="$PWD/$B/lib" timeout 150 "$B/dflash" bench --device cuda -m "$F" -p 512 \
        -n 8 -r 3 --no-spec 2>/dev/null | grep pp512
    done
  done | tee "$OUT/ab_$AB.txt"
fi

if [ -n "$ENVAB" ]; then
  # Runtime switches of one build against its defaults, alternating, on the 27B pair.
  F=/tmp/bonsai27-${DBENCH:-ptq1_0}.gguf D=/tmp/drafter27.gguf
  ensure_27b "${DBENCH:-ptq1_0}"
  IFS=';' read -r -a SETS <<<"$ENVAB"
  for i in $(seq 1 "$AB_RUNS"); do
    for E in "" "${SETS[@]}"; do
      echo "== env: ${E:-(defaults)}"
      env $E timeout 150 "$G/bench_cuda_ops" --model "$F" --drafter "$D" --model-only 2>&1 |
        grep -E "^decode|^verify|^draft step|rror"
      [ $ENVAB_PP = 1 ] && env $E timeout 150 "$G/dflash" bench --device cuda -m "$F" -p 512 -n 8 -r 3 --no-spec \
        2>/dev/null | grep pp512
    done
  done | tee "$OUT/env_ab.txt"
fi

echo "================ summary"
[ -f "$OUT/test_cuda.log" ] && grep -E "FAILED|PASSED|SKIPPED" "$OUT/test_cuda.log" | head -20
[ -f "$OUT/test_cuda_attn_generic.log" ] && grep -E "FAILED|PASSED" "$OUT/test_cuda_attn_generic.log" | sed 's/^/generic attention: /' | head -10
[ -f "$OUT/test_cuda_table.md" ] && { grep -E "FAIL" "$OUT/test_cuda_table.md" | head -20; tail -1 "$OUT/test_cuda_table.md"; }
[ -f "$OUT/bench.md" ] && cat "$OUT/bench.md"
for f in "$OUT"/bench_model_*.md; do [ -f "$f" ] && cat "$f"; done
if [ -n "$DEST" ] && [ "$(cd "$DEST" 2>/dev/null && pwd -P)" != "$(cd "$OUT" && pwd -P)" ]; then
  mkdir -p "$DEST"
  n=0
  for f in "$OUT"/test_cuda_table.md "$OUT"/ncu_*.txt "$OUT"/dflash_bench_*.md "$OUT"/timeline_*.md "$OUT"/step_breakdown_*.md \
    "$OUT"/ab_*.txt "$OUT"/env_ab.txt "$OUT"/attention.md "$OUT"/bench.md "$OUT"/bench_model_*.md; do
    [ -f "$f" ] && [ $n -lt 7 ] && cp "$f" "$DEST/" && n=$((n + 1))
  done
  tar czf "$DEST/gpu_logs.tgz" -C "$OUT" . && echo "logs: $DEST/gpu_logs.tgz; tables: $n in $DEST"
fi
exit $rc
