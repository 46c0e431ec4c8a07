"""cuTile SSMScan decode step (m2export.kernels.ssd_step, backend="cutile") vs a float64 oracle.

The oracle is ``ssm_step_ref``'s formula evaluated on float64 upcasts of the inputs
(``naive.ssm_scan_recurrent`` with seqlen 1). Outputs are NaN-poisoned through ``out=`` /
``state_out=`` before each launch; the in-place update (``state_out=ssm_state``) is tested too.

Error bounds (rel-L2; max-abs relative to max|ref|): the step has no matrix products, only fp32
elementwise work and one fp32 reduction, so the state is fp32-exact to ~1e-6 for every dtype and
y carries the rounding of its final cast:

=========  ===========  =================  =============
dtype      y rel-L2     new state rel-L2   max-abs / max
=========  ===========  =================  =============
float32    1e-5         1e-5               1e-5
float16    2e-3         1e-5               4e-3
bfloat16   1e-2         1e-5               2e-2
=========  ===========  =================  =============
"""

from __future__ import annotations

import math

import pytest
import torch

from m2export.contract import SSMScanProblem
from m2export.errors import BackendUnavailable, ContractError
from m2export.kernels.ssd.naive import ssm_scan_recurrent
from m2export.kernels.ssd_step import ssm_step
from tests.helpers import TORCH_DTYPES, assert_close, make_inputs, stable_seed
from tests.kernels.test_ssd import gpu

Y_REL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
MAXABS_Y = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 2e-2}
STATE_REL = 1e-5


def _step_inputs(p: SSMScanProblem, seed: int, **kw):
    inp = make_inputs(p, seed=seed, **kw)
    step = dict(x=inp["x"][:, 0], dt=inp["dt"][:, 0], A=inp["A"], B=inp["B"][:, 0], C=inp["C"][:, 0], D=inp["D"],
                dt_bias=inp["dt_bias"], ssm_state=inp["initial_state"])
    return inp, step


def _check(p: SSMScanProblem, *, seed: int, in_place=False, dt_limit=(0.0, math.inf), init_state=True, no_D=False,
           A_range=(0.5, 8.0), dt_value=None):
    inp, step = _step_inputs(p, seed, init_state=init_state, A_range=A_range)
    if dt_value is not None:
        inp["dt"] = torch.full_like(inp["dt"], dt_value)
        step["dt"] = inp["dt"][:, 0]
    if no_D:
        inp["D"] = step["D"] = None
    ref = ssm_scan_recurrent(**inp, dt_limit=dt_limit)  # float64, seqlen 1
    dev = {k: (v.cuda() if v is not None else None) for k, v in step.items()}
    y = torch.full(tuple(step["x"].shape), float("nan"), dtype=TORCH_DTYPES[p.dtype], device="cuda")
    if in_place:
        st_out = dev["ssm_state"]
    else:
        st_out = torch.full(p.shape_of("final_state"), float("nan"), dtype=torch.float32, device="cuda")
    res = ssm_step(**dev, dt_limit=dt_limit, out=y, state_out=st_out)
    torch.cuda.synchronize()
    assert res.y is y and res.final_state is st_out
    d = p.dtype
    assert_close("y", ref.y[:, 0], y.cpu(), rel=Y_REL[d], atol=MAXABS_Y[d] * ref.y.abs().max().item())
    assert_close("state", ref.final_state, st_out.cpu(), rel=STATE_REL)


CASES = [("B1_H8_G1", (1, 1, 8, 64, 1, 128)), ("B4_H8_G2", (4, 1, 8, 64, 2, 64)),
         ("B3_H16_G4", (3, 1, 16, 32, 4, 32)), ("B2_H16_G8", (2, 1, 16, 128, 8, 128)),
         ("B2_H4_P256_N64", (2, 1, 4, 256, 1, 64)), ("B2_H4_P32_N256", (2, 1, 4, 32, 2, 256)),
         ("B48_H8_tile64_occ2", (48, 1, 8, 64, 1, 128)),  # enough blocks for the 64-row tile at 2 blocks/SM
         # head dims that are not powers of two (issue 15): 16/32-row tiles dividing them
         ("B3_H8_P80_N128", (3, 1, 8, 80, 2, 128)), ("B2_H4_P96_N256", (2, 1, 4, 96, 1, 256)),
         ("B2_H4_P48_N64", (2, 1, 4, 48, 2, 64)), ("B64_H8_P80_N256", (64, 1, 8, 80, 8, 256)),
         # enough rows for ssd_step_rows_kernel (flat-row tiles spanning two heads): 64-row tiles at P80 N128, a
         # partial last tile (rows not a multiple of the tile: 67*3*80 rows in 32-row tiles; 45*7*96 in 64-row
         # tiles), one head per group and 7 groups
         ("B64_H8_P80_N128_rows64", (64, 1, 8, 80, 2, 128)), ("B67_H3_P80_N128_rows32_tail", (67, 1, 3, 80, 1, 128)),
         ("B45_H7_P96_N64_G7_rows64_tail", (45, 1, 7, 96, 7, 64)),
         # Falcon-H1-7B's decode (head dim 128, d_state 256, one group), fewer heads: 32-row tiles
         ("B64_H4_P128_N256_G1", (64, 1, 4, 128, 1, 256))]

# both settings of cutile.ROWS_POW2 (power-of-two head dims on the flat-row kernel, or on the per-head kernel), on
# the cases with enough rows for it
VARIANTS = {"pow2_rows": dict(ROWS_POW2=True), "pow2_per_head": dict(ROWS_POW2=False)}
VARIANT_CASES = [c for c in CASES if c[0] in ("B48_H8_tile64_occ2", "B64_H8_P80_N128_rows64",
                                              "B67_H3_P80_N128_rows32_tail", "B45_H7_P96_N64_G7_rows64_tail",
                                              "B64_H4_P128_N256_G1", "B64_H8_P80_N256")]


def _variant(monkeypatch, name: str, p: SSMScanProblem):
    """Set the module switches of VARIANTS[name] and say which launch ssm_step will take for ``p``."""
    from m2export.kernels.ssd_step import cutile as S

    for k, v in VARIANTS[name].items():
        monkeypatch.setattr(S, k, v)
    return S._plan(p, torch.device("cuda", torch.cuda.current_device()), True, (0.0, math.inf), True, True, True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_step(case, dtype):
    _check(SSMScanProblem(*case[1], dtype=dtype), seed=stable_seed(case[0], dtype))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", VARIANT_CASES, ids=[c[0] for c in VARIANT_CASES])
def test_step_rows_variants(case, variant, dtype, monkeypatch):
    """Power-of-two head dims on the flat-row or the per-head kernel (other head dims: the flat-row kernel either
    way), vs the float64 oracle: out of place, in place, and without state / D with a dt limit."""
    p = SSMScanProblem(*case[1], dtype=dtype)
    launch = _variant(monkeypatch, variant, p)
    pow2 = p.headdim & (p.headdim - 1) == 0
    if pow2 and not VARIANTS[variant].get("ROWS_POW2"):
        assert launch.name == "ssd_step_kernel"
    else:
        assert launch.name == "ssd_step_rows_kernel", (launch.name, launch.config)
    seed = stable_seed("variant", case[0], variant, dtype)
    _check(p, seed=seed)
    _check(p, seed=seed + 1, in_place=True)
    _check(p, seed=seed + 2, dt_limit=(0.05, 0.2), init_state=False, no_D=True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_step_in_place(dtype):
    _check(SSMScanProblem(4, 1, 8, 64, 2, 128, dtype=dtype), seed=31, in_place=True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_step_rows_in_place(dtype):
    _check(SSMScanProblem(64, 1, 8, 80, 2, 256, dtype=dtype), seed=34, in_place=True)


@pytest.mark.gpu
@gpu
def test_step_rows_dt_limit_no_state_no_D():
    _check(SSMScanProblem(64, 1, 8, 80, 4, 128, dtype="float16"), seed=35, dt_limit=(0.05, 0.2), init_state=False,
           no_D=True)


@pytest.mark.gpu
@gpu
def test_step_rows_non_contiguous_x_falls_back():
    """x a view with a row stride wider than headdim (not flat-viewable) takes the per-head kernel, read in place."""
    p = SSMScanProblem(64, 1, 8, 80, 2, 128, dtype="bfloat16")
    inp, step = _step_inputs(p, 36)
    ref = ssm_scan_recurrent(**inp)
    dev = {k: v.cuda() for k, v in step.items()}
    wide = torch.full((64, 8, 160), float("nan"), dtype=torch.bfloat16, device="cuda")
    wide[..., :80] = dev["x"]
    dev["x"] = wide[..., :80]
    res = ssm_step(**dev)
    assert_close("y", ref.y[:, 0], res.y.cpu(), rel=Y_REL["bfloat16"],
                 atol=MAXABS_Y["bfloat16"] * ref.y.abs().max().item())
    assert_close("state", ref.final_state, res.final_state.cpu(), rel=STATE_REL)


@pytest.mark.gpu
@gpu
def test_step_dt_limit_and_no_state():
    _check(SSMScanProblem(2, 1, 8, 64, 2, 64, dtype="bfloat16"), seed=32, dt_limit=(0.05, 0.2), init_state=False,
           no_D=True)


@pytest.mark.gpu
@gpu
def test_step_very_negative_decay():
    _check(SSMScanProblem(2, 1, 8, 64, 2, 64, dtype="float32"), seed=33, A_range=(16.0, 16.0), dt_value=5.0)


# ----------------------------------------------------------------------------- CPU: validation
def test_step_bad_headdim():
    _, step = _step_inputs(SSMScanProblem(1, 1, 2, 24, 1, 32), 0)
    with pytest.raises(ContractError, match="headdim: .*multiples of 16.*got 24"):
        ssm_step(**step, backend="cutile")


def test_step_bad_rank():
    _, step = _step_inputs(SSMScanProblem(1, 1, 2, 32, 1, 32), 0)
    step["x"] = step["x"][:, None]
    with pytest.raises(ContractError, match="x: expected a 3-D"):
        ssm_step(**step, backend="cutile")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error path")
def test_step_cutile_unavailable_on_cpu():
    _, step = _step_inputs(SSMScanProblem(1, 1, 2, 32, 1, 32), 0)
    with pytest.raises(BackendUnavailable):
        ssm_step(**step, backend="cutile")


def test_step_rows_tile_choice():
    """Flat-row tiles only where they beat the per-head kernel's power-of-two tile dividing headdim."""
    from m2export.kernels.ssd_step.cutile import choose_block_p, choose_block_rows

    assert choose_block_rows(64, 128, 80, 128) == 64 and choose_block_p(64, 128, 80, 128) == 16
    assert choose_block_rows(64, 128, 80, 256) == 32
    assert choose_block_rows(1, 128, 80, 128) == 32  # 320 tiles of 32 rows: >= 2 per SM
    assert choose_block_rows(64, 24, 128, 256) is None  # a power of two: whole 32-row tiles already
    assert choose_block_rows(64, 24, 128, 256, pow2=True) == 32  # ... the same tile on the flat-row kernel
    assert choose_block_rows(3, 8, 80, 128) is None  # too few rows for more than 8-row tiles


def test_step_torch_backend_in_place():
    inp, step = _step_inputs(SSMScanProblem(2, 1, 4, 32, 2, 32), 1)
    ref = ssm_scan_recurrent(**inp)
    st = step["ssm_state"]
    res = ssm_step(**step, backend="torch", state_out=st)
    assert res.final_state is st
    assert_close("state", ref.final_state, st, rel=1e-6)


# ------------------------------------------------------------- dt*A overflowing float32 to -inf
def _overflowing_step(p: SSMScanProblem, seed: int):
    """(inputs of the seqlen-1 scan, the step's arguments) with dt*A -inf in float32 on head 0 (A -1e30, dt 1e10:
    tests.helpers.overflowing_decay_inputs) and an initial state."""
    from tests.helpers import overflowing_decay_inputs

    inp = overflowing_decay_inputs(p, seed=seed)
    assert torch.isinf(inp["dt"].float()[:, 0, 0] * inp["A"][0]).all()
    step = dict(x=inp["x"][:, 0], dt=inp["dt"][:, 0], A=inp["A"], B=inp["B"][:, 0], C=inp["C"][:, 0], D=inp["D"],
                dt_bias=inp["dt_bias"], ssm_state=inp["initial_state"])
    return inp, step


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_step_reference_decay_overflowing_to_minus_inf(dtype):
    """CPU: ssm_step_ref where dt*A is -inf in float32: exp(-inf) = 0 times a finite state, the float64 decay to
    exactly 0, never NaN."""
    from m2export.kernels.ssd_step.naive import ssm_step_ref
    from tests.helpers import assert_overflow_close

    inp, step = _overflowing_step(SSMScanProblem(3, 1, 4, 16, 2, 16, dtype=dtype), stable_seed("overflow-step", dtype))
    ref = ssm_scan_recurrent(**inp)
    out = ssm_step_ref(**step)
    assert_overflow_close(ref, out.y[:, None], out.final_state, rel=Y_REL[dtype])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case, variant", [(c, v) for c in CASES if c[0] in ("B4_H8_G2", "B64_H8_P80_N128_rows64")
                                           for v in (None, *VARIANTS)],
                         ids=[f"{c}-{v}" for c in ("B4_H8_G2", "B64_H8_P80_N128_rows64") for v in ("default", *VARIANTS)])
def test_step_decay_overflowing_to_minus_inf(case, variant, dtype, monkeypatch):
    """dt*A -inf in float32 on head 0 (A -1e30, dt 1e10): the head-tile and the flat-row kernels (and the latter's
    VARIANTS) vs the float64 oracle, NaN-poisoned y and state_out. The CPU reading expects no NaN (exp(-inf) = 0
    times a finite state)."""
    from tests.helpers import assert_overflow_close

    p = SSMScanProblem(*case[1], dtype=dtype)
    if variant is not None:
        _variant(monkeypatch, variant, p)
    inp, step = _overflowing_step(p, stable_seed("overflow-step-gpu", case[0], dtype))
    ref = ssm_scan_recurrent(**inp)
    dev = {k: (v.cuda() if v is not None else None) for k, v in step.items()}
    y = torch.full(tuple(step["x"].shape), float("nan"), dtype=TORCH_DTYPES[p.dtype], device="cuda")
    st_out = torch.full(p.shape_of("final_state"), float("nan"), dtype=torch.float32, device="cuda")
    ssm_step(**dev, out=y, state_out=st_out)
    torch.cuda.synchronize()
    assert_overflow_close(ref, y.cpu()[:, None], st_out.cpu(), rel=Y_REL[dtype])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ("B4_H8_G2", "B64_H8_P80_N128_rows64")],
                         ids=["B4_H8_G2", "B64_H8_P80_N128_rows64"])
def test_step_nan_dt_stays_nan(case, dtype):
    """dt NaN at one (batch, head): the head-tile and the flat-row kernels give NaN y and state there (the float64
    oracle's), the other (batch, head)s match it. The step-size clamp used to drop the NaN (a finite answer)."""
    from tests.helpers import assert_nan_dt_propagated, nan_dt_inputs

    p = SSMScanProblem(*case[1], dtype=dtype)
    at = (p.batch - 1, 0, 3)
    inp = nan_dt_inputs(p, seed=stable_seed("nan-dt-step", case[0], dtype), at=at)
    ref = ssm_scan_recurrent(**inp)
    step = dict(x=inp["x"][:, 0], dt=inp["dt"][:, 0], A=inp["A"], B=inp["B"][:, 0], C=inp["C"][:, 0], D=inp["D"],
                dt_bias=inp["dt_bias"], ssm_state=inp["initial_state"])
    dev = {k: (v.cuda() if v is not None else None) for k, v in step.items()}
    y = torch.full(tuple(step["x"].shape), float("nan"), dtype=TORCH_DTYPES[p.dtype], device="cuda")
    st_out = torch.full(p.shape_of("final_state"), float("nan"), dtype=torch.float32, device="cuda")
    ssm_step(**dev, out=y, state_out=st_out)
    torch.cuda.synchronize()
    assert_nan_dt_propagated(ref, y.cpu()[:, None], st_out.cpu(), at=at, finite_before=0, rel=Y_REL[dtype])
