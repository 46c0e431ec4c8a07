"""cuTile packed variable-length prefill (``cu_seqlens``, issue 14): one launch group over all sequences, each
block walking ONE sequence (or one segment of it) over the packed batch's global, chunk-aligned tiles.

Semantics: :func:`m2export.kernels.ssd.packed.ssm_scan_packed_recurrent` (each sequence scanned alone, laid end
to end). Launches (one of each per headdim piece of :func:`m2export.kernels.ssd.plan.launch_pieces`; the pre-pass
once):

* :func:`ssd_packed_dt_kernel` (grid (1, nchunks, head blocks)): the per-token coefficients of
  :func:`m2export.kernels.ssd.cutile._ct_decay_terms` with the double-float cumsum restarted at each sequence's
  first token (hi, lo, ecs are sums from the later of the token's sequence start and its chunk start) and w taken
  to the last token of the token's OWN sequence in the chunk (``w_j = delta_j exp2(sum over (j, t_j] of dA)``,
  t_j = min(sequence end, chunk end) - 1): one coefficient row serves every sequence that touches a chunk;
* :func:`ssd_packed_segment_kernel` (only when some sequence has more than one segment): pass 1, the zero-start
  state and total log2-decay of every segment but a sequence's last;
* :func:`ssd_packed_scan_kernel` (grid (nheads, work items, headdim tiles)): pass 2. A block starts from its
  sequence's initial state loaded before the chunk loop (folded with the sequence's earlier segments), the
  unpacked kernel's shape, walks its chunks with rows and columns masked to its sequence's tokens [a, e),
  stores its y rows (masked: a chunk straddling a boundary is computed by each sequence that touches it, each
  storing only its own rows) and, for a sequence's last segment, final_state[s] after the loop.

The work table (int32, one row per work item; :func:`packed_work`) is built on the host from the offsets
(columns :data:`WORK_COLUMNS`): sequences are cut into segments of at most ``chunks_per_seg`` chunks
(the plan of one sequence of all the tokens, :func:`packed_config`), so one long sequence runs the unpacked
split plan's segments and many short ones run side by side, one block each. Empty sequences own no work item;
their final state is their initial state (or zeros), copied on the host's launch stream.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

import cuda.tile as ct

from m2export.contract import SSMScanProblem
from m2export.errors import ContractError
from m2export.kernels import launch as L
from m2export.kernels._host import cached_plan, hinted, launch_stream, out_buffers, sm_count, unit_stride
from m2export.kernels.launch import Launch
from m2export.kernels.ssd.cutile import (_LOG2E, _SEQ_TILE, _ZERO, ConstBool, ConstInt, _ct_chunk_out, _ct_chunk_rows,
                                         _ct_chunk_state_update, _ct_decay_terms, _ct_initial_state,
                                         _ct_load_seg_state, _ct_seg_df_cumsum, _ct_step_size, _ct_store_seg_state,
                                         _ct_store_state)
from m2export.kernels.ssd.naive import SSMScanOutput
from m2export.kernels.ssd.plan import MAX_GRID_Y, ScanConfig, TileFamily, launch_pieces, packed_config

#: columns of a work-table row: sequence, its first token a, one past its last token e, the item's chunks
#: [c_begin, c_end), the sequence's first item (pass 2 folds the pass-1 states of items [first_item, item)),
#: the item's own index (where pass 1 stores its state), 1 if it is the sequence's last segment
WORK_COLUMNS = ("seq", "a", "e", "c_begin", "c_end", "first_item", "item", "last")
_W_SEQ, _W_A, _W_E, _W_CB, _W_CE, _W_FIRST, _W_ITEM, _W_LAST = range(len(WORK_COLUMNS))  # (kernels read ints)
_BIG_POS = 1.0e9  # identity position of the reverse scan in :func:`_ct_seg_end_values`


# ----------------------------------------------------------------------------- tile helpers
def _ct_seq_edges(cu_seqlens, t, CHUNK: ConstInt):
    """(first, last) of each packed token t ((CHUNK,) int32), fp32 0/1: whether t is its sequence's first token
    and whether t + 1 is the next sequence's first token or the end of all tokens (t is its sequence's last)."""
    nseq = cu_seqlens.shape[0] - 1
    cnt0 = ct.zeros((CHUNK,), dtype=ct.int32)
    cnt1 = ct.zeros((CHUNK,), dtype=ct.int32)
    for k in range(ct.cdiv(nseq, _SEQ_TILE)):
        ends = ct.gather(cu_seqlens, k * _SEQ_TILE + 1 + ct.arange(_SEQ_TILE, dtype=ct.int32),
                         padding_value=2147483647)
        cnt0 = cnt0 + ct.sum(ct.where(ends[None, :] <= t[:, None], 1, 0), axis=1)
        cnt1 = cnt1 + ct.sum(ct.where(ends[None, :] <= t[:, None] + 1, 1, 0), axis=1)
    first = ct.where(ct.gather(cu_seqlens, cnt0) == t, 1.0, 0.0)
    last = ct.where(ct.gather(cu_seqlens, cnt1) == t + 1, 1.0, 0.0)
    return first, last


def _ct_first_flagged(h1, l1, f1, p1, h2, l2, f2, p2):
    """Combine of two adjacent ranges (value, flag seen, leftmost position): the value of the leftmost flagged
    element. Which operand is the left range is read from the positions, so the result does not depend on the
    order in which a reverse scan passes them."""
    left1 = p1 < p2
    fl = ct.where(left1, f1, f2)
    take_first = fl > 0.0
    h = ct.where(left1 == take_first, h1, h2)
    lo = ct.where(left1 == take_first, l1, l2)
    return h, lo, ct.maximum(f1, f2), ct.minimum(p1, p2)


def _ct_seg_end_values(hi, lo, last, CHUNK: ConstInt):
    """(hi, lo) at the first token j' >= j with ``last`` set (the last token of j's sequence in this chunk; the
    caller sets ``last`` on the chunk's last token), for every token j: a reverse scan of
    :func:`_ct_first_flagged`."""
    pos = ct.broadcast_to(ct.arange(CHUNK, dtype=ct.int32).astype(ct.float32)[:, None], hi.shape)
    flag = ct.broadcast_to(last[:, None], hi.shape)
    h, lo_t, _f, _p = ct.scan((hi, lo, flag, pos), 0, _ct_first_flagged, (0.0, 0.0, 0.0, _BIG_POS), reverse=True)
    return h, lo_t


def _ct_coef_rows(coef, h, c, CHUNK: ConstInt):
    """Rows dl, hi, r, w, ecs of chunk c, head h of the packed pre-pass's ``coef`` ((5, 1, nheads, tokens)), and
    (hi_last, ecs_last) of the chunk's last token, (1,)."""
    dl = ct.load(coef, index=(0, 0, h, c), shape=(1, 1, 1, CHUNK)).reshape((CHUNK,))
    hi = ct.load(coef, index=(1, 0, h, c), shape=(1, 1, 1, CHUNK)).reshape((CHUNK,))
    r = ct.load(coef, index=(2, 0, h, c), shape=(1, 1, 1, CHUNK)).reshape((CHUNK,))
    w = ct.load(coef, index=(3, 0, h, c), shape=(1, 1, 1, CHUNK)).reshape((CHUNK,))
    ecs = ct.load(coef, index=(4, 0, h, c), shape=(1, 1, 1, CHUNK)).reshape((CHUNK,))
    return dl, hi, r, w, ecs, ct.extract(hi, index=(CHUNK - 1,), shape=(1,)), ct.extract(ecs, index=(CHUNK - 1,),
                                                                                           shape=(1,))


# ----------------------------------------------------------------------------- kernels
@ct.kernel
def ssd_packed_dt_kernel(dt, A, dt_bias, cu_seqlens, coef, dt_min: float, dt_max: float, CHUNK: ConstInt,
                         BLOCK_H: ConstInt, HAS_DT_BIAS: ConstBool, DT_SOFTPLUS: ConstBool):
    """Packed pre-pass. Grid: (1, nchunks, cdiv(nheads, BLOCK_H)).

    Block (0, c, hb) writes coef[:, 0, heads hb*BLOCK_H..., chunk c] ((5, 1, nheads, nchunks*CHUNK) fp32, rows dl,
    hi, r, w, ecs of :func:`m2export.kernels.ssd.cutile._ct_decay_terms`) from delta = clamp(softplus(dt + dt_bias),
    dt_min, dt_max) (0 past the last token): hi, lo (double-float) restart at each sequence's first token; w is
    taken to the last token of the token's own sequence in the chunk (module docstring), so its exponent is
    accurate to that segment's own terms (issue 16)."""
    c = ct.bid(1)
    hb = ct.bid(2)
    seqlen = dt.shape[1]
    v = ct.load(dt, index=(0, c, hb), shape=(1, CHUNK, BLOCK_H), padding_mode=_ZERO).reshape((CHUNK, BLOCK_H))
    v = v.astype(ct.float32)
    a = ct.load(A, index=(hb,), shape=(BLOCK_H,), padding_mode=_ZERO).astype(ct.float32)
    if HAS_DT_BIAS:
        v = v + ct.load(dt_bias, index=(hb,), shape=(BLOCK_H,), padding_mode=_ZERO).astype(ct.float32)[None, :]
    v = _ct_step_size(v, dt_min, dt_max, DT_SOFTPLUS)
    idx = ct.arange(CHUNK, dtype=ct.int32)
    t = c * CHUNK + idx
    delta = ct.where(t[:, None] < seqlen, v, 0.0)
    first, last = _ct_seq_edges(cu_seqlens, t, CHUNK)
    last = ct.where(idx == CHUNK - 1, 1.0, last)
    dA = delta * (a * _LOG2E)[None, :]
    hi, lo, _f = _ct_seg_df_cumsum(dA, ct.broadcast_to(first[:, None], (CHUNK, BLOCK_H)), 0)
    hi_t, lo_t = _ct_seg_end_values(hi, lo, last, CHUNK)
    dl, hi, r, w, ecs = _ct_decay_terms(delta, hi, lo, hi_t, lo_t)
    shape = (1, 1, CHUNK, BLOCK_H)
    ct.store(coef, index=(0, 0, c, hb), tile=dl.reshape(shape), order=(0, 1, 3, 2))
    ct.store(coef, index=(1, 0, c, hb), tile=hi.reshape(shape), order=(0, 1, 3, 2))
    ct.store(coef, index=(2, 0, c, hb), tile=r.reshape(shape), order=(0, 1, 3, 2))
    ct.store(coef, index=(3, 0, c, hb), tile=w.reshape(shape), order=(0, 1, 3, 2))
    ct.store(coef, index=(4, 0, c, hb), tile=ecs.reshape(shape), order=(0, 1, 3, 2))


@ct.kernel
def ssd_packed_segment_kernel(x, coef, B, work, seg_state, seg_logdecay, heads_per_group: int, CHUNK: ConstInt,
                              BLOCK_P: ConstInt, D_STATE: ConstInt, P_TILE0: ConstInt):
    """Packed pass 1. Grid: (nheads, pass-1 work items, headdim tiles of the piece).

    Block (h, j, pt) takes work row j (an item that is not its sequence's last segment, so its last chunk's last
    token is its sequence's) and computes, from a zero state, the state its chunks leave ->
    seg_state[0, h, item, p-tile] ((headdim, d_state) fp32) and their total log2-decay -> seg_logdecay[0, h, item]
    (from the sequence's first token when it starts inside the item's first chunk). Chunks are walked last to first,
    as in :func:`m2export.kernels.ssd.cutile.ssd_segment_state_kernel`; columns before the sequence's first token
    are masked."""
    h = ct.bid(0)
    j = ct.bid(1)
    pt = ct.bid(2) + P_TILE0
    g = h // heads_per_group
    a = ct.gather(work, (j, _W_A))
    c_begin = ct.gather(work, (j, _W_CB))
    c_end = ct.gather(work, (j, _W_CE))
    item = ct.gather(work, (j, _W_ITEM))
    idx = ct.arange(CHUNK, dtype=ct.int32)
    state = ct.full((BLOCK_P, D_STATE), 0.0, dtype=ct.float32)
    later = ct.full((1,), 0.0, dtype=ct.float32)
    for i in range(c_end - c_begin):
        c = c_end - 1 - i
        _dl, _hi, _r, w, _ecs, hi_last, _ecs_last = _ct_coef_rows(coef, h, c, CHUNK)
        x_c = _ct_chunk_rows(x, 0, c, h, pt, CHUNK, BLOCK_P)
        B_c = _ct_chunk_rows(B, 0, c, g, 0, CHUNK, D_STATE)
        wl = ct.where(idx >= a - c * CHUNK, w * ct.exp2(later), 0.0)
        x_w = (x_c.astype(ct.float32) * wl[:, None]).astype(x.dtype)
        state = ct.mma(x_w.transpose(), B_c, state)
        later = later + hi_last
    _ct_store_seg_state(seg_state, 0, h, item, pt, state, BLOCK_P, D_STATE, False)
    ct.store(seg_logdecay, index=(0, h, item), tile=later.reshape((1, 1, 1)))


@ct.kernel
def ssd_packed_scan_kernel(x, coef, B, C, D, initial_state, work, seg_state, seg_logdecay, y, final_state,
                           heads_per_group: int, CHUNK: ConstInt, BLOCK_P: ConstInt, D_STATE: ConstInt,
                           HAS_D: ConstBool, HAS_INIT: ConstBool, STATE_T: ConstBool, SPLIT_UPD: ConstBool,
                           P_TILE0: ConstInt, MASKED_ALL: ConstBool):
    """Packed pass 2. Grid: (nheads, work items, headdim tiles of the piece).

    Block (h, i, pt) takes work row i (sequence s, tokens [a, e), chunks [c_begin, c_end)): its entry state is
    initial_state[s] (HAS_INIT; else zeros), loaded before the chunk loop and folded with the pass-1 states of
    the sequence's earlier items; per chunk, the unpacked SSD with C B^T columns before a masked (before exp),
    w masked to [a, e) and the state decayed to the sequence's last token in the chunk; y rows outside [a, e) are
    not stored (a masked store on chunks that straddle a boundary; MASKED_ALL: on every chunk). The sequence's
    last item writes final_state[s] after the loop."""
    h = ct.bid(0)
    i = ct.bid(1)
    pt = ct.bid(2) + P_TILE0
    g = h // heads_per_group
    s = ct.gather(work, (i, _W_SEQ))
    a = ct.gather(work, (i, _W_A))
    e = ct.gather(work, (i, _W_E))
    c_begin = ct.gather(work, (i, _W_CB))
    c_end = ct.gather(work, (i, _W_CE))
    first_item = ct.gather(work, (i, _W_FIRST))
    if HAS_D:
        d_h = ct.load(D, index=(h,), shape=(1,)).astype(ct.float32)
    else:
        d_h = ct.full((1,), 0.0, dtype=ct.float32)
    # the packed pass 2 loads h0 through TMA (INIT_TMA True): its 256-thread build was measured so (NOTES_ssd.md)
    state = _ct_initial_state(initial_state, s, h, pt, BLOCK_P, D_STATE, HAS_INIT, STATE_T, True)
    for sp in range(first_item, i):
        ld = ct.exp2(ct.load(seg_logdecay, index=(0, h, sp), shape=(1, 1, 1)).reshape((1,)))
        state = state * ld + _ct_load_seg_state(seg_state, 0, h, sp, pt, BLOCK_P, D_STATE, STATE_T)
    DTYPE = x.dtype
    idx = ct.arange(CHUNK, dtype=ct.int32)
    causal = idx[:, None] >= idx[None, :]
    rows = pt * BLOCK_P + ct.arange(BLOCK_P, dtype=ct.int32)
    for c in range(c_begin, c_end):
        cstart = c * CHUNK
        dl, hi, r, w, ecs, _hi_last, _ecs_last = _ct_coef_rows(coef, h, c, CHUNK)
        x_c = _ct_chunk_rows(x, 0, c, h, pt, CHUNK, BLOCK_P)
        B_c = _ct_chunk_rows(B, 0, c, g, 0, CHUNK, D_STATE)
        C_c = _ct_chunk_rows(C, 0, c, g, 0, CHUNK, D_STATE)
        cb = ct.mma(C_c, B_c.transpose(), ct.full((CHUNK, CHUNK), 0.0, dtype=ct.float32))
        seg = ct.where(causal & (idx[None, :] >= a - cstart), hi[:, None] - hi[None, :], -math.inf)
        m = (cb * ct.exp2(seg, flush_to_zero=True)).astype(DTYPE)
        xf = x_c.astype(ct.float32)
        acc = _ct_chunk_out(xf, m, C_c, state, dl, r, ecs, d_h, CHUNK, BLOCK_P, HAS_D, STATE_T).astype(DTYPE)
        tok = cstart + idx
        own = (tok >= a) & (tok < e)
        if MASKED_ALL:
            ct.scatter(y, (0, tok[:, None], h, rows[None, :]), acc, mask=own[:, None])
        else:
            if (a > cstart) | (e < cstart + CHUNK):
                ct.scatter(y, (0, tok[:, None], h, rows[None, :]), acc, mask=own[:, None])
            else:
                ct.store(y, index=(0, c, h, pt), tile=acc.reshape((1, CHUNK, 1, BLOCK_P)))
        # decay to the sequence's last token in this chunk (the chunk's last token unless the sequence ends here)
        ecs_t = ct.sum(ct.where(idx == ct.minimum(e - cstart, CHUNK) - 1, ecs, 0.0), keepdims=True)
        x_w = (xf * ct.where(own, w, 0.0)[:, None]).astype(DTYPE)
        state = _ct_chunk_state_update(state, x_w, B_c, ecs_t, STATE_T, SPLIT_UPD)
    if ct.gather(work, (i, _W_LAST)) > 0:
        _ct_store_state(final_state, s, h, pt, state, BLOCK_P, D_STATE, STATE_T)


# ----------------------------------------------------------------------------- plan
def segment_chunks(cfg: ScanConfig, seqlen: int) -> int:
    """Most chunks of one work item under ``cfg``: its chunks_per_seg, or all chunks for a single-pass plan."""
    return max(1, -(-seqlen // cfg.chunk) if cfg.nseg == 1 else cfg.chunks_per_seg)


def packed_work(offsets: list[int], chunk: int, seg_chunks: int) -> tuple[list[tuple[int, ...]], int, list[int]]:
    """The work table of a pack: (rows, pass-1 row count, empty sequences).

    rows: one per work item in sequence order (:data:`WORK_COLUMNS`), then a copy of every item that is not its
    sequence's last segment (pass 1's rows). A sequence of n chunks (those its tokens touch) is cut into
    ceil(n / seg_chunks) items of near-equal length. Empty sequences own no item."""
    items, empties = [], []
    for s in range(len(offsets) - 1):
        a, e = offsets[s], offsets[s + 1]
        if a == e:
            empties.append(s)
            continue
        c0, c1 = a // chunk, (e - 1) // chunk + 1
        k = -(-(c1 - c0) // seg_chunks)
        per = -(-(c1 - c0) // k)
        k = -(-(c1 - c0) // per)  # (no empty item)
        first = len(items)
        for j in range(k):
            cb = c0 + j * per
            items.append((s, a, e, cb, min(c1, cb + per), first, len(items), int(j == k - 1)))
    pass1 = [r for r in items if not r[_W_LAST]]
    return items + pass1, len(pass1), empties


@dataclass(frozen=True)
class PackedWork:
    """A pack's work table on the device, with what the host needs to launch it."""

    table: torch.Tensor  # (nitems + npass1, len(WORK_COLUMNS)) int32
    nitems: int
    npass1: int
    cu_seqlens: torch.Tensor  # (nseq + 1,) int32 on the device: the offsets the table was built from
    empties: torch.Tensor | None  # indices of the empty sequences (int64, on the device), or None


_WORK: "OrderedDict[tuple, PackedWork]" = OrderedDict()
_WORK_CACHE = 64  # packs remembered (LRU): a repeated pack (a benchmark, a graph capture after a warm-up) copies nothing


def device_work(offsets: list[int], chunk: int, seg_chunks: int, device: torch.device) -> PackedWork:
    """:func:`packed_work` of ``offsets`` as device tensors, cached (LRU of the last packs). A new pack is copied
    to the device on the current stream."""
    key = (tuple(offsets), chunk, seg_chunks, device.index)
    hit = _WORK.get(key)
    if hit is not None:
        _WORK.move_to_end(key)
        return hit
    rows, npass1, empties = packed_work(list(offsets), chunk, seg_chunks)
    table = torch.tensor(rows, dtype=torch.int32).reshape(len(rows), len(WORK_COLUMNS)).to(device)
    cu = torch.tensor(offsets, dtype=torch.int32).to(device)
    emp = torch.tensor(empties, dtype=torch.int64).to(device) if empties else None
    work = PackedWork(table, len(rows) - npass1, npass1, cu, emp)
    _WORK[key] = work
    if len(_WORK) > _WORK_CACHE:
        _WORK.popitem(last=False)
    return work


def _dt_launch(p: SSMScanProblem, cfg: ScanConfig, nchunks: int, *, dt_softplus, dt_limit, has_dt_bias) -> Launch:
    block_h = min(32, 1 << (p.nheads - 1).bit_length())
    args = (L.array("dt", p.dtype, 3), L.array("A", "float32", 1),
            L.array("dt_bias", "float32", 1, source=None if has_dt_bias else "A"), L.array("cu_seqlens", "int32", 1),
            L.array("coef", "float32", 4), L.scalar("dt_min", "float32", float(dt_limit[0])),
            L.scalar("dt_max", "float32", float(dt_limit[1])), L.constant("CHUNK", cfg.chunk),
            L.constant("BLOCK_H", block_h), L.constant("HAS_DT_BIAS", bool(has_dt_bias)),
            L.constant("DT_SOFTPLUS", bool(dt_softplus)))
    return Launch(ssd_packed_dt_kernel, args, (1, nchunks, -(-p.nheads // block_h)), cfg)


def _segment_launch(p: SSMScanProblem, cfg: ScanConfig, piece) -> Launch:
    dtn = p.dtype
    args = (L.array("x", dtn, 4), L.array("coef", "float32", 4), L.array("B", dtn, 4),
            L.array("work", "int32", 2, source="work_pass1"), L.array("seg_state", "float32", 5),
            L.array("seg_logdecay", "float32", 3), L.scalar("heads_per_group", "int32", p.heads_per_group),
            L.constant("CHUNK", cfg.chunk), L.constant("BLOCK_P", piece.width), L.constant("D_STATE", p.d_state),
            L.constant("P_TILE0", piece.tile0))
    kernel = hinted(ssd_packed_segment_kernel, cfg.seg_occupancy or cfg.occupancy, cfg.worker_warps)
    return Launch(kernel, args, None, cfg)


def _scan_launch(p: SSMScanProblem, cfg: ScanConfig, piece, *, has_D, has_init, masked_all: bool) -> Launch:
    dtn = p.dtype
    args = (L.array("x", dtn, 4), L.array("coef", "float32", 4), L.array("B", dtn, 4), L.array("C", dtn, 4),
            L.array("D", "float32", 1, source=None if has_D else "A"),
            L.array("initial_state", "float32", 4, source=None if has_init else "final_state"),
            L.array("work", "int32", 2, source="work_pass2"), L.array("seg_state", "float32", 5),
            L.array("seg_logdecay", "float32", 3), L.array("y", dtn, 4), L.array("final_state", "float32", 4),
            L.scalar("heads_per_group", "int32", p.heads_per_group), L.constant("CHUNK", cfg.chunk),
            L.constant("BLOCK_P", piece.width), L.constant("D_STATE", p.d_state), L.constant("HAS_D", bool(has_D)),
            L.constant("HAS_INIT", bool(has_init)), L.constant("STATE_T", bool(cfg.state_t)),
            L.constant("SPLIT_UPD", bool(cfg.split_upd)), L.constant("P_TILE0", piece.tile0),
            L.constant("MASKED_ALL", bool(masked_all)))
    kernel = hinted(ssd_packed_scan_kernel, cfg.occupancy, cfg.worker_warps)
    return Launch(kernel, args, None, cfg)


@dataclass(frozen=True)
class PackedPlan:
    """The launches of the packed form for one problem signature (grids on axis 1 set per pack: the work items)."""

    dt: Launch
    pieces: tuple[tuple[Launch, Launch, int], ...]  # (pass 1, pass 2, headdim tiles) per headdim piece
    config: ScanConfig


#: the y store of every chunk masked (ct.scatter), not only of the chunks that straddle a boundary: the sm_90
#: build of the scan is then the unpacked kernel's (bf16, mamba2-2.7b plan: 128 registers, no stack, 256 threads,
#: 115 KB smem; with the store-or-scatter branch: 80 registers, 384 threads; CPU builds, benchmarks/NOTES_ssd.md).
#: bench_ssd_packed.py times both
MASKED_ALL = True


def make_packed_plan(p: SSMScanProblem, cfg: ScanConfig, *, dt_softplus: bool, dt_limit: tuple[float, float],
                     has_D: bool, has_dt_bias: bool, has_init: bool, masked_all: bool = MASKED_ALL) -> PackedPlan:
    """The launches of ``cfg`` for the packed batch ``p`` (batch 1). Raises ContractError for another batch."""
    if p.batch != 1:
        raise ContractError(f"x: the packed form takes batch 1, got batch {p.batch}")
    nchunks = -(-p.seqlen // cfg.chunk)
    dt = _dt_launch(p, cfg, nchunks, dt_softplus=dt_softplus, dt_limit=dt_limit, has_dt_bias=has_dt_bias)
    pieces = tuple((_segment_launch(p, cfg, pc), _scan_launch(p, cfg, pc, has_D=has_D, has_init=has_init,
                                                               masked_all=masked_all), pc.tiles)
                   for pc, _ in launch_pieces(p.headdim, cfg.block_p, False))
    return PackedPlan(dt, pieces, cfg)


def packed_plan(p: SSMScanProblem, *, device: torch.device, dt_softplus: bool, dt_limit: tuple[float, float],
                has_D: bool, has_dt_bias: bool, has_init: bool, config: ScanConfig | None = None) -> PackedPlan:
    """:func:`make_packed_plan` with :func:`packed_config` or ``config``, cached per problem signature and device."""
    key = ("ssd-packed", p, float(dt_limit[0]), float(dt_limit[1]), bool(dt_softplus), has_D, has_dt_bias, has_init,
           device.index, config, MASKED_ALL)

    def make():
        cfg = config or packed_config(p, sm_count=sm_count(device))
        return make_packed_plan(p, cfg, dt_softplus=dt_softplus, dt_limit=dt_limit, has_D=has_D,
                                has_dt_bias=has_dt_bias, has_init=has_init, masked_all=MASKED_ALL)

    return cached_plan(key, make)


def ssm_scan_packed_cutile(x, dt, A, B, C, D, dt_bias, initial_state, offsets, *, problem: SSMScanProblem,
                           dt_softplus: bool, dt_limit: tuple[float, float], out=None, final_state_out=None,
                           stream=None, config: ScanConfig | None = None,
                           tiles: TileFamily | None = None) -> SSMScanOutput:
    """cuTile packed prefill in one launch group: the semantics of
    :func:`m2export.kernels.ssd.packed.ssm_scan_packed_recurrent` on validated arguments.

    ``offsets``: the pack's cu_seqlens as host ints (nseq + 1), already checked
    (:func:`m2export.contract.check_cu_seqlens`); the work table and the device copy of the offsets are built
    from them (cached per pack, :func:`device_work`). ``problem``: the packed batch (batch 1, seqlen = all tokens);
    initial_state (or None: zeros) and final_state are (nseq, nheads, headdim, d_state) fp32; empty sequences get
    their initial state. The plan: ``config``, else :func:`packed_config` (``tiles`` if given; no autotuning).
    All work is queued on ``stream`` (see :func:`m2export.kernels.ssd.cutile.ssm_scan_cutile`).
    """
    dev = x.device
    ls = launch_stream(stream, dev)
    p = problem
    nseq = len(offsets) - 1
    with torch.cuda.device(dev), torch.cuda.stream(ls):
        x, dt, B, C = (unit_stride(t) for t in (x, dt, B, C))
        A, D, dt_bias, initial_state = (None if t is None else t.contiguous() for t in (A, D, dt_bias, initial_state))
        y, final_state = out_buffers(x, (nseq, p.nheads, p.headdim, p.d_state), out, final_state_out, allocate=True)
        if p.seqlen == 0:  # every sequence is empty
            final_state.copy_(initial_state) if initial_state is not None else final_state.zero_()
            return SSMScanOutput(y, final_state)
        if config is None and tiles is not None:
            config = packed_config(p, sm_count=sm_count(dev), tiles=tiles)
        plan = packed_plan(p, device=dev, config=config, dt_softplus=dt_softplus, dt_limit=dt_limit,
                           has_D=D is not None, has_dt_bias=dt_bias is not None, has_init=initial_state is not None)
        cfg = plan.config
        work = device_work(offsets, cfg.chunk, segment_chunks(cfg, p.seqlen), dev)
        if work.nitems > MAX_GRID_Y:
            raise ContractError(f"cu_seqlens: {work.nitems} work items, more than the grid's {MAX_GRID_Y}; split the "
                                "batch")
        if work.empties is not None:  # an empty sequence keeps its state
            if initial_state is not None:
                final_state.index_copy_(0, work.empties, initial_state.index_select(0, work.empties))
            else:
                final_state.index_fill_(0, work.empties, 0.0)
        nchunks = -(-p.seqlen // cfg.chunk)
        tensors = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias, initial_state=initial_state,
                       cu_seqlens=work.cu_seqlens, y=y, final_state=final_state,
                       work_pass2=work.table[:work.nitems], work_pass1=work.table[work.nitems:],
                       coef=torch.empty((5, 1, p.nheads, nchunks * cfg.chunk), dtype=torch.float32, device=dev),
                       seg_state=torch.empty((1, p.nheads, max(1, work.nitems) if work.npass1 else 1, p.headdim,
                                              p.d_state), dtype=torch.float32, device=dev),
                       seg_logdecay=torch.empty((1, p.nheads, max(1, work.nitems) if work.npass1 else 1),
                                                dtype=torch.float32, device=dev))
        s = int(ls.cuda_stream)
        ct.launch(s, plan.dt.grid, plan.dt.kernel, plan.dt.bind(tensors))
        for seg, scan, ptiles in plan.pieces:
            if work.npass1:
                ct.launch(s, (p.nheads, work.npass1, ptiles), seg.kernel, seg.bind(tensors))
            ct.launch(s, (p.nheads, work.nitems, ptiles), scan.kernel, scan.bind(tensors))
    return SSMScanOutput(y, final_state)
