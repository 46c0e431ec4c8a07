"""Graph pieces built directly from the model description, without tracing (onnx_ir nodes over the model's tensors).

:func:`m2export.exporter.stamp.trace_stamped` composes the export graph from pieces: the embedding, every
layer, the final norm and head. Tracing one piece costs seconds of ``torch.export`` (its first call also
imports ``torch._dynamo``), while the pieces m2export itself describes are a fixed sequence of standard ONNX
ops plus one ``m2export::SSMScan``: those are built here, node by node, from the layer's
:class:`~m2export.models.spec.MambaSpec` and the model's own tensors (as mobius, onnxruntime-genai's model
builder and TensorRT-LLM build networks). Pieces without a builder (attention, MLP, MoE, shared blocks,
multipliers, bfloat16) are traced as before.

Each builder emits exactly the ops the traced and optimised piece has, in the same dtypes (so the flavour
passes after it, :func:`~m2export.exporter.export._inline` and :mod:`~m2export.exporter.native_ort`, see the
same patterns), with two simplifications that compute the same values: reshape targets are constants (``0``
copies the batch and sequence dims), and the conv state's ``Slice`` starts at ``-(d_conv - 1)`` (at the end for d_conv 1)
instead of at the traced ``sequence_length``. Weights are the model's tensors without copies (transposed
weights are numpy views, written in blocks when saved); derived constants (``A = -exp(A_log)``, float32
copies of a float16 model's norm weights, ``D`` and ``dt_bias``) are computed with torch, as the model does.

Tested against the traced graph and PyTorch in ONNX Runtime (tests/exporter/test_graph_build.py).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from m2export import contract
from m2export.exporter.configs import SEQ

#: the torch dtypes the builders cover (bfloat16 is traced: its conv runs through a float32 island there)
BUILT_DTYPES = (torch.float32, torch.float16)


def _ir():
    import onnx_ir as ir

    return ir


def can_build_embed(model) -> bool:
    """The embedding (and the residual stream's first value) has a builder."""
    return model.dtype in BUILT_DTYPES and model.spec.embedding_multiplier == 1.0


def can_build_head(model) -> bool:
    """The final norm and lm_head have a builder."""
    return model.dtype in BUILT_DTYPES and model.spec.logits_multiplier == 1.0


def can_build_layer(model, i: int) -> bool:
    """Layer ``i`` has a builder: a Mamba-2 mixer with the pre-norm residual and nothing else (no FFN, shared
    block or multiplier)."""
    from m2export.models.spec import MambaSpec

    spec = model.spec.layers[i]
    m = spec.mixer
    return (model.dtype in BUILT_DTYPES and isinstance(m, MambaSpec) and spec.ffn is None and spec.shared is None
            and spec.residual_multiplier == 1.0 and m.in_multiplier == 1.0 and m.out_multiplier == 1.0
            and m.zxbcdt_multipliers is None)


class Builder:
    """Appends nodes to one onnx_ir graph.

    ``weight(tensor)`` returns the graph's initializer for a model tensor (named and shared by the caller:
    :func:`~m2export.exporter.stamp.trace_stamped` keeps one initializer per tensor, aliases included);
    ``derived(key, make, name)`` one for a value computed from model tensors (``make()`` -> numpy array, called
    once per ``key``). Small constants of the code are initializers shared by every piece.
    """

    def __init__(self, graph, weight: Callable, derived: Callable):
        self.graph, self.weight, self.derived = graph, weight, derived
        self._consts: dict[tuple, object] = {}

    # ------------------------------------------------------------------ values
    def const(self, array) -> object:
        """An initializer holding ``array`` (one per distinct dtype, shape and content in the graph)."""
        ir = _ir()
        a = np.asarray(array)
        key = (a.dtype.str, a.shape, a.tobytes())
        if key not in self._consts:
            name = f"const.{len(self._consts)}"
            v = ir.Value(name=name, shape=ir.Shape(a.shape), type=ir.TensorType(ir.DataType.from_numpy(a.dtype)),
                         const_value=ir.Tensor(a, name=name))
            self.graph.register_initializer(v)
            self._consts[key] = v
        return self._consts[key]

    def op(self, op_type: str, inputs: list, attrs: dict | None = None, *, name: str, shape, dtype,
           domain: str = "", outputs: int = 1):
        """Append one node; its output(s) get ``name`` (``name.k`` for k > 0), ``shape`` and ``dtype`` (lists
        of them for several outputs). Returns the output value (a list for several)."""
        ir = _ir()
        node = ir.node(op_type, inputs, attrs or {}, domain=domain, num_outputs=outputs, name=name)
        shapes = shape if outputs > 1 else [shape]
        dtypes = dtype if outputs > 1 else [dtype]
        for k, (o, s, d) in enumerate(zip(node.outputs, shapes, dtypes)):
            o.name = name if k == 0 else f"{name}.{k}"
            o.type = ir.TensorType(d)
            o.shape = ir.Shape(s)
        self.graph.append(node)
        return list(node.outputs) if outputs > 1 else node.outputs[0]

    def cast(self, v, dtype, name: str):
        """``v`` as ``dtype`` (``v`` itself when it already is)."""
        return v if v.dtype == dtype else self.op("Cast", [v], {"to": int(dtype)}, name=name, shape=list(v.shape),
                                                  dtype=dtype)

    def rms_core(self, x, eps: float, name: str):
        """``x * Reciprocal(Sqrt(ReduceMean(Pow(x, 2), [-1]) + eps))`` (float32 ``x``), as traced."""
        ir = _ir()
        f = ir.DataType.FLOAT
        red = [*x.shape[:-1], 1]
        p = self.op("Pow", [x, self.const(np.float32(2.0))], name=f"{name}.pow", shape=list(x.shape), dtype=f)
        m = self.op("ReduceMean", [p, self.const(np.array([-1], np.int64))], {"keepdims": 1, "noop_with_empty_axes": 0},
                    name=f"{name}.mean", shape=red, dtype=f)
        a = self.op("Add", [m, self.const(np.float32(eps))], name=f"{name}.add_eps", shape=red, dtype=f)
        s = self.op("Sqrt", [a], name=f"{name}.sqrt", shape=red, dtype=f)
        r = self.op("Reciprocal", [s], name=f"{name}.rsqrt", shape=red, dtype=f)
        return self.op("Mul", [x, r], name=f"{name}.normed", shape=list(x.shape), dtype=f)

    def float_weight(self, t: torch.Tensor, name: str):
        """``t.float()`` as an initializer: the tensor itself when float32, else a float32 copy."""
        if t.dtype == torch.float32:
            return self.weight(t)
        return self.derived(("float", id(t)), lambda: t.detach().float().numpy(), name)

    def transposed(self, t: torch.Tensor, name: str):
        """``t.T`` of a 2-D weight as an initializer (a numpy view of ``t``: no copy until it is written)."""
        return self.derived(("T", id(t)), lambda: t.detach().numpy().T, name)

    def rms_norm(self, x, norm, out_dtype, name: str):
        """:class:`~m2export.models.mamba2.RMSNorm` ``norm`` of ``x``: float32 inside, ``out_dtype`` out."""
        ir = _ir()
        xf = self.cast(x, ir.DataType.FLOAT, f"{name}.in_float")
        y = self.rms_core(xf, norm.eps, name)
        y = self.op("Mul", [y, self.float_weight(norm.weight, f"{name}.weight_float")], name=f"{name}.scaled",
                    shape=list(x.shape), dtype=ir.DataType.FLOAT)
        return self.cast(y, out_dtype, f"{name}.out")

    def silu(self, x, name: str):
        s = self.op("Sigmoid", [x], name=f"{name}.sigmoid", shape=list(x.shape), dtype=x.dtype)
        return self.op("Mul", [x, s], name=name, shape=list(x.shape), dtype=x.dtype)

    def linear(self, x, lin, name: str):
        """``x @ W.T (+ b)`` of a torch Linear ``lin``."""
        W = lin.weight
        shape = [*x.shape[:-1], W.shape[0]]
        y = self.op("MatMul", [x, self.transposed(W, f"{name}.weight_t")], name=name, shape=shape, dtype=x.dtype)
        if lin.bias is not None:
            y = self.op("Add", [y, self.weight(lin.bias)], name=f"{name}.bias", shape=shape, dtype=x.dtype)
        return y

    def reshape(self, x, dims: list[int], name: str):
        """Reshape to ``(batch, seq, *dims)`` with a constant target (``0`` copies the two leading dims)."""
        return self.op("Reshape", [x, self.const(np.array([0, 0, *dims], np.int64))], name=name,
                       shape=[*x.shape[:2], *dims], dtype=x.dtype)


def dtype_of(t: torch.Tensor):
    """onnx_ir DataType of a (float32/float16) torch tensor's dtype."""
    return _ir().DataType.from_numpy(t.detach().numpy().dtype)


def embed(b: Builder, model, ids):
    """``(h, emb)`` of :meth:`HybridLM.embed` for the graph input ``ids`` (batch, seq) int64.

    Tied embeddings read the lm_head's transposed weight (``Gather(W.T, ids, axis=1)``, then a Transpose),
    so the tied weight is stored once, as the head's (d_model, vocab) matrix; untied ones ``Gather(W, ids)``.
    """
    ir = _ir()
    W = model.backbone.embedding.weight
    dt = dtype_of(W)
    d = W.shape[1]
    out = [*ids.shape, d]
    if model.spec.tie_embeddings:
        g = b.op("Gather", [b.transposed(W, "lm_head.weight_t"), ids], {"axis": 1}, name="embed.gather_t",
                 shape=[d, *ids.shape], dtype=dt)
        emb = b.op("Transpose", [g], {"perm": [1, 2, 0]}, name="emb", shape=out, dtype=dt)
    else:
        emb = b.op("Gather", [b.weight(W), ids], {"axis": 0}, name="emb", shape=out, dtype=dt)
    h = b.cast(emb, ir.DataType.FLOAT, "h") if model.spec.residual_in_fp32 else emb
    return h, emb


def head(b: Builder, model, h):
    """Logits of :meth:`HybridLM.head`: ``lm_head(norm_f(h))`` in the model dtype."""
    W = model.lm_head.weight
    x = b.rms_norm(h, model.backbone.norm_f, dtype_of(W), "head/norm_f")
    return b.op("MatMul", [x, b.transposed(W, "lm_head.weight_t")], name="logits", shape=[*h.shape[:-1], W.shape[0]],
                dtype=dtype_of(W))


def mamba_layer(b: Builder, layer, h, states: list, prefix: str, packing=None):
    """One :class:`~m2export.models.mamba2.Layer` with a Mamba-2 mixer (``can_build_layer``):
    ``h + mixer(norm(h))``, the mixer as :meth:`Mamba2Mixer.forward` with its scan as one ``m2export::SSMScan``.

    Args:
        h: the residual stream (batch, seq, d_model) value; states: the layer's ``past_conv_state`` and
            ``past_ssm_state`` graph inputs; prefix: value-name prefix (``layers.{i}/``).
        packing: a :class:`~m2export.exporter.packed.Packing` for the packed prefill graph (batch 1 of packed
            tokens, states per sequence): the conv restarts at every sequence boundary from that sequence's
            conv state, and the scan is one ``m2export::SSMScanPacked``; None for the regular graph.
    Returns:
        ``(h_out, [present_conv_state, present_ssm_state])`` (values; the caller names the graph outputs).
    """
    ir = _ir()
    from m2export.contract import SSMScanAttrs
    from m2export.exporter.ssm_scan_op import PLUGIN_ATTRIBUTES

    mixer = layer.mixer
    s = mixer.spec
    f32 = ir.DataType.FLOAT
    dt = dtype_of(mixer.in_proj.weight)
    bl = list(h.shape[:2])
    p = prefix
    x = b.rms_norm(h, layer.norm, dtype_of(layer.norm.weight), f"{p}norm")
    zxbcdt = b.linear(x, mixer.in_proj, f"{p}in_proj")
    z, xBC, dtv = b.op("Split", [zxbcdt, b.const(np.array([s.d_inner, s.conv_dim, s.nheads], np.int64))], {"axis": 2},
                       name=f"{p}split_zxbcdt", outputs=3, dtype=[dt] * 3,
                       shape=[[*bl, s.d_inner], [*bl, s.conv_dim], [*bl, s.nheads]])
    conv = _conv if packing is None else packing.conv
    ct, present_conv = conv(b, mixer, xBC, states[0], p)
    gn = s.ngroups * s.d_state
    xs, Bs, Cs = b.op("Split", [ct, b.const(np.array([s.d_inner, gn, gn], np.int64))], {"axis": 2},
                      name=f"{p}split_xBC", outputs=3, dtype=[dt] * 3,
                      shape=[[*bl, s.d_inner], [*bl, gn], [*bl, gn]])
    A_log = mixer.A_log
    inputs = {"x": b.reshape(xs, [s.nheads, s.headdim], f"{p}x"), "dt": dtv,
              "A": b.derived(("A", id(A_log)), lambda: (-torch.exp(A_log.detach().float())).numpy(), f"{p}A"),
              "B": b.reshape(Bs, [s.ngroups, s.d_state], f"{p}B"), "C": b.reshape(Cs, [s.ngroups, s.d_state], f"{p}C"),
              "D": b.float_weight(mixer.D, f"{p}D_float"),
              "dt_bias": b.float_weight(mixer.dt_bias, f"{p}dt_bias_float"),
              "initial_state": b.cast(states[1], f32, f"{p}past_ssm_float")}
    attrs = {**SSMScanAttrs.make(chunk_size=s.chunk_size, dt_softplus=True, dt_limit=s.dt_limit).onnx_attributes(),
             **PLUGIN_ATTRIBUTES}
    if packing is None:
        op, names, nstate = contract.OP_NAME, contract.INPUT_NAMES, bl[0]
    else:
        op, names, nstate = contract.PACKED_OP_NAME, contract.PACKED_INPUT_NAMES, packing.nseq_dim
        inputs[contract.CU_SEQLENS.name] = packing.cu_seqlens
    y, final = b.op(op, [inputs[n] for n in names], attrs, domain=contract.OP_DOMAIN,
                    name=f"{p}ssm_scan", outputs=2, dtype=[dt, f32],
                    shape=[[*bl, s.nheads, s.headdim], [nstate, s.nheads, s.headdim, s.d_state]])
    y = b.reshape(y, [s.d_inner], f"{p}y")
    y = _gate(b, mixer, y, z, p)
    out = b.linear(y, mixer.out_proj, f"{p}out_proj")
    out = b.cast(out, h.dtype, f"{p}out_proj_residual")
    h_out = b.op("Add", [h, out], name=f"{p}h_out", shape=list(h.shape), dtype=h.dtype)
    return h_out, [present_conv, final]


def _conv(b: Builder, mixer, xBC, past_conv_state, p: str):
    """The mixer's causal depthwise conv1d + SiLU over ``past_conv_state`` then ``xBC`` (batch, seq, conv_dim):
    ``(xBC_conv (batch, seq, conv_dim), present_conv_state (batch, conv_dim, d_conv - 1))``."""
    ir = _ir()
    s = mixer.spec
    dt = xBC.dtype
    bl = list(xBC.shape[:2])
    k = s.d_conv - 1
    xt = b.op("Transpose", [xBC], {"perm": [0, 2, 1]}, name=f"{p}xBC_t", shape=[bl[0], s.conv_dim, bl[1]], dtype=dt)
    past_conv = b.cast(past_conv_state, dt, f"{p}past_conv")
    cat = b.op("Concat", [past_conv, xt], {"axis": 2}, name=f"{p}conv_in", dtype=dt,
               shape=[bl[0], s.conv_dim, ir.SymbolicDim(f"{SEQ} + {k}")])
    ends = np.array([np.iinfo(np.int64).max], np.int64)
    # the last k columns; k = 0 (d_conv 1) starts at the end: a start of -0 would be 0, the whole concat
    start = np.array([-k if k else np.iinfo(np.int64).max], np.int64)
    present_conv = b.op("Slice", [cat, b.const(start), b.const(ends),
                                  b.const(np.array([2], np.int64)), b.const(np.array([1], np.int64))],
                        name=f"{p}present_conv_state", shape=[bl[0], s.conv_dim, k], dtype=dt)
    conv = mixer.conv1d
    conv_in = [cat, b.weight(conv.weight)] + ([b.weight(conv.bias)] if conv.bias is not None else [])
    c = b.op("Conv", conv_in, {"group": s.conv_dim, "kernel_shape": [s.d_conv], "pads": [0, 0], "strides": [1],
                               "dilations": [1]}, name=f"{p}conv1d", shape=[bl[0], s.conv_dim, bl[1]], dtype=dt)
    c = b.silu(c, f"{p}conv_silu")
    ct = b.op("Transpose", [c], {"perm": [0, 2, 1]}, name=f"{p}xBC_conv", shape=[*bl, s.conv_dim], dtype=dt)
    return ct, present_conv


def _gate(b: Builder, mixer, y, z, p: str):
    """The mixer's output gate: ``RMSNormGated`` (per group, before or after the gate) or ``y * silu(z)``."""
    ir = _ir()
    s = mixer.spec
    f32 = ir.DataType.FLOAT
    dt = y.dtype
    bl = list(y.shape[:2])
    yf = b.cast(y, f32, f"{p}y_float")
    zs = b.silu(b.cast(z, f32, f"{p}z_float"), f"{p}z_silu")
    if s.norm == "gate":
        g = b.op("Mul", [yf, zs], name=f"{p}gated", shape=list(y.shape), dtype=f32)
        return b.cast(g, dt, f"{p}gated_out")
    norm = mixer.norm
    x = yf if s.norm_before_gate else b.op("Mul", [yf, zs], name=f"{p}gated", shape=list(y.shape), dtype=f32)
    groups = s.d_inner // norm.group_size
    g = b.reshape(x, [groups, norm.group_size], f"{p}norm_groups")
    g = b.rms_core(g, norm.eps, f"{p}gated_norm")
    g = b.reshape(g, [s.d_inner], f"{p}norm_flat")
    g = b.op("Mul", [g, b.float_weight(norm.weight, f"{p}norm_weight_float")], name=f"{p}gated_norm.scaled",
             shape=[*bl, s.d_inner], dtype=f32)
    if s.norm_before_gate:
        g = b.op("Mul", [g, zs], name=f"{p}gated", shape=[*bl, s.d_inner], dtype=f32)
    return b.cast(g, dt, f"{p}gated_out")


def graph_input(io_tensor):
    """A graph input value with the name, dtype and symbolic shape of a :class:`~m2export.exporter.configs.TensorIO`."""
    ir = _ir()
    from m2export.exporter.ssm_scan_op import _elem_type

    dims = [d if isinstance(d, int) else ir.SymbolicDim(d) for d in io_tensor.shape]
    return ir.Value(name=io_tensor.name, type=ir.TensorType(ir.DataType(_elem_type(io_tensor.dtype))),
                    shape=ir.Shape(dims))


def new_model(opset: int):
    """An empty onnx_ir Model for the built graph (default domain at ``opset``, the SSMScan domain)."""
    ir = _ir()
    import onnx

    ir_version = max(10, onnx.helper.find_min_ir_version_for([onnx.helper.make_opsetid("", opset)]))
    graph = ir.Graph([], [], nodes=[], opset_imports={"": opset, contract.OP_DOMAIN: contract.OP_VERSION},
                     name="main_graph")
    return ir.Model(graph, ir_version=ir_version, producer_name="m2export")


__all__ = ["Builder", "can_build_embed", "can_build_head", "can_build_layer", "embed", "head",
           "mamba_layer", "graph_input", "new_model", "dtype_of"]
