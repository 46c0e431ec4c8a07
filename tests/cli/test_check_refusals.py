"""`m2export check` refuses what is not a tolerance, never replaces a report file it did not write (in OUTDIR or in
--report-dir) unless --force, and its -q line still names the reference."""

from __future__ import annotations

import json

import pytest

REPORTS_RECORD = "check_reports_written.json"  # m2export.check.compare.REPORTS_RECORD (asserted below)
from m2export.cli.main import main
from m2export.errors import ExitCode

QUICK = ["--shapes", "1x3", "--decode-steps", "1"]


@pytest.mark.parametrize("flag,value,why", [("--atol", "inf", "inf is infinite"), ("--rtol", "1e400", "1e400 is infinite"),
                                            ("--atol", "logits:nan", "nan is nan"), ("--rtol", "-1e-3", "-1e-3 is negative"),
                                            ("--atol", "1e-4,logits:-inf", "-inf is infinite")])
def test_tolerance_that_is_not_one_is_refused_first(tmp_path, capsys, flag, value, why):
    """inf would pass every element, nan and negative none: one line naming the value, the usage exit code of
    m2export.errors, before any file is read (OUTDIR does not even exist here)."""
    rc = main(["check", str(tmp_path / "nope"), f"{flag}={value}"])
    err = capsys.readouterr().err
    assert rc == ExitCode.USAGE, err
    item = value.split(",")[-1]
    assert err.strip().splitlines() == [f"error: {flag} '{item}': {why}; expected a finite number >= 0"], err


def test_quiet_line_names_the_reference(tiny_out, tmp_path, capsys):
    assert main(["check", str(tiny_out), "-q", "--report-dir", str(tmp_path / "r"), *QUICK]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"PASSED | m2export check {tiny_out} | vs torch (PyTorch fp32 "
                                               "reference) | "), out


@pytest.mark.parametrize("name", ["check_report.md", "check_inputs.json", REPORTS_RECORD])
def test_report_dir_files_m2export_did_not_write_are_refused(tiny_out, tmp_path, capsys, name):
    """A user's file of a report's name in --report-dir: refused (exit 1, one line naming it) before the run, the
    file untouched; --force replaces it. A second check into the same folder replaces its own reports; one edited
    since is refused again."""
    rep = tmp_path / "rep"
    rep.mkdir()
    (rep / name).write_text("mine\n")
    (rep / "notes.txt").write_text("unrelated\n")
    rc = main(["check", str(tiny_out), "-q", "--report-dir", str(rep), *QUICK])
    err = capsys.readouterr().err
    assert rc == ExitCode.USER_ERROR, err
    first = err.strip().splitlines()[0]
    assert first.startswith(f"error: --report-dir {rep}: holds file(s) m2export check did not write") and name in first
    assert "--force" in err and "Traceback" not in err
    assert (rep / name).read_text() == "mine\n" and not (rep / "check_report.json").exists()
    assert main(["check", str(tiny_out), "-q", "--report-dir", str(rep), "--force", *QUICK]) == 0
    assert (rep / "check_report.md").read_text().startswith("# m2export check: PASSED")
    from m2export.check.compare import REPORTS_RECORD as record

    assert record == REPORTS_RECORD and json.loads((rep / record).read_text())["written_by"] == "m2export check"
    assert main(["check", str(tiny_out), "-q", "--report-dir", str(rep), *QUICK]) == 0  # its own: replaced
    (rep / "check_report.json").write_text("{}\n")  # edited since
    capsys.readouterr()
    assert main(["check", str(tiny_out), "-q", "--report-dir", str(rep), *QUICK]) == ExitCode.USER_ERROR
    assert "check_report.json" in capsys.readouterr().err.splitlines()[0]
    assert (rep / "notes.txt").read_text() == "unrelated\n"


@pytest.mark.parametrize("values,shown", [(["--atol", "1e-3,1e-4"], "'1e-3', '1e-4'"),
                                          (["--rtol", "1e-3", "--rtol", "logits:1e-2,2e-3"], "'1e-3', '2e-3'")])
def test_two_default_tolerances_are_refused(tmp_path, capsys, values, shown):
    """Two VALUEs without a NAME: one would silently win; refused (exit 2) before any file is read."""
    rc = main(["check", str(tmp_path / "nope"), *values])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == ExitCode.USAGE, err
    assert err[0] == f"error: {values[0]} {shown}: more than one default value", err


@pytest.mark.parametrize("values,shown", [
    (["--atol", "logits:1e-30,logits:1"], "--atol 'logits:1e-30' and 'logits:1': two tolerances for output 'logits'"),
    (["--rtol", "present_ssm_state.*:1", "--rtol", "present_ssm_state.1:2"],
     "--rtol 'present_ssm_state.*:1' and 'present_ssm_state.1:2': two tolerances for output 'present_ssm_state.1'")])
def test_two_tolerances_for_one_output_are_refused(tiny_out, tmp_path, capsys, values, shown):
    """The later NAME:VALUE won silently (--atol logits:1e-30,logits:1 checked logits at 1): one line naming the flag,
    both values and the output, exit 1 (it takes the export's output names), before the reference runs."""
    rc = main(["check", str(tiny_out), *values, "--report-dir", str(tmp_path / "r"), *QUICK])
    out, err = capsys.readouterr()
    assert rc == ExitCode.USER_ERROR, err
    assert err.strip().splitlines()[0] == f"error: {shown}", err
    assert out == "" and not (tmp_path / "r").exists()


@pytest.mark.parametrize("flag,value,shown", [
    ("--shapes", "", "--shapes '': empty value; expected BATCHxSEQLEN with positive integers, e.g. 1x1,2x64"),
    ("--atol", "", "--atol '': empty value"), ("--rtol", " ", "--rtol ' ': empty value")])
def test_an_empty_list_flag_is_refused(tmp_path, capsys, flag, value, shown):
    """--shapes '' (or --atol '') ran the defaults as if the flag were absent: refused in one line (exit 2) before
    any file is read (OUTDIR does not exist)."""
    rc = main(["check", str(tmp_path / "nope"), flag, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == ExitCode.USAGE, err
    assert err[0] == f"error: {shown}", err


def test_run_check_refuses_no_shapes(tmp_path):
    """The library's shapes=[] ran the defaults too (those are shapes=None)."""
    from m2export.check.compare import run_check
    from m2export.errors import UsageError

    with pytest.raises(UsageError, match=r"^shapes \[\]: no size; expected BATCHxSEQLEN"):
        run_check(tmp_path / "nope", shapes=[])


def test_empty_tolerance_item_is_refused(tmp_path, capsys):
    rc = main(["check", str(tmp_path / "nope"), "--atol", "logits:1e-3,,1e-4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == ExitCode.USAGE and err[0] == "error: --atol 'logits:1e-3,,1e-4': empty item at position 2", err
