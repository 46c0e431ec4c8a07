"""Plain-PyTorch references of packed variable-length SSMScan (``cu_seqlens``; contract: m2export/contract.py).

* :func:`ssm_scan_packed_recurrent` -- the oracle: each sequence token by token (float64 by default),
  which is the definition (sequences are independent scans laid end to end).
* :func:`ssm_scan_packed_chunked` -- the chunked SSD algorithm over the *packed* token axis, chunks
  straddling sequence boundaries as a single-launch kernel sees them (mamba_ssm's ``seq_idx``
  semantics): the intra-chunk product is masked to pairs of one sequence, a token reads the state
  carried into its chunk only if its sequence began before the chunk (else its own initial state,
  decayed from its start), and each sequence's final state is taken at its last token.

Float32 internals, masking before exp (no inf*0), segment sums summed from their own terms
(:func:`~m2export.kernels.ssd.naive.segment_sums_ref`, never a difference of two cumulative sums: issue 16).
Imports only torch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from m2export.contract import SSMScanAttrs, check_cu_seqlens, validate_packed
from m2export.kernels.ssd.naive import (SSMScanOutput, _expand_groups, check_decay, dt_transform,
                                        segment_sums_ref, ssm_scan_recurrent)


def _offsets(cu_seqlens, seqlen: int) -> list[int]:
    return check_cu_seqlens(cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else cu_seqlens, seqlen)


def ssm_scan_packed_recurrent(x, dt, A, B, C, D=None, dt_bias=None, initial_state=None, *, cu_seqlens,
                              dt_softplus: bool = True, dt_limit: tuple[float, float] = (0.0, math.inf),
                              dtype: torch.dtype = torch.float64) -> SSMScanOutput:
    """The packed oracle: :func:`~m2export.kernels.ssd.naive.ssm_scan_recurrent` on each sequence's tokens.

    Shapes: x (1, total, nheads, headdim) etc.; cu_seqlens (nseq + 1,) int32; initial_state
    (nseq, nheads, headdim, d_state) fp32 or None. Returns y (1, total, ...) and final_state
    (nseq, nheads, headdim, d_state), both in ``dtype``.
    """
    p, nseq = validate_packed(x, dt, A, B, C, D, dt_bias, initial_state, cu_seqlens=cu_seqlens)
    cu = _offsets(cu_seqlens, p.seqlen)
    ys, states = [], []
    for s in range(nseq):
        a, b = cu[s], cu[s + 1]
        h0 = initial_state[s:s + 1] if initial_state is not None else None
        r = ssm_scan_recurrent(x[:, a:b], dt[:, a:b], A, B[:, a:b], C[:, a:b], D, dt_bias, h0,
                               dt_softplus=dt_softplus, dt_limit=dt_limit, dtype=dtype)
        ys.append(r.y)
        states.append(r.final_state)
    return SSMScanOutput(torch.cat(ys, dim=1), torch.cat(states, dim=0))


def ssm_scan_packed_chunked(x, dt, A, B, C, D=None, dt_bias=None, initial_state=None, *, cu_seqlens,
                            chunk_size: int = 256, dt_softplus: bool = True,
                            dt_limit: tuple[float, float] = (0.0, math.inf)) -> SSMScanOutput:
    """Chunked SSD over the packed axis with sequence boundaries inside chunks (see the module docstring).

    Returns y (1, total, nheads, headdim) in x.dtype and final_state (nseq, nheads, headdim, d_state) fp32.
    Raises ContractError for arguments that break the packed contract.
    """
    dt_limit = SSMScanAttrs.make(chunk_size=chunk_size, dt_softplus=dt_softplus, dt_limit=dt_limit).dt_limit
    p, nseq = validate_packed(x, dt, A, B, C, D, dt_bias, initial_state, cu_seqlens=cu_seqlens)
    check_decay(A)
    cu = _offsets(cu_seqlens, p.seqlen)
    f32, dev, T, H = torch.float32, x.device, p.seqlen, p.nheads
    Q = max(1, min(chunk_size, T))
    nchunks = max(1, -(-T // Q))
    pad = nchunks * Q - T
    seq = torch.zeros(T + pad, dtype=torch.long, device=dev)  # sequence of each token; padding: nseq (none)
    for s in range(nseq):
        seq[cu[s]:cu[s + 1]] = s
    seq[T:] = nseq
    start = torch.tensor(cu[:-1], device=dev)[seq.clamp(max=nseq - 1)]  # first token of each token's sequence
    delta = F.pad(dt_transform(dt, dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)[0], (0, 0, 0, pad))
    xf = F.pad(x[0].to(f32), (0, 0, 0, 0, 0, pad))
    Bf = F.pad(_expand_groups(B.to(f32), H)[0], (0, 0, 0, 0, 0, pad))
    Cf = F.pad(_expand_groups(C.to(f32), H)[0], (0, 0, 0, 0, 0, pad))
    h0 = (initial_state.to(f32) if initial_state is not None
          else torch.zeros(nseq, H, p.headdim, p.d_state, dtype=f32, device=dev))
    final = h0.clone()  # empty sequences keep their initial state
    y = torch.zeros(nchunks * Q, H, p.headdim, dtype=f32, device=dev)
    carry = h0[0]  # state entering the chunk, for the sequence that is running at the chunk's start
    idx = torch.arange(Q, device=dev)
    causal = idx[:, None] >= idx[None, :]
    for c in range(nchunks):
        sl = slice(c * Q, (c + 1) * Q)
        sq, st = seq[sl], start[sl]
        dA = delta[sl] * A.float()  # (Q, H)
        cs = torch.cumsum(dA, dim=0)  # (Q, H) inclusive: decay from the chunk start
        seg = segment_sums_ref(dA[None, None])[0, 0]  # (i, j, H): sum_{j<k<=i} dA_k, from its own terms
        begun_before = st < c * Q  # token's sequence started in an earlier chunk: reads the carry
        # decay from the start of the token's sequence (or of the chunk, if it began before) to the token:
        # seg[i, start - 1] when the sequence starts inside the chunk after its first token, else cs_i
        local = st - c * Q
        from_start = torch.where((local >= 1)[:, None], seg[idx, (local - 1).clamp(min=0)], cs)  # (Q, H)
        same = (sq[:, None] == sq[None, :]) & causal  # (Q, Q) pairs of one sequence, j <= i
        decay = torch.where(same[..., None], torch.exp(seg), torch.zeros((), device=dev))
        cb = torch.einsum("ihn,jhn->ijh", Cf[sl], Bf[sl])
        y_in = torch.einsum("ijh,jhp->ihp", cb * decay, delta[sl][..., None] * xf[sl])
        # the state each token's sequence enters the chunk with: the carry, or the sequence's initial state
        base = torch.where(begun_before[:, None, None, None], carry[None],
                           h0[sq.clamp(max=nseq - 1)])  # (Q, H, P, N)
        y_off = torch.einsum("ihn,ihpn->ihp", Cf[sl] * torch.exp(from_start)[..., None], base)
        y[sl] = y_in + y_off
        # state at each token t that ends a sequence in this chunk, and at the chunk's last token (the carry)
        ends = [(s, cu[s + 1] - 1 - c * Q) for s in range(nseq) if cu[s] < cu[s + 1] and
                c * Q <= cu[s + 1] - 1 < (c + 1) * Q]
        last = Q - 1
        points = ends + ([(None, last)] if int(sq[last]) < nseq else [])
        for s, t in points:
            own = (sq == sq[t]) & (idx <= t)  # tokens of t's sequence up to t in this chunk
            w = torch.where(own[:, None], delta[sl] * torch.exp(seg[t]), torch.zeros((), device=dev))
            state = torch.einsum("jhn,jhp->hpn", Bf[sl], w[..., None] * xf[sl])
            b0 = carry if bool(begun_before[t]) else h0[int(sq[t])]
            state = state + torch.exp(from_start[t])[:, None, None] * b0
            if s is not None:
                final[s] = state
            else:
                carry = state
    y = y[:T][None]
    if D is not None:
        y = y + D.to(f32)[:, None] * x.to(f32)
    return SSMScanOutput(y.to(x.dtype), final)
