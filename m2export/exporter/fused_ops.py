"""CausalConv1d and GatedRMSNorm in the exported graph: ONNX nodes, their model-local function bodies, and the
pass that puts them into the ``ssmscan`` flavour.

The ops are defined once in :mod:`m2export.contract_conv1d` and :mod:`m2export.contract_gated_norm` (names, I/O,
attributes); this module only writes them as ONNX:

* :func:`causal_conv1d_function_proto` / :func:`gated_rmsnorm_function_proto` -- the model-local functions
  ``m2export::CausalConv1d`` and ``m2export::GatedRMSNorm`` (opset version 1), the contracts' semantics in
  standard ONNX ops with float32 internals, so ONNX Runtime (and any runtime without the TensorRT plugins)
  runs a graph holding the nodes. Attributes are referenced inside the bodies (one function per op serves
  every node); the nodes also carry ``plugin_namespace``/``plugin_version`` (declared, unused in the body) so
  TensorRT picks the registered plugins (:mod:`m2export.plugins.fused_trt`).
* :func:`fuse_ops` -- the ``ssmscan`` flavour's rewrite of an exported graph: each Mamba-2 conv
  (``Transpose -> Concat(past_conv_state, .) -> Conv(group=C) -> SiLU -> Transpose``, with the ``Slice`` of the
  concatenation that is ``present_conv_state``) becomes one ``CausalConv1d`` node, each gated RMSNorm (the
  per-group ``rms_core`` between ``y``/``silu(z)`` and the norm weight, either order) one ``GatedRMSNorm`` node.
  The ``std`` flavour keeps the standard ops, the ``native`` flavour ONNX Runtime's contrib ops (neither calls
  this pass).
* :func:`conv1d_node_model` / :func:`gated_norm_node_model` -- one-node models for the tests.

CausalConv1d body, in float32 (inputs cast, outputs ``CastLike(x)``)::

    xp    = Concat(Transpose(conv_state, [0, 2, 1]), x, axis=1)          # (batch, d_conv - 1 + seqlen, conv_dim)
    win   = Gather(xp, Range(seqlen)[:, None] + Range(d_conv)[None, :], axis=1)   # (batch, seqlen, d_conv, C)
    y     = act(ReduceSum(win * Transpose(weight), axis=2) + bias)       # (batch, seqlen, conv_dim)
    final = Transpose(xp[:, seqlen:], [0, 2, 1])                          # (batch, conv_dim, d_conv - 1)

Channels last throughout (the in_proj output's layout), no ``Conv`` (its ``group`` attribute would have to
be a constant of the node). ``act`` is SiLU when the node's ``activation`` is ``"silu"``: tested as
``Size(Unique(Concat([activation], ["silu"]))) == 1`` (opset 18 ``Equal`` has no strings), anything else is the
identity; the exporter writes only contract-checked values. At ``seqlen`` 1 it is the one-token update:
one graph serves prefill and decode, as ``m2export::SSMScan`` does. In an ONNX graph all four inputs are
present (the pass materialises a zero bias when the conv has none).

GatedRMSNorm body, in float32: ``G = d_inner / group_size`` (``group_size`` 0: one group),
``u = x * silu(z)`` (or ``x`` when ``norm_before_gate``), ``Reshape(u, [..., G, group_size])``,
``u * Reciprocal(Sqrt(ReduceMean(u^2, -1) + eps))``, back to ``[..., d_inner]``, ``* weight``, and
``* silu(z)`` when ``norm_before_gate``; ``If(norm_before_gate)`` picks the order.

Tested in ONNX Runtime vs the float64 references (tests/exporter/test_fused_ops.py).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from m2export import contract_conv1d as cc
from m2export import contract_gated_norm as cg
from m2export.exporter.ssm_scan_op import PLUGIN_ATTRIBUTES, _Body, _elem_type

_ATTR_PROTO = {"int": onnx.AttributeProto.INT, "float": onnx.AttributeProto.FLOAT,
               "string": onnx.AttributeProto.STRING}
_VALUE_KIND = {"int": "value_int", "float": "value_float", "string": "value_string"}
#: the ops this module writes, in the order the pass adds their functions
OPS = ((cc.OP_DOMAIN, cc.OP_NAME, cc.OP_VERSION), (cg.OP_DOMAIN, cg.OP_NAME, cg.OP_VERSION))


def _ref(b: _Body, spec) -> str:
    """A Constant whose value is the calling node's attribute ``spec`` (an attribute reference)."""
    out = f"_attr_{spec.name}"
    node = helper.make_node("Constant", [], [out])
    node.attribute.append(helper.make_attribute_ref(_VALUE_KIND[spec.type], _ATTR_PROTO[spec.type],
                                                    ref_attr_name=spec.name))
    b.nodes.append(node)
    return out


def _attribute_protos(specs) -> list[onnx.AttributeProto]:
    """Declared attributes of a function: the contract's with their defaults, then the plugin-selecting ones."""
    return [helper.make_attribute(a.name, a.default) for a in specs] + \
        [helper.make_attribute(k, v) for k, v in PLUGIN_ATTRIBUTES.items()]


def _silu(b: _Body, v: str) -> str:
    return b.op("Mul", v, b.op("Sigmoid", v))


# ----------------------------------------------------------------------------- CausalConv1d
def _conv1d_body() -> tuple[list[onnx.NodeProto], Sequence[str], Sequence[str]]:
    F = TensorProto.FLOAT
    x, weight, bias, state = cc.INPUT_NAMES
    b = _Body()
    xf, wf, bf, sf = (b.op("Cast", t, to=F) for t in (x, weight, bias, state))
    xp = b.op("Concat", b.op("Transpose", sf, perm=[0, 2, 1]), xf, axis=1)  # (b, K-1+L, C)
    L = b.op("Shape", x, start=1, end=2)
    K = b.op("Shape", weight, start=1, end=2)
    zero, one, sq = b.const(0), b.const(1), b.const([0])
    t = b.op("Range", zero, b.op("Squeeze", L, sq), one)
    k = b.op("Range", zero, b.op("Squeeze", K, sq), one)
    idx = b.op("Add", b.op("Unsqueeze", t, b.const([1])), b.op("Unsqueeze", k, sq))  # (L, K)
    win = b.op("Gather", xp, idx, axis=1)  # (b, L, K, C)
    acc = b.op("ReduceSum", b.op("Mul", win, b.op("Transpose", wf, perm=[1, 0])), b.const([2]), keepdims=0)
    acc = b.op("Add", acc, bf)  # (b, L, C)
    act = b.op("Unsqueeze", _ref(b, cc.ATTRIBUTES[0]), sq)
    silu_name = b.op("Constant", value=helper.make_tensor("silu", TensorProto.STRING, [1], [b"silu"]))
    n_distinct = b.op("Size", b.op("Unique", b.op("Concat", act, silu_name, axis=0), sorted=0))
    is_silu = b.op("Equal", n_distinct, b.const(1))
    y = b.op("Where", is_silu, _silu(b, acc), acc)
    final = b.op("Transpose", b.op("Slice", xp, L, b.const([np.iinfo(np.int64).max]), b.const([1])), perm=[0, 2, 1])
    b.nodes.append(helper.make_node("CastLike", [y, x], [cc.OUTPUT_NAMES[0]]))
    b.nodes.append(helper.make_node("CastLike", [final, x], [cc.OUTPUT_NAMES[1]]))
    return b.nodes, cc.INPUT_NAMES, cc.OUTPUT_NAMES


def causal_conv1d_function_proto(opset: int = 18) -> onnx.FunctionProto:
    """Model-local function ``m2export::CausalConv1d`` v1 (module docstring), default domain at ``opset``."""
    nodes, inputs, outputs = _conv1d_body()
    return helper.make_function(cc.OP_DOMAIN, cc.OP_NAME, list(inputs), list(outputs), nodes,
                                [helper.make_opsetid("", opset)], attribute_protos=_attribute_protos(cc.ATTRIBUTES),
                                doc_string="m2export::CausalConv1d v1: depthwise causal conv1d with state (+ SiLU), "
                                           "fp32 internals; see m2export/contract_conv1d.py")


# ----------------------------------------------------------------------------- GatedRMSNorm
def _gated_norm_body() -> tuple[list[onnx.NodeProto], Sequence[str], Sequence[str]]:
    F = TensorProto.FLOAT
    x, z, weight = cg.INPUT_NAMES
    gs_spec, eps_spec, nbg_spec = (next(a for a in cg.ATTRIBUTES if a.name == n)
                                   for n in ("group_size", "eps", "norm_before_gate"))
    b = _Body()
    xf, zf, wf = (b.op("Cast", t, to=F) for t in (x, z, weight))
    gate = _silu(b, zf)
    shape = b.op("Shape", x)
    lead = b.op("Shape", x, end=-1)
    d = b.op("Shape", x, start=-1)
    gs = b.op("Reshape", _ref(b, gs_spec), b.const([1]))
    gs = b.op("Where", b.op("Equal", gs, b.const([0])), d, gs)  # 0: one group of d_inner
    grouped = b.op("Concat", lead, b.op("Div", d, gs), gs, axis=0)
    eps = _ref(b, eps_spec)

    def normed(bb: _Body, u: str) -> str:
        g = bb.op("Reshape", u, grouped)
        ms = bb.op("ReduceMean", bb.op("Mul", g, g), bb.const([-1]), keepdims=1)
        g = bb.op("Mul", g, bb.op("Reciprocal", bb.op("Sqrt", bb.op("Add", ms, eps))))
        return bb.op("Mul", bb.op("Reshape", g, shape), wf)

    branches = []
    for name, build in (("norm_then_gate", lambda bb: bb.op("Mul", normed(bb, xf), gate)),
                        ("gate_then_norm", lambda bb: normed(bb, bb.op("Mul", xf, gate)))):
        bb = _Body(prefix=f"{name}_")
        res = build(bb)
        branches.append(helper.make_graph(bb.nodes, name, [], [helper.make_tensor_value_info(res, F, None)]))
    nbg = b.op("Cast", _ref(b, nbg_spec), to=TensorProto.BOOL)
    out = b.op("If", nbg, then_branch=branches[0], else_branch=branches[1])
    b.nodes.append(helper.make_node("CastLike", [out, x], [cg.OUTPUT_NAMES[0]]))
    return b.nodes, cg.INPUT_NAMES, cg.OUTPUT_NAMES


def gated_rmsnorm_function_proto(opset: int = 18) -> onnx.FunctionProto:
    """Model-local function ``m2export::GatedRMSNorm`` v1 (module docstring), default domain at ``opset``."""
    nodes, inputs, outputs = _gated_norm_body()
    return helper.make_function(cg.OP_DOMAIN, cg.OP_NAME, list(inputs), list(outputs), nodes,
                                [helper.make_opsetid("", opset)], attribute_protos=_attribute_protos(cg.ATTRIBUTES),
                                doc_string="m2export::GatedRMSNorm v1: RMSNorm per group gated by silu(z), fp32 "
                                           "internals; see m2export/contract_gated_norm.py")


def function_protos(opset: int = 18) -> list[onnx.FunctionProto]:
    """Both functions (the order of :data:`OPS`)."""
    return [causal_conv1d_function_proto(opset), gated_rmsnorm_function_proto(opset)]


# ----------------------------------------------------------------------------- one-node models (tests)
def _model(node: onnx.NodeProto, specs_in, specs_out, elem: int, dims: dict, opset: int,
           domain: str, version: int) -> onnx.ModelProto:
    def vi(s):
        return helper.make_tensor_value_info(s.name, elem, [dims.get(d, d) for d in s.dims])

    graph = helper.make_graph([node], node.op_type, [vi(s) for s in specs_in], [vi(s) for s in specs_out])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(domain, version)],
                              functions=function_protos(opset))
    model.ir_version = 10
    return model


def conv1d_node_model(dtype: str = "float32", activation: str = "silu", opset: int = 18) -> onnx.ModelProto:
    """A model of one ``m2export::CausalConv1d`` node on graph inputs named as the contract's (symbolic dims)."""
    cc.check_activation(activation)
    node = helper.make_node(cc.OP_NAME, list(cc.INPUT_NAMES), list(cc.OUTPUT_NAMES), name="causal_conv1d",
                            domain=cc.OP_DOMAIN, activation=activation, **PLUGIN_ATTRIBUTES)
    return _model(node, cc.INPUTS, cc.OUTPUTS, _elem_type(dtype), {}, opset, cc.OP_DOMAIN, cc.OP_VERSION)


def gated_norm_node_model(problem: cg.GatedNormProblem, rank: int = 3, opset: int = 18) -> onnx.ModelProto:
    """A model of one ``m2export::GatedRMSNorm`` node with ``problem``'s attributes on inputs x, z of rank ``rank``
    ((rows..., d_inner), symbolic leading dims) and weight (d_inner,)."""
    node = helper.make_node(cg.OP_NAME, list(cg.INPUT_NAMES), list(cg.OUTPUT_NAMES), name="gated_rmsnorm",
                            domain=cg.OP_DOMAIN, **problem.onnx_attributes(), **PLUGIN_ATTRIBUTES)
    elem = _elem_type(problem.dtype)
    lead = [f"r{i}" for i in range(rank - 1)]
    ins = [helper.make_tensor_value_info("x", elem, [*lead, "d_inner"]),
           helper.make_tensor_value_info("z", elem, [*lead, "d_inner"]),
           helper.make_tensor_value_info("weight", elem, ["d_inner"])]
    outs = [helper.make_tensor_value_info("out", elem, [*lead, "d_inner"])]
    graph = helper.make_graph([node], node.op_type, ins, outs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    helper.make_opsetid(cg.OP_DOMAIN, cg.OP_VERSION)],
                              functions=function_protos(opset))
    model.ir_version = 10
    return model


__all__ = ["OPS", "causal_conv1d_function_proto", "gated_rmsnorm_function_proto", "function_protos",
           "conv1d_node_model", "gated_norm_node_model"]
