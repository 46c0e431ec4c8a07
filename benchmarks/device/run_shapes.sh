#!/usr/bin/env bash
# Device run for the hybrid models' shapes (issue 15): GPU tests of the new head dims / d_state / chunk, then
# bench_ssd.py on every shape with mamba_ssm and TileGym, then a d_state-256 config sweep. From the tree root:
#   source <cutile bundle>/device-env.sh; ANCHORS=<dir with mamba_ssm_triton/, tilegym/, einops/> \
#       bash benchmarks/device/run_shapes.sh
# Logs under $OUT (tests.log, bench.log, results.md, sweep.log).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${ANCHORS}:${PYTHONPATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
t0=$(date +%s)
timeout ${TEST_TIMEOUT:-170} python3 -m pytest -v -m gpu -n ${NPROC:-12} -p no:cacheprovider \
    ${TESTS:-tests/kernels/test_ssd.py tests/kernels/test_ssd_step.py} \
    -k "${KEXPR:-new_dims or chunk_size_attribute or large_decay or test_lengths or split_plan or test_step}" \
    >"$OUT/tests.log" 2>&1
echo "tests rc $? in $(( $(date +%s) - t0 )) s: $(grep -c ' PASSED' "$OUT/tests.log") passed," \
     "$(grep -c ' FAILED' "$OUT/tests.log") failed, $(grep -c ' SKIPPED' "$OUT/tests.log") skipped"
grep -E "FAILED|Error" "$OUT/tests.log" | head -20
t0=$(date +%s)
timeout ${BENCH_TIMEOUT:-210} python3 benchmarks/bench_ssd.py --anchors "$ANCHORS" --no-reference --rep 100 --jobs 12 \
    --shapes "${SHAPES:-a,b,c,d,nemotron_h_8b,nemotron_nano_9b,nemotron3_30b,granite4_small,falcon_h1_7b,nemotron3_30b_fp16,c_odd}" \
    --results "$OUT/results.md" >"$OUT/bench.log" 2>&1
echo "bench rc $? in $(( $(date +%s) - t0 )) s"
timeout ${SWEEP_TIMEOUT:-50} python3 benchmarks/bench_ssd.py --no-mamba --no-tilegym --no-reference --rep 100 --jobs 12 \
    --eager-only --shapes falcon_h1_7b --variants "${SWEEP:-auto,64:32::2,64:16::2}" --results "$OUT/sweep.md" \
    >"$OUT/sweep.log" 2>&1
echo "sweep rc $?"
grep -E " ms " "$OUT/bench.log" "$OUT/sweep.log" | sed 's/^.*log://' | cut -c1-150
