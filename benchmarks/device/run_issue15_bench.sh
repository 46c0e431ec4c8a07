#!/usr/bin/env bash
# Device run for issue 15 (session 5), last call: the GPU tests of the plan changes made after run_issue15.sh, then
# bench_ssd.py on every shape with mamba_ssm and TileGym in the same run, then head dims 64/80 with an initial state.
#   source <cutile bundle>/device-env.sh; ANCHORS=<dir with mamba_ssm_triton/, tilegym/, einops/> \
#       bash benchmarks/device/run_issue15_bench.sh
# Logs under $OUT (tests.log, bench.log, results.md, init.log, init.md).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${ANCHORS}:${PYTHONPATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
date -u; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
t0=$(date +%s)
timeout ${TEST_TIMEOUT:-120} python3 -m pytest -v -m gpu -n ${NPROC:-8} -p no:cacheprovider tests/kernels/test_ssd.py \
    -k "${KEXPR:-P32_N256 or (merged_tail and P48) or d_state_256_default}" >"$OUT/tests.log" 2>&1
echo "tests rc $? in $(( $(date +%s) - t0 )) s: $(grep -c ' PASSED' "$OUT/tests.log") passed," \
     "$(grep -c ' FAILED' "$OUT/tests.log") failed"
grep -E "^FAILED|Error" "$OUT/tests.log" | head -20
t0=$(date +%s)
timeout ${BENCH_TIMEOUT:-250} python3 benchmarks/bench_ssd.py --anchors "$ANCHORS" --no-reference --rep 100 --jobs 12 \
    --shapes "${SHAPES:-a,b,c,d,nemotron_h_8b,nemotron_nano_9b,nemotron3_30b,granite4_small,falcon_h1_7b,nemotron3_30b_fp16,c_odd}" \
    --results "$OUT/results.md" >"$OUT/bench.log" 2>&1
echo "bench rc $? in $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout ${INIT_TIMEOUT:-80} python3 benchmarks/bench_ssd.py --no-mamba --no-tilegym --no-reference --rep 100 --jobs 12 \
    --eager-only --initial-state --shapes nemotron_h_8b,nemotron_nano_9b --variants "auto,64:64:2:2::::::0" \
    --results "$OUT/init.md" >"$OUT/init.log" 2>&1
echo "init rc $? in $(( $(date +%s) - t0 )) s"
grep -E " ms " "$OUT/bench.log" "$OUT/init.log" | sed 's/^.*log://' | cut -c1-150
