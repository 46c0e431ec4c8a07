"""Export-only model patching (optimum's ModelPatcher idea): swap each mixer's ``scan_fn`` inside a ``with``.

Inside the block every :class:`~m2export.models.mamba2.Mamba2Mixer` calls the custom op
``torch.ops.m2export.ssm_scan`` (an opaque call for torch.export, lowered to one ONNX node); on exit the
original scan functions are restored, also when the export raises.

MoE blocks run one of their static-shape forms inside the block (the eager default loops over the experts a
batch routes to, a data-dependent shape torch.export cannot keep): :func:`moe_export_impl` chooses "dense"
(every expert on every token, weighted by the sparse top-k weights) for up to :data:`DENSE_MAX_EXPERTS`
experts and "gather" (each token's top-k expert weights gathered) above. Measured in ONNX Runtime (CPU,
1 thread, d_model 256, d_expert 128, best of 8-30, 10:24 UTC on the shared 2-core machine): 4 experts
top-2: dense 0.34 / 33.5 ms, gather 0.25 / 604 ms at 1 / 128 tokens; 16 top-2: dense 2.30 / 131, gather
0.46 / 646; 64 top-6: dense 117 / 308, gather 1.62 / 898. Both are exact (the same sums; max difference
5e-7). Gather wins decode at every count and dense wins prefill; dense's decode cost grows with the expert
count, so it is kept where that cost is small.

For bfloat16 models the patcher also routes the depthwise ``conv1d`` through float32 (Cast island):
ONNX ``Conv`` accepts bfloat16 only from opset 22, and m2export exports opset 18 by default. PyTorch's
CPU bf16 conv accumulates in fp32 and rounds once, so the island computes the same values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import m2export.models.mamba2 as mamba2_module
from m2export.models.mamba2 import Mamba2LMHeadModel, ScanFn


class _FunctionalFp32Conv:
    """``torch.nn.functional`` with ``conv1d`` evaluated in float32 for bfloat16 inputs."""

    def __getattr__(self, name):
        return getattr(F, name)

    @staticmethod
    def conv1d(x, weight, bias=None, *args, **kwargs):
        if x.dtype != torch.bfloat16:
            return F.conv1d(x, weight, bias, *args, **kwargs)
        out = F.conv1d(x.float(), weight.float(), None if bias is None else bias.float(), *args, **kwargs)
        return out.to(x.dtype)


#: MoE blocks with at most this many routed experts export in the "dense" form, larger ones in "gather"
DENSE_MAX_EXPERTS = 8


def moe_export_impl(n_experts: int) -> str:
    """The MoE form an export uses for ``n_experts`` routed experts (see the module docstring)."""
    return "dense" if n_experts <= DENSE_MAX_EXPERTS else "gather"


class Mamba2ModelPatcher:
    """``with Mamba2ModelPatcher(model): torch.onnx.export(...)``: mixers use ``scan_fn`` only inside."""

    def __init__(self, model: Mamba2LMHeadModel, scan_fn: ScanFn | None = None):
        if scan_fn is None:
            from m2export.exporter.ssm_scan_op import ssm_scan_fn

            scan_fn = ssm_scan_fn
        self.model = model
        self.scan_fn = scan_fn
        self._saved: list[ScanFn] | None = None

    def __enter__(self) -> Mamba2LMHeadModel:
        if self._saved is not None:
            raise RuntimeError("Mamba2ModelPatcher is not re-entrant")
        self._saved = [m.scan_fn for m in self.model.mixers]
        for m in self.model.mixers:
            m.scan_fn = self.scan_fn
        from m2export.models.layers import MoE

        self._moe = [(m, m.impl) for m in self.model.modules() if isinstance(m, MoE)]
        for m, _ in self._moe:
            m.impl = moe_export_impl(m.spec.n_experts)
        self._saved_F = mamba2_module.F
        if self.model.lm_head.weight.dtype == torch.bfloat16:
            mamba2_module.F = _FunctionalFp32Conv()
        return self.model

    def __exit__(self, *exc) -> None:
        for m, fn in zip(self.model.mixers, self._saved or []):
            m.scan_fn = fn
        for m, impl in getattr(self, "_moe", []):
            m.impl = impl
        self._moe = []
        if self._saved is not None:
            mamba2_module.F = self._saved_F
        self._saved = None
