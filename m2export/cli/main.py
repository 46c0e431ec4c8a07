"""``m2export`` command line: one module per verb in m2export/cli/.

Each verb module defines ``HELP`` (one line), ``DESCRIPTION`` (its --help text, with examples),
``add_arguments(parser)`` and ``run(args) -> int``; heavy libraries are imported inside ``run``.
A verb whose module fails to import is listed as unavailable with the reason, so ``--help`` works.

Exit codes: the table :class:`m2export.errors.ExitCode` (``--help`` prints it). Library errors name
parameters in backquotes (:func:`m2export.errors.render`); :func:`flag_mapper` shows them as the
verb's flags (``text`` -> ``--text``). Never a traceback for what is not a bug: results that cannot be
written to stdout (:class:`~m2export.errors.StdoutError`: a full device is one error line; a reader that closed
the pipe, ``| head``, exits 141 without a word, as Unix tools do, with the line under -v) and a
MemoryError (sizes beyond the machine) are one line each too.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import signal
import sys
import time

from m2export.errors import ExitCode, Interrupted, M2ExportError, StdoutError, exit_codes_text

VERBS = {
    "export": "m2export.cli.export",
    "build": "m2export.cli.build",
    "check": "m2export.cli.check",
    "generate": "m2export.cli.generate",
    "inspect": "m2export.cli.inspect",
    "random-checkpoint": "m2export.cli.random_checkpoint",
}
log = logging.getLogger("m2export")


def _add_logging_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Logging")
    g.add_argument("-v", "--verbose", action="count", default=0,
                   help="m2export's debug log (steps and timings) and tracebacks on errors; -vv also Polygraphy's log")
    g.add_argument("-q", "--quiet", action="store_true", help="only errors (and the PASSED/FAILED line of check)")


class Parser(argparse.ArgumentParser):
    """Every parser of the ``m2export`` command line (the verbs' subparsers are made of this class too):
    long options only by their full names. argparse's prefix abbreviations are off (``allow_abbrev=False``):
    ``--ssm`` is no ``--ssm-impl``, and a flag added later cannot change what an old command line means."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str, hint: str | None = None):
        """A refused command line in the CLI's error style: one ``error:`` line and a ``hint:`` line on stderr (not
        argparse's usage block), exit :attr:`ExitCode.USAGE`."""
        print(f"error: {message}", file=sys.stderr)
        hint = hint or f"'{self.prog} --help' shows the usage"
        print(f"hint: {hint}", file=sys.stderr)
        sys.exit(ExitCode.USAGE)

    def unrecognized(self, extra: list[str]):
        """Refuse ``extra`` (unknown arguments), suggesting the closest option of this parser for each flag."""
        import difflib

        options = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        near = [m[0] for x in extra if x.startswith("--")
                for m in [difflib.get_close_matches(x.split("=", 1)[0], options, n=1)] if m]
        self.error(f"unrecognized arguments: {' '.join(extra)}",
                   hint=(f"did you mean {', '.join(near)}? " if near else "") + f"'{self.prog} --help' lists the options")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="m2export", description="Export Mamba-2 checkpoints to ONNX and TensorRT engines and check their accuracy.",
        epilog="Run 'm2export VERB --help' for a verb's options and examples.\n\nexit codes:\n  "
               + exit_codes_text("\n  "),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"m2export {_version()}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for verb, modname in VERBS.items():
        try:
            mod = importlib.import_module(modname)
        except ImportError as e:  # keep --help working when an optional dependency is missing
            p = sub.add_parser(verb, help=f"(unavailable: {e})")
            p.set_defaults(_unavailable=f"'{verb}' is unavailable: {e}")
            continue
        p = sub.add_parser(verb, help=mod.HELP, description=mod.DESCRIPTION,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        _add_logging_args(p)
        p.set_defaults(_run=mod.run, _module=mod)
    return parser


def flag_mapper(parser: argparse.ArgumentParser, verb: str):
    """``name -> flag`` for the backquoted parameters of library errors: the running verb's option whose
    ``dest`` is ``name`` (or that the verb's ``PARAM_FLAGS`` names), else another verb's, else None
    (the message then shows the Python name)."""
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    order = [verb] + [v for v in subs.choices if v != verb]
    table: dict[str, str | None] = {}
    for v in order:
        p = subs.choices[v]
        for name, flag in getattr(p.get_default("_module"), "PARAM_FLAGS", {}).items():
            table.setdefault(name, flag)
        for a in p._actions:
            longs = [o for o in a.option_strings if o.startswith("--")]
            if a.dest in ("help", "verbose", "quiet") or (v != verb and not longs):
                continue
            table.setdefault(a.dest, longs[0] if longs else None)  # this verb's positional: keep the name
    return table.get


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("m2export")
    except Exception:
        return "0+unknown"


class _ClosedStdout:
    """What ``sys.stdout`` is when the interpreter started with fd 1 closed (Python sets it to None): every write
    fails as a write to a closed descriptor does (EBADF), which :class:`_GuardedStdout` turns into one error line."""

    def _closed(self, *_a):
        import errno

        raise OSError(errno.EBADF, "Bad file descriptor")

    write = writelines = fileno = _closed

    def flush(self) -> None:  # nothing buffered, nothing lost
        return None

    def isatty(self) -> bool:
        return False


class _GuardedStdout:
    """``sys.stdout`` while a verb runs: an OSError of a write or flush (a closed pipe, ``> /dev/full``)
    becomes :class:`~m2export.errors.StdoutError` (exit 141 silently, or one line and exit 1) instead of a traceback, and
    stdout is pointed at devnull so that nothing (the interpreter's final flush included) writes there again.
    Everything else is the wrapped stream's (``isatty``, ``fileno``, ``encoding``, ...)."""

    def __init__(self, stream):
        self._stream = stream
        self._pipe_fd: int | None = None  # raise_if_reader_gone: fd 1 if a pipe, -1 if not, None: not looked yet

    def _guard(self, op, *a):
        try:
            return op(*a)
        except OSError as e:
            self._silence()
            raise StdoutError(e) from None

    def _silence(self) -> None:
        import os

        with contextlib.suppress(OSError, ValueError, AttributeError):  # no real fd (a test's capture)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)

    def raise_if_reader_gone(self) -> None:
        """Raise :class:`~m2export.errors.StdoutError` (EPIPE: exit 141) when stdout is a pipe whose reader has
        closed it, without writing: for a verb that holds its results until the end (``generate`` through a
        tokenizer, or printing token ids), so that ``| head`` stops it at the next token as a write would stop
        one that streams. A pipe's write end polls POLLERR once no reader is left (Linux, macOS); anything that
        is not a pipe, or cannot be polled, is never "gone"."""
        import errno
        import os
        import select
        import stat

        if self._pipe_fd is None:
            try:
                fd = self._stream.fileno()
                self._pipe_fd = fd if stat.S_ISFIFO(os.fstat(fd).st_mode) and hasattr(select, "poll") else -1
            except (OSError, ValueError, AttributeError):  # no real fd (a test's capture)
                self._pipe_fd = -1
        if self._pipe_fd < 0:
            return
        p = select.poll()
        p.register(self._pipe_fd, select.POLLOUT)
        if any(ev & select.POLLERR for _, ev in p.poll(0)):
            self._silence()
            raise StdoutError(OSError(errno.EPIPE, os.strerror(errno.EPIPE)))

    def write(self, text: str) -> int:
        return self._guard(self._stream.write, text)

    def writelines(self, lines) -> None:
        return self._guard(self._stream.writelines, lines)

    def flush(self) -> None:
        return self._guard(self._stream.flush)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def finish_quietly() -> None:
    """Once a verb has returned (its output complete and reported), SIGINT/SIGTERM no longer change the exit status.

    The interpreter's teardown after ``main`` (torch's and onnxruntime's, up to a second) ran with Python's default
    handlers: a Ctrl-C there killed an export that had already written its folder and printed "wrote ...", and
    the shell saw 130 without a word. Called by :func:`console_main` only (never by ``main``, which tests and
    libraries call in-process).
    """
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)


def console_main() -> None:
    """The ``m2export`` command (pyproject's entry point): :func:`main`, then exit with the status it chose."""
    rc = main()
    finish_quietly()
    # nothing logs for the user once the verb has returned: libraries' exit hooks stay quiet at INFO (torch's
    # 'FakeTensor cache stats', logged at exit when a Ctrl-C stopped 'import torch' before torch had set its
    # loggers' levels, came through m2export's INFO root handler after the one error line)
    logging.disable(logging.INFO)
    sys.exit(rc)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if extra:  # the verb's own options, not the top-level ones
        (subs.choices[args.verb] if args.verb else parser).unrecognized(extra)
    if args.verb is None:  # as argparse does for a missing required argument: stderr, exit 2
        parser.error(f"no VERB given; expected one of {', '.join(subs.choices)}",
                     hint="'m2export --help' says what each does, 'm2export VERB --help' its options and examples")
    if getattr(args, "_unavailable", None):
        print(f"error: {args._unavailable}", file=sys.stderr)
        return ExitCode.BACKEND_UNAVAILABLE
    level = logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, format="%(message)s")  # to stderr: results go to stdout
    # -v: m2export's own debug log (export steps, timings); third-party libraries stay at INFO
    logging.getLogger("m2export").setLevel(logging.DEBUG if args.verbose and not args.quiet else level)
    t0 = time.perf_counter()
    stdout = sys.stdout if sys.stdout is not None else _ClosedStdout()  # None: started with fd 1 closed ('>&-')
    sys.stdout = _GuardedStdout(stdout)
    try:
        from m2export.check import console

        with console.quiet_third_party(only_errors=args.quiet):  # -q: the libraries m2export drives too
            rc = int(args._run(args) or 0)
        sys.stdout.flush()  # a failed final flush is this verb's error, not the interpreter's at exit
        return rc
    except M2ExportError as e:
        if isinstance(e, StdoutError) and e.exit_code == ExitCode.BROKEN_PIPE and not args.verbose:
            return int(e.exit_code)  # the reader left (| head): silent, as Unix tools are; -v says so
        if args.verbose:
            import traceback
            traceback.print_exc()
        message, hint = e.render(flag_mapper(parser, args.verb))
        print(f"error: {message}", file=sys.stderr)
        if hint:
            print(f"hint: {hint}", file=sys.stderr)
        return int(e.exit_code)
    except Interrupted as e:  # raised while an output was being written: it is left as it was (or complete)
        print(f"error: {e}", file=sys.stderr)
        return int(e.exit_code)
    except KeyboardInterrupt:  # outside an output being written (that is Interrupted, above): same wording
        print("error: interrupted by SIGINT", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except MemoryError as e:  # sizes beyond this machine (numpy names the array it could not allocate)
        return _out_of_memory(args, str(e))
    except Exception as e:
        oom = runtime_out_of_memory(e)
        if oom is not None:
            return _out_of_memory(args, oom)
        bad_path = unusable_path(e)
        if bad_path is not None:
            if args.verbose:
                import traceback
                traceback.print_exc()
            print(f"error: {bad_path[0]}", file=sys.stderr)
            print(f"hint: {bad_path[1]}", file=sys.stderr)
            return ExitCode.USER_ERROR
        import traceback
        traceback.print_exc()
        print(f"internal error in 'm2export {args.verb}' after {time.perf_counter() - t0:.1f}s: this is a bug, "
              "please report it with the traceback above", file=sys.stderr)
        return ExitCode.INTERNAL
    finally:
        sys.stdout = stdout


def runtime_out_of_memory(e: BaseException) -> str | None:
    """What an ONNX Runtime allocation failure (its arena's "Failed to allocate memory for requested buffer of size
    N", or a kernel's std::bad_alloc) or a PyTorch one (its CPU allocator's RuntimeError "DefaultCPUAllocator: can't
    allocate memory: you tried to allocate N bytes", "... not enough memory ..." on Windows; torch.OutOfMemoryError
    on a GPU) says, for ``e`` or an exception it was raised from; None for anything else (a bug stays a bug). Both
    raise their own exception types for these, not MemoryError."""
    import re

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        msg = str(e)
        torch_cpu = isinstance(e, RuntimeError) and re.search(r"DefaultCPUAllocator: (can't allocate|not enough) memory",
                                                             msg)
        if torch_cpu or type(e).__name__ == "OutOfMemoryError" and type(e).__module__.startswith("torch"):
            size = re.search(r"tried to allocate (\d+) bytes", msg)
            return ("PyTorch could not allocate " + (f"{int(size.group(1)) / 1e9:.2f} GB" if size else
                                                     msg.strip().splitlines()[0][:200]))
        if type(e).__module__.startswith("onnxruntime") and ("Failed to allocate memory" in msg or "bad_alloc" in msg):
            size = re.search(r"buffer of size (\d+)", msg)
            return ("ONNX Runtime could not allocate " + (f"a buffer of {int(size.group(1)) / 1e9:.2f} GB" if size
                                                          else "memory (std::bad_alloc)"))
        e = e.__cause__ or e.__context__
    return None


def unusable_path(e: BaseException) -> tuple[str, str] | None:
    """('PATH: what is wrong with it', hint) for a path the OS cannot even look at: a name too long (ENAMETOOLONG) or a
    symbolic-link loop (ELOOP, or pathlib's RuntimeError 'Symlink loop from ...' of Path.resolve); None for anything
    else. Raised wherever a verb first probes a path the user gave (OUTDIR, SOURCE, --report-dir, ...)."""
    import errno
    import os

    def short(name) -> str:
        name = os.fsdecode(name)
        return name if len(name) <= 120 else f"{name[:60]}...{name[-40:]} ({len(name)} characters)"

    loop_hint = "a symbolic link there points (through others) back at itself: remove the loop or pass another path"
    if isinstance(e, OSError) and e.errno in (errno.ENAMETOOLONG, errno.ELOOP) and e.filename is not None:
        return (f"{short(e.filename)}: {e.strerror or e}",
                "pass a shorter path" if e.errno == errno.ENAMETOOLONG else loop_hint)
    if isinstance(e, RuntimeError) and str(e).startswith("Symlink loop from "):
        return f"{short(str(e)[len('Symlink loop from '):].strip(chr(39)))}: symbolic link loop", loop_hint
    return None


def _out_of_memory(args, detail: str) -> int:
    if args.verbose:
        import traceback
        traceback.print_exc()
    print(f"error: out of memory in 'm2export {args.verb}'" + (f": {detail}" if detail else ""), file=sys.stderr)
    print("hint: ask for smaller sizes (batch, sequence length) or run on a machine with more memory",
          file=sys.stderr)
    return ExitCode.USER_ERROR


if __name__ == "__main__":
    console_main()
