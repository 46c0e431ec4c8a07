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

import torch

import cuda.tile as ct

from m2export.contract import SSMScanAttrs, SSMScanProblem
from m2export.errors import ContractError
from m2export.kernels import launch as L
from m2export.kernels._host import (cached_plan, check_supported, hinted, launch_stream, out_buffers, sm_count,
                                    unit_stride)
from m2export.kernels.launch import Launch
from m2export.kernels.ssd.cutile import _ct_put, _ct_step_size, _ct_tile
from m2export.kernels.ssd.naive import SSMScanOutput

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]

# Head dims that are not powers of two run :func:`ssd_step_rows_kernel` (flat-row tiles) where every tensor is
# contiguous; False: always :func:`ssd_step_kernel` (benchmarks' A/B, benchmarks/NOTES_ssd.md).
ROWS = True
# Power-of-two head dims on the flat-row kernel too (its tiles never span two heads there); False: the per-head
# kernel (benchmarks/NOTES_ssd.md, 2026-12-03 afternoon).
ROWS_POW2 = False


@ct.kernel
def ssd_step_kernel(x, dt, A, B, C, D, dt_bias, ssm_state, y, state_out, dt_min: float, dt_max: float,
                    heads_per_group: int,
                    BLOCK_P: ConstInt, D_STATE: ConstInt,
                    HAS_D: ConstBool, HAS_DT_BIAS: ConstBool, HAS_STATE: ConstBool, DT_SOFTPLUS: ConstBool,
                    TMA: ConstBool):
    """One decode step. Grid: (batch*nheads, headdim // BLOCK_P, 1).

    Block (bh, pt) owns batch bh // nheads, head bh % nheads and headdim rows
    [pt*BLOCK_P, (pt+1)*BLOCK_P): reads that (BLOCK_P, D_STATE) tile of ssm_state (zeros when
    HAS_STATE is False), writes it updated to state_out and the matching y entries. TMA False: plain loads
    and stores only (the AOT plugin's build: TensorRT's launcher cannot pass the tensor maps TMA needs).
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
    x_t = _ct_tile(x, (b, h, pt), (1, 1, BLOCK_P), TMA).reshape((BLOCK_P,)).astype(f32)
    B_t = _ct_tile(B, (b, g, 0), (1, 1, D_STATE), TMA).reshape((D_STATE,)).astype(f32)
    C_t = _ct_tile(C, (b, g, 0), (1, 1, D_STATE), TMA).reshape((D_STATE,)).astype(f32)
    upd = (delta * x_t)[:, None] * B_t[None, :]
    if HAS_STATE:
        st = _ct_tile(ssm_state, (b, h, pt, 0), (1, 1, BLOCK_P, D_STATE), TMA).reshape((BLOCK_P, D_STATE))
        st = st * ct.exp(delta * a_h) + upd
    else:
        st = upd
    yv = ct.sum(st * C_t[None, :], axis=1)
    if HAS_D:
        yv = yv + ct.load(D, index=(h,), shape=(1,)).astype(f32) * x_t
    _ct_put(state_out, (b, h, pt, 0), st.reshape((1, 1, BLOCK_P, D_STATE)), TMA)
    _ct_put(y, (b, h, pt), yv.astype(y.dtype).reshape((1, 1, BLOCK_P)), TMA)


def _ct_rows_head(A, dt, B, C, D, dt_bias, bh, nheads: int, ngroups: int, heads_per_group: int, dt_min: float,
                  dt_max: float, D_STATE: ConstInt, HAS_D: ConstBool, HAS_DT_BIAS: ConstBool, DT_SOFTPLUS: ConstBool):
    """(step size, decay, D, B row (1, D_STATE), C row) of flat (batch, head) index ``bh``, fp32; past the last
    head (a tile's second head at the end of the array) the loads are padding and nothing of it is stored."""
    f32 = ct.float32
    h = bh % nheads
    bg = (bh // nheads) * ngroups + h // heads_per_group
    v = ct.load(dt, index=(bh,), shape=(1,)).astype(f32)
    if HAS_DT_BIAS:
        v = v + ct.load(dt_bias, index=(h,), shape=(1,)).astype(f32)
    delta = _ct_step_size(v, dt_min, dt_max, DT_SOFTPLUS)
    decay = ct.exp(delta * ct.load(A, index=(h,), shape=(1,)).astype(f32))
    if HAS_D:
        d_h = ct.load(D, index=(h,), shape=(1,)).astype(f32)
    else:
        d_h = ct.full((1,), 0.0, dtype=f32)
    b_r = ct.load(B, index=(bg, 0), shape=(1, D_STATE)).astype(f32)
    c_r = ct.load(C, index=(bg, 0), shape=(1, D_STATE)).astype(f32)
    return delta, decay, d_h, b_r, c_r


@ct.kernel
def ssd_step_rows_kernel(x, dt, A, B, C, D, dt_bias, ssm_state, y, state_out, dt_min: float, dt_max: float,
                         nheads: int, headdim: int, ngroups: int, heads_per_group: int,
                         BLOCK_R: ConstInt, D_STATE: ConstInt,
                         HAS_D: ConstBool, HAS_DT_BIAS: ConstBool, HAS_STATE: ConstBool, DT_SOFTPLUS: ConstBool):
    """One decode step over flat state rows, for head dims that are not powers of two (80, 96, ...): the
    (batch, nheads, headdim) rows are one axis cut into BLOCK_R-row tiles (BLOCK_R <= headdim, so a tile holds
    rows of at most two heads), instead of the largest power-of-two tile dividing headdim (16 rows at 80).
    Grid: (ceil(batch*nheads*headdim / BLOCK_R), 1, 1).

    Views (contiguous tensors): x, y (batch*nheads*headdim,); dt (batch*nheads,); B, C (batch*ngroups, d_state);
    ssm_state, state_out (batch*nheads*headdim, d_state) fp32. Each row takes its head's step size, decay, D and
    its group's B/C row (selected between the tile's two heads); rows past the end are dropped by the stores.
    """
    t = ct.bid(0)
    f32 = ct.float32
    r0 = t * BLOCK_R
    bh0 = r0 // headdim
    dl0, dc0, d0, b0, c0 = _ct_rows_head(A, dt, B, C, D, dt_bias, bh0, nheads, ngroups, heads_per_group, dt_min,
                                         dt_max, D_STATE, HAS_D, HAS_DT_BIAS, DT_SOFTPLUS)
    dl1, dc1, d1, b1, c1 = _ct_rows_head(A, dt, B, C, D, dt_bias, bh0 + 1, nheads, ngroups, heads_per_group,
                                         dt_min, dt_max, D_STATE, HAS_D, HAS_DT_BIAS, DT_SOFTPLUS)
    second = (r0 + ct.arange(BLOCK_R, dtype=ct.int32)) >= (bh0 + 1) * headdim  # (BLOCK_R,) row of head bh0 + 1
    delta = ct.where(second, dl1, dl0)
    d_r = ct.where(second, d1, d0)
    sec2 = second.reshape((BLOCK_R, 1))
    B_t = ct.where(sec2, b1, b0)  # (BLOCK_R, D_STATE)
    C_t = ct.where(sec2, c1, c0)
    x_t = ct.load(x, index=(t,), shape=(BLOCK_R,)).astype(f32)
    upd = (delta * x_t).reshape((BLOCK_R, 1)) * B_t
    if HAS_STATE:
        st = ct.load(ssm_state, index=(t, 0), shape=(BLOCK_R, D_STATE))
        st = st * ct.where(second, dc1, dc0).reshape((BLOCK_R, 1)) + upd
    else:
        st = upd
    yv = ct.sum(st * C_t, axis=1) + d_r * x_t
    ct.store(state_out, index=(t, 0), tile=st)
    ct.store(y, index=(t,), tile=yv.astype(y.dtype))


def choose_block_rows(batch: int, nheads: int, headdim: int, d_state: int, sm_count: int = 132,
                      pow2: bool = False) -> int | None:
    """The flat-row tile of :func:`ssd_step_rows_kernel`: the largest power of two <= headdim with <= 8192 state
    elements that still gives >= 2 blocks per SM, or None where it is no larger than :func:`choose_block_p`'s tile
    (power-of-two head dims: that kernel's tiles are already whole; ``pow2``: the same tile, on this kernel)."""
    r = 1 << (headdim.bit_length() - 1)
    while r > 8 and (r * d_state > 8192 or -(-batch * nheads * headdim // r) < 2 * sm_count):
        r //= 2
    bp = choose_block_p(batch, nheads, headdim, d_state, sm_count)
    return r if r > bp or (pow2 and r == bp) else None


def choose_block_p(batch: int, nheads: int, headdim: int, d_state: int, sm_count: int = 132) -> int:
    """Largest power-of-two headdim tile dividing headdim with <= 8192 state elements (32 KiB fp32) per
    block that still gives >= 2 blocks per SM (why: benchmarks/NOTES_ssd.md, decode step). Dividing
    headdim (80 -> 16): the step is memory-bound, so exact tiles, no masked rows."""
    bp = headdim & -headdim  # largest power of two dividing headdim
    while bp > 8 and (bp * d_state > 8192 or batch * nheads * (headdim // bp) < 2 * sm_count):
        bp //= 2
    return bp


def choose_occupancy(block_p: int, d_state: int) -> int:
    """Blocks-per-SM hint: ~64 KiB of fp32 state tiles in flight per SM (without a hint the
    compiler gives the kernel 255 registers per thread, i.e. one block per SM), at most 8 (the
    compiler builds 256-thread blocks for this kernel; an SM holds 2048 threads)."""
    return max(1, min(8, 16384 // (block_p * d_state)))


def _step_args(p: SSMScanProblem, ranks: tuple[int, int, int, int], shape_scalars: tuple[str, ...],
               tile: tuple[str, int], *, dt_softplus: bool, dt_limit: tuple[float, float], has_D: bool,
               has_dt_bias: bool, has_state: bool, extra: tuple = ()) -> tuple:
    """The arguments both step kernels take, in their parameter order (which the AOT entry follows): x dt A B C D
    dt_bias ssm_state y state_out, dt_min, dt_max, the int32 ``shape_scalars`` (problem fields), then the tile
    constant ``tile`` = (name, rows), D_STATE, the HAS_* / DT_SOFTPLUS flags and ``extra`` constants. ``ranks``:
    the kernel's view ranks of (x and y, dt, B and C, the states). An absent D / dt_bias binds A (HAS_D / HAS_DT_BIAS False: never read),
    an absent ssm_state binds state_out (HAS_STATE False); ssm_state and state_out share alias group "state"."""
    dtn = p.dtype
    rx, rdt, rb, rs = ranks
    return (L.array("x", dtn, rx), L.array("dt", dtn, rdt), L.array("A", "float32", 1), L.array("B", dtn, rb),
            L.array("C", dtn, rb), L.array("D", "float32", 1, source=None if has_D else "A"),
            L.array("dt_bias", "float32", 1, source=None if has_dt_bias else "A"),
            L.array("ssm_state", "float32", rs, source=None if has_state else "state_out", alias=("state",)),
            L.array("y", dtn, rx), L.array("state_out", "float32", rs, alias=("state",)),
            L.scalar("dt_min", "float32", float(dt_limit[0])), L.scalar("dt_max", "float32", float(dt_limit[1])),
            *(L.scalar(n, "int32", getattr(p, n)) for n in shape_scalars),
            L.constant(tile[0], tile[1]), L.constant("D_STATE", p.d_state),
            L.constant("HAS_D", bool(has_D)), L.constant("HAS_DT_BIAS", bool(has_dt_bias)),
            L.constant("HAS_STATE", bool(has_state)), L.constant("DT_SOFTPLUS", bool(dt_softplus)), *extra)


def step_launch(p: SSMScanProblem, *, block_p: int, occupancy: int | None, dt_softplus: bool,
                dt_limit: tuple[float, float], has_D: bool = True, has_dt_bias: bool = True, has_state: bool = True,
                grid=None, tma: bool = True) -> Launch:
    """:func:`ssd_step_kernel` for ``p`` (seqlen ignored) with a ``block_p``-row headdim tile; grid
    ``(batch*nheads, headdim // block_p, 1)`` unless ``grid`` is given (the AOT plugin's symbolic one).
    ``state_out`` may be the same buffer as ``ssm_state`` (in place: alias group "state"). ``tma`` False: no TMA
    copies (the AOT build, :func:`aot_spec`)."""
    args = _step_args(p, (3, 2, 3, 4), ("heads_per_group",), ("BLOCK_P", block_p), dt_softplus=dt_softplus,
                      dt_limit=dt_limit, has_D=has_D, has_dt_bias=has_dt_bias, has_state=has_state,
                      extra=(L.constant("TMA", bool(tma)),))
    if grid is None:
        grid = (p.batch * p.nheads, p.headdim // block_p, 1)
    return Launch(hinted(ssd_step_kernel, occupancy), args, grid, block_p)


def rows_launch(p: SSMScanProblem, *, block_r: int, occupancy: int | None, dt_softplus: bool,
                dt_limit: tuple[float, float], has_D: bool = True, has_dt_bias: bool = True,
                has_state: bool = True) -> Launch:
    """:func:`ssd_step_rows_kernel` for ``p`` with ``block_r``-row tiles of the flat state rows (bind the flat views
    of :func:`_rows_views`); config ``("rows", block_r)``."""
    args = _step_args(p, (1, 1, 2, 2), ("nheads", "headdim", "ngroups", "heads_per_group"), ("BLOCK_R", block_r),
                      dt_softplus=dt_softplus, dt_limit=dt_limit, has_D=has_D, has_dt_bias=has_dt_bias,
                      has_state=has_state)
    grid = (-(-p.batch * p.nheads * p.headdim // block_r), 1, 1)
    return Launch(hinted(ssd_step_rows_kernel, occupancy), args, grid, ("rows", block_r))


def _rows_views(tensors: dict) -> dict | None:
    """The flat views :func:`ssd_step_rows_kernel` reads, or None where a tensor is not contiguous (then the
    per-head kernel runs)."""
    if not all(t is None or t.is_contiguous() for t in tensors.values()):
        return None
    out = dict(tensors)
    for k in ("x", "y", "dt"):
        out[k] = tensors[k].reshape(-1)
    for k in ("B", "C"):
        out[k] = tensors[k].reshape(-1, tensors[k].shape[-1])
    for k in ("ssm_state", "state_out"):
        if tensors[k] is not None:
            out[k] = tensors[k].reshape(-1, tensors[k].shape[-1])
    return out


def _plan(p: SSMScanProblem, dev: torch.device, dt_softplus, dt_limit, has_D, has_dt_bias, has_state,
          rows: bool = True) -> Launch:
    def make():
        br = choose_block_rows(p.batch, p.nheads, p.headdim, p.d_state, sm_count(dev), ROWS_POW2) if rows else None
        if br is not None:
            return rows_launch(p, block_r=br, occupancy=choose_occupancy(br, p.d_state), dt_softplus=dt_softplus,
                               dt_limit=dt_limit, has_D=has_D, has_dt_bias=has_dt_bias, has_state=has_state)
        bp = choose_block_p(p.batch, p.nheads, p.headdim, p.d_state, sm_count(dev))
        return step_launch(p, block_p=bp, occupancy=choose_occupancy(bp, p.d_state), dt_softplus=dt_softplus,
                           dt_limit=dt_limit, has_D=has_D, has_dt_bias=has_dt_bias, has_state=has_state)

    key = ("step", p, float(dt_limit[0]), float(dt_limit[1]), bool(dt_softplus), has_D, has_dt_bias, has_state,
           rows, ROWS_POW2, dev.index)
    return cached_plan(key, make)


def ssm_step_cutile(x, dt, A, B, C, D, dt_bias, ssm_state, *, problem: SSMScanProblem, dt_softplus: bool,
                    dt_limit: tuple[float, float], out=None, state_out=None, stream=None) -> SSMScanOutput:
    """cuTile decode step on validated arguments (see :func:`m2export.kernels.ssd_step.ssm_step`).

    ``problem`` has seqlen 1; the tile and occupancy hint come from :func:`choose_block_rows` (head dims that are
    not powers of two, contiguous tensors: :func:`ssd_step_rows_kernel`) or :func:`choose_block_p`, and
    :func:`choose_occupancy` (the launch is cached per problem signature)."""
    dev = x.device
    ls = launch_stream(stream, dev)
    with torch.cuda.device(dev), torch.cuda.stream(ls):
        x, dt, B, C = (unit_stride(t) for t in (x, dt, B, C))  # views read in place
        A, D, dt_bias = (None if t is None else t.contiguous() for t in (A, D, dt_bias))
        p = problem
        if ssm_state is not None and not ssm_state.is_contiguous():
            if state_out is ssm_state:
                raise ContractError("ssm_state: in-place update needs a contiguous ssm_state")
            ssm_state = ssm_state.contiguous()
        y, new_state = out_buffers(x, p.shape_of("final_state"), out, state_out, state_name="state_out",
                                   allocate=True)
        if p.batch == 0:
            return SSMScanOutput(y, new_state)
        tensors = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias, ssm_state=ssm_state, y=y,
                       state_out=new_state)
        flat = _rows_views(tensors) if ROWS else None
        launch = _plan(p, dev, dt_softplus, dt_limit, D is not None, dt_bias is not None, ssm_state is not None,
                       rows=flat is not None)
        ct.launch(int(ls.cuda_stream), launch.grid, launch.kernel,
                  launch.bind(flat if isinstance(launch.config, tuple) else tensors))
    return SSMScanOutput(y, new_state)


#: The AOT decode kernel's tile and hint (no TMA: plain 16-byte loads, 128 threads). H200 sweep, 2026-12-04
#: (benchmarks/bench_ssd_aot.py --decode-tiles, RESULTS.md): at P64 N128 32 rows (hint 4) reached 74.3 / 77.2% of
#: 4.3 TB/s at batch 64 / 128 against 69.0 / 72.9% for 64 rows (hint 2), and 12.9 / 60.7% against 11.9 / 52.5% at
#: batch 1 / 16; at P128 N256 32 rows with 6 blocks per SM 73.6 / 76.9% against 65.8 / 69.0% with 2 (16 rows: 74.3 /
#: 76.3% at 6, 61.8 / 62.9% at 4).
AOT_STEP_ROWS = 32
AOT_STEP_OCCUPANCY_N256 = 6


def aot_spec(problem: SSMScanProblem, attrs: SSMScanAttrs, *, block_p: int | None = None,
             occupancy: int | None = None) -> Launch:
    """The decode-step kernel for the TensorRT AOT plugin when seqlen is the constant 1.

    Bound to the plugin's tensors: x, dt, B, C and y are the plugin's 4-D/3-D tensors with their
    seqlen dimension (size 1) dropped, ``ssm_state`` reads ``initial_state`` and ``state_out`` writes
    ``final_state``; D, dt_bias and the state are present (ONNX graphs always have them). Entry
    parameters (cutile_python_v1): x (7), dt (5), A (3), B (7), C (7), D (3), dt_bias (3),
    ssm_state (9), y (7), state_out (9), dt_min, dt_max, heads_per_group: 63. Grid
    ``(batch*nheads, headdim // block_p, 1)``; the tile is batch-independent (batch is a runtime extent):
    the largest power of two dividing headdim, at most 32 rows, with :func:`choose_occupancy`'s hint, or 6 blocks
    per SM at d_state >= 256 (:data:`AOT_STEP_ROWS`, :data:`AOT_STEP_OCCUPANCY_N256`; ``block_p`` /
    ``occupancy``: another tile or hint, for sweeps). Built with ``TMA`` False (plain 16-byte loads and stores,
    given the static sizes' divisibility facts of :func:`m2export.plugins.aot.trt_signature`).
    """
    check_supported(problem, "step", hint='pad the model or use backend="torch"')
    bp = block_p or min(problem.headdim & -problem.headdim, AOT_STEP_ROWS)
    if occupancy is None:
        occupancy = AOT_STEP_OCCUPANCY_N256 if problem.d_state >= 256 else choose_occupancy(bp, problem.d_state)
    spec = step_launch(problem, block_p=bp, occupancy=occupancy,
                       dt_softplus=attrs.dt_softplus, dt_limit=attrs.dt_limit,
                       grid=lambda batch, nheads, headdim: (batch * nheads, headdim // bp, 1), tma=False)
    return spec.with_args(x=dict(squeeze=1), dt=dict(squeeze=1), B=dict(squeeze=1), C=dict(squeeze=1),
                          y=dict(squeeze=1), ssm_state=dict(source="initial_state"),
                          state_out=dict(source="final_state"))
