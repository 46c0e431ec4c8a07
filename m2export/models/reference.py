"""A true float64 forward of a checkpoint: the accuracy reference of exported graphs.

:func:`float64_model` is the checkpoint's :class:`~m2export.models.mamba2.HybridLM` in float64 with every
mixer's scan the float64 recurrence (:func:`~m2export.kernels.ssd.naive.ssm_scan_recurrent`, its inputs
not rounded): every op, the norms, gates, ``A = -exp(A_log)`` and the residual stream included, runs in
float64 on the checkpoint's weights (float64 copies of them, exact). Only the weights' own rounding
(the checkpoint's dtype) is shared with the graphs compared against it.

Why not transformers' ``Mamba2ForCausalLM`` loaded in float64: it computes every RMSNorm and the gated norm
in float32, keeps the residual in float32 (``residual_in_fp32``), ``A`` from ``A_log.float()``, and its torch
scan casts x, B and C to float32, so its "float64" logits carry an error of their own of the size compared
(4.9e-5 rel-L2 from this forward on the 130m-shaped checkpoint of benchmarks/bench_ort.py, where the exported
graphs are 3.3e-5 from it: benchmarks/RESULTS.md, "Issue 16 accuracy row").
"""

from __future__ import annotations

import os

import torch

from m2export.kernels.ssd.naive import ssm_scan_recurrent


def _scan64(x, dt, A, B, C, D=None, dt_bias=None, initial_state=None, *, chunk_size=None, dt_softplus=True,
            dt_limit=(0.0, float("inf"))):
    """The model's ``scan_fn`` signature over :func:`ssm_scan_recurrent` in float64 (``chunk_size`` unused)."""
    return ssm_scan_recurrent(x, dt, A, B, C, D, dt_bias, initial_state, dt_softplus=dt_softplus,
                              dt_limit=dt_limit, dtype=torch.float64)


def float64_model(path: str | os.PathLike):
    """The checkpoint at ``path`` (any format :func:`~m2export.models.checkpoint.load_checkpoint` reads) as a
    float64 :class:`~m2export.models.mamba2.HybridLM` in eval mode whose mixers scan with the float64
    recurrence. ``model(input_ids).logits`` (batch, seqlen, vocab_size) float64 is the reference; the
    recurrence is token by token (a 130m-shaped model at 512 tokens: ~1 GiB and tens of seconds on 2 cores).

    Raises what ``load_checkpoint`` raises (CheckpointError on a missing or malformed checkpoint)."""
    from m2export.models.checkpoint import load_checkpoint

    model = load_checkpoint(path, dtype=torch.float64).model.eval()
    for m in model.mixers:
        m.scan_fn = _scan64
    return model
