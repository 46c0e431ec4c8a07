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
