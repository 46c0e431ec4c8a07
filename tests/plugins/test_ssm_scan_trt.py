"""TensorRT plugin m2export::SSMScan (m2export.plugins.ssm_scan_trt) without TensorRT.

CPU: the shape/dtype/autotune rules for every contract case (ints and ShapeExpr-like dims), the module
importing without TensorRT and saying why, and the whole registration against stand-ins of
``tensorrt.plugin`` that enforce its schema rules (tests/plugins/fakes.py): descriptor, autotune, the
JIT impl's argument plumbing and the AOT impl's launch description.
GPU (marked ``gpu``): the JIT impl body on torch CUDA tensors seen through TensorRT-like tensor objects
(data_ptr/shape/strides/dtype, bf16 included) against the float64 oracle.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from m2export import contract
from m2export.contract import INPUT_NAMES, OUTPUT_NAMES, SSMScanAttrs, SSMScanProblem
from m2export.errors import BackendUnavailable, InternalError
from m2export.plugins import ssm_scan_trt as plug
from tests.helpers import SSD_STATE_REL, SSD_Y_REL, TORCH_DTYPES, assert_close, oracle_case, requires_cutile
from tests.plugins.fakes import Expr, FakeTensor, fake_tensorrt

CASES = [
    pytest.param(SSMScanProblem(2, 100, 8, 64, 2, 64, "float32"), id="B2-L100-H8-P64-G2-N64-fp32"),
    pytest.param(SSMScanProblem(1, 1, 4, 32, 1, 128, "float16"), id="L1-G1-N128-fp16"),
    pytest.param(SSMScanProblem(3, 257, 8, 64, 8, 128, "bfloat16"), id="L_k_chunk_plus_1-G8-bf16"),
    pytest.param(SSMScanProblem(1, 64, 24, 64, 1, 128, "bfloat16"), id="L_eq_chunk-H24-bf16"),
    pytest.param(SSMScanProblem(4, 7, 2, 128, 2, 256, "float32"), id="L_lt_chunk-P128-N256-fp32"),
]


def _sym(p: SSMScanProblem, name: str) -> tuple:
    """TensorRT-like dims of ``name``: batch and seqlen symbolic, the rest constant expressions."""
    spec = next(s for s in contract.INPUTS + contract.OUTPUTS if s.name == name)
    return tuple(Expr(d) if d in ("batch", "seqlen") else Expr(v) for d, v in zip(spec.dims, p.shape_of(name)))


# ----------------------------------------------------------------------------- rules
@pytest.mark.parametrize("p", CASES)
def test_output_shapes_ints_and_shape_exprs(p):
    y, fs = plug.output_shapes(p.shape_of("x"), p.shape_of("B"))
    assert (y, fs) == (p.shape_of("y"), p.shape_of("final_state"))
    sy, sfs = plug.output_shapes(_sym(p, "x"), _sym(p, "B"))
    assert sy == _sym(p, "y") and sfs == _sym(p, "final_state")
    assert sy[0].v == "batch" and sy[1].v == "seqlen" and sfs[0].v == "batch"


@pytest.mark.parametrize("dtype", contract.FLOAT_DTYPES)
def test_output_dtypes(dtype):
    assert plug.output_dtypes(dtype, "F32") == (dtype, "F32")
    trt_name = {"float32": "DataType.FLOAT", "float16": "DataType.HALF", "bfloat16": "DataType.BF16"}[dtype]
    assert plug.output_dtypes(trt_name, "DataType.FLOAT") == (trt_name, "DataType.FLOAT")


def test_autotune_io_types_follow_the_contract():
    combos = plug.autotune_io_types()
    assert len(combos) == len(contract.input_dtype_combinations()) == 3
    names = INPUT_NAMES + OUTPUT_NAMES
    for s, want in zip(combos, contract.input_dtype_combinations()):
        types_ = [t.strip() for t in s.split(",")]
        assert len(types_) == len(names)
        assert types_ == [plug.TRT_TYPE_NAMES[want[n]] for n in names]
    assert combos[2].startswith("BF16, BF16, FP32, BF16, BF16, FP32, FP32, FP32, BF16, FP32")


def test_attrs_from_plugin_fields():
    # TensorRT's ONNX parser hands INT attributes as int32 and FLOAT as float32 fields
    a = plug.attrs_from_plugin(np.int32(64), np.int32(0), np.float32(1e-3), np.float32(np.inf))
    assert a == SSMScanAttrs(chunk_size=64, dt_softplus=False, dt_min=float(np.float32(1e-3)), dt_max=math.inf)
    assert plug.attrs_from_plugin(256, 1, 0.0, math.inf) == SSMScanAttrs()


def test_plugin_signature_drift_is_caught():
    plug.check_plugin_signature(list(INPUT_NAMES) + list(contract.ATTRIBUTE_NAMES) + ["outputs"], extra=["outputs"])
    with pytest.raises(InternalError, match="drifted from the contract"):
        plug.check_plugin_signature(list(INPUT_NAMES) + ["chunk_size"], extra=[])


def test_cuda_array_interface_describes_trt_tensors():
    t = SimpleNamespace(data_ptr=0x7F0000001000, shape=(2, 3, 4), strides=(12, 4, 1), dtype="DataType.BF16")
    cai = plug.cuda_array_interface(t)
    assert cai["typestr"] == "<i2" and cai["strides"] == (24, 8, 2) and cai["shape"] == (2, 3, 4)
    assert cai["data"] == (0x7F0000001000, False) and cai["version"] == 3 and cai["stream"] is None
    t32 = SimpleNamespace(data_ptr=256, shape=(5, 6), strides=None, dtype=torch.float32)
    assert plug.cuda_array_interface(t32)["strides"] == (24, 4)
    with pytest.raises(InternalError, match="unsupported tensor dtype"):
        plug.cuda_array_interface(SimpleNamespace(data_ptr=0, shape=(1,), strides=(1,), dtype="DataType.INT8"))


def test_run_jit_plumbing_on_cpu():
    """Inputs in contract order, attributes and outputs reach ssm_scan (torch backend, CPU views)."""
    p = SSMScanProblem(2, 33, 4, 32, 2, 32, "float32")
    attrs = SSMScanAttrs(chunk_size=16, dt_min=1e-3, dt_max=0.5)
    ref, inp, y, fs = oracle_case(p, seed=3, dt_limit=attrs.dt_limit, device="cpu")
    plug.run_jit([FakeTensor(inp[n]) for n in INPUT_NAMES], [FakeTensor(y), FakeTensor(fs)], attrs, 0,
                 backend="torch", as_tensor=lambda t: t.tensor)
    assert_close("y", ref.y, y, rel=1e-5)
    assert_close("final_state", ref.final_state, fs, rel=1e-5)
    with pytest.raises(InternalError, match="got 7 inputs"):
        plug.run_jit([FakeTensor(inp[n]) for n in INPUT_NAMES[:7]], [y, fs], attrs, 0, as_tensor=lambda t: t)


# ----------------------------------------------------------------------------- import / registration
def test_plugins_import_without_tensorrt_says_why():
    pytest.importorskip("polygraphy")
    try:
        import tensorrt  # noqa: F401
        pytest.skip("TensorRT is installed here")
    except ImportError:
        pass
    import m2export.plugins as plugins

    # register() first: the recorded reason is the last attempt's (an earlier test may have left another)
    with pytest.raises(BackendUnavailable, match="TensorRT is not installed") as e:
        plugins.register()
    assert plugins.registered() is None
    assert "TensorRT is not installed" in plugins.unavailable_reason()
    assert "pip install --extra-index-url https://pypi.nvidia.com tensorrt-cu12" in e.value.hint
    assert "tensorrt-cu13" in e.value.hint


@pytest.fixture
def fresh_registry(monkeypatch):
    monkeypatch.setattr(plug, "_REGISTERED", {})
    yield


def _descs(trtp, p: SSMScanProblem):
    names = INPUT_NAMES
    dts = {n: ({"float32": "DataType.FLOAT", "float16": "DataType.HALF", "bfloat16": "DataType.BF16"}[p.dtype]
               if p.dtype_of(n) != "float32" else "DataType.FLOAT") for n in names + OUTPUT_NAMES}
    return [trtp.TensorDesc(_sym(p, n), dts[n]) for n in names], dts


def test_register_with_tensorrt_stand_ins(fresh_registry, monkeypatch):
    trt, trtp = fake_tensorrt()
    assert plug.register(trt=trt, trtp=trtp) == {"jit": True, "aot": True}
    assert plug.register(trt=trt, trtp=trtp) == {"jit": True, "aot": True}  # idempotent
    d = trtp.defs[plug.PLUGIN_ID]
    assert set(d) == {"desc", "autotune", "impl", "aot_impl"}
    p = SSMScanProblem(2, 100, 8, 64, 2, 64, "bfloat16")
    ins, dts = _descs(trtp, p)
    attrs = dict(chunk_size=256, dt_softplus=1, dt_min=0.0, dt_max=math.inf)

    y, fs = d["desc"](*ins, **attrs)
    assert y.shape_expr == _sym(p, "y") and y.dtype == "DataType.BF16"
    assert fs.shape_expr == _sym(p, "final_state") and fs.dtype == trt.float32

    combos = d["autotune"](*ins, outputs=(y, fs))
    assert [c.io_types for c in combos] == plug.autotune_io_types() and {c.layouts for c in combos} == {"LINEAR"}
    # one tactic per tile family of the layer's dtype (what TensorRT times at build time)
    from m2export.kernels.ssd.plan import tile_families

    for c, combo in zip(combos, contract.input_dtype_combinations()):
        fams = tile_families(SSMScanProblem(1, 2, p.nheads, p.headdim, p.ngroups, p.d_state, combo["x"]))
        assert len(fams) > 1 and c.tactics == list(range(1, len(fams) + 1))

    seen = {}
    monkeypatch.setattr(plug, "run_jit", lambda i, o, a, s, tactic: seen.update(inputs=i, outputs=o, attrs=a, stream=s,
                                                                                tactic=tactic))
    d["impl"](*ins, **attrs, outputs=("Y", "FS"), stream=1234, tactic=3)
    assert seen == dict(inputs=tuple(ins), outputs=("Y", "FS"), attrs=SSMScanAttrs(), stream=1234, tactic=3)

    from tests.plugins.test_aot import META, fixture_cubin, fixture_spec
    from m2export.plugins import aot

    kernel = aot.build_aot_kernel(fixture_spec(), fixture_cubin(), META["symbol"], gpu_code="sm_90")
    keys = []
    monkeypatch.setattr(plug, "build_target", lambda: ("sm_90", (9, 0), (13, 4)))
    monkeypatch.setattr(plug, "compile_checked_kernel", lambda *k: keys.append(k) or kernel)
    pm = META["problem"]
    q = SSMScanProblem(3, 50, pm["nheads"], pm["headdim"], pm["ngroups"], pm["d_state"], pm["dtype"])
    ins, dts = _descs(trtp, q)
    outs = (trtp.TensorDesc(_sym(q, "y"), dts["y"]), trtp.TensorDesc(_sym(q, "final_state"), dts["final_state"]))
    name, ptx, params, extra = d["aot_impl"](*ins, **attrs, outputs=outs, tactic=0)
    assert keys == [(q.nheads, q.headdim, q.ngroups, q.d_state, "bfloat16", SSMScanAttrs(), "sm_90", None, False)]
    assert name == kernel.name and ptx == kernel.ptx
    assert (params.grid_x, params.grid_y, params.grid_z) == (Expr("batch") * q.nheads, 1, q.headdim // META["block_p"])
    assert (params.block_x, params.block_y, params.block_z) == kernel.block and params.shared_mem == 0
    assert len(extra) == len(kernel.amap.extra_args)
    named = dict(zip(kernel.amap.extra_args, (e.v for e in extra)))
    assert named["x.shape0"] == Expr("batch") and named["x.shape1"] == Expr("seqlen")
    assert named["final_state.stride0"] == Expr(q.nheads * q.headdim * q.d_state)

    plug.configure_aot(ptx_isa=(9, 0))
    try:
        d["aot_impl"](*ins, **attrs, outputs=outs, tactic=0)
        assert keys[-1][-2:] == ((9, 0), False)
    finally:
        plug.configure_aot(ptx_isa=None)


def test_register_without_aot_support(fresh_registry):
    trt, trtp = fake_tensorrt(aot=False)
    assert plug.register(trt=trt, trtp=trtp) == {"jit": True, "aot": False}
    assert "aot_impl" not in trtp.defs[plug.PLUGIN_ID]


def test_register_refuses_old_tensorrt(fresh_registry):
    trt, trtp = fake_tensorrt(version="10.6.0")
    with pytest.raises(BackendUnavailable, match="TensorRT 10.6.0 is too old"):
        plug.register(trt=trt, trtp=trtp)
    assert plug._REGISTERED == {}


# ----------------------------------------------------------------------------- GPU: JIT impl body
gpu = requires_cutile
#: the bounds of tests/kernels/test_ssd.py (the JIT impl runs that kernel)
Y_REL, STATE_REL = SSD_Y_REL, SSD_STATE_REL


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("p", CASES)
@pytest.mark.parametrize("side_stream", [False, True], ids=["default_stream", "side_stream"])
def test_jit_impl_body_vs_reference(p, side_stream):
    attrs = SSMScanAttrs(chunk_size=64, dt_min=0.0, dt_max=math.inf)
    ref, dev, y, fs = oracle_case(p, seed=11, dt_limit=attrs.dt_limit)
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())
    plug.run_jit([FakeTensor(dev[n]) for n in INPUT_NAMES], [FakeTensor(y), FakeTensor(fs)], attrs,
                 stream.cuda_stream)
    stream.synchronize()
    assert_close("y", ref.y, y.cpu(), rel=Y_REL[p.dtype])
    assert_close("final_state", ref.final_state, fs.cpu(), rel=STATE_REL[p.dtype])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", contract.FLOAT_DTYPES)
def test_jit_impl_decode_runs_the_step_kernel(dtype, monkeypatch):
    """A decode engine's enqueue (seqlen 1) goes through the decode-step kernel, equal to ssm_step and the oracle."""
    from m2export.kernels.ssd_step import cutile as step_mod
    from m2export.kernels.ssd_step import ssm_step

    calls = []
    real = step_mod.ssm_step_cutile
    monkeypatch.setattr(step_mod, "ssm_step_cutile", lambda *a, **k: calls.append(1) or real(*a, **k))
    p = SSMScanProblem(16, 1, 8, 64, 2, 128, dtype)
    attrs = SSMScanAttrs(chunk_size=128, dt_min=1e-3, dt_max=0.5)
    ref, dev, y, fs = oracle_case(p, seed=12, dt_limit=attrs.dt_limit)
    plug.run_jit([FakeTensor(dev[n]) for n in INPUT_NAMES], [FakeTensor(y), FakeTensor(fs)], attrs, 0)
    torch.cuda.default_stream().synchronize()
    assert calls == [1]
    assert_close("y", ref.y, y.cpu(), rel=Y_REL[p.dtype])
    assert_close("final_state", ref.final_state, fs.cpu(), rel=STATE_REL[p.dtype])
    step = ssm_step(dev["x"][:, 0], dev["dt"][:, 0], dev["A"], dev["B"][:, 0], dev["C"][:, 0], dev["D"], dev["dt_bias"],
                    dev["initial_state"], dt_limit=attrs.dt_limit)
    torch.cuda.synchronize()
    assert torch.equal(step.y, y[:, 0]) and torch.equal(step.final_state, fs)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", contract.FLOAT_DTYPES)
def test_torch_view_aliases_trt_memory(dtype):
    base = torch.randn(3, 5, 7, device="cuda").to(TORCH_DTYPES[dtype])
    t = base[:, 1:4]  # strided view: strides in elements like TensorRT reports them
    v = plug.torch_view(FakeTensor(t))
    assert v.dtype == t.dtype and v.shape == t.shape and v.stride() == t.stride()
    assert v.data_ptr() == t.data_ptr()
    assert torch.equal(v, t)
    v.fill_(1)
    assert torch.all(base[:, 1:4] == 1)


def test_views_of_trt_buffers_are_made_once_per_description(monkeypatch):
    """The JIT body's views are cached by (address, shape, strides, dtype): same buffer -> same view,
    any change -> a new one; the cache is bounded."""
    made = []
    monkeypatch.setattr(plug, "torch_view", lambda t: made.append(t) or object())
    monkeypatch.setattr(plug, "_VIEWS", {})
    t = SimpleNamespace(data_ptr=4096, shape=(2, 3), strides=(3, 1), dtype="DataType.BF16")
    v = plug.cached_torch_view(t)
    assert plug.cached_torch_view(SimpleNamespace(**vars(t))) is v and len(made) == 1
    for change in (dict(data_ptr=8192), dict(shape=(3, 2)), dict(strides=(1, 2)), dict(dtype="DataType.HALF")):
        assert plug.cached_torch_view(SimpleNamespace(**{**vars(t), **change})) is not v
    assert len(made) == 5
    monkeypatch.setattr(plug, "VIEW_CACHE_SIZE", 5)
    plug.cached_torch_view(SimpleNamespace(**{**vars(t), "data_ptr": 1}))
    assert len(plug._VIEWS) == 1


def test_plugin_errors_are_recorded_for_the_build(fresh_registry, monkeypatch):
    """An exception inside a plugin function reaches TensorRT (which only logs it) and is kept for m2export build."""
    from m2export.errors import ContractError

    trt, trtp = fake_tensorrt()
    plug.register(trt=trt, trtp=trtp)
    d = trtp.defs[plug.PLUGIN_ID]
    plug.take_plugin_errors()

    def fail(*a):
        raise ContractError("headdim: the cuTile SSD kernel supports headdim in (32, 64, 128, 256), got 48")

    monkeypatch.setattr(plug, "build_target", lambda: ("sm_90", (9, 0), (13, 4)))
    monkeypatch.setattr(plug, "compile_checked_kernel", fail)
    p = SSMScanProblem(1, 8, 2, 48, 1, 32, "float32")
    ins, dts = _descs(trtp, p)
    outs = (trtp.TensorDesc(_sym(p, "y"), dts["y"]), trtp.TensorDesc(_sym(p, "final_state"), dts["final_state"]))
    with pytest.raises(ContractError):
        d["aot_impl"](*ins, chunk_size=256, dt_softplus=1, dt_min=0.0, dt_max=math.inf, outputs=outs, tactic=0)
    errs = plug.take_plugin_errors()
    assert len(errs) == 1 and "got 48" in str(errs[0]) and plug.take_plugin_errors() == []


# ----------------------------------------------------------------------------- packed form (cu_seqlens)
def test_packed_plugin_rules_and_registration(fresh_registry, monkeypatch):
    """m2export::SSMScanPacked: final_state's first dim is len(cu_seqlens) - 1, cu_seqlens is INT32 in every
    autotune combination, and the JIT impl hands the nine inputs to run_jit in the packed contract's order."""
    trt, trtp = fake_tensorrt()
    plug.register(trt=trt, trtp=trtp)
    d = trtp.defs[plug.PACKED_PLUGIN_ID]
    assert set(d) == {"desc", "autotune", "impl"}  # JIT only: one launch group per sequence
    h, hp, g, n = 8, 64, 2, 128
    ins = [trtp.TensorDesc(tuple(Expr(v) for v in dims), dt) for dims, dt in (
        ((1, "T", h, hp), "DataType.BF16"), ((1, "T", h), "DataType.BF16"), ((h,), "DataType.FLOAT"),
        ((1, "T", g, n), "DataType.BF16"), ((1, "T", g, n), "DataType.BF16"), ((h,), "DataType.FLOAT"),
        ((h,), "DataType.FLOAT"), (("S", h, hp, n), "DataType.FLOAT"), (("S1",), "DataType.INT32"))]
    attrs = dict(chunk_size=64, dt_softplus=1, dt_min=0.0, dt_max=math.inf)
    y, fs = d["desc"](*ins, **attrs)
    assert y.shape_expr == ins[0].shape_expr and y.dtype == "DataType.BF16"
    assert fs.shape_expr == (Expr("S1") - 1, Expr(h), Expr(hp), Expr(n)) and fs.dtype == trt.float32
    types = plug.autotune_io_types(packed=True)
    assert types == [c.io_types for c in d["autotune"](*ins, outputs=(y, fs))]
    assert all(t.split(", ")[8] == "INT32" and len(t.split(", ")) == 11 for t in types)
    seen = {}
    monkeypatch.setattr(plug, "run_jit", lambda i, o, a, s, packed, tactic: seen.update(inputs=i, attrs=a,
                                                                                        packed=packed))
    d["impl"](*ins, **attrs, outputs=("Y", "FS"), stream=7, tactic=0)
    assert seen == dict(inputs=tuple(ins), attrs=SSMScanAttrs(chunk_size=64), packed=True)


def test_run_jit_packed_plumbing_on_cpu():
    """The packed JIT body (torch backend, CPU views) equals the packed float64 oracle; 8 inputs are refused."""
    from m2export.kernels.ssd.packed import ssm_scan_packed_recurrent
    from tests.kernels.test_ssd_packed import _packed_inputs

    p, inp, cu = _packed_inputs([40, 0, 25], "float32", seed=21)
    ref = ssm_scan_packed_recurrent(**inp, cu_seqlens=cu)
    y, fs = torch.full(tuple(ref.y.shape), math.nan), torch.full((3, p.nheads, p.headdim, p.d_state), math.nan)
    feeds = [FakeTensor(cu if n == "cu_seqlens" else inp[n]) for n in contract.PACKED_INPUT_NAMES]
    plug.run_jit(feeds, [FakeTensor(y), FakeTensor(fs)], SSMScanAttrs(chunk_size=16), 0, backend="torch",
                 as_tensor=lambda t: t.tensor, packed=True)
    assert_close("y", ref.y, y, rel=2e-5)
    assert_close("final_state", ref.final_state, fs, rel=2e-5)
    with pytest.raises(InternalError, match="SSMScanPacked plugin: got 8 inputs"):
        plug.run_jit(feeds[:8], [y, fs], SSMScanAttrs(), 0, as_tensor=lambda t: t, packed=True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", contract.FLOAT_DTYPES)
def test_jit_impl_packed_vs_oracle(dtype):
    """The packed JIT body on the GPU (cuTile, NaN-poisoned outputs, a side stream) vs the packed oracle."""
    from m2export.kernels.ssd.packed import ssm_scan_packed_recurrent
    from tests.kernels.test_ssd_packed import _packed_inputs

    p, inp, cu = _packed_inputs([1, 63, 64, 65, 0, 300], dtype, seed=22)
    ref = ssm_scan_packed_recurrent(**inp, cu_seqlens=cu)
    dev = {k: v.cuda() for k, v in inp.items()}
    y = torch.full(tuple(ref.y.shape), math.nan, dtype=TORCH_DTYPES[dtype], device="cuda")
    fs = torch.full((6, p.nheads, p.headdim, p.d_state), math.nan, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    feeds = [FakeTensor(cu.cuda() if n == "cu_seqlens" else dev[n]) for n in contract.PACKED_INPUT_NAMES]
    plug.run_jit(feeds, [FakeTensor(y), FakeTensor(fs)], SSMScanAttrs(chunk_size=64), stream.cuda_stream,
                 packed=True)
    stream.synchronize()
    assert_close("y", ref.y, y.float().cpu(), rel=Y_REL[dtype])
    assert_close("final_state", ref.final_state, fs.cpu(), rel=STATE_REL[dtype])


# ----------------------------------------------------------------------------- tactics (build-time autotune)
def test_tactics_select_tile_families_and_reach_the_kernel(monkeypatch):
    """Tactic i runs the layer's i-th tile family in ssm_scan (JIT) and in the AOT kernel's compile; tactic 0 is the
    heuristic; a tactic never advertised is an InternalError; a decode graph (seqlen the constant 1) and dynamic
    sizes advertise none."""
    from m2export.errors import InternalError
    from m2export.kernels.ssd.plan import tile_families

    p = SSMScanProblem(2, 100, 8, 64, 2, 128, "bfloat16")
    fams = tile_families(p)
    x_sym, B_sym = _sym(p, "x"), _sym(p, "B")
    assert plug.tiles_for_tactic(0, x_sym, B_sym, "bfloat16") is None
    assert [plug.tiles_for_tactic(i, x_sym, B_sym, "bfloat16") for i in range(1, len(fams) + 1)] == list(fams)
    with pytest.raises(InternalError, match="tactic 99 not among"):
        plug.tiles_for_tactic(99, x_sym, B_sym, "bfloat16")
    decode_x = (Expr("batch"), Expr(1), *x_sym[2:])
    assert plug.layer_tile_families(decode_x, B_sym, "bfloat16") == ()
    assert plug.layer_tile_families((*x_sym[:3], Expr("headdim")), B_sym, "bfloat16") == ()
    assert all(t == [] for _, t in plug.autotune_combinations(decode_x, B_sym))

    seen = []
    import m2export.kernels.ssd as ssd

    monkeypatch.setattr(ssd, "ssm_scan", lambda *a, **kw: seen.append(kw["tiles"]))
    inp = {n: torch.zeros(p.shape_of(n), dtype=torch.float32 if p.dtype_of(n) == "float32" else torch.bfloat16)
           for n in INPUT_NAMES}
    y, fs = torch.empty(p.shape_of("y"), dtype=torch.bfloat16), torch.empty(p.shape_of("final_state"))
    for tactic in (0, 2):
        plug.run_jit([FakeTensor(inp[n]) for n in INPUT_NAMES], [FakeTensor(y), FakeTensor(fs)], SSMScanAttrs(), 0,
                     tactic=tactic, as_tensor=lambda t: t.tensor)
    assert seen == [None, fams[1]]

    calls = []

    def compile_kernel(*args):
        calls.append(args)
        raise RuntimeError("stop after the call")  # the arguments are what this test checks

    shapes = {n: _sym(p, n) for n in INPUT_NAMES + OUTPUT_NAMES}
    for tactic in (0, 3):
        with pytest.raises(RuntimeError, match="stop"):
            plug.aot_launch(shapes, "bfloat16", SSMScanAttrs(), gpu_code="sm_90", compile_kernel=compile_kernel,
                            tactic=tactic)
    assert len(calls[0]) == 9 and calls[1][9] == fams[2]


def test_chosen_tactic_runs_on_a_one_token_call_of_a_prefill_engine(monkeypatch):
    """A prefill engine's layer advertises tactics (its seqlen is dynamic at build time); at run time the same
    engine may get one token (a 1-token prompt, a packed call of 1 token): the tactic TensorRT chose must still
    select its family. It raised InternalError ('tactic 2 not among the 0 advertised'): the run-time x's seqlen 1
    read as a decode graph's constant 1."""
    from dataclasses import replace

    import m2export.kernels.ssd as ssd
    from m2export.kernels.ssd.plan import tile_families

    p = SSMScanProblem(1, 1, 8, 64, 2, 128, "bfloat16")
    fams = tile_families(p)
    assert len(fams) > 1 and plug.layer_tile_families(_sym(replace(p, seqlen=100), "x"), _sym(p, "B"), "bfloat16")
    seen = []
    monkeypatch.setattr(ssd, "ssm_scan", lambda *a, **kw: seen.append(kw["tiles"]))
    inp = {n: torch.zeros(p.shape_of(n), dtype=torch.float32 if p.dtype_of(n) == "float32" else torch.bfloat16)
           for n in INPUT_NAMES}
    y, fs = torch.empty(p.shape_of("y"), dtype=torch.bfloat16), torch.empty(p.shape_of("final_state"))
    for tactic in (0, 2, len(fams)):
        plug.run_jit([FakeTensor(inp[n]) for n in INPUT_NAMES], [FakeTensor(y), FakeTensor(fs)], SSMScanAttrs(), 0,
                     tactic=tactic, as_tensor=lambda t: t.tensor)
    assert seen == [None, fams[1], fams[-1]]
