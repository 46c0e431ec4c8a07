"""How a :class:`~m2export.check.compare.CheckReport` reads: console layouts, the Markdown report, verdicts,
copyable command blocks. Presentation only: the numbers come from the report.

* **Verdicts** (:func:`verdict`): Polygraphy's elementwise rule fails an element where its abs error >
  atol *and* its rel error > rtol. A passing output therefore shows the metric that decided it: ``max abs
  <= atol`` when every element is within atol, else "max abs > atol, rel <= rtol there" (the
  elements beyond atol are all within rtol). The overall max
  relative error is not shown for passing outputs: against near-zero references it is meaningless
  (fp16 logits reach 1e+13), and the verdict did not use it. The JSON report keeps every number.
* **Console** (:func:`print_console`): terminals of at least :data:`WIDE_MIN_WIDTH` columns get one
  table per section (runtime x output); narrower ones (``COLUMNS=80``) one block per output with one
  line per runtime. Runtimes are named by their short label (``onnxrt/ssmscan``, ``onnxrt/std``,
  ``trt/ssmscan``: runtime/graph flavour, m2export/names.py), expanded once in the header.
* **Commands** (:func:`command_block`): shell commands split at argument boundaries with ``\\``
  continuations, so no path is ever wrapped and the block pastes as is.
"""

from __future__ import annotations

import math
import shlex
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

import numpy as np

#: narrowest terminal that gets the wide per-section tables (their columns need about 155)
WIDE_MIN_WIDTH = 160


# ----------------------------------------------------------------------------------------------- verdicts
def verdict(passed: bool, max_abs: float, atol: float, rtol: float, failed: Sequence[str] = (),
            note: str = "", *, terse: bool = False) -> str:
    """Why an output passed or failed, in the terms of the elementwise rule (one short phrase; ``terse``
    leaves out the numbers, for tables that show them in columns)."""
    if note and (not passed or math.isnan(max_abs)):
        return note
    where = f" at {', '.join(failed[:3])}{' ...' if len(failed) > 3 else ''}" if failed else ""
    if terse:
        return ("abs <= atol" if max_abs <= atol else "rel <= rtol where abs > atol") if passed else \
            f"abs > atol and rel > rtol{where}"
    if passed:
        if max_abs <= atol:
            return f"max abs {max_abs:.2e} <= atol {atol:.0e}"
        return f"max abs {max_abs:.2e} > atol, rel <= rtol {rtol:.0e} there"
    return f"abs > atol {atol:.0e} and rel > rtol {rtol:.0e}{where} (max abs {max_abs:.2e})"


def runner_label(report, runner: str) -> str:
    """Short label (runtime/flavour) of a row's runner: the prefill runner "onnxrt:model.onnx" belongs
    to the runtime "onnxrt:model.onnx+decode.onnx"."""
    for r in report.runners:
        if runner == r["name"] or r["name"].startswith(runner + "+"):
            return r.get("label") or r["name"]
    return runner


def group_rows(rows, report=None) -> list[dict[str, Any]]:
    """Console rows: ``logits`` alone, the per-layer states grouped (worst case, pass count, verdict)."""
    groups: OrderedDict[tuple, list] = OrderedDict()
    for r in rows:
        groups.setdefault((r.section, r.runner, r.output.split(".")[0]), []).append(r)
    out = []
    for (section, runner, grp), rs in groups.items():
        n_ok = sum(r.passed for r in rs)
        worst = [r for r in rs if not r.passed]
        max_abs = math.nan if any(math.isnan(r.max_abs) for r in rs) else max(r.max_abs for r in rs)
        atol, rtol = max(r.atol for r in rs), max(r.rtol for r in rs)
        if worst:
            w = max(worst, key=lambda r: -1 if math.isnan(r.max_abs) else r.max_abs)
            layers = (f"{len(worst)}/{len(rs)} layers ({', '.join(r.output for r in worst[:3])}"
                      f"{' ...' if len(worst) > 3 else ''}): ") if len(rs) > 1 else ""
            why, terse = (layers + verdict(False, w.max_abs, w.atol, w.rtol, w.failed_iterations, w.note, terse=t)
                          for t in (False, True))
        elif all(r.max_abs <= r.atol for r in rs):
            why, terse = verdict(True, max_abs, atol, rtol), verdict(True, max_abs, atol, rtol, terse=True)
        else:
            why, terse = f"max abs {max_abs:.2e} > atol, rel <= rtol {rtol:.0e} there", "rel <= rtol where abs > atol"
        out.append({"section": section, "runner": runner,
                    "label": runner_label(report, runner) if report is not None else runner,
                    "output": rs[0].output if len(rs) == 1 else f"{grp}.* ({len(rs)} layers)",
                    "max_abs": max_abs, "mean_abs": float(np.mean([r.mean_abs for r in rs])),
                    "max_rel": math.nan if any(math.isnan(r.max_rel) for r in rs) else max(r.max_rel for r in rs),
                    "mean_rel": float(np.mean([r.mean_rel for r in rs])), "atol": atol, "rtol": rtol,
                    "passed": n_ok == len(rs), "why": why, "why_terse": terse,
                    "result": "pass" if n_ok == len(rs) else f"FAIL {len(rs) - n_ok}/{len(rs)}"})
    return out


def greedy_line(report, name: str, g: dict) -> str:
    """``greedy tokens onnxrt/std: 18/18 agree with torch (batch 2 x (prompt + 8 decode steps))``."""
    steps = report.decode_steps
    batch = g["total"] // (steps + 1) if steps + 1 and g["total"] % (steps + 1) == 0 else None
    how = f" (batch {batch} x (prompt + {steps} decode steps))" if batch else ""
    return (f"greedy tokens {runner_label(report, name)}: {g['agree']}/{g['total']} agree with {report.reference}"
            + how + (f"; {g['ties']} near-ties ignored" if g.get("ties") else "")
            + ("" if g["passed"] else f"; FAILED at {g['mismatches'][0]['where']}"))


# ----------------------------------------------------------------------------------------------- commands
def command_block(command: str | Sequence[str], width: int = 80, indent: str = "    ") -> str:
    """A shell command as lines of at most ``width`` columns, split only between arguments (a flag
    stays with its value) with `` \\`` continuations: pasted into a shell it is the same command. An
    argument longer than a line gets a line of its own (never split)."""
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    words: list[str] = []
    i = 0
    while i < len(argv):  # keep "--flag value" together
        w = shlex.quote(argv[i])
        if argv[i].startswith("-") and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            w += " " + shlex.quote(argv[i + 1])
            i += 1
        words.append(w)
        i += 1
    lines, cur = [], ""
    for w in words:
        cand = f"{cur} {w}" if cur else w
        limit = width - 2  # room for " \"
        if cur and len(cand) > limit:
            lines.append(cur)
            cur = indent + w
        else:
            cur = cand
    lines.append(cur)
    return " \\\n".join(lines)


# ----------------------------------------------------------------------------------------------- console
def _reference_words(report) -> str:
    if report.reference == "transformers":
        return "transformers fp32 logits; states from m2export's PyTorch model"
    return "PyTorch fp32 reference"


def reference_label(report) -> str:
    """What every runtime was compared with, in a few words: ``torch (PyTorch fp32 reference)``, with ``, cuTile
    kernels`` when its Mamba layers ran on them, or ``transformers (...)`` (the PASSED/FAILED line, -q too)."""
    detail = report.runners[0]["detail"] if report.runners else ""
    words = _reference_words(report) + (", Mamba layers on the cuTile kernels" if "cuTile" in detail else "")
    return f"{report.reference} ({words})"


def _header(report) -> list[str]:
    labels = [r for r in report.runners[1:]]
    out = [f"m2export check {report.outdir} ({report.dtype}): {report.reference} ({_reference_words(report)}) vs "
           + ", ".join(r.get("label") or r["name"] for r in labels)]
    width = max((len(r.get("label") or r["name"]) for r in labels), default=0)
    for r in labels:
        files = r["name"].split(":", 1)[-1].replace("+", " + ")
        out.append(f"  {(r.get('label') or r['name']):<{width}} = {r['detail'].split(',')[0]}: {files}")
    out += list(report.skipped)
    out.append("inputs: " + report.corpus + "; prefill " + ", ".join(f"{b}x{s}" for b, s in report.shapes)
               + report.continued_note())
    if report.vocab_coverage:  # the sweep can be most of the run (a 50k vocabulary): say it, and how to skip it
        out.append("vocabulary: " + report.vocab_coverage
                   + ("; 'check --no-vocab-sweep' skips the sweep" if report.vocab_sweep_inputs else ""))
    if report.decode_steps:  # a line of its own: wrapped after "; " it left the separator dangling at a line end
        out.append(f"sequence: prompt {report.prompt_len} + {report.decode_steps} decode steps")
    out.append("rule: an element fails where abs error > atol and rel error > rtol (Polygraphy elemwise)")
    return out


def print_console(report, report_dir: str | Path, console, *, json_name: str, md_name: str) -> None:
    """The check's console report on ``console`` (a rich Console): wide tables from
    :data:`WIDE_MIN_WIDTH` columns, else one block per output."""
    from rich.table import Table
    from rich.text import Text

    groups = group_rows(report.rows, report)
    for line in _header(report):  # wrapped between words, no trailing space (the inputs and vocabulary lines are long)
        _print_prose(console, line)
    wide = console.width >= WIDE_MIN_WIDTH
    for section in dict.fromkeys(g["section"] for g in groups):
        rows = [g for g in groups if g["section"] == section]
        title = f"{section}: each runtime vs {report.reference}"
        if wide:  # the title as a line of its own (a Table title is padded with spaces to the table's width)
            console.print(Text(title, style="bold"), soft_wrap=False)
            t = Table()
            for col in ("runtime", "output", "max abs", "mean abs", "atol", "rtol", "result", "why"):
                t.add_column(col, justify="right" if col in ("max abs", "mean abs", "atol", "rtol") else "left",
                             no_wrap=col != "why")
            for g in rows:
                t.add_row(g["label"], g["output"], _num(g["max_abs"]), _num(g["mean_abs"]), f"{g['atol']:.0e}",
                          f"{g['rtol']:.0e}", Text("pass", style="green") if g["passed"] else
                          Text(g["result"], style="red"), g["why_terse"])
            console.print(t)
            continue
        console.print(Text(title, style="bold"))
        lw = max(len(g["label"]) for g in rows)
        for out_name in dict.fromkeys(g["output"] for g in rows):
            console.print(Text("  " + out_name))
            grid = Table.grid(padding=(0, 2))
            grid.add_column(no_wrap=True, min_width=lw + 4)
            grid.add_column(no_wrap=True)
            grid.add_column()
            for g in rows:
                if g["output"] == out_name:
                    grid.add_row("    " + g["label"], Text("pass", style="green") if g["passed"] else
                                 Text("FAIL", style="red"), g["why"])
            console.print(grid)
    for name, g in report.greedy.items():
        _print_prose(console, greedy_line(report, name, g), style=None if g["passed"] else "red")
    for line in report.routing_lines():
        _print_prose(console, f"MoE routing, prefill {line}")
    if report.histogram:
        _print_prose(console, f"error histogram: {report.histogram}")
    _print_prose(console, f"reports: {report_dir}/{json_name}, {report_dir}/{md_name}")
    width = min(console.width, 100)
    if report.polygraphy_commands:
        _print_prose(console, reproduce_intro(report) + ":")
        console.print(Text(f"cd {shlex.quote(report.commands_dir)}"), soft_wrap=True, crop=False)
        for c in report.polygraphy_commands:
            console.print(Text(command_block(c, width=width)), soft_wrap=True, crop=False)
    if report.reproduce_note:
        _print_prose(console, f"note: {report.reproduce_note}")
    if report.tensorrt_commands:
        _print_prose(console, "with TensorRT, in the copied folder (trtexec builds the std flavour with the profile "
                              "'m2export build' uses):")
        for c in report.tensorrt_commands:
            console.print(Text(command_block(c, width=width)), soft_wrap=True, crop=False)
    if report.tensorrt_note:
        _print_prose(console, f"note: {report.tensorrt_note}")


def _print_prose(console, text: str, style: str | None = None) -> None:
    """``text`` wrapped at the console's width between words, every line without a trailing space (rich's own
    wrap of a Text keeps the space it broke at at the end of each line); a word longer than the width stays whole."""
    import textwrap

    from rich.text import Text

    for line in textwrap.wrap(text, width=console.width, break_long_words=False, break_on_hyphens=False):
        console.print(Text(line, style=style), soft_wrap=True, crop=False)


def _num(x: float) -> str:
    """A statistic for the console table: ``-`` for NaN (not a number: the verdict says why)."""
    return "-" if math.isnan(x) else f"{x:.2e}"


def reproduce_intro(report) -> str:
    """The sentence before the commands: what they compare and what they need."""
    n = report.saved.get("feeds", 0)
    return (f"reproduce anywhere (copy the folder; Polygraphy only: no m2export, torch or checkpoint): {n} saved "
            f"prefill feed(s) vs the saved {report.reference} outputs, same tolerances")
