"""What every benchmark script does with its table: print it (stdout) and append it to benchmarks/RESULTS.md."""

from __future__ import annotations

import datetime
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def utc_now() -> str:
    """The run's time stamp for the table heading (``2026-12-01 13:16 UTC``)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def publish(table: str, results: str | Path = RESULTS) -> None:
    """Print ``table`` to stdout and append it (after a blank line) to ``results``."""
    print(table)
    with open(results, "a") as f:
        f.write("\n" + table)
