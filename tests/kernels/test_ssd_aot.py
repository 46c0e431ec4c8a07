"""AOT description of the single-launch kernels for the TensorRT plugin (no GPU needed).

Needs ``cuda.tile`` importable (skipped otherwise); the export tests also need its compiler
(``tileiras`` on PATH or the nvidia-cuda-tileiras wheel: ``pip install "cuda-tile[tileiras]"``). The parameter layout asserted here was read off an exported sm_90 cubin
(EIATTR_KPARAM_INFO: 73 entries, pointers 8 bytes, the rest 4) -- see aot_spec's docstring.
"""

from __future__ import annotations

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
    assert [a.name for a in spec.args if a.kind == "array"] == [
        "x", "dt", "A", "B", "C", "D", "dt_bias", "initial_state", "y", "final_state"]
    assert spec.scalars()["dt_max"] == ("float32", 0.5)
    assert spec.grid(3, 8, 64) == (24, 1, 64 // spec.config.block_p)
    assert spec.config.nseg == 1


def test_step_flat_args_order_and_plugin_binding():
    """The decode-step AOT spec binds the plugin's tensors: seqlen (size 1) dropped, the state in/out renamed."""
    from m2export.kernels.ssd_step.cutile import aot_spec

    spec = aot_spec(SSMScanProblem(2, 1, 8, 64, 2, 128, "float16"), SSMScanAttrs())
    assert len(spec.flat_args()) == 63
    assert spec.grid(2, 8, 64) == (16, 64 // spec.config, 1)
    assert spec.sources()["ssm_state"] == "initial_state" and spec.sources()["state_out"] == "final_state"
    assert spec.views() == {"x": 1, "dt": 1, "B": 1, "C": 1, "y": 1}


def test_description_must_match_the_kernel_signature():
    """A launch description with B and C swapped (same shape and dtype) is refused when it is made."""
    from m2export.errors import InternalError
    from m2export.kernels.launch import Launch
    from m2export.kernels.ssd.cutile import aot_spec

    spec = aot_spec(SSMScanProblem(2, 100, 8, 64, 2, 128, "bfloat16"), SSMScanAttrs())
    args = list(spec.args)
    args[3], args[4] = args[4], args[3]
    with pytest.raises(InternalError, match="parameter 3 is 'C'.*'B'"):
        Launch(spec.kernel, tuple(args), spec.grid)


def test_unsupported_dims():
    from m2export.kernels.ssd.cutile import aot_spec
    from m2export.kernels.ssd_step.cutile import aot_spec as step_spec

    with pytest.raises(ContractError, match="d_state"):
        aot_spec(SSMScanProblem(1, 1, 2, 64, 1, 48), SSMScanAttrs())
    with pytest.raises(ContractError, match="headdim: .*multiples of 16.*got 40"):  # one line, naming the field
        step_spec(SSMScanProblem(1, 1, 2, 40, 1, 128), SSMScanAttrs())


def test_headdim_80_specs():
    """Nemotron-Nano's head dim 80: the prefill spec covers it with cdiv(80, 64) = 2 tiles (the last masked), the
    decode-step spec with 5 exact 16-row tiles (a power of two dividing 80)."""
    from m2export.kernels.ssd.cutile import aot_spec
    from m2export.kernels.ssd_step.cutile import aot_spec as step_spec

    spec = aot_spec(SSMScanProblem(2, 100, 8, 80, 2, 128, "bfloat16"), SSMScanAttrs())
    assert spec.config.block_p == 64 and spec.grid(3, 8, 80) == (24, 1, 2) and len(spec.flat_args()) == 73
    step = step_spec(SSMScanProblem(2, 1, 8, 80, 2, 128, "bfloat16"), SSMScanAttrs())
    assert step.config == 16 and step.grid(3, 8, 80) == (24, 5, 1)


@needs_tileiras
@pytest.mark.usefixtures("no_cuda_home")
@pytest.mark.parametrize("which", ["prefill", "step"])
def test_entry_params_match_flat_args(which):
    """The .entry of the PTX embedded in the exported cubin (the plugin's one export path) has exactly
    flat_args() parameters: a u64 pointer per array followed by u32 extents and strides, then the scalars;
    no tensor-map slots the plugin would have to fill."""
    from m2export.plugins import aot

    if which == "prefill":
        from m2export.kernels.ssd.cutile import aot_spec
    else:
        from m2export.kernels.ssd_step.cutile import aot_spec
    spec = aot_spec(SSMScanProblem(2, 1, 8, 64, 2, 128, "bfloat16"), SSMScanAttrs())
    cubin, _ = aot._export_cubin(spec, "sm_90")
    assert cubin[:4] == b"\x7fELF"
    entry = aot.parse_entry(aot.ptx_from_cubin(cubin))
    assert entry.name.startswith(spec.name)
    flat = spec.flat_args()
    kinds = [entry.param_kind(i) for i in range(len(entry.params))]
    want = ["ptr" if f.endswith(".ptr") else ("f32" if f in ("dt_min", "dt_max") else "u32") for f in flat]
    assert kinds == want
    k = aot.build_aot_kernel(spec, cubin, None, gpu_code="sm_90")
    assert k.block[0] % 32 == 0 and k.block[1:] == (1, 1)
