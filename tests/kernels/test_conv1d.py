"""CausalConv1d: the PyTorch reference vs an explicit float64 sum (CPU), the model's conv, and the cuTile
kernels (prefill and in-place update, backend="cutile") vs that float64 oracle (GPU).

Error bounds (rel-L2 of y vs the float64 oracle): fp32 arithmetic with one approximate division in
SiLU: 1e-5 for float32; y carries the rounding of its final cast otherwise (float16 2e-3, bfloat16
1e-2). The conv state holds input values, so it must match exactly. Outputs are NaN-poisoned
through ``out=`` / ``state_out=`` before each launch; x is also passed as a strided slice of a
wider tensor, the layout of the in_proj output.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from m2export.errors import BackendUnavailable, ContractError
from m2export.kernels.conv1d import causal_conv1d, causal_conv1d_ref, conv_update, conv_update_ref
from tests.helpers import TORCH_DTYPES, assert_close, requires_cutile

Y_REL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


def oracle(x, weight, bias, conv_state, silu=True):
    """float64 explicit sum over taps: y[b, t, c] = act(bias + sum_k w[c, k] * xp[b, t + k, c])."""
    b, L, C = x.shape
    K = weight.shape[1]
    st = torch.zeros(b, C, K - 1, dtype=torch.float64) if conv_state is None else conv_state.double().cpu()
    xp = torch.cat([st.transpose(1, 2), x.double().cpu()], dim=1)  # (b, K-1+L, C)
    y = torch.zeros(b, L, C, dtype=torch.float64)
    if bias is not None:
        y += bias.double().cpu()
    w = weight.double().cpu()
    for k in range(K):
        y += xp[:, k:k + L, :] * w[:, k]
    return (F.silu(y) if silu else y), xp[:, L:, :].transpose(1, 2).contiguous()


def make(batch, seqlen, conv_dim, d_conv, dtype="float32", *, seed, state=True, bias=True, pad=0, device="cpu"):
    """Random inputs; x is a slice [pad : pad + conv_dim] of a (batch, seqlen, conv_dim + 2*pad) tensor."""
    g = torch.Generator().manual_seed(seed)
    dt = TORCH_DTYPES[dtype]
    wide = torch.randn(batch, seqlen, conv_dim + 2 * pad, generator=g).to(dt).to(device)
    x = wide[..., pad:pad + conv_dim]
    w = (torch.randn(conv_dim, d_conv, generator=g) * 0.5).to(dt).to(device)
    bs = (torch.randn(conv_dim, generator=g) * 0.3).to(dt).to(device) if bias else None
    cs = torch.randn(batch, conv_dim, d_conv - 1, generator=g).to(dt).to(device) if state else None
    return x, w, bs, cs


@pytest.mark.parametrize("seqlen", [1, 2, 3, 4, 37])
@pytest.mark.parametrize("d_conv", [2, 3, 4])
def test_reference_matches_explicit_sum(seqlen, d_conv):
    x, w, bs, cs = make(3, seqlen, 20, d_conv, seed=seqlen * 10 + d_conv, pad=3)
    y_ref, st_ref = oracle(x, w, bs, cs)
    res = causal_conv1d_ref(x, w, bs, cs, dtype=torch.float64)
    assert_close("y", y_ref, res.y, rel=1e-12)
    assert torch.equal(res.final_conv_state, st_ref)
    res32 = causal_conv1d(x, w, bs, cs, backend="torch")
    assert res32.y.dtype == torch.float32 and res32.y.is_contiguous()
    assert_close("y fp32", y_ref, res32.y, rel=1e-6)


def test_reference_without_state_bias_or_activation():
    x, w, _, _ = make(2, 9, 12, 4, seed=1, state=False, bias=False)
    y_ref, st_ref = oracle(x, w, None, None, silu=False)
    res = causal_conv1d_ref(x, w, activation="none", dtype=torch.float64)
    assert_close("y", y_ref, res.y, rel=1e-12)
    assert torch.equal(res.final_conv_state, st_ref)


def test_prefill_then_updates_equals_longer_prefill():
    x, w, bs, cs = make(2, 11, 16, 4, seed=2)
    full = causal_conv1d_ref(x, w, bs, cs, dtype=torch.float64)
    head = causal_conv1d_ref(x[:, :6], w, bs, cs)
    state = head.final_conv_state.clone()
    for t in range(6, 11):
        res = conv_update(x[:, t], state, w, bs, backend="torch")
        assert res.final_conv_state is state  # in place
        assert_close(f"y[{t}]", full.y[:, t], res.y, rel=1e-6)
    assert torch.equal(state.double(), full.final_conv_state)


def test_update_reference_leaves_its_input_state_alone():
    x, w, bs, cs = make(3, 1, 8, 3, seed=3)
    before = cs.clone()
    res = conv_update_ref(x[:, 0], cs, w, bs)
    assert torch.equal(cs, before)
    assert torch.equal(res.final_conv_state, torch.cat([before[:, :, 1:], x[:, 0, :, None]], dim=2))


def test_reference_is_the_models_conv():
    """Mamba2Mixer's conv (F.conv1d over concat(conv_state, xBC)) computes the same function."""
    x, w, bs, cs = make(2, 7, 24, 4, seed=4)
    xp = torch.cat([cs, x.transpose(1, 2)], dim=2)
    y_model = F.silu(F.conv1d(xp, w[:, None, :], bs, groups=24)).transpose(1, 2)
    assert_close("y", y_model, causal_conv1d_ref(x, w, bs, cs).y, rel=1e-6)


def test_explicit_backends_only():
    x, w, bs, cs = make(1, 4, 8, 4, seed=5)
    with pytest.raises(ContractError, match="backend: expected one of"):
        causal_conv1d(x, w, bs, cs, backend="triton")
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailable, match="no CUDA device"):
            causal_conv1d(x, w, bs, cs, backend="cutile")
        with pytest.raises(BackendUnavailable, match="no CUDA device"):
            conv_update(x[:, 0], cs, w, bs, backend="cutile")


# ----------------------------------------------------------------------------- GPU: cuTile vs float64
gpu = requires_cutile
DTYPES = ["float32", "float16", "bfloat16"]
PREFILL = [  # (batch, seqlen, conv_dim, d_conv, state, bias, pad), ids name the edge
    pytest.param(2, 1, 200, 4, True, True, 8, id="L1"),
    pytest.param(2, 2, 200, 4, True, True, 8, id="L2"),
    pytest.param(3, 3, 200, 4, True, True, 0, id="L3_lt_dconv_plus1"),
    pytest.param(1, 4, 136, 4, False, True, 0, id="L4_no_state"),
    pytest.param(2, 19, 5376 // 8, 4, True, True, 8, id="L19_tile_plus_edge"),
    pytest.param(1, 64 + 2, 520, 3, True, False, 0, id="L_one_tile_plus_dconv_m1_d3_nobias"),
    pytest.param(2, 64 + 4, 130, 4, True, True, 0, id="L_one_tile_plus_dconv"),
    pytest.param(3, 100, 264, 2, True, True, 16, id="L100_d2"),
    pytest.param(2, 1000, 1000, 4, True, True, 8, id="L1000_C1000"),
    pytest.param(1, 2, 40, 3, False, False, 0, id="L2_d3_plain"),
    pytest.param(2, 77, 300, 4, True, True, 3, id="L77_unaligned_base"),
    pytest.param(3, 513, 2100, 4, True, True, 8, id="L513_block_edges_C2100"),
    # whole row tiles (conv_dim % 128 == 0, seqlen % 16 == 0): where stream2d's unchecked build may run (stream_unchecked)
    pytest.param(2, 96, 256, 4, True, True, 8, id="L96_C256_whole_tiles"),
    pytest.param(3, 16, 384, 4, True, True, 0, id="L16_C384_one_step_whole_tiles"),
    pytest.param(2, 64, 128, 2, True, False, 0, id="L64_C128_d2_whole_tiles_nobias"),
    pytest.param(2, 1024, 640, 3, False, True, 16, id="L1024_C640_d3_whole_tiles_no_state"),
]


#: (impl, latency, occupancy, tiles, prefetch, chooser[, unchecked]) run through every PREFILL edge besides the default launch:
#: the streaming kernels with the row-load latency hint, stream2d with and without the row prefetch, fixed tiles or
#: choose_stream_tiles' with the keywords ``chooser`` (None: the launcher's); candidates for the default
#: (benchmarks/NOTES_fusion.md). "fit16_prefetch" is the previous default (STREAM_PREFETCH, STREAM_FIT_WAVES and
#: STREAM_STEP_BYTES 4096 at 128 channels), "fit8_prefetch" the same with 8 rows per step, "fit16_prefetch_unchecked"
#: with stream2d's unchecked build where it applies (STREAM_UNCHECKED); "fit_256ch*"/"fit_512ch*": wider channel tiles
#: (longer row pieces per DRAM access), 4 or 8 KB of x per step ("fit_256ch": the default's tiles for 2-byte dtypes,
#: STREAM_BLOCK_C, and 256 channels of 4 fp32 rows).
PREFILL_CANDIDATES = [pytest.param(None, id="default"),
                      pytest.param(("stream", 10, 4, None, None, None), id="stream_lat10_occ4"),
                      pytest.param(("stream2d", 10, 4, None, None, None), id="stream2d_lat10_occ4"),
                      pytest.param(("stream2d", 10, 8, None, True, dict(fit=True, step_bytes=4096, block_c=128)),
                                   id="fit16_prefetch"),
                      pytest.param(("stream2d", 10, 8, None, True, dict(fit=True, rows=8, block_c=128)), id="fit8_prefetch"),
                      pytest.param(("stream2d", 10, 4, (256, 32, 128), None, None), id="stream2d_256x32x128_lat10_occ4"),
                      pytest.param(("stream2d", 10, 8, (272, 16, 128), False, None), id="stream2d_272x16x128_no_prefetch"),
                      pytest.param(("stream2d", 10, 8, None, True, dict(fit=True, step_bytes=4096, block_c=128),
                                    True), id="fit16_prefetch_unchecked"),
                      pytest.param(("stream2d", 10, 8, None, True, dict(fit=True, step_bytes=4096, block_c=256)),
                                   id="fit_256ch"),
                      pytest.param(("stream2d", 10, 4, None, True,
                                    dict(fit=True, step_bytes=8192, block_c=256, occupancy=4)), id="fit_256ch_occ4"),
                      pytest.param(("stream2d", 10, 4, None, True,
                                    dict(fit=True, step_bytes=8192, block_c=512, occupancy=4)), id="fit_512ch_occ4")]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", PREFILL_CANDIDATES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,seqlen,conv_dim,d_conv,state,bias,pad", PREFILL)
def test_cutile_prefill(batch, seqlen, conv_dim, d_conv, state, bias, pad, dtype, variant):
    from m2export.contract_conv1d import validate
    from m2export.kernels.conv1d.cutile import causal_conv1d_cutile

    x, w, bs, cs = make(batch, seqlen, conv_dim, d_conv, dtype, seed=seqlen + conv_dim + d_conv, state=state,
                        bias=bias, pad=pad, device="cuda")
    y_ref, st_ref = oracle(x, w, bs, cs)
    y = torch.full((batch, seqlen, conv_dim), float("nan"), dtype=x.dtype, device="cuda")
    st = torch.full((batch, conv_dim, d_conv - 1), float("nan"), dtype=x.dtype, device="cuda")
    cs_before = None if cs is None else cs.clone()
    if variant is None:
        res = causal_conv1d(x, w, bs, cs, out=y, state_out=st)
    else:
        from m2export.kernels.conv1d.cutile import choose_stream_tiles

        impl, lat, occ, tiles, prefetch, chooser, *unchecked = variant
        p = validate(x, w, bs, cs)
        tiles = tiles or (choose_stream_tiles(p, x.element_size(), **chooser) if chooser else None)
        res = causal_conv1d_cutile(x, w, bs, cs, problem=p, silu=True, out=y, state_out=st,
                                   impl=impl, latency=lat, occupancy=occ, tiles=tiles, prefetch=prefetch,
                                   unchecked=unchecked[0] if unchecked else None)
    torch.cuda.synchronize()
    assert res.y is y and res.final_conv_state is st
    assert_close("y", y_ref, y.cpu(), rel=Y_REL[dtype])
    assert torch.equal(st.cpu().double(), st_ref), "final_conv_state must be the last d_conv-1 inputs exactly"
    if cs is not None:
        assert torch.equal(cs, cs_before), "the prefill must not modify conv_state"


@pytest.mark.gpu
@gpu
def test_cutile_prefill_allocates_and_refuses_aliasing():
    x, w, bs, cs = make(2, 50, 300, 4, "bfloat16", seed=9, device="cuda")
    res = causal_conv1d(x, w, bs, cs)
    y_ref, st_ref = oracle(x, w, bs, cs)
    assert_close("y", y_ref, res.y.cpu(), rel=Y_REL["bfloat16"])
    assert torch.equal(res.final_conv_state.cpu().double(), st_ref)
    with pytest.raises(ContractError, match="state_out: must not alias conv_state"):
        causal_conv1d(x, w, bs, cs, state_out=cs)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("impl,tiles,occupancy,latency,prefetch", [(*v, None) for v in [
    ("stream", (16, 4, 1024), None, 0), ("stream", (64, 8, 512), 2, 0), ("stream", (8, 8, 128), None, 0),
    ("stream", (256, 4, 256), None, 0), ("stream", (4, 4, 16), None, 0), ("stream", (32, 4, 512), 4, 0),
    ("stream", (16, 16, 256), None, 0),
    ("stream", (256, 8, 256), None, 10), ("stream", (128, 8, 256), None, 10), ("stream", (256, 4, 512), None, 10),
    ("stream", (256, 8, 256), 4, 5), ("stream", (16, 4, 64), None, 10),
    ("stream2d", (256, 8, 256), None, 0), ("stream2d", (128, 8, 256), 4, 10), ("stream2d", (256, 4, 512), 4, 10),
    ("stream2d", (8, 8, 128), None, 10), ("stream2d", (4, 4, 16), None, 0),
    ("stream2d", (256, 16, 256), 4, 10), ("stream2d", (256, 16, 256), 4, 0), ("stream2d", (256, 8, 128), 8, 10),
    ("stream2d", (128, 32, 128), 4, 10), ("stream2d", (128, 16, 128), 4, 10), ("stream", (256, 8, 256), 5, 10),
    ("v1", (16, 128), None, 0), ("v1", (32, 128), 2, 0), ("v1", (4, 16), None, 0)]] + [
    # token ranges that are no power of two (the chooser's wave-fitted ones), with and without the row prefetch
    ("stream2d", (272, 16, 128), 8, 10, True), ("stream2d", (336, 16, 128), 8, 10, True),
    ("stream2d", (328, 8, 128), 8, 10, True), ("stream2d", (24, 8, 128), None, 0, True),
    ("stream2d", (48, 16, 64), 8, 10, False), ("stream2d", (256, 8, 128), 8, 10, False),
    # wider channel tiles (1344 channels: a partial last tile)
    ("stream2d", (168, 8, 256), 8, 10, True), ("stream2d", (336, 16, 256), 4, 10, True),
    ("stream2d", (176, 8, 512), 4, 10, True)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cutile_prefill_tile_variants(impl, tiles, occupancy, latency, prefetch, dtype):
    from m2export.contract_conv1d import validate
    from m2export.kernels.conv1d.cutile import causal_conv1d_cutile

    x, w, bs, cs = make(2, 300, 5376 // 4, 4, dtype, seed=tiles[0] + tiles[-1], pad=8, device="cuda")
    y_ref, st_ref = oracle(x, w, bs, cs)
    y = torch.full((2, 300, 5376 // 4), float("nan"), dtype=x.dtype, device="cuda")
    st = torch.full((2, 5376 // 4, 3), float("nan"), dtype=x.dtype, device="cuda")
    causal_conv1d_cutile(x, w, bs, cs, problem=validate(x, w, bs, cs), silu=True, out=y, state_out=st, tiles=tiles,
                         occupancy=occupancy, impl=impl, latency=latency, prefetch=prefetch)
    torch.cuda.synchronize()
    assert_close("y", y_ref, y.cpu(), rel=Y_REL[dtype])
    assert torch.equal(st.cpu().double(), st_ref)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tiles,prefetch", [((272, 16, 128), True), ((336, 16, 128), True), ((32, 16, 128), False),
                                            ((48, 8, 128), True), ((16, 16, 256), True), ((64, 4, 128), False),
                                            ((168, 8, 256), True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cutile_prefill_unchecked_whole_tiles(tiles, prefetch, dtype):
    """stream2d's unchecked build (row tiles without bounds checks) where every row tile lies inside x: whole tiles of
    channels and tokens, token ranges that do not divide seqlen (the last block's steps cut at the last token), batch
    > 1, initial state, strided x; float64 oracle, NaN-poisoned outputs; and the checked build on the same inputs."""
    from m2export.contract_conv1d import validate
    from m2export.kernels.conv1d.cutile import causal_conv1d_cutile, stream_unchecked

    rows, bc = tiles[1], tiles[2]
    batch, seqlen, conv_dim = 3, 40 * rows, 3 * bc
    x, w, bs, cs = make(batch, seqlen, conv_dim, 4, dtype, seed=tiles[0] + rows, pad=8, device="cuda")
    p = validate(x, w, bs, cs)
    assert stream_unchecked(p, tiles, unchecked=True) and not stream_unchecked(p, tiles, unchecked=False)
    y_ref, st_ref = oracle(x, w, bs, cs)
    for unchecked in (True, False):
        y = torch.full((batch, seqlen, conv_dim), float("nan"), dtype=x.dtype, device="cuda")
        st = torch.full((batch, conv_dim, 3), float("nan"), dtype=x.dtype, device="cuda")
        causal_conv1d_cutile(x, w, bs, cs, problem=p, silu=True, out=y, state_out=st, tiles=tiles, occupancy=8,
                             impl="stream2d", prefetch=prefetch, unchecked=unchecked)
        torch.cuda.synchronize()
        assert_close("y", y_ref, y.cpu(), rel=Y_REL[dtype])
        assert torch.equal(st.cpu().double(), st_ref)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("seqlen", [1, 2, 3, 4, 5, 260])
def test_cutile_prefill_no_activation_short(seqlen):
    """activation="none", every length around d_conv - 1 and a block edge (tiles of 4 tokens, 4 rows: 65 blocks)."""
    from m2export.contract_conv1d import validate
    from m2export.kernels.conv1d.cutile import causal_conv1d_cutile

    x, w, bs, cs = make(3, seqlen, 96, 4, "float32", seed=seqlen, pad=4, device="cuda")
    y_ref, st_ref = oracle(x, w, bs, cs, silu=False)
    for tiles in (None, (4, 4, 64)):
        y = torch.full((3, seqlen, 96), float("nan"), dtype=x.dtype, device="cuda")
        st = torch.full((3, 96, 3), float("nan"), dtype=x.dtype, device="cuda")
        causal_conv1d_cutile(x, w, bs, cs, problem=validate(x, w, bs, cs), silu=False, out=y, state_out=st,
                             tiles=tiles)
        torch.cuda.synchronize()
        assert_close("y", y_ref, y.cpu(), rel=1e-5)
        assert torch.equal(st.cpu().double(), st_ref)


def test_stream_tiles():
    from m2export.contract_conv1d import Conv1dProblem
    from m2export.kernels.conv1d.cutile import choose_stream_tiles

    assert choose_stream_tiles(Conv1dProblem(batch=4, seqlen=8192, conv_dim=5376, d_conv=4), 2, fit=False,
                               step_bytes=None, block_c=128) == (256, 8, 128)
    assert choose_stream_tiles(Conv1dProblem(batch=1, seqlen=8192, conv_dim=5376, d_conv=4), 2, fit=False,
                               step_bytes=None, block_c=128) == (256, 8, 128)
    assert choose_stream_tiles(Conv1dProblem(batch=1, seqlen=1000, conv_dim=1000, d_conv=4), 2, fit=False,
                               step_bytes=None, block_c=128) == (16, 8, 128)
    assert choose_stream_tiles(Conv1dProblem(batch=1, seqlen=3, conv_dim=40, d_conv=4), 4, fit=False,
                               step_bytes=None) == (8, 8, 64)

    def fit(b, l, c, itemsize=2, **kw):
        return choose_stream_tiles(Conv1dProblem(batch=b, seqlen=l, conv_dim=c, d_conv=4), itemsize, fit=True,
                                   **{"step_bytes": 4096, "block_c": 128, **kw})

    # the defaults (STREAM_BLOCK_C: 256 channels for 2-byte dtypes, 128 for fp32)
    p27 = Conv1dProblem(batch=1, seqlen=8192, conv_dim=5376, d_conv=4)
    assert choose_stream_tiles(p27, 2) == (168, 8, 256) and choose_stream_tiles(p27, 4) == (328, 8, 128)
    # token ranges fitted to whole waves of 8 x 132 blocks: 5,208 blocks (4.93 waves), 1,050 (one), 2,080 (1.97)
    assert fit(4, 8192, 5376) == (272, 16, 128) and fit(1, 8192, 5376) == (336, 16, 128)
    assert fit(1, 8192, 10240) == (320, 16, 128) and fit(4, 8192, 10240) == (256, 16, 128)
    assert fit(1, 8192, 5376, 4) == (328, 8, 128)  # fp32: 8 rows of 4 KB
    assert fit(1, 8192, 5376, rows=8) == (328, 8, 128)
    assert fit(1, 8192, 5376, occupancy=4) == (224, 16, 128)  # 1,554 blocks: 2.94 waves of 528
    assert fit(1, 1000, 1000) == (16, 16, 128) and fit(1, 3, 40, 4) == (16, 16, 64)
    # 256-channel tiles: 8 bf16 / 4 fp32 rows of 4 KB; 1,029 blocks at 2.7b
    # 1x8192, 3,108 (2.94 waves) at 4x8192; capped at the next power of two of a narrow conv_dim
    assert fit(1, 8192, 5376, block_c=256) == (168, 8, 256) and fit(4, 8192, 5376, block_c=256) == (224, 8, 256)
    assert fit(1, 8192, 5376, 4, block_c=256) == (164, 4, 256) and fit(1, 8192, 10240, block_c=256) == (320, 8, 256)
    assert fit(1, 3, 40, 4, block_c=256) == (16, 16, 64)


def test_stream_unchecked_only_where_every_row_tile_is_inside_x():
    from m2export.contract_conv1d import Conv1dProblem
    from m2export.kernels.conv1d.cutile import stream_unchecked

    def unc(l, c, tiles, **kw):
        return stream_unchecked(Conv1dProblem(batch=2, seqlen=l, conv_dim=c, d_conv=4), tiles, **kw)

    on = dict(unchecked=True)
    assert unc(8192, 5376, (336, 16, 128), **on) and unc(8192, 10240, (320, 16, 128), **on)
    assert unc(96, 256, (272, 16, 128), **on) and not unc(8192, 5376, (336, 16, 128), unchecked=False)
    assert not unc(8200, 5376, (336, 16, 128), **on)  # a partial last row tile
    assert not unc(8192, 5380, (336, 16, 128), **on) and not unc(1000, 1000, (16, 16, 128), **on)
    assert not unc(3, 128, (16, 16, 128), **on)


@pytest.mark.gpu
@gpu
def test_stream_tiles_refused():
    """ROWS < d_conv - 1 (wrong outputs on the H200), BLOCK_T not a multiple of ROWS, ROWS not a power of two
    (stream2d) and a latency hint out of 0..10: one-line ContractError."""
    from m2export.contract_conv1d import validate
    from m2export.kernels.conv1d.cutile import causal_conv1d_cutile

    x, w, bs, cs = make(1, 20, 64, 4, "float32", seed=1, device="cuda")
    for impl, tiles in (("stream", (32, 2, 64)), ("stream", (30, 4, 64)), ("stream2d", (36, 6, 64))):
        with pytest.raises(ContractError, match="need BLOCK_T a multiple of ROWS and ROWS >= d_conv - 1"):
            causal_conv1d_cutile(x, w, bs, cs, problem=validate(x, w, bs, cs), silu=True, tiles=tiles, impl=impl)
    with pytest.raises(ContractError, match="latency: expected 0"):
        causal_conv1d_cutile(x, w, bs, cs, problem=validate(x, w, bs, cs), silu=True, latency=11)


UPDATE = [pytest.param(1, 200, 4, id="B1"), pytest.param(5, 5376 // 8, 3, id="B5_d3"),
          pytest.param(130, 1000, 4, id="B130_C1000"), pytest.param(7, 48, 2, id="B7_d2")]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("impl,tiles", [(None, None), ("gather", None), ("cols", (8, 256)), ("cols", (1, 1024)),
                                        ("cols", (16, 128))])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,conv_dim,d_conv", UPDATE)
def test_cutile_update_in_place(batch, conv_dim, d_conv, dtype, impl, tiles):
    """The default update (public entry point) and each kernel/tile choice vs float64, NaN-poisoned y, the state
    shifted exactly."""
    from m2export.contract_conv1d import validate_update
    from m2export.kernels.conv1d.cutile import conv_update_cutile

    x, w, bs, cs = make(batch, 1, conv_dim, d_conv, dtype, seed=batch + conv_dim, pad=8, device="cuda")
    y_ref, st_ref = oracle(x, w, bs, cs)
    y = torch.full((batch, conv_dim), float("nan"), dtype=x.dtype, device="cuda")
    state = cs.clone()
    if impl is None:
        res = conv_update(x[:, 0], state, w, bs, out=y)
    else:
        res = conv_update_cutile(x[:, 0], state, w, bs, problem=validate_update(x[:, 0], state, w, bs), silu=True,
                                 out=y, impl=impl, tiles=tiles)
    torch.cuda.synchronize()
    assert res.y is y and res.final_conv_state is state
    assert_close("y", y_ref[:, 0], y.cpu(), rel=Y_REL[dtype])
    assert torch.equal(state.cpu().double(), st_ref), "conv_state must be shifted by one token exactly"


@pytest.mark.gpu
@gpu
def test_cutile_prefill_then_updates_equals_longer_prefill():
    x, w, bs, cs = make(3, 40, 264, 4, "float32", seed=11, device="cuda")
    full = causal_conv1d(x, w, bs, cs)
    head = causal_conv1d(x[:, :33], w, bs, cs)
    state = head.final_conv_state
    for t in range(33, 40):
        res = conv_update(x[:, t], state, w, bs)
        assert_close(f"y[{t}]", full.y[:, t], res.y, rel=1e-5)
    torch.cuda.synchronize()
    assert torch.equal(state, full.final_conv_state)
