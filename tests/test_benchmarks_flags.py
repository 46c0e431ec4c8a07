"""Benchmark scripts take their flags spelled out in full, like the CLI (whose parsers set allow_abbrev=False).

An abbreviated flag such as ``--rep`` for ``--repeat`` silently picking an option is how a benchmark row gets
recorded under settings nobody asked for; argparse's default allows it, so every script's parser must refuse it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.rglob("*.py"))


def _parsers(path: Path) -> list[ast.Call]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and (getattr(n.func, "attr", None) == "ArgumentParser" or getattr(n.func, "id", None) == "ArgumentParser")]


def test_there_are_benchmark_parsers():
    assert sum(len(_parsers(p)) for p in SCRIPTS) >= 10


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_benchmark_parsers_refuse_abbreviated_flags(path):
    for call in _parsers(path):
        kw = {k.arg: k.value for k in call.keywords}
        assert "allow_abbrev" in kw and isinstance(kw["allow_abbrev"], ast.Constant) and kw["allow_abbrev"].value is False, (
            f"{path.name}:{call.lineno}: ArgumentParser without allow_abbrev=False")


def test_bench_ssd_variant_fields_left_empty_take_the_defaults():
    """An empty field of a bench_ssd.py --variants entry is choose_config's default, occupancy included (until
    2026-12-03 an empty occupancy meant no hint: ``::::::::::2`` was timed without the default plan's hint and planned
    for one block per SM, a slower plan recorded as cb_pre's); '0' asks for no hint."""
    import sys

    sys.path.insert(0, str(BENCHMARKS))
    import bench_ssd
    from m2export.kernels.ssd.plan import choose_config

    prob = bench_ssd.problem_of("falcon_h1_7b")
    (_, v), = bench_ssd.cutile_variants("::::::::::2")[0]
    assert bench_ssd.config_of(prob, v) == choose_config(prob, cb_pre=2)
    (_, v), = bench_ssd.cutile_variants(":::0")[0]
    assert bench_ssd.config_of(prob, v).occupancy is None


def test_bench_ssd_variant_cb_state_field():
    """The 12th --variants field is ScanConfig.cb_state (1 on, 0 off, empty: choose_config's default); a 13th field is
    refused."""
    import sys

    sys.path.insert(0, str(BENCHMARKS))
    import bench_ssd
    from m2export.kernels.ssd.plan import choose_config

    prob = bench_ssd.problem_of("b")
    (_, v), = bench_ssd.cutile_variants(":::::::::::1")[0]
    assert bench_ssd.config_of(prob, v) == choose_config(prob, cb_state=True)
    (_, v), = bench_ssd.cutile_variants("::::::::::")[0]
    assert bench_ssd.config_of(prob, v) == choose_config(prob) and not choose_config(prob).cb_state
    with pytest.raises(SystemExit, match="at most 12"):
        bench_ssd.cutile_variants("::::::::::::1")
