"""GatedRMSNorm (RMSNorm per group, gated by silu(z)): one public entry point over explicit backends.

``backend="cutile"``: :mod:`m2export.kernels.gated_norm.cutile` (imported lazily); ``backend="torch"``:
:func:`m2export.kernels.gated_norm.naive.gated_rmsnorm_ref`. No silent fallback. The op's
definition: m2export/contract_gated_norm.py.
"""

from __future__ import annotations

from m2export.contract_gated_norm import validate
from m2export.errors import ContractError
from m2export.kernels.gated_norm.naive import gated_rmsnorm_ref
from m2export.kernels._host import BACKENDS, check_out, require_cuda_tile

__all__ = ["gated_rmsnorm", "gated_rmsnorm_ref"]


def gated_rmsnorm(x, z, weight, *, group_size: int | None = None, eps: float = 1e-5, norm_before_gate: bool = False,
                  backend: str = "cutile", out=None, stream=None):
    """Gated RMSNorm per group of channels (op m2export::GatedRMSNorm), in float32::

        norm_before_gate=False (Mamba-2): u = x * silu(z);  out = u * rsqrt(mean_group(u^2) + eps) * weight
        norm_before_gate=True:            out = x * rsqrt(mean_group(x^2) + eps) * weight * silu(z)

    Args:
        x: (..., d_inner) bf16 | fp16 | fp32 (the scan output y), last stride 1.
        z: the gate, shape and dtype of x, last stride 1 (usually a strided slice of the in_proj output).
        weight: (d_inner,), dtype of x.
        group_size: channels per group (d_inner // ngroups; any divisor of d_inner); None: d_inner.
        eps: added to the mean square (> 0).
        norm_before_gate: False for Mamba-2 and its hybrids.
        backend: "cutile" (CUDA, cuda.tile) or "torch" (naive.gated_rmsnorm_ref, any device).
        out: optional preallocated contiguous output (shape and dtype of x).
        stream: None, a torch.cuda.Stream or a raw cudaStream_t int ("cutile").

    Returns:
        out (..., d_inner) in x.dtype, contiguous.

    Raises:
        ContractError: an argument breaks the contract (m2export/contract_gated_norm.py), or an unusable out=.
        BackendUnavailable: backend="cutile" without CUDA / cuda.tile or with CPU tensors.

    Source: mamba_ssm/ops/triton/layernorm_gated.py (rmsnorm_fn, rms_norm_ref).
    """
    p = validate(x, z, weight, group_size=group_size, eps=eps, norm_before_gate=norm_before_gate)
    if backend not in BACKENDS:
        raise ContractError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        res = gated_rmsnorm_ref(x, z, weight, group_size=p.group_size, eps=eps, norm_before_gate=norm_before_gate)
        if out is None:
            return res
        check_out("out", out, x.shape, x.dtype, x.device)
        return out.copy_(res)
    require_cuda_tile(dict(x=x, z=z, weight=weight))
    from m2export.kernels.gated_norm.cutile import gated_rmsnorm_cutile

    return gated_rmsnorm_cutile(x, z, weight, problem=p, out=out, stream=stream)
