"""TensorRT plugin ``m2export::SSMScan`` v1 with TensorRT's Python plugin API (``tensorrt.plugin``).

The op's contract (inputs, outputs, attributes, shape and dtype rules) is :mod:`m2export.contract`;
this module only adapts it to TensorRT. Its logic lives in plain functions, testable without TensorRT:

* :func:`output_shapes` / :func:`output_dtypes` -- the ``@register`` shape and dtype rule (contract's);
* :func:`autotune_io_types` -- the ``@autotune`` type combinations (fp32 / fp16 / bf16, from the contract);
* :func:`run_jit` -- the ``@impl`` body: torch views of TensorRT's buffers (:func:`torch_view`, built from
  ``data_ptr``/shape/strides/dtype, since ``trtp.Tensor.__cuda_array_interface__`` refuses bf16), then
  :func:`m2export.kernels.ssd.ssm_scan` (cuTile) writing straight into TensorRT's outputs on TensorRT's stream;
* :func:`aot_launch` -- the ``@aot_impl`` body: the cuTile kernel exported to PTX for the build GPU, its
  parameters reordered to TensorRT's AOT convention, and the launch (see :mod:`m2export.plugins.aot`).

:func:`register` wraps them in the decorators. ``tensorrt`` is imported there, never at import time.
This file deliberately has no ``from __future__ import annotations``: TensorRT's decorators read the
annotations of the decorated functions as live types.

Attributes reach the plugin from the ONNX node (TensorRT's parser converts ONNX INT -> int32 and FLOAT ->
float32 plugin fields; ``plugin_namespace``/``plugin_version`` select the plugin and are not passed on):
``chunk_size: int``, ``dt_softplus: int`` (0/1), ``dt_min: float``, ``dt_max: float``.
"""

import functools
import logging
from typing import Any, Callable, List, Sequence, Tuple, Union

from m2export import backends, contract
from m2export.contract import SSMScanAttrs, SSMScanProblem
from m2export.errors import InternalError

log = logging.getLogger(__name__)

PLUGIN_ID = f"{contract.PLUGIN_NAMESPACE}::{contract.OP_NAME}"
#: the packed (cu_seqlens) form, JIT only: one launch group over all sequences (m2export.kernels.ssd ``cu_seqlens``)
PACKED_PLUGIN_ID = f"{contract.PLUGIN_NAMESPACE}::{contract.PACKED_OP_NAME}"
#: contract dtype name -> TensorRT's autotune spelling
TRT_TYPE_NAMES = {"float32": "FP32", "float16": "FP16", "bfloat16": "BF16", "int32": "INT32"}
#: contract attribute type -> the Python type the plugin's attribute is annotated with
ATTRIBUTE_TYPES = {"int": int, "float": float}


# ----------------------------------------------------------------------------- shape / dtype / autotune
def output_shapes(x_shape: Sequence[Any], B_shape: Sequence[Any]) -> Tuple[Tuple[Any, ...], Tuple[Any, ...]]:
    """``y`` like ``x``, ``final_state`` (batch, nheads, headdim, d_state): the contract's rule.

    Dims may be ints or TensorRT ``ShapeExpr`` items (anything indexable).
    """
    return contract.output_shapes(x_shape, B_shape)


def output_dtypes(x_dtype: Any, float32: Any) -> Tuple[Any, Any]:
    """``y`` in the dtype of ``x``, ``final_state`` in ``float32`` (given in the caller's dtype vocabulary)."""
    y_dtype, fs_dtype = contract.output_dtypes(x_dtype)
    if fs_dtype != "float32":
        raise InternalError(f"contract.output_dtypes: final_state dtype {fs_dtype!r} has no TensorRT mapping here")
    return y_dtype, float32


def autotune_io_types(packed: bool = False) -> List[str]:
    """One ``AutoTuneCombination`` type string per supported dtype combination, I/O in contract order.

    e.g. ``"BF16, BF16, FP32, BF16, BF16, FP32, FP32, FP32, BF16, FP32"`` (8 inputs, then y, final_state);
    ``packed``: the packed form's 9 inputs (``cu_seqlens`` INT32 last).
    """
    names = sum(_names(packed), ())
    return [", ".join(TRT_TYPE_NAMES[combo[n]] for n in names)
            for combo in contract.input_dtype_combinations(packed)]


def layer_tile_families(x_shape: Sequence[Any], B_shape: Sequence[Any], dtype: Any) -> tuple:
    """The prefill kernels' tuning space for a layer (:func:`m2export.kernels.ssd.plan.tile_families`): what the
    plugin's tactics ``1..n`` select. Empty when nheads/headdim/ngroups/d_state are not static, or seqlen is the
    constant 1 (a decode graph runs the step kernel, which has no tiles to choose)."""
    from m2export.kernels.ssd.plan import tile_families
    from m2export.plugins.aot import constant_size

    nheads, headdim, ngroups, d_state = (constant_size(v) for v in (x_shape[2], x_shape[3], B_shape[2], B_shape[3]))
    if None in (nheads, headdim, ngroups, d_state) or constant_size(x_shape[1]) == 1:
        return ()
    return tile_families(SSMScanProblem(batch=1, seqlen=2, nheads=nheads, headdim=headdim, ngroups=ngroups,
                                        d_state=d_state, dtype=contract.dtype_name(dtype)))


def autotune_combinations(x_shape: Sequence[Any], B_shape: Sequence[Any], packed: bool = False
                          ) -> List[Tuple[str, List[int]]]:
    """``(io_types, tactics)`` per :func:`autotune_io_types` entry: tactic ``i`` (1-based) runs the layer's
    ``i``-th tile family, so TensorRT times each candidate at build time and the engine keeps the fastest
    (tactic 0, TensorRT's default, runs the heuristic plan). No tactics where there is nothing to choose."""
    out = []
    for types, combo in zip(autotune_io_types(packed), contract.input_dtype_combinations(packed)):
        n = len(layer_tile_families(x_shape, B_shape, combo["x"]))
        out.append((types, list(range(1, n + 1)) if n > 1 else []))
    return out


def tiles_for_tactic(tactic: Any, x_shape: Sequence[Any], B_shape: Sequence[Any], dtype: Any):
    """The :class:`~m2export.kernels.ssd.plan.TileFamily` of ``tactic`` (None for 0/None: the heuristic).
    Raises InternalError for a tactic this layer never advertised.

    The sequence length is not looked at: a tactic > 0 was advertised for a layer whose seqlen is dynamic at build
    time, and at run time that engine may get one token (a 1-token prompt or packed call), which
    :func:`layer_tile_families` would read as a decode graph's constant 1."""
    if not tactic:
        return None
    families = layer_tile_families((x_shape[0], None, *x_shape[2:]), B_shape, dtype)
    if not 1 <= int(tactic) <= len(families):
        raise InternalError(f"SSMScan plugin: tactic {tactic} not among the {len(families)} advertised for x "
                            f"{tuple(x_shape)}, B {tuple(B_shape)}")
    return families[int(tactic) - 1]


def _names(packed: bool) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    return ((contract.PACKED_INPUT_NAMES, contract.PACKED_OUTPUT_NAMES) if packed
            else (contract.INPUT_NAMES, contract.OUTPUT_NAMES))


def attrs_from_plugin(chunk_size: int, dt_softplus: int, dt_min: float, dt_max: float) -> SSMScanAttrs:
    """The node's attributes as :class:`SSMScanAttrs` (float32 inf stays inf)."""
    return SSMScanAttrs(chunk_size=int(chunk_size), dt_softplus=bool(int(dt_softplus)),
                        dt_min=float(dt_min), dt_max=float(dt_max))


def check_plugin_signature(params: Sequence[str], *, extra: Sequence[str], packed: bool = False) -> None:
    """The decorated functions' parameters must be the contract's inputs, attributes, then ``extra``."""
    want = list(_names(packed)[0]) + list(contract.ATTRIBUTE_NAMES) + list(extra)
    if list(params) != want:
        raise InternalError(f"SSMScan plugin signature {list(params)} drifted from the contract: expected {want}")


# ----------------------------------------------------------------------------- JIT impl
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4}
#: __cuda_array_interface__ type strings; bf16 travels as its 16-bit pattern and is viewed back
_TYPESTR = {"float32": "<f4", "float16": "<f2", "bfloat16": "<i2", "int32": "<i4"}


def cuda_array_interface(t: Any) -> dict:
    """``__cuda_array_interface__`` (v3) of a TensorRT ``trtp.Tensor``-like object.

    Reads ``data_ptr``, ``shape``, ``strides`` (in elements; None = contiguous) and ``dtype``
    (``trt.DataType``, torch dtype or name). bf16 is described as int16 (same bytes); see :func:`torch_view`.
    No ``stream`` synchronisation is requested: the plugin runs on TensorRT's stream.
    """
    name = contract.dtype_name(t.dtype)
    if name not in _ITEMSIZE:
        raise InternalError(f"SSMScan plugin: unsupported tensor dtype {t.dtype} ({name})")
    shape = tuple(int(d) for d in t.shape)
    strides = getattr(t, "strides", None)
    if strides is None:
        strides, acc = [], 1
        for d in reversed(shape):
            strides.insert(0, acc)
            acc *= max(d, 1)
    item = _ITEMSIZE[name]
    return {"shape": shape, "typestr": _TYPESTR[name], "data": (int(t.data_ptr), False),
            "strides": tuple(int(s) * item for s in strides), "version": 3, "stream": None}


class _CudaArray:
    def __init__(self, cai: dict):
        self.__cuda_array_interface__ = cai


def torch_view(t: Any):
    """A torch CUDA tensor aliasing the memory of a ``trtp.Tensor``-like object (no copy), any float dtype."""
    import torch

    cai = cuda_array_interface(t)
    view = torch.as_tensor(_CudaArray(cai), device="cuda")
    if contract.dtype_name(t.dtype) == "bfloat16":
        view = view.view(torch.bfloat16)
    return view


_VIEWS: dict = {}
VIEW_CACHE_SIZE = 1024


def cached_torch_view(t: Any):
    """:func:`torch_view`, remembered per (address, shape, strides, dtype) of the TensorRT tensor.

    TensorRT hands an engine's enqueues the same buffers again and again; a view owns nothing (it only
    describes that memory), so the one made for the same description is interchangeable with a new one,
    and building ten of them per call is most of the plugin body's host time. At most
    :data:`VIEW_CACHE_SIZE` views are kept (cleared when full).
    """
    strides = getattr(t, "strides", None)
    key = (int(t.data_ptr), tuple(int(d) for d in t.shape), None if strides is None else tuple(int(v) for v in strides),
           str(t.dtype))
    view = _VIEWS.get(key)
    if view is None:
        if len(_VIEWS) >= VIEW_CACHE_SIZE:
            _VIEWS.clear()
        view = _VIEWS[key] = torch_view(t)
    return view


def run_jit(inputs: Sequence[Any], outputs: Sequence[Any], attrs: SSMScanAttrs, stream: int, *,
            backend: str = "cutile", as_tensor: Callable[[Any], Any] = cached_torch_view,
            packed: bool = False, tactic: int = 0) -> None:
    """The ``@impl`` body: SSMScan of TensorRT's ``inputs`` into its ``outputs`` on ``stream``.

    ``inputs`` in contract order (x, dt, A, B, C, D, dt_bias, initial_state; ``packed``: then cu_seqlens,
    :data:`m2export.contract.PACKED_INPUTS`), ``outputs`` (y, final_state): objects with
    ``data_ptr``/``shape``/``strides``/``dtype`` (TensorRT's ``trtp.Tensor``), turned into torch views by
    ``as_tensor``. The kernel writes the outputs in place, launched on the raw ``cudaStream_t`` TensorRT
    passes. The packed form reads ``cu_seqlens`` on the host (one device-to-host copy per call).
    ``tactic``: the one TensorRT chose at build time (:func:`tiles_for_tactic`; 0: the heuristic plan).
    """
    from m2export.kernels.ssd import ssm_scan

    in_names, out_names = _names(packed)
    if len(inputs) != len(in_names) or len(outputs) != len(out_names):
        raise InternalError(f"{contract.PACKED_OP_NAME if packed else contract.OP_NAME} plugin: got {len(inputs)} "
                            f"inputs and {len(outputs)} outputs, expected {len(in_names)} and {len(out_names)}")
    views = [as_tensor(t) for t in inputs]
    packing = {"cu_seqlens": views.pop()} if packed else {}
    x, dt, A, B, C, D, dt_bias, initial_state = views
    y, final_state = (as_tensor(t) for t in outputs)
    # ssm_scan resolves the raw handle (0 = the legacy default stream) and makes it torch's current
    # stream for the call, so scratch from torch's caching allocator is ordered on TensorRT's stream
    tiles = tiles_for_tactic(tactic, x.shape, B.shape, x.dtype)
    ssm_scan(x, dt, A, B, C, D, dt_bias, initial_state, chunk_size=attrs.chunk_size,
             dt_softplus=attrs.dt_softplus, dt_limit=attrs.dt_limit, backend=backend,
             out=y, final_state_out=final_state, stream=int(stream), tiles=tiles, **packing)


# ----------------------------------------------------------------------------- AOT impl
def aot_launch(shapes: dict, x_dtype: Any, attrs: SSMScanAttrs, *, gpu_code: str,
               ptx_isa: Tuple[int, int] = None, compile_kernel: Callable = None, tactic: int = 0) -> dict:
    """The ``@aot_impl`` body, free of TensorRT types.

    Args:
        shapes: name -> dims (ints or TensorRT ``ShapeExpr``) of every input and output.
        x_dtype: dtype of x (``trt.DataType``, torch dtype or name).
        gpu_code: ``sm_XY`` of the build GPU (pinned by the caller; see :func:`aot.check_target`).
        ptx_isa: explicit PTX ISA override (``--aot-ptx-isa``), else what tileiras emits.
        compile_kernel: :func:`m2export.plugins.aot.compile_aot_kernel` (injectable for tests).
        tactic: TensorRT's tactic (:func:`tiles_for_tactic`; 0: the default tiles).

    Returns:
        dict(name, ptx, grid (3 dims), block (3 ints), shared_mem, extra_args (values in slot order),
        extra_names, kernel (the :class:`~m2export.plugins.aot.AotKernel`)).
    """
    from m2export.plugins import aot

    compile_kernel = compile_kernel or aot.compile_aot_kernel
    x_shape, B_shape = shapes["x"], shapes["B"]
    nheads = aot.static_size(x_shape[2], "nheads (x dim 2)")
    headdim = aot.static_size(x_shape[3], "headdim (x dim 3)")
    ngroups = aot.static_size(B_shape[2], "ngroups (B dim 2)")
    d_state = aot.static_size(B_shape[3], "d_state (B dim 3)")
    dtype = contract.dtype_name(x_dtype)
    # a decode engine (seqlen the constant 1) runs the memory-bound step kernel, not the chunked scan
    decode = aot.constant_size(x_shape[1]) == 1
    tiles = None if decode else tiles_for_tactic(tactic, x_shape, B_shape, dtype)
    kernel = (compile_kernel(nheads, headdim, ngroups, d_state, dtype, attrs, gpu_code, ptx_isa, decode)
              if tiles is None else
              compile_kernel(nheads, headdim, ngroups, d_state, dtype, attrs, gpu_code, ptx_isa, decode, tiles))
    extras = aot.extra_arg_values(kernel.amap, shapes, kernel.scalars)
    grid = kernel.grid(x_shape[0], nheads, headdim)
    return dict(name=kernel.name, ptx=kernel.ptx, grid=tuple(grid), block=kernel.block, shared_mem=0,
                extra_args=extras, extra_names=kernel.amap.extra_args, kernel=kernel)


def build_target() -> Tuple[str, Tuple[int, int], Tuple[int, int]]:
    """(gpu_code, compute capability, driver CUDA version) of the GPU TensorRT is building on."""
    from m2export.plugins import _cuda, aot

    cc = _cuda.compute_capability()
    return aot.gpu_code_for(cc), cc, _cuda.driver_version()


_AOT_OPTIONS: dict = {"ptx_isa": None}


def configure_aot(*, ptx_isa: Union[Tuple[int, int], None] = None) -> None:
    """Options of the AOT implementation, which TensorRT calls without arguments of ours.

    ``ptx_isa``: rewrite the PTX ``.version`` to this ISA (``m2export build --aot-ptx-isa``; an explicit
    opt-in for drivers older than cuda-tile's toolkit -- verify the engine with ``m2export check``).
    None leaves tileiras' ISA alone.
    """
    _AOT_OPTIONS["ptx_isa"] = tuple(ptx_isa) if ptx_isa is not None else None


@functools.lru_cache(maxsize=32)
def compile_checked_kernel(nheads: int, headdim: int, ngroups: int, d_state: int, dtype: str,
                           attrs: SSMScanAttrs, gpu_code: str, ptx_isa: Union[Tuple[int, int], None] = None,
                           decode: bool = False, tiles: Any = None):
    """:func:`aot.compile_aot_kernel`, then :func:`aot.check_target` on the build GPU (once per kernel).

    The check JIT-compiles the PTX with the driver, exactly what TensorRT does when it loads the engine;
    doing it here turns a run-time failure (or garbage) into a build error naming the cause.
    """
    from m2export.plugins import _cuda, aot

    kernel = aot.compile_aot_kernel(nheads, headdim, ngroups, d_state, dtype, attrs, gpu_code, ptx_isa, decode,
                                    tiles)
    cc, driver = _cuda.compute_capability(), _cuda.driver_version()
    if aot.gpu_code_for(cc) != gpu_code:
        raise InternalError(f"AOT kernel compiled for {gpu_code} but the current GPU is sm_{cc[0]}{cc[1]}")
    aot.check_target(kernel.ptx, cc=cc, driver=driver, load=_cuda.try_load_module)
    return kernel


# ----------------------------------------------------------------------------- registration
_REGISTERED: dict = {}
#: exceptions raised inside the plugin functions since the last :func:`take_plugin_errors` (TensorRT only
#: logs them and reports a generic build failure; ``m2export build`` re-raises the first one)
_PLUGIN_ERRORS: list = []


def take_plugin_errors() -> list:
    """The exceptions the plugin functions raised under TensorRT since the last call (and forget them)."""
    errs = list(_PLUGIN_ERRORS)
    _PLUGIN_ERRORS.clear()
    return errs


def _recorded(what: str, fn: Callable, *args, **kwargs):
    """Call ``fn``; an exception is logged with its message, recorded, and re-raised to TensorRT."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        _PLUGIN_ERRORS.append(e)
        log.error("m2export::SSMScan %s failed: %s: %s", what, type(e).__name__, e)
        raise


def register(*, trt: Any = None, trtp: Any = None) -> dict:
    """Register ``m2export::SSMScan`` (descriptor, autotune, JIT impl and, where supported, AOT impl).

    Idempotent. ``trt``/``trtp`` default to ``tensorrt`` / ``tensorrt.plugin`` (injectable for tests).

    Returns:
        ``{"jit": True, "aot": bool}`` -- which implementations are registered.

    Raises:
        BackendUnavailable: TensorRT (or its ``tensorrt.plugin`` module) is missing or too old.
    """
    if _REGISTERED:
        return dict(_REGISTERED)
    trt, trtp, has_aot = backends.tensorrt_plugin_api("the SSMScan plugin", trt, trtp)

    @trtp.register(PLUGIN_ID)
    def ssm_scan_desc(x: trtp.TensorDesc, dt: trtp.TensorDesc, A: trtp.TensorDesc, B: trtp.TensorDesc,
                      C: trtp.TensorDesc, D: trtp.TensorDesc, dt_bias: trtp.TensorDesc,
                      initial_state: trtp.TensorDesc, chunk_size: int, dt_softplus: int, dt_min: float,
                      dt_max: float) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
        y_shape, fs_shape = output_shapes(x.shape_expr, B.shape_expr)
        y_dtype, fs_dtype = output_dtypes(x.dtype, trt.float32)
        return trtp.from_shape_expr(y_shape, dtype=y_dtype), trtp.from_shape_expr(fs_shape, dtype=fs_dtype)

    @trtp.autotune(PLUGIN_ID)
    def ssm_scan_autotune(x: trtp.TensorDesc, dt: trtp.TensorDesc, A: trtp.TensorDesc, B: trtp.TensorDesc,
                          C: trtp.TensorDesc, D: trtp.TensorDesc, dt_bias: trtp.TensorDesc,
                          initial_state: trtp.TensorDesc,
                          outputs: Tuple[trtp.TensorDesc, trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(types, "LINEAR", tactics or None)
                for types, tactics in autotune_combinations(x.shape_expr, B.shape_expr)]

    @trtp.impl(PLUGIN_ID)
    def ssm_scan_impl(x: trtp.Tensor, dt: trtp.Tensor, A: trtp.Tensor, B: trtp.Tensor, C: trtp.Tensor,
                      D: trtp.Tensor, dt_bias: trtp.Tensor, initial_state: trtp.Tensor, chunk_size: int,
                      dt_softplus: int, dt_min: float, dt_max: float,
                      outputs: Tuple[trtp.Tensor, trtp.Tensor], stream: int, tactic: int) -> None:
        _recorded("JIT impl", run_jit, (x, dt, A, B, C, D, dt_bias, initial_state), outputs,
                  attrs_from_plugin(chunk_size, dt_softplus, dt_min, dt_max), stream, tactic=tactic)

    for fn, extra in ((ssm_scan_desc, ()), (ssm_scan_impl, ("outputs", "stream", "tactic"))):
        check_plugin_signature(_param_names(fn), extra=extra)

    if has_aot:
        @trtp.aot_impl(PLUGIN_ID)
        def ssm_scan_aot_impl(x: trtp.TensorDesc, dt: trtp.TensorDesc, A: trtp.TensorDesc, B: trtp.TensorDesc,
                              C: trtp.TensorDesc, D: trtp.TensorDesc, dt_bias: trtp.TensorDesc,
                              initial_state: trtp.TensorDesc, chunk_size: int, dt_softplus: int, dt_min: float,
                              dt_max: float, outputs: Tuple[trtp.TensorDesc, trtp.TensorDesc], tactic: int
                              ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams,
                                         trtp.SymIntExprs]:
            descs = dict(zip(contract.INPUT_NAMES + contract.OUTPUT_NAMES,
                             (x, dt, A, B, C, D, dt_bias, initial_state, *outputs)))

            def describe():
                gpu_code, _cc, _driver = build_target()
                return aot_launch({k: v.shape_expr for k, v in descs.items()}, x.dtype,
                                  attrs_from_plugin(chunk_size, dt_softplus, dt_min, dt_max),
                                  gpu_code=gpu_code, ptx_isa=_AOT_OPTIONS["ptx_isa"],
                                  compile_kernel=compile_checked_kernel, tactic=tactic)

            launch = _recorded("AOT impl", describe)
            params = trtp.KernelLaunchParams()
            params.grid_x, params.grid_y, params.grid_z = launch["grid"]
            params.block_x, params.block_y, params.block_z = launch["block"]
            params.shared_mem = launch["shared_mem"]
            extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(v) for v in launch["extra_args"]])
            log.debug("SSMScan AOT kernel %s for %s: grid %s, block %s, %d extra args", launch["name"],
                      launch["kernel"].gpu_code, launch["grid"], launch["block"], len(launch["extra_args"]))
            return launch["name"], launch["ptx"], params, extra

        check_plugin_signature(_param_names(ssm_scan_aot_impl), extra=("outputs", "tactic"))

    @trtp.register(PACKED_PLUGIN_ID)
    def ssm_scan_packed_desc(x: trtp.TensorDesc, dt: trtp.TensorDesc, A: trtp.TensorDesc, B: trtp.TensorDesc,
                             C: trtp.TensorDesc, D: trtp.TensorDesc, dt_bias: trtp.TensorDesc,
                             initial_state: trtp.TensorDesc, cu_seqlens: trtp.TensorDesc, chunk_size: int,
                             dt_softplus: int, dt_min: float,
                             dt_max: float) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
        y_shape, fs_shape = contract.packed_output_shapes(x.shape_expr, B.shape_expr, cu_seqlens.shape_expr)
        y_dtype, fs_dtype = output_dtypes(x.dtype, trt.float32)
        return trtp.from_shape_expr(y_shape, dtype=y_dtype), trtp.from_shape_expr(fs_shape, dtype=fs_dtype)

    @trtp.autotune(PACKED_PLUGIN_ID)
    def ssm_scan_packed_autotune(x: trtp.TensorDesc, dt: trtp.TensorDesc, A: trtp.TensorDesc,
                                 B: trtp.TensorDesc, C: trtp.TensorDesc, D: trtp.TensorDesc,
                                 dt_bias: trtp.TensorDesc, initial_state: trtp.TensorDesc,
                                 cu_seqlens: trtp.TensorDesc, outputs: Tuple[trtp.TensorDesc, trtp.TensorDesc]
                                 ) -> List[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(types, "LINEAR", tactics or None)
                for types, tactics in autotune_combinations(x.shape_expr, B.shape_expr, packed=True)]

    @trtp.impl(PACKED_PLUGIN_ID)
    def ssm_scan_packed_impl(x: trtp.Tensor, dt: trtp.Tensor, A: trtp.Tensor, B: trtp.Tensor, C: trtp.Tensor,
                             D: trtp.Tensor, dt_bias: trtp.Tensor, initial_state: trtp.Tensor,
                             cu_seqlens: trtp.Tensor, chunk_size: int, dt_softplus: int, dt_min: float,
                             dt_max: float, outputs: Tuple[trtp.Tensor, trtp.Tensor], stream: int,
                             tactic: int) -> None:
        _recorded("JIT impl (packed)", run_jit, (x, dt, A, B, C, D, dt_bias, initial_state, cu_seqlens), outputs,
                  attrs_from_plugin(chunk_size, dt_softplus, dt_min, dt_max), stream, packed=True, tactic=tactic)

    for fn, extra in ((ssm_scan_packed_desc, ()), (ssm_scan_packed_impl, ("outputs", "stream", "tactic"))):
        check_plugin_signature(_param_names(fn), extra=extra, packed=True)

    _REGISTERED.update(jit=True, aot=has_aot)
    log.debug("registered TensorRT plugin %s (JIT%s)", PLUGIN_ID, " + AOT" if has_aot else "")
    return dict(_REGISTERED)


def _param_names(fn: Callable) -> List[str]:
    import inspect

    return list(inspect.signature(fn).parameters)
