"""``export_model``: a Mamba-2 checkpoint -> OUTDIR with prefill/decode ONNX graphs and m2export.json.

Steps (one progress-bar tick each): load the checkpoint in the export dtype; per role (prefill, decode)
trace with ``torch.onnx.export(..., dynamo=True)`` while :class:`Mamba2ModelPatcher` routes every scan
through ``torch.ops.m2export.ssm_scan`` (translated to one ``m2export::SSMScan`` node); attach the
model-local function body; save (external data above 2 GB); for the ``std`` flavour inline the function
(standard ops only); ``onnx.checker`` full check of every file; write the manifest. Everything is written
through :func:`m2export._paths.staged_output`: a temporary sibling of OUTDIR swapped in at the end, so a
failed or interrupted export leaves nothing and the previous export stays intact until the swap.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

from m2export import contract
from m2export import _paths
from m2export.errors import ExportError, Interrupted, InternalError, ParameterError
from m2export.exporter.configs import DECODE_FILE, DTYPES, PREFILL_FILE, Mamba2OnnxConfig
from m2export.exporter.manifest import GraphEntry, Manifest, foreign_reason, write_manifest
from m2export.exporter.genai import write_genai_files
from m2export.exporter.native_ort import to_native_ort
from m2export.names import FLAVOUR_SUFFIX, FLAVOURS, GROUPS, PRIMARY_FLAVOUR, canonical

log = logging.getLogger("m2export")

SSM_IMPL_CHOICES = (*FLAVOURS, *GROUPS)
#: protobuf's hard limit; above it weights go to ``<file>.data`` next to the graph
EXTERNAL_DATA_THRESHOLD = 2 * 1024**3
#: example sizes used for tracing; tests run other sizes to prove the axes are dynamic
EXAMPLE_BATCH, EXAMPLE_SEQ = 2, 7


def graph_file(role: str, ssm_impl: str, primary: bool) -> str:
    """File name of a graph in OUTDIR: model.onnx / decode.onnx (primary), model.std.onnx / decode.std.onnx."""
    base = PREFILL_FILE if role == "prefill" else DECODE_FILE
    return base if primary else base.replace(".onnx", f"{FLAVOUR_SUFFIX[ssm_impl]}.onnx")


def tool_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "onnx", "onnxscript", "onnx-ir", "onnxruntime", "m2export"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


class _GraphModule:
    """Builds the traced callable: forward(input_ids, states) -> (logits, *present states).

    ``states`` is the flat list past_conv_state.0, past_ssm_state.0, past_conv_state.1, ... (the order
    of :meth:`Mamba2OnnxConfig.inputs`).
    """

    @staticmethod
    def make(model):
        import torch

        class GraphModule(torch.nn.Module):
            def __init__(self, m):
                super().__init__()
                self.model = m

            def forward(self, input_ids, states: list):
                out = self.model(input_ids, list(states[0::2]), list(states[1::2]))
                flat = []
                for c, s in zip(out.conv_states, out.ssm_states):
                    flat += [c, s]
                return (out.logits, *flat)

        return GraphModule(model).eval()


def _trace(model, cfg, onnx_cfg: Mamba2OnnxConfig, decode: bool, torch_dtype, opset: int):
    """torch.onnx.export (dynamo) of one role; returns the ONNXProgram (SSMScan nodes, no function yet)."""
    import torch

    from m2export.exporter.patcher import Mamba2ModelPatcher
    from m2export.exporter.ssm_scan_op import custom_translation_table

    batch = torch.export.Dim("batch_size", min=1, max=1 << 16)
    seq = 1 if decode else EXAMPLE_SEQ
    ids = torch.zeros(EXAMPLE_BATCH, seq, dtype=torch.long)
    states = []
    for i in range(cfg.n_layer):
        states.append(torch.zeros(EXAMPLE_BATCH, cfg.conv_dim, cfg.d_conv - 1, dtype=torch_dtype))
        states.append(torch.zeros(EXAMPLE_BATCH, cfg.nheads, cfg.headdim, cfg.d_state, dtype=torch.float32))
    ids_dims = {0: batch} if decode else {0: batch, 1: torch.export.Dim("sequence_length", min=1, max=1 << 20)}
    dyn = {"input_ids": ids_dims, "states": [{0: batch} for _ in states]}
    wrapper = _GraphModule.make(model)
    with Mamba2ModelPatcher(model), torch.no_grad(), warnings.catch_warnings(), \
            contextlib.redirect_stdout(open(os.devnull, "w")):
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(
            wrapper, (ids, states), dynamo=True, opset_version=opset,
            input_names=list(onnx_cfg.inputs(decode)), output_names=list(onnx_cfg.outputs(decode)),
            dynamic_shapes=dyn, custom_translation_table=custom_translation_table(), verbose=False,
            optimize=False)
    _optimize(prog.model)
    return prog


def _optimize(model) -> None:
    """Constant folding + CSE + dead-node removal (onnx_ir passes), in place.

    Used instead of the exporter's default ``optimize=True``, whose pattern rewriter costs about a third
    of the export time of a 24-layer model for a graph that ORT and TensorRT simplify anyway. Functions
    are not inlined here (the SSMScan body is attached afterwards).
    """
    import onnx_ir as ir
    import onnx_ir.passes.common as common
    from onnxscript.optimizer import _constant_folding

    ir.passes.Sequential(
        _constant_folding.FoldConstantsPass(shape_inference=True, input_size_limit=8192, output_size_limit=65536),
        common.RemoveUnusedNodesPass(), common.CommonSubexpressionEliminationPass(), common.RemoveUnusedNodesPass(),
        common.RemoveUnusedOpsetsPass(), common.DeduplicateInitializersPass())(model)


def _attach_function(model, opset: int) -> None:
    """Add the model-local function m2export::SSMScan (and its opset import) to an onnx_ir Model."""
    import onnx_ir as ir

    from m2export.exporter.ssm_scan_op import ssm_scan_function_proto

    fn = ir.serde.deserialize_function(ssm_scan_function_proto(opset))
    model.functions[fn.identifier()] = fn
    model.opset_imports[contract.OP_DOMAIN] = contract.OP_VERSION


def _inline(model) -> None:
    """Replace every SSMScan call by the function body and drop the m2export domain (in place)."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common

    common.InlinePass()(model)
    model.functions.clear()
    _optimize(model)  # folds the (now constant) attribute values and shape arithmetic of the body
    # the body's dtype-polymorphic CastLike(y, x) becomes a plain Cast now that x's dtype is known
    for node in list(model.graph):
        if node.op_type == "CastLike" and node.domain == "" and node.inputs[1].dtype is not None:
            new = ir.node("Cast", [node.inputs[0]], {"to": node.inputs[1].dtype})
            ir.convenience.replace_nodes_and_values(model.graph, node, [node], [new], node.outputs, new.outputs)
    model.opset_imports.pop(contract.OP_DOMAIN, None)
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain == contract.OP_DOMAIN:
            raise InternalError(f"{node.op_type} left in the plugin-free graph after inlining")


def _model_nbytes(model) -> int:
    return sum(int(v.const_value.nbytes) for v in model.graph.initializers.values() if v.const_value is not None)


def _save(model, path: Path) -> list[str]:
    """Save an onnx_ir Model; weights go to ``<name>.data`` when the model exceeds 2 GB. Returns data files."""
    import onnx_ir as ir

    if _model_nbytes(model) > EXTERNAL_DATA_THRESHOLD - 64 * 1024**2:
        data = path.name + ".data"
        ir.save(model, path, external_data=data)
        return [data]
    ir.save(model, path)
    return []


def _check(path: Path) -> None:
    import onnx

    try:
        onnx.checker.check_model(str(path), full_check=True)
    except onnx.checker.ValidationError as e:
        raise ExportError(f"{path.name}: onnx.checker rejected the exported graph: {str(e).splitlines()[0]}") from e


def _rename_dims(model, onnx_cfg: Mamba2OnnxConfig, decode: bool) -> None:
    """Give graph inputs/outputs the symbolic dim names of :class:`Mamba2OnnxConfig`."""
    import onnx_ir as ir

    specs = {**onnx_cfg.inputs(decode), **onnx_cfg.outputs(decode)}
    for v in list(model.graph.inputs) + list(model.graph.outputs):
        want = specs.get(v.name)
        if want is None or v.shape is None:
            continue
        dims = [d if isinstance(d, int) else ir.SymbolicDim(d) for d in want]
        if len(dims) == len(v.shape):
            v.shape = ir.Shape(dims)


def _io_entry(onnx_cfg: Mamba2OnnxConfig, decode: bool, dtype_name: str) -> tuple[dict, dict]:
    def dt(name):
        if name == "input_ids":
            return "int64"
        return "float32" if "ssm_state" in name else dtype_name

    ins = {k: {"dtype": dt(k), "shape": list(v)} for k, v in onnx_cfg.inputs(decode).items()}
    outs = {k: {"dtype": dt(k), "shape": list(v)} for k, v in onnx_cfg.outputs(decode).items()}
    return ins, outs


def export_model(checkpoint: str | os.PathLike, outdir: str | os.PathLike, *, ssm_impl: str = PRIMARY_FLAVOUR,
                 dtype: str = "fp32", opset: int | None = None, force: bool = False, force_foreign: bool = False,
                 allow_nonfinite: bool = False, check: bool = True, progress: bool = False) -> Manifest:
    """Export a Mamba-2 checkpoint to ONNX prefill and decode graphs in ``outdir``.

    Args:
        checkpoint: checkpoint directory (config.json + weights) or weight file, mamba_ssm or HF format.
        outdir: output folder; layout in :mod:`m2export.exporter.manifest`.
        ssm_impl: graph flavour (m2export/names.py): "ssmscan" (one m2export::SSMScan custom-op node per
            layer + its model-local function), "std" (standard ops only), "native" (ONNX Runtime's own
            LinearAttention and CausalConvWithState kernels, opset 27: :mod:`m2export.exporter.native_ort`),
            "both" (ssmscan as model.onnx/decode.onnx, std as model.std.onnx/decode.std.onnx) or "all" (both,
            plus native as model.native.onnx/decode.native.onnx). The old spellings "plugin" and "onnx" are
            accepted with a DeprecationWarning. Every export also writes genai_config.json
            (:mod:`m2export.exporter.genai`) for onnxruntime-genai, and copies the checkpoint's tokenizer files.
        dtype: "fp32" | "fp16" | "bf16": weights and activations; scan internals and ssm states stay fp32.
        opset: default ONNX opset (default :attr:`Mamba2OnnxConfig.DEFAULT_OPSET`).
        force: replace an existing non-empty ``outdir`` that m2export wrote (its manifest says so and it
            holds only m2export's files). Never a symlink, a folder holding the checkpoint's files (through
            symlinks too) or the current directory, nor a non-empty mount point.
        force_foreign: with ``force``, replace ``outdir`` even if m2export did not write it (deletes it).
        allow_nonfinite: export NaN/Inf weights and (fp16/bf16) weights beyond the dtype's range; refused by
            default with the tensor, its first bad index and the value.
        check: run ``onnx.checker.check_model(full_check=True)`` on every written graph.
        progress: show a rich progress bar over the steps.
    Returns:
        The :class:`Manifest` written to ``outdir/m2export.json``.
    Raises:
        ParameterError: a bad ``ssm_impl``, ``dtype`` or ``opset``.
        OutputFolderError: ``outdir`` is a file, not empty without ``force``, unsafe to replace (see ``force``),
            changed during the export, or not writable (full disk included).
        ExportError: the ONNX export itself failed (nothing is left behind).
        CheckpointError, ConfigError: the checkpoint cannot be loaded or its config is unsupported.
        Interrupted: SIGINT/SIGTERM (exit 130/143 in the CLI); nothing is left, the previous export intact.
    """
    ssm_impl = canonical("flavour", ssm_impl)
    if ssm_impl not in SSM_IMPL_CHOICES:
        raise ParameterError(f"`ssm_impl`: expected one of {list(SSM_IMPL_CHOICES)}, got {ssm_impl!r}")
    if dtype not in DTYPES:
        raise ParameterError(f"`dtype`: expected one of {list(DTYPES)}, got {dtype!r}")
    opset = Mamba2OnnxConfig.DEFAULT_OPSET if opset is None else int(opset)
    import onnx

    if not 18 <= opset <= onnx.defs.onnx_opset_version():
        raise ParameterError(f"`opset` {opset}: m2export needs 18 <= opset <= {onnx.defs.onnx_opset_version()} "
                             f"(the newest this onnx {onnx.__version__} knows)", hint="omit `opset` for the default")
    impls = list(GROUPS.get(ssm_impl, [ssm_impl]))
    if "native" in impls and dtype == "bf16":
        raise ParameterError(f"`ssm_impl` {ssm_impl!r} with bf16: the native flavour targets ONNX Runtime's CPU "
                             "kernels, which have no bf16 (MatMul, Conv, LinearAttention)",
                             hint="export fp32 or fp16 for the native flavour, or `ssm_impl` 'both' for bf16")
    roles = ("prefill", "decode")
    n_steps = 1 + len(roles) * (2 + len(impls) * (1 + int(check))) + 1
    bar = _Progress(progress, n_steps)
    from m2export.models.checkpoint import checkpoint_files

    with _paths.staged_output(outdir, force=force, force_foreign=force_foreign, owned=foreign_reason,
                              protect=checkpoint_files(checkpoint)) as tmp, bar, _quiet_third_party_logs():
        import torch

        from m2export.models.checkpoint import load_checkpoint

        torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
        bar.step(f"loading {checkpoint}")
        ck = load_checkpoint(checkpoint, dtype=torch_dtype, allow_nonfinite=allow_nonfinite)
        cfg = ck.config
        onnx_cfg = Mamba2OnnxConfig(cfg)
        graphs: list[GraphEntry] = []
        for role in roles:
            decode = role == "decode"
            bar.step(f"tracing {role} graph (torch.onnx dynamo)")
            prog = _export_step(ck.model, cfg, onnx_cfg, decode, torch_dtype, opset)
            model = prog.model
            _rename_dims(model, onnx_cfg, decode)
            bar.step(f"attaching the SSMScan function to {role}")
            _attach_function(model, opset)
            ins, outs = _io_entry(onnx_cfg, decode, DTYPES[dtype])
            # ssmscan and native (a copy) first: inlining the std flavour mutates the model in place
            for impl in sorted(impls, key=("ssmscan", "native", "std").index):
                primary = impl == impls[0]
                fname = graph_file(role, impl, primary)
                bar.step(f"saving {fname}")
                if impl == "std":
                    _inline(model)
                data = _save(to_native_ort(model, cfg.nheads, cfg.n_layer, _inline) if impl == "native"
                             else model, tmp / fname)
                if check:
                    bar.step(f"onnx.checker full check of {fname}")
                    _check(tmp / fname)
                graphs.append(GraphEntry(role=role, ssm_impl=impl, file=fname, inputs=ins, outputs=outs,
                                         external_data=data))
            del prog, model
        bar.step("writing manifest")
        manifest = Manifest(source_checkpoint=str(Path(checkpoint).resolve()), checkpoint_format=ck.format,
                            checkpoint_sha256=ck.sha256, config=cfg.to_dict(), dtype=dtype, opset=opset,
                            graphs=graphs, tool_versions=tool_versions())
        write_manifest(tmp, manifest)
        write_genai_files(tmp, manifest, checkpoint)
    log.debug("exported %s -> %s (%s)", checkpoint, outdir, ", ".join(g.file for g in graphs))
    return manifest


#: third-party loggers that narrate every pass at INFO (and torch.onnx warns about torchvision) during export
_NOISY_LOGGERS = ("onnx_ir", "onnxscript", "torch.onnx", "torch.export", "torch._export", "torch.fx")


@contextlib.contextmanager
def _quiet_third_party_logs():
    """Raise the noisy loggers to ERROR for the export (left as they are when m2export logs at DEBUG, -vv)."""
    if log.getEffectiveLevel() <= logging.DEBUG:
        yield
        return
    import torch  # noqa: F401  (torch sets its loggers' levels when first imported: import it before changing them)

    saved = {n: logging.getLogger(n).level for n in _NOISY_LOGGERS}
    for n in _NOISY_LOGGERS:
        logging.getLogger(n).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for n, lvl in saved.items():
            logging.getLogger(n).setLevel(lvl)


def _export_step(model, cfg, onnx_cfg, decode, torch_dtype, opset):
    """One torch.onnx export, its failures turned into ExportError (kept as a seam for failure tests)."""
    try:
        prog = _trace(model, cfg, onnx_cfg, decode, torch_dtype, opset)
    except ExportError:
        raise
    except Exception as e:  # torch.export / onnx conversion raise many types
        if _paths.interrupted():  # a fallback caught the Interrupted our signal handler raised: re-raise it
            raise Interrupted(_paths.interrupted()) from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExportError(f"torch.onnx export of the {'decode' if decode else 'prefill'} graph failed: "
                          f"{type(e).__name__}: {first}", hint="rerun with -v for the traceback") from e
    _paths.raise_if_interrupted()  # ... or a fallback caught it and went on: the result does not count
    return prog


class _Progress:
    """rich progress bar over the export steps (no-op when disabled)."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled, total
        self._p: Any = None
        self._task = None

    def __enter__(self):
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._p = Progress(TextColumn("[bold]export[/]"), BarColumn(), MofNCompleteColumn(),
                               TimeElapsedColumn(), TextColumn("{task.description}"), transient=False,
                               console=Console(stderr=True))  # progress on stderr, results on stdout
            self._p.__enter__()
            self._task = self._p.add_task("starting", total=self.total)
        return self

    def step(self, what: str) -> None:
        _paths.raise_if_interrupted()  # every step boundary re-checks: a swallowed interrupt still stops here
        now = time.perf_counter()
        if getattr(self, "_t", None) is not None:
            log.debug("export: %s done in %.1fs", self._what, now - self._t)
        self._t, self._what = now, what
        log.debug("export: %s", what)
        if self._p is not None:
            if self._p.tasks[0].description != "starting":
                self._p.advance(self._task)
            self._p.update(self._task, description=what)

    def __exit__(self, *exc):
        if self._p is not None:
            if exc[0] is None:
                self._p.update(self._task, completed=self.total, description="done")
            self._p.__exit__(*exc)
