"""One SSMScan node in ONNX Runtime (CPU): the bodies m2export's flavours run, side by side in one process.

Bodies (all from :mod:`m2export.exporter.ssm_scan_op`, inlined, one node, fresh random inputs):

* ``chunked``: the chunked SSD alone (the standard body before the seqlen-1 branch);
* ``ssmscan/std``: the standard body as exported today, ``If(seqlen == 1)`` one recurrence step, else chunked;
* ``native``: the native flavour's body, ``If(seqlen == 1)`` the step, else ORT's com.microsoft LinearAttention.

Each is checked against the float64 oracle (rel-L2 of y and final_state) before timing; timings are
interleaved rounds (one call of each body per round), best and median of ``--reps``, ms per call.
Shapes default to one mamba2-130m layer (24 heads, headdim 64, d_state 128, 1 group, chunk 256).
Prints a markdown table and appends it to benchmarks/RESULTS.md.

    python benchmarks/bench_ort_scan_body.py --seqlens 1 2 8 64 512 --reps 40
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _report import publish, utc_now  # noqa: E402 (benchmarks/_report.py, beside this script)


def _chunked_only_function(opset: int):
    """The standard body without the seqlen-1 branch (what every call ran before it)."""
    from onnx import helper

    from m2export import contract
    from m2export.exporter import ssm_scan_op as op

    b = op._Body()
    e = op._entry(b)
    y, _ = op._chunked_scan(b, e, op._chunk_len(b, e["L"]), final_out=contract.OUTPUT_NAMES[1])
    b.nodes.append(helper.make_node("CastLike", [y, contract.INPUT_NAMES[0]], [contract.OUTPUT_NAMES[0]]))
    ref = op.ssm_scan_function_proto(opset)
    fn = helper.make_function(contract.OP_DOMAIN, contract.OP_NAME, list(contract.INPUT_NAMES),
                              list(contract.OUTPUT_NAMES), b.nodes, [helper.make_opsetid("", opset)],
                              attribute_protos=list(ref.attribute_proto))
    return fn


def _sessions(shape, chunk: int, threads: int):
    import onnxruntime as ort

    from m2export.contract import SSMScanAttrs
    from m2export.exporter.ssm_scan_op import inline_ssm_scan, ssm_scan_node_model

    attrs = [SSMScanAttrs(chunk_size=chunk)]
    models = {"ssmscan/std (If L==1 step)": ssm_scan_node_model(attrs, inline=True),
              "native (If L==1 step, else LinearAttention)": ssm_scan_node_model(attrs, inline=True, native=shape)}
    chunked = ssm_scan_node_model(attrs)
    del chunked.functions[:]
    chunked.functions.append(_chunked_only_function(18))
    models = {"chunked only": inline_ssm_scan(chunked), **models}
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    return {k: ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
            for k, m in models.items()}


def main(argv=None) -> int:
    import onnxruntime
    import torch

    from m2export.contract import SSMScanProblem
    from m2export.kernels.ssd.naive import ssm_scan_recurrent
    from tests.helpers import make_inputs

    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1, 2, 8, 64, 512])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--nheads", type=int, default=24)
    ap.add_argument("--headdim", type=int, default=64)
    ap.add_argument("--d-state", type=int, default=128)
    ap.add_argument("--ngroups", type=int, default=1)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    args = ap.parse_args(argv)

    from m2export.exporter.ssm_scan_op import NativeScanShape

    sess = _sessions(NativeScanShape(args.nheads, args.headdim, args.ngroups, args.d_state), args.chunk_size,
                     args.threads)
    rows = []
    for L in args.seqlens:
        p = SSMScanProblem(args.batch, L, args.nheads, args.headdim, args.ngroups, args.d_state)
        inp = make_inputs(p, seed=L, init_state=True, dt_scale=2.0)
        ref = ssm_scan_recurrent(**inp)
        feed = {k: v.numpy() for k, v in inp.items()}
        times = {k: [] for k in sess}
        err = {}
        for k, s in sess.items():
            y, fs = s.run(None, feed)
            err[k] = max(float(np.linalg.norm(y - ref.y.numpy()) / np.linalg.norm(ref.y.numpy())),
                         float(np.linalg.norm(fs - ref.final_state.numpy()) / np.linalg.norm(ref.final_state.numpy())))
        for _ in range(args.reps):
            for k, s in sess.items():
                t0 = time.perf_counter()
                s.run(None, feed)
                times[k].append((time.perf_counter() - t0) * 1e3)
        rows.append((L, {k: (min(v), statistics.median(v)) for k, v in times.items()}, err))
        print(f"L={L}: " + "; ".join(f"{k} {min(v):.3f} ms" for k, v in times.items()), file=sys.stderr)

    names = list(sess)
    now = utc_now()
    head = (f"### bench_ort_scan_body.py — {now} — CPU ({platform.machine()}), onnxruntime {onnxruntime.__version__}, "
            f"torch {torch.__version__}, {args.threads} intra-op threads; one SSMScan node, batch {args.batch}, "
            f"{args.nheads} heads x headdim {args.headdim}, d_state {args.d_state}, {args.ngroups} group(s), chunk "
            f"{args.chunk_size}, initial state; ms per call best / median of {args.reps} interleaved rounds; "
            "max rel-L2 of y and final_state vs the float64 oracle")
    lines = [head, "", "| L | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for L, t, e in rows:
        lines.append(f"| {L} | " + " | ".join(f"{t[k][0]:.3f} / {t[k][1]:.3f} (err {e[k]:.1e})" for k in names) + " |")
    table = "\n".join(lines) + "\n"
    publish(table, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
