"""Polygraphy's elementwise comparison, computed in slices: the same numbers and verdicts without whole-array
temporaries.

``SimpleCompareFunc`` (``check_error_stat="elemwise"``) compares two outputs by building whole arrays: the
absolute difference, a copy of the reference with an epsilon added at its zeros, the relative difference,
two medians (each a partitioned copy) and the mismatch masks: for fp32 logits of a (2, 257, 50288) input,
~6 temporaries of 103 MB each on top of the two outputs, held at once (benchmarks/RESULTS.md, issue 17).
:class:`SlicedCompareFunc` computes the same element-wise quantities, in Polygraphy's own arithmetic (inputs
cast up as ``polygraphy.comparator.util.cast_up`` does: fp16 -> fp32, small ints -> int32/int64; then
``|a - b|``, ``|a - b| / |b + eps at zeros|`` with Polygraphy's epsilon), on flat slices of
:data:`SLICE_ELEMENTS` elements, and keeps running reductions only:

* ``max_absdiff`` / ``max_reldiff``: the maximum of the slices' maxima; NaN when any element's is NaN (as
  ``numpy.amax`` of the whole array gives). Bit-identical to Polygraphy's.
* the elementwise verdict: an element fails where (abs > atol or abs is NaN) and (rel > rtol or rel is
  NaN), exactly Polygraphy's mask; the output fails when any slice has a failing element. A NaN or inf
  in either output therefore fails (inf - inf and inf / inf are NaN); nothing non-finite passes.
* ``mean_absdiff`` / ``mean_reldiff``: the slices' float64 sums over the element count. Polygraphy
  averages in float32 (``numpy.mean(dtype=float32)``); the two agree to float32 rounding (~1e-7 relative),
  and a NaN or inf anywhere gives NaN or inf in both.
* non-finite elements: where a slice's max abs difference is not finite, the NaN and inf elements of each output
  are counted (:class:`NonFinite`, the result's ``nonfinite``), so a report can say "NaN in 12 elements of the
  runtime's output" instead of a number; an inf difference of two finite outputs (fp32 overflow) counts none.
* medians and quantiles are not computed (``None`` in the result, which Polygraphy's result type allows):
  ``m2export check``'s report does not use them.

Every numpy output pair of one shape goes this way, however small: the per-layer states too (a 130m check
compares ~1,900 of them; Polygraphy's whole-array statistics, medians included, took ~24 ms each, ~45 s of CPU
in all: benchmarks/RESULTS.md, issue 17). Non-numpy arrays, booleans, outputs whose shapes differ (Polygraphy
aligns or refuses them) and every statistic other than ``elemwise`` are left to Polygraphy's own
``SimpleCompareFunc`` unchanged.
"""

from __future__ import annotations

import math

import numpy as np
from polygraphy.comparator.compare import OutputCompareResult, SimpleCompareFunc, SimpleThreshold
from polygraphy.logger import G_LOGGER, LogMode

#: elements per slice: 4 MiB of fp32; the slice's handful of temporaries stay in the tens of MB
SLICE_ELEMENTS = 1 << 20
#: what Polygraphy's SimpleCompareFunc adds to the reference's zeros before dividing (numpy float64 eps)
EPSILON = 2.220446049250313e-16


def _cast_up(a: np.ndarray) -> np.ndarray:
    """``polygraphy.comparator.util.cast_up`` for numpy arrays: fp16 -> fp32, int8/16 and uint8/16 -> int32,
    uint32 -> int64, anything else unchanged."""
    if a.dtype == np.float16:
        return a.astype(np.float32)
    if a.dtype in (np.int8, np.uint8, np.int16, np.uint16):
        return a.astype(np.int32)
    if a.dtype == np.uint32:
        return a.astype(np.int64)
    return a


class NonFinite:
    """NaN and inf element counts of one compared output pair (the runtime's output, the reference's), over
    ``elements`` elements; truthy when any count is non-zero. Added with ``+`` over iterations."""

    __slots__ = ("runtime_nan", "runtime_inf", "reference_nan", "reference_inf", "elements")

    def __init__(self, runtime_nan=0, runtime_inf=0, reference_nan=0, reference_inf=0, elements=0):
        self.runtime_nan, self.runtime_inf = int(runtime_nan), int(runtime_inf)
        self.reference_nan, self.reference_inf = int(reference_nan), int(reference_inf)
        self.elements = int(elements)

    def __add__(self, other: "NonFinite") -> "NonFinite":
        return NonFinite(*(getattr(self, k) + getattr(other, k) for k in self.__slots__))

    def __bool__(self) -> bool:
        return bool(self.runtime_nan or self.runtime_inf or self.reference_nan or self.reference_inf)

    def to_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}

    def describe(self) -> str:
        """``NaN in 5 and inf in 1 of 3,072 elements of the runtime's output`` (each side that has any)."""
        parts = []
        for side, nan, inf in (("runtime's", self.runtime_nan, self.runtime_inf),
                               ("reference's", self.reference_nan, self.reference_inf)):
            what = " and ".join(f"{k} in {n:,}" for k, n in (("NaN", nan), ("inf", inf)) if n)
            if what:
                parts.append(f"{what} of {self.elements:,} elements of the {side} output")
        return "; ".join(parts)


class ElementwiseStats:
    """Running reductions of Polygraphy's elementwise comparison of one output pair, fed slice by slice
    (:meth:`add`); :meth:`result` gives the ``OutputCompareResult``.

    Args:
        atol, rtol: the output's tolerances; infinities_compare_equal: as ``SimpleCompareFunc``'s option
            (equal infinities have abs difference 0 instead of NaN).
    """

    def __init__(self, atol: float, rtol: float, *, infinities_compare_equal: bool = False):
        self.atol, self.rtol, self.inf_equal = atol, rtol, infinities_compare_equal
        self.n = 0
        self.max_abs = self.max_rel = -math.inf
        self.sum_abs = self.sum_rel = 0.0
        self.nan_abs = self.nan_rel = False
        self.mismatch = False
        self.zero_in_reference = False
        self.nonfinite = NonFinite()

    def add(self, out0: np.ndarray, out1: np.ndarray) -> None:
        """One slice of the runtime's output (``out0``) and of the reference's (``out1``), same shape."""
        a, b = _cast_up(out0), _cast_up(out1)
        with np.errstate(all="ignore"):  # inf - inf, x / 0 ...: NaN/inf are the comparison's to report
            absdiff = np.abs(a - b)
            if self.inf_equal:
                absdiff = np.where(np.isinf(out0) & (out0 == out1), 0, absdiff)
            b_eps = np.array(b, copy=True)
            if b_eps.dtype.kind == "f":
                zeros = b_eps == 0
                if zeros.any():
                    self.zero_in_reference = True
                    b_eps[zeros] += EPSILON
            reldiff = np.divide(absdiff, np.abs(b_eps))
        del b_eps
        self.n += absdiff.size
        self.nonfinite.elements += absdiff.size
        for name, arr in (("abs", absdiff), ("rel", reldiff)):
            m = float(np.amax(arr))
            if name == "abs" and not math.isfinite(m):  # a NaN or inf in either output (or an fp32 overflow)
                self._count_nonfinite(out0, out1)
            if math.isnan(m):
                setattr(self, f"nan_{name}", True)
            else:
                setattr(self, f"max_{name}", max(getattr(self, f"max_{name}"), m))
            setattr(self, f"sum_{name}", getattr(self, f"sum_{name}") + float(np.sum(arr, dtype=np.float64)))
        if not self.mismatch:
            bad = (np.greater(absdiff, self.atol) | np.isnan(absdiff)) & (
                np.greater(reldiff, self.rtol) | np.isnan(reldiff))
            self.mismatch = bool(bad.any())

    def _count_nonfinite(self, out0: np.ndarray, out1: np.ndarray) -> None:
        def counts(arr):  # (NaN, inf) elements of one side; none for an integer output
            if arr.dtype.kind != "f":
                return 0, 0
            return np.count_nonzero(np.isnan(arr)), np.count_nonzero(np.isinf(arr))

        self.nonfinite += NonFinite(*counts(out0), *counts(out1))  # elements are counted in add()

    def result(self, err_stat: str = "elemwise") -> OutputCompareResult:
        """The comparison's ``OutputCompareResult`` (medians and quantiles ``None``), verdict stored."""
        if not self.n:  # an empty output (a d_conv 1 conv state): equal, with no differences to average
            return self._stored(OutputCompareResult(0.0, 0.0, 0.0, 0.0, None, None, None, None,
                                                    thresholds=SimpleThreshold(err_stat, self.atol, self.rtol)))
        max_abs = math.nan if self.nan_abs else self.max_abs
        max_rel = math.nan if self.nan_rel else self.max_rel
        res = OutputCompareResult(max_abs, max_rel, self.sum_abs / self.n, self.sum_rel / self.n, None, None, None,
                                  None, thresholds=SimpleThreshold(err_stat, self.atol, self.rtol))
        return self._stored(res)

    def _stored(self, res: OutputCompareResult) -> OutputCompareResult:
        res._stored_passed = not self.mismatch  # the elemwise verdict, as SimpleCompareFunc stores it
        res.nonfinite = self.nonfinite  # read by m2export.check.compare._rows (Polygraphy's own results lack it)
        return res


def sliced_elementwise(out0: np.ndarray, out1: np.ndarray, atol: float, rtol: float, *,
                       slice_elements: int = SLICE_ELEMENTS, infinities_compare_equal: bool = False
                       ) -> ElementwiseStats:
    """:class:`ElementwiseStats` of two same-shape arrays, fed in flat slices of ``slice_elements`` (C order;
    a non-contiguous array is read through ``numpy.ravel``'s copy)."""
    a, b = np.ravel(out0), np.ravel(out1)
    st = ElementwiseStats(atol, rtol, infinities_compare_equal=infinities_compare_equal)
    for i in range(0, a.size, slice_elements):
        st.add(a[i:i + slice_elements], b[i:i + slice_elements])
    return st


class SlicedCompareFunc(SimpleCompareFunc):
    """Polygraphy's ``SimpleCompareFunc`` whose ``elemwise`` comparison of same-shape numpy outputs runs in slices
    of ``slice_elements`` (:func:`sliced_elementwise`; an output of at most one slice is one slice): same max
    statistics and verdicts, float64-summed means, no medians, and no whole-array temporaries. Everything else
    (options, output matching, shape alignment, other statistics, booleans) is ``SimpleCompareFunc``'s own.

    Args:
        slice_elements: elements per slice (default :data:`SLICE_ELEMENTS`); the rest as ``SimpleCompareFunc``.
    """

    def __init__(self, *args, slice_elements: int = SLICE_ELEMENTS, **kwargs):
        super().__init__(*args, **kwargs)
        self.slice_elements = int(slice_elements)

    def _check_outputs_match(self, out0, out0_name, out1, out1_name, per_out_rtol, per_out_atol, per_out_err_stat,
                             runner0_name, runner1_name, per_out_quantile):
        if (per_out_err_stat != "elemwise" or not isinstance(out0, np.ndarray) or not isinstance(out1, np.ndarray)
                or out0.dtype == np.bool_ or out1.dtype == np.bool_ or out0.shape != out1.shape):
            return super()._check_outputs_match(out0, out0_name, out1, out1_name, per_out_rtol, per_out_atol,
                                                per_out_err_stat, runner0_name, runner1_name, per_out_quantile)
        st = sliced_elementwise(out0, out1, per_out_atol, per_out_rtol, slice_elements=self.slice_elements,
                                infinities_compare_equal=self.infinities_compare_equal)
        if st.zero_in_reference:
            G_LOGGER.warning(f"{runner1_name:35} | Output: {out1_name}: Some values are 0. Will add a small epsilon "
                             "quantity to these when computing relative difference. Note that this may cause some "
                             "relative differences to be extremely high. ", mode=LogMode.ONCE)
        res = st.result(per_out_err_stat)
        G_LOGGER.info(f"Error Metrics: {out0_name} (in slices of up to {self.slice_elements} elements) | max abs "
                      f"{res.max_absdiff:.5g}, max rel {res.max_reldiff:.5g}, mean abs {res.mean_absdiff:.5g}, "
                      f"mean rel {res.mean_reldiff:.5g}")
        return res
