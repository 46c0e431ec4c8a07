"""Stress: every element of y and final_state is written, in order, on every stream the API accepts (issue 14).

The race this guards against (root cause of the once-seen unwritten y tiles): a raw stream handle 0
went through ``torch.cuda.ExternalStream(0)``, which torch turns into a fresh *non-blocking pool
stream* (a null ``stream_ptr`` means "none given" to ``torch.cuda.Stream.__new__``), so the kernels
ran unordered with the caller's legacy default stream: the caller's ``synchronize`` + copy could
read y while the scan kernel was still in its last chunk (4096 = 2 x 8 x 4 tokens x 64 of the
B2-L100 fp32 case: the last, partial chunk of every block) or before it started (the earlier
all-NaN fp32 L7 case). Slow first launches (module load, fp32 local memory) widened the window.

Each repetition queues ``torch.cuda._sleep`` on the caller's stream, then poisons the outputs
(:func:`tests.helpers.poison_`), then calls; the checks run on the same stream without a host sync.
A launch that is not ordered after the poison (or before the checks) shows up as poison left in
the outputs (counted separately from computed NaN) on the first repetition, deterministically.
``M2EXPORT_STRESS_REPS`` (int, default 12) sets the repetitions per combination.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from m2export.contract import INPUT_NAMES, SSMScanAttrs, SSMScanProblem
from m2export.kernels.ssd.naive import ssm_scan_recurrent
from tests.helpers import SSD_STATE_REL, SSD_Y_REL, TORCH_DTYPES, count_unwritten, make_inputs, poison_, \
    requires_cutile, stable_seed


def _reps() -> int:
    raw = os.environ.get("M2EXPORT_STRESS_REPS", "12")
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"M2EXPORT_STRESS_REPS: expected a positive integer, got {raw!r}")
    return int(raw)


#: the failing case and its neighbours: L around a chunk edge, L < chunk, L = 1, every dtype, d_state 256
CASES = [
    ("B2-L100-H8-P64-G2-N64-fp32", (2, 100, 8, 64, 2, 64), "float32"),
    ("B2-L99-fp32", (2, 99, 8, 64, 2, 64), "float32"),
    ("B2-L101-fp32", (2, 101, 8, 64, 2, 64), "float32"),
    ("B2-L100-bf16", (2, 100, 8, 64, 2, 64), "bfloat16"),
    ("B2-L65-fp16", (2, 65, 8, 64, 2, 64), "float16"),
    ("B4-L7-P128-N256-fp32", (4, 7, 2, 128, 2, 256), "float32"),
    ("B1-L1-fp32", (1, 1, 4, 64, 1, 64), "float32"),
]
#: how the stream reaches the kernel, and on which stream the caller queues its work before and after
STREAMS = ["raw0", "none", "default_obj", "side_obj", "side_raw", "jit_raw0", "jit_side"]
PLANS = ["auto", "fused", "split"]


def _config(plan: str, p: SSMScanProblem):
    from m2export.kernels.ssd.plan import aot_config, choose_config

    if plan == "auto":
        return None
    if plan == "fused":
        return aot_config(p)
    return choose_config(p, nseg=2)


def _call(mode: str, plan: str, p: SSMScanProblem, dev: dict, y, fs, side: torch.cuda.Stream):
    from m2export.kernels.ssd import ssm_scan
    from m2export.kernels.ssd.cutile import ssm_scan_cutile
    from m2export.plugins import ssm_scan_trt as plug
    from tests.plugins.fakes import FakeTensor

    stream = {"raw0": 0, "none": None, "default_obj": torch.cuda.default_stream(), "side_obj": side,
              "side_raw": int(side.cuda_stream), "jit_raw0": 0, "jit_side": int(side.cuda_stream)}[mode]
    if mode.startswith("jit"):
        plug.run_jit([FakeTensor(dev[n]) for n in INPUT_NAMES], [FakeTensor(y), FakeTensor(fs)],
                     SSMScanAttrs(chunk_size=64), stream)
        return
    args = [dev[n] for n in INPUT_NAMES]
    cfg = _config(plan, p)
    if cfg is None:
        ssm_scan(*args, out=y, final_state_out=fs, stream=stream)
    else:
        from m2export.contract import validate

        ssm_scan_cutile(*args, problem=validate(*args), dt_softplus=True, dt_limit=(0.0, math.inf), out=y,
                        final_state_out=fs, stream=stream, config=cfg)


def _rel(ref: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return (out.double() - ref).norm() / ref.norm()


@pytest.mark.gpu
@requires_cutile
@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_outputs_written_in_stream_order(case, plan):
    name, dims, dtype = case
    p = SSMScanProblem(*dims, dtype=dtype)
    if plan == "split" and p.seqlen <= 64:
        pytest.skip("one chunk: no second segment to split into")
    inp = make_inputs(p, seed=stable_seed(name))
    ref = ssm_scan_recurrent(**inp)
    ref_y, ref_fs = ref.y.cuda(), ref.final_state.cuda()
    side = torch.cuda.Stream()
    failures = []
    for mode in STREAMS:
        if mode.startswith("jit") and plan != "auto":
            continue  # the plugin body always takes the automatic plan
        reader = side if mode.startswith("side") or mode == "jit_side" else torch.cuda.default_stream()
        torch.cuda.synchronize()
        with torch.cuda.stream(reader):
            dev = {k: (v.cuda() if v is not None else None) for k, v in inp.items()}
            y = torch.empty(p.shape_of("y"), dtype=TORCH_DTYPES[dtype], device="cuda")
            fs = torch.empty(p.shape_of("final_state"), dtype=torch.float32, device="cuda")
            unwritten = torch.zeros((), dtype=torch.int64, device="cuda")
            nonfinite = torch.zeros((), dtype=torch.int64, device="cuda")
            err_y = torch.zeros((), dtype=torch.float64, device="cuda")
            err_fs = torch.zeros((), dtype=torch.float64, device="cuda")
            for _ in range(_reps()):
                torch.cuda._sleep(2_000_000)  # ~1 ms of pending work on the caller's stream
                poison_(y), poison_(fs)
                _call(mode, plan, p, dev, y, fs, side)
                unwritten += count_unwritten(y) + count_unwritten(fs)
                nonfinite += (~torch.isfinite(y)).sum() + (~torch.isfinite(fs)).sum()
                err_y = torch.maximum(err_y, _rel(ref_y, y))
                err_fs = torch.maximum(err_fs, _rel(ref_fs, fs))
        reader.synchronize()
        u, n, ey, ef = unwritten.item(), nonfinite.item(), err_y.item(), err_fs.item()
        if u or n or not (ey <= SSD_Y_REL[dtype] and ef <= SSD_STATE_REL[dtype]):
            failures.append(f"{mode}: {u} elements never written, {n - u} computed non-finite over {_reps()} reps, "
                            f"max rel-L2 y {ey:.2e} final_state {ef:.2e}")
    assert not failures, f"{name} plan={plan}: " + "; ".join(failures)


@pytest.mark.gpu
@requires_cutile
@pytest.mark.parametrize("raw", [0, 1])
def test_raw_legacy_stream_handle_is_torch_default_stream(raw):
    from m2export.kernels._host import launch_stream

    s = launch_stream(raw, torch.device("cuda"))
    assert s == torch.cuda.default_stream() and s.cuda_stream == 0
    # what the old code did: ExternalStream(0) is a pool stream with a real handle of its own
    assert torch.cuda.ExternalStream(0).cuda_stream != 0


@pytest.mark.gpu
@requires_cutile
@pytest.mark.parametrize("mode", ["raw0", "side_raw"])
def test_step_outputs_written_in_stream_order(mode):
    from m2export.kernels.ssd_step import ssm_step

    p = SSMScanProblem(4, 1, 8, 64, 2, 128, "float32")
    inp = make_inputs(p, seed=stable_seed("step", mode))
    ref = ssm_scan_recurrent(**inp)
    side = torch.cuda.Stream()
    reader = side if mode == "side_raw" else torch.cuda.default_stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(reader):
        step = {k: (v.cuda() if v is not None else None) for k, v in inp.items()}
        args = dict(x=step["x"][:, 0], dt=step["dt"][:, 0], A=step["A"], B=step["B"][:, 0], C=step["C"][:, 0],
                    D=step["D"], dt_bias=step["dt_bias"], ssm_state=step["initial_state"])
        y = torch.empty_like(args["x"])
        st = torch.empty(p.shape_of("final_state"), dtype=torch.float32, device="cuda")
        unwritten = torch.zeros((), dtype=torch.int64, device="cuda")
        for _ in range(_reps()):
            torch.cuda._sleep(2_000_000)
            poison_(y), poison_(st)
            ssm_step(**args, out=y, state_out=st, stream=0 if mode == "raw0" else int(side.cuda_stream))
            unwritten += count_unwritten(y) + count_unwritten(st)
    reader.synchronize()
    assert unwritten.item() == 0, f"{unwritten.item()} elements never written (stream {mode})"
    assert _rel(ref.final_state.cuda(), st).item() <= 1e-5
