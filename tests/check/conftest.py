"""Fixtures for the check / generate / inspect tests: a tiny export made once per session."""

from __future__ import annotations

import pytest

from tests.check.exports import tiny_checkpoint, tiny_export, tiny_export_bf16


@pytest.fixture(scope="session")
def tiny_ck(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_out(tmp_path_factory):
    return tiny_export(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_out_bf16(tmp_path_factory):
    return tiny_export_bf16(tmp_path_factory)


@pytest.fixture(autouse=True)
def _quiet_and_single_threaded():
    """Polygraphy's logger to errors only; torch on one thread for these tiny models (with other work on
    the 2 cores, two torch threads make a 3 ms decode step take ~200 ms). Restored afterwards."""
    import torch

    from m2export.check.console import quiet_polygraphy

    quiet_polygraphy()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
