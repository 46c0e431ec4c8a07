"""Where the cuTile SSMScan prefill's time goes: each launch of the default plan alone, and the whole plan, per shape.

For every shape (bench_ssd.py's SHAPES, bf16 unless named, no initial state) the default plan
(``choose_config``) is timed as one CUDA graph of all its launches and each launch alone as a
one-launch graph (median of ``triton.testing.do_bench`` replays, us), with the pre-pass
(``ssd_dt_kernel``) compiled at each occupancy hint of ``--dt-occupancy`` (``none`` = unhinted;
the default build is ``cutile.DT_OCCUPANCY``, 4 since 2026-12-03). Before the timing, y and the final state of every
hint are compared with the unhinted plan's (bitwise equality is expected: the hint changes the
build, not the arithmetic order of the cumsum; the number is printed, not assumed).

    PYTHONPATH=.:$PYTHONPATH python3 benchmarks/bench_ssd_launches.py --results $OUT/launches.md
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_ssd import SHAPE_DTYPE, SHAPES, floor_s, make_inputs, time_fn  # noqa: E402

SHORT = {"ssd_dt_kernel": "pre-pass", "ssd_cb_kernel": "cb pre-pass", "ssd_segment_state_kernel": "pass 1",
         "ssd_scan_kernel": "pass 2", "ssd_fused_kernel": "fused"}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="a,b,d,nemotron_h_8b,nemotron_nano_9b,falcon_h1_7b")
    ap.add_argument("--dt-occupancy", default="none,4", help="comma list of ssd_dt_kernel hints (none = unhinted)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    ap.add_argument("--results", default="", help="markdown file the table is appended to ('' for none)")
    args = ap.parse_args(argv)
    import cuda.tile as ct

    import m2export.kernels.ssd.cutile as cu
    from m2export.contract import validate
    from m2export.kernels.ssd.plan import choose_config

    hints = [None if v == "none" else int(v) for v in args.dt_occupancy.split(",")]
    default_hint = cu.DT_OCCUPANCY
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    head = (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, "
            f"torch {torch.__version__}, cuda.tile {ct.__version__}; no initial state; us = median of graph replays")
    print(head, flush=True)
    lines = [f"### SSMScan prefill per launch, {head}", "",
             "| shape | plan | pre-pass hint | launches alone (us) | sum alone | whole plan (us) | % of floor | "
             "diff vs unhinted |", "|---|---|---|---|---|---|---|---|"]
    for name in args.shapes.split(","):
        dims = SHAPES[name]
        b, l, h, p, g, n = dims
        inp = make_inputs(dims, seed=zlib.crc32(name.encode()) % 1000, dtype=SHAPE_DTYPE.get(name, torch.bfloat16))
        prob = validate(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], None)
        cfg = choose_config(prob, sm_count=sm)
        ref = None
        for hint in hints:
            cu.DT_OCCUPANCY = hint
            plan = cu.make_scan_plan(prob, cfg, dt_softplus=True, dt_limit=(0.0, math.inf), has_D=True,
                                     has_dt_bias=True, has_init=False)
            t = dict(inp, initial_state=None, y=torch.empty_like(inp["x"]),
                     final_state=torch.empty(b, h, p, n, dtype=torch.float32, device="cuda"))
            for sname, shape, dtype in plan.scratch:
                t[sname] = torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")
            bound = [(lc, lc.bind(t)) for lc in plan.launches]

            def whole(bound=bound):
                s = torch.cuda.current_stream().cuda_stream
                for lc, a in bound:
                    ct.launch(s, lc.grid, lc.kernel, a)

            whole()
            torch.cuda.synchronize()
            out = (t["y"].float().clone(), t["final_state"].clone())
            if ref is None:
                ref, diff = out, "-"
            else:
                diff = f"{(out[0] - ref[0]).abs().max().item():.1e} / {(out[1] - ref[1]).abs().max().item():.1e}"
            alone = []
            for lc, a in bound:
                def one(lc=lc, a=a):
                    ct.launch(torch.cuda.current_stream().cuda_stream, lc.grid, lc.kernel, a)
                alone.append((SHORT.get(lc.name, lc.name), 1e3 * time_fn(one, graph=True, rep=args.rep)))
            tw = 1e3 * time_fn(whole, graph=True, rep=args.rep)
            cells = ", ".join(f"{k} {v:.1f}" for k, v in alone)
            lines.append(f"| {name} (B{b} L{l} H{h} P{p} G{g} N{n}) | Q{cfg.chunk} p{cfg.block_p} nseg {cfg.nseg} | "
                         f"{hint or 'none'} | {cells} | {sum(v for _, v in alone):.1f} | {tw:.1f} | "
                         f"{floor_s(dims) / (tw * 1e-6) * 100:.1f} | {diff} |")
            print(lines[-1], flush=True)
        cu.DT_OCCUPANCY = default_hint
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    if args.results:
        with open(args.results, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
