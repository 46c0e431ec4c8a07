"""The main job, end to end, through the CLI entry point (what README's first command runs).

export (both graph flavours) -> build (TensorRT engines; on a machine without TensorRT it exits 4 and
says so, and everything else still runs) -> check (PyTorch vs ONNX Runtime [vs TensorRT]) -> generate.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from m2export.cli.main import main

REPO = Path(__file__).resolve().parent.parent
#: The bundled checkpoint: a byte-level Mamba-2 trained on the Python stdlib sources (samples/).
CHECKPOINT = REPO / "samples" / "checkpoints" / "stdlib-byte-mamba2"
PROMPT = "def parse_args("


pytestmark = pytest.mark.usefixtures("single_threaded_torch")  # tiny decode steps: see tests/conftest.py


def test_main_job_export_build_check_generate(tmp_path, capsys):
    assert (CHECKPOINT / "config.json").is_file(), f"bundled checkpoint missing at {CHECKPOINT}"
    out = tmp_path / "stdlib"

    assert main(["export", str(CHECKPOINT), "-o", str(out), "--ssm-impl", "both", "-q"]) == 0
    capsys.readouterr()

    from m2export.backends import tensorrt_available

    rc = main(["build", str(out)])
    err = capsys.readouterr().err
    if tensorrt_available():
        assert rc == 0, err
    else:  # CPU-only machine: says so, no engines written, the rest of the job still runs
        assert rc == 4 and err.startswith("error: ") and ("TensorRT" in err or "GPU" in err), err
        assert not list(out.glob("*.plan"))

    assert main(["check", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.strip().splitlines()[-1].startswith("PASSED | m2export check")
    report = json.loads((out / "check_report.json").read_text())
    runners = [r["name"] for r in report["runners"]]
    assert runners[:3] == ["torch", "onnxrt:model.onnx", "onnxrt:model.std.onnx"]
    if tensorrt_available():
        assert any(r.startswith("trt:") for r in runners)
    else:
        assert any("skipped" in s and "TensorRT" in s for s in report["skipped"])
        assert "skipped" in text and "TensorRT" in text
    n_out = 1 + 2 * 4  # logits + conv/ssm state of 4 layers
    assert len(report["rows"]) == 2 * 2 * n_out and all(r["passed"] for r in report["rows"])

    texts = {}
    for runtime in ("onnxrt", "torch"):
        assert main(["generate", str(out), "--prompt", PROMPT, "--max-new-tokens", "48", "--runtime", runtime,
                     "-q"]) == 0
        texts[runtime] = capsys.readouterr().out
    assert texts["onnxrt"] == texts["torch"]
    new = texts["onnxrt"][len(PROMPT):]
    # a model trained on Python sources continues in plausible Python: printable ASCII, some line structure
    assert sum(c.isprintable() or c in "\n\t" for c in new) >= 0.95 * len(new)
    assert texts["onnxrt"].startswith(PROMPT)
