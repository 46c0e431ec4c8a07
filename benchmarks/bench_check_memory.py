"""Where ``m2export check`` spends its memory and CPU: an RSS timeline with the runner events, or a profile.

Runs ``m2export check OUTDIR [ARGS...]`` in this process (the CLI's own ``main``), with a thread that reads
this process's resident set size (``VmRSS`` of ``/proc/self/status``; also its
``RssAnon``/``RssFile`` split, and ``Pss``/USS of ``/proc/self/smaps_rollup``, whose peaks are printed at the end:
RSS counts a file page once per mapping of it, PSS divides every page among the mappings and processes that map
it, USS is the process's private pages only) every ``--interval`` seconds, and
marks on the timeline every Polygraphy runner's activation and deactivation (``BaseRunner.activate`` /
``deactivate``, wrapped) and every progress-bar section. It prints (stderr, as they happen) one line per
event with the RSS at that moment and the peak since the previous event, then the whole run's peak RSS
(``getrusage``: what ``/usr/bin/time -v`` reports as "Maximum resident set size"), user+sys CPU seconds,
wall time, the check's exit code, and the wall time spent inside each runner's ``infer`` (the runtimes' own
compute, the reference's included) against the whole run's. ``--profile FILE`` writes a cProfile of the run instead (``pstats``
readable; the top 25 by cumulative time are printed). Linux only (``/proc``).

    python benchmarks/bench_check_memory.py /tmp/chk/out130 -q
    python benchmarks/bench_check_memory.py /tmp/chk/out130 -q --profile /tmp/chk/check.prof
    python benchmarks/bench_check_memory.py /tmp/chk/out130 -q --sweep-feeds 4   # a shorter run, same peak

``--code DIR`` imports m2export from DIR (e.g. ``git archive`` of another commit unpacked there) instead of this
checkout, so one script measures before and after in the same session; ``--append LABEL`` adds one row with the
run's numbers to a table in benchmarks/RESULTS.md (``--table-header`` first writes the table's heading and column
line), x weight bytes taken from the export's ``*.onnx.data`` files.
"""

from __future__ import annotations

import argparse
import resource
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rss_parts() -> tuple[int, int, int]:
    """(VmRSS, RssAnon, RssFile) of this process in bytes, from /proc/self/status: RssFile is mapped file pages
    (the weight files' page-cache pages: shared, reclaimable), RssAnon the process's private memory."""
    got = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "RssAnon", "RssFile"):
                got[key] = int(line.split()[1]) * 1024
    return got.get("VmRSS", 0), got.get("RssAnon", 0), got.get("RssFile", 0)


def smaps_rollup() -> tuple[int, int]:
    """(Pss, USS = Private_Clean + Private_Dirty) of this process in bytes, from /proc/self/smaps_rollup."""
    got = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0] in ("Pss:", "Private_Clean:", "Private_Dirty:"):
                got[parts[0]] = int(parts[1]) * 1024
    return got.get("Pss:", 0), got.get("Private_Clean:", 0) + got.get("Private_Dirty:", 0)


def rss_bytes() -> int:
    """Resident set size of this process (bytes), from /proc/self/status."""
    return rss_parts()[0]


class Timeline:
    """RSS samples every ``interval`` s plus named events; ``peak_between`` gives the peak between events."""

    def __init__(self, interval: float):
        self.interval = interval
        self.t0 = time.perf_counter()
        self.samples: list[tuple[float, int]] = []
        self.peak_anon = self.peak_file = self.peak_pss = self.peak_uss = 0
        self.infer_s: dict[str, float] = {}  # wall seconds inside each runner's infer()
        self.mark_infer = False  # mark every infer() on the timeline (--mark-infer)
        self.events: list[tuple[float, int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            rss, anon, file = rss_parts()
            self.samples.append((time.perf_counter() - self.t0, rss))
            self.peak_anon, self.peak_file = max(self.peak_anon, anon), max(self.peak_file, file)
            pss, uss = smaps_rollup()
            self.peak_pss, self.peak_uss = max(self.peak_pss, pss), max(self.peak_uss, uss)
            self._stop.wait(self.interval)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join()

    def mark(self, what: str):
        t, rss = time.perf_counter() - self.t0, rss_bytes()
        prev = self.events[-1][0] if self.events else 0.0
        peak = max([r for s, r in self.samples if s >= prev] + [rss])
        self.events.append((t, rss, what))
        print(f"{t:8.1f}s  rss {rss / 1e9:6.2f} GB  (peak since previous {peak / 1e9:6.2f} GB)  {what}",
              file=sys.stderr, flush=True)



def _instrument(tl: Timeline):
    from polygraphy.backend.base import BaseRunner

    from m2export.check import console

    act, deact, infer = BaseRunner.activate, BaseRunner.deactivate, BaseRunner.infer

    def activate(self):
        tl.mark(f"activate {self.name} ...")
        act(self)
        tl.mark(f"activated {self.name}")

    def deactivate(self):
        deact(self)
        tl.mark(f"deactivated {self.name}")

    def timed_infer(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return infer(self, *args, **kwargs)
        finally:
            tl.infer_s[self.name] = tl.infer_s.get(self.name, 0.0) + time.perf_counter() - t
            if tl.mark_infer:
                tl.mark(f"    {self.name} infer done")

    BaseRunner.activate, BaseRunner.deactivate, BaseRunner.infer = activate, deactivate, timed_infer
    orig = console.progress_bars

    import contextlib

    @contextlib.contextmanager
    def bars(enabled=True, name="m2export"):
        with orig(enabled, name) as prog:
            def wrapped(desc, total):
                tl.mark(f"section: {desc}")
                task, done = prog(desc, total), [0]

                def step():
                    done[0] += 1
                    tl.mark(f"  {desc.split(':')[0]} {done[0]}/{total} done")
                    task()

                def doing(what):
                    tl.mark(f"  {desc.split(':')[0]}: {what}")
                    task.doing(what)
                return console.ProgressTask(step, doing)
            yield wrapped

    console.progress_bars = bars


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--interval", type=float, default=0.1, help="RSS sampling interval, s (default 0.1)")
    p.add_argument("--profile", metavar="FILE", help="write a cProfile of the run to FILE")
    p.add_argument("--sweep-feeds", type=int, metavar="N",
                   help="keep only the first N vocabulary-sweep feeds (every sweep feed has the same shape, so the "
                        "peak is the same; a 50k vocabulary has ~150 of them). Not the check's default: say so")
    p.add_argument("--mark-infer", action="store_true", help="also mark the end of every runner's infer() call")
    p.add_argument("--code", metavar="DIR", type=Path, help="import m2export from DIR instead of this checkout")
    p.add_argument("--append", metavar="LABEL", help="append a row for this run, labelled LABEL, to RESULTS.md")
    p.add_argument("--table-header", metavar="TITLE", help="with --append: first write a '## TITLE' heading and the "
                                                         "table's column line")
    args, check_args = p.parse_known_args()
    if args.code is not None:
        sys.path.insert(0, str(args.code.resolve()))
    import m2export
    from m2export.cli.main import main as cli_main

    print(f"m2export from {Path(m2export.__file__).parent}", file=sys.stderr)
    load0 = open("/proc/loadavg").read().split()[0]

    if args.sweep_feeds is not None:
        from m2export.check import data

        full = data.vocab_sweep_windows
        data.vocab_sweep_windows = lambda *a, **k: full(*a, **k)[:args.sweep_feeds]
    tl = Timeline(args.interval).start()
    tl.mark_infer = args.mark_infer
    _instrument(tl)
    t = time.perf_counter()
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        rc = prof.runcall(cli_main, ["check", *check_args])
        prof.dump_stats(args.profile)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
    else:
        rc = cli_main(["check", *check_args])
    wall = time.perf_counter() - t
    tl.mark("end")
    tl.stop()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(f"peak RSS {ru.ru_maxrss * 1024 / 1e9:.2f} GB | user+sys CPU {ru.ru_utime + ru.ru_stime:.1f} s "
          f"(user {ru.ru_utime:.1f}) | wall {wall:.1f} s | exit {rc} | sampled peaks: RssAnon "
          f"{tl.peak_anon / 1e9:.2f} GB, RssFile {tl.peak_file / 1e9:.2f} GB, PSS {tl.peak_pss / 1e9:.2f} GB, "
          f"USS {tl.peak_uss / 1e9:.2f} GB", file=sys.stderr)
    inside = sum(tl.infer_s.values())
    print(f"wall inside runners' infer(): {inside:.1f} s of {wall:.1f} s ({100 * inside / wall:.0f}%): "
          + ", ".join(f"{k} {v:.1f}" for k, v in sorted(tl.infer_s.items(), key=lambda kv: -kv[1])), file=sys.stderr)
    if args.append:
        _append_row(args, check_args, ru, wall, rc, inside, tl, load0)
    return rc


COLUMNS = ("run", "check arguments", "peak RSS", "x weights", "peak PSS", "x weights (PSS)", "peak USS",
           "peak RssAnon", "peak RssFile", "user+sys CPU", "wall", "in runners' infer()", "exit", "load at start")


def _append_row(args, check_args: list[str], ru, wall: float, rc: int, inside: float, tl: Timeline, load0: str):
    """One RESULTS.md row for this run (after a heading and column line with ``--table-header``)."""
    from _report import publish, utc_now

    outdir = next((Path(a) for a in check_args if not a.startswith("-") and (Path(a) / "m2export.json").is_file()),
                  None)
    weights = sum(f.stat().st_size for f in outdir.glob("*.onnx.data")) if outdir else 0
    peak = ru.ru_maxrss * 1024
    x = (lambda b: f"{b / weights:.2f}x") if weights else (lambda b: "-")
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    bench = f" (bench: --sweep-feeds {args.sweep_feeds})" if args.sweep_feeds is not None else ""
    row = [f"{args.append} ({utc_now()})", "`" + " ".join(check_args) + "`" + bench, gb(peak), x(peak), gb(tl.peak_pss),
           x(tl.peak_pss), gb(tl.peak_uss), gb(tl.peak_anon), gb(tl.peak_file), f"{ru.ru_utime + ru.ru_stime:.0f} s",
           f"{wall:.0f} s", f"{inside:.0f} s ({100 * inside / wall:.0f}%)", str(rc), load0]
    text = "| " + " | ".join(row) + " |\n"
    if args.table_header:
        text = (f"## {args.table_header}\n\nweights: {gb(weights)} (the export's *.onnx.data)\n\n| "
                + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n" + text)
    publish(text, sep="\n" if args.table_header else "")


if __name__ == "__main__":
    sys.exit(main())
