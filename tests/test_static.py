"""Static checks over the m2export package itself."""

from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "m2export"


def test_pyflakes_finds_nothing_in_the_package():
    """No unused import or variable, no redefinition of an unused name anywhere under m2export/ (pyflakes; a
    ``# noqa`` comment does not silence it: an import kept for its side effect is written as
    ``importlib.import_module``)."""
    pytest.importorskip("pyflakes")
    from pyflakes.api import checkRecursive
    from pyflakes.reporter import Reporter
    import io

    out, err = io.StringIO(), io.StringIO()
    n = checkRecursive([str(PACKAGE)], Reporter(out, err))
    assert n == 0 and not err.getvalue(), out.getvalue() + err.getvalue()
