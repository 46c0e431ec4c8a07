"""Is TensorRT usable here? The one check (and the one install hint) every verb and module asks.

Light to import: nothing heavy is imported until a function is called. Callers look the functions up on
this module at call time (``backends.tensorrt_unavailable_reason()``), so a test that stands in for
TensorRT patches one place.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from m2export.errors import BackendUnavailable

#: first TensorRT with tensorrt.plugin, and with plugins taking precedence over same-named ONNX local
#: functions (onnx-tensorrt 10.7 release notes; model.onnx carries SSMScan as a local function too)
MIN_TENSORRT = (10, 7)

#: how to get TensorRT (NVIDIA's index; the wheel follows the CUDA major version of the driver)
TENSORRT_INSTALL_HINT = ("pip install --extra-index-url https://pypi.nvidia.com tensorrt-cu12 "
                         "(or tensorrt-cu13 for CUDA 13 drivers), on a machine with an NVIDIA GPU")

NOT_INSTALLED = "TensorRT not installed"


def tensorrt_version(trt: Any) -> tuple[int, ...]:
    """(major, minor) of a ``tensorrt`` module."""
    return tuple(int(p) for p in str(trt.__version__).split(".")[:2] if p.isdigit())


def tensorrt_too_old(trt: Any) -> str | None:
    """Why this ``tensorrt`` module is too old for m2export (None when it is new enough)."""
    if tensorrt_version(trt) < MIN_TENSORRT:
        return (f"TensorRT {trt.__version__} is too old: m2export needs >= {'.'.join(map(str, MIN_TENSORRT))} "
                "(tensorrt.plugin, plugins over local functions)")
    return None


def tensorrt_unavailable_reason(*, need_gpu: bool = True) -> str | None:
    """Why TensorRT cannot be used here, or None when it can.

    Reasons: ``"TensorRT not installed"`` (:data:`NOT_INSTALLED`), ``"TensorRT does not import (...)"``
    (a broken install), ``"TensorRT X is too old: ..."`` and, with ``need_gpu``, ``"no CUDA GPU"`` (as
    torch sees it: the JIT plugin runs its kernel through torch).
    """
    if importlib.util.find_spec("tensorrt") is None:
        return NOT_INSTALLED
    try:
        import tensorrt as trt
    except Exception as e:  # a broken install raises OSError/ImportError from its shared libraries
        return f"TensorRT does not import ({type(e).__name__}: {e})"
    old = tensorrt_too_old(trt)
    if old:
        return old
    if need_gpu:
        import torch

        if not torch.cuda.is_available():
            return "no CUDA GPU"
    return None


def tensorrt_unavailable_error(why: str, purpose: str) -> BackendUnavailable:
    """The exit-4 error for ``why`` (from :func:`tensorrt_unavailable_reason`) when TensorRT is needed to
    ``purpose`` ("build engines", "run TensorRT engines", "check the TensorRT engines")."""
    if why == NOT_INSTALLED:
        return BackendUnavailable(f"TensorRT is not installed; cannot {purpose}", hint=TENSORRT_INSTALL_HINT)
    if why.startswith("TensorRT"):  # broken or too old: reinstall
        return BackendUnavailable(f"cannot {purpose}: {why}", hint=TENSORRT_INSTALL_HINT)
    return BackendUnavailable(f"cannot {purpose} here: {why}",
                              hint="run on a machine with an NVIDIA GPU and a working TensorRT install")


def require_tensorrt(purpose: str, *, need_gpu: bool = True):
    """The ``tensorrt`` module, or :class:`BackendUnavailable` (exit 4) saying why it is not usable."""
    why = tensorrt_unavailable_reason(need_gpu=need_gpu)
    if why:
        raise tensorrt_unavailable_error(why, purpose)
    import tensorrt as trt

    return trt


def tensorrt_plugin_api(what: str, trt: Any = None, trtp: Any = None) -> tuple[Any, Any, bool]:
    """``(tensorrt, tensorrt.plugin, has_aot)`` for registering m2export's Python plugins, ``what`` naming them
    (e.g. "the SSMScan plugin"); ``trt``/``trtp`` when both are given (tests inject stand-ins) are used as they are.
    ``has_aot``: this TensorRT registers AOT implementations too (``trtp.aot_impl`` and
    ``trt.QuickPluginCreationRequest``, TensorRT >= 10.8).

    Raises:
        BackendUnavailable: TensorRT (or its ``tensorrt.plugin`` module) is missing or older than
            :data:`MIN_TENSORRT`.
    """
    if trt is None or trtp is None:
        trt = require_tensorrt(f"register {what}", need_gpu=False)
        import tensorrt.plugin as trtp
    old = tensorrt_too_old(trt)
    if old:
        raise BackendUnavailable(f"cannot register {what}: {old}", hint=TENSORRT_INSTALL_HINT)
    return trt, trtp, hasattr(trtp, "aot_impl") and hasattr(trt, "QuickPluginCreationRequest")


def tensorrt_available() -> bool:
    """True when TensorRT imports, is new enough, and a CUDA GPU is visible."""
    return tensorrt_unavailable_reason() is None
