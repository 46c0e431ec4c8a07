"""``m2export check --reference-backend`` (issue 18 item 4): the PyTorch reference on the cuTile kernels.

CPU: strict validation (an unknown value is a usage error; cutile with --reference transformers, or without CUDA /
cuda.tile, is one error line before anything is read, exit 2 / 2 / 4); the check's wiring with the kernels' entry
points on their torch backends. GPU-marked (the lead runs it on the H200):
the bundled checkpoint's export passes the check against the cuTile reference (default tolerances).
"""

from __future__ import annotations

import pytest
import torch

from m2export.cli.main import main
from tests.helpers import requires_cutile


def test_unknown_backend_is_a_usage_error(tiny_out, capsys):
    with pytest.raises(SystemExit) as e:
        main(["check", str(tiny_out), "--reference-backend", "triton"])
    assert e.value.code == 2 and "invalid choice: 'triton'" in capsys.readouterr().err


def test_cutile_with_transformers_reference_is_refused(tmp_path, capsys):
    rc = main(["check", str(tmp_path / "nothing_read"), "--reference-backend", "cutile", "--reference", "transformers"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: --reference-backend 'cutile' runs m2export's PyTorch model; --reference is 'transformers'")
    assert "Traceback" not in err


def test_bad_autotune_switch_is_one_line_before_anything_is_read(tmp_path, capsys, autotune_env):
    """M2EXPORT_AUTOTUNE is read by the cuTile scan's eager calls, i.e. by this reference: a bad value is refused
    with one line before any file is read (it was a ValueError traceback from inside the first scan, on a GPU)."""
    autotune_env("true")
    rc = main(["check", str(tmp_path / "nothing_read"), "--reference-backend", "cutile"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert err.startswith("error: M2EXPORT_AUTOTUNE='true': expected one of '0'") and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the error path is the CPU one")
def test_cutile_without_cuda_is_exit_4_one_line(tmp_path, capsys):
    rc = main(["check", str(tmp_path / "nothing_read"), "--reference-backend", "cutile"])
    err = capsys.readouterr().err
    assert rc == 4, err
    lines = err.strip().splitlines()
    assert lines[0] == "error: --reference-backend cutile: no CUDA device is available" and "Traceback" not in err
    # the hint names the CLI flag, not the kernels' Python argument (it said 'pass backend="torch"')
    assert lines[1].startswith("hint: ") and "--reference-backend torch" in lines[1] and 'backend="' not in err


@pytest.mark.gpu
@requires_cutile
def test_check_passes_against_the_cutile_reference(tmp_path, capsys):
    """The bundled checkpoint (headdim 32, d_state 32: sizes the cuTile scan serves) exported, then checked with the
    reference on the GPU kernels: passes, and the report says which reference ran."""
    from pathlib import Path

    bundled = Path(__file__).resolve().parents[2] / "samples" / "checkpoints" / "stdlib-byte-mamba2"
    out = tmp_path / "out"
    assert main(["export", str(bundled), "-o", str(out), "--ssm-impl", "both", "-q"]) == 0
    rc = main(["check", str(out), "-q", "--reference-backend", "cutile", "--shapes", "1x5,2x70",
               "--decode-steps", "3"])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    assert stdout.strip().splitlines()[-1].startswith("PASSED | m2export check")
    report = (out / "check_report.md").read_text()
    assert "on the cuTile kernels" in report and "cuda" in report


def test_cutile_reference_plumbing_on_cpu(kernels_on_torch, monkeypatch, tmp_path):
    """run_check with reference_backend="cutile" on the CPU: the CUDA checks and Module.cuda() stood in for, the
    kernels' entry points forced to their torch backends; the check passes, the reference's Mamba layers did run
    through the kernel entry points (conv prefill and update, scan, norm), the report names the cuTile reference."""
    from pathlib import Path

    import m2export.kernels._host as host
    from m2export.check.compare import run_check
    from m2export.exporter import export_model

    monkeypatch.setattr(host, "require_cuda_tile", lambda tensors: None)
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    bundled = Path(__file__).resolve().parents[2] / "samples" / "checkpoints" / "stdlib-byte-mamba2"
    out = tmp_path / "out"
    export_model(bundled, out, ssm_impl="ssmscan")
    report = run_check(out, shapes=[(1, 5), (2, 9)], decode_steps=2, reference_backend="cutile")
    assert report.passed, report.failures()
    assert {"causal_conv1d", "conv_update", "ssm_scan", "gated_rmsnorm"} <= set(kernels_on_torch)
    assert "on the cuTile kernels" in (out / "check_report.md").read_text()
