"""argparse ``type=`` validators shared by the verbs: a bad value is a one-line usage error (exit 2).

Each returns the parsed value or raises ``argparse.ArgumentTypeError`` (argparse prints
``m2export VERB: error: argument --flag: MESSAGE`` and exits 2). What argparse cannot see (a value's syntax the
library parses, flags that contradict each other) the library refuses with
:class:`~m2export.errors.UsageError`: ``error: --flag VALUE: ...``, exit 2 too (the table: m2export/errors.py).
"""

from __future__ import annotations

import argparse
import math


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer: {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1."""
    v = _int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v}: expected an integer >= 1")
    return v


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    v = _int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v}: expected an integer >= 0")
    return v


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"{text}: expected a finite number >= 0")
    return v
