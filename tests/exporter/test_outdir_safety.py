"""export never deletes what it should not: the current directory, and a SIGTERM leaves no temporary folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from m2export.cli.main import main
from m2export.models.checkpoint import random_checkpoint

TINY = dict(d_model=32, n_layer=1, vocab_size=64, d_state=16, headdim=16, chunk_size=8)


def test_force_refuses_current_directory(tmp_path, monkeypatch, capsys):
    ck = random_checkpoint(tmp_path / "ck", **TINY)
    work = tmp_path / "work"
    work.mkdir()
    (work / "precious.txt").write_text("keep")
    monkeypatch.chdir(work)
    assert main(["export", str(ck), "-o", ".", "--force", "-q"]) == 1
    assert "current directory" in capsys.readouterr().err
    monkeypatch.chdir(work / "..")
    assert main(["export", str(ck), "-o", str(tmp_path), "--force", "-q"]) == 1  # an ancestor of the cwd
    assert (work / "precious.txt").read_text() == "keep"


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_leaves_nothing(tmp_path):
    ck = random_checkpoint(tmp_path / "ck", **TINY)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "m2export.cli.main", "export", str(ck), "-o", str(out), "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not any(p.name.startswith(".out.tmp-") for p in tmp_path.iterdir()):
        time.sleep(0.05)
    assert any(p.name.startswith(".out.tmp-") for p in tmp_path.iterdir()), "export never started"
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert "interrupted by SIGTERM" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"], "a temporary or partial folder was left"


@pytest.mark.parametrize("opset", ["17", "99"])
def test_opset_out_of_range_is_a_user_error(tmp_path, capsys, opset):
    ck = random_checkpoint(tmp_path / "ck", **TINY)
    assert main(["export", str(ck), "-o", str(tmp_path / "out"), "--opset", opset, "-q"]) == 1
    assert f"opset {opset}: m2export needs 18 <= opset <=" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
