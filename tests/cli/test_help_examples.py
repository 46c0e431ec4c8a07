"""Every verb's --help examples work when pasted in order into a shell in an empty directory (random-checkpoint
makes the checkpoint the later ones use); the TensorRT ones are skipped here with the reason."""

from __future__ import annotations

import shlex

import pytest

from m2export.backends import tensorrt_unavailable_reason
from m2export.cli.main import build_parser, main

ORDER = ["random-checkpoint", "export", "build", "check", "generate", "inspect"]  # as a user meets them


def _examples() -> list[str]:
    subs = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    assert sorted(subs.choices) == sorted(ORDER)
    out = []
    for verb in ORDER:
        desc = subs.choices[verb].description
        assert "examples:\n" in desc, verb
        lines = desc.split("examples:\n", 1)[1].splitlines()
        cmds = [ln.strip() for ln in lines if ln.startswith("  m2export ")]
        assert cmds and all(shlex.split(c, comments=True)[1] == verb for c in cmds), verb
        out += cmds
    return out


def _needs_tensorrt(cmd: str) -> bool:
    argv = shlex.split(cmd, comments=True)
    runtime = argv[argv.index("--runtime") + 1] if "--runtime" in argv else None
    return argv[1] == "build" or runtime == "trt" or any(a.endswith(".plan") for a in argv)


EXAMPLES = _examples()
TRT = [c for c in EXAMPLES if _needs_tensorrt(c)]


def test_help_examples_run_in_order(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for cmd in EXAMPLES:
        if _needs_tensorrt(cmd) and tensorrt_unavailable_reason():
            # not run here (test_help_examples_with_tensorrt says why), but what it reads must exist at this point
            # of the order (an engine excepted: only a build makes one), or it fails where TensorRT is installed
            source = shlex.split(cmd, comments=True)[2]
            assert source.endswith(".plan") or (tmp_path / source).exists(), f"{cmd}: {source} does not exist"
            continue
        rc = main(shlex.split(cmd, comments=True)[1:])
        out, err = capsys.readouterr()
        assert rc == 0, f"{cmd}\n{err[-2000:]}"
        assert "deprecated" not in err, cmd  # the examples use the current names


@pytest.mark.parametrize("cmd", TRT)
def test_help_examples_with_tensorrt(cmd):
    why = tensorrt_unavailable_reason()
    if why:
        pytest.skip(f"{why}: '{cmd}' needs TensorRT and a GPU")
    pytest.skip("runs inside test_help_examples_run_in_order where TensorRT is usable")
