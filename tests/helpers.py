"""Shared test helpers: a named error metric and problem generators drawn from the contract."""

from __future__ import annotations

import math
import os
import shutil
import zlib

import pytest
import torch

from m2export.contract import SSMScanProblem

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def stable_seed(*parts) -> int:
    """A seed from ``parts`` that is the same in every process (``hash(str)`` is salted per process)."""
    return zlib.crc32(repr(parts).encode()) % 2**31


def rel_l2(ref: torch.Tensor, out: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (0 when both are 0)."""
    r, o = ref.double(), out.double()
    den = r.norm().item()
    return (o - r).norm().item() / den if den > 0 else (o - r).norm().item()


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, *, rel: float, atol: float | None = None) -> None:
    """Fail unless ``out`` matches ``ref``: same shape, no NaN/inf, rel-L2 error <= rel, max-abs <= atol (if given).

    The message starts with ``name`` and gives both metrics. Never downgraded to a warning.
    """
    assert tuple(out.shape) == tuple(ref.shape), f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    bad = (~torch.isfinite(out.double())).sum().item()
    assert bad == 0, f"{name}: {bad} non-finite values (NaN-poisoned element never written, or overflow)"
    err = rel_l2(ref, out)
    maxabs = (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0
    msg = f"{name}: rel-L2 {err:.3e} (bound {rel:.1e}), max-abs {maxabs:.3e}" + (
        f" (bound {atol:.1e})" if atol is not None else "")
    assert err <= rel, msg
    if atol is not None:
        assert maxabs <= atol, msg


def make_inputs(p: SSMScanProblem, *, seed: int, device="cpu", init_state: bool = True, dt_scale: float = 1.0,
                A_range: tuple[float, float] = (0.5, 8.0)) -> dict[str, torch.Tensor]:
    """Fresh random SSMScan inputs for problem ``p`` (names and shapes from the contract).

    dt is raw (pre-softplus); A = -U[A_range]; initial_state present when ``init_state``.
    """
    g = torch.Generator().manual_seed(seed)
    dt_ = TORCH_DTYPES[p.dtype]

    def rnd(shape, scale=1.0):
        return (torch.randn(shape, generator=g) * scale)

    out = {
        "x": rnd(p.shape_of("x")).to(dt_),
        "dt": (rnd(p.shape_of("dt")) * dt_scale - 1.0).to(dt_),
        "A": -(torch.rand(p.nheads, generator=g) * (A_range[1] - A_range[0]) + A_range[0]),
        "B": rnd(p.shape_of("B"), 1 / math.sqrt(p.d_state)).to(dt_),
        "C": rnd(p.shape_of("C"), 1 / math.sqrt(p.d_state)).to(dt_),
        "D": rnd((p.nheads,)),
        "dt_bias": rnd((p.nheads,), 0.5),
        "initial_state": rnd(p.shape_of("initial_state")) if init_state else None,
    }
    return {k: (v.to(device) if v is not None else None) for k, v in out.items()}


#: NaN bit patterns the GPU tests poison outputs with (quiet NaNs with a payload no arithmetic produces:
#: NVIDIA GPU arithmetic returns the canonical NaN, so an element still holding this pattern was never written)
POISON_BITS = {"float32": (torch.int32, 0x7FE5A5A5), "float16": (torch.int16, 0x7E5A), "bfloat16": (torch.int16, 0x7FE5)}


def _dtype_name(t: torch.Tensor) -> str:
    return {v: k for k, v in TORCH_DTYPES.items()}[t.dtype]


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` (fp32/fp16/bf16) with :data:`POISON_BITS` in place (on the current stream); returns ``t``."""
    int_dtype, bits = POISON_BITS[_dtype_name(t)]
    t.view(int_dtype).fill_(bits)
    return t


def count_unwritten(t: torch.Tensor) -> torch.Tensor:
    """0-d int64 tensor (on t's device, no host sync): elements of ``t`` still holding the poison pattern."""
    int_dtype, bits = POISON_BITS[_dtype_name(t)]
    return (t.view(int_dtype) == bits).sum()


def large_decay_inputs(p: SSMScanProblem, *, seed: int, chunk_sum: float = -4000.0, per: int = 256,
                       spike_rate: float = 0.1) -> dict[str, torch.Tensor]:
    """:func:`make_inputs` with step sizes whose dt*A sums reach ``chunk_sum`` every ``per`` tokens (issue 16).

    Most steps are small (raw dt ~ -4: softplus ~ 0.018); a fraction ``spike_rate`` are spikes sized per
    head so that ``per`` tokens sum to about ``chunk_sum`` (raw dt > 20: softplus passes it through). The
    running in-chunk sums reach thousands while the segments between nearby small steps stay small: what
    a segment sum built as a difference of two cumulative sums gets wrong in fp32.
    """
    out = make_inputs(p, seed=seed, A_range=(1.0, 8.0))
    g = torch.Generator().manual_seed(seed + 1)
    shape = p.shape_of("dt")
    spikes = torch.rand(shape, generator=g) < spike_rate
    spike_dt = (-chunk_sum / (spike_rate * per)) / (-out["A"])  # (nheads,)
    dt = torch.where(spikes, spike_dt.expand(shape), torch.full(shape, -4.0)) + 0.3 * torch.randn(shape, generator=g)
    out["dt"] = dt.to(TORCH_DTYPES[p.dtype])
    out["dt_bias"] = torch.zeros(p.nheads)
    return out


#: (a0, spike_dt) of :func:`overflowing_decay_inputs` for float16 inputs, where dt 1e10 is inf: A -1e37 and dt 100,
#: dt*A -1e39 (-inf in float32) on the spikes, ~ -3e36 (finite) on the other tokens
FP16_OVERFLOW = (-1e37, 100.0)


def overflowing_decay_inputs(p: SSMScanProblem, *, seed: int, a0: float | None = -1e30,
                             spike_dt: float = 1e10) -> dict[str, torch.Tensor]:
    """:func:`make_inputs` (with an initial state) where dt*A overflows float32 to -inf on some steps of head 0
    (A ``a0`` = -1e30, finite; dt + dt_bias ``spike_dt`` = 1e10 on every third token, softplus passes it through)
    while the other heads keep their ordinary values: the float64 oracle's exp(dt*A) is 0 there, a finite answer.
    ``a0`` None keeps head 0's ordinary A (dt*A ~ -1e10 there: finite, no overflow). float16: pass a spike_dt it
    holds (:data:`FP16_OVERFLOW`); ValueError for one that rounds to inf."""
    if math.isinf(torch.tensor(spike_dt, dtype=TORCH_DTYPES[p.dtype]).item()):
        raise ValueError(f"overflowing_decay_inputs: dt {spike_dt:g} is inf in {p.dtype}")
    inp = make_inputs(p, seed=seed, init_state=True)
    if a0 is not None:
        inp["A"][0] = a0
    inp["dt"][:, ::3, 0] = spike_dt
    return inp


def assert_overflow_close(ref, y: torch.Tensor, final_state: torch.Tensor, *, rel: float) -> None:
    """:func:`assert_close` for outputs of :func:`overflowing_decay_inputs` (y (..., tokens, heads, headdim),
    final_state (..., heads, headdim, d_state)), compared piece by piece so that the 1e10-sized rows of the
    dt-1e10 tokens cannot hide an error elsewhere: head 0 on those tokens, head 0 on the others, heads 1..."""
    spike = torch.zeros(y.shape[-3], dtype=torch.bool)
    spike[::3] = True
    assert_close("y head 0, dt 1e10 tokens", ref.y[..., spike, 0, :], y[..., spike, 0, :], rel=rel)
    if (~spike).any():
        assert_close("y head 0, other tokens", ref.y[..., ~spike, 0, :], y[..., ~spike, 0, :], rel=rel)
    assert_close("y heads 1..", ref.y[..., 1:, :], y[..., 1:, :], rel=rel)
    assert_close("final_state head 0", ref.final_state[..., 0, :, :], final_state[..., 0, :, :], rel=rel)
    assert_close("final_state heads 1..", ref.final_state[..., 1:, :, :], final_state[..., 1:, :, :], rel=rel)


def nan_dt_inputs(p: SSMScanProblem, *, seed: int, at: tuple[int, int, int]) -> dict[str, torch.Tensor]:
    """:func:`make_inputs` (with an initial state) with dt NaN at one (batch, token, head) ``at``: the float64
    oracle's y is NaN there and on every later token of that (batch, head), its final state NaN for it; the rest
    stays finite."""
    inp = make_inputs(p, seed=seed, init_state=True)
    inp["dt"][at] = math.nan
    return inp


def assert_nan_dt_propagated(ref, y: torch.Tensor, final_state: torch.Tensor, *, at: tuple[int, int, int],
                             finite_before: int, rel: float) -> None:
    """Outputs of :func:`nan_dt_inputs` (y (batch, tokens, heads, headdim), final_state (batch, heads, headdim,
    d_state)): NaN wherever the oracle ``ref`` is (never a finite answer made from the NaN), and close to it on every
    other (batch, head) and on that one's tokens before ``finite_before`` (a kernel may spread the NaN over the rest
    of its chunk: the oracle's y there is finite, the kernel's may not be)."""
    b, t, h = at
    assert torch.isnan(ref.y[b, t:, h]).all() and torch.isnan(ref.final_state[b, h]).all(), "oracle: no NaN"
    assert torch.isnan(y[b, t:, h]).all(), f"y: {int((~torch.isnan(y[b, t:, h])).sum())} non-NaN values from a NaN dt"
    assert torch.isnan(final_state[b, h]).all(), "final_state: non-NaN values made from a NaN dt"
    other = torch.ones(y.shape[0], y.shape[2], dtype=torch.bool)
    other[b, h] = False
    assert_close("y, other (batch, head)", ref.y.permute(0, 2, 1, 3)[other], y.permute(0, 2, 1, 3)[other], rel=rel)
    if finite_before:
        assert_close("y, before the NaN's chunk", ref.y[b, :finite_before, h], y[b, :finite_before, h], rel=rel)
    assert_close("final_state, other (batch, head)", ref.final_state[other], final_state[other], rel=rel)


def packed_large_decay_case() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A packed case of :func:`large_decay_inputs`: 3 sequences (100, 300, 112 tokens: boundaries inside chunks of
    64 and 256), 8 heads, headdim 16, ngroups 2, d_state 16, an fp32 initial state per sequence. Returns the
    ssm_scan keyword inputs (``initial_state`` (3, 8, 16, 16)) and ``cu_seqlens`` (4,) int32."""
    lengths = [100, 300, 112]
    p = SSMScanProblem(1, sum(lengths), 8, 16, 2, 16)
    inp = large_decay_inputs(p, seed=3)
    inp["initial_state"] = torch.randn(len(lengths), 8, 16, 16, generator=torch.Generator().manual_seed(4))
    return inp, torch.tensor([0, 100, 400, 512], dtype=torch.int32)


def assert_cumsum_trt_safe(nodes, initializers=()) -> None:
    """Every CumSum (the segment sums, one per scan) on axis -2 with default attributes: the TensorRT
    ICumulativeLayer bugs need CumSums on different axes (TensorRT#4551) or differing reverse (#4513)."""
    import onnx

    def walk(ns):  # the nodes, and those of If/Loop branches (the chunked SSD is the else branch of If(L == 1))
        for n in ns:
            yield n
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    yield from walk(a.g.node)

    nodes = list(walk(nodes))
    values = {t.name: onnx.numpy_helper.to_array(t) for t in initializers}
    values.update({n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t) for n in nodes
                   if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"})
    cums = [n for n in nodes if n.op_type == "CumSum"]
    assert cums, "the segment sums are one CumSum per scan"
    assert all(not n.attribute for n in cums), [n.attribute for n in cums]
    assert {int(values[n.input[1]]) for n in cums} == {-2}


#: HF transformers Mamba2Config shapes for :func:`hf_init_checkpoint`
HF_SHAPES = {
    # state-spaces/mamba2-130m: d_model 768, 24 layers, d_state 128, headdim 64 (vocab padded to 16)
    "mamba2-130m": dict(hidden_size=768, num_hidden_layers=24, state_size=128, expand=2, head_dim=64,
                        num_heads=24, n_groups=1, vocab_size=50288, chunk_size=256),
    # test size; initializer_range 0.3 gives dt up to 16 and in-chunk sums of dt*A near -3,600 (like the 130m)
    "large-dt-small": dict(hidden_size=256, num_hidden_layers=2, state_size=32, expand=2, head_dim=32,
                           num_heads=16, n_groups=2, vocab_size=256, chunk_size=256, initializer_range=0.3),
}


def hf_init_checkpoint(outdir, shape: str, *, seed: int = 0, tie: bool = False):
    """Write a random HF ``Mamba2ForCausalLM`` with *transformers'* default init (``save_pretrained``).

    transformers' ``_init_weights`` (initializer_range 0.1, A_log = log(1..nheads)) gives far larger step
    sizes than mamba_ssm's init: on the 130m shape dt reaches 6-10 and in-chunk sums of dt*A -1,300 to
    -4,900, the regime of issue 16. Reuses ``outdir`` when its config.json exists. Returns the Path.
    """
    from pathlib import Path

    import transformers

    out = Path(outdir)
    if not (out / "config.json").is_file():
        torch.manual_seed(seed)
        cfg = transformers.Mamba2Config(**HF_SHAPES[shape], tie_word_embeddings=tie)
        transformers.Mamba2ForCausalLM(cfg).eval().save_pretrained(str(out))
    return out


def run_named(model, ids, past=None):
    """A :class:`Mamba2LMHeadModel` call with the exported graphs' output names (numpy arrays).

    Returns ({"logits", "present_conv_state.{i}", "present_ssm_state.{i}"}, (conv_states, ssm_states)),
    the second item to pass back as ``past`` for a continuation.
    """
    with torch.no_grad():
        o = model(ids, *(past or (None, None)))
    out = {"logits": o.logits.numpy()}
    out.update({f"present_conv_state.{i}": c.numpy() for i, c in enumerate(o.conv_states)})
    out.update({f"present_ssm_state.{i}": s.numpy() for i, s in enumerate(o.ssm_states)})
    return out, (o.conv_states, o.ssm_states)


def scan_stats(model, ids, window: int | None = None) -> tuple[float, float, float]:
    """(max dt, most negative and least negative per-layer minimum of the in-chunk running sum of dt*A)
    over one forward of ``model`` on ``ids`` (chunks of ``window`` tokens, default the model's chunk_size)."""
    from m2export.kernels.ssd.naive import dt_transform

    seen = []
    fns = [m.scan_fn for m in model.mixers]

    def recording(fn):
        def f(x, dt, A, B, C, D=None, dt_bias=None, initial_state=None, **kw):
            d = dt_transform(dt, dt_bias, dt_limit=kw["dt_limit"])
            Q = window or kw["chunk_size"]
            cs = min(torch.cumsum(d[:, i:i + Q] * A, 1).min().item() for i in range(0, d.shape[1], Q))
            seen.append((d.max().item(), cs))
            return fn(x, dt, A, B, C, D, dt_bias, initial_state, **kw)
        return f

    for m, fn in zip(model.mixers, fns):
        m.scan_fn = recording(fn)
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for m, fn in zip(model.mixers, fns):
            m.scan_fn = fn
    return max(s[0] for s in seen), min(s[1] for s in seen), max(s[1] for s in seen)


def nan_outputs(p: SSMScanProblem, device="cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """SSMScan output buffers poisoned with NaN (:func:`poison_`) before a kernel writes them: y (batch,
    seqlen, nheads, headdim) in p.dtype and final_state (batch, nheads, headdim, d_state) fp32."""
    y = torch.empty(p.shape_of("y"), dtype=TORCH_DTYPES[p.dtype], device=device)
    fs = torch.empty(p.shape_of("final_state"), dtype=torch.float32, device=device)
    return poison_(y), poison_(fs)


def oracle_case(p: SSMScanProblem, *, seed: int, dt_limit: tuple[float, float], device="cuda", **kw):
    """(ref, dev, y, final_state): the float64 token-by-token oracle's outputs on fresh inputs of ``p``
    (``make_inputs(p, seed=seed, **kw)``), those inputs contiguous on ``device`` (dict by contract
    name) and NaN-poisoned output buffers there (:func:`nan_outputs`)."""
    from m2export.kernels.ssd.naive import ssm_scan_recurrent

    inp = make_inputs(p, seed=seed, device="cpu", **kw)
    ref = ssm_scan_recurrent(**inp, dt_limit=dt_limit)
    dev = {k: (v.to(device).contiguous() if v is not None else None) for k, v in inp.items()}
    return (ref, dev, *nan_outputs(p, device))


#: error bounds of the cuTile SSD forward kernel vs the float64 oracle (rel-L2 of y and final_state), shared by
#: tests/kernels/test_ssd.py and the plugin tests that run the same kernel (JIT impl body, AOT launch)
SSD_Y_REL = {"float32": 2e-4, "float16": 5e-3, "bfloat16": 2e-2}
SSD_STATE_REL = {"float32": 2e-4, "float16": 5e-3, "bfloat16": 2e-2}


def cutile_skip_reason() -> str | None:
    """Why the cuTile kernels cannot run here (no CUDA device, cuda.tile missing), or None."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import cuda.tile  # noqa: F401  (availability check)
    except ImportError as e:
        return f"cuda.tile not importable: {e}"
    return None


_CUTILE_WHY = cutile_skip_reason()
#: skip marker for tests that launch cuTile kernels
requires_cutile = pytest.mark.skipif(_CUTILE_WHY is not None, reason=_CUTILE_WHY or "")


def tileiras_skip_reason() -> str | None:
    """Why cuTile kernels cannot be compiled here (no tileiras on PATH nor from the
    nvidia-cuda-tileiras wheel that cuda.tile finds by itself), or None."""
    if shutil.which("tileiras"):
        return None
    try:
        import nvidia.cu13 as cu13  # the wheel layout of nvidia-cuda-tileiras
    except ImportError:
        cu13 = None
    for root in getattr(cu13, "__path__", []):
        if os.access(os.path.join(root, "bin", "tileiras"), os.X_OK):
            return None
    return "tileiras (cuTile compiler) not found: not on PATH, no nvidia-cuda-tileiras wheel (pip install 'cuda-tile[tileiras]')"


def assert_usage_error(argv: list[str], msg: str, capsys) -> None:
    """``m2export *argv`` is an argparse usage error: exit 2, stderr one ``error:`` line holding ``msg`` and a
    ``hint:`` line, no traceback."""
    from m2export.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 2 and msg in lines[0] and lines[0].startswith("error: "), err
    assert lines[1].startswith("hint: ") and "Traceback" not in err, err


def kernel_entry_points() -> tuple:
    """``(module, name)`` of every kernel entry point the PyTorch model's "cutile" backend calls (conv prefill and
    one-token update, scan, gated norm): what ``kernels_on_torch`` (tests/conftest.py) stands in for."""
    import m2export.kernels.conv1d as conv
    import m2export.kernels.gated_norm as norm
    import m2export.kernels.ssd as ssd

    return (conv, "causal_conv1d"), (conv, "conv_update"), (ssd, "ssm_scan"), (norm, "gated_rmsnorm")
