"""Launch planning of the cuTile SSD forward (m2export.kernels.ssd.plan): plain Python, runs on CPU."""

import pytest

from m2export.contract import SSMScanProblem
from m2export.kernels.ssd import plan
from m2export.kernels.ssd.plan import ScanConfig, _plan_cost, aot_config, choose_config

# the benchmark's shapes (issue 6) and the plans measured fastest for them on the H200
BENCH = {
    "a": ((8, 2048, 24, 64, 1, 128), 1),
    "b": ((4, 8192, 80, 64, 1, 128), 4),
    "c": ((2, 8192, 128, 64, 8, 128), 1),
    "d": ((1, 65536, 80, 64, 1, 128), 13),
}


@pytest.mark.parametrize("name", sorted(BENCH))
def test_bench_shapes_get_the_measured_plans(name):
    dims, nseg = BENCH[name]
    cfg = choose_config(SSMScanProblem(*dims, dtype="bfloat16"), sm_count=132)
    assert (cfg.chunk, cfg.block_p, cfg.nseg, cfg.occupancy) == (64, 64, nseg, 2)
    assert cfg.dt_pre and cfg.state_t and not cfg.split_upd
    assert cfg.plan == ("single+dt" if nseg == 1 else "split+dt")


@pytest.mark.parametrize("seqlen", [1, 7, 63, 64, 65, 3 * 64 + 1, 5000, 65536])
@pytest.mark.parametrize("batch,nheads", [(1, 1), (1, 80), (16, 24)])
def test_segments_cover_the_sequence_without_empty_ones(seqlen, batch, nheads):
    cfg = choose_config(SSMScanProblem(batch, seqlen, nheads, 64, 1, 128, dtype="bfloat16"))
    nchunks = -(-seqlen // cfg.chunk)
    assert 1 <= cfg.nseg <= min(nchunks, plan.MAX_NSEG)
    assert (cfg.nseg - 1) * cfg.chunks_per_seg < nchunks <= cfg.nseg * cfg.chunks_per_seg


def test_plan_cost_counts_waves():
    # 264 slots: 264 blocks are one wave, 265 are two; each wave pays the chunks plus a block cost
    one = 10 + plan._BLOCK_COST
    assert _plan_cost(264, 10, 1, 264) == pytest.approx(one)
    assert _plan_cost(265, 10, 1, 264) == pytest.approx(2 * one)
    # splitting adds pass 1, the folds and a launch
    two = _plan_cost(10, 10, 2, 264)
    assert two == pytest.approx((5 + plan._BLOCK_COST) + (plan._PASS1_CHUNK_COST * 5 + plan._BLOCK_COST)
                                + plan._FOLD_COST + plan._LAUNCH_COST)


def test_short_sequences_stay_single_pass():
    cfg = choose_config(SSMScanProblem(1, 128, 8, 64, 1, 64, dtype="bfloat16"))
    assert cfg.nseg == 1  # two chunks: a second launch costs more than it saves


def test_fp32_and_d_state_256_use_chunk_32():
    assert choose_config(SSMScanProblem(4, 7, 2, 128, 2, 128, dtype="float32")).chunk == 32
    assert aot_config(SSMScanProblem(4, 7, 2, 128, 2, 256, dtype="float32")).chunk == 32
    assert choose_config(SSMScanProblem(4, 7, 2, 128, 2, 128, dtype="float16")).chunk == 64
    # d_state 256 at chunk 64 with 32-row tiles needs 255 registers and 161 KB of shared memory (one block per SM):
    # the AOT kernel runs chunk 32; bf16 JIT plans chunk 64 with 32-row tiles (one pass at Falcon-H1-7B, measured faster)
    assert aot_config(SSMScanProblem(4, 7, 2, 128, 2, 256, dtype="float16")).chunk == 32
    cfg = choose_config(SSMScanProblem(4, 7, 2, 128, 2, 256, dtype="bfloat16"))
    assert (cfg.chunk, cfg.block_p, cfg.state_t) == (64, 32, False)  # (headdim, d_state) state: measured faster
    assert choose_config(SSMScanProblem(4, 7, 2, 128, 2, 256, dtype="bfloat16"), state_t=True).state_t
    cfg = choose_config(SSMScanProblem(4, 7, 2, 128, 2, 256, dtype="float16"))
    assert (cfg.chunk, cfg.block_p, cfg.state_t) == (32, 32, True)
    assert choose_config(SSMScanProblem(4, 7, 2, 128, 2, 256, dtype="bfloat16"), chunk=32).block_p == 32
    assert choose_config(SSMScanProblem(4, 7, 2, 128, 2, 256, dtype="float32")).chunk == 32


@pytest.mark.parametrize("headdim,d_state,block_p", [(64, 128, 64), (128, 256, 32), (32, 32, 32), (256, 64, 128),
                                                     (80, 128, 64), (96, 256, 32), (48, 64, 32), (16, 128, 16),
                                                     (128, 512, 16), (64, 1024, 16)])
def test_block_p_bounds_the_state_tile(headdim, d_state, block_p):
    cfg = aot_config(SSMScanProblem(1, 100, 4, headdim, 1, d_state, dtype="bfloat16"))
    assert cfg.block_p == block_p and cfg.block_p <= headdim and cfg.block_p * d_state <= max(8192, 16 * d_state)
    cfg = choose_config(SSMScanProblem(1, 100, 4, headdim, 1, d_state, dtype="bfloat16"))
    block_p = min(32, headdim) if d_state == 256 else block_p  # the bf16 JIT plan's measured d_state-256 tiles
    assert cfg.block_p == block_p and cfg.block_p <= headdim and cfg.block_p * d_state <= max(8192, 16 * d_state)


@pytest.mark.parametrize("headdim,block_p,want", [
    (64, 64, [(64, 0, 1)]), (128, 64, [(64, 0, 2)]), (80, 64, [(64, 0, 1), (16, 4, 1)]),
    (96, 64, [(64, 0, 1), (32, 2, 1)]), (112, 64, [(64, 0, 1), (32, 2, 1), (16, 6, 1)]),
    (240, 128, [(128, 0, 1), (64, 2, 1), (32, 6, 1), (16, 14, 1)]), (48, 32, [(32, 0, 1), (16, 2, 1)]),
    (80, 32, [(32, 0, 2), (16, 4, 1)]), (16, 16, [(16, 0, 1)])])
def test_headdim_pieces_cover_every_row_once(headdim, block_p, want):
    pieces = plan.headdim_pieces(headdim, block_p)
    assert [tuple(pc) for pc in pieces] == want
    rows = [r for pc in pieces for t in range(pc.tiles) for r in range((pc.tile0 + t) * pc.width,
                                                                       (pc.tile0 + t + 1) * pc.width)]
    assert rows == list(range(headdim))


@pytest.mark.parametrize("headdim,block_p", [(40, 64), (0, 64), (64, 48), (64, 8)])
def test_headdim_pieces_refuse_what_they_cannot_cover(headdim, block_p):
    with pytest.raises(ValueError, match="headdim_pieces"):
        plan.headdim_pieces(headdim, block_p)


def test_merged_tail_plans_like_one_tile_per_head():
    # 80 = 64 + 16 with merge_tail: one launch of one block per (batch, head) owning both pieces, so the segment
    # count is headdim 64's (Nemotron-Nano-9B-v2's shape: 128 blocks, 2 segments)
    p80 = SSMScanProblem(1, 8192, 128, 80, 8, 128, dtype="bfloat16")
    p64 = SSMScanProblem(1, 8192, 128, 64, 8, 128, dtype="bfloat16")
    cfg = choose_config(p80)
    assert cfg.merge_tail and plan.launch_pieces(80, cfg.block_p, True) == ((plan.HeaddimPiece(64, 0, 1),
                                                                             plan.HeaddimPiece(16, 4, 1)),)
    assert cfg.nseg == choose_config(p64).nseg == 2


def test_merged_tail_keeps_the_state_as_headdim_by_d_state_in_16_bit():
    """A merged headdim tail (80 = 64 + 16, 96 = 64 + 32, 48 = 32 + 16) with bf16/fp16 inputs keeps the state as
    (headdim, d_state) (with an initial state its sm_90 build stays warp-specialised at P80 N128; the
    (d_state, headdim) build does not: plan._MERGED_TAIL_STATE_T); fp32, unmerged pieces and full tiles keep the
    default (d_state, headdim); an explicit state_t wins."""
    for dtype in ("bfloat16", "float16"):
        for dims in [(1, 8192, 128, 80, 8, 128), (2, 100, 8, 96, 2, 128), (2, 100, 8, 48, 1, 64)]:
            p = SSMScanProblem(*dims, dtype=dtype)
            cfg = choose_config(p)
            assert plan.launch_pieces(p.headdim, cfg.block_p, cfg.merge_tail)[0][1] is not None
            assert cfg.state_t is False and cfg.init_tma is True  # the TMA initial-state load (init_tma_default)
            assert choose_config(p, state_t=True).state_t is True
            assert choose_config(p, merge_tail=False).state_t is True  # pieces: one launch each, the default
        assert choose_config(SSMScanProblem(1, 8192, 128, 64, 8, 128, dtype=dtype)).state_t is True
        assert choose_config(SSMScanProblem(2, 100, 8, 112, 2, 128, dtype=dtype)).state_t is True  # 64+32+16: 3 launches
    assert choose_config(SSMScanProblem(1, 8192, 128, 80, 8, 128, dtype="float32")).state_t is True
    assert aot_config(SSMScanProblem(1, 8192, 128, 80, 8, 128, dtype="bfloat16")).state_t is True  # no merged tail


def test_unmerged_pieces_are_modelled_as_separate_launches():
    # without merging, 80 is two launches of 128 blocks each, one after the other: each is modelled on its own
    # (the old model counted 256 blocks in one launch and chose one segment; measured 2.0x head dim 64 per row)
    p80 = SSMScanProblem(1, 8192, 128, 80, 8, 128, dtype="bfloat16")
    cfg = choose_config(p80, merge_tail=False)
    assert not cfg.merge_tail and len(plan.launch_pieces(80, cfg.block_p, False)) == 2
    assert cfg.nseg == choose_config(SSMScanProblem(1, 8192, 128, 64, 8, 128, dtype="bfloat16")).nseg
    slots, nchunks = 2 * 132, 128
    assert sum(_plan_cost(128, nchunks, 2, slots) for _ in range(2)) < 2 * _plan_cost(128, nchunks, 1, slots)


@pytest.mark.parametrize("headdim,block_p,want", [
    (80, 64, [((64, 0, 1), (16, 4, 1))]), (96, 64, [((64, 0, 1), (32, 2, 1))]), (48, 32, [((32, 0, 1), (16, 2, 1))]),
    (64, 64, [((64, 0, 1), None)]), (112, 64, [((64, 0, 1), None), ((32, 2, 1), None), ((16, 6, 1), None)]),
    (144, 64, [((64, 0, 2), None), ((16, 8, 1), None)]), (80, 32, [((32, 0, 2), None), ((16, 4, 1), None)])])
def test_launch_pieces_merge_only_one_tile_plus_one_tail(headdim, block_p, want):
    got = plan.launch_pieces(headdim, block_p, True)
    assert [(tuple(pc), tuple(t) if t else None) for pc, t in got] == want
    # every row exactly once, merged or not
    rows = sorted(r for pc, t in got for piece in (pc, t) if piece for i in range(piece.tiles)
                  for r in range((piece.tile0 + i) * piece.width, (piece.tile0 + i + 1) * piece.width))
    assert rows == list(range(headdim))
    assert [pc for pc, _ in plan.launch_pieces(headdim, block_p, False)] == list(plan.headdim_pieces(headdim, block_p))


def test_overrides_win():
    p = SSMScanProblem(4, 8192, 80, 64, 1, 128, dtype="bfloat16")
    cfg = choose_config(p, chunk=128, block_p=32, nseg=3, occupancy=0, state_t=False, split_upd=True, dt_pre=False,
                        worker_warps=8, seg_occupancy=3, merge_tail=False)
    assert cfg == ScanConfig(chunk=128, block_p=32, nseg=3, chunks_per_seg=22, occupancy=None, state_t=False,
                             split_upd=True, dt_pre=False, worker_warps=8, seg_occupancy=3, merge_tail=False,
                             init_tma=True)


def test_aot_config_is_single_launch_without_pre_pass():
    cfg = aot_config(SSMScanProblem(2, 1000, 8, 64, 2, 128, dtype="bfloat16"))
    assert cfg.nseg == 1 and not cfg.dt_pre and cfg.plan == "single"


def test_half_wave_shapes_are_not_split():
    # between half a wave and one wave of blocks one pass was measured best (shapes a, c); the
    # model's per-block cost keeps such shapes single-pass
    for dims in [(2, 2048, 80, 64, 1, 128), (6, 2048, 24, 64, 1, 128), (8, 2048, 24, 64, 1, 128),
                 (2, 8192, 128, 64, 8, 128)]:
        assert choose_config(SSMScanProblem(*dims, dtype="bfloat16")).nseg == 1, dims


def test_small_modelled_gains_do_not_split():
    # 192 blocks on 264 slots with 1024 chunks each: the best split (4 segments) is modelled only
    # 7% faster, under _SPLIT_MIN_GAIN (the model's error on split plans is ~10-17%): one pass
    p = SSMScanProblem(8, 65536, 24, 64, 1, 128, dtype="bfloat16")
    base, nchunks, slots = 192, 1024, 2 * 132
    gain = 1 - plan._plan_cost(base, nchunks, 4, slots) / plan._plan_cost(base, nchunks, 1, slots)
    assert 0 < gain < plan._SPLIT_MIN_GAIN
    assert choose_config(p).nseg == 1


def test_few_blocks_are_split():
    # 24 blocks on 132 SMs: splitting the sequence is the only way to use the card
    assert choose_config(SSMScanProblem(1, 2048, 24, 64, 1, 128, dtype="bfloat16")).nseg > 4


def test_more_chunks_than_the_pre_pass_grid_fall_back_to_inline_step_sizes():
    long = SSMScanProblem(1, (plan.MAX_GRID_Y + 1) * 64, 8, 64, 1, 128, dtype="bfloat16")
    assert not choose_config(long).dt_pre
    assert choose_config(SSMScanProblem(1, plan.MAX_GRID_Y * 64, 8, 64, 1, 128, dtype="bfloat16")).dt_pre


def test_plans_are_deterministic():
    """The same problem gives the same plan (no state, no randomness): plans can be cached per signature."""
    for dims in [(1, 65536, 80, 64, 1, 128), (4, 8192, 80, 64, 1, 128), (2, 100, 8, 64, 2, 64)]:
        for dtype in ("bfloat16", "float32"):
            p = SSMScanProblem(*dims, dtype=dtype)
            assert len({choose_config(p, sm_count=132) for _ in range(3)}) == 1


# ----------------------------------------------------------------------------- tuning space
_TUNE_SHAPES = [SSMScanProblem(1, 8192, 128, 64, 8, 128, dtype="bfloat16"),  # (B, L, H, P, G, N)
                SSMScanProblem(2, 8192, 24, 128, 1, 256, dtype="bfloat16"),
                SSMScanProblem(1, 8192, 128, 80, 8, 128, dtype="float16"),
                SSMScanProblem(2, 100, 8, 64, 2, 64, dtype="float32"),
                SSMScanProblem(1, 33, 4, 16, 1, 32, dtype="bfloat16")]


@pytest.mark.parametrize("p", _TUNE_SHAPES, ids=lambda p: f"P{p.headdim}_N{p.d_state}_{p.dtype}")
def test_tile_families_start_with_the_heuristic_and_stay_in_budget(p):
    from dataclasses import replace

    from m2export.kernels.ssd.plan import MAX_FAMILIES, config_for, tile_families

    fams = tile_families(p)
    cfg = choose_config(p)
    assert (fams[0].chunk, fams[0].block_p, fams[0].state_t) == (cfg.chunk, cfg.block_p, cfg.state_t)
    assert 1 <= len(fams) <= MAX_FAMILIES and len(set(fams)) == len(fams)
    assert tile_families(p) == fams  # deterministic
    assert tile_families(replace(p, batch=7, seqlen=3)) == fams  # one space for every shape of the layer
    widest = 1 << (p.headdim.bit_length() - 1)
    for f in fams:
        assert f.block_p <= widest and f.block_p * p.d_state <= 8192
        assert f.chunk <= 64 or (p.dtype != "float32" and p.d_state <= 128)
        c = config_for(p, f)
        assert (c.chunk, c.block_p, c.state_t) == (f.chunk, f.block_p, f.state_t)
        nchunks = -(-p.seqlen // c.chunk)
        assert (c.nseg - 1) * c.chunks_per_seg < nchunks <= c.nseg * c.chunks_per_seg  # covers the sequence
    if p.headdim >= 64 and p.d_state <= 128:
        assert len(fams) > 2  # there is something to choose


def test_aot_config_takes_a_tactics_tiles():
    from m2export.kernels.ssd.plan import tile_families

    p = SSMScanProblem(2, 1000, 8, 64, 2, 128, dtype="bfloat16")
    for f in tile_families(p):
        c = aot_config(p, f)
        assert (c.chunk, c.block_p, c.state_t, c.nseg, c.dt_pre) == (f.chunk, f.block_p, f.state_t, 1, False)
    assert aot_config(p, None) == aot_config(p)


def test_initial_state_load_rule_is_one_home_and_deterministic():
    """plan.init_tma_default decides whether the initial-state load may use TMA: JIT plans keep it except the
    (headdim, d_state) state at d_state >= 256 (Falcon-H1-7B's default); the AOT kernel never uses it; an explicit
    init_tma overrides; the tile families the tuner builds follow the same rule."""
    from m2export.kernels.ssd.plan import config_for, init_tma_default, tile_families

    falcon = SSMScanProblem(2, 8192, 24, 128, 1, 256, dtype="bfloat16")
    d128 = SSMScanProblem(2, 8192, 128, 64, 8, 128, dtype="bfloat16")
    assert choose_config(falcon).init_tma is False and choose_config(d128).init_tma is True
    assert choose_config(falcon, state_t=True).init_tma is True
    assert choose_config(d128, state_t=False).init_tma is True
    assert choose_config(falcon, init_tma=True).init_tma is True and choose_config(d128, init_tma=False).init_tma is False
    for p in (falcon, d128, SSMScanProblem(1, 100, 8, 80, 2, 128, dtype="float16")):
        assert aot_config(p).init_tma is False
        for fam in tile_families(p):
            assert aot_config(p, fam).init_tma is False
            assert config_for(p, fam).init_tma == init_tma_default(fam.state_t, p.d_state, aot=False)
        assert choose_config(p) == choose_config(p)


def test_cb_pre_only_with_the_pre_pass_and_never_packed_or_aot():
    """ScanConfig.cb_pre (ssd_cb_kernel before the scan: 1 C @ B^T per group, 2 M per head): 0 by default
    (plan.DEFAULT_CB_PRE) except 2 for the bf16 d_state-256 heuristic tiles (plan._D_STATE_256_JIT_CB_PRE; not for a
    tuner family's explicit tiles), as asked for in plans with the pre-pass, 0 without it (the single fused launch has
    no place for it), never in the packed form or the AOT kernel; other values are refused."""
    from m2export.kernels.ssd.plan import TileFamily, config_for, packed_config

    p = SSMScanProblem(2, 8192, 24, 128, 1, 256, dtype="bfloat16")
    assert choose_config(p).cb_pre == plan._D_STATE_256_JIT_CB_PRE == 2
    assert choose_config(p, cb_pre=0).cb_pre == 0
    assert config_for(p, TileFamily(64, 32, False)).cb_pre == 0
    for q in (SSMScanProblem(2, 8192, 24, 128, 1, 256, dtype="float16"), SSMScanProblem(2, 8192, 24, 64, 1, 128)):
        assert choose_config(q).cb_pre == plan.DEFAULT_CB_PRE == 0
    for mode in (1, 2):
        assert choose_config(p, cb_pre=mode).cb_pre == mode and choose_config(p, cb_pre=mode).dt_pre
        assert choose_config(p, cb_pre=mode, dt_pre=False).cb_pre == 0
    with pytest.raises(ValueError, match="cb_pre 3"):
        choose_config(p, cb_pre=3)
    one = SSMScanProblem(1, 8192, 24, 128, 1, 256, dtype="bfloat16")
    assert packed_config(one, sm_count=132).cb_pre == 0
    assert packed_config(one, sm_count=132, tiles=TileFamily(64, 32, False)).cb_pre == 0
    assert aot_config(p).cb_pre == 0
    assert len({choose_config(p, cb_pre=1, chunk=64, block_p=16, occupancy=3) for _ in range(3)}) == 1


def test_cb_state_off_by_default_and_refused_where_it_cannot_apply():
    """ScanConfig.cb_state (C @ B^T and C @ state^T as one product in the scan's chunk loop): off by default
    (plan.DEFAULT_CB_STATE) on every shape, never in the packed form or the AOT kernel; asking for it with block_p !=
    chunk, with cb_pre or on the single fused launch is a ValueError naming the field; a plan with an initial state
    keeps the two products in its scan launch (make_scan_plan)."""
    from m2export.kernels.ssd.plan import TileFamily, packed_config

    d128 = SSMScanProblem(4, 8192, 80, 64, 1, 128, dtype="bfloat16")
    falcon = SSMScanProblem(2, 8192, 24, 128, 1, 256, dtype="bfloat16")
    for p in (d128, falcon, SSMScanProblem(1, 8192, 128, 80, 8, 128, dtype="bfloat16"), SSMScanProblem(1, 100, 8, 64, 2, 128,
                                                                                      dtype="float32")):
        assert choose_config(p).cb_state is plan.DEFAULT_CB_STATE is False
        assert aot_config(p).cb_state is False
    one = SSMScanProblem(1, 8192, 80, 64, 1, 128, dtype="bfloat16")
    assert packed_config(one, sm_count=132).cb_state is False
    assert packed_config(one, sm_count=132, tiles=TileFamily(64, 64, True)).cb_state is False
    cfg = choose_config(d128, cb_state=True)
    assert cfg.cb_state and (cfg.chunk, cfg.block_p) == (64, 64)
    assert choose_config(d128, cb_state=True) == cfg
    for kw in (dict(block_p=32), dict(chunk=32), dict(cb_pre=1), dict(dt_pre=False, nseg=1)):
        with pytest.raises(ValueError, match="cb_state needs"):
            choose_config(d128, cb_state=True, **kw)
    with pytest.raises(ValueError, match="cb_state needs"):
        choose_config(falcon, cb_state=True)  # its tiles: chunk 64, 32-row tiles, cb_pre 2


def test_cb_state_scan_launch_and_fallbacks():
    """The scan launch carries CB_STATE from the config without an initial state and False with one; the packed form
    and configs whose tiles do not match are refused by make_scan_plan (ContractError)."""
    from dataclasses import replace

    from m2export.errors import ContractError
    from m2export.kernels.ssd.cutile import make_scan_plan

    p = SSMScanProblem(4, 8192, 80, 64, 1, 128, dtype="bfloat16")
    cfg = choose_config(p, cb_state=True)
    kw = dict(dt_softplus=True, dt_limit=(0.0, float("inf")), has_D=True, has_dt_bias=True)
    for has_init, want in ((False, True), (True, False)):
        plan_ = make_scan_plan(p, cfg, has_init=has_init, **kw)
        (scan,) = [la for la in plan_.launches if la.name == "ssd_scan_kernel"]
        assert dict((a.name, a.value) for a in scan.args if a.kind == "constant")["CB_STATE"] is want
    with pytest.raises(ContractError, match="cb_state needs"):
        make_scan_plan(p, replace(cfg, block_p=32), has_init=False, **kw)
    with pytest.raises(ContractError):
        make_scan_plan(SSMScanProblem(1, 8192, 80, 64, 1, 128, dtype="bfloat16"), replace(cfg, nseg=1, chunks_per_seg=128),
                       has_init=False, packed=True, **kw)
