"""Packed prefill (``model.packed.onnx``) vs the alternatives a server has, in ONNX Runtime (CPU), one run.

For each pack of sequence lengths, the same tokens prefilled four ways, in interleaved rounds (best and median of
``--reps``):

* ``packed``: one call of model.packed.onnx (cu_seqlens, states per sequence);
* ``one sequence``: one call of model.onnx on all the tokens as a single sequence (the issue's reference: a
  packed batch should cost at most 1.1x this);
* ``per sequence``: one model.onnx call per sequence (batch 1 each);
* ``padded batch``: one model.onnx call with the sequences right-padded to the longest (batch = number of
  sequences; the padding's compute is wasted, and a real server would also have to undo its effect on the states).

Checkpoints: ``bundled`` (samples/checkpoints/stdlib-byte-mamba2) or ``130m`` (a mamba2-130m-shaped HF checkpoint,
tests.helpers.hf_init_checkpoint). ORT on 1 intra-op thread (the machine is shared: compare best-of-N); beside the
wall-clock times, the calling thread's CPU time (``time.thread_time``: ORT with one intra-op thread runs its kernels
on the caller's thread), which other processes on the shared cores disturb far less.
Results: a markdown table on stdout, appended to benchmarks/RESULTS.md.

    python benchmarks/bench_packed_ort.py --checkpoint bundled --reps 10
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _report import publish, utc_now  # noqa: E402

PACKS = {"4x128": [128] * 4, "64..448": [64, 192, 320, 448], "16x32": [32] * 16, "1x1000+3x8": [1000, 8, 8, 8]}


def _checkpoint(name: str, tmp: Path) -> Path:
    if name == "bundled":
        return ROOT / "samples" / "checkpoints" / "stdlib-byte-mamba2"
    if name == "130m":
        from tests.helpers import hf_init_checkpoint

        return hf_init_checkpoint(tmp / "ck130m", "mamba2-130m")
    return Path(name)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="bundled")
    ap.add_argument("--packs", default=",".join(PACKS), help=f"comma list of {list(PACKS)}")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    args = ap.parse_args(argv)

    import numpy as np
    import onnxruntime as ort

    from m2export.exporter import export_model
    from m2export.exporter.manifest import read_manifest
    from m2export.exporter.packed import NSEQ, PACKED_FILE, PACKED_ROLE, packed_feed

    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        ck = _checkpoint(args.checkpoint, tmp)
        out = tmp / "out"
        t0 = time.perf_counter()
        export_model(ck, out, packed_prefill=True)
        print(f"export with the packed graph: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = 1, 1
        so.log_severity_level = 3
        packed = ort.InferenceSession(str(out / PACKED_FILE), so, providers=["CPUExecutionProvider"])
        plain = ort.InferenceSession(str(out / "model.onnx"), so, providers=["CPUExecutionProvider"])
        vocab = plain.get_outputs()[0].shape[2]
        pio = read_manifest(out).graph(PACKED_ROLE).io()
        rng = np.random.default_rng(0)
        rows = []
        for pname in args.packs.split(","):
            lengths = PACKS[pname]
            n, total = len(lengths), sum(lengths)
            seqs = [rng.integers(0, vocab, L).astype(np.int64) for L in lengths]

            def states(sess, batch):
                return {i.name: np.zeros([batch if d in (NSEQ, "batch_size") else d for d in i.shape], np.float32)
                        for i in sess.get_inputs() if i.name not in ("input_ids", "cu_seqlens")}

            one_state = states(plain, 1)
            pfeed = packed_feed(seqs, [one_state] * n, pio)  # checked: cu_seqlens from 0 to total, one state per seq
            one = {"input_ids": np.concatenate(seqs)[None], **states(plain, 1)}
            singles = [{"input_ids": s[None], **states(plain, 1)} for s in seqs]
            pad = np.zeros((n, max(lengths)), np.int64)
            for j, s in enumerate(seqs):
                pad[j, :len(s)] = s
            padded = {"input_ids": pad, **states(plain, n)}
            ways = {"packed": lambda: packed.run(None, pfeed), "one sequence": lambda: plain.run(None, one),
                    "per sequence": lambda: [plain.run(None, f) for f in singles],
                    "padded batch": lambda: plain.run(None, padded)}
            times = {k: [] for k in ways}
            cpu = {k: [] for k in ways}  # this thread's CPU time: ORT on 1 intra-op thread runs on the caller's
            for fn in ways.values():
                fn()  # warm-up
            for _ in range(args.reps):
                for k, fn in ways.items():
                    t, c = time.perf_counter(), time.thread_time()
                    fn()
                    cpu[k].append((time.thread_time() - c) * 1e3)
                    times[k].append((time.perf_counter() - t) * 1e3)
            best = {k: min(v) for k, v in times.items()}
            best_cpu = {k: min(v) for k, v in cpu.items()}
            for k, v in times.items():
                rows.append(f"| {args.checkpoint} | {pname} ({n} seqs, {total} tokens) | {k} | {min(v):.1f} | "
                            f"{statistics.median(v):.1f} | {min(v) / best['one sequence']:.2f} | {best_cpu[k]:.1f} | "
                            f"{best_cpu[k] / best_cpu['one sequence']:.2f} |")
            print(f"  {pname}: " + ", ".join(f"{k} {b:.1f} ms (cpu {best_cpu[k]:.1f})" for k, b in best.items()),
                  file=sys.stderr, flush=True)
    head = (f"### Packed prefill in ONNX Runtime (bench_packed_ort.py), {utc_now()}, {platform.processor() or 'CPU'}, "
            f"{os.cpu_count()} cores (shared), onnxruntime {ort.__version__}, 1 thread, fp32, best / median of "
            f"{args.reps} interleaved rounds, load {os.getloadavg()[0]:.1f} at the end\n\n"
            "| checkpoint | pack | way | best ms | median ms | best / one sequence | best CPU ms | CPU / one sequence |\n"
            "|---|---|---|---|---|---|---|---|\n")
    publish(head + "\n".join(rows) + "\n", args.results)


if __name__ == "__main__":
    main()
