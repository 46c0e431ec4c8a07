"""NaN/inf in an output is a failure stated as such: counted per side, named with its iterations, never turned into
a number (no "max abs nan" next to a finite max rel computed from other iterations; no NaN token in the JSON)."""

from __future__ import annotations

import io
import json
import math
from collections import OrderedDict

import numpy as np
import pytest
from polygraphy.comparator.struct import IterationResult
from rich.console import Console

from m2export.check.compare import CheckReport, _rows, make_compare_func
from m2export.check.metrics import sliced_elementwise
from m2export.check.report import print_console

ATOL, RTOL = {"": 1e-4}, {"": 1e-3}


def _match(run: np.ndarray, ref: np.ndarray):
    f = make_compare_func(ATOL, RTOL)
    return f(IterationResult(OrderedDict(logits=run), runner_name="rt"),
             IterationResult(OrderedDict(logits=ref), runner_name="ref"))


def _two_iterations(bad):
    """Iteration 1x7: the runtime's logits have NaN at two elements (or ``bad``); 2x7: a finite error 0.5."""
    rng = np.random.default_rng(0)
    ref1 = rng.standard_normal((1, 7, 50)).astype(np.float32)
    run1 = ref1.copy()
    bad(run1, ref1)
    ref2 = rng.standard_normal((2, 7, 50)).astype(np.float32)
    run2 = ref2 + np.float32(0.5)
    return [_match(run1, ref1), _match(run2, ref2)]


def _report(rows):
    return CheckReport(outdir="out", dtype="fp32", reference="torch",
                       runners=[{"name": "torch", "detail": "PyTorch", "label": "torch"},
                                {"name": "rt", "detail": "ONNX Runtime CPU", "label": "onnxrt/std"}],
                       skipped=[], shapes=[[1, 7], [2, 7]], decode_steps=0, prompt_len=0, atol=ATOL, rtol=RTOL,
                       rows=rows, greedy={})


def _nan_run(run, ref):
    run[0, 3, 5] = run[0, 6, 1] = np.nan


def _inf_ref(run, ref):
    ref[0, 0, 0] = run[0, 0, 0] = np.inf


@pytest.mark.parametrize("bad,expect", [(_nan_run, "NaN in 2 of 350 elements of the runtime's output (at 1x7)"),
                                        (_inf_ref, "inf in 1 of 350 elements of the runtime's output; inf in 1 of "
                                                   "350 elements of the reference's output (at 1x7)")])
def test_nan_row_is_a_failure_stated_as_such(bad, expect):
    [row] = _rows("prefill", [{("rt", "torch"): _two_iterations(bad)}], ["1x7", "2x7"], ["logits"], ATOL, RTOL)
    assert not row.passed and row.note == expect
    # no statistic stands for the output: before, max abs was NaN next to the 2x7 iteration's finite max rel
    assert all(math.isnan(x) for x in (row.max_abs, row.mean_abs, row.max_rel, row.mean_rel))
    rep = _report([row])
    [fail] = rep.failures()
    assert fail == f"prefill rt: logits ({expect})" and "max rel" not in fail and "nan" not in fail
    md = rep.to_markdown()
    assert "nan" not in md.lower().replace("nan in", "") and expect in md
    d = json.loads(json.dumps(rep.to_dict()), parse_constant=lambda c: pytest.fail(f"JSON token {c}"))
    assert d["rows"][0]["max_abs"] is None and d["rows"][0]["nonfinite"]["elements"] == 350
    buf = io.StringIO()
    print_console(rep, "out", Console(file=buf, width=200, highlight=False), json_name="r.json", md_name="r.md")
    out = buf.getvalue()
    assert "nan" not in out.lower().replace("nan in", "") and "FAIL" in out


def test_counts_only_where_the_difference_is_not_finite():
    """Finite outputs count nothing; an fp32 overflow of two finite outputs keeps its inf difference (a number
    that is true) and counts no NaN/inf element."""
    a = np.array([3e38, 1.0], np.float32)
    b = np.array([-3e38, 1.0], np.float32)
    st = sliced_elementwise(a, b, 1e-4, 1e-3)
    assert not st.nonfinite and math.isinf(st.result().max_absdiff) and not bool(st.result())
    a[1] = np.nan
    st = sliced_elementwise(a, b, 1e-4, 1e-3, slice_elements=1)
    assert st.nonfinite.to_dict() == {"runtime_nan": 1, "runtime_inf": 0, "reference_nan": 0, "reference_inf": 0,
                                      "elements": 2}
