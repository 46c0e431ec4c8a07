"""One launch description per cuTile kernel: its arguments in order, by name, and its grid.

A :class:`Launch` is checked against the kernel's own Python signature when it is made (same
names in the same order; arrays, runtime scalars and ``ct.Constant`` parameters where the
signature has them), so a swapped or missing argument fails here, not as garbage on the GPU.
The same description feeds both launch paths:

* JIT (``ct.launch``): :meth:`Launch.bind` turns a name -> tensor mapping into the positional
  argument tuple;
* AOT (TensorRT ``--plugin aot``, :mod:`m2export.plugins.aot`): :meth:`Launch.flat_args` lists
  the entry parameters in the ``cutile_python_v1`` flattening, :attr:`Arg.source` names the plugin
  tensor bound to each array and :attr:`Arg.squeeze` the size-1 dimension the kernel's view drops
  (the decode step sees x (batch, 1, nheads, headdim) as (batch, nheads, headdim)).

Plain Python: importing this needs neither CUDA nor ``cuda.tile``.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, replace
from typing import Any, Mapping

from m2export.errors import InternalError

ARG_KINDS = ("array", "scalar", "constant")


@dataclass(frozen=True)
class Arg:
    """One parameter of a kernel, in order.

    kind: "array" (a tensor; ``dtype`` its element type, ``ndim`` its rank), "scalar" (a runtime
    value, ``dtype`` "float32" or "int32", ``value``) or "constant" (``ct.Constant``, compiled in:
    ``value``; no slot in the AOT entry). ``source``: the tensor bound to an array (default: its
    own name; e.g. the fused kernel's ``D`` reads ``A`` when D is absent and HAS_D is False);
    ``squeeze``: AOT only, a size-1 dimension of the source tensor that the kernel's view drops;
    ``alias``: arrays sharing a group may be the same buffer (an in-place state update).
    """

    name: str
    kind: str
    dtype: str | None = None
    ndim: int | None = None
    value: Any = None
    source: str | None = None
    squeeze: int | None = None
    alias: tuple[str, ...] = ()

    @property
    def src(self) -> str:
        return self.source or self.name


def array(name: str, dtype: str, ndim: int, **kw) -> Arg:
    return Arg(name, "array", dtype, ndim, **kw)


def scalar(name: str, dtype: str, value: Any) -> Arg:
    return Arg(name, "scalar", dtype, value=value)


def constant(name: str, value: Any) -> Arg:
    return Arg(name, "constant", value=value)


def kernel_params(kernel: Any) -> list[tuple[str, str]]:
    """(name, kind) of each parameter of a ``@ct.kernel``, from its own signature and annotations:
    ``ct.Constant[...]`` -> "constant", ``float``/``int`` -> "scalar", unannotated -> "array"."""
    fn = getattr(kernel, "_pyfunc", kernel)
    hints = typing.get_type_hints(fn, include_extras=True)
    out = []
    for name in fn.__code__.co_varnames[:fn.__code__.co_argcount]:
        h = hints.get(name)
        if h is None:
            kind = "array"
        elif typing.get_origin(h) is typing.Annotated and any(
                type(m).__name__ == "ConstantAnnotation" for m in typing.get_args(h)[1:]):
            kind = "constant"
        elif h in (float, int):
            kind = "scalar"
        else:
            raise InternalError(f"kernel {fn.__name__}: parameter {name} has annotation {h!r}; expected none "
                                "(an array), float/int (a scalar) or ct.Constant[...]")
        out.append((name, kind))
    return out


@dataclass(frozen=True)
class Launch:
    """A kernel, its arguments (:class:`Arg`, in the kernel's order) and its grid.

    grid: ``(gx, gy, gz)`` for a JIT launch, or for an AOT description a function
    ``grid(batch, nheads, headdim)`` (ints or TensorRT ``ShapeExpr``). config: what the plan chose
    (a ScanConfig, a decode-step tile), for callers and tests.
    """

    kernel: Any
    args: tuple[Arg, ...]
    grid: Any
    config: Any = None

    def __post_init__(self):
        want = kernel_params(self.kernel)
        have = [(a.name, a.kind) for a in self.args]
        if have != want:
            raise InternalError(f"launch description of {getattr(self.kernel, '_pyfunc', self.kernel).__name__} "
                                f"drifted from the kernel's signature: {_diff(have, want)}")

    @property
    def name(self) -> str:
        return getattr(self.kernel, "_pyfunc", self.kernel).__name__

    def bind(self, tensors: Mapping[str, Any]) -> tuple:
        """Positional arguments for ``ct.launch``: arrays from ``tensors[arg.src]``, the rest their values."""
        return tuple(tensors[a.src] if a.kind == "array" else a.value for a in self.args)

    def launch(self, stream: int, tensors: Mapping[str, Any]) -> None:
        import cuda.tile as ct

        ct.launch(stream, self.grid, self.kernel, self.bind(tensors))

    def runtime_params(self) -> list[str]:
        """Names of the parameters that take entry slots (arrays and scalars), in order."""
        return [a.name for a in self.args if a.kind != "constant"]

    def flat_args(self) -> list[str]:
        """Entry parameters in the ``cutile_python_v1`` flattening: ``NAME.ptr``, ``NAME.shapeK``,
        ``NAME.strideK`` per array (pointer, extents, strides), the name of each runtime scalar."""
        out = []
        for a in self.args:
            if a.kind == "array":
                out.append(f"{a.name}.ptr")
                out += [f"{a.name}.shape{i}" for i in range(a.ndim)]
                out += [f"{a.name}.stride{i}" for i in range(a.ndim)]
            elif a.kind == "scalar":
                out.append(a.name)
        return out

    def sources(self) -> dict[str, str]:
        """Array name -> the tensor bound to it."""
        return {a.name: a.src for a in self.args if a.kind == "array"}

    def views(self) -> dict[str, int]:
        """Array name -> the size-1 dimension of its source the kernel's view drops (only those with one)."""
        return {a.name: a.squeeze for a in self.args if a.kind == "array" and a.squeeze is not None}

    def scalars(self) -> dict[str, tuple[str, Any]]:
        return {a.name: (a.dtype, a.value) for a in self.args if a.kind == "scalar"}

    def with_args(self, **changes: dict) -> "Launch":
        """A copy with some arguments' fields replaced: ``with_args(x=dict(source="x", squeeze=1))``."""
        unknown = set(changes) - {a.name for a in self.args}
        if unknown:
            raise InternalError(f"{self.name}: no parameter(s) {sorted(unknown)}")
        return replace(self, args=tuple(replace(a, **changes[a.name]) if a.name in changes else a
                                        for a in self.args))


def _diff(have: list, want: list) -> str:
    for i, (h, w) in enumerate(zip(have, want)):
        if h != w:
            return f"parameter {i} is {h[0]!r} ({h[1]}) in the description but {w[0]!r} ({w[1]}) in the kernel"
    return f"{len(have)} arguments described, the kernel takes {len(want)}"


__all__ = ["ARG_KINDS", "Arg", "Launch", "array", "constant", "kernel_params", "scalar"]
