"""Bad input through the CLI (issue 13, items 12 and 13): each case gives one ``error:`` line (plus an
optional ``hint:``) and an exit code of the table in m2export/errors.py, never a traceback (each was exit 70
with one, or a misleading message, on the code before these tests)."""

from __future__ import annotations

import pytest

from m2export.cli.main import main
from m2export.errors import ExitCode
from tests.check.exports import copy_export


def _one_error(capsys, expected: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and expected in lines[0], err
    return lines[0]


@pytest.mark.parametrize("which", ["input", "output"])
@pytest.mark.parametrize("target", ["outdir", "graph"])
def test_inspect_graph_with_an_unknown_elem_type(tiny_out, tmp_path, capsys, which, target):
    import onnx

    out = copy_export(tiny_out, tmp_path / "out")
    m = onnx.load(str(out / "model.onnx"), load_external_data=False)
    vi = (m.graph.input if which == "input" else m.graph.output)[0]
    vi.type.tensor_type.elem_type = 77
    onnx.save(m, str(out / "model.onnx"))
    rc = main(["inspect", str(out if target == "outdir" else out / "model.onnx")])
    line = _one_error(capsys, f"model.onnx: {which} {vi.name!r} has elem_type 77, which is no tensor type of ONNX's")
    assert rc == ExitCode.USER_ERROR, line
