"""ONNX export of Mamba-2 checkpoints (prefill + decode graphs, SSMScan custom op or standard ops).

Public API: :func:`export_model` (the library call behind ``m2export export``), :func:`ort_generate_greedy`
and :class:`OrtModel` (run an export folder in ONNX Runtime). They are imported on first use (PEP 562), so
that importing a light submodule (``m2export.exporter.configs``, ``.manifest``: file names, the manifest) does
not import torch, onnx and onnxscript: that took 3 s of CPU (7-8 s wall on a loaded 2-core machine) before
``inspect`` printed anything, or ``build`` said that TensorRT is not installed.
"""

_LAZY = {"export_model": "m2export.exporter.export", "ort_generate_greedy": "m2export.exporter.runtime",
         "OrtModel": "m2export.exporter.runtime"}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
