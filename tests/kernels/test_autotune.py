"""The autotuner (m2export/kernels/_tune.py): strict switch, key, choice by measured time, cache, budget, failures.

Timing itself needs a GPU (the GPU test in tests/kernels/test_ssd.py runs the SSD scan with the switch on); here
the timer is a table of stand-in times, so the search logic is checked exactly.
"""

from __future__ import annotations

import pytest
import torch

from m2export.kernels import _tune


@pytest.mark.parametrize("value,want", [(None, False), ("", False), ("0", False), ("1", True), (" 1 ", True)])
def test_switch_values(value, want):
    env = {} if value is None else {_tune.ENV: value}
    assert _tune.enabled(env) is want


@pytest.mark.parametrize("value", ["true", "yes", "2", "on", "off"])
def test_switch_is_strict(value):
    from m2export.errors import ParameterError

    with pytest.raises(ParameterError, match=r"M2EXPORT_AUTOTUNE='.*': expected one of '0' .* or '1'"):
        _tune.enabled({_tune.ENV: value})  # a ParameterError: one line in the CLI (it is a ValueError too)


def test_switch_is_read_once_and_kept(autotune_env, monkeypatch):
    """The environment is parsed at the first call and the answer kept (eager scans ask on every call): a change
    of the variable is not seen until reset(); a bad value raises at first use, is not kept, and raises again."""
    autotune_env("1")
    assert _tune.enabled() is True
    monkeypatch.setenv(_tune.ENV, "bogus")  # not read again
    assert _tune.enabled() is True and _tune.enabled({_tune.ENV: "0"}) is False and _tune.enabled() is True
    _tune.reset()
    from m2export.errors import ParameterError

    for _ in range(2):
        with pytest.raises(ParameterError, match="M2EXPORT_AUTOTUNE='bogus'"):
            _tune.enabled()
    monkeypatch.delenv(_tune.ENV)
    assert _tune.enabled() is False  # the bad value was not kept: read again, now unset


def test_key_covers_shapes_strides_dtypes_flags_version_and_device():
    x = torch.zeros(2, 8, 4, 16)
    base = _tune.tuning_key("ssm_scan", "v1", {"x": x, "D": None}, flags=(True,), device="dev0")
    assert base == _tune.tuning_key("ssm_scan", "v1", {"D": None, "x": torch.ones(2, 8, 4, 16)}, flags=(True,),
                                    device="dev0")  # values and argument order do not matter
    others = [_tune.tuning_key("ssm_scan", "v1", {"x": torch.zeros(2, 9, 4, 16), "D": None}, flags=(True,), device="dev0"),
              _tune.tuning_key("ssm_scan", "v1", {"x": x.transpose(1, 2), "D": None}, flags=(True,), device="dev0"),
              _tune.tuning_key("ssm_scan", "v1", {"x": x.half(), "D": None}, flags=(True,), device="dev0"),
              _tune.tuning_key("ssm_scan", "v1", {"x": x, "D": torch.zeros(4)}, flags=(True,), device="dev0"),
              _tune.tuning_key("ssm_scan", "v1", {"x": x, "D": None}, flags=(False,), device="dev0"),
              _tune.tuning_key("ssm_scan", "v2", {"x": x, "D": None}, flags=(True,), device="dev0"),
              _tune.tuning_key("ssm_step", "v1", {"x": x, "D": None}, flags=(True,), device="dev0"),
              _tune.tuning_key("ssm_scan", "v1", {"x": x, "D": None}, flags=(True,), device="dev1")]
    assert len({base, *others}) == len(others) + 1


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _timer_from(times: dict, clock: _Clock | None = None, cost: float = 0.0):
    def timer(fn):
        fn()
        if clock is not None:
            clock.t += cost
        return times[_timer_from.last]
    return timer


def test_chooses_the_fastest_once_per_key():
    tuner = _tune.Autotuner()
    ran = []

    def run(c):
        ran.append(c)
        _timer_from.last = c

    times = {"a": 3.0, "b": 1.0, "c": 2.0}
    assert tuner.choose(("k",), ["a", "b", "c"], run, _timer_from(times)) == "b"
    assert ran == ["a", "b", "c"]
    assert tuner.choose(("k",), ["a", "b", "c"], run, _timer_from(times)) == "b" and len(ran) == 3  # cached
    assert [ms for _, ms in tuner.trials[("k",)]] == [3.0, 1.0, 2.0]
    assert tuner.choose(("k2",), ["a", "c"], run, _timer_from(times)) == "c"


def test_failing_candidates_are_skipped_but_the_heuristic_must_run():
    tuner = _tune.Autotuner()

    def run(c):
        if c.startswith("bad"):
            raise RuntimeError(f"{c} does not compile")
        _timer_from.last = c

    times = {"a": 3.0, "b": 1.0}
    assert tuner.choose(("k",), ["a", "bad1", "b"], run, _timer_from(times)) == "b"
    assert tuner.trials[("k",)][1] == ("bad1", None)
    with pytest.raises(RuntimeError, match="bad0 does not compile"):
        tuner.choose(("k3",), ["bad0", "a"], run, _timer_from(times))
    assert tuner.cached(("k3",)) is None


def test_budget_stops_new_candidates_but_keeps_the_heuristic():
    clock = _Clock()
    tuner = _tune.Autotuner(budget_s=10.0, clock=clock)

    def run(c):
        _timer_from.last = c

    times = {"a": 5.0, "b": 4.0, "c": 0.1}
    # each candidate costs 6 s of compile + timing: a (0 -> 6), b (6 -> 12), then the budget is spent: c never runs
    assert tuner.choose(("k",), ["a", "b", "c"], run, _timer_from(times, clock, 6.0)) == "b"
    assert [c for c, _ in tuner.trials[("k",)]] == ["a", "b"]


def test_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(_tune, "CACHE_SIZE", 2)
    tuner = _tune.Autotuner()

    def run(c):
        _timer_from.last = c

    for k in ("k1", "k2", "k3"):
        tuner.choose((k,), ["a"], run, _timer_from({"a": 1.0}))
    assert tuner.cached(("k1",)) is None and tuner.cached(("k3",)) == "a"
    # the trials kept for reports are bounded with the cache (they grew by one entry per new key: every new
    # sequence length of an eager scan is a new key, so a long-running process leaked them)
    assert set(tuner.trials) == {("k2",), ("k3",)}
