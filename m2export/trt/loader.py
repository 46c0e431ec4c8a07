"""Polygraphy-style loader: ONNX file -> TensorRT network, strongly typed, with the SSMScan plugin mode set.

Polygraphy's ``NetworkFromOnnxPath`` cannot set the network creation flags that choose between a
Python plugin's JIT and AOT implementations (``PREFER_JIT_PYTHON_PLUGINS`` /
``PREFER_AOT_PYTHON_PLUGINS``), so this loader creates the network itself and otherwise behaves like
Polygraphy's loaders: the constructor stores configuration, calling it does the work and returns
``(builder, network, parser)`` for ``EngineBytesFromNetwork``.

It also makes sure the plugin was really used: TensorRT >= 10.7 prefers a registered plugin over the
model-local ONNX function of the same name (model.onnx carries SSMScan both ways), but without the
plugin it silently inlines the function. The number of SSMScan plugin layers must equal the number of
SSMScan nodes, else the build fails naming the cause.
"""

from __future__ import annotations

import logging
from pathlib import Path

from polygraphy.backend.base import BaseLoader

from m2export import contract
from m2export.errors import BackendUnavailable, BuildError, InternalError

log = logging.getLogger(__name__)

PLUGIN_MODES = ("jit", "aot")


def count_plugin_nodes(onnx_path: str | Path) -> int:
    """Nodes of the main graph of ``onnx_path`` that a registered m2export plugin implements (SSMScan, SSMScanPacked,
    CausalConv1d, GatedRMSNorm; weights not loaded): the plugin layers the parsed network must have."""
    import onnx

    from m2export import contract_conv1d, contract_gated_norm

    ops = {contract.OP_NAME, contract.PACKED_OP_NAME, contract_conv1d.OP_NAME, contract_gated_norm.OP_NAME}
    model = onnx.load(str(onnx_path), load_external_data=False)
    return sum(1 for n in model.graph.node if n.op_type in ops and n.domain == contract.OP_DOMAIN)


def count_ssm_scan_nodes(onnx_path: str | Path) -> int:
    """SSMScan nodes (domain m2export) in the main graph of ``onnx_path`` (weights not loaded)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    return sum(1 for n in model.graph.node if n.op_type == contract.OP_NAME and n.domain == contract.OP_DOMAIN)


def network_flags(trt, plugin_mode: str | None) -> int:
    """Network creation flags: strongly typed (TensorRT 10; always on and deprecated in 11) + plugin mode.

    Raises:
        BackendUnavailable: ``plugin_mode="aot"`` on a TensorRT without AOT Python plugins.
    """
    flag_enum = trt.NetworkDefinitionCreationFlag
    flags = 0
    major = int(str(trt.__version__).split(".")[0])
    if major < 11:
        flags |= 1 << int(flag_enum.STRONGLY_TYPED)
    if plugin_mode is not None:
        name = f"PREFER_{plugin_mode.upper()}_PYTHON_PLUGINS"
        flag = getattr(flag_enum, name, None)
        if flag is None:
            if plugin_mode == "aot":
                raise BackendUnavailable(f"TensorRT {trt.__version__} has no AOT Python plugins ({name})",
                                         hint="use `plugin='jit'`, or install a newer TensorRT")
        else:
            flags |= 1 << int(flag)
    return flags


def format_parser_errors(parser, onnx_path: str | Path) -> str:
    """One line per ONNX parser error, naming the failing node and its operator."""
    lines = []
    for i in range(parser.num_errors):
        err = parser.get_error(i)
        node = err.node_name() if hasattr(err, "node_name") else ""
        op = err.node_operator() if hasattr(err, "node_operator") else ""
        where = f"node {node!r} (op {op})" if node or op else f"node #{err.node()}"
        lines.append(f"{where}: {err.desc()}")
    return f"TensorRT cannot parse {onnx_path}: " + "; ".join(lines or ["unknown parser error"])


def pin_input_shapes(network, shapes: dict[str, tuple[int, ...]]) -> None:
    """Set the shapes of the named network inputs (-1: dynamic), e.g. ``input_ids`` to (-1, 1) for a
    decode-only engine. Raises BuildError naming an input the network does not have."""
    have = {network.get_input(i).name: network.get_input(i) for i in range(network.num_inputs)}
    for name, shape in shapes.items():
        if name not in have:
            raise BuildError(f"cannot fix the shape of input {name!r}: the network's inputs are {sorted(have)}")
        have[name].shape = tuple(shape)


class NetworkFromOnnxPathWithPlugin(BaseLoader):
    """Parse ``path`` into a strongly typed network with the SSMScan plugin in ``plugin_mode``.

    ``plugin_mode`` None: the graph must have no SSMScan node (the ``std`` flavour, ``.std.onnx``).
    ``input_shapes``: input name -> shape to fix after parsing (:func:`pin_input_shapes`).
    """

    def __init__(self, path: str | Path, *, plugin_mode: str | None, input_shapes: dict | None = None):
        if plugin_mode is not None and plugin_mode not in PLUGIN_MODES:
            raise ValueError(f"plugin_mode: expected one of {PLUGIN_MODES} or None, got {plugin_mode!r}")
        self.path = Path(path)
        self.plugin_mode = plugin_mode
        self.input_shapes = dict(input_shapes or {})

    def call_impl(self):
        import tensorrt as trt
        from polygraphy.backend.trt import util as trt_util

        path = self.path
        expected = count_ssm_scan_nodes(path)
        if expected and self.plugin_mode is None:
            raise InternalError(f"{self.path}: has {expected} SSMScan node(s) but no plugin mode was given")
        builder = trt.Builder(trt_util.get_trt_logger())
        network = builder.create_network(network_flags(trt, self.plugin_mode if expected else None))
        parser = trt.OnnxParser(network, trt_util.get_trt_logger())
        if not parser.parse_from_file(str(path)):
            msg = format_parser_errors(parser, self.path)
            hint = None
            if contract.OP_NAME in msg:
                from m2export import plugins

                hint = ("the SSMScan plugin is not registered: " + (plugins.unavailable_reason() or "?")
                        + "; or build the std flavour (export both flavours (`ssm_impl='both'`), then build *.std.onnx)")
            raise BuildError(msg, hint=hint)
        pin_input_shapes(network, self.input_shapes)
        plugin_layers = sum(1 for i in range(network.num_layers)
                            if network.get_layer(i).type == trt.LayerType.PLUGIN_V3)
        expected = count_plugin_nodes(path) if expected else 0  # SSMScan and the conv / gated-norm nodes
        if expected and plugin_layers < expected:
            raise BackendUnavailable(
                f"{self.path}: TensorRT imported {expected - plugin_layers} of {expected} m2export node(s) "
                f"without their plugin (as the ONNX local function); an m2export plugin was not found",
                hint="import m2export.plugins before building (m2export build does), with TensorRT >= 10.7")
        log.debug("%s: %d layers, %d plugin layer(s) for %d SSMScan node(s)", self.path,
                  network.num_layers, plugin_layers, expected)
        return builder, network, parser
