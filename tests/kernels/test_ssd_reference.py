"""Chunked SSD reference (naive.ssm_scan_chunked) vs the float64 token-by-token oracle.

Error bounds (rel-L2 of y and final_state vs the oracle evaluated on the same, already-rounded inputs):
fp32 1e-5; fp16 2e-3 and bf16 1e-2 on y (only the final cast of y to the input dtype rounds: fp16 has
2^-11, bf16 2^-8 relative precision); final_state is fp32 in every case: 1e-5.
"""

from __future__ import annotations


import pytest
import torch

from m2export.contract import SSMScanProblem
from m2export.errors import ContractError
from m2export.kernels.ssd.naive import ssm_scan_chunked, ssm_scan_recurrent
from m2export.kernels.ssd_step.naive import ssm_step_ref
from tests.helpers import assert_close, large_decay_inputs, make_inputs, stable_seed

Y_BOUND = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
STATE_BOUND = 1e-5

CASES = [  # id, (batch, seqlen, nheads, headdim, ngroups, d_state), chunk_size
    ("L1", (1, 1, 4, 8, 1, 16), 16),
    ("L_lt_chunk", (2, 5, 4, 8, 1, 16), 16),
    ("L_eq_chunk", (1, 16, 4, 8, 1, 16), 16),
    ("L_k_chunk_plus_1", (1, 33, 4, 8, 1, 16), 16),
    ("several_chunks", (1, 100, 4, 8, 1, 8), 16),
    ("B3", (3, 20, 4, 8, 1, 8), 8),
    ("G2_H8", (2, 37, 8, 8, 2, 16), 16),
    ("G4_H16", (1, 50, 16, 4, 4, 8), 16),
    ("chunk4_L8", (2, 8, 4, 8, 2, 8), 4),
]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("init_state", [False, True], ids=["zero_state", "init_state"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_chunked_matches_oracle(case, init_state, dtype):
    _, dims, chunk = case
    p = SSMScanProblem(*dims, dtype=dtype)
    inp = make_inputs(p, seed=stable_seed(case[0], init_state, dtype), init_state=init_state)
    ref = ssm_scan_recurrent(**inp)
    out = ssm_scan_chunked(**inp, chunk_size=chunk)
    assert out.y.dtype == inp["x"].dtype and out.final_state.dtype == torch.float32
    assert_close("y", ref.y, out.y, rel=Y_BOUND[dtype])
    assert_close("final_state", ref.final_state, out.final_state, rel=STATE_BOUND)


#: issue 16: fp32 segment sums accurate to the segment's own terms (old cs_i - cs_j: y 3e-5 .. 1e-4 here)
LARGE_DECAY_BOUND = 5e-6


@pytest.mark.parametrize("init_state", [False, True], ids=["zero_state", "init_state"])
@pytest.mark.parametrize("chunk_size", [256, 100])
def test_chunked_large_decay_sums(chunk_size, init_state):
    """dt*A summing to -4,000 per 256 tokens, small steps between spikes (the 130m-with-HF-init regime)."""
    p = SSMScanProblem(2, 512, 8, 16, 2, 16)
    inp = large_decay_inputs(p, seed=chunk_size + init_state)
    if not init_state:
        inp["initial_state"] = None
    ref = ssm_scan_recurrent(**inp)
    out = ssm_scan_chunked(**inp, chunk_size=chunk_size)
    assert_close("y", ref.y, out.y, rel=LARGE_DECAY_BOUND)
    assert_close("final_state", ref.final_state, out.final_state, rel=LARGE_DECAY_BOUND)


def test_split_scan_equals_unsplit_on_large_decay_sums():
    """A scan split at 300 of 512 through the state equals the unsplit one (chunk boundaries differ)."""
    p = SSMScanProblem(1, 512, 8, 16, 2, 16)
    inp = large_decay_inputs(p, seed=11)
    full = ssm_scan_chunked(**inp, chunk_size=256)
    first = ssm_scan_chunked(**{**inp, **{k: inp[k][:, :300] for k in ("x", "dt", "B", "C")}}, chunk_size=256)
    second = ssm_scan_chunked(**{**inp, **{k: inp[k][:, 300:] for k in ("x", "dt", "B", "C")},
                                 "initial_state": first.final_state}, chunk_size=256)
    assert_close("y after the split", full.y[:, 300:], second.y, rel=LARGE_DECAY_BOUND)
    assert_close("final_state", full.final_state, second.final_state, rel=LARGE_DECAY_BOUND)


def test_chunk_size_changes_order_only():
    p = SSMScanProblem(2, 45, 8, 8, 2, 16)
    inp = make_inputs(p, seed=3)
    outs = [ssm_scan_chunked(**inp, chunk_size=c) for c in (1, 4, 16, 64)]
    for o in outs[1:]:
        assert_close("y", outs[0].y, o.y, rel=1e-5)
        assert_close("final_state", outs[0].final_state, o.final_state, rel=1e-5)


def test_dt_limit_is_applied():
    p = SSMScanProblem(1, 24, 4, 8, 1, 8)
    inp = make_inputs(p, seed=4)
    limit = (0.05, 0.2)
    ref = ssm_scan_recurrent(**inp, dt_limit=limit)
    out = ssm_scan_chunked(**inp, chunk_size=8, dt_limit=limit)
    assert_close("y", ref.y, out.y, rel=1e-5)
    unclamped = ssm_scan_chunked(**inp, chunk_size=8)
    assert (unclamped.y - out.y).abs().max() > 1e-3, "dt_limit had no effect"


def test_very_negative_decay_no_nan():
    """dt = 5 after softplus and A = -16: dt*A = -80 per token; exp underflows to 0 but never NaN."""
    p = SSMScanProblem(2, 40, 4, 8, 2, 8)
    inp = make_inputs(p, seed=5)
    inp["dt"] = torch.full_like(inp["dt"], 5.0)
    inp["dt_bias"] = torch.zeros(4)
    inp["A"] = torch.full((4,), -16.0)
    ref = ssm_scan_recurrent(**inp, dt_softplus=False)
    out = ssm_scan_chunked(**inp, chunk_size=16, dt_softplus=False)
    assert torch.isfinite(out.y).all() and torch.isfinite(out.final_state).all()
    assert_close("y", ref.y, out.y, rel=1e-5)
    assert_close("final_state", ref.final_state, out.final_state, rel=1e-5)


def test_state_propagates_across_chunks():
    """chunk 4, L 8: the output of chunk 2 must depend on the input of chunk 1."""
    p = SSMScanProblem(1, 8, 2, 4, 1, 4)
    inp = make_inputs(p, seed=6, init_state=False, A_range=(0.01, 0.02))
    base = ssm_scan_chunked(**inp, chunk_size=4).y
    inp["x"] = inp["x"].clone()
    inp["x"][:, 0] += 1.0
    moved = ssm_scan_chunked(**inp, chunk_size=4).y
    assert (moved[:, 4:] - base[:, 4:]).abs().max() > 1e-3
    ref = ssm_scan_recurrent(**inp)
    assert_close("y", ref.y, moved, rel=1e-5)


def test_split_sequence_equals_whole():
    """scan(L1) then scan(L2, initial_state=final) == scan(L1 + L2)."""
    p = SSMScanProblem(2, 30, 4, 8, 2, 8)
    inp = make_inputs(p, seed=7)
    whole = ssm_scan_chunked(**inp, chunk_size=8)
    a = {k: (v[:, :13] if k in ("x", "dt", "B", "C") else v) for k, v in inp.items()}
    b = {k: (v[:, 13:] if k in ("x", "dt", "B", "C") else v) for k, v in inp.items()}
    first = ssm_scan_chunked(**a, chunk_size=8)
    b["initial_state"] = first.final_state
    second = ssm_scan_chunked(**b, chunk_size=8)
    assert_close("y", whole.y, torch.cat([first.y, second.y], 1), rel=1e-5)
    assert_close("final_state", whole.final_state, second.final_state, rel=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_step_ref_matches_scan_of_length_one(dtype):
    p = SSMScanProblem(3, 1, 8, 8, 2, 16, dtype=dtype)
    inp = make_inputs(p, seed=8)
    ref = ssm_scan_recurrent(**inp, dt_limit=(0.0, 0.3))
    out = ssm_step_ref(inp["x"][:, 0], inp["dt"][:, 0], inp["A"], inp["B"][:, 0], inp["C"][:, 0], inp["D"],
                       inp["dt_bias"], inp["initial_state"], dt_limit=(0.0, 0.3))
    assert_close("y", ref.y[:, 0], out.y, rel=Y_BOUND[dtype])
    assert_close("ssm_state", ref.final_state, out.final_state, rel=STATE_BOUND)


def test_contract_errors_name_the_argument():
    p = SSMScanProblem(2, 10, 6, 8, 2, 16)
    inp = make_inputs(p, seed=9)
    g4 = inp["B"][:, :, :1].expand(2, 10, 4, 16)  # ngroups 4 does not divide nheads 6
    bad = dict(inp, B=g4, C=g4)
    with pytest.raises(ContractError, match=r"nheads % ngroups"):
        ssm_scan_chunked(**bad)
    with pytest.raises(ContractError, match=r"^C: expected .*d_state=16"):
        ssm_scan_chunked(**dict(inp, C=inp["C"][..., :8]))
    with pytest.raises(ContractError, match=r"^dt: expected dtype float32"):
        ssm_scan_chunked(**dict(inp, dt=inp["dt"].half()))
    with pytest.raises(ContractError, match=r"^initial_state: expected dtype float32"):
        ssm_scan_chunked(**dict(inp, initial_state=inp["initial_state"].double()))
    with pytest.raises(ContractError, match="chunk_size"):
        ssm_scan_chunked(**inp, chunk_size=0)
    with pytest.raises(ContractError, match="dt_limit"):
        ssm_scan_chunked(**inp, dt_limit=(0.5, 0.1))


def test_negative_step_without_softplus_is_clamped_and_chunk_independent():
    """dt_softplus=False with dt + dt_bias < 0: the step is clamped at dt_min = 0 in every implementation."""
    p = SSMScanProblem(1, 3, 1, 1, 1, 1)
    inp = dict(x=torch.ones(1, 3, 1, 1), dt=torch.full((1, 3, 1), -0.5), A=torch.tensor([-1.0]),
               B=torch.ones(1, 3, 1, 1), C=torch.ones(1, 3, 1, 1))
    ref = ssm_scan_recurrent(**inp, dt_softplus=False)
    assert torch.equal(ref.y, torch.zeros_like(ref.y))
    for chunk in (1, 2, 256):
        assert_close(f"y(chunk={chunk})", ref.y, ssm_scan_chunked(**inp, dt_softplus=False, chunk_size=chunk).y,
                     rel=1e-6, atol=1e-7)
    del p


def test_growing_decay_is_rejected():
    p = SSMScanProblem(1, 4, 2, 4, 1, 4)
    inp = make_inputs(p, seed=10)
    inp["A"] = torch.tensor([-1.0, 0.5])
    for fn in (ssm_scan_recurrent, ssm_scan_chunked):
        with pytest.raises(ContractError, match=r"A: expected A <= 0"):
            fn(**inp)


def test_torch_backend_checks_out_buffers_and_dt_limit():
    from m2export.kernels.ssd import ssm_scan

    p = SSMScanProblem(2, 5, 4, 8, 2, 16)
    inp = make_inputs(p, seed=11)
    with pytest.raises(ContractError, match=r"^out: expected a contiguous torch.float32 tensor of shape"):
        ssm_scan(**inp, backend="torch", out=torch.empty(3, 2, 5, 4, 8))
    with pytest.raises(ContractError, match=r"^final_state_out: expected a contiguous torch.float32"):
        ssm_scan(**inp, backend="torch", final_state_out=torch.empty(p.shape_of("final_state"), dtype=torch.half))
    with pytest.raises(ContractError, match=r"^dt_limit: expected \(dt_min, dt_max\)"):
        ssm_scan(**inp, backend="torch", dt_limit=(0.1,))
    y = torch.full(p.shape_of("y"), float("nan"))
    res = ssm_scan(**inp, backend="torch", out=y)
    assert res.y is y and torch.isfinite(y).all()
