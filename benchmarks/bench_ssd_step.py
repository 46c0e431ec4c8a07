"""Benchmark of the SSMScan decode step (one token per sequence): cuTile vs mamba_ssm vs the PyTorch reference.

Memory-bound: bytes = 8*b*h*p*n (fp32 state read + written) + 2*b*h*p*s_x (x, y) + 2*b*g*n*s_x (B, C)
+ b*h*s_x (dt) + 3*h*4; GB/s = bytes / t and % of the 4.3 TB/s copy bandwidth measured on this H200
(/work/.library/device/KINDS.md). bf16, in-place state update; shapes (batch, nheads, headdim, ngroups, d_state)
in SHAPES (headdim 64 / d_state 128, and the hybrid models' head dims 80 / 128 and d_state 256).
ms = median of eager calls and of CUDA-graph replays (triton.testing.do_bench), side by side.

Implementations, in the same run: ``ssm_step`` (cuTile); the TensorRT JIT plugin's enqueue body
(``run_jit`` on TensorRT-like tensors with seqlen 1, which routes to the same step kernel inside
``ssm_scan``); mamba_ssm's Triton ``selective_state_update`` (the Mamba-2 layer's decode call:
per-head dt/A/D/dt_bias broadcast over headdim and d_state as stride-0 views), from a git-ignored
copy of state-spaces/mamba under ``.devcarry/mamba_ssm_triton`` (skipped with a note when absent);
``--block-p`` sweeps headdim tiles through the step kernel's launch description (``rN``: the flat-row kernel
(any head dim), N-row tiles); ``--aot`` adds the TensorRT AOT plugin's decode kernel (PTX in TensorRT's slot order,
launched as TensorRT's AOT launcher does: cuLaunchKernel with the plugin's pointers and int32 extras, so no TMA
descriptors); ``--baseline MODULE`` times another ``ssm_step_cutile`` (a copy of main's) beside the current one.

    PYTHONPATH=.:$PYTHONPATH python3 benchmarks/bench_ssd_step.py --results $OUT/results.md
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_ssd import load_mamba_triton, time_fn  # noqa: E402
from m2export.kernels.ssd_step import ssm_step  # noqa: E402

SHAPES = {  # name: (batch, nheads, headdim, ngroups, d_state)
    "B1_H80": (1, 80, 64, 1, 128),
    "B16_H80": (16, 80, 64, 1, 128),
    "B64_H80": (64, 80, 64, 1, 128),
    "B128_H80": (128, 80, 64, 1, 128),
    "B64_H128_G8": (64, 128, 64, 8, 128),
    # issue 15's decode goal: head dims 80 / 128 and d_state 256 at batch >= 64 (the hybrid models' Mamba layers)
    "B64_H128_P80_G8": (64, 128, 80, 8, 128),     # Nemotron-Nano-9B-v2
    "B128_H128_P80_G8": (128, 128, 80, 8, 128),
    "B64_H24_P128_N256": (64, 24, 128, 1, 256),   # Falcon-H1-7B
    "B128_H24_P128_N256": (128, 24, 128, 1, 256),
    "B64_H128_P80_G8_N256": (64, 128, 80, 8, 256),   # head dim 80 at d_state 256 (no model of the list: coverage)
    "B128_H128_P80_G8_N256": (128, 128, 80, 8, 256),
    "B64_H128_P64_G8": (64, 128, 64, 8, 128),     # Nemotron-H-8B
}
HBM = 4.3e12


def step_bytes(b, h, p, g, n, s=2):
    return 8 * b * h * p * n + 2 * b * h * p * s + 2 * b * g * n * s + b * h * s + 3 * h * 4


def load_selective_state_update():
    return load_mamba_triton("selective_state_update", "selective_state_update")


class _TrtLike:
    """The attributes the JIT plugin body reads off a ``trtp.Tensor`` (data_ptr, shape, strides, dtype)."""

    def __init__(self, t: torch.Tensor):
        self.data_ptr, self.shape, self.strides, self.dtype = t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


@functools.lru_cache(maxsize=None)
def aot_kernel(prob):
    """(label, AotKernel) of the AOT plugin's decode kernel for ``prob`` (seqlen 1, SSMScanAttrs() defaults; the
    plugin's export and checks), cached per problem without its batch (a runtime extent of the AOT kernel)."""
    from m2export.contract import SSMScanAttrs
    from m2export.kernels.ssd_step.cutile import aot_spec
    from m2export.plugins import _cuda, aot

    gpu_code = aot.gpu_code_for(_cuda.compute_capability(torch.cuda.current_device()))
    spec = aot_spec(prob, SSMScanAttrs())  # for the label: compile_aot_kernel builds the same description
    kern = aot.compile_aot_kernel(prob.nheads, prob.headdim, prob.ngroups, prob.d_state, prob.dtype, SSMScanAttrs(),
                                  gpu_code, decode=True)
    return f"plugin AOT kernel ({spec.name}, block_p {spec.config}; launched like TensorRT)", kern


def aot_launcher(kern, plugin: dict, y4, fs):
    """A callable launching ``kern`` as TensorRT's AOT launcher does (benchmarks/bench_ssd_aot.py's aot_runner:
    input pointers | int32 extras from the plugin tensors' shapes | output pointers, on the current stream)."""
    from benchmarks.bench_ssd_aot import aot_runner  # (bench_ssd_aot imports this module's SHAPES)

    b, _, h, p = y4.shape
    return aot_runner(kern, plugin, y4, fs, b, h, p)


def main(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rep", type=int, default=300, help="ms of timed calls per implementation and mode (median)")
    ap.add_argument("--skip", default="", help="comma list of implementation label prefixes not to run (e.g. "
                    "'torch,mamba')")
    ap.add_argument("--baseline", default="", help="module with another ssm_step_cutile (e.g. a copy of main's "
                    "m2export/kernels/ssd_step/cutile.py), timed beside the current one on every shape")
    ap.add_argument("--aot", action="store_true", help="also time the AOT plugin's decode kernel launched like "
                    "TensorRT")
    ap.add_argument("--block-p", default="auto",
                    help="comma list of headdim tiles to time, each optionally :occupancy hint (auto = heuristic; "
                         "rN = the flat-row kernel with N-row tiles)")
    args = ap.parse_args(argv)
    import triton
    import cuda.tile as ct

    from m2export.contract import INPUT_NAMES, SSMScanAttrs, validate
    from m2export.kernels.ssd_step.cutile import _rows_views, rows_launch, step_launch
    from m2export.plugins.ssm_scan_trt import run_jit

    ssu, why = load_selective_state_update()
    head = (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, "
            f"torch {torch.__version__}, triton {triton.__version__}, cuda.tile {ct.__version__}; bf16, in place"
            + ("" if ssu else f"; mamba_ssm: {why}"))
    print(head)
    lines = [f"### SSMScan decode step, {head}", "",
             "| shape | implementation | eager ms | graph ms | GB/s (graph; eager if no graph) | % of 4.3 TB/s "
             "| rel-err y |", "|---|---|---|---|---|---|---|"]
    capture_failed = False
    for name in args.shapes.split(","):
        b, h, p, g, n = SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(1)
        r = lambda *s, sc=1.0: torch.randn(*s, generator=gen, device="cuda") * sc  # noqa: E731
        x, dt = r(b, h, p).bfloat16(), (r(b, h) - 1).bfloat16()
        A, D, bias = -(torch.rand(h, device="cuda") * 7.5 + 0.5), r(h), r(h, sc=0.5)
        B, C = r(b, g, n, sc=n ** -0.5).bfloat16(), r(b, g, n, sc=n ** -0.5).bfloat16()
        state = r(b, h, p, n)
        y = torch.empty_like(x)
        ref = ssm_step(x, dt, A, B, C, D, bias, state.clone(), backend="torch")
        prob = validate(x[:, None], dt[:, None], A, B[:, None], C[:, None], D, bias, state)
        impls = []

        def err_of(out):
            return ((out.float() - ref.y.float()).norm() / ref.y.float().norm()).item()

        for bp in args.block_p.split(","):
            if bp == "auto":
                impls.append(("cutile ssm_step", lambda: ssm_step(x, dt, A, B, C, D, bias, state, out=y,
                                                                   state_out=state), lambda: y))
            elif bp.startswith("r"):  # "rN" or "rN:occupancy": the flat-row kernel with N-row tiles (sweep)
                tile, _, occ = bp[1:].partition(":")
                launch = rows_launch(prob, block_r=int(tile), occupancy=int(occ) if occ else None, dt_softplus=True,
                                     dt_limit=(0.0, math.inf))
                bound = launch.bind(_rows_views(dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=bias, ssm_state=state,
                                                     y=y, state_out=state)))
                impls.append((f"cutile rows[block_r={tile}{', occupancy=' + occ if occ else ''}]",
                              lambda launch=launch, bound=bound: ct.launch(torch.cuda.current_stream().cuda_stream,
                                                                           launch.grid, launch.kernel, bound),
                              lambda: y))
            else:  # "block_p" or "block_p:occupancy": the launch description with another tile (sweep)
                tile, _, occ = bp.partition(":")
                launch = step_launch(prob, block_p=int(tile), occupancy=int(occ) if occ else None, dt_softplus=True,
                                     dt_limit=(0.0, math.inf))
                bound = launch.bind(dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=bias, ssm_state=state, y=y,
                                         state_out=state))
                impls.append((f"cutile[block_p={tile}{', occupancy=' + occ if occ else ''}]",
                              lambda launch=launch, bound=bound: ct.launch(torch.cuda.current_stream().cuda_stream,
                                                                           launch.grid, launch.kernel, bound),
                              lambda: y))
        # the TensorRT JIT plugin's enqueue: 4-D tensors with seqlen 1, state in -> state out
        x4, dt4, B4, C4, y4 = x[:, None], dt[:, None], B[:, None], C[:, None], torch.empty_like(x[:, None])
        fs = torch.empty_like(state)
        ins = [_TrtLike(t) for t in (x4, dt4, A, B4, C4, D, bias, state)]
        outs = [_TrtLike(y4), _TrtLike(fs)]
        assert len(ins) == len(INPUT_NAMES)
        impls.append(("plugin JIT body (run_jit, seqlen 1)",
                      lambda: run_jit(ins, outs, SSMScanAttrs(), torch.cuda.current_stream().cuda_stream),
                      lambda: y4[:, 0]))
        if args.aot:
            plugin = dict(zip(INPUT_NAMES, (x4, dt4, A, B4, C4, D, bias, state)))
            label, kern = aot_kernel(dataclasses.replace(prob, batch=1))
            impls.append((label, aot_launcher(kern, plugin, y4, fs), lambda: y4[:, 0]))
        if ssu is not None:
            # Mamba2.step's call: per-head parameters broadcast over headdim / d_state (stride-0 views)
            A3 = A[:, None, None].expand(h, p, n)
            dt3, D2, bias2 = dt[:, :, None].expand(b, h, p), D[:, None].expand(h, p), bias[:, None].expand(h, p)
            st_m = state.clone()
            impls.append(("mamba_ssm selective_state_update",
                          lambda: ssu(st_m, x, dt3, A3, B, C, D=D2, dt_bias=bias2, dt_softplus=True),
                          lambda: ssu(state.clone(), x, dt3, A3, B, C, D=D2, dt_bias=bias2, dt_softplus=True)))
            st_m.copy_(state)
        impls.append(("torch reference", lambda: ssm_step(x, dt, A, B, C, D, bias, state, backend="torch"), None))
        if args.baseline:
            import importlib

            base = importlib.import_module(args.baseline)
            impls.insert(1, (f"baseline {args.baseline}.ssm_step_cutile",
                             lambda: base.ssm_step_cutile(x, dt, A, B, C, D, bias, state, problem=prob, dt_softplus=True,
                                                          dt_limit=(0.0, math.inf), out=y, state_out=state),
                             lambda: y))
        skip = tuple(k for k in args.skip.split(",") if k)
        impls = [i for i in impls if not i[0].startswith(skip)] if skip else impls
        # accuracy first, every implementation from the same starting state (the timed runs update it in place)
        st0 = state.clone()
        errs = {}
        for label, fn, out_of in impls:
            if out_of is not None:
                state.copy_(st0)
                if label.startswith("mamba"):
                    errs[label] = err_of(out_of())
                else:
                    fn()
                    errs[label] = err_of(out_of())
        state.copy_(st0)
        for label, fn, out_of in impls:
            err = errs.get(label, float("nan"))
            te = time_fn(fn, graph=False, rep=args.rep)
            try:  # the torch reference is timed eagerly only: its capture fails (host-side ops)
                tg = (float("nan") if label == "torch reference" or capture_failed
                      else time_fn(fn, graph=True, rep=args.rep))
            except Exception as e:  # noqa: BLE001  (reported in the table, not hidden)
                print(f"  {name} {label}: CUDA-graph capture failed, eager timing only from here: {e!r}"[:300],
                      flush=True)
                capture_failed = True
                tg = float("nan")
            gbs = step_bytes(b, h, p, g, n) / ((te if math.isnan(tg) else tg) * 1e-3) / 1e9
            lines.append(f"| {name} (P{p} N{n}) | {label} | {te:.4f} | {tg:.4f} | {gbs:.0f} | "
                         f"{gbs / HBM * 1e11:.1f} | {err:.1e} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.results:
        with open(args.results, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
