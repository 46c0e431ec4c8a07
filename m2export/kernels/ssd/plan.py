"""Launch plan of the cuTile SSD forward: tile sizes, segment count and compiler hints.

Plain Python (no cuda.tile import), so the planning rules are tested on machines without a GPU;
the kernels that consume a :class:`ScanConfig` are in :mod:`m2export.kernels.ssd.cutile`.
Measurements behind the defaults and the cost model: ``benchmarks/NOTES_ssd.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from m2export.contract import SSMScanProblem

_DEFAULT_SM_COUNT = 132  # H200 SXM


@dataclass(frozen=True)
class ScanConfig:
    """Tile sizes and launch plan of one SSMScan call.

    chunk: tokens per chunk (power of two); block_p: headdim rows per block (power of two, divides
    headdim); nseg: sequence segments (1 = one pass over the sequence: ssd_fused_kernel alone, or
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

    @property
    def plan(self) -> str:
        return ("single" if self.nseg == 1 else "split") + ("+dt" if self.dt_pre else "")


def _default_chunk(problem: SSMScanProblem) -> int:
    # fp32 products run as FFMA with whole operand tiles in registers (they spill: 24 KB of stack
    # per thread at chunk 64, d_state 256); chunk 32 halves that
    return 32 if problem.dtype == "float32" else DEFAULT_CHUNK


def _default_block_p(headdim: int, d_state: int) -> int:
    # keep the fp32 state tile (block_p x d_state) at <= 8192 elements (32 KiB) per block
    return max(16, min(headdim, 8192 // d_state))


# Defaults measured on the H200 (benchmarks/NOTES_ssd.md, runs of 2026-11-30): chunk 64 (32 for
# fp32), step sizes by the pre-pass kernel, the state kept as (d_state, headdim) with each chunk's
# contribution accumulated onto the decayed state, occupancy hint 2; the segment count from
# _plan_cost below.
DEFAULT_CHUNK = 64
DEFAULT_OCCUPANCY = 2
DEFAULT_STATE_T = True
DEFAULT_SPLIT_UPD = False
DEFAULT_DT_PRE = True
MAX_NSEG = 64

# Relative costs in the plan model, in units of one chunk iteration of the scan kernel, fitted to
# the H200 runs of 2026-11-30 (benchmarks/RESULTS.md, run 4 and session 3's run 1): a chunk of
# pass 1 (state contribution only, accumulated last chunk first: 289 vs 986 SASS instructions per
# iteration in the sm_90 build; fitted to the chosen plans of b and d, 0.19 and 0.25, while b's
# other measured plans imply 0.06-0.15: a rough number); the fixed cost of
# a block (entry/exit, state load/store, pipeline fill), paid once per wave; folding one earlier
# segment's state into a pass-2 block's entry state; one extra launch.
_PASS1_CHUNK_COST = 0.22
_BLOCK_COST = 2.4
_FOLD_COST = 0.4
_LAUNCH_COST = 1.0
MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y: ssd_dt_kernel puts chunks there
# A split plan re-reads x and B and is modelled only to ~10-17% (measured vs modelled split plans
# of b: 0.641 vs 0.703 ms in 5 segments, 1.82 vs 1.55 relative in 22): split only when the model
# predicts at least this fraction less time than one pass.
_SPLIT_MIN_GAIN = 0.10


def _plan_cost(base: int, nchunks: int, nseg: int, slots: int) -> float:
    """Modelled time of the split plan with ``nseg`` segments (1: single pass), in chunk iterations.

    base: (batch, head, p-tile) blocks per segment; slots: blocks resident at once (occupancy x
    SMs). Blocks of one launch take the same time, so a launch costs ceil(blocks / slots) waves of
    (chunks_per_seg + block cost); the last pass-2 block also folds nseg - 1 segment states.
    Checked against run 4 (measured / modelled time relative to the chosen plan): a, 11 segments
    2.2 / 2.2; b, 13 and 22 segments 1.33 / 1.28 and 1.82 / 1.55; c, 13 segments 2.09 / 1.82;
    d, 14 and 23 segments 1.04 / 1.11 and 1.05 / 1.04. With the backward pass 1 (session 3, call 1;
    modelled ms = units x 2.906 µs, shape c's 0.379 ms / 130.4 units): b in 3 / 4 / 5 segments
    0.609 / 0.604 / 0.641 measured vs 0.636 / 0.616 / 0.703 modelled (3 vs 4 is within the noise);
    d in 13 segments 1.216 vs 1.193.
    """
    cps = -(-nchunks // nseg)
    nseg = -(-nchunks // cps)
    cost = -(-base * nseg // slots) * (cps + _BLOCK_COST)
    if nseg > 1:
        cost += (-(-base * (nseg - 1) // slots)) * (_PASS1_CHUNK_COST * cps + _BLOCK_COST)
        cost += _FOLD_COST * (nseg - 1) + _LAUNCH_COST
    return cost


def choose_config(problem: SSMScanProblem, *, sm_count: int = _DEFAULT_SM_COUNT, chunk: int | None = None,
                  block_p: int | None = None, nseg: int | None = None, blocks_per_sm: int | None = None,
                  occupancy: int | None = None, state_t: bool | None = None,
                  split_upd: bool | None = None, dt_pre: bool | None = None,
                  worker_warps: int | None = None, seg_occupancy: int | None = None) -> ScanConfig:
    """Pick chunk, headdim tile, segment count and compiler hints for ``problem``.

    Heuristic: the DEFAULT_* values above; block_p from the register budget of the state; nseg
    minimising :func:`_plan_cost` over 1..MAX_NSEG (wave quantisation matters: on the H200, shape d
    of the benchmark runs 13 segments = 3.94 waves of blocks rather than 14 = 4.24), kept only if
    it is modelled at least _SPLIT_MIN_GAIN faster than one pass; the dt
    pre-pass unless the sequence has more than MAX_GRID_Y chunks. Any argument
    given overrides its default (the benchmark's sweeps): ``blocks_per_sm`` instead picks the
    segment count giving about that many blocks per SM; ``occupancy=0`` means no hint.
    """
    chunk = chunk or _default_chunk(problem)
    block_p = block_p or _default_block_p(problem.headdim, problem.d_state)
    occupancy = DEFAULT_OCCUPANCY if occupancy is None else (occupancy or None)
    state_t = DEFAULT_STATE_T if state_t is None else state_t
    split_upd = DEFAULT_SPLIT_UPD if split_upd is None else split_upd
    nchunks = max(1, -(-problem.seqlen // chunk))
    base = max(1, problem.batch * problem.nheads * (problem.headdim // block_p))
    if nseg is None:
        slots = (occupancy or 1) * sm_count
        if blocks_per_sm:
            nseg = min(MAX_NSEG, max(1, -(-(blocks_per_sm * sm_count) // base)))
        else:
            cost = {n: _plan_cost(base, nchunks, n, slots) for n in range(1, min(nchunks, MAX_NSEG) + 1)}
            nseg = min(cost, key=lambda n: (cost[n], n))
            if cost[nseg] > (1 - _SPLIT_MIN_GAIN) * cost[1]:
                nseg = 1
    nseg = max(1, min(nseg, nchunks))
    cps = -(-nchunks // nseg)
    nseg = -(-nchunks // cps)  # no empty segment
    if dt_pre is None:  # the pre-pass grid has the chunks on y (at most 65535: ~4M tokens at chunk 64)
        dt_pre = DEFAULT_DT_PRE and nchunks <= MAX_GRID_Y
    return ScanConfig(chunk=chunk, block_p=block_p, nseg=nseg, chunks_per_seg=cps, occupancy=occupancy,
                      state_t=state_t, split_upd=split_upd, dt_pre=dt_pre,
                      worker_warps=worker_warps or None, seg_occupancy=seg_occupancy or None)


def aot_config(problem: SSMScanProblem) -> ScanConfig:
    """The single-launch configuration the AOT plugin compiles (nseg 1, the measured defaults)."""
    return ScanConfig(chunk=_default_chunk(problem), block_p=_default_block_p(problem.headdim, problem.d_state), nseg=1,
                      chunks_per_seg=0, occupancy=DEFAULT_OCCUPANCY, state_t=DEFAULT_STATE_T,
                      split_upd=DEFAULT_SPLIT_UPD)
