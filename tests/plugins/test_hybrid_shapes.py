"""The SSMScan plugin's JIT impl body on the Mamba shapes of the hybrid presets (issue 11's H200 test).

Every preset's Mamba layers (nheads, headdim, ngroups, d_state, chunk_size, dt_limit from the public configs in
m2export/models/presets.py) run through ``run_jit`` exactly as TensorRT's enqueue calls it, against the
float64 oracle, NaN-poisoned outputs, bf16, with an initial state and a partial last chunk. A shape the
kernel does not serve must be refused at build time (``check_kernel_support``) naming the size; that part
runs on the CPU too.
"""

from __future__ import annotations

import pytest
import torch

from m2export.contract import INPUT_NAMES, SSMScanAttrs, SSMScanProblem
from m2export.errors import BackendUnavailable, ContractError
from m2export.kernels._host import check_supported
from tests.helpers import SSD_STATE_REL, SSD_Y_REL, assert_close, oracle_case, requires_cutile
from tests.plugins.fakes import FakeTensor

PRESETS = ("nemotron-h-8b", "nemotron-nano-9b-v2", "nemotron-3-nano-30b-a3b", "granite-4.0-h-small",
           "granite-4.0-h-1b", "bamba-9b", "falcon-h1-0.5b", "falcon-h1-7b", "zamba2-2.7b", "zamba2-7b")


def _mamba(name: str):
    from m2export.models.families import READERS
    from m2export.models.presets import preset_config

    family, cfg = preset_config(name)
    spec = READERS[family](cfg, name)
    return spec.layers[spec.mamba_layers[0]].mamba


def _supported(m) -> bool:
    try:
        check_supported(m)
    except ContractError:
        return False
    return True


@pytest.mark.parametrize("name", PRESETS)
def test_unsupported_shapes_refused_at_build_time(name, tmp_path):
    """check_kernel_support agrees with the kernels' own check on each preset (refusal names the size)."""
    from m2export.exporter.manifest import Manifest
    from m2export.models.presets import preset_config
    from m2export.trt.build import check_kernel_support

    family, cfg = preset_config(name)
    m = Manifest(source_checkpoint="ck", checkpoint_format=family, checkpoint_sha256="0", config=cfg, dtype="bf16",
                 opset=18, graphs=[], tool_versions={})
    mb = _mamba(name)
    if _supported(mb):
        check_kernel_support(m)
    else:
        with pytest.raises(BackendUnavailable, match=r"cannot run Mamba layer \d+: (headdim|d_state)"):
            check_kernel_support(m)


@pytest.mark.gpu
@requires_cutile
@pytest.mark.parametrize("name", PRESETS)
def test_jit_impl_body_on_preset_shapes(name):
    from m2export.plugins import ssm_scan_trt as plug

    mb = _mamba(name)
    if not _supported(mb):
        pytest.skip(f"{name}: headdim {mb.headdim} / d_state {mb.d_state} not served by the kernel (refused at "
                    "build time: test_unsupported_shapes_refused_at_build_time)")
    L = 2 * mb.chunk_size + 3  # two full chunks and a partial one
    p = SSMScanProblem(1, L, mb.nheads, mb.headdim, mb.ngroups, mb.d_state, "bfloat16")
    attrs = SSMScanAttrs(chunk_size=mb.chunk_size, dt_min=float(mb.dt_limit[0]), dt_max=float(mb.dt_limit[1]))
    ref, dev, y, fs = oracle_case(p, seed=sum(map(ord, name)), dt_limit=attrs.dt_limit,  # a stable seed
                                  init_state=True)
    plug.run_jit([FakeTensor(dev[n]) for n in INPUT_NAMES], [FakeTensor(y), FakeTensor(fs)], attrs, 0)
    torch.cuda.synchronize()
    assert_close(f"{name} y", ref.y, y.cpu(), rel=SSD_Y_REL[p.dtype])
    assert_close(f"{name} final_state", ref.final_state, fs.cpu(), rel=SSD_STATE_REL[p.dtype])
