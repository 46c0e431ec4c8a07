"""Fixtures for the check / generate / inspect tests: a tiny export made once per session."""

from __future__ import annotations

import pytest

from tests.check.exports import tiny_checkpoint, tiny_export


@pytest.fixture(scope="session")
def tiny_ck(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_out(tmp_path_factory):
    return tiny_export(tmp_path_factory)


@pytest.fixture(autouse=True)
def _quiet_polygraphy():
    from m2export.check.console import quiet_polygraphy

    quiet_polygraphy()
