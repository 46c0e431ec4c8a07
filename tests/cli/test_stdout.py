"""Results that cannot be written to stdout (issue 13, item 12): a reader that closes the pipe early
(``| head -c1``) and a full device (``> /dev/full``) give one error line and an exit code of the table in
m2export/errors.py, never a traceback (they were exit 70 with one: BrokenPipeError / OSError ENOSPC)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from m2export.errors import ExitCode

ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "m2export.cli.main", *map(str, args)]


def _one_error_line(err: str, expected: str) -> None:
    assert "Traceback" not in err and "internal error" not in err and "Exception ignored" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert lines == [f"error: {expected}"], err


def test_generate_into_a_pipe_closed_after_one_byte(tiny_out):
    """``m2export generate ... | head -c1``: the first write after the reader left stops the generation."""
    p = subprocess.Popen(_cli("generate", tiny_out, "--prompt", "import os\n", "--max-new-tokens", 300),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    assert p.stdout.read(1) == b"i"  # the prompt is echoed first; the new tokens follow one write each
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == ExitCode.BROKEN_PIPE == 141, err
    assert err == "", err  # a reader that leaves is no error to report: silent, as Unix tools are (was an error line)
    assert "tokens/s" not in err  # stopped there: no speed line of a finished run


@pytest.mark.parametrize("verb", ["generate", "inspect", "check"])
@pytest.mark.parametrize("verbose", [False, True])
def test_every_verb_into_a_closed_pipe_exits_141_silently(tiny_out, tmp_path, verb, verbose):
    """Every verb's stdout goes through one path (m2export/cli/main.py): a reader that closed the pipe before the
    results came is exit 141 with nothing on stderr; -v names it (one error line, then the traceback)."""
    extra = {"generate": ["--prompt", "ab", "--max-new-tokens", 3],
             "check": ["--report-dir", tmp_path, "--shapes", "1x5", "--decode-steps", 1, "--no-vocab-sweep", "-q"],
             "inspect": []}[verb] + (["-v"] if verbose else [])
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the verb writes anything
    try:
        p = subprocess.run(_cli(verb, tiny_out, *extra), stdout=w, stderr=subprocess.PIPE, env=ENV, timeout=300)
    finally:
        os.close(w)
    err = p.stderr.decode()
    assert p.returncode == ExitCode.BROKEN_PIPE, err
    if verbose:
        assert "error: stdout was closed by its reader (broken pipe): the output stopped there" in err, err
    else:
        assert "error:" not in err and "Traceback" not in err and "hint:" not in err, err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
@pytest.mark.parametrize("verb", ["generate", "inspect"])
def test_results_to_dev_full(tiny_out, verb):
    extra = ["--prompt", "ab", "--max-new-tokens", 3] if verb == "generate" else []
    with open("/dev/full", "w") as full:
        r = subprocess.run(_cli(verb, tiny_out, *extra), stdout=full, stderr=subprocess.PIPE, env=ENV,
                           timeout=300)
    err = r.stderr.decode()
    assert r.returncode == ExitCode.USER_ERROR, err
    _one_error_line(err, "cannot write the results to stdout: No space left on device")
    assert "hint: redirect stdout to a file on a device with free space" in err


@pytest.mark.parametrize("verb", ["inspect", "export"])
def test_stdout_closed_at_start(tiny_out, tiny_ck, tmp_path, verb):
    """Started with fd 1 closed ('>&-': Python's sys.stdout is None): a verb with results to print says so in one
    line (exit 1; was an AttributeError traceback, exit 70); one with nothing to print (-q export) exits 0."""
    args = {"inspect": ["inspect", tiny_out],
            "export": ["export", tiny_ck, "-o", tmp_path / "o", "-q"]}[verb]
    p = subprocess.run(_cli(*args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV, timeout=300,
                       preexec_fn=lambda: os.close(1))
    err = p.stderr.decode()
    assert "Traceback" not in err, err
    if verb == "inspect":
        assert p.returncode == 1, err
        _one_error_line(err, "cannot write the results to stdout: it is closed (the command ran with stdout shut, "
                             "e.g. '>&-')")
    else:
        assert p.returncode == 0 and err == "", err
        assert (tmp_path / "o" / "m2export.json").exists()
