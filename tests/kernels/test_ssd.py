"""cuTile SSMScan forward (m2export.kernels.ssd, backend="cutile") vs the float64 oracle.

GPU tests (marked ``gpu``; skipped with a reason without CUDA or cuda.tile) draw fresh random
inputs, NaN-poison ``out=``/``final_state_out=`` before every launch, and compare with
``naive.ssm_scan_recurrent`` evaluated in float64 on the same (already rounded) inputs.

Error bounds (rel-L2 = ||out - ref|| / ||ref||; max-abs relative to max|ref|):

=========  ==================  ==================  ======================================
dtype      y rel-L2            final_state rel-L2  max-abs / max|ref| (y and final_state)
=========  ==================  ==================  ======================================
float32    2e-4                2e-4                2e-3
float16    5e-3                5e-3                2e-2
bfloat16   2e-2                2e-2                6e-2
=========  ==================  ==================  ======================================

Why these: the kernel does its matrix products with operands in the input dtype and fp32
accumulation (bf16/fp16 on the tensor cores; for fp32 inputs the sm_90 SASS shows plain FFMA, no
TF32, so the "float32" row has slack); the intra-chunk weights and the carried state enter the
products rounded to the input dtype, as in mamba_ssm (bf16: 2^-8 relative per operand). The
state itself is kept and returned in fp32. The bounds are upper limits, not measured errors.

CPU tests (not marked): argument validation and BackendUnavailable on a machine without CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch

from m2export.contract import SSMScanProblem
from m2export.errors import BackendUnavailable, ContractError
from m2export.kernels.ssd import ssm_scan
from m2export.kernels.ssd.naive import ssm_scan_recurrent
from tests.helpers import SSD_STATE_REL as STATE_REL
from tests.helpers import SSD_Y_REL as Y_REL
from tests.helpers import assert_close, make_inputs, nan_outputs, requires_cutile, stable_seed

MAXABS = {"float32": 2e-3, "float16": 2e-2, "bfloat16": 6e-2}


gpu = requires_cutile


def _run_and_check(p: SSMScanProblem, *, seed: int, init_state=True, dt_limit=(0.0, math.inf), config=None,
                   dt_scale=1.0, A_range=(0.5, 8.0), no_D=False, no_bias=False, stream=None, dt_override=None,
                   stream_obj=None):
    inp = make_inputs(p, seed=seed, device="cpu", init_state=init_state, dt_scale=dt_scale, A_range=A_range)
    if dt_override is not None:
        inp["dt"] = dt_override(inp["dt"])
    if no_D:
        inp["D"] = None
    if no_bias:
        inp["dt_bias"] = None
    ref = ssm_scan_recurrent(**inp, dt_limit=dt_limit)
    dev = {k: (v.cuda() if v is not None else None) for k, v in inp.items()}
    y, fs = nan_outputs(p)
    if stream_obj is not None:  # inputs were written on the current stream: order the launch after them
        stream_obj.wait_stream(torch.cuda.current_stream())
    if config is None:
        res = ssm_scan(**dev, dt_limit=dt_limit, out=y, final_state_out=fs, stream=stream)
    else:
        from m2export.kernels.ssd.cutile import ssm_scan_cutile
        from m2export.contract import validate

        prob = validate(*(dev[k] for k in ("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_state")))
        res = ssm_scan_cutile(*(dev[k] for k in ("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_state")),
                              problem=prob, dt_softplus=True, dt_limit=dt_limit, out=y, final_state_out=fs,
                              stream=stream, config=config)
    torch.cuda.synchronize()
    assert res.y is y and res.final_state is fs
    d = p.dtype
    assert_close("y", ref.y, y.cpu(), rel=Y_REL[d], atol=MAXABS[d] * ref.y.abs().max().item())
    assert_close("final_state", ref.final_state, fs.cpu(), rel=STATE_REL[d],
                 atol=MAXABS[d] * ref.final_state.abs().max().item())


# (id, (batch, seqlen, nheads, headdim, ngroups, d_state))
LENGTH_CASES = [
    ("L1", (2, 1, 8, 64, 2, 64)),
    ("L_lt_chunk", (2, 37, 8, 64, 2, 64)),
    ("L_eq_chunk", (2, 64, 8, 64, 2, 64)),
    ("L_k_chunk_plus_1", (2, 3 * 64 + 1, 8, 64, 2, 64)),
    ("several_chunks", (1, 517, 8, 64, 2, 64)),
]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("plan", ["auto", "fused"])
@pytest.mark.parametrize("case", LENGTH_CASES, ids=[c[0] for c in LENGTH_CASES])
def test_lengths(case, plan):
    from m2export.kernels.ssd.plan import aot_config

    p = SSMScanProblem(*case[1], dtype="bfloat16")
    cfg = aot_config(p) if plan == "fused" else None  # "fused": the single-launch kernel the AOT plugin uses
    _run_and_check(p, seed=stable_seed(case[0], plan), config=cfg)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("init_state", [False, True], ids=["zero_state", "init_state"])
def test_dtypes(dtype, init_state):
    _run_and_check(SSMScanProblem(2, 3 * 64 + 1, 8, 64, 2, 64, dtype=dtype), seed=11, init_state=init_state)


GROUP_CASES = [("G1_H4", (2, 130, 4, 64, 1, 64)), ("G2_H8", (2, 130, 8, 64, 2, 64)),
               ("G4_H16", (1, 130, 16, 64, 4, 64)), ("G8_H16", (1, 130, 16, 64, 8, 64)),
               ("G8_H8", (1, 130, 8, 64, 8, 64))]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", GROUP_CASES, ids=[c[0] for c in GROUP_CASES])
def test_groups(case):
    _run_and_check(SSMScanProblem(*case[1], dtype="bfloat16"), seed=5)


DIM_CASES = [(32, 32), (64, 128), (128, 64), (128, 128), (32, 256), (256, 64)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("headdim,d_state", DIM_CASES, ids=[f"P{a}_N{b}" for a, b in DIM_CASES])
def test_dims(headdim, d_state):
    _run_and_check(SSMScanProblem(2, 200, 4, headdim, 2, d_state, dtype="bfloat16"), seed=headdim + d_state)


#: issue 15: head dims that are not powers of two (80: Nemotron-Nano-9B-v2; 96; 48), d_state 256 (Falcon-H1,
#: Nemotron-H 47B/56B, Bamba) and the kernel's chunk 128 (Nemotron-H's chunk_size), each at the standard's lengths
#: (1 = the decode-step kernel, < chunk, = chunk, 3 chunks + 1), batch 2, ngroups 2, initial state
NEW_DIM_CASES = [(80, 128, 64), (80, 256, 64), (96, 128, 128), (48, 64, 64), (128, 256, 128), (112, 64, 64)]


def _kernel_chunk_cases():
    for hd, n, q in NEW_DIM_CASES:
        for length in (1, 37, q, 3 * q + 1):
            yield hd, n, q, length


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("plan", ["auto", "aot"])
@pytest.mark.parametrize("headdim,d_state,chunk,seqlen", list(_kernel_chunk_cases()),
                         ids=[f"P{a}_N{b}_Q{c}_L{d}" for a, b, c, d in _kernel_chunk_cases()])
def test_new_dims(headdim, d_state, chunk, seqlen, plan):
    """auto: choose_config at this chunk (headdim split into power-of-two pieces, one launch each: 80 -> 64 +
    16); aot: the TensorRT AOT plugin's single launch (aot_spec, its grid; the last tile masked: 80 -> 2 x 64),
    launched here with ct.launch. bf16, vs the float64 oracle, NaN-poisoned outputs."""
    from dataclasses import replace

    from m2export.contract import SSMScanAttrs
    from m2export.kernels.ssd.cutile import aot_spec
    from m2export.kernels.ssd.plan import aot_config, choose_config

    p = SSMScanProblem(2, seqlen, 8, headdim, 2, d_state, dtype="bfloat16")
    if plan == "auto":
        # L = 1: ssm_scan routes it to the decode-step kernel (its own tiles dividing headdim)
        _run_and_check(p, seed=stable_seed(headdim, d_state, chunk, seqlen), config=None if seqlen == 1 else
                       choose_config(p, chunk=chunk))
        return
    import cuda.tile as ct

    spec = aot_spec(p, SSMScanAttrs(), config=replace(aot_config(p), chunk=chunk))
    inp = make_inputs(p, seed=stable_seed(headdim, d_state, chunk, seqlen, "aot"))
    ref = ssm_scan_recurrent(**inp)
    dev = {k: v.cuda() for k, v in inp.items()}
    dev["y"], dev["final_state"] = nan_outputs(p)
    ct.launch(torch.cuda.current_stream(), spec.grid(p.batch, p.nheads, p.headdim), spec.kernel, spec.bind(dev))
    torch.cuda.synchronize()
    d = p.dtype
    assert_close("y", ref.y, dev["y"].cpu(), rel=Y_REL[d], atol=MAXABS[d] * ref.y.abs().max().item())
    assert_close("final_state", ref.final_state, dev["final_state"].cpu(), rel=STATE_REL[d],
                 atol=MAXABS[d] * ref.final_state.abs().max().item())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_new_dims_dtypes_split_large_decay(dtype):
    """Head dim 80, d_state 256 in fp32/fp16: split plan (3 segments) and large dt*A (A = -16, dt ~ 5)."""
    from m2export.kernels.ssd.plan import choose_config

    p = SSMScanProblem(2, 3 * 64 + 1, 8, 80, 2, 256, dtype=dtype)
    _run_and_check(p, seed=stable_seed("nd", dtype), config=choose_config(p, nseg=3))
    _run_and_check(p, seed=stable_seed("nd-decay", dtype), A_range=(16.0, 16.0), no_bias=True,
                   dt_override=lambda d: torch.full_like(d, 5.0))


#: (headdim, d_state, chunk, seqlen, dtype, nseg): the merged tail (launch_pieces: 80 = 64 + 16, 96 = 64 + 32,
#: 48 = 32 + 16 in one launch) in one pass and split, every dtype, partial chunks
MERGED_TAIL_CASES = [(80, 128, 64, 3 * 64 + 1, "bfloat16", 1), (80, 128, 64, 5 * 64 + 9, "bfloat16", 3),
                     (80, 128, 64, 37, "float16", 1), (96, 128, 128, 3 * 128 + 1, "float16", 2),
                     (48, 64, 32, 5 * 32 + 1, "float32", 3), (80, 128, 32, 2 * 32 + 5, "float32", 2),
                     (48, 64, 64, 2 * 64 + 7, "bfloat16", 2)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("merge", [True, False], ids=["merged", "pieces"])
@pytest.mark.parametrize("headdim,d_state,chunk,seqlen,dtype,nseg", MERGED_TAIL_CASES,
                         ids=[f"P{a}_N{b}_Q{c}_L{d}_{e}_s{f}" for a, b, c, d, e, f in MERGED_TAIL_CASES])
def test_merged_tail(headdim, d_state, chunk, seqlen, dtype, nseg, merge):
    """A block owning a full tile and the narrower tail (merge_tail) vs one launch per piece: both vs the float64
    oracle with an initial state, ngroups 2, NaN-poisoned outputs (every y row and state row written once). The
    heuristic's state layout: (headdim, d_state) for merged tails in bf16/fp16, (d_state, headdim) otherwise."""
    from m2export.kernels.ssd.plan import choose_config, launch_pieces

    p = SSMScanProblem(2, seqlen, 8, headdim, 2, d_state, dtype=dtype)
    cfg = choose_config(p, chunk=chunk, nseg=nseg, merge_tail=merge)
    assert cfg.nseg == nseg and len(launch_pieces(headdim, cfg.block_p, merge)) == (1 if merge else 2)
    _run_and_check(p, seed=stable_seed("merged", headdim, seqlen, dtype, nseg, merge), config=cfg)


@pytest.mark.gpu
@gpu
def test_merged_tail_without_initial_state():
    """The merged tail's other sm_90 build (no initial state: warp-specialised, the one bench_ssd.py times)."""
    from m2export.kernels.ssd.plan import choose_config

    p = SSMScanProblem(2, 5 * 64 + 9, 8, 80, 2, 128, dtype="bfloat16")
    cfg = choose_config(p, nseg=2)
    assert cfg.merge_tail and cfg.nseg == 2
    _run_and_check(p, seed=stable_seed("merged-noinit"), config=cfg, init_state=False)


#: d_state 256 (Falcon-H1-7B: headdim 128): the plans the benchmark sweeps (chunk, block_p, nseg)
D_STATE_256_PLANS = [(32, 32, 2), (32, 16, 1), (64, 16, 2)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("chunk,block_p,nseg", D_STATE_256_PLANS,
                         ids=[f"Q{a}_P{b}_s{c}" for a, b, c in D_STATE_256_PLANS])
def test_d_state_256_plans(chunk, block_p, nseg):
    from m2export.kernels.ssd.plan import choose_config

    p = SSMScanProblem(2, 5 * 64 + 3, 8, 128, 2, 256, dtype="bfloat16")
    cfg = choose_config(p, chunk=chunk, block_p=block_p, nseg=nseg)
    assert (cfg.chunk, cfg.block_p, cfg.nseg) == (chunk, block_p, nseg)
    _run_and_check(p, seed=stable_seed("n256", chunk, block_p, nseg), config=cfg)


#: d_state 256 plans with other compiler hints / layouts (the Falcon-H1-7B sweep of session 6):
#: (seqlen, initial state, choose_config overrides)
D_STATE_256_KNOBS = [
    (5 * 64 + 3, True, dict(chunk=64, block_p=16, nseg=2, worker_warps=8)),
    (5 * 64 + 3, False, dict(chunk=64, block_p=16, nseg=2, worker_warps=8)),
    (37, True, dict(chunk=64, block_p=16, nseg=1, worker_warps=8)),
    (5 * 64 + 3, True, dict(chunk=64, block_p=32, nseg=3, worker_warps=8)),
    (5 * 64 + 3, True, dict(chunk=64, block_p=16, nseg=2, state_t=False)),
    (3 * 64 + 1, False, dict(chunk=64, block_p=16, nseg=2, state_t=False)),
    (64, True, dict(chunk=64, block_p=16, nseg=1, state_t=False)),
    (37, True, dict(chunk=64, block_p=16, nseg=1, state_t=False)),
    (5 * 64 + 3, True, dict(chunk=64, block_p=16, nseg=2, split_upd=True)),
]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("seqlen,init,kw", D_STATE_256_KNOBS,
                         ids=[f"L{a}{'_init' if b else ''}_" + "_".join(f"{k}{v}" for k, v in c.items())
                              for a, b, c in D_STATE_256_KNOBS])
def test_d_state_256_knobs(seqlen, init, kw):
    """Headdim 128 / d_state 256 (bf16, ngroups 2) with 8 worker warps, the (headdim, d_state) state layout or the
    split state update, vs the float64 oracle, NaN-poisoned outputs; with and without an initial state (two
    different sm_90 builds)."""
    from m2export.kernels.ssd.plan import choose_config

    p = SSMScanProblem(2, seqlen, 8, 128, 2, 256, dtype="bfloat16")
    cfg = choose_config(p, **kw)
    assert all(getattr(cfg, k) == v for k, v in kw.items())
    _run_and_check(p, seed=stable_seed("n256-knobs", seqlen, init, *sorted(kw.items())), config=cfg,
                   init_state=init)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_d_state_256_default_plan(dtype):
    """ssm_scan's own plan for d_state 256 (choose_config: bf16 chunk 64 with 32-row tiles, 3 for headdim 96, the
    state as (headdim, d_state); fp16 chunk 32 with 32-row tiles, the state as (d_state, headdim))."""
    from m2export.kernels.ssd.plan import choose_config

    p = SSMScanProblem(2, 2 * 64 + 5, 8, 96, 2, 256, dtype=dtype)
    cfg = choose_config(p)
    assert (cfg.chunk, cfg.block_p, cfg.state_t) == ((64, 32, False) if dtype == "bfloat16" else (32, 32, True))
    _run_and_check(p, seed=stable_seed("n256-default", dtype))


#: plans with ssd_cb_kernel before the scan (ScanConfig.cb_pre 1: C @ B^T per group, 2: M per head): (shape (B, L, H,
#: P, G, N), dtype, initial state, choose_config overrides); the d_state-128 tiles of the defaults, Falcon-H1-7B's
#: tiles, a merged headdim tail (80 = 64 + 16)
CB_PRE_CASES = [
    ((2, 3 * 64 + 1, 8, 64, 2, 128), "bfloat16", True, dict(cb_pre=1, nseg=1)),
    ((2, 3 * 64 + 1, 8, 64, 2, 128), "bfloat16", False, dict(cb_pre=1, nseg=2)),
    ((2, 37, 8, 64, 2, 128), "float16", True, dict(cb_pre=1)),
    ((1, 1, 4, 64, 1, 128), "bfloat16", True, dict(cb_pre=1)),
    ((2, 64, 4, 64, 1, 128), "float16", False, dict(cb_pre=1, nseg=1)),
    ((1, 3 * 32 + 1, 4, 64, 2, 64), "float32", True, dict(cb_pre=1, nseg=2)),
    ((1, 3 * 64 + 1, 8, 80, 2, 128), "bfloat16", True, dict(cb_pre=1, nseg=2)),
    ((2, 3 * 64 + 1, 4, 128, 1, 256), "bfloat16", True, dict(cb_pre=1, chunk=64, block_p=16, nseg=1, occupancy=3)),
    ((2, 5 * 64 + 3, 4, 128, 1, 256), "bfloat16", False, dict(cb_pre=1, chunk=64, block_p=16, nseg=2)),
    ((2, 3 * 64 + 1, 6, 128, 1, 256), "bfloat16", True, dict(cb_pre=2)),
    ((2, 37, 6, 128, 1, 256), "bfloat16", False, dict(cb_pre=2)),
    ((1, 1, 4, 128, 1, 256), "bfloat16", True, dict(cb_pre=2)),
    ((2, 5 * 64 + 3, 12, 128, 2, 256), "bfloat16", True, dict(cb_pre=2, nseg=2)),
    ((2, 64, 8, 64, 2, 128), "float16", True, dict(cb_pre=2, nseg=1)),
    ((1, 3 * 32 + 1, 6, 64, 2, 64), "float32", False, dict(cb_pre=2, nseg=2)),
]


def _plan_case_id(d, t, i, kw) -> str:
    """Test id of a (shape, dtype, initial state, choose_config overrides) plan case."""
    return (f"B{d[0]}_L{d[1]}_H{d[2]}_P{d[3]}_G{d[4]}_N{d[5]}_{t}{'_init' if i else ''}_"
            + "_".join(f"{k}{v}" for k, v in kw.items()))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dims,dtype,init,kw", CB_PRE_CASES,
                         ids=[_plan_case_id(*c) for c in CB_PRE_CASES])
def test_cb_pre_plans(dims, dtype, init, kw):
    """ssd_cb_kernel writes C @ B^T once per batch, group and chunk (cb_pre 1, fp32) or the masked, decayed M once per
    head (cb_pre 2, input dtype; 6 / 12 heads: 2 and 3 heads per kernel block) and the chunk loop reads it: vs the
    float64 oracle, NaN-poisoned outputs, at L 1 / < chunk / = chunk / k*chunk + 1, one pass and split, ngroups 1 and
    2, with and without an initial state, every dtype, Falcon-H1-7B's tiles and a merged headdim tail (80)."""
    from m2export.kernels.ssd.plan import choose_config

    p = SSMScanProblem(*dims, dtype=dtype)
    cfg = choose_config(p, **kw)
    assert all(getattr(cfg, k) == (v or None if k == "occupancy" else v) for k, v in kw.items())
    _run_and_check(p, seed=stable_seed("cb-pre", dims, dtype, init, *sorted(kw.items())), config=cfg,
                   init_state=init)


#: plans with C @ B^T and C @ state^T as one product in the chunk loop (ScanConfig.cb_state; block_p == chunk):
#: (shape (B, L, H, P, G, N), dtype, initial state, choose_config overrides). With an initial state the scan launch
#: keeps the two products (make_scan_plan), so the init case checks that fallback.
CB_STATE_CASES = [
    ((2, 3 * 64 + 1, 8, 64, 2, 128), "bfloat16", False, dict(cb_state=True, nseg=1)),
    ((2, 3 * 64 + 1, 8, 64, 2, 128), "bfloat16", False, dict(cb_state=True, nseg=2)),
    ((2, 37, 8, 64, 2, 128), "float16", False, dict(cb_state=True)),
    ((1, 1, 4, 64, 1, 128), "bfloat16", False, dict(cb_state=True)),
    ((2, 64, 4, 64, 1, 128), "float16", False, dict(cb_state=True, nseg=1)),
    ((2, 2 * 64 + 5, 4, 64, 1, 64), "bfloat16", False, dict(cb_state=True, nseg=2)),
    ((1, 3 * 32 + 1, 4, 32, 2, 64), "float32", False, dict(cb_state=True, chunk=32, block_p=32, nseg=2)),
    ((1, 3 * 64 + 1, 8, 80, 2, 128), "bfloat16", False, dict(cb_state=True, nseg=2)),
    ((2, 3 * 64 + 1, 8, 64, 2, 128), "bfloat16", True, dict(cb_state=True, nseg=2)),
]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dims,dtype,init,kw", CB_STATE_CASES,
                         ids=[_plan_case_id(*c) for c in CB_STATE_CASES])
def test_cb_state_plans(dims, dtype, init, kw):
    """The chunk loop's C @ B^T and C @ state^T from one product C @ [B^T | state^T] (cb_state): vs the float64
    oracle, NaN-poisoned outputs, at L 1 / < chunk / = chunk / k*chunk + 1, one pass and split, ngroups 1 and 2,
    d_state 64 and 128, every dtype, a merged headdim tail (80 = 64 + 16: the tail keeps its own product) and, with
    an initial state, the plan's fallback to two products."""
    from m2export.kernels.ssd.plan import choose_config

    p = SSMScanProblem(*dims, dtype=dtype)
    cfg = choose_config(p, **kw)
    assert cfg.cb_state and all(getattr(cfg, k) == v for k, v in kw.items())
    _run_and_check(p, seed=stable_seed("cb-state", dims, dtype, init, *sorted(kw.items())), config=cfg,
                   init_state=init)


@pytest.mark.gpu
@gpu
def test_chunk_size_attribute_128():
    """The contract's chunk_size (an evaluation-order attribute; Nemotron-H uses 128) does not change the
    cuTile result: 64, 128 and 256 all match the oracle."""
    p = SSMScanProblem(1, 300, 4, 80, 1, 128, dtype="bfloat16")
    inp = make_inputs(p, seed=77)
    ref = ssm_scan_recurrent(**inp)
    dev = {k: (v.cuda() if v is not None else None) for k, v in inp.items()}
    for cs in (64, 128, 256):
        res = ssm_scan(**dev, chunk_size=cs)
        assert_close(f"y (chunk_size {cs})", ref.y, res.y.cpu(), rel=Y_REL["bfloat16"])
        assert_close(f"final_state (chunk_size {cs})", ref.final_state, res.final_state.cpu(),
                     rel=STATE_REL["bfloat16"])


@pytest.mark.gpu
@gpu
def test_dims_fp32():
    _run_and_check(SSMScanProblem(1, 200, 4, 128, 1, 128, dtype="float32"), seed=3)


@pytest.mark.gpu
@gpu
def test_aot_fused_fp32_fp16():
    from m2export.kernels.ssd.plan import aot_config

    for dtype in ("float32", "float16"):
        p = SSMScanProblem(2, 150, 8, 64, 2, 64, dtype=dtype)
        _run_and_check(p, seed=44, config=aot_config(p))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dt_limit(dtype):
    _run_and_check(SSMScanProblem(2, 150, 8, 64, 2, 64, dtype=dtype), seed=7, dt_limit=(0.05, 0.3), dt_scale=2.0)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_very_negative_decay(dtype):
    """dt ~ 5 after softplus and A = -16: per-token log-decay -80, chunk sums ~ -5000: no NaN/inf."""
    p = SSMScanProblem(2, 200, 8, 64, 2, 64, dtype=dtype)
    _run_and_check(p, seed=9, A_range=(16.0, 16.0), dt_override=lambda d: torch.full_like(d, 5.0), no_bias=True)


#: issue 16: fp32 segment sums accurate to the segment's own terms (the bound of the chunked reference,
#: tests/kernels/test_ssd_reference.py); the kernels' old exp2(cs2_i - cs2_j) missed it
LARGE_DECAY_BOUND = 5e-6
LARGE_DECAY_PLANS = [("auto", {}), ("chunk64", dict(chunk=64)), ("split", dict(nseg=3)),
                     ("split_inline", dict(nseg=3, dt_pre=False)), ("fused", None)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("plan,kw", LARGE_DECAY_PLANS, ids=[c[0] for c in LARGE_DECAY_PLANS])
def test_large_decay_sums_fp32(plan, kw):
    """dt*A summing to -4,000 every 64 tokens between small steps (large_decay_inputs): every plan's fp32
    result within 5e-6 of the float64 oracle (y and final_state rel-L2), NaN-poisoned outputs."""
    from m2export.contract import validate
    from m2export.kernels.ssd.cutile import ssm_scan_cutile
    from m2export.kernels.ssd.plan import aot_config, choose_config
    from tests.helpers import large_decay_inputs

    p = SSMScanProblem(2, 3 * 64 + 1 + 128, 8, 64, 2, 64, dtype="float32")
    inp = large_decay_inputs(p, seed=stable_seed("large_decay", plan), per=64)
    ref = ssm_scan_recurrent(**inp)
    cfg = aot_config(p) if kw is None else choose_config(p, **kw)
    names = ("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_state")
    dev = [inp[k].cuda() for k in names]
    y, fs = nan_outputs(p)
    ssm_scan_cutile(*dev, problem=validate(*dev), dt_softplus=True, dt_limit=(0.0, math.inf), out=y,
                    final_state_out=fs, config=cfg)
    torch.cuda.synchronize()
    assert_close(f"y ({cfg})", ref.y, y.cpu(), rel=LARGE_DECAY_BOUND)
    assert_close(f"final_state ({cfg})", ref.final_state, fs.cpu(), rel=LARGE_DECAY_BOUND)


@pytest.mark.gpu
@gpu
def test_optional_inputs_absent():
    _run_and_check(SSMScanProblem(2, 100, 8, 64, 2, 64, dtype="bfloat16"), seed=13, init_state=False, no_D=True,
                   no_bias=True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("nseg", [2, 3, 6])  # 11 chunks: 6/4/2 chunks per segment
def test_split_plan(nseg):
    from m2export.kernels.ssd.plan import choose_config

    p = SSMScanProblem(2, 700, 8, 64, 2, 128, dtype="bfloat16")
    cfg = choose_config(p, nseg=nseg)
    assert cfg.nseg == nseg
    _run_and_check(p, seed=20 + nseg, config=cfg)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
@pytest.mark.parametrize("dt_pre", [True, False], ids=["dt_pre", "dt_inline"])
def test_split_plan_slow_decay(dtype, dt_pre):
    """|A| small enough that a whole segment's decay (and the initial state's) stays far from 0,
    so an error in the segment fold (exp vs exp2 of the log-decay) shows; both step-size paths.
    fp16: pass 1 rounds x * w * (decay of the later chunks) to fp16, whose range ends at ~6e-5
    (subnormals below): checked here against the same bound as the single pass."""
    from m2export.kernels.ssd.plan import choose_config

    p = SSMScanProblem(2, 700, 8, 64, 2, 128, dtype=dtype)
    cfg = choose_config(p, nseg=4, dt_pre=dt_pre)
    assert cfg.nseg == 4 and cfg.dt_pre == dt_pre
    _run_and_check(p, seed=70 + dt_pre, config=cfg, A_range=(0.01, 0.05), dt_scale=0.5)


@pytest.mark.gpu
@gpu
def test_config_for_another_seqlen_is_refused():
    """A split plan made for a shorter sequence would leave chunks unscanned: refused. A
    single-pass plan walks every chunk whatever seqlen it was made for: correct results."""
    from m2export.contract import validate
    from m2export.kernels.ssd.cutile import ssm_scan_cutile
    from m2export.kernels.ssd.plan import choose_config

    short = SSMScanProblem(1, 128, 2, 64, 1, 64, dtype="bfloat16")
    p = SSMScanProblem(1, 700, 2, 64, 1, 64, dtype="bfloat16")
    inp = {k: (v.cuda() if v is not None else None) for k, v in make_inputs(p, seed=1).items()}
    names = ("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_state")
    with pytest.raises(ContractError, match="does not cover seqlen 700"):
        ssm_scan_cutile(*(inp[k] for k in names), problem=validate(*(inp[k] for k in names)), dt_softplus=True,
                        dt_limit=(0.0, math.inf), config=choose_config(short, nseg=2))
    _run_and_check(p, seed=1, config=choose_config(short, nseg=1))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layout", ["state_pn", "state_np_split"])
def test_state_layouts(layout):
    """Both on-chip state layouts/update orders (benchmark variants), fused and split plans."""
    from m2export.kernels.ssd.plan import choose_config

    p = SSMScanProblem(2, 300, 8, 64, 2, 64, dtype="bfloat16")
    flag = layout == "state_np_split"
    for nseg in (1, 3):
        _run_and_check(p, seed=40 + nseg, config=choose_config(p, nseg=nseg, state_t=flag, split_upd=flag,
                                                                occupancy=0))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind", ["torch_stream", "int_stream"])
def test_stream(kind):
    s = torch.cuda.Stream()
    _run_and_check(SSMScanProblem(1, 100, 4, 64, 1, 64, dtype="bfloat16"), seed=17,
                   stream=s if kind == "torch_stream" else int(s.cuda_stream), stream_obj=s)


@pytest.mark.gpu
@gpu
def test_noncontiguous_inputs():
    p = SSMScanProblem(2, 100, 8, 64, 2, 64, dtype="bfloat16")
    inp = make_inputs(p, seed=23)
    ref = ssm_scan_recurrent(**inp)
    # x as a strided view (heads and headdim transposed twice), B/C sliced from a wider tensor
    x = inp["x"].cuda().transpose(2, 3).contiguous().transpose(2, 3)
    Bw = torch.cat([inp["B"], inp["B"]], dim=-1).cuda()[..., : p.d_state]
    dev = {k: (v.cuda() if v is not None else None) for k, v in inp.items()}
    dev.update(x=x, B=Bw)
    assert not x.is_contiguous() and not Bw.is_contiguous()
    res = ssm_scan(**dev)
    assert_close("y", ref.y, res.y.cpu(), rel=Y_REL["bfloat16"])
    assert_close("final_state", ref.final_state, res.final_state.cpu(), rel=STATE_REL["bfloat16"])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("seqlen", [1, 63, 64, 65, 200])
def test_layer_layout_views(seqlen, dtype):
    """The layer's layout, read in place by the cuTile backend (no copies): x, B, C views of one
    (batch, seqlen, d_inner + 2 * ngroups * d_state) conv output, dt a view of a wider tensor at an
    offset that is not 16-byte aligned (the in_proj output's dt columns), an initial state; outputs
    NaN-poisoned. seqlen 1 is the decode step."""
    p = SSMScanProblem(2, seqlen, 8, 64, 2, 64, dtype=dtype)
    inp = make_inputs(p, seed=stable_seed("layout", seqlen, dtype), init_state=True)
    ref = ssm_scan_recurrent(**inp)
    di, gn = p.nheads * p.headdim, p.ngroups * p.d_state
    xbc = torch.cat([inp["x"].reshape(2, seqlen, di), inp["B"].reshape(2, seqlen, gn),
                     inp["C"].reshape(2, seqlen, gn)], dim=-1).cuda()
    wide = torch.cat([torch.zeros(2, seqlen, 3, dtype=inp["dt"].dtype), inp["dt"]], dim=-1).cuda()
    x, B, C = (t.reshape(2, seqlen, -1, w) for t, w in zip(torch.split(xbc, [di, gn, gn], dim=-1),
                                                            (p.headdim, p.d_state, p.d_state)))
    dt = wide[..., 3:]
    assert not any(t.is_contiguous() for t in (x, B, C, dt)) and dt.data_ptr() % 16 != 0
    dev = {k: (v.cuda() if v is not None else None) for k, v in inp.items()}
    dev.update(x=x, dt=dt, B=B, C=C)
    y, fs = nan_outputs(p)
    res = ssm_scan(**dev, out=y, final_state_out=fs)
    torch.cuda.synchronize()
    assert res.y is y and res.final_state is fs
    assert_close("y", ref.y, y.cpu(), rel=Y_REL[dtype])
    assert_close("final_state", ref.final_state, fs.cpu(), rel=STATE_REL[dtype])


# ----------------------------------------------------------------------------- CPU: validation
def _cpu_inputs(headdim=64, d_state=64):
    return make_inputs(SSMScanProblem(1, 8, 2, headdim, 1, d_state), seed=0)


@pytest.mark.parametrize("headdim,d_state,bad", [(40, 64, "headdim"), (64, 96, "d_state"), (512, 64, "headdim"),
                                                 (272, 128, "headdim"), (8, 64, "headdim")])
def test_unsupported_dims_rejected(headdim, d_state, bad):
    """Refused before any launch with a one-line ContractError naming the field (also for decode: seqlen 1)."""
    for seqlen in (8, 1):
        inp = _cpu_inputs(headdim, d_state)
        inp = {k: (v[:, :seqlen] if k in ("x", "dt", "B", "C") else v) for k, v in inp.items()}
        with pytest.raises(ContractError, match=rf"{bad}: .*got {headdim if bad == 'headdim' else d_state}") as e:
            ssm_scan(**inp, backend="cutile")
        assert "\n" not in str(e.value)


def test_unknown_backend_rejected():
    with pytest.raises(ContractError, match="backend"):
        ssm_scan(**_cpu_inputs(), backend="triton")


def test_contract_violation_rejected():
    inp = _cpu_inputs()
    inp["dt"] = inp["dt"][:, :4]
    with pytest.raises(ContractError, match="dt"):
        ssm_scan(**inp, backend="cutile")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error path")
def test_cutile_unavailable_on_cpu():
    with pytest.raises(BackendUnavailable) as ei:
        ssm_scan(**_cpu_inputs(), backend="cutile")
    assert "m2export[gpu]" in (ei.value.hint or "")


def test_torch_backend_matches_oracle_and_fills_out():
    inp = _cpu_inputs()
    ref = ssm_scan_recurrent(**inp)
    y = torch.full_like(inp["x"], float("nan"))
    res = ssm_scan(**inp, backend="torch", chunk_size=4, out=y)
    assert res.y is y
    assert_close("y", ref.y, y, rel=1e-5)
    assert_close("final_state", ref.final_state, res.final_state, rel=1e-5)


# ----------------------------------------------------------------------------- tuning space and autotuner
# every tile family (kernels/ssd/plan.py tile_families: what TensorRT's tactics and M2EXPORT_AUTOTUNE=1 launch,
# chunk 128 included) vs the oracle, at lengths around its own chunk, in the split plan and the AOT kernel
_FAMILY_CASES = [("bfloat16", 64, 128, 2), ("float16", 80, 128, 2), ("bfloat16", 128, 256, 1), ("float32", 64, 64, 2)]


def _family_params():
    from m2export.kernels.ssd.plan import tile_families

    out = []
    for dtype, headdim, d_state, ngroups in _FAMILY_CASES:
        for fam in tile_families(SSMScanProblem(1, 2, 8, headdim, ngroups, d_state, dtype=dtype)):
            out.append(pytest.param(dtype, headdim, d_state, ngroups, fam, id=f"{dtype}_P{headdim}_N{d_state}_"
                                    f"G{ngroups}_Q{fam.chunk}_p{fam.block_p}_{'T' if fam.state_t else 'S'}"))
    return out


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("plan", ["single", "split", "aot"])
@pytest.mark.parametrize("dtype,headdim,d_state,ngroups,fam", _family_params())
def test_every_tile_family(dtype, headdim, d_state, ngroups, fam, plan):
    """One tile family in one launch plan: the heuristic's segment count (config_for) at L = chunk - 3 and
    3 chunks + 5, a forced 2-segment split, or the AOT kernel (aot_config with the family's tiles).

    Small on purpose (one batch, 4 heads, <= 4 chunks): the float64 oracle runs on the device's CPU, shared by
    every xdist worker; 2 x 8 heads x 9 chunks did not finish within 200 s for 16 workers (H200, 2026-12-01). One
    plan per case, so xdist spreads the compiles (each plan builds its own kernels): with the three plans in one
    case, 4 of 24 cases finished in 200 s on 16 workers (H200, 2026-12-02)."""
    from m2export.kernels.ssd.plan import aot_config, choose_config, config_for

    seed = stable_seed("family", dtype, headdim, d_state, fam.chunk, fam.block_p, fam.state_t, plan)
    p = SSMScanProblem(1, 3 * fam.chunk + 5, 4, headdim, ngroups, d_state, dtype=dtype)
    if plan == "single":
        for seqlen in (fam.chunk - 3, 3 * fam.chunk + 5):
            p = SSMScanProblem(1, seqlen, 4, headdim, ngroups, d_state, dtype=dtype)
            _run_and_check(p, seed=seed + seqlen, config=config_for(p, fam))
    elif plan == "split":
        split = choose_config(p, chunk=fam.chunk, block_p=fam.block_p, state_t=fam.state_t, nseg=2)
        assert split.nseg == 2
        _run_and_check(p, seed=seed, config=split)
    else:
        _run_and_check(p, seed=seed, config=aot_config(p, fam))


@pytest.mark.gpu
@gpu
def test_autotuned_scan(monkeypatch, autotune_env):
    """M2EXPORT_AUTOTUNE=1: the first call of a signature times every candidate (into scratch buffers) and keeps
    the fastest; the result equals the oracle; the second call reuses the choice (no new trials)."""
    from m2export.kernels import _tune

    autotune_env("1")
    monkeypatch.setattr(_tune, "TUNER", _tune.Autotuner())
    p = SSMScanProblem(2, 3 * 64 + 1, 8, 64, 2, 128, dtype="bfloat16")
    _run_and_check(p, seed=stable_seed("autotune", 1))
    (key, trials), = _tune.TUNER.trials.items()
    assert len(trials) > 1 and all(ms is not None and ms > 0 for _, ms in trials)
    chosen = _tune.TUNER.cached(key)
    assert chosen == min(trials, key=lambda t: t[1])[0]
    _run_and_check(p, seed=stable_seed("autotune", 2))
    assert len(_tune.TUNER.trials) == 1


# ------------------------------------------------------------- dt*A overflowing float32 to -inf
#: (id, seqlen) at chunk 64: one token, less than a chunk, k chunks + 1
OVERFLOW_LENGTHS = [("L1", 1), ("L_lt_chunk", 37), ("L_k_chunk_plus_1", 3 * 64 + 1)]


@pytest.mark.parametrize("a0", [-1e30, None], ids=["A0_-1e30", "A0_ordinary"])
@pytest.mark.parametrize("case", OVERFLOW_LENGTHS, ids=[c[0] for c in OVERFLOW_LENGTHS])
def test_chunked_reference_decay_overflowing_to_minus_inf(case, a0):
    """CPU: ssm_scan_chunked where dt*A is -inf in float32 (A -1e30, dt 1e10 on head 0) gives the float64 decay to
    exactly 0, never NaN: its segment sums mask dA (where, not a 0/1 product) before the cumsum, it forms no
    cs_i - cs_j, and it masks before exp. A0_ordinary: head 0's own A, dt*A ~ -1e10 (finite) on those tokens."""
    from m2export.kernels.ssd.naive import ssm_scan_chunked
    from tests.helpers import assert_overflow_close, overflowing_decay_inputs

    p = SSMScanProblem(2, case[1], 4, 16, 2, 16, dtype="float32")
    inp = overflowing_decay_inputs(p, seed=stable_seed("overflow-ref", case[0]), a0=a0)
    assert torch.isinf(inp["dt"].float()[:, ::3, 0] * inp["A"][0]).all() == (a0 is not None)
    ref = ssm_scan_recurrent(**inp)
    out = ssm_scan_chunked(**inp, chunk_size=64)
    assert_overflow_close(ref, out.y, out.final_state, rel=2e-5)


def _overflow_config(p: SSMScanProblem, plan: str):
    """The plan of test_decay_overflowing_to_minus_inf: None (ssm_scan's own) or a ScanConfig at chunk 64."""
    from m2export.kernels.ssd.plan import aot_config, choose_config

    nchunks = -(-p.seqlen // 64)
    return {"auto": None, "fused": aot_config(p), "dt_pre": choose_config(p, chunk=64, nseg=1, dt_pre=True),
            "split": choose_config(p, chunk=64, nseg=min(3, nchunks)),
            "cb_pre1": choose_config(p, chunk=64, cb_pre=1), "cb_pre2": choose_config(p, chunk=64, cb_pre=2)}[plan]


def _check_overflowing_decay(case, dtype: str, plan: str, a0, spike_dt: float = 1e10) -> None:
    """One plan of ssm_scan_cutile (or ssm_scan's own) on :func:`tests.helpers.overflowing_decay_inputs` vs the
    float64 oracle, NaN-poisoned outputs."""
    from m2export.contract import validate
    from m2export.kernels.ssd.cutile import ssm_scan_cutile
    from tests.helpers import assert_overflow_close, overflowing_decay_inputs

    p = SSMScanProblem(2, case[1], 8, 64, 2, 64, dtype=dtype)
    inp = overflowing_decay_inputs(p, seed=stable_seed("overflow", case[0], dtype, a0), a0=a0, spike_dt=spike_dt)
    ref = ssm_scan_recurrent(**inp)
    names = ("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_state")
    dev = [inp[k].cuda() for k in names]
    y, fs = nan_outputs(p)
    cfg = _overflow_config(p, plan)
    if cfg is None:
        ssm_scan(*dev, out=y, final_state_out=fs)
    else:
        ssm_scan_cutile(*dev, problem=validate(*dev), dt_softplus=True, dt_limit=(0.0, math.inf), out=y,
                        final_state_out=fs, config=cfg)
    torch.cuda.synchronize()
    assert_overflow_close(ref, y.cpu(), fs.cpu(), rel=Y_REL[dtype])


OVERFLOW_PLANS = ["auto", "fused", "dt_pre", "split", "cb_pre1", "cb_pre2"]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("plan", OVERFLOW_PLANS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("a0", [-1e30, None], ids=["A0_-1e30", "A0_ordinary"])
@pytest.mark.parametrize("case", OVERFLOW_LENGTHS, ids=[c[0] for c in OVERFLOW_LENGTHS])
def test_decay_overflowing_to_minus_inf(case, dtype, plan, a0):
    """dt*A -inf in float32 on head 0 (A -1e30, dt 1e10 on every third token; finite but -3e29 on the others):
    every plan vs the float64 oracle (its exp(dt*A) is 0: an exact decay to 0), with an initial state, NaN-poisoned
    outputs. Without the kernels' LOG2_STEP_FLOOR the double-float cumsum gives NaN (benchmarks/NOTES_ssd.md, "dt*A
    at -inf": -inf - -inf in its TwoSum; and, for finite dt*A ~ -1e30, residuals lo ~ 1e23 with exp2(lo) = 0 and
    exp2(-lo) = inf). A0_ordinary: head 0's own A (dt*A ~ -1e10, finite: no overflow anywhere), NaN too without
    the floor (in-chunk sums below ~-1.5e9)."""
    _check_overflowing_decay(case, dtype, plan, a0)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("plan", OVERFLOW_PLANS)
@pytest.mark.parametrize("case", OVERFLOW_LENGTHS, ids=[c[0] for c in OVERFLOW_LENGTHS])
def test_decay_overflowing_to_minus_inf_fp16(case, plan):
    """float16 inputs (dt 1e10 is inf there): A -1e37, dt 100 on every third token of head 0 (dt*A -1e39, -inf in
    float32; ~ -3e36 on the others; tests.helpers.FP16_OVERFLOW), every plan vs the float64 oracle. Also checks the
    floor's bound on the residuals: x * dl is cast to float16 in the chunk product, so dl must stay near delta."""
    from tests.helpers import FP16_OVERFLOW

    _check_overflowing_decay(case, "float16", plan, FP16_OVERFLOW[0], FP16_OVERFLOW[1])


# ------------------------------------------------------------- a NaN dt
def test_chunked_reference_nan_dt_stays_nan():
    """CPU: ssm_scan_chunked with dt NaN at one (batch, token, head) is NaN where the float64 oracle is (and over the
    rest of that chunk), matches it elsewhere; the check refuses the finite answer a dropped NaN gives."""
    from m2export.kernels.ssd.naive import ssm_scan_chunked
    from tests.helpers import assert_nan_dt_propagated, nan_dt_inputs

    p = SSMScanProblem(2, 3 * 64 + 1, 8, 16, 2, 16, dtype="float32")
    at = (1, 130, 3)
    inp = nan_dt_inputs(p, seed=stable_seed("nan-dt-ref"), at=at)
    ref = ssm_scan_recurrent(**inp)
    out = ssm_scan_chunked(**inp, chunk_size=64)
    assert_nan_dt_propagated(ref, out.y, out.final_state, at=at, finite_before=128, rel=2e-5)
    inp["dt"][at] = 20.0  # what the kernels' clamp made of it (softplus(NaN) -> 20)
    dropped = ssm_scan_recurrent(**inp)
    with pytest.raises(AssertionError, match="non-NaN values from a NaN dt"):
        assert_nan_dt_propagated(ref, dropped.y, dropped.final_state, at=at, finite_before=128, rel=2e-5)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("plan", OVERFLOW_PLANS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nan_dt_stays_nan(dtype, plan):
    """dt NaN at one (batch, token, head): y is NaN on that token and every later one of its (batch, head), its
    final state NaN, as in the float64 oracle; other (batch, head)s and the earlier chunks match it. The step-size
    clamp's ct.minimum / ct.maximum used to drop the NaN (softplus(NaN) became 20: a finite answer)."""
    from m2export.contract import validate
    from m2export.kernels.ssd.cutile import ssm_scan_cutile
    from tests.helpers import assert_nan_dt_propagated, nan_dt_inputs

    p = SSMScanProblem(2, 3 * 64 + 1, 8, 64, 2, 64, dtype=dtype)
    at = (1, 130, 3)  # chunk [128, 160) at chunk 32, [128, 192) at 64
    inp = nan_dt_inputs(p, seed=stable_seed("nan-dt", dtype), at=at)
    ref = ssm_scan_recurrent(**inp)
    dev = [inp[k].cuda() for k in ("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_state")]
    y, fs = nan_outputs(p)
    cfg = _overflow_config(p, plan)
    if cfg is None:
        ssm_scan(*dev, out=y, final_state_out=fs)
    else:
        ssm_scan_cutile(*dev, problem=validate(*dev), dt_softplus=True, dt_limit=(0.0, math.inf), out=y,
                        final_state_out=fs, config=cfg)
    torch.cuda.synchronize()
    assert_nan_dt_propagated(ref, y.cpu(), fs.cpu(), at=at, finite_before=128, rel=Y_REL[dtype])
