"""Tiny random checkpoints and their exports, shared by the exporter tests (session-scoped: each export once).

Sizes: d_model 64, 2 layers, headdim 16 (8 heads), d_state 16, chunk_size 8, vocab 100 (padded 112).
Exports trace at batch 2 / seq 7 (export.EXAMPLE_*); the tests run other sizes to exercise dynamic axes.
"""

from __future__ import annotations

import pytest

TINY = dict(d_model=64, n_layer=2, vocab_size=100, d_state=16, headdim=16, chunk_size=8)


@pytest.fixture(scope="session")
def tiny_g2(tmp_path_factory):
    """Tiny checkpoint with ngroups=2 (4 heads per group)."""
    from m2export.models.checkpoint import random_checkpoint

    return random_checkpoint(tmp_path_factory.mktemp("ck") / "tiny_g2", ngroups=2, seed=1, **TINY)


@pytest.fixture(scope="session")
def tiny_g1(tmp_path_factory):
    """Tiny checkpoint with ngroups=1, a dt_limit and untied embeddings (HF format)."""
    from m2export.models.checkpoint import random_checkpoint

    return random_checkpoint(tmp_path_factory.mktemp("ck") / "tiny_g1", ngroups=1, seed=2, format="hf",
                             dt_limit=(0.002, 0.08), tie_embeddings=False, **TINY)


def _export(tmp_path_factory, ck, name, **kw):
    from m2export.exporter import export_model

    out = tmp_path_factory.mktemp("exp") / name
    export_model(ck, out, **kw)
    return out


@pytest.fixture(scope="session")
def export_fp32_both(tmp_path_factory, tiny_g2):
    """All three flavours (ssmscan, std, native) of the G=2 checkpoint."""
    return _export(tmp_path_factory, tiny_g2, "fp32_all", ssm_impl="all")


@pytest.fixture(scope="session")
def export_fp32_g1_cli(tmp_path_factory, tiny_g1):
    """fp32 export of the G=1 checkpoint through the CLI (``m2export export ... --ssm-impl all``)."""
    from m2export.cli.main import main

    out = tmp_path_factory.mktemp("exp") / "fp32_g1_cli"
    assert main(["export", str(tiny_g1), "-o", str(out), "--ssm-impl", "all", "-q"]) == 0
    return out


@pytest.fixture(scope="session")
def export_fp16_both(tmp_path_factory, tiny_g2):
    return _export(tmp_path_factory, tiny_g2, "fp16_all", ssm_impl="all", dtype="fp16")


@pytest.fixture(scope="session")
def export_bf16_both(tmp_path_factory, tiny_g2):
    return _export(tmp_path_factory, tiny_g2, "bf16_both", ssm_impl="both", dtype="bf16")
