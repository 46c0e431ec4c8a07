"""Pattern-matching helpers over onnx_ir graphs, shared by the graph rewrites (:mod:`m2export.exporter.fused_ops`,
:mod:`m2export.exporter.native_ort`). Each takes values/nodes that may be None and returns None on no match."""

from __future__ import annotations


def producer(value, op_type: str):
    """The default-domain ``op_type`` node producing ``value``, else None."""
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == op_type and node.domain == "" else None


def perm(node) -> list[int] | None:
    """A Transpose node's ``perm`` attribute, else None."""
    a = node.attributes.get("perm") if node is not None else None
    return list(a.value) if a is not None else None


def const_array(value):
    """The numpy value of a constant (initializer or Constant node), else None."""
    import onnx_ir as ir

    t = ir.convenience.get_const_tensor(value) if value is not None else None
    return None if t is None else t.numpy()


def scalar(value) -> float | None:
    """The value of a one-element constant (initializer or Constant node), else None."""
    a = const_array(value)
    return float(a.reshape(-1)[0]) if a is not None and a.size == 1 else None


def rms_core(mul, *, single_use: bool = False):
    """``(x, eps, chain)`` if ``mul`` is ``Mul(x, Reciprocal(Sqrt(Add(ReduceMean(Pow(x, 2), axes=[-1], keepdims=1),
    eps))))`` (either operand order), ``chain`` the five nodes before ``mul``; with ``single_use`` only where every
    one of them has one use. Else None."""
    for x, r in (mul.inputs, mul.inputs[::-1]):
        rec = producer(r, "Reciprocal")
        sqrt = producer(rec.inputs[0], "Sqrt") if rec else None
        add = producer(sqrt.inputs[0], "Add") if sqrt else None
        if add is None:
            continue
        for m, e in (add.inputs, add.inputs[::-1]):
            mean, eps = producer(m, "ReduceMean"), scalar(e)
            pw = producer(mean.inputs[0], "Pow") if mean is not None else None
            if pw is None or eps is None or pw.inputs[0] is not x or scalar(pw.inputs[1]) != 2.0:
                continue
            axes = const_array(mean.inputs[1]) if len(mean.inputs) > 1 else None
            keep = mean.attributes.get("keepdims")
            rank = len(x.shape) if x.shape is not None else None
            if axes is None or rank is None or [int(a) % rank for a in axes.reshape(-1)] != [rank - 1] \
                    or (keep is not None and keep.value != 1):
                continue
            chain = (pw, mean, add, sqrt, rec)
            if not single_use or all(len(n.outputs[0].uses()) == 1 for n in chain):
                return x, eps, chain
    return None
