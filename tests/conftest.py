"""Session fixtures shared by tests/check and tests/cli: one tiny export each, made once per test session."""

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
