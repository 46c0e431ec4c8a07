"""Benchmark of the SSMScan decode step (one token per sequence): cuTile vs the PyTorch reference.

Memory-bound: bytes = 8*b*h*p*n (fp32 state read + written) + 2*b*h*p*s_x (x, y) + 2*b*g*n*s_x (B, C)
+ b*h*s_x (dt) + 3*h*4; GB/s = bytes / t and % of the 4.3 TB/s copy bandwidth measured on this H200
(/work/.library/device/KINDS.md). bf16, headdim 64, d_state 128, in-place state update.
ms = median of CUDA-graph replays (triton.testing.do_bench), eager in its own column.

    PYTHONPATH=.:$PYTHONPATH python3 benchmarks/bench_ssd_step.py --results $OUT/results.md
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_ssd import time_fn  # noqa: E402
from m2export.kernels.ssd_step import ssm_step  # noqa: E402

SHAPES = {  # name: (batch, nheads, headdim, ngroups, d_state)
    "B1_H80": (1, 80, 64, 1, 128),
    "B16_H80": (16, 80, 64, 1, 128),
    "B128_H80": (128, 80, 64, 1, 128),
    "B64_H128_G8": (64, 128, 64, 8, 128),
}
HBM = 4.3e12


def step_bytes(b, h, p, g, n, s=2):
    return 8 * b * h * p * n + 2 * b * h * p * s + 2 * b * g * n * s + b * h * s + 3 * h * 4


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    ap.add_argument("--block-p", default="auto", help="comma list of headdim tiles to time, each optionally :occupancy hint (auto = heuristic)")
    args = ap.parse_args(argv)
    import triton
    import cuda.tile as ct

    head = (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, "
            f"torch {torch.__version__}, triton {triton.__version__}, cuda.tile {ct.__version__}; bf16, in place")
    print(head)
    lines = [f"### SSMScan decode step, {head}", "",
             "| shape | implementation | eager ms | graph ms | GB/s (graph; eager if no graph) | % of 4.3 TB/s | rel-err y |", "|---|---|---|---|---|---|---|"]
    capture_failed = False
    for name, (b, h, p, g, n) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(1)
        r = lambda *s, sc=1.0: torch.randn(*s, generator=gen, device="cuda") * sc  # noqa: E731
        x, dt = r(b, h, p).bfloat16(), (r(b, h) - 1).bfloat16()
        A, D, bias = -(torch.rand(h, device="cuda") * 7.5 + 0.5), r(h), r(h, sc=0.5)
        B, C = r(b, g, n, sc=n ** -0.5).bfloat16(), r(b, g, n, sc=n ** -0.5).bfloat16()
        state = r(b, h, p, n)
        y = torch.empty_like(x)
        ref = ssm_step(x, dt, A, B, C, D, bias, state.clone(), backend="torch")
        got = ssm_step(x, dt, A, B, C, D, bias, state.clone(), backend="cutile")
        err = ((got.y.float() - ref.y.float()).norm() / ref.y.float().norm()).item()
        from m2export.contract import validate
        from m2export.kernels.ssd_step.cutile import ssm_step_cutile

        prob = validate(x[:, None], dt[:, None], A, B[:, None], C[:, None], D, bias, state)
        impls = []
        for bp in args.block_p.split(","):
            if bp == "auto":
                impls.append(("cutile", lambda: ssm_step(x, dt, A, B, C, D, bias, state, out=y, state_out=state)))
            else:  # "block_p" or "block_p:occupancy"
                tile, _, occ = bp.partition(":")
                impls.append((f"cutile[block_p={tile}{', occupancy=' + occ if occ else ''}]",
                              lambda tile=int(tile), occ=int(occ or 0): ssm_step_cutile(
                    x, dt, A, B, C, D, bias, state, problem=prob, dt_softplus=True, dt_limit=(0.0, math.inf),
                    out=y, state_out=state, block_p=tile, occupancy=occ or None)))
        impls.append(("torch reference", lambda: ssm_step(x, dt, A, B, C, D, bias, state, backend="torch")))
        for label, fn in impls:
            te = time_fn(fn, graph=False)
            try:  # the torch reference is timed eagerly only: its capture fails (host-side ops)
                tg = float("nan") if label == "torch reference" or capture_failed else time_fn(fn, graph=True)
            except Exception as e:  # noqa: BLE001  (reported in the table, not hidden)
                # a failed capture can leave torch's RNG/graph state unusable: no more captures
                print(f"  {name} {label}: CUDA-graph capture failed, eager timing only from here: {e!r}"[:300],
                      flush=True)
                capture_failed = True
                tg = float("nan")
            gbs = step_bytes(b, h, p, g, n) / ((te if math.isnan(tg) else tg) * 1e-3) / 1e9
            err_cell = f"{err:.1e} |" if label == "cutile" else "- |"
            lines.append(f"| {name} (P{p} N{n}) | {label} | {te:.4f} | {tg:.4f} | {gbs:.0f} | {gbs / HBM * 1e11:.1f} | "
                         + err_cell)
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.results:
        with open(args.results, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
