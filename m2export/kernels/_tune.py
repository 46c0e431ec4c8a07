"""The one autotuner of m2export's cuTile kernels: search, key, cache and the environment switch.

A kernel offers a few candidate launch configurations (the SSD scan: :func:`m2export.kernels.ssd.plan.tile_families`,
heuristic first); :meth:`Autotuner.choose` times each on the call's own tensors and remembers the fastest per
:func:`tuning_key` (shapes, strides and dtypes of every tensor, the call's flags, the device's name and compute
capability, the kernel version). Each candidate's first run compiles it: the search stops starting new
candidates once :data:`DEFAULT_BUDGET_S` seconds have passed and each compile runs under
``cuda.tile.compiler_timeout``, so tuning time is bounded; the heuristic's candidate is always measured.

Off by default: an eager call uses the heuristic plan, deterministic and free. ``M2EXPORT_AUTOTUNE=1`` turns the
search on for eager calls (the first call of each signature pays it). Inside TensorRT the choice belongs to the
engine build: the plugin advertises the same candidates as tactics and TensorRT times them
(:mod:`m2export.plugins.ssm_scan_trt`), whatever this switch says.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections import OrderedDict
from typing import Any, Callable, Mapping, Sequence, TypeVar

log = logging.getLogger("m2export")

#: the one switch: "1" searches, "0" (or unset) uses the heuristic plan
ENV = "M2EXPORT_AUTOTUNE"
_VALUES = {"0": False, "1": True, "": False}
#: seconds after which no new candidate starts (the running one finishes)
DEFAULT_BUDGET_S = 60.0
#: cuda.tile compile timeout per candidate, seconds
COMPILE_TIMEOUT_S = 60.0
#: timed runs per candidate (after one untimed run that compiles it); the median counts
REPS = 5
CACHE_SIZE = 256

C = TypeVar("C")


#: ``M2EXPORT_AUTOTUNE`` as parsed by the process's first :func:`enabled` call (None: not yet; :func:`reset`)
_enabled: bool | None = None


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether eager calls search (``M2EXPORT_AUTOTUNE``): "1" yes; "0", empty or unset no (blanks around the value
    ignored). The environment is read and parsed once, at the first call, and the answer kept for the process (every
    eager scan asks); :func:`reset` forgets it. ``environ``: parse that mapping instead (nothing read or kept).

    Raises:
        ParameterError: (a ValueError; one line in the CLI) any other value. Nothing is kept then: every call
            raises until the variable is fixed (and :func:`reset` called).
    """
    global _enabled
    if environ is not None:
        return _parse(environ.get(ENV, ""))
    if _enabled is None:
        _enabled = _parse(os.environ.get(ENV, ""))
    return _enabled


def reset() -> None:
    """Forget the parsed switch: the next :func:`enabled` reads ``M2EXPORT_AUTOTUNE`` again (for tests that set it)."""
    global _enabled
    _enabled = None


def _parse(text: str) -> bool:
    value = text.strip()
    if value not in _VALUES:
        from m2export.errors import ParameterError

        raise ParameterError(f"{ENV}={value!r}: expected one of '0' (heuristic plans) or '1' (search each new shape)",
                             hint=f"unset {ENV} or set it to 0 or 1")
    return _VALUES[value]


def _describe(t: Any) -> tuple:
    if t is None:
        return (None,)
    return (tuple(t.shape), tuple(t.stride()), str(t.dtype))


def tuning_key(kernel: str, version: str, tensors: Mapping[str, Any], *, flags: tuple = (),
               device: Any = None) -> tuple:
    """The cache key of one call: kernel name and version, every tensor's (shape, strides, dtype) by name (None
    for an absent optional one), ``flags`` (attributes that select code: softplus, limits, ...) and the device
    (name and compute capability, from torch when ``device`` is a CUDA device; else ``device`` as given)."""
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        props = torch.cuda.get_device_properties(device)
        dev = (props.name, props.major, props.minor)
    else:
        dev = device
    return (kernel, version, tuple((n, _describe(t)) for n, t in sorted(tensors.items())), tuple(flags), dev)


def cuda_timer(stream: Any) -> Callable[[Callable[[], None]], float]:
    """A timer of ``fn`` on ``stream`` (a torch.cuda.Stream): one untimed run, then the median of :data:`REPS`
    runs between CUDA events, in milliseconds."""
    import torch

    def time_ms(fn: Callable[[], None]) -> float:
        fn()
        times = []
        for _ in range(REPS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    return time_ms


class Autotuner:
    """Chooses among candidates by measured time, once per key (an LRU of :data:`CACHE_SIZE` keys).

    ``timer(fn) -> ms`` runs ``fn`` and returns its time (:func:`cuda_timer` on the GPU; injectable for tests).
    ``clock`` measures the budget (seconds).
    """

    def __init__(self, *, budget_s: float = DEFAULT_BUDGET_S, clock: Callable[[], float] = time.monotonic):
        self.budget_s, self.clock = budget_s, clock
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        #: key -> [(candidate, ms or None if it failed)], for reports and tests (the cached keys' only)
        self.trials: dict[tuple, list] = {}

    def cached(self, key: tuple) -> Any | None:
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        return None

    def choose(self, key: tuple, candidates: Sequence[C], run: Callable[[C], None],
               timer: Callable[[Callable[[], None]], float]) -> C:
        """The fastest of ``candidates`` for ``key`` (cached). ``run(c)`` executes candidate ``c`` once.

        candidates[0] (the heuristic) is always measured, and an error in it propagates; a later candidate that
        raises (a compile failure, a timeout) is logged and skipped. Candidates after the budget is spent are
        not started.
        """
        hit = self.cached(key)
        if hit is not None:
            return hit
        if not candidates:
            raise ValueError("Autotuner.choose: no candidates")
        t0, trials = self.clock(), []
        for i, cand in enumerate(candidates):
            if i and self.clock() - t0 > self.budget_s:
                log.info("autotune: budget of %.0f s spent after %d of %d candidates", self.budget_s, i,
                         len(candidates))
                break
            try:
                ms = timer(lambda: run(cand))
            except Exception as e:
                if i == 0:
                    raise
                log.info("autotune: candidate %s skipped: %s: %s", cand, type(e).__name__, e)
                trials.append((cand, None))
                continue
            trials.append((cand, ms))
        best = min((t for t in trials if t[1] is not None), key=lambda t: t[1])[0]
        log.info("autotune: %s chosen (%s)", best, ", ".join(f"{c}: {'failed' if ms is None else f'{ms:.4f} ms'}"
                                                              for c, ms in trials))
        self.trials[key] = trials
        if len(self._cache) >= CACHE_SIZE:
            old, _ = self._cache.popitem(last=False)
            self.trials.pop(old, None)  # bounded with the cache
        self._cache[key] = best
        return best


#: the process's tuner (one cache for every kernel: keys name the kernel)
TUNER = Autotuner()
