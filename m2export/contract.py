"""The SSMScan contract: the one definition of op ``m2export::SSMScan`` version 1.

Everything that produces or consumes the op imports this module: the ONNX exporter builds
the node from :data:`INPUTS`, :data:`OUTPUTS` and :data:`ATTRIBUTES`; the TensorRT plugin's
shape and dtype rules are :func:`output_shapes` and :func:`output_dtypes`; the kernels and the
PyTorch references call :func:`validate`; tests draw their inputs from :class:`SSMScanProblem`.

Semantics (Dao & Gu, "Transformers are SSMs", arXiv:2405.21060, Sec. 3 and 6; the argument
order of ``mamba_ssm/ops/triton/ssd_combined.py::mamba_chunk_scan_combined``). Per batch b,
head h (group g = h // (nheads // ngroups)) and token t::

    dt_t    = clamp(softplus(dt[b,t,h] + dt_bias[h]) if dt_softplus else dt[b,t,h] + dt_bias[h],
                    dt_min, dt_max)                                   # step size, > 0
    state_t = exp(dt_t * A[h]) * state_{t-1} + dt_t * outer(x[b,t,h], B[b,t,g])   # (headdim, d_state)
    y[b,t,h] = state_t @ C[b,t,g] + D[h] * x[b,t,h]

with ``state_{-1} = initial_state[b,h]`` and ``final_state[b,h] = state_{seqlen-1}``.
``chunk_size`` only changes the evaluation order (the chunked SSD algorithm), never the
result beyond float32 rounding: an implementation may choose its own chunking. This holds
because every step decays: ``A <= 0`` is required (``A = -exp(A_log)``) and the step size is
clamped at ``dt_min >= 0`` (also with ``dt_softplus=0``). The references reject ``A > 0``
with ContractError; kernels do not inspect values (that would need a device sync).

In an ONNX graph all eight inputs are always present (the exporter materialises ``D``,
``dt_bias`` and ``initial_state`` as zeros when a model has none); in the Python API
``D``, ``dt_bias`` and ``initial_state`` may be ``None``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from m2export.errors import ContractError

OP_NAME = "SSMScan"
OP_DOMAIN = "m2export"
OP_VERSION = 1
#: Node attributes that make TensorRT (>= 10.7) pick the registered plugin m2export::SSMScan v1.
PLUGIN_NAMESPACE = "m2export"
PLUGIN_VERSION = "1"

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
"""dtypes of ``x``/``dt``/``B``/``C`` (all four share one) and of ``y``."""


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of SSMScan.

    ``dims`` are symbol names; ``dtype`` is ``"x"`` (same dtype as input ``x``, one of
    :data:`FLOAT_DTYPES`) or ``"float32"``.
    """

    name: str
    dims: tuple[str, ...]
    dtype: str
    optional: bool
    doc: str


INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("x", ("batch", "seqlen", "nheads", "headdim"), "x", False,
               "SSM input after conv1d + SiLU"),
    TensorSpec("dt", ("batch", "seqlen", "nheads"), "x", False,
               "raw step size, before dt_bias and softplus"),
    TensorSpec("A", ("nheads",), "float32", False, "continuous decay rate, A = -exp(A_log) < 0"),
    TensorSpec("B", ("batch", "seqlen", "ngroups", "d_state"), "x", False, "input projection"),
    TensorSpec("C", ("batch", "seqlen", "ngroups", "d_state"), "x", False, "output projection"),
    TensorSpec("D", ("nheads",), "float32", True, "skip weight (None: no skip)"),
    TensorSpec("dt_bias", ("nheads",), "float32", True, "added to dt before softplus (None: 0)"),
    TensorSpec("initial_state", ("batch", "nheads", "headdim", "d_state"), "float32", True,
               "ssm_state before token 0 (None: zeros)"),
)
OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("y", ("batch", "seqlen", "nheads", "headdim"), "x", False, "scan output"),
    TensorSpec("final_state", ("batch", "nheads", "headdim", "d_state"), "float32", False,
               "ssm_state after the last token"),
)
INPUT_NAMES = tuple(s.name for s in INPUTS)
OUTPUT_NAMES = tuple(s.name for s in OUTPUTS)


@dataclass(frozen=True)
class AttributeSpec:
    name: str
    type: str  # "int" | "float" | "string"
    default: Any
    doc: str


ATTRIBUTES: tuple[AttributeSpec, ...] = (
    AttributeSpec("chunk_size", "int", 256, "tokens per chunk (evaluation order only), >= 1"),
    AttributeSpec("dt_softplus", "int", 1, "1: dt = softplus(dt + dt_bias); 0: dt = dt + dt_bias"),
    AttributeSpec("dt_min", "float", 0.0, "lower clamp on the step size after softplus"),
    AttributeSpec("dt_max", "float", math.inf, "upper clamp on the step size after softplus"),
)
ATTRIBUTE_NAMES = tuple(a.name for a in ATTRIBUTES)


@dataclass(frozen=True)
class SSMScanAttrs:
    """Attribute values of one SSMScan node (defaults from :data:`ATTRIBUTES`)."""

    chunk_size: int = 256
    dt_softplus: bool = True
    dt_min: float = 0.0
    dt_max: float = math.inf

    def __post_init__(self):
        if not isinstance(self.chunk_size, int) or isinstance(self.chunk_size, bool) or self.chunk_size < 1:
            raise ContractError(f"chunk_size: expected an integer >= 1, got {self.chunk_size!r}")
        if not isinstance(self.dt_softplus, bool):
            raise ContractError(f"dt_softplus: expected True or False, got {self.dt_softplus!r}")
        for name in ("dt_min", "dt_max"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ContractError(f"dt_limit: {name} must be a number, got {v!r}")
        if not math.isfinite(self.dt_min):
            raise ContractError(f"dt_limit: expected a finite dt_min, got {self.dt_min}")
        if not (self.dt_min <= self.dt_max) or self.dt_min < 0 or math.isnan(self.dt_min):
            raise ContractError(
                f"dt_limit: expected 0 <= dt_min <= dt_max, got dt_min={self.dt_min}, dt_max={self.dt_max}")

    @classmethod
    def make(cls, *, chunk_size: int = 256, dt_softplus: bool = True,
             dt_limit=(0.0, math.inf)) -> "SSMScanAttrs":
        """Attributes from the Python API's keywords; ``dt_limit`` must be a (dt_min, dt_max) pair.

        Raises:
            ContractError: malformed dt_limit or chunk_size.
        """
        try:
            lo, hi = dt_limit
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (lo, hi)):
                raise TypeError
            lo, hi = float(lo), float(hi)
        except (TypeError, ValueError):
            raise ContractError(f"dt_limit: expected (dt_min, dt_max), two numbers, got {dt_limit!r}") from None
        if dt_softplus not in (True, False) or not isinstance(dt_softplus, (bool, int)):  # "no" is truthy: refuse
            raise ContractError(f"dt_softplus: expected True or False, got {dt_softplus!r}")
        return cls(chunk_size=chunk_size, dt_softplus=bool(dt_softplus), dt_min=lo, dt_max=hi)

    @property
    def dt_limit(self) -> tuple[float, float]:
        return (self.dt_min, self.dt_max)

    def onnx_attributes(self) -> dict[str, Any]:
        """Attribute dict for the ONNX node (ints/floats as ONNX stores them, inf kept as inf)."""
        return {"chunk_size": int(self.chunk_size), "dt_softplus": int(bool(self.dt_softplus)),
                "dt_min": float(self.dt_min), "dt_max": float(self.dt_max)}

    @classmethod
    def from_onnx_attributes(cls, attrs: dict[str, Any]) -> "SSMScanAttrs":
        unknown = set(attrs) - set(ATTRIBUTE_NAMES) - {"plugin_namespace", "plugin_version"}
        if unknown:
            raise ContractError(f"SSMScan: unknown attribute(s) {sorted(unknown)}; expected {list(ATTRIBUTE_NAMES)}")
        for name, want in (("plugin_namespace", PLUGIN_NAMESPACE), ("plugin_version", PLUGIN_VERSION)):
            got = attrs.get(name, want)
            got = got.decode() if isinstance(got, bytes) else got
            if got != want:
                raise ContractError(f"SSMScan: attribute {name}={got!r}; this m2export implements {want!r}")
        if attrs.get("dt_softplus", 1) not in (0, 1) or isinstance(attrs.get("dt_softplus", 1), (bool, float)):
            raise ContractError(f"SSMScan: attribute dt_softplus={attrs['dt_softplus']!r}; expected 0 or 1")
        return cls(chunk_size=int(attrs.get("chunk_size", 256)),
                   dt_softplus=bool(int(attrs.get("dt_softplus", 1))),
                   dt_min=float(attrs.get("dt_min", 0.0)), dt_max=float(attrs.get("dt_max", math.inf)))


@dataclass(frozen=True)
class SSMScanProblem:
    """Sizes and dtype of one SSMScan call; heads map to groups in contiguous blocks.

    ``head_to_group(h) = h // (nheads // ngroups)`` (i.e. ``B.repeat_interleave(nheads // ngroups, dim=2)``).
    """

    batch: int
    seqlen: int
    nheads: int
    headdim: int
    ngroups: int
    d_state: int
    dtype: str = "float32"

    def __post_init__(self):
        for f in ("batch", "seqlen", "nheads", "headdim", "ngroups", "d_state"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < (0 if f in ("batch", "seqlen") else 1):
                raise ContractError(f"{f}: expected a positive integer, got {v!r}")
        if self.nheads % self.ngroups:
            raise ContractError(
                f"nheads % ngroups must be 0 (heads map to groups in contiguous blocks), "
                f"got nheads={self.nheads}, ngroups={self.ngroups}")
        if self.dtype not in FLOAT_DTYPES:
            raise ContractError(f"dtype: expected one of {FLOAT_DTYPES}, got {self.dtype!r}")

    @property
    def heads_per_group(self) -> int:
        return self.nheads // self.ngroups

    def sizes(self) -> dict[str, int]:
        return {"batch": self.batch, "seqlen": self.seqlen, "nheads": self.nheads,
                "headdim": self.headdim, "ngroups": self.ngroups, "d_state": self.d_state}

    def shape_of(self, name: str) -> tuple[int, ...]:
        """Concrete shape of input/output ``name`` for this problem."""
        spec = _SPEC_BY_NAME[name]
        s = self.sizes()
        return tuple(s[d] for d in spec.dims)

    def dtype_of(self, name: str) -> str:
        spec = _SPEC_BY_NAME[name]
        return self.dtype if spec.dtype == "x" else spec.dtype


_SPEC_BY_NAME = {s.name: s for s in INPUTS + OUTPUTS}


def dtype_name(dtype: Any) -> str:
    """'float32' for torch.float32, numpy float32, or the string itself."""
    s = str(dtype)
    for prefix in ("torch.", "<class 'numpy.", "DataType."):
        if s.startswith(prefix):
            s = s[len(prefix):]
    s = s.rstrip("'>")
    return {"float": "float32", "half": "float16", "FLOAT": "float32", "HALF": "float16",
            "BF16": "bfloat16", "INT32": "int32"}.get(s, s)


def _fmt_expected(spec: TensorSpec, sizes: dict[str, int | None]) -> str:
    parts = [f"{d}={sizes[d]}" if sizes.get(d) is not None else d for d in spec.dims]
    return "(" + ", ".join(parts) + ")"


def check_specs(specs: Sequence[TensorSpec], args: dict, sizes: dict, xdtype: str) -> None:
    """Check each tensor of ``args`` (by spec name) against its :class:`TensorSpec`, in order: present
    unless optional, rank, every dim against ``sizes`` (a symbol still None is fixed by the first
    tensor that has it; ``sizes`` is updated in place), dtype (``"x"``: ``xdtype``). Shared by the
    contracts of every op (SSMScan here, m2export/contract_conv1d.py).

    Raises:
        ContractError: naming the argument, the expected shape in symbols (sizes fixed so far filled
            in) and its actual shape, or the expected and actual dtype.
    """
    for spec in specs:
        t = args[spec.name]
        if t is None:
            if not spec.optional:
                raise ContractError(f"{spec.name}: required input is None")
            continue
        shape = tuple(int(d) for d in t.shape)
        if len(shape) != len(spec.dims):
            raise ContractError(
                f"{spec.name}: expected {len(spec.dims)}-D {_fmt_expected(spec, sizes)}, got shape {shape}")
        for sym, n in zip(spec.dims, shape):
            if sizes.get(sym) is None:
                sizes[sym] = n
            elif sizes[sym] != n:
                raise ContractError(
                    f"{spec.name}: expected {_fmt_expected(spec, sizes)}, got {shape} ({sym} mismatch)")
        want = xdtype if spec.dtype == "x" else spec.dtype
        got = dtype_name(t.dtype)
        if got != want:
            raise ContractError(
                f"{spec.name}: expected dtype {want}" + (" (the dtype of x)" if spec.dtype == "x" else "")
                + f", got {got}")


def validate(x, dt, A, B, C, D=None, dt_bias=None, initial_state=None) -> SSMScanProblem:
    """Check SSMScan arguments against the contract and return their :class:`SSMScanProblem`.

    Accepts any objects with ``.shape`` and ``.dtype`` (torch tensors, numpy arrays).

    Raises:
        ContractError: naming the argument, its expected shape in symbols (with the sizes
            already fixed by earlier arguments) and its actual shape or dtype.
    """
    args = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias, initial_state=initial_state)
    sizes: dict[str, int | None] = dict.fromkeys(("batch", "seqlen", "nheads", "headdim", "ngroups", "d_state"))
    xdtype = dtype_name(x.dtype)
    if xdtype not in FLOAT_DTYPES:
        raise ContractError(f"x: expected dtype in {FLOAT_DTYPES}, got {xdtype}")
    check_specs(INPUTS, args, sizes, xdtype)
    if sizes["nheads"] % sizes["ngroups"]:
        raise ContractError(
            f"B: expected (batch, seqlen, ngroups, d_state) with nheads % ngroups == 0, "
            f"got ngroups={sizes['ngroups']} and nheads={sizes['nheads']}")
    return SSMScanProblem(dtype=xdtype, **sizes)  # type: ignore[arg-type]


def output_shapes(x_shape: Sequence[Any], B_shape: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Shape rule: ``y`` is shaped like ``x``; ``final_state`` is (batch, nheads, headdim, d_state).

    Works on any indexable dims (ints, or TensorRT ``ShapeExpr`` items), so the plugin's
    ``@register`` function calls it unchanged.
    """
    batch, nheads, headdim = x_shape[0], x_shape[2], x_shape[3]  # x_shape[1] is seqlen
    d_state = B_shape[3]
    return tuple(x_shape[i] for i in range(4)), (batch, nheads, headdim, d_state)


def output_dtypes(x_dtype: Any) -> tuple[Any, str]:
    """Dtype rule: ``y`` has the dtype of ``x``; ``final_state`` is float32."""
    return x_dtype, "float32"


def input_dtype_combinations(packed: bool = False) -> list[dict[str, str]]:
    """Every supported assignment of dtypes to inputs and outputs (one per x dtype); ``packed``: of
    :data:`PACKED_OP_NAME` (``cu_seqlens`` int32)."""
    specs = PACKED_INPUTS + PACKED_OUTPUTS if packed else INPUTS + OUTPUTS
    combos = []
    for xd in FLOAT_DTYPES:
        combos.append({s.name: (xd if s.dtype == "x" else s.dtype) for s in specs})
    return combos


# ----------------------------------------------------------------------------- packed variable-length prefill
CU_SEQLENS = TensorSpec("cu_seqlens", ("nseq_plus_1",), "int32", True,
                        "packed prefill: sequence s is tokens [cu_seqlens[s], cu_seqlens[s+1]) of batch row 0")
"""Optional input of the packed (variable-length) form of SSMScan (issue 14): batch 1, the sequences of a
continuous-batching prefill laid end to end along ``seqlen``. ``cu_seqlens`` (nseq + 1,) int32 starts at 0,
is non-decreasing and ends at seqlen (empty sequences allowed). Each sequence is scanned on its own: no
state crosses a boundary (chunks that straddle one must not leak it), ``initial_state`` is
(nseq, nheads, headdim, d_state) and ``final_state`` (nseq, nheads, headdim, d_state), the state after
each sequence's last token (its initial state, or zeros, when it is empty)."""


PACKED_OP_NAME = "SSMScanPacked"
"""ONNX op type (domain :data:`OP_DOMAIN`, version :data:`OP_VERSION`) and TensorRT plugin name of the packed form:
the inputs of SSMScan with ``initial_state`` per sequence (required) and :data:`CU_SEQLENS` last, attributes
:data:`ATTRIBUTES`. A second op type rather than an optional ninth input: an ONNX function cannot branch on
whether an optional input is present, and the two forms differ in the meaning of the state's first dim."""

PACKED_INPUTS: tuple[TensorSpec, ...] = INPUTS[:7] + (
    TensorSpec("initial_state", ("nseq", "nheads", "headdim", "d_state"), "float32", False,
               "ssm_state before each sequence's first token (zeros for a fresh request)"),
    CU_SEQLENS,
)
PACKED_OUTPUTS: tuple[TensorSpec, ...] = (
    OUTPUTS[0],
    TensorSpec("final_state", ("nseq", "nheads", "headdim", "d_state"), "float32", False,
               "ssm_state after each sequence's last token (its initial state when the sequence is empty)"),
)
PACKED_INPUT_NAMES = tuple(s.name for s in PACKED_INPUTS)
PACKED_OUTPUT_NAMES = tuple(s.name for s in PACKED_OUTPUTS)


def validate_packed(x, dt, A, B, C, D=None, dt_bias=None, initial_state=None, *, cu_seqlens) -> tuple:
    """Check the packed form's shapes and dtypes; returns (:class:`SSMScanProblem` of the packed batch, nseq).

    Values of ``cu_seqlens`` need the host (see :func:`check_cu_seqlens`).

    Raises:
        ContractError: naming the argument and what was expected.
    """
    shape = tuple(int(d) for d in cu_seqlens.shape)
    if len(shape) != 1 or shape[0] < 2:
        raise ContractError(f"cu_seqlens: expected a 1-D tensor of nseq + 1 >= 2 offsets, got shape {shape}")
    if dtype_name(cu_seqlens.dtype) != "int32":
        raise ContractError(f"cu_seqlens: expected dtype int32, got {dtype_name(cu_seqlens.dtype)}")
    nseq = shape[0] - 1
    p = validate(x, dt, A, B, C, D, dt_bias, None)
    if p.batch != 1:
        raise ContractError(f"x: packed prefill (cu_seqlens given) expects batch 1, got batch {p.batch}")
    if initial_state is not None:
        want = (nseq, p.nheads, p.headdim, p.d_state)
        got = tuple(int(d) for d in initial_state.shape)
        if got != want or dtype_name(initial_state.dtype) != "float32":
            raise ContractError(f"initial_state: expected float32 (nseq, nheads, headdim, d_state) = {want} with "
                                f"cu_seqlens, got {dtype_name(initial_state.dtype)} {got}")
    return p, nseq


def check_cu_seqlens(offsets: Sequence[int], seqlen: int) -> list[int]:
    """Raise ContractError unless ``offsets`` start at 0, never decrease and end at ``seqlen``; returns them as ints."""
    cu = [int(v) for v in offsets]
    if cu[0] != 0 or cu[-1] != seqlen or any(b < a for a, b in zip(cu, cu[1:])):
        raise ContractError(f"cu_seqlens: expected non-decreasing offsets from 0 to seqlen={seqlen}, got "
                            f"{cu if len(cu) <= 12 else cu[:6] + ['...'] + cu[-3:]}")
    return cu


def packed_output_shapes(x_shape: Sequence[Any], B_shape: Sequence[Any],
                         cu_seqlens_shape: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Shape rule of the packed form: ``y`` like ``x``; ``final_state`` (nseq, nheads, headdim, d_state) with
    nseq = cu_seqlens_shape[0] - 1 (ints or TensorRT ``ShapeExpr`` items, which support ``-``)."""
    y, fs = output_shapes(x_shape, B_shape)
    return y, (cu_seqlens_shape[0] - 1, *fs[1:])
