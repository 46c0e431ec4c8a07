"""Plain-PyTorch reference of GatedRMSNorm (m2export/contract_gated_norm.py).

Imports only torch. ``dtype=torch.float64`` makes it the float64 oracle of the kernel tests.
Source: mamba_ssm/ops/triton/layernorm_gated.py ``rms_norm_ref`` (group_size, norm_before_gate, no bias).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from m2export.contract_gated_norm import validate


def gated_rmsnorm_ref(x, z, weight, *, group_size: int | None = None, eps: float = 1e-5,
                      norm_before_gate: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm per group of ``group_size`` channels, gated by silu(z) (formula in the contract).

    Args:
        x, z: (..., d_inner) bf16 | fp16 | fp32, same shape, last stride 1.
        weight: (d_inner,), dtype of x.
        group_size: channels per group (divides d_inner); None: d_inner (one group).
        eps: added to the mean square.  norm_before_gate: False for Mamba-2 (gate, then norm).
        dtype: arithmetic dtype; None: float32 with the output cast to x.dtype; torch.float64:
            the oracle, output in float64.
    Returns:
        out (..., d_inner), contiguous.
    Raises:
        ContractError: as :func:`m2export.contract_gated_norm.validate`.
    """
    p = validate(x, z, weight, group_size=group_size, eps=eps, norm_before_gate=norm_before_gate)
    cdt = dtype or torch.float32
    xf, zf, wf = x.to(cdt), z.to(cdt), weight.to(cdt)
    gate = F.silu(zf)
    u = xf if norm_before_gate else xf * gate
    g = u.reshape(*u.shape[:-1], p.ngroups, p.group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    out = g.reshape(u.shape) * wf
    if norm_before_gate:
        out = out * gate
    return out.to(x.dtype if dtype is None else dtype).contiguous()
