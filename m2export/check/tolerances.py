"""Default accuracy tolerances of ``m2export check``, per export dtype: the one table they come from.

atol is ``GraphIO.ATOL`` (m2export/exporter/configs.py, shared with the exporter's own
validation); rtol is :data:`DEFAULT_RTOL` here. :func:`default_tolerances` is what the check uses and
:func:`defaults_table` renders the same values for ``m2export check --help``. Light to import (no
Polygraphy, no torch), so the help text can be generated from it.
"""

from __future__ import annotations

from m2export.errors import ExportFolderError

#: default rtol per export dtype (atol comes from GraphIO.ATOL)
DEFAULT_RTOL = {"fp32": 1e-3, "fp16": 1e-2, "bf16": 5e-2}


def _atol_table() -> dict[str, float]:
    from m2export.exporter.configs import GraphIO

    return {k: float(v) for k, v in GraphIO.ATOL}


def default_tolerances(dtype: str) -> tuple[dict[str, float], dict[str, float]]:
    """(atol, rtol) dicts with only the ``""`` default key, for an export ``dtype``.

    Raises:
        ExportFolderError: an unknown dtype (m2export.json is not from this version).
    """
    atol = _atol_table()
    if dtype not in atol or dtype not in DEFAULT_RTOL:
        raise ExportFolderError(f"m2export.json: unknown dtype {dtype!r}; expected one of {sorted(atol)}")
    return {"": atol[dtype]}, {"": float(DEFAULT_RTOL[dtype])}


def format_tolerance(v: float) -> str:
    """1e-4 -> '1e-4', 0.05 -> '5e-2', 2.5e-3 -> '2.5e-3', 0 -> '0'."""
    if v == 0:
        return "0"
    mantissa, exp = f"{v:e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exp)}"


def defaults_table(indent: str = "  ") -> str:
    """One line per export dtype: ``fp32  atol 1e-4  rtol 1e-3`` (the values :func:`default_tolerances` returns)."""
    lines = []
    for dtype in _atol_table():
        atol, rtol = default_tolerances(dtype)
        lines.append(f"{indent}{dtype:<5} atol {format_tolerance(atol['']):<7} rtol {format_tolerance(rtol[''])}")
    return "\n".join(lines)
