"""cuTile kernel of GatedRMSNorm (m2export/contract_gated_norm.py), memory-bound.

Order: ``@ct.kernel`` -> launch configuration -> :func:`gated_rmsnorm_cutile` (called by
:func:`m2export.kernels.gated_norm.gated_rmsnorm`).

Block (r, g) owns BLOCK_R rows of group g: it loads the group's slice of x and z (``x.slice(axis=1,
start=g*group_size)``, so a group need not start on a tile boundary; the tile is the next power
of two >= group_size, zero-padded, and padded channels add 0 to the sum of squares), computes in
fp32::

    gate = silu(z);  u = x * gate (or x when norm_before_gate)
    out  = u * rsqrt(sum(u^2) / group_size + eps) * weight (* gate when norm_before_gate)

and stores out in x's dtype. One pass: x and z read once, out written once (3 * rows * d_inner *
itemsize bytes; weight is re-read per block from L2).
"""

from __future__ import annotations

import torch

import cuda.tile as ct

from m2export.contract_gated_norm import GatedNormProblem
from m2export.kernels.conv1d.cutile import _ct_silu
from m2export.kernels.ssd.cutile import _hinted, _torch_stream

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
_ZERO = ct.PaddingMode.ZERO


@ct.kernel
def gated_rmsnorm_kernel(x, z, weight, out, group_size: int, eps: float,
                         BLOCK_R: ConstInt, BLOCK_G: ConstInt, NORM_BEFORE_GATE: ConstBool):
    """Grid: (cdiv(rows, BLOCK_R), ngroups, 1). x, z: (rows, d_inner), last stride 1; out contiguous.

    Block (r, g) owns rows [r*BLOCK_R, ...) and channels [g*group_size, (g+1)*group_size).
    """
    r = ct.bid(0)
    g = ct.bid(1)
    f32 = ct.float32
    c0 = g * group_size
    c1 = c0 + group_size
    xt = ct.load(x.slice(axis=1, start=c0, stop=c1), index=(r, 0), shape=(BLOCK_R, BLOCK_G),
                 padding_mode=_ZERO).astype(f32)
    zt = ct.load(z.slice(axis=1, start=c0, stop=c1), index=(r, 0), shape=(BLOCK_R, BLOCK_G),
                 padding_mode=_ZERO).astype(f32)
    wt = ct.load(weight.slice(axis=0, start=c0, stop=c1), index=(0,), shape=(BLOCK_G,),
                 padding_mode=_ZERO).astype(f32)
    gate = _ct_silu(zt)
    if NORM_BEFORE_GATE:
        u = xt
    else:
        u = xt * gate
    rstd = ct.rsqrt(ct.sum(u * u, axis=1) / group_size + eps)  # (BLOCK_R,)
    o = u * rstd[:, None] * wt[None, :]
    if NORM_BEFORE_GATE:
        o = o * gate
    ct.store(out.slice(axis=1, start=c0, stop=c1), index=(r, 0), tile=o.astype(out.dtype))


def choose_tiles(p: GatedNormProblem) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_G): the group padded to a power of two, and rows so a tile holds ~8192 elements."""
    bg = max(16, 1 << (p.group_size - 1).bit_length())
    br = max(1, min(16, 8192 // bg))
    br = min(br, max(1, 1 << max(0, p.rows - 1).bit_length()))
    return br, bg


def gated_rmsnorm_cutile(x, z, weight, *, problem: GatedNormProblem, out=None, stream=None,
                         tiles: tuple[int, int] | None = None, occupancy: int | None = None) -> torch.Tensor:
    """cuTile GatedRMSNorm on validated arguments (see :func:`m2export.kernels.gated_norm.gated_rmsnorm`).

    x and z are viewed as (rows, d_inner) (a copy only if their strides do not allow a view);
    ``tiles``/``occupancy`` override :func:`choose_tiles` and the compiler's default (benchmarks).
    """
    from m2export.kernels.ssd import check_out

    p = problem
    dev = x.device
    launch_stream = _torch_stream(stream, dev)
    with torch.cuda.device(dev), torch.cuda.stream(launch_stream):
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=dev)
        check_out("out", out, x.shape, x.dtype, dev)
        if p.rows == 0:
            return out
        x2, z2 = x.reshape(p.rows, p.d_inner), z.reshape(p.rows, p.d_inner)
        br, bg = tiles or choose_tiles(p)
        ct.launch(int(launch_stream.cuda_stream), (-(-p.rows // br), p.ngroups, 1),
                  _hinted(gated_rmsnorm_kernel, occupancy),
                  (x2, z2, weight.contiguous(), out.view(p.rows, p.d_inner), int(p.group_size), float(p.eps),
                   br, bg, bool(p.norm_before_gate)))
    return out
