"""ONNX Runtime (CPU) cost of the m2export::CausalConv1d / GatedRMSNorm function bodies (issue 18 item 3).

The ssmscan graph runs each Mamba layer's conv and gated norm through the nodes' model-local functions, the std
graph through the ops the exporter had before (Conv, the Pow/ReduceMean core); the scans are the SSMScan body in
both (std: inlined and constant-folded at export; ssmscan: inlined by ORT at load), so ssmscan vs std is mostly,
not only, what the fused nodes cost ORT. Interleaved runs
(ssmscan, std, ssmscan, ...), median and best of each, load average beside them. Results on stdout (markdown rows
for benchmarks/RESULTS.md), progress on stderr.

    python benchmarks/bench_fused_ort.py [--reps 15] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CASES = {  # name -> random_checkpoint keywords (None: the bundled checkpoint)
    "bundled (d_model 128, 4 layers)": None,
    "130m-shaped, 2 layers (d_model 768, 24 heads x 64, d_state 128)": dict(d_model=768, n_layer=2, vocab_size=1024,
                                                                             d_state=128, headdim=64, ngroups=1,
                                                                             chunk_size=256),
}


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=256)
    args = ap.parse_args()
    from m2export.exporter import OrtModel, export_model
    from m2export.models.checkpoint import random_checkpoint

    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name, kw in CASES.items():
            ck = ROOT / "samples" / "checkpoints" / "stdlib-byte-mamba2" if kw is None else \
                random_checkpoint(Path(d) / f"ck{len(rows)}", seed=0, **kw)
            out = Path(d) / f"out{len(rows)}"
            export_model(ck, out, ssm_impl="both")
            models = {impl: OrtModel(out, impl, threads=args.threads) for impl in ("ssmscan", "std")}
            vocab = 256 if kw is None else kw["vocab_size"]
            ids = np.random.default_rng(0).integers(0, vocab, (1, args.prefill), dtype=np.int64)
            one = ids[:, :1]
            past = {impl: m.io.next_past(m.run(ids)) for impl, m in models.items()}
            times = {(impl, what): [] for impl in models for what in ("prefill", "decode")}
            for r in range(args.reps):
                for impl, m in models.items():
                    t = time.perf_counter()
                    m.run(ids)
                    times[impl, "prefill"].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    m.run(one, past[impl], decode=True)
                    times[impl, "decode"].append(time.perf_counter() - t)
                print(f"{name}: rep {r + 1}/{args.reps}", file=sys.stderr)
            load = open("/proc/loadavg").read().split()[:3]
            for what in ("prefill", "decode"):
                a, b = times["ssmscan", what], times["std", what]
                rows.append(f"| {name} | {what} {'1x' + str(args.prefill) if what == 'prefill' else '1 token'} | "
                            f"{1e3 * statistics.median(a):.2f} / {1e3 * min(a):.2f} | "
                            f"{1e3 * statistics.median(b):.2f} / {1e3 * min(b):.2f} | "
                            f"{statistics.median(a) / statistics.median(b):.2f} | {' '.join(load)} |")
    print("| model | call | ssmscan (fused nodes' bodies) ms median / best | std (Conv, RMS core) ms median / best "
          "| ratio of medians | loadavg |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    sys.exit(main())
