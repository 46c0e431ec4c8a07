"""m2export works without cuda.tile (an optional dependency: ``m2export[gpu]``).

The test extra installs cuda-tile (the kernel compile tests need it), so this runs a fresh
interpreter in which ``import cuda.tile`` fails, as on a machine without it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_SCRIPT = r"""
import importlib, pkgutil, sys
sys.modules["cuda.tile"] = None  # any import of cuda.tile now raises ImportError

import m2export
skipped = []
for m in pkgutil.walk_packages(m2export.__path__, "m2export."):
    if m.name.rsplit(".", 1)[1] in ("cutile", "cutile_packed"):  # the kernel modules: need cuda.tile by design
        skipped.append(m.name)
        continue
    importlib.import_module(m.name)
assert skipped == ["m2export.kernels.conv1d.cutile", "m2export.kernels.gated_norm.cutile",
                   "m2export.kernels.ssd.cutile", "m2export.kernels.ssd.cutile_packed",
                   "m2export.kernels.ssd_step.cutile"], skipped

import torch
from m2export.contract import SSMScanProblem
from m2export.errors import BackendUnavailable
from m2export.kernels.ssd import ssm_scan
from tests.helpers import make_inputs

inp = make_inputs(SSMScanProblem(1, 10, 2, 32, 1, 32), seed=0)
assert torch.isfinite(ssm_scan(**inp, backend="torch").y).all()
try:
    ssm_scan(**inp, backend="cutile")
except BackendUnavailable as e:
    assert "m2export[gpu]" in (e.hint or ""), e.hint
else:
    raise AssertionError("backend='cutile' without cuda.tile did not raise")

from m2export.kernels.conv1d import causal_conv1d
from m2export.kernels.gated_norm import gated_rmsnorm

x, w = torch.randn(2, 5, 12), torch.randn(12, 4)
assert torch.isfinite(causal_conv1d(x, w, backend="torch").y).all()
assert torch.isfinite(gated_rmsnorm(x, x, torch.ones(12), backend="torch")).all()
for call in (lambda: causal_conv1d(x, w), lambda: gated_rmsnorm(x, x, torch.ones(12))):
    try:
        call()
    except BackendUnavailable as e:
        assert "m2export[gpu]" in (e.hint or ""), e.hint
    else:
        raise AssertionError("backend='cutile' without cuda.tile did not raise")
print("ok")
"""


def test_package_imports_and_runs_without_cuda_tile():
    r = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]
