"""TensorRT plugins ``m2export::CausalConv1d`` v1 and ``m2export::GatedRMSNorm`` v1 (``tensorrt.plugin``), backed by
the cuTile kernels' public entry points.

The ops' contracts are :mod:`m2export.contract_conv1d` and :mod:`m2export.contract_gated_norm`; the ONNX nodes
(and their function bodies) are written by :mod:`m2export.exporter.fused_ops`. As for SSMScan
(:mod:`m2export.plugins.ssm_scan_trt`), the logic lives in plain functions testable without TensorRT:

* :func:`conv_output_shapes` / :func:`norm_output_shapes`, :func:`output_dtypes`, :func:`autotune_io_types` --
  the ``@register`` / ``@autotune`` rules, from the contracts (every I/O in the dtype of ``x``);
* :func:`run_conv_jit` -- the conv's ``@impl`` body: ``sequence_length`` 1 is the one-token update
  (:func:`m2export.kernels.conv1d.conv_update`, in place on the output state after a copy of the input state:
  TensorRT's inputs are read-only), any other length the prefill (:func:`~m2export.kernels.conv1d.causal_conv1d`),
  writing straight into TensorRT's outputs on TensorRT's stream;
* :func:`run_norm_jit` -- the norm's ``@impl`` body (:func:`m2export.kernels.gated_norm.gated_rmsnorm`);
* :func:`conv_aot_launch` / :func:`norm_aot_launch` -- the ``@aot_impl`` bodies: one kernel each, exported to PTX
  in TensorRT's argument order (:mod:`m2export.plugins.aot`) for any shape: the conv's streaming kernel (every
  token and the final state in one launch; a decode token too, where the JIT body runs the update kernel) and
  the gated-norm kernel.

``register`` wraps them in the decorators; ``tensorrt`` is imported there, never at import time. No
``from __future__ import annotations`` here: TensorRT's decorators read the annotations as live types.

Attributes from the ONNX node: ``activation: str`` (conv), ``group_size: int``, ``eps: float``,
``norm_before_gate: int`` (norm); ``plugin_namespace``/``plugin_version`` select the plugin.
Not run anywhere: TensorRT is not installed here (the bodies are tested with stand-ins and the torch backend).
"""

import contextlib
import functools
import logging
from typing import Any, Callable, List, Sequence, Tuple, Union

from m2export import backends
from m2export import contract_conv1d as cc
from m2export import contract_gated_norm as cg
from m2export.contract import FLOAT_DTYPES, PLUGIN_NAMESPACE, dtype_name
from m2export.errors import BackendUnavailable, ContractError, InternalError
from m2export.plugins.ssm_scan_trt import TRT_TYPE_NAMES, _param_names, _recorded, build_target, cached_torch_view

log = logging.getLogger(__name__)

CONV_PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{cc.OP_NAME}"
NORM_PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{cg.OP_NAME}"


# ----------------------------------------------------------------------------- shape / dtype / autotune
def conv_output_shapes(x_shape: Sequence[Any], weight_shape: Sequence[Any]) -> Tuple[Tuple[Any, ...], Tuple[Any, ...]]:
    """``y`` (batch, seqlen, conv_dim), ``final_conv_state`` (batch, conv_dim, d_conv - 1): the contract's rule.
    Dims may be ints or TensorRT ``ShapeExpr`` items."""
    return cc.output_shapes(x_shape, weight_shape)


def norm_output_shapes(x_shape: Sequence[Any]) -> Tuple[Tuple[Any, ...]]:
    """``out`` shaped like ``x``."""
    return (tuple(x_shape[i] for i in range(len(x_shape))),)


def output_dtypes(x_dtype: Any, n_outputs: int) -> Tuple[Any, ...]:
    """Every output of both ops has the dtype of ``x`` (the contracts' ``"x"`` dtype for each output)."""
    return (x_dtype,) * n_outputs


def autotune_io_types(op: str) -> List[str]:
    """One type string per dtype of ``x`` (:data:`~m2export.contract.FLOAT_DTYPES`), I/O in contract order:
    every tensor of both ops shares the dtype of ``x``. ``op``: the contract's OP_NAME."""
    specs = {cc.OP_NAME: cc.INPUTS + cc.OUTPUTS, cg.OP_NAME: cg.INPUTS + cg.OUTPUTS}[op]
    if any(s.dtype != "x" for s in specs):
        raise InternalError(f"{op}: a tensor of the contract is not in the dtype of x; autotune_io_types needs it")
    return [", ".join(TRT_TYPE_NAMES[d] for _ in specs) for d in FLOAT_DTYPES]


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def conv_activation(activation: Any) -> str:
    """The node's ``activation`` attribute, checked against the contract (bytes or str)."""
    return cc.check_activation(_text(activation))


def norm_attrs(group_size: Any, eps: Any, norm_before_gate: Any) -> dict:
    """The node's attributes as :func:`~m2export.kernels.gated_norm.gated_rmsnorm` keywords (group_size 0: None)."""
    if int(norm_before_gate) not in (0, 1):
        raise ContractError(f"GatedRMSNorm: attribute norm_before_gate={norm_before_gate!r}; expected 0 or 1")
    if int(group_size) < 0:
        raise ContractError(f"GatedRMSNorm: attribute group_size={group_size!r}; expected >= 0 (0: one group)")
    return dict(group_size=int(group_size) or None, eps=float(eps), norm_before_gate=bool(int(norm_before_gate)))


def check_plugin_signature(op: str, params: Sequence[str], *, extra: Sequence[str]) -> None:
    """The decorated functions' parameters must be the contract's inputs, attributes, then ``extra``."""
    mod = {cc.OP_NAME: cc, cg.OP_NAME: cg}[op]
    want = list(mod.INPUT_NAMES) + [a.name for a in mod.ATTRIBUTES] + list(extra)
    if list(params) != want:
        raise InternalError(f"{op} plugin signature {list(params)} drifted from the contract: expected {want}")


# ----------------------------------------------------------------------------- JIT impl
def _stream_context(backend: str, stream: int, device):
    """torch's current stream = TensorRT's raw ``cudaStream_t`` (the state copy is ordered with the kernels), through
    :func:`m2export.kernels._host.launch_stream` (0 and 1 are the legacy default stream, not a pool stream)."""
    if backend != "cutile":
        return contextlib.nullcontext()
    import torch

    from m2export.kernels._host import launch_stream

    return torch.cuda.stream(launch_stream(int(stream), device))


def run_conv_jit(inputs: Sequence[Any], outputs: Sequence[Any], activation: str, stream: int, *,
                 backend: str = "cutile", as_tensor: Callable[[Any], Any] = cached_torch_view) -> None:
    """The conv's ``@impl`` body: inputs (x, weight, bias, conv_state), outputs (y, final_conv_state), TensorRT
    ``trtp.Tensor``-likes turned into torch views by ``as_tensor``.

    ``sequence_length`` 1: ``final_conv_state <- conv_state`` (a copy on ``stream``), then
    :func:`~m2export.kernels.conv1d.conv_update` in place on it, ``y[:, 0]`` as its ``out``; else
    :func:`~m2export.kernels.conv1d.causal_conv1d` with ``out=y``, ``state_out=final_conv_state``.
    """
    from m2export.kernels.conv1d import causal_conv1d, conv_update

    if len(inputs) != len(cc.INPUT_NAMES) or len(outputs) != len(cc.OUTPUT_NAMES):
        raise InternalError(f"CausalConv1d plugin: got {len(inputs)} inputs and {len(outputs)} outputs, expected "
                            f"{len(cc.INPUT_NAMES)} and {len(cc.OUTPUT_NAMES)}")
    x, weight, bias, state = (as_tensor(t) for t in inputs)
    y, final = (as_tensor(t) for t in outputs)
    if x.shape[1] == 1:
        with _stream_context(backend, stream, final.device):
            final.copy_(state)
        conv_update(x[:, 0], final, weight, bias, activation=activation, backend=backend, out=y[:, 0],
                    stream=int(stream) if backend == "cutile" else None)
    else:
        causal_conv1d(x, weight, bias, state, activation=activation, backend=backend, out=y, state_out=final,
                      stream=int(stream) if backend == "cutile" else None)


def run_norm_jit(inputs: Sequence[Any], outputs: Sequence[Any], attrs: dict, stream: int, *,
                 backend: str = "cutile", as_tensor: Callable[[Any], Any] = cached_torch_view) -> None:
    """The norm's ``@impl`` body: inputs (x, z, weight), output (out); ``attrs`` from :func:`norm_attrs`."""
    from m2export.kernels.gated_norm import gated_rmsnorm

    if len(inputs) != len(cg.INPUT_NAMES) or len(outputs) != len(cg.OUTPUT_NAMES):
        raise InternalError(f"GatedRMSNorm plugin: got {len(inputs)} inputs and {len(outputs)} outputs, expected "
                            f"{len(cg.INPUT_NAMES)} and {len(cg.OUTPUT_NAMES)}")
    x, z, weight = (as_tensor(t) for t in inputs)
    (out,) = (as_tensor(t) for t in outputs)
    gated_rmsnorm(x, z, weight, **attrs, backend=backend, out=out,
                  stream=int(stream) if backend == "cutile" else None)


# ----------------------------------------------------------------------------- AOT
def _cdiv(a: Any, b: int) -> Any:
    """ceil(a / b) for an int or a TensorRT ``ShapeExpr`` (``+``, ``//``)."""
    return (a + (b - 1)) // b


def _product(dims: Sequence[Any]) -> Any:
    out: Any = 1
    for d in dims:
        out = d if isinstance(out, int) and out == 1 else out * d
    return out


def conv_aot_spec(dtype: str, d_conv: int, conv_dim: int, silu: bool):
    """The :class:`~m2export.kernels.launch.Launch` of the prefill's streaming kernel (:mod:`m2export.kernels.conv1d.cutile`
    ``stream_kernel()``: ``STREAM_IMPL`` with its ``STREAM_OCCUPANCY`` hint; the whole prefill, every token and the
    final state, in one launch) for the plugin's tensors (x (batch, seqlen, conv_dim), weight, bias, conv_state; y,
    final_conv_state), bias and state always present (the ONNX node has all four inputs). Tiles (and the row-load
    hint ``STREAM_LATENCY``, the row prefetch ``STREAM_PREFETCH``; bounds-checked row tiles, CHECK True: the engine's
    extents are runtime values) from the kernel module's ``choose_stream_tiles``
    for ``conv_dim`` and one sequence of :data:`AOT_CONV_SEQLEN` tokens on 132 SMs (batch and seqlen are runtime
    extents of the engine; any tile is correct, the choice is only speed); grid
    ``(cdiv(seqlen, BLOCK_T), cdiv(conv_dim, BLOCK_C), batch)``. Made against the kernel's own signature (a drift
    fails here, not on the GPU)."""
    from m2export.kernels import launch as L
    from m2export.kernels.conv1d import cutile as K

    bt, rows, bc = K.choose_stream_tiles(cc.Conv1dProblem(batch=1, seqlen=AOT_CONV_SEQLEN, conv_dim=int(conv_dim),
                                                          d_conv=int(d_conv), dtype=dtype), 2 if dtype != "float32" else 4)
    try:
        K.check_stream_tiles(K.STREAM_IMPL, (bt, rows, bc), int(d_conv))
    except ContractError as e:
        raise InternalError(f"{K.STREAM_IMPL} {e}") from None
    args = (L.array("x", dtype, 3), L.array("weight", dtype, 2), L.array("bias", dtype, 1),
            L.array("conv_state", dtype, 3), L.array("y", dtype, 3),
            L.array("state_out", dtype, 3, source=cc.OUTPUT_NAMES[1]),
            L.constant("BLOCK_T", bt), L.constant("ROWS", rows), L.constant("BLOCK_C", bc),
            L.constant("D_CONV", int(d_conv)), L.constant("HAS_BIAS", True), L.constant("HAS_STATE", True),
            L.constant("SILU", bool(silu)), L.constant("LATENCY", K.STREAM_LATENCY),
            L.constant("PREFETCH", K.STREAM_PREFETCH), L.constant("CHECK", True))
    return L.Launch(K.stream_kernel(), args,
                    grid=lambda batch, seqlen, conv_dim: (_cdiv(seqlen, bt), _cdiv(conv_dim, bc), batch))


#: the sequence length the conv's AOT tiles are chosen for (a long prefill: the longest token range per block)
AOT_CONV_SEQLEN = 8192


def norm_aot_spec(problem: cg.GatedNormProblem):
    """The :class:`~m2export.kernels.launch.Launch` of ``gated_rmsnorm_kernel`` for x, z, out viewed as (rows, d_inner)
    (the plugin's extras are computed from those 2-D shapes: TensorRT's I/O is dense, so the view changes no
    stride), tiles from the kernel module's ``choose_tiles`` with rows a runtime extent; grid
    ``(cdiv(rows, BLOCK_R), ngroups, 1)``."""
    from m2export.kernels import launch as L
    from m2export.kernels.gated_norm import cutile as K

    br, ch, nch = K.choose_tiles(problem)
    K.check_tiles(problem, (br, ch, nch))
    d = problem.dtype
    args = (L.array("x", d, 2), L.array("z", d, 2), L.array("weight", d, 1), L.array("out", d, 2),
            L.scalar("group_size", "int32", int(problem.group_size)), L.scalar("eps", "float32", float(problem.eps)),
            L.constant("BLOCK_R", br), L.constant("CHUNK", ch), L.constant("NCHUNK", nch),
            L.constant("NORM_BEFORE_GATE", bool(problem.norm_before_gate)))
    return L.Launch(K.gated_rmsnorm_kernel, args, grid=lambda rows: (_cdiv(rows, br), problem.ngroups, 1))


#: rows assumed when choosing the norm's AOT tiles (rows are a runtime extent of the engine)
AOT_NORM_ROWS = 1 << 20


@functools.lru_cache(maxsize=32)
def compile_conv_kernel(dtype: str, d_conv: int, conv_dim: int, silu: bool, gpu_code: str,
                        ptx_isa: Union[Tuple[int, int], None] = None):
    """The prefill's streaming kernel (:func:`conv_aot_spec`) as an :class:`~m2export.plugins.aot.AotKernel` (cached per dtype, d_conv, target); the
    1-D bias exported without TMA (:func:`_export_without_tma`)."""
    from m2export.plugins import aot

    spec = conv_aot_spec(dtype, d_conv, conv_dim, silu)
    cubin, symbol = _export_without_tma(spec, gpu_code, ("bias",))
    return aot.build_aot_kernel(spec, cubin, symbol, gpu_code=gpu_code, ptx_isa=ptx_isa, inputs=cc.INPUT_NAMES,
                                outputs=cc.OUTPUT_NAMES)


def _export_without_tma(spec, gpu_code: str, arrays: Sequence[str]) -> Tuple[bytes, None]:
    """:func:`m2export.plugins.aot._export_cubin` with the base alignment of ``arrays`` declared as 1 byte: a 1-D
    array with a known unit stride and a 16-byte aligned base is a TMA candidate, whose 128-byte tensor map
    TensorRT's AOT launcher cannot pass (``check_entry`` refuses it). TensorRT's buffers are 256-byte aligned, so
    the weaker claim is true."""
    import dataclasses
    import io

    from cuda.tile.compilation import KernelSignature, export_kernel

    from m2export.plugins import aot

    sig = aot.trt_signature(spec)
    cons = [dataclasses.replace(c, base_addr_divisible_by=1) if a.name in arrays else c
            for a, c in zip(spec.args, sig.parameters)]
    buf = io.BytesIO()
    export_kernel(spec.kernel, [KernelSignature(cons, sig.calling_convention)], buf, gpu_code=gpu_code,
                  output_format="cubin")
    return buf.getvalue(), None


@functools.lru_cache(maxsize=32)
def compile_norm_kernel(problem: cg.GatedNormProblem, gpu_code: str, ptx_isa: Union[Tuple[int, int], None] = None):
    """``gated_rmsnorm_kernel`` as an :class:`~m2export.plugins.aot.AotKernel` (``problem.rows`` ignored); the
    (d_inner,) weight exported without TMA (:func:`_export_without_tma`)."""
    from m2export.plugins import aot

    spec = norm_aot_spec(problem)
    cubin, symbol = _export_without_tma(spec, gpu_code, ("weight",))
    return aot.build_aot_kernel(spec, cubin, symbol, gpu_code=gpu_code, ptx_isa=ptx_isa, inputs=cg.INPUT_NAMES,
                                outputs=cg.OUTPUT_NAMES)


def conv_aot_launch(shapes: dict, x_dtype: Any, activation: str, *, gpu_code: str,
                    ptx_isa: Tuple[int, int] = None, compile_kernel: Callable = None) -> dict:
    """The conv's ``@aot_impl`` body, free of TensorRT types: ``shapes`` name -> dims of every input and output.

    Returns:
        dict(name, ptx, grid, block, shared_mem, extra_args, extra_names, kernel), as SSMScan's ``aot_launch``.
    Raises:
        BackendUnavailable: a dynamic conv_dim or d_conv (the kernel unrolls its taps; its tile follows conv_dim).
    """
    from m2export.plugins import aot

    compile_kernel = compile_kernel or compile_conv_kernel
    conv_dim = aot.constant_size(shapes["weight"][0])
    d_conv = aot.constant_size(shapes["weight"][1])
    if d_conv is None or conv_dim is None:
        raise BackendUnavailable("CausalConv1d AOT plugin: the weight's (conv_dim, d_conv) must be static",
                                 hint="build with the JIT plugin (`plugin='jit'`)")
    kernel = compile_kernel(dtype_name(x_dtype), d_conv, conv_dim, activation == "silu", gpu_code, ptx_isa)
    extras = aot.extra_arg_values(kernel.amap, shapes, kernel.scalars)
    grid = kernel.grid(shapes["x"][0], shapes["x"][1], shapes["x"][2])
    return dict(name=kernel.name, ptx=kernel.ptx, grid=tuple(grid), block=kernel.block, shared_mem=0,
                extra_args=extras, extra_names=kernel.amap.extra_args, kernel=kernel)


def norm_aot_launch(shapes: dict, x_dtype: Any, attrs: dict, *, gpu_code: str, ptx_isa: Tuple[int, int] = None,
                    compile_kernel: Callable = None) -> dict:
    """The norm's ``@aot_impl`` body: x, z, out viewed as (rows, d_inner), rows the product of the leading dims.

    Raises:
        BackendUnavailable: a dynamic d_inner (the tiles are compiled in).
    """
    from m2export.plugins import aot

    compile_kernel = compile_kernel or compile_norm_kernel
    x_shape = list(shapes["x"])
    d_inner = aot.constant_size(x_shape[-1])
    if d_inner is None:
        raise BackendUnavailable("GatedRMSNorm AOT plugin: d_inner (the last dim of x) must be static",
                                 hint="build with the JIT plugin (`plugin='jit'`)")
    problem = cg.GatedNormProblem(rows=AOT_NORM_ROWS, d_inner=d_inner, group_size=attrs["group_size"] or d_inner,
                                  eps=attrs["eps"], norm_before_gate=attrs["norm_before_gate"],
                                  dtype=dtype_name(x_dtype))
    kernel = compile_kernel(problem, gpu_code, ptx_isa)
    rows = _product(x_shape[:-1])
    flat = {"x": (rows, d_inner), "z": (rows, d_inner), "weight": (d_inner,), "out": (rows, d_inner)}
    extras = aot.extra_arg_values(kernel.amap, flat, kernel.scalars)
    return dict(name=kernel.name, ptx=kernel.ptx, grid=tuple(kernel.grid(rows)), block=kernel.block, shared_mem=0,
                extra_args=extras, extra_names=kernel.amap.extra_args, kernel=kernel)


def _checked(kernel):
    """:func:`m2export.plugins.aot.check_target` on the build GPU for an AOT kernel (what TensorRT does on load)."""
    from m2export.plugins import _cuda, aot

    cc_, driver = _cuda.compute_capability(), _cuda.driver_version()
    if aot.gpu_code_for(cc_) != kernel.gpu_code:
        raise InternalError(f"AOT kernel compiled for {kernel.gpu_code} but the current GPU is sm_{cc_[0]}{cc_[1]}")
    aot.check_target(kernel.ptx, cc=cc_, driver=driver, load=_cuda.try_load_module, kernel=kernel.name)
    return kernel


def _aot_return(trtp: Any, launch: dict, what: str):
    params = trtp.KernelLaunchParams()
    params.grid_x, params.grid_y, params.grid_z = launch["grid"]
    params.block_x, params.block_y, params.block_z = launch["block"]
    params.shared_mem = launch["shared_mem"]
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(v) for v in launch["extra_args"]])
    log.debug("%s AOT kernel %s: grid %s, block %s, %d extra args", what, launch["name"], launch["grid"],
              launch["block"], len(launch["extra_args"]))
    return launch["name"], launch["ptx"], params, extra


# ----------------------------------------------------------------------------- registration
_REGISTERED: dict = {}


def register(*, trt: Any = None, trtp: Any = None) -> dict:
    """Register ``m2export::CausalConv1d`` and ``m2export::GatedRMSNorm`` (descriptor, autotune, JIT impl and,
    where TensorRT has AOT Python plugins, AOT impl). Idempotent; ``trt``/``trtp`` injectable for tests.

    Returns:
        ``{"jit": True, "aot": bool}``.
    Raises:
        BackendUnavailable: TensorRT (or ``tensorrt.plugin``) is missing or too old.
    """
    if _REGISTERED:
        return dict(_REGISTERED)
    trt, trtp, has_aot = backends.tensorrt_plugin_api("the CausalConv1d and GatedRMSNorm plugins", trt, trtp)
    from m2export.plugins.ssm_scan_trt import _AOT_OPTIONS

    # ------------------------------------------------------------------ CausalConv1d
    @trtp.register(CONV_PLUGIN_ID)
    def conv_desc(x: trtp.TensorDesc, weight: trtp.TensorDesc, bias: trtp.TensorDesc, conv_state: trtp.TensorDesc,
                  activation: str) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
        y_shape, s_shape = conv_output_shapes(x.shape_expr, weight.shape_expr)
        y_dt, s_dt = output_dtypes(x.dtype, 2)
        return trtp.from_shape_expr(y_shape, dtype=y_dt), trtp.from_shape_expr(s_shape, dtype=s_dt)

    @trtp.autotune(CONV_PLUGIN_ID)
    def conv_autotune(x: trtp.TensorDesc, weight: trtp.TensorDesc, bias: trtp.TensorDesc,
                      conv_state: trtp.TensorDesc, outputs: Tuple[trtp.TensorDesc, trtp.TensorDesc]
                      ) -> List[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(t, "LINEAR") for t in autotune_io_types(cc.OP_NAME)]

    @trtp.impl(CONV_PLUGIN_ID)
    def conv_impl(x: trtp.Tensor, weight: trtp.Tensor, bias: trtp.Tensor, conv_state: trtp.Tensor, activation: str,
                  outputs: Tuple[trtp.Tensor, trtp.Tensor], stream: int) -> None:
        _recorded("CausalConv1d JIT impl", run_conv_jit, (x, weight, bias, conv_state), outputs,
                  conv_activation(activation), stream)

    for fn, extra in ((conv_desc, ()), (conv_impl, ("outputs", "stream"))):
        check_plugin_signature(cc.OP_NAME, _param_names(fn), extra=extra)

    # ------------------------------------------------------------------ GatedRMSNorm
    @trtp.register(NORM_PLUGIN_ID)
    def norm_desc(x: trtp.TensorDesc, z: trtp.TensorDesc, weight: trtp.TensorDesc, group_size: int, eps: float,
                  norm_before_gate: int) -> Tuple[trtp.TensorDesc]:
        (o_shape,) = norm_output_shapes(x.shape_expr)
        return (trtp.from_shape_expr(o_shape, dtype=output_dtypes(x.dtype, 1)[0]),)

    @trtp.autotune(NORM_PLUGIN_ID)
    def norm_autotune(x: trtp.TensorDesc, z: trtp.TensorDesc, weight: trtp.TensorDesc,
                      outputs: Tuple[trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(t, "LINEAR") for t in autotune_io_types(cg.OP_NAME)]

    @trtp.impl(NORM_PLUGIN_ID)
    def norm_impl(x: trtp.Tensor, z: trtp.Tensor, weight: trtp.Tensor, group_size: int, eps: float,
                  norm_before_gate: int, outputs: Tuple[trtp.Tensor], stream: int) -> None:
        _recorded("GatedRMSNorm JIT impl", run_norm_jit, (x, z, weight), outputs,
                  norm_attrs(group_size, eps, norm_before_gate), stream)

    for fn, extra in ((norm_desc, ()), (norm_impl, ("outputs", "stream"))):
        check_plugin_signature(cg.OP_NAME, _param_names(fn), extra=extra)

    if has_aot:
        @trtp.aot_impl(CONV_PLUGIN_ID)
        def conv_aot_impl(x: trtp.TensorDesc, weight: trtp.TensorDesc, bias: trtp.TensorDesc,
                          conv_state: trtp.TensorDesc, activation: str,
                          outputs: Tuple[trtp.TensorDesc, trtp.TensorDesc], tactic: int
                          ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymIntExprs]:
            descs = dict(zip(cc.INPUT_NAMES + cc.OUTPUT_NAMES, (x, weight, bias, conv_state, *outputs)))

            def describe():
                gpu_code, _cc, _driver = build_target()
                return conv_aot_launch({k: v.shape_expr for k, v in descs.items()}, x.dtype,
                                       conv_activation(activation), gpu_code=gpu_code,
                                       ptx_isa=_AOT_OPTIONS["ptx_isa"],
                                       compile_kernel=lambda *a: _checked(compile_conv_kernel(*a)))

            return _aot_return(trtp, _recorded("CausalConv1d AOT impl", describe), "CausalConv1d")

        @trtp.aot_impl(NORM_PLUGIN_ID)
        def norm_aot_impl(x: trtp.TensorDesc, z: trtp.TensorDesc, weight: trtp.TensorDesc, group_size: int,
                          eps: float, norm_before_gate: int, outputs: Tuple[trtp.TensorDesc], tactic: int
                          ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymIntExprs]:
            descs = dict(zip(cg.INPUT_NAMES + cg.OUTPUT_NAMES, (x, z, weight, *outputs)))

            def describe():
                gpu_code, _cc, _driver = build_target()
                return norm_aot_launch({k: v.shape_expr for k, v in descs.items()}, x.dtype,
                                       norm_attrs(group_size, eps, norm_before_gate), gpu_code=gpu_code,
                                       ptx_isa=_AOT_OPTIONS["ptx_isa"],
                                       compile_kernel=lambda *a: _checked(compile_norm_kernel(*a)))

            return _aot_return(trtp, _recorded("GatedRMSNorm AOT impl", describe), "GatedRMSNorm")

        check_plugin_signature(cc.OP_NAME, _param_names(conv_aot_impl), extra=("outputs", "tactic"))
        check_plugin_signature(cg.OP_NAME, _param_names(norm_aot_impl), extra=("outputs", "tactic"))

    _REGISTERED.update(jit=True, aot=has_aot)
    log.debug("registered TensorRT plugins %s, %s (JIT%s)", CONV_PLUGIN_ID, NORM_PLUGIN_ID, " + AOT" if has_aot else "")
    return dict(_REGISTERED)
