"""Runtime plugins of op ``m2export::SSMScan``.

``import m2export.plugins`` registers the TensorRT plugins ``m2export::SSMScan`` v1 (and its packed form),
``m2export::CausalConv1d`` v1 and ``m2export::GatedRMSNorm`` v1 (JIT and, with TensorRT >= the version that has
AOT Python plugins, AOT) when TensorRT is installed; this is what a
Python process must do before it deserializes an engine built with ``--plugin jit``. Where TensorRT is
missing the import still succeeds: :func:`unavailable_reason` says why the plugin is not registered,
and :func:`register` raises :class:`~m2export.errors.BackendUnavailable` with the install hint.

* :mod:`m2export.plugins.ssm_scan_trt` -- the TensorRT plugin (shape/dtype rules, JIT impl, AOT impl).
* :mod:`m2export.plugins.fused_trt` -- the CausalConv1d and GatedRMSNorm plugins (the same, for the conv and norm).
* :mod:`m2export.plugins.aot` -- cuTile kernel -> PTX in TensorRT's AOT argument order, target checks.
"""

from __future__ import annotations

import logging

from m2export.errors import BackendUnavailable

__all__ = ["register", "registered", "unavailable_reason"]

log = logging.getLogger(__name__)
_STATE: dict = {"registered": None, "reason": None}


def register() -> dict:
    """Register the TensorRT plugins (idempotent); returns ``{"jit": True, "aot": bool}`` (aot: every plugin has it).

    Raises:
        BackendUnavailable: TensorRT is not installed or too old (the hint says how to install it).
    """
    from m2export.plugins import fused_trt, ssm_scan_trt

    try:
        got = ssm_scan_trt.register()
        fused = fused_trt.register()
        _STATE["registered"] = {"jit": got["jit"] and fused["jit"], "aot": got["aot"] and fused["aot"]}
        _STATE["reason"] = None
    except BackendUnavailable as e:
        _STATE["reason"] = str(e)
        raise
    return dict(_STATE["registered"])


def registered() -> dict | None:
    """``{"jit": True, "aot": bool}`` once registered in this process, else None."""
    return dict(_STATE["registered"]) if _STATE["registered"] else None


def unavailable_reason() -> str | None:
    """Why the TensorRT plugin is not registered in this process (None when it is)."""
    if _STATE["registered"]:
        return None
    return _STATE["reason"] or "not registered yet: call m2export.plugins.register()"


def _register_on_import() -> None:
    try:
        register()
    except BackendUnavailable:
        pass  # reason recorded; importing must work without TensorRT
    except Exception as e:  # a TensorRT API mismatch must not break `import m2export.plugins`
        _STATE["reason"] = f"registration failed: {type(e).__name__}: {e}"
        log.warning("m2export::SSMScan TensorRT plugin not registered: %s", _STATE["reason"])


_register_on_import()
