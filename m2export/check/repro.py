"""What ``m2export check`` leaves next to the reports so its comparison runs anywhere, m2export-free.

The export folder travels: copied to a TensorRT machine, the commands printed by ``m2export check`` run
there from inside the folder with Polygraphy and TensorRT only (no m2export, torch or checkpoint):

* ``check_inputs.json``: a prefix of the prefill feeds the check compared (fresh and continued sizes, up
  to :data:`SAVED_BYTES` with the outputs), in Polygraphy's JSON format (``--load-inputs``);
* ``check_reference_outputs.json``: the PyTorch reference's outputs for those feeds, as Polygraphy
  ``RunResults`` of runner ``torch`` (``--load-outputs``): a runtime is compared with the reference itself;
* ``check_data_loader.py``: the same feeds for ``--data-loader-script``, read from the JSON next to the
  script (paths relative to the script's own file; imports Polygraphy only).

Commands (:func:`reproduction_commands`) name files relative to the folder they are run in (``cd`` first):
``polygraphy run`` with ONNX Runtime for every ONNX graph (they run here, and tests run them in a copied
folder), and for TensorRT: ``trtexec --onnx ... --minShapes/--optShapes/--maxShapes`` and ``polygraphy run
--trt`` with the same profile for the std flavour (standard ops, no plugin), ``trtexec --loadEngine`` /
``polygraphy run --model-type engine`` for engines built with the AOT plugin (the kernel is inside the
engine: no plugin library). Graphs with SSMScan nodes need the m2export::SSMScan plugin to *build*: a
Python plugin, registered by ``m2export build`` (there is no plugin library for trtexec), and engines
built with the JIT plugin need m2export at run time (``m2export check --runtime trt``).
"""

from __future__ import annotations

import os
import shlex
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from m2export._paths import atomic_file, atomic_write_text
from m2export.exporter.manifest import CHECK_REPORT_FILES

DATA_LOADER_SCRIPT, INPUTS_FILE, REFERENCE_FILE = CHECK_REPORT_FILES[3:]
#: bytes of feeds + reference outputs kept for the commands (at least the first feed is always kept)
SAVED_BYTES = 64 << 20


class RecordingLoader:
    """Iterate ``loader`` (a Polygraphy data loader) unchanged, keeping copies of its first feeds while
    they and the reference outputs (``record_outputs``) fit in ``budget`` bytes."""

    def __init__(self, loader, budget: int = SAVED_BYTES):
        self.loader, self.budget = loader, budget
        self.feeds: list[OrderedDict[str, np.ndarray]] = []
        self.outputs: list[OrderedDict[str, np.ndarray]] = []
        self._used, self._open = 0, True

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name):  # labels, past_len, shapes ... of the wrapped loader
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[OrderedDict[str, np.ndarray]]:
        for feed in self.loader:
            if self._open:
                size = sum(np.asarray(v).nbytes for v in feed.values())
                if self.feeds and self._used + 2 * size > self.budget:
                    self._open = False
                else:
                    self.feeds.append(OrderedDict((k, np.array(v, copy=True)) for k, v in feed.items()))
                    self._used += size
            yield feed

    def record_outputs(self, index: int, outputs) -> None:
        """The reference's outputs of feed ``index`` (kept when that feed was, and they fit)."""
        if index == len(self.outputs) and index < len(self.feeds):
            size = sum(np.asarray(v).nbytes for v in outputs.values())
            if len(self.outputs) and self._used + size > self.budget:
                del self.feeds[index:]
                return
            self.outputs.append(OrderedDict((k, np.array(v, copy=True)) for k, v in outputs.items()))
            self._used += size

    def saved(self) -> int:
        """Number of (feed, reference outputs) pairs saved."""
        return min(len(self.feeds), len(self.outputs))


DATA_LOADER_TEMPLATE = '''"""Polygraphy data loader written by `m2export check`: {n} of the prefill feeds it compared.

Reads {inputs} next to this file (so it works from any directory, after the folder is copied);
needs Polygraphy only. The same feeds as `--load-inputs {inputs}`.

Use with: polygraphy run ... --data-loader-script {script}:load_data
"""

from pathlib import Path

from polygraphy.json import load_json

INPUTS = Path(__file__).resolve().parent / {inputs!r}


def load_data():
    yield from load_json(INPUTS)
'''


def write_saved(report_dir: Path, rec: RecordingLoader, reference_name: str) -> int:
    """Write :data:`INPUTS_FILE`, :data:`REFERENCE_FILE` and :data:`DATA_LOADER_SCRIPT` into
    ``report_dir``; returns the number of feeds saved (0: nothing written)."""
    from polygraphy.comparator import RunResults
    from polygraphy.comparator.struct import IterationResult
    from polygraphy.json import save_json

    n = rec.saved()
    if n == 0:
        return 0
    with atomic_file(report_dir / INPUTS_FILE) as tmp:  # a full disk leaves the previous file, never half a one
        save_json(rec.feeds[:n], str(tmp))
    results = RunResults()
    results.append((reference_name, [IterationResult(o, runner_name=reference_name) for o in rec.outputs[:n]]))
    with atomic_file(report_dir / REFERENCE_FILE) as tmp:
        results.save(str(tmp))
    atomic_write_text(report_dir / DATA_LOADER_SCRIPT, DATA_LOADER_TEMPLATE.format(
        n=n, inputs=INPUTS_FILE, script=DATA_LOADER_SCRIPT))
    return n


def _tol_args(flag: str, tol: dict[str, float]) -> list[str]:
    return [flag, *[f"{k}:{v:g}" for k, v in tol.items() if k], f"{tol['']:g}"]


def _rel(path: Path, start: Path) -> str:
    return os.path.relpath(path, start)


def trt_profile(manifest, graph, batch=None, seq=None) -> dict[str, dict[str, list[int]]]:
    """The optimization profile ``m2export build`` gives ``graph`` (its defaults unless ``batch``/``seq``),
    from the input shapes m2export.json records (the graph itself is not read)."""
    from m2export.trt.build import DEFAULT_BATCH, DEFAULT_SEQ, graph_profile

    inputs = {name: spec["shape"] for name, spec in graph.inputs.items()}
    return graph_profile(inputs, "prefill", batch or DEFAULT_BATCH, seq or DEFAULT_SEQ)


def trtexec_shapes(profile: dict[str, dict[str, list[int]]], which: str) -> str:
    """``input_ids:1x128,past_conv_state.0:1x256x3,...`` (trtexec's --minShapes/--optShapes/--maxShapes)."""
    return ",".join(f"{name}:{'x'.join(str(d) for d in s[which])}" for name, s in profile.items())


def polygraphy_shapes(profile: dict[str, dict[str, list[int]]], which: str) -> list[str]:
    """``input_ids:[1,128] ...`` (Polygraphy's --trt-min-shapes/--trt-opt-shapes/--trt-max-shapes)."""
    return [f"{name}:[{','.join(str(d) for d in s[which])}]" for name, s in profile.items()]


def reproduction_commands(outdir: Path, manifest, report_dir: Path, atol: dict[str, float],
                          rtol: dict[str, float], *, data_loader: bool = False) -> dict[str, list[str]]:
    """Shell commands, run from ``report_dir`` (paths relative to it), on the saved inputs and reference outputs.

    Returns ``{"onnxrt": [...], "tensorrt": [...]}``: ``polygraphy run --onnxrt`` of every prefill ONNX graph
    whose states are in the model's layout (the saved feeds' and outputs': not the native flavour, whose
    ssm states are (batch, nheads, d_state, headdim)) vs the saved reference; for TensorRT, per prefill graph without SSMScan nodes (std flavour)
    ``trtexec --onnx`` with the build profile and ``polygraphy run --trt`` with it, and per AOT engine
    recorded in m2export.json ``polygraphy run --model-type engine --trt`` and ``trtexec --loadEngine``.
    """
    q = shlex.join
    feed = (["--data-loader-script", f"{DATA_LOADER_SCRIPT}:load_data"] if data_loader
            else ["--load-inputs", INPUTS_FILE])
    cmp = [*feed, "--load-outputs", REFERENCE_FILE, *_tol_args("--atol", atol), *_tol_args("--rtol", rtol),
           "--check-error-stat", "elemwise"]
    onnxrt, trt = [], []
    for g in manifest.graphs:
        if not g.serves("prefill") or any(s.perm is not None for s in g.io().states):
            continue  # a graph with states in another layout than the saved feeds' (the native flavour's) is left out
        onnx_rel = _rel(outdir / g.file, report_dir)
        onnxrt.append(q(["polygraphy", "run", onnx_rel, "--onnxrt", *cmp]))
        if g.ssm_impl == "std":  # no SSMScan node: builds with TensorRT alone
            prof = trt_profile(manifest, g)
            plan = _rel(outdir / (Path(g.file).stem + ".plan"), report_dir)
            trt.append(q(["trtexec", f"--onnx={onnx_rel}", f"--minShapes={trtexec_shapes(prof, 'min')}",
                          f"--optShapes={trtexec_shapes(prof, 'opt')}", f"--maxShapes={trtexec_shapes(prof, 'max')}",
                          f"--saveEngine={plan}"]))
            trt.append(q(["polygraphy", "run", onnx_rel, "--trt",
                          "--trt-min-shapes", *polygraphy_shapes(prof, "min"),
                          "--trt-opt-shapes", *polygraphy_shapes(prof, "opt"),
                          "--trt-max-shapes", *polygraphy_shapes(prof, "max"), *cmp]))
    for e in manifest.engines:
        if not e.serves("prefill") or e.plugin_mode == "jit":
            continue
        plan_rel = _rel(outdir / e.file, report_dir)
        trt.append(q(["polygraphy", "run", plan_rel, "--model-type", "engine", "--trt", *cmp]))
        prof = e.profile("prefill") or None
        g = next((g for g in manifest.graphs if g.file == e.onnx_file), None)
        if not isinstance(prof, dict) and g is not None:
            prof = trt_profile(manifest, g)
        if isinstance(prof, dict):
            sel = [f"--profile={e.profile_index('prefill')}"] if len(e.profile_roles) > 1 else []
            trt.append(q(["trtexec", f"--loadEngine={plan_rel}", *sel, f"--shapes={trtexec_shapes(prof, 'opt')}"]))
    return {"onnxrt": onnxrt, "tensorrt": trt}


def left_out_note(manifest) -> str | None:
    """Why prefill graphs have no ``polygraphy run`` command (:func:`reproduction_commands` leaves out graphs whose
    states are in another layout than the saved feeds': the native flavour's); None when none is left out."""
    left = [g.file for g in manifest.graphs
            if g.serves("prefill") and any(s.perm is not None for s in g.io().states)]
    if not left:
        return None
    return (f"no polygraphy command for {', '.join(left)}: its states are in ONNX Runtime's own layouts, not the "
            "saved feeds' (the model's); 'm2export check' compares it with the reference itself")


def ssmscan_build_note(manifest) -> str | None:
    """What to do for graphs with SSMScan nodes, and JIT engines, on a TensorRT machine (None: nothing)."""
    notes = []
    if any(g.ssm_impl == "ssmscan" for g in manifest.graphs):
        notes.append("graphs with SSMScan nodes build with the m2export::SSMScan plugin (a Python plugin: no "
                     "library for trtexec): 'm2export build OUTDIR --plugin aot' there, after which the AOT "
                     "engine runs in trtexec and polygraphy without m2export")
    if any(e.plugin_mode == "jit" for e in manifest.engines):
        notes.append("engines built with the JIT plugin call back into Python: check them with "
                     "'m2export check OUTDIR --runtime trt'")
    return "; ".join(notes) or None


def describe(rec: RecordingLoader) -> dict[str, Any]:
    """What was saved, for the report."""
    labels = list(getattr(rec.loader, "labels", []))
    return {"feeds": rec.saved(), "labels": labels[:rec.saved()], "inputs": INPUTS_FILE,
            "reference_outputs": REFERENCE_FILE, "data_loader": DATA_LOADER_SCRIPT}
