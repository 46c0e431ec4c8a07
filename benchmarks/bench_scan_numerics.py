"""fp32 accuracy of the selective scan where the in-chunk sums of dt*A are large (issue 16, item 1).

Three measurements, each against a float64 run, printed as one markdown table and appended to
benchmarks/RESULTS.md:

* **synthetic SSMScan** (batch 2, L 512, 8 heads, 2 groups, headdim 32, d_state 32, chunk 256, initial
  state; ``tests.helpers.large_decay_inputs``): step sizes mostly small with sparse large spikes, so the
  running sum of dt*A inside a chunk reaches about -4,000 while most segments between nearby tokens stay small. rel-L2 of y and final_state vs
  :func:`~m2export.kernels.ssd.naive.ssm_scan_recurrent` (float64) for the chunked PyTorch reference and
  for ONNX Runtime on the SSMScan function body and on its inlined standard-op form.
* **130m-shaped HF checkpoint with transformers' default init** (``tests.helpers.hf_init_checkpoint``; dt
  reaches 6-10, in-chunk sums -1,300 to -4,900): logits rel-L2 at L=128 and 512 vs transformers'
  ``Mamba2ForCausalLM`` in float64, for transformers fp32, m2export's PyTorch model (fp32) and both ONNX
  Runtime flavours of its export.
* **split prefill** (300 + 212 tokens through the state I/O vs one 512-token prefill, same model): logits
  max-abs over max |logits| (last 212 positions) and the largest per-layer rel-L2 of conv_state and
  ssm_state, for the PyTorch model and both ORT flavours.

    python benchmarks/bench_scan_numerics.py [--workdir /tmp/m2export-numerics] [--label "after"]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _report import publish, utc_now  # noqa: E402 (benchmarks/_report.py, beside this script)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _rel(ref, out) -> float:
    import numpy as np

    r, o = np.asarray(ref, np.float64), np.asarray(out, np.float64)
    return float(np.linalg.norm(o - r) / np.linalg.norm(r))


def bench_synthetic(rows: list) -> None:
    import numpy as np
    import onnxruntime as ort
    import torch

    from m2export.contract import SSMScanAttrs, SSMScanProblem
    from m2export.exporter.ssm_scan_op import ssm_scan_node_model
    from m2export.kernels.ssd import naive
    from tests.helpers import large_decay_inputs

    inp = large_decay_inputs(SSMScanProblem(2, 512, 8, 32, 2, 32), seed=0)
    d = naive.dt_transform(inp["dt"], inp["dt_bias"])
    dA = d * inp["A"]
    sums = torch.stack([dA[:, i:i + 256].sum(1) for i in range(0, 512, 256)])
    _log(f"synthetic: per-chunk dt*A sums {sums.min().item():.0f} .. {sums.max().item():.0f}")
    ref = naive.ssm_scan_recurrent(**inp)
    out = naive.ssm_scan_chunked(**inp, chunk_size=256)
    rows.append(("synthetic SSMScan, dt*A sums ~-4000/chunk", "torch chunked reference (fp32)",
                 f"y {_rel(ref.y, out.y):.2e}, final_state {_rel(ref.final_state, out.final_state):.2e}"))
    feeds = {k: v.numpy().astype(np.float32) for k, v in inp.items()}
    for inline, what in ((False, "ORT, SSMScan function body"), (True, "ORT, standard-op graph")):
        model = ssm_scan_node_model([SSMScanAttrs.make(chunk_size=256)], inline=inline)
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        y, fs = sess.run(None, feeds)
        rows.append(("synthetic SSMScan, dt*A sums ~-4000/chunk", what,
                     f"y {_rel(ref.y, y):.2e}, final_state {_rel(ref.final_state, fs):.2e}"))


def _split_errors(full: dict, second: dict, n_second: int) -> str:
    """logits max-abs/max|logits| on the overlap and the worst per-layer state rel-L2 (name -> array dicts)."""
    import numpy as np

    lf, ls = np.asarray(full["logits"], np.float64)[:, -n_second:], np.asarray(second["logits"], np.float64)
    lo = float(np.abs(lf - ls).max() / np.abs(lf).max())
    worst = {}
    for k in full:
        if k == "logits":
            continue
        kind = "conv" if "conv" in k else "ssm"
        worst[kind] = max(worst.get(kind, 0.0), _rel(full[k], second[k]))
    return f"logits {lo:.2e}, conv_state {worst['conv']:.2e}, ssm_state {worst['ssm']:.2e}"


def bench_hf(rows: list, work: Path, seqlens=(128, 512), split=300) -> None:
    import torch
    import transformers

    from m2export.exporter import export_model
    from m2export.exporter.runtime import OrtModel
    from m2export.models.checkpoint import load_checkpoint
    from tests.helpers import hf_init_checkpoint, run_named, scan_stats

    t = time.perf_counter()
    ck = hf_init_checkpoint(work / "hf-mamba2-130m", "mamba2-130m")
    _log(f"checkpoint {time.perf_counter() - t:.0f} s")
    L = max(seqlens)
    ids = torch.randint(0, 50280, (1, L), generator=torch.Generator().manual_seed(L))
    hf64 = transformers.Mamba2ForCausalLM.from_pretrained(str(ck), dtype=torch.float64).eval()
    with torch.no_grad():
        ref = {n: hf64(ids[:, :n]).logits.numpy() for n in seqlens}
    del hf64
    hf32 = transformers.Mamba2ForCausalLM.from_pretrained(str(ck)).eval()
    with torch.no_grad():
        for n in seqlens:
            rows.append((f"130m HF init, logits vs transformers fp64, L={n}", "transformers fp32",
                         f"{_rel(ref[n], hf32(ids[:, :n]).logits.numpy()):.2e}"))
    del hf32
    model = load_checkpoint(ck).model.eval()
    dtmax, cmin, cmax = scan_stats(model, ids)
    _log(f"130m: dt max {dtmax:.1f}; per-layer min in-chunk sum of dt*A {cmax:.0f} .. {cmin:.0f}")
    rows.append(("130m HF init, statistics", "max dt; per-layer min in-chunk sum of dt*A",
                 f"{dtmax:.1f}; {cmax:.0f} .. {cmin:.0f}"))

    for n in seqlens:
        rows.append((f"130m HF init, logits vs transformers fp64, L={n}", "m2export PyTorch fp32",
                     f"{_rel(ref[n], run_named(model, ids[:, :n])[0]['logits']):.2e}"))
    full, _ = run_named(model, ids)
    _, past = run_named(model, ids[:, :split])
    second, _ = run_named(model, ids[:, split:], past)
    rows.append((f"split prefill {split}+{L - split} vs {L}", "m2export PyTorch fp32",
                 _split_errors(full, second, L - split)))
    del model

    out = work / "export-130m"
    t = time.perf_counter()
    export_model(ck, out, ssm_impl="both", force=True)
    _log(f"export {time.perf_counter() - t:.0f} s")
    for impl in ("plugin", "onnx"):
        m = OrtModel(out, impl, threads=2)
        for n in seqlens:
            rows.append((f"130m HF init, logits vs transformers fp64, L={n}", f"ORT, {impl} flavour",
                         f"{_rel(ref[n], m.run(ids[:, :n].numpy())['logits']):.2e}"))
        full = m.run(ids.numpy())
        first = m.run(ids[:, :split].numpy())
        second = m.run(ids[:, split:].numpy(), {k.replace("present_", "past_"): v for k, v in first.items()
                                                if k.startswith("present_")})
        rows.append((f"split prefill {split}+{L - split} vs {L}", f"ORT, {impl} flavour",
                     _split_errors(full, second, L - split)))
        del m


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/m2export-numerics")
    ap.add_argument("--label", default="", help="a word for the RESULTS.md heading (e.g. 'before', 'after')")
    ap.add_argument("--no-hf", action="store_true", help="synthetic SSMScan only")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    args = ap.parse_args(argv)
    import onnxruntime
    import torch
    import transformers

    torch.set_num_threads(2)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    rows: list = []
    bench_synthetic(rows)
    if not args.no_hf:
        bench_hf(rows, work)
    now = utc_now()
    head = (f"## bench_scan_numerics.py{' (' + args.label + ')' if args.label else ''} — {now} — CPU "
            f"({platform.machine()}), torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, "
            f"transformers {transformers.__version__}; fp32, batch 1 (synthetic: batch 2)\n\n"
            "| case | run | rel-L2 vs float64 (split: vs the unsplit run) |\n|---|---|---|\n")
    table = head + "".join(f"| {a} | {b} | {c} |\n" for a, b, c in rows)
    publish(table, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
