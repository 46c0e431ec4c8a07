"""cuTile kernels of CausalConv1d (m2export/contract_conv1d.py): prefill and single-token update, memory-bound.

Order: tile helpers -> ``@ct.kernel`` functions (docstrings name the grid and what a block owns)
-> launch configuration -> :func:`causal_conv1d_cutile` / :func:`conv_update_cutile` (called by
:mod:`m2export.kernels.conv1d`).

Prefill, one launch: a streaming kernel (default :func:`conv1d_stream2d_kernel`, :data:`STREAM_IMPL`; also
:func:`conv1d_stream_kernel`). Block (token range, c-tile, b) walks its tokens ROWS at a time (stream2d: one
(1, ROWS, BLOCK_C) tile per step; stream: one (1, 1, BLOCK_C) row load per token; a row index is a tile
index: no array slices), keeps the last d_conv-1 rows on chip, gathers the d_conv-1 rows before its range
once (from conv_state for tokens < 0), and the block holding the last token writes the final
conv_state. x is read once from DRAM and L2 (v1 below read each row once per tap from L2).

Prefill v1 (``impl="v1"``, kept for benchmarks), two launches. :func:`conv1d_fwd_kernel` computes
the tokens t >= d_conv-1, which read no state: block (t-tile, c-tile, b) owns BLOCK_T tokens x
BLOCK_C channels::

    y[t, c] = act(bias[c] + sum_k weight[c, k] * x[t - (d_conv-1) + k, c])

Tap k is a tile load from ``x.slice(axis=1, start=k)`` (the tap tiles overlap, so DRAM sees x about
once; the rest hits L1/L2). :func:`conv1d_edge_kernel` computes the first d_conv-1 tokens, whose
taps reach into conv_state (gathers: a negative token index is out of bounds of x, giving 0, and in
bounds of conv_state at d_conv-1+t, so the sum of two gathers is the padded input), and writes the
final conv_state (the last d_conv-1 inputs) with a bounds-checked scatter. Accumulation in fp32
in both; y in x's dtype.

Measured (benchmarks/NOTES_fusion.md, H200, mamba2-2.7b 4 x 8192 bf16): v1 448 us, the stream kernel
320-351 us (2.0-2.1x the byte floor), stream2d 256x8x128 at occupancy 8 with the latency hint 287 us (1.75x),
the default (token ranges fitted to whole waves, 16 rows per step, the next step's rows prefetched) 205 us
(1.25x), 198 us (1.21x) with the exp2 SiLU, 195 us (1.19x) with 256-channel tiles of 8 rows (2026-12-04).
Read PTX built with ct.launch's constraints (extents divisible by 16, tests/kernels/test_kernels_compile.py): built
without them, tileiras shows one 2-byte load per element; with them, 16-byte loads. A variant that loads one
(BLOCK_T, 4, BLOCK_C) tile of a window view (x.as_strided with equal token and tap strides) and reduces it over the
taps ran 1.8x slower than v1.

Update (default :func:`conv1d_update_cols_kernel`, :data:`UPDATE_IMPL`). Block (b-tile, c-tile) reads the
window [conv_state columns, x], writes y and the state shifted by one token, in place (each block reads its
state tile before writing it, and no two blocks share one). H200, batch 128 bf16: 15.6 / 19.6 us at
mamba2-2.7b / Nemotron-H-8B against 24.7 / 41.7 for the gather kernel (floor 2.6 / 4.9).

Bytes (prefill): x read and y written once each, 2 * batch * seqlen * conv_dim * itemsize; the
state and weights are small.
"""

from __future__ import annotations

import torch

import cuda.tile as ct

from m2export.contract_conv1d import Conv1dProblem
from m2export.errors import ContractError
from m2export.kernels.conv1d.naive import Conv1dOutput
from m2export.kernels._host import check_out, hinted, launch_stream, sm_count

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
_ZERO = ct.PaddingMode.ZERO
STATE_TILE = 4
"""Tokens/state columns per edge tile: a power of two >= d_conv - 1 (d_conv <= 4, the contract's range)."""
EDGE_BLOCK_C = 128
"""Channels per block of the edge kernel (tiny work: batch * conv_dim * (d_conv - 1) outputs)."""


# ----------------------------------------------------------------------------- tile helpers
LOG2E = 1.4426950408889634
"""log2(e): exp(-v) = exp2(-v * LOG2E)."""
SILU_EXP2 = True
"""SiLU of the conv and gated-norm kernels through exp2 with subnormals flushed (:func:`_ct_silu`); False: ``ct.exp``
(the previous build). Read when a kernel is compiled (a module constant to cuTile)."""


def _ct_silu(v):
    """silu(v) = v / (1 + exp2(-v * log2 e)) of an fp32 tile: exp2 and the approximate division (rcp + mul, ~2 ulp)
    with subnormals flushed to zero (exp2(-v log2 e) overflows to inf for v << 0, giving -0; a subnormal v or result
    gives 0). sm_90 SASS: FMUL, MUFU.EX2, FADD, MUFU.RCP, FMUL per element; ``ct.exp`` without the flush (SILU_EXP2
    False) took 12 (range reduction and rescaling), 448 -> 301 instructions per 16-row step of the streaming conv."""
    if not SILU_EXP2:
        return ct.truediv(v, 1.0 + ct.exp(-v), rounding_mode=ct.RoundingMode.APPROX)
    e = ct.exp2(v * -LOG2E, flush_to_zero=True)
    return ct.truediv(v, 1.0 + e, rounding_mode=ct.RoundingMode.APPROX, flush_to_zero=True)


def _ct_act(v, SILU: ConstBool):
    """silu(v) or v (fp32 tile)."""
    if SILU:
        return _ct_silu(v)
    return v


def _ct_bias(bias, ci, BLOCK_C: ConstInt, HAS_BIAS: ConstBool):
    """bias[c-tile ci] as a (BLOCK_C,) fp32 tile (0 if absent or past conv_dim)."""
    if HAS_BIAS:
        return ct.load(bias, index=(ci,), shape=(BLOCK_C,), padding_mode=_ZERO).astype(ct.float32)
    return ct.full((BLOCK_C,), 0.0, dtype=ct.float32)


def _ct_rows_load(x, index, ROWS: ConstInt, BLOCK_C: ConstInt, LATENCY: ConstInt, CHECK: ConstBool = True):
    """The (1, ROWS, BLOCK_C) tile ``index`` of x (zero past its ends), with the DRAM latency hint LATENCY
    (1..10) or none (0). With a hint of 10 on the streaming kernels' row loads, tileiras issues the loads
    of the next steps before this step's stores (sm_90 PTX read on the CPU: three steps of rows in the
    prologue, one step ahead in the loop). CHECK False: no bounds check (the caller knows the tile lies inside x;
    tileiras 13.4 refuses a padding mode on such a load)."""
    if not CHECK:
        if LATENCY > 0:
            return ct.load(x, index=index, shape=(1, ROWS, BLOCK_C), latency=LATENCY, check_bounds=False)
        return ct.load(x, index=index, shape=(1, ROWS, BLOCK_C), check_bounds=False)
    if LATENCY > 0:
        return ct.load(x, index=index, shape=(1, ROWS, BLOCK_C), padding_mode=_ZERO, latency=LATENCY)
    return ct.load(x, index=index, shape=(1, ROWS, BLOCK_C), padding_mode=_ZERO)


def _n_steps(seqlen, t0, BLOCK_T: ConstInt, ROWS: ConstInt):
    """Steps of ROWS tokens a streaming block starting at token t0 takes: its BLOCK_T tokens, cut at the step holding
    token seqlen - 1, so no row tile it loads lies wholly past the end of x (cuTile leaves such a load undefined)."""
    return min(BLOCK_T, seqlen - t0 + ROWS - 1) // ROWS


def _ct_rows_conv(cur, win, ws, bs, ROWS: ConstInt, BLOCK_C: ConstInt, D_CONV: ConstInt, SILU: ConstBool):
    """One step of the 2-D streaming kernel: the (ROWS, BLOCK_C) fp32 outputs of the (1, ROWS, BLOCK_C) row tile
    ``cur`` and the D_CONV-1 rows ``win`` before it (a tuple of (1, BLOCK_C) fp32 tiles), and the window for the next
    step (its last D_CONV-1 rows). Rows are taken out with ``ct.extract`` and the outputs put back with ``ct.insert``."""
    cur = cur.reshape((ROWS, BLOCK_C)).astype(ct.float32)
    rows = ()
    for i in ct.static_iter(range(ROWS)):
        rows += (ct.extract(cur, (i, 0), (1, BLOCK_C)),)
    full = win + rows
    out = ct.full((ROWS, BLOCK_C), 0.0, dtype=ct.float32)
    for i in ct.static_iter(range(ROWS)):
        acc = bs
        for k in ct.static_iter(range(D_CONV)):
            acc = acc + ws[k] * full[i + k]
        out = ct.insert(out, (i, 0), _ct_act(acc, SILU))
    return out, full[ROWS:]


def _ct_store_final_state(x, conv_state, state_out, b, cidx, D_CONV: ConstInt, HAS_STATE: ConstBool):
    """state_out[b, cidx, :] = the last D_CONV-1 inputs of batch b (state column j holds token
    seqlen - (D_CONV-1) + j; a token < 0 comes from conv_state, out of bounds of x (0) and in bounds of
    conv_state at D_CONV-1+t). Columns past D_CONV-1 and channels past conv_dim are dropped by the
    bounds-checked scatter."""
    j = ct.arange(STATE_TILE, dtype=ct.int32)
    ts = x.shape[1] - (D_CONV - 1) + j  # token held in state column j (< 0: from conv_state)
    st = ct.gather(x, (b, ts[None, :], cidx[:, None]))
    if HAS_STATE:
        st = st + ct.gather(conv_state, (b, cidx[:, None], ts[None, :] + (D_CONV - 1)))
    ct.scatter(state_out, (b, cidx[:, None], j[None, :]), st.astype(state_out.dtype))


# ----------------------------------------------------------------------------- kernels
@ct.kernel
def conv1d_fwd_kernel(x, weight, bias, y, BLOCK_T: ConstInt, BLOCK_C: ConstInt, D_CONV: ConstInt,
                      HAS_BIAS: ConstBool, SILU: ConstBool):
    """Prefill, tokens t >= d_conv-1 (they read no state). Grid: (cdiv(seqlen - (D_CONV-1), BLOCK_T),
    cdiv(conv_dim, BLOCK_C), batch).

    Block (tt, ci, b) owns tokens t = D_CONV-1 + [tt*BLOCK_T, ...) and channels [ci*BLOCK_C, ...)
    of batch b: y[b, t, c] = act(bias[c] + sum_k weight[c, k] * x[b, t - (D_CONV-1) + k, c]); tap k
    is the tile tt of ``x.slice(axis=1, start=k)`` (every start >= 0), y the tile tt of
    ``y.slice(axis=1, start=D_CONV-1)`` (bounds-checked). x: (batch, seqlen, conv_dim), last stride 1.
    """
    tt = ct.bid(0)
    ci = ct.bid(1)
    b = ct.bid(2)
    f32 = ct.float32
    seqlen = x.shape[1]
    acc = ct.full((BLOCK_T, BLOCK_C), 0.0, dtype=f32) + _ct_bias(bias, ci, BLOCK_C, HAS_BIAS)[None, :]
    for k in range(D_CONV):
        xs = ct.load(x.slice(axis=1, start=k, stop=seqlen), index=(b, tt, ci), shape=(1, BLOCK_T, BLOCK_C),
                     padding_mode=_ZERO).reshape((BLOCK_T, BLOCK_C))
        w = ct.load(weight, index=(ci, k), shape=(BLOCK_C, 1), padding_mode=_ZERO).reshape((BLOCK_C,))
        acc = acc + xs.astype(f32) * w.astype(f32)[None, :]
    ct.store(y.slice(axis=1, start=D_CONV - 1, stop=seqlen), index=(b, tt, ci),
             tile=_ct_act(acc, SILU).astype(y.dtype).reshape((1, BLOCK_T, BLOCK_C)))


@ct.kernel
def conv1d_stream_kernel(x, weight, bias, conv_state, y, state_out, BLOCK_T: ConstInt, ROWS: ConstInt,
                         BLOCK_C: ConstInt, D_CONV: ConstInt, HAS_BIAS: ConstBool, HAS_STATE: ConstBool,
                         SILU: ConstBool, LATENCY: ConstInt, PREFETCH: ConstBool, CHECK: ConstBool):
    """Prefill, every token and the final state, one pass over x. Grid: (cdiv(seqlen, BLOCK_T),
    cdiv(conv_dim, BLOCK_C), batch).

    Block (tt, ci, b) owns tokens [tt*BLOCK_T, ...) and channels [ci*BLOCK_C, ...) of batch b. It
    walks its tokens ROWS at a time: each step loads ROWS token rows (one (1, 1, BLOCK_C) tile each,
    a row index being a tile index), computes their outputs from those rows and the D_CONV-1 rows
    before them (kept on chip from the previous step), and stores ROWS rows. The D_CONV-1 rows
    before the block's first token are gathered once (from conv_state for tokens < 0: a negative
    token is out of bounds of x, 0, and in bounds of conv_state at D_CONV-1+t). Rows past seqlen
    read 0 and their stores are dropped. The block holding the last token also writes state_out
    (the last D_CONV-1 inputs, from conv_state when seqlen < D_CONV-1). BLOCK_T % ROWS == 0 and
    ROWS >= D_CONV-1 (the rows kept for the next step are then all rows of this step; with ROWS 2 at
    d_conv 4, where an old row moves within the carried tuple, the H200 gave wrong outputs).
    conv_state and state_out: (batch, conv_dim, D_CONV-1), not aliased. LATENCY: the row loads' DRAM
    latency hint (1..10; 0: the compiler's own), with which tileiras software-pipelines the row loads of
    the next steps ahead of this step's stores (see :func:`_ct_rows_load`). PREFETCH and CHECK: unused here (the
    parameter lists of the streaming kernels are one; see :func:`conv1d_stream2d_kernel`).
    """
    tt = ct.bid(0)
    ci = ct.bid(1)
    b = ct.bid(2)
    f32 = ct.float32
    seqlen = x.shape[1]
    t0 = tt * BLOCK_T
    cidx = ci * BLOCK_C + ct.arange(BLOCK_C, dtype=ct.int32)
    ws = ()
    for k in ct.static_iter(range(D_CONV)):
        ws += (ct.load(weight, index=(ci, k), shape=(BLOCK_C, 1), padding_mode=_ZERO).reshape((BLOCK_C,)).astype(f32),)
    bs = _ct_bias(bias, ci, BLOCK_C, HAS_BIAS)
    win = ()
    for j in ct.static_iter(range(D_CONV - 1)):
        t = t0 - (D_CONV - 1) + j
        r = ct.gather(x, (b, t, cidx)).astype(f32)
        if HAS_STATE:
            r = r + ct.gather(conv_state, (b, cidx, t + (D_CONV - 1))).astype(f32)
        win += (r,)
    for s in range(_n_steps(seqlen, t0, BLOCK_T, ROWS)):
        t1 = t0 + s * ROWS
        rows = ()
        for i in ct.static_iter(range(ROWS)):
            rows += (_ct_rows_load(x, (b, t1 + i, ci), 1, BLOCK_C, LATENCY).reshape((BLOCK_C,)).astype(f32),)
        full = win + rows
        for i in ct.static_iter(range(ROWS)):
            acc = bs
            for k in ct.static_iter(range(D_CONV)):
                acc = acc + ws[k] * full[i + k]
            ct.store(y, index=(b, t1 + i, ci), tile=_ct_act(acc, SILU).astype(y.dtype).reshape((1, 1, BLOCK_C)))
        win = full[ROWS:]
    if t0 + BLOCK_T >= seqlen:
        _ct_store_final_state(x, conv_state, state_out, b, cidx, D_CONV, HAS_STATE)


@ct.kernel
def conv1d_stream2d_kernel(x, weight, bias, conv_state, y, state_out, BLOCK_T: ConstInt, ROWS: ConstInt,
                           BLOCK_C: ConstInt, D_CONV: ConstInt, HAS_BIAS: ConstBool, HAS_STATE: ConstBool,
                           SILU: ConstBool, LATENCY: ConstInt, PREFETCH: ConstBool, CHECK: ConstBool):
    """Prefill as :func:`conv1d_stream_kernel` (same grid, block ownership, carried rows, gathers and final
    state), with 2-D tiles: each step loads its ROWS token rows as one (1, ROWS, BLOCK_C) tile (16-byte
    loads), takes the rows out with ``ct.extract`` for the taps, puts the outputs back with ``ct.insert``
    and stores them as one (1, ROWS, BLOCK_C) tile. Weights are gathered (one strided element per channel
    and tap). ROWS a power of two >= D_CONV-1, BLOCK_T % ROWS == 0 (BLOCK_T any such multiple); LATENCY as in
    the streaming kernel (no effect on this kernel's sm_90 SASS: read on the CPU).

    PREFETCH: the next step's row tile is loaded before this step's outputs are computed (carried in registers;
    the last step re-loads its own tile, so no load lies past x's end). Without it each step's 16-byte loads are
    consumed right after they are issued (sm_90 SASS: LDG.E.128 then STS.128 of the same registers): one DRAM
    latency per step per block, which bounded the kernel at ~2.9 TB/s at 8 blocks per SM (benchmarks/NOTES_fusion.md).

    CHECK False: the row loads and the y stores without bounds checks, for launches whose every row tile lies inside x
    and y (conv_dim % BLOCK_C == 0 and seqlen % ROWS == 0: the launcher decides, :func:`stream_unchecked`); the
    gathers (window, weights, final state) stay checked. sm_90 SASS, 16-row bf16 step: 301 -> 242 instructions.
    """
    tt = ct.bid(0)
    ci = ct.bid(1)
    b = ct.bid(2)
    f32 = ct.float32
    seqlen = x.shape[1]
    t0 = tt * BLOCK_T
    steps = BLOCK_T // ROWS
    cidx = ci * BLOCK_C + ct.arange(BLOCK_C, dtype=ct.int32)
    ws = ()
    for k in ct.static_iter(range(D_CONV)):
        ws += (ct.gather(weight, (cidx, k)).astype(f32).reshape((1, BLOCK_C)),)
    bs = _ct_bias(bias, ci, BLOCK_C, HAS_BIAS).reshape((1, BLOCK_C))
    win = ()
    for j in ct.static_iter(range(D_CONV - 1)):
        t = t0 - (D_CONV - 1) + j
        r = ct.gather(x, (b, t, cidx)).astype(f32)
        if HAS_STATE:
            r = r + ct.gather(conv_state, (b, cidx, t + (D_CONV - 1))).astype(f32)
        win += (r.reshape((1, BLOCK_C)),)
    n = _n_steps(seqlen, t0, BLOCK_T, ROWS)
    if PREFETCH:
        cur = _ct_rows_load(x, (b, tt * steps, ci), ROWS, BLOCK_C, LATENCY, CHECK)
        for s in range(n):
            # the next step's rows (the last step re-reads its own: no tile past x's end), loaded before this step's
            nxt = _ct_rows_load(x, (b, tt * steps + min(s + 1, n - 1), ci), ROWS, BLOCK_C, LATENCY, CHECK)
            out, win = _ct_rows_conv(cur, win, ws, bs, ROWS, BLOCK_C, D_CONV, SILU)
            ct.store(y, index=(b, tt * steps + s, ci), tile=out.astype(y.dtype).reshape((1, ROWS, BLOCK_C)),
                     check_bounds=CHECK)
            cur = nxt
    else:
        for s in range(n):
            cur = _ct_rows_load(x, (b, tt * steps + s, ci), ROWS, BLOCK_C, LATENCY, CHECK)
            out, win = _ct_rows_conv(cur, win, ws, bs, ROWS, BLOCK_C, D_CONV, SILU)
            ct.store(y, index=(b, tt * steps + s, ci), tile=out.astype(y.dtype).reshape((1, ROWS, BLOCK_C)),
                     check_bounds=CHECK)
    if t0 + BLOCK_T >= seqlen:
        _ct_store_final_state(x, conv_state, state_out, b, cidx, D_CONV, HAS_STATE)


@ct.kernel
def conv1d_edge_kernel(x, weight, bias, conv_state, y, state_out, BLOCK_C: ConstInt, D_CONV: ConstInt,
                       HAS_BIAS: ConstBool, HAS_STATE: ConstBool, SILU: ConstBool):
    """Prefill, the tokens that read conv_state and the final state. Grid: (cdiv(conv_dim, BLOCK_C), batch, 1).

    Block (ci, b) owns channels [ci*BLOCK_C, ...) of batch b: y for tokens t < min(D_CONV-1, seqlen)
    and state_out[b, c-tile, :] (the last D_CONV-1 inputs). It gathers the padded input
    xp[t + k] (t + k - (D_CONV-1) < 0: conv_state[b, c, t + k], else x[b, t + k - (D_CONV-1), c]) as
    the sum of two gathers: a negative token index is out of bounds of x (0) and in bounds of
    conv_state. Tiles are (STATE_TILE, BLOCK_C); columns past the array are dropped by the
    bounds-checked scatters. conv_state and state_out: (batch, conv_dim, D_CONV-1), not aliased.
    """
    ci = ct.bid(0)
    b = ct.bid(1)
    f32 = ct.float32
    seqlen = x.shape[1]
    j = ct.arange(STATE_TILE, dtype=ct.int32)
    cidx = ci * BLOCK_C + ct.arange(BLOCK_C, dtype=ct.int32)
    acc = ct.full((STATE_TILE, BLOCK_C), 0.0, dtype=f32) + _ct_bias(bias, ci, BLOCK_C, HAS_BIAS)[None, :]
    for k in range(D_CONV):
        tk = j - (D_CONV - 1) + k  # token read by tap k for output token j (< 0: from conv_state)
        xs = ct.gather(x, (b, tk[:, None], cidx[None, :])).astype(f32)
        if HAS_STATE:
            xs = xs + ct.gather(conv_state, (b, cidx[None, :], tk[:, None] + (D_CONV - 1))).astype(f32)
        w = ct.load(weight, index=(ci, k), shape=(BLOCK_C, 1), padding_mode=_ZERO).reshape((BLOCK_C,))
        acc = acc + xs * w.astype(f32)[None, :]
    keep = (j[:, None] < D_CONV - 1) & (j[:, None] < seqlen)
    ct.scatter(y, (b, j[:, None], cidx[None, :]), _ct_act(acc, SILU).astype(y.dtype), mask=keep)
    _ct_store_final_state(x, conv_state, state_out, b, cidx, D_CONV, HAS_STATE)


@ct.kernel
def conv1d_update_kernel(x, weight, bias, conv_state, y,
                         BLOCK_B: ConstInt, BLOCK_C: ConstInt, D_CONV: ConstInt,
                         HAS_BIAS: ConstBool, SILU: ConstBool):
    """Single-token update, in place on conv_state. Grid: (cdiv(batch, BLOCK_B), cdiv(conv_dim, BLOCK_C), 1).

    Block (bb, ci) owns rows [bb*BLOCK_B, ...) and channels [ci*BLOCK_C, ...): reads x (batch,
    conv_dim) and its conv_state tile (batch, conv_dim, D_CONV-1), writes y (batch, conv_dim) and
    the state shifted by one token (oldest dropped, x appended).
    """
    bb = ct.bid(0)
    ci = ct.bid(1)
    f32 = ct.float32
    W = STATE_TILE
    j = ct.arange(W, dtype=ct.int32)
    bidx = bb * BLOCK_B + ct.arange(BLOCK_B, dtype=ct.int32)
    cidx = ci * BLOCK_C + ct.arange(BLOCK_C, dtype=ct.int32)
    xt = ct.load(x, index=(bb, ci), shape=(BLOCK_B, BLOCK_C), padding_mode=_ZERO).astype(f32)
    st = ct.gather(conv_state, (bidx[:, None, None], cidx[None, :, None], j[None, None, :])).astype(f32)
    # window [state columns 0..D_CONV-2, x] (column D_CONV-1 of the state tile is out of bounds: 0)
    win = ct.where(j[None, None, :] == D_CONV - 1, xt[:, :, None], st)
    w = ct.gather(weight, (cidx[:, None], j[None, :])).astype(f32)  # (BLOCK_C, W), 0 past d_conv
    acc = ct.sum(win * w[None, :, :], axis=2) + _ct_bias(bias, ci, BLOCK_C, HAS_BIAS)[None, :]
    nxt = ct.gather(conv_state, (bidx[:, None, None], cidx[None, :, None], j[None, None, :] + 1)).astype(f32)
    new = ct.where(j[None, None, :] == D_CONV - 2, xt[:, :, None], nxt)
    ct.store(y, index=(bb, ci), tile=_ct_act(acc, SILU).astype(y.dtype))
    ct.scatter(conv_state, (bidx[:, None, None], cidx[None, :, None], j[None, None, :]), new.astype(conv_state.dtype))


@ct.kernel
def conv1d_update_cols_kernel(x, weight, bias, conv_state, y, BLOCK_B: ConstInt, BLOCK_C: ConstInt, D_CONV: ConstInt,
                              HAS_BIAS: ConstBool, SILU: ConstBool):
    """Single-token update as :func:`conv1d_update_kernel` (same grid, block ownership, in place on conv_state),
    with plain tile loads and stores instead of 3-D gathers: state column j of the block is the
    (BLOCK_B, BLOCK_C, 1) tile (bb, ci, j) of conv_state (no index tiles: the gathers' int32 index tensors
    took 255 registers per thread, sm_90 CPU build), the weights' tap k the (BLOCK_C, 1) tile (ci, k). Every
    column is read before any is written (the stores use the values just loaded, the same tiles)."""
    bb = ct.bid(0)
    ci = ct.bid(1)
    f32 = ct.float32
    xt = ct.load(x, index=(bb, ci), shape=(BLOCK_B, BLOCK_C), padding_mode=_ZERO).astype(f32)
    cols = ()
    for j in ct.static_iter(range(D_CONV - 1)):
        cols += (ct.load(conv_state, index=(bb, ci, j), shape=(BLOCK_B, BLOCK_C, 1),
                         padding_mode=_ZERO).reshape((BLOCK_B, BLOCK_C)).astype(f32),)
    win = cols + (xt,)
    acc = ct.full((BLOCK_B, BLOCK_C), 0.0, dtype=f32) + _ct_bias(bias, ci, BLOCK_C, HAS_BIAS)[None, :]
    for k in ct.static_iter(range(D_CONV)):
        w = ct.load(weight, index=(ci, k), shape=(BLOCK_C, 1), padding_mode=_ZERO).reshape((BLOCK_C,)).astype(f32)
        acc = acc + win[k] * w[None, :]
    ct.store(y, index=(bb, ci), tile=_ct_act(acc, SILU).astype(y.dtype))
    for j in ct.static_iter(range(D_CONV - 1)):
        ct.store(conv_state, index=(bb, ci, j),
                 tile=win[j + 1].astype(conv_state.dtype).reshape((BLOCK_B, BLOCK_C, 1)))


# ----------------------------------------------------------------------------- launch configuration
def choose_fwd_tiles(p: Conv1dProblem) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_C) of the streaming prefill kernel, no occupancy hint: 16 tokens x 128 channels,
    the fastest of the configurations timed on the H200 (benchmarks/NOTES_fusion.md: 448 us at
    mamba2-2.7b 4 x 8192 bf16, against 972 us for 16 x 256 and 590 us for 32 x 128); smaller tiles
    for tiny problems."""
    bt = 16 if p.seqlen > 8 else 4
    bc = 128 if p.conv_dim > 64 else max(16, 1 << (p.conv_dim - 1).bit_length())
    return bt, bc


def choose_update_tiles(p: Conv1dProblem) -> tuple[int, int]:
    """(BLOCK_B, BLOCK_C) of the update: 4 rows x 256 channels (H200, batch 128 bf16, cols kernel: 15.7 / 19.6 us
    at mamba2-2.7b / Nemotron-H-8B; 8x256 14.8 / 23.6, 2x512 16.0 / 22.5, 16x128 15.3 / 25.0)."""
    bb = min(4, 1 << max(0, p.batch - 1).bit_length())
    bc = 256 if p.conv_dim > 128 else max(16, 1 << (p.conv_dim - 1).bit_length())
    return bb, bc


UPDATE_IMPL = "cols"
"""The single-token update's kernel by default: "cols" (:func:`conv1d_update_cols_kernel`, plain tile loads, 84
registers at 4 x 256 bf16 in the sm_90 CPU build) or "gather" (:func:`conv1d_update_kernel`, 255 registers)."""

STREAM_IMPL = "stream2d"
"""The prefill's kernel by default: "stream2d" (:func:`conv1d_stream2d_kernel`) or "stream"
(:func:`conv1d_stream_kernel`). H200, bf16, 2026-12-02 (benchmarks/NOTES_fusion.md): stream2d 256x8x128 with
occupancy 8 and latency 10 286.8 / 93.6 us at mamba2-2.7b 4x8192 / 1x8192 and 482.5 / 139.3 at Nemotron-H-8B,
against 351.3 / 96.8 and 643.5 / 157.8 for the stream kernel at 256x8x256 (no hints) in the same run."""

STREAM_OCCUPANCY = 8
"""The streaming prefill's blocks-per-SM hint by default (sm_90 CPU build of stream2d 256x8x128 bf16 with it: 63
registers, 7 KB of shared memory, no spills: eight blocks of 128 threads per SM)."""

STREAM_LATENCY = 10
"""The streaming prefill's row-load latency hint by default (1..10; 0: none, the compiler's own)."""

STREAM_PREFETCH = True
"""The 2-D streaming kernel loads the next step's rows before computing this step's (:func:`conv1d_stream2d_kernel`).
With :data:`STREAM_FIT_WAVES` and :data:`STREAM_STEP_BYTES` 4096 (H200, bf16, 2026-12-02 18:20 UTC,
benchmarks/NOTES_fusion.md): 204.9 / 58.6 us at mamba2-2.7b 4x8192 / 1x8192, 365.7 / 101.0 at Nemotron-H-8B, against
283.3 / 92.2 and 478.9 / 137.8 without the three (256x8x128, no prefetch). Default since its float64 GPU oracle tests
passed (H200, 2026-12-03, NOTES_fusion.md); False: the previous kernel (its sm_90 SASS unchanged)."""

STREAM_FIT_WAVES = True
""":func:`choose_stream_tiles` fits the token range to whole waves of blocks (False: 256 tokens, halved down to 16
while the grid has fewer than 4 blocks per SM). See :data:`STREAM_PREFETCH`."""

STREAM_STEP_BYTES = 4096
"""Bytes of x one step of a streaming block loads (:func:`choose_stream_tiles`: 4096 gives 8 rows of 256 bf16
channels, the default :data:`STREAM_BLOCK_C`, 16 of 128, 8 of 128 fp32 channels, whose 16-row build spills); None: 8
rows. See :data:`STREAM_PREFETCH`."""

STREAM_BLOCK_C = {2: 256, 4: 128}
"""Channels per streaming block by default, by element size (:func:`choose_stream_tiles`). 2-byte dtypes: 256, i.e. 8
rows of 512 B per step with :data:`STREAM_STEP_BYTES` (sm_90 CPU build: 64 registers, 26 KB shared memory, no spills,
317 SASS instructions and 9 barriers per step against 301 and 3 at 16 x 128). H200, bf16, 2026-12-04, bench_layer.py
(two A/B repeats each, benchmarks/NOTES_fusion.md): 195.0-195.4 / 55.2-55.4 us at mamba2-2.7b 4x8192 / 1x8192 and
92.5 at Nemotron-H-8B 1x8192 against 197.8-198.2 / 56.0-56.1 / 93.4-93.7 with 128 channels; Nemotron-H 4x8192
349.2-349.6 against 347.1-347.3 (0.7% slower). fp32: 128 (256 channels passed the oracle tests, not timed)."""

STREAM_UNCHECKED = False
"""True: launches of :func:`conv1d_stream2d_kernel` whose row tiles all lie inside x (:func:`stream_unchecked`) use its
unchecked build (CHECK False, 242 instead of 301 SASS instructions per 16-row bf16 step); False (default): always the
checked one. Off because it was no faster: H200, 2026-12-03, two runs, unchecked vs checked at mamba2-2.7b / Nemotron-H
4x8192 and 1x8192: 198.8 / 56.7 / 349.3 / 95.4 vs 197.8 / 55.8 / 348.4 / 94.7 us, and 202.0 / 57.4 / 349.1 / 97.9 vs
198.5 / 56.4 / 348.4 / 94.8 (benchmarks/NOTES_fusion.md); both builds passed the float64 oracle tests."""

STREAM_KERNELS = {"stream": conv1d_stream_kernel, "stream2d": conv1d_stream2d_kernel}
"""The prefill's streaming kernels by ``impl`` name (same parameters, grid and tiles)."""


def stream_kernel(impl: str = STREAM_IMPL, occupancy: int = STREAM_OCCUPANCY):
    """The streaming prefill kernel ``impl`` with the blocks-per-SM hint ``occupancy`` (0: none); the JIT launcher
    and the AOT plugin (m2export/plugins/fused_trt.py) both take the kernel from here."""
    return hinted(STREAM_KERNELS[impl], occupancy or None)


def choose_stream_tiles(p: Conv1dProblem, itemsize: int, sm_count: int = 132, occupancy: int = STREAM_OCCUPANCY,
                        rows: int | None = None, fit: bool | None = None,
                        step_bytes: int | None = STREAM_STEP_BYTES, block_c: int | None = None) -> tuple[int, int, int]:
    """(BLOCK_T, ROWS, BLOCK_C) of the streaming kernels for ``occupancy`` blocks per SM on ``sm_count`` SMs.

    BLOCK_C: ``block_c`` channels, a power of two (default :data:`STREAM_BLOCK_C` for ``itemsize``: 256 for 2-byte
    dtypes, 128 for fp32; smaller for narrow problems). ROWS (unless given): ``step_bytes`` of x per step (4096: 8 rows
    of 256 bf16 channels, 16 of 128, 8 of 128 fp32 channels, whose 16-row build spills at 64 registers), at least
    d_conv - 1; None: 8 rows.
    BLOCK_T, ``fit`` (default :data:`STREAM_FIT_WAVES`): the blocks are equal and run in waves of ``occupancy *
    sm_count``, so a last wave that is partly empty costs a whole one (H200, stream2d 256x8x128: time =
    ceil(blocks / 1056) x 48 us at every layer shape, benchmarks/NOTES_fusion.md). The token range is fitted to
    whole waves: the wave count 256-token ranges would give, rounded, then the longest range (a multiple of ROWS)
    whose blocks fit in that many waves (mamba2-2.7b 1 x 8192 at 128 channels: 336 tokens, 1,050 blocks in one wave;
    256: 1,344, two waves; at 256 channels 168 tokens, 1,029 blocks). Without ``fit``: 256 tokens, halved down to 16
    while the grid has fewer than 4 blocks per SM."""
    bc = min(block_c or STREAM_BLOCK_C.get(itemsize, 128), max(16, 1 << max(0, p.conv_dim - 1).bit_length()))
    pow2 = 1 << max(0, p.d_conv - 2).bit_length()  # the smallest power of two >= d_conv - 1
    rows = rows or (max(pow2, min(16, step_bytes // (bc * itemsize))) if step_bytes else 8)
    cols = -(-p.conv_dim // bc) * max(1, p.batch)
    if not (STREAM_FIT_WAVES if fit is None else fit):
        bt = 256
        while bt > 16 and -(-p.seqlen // bt) * -(-p.conv_dim // bc) * p.batch < 4 * sm_count:
            bt //= 2
        return max(rows, min(bt, rows * -(-p.seqlen // rows))), rows, bc
    slots = max(1, occupancy) * sm_count
    waves = max(1, round(-(-p.seqlen // 256) * cols / slots))
    ranges = max(1, waves * slots // cols)  # token ranges per (channel tile, sequence)
    bt = rows * -(-(-(-p.seqlen // ranges)) // rows)
    return bt, rows, bc


def stream_unchecked(p: Conv1dProblem, tiles: tuple[int, int, int], unchecked: bool | None = None) -> bool:
    """Whether a streaming launch with ``tiles`` (BLOCK_T, ROWS, BLOCK_C) may skip the row tiles' bounds checks: every
    (1, ROWS, BLOCK_C) tile a block loads or stores lies inside x and y when conv_dim % BLOCK_C == 0 and seqlen % ROWS
    == 0 (token ranges are ROWS multiples; a block's steps stop at the one holding the last token). ``unchecked``
    None: :data:`STREAM_UNCHECKED`; False: never."""
    on = STREAM_UNCHECKED if unchecked is None else bool(unchecked)
    return on and p.conv_dim % tiles[2] == 0 and p.seqlen % tiles[1] == 0


def check_stream_tiles(impl: str, tiles: tuple[int, int, int], d_conv: int) -> None:
    """Raise ContractError unless ``tiles`` (BLOCK_T, ROWS, BLOCK_C) fit the streaming kernel ``impl``: BLOCK_T a
    multiple of ROWS, ROWS >= d_conv - 1 (with fewer rows per step the stream kernel gave wrong outputs on the
    H200), ROWS a power of two for stream2d."""
    bt, rows, bc = tiles
    if bt % rows or rows < d_conv - 1 or (impl == "stream2d" and rows & (rows - 1)):
        raise ContractError(f"tiles: {tuple(tiles)} need BLOCK_T a multiple of ROWS and ROWS >= d_conv - 1 "
                            f"({d_conv - 1}; a power of two for 'stream2d'): with fewer rows per step the "
                            "kernel gave wrong outputs on the H200")


def causal_conv1d_cutile(x, weight, bias, conv_state, *, problem: Conv1dProblem, silu: bool, out=None,
                         state_out=None, stream=None, tiles: tuple[int, ...] | None = None,
                         occupancy: int | None = None, impl: str | None = None,
                         latency: int | None = None, prefetch: bool | None = None,
                         unchecked: bool | None = None) -> Conv1dOutput:
    """cuTile prefill on validated arguments (see :func:`m2export.kernels.conv1d.causal_conv1d`).

    ``x`` is used in place when its last stride is 1 (any other strides, e.g. a slice of the
    in_proj output); weight/bias/conv_state are made contiguous. ``impl`` (default :data:`STREAM_IMPL`):
    "stream2d" (:func:`conv1d_stream2d_kernel`) or "stream" (:func:`conv1d_stream_kernel`), one launch,
    ``tiles`` = (BLOCK_T, ROWS, BLOCK_C) overriding :func:`choose_stream_tiles` (ROWS a power of two for
    stream2d), ``occupancy`` the blocks-per-SM hint (default :data:`STREAM_OCCUPANCY`, 0: none), ``latency``
    the row-load hint (default :data:`STREAM_LATENCY`; 1..10, 0: none), ``prefetch`` the next step's rows loaded
    ahead (default :data:`STREAM_PREFETCH`; stream2d only), ``unchecked`` the row tiles' bounds checks skipped where
    every tile lies inside x (default :data:`STREAM_UNCHECKED`, :func:`stream_unchecked`; stream2d only); "v1": :func:`conv1d_fwd_kernel` +
    :func:`conv1d_edge_kernel`, ``tiles`` = (BLOCK_T, BLOCK_C) overriding :func:`choose_fwd_tiles`, no hint
    unless ``occupancy`` (benchmarks).
    """
    from m2export.kernels.conv1d import conv_out_buffers

    impl = STREAM_IMPL if impl is None else impl
    if impl not in ("stream", "stream2d", "v1"):
        raise ContractError(f"impl: expected 'stream', 'stream2d' or 'v1', got {impl!r}")
    lat = STREAM_LATENCY if latency is None else int(latency)
    if not 0 <= lat <= 10:
        raise ContractError(f"latency: expected 0 (no hint) or 1..10, got {latency!r}")
    p = problem
    dev = x.device
    stream_ = launch_stream(stream, dev)
    with torch.cuda.device(dev), torch.cuda.stream(stream_):
        weight, bias, conv_state = (None if t is None else t.contiguous() for t in (weight, bias, conv_state))
        y, st_out = conv_out_buffers(x, p, out, state_out, allocate=True)
        if p.batch == 0:
            return Conv1dOutput(y, st_out)
        if p.seqlen == 0:
            st_out.copy_(conv_state) if conv_state is not None else st_out.zero_()
            return Conv1dOutput(y, st_out)
        raw = int(stream_.cuda_stream)
        b_arg = bias if bias is not None else weight
        s_arg = conv_state if conv_state is not None else st_out
        if impl in ("stream", "stream2d"):
            occ = STREAM_OCCUPANCY if occupancy is None else occupancy
            bt, rows, bc = tiles or choose_stream_tiles(p, x.element_size(), sm_count(dev), occ or STREAM_OCCUPANCY)
            check_stream_tiles(impl, (bt, rows, bc), p.d_conv)
            ct.launch(raw, (-(-p.seqlen // bt), -(-p.conv_dim // bc), p.batch), stream_kernel(impl, occ),
                      (x, weight, b_arg, s_arg, y, st_out, bt, rows, bc, p.d_conv, bias is not None,
                       conv_state is not None, bool(silu), lat, STREAM_PREFETCH if prefetch is None else bool(prefetch),
                       not stream_unchecked(p, (bt, rows, bc), unchecked)))
            return Conv1dOutput(y, st_out)
        bt, bc = tiles or choose_fwd_tiles(p)
        n_main = p.seqlen - (p.d_conv - 1)
        if n_main > 0:
            ct.launch(raw, (-(-n_main // bt), -(-p.conv_dim // bc), p.batch), hinted(conv1d_fwd_kernel, occupancy or None),
                      (x, weight, b_arg, y, bt, bc, p.d_conv, bias is not None, bool(silu)))
        ct.launch(raw, (-(-p.conv_dim // EDGE_BLOCK_C), p.batch, 1), conv1d_edge_kernel,
                  (x, weight, b_arg, s_arg, y, st_out, EDGE_BLOCK_C,
                   p.d_conv, bias is not None, conv_state is not None, bool(silu)))
    return Conv1dOutput(y, st_out)


def conv_update_cutile(x, conv_state, weight, bias, *, problem: Conv1dProblem, silu: bool, out=None,
                       stream=None, tiles: tuple[int, int] | None = None, impl: str | None = None) -> Conv1dOutput:
    """cuTile single-token update on validated arguments, in place on ``conv_state`` (which must be
    contiguous); see :func:`m2export.kernels.conv1d.conv_update`. ``impl``: "cols"
    (:func:`conv1d_update_cols_kernel`) or "gather" (:func:`conv1d_update_kernel`); default
    :data:`UPDATE_IMPL`. ``tiles`` = (BLOCK_B, BLOCK_C) overrides :func:`choose_update_tiles`."""
    impl = UPDATE_IMPL if impl is None else impl
    if impl not in ("cols", "gather"):
        raise ContractError(f"impl: expected 'cols' or 'gather', got {impl!r}")
    p = problem
    dev = x.device
    if not conv_state.is_contiguous():
        raise ContractError("conv_state: the in-place update needs a contiguous conv_state, got strides "
                            f"{tuple(conv_state.stride())}")
    stream_ = launch_stream(stream, dev)
    with torch.cuda.device(dev), torch.cuda.stream(stream_):
        weight, bias = (None if t is None else t.contiguous() for t in (weight, bias))
        if out is None:
            out = torch.empty(p.batch, p.conv_dim, dtype=x.dtype, device=dev)
        check_out("out", out, (p.batch, p.conv_dim), x.dtype, dev)
        if p.batch == 0:
            return Conv1dOutput(out, conv_state)
        bb, bc = tiles or choose_update_tiles(p)
        kern = conv1d_update_cols_kernel if impl == "cols" else conv1d_update_kernel
        ct.launch(int(stream_.cuda_stream), (-(-p.batch // bb), -(-p.conv_dim // bc), 1), kern,
                  (x, weight, bias if bias is not None else weight, conv_state, out, bb, bc, p.d_conv,
                   bias is not None, bool(silu)))
    return Conv1dOutput(out, conv_state)
