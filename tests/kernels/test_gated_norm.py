"""GatedRMSNorm: the PyTorch reference vs an explicit float64 formula and the model's RMSNormGated (CPU),
and the cuTile kernel (backend="cutile") vs the float64 oracle (GPU).

Error bounds (rel-L2 vs float64): fp32 arithmetic, one fp32 reduction per group and an approximate
division in SiLU: 1e-5 for float32; otherwise the rounding of the final cast (float16 2e-3,
bfloat16 1e-2). The output is NaN-poisoned through ``out=``; z is a strided slice of a wider
tensor (the layout of the in_proj output).
"""

from __future__ import annotations

import pytest
import torch

from m2export.errors import BackendUnavailable, ContractError
from m2export.kernels.gated_norm import gated_rmsnorm, gated_rmsnorm_ref
from m2export.models.mamba2 import RMSNormGated
from tests.helpers import TORCH_DTYPES, assert_close, requires_cutile

REL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


def oracle(x, z, weight, group_size, eps, norm_before_gate):
    """float64, written out per group: mamba_ssm's rms_norm_ref without bias."""
    xf, zf, wf = x.double().cpu(), z.double().cpu(), weight.double().cpu()
    gate = zf * torch.sigmoid(zf)
    u = xf if norm_before_gate else xf * gate
    out = torch.empty_like(u)
    for g0 in range(0, u.shape[-1], group_size):
        ug = u[..., g0:g0 + group_size]
        out[..., g0:g0 + group_size] = ug / torch.sqrt((ug * ug).mean(-1, keepdim=True) + eps)
    out = out * wf
    return out * gate if norm_before_gate else out


def make(shape, d_inner, dtype="float32", *, seed, pad=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    dt = TORCH_DTYPES[dtype]
    x = (torch.randn(*shape, d_inner, generator=g) * 2).to(dt).to(device)
    wide = (torch.randn(*shape, d_inner + 2 * pad, generator=g) * 2).to(dt).to(device)
    w = (1 + 0.3 * torch.randn(d_inner, generator=g)).to(dt).to(device)
    return x, wide[..., pad:pad + d_inner], w


@pytest.mark.parametrize("group_size", [96, 48, 32, 1])
@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_reference_matches_explicit_formula(group_size, norm_before_gate):
    x, z, w = make((2, 5), 96, seed=group_size, pad=7)
    ref = oracle(x, z, w, group_size, 1e-5, norm_before_gate)
    got = gated_rmsnorm_ref(x, z, w, group_size=group_size, norm_before_gate=norm_before_gate, dtype=torch.float64)
    assert_close("out", ref, got, rel=1e-12)
    out32 = gated_rmsnorm(x, z, w, group_size=group_size, norm_before_gate=norm_before_gate, backend="torch")
    assert out32.dtype == torch.float32 and out32.is_contiguous()
    assert_close("out fp32", ref, out32, rel=1e-6)


@pytest.mark.parametrize("ngroups", [1, 4])
def test_reference_is_the_models_gated_norm(ngroups):
    x, z, w = make((3, 4), 64, seed=ngroups)
    m = RMSNormGated(64, group_size=64 // ngroups, eps=1e-5)
    with torch.no_grad():
        m.weight.copy_(w)
        assert_close("out", m(x, z), gated_rmsnorm_ref(x, z, w, group_size=64 // ngroups), rel=1e-6)


def test_out_buffer_and_explicit_backends():
    x, z, w = make((4,), 32, seed=3)
    out = torch.full_like(x, float("nan"))
    assert gated_rmsnorm(x, z, w, backend="torch", out=out) is out
    assert_close("out", oracle(x, z, w, 32, 1e-5, False), out, rel=1e-6)
    with pytest.raises(ContractError, match="backend: expected one of"):
        gated_rmsnorm(x, z, w, backend="triton")
    with pytest.raises(ContractError, match="out: expected a contiguous"):
        gated_rmsnorm(x, z, w, backend="torch", out=torch.empty(4, 31))
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailable, match="no CUDA device"):
            gated_rmsnorm(x, z, w, backend="cutile")


# ----------------------------------------------------------------------------- GPU: cuTile vs float64
gpu = requires_cutile
DTYPES = ["float32", "float16", "bfloat16"]
CASES = [  # (leading shape, d_inner, group_size, pad of z)
    pytest.param((1,), 5120, 5120, 0, id="rows1_G1_5120"),
    pytest.param((3, 7), 5120, 5120, 40, id="rows21_G1_5120_strided_z"),
    pytest.param((2, 9), 8192, 1024, 24, id="nemotron_G8_1024"),  # one wave: choose_grouped_small's (GROUPED_SMALL)
    pytest.param((133,), 8192, 1024, 24, id="nemotron_G8_1024_rows133"),  # 1,064 (row, group) blocks: choose_grouped
    pytest.param((37,), 96, 48, 0, id="group48_not_pow2"),
    pytest.param((5,), 200, 40, 8, id="group40_C200"),
    pytest.param((2, 65), 256, 256, 0, id="rows130"),
    pytest.param((3,), 7168, 7168, 8, id="G1_7168_three_pieces"),
    pytest.param((2, 3), 3000, 3000, 0, id="G1_3000_seven_bits_padded"),
    pytest.param((5,), 3072, 1536, 8, id="G2_1536_chunks"),
    pytest.param((4,), 3072, 1024, 0, id="G3_1024_pieces"),
    pytest.param((2, 5), 4096, 256, 8, id="G16_256_grouped"),
]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_before_gate", [False, True], ids=["gate_then_norm", "norm_then_gate"])
@pytest.mark.parametrize("lead,d_inner,group_size,pad", CASES)
def test_cutile_gated_norm(lead, d_inner, group_size, pad, norm_before_gate, dtype):
    x, z, w = make(lead, d_inner, dtype, seed=d_inner + group_size + len(lead), pad=pad, device="cuda")
    ref = oracle(x, z, w, group_size, 1e-5, norm_before_gate)
    out = torch.full_like(x, float("nan"))
    res = gated_rmsnorm(x, z, w, group_size=group_size, norm_before_gate=norm_before_gate, out=out)
    torch.cuda.synchronize()
    assert res is out
    assert_close("out", ref, out.cpu(), rel=REL[dtype])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tiles", [(1, 1024, 5), (4, 1024, 5), (2, 8192, 1), (1, 8192, 1)],
                         ids=["chunks_R1", "chunks_R4", "padded_R2", "padded_R1"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cutile_gated_norm_tile_variants(tiles, dtype):
    """The 5120-channel group of mamba2-2.7b both ways: one padded tile, five chunks in two passes."""
    from m2export.contract_gated_norm import validate
    from m2export.kernels.gated_norm.cutile import gated_rmsnorm_cutile

    x, z, w = make((3, 3), 5120, dtype, seed=tiles[0] + tiles[2], pad=16, device="cuda")
    ref = oracle(x, z, w, 5120, 1e-5, False)
    out = torch.full_like(x, float("nan"))
    gated_rmsnorm_cutile(x, z, w, problem=validate(x, z, w), out=out, tiles=tiles, occupancy=4)
    torch.cuda.synchronize()
    assert_close("out", ref, out.cpu(), rel=REL[dtype])


def test_tiles_must_cover_the_group():
    from m2export.contract_gated_norm import GatedNormProblem
    from m2export.kernels.gated_norm.cutile import check_tiles, choose_tiles

    p = GatedNormProblem(rows=10, d_inner=10240, group_size=5120)
    assert choose_tiles(p) == (2, 1024, 5)
    assert choose_tiles(GatedNormProblem(rows=10, d_inner=5120, group_size=5120)) == (1, 8192, 1)
    assert choose_tiles(GatedNormProblem(rows=10, d_inner=8192, group_size=1024)) == (2, 1024, 1)
    with pytest.raises(ContractError, match="do not cover group_size 5120"):
        check_tiles(p, (1, 8192, 1))  # padding would run into the next group


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("pieces,tma,occupancy", [((1, 4096, 1024, 0), False, None), ((2, 4096, 1024, 0), True, 2),
                                                  ((4, 4096, 1024, 0), False, 1), ((1, 4096, 1024, 0), True, None)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cutile_gated_norm_pieces_variants(pieces, tma, occupancy, dtype):
    """The 5120-channel group as 4096 + 1024 in one pass, rows per block, bulk copies on and off."""
    from m2export.contract_gated_norm import validate
    from m2export.kernels.gated_norm.cutile import gated_rmsnorm_cutile

    x, z, w = make((3, 3), 5120, dtype, seed=pieces[0] + tma, pad=16, device="cuda")
    for nbg in (False, True):
        ref = oracle(x, z, w, 5120, 1e-5, nbg)
        out = torch.full_like(x, float("nan"))
        gated_rmsnorm_cutile(x, z, w, problem=validate(x, z, w, norm_before_gate=nbg), out=out, pieces=pieces,
                             tma=tma, occupancy=occupancy)
        torch.cuda.synchronize()
        assert_close("out", ref, out.cpu(), rel=REL[dtype])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("grouped,tma,occupancy,check,warps", [
    ((1, 8), True, None, None, None), ((2, 4), True, 4, None, None), ((1, 2), False, 8, None, None),
    ((4, 8), True, 1, None, None), ((1, 1), False, 0, False, None), ((1, 4), True, 8, False, None),
    ((1, 2), False, 0, False, None), ((1, 1), False, 0, False, 8), ((1, 2), False, 0, False, 8),
    ((2, 4), True, 4, None, 8)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cutile_gated_norm_grouped_variants(grouped, tma, occupancy, check, warps, dtype):
    """Nemotron-H's 8 groups of 1024, G of them per block, rows (21: a partial last block) per block, both gate orders;
    check False: loads and stores without bounds checks (one row per block); warps 8: 256 threads per block."""
    from m2export.contract_gated_norm import validate
    from m2export.kernels.gated_norm.cutile import gated_rmsnorm_cutile

    x, z, w = make((3, 7), 8192, dtype, seed=grouped[0] * 10 + grouped[1], pad=24, device="cuda")
    for nbg in (False, True):
        ref = oracle(x, z, w, 1024, 1e-5, nbg)
        out = torch.full_like(x, float("nan"))
        gated_rmsnorm_cutile(x, z, w, problem=validate(x, z, w, group_size=1024, norm_before_gate=nbg), out=out,
                             grouped=grouped, tma=tma, occupancy=occupancy, check=check, warps=warps)
        torch.cuda.synchronize()
        assert_close("out", ref, out.cpu(), rel=REL[dtype])


def test_unchecked_grouped_needs_whole_blocks():
    """Refused before anything runs (CPU tensors: no launch is reached)."""
    pytest.importorskip("cuda.tile")
    from m2export.contract_gated_norm import validate
    from m2export.kernels.gated_norm.cutile import gated_rmsnorm_cutile

    x, z, w = make((21,), 8192, "float32", seed=3)
    with pytest.raises(ContractError, match="check=False: 21 rows are not a multiple of BLOCK_R 2"):
        gated_rmsnorm_cutile(x, z, w, problem=validate(x, z, w, group_size=1024), grouped=(2, 4), check=False)
    with pytest.raises(ContractError, match="warps: expected 4 or 8"):
        gated_rmsnorm_cutile(x, z, w, problem=validate(x, z, w, group_size=1024), grouped=(1, 4), warps=2)


def test_pieces_decompose_the_group():
    from m2export.contract_gated_norm import GatedNormProblem
    from m2export.kernels.gated_norm.cutile import choose_pieces, choose_pieces_rows

    assert choose_pieces(GatedNormProblem(rows=10, d_inner=5120, group_size=5120)) == (4096, 1024, 0)
    assert choose_pieces(GatedNormProblem(rows=10, d_inner=7168, group_size=7168)) == (4096, 2048, 1024)
    assert choose_pieces(GatedNormProblem(rows=10, d_inner=8192, group_size=1024)) == (1024, 0, 0)
    assert choose_pieces(GatedNormProblem(rows=10, d_inner=10240, group_size=5120)) is None  # two groups
    assert choose_pieces(GatedNormProblem(rows=10, d_inner=3000, group_size=3000)) is None  # seven binary digits
    assert choose_pieces_rows(GatedNormProblem(rows=10, d_inner=8192, group_size=1024)) == 2
    from m2export.kernels.gated_norm.cutile import choose_grouped

    assert choose_grouped(GatedNormProblem(rows=10, d_inner=8192, group_size=1024)) == (1, 4)
    assert choose_grouped(GatedNormProblem(rows=10, d_inner=3072, group_size=1024)) is None  # 3 groups: pieces
    assert choose_grouped(GatedNormProblem(rows=10, d_inner=5120, group_size=5120)) is None
    assert choose_grouped(GatedNormProblem(rows=10, d_inner=32768, group_size=4096)) is None  # 4096 per group
    assert choose_pieces_rows(GatedNormProblem(rows=1, d_inner=96, group_size=48)) == 1
    from m2export.kernels.gated_norm.cutile import choose_grouped_small

    small = dict(grouped=(1, 1), tma=False, check=False, occupancy=0, warps=8)
    assert choose_grouped_small(GatedNormProblem(rows=128, d_inner=8192, group_size=1024)) == small  # decode, 1,024
    assert choose_grouped_small(GatedNormProblem(rows=133, d_inner=8192, group_size=1024)) is None  # 1,064 blocks
    assert choose_grouped_small(GatedNormProblem(rows=128, d_inner=8192, group_size=1024), sm_count=100) is None
    assert choose_grouped_small(GatedNormProblem(rows=4, d_inner=5120, group_size=5120)) is None  # one group: pieces


@pytest.mark.gpu
@gpu
def test_cutile_gated_norm_large_and_tiny_values():
    """Large |z| (exp overflow inside SiLU) and a row of zeros (rsqrt(eps)) stay finite and right."""
    x, z, w = make((4,), 1024, "float32", seed=5, device="cuda")
    z[0, :10] = -200.0
    z[1, :10] = 200.0
    x[2] = 0.0
    ref = oracle(x, z, w, 256, 1e-5, False)
    assert_close("out", ref, gated_rmsnorm(x, z, w, group_size=256).cpu(), rel=1e-5)
