"""Plain-PyTorch references of SSMScan (see m2export/contract.py for the semantics).

* :func:`ssm_scan_recurrent` - the oracle: token by token, float64 by default.
* :func:`ssm_scan_chunked` - the chunked SSD algorithm every kernel and graph reproduces,
  float32 internals, any ``seqlen`` (padded internally; padded steps neither decay nor add).
* Stage references with the same names the cuTile kernels use: :func:`dt_transform`,
  :func:`chunk_cumsum_ref`, :func:`segment_sums_ref`, :func:`chunk_state_ref`, :func:`state_passing_ref`,
  :func:`chunk_scan_ref`.

Source: Dao & Gu, "Transformers are SSMs" (arXiv:2405.21060), Sec. 6 and Listing 1; the stage
split follows mamba_ssm/ops/triton/ssd_{chunk_state,state_passing,chunk_scan}.py.
Imports only torch: usable on CPU CI and by the exporter.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from m2export.contract import SSMScanAttrs, validate
from m2export.errors import ContractError


class SSMScanOutput(NamedTuple):
    """y: (batch, seqlen, nheads, headdim) in x.dtype; final_state: (batch, nheads, headdim, d_state) fp32."""

    y: torch.Tensor
    final_state: torch.Tensor


def softplus_stable(v: torch.Tensor) -> torch.Tensor:
    """softplus with the large-input passthrough of torch/mamba_ssm: v if v > 20 else log1p(exp(v))."""
    return torch.where(v > 20.0, v, torch.log1p(torch.exp(torch.clamp(v, max=20.0))))


def dt_transform(dt: torch.Tensor, dt_bias: torch.Tensor | None, *, dt_softplus: bool = True,
                 dt_limit: tuple[float, float] = (0.0, math.inf), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Step size Δ = clamp(softplus(dt + dt_bias), *dt_limit), computed in ``dtype``.

    Args:
        dt: (batch, seqlen, nheads), any float dtype. dt_bias: (nheads,) or None.
    Returns:
        (batch, seqlen, nheads) in ``dtype``.
    """
    v = dt.to(dtype)
    if dt_bias is not None:
        v = v + dt_bias.to(dtype)
    if dt_softplus:
        v = softplus_stable(v)
    lo, hi = dt_limit
    # always clamp at dt_min (>= 0): a negative step would grow the state and break chunk-order independence
    return torch.clamp(v, min=lo, max=hi if math.isfinite(hi) else None)


def check_decay(A: torch.Tensor) -> None:
    """Raise ContractError unless every A is finite and <= 0 (the contract: A = -exp(A_log); a growing state is
    undefined, a NaN one poisons every later token)."""
    if A.numel() and bool(((A > 0) | ~torch.isfinite(A)).any()):  # NaN > 0 is False: test finiteness too
        bad = A[(A > 0) | ~torch.isfinite(A)]
        raise ContractError(f"A: expected A <= 0 and finite (A = -exp(A_log)), got {bad[0].item():.4g} "
                            f"(max(A) = {A.max().item():.4g})")


def _as_fp32_spec(t):
    """``t``, or for a float64 tensor a float32 meta tensor of its shape (what :func:`validate` reads)."""
    return torch.empty(t.shape, dtype=torch.float32, device="meta") if t is not None and t.dtype == torch.float64 else t


def _expand_groups(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """(b, l, ngroups, n) -> (b, l, nheads, n), head h reading group h // (nheads // ngroups)."""
    return t.repeat_interleave(nheads // t.shape[2], dim=2)


def ssm_scan_recurrent(x, dt, A, B, C, D=None, dt_bias=None, initial_state=None, *, dt_softplus: bool = True,
                       dt_limit: tuple[float, float] = (0.0, math.inf),
                       dtype: torch.dtype = torch.float64) -> SSMScanOutput:
    """The oracle: SSMScan evaluated token by token in ``dtype`` (float64 by default).

    Shapes as in :mod:`m2export.contract`; the dtypes too, except that float64 tensors are accepted wherever the
    contract has float32 or x's dtype (checked as if they were float32; a float64 model's forward,
    :func:`~m2export.models.reference.float64_model`, feeds its scan unrounded). Returns y and final_state in
    ``dtype``. Raises ContractError on arguments that break the contract.
    """
    attrs = SSMScanAttrs.make(dt_softplus=dt_softplus, dt_limit=dt_limit)
    p = validate(*(_as_fp32_spec(t) for t in (x, dt, A, B, C, D, dt_bias, initial_state)))
    check_decay(A)
    delta = dt_transform(dt, dt_bias, dt_softplus=dt_softplus, dt_limit=attrs.dt_limit, dtype=dtype)
    xs, Bs, Cs = x.to(dtype), _expand_groups(B.to(dtype), p.nheads), _expand_groups(C.to(dtype), p.nheads)
    Ad = A.to(dtype)
    h = (initial_state.to(dtype).clone() if initial_state is not None
         else torch.zeros(p.batch, p.nheads, p.headdim, p.d_state, dtype=dtype, device=x.device))
    ys = []
    for t in range(p.seqlen):
        d = delta[:, t]  # (b, h)
        decay = torch.exp(d * Ad)  # (b, h)
        h = decay[:, :, None, None] * h + (d[:, :, None] * xs[:, t])[..., None] * Bs[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, Cs[:, t]))
    y = torch.stack(ys, dim=1) if ys else xs.new_zeros(xs.shape)
    if D is not None:
        y = y + D.to(dtype)[:, None] * xs
    return SSMScanOutput(y, h)


# ---------------------------------------------------------------- chunked SSD, stage by stage
def chunk_cumsum_ref(delta: torch.Tensor, A: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Within-chunk inclusive cumulative sum of dt*A (the decay from the chunk start to each token).

    Args:
        delta: (batch, nchunks, chunk_size, nheads) fp32 step sizes (0 on padded steps).
        A: (nheads,) fp32.
    Returns:
        dA_cumsum: (batch, nchunks, chunk_size, nheads) fp32, <= 0.
    """
    return torch.cumsum(delta * A.float(), dim=2)


def segment_sums_ref(dA: torch.Tensor) -> torch.Tensor:
    """Segment sums of dt*A inside each chunk, each summed from its own terms.

    ``seg[..., i, j, :] = sum_{j < k <= i} dA[..., k, :]`` for j <= i, 0 above the diagonal (empty sum).
    Computed as a running sum down ``i`` of ``dA_k`` masked to ``k > j`` (the ``segsum`` of HF
    transformers' Mamba-2 and of arXiv:2405.21060 Listing 1), *not* as ``cs_i - cs_j``: the difference of
    two chunk-long cumulative sums carries the fp32 rounding of the sums' magnitude (thousands when dt is
    large), an absolute error of ~1e-4 in every decay exponent, where this sum is accurate to the fp32
    rounding of the segment's own terms (all terms <= 0, so every partial sum is bounded by the segment).

    Args:
        dA: (batch, nchunks, chunk_size, nheads) fp32, <= 0.
    Returns:
        seg: (batch, nchunks, chunk_size (i), chunk_size (j), nheads) fp32, <= 0.
    """
    L = dA.shape[2]
    strict = torch.ones(L, L, dtype=torch.bool, device=dA.device).tril(-1)[None, None, :, :, None]  # [k, j]: k > j
    terms = torch.where(strict, dA[:, :, :, None, :], torch.zeros((), dtype=dA.dtype, device=dA.device))
    return torch.cumsum(terms, dim=2)


def chunk_state_ref(x, B, delta, seg):
    """State contributed by each chunk alone (zero state at chunk start).

    Args: x (b, c, l, h, p) fp32; B (b, c, l, h, n) fp32 (groups expanded); delta (b, c, l, h) fp32;
    seg (b, c, l, l, h) from :func:`segment_sums_ref` (its last row is the decay from each token to the chunk end).
    Returns: states (b, c, h, p, n) fp32.
    """
    decay_to_end = torch.exp(seg[:, :, -1])  # (b, c, l, h): exp(sum_{k > j} dA_k)
    return torch.einsum("bclhn,bclhp->bchpn", B, (decay_to_end * delta)[..., None] * x)


def state_passing_ref(states, dA_cumsum, initial_state):
    """Carry the state across chunks.

    Args: states (b, c, h, p, n) fp32; dA_cumsum (b, c, l, h); initial_state (b, h, p, n) fp32.
    Returns: (prev_states (b, c, h, p, n): state entering each chunk, final_state (b, h, p, n)).
    """
    chunk_decay = torch.exp(dA_cumsum[:, :, -1, :])  # (b, c, h), total decay of each chunk
    prev = []
    s = initial_state
    for c in range(states.shape[1]):
        prev.append(s)
        s = chunk_decay[:, c, :, None, None] * s + states[:, c]
    return torch.stack(prev, dim=1), s


def chunk_scan_ref(x, B, C, delta, dA_cumsum, seg, prev_states):
    """Output of each chunk: intra-chunk (C·Bᵀ masked decay) plus inter-chunk (C·state_in) terms.

    Args: x (b, c, l, h, p); B, C (b, c, l, h, n); delta, dA_cumsum (b, c, l, h); seg (b, c, l, l, h) from
    :func:`segment_sums_ref`; prev_states (b, c, h, p, n); all fp32.
    Returns: y (b, c, l, h, p) fp32, without the D skip.
    """
    L = x.shape[2]
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()[None, None, :, :, None]
    # mask before exp: seg is a finite sum (0 above the diagonal), exp of it is kept on j <= i only (no inf*0)
    decay = torch.where(causal, torch.exp(seg), torch.zeros((), device=x.device))
    cb = torch.einsum("bcihn,bcjhn->bcijh", C, B)
    y_diag = torch.einsum("bcijh,bcjhp->bcihp", cb * decay, delta[..., None] * x)
    y_off = torch.einsum("bclhn,bchpn->bclhp", C * torch.exp(dA_cumsum)[..., None], prev_states)
    return y_diag + y_off


def ssm_scan_chunked(x, dt, A, B, C, D=None, dt_bias=None, initial_state=None, *, chunk_size: int = 256,
                     dt_softplus: bool = True, dt_limit: tuple[float, float] = (0.0, math.inf)) -> SSMScanOutput:
    """Chunked SSD in plain PyTorch with float32 internals; the semantics of m2export::SSMScan v1.

    Args:
        x: (batch, seqlen, nheads, headdim), fp32/fp16/bf16.
        dt: (batch, seqlen, nheads), dtype of x, raw (before dt_bias/softplus).
        A: (nheads,) fp32, negative.  B, C: (batch, seqlen, ngroups, d_state), dtype of x.
        D, dt_bias: (nheads,) fp32 or None.  initial_state: (batch, nheads, headdim, d_state) fp32 or None.
        chunk_size: tokens per chunk (>= 1); seqlen need not be a multiple.
    Returns:
        SSMScanOutput(y in x.dtype, final_state fp32).
    Raises:
        ContractError: see :func:`m2export.contract.validate`.
    Source:
        arXiv:2405.21060 Listing 1 (ssd_minimal): fp32 segment sums built from their own terms
        (:func:`segment_sums_ref`), masking before exp.
    """
    dt_limit = SSMScanAttrs.make(chunk_size=chunk_size, dt_softplus=dt_softplus, dt_limit=dt_limit).dt_limit
    p = validate(x, dt, A, B, C, D, dt_bias, initial_state)
    check_decay(A)
    f32 = torch.float32
    chunk_size = min(chunk_size, max(1, p.seqlen))  # evaluation order only: never pad past one sequence
    delta = dt_transform(dt, dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)  # (b, l, h)
    nchunks = max(1, -(-p.seqlen // chunk_size))
    pad = nchunks * chunk_size - p.seqlen
    xf = F.pad(x.to(f32), (0, 0, 0, 0, 0, pad))
    Bf = F.pad(_expand_groups(B.to(f32), p.nheads), (0, 0, 0, 0, 0, pad))
    Cf = F.pad(_expand_groups(C.to(f32), p.nheads), (0, 0, 0, 0, 0, pad))
    delta = F.pad(delta, (0, 0, 0, pad))  # padded steps: delta = 0 -> no decay, no input

    def chunks(t):
        return t.reshape(p.batch, nchunks, chunk_size, *t.shape[2:])

    xc, Bc, Cc, dc = chunks(xf), chunks(Bf), chunks(Cf), chunks(delta)
    cs = chunk_cumsum_ref(dc, A, chunk_size)
    seg = segment_sums_ref(dc * A.float())
    states = chunk_state_ref(xc, Bc, dc, seg)
    h0 = (initial_state.to(f32) if initial_state is not None
          else torch.zeros(p.batch, p.nheads, p.headdim, p.d_state, dtype=f32, device=x.device))
    prev_states, final_state = state_passing_ref(states, cs, h0)
    y = chunk_scan_ref(xc, Bc, Cc, dc, cs, seg, prev_states)
    y = y.reshape(p.batch, nchunks * chunk_size, p.nheads, p.headdim)[:, : p.seqlen]
    if D is not None:
        y = y + D.to(f32)[:, None] * x.to(f32)
    return SSMScanOutput(y.to(x.dtype), final_state)
