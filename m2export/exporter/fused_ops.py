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
  The ``std`` flavour keeps the standard ops (at opset >= 23 its RMSNorms as ``RMSNormalization``:
  :func:`rms_normalization`), the ``native`` flavour ONNX Runtime's contrib ops (neither calls this pass).
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
from m2export.exporter._match import const_array as _const_array
from m2export.exporter._match import perm as _perm
from m2export.exporter._match import producer as _producer
from m2export.exporter._match import rms_core
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
    return _function_proto(cc, _conv1d_body, "depthwise causal conv1d with state (+ SiLU), fp32 internals", opset)


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
    return _function_proto(cg, _gated_norm_body, "RMSNorm per group gated by silu(z), fp32 internals", opset)


def _function_proto(contract, body, what: str, opset: int) -> onnx.FunctionProto:
    """The model-local function of one op contract (:mod:`m2export.contract_conv1d` or ``contract_gated_norm``):
    ``body()``'s nodes over the contract's inputs and outputs, the default domain at ``opset``, the contract's
    attributes with their defaults plus the plugin-selecting ones, and a doc string saying ``what`` it computes."""
    nodes, inputs, outputs = body()
    source = contract.__name__.replace(".", "/") + ".py"
    return helper.make_function(contract.OP_DOMAIN, contract.OP_NAME, list(inputs), list(outputs), nodes,
                                [helper.make_opsetid("", opset)], attribute_protos=_attribute_protos(contract.ATTRIBUTES),
                                doc_string=f"{contract.OP_DOMAIN}::{contract.OP_NAME} v{contract.OP_VERSION}: {what}; "
                                           f"see {source}")


def function_protos(opset: int = 18) -> list[onnx.FunctionProto]:
    """Both functions (the order of :data:`OPS`)."""
    return [causal_conv1d_function_proto(opset), gated_rmsnorm_function_proto(opset)]


# ----------------------------------------------------------------------------- the ssmscan flavour's rewrite
def _only_use(value, op_type: str | None = None):
    uses = [u.node for u in value.uses()] if value is not None else []
    if len(uses) != 1 or value.is_graph_output() or uses[0].domain != "":
        return None
    return uses[0] if op_type is None or uses[0].op_type == op_type else None


def _silu_input(value):
    """``v`` if ``value`` is ``Mul(v, Sigmoid(v))`` (either order), else None."""
    m = _producer(value, "Mul")
    if m is None:
        return None
    for a, s in (m.inputs, m.inputs[::-1]):
        sig = _producer(s, "Sigmoid")
        if sig is not None and sig.inputs[0] is a:
            return a
    return None


def _uncast(value):
    """The input of a ``Cast`` to float32 producing ``value`` (the value before the float32 island), else ``value``."""
    import onnx_ir as ir

    c = _producer(value, "Cast")
    if c is not None and c.attributes.get("to") is not None and c.attributes["to"].value == ir.DataType.FLOAT:
        return c.inputs[0]
    return value


def _initializer(model, name: str, array: np.ndarray):
    import onnx_ir as ir

    name = _unique(model, name)
    v = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                 const_value=ir.Tensor(array, name=name))
    model.graph.register_initializer(v)
    return v


def _unique(model, name: str) -> str:
    taken = set(model.graph.initializers)
    k, out = 0, name
    while out in taken:
        k += 1
        out = f"{name}.{k}"
    return out


def _replace(old, new) -> None:
    """Point every use of ``old`` (graph outputs included, keeping the output's name) at ``new``."""
    name = old.name
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    old.name, new.name = f"{name}.unfused", name


def fuse_conv1d(model) -> int:
    """Replace each Mamba-2 causal depthwise conv + SiLU by one ``m2export::CausalConv1d`` node (in place).

    Pattern (built by :func:`m2export.exporter.build.mamba_layer` and as torch.onnx traces ``Mamba2Mixer``):
    ``t = Transpose(x, [0, 2, 1])``, ``cat = Concat(past, t, axis=2)`` with ``past`` a graph input,
    ``present = Slice(cat, ...)`` a graph output, ``c = Conv(cat, W (C, 1, K)[, bias], group=C, no padding,
    stride 1, dilation 1)``, ``Mul(c, Sigmoid(c))``, ``Transpose(., [0, 2, 1])``. The node reads ``x`` and writes
    ``y`` channels last; its weight is ``Squeeze(W, [1])`` (C, K) (``W`` stays the one initializer), its bias a zero one when the conv has
    none. bfloat16 as traced (``Cast(cat)`` to float32, the conv on float32 copies of the weights, ``Cast`` back, the
    SiLU) is matched too: the node computes in float32 and rounds once, the weights reach it cast back to the
    dtype of ``x`` in the graph (exact). Anything else is left as it is. Returns the count.
    """
    import onnx_ir as ir

    g = model.graph
    fused = 0
    for conv in [n for n in g if n.op_type == "Conv" and n.domain == ""]:
        cat = _producer(conv.inputs[0], "Concat")
        island = None  # bfloat16 as traced: Cast(cat) to float32 -> Conv -> Cast back, then the SiLU
        if cat is None:
            island = _producer(conv.inputs[0], "Cast")
            cat = _producer(island.inputs[0], "Concat") if island is not None and len(conv.inputs[0].uses()) == 1 \
                else None
        if cat is None or len(cat.inputs) != 2 or cat.attributes["axis"].as_int() != 2:
            continue
        past, t = cat.inputs
        pre = _producer(t, "Transpose")
        w = _const_array(conv.inputs[1])
        attrs = {k: v.value for k, v in conv.attributes.items()}
        if not (past.is_graph_input() and pre is not None and _perm(pre) == [0, 2, 1] and len(t.uses()) == 1
                and w is not None and w.ndim == 3 and w.shape[1] == 1 and attrs.get("group") == w.shape[0]
                and cc.D_CONV_RANGE[0] <= w.shape[2] <= cc.D_CONV_RANGE[1]
                and all(p == 0 for p in attrs.get("pads", [0, 0])) and all(s == 1 for s in attrs.get("strides", [1]))
                and all(d == 1 for d in attrs.get("dilations", [1]))
                and attrs.get("auto_pad", "NOTSET") in ("NOTSET", b"NOTSET")):
            continue
        c = conv.outputs[0]
        if island is not None:
            back = _only_use(c, "Cast")
            if back is None or back.attributes["to"].value != cat.outputs[0].dtype:
                continue
            c = back.outputs[0]
        uses = [u.node for u in c.uses()]
        sig = next((u for u in uses if u.op_type == "Sigmoid"), None)
        mul = next((u for u in uses if u.op_type == "Mul"), None)
        if len(uses) != 2 or sig is None or mul is None or _only_use(sig.outputs[0], "Mul") is not mul:
            continue
        post = _only_use(mul.outputs[0], "Transpose")
        slices = [u.node for u in cat.outputs[0].uses() if u.node is not (island or conv)]
        if post is None or _perm(post) != [0, 2, 1] or len(slices) != 1 or slices[0].op_type != "Slice" \
                or not slices[0].outputs[0].is_graph_output():
            continue
        x, present, y_cl = pre.inputs[0], slices[0].outputs[0], post.outputs[0]
        name = conv.outputs[0].name  # value names are unique in the graph (node names of traced pieces need not be)
        axis1 = model.graph.initializers.get("fused_ops.axis_1")
        # (C, 1, K) -> (C, K) in the graph: the weight stays one initializer shared with the other flavours
        squeeze = ir.node("Squeeze", [conv.inputs[1], axis1 or _initializer(model, "fused_ops.axis_1",
                                                                       np.array([1], np.int64))],
                          name=f"{name}.taps")
        weight = squeeze.outputs[0]
        weight.name, weight.dtype, weight.shape = f"{name}.taps", conv.inputs[1].dtype, ir.Shape([w.shape[0], w.shape[2]])
        g.insert_before(pre, squeeze)
        bias = conv.inputs[2] if len(conv.inputs) > 2 and conv.inputs[2] is not None else None
        xdt = x.dtype
        if island is not None:  # the island's float32 weights are exact copies of x-dtype ones: cast back in the graph
            weight = _cast_before(g, pre, weight, xdt, f"{name}.taps_{xdt.name.lower()}")
            bias = None if bias is None else _cast_before(g, pre, bias, xdt, f"{name}.bias_{xdt.name.lower()}")
        if bias is None:  # zeros made in the graph (ConstantOfShape): no stored copy
            zeros = ir.node("ConstantOfShape", [_initializer(model, f"{name}.channels", np.array([w.shape[0]], np.int64))],
                            {"value": ir.tensor(np.zeros(1, weight.dtype.numpy()))}, name=f"{name}.zero_bias")
            bias = zeros.outputs[0]
            bias.name, bias.dtype, bias.shape = f"{name}.zero_bias", weight.dtype, ir.Shape([w.shape[0]])
            g.insert_before(pre, zeros)
        node = ir.node(cc.OP_NAME, [x, weight, bias, past], {"activation": "silu", **PLUGIN_ATTRIBUTES},
                       domain=cc.OP_DOMAIN, version=cc.OP_VERSION, num_outputs=2, name=f"{name}.causal_conv1d")
        for o, ref in zip(node.outputs, (y_cl, present)):
            o.type, o.shape = ref.type, ref.shape
        g.insert_before(pre, node)
        _replace(y_cl, node.outputs[0])
        _replace(present, node.outputs[1])
        fused += 1
    return fused


def _cast_before(g, before, v, dtype, name: str):
    """``Cast(v, to=dtype)`` inserted before node ``before``; its output (named ``name``)."""
    import onnx_ir as ir

    c = ir.node("Cast", [v], {"to": dtype}, name=name)
    c.outputs[0].name, c.outputs[0].dtype, c.outputs[0].shape = name, dtype, v.shape
    g.insert_before(before, c)
    return c.outputs[0]


def _rms_cores(g):
    """``(core, u, eps)`` for each default-domain ``Mul`` of graph ``g`` that is an RMSNorm core over ``u``
    (:func:`~m2export.exporter._match.rms_core`), in graph order; the candidates are listed first and each is matched
    when its turn comes, so the caller may rewrite the graph between them."""
    for core in [n for n in g if n.op_type == "Mul" and n.domain == ""]:
        found = rms_core(core)
        if found is not None:
            yield core, found[0], found[1]


def fuse_gated_norm(model) -> int:
    """Replace each gated RMSNorm by one ``m2export::GatedRMSNorm`` node (in place); returns the count.

    Pattern (as built by ``build._gate`` and as traced from ``RMSNormGated``), float32 inside: the core
    :func:`~m2export.exporter._match.rms_core` on ``v`` or on ``Reshape(v, [..., G, gs])`` (then ``Reshape`` back to ``[..., d_inner]``),
    ``Mul(., weight)`` with ``weight`` a (d_inner,) initializer, and the gate ``silu(z)`` either before
    (``v = Mul(y, silu(z))``: norm_before_gate 0) or after (``Mul(., silu(z))``: 1); ``y`` and ``z`` read
    before their float32 Casts, the output after the final Cast back (or float32 itself). A pre-norm RMSNorm
    (no gate) does not match. A float32 weight of a float16/bfloat16 graph is cast to the dtype of ``y`` in the graph.
    """
    import onnx_ir as ir

    g = model.graph
    fused = 0
    for core, u, eps in _rms_cores(g):
        rs_in = _producer(u, "Reshape")
        if rs_in is not None and u.shape is not None and len(u.shape) >= 2 and isinstance(u.shape[-1], int):
            group_size = int(u.shape[-1])
            v = rs_in.inputs[0]
            back = _only_use(core.outputs[0], "Reshape")
            if back is None:
                continue
            normed = back.outputs[0]
        else:
            v, normed = u, core.outputs[0]
            group_size = None
        if v.shape is None or not isinstance(v.shape[-1], int):
            continue
        d_inner = int(v.shape[-1])
        group_size = group_size or d_inner
        if d_inner % group_size or (rs_in is not None and normed.shape is not None
                                    and list(normed.shape) != list(v.shape)):
            continue
        wmul = _only_use(normed, "Mul")
        if wmul is None:
            continue
        wv = next((i for i in wmul.inputs if i is not normed), None)
        w = _const_array(wv)
        if w is None or w.shape != (d_inner,):
            continue
        # the gate: before (v = y * silu(z)) or after (out = wmul * silu(z))
        nbg = None
        vm = _producer(v, "Mul")
        if vm is not None and len(v.uses()) == 1:
            for y, s in (vm.inputs, vm.inputs[::-1]):
                zf = _silu_input(s)
                if zf is not None:
                    nbg, y_f, z_f, out = 0, y, zf, wmul.outputs[0]
                    break
        if nbg is None:
            after = _only_use(wmul.outputs[0], "Mul")
            s = next((i for i in after.inputs if i is not wmul.outputs[0]), None) if after is not None else None
            zf = _silu_input(s)
            if zf is None:
                continue
            nbg, y_f, z_f, out = 1, v, zf, after.outputs[0]
        y_in, z_in = _uncast(y_f), _uncast(z_f)
        if y_in.dtype != z_in.dtype or y_in.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
            continue
        if y_in.dtype != ir.DataType.FLOAT:  # the output must be the Cast back to y's dtype
            c = _only_use(out, "Cast")
            if c is None or c.attributes["to"].value != y_in.dtype:
                continue
            out = c.outputs[0]
        elif out.dtype != ir.DataType.FLOAT:
            continue
        if y_in.shape is None or z_in.shape is None or list(y_in.shape) != list(z_in.shape):
            continue
        name = out.name  # value names are unique in the graph (node names of traced pieces need not be)
        np_dt = y_in.dtype.numpy()
        weight = wv
        if w.dtype != np_dt:  # a float32 copy of the model's weight: cast back in the graph (exact), no stored copy
            cast = ir.node("Cast", [wv], {"to": y_in.dtype}, name=f"{name}.weight_{np_dt.name}")
            weight = cast.outputs[0]
            weight.name, weight.dtype, weight.shape = cast.name, y_in.dtype, ir.Shape([d_inner])
            g.insert_after(out.producer(), cast)
        attrs = cg.GatedNormProblem(rows=0, d_inner=d_inner, group_size=group_size, eps=eps,
                                    norm_before_gate=bool(nbg), dtype=str(np_dt)).onnx_attributes()
        node = ir.node(cg.OP_NAME, [y_in, z_in, weight], {**attrs, **PLUGIN_ATTRIBUTES}, domain=cg.OP_DOMAIN,
                       version=cg.OP_VERSION, name=f"{name}.gated_rmsnorm")
        node.outputs[0].type, node.outputs[0].shape = out.type, out.shape
        g.insert_after(out.producer(), node)
        _replace(out, node.outputs[0])
        fused += 1
    return fused


#: the first default-domain opset with ``RMSNormalization``
RMS_NORMALIZATION_OPSET = 23


def rms_normalization(model) -> int:
    """The ``std`` flavour at opset >= :data:`RMS_NORMALIZATION_OPSET`: every RMSNorm core (:func:`~m2export.exporter._match.rms_core`, as built
    and as traced) becomes one standard ``RMSNormalization`` (axis -1, its eps, stash_type 1: float32 inside), in
    place. A core followed by ``Mul(., weight)`` with a (d,) constant takes that weight as its scale (the pre-norms,
    norm_f, a gated norm without groups); a per-group core (the gated norm on ``[..., G, group_size]``, the weight
    after the Reshape back) gets a scale of ones made in the graph (``ConstantOfShape``: nothing stored) and keeps
    its Reshape and weight Mul. Returns the number replaced.
    """
    import onnx_ir as ir
    import onnx_ir.passes.common as common

    g = model.graph
    done = 0
    for core, u, eps in _rms_cores(g):
        if u.dtype != ir.DataType.FLOAT or u.shape is None or not isinstance(u.shape[-1], int):
            continue
        d = int(u.shape[-1])
        out = core.outputs[0]
        wmul = _only_use(out, "Mul")
        wv = next((i for i in wmul.inputs if i is not out), None) if wmul is not None else None
        w = _const_array(wv)
        name = out.name
        if w is not None and w.shape == (d,) and w.dtype == np.float32:
            scale, out = wv, wmul.outputs[0]
        else:
            ones = ir.node("ConstantOfShape", [_initializer(model, f"{name}.scale_shape", np.array([d], np.int64))],
                           {"value": ir.tensor(np.ones(1, np.float32))}, name=f"{name}.scale")
            scale = ones.outputs[0]
            scale.name, scale.dtype, scale.shape = f"{name}.scale", ir.DataType.FLOAT, ir.Shape([d])
            g.insert_before(core, ones)
        node = ir.node("RMSNormalization", [u, scale], {"axis": -1, "epsilon": float(eps), "stash_type": 1},
                       name=f"{name}.rms_normalization")
        node.outputs[0].type, node.outputs[0].shape = out.type, out.shape
        g.insert_after(out.producer(), node)
        _replace(out, node.outputs[0])
        done += 1
    if done:
        common.RemoveUnusedNodesPass()(model)
        g.sort()
    return done


def fuse_ops(model):
    """The ``ssmscan`` flavour's copy of an onnx_ir ``model`` (weights shared, ``model`` untouched): every causal
    conv and gated RMSNorm the patterns match (:func:`fuse_conv1d`, :func:`fuse_gated_norm`) replaced by the
    custom nodes, the model-local functions of the ops used attached (at the model's default opset) and the
    nodes left unused removed. Returns ``(model, n_conv, n_norm)``."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common

    out = model.clone()
    n_conv, n_norm = fuse_conv1d(out), fuse_gated_norm(out)
    if n_conv or n_norm:
        common.RemoveUnusedNodesPass()(out)
        opset = out.opset_imports[""]
        for n, make in ((n_conv, causal_conv1d_function_proto), (n_norm, gated_rmsnorm_function_proto)):
            if n:
                f = ir.serde.deserialize_function(make(opset))
                out.functions[f.identifier()] = f
        out.opset_imports[cc.OP_DOMAIN] = cc.OP_VERSION
        out.graph.sort()
    return out, n_conv, n_norm


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


__all__ = ["OPS", "fuse_ops", "rms_normalization", "RMS_NORMALIZATION_OPSET", "fuse_conv1d", "fuse_gated_norm", "causal_conv1d_function_proto", "gated_rmsnorm_function_proto", "function_protos",
           "conv1d_node_model", "gated_norm_node_model"]
