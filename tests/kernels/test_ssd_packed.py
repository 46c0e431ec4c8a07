"""Packed variable-length prefill (``cu_seqlens``, issue 14): contract, chunked reference and cuTile vs the oracle.

The oracle (:func:`ssm_scan_packed_recurrent`) scans each sequence alone in float64; the chunked reference
runs chunks that straddle sequence boundaries (a boundary inside a chunk and one on a chunk edge in every
multi-sequence case), so any state leaking across a boundary shows up as an error. Per-sequence initial
states, every dtype, empty sequences. GPU tests (marked ``gpu``) run the cuTile path with NaN-poisoned outputs.
"""

from __future__ import annotations

import pytest
import torch

from m2export import contract
from m2export.contract import SSMScanProblem
from m2export.errors import ContractError
from m2export.kernels.ssd import ssm_scan
from m2export.kernels.ssd.packed import ssm_scan_packed_chunked, ssm_scan_packed_recurrent
from tests.helpers import SSD_STATE_REL, SSD_Y_REL, assert_close, count_unwritten, large_decay_inputs, make_inputs, \
    packed_large_decay_case, poison_, requires_cutile, stable_seed
from tests.plugins.fakes import Expr

# (id, sequence lengths); chunk 64: 63|64 puts a boundary inside chunk 0, 64 one on a chunk edge
PACKS = [
    ("one_L1", [1]),
    ("one_L500", [500]),
    ("two_63_65", [63, 65]),
    ("two_64_64_edge", [64, 64]),
    ("seven", [1, 63, 64, 65, 500, 2048, 7]),
    ("with_empty", [5, 0, 70]),
    ("tiny", [1, 2, 1, 0, 3, 1, 64, 1, 0, 30, 0]),  # many sequences in one chunk, empty ones inside and at the end
]
REF_REL = {"float32": 2e-5, "float16": 5e-3, "bfloat16": 2e-2}


def _packed_inputs(lengths, dtype, *, seed, H=4, P=32, G=2, N=32, init=True):
    T = sum(lengths)
    p = SSMScanProblem(1, T, H, P, G, N, dtype=dtype)
    inp = make_inputs(p, seed=seed, init_state=False)
    g = torch.Generator().manual_seed(seed + 1)
    inp["initial_state"] = torch.randn(len(lengths), H, P, N, generator=g) if init else None
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
    return p, inp, cu


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("pack", PACKS, ids=[c[0] for c in PACKS])
def test_chunked_reference_matches_the_oracle(pack, dtype):
    name, lengths = pack
    if dtype != "float32" and sum(lengths) > 1000:
        pytest.skip("one long pack per half dtype is enough (the seven-sequence pack runs in fp32)")
    p, inp, cu = _packed_inputs(lengths, dtype, seed=stable_seed(name, dtype))
    ref = ssm_scan_packed_recurrent(**inp, cu_seqlens=cu)
    for chunk in (64, 256):
        out = ssm_scan_packed_chunked(**inp, cu_seqlens=cu, chunk_size=chunk)
        assert out.final_state.shape == (len(lengths), p.nheads, p.headdim, p.d_state)
        assert_close(f"y chunk {chunk}", ref.y, out.y, rel=REF_REL[dtype])
        assert_close(f"final_state chunk {chunk}", ref.final_state, out.final_state, rel=REF_REL[dtype])


def test_chunked_reference_large_decay_sums():
    """dt*A summing to -4,000 per 256 tokens (issue 16), boundaries inside chunks: segment sums from their own
    terms, 5e-6 of the oracle (as cumsum differences: 3e-5 .. 1e-4)."""
    inp, cu = packed_large_decay_case()
    ref = ssm_scan_packed_recurrent(**inp, cu_seqlens=cu)
    out = ssm_scan_packed_chunked(**inp, cu_seqlens=cu, chunk_size=256)
    assert_close("y", ref.y, out.y, rel=5e-6)
    assert_close("final_state", ref.final_state, out.final_state, rel=5e-6)


def test_oracle_is_each_sequence_alone_and_empty_keeps_its_state():
    from m2export.kernels.ssd.naive import ssm_scan_recurrent

    p, inp, cu = _packed_inputs([3, 0, 5], "float32", seed=4)
    out = ssm_scan_packed_recurrent(**inp, cu_seqlens=cu)
    alone = ssm_scan_recurrent(inp["x"][:, 3:], inp["dt"][:, 3:], inp["A"], inp["B"][:, 3:], inp["C"][:, 3:],
                               inp["D"], inp["dt_bias"], inp["initial_state"][2:3])
    assert torch.equal(out.y[:, 3:], alone.y) and torch.equal(out.final_state[2:], alone.final_state)
    assert torch.equal(out.final_state[1], inp["initial_state"][1].double())


def test_no_leak_across_a_boundary_inside_a_chunk():
    """A huge state in sequence 0 must not reach sequence 1, which starts mid-chunk (chunk 64, boundary 40)."""
    p, inp, cu = _packed_inputs([40, 30], "float32", seed=5)
    inp["initial_state"][0] *= 1e6
    inp["A"] = torch.full_like(inp["A"], -1e-3)  # slow decay: a leak would dominate sequence 1
    ref = ssm_scan_packed_recurrent(**inp, cu_seqlens=cu)
    out = ssm_scan_packed_chunked(**inp, cu_seqlens=cu, chunk_size=64)
    assert_close("y of sequence 1", ref.y[:, 40:], out.y[:, 40:], rel=2e-5)
    assert_close("final_state of sequence 1", ref.final_state[1], out.final_state[1], rel=2e-5)


def test_ssm_scan_torch_backend_packed():
    p, inp, cu = _packed_inputs([63, 65], "float32", seed=6)
    ref = ssm_scan_packed_recurrent(**inp, cu_seqlens=cu)
    y = torch.empty(p.shape_of("y"))
    fs = torch.empty(2, p.nheads, p.headdim, p.d_state)
    res = ssm_scan(**inp, cu_seqlens=cu, backend="torch", chunk_size=64, out=y, final_state_out=fs)
    assert res.y is y and res.final_state is fs
    assert_close("y", ref.y, y, rel=2e-5)
    assert_close("final_state", ref.final_state, fs, rel=2e-5)


@pytest.mark.parametrize("change, msg", [
    (lambda inp, cu: ({k: (v.expand(2, *v.shape[1:]) if k in ("x", "dt", "B", "C") else v)
                       for k, v in inp.items()}, cu), "expects batch 1"),
    (lambda inp, cu: (inp, cu.long()), "cu_seqlens: expected dtype int32"),
    (lambda inp, cu: (inp, cu[None]), "1-D tensor"),
    (lambda inp, cu: (inp, cu[:1]), "nseq \\+ 1 >= 2"),
    (lambda inp, cu: (dict(inp, initial_state=inp["initial_state"][:1]), cu), "initial_state: expected float32 "
                                                                            "\\(nseq"),
    (lambda inp, cu: (dict(inp, initial_state=None), torch.tensor([0, 70, 60, 128], dtype=torch.int32)),
     "non-decreasing"),
    (lambda inp, cu: (inp, torch.tensor([0, 64, 127], dtype=torch.int32)), "seqlen=128"),
])
def test_packed_contract_errors(change, msg):
    p, inp, cu = _packed_inputs([63, 65], "float32", seed=7)
    inp, cu = change(inp, cu)
    with pytest.raises(ContractError, match=msg):
        ssm_scan(**inp, cu_seqlens=cu, backend="torch")


def test_packed_shape_rule_ints_and_shape_exprs():
    y, fs = contract.packed_output_shapes((1, 300, 8, 64), (1, 300, 2, 128), (4,))
    assert y == (1, 300, 8, 64) and fs == (3, 8, 64, 128)
    sy, sfs = contract.packed_output_shapes(tuple(Expr(v) for v in (1, "T", 8, 64)),
                                            tuple(Expr(v) for v in (1, "T", 2, 128)), (Expr("nseq1"),))
    assert sy[1] == Expr("T") and sfs[0] == Expr("(nseq1-1)") and sfs[1:] == (Expr(8), Expr(64), Expr(128))


# ----------------------------------------------------------------------------- GPU: cuTile
@pytest.mark.gpu
@requires_cutile
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("pack", PACKS, ids=[c[0] for c in PACKS])
def test_cutile_packed_matches_the_oracle(pack, dtype):
    """ssm_scan's packed path (routed to the work-item launch group, cu_seqlens on the device) and
    ssm_scan_packed_cutile called directly with host offsets (its default plan), both against one oracle run."""
    name, lengths = pack
    p, inp, cu = _packed_inputs(lengths, dtype, seed=stable_seed("gpu", name, dtype), H=8, P=64, G=2, N=128)
    ref = ssm_scan_packed_recurrent(**inp, cu_seqlens=cu)
    dev = {k: (v.cuda() if v is not None else None) for k, v in inp.items()}
    y = poison_(torch.empty(p.shape_of("y"), dtype=dev["x"].dtype, device="cuda"))
    fs = poison_(torch.empty(len(lengths), p.nheads, p.headdim, p.d_state, device="cuda"))
    ssm_scan(**dev, cu_seqlens=cu.cuda(), out=y, final_state_out=fs)
    torch.cuda.synchronize()
    assert count_unwritten(y).item() == 0 and count_unwritten(fs).item() == 0
    assert_close("y", ref.y, y.cpu(), rel=SSD_Y_REL[dtype])
    assert_close("final_state", ref.final_state, fs.cpu(), rel=SSD_STATE_REL[dtype])
    _run_packed_plans(inp, cu, ref, dtype, [None], rel_y=SSD_Y_REL[dtype], rel_state=SSD_STATE_REL[dtype])


def _run_packed_plans(inp, cu, ref, dtype, configs, *, rel_y, rel_state):
    """Run the packed launch group (cutile_packed.ssm_scan_packed_cutile) with each config (None: its default plan) on
    NaN-poisoned outputs and compare with the oracle ``ref``; returns the last run's (y, final_state)."""
    import math

    from m2export.contract import validate_packed
    from m2export.kernels.ssd.cutile_packed import ssm_scan_packed_cutile

    dev = {k: (v.cuda() if v is not None else None) for k, v in inp.items()}
    p, nseq = validate_packed(**dev, cu_seqlens=cu)
    offsets = cu.tolist()
    for cfg in configs:
        y = poison_(torch.empty(p.shape_of("y"), dtype=dev["x"].dtype, device="cuda"))
        fs = poison_(torch.empty(nseq, p.nheads, p.headdim, p.d_state, device="cuda"))
        ssm_scan_packed_cutile(*(dev[k] for k in contract.INPUT_NAMES), offsets, problem=p, dt_softplus=True,
                               dt_limit=(0.0, math.inf), out=y, final_state_out=fs, config=cfg)
        torch.cuda.synchronize()
        assert count_unwritten(y).item() == 0 and count_unwritten(fs).item() == 0, cfg
        assert_close(f"y ({cfg})", ref.y, y.cpu(), rel=rel_y)
        assert_close(f"final_state ({cfg})", ref.final_state, fs.cpu(), rel=rel_state)
    return y.cpu(), fs.cpu()


@pytest.mark.gpu
@requires_cutile
@pytest.mark.parametrize("dtype,init", [("float32", True), ("bfloat16", False), ("float16", True)])
def test_cutile_packed_every_plan(dtype, init):
    """The seven-sequence pack through plans whose work items are whole sequences (nseg 1) or segments of them
    (pass 1 and the fold: nseg 2, 5 and one chunk per item), chunk 32 and 64, both state layouts; with and
    without initial states."""
    from m2export.kernels.ssd.plan import choose_config

    lengths = [1, 63, 64, 65, 500, 2048, 7]
    p, inp, cu = _packed_inputs(lengths, dtype, seed=stable_seed("plans", dtype, init), H=4, P=64, G=2, N=64,
                                init=init)
    ref = ssm_scan_packed_recurrent(**inp, cu_seqlens=cu)
    base = dict(dt_pre=True, merge_tail=False)
    configs = [choose_config(p, nseg=1, **base), choose_config(p, nseg=2, **base),
               choose_config(p, nseg=5, chunk=32, state_t=False, **base),
               choose_config(p, nseg=-(-sum(lengths) // 64), chunk=64, **base)]
    _run_packed_plans(inp, cu, ref, dtype, configs, rel_y=SSD_Y_REL[dtype], rel_state=SSD_STATE_REL[dtype])


@pytest.mark.gpu
@requires_cutile
def test_cutile_packed_no_leak_and_large_decay_sums():
    """A huge state in sequence 0 must not reach sequence 1 (boundary inside chunk 0, slow decay); and dt*A summing
    to -4,000 per 64 tokens with boundaries inside chunks: fp32 within 5e-6 of the oracle, single and split plans."""
    from m2export.kernels.ssd.plan import choose_config

    p, inp, cu = _packed_inputs([40, 30, 90], "float32", seed=8, H=4, P=64, G=1, N=64)
    inp["initial_state"][0] *= 1e6
    inp["A"] = torch.full_like(inp["A"], -1e-3)
    ref = ssm_scan_packed_recurrent(**inp, cu_seqlens=cu)
    cfgs = [choose_config(p, nseg=n, dt_pre=True, merge_tail=False) for n in (3, 1)]
    y, fs = _run_packed_plans(inp, cu, ref, "float32", cfgs, rel_y=2e-4, rel_state=2e-4)
    # the leak check proper: sequence 1's rows on their own (sequence 0's scale would hide an error there)
    assert_close("y of sequence 1", ref.y[:, 40:70], y[:, 40:70], rel=2e-4)
    assert_close("final_state of sequence 1", ref.final_state[1], fs[1], rel=2e-4)

    lengths = [100, 300, 112]
    p = SSMScanProblem(1, sum(lengths), 8, 64, 2, 64, dtype="float32")
    inp = large_decay_inputs(p, seed=9, per=64)
    inp["initial_state"] = torch.randn(3, 8, 64, 64, generator=torch.Generator().manual_seed(10))
    cu = torch.tensor([0, 100, 400, 512], dtype=torch.int32)
    ref = ssm_scan_packed_recurrent(**inp, cu_seqlens=cu)
    cfgs = [choose_config(p, nseg=n, dt_pre=True, merge_tail=False) for n in (1, 4)]
    _run_packed_plans(inp, cu, ref, "float32", cfgs, rel_y=5e-6, rel_state=5e-6)


@pytest.mark.gpu
@requires_cutile
def test_cutile_packed_is_one_launch_group(monkeypatch):
    """Seven sequences through ssm_scan (cu_seqlens) cost the packed plan's launches (pre-pass, pass 1, scan), not
    one group per sequence."""
    import m2export.kernels.ssd.cutile_packed as cut
    from m2export.contract import validate_packed

    p, inp, cu = _packed_inputs([1, 63, 64, 65, 500, 2048, 7], "bfloat16", seed=11, H=8, P=64, G=2, N=128)
    dev = {k: v.cuda() for k, v in inp.items()}
    p, nseq = validate_packed(**dev, cu_seqlens=cu)

    def run():
        ssm_scan(**dev, cu_seqlens=cu)

    run()  # compile first
    seen = []
    real = cut.ct.launch
    monkeypatch.setattr(cut.ct, "launch", lambda stream, grid, kernel, args: (seen.append(kernel), real(
        stream, grid, kernel, args))[1])
    run()
    torch.cuda.synchronize()
    assert 2 <= len(seen) <= 3, seen


@pytest.mark.gpu
@requires_cutile
def test_cutile_packed_reads_cu_seqlens_on_the_launch_stream():
    """cu_seqlens written on the launch stream (a non-blocking stream, as TensorRT's enqueue stream can be) after
    a long sleep there: the packed path must read it on that stream, after the write. Read on the current stream
    it would see the stale zeros (a ContractError: last offset 0) or, worse, run on stale offsets."""
    lengths = [63, 65, 7]
    p, inp, cu = _packed_inputs(lengths, "float32", seed=stable_seed("gpu-stream", "cu"), H=4, P=64, G=2, N=64)
    ref = ssm_scan_packed_recurrent(**inp, cu_seqlens=cu)
    dev = {k: (v.cuda() if v is not None else None) for k, v in inp.items()}
    good = cu.cuda()
    torch.cuda.synchronize()
    for _ in range(3):
        side = torch.cuda.Stream()
        stale = torch.zeros_like(good)
        y = poison_(torch.empty(p.shape_of("y"), dtype=dev["x"].dtype, device="cuda"))
        fs = poison_(torch.empty(len(lengths), p.nheads, p.headdim, p.d_state, device="cuda"))
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on this stream only
            stale.copy_(good)
        ssm_scan(**dev, cu_seqlens=stale, out=y, final_state_out=fs, stream=side)
        side.synchronize()
        assert count_unwritten(y).item() == 0 and count_unwritten(fs).item() == 0
        assert_close("y", ref.y, y.cpu(), rel=SSD_Y_REL["float32"])
        assert_close("final_state", ref.final_state, fs.cpu(), rel=SSD_STATE_REL["float32"])


# ------------------------------------------------------------- dt*A overflowing float32 to -inf
#: sequence lengths around chunk 32: one token, < chunk, k*chunk + 1, boundaries inside chunks
OVERFLOW_PACK = [20, 1, 37, 2 * 32 + 1]


def _overflowing_packed_inputs(dtype, *, seed, **kw):
    """_packed_inputs of OVERFLOW_PACK with dt*A -inf in float32 on head 0 (A -1e30, dt 1e10 on every third packed
    token; float16: A -1e37, dt 100, tests.helpers.FP16_OVERFLOW; tests.helpers.overflowing_decay_inputs)."""
    from tests.helpers import FP16_OVERFLOW

    a0, spike_dt = FP16_OVERFLOW if dtype == "float16" else (-1e30, 1e10)
    p, inp, cu = _packed_inputs(OVERFLOW_PACK, dtype, seed=seed, **kw)
    inp["A"][0] = a0
    inp["dt"][:, ::3, 0] = spike_dt
    assert torch.isinf(inp["dt"].float()[:, ::3, 0] * inp["A"][0]).all()
    return p, inp, cu


def test_chunked_reference_decay_overflowing_to_minus_inf():
    """CPU: ssm_scan_packed_chunked where dt*A is -inf in float32 is the float64 oracle's decay to exactly 0, never
    NaN (masks before exp and before its segment sums' cumsum; decays from a sequence start are gathers, not
    differences of cumulative sums)."""
    from tests.helpers import assert_overflow_close

    _, inp, cu = _overflowing_packed_inputs("float32", seed=stable_seed("overflow-packed-ref"))
    ref = ssm_scan_packed_recurrent(**inp, cu_seqlens=cu)
    out = ssm_scan_packed_chunked(**inp, cu_seqlens=cu, chunk_size=32)
    assert_overflow_close(ref, out.y, out.final_state, rel=2e-5)


@pytest.mark.gpu
@requires_cutile
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_cutile_packed_decay_overflowing_to_minus_inf(dtype):
    """dt*A -inf in float32 on head 0 (A -1e30, dt 1e10 on every third packed token; float16: A -1e37, dt 100):
    ssm_scan's packed path and the packed launch group (default plan; nseg 2 and one chunk per item at chunk 32, pass 1
    and the fold) vs the float64 oracle, initial states, NaN-poisoned outputs. Without the kernels' LOG2_STEP_FLOOR the
    double-float cumsum gives NaN (benchmarks/NOTES_ssd.md, "dt*A at -inf")."""
    import math

    from m2export.contract import validate_packed
    from m2export.kernels.ssd.cutile_packed import ssm_scan_packed_cutile
    from m2export.kernels.ssd.plan import choose_config
    from tests.helpers import assert_overflow_close

    p, inp, cu = _overflowing_packed_inputs(dtype, seed=stable_seed("overflow-packed", dtype), H=8, P=64, N=64)
    ref = ssm_scan_packed_recurrent(**inp, cu_seqlens=cu)
    dev = {k: (v.cuda() if v is not None else None) for k, v in inp.items()}
    nseq = len(OVERFLOW_PACK)
    base = dict(chunk=32, dt_pre=True, merge_tail=False)
    configs = ["ssm_scan", None, choose_config(p, nseg=2, **base),
               choose_config(p, nseg=-(-sum(OVERFLOW_PACK) // 32), **base)]
    pp, _ = validate_packed(**dev, cu_seqlens=cu)
    for cfg in configs:
        y = poison_(torch.empty(p.shape_of("y"), dtype=dev["x"].dtype, device="cuda"))
        fs = poison_(torch.empty(nseq, p.nheads, p.headdim, p.d_state, device="cuda"))
        if cfg == "ssm_scan":
            ssm_scan(**dev, cu_seqlens=cu.cuda(), out=y, final_state_out=fs)
        else:
            ssm_scan_packed_cutile(*(dev[k] for k in contract.INPUT_NAMES), cu.tolist(), problem=pp,
                                   dt_softplus=True, dt_limit=(0.0, math.inf), out=y, final_state_out=fs, config=cfg)
        torch.cuda.synchronize()
        assert count_unwritten(y).item() == 0 and count_unwritten(fs).item() == 0, cfg
        assert_overflow_close(ref, y.cpu(), fs.cpu(), rel=SSD_Y_REL[dtype])
