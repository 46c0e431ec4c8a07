"""Writing output folders and files without ever destroying what m2export did not write.

One home for the output logic of ``export`` (OUTDIR), ``save_checkpoint``/``random_checkpoint`` and
``check``'s reports:

* :func:`staged_output` — a folder is written into a marked temporary sibling ``.NAME.tmp-XXXX/new`` and
  swapped in at the end: the previous folder is renamed aside (into the same marked sibling), the new one
  renamed in, then the old one deleted; on any failure before that the previous folder is intact, and
  SIGINT/SIGTERM are held back during the three renames (and reported after them). A folder is replaced only with ``force=True``
  and only if ``owned(folder)`` says m2export wrote it (``force_foreign=True`` overrides that, never the
  protected paths). A symlinked target is refused (never followed); nothing the ``protect`` paths resolve
  into (a checkpoint's files through their symlinks), nor a folder holding the current directory, is ever
  deleted; a mount point (cannot be renamed over) and the current directory (renaming onto it would leave the
  caller's shell in a deleted directory) are written in place: staged inside them and moved in at the end
  with interrupts held. A non-empty mount point is refused before anything is deleted; the current directory
  holding only what m2export wrote (``owned``) is replaced under ``force``: its entries moved aside into the
  staging folder, the new ones moved in, the old ones deleted (a SIGKILL in between is finished or undone by
  the next run), and never for ``force_foreign``. Stale marked siblings of killed runs are cleaned (their
  previous folder restored when the kill hit the swap); parent folders created for a failed write are removed
  again.
* :func:`atomic_write_text` / :func:`atomic_file` — temp file in the same folder + fsync + ``os.replace``.
* :func:`loads_json` — the reading side of m2export's JSON files: ``json.loads`` refusing duplicate keys
  (``json`` keeps the last one without a word, so a hand-edited ``config.json`` could mean two things).
* Interrupts stick: inside :func:`staged_output` SIGINT/SIGTERM set a flag and raise
  :class:`~m2export.errors.Interrupted` (a BaseException, so ``except Exception`` fallbacks in third-party
  code cannot swallow it); :func:`raise_if_interrupted` re-raises after a step that caught it anyway.
  SIGXFSZ is ignored meanwhile, so a file-size limit is an EFBIG error instead of a core dump.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
import logging
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

from m2export.errors import Interrupted, M2ExportError, OutputFolderError

log = logging.getLogger("m2export")

#: marker file inside every temporary sibling m2export creates (JSON: pid, host, target, started)
STAGING_MARKER = ".m2export-staging"
_INTERRUPTS = (signal.SIGINT, signal.SIGTERM)
#: the signal received inside staged_output (None: none); read by raise_if_interrupted
_received: list[int] = []
#: non-empty while a critical section defers interrupts (see _signals_held)
_holding: list[int] = []


# ------------------------------------------------------------------------------------------------ hazards
def replace_hazard(target: Path, checkpoint: Path | None = None, *, protect: Iterable[Path] = (),
                   cwd_ok: bool = False) -> str | None:
    """Why replacing (deleting) ``target`` would be wrong, or None.

    Wrong when ``target`` is, or contains, the current directory, ``checkpoint``, or any ``protect`` path
    (each resolved through its symlinks: a weight file linked from elsewhere protects the file it points to).
    ``cwd_ok``: ``target`` may be the current directory itself (its contents replaced in place, the folder kept;
    still never an ancestor of it).
    """
    out = target.resolve()

    def inside(p: Path) -> bool:
        r = Path(p).resolve()
        return r == out or out in r.parents

    if checkpoint is not None and inside(checkpoint):
        return f"holds the checkpoint {checkpoint}"
    for p in protect:
        if inside(p):
            r = Path(p).resolve()
            return f"holds the checkpoint's {'folder' if r.is_dir() else 'file'} {r}"
    if inside(Path.cwd()) and not (cwd_ok and _is_cwd(target)):
        return "is (or contains) the current directory"
    return None


def _interesting_entries(folder: Path) -> list[str]:
    """Entries of ``folder`` other than m2export's own staging folders."""
    return sorted(p.name for p in folder.iterdir() if not _is_staging(p))


def _is_staging(p: Path) -> bool:
    return p.is_dir() and not p.is_symlink() and (p / STAGING_MARKER).is_file()


# ------------------------------------------------------------------------------------------------ signals
def interrupted() -> int | None:
    """The SIGINT/SIGTERM received inside :func:`staged_output`, or None."""
    return _received[-1] if _received else None


def raise_if_interrupted() -> None:
    """Raise :class:`Interrupted` if a signal arrived (call after any step that may have swallowed it)."""
    if _received:
        raise Interrupted(_received[-1])


@contextlib.contextmanager
def _interrupts_stick() -> Iterator[None]:
    """SIGINT/SIGTERM -> flag + :class:`Interrupted`; SIGXFSZ ignored (main thread only; else a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        _received.append(signum)
        if not _holding:
            raise Interrupted(signum)

    # a signal the process was started with ignored (`cmd &` in a non-interactive shell, nohup-like launchers)
    # stays ignored: whoever started it chose that
    saved = {s: signal.signal(s, handler) for s in _INTERRUPTS if signal.getsignal(s) is not signal.SIG_IGN}
    saved[signal.SIGXFSZ] = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Defer SIGINT/SIGTERM (recorded, raised by the next :func:`raise_if_interrupted`) in a critical section.

    Done in Python rather than with pthread_sigmask: a process-directed signal blocked in the main thread
    is taken by another thread (torch's pools), and Python still runs the handler in the main thread.
    """
    _holding.append(1)
    try:
        yield
    finally:
        _holding.pop()


# ------------------------------------------------------------------------------------------------ files
def name_listing(names, most: int = 5) -> str:
    """``a, b, c`` -- at most ``most`` names, then how many there are in all (``a, b, ... (11 in all)``), so a
    refusal quoting a folder's entries never looks like the whole list when it is not."""
    names = list(names)
    return ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most else "")


def not_a_file(p: Path) -> str:
    """Why ``p`` (an input file the user named) is not a readable regular file: 'no such file', 'is a directory'
    or 'is not a regular file' (a FIFO, a device such as /dev/null)."""
    return "is a directory" if p.is_dir() else "is not a regular file" if p.exists() else "no such file"


def os_error_message(e: OSError) -> str:
    """'No space left on device' etc. (strerror, else the exception text)."""
    return e.strerror or str(e)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success fsync it and ``os.replace`` it onto ``path``.

    On any failure (a full disk included) the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (temp file + fsync + os.replace). Raises OSError."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)
    return Path(path)


class DuplicateKeyError(ValueError):
    """A JSON object repeats a key (:func:`loads_json`); ``key`` is the repeated key."""

    def __init__(self, key: str):
        super().__init__(f"duplicate key {key!r} (JSON would silently keep the last value)")
        self.key = key


def _unique_pairs(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKeyError(k)
        out[k] = v
    return out


def loads_json(text: str | bytes):
    """``json.loads(text)`` with every object's keys unique.

    Raises:
        ValueError: malformed JSON (``json.JSONDecodeError``), nesting too deep for Python's parser (its
            RecursionError, e.g. 100,000 ``[``), or :class:`DuplicateKeyError` naming the first repeated key.
            Callers prefix the file name.
    """
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs)
    except RecursionError:
        raise ValueError("nested too deeply to parse (arrays/objects inside each other beyond Python's "
                         "recursion limit)") from None


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


# ------------------------------------------------------------------------------------------------ folders
def _marker_owner(staging: Path) -> dict | None:
    try:
        d = json.loads((staging / STAGING_MARKER).read_text())
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(target: Path) -> list[Path]:
    """Remove the marked temporary siblings of ``target`` left by killed runs (dead pid, this host).

    A sibling holding ``old/`` while ``target`` is missing is a swap killed half-way: ``old`` (the previous
    folder) is renamed back first. Returns what was removed, each also named in a warning of the ``m2export``
    logger (the CLI's stderr, ``-q`` included: a deletion is never silent). Only folders whose name is the
    pattern and whose marker (:data:`STAGING_MARKER`, written by :func:`_new_staging` right after the folder is
    made, deleted last by :func:`remove_staging`) names this host and a pid that is not running are touched;
    unmarked ones, another host's and a live process's never. In the current directory (``-o .``) the marked
    folder is inside ``target``: a replacement killed half-way is finished or undone (:func:`_replace_in_place`).
    """
    removed = []
    for where in (target.parent, target):
        if not where.is_dir() or where.is_symlink():
            continue
        for p in where.glob(f".{target.name}.tmp-*" if where == target.parent else ".m2export.tmp-*"):
            owner = _marker_owner(p) if _is_staging(p) else None
            if owner is None or owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
                continue
            if owner["pid"] != os.getpid() and _alive(owner["pid"]):
                continue
            old = p / "old"
            done = ""
            if old.is_dir() and where == target.parent and not os.path.lexists(target):
                os.rename(old, target)
                done = f"; {target} (the previous folder, set aside when it was killed) was put back"
            elif where == target and (p / _MOVING_IN).is_file():  # killed moving the new export in: finish it
                for q in sorted((p / "new").iterdir()):
                    if not os.path.lexists(target / q.name):
                        os.rename(q, target / q.name)
                done = f"; the rest of its output was moved into {target}, as it was doing when killed"
            elif where == target and old.is_dir():  # killed setting the previous export aside: put it back
                for q in sorted(old.iterdir()):
                    if not os.path.lexists(target / q.name):
                        os.rename(q, target / q.name)
                done = f"; the previous files it had set aside were put back into {target}"
            remove_staging(p)
            removed.append(p)
            who = "an earlier run in this process" if owner["pid"] == os.getpid() else \
                f"process {owner['pid']}, no longer running"
            log.warning(f"note: removed {p}, the temporary folder of an m2export run that was killed ({who})"
                        + done)
    return removed


def _is_mount(p: Path) -> bool:
    return p.is_dir() and os.path.ismount(p)


def _is_cwd(p: Path) -> bool:
    """``p`` is an existing folder and the current directory: renaming another folder onto it would leave the
    caller's shell in a deleted directory (``export -o .``), so it is written in place like a mount point."""
    try:
        return p.is_dir() and os.path.samefile(p, os.getcwd())
    except OSError:  # the current directory was deleted (or is unreadable): nothing to keep
        return False


def check_target(target: Path, *, force: bool, force_foreign: bool, protect: Iterable[Path],
                 owned: Callable[[Path], str | None], error: type[M2ExportError] = OutputFolderError) -> None:
    """Refuse a target folder before any work (see :func:`staged_output`). Raises ``error``."""
    if target.is_symlink():
        raise error(f"{target}: is a symbolic link; m2export never writes through one",
                    hint=f"pass the real folder ({target.resolve()}) or another path")
    if target.exists() and not target.is_dir():
        raise error(f"{target}: exists and is not a directory", hint="choose another output folder (`outdir`)")
    if target.is_dir() and _interesting_entries(target):
        if not force and force_foreign:  # the user asked for a replacement, with half the switch
            raise error(f"{target}: exists and is not empty; `force_foreign` replaces a folder only together with "
                        "`force`", hint="pass `force=True` as well to delete its contents, or choose another "
                                        "output folder (`outdir`)")
        if not force:
            why = owned(target)  # not m2export's: --force alone would be refused next, so the hint says so now
            if why:
                raise error(f"{target}: exists and is not empty, and {why}",
                            hint="choose another output folder (`outdir`), delete it yourself, or pass `force=True` "
                                 "with `force_foreign=True` to delete its contents")
            raise error(f"{target}: exists and is not empty",
                        hint="pass `force=True` to replace it, or choose another output folder (`outdir`)")
        why = owned(target)
        # the current directory itself: its contents are replaced in place when m2export wrote them all
        hazard = replace_hazard(target, protect=protect, cwd_ok=why is None)
        if hazard:
            raise error(f"{target}: {hazard}; `force` would delete it", hint="choose a new or dedicated folder")
        if why and not force_foreign:
            raise error(f"{target}: {why}; `force` replaces only folders m2export wrote",
                        hint="delete it yourself, choose another folder, or add `force_foreign=True` to delete its "
                             "contents anyway")
        if _is_mount(target):
            raise error(f"{target}: is a mount point and not empty; it cannot be replaced atomically, and "
                        "m2export deletes nothing it cannot restore",
                        hint="empty it yourself, or write into a new folder inside it")
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise error(f"{target}: {parent} is not a directory", hint="choose another output folder (`outdir`)")
    if not os.access(parent, os.W_OK | os.X_OK) or (target.is_dir() and not os.access(target, os.W_OK)):
        raise error(f"{target}: cannot write there (no write permission on {parent})",
                    hint="choose a writable output folder (`outdir`)")


def _make_parents(d: Path) -> list[Path]:
    """mkdir -p ``d``; returns the folders created (deepest last)."""
    made = []
    for p in reversed([d, *d.parents]):
        if not p.exists():
            p.mkdir()
            made.append(p)
    return made


def _new_staging(where: Path, prefix: str, target: Path) -> Path:
    s = Path(tempfile.mkdtemp(prefix=prefix, dir=where))
    (s / STAGING_MARKER).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                "target": str(target), "started": time.time()}))
    new = s / "new"
    new.mkdir()
    os.chmod(new, 0o777 & ~_umask())
    return s


@contextlib.contextmanager
def staged_output(target: str | os.PathLike, *, force: bool = False, force_foreign: bool = False,
                  protect: Iterable[Path] = (), owned: Callable[[Path], str | None] = lambda p: None,
                  error: type[M2ExportError] = OutputFolderError) -> Iterator[Path]:
    """Yield an empty folder to write the output into; swap it in as ``target`` when the block succeeds.

    Args:
        target: the output folder (need not exist; missing parents are created, and removed on failure).
        force: allow replacing a non-empty ``target`` whose ``owned(target)`` is None (m2export wrote it).
        force_foreign: with ``force``, replace it even when ``owned`` objects (the contents are deleted).
        protect: paths that must survive (a checkpoint's config and weight files): ``target`` holding any
            of them (through symlinks), or holding the current directory, is refused whatever the flags; the
            current directory itself is replaced (in place) only when ``owned`` accepts it.
        owned: ``folder -> None`` if m2export wrote it, else the reason it is not m2export's.
        error: the M2ExportError subclass raised (messages name ```force```/```force_foreign```, which the
            CLI shows as its flags).
    Raises:
        ``error``: the target is refused (before any work), cannot be written (full disk, EFBIG, permissions:
        the OS message is named), or changed during the write so that swapping would destroy something.
        Interrupted: SIGINT/SIGTERM (nothing is left behind; the previous folder is intact or replaced whole).
    """
    target = Path(target)
    target = target.absolute() if target.name not in ("", ".", "..") else target.resolve()
    target = target.parent.resolve() / target.name  # resolve the parents, never the target itself
    protect = [Path(p) for p in protect]
    _received.clear()
    with _interrupts_stick():
        with _signals_held():
            try:
                clean_stale(target)
            except OSError:
                pass
        check_target(target, force=force, force_foreign=force_foreign, protect=protect, owned=owned, error=error)
        # empty (check_target refused a non-empty one) and not to be renamed: write inside it, move in at the end
        in_place = _is_mount(target) or _is_cwd(target)
        made: list[Path] = []
        staging = None
        done = False
        try:
            made = _make_parents(target.parent)
            staging = _new_staging(target if in_place else target.parent,
                                   ".m2export.tmp-" if in_place else f".{target.name}.tmp-", target)
            yield staging / "new"
            raise_if_interrupted()
            with _signals_held():
                if in_place:
                    _replace_in_place(staging, target, owned=owned, error=error)
                else:
                    _swap(staging, target, force=force, force_foreign=force_foreign, owned=owned, error=error)
                done = True
                remove_staging(staging)
            if _received:  # arrived during the swap: reported now, with the new output complete in place
                raise Interrupted(_received[-1], f"{target} was written completely before stopping")
        except OSError as e:
            raise error(f"{target}: cannot write the output ({os_error_message(e)})",
                        hint="free some space or choose a writable output folder (`outdir`)" if e.errno in
                        (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else "choose a writable output folder (`outdir`)") from None
        finally:
            if not done:
                with _signals_held():
                    if staging is not None:
                        _restore_and_remove(staging, target, in_place=in_place)
                    for p in reversed(made):
                        with contextlib.suppress(OSError):
                            p.rmdir()


def _restore_and_remove(staging: Path, target: Path, *, in_place: bool = False) -> None:
    old = staging / "old"
    if in_place:  # the previous entries back into the folder (those set aside before a failure)
        for p in sorted(old.iterdir()) if old.is_dir() else ():
            if not os.path.lexists(target / p.name):
                with contextlib.suppress(OSError):
                    os.rename(p, target / p.name)
    elif old.is_dir() and not os.path.lexists(target):
        with contextlib.suppress(OSError):
            os.rename(old, target)
    remove_staging(staging)


def remove_staging(staging: Path) -> None:
    """Delete a marked temporary folder, its marker last: one killed while deleting (a large previous export
    in ``old/``) is still marked, so the next run removes the rest (an unmarked one would stay for ever)."""
    for p in sorted(staging.iterdir()) if staging.is_dir() and not staging.is_symlink() else ():
        if p.name != STAGING_MARKER:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    p.unlink()
    shutil.rmtree(staging, ignore_errors=True)


def _swap(staging: Path, target: Path, *, force, force_foreign, owned, error) -> None:
    """new -> target, the previous target (if any) aside into ``staging/old`` first and re-checked there."""
    new, old = staging / "new", staging / "old"
    if not os.path.lexists(target):
        try:
            os.rename(new, target)  # fails if something appeared meanwhile (non-empty dir, file)
            return
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
        raise error(f"{target}: appeared while m2export was writing; left it alone and wrote nothing",
                    hint="is another export writing there? choose another output folder")
    if target.is_symlink() or not target.is_dir():
        raise error(f"{target}: was replaced by a {'symbolic link' if target.is_symlink() else 'file'} while "
                    "m2export was writing; left it alone and wrote nothing")
    os.rename(target, old)  # EBUSY (a mount point) etc.: nothing moved yet
    why = None
    if _interesting_entries(old):
        if not force:
            why = "was filled while m2export was writing"
        elif not force_foreign:
            why = owned(old)
    if why:
        os.rename(old, target)
        raise error(f"{target}: {why}; left it alone and wrote nothing",
                    hint="`force` replaces only folders m2export wrote; choose another output folder")
    try:
        os.rename(new, target)
    except OSError:
        os.rename(old, target)
        raise


#: in an in-place staging folder: the previous entries are all in ``old/``, the new ones being moved in (a run
#: killed from here on is completed by :func:`clean_stale`, one killed before is undone)
_MOVING_IN = "moving-in"


def _replace_in_place(staging: Path, target: Path, *, owned, error) -> None:
    """Move the entries of ``staging/new`` into the unrenameable ``target`` (a mount point, the current
    directory). An empty ``target`` just receives them; a non-empty one (the current directory holding a previous
    export, accepted by :func:`check_target` under ``force``) is re-checked now: ``owned(target)`` must still say
    m2export wrote everything in it (a file written there meanwhile is not m2export's: refused, nothing moved,
    even with ``force_foreign``: the current directory's files are never deleted for that flag). Its entries are
    then moved aside into ``staging/old`` and the new ones moved in; ``old`` goes with the staging folder. Any
    failure before the last move puts the previous entries back (the caller's :func:`_restore_and_remove`)."""
    have = _interesting_entries(target)
    if have and not _is_mount(target):
        # what the folder's owner rule does not judge stays: .m2export* names (another run's temporaries, such as
        # a running build's .m2export-timing-*) are left out of every `owned` check, so they are not ours to move
        have = [n for n in have if not n.startswith(".m2export")]
        why = owned(target)
        if why:
            raise error(f"{target}: {why} (since the export began); left it alone and wrote nothing",
                        hint="`force` replaces only folders m2export wrote; choose another output folder")
        old = staging / "old"
        old.mkdir()
        for name in have:
            os.rename(target / name, old / name)
        (staging / _MOVING_IN).write_text("")
    elif have:
        raise error(f"{target}: got {have[:5]} while m2export was writing; left it alone and wrote nothing")
    moved = []
    try:
        for p in sorted((staging / "new").iterdir()):
            if os.path.lexists(target / p.name):  # appeared since: never renamed over
                raise error(f"{target}: got {p.name} while m2export was writing; left it alone and wrote nothing")
            os.rename(p, target / p.name)
            moved.append(p.name)
    except BaseException:
        for name in moved:  # the new entries back, so that the previous ones can return
            with contextlib.suppress(OSError):
                os.rename(target / name, staging / "new" / name)
        with contextlib.suppress(OSError):
            (staging / _MOVING_IN).unlink()
        raise
