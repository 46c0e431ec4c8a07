"""Third-party noise: one home (m2export.check.console.quiet_third_party) for the CLI's -q and the export's loggers."""

from __future__ import annotations

import logging
import os

import pytest


def test_quiet_third_party_sets_and_restores_everything(monkeypatch):
    """-q (only_errors): transformers' environment switches set for the block, each restored after (an unset one
    unset again, a user's value kept); loggers: the noisy loggers at ERROR for the block, their levels restored."""
    from m2export.check import console

    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")
    name = console.NOISY_LOGGERS[0]
    logging.getLogger(name).setLevel(logging.INFO)
    with console.quiet_third_party(only_errors=True, loggers=True):
        assert {k: os.environ[k] for k in console.QUIET_ENV} == console.QUIET_ENV
        assert all(logging.getLogger(n).level == logging.ERROR for n in console.NOISY_LOGGERS)
    assert "TRANSFORMERS_VERBOSITY" not in os.environ and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "0"
    assert logging.getLogger(name).level == logging.INFO
    with console.quiet_third_party():  # neither: nothing changes
        assert "TRANSFORMERS_VERBOSITY" not in os.environ and logging.getLogger(name).level == logging.INFO


def test_loggers_left_alone_at_debug():
    """-v (m2export's log at DEBUG): the noisy loggers keep their levels, so their messages show."""
    from m2export.check import console

    name = console.NOISY_LOGGERS[0]
    logging.getLogger(name).setLevel(logging.INFO)
    m2 = logging.getLogger("m2export")
    old = m2.level
    m2.setLevel(logging.DEBUG)
    try:
        with console.quiet_third_party(loggers=True):
            assert logging.getLogger(name).level == logging.INFO
    finally:
        m2.setLevel(old)


@pytest.mark.parametrize("quiet", [False, True])
def test_cli_and_export_use_the_one_home(tiny_ck, tmp_path, monkeypatch, quiet):
    """The CLI (-q) and export_model both go through quiet_third_party: no private twin of it in either module."""
    from m2export.check import console
    from m2export.cli import main as cli_main
    from m2export.exporter import export as export_mod

    calls = []
    real = console.quiet_third_party

    def spy(**kw):
        calls.append(kw)
        return real(**kw)

    monkeypatch.setattr(console, "quiet_third_party", spy)
    assert not hasattr(cli_main, "_third_party_quiet") and not hasattr(export_mod, "_quiet_third_party_logs")
    assert cli_main.main(["export", str(tiny_ck), "-o", str(tmp_path / "o"), "--no-check",
                          *(["-q"] if quiet else [])]) == 0
    assert {"only_errors": quiet} in calls and {"loggers": True} in calls
