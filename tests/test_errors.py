"""Exit codes and error messages have one home (m2export/errors.py), and the CLI maps library parameters to
its flags: the table is the one --help and the README print, internal invariants exit 70, library messages
name parameters (never CLI flags), and one function decides whether TensorRT is usable."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from m2export import backends
from m2export.cli.main import build_parser, main
from m2export.errors import (BackendUnavailable, ExitCode, InternalError, M2ExportError, ParameterError,
                             exit_codes_text, render)

ROOT = Path(__file__).resolve().parents[1]


def test_exit_code_table_is_what_help_and_readme_print(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for code in ExitCode:
        assert f"  {int(code)} {code.meaning}" in out
    readme = (ROOT / "README.md").read_text()
    assert "* " + exit_codes_text("\n* ") in readme.split("## Exit codes", 1)[1]  # one code per bullet


def test_verb_help_names_only_codes_of_the_table():
    subs = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    known = {int(c) for c in ExitCode}
    for verb, p in subs.choices.items():
        desc = p.description or ""
        if "exit codes:" not in desc:
            continue
        text = desc.split("exit codes:", 1)[1].split("\n\n", 1)[0]
        used = {int(n) for n in re.findall(r"(?:^|[:;] )(\d+) ", text)}
        assert used and used <= known, (verb, used - known)


def test_render_python_and_cli_forms():
    msg = "`text` /x: no such file; pass `force=True` or `plugin='jit'`"
    assert render(msg) == "text /x: no such file; pass force=True or plugin='jit'"
    flags = {"text": "--text", "force": "--force", "plugin": "--plugin"}.get
    assert render(msg, flags) == "--text /x: no such file; pass --force or --plugin jit"
    assert render("`other` 3", flags) == "other 3"  # no flag known: the Python name
    e = ParameterError("`seed` -1: expected >= 0", hint="omit `seed`")
    assert str(e) == "seed -1: expected >= 0" and e.hint == "omit seed"


def test_cli_maps_library_parameters_to_its_flags(tiny_out, tmp_path, capsys):
    rc = main(["check", str(tiny_out), "--text", str(tmp_path / "missing.txt"), "--report-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == ExitCode.USER_ERROR
    assert err.startswith(f"error: --text {tmp_path / 'missing.txt'}: no such file"), err
    assert "hint: pass a UTF-8 text file, or omit --text" in err and "`" not in err
    rc = main(["check", str(tiny_out), "--atol", "logit:1", "--report-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("error: --atol 'logit:1': no output named 'logit'"), err
    assert "\nhint: the outputs are logits, " in err, err  # one hint, no 'hint: Note:' stutter


def test_internal_invariant_exits_70_with_traceback(monkeypatch, tmp_path, capsys):
    import m2export.inspect as insp

    def broken(path):
        raise InternalError("an invariant does not hold")

    monkeypatch.setattr(insp, "describe", broken)
    assert main(["inspect", str(tmp_path)]) == ExitCode.INTERNAL == 70
    err = capsys.readouterr().err
    assert "Traceback" in err and "InternalError: an invariant does not hold" in err and "this is a bug" in err


def test_error_types_carry_their_exit_codes():
    assert M2ExportError("x").exit_code == 1
    assert BackendUnavailable("x").exit_code == 4
    assert InternalError("x").exit_code == 70


_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z-]*")


def _error_strings(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name.endswith(("Error", "Unavailable")):
                for n in ast.walk(node):
                    if isinstance(n, ast.Constant) and isinstance(n.value, str):
                        yield node.lineno, n.value


def test_library_messages_do_not_name_cli_flags():
    """Outside m2export/cli/, error messages name parameters in backquotes (the CLI maps them to flags);
    a flag may appear only inside a whole 'm2export VERB ...' command given as a recipe."""
    bad = []
    for p in sorted((ROOT / "m2export").rglob("*.py")):
        if "cli" in p.relative_to(ROOT / "m2export").parts:
            continue
        for line, s in _error_strings(p):
            if _FLAG.search(s) and "m2export " not in s:
                bad.append(f"{p.relative_to(ROOT)}:{line}: {s!r}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("why", ["TensorRT 10.3.0 is too old: m2export needs >= 10.7 (...)", "no CUDA GPU"])
def test_one_tensorrt_check_for_every_verb(why, tiny_out, monkeypatch, capsys):
    """Patching backends.tensorrt_unavailable_reason changes what build, check, generate and the plugin
    registration say: there is one check."""
    from m2export import plugins
    from m2export.trt.build import require_tensorrt

    monkeypatch.setattr(backends, "tensorrt_unavailable_reason", lambda **kw: why)
    with pytest.raises(BackendUnavailable, match=re.escape(why)):
        require_tensorrt()
    with pytest.raises(BackendUnavailable, match=re.escape(why)):
        plugins.register()
    for argv in (["generate", str(tiny_out), "--prompt", "x", "--runtime", "trt"],
                 ["check", str(tiny_out), "--runtime", "trt", "--shapes", "1x2", "--decode-steps", "0"]):
        assert main(argv) == ExitCode.BACKEND_UNAVAILABLE
        assert why in capsys.readouterr().err


def test_one_tensorrt_install_hint(monkeypatch):
    monkeypatch.setattr(backends, "tensorrt_unavailable_reason", lambda **kw: backends.NOT_INSTALLED)
    with pytest.raises(BackendUnavailable) as e:
        backends.require_tensorrt("build engines")
    assert e.value.hint == backends.TENSORRT_INSTALL_HINT
    assert str(e.value) == "TensorRT is not installed; cannot build engines"
