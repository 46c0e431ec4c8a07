"""Run ``m2export ARGS...`` and send this process a signal at a named point of an export (test harness).

usage: python tests/exporter/kill_driver.py POINT SIGNAL m2export-args...

POINT (each hooks a name that exists in every version of the exporter, so the same harness runs on old code):
  load          before the checkpoint is loaded (m2export.models.checkpoint.load_checkpoint)
  check         before the loader's first weight check (m2export.models.checkpoint.check_weights): files open
  torch_export  inside torch.onnx's first capture strategy (torch.export.export), whose fallback catches
                ``Exception``
  save          after the first graph file is saved (m2export.exporter.export._save)
  manifest      before the manifest is written (m2export.exporter.export.write_manifest)
  swap          before the first rename that moves the output folder (OUT as source or destination)
  swap_after    right after that rename (with SIGKILL: the swap is cut half-way)
  aside_after   (OUT the current directory, replaced in place) right after the first rename of one of OUT's entries
                out of it (into the staging folder inside it: the previous export half set aside)
  in_after      right after the first rename of an entry into OUT (the new export half moved in)
  exit          after the verb returned, when the ``m2export`` command (m2export.cli.main.console_main) is about to
                exit: the interpreter's teardown (the command runs through console_main here, not main)
SIGNAL: SIGINT, SIGTERM or SIGKILL. The signal is sent once, with os.kill to this process. Or TRUNCATE: another
process truncates the checkpoint's *.safetensors files to 0 bytes (os.truncate), once, and this one waits for it
to finish before going on. Or WAIT_OTHER: no signal; this process waits (up to 120 s, then exits 3) until another
process is writing OUT as well (a marked staging sibling of OUT whose marker names another pid) or OUT exists,
then goes on: held at ``swap``, two exports to one new OUT deterministically overlap past their output checks.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import signal
import sys
import time


def wait_for_other(out: str) -> None:
    """Wait until another process has a staging folder for ``out`` (it passed its output checks) or ``out`` exists."""
    from m2export._paths import STAGING_MARKER

    parent, name = os.path.split(out)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if os.path.lexists(out):
            return
        for s in glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.tmp-*")):
            try:
                with open(os.path.join(s, STAGING_MARKER)) as fh:
                    if json.load(fh).get("pid") != os.getpid():
                        return
            except (OSError, ValueError, AttributeError):
                pass  # being created, or gone
        time.sleep(0.02)
    print(f"kill_driver: no other export of {out} within 120 s", file=sys.stderr)
    os._exit(3)


def main() -> int:
    point, sig, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    out = os.path.abspath(args[args.index("-o") + 1])
    fired = []

    def fire():
        if not fired:
            fired.append(1)
            if sig == "WAIT_OTHER":
                wait_for_other(out)
            elif sig == "TRUNCATE":
                import subprocess

                files = sorted(glob.glob(os.path.join(args[args.index("export") + 1], "*.safetensors")))
                # Popen + wait, not run: run kills the child when the wait is interrupted by an exception
                subprocess.Popen([sys.executable, "-c", "import os, sys\nfor f in sys.argv[1:]: os.truncate(f, 0)",
                                  *files]).wait()
            else:
                os.kill(os.getpid(), getattr(signal, sig))

    def before(obj, name):
        orig = getattr(obj, name)

        @functools.wraps(orig)
        def wrapper(*a, **k):
            fire()
            return orig(*a, **k)
        setattr(obj, name, wrapper)

    if point in ("load", "check"):
        import m2export.models.checkpoint as m
        before(m, "load_checkpoint" if point == "load" else "check_weights")
    elif point == "torch_export":
        import torch.export
        before(torch.export, "export")
    elif point in ("save", "manifest"):
        import m2export.exporter.export as e
        if point == "manifest":
            before(e, "write_manifest")
        else:
            orig = e._save

            def save(*a, **k):
                r = orig(*a, **k)
                fire()
                return r
            e._save = save
    elif point in ("swap", "swap_after", "aside_after", "in_after"):
        orig_rename = os.rename

        def rename(src, dst, *a, **k):
            src, dst = os.path.abspath(src), os.path.abspath(dst)
            moves_out = out in (src, dst)
            if moves_out and point == "swap":
                fire()
            r = orig_rename(src, dst, *a, **k)
            if (moves_out and point == "swap_after" or point == "aside_after" and os.path.dirname(src) == out
                    or point == "in_after" and os.path.dirname(dst) == out):
                fire()
            return r
        os.rename = rename
    elif point == "exit":
        import m2export.cli.main as cm
        orig_finish = cm.finish_quietly

        def finish():
            orig_finish()
            fire()
        cm.finish_quietly = finish
        print("fired=pending", file=sys.stderr)  # console_main exits: the report line comes before
        sys.argv = ["m2export", *args]
        cm.console_main()
    else:
        raise SystemExit(f"unknown point {point!r}")
    from m2export.cli.main import main as m2main

    rc = m2main(args)
    print(f"fired={bool(fired)}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
