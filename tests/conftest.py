"""Shared fixtures: one tiny export each for tests/check and tests/cli (made once per test session);
an environment for compiling cuTile kernels on the CPU."""

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


@pytest.fixture
def no_cuda_home(monkeypatch):
    """Compile cuTile kernels with the wheel's own libnvvm: with CUDA_HOME set, tileiras loads that
    toolkit's (an older one fails with "Return code 5")."""
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)


@pytest.fixture
def single_threaded_torch():
    """One torch thread: tiny models' matmuls and decode steps crawl with two threads on two busy cores
    (~20x slower measured on the shared CI box)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def kernels_on_torch(monkeypatch):
    """The kernels' entry points (tests.helpers.kernel_entry_points) called with backend="cutile" run their torch
    backends instead: the cutile branch's plumbing on the CPU. The list of the names called, in call order."""
    from tests.helpers import kernel_entry_points

    calls = []
    for mod, name in kernel_entry_points():
        real = getattr(mod, name)

        def on_torch(*a, _real=real, _name=name, **k):
            assert k.pop("backend") == "cutile"
            calls.append(_name)
            return _real(*a, backend="torch", **k)

        monkeypatch.setattr(mod, name, on_torch)
    return calls


@pytest.fixture
def autotune_env(monkeypatch):
    """``set(value)``: ``M2EXPORT_AUTOTUNE`` for this test, read afresh (the process parses it once and keeps the
    answer: m2export.kernels._tune.enabled); what it kept is forgotten again after the test."""
    from m2export.kernels import _tune

    def set_(value: str) -> None:
        monkeypatch.setenv(_tune.ENV, value)
        _tune.reset()

    yield set_
    _tune.reset()
