"""AOT path of the SSMScan TensorRT plugin: the cuTile kernel as PTX in TensorRT's argument order.

TensorRT's ahead-of-time Python plugins (``@tensorrt.plugin.aot_impl``) return a kernel name, its PTX,
launch parameters and "extra" symbolic int32 arguments; at run time TensorRT launches the PTX itself
(no Python) with the parameter slots filled as::

    input pointers (plugin input order) | extra SymInt32 args | output pointers (plugin output order)

cuTile's calling convention ``cutile_python_v1`` instead flattens each kernel parameter in declaration
order: an array becomes ``pointer (u64), shape[0..ndim) (i32), stride[0..ndim) (i32)``, a runtime scalar
one parameter of its type, and ``ct.Constant`` parameters are compiled in (no slot). The kernel's own
description of that flattening is :meth:`m2export.kernels.launch.Launch.flat_args`
(``["x.ptr", "x.shape0", ..., "x.stride3", "dt.ptr", ..., "dt_min", "dt_max"]``).

This module maps one onto the other explicitly and checks every step, because a wrong mapping does
not fail: the kernel reads whatever lies in the slot and writes plausible garbage.

1. :func:`argument_map` -- which cuTile parameter goes into which TensorRT slot, and the names of the
   extra arguments (every shape/stride/scalar, in cuTile order).
2. :func:`ptx_from_cubin` -- ``cuda.tile.compilation.export_kernel`` writes a cubin; the PTX it was
   assembled from is the cubin's ``.nv_debug_ptx_txt`` section (found by name in the ELF section table).
3. :func:`parse_entry` / :func:`check_entry` / :func:`reorder_entry_params` -- the ``.entry`` parameter
   declarations are permuted into TensorRT's order. The body refers to each parameter by name, so moving
   the declaration is what rebinds it; the count and the type of each slot are checked first.
4. :func:`extra_arg_values` -- the extras' values from the tensor shapes (TensorRT ``ShapeExpr`` or
   ints), contiguous row-major strides, and fp32 scalars as their int32 bit pattern (TensorRT only
   passes int32 extras; a 4-byte ``.param .f32`` slot reads the same bits).
5. :func:`check_target` -- the PTX ``.target`` must be the build GPU's architecture and the installed
   driver must JIT-compile the PTX ISA: TensorRT loads embedded PTX lazily, so otherwise the engine builds
   and then fails or computes garbage at run time.

Prior art (read, not copied): Torch-TensorRT ``py/torch_tensorrt/kernels/_cutile.py`` (cutile_kernel_op
branch) does the same export -> PTX -> ``.entry`` reorder; TensorRT's
``samples/python/quickly_deployable_plugins/qdp_defs.py`` shows the AOT return value.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import re
import struct
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from m2export.contract import INPUT_NAMES, INPUTS, OUTPUT_NAMES, OUTPUTS, SSMScanAttrs, SSMScanProblem
from m2export.errors import BackendUnavailable, InternalError

PTX_SECTION = ".nv_debug_ptx_txt"
"""ELF section of a cuTile cubin that holds the PTX the cubin was assembled from (NUL-separated lines)."""

_ENTRY_RE = re.compile(r"\.visible\s+\.entry\s+([A-Za-z_$][\w$]*)\s*\(([^)]*)\)", re.DOTALL)
_VERSION_RE = re.compile(r"^\s*\.version\s+(\d+)\.(\d+)", re.MULTILINE)
_TARGET_RE = re.compile(r"^\s*\.target\s+([\w,\s]+?)\s*$", re.MULTILINE)
_REQNTID_RE = re.compile(r"\.reqntid\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?")
_ARG_RE = re.compile(r"^(?P<tensor>[A-Za-z_]\w*)\.(?:(?P<ptr>ptr)|shape(?P<shape>\d+)|stride(?P<stride>\d+))$")


# ----------------------------------------------------------------------------- argument mapping
@dataclass(frozen=True)
class ArgumentMap:
    """TensorRT AOT slots <-> cuTile entry parameters for one kernel.

    Attributes:
        cutile_args: symbolic entry parameters in cuTile order (``Launch.flat_args()``).
        inputs, outputs: plugin input and output tensor names, in TensorRT's order.
        order: ``order[slot]`` is the index in ``cutile_args`` of the parameter TensorRT fills into
            ``slot``; :func:`reorder_entry_params` applies it to the PTX.
        extra_args: names of the SymInt32 extras, in slot order (every non-pointer parameter, in cuTile order).
        sources: kernel array parameter -> the plugin tensor bound to it (absent: the same name).
        views: kernel array parameter -> the size-1 dimension of its plugin tensor the kernel's view drops.
    """

    cutile_args: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    order: tuple[int, ...]
    extra_args: tuple[str, ...]
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)
    views: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def source(self, param: str) -> str:
        return self.sources.get(param, param)

    def params(self) -> list[str]:
        """The kernel parameters the entry takes, in order (each array once, each scalar)."""
        out: list[str] = []
        for name in self.cutile_args:
            m = _ARG_RE.match(name)
            p = m.group("tensor") if m else name
            if not out or out[-1] != p:
                out.append(p)
        return out

    @property
    def trt_slots(self) -> tuple[str, ...]:
        """Parameter names in TensorRT slot order (what the reordered entry declares)."""
        return tuple(self.cutile_args[i] for i in self.order)


def argument_map(cutile_args: Sequence[str], inputs: Sequence[str] = INPUT_NAMES,
                 outputs: Sequence[str] = OUTPUT_NAMES, *, sources: Mapping[str, str] | None = None,
                 views: Mapping[str, int] | None = None) -> ArgumentMap:
    """Map TensorRT's AOT slots (input ptrs | extras | output ptrs) onto ``cutile_args``.

    ``sources`` names the plugin tensor of a kernel array parameter whose name differs (the decode
    step's ``ssm_state`` is the plugin's ``initial_state``); ``views`` its dropped size-1 dimension.

    Raises:
        InternalError: a tensor has no pointer or two, an argument name is malformed, or a pointer
            belongs to a tensor that is neither an input nor an output -- a kernel/plugin mismatch.
    """
    cutile_args = tuple(cutile_args)
    ptr_index: dict[str, int] = {}
    for i, name in enumerate(cutile_args):
        m = _ARG_RE.match(name)
        if m is None:
            if "." in name:
                raise InternalError(f"AOT argument {name!r}: expected TENSOR.ptr, TENSOR.shapeK, TENSOR.strideK "
                                    "or a scalar name")
            continue
        if m.group("ptr"):
            tensor = (sources or {}).get(m.group("tensor"), m.group("tensor"))
            if tensor in ptr_index:
                raise InternalError(f"AOT arguments: tensor {tensor!r} has two pointers")
            ptr_index[tensor] = i
    known = set(inputs) | set(outputs)
    stray = sorted(set(ptr_index) - known)
    if stray:
        raise InternalError(f"AOT arguments: pointer(s) of {stray} are neither plugin inputs {list(inputs)} "
                            f"nor outputs {list(outputs)}")
    missing = [t for t in (*inputs, *outputs) if t not in ptr_index]
    if missing:
        raise InternalError(f"AOT arguments: no pointer parameter for {missing} in {list(cutile_args)}")
    ptrs = set(ptr_index.values())
    extras = [i for i in range(len(cutile_args)) if i not in ptrs]
    order = tuple([ptr_index[t] for t in inputs] + extras + [ptr_index[t] for t in outputs])
    return ArgumentMap(cutile_args, tuple(inputs), tuple(outputs), order,
                       tuple(cutile_args[i] for i in extras), dict(sources or {}), dict(views or {}))


def float32_bits(value: float) -> int:
    """The IEEE-754 binary32 bit pattern of ``value`` as a signed int32 (inf -> 2139095040)."""
    return struct.unpack("<i", struct.pack("<f", float(value)))[0]


def _product(dims: Sequence[Any]) -> Any:
    out: Any = 1
    for d in dims:
        out = d if isinstance(out, int) and out == 1 else out * d
    return out


def scalar_arg(dtype: str, value: Any) -> int:
    """The int32 TensorRT passes for a runtime scalar: the value (int32) or its bit pattern (float32)."""
    if dtype == "float32":
        return float32_bits(value)
    if dtype == "int32":
        v = int(value)
        if not -2**31 <= v < 2**31:
            raise InternalError(f"int32 scalar argument out of range: {v}")
        return v
    raise InternalError(f"AOT scalar of dtype {dtype!r}: TensorRT's AOT extras are 32-bit; expected float32 or int32")


def extra_arg_values(amap: ArgumentMap, shapes: Mapping[str, Sequence[Any]],
                     scalars: Mapping[str, tuple[str, Any]]) -> list[Any]:
    """Values of ``amap.extra_args``: shapes (ints or ``ShapeExpr``), contiguous strides, scalars.

    ``TENSOR.shapeK`` is dim K of the kernel's view of its plugin tensor (``shapes[amap.source(TENSOR)]``
    without the dimension ``amap.views`` drops, which has size 1); ``TENSOR.strideK`` the row-major
    contiguous stride in elements (the product of the later dims, ``1`` for the last: TensorRT plugin
    I/O is linear and dense, and dropping a size-1 dim changes no stride); a scalar is
    :func:`scalar_arg` of ``scalars[name] = (dtype, value)``. Works symbolically: dims only need ``*``.
    """
    out = []
    for name in amap.extra_args:
        m = _ARG_RE.match(name)
        if m is None:
            if name not in scalars:
                raise InternalError(f"AOT scalar argument {name!r} has no value (have {sorted(scalars)})")
            out.append(scalar_arg(*scalars[name]))
            continue
        dims = list(shapes[amap.source(m.group("tensor"))])
        if m.group("tensor") in amap.views:
            del dims[amap.views[m.group("tensor")]]
        if m.group("shape") is not None:
            out.append(dims[int(m.group("shape"))])
        else:
            k = int(m.group("stride"))
            out.append(_product(dims[k + 1:]))
    return out


# ----------------------------------------------------------------------------- PTX
def cubin_sections(cubin: bytes) -> dict[str, bytes]:
    """Name -> contents of the sections of a 64-bit little-endian ELF (a cubin)."""
    if len(cubin) < 64 or cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise InternalError("cuTile export did not produce a 64-bit little-endian ELF cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = []
    for i in range(shnum):
        name, _typ, _flags, _addr, off, size = struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize)
        headers.append((name, off, size))
    _n, stroff, strsize = headers[shstrndx]
    strtab = cubin[stroff:stroff + strsize]
    out = {}
    for name, off, size in headers:
        end = strtab.find(b"\0", name)
        out[strtab[name:end].decode(errors="replace")] = cubin[off:off + size]
    return out


def ptx_from_cubin(cubin: bytes) -> str:
    """The PTX text a cuTile cubin was assembled from (section :data:`PTX_SECTION`)."""
    sections = cubin_sections(cubin)
    raw = sections.get(PTX_SECTION)
    if not raw:
        raise InternalError(f"cuTile cubin has no {PTX_SECTION} section (sections: {sorted(sections)}); "
                            "this cuda-tile version does not embed its PTX, which the AOT plugin needs")
    text = raw.replace(b"\0", b"\n").decode("utf-8", errors="strict")
    start = text.find(".version")
    if start < 0 or ".entry" not in text:
        raise InternalError(f"{PTX_SECTION} of the cuTile cubin does not look like PTX")
    return _strip_after_entry(text[start:])


def _strip_after_entry(ptx: str) -> str:
    """Cut the module after the closing brace of the entry's body.

    What follows in the section is debug information (``.section .debug_str``) and the Tile IR source
    (``.nv_intermediate_source_section``), which is not PTX that the driver's JIT accepts. Braces are
    matched (vector operands such as ``{%r1, %r2}`` put balanced braces inside the body).
    """
    m = _ENTRY_RE.search(ptx)
    if m is None:
        raise InternalError("kernel PTX has no .visible .entry")
    open_at = ptx.find("{", m.end())
    depth = 0
    for brace in re.finditer(r"[{}]", ptx[open_at:]):
        depth += 1 if brace.group() == "{" else -1
        if depth == 0:
            return ptx[:open_at + brace.end()] + "\n"
    raise InternalError("kernel PTX: unbalanced braces in the entry body")


@dataclass(frozen=True)
class PtxEntry:
    """The kernel entry of a PTX module: name, parameter declarations, span of the declaration list."""

    name: str
    params: tuple[str, ...]
    span: tuple[int, int]

    def param_name(self, i: int) -> str:
        return self.params[i].split()[-1]

    def param_kind(self, i: int) -> str:
        """'ptr' (u64 global pointer), 'u32'/'s32'/'b32' (32-bit int), 'f32', or the raw type."""
        toks = self.params[i].split()
        if ".ptr" in toks:
            return "ptr"
        return toks[1].lstrip(".") if len(toks) > 1 else "?"


def parse_entry(ptx: str) -> PtxEntry:
    """The single ``.visible .entry`` of ``ptx`` (cuTile exports one kernel per module)."""
    found = list(_ENTRY_RE.finditer(ptx))
    if len(found) != 1:
        raise InternalError(f"expected exactly one .visible .entry in the kernel PTX, found {len(found)}")
    m = found[0]
    params = tuple(" ".join(p.split()) for p in m.group(2).split(",") if p.strip())
    return PtxEntry(m.group(1), params, m.span(2))


def ptx_version(ptx: str) -> tuple[int, int]:
    m = _VERSION_RE.search(ptx)
    if m is None:
        raise InternalError("PTX has no .version directive")
    return int(m.group(1)), int(m.group(2))


def set_ptx_version(ptx: str, version: tuple[int, int]) -> str:
    """Rewrite the ``.version`` directive (only on explicit request: see ``ptx_isa`` in :func:`compile_aot_kernel`)."""
    m = _VERSION_RE.search(ptx)
    if m is None:
        raise InternalError("PTX has no .version directive")
    return ptx[:m.start(1)] + f"{version[0]}.{version[1]}" + ptx[m.end(2):]


def ptx_target(ptx: str) -> str:
    """Architecture of the ``.target`` directive, e.g. ``sm_90a``."""
    m = _TARGET_RE.search(ptx)
    if m is None:
        raise InternalError("PTX has no .target directive")
    return m.group(1).split(",")[0].strip()


def required_threads(ptx: str) -> tuple[int, int, int] | None:
    """The ``.reqntid`` block shape the entry demands (cuTile picks it; a launch must match it)."""
    m = _REQNTID_RE.search(ptx)
    if m is None:
        return None
    return tuple(int(g) if g else 1 for g in m.groups())  # type: ignore[return-value]


def check_entry(entry: PtxEntry, amap: ArgumentMap, scalar_dtypes: Mapping[str, str],
                kernel_params: Sequence[str]) -> None:
    """The entry's parameters must be exactly ``amap.cutile_args``: the kernel's own parameters in order,
    the count, and a type per kind.

    ``kernel_params``: the runtime (non-constant) parameters of the kernel's Python signature, in order
    (:func:`m2export.kernels.launch.kernel_params`); the PTX names its parameters by index only, so this
    is what catches two same-typed arrays described in the wrong order (B and C swapped). Pointers
    must be ``.u64 .ptr``, shapes and strides 32-bit integers, scalars ``.f32`` (float32) or a 32-bit
    integer (int32), per ``scalar_dtypes``.
    """
    args = amap.cutile_args
    described = amap.params()
    if described != list(kernel_params):
        bad = next((i for i, (a, b) in enumerate(zip(described, kernel_params)) if a != b),
                   min(len(described), len(kernel_params)))
        raise InternalError(
            f"kernel {entry.name}: the AOT description lists parameter {bad} as "
            f"{described[bad] if bad < len(described) else '<none>'!r} but the kernel's signature has "
            f"{kernel_params[bad] if bad < len(kernel_params) else '<none>'!r} there "
            f"(described {described}, kernel {list(kernel_params)}); refusing to bind arguments by position")
    blobs = [entry.params[i] for i in range(len(entry.params)) if ".b8" in entry.params[i].split() or
             re.search(r"\[\d+\]$", entry.params[i])]
    if blobs:
        raise InternalError(
            f"kernel {entry.name}: {len(blobs)} parameter(s) are byte arrays ({blobs[0].split()[-1][-24:]}...), "
            "i.e. TMA tensor-map descriptors the host encodes per launch; TensorRT's AOT launcher passes only "
            "pointers and int32 extras -- export the AOT kernel with TMA forbidden (its TMA constant False) or "
            "without divisibility facts (trt_signature)")
    if len(entry.params) != len(args):
        raise InternalError(
            f"kernel {entry.name}: the PTX entry declares {len(entry.params)} parameters but the kernel's "
            f"AOT description flattens to {len(args)} ({', '.join(args)}); the cuTile calling convention "
            "or the kernel signature changed -- refusing to guess the argument order")
    for i, name in enumerate(args):
        kind = entry.param_kind(i)
        m = _ARG_RE.match(name)
        ints = ("u32", "s32", "b32")
        if m is not None:
            want = ("ptr",) if m.group("ptr") else ints
        else:
            want = {"float32": ("f32",), "int32": ints}.get(scalar_dtypes.get(name, "?"), ("<a 32-bit scalar>",))
        if kind not in want:
            raise InternalError(f"kernel {entry.name}: parameter {i} ({name}) is declared "
                                f"'{entry.params[i]}', expected {' or '.join(want)}")


def reorder_entry_params(ptx: str, entry: PtxEntry, order: Sequence[int]) -> str:
    """PTX with the entry's parameter declarations permuted so that slot ``i`` declares ``order[i]``."""
    if sorted(order) != list(range(len(entry.params))):
        raise InternalError(f"parameter order {list(order)} is not a permutation of {len(entry.params)} slots")
    body = ",\n\t".join(entry.params[i] for i in order)
    a, b = entry.span
    return ptx[:a] + "\n\t" + body + "\n" + ptx[b:]


# ----------------------------------------------------------------------------- target
def gpu_code_for(cc: tuple[int, int]) -> str:
    """cuTile ``gpu_code`` for a compute capability: (9, 0) -> ``sm_90``."""
    return f"sm_{cc[0]}{cc[1]}"


def check_target(ptx: str, *, cc: tuple[int, int], driver: tuple[int, int],
                 load: Callable[[bytes], int], kernel: str = "SSMScan") -> None:
    """Refuse PTX the build GPU cannot run: wrong ``.target`` architecture, or an ISA the driver rejects.

    ``load`` JIT-compiles PTX with the driver (``cuModuleLoadData``) and returns the CUresult.

    Raises:
        BackendUnavailable: naming the PTX target/ISA, the GPU's compute capability and the driver's
            CUDA version, with the remedy.
    """
    from m2export.plugins._cuda import CUDA_ERROR_UNSUPPORTED_PTX_VERSION, result_name

    target = ptx_target(ptx)
    m = re.fullmatch(r"sm_(\d+)(\d)([af]?)", target)
    if m is None or (int(m.group(1)), int(m.group(2))) != tuple(cc):
        raise BackendUnavailable(
            f"{kernel} AOT kernel: PTX .target {target} does not match the build GPU "
            f"(compute capability {cc[0]}.{cc[1]}); the engine would not run there",
            hint="build on the GPU the engine is for (engines are specific to one GPU architecture)")
    rc = load(ptx.encode())
    if rc == 0:
        return
    isa = ptx_version(ptx)
    if rc == CUDA_ERROR_UNSUPPORTED_PTX_VERSION:
        raise BackendUnavailable(
            f"{kernel} AOT kernel: the CUDA driver (CUDA {driver[0]}.{driver[1]}) cannot JIT PTX ISA "
            f"{isa[0]}.{isa[1]} emitted by cuda-tile's tileiras; an engine embedding it would build and then "
            "fail or compute garbage when TensorRT loads the kernel",
            hint="update the NVIDIA driver to one supporting that PTX ISA (or install a cuda-tile whose tileiras "
                 "is not newer than the driver), or build with the JIT plugin (`plugin='jit'`)")
    raise BackendUnavailable(
        f"{kernel} AOT kernel: the CUDA driver (CUDA {driver[0]}.{driver[1]}) rejects the PTX "
        f"(ISA {isa[0]}.{isa[1]}, target {target}) with {result_name(rc)}",
        hint="build with the JIT plugin (`plugin='jit'`), or report this with 'm2export build -v' output")


# ----------------------------------------------------------------------------- compile
@dataclass(frozen=True)
class AotKernel:
    """A cuTile kernel ready for ``@aot_impl``: PTX in TensorRT's argument order and how to launch it.

    ``grid(batch, nheads, headdim)`` gives the launch grid (ints or ``ShapeExpr``); ``block`` the
    ``.reqntid`` of the entry; ``scalars`` the runtime scalar arguments, name -> (dtype, value).
    """

    name: str
    ptx: str
    block: tuple[int, int, int]
    amap: ArgumentMap
    grid: Callable[[Any, Any, Any], tuple[Any, Any, Any]]
    scalars: Mapping[str, tuple[str, Any]]
    gpu_code: str


def divisibility_facts(dims: Sequence[int | None]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape_divisible_by, stride_divisible_by) of a contiguous row-major tensor whose extents are ``dims``
    (an int: fixed when the engine is built; None: known only at run time, e.g. batch).

    Each fixed extent is divisible by its largest power-of-two factor (a run-time one only by 1); a stride is
    the product of the extents after it, so it is divisible by the product of their factors (capped at 2**16).
    True for every tensor TensorRT hands a plugin in its linear format, whatever the run-time extents.
    """
    shape = tuple((v & -v) if isinstance(v, int) and v > 0 else 1 for v in dims)
    stride = []
    for i in range(len(shape)):
        f = 1
        for v in shape[i + 1:]:
            f *= v
        stride.append(min(f, 1 << 16))
    return shape, tuple(stride)


def contract_dims(nheads: int, headdim: int, ngroups: int, d_state: int, *, decode: bool = False,
                  specs: Sequence[Any] = INPUTS + OUTPUTS) -> dict[str, tuple[int | None, ...]]:
    """Each SSMScan plugin tensor's extents (the contract's :class:`~m2export.contract.TensorSpec` dims) as far
    as the engine fixes them: nheads, headdim, ngroups and d_state are compiled into the AOT kernel, batch is a
    run-time extent (None), seqlen too except in a decode graph (the constant 1)."""
    sizes = {"nheads": nheads, "headdim": headdim, "ngroups": ngroups, "d_state": d_state,
             "batch": None, "seqlen": 1 if decode else None}
    return {s.name: tuple(sizes[d] for d in s.dims) for s in specs}


def trt_signature(spec: Any, dims: Mapping[str, Sequence[int | None]] | None = None):
    """The ``KernelSignature`` the AOT kernel is exported with: only what TensorRT's launcher can pass.

    TensorRT's AOT launch hands the kernel device pointers and 32-bit integer extras, nothing else. So
    every array is declared contiguous (last stride the constant 1), non-negative strides, 16-byte aligned
    base (TensorRT's buffers are at least 256-byte aligned). ``dims`` (source tensor name -> its extents,
    :func:`contract_dims`) adds the shape and stride divisibility that the engine's fixed sizes imply
    (:func:`divisibility_facts`; a kernel view's squeezed dimension dropped): without them every tile access
    is bounds-checked element by element and tileiras emits scalar 2- and 4-byte loads (the decode kernel at
    head dim 64, d_state 128: 255 registers, a 48-byte spill, 3,696 SASS instructions; with them 16-byte
    LDG.E.128, 168 registers, 1,816). With those facts cuTile would choose TMA, whose 128-byte ``CUtensorMap``
    parameters the host must encode per launch (cuTile's own launcher does; TensorRT cannot), so kernels
    exported with ``dims`` must forbid it themselves (their ``TMA`` constant False); :func:`check_entry`
    refuses any tensor-map parameter that remains. Scalars are fp32 or int32; ``ct.Constant`` parameters
    take their compiled-in values. This is the plugin's side of the calling convention, on purpose not the
    ``ct.launch`` (the JIT path), which derives its facts from the actual tensors and may use TMA.
    ``spec`` is a :class:`m2export.kernels.launch.Launch`.
    """
    import cuda.tile as ct
    from cuda.tile.compilation import ArrayConstraint, CallingConvention, KernelSignature, ScalarConstraint

    dtypes = {"float32": ct.float32, "float16": ct.float16, "bfloat16": ct.bfloat16}
    scalars = {"float32": ct.float32, "int32": ct.int32}
    cons: list[Any] = []
    for prm in spec.args:
        if prm.kind == "array":
            facts = {}
            if dims is not None and prm.src in dims:
                view = list(dims[prm.src])
                if prm.squeeze is not None:
                    del view[prm.squeeze]
                if len(view) != prm.ndim:
                    raise InternalError(f"AOT array {prm.name}: {prm.ndim}-D view of {prm.src} with extents "
                                        f"{tuple(dims[prm.src])} (squeeze {prm.squeeze})")
                shape_div, stride_div = divisibility_facts(view)
                facts = dict(shape_divisible_by=shape_div, stride_divisible_by=stride_div)
            cons.append(ArrayConstraint(dtypes[prm.dtype], prm.ndim, index_dtype=ct.int32, stride_lower_bound_incl=0,
                                        alias_groups=tuple(getattr(prm, "alias", ()) or ()),
                                        may_alias_internally=False,
                                        stride_constant=(None,) * (prm.ndim - 1) + (1,), base_addr_divisible_by=16,
                                        **facts))
        elif prm.kind == "scalar":
            if prm.dtype not in scalars:
                raise InternalError(f"AOT scalar {prm.name} of dtype {prm.dtype}: TensorRT passes 32-bit extras only")
            cons.append(ScalarConstraint(scalars[prm.dtype]))
        else:
            cons.append(prm.value)
    return KernelSignature(cons, CallingConvention.cutile_python_v1())


def _export_cubin(spec: Any, gpu_code: str, dims: Mapping[str, Sequence[int | None]] | None = None
                  ) -> tuple[bytes, None]:
    from cuda.tile.compilation import export_kernel

    buf = io.BytesIO()
    export_kernel(spec.kernel, [trt_signature(spec, dims)], buf, gpu_code=gpu_code, output_format="cubin")
    return buf.getvalue(), None  # the entry symbol is read from the PTX (one entry per export)


def build_aot_kernel(spec: Any, cubin: bytes, symbol: str | None, *, gpu_code: str,
                     ptx_isa: tuple[int, int] | None = None, inputs: Sequence[str] = INPUT_NAMES,
                     outputs: Sequence[str] = OUTPUT_NAMES) -> AotKernel:
    """Turn an exported cubin of ``spec`` (a :class:`~m2export.kernels.launch.Launch` with a symbolic grid)
    into an :class:`AotKernel`.

    Checks the entry against ``spec.flat_args()`` and the kernel's own signature, and reorders it to
    TensorRT's convention for a plugin with ``inputs`` / ``outputs`` (default: SSMScan's); ``ptx_isa``
    (explicit opt-in) rewrites the ``.version`` header.
    """
    from m2export.kernels.launch import kernel_params

    ptx = ptx_from_cubin(cubin)
    entry = parse_entry(ptx)
    if symbol is not None and entry.name != symbol:
        raise InternalError(f"exported entry {entry.name!r} is not the requested symbol {symbol!r}")
    amap = argument_map(spec.flat_args(), inputs, outputs, sources=spec.sources(), views=spec.views())
    scalars = spec.scalars()
    check_entry(entry, amap, {k: v[0] for k, v in scalars.items()},
                [n for n, kind in kernel_params(spec.kernel) if kind != "constant"])
    ptx = reorder_entry_params(ptx, entry, amap.order)
    if ptx_isa is not None:
        ptx = set_ptx_version(ptx, ptx_isa)
    block = required_threads(ptx)
    if block is None:  # cuTile always emits one; without it the launch block size would be a guess
        raise InternalError(f"kernel {entry.name}: no .reqntid in the PTX; cannot tell TensorRT the block size")
    return AotKernel(entry.name, ptx, block, amap, spec.grid, scalars, gpu_code)


@functools.lru_cache(maxsize=32)
def compile_aot_kernel(nheads: int, headdim: int, ngroups: int, d_state: int, dtype: str, attrs: SSMScanAttrs,
                       gpu_code: str, ptx_isa: tuple[int, int] | None = None, decode: bool = False,
                       tiles: Any = None, step_tile: tuple[int, int | None] | None = None) -> AotKernel:
    """Export the cuTile kernel for these static sizes and return it as an :class:`AotKernel`.

    ``decode`` (the graph's seqlen is the constant 1): the decode-step kernel
    (:func:`m2export.kernels.ssd_step.cutile.aot_spec`); otherwise the single-launch SSD kernel
    (:func:`m2export.kernels.ssd.cutile.aot_spec`). batch (and seqlen) are runtime extents, so one
    export serves every profile; the result is cached per (sizes, dtype, attributes, target, decode,
    tiles), since TensorRT asks once per layer and tactic. ``tiles``: a tactic's
    :class:`~m2export.kernels.ssd.plan.TileFamily` (prefill only; None: the default tiles). ``step_tile``:
    (block_p, occupancy hint or None) of the decode kernel instead of its default rule (decode only; tile
    sweeps and their tests).
    """
    if (tiles is not None and decode) or (step_tile is not None and not decode):
        raise InternalError("compile_aot_kernel: `tiles` is for the prefill kernel, `step_tile` for the decode one")
    if decode:
        from m2export.kernels.ssd_step.cutile import aot_spec
    else:
        from m2export.kernels.ssd.cutile import aot_spec

    problem = SSMScanProblem(batch=1, seqlen=1, nheads=nheads, headdim=headdim, ngroups=ngroups,
                             d_state=d_state, dtype=dtype)
    if step_tile is not None:
        spec = aot_spec(problem, attrs, block_p=step_tile[0], occupancy=step_tile[1])
    else:
        spec = aot_spec(problem, attrs) if tiles is None else aot_spec(problem, attrs, tiles=tiles)
    cubin, symbol = _export_cubin(spec, gpu_code, contract_dims(nheads, headdim, ngroups, d_state, decode=decode))
    return build_aot_kernel(spec, cubin, symbol, gpu_code=gpu_code, ptx_isa=ptx_isa)


def constant_size(value: Any) -> int | None:
    """The value of an int or a constant TensorRT ``ShapeExpr``; None when it is only known at run time."""
    if isinstance(value, int):
        return value
    is_const = getattr(value, "is_constant", None)
    if callable(is_const) and is_const():
        return int(value.constant_value())
    return None


def static_size(value: Any, what: str) -> int:
    """An int from an int or a constant TensorRT ``ShapeExpr`` (``is_constant``/``constant_value``)."""
    v = constant_size(value)
    if v is None:
        raise BackendUnavailable(f"SSMScan AOT plugin: {what} must be static (a fixed size in the ONNX graph), "
                                 f"got {value}",
                                 hint="build with the JIT plugin (`plugin='jit'`) for graphs with dynamic "
                                      "nheads/headdim/ngroups/d_state")
    return v


__all__ = ["ArgumentMap", "AotKernel", "PTX_SECTION", "PtxEntry", "argument_map", "build_aot_kernel",
           "check_entry", "check_target", "compile_aot_kernel", "constant_size", "contract_dims", "cubin_sections",
           "divisibility_facts", "extra_arg_values",
           "float32_bits", "gpu_code_for", "scalar_arg", "parse_entry", "ptx_from_cubin", "ptx_target", "ptx_version",
           "reorder_entry_params", "required_threads", "set_ptx_version", "static_size", "trt_signature"]
