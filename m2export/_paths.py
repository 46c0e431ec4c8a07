"""Guards for the folders m2export replaces (export OUTDIR, random-checkpoint output)."""

from __future__ import annotations

from pathlib import Path


def replace_hazard(target: Path, checkpoint: Path | None = None) -> str | None:
    """Why replacing (deleting) ``target`` would be wrong, or None.

    Wrong when ``target`` is, or contains, the current directory or ``checkpoint``.
    """
    out = target.resolve()

    def inside(p: Path) -> bool:
        r = p.resolve()
        return r == out or out in r.parents

    if checkpoint is not None and inside(checkpoint):
        return f"holds the checkpoint {checkpoint}"
    if inside(Path.cwd()):
        return "is (or contains) the current directory"
    return None
