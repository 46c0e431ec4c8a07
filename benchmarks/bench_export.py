"""Benchmark of ``m2export export`` and of the exported graphs in ONNX Runtime (CPU) vs PyTorch eager.

Per preset (random weights, mamba_ssm init; ``m2export.models.config.PRESETS``):

* export: wall time and peak resident memory (``resource.getrusage(RUSAGE_SELF).ru_maxrss`` of a fresh
  child process that runs only ``export_model(..., ssm_impl="both")``), file sizes;
* prefill throughput, batch 1, tokens/s = seqlen / time of one prefill call (best and median of
  ``--reps`` after one warm-up): PyTorch eager (``Mamba2LMHeadModel.forward``, the chunked reference scan)
  vs ORT CPUExecutionProvider on the plugin flavour (SSMScan local function) and the standard-op flavour;
* decode: ms per token of ``--decode-steps`` single-token steps (ORT decode graphs vs ``model.step``).

ORT and torch both get ``--threads`` intra-op threads. Results are appended to benchmarks/RESULTS.md.
The machine is shared: best-of-N is the number to compare, the median shows the noise.

    python benchmarks/bench_export.py --preset mamba2-130m
    python benchmarks/bench_export.py --preset mamba2-2.7b --dtype fp16 --no-throughput   # export only
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _child_export(ck: str, out: str, dtype: str) -> None:
    """Run one export in this (fresh) process and print its wall time and peak RSS as JSON."""
    from m2export.exporter import export_model

    t = time.perf_counter()
    export_model(ck, out, ssm_impl="both", dtype=dtype, force=True)
    wall = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    print(json.dumps({"wall_s": wall, "peak_rss_bytes": rss}))


def _random_checkpoint(ck: Path, preset: str, dtype) -> None:
    """random_checkpoint(preset=...) built directly in ``dtype`` (no fp32 copy: a 2.7B fp16 model stays ~5 GB)."""
    import torch

    from m2export.models.checkpoint import save_checkpoint
    from m2export.models.config import PRESETS, Mamba2Config
    from m2export.models.mamba2 import Mamba2LMHeadModel, init_weights_

    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = init_weights_(Mamba2LMHeadModel(Mamba2Config(**PRESETS[preset])), seed=0)
    finally:
        torch.set_default_dtype(prev)
    save_checkpoint(model, ck)


def _timeit(fn, reps: int) -> tuple[float, float]:
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts), statistics.median(ts)


def _throughput(ck: Path, out: Path, seqlens: list[int], reps: int, threads: int, decode_steps: int) -> list[dict]:
    import numpy as np
    import torch

    from m2export.exporter import OrtModel
    from m2export.exporter.manifest import read_manifest
    from m2export.models.checkpoint import load_checkpoint

    torch.set_num_threads(threads)
    man = read_manifest(out)
    tdt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[man.dtype]
    model = load_checkpoint(ck, dtype=tdt).model
    vocab = model.cfg.vocab_size
    rows = []
    oms = {impl: OrtModel(out, impl, threads=threads) for impl in ("plugin", "onnx")}
    for L in seqlens:
        ids = torch.randint(0, vocab, (1, L), generator=torch.Generator().manual_seed(L))
        with torch.no_grad():
            best, med = _timeit(lambda: model(ids), reps)
        rows.append({"what": f"prefill L={L}", "impl": "PyTorch eager", "best": L / best, "median": L / med})
        for impl, om in oms.items():
            best, med = _timeit(lambda: om.run(ids.numpy()), reps)
            rows.append({"what": f"prefill L={L}", "impl": f"ORT {impl}", "best": L / best, "median": L / med})
    # decode: ms per token over decode_steps steps after a 16-token prefill
    ids = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        st = model(ids)

        def torch_steps():
            o = st
            for _ in range(decode_steps):
                o = model.step(ids[:, :1], o.conv_states, o.ssm_states)

        best, med = _timeit(torch_steps, max(1, reps // 2))
    rows.append({"what": "decode", "impl": "PyTorch eager", "best": 1e3 * best / decode_steps,
                 "median": 1e3 * med / decode_steps, "unit": "ms/token"})
    for impl, om in oms.items():
        o0 = om.run(ids.numpy())

        def ort_steps():
            o = o0
            for _ in range(decode_steps):
                o = om.run(np.zeros((1, 1), np.int64), {k.replace("present_", "past_"): v for k, v in o.items()
                                                          if k.startswith("present_")}, decode=True)

        best, med = _timeit(ort_steps, max(1, reps // 2))
        rows.append({"what": "decode", "impl": f"ORT {impl}", "best": 1e3 * best / decode_steps,
                     "median": 1e3 * med / decode_steps, "unit": "ms/token"})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", action="append", help="model shape (repeatable; default mamba2-130m)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--no-throughput", action="store_true", help="export time/memory only")
    ap.add_argument("--workdir", default="/tmp/m2export-bench", help="checkpoints and exports (deleted unless --keep)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    ap.add_argument("--child-export", nargs=3, metavar=("CKPT", "OUT", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_export:
        _child_export(*args.child_export)
        return 0

    from m2export.models.config import PRESETS, Mamba2Config

    import torch

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    lines = []
    for preset in args.preset or ["mamba2-130m"]:
        cfg = Mamba2Config(**PRESETS[preset])
        ck, out = work / f"ck-{preset}", work / f"out-{preset}-{args.dtype}"
        tdt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
        t = time.perf_counter()
        if not (ck / "config.json").is_file():
            _random_checkpoint(ck, preset, tdt)
        print(f"[{preset}] checkpoint {time.perf_counter() - t:.0f}s", flush=True)
        proc = subprocess.run([sys.executable, __file__, "--child-export", str(ck), str(out), args.dtype],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            lines.append(f"| {preset} | {args.dtype} | export FAILED (rc {proc.returncode}): {' / '.join(tail)} | | |")
            print(lines[-1], flush=True)
            continue
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        sizes = {f.name: f.stat().st_size for f in out.iterdir()}
        files = ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in sorted(sizes.items()) if v > 1e6)
        n_params = sum(p.numel() for p in __import__("m2export.models.mamba2", fromlist=["x"])
                       .Mamba2LMHeadModel(cfg).parameters()) if preset == "mamba2-130m" else None
        lines.append(f"| {preset} (d_model {cfg.d_model}, {cfg.n_layer} layers"
                     + (f", {n_params / 1e6:.0f}M params" if n_params else "") + f") | {args.dtype} | "
                     f"{res['wall_s']:.0f} s | {res['peak_rss_bytes'] / 2**30:.1f} GiB | {files} |")
        print(lines[-1], flush=True)
        if not args.no_throughput:
            rows = _throughput(ck, out, args.seqlens, args.reps, args.threads, args.decode_steps)
            lines.append("")
            lines.append(f"{preset} {args.dtype}, batch 1, {args.threads} threads | best | median | unit")
            lines.append("--- | --- | --- | ---")
            for r in rows:
                lines.append(f"{r['what']}: {r['impl']} | {r['best']:.1f} | {r['median']:.1f} | "
                             f"{r.get('unit', 'tokens/s')}")
            print("\n".join(lines[-len(rows) - 2:]), flush=True)
            lines.append("")
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    import onnxruntime

    header = [f"## bench_export.py — {stamp} — CPU 2 cores (shared machine, {platform.processor() or platform.machine()})",
              "", f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}; export = export_model(ssm_impl='both') "
              "(prefill + decode, plugin + standard-op flavours, onnx.checker full check) in a fresh process.", "",
              "| model | dtype | export wall | export peak RSS | files |", "| --- | --- | --- | --- | --- |"]
    # the table rows are the lines starting with '| '; throughput tables follow them
    table = [ln for ln in lines if ln.startswith("| ")]
    rest = [ln for ln in lines if not ln.startswith("| ")]
    text = "\n".join(header + table + [""] + rest).rstrip() + "\n\n"
    res_path = Path(args.results)
    with open(res_path, "a") as f:
        f.write(text)
    print(f"appended to {res_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
