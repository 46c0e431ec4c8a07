"""cuTile (``cuda.tile``) kernels of SSMScan, the chunked SSD forward (prefill).

Layout of this file (TileGym's order): private tile helpers -> ``@ct.kernel`` functions (each
docstring names its grid and what one block owns) -> launch configuration and wrappers ->
:func:`ssm_scan_cutile` (called by :func:`m2export.kernels.ssd.ssm_scan`) -> :func:`aot_spec`
for the TensorRT AOT plugin.

Algorithm (Dao & Gu, arXiv:2405.21060, Sec. 6; the state kept on chip). One block owns one
(batch, head, headdim tile) and walks the sequence chunk by chunk (``CHUNK`` tokens, a power of
two chosen here, independent of the contract's ``chunk_size``). Per chunk, all in
registers/shared memory:

    delta  = clamp(softplus(dt + dt_bias), dt_min, dt_max), 0 on padded tokens  # (Q,)    fp32
    cs     = cumsum(delta * A)  (kept as cs2 = cs * log2(e))                   # (Q,)    fp32, <= 0
    w      = delta * exp(cs_last - cs)                                         # (Q,)    fp32
    CB     = C @ B^T                                                           # (Q, Q)  tensor cores, fp32 acc
    M      = CB * exp2(where(i >= j, cs2_i - cs2_j, -inf))                     # (Q, Q)  masked before exp
    y      = M @ (x * delta) + exp(cs)_i * (C @ state^T) + D * x               # (Q, P)
    state  = exp(cs_last) * state + B^T @ (x * w)                              # (N, P)  fp32

Every per-token scaling lands on the narrow operand x (Q, P) or on output rows, so B and C
(Q, N) go from shared memory to the tensor cores untouched. Padded tokens (past ``seqlen``) get
delta = 0: they neither decay nor add, and their y rows are never stored (the store is
bounds-checked). ``C @ B^T`` never leaves the chip.

Launch plans (all share the tile helpers):

* JIT (``ssm_scan``, the TensorRT JIT plugin): :func:`ssd_dt_kernel` computes delta, cs2, w and
  exp(cs) for every token into a small fp32 scratch (the scan loop then reads them with TMA
  instead of strided loads of dt on its critical path); then, when :func:`choose_config` splits
  the sequence into ``nseg`` > 1 segments, :func:`ssd_segment_state_kernel` computes each
  segment's zero-start state and log2-decay; :func:`ssd_scan_kernel` (grid (batch*nheads, nseg,
  headdim tiles)) folds the earlier segments into its entry state and runs the chunk loop.
* AOT (TensorRT ``--plugin aot``): :func:`ssd_fused_kernel`, one launch, the coefficients computed
  inline from dt.

Variants of the scan and fused kernels (compile-time flags, all tested; the segment-state kernel
always holds its state as (headdim, d_state)): ``STATE_T`` keeps the state as (d_state, headdim) so
the inter-chunk product needs no transpose; ``SPLIT_UPD`` adds each chunk's contribution after
its own product instead of accumulating onto the decayed state. Defaults (measured, see
benchmarks/NOTES_ssd.md): STATE_T on, SPLIT_UPD off, chunk 64 (32 for fp32), occupancy hint 2.
Precision: matrix products take operands in the input dtype with fp32 accumulation (bf16/fp16:
wgmma; fp32 inputs: FFMA in the sm_90 SASS, no TF32); the intra-chunk weights, x * delta,
x * w and the state enter the products rounded to the input dtype (mamba_ssm rounds its scaled
operands cb*decay*dt and B*decay*dt instead; same order of error, checked against the float64
oracle); segment sums, exponentials and the state are fp32 (the intra-chunk decay's exp2 flushes
results below 2**-126 to zero, which saves ptxas's denormal fix-up around each MUFU.EX2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

import cuda.tile as ct

from m2export.contract import SSMScanAttrs, SSMScanProblem
from m2export.errors import ContractError
from m2export.kernels.ssd import out_buffers
from m2export.kernels.ssd.naive import SSMScanOutput
from m2export.kernels.ssd.plan import ScanConfig, aot_config, choose_config

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]

SUPPORTED_DIMS = (32, 64, 128, 256)
"""headdim and d_state the kernels compile for (powers of two; tiles must be)."""

_ZERO = ct.PaddingMode.ZERO
_LOG2E = 1.4426950408889634  # exp(v) = exp2(v * log2(e))
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


# ----------------------------------------------------------------------------- tile helpers
def _ct_block_coords(x, heads_per_group):
    """(b, h, g, pt, seqlen) of a block on a (batch*nheads, *, headdim tiles) grid: batch, head,
    its group (contiguous heads per group), headdim tile; x is (batch, seqlen, nheads, headdim)."""
    bh = ct.bid(0)
    nheads = x.shape[2]
    h = bh % nheads
    return bh // nheads, h, h // heads_per_group, ct.bid(2), x.shape[1]


def _ct_chunk_rows(arr, b, c, j, k, CHUNK: ConstInt, WIDTH: ConstInt):
    """Rows of chunk c of arr[b, :, j, k*WIDTH...] ((batch, seqlen, heads or groups, width)) as a
    (CHUNK, WIDTH) tile, zero past seqlen."""
    return ct.load(arr, index=(b, c, j, k), shape=(1, CHUNK, 1, WIDTH), padding_mode=_ZERO).reshape((CHUNK, WIDTH))


def _ct_step_size(v, dt_min, dt_max, DT_SOFTPLUS: ConstBool):
    """clamp(softplus(v), dt_min, dt_max) of the fp32 tile v = dt + dt_bias (softplus passes
    v > 20 through, as torch and mamba_ssm do)."""
    if DT_SOFTPLUS:
        v = ct.where(v > 20.0, v, ct.log(1.0 + ct.exp(ct.minimum(v, 20.0))))
    return ct.minimum(ct.maximum(v, dt_min), dt_max)


def _ct_head_scalars(A, D, dt_bias, h, HAS_D: ConstBool, HAS_DT_BIAS: ConstBool):
    """(1,)-tiles A[h], D[h] (0 if absent) and dt_bias[h] (0 if absent), fp32."""
    a_h = ct.load(A, index=(h,), shape=(1,)).astype(ct.float32)
    if HAS_D:
        d_h = ct.load(D, index=(h,), shape=(1,)).astype(ct.float32)
    else:
        d_h = ct.full((1,), 0.0, dtype=ct.float32)
    if HAS_DT_BIAS:
        bias_h = ct.load(dt_bias, index=(h,), shape=(1,)).astype(ct.float32)
    else:
        bias_h = ct.full((1,), 0.0, dtype=ct.float32)
    return a_h, d_h, bias_h


def _ct_chunk_delta(dt, b, c, h, bias_h, dt_min, dt_max, seqlen, CHUNK: ConstInt, DT_SOFTPLUS: ConstBool):
    """Step sizes of chunk c: clamp(softplus(dt + dt_bias)), exactly 0 on tokens >= seqlen. (CHUNK,) fp32."""
    v = ct.load(dt, index=(b, c, h), shape=(1, CHUNK, 1), padding_mode=_ZERO).reshape((CHUNK,))
    v = _ct_step_size(v.astype(ct.float32) + bias_h, dt_min, dt_max, DT_SOFTPLUS)
    t = c * CHUNK + ct.arange(CHUNK, dtype=ct.int32)
    return ct.where(t < seqlen, v, 0.0)


def _ct_chunk_state_update(state, x_w, B_c, ecs_last, STATE_T: ConstBool, SPLIT_UPD: ConstBool):
    """state -> exp(cs_last) * state + B_c^T @ x_w, with x_w = x_c * w[:, None] (input dtype).

    state is (N, P) fp32 when STATE_T, else (P, N). With SPLIT_UPD the chunk's own contribution
    is a separate product added afterwards, so the only work that waits on the previous state is
    one fused multiply-add; without it the product accumulates onto the decayed state (measured
    2-12% faster on the H200, benchmarks/NOTES_ssd.md, although its PTX is not shorter).
    """
    if STATE_T:
        if SPLIT_UPD:
            return state * ecs_last + ct.mma(B_c.transpose(), x_w, ct.full(state.shape, 0.0, dtype=ct.float32))
        return ct.mma(B_c.transpose(), x_w, state * ecs_last)
    if SPLIT_UPD:
        return state * ecs_last + ct.mma(x_w.transpose(), B_c, ct.full(state.shape, 0.0, dtype=ct.float32))
    return ct.mma(x_w.transpose(), B_c, state * ecs_last)


def _ct_chunk_coeffs(dt, coef, b, c, h, a_h, bias_h, dt_min, dt_max, seqlen, CHUNK: ConstInt,
                     DT_SOFTPLUS: ConstBool, DT_PRE: ConstBool):
    """Per-token coefficients of chunk c, all (CHUNK,) fp32: delta, cs2 = cumsum(delta*A)*log2(e)
    (<= 0, non-increasing), w = delta * exp(cs_last - cs), ecs = exp(cs); and ecs_last = exp(cs_last) (1,).

    DT_PRE: read them from ``coef`` (written by :func:`ssd_dt_kernel`; rows delta, cs2, w, ecs);
    otherwise compute them here from dt (the single-launch plan).
    """
    if DT_PRE:
        delta = ct.load(coef, index=(0, b, h, c), shape=(1, 1, 1, CHUNK)).reshape((CHUNK,))
        cs2 = ct.load(coef, index=(1, b, h, c), shape=(1, 1, 1, CHUNK)).reshape((CHUNK,))
        w = ct.load(coef, index=(2, b, h, c), shape=(1, 1, 1, CHUNK)).reshape((CHUNK,))
        ecs = ct.load(coef, index=(3, b, h, c), shape=(1, 1, 1, CHUNK)).reshape((CHUNK,))
        ecs_last = ct.extract(ecs, index=(CHUNK - 1,), shape=(1,))
    else:
        delta = _ct_chunk_delta(dt, b, c, h, bias_h, dt_min, dt_max, seqlen, CHUNK, DT_SOFTPLUS)
        cs2 = ct.cumsum(delta * (a_h * _LOG2E), 0)  # (Q,) fp32 inclusive, log2 units
        cs2_last = ct.extract(cs2, index=(CHUNK - 1,), shape=(1,))
        w = delta * ct.exp2(cs2_last - cs2)  # exponent <= 0
        ecs = ct.exp2(cs2)
        ecs_last = ct.exp2(cs2_last)
    return delta, cs2, w, ecs, ecs_last


def _ct_scan_chunks(x, dt, coef, B, C, y, b, h, g, pt, c_begin, c_end, state, a_h, d_h, bias_h,
                    dt_min, dt_max, seqlen, CHUNK: ConstInt, BLOCK_P: ConstInt, D_STATE: ConstInt,
                    HAS_D: ConstBool, DT_SOFTPLUS: ConstBool, STATE_T: ConstBool, SPLIT_UPD: ConstBool,
                    DT_PRE: ConstBool):
    """Full SSD over chunks [c_begin, c_end) of one (b, h, p-tile): writes y, returns the state.

    Per-token scalings are applied to the narrow operand: x (Q x P) is scaled by delta and by w
    before the products, and the inter-chunk output row by row by exp(cs) after its product,
    so B and C (Q x N) go to the tensor cores untouched.
    """
    DTYPE = x.dtype
    idx = ct.arange(CHUNK, dtype=ct.int32)
    causal = idx[:, None] >= idx[None, :]
    for c in range(c_begin, c_end):
        delta, cs2, w, ecs, ecs_last = _ct_chunk_coeffs(dt, coef, b, c, h, a_h, bias_h, dt_min, dt_max, seqlen,
                                                        CHUNK, DT_SOFTPLUS, DT_PRE)
        x_c = _ct_chunk_rows(x, b, c, h, pt, CHUNK, BLOCK_P)
        B_c = _ct_chunk_rows(B, b, c, g, 0, CHUNK, D_STATE)
        C_c = _ct_chunk_rows(C, b, c, g, 0, CHUNK, D_STATE)
        xf = x_c.astype(ct.float32)
        # intra-chunk: ((C B^T) * exp(cs_i - cs_j) [i >= j]) @ (delta * x); masked before exp
        cb = ct.mma(C_c, B_c.transpose(), ct.full((CHUNK, CHUNK), 0.0, dtype=ct.float32))
        seg = ct.where(causal, cs2[:, None] - cs2[None, :], -math.inf)
        m = (cb * ct.exp2(seg, flush_to_zero=True)).astype(DTYPE)
        acc = ct.mma(m, (xf * delta[:, None]).astype(DTYPE), ct.full((CHUNK, BLOCK_P), 0.0, dtype=ct.float32))
        if HAS_D:
            acc = acc + d_h * xf
        # inter-chunk: exp(cs_i) * (C @ state^T)_i
        if STATE_T:
            off = ct.mma(C_c, state.astype(DTYPE), ct.full((CHUNK, BLOCK_P), 0.0, dtype=ct.float32))
        else:
            off = ct.mma(C_c, state.transpose().astype(DTYPE), ct.full((CHUNK, BLOCK_P), 0.0, dtype=ct.float32))
        acc = acc + off * ecs[:, None]
        ct.store(y, index=(b, c, h, pt), tile=acc.astype(DTYPE).reshape((1, CHUNK, 1, BLOCK_P)))
        state = _ct_chunk_state_update(state, (xf * w[:, None]).astype(DTYPE), B_c, ecs_last, STATE_T, SPLIT_UPD)
    return state


def _ct_zero_state(BLOCK_P: ConstInt, D_STATE: ConstInt, STATE_T: ConstBool):
    if STATE_T:
        return ct.full((D_STATE, BLOCK_P), 0.0, dtype=ct.float32)
    return ct.full((BLOCK_P, D_STATE), 0.0, dtype=ct.float32)


def _ct_load_state(arr, b, h, pt, BLOCK_P: ConstInt, D_STATE: ConstInt, STATE_T: ConstBool):
    """Rows [pt*BLOCK_P, ...) of arr[b, h] ((headdim, d_state) fp32) in the on-chip layout."""
    if STATE_T:
        return ct.load(arr, index=(b, h, 0, pt), shape=(1, 1, D_STATE, BLOCK_P), order=(0, 1, 3, 2)
                       ).reshape((D_STATE, BLOCK_P)).astype(ct.float32)
    return ct.load(arr, index=(b, h, pt, 0), shape=(1, 1, BLOCK_P, D_STATE)
                   ).reshape((BLOCK_P, D_STATE)).astype(ct.float32)


def _ct_store_state(arr, b, h, pt, state, BLOCK_P: ConstInt, D_STATE: ConstInt, STATE_T: ConstBool):
    if STATE_T:
        ct.store(arr, index=(b, h, 0, pt), tile=state.reshape((1, 1, D_STATE, BLOCK_P)), order=(0, 1, 3, 2))
    else:
        ct.store(arr, index=(b, h, pt, 0), tile=state.reshape((1, 1, BLOCK_P, D_STATE)))


def _ct_load_seg_state(arr, b, h, s, pt, BLOCK_P: ConstInt, D_STATE: ConstInt, STATE_T: ConstBool):
    if STATE_T:
        return ct.load(arr, index=(b, h, s, 0, pt), shape=(1, 1, 1, D_STATE, BLOCK_P), order=(0, 1, 2, 4, 3)
                       ).reshape((D_STATE, BLOCK_P))
    return ct.load(arr, index=(b, h, s, pt, 0), shape=(1, 1, 1, BLOCK_P, D_STATE)).reshape((BLOCK_P, D_STATE))


def _ct_store_seg_state(arr, b, h, s, pt, state, BLOCK_P: ConstInt, D_STATE: ConstInt, STATE_T: ConstBool):
    if STATE_T:
        ct.store(arr, index=(b, h, s, 0, pt), tile=state.reshape((1, 1, 1, D_STATE, BLOCK_P)),
                 order=(0, 1, 2, 4, 3))
    else:
        ct.store(arr, index=(b, h, s, pt, 0), tile=state.reshape((1, 1, 1, BLOCK_P, D_STATE)))


def _ct_initial_state(initial_state, b, h, pt, BLOCK_P: ConstInt, D_STATE: ConstInt, HAS_INIT: ConstBool,
                      STATE_T: ConstBool):
    if HAS_INIT:
        return _ct_load_state(initial_state, b, h, pt, BLOCK_P, D_STATE, STATE_T)
    return _ct_zero_state(BLOCK_P, D_STATE, STATE_T)


# ----------------------------------------------------------------------------- kernels
@ct.kernel
def ssd_dt_kernel(dt, A, dt_bias, coef, dt_min: float, dt_max: float,
                  CHUNK: ConstInt, BLOCK_H: ConstInt, HAS_DT_BIAS: ConstBool, DT_SOFTPLUS: ConstBool):
    """Step-size pre-pass of the two-kernel plans. Grid: (batch, nchunks, cdiv(nheads, BLOCK_H)).

    Block (b, c, hb) turns dt[b, chunk c, heads hb*BLOCK_H...] into the per-token coefficients the
    scan kernels read (fp32, ``coef`` is (4, batch, nheads, nchunks*CHUNK)): row 0 delta =
    clamp(softplus(dt + dt_bias), dt_min, dt_max) (0 past seqlen), row 1 cs2 = log2(e) * cumsum
    within the chunk of delta*A (<= 0), row 2 w = delta*exp(cs_last - cs), row 3 exp(cs). Padded tokens have
    delta = 0, so cs stays flat there: they neither decay nor add.
    """
    b = ct.bid(0)
    c = ct.bid(1)
    hb = ct.bid(2)
    seqlen = dt.shape[1]
    v = ct.load(dt, index=(b, c, hb), shape=(1, CHUNK, BLOCK_H), padding_mode=_ZERO).reshape((CHUNK, BLOCK_H))
    v = v.astype(ct.float32)
    a = ct.load(A, index=(hb,), shape=(BLOCK_H,), padding_mode=_ZERO).astype(ct.float32)
    if HAS_DT_BIAS:
        v = v + ct.load(dt_bias, index=(hb,), shape=(BLOCK_H,), padding_mode=_ZERO).astype(ct.float32)[None, :]
    v = _ct_step_size(v, dt_min, dt_max, DT_SOFTPLUS)
    t = c * CHUNK + ct.arange(CHUNK, dtype=ct.int32)
    delta = ct.where(t[:, None] < seqlen, v, 0.0)
    cs = ct.cumsum(delta * (a * _LOG2E)[None, :], 0)  # log2 units
    cs_last = ct.extract(cs, index=(CHUNK - 1, 0), shape=(1, BLOCK_H))
    w = delta * ct.exp2(cs_last - cs)
    shape = (1, 1, CHUNK, BLOCK_H)
    ct.store(coef, index=(0, b, c, hb), tile=delta.reshape(shape), order=(0, 1, 3, 2))
    ct.store(coef, index=(1, b, c, hb), tile=cs.reshape(shape), order=(0, 1, 3, 2))
    ct.store(coef, index=(2, b, c, hb), tile=w.reshape(shape), order=(0, 1, 3, 2))
    ct.store(coef, index=(3, b, c, hb), tile=ct.exp2(cs).reshape(shape), order=(0, 1, 3, 2))


@ct.kernel
def ssd_fused_kernel(x, dt, A, B, C, D, dt_bias, initial_state, y, final_state,
                     dt_min: float, dt_max: float, heads_per_group: int,
                     CHUNK: ConstInt, BLOCK_P: ConstInt, D_STATE: ConstInt,
                     HAS_D: ConstBool, HAS_DT_BIAS: ConstBool, HAS_INIT: ConstBool, DT_SOFTPLUS: ConstBool,
                     STATE_T: ConstBool, SPLIT_UPD: ConstBool):
    """Single-launch SSD forward. Grid: (batch*nheads, 1, headdim // BLOCK_P).

    Block (bh, 0, pt) owns batch bh // nheads, head bh % nheads, headdim rows
    [pt*BLOCK_P, (pt+1)*BLOCK_P): it walks all chunks of the sequence with its (BLOCK_P, D_STATE)
    fp32 state on chip, writes those rows of y for every token and of final_state at the end.
    Absent optional inputs (HAS_* False) are never read: pass any array there.
    """
    b, h, g, pt, seqlen = _ct_block_coords(x, heads_per_group)
    a_h, d_h, bias_h = _ct_head_scalars(A, D, dt_bias, h, HAS_D, HAS_DT_BIAS)
    state = _ct_initial_state(initial_state, b, h, pt, BLOCK_P, D_STATE, HAS_INIT, STATE_T)
    nchunks = ct.cdiv(seqlen, CHUNK)
    state = _ct_scan_chunks(x, dt, dt, B, C, y, b, h, g, pt, 0, nchunks, state, a_h, d_h, bias_h,
                            dt_min, dt_max, seqlen, CHUNK, BLOCK_P, D_STATE, HAS_D, DT_SOFTPLUS, STATE_T, SPLIT_UPD,
                            False)
    _ct_store_state(final_state, b, h, pt, state, BLOCK_P, D_STATE, STATE_T)


@ct.kernel
def ssd_segment_state_kernel(x, dt, coef, A, B, dt_bias, seg_state, seg_logdecay,
                             dt_min: float, dt_max: float, heads_per_group: int, chunks_per_seg: int,
                             CHUNK: ConstInt, BLOCK_P: ConstInt, D_STATE: ConstInt,
                             HAS_DT_BIAS: ConstBool, DT_SOFTPLUS: ConstBool, DT_PRE: ConstBool):
    """Split plan, pass 1. Grid: (batch*nheads, nseg - 1, headdim // BLOCK_P).

    Block (bh, s, pt) computes, from a zero state, the state segment s alone leaves after its
    chunks [s*chunks_per_seg, (s+1)*chunks_per_seg) -> seg_state[b, h, s, p-tile, :] (fp32), and
    the segment's total log2-decay log2(e)*sum(delta*A) -> seg_logdecay[b, h, s] (every p-tile writes the
    same value). The last segment is never needed by pass 2, hence nseg - 1 blocks along axis 1.

    Unrolling the recurrence state_c = exp(cs_last_c) * state_{c-1} + B_c^T (x_c * w_c), the
    segment's state is sum_c B_c^T (x_c * w_c * exp(sum of cs_last over the chunks after c)). The
    block walks its chunks last to first, so that factor is a running scalar and every chunk is a
    pure accumulation into one product accumulator: no state multiply on the loop's dependency
    chain. The state is held as (headdim, d_state) (x_w^T @ B_c): measured faster here than the
    (d_state, headdim) layout of the scan kernel (benchmarks/NOTES_ssd.md, v6).
    """
    b, h, g, pt, seqlen = _ct_block_coords(x, heads_per_group)
    s = ct.bid(1)
    a_h, _, bias_h = _ct_head_scalars(A, A, dt_bias, h, False, HAS_DT_BIAS)
    nchunks = ct.cdiv(seqlen, CHUNK)
    c_begin = s * chunks_per_seg
    c_end = ct.minimum(c_begin + chunks_per_seg, nchunks)
    state = _ct_zero_state(BLOCK_P, D_STATE, False)
    later = ct.full((1,), 0.0, dtype=ct.float32)  # log2-decay of the chunks after c in this segment (<= 0)
    for i in range(c_end - c_begin):
        c = c_end - 1 - i
        _delta, cs2, w, _ecs, _ecs_last = _ct_chunk_coeffs(dt, coef, b, c, h, a_h, bias_h, dt_min, dt_max, seqlen,
                                                           CHUNK, DT_SOFTPLUS, DT_PRE)
        x_c = _ct_chunk_rows(x, b, c, h, pt, CHUNK, BLOCK_P)
        B_c = _ct_chunk_rows(B, b, c, g, 0, CHUNK, D_STATE)
        x_w = (x_c.astype(ct.float32) * (w * ct.exp2(later))[:, None]).astype(x.dtype)
        state = ct.mma(x_w.transpose(), B_c, state)
        later = later + ct.extract(cs2, index=(CHUNK - 1,), shape=(1,))
    _ct_store_seg_state(seg_state, b, h, s, pt, state, BLOCK_P, D_STATE, False)
    ct.store(seg_logdecay, index=(b, h, s), tile=later.reshape((1, 1, 1)))


@ct.kernel
def ssd_scan_kernel(x, dt, coef, A, B, C, D, dt_bias, initial_state, seg_state, seg_logdecay, y, final_state,
                    dt_min: float, dt_max: float, heads_per_group: int, chunks_per_seg: int,
                    CHUNK: ConstInt, BLOCK_P: ConstInt, D_STATE: ConstInt,
                    HAS_D: ConstBool, HAS_DT_BIAS: ConstBool, HAS_INIT: ConstBool, DT_SOFTPLUS: ConstBool,
                    STATE_T: ConstBool, SPLIT_UPD: ConstBool, DT_PRE: ConstBool):
    """Split plan, pass 2. Grid: (batch*nheads, nseg, headdim // BLOCK_P).

    Block (bh, s, pt) builds its entry state on chip, initial_state folded with segments
    0..s-1 of pass 1 (state = exp(logdecay_s') * state + seg_state_s'), then runs the full SSD
    over segment s's chunks, writing y; the last segment's block writes final_state.
    """
    b, h, g, pt, seqlen = _ct_block_coords(x, heads_per_group)
    s = ct.bid(1)
    nseg = ct.num_blocks(1)
    a_h, d_h, bias_h = _ct_head_scalars(A, D, dt_bias, h, HAS_D, HAS_DT_BIAS)
    state = _ct_initial_state(initial_state, b, h, pt, BLOCK_P, D_STATE, HAS_INIT, STATE_T)
    for sp in range(s):
        ld = ct.load(seg_logdecay, index=(b, h, sp), shape=(1, 1, 1)).reshape((1,))
        st = _ct_load_seg_state(seg_state, b, h, sp, pt, BLOCK_P, D_STATE, STATE_T)
        state = state * ct.exp2(ld) + st
    nchunks = ct.cdiv(seqlen, CHUNK)
    c_begin = s * chunks_per_seg
    c_end = ct.minimum(c_begin + chunks_per_seg, nchunks)
    state = _ct_scan_chunks(x, dt, coef, B, C, y, b, h, g, pt, c_begin, c_end, state, a_h, d_h, bias_h,
                            dt_min, dt_max, seqlen, CHUNK, BLOCK_P, D_STATE, HAS_D, DT_SOFTPLUS, STATE_T, SPLIT_UPD,
                            DT_PRE)
    if s == nseg - 1:
        _ct_store_state(final_state, b, h, pt, state, BLOCK_P, D_STATE, STATE_T)


# ----------------------------------------------------------------------------- launch configuration
_HINTED: dict[tuple[Any, int | None, int | None], Any] = {}


def _hinted(kernel, occupancy: int | None, worker_warps: int | None = None):
    """``kernel`` re-hinted for ``occupancy``/``worker_warps`` (one kernel object, hence one JIT cache, per hint)."""
    if occupancy is None and worker_warps is None:
        return kernel
    key = (kernel, occupancy, worker_warps)
    if key not in _HINTED:
        hints = {k: v for k, v in (("occupancy", occupancy), ("num_worker_warps", worker_warps)) if v is not None}
        _HINTED[key] = kernel.replace_hints(**hints)
    return _HINTED[key]


def _torch_stream(stream, device: torch.device) -> torch.cuda.Stream:
    """The launch stream as a torch stream.

    None -> the current stream of ``device``; a torch stream -> itself; a raw ``cudaStream_t``
    int -> ``torch.cuda.ExternalStream``, except 0 and 1 (``cudaStreamLegacy``), which are the
    legacy default stream: ``torch.cuda.ExternalStream(0)`` is NOT that stream -- torch treats a
    null ``stream_ptr`` as "no pointer given" and hands out a fresh non-blocking pool stream, which
    is ordered neither after the caller's earlier work nor before its later work (that race left
    y unwritten on the JIT plugin's default-stream path, issue 14). 2 (``cudaStreamPerThread``)
    is refused: torch has no stream object for it.
    """
    if stream is None:
        return torch.cuda.current_stream(device)
    if isinstance(stream, int):
        if stream in (0, 1):
            return torch.cuda.default_stream(device)
        if stream == 2:
            raise ContractError("stream: cudaStreamPerThread (2) is not supported; pass the stream's own handle")
        return torch.cuda.ExternalStream(stream, device=device)
    if getattr(stream, "cuda_stream", None) is None:
        raise TypeError(f"stream: expected None, a torch.cuda.Stream or a raw cudaStream_t int, got {type(stream)}")
    return stream


def _fused_args(x, dt, A, B, C, D, dt_bias, initial_state, y, final_state, dt_min, dt_max, *,
                cfg: ScanConfig, heads_per_group: int, dt_softplus: bool):
    d_state = B.shape[3]
    return (x, dt, A, B, C, D if D is not None else A, dt_bias if dt_bias is not None else A,
            initial_state if initial_state is not None else final_state, y, final_state,
            float(dt_min), float(dt_max), int(heads_per_group),
            cfg.chunk, cfg.block_p, d_state,
            D is not None, dt_bias is not None, initial_state is not None, bool(dt_softplus),
            bool(cfg.state_t), bool(cfg.split_upd))


def _fused_grid(batch: int, nheads: int, headdim: int, block_p: int) -> tuple[int, int, int]:
    return (batch * nheads, 1, headdim // block_p)


def _launch(x, dt, A, B, C, D, dt_bias, initial_state, y, final_state, *, cfg: ScanConfig,
            heads_per_group: int, dt_softplus: bool, dt_min: float, dt_max: float, stream: int) -> None:
    batch, seqlen, nheads, headdim = x.shape
    d_state = B.shape[3]
    npt = headdim // cfg.block_p
    nchunks = -(-seqlen // cfg.chunk)
    cps = nchunks if cfg.nseg == 1 else cfg.chunks_per_seg
    if cfg.nseg < 1 or headdim % cfg.block_p or not (cfg.nseg - 1) * cps < nchunks <= cfg.nseg * cps:
        # a plan made for another seqlen would leave chunks unscanned: refuse, never truncate
        raise ContractError(f"config: {cfg} does not cover seqlen {seqlen} ({nchunks} chunks of {cfg.chunk}) "
                            f"and headdim {headdim}; make it with choose_config for this problem")
    if cfg.nseg == 1 and not cfg.dt_pre:
        ct.launch(stream, _fused_grid(batch, nheads, headdim, cfg.block_p),
                  _hinted(ssd_fused_kernel, cfg.occupancy, cfg.worker_warps),
                  _fused_args(x, dt, A, B, C, D, dt_bias, initial_state, y, final_state, dt_min, dt_max,
                              cfg=cfg, heads_per_group=heads_per_group, dt_softplus=dt_softplus))
        return
    bias = dt_bias if dt_bias is not None else A
    if cfg.dt_pre:
        # fp32 per-token coefficients (4 x the size of dt in fp32)
        coef = torch.empty(4, batch, nheads, nchunks * cfg.chunk, dtype=torch.float32, device=x.device)
        block_h = min(32, 1 << (nheads - 1).bit_length())
        ct.launch(stream, (batch, nchunks, -(-nheads // block_h)), ssd_dt_kernel,
                  (dt, A, bias, coef, float(dt_min), float(dt_max), cfg.chunk, block_h, dt_bias is not None,
                   bool(dt_softplus)))
    else:
        coef = A  # never read
    # fp32 scratch: the state each segment alone leaves, and its total log-decay (tiny next to x);
    # a single pass never reads them (pass 2's fold loop is empty): a one-element-per-dim stand-in
    if cfg.nseg > 1:
        seg_state = torch.empty(batch, nheads, cfg.nseg - 1, headdim, d_state, dtype=torch.float32, device=x.device)
        seg_logdecay = torch.empty(batch, nheads, cfg.nseg - 1, dtype=torch.float32, device=x.device)
    else:
        seg_state = torch.empty(1, 1, 1, headdim, d_state, dtype=torch.float32, device=x.device)
        seg_logdecay = torch.empty(1, 1, 1, dtype=torch.float32, device=x.device)
    if cfg.nseg > 1:
        ct.launch(stream, (batch * nheads, cfg.nseg - 1, npt),
                  _hinted(ssd_segment_state_kernel, cfg.seg_occupancy or cfg.occupancy, cfg.worker_warps),
                  (x, dt, coef, A, B, bias, seg_state, seg_logdecay, float(dt_min), float(dt_max),
                   int(heads_per_group), cps, cfg.chunk, cfg.block_p, d_state, dt_bias is not None,
                   bool(dt_softplus), bool(cfg.dt_pre)))
    ct.launch(stream, (batch * nheads, cfg.nseg, npt), _hinted(ssd_scan_kernel, cfg.occupancy, cfg.worker_warps),
              (x, dt, coef, A, B, C, D if D is not None else A, bias,
               initial_state if initial_state is not None else final_state, seg_state, seg_logdecay, y, final_state,
               float(dt_min), float(dt_max), int(heads_per_group), cps,
               cfg.chunk, cfg.block_p, d_state,
               D is not None, dt_bias is not None, initial_state is not None, bool(dt_softplus),
               bool(cfg.state_t), bool(cfg.split_upd), bool(cfg.dt_pre)))


def ssm_scan_cutile(x, dt, A, B, C, D, dt_bias, initial_state, *, problem: SSMScanProblem, dt_softplus: bool,
                    dt_limit: tuple[float, float], out=None, final_state_out=None, stream=None,
                    config: ScanConfig | None = None) -> SSMScanOutput:
    """cuTile SSMScan on validated arguments (see :func:`m2export.kernels.ssd.ssm_scan`).

    Inputs are made contiguous (a copy when they are not); ``out``/``final_state_out`` must be
    contiguous and are written in full. ``config`` overrides :func:`choose_config`. All work is
    queued on ``stream``; inputs produced on another stream must be ordered by the caller.
    """
    dev = x.device
    launch_stream = _torch_stream(stream, dev)
    # everything below (contiguous copies, output and scratch allocation, the launches) is ordered
    # on the launch stream, so the caching allocator ties scratch memory to it
    with torch.cuda.device(dev), torch.cuda.stream(launch_stream):
        x, dt, A, B, C, D, dt_bias, initial_state = (
            None if t is None else t.contiguous() for t in (x, dt, A, B, C, D, dt_bias, initial_state))
        p = problem
        y, final_state = out_buffers(x, p, out, final_state_out, allocate=True)
        if p.batch == 0:
            return SSMScanOutput(y, final_state)
        if p.seqlen == 0:  # nothing to scan: final_state = initial_state (or zeros)
            final_state.copy_(initial_state) if initial_state is not None else final_state.zero_()
            return SSMScanOutput(y, final_state)
        if config is None:
            config = choose_config(p, sm_count=_sm_count(dev))
        _launch(x, dt, A, B, C, D, dt_bias, initial_state, y, final_state, cfg=config,
                heads_per_group=p.heads_per_group, dt_softplus=dt_softplus,
                dt_min=dt_limit[0], dt_max=dt_limit[1], stream=int(launch_stream.cuda_stream))
    return SSMScanOutput(y, final_state)


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SM_COUNT:
        _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SM_COUNT[i]


# ----------------------------------------------------------------------------- AOT (TensorRT plugin)
@dataclass(frozen=True)
class AotParam:
    """One parameter of the exported kernel, in order.

    kind: "array" (name of an SSMScan input/output tensor, ``ndim`` dims, ``dtype``), "scalar"
    (a runtime fp32 value, ``value`` taken from the attributes) or "constant" (compiled in,
    ``value``; not a kernel parameter at run time).
    """

    name: str
    kind: str
    dtype: str | None = None
    ndim: int | None = None
    value: Any = None
    alias: tuple[str, ...] = ()  # alias groups: arrays sharing a group may be the same buffer


@dataclass(frozen=True)
class AotSpec:
    """Everything the TensorRT AOT plugin needs to export and launch the single-launch SSD kernel.

    Attributes:
        kernel: the ``@ct.kernel`` object (:func:`ssd_fused_kernel`, re-hinted for ``config.occupancy``).
        params: the kernel's Python parameters in order (see :class:`AotParam`).
        grid: ``grid(batch, nheads, headdim) -> (gx, gy, gz)``.
        block: None here; cuTile picks the block size at compile time: :meth:`compile` returns it
            (``AotKernel.threads``, the entry's ``.reqntid``; 256 for bf16 headdim 64 d_state 128).
        config: the :class:`ScanConfig` compiled in (nseg is always 1 here).

    Use: ``spec.compile(gpu_code="sm_90")`` (or ``export_kernel(spec.kernel, [spec.signature()], f,
    gpu_code=..., output_format="cubin")``) -> cubin, symbol, threads; launch it on grid
    ``spec.grid(batch, nheads, headdim)`` with the parameters of :meth:`flat_args`. Only headdim,
    d_state, the dtype, the presence flags and dt_softplus are compiled in: batch, seqlen, ngroups
    and dt_limit are runtime values, so one export serves every batch and sequence length.

    Flattening (calling convention ``cutile_python_v1``; verified on CPU-exported sm_90 cubins:
    cuobjdump's EIATTR_KPARAM_INFO and the ``.entry`` of the PTX embedded in the cubin, see
    tests/kernels/test_ssd_aot.py): every array parameter becomes ``1 + 2*ndim`` consecutive entry
    parameters -- base pointer (u64), extents shape[0..ndim) (u32), strides stride[0..ndim) (u32,
    in elements, not bytes; all are passed even where the signature fixes them); a runtime
    scalar is one 4-byte parameter (``dt_min``, ``dt_max``: f32; ``heads_per_group``: u32);
    ``ct.Constant`` parameters are compiled in and take no slot. So the entry takes, in order:
    x (9), dt (7), A (3), B (9), C (9), D (3), dt_bias (3), initial_state (9), y (9),
    final_state (9), dt_min, dt_max, heads_per_group: 73 parameters, 0x14c bytes of parameter
    space. The plugin passes the 10 device pointers (inputs then outputs) and, as extra SymInt32
    arguments, the extents and strides of each tensor (contiguous, row-major) plus the two
    floats' bit patterns and heads_per_group -- :meth:`flat_args` lists them symbolically. The
    signature promises: arrays 16-byte aligned, last stride 1, no aliasing (see :meth:`signature`
    for ``tma``: its default False keeps the entry free of hidden tensor-map parameters). The
    JIT path (ct.launch) derives stride divisibility from the actual tensors and may use TMA.
    """

    kernel: Any
    params: tuple[AotParam, ...]
    grid: Callable[[int, int, int], tuple[int, int, int]]
    block: int | None
    config: ScanConfig
    problem: SSMScanProblem
    attrs: SSMScanAttrs

    def signature(self, *, index_dtype=None, tma: bool = False):
        """:class:`cuda.tile.compilation.KernelSignature` for ``export_kernel`` (contiguous arrays).

        ``tma=False`` (default) promises nothing about strides beyond the last one being 1. With
        ``tma=True`` the strides of x/B/C/y/states are declared multiples of 16 bytes, which lets
        tileiras use the Hopper bulk tensor copy (TMA) -- and then the entry gains one hidden
        128-byte ``.param`` per TMA-loaded array (a CUtensorMap the cuTile launcher encodes on the
        host), which a plain cuLaunchKernel with :meth:`flat_args` does not fill. Keep False for
        the TensorRT plugin unless it encodes those tensor maps itself.
        """
        from cuda.tile.compilation import ArrayConstraint, CallingConvention, KernelSignature, ScalarConstraint

        dts = {"float32": ct.float32, "float16": ct.float16, "bfloat16": ct.bfloat16}
        cons = []
        for prm in self.params:
            if prm.kind == "array":
                # strides in elements: the last is 1 (contiguous); the others are multiples of
                # 16 bytes for every tensor whose inner extent is headdim or d_state (>= 32)
                inner16 = tma and prm.name not in ("dt", "A", "D", "dt_bias")
                cons.append(ArrayConstraint(dts[prm.dtype], prm.ndim, index_dtype=index_dtype or ct.int32,
                                            stride_lower_bound_incl=0, alias_groups=prm.alias, may_alias_internally=False,
                                            stride_constant=(None,) * (prm.ndim - 1) + (1,),
                                            stride_divisible_by=(16 // _ITEMSIZE[prm.dtype] if inner16 else 1,) * (prm.ndim - 1) + (1,),
                                            base_addr_divisible_by=16))
            elif prm.kind == "scalar":
                cons.append(ScalarConstraint(ct.int32 if prm.dtype == "int32" else ct.float32))
            else:
                cons.append(prm.value)
        return KernelSignature(cons, CallingConvention.cutile_python_v1()).with_mangled_symbol(
            self.kernel._pyfunc.__name__)

    def export(self, output_file, *, gpu_code: str = "sm_90") -> str:
        """Compile to a cubin (``output_file``: path or binary file object); returns the entry symbol."""
        from cuda.tile.compilation import export_kernel

        sig = self.signature()
        export_kernel(self.kernel, [sig], output_file, gpu_code=gpu_code, output_format="cubin")
        return sig.symbol

    def compile(self, *, gpu_code: str = "sm_90") -> "AotKernel":
        """Export and read back what the plugin needs: cubin, its embedded PTX, entry symbol, block size."""
        import io

        buf = io.BytesIO()
        symbol = self.export(buf, gpu_code=gpu_code)
        return AotKernel.from_cubin(buf.getvalue(), symbol)

    def flat_args(self) -> list[str]:
        """Symbolic entry parameters in order, e.g. ``['x.ptr', 'x.shape0', ..., 'x.stride3', ...]``."""
        out = []
        for prm in self.params:
            if prm.kind == "array":
                out.append(f"{prm.name}.ptr")
                out += [f"{prm.name}.shape{i}" for i in range(prm.ndim)]
                out += [f"{prm.name}.stride{i}" for i in range(prm.ndim)]
            elif prm.kind == "scalar":
                out.append(prm.name)
        return out


@dataclass(frozen=True)
class AotKernel:
    """A compiled kernel as the TensorRT plugin consumes it.

    cubin: the sm_XX binary from ``export_kernel``. ptx: the PTX tileiras generated, which the
    cubin carries in its ``.nv_debug_ptx_txt`` section (ISA 9.4, ``.target sm_90a`` with CUDA
    13.4: a driver or ptxas older than CUDA 13.4 cannot compile it, so prefer the cubin).
    symbol: the ``.entry`` name. threads: the entry's ``.reqntid`` (block size, x only; y = z = 1).
    param_types: PTX types of the entry parameters in order (``u64`` pointers, ``u32`` extents
    and strides, ``f32``/``u32`` scalars).
    """

    cubin: bytes
    ptx: str | None
    symbol: str
    threads: int | None
    param_types: tuple[str, ...]
    hidden_params: int = 0  # ".hidden .param .b8 [128]" tensor-map slots (0 unless exported with tma=True)

    @classmethod
    def from_cubin(cls, cubin: bytes, symbol: str) -> "AotKernel":
        import re
        import struct

        ptx = None
        shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)

        def header(i):  # (name, type, flags, addr, offset, size, ...)
            return struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)

        names_off = header(shstrndx)[4]
        for i in range(shnum):
            h = header(i)
            start = names_off + h[0]
            if cubin[start:cubin.index(b"\0", start)] == b".nv_debug_ptx_txt":
                ptx = cubin[h[4]:h[4] + h[5]].replace(b"\0", b"\n").decode()
        threads, types = None, ()
        if ptx is not None:
            entry = ptx[ptx.find(".entry"):]
            plist = entry[:entry.find(")")]
            types = tuple(re.findall(r"\.param\s+\.(u64|u32|s32|b32|f32|b64)\s", plist))
            hidden = len(re.findall(r"\.hidden\s+\.param", plist))
            m = re.search(r"\.reqntid\s+(\d+)", ptx)
            threads = int(m.group(1)) if m else None
        else:
            hidden = 0
        return cls(cubin=cubin, ptx=ptx, symbol=symbol, threads=threads, param_types=types, hidden_params=hidden)


def aot_spec(problem: SSMScanProblem, attrs: SSMScanAttrs, *, has_D: bool = True, has_dt_bias: bool = True,
             has_initial_state: bool = True, config: ScanConfig | None = None) -> AotSpec:
    """Describe the single-launch kernel for ``problem``'s headdim/d_state/ngroups/dtype.

    Only headdim, d_state, nheads // ngroups and the dtype are compiled in; batch and seqlen are
    runtime extents, so one export serves every batch and seqlen. In an ONNX graph D, dt_bias
    and initial_state are always present (``has_*`` default True).
    """
    check_supported(problem)
    cfg = config or aot_config(problem)
    dt_name = problem.dtype
    arr = lambda name, nd, dt=dt_name: AotParam(name, "array", dt, nd)  # noqa: E731
    params = (
        arr("x", 4), arr("dt", 3), arr("A", 1, "float32"), arr("B", 4), arr("C", 4),
        arr("D", 1, "float32"), arr("dt_bias", 1, "float32"), arr("initial_state", 4, "float32"),
        arr("y", 4), arr("final_state", 4, "float32"),
        AotParam("dt_min", "scalar", "float32", value=float(attrs.dt_min)),
        AotParam("dt_max", "scalar", "float32", value=float(attrs.dt_max)),
        AotParam("heads_per_group", "scalar", "int32", value=problem.heads_per_group),
        AotParam("CHUNK", "constant", value=cfg.chunk),
        AotParam("BLOCK_P", "constant", value=cfg.block_p),
        AotParam("D_STATE", "constant", value=problem.d_state),
        AotParam("HAS_D", "constant", value=bool(has_D)),
        AotParam("HAS_DT_BIAS", "constant", value=bool(has_dt_bias)),
        AotParam("HAS_INIT", "constant", value=bool(has_initial_state)),
        AotParam("DT_SOFTPLUS", "constant", value=bool(attrs.dt_softplus)),
        AotParam("STATE_T", "constant", value=bool(cfg.state_t)),
        AotParam("SPLIT_UPD", "constant", value=bool(cfg.split_upd)),
    )
    bp = cfg.block_p
    return AotSpec(kernel=_hinted(ssd_fused_kernel, cfg.occupancy), params=params,
                   grid=lambda batch, nheads, headdim: _fused_grid(batch, nheads, headdim, bp),
                   block=None, config=cfg, problem=problem, attrs=attrs)


def check_supported(problem: SSMScanProblem) -> None:
    """Raise ContractError for sizes the kernels cannot do (headdim/d_state outside SUPPORTED_DIMS)."""
    from m2export.errors import ContractError

    for name in ("headdim", "d_state"):
        v = getattr(problem, name)
        if v not in SUPPORTED_DIMS:
            raise ContractError(f"{name}: the cuTile SSD kernel supports {name} in {SUPPORTED_DIMS}, got {v}",
                                hint='pad the model or use backend="torch"')
