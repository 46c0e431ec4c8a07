"""Export-only model patching (optimum's ModelPatcher idea): swap each mixer's ``scan_fn`` inside a ``with``.

Inside the block every :class:`~m2export.models.mamba2.Mamba2Mixer` calls the custom op
``torch.ops.m2export.ssm_scan`` (an opaque call for torch.export, lowered to one ONNX node); on exit the
original scan functions are restored, also when the export raises.
"""

from __future__ import annotations

from m2export.models.mamba2 import Mamba2LMHeadModel, ScanFn


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
        return self.model

    def __exit__(self, *exc) -> None:
        for m, fn in zip(self.model.mixers, self._saved or []):
            m.scan_fn = fn
        self._saved = None
