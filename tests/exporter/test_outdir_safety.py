"""export never destroys what it should not, and never leaves a half-written OUTDIR.

The current directory, a user's files (in OUT, appearing in OUT during the export, in a symlinked OUT's
target, in a checkpoint's weights reached through a symlink, on a mount point) survive; SIGINT/SIGTERM
at any point leave OUT as the previous export or the new one, complete, and nothing else; a killed
export's temporary folder is cleaned by the next one; a file-size limit is a one-line error.
"""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from m2export.cli.main import main
from m2export.models.checkpoint import random_checkpoint

TINY = dict(d_model=32, n_layer=1, vocab_size=64, d_state=16, headdim=16, chunk_size=8)
DRIVER = Path(__file__).with_name("kill_driver.py")
REPO = Path(__file__).resolve().parents[2]
posix = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    return random_checkpoint(tmp_path_factory.mktemp("ck") / "ck", **TINY)


@pytest.fixture(scope="module")
def previous(tmp_path_factory, ck):
    """A previous export (ssmscan flavour only: the new exports below add *.std.onnx, so the two differ)."""
    out = tmp_path_factory.mktemp("prev") / "prev"
    assert main(["export", str(ck), "-o", str(out), "-q"]) == 0
    return out


def fingerprint(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


def is_complete_export(d: Path, ssm_impl: str) -> bool:
    """The manifest is readable and names exactly the files present (plus genai_config.json), each a loadable
    ONNX graph."""
    import onnx

    from m2export.exporter.genai import GENAI_CONFIG_FILE
    from m2export.exporter.manifest import read_manifest

    m = read_manifest(d)
    files = {g.file for g in m.graphs}
    data = {x for g in m.graphs for x in g.external_data}  # the weights, once (model.onnx.data)
    if sorted(files | data | {"m2export.json", GENAI_CONFIG_FILE}) != sorted(p.name for p in d.iterdir()):
        return False
    if ssm_impl == "both" and len(files) != 2:
        return False
    for f in files:
        onnx.load(str(d / f))
    return True


def run_cli(*args, point=None, sig="SIGTERM", limit_fsize=None, timeout=240, ignore_sigint=False, cwd=None):
    """m2export in a subprocess (through the kill driver when ``point`` is given); ``ignore_sigint``: started with
    SIGINT ignored (as ``cmd &`` in a non-interactive shell starts it)."""
    cmd = [sys.executable, str(DRIVER), point, sig, *args] if point else [sys.executable, "-m", "m2export.cli.main",
                                                                           *args]

    def pre():
        if limit_fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_fsize, limit_fsize))
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # as a shell with 'ulimit -f' does not; see the test
        if ignore_sigint:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=pre, env=env, cwd=cwd)


def test_force_refuses_current_directory(tmp_path, monkeypatch, capsys, ck):
    work = tmp_path / "work"
    work.mkdir()
    (work / "precious.txt").write_text("keep")
    monkeypatch.chdir(work)
    assert main(["export", str(ck), "-o", ".", "--force", "-q"]) == 1
    assert "current directory" in capsys.readouterr().err
    monkeypatch.chdir(work / "..")
    assert main(["export", str(ck), "-o", str(tmp_path), "--force", "-q"]) == 1  # an ancestor of the cwd
    assert (work / "precious.txt").read_text() == "keep"


@pytest.mark.parametrize("spelling", [".", "abs"])
def test_export_into_the_empty_current_directory_keeps_that_directory(tmp_path, monkeypatch, ck, spelling):
    """`export -o .` in an empty current directory renamed the staged folder onto it: a new inode, the caller's
    shell left in a deleted directory (it saw no files; the next m2export there failed). It is written in place
    now, like an empty mount point: same inode, a complete export, no staging folder left."""
    work = tmp_path / "work"
    work.mkdir()
    inode = work.stat().st_ino
    monkeypatch.chdir(work)
    assert main(["export", str(ck), "-o", "." if spelling == "." else str(work), "-q"]) == 0
    assert work.stat().st_ino == inode and os.stat(".").st_nlink > 0 and os.path.samefile(".", work)
    assert is_complete_export(work, "ssmscan")


@posix
def test_interrupted_export_into_the_current_directory_leaves_it_empty(tmp_path, ck):
    work = tmp_path / "work"
    work.mkdir()
    inode = work.stat().st_ino
    r = run_cli("export", str(ck), "-o", ".", "-q", point="manifest", sig="SIGTERM", cwd=work)
    assert "fired=True" in r.stderr and r.returncode == 143, r.stderr[-2000:]
    assert work.stat().st_ino == inode and list(work.iterdir()) == []


@pytest.mark.parametrize("spelling", [".", "abs"])
def test_force_replaces_a_previous_export_in_the_current_directory(tmp_path, monkeypatch, capsys, ck, previous,
                                                                   spelling):
    """`export -o . --force` over a previous export in the current directory was refused ("is (or contains) the
    current directory") although --force replaces that export anywhere else: it is replaced in place now (same
    inode, the new export complete, nothing of the old one or of the staging left)."""
    work = tmp_path / "work"
    shutil.copytree(previous, work)
    inode = work.stat().st_ino
    monkeypatch.chdir(work)
    rc = main(["export", str(ck), "-o", "." if spelling == "." else str(work), "--ssm-impl", "both", "--force", "-q"])
    assert rc == 0, capsys.readouterr().err
    assert work.stat().st_ino == inode and os.path.samefile(".", work)
    assert is_complete_export(work, "both")


def test_force_in_the_current_directory_leaves_other_runs_temporaries(tmp_path, monkeypatch, ck, previous):
    """.m2export* entries are left out of the --force rule (another run's temporaries: a running build's
    .m2export-timing-* folder): replacing the current directory in place leaves them where they are."""
    work = tmp_path / "work"
    shutil.copytree(previous, work)
    (work / ".m2export-timing-abc").mkdir()
    (work / ".m2export-timing-abc" / "cache").write_text("a build's")
    monkeypatch.chdir(work)
    assert main(["export", str(ck), "-o", ".", "--force", "-q"]) == 0
    assert (work / ".m2export-timing-abc" / "cache").read_text() == "a build's"
    shutil.rmtree(work / ".m2export-timing-abc")
    assert is_complete_export(work, "ssmscan")


@pytest.mark.parametrize("flags", [["--force"], ["--force", "--force-foreign"]])
def test_force_keeps_refusing_the_current_directory_holding_a_users_file(tmp_path, monkeypatch, capsys, ck,
                                                                         previous, flags):
    """A previous export plus the user's notes.txt: not m2export's; the current directory is never replaced then,
    --force-foreign included (renaming it aside is impossible and deleting the user's file is not ours)."""
    work = tmp_path / "work"
    shutil.copytree(previous, work)
    (work / "notes.txt").write_text("mine")
    before = fingerprint(work)
    monkeypatch.chdir(work)
    assert main(["export", str(ck), "-o", ".", "-q", *flags]) == 1
    assert "current directory" in capsys.readouterr().err
    assert fingerprint(work) == before


def test_a_file_written_into_the_current_directory_during_a_forced_export_survives(tmp_path, monkeypatch, capsys,
                                                                                     ck, previous):
    import m2export.exporter.export as ex

    work = tmp_path / "work"
    shutil.copytree(previous, work)
    before = fingerprint(work)
    orig = ex._export_step

    def step(*a, **k):
        (work / "arrived.txt").write_text("someone else's")
        return orig(*a, **k)
    monkeypatch.setattr(ex, "_export_step", step)
    monkeypatch.chdir(work)
    assert main(["export", str(ck), "-o", ".", "--ssm-impl", "both", "--force", "-q"]) == 1
    assert "left it alone and wrote nothing" in capsys.readouterr().err
    assert fingerprint(work) == {**before, "arrived.txt": fingerprint(work)["arrived.txt"]}
    assert sorted(p.name for p in work.iterdir()) == sorted([*before, "arrived.txt"])  # no staging folder left


@posix
@pytest.mark.parametrize("point", ["aside_after", "in_after"])
def test_sigkill_while_replacing_the_current_directory_is_undone_or_finished(tmp_path, ck, previous, point, caplog):
    """SIGKILL half-way through setting the previous export aside: the next run's clean-up puts it back; half-way
    through moving the new one in: it moves the rest in. Either way one whole export."""
    work = tmp_path / "work"
    shutil.copytree(previous, work)
    before = fingerprint(work)
    inode = work.stat().st_ino
    r = run_cli("export", str(ck), "-o", ".", "--ssm-impl", "both", "--force", "-q", point=point, sig="SIGKILL",
                cwd=work)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    stale = [p.name for p in work.iterdir() if p.name.startswith(".m2export.tmp-")]
    assert len(stale) == 1, "nothing to clean: bad test"
    r = run_cli("inspect", ".", cwd=work)  # reads only: cleans nothing
    assert stale == [p.name for p in work.iterdir() if p.name.startswith(".m2export.tmp-")]
    from m2export._paths import clean_stale

    with caplog.at_level("WARNING", logger="m2export"):
        assert [p.name for p in clean_stale(work)] == stale
    assert f"note: removed {work / stale[0]}, the temporary folder of an m2export run that was killed" in caplog.text
    assert ("were put back into" if point == "aside_after" else "was moved into") in caplog.text
    assert work.stat().st_ino == inode
    if point == "aside_after":
        assert fingerprint(work) == before
    else:
        assert is_complete_export(work, "both")


# ------------------------------------------------------------------------------------------ item 7: --force
def test_force_refuses_a_folder_m2export_did_not_write(tmp_path, capsys, ck):
    out = tmp_path / "thesis"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    assert main(["export", str(ck), "-o", str(out), "--force", "-q"]) == 1
    err = capsys.readouterr().err
    assert "has no m2export manifest" in err and "--force-foreign" in err
    assert (out / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thesis"]


@pytest.mark.parametrize("name", ["notes.txt", "mine.onnx", "mine.onnx.data", "mine.plan"])
def test_force_refuses_an_export_holding_a_users_file(tmp_path, capsys, ck, previous, name):
    """A user's own graph, weights or engine in an export folder (mine.onnx): --force deleted it (any *.onnx,
    *.onnx.data or *.plan counted as m2export's); only the names m2export writes do now."""
    out = tmp_path / "out"
    shutil.copytree(previous, out)
    (out / name).write_text("mine")
    assert main(["export", str(ck), "-o", str(out), "--force", "-q"]) == 1
    assert f"did not write ({name})" in capsys.readouterr().err
    assert (out / name).read_text() == "mine"


@pytest.mark.parametrize("name", ["model.std.onnx", "model.native.onnx", "model.packed.onnx", "model.plan",
                                  "model.decode.plan", "model.std.plan"])
def test_force_refuses_unlisted_files_named_like_m2exports_graphs_and_engines(tmp_path, capsys, ck, previous, name):
    """A graph or engine of a name m2export writes that the manifest does not list (a user's own model.plan, a
    model.std.onnx copied in from elsewhere) was taken for m2export's and deleted by --force: only what the
    manifest lists is m2export's now. One line naming the file, exit 1, the file kept; the listed ones (the
    previous export's model.onnx, model.onnx.data) are still replaced (test_force_replaces_... below)."""
    out = tmp_path / "out"
    shutil.copytree(previous, out)
    (out / name).write_text("mine")
    assert main(["export", str(ck), "-o", str(out), "--force", "-q"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[0] == (f"error: {out}: holds file(s) m2export did not write ({name}); --force replaces "
                                   "only folders m2export wrote"), err
    assert (out / name).read_text() == "mine"


def test_force_replaces_the_graphs_and_engines_the_manifest_lists(tmp_path, ck, previous):
    """The previous export's graph and weights, and an engine its manifest lists, are m2export's: replaced."""
    from tests.check.exports import record_engine

    out = tmp_path / "out"
    shutil.copytree(previous, out)
    record_engine(out, [], file="model.plan")
    assert main(["export", str(ck), "-o", str(out), "--force", "-q", "--ssm-impl", "both"]) == 0
    assert is_complete_export(out, "both")


@pytest.mark.parametrize("name", ["check_report.md", "check_inputs.json", "tokenizer.json", ".timing.cache"])
def test_force_refuses_a_users_file_named_like_one_m2export_writes(tmp_path, capsys, ck, previous, name):
    """A user's own check_report.md (tokenizer.json, ...) in an export folder, not written by m2export: --force
    deleted it (every name m2export may write counted as m2export's, whatever the content). Now only a file the
    manifest records (its sha256) is: one line naming the file, exit 1, the file kept."""
    out = tmp_path / "out"
    shutil.copytree(previous, out)
    (out / name).write_text("my notes")
    assert main(["export", str(ck), "-o", str(out), "--force", "-q"]) == 1
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert first == f"error: {out}: holds file(s) m2export did not write ({name}); --force replaces only folders " \
                    "m2export wrote", err
    assert err.count("error:") == 1 and "Traceback" not in err
    assert (out / name).read_text() == "my notes"


def test_force_refuses_an_auxiliary_file_changed_since_m2export_wrote_it(tmp_path, capsys, ck, previous):
    """genai_config.json as the previous export wrote it is replaced (the other --force tests); edited by the user
    (its content no longer the recorded sha256), it is theirs: refused, naming it, and kept."""
    from m2export.exporter.genai import GENAI_CONFIG_FILE

    out = tmp_path / "out"
    shutil.copytree(previous, out)
    mine = (out / GENAI_CONFIG_FILE).read_text().replace('"num_beams": 1', '"num_beams": 4')
    assert mine != (previous / GENAI_CONFIG_FILE).read_text()
    (out / GENAI_CONFIG_FILE).write_text(mine)
    assert main(["export", str(ck), "-o", str(out), "--force", "-q"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out}: holds file(s) changed since m2export wrote them ({GENAI_CONFIG_FILE}); "), err
    assert (out / GENAI_CONFIG_FILE).read_text() == mine


def test_force_refuses_auxiliary_files_a_manifest_without_the_record_lists(tmp_path, capsys, ck, previous):
    """A folder from an m2export that recorded no ``files``: its genai_config.json cannot be told from a user's, so
    --force refuses and says why (--force-foreign replaces it)."""
    import json

    from m2export.exporter.configs import MANIFEST_FILE

    out = tmp_path / "out"
    shutil.copytree(previous, out)
    raw = json.loads((out / MANIFEST_FILE).read_text())
    del raw["files"]
    (out / MANIFEST_FILE).write_text(json.dumps(raw))
    assert main(["export", str(ck), "-o", str(out), "--force", "-q"]) == 1
    err = capsys.readouterr().err
    assert "did not write (genai_config.json) (its m2export.json, from an older m2export, records none" in err, err
    assert main(["export", str(ck), "-o", str(out), "--force", "--force-foreign", "-q"]) == 0


def test_check_reports_written_into_the_export_are_recorded_and_replaced(tmp_path, ck, previous):
    """`m2export check OUTDIR` records the reports it writes there: a later --force replaces them."""
    from m2export.exporter.manifest import CHECK_REPORT_FILES, file_sha256, read_manifest

    out = tmp_path / "out"
    shutil.copytree(previous, out)
    assert main(["check", str(out), "--shapes", "1x4", "--decode-steps", "1", "-q"]) == 0
    files = read_manifest(out).files
    written = [n for n in CHECK_REPORT_FILES if (out / n).exists()]
    assert "check_report.md" in written and sorted(n for n in files if n in CHECK_REPORT_FILES) == sorted(written)
    assert all(files[n] == file_sha256(out / n) for n in written)
    assert main(["export", str(ck), "-o", str(out), "--force", "-q"]) == 0
    assert is_complete_export(out, "ssmscan")


def test_force_foreign_replaces_on_request(tmp_path, ck):
    out = tmp_path / "thesis"
    out.mkdir()
    (out / "thesis.tex").write_text("draft")
    assert main(["export", str(ck), "-o", str(out), "--force", "--force-foreign", "-q"]) == 0
    assert is_complete_export(out, "ssmscan")


def test_force_foreign_alone_says_it_needs_force(tmp_path, capsys, ck):
    """--force-foreign without --force refuses (nothing deleted) and says the two go together; it used to answer
    'pass --force to replace it' as if the user had asked for nothing."""
    out = tmp_path / "thesis"
    out.mkdir()
    (out / "thesis.tex").write_text("draft")
    assert main(["export", str(ck), "-o", str(out), "--force-foreign", "-q"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out}: exists and is not empty; --force-foreign replaces a folder only together "
                          "with --force\nhint: pass --force as well"), err
    assert (out / "thesis.tex").read_text() == "draft" and "Traceback" not in err


def test_force_never_follows_a_symlinked_outdir(tmp_path, capsys, ck, previous):
    real = tmp_path / "real"
    shutil.copytree(previous, real)
    (tmp_path / "link").symlink_to(real)
    before = fingerprint(real)
    assert main(["export", str(ck), "-o", str(tmp_path / "link"), "--force", "-q"]) == 1
    assert "symbolic link" in capsys.readouterr().err
    assert fingerprint(real) == before and (tmp_path / "link").is_symlink()


def test_force_never_deletes_a_checkpoint_reached_through_a_symlink(tmp_path, capsys, ck):
    realw = tmp_path / "realw"
    shutil.copytree(ck, realw)
    ck2 = tmp_path / "ck2"
    ck2.mkdir()
    shutil.copy(ck / "config.json", ck2 / "config.json")
    (ck2 / "model.safetensors").symlink_to(realw / "model.safetensors")
    before = fingerprint(realw)
    assert main(["export", str(ck2), "-o", str(realw), "--force", "-q"]) == 1
    assert "holds the checkpoint's file" in capsys.readouterr().err
    assert fingerprint(realw) == before


# ------------------------------------------------------------------------------------------ item 5: races
def test_files_appearing_in_outdir_during_the_export_survive(tmp_path, monkeypatch, capsys, ck):
    import m2export.exporter.export as ex

    out = tmp_path / "out"
    orig = ex._export_step

    def step(*a, **k):
        out.mkdir(exist_ok=True)
        (out / "arrived.txt").write_text("someone else's")
        return orig(*a, **k)
    monkeypatch.setattr(ex, "_export_step", step)
    assert main(["export", str(ck), "-o", str(out), "-q"]) == 1
    assert "while m2export was writing" in capsys.readouterr().err
    assert (out / "arrived.txt").read_text() == "someone else's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in out.iterdir()) == ["arrived.txt"]


@pytest.mark.parametrize("lease", [True, False], ids=["leased", "no-lease"])
def test_checkpoint_written_in_place_during_the_export_is_refused(tmp_path, monkeypatch, capsys, ck, lease):
    """The export reads the weights from mappings of the checkpoint until its last graph is written: a same-size
    rewrite of model.safetensors meanwhile (here: after the load, one float of the last tensor changed in
    place) gave exit 0 and an export mixing old and new weights under the old file's sha256. Now: one line
    naming the file, exit 1, nothing written; under the file's read lease the write is refused as it opens the
    file (the export's SIGIO handler raises in it), without one (another user's file: the weights were read
    into memory) the file's changed stamps are refused at the end."""
    import m2export.exporter.export as ex
    from m2export.models.checkpoint import MappedWeights

    if not lease:
        monkeypatch.setattr(MappedWeights, "_lease", lambda self, f: False)

    mine = tmp_path / "ck"
    shutil.copytree(ck, mine)
    st = mine / "model.safetensors"
    out = tmp_path / "out"
    orig = ex._export_step

    def step(*a, **k):
        with open(st, "r+b") as fh:  # in place: same inode, same size
            fh.seek(-4, os.SEEK_END)
            last = fh.read(4)
            fh.seek(-4, os.SEEK_END)
            fh.write(bytes(b ^ 0x01 for b in last))
        return orig(*a, **k)
    monkeypatch.setattr(ex, "_export_step", step)
    assert main(["export", str(mine), "-o", str(out), "-q"]) == 1
    err = capsys.readouterr().err
    assert f"error: {st}: changed while it was being exported" in err and "Traceback" not in err, err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    monkeypatch.setattr(ex, "_export_step", orig)
    assert main(["export", str(mine), "-o", str(out), "-q"]) == 0  # unchanged since its own load: exported


@posix
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="file leases (fcntl F_SETLEASE): Linux")
@pytest.mark.parametrize("point", ["load", "check", "save"])
def test_checkpoint_truncated_during_the_export_is_one_error_line(tmp_path, ck, point):
    """The export reads the weights from read-only mappings of model.safetensors: another process truncating
    it meanwhile (a checkpoint saved again into its folder) made the next read of a mapped page a SIGBUS (exit
    135, the staging folder left behind) at the load's weight checks and after the first graph was saved. Now
    the truncation waits on the file's read lease while the export stops: one line naming the file, exit 1,
    nothing left; then the truncation goes on. (Truncated before the load: the loader's own one-line error.)"""
    mine = tmp_path / "ck"
    shutil.copytree(ck, mine)
    st = mine / "model.safetensors"
    r = run_cli("export", str(mine), "-o", str(tmp_path / "out"), "--ssm-impl", "both", "-q", point=point,
                sig="TRUNCATE")
    assert "fired=True" in r.stderr, r.stderr[-2000:]
    assert r.returncode == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-2000:])
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    want = "cannot read tensors" if point == "load" else "changed while it was being exported"
    assert len(errors) == 1 and errors[0].startswith(f"error: {st}: {want}"), r.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"], "a temporary or partial folder was left"
    deadline = time.monotonic() + 30
    while st.stat().st_size and time.monotonic() < deadline:  # the truncation, let go by the lease
        time.sleep(0.05)
    assert st.stat().st_size == 0


@posix
def test_concurrent_exports_to_one_new_outdir(tmp_path, ck):
    """Two exports to one new OUT: one wins, the other refuses (nothing of it left). The ssmscan export is held
    before its swap until the other one is writing too (or has swapped in): without that the first could finish
    before the second started, which then refused at its output check ("exists and is not empty"), not in the
    overlap this test is about (it failed so once on a fresh clone). Either may swap in first."""
    out = tmp_path / "out"
    procs = []
    threads = [threading.Thread(target=lambda i=i: procs.append(
        (i, run_cli("export", str(ck), "-o", str(out), "-q", *(["--ssm-impl", "both"] if i else []),
                    **({} if i else dict(point="swap", sig="WAIT_OTHER")))))) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    held = next(p for i, p in procs if i == 0)
    assert "fired=True" in held.stderr, held.stderr[-2000:]
    rcs = sorted(p.returncode for _, p in procs)
    assert rcs == [0, 1], [(p.returncode, p.stderr[-300:]) for _, p in procs]
    loser = next(p for _, p in procs if p.returncode == 1)
    assert "while m2export was writing" in loser.stderr
    winner = next(i for i, p in procs if p.returncode == 0)
    assert is_complete_export(out, "both" if winner else "ssmscan")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ------------------------------------------------------------------------------------------ items 6, 11: signals
@posix
@pytest.mark.parametrize("point,sig", [("load", "SIGINT"), ("torch_export", "SIGTERM"), ("torch_export", "SIGINT"),
                                       ("save", "SIGINT"), ("manifest", "SIGTERM"), ("swap", "SIGTERM")])
def test_interrupt_leaves_previous_or_new_export(tmp_path, ck, previous, point, sig):
    out = tmp_path / "out"
    shutil.copytree(previous, out)
    before = fingerprint(out)
    # a pure Mamba-2 fp32 export traces nothing (m2export/exporter/build.py): bf16 pieces are traced
    traced = ["--dtype", "bf16"] if point == "torch_export" else []
    r = run_cli("export", str(ck), "-o", str(out), "--ssm-impl", "both", "--force", "-q", *traced, point=point,
                sig=sig)
    assert "fired=True" in r.stderr, r.stderr[-2000:]
    assert r.returncode == {"SIGINT": 130, "SIGTERM": 143}[sig], r.stderr[-2000:]
    assert f"interrupted by {sig}" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "a temporary or partial folder was left"
    if point == "swap":  # signals are held during the swap: it completes, then the interrupt is reported
        assert is_complete_export(out, "both")
    else:
        assert fingerprint(out) == before, "the previous export was changed"


@posix
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_interrupt_after_the_export_finished_keeps_exit_0(tmp_path, ck, sig):
    """A Ctrl-C in the interpreter's teardown, after "wrote ..." was printed (found by a new-user tryout: exit 130
    and no message, the folder complete), leaves the exit status the verb returned."""
    out = tmp_path / "out"
    r = run_cli("export", str(ck), "-o", str(out), "-q", point="exit", sig=sig)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "interrupted" not in r.stderr, r.stderr[-2000:]
    assert is_complete_export(out, "ssmscan")


@posix
def test_sigint_ignored_at_start_stays_ignored_while_writing(tmp_path, ck):
    """A process started with SIGINT ignored (`m2export export ... &` from a script) kept ignoring it until the export
    began writing, then m2export's own handler took it (exit 130, nothing written): whoever started it chose to
    ignore it. Now the export completes, exit 0."""
    out = tmp_path / "out"
    r = run_cli("export", str(ck), "-o", str(out), "-q", point="save", sig="SIGINT", ignore_sigint=True)
    assert "fired=True" in r.stderr, r.stderr[-2000:]
    assert r.returncode == 0 and "interrupted" not in r.stderr, (r.returncode, r.stderr[-2000:])
    assert is_complete_export(out, "ssmscan")


@posix
def test_sigkill_leftovers_are_cleaned_by_the_next_export(tmp_path, ck, previous):
    """The next export to the same OUT removes the killed one's marked sibling and says so on stderr, -q included
    (it was removed silently)."""
    out = tmp_path / "out"
    r = run_cli("export", str(ck), "-o", str(out), "-q", point="save", sig="SIGKILL")
    assert r.returncode == -signal.SIGKILL
    stale = [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    assert len(stale) == 1, "nothing to clean: bad test"
    pid = _marker(tmp_path / stale[0])
    r = run_cli("export", str(ck), "-o", str(out), "-q")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.splitlines() == [f"note: removed {tmp_path / stale[0]}, the temporary folder of an m2export run "
                                     f"that was killed (process {pid}, no longer running)"], r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert is_complete_export(out, "ssmscan")


def _marker(staging: Path) -> int:
    import json

    from m2export._paths import STAGING_MARKER

    return json.loads((staging / STAGING_MARKER).read_text())["pid"]


@posix
def test_marked_folders_of_a_live_process_or_another_host_are_never_cleaned(tmp_path, ck, capsys):
    """Only a marked sibling whose pid is not running on this host is m2export's dead run: a live process's (a
    concurrent export), another host's (a shared file system) and an unmarked one stay, with no note."""
    import json
    import socket

    from m2export._paths import STAGING_MARKER

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for name, pid, host in [("live", live.pid, socket.gethostname()), ("remote", 2 ** 22 + 7, "elsewhere"),
                                ("unmarked", None, None)]:
            d = tmp_path / f".out.tmp-{name}"
            (d / "new").mkdir(parents=True)
            (d / "new" / "data").write_text(name)
            if pid is not None:
                (d / STAGING_MARKER).write_text(json.dumps({"pid": pid, "host": host, "target": str(tmp_path / "out"),
                                                            "started": 0}))
        capsys.readouterr()
        assert main(["export", str(ck), "-o", str(tmp_path / "out"), "-q"]) == 0
        assert "note: removed" not in capsys.readouterr().err
        for name in ("live", "remote", "unmarked"):
            assert (tmp_path / f".out.tmp-{name}" / "new" / "data").read_text() == name
    finally:
        live.kill()
        live.wait()


@posix
def test_sigkill_in_the_middle_of_the_swap_restores_the_previous_export(tmp_path, ck, previous):
    out = tmp_path / "out"
    shutil.copytree(previous, out)
    before = fingerprint(out)
    r = run_cli("export", str(ck), "-o", str(out), "--ssm-impl", "both", "--force", "-q", point="swap_after",
                sig="SIGKILL")
    assert r.returncode == -signal.SIGKILL and not out.exists()  # the previous export is aside, in the marked folder
    from m2export._paths import clean_stale

    clean_stale(out.absolute())
    assert fingerprint(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_unmarked_lookalike_folders_are_never_cleaned(tmp_path, ck):
    (tmp_path / ".out.tmp-mine").mkdir()
    (tmp_path / ".out.tmp-mine" / "data").write_text("not m2export's")
    assert main(["export", str(ck), "-o", str(tmp_path / "out"), "-q"]) == 0
    assert (tmp_path / ".out.tmp-mine" / "data").read_text() == "not m2export's"


def test_failed_export_removes_the_parent_folders_it_created(tmp_path, ck):
    bad = tmp_path / "bad"
    shutil.copytree(ck, bad)
    (bad / "config.json").write_text('{"d_model": 32}')
    assert main(["export", str(bad), "-o", str(tmp_path / "a" / "b" / "out"), "-q"]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


# ------------------------------------------------------------------------------------------ item 8: mount points
@pytest.fixture
def tmpfs(tmp_path):
    """A small tmpfs mounted at tmp_path/mnt (needs root and mount; skipped otherwise)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip() or r.returncode})")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_force_onto_a_mount_point_deletes_nothing(tmpfs, capsys, ck, previous):
    shutil.copytree(previous, tmpfs, dirs_exist_ok=True)
    before = fingerprint(tmpfs)
    assert main(["export", str(ck), "-o", str(tmpfs), "--force", "-q"]) == 1
    assert "mount point" in capsys.readouterr().err
    assert fingerprint(tmpfs) == before


def test_export_into_an_empty_mount_point_writes_in_place(tmpfs, ck):
    assert main(["export", str(ck), "-o", str(tmpfs), "-q"]) == 0
    assert is_complete_export(tmpfs, "ssmscan")


# ------------------------------------------------------------------------------------------ item 12: full disk
@posix
def test_file_size_limit_is_a_one_line_error_and_leaves_the_previous_export(tmp_path, ck, previous):
    out = tmp_path / "out"
    shutil.copytree(previous, out)
    before = fingerprint(out)
    r = run_cli("export", str(ck), "-o", str(out), "--ssm-impl", "both", "--force", "-q", limit_fsize=16 * 1024)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "File too large" in r.stderr and "Traceback" not in r.stderr
    assert fingerprint(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_full_disk_is_a_one_line_error(tmpfs, capsys):
    (tmpfs / "fill").write_bytes(b"\0" * (8 * 1024 * 1024 - 64 * 1024))
    assert main(["random-checkpoint", "--d-model", "256", "--n-layer", "4", "--vocab-size", "256",
                 "-o", str(tmpfs / "ck"), "-q"]) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert sorted(p.name for p in tmpfs.iterdir()) == ["fill"]


def test_random_checkpoint_under_a_file_size_limit(tmp_path):
    r = run_cli("random-checkpoint", "--d-model", "64", "--n-layer", "2", "--vocab-size", "256", "-o",
                str(tmp_path / "ck"), "-q", limit_fsize=8 * 1024)
    assert r.returncode == 1 and "File too large" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_opset_out_of_range_is_a_usage_error(tmp_path, capsys, ck):
    for opset in ("17", "99"):
        assert main(["export", str(ck), "-o", str(tmp_path / "out"), "--opset", opset, "-q"]) == 2
        assert f"opset {opset}: m2export needs 18 <= opset <=" in capsys.readouterr().err
        assert not (tmp_path / "out").exists()


def test_output_folder_holding_the_checkpoint_folder_is_named_a_folder(tmp_path, capsys, ck):
    """-o the folder that holds the checkpoint's folder: refused even with --force-foreign, and the message calls
    the checkpoint a folder (it said "the checkpoint's file" for a directory)."""
    par = tmp_path / "par"
    shutil.copytree(ck, par / "ck")
    before = fingerprint(par)
    assert main(["export", str(par / "ck"), "-o", str(par), "--force", "--force-foreign", "-q"]) == 1
    err = capsys.readouterr().err
    assert f"holds the checkpoint's folder {(par / 'ck').resolve()}" in err, err
    assert fingerprint(par) == before
