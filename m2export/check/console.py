"""Console helpers shared by the check / generate / inspect verbs: rich progress bars and tables."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator


@contextlib.contextmanager
def progress_bars(enabled: bool) -> Iterator[Callable[[str, int], Callable[[], None]]]:
    """Yield ``new_task(description, total) -> advance()``; a rich progress display on stderr when enabled.

    Disabled (quiet, or stderr not a terminal) it yields no-op tasks.
    """
    if not enabled or not sys.stderr.isatty():
        yield lambda desc, total: (lambda: None)
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as prog:
        def new_task(desc: str, total: int) -> Callable[[], None]:
            tid = prog.add_task(desc, total=total)
            return lambda: prog.advance(tid)

        yield new_task


def quiet_polygraphy(verbose: int = 0) -> None:
    """Polygraphy logs through a process-wide logger: keep only its errors unless ``-vv``, and turn its
    colour probe off (it prints a warning when the optional ``colored`` module is missing)."""
    from polygraphy.logger import G_LOGGER

    G_LOGGER.colors = False
    G_LOGGER.module_severity = G_LOGGER.INFO if verbose > 1 else G_LOGGER.ERROR


def human_bytes(n: int) -> str:
    """``517.3 MB``: decimal units, one decimal."""
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def write_stdout(text: str) -> None:
    """Print ``text`` and flush. Under the CLI (:func:`m2export.cli.main.main`) a closed pipe
    (``m2export inspect ... | head``) or a full device is :class:`~m2export.errors.StdoutError`: one line,
    exit 141 or 1, stdout silenced so the interpreter's final flush cannot raise again."""
    sys.stdout.write(text)
    sys.stdout.flush()
