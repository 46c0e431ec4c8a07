"""cuTile packed variable-length prefill (``cu_seqlens``, issue 14): one launch group over all sequences, each
block walking ONE sequence (or one segment of it) in chunks aligned to that sequence's own first token.

Semantics: :func:`m2export.kernels.ssd.packed.ssm_scan_packed_recurrent` (each sequence scanned alone, laid end
to end). Every kernel reads and writes a sequence through views of the packed arrays sliced to its tokens
[a, e) (``Array.slice``: loads past e read zeros, stores past e are dropped), so the chunk loop is the unpacked
one (:func:`m2export.kernels.ssd.cutile._ct_scan_chunks`) with nothing masked and no chunk shared by two
sequences: a sequence of L tokens is ceil(L / CHUNK) chunks of its own, the last one partial as in the unpacked
plan. Launches (one of each per headdim piece of :func:`m2export.kernels.ssd.plan.launch_pieces`; the pre-pass
once):

* :func:`ssd_packed_dt_kernel` (grid (1, sequence chunks, head blocks)): the per-token coefficients of
  :func:`m2export.kernels.ssd.cutile._ct_decay_terms` of each sequence chunk (the unpacked pre-pass on the
  sequence's view), into ``coef`` at the chunk's row of the chunk table;
* :func:`ssd_packed_segment_kernel` (only when some sequence has more than one segment): pass 1, the zero-start
  state and total log2-decay of every segment but a sequence's last;
* :func:`ssd_packed_scan_kernel` (grid (nheads, work items, headdim tiles)): pass 2. A block starts from its
  sequence's initial state loaded before the chunk loop (folded with the pass-1 states of the sequence's earlier
  segments), runs the unpacked chunk loop over its chunks of the sequence's views and, for a sequence's last
  segment, writes final_state[s] after the loop.

The work table (int32, one row per work item; :func:`packed_work`, columns :data:`WORK_COLUMNS`) and the chunk
table (one row per sequence chunk, :data:`CHUNK_COLUMNS`) are built on the host from the offsets: sequences are
cut into segments of at most ``chunks_per_seg`` chunks (the plan of one sequence of all the tokens,
:func:`packed_config`), so one long sequence runs the unpacked split plan's segments and many short ones run
side by side, one block each; work rows are ordered longest first (blocks are issued in grid order, so the
longest items start first). Empty sequences own no work item and no chunk; their final state is their initial
state (or zeros), copied on the host's launch stream.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

import cuda.tile as ct

from m2export.contract import SSMScanProblem
from m2export.errors import ContractError
from m2export.kernels import launch as L
from m2export.kernels._host import cached_plan, hinted, launch_stream, out_buffers, sm_count, unit_stride
from m2export.kernels.launch import Launch
from m2export.kernels.ssd.cutile import (_ZERO, ConstBool, ConstInt, _ct_chunk_rows, _ct_decay_terms, _ct_df_cumsum,
                                         _ct_initial_state, _ct_load_seg_state, _ct_log2_steps, _ct_scan_chunks,
                                         _ct_step_size, _ct_store_seg_state, _ct_store_state)
from m2export.kernels.ssd.naive import SSMScanOutput
from m2export.kernels.ssd.plan import MAX_GRID_Y, ScanConfig, TileFamily, launch_pieces, packed_config

#: columns of a work-table row: sequence, its first token a, one past its last token e, the item's chunks
#: [k_begin, k_end) counted from the sequence's first token, the sequence's first item (pass 2 folds the pass-1
#: states of items [first_item, item)), the item's own index (where pass 1 stores its state), 1 if it is the
#: sequence's last segment, the chunk-table row of the sequence's chunk 0 (its coefficients in ``coef``)
WORK_COLUMNS = ("seq", "a", "e", "k_begin", "k_end", "first_item", "item", "last", "coef_chunk0")
_W_SEQ, _W_A, _W_E, _W_KB, _W_KE, _W_FIRST, _W_ITEM, _W_LAST, _W_C0 = range(len(WORK_COLUMNS))  # (kernels read ints)
#: columns of a chunk-table row (the pre-pass's grid axis 1): the sequence's a, e and the chunk k of it
CHUNK_COLUMNS = ("a", "e", "k")


# ----------------------------------------------------------------------------- tile helpers
def _ct_coef_rows(coef, h, c, CHUNK: ConstInt):
    """Rows w and the chunk's total log2-decay hi_last (1,) of chunk-table row c, head h of ``coef``
    ((5, 1, nheads, sequence chunks * CHUNK))."""
    hi = ct.load(coef, index=(1, 0, h, c), shape=(1, 1, 1, CHUNK)).reshape((CHUNK,))
    w = ct.load(coef, index=(3, 0, h, c), shape=(1, 1, 1, CHUNK)).reshape((CHUNK,))
    return w, ct.extract(hi, index=(CHUNK - 1,), shape=(1,))


# ----------------------------------------------------------------------------- kernels
@ct.kernel
def ssd_packed_dt_kernel(dt, A, dt_bias, chunks, coef, dt_min: float, dt_max: float, CHUNK: ConstInt,
                         BLOCK_H: ConstInt, HAS_DT_BIAS: ConstBool, DT_SOFTPLUS: ConstBool):
    """Packed pre-pass. Grid: (1, sequence chunks, cdiv(nheads, BLOCK_H)).

    Block (0, j, hb) takes chunk-table row j (chunk k of the sequence of tokens [a, e)) and writes coef[:, 0,
    heads hb*BLOCK_H..., row j] ((5, 1, nheads, rows*CHUNK) fp32: dl, hi, r, w, ecs of
    :func:`m2export.kernels.ssd.cutile._ct_decay_terms`) from delta = clamp(softplus(dt + dt_bias), dt_min, dt_max)
    of the tokens a + k*CHUNK ... (0 from e on): :func:`m2export.kernels.ssd.cutile.ssd_dt_kernel` on the
    sequence's view of dt."""
    j = ct.bid(1)
    hb = ct.bid(2)
    a = ct.gather(chunks, (j, 0))
    e = ct.gather(chunks, (j, 1))
    k = ct.gather(chunks, (j, 2))
    dts = dt.slice(axis=1, start=a, stop=e)
    v = ct.load(dts, index=(0, k, hb), shape=(1, CHUNK, BLOCK_H), padding_mode=_ZERO).reshape((CHUNK, BLOCK_H))
    v = v.astype(ct.float32)
    av = ct.load(A, index=(hb,), shape=(BLOCK_H,), padding_mode=_ZERO).astype(ct.float32)
    if HAS_DT_BIAS:
        v = v + ct.load(dt_bias, index=(hb,), shape=(BLOCK_H,), padding_mode=_ZERO).astype(ct.float32)[None, :]
    v = _ct_step_size(v, dt_min, dt_max, DT_SOFTPLUS)
    t = k * CHUNK + ct.arange(CHUNK, dtype=ct.int32)
    delta = ct.where(t[:, None] < e - a, v, 0.0)
    hi, lo = _ct_df_cumsum(_ct_log2_steps(delta, av[None, :]), 0)  # log2 units
    dl, hi, r, w, ecs = _ct_decay_terms(delta, hi, lo, ct.extract(hi, index=(CHUNK - 1, 0), shape=(1, BLOCK_H)),
                                        ct.extract(lo, index=(CHUNK - 1, 0), shape=(1, BLOCK_H)))
    shape = (1, 1, CHUNK, BLOCK_H)
    ct.store(coef, index=(0, 0, j, hb), tile=dl.reshape(shape), order=(0, 1, 3, 2))
    ct.store(coef, index=(1, 0, j, hb), tile=hi.reshape(shape), order=(0, 1, 3, 2))
    ct.store(coef, index=(2, 0, j, hb), tile=r.reshape(shape), order=(0, 1, 3, 2))
    ct.store(coef, index=(3, 0, j, hb), tile=w.reshape(shape), order=(0, 1, 3, 2))
    ct.store(coef, index=(4, 0, j, hb), tile=ecs.reshape(shape), order=(0, 1, 3, 2))


@ct.kernel
def ssd_packed_segment_kernel(x, coef, B, work, seg_state, seg_logdecay, heads_per_group: int, CHUNK: ConstInt,
                              BLOCK_P: ConstInt, D_STATE: ConstInt, P_TILE0: ConstInt):
    """Packed pass 1. Grid: (nheads, pass-1 work items, headdim tiles of the piece).

    Block (h, j, pt) takes work row j (an item that is not its sequence's last segment: its chunks are whole) and
    computes, from a zero state, the state its chunks leave -> seg_state[0, h, item, p-tile] ((headdim, d_state)
    fp32) and their total log2-decay -> seg_logdecay[0, h, item]. Chunks are walked last to first, as in
    :func:`m2export.kernels.ssd.cutile.ssd_segment_state_kernel`, on the sequence's views of x and B."""
    h = ct.bid(0)
    j = ct.bid(1)
    pt = ct.bid(2) + P_TILE0
    g = h // heads_per_group
    a = ct.gather(work, (j, _W_A))
    e = ct.gather(work, (j, _W_E))
    k_begin = ct.gather(work, (j, _W_KB))
    k_end = ct.gather(work, (j, _W_KE))
    item = ct.gather(work, (j, _W_ITEM))
    c0 = ct.gather(work, (j, _W_C0))
    xs = x.slice(axis=1, start=a, stop=e)
    Bs = B.slice(axis=1, start=a, stop=e)
    state = ct.full((BLOCK_P, D_STATE), 0.0, dtype=ct.float32)
    later = ct.full((1,), 0.0, dtype=ct.float32)
    for i in range(k_end - k_begin):
        k = k_end - 1 - i
        w, hi_last = _ct_coef_rows(coef, h, c0 + k, CHUNK)
        x_c = _ct_chunk_rows(xs, 0, k, h, pt, CHUNK, BLOCK_P)
        B_c = _ct_chunk_rows(Bs, 0, k, g, 0, CHUNK, D_STATE)
        x_w = (x_c.astype(ct.float32) * (w * ct.exp2(later))[:, None]).astype(x.dtype)
        state = ct.mma(x_w.transpose(), B_c, state)
        later = later + hi_last
    _ct_store_seg_state(seg_state, 0, h, item, pt, state, BLOCK_P, D_STATE, False)
    ct.store(seg_logdecay, index=(0, h, item), tile=later.reshape((1, 1, 1)))


@ct.kernel
def ssd_packed_scan_kernel(x, coef, B, C, D, initial_state, work, seg_state, seg_logdecay, y, final_state,
                           heads_per_group: int, CHUNK: ConstInt, BLOCK_P: ConstInt, D_STATE: ConstInt,
                           HAS_D: ConstBool, HAS_INIT: ConstBool, STATE_T: ConstBool, SPLIT_UPD: ConstBool,
                           P_TILE0: ConstInt):
    """Packed pass 2. Grid: (nheads, work items, headdim tiles of the piece).

    Block (h, i, pt) takes work row i (sequence s, tokens [a, e), its chunks [k_begin, k_end)): its entry state is
    initial_state[s] (HAS_INIT; else zeros), loaded before the chunk loop and folded with the pass-1 states of
    the sequence's earlier items; then the unpacked chunk loop (:func:`m2export.kernels.ssd.cutile._ct_scan_chunks`)
    on the sequence's views of x, B, C and y (rows from e on are neither read nor stored) and its rows of coef.
    The sequence's last item writes final_state[s] after the loop."""
    h = ct.bid(0)
    i = ct.bid(1)
    pt = ct.bid(2) + P_TILE0
    g = h // heads_per_group
    s = ct.gather(work, (i, _W_SEQ))
    a = ct.gather(work, (i, _W_A))
    e = ct.gather(work, (i, _W_E))
    k_begin = ct.gather(work, (i, _W_KB))
    k_end = ct.gather(work, (i, _W_KE))
    first_item = ct.gather(work, (i, _W_FIRST))
    item = ct.gather(work, (i, _W_ITEM))
    c0 = ct.gather(work, (i, _W_C0))
    if HAS_D:
        d_h = ct.load(D, index=(h,), shape=(1,)).astype(ct.float32)
    else:
        d_h = ct.full((1,), 0.0, dtype=ct.float32)
    # the packed pass 2 loads h0 through TMA (INIT_TMA True): its 256-thread build was measured so (NOTES_ssd.md)
    state = _ct_initial_state(initial_state, s, h, pt, BLOCK_P, D_STATE, HAS_INIT, STATE_T, True)
    for sp in range(first_item, item):
        ld = ct.exp2(ct.load(seg_logdecay, index=(0, h, sp), shape=(1, 1, 1)).reshape((1,)))
        state = state * ld + _ct_load_seg_state(seg_state, 0, h, sp, pt, BLOCK_P, D_STATE, STATE_T)
    xs = x.slice(axis=1, start=a, stop=e)
    Bs = B.slice(axis=1, start=a, stop=e)
    Cs = C.slice(axis=1, start=a, stop=e)
    ys = y.slice(axis=1, start=a, stop=e)
    cs = coef.slice(axis=3, start=c0 * CHUNK, stop=(c0 + ct.cdiv(e - a, CHUNK)) * CHUNK)
    # DT_PRE: the coefficients come from cs (dt, A, dt_bias, dt limits and seqlen are not read); no tail, unpacked
    state, _ = _ct_scan_chunks(xs, xs, cs, Bs, Cs, ys, 0, h, g, pt, k_begin, k_end, state, state, d_h, d_h, d_h,
                               0.0, 0.0, e - a, CHUNK, BLOCK_P, D_STATE, HAS_D, False, STATE_T, SPLIT_UPD, True,
                               False, BLOCK_P, 0, initial_state, final_state, work, work, False, False, work, 0, False)
    if ct.gather(work, (i, _W_LAST)) > 0:
        _ct_store_state(final_state, s, h, pt, state, BLOCK_P, D_STATE, STATE_T)


# ----------------------------------------------------------------------------- plan
def segment_chunks(cfg: ScanConfig, seqlen: int) -> int:
    """Most chunks of one work item under ``cfg``: its chunks_per_seg, or all chunks for a single-pass plan."""
    return max(1, -(-seqlen // cfg.chunk) if cfg.nseg == 1 else cfg.chunks_per_seg)


@dataclass(frozen=True)
class WorkTables:
    """The host tables of one pack (:func:`packed_work`)."""

    rows: list[tuple[int, ...]]  # pass-2 rows (every item, longest first), then pass-1 rows (:data:`WORK_COLUMNS`)
    npass1: int  # pass-1 rows: every item that is not its sequence's last segment (longest first)
    chunks: list[tuple[int, int, int]]  # one row per sequence chunk (:data:`CHUNK_COLUMNS`), sequence by sequence
    empties: list[int]  # the empty sequences


def packed_work(offsets: list[int], chunk: int, seg_chunks: int) -> WorkTables:
    """The work and chunk tables of a pack.

    A sequence of L tokens is ceil(L / chunk) chunks of its own (from its first token; the last one partial), cut
    into ceil(chunks / seg_chunks) items of near-equal length, numbered in sequence order (``item``); the rows of
    each pass are ordered by item length, longest first (stable). Empty sequences own no item and no chunk."""
    items, chunks, empties = [], [], []
    for s in range(len(offsets) - 1):
        a, e = offsets[s], offsets[s + 1]
        if a == e:
            empties.append(s)
            continue
        n = -(-(e - a) // chunk)
        k = -(-n // seg_chunks)
        per = -(-n // k)
        k = -(-n // per)  # (no empty item)
        first, c0 = len(items), len(chunks)
        chunks.extend((a, e, j) for j in range(n))
        for j in range(k):
            kb = j * per
            items.append((s, a, e, kb, min(n, kb + per), first, len(items), int(j == k - 1), c0))

    def longest_first(rows):
        return sorted(rows, key=lambda r: r[_W_KB] - r[_W_KE])

    pass1 = longest_first([r for r in items if not r[_W_LAST]])
    return WorkTables(longest_first(items) + pass1, len(pass1), chunks, empties)


@dataclass(frozen=True)
class PackedWork:
    """A pack's tables on the device, with what the host needs to launch it."""

    table: torch.Tensor  # (nitems + npass1, len(WORK_COLUMNS)) int32
    nitems: int
    npass1: int
    chunks: torch.Tensor  # (nchunks, len(CHUNK_COLUMNS)) int32: the pre-pass's rows
    nchunks: int
    empties: torch.Tensor | None  # indices of the empty sequences (int64, on the device), or None


_WORK: "OrderedDict[tuple, PackedWork]" = OrderedDict()
_WORK_CACHE = 64  # packs remembered (LRU): a repeated pack (a benchmark, a graph capture after a warm-up) copies nothing


def device_work(offsets: list[int], chunk: int, seg_chunks: int, device: torch.device) -> PackedWork:
    """:func:`packed_work` of ``offsets`` as device tensors, cached (LRU of the last packs). A new pack is copied
    to the device on the current stream. Raises ContractError past the grid's MAX_GRID_Y rows on axis 1."""
    key = (tuple(offsets), chunk, seg_chunks, device.index)
    hit = _WORK.get(key)
    if hit is not None:
        _WORK.move_to_end(key)
        return hit
    w = packed_work(list(offsets), chunk, seg_chunks)
    nitems = len(w.rows) - w.npass1
    if max(nitems, len(w.chunks)) > MAX_GRID_Y:
        raise ContractError(f"cu_seqlens: {nitems} work items and {len(w.chunks)} sequence chunks, more than the "
                            f"grid's {MAX_GRID_Y}; split the batch")
    table = torch.tensor(w.rows, dtype=torch.int32).reshape(len(w.rows), len(WORK_COLUMNS)).to(device)
    chunks = torch.tensor(w.chunks, dtype=torch.int32).reshape(len(w.chunks), len(CHUNK_COLUMNS)).to(device)
    emp = torch.tensor(w.empties, dtype=torch.int64).to(device) if w.empties else None
    work = PackedWork(table, nitems, w.npass1, chunks, len(w.chunks), emp)
    _WORK[key] = work
    if len(_WORK) > _WORK_CACHE:
        _WORK.popitem(last=False)
    return work


def _dt_launch(p: SSMScanProblem, cfg: ScanConfig, *, dt_softplus, dt_limit, has_dt_bias) -> Launch:
    block_h = min(32, 1 << (p.nheads - 1).bit_length())
    args = (L.array("dt", p.dtype, 3), L.array("A", "float32", 1),
            L.array("dt_bias", "float32", 1, source=None if has_dt_bias else "A"), L.array("chunks", "int32", 2),
            L.array("coef", "float32", 4), L.scalar("dt_min", "float32", float(dt_limit[0])),
            L.scalar("dt_max", "float32", float(dt_limit[1])), L.constant("CHUNK", cfg.chunk),
            L.constant("BLOCK_H", block_h), L.constant("HAS_DT_BIAS", bool(has_dt_bias)),
            L.constant("DT_SOFTPLUS", bool(dt_softplus)))
    return Launch(ssd_packed_dt_kernel, args, None, cfg)


def _segment_launch(p: SSMScanProblem, cfg: ScanConfig, piece) -> Launch:
    dtn = p.dtype
    args = (L.array("x", dtn, 4), L.array("coef", "float32", 4), L.array("B", dtn, 4),
            L.array("work", "int32", 2, source="work_pass1"), L.array("seg_state", "float32", 5),
            L.array("seg_logdecay", "float32", 3), L.scalar("heads_per_group", "int32", p.heads_per_group),
            L.constant("CHUNK", cfg.chunk), L.constant("BLOCK_P", piece.width), L.constant("D_STATE", p.d_state),
            L.constant("P_TILE0", piece.tile0))
    kernel = hinted(ssd_packed_segment_kernel, cfg.seg_occupancy or cfg.occupancy, cfg.worker_warps)
    return Launch(kernel, args, None, cfg)


def _scan_launch(p: SSMScanProblem, cfg: ScanConfig, piece, *, has_D, has_init) -> Launch:
    dtn = p.dtype
    args = (L.array("x", dtn, 4), L.array("coef", "float32", 4), L.array("B", dtn, 4), L.array("C", dtn, 4),
            L.array("D", "float32", 1, source=None if has_D else "A"),
            L.array("initial_state", "float32", 4, source=None if has_init else "final_state"),
            L.array("work", "int32", 2, source="work_pass2"), L.array("seg_state", "float32", 5),
            L.array("seg_logdecay", "float32", 3), L.array("y", dtn, 4), L.array("final_state", "float32", 4),
            L.scalar("heads_per_group", "int32", p.heads_per_group), L.constant("CHUNK", cfg.chunk),
            L.constant("BLOCK_P", piece.width), L.constant("D_STATE", p.d_state), L.constant("HAS_D", bool(has_D)),
            L.constant("HAS_INIT", bool(has_init)), L.constant("STATE_T", bool(cfg.state_t)),
            L.constant("SPLIT_UPD", bool(cfg.split_upd)), L.constant("P_TILE0", piece.tile0))
    kernel = hinted(ssd_packed_scan_kernel, cfg.occupancy, cfg.worker_warps)
    return Launch(kernel, args, None, cfg)


@dataclass(frozen=True)
class PackedPlan:
    """The launches of the packed form for one problem signature (grids on axis 1 set per pack: the chunk table's
    rows for the pre-pass, the work items for the passes)."""

    dt: Launch
    pieces: tuple[tuple[Launch, Launch, int], ...]  # (pass 1, pass 2, headdim tiles) per headdim piece
    config: ScanConfig


def make_packed_plan(p: SSMScanProblem, cfg: ScanConfig, *, dt_softplus: bool, dt_limit: tuple[float, float],
                     has_D: bool, has_dt_bias: bool, has_init: bool) -> PackedPlan:
    """The launches of ``cfg`` for the packed batch ``p`` (batch 1). Raises ContractError for another batch."""
    if p.batch != 1:
        raise ContractError(f"x: the packed form takes batch 1, got batch {p.batch}")
    dt = _dt_launch(p, cfg, dt_softplus=dt_softplus, dt_limit=dt_limit, has_dt_bias=has_dt_bias)
    pieces = tuple((_segment_launch(p, cfg, pc), _scan_launch(p, cfg, pc, has_D=has_D, has_init=has_init), pc.tiles)
                   for pc, _ in launch_pieces(p.headdim, cfg.block_p, False))
    return PackedPlan(dt, pieces, cfg)


def packed_plan(p: SSMScanProblem, *, device: torch.device, dt_softplus: bool, dt_limit: tuple[float, float],
                has_D: bool, has_dt_bias: bool, has_init: bool, config: ScanConfig | None = None) -> PackedPlan:
    """:func:`make_packed_plan` with :func:`packed_config` or ``config``, cached per problem signature and device."""
    key = ("ssd-packed", p, float(dt_limit[0]), float(dt_limit[1]), bool(dt_softplus), has_D, has_dt_bias, has_init,
           device.index, config)

    def make():
        cfg = config or packed_config(p, sm_count=sm_count(device))
        return make_packed_plan(p, cfg, dt_softplus=dt_softplus, dt_limit=dt_limit, has_D=has_D,
                                has_dt_bias=has_dt_bias, has_init=has_init)

    return cached_plan(key, make)


def packed_launches(plan: PackedPlan, work: PackedWork, nheads: int) -> tuple[tuple[Launch, tuple[int, int, int]], ...]:
    """(launch, grid) of each kernel of ``plan`` over ``work``, in launch order: the pre-pass, then per headdim piece
    pass 1 (when some sequence has more than one item) and pass 2."""
    block_h = next(a.value for a in plan.dt.args if a.name == "BLOCK_H")
    out = [(plan.dt, (1, work.nchunks, -(-nheads // block_h)))]
    for seg, scan, ptiles in plan.pieces:
        if work.npass1:
            out.append((seg, (nheads, work.npass1, ptiles)))
        out.append((scan, (nheads, work.nitems, ptiles)))
    return tuple(out)


def run_packed_plan(plan: PackedPlan, work: PackedWork, tensors: dict, stream: int) -> None:
    """Queue :func:`packed_launches` on ``stream``; ``tensors`` maps the launch arguments' names to arrays (inputs,
    outputs and the scratch of :func:`packed_scratch`; the tables come from ``work``)."""
    tensors = dict(tensors, chunks=work.chunks, work_pass2=work.table[:work.nitems],
                   work_pass1=work.table[work.nitems:])
    for launch, grid in packed_launches(plan, work, tensors["x"].shape[2]):
        ct.launch(stream, grid, launch.kernel, launch.bind(tensors))


def packed_scratch(p: SSMScanProblem, cfg: ScanConfig, work: PackedWork, device: torch.device) -> dict:
    """The scratch arrays of one packed run: coef (the pre-pass's coefficients, one CHUNK-row per sequence chunk)
    and pass 1's segment states and log2-decays (a one-item stand-in when there is no pass 1)."""
    nseg = max(1, work.nitems) if work.npass1 else 1
    return dict(coef=torch.empty((5, 1, p.nheads, work.nchunks * cfg.chunk), dtype=torch.float32, device=device),
                seg_state=torch.empty((1, p.nheads, nseg, p.headdim, p.d_state), dtype=torch.float32, device=device),
                seg_logdecay=torch.empty((1, p.nheads, nseg), dtype=torch.float32, device=device))


def ssm_scan_packed_cutile(x, dt, A, B, C, D, dt_bias, initial_state, offsets, *, problem: SSMScanProblem,
                           dt_softplus: bool, dt_limit: tuple[float, float], out=None, final_state_out=None,
                           stream=None, config: ScanConfig | None = None,
                           tiles: TileFamily | None = None) -> SSMScanOutput:
    """cuTile packed prefill in one launch group: the semantics of
    :func:`m2export.kernels.ssd.packed.ssm_scan_packed_recurrent` on validated arguments.

    ``offsets``: the pack's cu_seqlens as host ints (nseq + 1), already checked
    (:func:`m2export.contract.check_cu_seqlens`); the work and chunk tables are built from them (cached per pack,
    :func:`device_work`). ``problem``: the packed batch (batch 1, seqlen = all tokens); initial_state (or None:
    zeros) and final_state are (nseq, nheads, headdim, d_state) fp32; empty sequences get their initial state.
    The plan: ``config``, else :func:`packed_config` (``tiles`` if given; no autotuning). All work is queued on
    ``stream`` (see :func:`m2export.kernels.ssd.cutile.ssm_scan_cutile`). Raises ContractError for a pack of more
    than MAX_GRID_Y work items or sequence chunks.
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
        if work.empties is not None:  # an empty sequence keeps its state
            if initial_state is not None:
                final_state.index_copy_(0, work.empties, initial_state.index_select(0, work.empties))
            else:
                final_state.index_fill_(0, work.empties, 0.0)
        tensors = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias, initial_state=initial_state, y=y,
                       final_state=final_state, **packed_scratch(p, cfg, work, dev))
        run_packed_plan(plan, work, tensors, int(ls.cuda_stream))
    return SSMScanOutput(y, final_state)
