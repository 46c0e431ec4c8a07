"""The few CUDA driver API calls the TensorRT plugin needs, through ``ctypes`` on ``libcuda``.

Used to pin and check the AOT kernel's target (driver version, compute capability of the device
TensorRT builds for, and whether the driver JIT-compiles the PTX about to be embedded in an engine)
and, in tests, to launch that PTX exactly as TensorRT's AOT launcher does. Plain ``ctypes`` so it
works with any torch/cuda-python combination, or none. Nothing here runs at import time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass
from typing import Sequence

from m2export.errors import BackendUnavailable

CUDA_SUCCESS = 0
#: CUresult values named in our messages (cuda.h)
_RESULT_NAMES = {
    0: "CUDA_SUCCESS", 1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED", 35: "CUDA_ERROR_INSUFFICIENT_DRIVER", 100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE", 200: "CUDA_ERROR_INVALID_IMAGE", 201: "CUDA_ERROR_INVALID_CONTEXT",
    209: "CUDA_ERROR_NO_BINARY_FOR_GPU", 218: "CUDA_ERROR_INVALID_PTX", 221: "CUDA_ERROR_JIT_COMPILER_NOT_FOUND",
    222: "CUDA_ERROR_UNSUPPORTED_PTX_VERSION", 224: "CUDA_ERROR_UNSUPPORTED_DEVPTR_SYNC_MEMOP",
    500: "CUDA_ERROR_NOT_FOUND", 700: "CUDA_ERROR_ILLEGAL_ADDRESS", 701: "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
    719: "CUDA_ERROR_LAUNCH_FAILED",
}
CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222
_CU_DEVICE_ATTRIBUTE_CC_MAJOR = 75
_CU_DEVICE_ATTRIBUTE_CC_MINOR = 76

_LIB: ctypes.CDLL | None = None


def result_name(code: int) -> str:
    return _RESULT_NAMES.get(int(code), f"CUresult {int(code)}")


def _lib() -> ctypes.CDLL:
    """libcuda, initialised (``cuInit(0)``); BackendUnavailable when there is no driver or no GPU."""
    global _LIB
    if _LIB is None:
        name = ctypes.util.find_library("cuda") or "libcuda.so.1"
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            raise BackendUnavailable(f"no CUDA driver: cannot load libcuda ({e})",
                                     hint="run on a machine with an NVIDIA GPU and its driver installed") from None
        rc = lib.cuInit(0)
        if rc != CUDA_SUCCESS:
            raise BackendUnavailable(f"no usable CUDA GPU: cuInit failed with {result_name(rc)}",
                                     hint="check nvidia-smi; TensorRT engines need an NVIDIA GPU")
        _LIB = lib
    return _LIB


def _check(rc: int, what: str) -> None:
    if rc != CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {result_name(rc)}")


def driver_version() -> tuple[int, int]:
    """CUDA version the installed driver supports, e.g. (13, 0)."""
    v = ctypes.c_int()
    _check(_lib().cuDriverGetVersion(ctypes.byref(v)), "cuDriverGetVersion")
    return v.value // 1000, (v.value % 1000) // 10


def device_count() -> int:
    n = ctypes.c_int()
    _check(_lib().cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
    return n.value


def current_device() -> int:
    """Ordinal of the device of the current context (the one TensorRT builds on), else 0."""
    lib = _lib()
    dev = ctypes.c_int()
    if lib.cuCtxGetDevice(ctypes.byref(dev)) == CUDA_SUCCESS:
        return dev.value
    return 0


def compute_capability(ordinal: int | None = None) -> tuple[int, int]:
    lib = _lib()
    ordinal = current_device() if ordinal is None else ordinal
    dev = ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib.cuDeviceGetAttribute(ctypes.byref(major), _CU_DEVICE_ATTRIBUTE_CC_MAJOR, dev), "cuDeviceGetAttribute")
    _check(lib.cuDeviceGetAttribute(ctypes.byref(minor), _CU_DEVICE_ATTRIBUTE_CC_MINOR, dev), "cuDeviceGetAttribute")
    return major.value, minor.value


def device_name(ordinal: int | None = None) -> str:
    lib = _lib()
    ordinal = current_device() if ordinal is None else ordinal
    dev = ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    buf = ctypes.create_string_buffer(256)
    _check(lib.cuDeviceGetName(buf, 256, dev), "cuDeviceGetName")
    return buf.value.decode(errors="replace")


def _ensure_context(ordinal: int | None = None) -> None:
    """Make the primary context of ``ordinal`` current if no context is (cuModuleLoadData needs one)."""
    lib = _lib()
    ctx = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(ctx)) == CUDA_SUCCESS and ctx.value:
        return
    ordinal = 0 if ordinal is None else ordinal
    dev = ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def try_load_module(image: bytes) -> int:
    """``cuModuleLoadData(image)`` (PTX text or cubin) then unload; returns the CUresult (0 = loads)."""
    lib = _lib()
    _ensure_context()
    mod = ctypes.c_void_p()
    data = image if image.endswith(b"\0") else image + b"\0"
    rc = lib.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(data))
    if rc == CUDA_SUCCESS:
        lib.cuModuleUnload(mod)
    return int(rc)


@dataclass
class LoadedKernel:
    """One kernel of a module loaded with :func:`load_kernel`; :meth:`launch` mirrors TensorRT's AOT launch."""

    module: ctypes.c_void_p
    function: ctypes.c_void_p

    def launch(self, grid: Sequence[int], block: Sequence[int], args: Sequence[tuple[str, int]],
               *, shared_mem: int = 0, stream: int = 0) -> None:
        """``cuLaunchKernel`` with ``args`` as ``(ctype, value)`` pairs: "u64" (pointers), "i32".

        TensorRT passes the tensor pointers as 64-bit values and every extra SymInt32 argument as a
        32-bit integer, in slot order; this does the same.
        """
        holders = []
        for kind, value in args:
            if kind == "u64":
                holders.append(ctypes.c_uint64(int(value)))
            elif kind == "i32":
                holders.append(ctypes.c_int32(int(value)))
            else:
                raise ValueError(f"argument kind {kind!r}: expected 'u64' or 'i32'")
        ptrs = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
        gx, gy, gz = (list(grid) + [1, 1])[:3]
        bx, by, bz = (list(block) + [1, 1])[:3]
        _check(_lib().cuLaunchKernel(self.function, gx, gy, gz, bx, by, bz, shared_mem, ctypes.c_void_p(stream),
                                     ptrs, None), "cuLaunchKernel")

    def unload(self) -> None:
        _lib().cuModuleUnload(self.module)


def load_kernel(image: bytes, name: str) -> LoadedKernel:
    """Load a PTX/cubin image into the current context and look up entry ``name``."""
    lib = _lib()
    _ensure_context()
    mod = ctypes.c_void_p()
    data = image if image.endswith(b"\0") else image + b"\0"
    _check(lib.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(data)), "cuModuleLoadData")
    fn = ctypes.c_void_p()
    rc = lib.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode())
    if rc != CUDA_SUCCESS:
        lib.cuModuleUnload(mod)
        _check(rc, f"cuModuleGetFunction({name!r})")
    return LoadedKernel(mod, fn)
