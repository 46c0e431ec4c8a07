"""Accuracy checks and the runners behind ``m2export check`` / ``m2export generate``.

* :mod:`m2export.check.compare` -- :func:`~m2export.check.compare.run_check` (the library call behind
  ``m2export check``) and its :class:`~m2export.check.compare.CheckReport`.
* :mod:`m2export.check.runners` -- Polygraphy runners: ``TorchRunner`` (the PyTorch reference),
  ``OnnxReferenceRunner`` (ONNX's reference evaluator), and factories for Polygraphy's ORT and TRT runners.
* :mod:`m2export.check.data` -- ``TokenDataLoader``: real byte-level token feeds with zero past states.
* :mod:`m2export.check.console` -- progress bars and Polygraphy log settings for the CLI.
* :mod:`m2export.check.routing` -- a failed prefill input of an MoE model explained (or not) by near-tie
  routing flips, found by rerunning the reference with them.

Nothing is imported here, so ``import m2export.check.data`` stays cheap (no Polygraphy, no torch).
"""
