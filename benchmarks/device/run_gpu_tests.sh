#!/usr/bin/env bash
# Device run: the GPU tests in two stages, both verbose (one PASSED/FAILED line per test) with a junit record.
#   source <cutile bundle>/device-env.sh; FIRST="<-k expr>" bash benchmarks/device/run_gpu_tests.sh
# Stage 1: the tests matching FIRST (the ones that matter most this call) under FIRST_TIMEOUT; stage 2: every
# other GPU test of TESTS under REST_TIMEOUT (REST_TIMEOUT=0: skip it). Logs under $OUT (first.log, rest.log,
# *.xml, gpu.txt). NPROC: pytest-xdist workers (compiles dominate: 8 on the 16-core H200 machine).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
# One CPU thread pool per xdist worker, sized to share the cores: 16 workers each with torch's default pool (one
# thread per core) put the 16-core device machine at load ~150 (helper fuse, 2026-12-02), starving the compiles.
_threads=$(( $(nproc) / ${NPROC:-8} )); [ "$_threads" -lt 1 ] && _threads=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$_threads} MKL_NUM_THREADS=${MKL_NUM_THREADS:-$_threads}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TESTS=${TESTS:-tests/kernels tests/plugins}
date -u | tee "$OUT/gpu.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee -a "$OUT/gpu.txt"
python3 -c "import torch, triton, cuda.tile as ct; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda.tile', ct.__version__)" | tee -a "$OUT/gpu.txt"
stage() {  # name, timeout, -k expression
  local t0; t0=$(date +%s)
  timeout "$2" python3 -m pytest -v -m gpu -n "${NPROC:-8}" -p no:cacheprovider --junitxml="$OUT/$1.xml" \
      $TESTS -k "$3" >"$OUT/$1.log" 2>&1
  echo "$1: rc $? in $(( $(date +%s) - t0 )) s: $(grep -c ' PASSED' "$OUT/$1.log") passed," \
       "$(grep -c ' FAILED' "$OUT/$1.log") failed, $(grep -c ' SKIPPED' "$OUT/$1.log") skipped," \
       "$(grep -c ' ERROR' "$OUT/$1.log") errors" | tee -a "$OUT/summary.txt"
  grep -E "^(FAILED|ERROR)|(FAILED|SKIPPED|ERROR) tests" "$OUT/$1.log" | cut -c1-300 | head -30
}
stage first "${FIRST_TIMEOUT:-300}" "${FIRST:?set FIRST to a -k expression}"
[ "${REST_TIMEOUT:-0}" != 0 ] && stage rest "$REST_TIMEOUT" "not (${FIRST})"
date -u
