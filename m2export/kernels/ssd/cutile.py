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
    hi, lo = cumsum(delta * A * log2(e)) in double-float (hi + lo; lo its residual) # (Q,)    fp32, hi <= 0
    r, dl  = exp2(lo), delta * exp2(-lo)                                        # (Q,)    fp32
    w      = delta * exp2((hi_last - hi) + (lo_last - lo))                      # (Q,)    fp32
    CB     = C @ B^T                                                           # (Q, Q)  tensor cores, fp32 acc
    M      = CB * exp2(where(i >= j, hi_i - hi_j, -inf))                       # (Q, Q)  masked before exp
    y      = r_i * (M @ (x * dl)) + exp2(hi)_i * (C @ state^T) + D * x          # (Q, P)
    state  = exp2(hi_last) * state + B^T @ (x * w)                             # (N, P)  fp32

Segment sums (issue 16): the decay of tokens j < i is exp2(hi_i - hi_j + lo_i - lo_j); hi_i - hi_j is
rounded relative to the segment and the residuals lo (the part of the cumulative sum that fp32 cannot
hold: ~ulp(|cs|), i.e. ~2.4e-4 at |cs| = 4,000) enter as a row factor r_i and a column factor on
x_j, so every decay exponent is accurate to the fp32 rounding of the segment's own terms, not of the
running sum (the old exp2(cs2_i - cs2_j) was 1.4e-4 rel-L2 from float64 on sums of -4,000 per 64
tokens, tests/kernels/test_ssd.py::test_large_decay_sums_fp32, where the bound is 5e-6). The decays from
the chunk start, exp2(hi_i) on the inter-chunk rows and exp2(hi_last) on the carried state, leave out
exp2(lo): either is a normal fp32 number only while |hi| < 126, where |lo| <= ulp(hi) / 2 <= 2**-18, so the
factor left out is within 2.7e-6 of 1 (fp32 rounding); below that the decay itself flushes to 0.

Every per-token scaling lands on the narrow operand x (Q, P) or on output rows, so B and C
(Q, N) go from shared memory to the tensor cores untouched. Padded tokens (past ``seqlen``) get
delta = 0: they neither decay nor add, and their y rows are never stored (the store is
bounds-checked). ``C @ B^T`` never leaves the chip (except in ``cb_pre`` plans, below).

Launch plans (all share the tile helpers):

* JIT (``ssm_scan``, the TensorRT JIT plugin): :func:`ssd_dt_kernel` computes dl, hi, r, w and
  exp2(hi) for every token into a small fp32 scratch (the scan loop then reads them with TMA
  instead of strided loads of dt on its critical path); then, when :func:`choose_config` splits
  the sequence into ``nseg`` > 1 segments, :func:`ssd_segment_state_kernel` computes each
  segment's zero-start state and log2-decay; :func:`ssd_scan_kernel` (grid (batch*nheads, nseg,
  headdim tiles)) folds the earlier segments into its entry state and runs the chunk loop. A headdim that
  block_p does not divide takes one launch pair per power-of-two piece, or one pair whose blocks also own the
  narrower tail (``HAS_TAIL``: 80 = 64 + 16, sharing C @ B^T and the loads; ``plan.launch_pieces``). With
  ``cb_pre`` (``ScanConfig.cb_pre``; 2 for bf16 d_state-256 heuristic tiles, else 0 by default) :func:`ssd_cb_kernel`
  first writes every chunk's C @ B^T once per group (1: fp32) or its masked, decayed M once per head with r and dl
  folded in (2: input dtype, r_i M_ij dl_j) to an HBM scratch, and the chunk
  loop reads it instead of recomputing it per head and headdim tile.
* AOT (TensorRT ``--plugin aot``): :func:`ssd_fused_kernel`, one launch, the coefficients computed
  inline from dt.

Variants of the scan and fused kernels (compile-time flags, all tested; the segment-state kernel
always holds its state as (headdim, d_state)): ``STATE_T`` keeps the state as (d_state, headdim) so
the inter-chunk product needs no transpose; ``SPLIT_UPD`` adds each chunk's contribution after
its own product instead of accumulating onto the decayed state. Defaults (measured, see
benchmarks/NOTES_ssd.md): STATE_T on (off for bf16 d_state 256 at 16-row tiles), SPLIT_UPD off, chunk 64 (32 for
fp32), occupancy hint 2.
Precision: matrix products take operands in the input dtype with fp32 accumulation (bf16/fp16:
wgmma; fp32 inputs: FFMA in the sm_90 SASS, no TF32); the intra-chunk weights, x * delta,
x * w and the state enter the products rounded to the input dtype (mamba_ssm rounds its scaled
operands cb*decay*dt and B*decay*dt instead; same order of error, checked against the float64
oracle); segment sums, exponentials and the state are fp32 (the intra-chunk decay's exp2 flushes
results below 2**-126 to zero, which saves ptxas's denormal fix-up around each MUFU.EX2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

import cuda.tile as ct

from m2export.contract import SSMScanAttrs, SSMScanProblem
from m2export.errors import ContractError
from m2export.kernels import launch as L
from m2export.kernels._host import (cached_plan, check_supported, hinted, launch_stream, out_buffers, sm_count,
                                    unit_stride)
from m2export.kernels.launch import Launch
from m2export.kernels.ssd.naive import SSMScanOutput
from m2export.kernels import _tune
from m2export.kernels.ssd.plan import (HeaddimPiece, ScanConfig, TileFamily, aot_config, choose_config,
                                      config_for, headdim_pieces, launch_pieces, packed_config, tile_families)

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]

_ZERO = ct.PaddingMode.ZERO
_LOG2E = 1.4426950408889634  # exp(v) = exp2(v * log2(e))
#: floor of every token's log2-decay step delta * A * log2(e) in the prefill kernels (:func:`_ct_log2_steps`): -2**16,
#: i.e. dt*A below -45426, whose exp is exactly 0 even in float64, so the floor never changes the answer; inputs with
#: every dt*A >= -45426 are unchanged bit for bit. Why (benchmarks/NOTES_ssd.md, "dt*A at -inf"): unfloored, a
#: -inf step (dt*A overflowing float32) makes the double-float cumsum's TwoSum -inf - -inf = NaN, and a huge finite
#: one (in-chunk sums below ~-1.5e9) leaves a residual |lo| ~ ulp(hi) so large that r = exp2(lo) = 0 and
#: dl = delta * exp2(-lo) = inf: 0 * inf = NaN in y. Floored, a chunk of <= 256 tokens keeps |hi| <= 2**24, so
#: |lo| <= 1 (r, dl / delta within [1/2, 2]: no fp16 overflow of x * dl either), and exp2 of any segment holding a
#: floored step is exactly 0 in fp32. Not the ONNX bodies' DA_FLOOR (-1e30, m2export/exporter/ssm_scan_op.py):
#: that one is far too low for the double-float residuals.
LOG2_STEP_FLOOR = -65536.0
_SEQ_TILE = 64  # cu_seqlens entries compared per step when the packed pre-pass finds each token's sequence


# ----------------------------------------------------------------------------- tile helpers
def _ct_tile(arr, index, shape, TMA: ConstBool, PAD: ConstBool = False):
    """``ct.load`` of one tile (PAD: zero past the array's ends). TMA False forbids a TMA copy
    (``allow_tma=False``: the TensorRT AOT build, whose launcher cannot pass the tensor maps TMA needs); True leaves
    the choice to the compiler with no hint at all, so the JIT builds are the same as without this switch."""
    if PAD:
        if TMA:
            return ct.load(arr, index=index, shape=shape, padding_mode=_ZERO)
        return ct.load(arr, index=index, shape=shape, padding_mode=_ZERO, allow_tma=False)
    if TMA:
        return ct.load(arr, index=index, shape=shape)
    return ct.load(arr, index=index, shape=shape, allow_tma=False)


def _ct_put(arr, index, tile, TMA: ConstBool):
    """``ct.store`` of one tile, TMA as in :func:`_ct_tile`."""
    if TMA:
        ct.store(arr, index=index, tile=tile)
    else:
        ct.store(arr, index=index, tile=tile, allow_tma=False)


def _ct_block_coords(x, heads_per_group, P_TILE0: ConstInt):
    """(b, h, g, pt, seqlen) of a block on a (batch*nheads, *, headdim tiles) grid: batch, head,
    its group (contiguous heads per group), headdim tile (P_TILE0 + its index on the grid's axis 2,
    in units of the block's tile width); x is (batch, seqlen, nheads, headdim)."""
    bh = ct.bid(0)
    nheads = x.shape[2]
    h = bh % nheads
    return bh // nheads, h, h // heads_per_group, ct.bid(2) + P_TILE0, x.shape[1]


def _ct_chunk_rows(arr, b, c, j, k, CHUNK: ConstInt, WIDTH: ConstInt, TMA: ConstBool = True):
    """Rows of chunk c of arr[b, :, j, k*WIDTH...] ((batch, seqlen, heads or groups, width)) as a
    (CHUNK, WIDTH) tile, zero past seqlen (TMA: :func:`_ct_tile`)."""
    return _ct_tile(arr, (b, c, j, k), (1, CHUNK, 1, WIDTH), TMA, True).reshape((CHUNK, WIDTH))


def _ct_step_size(v, dt_min, dt_max, DT_SOFTPLUS: ConstBool):
    """clamp(softplus(v), dt_min, dt_max) of the fp32 tile v = dt + dt_bias (softplus passes
    v > 20 through, as torch and mamba_ssm do); a NaN stays NaN, as in torch (ct.minimum / ct.maximum drop a NaN
    operand unless propagate_nan: a NaN dt became the step size 20, or dt_min without softplus, a finite answer)."""
    if DT_SOFTPLUS:
        v = ct.where(v > 20.0, v, ct.log(1.0 + ct.exp(ct.minimum(v, 20.0, propagate_nan=True))))
    return ct.minimum(ct.maximum(v, dt_min, propagate_nan=True), dt_max, propagate_nan=True)


def _ct_head_scalars(A, D, dt_bias, h, HAS_D: ConstBool, HAS_DT_BIAS: ConstBool, TMA: ConstBool = True):
    """(1,)-tiles A[h], D[h] (0 if absent) and dt_bias[h] (0 if absent), fp32."""
    a_h = _ct_tile(A, (h,), (1,), TMA).astype(ct.float32)
    if HAS_D:
        d_h = _ct_tile(D, (h,), (1,), TMA).astype(ct.float32)
    else:
        d_h = ct.full((1,), 0.0, dtype=ct.float32)
    if HAS_DT_BIAS:
        bias_h = _ct_tile(dt_bias, (h,), (1,), TMA).astype(ct.float32)
    else:
        bias_h = ct.full((1,), 0.0, dtype=ct.float32)
    return a_h, d_h, bias_h


def _ct_chunk_delta(dt, b, c, h, bias_h, dt_min, dt_max, seqlen, CHUNK: ConstInt, DT_SOFTPLUS: ConstBool,
                    TMA: ConstBool = True):
    """Step sizes of chunk c: clamp(softplus(dt + dt_bias)), exactly 0 on tokens >= seqlen. (CHUNK,) fp32."""
    v = _ct_tile(dt, (b, c, h), (1, CHUNK, 1), TMA, True).reshape((CHUNK,))
    v = _ct_step_size(v.astype(ct.float32) + bias_h, dt_min, dt_max, DT_SOFTPLUS)
    t = c * CHUNK + ct.arange(CHUNK, dtype=ct.int32)
    return ct.where(t < seqlen, v, 0.0)


def _ct_log2_steps(delta, a):
    """Each token's log2-decay step delta * A * log2(e) (fp32, <= 0) from the step sizes ``delta`` and A ``a``
    (broadcastable fp32 tiles), floored at :data:`LOG2_STEP_FLOOR` (-inf included); a NaN stays NaN (a where on
    v < floor: ct.maximum would drop the NaN). The one place the prefill kernels form dA."""
    v = delta * (a * _LOG2E)
    return ct.where(v < LOG2_STEP_FLOOR, LOG2_STEP_FLOOR, v)


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


def _ct_two_sum(a, b):
    """(s, e) with s = fl(a + b) and s + e == a + b exactly (Knuth's TwoSum; no FMA, no reassociation)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _ct_df_add(h1, l1, h2, l2):
    """Double-float sum (h1 + l1) + (h2 + l2), renormalised so that |l| <= ulp(h) / 2 (the combine of
    :func:`_ct_df_cumsum`)."""
    s, e = _ct_two_sum(h1, h2)
    e = e + (l1 + l2)
    h = s + e
    return h, e - (h - s)


def _ct_df_cumsum(v, AXIS: ConstInt):
    """Inclusive cumsum of the fp32 tile ``v`` along AXIS in double-float: (hi, lo), hi = fl32 of the sum
    (up to the last bit), lo its residual (|lo| <= ulp(hi) / 2); hi + lo is the exact prefix sum to ~2**-44
    relative. A ct.scan of :func:`_ct_df_add` (fp32 only; an fp64 cumsum gave the same sm_90 build of the
    fused kernel: see benchmarks/NOTES_ssd.md, issue 16)."""
    return ct.scan((v, ct.zeros(v.shape, dtype=ct.float32)), AXIS, _ct_df_add, (0.0, 0.0))


def _ct_seg_df_add(h1, l1, f1, h2, l2, f2):
    """Segmented double-float sum: (h2, l2) where the right operand starts a segment (f2 = 1), else
    :func:`_ct_df_add` of both; the flag ORs (associative, so a ct.scan of it restarts at every flag)."""
    h, l = _ct_df_add(h1, l1, h2, l2)
    start = f2 > 0.0
    return ct.where(start, h2, h), ct.where(start, l2, l), ct.maximum(f1, f2)


def _ct_seg_df_cumsum(v, flag, AXIS: ConstInt):
    """(hi, lo, flags seen) of :func:`_ct_df_cumsum` restarted wherever ``flag`` (fp32 0/1, shape of v) is 1: the
    packed form's sum from the token's own sequence start (or the chunk start, whichever is later)."""
    return ct.scan((v, ct.zeros(v.shape, dtype=ct.float32), flag), AXIS, _ct_seg_df_add, (0.0, 0.0, 0.0))


def _ct_token_seq(cu_seqlens, t, CHUNK: ConstInt):
    """Sequence index of each packed token t ((CHUNK,) int32): #{s : cu_seqlens[s + 1] <= t}, so empty
    sequences own no token and tokens past the end get nseq; with whether t starts its sequence (fp32 0/1)."""
    nseq = cu_seqlens.shape[0] - 1
    cnt = ct.zeros((CHUNK,), dtype=ct.int32)
    for k in range(ct.cdiv(nseq, _SEQ_TILE)):
        ends = ct.gather(cu_seqlens, k * _SEQ_TILE + 1 + ct.arange(_SEQ_TILE, dtype=ct.int32),
                         padding_value=2147483647)
        cnt = cnt + ct.sum(ct.where(ends[None, :] <= t[:, None], 1, 0), axis=1)
    first = ct.where(ct.gather(cu_seqlens, cnt) == t, 1.0, 0.0)
    return cnt, first


def _ct_decay_terms(delta, hi, lo, hi_last, lo_last):
    """Decay coefficients of one chunk, all fp32, in log2 units, from the step sizes ``delta`` (fp32)
    and the double-float inclusive cumsum (hi, lo) of delta * A * log2(e) along the tokens
    (:func:`_ct_df_cumsum`), with (hi_last, lo_last) its last token's (broadcastable). Returns
    (dl, hi, r, w, ecs):

    * hi (<= 0): the intra-chunk exponent of tokens (i, j) is fl(hi_i - hi_j) + lo_i - lo_j;
    * r = exp2(lo), a factor on output row i, and dl = delta * exp2(-lo), the step size scaling x_j:
      together exp2(lo_i - lo_j);
    * w = delta * exp2((hi_last - hi) + (lo_last - lo)) (the decay to the chunk end);
    * ecs = exp2(hi) (the decay from the chunk start; its own terms).

    Why (issue 16): in fp32, cs_i - cs_j carries the rounding of cs itself (thousands when dt is large:
    an absolute error of ~ulp(|cs|) in every exponent). fl(hi_i - hi_j) is rounded relative to the
    segment, and lo_i - lo_j restores what rounding cs to fp32 lost, so every segment sum is accurate
    to the fp32 rounding of its own terms.
    """
    w = delta * ct.exp2((hi_last - hi) + (lo_last - lo))  # exponent <= 0
    return delta * ct.exp2(-lo), hi, ct.exp2(lo), w, ct.exp2(hi)


def _ct_chunk_coeffs(dt, coef, b, c, h, a_h, bias_h, dt_min, dt_max, seqlen, CHUNK: ConstInt,
                     DT_SOFTPLUS: ConstBool, DT_PRE: ConstBool, TMA: ConstBool = True):
    """Per-token coefficients of chunk c, all (CHUNK,) fp32 (see :func:`_ct_decay_terms`): dl, hi, r,
    w, ecs; and the chunk's total log2-decay hi_last (1,) and ecs_last = exp2(cs_last) (1,).

    DT_PRE: read them from ``coef`` (written by :func:`ssd_dt_kernel`; rows dl, hi, r, w, ecs);
    otherwise compute them here from dt (the single-launch plan).
    """
    if DT_PRE:
        dl = ct.load(coef, index=(0, b, h, c), shape=(1, 1, 1, CHUNK)).reshape((CHUNK,))
        hi = ct.load(coef, index=(1, b, h, c), shape=(1, 1, 1, CHUNK)).reshape((CHUNK,))
        r = ct.load(coef, index=(2, b, h, c), shape=(1, 1, 1, CHUNK)).reshape((CHUNK,))
        w = ct.load(coef, index=(3, b, h, c), shape=(1, 1, 1, CHUNK)).reshape((CHUNK,))
        ecs = ct.load(coef, index=(4, b, h, c), shape=(1, 1, 1, CHUNK)).reshape((CHUNK,))
    else:
        delta = _ct_chunk_delta(dt, b, c, h, bias_h, dt_min, dt_max, seqlen, CHUNK, DT_SOFTPLUS, TMA)
        hi, lo = _ct_df_cumsum(_ct_log2_steps(delta, a_h), 0)  # (Q,) inclusive
        dl, hi, r, w, ecs = _ct_decay_terms(delta, hi, lo, ct.extract(hi, index=(CHUNK - 1,), shape=(1,)),
                                            ct.extract(lo, index=(CHUNK - 1,), shape=(1,)))
    hi_last = ct.extract(hi, index=(CHUNK - 1,), shape=(1,))
    ecs_last = ct.extract(ecs, index=(CHUNK - 1,), shape=(1,))
    return dl, hi, r, w, ecs, hi_last, ecs_last


def _ct_chunk_out(x_c, xf, m, C_c, state, dl, r, ecs, d_h, CHUNK: ConstInt, WIDTH: ConstInt, HAS_D: ConstBool,
                  STATE_T: ConstBool, M_SCALED: ConstBool, OFF_GIVEN: ConstBool, off_in):
    """y rows of one chunk for one headdim tile, (CHUNK, WIDTH) fp32: r_i * (m @ (dl * x)) + D * x + exp2(hi_i) *
    (C @ state^T)_i, from x (x_c, input dtype; xf, fp32), the chunk's masked, decayed C @ B^T ``m`` (input dtype) and
    the tile's entry state. M_SCALED: ``m`` already holds r_i * M_ij * dl_j (:func:`ssd_cb_kernel`), so x enters
    its product as loaded (no per-chunk scaling, store and barrier before it). OFF_GIVEN: ``off_in`` is C @ state^T
    (fp32, computed with C @ B^T in one product, :func:`_ct_cb_and_state_rows`); else it is not read."""
    DTYPE = m.dtype
    if M_SCALED:
        acc = ct.mma(m, x_c, ct.full((CHUNK, WIDTH), 0.0, dtype=ct.float32))
    else:
        acc = ct.mma(m, (xf * dl[:, None]).astype(DTYPE), ct.full((CHUNK, WIDTH), 0.0, dtype=ct.float32))
        acc = acc * r[:, None]
    if HAS_D:
        acc = acc + d_h * xf
    # inter-chunk: exp(cs_i) * (C @ state^T)_i
    if OFF_GIVEN:
        off = off_in
    elif STATE_T:
        off = ct.mma(C_c, state.astype(DTYPE), ct.full((CHUNK, WIDTH), 0.0, dtype=ct.float32))
    else:
        off = ct.mma(C_c, state.transpose().astype(DTYPE), ct.full((CHUNK, WIDTH), 0.0, dtype=ct.float32))
    return acc + off * ecs[:, None]


def _ct_cb_and_state_rows(C_c, B_c, state, CHUNK: ConstInt, STATE_T: ConstBool):
    """(C @ B^T, C @ state^T) of one chunk, both (CHUNK, CHUNK) fp32, from ONE product C_c @ [B_c^T | state^T]
    ((CHUNK, d_state) @ (d_state, 2 * CHUNK); the state's headdim tile must be CHUNK rows wide): one wgmma group and
    one wait instead of two on the chunk's serial chain (tileiras waits for every product before the next;
    ScanConfig.cb_state, benchmarks/NOTES_ssd.md). The state enters in C's dtype, as in :func:`_ct_chunk_out`."""
    if STATE_T:
        sop = state.astype(C_c.dtype)
    else:
        sop = state.transpose().astype(C_c.dtype)
    both = ct.mma(C_c, ct.cat((B_c.transpose(), sop), 1), ct.full((CHUNK, 2 * CHUNK), 0.0, dtype=ct.float32))
    return (ct.extract(both, index=(0, 0), shape=(CHUNK, CHUNK)),
            ct.extract(both, index=(0, 1), shape=(CHUNK, CHUNK)))


def _ct_packed_chunk(y, initial_state, final_state, cu_seqlens, seq_idx, sq, c, xf, m, B_c, C_c, state, dl, hi, r,
                     w, ecs, ecs_last, d_h, h, pt, CHUNK: ConstInt, BLOCK_P: ConstInt, D_STATE: ConstInt,
                     HAS_D: ConstBool, HAS_INIT: ConstBool, STATE_T: ConstBool, SPLIT_UPD: ConstBool):
    """One chunk of the packed form (batch 1): writes its y rows and the final state of every sequence whose
    last token (or, when empty, whose offset) falls in it; returns the state carried into the next chunk.

    ``sq``: each token's sequence; ``m``: C @ B^T masked (before exp) to pairs of one sequence, j <= i;
    hi/ecs from the pre-pass sum from the later of the token's sequence start and the chunk start, w is that
    of the chunk's last sequence (:func:`ssd_dt_kernel`, PACKED). ``state``: the state of the sequence running
    at the chunk's start, read only by the rows of that sequence when it began before the chunk; every
    sequence that starts inside reads its own initial state (HAS_INIT; else zeros), decayed from its start
    (mamba_ssm's ``seq_idx`` semantics, :func:`m2export.kernels.ssd.packed.ssm_scan_packed_chunked`).
    """
    DTYPE = m.dtype
    nseq = cu_seqlens.shape[0] - 1
    cstart = c * CHUNK
    idx = ct.arange(CHUNK, dtype=ct.int32)
    s_first = ct.extract(sq, index=(0,), shape=(1,)).item()
    s_last = ct.minimum(ct.extract(sq, index=(CHUNK - 1,), shape=(1,)).item(), nseq - 1)
    first_before = ct.gather(cu_seqlens, s_first) < cstart
    zero = ct.full((CHUNK, BLOCK_P), 0.0, dtype=ct.float32)
    acc = ct.mma(m, (xf * dl[:, None]).astype(DTYPE), zero) * r[:, None]
    if HAS_D:
        acc = acc + d_h * xf
    carry_rows = (sq == s_first) & first_before
    acc = acc + _ct_state_rows(C_c, state, zero, STATE_T) * ct.where(carry_rows, ecs, 0.0)[:, None]
    if HAS_INIT:  # the sequences that start in this chunk read their own initial state
        for s in range(s_first + ct.where(first_before, 1, 0), s_last + 1):
            h0 = _ct_load_state(initial_state, s, h, pt, BLOCK_P, D_STATE, STATE_T)
            acc = acc + _ct_state_rows(C_c, h0, zero, STATE_T) * ct.where(sq == s, ecs, 0.0)[:, None]
    ct.store(y, index=(0, c, h, pt), tile=acc.astype(DTYPE).reshape((1, CHUNK, 1, BLOCK_P)))
    # final states: the sequences s with cu_seqlens[s + 1] in (cstart, cstart + CHUNK] (chunk 0 also takes the
    # empty ones at offset 0): s_begin .. s_end - 1, where s_end = the sequence of the next chunk's first token
    s_begin = ct.where(c == 0, 0, s_first)
    s_end = ct.gather(seq_idx, cstart + CHUNK, padding_value=nseq)
    for s in range(s_begin, s_end):
        a = ct.gather(cu_seqlens, s) - cstart  # < 0: the sequence began before this chunk (reads ``state``)
        e = ct.gather(cu_seqlens, s + 1) - cstart  # one past its last token
        own = sq == s
        at_end = idx == e - 1
        hi_t = ct.sum(ct.where(at_end, hi, 0.0))
        r_t = ct.sum(ct.where(at_end, r, 0.0))
        # w of the segment (j, last token]: delta_j exp2(hi_t - hi_j + lo_t - lo_j) = dl_j r_t exp2(hi_t - hi_j)
        w_t = dl * ct.exp2(ct.where(own, hi_t - hi, -math.inf)) * r_t
        if HAS_INIT:
            base = ct.where(a < 0, state, _ct_load_state(initial_state, s, h, pt, BLOCK_P, D_STATE, STATE_T))
        else:
            base = ct.where(a < 0, state, 0.0)
        ecs_t = ct.where(a == e, 1.0, ct.exp2(hi_t))  # an empty sequence keeps its state
        fs = _ct_chunk_state_update(base, (xf * w_t[:, None]).astype(DTYPE), B_c, ecs_t, STATE_T, True)
        _ct_store_state(final_state, s, h, pt, fs, BLOCK_P, D_STATE, STATE_T)
    # the state carried on: the chunk's last sequence's, from its initial state if it starts in this chunk
    if ct.gather(cu_seqlens, s_last) >= cstart:
        if HAS_INIT:
            state = _ct_load_state(initial_state, s_last, h, pt, BLOCK_P, D_STATE, STATE_T)
        else:
            state = _ct_zero_state(BLOCK_P, D_STATE, STATE_T)
    return _ct_chunk_state_update(state, (xf * w[:, None]).astype(DTYPE), B_c, ecs_last, STATE_T, SPLIT_UPD)


def _ct_decayed(cb, hi, causal, DTYPE):
    """M = (C B^T) * exp2(where(i >= j, hi_i - hi_j, -inf)) of one chunk in ``DTYPE`` (masked before exp; flush to
    zero), from cb = C @ B^T (CHUNK, CHUNK) fp32 and the head's intra-chunk exponents hi (CHUNK,)."""
    seg = ct.where(causal, hi[:, None] - hi[None, :], -math.inf)
    return (cb * ct.exp2(seg, flush_to_zero=True)).astype(DTYPE)


def _ct_state_rows(C_c, state, zero, STATE_T: ConstBool):
    """C_c @ state^T, (CHUNK, width) fp32: each row's read of ``state`` (fp32, the on-chip layout)."""
    if STATE_T:
        return ct.mma(C_c, state.astype(C_c.dtype), zero)
    return ct.mma(C_c, state.transpose().astype(C_c.dtype), zero)


def _ct_scan_chunks(x, dt, coef, B, C, y, b, h, g, pt, c_begin, c_end, state, state2, a_h, d_h, bias_h,
                    dt_min, dt_max, seqlen, CHUNK: ConstInt, BLOCK_P: ConstInt, D_STATE: ConstInt,
                    HAS_D: ConstBool, DT_SOFTPLUS: ConstBool, STATE_T: ConstBool, SPLIT_UPD: ConstBool,
                    DT_PRE: ConstBool, HAS_TAIL: ConstBool, TAIL_P: ConstInt, TAIL_TILE: ConstInt,
                    initial_state, final_state, cu_seqlens, seq_idx, HAS_INIT: ConstBool, PACKED: ConstBool,
                    cb_pre, CB_PRE: ConstInt, CB_STATE: ConstBool, TMA: ConstBool = True):
    """Full SSD over chunks [c_begin, c_end) of one (b, h, p-tile): writes y, returns (state, state2).
    TMA False: no TMA copies of x, dt, B, C or y (:func:`_ct_tile`).

    CB_STATE (not with PACKED or CB_PRE; BLOCK_P == CHUNK): the chunk's C @ B^T and the tile's C @ state^T are one
    product (:func:`_ct_cb_and_state_rows`); C is then loaded with a latency-1 hint (one TMA stage fewer, 108 KB of
    shared memory instead of 116 at d_state 128, so that two blocks fit per SM). The tail's (HAS_TAIL) product stays
    separate.

    CB_PRE (not with PACKED; written by :func:`ssd_cb_kernel`): 1, the chunk's C @ B^T is read from ``cb_pre``
    ((batch, ngroups, nchunks*CHUNK, CHUNK) fp32) instead of computed by every head and headdim tile of the group;
    2, the masked, decayed M (below) is read from ``cb_pre`` ((batch, nheads, nchunks*CHUNK, CHUNK), input dtype).

    HAS_TAIL: the block also owns the TAIL_P rows from row TAIL_TILE * TAIL_P (a headdim's narrower last
    piece, :func:`m2export.kernels.ssd.plan.launch_pieces`), with its own state ``state2``; they share
    the chunk's coefficients, the B and C loads and the masked, decayed C @ B^T. Without it ``state2`` is
    returned untouched.

    Per-token scalings are applied to the narrow operand: x (Q x P) is scaled by delta and by w
    before the products, and the inter-chunk output row by row by exp(cs) after its product,
    so B and C (Q x N) go to the tensor cores untouched.
    """
    DTYPE = x.dtype
    idx = ct.arange(CHUNK, dtype=ct.int32)
    causal = idx[:, None] >= idx[None, :]
    for c in range(c_begin, c_end):
        dl, hi, r, w, ecs, _hi_last, ecs_last = _ct_chunk_coeffs(dt, coef, b, c, h, a_h, bias_h, dt_min, dt_max,
                                                                 seqlen, CHUNK, DT_SOFTPLUS, DT_PRE, TMA)
        x_c = _ct_chunk_rows(x, b, c, h, pt, CHUNK, BLOCK_P, TMA)
        B_c = _ct_chunk_rows(B, b, c, g, 0, CHUNK, D_STATE, TMA)
        if CB_STATE and not PACKED:
            C_c = ct.load(C, index=(b, c, g, 0), shape=(1, CHUNK, 1, D_STATE), padding_mode=_ZERO,
                          latency=1).reshape((CHUNK, D_STATE))
        else:
            C_c = _ct_chunk_rows(C, b, c, g, 0, CHUNK, D_STATE, TMA)
        x2_c = _ct_chunk_rows(x, b, c, h, TAIL_TILE, CHUNK, TAIL_P, TMA) if HAS_TAIL else x_c
        # intra-chunk: r_i * ((C B^T) * exp2(hi_i - hi_j) [i >= j]) @ (dl * x), i.e. the decay
        # exp2(hi_i - hi_j + lo_i - lo_j) of the segment (j, i] (_ct_decay_terms); masked before exp
        if CB_PRE == 1 and not PACKED:
            cb = ct.load(cb_pre, index=(b, g, c, 0), shape=(1, 1, CHUNK, CHUNK)).reshape((CHUNK, CHUNK))
            off = cb  # (not read)
        elif CB_PRE == 2 and not PACKED:
            cb = ct.load(cb_pre, index=(b, h, c, 0), shape=(1, 1, CHUNK, CHUNK)).reshape((CHUNK, CHUNK))
            off = cb  # (not read)
        elif CB_STATE and not PACKED:
            cb, off = _ct_cb_and_state_rows(C_c, B_c, state, CHUNK, STATE_T)
        else:
            cb = ct.mma(C_c, B_c.transpose(), ct.full((CHUNK, CHUNK), 0.0, dtype=ct.float32))
            off = cb  # (not read: C @ state^T is taken in _ct_chunk_out)
        if PACKED:  # pairs of one sequence only (PACKED: HAS_TAIL is False, the plan has one piece per launch)
            sq = ct.load(seq_idx, index=(c,), shape=(CHUNK,))
            seg = ct.where(causal & (sq[:, None] == sq[None, :]), hi[:, None] - hi[None, :], -math.inf)
            m = (cb * ct.exp2(seg, flush_to_zero=True)).astype(DTYPE)
            state = _ct_packed_chunk(y, initial_state, final_state, cu_seqlens, seq_idx, sq, c,
                                     x_c.astype(ct.float32), m, B_c, C_c, state, dl, hi, r, w, ecs, ecs_last, d_h,
                                     h, pt, CHUNK, BLOCK_P, D_STATE, HAS_D, HAS_INIT, STATE_T, SPLIT_UPD)
        else:
            if CB_PRE == 2:
                m = cb
            else:
                m = _ct_decayed(cb, hi, causal, DTYPE)
            xf = x_c.astype(ct.float32)
            acc = _ct_chunk_out(x_c, xf, m, C_c, state, dl, r, ecs, d_h, CHUNK, BLOCK_P, HAS_D, STATE_T, CB_PRE == 2,
                                CB_STATE and CB_PRE == 0, off)
            _ct_put(y, (b, c, h, pt), acc.astype(DTYPE).reshape((1, CHUNK, 1, BLOCK_P)), TMA)
            state = _ct_chunk_state_update(state, (xf * w[:, None]).astype(DTYPE), B_c, ecs_last, STATE_T, SPLIT_UPD)
            if HAS_TAIL:
                x2f = x2_c.astype(ct.float32)
                acc2 = _ct_chunk_out(x2_c, x2f, m, C_c, state2, dl, r, ecs, d_h, CHUNK, TAIL_P, HAS_D, STATE_T,
                                     CB_PRE == 2, False, m)
                _ct_put(y, (b, c, h, TAIL_TILE), acc2.astype(DTYPE).reshape((1, CHUNK, 1, TAIL_P)), TMA)
                state2 = _ct_chunk_state_update(state2, (x2f * w[:, None]).astype(DTYPE), B_c, ecs_last, STATE_T,
                                                SPLIT_UPD)
    return state, state2


def _ct_zero_state(BLOCK_P: ConstInt, D_STATE: ConstInt, STATE_T: ConstBool):
    if STATE_T:
        return ct.full((D_STATE, BLOCK_P), 0.0, dtype=ct.float32)
    return ct.full((BLOCK_P, D_STATE), 0.0, dtype=ct.float32)


def _ct_load_state(arr, b, h, pt, BLOCK_P: ConstInt, D_STATE: ConstInt, STATE_T: ConstBool):
    """Rows [pt*BLOCK_P, ...) of arr[b, h] ((headdim, d_state) fp32) in the on-chip layout; rows past
    headdim (a masked last tile) read 0."""
    if STATE_T:
        return ct.load(arr, index=(b, h, 0, pt), shape=(1, 1, D_STATE, BLOCK_P), order=(0, 1, 3, 2),
                       padding_mode=_ZERO).reshape((D_STATE, BLOCK_P)).astype(ct.float32)
    return ct.load(arr, index=(b, h, pt, 0), shape=(1, 1, BLOCK_P, D_STATE), padding_mode=_ZERO
                   ).reshape((BLOCK_P, D_STATE)).astype(ct.float32)


def _ct_store_state(arr, b, h, pt, state, BLOCK_P: ConstInt, D_STATE: ConstInt, STATE_T: ConstBool,
                    TMA: ConstBool = True):
    """Store a block's state (the on-chip layout) as rows [pt*BLOCK_P, ...) of arr[b, h]; TMA: :func:`_ct_tile`."""
    if STATE_T:
        if TMA:
            ct.store(arr, index=(b, h, 0, pt), tile=state.reshape((1, 1, D_STATE, BLOCK_P)), order=(0, 1, 3, 2))
        else:
            ct.store(arr, index=(b, h, 0, pt), tile=state.reshape((1, 1, D_STATE, BLOCK_P)), order=(0, 1, 3, 2),
                     allow_tma=False)
    else:
        _ct_put(arr, (b, h, pt, 0), state.reshape((1, 1, BLOCK_P, D_STATE)), TMA)


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
                      STATE_T: ConstBool, INIT_TMA: ConstBool):
    """The entry state of a block: initial_state's rows in the on-chip layout (HAS_INIT), else zeros. INIT_TMA
    False makes that one load a plain (non-TMA) load: tileiras then keeps the warp-specialised build for some
    tiles where the TMA load loses it (plan.ScanConfig.init_tma, benchmarks/NOTES_ssd.md); same values."""
    if HAS_INIT:
        if INIT_TMA:
            return _ct_load_state(initial_state, b, h, pt, BLOCK_P, D_STATE, STATE_T)
        if STATE_T:
            return ct.load(initial_state, index=(b, h, 0, pt), shape=(1, 1, D_STATE, BLOCK_P), order=(0, 1, 3, 2),
                           padding_mode=_ZERO, allow_tma=False).reshape((D_STATE, BLOCK_P)).astype(ct.float32)
        return ct.load(initial_state, index=(b, h, pt, 0), shape=(1, 1, BLOCK_P, D_STATE), padding_mode=_ZERO,
                       allow_tma=False).reshape((BLOCK_P, D_STATE)).astype(ct.float32)
    return _ct_zero_state(BLOCK_P, D_STATE, STATE_T)


# ----------------------------------------------------------------------------- kernels
@ct.kernel
def ssd_dt_kernel(dt, A, dt_bias, cu_seqlens, coef, seq_idx, dt_min: float, dt_max: float,
                  CHUNK: ConstInt, BLOCK_H: ConstInt, HAS_DT_BIAS: ConstBool, DT_SOFTPLUS: ConstBool,
                  PACKED: ConstBool):
    """Step-size pre-pass of the two-kernel plans. Grid: (batch, nchunks, cdiv(nheads, BLOCK_H)).

    Block (b, c, hb) turns dt[b, chunk c, heads hb*BLOCK_H...] into the per-token coefficients the
    scan kernels read (fp32, ``coef`` is (5, batch, nheads, nchunks*CHUNK)), the rows of
    :func:`_ct_decay_terms`: dl, hi, r, w, ecs, from delta = clamp(softplus(dt + dt_bias), dt_min,
    dt_max) (0 past seqlen) and the within-chunk cumsum of delta*A*log2(e) (fp64). Padded tokens
    have delta = 0, so cs stays flat there: they neither decay nor add.

    PACKED (batch 1, ``cu_seqlens`` (nseq + 1,) int32): the cumsum restarts at each sequence's first token
    (so hi, lo, ecs are sums from the later of the sequence start and the chunk start), w is masked (before
    exp) to the tokens of the sequence of the chunk's last token (the one whose state the chunk carries on),
    and the blocks of head block 0 write each token's sequence index to ``seq_idx`` ((nchunks*CHUNK,) int32,
    nseq past the last token). Otherwise cu_seqlens and seq_idx are never touched (pass any array).
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
    if PACKED:
        sq, first = _ct_token_seq(cu_seqlens, t, CHUNK)
        dA = _ct_log2_steps(delta, a[None, :])
        hi, lo, _f = _ct_seg_df_cumsum(dA, ct.broadcast_to(first[:, None], (CHUNK, BLOCK_H)), 0)
        hi_last = ct.extract(hi, index=(CHUNK - 1, 0), shape=(1, BLOCK_H))
        lo_last = ct.extract(lo, index=(CHUNK - 1, 0), shape=(1, BLOCK_H))
        dl, hi, r, _w, ecs = _ct_decay_terms(delta, hi, lo, hi_last, lo_last)
        carried = (sq == ct.extract(sq, index=(CHUNK - 1,), shape=(1,)))[:, None]  # the last token's sequence
        w = delta * ct.exp2(ct.where(carried, (hi_last - hi) + (lo_last - lo), -math.inf))
        if hb == 0:
            ct.store(seq_idx, index=(c,), tile=sq)
    else:
        hi, lo = _ct_df_cumsum(_ct_log2_steps(delta, a[None, :]), 0)  # log2 units
        dl, hi, r, w, ecs = _ct_decay_terms(delta, hi, lo, ct.extract(hi, index=(CHUNK - 1, 0), shape=(1, BLOCK_H)),
                                            ct.extract(lo, index=(CHUNK - 1, 0), shape=(1, BLOCK_H)))
    shape = (1, 1, CHUNK, BLOCK_H)
    ct.store(coef, index=(0, b, c, hb), tile=dl.reshape(shape), order=(0, 1, 3, 2))
    ct.store(coef, index=(1, b, c, hb), tile=hi.reshape(shape), order=(0, 1, 3, 2))
    ct.store(coef, index=(2, b, c, hb), tile=r.reshape(shape), order=(0, 1, 3, 2))
    ct.store(coef, index=(3, b, c, hb), tile=w.reshape(shape), order=(0, 1, 3, 2))
    ct.store(coef, index=(4, b, c, hb), tile=ecs.reshape(shape), order=(0, 1, 3, 2))


@ct.kernel
def ssd_cb_kernel(B, C, coef, cb_pre, heads_per_group: int, CHUNK: ConstInt, D_STATE: ConstInt, M_HEADS: ConstInt):
    """C @ B^T of every chunk once per group (plans with ``cb_pre`` 1), or the masked, decayed M of every head
    (``cb_pre`` 2). Grid: (batch, nchunks, ngroups) with M_HEADS 0, else (batch, nchunks, nheads // M_HEADS).

    M_HEADS 0: block (b, c, g) writes cb_pre[b, g, c*CHUNK ... (c+1)*CHUNK, :] = C_c @ B_c^T ((CHUNK, CHUNK) fp32,
    tensor cores with fp32 accumulation, operands in the input dtype; rows and columns past seqlen are 0), which
    every head and headdim tile of the group would otherwise recompute in :func:`ssd_scan_kernel`'s chunk loop.
    M_HEADS > 0 (a divisor of heads_per_group): block (b, c, k) computes C_c @ B_c^T once for heads k*M_HEADS ...
    (k+1)*M_HEADS - 1 (one group) and writes each head's r_i * M_ij * dl_j, M = (C B^T) * exp2(where(i >= j, hi_i - hi_j,
    -inf)), in the input dtype to cb_pre[b, h, c*CHUNK ...] (the chunk loop's M with its row factor r and the step
    sizes dl of x folded in, so x enters the loop's product as loaded; dl, hi, r from ``coef``, the pre-pass's rows).
    B and C are (batch, seqlen, ngroups, d_state).
    """
    b = ct.bid(0)
    c = ct.bid(1)
    k = ct.bid(2)
    g = k if M_HEADS == 0 else (k * M_HEADS) // heads_per_group
    C_c = _ct_chunk_rows(C, b, c, g, 0, CHUNK, D_STATE)
    B_c = _ct_chunk_rows(B, b, c, g, 0, CHUNK, D_STATE)
    cb = ct.mma(C_c, B_c.transpose(), ct.full((CHUNK, CHUNK), 0.0, dtype=ct.float32))
    if M_HEADS == 0:
        ct.store(cb_pre, index=(b, g, c, 0), tile=cb.reshape((1, 1, CHUNK, CHUNK)))
    else:
        idx = ct.arange(CHUNK, dtype=ct.int32)
        causal = idx[:, None] >= idx[None, :]
        for i in range(M_HEADS):
            h = k * M_HEADS + i
            dl = ct.load(coef, index=(0, b, h, c), shape=(1, 1, 1, CHUNK)).reshape((CHUNK,))
            hi = ct.load(coef, index=(1, b, h, c), shape=(1, 1, 1, CHUNK)).reshape((CHUNK,))
            r = ct.load(coef, index=(2, b, h, c), shape=(1, 1, 1, CHUNK)).reshape((CHUNK,))
            m = _ct_decayed(cb * (r[:, None] * dl[None, :]), hi, causal, C.dtype)
            ct.store(cb_pre, index=(b, h, c, 0), tile=m.reshape((1, 1, CHUNK, CHUNK)))


@ct.kernel
def ssd_fused_kernel(x, dt, A, B, C, D, dt_bias, initial_state, y, final_state,
                     dt_min: float, dt_max: float, heads_per_group: int,
                     CHUNK: ConstInt, BLOCK_P: ConstInt, D_STATE: ConstInt,
                     HAS_D: ConstBool, HAS_DT_BIAS: ConstBool, HAS_INIT: ConstBool, DT_SOFTPLUS: ConstBool,
                     STATE_T: ConstBool, SPLIT_UPD: ConstBool, P_TILE0: ConstInt, INIT_TMA: ConstBool,
                     TMA: ConstBool):
    """Single-launch SSD forward. Grid: (batch*nheads, 1, headdim tiles).

    Block (bh, 0, t) owns batch bh // nheads, head bh % nheads, headdim rows [pt*BLOCK_P,
    (pt+1)*BLOCK_P) with pt = P_TILE0 + t: it walks all chunks of the sequence with its (BLOCK_P,
    D_STATE) fp32 state on chip, writes those rows of y for every token and of final_state at the
    end. Rows past headdim (a masked last tile: headdim not a multiple of BLOCK_P) read 0 and are
    never stored; headdim rows are independent, so they cannot reach the others.
    Absent optional inputs (HAS_* False) are never read: pass any array there. TMA False: no TMA copy anywhere
    (the TensorRT AOT build, :func:`aot_spec`; INIT_TMA is then ignored).
    """
    b, h, g, pt, seqlen = _ct_block_coords(x, heads_per_group, P_TILE0)
    a_h, d_h, bias_h = _ct_head_scalars(A, D, dt_bias, h, HAS_D, HAS_DT_BIAS, TMA)
    if TMA:
        state = _ct_initial_state(initial_state, b, h, pt, BLOCK_P, D_STATE, HAS_INIT, STATE_T, INIT_TMA)
    else:
        state = _ct_initial_state(initial_state, b, h, pt, BLOCK_P, D_STATE, HAS_INIT, STATE_T, False)
    nchunks = ct.cdiv(seqlen, CHUNK)
    state, _ = _ct_scan_chunks(x, dt, dt, B, C, y, b, h, g, pt, 0, nchunks, state, state, a_h, d_h, bias_h,
                               dt_min, dt_max, seqlen, CHUNK, BLOCK_P, D_STATE, HAS_D, DT_SOFTPLUS, STATE_T,
                               SPLIT_UPD, False, False, BLOCK_P, 0, initial_state, final_state, dt, dt, False, False,
                               dt, 0, False, TMA)
    _ct_store_state(final_state, b, h, pt, state, BLOCK_P, D_STATE, STATE_T, TMA)


@ct.kernel
def ssd_segment_state_kernel(x, dt, coef, A, B, dt_bias, initial_state, cu_seqlens, seq_idx, seg_state, seg_logdecay,
                             dt_min: float, dt_max: float, heads_per_group: int, chunks_per_seg: int,
                             CHUNK: ConstInt, BLOCK_P: ConstInt, D_STATE: ConstInt,
                             HAS_DT_BIAS: ConstBool, DT_SOFTPLUS: ConstBool, DT_PRE: ConstBool,
                             P_TILE0: ConstInt, HAS_TAIL: ConstBool, TAIL_P: ConstInt, TAIL_TILE: ConstInt,
                             HAS_INIT: ConstBool, PACKED: ConstBool):
    """Split plan, pass 1. Grid: (batch*nheads, nseg - 1, headdim tiles of the piece).

    Block (bh, s, pt) computes, from a zero state, the state segment s alone leaves after its
    chunks [s*chunks_per_seg, (s+1)*chunks_per_seg) -> seg_state[b, h, s, p-tile, :] (fp32), and
    the segment's total log2-decay log2(e)*sum(delta*A) -> seg_logdecay[b, h, s] (every p-tile writes the
    same value). The last segment is never needed by pass 2, hence nseg - 1 blocks along axis 1.

    Unrolling the recurrence state_c = exp(cs_last_c) * state_{c-1} + B_c^T (x_c * w_c), the
    segment's state is sum_c B_c^T (x_c * w_c * exp(sum of cs_last over the chunks after c)). The
    block walks its chunks last to first, so that factor is a running scalar and every chunk is a
    pure accumulation into one product accumulator: no state multiply on the loop's dependency
    chain. The state is held as (headdim, d_state) (x_w^T @ B_c): measured faster here than the
    (d_state, headdim) layout of the scan kernel (benchmarks/NOTES_ssd.md, v6). HAS_TAIL: the block also
    computes the segment state of the TAIL_P rows from row TAIL_TILE * TAIL_P (see :func:`_ct_scan_chunks`).

    PACKED (batch 1, no tail; coef from the packed pre-pass): the state is that of the sequence running at the
    segment's end; chunks whose last token belongs to an earlier sequence add nothing. When that sequence
    starts inside the segment, its initial state (HAS_INIT), decayed from its start, is added and the
    log2-decay is -inf: pass 2's fold multiplies the state before by exp2(-inf) = 0 (no state crosses the
    boundary). Otherwise initial_state, cu_seqlens and seq_idx are never read.
    """
    b, h, g, pt, seqlen = _ct_block_coords(x, heads_per_group, P_TILE0)
    s = ct.bid(1)
    a_h, _, bias_h = _ct_head_scalars(A, A, dt_bias, h, False, HAS_DT_BIAS)
    nchunks = ct.cdiv(seqlen, CHUNK)
    c_begin = s * chunks_per_seg
    c_end = ct.minimum(c_begin + chunks_per_seg, nchunks)
    state = _ct_zero_state(BLOCK_P, D_STATE, False)
    state2 = _ct_zero_state(TAIL_P, D_STATE, False)
    later = ct.full((1,), 0.0, dtype=ct.float32)  # log2-decay of the chunks after c in this segment (<= 0)
    s_seg = 0
    if PACKED:
        s_seg = ct.gather(seq_idx, c_end * CHUNK - 1)  # the sequence at the segment's end
    for i in range(c_end - c_begin):
        c = c_end - 1 - i
        _dl, _hi, _r, w, _ecs, hi_last, _ecs_last = _ct_chunk_coeffs(dt, coef, b, c, h, a_h, bias_h, dt_min,
                                                                     dt_max, seqlen, CHUNK, DT_SOFTPLUS, DT_PRE)
        x_c = _ct_chunk_rows(x, b, c, h, pt, CHUNK, BLOCK_P)
        B_c = _ct_chunk_rows(B, b, c, g, 0, CHUNK, D_STATE)
        if PACKED:  # w is masked to the chunk's last sequence: keep the chunk only if that is s_seg
            keep = ct.gather(seq_idx, c * CHUNK + CHUNK - 1) == s_seg
            wl = ct.where(keep, w * ct.exp2(later), 0.0)
            hi_last = ct.where(keep, hi_last, 0.0)
        else:
            wl = w * ct.exp2(later)
        x_w = (x_c.astype(ct.float32) * wl[:, None]).astype(x.dtype)
        state = ct.mma(x_w.transpose(), B_c, state)
        if HAS_TAIL:
            x2_c = _ct_chunk_rows(x, b, c, h, TAIL_TILE, CHUNK, TAIL_P)
            x2_w = (x2_c.astype(ct.float32) * wl[:, None]).astype(x.dtype)
            state2 = ct.mma(x2_w.transpose(), B_c, state2)
        later = later + hi_last
    if PACKED:
        if ct.gather(cu_seqlens, s_seg) >= c_begin * CHUNK:  # s_seg starts in this segment: a reset
            if HAS_INIT:
                state = state + _ct_load_state(initial_state, s_seg, h, pt, BLOCK_P, D_STATE, False) * ct.exp2(later)
            later = ct.full((1,), -math.inf, dtype=ct.float32)
    _ct_store_seg_state(seg_state, b, h, s, pt, state, BLOCK_P, D_STATE, False)
    if HAS_TAIL:
        _ct_store_seg_state(seg_state, b, h, s, TAIL_TILE, state2, TAIL_P, D_STATE, False)
    ct.store(seg_logdecay, index=(b, h, s), tile=later.reshape((1, 1, 1)))


@ct.kernel
def ssd_scan_kernel(x, dt, coef, A, B, C, D, dt_bias, initial_state, seg_state, seg_logdecay, y, final_state,
                    cu_seqlens, seq_idx, cb_pre, dt_min: float, dt_max: float, heads_per_group: int,
                    chunks_per_seg: int,
                    CHUNK: ConstInt, BLOCK_P: ConstInt, D_STATE: ConstInt,
                    HAS_D: ConstBool, HAS_DT_BIAS: ConstBool, HAS_INIT: ConstBool, DT_SOFTPLUS: ConstBool,
                    STATE_T: ConstBool, SPLIT_UPD: ConstBool, DT_PRE: ConstBool, P_TILE0: ConstInt,
                    HAS_TAIL: ConstBool, TAIL_P: ConstInt, TAIL_TILE: ConstInt, PACKED: ConstBool,
                    INIT_TMA: ConstBool, CB_PRE: ConstInt, CB_STATE: ConstBool):
    """Split plan, pass 2. Grid: (batch*nheads, nseg, headdim tiles of the piece).

    Block (bh, s, pt) builds its entry state on chip, initial_state folded with segments
    0..s-1 of pass 1 (state = exp(logdecay_s') * state + seg_state_s'), then runs the full SSD
    over segment s's chunks, writing y; the last segment's block writes final_state. HAS_TAIL: the same for
    the TAIL_P rows from row TAIL_TILE * TAIL_P, a second state on chip (see :func:`_ct_scan_chunks`).

    PACKED (batch 1, no tail, the packed pre-pass and pass 1): the entry state starts from zeros (chunk 0 begins
    a sequence), initial_state and final_state are (nseq, nheads, headdim, d_state), and each chunk writes the
    final states of the sequences that end in it (:func:`_ct_packed_chunk`); cu_seqlens and seq_idx are read
    only then.

    CB_PRE 1 / 2 (not with PACKED): each chunk's C @ B^T / masked, decayed M is read from ``cb_pre``
    (:func:`ssd_cb_kernel`) instead of computed by the block; with 0 cb_pre is never read. CB_STATE (ScanConfig.cb_state;
    CB_PRE 0, BLOCK_P == CHUNK, not PACKED): C @ B^T and C @ state^T as one product (see :func:`_ct_scan_chunks`).
    """
    b, h, g, pt, seqlen = _ct_block_coords(x, heads_per_group, P_TILE0)
    s = ct.bid(1)
    nseg = ct.num_blocks(1)
    a_h, d_h, bias_h = _ct_head_scalars(A, D, dt_bias, h, HAS_D, HAS_DT_BIAS)
    state = _ct_initial_state(initial_state, b, h, pt, BLOCK_P, D_STATE, HAS_INIT and not PACKED, STATE_T, INIT_TMA)
    state2 = _ct_initial_state(initial_state, b, h, TAIL_TILE, TAIL_P, D_STATE, HAS_INIT and HAS_TAIL, STATE_T,
                               INIT_TMA)
    for sp in range(s):
        ld = ct.exp2(ct.load(seg_logdecay, index=(b, h, sp), shape=(1, 1, 1)).reshape((1,)))
        state = state * ld + _ct_load_seg_state(seg_state, b, h, sp, pt, BLOCK_P, D_STATE, STATE_T)
        if HAS_TAIL:
            state2 = state2 * ld + _ct_load_seg_state(seg_state, b, h, sp, TAIL_TILE, TAIL_P, D_STATE, STATE_T)
    nchunks = ct.cdiv(seqlen, CHUNK)
    c_begin = s * chunks_per_seg
    c_end = ct.minimum(c_begin + chunks_per_seg, nchunks)
    state, state2 = _ct_scan_chunks(x, dt, coef, B, C, y, b, h, g, pt, c_begin, c_end, state, state2, a_h, d_h,
                                    bias_h, dt_min, dt_max, seqlen, CHUNK, BLOCK_P, D_STATE, HAS_D, DT_SOFTPLUS,
                                    STATE_T, SPLIT_UPD, DT_PRE, HAS_TAIL, TAIL_P, TAIL_TILE, initial_state,
                                    final_state, cu_seqlens, seq_idx, HAS_INIT, PACKED, cb_pre, CB_PRE,
                                    CB_STATE)
    if not PACKED:  # (packed: each sequence's final state was written at its last token)
        if s == nseg - 1:
            _ct_store_state(final_state, b, h, pt, state, BLOCK_P, D_STATE, STATE_T)
            if HAS_TAIL:
                _ct_store_state(final_state, b, h, TAIL_TILE, state2, TAIL_P, D_STATE, STATE_T)


# ----------------------------------------------------------------------------- launch descriptions
def fused_launch(p: SSMScanProblem, cfg: ScanConfig, *, dt_softplus: bool, dt_limit: tuple[float, float],
                 has_D: bool = True, has_dt_bias: bool = True, has_init: bool = True, grid=None,
                 piece: HeaddimPiece | None = None, tma: bool = True) -> Launch:
    """:func:`ssd_fused_kernel` for ``p`` over one headdim ``piece`` (default: cdiv(headdim, block_p) tiles of
    cfg.block_p from row 0, the last one masked when block_p does not divide headdim); grid ``(batch*nheads, 1,
    tiles)``; ``grid`` overrides it, e.g. a function of (batch, nheads, headdim) for the AOT plugin. Absent inputs
    read a stand-in array. ``tma`` False: no TMA copies (the AOT build)."""
    dtn = p.dtype
    piece = piece or HeaddimPiece(cfg.block_p, 0, -(-p.headdim // cfg.block_p))
    args = (
        L.array("x", dtn, 4), L.array("dt", dtn, 3), L.array("A", "float32", 1), L.array("B", dtn, 4),
        L.array("C", dtn, 4), L.array("D", "float32", 1, source=None if has_D else "A"),
        L.array("dt_bias", "float32", 1, source=None if has_dt_bias else "A"),
        L.array("initial_state", "float32", 4, source=None if has_init else "final_state"),
        L.array("y", dtn, 4), L.array("final_state", "float32", 4),
        L.scalar("dt_min", "float32", float(dt_limit[0])), L.scalar("dt_max", "float32", float(dt_limit[1])),
        L.scalar("heads_per_group", "int32", p.heads_per_group),
        L.constant("CHUNK", cfg.chunk), L.constant("BLOCK_P", piece.width), L.constant("D_STATE", p.d_state),
        L.constant("HAS_D", bool(has_D)), L.constant("HAS_DT_BIAS", bool(has_dt_bias)),
        L.constant("HAS_INIT", bool(has_init)), L.constant("DT_SOFTPLUS", bool(dt_softplus)),
        L.constant("STATE_T", bool(cfg.state_t)), L.constant("SPLIT_UPD", bool(cfg.split_upd)),
        L.constant("P_TILE0", piece.tile0), L.constant("INIT_TMA", bool(cfg.init_tma)),
        L.constant("TMA", bool(tma)),
    )
    if grid is None:
        grid = (p.batch * p.nheads, 1, piece.tiles)
    return Launch(hinted(ssd_fused_kernel, cfg.occupancy, cfg.worker_warps), args, grid, cfg)


def _packed_arrays(packed: bool) -> tuple:
    """cu_seqlens ((nseq + 1,) int32) and seq_idx (the pre-pass's (nchunks*CHUNK,) int32 scratch) of the packed
    form; unpacked launches never read them: ``A`` stands in."""
    if packed:
        return L.array("cu_seqlens", "int32", 1), L.array("seq_idx", "int32", 1)
    return L.array("cu_seqlens", "float32", 1, source="A"), L.array("seq_idx", "float32", 1, source="A")


#: occupancy hint of the unpacked ssd_dt_kernel (4: 124 registers x 128 threads and 50.3 KB shared memory at chunk 64,
#: four blocks per SM, no spills; None: unhinted, 126 registers, 67.7 KB, three; sm_90 builds). The hint measured
#: 20-28% faster on that launch on b, d, Nemotron-H-8B and Nano-9B (1-2.5% of the whole plan), outputs bit-identical
#: (benchmarks/NOTES_ssd.md, "Prefill per launch"). The packed pre-pass stays unhinted (not measured: its hint-4
#: build is 64 registers x 256 threads instead of 255).
DT_OCCUPANCY: int | None = 4


def _dt_launch(p: SSMScanProblem, cfg: ScanConfig, nchunks: int, *, dt_softplus, dt_limit, has_dt_bias,
               packed: bool = False) -> Launch:
    block_h = min(32, 1 << (p.nheads - 1).bit_length())
    cu, seq = _packed_arrays(packed)
    args = (L.array("dt", p.dtype, 3), L.array("A", "float32", 1),
            L.array("dt_bias", "float32", 1, source=None if has_dt_bias else "A"), cu, L.array("coef", "float32", 4),
            seq, L.scalar("dt_min", "float32", float(dt_limit[0])), L.scalar("dt_max", "float32", float(dt_limit[1])),
            L.constant("CHUNK", cfg.chunk), L.constant("BLOCK_H", block_h),
            L.constant("HAS_DT_BIAS", bool(has_dt_bias)), L.constant("DT_SOFTPLUS", bool(dt_softplus)),
            L.constant("PACKED", bool(packed)))
    kernel = hinted(ssd_dt_kernel, None if packed else DT_OCCUPANCY)
    return Launch(kernel, args, (p.batch, nchunks, -(-p.nheads // block_h)), cfg)


#: occupancy hint of ssd_cb_kernel (unhinted it builds at 255 registers x 256 threads: one block per SM)
CB_OCCUPANCY = 2


def m_heads(heads_per_group: int) -> int:
    """Heads per block of ssd_cb_kernel writing M (cb_pre 2): the largest of 8, 4, 2, 1 dividing heads_per_group."""
    return next(n for n in (8, 4, 2, 1) if heads_per_group % n == 0)


def _cb_pre_scratch(p: SSMScanProblem, cfg: ScanConfig, nchunks: int) -> tuple[str, tuple[int, ...], str]:
    """The cb_pre scratch: C @ B^T per group (fp32) for cb_pre 1, M per head (input dtype) for 2."""
    if cfg.cb_pre == 1:
        return ("cb_pre", (p.batch, p.ngroups, nchunks * cfg.chunk, cfg.chunk), "float32")
    return ("cb_pre", (p.batch, p.nheads, nchunks * cfg.chunk, cfg.chunk), p.dtype)


def _cb_launch(p: SSMScanProblem, cfg: ScanConfig, nchunks: int) -> Launch:
    mh = 0 if cfg.cb_pre == 1 else m_heads(p.heads_per_group)
    args = (L.array("B", p.dtype, 4), L.array("C", p.dtype, 4), L.array("coef", "float32", 4),
            L.array("cb_pre", _cb_pre_scratch(p, cfg, nchunks)[2], 4),
            L.scalar("heads_per_group", "int32", p.heads_per_group),
            L.constant("CHUNK", cfg.chunk), L.constant("D_STATE", p.d_state), L.constant("M_HEADS", mh))
    kernel = hinted(ssd_cb_kernel, CB_OCCUPANCY, None)
    return Launch(kernel, args, (p.batch, nchunks, p.ngroups if mh == 0 else p.nheads // mh), cfg)


def _tail_constants(piece: HeaddimPiece, tail: HeaddimPiece | None) -> tuple:
    """HAS_TAIL, TAIL_P, TAIL_TILE of a launch whose blocks also own ``tail`` (None: no tail; the widths then
    repeat the piece's, never read)."""
    return (L.constant("HAS_TAIL", tail is not None), L.constant("TAIL_P", (tail or piece).width),
            L.constant("TAIL_TILE", tail.tile0 if tail else 0))


def _segment_launch(p: SSMScanProblem, cfg: ScanConfig, piece: HeaddimPiece, tail: HeaddimPiece | None = None, *,
                    dt_softplus, dt_limit, has_dt_bias, has_init: bool = False, packed: bool = False) -> Launch:
    dtn = p.dtype
    init = packed and has_init  # pass 1 reads initial states only in the packed form
    args = (L.array("x", dtn, 4), L.array("dt", dtn, 3), L.array("coef", "float32", 4), L.array("A", "float32", 1),
            L.array("B", dtn, 4), L.array("dt_bias", "float32", 1, source=None if has_dt_bias else "A"),
            L.array("initial_state", "float32", 4, source=None if init else "final_state"), *_packed_arrays(packed),
            L.array("seg_state", "float32", 5), L.array("seg_logdecay", "float32", 3),
            L.scalar("dt_min", "float32", float(dt_limit[0])), L.scalar("dt_max", "float32", float(dt_limit[1])),
            L.scalar("heads_per_group", "int32", p.heads_per_group),
            L.scalar("chunks_per_seg", "int32", cfg.chunks_per_seg),
            L.constant("CHUNK", cfg.chunk), L.constant("BLOCK_P", piece.width), L.constant("D_STATE", p.d_state),
            L.constant("HAS_DT_BIAS", bool(has_dt_bias)), L.constant("DT_SOFTPLUS", bool(dt_softplus)),
            L.constant("DT_PRE", bool(cfg.dt_pre)), L.constant("P_TILE0", piece.tile0), *_tail_constants(piece, tail),
            L.constant("HAS_INIT", bool(init)), L.constant("PACKED", bool(packed)))
    kernel = hinted(ssd_segment_state_kernel, cfg.seg_occupancy or cfg.occupancy, cfg.worker_warps)
    return Launch(kernel, args, (p.batch * p.nheads, cfg.nseg - 1, piece.tiles), cfg)


def _scan_launch(p: SSMScanProblem, cfg: ScanConfig, cps: int, piece: HeaddimPiece, tail: HeaddimPiece | None = None,
                 *, dt_softplus, dt_limit, has_D, has_dt_bias, has_init, packed: bool = False) -> Launch:
    dtn = p.dtype
    args = (L.array("x", dtn, 4), L.array("dt", dtn, 3), L.array("coef", "float32", 4), L.array("A", "float32", 1),
            L.array("B", dtn, 4), L.array("C", dtn, 4), L.array("D", "float32", 1, source=None if has_D else "A"),
            L.array("dt_bias", "float32", 1, source=None if has_dt_bias else "A"),
            L.array("initial_state", "float32", 4, source=None if has_init else "final_state"),
            L.array("seg_state", "float32", 5), L.array("seg_logdecay", "float32", 3),
            L.array("y", dtn, 4), L.array("final_state", "float32", 4), *_packed_arrays(packed),
            L.array("cb_pre", (p.dtype if cfg.cb_pre == 2 else "float32"), 4 if cfg.cb_pre else 1,
                    source=None if cfg.cb_pre else "A"),
            L.scalar("dt_min", "float32", float(dt_limit[0])), L.scalar("dt_max", "float32", float(dt_limit[1])),
            L.scalar("heads_per_group", "int32", p.heads_per_group), L.scalar("chunks_per_seg", "int32", cps),
            L.constant("CHUNK", cfg.chunk), L.constant("BLOCK_P", piece.width), L.constant("D_STATE", p.d_state),
            L.constant("HAS_D", bool(has_D)), L.constant("HAS_DT_BIAS", bool(has_dt_bias)),
            L.constant("HAS_INIT", bool(has_init)), L.constant("DT_SOFTPLUS", bool(dt_softplus)),
            L.constant("STATE_T", bool(cfg.state_t)), L.constant("SPLIT_UPD", bool(cfg.split_upd)),
            L.constant("DT_PRE", bool(cfg.dt_pre)), L.constant("P_TILE0", piece.tile0), *_tail_constants(piece, tail),
            L.constant("PACKED", bool(packed)), L.constant("INIT_TMA", bool(cfg.init_tma)),
            L.constant("CB_PRE", int(cfg.cb_pre)), L.constant("CB_STATE", bool(cfg.cb_state)))
    kernel = hinted(ssd_scan_kernel, cfg.occupancy, cfg.worker_warps)
    return Launch(kernel, args, (p.batch * p.nheads, cfg.nseg, piece.tiles), cfg)


@dataclass(frozen=True)
class ScanPlan:
    """The launches of one SSMScan call and the scratch they share ((name, shape, dtype); allocated per call).

    Made once per problem signature (:func:`scan_plan`, cached): the per-call work is allocating
    the scratch and binding tensors.
    """

    launches: tuple[Launch, ...]
    scratch: tuple[tuple[str, tuple[int, ...], str], ...]
    config: ScanConfig


def make_scan_plan(p: SSMScanProblem, cfg: ScanConfig, *, dt_softplus: bool, dt_limit: tuple[float, float],
                   has_D: bool, has_dt_bias: bool, has_init: bool, packed: bool = False) -> ScanPlan:
    """The launches of ``cfg`` for ``p``. Raises ContractError if ``cfg`` does not cover ``p`` (a plan made
    for another seqlen would leave chunks unscanned: refuse, never truncate).

    ``packed``: the packed form (``p.batch`` 1, the tensors then include ``cu_seqlens``; initial_state and
    final_state per sequence): the same launches with PACKED set, which needs the pre-pass (``cfg.dt_pre``) and
    no merged headdim tail (``cfg.merge_tail`` False: :func:`packed_config`); nseq is a runtime extent."""
    if packed and (not cfg.dt_pre or cfg.merge_tail or cfg.cb_pre or p.batch != 1):
        raise ContractError(f"config: the packed form needs batch 1, dt_pre, no merge_tail and no cb_pre, got batch "
                            f"{p.batch}, {cfg}; make it with packed_config")
    if cfg.cb_state and (packed or cfg.block_p != cfg.chunk or cfg.cb_pre or (cfg.nseg == 1 and not cfg.dt_pre)):
        raise ContractError(f"config: cb_state needs block_p == chunk, cb_pre 0, the scan kernel (dt_pre or a split) "
                            f"and no packed form, got {cfg}; make it with choose_config")
    if cfg.cb_pre and not cfg.dt_pre:
        raise ContractError(f"config: cb_pre needs the pre-pass plan (dt_pre), got {cfg}; make it with choose_config")
    nchunks = -(-p.seqlen // cfg.chunk)
    cps = nchunks if cfg.nseg == 1 else cfg.chunks_per_seg
    pieces = launch_pieces(p.headdim, cfg.block_p, cfg.merge_tail)
    if cfg.nseg < 1 or not (cfg.nseg - 1) * cps < nchunks <= cfg.nseg * cps:
        raise ContractError(f"config: {cfg} does not cover seqlen {p.seqlen} ({nchunks} chunks of {cfg.chunk}); "
                            "make it with choose_config for this problem")
    kw = dict(dt_softplus=dt_softplus, dt_limit=dt_limit, has_dt_bias=has_dt_bias, packed=packed)
    if cfg.nseg == 1 and not cfg.dt_pre:  # the fused kernel has no tail: one launch per piece
        return ScanPlan(tuple(fused_launch(p, cfg, has_D=has_D, has_init=has_init, piece=pc, dt_softplus=dt_softplus,
                                           dt_limit=dt_limit, has_dt_bias=has_dt_bias)
                              for pc in headdim_pieces(p.headdim, cfg.block_p)), (), cfg)
    launches, scratch = [], []
    if cfg.dt_pre:  # fp32 per-token coefficients (5 x the size of dt in fp32)
        scratch.append(("coef", (5, p.batch, p.nheads, nchunks * cfg.chunk), "float32"))
        if packed:  # each token's sequence, written by the pre-pass
            scratch.append(("seq_idx", (nchunks * cfg.chunk,), "int32"))
        launches.append(_dt_launch(p, cfg, nchunks, **kw))
    if cfg.cb_pre:  # C @ B^T per (batch, group, chunk) or M per (batch, head, chunk): read by the chunk loops
        scratch.append(_cb_pre_scratch(p, cfg, nchunks))
        launches.append(_cb_launch(p, cfg, nchunks))
    # the state each segment alone leaves, and its total log-decay (tiny next to x); a single pass
    # never reads them (pass 2's fold loop is empty): a one-element-per-dim stand-in
    nsp = cfg.nseg - 1
    scratch.append(("seg_state", (p.batch, p.nheads, nsp, p.headdim, p.d_state) if nsp else
                    (1, 1, 1, p.headdim, p.d_state), "float32"))
    scratch.append(("seg_logdecay", (p.batch, p.nheads, nsp) if nsp else (1, 1, 1), "float32"))
    for pc, tail in pieces:  # one pass-1 and one pass-2 launch per headdim piece (launch_pieces)
        if nsp:
            launches.append(_segment_launch(p, cfg, pc, tail, has_init=has_init, **kw))
        # cb_state only without an initial state: with one, tileiras 13.4 drops the warp-specialised build of the
        # one-product loop (128 threads, 250 registers; sm_90 build, benchmarks/NOTES_ssd.md)
        scfg = replace(cfg, cb_state=False) if has_init else cfg
        launches.append(_scan_launch(p, scfg, cps, pc, tail, has_D=has_D, has_init=has_init, **kw))
    # without the pre-pass, coef is never read (DT_PRE False): any array stands in
    return ScanPlan(tuple(launches if cfg.dt_pre else [l.with_args(coef=dict(source="A")) for l in launches]),
                    tuple(scratch), cfg)


def scan_plan(p: SSMScanProblem, *, device: torch.device, dt_softplus: bool, dt_limit: tuple[float, float],
              has_D: bool, has_dt_bias: bool, has_init: bool, config: ScanConfig | None = None,
              packed: bool = False) -> ScanPlan:
    """:func:`make_scan_plan` with :func:`choose_config` (packed: :func:`packed_config`) or ``config``, cached per
    problem signature and device."""
    key = ("ssd", p, float(dt_limit[0]), float(dt_limit[1]), bool(dt_softplus), has_D, has_dt_bias, has_init,
           device.index, config, packed)

    def make():
        cfg = config or (packed_config(p, sm_count=sm_count(device)) if packed
                         else choose_config(p, sm_count=sm_count(device)))
        return make_scan_plan(p, cfg, dt_softplus=dt_softplus, dt_limit=dt_limit, has_D=has_D,
                              has_dt_bias=has_dt_bias, has_init=has_init, packed=packed)

    return cached_plan(key, make)


def run_scan_plan(plan: ScanPlan, tensors: dict, stream: int, device: torch.device) -> None:
    """Allocate the plan's scratch (on the current torch stream, which must be ``stream``) and launch."""
    for name, shape, dtype in plan.scratch:
        tensors[name] = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
    for launch in plan.launches:
        ct.launch(stream, launch.grid, launch.kernel, launch.bind(tensors))


def ssm_scan_cutile(x, dt, A, B, C, D, dt_bias, initial_state, *, problem: SSMScanProblem, dt_softplus: bool,
                    dt_limit: tuple[float, float], out=None, final_state_out=None, stream=None,
                    config: ScanConfig | None = None, tiles: TileFamily | None = None) -> SSMScanOutput:
    """cuTile SSMScan on validated arguments (see :func:`m2export.kernels.ssd.ssm_scan`).

    x, dt, B and C are read in place when their last stride is 1 (views of the conv and in_proj
    outputs: no copies), else copied contiguous (:func:`unit_stride`); the other inputs are made
    contiguous. ``out``/``final_state_out`` must be
    contiguous and are written in full. The plan: ``config`` if given, else ``tiles`` (one of
    :func:`tile_families`, e.g. a TensorRT tactic) with the modelled segment count, else the autotuner's
    choice when ``M2EXPORT_AUTOTUNE=1`` (:mod:`m2export.kernels._tune`), else :func:`choose_config`. All work is
    queued on ``stream``; inputs produced on another stream must be ordered by the caller.
    """
    dev = x.device
    ls = launch_stream(stream, dev)
    # everything below (contiguous copies, output and scratch allocation, the launches) is ordered
    # on the launch stream, so the caching allocator ties scratch memory to it
    with torch.cuda.device(dev), torch.cuda.stream(ls):
        x, dt, B, C = (unit_stride(t) for t in (x, dt, B, C))
        A, D, dt_bias, initial_state = (None if t is None else t.contiguous() for t in (A, D, dt_bias, initial_state))
        p = problem
        y, final_state = out_buffers(x, p.shape_of("final_state"), out, final_state_out, allocate=True)
        if p.batch == 0:
            return SSMScanOutput(y, final_state)
        if p.seqlen == 0:  # nothing to scan: final_state = initial_state (or zeros)
            final_state.copy_(initial_state) if initial_state is not None else final_state.zero_()
            return SSMScanOutput(y, final_state)
        flags = dict(dt_softplus=dt_softplus, dt_limit=dt_limit, has_D=D is not None,
                     has_dt_bias=dt_bias is not None, has_init=initial_state is not None)
        inputs = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias, initial_state=initial_state)
        if config is None and tiles is not None:
            config = config_for(p, tiles, sm_count=sm_count(dev))
        elif config is None and _tune.enabled():
            config = tuned_config(p, inputs, flags, ls, dev)
        plan = scan_plan(p, device=dev, config=config, **flags)
        run_scan_plan(plan, dict(inputs, y=y, final_state=final_state), int(ls.cuda_stream), dev)
    return SSMScanOutput(y, final_state)


#: bump when a kernel change can change which candidate is fastest (part of every tuning key)
KERNEL_VERSION = "ssd-2026-12-02"


def tuned_config(p: SSMScanProblem, inputs: dict, flags: dict, ls, dev) -> ScanConfig:
    """The fastest :func:`tile_families` candidate for this call (:data:`m2export.kernels._tune.TUNER`), timed on
    the call's inputs into scratch outputs (the caller's buffers, which may alias an input, are not touched)."""
    key = _tune.tuning_key("ssm_scan", KERNEL_VERSION, inputs, device=dev,
                           flags=(flags["dt_softplus"], *map(float, flags["dt_limit"])))
    hit = _tune.TUNER.cached(key)
    if hit is not None:
        return hit
    sms = sm_count(dev)
    candidates = [config_for(p, f, sm_count=sms) for f in tile_families(p)]
    scratch = dict(inputs, y=torch.empty_like(inputs["x"]),
                   final_state=torch.empty(p.shape_of("final_state"), dtype=torch.float32, device=dev))

    def run(cfg: ScanConfig) -> None:
        with ct.compiler_timeout(_tune.COMPILE_TIMEOUT_S):
            run_scan_plan(scan_plan(p, device=dev, config=cfg, **flags), dict(scratch), int(ls.cuda_stream), dev)

    return _tune.TUNER.choose(key, candidates, run, _tune.cuda_timer(ls))


# ----------------------------------------------------------------------------- AOT (TensorRT plugin)
def aot_spec(problem: SSMScanProblem, attrs: SSMScanAttrs, *, has_D: bool = True, has_dt_bias: bool = True,
             has_initial_state: bool = True, config: ScanConfig | None = None,
             tiles: TileFamily | None = None) -> Launch:
    """The single-launch kernel for ``problem``'s headdim/d_state/ngroups/dtype, for the TensorRT AOT plugin.

    Only headdim, d_state, nheads // ngroups and the dtype are compiled in; batch and seqlen are
    runtime extents, so one export serves every batch and seqlen. ``grid(batch, nheads, headdim)``
    is symbolic. In an ONNX graph D, dt_bias and initial_state are always present (``has_*`` default
    True). ``tiles``: one of :func:`tile_families` (a TensorRT tactic) instead of the default tiles.
    Exported by :mod:`m2export.plugins.aot` (the one AOT export path); the entry takes 73
    parameters (x 9, dt 7, A 3, B 9, C 9, D 3, dt_bias 3, initial_state 9, y 9, final_state 9,
    dt_min, dt_max, heads_per_group).
    """
    check_supported(problem, hint='pad the model or use backend="torch"')
    cfg = config or aot_config(problem, tiles)
    tiles = -(-problem.headdim // cfg.block_p)  # headdim is compiled in; a last tile block_p does not fill is masked
    return fused_launch(problem, cfg, dt_softplus=attrs.dt_softplus, dt_limit=attrs.dt_limit, has_D=has_D,
                        has_dt_bias=has_dt_bias, has_init=has_initial_state,
                        grid=lambda batch, nheads, headdim: (batch * nheads, 1, tiles), tma=False)
