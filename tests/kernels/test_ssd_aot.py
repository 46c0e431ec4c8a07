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


def test_divisibility_facts_of_a_contiguous_tensor():
    """Fixed extents give their power-of-two factor, run-time ones (None) 1; a stride is divisible by the product of
    the factors after it (x (batch, seqlen, nheads 80, headdim 64): stride of seqlen nheads*headdim = 5120 = 1024*5)."""
    from m2export.plugins.aot import contract_dims, divisibility_facts

    assert divisibility_facts((None, None, 80, 64)) == ((1, 1, 16, 64), (1024, 1024, 64, 1))
    assert divisibility_facts((None, 24, 128, 256)) == ((1, 8, 128, 256), (1 << 16, 1 << 15, 256, 1))  # capped
    assert divisibility_facts((12,)) == ((4,), (1,))
    dims = contract_dims(8, 80, 2, 128, decode=True)
    assert dims["x"] == (None, 1, 8, 80) and dims["initial_state"] == (None, 8, 80, 128) and dims["A"] == (8,)
    assert contract_dims(8, 80, 2, 128)["B"] == (None, None, 2, 128)


def test_trt_signature_states_the_fixed_sizes_of_each_view():
    """The decode kernel's views drop the plugin tensors' seqlen axis; the facts follow the view, and arrays whose
    source is not in ``dims`` (none given) keep the plain contiguous declaration."""
    from m2export.kernels.ssd_step.cutile import aot_spec
    from m2export.plugins import aot

    spec = aot_spec(SSMScanProblem(1, 1, 8, 80, 2, 128, "bfloat16"), SSMScanAttrs())
    arrays = [a.name for a in spec.args if a.kind != "constant"]
    cons = dict(zip(arrays, aot.trt_signature(spec, aot.contract_dims(8, 80, 2, 128, decode=True)).parameters))
    assert tuple(cons["x"].shape_divisible_by) == (1, 8, 16) and tuple(cons["x"].stride_divisible_by) == (128, 16, 1)
    assert tuple(cons["ssm_state"].shape_divisible_by) == (1, 8, 16, 128)
    assert tuple(cons["state_out"].stride_divisible_by) == (1 << 14, 2048, 128, 1)
    plain = dict(zip(arrays, aot.trt_signature(spec).parameters))
    assert plain["x"].stride_divisible_by in (1, (1, 1, 1))


AOT_LOAD_CASES = [(True, (80, 64, 1, 128)), (True, (128, 80, 8, 256)), (False, (80, 64, 1, 128)),
                  (False, (24, 128, 1, 256))]


@needs_tileiras
@pytest.mark.usefixtures("no_cuda_home")
@pytest.mark.parametrize("decode, dims", AOT_LOAD_CASES,
                         ids=[f"{'decode' if d else 'prefill'}_H{h}_P{p}_G{g}_N{n}" for d, (h, p, g, n) in AOT_LOAD_CASES])
def test_aot_kernels_move_tiles_with_vector_loads_and_no_tma(decode, dims):
    """The exported AOT kernel (compile_aot_kernel: the plugin's one path) moves its tiles with 8- and 16-byte
    global loads and stores, and no TMA (no tensor map: TensorRT's launcher cannot pass one). Without the fixed
    sizes' divisibility facts every load was a 2- or 4-byte one (0 vector loads of 134 at head dim 64 decode,
    0 of 389 in the prefill kernel: sm_90 builds read on the CPU, 2026-12-04)."""
    import re

    from m2export.plugins import aot

    k = aot.compile_aot_kernel(*dims, "bfloat16", SSMScanAttrs(), "sm_90", decode=decode)
    lines = [ln.strip() for ln in k.ptx.splitlines()]
    loads = [ln for ln in lines if re.match(r"(@!?%p\d+\s+)?ld\.global", ln)]
    vector_loads = [ln for ln in loads if re.search(r"\.v[24]\.", ln)]
    vector_stores = [ln for ln in lines if re.match(r"(@!?%p\d+\s+)?st\.global\S*\.v[24]\.", ln)]
    assert len(vector_loads) >= len(loads) // 4, (len(vector_loads), len(loads))
    assert vector_stores
    assert not [ln for ln in lines if "cp.async.bulk.tensor" in ln or "tensormap" in ln]


@pytest.mark.parametrize("headdim, d_state, rows, occupancy", [(64, 128, 32, 4), (128, 256, 32, 6), (80, 128, 16, 8),
                                                               (80, 256, 16, 6), (64, 64, 32, 8), (16, 128, 16, 8)])
def test_aot_decode_tile_rule(headdim, d_state, rows, occupancy):
    """The AOT decode kernel's batch-independent tile (AOT_STEP_ROWS, at most the largest power of two dividing
    headdim) and hint (6 at d_state 256, else choose_occupancy): the H200 sweep's choice, each GPU-tested."""
    from m2export.kernels._host import hinted
    from m2export.kernels.ssd_step.cutile import aot_spec, ssd_step_kernel

    spec = aot_spec(SSMScanProblem(1, 1, 8, headdim, 1, d_state, "bfloat16"), SSMScanAttrs())
    assert spec.config == rows and spec.grid(4, 8, headdim) == (32, headdim // rows, 1)
    assert spec.kernel is hinted(ssd_step_kernel, occupancy)  # one kernel object per hint
