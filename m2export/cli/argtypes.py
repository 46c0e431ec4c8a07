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


def comma_items(text: str, flag: str) -> list[str]:
    """``"a, b,c"`` -> ``["a", "b", "c"]`` (items stripped).

    Raises:
        UsageError: an empty value (``--atol ''``, blanks): ``error: FLAG '': empty value`` (exit 2), since an
            empty list would quietly mean "the defaults", which the user gets by leaving the flag out; an empty
            item (``1,,2``, a trailing ``1,2,``): ``error: FLAG '1,,2': empty item at position 2`` (exit 2); a
            list that silently dropped it would be another list than the one typed.
    """
    from m2export.errors import UsageError

    if not text.strip():
        raise UsageError(f"{flag} {text!r}: empty value", hint=f"give at least one item, or leave {flag} out for "
                                                              "its default")
    items = [v.strip() for v in text.split(",")]
    for i, v in enumerate(items, 1):
        if not v:
            raise UsageError(f"{flag} {text!r}: empty item at position {i}",
                             hint="separate the items with single commas")
    return items
