"""cuTile kernel of the SSMScan decode step (one token per sequence), memory-bound.

Order: ``@ct.kernel`` -> launch configuration and wrapper -> :func:`ssm_step_cutile` (called by
:func:`m2export.kernels.ssd_step.ssm_step`) -> :func:`aot_spec` for the TensorRT plugin.

Per (batch, head), with Δ = clamp(softplus(dt + dt_bias), dt_min, dt_max)::

    state = state * exp(Δ * A) + Δ * outer(x, B[group])        # (headdim, d_state) fp32
    y     = state @ C[group] + D * x                           # (headdim,)

Bytes: the fp32 state is read and written once (8 * headdim * d_state per head); everything
else is small. The update may be in place (``state_out is ssm_state``): each block reads its
state tile before writing it, and no two blocks share a tile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

import cuda.tile as ct

from m2export.contract import SSMScanAttrs, SSMScanProblem
from m2export.errors import ContractError
from m2export.kernels.ssd import out_buffers
from m2export.kernels.ssd.cutile import AotParam, _ct_step_size, _hinted, _sm_count, _torch_stream, check_supported
from m2export.kernels.ssd.naive import SSMScanOutput

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]


@ct.kernel
def ssd_step_kernel(x, dt, A, B, C, D, dt_bias, ssm_state, y, state_out, dt_min: float, dt_max: float,
                    heads_per_group: int,
                    BLOCK_P: ConstInt, D_STATE: ConstInt,
                    HAS_D: ConstBool, HAS_DT_BIAS: ConstBool, HAS_STATE: ConstBool, DT_SOFTPLUS: ConstBool):
    """One decode step. Grid: (batch*nheads, headdim // BLOCK_P, 1).

    Block (bh, pt) owns batch bh // nheads, head bh % nheads and headdim rows
    [pt*BLOCK_P, (pt+1)*BLOCK_P): reads that (BLOCK_P, D_STATE) tile of ssm_state (zeros when
    HAS_STATE is False), writes it updated to state_out and the matching y entries.
    """
    bh = ct.bid(0)
    pt = ct.bid(1)
    nheads = x.shape[1]
    b = bh // nheads
    h = bh % nheads
    g = h // heads_per_group
    f32 = ct.float32
    a_h = ct.load(A, index=(h,), shape=(1,)).astype(f32)
    v = ct.load(dt, index=(b, h), shape=(1, 1)).reshape((1,)).astype(f32)
    if HAS_DT_BIAS:
        v = v + ct.load(dt_bias, index=(h,), shape=(1,)).astype(f32)
    delta = _ct_step_size(v, dt_min, dt_max, DT_SOFTPLUS)  # (1,)
    x_t = ct.load(x, index=(b, h, pt), shape=(1, 1, BLOCK_P)).reshape((BLOCK_P,)).astype(f32)
    B_t = ct.load(B, index=(b, g, 0), shape=(1, 1, D_STATE)).reshape((D_STATE,)).astype(f32)
    C_t = ct.load(C, index=(b, g, 0), shape=(1, 1, D_STATE)).reshape((D_STATE,)).astype(f32)
    upd = (delta * x_t)[:, None] * B_t[None, :]
    if HAS_STATE:
        st = ct.load(ssm_state, index=(b, h, pt, 0), shape=(1, 1, BLOCK_P, D_STATE)).reshape((BLOCK_P, D_STATE))
        st = st * ct.exp(delta * a_h) + upd
    else:
        st = upd
    yv = ct.sum(st * C_t[None, :], axis=1)
    if HAS_D:
        yv = yv + ct.load(D, index=(h,), shape=(1,)).astype(f32) * x_t
    ct.store(state_out, index=(b, h, pt, 0), tile=st.reshape((1, 1, BLOCK_P, D_STATE)))
    ct.store(y, index=(b, h, pt), tile=yv.astype(y.dtype).reshape((1, 1, BLOCK_P)))


def choose_block_p(batch: int, nheads: int, headdim: int, d_state: int, sm_count: int = 132) -> int:
    """Largest power-of-two headdim tile with <= 8192 state elements (32 KiB fp32) per block that
    still gives >= 2 blocks per SM (measured on the H200, benchmarks/RESULTS.md: at batch 64-128,
    headdim 64, d_state 128, tile 64 with 2 blocks per SM moves 3.9-4.0 TB/s; tile 32 with no
    occupancy hint, the previous default, 2.0 TB/s)."""
    bp = headdim
    while bp > 8 and (bp * d_state > 8192 or batch * nheads * (headdim // bp) < 2 * sm_count):
        bp //= 2
    return bp


def choose_occupancy(block_p: int, d_state: int) -> int:
    """Blocks-per-SM hint: ~64 KiB of fp32 state tiles in flight per SM (without a hint the
    compiler gives the kernel 255 registers per thread, i.e. one block per SM), at most 8 (the
    compiler builds 256-thread blocks for this kernel; an SM holds 2048 threads)."""
    return max(1, min(8, 16384 // (block_p * d_state)))


def _step_args(x, dt, A, B, C, D, dt_bias, ssm_state, y, state_out, dt_min, dt_max, *, block_p, heads_per_group,
               dt_softplus):
    return (x, dt, A, B, C, D if D is not None else A, dt_bias if dt_bias is not None else A,
            ssm_state if ssm_state is not None else state_out, y, state_out, float(dt_min), float(dt_max),
            int(heads_per_group), block_p, B.shape[2], D is not None, dt_bias is not None, ssm_state is not None,
            bool(dt_softplus))


def ssm_step_cutile(x, dt, A, B, C, D, dt_bias, ssm_state, *, problem: SSMScanProblem, dt_softplus: bool,
                    dt_limit: tuple[float, float], out=None, state_out=None, stream=None,
                    block_p: int | None = None, occupancy: int | None = None) -> SSMScanOutput:
    """cuTile decode step on validated arguments (see :func:`m2export.kernels.ssd_step.ssm_step`).

    ``block_p``/``occupancy`` override the headdim tile and the compiler's blocks-per-SM hint
    (benchmark sweeps; ``occupancy`` None with an explicit ``block_p``: no hint); both None:
    :func:`choose_block_p` and :func:`choose_occupancy`."""
    dev = x.device
    launch_stream = _torch_stream(stream, dev)
    with torch.cuda.device(dev), torch.cuda.stream(launch_stream):
        x, dt, A, B, C, D, dt_bias = (None if t is None else t.contiguous() for t in (x, dt, A, B, C, D, dt_bias))
        p = problem
        if ssm_state is not None and not ssm_state.is_contiguous():
            if state_out is ssm_state:
                raise ContractError("ssm_state: in-place update needs a contiguous ssm_state")
            ssm_state = ssm_state.contiguous()
        y, new_state = out_buffers(x, p, out, state_out, state_name="state_out", allocate=True)
        if p.batch == 0:
            return SSMScanOutput(y, new_state)
        bp = block_p or choose_block_p(p.batch, p.nheads, p.headdim, p.d_state, _sm_count(dev))
        if occupancy is None and block_p is None:
            occupancy = choose_occupancy(bp, p.d_state)
        ct.launch(int(launch_stream.cuda_stream), (p.batch * p.nheads, p.headdim // bp, 1),
                  _hinted(ssd_step_kernel, occupancy or None),
                  _step_args(x, dt, A, B, C, D, dt_bias, ssm_state, y, new_state, dt_limit[0], dt_limit[1],
                             block_p=bp, heads_per_group=p.heads_per_group, dt_softplus=dt_softplus))
    return SSMScanOutput(y, new_state)


@dataclass(frozen=True)
class StepAotSpec:
    """Single-launch decode-step kernel for the TensorRT AOT plugin (same conventions as
    :class:`m2export.kernels.ssd.cutile.AotSpec`).

    Entry parameters (cutile_python_v1: each array = pointer, extents, strides): x (7), dt (5),
    A (3), B (7), C (7), D (3), dt_bias (3), ssm_state (9), y (7), state_out (9), dt_min, dt_max,
    heads_per_group: 63 parameters.
    Grid ``grid(batch, nheads, headdim) = (batch*nheads, headdim // block_p, 1)``. ``state_out``
    may be the same buffer as ``ssm_state`` (in place).
    """

    kernel: Any
    params: tuple[AotParam, ...]
    grid: Callable[[int, int, int], tuple[int, int, int]]
    block: int | None
    block_p: int
    problem: SSMScanProblem
    attrs: SSMScanAttrs

    def signature(self):
        from m2export.kernels.ssd.cutile import AotSpec

        return AotSpec.signature(self)  # same parameter walk

    def export(self, output_file, *, gpu_code: str = "sm_90") -> str:
        from m2export.kernels.ssd.cutile import AotSpec

        return AotSpec.export(self, output_file, gpu_code=gpu_code)

    def compile(self, *, gpu_code: str = "sm_90"):
        from m2export.kernels.ssd.cutile import AotSpec

        return AotSpec.compile(self, gpu_code=gpu_code)

    def flat_args(self) -> list[str]:
        from m2export.kernels.ssd.cutile import AotSpec

        return AotSpec.flat_args(self)


def aot_spec(problem: SSMScanProblem, attrs: SSMScanAttrs, *, block_p: int | None = None) -> StepAotSpec:
    """Describe the decode-step kernel for ``problem`` (seqlen ignored; D, dt_bias, ssm_state present)."""
    check_supported(problem)
    bp = block_p or min(problem.headdim, max(8, 4096 // problem.d_state))
    dtn = problem.dtype
    arr = lambda name, nd, dt=dtn: AotParam(name, "array", dt, nd)  # noqa: E731
    params = (
        arr("x", 3), arr("dt", 2), arr("A", 1, "float32"), arr("B", 3), arr("C", 3),
        arr("D", 1, "float32"), arr("dt_bias", 1, "float32"), AotParam("ssm_state", "array", "float32", 4, alias=("state",)),
        arr("y", 3), AotParam("state_out", "array", "float32", 4, alias=("state",)),
        AotParam("dt_min", "scalar", "float32", value=float(attrs.dt_min)),
        AotParam("dt_max", "scalar", "float32", value=float(attrs.dt_max)),
        AotParam("heads_per_group", "scalar", "int32", value=problem.heads_per_group),
        AotParam("BLOCK_P", "constant", value=bp),
        AotParam("D_STATE", "constant", value=problem.d_state),
        AotParam("HAS_D", "constant", value=True),
        AotParam("HAS_DT_BIAS", "constant", value=True),
        AotParam("HAS_STATE", "constant", value=True),
        AotParam("DT_SOFTPLUS", "constant", value=bool(attrs.dt_softplus)),
    )
    return StepAotSpec(kernel=ssd_step_kernel, params=params,
                       grid=lambda batch, nheads, headdim: (batch * nheads, headdim // bp, 1),
                       block=None, block_p=bp, problem=problem, attrs=attrs)
