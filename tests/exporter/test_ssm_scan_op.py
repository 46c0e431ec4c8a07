"""The SSMScan ONNX function body (ssmscan flavour) and its inlined form (std flavour) vs the float64 oracle.

One-node models built by ``ssm_scan_node_model`` run in ONNX Runtime (CPU) on problems drawn from the
contract with ``tests.helpers.make_inputs``; the reference is ``ssm_scan_recurrent`` in float64.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
import torch

from m2export.contract import SSMScanAttrs, SSMScanProblem
from m2export.exporter.ssm_scan_op import PLUGIN_ATTRIBUTES, ssm_scan_fn, ssm_scan_node_model
from m2export.kernels.ssd.naive import ssm_scan_recurrent
from tests.helpers import assert_close, assert_cumsum_trt_safe, large_decay_inputs, make_inputs, \
    overflowing_decay_inputs

ort = pytest.importorskip("onnxruntime")

CHUNK = 8
# (batch, seqlen, nheads, headdim, ngroups, d_state)
CASES = {
    "L1": (1, 1, 4, 8, 1, 16),
    "L1_B3_G2": (3, 1, 8, 8, 2, 16),  # the If(seqlen == 1) step branch with batch and groups
    "L2": (2, 2, 4, 8, 2, 16),  # the shortest sequence through the chunked branch
    "L_lt_chunk": (1, 5, 4, 8, 1, 16),
    "L_eq_chunk": (1, CHUNK, 4, 8, 1, 16),
    "L_k_chunk_plus_1": (1, 3 * CHUNK + 1, 4, 8, 1, 16),
    "B3": (3, 11, 4, 8, 1, 16),
    "G2": (2, 19, 4, 8, 2, 16),
    "G4_H8": (1, 2 * CHUNK, 8, 4, 4, 8),
    "long_L200": (1, 200, 2, 4, 1, 8),
}
FP32_REL = 2e-5


def _session(model: onnx.ModelProto):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _feeds(inp: dict) -> dict:
    p_zero = None
    out = {}
    for k, v in inp.items():
        if v is None:  # ONNX graphs always carry all eight inputs: absent initial_state = zeros
            x, B = inp["x"], inp["B"]
            p_zero = np.zeros((x.shape[0], x.shape[2], x.shape[3], B.shape[3]), np.float32)
            out[k] = p_zero
        elif v.dtype == torch.bfloat16:
            import ml_dtypes

            out[k] = v.float().numpy().astype(ml_dtypes.bfloat16)
        else:
            out[k] = v.numpy()
    return out


@pytest.fixture(scope="module", params=["function", "inlined"])
def two_node_session(request):
    """Two SSMScan nodes in one graph with different attributes, sharing the one local function."""
    attrs = [SSMScanAttrs(chunk_size=CHUNK), SSMScanAttrs(chunk_size=3, dt_min=0.05, dt_max=0.4)]
    model = ssm_scan_node_model(attrs, inline=request.param == "inlined")
    onnx.checker.check_model(model, full_check=True)
    return attrs, _session(model)


@pytest.mark.parametrize("init_state", [True, False], ids=["init_state", "zero_state"])
@pytest.mark.parametrize("case", list(CASES))
def test_node_vs_oracle(two_node_session, case, init_state):
    attrs, sess = two_node_session
    p = SSMScanProblem(*CASES[case])
    inp = make_inputs(p, seed=list(CASES).index(case), init_state=init_state, dt_scale=2.0)
    outs = sess.run(None, _feeds(inp))
    for k, a in enumerate(attrs):
        ref = ssm_scan_recurrent(**inp, dt_softplus=a.dt_softplus, dt_limit=a.dt_limit)
        assert_close(f"{case} node{k} y", ref.y, torch.from_numpy(outs[2 * k]), rel=FP32_REL)
        assert_close(f"{case} node{k} final_state", ref.final_state, torch.from_numpy(outs[2 * k + 1]), rel=FP32_REL)


def test_nodes_with_different_attributes_differ(two_node_session):
    """Guards the attribute references: a dt_limit that bites must change node 1's output, not node 0's."""
    attrs, sess = two_node_session
    p = SSMScanProblem(2, 13, 4, 8, 2, 16)
    inp = make_inputs(p, seed=5, dt_scale=3.0)
    outs = sess.run(None, _feeds(inp))
    assert np.abs(outs[0] - outs[2]).max() > 1e-2
    unclamped = ssm_scan_recurrent(**inp)
    clamped = ssm_scan_recurrent(**inp, dt_limit=attrs[1].dt_limit)
    assert_close("node0 = no limit", unclamped.y, torch.from_numpy(outs[0]), rel=FP32_REL)
    assert_close("node1 = dt_limit", clamped.y, torch.from_numpy(outs[2]), rel=FP32_REL)


@pytest.mark.parametrize("inline", [False, True], ids=["function", "inlined"])
def test_no_softplus_and_large_dt(inline):
    """dt_softplus=0 uses dt + dt_bias as is; with softplus, dt + dt_bias > 20 passes through (no exp overflow)."""
    p = SSMScanProblem(1, 10, 2, 4, 1, 8)
    sess = _session(ssm_scan_node_model([SSMScanAttrs(chunk_size=4, dt_softplus=False), SSMScanAttrs(chunk_size=4)],
                                        inline=inline))
    inp = make_inputs(p, seed=7)
    inp["dt"] = inp["dt"].abs() * 0.1
    inp["dt_bias"] = inp["dt_bias"].abs() * 0.1
    outs = sess.run(None, _feeds(inp))
    inp["dt"][0, :3] = -1.0  # negative steps are clamped at dt_min = 0 (the contract: every step decays)
    ref = ssm_scan_recurrent(**inp, dt_softplus=False)
    outs = sess.run(None, _feeds(inp))
    assert_close("dt_softplus=0 y", ref.y, torch.from_numpy(outs[0]), rel=FP32_REL)
    assert_close("dt_softplus=0 final_state", ref.final_state, torch.from_numpy(outs[1]), rel=FP32_REL)
    inp["dt_bias"] = torch.full((2,), 60.0)  # softplus(v) = v for v > 20; exp(60) would overflow in fp32 mid-way
    inp["A"] = torch.tensor([-1e-3, -2e-3])
    outs = sess.run(None, _feeds(inp))
    ref = ssm_scan_recurrent(**inp)
    assert_close("large dt y", ref.y, torch.from_numpy(outs[2]), rel=FP32_REL)
    assert_close("large dt final_state", ref.final_state, torch.from_numpy(outs[3]), rel=FP32_REL)


@pytest.mark.parametrize("seqlen", [1, 512])
@pytest.mark.parametrize("inline", [False, True], ids=["function", "inlined"])
def test_large_decay_sums(inline, seqlen):
    """dt*A summing to -4,000 per 256 tokens (issue 16): segment sums from their own terms, 5e-6 of float64
    (the old body's cs_i - cs_j gave 1e-4); seqlen 1 takes the step branch."""
    p = SSMScanProblem(2, seqlen, 8, 16, 2, 16)
    sess = _session(ssm_scan_node_model([SSMScanAttrs(chunk_size=256), SSMScanAttrs(chunk_size=100)], inline=inline))
    inp = large_decay_inputs(p, seed=5)
    outs = sess.run(None, _feeds(inp))
    ref = ssm_scan_recurrent(**inp)
    for k in range(2):
        assert_close(f"node{k} y", ref.y, torch.from_numpy(outs[2 * k]), rel=5e-6)
        assert_close(f"node{k} final_state", ref.final_state, torch.from_numpy(outs[2 * k + 1]), rel=5e-6)


def test_body_branches_on_one_token():
    """The standard body is If(seqlen == 1): a one-token step (no CumSum, no chunk reshapes) else the chunked SSD."""
    from m2export.exporter.ssm_scan_op import ssm_scan_function_proto

    fn = ssm_scan_function_proto()
    ifs = [n for n in fn.node if n.op_type == "If"]
    assert len(ifs) == 1
    branches = {a.name: a.g for a in ifs[0].attribute}
    step_ops = {n.op_type for n in branches["then_branch"].node}
    chunk_ops = {n.op_type for n in branches["else_branch"].node}
    assert "CumSum" not in step_ops and "CumSum" in chunk_ops and "Exp" in step_ops
    cond = next(n for n in fn.node if n.output[0] == ifs[0].input[0])
    assert cond.op_type == "Equal"


def _native_session(p: SSMScanProblem):
    """The native flavour's SSMScan bodies for problems of ``p``'s sizes and dtype (one ORT com.microsoft
    LinearAttention for any seqlen, states (b, h, d_state, headdim)), inlined; three nodes with different
    attributes (one function each): a chunk size only, a binding dt_limit, and dt_softplus=0 with dt_min > 0.
    Returns (attrs, run): ``run(inputs)`` feeds the states in the native layout and returns the outputs in the
    contract's shapes: the final states back in (b, h, headdim, d_state), y (flat in the native body) as
    (b, L, h, headdim)."""
    from m2export.exporter.ssm_scan_op import NATIVE_OPSETS, NATIVE_STATE_PERM, NativeScanShape

    attrs = [SSMScanAttrs(chunk_size=CHUNK), SSMScanAttrs(chunk_size=3, dt_min=0.05, dt_max=0.4),
             SSMScanAttrs(dt_softplus=False, dt_min=0.01)]
    shape = NativeScanShape(p.nheads, p.headdim, p.ngroups, p.d_state)
    model = ssm_scan_node_model(attrs, dtype=p.dtype, native=shape)
    assert len(model.functions) == 3
    model = ssm_scan_node_model(attrs, dtype=p.dtype, inline=True, native=shape)
    onnx.checker.check_model(model, full_check=True)
    assert {o.domain: o.version for o in model.opset_import} == NATIVE_OPSETS
    # the graph I/O of the states is (batch, nheads, d_state, headdim)
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(model.graph.input) + list(model.graph.output)}
    assert dims["initial_state"] == dims["final_state.0"] == ["batch", "nheads", "d_state", "headdim"]
    assert dims["y.0"] == ["batch", "seqlen", p.nheads * p.headdim]
    sess = _session(model)

    def run(inp):
        feeds = _feeds(inp)
        feeds["initial_state"] = np.ascontiguousarray(feeds["initial_state"].transpose(NATIVE_STATE_PERM))
        outs = sess.run(None, feeds)
        return [o.reshape(*o.shape[:2], p.nheads, p.headdim) if k % 2 == 0 else o.transpose(NATIVE_STATE_PERM)
                for k, o in enumerate(outs)]

    return attrs, run


@pytest.mark.parametrize("init_state", [True, False], ids=["init_state", "zero_state"])
@pytest.mark.parametrize("case", list(CASES))
def test_native_node_vs_oracle(case, init_state):
    """The native body (L1 cases: one token, a decode step; the rest several), three attribute sets, vs the
    float64 oracle; headdim != d_state in every case, so a state read in the wrong layout fails."""
    p = SSMScanProblem(*CASES[case])
    attrs, run = _native_session(p)
    inp = make_inputs(p, seed=list(CASES).index(case), init_state=init_state, dt_scale=2.0)
    outs = run(inp)
    for k, a in enumerate(attrs):
        ref = ssm_scan_recurrent(**inp, dt_softplus=a.dt_softplus, dt_limit=a.dt_limit)
        assert_close(f"native {case} node{k} y", ref.y, torch.from_numpy(outs[2 * k]), rel=FP32_REL)
        assert_close(f"native {case} node{k} final_state", ref.final_state, torch.from_numpy(outs[2 * k + 1]),
                     rel=FP32_REL)


@pytest.mark.parametrize("seqlen", [1, 2, 512])
def test_native_node_large_decay_sums(seqlen):
    """ORT's LinearAttention on dt*A summing to -4,000 per 256 tokens (one token: the decode step)."""
    p = SSMScanProblem(2, seqlen, 8, 16, 2, 16)
    _, run = _native_session(p)
    inp = large_decay_inputs(p, seed=seqlen)
    y, s = run(inp)[:2]
    ref = ssm_scan_recurrent(**inp)
    assert_close("native y", ref.y, torch.from_numpy(y), rel=5e-6)
    assert_close("native final_state", ref.final_state, torch.from_numpy(s), rel=5e-6)


@pytest.mark.parametrize("seqlen", [1, 21])
def test_native_fp16_node(seqlen):
    """fp16 x/dt/B/C through the native body (one token and several): y fp16, final_state fp32, rel-L2 2e-3."""
    p = SSMScanProblem(2, seqlen, 4, 8, 2, 16, dtype="float16")
    _, run = _native_session(p)
    inp = make_inputs(p, seed=12)
    y, s = run(inp)[:2]
    assert y.dtype == np.float16 and s.dtype == np.float32
    ref = ssm_scan_recurrent(**inp)
    assert_close("fp16 y", ref.y, torch.from_numpy(y), rel=2e-3)
    assert_close("fp16 final_state", ref.final_state, torch.from_numpy(s), rel=2e-3)


@pytest.mark.parametrize("inline", [False, True], ids=["function", "inlined"])
def test_fp16_node(inline):
    """fp16 x/dt/B/C: internals fp32 (Cast islands), y fp16, final_state fp32; bound: rel-L2 2e-3."""
    p = SSMScanProblem(2, 21, 4, 8, 2, 16, dtype="float16")
    sess = _session(ssm_scan_node_model([SSMScanAttrs(chunk_size=CHUNK)], dtype="float16", inline=inline))
    inp = make_inputs(p, seed=11)
    y, s = sess.run(None, _feeds(inp))
    assert y.dtype == np.float16 and s.dtype == np.float32
    ref = ssm_scan_recurrent(**inp)
    assert_close("fp16 y", ref.y, torch.from_numpy(y), rel=2e-3)
    assert_close("fp16 final_state", ref.final_state, torch.from_numpy(s), rel=2e-3)


@pytest.mark.parametrize("inline", [False, True], ids=["function", "inlined"])
def test_bf16_node_reference_evaluator(inline):
    """bf16 graphs: ORT CPU has no bf16 kernels; the ONNX reference evaluator runs them. Bound rel-L2 1e-2."""
    from onnx.reference import ReferenceEvaluator

    p = SSMScanProblem(2, 13, 4, 8, 2, 16, dtype="bfloat16")
    model = ssm_scan_node_model([SSMScanAttrs(chunk_size=CHUNK)], dtype="bfloat16", inline=inline)
    onnx.checker.check_model(model, full_check=True)
    inp = make_inputs(p, seed=13)
    y, s = ReferenceEvaluator(model).run(None, _feeds(inp))
    assert s.dtype == np.float32
    ref = ssm_scan_recurrent(**inp)
    assert_close("bf16 y", ref.y, torch.from_numpy(y.astype(np.float32)), rel=1e-2)
    assert_close("bf16 final_state", ref.final_state, torch.from_numpy(s), rel=1e-2)


def test_function_declares_and_references_attributes():
    model = ssm_scan_node_model([SSMScanAttrs()])
    (fn,) = model.functions
    assert (fn.domain, fn.name) == ("m2export", "SSMScan")
    declared = {a.name for a in fn.attribute_proto}
    assert declared == {"chunk_size", "dt_softplus", "dt_min", "dt_max", *PLUGIN_ATTRIBUTES}
    referenced = {a.ref_attr_name for n in fn.node for a in n.attribute if a.ref_attr_name}
    assert referenced == {"chunk_size", "dt_softplus", "dt_min", "dt_max"}
    assert_cumsum_trt_safe(fn.node)
    assert {a.name: onnx.helper.get_attribute_value(a) for a in fn.attribute_proto}["dt_max"] == math.inf


def test_custom_op_opcheck():
    """torch.library.opcheck: the custom op's fake impl agrees with its eager impl (shapes, dtypes, no aliasing)."""
    p = SSMScanProblem(2, 9, 4, 8, 2, 16)
    inp = make_inputs(p, seed=3)
    args = tuple(inp[k] for k in ("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_state"))
    torch.library.opcheck(torch.ops.m2export.ssm_scan.default, args + (8, True, 0.0, math.inf),
                          test_utils=("test_schema", "test_faketensor"))
    y, s = ssm_scan_fn(*args[:5], chunk_size=8)  # optional inputs materialised as zeros
    ref = ssm_scan_recurrent(*args[:5])
    assert_close("ssm_scan_fn y", ref.y, y, rel=FP32_REL)
    assert s.dtype == torch.float32


def test_patcher_restores_on_error(tiny_g2):
    from m2export.exporter.patcher import Mamba2ModelPatcher
    from m2export.models.checkpoint import load_checkpoint

    model = load_checkpoint(tiny_g2).model
    before = [m.scan_fn for m in model.mixers]
    with pytest.raises(RuntimeError, match="boom"):
        with Mamba2ModelPatcher(model):
            assert all(m.scan_fn is ssm_scan_fn for m in model.mixers)
            raise RuntimeError("boom")
    assert [m.scan_fn for m in model.mixers] == before


@pytest.mark.parametrize("shape", [(2, 1000, 4, 2, 4, 4, 8), (1, 301, 2, 1, 8, 16, 4), (1, 37, 2, 2, 4, 8, 64)],
                         ids=["decay_largest", "states_largest", "one_chunk"])
def test_chunked_body_sizes_are_what_the_body_allocates(shape):
    """ChunkedBodySizes (the check's memory estimate of the scan body, m2export/check/data.py) from the body's own
    chunking: each of its parts is the size of a tensor the chunked branch allocates in ONNX Runtime, and the body
    allocates nothing larger than the largest part (its (nchunks + 1)^2 decay matrices, on long sequences)."""
    import onnx.inliner
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from m2export import contract
    from m2export.exporter import ssm_scan_op as so

    batch, L, h, g, p, n, Q = shape
    body = so._Body()
    e = so._entry(body)
    nodes, ins, outs = so._finish(body, *so._chunked_scan(body, e, so._chunk_len(body, e["L"])))
    fn = helper.make_function(contract.OP_DOMAIN, "Chunked", list(ins), list(outs), nodes,
                              [helper.make_opsetid("", 18)], attribute_protos=so._attribute_defaults())
    node = helper.make_node("Chunked", list(ins), list(outs), domain=contract.OP_DOMAIN,
                            **SSMScanAttrs.make(chunk_size=Q).onnx_attributes())
    graph = helper.make_graph([node], "chunked", [helper.make_tensor_value_info(i, TensorProto.FLOAT, None) for i in ins],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(contract.OP_DOMAIN, 1)],
                              functions=[fn])
    model.ir_version = 10
    model = onnx.inliner.inline_local_functions(model)
    declared = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.ValueInfoProto(name=o) for nd in model.graph.node for o in nd.output
                              if o not in declared)
    inp = make_inputs(SSMScanProblem(batch, L, h, p, g, n), seed=5)
    feeds = {k: inp[k].numpy() for k in ins}
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sizes = {v.nbytes for v in sess.run(None, feeds)}
    parts = so.ChunkedBodySizes.of(batch, L, h, p, n, Q)
    for name in ("decay", "intra", "states", "tokens"):
        assert getattr(parts, name) in sizes, f"{name}: {getattr(parts, name)} bytes, no tensor of that size"
    assert max(sizes) == max(parts.decay, parts.intra, parts.states, parts.tokens)
    assert parts.peak >= 2 * max(sizes)


@pytest.mark.parametrize("seqlen", [1, 7, 26])
@pytest.mark.parametrize("inline", [False, True], ids=["function", "inlined"])
def test_decay_overflowing_to_minus_inf(inline, seqlen):
    """A step whose dt*A is -inf in float32 decays the state to exactly 0 (as float64 says), never NaN: the body
    floors dt*A at a finite value before its 0/1 masked MatMuls (-inf * 0 = NaN) and its sums."""
    p = SSMScanProblem(2, seqlen, 4, 8, 2, 16)
    sess = _session(ssm_scan_node_model([SSMScanAttrs(chunk_size=8)], inline=inline))
    inp = overflowing_decay_inputs(p, seed=11)
    assert torch.isinf(inp["dt"].float()[:, ::3, 0] * inp["A"][0]).all()
    y, final = sess.run(None, _feeds(inp))
    ref = ssm_scan_recurrent(**inp)
    assert np.isfinite(y).all() and np.isfinite(final).all()
    assert_close("y", ref.y, torch.from_numpy(y), rel=FP32_REL)
    assert_close("final_state", ref.final_state, torch.from_numpy(final), rel=FP32_REL)
