"""Plain-PyTorch reference of the single-token SSMScan update (decode step).

The step is SSMScan with seqlen == 1 (m2export/contract.py), written without the seqlen axis:

    dt    = clamp(softplus(dt + dt_bias), dt_min, dt_max)                  # (batch, nheads)
    state = state * exp(dt * A) + dt * outer(x, B[group])                   # (batch, nheads, headdim, d_state)
    y     = state @ C[group] + D * x                                        # (batch, nheads, headdim)

dt_limit is applied here too (one known reference implementation forgets it in decode).
Source: mamba_ssm/ops/triton/selective_state_update.py (selective_state_update_ref), Mamba-2 form.
"""

from __future__ import annotations

import math

import torch

from m2export.contract import SSMScanAttrs, validate
from m2export.kernels.ssd.naive import SSMScanOutput, check_decay, dt_transform


def ssm_step_ref(x, dt, A, B, C, D=None, dt_bias=None, ssm_state=None, *, dt_softplus: bool = True,
                 dt_limit: tuple[float, float] = (0.0, math.inf)) -> SSMScanOutput:
    """One decode step, float32 internals.

    Args:
        x: (batch, nheads, headdim) fp32/fp16/bf16.  dt: (batch, nheads), dtype of x, raw.
        A: (nheads,) fp32.  B, C: (batch, ngroups, d_state), dtype of x.
        D, dt_bias: (nheads,) fp32 or None.  ssm_state: (batch, nheads, headdim, d_state) fp32 or None (zeros).
    Returns:
        SSMScanOutput(y (batch, nheads, headdim) in x.dtype, new ssm_state fp32). The input state is not modified.
    Raises:
        ContractError: as :func:`m2export.contract.validate` for the seqlen-1 problem.
    """
    dt_limit = SSMScanAttrs.make(dt_softplus=dt_softplus, dt_limit=dt_limit).dt_limit
    p = validate(x[:, None], dt[:, None], A, B[:, None], C[:, None], D, dt_bias, ssm_state)
    check_decay(A)
    f32 = torch.float32
    delta = dt_transform(dt, dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)  # (b, h)
    rep = p.heads_per_group
    Bh = B.to(f32).repeat_interleave(rep, dim=1)  # (b, h, n)
    Ch = C.to(f32).repeat_interleave(rep, dim=1)
    xf = x.to(f32)
    state = (ssm_state.to(f32) if ssm_state is not None
             else torch.zeros(p.batch, p.nheads, p.headdim, p.d_state, dtype=f32, device=x.device))
    decay = torch.exp(delta * A.to(f32))  # (b, h)
    new_state = state * decay[:, :, None, None] + (delta[:, :, None] * xf)[..., None] * Bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", new_state, Ch)
    if D is not None:
        y = y + D.to(f32)[:, None] * xf
    return SSMScanOutput(y.to(x.dtype), new_state)
