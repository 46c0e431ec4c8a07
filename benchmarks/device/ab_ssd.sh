#!/usr/bin/env bash
# Device run: the same GPU tests and SSD benchmark on two source trees in one call (before/after a kernel change).
# Usage on the device machine, from the repository root, after `source .devcarry/cutile/device-env.sh`:
#   bash benchmarks/device/ab_ssd.sh OLD_TREE NEW_TREE "<pytest -k expr for both>" "<pytest args for NEW only>" \
#        "<bench variants>" "<bench shapes>"
# Each tree is a copy of the repository (m2export/, tests/, benchmarks/). Logs under $OUT (old_*, new_*).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
OLD=$1 NEW=$2 KBOTH=${3:-} NEWTESTS=${4:-} VARIANTS=${5:-auto} SHAPES=${6:-a,b,c,d}
base=${PYTHONPATH:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
for side in old new; do
  tree=$OLD; [ $side = new ] && tree=$NEW
  if [ -n "$KBOTH" ]; then
    (cd "$tree" && PYTHONPATH=.:$base timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -m gpu -n ${NPROC:-12} \
       -p no:cacheprovider tests/kernels/test_ssd.py -k "$KBOTH" 2>&1 | tail -25) | tee "$OUT/${side}_tests.log"
  fi
done
for side in old new; do
  tree=$OLD; [ $side = new ] && tree=$NEW
  if [ "$VARIANTS" != skip ]; then
    (cd "$tree" && PYTHONPATH=.:$base python3 benchmarks/bench_ssd.py --shapes "$SHAPES" --variants "$VARIANTS" \
       --no-reference --no-mamba --rep 100 --jobs 12 --results "$OUT/${side}_results.md" 2>&1 | grep -v warm-up) \
       | tee "$OUT/${side}_bench.log"
  fi
done
if [ -n "$NEWTESTS" ]; then
  (cd "$NEW" && PYTHONPATH=.:$base timeout ${NEW_TIMEOUT:-300} python3 -m pytest -q -m gpu -n ${NPROC:-12} \
     -p no:cacheprovider $NEWTESTS 2>&1 | tail -30) | tee "$OUT/new_full_tests.log"
fi
for side in old new; do [ -f "$OUT/${side}_bench.log" ] && { echo "== $side"; grep " ms " "$OUT/${side}_bench.log"; }; done
