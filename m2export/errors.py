"""Exception types of m2export.

User errors (bad input, missing optional dependency, failed accuracy check) derive from
:class:`M2ExportError`; the CLI prints them as one line plus an optional hint and exits
non-zero without a traceback. Bugs in m2export itself are :class:`InternalError`.
"""

from __future__ import annotations


class M2ExportError(Exception):
    """A problem the user can fix. ``hint`` (optional) says how."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.hint = hint

    def __str__(self) -> str:  # message only; the CLI prints the hint on its own line
        return self.args[0] if self.args else ""


class ContractError(M2ExportError, ValueError):
    """An SSMScan argument breaks the contract in :mod:`m2export.contract`."""


class ConfigError(M2ExportError, ValueError):
    """A model configuration field is missing, malformed or unsupported."""


class CheckpointError(M2ExportError):
    """A checkpoint file or directory is missing, malformed, or its tensors do not match the config."""


class ExportError(M2ExportError):
    """ONNX export failed or the output directory cannot be used."""


class ToleranceError(M2ExportError):
    """An accuracy comparison exceeded its tolerance."""

    exit_code = 3


class BackendUnavailable(M2ExportError):
    """An explicitly requested backend (cuTile, TensorRT, ONNX Runtime, CUDA) is not usable here."""

    exit_code = 4


class InternalError(Exception):
    """A bug in m2export: please report it with the traceback."""
