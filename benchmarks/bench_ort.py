"""m2export vs Microsoft's mobius-onnx on the same HF checkpoints, in ONNX Runtime (CPU), one run side by side.

Per checkpoint (``--checkpoint``: ``130m``, a mamba2-130m-shaped HF checkpoint with transformers' default
init, ``tests.helpers.hf_init_checkpoint``; ``bundled``, samples/checkpoints/stdlib-byte-mamba2 converted
to the HF format so mobius can read it; or a path to any HF Mamba-2 folder):

* export: wall time and peak RSS of a fresh child process doing only the export
  (``os.wait4``'s ``ru_maxrss`` of that child), bytes on disk of the output folder;
  m2export: ``export_model(..., ssm_impl="native")``; mobius: ``mobius build OUT --model CK --ep cpu
  --optimize`` from a throwaway venv (``--mobius-venv``, created with ``pip install mobius-onnx``
  on first use; never a project dependency);
* ORT prefill L=128 / 512 and decode ms/token: every model's session in one process, measured in
  interleaved rounds (m2export, mobius, m2export, ...), best and median of ``--reps`` (>= 10) rounds on each of
  ``--session-sets`` (4) fresh sets of sessions, created in alternating orders (:func:`measure` says why); with
  ``--all-flavours`` (default) the std and ssmscan flavours too (a second export, ``ssm_impl="both"``,
  whose wall/RSS/disk cells are that export's);
* accuracy: logits of the L=512 prefill vs a true float64 forward of the checkpoint
  (:func:`m2export.models.reference.float64_model`: every op in float64, the scan a float64 recurrence), rel-L2;
  beside it vs transformers' ``Mamba2ForCausalLM`` loaded in float64, which is not float64 throughout (its
  norms, residual and scan inputs are float32: :func:`accuracy`).
* ORT kernels per prefill (L=512) and decode call: ORT profiling, count and total time of node events.

Results: a markdown table on stdout, appended to benchmarks/RESULTS.md. The machine is shared: compare
best-of-N; the median shows the noise.

    python benchmarks/bench_ort.py --checkpoint bundled --checkpoint 130m --reps 10
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _report import du, measured_run, profile_by_op, publish, utc_now  # noqa: E402 (benchmarks/_report.py, beside this script)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _child(cmd: list[str]) -> dict:
    """Run ``cmd`` in a fresh process (:func:`_report.measured_run`); raise if it failed."""
    res = measured_run(cmd)
    if res["rc"] != 0:
        raise RuntimeError(f"{cmd[0]} ... failed (rc {res['rc']}): {res['tail']}")
    return res


def mobius_venv(venv: Path) -> Path:
    """The mobius venv's python, creating the venv (torch 2.13.0 CPU first, then mobius-onnx) on first use."""
    py = venv / "bin" / "python"
    if not (venv / "bin" / "mobius").exists():
        _log(f"creating {venv} with mobius-onnx (throwaway; not a project dependency)")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "torch==2.13.0"], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "mobius-onnx"], check=True)
    return py


def checkpoints(names: list[str], work: Path) -> dict[str, Path]:
    """name -> HF-format checkpoint dir."""
    from m2export.models.checkpoint import load_checkpoint, save_checkpoint
    from tests.helpers import hf_init_checkpoint

    out = {}
    for n in names:
        if n == "130m":
            d = work / "hf-mamba2-130m"
            if not (d / "config.json").is_file():
                # in a child: a model built in this process stays resident here, and every export child started
                # after it reported this process's pages as its own peak RSS (0.98 GiB for both exporters on the
                # first run of a fresh --workdir, 0.48 / 0.95 GiB once the checkpoint existed: benchmarks/RESULTS.md)
                _child([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[2]); "
                        "from tests.helpers import hf_init_checkpoint; hf_init_checkpoint(sys.argv[1], 'mamba2-130m')",
                        str(d), str(ROOT)])
            out[n] = hf_init_checkpoint(d, "mamba2-130m")  # reused: its config.json exists
        elif n == "bundled":
            d = work / "hf-stdlib-byte-mamba2"
            if not (d / "config.json").is_file():
                save_checkpoint(load_checkpoint(ROOT / "samples/checkpoints/stdlib-byte-mamba2").model, d, format="hf")
            out[n] = d
        else:
            out[Path(n).name] = Path(n)
    return out


def _feeds_for(sess, ids, past=None):
    """Feeds for any decoder graph: input_ids, optional attention_mask / position_ids, zero (or given) states."""
    import numpy as np

    b, L = ids.shape
    feeds = {}
    types = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
             "tensor(int32)": np.int32}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = ids
        elif i.name == "attention_mask":
            total = L + (past or {}).get("_past_len", 0)
            feeds[i.name] = np.ones((b, total), types[i.type])
        elif i.name == "position_ids":
            start = (past or {}).get("_past_len", 0)
            feeds[i.name] = np.arange(start, start + L, dtype=types[i.type])[None].repeat(b, 0)
        elif past is not None and i.name in past:
            feeds[i.name] = past[i.name]
        else:
            shape = [b if isinstance(d, str) and "batch" in d else (0 if isinstance(d, str) else d) for d in i.shape]
            feeds[i.name] = np.zeros(shape, types[i.type])
    return feeds


def _pairs(sess) -> dict[str, str]:
    """present output name -> past input name (by the shared suffix after 'past'/'present')."""
    ins = [i.name for i in sess.get_inputs()]
    out = {}
    for o in sess.get_outputs():
        n = o.name
        for cand in (n.replace("present_", "past_", 1), n.replace("present.", "past_key_values.", 1),
                     n.replace("present", "past", 1)):
            if cand in ins:
                out[n] = cand
                break
    return out


class Runner:
    """One decoder graph in an ORT session: prefill(ids) and decode steps by feeding present -> past."""

    def __init__(self, path: Path, threads: int, profile_dir: Path | None = None):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        if profile_dir is not None:
            so.enable_profiling = True
            so.profile_file_prefix = str(profile_dir / path.parent.name)
        self.sess = ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])
        self.names = [o.name for o in self.sess.get_outputs()]
        self.pairs = _pairs(self.sess)

    def run(self, ids, past=None):
        out = dict(zip(self.names, self.sess.run(self.names, _feeds_for(self.sess, ids, past))))
        nxt = {self.pairs[k]: v for k, v in out.items() if k in self.pairs}
        nxt["_past_len"] = (past or {}).get("_past_len", 0) + ids.shape[1]
        return out, nxt


def _profile_counts(path: Path) -> tuple[int, float]:
    """(node events, total node time in ms) of one ORT profile JSON."""
    ops = profile_by_op(path).values()
    return sum(n for n, _ in ops), sum(ms for _, ms in ops)


def measure(graphs: dict[str, Path], threads: int, vocab: int, seqlens, reps: int, decode_steps: int,
            session_sets: int = 4) -> dict:
    """Best and median ms of each graph's prefill (per L) and decode step, in interleaved rounds.

    The rounds run on ``session_sets`` sets of fresh sessions (each set made, timed for ``reps`` rounds, and
    dropped before the next), created and interleaved in the graphs' order, then in the reverse order, and so on;
    the statistics pool every set. Why: two sessions of one graph in one process differed by up to ~10% per
    decode token here, whichever graph it was and whichever was created first (their memory's placement; decode
    streams every weight per token), which made one set's decode comparison a draw of where each session's
    weights landed (benchmarks/RESULTS.md, issue 16's decode row)."""
    import numpy as np

    rng = np.random.default_rng(0)
    ids_of = {L: rng.integers(0, vocab, (1, L), dtype=np.int64) for L in seqlens}
    ids16 = rng.integers(0, vocab, (1, 16), dtype=np.int64)
    tok = np.array([[1]], np.int64)
    ts = {k: {c: [] for c in [f"prefill L={L} ms" for L in seqlens] + ["decode ms/token"]} for k in graphs}
    for s in range(session_sets):
        order = list(graphs) if s % 2 == 0 else list(graphs)[::-1]
        runners = {k: Runner(graphs[k], threads) for k in order}
        for L in seqlens:
            for r in runners.values():
                r.run(ids_of[L])  # warm-up
            for _ in range(reps):
                for k, r in runners.items():
                    t = time.perf_counter()
                    r.run(ids_of[L])
                    ts[k][f"prefill L={L} ms"].append(time.perf_counter() - t)
        states = {k: r.run(ids16)[1] for k, r in runners.items()}
        for _ in range(max(reps, decode_steps)):
            for k, r in runners.items():
                t = time.perf_counter()
                _, states[k] = r.run(tok, states[k])
                ts[k]["decode ms/token"].append(time.perf_counter() - t)
        del runners, states
        gc.collect()
    return {k: {c: (1e3 * min(v), 1e3 * statistics.median(v)) for c, v in row.items()} for k, row in ts.items()}


def accuracy(runners: dict, ck: Path, L: int = 512) -> dict:
    """(rel-L2 vs the float64 forward, rel-L2 vs transformers "fp64") of each runner's L-token prefill logits.

    The reference is a true float64 forward, :func:`m2export.models.reference.float64_model` (every op in
    float64, the scan the float64 recurrence; mamba_ssm semantics, which transformers 5.24 follows for Mamba-2).
    transformers' ``Mamba2ForCausalLM`` loaded in float64 is shown beside it for comparison only: it runs its
    norms, residual, ``A`` and scan inputs in float32, an error of its own of the size compared (that module's
    docstring)."""
    import numpy as np
    import torch
    import transformers

    from m2export.models.reference import float64_model

    vocab = json.loads((ck / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (1, L), generator=torch.Generator().manual_seed(L))
    with torch.no_grad():
        model = float64_model(ck)
        ref = model(ids).logits.numpy()
        del model  # one float64 model in memory at a time (130m: ~1 GiB each)
        gc.collect()
        hf = transformers.Mamba2ForCausalLM.from_pretrained(str(ck), dtype=torch.float64).eval()
        ref_hf = hf(ids).logits.numpy()[..., : ref.shape[-1]]
    del hf
    gc.collect()
    out = {}
    for k, r in runners.items():
        lg = r.run(ids.numpy())[0]["logits"].astype(np.float64)[..., : ref.shape[-1]]
        out[k] = (float(np.linalg.norm(lg - ref) / np.linalg.norm(ref)),
                  float(np.linalg.norm(lg - ref_hf) / np.linalg.norm(ref_hf)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", action="append", help="130m | bundled | HF folder (repeatable; default both)")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--session-sets", type=int, default=4,
                    help="fresh sets of sessions the rounds run on, created in alternating orders (measure())")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp/m2export-bench-ort")
    ap.add_argument("--mobius-venv", default="/tmp/m2export-mobius-venv")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    ap.add_argument("--all-flavours", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the std and ssmscan flavours (one more export, ssm_impl='both')")
    args = ap.parse_args(argv)
    if args.reps < 10:
        ap.error("--reps: at least 10")
    if args.session_sets < 1:
        ap.error("--session-sets: at least 1")
    import numpy as np
    import onnxruntime
    import torch

    torch.set_num_threads(args.threads)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    py_mobius = mobius_venv(Path(args.mobius_venv))
    mob_version = subprocess.run([str(py_mobius), "-c", "import importlib.metadata as m; print(m.version('mobius-onnx'))"],
                                 capture_output=True, text=True).stdout.strip() or "?"
    lines = []
    for name, ck in checkpoints(args.checkpoint or ["bundled", "130m"], work).items():
        out_ours, out_mob, out_both = work / f"m2export-{name}", work / f"mobius-{name}", work / f"m2export-both-{name}"
        for d in (out_ours, out_mob, out_both):
            shutil.rmtree(d, ignore_errors=True)

        def export(out: Path, impl: str) -> dict:
            return _child([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[4]); "
                           "from m2export.exporter import export_model; "
                           "export_model(sys.argv[1], sys.argv[2], ssm_impl=sys.argv[3])", str(ck), str(out), impl,
                           str(ROOT)])

        _log(f"[{name}] m2export export (native)")
        e_ours = export(out_ours, "native")
        _log(f"[{name}] mobius build")
        # --model (a local folder is accepted), not --config: mobius-onnx 0.1.0's --config path resolves the config
        # class without the model class (mobius/__main__.py _cmd_build -> _config_from_hf(hf_config)), and the
        # registry's "mamba2" entry has none, so it falls back to ArchitectureConfig and Mamba2Backbone fails with
        # "'ArchitectureConfig' object has no attribute 'num_heads'" for any Mamba-2 config (ours included)
        e_mob = _child([str(py_mobius), "-m", "mobius", "build", str(out_mob), "--model", str(ck), "--ep", "cpu",
                        "--optimize"])
        graphs = {"m2export native": (out_ours / "model.onnx", out_ours, e_ours)}
        if args.all_flavours:
            _log(f"[{name}] m2export export (ssmscan + std, the other two flavours)")
            e_both = export(out_both, "both")
            graphs["m2export std"] = (out_both / "model.std.onnx", out_both, e_both)
            graphs["m2export ssmscan"] = (out_both / "model.onnx", out_both, e_both)
        g_mob = next(iter(sorted(out_mob.rglob("model.onnx"))), None) or next(iter(sorted(out_mob.rglob("*.onnx"))))
        graphs["mobius"] = (g_mob, out_mob, e_mob)
        vocab = json.loads((ck / "config.json").read_text())["vocab_size"]
        _log(f"[{name}] timing (interleaved)")
        t = measure({k: g for k, (g, _, _) in graphs.items()}, args.threads, vocab, args.seqlens, args.reps,
                    args.decode_steps, args.session_sets)
        _log(f"[{name}] accuracy")
        runners = {k: Runner(g, args.threads) for k, (g, _, _) in graphs.items()}
        acc = accuracy(runners, ck, max(args.seqlens))
        del runners
        prof = work / "profiles"
        prof.mkdir(exist_ok=True)
        kern = {}
        for k, (g, _, _) in graphs.items():
            for what, L in (("prefill L=512", 512), ("decode", 1)):
                # the 16-token prefill that makes the decode step's states runs in an unprofiled session
                past = Runner(g, args.threads).run(np.ones((1, 16), "int64"))[1] if L == 1 else None
                r = Runner(g, args.threads, profile_dir=prof)
                r.run(np.ones((1, L), "int64"), past)
                kern[(k, what)] = _profile_counts(Path(r.sess.end_profiling()))
        rows = []
        for k, (_, out_dir, e) in graphs.items():
            rss = f"{e['peak_rss_bytes'] / 2**30:.2f} GiB"
            both = " (ssmscan + std export)" if out_dir == out_both else ""
            cells = [f"{e['wall_s']:.1f} s / {rss}{both}", f"{du(out_dir) / 1e6:.0f} MB{both}"]
            cells += [f"{t[k][c][0]:.1f} / {t[k][c][1]:.1f}" for c in [f"prefill L={L} ms" for L in args.seqlens]
                      + ["decode ms/token"]]
            cells += [f"{kern[(k, 'prefill L=512')][0]} / {kern[(k, 'decode')][0]}", f"{acc[k][0]:.2e}",
                      f"{acc[k][1]:.2e}"]
            rows.append(f"| {name} | {k} | " + " | ".join(cells) + " |")
        lines += rows
    now = utc_now()
    head = (f"## bench_ort.py — {now} — CPU {os.cpu_count()} cores ({platform.machine()}, shared), "
            f"onnxruntime {onnxruntime.__version__}, torch {torch.__version__}, mobius-onnx {mob_version}, "
            f"{args.threads} threads, "
            f"best / median of {args.reps} interleaved runs on each of {args.session_sets} fresh session sets "
            f"(alternating creation order), load {os.getloadavg()[0]:.1f} at the end\n\n"
            "| checkpoint | exporter | export wall / peak RSS | on disk | "
            + " | ".join(f"prefill L={L} ms" for L in args.seqlens)
            + " | decode ms/token | ORT kernels prefill L=512 / decode | logits rel-L2 vs float64 forward "
              "| vs transformers \"fp64\" (fp32 norms) |\n|" + "---|" * (8 + len(args.seqlens)) + "\n")
    table = head + "\n".join(lines) + "\n"
    publish(table, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
