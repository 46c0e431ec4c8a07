"""Hybrid presets (issues 11 and 12): m2export's export and its graphs in ONNX Runtime (CPU) vs transformers eager.

Per preset (``--preset``, a key of ``m2export.models.presets.HYBRID_PRESETS``), one run:

* checkpoint: ``m2export random-checkpoint --preset P --dtype D`` (the family's HF format), once; its
  safetensors bytes are the "weight bytes" every RSS is divided by;
* export: ``m2export export CK -o OUT --ssm-impl I --dtype D`` (default ``all``: ssmscan + std + native,
  one weights file) in a fresh process: wall, user+sys CPU, peak RSS (``os.wait4`` of that child,
  :func:`_report.measured_run`), bytes on disk;
* speed (skipped with ``--export-only``): ORT CPUExecutionProvider on each ``--flavour`` (``OrtModel``,
  :mod:`m2export.exporter.runtime`) vs transformers eager (``AutoModelForCausalLM.from_pretrained(CK,
  dtype=D, attn_implementation="eager")``, its own cache for decode), batch 1: prefill tokens/s at each
  ``--seqlens`` L (L / seconds of one call on a fresh sequence) and decode ms/token (``--decode-steps``
  greedy one-token steps after a 16-token prompt, each runner on its own greedy path). The runners of one
  ``--group`` share a fresh process and are measured in interleaved rounds (warm-up, then runner A, B, ...,
  A, B, ...); best and median of ``--reps`` (``--reps-long`` for L >= 512). ORT times are the session's
  own (``Decoder.last_seconds``: feeds built and outputs copied outside), transformers' the forward call.
  Threads: ``torch.set_num_threads(T)`` and ORT ``intra_op_num_threads = T`` (``--threads``, default 2).
  Groups that do not fit in memory together are run one after the other (``--group`` given more than once).
* correctness: logits rel-L2 of each ORT flavour vs transformers on the same L=128 prompt (transformers
  changed only where :func:`m2export.check.runners.follow_mamba_ssm_` says: dt limit, per-group norm), and
  whether the greedy decode tokens agree;
* a watchdog (``--min-available-gib``) kills a measured child when the machine runs out of memory: its
  row then says so, with the peak RSS it had reached;
* ``--profile``: per ORT flavour, a fresh process with ``SessionOptions.enable_profiling``: one L=128 prefill
  and one decode step, node count and time per op type (top 8).

Every result is printed (stdout) and appended to benchmarks/RESULTS.md as soon as it is measured, with the date, ``uptime`` load and
versions. The machine is shared: compare best-of-N and the CPU seconds; the median shows the noise.

    flock /work/wt/BIGMEM.lock python benchmarks/bench_hybrids.py --preset falcon-h1-0.5b
    flock /work/wt/BIGMEM.lock python benchmarks/bench_hybrids.py --preset granite-4.0-h-1b \\
        --group ssmscan,transformers --group native,transformers
    flock /work/wt/BIGMEM.lock python benchmarks/bench_hybrids.py --preset nemotron-h-8b --dtype fp16 \\
        --ssm-impl ssmscan --export-only
"""

from __future__ import annotations

import argparse
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

from _report import du, measured_run, profile_by_op, publish, utc_now  # noqa: E402 (beside this script)

TRANSFORMERS = "transformers"
DTYPES = ("fp32", "fp16", "bf16")
PROMPT_SEED = 1234


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _m2export() -> str:
    """The m2export CLI of this interpreter's environment."""
    exe = Path(sys.executable).parent / "m2export"
    return str(exe) if exe.exists() else shutil.which("m2export") or "m2export"


def _prompt(vocab: int, L: int, seed: int = PROMPT_SEED):
    import numpy as np

    return np.random.default_rng(seed + L).integers(0, vocab, (1, L), dtype=np.int64)


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


# --------------------------------------------------------------------------------------------------- runners
class _Ort:
    """One ORT flavour of an export: prefill on a fresh sequence, decode steps through the state I/O."""

    def __init__(self, out: Path, flavour: str, threads: int, profile_dir: Path | None = None):
        from m2export.exporter.runtime import OrtModel

        if profile_dir is None:
            self.om = OrtModel(out, flavour, threads=threads)
        else:  # the same session options as ort_session, plus profiling
            import onnxruntime as ort

            from m2export.exporter.manifest import read_manifest
            from m2export.exporter.runtime import Decoder, SessionInfer

            man = read_manifest(out)
            entry = man.graph("prefill", flavour)
            so = ort.SessionOptions()
            so.intra_op_num_threads = threads
            so.log_severity_level = 3
            so.enable_profiling = True
            so.profile_file_prefix = str(profile_dir / f"{out.name}-{flavour}")
            self.sess = ort.InferenceSession(str(out / entry.file), sess_options=so,
                                             providers=["CPUExecutionProvider"])
            io = entry.io()
            self.om = Decoder(io, SessionInfer(self.sess, io.output_names()).infer)
        self.vocab = self.om.io.outputs[0].shape[-1]

    def prefill(self, ids):
        """(seconds, logits (1, L, V) float32, state to continue)."""
        import numpy as np

        out = self.om.call(ids)
        return self.om.last_seconds, np.asarray(out["logits"], np.float32), out

    def step(self, tok, state):
        import numpy as np

        out = self.om.call(tok, self.om.io.next_past(state, copy=False), decode=True)
        return self.om.last_seconds, np.asarray(out["logits"], np.float32), out


class _Transformers:
    """transformers eager of the checkpoint, its own cache for decode."""

    def __init__(self, ck: Path, dtype: str):
        import torch
        import transformers

        from m2export.check.runners import follow_mamba_ssm_
        from m2export.models.checkpoint import read_spec

        self.torch = torch
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(ck), dtype=_torch_dtype(dtype), attn_implementation="eager").eval()
        spec, _ = read_spec(ck)
        self.notes = follow_mamba_ssm_(self.hf, spec)
        self.vocab = self.hf.get_output_embeddings().weight.shape[0]

    def _call(self, ids, cache=None):
        torch = self.torch
        with torch.inference_mode():
            t = time.perf_counter()
            out = self.hf(torch.from_numpy(ids), past_key_values=cache, use_cache=True)
            secs = time.perf_counter() - t
        return secs, out.logits.float().numpy(), out.past_key_values

    def prefill(self, ids):
        return self._call(ids)

    def step(self, tok, cache):
        return self._call(tok, cache)


def _child_speed(spec: dict) -> dict:
    """One group of runners in this (fresh) process, interleaved; prints nothing, returns the JSON result."""
    import numpy as np
    import torch

    threads = spec["threads"]
    torch.set_num_threads(threads)
    out, ck, logits_dir = Path(spec["out"]), Path(spec["ck"]), Path(spec["logits_dir"])
    runners, res = {}, {"runners": {}, "notes": []}
    for name in spec["runners"]:
        t = time.perf_counter()
        runners[name] = _Transformers(ck, spec["dtype"]) if name == TRANSFORMERS else _Ort(out, name, threads)
        res["runners"][name] = {"load_s": time.perf_counter() - t, "rows": {}}
        if name == TRANSFORMERS:
            res["notes"] += runners[name].notes
        _log(f"  loaded {name} ({time.perf_counter() - t:.0f} s)")
    vocab = min(r.vocab for r in runners.values())
    for L in spec["seqlens"]:
        ids = _prompt(vocab, L)
        reps = spec["reps_long"] if L >= 512 else spec["reps"]
        ts: dict[str, list[float]] = {k: [] for k in runners}
        for k, r in runners.items():  # warm-up (and the logits of the check prompt)
            secs, logits, _ = r.prefill(ids)
            if L == spec["check_len"]:
                np.save(logits_dir / f"{k}.npy", logits[..., :vocab])
            _log(f"  L={L} warm-up {k}: {secs:.2f} s")
        for i in range(reps):
            for k, r in runners.items():
                ts[k].append(r.prefill(ids)[0])
            _log(f"  L={L} round {i + 1}/{reps}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in ts.items()))
        for k, v in ts.items():
            res["runners"][k]["rows"][f"prefill L={L}"] = {"best": L / min(v), "median": L / statistics.median(v),
                                                           "unit": "tokens/s", "n": len(v)}
    prompt = _prompt(vocab, 16)
    state, toks, ts = {}, {k: [] for k in runners}, {k: [] for k in runners}
    for k, r in runners.items():
        _, logits, state[k] = r.prefill(prompt)
        toks[k].append(int(logits[0, -1, :vocab].argmax()))
    for _ in range(spec["decode_steps"]):
        for k, r in runners.items():
            secs, logits, state[k] = r.step(np.array([[toks[k][-1]]], np.int64), state[k])
            ts[k].append(secs)
            toks[k].append(int(logits[0, -1, :vocab].argmax()))
    for k in runners:
        v = ts[k][1:]  # the first step allocates (first call at sequence_length 1): not counted
        res["runners"][k]["rows"]["decode"] = {"best": 1e3 * min(v), "median": 1e3 * statistics.median(v),
                                               "unit": "ms/token", "n": len(v)}
        res["runners"][k]["tokens"] = toks[k]
    res["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return res


def _child_profile(spec: dict) -> dict:
    """Per op type (count, ms) of one L=check_len prefill and one decode step of one ORT flavour."""
    import numpy as np

    prof = Path(spec["prof_dir"])
    prof.mkdir(parents=True, exist_ok=True)
    r = _Ort(Path(spec["out"]), spec["flavour"], spec["threads"], profile_dir=prof)
    ids = _prompt(r.vocab, spec["check_len"])
    r.prefill(ids)  # run 0: warm-up
    _, _, st = r.prefill(ids)  # run 1
    _, _, st2 = r.step(np.ones((1, 1), np.int64), st)  # run 2: warm-up of the one-token shape
    r.step(np.ones((1, 1), np.int64), st2)  # run 3
    path = Path(r.sess.end_profiling())
    # split the events by run: the profile's "model_run" events bound each call, in order
    ev = json.loads(path.read_text())
    runs = [e for e in ev if e.get("name") == "model_run"]
    out = {}
    for what, run in (("prefill", runs[1]), ("decode", runs[3])):
        lo, hi = run["ts"], run["ts"] + run["dur"]
        sub = [e for e in ev if lo <= e.get("ts", -1) <= hi]
        part = path.with_suffix(f".{what}.json")
        part.write_text(json.dumps(sub))
        out[what] = {"run_ms": run["dur"] / 1e3, "ops": profile_by_op(part)}
    return out


# ------------------------------------------------------------------------------------------------------ main
def _versions() -> str:
    from importlib.metadata import version

    return ", ".join(f"{p} {version(p)}" for p in ("torch", "transformers", "onnxruntime", "onnx"))


def _load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip().split("load average:")[-1].strip()


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


#: the watchdog's MemAvailable floor (``--min-available-gib``): set by main
MIN_AVAILABLE: list[int | None] = [None]


def _measured(cmd: list[str]) -> dict:
    return measured_run(cmd, min_available=MIN_AVAILABLE[0])


def _child(mode: str, spec: dict) -> dict:
    """Run ``--child-MODE SPEC`` in a fresh process; its JSON result plus wall/CPU/RSS, or ``error``."""
    r = _measured([sys.executable, __file__, f"--child-{mode}", json.dumps(spec)])
    if r["rc"] != 0:
        return {"error": f"rc {r['rc']}: {r['tail']}", **{k: r[k] for k in ("wall_s", "peak_rss_bytes")}}
    return {**json.loads(r["stdout"].strip().splitlines()[-1]), "wall_s": r["wall_s"], "cpu_s": r["cpu_s"]}


class _Results:
    """The run's markdown, written as it is made: :meth:`emit` prints lines (stdout) and appends them to the
    results file at once, so a long run that is stopped keeps what it measured."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def emit(self, *lines: str) -> None:
        publish("\n".join(lines) + "\n", self.path, sep="")


def bench_preset(preset: str, args, res: _Results) -> None:
    """Everything for one preset, emitted to ``res`` step by step; the checkpoint and export are deleted after
    (unless ``--keep``)."""
    from m2export.models.presets import HYBRID_PRESETS

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    ck, out = work / f"ck-{preset}-{args.dtype}", work / f"out-{preset}-{args.dtype}"
    logits_dir = work / f"logits-{preset}"
    try:
        _bench_preset(preset, args, res, HYBRID_PRESETS[preset].family, ck, out, logits_dir, work)
    finally:
        if not args.keep:
            for d in (out, ck, logits_dir):
                shutil.rmtree(d, ignore_errors=True)


def _bench_preset(preset, args, res, family, ck, out, logits_dir, work) -> None:
    lines = ["", f"### {preset} ({family}), {args.dtype} — {utc_now()}, load {_load()}", ""]
    if not (ck / "config.json").is_file():
        _log(f"[{preset}] random-checkpoint")
        r = _measured([_m2export(), "random-checkpoint", "--preset", preset, "--dtype", args.dtype, "-o", str(ck),
                       "--force", "-q"])
        if r["rc"] != 0:
            res.emit(*lines, f"random-checkpoint FAILED ({r['tail']}), peak RSS {_gib(r['peak_rss_bytes'])}")
            return
        lines.append(f"checkpoint: `m2export random-checkpoint --preset {preset} --dtype {args.dtype}` "
                     f"{r['wall_s']:.0f} s wall, peak RSS {_gib(r['peak_rss_bytes'])}; ")
    wbytes = sum(f.stat().st_size for f in ck.glob("*.safetensors"))
    weights = f"weights: {wbytes / 1e6:,.0f} MB ({args.dtype} safetensors)"
    if lines[-1]:  # the checkpoint line: same paragraph
        lines[-1] += weights
    else:
        lines.append(weights)
    if args.reuse_export and (out / "m2export.json").is_file():
        res.emit(*lines, "", f"export: reused {out} (written by an earlier run; its numbers are there)")
        lines, e = [], {"rc": 0, "reused": True}
    else:
        _log(f"[{preset}] export --ssm-impl {args.ssm_impl} (load {_load()})")
        e = _measured([_m2export(), "export", str(ck), "-o", str(out), "--ssm-impl", args.ssm_impl, "--dtype",
                       args.dtype, "--force", "-q"])
    if not e.get("reused"):
        lines += ["", "| export | wall (contended) | user+sys CPU | peak RSS | x weight bytes | on disk | load after |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        status = "" if e["rc"] == 0 else f" FAILED rc {e['rc']} ({e['tail']})"
        disk = f"{du(out) / 1e6:,.0f} MB" if e["rc"] == 0 else "—"
        lines.append(f"| `--ssm-impl {args.ssm_impl} --dtype {args.dtype}`{status} | {e['wall_s']:.0f} s | "
                     f"{e['cpu_s']:.0f} s | {_gib(e['peak_rss_bytes'])} | {e['peak_rss_bytes'] / wbytes:.2f}x | "
                     f"{disk} | {_load()} |")
        res.emit(*lines)
    if e["rc"] != 0 or args.export_only:
        return
    groups = [g.split(",") for g in (args.group or [",".join([*args.flavour, TRANSFORMERS])])]
    logits_dir.mkdir(exist_ok=True)
    base = {"ck": str(ck), "out": str(out), "dtype": args.dtype, "seqlens": args.seqlens, "reps": args.reps,
            "reps_long": args.reps_long or args.reps, "decode_steps": args.decode_steps, "threads": args.threads,
            "check_len": 128, "logits_dir": str(logits_dir)}
    res.emit("", f"Speed: batch 1, {args.threads} threads (torch.set_num_threads and ORT intra_op_num_threads), "
                 f"best / median of {args.reps} interleaved rounds ({base['reps_long']} for L >= 512) after one "
                 f"warm-up; decode: {args.decode_steps - 1} steps after a 16-token prompt (first step not counted). "
                 "One process per group, groups one after the other.",
             "", "| group (one process) | runner | load | " + " | ".join(f"prefill L={L} tok/s" for L in args.seqlens)
             + " | decode ms/token | process peak RSS (x weights) | logits rel-L2 vs transformers (L=128) | "
               "greedy tokens vs transformers | process wall / CPU, load after |",
             "|" + " --- |" * (8 + len(args.seqlens)))
    ref_logits = logits_dir / f"{TRANSFORMERS}.npy"
    ref_toks, notes = None, set()
    for g in groups:
        gname = " + ".join(g)
        _log(f"[{preset}] speed, group {gname} (load {_load()})")
        r = _child("speed", {**base, "runners": g})
        if "error" in r:
            res.emit(f"| {gname} | FAILED ({r['error']}); peak RSS {_gib(r['peak_rss_bytes'])} "
                     f"({r['peak_rss_bytes'] / wbytes:.2f}x) |" + " |" * (6 + len(args.seqlens)))
            continue
        notes.update(r["notes"])
        ref_toks = r["runners"].get(TRANSFORMERS, {}).get("tokens", ref_toks)
        rows = []
        for k, rr in r["runners"].items():
            cells = [f"{rr['load_s']:.0f} s"]
            cells += [f"{rr['rows'][f'prefill L={L}']['best']:.1f} / {rr['rows'][f'prefill L={L}']['median']:.1f}"
                      for L in args.seqlens]
            cells.append(f"{rr['rows']['decode']['best']:.1f} / {rr['rows']['decode']['median']:.1f}")
            cells.append(f"{_gib(r['peak_rss_bytes'])} ({r['peak_rss_bytes'] / wbytes:.2f}x)")
            if k != TRANSFORMERS and ref_logits.is_file() and 128 in args.seqlens:
                import numpy as np

                a, b = np.load(logits_dir / f"{k}.npy"), np.load(ref_logits)
                cells.append(f"{np.linalg.norm(a - b) / np.linalg.norm(b):.1e}")
            else:
                cells.append("—")
            if k != TRANSFORMERS and ref_toks:
                same = next((i for i, (x, y) in enumerate(zip(rr["tokens"], ref_toks)) if x != y), None)
                cells.append(f"{len(ref_toks)}/{len(ref_toks)} equal" if same is None else f"first differs at {same}")
            else:
                cells.append("—")
            cells.append(f"{r['wall_s']:.0f} s / {r['cpu_s']:.0f} s, {_load()}")
            rows.append(f"| {gname} | {k} | " + " | ".join(cells) + " |")
        res.emit(*rows)
    if notes:
        res.emit("", "transformers changed to follow mamba_ssm (check.runners.follow_mamba_ssm_): "
                 + "; ".join(sorted(notes)))
    if args.profile:
        res.emit("", "ORT profile (one call each after warm-up; node count, ms per op type, top 8 by time):", "")
        for fl in args.flavour:
            p = _child("profile", {**base, "flavour": fl, "prof_dir": str(work / "profiles")})
            if "error" in p:
                res.emit(f"- {fl}: profile FAILED ({p['error']})")
                continue
            for what in ("prefill", "decode"):
                ops = sorted(p[what]["ops"].items(), key=lambda kv: -kv[1][1])
                total = sum(ms for _, ms in p[what]["ops"].values())
                res.emit(f"- {fl} {what} ({'L=128' if what == 'prefill' else '1 token'}): run "
                         f"{p[what]['run_ms']:.0f} ms, nodes {sum(n for _, (n, _) in ops)} ({total:.0f} ms): "
                         + ", ".join(f"{op} {n}x {ms:.0f} ms" for op, (n, ms) in ops[:8]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", action="append", help="hybrid preset (repeatable)")
    ap.add_argument("--dtype", default="fp32", choices=DTYPES)
    ap.add_argument("--ssm-impl", default="all", help="what the export writes (m2export export --ssm-impl)")
    ap.add_argument("--flavour", nargs="+", default=["ssmscan", "native"], help="ORT flavours timed")
    ap.add_argument("--group", action="append",
                    help="comma-separated runners sharing one process (flavours and/or 'transformers'); repeat to "
                         "run groups one after the other (default: one group of every flavour + transformers)")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--reps-long", type=int, help="reps for L >= 512 (default --reps)")
    ap.add_argument("--decode-steps", type=int, default=17)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--export-only", action="store_true")
    ap.add_argument("--profile", action="store_true", help="ORT profile of each flavour (a fresh process each)")
    ap.add_argument("--min-available-gib", type=float, default=1.5,
                    help="kill a measured child of this run when the machine's MemAvailable falls below this "
                         "(a shared machine: before the OOM killer picks someone else's process); 0: off")
    ap.add_argument("--workdir", default="/tmp/hbench")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and export (multi-GB)")
    ap.add_argument("--reuse-export", action="store_true",
                    help="time an export an earlier --keep run left in --workdir (no export measured)")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    ap.add_argument("--child-speed", help=argparse.SUPPRESS)
    ap.add_argument("--child-profile", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_speed or args.child_profile:
        fn = _child_speed if args.child_speed else _child_profile
        print(json.dumps(fn(json.loads(args.child_speed or args.child_profile))))
        return 0
    from m2export.models.presets import HYBRID_PRESETS

    MIN_AVAILABLE[0] = int(args.min_available_gib * 2**30) or None
    for p in args.preset or []:
        if p not in HYBRID_PRESETS:
            ap.error(f"--preset {p!r}: expected one of {sorted(HYBRID_PRESETS)}")
    if not args.preset:
        ap.error("give --preset")
    res = _Results(args.results)
    res.emit("", f"## bench_hybrids.py — {utc_now()} — CPU here ({os.cpu_count()} cores shared, "
                 f"{platform.machine()}), {_versions()}")
    for p in args.preset:
        bench_preset(p, args, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
