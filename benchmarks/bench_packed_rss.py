"""Peak RSS of one ONNX Runtime run of ``OUTDIR/model.packed.onnx`` on the pack ``m2export check`` feeds.

One process, one session built as the check builds its sessions (CPU, no arena, MatMul prepacking off, no
constant folding), one call on the check's pack lengths for the model's chunk size (``pack_lengths``: 255, 1,
256, 0, 257, 5 on a 130m, 774 tokens) with random tokens and random past states. Prints the RSS before the call
(weights not yet paged in), the process's peak (``getrusage``) and the RSS after it. ``--save FILE`` writes the
outputs (``.npz``) so two exports can be compared element for element (``--compare OTHER.npz``).
Run it once per process (the peak is the process's).

    python benchmarks/bench_packed_rss.py /tmp/out130 --save /tmp/after.npz --compare /tmp/before.npz
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("outdir", type=Path)
    p.add_argument("--save", type=Path, help="write the outputs to this .npz")
    p.add_argument("--compare", type=Path, help="compare the outputs with this .npz (bit for bit, then max abs)")
    args = p.parse_args()
    import onnxruntime as ort

    from m2export.check.packed import pack_lengths
    from m2export.exporter.manifest import read_manifest

    lengths = pack_lengths(read_manifest(args.outdir).model_config())
    so = ort.SessionOptions()
    so.enable_cpu_mem_arena = False
    so.add_session_config_entry("session.disable_prepacking", "1")
    sess = ort.InferenceSession(str(args.outdir / "model.packed.onnx"), so, providers=["CPUExecutionProvider"],
                                disabled_optimizers=["ConstantFolding"])
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, 256, (1, sum(lengths))).astype(np.int64),
             "cu_seqlens": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)}
    for i in sess.get_inputs()[2:]:
        feeds[i.name] = (0.1 * rng.standard_normal([len(lengths), *i.shape[1:]])).astype(np.float32)
    before = rss()
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"pack {lengths} ({sum(lengths)} tokens): rss before the call {before / 1e9:.2f} GB, peak {peak / 1e9:.2f} GB"
          f" (+{(peak - before) / 1e9:.2f}), after {rss() / 1e9:.2f} GB")
    if args.save:
        np.savez(args.save, **outs)
    if args.compare:
        old = np.load(args.compare)
        same = [k for k in outs if np.array_equal(outs[k], old[k], equal_nan=True)]
        print(f"{len(same)} of {len(outs)} outputs bit-equal to {args.compare}"
              + "".join(f"; {k} max abs {np.abs(outs[k] - old[k]).max():.3g}" for k in outs if k not in same))
    return 0


if __name__ == "__main__":
    sys.exit(main())
