"""AOT description of the single-launch kernels for the TensorRT plugin (no GPU needed).

Needs ``cuda.tile`` importable (skipped otherwise); the export tests also need its compiler
(``tileiras`` on PATH or the nvidia-cuda-tileiras wheel: ``pip install "cuda-tile[tileiras]"``). The parameter layout asserted here was read off an exported sm_90 cubin
(EIATTR_KPARAM_INFO: 73 entries, pointers 8 bytes, the rest 4) -- see AotSpec's docstring.
"""

from __future__ import annotations

import io

import pytest

pytest.importorskip("cuda.tile")

from m2export.contract import SSMScanAttrs, SSMScanProblem  # noqa: E402
from m2export.errors import ContractError  # noqa: E402
from tests.helpers import tileiras_skip_reason  # noqa: E402

needs_tileiras = pytest.mark.skipif(tileiras_skip_reason() is not None, reason=tileiras_skip_reason() or "")


def test_prefill_flat_args_order():
    from m2export.kernels.ssd.cutile import aot_spec

    spec = aot_spec(SSMScanProblem(2, 100, 8, 64, 2, 128, "bfloat16"), SSMScanAttrs(dt_min=0.0, dt_max=0.5))
    flat = spec.flat_args()
    assert len(flat) == 73
    assert flat[:9] == ["x.ptr", "x.shape0", "x.shape1", "x.shape2", "x.shape3",
                        "x.stride0", "x.stride1", "x.stride2", "x.stride3"]
    assert flat[9] == "dt.ptr" and flat[16] == "A.ptr" and flat[-3:] == ["dt_min", "dt_max", "heads_per_group"]
    assert [p.name for p in spec.params if p.kind == "array"] == [
        "x", "dt", "A", "B", "C", "D", "dt_bias", "initial_state", "y", "final_state"]
    assert spec.grid(3, 8, 64) == (24, 1, 64 // spec.config.block_p)
    assert spec.config.nseg == 1


def test_step_flat_args_order():
    from m2export.kernels.ssd_step.cutile import aot_spec

    spec = aot_spec(SSMScanProblem(2, 1, 8, 64, 2, 128, "float16"), SSMScanAttrs())
    assert len(spec.flat_args()) == 63
    assert spec.grid(2, 8, 64) == (16, 64 // spec.block_p, 1)


def test_unsupported_dims():
    from m2export.kernels.ssd.cutile import aot_spec

    with pytest.raises(ContractError, match="d_state"):
        aot_spec(SSMScanProblem(1, 1, 2, 64, 1, 48), SSMScanAttrs())


@needs_tileiras
@pytest.mark.usefixtures("no_cuda_home")
def test_export_cubin():
    from m2export.kernels.ssd.cutile import aot_spec

    spec = aot_spec(SSMScanProblem(1, 1, 4, 32, 1, 32, "bfloat16"), SSMScanAttrs())
    buf = io.BytesIO()
    symbol = spec.export(buf, gpu_code="sm_90")
    assert buf.getvalue()[:4] == b"\x7fELF" and symbol.startswith("ssd_fused_kernel")


@needs_tileiras
@pytest.mark.usefixtures("no_cuda_home")
@pytest.mark.parametrize("which", ["prefill", "step"])
def test_entry_params_match_flat_args(which):
    """The .entry of the PTX embedded in the exported cubin has exactly flat_args() parameters:
    a u64 pointer per array followed by u32 extents and strides, then the scalars."""
    if which == "prefill":
        from m2export.kernels.ssd.cutile import aot_spec
    else:
        from m2export.kernels.ssd_step.cutile import aot_spec
    spec = aot_spec(SSMScanProblem(2, 1, 8, 64, 2, 128, "bfloat16"), SSMScanAttrs())
    k = spec.compile(gpu_code="sm_90")
    flat = spec.flat_args()
    assert k.ptx is not None and k.symbol in k.ptx
    assert len(k.param_types) == len(flat)
    want = ["u64" if f.endswith(".ptr") else ("f32" if f in ("dt_min", "dt_max") else "u32") for f in flat]
    assert list(k.param_types) == want
    assert k.hidden_params == 0  # no tensor-map slots the plugin would have to fill
    assert k.threads and k.threads % 32 == 0
