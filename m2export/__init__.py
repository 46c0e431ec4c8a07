"""m2export: Mamba-2 checkpoints to ONNX (custom op ``m2export::SSMScan``) and TensorRT engines.

Entry points: the ``m2export`` command (:mod:`m2export.cli.main`), :func:`m2export.exporter.export_model`,
:func:`m2export.models.checkpoint.load_checkpoint`, :func:`m2export.kernels.ssd.ssm_scan`.
The SSMScan contract every part follows is :mod:`m2export.contract`. Importing this package loads
neither torch, TensorRT nor cuda.tile.
"""

__version__ = "0.1.0"
