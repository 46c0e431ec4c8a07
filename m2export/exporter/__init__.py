"""ONNX export of Mamba-2 checkpoints (prefill + decode graphs, SSMScan custom op or standard ops).

Public API: :func:`export_model` (the library call behind ``m2export export``), :func:`ort_generate_greedy`
and :class:`OrtModel` (run an export folder in ONNX Runtime). torch is imported only when exporting.
"""

from m2export.exporter.export import export_model
from m2export.exporter.runtime import OrtModel, ort_generate_greedy

__all__ = ["export_model", "ort_generate_greedy", "OrtModel"]
