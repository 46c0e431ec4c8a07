"""Benchmark of the TensorRT AOT plugin's SSMScan kernels against the JIT path they stand in for (H200).

An AOT engine runs the kernel TensorRT's launcher starts with device pointers and int32 extras only (no TMA tensor
maps): ``m2export.plugins.aot.compile_aot_kernel``'s export, its PTX in TensorRT's slot order, loaded through the
driver (or assembled with ptxas where the driver predates the PTX ISA) and launched with cuLaunchKernel exactly as
tests/plugins/test_aot.py does. The JIT plugin and the PyTorch GPU backend run ``ssm_scan_cutile`` /
``ssm_step`` (``ct.launch``: the default plans, TMA allowed). Same inputs for both (bf16 x/B/C/dt, fp32 A, D,
dt_bias and a random fp32 initial state, as an ONNX graph always has); each output is compared with the JIT one
(rel-L2 of y and of the final state) before timing. ms = median of CUDA-graph replays (triton.testing.do_bench);
% of floor as benchmarks/bench_ssd.py (prefill) and bench_ssd_step.py (decode: the state read and written once).
Prefill shapes are bench_ssd.SHAPES (batch, seqlen, nheads, headdim, ngroups, d_state); decode shapes
bench_ssd_step.SHAPES (batch, nheads, headdim, ngroups, d_state).

    PYTHONPATH=.:$PYTHONPATH python3 benchmarks/bench_ssd_aot.py --results $OUT/results.md
"""

from __future__ import annotations

import argparse
import datetime
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_ssd import SHAPES as PREFILL_SHAPES, floor_s, rel_err, time_fn  # noqa: E402
from benchmarks.bench_ssd_step import HBM, SHAPES as STEP_SHAPES, step_bytes  # noqa: E402

PREFILL = "b,nemotron_h_8b,nemotron_nano_9b,falcon_h1_7b,a"
DECODE = "B64_H80,B64_H128_P80_G8,B64_H24_P128_N256,B128_H128_P80_G8"


def load_image(kern) -> "object":
    """The AOT kernel loaded as TensorRT loads it: its PTX through the driver's JIT, or (driver older than the PTX
    ISA) assembled by the carried ptxas."""
    from m2export.plugins import _cuda, aot

    image = kern.ptx.encode()
    if _cuda.try_load_module(image) == _cuda.CUDA_ERROR_UNSUPPORTED_PTX_VERSION:
        with tempfile.TemporaryDirectory() as d:
            Path(d, "k.ptx").write_text(kern.ptx)
            subprocess.run([shutil.which("ptxas") or "ptxas", f"-arch={aot.ptx_target(kern.ptx)}", "-o",
                            str(Path(d, "k.cubin")), str(Path(d, "k.ptx"))], check=True)
            image = Path(d, "k.cubin").read_bytes()
    return _cuda.load_kernel(image, kern.name)


def aot_runner(kern, tensors: dict, y, fs, batch: int, nheads: int, headdim: int):
    """A callable launching ``kern`` with TensorRT's slots: input pointers | extras | output pointers."""
    from m2export.contract import INPUT_NAMES
    from m2export.plugins import aot

    loaded = load_image(kern)
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    shapes.update(y=tuple(y.shape), final_state=tuple(fs.shape))
    extras = aot.extra_arg_values(kern.amap, shapes, kern.scalars)
    grid = kern.grid(batch, nheads, headdim)
    slots = ([("u64", tensors[n].data_ptr()) for n in INPUT_NAMES] + [("i32", v) for v in extras]
             + [("u64", t.data_ptr()) for t in (y, fs)])
    return lambda: loaded.launch(grid, kern.block, slots, stream=torch.cuda.current_stream().cuda_stream)


def measure(kern, tensors: dict, out: tuple, jit_out: tuple, batch: int, nheads: int, headdim: int, rep: int):
    """(rel err of y, of the final state vs the JIT outputs ``jit_out``, graph-replay ms) of the AOT kernel
    ``kern`` launched like TensorRT into the NaN-poisoned ``out`` = (y, final_state)."""
    for o in out:
        o.fill_(math.nan)
    run = aot_runner(kern, tensors, *out, batch, nheads, headdim)
    run()
    torch.cuda.synchronize()
    return rel_err(jit_out[0], out[0]), rel_err(jit_out[1], out[1]), time_fn(run, graph=True, rep=rep)


def inputs(b, l, h, p, g, n, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s, sc=1.0: torch.randn(*s, generator=gen, device="cuda") * sc  # noqa: E731
    return dict(x=r(b, l, h, p).bfloat16(), dt=(r(b, l, h) - 1).bfloat16(),
                A=-(torch.rand(h, device="cuda", generator=gen) * 7.5 + 0.5), B=r(b, l, g, n, sc=n ** -0.5).bfloat16(),
                C=r(b, l, g, n, sc=n ** -0.5).bfloat16(), D=r(h), dt_bias=r(h, sc=0.5),
                initial_state=r(b, h, p, n, sc=0.1))


def main(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--prefill", default=PREFILL, help="comma list of bench_ssd shapes ('' for none)")
    ap.add_argument("--decode", default=DECODE, help="comma list of bench_ssd_step shapes ('' for none)")
    ap.add_argument("--prefill-tactics", action="store_true", help="also time every TensorRT tactic of the AOT prefill "
                    "kernel (plan.tile_families: what TensorRT's build-time autotune chooses among)")
    ap.add_argument("--decode-tiles", default="auto", help="comma list of AOT decode tiles to time: auto (aot_spec's "
                    "rule) or BLOCK_P or BLOCK_P:OCCUPANCY")
    ap.add_argument("--rep", type=int, default=200, help="ms of timed replays per implementation (median)")
    ap.add_argument("--label", default="", help="a tag for the rows (e.g. the tree measured)")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"),
                    help="markdown file the table is appended to ('' for none)")
    args = ap.parse_args(argv)
    import triton

    import cuda.tile as ct

    from m2export.contract import SSMScanAttrs, validate
    from m2export.kernels.ssd.cutile import ssm_scan_cutile
    from m2export.kernels.ssd_step import ssm_step
    from m2export.plugins import _cuda, aot

    gpu_code = aot.gpu_code_for(_cuda.compute_capability(torch.cuda.current_device()))
    attrs = SSMScanAttrs()
    head = (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, "
            f"torch {torch.__version__}, triton {triton.__version__}, cuda.tile {ct.__version__}, driver CUDA "
            f"{_cuda.driver_version()}; bf16, random fp32 initial state; graph-replay medians{' ' + args.label if args.label else ''}")
    print(head, flush=True)
    if args.prefill_tactics:  # compile every tactic first, in parallel (tileiras runs as a subprocess)
        from concurrent.futures import ThreadPoolExecutor

        from m2export.contract import SSMScanProblem
        from m2export.kernels.ssd.plan import tile_families

        jobs = []
        for name in [s for s in args.prefill.split(",") if s]:
            b, l, h, p, g, n = PREFILL_SHAPES[name]
            fams = (None, *tile_families(SSMScanProblem(b, l, h, p, g, n, "bfloat16")))
            jobs += [(h, p, g, n, f) for f in fams]
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda j: aot.compile_aot_kernel(*j[:4], "bfloat16", attrs, gpu_code, tiles=j[4]), jobs))
        print(f"compiled {len(jobs)} AOT prefill kernels", flush=True)
    lines = [f"\n### bench_ssd_aot.py: TensorRT AOT kernels vs the JIT path, {head}\n",
             "| shape | path | JIT ms | AOT ms | AOT / JIT | AOT % of floor | AOT rel err y / state vs JIT |",
             "|---|---|---|---|---|---|---|"]
    for name in [s for s in args.prefill.split(",") if s]:
        b, l, h, p, g, n = PREFILL_SHAPES[name]
        t = inputs(b, l, h, p, g, n, seed=len(name))
        prob = validate(t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["dt_bias"], t["initial_state"])
        yj, fj = torch.full_like(t["x"], math.nan), torch.full_like(t["initial_state"], math.nan)
        ya, fa = torch.full_like(yj, math.nan), torch.full_like(fj, math.nan)

        def jit(yj=yj, fj=fj, t=t, prob=prob):
            ssm_scan_cutile(t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["dt_bias"], t["initial_state"],
                            problem=prob, dt_softplus=True, dt_limit=(0.0, math.inf), out=yj, final_state_out=fj)
        jit()
        tj = time_fn(jit, graph=True, rep=args.rep)
        families = [None]
        if args.prefill_tactics:
            from m2export.kernels.ssd.plan import tile_families

            families += list(tile_families(prob))
        for i, fam in enumerate(families):
            kern = aot.compile_aot_kernel(h, p, g, n, "bfloat16", attrs, gpu_code, tiles=fam)
            ey, es, ta = measure(kern, t, (ya, fa), (yj, fj), b, h, p, args.rep)
            pct = floor_s((b, l, h, p, g, n)) / (ta * 1e-3) * 100
            what = "prefill" if fam is None else (f"prefill tactic {i} (Q{fam.chunk} p{fam.block_p} "
                                                  f"{'T' if fam.state_t else 'S'})")
            lines.append(f"| {name} {PREFILL_SHAPES[name]} | {what} | {tj:.3f} | {ta:.3f} | {ta / tj:.2f} | "
                         f"{pct:.1f} | {ey:.1e} / {es:.1e} |")
            print(lines[-1], flush=True)
        del t, yj, fj, ya, fa
    for name in [s for s in args.decode.split(",") if s]:
        b, h, p, g, n = STEP_SHAPES[name]
        t = inputs(b, 1, h, p, g, n, seed=len(name))
        yj = torch.full_like(t["x"], math.nan)
        fj = torch.full_like(t["initial_state"], math.nan)
        ya, fa = torch.full_like(yj, math.nan), torch.full_like(fj, math.nan)

        def jit(yj=yj, fj=fj, t=t):  # the JIT plugin's decode call: 4-D tensors, state in -> state out
            ssm_step(t["x"][:, 0], t["dt"][:, 0], t["A"], t["B"][:, 0], t["C"][:, 0], t["D"], t["dt_bias"],
                     t["initial_state"], out=yj[:, 0], state_out=fj)
        jit()
        tj = time_fn(jit, graph=True, rep=args.rep)
        for tile in args.decode_tiles.split(","):
            if tile == "auto":
                kern, what = aot.compile_aot_kernel(h, p, g, n, "bfloat16", attrs, gpu_code, decode=True), "decode"
            else:  # the plugin's export path with another tile / occupancy hint (cached per shape family)
                bp, _, occ = tile.partition(":")
                if p % int(bp) or int(bp) * n > 8192:  # not a whole tile of headdim, or over 32 KiB of fp32 state
                    continue
                kern = aot.compile_aot_kernel(h, p, g, n, "bfloat16", attrs, gpu_code, decode=True,
                                              step_tile=(int(bp), int(occ) if occ else None))
                what = f"decode tile {tile}"
            ey, es, ta = measure(kern, t, (ya, fa), (yj, fj), b, h, p, args.rep)
            pct = step_bytes(b, h, p, g, n) / (ta * 1e-3) / HBM * 100
            lines.append(f"| {name} (P{p} N{n}) | {what} | {tj:.4f} | {ta:.4f} | {ta / tj:.2f} | {pct:.1f} | "
                         f"{ey:.1e} / {es:.1e} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.results:
        with open(args.results, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
