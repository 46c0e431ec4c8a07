"""Host code shared by the SSMScan kernels (prefill and decode step): one home for each fact.

Backend checks and the supported sizes, output buffers, the launch stream, the SM count, the
cache of re-hinted kernel objects and the cache of launch plans. Imports neither CUDA nor
``cuda.tile`` at import time (the package must import on any machine).
"""

from __future__ import annotations

import importlib
import weakref
from typing import Any, Callable

import torch

from m2export.errors import BackendUnavailable, ContractError

BACKENDS = ("cutile", "torch")
INSTALL_HINT = 'install the GPU extra (pip install m2export[gpu]) on a CUDA machine, or pass backend="torch"'
SUPPORTED_DIMS = (32, 64, 128, 256)
"""d_state the cuTile kernels compile for (a power of two: the B/C tiles span it)."""
HEADDIM_MULTIPLE, HEADDIM_MAX = 16, 256
"""headdim the cuTile kernels serve: any multiple of 16 up to 256 (e.g. Nemotron-Nano's 80), covered by
power-of-two tiles without padding copies (m2export.kernels.ssd.plan.headdim_pieces)."""
SUPPORTED_TEXT = {"headdim": f"multiples of {HEADDIM_MULTIPLE} up to {HEADDIM_MAX}", "d_state": str(SUPPORTED_DIMS)}
"""How error messages name the supported sizes (the prefill, decode-step and TensorRT build checks)."""


def is_supported(name: str, value: int) -> bool:
    """Whether the cuTile kernels serve ``headdim`` / ``d_state`` = ``value`` (see :data:`SUPPORTED_TEXT`)."""
    if name == "headdim":
        return 0 < value <= HEADDIM_MAX and value % HEADDIM_MULTIPLE == 0
    return value in SUPPORTED_DIMS


# ----------------------------------------------------------------------------- checks
def check_supported(problem, kernel: str = "SSD", *, hint: str = 'use backend="torch" for other sizes') -> None:
    """Raise ContractError (one line, naming the field) unless headdim and d_state are served (:func:`is_supported`)."""
    for name in ("headdim", "d_state"):
        v = getattr(problem, name)
        if not is_supported(name, v):
            raise ContractError(
                f"{name}: the cuTile {kernel} kernel supports {name} in {SUPPORTED_TEXT[name]}, got {v}", hint=hint)


def require_cutile(backend: str, problem, kernel: str, tensors: dict, stream=None) -> None:
    """Raise unless ``backend`` is "cutile" and the cuTile ``kernel`` can run ``problem`` on ``tensors`` here
    (``tensors["A"]`` is checked by :func:`check_decay_once` first: bad input is named before a missing GPU).

    Raises:
        ContractError: unknown backend, headdim/d_state not served (:func:`is_supported`), or a NaN/inf/positive A.
        BackendUnavailable: no CUDA device, no cuda.tile, or a tensor not on CUDA.
    """
    if backend != "cutile":
        raise ContractError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    check_supported(problem, kernel)
    check_decay_once(tensors["A"], stream)
    require_cuda_tile(tensors)


_DECAY_OK: dict[int, tuple[Any, int, int]] = {}


def check_decay_once(A: torch.Tensor, stream=None) -> None:
    """:func:`m2export.kernels.ssd.naive.check_decay` (every A finite and <= 0) on the cuTile path, without
    a device sync per launch.

    A tensor off the GPU is checked on every call (cheap). A CUDA tensor is checked once per tensor object
    and version (``A`` is a weight: the TensorRT plugin passes the same cached view on every enqueue; an
    in-place change bumps the version and is checked again). Reading the verdict back is a device sync, so
    while ``stream`` (the launch stream, see :func:`launch_stream`) or torch's current stream is being
    captured into a CUDA graph, an A not seen before is not checked (a sync would invalidate the capture).

    Raises:
        ContractError: A holds a NaN, an inf or a positive value (named, with the first bad value).
    """
    from m2export.kernels.ssd.naive import check_decay

    if A.device.type != "cuda":
        check_decay(A)
        return
    version = tensor_version(A)
    seen = _DECAY_OK.get(id(A))
    if version is not None and seen is not None and seen[0]() is A and seen[1:] == (version, A.data_ptr()):
        return
    if torch.cuda.is_current_stream_capturing():
        return
    with torch.cuda.device(A.device), torch.cuda.stream(launch_stream(stream, A.device)):
        if torch.cuda.is_current_stream_capturing():
            return
    check_decay(A)
    if version is None:  # an inference tensor: no version counter, so an in-place change could not be seen
        return
    if len(_DECAY_OK) >= PLAN_CACHE_SIZE:
        _DECAY_OK.clear()
    _DECAY_OK[id(A)] = (weakref.ref(A), version, A.data_ptr())


def tensor_version(t: torch.Tensor) -> int | None:
    """``t``'s in-place version counter, or None for a tensor made under ``torch.inference_mode()`` (those
    have none: reading ``_version`` raises RuntimeError), which callers must then not cache against."""
    if t.is_inference():
        return None
    return t._version


def require_cuda_tile(tensors: dict) -> None:
    """Raise BackendUnavailable unless a CUDA device and cuda.tile are there and every tensor of ``tensors``
    (name -> tensor or None) is on CUDA: the size-free part of :func:`require_cutile`, for kernels with
    no headdim/d_state (m2export/kernels/conv1d, gated_norm)."""
    if not torch.cuda.is_available():
        raise BackendUnavailable('backend="cutile": no CUDA device is available', hint=INSTALL_HINT)
    try:
        importlib.import_module("cuda.tile")  # availability check
    except ImportError as e:
        raise BackendUnavailable(f'backend="cutile": cuda.tile cannot be imported ({e})', hint=INSTALL_HINT) from e
    for name, t in tensors.items():
        if t is not None and t.device.type != "cuda":
            raise BackendUnavailable(f'backend="cutile": {name} is on {t.device}, expected a CUDA tensor',
                                     hint='move the inputs to the GPU or pass backend="torch"')


# ----------------------------------------------------------------------------- output buffers
def check_out(name: str, t, shape, dtype, device):
    """Raise ContractError unless ``t`` is a contiguous tensor of exactly ``shape``/``dtype`` on ``device``."""
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device or not t.is_contiguous():
        raise ContractError(
            f"{name}: expected a contiguous {dtype} tensor of shape {tuple(shape)} on {device}, "
            f"got {t.dtype} {tuple(t.shape)} on {t.device} (contiguous={t.is_contiguous()})")
    return t


def out_buffers(x, state_shape, out=None, state_out=None, *, state_name: str = "final_state_out",
                allocate: bool = False):
    """Check the caller's ``out`` (shaped and typed like ``x``) and ``state_out`` (``state_shape``, fp32)
    with :func:`check_out`; with ``allocate``, make empty ones for those not given.

    Returns (y buffer or None, state buffer or None).
    """
    if out is not None:
        check_out("out", out, x.shape, x.dtype, x.device)
    elif allocate:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous also for a strided x
    if state_out is not None:
        check_out(state_name, state_out, state_shape, torch.float32, x.device)
    elif allocate:
        state_out = torch.empty(state_shape, dtype=torch.float32, device=x.device)
    return out, state_out


def unit_stride(t):
    """``t`` itself when its last stride is 1 (a cuTile kernel reads it in place through its strides,
    e.g. a view of the conv output or of the in_proj output), else a contiguous copy; None stays None."""
    if t is None or t.stride(-1) == 1 or t.numel() == 0:
        return t
    return t.contiguous()


def into_buffers(res, out=None, final_state_out=None):
    """Copy ``res`` (an SSMScanOutput) into the caller's preallocated buffers (each optional) and return them."""
    if out is not None:
        out.copy_(res.y)
    if final_state_out is not None:
        final_state_out.copy_(res.final_state)
    return type(res)(res.y if out is None else out, res.final_state if final_state_out is None else final_state_out)


# ----------------------------------------------------------------------------- device, stream
def launch_stream(stream, device: torch.device) -> torch.cuda.Stream:
    """The launch stream as a torch stream.

    None -> the current stream of ``device``; a torch stream -> itself; a raw ``cudaStream_t``
    int -> ``torch.cuda.ExternalStream``, except 0 and 1 (``cudaStreamLegacy``), which are the
    legacy default stream: ``torch.cuda.ExternalStream(0)`` is NOT that stream -- torch treats a
    null ``stream_ptr`` as "no pointer given" and hands out a fresh non-blocking pool stream, which
    is ordered neither after the caller's earlier work nor before its later work (that race left
    y unwritten on the JIT plugin's default-stream path, issue 14). 2 (``cudaStreamPerThread``)
    is refused: torch has no stream object for it.
    """
    if stream is None:
        return torch.cuda.current_stream(device)
    if isinstance(stream, int):
        if stream in (0, 1):
            return torch.cuda.default_stream(device)
        if stream == 2:
            raise ContractError("stream: cudaStreamPerThread (2) is not supported; pass the stream's own handle")
        return torch.cuda.ExternalStream(stream, device=device)
    if getattr(stream, "cuda_stream", None) is None:
        raise TypeError(f"stream: expected None, a torch.cuda.Stream or a raw cudaStream_t int, got {type(stream)}")
    return stream


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (cached per device index)."""
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SM_COUNT:
        _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SM_COUNT[i]


# ----------------------------------------------------------------------------- caches
_HINTED: dict[tuple[Any, int | None, int | None], Any] = {}


def hinted(kernel, occupancy: int | None, worker_warps: int | None = None):
    """``kernel`` re-hinted for ``occupancy``/``worker_warps`` (one kernel object, hence one JIT cache, per hint)."""
    if occupancy is None and worker_warps is None:
        return kernel
    key = (kernel, occupancy, worker_warps)
    if key not in _HINTED:
        hints = {k: v for k, v in (("occupancy", occupancy), ("num_worker_warps", worker_warps)) if v is not None}
        _HINTED[key] = kernel.replace_hints(**hints)
    return _HINTED[key]


_PROBLEMS: dict[tuple, Any] = {}


def validated(*args):
    """:func:`m2export.contract.validate` of ``args``, remembered per (shape, dtype) signature of the
    arguments: the contract only looks at shapes and dtypes, so a signature seen once is valid again.
    Errors are raised every time (never cached)."""
    key = tuple(None if t is None else (tuple(t.shape), t.dtype) for t in args)
    problem = _PROBLEMS.get(key)
    if problem is None:
        from m2export.contract import validate

        problem = validate(*args)
        if len(_PROBLEMS) >= PLAN_CACHE_SIZE:
            _PROBLEMS.clear()
        _PROBLEMS[key] = problem
    return problem


_PLANS: dict[tuple, Any] = {}
PLAN_CACHE_SIZE = 4096


def cached_plan(key: tuple, make: Callable[[], Any]) -> Any:
    """The launch plan for ``key`` (a problem signature: shapes, dtypes, flags, device), made once by ``make``.

    Keeps choose_config and the launch descriptions off the per-call path; cleared when it holds
    :data:`PLAN_CACHE_SIZE` plans (a server sees few distinct signatures).
    """
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= PLAN_CACHE_SIZE:
            _PLANS.clear()
        plan = _PLANS[key] = make()
    return plan
