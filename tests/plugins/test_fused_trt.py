"""The CausalConv1d and GatedRMSNorm TensorRT plugins without TensorRT: shape/dtype/autotune rules, registration
with stand-ins (tests/plugins/fakes.py), the JIT bodies' argument mapping on the CPU (torch backend, vs the float64
references; sequence_length 1 routed to the update kernel), and the AOT kernels exported for sm_90 on the CPU
(their TensorRT slot order and extras). GPU-marked: the JIT bodies with the cuTile kernels vs float64, and the AOT
kernels launched as TensorRT would. No TensorRT result anywhere: TensorRT is not installed here.
"""

from __future__ import annotations

import pytest
import torch

from m2export import contract_conv1d as cc
from m2export import contract_gated_norm as cg
from m2export.errors import BackendUnavailable, ContractError, InternalError
from m2export.kernels.conv1d import causal_conv1d_ref
from m2export.kernels.gated_norm import gated_rmsnorm_ref
from m2export.plugins import fused_trt as fp
from tests.helpers import assert_close, requires_cutile, stable_seed, tileiras_skip_reason
from tests.plugins.fakes import Expr, FakeTensor, exprs, fake_tensorrt

DT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TRT_DT = {"float32": "DataType.FLOAT", "float16": "DataType.HALF", "bfloat16": "DataType.BF16"}
Y_REL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
needs_tileiras = pytest.mark.skipif(tileiras_skip_reason() is not None, reason=tileiras_skip_reason() or "")


@pytest.fixture
def fresh_registry(monkeypatch):
    monkeypatch.setattr(fp, "_REGISTERED", {})
    yield


# ----------------------------------------------------------------------------- rules
def test_shape_rules_ints_and_shape_exprs():
    assert fp.conv_output_shapes((3, 7, 200), (200, 4)) == ((3, 7, 200), (3, 200, 3))
    y, s = fp.conv_output_shapes(exprs("batch", "seqlen", 200), exprs(200, 4))
    assert y == exprs("batch", "seqlen", 200) and s == (Expr("batch"), Expr(200), Expr(3))
    assert fp.norm_output_shapes(exprs("batch", "seqlen", 96)) == (exprs("batch", "seqlen", 96),)
    assert fp.output_dtypes("DataType.BF16", 2) == ("DataType.BF16", "DataType.BF16")


def test_autotune_types_follow_the_contracts():
    conv = fp.autotune_io_types(cc.OP_NAME)
    assert conv == [", ".join([t] * 6) for t in ("FP32", "FP16", "BF16")]  # 4 inputs, 2 outputs
    assert fp.autotune_io_types(cg.OP_NAME) == [", ".join([t] * 4) for t in ("FP32", "FP16", "BF16")]


def test_attribute_fields():
    assert fp.conv_activation(b"silu") == "silu" and fp.conv_activation("none") == "none"
    with pytest.raises(ContractError, match="activation"):
        fp.conv_activation("gelu")
    assert fp.norm_attrs(0, 1e-5, 0) == dict(group_size=None, eps=1e-5, norm_before_gate=False)
    assert fp.norm_attrs(24, 1e-6, 1) == dict(group_size=24, eps=1e-6, norm_before_gate=True)
    with pytest.raises(ContractError, match="norm_before_gate=2"):
        fp.norm_attrs(24, 1e-5, 2)
    with pytest.raises(InternalError, match="drifted"):
        fp.check_plugin_signature(cc.OP_NAME, ["x", "weight", "conv_state", "bias", "activation"], extra=())


# ----------------------------------------------------------------------------- registration (stand-ins)
def _conv_descs(trtp, dtype="bfloat16", seqlen="seqlen"):
    d = TRT_DT[dtype]
    return [trtp.TensorDesc(exprs("batch", seqlen, 200), d), trtp.TensorDesc(exprs(200, 4), d),
            trtp.TensorDesc(exprs(200), d), trtp.TensorDesc(exprs("batch", 200, 3), d)]


def _norm_descs(trtp, dtype="float16"):
    d = TRT_DT[dtype]
    return [trtp.TensorDesc(exprs("batch", "seqlen", 96), d), trtp.TensorDesc(exprs("batch", "seqlen", 96), d),
            trtp.TensorDesc(exprs(96), d)]


def test_register_with_tensorrt_stand_ins(fresh_registry, monkeypatch):
    trt, trtp = fake_tensorrt()
    assert fp.register(trt=trt, trtp=trtp) == {"jit": True, "aot": True}
    assert fp.register(trt=trt, trtp=trtp) == {"jit": True, "aot": True}  # idempotent
    conv, norm = trtp.defs[fp.CONV_PLUGIN_ID], trtp.defs[fp.NORM_PLUGIN_ID]
    assert set(conv) == set(norm) == {"desc", "autotune", "impl", "aot_impl"}

    ins = _conv_descs(trtp)
    y, s = conv["desc"](*ins, activation="silu")
    assert y.shape_expr == exprs("batch", "seqlen", 200) and y.dtype == "DataType.BF16"
    assert s.shape_expr == (Expr("batch"), Expr(200), Expr(3)) and s.dtype == "DataType.BF16"
    assert [c.io_types for c in conv["autotune"](*ins, outputs=(y, s))] == fp.autotune_io_types(cc.OP_NAME)
    seen = {}
    monkeypatch.setattr(fp, "run_conv_jit", lambda i, o, a, st: seen.update(i=i, o=o, a=a, st=st))
    conv["impl"](*ins, activation=b"silu", outputs=("Y", "S"), stream=77)
    assert seen == dict(i=tuple(ins), o=("Y", "S"), a="silu", st=77)

    nin = _norm_descs(trtp)
    (o,) = norm["desc"](*nin, group_size=24, eps=1e-5, norm_before_gate=0)
    assert o.shape_expr == nin[0].shape_expr and o.dtype == "DataType.HALF"
    monkeypatch.setattr(fp, "run_norm_jit", lambda i, o, a, st: seen.update(ni=i, no=o, na=a, nst=st))
    norm["impl"](*nin, group_size=24, eps=1e-5, norm_before_gate=1, outputs=("O",), stream=5)
    assert seen["ni"] == tuple(nin) and seen["na"] == dict(group_size=24, eps=1e-5, norm_before_gate=True)


def test_register_without_aot_support(fresh_registry):
    trt, trtp = fake_tensorrt(aot=False)
    assert fp.register(trt=trt, trtp=trtp) == {"jit": True, "aot": False}
    assert "aot_impl" not in trtp.defs[fp.CONV_PLUGIN_ID]


def test_register_refuses_old_tensorrt(fresh_registry):
    """The preamble both plugin modules share (backends.tensorrt_plugin_api): one line naming the plugins, nothing
    registered."""
    trt, trtp = fake_tensorrt(version="10.6.0")
    with pytest.raises(BackendUnavailable, match="^cannot register the CausalConv1d and GatedRMSNorm plugins: "
                                                 "TensorRT 10.6.0 is too old"):
        fp.register(trt=trt, trtp=trtp)
    assert fp._REGISTERED == {} and trtp.defs == {}


def test_plugins_package_registers_all_ops(monkeypatch):
    """m2export.plugins.register() registers SSMScan and both fused ops; aot only when every plugin has it."""
    import m2export.plugins as plugins
    from m2export.plugins import ssm_scan_trt

    monkeypatch.setattr(ssm_scan_trt, "register", lambda: {"jit": True, "aot": True})
    monkeypatch.setattr(fp, "register", lambda: {"jit": True, "aot": False})
    monkeypatch.setitem(plugins._STATE, "registered", None)
    assert plugins.register() == {"jit": True, "aot": False}


# ----------------------------------------------------------------------------- JIT bodies on the CPU (torch backend)
def _conv_case(batch, seqlen, conv_dim, d_conv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    dt = DT[dtype]
    x = torch.randn(batch, seqlen, conv_dim, generator=g).to(dt)
    w = (torch.randn(conv_dim, d_conv, generator=g) * 0.5).to(dt)
    b = (torch.randn(conv_dim, generator=g) * 0.3).to(dt)
    s = torch.randn(batch, conv_dim, d_conv - 1, generator=g).to(dt)
    return x, w, b, s


def _as_tensor(t):
    return t.tensor


@pytest.mark.parametrize("seqlen", [1, 2, 3, 9])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_run_conv_jit_plumbing_on_cpu(seqlen, dtype, monkeypatch):
    """Inputs and outputs bound by position as the contract orders them; seqlen 1 goes to conv_update (the
    update kernel) on a copy of the input state, longer ones to causal_conv1d; the input state is unchanged."""
    import m2export.kernels.conv1d as K

    x, w, b, s = _conv_case(3, seqlen, 40, 4, dtype, stable_seed("jit", seqlen, dtype))
    s_before = s.clone()
    y = torch.full((3, seqlen, 40), float("nan"), dtype=DT[dtype])
    st = torch.full((3, 40, 3), float("nan"), dtype=DT[dtype])
    calls = []
    for name in ("causal_conv1d", "conv_update"):
        real = getattr(K, name)
        monkeypatch.setattr(K, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    fp.run_conv_jit([FakeTensor(t) for t in (x, w, b, s)], [FakeTensor(y), FakeTensor(st)], "silu", 0,
                    backend="torch", as_tensor=_as_tensor)
    assert calls == ["conv_update" if seqlen == 1 else "causal_conv1d"]
    ref = causal_conv1d_ref(x, w, b, s, dtype=torch.float64)
    assert_close("y", ref.y, y.double(), rel=Y_REL[dtype])
    assert torch.equal(st.double(), ref.final_conv_state) and torch.equal(s, s_before)


@pytest.mark.parametrize("nbg", [0, 1])
def test_run_norm_jit_plumbing_on_cpu(nbg):
    g = torch.Generator().manual_seed(stable_seed("norm_jit", nbg))
    x, z = torch.randn(2, 5, 8 * 12, generator=g), torch.randn(2, 5, 8 * 12, generator=g)
    w = 1 + 0.1 * torch.randn(8 * 12, generator=g)
    out = torch.full_like(x, float("nan"))
    attrs = fp.norm_attrs(12, 1e-6, nbg)
    fp.run_norm_jit([FakeTensor(t) for t in (x, z, w)], [FakeTensor(out)], attrs, 0, backend="torch",
                    as_tensor=_as_tensor)
    ref = gated_rmsnorm_ref(x, z, w, group_size=12, eps=1e-6, norm_before_gate=bool(nbg), dtype=torch.float64)
    assert_close("out", ref, out.double(), rel=1e-5)


def test_run_jit_checks_the_io_count():
    with pytest.raises(InternalError, match="expected 4 and 2"):
        fp.run_conv_jit([1, 2, 3], [4, 5], "silu", 0, backend="torch", as_tensor=_as_tensor)
    with pytest.raises(InternalError, match="expected 3 and 1"):
        fp.run_norm_jit([1, 2, 3], [4, 5], {}, 0, backend="torch", as_tensor=_as_tensor)


# ----------------------------------------------------------------------------- AOT (export for sm_90 on the CPU)
@needs_tileiras
@pytest.mark.parametrize("seqlen", ["seqlen", 1])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_conv_aot_kernel_slots_and_extras(seqlen, dtype):
    """The conv's AOT kernel (the streaming kernel: every token and the final state in one launch), a dynamic prefill
    or a decode engine's constant 1: its PTX reordered to TensorRT's slots (x, weight, bias, conv_state | extras |
    y, final_conv_state), extras from the plugin's shapes, grid over tokens, channel tiles and batch."""
    shapes = {"x": exprs("batch", seqlen, 200), "weight": exprs(200, 4), "bias": exprs(200),
              "conv_state": exprs("batch", 200, 3), "y": exprs("batch", seqlen, 200),
              "final_conv_state": exprs("batch", 200, 3)}
    launch = fp.conv_aot_launch(shapes, TRT_DT[dtype], "silu", gpu_code="sm_90")
    k = launch["kernel"]
    from m2export.kernels.conv1d import cutile as K

    assert launch["name"].startswith(f"conv1d_{K.STREAM_IMPL}_kernel") and ".target sm_90" in launch["ptx"]
    slots = k.amap.trt_slots
    assert [s for s in slots if s.endswith(".ptr")] == ["x.ptr", "weight.ptr", "bias.ptr", "conv_state.ptr",
                                                        "y.ptr", "state_out.ptr"]
    assert slots[:4] == ("x.ptr", "weight.ptr", "bias.ptr", "conv_state.ptr") and slots[-2:] == ("y.ptr",
                                                                                                "state_out.ptr")
    named = dict(zip(launch["extra_names"], launch["extra_args"]))
    assert named["x.shape0"] == Expr("batch") and named["x.shape1"] == Expr(seqlen) and named["x.stride0"] == \
        Expr(seqlen) * 200
    assert named["state_out.shape1"] == Expr(200) and named["state_out.stride1"] == Expr(3)
    bt = dict((a.name, a.value) for a in fp.conv_aot_spec(dtype, 4, 200, True).args)["BLOCK_T"]
    assert launch["grid"][0] == (Expr(seqlen) + (bt - 1)) // bt and launch["grid"][2] == Expr("batch")


def test_conv_aot_needs_static_weight_dims():
    shapes = {"x": exprs("batch", "seqlen", 200), "weight": exprs(200, "d_conv")}
    with pytest.raises(BackendUnavailable, match="must be static") as e:
        fp.conv_aot_launch(shapes, "DataType.HALF", "silu", gpu_code="sm_90", compile_kernel=lambda *a: 1 / 0)
    assert "plugin='jit'" in e.value.hint


@needs_tileiras
@pytest.mark.parametrize("group_size,nbg", [(24, 0), (96, 1), (12, 0)])
def test_norm_aot_kernel_slots_and_extras(group_size, nbg):
    """The norm's AOT kernel for x of (batch, seqlen, 96): viewed as (rows, 96), rows = batch * seqlen; scalars
    group_size (int32) and eps (its float32 bits) among the extras."""
    from m2export.plugins import aot

    shapes = {"x": exprs("batch", "seqlen", 96), "z": exprs("batch", "seqlen", 96), "weight": exprs(96),
              "out": exprs("batch", "seqlen", 96)}
    launch = fp.norm_aot_launch(shapes, "DataType.HALF", fp.norm_attrs(group_size, 1e-6, nbg), gpu_code="sm_90")
    k = launch["kernel"]
    assert launch["name"].startswith("gated_rmsnorm_kernel")
    assert [s for s in k.amap.trt_slots if s.endswith(".ptr")] == ["x.ptr", "z.ptr", "weight.ptr", "out.ptr"]
    named = dict(zip(launch["extra_names"], launch["extra_args"]))
    rows = Expr("batch") * Expr("seqlen")
    assert named["x.shape0"] == rows and named["out.shape1"] == 96 and named["z.stride0"] == 96
    assert named["group_size"] == group_size and named["eps"] == aot.float32_bits(1e-6)
    assert launch["grid"][1] == 96 // group_size


# ----------------------------------------------------------------------------- GPU (run by the lead on the H200)
@pytest.mark.gpu
@requires_cutile
@pytest.mark.parametrize("seqlen", [1, 2, 3, 17, 300])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("on", ["side_stream", "stream_0"])
def test_conv_jit_body_on_gpu_vs_float64(seqlen, dtype, on):
    """The conv plugin's JIT body with the cuTile kernels (update kernel at seqlen 1) on a side stream or TensorRT's
    stream 0 (the legacy default stream), TensorRT-like views of NaN-poisoned outputs, vs the float64 reference; the
    input state is left as it was."""
    x, w, b, s = (t.cuda() for t in _conv_case(4, seqlen, 200, 4, dtype, stable_seed("gpu_conv", seqlen, dtype)))
    s_before = s.clone()
    y = torch.full((4, seqlen, 200), float("nan"), dtype=DT[dtype], device="cuda")
    st = torch.full((4, 200, 3), float("nan"), dtype=DT[dtype], device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    fp.run_conv_jit([FakeTensor(t) for t in (x, w, b, s)], [FakeTensor(y), FakeTensor(st)], "silu",
                    side.cuda_stream if on == "side_stream" else 0, as_tensor=fp.cached_torch_view)
    torch.cuda.synchronize()
    ref = causal_conv1d_ref(x.cpu(), w.cpu(), b.cpu(), s.cpu(), dtype=torch.float64)
    assert_close("y", ref.y, y.double().cpu(), rel=Y_REL[dtype])
    assert torch.equal(st.double().cpu(), ref.final_conv_state) and torch.equal(s, s_before)


@pytest.mark.gpu
@requires_cutile
@pytest.mark.parametrize("group_size,nbg", [(5120, 0), (8 * 80, 0), (96, 1)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_norm_jit_body_on_gpu_vs_float64(group_size, nbg, dtype):
    d = 5120 if group_size == 5120 else 8 * group_size
    g = torch.Generator().manual_seed(stable_seed("gpu_norm", group_size, nbg, dtype))
    x, z = (torch.randn(3, 7, d, generator=g).to(DT[dtype]).cuda() for _ in range(2))
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(DT[dtype]).cuda()
    out = torch.full_like(x, float("nan"))
    side = torch.cuda.Stream()
    fp.run_norm_jit([FakeTensor(t) for t in (x, z, w)], [FakeTensor(out)], fp.norm_attrs(group_size, 1e-5, nbg),
                    side.cuda_stream, as_tensor=fp.cached_torch_view)
    side.synchronize()
    ref = gated_rmsnorm_ref(x.cpu(), z.cpu(), w.cpu(), group_size=group_size, norm_before_gate=bool(nbg),
                            dtype=torch.float64)
    assert_close("out", ref, out.double().cpu(), rel={"float32": 1e-5, "bfloat16": 1e-2}[dtype])


def _launch_aot_like_tensorrt(launch: dict, inputs: list, outputs: list) -> None:
    """Load the AOT kernel's PTX (or, for a driver older than its ISA, the cubin ptxas assembles from it) and launch
    it as TensorRT's AOT launcher does: input pointers | int32 extras | output pointers; then synchronize."""
    from m2export.plugins import _cuda, aot
    from tests.plugins.test_aot import _assemble

    k = launch["kernel"]
    image = k.ptx.encode()
    if _cuda.try_load_module(image) == _cuda.CUDA_ERROR_UNSUPPORTED_PTX_VERSION:
        image = _assemble(k.ptx, aot.ptx_target(k.ptx))
    kern = _cuda.load_kernel(image, k.name)
    kern.launch(tuple(int(g) for g in launch["grid"]), k.block,
                [("u64", t.data_ptr()) for t in inputs] + [("i32", int(v)) for v in launch["extra_args"]]
                + [("u64", t.data_ptr()) for t in outputs], stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    kern.unload()


def _sm() -> str:
    from m2export.plugins import _cuda, aot

    return aot.gpu_code_for(_cuda.compute_capability(torch.cuda.current_device()))


@pytest.mark.gpu
@requires_cutile
@pytest.mark.parametrize("seqlen", [1, 2, 3, 4, 17, 300])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_conv_aot_kernel_launched_like_tensorrt(seqlen, dtype):
    """The conv's AOT kernel (the streaming kernel) launched with the plugin's dense tensors and the extras from
    their int shapes, NaN-poisoned outputs, vs the float64 reference (short, tile-edge and long sequences)."""
    x, w, b, s = (t.cuda().contiguous() for t in _conv_case(5, seqlen, 300, 4, dtype,
                                                            stable_seed("aot_conv", seqlen, dtype)))
    y = torch.full((5, seqlen, 300), float("nan"), dtype=DT[dtype], device="cuda")
    st = torch.full((5, 300, 3), float("nan"), dtype=DT[dtype], device="cuda")
    shapes = {n: tuple(t.shape) for n, t in zip(cc.INPUT_NAMES + cc.OUTPUT_NAMES, (x, w, b, s, y, st))}
    launch = fp.conv_aot_launch(shapes, dtype, "silu", gpu_code=_sm())
    _launch_aot_like_tensorrt(launch, [x, w, b, s], [y, st])
    ref = causal_conv1d_ref(x.cpu(), w.cpu(), b.cpu(), s.cpu(), dtype=torch.float64)
    assert_close("y", ref.y, y.double().cpu(), rel=Y_REL[dtype])
    assert torch.equal(st.double().cpu(), ref.final_conv_state)


@pytest.mark.gpu
@requires_cutile
@pytest.mark.parametrize("d_inner,group_size,nbg", [(5120, 5120, 0), (8 * 80, 80, 0), (8 * 96, 96, 1), (8 * 12, 12, 0)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_norm_aot_kernel_launched_like_tensorrt(d_inner, group_size, nbg, dtype):
    g = torch.Generator().manual_seed(stable_seed("aot_norm", d_inner, nbg, dtype))
    x, z = (torch.randn(3, 37, d_inner, generator=g).to(DT[dtype]).cuda() for _ in range(2))
    w = (1 + 0.1 * torch.randn(d_inner, generator=g)).to(DT[dtype]).cuda()
    out = torch.full_like(x, float("nan"))
    shapes = {"x": tuple(x.shape), "z": tuple(z.shape), "weight": tuple(w.shape), "out": tuple(out.shape)}
    launch = fp.norm_aot_launch(shapes, dtype, fp.norm_attrs(group_size, 1e-5, nbg), gpu_code=_sm())
    _launch_aot_like_tensorrt(launch, [x, z, w], [out])
    ref = gated_rmsnorm_ref(x.cpu(), z.cpu(), w.cpu(), group_size=group_size, norm_before_gate=bool(nbg),
                            dtype=torch.float64)
    assert_close("out", ref, out.double().cpu(), rel={"float32": 1e-5, "bfloat16": 1e-2}[dtype])
