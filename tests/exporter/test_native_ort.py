"""The native flavour's graph rewrites (m2export/exporter/native_ort.py), each alone vs the graph it rewrote.

Each pass is applied to a copy of the traced ssmscan-flavour graph of the tiny G=2 checkpoint (SSMScan nodes
with their model-local function, which ONNX Runtime runs) and both graphs run in ONNX Runtime on the same
random feeds: one token (the decode branches), 5 and 13 tokens, batch 1 and 3, random past states. Bound:
rel-L2 1e-6 (fp16 graphs 2e-3) on logits and every state (the rewrites change only float32 evaluation order). A pass that
matches nothing would make every comparison trivially pass, so each test also asserts how many it rewrote.
The whole native graph vs PyTorch is tests/exporter/test_export.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from m2export.exporter import native_ort
from m2export.exporter.manifest import read_manifest

pytest.importorskip("onnxruntime")
REL = 1e-6


def _traced(outdir):
    """The graph an export's native flavour is made from (export.base_graph: the ssmscan graph before its conv and
    gated norms become m2export::CausalConv1d / GatedRMSNorm nodes), as an onnx_ir model (weights in memory)."""
    from m2export.exporter.export import base_graph

    m = read_manifest(outdir)
    return m, base_graph(m.source_checkpoint, dtype=m.dtype, opset=m.opset)


def _session(model):
    import onnx_ir as ir
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def _compare(ref_model, new_model, vocab: int, dtype=np.float32, rel: float = REL):
    ref, new = _session(ref_model), _session(new_model)
    rng = np.random.default_rng(0)
    names = [o.name for o in ref.get_outputs()]
    assert names == [o.name for o in new.get_outputs()]
    for batch, seqlen in ((1, 1), (3, 1), (1, 5), (3, 13)):
        feeds = {"input_ids": rng.integers(0, vocab, (batch, seqlen), dtype=np.int64)}
        for i in ref.get_inputs():
            if i.name != "input_ids":
                shape = [batch if isinstance(d, str) else d for d in i.shape]
                feeds[i.name] = rng.standard_normal(shape).astype(np.float32 if "ssm" in i.name else dtype)
        for name, a, b in zip(names, ref.run(names, feeds), new.run(names, feeds)):
            a, b = a.astype(np.float64), b.astype(np.float64)
            err = np.linalg.norm(a - b) / np.linalg.norm(a)
            assert err <= rel, f"{name} at batch {batch}, {seqlen} tokens: rel-L2 {err:.2e} vs the unfused graph"


def _native_copy(model):
    """A copy with the native flavour's opset imports (what to_native_ort gives the graph before its passes)."""
    from m2export.exporter.ssm_scan_op import NATIVE_OPSETS

    new = model.clone()
    new.opset_imports.update(NATIVE_OPSETS)
    return new


@pytest.fixture(scope="module")
def traced(export_fp32_both):
    return _traced(export_fp32_both)


def test_fuse_causal_conv_vs_traced(traced):
    """One CausalConvWithState per layer for any number of tokens (channels-first on the traced conv's input, the
    states as the graph I/O has them; its SiLU), the traced conv, its SiLU and its state Slice gone."""
    m, model = traced
    new = _native_copy(model)
    assert native_ort.fuse_causal_conv(new) == m.model_config().n_layer
    ops = [n.op_type for n in new.graph]
    assert ops.count("CausalConvWithState") == m.model_config().n_layer
    assert not {"Conv", "If", "Slice", "Concat"} & set(ops)
    assert ops.count("Sigmoid") == sum(n.op_type == "Sigmoid" for n in model.graph) - m.model_config().n_layer
    _compare(model, new, m.model_config().vocab_size)


def test_fuse_rms_norm_vs_traced(traced):
    """RMSNormalization on the embedding and the grouped gated norms, SkipSimplifiedLayerNormalization on the
    residual sums (layers 1.. and norm_f)."""
    m, model = traced
    n_layer = m.model_config().n_layer
    new = _native_copy(model)
    assert native_ort.fuse_rms_norm(new) == 2 * n_layer + 1
    ops = [n.op_type for n in new.graph]
    assert ops.count("SkipSimplifiedLayerNormalization") == n_layer and "Reciprocal" not in ops
    # the gated norms' weights are the norms' scales (as (g, size) Reshapes), not Muls after them
    gated = [v for k, v in new.graph.initializers.items() if k.endswith("mixer.norm.weight")]
    assert gated and all({u.node.op_type for u in v.uses()} == {"Reshape"} for v in gated)  # equal ones: deduplicated
    _compare(model, new, m.model_config().vocab_size)


def test_fuse_rms_norm_one_group_vs_traced(export_fp32_g1_cli):
    """ngroups 1: the gated norm runs on the un-reshaped (b, L, d_inner) input with its weight, its two Reshapes
    and the weight Mul gone (no ones scale anywhere)."""
    m, model = _traced(export_fp32_g1_cli)
    n_layer = m.model_config().n_layer
    new = _native_copy(model)
    assert native_ort.fuse_rms_norm(new) == 2 * n_layer + 1
    assert not [k for k in new.graph.initializers if k.endswith(".ones")]
    reshapes = sum(n.op_type == "Reshape" for n in model.graph) - sum(n.op_type == "Reshape" for n in new.graph)
    assert reshapes == 2 * n_layer
    _compare(model, new, m.model_config().vocab_size)


@pytest.fixture(scope="module")
def traced_pieces(tiny_g2):
    """The ssmscan-flavour graph of the G=2 checkpoint with every piece traced (no builder: the exported graph's
    reshape targets are constants already, m2export/exporter/build.py), with its manifest."""
    from m2export.exporter import export as E
    from m2export.exporter.configs import GraphIO
    from m2export.models.checkpoint import load_checkpoint

    ck = load_checkpoint(tiny_g2)
    io = GraphIO.for_model(ck.spec, "fp32")
    model = E._trace(ck.model, io, GraphIO.DEFAULT_OPSET, build_pieces=False)
    E._rename_dims(model, io)
    E._attach_function(model, GraphIO.DEFAULT_OPSET)
    return model


def test_constant_reshapes_vs_traced(traced, traced_pieces):
    """Constant reshape targets: no Reshape reads a computed shape any more (its Shape/Squeeze/Concat arithmetic
    is gone; the Concats left are the convs' past-state concatenations). On the traced graph; the exported
    (built) graph has none to rewrite."""
    import onnx_ir as ir

    m, built = traced
    assert native_ort.constant_reshapes(_native_copy(built)) == 0
    model = traced_pieces
    n_layer = m.model_config().n_layer
    new = _native_copy(model)
    assert native_ort.constant_reshapes(new) >= 4 * n_layer
    reshapes = [n for n in new.graph if n.op_type == "Reshape"]
    assert reshapes and all(ir.convenience.get_const_tensor(n.inputs[1]) is not None for n in reshapes)
    assert [n.op_type for n in new.graph].count("Concat") == n_layer
    _compare(model, new, m.model_config().vocab_size)


def test_fuse_rms_norm_fp16_vs_traced(export_fp16_both):
    """fp16 graphs compute each RMSNorm in a float32 Cast island: the float32 cores fuse (the Casts stay) and the
    outputs stay within fp16 rounding of the unfused graph."""
    m, model = _traced(export_fp16_both)
    new = _native_copy(model)
    assert native_ort.fuse_rms_norm(new) == 2 * m.model_config().n_layer + 1
    _compare(model, new, m.model_config().vocab_size, dtype=np.float16, rel=2e-3)


def test_fold_reshapes_vs_unfolded():
    """fold_reshapes on a small graph: Reshape(Reshape), Unsqueeze(Reshape) and a Reshape to the shape its input
    has merge or go (counted, and the op counts drop), the outputs equal the unfolded graph's in ONNX Runtime; a
    chain whose second target's 0 would copy another dim, and a graph output, stay."""
    import onnx
    import onnx_ir as ir
    from onnx import TensorProto, helper

    c = lambda name, dims: helper.make_tensor(name, TensorProto.INT64, [len(dims)], dims)  # noqa: E731
    nodes = [
        helper.make_node("Reshape", ["x", "to_heads"], ["x4"]),  # (b, L, 24) -> (b, L, 4, 6)
        helper.make_node("Reshape", ["x4", "to_flat"], ["x3"]),  # back to (b, L, 24): merges, then is x itself
        helper.make_node("Mul", ["x3", "two"], ["a"]),
        helper.make_node("Unsqueeze", ["x4", "axis3"], ["x5"]),  # (b, L, 4, 1, 6): one Reshape of x
        helper.make_node("Mul", ["x5", "two"], ["b5"]),
        helper.make_node("Reshape", ["x4", "swap"], ["x4b"]),  # [0, 0, 0, 6] on (b, L, 4, 6): identity
        helper.make_node("Mul", ["x4b", "two"], ["c4"]),
        helper.make_node("Reshape", ["x", "lead"], ["y2"]),  # (b*L, 24)
        helper.make_node("Reshape", ["y2", "zero_late"], ["y3"]),  # its 0 copies y2's dim 1 (24), not x's: stays
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "L", 24])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, d) for n, d in (
            ("a", ["b", "L", 24]), ("b5", ["b", "L", 4, 1, 6]), ("c4", ["b", "L", 4, 6]), ("y3", [2, 24, "r"]),
            ("x4", ["b", "L", 4, 6]))],
        [c("to_heads", [0, 0, 4, 6]), c("to_flat", [0, 0, 24]), c("axis3", [3]), c("swap", [0, 0, 0, 6]),
         c("lead", [-1, 24]), c("zero_late", [2, 0, -1]), helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    ref = ir.serde.deserialize_model(model)
    new = ir.serde.deserialize_model(model)
    assert native_ort.fold_reshapes(new) == 4
    ops = [n.op_type for n in new.graph]
    assert "Unsqueeze" not in ops and ops.count("Reshape") == 4  # x4 (a graph output), x5, y2, y3
    assert new.graph.node(0).op_type == "Reshape" and [n.inputs[0].name for n in new.graph if n.op_type == "Mul"] \
        == ["x", "x5", "x4"]
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 4, 24)).astype(np.float32)}
    for a, b in zip(_session(ref).run(None, feeds), _session(new).run(None, feeds)):
        np.testing.assert_array_equal(a, b)
