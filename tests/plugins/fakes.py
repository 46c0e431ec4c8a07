"""Stand-ins for TensorRT objects, so the plugin's plain functions and its registration run on CPU.

* :class:`Expr` -- a symbolic dimension like TensorRT's ``ShapeExpr`` (``*``, ``+``, ``//``, constants).
* :class:`FakeTensor` -- a ``trtp.Tensor``-like view of a torch tensor (``data_ptr``/shape/strides/dtype).
* :func:`fake_tensorrt` -- ``(trt, trtp)`` modules with the decorators of ``tensorrt.plugin`` recording the
  decorated functions and checking the schema rules TensorRT's validators enforce (live type annotations,
  tensors then attributes of int/float/..., no defaults, ``outputs``/``stream``/``tactic`` placement,
  aot_impl return annotation).
"""

from __future__ import annotations

import inspect
import types
import typing
from typing import Any


class Expr:
    """Symbolic int expression (``*``, ``+``, ``-``, ``//``); ``Expr(4)`` is constant, ``Expr("batch")`` is not."""

    def __init__(self, v: Any):
        self.v = v

    def _op(self, sym: str, other: Any) -> "Expr":
        o = other.v if isinstance(other, Expr) else other
        if isinstance(self.v, int) and isinstance(o, int):
            return Expr({"*": self.v * o, "+": self.v + o, "-": self.v - o, "//": self.v // o}[sym])
        return Expr(f"({self.v}{sym}{o})")

    def __mul__(self, o):
        return self._op("*", o)

    __rmul__ = __mul__

    def __add__(self, o):
        return self._op("+", o)

    def __sub__(self, o):
        return self._op("-", o)

    def __floordiv__(self, o):
        return self._op("//", o)

    def is_constant(self) -> bool:
        return isinstance(self.v, int)

    def constant_value(self) -> int:
        assert isinstance(self.v, int)
        return self.v

    def __eq__(self, other):
        return isinstance(other, Expr) and other.v == self.v or (isinstance(other, int) and self.v == other)

    def __hash__(self):
        return hash(self.v)

    def __repr__(self):
        return f"Expr({self.v!r})"


def exprs(*dims) -> tuple[Expr, ...]:
    return tuple(Expr(d) for d in dims)


class FakeTensor:
    """What ``@impl`` receives from TensorRT: ``data_ptr``, ``shape``, ``strides`` (elements), ``dtype``."""

    def __init__(self, t, dtype_name: str | None = None):
        import torch

        self.tensor = t
        self.data_ptr = t.data_ptr()
        self.shape = tuple(t.shape)
        self.strides = tuple(t.stride())
        self.dtype = dtype_name or {torch.float32: "DataType.FLOAT", torch.float16: "DataType.HALF",
                                    torch.bfloat16: "DataType.BF16", torch.int32: "DataType.INT32"}[t.dtype]


def fake_tensorrt(version: str = "10.13.0", *, aot: bool = True):
    """``(trt, trtp)`` stand-ins; ``trtp.defs[plugin_id]`` holds the registered functions by role."""

    class TensorDesc:
        def __init__(self, shape_expr=(), dtype=None):
            self.shape_expr = tuple(shape_expr)
            self.dtype = dtype

    class Tensor:
        pass

    class AutoTuneCombination:
        def __init__(self, io_types=None, layouts=None, tactics=None):
            self.io_types, self.layouts, self.tactics = io_types, layouts, tactics

    class KernelLaunchParams:
        def __init__(self):
            self.grid_x = self.grid_y = self.grid_z = self.block_x = self.block_y = self.block_z = 1
            self.shared_mem = 0

    class SymExprs(list):
        pass

    class SymIntExprs(SymExprs):
        @classmethod
        def from_tuple(cls, items):
            return cls(items)

    class SymInt32:
        def __init__(self, v):
            self.v = v

    trt = types.SimpleNamespace(__version__=version, float32="DataType.FLOAT", float16="DataType.HALF",
                                bfloat16="DataType.BF16")
    if aot:
        trt.QuickPluginCreationRequest = object()
    defs: dict[str, dict[str, Any]] = {}

    def _params(fn):
        return inspect.signature(fn).parameters

    def register(plugin_id):
        def deco(fn):
            saw_attr = False
            for name, p in _params(fn).items():
                assert p.annotation is not inspect.Parameter.empty, f"{name}: register args need annotations"
                assert not isinstance(p.annotation, str), f"{name}: annotation is a string (postponed evaluation)"
                assert p.default is inspect.Parameter.empty, f"{name}: defaults are not supported"
                if isinstance(p.annotation, type) and issubclass(p.annotation, TensorDesc):
                    assert not saw_attr, "tensors and attributes interspersed"
                else:
                    assert p.annotation in (int, float, bool, str, bytes), f"{name}: unsupported attr type"
                    assert name not in ("outputs", "stream", "tactic")
                    saw_attr = True
            ret = inspect.signature(fn).return_annotation
            assert typing.get_origin(ret) is tuple and all(issubclass(a, TensorDesc) for a in typing.get_args(ret))
            assert plugin_id not in defs, f"{plugin_id} registered twice"
            defs[plugin_id] = {"desc": fn}
            return fn
        return deco

    def _later(role, last):
        def outer(plugin_id):
            def deco(fn):
                assert plugin_id in defs, f"{plugin_id}: @{role} before @register"
                names = list(_params(fn))
                ends = [list(last)] + ([list(last) + ["tactic"]] if role in ("impl",) else [])
                assert any(names[-len(e):] == e for e in ends), f"@{role}: parameters must end with {ends}, got {names}"
                if role == "aot_impl":
                    ret = inspect.signature(fn).return_annotation
                    args = typing.get_args(ret)
                    assert typing.get_origin(ret) is tuple and len(args) == 4
                    assert issubclass(args[2], KernelLaunchParams) and issubclass(args[3], SymExprs)
                defs[plugin_id][role] = fn
                return fn
            return deco
        return outer

    trtp = types.SimpleNamespace(
        TensorDesc=TensorDesc, Tensor=Tensor, AutoTuneCombination=AutoTuneCombination,
        KernelLaunchParams=KernelLaunchParams, SymExprs=SymExprs, SymIntExprs=SymIntExprs, SymInt32=SymInt32,
        register=register, impl=_later("impl", ("outputs", "stream")), autotune=_later("autotune", ("outputs",)),
        from_shape_expr=lambda shape, dtype: TensorDesc(shape, dtype), defs=defs)
    if aot:
        trtp.aot_impl = _later("aot_impl", ("outputs", "tactic"))
    return trt, trtp
