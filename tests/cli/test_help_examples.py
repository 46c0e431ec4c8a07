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
    return ((argv[1] == "build" and "--skip-if-unavailable" not in argv) or runtime == "trt"
            or any(a.endswith(".plan") for a in argv))


def _comment(cmd: str) -> str:
    return cmd.split("#", 1)[1] if "#" in cmd else ""


EXAMPLES = _examples()
TRT = [c for c in EXAMPLES if _needs_tensorrt(c)]


def test_examples_that_a_plain_cpu_install_cannot_run_say_what_they_need():
    """README: the examples work pasted in order, except those marked with what they need; a plain CPU install
    (no TensorRT, no test extra) failed 6 of them unmarked: the builds and 'check --runtime trt' (exit 4),
    'check --reference transformers' (exit 4 without transformers), 'inspect .../model.plan' (exit 1 before a build).
    build --help also shows --skip-if-unavailable, the build that exits 0 where TensorRT is missing."""
    for cmd in TRT:
        assert "needs TensorRT" in _comment(cmd), cmd
    for cmd in EXAMPLES:
        argv = shlex.split(cmd, comments=True)
        if "--reference" in argv and argv[argv.index("--reference") + 1] == "transformers":
            assert "needs transformers" in _comment(cmd), cmd
        if argv[-1].endswith(".plan"):
            assert "after 'm2export build" in _comment(cmd), cmd
    assert any(shlex.split(c, comments=True)[1:] == ["build", "out/tiny", "--skip-if-unavailable"] for c in EXAMPLES)


def test_help_examples_run_in_order(tmp_path, monkeypatch, capsys):
    """In order in an empty directory, as on a plain CPU install (transformers hidden: it is the test extra's): every
    unmarked example exits 0; one marked 'needs transformers' exits 4 without it (and 0 with it, where installed);
    one marked 'needs TensorRT' exits 4 without TensorRT (or runs where it is usable)."""
    import importlib.util
    import sys

    monkeypatch.chdir(tmp_path)
    has_transformers = importlib.util.find_spec("transformers") is not None
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError, as on a plain install
    for cmd in EXAMPLES:
        argv = shlex.split(cmd, comments=True)[1:]
        if _needs_tensorrt(cmd) and tensorrt_unavailable_reason():
            # not run here (test_help_examples_with_tensorrt says why), but what it reads must exist at this point
            # of the order (an engine excepted: only a build makes one), or it fails where TensorRT is installed
            source = argv[1]
            assert source.endswith(".plan") or (tmp_path / source).exists(), f"{cmd}: {source} does not exist"
            assert main(argv) == (1 if source.endswith(".plan") else 4), cmd  # as its comment says (no engine: 1)
            capsys.readouterr()
            continue
        needs_transformers = "needs transformers" in _comment(cmd)
        if needs_transformers:
            assert main(argv) == 4, cmd
            capsys.readouterr()
            if not has_transformers:
                continue
            del sys.modules["transformers"]  # installed here: the example runs too
        rc = main(argv)
        if needs_transformers:
            sys.modules["transformers"] = None
        out, err = capsys.readouterr()
        assert rc == 0, f"{cmd}\n{err[-2000:]}"
        assert "deprecated" not in err, cmd  # the examples use the current names


@pytest.mark.parametrize("cmd", TRT)
def test_help_examples_with_tensorrt(cmd):
    why = tensorrt_unavailable_reason()
    if why:
        pytest.skip(f"{why}: '{cmd}' needs TensorRT and a GPU")
    pytest.skip("runs inside test_help_examples_run_in_order where TensorRT is usable")
