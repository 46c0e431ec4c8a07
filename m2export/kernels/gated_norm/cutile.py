"""cuTile kernel of GatedRMSNorm (m2export/contract_gated_norm.py), memory-bound.

Order: tile helpers -> ``@ct.kernel`` -> launch configuration -> :func:`gated_rmsnorm_cutile`
(called by :func:`m2export.kernels.gated_norm.gated_rmsnorm`).

Three kernels, all plain tile loads of x and z (no array slices), the launcher picking one:
:func:`gated_rmsnorm_grouped_kernel` for several power-of-two groups (G of them per block, one
(rows, G*group_size) tile viewed as (rows, G, group_size)), :func:`gated_rmsnorm_pieces_kernel`
for one group (its binary decomposition, 5120 = 4096 + 1024: nothing padded) and a power-of-two
group, :func:`gated_rmsnorm_kernel` otherwise (several groups of another size: NCHUNK tiles of the
group's largest power-of-two divisor in two passes; or one tile padded to the next power of two).
Measured on the H200 (benchmarks/NOTES_fusion.md): 281 us at mamba2-2.7b 4 x 8192 bf16 (pieces,
Triton rmsnorm_fn 314), 384 us at Nemotron-H-8B (grouped, Triton 394). In
fp32::

    gate = silu(z);  u = x * gate (or x when norm_before_gate)
    out  = u * rsqrt(sum(u^2) / group_size + eps) * weight (* gate when norm_before_gate)

and out is stored in x's dtype. x and z are read once from DRAM, out written once (3 * rows *
d_inner * itemsize bytes; weight is re-read per block from L2).
"""

from __future__ import annotations

import torch

import cuda.tile as ct

from m2export.contract_gated_norm import GatedNormProblem
from m2export.errors import ContractError
from m2export.kernels.conv1d.cutile import _ct_silu
from m2export.kernels._host import check_out, hinted, launch_stream, sm_count

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
_ZERO = ct.PaddingMode.ZERO


# ----------------------------------------------------------------------------- tile helpers
def _ct_tile_load(a, index, shape, TMA, CHECK: ConstBool):
    """Tile ``index`` of ``a``: zero-padded past its ends (CHECK), or unchecked (CHECK False: the caller knows the
    tile lies wholly inside ``a``; tileiras 13.4 refuses a padding mode on an unchecked load). TMA: the load's
    ``allow_tma`` (None: the compiler's choice)."""
    if CHECK:
        return ct.load(a, index=index, shape=shape, padding_mode=_ZERO, allow_tma=TMA)
    return ct.load(a, index=index, shape=shape, allow_tma=TMA, check_bounds=False)


def _ct_gated_input(x, z, r, c, BLOCK_R: ConstInt, CHUNK: ConstInt, NORM_BEFORE_GATE: ConstBool,
                    TMA: ConstBool = True, CHECK: ConstBool = True):
    """(u, gate) of tile (r, c) of x and z, fp32: gate = silu(z); u = x (norm first) or x * gate.
    TMA False: plain loads into registers (no bulk copy through shared memory). CHECK False: the tile lies
    wholly inside x and z (no bounds check: with one, tileiras converts each plain load's result inside its
    bounds branch, so the z load waits for the x load, two DRAM round trips; sm_90 SASS read on the CPU)."""
    xt = _ct_tile_load(x, (r, c), (BLOCK_R, CHUNK), TMA, CHECK).astype(ct.float32)
    zt = _ct_tile_load(z, (r, c), (BLOCK_R, CHUNK), TMA, CHECK).astype(ct.float32)
    gate = _ct_silu(zt)
    if NORM_BEFORE_GATE:
        return xt, gate
    return xt * gate, gate


def _ct_store_normed(out, weight, u, gate, rstd, r, c, BLOCK_R: ConstInt, CHUNK: ConstInt,
                     NORM_BEFORE_GATE: ConstBool, TMA: ConstBool = True):
    """out tile (r, c) = u * rstd * weight (* gate when NORM_BEFORE_GATE), in out's dtype."""
    wt = ct.load(weight, index=(c,), shape=(CHUNK,), padding_mode=_ZERO).astype(ct.float32)
    o = u * rstd[:, None] * wt[None, :]
    if NORM_BEFORE_GATE:
        o = o * gate
    ct.store(out, index=(r, c), tile=o.astype(out.dtype), allow_tma=TMA)


# ----------------------------------------------------------------------------- kernel
@ct.kernel
def gated_rmsnorm_kernel(x, z, weight, out, group_size: int, eps: float,
                         BLOCK_R: ConstInt, CHUNK: ConstInt, NCHUNK: ConstInt, NORM_BEFORE_GATE: ConstBool):
    """Grid: (cdiv(rows, BLOCK_R), ngroups, 1). x, z: (rows, d_inner), last stride 1; out contiguous.

    Block (r, g) owns rows [r*BLOCK_R, ...) of group g: tiles g*NCHUNK .. g*NCHUNK + NCHUNK-1 of the
    (BLOCK_R, CHUNK) tile space, where group_size == NCHUNK * CHUNK, or (one group) NCHUNK == 1 and
    CHUNK >= group_size with the tile zero-padded past d_inner. NCHUNK == 1: one pass, the tile kept
    on chip; otherwise the sum of squares over the chunks first, then a second pass re-reads them
    (from L2) to normalise.
    """
    r = ct.bid(0)
    g = ct.bid(1)
    if NCHUNK == 1:
        u, gate = _ct_gated_input(x, z, r, g, BLOCK_R, CHUNK, NORM_BEFORE_GATE)
        rstd = ct.rsqrt(ct.sum(u * u, axis=1) / group_size + eps)
        _ct_store_normed(out, weight, u, gate, rstd, r, g, BLOCK_R, CHUNK, NORM_BEFORE_GATE)
    else:
        ss = ct.full((BLOCK_R,), 0.0, dtype=ct.float32)
        for c in range(NCHUNK):
            u, _gate = _ct_gated_input(x, z, r, g * NCHUNK + c, BLOCK_R, CHUNK, NORM_BEFORE_GATE)
            ss = ss + ct.sum(u * u, axis=1)
        rstd = ct.rsqrt(ss / group_size + eps)
        for c in range(NCHUNK):
            u, gate = _ct_gated_input(x, z, r, g * NCHUNK + c, BLOCK_R, CHUNK, NORM_BEFORE_GATE)
            _ct_store_normed(out, weight, u, gate, rstd, r, g * NCHUNK + c, BLOCK_R, CHUNK, NORM_BEFORE_GATE)


@ct.kernel
def gated_rmsnorm_pieces_kernel(x, z, weight, out, group_size: int, eps: float, BLOCK_R: ConstInt, W0: ConstInt,
                                W1: ConstInt, W2: ConstInt, NORM_BEFORE_GATE: ConstBool, TMA: ConstBool):
    """Grid: (cdiv(rows, BLOCK_R), ngroups, 1). x, z: (rows, d_inner), last stride 1; out contiguous.

    Block (r, g) owns rows [r*BLOCK_R, ...) of group g, held on chip in one pass as up to three
    tiles of widths W0 > W1 > W2 (powers of two; 0: absent) that add up to group_size: the group's
    binary decomposition, each piece starting at the sum of the larger ones (a multiple of its own
    width), so nothing is padded (5120 = 4096 + 1024). Several groups: W1 == W2 == 0 and
    W0 == group_size, a power of two (piece index g). TMA False: plain loads and stores through
    registers (no bulk copy).
    """
    r = ct.bid(0)
    g = ct.bid(1)
    u0, g0 = _ct_gated_input(x, z, r, g, BLOCK_R, W0, NORM_BEFORE_GATE, TMA)
    ss = ct.sum(u0 * u0, axis=1)
    if W1 > 0:
        u1, g1 = _ct_gated_input(x, z, r, W0 // W1, BLOCK_R, W1, NORM_BEFORE_GATE, TMA)
        ss = ss + ct.sum(u1 * u1, axis=1)
    if W2 > 0:
        u2, g2 = _ct_gated_input(x, z, r, (W0 + W1) // W2, BLOCK_R, W2, NORM_BEFORE_GATE, TMA)
        ss = ss + ct.sum(u2 * u2, axis=1)
    rstd = ct.rsqrt(ss / group_size + eps)
    _ct_store_normed(out, weight, u0, g0, rstd, r, g, BLOCK_R, W0, NORM_BEFORE_GATE, TMA)
    if W1 > 0:
        _ct_store_normed(out, weight, u1, g1, rstd, r, W0 // W1, BLOCK_R, W1, NORM_BEFORE_GATE, TMA)
    if W2 > 0:
        _ct_store_normed(out, weight, u2, g2, rstd, r, (W0 + W1) // W2, BLOCK_R, W2, NORM_BEFORE_GATE, TMA)


@ct.kernel
def gated_rmsnorm_grouped_kernel(x, z, weight, out, group_size: int, eps: float, BLOCK_R: ConstInt, G: ConstInt,
                                 GS: ConstInt, NORM_BEFORE_GATE: ConstBool, TMA: ConstBool, CHECK: ConstBool):
    """Grid: (cdiv(rows, BLOCK_R), ngroups // G, 1). x, z: (rows, d_inner), last stride 1; out contiguous.
    GS == group_size, a power of two; G groups per block.

    Block (r, gb) owns rows [r*BLOCK_R, ...) and the G whole groups [gb*G, ...): one plain
    (BLOCK_R, G*GS) tile of x and of z (the loads of the one-group kernel on a 5120-channel group),
    viewed as (BLOCK_R, G, GS) on chip and normalised per (row, group) in one pass (Nemotron-H: 8
    groups of 1024 per block instead of one). CHECK False: every block's tile lies inside x, z and out
    (BLOCK_R 1, or rows a multiple of it): loads and stores without bounds checks, and the weight without
    a bulk copy when TMA is off (:func:`choose_grouped_small`, the decode regime).
    """
    r = ct.bid(0)
    gb = ct.bid(1)
    u, gate = _ct_gated_input(x, z, r, gb, BLOCK_R, G * GS, NORM_BEFORE_GATE, TMA, CHECK)
    u3 = u.reshape((BLOCK_R, G, GS))
    rstd = ct.rsqrt(ct.sum(u3 * u3, axis=2) / group_size + eps)  # (BLOCK_R, G)
    if CHECK:
        wt = _ct_tile_load(weight, (gb,), (G * GS,), None, CHECK).astype(ct.float32)
    else:  # the decode regime: no bulk copy of the weight either (no producer warps: 128 threads, 37 registers)
        wt = _ct_tile_load(weight, (gb,), (G * GS,), TMA, CHECK).astype(ct.float32)
    o = (u3 * rstd[:, :, None]).reshape((BLOCK_R, G * GS)) * wt[None, :]
    if NORM_BEFORE_GATE:
        o = o * gate
    ct.store(out, index=(r, gb), tile=o.astype(out.dtype), allow_tma=TMA, check_bounds=CHECK)


# ----------------------------------------------------------------------------- launch configuration
def choose_tiles(p: GatedNormProblem) -> tuple[int, int, int]:
    """(BLOCK_R, CHUNK, NCHUNK). A power-of-two group is one tile; one group of another size is one
    tile padded to the next power of two; otherwise NCHUNK tiles of the group's largest power-of-two
    divisor. BLOCK_R: rows so that a tile holds about 2048 elements (at most 16)."""
    gs = p.group_size
    if gs & (gs - 1) == 0:
        ch, nch = gs, 1
    elif p.ngroups == 1:
        ch, nch = 1 << (gs - 1).bit_length(), 1
    else:
        ch = gs & -gs
        nch = gs // ch
    br = max(1, min(16, 2048 // ch))
    br = min(br, max(1, 1 << max(0, p.rows - 1).bit_length()))
    return br, ch, nch


def choose_occupancy(tiles: tuple[int, int, int], itemsize: int) -> int:
    """Blocks-per-SM hint: about 128 KiB of x and z tiles in shared memory per SM, at most 8 (without a
    hint tileiras gives the kernel 255 registers per thread, one block per SM; with 4, 64 registers
    and no stack at (1, 8192) bf16, read from the sm_90 cubin on the CPU)."""
    tile = 2 * tiles[0] * tiles[1] * itemsize
    return max(1, min(8, 1 << max(0, (131072 // tile).bit_length() - 1)))


def check_tiles(p: GatedNormProblem, tiles: tuple[int, int, int]) -> None:
    """Raise ContractError unless ``tiles`` (BLOCK_R, CHUNK, NCHUNK) cover every group exactly."""
    br, ch, nch = tiles
    pow2 = all(v > 0 and v & (v - 1) == 0 for v in (br, ch))
    if not (pow2 and nch >= 1 and (ch * nch == p.group_size or (p.ngroups == 1 and nch == 1 and ch >= p.group_size))):
        raise ContractError(f"tiles: {tiles} do not cover group_size {p.group_size} (ngroups {p.ngroups}); expected "
                            "powers of two BLOCK_R, CHUNK with CHUNK * NCHUNK == group_size")


def choose_pieces(p: GatedNormProblem) -> tuple[int, int, int] | None:
    """(W0, W1, W2) of :func:`gated_rmsnorm_pieces_kernel` for ``p``, or None where it does not apply
    (several groups of a size that is not a power of two; one group of more than three binary digits).
    A power-of-two group is (group_size, 0, 0); one group is its binary decomposition, largest first."""
    gs = p.group_size
    if gs & (gs - 1) == 0:
        return gs, 0, 0
    bits = [1 << i for i in range(gs.bit_length() - 1, -1, -1) if gs >> i & 1]
    if p.ngroups != 1 or len(bits) > 3:
        return None
    return tuple(bits + [0] * (3 - len(bits)))  # type: ignore[return-value]


def choose_grouped(p: GatedNormProblem) -> tuple[int, int] | None:
    """(BLOCK_R, G) of :func:`gated_rmsnorm_grouped_kernel`, or None where it does not apply: several
    power-of-two groups, G of them per block (the largest power of two dividing ngroups with at most
    4096 channels per block; at least 2), one row per block. H200, Nemotron-H 4 x 8192 bf16 (8 x 1024):
    G 4 at occupancy 8 383.7 us, G 8 at 4 414.0, Triton 395.0 (benchmarks/NOTES_fusion.md)."""
    gs, ng = p.group_size, p.ngroups
    if ng < 2 or gs & (gs - 1):
        return None
    g = min(ng & -ng, max(1, 4096 // gs))
    return (1, g) if g >= 2 else None


def choose_pieces_rows(p: GatedNormProblem) -> int:
    """BLOCK_R of the pieces kernel: rows so that a block holds about 2048 elements of x (at most 16)."""
    br = max(1, min(16, 2048 // p.group_size))
    return min(br, max(1, 1 << max(0, p.rows - 1).bit_length()))


def choose_grouped_small(p: GatedNormProblem, sm_count: int = 132) -> dict | None:
    """Launcher keywords of the grouped kernel for a problem that is one wave of blocks (several power-of-two groups,
    rows * ngroups <= 8 * sm_count: decode, 128 rows of Nemotron-H), or None. Such a launch is latency-bound: one
    block per (row, group), plain loads without bounds checks (x and z then both in flight at once: with the checks
    the z load waited for the x load; sm_90 SASS read on the CPU), no bulk copies (no producer warps), no
    occupancy hint, :data:`DECODE_WARPS` warps. H200, Nemotron-H 128 rows bf16 (2026-12-02 18:20 UTC, benchmarks/NOTES_fusion.md):
    7.8-7.9 us against 9.1 for the G4 TMA default, 8.4 for G1 without TMA (checked, occupancy 16) and 7.6 for Triton
    rmsnorm_fn. The launcher uses it only with :data:`GROUPED_SMALL`."""
    if choose_grouped(p) is None or p.rows * p.ngroups > 8 * sm_count:
        return None
    return dict(grouped=(1, 1), tma=False, check=False, occupancy=0, warps=DECODE_WARPS)


DECODE_WARPS = 8
"""num_worker_warps of :func:`choose_grouped_small`'s launch: 8 (256 threads, 8-byte loads of a 1024-channel group, 25
registers, 312 SASS instructions against 408 at the compiler's 4; sm_90 CPU build). H200, Nemotron-H 128 rows bf16
(2026-12-03, three runs of one call, benchmarks/NOTES_fusion.md): 7.2 / 6.9 / 7.1 us against 7.3 / 7.0 / 7.1 at 4 warps
(within the spread) and 7.8 / 7.6 / 7.6 for Triton rmsnorm_fn."""


GROUPED_SMALL = True
"""The launcher takes :func:`choose_grouped_small`'s keywords for one-wave problems (default since their float64 GPU
oracle tests passed, H200, 2026-12-03, benchmarks/NOTES_fusion.md; False: the grouped chooser's G4 TMA launch)."""

PIECES_TMA = True
"""Bulk copies (TMA) in the pieces kernel: on (281 vs 332 us off at mamba2-2.7b 4 x 8192 bf16 on the H200,
benchmarks/NOTES_fusion.md)."""


def gated_rmsnorm_cutile(x, z, weight, *, problem: GatedNormProblem, out=None, stream=None,
                         tiles: tuple[int, int, int] | None = None, occupancy: int | None = None,
                         pieces: tuple[int, int, int, int] | None = None, grouped: tuple[int, int] | None = None,
                         tma: bool | None = None, check: bool | None = None,
                         warps: int | None = None) -> torch.Tensor:
    """cuTile GatedRMSNorm on validated arguments (see :func:`m2export.kernels.gated_norm.gated_rmsnorm`).

    x and z are viewed as (rows, d_inner) (a copy only if their strides do not allow a view).
    Default: :func:`gated_rmsnorm_grouped_kernel` where :func:`choose_grouped` applies (with
    :func:`choose_grouped_small`'s keywords for a one-wave problem when :data:`GROUPED_SMALL`), else
    :func:`gated_rmsnorm_pieces_kernel` where :func:`choose_pieces` does, else
    :func:`gated_rmsnorm_kernel`. Overrides (benchmarks, tests): ``tiles`` = (BLOCK_R, CHUNK, NCHUNK)
    runs gated_rmsnorm_kernel, ``pieces`` = (BLOCK_R, W0, W1, W2) the pieces kernel, ``grouped`` =
    (BLOCK_R, G) the grouped kernel; ``tma`` the bulk-copy flag of the last two (default
    :data:`PIECES_TMA`); ``check`` False: the grouped kernel without bounds checks (needs BLOCK_R 1 or rows a
    multiple of it; default True); ``occupancy`` the blocks-per-SM hint (0: none); ``warps`` the grouped kernel's
    ``num_worker_warps`` hint (4 or 8 with tileiras 13.4; None: the compiler's, 4 warps; 8 warps: 256 threads and
    8-byte loads of a 1024-channel group).
    """
    p = problem
    dev = x.device
    if tiles is None and pieces is None and grouped is None:
        small = choose_grouped_small(p, sm_count(dev)) if GROUPED_SMALL else None
        if small is not None:
            grouped = small["grouped"]
            tma = small["tma"] if tma is None else tma
            check = small["check"] if check is None else check
            occupancy = small["occupancy"] if occupancy is None else occupancy
            warps = small.get("warps") if warps is None else warps
        else:
            grouped = choose_grouped(p)
        w = choose_pieces(p)
        if grouped is None and w is not None:
            pieces = (choose_pieces_rows(p), *w)
        elif grouped is None:
            tiles = choose_tiles(p)
    use_tma = PIECES_TMA if tma is None else bool(tma)
    if tiles is not None:
        check_tiles(p, tiles)
        if occupancy is None:
            occupancy = choose_occupancy(tiles, x.element_size())
        kernel = hinted(gated_rmsnorm_kernel, occupancy or None)
        br, grid1 = tiles[0], p.ngroups
        consts = (*tiles, bool(p.norm_before_gate))
    elif pieces is not None:
        br, w0, w1, w2 = pieces
        if w0 + w1 + w2 != p.group_size or any(v & (v - 1) for v in (br, w0, w1, w2)) or not w0 > w1 >= w2 or \
                (w1 and p.ngroups != 1) or (w2 and not w1) or (w1 and w2 == w1):
            raise ContractError(f"pieces: {pieces} do not decompose group_size {p.group_size} (ngroups {p.ngroups}); "
                                "expected BLOCK_R and widths W0 > W1 > W2 (powers of two or 0) adding up to it")
        if occupancy is None:
            occupancy = choose_occupancy((br, p.group_size), x.element_size())
        kernel = hinted(gated_rmsnorm_pieces_kernel, occupancy or None)
        grid1 = p.ngroups
        consts = (br, w0, w1, w2, bool(p.norm_before_gate), use_tma)
    else:
        br, g = grouped
        gs = p.group_size
        if any(v < 1 or v & (v - 1) for v in (br, g, gs)) or p.ngroups % g:
            raise ContractError(f"grouped: {grouped} does not fit {p.ngroups} groups of {gs}; expected powers of two "
                                "BLOCK_R and G with G dividing ngroups, and a power-of-two group_size")
        use_check = True if check is None else bool(check)
        if not use_check and br > 1 and p.rows % br:
            raise ContractError(f"check=False: {p.rows} rows are not a multiple of BLOCK_R {br} (the last block would "
                                "read past the end); expected BLOCK_R 1 or a divisor of rows")
        if occupancy is None:
            occupancy = choose_occupancy((br, g * gs), x.element_size())
        if warps is not None and warps not in (4, 8):
            raise ContractError(f"warps: expected 4 or 8 (tileiras 13.4), got {warps!r}")
        kernel = hinted(gated_rmsnorm_grouped_kernel, occupancy or None, warps)
        grid1 = p.ngroups // g
        consts = (br, g, gs, bool(p.norm_before_gate), use_tma, use_check)
    stream_ = launch_stream(stream, dev)
    with torch.cuda.device(dev), torch.cuda.stream(stream_):
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=dev)
        check_out("out", out, x.shape, x.dtype, dev)
        if p.rows == 0:
            return out
        x2, z2 = x.reshape(p.rows, p.d_inner), z.reshape(p.rows, p.d_inner)
        ct.launch(int(stream_.cuda_stream), (-(-p.rows // br), grid1, 1), kernel,
                  (x2, z2, weight.contiguous(), out.view(p.rows, p.d_inner), int(p.group_size), float(p.eps), *consts))
    return out
