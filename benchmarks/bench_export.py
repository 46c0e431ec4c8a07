"""Benchmark of ``m2export export`` and of the exported graphs in ONNX Runtime (CPU) vs PyTorch eager.

Per preset (random weights, mamba_ssm init; ``m2export.models.config.PRESETS``):

* export: user+sys CPU seconds, wall time and peak resident memory (``resource.getrusage(RUSAGE_SELF)`` of a
  fresh child process that runs only ``export_model(..., ssm_impl="both")``), file sizes; on a shared machine
  the CPU seconds and the RSS are the load-independent numbers;
* prefill throughput, batch 1, tokens/s = seqlen / time of one prefill call (best and median of
  ``--reps`` after one warm-up): PyTorch eager (``Mamba2LMHeadModel.forward``, the chunked reference scan)
  vs ORT CPUExecutionProvider on the plugin flavour (SSMScan local function) and the standard-op flavour;
* decode: ms per token of ``--decode-steps`` greedy single-token steps (ORT decode graph vs ``model.step``);
* checks: rel-L2 of ORT's logits of the longest prefill vs PyTorch's, and greedy tokens ORT == PyTorch.

Each phase (export, PyTorch, ORT plugin, ORT standard-op) runs in its own fresh process, so its peak RSS is
its own. ORT and torch both get ``--threads`` intra-op threads. Results are appended to benchmarks/RESULTS.md.
The machine is shared: best-of-N is the number to compare, the median shows the noise.

    python benchmarks/bench_export.py --preset mamba2-130m
    python benchmarks/bench_export.py --preset mamba2-2.7b --dtype fp16 --no-throughput --keep   # export only
    python benchmarks/bench_export.py --preset mamba2-2.7b --dtype fp16 --reuse --seqlens 32 --reps 1
"""

from __future__ import annotations

import argparse
import datetime
import json
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
    ru = resource.getrusage(resource.RUSAGE_SELF)
    # user + sys CPU seconds of the whole process (imports included): load-independent on a shared machine
    print(json.dumps({"wall_s": wall, "peak_rss_bytes": ru.ru_maxrss * 1024,  # Linux: KiB
                      "cpu_s": ru.ru_utime + ru.ru_stime}))


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
    save_checkpoint(model, ck, force=True)


def _timeit(fn, reps: int) -> tuple[float, float]:
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts), statistics.median(ts)


def _prompt(vocab: int, L: int):
    import torch

    return torch.randint(0, vocab, (1, L), generator=torch.Generator().manual_seed(L))


def _child_run(phase: str, ck: str, out: str, spec: str) -> None:
    """One measurement phase in a fresh process (so each phase's memory is freed and measured alone).

    phase "torch": PyTorch eager prefill tokens/s per seqlen, decode ms/token, greedy tokens, and the
    logits of the longest prefill saved to OUT/../torch_logits.npy. phase "ort:<impl>": the same through
    ORT sessions (the prefill session is closed before the decode session opens, so one ~graph-sized
    session is alive at a time), plus rel-L2 of the longest prefill's logits against PyTorch's and whether
    the greedy tokens are equal. Prints one JSON object.
    """
    import numpy as np
    import torch

    from m2export.exporter.manifest import read_manifest
    from m2export.exporter.runtime import OrtModel

    cfg = json.loads(spec)
    seqlens, reps, threads, steps = cfg["seqlens"], cfg["reps"], cfg["threads"], cfg["decode_steps"]
    torch.set_num_threads(threads)
    man = read_manifest(out)
    vocab = man.model_config().vocab_size
    ref_file = Path(out).parent / (Path(out).name + ".torch_logits.npy")
    res: dict = {"rows": []}
    gen_prompt = _prompt(vocab, 16)
    if phase == "torch":
        from m2export.models.checkpoint import load_checkpoint

        tdt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[man.dtype]
        model = load_checkpoint(ck, dtype=tdt).model
        with torch.no_grad():
            for L in seqlens:
                ids = _prompt(vocab, L)
                best, med = _timeit(lambda: model(ids), reps)
                res["rows"].append({"what": f"prefill L={L}", "best": L / best, "median": L / med})
            np.save(ref_file, model(_prompt(vocab, seqlens[-1])).logits.float().numpy())
            st = model(gen_prompt)
            toks = [int(st.logits[0, -1].argmax())]
            model.step(torch.tensor([[toks[-1]]]), st.conv_states, st.ssm_states)  # warm-up, result unused
            t = time.perf_counter()
            for _ in range(steps):
                st = model.step(torch.tensor([[toks[-1]]]), st.conv_states, st.ssm_states)
                toks.append(int(st.logits[0, -1].argmax()))
            res["rows"].append({"what": "decode", "best": 1e3 * (time.perf_counter() - t) / steps,
                                "unit": "ms/token"})
        res["tokens"] = toks
    else:
        impl = phase.split(":", 1)[1]
        om = OrtModel(out, impl, threads=threads)
        for L in seqlens:
            ids = _prompt(vocab, L).numpy()
            best, med = _timeit(lambda: om.run(ids), reps)
            res["rows"].append({"what": f"prefill L={L}", "best": L / best, "median": L / med})
        logits = om.run(_prompt(vocab, seqlens[-1]).numpy())["logits"].astype(np.float32)
        if ref_file.is_file():
            ref = np.load(ref_file)
            res["rel_l2"] = float(np.linalg.norm(logits - ref) / np.linalg.norm(ref))
        om.run(np.zeros((1, 1), np.int64), decode=True)  # warm-up, result unused
        toks, secs = [], 0.0
        for st in om.run_sequence(gen_prompt.numpy(), steps):
            toks.append(int(np.asarray(st.outputs["logits"])[0, -1].argmax()))
            secs += st.seconds if st.index else 0.0
        res["rows"].append({"what": "decode", "best": 1e3 * secs / steps, "unit": "ms/token"})
        res["tokens"] = toks
    res["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(res))


def _run_child(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"rc {proc.returncode}: " + " / ".join(tail)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _n_params(cfg) -> int:
    """Parameter count of a Mamba-2 LM from its config (tied embeddings counted once)."""
    per_layer = (cfg.d_model * cfg.d_in_proj  # in_proj (no bias)
                 + cfg.conv_dim * cfg.d_conv + cfg.conv_dim  # conv1d weight + bias
                 + 3 * cfg.nheads + cfg.d_inner  # dt_bias, A_log, D, gated-norm weight
                 + cfg.d_inner * cfg.d_model + cfg.d_model)  # out_proj, block norm
    head = 0 if cfg.tie_embeddings else cfg.vocab_size_padded * cfg.d_model
    return cfg.vocab_size_padded * cfg.d_model + cfg.n_layer * per_layer + cfg.d_model + head


def _fmt_size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", action="append", help="model shape (repeatable; default mamba2-130m)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--no-throughput", action="store_true", help="export time/memory only")
    ap.add_argument("--workdir", default="/tmp/m2export-bench", help="checkpoints and exports (deleted unless --keep)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--reuse", action="store_true", help="measure an export kept by an earlier --keep run")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    ap.add_argument("--child-export", nargs=3, metavar=("CKPT", "OUT", "DTYPE"), help=argparse.SUPPRESS)
    ap.add_argument("--child-run", nargs=4, metavar=("PHASE", "CKPT", "OUT", "SPEC"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_export:
        _child_export(*args.child_export)
        return 0
    if args.child_run:
        _child_run(*args.child_run)
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
        if args.reuse and (out / "m2export.json").is_file():
            res = {"reused": True}
        else:
            res = _run_child(["--child-export", str(ck), str(out), args.dtype])
        if "error" in res:
            lines.append(f"| {preset} | {args.dtype} | export FAILED ({res['error']}) | | | |")
            print(lines[-1], flush=True)
            continue
        sizes = {f.name: f.stat().st_size for f in out.iterdir() if f.suffix in (".onnx", ".data")}
        files = ", ".join(f"{k} {_fmt_size(v)}" for k, v in sorted(sizes.items()))
        wall = "(reused export)" if "reused" in res else f"{res['wall_s']:.0f} s"
        rss = "" if "reused" in res else f"{res['peak_rss_bytes'] / 2**30:.2f} GiB"
        cpu = "" if "reused" in res else f"{res['cpu_s']:.1f} s"
        lines.append(f"| {preset} (d_model {cfg.d_model}, {cfg.n_layer} layers, {_n_params(cfg) / 1e6:.0f}M params) | "
                     f"{args.dtype} | {cpu} | {wall} | {rss} | {files} |")
        print(lines[-1], flush=True)
        if not args.no_throughput:
            spec = json.dumps({"seqlens": args.seqlens, "reps": args.reps, "threads": args.threads,
                               "decode_steps": args.decode_steps})
            phases = {"PyTorch eager": "torch", "ORT plugin flavour": "ort:plugin", "ORT standard-op flavour": "ort:onnx"}
            results = {name: _run_child(["--child-run", ph, str(ck), str(out), spec]) for name, ph in phases.items()}
            lines += ["", f"{preset} {args.dtype}, batch 1, {args.threads} threads | best | median | unit", "--- | --- | --- | ---"]
            torch_toks = results["PyTorch eager"].get("tokens")
            for name, r in results.items():
                if "error" in r:
                    lines.append(f"{name} | FAILED: {r['error']} | |")
                    continue
                for row in r["rows"]:
                    med = f"{row['median']:.1f}" if "median" in row else ""
                    lines.append(f"{row['what']}: {name} | {row['best']:.1f} | {med} | {row.get('unit', 'tokens/s')}")
                acc = [f"peak RSS {r['peak_rss_bytes'] / 2**30:.1f} GiB"]
                if "rel_l2" in r:
                    acc.append(f"logits rel-L2 vs PyTorch (L={args.seqlens[-1]}) {r['rel_l2']:.1e}")
                if name != "PyTorch eager" and torch_toks:
                    same = r["tokens"] == torch_toks
                    acc.append(f"greedy {len(torch_toks)} tokens {'==' if same else '!='} PyTorch")
                lines.append(f"{name}: check | {'; '.join(acc)} | |")
            print("\n".join(lines[-(3 + sum(len(r.get('rows', [])) + 1 for r in results.values())):]), flush=True)
            lines.append("")
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
            for f in work.glob(out.name + ".torch_logits.npy"):
                f.unlink()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    import onnxruntime

    header = [f"## bench_export.py — {stamp} — CPU 2 cores (shared machine, {platform.processor() or platform.machine()})",
              "", f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}; export = export_model(ssm_impl='both') "
              "(prefill + decode, plugin + standard-op flavours, onnx.checker full check) in a fresh process.", "",
              "| model | dtype | export user+sys CPU | export wall | export peak RSS | files |",
              "| --- | --- | --- | --- | --- | --- |"]
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
