"""The ``native`` flavour: the Mamba-2 model on ONNX Runtime's own fused kernels (CPU provider, ORT >= 1.32).

Made from the traced ssmscan-flavour graph (SSMScan nodes plus the model-local function) by
:func:`to_native_ort`, in four rewrites, each leaving anything that does not match its pattern as it was:

* every ``m2export::SSMScan`` call is inlined with a body built for its attribute values, its sizes and the
  dtype of ``x`` (:func:`~m2export.exporter.ssm_scan_op.native_ssm_scan_function`): ``Softplus`` for the step
  size, then one ORT ``com.microsoft::LinearAttention`` for any number of tokens (one token: a decode step
  of the recurrence, whose q·S output is y itself); every reshape a constant. Its state is
  LinearAttention's (batch, nheads, d_state, headdim), and so is the graph's ``past_ssm_state.{i}`` /
  ``present_ssm_state.{i}`` I/O (:data:`~m2export.exporter.configs.STATE_LAYOUTS`; :func:`relayout_states`):
  no transpose of a state anywhere, where the contract's (b, h, headdim, d_state) would cost a pass over
  every state per call;
* every causal depthwise conv (``Concat(past_conv_state, x)`` → ``Conv(group=C)`` → ``x * Sigmoid(x)``, and
  the ``Slice`` of the concatenation that is ``present_conv_state``) becomes one
  ``com.microsoft::CausalConvWithState(activation="silu")`` for any number of tokens (its SiLU is accurate
  where ORT's fusion of the traced one is not: :func:`fuse_causal_conv`), channels-first between the traced
  Transposes of the activations (ORT's CPU kernel is several times slower channels-last at prefill lengths),
  on the conv states in the model's (batch, conv_dim, d_conv - 1) layout; the graph has no ``If``;
* every RMSNorm as traced (``x * Reciprocal(Sqrt(ReduceMean(Pow(x, 2), [-1]) + eps))``, then the weight) becomes
  one ``RMSNormalization`` (opset 23), or ``com.microsoft::SkipSimplifiedLayerNormalization`` where its input
  is a residual ``Add`` (the sum is that node's fourth output);
* every ``Reshape`` whose target shape is computed at run time (``Shape`` → ``Squeeze`` → ``Concat``) but
  whose output shape is known up to the batch and sequence symbols gets a constant shape (``0`` copies a
  dim, ``-1`` infers one), so the shape arithmetic drops out; then chains of reshapes merge
  (:func:`fold_reshapes`).

Every pass expects the model to import :data:`~m2export.exporter.ssm_scan_op.NATIVE_OPSETS` (opset 27 and
``com.microsoft``), as :func:`to_native_ort` sets first.

ONNX Runtime 1.32 has no CPU kernel for the default-domain (opset 27) ``LinearAttention`` and
``CausalConvWithState``: it runs their ONNX function bodies (a Scan over tokens, a Conv), which is why the
contrib-domain ops are used. The graph I/O keeps its names and dtypes; the ssm states' shapes are in the
native layout (m2export.json records it per graph). Kernel counts and times
per call: ``benchmarks/bench_ort.py`` in benchmarks/RESULTS.md. Runtimes other than ONNX Runtime use the
``std`` flavour; TensorRT uses the ``ssmscan`` flavour (the plugin).
"""

from __future__ import annotations

from m2export import contract
from m2export.errors import ExportError
from m2export.exporter._match import perm as _perm
from m2export.exporter._match import producer as _producer
from m2export.exporter._match import rms_core
from m2export.exporter.ssm_scan_op import NATIVE_OPSETS, ORT_DOMAIN

#: IR version of the native graphs (onnx 1.22's, the first with opset 27)
NATIVE_IR_VERSION = 11


def to_native_ort(model, nheads: int, n_layer: int, inline, io, n_conv: int | None = None):
    """A native-kernel copy of an onnx_ir ssmscan-flavour ``model`` (weights shared, ``model`` untouched).

    Args:
        model: onnx_ir Model with ``m2export::SSMScan`` nodes and the model-local function (ssmscan flavour);
            the nodes' ``x`` and ``B`` inputs must have static head, headdim, group and d_state sizes.
        nheads: heads of every mixer (checked against the graph).
        n_layer: mixers expected (one LinearAttention and one CausalConvWithState each).
        n_conv: CausalConvWithState nodes expected (default ``n_layer``): a mixer with d_conv 1 has no conv state
            to carry (its conv is a per-channel scale; the graph's optimiser drops the concat with the empty
            state), so its standard ``Conv`` stays.
        inline: the exporter's inlining pass (``export._inline``), applied to the copy.
        io: the native flavour's :class:`~m2export.exporter.configs.GraphIO` (``GraphIO.for_model(...,
            flavour="native")``): the state layouts the copy's graph I/O gets (:func:`relayout_states`).
    Returns:
        The onnx_ir Model of the ``native`` flavour (opsets :data:`~m2export.exporter.ssm_scan_op.NATIVE_OPSETS`,
        no m2export domain).
    Raises:
        ExportError: the traced graph does not have the expected scans and conv pattern once per layer.
    """
    out = model.clone()
    out.opset_imports.update(NATIVE_OPSETS)
    out.ir_version = max(out.ir_version or 0, NATIVE_IR_VERSION)
    n_scan = _specialise_scans(out, nheads)
    relayout_states(out, io)
    inline(out)
    fused = fuse_causal_conv(out)
    fuse_rms_norm(out)
    constant_reshapes(out)
    fold_reshapes(out)
    import onnx_ir as ir

    n_la = sum(1 for n in ir.traversal.RecursiveGraphIterator(out.graph) if n.op_type == "LinearAttention")
    if not (n_scan == n_la == n_layer and fused == (n_layer if n_conv is None else n_conv)):
        raise ExportError(f"internal: the native flavour expected {n_layer} scans, causal convs and "
                          f"LinearAttention nodes, found {n_scan} SSMScan nodes, {fused} convs and "
                          f"{n_la} LinearAttention nodes")
    return out


def _is_native_scan(node) -> bool:
    from m2export.exporter.ssm_scan_op import native_function_name

    return node.domain == contract.OP_DOMAIN and node.op_type.startswith(native_function_name(0)[:-1])


def _transpose(value, perm, name: str):
    """A ``Transpose(value, perm)`` node (not inserted) whose output has ``value``'s dtype and permuted shape."""
    import onnx_ir as ir

    node = ir.node("Transpose", [value], {"perm": list(perm)}, name=name)
    out = node.outputs[0]
    out.name, out.type = name, value.type
    if value.shape is not None:
        out.shape = ir.Shape([value.shape[i] for i in perm])
    return node


def relayout_states(model, io) -> int:
    """Give the graph I/O of every state whose layout in ``io`` is not the model's that layout, and the native
    SSMScan calls their states in theirs, with no transpose left between them. Returns the states relaid.

    Each such ``past`` input gets ``io``'s shape and a Transpose back to the model's layout for the nodes that
    read it; each such ``present`` output is a Transpose of what the graph computed; each native SSMScan call
    (:func:`_specialise_scans`; its body's states are :data:`~m2export.exporter.ssm_scan_op.NATIVE_STATE_PERM`)
    reads ``Transpose(initial_state)`` and its final state is transposed back. Then :func:`cancel_transposes`
    removes every pair that undoes itself: where a call reads the graph's past state and writes its present
    one (every Mamba-2 layer), the state goes from input to LinearAttention to output untouched. Raises
    ExportError when ``io`` relays a state the scans do not keep in that layout (only ssm_state, as
    :data:`NATIVE_STATE_PERM`).
    """
    import numpy as np
    import onnx_ir as ir

    from m2export.exporter.ssm_scan_op import NATIVE_STATE_PERM

    g = model.graph
    relaid = [s for s in io.states if s.perm is not None]
    for s in relaid:
        if (s.kind, s.perm) != ("ssm_state", NATIVE_STATE_PERM):
            raise ExportError(f"internal: the native flavour keeps {s.kind} in {s.layout}; it handles ssm_state as "
                              f"{NATIVE_STATE_PERM} (the scans) only")
    if not relaid:
        return 0
    inv = tuple(int(i) for i in np.argsort(NATIVE_STATE_PERM))
    for node in [n for n in g if _is_native_scan(n) and any(s.kind == "ssm_state" for s in relaid)]:
        name = node.name or "ssm_scan"
        h0 = node.inputs[7]
        t_in = _transpose(h0, NATIVE_STATE_PERM, f"{name}.initial_state_native")
        g.insert_before(node, t_in)
        node.replace_input_with(7, t_in.outputs[0])
        final = node.outputs[1]
        if final.shape is not None:  # the body's state is in the native layout
            final.shape = ir.Shape([final.shape[i] for i in NATIVE_STATE_PERM])
        uses = list(final.uses())
        t_out = _transpose(final, inv, f"{name}.final_state_model")
        g.insert_after(node, t_out)
        for use in uses:
            use.node.replace_input_with(use.idx, t_out.outputs[0])
        _replace_graph_output(g, final, t_out.outputs[0])
    by_name = {v.name: v for v in g.inputs}
    outs = {v.name: k for k, v in enumerate(g.outputs)}
    first = next(iter(g))
    for s in relaid:
        v = by_name[s.past.name]
        uses = list(v.uses())
        v.shape = _shape(s.past.shape)  # the graph's layout; the Transpose gives the model's back
        t = _transpose(v, tuple(int(i) for i in np.argsort(s.perm)), f"{s.past.name}.model_layout")
        g.insert_before(first, t)
        for use in uses:
            use.node.replace_input_with(use.idx, t.outputs[0])
        k = outs[s.present.name]
        o = g.outputs[k]
        o.name = f"{s.present.name}.model_layout"
        t = _transpose(o, s.perm, s.present.name)
        t.outputs[0].name = s.present.name
        g.append(t)
        g.outputs[k] = t.outputs[0]
        t.outputs[0].shape = _shape(s.present.shape)
    cancel_transposes(model)
    return len(relaid)


def _shape(dims):
    import onnx_ir as ir

    return ir.Shape([d if isinstance(d, int) else ir.SymbolicDim(d) for d in dims])


def _replace_graph_output(g, old, new) -> None:
    """``new`` in ``old``'s place among the graph outputs, with its name (``old`` renamed)."""
    if not old.is_graph_output():
        return
    name = old.name
    old.name = f"{name}.before"
    for k, v in enumerate(g.outputs):
        if v is old:
            g.outputs[k] = new
    new.name = name


def cancel_transposes(model) -> int:
    """Remove every top-level ``Transpose(Transpose(v, p), q)`` whose perms compose to the identity: its readers
    read ``v`` (a graph output keeps its name: ``v`` takes it, or an ``Identity`` of ``v`` where ``v`` is a graph
    input, output or initializer). The inner Transpose goes when nothing else reads it. Returns the pairs removed."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common

    g = model.graph
    done = 0
    for t2 in [n for n in g if n.op_type == "Transpose" and n.domain == ""]:
        t1 = _producer(t2.inputs[0], "Transpose")
        p1, p2 = _perm(t1), _perm(t2)
        if t1 is None or p1 is None or p2 is None or len(p1) != len(p2) or [p1[i] for i in p2] != list(range(len(p1))):
            continue
        v, out = t1.inputs[0], t2.outputs[0]
        if out.is_graph_output():
            if v.is_graph_input() or v.is_graph_output() or v.is_initializer():
                ident = ir.node("Identity", [v], name=f"{out.name}.identity")
                ident.outputs[0].type, ident.outputs[0].shape = out.type, out.shape
                g.insert_after(t2, ident)
                v = ident.outputs[0]
            name, shape = out.name, out.shape
            out.replace_all_uses_with(v, replace_graph_outputs=True)
            out.name, v.name = f"{name}.cancelled", name
            if shape is not None:
                v.shape = shape
        else:
            out.replace_all_uses_with(v)
        done += 1
    if done:
        common.RemoveUnusedNodesPass()(model)
    return done


def _specialise_scans(model, nheads: int) -> int:
    """Point every SSMScan node at the native body for its (attributes, sizes, dtype); returns the node count."""
    import onnx_ir as ir

    from m2export.contract import SSMScanAttrs
    from m2export.exporter.ssm_scan_op import NativeScanShape, native_function_name, native_ssm_scan_function

    bodies: dict[tuple, str] = {}
    count = 0
    for node in model.graph:
        if node.op_type != contract.OP_NAME or node.domain != contract.OP_DOMAIN:
            continue
        x, B = node.inputs[0], node.inputs[3]
        dims = [x.shape[2], x.shape[3], B.shape[2], B.shape[3]] if x.shape is not None and B.shape is not None \
            and len(x.shape) == 4 and len(B.shape) == 4 else []
        if not dims or not all(isinstance(d, int) for d in dims) or dims[0] != nheads:
            raise ExportError(f"internal: SSMScan node {node.name!r} has x {x.shape} and B {B.shape}; the native "
                              f"flavour needs static (nheads={nheads}, headdim) and (ngroups, d_state)")
        attrs = SSMScanAttrs.from_onnx_attributes({k: a.value for k, a in node.attributes.items()})
        key = (attrs, NativeScanShape(*dims), int(x.dtype))
        node.op_type = bodies.setdefault(key, native_function_name(len(bodies)))
        node.attributes.clear()
        _unflatten_y(model, node, dims[0], dims[1])
        count += 1
    model.functions.clear()
    for (attrs, shape, dtype), name in bodies.items():
        fn = ir.serde.deserialize_function(native_ssm_scan_function(attrs, shape, dtype, name))
        model.functions[fn.identifier()] = fn
    return count


def _unflatten_y(model, node, nheads: int, headdim: int) -> None:
    """The native body's ``y`` is flat (batch, seqlen, nheads * headdim): give the call's output that shape and its
    readers ``Reshape(y, [0, 0, nheads, headdim])`` (the contract's shape), which :func:`fold_reshapes` then
    merges with the caller's reshape back to the flat activations (the builder's ``layers.i/y``)."""
    import numpy as np
    import onnx_ir as ir

    y = node.outputs[0]
    uses = list(y.uses())
    shape = list(y.shape) if y.shape is not None else None
    name = y.name
    y.name = f"{name}.flat"
    if shape is not None and len(shape) == 4:
        y.shape = ir.Shape([shape[0], shape[1], nheads * headdim])
    target = ir.Value(name=f"{name}.heads_shape", shape=ir.Shape([4]), type=ir.TensorType(ir.DataType.INT64),
                      const_value=ir.tensor(np.array([0, 0, nheads, headdim], np.int64), name=f"{name}.heads_shape"))
    model.graph.register_initializer(target)
    r = ir.node("Reshape", [y, target], name=f"{name}.heads")
    r.outputs[0].name, r.outputs[0].type = name, y.type
    if shape is not None:
        r.outputs[0].shape = ir.Shape(shape)
    model.graph.insert_after(node, r)
    for use in uses:
        use.node.replace_input_with(use.idx, r.outputs[0])
    _replace_graph_output(model.graph, y, r.outputs[0])
    r.outputs[0].name = name


def _const_ints(value) -> list[int] | None:
    """The 1-D int64 constant held by ``value`` (initializer or Constant node), else None."""
    import onnx_ir as ir

    t = ir.convenience.get_const_tensor(value) if value is not None else None
    if t is None:
        return None
    a = t.numpy()
    return [int(v) for v in a.reshape(-1)] if a.ndim == 1 and a.dtype.kind == "i" else None


def _plain_reshape(node) -> list[int] | None:
    """The constant target of a top-level default-domain ``Reshape`` without ``allowzero``, else None."""
    if node is None or node.op_type != "Reshape" or node.domain != "":
        return None
    az = node.attributes.get("allowzero")
    if az is not None and az.value:
        return None
    return _const_ints(node.inputs[1])


def fold_reshapes(model) -> int:
    """Merge chains of shape-only ops at the top level; returns the number of rewrites. Until nothing changes:

    * ``Reshape(Reshape(v, c1), c2)`` -> ``Reshape(v, c2)`` where every ``0`` of ``c2`` copies a dim ``c1`` copied
      from ``v`` (the same position);
    * ``Unsqueeze(Reshape(v, c1), axes)`` -> ``Reshape(v, c1 with 1 at axes)`` where ``c1``'s zeros all precede the
      first new axis;
    * ``Reshape(v, c)`` whose ``v`` has ``c``'s shape already (rank and every literal size equal; a ``0`` copies,
      at most one ``-1``) -> ``v`` (not for a graph output).

    Every target is a constant (:func:`constant_reshapes` first). On the native graph: the body's reshape of ``x``
    to flat undoes the builder's reshape to heads, the flat ``y`` goes straight to the gate, the group axis of
    ``B``/``C`` is inserted by their reshape: 4 kernels per layer and token fewer.
    """
    import numpy as np
    import onnx_ir as ir
    import onnx_ir.passes.common as common

    g = model.graph

    def target(dims, name):
        v = ir.Value(name=name, shape=ir.Shape([len(dims)]), type=ir.TensorType(ir.DataType.INT64),
                     const_value=ir.tensor(np.array(dims, np.int64), name=name))
        g.register_initializer(v)
        return v

    done, changed = 0, True
    while changed:
        changed = False
        for node in list(g):
            if node.graph is not g:
                continue
            c2 = _plain_reshape(node)
            if c2 is not None:
                src = node.inputs[0].producer() if node.inputs[0] is not None else None
                c1 = _plain_reshape(src) if src is not None and src.graph is g else None
                if c1 is not None and node.outputs[0].uses() \
                        and all(i < len(c1) and c1[i] == 0 for i, d in enumerate(c2) if d == 0):
                    node.replace_input_with(0, src.inputs[0])
                    done, changed = done + 1, True
                    continue
                v, out = node.inputs[0], node.outputs[0]
                if out.uses() and v.shape is not None and len(v.shape) == len(c2) and not out.is_graph_output() \
                        and sum(d == -1 for d in c2) <= 1 \
                        and all(d in (0, -1) or (isinstance(s, int) and s == d) for d, s in zip(c2, v.shape)):
                    out.replace_all_uses_with(v)
                    done, changed = done + 1, True
                continue
            if node.op_type == "Unsqueeze" and node.domain == "" and len(node.inputs) == 2:
                src = node.inputs[0].producer() if node.inputs[0] is not None else None
                c1 = _plain_reshape(src) if src is not None and src.graph is g else None
                axes = _const_ints(node.inputs[1])
                if c1 is None or axes is None or not node.outputs[0].uses():
                    continue
                rank = len(c1) + len(axes)
                axes = sorted(a % rank for a in axes)
                zeros = [i for i, d in enumerate(c1) if d == 0]
                if len(set(axes)) != len(axes) or (zeros and max(zeros) >= axes[0]):
                    continue
                rest = iter(c1)
                dims = [1 if i in axes else next(rest) for i in range(rank)]
                name = node.name or node.outputs[0].name or "unsqueeze"
                r = ir.node("Reshape", [src.inputs[0], target(dims, f"{name}.as_reshape")], name=f"{name}.as_reshape")
                out = node.outputs[0]
                r.outputs[0].type, r.outputs[0].shape = out.type, out.shape
                g.insert_before(node, r)
                out_name = out.name
                out.replace_all_uses_with(r.outputs[0], replace_graph_outputs=True)
                g.remove(node, safe=True)
                r.outputs[0].name = out_name
                done, changed = done + 1, True
    if done:
        common.RemoveUnusedNodesPass()(model)
    return done


def _single_consumer(value, op_type: str):
    uses = [u.node for u in value.uses()]
    return uses[0] if len(uses) == 1 and uses[0].op_type == op_type and uses[0].domain == "" else None


def fuse_causal_conv(model) -> int:
    """Replace each traced causal depthwise conv + SiLU (+ its state Slice) by ORT's ``CausalConvWithState``
    (``activation="silu"``, channels-first), for any number of tokens.

    Pattern (as torch.onnx traces ``Mamba2Mixer``): ``cat = Concat(past, x, axis=2)`` with ``past`` a graph input
    (batch, channels, d_conv - 1); ``present = Slice(cat, ...)`` a graph output; ``c = Conv(cat, W[, bias],
    group=channels, no padding, stride 1, dilation 1)``; ``y = Mul(c, Sigmoid(c))``. The node reads ``x`` and
    ``past`` and its outputs replace ``y`` and ``present``: the traced Transposes of the activations around the
    conv (the in-projection's (batch, seqlen, channels) to the conv's (batch, channels, seqlen) and back) stay,
    the states go in and out as the graph I/O has them (the model's layout). Anything else is left as it is.
    Returns the number fused.

    Why at every length, where ORT 1.32's CPU ``Conv`` is faster from ~128 tokens on: ONNX Runtime fuses the
    traced ``x * Sigmoid(x)`` into ``QuickGelu``, whose logistic has an absolute error of ~1e-7 (relative
    2e-3 at x < -3), while this node's SiLU, ``x / (1 + exp(-x))``, is accurate to ~1e-7 relative. On the
    130m-shaped checkpoint of benchmarks/bench_ort.py the traced prefill conv put the logits 1.5% further from a
    float64 forward (3.36e-5 vs 3.31e-5 rel-L2; benchmarks/RESULTS.md, "Issue 16 accuracy: the native conv at
    every length"); this node needs no ``If(sequence_length == 1)``. Why channels-first: ORT 1.32's CPU kernel
    walks each channel's positions, contiguous channels-first and ``channels`` apart channels-last (a strided
    gather and scatter per channel), and its decode fast path (a fixed kernel width) is channels-first only; at
    512 tokens of a 130m layer (1792 channels) channels-last cost more than channels-first plus both Transposes
    (benchmarks/RESULTS.md, "Issue 16: the native graph does less work than mobius's").
    """
    import onnx_ir as ir
    import onnx_ir.passes.common as common

    g = model.graph
    fused = 0
    for conv in [n for n in g if n.op_type == "Conv" and n.domain == ""]:
        cat = _producer(conv.inputs[0], "Concat")
        if cat is None or len(cat.inputs) != 2 or cat.attributes["axis"].as_int() != 2:
            continue
        past, x = cat.inputs
        w = conv.inputs[1]
        attrs = {k: v.value for k, v in conv.attributes.items()}
        if not (past.is_graph_input() and w.shape is not None and len(w.shape) == 3 and w.shape[1] == 1
                and attrs.get("group") == w.shape[0] and all(p == 0 for p in attrs.get("pads", [0, 0]))
                and all(s == 1 for s in attrs.get("strides", [1])) and all(d == 1 for d in attrs.get("dilations", [1]))
                and attrs.get("auto_pad", "NOTSET") in ("NOTSET", b"NOTSET")):
            continue
        uses = [u.node for u in conv.outputs[0].uses()]
        sig = next((u for u in uses if u.op_type == "Sigmoid"), None)
        mul = next((u for u in uses if u.op_type == "Mul"), None)
        if len(uses) != 2 or sig is None or mul is None or _single_consumer(sig.outputs[0], "Mul") is not mul:
            continue
        slices = [u.node for u in cat.outputs[0].uses() if u.node is not conv]
        if len(slices) != 1 or slices[0].op_type != "Slice" or not slices[0].outputs[0].is_graph_output():
            continue
        present = slices[0].outputs[0]
        name = conv.name or "conv"
        y = mul.outputs[0]
        ccws = ir.node("CausalConvWithState", [x, w, conv.inputs[2] if len(conv.inputs) > 2 else None, past],
                       {"activation": "silu"}, domain=ORT_DOMAIN, num_outputs=2, name=f"{name}.causal_conv_with_state")
        g.insert_before(cat, ccws)
        for new_v, old_v, tag in zip(ccws.outputs, (y, present), ("y", "state")):
            new_v.type, new_v.shape, old_name = old_v.type, old_v.shape, old_v.name
            old_v.replace_all_uses_with(new_v, replace_graph_outputs=True)  # present: present_conv_state.{i}
            old_v.name, new_v.name = f"{name}.{tag}_traced", old_name
        fused += 1
    if fused:
        common.RemoveUnusedNodesPass()(model)  # the traced nodes and the Slice bounds only they read
        g.sort()
    return fused


def fuse_rms_norm(model) -> int:
    """Replace each traced RMSNorm over the last axis by ``RMSNormalization`` (or, on a residual sum,
    ``com.microsoft::SkipSimplifiedLayerNormalization``); returns the number fused.

    Matched: :func:`_rms_core` followed by ``Mul(., w)`` with a constant ``w`` of the last axis' size (the
    weight becomes the op's scale); or, for a grouped norm over (..., g, size) (the gated norm) followed by a
    Reshape back to (..., g * size) and ``Mul(., w)``, the scale is ``Reshape(w, [g, size])`` and that Mul goes;
    else the core alone with a scale of ones. ``SkipSimplifiedLayerNormalization`` is used
    when ``x = Add(a, b)`` of two rank-3 tensors of x's shape (the residual stream): its fourth output is
    that sum, which replaces the Add for its other consumers. ``x`` must be float32 (fp16 graphs: the cores
    inside their float32 Cast islands fuse, the Casts stay). Same formula as traced: ``x / sqrt(mean(x^2) +
    eps) * w``.
    """
    import numpy as np
    import onnx_ir as ir
    import onnx_ir.passes.common as common

    g = model.graph
    fused = 0
    for mul in [n for n in g if n.op_type == "Mul" and n.domain == ""]:
        if mul.graph is not g:  # removed by an earlier fusion
            continue
        core = rms_core(mul, single_use=True)
        if core is None:
            continue
        x, eps, chain = core
        if x.dtype != ir.DataType.FLOAT or x.shape is None or not isinstance(x.shape[-1], int):
            continue
        size = x.shape[-1]
        out, scale = mul.outputs[0], None
        wmul = _single_consumer(out, "Mul")
        if wmul is not None:
            w = wmul.inputs[1] if wmul.inputs[0] is out else wmul.inputs[0]
            wt = ir.convenience.get_const_tensor(w)
            if wt is not None and tuple(wt.shape) == (size,) and wt.dtype == ir.DataType.FLOAT:
                scale, out = w, wmul.outputs[0]
        if scale is None and len(x.shape) >= 2 and isinstance(x.shape[-2], int):
            # grouped norm: (..., g, size) -> Reshape to (..., g * size) -> Mul(w): the scale is w as (g, size),
            # a Reshape of the initializer (ORT folds it at session start; the stored weight stays one tensor)
            back = _single_consumer(out, "Reshape")
            wmul = _single_consumer(back.outputs[0], "Mul") if back is not None else None
            if wmul is not None and back.outputs[0].shape is not None and len(back.outputs[0].shape) == len(x.shape) - 1:
                w = wmul.inputs[1] if wmul.inputs[0] is back.outputs[0] else wmul.inputs[0]
                wt = ir.convenience.get_const_tensor(w)
                groups = x.shape[-2]
                fwd = _producer(x, "Reshape")
                flat = fwd.inputs[0] if fwd is not None and groups == 1 and len(x.uses()) == 2 else None
                if flat is not None and (flat.shape is None or list(flat.shape) != list(back.outputs[0].shape)):
                    flat = None
                if wt is not None and tuple(wt.shape) == (size,) and wt.dtype == ir.DataType.FLOAT and flat is not None:
                    # one group: the norm runs on the un-reshaped input, with w itself; both Reshapes and the Mul go
                    node = ir.node("RMSNormalization", [flat, w], {"epsilon": eps, "axis": -1}, name=f"{mul.name or 'rms'}.rms_norm")
                    g.insert_before(chain[0], node)
                    y, tail = node.outputs[0], wmul.outputs[0]
                    y.type, y.shape, tail_name = tail.type, tail.shape, tail.name
                    tail.replace_all_uses_with(y, replace_graph_outputs=True)
                    g.remove([wmul, back, mul, *chain, fwd], safe=True)
                    y.name = tail_name
                    fused += 1
                    continue
                if wt is not None and tuple(wt.shape) == (groups * size,) and wt.dtype == ir.DataType.FLOAT:
                    shape = ir.Value(name=f"{mul.name or 'rms'}.scale_shape", shape=ir.Shape([2]),
                                     type=ir.TensorType(ir.DataType.INT64), const_value=ir.tensor(
                                         np.array([groups, size], np.int64), name=f"{mul.name or 'rms'}.scale_shape"))
                    g.register_initializer(shape)
                    r = ir.node("Reshape", [w, shape], name=f"{mul.name or 'rms'}.scale")
                    r.outputs[0].name, r.outputs[0].type = f"{mul.name or 'rms'}.scale", w.type
                    g.insert_before(chain[0], r)
                    scale = r.outputs[0]
                    # the Mul's output is now the Reshape's: same values, w applied inside the norm
                    wmul_out = wmul.outputs[0]
                    wmul_name = wmul_out.name
                    wmul_out.replace_all_uses_with(back.outputs[0], replace_graph_outputs=True)
                    g.remove(wmul, safe=True)
                    if not back.outputs[0].is_graph_output():
                        back.outputs[0].name = wmul_name
            wmul = None
        if scale is None:
            wmul = None
            ones = ir.Value(name=f"{mul.name or 'rms'}.ones", shape=ir.Shape([size]), type=ir.TensorType(ir.DataType.FLOAT),
                            const_value=ir.tensor(np.ones(size, np.float32), name=f"{mul.name or 'rms'}.ones"))
            g.register_initializer(ones)
            scale = ones
        add = _producer(x, "Add")
        residual = add is not None and len(x.shape) == 3 and all(
            v is not None and v.shape is not None and list(v.shape) == list(x.shape) for v in add.inputs)
        name = f"{mul.name or 'rms'}.rms_norm"
        if residual:
            node = ir.node("SkipSimplifiedLayerNormalization", [add.inputs[0], add.inputs[1], scale],
                           {"epsilon": eps}, domain=ORT_DOMAIN, num_outputs=4, name=name)
            node.outputs[1].name, node.outputs[2].name = f"{name}.mean", f"{name}.inv_std_var"
            g.insert_before(add, node)
            total = node.outputs[3]
            total.dtype, total.shape = x.dtype, x.shape
            x_name = x.name
            x.replace_all_uses_with(total, replace_graph_outputs=True)
            g.remove(add, safe=True)
            total.name = x_name
        else:
            node = ir.node("RMSNormalization", [x, scale], {"epsilon": eps, "axis": -1}, num_outputs=1, name=name)
            g.insert_before(chain[0], node)
        y = node.outputs[0]
        y.dtype, y.shape = out.dtype, out.shape
        out_name = out.name
        out.replace_all_uses_with(y, replace_graph_outputs=True)
        for n in ([wmul] if wmul is not None else []) + [mul, *chain[::-1]]:
            g.remove(n, safe=True)
        y.name = out_name
        fused += 1
    if fused:
        common.RemoveUnusedNodesPass()(model)
    return fused


def constant_reshapes(model) -> int:
    """Give every top-level ``Reshape`` with a run-time target shape a constant one where the output's shape is
    known up to symbols: a dim equal to the input's dim at the same position (same symbol or size) becomes ``0``
    (copy), a fixed size stays, and at most one other symbol becomes ``-1``. ``allowzero`` is cleared (no
    constant shape written here has a literal zero). Returns the number rewritten."""
    import numpy as np
    import onnx_ir as ir
    import onnx_ir.passes.common as common

    g = model.graph
    done = 0
    for node in [n for n in g if n.op_type == "Reshape" and n.domain == ""]:
        data, target = node.inputs[0], node.inputs[1]
        out = node.outputs[0]
        if ir.convenience.get_const_tensor(target) is not None or out.shape is None or data.shape is None:
            continue
        dims, unknown = [], 0
        for i, d in enumerate(out.shape):
            if i < len(data.shape) and isinstance(d, ir.SymbolicDim) and d.value is not None \
                    and isinstance(data.shape[i], ir.SymbolicDim) and data.shape[i].value == d.value:
                dims.append(0)
            elif isinstance(d, int) and d > 0:
                dims.append(d)
            else:
                dims.append(-1)
                unknown += 1
        if unknown > 1:
            continue
        const = ir.Value(name=f"{node.name or out.name}.shape", shape=ir.Shape([len(dims)]),
                         type=ir.TensorType(ir.DataType.INT64),
                         const_value=ir.tensor(np.array(dims, np.int64), name=f"{node.name or out.name}.shape"))
        g.register_initializer(const)
        node.replace_input_with(1, const)
        node.attributes.pop("allowzero", None)
        done += 1
    if done:
        common.RemoveUnusedNodesPass()(model)
    return done
