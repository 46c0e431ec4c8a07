"""Progress of `m2export check` on stderr (results stay on stdout): every phase and step named, per runner and per
reference phase; a stderr that is not a terminal gets plain lines for the steps that take a while, never silence."""

from __future__ import annotations

import io
import time

from m2export.check import console
from m2export.check.compare import run_check
from m2export.cli.main import main


def test_plain_lines_announce_long_steps_only():
    buf = io.StringIO()
    plain = console._PlainLines("check", buf, after=0.2, every=0.6)
    task = plain.new_task("prefill (2 inputs x 2 runners)", 3)
    task.doing("1x3: torch")
    task()  # quick: nothing
    task.doing("1x3: onnxrt/std")
    time.sleep(1.2)
    task()
    plain.close()
    lines = [ln.split("] ", 1)[1] for ln in buf.getvalue().splitlines()]
    assert lines[0] == "prefill (2 inputs x 2 runners) 2/3: 1x3: onnxrt/std ...", lines
    assert lines[1].startswith("prefill (2 inputs x 2 runners) 2/3: 1x3: onnxrt/std: still running ("), lines
    assert lines[-1].startswith("prefill (2 inputs x 2 runners) 2/3: 1x3: onnxrt/std done in 1."), lines
    assert all(ln.startswith("check [0m0") for ln in buf.getvalue().splitlines())
    assert "torch" not in buf.getvalue()


def test_every_phase_and_runner_is_named(tiny_out, tmp_path):
    events: list[tuple] = []

    def progress(desc, total):
        events.append(("task", desc, total))
        return console.ProgressTask(lambda: events.append(("advance", desc)),
                                    lambda what: events.append(("doing", desc, what)))

    assert run_check(tiny_out, shapes=[(1, 3)], decode_steps=1, report_dir=tmp_path, progress=progress).passed
    tasks = {e[1]: e[2] for e in events if e[0] == "task"}
    assert list(tasks) == ["setup", "prefill (3 inputs x 3 runners; the vocabulary sweep: the last 1)", "sequence (prompt 13 + 1 decode steps)",
                           "reports"], tasks
    for desc, total in tasks.items():  # each bar ends full
        assert sum(1 for e in events if e == ("advance", desc)) == total, desc
    steps = [e[2] for e in events if e[0] == "doing"]
    for want in ("reading model.onnx (contract checks)", "reading model.std.onnx (contract checks)",
                 "starting onnxrt/std", "1x3 after 19: making the feed (reference past states)", "1x3 after 19: torch",
                 "1x3 after 19: onnxrt/ssmscan", "1x3 after 19: onnxrt/std",
                 "onnxrt/std: prompt 13 + 1 decode steps, its own states fed back"):
        assert want in steps, (want, steps)
    assert any(s.startswith("loading the reference checkpoint ") for s in steps)


def test_cli_progress_on_stderr_when_not_a_terminal(tiny_out, tmp_path, capsys, monkeypatch):
    """stderr a pipe or a log (pytest's capture): plain lines on stderr for steps past PLAIN_AFTER_S (0 here: every
    step), stdout exactly the results."""
    monkeypatch.setattr(console, "PLAIN_AFTER_S", 0.0)
    real_begin = console._PlainLines._begin

    def slow_begin(self, st, what):  # every step outlives the watcher's tick
        real_begin(self, st, what)
        time.sleep(0.6)

    monkeypatch.setattr(console._PlainLines, "_begin", slow_begin)
    assert main(["check", str(tiny_out), "--shapes", "1x3", "--decode-steps", "1", "--report-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "check [" in err and "prefill (3 inputs x 3 runners; the vocabulary sweep: the last 1)" in err and "sequence (prompt" in err, err
    assert "check [" not in out and out.splitlines()[-1].startswith("PASSED | m2export check")


def test_a_plain_advance_callable_is_enough(tiny_out, tmp_path):
    """run_check's progress callback may return a plain advance() (no ProgressTask): run_check wraps it once, its
    steps unnamed; every bar still ends full and the check runs as with named steps."""
    counts: dict[str, list[int]] = {}

    def progress(desc, total):
        counts[desc] = [total, 0]
        return lambda: counts[desc].__setitem__(1, counts[desc][1] + 1)

    assert run_check(tiny_out, shapes=[(1, 3)], decode_steps=1, report_dir=tmp_path, progress=progress).passed
    assert counts and all(total == done for total, done in counts.values()), counts
