"""The CausalConv1d contract: the one definition of op ``m2export::CausalConv1d`` version 1
(depthwise causal conv1d with state, + optional SiLU), prefill and single-token update.

Everything that produces or consumes the op imports this module: the kernels and the PyTorch
references call :func:`validate` / :func:`validate_update`; tests draw their inputs from
:class:`Conv1dProblem`. Layout follows the in_proj output of Mamba-2 (channels last), so ``x``
may be a strided slice of that output (last stride 1).

Semantics (mamba_ssm/modules/mamba2.py ``Mamba2.forward`` and ``step``; the kernel of
Dao-AILab/causal-conv1d ``causal_conv1d_fn`` / ``causal_conv1d_update``). Per batch b, channel c,
token t, with the padded input ``xp[b, c] = concat(conv_state[b, c], x[b, :, c])`` of length
``d_conv - 1 + seqlen``::

    y[b, t, c]            = act(bias[c] + sum_{k < d_conv} weight[c, k] * xp[b, c, t + k])
    final_conv_state[b, c] = xp[b, c, seqlen : seqlen + d_conv - 1]      # the last d_conv-1 inputs

with ``act = silu`` when ``activation`` is "silu", identity when "none"; ``conv_state`` None
means zeros. The update (``seqlen`` 1, no seqlen axis) is the same formula applied to one token,
with the state shifted by one in place.
"""

from __future__ import annotations

from dataclasses import dataclass

from m2export.contract import FLOAT_DTYPES, AttributeSpec, TensorSpec, check_specs, dtype_name
from m2export.errors import ContractError

OP_NAME = "CausalConv1d"
OP_DOMAIN = "m2export"
OP_VERSION = 1

D_CONV_RANGE = (2, 4)
"""d_conv the kernels and the op accept (inclusive): every Mamba-2 checkpoint and hybrid uses 4."""

INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("x", ("batch", "seqlen", "conv_dim"), "x", False,
               "conv input (xBC of the in_proj output), channels last; last stride 1"),
    TensorSpec("weight", ("conv_dim", "d_conv"), "x", False, "depthwise taps, oldest first"),
    TensorSpec("bias", ("conv_dim",), "x", True, "per-channel bias (None: 0)"),
    TensorSpec("conv_state", ("batch", "conv_dim", "d_conv_m1"), "x", True,
               "the d_conv-1 inputs before token 0, oldest first (None: zeros)"),
)
OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("y", ("batch", "seqlen", "conv_dim"), "x", False, "act(conv), contiguous"),
    TensorSpec("final_conv_state", ("batch", "conv_dim", "d_conv_m1"), "x", False,
               "the last d_conv-1 inputs (of conv_state, then x)"),
)
INPUT_NAMES = tuple(s.name for s in INPUTS)
OUTPUT_NAMES = tuple(s.name for s in OUTPUTS)
ACTIVATIONS = ("silu", "none")
ATTRIBUTES: tuple[AttributeSpec, ...] = (
    AttributeSpec("activation", "string", "silu", "silu: y = silu(conv); none: y = conv"),
)


@dataclass(frozen=True)
class Conv1dProblem:
    """Sizes and dtype of one CausalConv1d call (``seqlen`` 1 for the update)."""

    batch: int
    seqlen: int
    conv_dim: int
    d_conv: int
    dtype: str = "float32"

    def __post_init__(self):
        for f in ("batch", "seqlen", "conv_dim", "d_conv"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < (0 if f in ("batch", "seqlen") else 1):
                raise ContractError(f"{f}: expected a positive integer, got {v!r}")
        lo, hi = D_CONV_RANGE
        if not lo <= self.d_conv <= hi:
            raise ContractError(f"d_conv: expected {lo} <= d_conv <= {hi}, got {self.d_conv}")
        if self.dtype not in FLOAT_DTYPES:
            raise ContractError(f"dtype: expected one of {FLOAT_DTYPES}, got {self.dtype!r}")

    def sizes(self) -> dict[str, int]:
        return {"batch": self.batch, "seqlen": self.seqlen, "conv_dim": self.conv_dim, "d_conv": self.d_conv,
                "d_conv_m1": self.d_conv - 1}

    def shape_of(self, name: str) -> tuple[int, ...]:
        """Concrete shape of input/output ``name`` (prefill layout) for this problem."""
        s = self.sizes()
        return tuple(s[d] for d in _SPEC_BY_NAME[name].dims)


_SPEC_BY_NAME = {s.name: s for s in INPUTS + OUTPUTS}


def check_activation(activation: str) -> str:
    """Return ``activation`` if it is one of :data:`ACTIVATIONS`, else raise ContractError."""
    if activation not in ACTIVATIONS:
        raise ContractError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    return activation


def validate(x, weight, bias=None, conv_state=None) -> Conv1dProblem:
    """Check prefill arguments against the contract and return their :class:`Conv1dProblem`.

    Accepts torch tensors (``x`` may be strided: any batch/seqlen strides, last stride 1).

    Raises:
        ContractError: naming the argument, its expected shape in symbols (sizes fixed by earlier
            arguments filled in) and its actual shape, dtype or stride; d_conv outside 2..4.
    """
    xdtype = dtype_name(x.dtype)
    if xdtype not in FLOAT_DTYPES:
        raise ContractError(f"x: expected dtype in {FLOAT_DTYPES}, got {xdtype}")
    sizes: dict = dict.fromkeys(("batch", "seqlen", "conv_dim", "d_conv", "d_conv_m1"))
    args = dict(x=x, weight=weight, bias=bias, conv_state=conv_state)
    check_specs(INPUTS[:3], args, sizes, xdtype)
    sizes["d_conv_m1"] = sizes["d_conv"] - 1
    check_specs(INPUTS[3:], args, sizes, xdtype)
    if x.dim() == 3 and x.shape[-1] > 1 and x.numel() and x.stride(-1) != 1:
        raise ContractError(f"x: expected last stride 1 (channels contiguous), got strides {tuple(x.stride())}")
    return Conv1dProblem(batch=sizes["batch"], seqlen=sizes["seqlen"], conv_dim=sizes["conv_dim"],
                         d_conv=sizes["d_conv"], dtype=xdtype)


def validate_update(x, conv_state, weight, bias=None) -> Conv1dProblem:
    """Check single-token update arguments: x (batch, conv_dim), conv_state (batch, conv_dim,
    d_conv-1) (required: it is updated in place), weight, bias. Returns the seqlen-1 problem.

    Raises:
        ContractError: as :func:`validate` (x must be 2-D here).
    """
    if x.dim() != 2:
        raise ContractError(f"x: expected a 2-D (batch, conv_dim) tensor for the update, got shape {tuple(x.shape)}")
    if conv_state is None:
        raise ContractError("conv_state: required for the update (it is updated in place), got None")
    return validate(x[:, None], weight, bias, conv_state)


def output_shapes(x_shape, weight_shape):
    """Shape rule: ``y`` is (batch, seqlen, conv_dim); ``final_conv_state`` (batch, conv_dim, d_conv - 1).
    Works on ints or symbolic dims that support ``- 1``."""
    return (x_shape[0], x_shape[1], x_shape[2]), (x_shape[0], x_shape[2], weight_shape[1] - 1)
