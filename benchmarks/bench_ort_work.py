"""How much work each ORT decoder graph does per call: m2export's native graph vs mobius-onnx's, same checkpoint.

On a shared machine the wall time of one call moves by 10-30% with the other engineers' load, so two graphs
running the same MatMuls with the same weights cannot be ranked by wall time alone. This script measures what
the load moves least, per prefill (``--seqlens``) and per decode token, every graph's sessions interleaved
(graph A, B, A, B, ...):

* ORT kernels per call (the profile's node events: deterministic);
* the profile summed per op type, median per call (MatMul split into the in-projections, out-projections and
  lm_head by node name, as in ``bench_ort_decode.py``), and the ops that differ between the graphs totalled
  (``rest``: every op but the MatMuls and LinearAttention, which the graphs share kernel for kernel);
* the calling thread's CPU time per call (``time.thread_time``; with ``--threads 1``, the default, ORT runs every
  kernel on the calling thread, so this is the call's own CPU time, not other processes'), best and median.

Results: a markdown table on stdout, appended to benchmarks/RESULTS.md.

    python benchmarks/bench_ort_work.py --workdir /tmp/m2export-bench-ort      # bench_ort.py's 130m exports
    python benchmarks/bench_ort_work.py --graph ours=a/model.onnx --graph mobius=b/model.onnx
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from _report import publish, utc_now  # noqa: E402
from bench_ort import Runner  # noqa: E402
from bench_ort_decode import _op_class  # noqa: E402

#: op classes the native graph and mobius's run with the same kernels on the same data (left out of ``rest``)
SHARED = ("MatMul in_proj", "MatMul out_proj", "MatMul lm_head", "MatMul other", "LinearAttention")


def _per_call(path: Path, skip: int) -> dict[str, float]:
    """op class -> median ms per call over the profile's model_runs after the first ``skip``; plus
    ``kernels`` (median node events per call) and ``model_run`` (median ms)."""
    ev = json.loads(Path(path).read_text())
    runs = [e for e in ev if e.get("name") == "model_run"]
    starts = [e["ts"] for e in runs]
    acc: dict[int, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    count: dict[int, int] = collections.defaultdict(int)
    for e in ev:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            i = bisect.bisect_right(starts, e["ts"]) - 1
            acc[i][_op_class(e["args"].get("op_name", "?"), e["name"])] += e["dur"] / 1e3
            count[i] += 1
    keep = list(range(skip, len(runs)))
    out = {c: statistics.median(acc[i].get(c, 0.0) for i in keep) for c in {c for i in keep for c in acc[i]}}
    out["rest"] = statistics.median(sum(v for c, v in acc[i].items() if c not in SHARED) for i in keep)
    out["model_run"] = statistics.median(runs[i]["dur"] / 1e3 for i in keep)
    out["kernels"] = statistics.median(count[i] for i in keep)
    return out


def run(graphs: dict[str, Path], threads: int, seqlens, reps: int, steps: int, vocab: int, prof_dir: Path) -> dict:
    """(what, graph) -> profile per call plus ``cpu`` (best, median) ms; what is ``prefill L=..`` or ``decode``."""
    import numpy as np

    rng = np.random.default_rng(0)
    res = {}
    for what in [f"prefill L={L}" for L in seqlens] + ["decode"]:
        runners = {k: Runner(g, threads, profile_dir=prof_dir) for k, g in graphs.items()}
        cpu = {k: [] for k in graphs}
        if what == "decode":
            states = {k: r.run(np.ones((1, 16), np.int64))[1] for k, r in runners.items()}  # profiled run 0
            feeds, n, skip = np.array([[1]], np.int64), steps, 1
        else:
            feeds, n, skip = rng.integers(0, vocab, (1, int(what.split("=")[1])), dtype=np.int64), reps, 1
            for r in runners.values():
                r.run(feeds)  # warm-up (profiled run 0)
        for _ in range(n):
            for k, r in runners.items():
                t = time.thread_time()
                if what == "decode":
                    _, states[k] = r.run(feeds, states[k])
                else:
                    r.run(feeds)
                cpu[k].append(1e3 * (time.thread_time() - t))
        for k, r in runners.items():
            res[(what, k)] = {**_per_call(Path(r.sess.end_profiling()), skip),
                              "cpu": (min(cpu[k]), statistics.median(cpu[k]))}
        del runners
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graph", action="append", metavar="NAME=PATH",
                    help="a decoder graph (default: bench_ort.py's 130m exports in --workdir)")
    ap.add_argument("--workdir", default="/tmp/m2export-bench-ort")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--reps", type=int, default=10, help="prefill calls per graph and length")
    ap.add_argument("--steps", type=int, default=60, help="decode steps per graph")
    ap.add_argument("--vocab", type=int, default=50280)
    ap.add_argument("--results", default=str(ROOT / "RESULTS.md"))
    args = ap.parse_args(argv)
    import onnxruntime

    if args.graph:
        graphs = {k: Path(v) for k, v in (g.split("=", 1) for g in args.graph)}
    else:
        w = Path(args.workdir)
        mob = next(iter(sorted((w / "mobius-130m").rglob("model.onnx"))), w / "mobius-130m" / "model.onnx")
        graphs = {"m2export native": w / "m2export-130m" / "model.onnx", "mobius": mob}
    for k, v in graphs.items():
        if not v.is_file():
            ap.error(f"--graph {k}: no such file {v} (run benchmarks/bench_ort.py --checkpoint 130m first)")
    prof_dir = Path(args.workdir) / "profiles-work"
    prof_dir.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()[0]
    res = run(graphs, args.threads, args.seqlens, args.reps, args.steps, args.vocab, prof_dir)
    whats = [f"prefill L={L}" for L in args.seqlens] + ["decode"]
    lines = [f"## bench_ort_work.py — {utc_now()} — CPU {os.cpu_count()} cores ({platform.machine()}, shared), "
             f"onnxruntime {onnxruntime.__version__}, {args.threads} thread(s), {args.reps} interleaved prefill calls "
             f"per length, {args.steps} interleaved decode steps (after a 16-token prefill), load {load0:.1f} at the "
             f"start, {os.getloadavg()[0]:.1f} at the end", "",
             "Per call: ORT kernels; thread CPU ms best / median; profile median ms (`rest`: every op but the MatMuls "
             "and LinearAttention)", "",
             "| | " + " | ".join(f"{w}: {k}" for w in whats for k in graphs) + " |",
             "|---|" + "---|" * (len(whats) * len(graphs))]
    cells = lambda f: " | ".join(f(res[(w, k)]) for w in whats for k in graphs)  # noqa: E731
    lines.append("| kernels | " + cells(lambda d: f"{d['kernels']:.0f}") + " |")
    lines.append("| thread CPU ms | " + cells(lambda d: f"{d['cpu'][0]:.2f} / {d['cpu'][1]:.2f}") + " |")
    classes = sorted({c for d in res.values() for c in d} - {"kernels", "cpu", "model_run", "rest"},
                     key=lambda c: -max(d.get(c, 0.0) for d in res.values()))
    for c in ["model_run", "rest"] + classes:
        lines.append(f"| {c} | " + cells(lambda d: f"{d.get(c, 0.0):.3f}") + " |")
    publish("\n".join(lines) + "\n", args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
