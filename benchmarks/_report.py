"""What every benchmark script does with its table: print it (stdout) and append it to benchmarks/RESULTS.md."""

from __future__ import annotations

import datetime
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def utc_now() -> str:
    """The run's time stamp for the table heading (``2026-12-01 13:16 UTC``)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def publish(table: str, results: str | Path = RESULTS, *, sep: str = "\n") -> None:
    """Print ``table`` to stdout and append it to ``results`` after ``sep`` (a blank line by default; ""
    to continue what an earlier call wrote, e.g. more rows of the same table)."""
    print(table, end="" if table.endswith("\n") else "\n", flush=True)
    with open(results, "a") as f:
        f.write(sep + table)


def du(path: Path) -> int:
    """Bytes of the regular files under ``path`` (bytes on disk of an export or checkpoint folder)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _mem_available() -> int:
    """MemAvailable of /proc/meminfo, bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def measured_run(cmd: list[str], *, env: dict | None = None, min_available: int | None = None) -> dict:
    """Run ``cmd`` in a fresh process and measure it alone: ``wall_s``, ``cpu_s`` (user + sys seconds),
    ``peak_rss_bytes`` (its ``ru_maxrss``, from ``os.wait4`` of that one child, so earlier children do not
    mask it as ``RUSAGE_CHILDREN``'s maximum would), ``rc``, ``stdout`` and the last lines of stderr (``tail``).

    ``min_available`` (bytes): a watchdog kills the child (SIGKILL, that pid only) when the machine's
    MemAvailable falls below it, before the kernel's OOM killer picks a process of someone else on a shared
    machine; ``killed`` then says so (and ``peak_rss_bytes`` is the peak it had reached).
    Never raises for a failed command: the caller reports ``rc`` and ``tail`` (a failure is a result too)."""
    import os
    import subprocess
    import tempfile
    import threading
    import time

    killed: list[str] = []
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        done = threading.Event()

        def watch():
            while not done.wait(0.25):
                avail = _mem_available()
                if avail < min_available:
                    killed.append(f"killed by the benchmark's watchdog: MemAvailable {avail / 2**30:.2f} GiB < "
                                  f"{min_available / 2**30:.2f} GiB")
                    os.kill(proc.pid, 9)
                    return

        if min_available:
            threading.Thread(target=watch, daemon=True).start()
        _, status, ru = os.wait4(proc.pid, 0)
        done.set()
        wall = time.perf_counter() - t
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    tail = " / ".join(killed + stderr.strip().splitlines()[-3:])
    return {"wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime, "peak_rss_bytes": ru.ru_maxrss * 1024,  # KiB
            "rc": proc.returncode, "stdout": stdout, "tail": tail, "killed": bool(killed)}


def profile_by_op(path: str | Path) -> dict[str, tuple[int, float]]:
    """An ORT profile JSON (``SessionOptions.enable_profiling``) summed per op type: op -> (node events, ms)."""
    import json

    out: dict[str, tuple[int, float]] = {}
    for e in json.loads(Path(path).read_text()):
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            op = e.get("args", {}).get("op_name", "?")
            n, ms = out.get(op, (0, 0.0))
            out[op] = (n + 1, ms + e.get("dur", 0) / 1e3)
    return out
