"""SSMScan in the exported graph: the torch custom op, its ONNX translation and its ONNX function body.

* :data:`ssm_scan` is ``torch.ops.m2export.ssm_scan``, a ``torch.library.custom_op`` whose eager
  implementation is :func:`m2export.kernels.ssd.naive.ssm_scan_chunked` and whose fake (meta)
  implementation applies :func:`m2export.contract.output_shapes` / ``output_dtypes``. torch.export keeps
  it as one opaque call.
* :func:`translate_ssm_scan` (for ``torch.onnx.export(custom_translation_table=...)``) lowers that call to
  ONE node ``m2export::SSMScan`` (opset version 1) with the contract's inputs, attributes from
  :meth:`SSMScanAttrs.onnx_attributes` and ``plugin_namespace``/``plugin_version``, so TensorRT picks the
  registered plugin.
* :func:`ssm_scan_function_proto` is the model-local ONNX function of the same name and domain: the
  chunked SSD (arXiv:2405.21060, Sec. 6, Listing 1) in standard ONNX ops, so ONNX Runtime (and any
  runtime without the plugin) runs the plugin flavour. Its attributes are *referenced* inside the body
  (``Constant(value_int=@chunk_size)`` etc.), so one function serves every node, whatever attribute
  values each layer carries. Inlining it gives the ``std`` flavour (standard ops only).

Design of the body (every step in float32, Cast islands at entry/exit for fp16/bf16 graphs):

1. ``delta = clamp(where(v > 20, v, log(1 + exp(min(v, 20)))), dt_min, dt_max)``, ``v = dt + dt_bias``
   (ONNX ``Softplus`` has no large-input passthrough and overflows in fp16); with ``dt_softplus=0``
   ``delta = clamp(v, dt_min, dt_max)``.
2. Chunk length ``Q = min(chunk_size, seqlen)`` (evaluation order only, see the contract), ``seqlen``
   padded to ``nchunks * Q`` with ``delta = 0`` on padded steps (they neither decay nor add).
3. Within-chunk cumulative sum ``cs`` of ``delta * A`` (decay from the chunk start) as a MatMul with a
   triangular 0/1 matrix built from ``Range``.
4. Segment sums ``seg[i, j] = sum_{j<k<=i} delta_k A`` summed from their own terms (``delta_k A`` masked to
   ``k > j``, one ``CumSum`` down ``i``), never ``cs_i - cs_j``: with large ``dt`` the cumulative sums reach
   thousands and their difference carries that magnitude's fp32 rounding (~1e-4 in every exponent).
   Every CumSum in the graph has the same axis (-2) and no ``reverse``/``exclusive``: the TensorRT
   ICumulativeLayer bugs (TensorRT#4551: several CumSums on different axes; #4513: differing ``reverse``)
   need those differences. Intra-chunk output ``(C Bᵀ ∘ exp(seg) masked to j <= i) · (delta ∘ x)``.
5. Chunk states ``xᵀ · (exp(seg[last, :]) delta ∘ B)``.
6. State passing in closed form: with the initial state as chunk -1, the state entering chunk c is
   ``sum_{m <= c} exp(sum_{k=m}^{c-1} T_k) S_m`` (``T_k`` the total log-decay of chunk k). The exponent
   is a masked sum (one MatMul with a 0/1 tensor, no difference of long cumulative sums, so no
   cancellation on long sequences), then one masked ``exp`` and one MatMul over chunks: no Loop/Scan.
7. ``y = intra + exp(cs) ∘ (C · state_in) + D x``, cast back to the dtype of ``x``.

Steps 2-7 run only for ``seqlen > 1``: the body is ``If(seqlen == 1)`` one step of the recurrence itself
(``h = exp(delta A) h0 + (delta x) Bᵀ``, ``y = h C + D x``; a decode token), else the chunked SSD. One
graph serves prefill and decode, and the step costs a fraction of the chunked body at one token
(benchmarks/bench_ort_scan_body.py). The native flavour (ONNX Runtime only) has its own bodies,
specialised per attribute set and model size: :func:`native_ssm_scan_function`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from m2export import contract
from m2export.contract import SSMScanAttrs
from m2export.kernels.ssd.naive import ssm_scan_chunked

#: the torch custom op (namespace::name) that stands for SSMScan during export
TORCH_OP = "m2export::ssm_scan"
PLUGIN_ATTRIBUTES = {"plugin_namespace": contract.PLUGIN_NAMESPACE, "plugin_version": contract.PLUGIN_VERSION}

#: The floor of every dt*A in the chunked bodies. exp(-1e30) is 0 in float32, as exp(-inf) is, so a floored step
#: decays the state to exactly 0 as the float64 recurrence does; and 1e8 floored steps sum to -1e38, above
#: -FLT_MAX (3.4e38), so no segment or chunk sum overflows to -inf and no masked MatMul meets -inf * 0.
DA_FLOOR = -1e30


# --------------------------------------------------------------------------- torch custom op
@torch.library.custom_op(TORCH_OP, mutates_args=())
def ssm_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor, dt_bias: torch.Tensor, initial_state: torch.Tensor, chunk_size: int,
             dt_softplus: bool, dt_min: float, dt_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SSMScan with all eight inputs present (see m2export.contract); eager impl = chunked reference."""
    y, final_state = ssm_scan_chunked(x, dt, A, B, C, D, dt_bias, initial_state, chunk_size=chunk_size,
                                      dt_softplus=dt_softplus, dt_limit=(dt_min, dt_max))
    return y, final_state


@ssm_scan.register_fake
def _ssm_scan_fake(x, dt, A, B, C, D, dt_bias, initial_state, chunk_size, dt_softplus, dt_min, dt_max):
    y_shape, s_shape = contract.output_shapes(x.shape, B.shape)
    return x.new_empty(y_shape), x.new_empty(s_shape, dtype=torch.float32)


def ssm_scan_fn(x, dt, A, B, C, D=None, dt_bias=None, initial_state=None, *, chunk_size: int,
                dt_softplus: bool = True, dt_limit: tuple[float, float] = (0.0, math.inf)):
    """A ``Mamba2Mixer.scan_fn`` that calls the custom op (absent optional inputs materialised as zeros)."""
    nheads = x.shape[2]
    if D is None:
        D = x.new_zeros(nheads, dtype=torch.float32)
    if dt_bias is None:
        dt_bias = x.new_zeros(nheads, dtype=torch.float32)
    if initial_state is None:
        initial_state = x.new_zeros((x.shape[0], nheads, x.shape[3], B.shape[3]), dtype=torch.float32)
    attrs = SSMScanAttrs.make(chunk_size=int(chunk_size), dt_softplus=dt_softplus, dt_limit=dt_limit)
    return torch.ops.m2export.ssm_scan(x, dt, A, B, C, D, dt_bias, initial_state, attrs.chunk_size,
                                       attrs.dt_softplus, attrs.dt_min, attrs.dt_max)


# --------------------------------------------------------------------------- ONNX translation
_ONNX_ATTR_TYPES = {"int": onnx.defs.OpSchema.AttrType.INT, "float": onnx.defs.OpSchema.AttrType.FLOAT,
                    "string": onnx.defs.OpSchema.AttrType.STRING}
_PROTO_ATTR_TYPES = {"int": onnx.AttributeProto.INT, "float": onnx.AttributeProto.FLOAT,
                     "string": onnx.AttributeProto.STRING}


def onnx_op_schema() -> onnx.defs.OpSchema:
    """An (unregistered) OpSchema of m2export::SSMScan v1, built from the contract.

    Used only to let the torch exporter's onnxscript tracer emit the node; never registered globally.
    """
    S = onnx.defs.OpSchema
    tx = "T"

    def param(spec):
        return S.FormalParameter(spec.name, tx if spec.dtype == "x" else "tensor(float)", spec.doc)

    attrs = [S.Attribute(a.name, _ONNX_ATTR_TYPES[a.type], a.doc, required=False) for a in contract.ATTRIBUTES]
    attrs += [S.Attribute(k, S.AttrType.STRING, "TensorRT plugin selection", required=False) for k in PLUGIN_ATTRIBUTES]
    return S(contract.OP_NAME, contract.OP_DOMAIN, contract.OP_VERSION,
             "Chunked selective scan of one Mamba-2 layer (m2export/contract.py)",
             inputs=[param(s) for s in contract.INPUTS], outputs=[param(s) for s in contract.OUTPUTS],
             type_constraints=[(tx, [f"tensor({d.replace('float32', 'float')})" for d in contract.FLOAT_DTYPES],
                                "dtype of x, dt, B, C and y")],
             attributes=attrs)


_SSM_OP = None


def _onnxscript_op():
    global _SSM_OP
    if _SSM_OP is None:
        import onnxscript
        from onnxscript._internal.values import Op

        _SSM_OP = Op(onnxscript.values.Opset(contract.OP_DOMAIN, contract.OP_VERSION), contract.OP_NAME,
                     onnx_op_schema())
    return _SSM_OP


def translate_ssm_scan(x, dt, A, B, C, D, dt_bias, initial_state, chunk_size: int, dt_softplus: bool,
                       dt_min: float, dt_max: float):
    """custom_translation_table entry: torch.ops.m2export.ssm_scan -> one m2export::SSMScan node."""
    attrs = SSMScanAttrs(chunk_size=int(chunk_size), dt_softplus=bool(dt_softplus), dt_min=float(dt_min),
                         dt_max=float(dt_max)).onnx_attributes()
    return _onnxscript_op()(x, dt, A, B, C, D, dt_bias, initial_state, **attrs, **PLUGIN_ATTRIBUTES)


def custom_translation_table() -> dict:
    return {torch.ops.m2export.ssm_scan.default: translate_ssm_scan}


# --------------------------------------------------------------------------- ONNX function body
class _Body:
    """Tiny node builder: ``b.op("Add", a, c)`` appends a node and returns its output name."""

    def __init__(self, prefix: str = ""):
        self.nodes: list[onnx.NodeProto] = []
        self._n = 0
        self._prefix = prefix  # keeps the names of an If branch apart from its outer scope's

    def op(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", **attrs):
        outs = []
        for _ in range(outputs):
            self._n += 1
            outs.append(f"_{self._prefix}{op_type.lower()}{self._n}")
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, domain=domain, **attrs))
        return outs[0] if outputs == 1 else outs

    def ref_constant(self, kind: str, attr: str) -> str:
        """Scalar Constant whose value is the calling node's attribute ``attr`` (an attribute reference)."""
        self._n += 1
        out = f"_attr_{attr}"
        node = helper.make_node("Constant", [], [out])
        kind_type = _PROTO_ATTR_TYPES["int" if kind == "value_int" else "float"]
        node.attribute.append(helper.make_attribute_ref(kind, kind_type, ref_attr_name=attr))
        self.nodes.append(node)
        return out

    def const(self, value, dtype=np.int64) -> str:
        self._n += 1
        out = f"_{self._prefix}const{self._n}"
        self.nodes.append(helper.make_node("Constant", [], [out], value=onnx.numpy_helper.from_array(
            np.asarray(value, dtype=dtype), name=out)))
        return out


def _entry(b: _Body) -> dict[str, str]:
    """fp32 casts of the inputs, their sizes (1-D int64) and step 1, the step size ``delta`` (b, L, h)."""
    F = TensorProto.FLOAT
    x, dt, A, B, C, D, dt_bias, h0 = contract.INPUT_NAMES
    one_f, twenty = b.const(1.0, np.float32), b.const(20.0, np.float32)
    e = dict(zip(("xf", "dtf", "Bf", "Cf", "Af", "Df", "dtbf", "h0f"),
                 (b.op("Cast", t, to=F) for t in (x, dt, B, C, A, D, dt_bias, h0))))
    e.update(zip(("bsz", "L", "h", "p"), (b.op("Shape", x, start=k, end=k + 1) for k in range(4))))
    e["g"], e["n"] = b.op("Shape", B, start=2, end=3), b.op("Shape", B, start=3, end=4)
    e["hpg"] = b.op("Div", e["h"], e["g"])

    # 1. step size delta = clamp(softplus(dt + dt_bias)) in fp32                       (b, L, h)
    v = b.op("Add", e["dtf"], e["dtbf"])
    sp = b.op("Where", b.op("Greater", v, twenty), v,
              b.op("Log", b.op("Add", b.op("Exp", b.op("Min", v, twenty)), one_f)))
    use_sp = b.op("Cast", b.ref_constant("value_int", "dt_softplus"), to=TensorProto.BOOL)
    v = b.op("Where", use_sp, sp, v)
    dmin, dmax = b.ref_constant("value_float", "dt_min"), b.ref_constant("value_float", "dt_max")
    # always clamped at dt_min >= 0 (also with dt_softplus=0: every step decays, see the contract)
    e["delta"] = b.op("Min", b.op("Max", v, dmin), dmax)
    return e


def _chunk_len(b: _Body, L: str) -> str:
    """Step 2's chunk length ``Q = max(1, min(chunk_size, L))`` (1-D int64; the node's chunk_size attribute)."""
    one = b.const([1])
    return b.op("Max", b.op("Min", b.op("Reshape", b.ref_constant("value_int", "chunk_size"), one), L), one)


def _build_body() -> tuple[list[onnx.NodeProto], Sequence[str], Sequence[str]]:
    """The SSMScan body in standard ops: ``If(seqlen == 1)`` one recurrence step (:func:`_step_scan`, a decode
    token), else the chunked SSD (steps 2-7 of the module docstring). Step 1 (delta) is shared."""
    b = _Body()
    e = _entry(b)
    Q = _chunk_len(b, e["L"])
    one_token = b.op("Equal", e["L"], b.const([1]))
    y, final = _if(b, one_token, ("step", lambda bb: _step_scan(bb, e)), ("chunked", lambda bb: _chunked_scan(bb, e, Q)))
    return _finish(b, y, final)


def _if(b: _Body, cond: str, then: tuple, other: tuple) -> tuple[str, str]:
    """Append ``If(cond, then, other)`` to ``b``; returns its outputs (y float32, final_state). ``then``/``other``
    are (name, build): ``build(body)`` appends a branch to a fresh body and returns its (y, final_state)."""
    branches = []
    for name, build in (then, other):
        bb = _Body(prefix=f"{b._prefix}{name}_")  # unique names across nested branches
        y, s = build(bb)
        branches.append(helper.make_graph(bb.nodes, f"ssm_scan_{b._prefix}{name}", [], [
            helper.make_tensor_value_info(y, TensorProto.FLOAT, None),
            helper.make_tensor_value_info(s, TensorProto.FLOAT, None)]))
    return b.op("If", cond, outputs=2, then_branch=branches[0], else_branch=branches[1])


def _finish(b: _Body, y: str, final: str) -> tuple[list[onnx.NodeProto], Sequence[str], Sequence[str]]:
    """The body's outputs: y cast back to the dtype of x, final_state (float32)."""
    b.nodes.append(helper.make_node("CastLike", [y, contract.INPUT_NAMES[0]], [contract.OUTPUT_NAMES[0]]))
    b.nodes.append(helper.make_node("Identity", [final], [contract.OUTPUT_NAMES[1]]))
    return b.nodes, contract.INPUT_NAMES, contract.OUTPUT_NAMES


def _step_scan(b: _Body, e: dict[str, str]) -> tuple[str, str]:
    """One token (seqlen 1) of the recurrence, appended to ``b``: ``h1 = exp(delta*A) h0 + (delta x) B^T``,
    ``y = h1 C + D x`` (the SSD definition itself; no chunking, no segment sums: one decay per token).

    At one token it is ~4.5x cheaper in ONNX Runtime than the chunked body (one 130m-shaped layer, CPU,
    best of 30: 0.41 vs 1.82 ms; benchmarks/RESULTS.md). Returns (y float32 (b, 1, h, p), final_state (b, h, p, n)).
    """
    bsz, h, p, g, n, hpg = (e[k] for k in ("bsz", "h", "p", "g", "n", "hpg"))
    one = b.const([1])
    d = b.op("Reshape", e["delta"], b.op("Concat", bsz, h, axis=0))  # (b, h)
    decay = b.op("Exp", b.op("Mul", d, e["Af"]))  # (b, h); delta >= 0, A < 0: in (0, 1]
    x1 = b.op("Reshape", e["xf"], b.op("Concat", bsz, h, p, axis=0))  # (b, h, p)
    xd = b.op("Mul", x1, b.op("Unsqueeze", d, b.const([-1])))  # delta x

    def heads(t):  # (b, 1, g, n) -> (b, h, n), head h reading group h // hpg
        t4 = b.op("Reshape", t, b.op("Concat", bsz, g, one, n, axis=0))
        return b.op("Reshape", b.op("Expand", t4, b.op("Concat", bsz, g, hpg, n, axis=0)),
                    b.op("Concat", bsz, h, n, axis=0))

    Bh, Ch = heads(e["Bf"]), heads(e["Cf"])
    upd = b.op("Mul", b.op("Unsqueeze", xd, b.const([-1])), b.op("Unsqueeze", Bh, b.const([2])))  # (b, h, p, n)
    h1 = b.op("Add", b.op("Mul", e["h0f"], b.op("Unsqueeze", decay, b.const([2, 3]))), upd)
    y = b.op("MatMul", h1, b.op("Unsqueeze", Ch, b.const([-1])))  # (b, h, p, 1)
    y = b.op("Add", b.op("Reshape", y, b.op("Concat", bsz, one, h, p, axis=0)),
             b.op("Mul", e["xf"], b.op("Unsqueeze", e["Df"], one)))
    return y, h1


def _within_chunks(b: _Body, xc: str, dc: str, Bc: str, Cc: str, A3: str, Q: str) -> tuple[str, str, str, str]:
    """Steps 3-5 on chunked tensors (every chunk from a zero state): xc (b, nc, g, hpg, Q, p), dc (b, nc, g, hpg, Q)
    (delta; 0 on padded steps), Bc/Cc (b, nc, g, 1, Q, n), A3 (g, hpg, 1), Q (1-D int64).

    Returns (cs (b, nc, g, hpg, Q): decay from the chunk start, y_diag (b, nc, g, hpg, Q, p): intra-chunk output,
    states (b, nc, g, hpg, p, n): state at the chunk end, cs_last (b, nc, g, hpg, 1): chunk totals of delta*A).
    Shared by the SSMScan body and the SSMScanPacked body (whose chunks never straddle a sequence boundary).
    """
    F = TensorProto.FLOAT
    i1 = lambda v: b.const([v])  # noqa: E731  1-D int64
    zero_f = b.const(0.0, np.float32)
    one = i1(1)
    # 3. within-chunk inclusive cumsum of delta*A as a MatMul with U[j, i] = (j <= i): the decay from the
    #    chunk start to token i (a sum from the anchor at the chunk start, accurate to its own terms)
    Qs = b.op("Squeeze", Q, b.const([0]))
    r = b.op("Range", b.const(0), Qs, b.const(1))
    r_col, r_row = b.op("Unsqueeze", r, i1(1)), b.op("Unsqueeze", r, i1(0))
    causal = b.op("GreaterOrEqual", r_col, r_row)  # [i, j] = i >= j
    strict = b.op("Greater", r_col, r_row)  # [k, j] = k > j
    upper = b.op("Cast", b.op("LessOrEqual", r_col, r_row), to=F)  # [j, i] = j <= i
    # dt*A floored at DA_FLOOR (NaN kept: Where, not Max): a step whose product overflows float32 to -inf would
    # make the 0/1 masked MatMuls below (cs, and the chunk-level Y) compute -inf * 0 = NaN
    dA = b.op("Mul", dc, A3)  # (b, nc, g, hpg, Q)
    floor = b.const(DA_FLOOR, np.float32)
    dA = b.op("Where", b.op("Less", dA, floor), floor, dA)
    cs = b.op("MatMul", dA, upper)  # cs_i = sum_{j <= i} dA_j

    # 4. segment sums seg[i, j] = sum_{j < k <= i} dA_k from their own terms: dA_k masked to k > j, summed
    #    down i (one CumSum, axis -2, no reverse/exclusive). Not cs_i - cs_j: that difference carries the
    #    fp32 rounding of |cs| (thousands for large dt), ~1e-4 absolute error in every exponent.
    terms = b.op("Where", strict, b.op("Unsqueeze", dA, i1(-1)), zero_f)  # (b, nc, g, hpg, Q(k), Q(j))
    seg = b.op("CumSum", terms, b.const(-2))  # [i, j]; 0 above the diagonal (empty sum), <= 0
    # intra-chunk output: mask before use (exp of the finite seg, kept on j <= i only; no inf*0)
    decay = b.op("Where", causal, b.op("Exp", seg), zero_f)
    CB = b.op("MatMul", Cc, b.op("Transpose", Bc, perm=[0, 1, 2, 3, 5, 4]))  # (b, nc, g, 1, Q, Q)
    xd = b.op("Mul", xc, b.op("Unsqueeze", dc, i1(-1)))  # delta ∘ x: (b, nc, g, hpg, Q, p)
    y_diag = b.op("MatMul", b.op("Mul", CB, decay), xd)  # (b, nc, g, hpg, Q, p)

    # 5. chunk states (zero state at chunk start): the last row of seg is the decay from token j to the chunk end
    Qm1 = b.op("Sub", Q, one)
    to_end = b.op("Squeeze", b.op("Slice", seg, Qm1, Q, i1(-2)), i1(-2))  # (b, nc, g, hpg, Q)
    xw = b.op("Mul", xd, b.op("Unsqueeze", b.op("Exp", to_end), i1(-1)))
    states = b.op("MatMul", b.op("Transpose", xw, perm=[0, 1, 2, 3, 5, 4]), Bc)  # (b, nc, g, hpg, p, n)
    cs_last = b.op("Slice", cs, i1(-1), i1(np.iinfo(np.int64).max), i1(-1))  # (b, nc, g, hpg, 1): chunk totals

    return cs, y_diag, states, cs_last


def _chunked_scan(b: _Body, e: dict[str, str], Q: str, final_out: str | None = None) -> tuple[str, str]:
    """Steps 2-7 appended to ``b`` (``e`` from :func:`_entry`, ``Q`` from :func:`_chunk_len`).

    Returns (y in float32 with the D skip (b, L, h, p), final_state (b, h, p, n)); ``final_out`` names the latter.
    """
    F = TensorProto.FLOAT
    i1 = lambda v: b.const([v])  # noqa: E731  1-D int64
    zero_f = b.const(0.0, np.float32)
    xf, Bf, Cf, Af, Df, h0f, delta = (e[k] for k in ("xf", "Bf", "Cf", "Af", "Df", "h0f", "delta"))
    bsz, L, h, p, g, n, hpg = (e[k] for k in ("bsz", "L", "h", "p", "g", "n", "hpg"))

    # 2. chunking: nc = max(1, ceil(L / Q)), pad = nc*Q - L
    one = i1(1)
    nc = b.op("Max", b.op("Div", b.op("Sub", b.op("Add", L, Q), one), Q), one)
    Lp = b.op("Mul", nc, Q)
    pad = b.op("Sub", Lp, L)
    z1 = i1(0)

    def pad_seq(t, rank):  # pad axis 1 at the end with zeros
        pads = b.op("Concat", *([z1] * rank), *([z1] * 1), pad, *([z1] * (rank - 2)), axis=0)
        return b.op("Pad", t, pads)

    xc = b.op("Transpose", b.op("Reshape", pad_seq(xf, 4), b.op("Concat", bsz, nc, Q, g, hpg, p, axis=0)),
              perm=[0, 1, 3, 4, 2, 5])  # (b, nc, g, hpg, Q, p)
    dc = b.op("Transpose", b.op("Reshape", pad_seq(delta, 3), b.op("Concat", bsz, nc, Q, g, hpg, axis=0)),
              perm=[0, 1, 3, 4, 2])  # (b, nc, g, hpg, Q)

    def chunk_bc(t):  # (b, L, g, n) -> (b, nc, g, 1, Q, n)
        r = b.op("Reshape", pad_seq(t, 4), b.op("Concat", bsz, nc, Q, g, n, axis=0))
        return b.op("Unsqueeze", b.op("Transpose", r, perm=[0, 1, 3, 2, 4]), i1(3))

    Bc, Cc = chunk_bc(Bf), chunk_bc(Cf)
    A3 = b.op("Reshape", Af, b.op("Concat", g, hpg, one, axis=0))  # (g, hpg, 1)
    cs, y_diag, states, cs_last = _within_chunks(b, xc, dc, Bc, Cc, A3, Q)

    # 6. state passing over chunks in closed form; index m = 0 is the initial state, m = c + 1 chunk c
    T = b.op("Transpose", b.op("Squeeze", cs_last, i1(-1)), perm=[0, 2, 3, 1])  # (b, g, hpg, nc)
    ncs = b.op("Squeeze", nc, b.const([0]))
    kk = b.op("Range", b.const(0), ncs, b.const(1))  # k = 0..nc-1
    mm = b.op("Range", b.const(0), b.op("Add", ncs, b.const(1)), b.const(1))  # c, m = 0..nc
    nc1 = b.op("Add", nc, one)
    # seg_c[c, m] = sum_{m <= k < c} T_k as two O(nc^2) factors (no (nc+1)^2 x nc selector: memory):
    # Y[k, m] = T_k [m <= k], then seg_c = Lstrict @ Y with Lstrict[c, k] = [k < c]; a masked sum, not
    # a difference of long cumulative sums, so no cancellation on long sequences.
    k_col, m_row = b.op("Unsqueeze", kk, i1(1)), b.op("Unsqueeze", mm, i1(0))
    Y = b.op("Mul", b.op("Unsqueeze", T, i1(-1)), b.op("Cast", b.op("LessOrEqual", m_row, k_col), to=F))
    lstrict = b.op("Cast", b.op("Less", b.op("Unsqueeze", kk, i1(0)), b.op("Unsqueeze", mm, i1(1))), to=F)
    seg_c = b.op("MatMul", lstrict, Y)  # (b, g, hpg, nc+1, nc+1): [c, m] = sum_{m<=k<c} T_k
    lower_c = b.op("LessOrEqual", b.op("Unsqueeze", mm, i1(0)), b.op("Unsqueeze", mm, i1(1)))  # [c, m]: m <= c
    Wc = b.op("Where", lower_c, b.op("Exp", b.op("Min", seg_c, zero_f)), zero_f)  # (b, g, hpg, nc+1, nc+1)
    pn = b.op("Mul", p, n)
    st = b.op("Reshape", b.op("Transpose", states, perm=[0, 2, 3, 1, 4, 5]),
              b.op("Concat", bsz, g, hpg, nc, pn, axis=0))  # (b, g, hpg, nc, p*n)
    s0 = b.op("Reshape", h0f, b.op("Concat", bsz, g, hpg, one, pn, axis=0))  # (b, g, hpg, 1, p*n)
    S = b.op("MatMul", Wc, b.op("Concat", s0, st, axis=3))  # (b, g, hpg, nc+1, p*n): state entering chunk c
    final = final_out or f"_{b._prefix}final_state"
    b.nodes.append(helper.make_node("Reshape", [b.op("Slice", S, nc, nc1, b.const([3])),
                                                b.op("Concat", bsz, h, p, n, axis=0)], [final]))
    prev = b.op("Reshape", b.op("Slice", S, b.const([0]), nc, b.const([3])),
                b.op("Concat", bsz, g, hpg, nc, p, n, axis=0))
    prev = b.op("Transpose", prev, perm=[0, 3, 1, 2, 5, 4])  # (b, nc, g, hpg, n, p)

    # 7. inter-chunk output, skip term (the caller casts back to the dtype of x)
    y_off = b.op("Mul", b.op("MatMul", Cc, prev), b.op("Unsqueeze", b.op("Exp", cs), i1(-1)))
    yc = b.op("Add", y_diag, y_off)  # (b, nc, g, hpg, Q, p)
    yl = b.op("Reshape", b.op("Transpose", yc, perm=[0, 1, 4, 2, 3, 5]), b.op("Concat", bsz, Lp, h, p, axis=0))
    yl = b.op("Slice", yl, b.const([0]), L, i1(1))
    return b.op("Add", yl, b.op("Mul", xf, b.op("Unsqueeze", Df, i1(1)))), final


@dataclass(frozen=True)
class ChunkedBodySizes:
    """Bytes of the largest float32 tensors the SSMScan body's chunked branch (:func:`_chunked_scan`, seqlen > 1)
    allocates for one problem, from the body's own chunking: ``Q = max(1, min(chunk_size, seqlen))``
    (:func:`_chunk_len`), ``nc = ceil(seqlen / Q)`` chunks, ``seqlen`` padded to ``nc * Q``.

    decay: one (batch, nheads, nc + 1, nc + 1) matrix of step 6 (segment sums over chunks, their exp, the masked
        weights; the (b, h, nc, nc + 1) factor Y is as large).
    intra: one (batch, nc, nheads, Q, Q) tensor of step 4 (within-chunk segment sums, their exp, the mask, C Bᵀ ∘ it).
    states: the (batch, nheads, nc + 1, headdim * d_state) states entering each chunk (step 6's MatMul output, and
        its input: the initial state and the chunk states).
    tokens: one per-token tensor (batch, nc * Q, nheads, headdim) (x, delta ∘ x, y).
    """

    decay: int
    intra: int
    states: int
    tokens: int

    @classmethod
    def of(cls, batch: int, seqlen: int, nheads: int, headdim: int, d_state: int, chunk_size: int
           ) -> "ChunkedBodySizes":
        q = max(1, min(chunk_size, seqlen))
        nc = max(1, -(-seqlen // q))
        f = 4 * batch * nheads
        return cls(decay=f * (nc + 1) ** 2, intra=f * nc * q * q, states=f * (nc + 1) * headdim * d_state,
                   tokens=f * nc * q * headdim)

    @property
    def peak(self) -> int:
        """What the body holds at once at its fullest (ONNX Runtime frees a tensor after its last use): step 4-5's
        segment sums (kept for the chunk states), a masked exp and a product, or step 6's two decay matrices next
        to the chunk states, or one decay matrix next to the states' input and output; with two per-token tensors
        (the intra-chunk output, x) alive throughout."""
        return 2 * self.tokens + max(3 * self.intra, 2 * self.decay + self.states, self.decay + 2 * self.states)


#: default-domain opset of the native flavour's graphs (onnx 1.23's newest; RMSNormalization needs >= 23)
NATIVE_OPSET = 27
#: domain of ONNX Runtime's contrib kernels; the native flavour's LinearAttention and CausalConvWithState live
#: there: ORT 1.32 has no CPU kernel for the opset-27 default-domain ops of the same names and runs their ONNX
#: function bodies instead (a Scan over tokens, a Conv), 1.5-6x slower (benchmarks/RESULTS.md)
ORT_DOMAIN = "com.microsoft"
#: the native flavour's opset imports
NATIVE_OPSETS = {"": NATIVE_OPSET, ORT_DOMAIN: 1}


@dataclass(frozen=True)
class NativeScanShape:
    """The static sizes a native-flavour SSMScan body is built for (one model's mixers).

    LinearAttention takes the head count as an attribute; the other sizes make every reshape of the body a
    constant (no Shape/Concat arithmetic at run time). Batch and sequence length stay dynamic.
    """

    nheads: int
    headdim: int
    ngroups: int
    d_state: int

    def __post_init__(self):
        if min(self.nheads, self.headdim, self.ngroups, self.d_state) < 1 or self.nheads % self.ngroups:
            raise ValueError(f"NativeScanShape: expected positive sizes with nheads % ngroups == 0, got {self}")


#: the native bodies' state layout, as positions of the contract's (batch, nheads, headdim, d_state) axes:
#: (batch, nheads, d_state, headdim), ORT LinearAttention's (b, h, d_k, d_v) with d_k = d_state, d_v = headdim
#: (the native flavour's graph I/O, :data:`m2export.exporter.configs.STATE_LAYOUTS`)
NATIVE_STATE_PERM = (0, 1, 3, 2)


def _build_native_body(attrs: SSMScanAttrs, shape: NativeScanShape, x_dtype: int = TensorProto.FLOAT
                       ) -> tuple[list[onnx.NodeProto], Sequence[str], Sequence[str]]:
    """The native flavour's SSMScan body for one attribute set, one model's sizes and the dtype of ``x``; its
    ``initial_state`` and ``final_state`` are (batch, nheads, d_state, headdim) (:data:`NATIVE_STATE_PERM`),
    ``y`` is flat, (batch, seqlen, nheads * headdim) (LinearAttention's own output plus the D skip: the caller
    reshapes it, :func:`~m2export.exporter.native_ort.to_native_ort`), the other inputs as the contract says.

    ``delta = clip(Softplus(dt + dt_bias), dt_min, dt_max)`` (ORT's fp32 Softplus is accurate to 7e-8 relative
    over the whole range, large inputs included; the clip only where the limits bind), then one
    ``com.microsoft::LinearAttention`` (``update_rule="gated"``: q = C per group (inverse GQA, q_num_heads = ngroups), k = B copied from groups to heads,
    v = delta ∘ x, decay = delta · A per head, scale 1) on the state in its own (b, h, d_k = d_state,
    d_v = headdim) layout: no transpose, and its output q·S is y itself, for one token (decode: a token of the
    recurrence, no chunk machinery) as for a prefill. ORT 1.32's CPU LinearAttention is a token-by-token
    recurrence and, on a 130m-shaped layer, as fast as the chunked SSD body from 2 to 512 tokens or faster
    (benchmarks/RESULTS.md); it forms no segment sums (one decay per token), so it is exact to fp32 rounding
    for any dt·A. The D skip is added on the flat output (``x`` reshaped flat, which undoes the caller's reshape
    of the flat activations, times D repeated per headdim, a constant). Every step in float32 (Casts only for
    fp16 ``x``).
    """
    F = TensorProto.FLOAT
    b = _Body()
    h, p, g, n = shape.nheads, shape.headdim, shape.ngroups, shape.d_state
    hpg = h // g
    x, dt, A, B, C, D, dt_bias, h0 = contract.INPUT_NAMES
    f32 = (lambda t: t) if x_dtype == F else (lambda t: b.op("Cast", t, to=F))  # noqa: E731
    xf, dtf, Bf, Cf = (f32(t) for t in (x, dt, B, C))
    shp = lambda *dims: b.const(list(dims))  # noqa: E731  constant shape (0: copy the input's dim, -1: infer)

    v = b.op("Add", dtf, dt_bias)
    delta = b.op("Softplus", v) if attrs.dt_softplus else v  # (b, L, h)
    # clamp as the contract says (always at dt_min >= 0); Softplus is >= 0 already, inf bounds nothing
    lo = attrs.dt_min if (attrs.dt_min > 0 or not attrs.dt_softplus) else None
    hi = attrs.dt_max if math.isfinite(attrs.dt_max) else None
    if lo is not None or hi is not None:
        delta = b.op("Clip", delta, "" if lo is None else b.const(lo, np.float32),
                     "" if hi is None else b.const(hi, np.float32))
    dA = b.op("Mul", delta, A)  # (b, L, h) log-decay, <= 0
    xd = b.op("Mul", xf, b.op("Unsqueeze", delta, b.const([-1])))  # delta ∘ x  (b, L, h, p)
    d_rep = b.op("Reshape", b.op("Expand", b.op("Unsqueeze", D, b.const([1])), shp(h, p)), shp(h * p))  # (h*p,)
    skip = b.op("Mul", f32(b.op("Reshape", x, shp(0, 0, h * p))), d_rep)  # D x  (b, L, h*p)

    def heads_flat(t):  # (b, L, g, n) -> (b, L, h*n), head h reading group h // hpg: copies of each group's row
        if hpg == 1:
            return b.op("Reshape", t, shp(0, 0, h * n))
        if g == 1:  # (b, L, n) tiled h times (the caller's reshape to (b, L, 1, n) and this one cancel)
            return b.op("Tile", b.op("Reshape", t, shp(0, 0, n)), shp(1, 1, h))
        return b.op("Reshape", b.op("Tile", t, shp(1, 1, 1, hpg)), shp(0, 0, h * n))  # (b, L, g, hpg*n)

    # q = C per group (inverse GQA: LinearAttention's kv head j reads query head j // (h / g), which is Mamba-2's
    # head -> group map, so C is never expanded to heads); k = B per head (the state's heads), v = delta ∘ x
    o, final = b.op("LinearAttention", b.op("Reshape", Cf, shp(0, 0, g * n)), heads_flat(Bf),
                    b.op("Reshape", xd, shp(0, 0, h * p)), h0, dA,
                    outputs=2, domain=ORT_DOMAIN, update_rule="gated", q_num_heads=g, kv_num_heads=h, scale=1.0)
    y = b.op("Add", o, skip)  # (b, L, h*p)
    if x_dtype == F:
        b.nodes.append(helper.make_node("Identity", [y], [contract.OUTPUT_NAMES[0]]))
    else:
        b.nodes.append(helper.make_node("Cast", [y], [contract.OUTPUT_NAMES[0]], to=x_dtype))
    b.nodes.append(helper.make_node("Identity", [final], [contract.OUTPUT_NAMES[1]]))
    return b.nodes, contract.INPUT_NAMES, contract.OUTPUT_NAMES


def native_function_name(k: int) -> str:
    """Name (in the m2export domain) of the native body for a model's ``k``-th distinct attribute set."""
    return f"{contract.OP_NAME}Native{k}"


def native_ssm_scan_function(attrs: SSMScanAttrs, shape: NativeScanShape, x_dtype: int, name: str
                             ) -> onnx.FunctionProto:
    """The native body (:func:`_build_native_body`) as model-local function ``m2export::<name>``: no attributes
    (they are baked in), opsets :data:`NATIVE_OPSETS`, the states in the native layout (:data:`NATIVE_STATE_PERM`).
    ``x_dtype``: ONNX element type of ``x`` (float or float16).
    """
    nodes, inputs, outputs = _build_native_body(attrs, shape, x_dtype)
    return helper.make_function(contract.OP_DOMAIN, name, list(inputs), list(outputs), nodes,
                                [helper.make_opsetid(d, v) for d, v in NATIVE_OPSETS.items()],
                                doc_string=f"m2export::SSMScan v1, native flavour (states (batch, nheads, d_state, "
                                           f"headdim)), {attrs}, {shape}")


def _attribute_defaults() -> list[onnx.AttributeProto]:
    """The function's declared attributes: the contract's with their defaults, then the plugin-selecting ones."""
    defaults = [helper.make_attribute(a.name, a.default if a.type != "int" else int(a.default))
                for a in contract.ATTRIBUTES]
    return defaults + [helper.make_attribute(k, v) for k, v in PLUGIN_ATTRIBUTES.items()]


def ssm_scan_function_proto(opset: int = 18) -> onnx.FunctionProto:
    """Model-local function ``m2export::SSMScan``: the reference semantics in standard ONNX ops (opset ``opset``).

    Attributes (with defaults from the contract) are referenced in the body, so nodes with different
    attribute values share this one function. ``plugin_namespace``/``plugin_version`` are declared (and
    unused) so the calling node's attributes all match declared ones. (The native flavour's bodies are
    :func:`native_ssm_scan_function`, one per attribute set.)
    """
    nodes, inputs, outputs = _build_body()
    fn = helper.make_function(contract.OP_DOMAIN, contract.OP_NAME, list(inputs), list(outputs), nodes,
                              [helper.make_opsetid("", opset)], attribute_protos=_attribute_defaults(),
                              doc_string="m2export::SSMScan v1 reference semantics (chunked SSD, fp32 internals); "
                                         "see m2export/contract.py")
    return fn


def _build_packed_body() -> tuple[list[onnx.NodeProto], Sequence[str], Sequence[str]]:
    """The body of ``m2export::SSMScanPacked`` (contract: :data:`m2export.contract.PACKED_INPUTS`) in standard ops,
    no Loop/Scan: the chunked SSD of :func:`_chunked_scan` over *sequence-local* chunks.

    Each sequence s (tokens ``[cu_seqlens[s], cu_seqlens[s+1])`` of batch row 0, ``len_s`` of them) is cut into
    ``n_s = ceil(len_s / Q)`` chunks from its own first token, its last chunk padded with ``delta = 0`` steps (no
    decay, no input). ``Q`` (:func:`_packed_chunk_len`; evaluation order only) is the SSMScan body's chunk length
    ``max(1, min(chunk_size, total))`` unless that pads the pack by more than 1/8 of its tokens (many sequences
    shorter than a chunk), then the largest of its halvings (down to 16) that does not. All ``NL = sum n_s``
    chunks of the pack are laid side by side (one Gather from the tokens, computed once from ``cu_seqlens``) and
    run as one batch through steps 3-5 (:func:`_within_chunks`): no chunk straddles a boundary, so no masking
    inside a chunk is needed and nothing leaks. State passing (step 6) is the closed form over the chunks of each
    sequence, from the sources ``[h0 of every sequence; Z of every chunk]`` (``Z_m`` chunk m's zero-entry state,
    ``T_k`` chunk k's total log-decay): the state of sequence s before chunk e is
    ``sum_{m < e, seq(m) = s} exp(sum_{m < k < e} T_k) Z_m + exp(sum_{k < e, seq(k) = s} T_k) h0_s``, every
    exponent a masked sum of chunk totals (<= 0), masked before exp; one MatMul gives it before every chunk (the
    state step 7 reads) and after each sequence's last chunk (``final_state``; ``h0_s``, bit for bit, for an empty
    sequence), split at once. Step 7 as in the SSMScan body; ``y`` is gathered back from the chunks to the packed token order.

    Cost: the single-sequence body's on ``NL * Q`` steps (the padding of each sequence's last chunk is the only
    extra work, at most 1/8 of the tokens where a halving of Q gets there) plus ((NL + nseq) x (nseq + NL))
    state-passing MatMuls. Offsets that break the contract (not from 0, decreasing, last != seqlen) give NaN in
    every element of both outputs (indices are clamped so that the body
    still runs); hosts refuse them first with :func:`m2export.contract.check_cu_seqlens`.
    """
    F, I64 = TensorProto.FLOAT, TensorProto.INT64
    cu = contract.PACKED_INPUT_NAMES[-1]
    b = _Body()
    e = _entry(b)
    Q = _chunk_len(b, e["L"])
    i1 = lambda v: b.const([v])  # noqa: E731  1-D int64
    zero_i, one_i, big = b.const(0), b.const(1), i1(np.iinfo(np.int64).max)
    zero_f = b.const(0.0, np.float32)
    xf, Bf, Cf, Af, Df, h0f, delta = (e[k] for k in ("xf", "Bf", "Cf", "Af", "Df", "h0f", "delta"))
    L, h, p, g, n, hpg = (e[k] for k in ("L", "h", "p", "g", "n", "hpg"))
    one = i1(1)
    sq = lambda t: b.op("Squeeze", t, i1(0))  # noqa: E731  (1,) -> scalar
    col = lambda t: b.op("Unsqueeze", t, i1(1))  # noqa: E731
    row = lambda t: b.op("Unsqueeze", t, i1(0))  # noqa: E731

    # offsets (int64) and their validity (from 0, non-decreasing, last = seqlen): a (1,) bool for the NaN poison
    cu64 = b.op("Cast", cu, to=I64)
    starts, ends = b.op("Slice", cu64, i1(0), i1(-1)), b.op("Slice", cu64, one, big)  # (nseq,)
    lens = b.op("Sub", ends, starts)
    drops = b.op("ReduceSum", b.op("Cast", b.op("Less", lens, zero_i), to=I64), keepdims=1)  # (1,) [] -> 0
    valid = b.op("And", b.op("And", b.op("Equal", b.op("Slice", cu64, i1(0), one), i1(0)),
                              b.op("Equal", b.op("Slice", cu64, i1(-1), big), L)),
                 b.op("Equal", b.op("Reshape", drops, one), i1(0)))  # (1,)
    nan = b.const(np.nan, np.float32)
    lens = b.op("Max", lens, zero_i)
    starts = b.op("Min", b.op("Max", starts, zero_i), L)

    Q = _packed_chunk_len(b, Q, lens, L)
    # sequence-local chunks: n_s = ceil(len_s / Q), chunk ids co_s .. co_s + n_s - 1 (co: exclusive running sum)
    n_s = b.op("Div", b.op("Sub", b.op("Add", lens, Q), one), Q)
    si = b.op("Range", zero_i, b.op("Size", n_s), one_i)  # sequence ids
    upto = b.op("Cast", b.op("LessOrEqual", row(si), col(si)), to=I64)  # [s, s'] = s' <= s (no CumSum: one axis)
    co_end = b.op("ReduceSum", b.op("Mul", upto, row(n_s)), i1(1), keepdims=0)  # (nseq,) one past its last chunk
    co = b.op("Sub", co_end, n_s)
    NL = b.op("Reshape", b.op("ReduceSum", n_s, keepdims=1), one)  # (1,); 0 when every sequence is empty
    lch = b.op("Range", zero_i, sq(NL), one_i)  # chunk ids 0..NL-1
    # sequence of each chunk: how many sequences' chunks end at or before it (empty ones end where they start)
    s_l = b.op("ReduceSum", b.op("Cast", b.op("GreaterOrEqual", col(lch), row(co_end)), to=I64), i1(1), keepdims=0)
    # token held by step q of chunk l: start + (l - co) * Q + q. Steps past the sequence's end (its last chunk's
    # padding) get delta = 0 (no decay, no input) and the x, B, C of the sequence's own last token (so nothing of
    # another sequence is read): they come after every real step of their chunk, so the causal mask keeps them
    # out of real rows' y, and their delta ∘ x = 0 keeps them out of the state
    pos = b.op("Add", col(b.op("Mul", b.op("Sub", lch, b.op("Gather", co, s_l, axis=0)), Q)),
               row(b.op("Range", zero_i, sq(Q), one_i)))  # (NL, Q)
    len_l = col(b.op("Gather", lens, s_l, axis=0))
    real = b.op("Less", pos, len_l)  # (NL, Q)
    tok = b.op("Add", b.op("Min", pos, b.op("Sub", len_l, one_i)), col(b.op("Gather", starts, s_l, axis=0)))
    tok = b.op("Min", tok, b.op("Sub", L, one))  # in range also for offsets past seqlen (then poisoned)

    def chunked(t):  # (1, L, ...) float32 -> (NL, Q, ...)
        return b.op("Gather", b.op("Squeeze", t, i1(0)), tok, axis=0)

    NLQ = lambda *dims: b.op("Concat", one, NL, Q, *dims, axis=0)  # noqa: E731  (1, NL, Q, ...)
    xc = b.op("Transpose", b.op("Reshape", chunked(xf), NLQ(g, hpg, p)), perm=[0, 1, 3, 4, 2, 5])
    d_steps = b.op("Where", b.op("Unsqueeze", real, i1(-1)), chunked(delta), zero_f)  # (NL, Q, h)
    dc = b.op("Transpose", b.op("Reshape", d_steps, NLQ(g, hpg)), perm=[0, 1, 3, 4, 2])

    def chunk_bc(t):  # (1, L, g, n) -> (1, NL, g, 1, Q, n)
        r = b.op("Reshape", chunked(t), NLQ(g, n))
        return b.op("Unsqueeze", b.op("Transpose", r, perm=[0, 1, 3, 2, 4]), i1(3))

    Bc, Cc = chunk_bc(Bf), chunk_bc(Cf)
    A3 = b.op("Reshape", Af, b.op("Concat", g, hpg, one, axis=0))  # (g, hpg, 1)
    cs, y_diag, states, cs_last = _within_chunks(b, xc, dc, Bc, Cc, A3, Q)  # batch 1, NL chunks

    # 6. state passing in closed form over each sequence's chunks, from the sources [h0 of every sequence; Z of every
    #    chunk] (see the docstring): one MatMul for the states entering the chunks, one for the final states
    T = b.op("Transpose", b.op("Squeeze", cs_last, i1(-1)), perm=[0, 2, 3, 1])  # (1, g, hpg, NL) chunk totals
    T_col = b.op("Unsqueeze", T, i1(-1))  # (1, g, hpg, NL, 1)
    Y = b.op("Mul", T_col, b.op("Cast", b.op("Greater", col(lch), row(lch)), to=F))  # [k, m] = T_k [k > m]

    def weights(e, q, poison: bool = False):
        """Weights (1, g, hpg, R, nseq + NL) of the sources for R rows, row r the state of sequence q_r before chunk
        e_r: sum_{m < e_r, seq(m) = q_r} exp(sum_{m < k < e_r} T_k) Z_m + exp(sum_{k < e_r, seq(k) = q_r} T_k) h0_q.
        Every exponent a masked sum of chunk totals (<= 0), masked before exp. ``poison``: the h0 weights NaN for
        offsets that break the contract (the MatMul carries NaN to every element of its rows)."""
        before = b.op("Less", row(lch), col(e))  # [r, k]: k < e_r
        mine = b.op("And", before, b.op("Equal", col(q), row(s_l)))  # [r, m]: m < e_r, seq(m) = q_r
        seg = b.op("MatMul", b.op("Cast", before, to=F), Y)  # [r, m] = sum_{m < k < e_r} T_k
        wz = b.op("Where", mine, b.op("Exp", b.op("Min", seg, zero_f)), zero_f)
        wh = b.op("Exp", b.op("Min", b.op("MatMul", b.op("Cast", mine, to=F), T_col), zero_f))  # (1, g, hpg, R, 1)
        onehot = b.op("Cast", b.op("Equal", col(q), row(si)), to=F)  # [r, s]: s = q_r
        if poison:
            wh = b.op("Where", valid, wh, nan)
        return b.op("Concat", b.op("Mul", wh, onehot), wz, axis=-1)

    pn = b.op("Mul", p, n)
    nseq = b.op("Shape", h0f, start=0, end=1)
    h0g = b.op("Reshape", h0f, b.op("Concat", nseq, g, hpg, pn, axis=0))  # (nseq, g, hpg, p*n)
    Z = b.op("Reshape", b.op("Transpose", states, perm=[0, 2, 3, 1, 4, 5]),
             b.op("Concat", one, g, hpg, NL, pn, axis=0))  # (1, g, hpg, NL, p*n)
    src = b.op("Concat", b.op("Unsqueeze", b.op("Transpose", h0g, perm=[1, 2, 0, 3]), i1(0)), Z, axis=3)
    # one MatMul for both row sets, split at once: E (1, g, hpg, NL, p*n), the state entering chunk l, and the
    # final_state rows (1, g, hpg, nseq, p*n), the state after sequence s's last chunk (before chunk co_end[s]).
    # Two MatMuls on src would leave it (nseq + NL rows of p*n) alive until the final_state branch runs, which
    # ONNX Runtime's default order puts after the logits: every layer's src at once (24 x 26 MB on a 130m pack of
    # 774 tokens, Q 32); the one Split frees it when E is taken
    E, fin = b.op("Split", b.op("MatMul", b.op("Concat", weights(lch, s_l), weights(co_end, si, poison=True), axis=3),
                                src), b.op("Concat", NL, nseq, axis=0), axis=3, outputs=2)
    # an empty sequence keeps h0, bit for bit (below)
    fin = b.op("Transpose", b.op("Squeeze", fin, i1(0)), perm=[2, 0, 1, 3])
    keep = b.op("And", b.op("Equal", n_s, zero_i), valid)  # an empty sequence of valid offsets: h0 itself
    fin = b.op("Where", b.op("Reshape", keep, b.const([-1, 1, 1, 1])), h0g, fin)

    # 7. inter-chunk output, back to the packed token order, skip term
    prev = b.op("Transpose", b.op("Reshape", E, b.op("Concat", one, g, hpg, NL, p, n, axis=0)),
                perm=[0, 3, 1, 2, 5, 4])  # (1, NL, g, hpg, n, p)
    y_off = b.op("Mul", b.op("MatMul", Cc, prev), b.op("Unsqueeze", b.op("Exp", cs), i1(-1)))
    yc = b.op("Transpose", b.op("Add", y_diag, y_off), perm=[0, 1, 4, 2, 3, 5])  # (1, NL, Q, g, hpg, p)
    y_rows = b.op("Reshape", yc, b.op("Concat", b.op("Mul", NL, Q), h, p, axis=0))
    # chunk step of packed token t: co[seq(t)] * Q + (t - start[seq(t)]) (clamped into the padded rows)
    t = b.op("Range", zero_i, sq(L), one_i)
    seq_t = b.op("ReduceSum", b.op("Cast", b.op("GreaterOrEqual", col(t), row(ends)), to=I64), i1(1), keepdims=0)
    seq_t = b.op("Min", seq_t, b.op("Sub", b.op("Max", b.op("Size", starts), one_i), one_i))  # < nseq
    slot = b.op("Add", b.op("Mul", b.op("Gather", co, seq_t, axis=0), sq(Q)),
                b.op("Sub", t, b.op("Gather", starts, seq_t, axis=0)))
    slot = b.op("Min", b.op("Max", slot, zero_i), b.op("Sub", b.op("Mul", sq(NL), sq(Q)), one_i))
    y = b.op("Unsqueeze", b.op("Gather", y_rows, slot, axis=0), i1(0))  # (1, L, h, p)
    # the NaN poison of invalid offsets rides on the (nheads,) skip weight: D x carries it to every y element
    y = b.op("Add", y, b.op("Mul", xf, b.op("Unsqueeze", b.op("Where", valid, Df, nan), one)))
    b.nodes.append(helper.make_node("CastLike", [y, contract.INPUT_NAMES[0]], [contract.PACKED_OUTPUT_NAMES[0]]))
    b.nodes.append(helper.make_node("Reshape", [fin, b.op("Shape", h0f)], [contract.PACKED_OUTPUT_NAMES[1]]))
    for node in b.nodes:  # NL, nseq and seqlen may be 0 (no sequences, all empty): a 0 in a shape is a 0
        if node.op_type == "Reshape":
            node.attribute.append(helper.make_attribute("allowzero", 1))
    return b.nodes, contract.PACKED_INPUT_NAMES, contract.PACKED_OUTPUT_NAMES


#: chunk-length halvings the packed body may take (Q, Q/2, .. Q/16, never below 16) and the padding it accepts
PACKED_CHUNK_HALVINGS, PACKED_MIN_CHUNK, PACKED_MAX_PAD = 4, 16, 1 / 8


def _packed_chunk_len(b: _Body, Q: str, lens: str, L: str) -> str:
    """The packed body's chunk length (1-D int64): the first of ``Q, Q/2, .., Q/2^PACKED_CHUNK_HALVINGS`` (each at
    least ``min(Q, PACKED_MIN_CHUNK)``) whose sequence-local chunks pad the pack to at most ``(1 + PACKED_MAX_PAD)``
    times its ``L`` tokens, else the last one. A pack of sequences shorter than Q pads each to a whole chunk (16 of
    32 tokens with Q = 64: twice the work); halving Q removes that padding without making every chunk small."""
    k = np.arange(PACKED_CHUNK_HALVINGS + 1, dtype=np.int64)
    cands = b.op("Max", b.op("Div", Q, b.const(2 ** k)), b.op("Min", Q, b.const([PACKED_MIN_CHUNK])))  # (K,)
    cand_col = b.op("Unsqueeze", cands, b.const([1]))  # (K, 1)
    n = b.op("Div", b.op("Sub", b.op("Add", b.op("Unsqueeze", lens, b.const([0])), cand_col), b.const(1)), cand_col)
    slots = b.op("Mul", b.op("ReduceSum", n, b.const([1]), keepdims=0), cands)  # (K,) padded steps per candidate
    den = round(1 / PACKED_MAX_PAD)
    ok = b.op("LessOrEqual", b.op("Mul", slots, b.const(den)), b.op("Mul", L, b.const(den + 1)))
    key = b.op("Where", ok, b.const(k), b.const(len(k) - 1))  # first acceptable candidate, else the last
    return b.op("Reshape", b.op("Gather", cands, b.op("ReduceMin", key, keepdims=1), axis=0), b.const([1]))


def ssm_scan_packed_function_proto(opset: int = 18) -> onnx.FunctionProto:
    """Model-local function ``m2export::SSMScanPacked`` (:func:`_build_packed_body`: standard ops of the default
    domain only, no Loop and no call of ``m2export::SSMScan``)."""
    nodes, inputs, outputs = _build_packed_body()
    return helper.make_function(contract.OP_DOMAIN, contract.PACKED_OP_NAME, list(inputs), list(outputs), nodes,
                                [helper.make_opsetid("", opset)], attribute_protos=_attribute_defaults(),
                                doc_string="m2export::SSMScanPacked v1: SSMScan of each sequence of a packed batch "
                                           "(cu_seqlens), chunked over sequence-local chunks; see m2export/contract.py")


def _elem_type(dtype: str) -> int:
    """ONNX element type of a dtype name of the graph I/O (:class:`~m2export.exporter.configs.TensorIO`)."""
    return {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16,
            "int64": TensorProto.INT64, "int32": TensorProto.INT32}[dtype]


def ssm_scan_packed_node_model(attrs: SSMScanAttrs, dtype: str = "float32", opset: int = 18,
                               inline: bool = False) -> onnx.ModelProto:
    """A model of one ``m2export::SSMScanPacked`` node on graph inputs named as the contract's packed inputs.

    For testing the packed body (and, with ``inline``, its plugin-free form) against the packed oracle.
    """
    elem = _elem_type(dtype)
    ins = [helper.make_tensor_value_info(s.name, elem if s.dtype == "x" else
                                         helper.np_dtype_to_tensor_dtype(np.dtype(s.dtype)), list(s.dims))
           for s in contract.PACKED_INPUTS]
    outs = [helper.make_tensor_value_info(s.name, elem if s.dtype == "x" else TensorProto.FLOAT, list(s.dims))
            for s in contract.PACKED_OUTPUTS]
    node = helper.make_node(contract.PACKED_OP_NAME, list(contract.PACKED_INPUT_NAMES),
                            list(contract.PACKED_OUTPUT_NAMES), name="ssm_scan_packed", domain=contract.OP_DOMAIN,
                            **attrs.onnx_attributes(), **PLUGIN_ATTRIBUTES)
    model = helper.make_model(helper.make_graph([node], "ssm_scan_packed", ins, outs),
                              opset_imports=[helper.make_opsetid("", opset),
                                             helper.make_opsetid(contract.OP_DOMAIN, contract.OP_VERSION)],
                              functions=[ssm_scan_function_proto(opset), ssm_scan_packed_function_proto(opset)])
    model.ir_version = 10
    return inline_ssm_scan(model) if inline else model


def ssm_scan_node_model(attrs_per_node: Sequence[SSMScanAttrs], dtype: str = "float32", opset: int = 18,
                        inline: bool = False, native: NativeScanShape | None = None) -> onnx.ModelProto:
    """A model of independent SSMScan nodes (one per entry of ``attrs_per_node``) sharing the graph inputs.

    Inputs: the contract's names (symbolic dims); outputs ``y.{k}``, ``final_state.{k}`` per node.
    For testing the function body, and the sharing of one function by nodes with different attributes.
    ``inline`` returns the plugin-free (function-inlined) form. ``native``: the native flavour's bodies for
    problems of that shape instead (one function per distinct attribute set, opsets :data:`NATIVE_OPSETS`), whose
    ``initial_state`` and ``final_state.{k}`` are (batch, nheads, d_state, headdim) (:data:`NATIVE_STATE_PERM`)
    and ``y.{k}`` is flat (batch, seqlen, nheads * headdim).
    """
    elem = _elem_type(dtype)

    def dims(spec):
        d = list(spec.dims)
        if native is not None and spec.name == "y":  # the native body's y is flat
            return [d[0], d[1], native.nheads * native.headdim]
        return d if native is None or spec.name not in ("initial_state", "final_state") else \
            [d[i] for i in NATIVE_STATE_PERM]

    ins = [helper.make_tensor_value_info(s.name, elem if s.dtype == "x" else TensorProto.FLOAT, dims(s))
           for s in contract.INPUTS]
    nodes, outs, native_fns = [], [], {}
    for k, a in enumerate(attrs_per_node):
        names = [f"{o}.{k}" for o in contract.OUTPUT_NAMES]
        if native is None:
            nodes.append(helper.make_node(contract.OP_NAME, list(contract.INPUT_NAMES), names, name=f"ssm_scan.{k}",
                                          domain=contract.OP_DOMAIN, **a.onnx_attributes(), **PLUGIN_ATTRIBUTES))
        else:
            fname = native_fns.setdefault(a, native_function_name(len(native_fns)))
            nodes.append(helper.make_node(fname, list(contract.INPUT_NAMES), names, name=f"ssm_scan.{k}",
                                          domain=contract.OP_DOMAIN))
        outs += [helper.make_tensor_value_info(names[0], elem, dims(contract.OUTPUTS[0])),
                 helper.make_tensor_value_info(names[1], TensorProto.FLOAT, dims(contract.OUTPUTS[1]))]
    graph = helper.make_graph(nodes, "ssm_scan_nodes", ins, outs)
    if native is None:
        opsets, functions = {"": opset}, [ssm_scan_function_proto(opset)]
    else:
        opsets = dict(NATIVE_OPSETS)
        functions = [native_ssm_scan_function(a, native, elem, name) for a, name in native_fns.items()]
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()]
                              + [helper.make_opsetid(contract.OP_DOMAIN, contract.OP_VERSION)], functions=functions)
    model.ir_version = 10 if native is None and opset < NATIVE_OPSET else 11
    if inline:
        model = inline_ssm_scan(model)
    return model


def inline_ssm_scan(model: onnx.ModelProto) -> onnx.ModelProto:
    """The plugin-free form: every SSMScan call replaced by its body; the m2export domain removed."""
    import onnx.inliner

    out = onnx.inliner.inline_local_functions(model)
    keep = [o for o in out.opset_import if o.domain != contract.OP_DOMAIN]
    del out.opset_import[:]
    out.opset_import.extend(keep)
    return out
