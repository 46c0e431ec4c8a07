#!/usr/bin/env bash
# Device run (issue 18): the constraints ct.launch derives for the layer's strided views, the GPU tests of
# the conv1d / gated-norm kernels and of the scan on views, then bench_layer.py with its variants.
#   source .devcarry/cutile/device-env.sh; bash benchmarks/device/run_fusion.sh
# TESTS / KEXPR: pytest files and -k expression (KEXPR=skip: no tests); BENCH=skip: no benchmark;
# BENCH_ARGS: extra bench_layer.py arguments. WARM=1: while the tests run, a first bench_layer.py pass (--rep 1,
# results thrown away) compiles every kernel the benchmark launches into cuTile's disk cache, so the timed pass
# after the tests compiles nothing. Logs (tests.log verbose: one PASSED/FAILED line per test; bench.log) and
# results.md under $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
date -u | tee "$OUT/gpu.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee -a "$OUT/gpu.txt"
python3 - <<'PY' 2>&1 | tee "$OUT/signature.txt"
import torch
from cuda.tile.compilation import CallingConvention, KernelSignature
from m2export.kernels.conv1d.cutile import STREAM_LATENCY, STREAM_PREFETCH, stream_kernel
zx = torch.empty(4, 64, 10576, dtype=torch.bfloat16, device="cuda")
x = zx[..., 5120:5120 + 5376]
st = torch.empty(4, 5376, 3, dtype=torch.bfloat16, device="cuda")
y = torch.empty(4, 64, 5376, dtype=torch.bfloat16, device="cuda")
w = torch.empty(5376, 4, dtype=torch.bfloat16, device="cuda")
sig = KernelSignature.from_kernel_args(stream_kernel(), [x, w, w[:, 0], st, y, st, 272, 16, 128, 4, True, True, True,
                                                         STREAM_LATENCY, STREAM_PREFETCH, False],
                                       CallingConvention.cutile_python_v1())
for c in sig.parameters[:6] if hasattr(sig, "parameters") else [sig]:
    print(c)
PY
if [ "${WARM:-0}" = 1 ] && [ "${BENCH:-}" != skip ]; then
  ( t0=$(date +%s); timeout "${WARM_TIMEOUT:-300}" python3 benchmarks/bench_layer.py --rep 1 --results /tmp/warm.md \
      ${BENCH_ARGS:-} >"$OUT/warm.log" 2>&1; echo "warm-up: rc $? in $(( $(date +%s) - t0 )) s" >>"$OUT/warm.log" ) &
  warm=$!
fi
if [ "${KEXPR:-}" != skip ]; then
  t0=$(date +%s)
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -v -m gpu -n "${NPROC:-12}" -p no:cacheprovider \
      ${TESTS:-tests/kernels/test_conv1d.py tests/kernels/test_gated_norm.py tests/kernels/test_ssd_step.py tests/kernels/test_ssd.py} \
      ${KEXPR:+-k "$KEXPR"} >"$OUT/tests.log" 2>&1
  echo "tests: rc $? in $(( $(date +%s) - t0 )) s: $(grep -c ' PASSED' "$OUT/tests.log") passed," \
       "$(grep -c ' FAILED' "$OUT/tests.log") failed, $(grep -c ' SKIPPED' "$OUT/tests.log") skipped," \
       "$(grep -c ' ERROR' "$OUT/tests.log") errors" | tee -a "$OUT/summary.txt"
  grep -E "^(FAILED|ERROR)|(FAILED|ERROR) tests" "$OUT/tests.log" | cut -c1-240 | head -20
fi
if [ "${BENCH:-}" != skip ]; then
  [ -n "${warm:-}" ] && { wait "$warm"; tail -1 "$OUT/warm.log"; }
  echo "load before the timed bench: $(cat /proc/loadavg)" >> "$OUT/gpu.txt"
  timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/bench_layer.py --rep "${REP:-60}" --results "$OUT/results.md" \
      ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
  echo "bench: rc $?" >>"$OUT/bench.log"
  grep -E " us |rc |FAILED|Error" "$OUT/bench.log" | cut -c1-200 | tail -120
fi
date -u
