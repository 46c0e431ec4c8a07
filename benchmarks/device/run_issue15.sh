#!/usr/bin/env bash
# Device run for issue 15 (session 5): GPU tests of the merged headdim tail, the d_state-256 plans and the tests
# the first steps left unrun; then an eager sweep of the head-dim-80 and d_state-256 plans. From the tree root:
#   source <cutile bundle>/device-env.sh; bash benchmarks/device/run_issue15.sh
# Logs under $OUT (tests.log, sweep.log, sweep.md). TESTS / KEXPR / SWEEP_SHAPES / SWEEP override the defaults.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
date -u; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
t0=$(date +%s)
timeout ${TEST_TIMEOUT:-230} python3 -m pytest -v -m gpu -n ${NPROC:-8} -p no:cacheprovider \
    ${TESTS:-tests/kernels/test_ssd.py tests/kernels/test_ssd_step.py} \
    -k "${KEXPR:-merged_tail or d_state_256_plans or split_large_decay or chunk_size_attribute or test_split_plan[ or P80_N128_Q64_L64-auto or P96_N128_Q128_L128-auto or P48_N64_Q64_L64-auto or P80_N128_Q64_L193-aot or (test_step and (P80 or P96 or P48))}" \
    >"$OUT/tests.log" 2>&1
echo "tests rc $? in $(( $(date +%s) - t0 )) s: $(grep -c ' PASSED' "$OUT/tests.log") passed," \
     "$(grep -c ' FAILED' "$OUT/tests.log") failed, $(grep -c ' SKIPPED' "$OUT/tests.log") skipped"
grep -E "^FAILED|Error" "$OUT/tests.log" | head -20
# head dim 80 beside head dim 64 on the same model shape (per-row cost), then the d_state-256 plans
for job in "nemotron_h_8b,nemotron_nano_9b|${SWEEP_P80:-auto,64:64:1:2::::::0,64:64:2:2::::::0}" \
           "falcon_h1_7b|${SWEEP_FALCON:-auto,32:32:2:2,32:16::2,32:16:2:2,64:16::2,64:16:2:2}"; do
  t0=$(date +%s)
  timeout ${SWEEP_TIMEOUT:-110} python3 benchmarks/bench_ssd.py --no-mamba --no-tilegym --no-reference --rep 100 \
      --jobs 12 --eager-only --shapes "${job%%|*}" --variants "${job##*|}" --results "$OUT/sweep.md" >>"$OUT/sweep.log" 2>&1
  echo "sweep ${job%%|*} rc $? in $(( $(date +%s) - t0 )) s"
done
grep -E " ms " "$OUT/sweep.log" | cut -c1-120
