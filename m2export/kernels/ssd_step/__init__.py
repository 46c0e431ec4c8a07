"""SSMScan decode step (one token per sequence): one public entry point over explicit backends.

``backend="cutile"``: :mod:`m2export.kernels.ssd_step.cutile` (imported lazily); ``backend="torch"``:
:func:`m2export.kernels.ssd_step.naive.ssm_step_ref`. No silent fallback.
"""

from __future__ import annotations

import math

from m2export.contract import SSMScanAttrs
from m2export.errors import ContractError
from m2export.kernels._host import into_buffers, out_buffers, require_cutile, validated
from m2export.kernels.ssd.naive import SSMScanOutput
from m2export.kernels.ssd_step.naive import ssm_step_ref

__all__ = ["ssm_step", "ssm_step_ref", "SSMScanOutput"]


def ssm_step(x, dt, A, B, C, D=None, dt_bias=None, ssm_state=None, *, dt_softplus: bool = True,
             dt_limit: tuple[float, float] = (0.0, math.inf), backend: str = "cutile", out=None, state_out=None,
             stream=None) -> SSMScanOutput:
    """One decode step of SSMScan (seqlen 1, without the seqlen axis)::

        dt    = clamp(softplus(dt + dt_bias), dt_min, dt_max)                 # (batch, nheads)
        state = state * exp(dt * A) + dt * outer(x, B[group])                  # (batch, nheads, headdim, d_state)
        y     = state @ C[group] + D * x                                       # (batch, nheads, headdim)

    Args:
        x: (batch, nheads, headdim), bf16 | fp16 | fp32.  dt: (batch, nheads), dtype of x, raw.
        A: (nheads,) fp32.  B, C: (batch, ngroups, d_state), dtype of x.
        D, dt_bias: (nheads,) fp32 or None.
        ssm_state: (batch, nheads, headdim, d_state) fp32, or None (zeros).
        dt_softplus, dt_limit: as :func:`m2export.kernels.ssd.ssm_scan` (the clamp is applied here too).
        backend: "cutile" or "torch".
        out: optional preallocated y (contiguous, shape/dtype of x).
        state_out: optional preallocated new state (contiguous fp32); may be ``ssm_state`` itself
            for an in-place update ("cutile"; with "torch" the result is copied into it).
        stream: None, a torch.cuda.Stream or a raw cudaStream_t int ("cutile").

    Returns:
        SSMScanOutput(y (batch, nheads, headdim) in x.dtype, new state (batch, nheads, headdim, d_state) fp32).

    Raises:
        ContractError: bad shapes/dtypes (m2export/contract.py), for "cutile" headdim not a multiple of 16
            up to 256 or d_state not in {32, 64, 128, 256}, or an unusable out=/state_out=.
        BackendUnavailable: no CUDA / cuda.tile / CPU tensors for "cutile"; hint: pip install m2export[gpu].
    """
    attrs = SSMScanAttrs.make(dt_softplus=dt_softplus, dt_limit=dt_limit)
    for name, t, nd in (("x", x, 3), ("dt", dt, 2), ("B", B, 3), ("C", C, 3)):
        if t.dim() != nd:
            raise ContractError(f"{name}: expected a {nd}-D tensor for ssm_step, got shape {tuple(t.shape)}")
    problem = validated(x[:, None], dt[:, None], A, B[:, None], C[:, None], D, dt_bias, ssm_state)
    if backend == "torch":
        out_buffers(x, problem.shape_of("final_state"), out, state_out, state_name="state_out")
        res = ssm_step_ref(x, dt, A, B, C, D, dt_bias, ssm_state, dt_softplus=dt_softplus, dt_limit=attrs.dt_limit)
        return into_buffers(res, out, state_out)
    require_cutile(backend, problem, "step", dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias,
                                                  ssm_state=ssm_state), stream)
    from m2export.kernels.ssd_step.cutile import ssm_step_cutile

    return ssm_step_cutile(x, dt, A, B, C, D, dt_bias, ssm_state, problem=problem, dt_softplus=dt_softplus,
                           dt_limit=attrs.dt_limit, out=out, state_out=state_out, stream=stream)
