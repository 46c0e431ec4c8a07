"""Where an ORT decode token's time goes: m2export's native graph vs mobius-onnx's, same checkpoint, one process.

Two parts (``benchmarks/bench_ort.py`` makes the exports, or pass ``--graph NAME=PATH`` twice or more):

* sessions: ``--sets`` fresh sets of sessions, each holding two sessions of every graph (created in alternating
  orders: A, B, A', B' then B', A', B, A), ``--steps`` interleaved decode steps each after a 16-token prefill;
  median ms per token of every session. Shows how far two sessions of the *same* graph in one process differ
  (their memory's placement) next to how far the graphs differ;
* profile: one more set with ORT profiling on, the median per token of each op type's summed node time (MatMul
  split into the in-projections, out-projections and the lm_head by node name; an ``If``'s time includes its
  branch's nodes, which are also counted under their own op), the ``model_run`` time and the node count.

Results: a markdown table on stdout, appended to benchmarks/RESULTS.md.

    python benchmarks/bench_ort_decode.py --workdir /tmp/m2export-bench-ort
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gc
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


def _decode(runners: dict, steps: int) -> dict[str, list[float]]:
    """ms per decode step of each runner, interleaved, after a 16-token prefill."""
    import numpy as np

    states = {k: r.run(np.ones((1, 16), np.int64))[1] for k, r in runners.items()}
    tok = np.array([[1]], np.int64)
    ts = {k: [] for k in runners}
    for _ in range(steps):
        for k, r in runners.items():
            t = time.perf_counter()
            _, states[k] = r.run(tok, states[k])
            ts[k].append(1e3 * (time.perf_counter() - t))
    return ts


def _op_class(op: str, node: str) -> str:
    if op != "MatMul":
        return op
    return "MatMul lm_head" if ("logits" in node or "lm_head" in node) else \
        "MatMul in_proj" if "in_proj" in node else "MatMul out_proj" if "out_proj" in node else "MatMul other"


def _profile(path: Path) -> dict[str, float]:
    """op class -> median ms per decode token (the first model_run, the prefill, left out); plus totals."""
    ev = json.loads(Path(path).read_text())
    runs = [e for e in ev if e.get("name") == "model_run"][1:]
    starts = [e["ts"] for e in runs]
    acc: dict[int, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    count: dict[int, int] = collections.defaultdict(int)
    for e in ev:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and e["ts"] >= starts[0]:
            i = bisect.bisect_right(starts, e["ts"]) - 1
            acc[i][_op_class(e["args"].get("op_name", "?"), e["name"])] += e["dur"] / 1e3
            count[i] += 1
    classes = {c for d in acc.values() for c in d}
    out = {c: statistics.median(acc[i].get(c, 0.0) for i in acc) for c in classes}
    out["model_run"] = statistics.median(e["dur"] / 1e3 for e in runs)
    out["node events"] = statistics.median(count.values())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graph", action="append", metavar="NAME=PATH",
                    help="a decoder graph (default: bench_ort.py's 130m exports in --workdir)")
    ap.add_argument("--workdir", default="/tmp/m2export-bench-ort")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sets", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--results", default=str(ROOT / "RESULTS.md"))
    args = ap.parse_args(argv)
    import onnxruntime

    if args.graph:
        graphs = dict(g.split("=", 1) for g in args.graph)
    else:
        w = Path(args.workdir)
        graphs = {"m2export native": w / "m2export-130m" / "model.onnx",
                  "mobius": next(iter(sorted((w / "mobius-130m").rglob("model.onnx"))), None)}
    graphs = {k: Path(v) for k, v in graphs.items() if v is not None}
    for k, v in graphs.items():
        if not v.is_file():
            ap.error(f"--graph {k}: no such file {v} (run benchmarks/bench_ort.py --checkpoint 130m first)")
    load0 = os.getloadavg()[0]
    rows = []
    for s in range(args.sets):
        names = [(k, i) for i in (0, 1) for k in graphs]
        order = names if s % 2 == 0 else names[::-1]
        runners = {f"{k} #{i + 1}": Runner(graphs[k], args.threads) for k, i in order}
        ts = _decode(runners, args.steps)
        rows.append(" | ".join(f"{k}: {statistics.median(v):.1f} (best {min(v):.1f})" for k, v in ts.items()))
        del runners
        gc.collect()
    prof_dir = Path(args.workdir) / "profiles-decode"
    prof_dir.mkdir(parents=True, exist_ok=True)
    runners = {k: Runner(g, args.threads, profile_dir=prof_dir) for k, g in graphs.items()}
    _decode(runners, args.steps)
    prof = {k: _profile(Path(r.sess.end_profiling())) for k, r in runners.items()}
    del runners
    now = utc_now()
    lines = [f"## bench_ort_decode.py — {now} — CPU {os.cpu_count()} cores ({platform.machine()}, shared), "
             f"onnxruntime {onnxruntime.__version__}, {args.threads} threads, {args.steps} interleaved decode steps "
             f"per session after a 16-token prefill, load {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at "
             "the end", "",
             "Sessions (two of each graph per set, alternating creation order): median (best) ms per token", ""]
    lines += [f"* set {i + 1}: {r}" for i, r in enumerate(rows)]
    classes = sorted({c for p in prof.values() for c in p} - {"model_run", "node events"},
                     key=lambda c: -max(p.get(c, 0.0) for p in prof.values()))
    lines += ["", "Profile (one more set, profiling on): median ms per token", "",
              "| op | " + " | ".join(prof) + " |", "|---|" + "---|" * len(prof)]
    for c in ["model_run", "node events"] + classes:
        lines.append(f"| {c} | " + " | ".join(f"{p.get(c, 0.0):.3f}" if c != "node events" else f"{p[c]:.0f}"
                                             for p in prof.values()) + " |")
    publish("\n".join(lines) + "\n", args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
