"""Benchmark of the SSMScan forward (prefill): cuTile vs mamba_ssm's Triton kernel vs TileGym's cuTile kernel.

Shapes (B, L, H, P, G, N; bf16 unless named; D and dt_bias present, softplus, no initial state unless --initial-state):
    a) 8, 2048, 24, 64, 1, 128            issue 6's four shapes
    b) 4, 8192, 80, 64, 1, 128
    c) 2, 8192, 128, 64, 8, 128
    d) 1, 65536, 80, 64, 1, 128
    nemotron_h_8b)     1, 8192, 128, 64, 8, 128    (chunk_size 128: mamba_ssm runs at 128)
    nemotron_nano_9b)  1, 8192, 128, 80, 8, 128    (head dim 80: TileGym needs P % 64 == 0, not run)
    nemotron3_30b)     8, 2048, 64, 64, 8, 128
    granite4_small)    4, 4096, 128, 64, 1, 128
    falcon_h1_7b)      2, 8192, 24, 128, 1, 256
    nemotron3_30b_fp16) the 30B shape in fp16
    c_odd)             c with L = 8000 (not a multiple of chunk 128 or 256; 125 x 64, so TileGym runs it)

Per implementation and shape: median ms of eager calls and of CUDA-graph replays
(triton.testing.do_bench, return_mode="median", after warm-up), then

    bytes  = 2*(b*l*h*p)*s_x           x read + y written              (s_x = 2 for bf16)
           + 2*(b*l*g*n)*s_x           B and C read once
           + (b*l*h)*s_x               dt read
           + (b*h*p*n)*4               final_state written (fp32)
           + 3*h*4                     A, D, dt_bias
    FLOPs  = nchunks * (g*2*Q*Q*n              C @ B^T per group and chunk
                        + h*(2*Q*Q*p           (masked CB) @ x
                             + 2*Q*n*p         C @ state (inter-chunk output)
                             + 2*Q*n*p))       x^T @ B (chunk state)
             with Q = 256 (mamba_ssm's default chunk) and nchunks = b * ceil(l / Q); full (not
             causal-halved) Q x Q products, as the tensor cores execute them.
    floor  = max(bytes / 4.3 TB/s, FLOPs / 790 TFLOP/s)   (H200: measured copy bandwidth and bf16
             dense matmul rate on random data, /work/.library/device/KINDS.md)
    TFLOP/s = FLOPs / t,  GB/s = bytes / t,  % of floor = floor / t * 100  (t: graph-replay median)

mamba_ssm: ``mamba_chunk_scan_combined(..., chunk_size=256 (128 where the model uses it), dt_softplus=True,
return_final_states=True)`` imported from a git-ignored copy of state-spaces/mamba's ``mamba_ssm`` package (its
.py files: ops/triton imports mamba_ssm.utils; the package ``__init__`` cut to its version line, which otherwise
imports the CUDA-extension modules) under ANCHORS/mamba_ssm_triton/mamba_ssm. TileGym:
``tilegym.ops.cutile.mamba2.mamba2_chunk_forward(x, A, B, C, D, dt, init_state, chunk_size=64)`` from a git-ignored
copy of NVIDIA/TileGym's module under ANCHORS/tilegym (with stand-ins for ``tilegym.backend.register_impl`` and
``tilegym.autotune.is_autotune_disabled``); it takes dt already softplus'd (done once, outside the timing)
and a zero initial state, needs L % 64 == 0 and P % 64 == 0, and runs with TILEGYM_DISABLE_AUTOTUNE=1 (its
first config of each search space) unless --tilegym-autotune. ANCHORS: --anchors, default ROOT/.devcarry.
Neither is ever committed; a missing one is skipped with a note.

Run on the device (see benchmarks/NOTES_ssd.md):
    PYTHONPATH=.:$PYTHONPATH python3 benchmarks/bench_ssd.py --results $OUT/results.md
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import time
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from m2export.kernels.ssd.naive import ssm_scan_chunked  # noqa: E402

SHAPES = {  # name: (batch, seqlen, nheads, headdim, ngroups, d_state)
    "a": (8, 2048, 24, 64, 1, 128),
    "b": (4, 8192, 80, 64, 1, 128),
    "c": (2, 8192, 128, 64, 8, 128),
    "d": (1, 65536, 80, 64, 1, 128),
    "nemotron_h_8b": (1, 8192, 128, 64, 8, 128),
    "nemotron_nano_9b": (1, 8192, 128, 80, 8, 128),
    "nemotron3_30b": (8, 2048, 64, 64, 8, 128),
    "granite4_small": (4, 4096, 128, 64, 1, 128),
    "falcon_h1_7b": (2, 8192, 24, 128, 1, 256),
    "nemotron3_30b_fp16": (8, 2048, 64, 64, 8, 128),
    "c_odd": (2, 8000, 128, 64, 8, 128),
}
SHAPE_DTYPE = {"nemotron3_30b_fp16": torch.float16}  # others bf16
SHAPE_MAMBA_CHUNK = {"nemotron_h_8b": 128}  # others 256 (mamba_ssm's default)
HBM_BYTES_PER_S = 4.3e12
BF16_FLOP_PER_S = 790e12
FLOP_CHUNK = 256


def bytes_moved(b, l, h, p, g, n, s_x=2) -> int:
    return 2 * b * l * h * p * s_x + 2 * b * l * g * n * s_x + b * l * h * s_x + b * h * p * n * 4 + 3 * h * 4


def flops(b, l, h, p, g, n, Q=FLOP_CHUNK) -> int:
    nchunks = b * math.ceil(l / Q)
    return nchunks * (g * 2 * Q * Q * n + h * (2 * Q * Q * p + 4 * Q * n * p))


def floor_s(dims) -> float:
    return max(bytes_moved(*dims) / HBM_BYTES_PER_S, flops(*dims) / BF16_FLOP_PER_S)


def make_inputs(dims, seed=0, device="cuda", dtype=torch.bfloat16):
    b, l, h, p, g, n = dims
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=device) * scale

    return dict(
        x=rnd(b, l, h, p).to(dtype),
        dt=(rnd(b, l, h) - 1.0).to(dtype),  # raw; softplus(dt + dt_bias) ~ 0.1 .. 1
        A=-(torch.rand(h, generator=gen, device=device) * 7.5 + 0.5),
        B=rnd(b, l, g, n, scale=n ** -0.5).to(dtype),
        C=rnd(b, l, g, n, scale=n ** -0.5).to(dtype),
        D=rnd(h),
        dt_bias=rnd(h, scale=0.5),
    )


ANCHORS = ROOT / ".devcarry"  # --anchors


def load_mamba_triton(module: str, name: str):
    """(``name`` from ``mamba_ssm.ops.triton.<module>``, "") out of the git-ignored copy of state-spaces/mamba's
    ``mamba_ssm/ops/triton`` under ANCHORS/mamba_ssm_triton (never committed), or (None, why not)."""
    import importlib

    path = ANCHORS / "mamba_ssm_triton"
    if not path.is_dir():
        return None, f"no {path}"
    sys.path.insert(0, str(path))
    try:
        return getattr(importlib.import_module(f"mamba_ssm.ops.triton.{module}"), name), ""
    except Exception as e:  # report, don't hide: the table says why the column is empty
        return None, f"import failed: {e!r}"


def load_mamba():
    return load_mamba_triton("ssd_combined", "mamba_chunk_scan_combined")


def load_tilegym(autotune: bool, search_slice: tuple[int, int] | None = None):
    """(TileGym's ``mamba2_chunk_forward``, "") from the git-ignored copy under ANCHORS/tilegym, or (None, why not).
    ``search_slice`` (i, n): its autotuner searches only configs i, i+n, i+2n, ... of each search space (the
    parallel warm-up's share: n processes compile the whole space into cuTile's disk cache, then the timed run's
    full search finds every cubin there)."""
    import importlib
    import os

    if not (ANCHORS / "tilegym").is_dir():
        return None, f"no {ANCHORS / 'tilegym'}"
    os.environ["TILEGYM_DISABLE_AUTOTUNE"] = "0" if autotune else "1"
    sys.path.insert(0, str(ANCHORS))
    try:
        mod = importlib.import_module("tilegym.ops.cutile.mamba2")
    except Exception as e:  # report, don't hide
        return None, f"import failed: {e!r}"
    if search_slice is not None:
        i, n = search_slice
        full = mod.exhaustive_search
        mod.exhaustive_search = lambda configs, *a, **kw: full(list(configs)[i::n] or list(configs)[:1], *a, **kw)
    return mod.mamba2_chunk_forward, ""


def append_results(text: str, path: str) -> None:
    """Print the table to stdout and append it to the markdown file ``path`` ('' for none)."""
    print("\n" + text)
    if path:
        with open(path, "a") as f:
            f.write(text + "\n")


def time_fn(fn, *, graph: bool, rep: int = 300, warmup: int = 50) -> float:
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    if not graph:
        return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return do_bench(g.replay, warmup=warmup, rep=rep, return_mode="median")


def rel_err(ref: torch.Tensor, out: torch.Tensor) -> float:
    r, o = ref.float(), out.float()
    return ((o - r).norm() / r.norm()).item()


def cutile_variants(spec: str):
    """'auto' (choose_config's defaults), 'tuned' (the autotuner's choice among plan.tile_families), 'none' (no cuTile
    row: the anchors only) or comma list of
    chunk:block_p:nseg[:occupancy[:state_t[:split_upd[:dt_pre[:worker_warps[:seg_occupancy[:merge_tail[:cb_pre[:cb_state]]]]]]]]]
    (chunk/block_p empty: choose_config's; nseg empty: the cost model's; 'aN': the heuristic aiming at N blocks per SM;
    occupancy empty: choose_config's default hint (plan.DEFAULT_OCCUPANCY), 0: no hint; worker_warps empty: no hint;
    state_t/split_upd/dt_pre/merge_tail/cb_state 0 or 1, cb_pre 0, 1 or 2, empty: choose_config's default). Until 2026-12-03 an
    empty occupancy meant no hint (so ``::::::::::2`` then ran without the occupancy-2 hint, and the cost model
    planned for one block per SM)."""
    from m2export.kernels.ssd.plan import choose_config

    out = []
    for item in spec.split(","):
        if item == "none":  # no cuTile row (anchors only)
            continue
        if item == "auto":
            out.append(("cutile", None))
            continue
        if item == "tuned":  # the autotuner's pick (m2export/kernels/_tune.py) on this shape, tuned outside the timing
            out.append(("cutile[tuned]", "tuned"))
            continue
        fields = item.split(":")
        if len(fields) > 12:
            raise SystemExit(f"--variants: {item!r} has {len(fields)} fields, at most 12 "
                             "(chunk:block_p:nseg:occupancy:state_t:split_upd:dt_pre:worker_warps:seg_occupancy:"
                             "merge_tail:cb_pre:cb_state)")
        q, bp, ns, occ, st, su, pre, ww, so, mt, cbp, cbs = (fields + [""] * 12)[:12]
        flag = lambda v: None if v == "" else v == "1"  # noqa: E731
        out.append((f"cutile[{item}]", (int(q) if q else None, int(bp) if bp else None, ns, int(occ) if occ else None,
                                        flag(st), flag(su), flag(pre), int(ww) if ww else None,
                                        int(so) if so else None, flag(mt), int(cbp) if cbp else None, flag(cbs))))
    return out, choose_config


def config_of(prob, v, sm: int = 132):
    """The ScanConfig of one parsed --variants entry ``v`` (None: choose_config's) for problem ``prob``."""
    from m2export.kernels.ssd.plan import choose_config

    if v is None:
        return choose_config(prob, sm_count=sm)
    q, bp, ns, occ, st, su, pre, ww, so, mt, cbp, cbs = v
    kw = dict(sm_count=sm, chunk=q, block_p=bp, occupancy=occ, state_t=st, split_upd=su, dt_pre=pre,
              worker_warps=ww, seg_occupancy=so, merge_tail=mt, cb_pre=cbp, cb_state=cbs)
    if ns == "":  # the cost model's segment count for this chunk and tile
        return choose_config(prob, **kw)
    if ns.startswith("a"):  # about this many blocks per SM
        base = prob.batch * prob.nheads * (prob.headdim // (bp or choose_config(prob, sm_count=sm).block_p))
        return choose_config(prob, nseg=min(64, max(1, -(-(int(ns[1:] or 8) * sm) // base))), **kw)
    return choose_config(prob, nseg=int(ns), **kw)


def problem_of(name: str):
    """The SSMScanProblem of benchmark shape ``name`` (no initial state)."""
    from m2export.contract import SSMScanProblem

    b, l, h, p, g, n = SHAPES[name]
    return SSMScanProblem(b, l, h, p, g, n, str(SHAPE_DTYPE.get(name, torch.bfloat16)).removeprefix("torch."))


def warm_up_parallel(args) -> None:
    """Compile every (shape, variant) in ``args.jobs`` processes (tileiras runs on the host CPUs);
    the timed run then finds the cubins in cuTile's disk cache."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(sh, v, i == 0) for sh in args.shapes.split(",") for i, v in enumerate(args.variants.split(","))]
    sliced = args.tilegym_autotune and args.tilegym_slices > 1 and not args.no_tilegym

    def one(job):
        sh, v, first = job  # TileGym's kernels compile once per shape (the first variant's job)
        tg = ["--anchors", args.anchors] + (["--tilegym-autotune"] if args.tilegym_autotune else []) \
            if first and not args.no_tilegym and not sliced else ["--no-tilegym"]
        init = ["--initial-state"] if args.initial_state else []
        r = subprocess.run([sys.executable, __file__, "--warmup-only", "--no-mamba", "--no-reference", *tg, *init,
                            "--results", "", "--shapes", sh, "--variants", v], capture_output=True, text=True)
        return f"  warm-up {sh} {v}: rc {r.returncode} {r.stdout.strip().splitlines()[-1:] if r.returncode else ''}" \
            + (r.stderr[-400:] if r.returncode else "")

    def tilegym_share(i):  # TileGym's search space, 1/n of it per process (compiles only)
        r = subprocess.run([sys.executable, __file__, "--warmup-only", "--no-mamba", "--no-reference", "--anchors",
                            args.anchors, "--tilegym-autotune", "--tilegym-slice", f"{i}/{args.tilegym_slices}",
                            *(["--initial-state"] if args.initial_state else []), "--results", "", "--shapes",
                            args.shapes, "--variants", "none"], capture_output=True, text=True)
        return f"  warm-up TileGym search share {i}/{args.tilegym_slices}: rc {r.returncode}" \
            + (r.stderr[-400:] if r.returncode else "")

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as ex:
        shares = [ex.submit(tilegym_share, i) for i in range(args.tilegym_slices)] if sliced else []
        for line in ex.map(one, jobs):
            print(line, flush=True)
        for f in shares:
            print(f.result(), flush=True)
    print(f"  warm-up done in {time.perf_counter() - t0:.0f} s", flush=True)


def main(argv=None):
    global ANCHORS
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="a,b,c,d")
    ap.add_argument("--variants", default="auto", help="cuTile configs: auto, or chunk:block_p:nseg,...")
    ap.add_argument("--no-mamba", action="store_true")
    ap.add_argument("--no-tilegym", action="store_true")
    ap.add_argument("--tilegym-autotune", action="store_true", help="let TileGym search its configs (slow)")
    ap.add_argument("--tilegym-slices", type=int, default=1,
                    help="with --tilegym-autotune and --jobs > 1: compile TileGym's search space first in this many "
                         "parallel processes (cuTile's disk cache); the timed run still searches every config")
    ap.add_argument("--tilegym-slice", default="", help=argparse.SUPPRESS)  # i/n: the warm-up's share
    ap.add_argument("--anchors", default=str(ANCHORS), help="folder holding mamba_ssm_triton/ and tilegym/")
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--initial-state", action="store_true",
                    help="give every implementation a random fp32 initial state (ONNX graphs always have one)")
    ap.add_argument("--eager-only", action="store_true", help="skip CUDA-graph timing (config sweeps)")
    ap.add_argument("--rep", type=int, default=300, help="do_bench repetition time, ms")
    ap.add_argument("--warmup-only", action="store_true", help="compile every variant once and exit")
    ap.add_argument("--jobs", type=int, default=1,
                    help="compile the variants first in this many parallel processes (cuTile's disk cache)")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"),
                    help="markdown file the table is appended to ('' for none)")
    args = ap.parse_args(argv)
    ANCHORS = Path(args.anchors)

    from m2export.kernels.ssd.cutile import ssm_scan_cutile
    from m2export.contract import validate

    import triton

    import cuda.tile as ct

    if args.jobs > 1 and not args.warmup_only:
        warm_up_parallel(args)
    mamba, why_no_mamba = (None, "--no-mamba") if args.no_mamba else load_mamba()
    share = tuple(int(v) for v in args.tilegym_slice.split("/")) if args.tilegym_slice else None
    tilegym, why_no_tilegym = (None, "--no-tilegym") if args.no_tilegym else load_tilegym(args.tilegym_autotune,
                                                                                          share)
    variants, choose_config = cutile_variants(args.variants)
    dev = torch.cuda.get_device_name()
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    head = (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {dev} ({sm} SMs), torch {torch.__version__}, "
            f"triton {triton.__version__}, cuda.tile {ct.__version__}; bf16 unless named, "
            f"{'random fp32 initial state' if args.initial_state else 'no initial state'}; "
            f"ms = median (do_bench); TileGym autotune {'on' if args.tilegym_autotune else 'off'}")
    print(head, flush=True)
    rows = []
    for name in args.shapes.split(","):
        dims = SHAPES[name]
        b, l, h, p, g, n = dims
        dtype = SHAPE_DTYPE.get(name, torch.bfloat16)
        inp = make_inputs(dims, seed=zlib.crc32(name.encode()) % 1000, dtype=dtype)
        h0 = (torch.randn(b, h, p, n, device="cuda") * 0.1 if args.initial_state else
              torch.zeros(b, h, p, n, dtype=torch.float32, device="cuda"))
        init = h0 if args.initial_state else None
        prob = validate(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], init)
        impls = []
        for label, v in variants:
            if v == "tuned":
                from m2export.kernels.ssd.cutile import tuned_config

                t0 = time.perf_counter()
                cfg = tuned_config(prob, dict(x=inp["x"], dt=inp["dt"], A=inp["A"], B=inp["B"], C=inp["C"], D=inp["D"],
                                              dt_bias=inp["dt_bias"], initial_state=init),
                                   dict(dt_softplus=True, dt_limit=(0.0, math.inf), has_D=True, has_dt_bias=True,
                                        has_init=init is not None), torch.cuda.current_stream(), inp["x"].device)
                label = f"cutile[tuned Q{cfg.chunk} p{cfg.block_p} {'T' if cfg.state_t else 'S'}]"
                print(f"  {name}: tuned in {time.perf_counter() - t0:.1f} s -> {cfg}", flush=True)
            else:
                cfg = config_of(prob, v, sm)
            y = torch.empty_like(inp["x"])
            fs = torch.empty(b, h, p, n, dtype=torch.float32, device="cuda")

            def run_ct(cfg=cfg, y=y, fs=fs):
                return ssm_scan_cutile(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"],
                                       init, problem=prob, dt_softplus=True, dt_limit=(0.0, math.inf), out=y,
                                       final_state_out=fs, config=cfg)
            impls.append((f"{label} s{cfg.nseg}", run_ct))
        if mamba is not None:
            mq = SHAPE_MAMBA_CHUNK.get(name, 256)

            def run_mamba(mq=mq):
                return mamba(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk_size=mq, D=inp["D"],
                             dt_bias=inp["dt_bias"], initial_states=init, dt_softplus=True, return_final_states=True)
            impls.append((f"mamba_ssm triton (chunk {mq})", run_mamba))
        if tilegym is not None and l % 64 == 0 and p % 64 == 0:
            # dt softplus'd once here, outside the timing (TileGym takes the step size itself)
            dt_sp = torch.nn.functional.softplus(inp["dt"].float() + inp["dt_bias"]).to(dtype)

            def run_tilegym(dt_sp=dt_sp, h0=h0):
                return tilegym(inp["x"], inp["A"], inp["B"], inp["C"], inp["D"], dt_sp, h0, chunk_size=64)
            impls.append(("TileGym cuTile (chunk 64)", run_tilegym))
        elif tilegym is not None:
            print(f"  {name}: TileGym not run (needs L % 64 == 0 and P % 64 == 0; L {l}, P {p})", flush=True)
        if not args.no_reference:
            def run_ref():
                return ssm_scan_chunked(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"],
                                        init, chunk_size=256)
            impls.append(("torch reference (chunk 256)", run_ref))
        ref_out = None
        for label, fn in impls:
            try:
                out = fn()
                torch.cuda.synchronize()
                if args.warmup_only:
                    print(f"  {name} {label}: compiled", flush=True)
                    continue
                yv, fsv = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
                if ref_out is None:
                    ref_out = ssm_scan_chunked(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"],
                                               inp["dt_bias"], init, chunk_size=256) if not label.startswith("torch") else out
                    torch.cuda.synchronize()
                err_y = rel_err(ref_out[0], yv)
                err_s = rel_err(ref_out[1], fsv) if fsv is not None else float("nan")
                t_e = time_fn(fn, graph=False, rep=args.rep, warmup=min(50, args.rep))
                try:
                    t_g = (time_fn(fn, graph=True, rep=args.rep, warmup=min(50, args.rep)) if not args.eager_only
                           else float("nan"))
                except Exception as e:  # noqa: BLE001
                    print(f"  graph capture failed for {label}: {e!r}", flush=True)
                    t_g = float("nan")
            except Exception as e:  # noqa: BLE001
                print(f"  {name} {label}: FAILED {e!r}", flush=True)
                continue
            t = t_g if not math.isnan(t_g) else t_e
            row = dict(shape=name, impl=label, eager=t_e, graph=t_g, tflops=flops(*dims) / (t * 1e-3) / 1e12,
                       gbs=bytes_moved(*dims) / (t * 1e-3) / 1e9, pct=floor_s(dims) / (t * 1e-3) * 100,
                       err_y=err_y, err_s=err_s)
            rows.append(row)
            print(f"  {name} {label:45s} eager {t_e:8.3f} ms  graph {t_g:8.3f} ms  {row['tflops']:6.1f} TFLOP/s "
                  f"{row['gbs']:7.0f} GB/s  {row['pct']:5.1f}% of floor  rel-err y {err_y:.2e} state {err_s:.2e}",
                  flush=True)
        ref_out = None
        torch.cuda.empty_cache()

    anchors = {}
    for r in rows:
        if r["impl"].startswith(("mamba_ssm", "TileGym")) and not math.isnan(r["graph"]):
            anchors[r["shape"]] = min(anchors.get(r["shape"], math.inf), r["graph"])
    lines = [f"### SSMScan forward, {head}", "",
             "| shape | implementation | eager ms | graph ms | TFLOP/s | GB/s | % of floor | / fastest anchor "
             "| rel-err y vs torch ref |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b, l, h, p, g, n = SHAPES[r["shape"]]
        dtn = str(SHAPE_DTYPE.get(r["shape"], torch.bfloat16)).replace("torch.", "")
        ratio = r["graph"] / anchors[r["shape"]] if r["shape"] in anchors else math.nan
        lines.append(f"| {r['shape']} (B{b} L{l} H{h} P{p} G{g} N{n} {dtn}) | {r['impl']} | {r['eager']:.3f} | "
                     f"{r['graph']:.3f} | {r['tflops']:.1f} | {r['gbs']:.0f} | {r['pct']:.1f} | {ratio:.2f} | "
                     f"{r['err_y']:.1e} |")
    floors = ", ".join(f"{k}: {floor_s(SHAPES[k]) * 1e3:.3f} ms" for k in args.shapes.split(","))
    notes = [f"mamba_ssm not run: {why_no_mamba}." if mamba is None else "",
             f"TileGym not run: {why_no_tilegym}." if tilegym is None else ""]
    lines += ["", f"Floor max(bytes/4.3 TB/s, FLOPs/790 TFLOP/s): {floors}. " + " ".join(n for n in notes if n), ""]
    append_results("\n".join(lines), args.results)


if __name__ == "__main__":
    main()
