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


@pytest.fixture(scope="module")
def vocab100_out(tmp_path_factory):
    """A tiny export of a 100-token vocabulary without a tokenizer: generate prints token ids."""
    from m2export.exporter import export_model
    from m2export.models.checkpoint import random_checkpoint

    d = tmp_path_factory.mktemp("v100")
    ck = random_checkpoint(d / "ck", d_model=32, n_layer=1, vocab_size=100, d_state=8, headdim=16, chunk_size=8,
                           seed=1)
    export_model(ck, d / "out", ssm_impl="ssmscan")
    return d / "out"


def _word_tokenizer(path) -> str:
    """A tokenizers WordLevel file of 256 words ``w0`` .. ``w255``: text on the tiny 256-token model that is not bytes."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = tokenizers.Tokenizer(WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path))
    return str(path)


@pytest.mark.parametrize("vocab", ["ids", "tokenizer"])
def test_generate_holding_its_results_stops_when_the_reader_leaves(tiny_out, vocab100_out, tmp_path, vocab):
    """A vocabulary that is not bytes prints its results at the end (the ids, or the text a tokenizer decodes, and
    --ids): a reader that left was noticed only then, after every token (here 10,000,000: hours). Now the next
    token after it left stops the run: exit 141, silent, as the byte vocabulary's streamed output does."""
    if vocab == "ids":
        args = [vocab100_out, "--prompt-ids", "1,2,3"]
    else:
        args = [tiny_out, "--prompt", "w1 w2", "--tokenizer", _word_tokenizer(tmp_path / "tokenizer.json"), "--ids"]
    p = subprocess.Popen(_cli("generate", *args, "--max-new-tokens", 10_000_000), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=ENV)
    p.stdout.close()  # the reader leaves before any result
    try:
        rc = p.wait(timeout=240)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise AssertionError("still generating 240 s after its reader left") from None
    err = p.stderr.read().decode()
    assert rc == ExitCode.BROKEN_PIPE, err
    assert err == "", err


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
