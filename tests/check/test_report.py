"""How the check reads (m2export/check/report.py): an 80-column layout (one block per output, one line per
runtime) and the wide table from 120 columns; passing rows show the metric the verdict used, never an
alarming relative error against near-zero references; commands are copyable blocks split between arguments."""

from __future__ import annotations

import io
import math
import re
import shlex

import pytest
from rich.console import Console

from m2export.check.compare import CheckReport, OutputRow
from m2export.check.report import WIDE_MIN_WIDTH, command_block, group_rows, print_console, verdict
from m2export.cli.main import main

QUICK = ["--shapes", "1x3,2x17", "--decode-steps", "2"]


def _check_stdout(tiny_out, tmp_path, capsys, monkeypatch, columns: int) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["check", str(tiny_out), *QUICK, "--report-dir", str(tmp_path)]) == 0
    return capsys.readouterr().out


def test_check_fits_80_columns(tiny_out, tmp_path, capsys, monkeypatch):
    out = _check_stdout(tiny_out, tmp_path, capsys, monkeypatch, 80)
    lines = out.splitlines()
    # the PASSED line (one line, Polygraphy's format, naming OUTDIR) and command blocks may be longer
    prose = [ln for ln in lines if not ln.rstrip().endswith("\\") and not ln.startswith(("polygraphy", "    --",
                                                                                          "PASSED"))]
    assert all(len(ln) <= 80 for ln in prose), [ln for ln in prose if len(ln) > 80]
    assert "…" not in out and "┃" not in out  # nothing cut short, no wide table
    # one block per output, one line per runtime, each naming its verdict's metric
    for section in ("prefill", "sequence"):
        body = out.split(f"{section}: each runtime vs torch", 1)[1]
        for group in ("logits", "present_conv_state.* (2 layers)", "present_ssm_state.* (2 layers)"):
            block = body.split(f"\n  {group}\n", 1)[1].splitlines()[:2]
            assert re.fullmatch(r"    onnxrt/ssmscan  pass  max abs \S+ <= atol 1e-04", block[0]), block
            assert re.fullmatch(r"    onnxrt/std      pass  max abs \S+ <= atol 1e-04", block[1]), block
    assert re.search(r"onnxrt/std     = ONNX Runtime CPU: model\.std\.onnx\n", out), out  # one graph per flavour
    assert "max rel" not in out
    assert re.search(r"greedy tokens onnxrt/std: 6/6 agree with torch \(batch 2 x \(prompt \+ 2 decode\s+steps\)\)",
                     out)
    assert out.splitlines()[-1].startswith("PASSED | m2export check")


def test_check_wide_table_on_wide_terminals(tiny_out, tmp_path, capsys, monkeypatch):
    out = _check_stdout(tiny_out, tmp_path, capsys, monkeypatch, 200)
    header = next(ln for ln in out.splitlines() if "max abs" in ln and "┃" in ln)
    assert [c.strip() for c in header.strip("┃ ").split("┃")] == [
        "runtime", "output", "max abs", "mean abs", "atol", "rtol", "result", "why"]
    assert "│ onnxrt/std     │ logits" in out and "…" not in out


def _row(max_abs, max_rel, passed, output="logits", failed=()):
    return OutputRow("prefill", "onnxrt:model.onnx", "torch", output, 2, max_abs, max_abs / 10, max_rel, 1e-3,
                     5e-2, 1e-2, passed, list(failed))


def _report(rows):
    return CheckReport(outdir="out", dtype="fp16", reference="torch",
                       runners=[{"name": "torch", "detail": "PyTorch", "label": "torch"},
                                {"name": "onnxrt:model.onnx+decode.onnx", "detail": "ONNX Runtime CPU, ssm_impl=ssmscan",
                                 "label": "onnxrt/ssmscan"}],
                       skipped=[], shapes=[[1, 3]], decode_steps=0, prompt_len=0, atol={"": 5e-2},
                       rtol={"": 1e-2}, rows=rows, greedy={})


@pytest.mark.parametrize("width", [80, WIDE_MIN_WIDTH])
def test_passing_rows_show_the_metric_the_verdict_used(width):
    """fp16 logits: a near-zero reference gives max rel 2.4e+13 on a passing row; the console says why the
    row passed (max abs within atol, or beyond it only where the relative error is within rtol)."""
    rows = [_row(3.1e-2, 2.4e13, True),
            _row(6.0e-2, 2.4e13, True, output="present_conv_state.0"),
            _row(0.5, 3.0, False, output="present_ssm_state.0", failed=["2x17"])]
    buf = io.StringIO()
    print_console(_report(rows), "out", Console(file=buf, width=width, highlight=False), json_name="r.json",
                  md_name="r.md")
    out = re.sub(r"\s+", " ", buf.getvalue())  # the why column may wrap at 80 columns
    assert "2.40e+13" not in out and "2.4e+13" not in out and "…" not in out
    if width < WIDE_MIN_WIDTH:
        assert "max abs 3.10e-02 <= atol 5e-02" in out
        assert "max abs 6.00e-02 > atol, rel <= rtol 1e-02 there" in out
        assert "abs > atol 5e-02 and rel > rtol 1e-02 at 2x17 (max abs 5.00e-01)" in out
    else:  # the numbers are in their columns
        assert "│ 3.10e-02 │" in out and "│ abs <= atol │" in out
        assert "│ rel <= rtol where abs > atol │" in out and "│ abs > atol and rel > rtol at 2x17 │" in out
    md = _report(rows).to_markdown()
    assert "2.4" not in md.split("## Per output", 1)[1] and "> atol, rel <= rtol 1e-02 there" in md


def test_verdicts():
    assert verdict(True, 1e-7, 1e-4, 1e-3) == "max abs 1.00e-07 <= atol 1e-04"
    assert verdict(False, math.nan, 1e-4, 1e-3, note="output missing from this runtime") == \
        "output missing from this runtime"
    g = group_rows([_row(1e-2, 5.0, True, "present_ssm_state.0"), _row(6e-2, 5.0, True, "present_ssm_state.1")])
    assert g[0]["output"] == "present_ssm_state.* (2 layers)" and "> atol, rel <= rtol" in g[0]["why"]


@pytest.mark.parametrize("width", [60, 80, 100])
def test_command_block_splits_between_arguments(width):
    argv = ["polygraphy", "run", "model.std.onnx", "--onnxrt", "--load-inputs", "check_inputs.json",
            "--load-outputs", "check_reference_outputs.json", "--atol", "logits:0.05", "0.05", "--rtol", "0.01",
            "--check-error-stat", "elemwise", "--data-loader-script", "/a/very/long/" + "x" * 70 + "/dl.py:load_data"]
    block = command_block(argv, width=width)
    assert shlex.split(block.replace("\\\n", " ")) == argv  # a shell joins the continuations: the same command
    for ln in block.splitlines():
        toks = shlex.split(ln.rstrip("\\"))
        assert len(ln) <= width or len(toks) <= 2, ln  # only a single over-long argument may overflow
    assert "--load-inputs check_inputs.json" in block  # a flag stays with its value


def test_wrapped_notes_keep_no_trailing_space():
    """The console's 'note:' lines wrapped at the terminal width: each line ended with the space it was broken at
    ("... 'm2export build OUTDIR --plugin aot' there, " on the 130m check). Now no line ends with a space, every
    line fits the width, and the words are the note's, in order."""
    rep = _report([_row(1e-5, 1e-4, True)])
    rep.reproduce_note = ("graphs with SSMScan nodes build with the m2export::SSMScan plugin (a Python plugin: no "
                          "library for trtexec): 'm2export build OUTDIR --plugin aot' there, after which the AOT engine "
                          "runs in trtexec and polygraphy without m2export")
    rep.tensorrt_note = "TensorRT is not installed here: " + " ".join(["the engines are built elsewhere"] * 6)
    for width in (80, 101, WIDE_MIN_WIDTH):
        buf = io.StringIO()
        print_console(rep, "out", Console(file=buf, width=width, highlight=False), json_name="r.json", md_name="r.md")
        text = buf.getvalue()
        notes = text[text.index("note: "):].splitlines()
        assert len(notes) > 2 and all(ln == ln.rstrip() and len(ln) <= width for ln in notes), notes
        assert " ".join(notes) == f"note: {rep.reproduce_note} note: {rep.tensorrt_note}"
