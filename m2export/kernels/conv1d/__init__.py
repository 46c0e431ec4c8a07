"""CausalConv1d (depthwise causal conv1d with state, + SiLU): public entry points over explicit backends.

``backend="cutile"``: :mod:`m2export.kernels.conv1d.cutile` (imported lazily); ``backend="torch"``:
:mod:`m2export.kernels.conv1d.naive`. No silent fallback. The op's definition: m2export/contract_conv1d.py.
"""

from __future__ import annotations

import torch

from m2export.contract_conv1d import check_activation, validate, validate_update
from m2export.errors import ContractError
from m2export.kernels.conv1d.naive import Conv1dOutput, causal_conv1d_ref, conv_update_ref
from m2export.kernels._host import BACKENDS, check_out, require_cuda_tile

__all__ = ["causal_conv1d", "conv_update", "causal_conv1d_ref", "conv_update_ref", "Conv1dOutput"]


def conv_out_buffers(x, problem, out=None, state_out=None, *, allocate: bool = False):
    """Check the caller's ``out`` ((batch, seqlen, conv_dim), dtype of x) and ``state_out`` ((batch,
    conv_dim, d_conv-1), dtype of x), contiguous, with :func:`check_out`; with ``allocate``, make
    empty ones for those not given. Returns (y buffer or None, state buffer or None)."""
    if out is not None:
        check_out("out", out, problem.shape_of("y"), x.dtype, x.device)
    elif allocate:
        out = torch.empty(problem.shape_of("y"), dtype=x.dtype, device=x.device)
    if state_out is not None:
        check_out("state_out", state_out, problem.shape_of("final_conv_state"), x.dtype, x.device)
    elif allocate:
        state_out = torch.empty(problem.shape_of("final_conv_state"), dtype=x.dtype, device=x.device)
    return out, state_out


def _backend(backend: str, tensors: dict) -> None:
    if backend not in BACKENDS:
        raise ContractError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "cutile":
        require_cuda_tile(tensors)


def causal_conv1d(x, weight, bias=None, conv_state=None, *, activation: str = "silu", backend: str = "cutile",
                  out=None, state_out=None, stream=None) -> Conv1dOutput:
    """Depthwise causal conv1d with state, then SiLU: the prefill of Mamba-2's conv (op m2export::CausalConv1d)::

        xp = concat(conv_state, x) per channel                        # (batch, conv_dim, d_conv - 1 + seqlen)
        y[b, t, c] = act(bias[c] + sum_k weight[c, k] * xp[b, c, t + k])
        final_conv_state = xp[:, :, seqlen:]                          # the last d_conv - 1 inputs

    Args:
        x: (batch, seqlen, conv_dim) bf16 | fp16 | fp32, channels last; may be a strided view
            (e.g. the xBC slice of the in_proj output) as long as the last stride is 1.
        weight: (conv_dim, d_conv) (nn.Conv1d's (conv_dim, 1, d_conv) squeezed), dtype of x; d_conv 2..4.
        bias: (conv_dim,) dtype of x, or None.
        conv_state: (batch, conv_dim, d_conv - 1), dtype of x, or None (zeros).
        activation: "silu" (Mamba-2) or "none".
        backend: "cutile" (CUDA, cuda.tile) or "torch" (naive.causal_conv1d_ref, any device).
        out, state_out: optional preallocated contiguous y / final_conv_state (state_out must not be conv_state).
        stream: None, a torch.cuda.Stream or a raw cudaStream_t int ("cutile").

    Returns:
        Conv1dOutput(y (batch, seqlen, conv_dim) contiguous, final_conv_state (batch, conv_dim, d_conv - 1)),
        both in x.dtype.

    Raises:
        ContractError: an argument breaks the contract (m2export/contract_conv1d.py) or an unusable out=.
        BackendUnavailable: backend="cutile" without CUDA / cuda.tile or with CPU tensors.

    Source: mamba_ssm/modules/mamba2.py (Mamba2.forward); Dao-AILab/causal-conv1d causal_conv1d_fn.
    """
    p = validate(x, weight, bias, conv_state)
    check_activation(activation)
    _backend(backend, dict(x=x, weight=weight, bias=bias, conv_state=conv_state))
    if (state_out is not None and conv_state is not None
            and state_out.untyped_storage().data_ptr() == conv_state.untyped_storage().data_ptr()):
        raise ContractError("state_out: must not alias conv_state in the prefill (conv_update updates in place)")
    if backend == "torch":
        conv_out_buffers(x, p, out, state_out)
        res = causal_conv1d_ref(x, weight, bias, conv_state, activation=activation)
        if out is not None:
            out.copy_(res.y)
        if state_out is not None:
            state_out.copy_(res.final_conv_state)
        return Conv1dOutput(res.y if out is None else out, res.final_conv_state if state_out is None else state_out)
    from m2export.kernels.conv1d.cutile import causal_conv1d_cutile

    return causal_conv1d_cutile(x, weight, bias, conv_state, problem=p, silu=activation == "silu", out=out,
                                state_out=state_out, stream=stream)


def conv_update(x, conv_state, weight, bias=None, *, activation: str = "silu", backend: str = "cutile",
                out=None, stream=None) -> Conv1dOutput:
    """One decode token of CausalConv1d, updating ``conv_state`` IN PLACE (both backends)::

        y[b, c] = act(bias[c] + sum_{k < d_conv-1} weight[c, k] * conv_state[b, c, k] + weight[c, d_conv-1] * x[b, c])
        conv_state[b, c] <- concat(conv_state[b, c, 1:], x[b, c])

    Args:
        x: (batch, conv_dim), dtype bf16 | fp16 | fp32, last stride 1 (may be a strided view).
        conv_state: (batch, conv_dim, d_conv - 1), dtype of x, contiguous; overwritten with the new state.
        weight, bias, activation, backend, stream: as :func:`causal_conv1d`.
        out: optional preallocated contiguous y (batch, conv_dim).

    Returns:
        Conv1dOutput(y (batch, conv_dim) in x.dtype, conv_state (the same tensor, updated)).

    Raises:
        ContractError / BackendUnavailable: as :func:`causal_conv1d`; a non-contiguous conv_state.

    Source: mamba_ssm/modules/mamba2.py (Mamba2.step); causal-conv1d causal_conv1d_update.
    """
    p = validate_update(x, conv_state, weight, bias)
    check_activation(activation)
    _backend(backend, dict(x=x, weight=weight, bias=bias, conv_state=conv_state))
    if backend == "torch":
        res = conv_update_ref(x, conv_state, weight, bias, activation=activation)
        conv_state.copy_(res.final_conv_state)
        if out is not None:
            check_out("out", out, (p.batch, p.conv_dim), x.dtype, x.device)
            out.copy_(res.y)
        return Conv1dOutput(res.y if out is None else out, conv_state)
    from m2export.kernels.conv1d.cutile import conv_update_cutile

    return conv_update_cutile(x, conv_state, weight, bias, problem=p, silu=activation == "silu", out=out,
                              stream=stream)
