"""Console helpers shared by the verbs: rich progress bars and tables, and what keeps the third-party libraries
m2export drives quiet (:func:`quiet_third_party`, :func:`quiet_polygraphy`)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
from typing import Callable, Iterator

#: -q: what the third-party libraries m2export drives read at import (transformers, for ``check --reference
#: transformers``: its weight-loading progress bar and its warnings)
QUIET_ENV = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
#: the loggers an export raises to ERROR (torch.onnx's exporter and the libraries under it: per-op INFO/WARNING)
NOISY_LOGGERS = ("onnx_ir", "onnxscript", "torch.onnx", "torch.export", "torch._export", "torch.fx")


@contextlib.contextmanager
def quiet_third_party(*, only_errors: bool = False, loggers: bool = False) -> Iterator[None]:
    """For the block, the third-party libraries m2export drives say less; everything is restored after.

    Args:
        only_errors: the CLI's -q ("only errors"): those libraries print errors only too: the environment variables
            of :data:`QUIET_ENV` for one not imported yet (read at its import), its own switches for one that is
            (transformers).
        loggers: the Python loggers of :data:`NOISY_LOGGERS` at ERROR (an export's); left as they are when
            m2export's own log is at DEBUG (-v). Imports torch first: it sets its loggers' levels when imported.
    """
    saved_env: dict[str, str | None] = {}
    saved_levels: dict[str, int] = {}
    if only_errors:
        saved_env = {k: os.environ.get(k) for k in QUIET_ENV}
        os.environ.update(QUIET_ENV)
        if "transformers" in sys.modules:
            from transformers.utils import logging as hf_logging
            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()
    if loggers and logging.getLogger("m2export").getEffectiveLevel() > logging.DEBUG:
        importlib.import_module("torch")
        saved_levels = {n: logging.getLogger(n).level for n in NOISY_LOGGERS}
        for n in NOISY_LOGGERS:
            logging.getLogger(n).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for n, lvl in saved_levels.items():
            logging.getLogger(n).setLevel(lvl)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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
