#!/usr/bin/env bash
# Device run for the hybrid models' shapes (issue 15): GPU tests of the new head dims / d_state / chunk, then
# bench_ssd.py on every shape with mamba_ssm and TileGym in the same run, then eager config sweeps. From the tree root:
#   source <cutile bundle>/device-env.sh; ANCHORS=<dir with mamba_ssm_triton/, tilegym/, einops/> \
#       bash benchmarks/device/run_shapes.sh
# Logs under $OUT (tests.log, bench.log, results.md, sweep.log, sweep.md). Knobs (environment):
#   TESTS, KEXPR (pytest files and -k; KEXPR=skip: no tests), NPROC, TEST_TIMEOUT;
#   SHAPES (bench shapes; skip: no bench), VARIANTS (their cuTile variants, default auto), BENCH_TIMEOUT;
#   JOBS2: ';'-separated "shapes|variants|extra flags" benchmark jobs after it, with the anchors and graph timing
#   (e.g. "falcon_h1_7b|auto,64:16:1:3|--no-tilegym"), results in results2.md, JOB2_TIMEOUT per job;
#   SWEEPS: ';'-separated "shapes|variants" jobs (bench_ssd.py --variants syntax; empty: none), SWEEP_FLAGS
#   (extra bench flags for every sweep, e.g. --initial-state), SWEEP_TIMEOUT (per job).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${ANCHORS:-}:${PYTHONPATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
date -u; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
KEXPR=${KEXPR:-new_dims or chunk_size_attribute or large_decay or test_lengths or split_plan or test_step}
if [ "$KEXPR" != skip ]; then
  t0=$(date +%s)
  timeout ${TEST_TIMEOUT:-170} python3 -m pytest -v -m gpu -n ${NPROC:-8} -p no:cacheprovider \
      ${TESTS:-tests/kernels/test_ssd.py tests/kernels/test_ssd_step.py} -k "$KEXPR" >"$OUT/tests.log" 2>&1
  echo "tests rc $? in $(( $(date +%s) - t0 )) s: $(grep -c ' PASSED' "$OUT/tests.log") passed," \
       "$(grep -c ' FAILED' "$OUT/tests.log") failed, $(grep -c ' SKIPPED' "$OUT/tests.log") skipped"
  grep -E "^FAILED|Error" "$OUT/tests.log" | head -20
fi
SHAPES=${SHAPES:-a,b,c,d,nemotron_h_8b,nemotron_nano_9b,nemotron3_30b,granite4_small,falcon_h1_7b,nemotron3_30b_fp16,c_odd}
if [ "$SHAPES" != skip ]; then
  t0=$(date +%s)
  timeout ${BENCH_TIMEOUT:-210} python3 benchmarks/bench_ssd.py --anchors "${ANCHORS:-.devcarry}" --no-reference \
      --rep 100 --jobs 12 --shapes "$SHAPES" --variants "${VARIANTS:-auto}" --results "$OUT/results.md" \
      >"$OUT/bench.log" 2>&1
  echo "bench rc $? in $(( $(date +%s) - t0 )) s"
fi
IFS=';' read -ra jobs2 <<< "${JOBS2:-}"
for job in "${jobs2[@]}"; do
  [ -n "$job" ] || continue
  IFS='|' read -r j_shapes j_variants j_flags <<< "$job"
  t0=$(date +%s)
  timeout ${JOB2_TIMEOUT:-60} python3 benchmarks/bench_ssd.py --anchors "${ANCHORS:-.devcarry}" --no-reference \
      --rep 100 --jobs 12 --shapes "$j_shapes" --variants "$j_variants" $j_flags --results "$OUT/results2.md" \
      >>"$OUT/bench2.log" 2>&1
  echo "job2 $j_shapes rc $? in $(( $(date +%s) - t0 )) s"
done
IFS=';' read -ra jobs <<< "${SWEEPS-falcon_h1_7b|auto,64:32::2,64:16::2}"
for job in "${jobs[@]}"; do
  [ -n "$job" ] || continue
  t0=$(date +%s)
  timeout ${SWEEP_TIMEOUT:-50} python3 benchmarks/bench_ssd.py --no-mamba --no-tilegym --no-reference --rep 100 \
      --jobs 12 --eager-only ${SWEEP_FLAGS:-} --shapes "${job%%|*}" --variants "${job##*|}" --results "$OUT/sweep.md" \
      >>"$OUT/sweep.log" 2>&1
  echo "sweep ${job%%|*} rc $? in $(( $(date +%s) - t0 )) s"
done
grep -hE " ms " "$OUT"/bench.log "$OUT"/bench2.log "$OUT"/sweep.log 2>/dev/null | cut -c1-150
