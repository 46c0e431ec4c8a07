"""`m2export check` through the CLI entry point: output, exit codes and error paths."""

from __future__ import annotations

import json

import pytest

from m2export.cli.main import main
from tests.check.exports import copy_export, record_engine, set_ssm_scan_attribute, zero_graph_input
from tests.helpers import assert_usage_error

QUICK = ["--shapes", "1x5,2x17", "--decode-steps", "2"]


def test_check_pass(tiny_out, tmp_path, capsys):
    rc = main(["check", str(tiny_out), "--report-dir", str(tmp_path), *QUICK])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "skipped: TensorRT" in out or "TensorRT: skipped" in out
    assert "= ONNX Runtime CPU: model.onnx\n" in out and "onnxrt/std" in out and "decode.onnx" not in out
    assert "present_ssm_state.* (2 layers)" in out
    assert "polygraphy run" in out and "--load-inputs check_inputs.json" in out
    assert out.strip().splitlines()[-1].startswith("PASSED | m2export check")
    assert json.loads((tmp_path / "check_report.json").read_text())["passed"] is True


def test_check_quiet_and_tolerance_override(tiny_out, tmp_path, capsys):
    rc = main(["check", str(tiny_out), "--report-dir", str(tmp_path), "-q", "--atol", "1e-5", "--atol", "logits:2e-4",
               "--rtol", "present_ssm_state.*:1e-2", *QUICK])
    out, _ = capsys.readouterr()
    assert rc == 0 and out.strip().startswith("PASSED") and len(out.strip().splitlines()) == 1
    rep = json.loads((tmp_path / "check_report.json").read_text())
    assert rep["atol"] == {"": 1e-5, "logits": 2e-4}
    assert rep["rtol"]["present_ssm_state.1"] == 1e-2


def test_check_tampered_exit_3(tiny_out, tmp_path, capsys):
    out_dir = copy_export(tiny_out, tmp_path / "t")
    set_ssm_scan_attribute(out_dir / "model.onnx", "dt_softplus", 0)
    rc = main(["check", str(out_dir), "-q", *QUICK])
    out, err = capsys.readouterr()
    assert rc == 3
    assert out.strip().startswith("FAILED | m2export check")
    first = err.strip().splitlines()[0]
    assert first.startswith("error: accuracy check failed:") and "onnxrt:model.onnx: present_ssm_state.0" in first
    assert "hint:" in err and "Traceback" not in err


@pytest.mark.parametrize("state,op_type", [("past_ssm_state", "SSMScan"), ("past_conv_state", "CausalConv1d")])
def test_check_prefill_ignoring_past_states_exit_3(tiny_out, tmp_path, capsys, state, op_type):
    """SSMScan's initial_state (or the conv's past inputs) replaced by zeros in model.onnx: a graph that is
    right only for fresh sequences. The check feeds continued sequences too, so it fails (exit 3), naming
    the outputs."""
    out_dir = copy_export(tiny_out, tmp_path / "t")
    for i in range(2):
        assert zero_graph_input(out_dir / "model.onnx", f"{state}.{i}", op_type) == 1
    rc = main(["check", str(out_dir), "-q", "--shapes", "1x5,2x17", "--decode-steps", "0"])
    out, err = capsys.readouterr()
    assert rc == 3, err
    assert out.strip().startswith("FAILED | m2export check")
    first = err.strip().splitlines()[0]
    assert first.startswith("error: accuracy check failed:") and "prefill onnxrt:model.onnx: logits" in first
    assert "present_ssm_state.1" in (out_dir / "check_report.md").read_text()
    assert "model.std.onnx" not in first and "Traceback" not in err


@pytest.mark.parametrize("case", ["missing_dir", "file_not_dir", "no_manifest", "missing_graph", "bad_tol",
                                  "missing_engine", "trt_required"])
def test_check_errors(case, tiny_out, tmp_path, capsys):
    args = ["check"]
    code, msg = 1, None
    if case == "missing_dir":
        args.append(str(tmp_path / "nope"))
        msg = "nope: does not exist"  # was "not a directory"
    elif case == "file_not_dir":
        args.append(str(tiny_out / "model.onnx"))
        msg = "model.onnx: not a directory"
    elif case == "no_manifest":
        args.append(str(tmp_path))
        msg = "m2export.json: missing"
    else:
        d = copy_export(tiny_out, tmp_path / "o")
        args.append(str(d))
        if case == "missing_graph":
            (d / "model.std.onnx").unlink()
            msg = "model.std.onnx: std graph listed in m2export.json is missing"
        elif case == "bad_tol":
            args += ["--atol", "logitz:1"]
            msg = "--atol 'logitz:1': no output named 'logitz'"
        else:
            record_engine(d, [], payload=None if case == "missing_engine" else b"x")
            if case == "missing_engine":
                msg = "model.plan: prefill TensorRT engine listed in m2export.json is missing"
            else:
                args += ["--runtime", "trt"]
                code, msg = 4, "TensorRT is not installed"
    rc = main(args + QUICK)
    err = capsys.readouterr().err
    assert rc == code, err
    lines = err.strip().splitlines()
    assert lines[0].startswith("error: ") and msg in lines[0], err
    assert lines[1].startswith("hint: ") or case == "bad_tol"
    assert "Traceback" not in err


@pytest.mark.parametrize("args,msg", [(["--prompt-len", "-3"], "argument --prompt-len: -3: expected an integer >= 1"),
                                      (["--prompt-len", "0"], "argument --prompt-len: 0: expected an integer >= 1"),
                                      (["--max-seq-len", "0"], "argument --max-seq-len: 0: expected an integer >= 1"),
                                      (["--decode-steps", "-1"], "argument --decode-steps: -1: expected an integer >= 0"),
                                      (["--seed", "-1"], "argument --seed: -1: expected an integer >= 0")])
def test_check_bad_numbers_are_usage_errors(tiny_out, capsys, args, msg):
    """Out-of-range numbers are argparse errors (exit 2, one line), not a conv1d RuntimeError (exit 70)."""
    assert_usage_error(["check", str(tiny_out), *args], msg, capsys)


@pytest.mark.parametrize("where", ["proc", "file", "under_file"])
def test_check_unwritable_report_dir(tiny_out, tmp_path, capsys, where):
    """--report-dir that cannot be created or written: exit 1 with one line, before the comparison runs."""
    (tmp_path / "f").write_text("")
    target = {"proc": "/proc/m2export-nope", "file": str(tmp_path / "f"), "under_file": str(tmp_path / "f" / "d")}
    rc = main(["check", str(tiny_out), "--report-dir", target[where], *QUICK])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 1, err
    assert lines[0].startswith(f"error: --report-dir {target[where]}: cannot write the check reports there (")
    assert lines[1].startswith("hint: ") and "Traceback" not in err and "PASSED" not in out


def test_check_help_lists_default_tolerances_of_every_dtype(capsys, monkeypatch):
    """--help shows the defaults of every export dtype (bf16 included), rendered from the table the check
    uses (m2export.check.tolerances), not restated by hand."""
    import m2export.check.tolerances as T

    def help_text():
        with pytest.raises(SystemExit):
            main(["check", "--help"])
        return capsys.readouterr().out

    out = help_text()
    for dtype in ("fp32", "fp16", "bf16"):
        atol, rtol = T.default_tolerances(dtype)
        line = next(ln for ln in out.splitlines() if ln.split()[:1] == [dtype])
        assert line.split() == [dtype, "atol", T.format_tolerance(atol[""]), "rtol", T.format_tolerance(rtol[""])]
    assert "bf16  atol 1e-1    rtol 5e-2" in out and "@" not in out
    monkeypatch.setitem(T.DEFAULT_RTOL, "bf16", 0.07)
    assert "bf16  atol 1e-1    rtol 7e-2" in help_text()


def test_cli_parser_does_not_import_the_tolerance_table():
    """Building the parser (every m2export command) stays cheap: the table is read only for --help."""
    import subprocess
    import sys

    code = ("import sys; from m2export.cli.main import build_parser; build_parser(); "
            "assert 'm2export.check.tolerances' not in sys.modules and 'numpy' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def _check_into_outdir(d) -> int:
    return main(["check", str(d), "-q", "--shapes", "1x3", "--decode-steps", "0"])


@pytest.mark.parametrize("whose", ["user", "edited"])
def test_check_never_replaces_a_report_it_did_not_write(tiny_out, tmp_path, capsys, whose):
    """check_report.md in the export folder that m2export did not write (a user's own), or one it wrote and the user
    edited since: check refuses before the run, in export --force's terms (one line + hint, exit 1), and writes
    nothing; its own reports, unchanged since, it replaces (m2export.json's 'files' sha256 says which are which)."""
    from m2export.errors import ExitCode

    d = copy_export(tiny_out, tmp_path / "o")
    md = d / "check_report.md"
    if whose == "edited":
        assert _check_into_outdir(d) == 0  # its own reports, recorded
        capsys.readouterr()
        assert _check_into_outdir(d) == 0  # replaced: they are m2export's
        capsys.readouterr()
        md.write_text(md.read_text() + "\nmy notes\n")
    else:
        md.write_text("my notes\n")
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    assert _check_into_outdir(d) == ExitCode.USER_ERROR
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    why = ("holds file(s) m2export did not write (check_report.md)" if whose == "user"
           else "holds file(s) changed since m2export wrote them (check_report.md)")
    assert len(lines) == 2 and "Traceback" not in cap.err, cap.err
    assert lines[0] == f"error: {d}: {why}; check replaces only the reports it wrote", lines[0]
    assert lines[1].startswith("hint: ") and "--report-dir" in lines[1]
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before  # nothing written, nothing replaced


def test_check_refuses_a_report_that_appears_while_it_runs(tiny_out, tmp_path, capsys, monkeypatch):
    """A check_report.md written into the folder while the comparison runs is not replaced either (checked again
    right before the reports are written): nothing is written."""
    from m2export.check import compare

    d = copy_export(tiny_out, tmp_path / "o")
    real = compare.build_runtimes

    def meanwhile(*a, **k):
        (d / "check_report.md").write_text("mine\n")
        return real(*a, **k)

    monkeypatch.setattr(compare, "build_runtimes", meanwhile)
    assert _check_into_outdir(d) == 1
    assert "holds file(s) m2export did not write (check_report.md)" in capsys.readouterr().err
    assert (d / "check_report.md").read_text() == "mine\n"
    assert not any(p.name.startswith("check_") and p.name != "check_report.md" for p in d.iterdir())


def test_check_names_the_vocabulary_sweep_and_skips_it_on_request(tiny_out, tmp_path, capsys):
    """The vocabulary sweep (every token id fed once; ~25 minutes of a 130m check on 2 cores) is named on stdout with
    its inputs and why, --help describes it, and --no-vocab-sweep (a plain switch: no value, no abbreviation) skips
    it: fewer inputs, and the report says which ids were fed instead."""
    rc = main(["check", str(tiny_out), "--report-dir", str(tmp_path / "a"), *QUICK])
    out, err = capsys.readouterr()
    assert rc == 0, err
    line = " ".join(out.split("\nvocabulary: ", 1)[1].split("\nsequence: ")[0].split())
    assert "vocabulary sweep of 1 input(s)" in line and "so that every embedding row is exercised" in line, line
    assert line.endswith("'check --no-vocab-sweep' skips the sweep"), line
    with_sweep = json.loads((tmp_path / "a" / "check_report.json").read_text())
    assert with_sweep["vocab_sweep_inputs"] == 1

    rc = main(["check", str(tiny_out), "--report-dir", str(tmp_path / "b"), "--no-vocab-sweep", *QUICK])
    out, err = capsys.readouterr()
    assert rc == 0, err
    line = " ".join(out.split("\nvocabulary: ", 1)[1].split("\nsequence: ")[0].split())
    assert "no vocabulary sweep" in line and "--no-vocab-sweep" not in line, line
    rep = json.loads((tmp_path / "b" / "check_report.json").read_text())
    assert rep["vocab_sweep_inputs"] == 0 and "no vocabulary sweep" in rep["vocab_coverage"]
    assert ({r["iterations"] for r in rep["rows"] if r["section"] == "prefill"} == {4}  # 1x5, 2x17: fresh + continued
            and {r["iterations"] for r in with_sweep["rows"] if r["section"] == "prefill"} == {5})
    assert "no vocabulary sweep" in (tmp_path / "b" / "check_report.md").read_text()

    with pytest.raises(SystemExit):
        main(["check", "--help"])
    assert "--no-vocab-sweep" in capsys.readouterr().out.split("Reference and runtimes")[0]  # in the description too
    assert_usage_error(["check", str(tiny_out), "--no-vocab-sweep=1"], "ignored explicit argument '1'", capsys)
    assert_usage_error(["check", str(tiny_out), "--no-vocab"], "unrecognized arguments: --no-vocab", capsys)


@pytest.mark.parametrize("columns", [None, "80"])
def test_check_console_lines_never_end_in_a_space(tiny_out, tmp_path, capsys, monkeypatch, columns):
    """Every prose line of the console report (header, greedy lines, 'reproduce anywhere ...', notes) wraps between
    words with no trailing space: rich's own wrap of a long Text left the space it broke at at the line end
    ("... 'm2export build OUTDIR --plugin aot' there, " then "after which ..."), at 160 columns (a pipe) and at 80."""
    if columns:
        monkeypatch.setenv("COLUMNS", columns)
    else:
        monkeypatch.delenv("COLUMNS", raising=False)
    rc = main(["check", str(tiny_out), "--report-dir", str(tmp_path), *QUICK])
    out, err = capsys.readouterr()
    assert rc == 0, err
    width = int(columns or 160)
    assert [ln for ln in out.splitlines() if ln != ln.rstrip()] == []
    assert "after which the AOT engine runs in trtexec" in " ".join(out.split())
    prose = [ln for ln in out.splitlines() if not ln.startswith(("polygraphy ", "trtexec ", "    ", "cd ", "PASSED "))]
    assert all(len(ln) <= width for ln in prose if " " in ln), [ln for ln in prose if len(ln) > width]
