"""Launch plan of the cuTile SSD forward: tile sizes, segment count and compiler hints.

Plain Python (no cuda.tile import), so the planning rules are tested on machines without a GPU;
the kernels that consume a :class:`ScanConfig` are in :mod:`m2export.kernels.ssd.cutile`.
Measurements behind the defaults and the cost model: ``benchmarks/NOTES_ssd.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from m2export.contract import SSMScanProblem
from m2export.errors import ContractError

_DEFAULT_SM_COUNT = 132  # H200 SXM


@dataclass(frozen=True)
class ScanConfig:
    """Tile sizes and launch plan of one SSMScan call.

    chunk: tokens per chunk (power of two); block_p: headdim rows per block of the widest tiles (power of
    two; a headdim it does not divide is covered by :func:`headdim_pieces`, or by a masked last tile in the
    AOT kernel); nseg: sequence segments (1 = one pass over the sequence: ssd_fused_kernel alone, or
    ssd_dt_kernel + ssd_scan_kernel when dt_pre); chunks_per_seg: chunks in each segment (the last
    may have fewer). A config is made for one seqlen: the launch refuses one that does not cover it.
    """

    chunk: int
    block_p: int
    nseg: int
    chunks_per_seg: int
    occupancy: int | None = None  # cuTile compiler hint: blocks per SM (None: compiler default)
    state_t: bool = False  # keep the state on chip as (d_state, headdim) instead of (headdim, d_state)
    split_upd: bool = False  # add each chunk's state contribution after its own product
    dt_pre: bool = False  # step sizes and decays by a pre-pass kernel (ssd_dt_kernel) instead of in the scan loop
    worker_warps: int | None = None  # cuTile compiler hint num_worker_warps (None: compiler default)
    seg_occupancy: int | None = None  # occupancy hint of the split plan's pass 1 (None: same as occupancy)
    merge_tail: bool = False  # headdim = block_p + a narrower power of two: one block owns both (launch_pieces)
    init_tma: bool = True  # the initial-state load may use TMA (False: a plain load; see init_tma_default)
    # ssd_cb_kernel before the scan (needs dt_pre; never packed or AOT): 0 none (C @ B^T in the chunk loop), 1 C @ B^T
    # once per (batch, group, chunk) in fp32, 2 the masked, decayed M (times r_i and dl_j) once per (batch, head, chunk)
    # in the input dtype
    cb_pre: int = 0
    # C @ B^T and C @ state^T as one product C @ [B^T | state^T] in the scan's chunk loop (three serialised wgmma groups
    # per chunk instead of four; needs block_p == chunk and cb_pre 0; never packed or AOT); see choose_config
    cb_state: bool = False

    @property
    def plan(self) -> str:
        return ("single" if self.nseg == 1 else "split") + ("+dt" if self.dt_pre else "")


def _default_chunk(problem: SSMScanProblem) -> int:
    # fp32 products run as FFMA with whole operand tiles in registers (they spill: 24 KB of stack
    # per thread at chunk 64, d_state 256); chunk 32 halves that. d_state 256 (bf16/fp16): at chunk 64 the
    # scan kernel needs 255 registers, an 80-byte stack and 161 KB of shared memory (one block per SM);
    # at chunk 32, 128 registers and 114 KB (two per SM; sm_90 build on the CPU, benchmarks/NOTES_ssd.md)
    return 32 if problem.dtype == "float32" or problem.d_state >= 256 else DEFAULT_CHUNK


# d_state 256 in bf16, JIT plans: chunk 64 with 16-row headdim tiles (sm_90 build: 128 registers, no stack,
# 113 KB shared memory, two blocks per SM) measured 0.670 ms against 0.715 for chunk 32 with 32-row tiles and
# 0.838-1.05 for the other tiles/segment counts swept (Falcon-H1-7B's shape, H200, eager; benchmarks/NOTES_ssd.md).
# fp16 keeps chunk 32 (this plan never ran on the GPU in fp16); the AOT kernel keeps _default_chunk/_default_block_p.
# With these tiles the state is kept as (headdim, d_state) (state_t False): 0.595 ms against 0.669 for
# (d_state, headdim), graph replay, same H200 run (session 6, 19:19 UTC; sm_90 build: 36 instead of 52 HGMMA per
# chunk, 1,996 instead of 2,364 SASS instructions, 128 registers, 110 KB shared memory).
# Session 2026-12-02 (helper "gpu", H200, same run): chunk 64 with 32-row tiles, one pass, (headdim, d_state):
# 0.401 ms against 0.594 for (64, 16) in two segments (graph replay, Falcon-H1-7B, no initial state; the
# autotuner's pick too); with an initial state its AOT build 0.724 vs 0.807 ms (RESULTS.md, NOTES_ssd.md).
_D_STATE_256_JIT_TILES = (64, 32)
_D_STATE_256_JIT_STATE_T = False
# With those tiles, M = r_i (C B^T)_ij exp2(hi_i - hi_j) dl_j by ssd_cb_kernel (cb_pre 2): the chunk loop then has no
# C @ B^T, no exp2 and no scaling of x (656 instead of 953 SASS per iteration, sm_90 build; benchmarks/NOTES_ssd.md,
# 2026-12-03 "cb_pre 2 with the step sizes folded into M"). Only for these heuristic tiles (not the tuner's families).
_D_STATE_256_JIT_CB_PRE = 2

# Merged headdim tails (launch_pieces: 80 = 64 + 16 in one block) with 16-bit inputs keep the state as (headdim,
# d_state). sm_90 builds on the CPU with an initial state (ptxas -v, bf16 and fp16, Nemotron-Nano-9B's P80 N128, 64-row
# tile + 16-row tail): (d_state, headdim) 255 registers, 112-byte stack, 128 threads (tileiras drops warp
# specialisation, the build that ran 0.581 ms with a state against 0.346 without); (headdim, d_state) 128 registers,
# no stack, 256 threads with or without a state, and 0.305 against 0.336 ms without a state (H200, same run,
# 2026-12-02; benchmarks/NOTES_ssd.md). P96 (64 + 32) builds 128 threads with either layout, P48 N64 (32 + 16) 256
# with either; fp32 (FFMA, spills) 128 threads with either and keeps the default.
_MERGED_TAIL_STATE_T = False


def init_tma_default(state_t: bool, d_state: int, *, aot: bool) -> bool:
    """Whether the scan's initial-state load may use TMA (the one home of this choice; ScanConfig.init_tma).

    tileiras drops the warp-specialised build (256 -> 128 threads, 255 registers) when the chunk loop starts from
    a TMA-loaded state in some tile families; a plain load of that one tile keeps it in others. sm_90 builds on the
    CPU with an initial state (ptxas -v, 2026-12-02, benchmarks/NOTES_ssd.md "initial-state load"):
    JIT scan kernel: TMA keeps 256 threads for every (d_state, headdim) family and for (headdim, d_state) at
    d_state 128 (a plain load drops it there: 64:64 S 242 registers, 128 threads), while at d_state 256 the
    (headdim, d_state) default (64:32 S) needs the plain load (TMA: 255 registers, 128 threads; plain: 128, 256).
    AOT fused kernel (the plugin, always with a state): the plain load gives 256 threads where TMA gave 128
    (64:64 T bf16/fp16, 64:32 S at d_state 256) and the same build class on every other family tried.
    """
    if aot:
        return False
    return state_t or d_state < 256


def _default_block_p(headdim: int, d_state: int) -> int:
    # keep the fp32 state tile (block_p x d_state) at <= 8192 elements (32 KiB) per block; a power of two
    # no wider than headdim (80 -> 64 + a 16-row piece, see headdim_pieces)
    return max(16, min(1 << (headdim.bit_length() - 1), 8192 // d_state))


class HeaddimPiece(NamedTuple):
    """``tiles`` headdim tiles of ``width`` rows (a power of two) starting at tile index ``tile0`` (rows
    tile0*width ...): the grid's third axis of one launch."""

    width: int
    tile0: int
    tiles: int


def headdim_pieces(headdim: int, block_p: int) -> tuple[HeaddimPiece, ...]:
    """Cover headdim rows exactly with power-of-two tiles: full tiles of ``block_p`` rows, then the remainder
    in descending powers of two (each starts at a multiple of its width), e.g. 80 with block_p 64 -> 64 + 16,
    112 -> 64 + 32 + 16, 96 with block_p 32 -> 3 x 32. One launch per piece, all sharing the pre-pass and
    scratch: no padded rows, no copies (the C @ B^T product is recomputed per tile, as for full tiles).
    Raises ValueError unless headdim is a positive multiple of 16 and block_p a power of two >= 16.
    """
    if headdim <= 0 or headdim % 16 or block_p < 16 or block_p & (block_p - 1):
        raise ValueError(f"headdim_pieces: headdim {headdim} (multiple of 16) and block_p {block_p} (power of 2 >= 16)")
    pieces = [HeaddimPiece(block_p, 0, headdim // block_p)] if headdim >= block_p else []
    done = headdim - headdim % block_p
    w = block_p // 2
    while done < headdim:
        if headdim - done >= w:
            pieces.append(HeaddimPiece(w, done // w, 1))
            done += w
        w //= 2
    return tuple(pieces)


def launch_pieces(headdim: int, block_p: int, merge_tail: bool) -> tuple[tuple[HeaddimPiece, HeaddimPiece | None], ...]:
    """The headdim pieces of the scan launches, each with the tail piece its blocks also own (or None).

    Without ``merge_tail`` (or when it does not apply) one launch per :func:`headdim_pieces` piece. With it,
    a headdim of one full block_p tile plus one narrower power of two (80 = 64 + 16, 96 = 64 + 32, 48 = 32 + 16)
    is one launch whose blocks own both: the narrow rows share the chunk's C @ B^T, its B/C loads and its
    coefficients with the full tile instead of recomputing them in a second launch of half-idle blocks (the
    cause of head dim 80 costing 2.0x head dim 64 per row, benchmarks/NOTES_ssd.md, issue 15).
    """
    pieces = headdim_pieces(headdim, block_p)
    if merge_tail and len(pieces) == 2 and pieces[0].tiles == 1:
        return ((pieces[0], pieces[1]),)
    return tuple((pc, None) for pc in pieces)


# Defaults (measured on the H200: benchmarks/NOTES_ssd.md): chunk 64 (32 for fp32), step sizes by the
# pre-pass kernel, the state kept as (d_state, headdim) with each chunk's contribution accumulated onto
# the decayed state, occupancy hint 2; the segment count from _plan_cost below.
DEFAULT_CHUNK = 64
DEFAULT_OCCUPANCY = 2
DEFAULT_STATE_T = True
DEFAULT_SPLIT_UPD = False
DEFAULT_DT_PRE = True
DEFAULT_MERGE_TAIL = True
DEFAULT_CB_PRE = 0  # benchmarks/NOTES_ssd.md "C @ B^T by a pre-pass"
DEFAULT_CB_STATE = False  # 5-9% slower on the H200: benchmarks/NOTES_ssd.md "C @ B^T and C @ state^T as one product"
MAX_NSEG = 64

# Relative costs in the plan model, in units of one chunk iteration of the scan kernel (fitted on
# the H200; the fits, their spread and the measured-vs-modelled plans: benchmarks/NOTES_ssd.md):
# a pass-1 chunk, a block's fixed cost (paid once per wave), folding one earlier segment, a launch.
_PASS1_CHUNK_COST = 0.22
_BLOCK_COST = 2.4
_FOLD_COST = 0.4
_LAUNCH_COST = 1.0
MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y: ssd_dt_kernel puts chunks there
# A split plan re-reads x and B and is modelled only to ~10-17% (NOTES_ssd.md): split only when the
# model predicts at least this fraction less time than one pass.
_SPLIT_MIN_GAIN = 0.10


def _plan_cost(base: int, nchunks: int, nseg: int, slots: int) -> float:
    """Modelled time of the split plan with ``nseg`` segments (1: single pass), in chunk iterations.

    base: (batch, head, p-tile) blocks per segment; slots: blocks resident at once (occupancy x
    SMs). Blocks of one launch take the same time, so a launch costs ceil(blocks / slots) waves of
    (chunks_per_seg + block cost); the last pass-2 block also folds nseg - 1 segment states.
    Measured against modelled plans: benchmarks/NOTES_ssd.md.
    """
    cps = -(-nchunks // nseg)
    nseg = -(-nchunks // cps)
    cost = -(-base * nseg // slots) * (cps + _BLOCK_COST)
    if nseg > 1:
        cost += (-(-base * (nseg - 1) // slots)) * (_PASS1_CHUNK_COST * cps + _BLOCK_COST)
        cost += _FOLD_COST * (nseg - 1) + _LAUNCH_COST
    return cost


def choose_config(problem: SSMScanProblem, *, sm_count: int = _DEFAULT_SM_COUNT, chunk: int | None = None,
                  block_p: int | None = None, nseg: int | None = None,
                  occupancy: int | None = None, state_t: bool | None = None,
                  split_upd: bool | None = None, dt_pre: bool | None = None,
                  worker_warps: int | None = None, seg_occupancy: int | None = None,
                  merge_tail: bool | None = None, init_tma: bool | None = None,
                  cb_pre: int | None = None, cb_state: bool | None = None) -> ScanConfig:
    """Pick chunk, headdim tile, segment count and compiler hints for ``problem``.

    Heuristic: the DEFAULT_* values above; block_p from the register budget of the state (d_state 256 in
    bf16: chunk 64, 32-row tiles and the state as (headdim, d_state), measured); the state as (headdim, d_state)
    for a merged headdim tail with 16-bit inputs (_MERGED_TAIL_STATE_T); nseg
    minimising the sum of :func:`_plan_cost` over the launches of :func:`launch_pieces` (launches on one
    stream run one after the other: each pays its own waves), over 1..MAX_NSEG
    (wave quantisation matters: on the H200, shape d
    of the benchmark runs 13 segments = 3.94 waves of blocks rather than 14 = 4.24), kept only if
    it is modelled at least _SPLIT_MIN_GAIN faster than one pass; the dt
    pre-pass unless the sequence has more than MAX_GRID_Y chunks; ``cb_pre`` (ScanConfig.cb_pre) only with the
    pre-pass (0 without it), default DEFAULT_CB_PRE (_D_STATE_256_JIT_CB_PRE with the bf16 d_state-256 tiles). Any argument
    given overrides its default (explicit plans for tests and the benchmark's sweeps); ``occupancy=0``
    means no hint. ``cb_state`` (ScanConfig.cb_state, default DEFAULT_CB_STATE) needs block_p == chunk, cb_pre 0 and the
    pre-pass or a split (the scan kernel; the fused single launch has no such form): ValueError otherwise.
    """
    if chunk is None and block_p is None and problem.d_state >= 256 and problem.dtype == "bfloat16":
        chunk, block_p = _D_STATE_256_JIT_TILES
        # no wider than headdim (16 -> 16), and within the state tile's budget beyond d_state 256 (as the
        # default: 16 rows at d_state 512, not 32 x 512 fp32 = 64 KiB per block)
        block_p = min(block_p, 1 << (problem.headdim.bit_length() - 1), max(16, 8192 // problem.d_state))
        state_t = _D_STATE_256_JIT_STATE_T if state_t is None else state_t
        cb_pre = _D_STATE_256_JIT_CB_PRE if cb_pre is None else cb_pre
    chunk = chunk or _default_chunk(problem)
    block_p = block_p or _default_block_p(problem.headdim, problem.d_state)
    occupancy = DEFAULT_OCCUPANCY if occupancy is None else (occupancy or None)
    split_upd = DEFAULT_SPLIT_UPD if split_upd is None else split_upd
    merge_tail = DEFAULT_MERGE_TAIL if merge_tail is None else merge_tail
    launches = launch_pieces(problem.headdim, block_p, merge_tail)
    if state_t is None and problem.dtype != "float32" and launches[0][1] is not None:  # a merged tail
        state_t = _MERGED_TAIL_STATE_T
    state_t = DEFAULT_STATE_T if state_t is None else state_t
    nchunks = max(1, -(-problem.seqlen // chunk))
    bases = [max(1, problem.batch * problem.nheads * pc.tiles) for pc, _ in launches]
    if nseg is None:
        slots = (occupancy or 1) * sm_count
        cost = {n: sum(_plan_cost(base, nchunks, n, slots) for base in bases)
                for n in range(1, min(nchunks, MAX_NSEG) + 1)}
        nseg = min(cost, key=lambda n: (cost[n], n))
        if cost[nseg] > (1 - _SPLIT_MIN_GAIN) * cost[1]:
            nseg = 1
    nseg = max(1, min(nseg, nchunks))
    cps = -(-nchunks // nseg)
    nseg = -(-nchunks // cps)  # no empty segment
    if dt_pre is None:  # the pre-pass grid has the chunks on y (at most 65535: ~4M tokens at chunk 64)
        dt_pre = DEFAULT_DT_PRE and nchunks <= MAX_GRID_Y
    if init_tma is None:
        init_tma = init_tma_default(state_t, problem.d_state, aot=False)
    cb_pre = int(DEFAULT_CB_PRE if cb_pre is None else cb_pre) if dt_pre else 0
    if cb_pre not in (0, 1, 2):
        raise ValueError(f"choose_config: cb_pre {cb_pre} (0, 1 or 2)")
    cb_state = bool(DEFAULT_CB_STATE if cb_state is None else cb_state)
    if cb_state and (block_p != chunk or cb_pre or not (dt_pre or nseg > 1)):
        raise ValueError(f"choose_config: cb_state needs block_p == chunk (got {block_p}, {chunk}), cb_pre 0 (got "
                         f"{cb_pre}) and the scan kernel (dt_pre or nseg > 1; got dt_pre {dt_pre}, nseg {nseg})")
    return ScanConfig(chunk=chunk, block_p=block_p, nseg=nseg, chunks_per_seg=cps, occupancy=occupancy,
                      state_t=state_t, split_upd=split_upd, dt_pre=dt_pre,
                      worker_warps=worker_warps or None, seg_occupancy=seg_occupancy or None, merge_tail=merge_tail,
                      init_tma=init_tma, cb_pre=cb_pre, cb_state=cb_state)


def aot_config(problem: SSMScanProblem, tiles: "TileFamily | None" = None) -> ScanConfig:
    """The single-launch configuration the AOT plugin compiles (nseg 1, the measured defaults; ``tiles``, a
    TensorRT tactic's :class:`TileFamily`, replaces chunk, block_p and the state layout)."""
    cfg = ScanConfig(chunk=_default_chunk(problem), block_p=_default_block_p(problem.headdim, problem.d_state), nseg=1,
                     chunks_per_seg=0, occupancy=DEFAULT_OCCUPANCY, state_t=DEFAULT_STATE_T,
                     split_upd=DEFAULT_SPLIT_UPD, init_tma=init_tma_default(DEFAULT_STATE_T, problem.d_state, aot=True))
    return cfg if tiles is None else replace(cfg, chunk=tiles.chunk, block_p=tiles.block_p, state_t=tiles.state_t)


# ----------------------------------------------------------------------------- tuning space
@dataclass(frozen=True)
class TileFamily:
    """The part of a :class:`ScanConfig` a tuner chooses: chunk, headdim tile rows and the on-chip state layout.

    Independent of batch and seqlen (the segment count is modelled per call by :func:`choose_config`), so one
    choice serves every shape of a layer: the TensorRT plugin's tactic ``i`` is ``tile_families(problem)[i - 1]``.
    """

    chunk: int
    block_p: int
    state_t: bool


#: at most this many candidates per problem (each is a compile: bounded tuning time)
MAX_FAMILIES = 6
_CHUNKS = (32, 64, 128)
_BLOCK_PS = (16, 32, 64)


def _family(cfg: ScanConfig) -> TileFamily:
    return TileFamily(cfg.chunk, cfg.block_p, cfg.state_t)


def tile_families(problem: SSMScanProblem) -> tuple[TileFamily, ...]:
    """The tuning space of ``problem``: the heuristic's family first, then one knob changed at a time (chunk,
    then headdim tile, then the state layout), at most :data:`MAX_FAMILIES`, deterministic.

    Depends only on headdim, d_state and the dtype. Every family keeps the fp32 state tile within the
    heuristic's register budget (block_p x d_state <= 8192 elements, block_p no wider than headdim's largest
    power of two); chunk 128 only for 16-bit inputs with d_state <= 128 (fp32 and d_state 256 spill already at
    64: :func:`_default_chunk`).
    """
    base = _family(choose_config(replace(problem, batch=1, seqlen=1)))
    widest = 1 << (problem.headdim.bit_length() - 1)
    wide_ok = problem.dtype != "float32" and problem.d_state <= 128

    def ok(f: TileFamily) -> bool:
        return (f.block_p <= widest and f.block_p * problem.d_state <= 8192 and (f.chunk <= 64 or wide_ok))

    out = [base]
    variants = ([replace(base, chunk=c) for c in _CHUNKS] + [replace(base, block_p=b) for b in _BLOCK_PS]
                + [replace(base, state_t=not base.state_t)]
                + [replace(base, chunk=c, state_t=not base.state_t) for c in _CHUNKS])
    for f in variants:
        if len(out) == MAX_FAMILIES:
            break
        if f not in out and ok(f):
            out.append(f)
    return tuple(out)


def config_for(problem: SSMScanProblem, family: TileFamily, *, sm_count: int = _DEFAULT_SM_COUNT) -> ScanConfig:
    """:func:`choose_config` with ``family``'s tiles (segment count, hints and pre-pass as the heuristic picks)."""
    return choose_config(problem, sm_count=sm_count, chunk=family.chunk, block_p=family.block_p,
                         state_t=family.state_t)


def packed_config(p: SSMScanProblem, *, sm_count: int, tiles: TileFamily | None = None) -> ScanConfig:
    """The tiles and segment length of the packed form for the packed batch ``p`` (batch 1, seqlen = all tokens):
    what :func:`choose_config` (or ``tiles``, :func:`config_for`) picks for one sequence of that length, with the
    pre-pass and one launch per headdim piece; sequences are cut into work items of at most its chunks_per_seg
    chunks. Raises ContractError past MAX_GRID_Y chunks (the pre-pass grid)."""
    nchunks = -(-p.seqlen // (tiles.chunk if tiles else choose_config(p, sm_count=sm_count).chunk))
    if nchunks > MAX_GRID_Y:
        raise ContractError(f"x: packed prefill of {p.seqlen} tokens is {nchunks} chunks, more than the pre-pass "
                            f"grid's {MAX_GRID_Y}; split the batch")
    if tiles is not None:
        return replace(config_for(p, tiles, sm_count=sm_count), dt_pre=True, merge_tail=False, cb_pre=0)
    return choose_config(p, sm_count=sm_count, dt_pre=True, merge_tail=False, cb_pre=0)
