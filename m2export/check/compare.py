"""``m2export check``: compare an export against the PyTorch reference with Polygraphy.

Three sections, all compared with one ``SimpleCompareFunc`` (what ``CompareFunc.simple`` builds; Polygraphy
0.53 deprecates the factory in favour of the class), computed in slices, logits and states alike
(:class:`~m2export.check.metrics.SlicedCompareFunc`: the same max statistics and verdicts without
whole-array temporaries or medians): per-output atol/rtol with ``""`` as the default key,
``check_error_stat="elemwise"``: an element fails when its abs error > atol *and* its rel error > rtol.

* ``prefill``: :class:`~m2export.check.data.TokenDataLoader` feeds (real byte tokens, several batch/seqlen
  sizes) through the prefill graph of every runtime (:func:`_prefill`: the reference first, then each
  runtime compared with it as it returns and dropped); each size twice: a
  fresh sequence (zero past states) and a continued one, whose past states are the reference's own
  states after the preceding ``past_len`` tokens of the text (so ignored ``past_*`` inputs fail).
* ``packed`` (exports with ``model.packed.onnx``): one call of the packed prefill graph on several sequences of
  different lengths, each with its own past states, against the reference run on each sequence alone
  (:mod:`m2export.check.packed`; ONNX Runtime only).
* ``sequence``: prefill a prompt, then ``decode_steps`` decode-graph steps, each runtime feeding its own
  ``present_*`` states back as ``past_*``; the reference's greedy token is fed to all runtimes so every
  step compares like with like, and each runtime's own greedy choice must agree with the reference's
  wherever the reference's top-2 logit margin exceeds twice the logits atol (closer is a numerical tie).
  Compared with ``Comparator.compare_accuracy``, one runtime at a time.

Every comparison is (runtime, reference): Polygraphy's relative error divides by the second output.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import gc
import importlib.util
import json
import logging
import math
import os
import shlex
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from m2export import backends, names
from m2export.check.console import ProgressTask
from m2export.check.data import (FeedInfo, TokenDataLoader, byte_tokens, check_shapes, chunk_size_of,
                                 default_shapes, read_corpus, token_windows)
from m2export.check.report import command_block, greedy_line, reproduce_intro, runner_label, verdict
from m2export.check.repro import DATA_LOADER_SCRIPT, INPUTS_FILE, REFERENCE_FILE
from m2export.check.repro import (RecordingLoader, left_out_note, reproduction_commands, ssmscan_build_note,
                                   write_saved)
from m2export.check.repro import describe as describe_saved
from m2export.check.runners import (REFERENCES, ModelFromCheckpoint, ModelFromTransformers, ModelLayoutStates,
                                    OnnxReferenceRunner, SharedInitializers, TorchRunner, TransformersRunner,
                                    onnxrt_runner, reference_runner, trt_runners)
from m2export.check.tolerances import default_tolerances
from m2export.check.weights import ExportWeights
from m2export._paths import atomic_file, atomic_write_text
from m2export.errors import (BackendUnavailable, CheckpointError, ExportFolderError, M2ExportError, OutputFolderError,
                             ParameterError, UsageError)
from m2export.exporter.configs import MANIFEST_FILE, GraphIO
from m2export.exporter.packed import PACKED_ROLE
from m2export.exporter.manifest import (CHECK_REPORT_FILES, REEXPORT_HINT, Manifest, read_manifest, record_files,
                                        refuse_unowned)
from m2export.exporter.runtime import Decoder, feed_dtype_of

log = logging.getLogger(__name__)

REPORT_JSON, REPORT_MD, REPORT_PNG = CHECK_REPORT_FILES[:3]
REFERENCE = names.REFERENCE_RUNTIME
RUNTIMES = ("onnxrt", "trt")  # the defaults; "onnx-reference" on request, and instead of onnxrt for bf16
ALL_RUNTIMES = tuple(r for r in names.RUNTIMES if r != REFERENCE)  # what check can compare with the reference


# ----------------------------------------------------------------------------------------------- tolerances
def tolerance_items(values: list[str] | None, param: str) -> list[tuple[str | None, float]]:
    """``--atol``/``--rtol`` values as (NAME or None for the default, VALUE) pairs, each VALUE a finite number >= 0.

    An infinite tolerance would pass every element (NaN excepted) and a NaN or negative one none: neither is a
    tolerance. Checked before any file is read.

    Raises:
        UsageError: a malformed value, or one that is inf, nan or negative, or more than one VALUE without a NAME
            (two defaults: which one holds is not ours to pick) (exit 2, like every malformed flag value:
            m2export.errors.ExitCode.USAGE); the message names ``param`` ("atol" / "rtol") and the value(s).
    """
    out = []
    for v in values or []:
        name, sep, num = v.rpartition(":")
        try:
            x = float(num)
        except ValueError:
            raise UsageError(f"`{param}` {v!r}: expected VALUE or NAME:VALUE with VALUE a finite number >= 0") from None
        if not (math.isfinite(x) and x >= 0):
            what = "nan" if math.isnan(x) else "infinite" if math.isinf(x) else "negative"
            raise UsageError(f"`{param}` {v!r}: {num.strip()} is {what}; expected a finite number >= 0")
        out.append((name if sep else None, x))
    defaults = [v for v, (name, _) in zip(values or [], out) if name is None]
    if len(defaults) > 1:  # "later wins" would drop one silently: which one the user meant is not ours to pick
        raise UsageError(f"`{param}` {', '.join(map(repr, defaults))}: more than one default value",
                         hint="give one VALUE (the default) and NAME:VALUE for each output that differs")
    return out


def parse_tolerances(values: list[str] | None, base: dict[str, float], output_names: list[str],
                     param: str) -> dict[str, float]:
    """Apply ``--atol``/``--rtol`` values to ``base``: ``VALUE`` sets the default, ``NAME:VALUE`` one output.

    NAME may be a glob (``present_ssm_state.*``); it is expanded to the exact output names Polygraphy
    needs. Each output takes at most one NAME:VALUE and there is at most one default (:func:`tolerance_items`):
    "the later one wins" would drop the other silently, and which one the user meant is not ours to pick.

    Raises:
        UsageError: a malformed, infinite, NaN or negative value, or two defaults (:func:`tolerance_items`);
            ParameterError: a NAME that matches no output (with the names available), or an output that two
            NAME:VALUE values match (the same name twice, or a glob and a name: both values named); the message
            names ``param`` ("atol" / "rtol").
    """
    out = dict(base)
    given: dict[str, str] = {}  # output -> the NAME:VALUE value that set it
    for (name, x), v in zip(tolerance_items(values, param), values or []):
        if name is None:
            out[""] = x
            continue
        matched = [n for n in output_names if fnmatch.fnmatchcase(n, name)]
        if not matched:
            raise ParameterError(f"`{param}` {v!r}: no output named {name!r}",
                                hint=f"the outputs are {_abbrev_names(output_names)}; globs like "
                                     "'present_ssm_state.*' work")
        twice = [n for n in matched if n in given]
        if twice:
            raise ParameterError(f"`{param}` {given[twice[0]]!r} and {v!r}: two tolerances for output {twice[0]!r}"
                                 + (f" (and {len(twice) - 1} more)" if len(twice) > 1 else ""),
                                 hint="give each output one NAME:VALUE (narrow the glob, or drop one of them)")
        for n in matched:
            out[n] = x
            given[n] = v
    return out


def _abbrev_names(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def make_compare_func(atol: dict[str, float], rtol: dict[str, float]):
    """Polygraphy ``SimpleCompareFunc`` (= ``CompareFunc.simple``) with exact output-name matching, elementwise,
    computed in slices (:class:`~m2export.check.metrics.SlicedCompareFunc`)."""
    from m2export.check.metrics import SlicedCompareFunc

    def exact(output_name, index, iter_result, base_iter_result=None):
        return [output_name] if output_name in iter_result else None

    return SlicedCompareFunc(atol=atol, rtol=rtol, check_error_stat="elemwise", find_output_func=exact)


# ----------------------------------------------------------------------------------------------- report
@dataclass
class OutputRow:
    """Comparison of one output between a runtime and the reference over a section's iterations."""

    section: str  # "prefill" | "packed" | "sequence"
    runner: str
    reference: str
    output: str
    iterations: int
    max_abs: float
    mean_abs: float
    max_rel: float
    mean_rel: float
    atol: float
    rtol: float
    passed: bool
    failed_iterations: list[str] = field(default_factory=list)  # e.g. "2x65" or "step 3"
    note: str = ""
    #: NaN/inf element counts over the iterations (metrics.NonFinite.to_dict) when either output had any: the
    #: row then fails and its statistics are NaN (not numbers of the finite part)
    nonfinite: dict[str, int] = field(default_factory=dict)


@dataclass
class CheckReport:
    """Everything ``m2export check`` measured. Truthy when every comparison passed."""

    outdir: str
    dtype: str
    reference: str
    runners: list[dict[str, str]]
    skipped: list[str]
    shapes: list[list[int]]
    decode_steps: int
    prompt_len: int
    atol: dict[str, float]
    rtol: dict[str, float]
    rows: list[OutputRow]
    greedy: dict[str, dict[str, Any]]
    polygraphy_commands: list[str] = field(default_factory=list)  # polygraphy run --onnxrt, from commands_dir
    tensorrt_commands: list[str] = field(default_factory=list)  # trtexec / polygraphy run --trt, from commands_dir
    tensorrt_note: str = ""
    reproduce_note: str = ""  # graphs without a polygraphy command, and why (m2export.check.repro.left_out_note)
    commands_dir: str = ""
    saved: dict[str, Any] = field(default_factory=dict)  # what check_inputs.json etc. hold (m2export.check.repro)
    histogram: str | None = None
    histogram_note: str = ""
    corpus: str = "Python stdlib sources"
    versions: dict[str, str] = field(default_factory=dict)
    past_len: int = 0  # prefill sizes are also fed continuing this many reference tokens (0: fresh only)
    vocab_coverage: str = ""  # which token ids the prefill feeds hold (TokenDataLoader.coverage)
    vocab_sweep_inputs: int = 0  # prefill feeds of the vocabulary sweep (TokenDataLoader.sweep; 0: skipped)
    packed: str = ""  # the packed section's pack (m2export.check.packed), "" when it did not run
    #: where the reference's tensors were (ExportWeights.summary: views of the export's mapped weights, each
    #: bit-equal to the checkpoint's, or the checkpoint's own copy)
    reference_weights: dict[str, Any] = field(default_factory=dict)
    #: failed prefill feeds of a model with MoE layers, each diagnosed for routing flips at near ties
    #: (m2export.check.routing.Diagnosis as a dict: runner, feed, explained, flips, max_abs, reason)
    routing: list[dict[str, Any]] = field(default_factory=list)

    def weights_note(self) -> str:
        """The reference's weights in words: how many are views of the export's weights (bit-equal to the
        checkpoint's) and which are the checkpoint's own copies."""
        w = self.reference_weights
        if not w:
            return ""
        from m2export.check.console import human_bytes

        n = w["shared_tensors"] + w["own_tensors"]
        text = (f"{w['shared_tensors']} of {n} tensors ({human_bytes(w['shared_bytes'])} of "
                f"{human_bytes(w['shared_bytes'] + w['own_bytes'])}) are views of the export's weights, each checked "
                "bit-equal to the checkpoint's at load (one copy in memory for the reference and ONNX Runtime)")
        if w["own_tensors"]:
            own = w["own"]
            text += (f"; {w['own_tensors']} ({human_bytes(w['own_bytes'])}) are the checkpoint's own: no bit-equal "
                     f"tensor in the export ({', '.join(own[:4])}{' ...' if len(own) > 4 else ''})")
        return text

    def __bool__(self) -> bool:
        return self.passed

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.passed for r in self.rows) and all(
            g["passed"] for g in self.greedy.values())

    def failures(self) -> list[str]:
        """One short line per failed output / greedy check: "section runner: output (max abs ..., atol ...)"."""
        out = [f"{r.section} {r.runner}: {r.output} ({r.note})" if math.isnan(r.max_abs) and r.note else
               f"{r.section} {r.runner}: {r.output} (max abs {r.max_abs:.3g} vs atol {r.atol:.3g}, max rel "
               f"{r.max_rel:.3g} vs rtol {r.rtol:.3g}{'; ' + r.note if r.note else ''}"
               f"{'; ' + self.routing_words(r) if self.routing_explains(r) else ''})"
               for r in self.rows if not r.passed]
        out += [f"sequence {name}: greedy tokens differ from {self.reference} at {g['mismatches'][0]['where']}"
                for name, g in self.greedy.items() if not g["passed"]]
        return out

    def routing_explains(self, row: OutputRow) -> bool:
        """Every failed input of this failed prefill row is explained by MoE routing flips at near ties
        (:attr:`routing`); the row stays failed."""
        explained = {d["feed"] for d in self.routing if d["runner"] == row.runner and d["explained"]}
        return (row.section == "prefill" and not row.passed and bool(row.failed_iterations)
                and not math.isnan(row.max_abs) and set(row.failed_iterations) <= explained)

    def routing_words(self, row: OutputRow) -> str:
        ds = [d for d in self.routing if d["runner"] == row.runner and d["feed"] in row.failed_iterations]
        n = sum(len(d["flips"]) for d in ds)
        return (f"explained by {n} MoE routing flip{'s' * (n != 1)} at a near tie (the reference routed so matches "
                "within tolerance; see 'MoE routing' in the report)")

    def all_failures_are_routing_flips(self) -> bool:
        """The check failed, and only through prefill rows that :meth:`routing_explains`."""
        failed = [r for r in self.rows if not r.passed]
        return (bool(failed) and all(self.routing_explains(r) for r in failed)
                and all(g["passed"] for g in self.greedy.values()))

    def routing_lines(self) -> list[str]:
        """One line per diagnosed feed (m2export.check.routing.Diagnosis.describe)."""
        from m2export.check.routing import Diagnosis, Flip

        return [Diagnosis(**{**d, "flips": [Flip(**f) for f in d["flips"]]}).describe() for d in self.routing]

    def continued_note(self) -> str:
        """How the prefill sizes were fed: fresh only, or fresh and continued after ``past_len`` tokens."""
        if not self.past_len:
            return " (zero past states)"
        source = "m2export's PyTorch model" if self.reference == "transformers" else self.reference
        return (f", each fresh (zero past states) and continued after {self.past_len} tokens (past states "
                f"from {source})")

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready values: a float that is not a number (a statistic of a row with NaN outputs, see
        ``OutputRow.nonfinite``) is None (JSON null), an infinite one the string "inf"/"-inf", never the invalid
        ``NaN``/``Infinity`` tokens."""
        d = asdict(self)
        d["passed"] = self.passed
        for row, r in zip(d["rows"], self.rows):
            row["why"] = row_verdict(r)
        return _json_safe(d)

    def write_json(self, path: Path) -> Path:
        """Write the report atomically (a full disk leaves the previous report, never a truncated one)."""
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=2, default=_json_default) + "\n")

    def to_markdown(self) -> str:
        lines = [f"# m2export check: {'PASSED' if self.passed else 'FAILED'}", "",
                 f"- output folder: `{self.outdir}` (dtype {self.dtype})",
                 f"- reference: `{self.reference}` ({self.runners[0]['detail'] if self.runners else ''})",
                 f"- vocabulary: {self.vocab_coverage or 'not recorded'}",
                 *([f"- reference weights: {self.weights_note()}"] if self.reference_weights else []),
                 "- runtimes: " + ", ".join(f"`{r['name']}` ({r['detail']})" for r in self.runners)]
        lines += [f"- {s}" for s in self.skipped]
        lines += [f"- inputs: {self.corpus} as bytes; prefill (batch x seqlen): "
                  + ", ".join(f"{b}x{s}" for b, s in self.shapes) + self.continued_note()
                  + f"; sequence: prompt {self.prompt_len} tokens + {self.decode_steps} decode steps"
                  + (f"; packed: {self.packed} in one call of model.packed.onnx, each sequence against the "
                     "reference run on it alone from the same states (odd-numbered ones continued)" if self.packed
                     else ""),
                  f"- tolerances (elemwise: fails where abs > atol and rel > rtol): atol {_fmt_tol(self.atol)}; "
                  f"rtol {_fmt_tol(self.rtol)}", ""]
        if self.failures():
            lines += ["## Failures", ""] + [f"- {f}" for f in self.failures()] + [""]
        if self.routing:
            lines += ["## MoE routing", "", ROUTING_INTRO, ""] + [f"- {x}" for x in self.routing_lines()] + [""]
        lines += ["## Per output", "",
                  "Each row's verdict names the metric it used (the max relative error against near-zero "
                  f"references is meaningless for a pass; every number is in {Path(self.outdir).name}'s "
                  "check_report.json).", "",
                  "| section | runtime | output | iters | max abs | mean abs | atol | rtol | result | why |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in self.rows:
            lines.append(f"| {r.section} | {runner_label(self, r.runner)} | {r.output} | {r.iterations} | "
                         f"{_num(r.max_abs, '.3e')} | {_num(r.mean_abs, '.3e')} | {r.atol:.1e} | {r.rtol:.1e} | "
                         f"{'pass' if r.passed else 'FAIL'} | {row_verdict(r)} |")
        lines += ["", "## Greedy tokens (sequence section)", ""]
        for name, g in self.greedy.items():
            lines.append(f"- {greedy_line(self, name, g)}")
        if self.histogram:
            lines += ["", f"![error histogram]({Path(self.histogram).name})"]
        elif self.histogram_note:
            lines += ["", f"Error histogram: {self.histogram_note}"]
        if self.versions:
            lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in self.versions.items())]
        if not self.polygraphy_commands and self.dtype == "bf16":
            lines += ["", "No `polygraphy run` equivalent for a bf16 export: Polygraphy's CLI runs ONNX graphs with "
                      "ONNX Runtime, which has no bf16 kernels on the CPU."]
        if self.polygraphy_commands:
            lines += ["", "## Reproduce anywhere with Polygraphy", "", reproduce_intro(self), "",
                      "```sh", f"cd {shlex.quote(self.commands_dir)}"] + [command_block(c, 100) for c in
                                                                          self.polygraphy_commands] + ["```"]
        if self.reproduce_note:
            lines += ["", f"Note: {self.reproduce_note}."]
        if self.tensorrt_commands or self.tensorrt_note:
            lines += ["", "With TensorRT (on the TensorRT machine, in the copied folder):", "", "```sh"] + [
                command_block(c, 100) for c in self.tensorrt_commands] + ["```"] + (
                [f"Note: {self.tensorrt_note}."] if self.tensorrt_note else [])
        return "\n".join(lines) + "\n"


#: what the MoE routing lines of a report mean
ROUTING_INTRO = ("Each failed prefill input of an MoE model, rerun in the reference with the routing decision that "
                 "was closest to a tie at its first failing token flipped to the runner-up (m2export.check.routing): "
                 "'explained' where the reference so rerouted matches every output within the same tolerances, i.e. "
                 "the runtime routed those tokens to other experts from its own rounded activations. The comparison "
                 "still fails.")


def row_verdict(r: OutputRow) -> str:
    """:func:`m2export.check.report.verdict` of one row."""
    return verdict(r.passed, r.max_abs, r.atol, r.rtol, r.failed_iterations, r.note)


def _num(x: float, spec: str) -> str:
    """A statistic for a table: ``-`` for NaN (not a number: the row's note says why), else ``format(x, spec)``."""
    return "-" if math.isnan(x) else format(x, spec)


def _fmt_tol(t: dict[str, float]) -> str:
    return ", ".join(f"{k or 'default'}={v:g}" for k, v in t.items())


def _json_safe(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None if math.isnan(o) else str(o)
    if isinstance(o, dict):
        return {k: _json_safe(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_json_safe(v) for v in o]
    return o


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    return str(o)


# ----------------------------------------------------------------------------------------------- runners
@dataclass
class _Runtime:
    """One runtime's prefill and decode runners (decode None: the prefill graph serves decode steps too);
    ``label`` is its short console name, runtime/flavour (``onnxrt/std``)."""

    name: str
    detail: str
    prefill: Any
    decode: Any | None
    label: str = ""


def _graph_path(outdir: Path, file: str, what: str) -> Path:
    p = outdir / file
    if not p.is_file():
        raise ExportFolderError(f"{p}: {what} listed in m2export.json is missing",
                                hint=REEXPORT_HINT)
    return p


def build_runtimes(outdir: Path, manifest: Manifest, reference, *, runtimes=RUNTIMES,
                   require_trt: bool = False, shared: SharedInitializers | None = None) -> tuple[list[_Runtime], list[str]]:
    """The reference plus one runtime per ONNX flavour (and TensorRT engines where possible); the ONNX Runtime
    sessions take their weights from ``shared`` (:class:`~m2export.check.runners.SharedInitializers`) when given.

    Returns (runtimes with the reference first, skipped-lines).

    Raises:
        ExportFolderError: a graph or engine listed in the manifest is missing (exit 1); ``require_trt`` with
            TensorRT usable but no engines built (exit 1).
        BackendUnavailable: ``require_trt`` and TensorRT is not usable here (not installed, no CUDA GPU):
            exit 4, checked before the engines.
    """
    dtype = manifest.dtype
    name = "transformers" if isinstance(reference, ModelFromTransformers) else REFERENCE
    out = [_Runtime(name, REFERENCES[name], reference_runner(reference, role="prefill", dtype=dtype, name=name),
                    reference_runner(reference, role="decode", dtype=dtype, name=name))]
    skipped: list[str] = []
    onnx_runtimes = [r for r in ("onnxrt", "onnx-reference") if r in runtimes]
    if dtype == "bf16" and "onnxrt" in onnx_runtimes:
        skipped.append("ONNX Runtime: skipped: bf16 export (ORT's CPU provider has no bfloat16 MatMul/Conv "
                       "kernels); its graphs are checked with ONNX's reference evaluator (onnx-reference) instead")
        onnx_runtimes = ["onnx-reference"]
    primary = manifest.graph("prefill").ssm_impl
    for rt_name in onnx_runtimes:
        make = functools.partial(onnxrt_runner, shared=shared) if rt_name == "onnxrt" else OnnxReferenceRunner
        what = "ONNX Runtime CPU" if rt_name == "onnxrt" else "onnx.reference.ReferenceEvaluator"
        for impl in [primary] + [i for i in manifest.ssm_impls() if i != primary]:
            g = manifest.graph("prefill", impl)
            pre = _graph_path(outdir, g.file, f"{impl} graph")
            runner = make(pre, name=f"{rt_name}:{pre.name}")
            io = g.io()
            if any(s.perm is not None for s in io.states):  # states compared in the model's layout
                runner = ModelLayoutStates(runner, io)
            out.append(_Runtime(f"{rt_name}:{pre.name}", f"{what}, ssm_impl={impl}", runner, None,
                                label=f"{rt_name}/{impl}"))
    if "trt" in runtimes:
        pre_e = manifest.engine("prefill")
        engines = list(manifest.engines)
        why = backends.tensorrt_unavailable_reason()
        if require_trt and why:  # one rule with generate's trt runtime: no usable TensorRT -> exit 4, first
            raise backends.tensorrt_unavailable_error(why, "check the TensorRT engines")
        for e in engines:
            _graph_path(outdir, e.file, f"{e.role} TensorRT engine")
        if not engines:
            msg = (f"TensorRT: skipped: {why} (and no engines in this folder)" if why else
                   "TensorRT: skipped: no engines in this folder (build them with 'm2export build OUTDIR')")
            if require_trt:
                raise ExportFolderError(f"{outdir}: no TensorRT engines to check (none recorded in m2export.json)",
                                  hint="build them with 'm2export build OUTDIR'")
            skipped.append(msg)
        elif why:
            skipped.append(f"TensorRT: skipped: {why} ({', '.join(e.file for e in engines)} not checked)")
        elif pre_e is None:
            skipped.append("TensorRT: skipped: no engine with a prefill profile (model.plan)")
        else:
            flavour = next((g.ssm_impl for g in manifest.graphs if g.file == pre_e.onnx_file), None)
            dec_e = manifest.engine("decode")
            pre, dec = trt_runners(outdir, pre_e, dec_e)
            files = pre_e.file + (f"+{dec_e.file}" if dec_e is not None and dec_e.file != pre_e.file else "")
            out.append(_Runtime(f"trt:{files}",
                                f"TensorRT {pre_e.tensorrt_version}, {pre_e.precision}, plugin {pre_e.plugin_mode}, "
                                f"profiles {'+'.join(pre_e.profile_roles)}", pre, dec,
                                label="trt" + (f"/{flavour}" if flavour else "")))
    return out, skipped


def _engine_shapes(manifest: Manifest) -> list[tuple[int, int]] | None:
    """(batch, seqlen) from the prefill engine's profiles: min, opt and max of ``input_ids``, if recorded."""
    e = manifest.engine("prefill")
    if e is None:
        return None
    out = []
    for prof in [e.profile("prefill")]:
        spec = prof.get("input_ids") if isinstance(prof, dict) else None
        if not isinstance(spec, dict):
            continue
        for k in ("min", "opt", "max"):
            shp = spec.get(k)
            if isinstance(shp, (list, tuple)) and len(shp) == 2 and (int(shp[0]), int(shp[1])) not in out:
                out.append((int(shp[0]), int(shp[1])))
    return out or None


# ----------------------------------------------------------------------------------------------- main entry
REFERENCE_BACKENDS = ("torch", "cutile")
"""Kernels of the PyTorch reference (``check --reference-backend``): PyTorch ops on the CPU, or the cuTile kernels on
a GPU (:meth:`m2export.models.mamba2.HybridLM.set_kernel_backend`)."""


def _check_reference_backend(backend: str, reference: str) -> None:
    """Refuse an unknown backend, or "cutile" with transformers' reference, a bad ``M2EXPORT_AUTOTUNE``
    (:func:`m2export.kernels._tune.enabled`) or without CUDA / cuda.tile, before any file is read (UsageError exit 2,
    ParameterError of the environment exit 1, BackendUnavailable exit 4; one line each)."""
    if backend not in REFERENCE_BACKENDS:
        raise UsageError(f"`reference_backend` {backend!r}: expected one of {list(REFERENCE_BACKENDS)}")
    if backend == "cutile":
        if reference != REFERENCE:
            raise UsageError(f"`reference_backend` 'cutile' runs m2export's PyTorch model; `reference` is "
                             f"{reference!r}", hint="drop `reference_backend`, or use `reference` 'torch'")
        from m2export.kernels import _tune
        from m2export.kernels._host import require_cuda_tile

        _tune.enabled()  # the cuTile scan reads M2EXPORT_AUTOTUNE on every eager call: a bad value fails here

        try:
            require_cuda_tile({})
        except BackendUnavailable as e:  # the kernels' own hint names their Python `backend` argument
            why = e.raw_message.split(": ", 1)[-1]
            raise BackendUnavailable(f"`reference_backend='cutile'`: {why}",
                                     hint="run it on a CUDA machine with the GPU extra (pip install m2export[gpu]), "
                                          "or use `reference_backend='torch'` (the default)") from None


def run_check(outdir: str | Path, *, checkpoint: str | Path | None = None, atol: list[str] | None = None,
              rtol: list[str] | None = None, shapes: list[tuple[int, int]] | None = None, decode_steps: int = 8,
              prompt_len: int | None = None, text: str | Path | None = None, seed: int = 0,
              runtimes=RUNTIMES, require_trt: bool = False, report_dir: str | Path | None = None,
              max_seqlen: int = 512, progress: Callable | None = None, polygraphy_log: bool = False,
              reference: str = REFERENCE, reference_backend: str = "torch", force: bool = False,
              vocab_sweep: bool = True) -> CheckReport:
    """Compare every runtime of an export with the reference (m2export's PyTorch model, or transformers'); write
    the reports.

    Args:
        outdir: folder written by ``m2export export`` (m2export.json + graphs [+ engines]).
        checkpoint: the reference checkpoint (default: the manifest's ``source_checkpoint``); its sha256
            must match the manifest's.
        atol, rtol: ``VALUE`` or ``NAME:VALUE`` (NAME may be a glob) on top of the dtype defaults.
        shapes: prefill (batch, seqlen) sizes, each >= 1 (default: the engine profile's min/opt/max when
            engines exist, else :func:`~m2export.check.data.default_shapes`); an empty prompt or batch is a
            UsageError (:func:`~m2export.check.data.check_shapes`), before anything is fed.
        decode_steps: decode-graph steps in the sequence section (0 skips the section).
        prompt_len: prompt length of the sequence section (default chunk_size // 2 + 5).
        text: corpus file (default: the Python stdlib sources).
        runtimes: subset of ("onnxrt", "onnx-reference", "trt"); a bf16 export swaps onnxrt for onnx-reference.
        require_trt: fail instead of skipping TensorRT (exit 4 without a usable TensorRT, checked first;
            exit 1 when TensorRT is usable but no engines were built).
        report_dir: where the reports go (default ``outdir``). A file there with a report's name that m2export did
            not write (or one edited since) is refused before anything runs (OutputFolderError), unless ``force``;
            what was written is recorded (OUTDIR: m2export.json's ``files``; elsewhere :data:`REPORTS_RECORD`).
        force: replace same-named files in ``report_dir`` even if m2export did not write them.
        vocab_sweep: after the corpus feeds, feed every token id once (fresh states; TokenDataLoader's
            ``vocab_sweep``: ceil(vocab_size / L) inputs of 1 x L, L = 333 on a 50k vocabulary, so most of a large
            vocabulary's check time); False skips it, and the report's vocabulary line says which ids were fed.
        progress: callback ``progress(description, total) -> advance()`` for progress bars (None: silent); where it
            returns a :class:`~m2export.check.console.ProgressTask`, its ``doing(what)`` is told each step as it
            starts: phases setup, prefill (per input and runner, the reference's past states included), packed,
            sequence (per runtime), reports (a plain ``advance`` callable is wrapped in one, its steps unnamed).
        polygraphy_log: let Polygraphy log its per-output details (``-v``).
        reference: "torch" (m2export's PyTorch model, fp32) or "transformers" (HF-format checkpoints only:
            transformers' model gives the logits, one full forward per call over the tokens so far, no cache;
            the ``present_*`` states stay compared against m2export's PyTorch model, which produces them in the
            graphs' layout; where transformers differs from mamba_ssm the reference follows mamba_ssm and the
            report says so: :class:`~m2export.check.runners.ModelFromTransformers`).

    Returns:
        CheckReport (truthy when everything passed); reports written to ``report_dir``:
        check_report.json, check_report.md, check_errors.png (with matplotlib), and for the printed
        commands check_inputs.json, check_reference_outputs.json, check_data_loader.py (m2export.check.repro).

    Raises:
        ParameterError: a bad argument; ExportFolderError, CheckpointError, RuntimeLoadError: the folder, the
            reference or a graph is unusable (exit 1); OutputFolderError: `report_dir` is not writable, or a report
            file there is not the one m2export wrote (a user's, or edited since) and not ``force``.
        BackendUnavailable: ``require_trt`` where TensorRT is not usable (exit 4).
    """
    from polygraphy.comparator import Comparator
    from polygraphy.exception import PolygraphyException
    from polygraphy.logger import G_LOGGER

    for param, value, low in (("decode_steps", decode_steps, 0), ("prompt_len", prompt_len, 1),
                              ("max_seqlen", max_seqlen, 1), ("seed", seed, 0)):
        if value is not None and value < low:
            raise UsageError(f"`{param}` {value}: expected an integer >= {low}")
    if reference not in REFERENCES:
        raise UsageError(f"`reference` {reference!r}: expected one of {list(REFERENCES)}")
    tolerance_items(atol, "atol"), tolerance_items(rtol, "rtol")  # values first; names once the outputs are known
    shapes = check_shapes(shapes) if shapes is not None else None
    _check_reference_backend(reference_backend, reference)
    runtimes = tuple(names.canonical("runtime", r) for r in runtimes)
    unknown = [r for r in runtimes if r not in ALL_RUNTIMES]
    if unknown:
        raise UsageError(f"`runtimes` {unknown}: expected names from {list(ALL_RUNTIMES)}")
    outdir = Path(outdir)
    manifest = read_manifest(outdir)
    atol_d, rtol_d = default_tolerances(manifest.dtype)  # the names need only the manifest: before any graph is read
    out_names = GraphIO.for_model(manifest.model_config(), manifest.dtype).output_names()
    atol_d = parse_tolerances(atol, atol_d, out_names, "atol")
    rtol_d = parse_tolerances(rtol, rtol_d, out_names, "rtol")
    from m2export.inspect import check_graph_file

    prog = _new_task(progress)
    setup = prog("setup", len(manifest.graphs) + 1)
    for g in manifest.graphs:  # SSMScan attributes must keep the contract (ORT would run them as they are),
        setup.doing(f"reading {g.file} (contract checks)")
        check_graph_file(outdir / g.file, g)  # and each file must be the graph its entry describes
        setup()
    cfg = manifest.model_config()
    dtype = manifest.dtype
    report_dir = _writable_report_dir(Path(report_dir) if report_dir else outdir, explicit=bool(report_dir))
    in_outdir = report_dir.resolve() == outdir.resolve()
    if not force:  # before the long run; again right before the reports are written
        _refuse_unowned_reports(report_dir, in_outdir=in_outdir)

    ck_path = Path(checkpoint) if checkpoint else Path(manifest.source_checkpoint)
    if not ck_path.exists():
        if checkpoint:  # the user's path, not the manifest's
            raise CheckpointError(f"`checkpoint` {ck_path}: no such file or directory",
                                  hint="pass the checkpoint the export was made from, or omit `checkpoint` to use "
                                       f"the one {MANIFEST_FILE} records ({manifest.source_checkpoint})")
        raise CheckpointError(f"reference checkpoint {ck_path} (from {MANIFEST_FILE}) does not exist",
                              hint="pass the checkpoint the export was made from (`checkpoint`)")
    shared = SharedInitializers()  # every ONNX Runtime session's weights: one memory-mapped copy of model.onnx.data
    weights = ExportWeights(shared, [outdir / g.file for g in manifest.graphs])  # ... and the reference's, verified
    on_cpu = reference_backend == "torch"  # a cuTile reference copies its weights to the GPU: nothing to share
    ref_loader = ModelFromCheckpoint(ck_path, expected_sha256=manifest.checkpoint_sha256 or None,
                                     kernel_backend=reference_backend, share=weights if on_cpu else None,
                                     allow_nonfinite=manifest.allow_nonfinite)
    if reference == "transformers":
        ref_loader = ModelFromTransformers(ck_path, ref_loader)

    compare_func = make_compare_func(atol_d, rtol_d)

    shapes = shapes or list(_engine_shapes(manifest) or default_shapes(cfg, max_seqlen))
    corpus = read_corpus(text)
    # an ONNX runtime on a graph whose SSMScan runs the chunked body: its working set counts in the shapes' memory
    onnx_scan = any(r in runtimes for r in ("onnxrt", "onnx-reference")) and any(
        g.ssm_impl in ("ssmscan", "std") and g.role != PACKED_ROLE for g in manifest.graphs)
    loader = TokenDataLoader(cfg, dtype, shapes, corpus=corpus, seed=seed, reference=ref_loader, onnx_scan=onnx_scan,
                             vocab_sweep=vocab_sweep)
    rts, skipped = build_runtimes(outdir, manifest, ref_loader, runtimes=runtimes, require_trt=require_trt,
                                  shared=shared)
    if len(rts) < 2:
        raise ParameterError(f"{outdir}: nothing to compare with the reference (`runtimes`={list(runtimes)})",
                             hint="keep 'onnxrt' in `runtimes`")
    setup.doing(f"loading the reference checkpoint {ck_path} (sha256, weights checked against the export's)")
    loaded = ref_loader()  # load now: a bad checkpoint fails before any runtime starts
    setup()
    ck = loaded.ck if reference == "transformers" else loaded
    ref_weights = ExportWeights.summary(ck.model, ck.shared) if on_cpu else {}
    scan = loaded.model.mixers[0].scan_fn
    rts[0].detail = f"PyTorch fp32, {ck_path}, scan {scan.__module__}.{scan.__qualname__}"
    if reference_backend != "torch":
        rts[0].detail = (f"PyTorch fp32 on {loaded.model.lm_head.weight.device}, {ck_path}, Mamba layers (conv, "
                         "scan, gated norm) on the cuTile kernels")
    if reference == "transformers":
        import transformers

        rts[0].detail = (f"transformers {transformers.__version__} {type(loaded.hf).__name__} fp32, {ck_path}: logits "
                         "(one full forward over the tokens so far per call, no cache); present_* states from "
                         f"m2export's PyTorch model (scan {scan.__module__}.{scan.__qualname__}), which transformers "
                         "does not expose in this layout"
                         + "".join(f"; follows mamba_ssm: {n}" for n in loaded.notes))
    del loaded, ck  # the loader keeps it until the reference's last call (release_reference)
    hist: dict[str, list[np.ndarray]] = {}
    packed_info: list[tuple[str, str]] = []  # the packed section's (pack, runner name), when it ran

    severity = G_LOGGER.INFO if polygraphy_log else G_LOGGER.CRITICAL
    try:
        with G_LOGGER.verbosity(severity), _no_eager_log_stats(enabled=not polygraphy_log):
            # -------- prefill section: every feed through the reference, then each runtime, compared as produced
            sweep = f"; the vocabulary sweep: the last {len(loader.sweep)}" if loader.sweep else ""
            advance = prog(f"prefill ({len(loader)} inputs x {len(rts)} runners{sweep})", len(loader) * len(rts))
            rec = RecordingLoader(loader)  # keeps the first feeds + reference outputs for the commands
            routing: list[dict[str, Any]] = []
            prefill_acc = _prefill(rts, rec, compare_func, advance, hist, rec, feeds=loader.feeds,
                                   explain=_routing_explainer(routing, compare_func, dtype, atol_d, rtol_d))
            rows = _rows("prefill", [prefill_acc], loader.labels, out_names, atol_d, rtol_d)
            rows += _packed_rows(outdir, manifest, ref_loader, compare_func, runtimes, shared, corpus, seed,
                                 max_seqlen, out_names, atol_d, rtol_d, skipped, packed_info, prog)

            # -------- sequence section: prefill -> decode steps, states fed back per runtime
            greedy: dict[str, dict[str, Any]] = {}
            plen = prompt_len if prompt_len is not None else min(max_seqlen, chunk_size_of(cfg) // 2 + 5)
            prof = _engine_shapes(manifest)
            if prof and prompt_len is None:  # keep the prompt inside the prefill engine's profile
                plen = min(max(plen, min(s for _, s in prof)), max(s for _, s in prof))
            if decode_steps > 0:
                advance = prog(f"sequence (prompt {plen} + {decode_steps} decode steps)", len(rts))
                seq_accs, greedy = _sequence(
                    rts, cfg, dtype, corpus, plen, decode_steps, seed, atol_d.get("logits", atol_d[""]), advance,
                    lambda ref, run: Comparator.compare_accuracy([ref, run], comparisons=[(1, 0)],
                                                                 compare_func=compare_func),
                    batch=_sequence_batch(manifest), release_reference=ref_loader.release)
                seq_labels = ["prefill"] + [f"step {k + 1}" for k in range(decode_steps)]
                for acc in seq_accs:
                    rows += _rows("sequence", acc, seq_labels, out_names, atol_d, rtol_d)
    except PolygraphyException as e:
        raise M2ExportError(f"Polygraphy failed while running the comparison: {e}".strip(),
                            hint="re-run with -v for Polygraphy's log") from None
    finally:
        ref_loader.release()
        shared.release()
        gc.collect()
    changed = weights.unchanged()
    if changed:  # the reference and ONNX Runtime read these files' pages while they ran: the comparison is void
        raise ExportFolderError(f"{', '.join(changed)}: changed while the check ran (the reference and ONNX Runtime "
                                "both read it); the comparison is void", hint="re-run the check when nothing "
                                "writes to the folder")

    report = CheckReport(
        outdir=str(outdir), dtype=dtype, reference=rts[0].name,
        runners=[{"name": r.name, "detail": r.detail, "label": r.label or r.name} for r in rts]
        + [{"name": n, "detail": "ONNX Runtime CPU, packed prefill graph (cu_seqlens)", "label": "onnxrt/packed"}
           for _, n in packed_info], skipped=skipped,
        shapes=[list(s) for s in shapes], decode_steps=decode_steps if greedy else 0,
        prompt_len=plen if greedy else 0, atol=atol_d, rtol=rtol_d, rows=rows, greedy=greedy,
        corpus=str(text) if text else "Python stdlib sources", versions=_versions(), past_len=loader.past_len,
        vocab_coverage=loader.coverage, vocab_sweep_inputs=len(loader.sweep), reference_weights=ref_weights,
        packed="".join(p for p, _ in packed_info), routing=routing)
    written = [REPORT_JSON, REPORT_MD]
    if not force:
        _refuse_unowned_reports(report_dir, in_outdir=in_outdir)
    writing = prog("reports", 1)
    writing.doing(f"writing the reports to {report_dir}")
    try:
        if dtype != "bf16" and write_saved(report_dir, rec, rts[0].name):  # JSON has no bf16; ORT CPU neither
            written += [DATA_LOADER_SCRIPT, INPUTS_FILE, REFERENCE_FILE]
            cmds = reproduction_commands(outdir, manifest, report_dir, atol_d, rtol_d)
            report.polygraphy_commands, report.tensorrt_commands = cmds["onnxrt"], cmds["tensorrt"]
            report.saved, report.commands_dir = describe_saved(rec), str(report_dir)
            report.tensorrt_note = ssmscan_build_note(manifest) or ""
            report.reproduce_note = left_out_note(manifest) or ""
        report.histogram, report.histogram_note = _histogram(hist, report_dir / REPORT_PNG)
        written += [REPORT_PNG] if report.histogram else []
        report.write_json(report_dir / REPORT_JSON)
        atomic_write_text(report_dir / REPORT_MD, report.to_markdown())
        _record_reports(report_dir, written, in_outdir=in_outdir)  # ours now: the next check may replace them
        writing()
    except OSError as e:
        raise OutputFolderError(f"{report_dir}: cannot write the check reports ({e.strerror or e})",
                                hint="pass a writable folder as `report_dir`") from None
    return report


#: in a ``report_dir`` other than OUTDIR: what the check wrote there, {name: sha256} (OUTDIR's own reports are recorded
#: in its m2export.json instead), so that a later check replaces only those files and never one it did not write
REPORTS_RECORD = "check_reports_written.json"
_RECORD_WRITER = "m2export check"
_UNOWNED_HINT = "move those files away, write the reports elsewhere with `report_dir`, or replace them with `force`"


def _refuse_unowned_reports(report_dir: Path, *, in_outdir: bool) -> None:
    """A report file of ``report_dir`` that m2export did not write, or one edited since it did, is never replaced:
    OutputFolderError naming the files (exit 1). In OUTDIR the manifest's ``files`` say which are m2export's
    (:func:`~m2export.exporter.manifest.refuse_unowned`, the rule of ``export --force``); elsewhere
    :data:`REPORTS_RECORD` does, and a file of that name that is not such a record is refused too."""
    if in_outdir:
        refuse_unowned(report_dir, CHECK_REPORT_FILES, writer="check", what="reports", hint=_UNOWNED_HINT)
        return
    from m2export.exporter.manifest import file_sha256

    present = [n for n in (*CHECK_REPORT_FILES, REPORTS_RECORD) if os.path.lexists(report_dir / n)]
    if not present:
        return
    recorded = _reports_record(report_dir)
    foreign = [] if recorded is not None or REPORTS_RECORD not in present else [REPORTS_RECORD]
    for n in present:
        if n == REPORTS_RECORD:
            continue
        p = report_dir / n
        try:
            ours = (recorded is not None and n in recorded and p.is_file() and not p.is_symlink()
                    and file_sha256(p) == recorded[n])
        except OSError:
            ours = False
        if not ours:
            foreign.append(n)
    if foreign:
        listing = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise OutputFolderError(f"`report_dir` {report_dir}: holds file(s) m2export check did not write, or changed "
                                f"since ({listing}); check replaces only the reports it wrote", hint=_UNOWNED_HINT)


def _reports_record(report_dir: Path) -> dict[str, str] | None:
    """{name: sha256} of :data:`REPORTS_RECORD` in ``report_dir``; None when it is absent or not such a record."""
    p = report_dir / REPORTS_RECORD
    try:
        if p.is_symlink() or not p.is_file():
            return None
        raw = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(raw, dict) and raw.get("written_by") == _RECORD_WRITER and isinstance(raw.get("files"), dict)):
        return None
    return {k: v for k, v in raw["files"].items() if isinstance(k, str) and isinstance(v, str)}


def _record_reports(report_dir: Path, names: list[str], *, in_outdir: bool) -> None:
    """Record the reports just written as m2export's (OUTDIR: its manifest; elsewhere :data:`REPORTS_RECORD`),
    so that the next check (and, in OUTDIR, ``export --force``) may replace them. Raises OSError."""
    if in_outdir:
        record_files(report_dir, names)
        return
    from m2export.exporter.manifest import aux_record

    files = {**(_reports_record(report_dir) or {}), **aux_record(report_dir, names)}
    atomic_write_text(report_dir / REPORTS_RECORD, json.dumps({"written_by": _RECORD_WRITER, "files": files},
                                                              indent=2) + "\n")


def _writable_report_dir(path: Path, *, explicit: bool) -> Path:
    """``path``, created if needed, after proving a file can be written there (before the long run).

    Raises:
        OutputFolderError: it cannot be created or written (exit 1), with the OS's reason.
    """
    import tempfile

    what = f"`report_dir` {path}" if explicit else f"{path}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        reason = e.strerror or str(e)
        if isinstance(e, FileExistsError) or (path.exists() and not path.is_dir()):
            reason = "a file, not a folder"
        raise OutputFolderError(f"{what}: cannot write the check reports there ({reason})",
                                hint="pass a writable folder as `report_dir`") from None
    return path


HIST_SAMPLES = 100_000  # per output and iteration: the histogram needs a sample, not every logit


@contextlib.contextmanager
def _no_eager_log_stats(enabled: bool):
    """While Polygraphy's log is suppressed, skip its per-output *log* statistics.

    ``polygraphy.comparator.util.log_output_stats`` computes mean/std/median/p90/p95/p99 of every
    compared output and of its abs/rel differences eagerly, then hands the string to a logger that
    drops it: on a 50k-token vocabulary that was 60% of a check's time (27 of 44 s). The comparison
    itself (``SimpleCompareFunc``'s statistics and verdicts) does not use it. Restored on exit.
    """
    from polygraphy.comparator import util as comp_util

    original = getattr(comp_util, "log_output_stats", None)
    if not enabled or original is None:
        yield
        return
    comp_util.log_output_stats = lambda *args, **kwargs: None
    try:
        yield
    finally:
        comp_util.log_output_stats = original


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("m2export", "polygraphy", "onnxruntime", "onnx", "torch", "numpy", "tensorrt"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _new_task(progress: Callable | None) -> Callable[[str, int], ProgressTask]:
    """``new_task(description, total) -> ProgressTask`` from run_check's ``progress`` callback (None: silent), whose
    ``advance`` may be a plain callable (then the steps' names go nowhere)."""
    if progress is None:
        return lambda desc, total: ProgressTask()

    def new_task(desc: str, total: int) -> ProgressTask:
        task = progress(desc, total)
        return task if isinstance(task, ProgressTask) else ProgressTask(task)
    return new_task


def _prefill(rts: list[_Runtime], loader, compare_func, advance: ProgressTask, hist, rec=None,
             feeds: "list[FeedInfo] | None" = None, explain: Callable | None = None
             ) -> "OrderedDict[tuple[str, str], list]":
    """The prefill section: every feed of ``loader`` through the reference's prefill runner, then through each
    runtime's in turn; each runtime's outputs are compared with the reference's (``compare_func(runtime,
    reference)``, Polygraphy's order: relative errors divide by the reference) as soon as they exist and
    dropped, so at most the reference's and one runtime's outputs of one feed are alive (Polygraphy's
    ``Comparator.run(streaming=True)`` held every runner's outputs of a feed, and the previous feed's while
    the next ran). All runners are active for the whole section, as with ``Comparator.run``; feeds are
    coerced to each runner's input metadata as it does.

    Also hands the reference's outputs to ``rec`` (:class:`~m2export.check.repro.RecordingLoader`) and (when
    matplotlib is installed)
    keeps a strided sample of the abs errors per runtime and output group in ``hist`` for the histogram.
    A runtime's failed feed is handed to ``explain(reference runner, rerun, runtime outputs, feed label)`` (``rerun()``
    runs the reference on that feed again) before its outputs are dropped: :func:`_routing_explainer`.

    Returns:
        {(runtime runner name, reference runner name): [one match dict per feed]}: the layout of Polygraphy's
        ``AccuracyResult`` that :func:`_rows` reads.
    """
    from polygraphy.comparator.data_loader import check_feed_dict, coerce_feed_dict
    from polygraphy.comparator.struct import IterationResult
    from polygraphy.logger import G_LOGGER

    want_hist = importlib.util.find_spec("matplotlib") is not None
    runners = [r.prefill for r in rts]
    acc: OrderedDict[tuple[str, str], list] = OrderedDict(((r.name, runners[0].name), []) for r in runners[1:])
    names = [rt.label or rt.name for rt in rts]
    infos = list(feeds or [])

    def info(k) -> FeedInfo:  # what the loader says of its k-th feed (a plain loader: nothing)
        return infos[k] if k < len(infos) else FeedInfo(f"input {k + 1}")

    def label(k):
        return info(k).label

    with contextlib.ExitStack() as stack:
        active = []
        for rt, r in zip(names, runners):  # ONNX Runtime builds its session here (seconds for a large graph)
            advance.doing(f"starting {rt}")
            active.append(stack.enter_context(r))
        metas = [r.get_input_metadata(use_numpy_dtypes=False) for r in active]

        def run(k, feed):
            runner = active[k]
            out = runner.infer(feed_dict=coerce_feed_dict(feed, metas[k]))
            return IterationResult(outputs=out, runtime=runner.last_inference_time(), runner_name=runner.name)

        feeds = iter(loader)
        stack.callback(getattr(feeds, "close", lambda: None))  # the loader's own reference runner, deactivated
        for k in range(len(loader)):
            # a continued input's past states come from the reference, run while the loader makes the feed
            advance.doing(f"{label(k)}: making the feed" + (" (reference past states)" if info(k).continues else ""))
            feed = next(feeds, None)
            if feed is None:
                break
            check_feed_dict(feed)
            advance.doing(f"{label(k)}: {names[0]}")
            ref = run(0, feed)
            advance()
            release_freed_memory()  # the reference's freed temporaries, before the runtimes allocate theirs
            if rec is not None:
                rec.record_outputs(k, ref)
            for i in range(1, len(active)):
                advance.doing(f"{label(k)}: {names[i]}")
                it = run(i, feed)
                match = compare_func(it, ref)
                acc[(it.runner_name, ref.runner_name)].append(match)
                if explain is not None and not all(bool(m) for m in match.values()):
                    advance.doing(f"{label(k)}: {names[i]} failed; rerunning {names[0]} with near-tie MoE routing "
                                  "flips")
                    explain(active[0], lambda f=feed: run(0, f), it, label(k))
                if want_hist:
                    _sample_errors(hist, it, ref)
                del it
                release_freed_memory()
                advance()
            del ref, feed
    for (name, ref_name), matches in acc.items():
        n_ok = sum(all(bool(m) for m in match.values()) for match in matches)
        G_LOGGER.log(f"Accuracy Summary | {name} vs. {ref_name} | Passed: {n_ok}/{len(matches)} iterations",
                     G_LOGGER.FINISH if n_ok == len(matches) else G_LOGGER.ERROR)
    return acc


#: failed prefill feeds whose MoE routing is diagnosed in one check (each up to routing.MAX_RERUNS reference reruns)
MAX_ROUTING_DIAGNOSES = 4


def _routing_explainer(out: list[dict[str, Any]], compare_func, dtype: str, atol_d, rtol_d) -> Callable:
    """``_prefill``'s ``explain``: :func:`m2export.check.routing.diagnose` of a failed feed, appended to ``out`` as
    a dict, for m2export's PyTorch reference of a model with MoE layers (transformers' reference: nothing), at most
    :data:`MAX_ROUTING_DIAGNOSES` feeds."""
    from m2export.check.routing import diagnose, moe_routers

    def explain(ref_runner, rerun, it, feed_label) -> None:
        model = getattr(ref_runner, "model", None)
        if (not isinstance(ref_runner, TorchRunner) or isinstance(ref_runner, TransformersRunner) or model is None
                or not moe_routers(model) or "logits" not in it):
            return
        if len(out) >= MAX_ROUTING_DIAGNOSES:
            out.append({"runner": it.runner_name, "feed": feed_label, "explained": False, "flips": [],
                        "max_abs": math.nan, "reason": f"not diagnosed (only the first {MAX_ROUTING_DIAGNOSES} "
                                                       "failed inputs are)"})
            return
        d = diagnose(model, rerun, it, compare_func, runner=it.runner_name, feed=feed_label, dtype=dtype,
                     atol=atol_d.get("logits", atol_d[""]), rtol=rtol_d.get("logits", rtol_d[""]))
        if d is not None:
            out.append(d.to_dict())

    return explain


def _packed_rows(outdir, manifest, ref_loader, compare_func, runtimes, shared, corpus, seed, max_seqlen, out_names,
                 atol_d, rtol_d, skipped: list[str], info: list[tuple[str, str]], prog) -> list[OutputRow]:
    """The packed section (:mod:`m2export.check.packed`): rows for ``model.packed.onnx`` in ONNX Runtime, when the
    export has it; a skipped-line when ONNX Runtime is not among ``runtimes``. Appends (the pack's label, the
    runner's name) to ``info``."""
    from m2export.check.packed import SECTION, packed_entry, packed_section

    entry = packed_entry(manifest)
    if entry is None:
        return []
    if "onnxrt" not in runtimes:
        skipped.append(f"packed prefill graph ({entry.file}): skipped: ONNX Runtime is not among the runtimes")
        return []
    reference = getattr(ref_loader, "m2export_reference", ref_loader)  # states in the graphs' layout: m2export's
    pio = entry.io()

    def runner(path, name):
        r = onnxrt_runner(path, name=name, shared=shared)
        return ModelLayoutStates(r, pio) if any(s.perm is not None for s in pio.states) else r

    advance = prog(f"packed ({entry.file})", 1)
    acc, label, name = packed_section(outdir, manifest, reference, compare_func,
                                   tokens=byte_tokens(corpus, manifest.model_config().vocab_size), seed=seed,
                                   dtype=manifest.dtype, max_seqlen=max_seqlen, runner_factory=runner,
                                   doing=advance.doing)
    advance()
    release_freed_memory()
    info.append((label, name))
    return _rows(SECTION, [acc], [label], out_names, atol_d, rtol_d)


def _sample_errors(hist: dict[str, list[np.ndarray]], it, ref) -> None:
    """A strided sample (:data:`HIST_SAMPLES` per output) of one runtime's abs errors vs the reference, per
    runtime and output group (``"name | logits"``), for the histogram."""
    for out_name in it.keys():
        if out_name in ref:
            a = np.asarray(it[out_name]).ravel()
            b = np.asarray(ref[out_name]).ravel()
            step = max(1, -(-a.size // HIST_SAMPLES))
            err = np.abs(a[::step].astype(np.float64) - b[::step].astype(np.float64)).astype(np.float32)
            hist.setdefault(f"{it.runner_name} | {out_name.split('.')[0]}", []).append(err)


def release_freed_memory() -> None:
    """Hand memory freed by the last call back to the OS (glibc's ``malloc_trim``; elsewhere nothing).

    glibc keeps what a PyTorch forward frees in its per-thread heaps: after the reference's 1x256, 3x127 and 2x257
    calls on a 130m model its process held 0.76 GB of private memory, 0.29 GB after a trim (CPU here). The check
    trims after every compared input, so that memory serves the next runtime instead of sitting in a heap.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


def _rows(section, acc_results, labels, out_names, atol_d, rtol_d) -> list[OutputRow]:
    """OutputRow per (pair, output) aggregated over iterations; outputs never compared become failures.

    An output with a NaN or inf in either runtime's output in any iteration (:class:`~m2export.check.metrics.
    NonFinite`, counted by the sliced comparison) fails, and its row states it as such: the counts and the
    iterations in ``note`` and ``nonfinite``, every statistic NaN (printed as "-"), never a number computed
    over the finite part or from the other iterations. A non-finite difference without a count (Polygraphy's own
    comparison of a shape-mismatched output) is stated as "non-finite differences"."""
    from m2export.check.metrics import NonFinite

    acc = acc_results[0]  # one compare func
    rows = []
    for (runner, reference), iters in acc.items():
        seen: dict[str, list] = OrderedDict((n, []) for n in out_names)
        for k, match in enumerate(iters):
            for name, res in match.items():
                seen.setdefault(name, []).append((k, res))
        for name, results in seen.items():
            atol, rtol = atol_d.get(name, atol_d[""]), rtol_d.get(name, rtol_d[""])
            if not results:
                rows.append(OutputRow(section, runner, reference, name, 0, math.nan, math.nan, math.nan, math.nan,
                                      atol, rtol, False, note="output missing from this runtime"))
                continue
            label = [labels[k] if k < len(labels) else str(k) for k, _ in results]
            stats = [(i, r) for i, (_, r) in enumerate(results) if hasattr(r, "max_absdiff")]
            failed = [label[i] for i, (_, r) in enumerate(results) if not bool(r)]
            notes = [] if len(stats) == len(results) else ["shape mismatch"]
            nonfinite, where = NonFinite(), []
            for i, s in stats:
                nf = getattr(s, "nonfinite", None)
                if nf:
                    nonfinite, where = nonfinite + nf, where + [label[i]]
                elif not (math.isfinite(s.max_absdiff) and math.isfinite(s.max_reldiff)) and nf is None:
                    where.append(label[i])
            row = OutputRow(section, runner, reference, name, len(results),
                            _nanmax([s.max_absdiff for _, s in stats]),
                            float(np.mean([s.mean_absdiff for _, s in stats])) if stats else math.nan,
                            _nanmax([s.max_reldiff for _, s in stats]),
                            float(np.mean([s.mean_reldiff for _, s in stats])) if stats else math.nan,
                            atol, rtol, not failed, failed)
            if where:  # NaN/inf: a failure stated as such; no statistic stands for the output
                at = f" (at {', '.join(where[:3])}{' ...' if len(where) > 3 else ''})"
                notes.append((nonfinite.describe() if nonfinite else "non-finite differences (NaN/inf)") + at)
                row.max_abs = row.mean_abs = row.max_rel = row.mean_rel = math.nan
                row.passed = False
                row.nonfinite = nonfinite.to_dict() if nonfinite else {}
            row.note = "; ".join(notes)
            rows.append(row)
    return rows


def _nanmax(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return max(xs) if xs else math.nan


def _sequence_batch(manifest: Manifest) -> int:
    """Batch of the sequence check: 2, or less where a TensorRT profile allows only 1."""
    batch = 2
    for e in manifest.engines:
        for prof in e.profiles or []:
            spec = prof.get("input_ids") if isinstance(prof, dict) else None
            if isinstance(spec, dict) and isinstance(spec.get("max"), (list, tuple)) and spec["max"]:
                batch = min(batch, int(spec["max"][0]))
    return max(batch, 1)


def _sequence(rts: list[_Runtime], cfg, dtype, corpus: bytes, plen: int, steps: int, seed: int, logits_atol: float,
              advance: ProgressTask, compare: Callable, batch: int = 2,
              release_reference: Callable[[], None] | None = None) -> tuple[list[Any], dict[str, dict[str, Any]]]:
    """Run prefill + ``steps`` decode steps per runtime, one runtime at a time; return (one Polygraphy
    ``AccuracyResults`` per runtime after the reference, greedy agreement per runtime).

    Each runtime runs :meth:`~m2export.exporter.runtime.Decoder.run_sequence` (its own states fed back). The
    reference runs first and its iterations are kept; its greedy token at each step is fed to every runtime.
    Every other runtime is compared with them as it runs (``compare(reference_stream, runtime_stream)``): only
    the reference's iterations and the current call's outputs are held, never a runtime's whole sequence.
    ``release_reference()`` is called once the reference has run (its model is not needed after it).
    """
    from polygraphy.comparator import RunResults
    from polygraphy.comparator.struct import IterationResult

    io = GraphIO.for_model(cfg, dtype)
    rng = np.random.default_rng(seed + 1)
    prompt = token_windows(byte_tokens(corpus, cfg.vocab_size), batch, plen, rng)
    ref_iters: list[Any] = []
    ref_tokens: list[np.ndarray] = []
    ref_logits: list[np.ndarray] = []
    greedy: dict[str, dict[str, Any]] = {}
    accs = []

    def singles(name, iters):
        for it in iters:
            rr = RunResults()
            rr.append((name, [it]))
            yield rr

    for ri, rt in enumerate(rts):
        def choose(k: int, last: np.ndarray, ri=ri, rt=rt) -> np.ndarray:
            if ri == 0:
                ref_logits.append(last)
                ref_tokens.append(last.argmax(-1))
            else:
                _greedy_update(greedy.setdefault(rt.name, {"agree": 0, "total": 0, "ties": 0, "mismatches": []}),
                               k, last, ref_logits[k], logits_atol)
            return ref_tokens[k]

        def iterations(runner, rt=rt, choose=choose):
            st = None
            for st in runner.run_sequence(prompt, steps, choose):
                yield IterationResult(st.outputs, runner_name=rt.name)
            choose(steps, np.asarray(st.outputs["logits"], dtype=np.float32)[:, -1])

        one_graph = rt.decode is None or rt.decode is rt.prefill
        advance.doing(f"{rt.label or rt.name}: prompt {plen} + {steps} decode steps, its own states fed back")
        with rt.prefill as pre, (contextlib.nullcontext(None) if one_graph else rt.decode) as dec:
            runner = Decoder(io, pre.infer, None if dec is None else dec.infer, np_dtype=feed_dtype_of)
            if ri == 0:
                ref_iters = list(iterations(runner))
                release_freed_memory()
            else:
                accs.append(compare(singles(rts[0].name, ref_iters), singles(rt.name, iterations(runner))))
        if ri == 0 and release_reference is not None:
            release_reference()
            gc.collect()
        advance()
    for g in greedy.values():
        g["passed"] = not g["mismatches"]
    return accs, greedy


def _greedy_update(g: dict, step: int, last: np.ndarray, ref: np.ndarray, atol: float) -> None:
    """Count greedy agreement at one step; a disagreement counts only where the reference's top-2 margin
    exceeds 2 * atol (otherwise the choice is a numerical tie)."""
    mine, theirs = last.argmax(-1), ref.argmax(-1)
    if ref.shape[-1] < 2:  # a one-token vocabulary: nothing to tie with
        margin = np.full(len(ref), np.inf)
    else:
        top2 = np.sort(ref, axis=-1)[:, -2:]
        margin = top2[:, 1] - top2[:, 0]
    for b in range(len(mine)):
        g["total"] += 1
        bad = [who for who, x in (("runtime", last[b]), ("reference", ref[b])) if not np.isfinite(x).all()]
        if bad:  # NaN argmax is 0 on both sides: never an agreement
            g["mismatches"].append({"where": f"{'prefill' if step == 0 else f'step {step}'} batch {b} (non-finite "
                                             f"logits ({' and '.join(bad)}))", "token": int(mine[b]),
                                    "reference_token": int(theirs[b]), "reference_margin": float("nan")})
            continue
        if mine[b] == theirs[b]:
            g["agree"] += 1
        elif margin[b] <= 2 * atol:
            g["ties"] += 1
        else:
            g["mismatches"].append({"where": f"{'prefill' if step == 0 else f'step {step}'} batch {b}",
                                    "token": int(mine[b]), "reference_token": int(theirs[b]),
                                    "reference_margin": float(margin[b])})


# ----------------------------------------------------------------------------------------------- histogram
def _histogram(hist: dict[str, list[np.ndarray]], path: Path) -> tuple[str | None, str]:
    """PNG histogram of log10 abs errors per runtime and output group; (path, "") or (None, why not)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "skipped: matplotlib not installed (pip install 'm2export[plot]')"
    if not hist:
        return None, "skipped: no comparisons"
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, errs in sorted(hist.items()):
        e = np.concatenate(errs)
        finite = np.isfinite(e)
        if not finite.any():
            continue
        bad = int((~finite).sum())
        ax.hist(np.log10(np.maximum(e[finite], 1e-12)), bins=80, histtype="step",
                label=label + (f" ({bad} non-finite not shown)" if bad else ""))
    ax.set_xlabel("log10 |runtime - torch| over all prefill-section elements (exact matches at -12)")
    ax.set_ylabel("elements")
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return str(path), ""
