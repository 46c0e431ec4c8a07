"""CPU time and peak memory of ``m2export export`` at two commits, side by side in one run.

For each commit (``--rev``, repeatable; ``WORKTREE`` is the working tree as it is), the source is unpacked
(``git archive``) into a temporary folder and ``python -m m2export.cli.main export CKPT -o OUT -q --force``
runs from it in a fresh child process, ``--runs`` times, the commits interleaved (round-robin) so the
shared machine's load changes hit every commit alike. Per run: user + sys CPU seconds and peak RSS of that
child alone (``os.wait4``'s rusage: what ``/usr/bin/time -v`` reports), and wall seconds. The table gives the
best and the median per commit, the checkpoint's weight bytes and peak RSS / weight bytes; it is printed and
appended to benchmarks/RESULTS.md with the date, CPU, load average and versions.

    python benchmarks/bench_export_cost.py CKPT --rev 2d92c19 --rev WORKTREE --runs 3
    flock /work/wt/BIGMEM.lock python benchmarks/bench_export_cost.py CK27 --dtype fp16 --rev main --rev WORKTREE

Only the export itself is measured (its default flavour, its onnx.checker check); exports are written under
``--workdir`` and deleted after each run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tree(rev: str, into: Path) -> Path:
    """The source of ``rev`` (``WORKTREE``: this working tree) as a folder to run from."""
    if rev == "WORKTREE":
        return ROOT
    dst = into / rev.replace("/", "_")
    dst.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dst)], input=archive, check=True)
    return dst


def _run(tree: Path, ck: str, out: Path, extra: list[str]) -> dict:
    """One export in a fresh child run from ``tree``: rc, cpu_s (user + sys), peak_rss_bytes, wall_s."""
    env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "m2export.cli.main", "export", ck, "-o", str(out), "-q", "--force", *extra]
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=str(tree), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    err = proc.stderr.read().decode(errors="replace").strip().splitlines()[-1:] if proc.stderr else []
    proc.returncode = os.waitstatus_to_exitcode(status)
    shutil.rmtree(out, ignore_errors=True)
    return {"rc": proc.returncode, "cpu_s": ru.ru_utime + ru.ru_stime, "user_s": ru.ru_utime, "sys_s": ru.ru_stime,
            "peak_rss_bytes": ru.ru_maxrss * 1024, "wall_s": wall, "err": err}


def _weight_bytes(ck: str) -> int:
    p = Path(ck)
    files = [p] if p.is_file() else [*p.glob("*.safetensors"), *p.glob("*.bin")]
    return sum(f.stat().st_size for f in files)


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for pkg in ("torch", "onnx", "onnxscript", "onnx-ir", "onnxruntime", "safetensors"):
        try:
            out.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            pass
    return ", ".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--rev", action="append", required=True, help="git revision, or WORKTREE (repeatable)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default=None, choices=["fp32", "fp16", "bf16"])
    ap.add_argument("--ssm-impl", default=None)
    ap.add_argument("--label", default="", help="what the checkpoint is, for the table")
    ap.add_argument("--workdir", default=None, help="where exports go (default: a temporary folder)")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args(argv)

    extra = [*(["--dtype", args.dtype] if args.dtype else []), *(["--ssm-impl", args.ssm_impl] if args.ssm_impl else [])]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="m2export-bench-cost-", dir=args.workdir) as tmp:
        tmp = Path(tmp)
        trees = {rev: _tree(rev, tmp / "src") for rev in args.rev}
        runs: dict[str, list[dict]] = {rev: [] for rev in args.rev}
        for i in range(args.runs):
            for rev, tree in trees.items():
                r = _run(tree, args.checkpoint, tmp / "out", extra)
                runs[rev].append(r)
                print(f"run {i + 1} {rev}: rc {r['rc']} cpu {r['cpu_s']:.1f} s (user {r['user_s']:.1f} + sys "
                      f"{r['sys_s']:.1f}), peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB, wall {r['wall_s']:.0f} s"
                      + (f"  {r['err']}" if r["rc"] else ""), file=sys.stderr, flush=True)
    load_after = os.getloadavg()
    wb = _weight_bytes(args.checkpoint)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"#### bench_export_cost.py — {stamp} — CPU here ({platform.machine()}, {os.cpu_count()} cores, shared; "
             f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after)", "",
             f"`{' '.join(['m2export export', args.label or args.checkpoint, '-q --force', *extra])}`"
             + f", weights {wb / 1e9:.2f} GB; {args.runs} runs per commit, interleaved; {_versions()}.", "",
             "| code | user + sys CPU, best / median | peak RSS, best / median | x weight bytes (best) | wall best / median |",
             "| --- | --- | --- | --- | --- |"]
    for rev, rs in runs.items():
        ok = [r for r in rs if r["rc"] == 0]
        if not ok:
            lines.append(f"| {rev} | FAILED ({rs[-1]['err']}) | | | |")
            continue
        cpu = [r["cpu_s"] for r in ok]
        rss = [r["peak_rss_bytes"] / 2**30 for r in ok]
        wall = [r["wall_s"] for r in ok]
        name = rev if rev != "WORKTREE" else "this change"
        lines.append(f"| {name} | {min(cpu):.1f} / {statistics.median(cpu):.1f} s | {min(rss):.2f} / "
                     f"{statistics.median(rss):.2f} GiB | {min(rss) * 2**30 / wb:.2f}x | {min(wall):.0f} / "
                     f"{statistics.median(wall):.0f} s |" + (f" ({len(rs) - len(ok)} failed)" if len(ok) < len(rs) else ""))
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_append:
        with open(args.results, "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
