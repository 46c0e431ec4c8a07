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


class ProgressTask:
    """One phase of a long run: call it to advance one step; :meth:`doing` names the step now running (shown by the
    progress display; a no-op for a silent one). What :func:`progress_bars`' ``new_task`` returns."""

    def __init__(self, advance: Callable[[], None] | None = None, doing: Callable[[str], None] | None = None):
        self._advance, self._doing = advance, doing

    def __call__(self) -> None:
        if self._advance is not None:
            self._advance()

    def doing(self, what: str) -> None:
        if self._doing is not None:
            self._doing(what)


#: plain-line progress (stderr not a terminal): a step is announced once it has run this long, then again every
#: :data:`PLAIN_EVERY_S` while it runs, and its end is printed; shorter steps print nothing
PLAIN_AFTER_S = 5.0
PLAIN_EVERY_S = 30.0


class _PlainLines:
    """Progress for a stderr that is not a terminal (a log file, a pipe, CI): whole lines, only for steps that take
    a while, so a quick run prints nothing and a long one says what it is doing at least every
    :data:`PLAIN_EVERY_S` seconds. A daemon thread watches the step now running."""

    def __init__(self, name: str, stream, after: float | None = None, every: float | None = None):
        import threading
        import time

        self.name, self.stream = name, stream
        self.after = PLAIN_AFTER_S if after is None else after
        self.every = PLAIN_EVERY_S if every is None else every
        self._clock = time.monotonic
        self.t0 = self._clock()
        self._lock = threading.Lock()
        self._cur: dict | None = None  # the step now running: phase, index, total, what, start, announced, last
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="m2export-progress", daemon=True)
        self._thread.start()

    def new_task(self, desc: str, total: int) -> ProgressTask:
        st = {"desc": desc, "total": total, "done": 0}
        self._begin(st, None)
        return ProgressTask(lambda: self._advance(st), lambda what: self._begin(st, what))

    def _line(self, text: str) -> None:
        t = int(self._clock() - self.t0)
        try:
            self.stream.write(f"{self.name} [{t // 60:d}m{t % 60:02d}s] {text}\n")
            self.stream.flush()
        except (OSError, ValueError):  # a closed stderr: progress is not worth an error
            pass

    def _step_text(self, c: dict) -> str:
        st = c["task"]
        head = f"{st['desc']} {min(st['done'] + 1, st['total'])}/{st['total']}" if st["total"] > 1 else st["desc"]
        return head + (f": {c['what']}" if c["what"] else "")

    def _end_step(self) -> None:
        c, self._cur = self._cur, None
        if c is not None and c["announced"]:
            self._line(f"{self._step_text(c)} done in {self._clock() - c['start']:.1f}s")

    def _begin(self, st: dict, what: str | None) -> None:
        with self._lock:
            if self._cur is not None and self._cur["task"] is st and what is not None and self._cur["what"] is None:
                self._cur["what"] = what  # the phase's first named step: the same step, now with its name
                return
            self._end_step()
            now = self._clock()
            self._cur = {"task": st, "what": what, "start": now, "announced": False, "last": now}

    def _advance(self, st: dict) -> None:
        with self._lock:
            if self._cur is not None and self._cur["task"] is st:
                self._end_step()
            st["done"] += 1
            if st["done"] < st["total"]:
                now = self._clock()
                self._cur = {"task": st, "what": None, "start": now, "announced": False, "last": now}

    def _watch(self) -> None:
        while not self._stop.wait(max(0.05, min(0.5, self.every / 4))):
            with self._lock:
                c, now = self._cur, self._clock()
                if c is None:
                    continue
                ran = now - c["start"]
                if not c["announced"] and ran >= self.after:
                    c["announced"], c["last"] = True, now
                    self._line(f"{self._step_text(c)} ...")
                elif c["announced"] and now - c["last"] >= self.every:
                    c["last"] = now
                    self._line(f"{self._step_text(c)}: still running ({ran:.0f}s)")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        with self._lock:
            self._end_step()


@contextlib.contextmanager
def progress_bars(enabled: bool, name: str = "m2export") -> Iterator[Callable[[str, int], ProgressTask]]:
    """Yield ``new_task(description, total) -> ProgressTask`` (call it to advance; ``.doing(what)`` names the step
    now running), always on stderr (results stay on stdout).

    A terminal gets a rich progress display (one bar per phase, its description the step now running). Any other
    stderr (a log, a pipe) gets plain lines from ``name`` for the steps that run longer than :data:`PLAIN_AFTER_S`
    (:class:`_PlainLines`), so a long run is never silent. Disabled (quiet) it yields no-op tasks.
    """
    if not enabled:
        yield lambda desc, total: ProgressTask()
        return
    if not sys.stderr.isatty():
        plain = _PlainLines(name, sys.stderr)
        try:
            yield plain.new_task
        finally:
            plain.close()
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as prog:
        def new_task(desc: str, total: int) -> ProgressTask:
            tid = prog.add_task(desc, total=total)
            return ProgressTask(lambda: prog.advance(tid),
                                lambda what: prog.update(tid, description=f"{desc}: {what}"))

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
    (``m2export inspect ... | head``) or a full device is :class:`~m2export.errors.StdoutError`: exit 141
    (silent) or 1 (one line), stdout silenced so the interpreter's final flush cannot raise again."""
    sys.stdout.write(text)
    sys.stdout.flush()
