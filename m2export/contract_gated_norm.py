"""The GatedRMSNorm contract: the one definition of op ``m2export::GatedRMSNorm`` version 1
(RMSNorm per group of channels, gated by silu(z)).

The kernels and the PyTorch reference call :func:`validate`; tests draw their inputs from
:class:`GatedNormProblem`.

Semantics (mamba_ssm/ops/triton/layernorm_gated.py ``rmsnorm_fn`` / ``rms_norm_ref`` with
``group_size = d_inner // ngroups``, no bias). Per row r (every leading index) and group g of
``group_size`` consecutive channels, in float32::

    norm_before_gate = False (Mamba-2):  u = x * silu(z);  out = u * rsqrt(mean_g(u^2) + eps) * weight
    norm_before_gate = True:             out = x * rsqrt(mean_g(x^2) + eps) * weight * silu(z)

``mean_g`` is the mean over the row's group; ``out`` has the dtype of ``x``. With ngroups = 1 this
is transformers' ``MambaRMSNormGated``; ngroups > 1 (Nemotron-H: 8) normalises each group alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from m2export.contract import FLOAT_DTYPES, AttributeSpec, TensorSpec, dtype_name
from m2export.errors import ContractError

OP_NAME = "GatedRMSNorm"
OP_DOMAIN = "m2export"
OP_VERSION = 1

INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("x", ("rows...", "d_inner"), "x", False, "scan output y, last stride 1"),
    TensorSpec("z", ("rows...", "d_inner"), "x", False, "gate (z of the in_proj output), last stride 1"),
    TensorSpec("weight", ("d_inner",), "x", False, "per-channel scale"),
)
OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("out", ("rows...", "d_inner"), "x", False, "normalised, gated; contiguous"),
)
INPUT_NAMES = tuple(s.name for s in INPUTS)
OUTPUT_NAMES = tuple(s.name for s in OUTPUTS)
ATTRIBUTES: tuple[AttributeSpec, ...] = (
    AttributeSpec("group_size", "int", 0, "channels per group, divides d_inner (0: d_inner, one group)"),
    AttributeSpec("eps", "float", 1e-5, "added to the mean square, > 0"),
    AttributeSpec("norm_before_gate", "int", 0, "1: norm then gate; 0: gate then norm (Mamba-2)"),
)
ATTRIBUTE_NAMES = tuple(a.name for a in ATTRIBUTES)


@dataclass(frozen=True)
class GatedNormProblem:
    """Sizes, dtype and attributes of one GatedRMSNorm call; ``rows`` = product of the leading dims."""

    rows: int
    d_inner: int
    group_size: int
    eps: float = 1e-5
    norm_before_gate: bool = False
    dtype: str = "float32"

    def __post_init__(self):
        if not isinstance(self.rows, int) or self.rows < 0:
            raise ContractError(f"rows: expected an integer >= 0, got {self.rows!r}")
        for f in ("d_inner", "group_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ContractError(f"{f}: expected a positive integer, got {v!r}")
        if self.d_inner % self.group_size:
            raise ContractError(f"group_size: expected a divisor of d_inner={self.d_inner}, got {self.group_size}")
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise ContractError(f"eps: expected a finite number > 0, got {self.eps!r}")
        if self.dtype not in FLOAT_DTYPES:
            raise ContractError(f"dtype: expected one of {FLOAT_DTYPES}, got {self.dtype!r}")

    @property
    def ngroups(self) -> int:
        return self.d_inner // self.group_size

    def onnx_attributes(self) -> dict:
        return {"group_size": int(self.group_size), "eps": float(self.eps),
                "norm_before_gate": int(bool(self.norm_before_gate))}


def validate(x, z, weight, *, group_size: int | None = None, eps: float = 1e-5,
             norm_before_gate: bool = False) -> GatedNormProblem:
    """Check GatedRMSNorm arguments and return their :class:`GatedNormProblem`.

    ``x`` and ``z``: same shape (..., d_inner), dtype in FLOAT_DTYPES, last stride 1 (other strides
    free: z is usually a slice of the in_proj output); ``weight``: (d_inner,), dtype of x.
    ``group_size`` None or 0: d_inner.

    Raises:
        ContractError: naming the argument, the expected shape/dtype/stride and the actual one.
    """
    xdtype = dtype_name(x.dtype)
    if xdtype not in FLOAT_DTYPES:
        raise ContractError(f"x: expected dtype in {FLOAT_DTYPES}, got {xdtype}")
    if x.dim() < 1:
        raise ContractError(f"x: expected (..., d_inner), got shape {tuple(x.shape)}")
    d_inner = int(x.shape[-1])
    if tuple(z.shape) != tuple(x.shape):
        raise ContractError(f"z: expected the shape of x {tuple(x.shape)}, got {tuple(z.shape)}")
    if tuple(weight.shape) != (d_inner,):
        raise ContractError(f"weight: expected (d_inner={d_inner},), got {tuple(weight.shape)}")
    for name, t in (("z", z), ("weight", weight)):
        if dtype_name(t.dtype) != xdtype:
            raise ContractError(f"{name}: expected dtype {xdtype} (the dtype of x), got {dtype_name(t.dtype)}")
    for name, t in (("x", x), ("z", z)):
        if d_inner > 1 and t.numel() and t.stride(-1) != 1:
            raise ContractError(f"{name}: expected last stride 1, got strides {tuple(t.stride())}")
    rows = x.numel() // d_inner if d_inner else 0
    return GatedNormProblem(rows=rows, d_inner=d_inner, group_size=int(group_size or d_inner), eps=float(eps),
                            norm_before_gate=bool(norm_before_gate), dtype=xdtype)
