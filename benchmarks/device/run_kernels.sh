#!/usr/bin/env bash
# Device run: SSD kernel tests (GPU) then the benchmark. Usage on the device machine:
#   source .devcarry/cutile/device-env.sh; bash benchmarks/device/run_kernels.sh "<pytest -k expr or ''>" "<variants>" "<shapes>"
# Writes logs under $OUT. Needs .devcarry/wheels (pytest-xdist, execnet) and optionally .devcarry/mamba_ssm_triton.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
KEXPR=${1:-}
VARIANTS=${2:-auto}
SHAPES=${3:-a,b,c,d}
pip install -q --no-index --no-deps .devcarry/wheels/*.whl >"$OUT/pip.log" 2>&1 || echo "pip failed (see pip.log)"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
if [ "$KEXPR" != "skip" ]; then
  t0=$(date +%s)
  timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -m gpu -n ${NPROC:-12} ${KEXPR:+-k "$KEXPR"} ${TESTS:-tests/kernels tests/plugins} -p no:cacheprovider \
      2>&1 | tail -40 | tee "$OUT/tests.log"
  echo "tests: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/tests.log"
fi
if [ "$VARIANTS" != "skip" ]; then
  t0=$(date +%s)
  python3 benchmarks/bench_ssd.py --shapes "$SHAPES" --variants "$VARIANTS" --no-reference --rep 100 --jobs 12 \
      --results "$OUT/results.md" 2>&1 | tee "$OUT/bench.log"
  echo "bench: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log"
fi
