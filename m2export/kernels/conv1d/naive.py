"""Plain-PyTorch references of CausalConv1d (m2export/contract_conv1d.py): prefill and single-token update.

Imports only torch, so CPU CI and the exporter can use them. ``dtype=torch.float64`` makes them the
float64 oracle of the kernel tests (inputs upcast, outputs left in float64).
Source: mamba_ssm/modules/mamba2.py (``Mamba2.forward``: F.conv1d over concat(conv_state, xBC);
``Mamba2.step``: roll the state, sum(state * weight)).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from m2export.contract_conv1d import check_activation, validate, validate_update


class Conv1dOutput(NamedTuple):
    """y (batch, seqlen, conv_dim) [or (batch, conv_dim) for the update]; final_conv_state (batch, conv_dim, d_conv-1)."""

    y: torch.Tensor
    final_conv_state: torch.Tensor


def _act(v: torch.Tensor, activation: str) -> torch.Tensor:
    return F.silu(v) if activation == "silu" else v


def causal_conv1d_ref(x, weight, bias=None, conv_state=None, *, activation: str = "silu",
                      dtype: torch.dtype | None = None) -> Conv1dOutput:
    """Depthwise causal conv1d with state, then the activation (see the contract for the formula).

    Args:
        x: (batch, seqlen, conv_dim) bf16 | fp16 | fp32, channels last (may be a strided view).
        weight: (conv_dim, d_conv), dtype of x.  bias: (conv_dim,) or None.
        conv_state: (batch, conv_dim, d_conv - 1) or None (zeros): the inputs before token 0.
        activation: "silu" or "none".
        dtype: arithmetic dtype; None: float32 with outputs cast to x.dtype; torch.float64: the
            oracle, outputs in float64.
    Returns:
        Conv1dOutput(y (batch, seqlen, conv_dim), final_conv_state (batch, conv_dim, d_conv - 1)).
        The input state is not modified.
    Raises:
        ContractError: as :func:`m2export.contract_conv1d.validate`.
    """
    p = validate(x, weight, bias, conv_state)
    check_activation(activation)
    cdt = dtype or torch.float32
    out_dt = x.dtype if dtype is None else dtype
    xt = x.to(cdt).transpose(1, 2)  # (batch, conv_dim, seqlen)
    if conv_state is None:
        st = xt.new_zeros(p.batch, p.conv_dim, p.d_conv - 1)
    else:
        st = conv_state.to(cdt)
    xp = torch.cat([st, xt], dim=2)  # (batch, conv_dim, d_conv - 1 + seqlen)
    final = xp[:, :, xp.shape[2] - (p.d_conv - 1):]
    y = F.conv1d(xp, weight.to(cdt)[:, None, :], None if bias is None else bias.to(cdt), groups=p.conv_dim)
    y = _act(y, activation).transpose(1, 2)
    return Conv1dOutput(y.to(out_dt).contiguous(), final.to(out_dt).contiguous())


def conv_update_ref(x, conv_state, weight, bias=None, *, activation: str = "silu",
                    dtype: torch.dtype | None = None) -> Conv1dOutput:
    """One decode token: y = act(bias + sum_k weight[:, k] * concat(conv_state, x)[:, k]); state shifted by one.

    Args:
        x: (batch, conv_dim).  conv_state: (batch, conv_dim, d_conv - 1), required.
        weight, bias, activation, dtype: as :func:`causal_conv1d_ref`.
    Returns:
        Conv1dOutput(y (batch, conv_dim), new conv_state (batch, conv_dim, d_conv - 1)); the input
        state is not modified (the kernel's in-place update must equal this).
    """
    validate_update(x, conv_state, weight, bias)
    res = causal_conv1d_ref(x[:, None], weight, bias, conv_state, activation=activation, dtype=dtype)
    return Conv1dOutput(res.y[:, 0], res.final_conv_state)
