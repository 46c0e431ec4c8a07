"""The ``native`` flavour: the Mamba-2 mixer on ONNX Runtime's own kernels (default-domain opset 27).

Made from the traced ssmscan-flavour graph (SSMScan nodes plus the model-local function) by
:func:`to_native_ort`:

* every ``m2export::SSMScan`` call is inlined with the body of :func:`~m2export.exporter.ssm_scan_op.
  _build_native_body`: the step size as in every flavour, then ``If(seqlen <= NATIVE_RECURRENT_MAX_LEN)``
  one ``LinearAttention`` (``update_rule="gated"``: q = C, k = B expanded from groups to heads,
  v = delta ∘ x, decay = delta · A, scale 1; the D skip outside; the state transposed at the node, since
  LinearAttention keeps (b, h, d_state, headdim) and the graph I/O (b, h, headdim, d_state) like every
  flavour), else the chunked body of the std flavour. ORT 1.32's CPU LinearAttention is a token-by-token
  recurrence (MLAS GEMVs; its chunk_size attribute is unused): accurate and the fastest at decode, but
  slower than the chunked body from ~16 tokens on (one 130m-shaped layer: benchmarks/RESULTS.md);
* every causal depthwise conv of the traced graph (``Concat(past_conv_state, x)`` → ``Conv(group=C)``
  → ``x * Sigmoid(x)``, and the ``Slice`` of the concatenation that is ``present_conv_state``) becomes one
  ``CausalConvWithState(activation="silu")``.

The graph I/O (names, shapes, dtypes) is unchanged. ONNX Runtime >= 1.32 runs both ops on its CPU
provider (kernel counts and times per prefill/decode call: benchmarks/RESULTS.md). Runtimes without
opset 27 use the ``std`` flavour; TensorRT uses the ``ssmscan`` flavour (the plugin).
"""

from __future__ import annotations

from m2export.errors import ExportError
from m2export.exporter.ssm_scan_op import NATIVE_OPSET

#: IR version of the native graphs (onnx 1.22's, the first with opset 27)
NATIVE_IR_VERSION = 11


def to_native_ort(model, nheads: int, n_layer: int, inline):
    """A native-kernel copy of an onnx_ir ssmscan-flavour ``model`` (weights shared, ``model`` untouched).

    Args:
        model: onnx_ir Model with ``m2export::SSMScan`` nodes and the model-local function (ssmscan flavour).
        nheads: heads of every mixer (LinearAttention needs it as an attribute).
        n_layer: mixers expected (one LinearAttention and one CausalConvWithState each).
        inline: the exporter's inlining pass (``export._inline``), applied to the copy.
    Returns:
        The onnx_ir Model of the ``native`` flavour (opset 27, no m2export domain).
    Raises:
        ExportError: the traced graph does not have the expected conv pattern once per layer.
    """
    import onnx_ir as ir

    from m2export.exporter.ssm_scan_op import ssm_scan_function_proto

    out = model.clone()
    out.opset_imports[""] = NATIVE_OPSET
    out.ir_version = max(out.ir_version or 0, NATIVE_IR_VERSION)
    fn = ir.serde.deserialize_function(ssm_scan_function_proto(NATIVE_OPSET, native_nheads=nheads))
    out.functions.clear()
    out.functions[fn.identifier()] = fn
    inline(out)
    fused = fuse_causal_conv(out)
    n_la = sum(1 for n in ir.traversal.RecursiveGraphIterator(out.graph) if n.op_type == "LinearAttention")
    if fused != n_layer or n_la != n_layer:
        raise ExportError(f"internal: the native flavour expected {n_layer} causal convs and scans, found {fused} "
                          f"convs and {n_la} LinearAttention nodes")
    return out


def _single_consumer(value, op_type: str):
    uses = [u.node for u in value.uses()]
    return uses[0] if len(uses) == 1 and uses[0].op_type == op_type and uses[0].domain == "" else None


def fuse_causal_conv(model) -> int:
    """Replace each traced causal depthwise conv + SiLU (+ its state Slice) by ``CausalConvWithState``.

    Pattern (as torch.onnx traces ``Mamba2Mixer``): ``cat = Concat(past, x, axis=2)``; ``present =
    Slice(cat, ...)`` (a graph output); ``c = Conv(cat, W[, bias], group=channels, no padding, stride 1,
    dilation 1)``; ``y = Mul(c, Sigmoid(c))``. Anything else is left as it is. Returns the number fused.
    """
    import onnx_ir as ir

    g = model.graph
    fused = 0
    for conv in [n for n in g if n.op_type == "Conv" and n.domain == ""]:
        cat = conv.inputs[0].producer() if conv.inputs[0] is not None else None
        if cat is None or cat.op_type != "Concat" or len(cat.inputs) != 2 or cat.attributes["axis"].as_int() != 2:
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
        inputs = [x, w, conv.inputs[2] if len(conv.inputs) > 2 else None, past]
        node = ir.node("CausalConvWithState", inputs, {"activation": "silu"}, num_outputs=2,
                       name=f"{conv.name or 'conv'}.causal_conv_with_state")
        g.insert_before(cat, node)
        y, state = node.outputs
        y_name, present_name = mul.outputs[0].name, present.name
        y.dtype, y.shape = mul.outputs[0].dtype, mul.outputs[0].shape
        state.dtype, state.shape = present.dtype, present.shape
        mul.outputs[0].replace_all_uses_with(y, replace_graph_outputs=True)
        present.replace_all_uses_with(state, replace_graph_outputs=True)  # present_conv_state.{i}
        for n in (mul, sig, conv, slices[0], cat):
            g.remove(n, safe=True)
        y.name, state.name = y_name, present_name
        fused += 1
    if fused:
        import onnx_ir.passes.common as common

        common.RemoveUnusedNodesPass()(model)
    return fused
