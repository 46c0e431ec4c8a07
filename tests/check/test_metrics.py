"""The check's comparison in slices (m2export/check/metrics.py) against Polygraphy's whole-array SimpleCompareFunc,
and the prefill section's memory discipline (at most the reference's and one runtime's outputs alive)."""

from __future__ import annotations

import math
import tracemalloc
import weakref
from collections import OrderedDict

import numpy as np
import pytest
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata
from polygraphy.comparator.compare import SimpleCompareFunc
from polygraphy.comparator.struct import IterationResult

from m2export.check.console import ProgressTask
from m2export.check.compare import _prefill, _rows, _Runtime, make_compare_func
from m2export.check.metrics import SlicedCompareFunc, sliced_elementwise


def _pair(rng, n, dtype, case):
    """(runtime, reference) arrays of n elements: reference ~N(0, 3) with exact zeros, runtime within ~1e-5,
    then ``case`` plants what the verdict must see."""
    ref = (rng.standard_normal(n) * 3).astype(dtype)
    ref[rng.integers(0, n, 5)] = 0
    run = (ref + rng.standard_normal(n) * 1e-5).astype(dtype)
    k = int(rng.integers(0, n))
    if case == "abs_beyond_rel_within":  # abs > atol but rel <= rtol: passes
        ref[k], run[k] = 1000.0, 1000.0 + 0.5
    elif case == "both_beyond":
        ref[k], run[k] = 1.0, 2.0
    elif case == "nan_runtime":
        run[k] = np.nan
    elif case == "nan_reference":
        ref[k] = np.nan
    elif case == "inf_both":  # inf - inf is NaN: fails (SimpleCompareFunc's default)
        ref[k] = run[k] = np.inf
    elif case == "inf_runtime":
        run[k] = -np.inf
    elif case == "zero_reference":  # a small error on a zero reference: huge rel, abs within atol
        ref[k], run[k] = 0.0, 1e-6
    return run, ref


CASES = ["close", "abs_beyond_rel_within", "both_beyond", "nan_runtime", "nan_reference", "inf_both", "inf_runtime",
         "zero_reference"]


def _same(x, y, rel=0.0):
    if x is None or y is None:
        return x is y
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    return x == y if rel == 0 else math.isclose(x, y, rel_tol=rel, abs_tol=0.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("slice_elements", [7, 1000, 4096])
def test_sliced_equals_polygraphy_whole_array(case, dtype, slice_elements):
    """Every statistic the report uses and the verdict: bit-equal max abs/rel and verdict, means to float32
    rounding, NaN where Polygraphy has NaN (a NaN never passes), on random data with planted cases."""
    rng = np.random.default_rng([CASES.index(case), slice_elements])
    run, ref = _pair(rng, 9001, dtype, case)
    atol, rtol = (1e-4, 1e-3) if dtype == np.float32 else (5e-2, 1e-2)
    whole = SimpleCompareFunc(atol=atol, rtol=rtol, check_error_stat="elemwise")._check_outputs_match(
        run, "x", ref, "x", rtol, atol, "elemwise", "rt", "ref", 0.99)
    got = sliced_elementwise(run, ref, atol, rtol, slice_elements=slice_elements).result()
    assert bool(got) == bool(whole), (case, got.max_absdiff, whole.max_absdiff)
    assert _same(got.max_absdiff, whole.max_absdiff) and _same(got.max_reldiff, whole.max_reldiff)
    assert _same(got.mean_absdiff, whole.mean_absdiff, 1e-5) and _same(got.mean_reldiff, whole.mean_reldiff, 1e-5)
    expect_pass = case in ("close", "abs_beyond_rel_within", "zero_reference")
    assert bool(got) == expect_pass  # the planted case decides; NaN and inf always fail
    if case in ("nan_runtime", "nan_reference", "inf_both"):
        assert math.isnan(got.max_absdiff)


@pytest.mark.parametrize("case", CASES)
def test_compare_func_verdicts_and_rows_unchanged(case):
    """Through the check's compare func (exact names, 3-d logits larger than a slice, a small state): the match
    dict has the same verdicts and the statistics the report rows read as Polygraphy's SimpleCompareFunc."""
    rng = np.random.default_rng([CASES.index(case), 99])
    run, ref = _pair(rng, 2 * 7 * 1000, np.float32, case)
    s_run, s_ref = _pair(rng, 300, np.float32, "close")
    atol, rtol = {"": 1e-4}, {"": 1e-3}
    it = IterationResult(OrderedDict(logits=run.reshape(2, 7, 1000), state=s_run), runner_name="rt")
    base = IterationResult(OrderedDict(logits=ref.reshape(2, 7, 1000), state=s_ref), runner_name="ref")
    sliced = SlicedCompareFunc(atol=atol, rtol=rtol, check_error_stat="elemwise", slice_elements=512)(it, base)
    whole = SimpleCompareFunc(atol=atol, rtol=rtol, check_error_stat="elemwise")(it, base)
    assert list(sliced) == list(whole) == ["logits", "state"]
    for name in sliced:
        a, b = sliced[name], whole[name]
        assert bool(a) == bool(b)
        assert _same(a.max_absdiff, b.max_absdiff) and _same(a.max_reldiff, b.max_reldiff)
        assert _same(a.mean_absdiff, b.mean_absdiff, 1e-5) and _same(a.mean_reldiff, b.mean_reldiff, 1e-5)
    assert all(sliced[n].median_absdiff is None for n in sliced)  # the small state went the sliced way too
    # the report rows built from either are the same (means to float32 rounding)
    rows = [_rows("prefill", [{("rt", "ref"): [m]}], ["1x7"], ["logits", "state"], atol, rtol)
            for m in (sliced, whole)]
    for r1, r2 in zip(*rows):
        assert (r1.passed, r1.failed_iterations) == (r2.passed, r2.failed_iterations)
        if case in ("nan_runtime", "nan_reference", "inf_both", "inf_runtime") and r1.output == "logits":
            # a failure stated as such: the sliced comparison counts the NaN/inf elements, Polygraphy's does not
            side = "reference's" if case == "nan_reference" else "runtime's"
            assert f"of 14,000 elements of the {side} output" in r1.note and r1.note.endswith("(at 1x7)"), r1.note
            assert r2.note == "non-finite differences (NaN/inf) (at 1x7)" and not r1.passed
        else:
            assert r1.note == r2.note
        assert _same(r1.max_abs, r2.max_abs) and _same(r1.max_rel, r2.max_rel)
        assert _same(r1.mean_abs, r2.mean_abs, 1e-5)


def test_large_output_compared_without_whole_array_temporaries():
    """Comparing 8M-element fp32 outputs (32 MB each) allocates a few slices' worth, not the ~6 whole-array
    temporaries (abs, reference copy, rel, medians) of SimpleCompareFunc (> 150 MB here)."""
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((2, 80, 50_000), dtype=np.float32)
    run = ref + np.float32(1e-6)
    f = make_compare_func({"": 1e-4}, {"": 1e-3})
    it, base = (IterationResult(OrderedDict(logits=a), runner_name=n) for a, n in ((run, "rt"), (ref, "ref")))
    tracemalloc.start()
    try:
        match = f(it, base)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert bool(match["logits"]) and match["logits"].max_absdiff < 1e-5
    assert peak < 48 << 20, f"peak {peak / 2**20:.0f} MiB during the comparison"


class _Fake(BaseRunner):
    """A runner returning a fresh (2, 3, 4096) 'logits' per call (reference: ``base``; runtime: base + 1e-6) and
    recording how many outputs of earlier calls (any runner) are still alive when it runs."""

    def __init__(self, name, alive: list, seen: list, offset: float):
        super().__init__(name=name)
        self.alive, self.seen, self.offset = alive, seen, offset

    def activate_impl(self):
        pass

    def get_input_metadata_impl(self):
        return TensorMetadata().add("input_ids", dtype=np.int64, shape=[1, 1])

    def infer_impl(self, feed_dict):
        self.seen.append(sum(r() is not None for r in self.alive))
        k = int(np.asarray(feed_dict["input_ids"]).ravel()[0])
        out = np.full((2, 3, 4096), float(k), np.float32) + np.float32(self.offset)
        self.alive.append(weakref.ref(out))
        return OrderedDict(logits=out)

    def deactivate_impl(self):
        pass


def test_prefill_keeps_at_most_the_reference_and_one_runtime_output():
    """_prefill compares each runtime's outputs as they come and drops them: when any runner runs, at most the
    current feed's reference outputs are alive (Polygraphy's streaming Comparator.run also held the other
    runners' outputs of the feed and the previous feed's). Verdicts per feed and runtime recorded."""
    alive, seen = [], []
    rts = [_Runtime(n, "", _Fake(n, alive, seen, off), None) for n, off in (("ref", 0.0), ("a", 1e-6), ("b", 5.0))]
    feeds = [OrderedDict(input_ids=np.full((1, 1), k, np.int64)) for k in range(4)]
    acc = _prefill(rts, feeds, make_compare_func({"": 1e-4}, {"": 1e-3}), ProgressTask(), {})
    assert list(acc) == [("a", "ref"), ("b", "ref")]
    assert [bool(m["logits"]) for m in acc[("a", "ref")]] == [True] * 4
    assert [bool(m["logits"]) for m in acc[("b", "ref")]] == [False] * 4
    assert len(seen) == 12 and max(seen) <= 1, seen


def test_empty_outputs_compare_equal_without_nan_or_warnings():
    """A d_conv 1 mixer's conv state has no columns (batch, conv_dim, 0): the check compares it as equal with zero
    differences (Polygraphy's whole-array rule averaged nothing: NaN means and numpy's 'Mean of empty slice'
    RuntimeWarning on stderr). A shape mismatch is still Polygraphy's to refuse."""
    import warnings

    atol, rtol = {"": 1e-4}, {"": 1e-3}
    empty = np.zeros((2, 96, 0), np.float32)
    it = IterationResult(OrderedDict(state=empty), runner_name="rt")
    base = IterationResult(OrderedDict(state=empty.copy()), runner_name="ref")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = SlicedCompareFunc(atol=atol, rtol=rtol, check_error_stat="elemwise")(it, base)["state"]
    assert bool(got)
    assert (got.max_absdiff, got.max_reldiff, got.mean_absdiff, got.mean_reldiff) == (0.0, 0.0, 0.0, 0.0)
    bad = IterationResult(OrderedDict(state=np.zeros((2, 96, 1), np.float32)), runner_name="rt")
    assert not bool(SlicedCompareFunc(atol=atol, rtol=rtol, check_error_stat="elemwise")(bad, base)["state"])
