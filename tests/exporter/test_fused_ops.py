"""The m2export::CausalConv1d and m2export::GatedRMSNorm ONNX function bodies in ONNX Runtime vs float64 references.

One-node models (``conv1d_node_model`` / ``gated_norm_node_model``) run in ONNX Runtime (CPU) on fresh random
inputs; the references are the kernels' own float64 references (``causal_conv1d_ref`` / ``gated_rmsnorm_ref`` with
``dtype=torch.float64``), themselves checked against explicit sums in tests/kernels. Bounds (rel-L2): float32
internals, 1e-5 in fp32 graphs; fp16 graphs carry the rounding of their inputs' cast and of the output, 2e-3.
The conv state holds input values: it must match exactly.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from m2export import contract_conv1d as cc
from m2export import contract_gated_norm as cg
from m2export.exporter.fused_ops import (causal_conv1d_function_proto, conv1d_node_model, gated_norm_node_model,
                                         gated_rmsnorm_function_proto)
from m2export.exporter.ssm_scan_op import PLUGIN_ATTRIBUTES
from m2export.kernels.conv1d import causal_conv1d_ref
from m2export.kernels.gated_norm import gated_rmsnorm_ref
from tests.helpers import assert_close, stable_seed

ort = pytest.importorskip("onnxruntime")

REL = {"float32": 1e-5, "float16": 2e-3}
DT = {"float32": torch.float32, "float16": torch.float16}


def _session(model: onnx.ModelProto):
    onnx.checker.check_model(model, full_check=True)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


# ----------------------------------------------------------------------------- CausalConv1d
CONV_CASES = {  # (batch, seqlen, conv_dim, d_conv, initial state, bias)
    "L1_decode": (2, 1, 24, 4, True, True),
    "L2_lt_dconv": (1, 2, 24, 4, True, True),
    "L3_lt_dconv": (3, 3, 40, 4, True, True),
    "L4_eq_dconv": (1, 4, 24, 4, False, True),
    "L37_B3": (3, 37, 200, 4, True, True),
    "dconv2": (2, 5, 17, 2, True, True),
    "dconv3_nobias": (2, 6, 30, 3, True, False),
    "L1_dconv2_zero_state": (4, 1, 9, 2, False, True),
    "tile_edges_L17_C129": (2, 17, 129, 4, True, True),  # one past the kernel's default 16 x 128 tile
    "tile_L16_C128": (1, 16, 128, 4, True, True),
}


def _conv_inputs(batch, seqlen, conv_dim, d_conv, state, bias, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    dt = DT[dtype]
    x = torch.randn(batch, seqlen, conv_dim, generator=g).to(dt)
    w = (torch.randn(conv_dim, d_conv, generator=g) * 0.5).to(dt)
    b = (torch.randn(conv_dim, generator=g) * 0.3).to(dt) if bias else torch.zeros(conv_dim, dtype=dt)
    s = torch.randn(batch, conv_dim, d_conv - 1, generator=g).to(dt) if state else \
        torch.zeros(batch, conv_dim, d_conv - 1, dtype=dt)
    return x, w, b, s


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("activation", ["silu", "none"])
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv1d_body_matches_the_reference(case, activation, dtype):
    x, w, b, s = _conv_inputs(*CONV_CASES[case], dtype, stable_seed("conv", case, activation, dtype))
    ref = causal_conv1d_ref(x, w, b, s, activation=activation, dtype=torch.float64)
    sess = _session(conv1d_node_model(dtype, activation))
    y, final = sess.run(None, {"x": x.numpy(), "weight": w.numpy(), "bias": b.numpy(), "conv_state": s.numpy()})
    assert y.dtype == final.dtype == np.dtype(dtype)
    assert y.shape == tuple(ref.y.shape) and final.shape == tuple(ref.final_conv_state.shape)
    assert_close("y", ref.y, torch.from_numpy(y).double(), rel=REL[dtype])
    assert torch.equal(torch.from_numpy(final).double(), ref.final_conv_state)


def test_conv1d_body_prefill_then_steps_equals_one_prefill():
    """Prefill 5 tokens, then 3 one-token calls through the returned state == one 8-token call (the decode path)."""
    x, w, b, s = _conv_inputs(2, 8, 24, 4, True, True, "float32", stable_seed("conv_split"))
    sess = _session(conv1d_node_model())
    run = lambda xx, ss: sess.run(None, {"x": xx.numpy(), "weight": w.numpy(), "bias": b.numpy(),  # noqa: E731
                                         "conv_state": ss})
    y_all, st_all = run(x, s.numpy())
    ys, st = [], s.numpy()
    for a, e in ((0, 5), (5, 6), (6, 7), (7, 8)):
        y, st = run(x[:, a:e].contiguous(), st)
        ys.append(y)
    np.testing.assert_allclose(np.concatenate(ys, axis=1), y_all, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(st, st_all)


def test_conv1d_function_declares_the_contract():
    fn = causal_conv1d_function_proto()
    assert (fn.domain, fn.name) == (cc.OP_DOMAIN, cc.OP_NAME)
    assert tuple(fn.input) == cc.INPUT_NAMES and tuple(fn.output) == cc.OUTPUT_NAMES
    declared = {a.name for a in fn.attribute_proto}
    assert declared == {a.name for a in cc.ATTRIBUTES} | set(PLUGIN_ATTRIBUTES)
    assert {n.op_type for n in fn.node} & {"Conv", "Loop", "Scan"} == set()


# ----------------------------------------------------------------------------- GatedRMSNorm
NORM_CASES = {  # (leading shape, d_inner, group_size)
    "one_group": ((2, 5), 96, 96),
    "ngroups8": ((3, 4), 8 * 24, 24),
    "ngroups8_not_pow2": ((1, 7), 8 * 12, 12),
    "ngroups3_odd": ((2, 3), 3 * 20, 20),
    "decode_L1": ((4, 1), 2 * 40, 40),
    "group_size_0": ((2, 2), 48, 0),
    "rank2": ((6,), 8 * 10, 10),
}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("case", list(NORM_CASES))
def test_gated_norm_body_matches_the_reference(case, norm_before_gate, dtype):
    lead, d, gs = NORM_CASES[case]
    g = torch.Generator().manual_seed(stable_seed("norm", case, norm_before_gate, dtype))
    x = (torch.randn(*lead, d, generator=g) * 2).to(DT[dtype])
    z = torch.randn(*lead, d, generator=g).to(DT[dtype])
    w = (1 + 0.2 * torch.randn(d, generator=g)).to(DT[dtype])
    eps = 1e-3 if dtype == "float16" else 1e-6  # a non-default eps reaches the body
    p = cg.validate(x, z, w, group_size=gs, eps=eps, norm_before_gate=norm_before_gate)
    p = cg.GatedNormProblem(rows=p.rows, d_inner=d, group_size=p.group_size, eps=eps,
                            norm_before_gate=norm_before_gate, dtype=dtype)
    model = gated_norm_node_model(p, rank=len(lead) + 1)
    if gs == 0:  # the attribute's "one group" spelling
        next(a for a in model.graph.node[0].attribute if a.name == "group_size").i = 0
    (out,) = _session(model).run(None, {"x": x.numpy(), "z": z.numpy(), "weight": w.numpy()})
    ref = gated_rmsnorm_ref(x, z, w, group_size=gs or None, eps=eps, norm_before_gate=norm_before_gate,
                            dtype=torch.float64)
    assert out.dtype == np.dtype(dtype) and out.shape == tuple(x.shape)
    assert_close("out", ref, torch.from_numpy(out).double(), rel=REL[dtype])


def test_gated_norm_groups_are_normalised_alone():
    """A group scaled by 1000 leaves the other groups' outputs unchanged (a body over all channels would not)."""
    g = torch.Generator().manual_seed(stable_seed("norm_alone"))
    x, z, w = torch.randn(2, 3, 60, generator=g), torch.randn(2, 3, 60, generator=g), torch.ones(60)
    p = cg.GatedNormProblem(rows=6, d_inner=60, group_size=20)
    sess = _session(gated_norm_node_model(p))
    (a,) = sess.run(None, {"x": x.numpy(), "z": z.numpy(), "weight": w.numpy()})
    x2 = x.clone()
    x2[..., 20:40] *= 1000
    (b,) = sess.run(None, {"x": x2.numpy(), "z": z.numpy(), "weight": w.numpy()})
    np.testing.assert_allclose(a[..., :20], b[..., :20], rtol=1e-6)
    np.testing.assert_allclose(a[..., 40:], b[..., 40:], rtol=1e-6)
    np.testing.assert_allclose(a[..., 20:40], b[..., 20:40], rtol=1e-3)  # RMS-normalised: scale drops out (but eps)


def test_gated_norm_function_declares_the_contract():
    fn = gated_rmsnorm_function_proto()
    assert (fn.domain, fn.name) == (cg.OP_DOMAIN, cg.OP_NAME)
    assert tuple(fn.input) == cg.INPUT_NAMES and tuple(fn.output) == cg.OUTPUT_NAMES
    assert {a.name for a in fn.attribute_proto} == set(cg.ATTRIBUTE_NAMES) | set(PLUGIN_ATTRIBUTES)
