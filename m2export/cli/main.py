"""``m2export`` command line: one module per verb in m2export/cli/.

Each verb module defines ``HELP`` (one line), ``DESCRIPTION`` (its --help text, with examples),
``add_arguments(parser)`` and ``run(args) -> int``; heavy libraries are imported inside ``run``.
A verb whose module fails to import is listed as unavailable with the reason, so ``--help`` works.

Exit codes: 0 success; 1 user error (bad input, printed as one line + hint); 2 bad command line;
3 accuracy check failed; 4 a required backend (TensorRT, CUDA, cuTile) is unavailable;
70 internal error (a bug: traceback printed).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time

from m2export.errors import M2ExportError

VERBS = {
    "export": "m2export.cli.export",
    "build": "m2export.cli.build",
    "check": "m2export.cli.check",
    "generate": "m2export.cli.generate",
    "inspect": "m2export.cli.inspect",
    "random-checkpoint": "m2export.cli.random_checkpoint",
}
EXIT_INTERNAL = 70
log = logging.getLogger("m2export")


def _add_logging_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Logging")
    g.add_argument("-v", "--verbose", action="count", default=0, help="more output; tracebacks on errors")
    g.add_argument("-q", "--quiet", action="store_true", help="only errors (and the PASSED/FAILED line of check)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="m2export", description="Export Mamba-2 checkpoints to ONNX and TensorRT engines and check their accuracy.",
        epilog="Run 'm2export VERB --help' for a verb's options and examples. " + __doc__.split("Exit codes:")[1].strip()
        .replace("\n", " ").join(["Exit codes: ", ""]), formatter_class=argparse.RawDescriptionHelpFormatter)
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
        p.set_defaults(_run=mod.run)
    return parser


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("m2export")
    except Exception:
        return "0+unknown"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verb is None:
        parser.print_help()
        return 2
    if getattr(args, "_unavailable", None):
        print(f"error: {args._unavailable}", file=sys.stderr)
        return 4
    level = logging.WARNING if args.quiet else (logging.DEBUG if args.verbose > 1 else logging.INFO)
    logging.basicConfig(level=level, format="%(message)s")
    t0 = time.perf_counter()
    try:
        return int(args._run(args) or 0)
    except M2ExportError as e:
        if args.verbose:
            import traceback
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        if e.hint:
            print(f"hint: {e.hint}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception:
        import traceback
        traceback.print_exc()
        print(f"internal error in 'm2export {args.verb}' after {time.perf_counter() - t0:.1f}s: this is a bug, "
              "please report it with the traceback above", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
