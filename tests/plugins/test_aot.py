"""AOT path of the SSMScan plugin (m2export.plugins.aot): argument mapping, PTX rewriting, target checks.

CPU tests run on a real cuTile export (tests/plugins/data: the ``.nv_debug_ptx_txt`` section of the
cubin that ``cuda.tile.compilation.export_kernel`` wrote for the single-launch SSD kernel, sm_90, bf16;
how it was made is in data/README.md). GPU tests (marked ``gpu``) export the current kernel, load the
rewritten PTX with the CUDA driver and launch it exactly as TensorRT's AOT launcher does (input
pointers | extra int32 args | output pointers), against the float64 oracle.
"""

from __future__ import annotations

import json
import lzma
import math
import re
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest

from m2export.contract import INPUT_NAMES, OUTPUT_NAMES, SSMScanAttrs, SSMScanProblem
from m2export.errors import BackendUnavailable, InternalError
from m2export.plugins import aot
from m2export.plugins.ssm_scan_trt import aot_launch
from tests.helpers import SSD_STATE_REL, SSD_Y_REL, assert_close, oracle_case, requires_cutile
from tests.plugins.fakes import Expr, exprs

DATA = Path(__file__).parent / "data"
META = json.loads((DATA / "ssd_fused_bf16_sm90.json").read_text())
RAW_SECTION = lzma.decompress((DATA / "ssd_fused_bf16_sm90.nv_debug_ptx_txt.xz").read_bytes())


def _meta_scalars() -> dict:
    return {k: (dt, math.inf if v == "inf" else v) for k, (dt, v) in META["scalars"].items()}


def make_elf(sections: dict[str, bytes]) -> bytes:
    """A minimal 64-bit little-endian ELF with these sections (enough for cubin_sections)."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n in [*sections, ".shstrtab"])
    offsets, body = [], b""
    for data in [*sections.values(), names]:
        offsets.append(64 + len(body))
        body += data
    shoff = 64 + len(body)
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, len(sections) + 2, len(sections) + 1)
    shdrs = bytes(64)  # null section
    name_off = 1
    for (name, data), off in zip([*sections.items(), (".shstrtab", names)], offsets):
        shdrs += struct.pack("<IIQQQQIIQQ", name_off, 1, 0, 0, off, len(data), 0, 0, 1, 0)
        name_off += len(name) + 1
    return bytes(header) + body + shdrs


def fixture_cubin() -> bytes:
    return make_elf({".text.k": b"\0" * 16, aot.PTX_SECTION: RAW_SECTION, ".nv.info": b"\1\2"})


def _fixture_kernel(x, dt, A, B, C, D, dt_bias, initial_state, y, final_state, dt_min: float, dt_max: float,
                    heads_per_group: int):
    """Signature of the kernel the fixture was exported from (ssd_fused_kernel without its constants)."""


#: the fixture's runtime parameters in order, as the kernel's signature declares them
FIXTURE_PARAMS = ["x", "dt", "A", "B", "C", "D", "dt_bias", "initial_state", "y", "final_state",
                  "dt_min", "dt_max", "heads_per_group"]


def fixture_spec():
    """A launch-description stand-in (m2export.kernels.launch.Launch's AOT surface) for the fixture's export."""
    bp = META["block_p"]
    return SimpleNamespace(kernel=_fixture_kernel, flat_args=lambda: list(META["flat_args"]), sources=dict,
                           views=dict, scalars=_meta_scalars,
                           grid=lambda batch, nheads, headdim: (batch * nheads, 1, headdim // bp))


# ----------------------------------------------------------------------------- argument mapping
def test_argument_map_orders_inputs_extras_outputs():
    amap = aot.argument_map(META["flat_args"])
    slots = amap.trt_slots
    assert slots[:8] == tuple(f"{n}.ptr" for n in INPUT_NAMES)
    assert slots[-2:] == tuple(f"{n}.ptr" for n in OUTPUT_NAMES)
    assert [s for s in slots[8:-2] if s.endswith(".ptr")] == []
    assert slots[8:-2] == amap.extra_args
    # extras keep cuTile's relative order: x's shape then strides, ..., final_state's, then the scalars
    assert amap.extra_args[:8] == ("x.shape0", "x.shape1", "x.shape2", "x.shape3",
                                   "x.stride0", "x.stride1", "x.stride2", "x.stride3")
    assert amap.extra_args[-len(META["scalars"]):] == tuple(META["scalars"])
    assert sorted(amap.order) == list(range(len(META["flat_args"])))


def test_argument_map_rejects_mismatches():
    args = list(META["flat_args"])
    with pytest.raises(InternalError, match="no pointer parameter for \\['final_state'\\]"):
        aot.argument_map([a for a in args if a != "final_state.ptr"])
    with pytest.raises(InternalError, match="two pointers"):
        aot.argument_map(args + ["x.ptr"])
    with pytest.raises(InternalError, match="neither plugin inputs"):
        aot.argument_map(args + ["scratch.ptr"])
    with pytest.raises(InternalError, match="expected TENSOR.ptr"):
        aot.argument_map(args + ["x.size"])


def test_extra_arg_values_symbolic_and_concrete():
    amap = aot.argument_map(META["flat_args"])
    p = SSMScanProblem(batch=3, seqlen=70, nheads=4, headdim=32, ngroups=2, d_state=32)
    concrete = {n: p.shape_of(n) for n in INPUT_NAMES + OUTPUT_NAMES}
    vals = dict(zip(amap.extra_args, aot.extra_arg_values(amap, concrete, _meta_scalars())))
    assert [vals[f"x.shape{i}"] for i in range(4)] == [3, 70, 4, 32]
    assert [vals[f"x.stride{i}"] for i in range(4)] == [70 * 4 * 32, 4 * 32, 32, 1]
    assert [vals[f"final_state.stride{i}"] for i in range(4)] == [4 * 32 * 32, 32 * 32, 32, 1]
    assert vals["A.shape0"] == 4 and vals["A.stride0"] == 1
    assert vals["dt_max"] == 0x7F800000 and vals["dt_min"] == 0 and vals["heads_per_group"] == 2
    # the same with TensorRT-like symbolic dims: batch and seqlen stay expressions
    b, L = Expr("batch"), Expr("seqlen")
    sym = {n: tuple(b if d == "batch" else L if d == "seqlen" else Expr(v) for d, v in zip(_dims(n), p.shape_of(n)))
           for n in INPUT_NAMES + OUTPUT_NAMES}
    svals = dict(zip(amap.extra_args, aot.extra_arg_values(amap, sym, _meta_scalars())))
    assert svals["x.shape0"] is b and svals["x.stride0"] == Expr("((seqlen*4)*32)")
    assert svals["x.stride3"] == 1 and svals["y.stride1"] == Expr(128)


def _dims(name: str) -> tuple[str, ...]:
    from m2export.contract import INPUTS, OUTPUTS

    return next(s.dims for s in INPUTS + OUTPUTS if s.name == name)


def test_scalar_args():
    assert aot.float32_bits(1.0) == 0x3F800000
    assert aot.float32_bits(-2.0) == -0x40000000
    assert aot.float32_bits(math.inf) == 0x7F800000
    assert aot.scalar_arg("int32", 3) == 3
    with pytest.raises(InternalError, match="out of range"):
        aot.scalar_arg("int32", 2**31)
    with pytest.raises(InternalError, match="32-bit"):
        aot.scalar_arg("float64", 1.0)


# ----------------------------------------------------------------------------- PTX from a real export
def test_cubin_sections_and_ptx_extraction():
    secs = aot.cubin_sections(fixture_cubin())
    assert set(secs) >= {".text.k", aot.PTX_SECTION, ".nv.info"} and secs[".nv.info"] == b"\1\2"
    ptx = aot.ptx_from_cubin(fixture_cubin())
    assert ptx.startswith(".version ") and ptx.rstrip().endswith("}")
    # the debug sections and the Tile IR source that follow the entry in the section are cut off
    assert ".nv_intermediate_source_section" in RAW_SECTION.decode(errors="replace")
    assert ".nv_intermediate_source_section" not in ptx and ".section" not in ptx
    assert aot.ptx_version(ptx) == (9, 4) and aot.ptx_target(ptx) == "sm_90a"
    assert aot.required_threads(ptx) is not None
    with pytest.raises(InternalError, match="no .nv_debug_ptx_txt section"):
        aot.ptx_from_cubin(make_elf({".text": b"x"}))
    with pytest.raises(InternalError, match="ELF"):
        aot.cubin_sections(b"not an elf" * 10)


def test_entry_matches_the_kernel_description():
    ptx = aot.ptx_from_cubin(fixture_cubin())
    entry = aot.parse_entry(ptx)
    assert entry.name == META["symbol"]
    assert len(entry.params) == len(META["flat_args"])
    amap = aot.argument_map(META["flat_args"])
    scalar_dtypes = {k: v[0] for k, v in _meta_scalars().items()}
    aot.check_entry(entry, amap, scalar_dtypes, FIXTURE_PARAMS)
    # one parameter fewer (e.g. a calling-convention change) is refused, not guessed
    with pytest.raises(InternalError, match="refusing to guess"):
        aot.check_entry(entry, aot.argument_map(META["flat_args"][:-1]), {}, FIXTURE_PARAMS[:-1])
    # a scalar declared with another type than described is refused
    wrong = {k: ("int32" if dt == "float32" else "float32") for k, (dt, _) in _meta_scalars().items()}
    with pytest.raises(InternalError, match="is declared"):
        aot.check_entry(entry, amap, wrong, FIXTURE_PARAMS)


def test_entry_check_refuses_swapped_same_typed_arrays():
    """B and C have the same rank and dtype, so every slot type still matches when a description swaps them;
    the kernel's own parameter order catches it (the PTX names parameters by index only)."""
    entry = aot.parse_entry(aot.ptx_from_cubin(fixture_cubin()))
    flat = list(META["flat_args"])
    b = [i for i, f in enumerate(flat) if f.startswith("B.")]
    c = [i for i, f in enumerate(flat) if f.startswith("C.")]
    swapped = flat[:b[0]] + [flat[i] for i in c] + [flat[i] for i in b] + flat[c[-1] + 1:]
    assert len(swapped) == len(flat) and [entry.param_kind(i) for i in b] == [entry.param_kind(i) for i in c]
    scalar_dtypes = {k: v[0] for k, v in _meta_scalars().items()}
    with pytest.raises(InternalError, match="parameter 3 as 'C' but the kernel's signature has 'B'"):
        aot.check_entry(entry, aot.argument_map(swapped), scalar_dtypes, FIXTURE_PARAMS)
    # and through build_aot_kernel, which reads the order from the kernel's signature
    spec = fixture_spec()
    spec.flat_args = lambda: swapped
    with pytest.raises(InternalError, match="'C' but the kernel's signature has 'B'"):
        aot.build_aot_kernel(spec, fixture_cubin(), META["symbol"], gpu_code="sm_90")


def test_tensor_map_parameters_are_refused():
    """A kernel taking TMA descriptors (128-byte .b8 params) cannot be launched by TensorRT: clear error."""
    ptx = aot.ptx_from_cubin(fixture_cubin())
    entry = aot.parse_entry(ptx)
    tma = entry.params + (f".param .align 64 .b8 {entry.name}_param_{len(entry.params)}[128]",)
    fake = aot.PtxEntry(entry.name, tma, entry.span)
    with pytest.raises(InternalError, match="TMA tensor-map descriptors"):
        aot.check_entry(fake, aot.argument_map(META["flat_args"]), {}, FIXTURE_PARAMS)


def test_reorder_rebinds_parameters_by_name():
    ptx = aot.ptx_from_cubin(fixture_cubin())
    entry = aot.parse_entry(ptx)
    amap = aot.argument_map(META["flat_args"])
    out = aot.reorder_entry_params(ptx, entry, amap.order)
    new = aot.parse_entry(out)
    assert new.name == entry.name and len(new.params) == len(entry.params)
    # slot i now declares the cuTile parameter amap.order[i] (its original name, hence its original uses)
    assert [new.param_name(i) for i in range(len(new.params))] == [entry.param_name(j) for j in amap.order]
    assert [new.param_kind(i) for i in range(8)] == ["ptr"] * 8
    assert [new.param_kind(i) for i in (-2, -1)] == ["ptr", "ptr"]
    # the body is untouched
    body = lambda s: s[s.index("{", aot.parse_entry(s).span[1]):]  # noqa: E731
    assert body(out) == body(ptx)
    # each of the 10 pointer slots is read by the body under the name it was declared with
    for i in [*range(8), -2, -1]:
        assert re.search(r"ld\.param\.\w+\s+[^,]+,\s*\[" + re.escape(new.param_name(i)) + r"\]", out), i
    with pytest.raises(InternalError, match="not a permutation"):
        aot.reorder_entry_params(ptx, entry, [0] * len(entry.params))


def test_build_aot_kernel_from_fixture():
    k = aot.build_aot_kernel(fixture_spec(), fixture_cubin(), META["symbol"], gpu_code="sm_90")
    assert k.name == META["symbol"] and k.block == aot.required_threads(k.ptx)
    assert aot.parse_entry(k.ptx).params == tuple(
        aot.parse_entry(aot.ptx_from_cubin(fixture_cubin())).params[i] for i in k.amap.order)
    isa = aot.build_aot_kernel(fixture_spec(), fixture_cubin(), META["symbol"], gpu_code="sm_90", ptx_isa=(9, 0))
    assert aot.ptx_version(isa.ptx) == (9, 0) and isa.ptx.replace(".version 9.0", ".version 9.4", 1) == k.ptx
    with pytest.raises(InternalError, match="not the requested symbol"):
        aot.build_aot_kernel(fixture_spec(), fixture_cubin(), "other", gpu_code="sm_90")


def test_aot_launch_with_symbolic_shapes():
    """The @aot_impl body with TensorRT-like ShapeExprs: grid, block, extras in slot order."""
    kernel = aot.build_aot_kernel(fixture_spec(), fixture_cubin(), META["symbol"], gpu_code="sm_90")
    calls = []

    def compile_kernel(*key):
        calls.append(key)
        return kernel

    pm = META["problem"]
    b, L = Expr("batch"), Expr("seqlen")
    H, P, G, N = pm["nheads"], pm["headdim"], pm["ngroups"], pm["d_state"]
    shapes = {"x": (b, L, *exprs(H, P)), "dt": (b, L, Expr(H)), "A": exprs(H), "B": (b, L, *exprs(G, N)),
              "C": (b, L, *exprs(G, N)), "D": exprs(H), "dt_bias": exprs(H),
              "initial_state": (b, *exprs(H, P, N)), "y": (b, L, *exprs(H, P)), "final_state": (b, *exprs(H, P, N))}
    out = aot_launch(shapes, "DataType.BF16", SSMScanAttrs(), gpu_code="sm_90", compile_kernel=compile_kernel)
    assert calls == [(H, P, G, N, "bfloat16", SSMScanAttrs(), "sm_90", None, False)]
    assert out["name"] == META["symbol"] and out["block"] == kernel.block and out["shared_mem"] == 0
    assert out["grid"] == (b * H, 1, P // META["block_p"])
    assert out["extra_names"] == kernel.amap.extra_args and len(out["extra_args"]) == len(kernel.amap.extra_args)
    named = dict(zip(out["extra_names"], out["extra_args"]))
    assert named["x.shape1"] is L and named["initial_state.shape0"] is b and named["dt_max"] == 0x7F800000


def test_aot_decode_engine_picks_the_step_kernel():
    """seqlen the constant 1 (a decode engine): the step kernel's spec, its extras from the plugin's 4-D shapes
    with the seqlen dim dropped; a dynamic seqlen keeps the prefill kernel."""
    from m2export.kernels.ssd_step.cutile import aot_spec as step_spec

    H, P, G, N = 8, 64, 2, 128
    spec = step_spec(SSMScanProblem(1, 1, H, P, G, N, "bfloat16"), SSMScanAttrs())
    amap = aot.argument_map(spec.flat_args(), sources=spec.sources(), views=spec.views())
    kernel = SimpleNamespace(amap=amap, scalars=spec.scalars(), grid=spec.grid, name="k", ptx="", block=(128, 1, 1))
    calls = []

    def compile_kernel(*key):
        calls.append(key)
        return kernel

    b = Expr("batch")
    for L, decode in ((Expr(1), True), (Expr("seqlen"), False)):
        shapes = {"x": (b, L, *exprs(H, P)), "dt": (b, L, Expr(H)), "A": exprs(H), "B": (b, L, *exprs(G, N)),
                  "C": (b, L, *exprs(G, N)), "D": exprs(H), "dt_bias": exprs(H),
                  "initial_state": (b, *exprs(H, P, N)), "y": (b, L, *exprs(H, P)),
                  "final_state": (b, *exprs(H, P, N))}
        out = aot_launch(shapes, "DataType.BF16", SSMScanAttrs(), gpu_code="sm_90", compile_kernel=compile_kernel)
        assert calls[-1][-1] is decode
    named = dict(zip(out["extra_names"], out["extra_args"]))
    # pointers: TensorRT's 8 input slots then 2 outputs, bound to the step kernel's renamed state in/out
    slots = amap.trt_slots
    assert slots[:8] == ("x.ptr", "dt.ptr", "A.ptr", "B.ptr", "C.ptr", "D.ptr", "dt_bias.ptr", "ssm_state.ptr")
    assert slots[-2:] == ("y.ptr", "state_out.ptr")
    assert [named[f"x.shape{i}"] for i in range(3)] == [b, Expr(H), Expr(P)]
    assert named["x.stride0"] == Expr(H * P) and named["dt.shape1"] == Expr(H) and named["B.shape1"] == Expr(G)
    assert named["ssm_state.shape0"] is b and named["state_out.stride0"] == Expr(H * P * N)
    assert out["grid"] == (b * H, P // spec.config, 1)


def test_aot_needs_static_head_dims():
    shapes = {"x": (Expr("b"), Expr("L"), Expr("h"), Expr(32)), "B": exprs(1, 1, 2, 32)}
    with pytest.raises(BackendUnavailable, match="nheads .* must be static"):
        aot_launch(shapes, "float32", SSMScanAttrs(), gpu_code="sm_90", compile_kernel=None)


# ----------------------------------------------------------------------------- target checks
def test_check_target():
    ptx = aot.ptx_from_cubin(fixture_cubin())  # .target sm_90a, .version 9.4
    aot.check_target(ptx, cc=(9, 0), driver=(13, 4), load=lambda b: 0)
    with pytest.raises(BackendUnavailable, match="does not match the build GPU .compute capability 10.0"):
        aot.check_target(ptx, cc=(10, 0), driver=(13, 4), load=lambda b: 0)
    with pytest.raises(BackendUnavailable, match="CUDA 13.0. cannot JIT PTX ISA 9.4") as e:
        aot.check_target(ptx, cc=(9, 0), driver=(13, 0), load=lambda b: 222)
    assert "plugin='jit'" in e.value.hint
    with pytest.raises(BackendUnavailable, match="rejects the PTX .* CUDA_ERROR_INVALID_PTX"):
        aot.check_target(ptx, cc=(9, 0), driver=(13, 4), load=lambda b: 218)
    assert aot.gpu_code_for((9, 0)) == "sm_90"


# ----------------------------------------------------------------------------- GPU: launch like TensorRT
gpu = requires_cutile
#: the bounds of tests/kernels/test_ssd.py (the AOT kernel is the same cuTile kernel)
Y_REL, STATE_REL = SSD_Y_REL, SSD_STATE_REL

AOT_CASES = [  # (problem, dt_limit): the limits reach the kernel as float32 bit patterns
    pytest.param(SSMScanProblem(2, 100, 8, 64, 2, 64, "float32"), (1e-4, math.inf), id="B2-L100-H8-P64-G2-N64-fp32"),
    pytest.param(SSMScanProblem(1, 1, 4, 32, 1, 128, "float32"), (0.0, math.inf), id="L1-N128-fp32"),
    pytest.param(SSMScanProblem(3, 257, 8, 64, 8, 128, "bfloat16"), (1e-3, 0.2),
                 id="L_k_chunk_plus_1-G8-bf16-dt_limit"),
    pytest.param(SSMScanProblem(2, 64, 4, 128, 2, 64, "float16"), (0.0, math.inf), id="L_eq_chunk-P128-fp16"),
]


def _launch_like_tensorrt(k, image: bytes, p: SSMScanProblem, dev: dict, y, fs) -> None:
    """Load ``image`` (the AOT kernel's PTX or its assembled cubin) and launch it as TensorRT's AOT launcher
    does: input pointers | int32 extras from the plugin tensors' shapes | output pointers; then synchronize."""
    import torch

    from m2export.plugins import _cuda

    kern = _cuda.load_kernel(image, k.name)
    extras = aot.extra_arg_values(k.amap, {n: p.shape_of(n) for n in INPUT_NAMES + OUTPUT_NAMES}, k.scalars)
    kern.launch(k.grid(p.batch, p.nheads, p.headdim), k.block,
                [("u64", dev[n].data_ptr()) for n in INPUT_NAMES] + [("i32", v) for v in extras]
                + [("u64", t.data_ptr()) for t in (y, fs)], stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    kern.unload()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("p, dt_limit", AOT_CASES)
def test_aot_kernel_launched_like_tensorrt(p, dt_limit):
    """Export -> PTX rewritten to TensorRT's order -> driver JIT -> cuLaunchKernel with TensorRT's slots."""
    import torch

    from m2export.plugins import _cuda

    cc = _cuda.compute_capability(torch.cuda.current_device())
    attrs = SSMScanAttrs(dt_min=dt_limit[0], dt_max=dt_limit[1])
    k = aot.compile_aot_kernel(p.nheads, p.headdim, p.ngroups, p.d_state, p.dtype, attrs, aot.gpu_code_for(cc))
    ref, dev, y, fs = oracle_case(p, seed=7, dt_limit=attrs.dt_limit)
    torch.cuda.synchronize()
    image, how = k.ptx.encode(), "PTX (driver JIT, as TensorRT loads it)"
    rc = _cuda.try_load_module(image)
    if rc == _cuda.CUDA_ERROR_UNSUPPORTED_PTX_VERSION:
        # this driver predates tileiras' PTX ISA (TensorRT would refuse the same: check_target); still prove
        # the argument mapping by assembling the rewritten PTX with the carried ptxas instead
        image, how = _assemble(k.ptx, aot.ptx_target(k.ptx)), "cubin (ptxas; driver too old for the PTX ISA)"
    else:
        assert rc == 0, _cuda.result_name(rc)
    print(f"\n{p}: loading {how}, driver CUDA {_cuda.driver_version()}")
    _launch_like_tensorrt(k, image, p, dev, y, fs)
    assert_close("y", ref.y, y.cpu(), rel=Y_REL[p.dtype])
    assert_close("final_state", ref.final_state, fs.cpu(), rel=STATE_REL[p.dtype])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_aot_kernel_decay_overflowing_to_minus_inf(dtype):
    """The TensorRT AOT kernel (the fused kernel, PTX through the driver JIT, TensorRT's slots) where dt*A is -inf in
    float32 on head 0 (A -1e30, dt 1e10 on every third token; float16 A -1e37, dt 100: tests.helpers.FP16_OVERFLOW),
    L = 3*64 + 1, an initial state: the float64 oracle's answer, never NaN (the kernels' LOG2_STEP_FLOOR)."""
    import torch

    from m2export.kernels.ssd.naive import ssm_scan_recurrent
    from m2export.plugins import _cuda
    from tests.helpers import FP16_OVERFLOW, assert_overflow_close, nan_outputs, overflowing_decay_inputs

    p = SSMScanProblem(2, 3 * 64 + 1, 8, 64, 2, 64, dtype)
    cc = _cuda.compute_capability(torch.cuda.current_device())
    k = aot.compile_aot_kernel(p.nheads, p.headdim, p.ngroups, p.d_state, p.dtype, SSMScanAttrs(),
                               aot.gpu_code_for(cc))
    a0, spike_dt = FP16_OVERFLOW if dtype == "float16" else (-1e30, 1e10)
    inp = overflowing_decay_inputs(p, seed=17, a0=a0, spike_dt=spike_dt)
    ref = ssm_scan_recurrent(**inp)
    dev = {n: inp[n].cuda().contiguous() for n in INPUT_NAMES}
    y, fs = nan_outputs(p)
    image = k.ptx.encode()
    rc = _cuda.try_load_module(image)
    if rc == _cuda.CUDA_ERROR_UNSUPPORTED_PTX_VERSION:
        image = _assemble(k.ptx, aot.ptx_target(k.ptx))
    else:
        assert rc == 0, _cuda.result_name(rc)
    _launch_like_tensorrt(k, image, p, dev, y, fs)
    assert_overflow_close(ref, y.cpu(), fs.cpu(), rel=Y_REL[dtype])


def _tactic_cases():
    from m2export.kernels.ssd.plan import tile_families

    out = []
    for p in (SSMScanProblem(2, 193, 8, 64, 2, 128, "bfloat16"), SSMScanProblem(2, 130, 4, 128, 1, 256, "bfloat16")):
        out += [pytest.param(p, i, id=f"P{p.headdim}_N{p.d_state}_L{p.seqlen}-tactic{i}")
                for i in range(1, len(tile_families(p)) + 1)]
    return out


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("p, tactic", _tactic_cases())
def test_aot_prefill_tactics_launched_like_tensorrt(p, tactic):
    """Every TensorRT tactic of the AOT prefill kernel (tactic i = plan.tile_families(problem)[i - 1], the space
    TensorRT's build-time autotune chooses from), exported on the plugin's path and launched like TensorRT, vs the
    float64 oracle (L = k*chunk + 1, ngroups > 1 and d_state 256, initial state, NaN-poisoned outputs)."""
    import torch

    from m2export.kernels.ssd.plan import tile_families
    from m2export.plugins import _cuda

    fam = tile_families(p)[tactic - 1]
    cc = _cuda.compute_capability(torch.cuda.current_device())
    k = aot.compile_aot_kernel(p.nheads, p.headdim, p.ngroups, p.d_state, p.dtype, SSMScanAttrs(),
                               aot.gpu_code_for(cc), tiles=fam)
    ref, dev, y, fs = oracle_case(p, seed=20 + tactic, dt_limit=(0.0, math.inf))
    torch.cuda.synchronize()
    image = k.ptx.encode()
    if _cuda.try_load_module(image) == _cuda.CUDA_ERROR_UNSUPPORTED_PTX_VERSION:
        image = _assemble(k.ptx, aot.ptx_target(k.ptx))
    _launch_like_tensorrt(k, image, p, dev, y, fs)
    assert_close(f"y ({fam})", ref.y, y.cpu(), rel=Y_REL[p.dtype])
    assert_close(f"final_state ({fam})", ref.final_state, fs.cpu(), rel=STATE_REL[p.dtype])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("headdim, ngroups, d_state", [(64, 2, 128), (80, 2, 128), (80, 4, 256), (128, 1, 256)],
                         ids=["P64", "P80", "P80_N256", "P128_N256"])
def test_aot_decode_kernel_launched_like_tensorrt(dtype, headdim, ngroups, d_state):
    """The decode engine's AOT kernel (seqlen the constant 1): the per-head step kernel (16-row tiles at head dim
    80, where the JIT launch takes the flat-row kernel), its PTX in TensorRT's slot order, launched with the
    plugin's 4-D tensors and the extras computed from their shapes; equal to ssm_step (cuTile, JIT) and the
    float64 oracle."""
    import torch

    from m2export.plugins import _cuda

    p = SSMScanProblem(64, 1, 8, headdim, ngroups, d_state, dtype)
    cc = _cuda.compute_capability(torch.cuda.current_device())
    attrs = SSMScanAttrs(dt_min=1e-3, dt_max=0.5)
    k = aot.compile_aot_kernel(p.nheads, p.headdim, p.ngroups, p.d_state, p.dtype, attrs, aot.gpu_code_for(cc),
                               None, True)
    assert k.name.startswith("ssd_step_kernel")
    _check_aot_decode(k, p, attrs, seed=9)


#: (headdim, ngroups, d_state, block_p, occupancy): AOT decode tiles other than aot_spec's rule (a tile-rule sweep
#: in benchmarks/bench_ssd_aot.py --decode-tiles); the masked-free tiles divide headdim
AOT_DECODE_TILES = [(64, 2, 128, 32, 4), (64, 2, 128, 16, 8), (64, 2, 128, 64, 3), (128, 1, 256, 16, 4),
                    (128, 1, 256, 8, 8), (80, 4, 128, 16, 8), (128, 1, 256, 32, 6), (128, 1, 256, 16, 6),
                    (80, 4, 256, 16, 6), (64, 2, 64, 32, 8)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("headdim, ngroups, d_state, block_p, occupancy", AOT_DECODE_TILES,
                         ids=[f"P{c[0]}_N{c[2]}_tile{c[3]}_occ{c[4]}" for c in AOT_DECODE_TILES])
def test_aot_decode_tiles_launched_like_tensorrt(dtype, headdim, ngroups, d_state, block_p, occupancy):
    """The AOT decode kernel with other tiles and occupancy hints, exported on the plugin's path (trt_signature with
    the contract's fixed sizes), launched like TensorRT: equal to the float64 oracle and to ssm_step."""
    import torch

    from m2export.plugins import _cuda

    p = SSMScanProblem(64, 1, 8, headdim, ngroups, d_state, dtype)
    gpu_code = aot.gpu_code_for(_cuda.compute_capability(torch.cuda.current_device()))
    attrs = SSMScanAttrs(dt_min=1e-3, dt_max=0.5)
    k = aot.compile_aot_kernel(p.nheads, p.headdim, p.ngroups, p.d_state, p.dtype, attrs, gpu_code, decode=True,
                               step_tile=(block_p, occupancy))
    assert k.grid(1, 8, headdim) == (8, headdim // block_p, 1)
    _check_aot_decode(k, p, attrs, seed=11 + block_p)


def _check_aot_decode(k, p: SSMScanProblem, attrs: SSMScanAttrs, *, seed: int) -> None:
    """Launch the AOT decode kernel ``k`` like TensorRT on fresh inputs of ``p`` (NaN-poisoned outputs) and compare
    with the float64 oracle and with ssm_step (JIT)."""
    import torch

    from m2export.kernels.ssd_step import ssm_step
    from m2export.plugins import _cuda

    dtype = p.dtype
    ref, dev, y, fs = oracle_case(p, seed=seed, dt_limit=attrs.dt_limit)
    torch.cuda.synchronize()
    image = k.ptx.encode()
    if _cuda.try_load_module(image) == _cuda.CUDA_ERROR_UNSUPPORTED_PTX_VERSION:
        image = _assemble(k.ptx, aot.ptx_target(k.ptx))
    _launch_like_tensorrt(k, image, p, dev, y, fs)
    assert_close("y", ref.y, y.cpu(), rel=Y_REL[p.dtype])
    assert_close("final_state", ref.final_state, fs.cpu(), rel=STATE_REL[p.dtype])
    step = ssm_step(dev["x"][:, 0], dev["dt"][:, 0], dev["A"], dev["B"][:, 0], dev["C"][:, 0], dev["D"], dev["dt_bias"],
                    dev["initial_state"], dt_limit=attrs.dt_limit)
    torch.cuda.synchronize()
    # another headdim tile than the JIT launch picks (batch is a runtime extent here): same math, y may differ
    # by its final rounding
    assert_close("y vs ssm_step", step.y.double().cpu(), y[:, 0].cpu(),
                 rel={"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}[dtype])
    assert_close("state vs ssm_step", step.final_state.double().cpu(), fs.cpu(), rel=1e-5)


def _assemble(ptx: str, target: str) -> bytes:
    import shutil
    import subprocess
    import tempfile

    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("driver too old for the PTX ISA and no ptxas on PATH to assemble it")
    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "k.ptx", Path(d) / "k.cubin"
        src.write_text(ptx)
        subprocess.run([ptxas, f"-arch={target}", str(src), "-o", str(dst)], check=True, capture_output=True)
        return dst.read_bytes()


def test_no_cuda_driver_is_backend_unavailable(monkeypatch):
    """Where libcuda is missing (this CPU machine), the driver helpers raise BackendUnavailable, not OSError."""
    import ctypes

    from m2export.plugins import _cuda

    def no_lib(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(_cuda, "_LIB", None)
    monkeypatch.setattr(ctypes, "CDLL", no_lib)
    with pytest.raises(BackendUnavailable, match="no CUDA driver") as e:
        _cuda.device_count()
    assert "NVIDIA GPU" in e.value.hint
    from m2export.trt.build import require_gpu

    with pytest.raises(BackendUnavailable, match="no CUDA driver"):
        require_gpu()


def test_launch_packs_arguments_like_tensorrt(monkeypatch):
    """LoadedKernel.launch (used by the GPU test) passes u64 pointers and int32 extras by address, in slot order."""
    import ctypes

    from m2export.plugins import _cuda

    seen = {}

    class FakeLib:
        def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
            seen.update(grid=(gx, gy, gz), block=(bx, by, bz), smem=smem, stream=stream.value,
                        args=[ctypes.c_uint64.from_address(params[0]).value,
                              ctypes.c_int32.from_address(params[1]).value,
                              ctypes.c_int32.from_address(params[2]).value,
                              ctypes.c_uint64.from_address(params[3]).value])
            return 0

    monkeypatch.setattr(_cuda, "_LIB", FakeLib())
    k = _cuda.LoadedKernel(ctypes.c_void_p(1), ctypes.c_void_p(2))
    k.launch((6, 1, 2), (256,), [("u64", 0xDEADBEEF000), ("i32", -7), ("i32", aot.float32_bits(math.inf)),
                                 ("u64", 0x10)], stream=99)
    assert seen == dict(grid=(6, 1, 2), block=(256, 1, 1), smem=0, stream=99,
                        args=[0xDEADBEEF000, -7, 0x7F800000, 0x10])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("p, dt_limit", [AOT_CASES[0], AOT_CASES[2]])
@pytest.mark.parametrize("isa", ["tileiras", "driver"], ids=["isa_as_emitted", "isa_rewritten_to_driver"])
def test_aot_ptx_through_driver_jit_matches_or_is_refused(p, dt_limit, isa):
    """TensorRT's own path: the driver JIT-compiles the embedded PTX. Either the build-time check refuses
    the PTX (BackendUnavailable naming the ISA/driver: no engine is built) or the kernel the driver compiled
    reproduces the oracle -- never an engine that loads and computes garbage. ``isa_rewritten_to_driver``
    is ``--aot-ptx-isa`` set to the driver's own ISA (CUDA 13.x drivers: 9.x)."""
    import torch

    from m2export.plugins import _cuda

    driver = _cuda.driver_version()
    if isa == "driver" and driver[0] != 13:
        pytest.skip(f"the PTX ISA of CUDA {driver[0]}.{driver[1]} drivers is not derived here")
    cc = _cuda.compute_capability(torch.cuda.current_device())
    attrs = SSMScanAttrs(dt_min=dt_limit[0], dt_max=dt_limit[1])
    k = aot.compile_aot_kernel(p.nheads, p.headdim, p.ngroups, p.d_state, p.dtype, attrs, aot.gpu_code_for(cc),
                               (9, driver[1]) if isa == "driver" else None)
    torch.zeros(1, device="cuda")  # a current context for the driver calls
    try:
        aot.check_target(k.ptx, cc=cc, driver=driver, load=_cuda.try_load_module)
    except BackendUnavailable as e:
        print(f"\n{p} ISA {aot.ptx_version(k.ptx)}: refused at build time: {e}")
        assert f"CUDA {driver[0]}.{driver[1]}" in str(e) and "plugin='jit'" in e.hint
        return
    ref, dev, y, fs = oracle_case(p, seed=5, dt_limit=attrs.dt_limit)
    torch.cuda.synchronize()
    _launch_like_tensorrt(k, k.ptx.encode(), p, dev, y, fs)
    print(f"\n{p} ISA {aot.ptx_version(k.ptx)}: driver JIT (CUDA {driver[0]}.{driver[1]}) accepted it")
    assert_close("y", ref.y, y.cpu(), rel=Y_REL[p.dtype])
    assert_close("final_state", ref.final_state, fs.cpu(), rel=STATE_REL[p.dtype])
