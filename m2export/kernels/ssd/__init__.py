"""SSMScan forward (prefill): one public entry point over explicit backends.

``backend="cutile"`` runs the cuTile kernels of :mod:`m2export.kernels.ssd.cutile` (imported
lazily: importing this package needs neither CUDA nor ``cuda.tile``); ``backend="torch"`` runs
the plain-PyTorch chunked reference :func:`m2export.kernels.ssd.naive.ssm_scan_chunked` on any
device. An unusable backend raises :class:`~m2export.errors.BackendUnavailable`; nothing ever
falls back silently.
"""

from __future__ import annotations

import math

from m2export.contract import SSMScanAttrs
from m2export.kernels._host import BACKENDS, SUPPORTED_DIMS, into_buffers, out_buffers, require_cutile, validated
from m2export.kernels.ssd.naive import SSMScanOutput, ssm_scan_chunked, ssm_scan_recurrent

__all__ = ["ssm_scan", "SSMScanOutput", "ssm_scan_chunked", "ssm_scan_recurrent", "BACKENDS", "SUPPORTED_DIMS"]


def ssm_scan(x, dt, A, B, C, D=None, dt_bias=None, initial_state=None, *, chunk_size: int = 256,
             dt_softplus: bool = True, dt_limit: tuple[float, float] = (0.0, math.inf), backend: str = "cutile",
             out=None, final_state_out=None, stream=None, cu_seqlens=None, tiles=None) -> SSMScanOutput:
    """Chunked selective scan (SSD) of one Mamba-2 layer; the semantics of ONNX op m2export::SSMScan v1.

    Per head h and token t, with dt_t = clamp(softplus(dt_t + dt_bias_h), *dt_limit)::

        ssm_state_t = exp(dt_t * A_h) * ssm_state_{t-1} + dt_t * outer(x_t, B_t)    # (headdim, d_state)
        y_t         = ssm_state_t @ C_t + D_h * x_t                                  # (headdim,)

    Args:
        x: (batch, seqlen, nheads, headdim), bf16 | fp16 | fp32. SSM input after conv1d + SiLU.
        dt: (batch, seqlen, nheads), dtype of x. Raw step size, before dt_bias and softplus.
        A: (nheads,) fp32, negative (A = -exp(A_log)).
        B, C: (batch, seqlen, ngroups, d_state), dtype of x; head h reads group h // (nheads // ngroups).
        D: (nheads,) fp32 skip weight, or None.
        dt_bias: (nheads,) fp32, or None.
        initial_state: (batch, nheads, headdim, d_state) fp32, or None (zeros).
        chunk_size: evaluation order of the "torch" backend (>= 1); the cuTile kernel picks its own
            chunking (the result is the same up to fp32 rounding). seqlen need not be a multiple.
        dt_softplus: apply softplus (with passthrough above 20) to dt + dt_bias.
        dt_limit: (dt_min, dt_max) clamp on the step size after softplus.
        backend: "cutile" (CUDA tensors, cuda.tile) or "torch" (naive.ssm_scan_chunked, any device).
        out: optional preallocated y, contiguous, shape and dtype of x, on x's device ("cutile" only).
        final_state_out: optional preallocated final_state, contiguous fp32 ("cutile" only).
        stream: None (current stream), a torch.cuda.Stream, or a raw cudaStream_t int ("cutile" only):
            the kernels are launched on it (0: the legacy default stream).
        cu_seqlens: packed variable-length prefill (m2export.contract.CU_SEQLENS): (nseq + 1,) int32
            offsets into the token axis of a batch-1 x; initial_state and final_state are then
            (nseq, nheads, headdim, d_state). The offsets are read on the host (a device sync when
            they live on the GPU).
        tiles: the cuTile prefill kernels' tiles, one of :func:`m2export.kernels.ssd.plan.tile_families` of this
            problem (the TensorRT plugin passes its tactic's), or None: the heuristic plan, or with
            ``M2EXPORT_AUTOTUNE=1`` the fastest candidate measured on the first call of each signature
            (:mod:`m2export.kernels._tune`). Changes speed only; ignored by the "torch" backend and at seqlen 1.

    Returns:
        SSMScanOutput(y, final_state): y (batch, seqlen, nheads, headdim) in x.dtype (``out`` if given);
        final_state (batch, nheads, headdim, d_state) fp32 (``final_state_out`` if given).

    Raises:
        ContractError: an argument breaks the SSMScan contract (m2export/contract.py), or for
            backend="cutile" headdim is not a multiple of 16 up to 256 or d_state not in {32, 64, 128, 256},
            or out= does not fit.
        BackendUnavailable: the backend cannot run here (no CUDA, no cuda.tile, CPU tensors); the
            hint says how to install it (pip install m2export[gpu]) or to pass backend="torch".

    Non-contiguous inputs are accepted; the cuTile backend reads x, dt, B, C in place when their last
    stride is 1 (views of the conv output: no copies) and makes a contiguous copy of the others first.
    With backend="cutile", seqlen == 1 (decode) runs the decode-step kernel
    (:mod:`m2export.kernels.ssd_step`), every other length the chunked prefill kernels.

    Source:
        Dao & Gu, "Transformers are SSMs" (arXiv:2405.21060), Sec. 6 and Listing 1; argument order of
        mamba_ssm/ops/triton/ssd_combined.py::mamba_chunk_scan_combined.
    """
    attrs = SSMScanAttrs.make(chunk_size=chunk_size, dt_softplus=dt_softplus, dt_limit=dt_limit)
    if cu_seqlens is not None:
        return _ssm_scan_packed(x, dt, A, B, C, D, dt_bias, initial_state, cu_seqlens=cu_seqlens, attrs=attrs,
                                backend=backend, out=out, final_state_out=final_state_out, stream=stream,
                                tiles=tiles)
    problem = validated(x, dt, A, B, C, D, dt_bias, initial_state)
    if backend == "torch":
        out_buffers(x, problem.shape_of("final_state"), out, final_state_out)
        res = ssm_scan_chunked(x, dt, A, B, C, D, dt_bias, initial_state, chunk_size=chunk_size,
                               dt_softplus=dt_softplus, dt_limit=attrs.dt_limit)
        return into_buffers(res, out, final_state_out)
    require_cutile(backend, problem, "SSD", dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias,
                                                 initial_state=initial_state), stream)
    if problem.seqlen == 1:
        # decode: the memory-bound step kernel (one pass over the state), not the chunked pipeline
        from m2export.kernels.ssd_step.cutile import ssm_step_cutile

        if out is not None:
            out_buffers(x, problem.shape_of("final_state"), out)  # checked as a 4-D buffer, written through a view
        res = ssm_step_cutile(x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D, dt_bias, initial_state, problem=problem,
                              dt_softplus=dt_softplus, dt_limit=attrs.dt_limit,
                              out=None if out is None else out[:, 0], state_out=final_state_out, stream=stream)
        return SSMScanOutput(res.y[:, None] if out is None else out, res.final_state)
    from m2export.kernels.ssd.cutile import ssm_scan_cutile

    return ssm_scan_cutile(x, dt, A, B, C, D, dt_bias, initial_state, problem=problem, dt_softplus=dt_softplus,
                           dt_limit=attrs.dt_limit, out=out, final_state_out=final_state_out, stream=stream,
                           tiles=tiles)


def _ssm_scan_packed(x, dt, A, B, C, D, dt_bias, initial_state, *, cu_seqlens, attrs: SSMScanAttrs, backend: str,
                     out, final_state_out, stream, tiles=None) -> SSMScanOutput:
    """Packed prefill: "torch" runs :func:`~m2export.kernels.ssd.packed.ssm_scan_packed_chunked`; "cutile" runs
    :func:`m2export.kernels.ssd.cutile_packed.ssm_scan_packed_cutile`, one launch group over all sequences (one
    block per sequence segment, driven by a work table built from the offsets, which are read on the host on the
    launch stream: a device sync when they live on the GPU); a pack with one non-empty sequence runs the unpacked
    plan on that sequence's slice (H200, bench_ssd_packed.py, benchmarks/RESULTS.md 2026-12-02 17:58 UTC:
    mamba2-2.7b T 8192 one sequence 0.177 ms unpacked vs 0.183 packed; 4 / 16 sequences packed 0.184 / 0.170
    vs 0.227 / 0.460 ms for one launch group per sequence)."""
    from m2export.contract import check_cu_seqlens, validate_packed

    problem, nseq = validate_packed(x, dt, A, B, C, D, dt_bias, initial_state, cu_seqlens=cu_seqlens)
    fs_shape = (nseq, problem.nheads, problem.headdim, problem.d_state)
    if backend == "torch":
        from m2export.kernels.ssd.packed import ssm_scan_packed_chunked

        out_buffers(x, fs_shape, out, final_state_out)
        res = ssm_scan_packed_chunked(x, dt, A, B, C, D, dt_bias, initial_state, cu_seqlens=cu_seqlens,
                                      chunk_size=attrs.chunk_size, dt_softplus=attrs.dt_softplus,
                                      dt_limit=attrs.dt_limit)
        return into_buffers(res, out, final_state_out)
    require_cutile(backend, problem, "SSD", dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias,
                                                 initial_state=initial_state), stream)
    import torch

    from m2export.kernels._host import launch_stream

    ls = launch_stream(stream, x.device)
    with torch.cuda.device(x.device), torch.cuda.stream(ls):
        # read on the launch stream: whatever produced cu_seqlens (TensorRT's enqueue stream, often non-blocking)
        # ordered it there, and a copy on the current stream would not wait for it
        cu = check_cu_seqlens(cu_seqlens.tolist(), problem.seqlen)
        live = [s for s in range(nseq) if cu[s] < cu[s + 1]]
        if len(live) == 1:  # one sequence (and empty ones): the unpacked plan on its slice, in place
            y, fs = out_buffers(x, fs_shape, out, final_state_out, allocate=True)
            (a, b), s = (cu[live[0]], cu[live[0] + 1]), live[0]
            if nseq > 1:  # the empty sequences keep their states
                fs.copy_(initial_state) if initial_state is not None else fs.zero_()
            ssm_scan(x[:, a:b], dt[:, a:b], A, B[:, a:b], C[:, a:b], D, dt_bias,
                     None if initial_state is None else initial_state[s:s + 1], chunk_size=attrs.chunk_size,
                     dt_softplus=attrs.dt_softplus, dt_limit=attrs.dt_limit, backend=backend, out=y[:, a:b],
                     final_state_out=fs[s:s + 1], stream=ls, tiles=tiles)
            return SSMScanOutput(y, fs)
    from m2export.kernels.ssd.cutile_packed import ssm_scan_packed_cutile

    return ssm_scan_packed_cutile(x, dt, A, B, C, D, dt_bias, initial_state, cu, problem=problem,
                                  dt_softplus=attrs.dt_softplus, dt_limit=attrs.dt_limit, out=out,
                                  final_state_out=final_state_out, stream=ls, tiles=tiles)
