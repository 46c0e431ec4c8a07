"""``export_model``: a Mamba-2 checkpoint -> OUTDIR with one ONNX graph per flavour and m2export.json.

One graph serves prefill and decode (``sequence_length`` 1 is a decode step; the past states are inputs):
measured on a mamba2-130m-shaped checkpoint (ORT CPU, 1 thread, batch 1, L=1, best of 60 interleaved
runs), the prefill graph took 108.8 ms (ssmscan flavour) / 157.0 ms (std) where the separately traced
decode graph took 107.4 / 142.3 ms: within the run-to-run noise of that loaded machine (medians 128 vs 121
/ 197 vs 197 ms), so the second graph (and its copy of the weights) bought nothing.

Steps (one progress-bar tick each): load the checkpoint in the export dtype; compose the graph
(:mod:`m2export.exporter.stamp`): the embedding, Mamba-2 layers, final norm and head built node by node
(:mod:`m2export.exporter.build`; one ``m2export::SSMScan`` node per layer), any other piece traced with
``torch.onnx.export(..., dynamo=True)`` while :class:`Mamba2ModelPatcher` routes every scan through
``torch.ops.m2export.ssm_scan``, once per distinct layer kind, every layer stamped from its kind's trace with
its own weights; optimise the composed graph when something was traced (constant folding, CSE); attach the model-local
function body; save; for the ``std`` flavour inline the function (standard ops only); ``onnx.checker``
full check of every file; write the manifest. Weights are stored once, in ``model.onnx.data``
(:class:`SharedWeights`), which every graph of the folder references (both flavours included). Everything
is written through :func:`m2export._paths.staged_output`: a temporary sibling of OUTDIR swapped in at the
end, so a failed or interrupted export leaves nothing and the previous export stays intact until the swap.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
import warnings
from pathlib import Path
from typing import Any

from m2export import contract
from m2export import _paths
from m2export.check import console
from m2export.errors import ExportError, Interrupted, InternalError, M2ExportError, ParameterError, UsageError
from m2export.exporter.configs import (BATCH, DTYPES, GRAPH_ROLE, PAST_SEQ, PREFILL_FILE, SEQ,
                                       WEIGHTS_FILE, GraphIO)
from m2export.exporter.manifest import GraphEntry, Manifest, aux_record, foreign_reason, write_manifest
from m2export.exporter.genai import TOKENIZER_FILES, write_genai_files
from m2export.exporter.fused_ops import RMS_NORMALIZATION_OPSET, rms_normalization
from m2export.exporter.native_ort import to_native_ort
from m2export.names import FLAVOUR_SUFFIX, FLAVOURS, GROUPS, PRIMARY_FLAVOUR, canonical

log = logging.getLogger("m2export")

SSM_IMPL_CHOICES = (*FLAVOURS, *GROUPS)
#: example sizes used for tracing; tests run other sizes to prove the axes are dynamic
EXAMPLE_BATCH, EXAMPLE_SEQ, EXAMPLE_PAST = 2, 7, 5


def graph_file(ssm_impl: str, primary: bool) -> str:
    """File name of a graph in OUTDIR: model.onnx (primary flavour), model.std.onnx / model.native.onnx (others)."""
    return PREFILL_FILE if primary else PREFILL_FILE.replace(".onnx", f"{FLAVOUR_SUFFIX[ssm_impl]}.onnx")


def tool_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "onnx", "onnxscript", "onnx-ir", "onnxruntime", "m2export"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def flat_forward(model, input_ids, past: list):
    """``(logits, presents)``: the model called with its states as one flat list in :class:`GraphIO` state order.

    A model with its own ``forward_states(input_ids, past) -> (logits, presents)`` (the layer-stack models)
    answers for itself; a pure Mamba-2 model's flat order is conv_state.0, ssm_state.0, conv_state.1, ...
    """
    own = getattr(model, "forward_states", None)
    if callable(own):
        return own(input_ids, list(past))
    out = model(input_ids, list(past[0::2]), list(past[1::2]))
    flat = []
    for c, s in zip(out.conv_states, out.ssm_states):
        flat += [c, s]
    return out.logits, flat


class _GraphModule:
    """Builds the traced callable: forward(input_ids, states) -> (logits, *present states), states in the
    order of :attr:`GraphIO.states`."""

    @staticmethod
    def make(model):
        import torch

        class GraphModule(torch.nn.Module):
            def __init__(self, m):
                super().__init__()
                self.model = m

            def forward(self, input_ids, states: list):
                logits, presents = flat_forward(self.model, input_ids, states)
                return (logits, *presents)

        return GraphModule(model).eval()


def torch_dtype(onnx_dtype: str):
    """torch dtype of an ONNX dtype name (float32, float16, bfloat16, int64)."""
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
            "int64": torch.int64}[onnx_dtype]


def example_inputs(io: GraphIO):
    """(input_ids, states, dynamic_shapes) for tracing: sizes EXAMPLE_*, dims named by ``io``."""
    import torch

    dims = {BATCH: torch.export.Dim(BATCH, min=1, max=1 << 16),
            SEQ: torch.export.Dim(SEQ, min=1, max=1 << 20),
            PAST_SEQ: torch.export.Dim("past_sequence_length", min=0, max=1 << 20)}
    ids = torch.zeros(EXAMPLE_BATCH, EXAMPLE_SEQ, dtype=torch.long)
    states = [torch.zeros(s.past.concrete(batch_size=EXAMPLE_BATCH, past_sequence_length=EXAMPLE_PAST),
                          dtype=torch_dtype(s.past.dtype)) for s in io.states]
    dyn_ids = {k: dims[d] for k, d in enumerate(io.input("input_ids").shape) if isinstance(d, str)}
    dyn_states = [{k: dims[d] for k, d in enumerate(s.past.shape) if isinstance(d, str)} for s in io.states]
    return ids, states, {"input_ids": dyn_ids, "states": dyn_states}


def _trace(model, io: GraphIO, opset: int, *, build_pieces: bool = True):
    """The ONNX graph of one model (onnx_ir Model; SSMScan nodes, no function yet), optimised.

    Composed piecewise (:func:`m2export.exporter.stamp.trace_stamped`): the pieces with a builder
    (:mod:`m2export.exporter.build`) built directly, the others traced once per distinct layer kind and
    stamped with every layer's weights; a model without that structure is traced whole. The patcher, the
    shared torchlib registry and the optimisation passes are entered only when something is traced (a built
    graph has nothing to fold: a pure Mamba-2 export never imports torch.export's tracer or onnxscript).
    ``build_pieces=False`` traces every piece (tests compare both)."""
    from m2export.exporter.stamp import CannotStamp, trace_stamped

    with contextlib.ExitStack() as stack:
        entered = []

        def trace_module(*args):
            if not entered:  # first trace: patch the mixers, share one registry
                from m2export.exporter.patcher import Mamba2ModelPatcher

                stack.enter_context(Mamba2ModelPatcher(model))
                stack.enter_context(_one_torchlib_registry())
                entered.append(True)
            return _trace_module(*args)

        try:
            model_ir, traced = trace_stamped(model, io, opset, trace_module, build_pieces=build_pieces)
        except CannotStamp as e:
            log.debug("export: tracing the whole model (%s)", e)
            ids, states, dyn = example_inputs(io)
            model_ir, traced = trace_module(_GraphModule.make(model), (ids, states), dyn, io.input_names(),
                                            io.output_names(), opset), 1
    if traced:
        _optimize(model_ir)
        _share_tied_embedding(model_ir)
    return model_ir


@contextlib.contextmanager
def _one_torchlib_registry():
    """Inside the block, every ``torch.onnx.export`` starts from one torchlib registry per opset.

    Each ``torch.onnx.export`` call builds ``ONNXRegistry.from_torchlib`` afresh (torch 2.13:
    ``torch/onnx/_internal/exporter/_compat.py``): ~2 s of CPU per call here, paid once per traced piece
    (embedding, head, each layer kind). The registry is built once; each call gets a copy of its
    ``functions`` table (target -> list of decompositions), so the custom translations one call registers
    (``register_op`` inserts into those lists) never reach another. Where torch's layout differs (another
    torch version), nothing is patched and every call builds its own, as before.
    """
    try:
        from torch.onnx._internal.exporter import _registration
    except ImportError:
        yield
        return
    cls = getattr(_registration, "ONNXRegistry", None)
    orig = getattr(cls, "__dict__", {}).get("from_torchlib")
    if not isinstance(orig, classmethod):
        yield
        return
    built: dict[Any, Any] = {}

    def from_torchlib(klass, *args, **kwargs):
        key = (klass, args, tuple(sorted(kwargs.items())))
        if key not in built:
            built[key] = orig.__func__(klass, *args, **kwargs)
        reg = built[key]
        copy = klass.__new__(klass)
        copy.__dict__.update(reg.__dict__)
        copy.functions = {k: list(v) for k, v in reg.functions.items()}
        return copy

    cls.from_torchlib = classmethod(from_torchlib)
    try:
        yield
    finally:
        cls.from_torchlib = orig


def _trace_module(module, args: tuple, dynamic_shapes, input_names: list[str], output_names: list[str],
                  opset: int):
    """One ``torch.onnx.export`` (dynamo) of ``module(*args)``, no optimisation; returns the onnx_ir Model.
    Called inside :class:`Mamba2ModelPatcher` (every mixer's scan routed through SSMScan)."""
    import torch

    from m2export.exporter.ssm_scan_op import custom_translation_table

    with torch.no_grad(), warnings.catch_warnings(), \
            contextlib.redirect_stdout(open(os.devnull, "w")):
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(
            module, args, dynamo=True, opset_version=opset, input_names=input_names, output_names=output_names,
            dynamic_shapes=dynamic_shapes, custom_translation_table=custom_translation_table(), verbose=False,
            optimize=False)
    _portable_stack_traces(prog.model)
    return prog.model


#: the node metadata key under which torch.onnx records the Python stack that created a node
STACK_TRACE_KEY = "pkg.torch.onnx.stack_trace"
_FRAME_FILE = re.compile(r'File "([^"]+)"')


def portable_path(path: str) -> str:
    """A source path as recorded in an export: relative to the checkout for m2export's own files
    (``m2export/exporter/stamp.py``), from ``site-packages/`` for installed packages, else the file name alone.
    Keeps exports of one model equal across checkouts and machines, and keeps the exporting user's
    directories out of files that travel."""
    parts = Path(path).parts
    if "site-packages" in parts:
        return "/".join(("site-packages",) + parts[parts.index("site-packages") + 1:])
    package_root = Path(__file__).resolve().parents[2]  # the folder holding m2export/
    try:
        return Path(path).resolve().relative_to(package_root).as_posix()
    except ValueError:
        return Path(path).name


def _portable_stack_traces(model) -> None:
    """Rewrite, in place, the file paths in every traced node's stack-trace metadata with
    :func:`portable_path` (torch.onnx writes absolute paths)."""
    import onnx_ir as ir

    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        trace = node.metadata_props.get(STACK_TRACE_KEY)
        if trace:
            node.metadata_props[STACK_TRACE_KEY] = _FRAME_FILE.sub(
                lambda m: f'File "{portable_path(m.group(1))}"', trace)


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


def _share_tied_embedding(model) -> None:
    """Keep a tied embedding once: lm_head's ``MatMul(h, Transpose(W))`` is constant-folded into a second
    initializer ``W^T``, so ``W`` (the embedding) and ``W^T`` would both be stored. Where a ``Gather(W, ids)``
    has an initializer equal to ``W^T`` beside it, it becomes ``Transpose(Gather(W^T, ids, axis=1))`` (same
    values: columns of W^T are rows of W) and ``W`` drops out of the graph (in place)."""
    import numpy as np
    import onnx_ir as ir
    import onnx_ir.passes.common as common

    inits = model.graph.initializers
    by_shape: dict[tuple, list] = {}
    for v in inits.values():
        if v.const_value is not None and v.shape is not None and len(v.shape) == 2:
            by_shape.setdefault((v.dtype, tuple(v.shape)), []).append(v)
    changed = False
    for node in list(model.graph):
        if node.op_type != "Gather" or node.domain != "" or node.attributes.get_int("axis", 0) != 0:
            continue
        w, ids = node.inputs[0], node.inputs[1]
        if w is None or w.name not in inits or w.const_value is None or w.shape is None or len(w.shape) != 2 \
                or ids is None or ids.shape is None:
            continue
        cands = by_shape.get((w.dtype, (w.shape[1], w.shape[0])), [])
        a = w.const_value.numpy() if cands else None
        wt = next((c for c in cands if np.array_equal(c.const_value.numpy(), a.T)), None)
        if wt is None:
            continue
        rank = len(ids.shape)
        g = ir.node("Gather", [wt, ids], {"axis": 1})  # (d, *ids)
        t = ir.node("Transpose", g.outputs, {"perm": [*range(1, rank + 1), 0]})
        ir.convenience.replace_nodes_and_values(model.graph, node, [node], [g, t], node.outputs, t.outputs)
        changed = True
    if changed:
        common.RemoveUnusedNodesPass()(model)


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


class SharedWeights:
    """One external-data file for every graph of an export folder: each distinct weight is written once.

    :meth:`externalize` moves a model's initializers of at least ``threshold`` bytes into the file (64-byte
    aligned, deduplicated by dtype, shape and content) and points them there as external tensors, so
    ``onnx_ir.save`` writes only references; a second graph with the same weights (the standard-op flavour
    inlined from the plugin one) reuses the stored bytes. Small tensors stay inline.

    Each tensor is written from its own buffer (:class:`_Bits`: a checkpoint tensor straight from its
    memory-mapped safetensors file; a folded transpose in blocks of at most :data:`_Bits.BLOCK` bytes), never
    as a ``tobytes`` copy of the whole tensor; content equality is decided by a sample of elements and
    confirmed by an exact comparison (with the stored bytes read back), never by hashing every tensor.
    """

    ALIGN = 64

    def __init__(self, folder: Path, name: str = WEIGHTS_FILE, threshold: int = 1024, pages=None):
        """``pages``: the :class:`~m2export.models.checkpoint.MappedWeights` of a mapped checkpoint load: each
        :meth:`externalize` first releases every page of it (what building and rewriting the graph read; one
        sampled element maps a whole 2 MB page-cache folio) and then each tensor's pages once its bytes are
        written or found stored, so an export holds one weight resident at a time, not all of them."""
        self.folder, self.name, self.threshold = Path(folder), name, threshold
        self.pages = pages
        self._f = open(self.folder / name, "w+b")
        self._index: dict[tuple, list[tuple[int, int]]] = {}

    def externalize(self, model) -> bool:
        """Point ``model``'s large initializers into the shared file; True if any initializer refers to it."""
        import onnx_ir as ir

        used = False
        if self.pages is not None:
            self.pages.release_all()
        for v in model.graph.initializers.values():
            t = v.const_value
            if t is None or t.nbytes < self.threshold:
                continue
            used = True
            if isinstance(t, ir.ExternalTensor) and Path(t.location).name == self.name:
                continue
            bits = _Bits(t)
            key = bits.key()
            slot = next((s for s in self._index.get(key, []) if bits.equals_file(self._f, *s)), None)
            if slot is None:
                self._f.seek(0, os.SEEK_END)
                self._f.write(b"\0" * (-self._f.tell() % self.ALIGN))
                off = self._f.tell()
                for block in bits.blocks():
                    self._f.write(block)
                slot = (off, self._f.tell() - off)
                self._index.setdefault(key, []).append(slot)
            if self.pages is not None:
                self.pages.release(bits.view)
            off, n = slot
            v.const_value = ir.ExternalTensor(self.name, off, n, t.dtype, shape=t.shape, name=v.name,
                                              base_dir=str(self.folder))
        self._f.flush()
        return used

    def close(self) -> None:
        self._f.close()


class _Bits:
    """The stored bytes of one onnx_ir tensor, read in place where its layout allows.

    For an ``onnx_ir`` tensor over a numpy array or a torch tensor (the exporter's initializers: checkpoint
    tensors, constant-folded values) in a byte-addressable dtype, on a little-endian machine: ``view`` is the
    array reinterpreted as unsigned integers of its item size (bit patterns, so equality is byte equality:
    -0.0 differs from 0.0, a NaN equals the same NaN), without a copy. Anything else (4-bit types, strings,
    a big-endian host) goes through the tensor's own ``tobytes()``.
    """

    #: largest block written (or compared) at once when the array is not contiguous: bounds the temporary copy
    #: (one buffer, reused for every block of a tensor: a 130m native export peaked at +134 MB over its
    #: pre-save RSS with 64 MB blocks, two of them alive at once; 1.07 -> 0.95 GiB with one 16 MB buffer)
    BLOCK = 16 << 20
    #: elements sampled for :meth:`key`
    SAMPLE = 64

    def __init__(self, t):
        import math
        import sys

        import numpy as np
        import onnx_ir as ir

        self.dtype, self.shape = t.dtype, tuple(t.shape)
        view = None
        if sys.byteorder == "little" and isinstance(t, (ir.Tensor, ir.ExternalTensor)) and t.dtype.bitwidth >= 8:
            try:
                a = t.numpy()
            except Exception:  # a dtype numpy cannot hold: use tobytes below
                a = None
            if isinstance(a, np.ndarray) and a.dtype.byteorder in "=|<" and a.itemsize * 8 == t.dtype.bitwidth \
                    and a.shape == self.shape:
                view = a.view(f"u{a.itemsize}")
        if view is None:
            data = np.frombuffer(t.tobytes(), dtype=np.uint8)
            n = t.dtype.bitwidth // 8
            view = data.view(f"u{n}").reshape(self.shape) if t.dtype.bitwidth % 8 == 0 and n in (1, 2, 4, 8) \
                and data.size == n * math.prod(self.shape) else data
        self.view = view.reshape(1) if view.ndim == 0 else view

    def key(self) -> tuple:
        """(dtype, shape, bytes, sampled elements): equal tensors have equal keys."""
        import numpy as np

        a = self.view
        idx = np.unravel_index(np.linspace(0, a.size - 1, min(a.size, self.SAMPLE)).astype(np.int64), a.shape) \
            if a.size else ()
        return self.dtype, self.shape, a.nbytes, a[idx].tobytes() if a.size else b""

    def blocks(self):
        """The bytes in C order, as buffers of at most :data:`BLOCK` bytes (views where contiguous). A
        non-contiguous array (a folded transpose) is copied block by block into one buffer that every block
        reuses: each yielded buffer is valid until the next one is asked for (write or compare it first)."""
        import numpy as np

        a = self.view
        if a.flags.c_contiguous:
            flat = memoryview(a.reshape(-1).view(np.uint8))
            for i in range(0, len(flat), self.BLOCK):
                yield flat[i:i + self.BLOCK]
            return
        rows = max(1, self.BLOCK // max(1, a[0].nbytes))  # a is at least 1-D and non-empty here
        buf = np.empty((min(rows, a.shape[0]), *a.shape[1:]), dtype=a.dtype)
        for i in range(0, a.shape[0], rows):
            part = buf[:min(rows, a.shape[0] - i)]
            np.copyto(part, a[i:i + rows])
            yield memoryview(part.reshape(-1).view(np.uint8))

    def equals(self, other: "_Bits") -> bool:
        """Byte equality with another tensor (compared in blocks of rows: no whole-tensor temporary)."""
        import numpy as np

        a, b = self.view, other.view
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.ndim == 0 or a.size == 0:
            return bool(np.array_equal(a, b))
        rows = max(1, self.BLOCK // max(1, a[0].nbytes))
        return all(np.array_equal(a[i:i + rows], b[i:i + rows]) for i in range(0, a.shape[0], rows))

    def equals_file(self, f, offset: int, n: int) -> bool:
        """Byte equality with the ``n`` bytes at ``offset`` of the open file ``f``."""
        if n != self.view.nbytes:
            return False
        f.flush()
        f.seek(offset)
        for b in self.blocks():
            if f.read(len(b)) != b:
                return False
        return True


def _merge_equal_initializers(model, pages=None) -> int:
    """Make initializers of equal dtype, shape and content one initializer, used by all their consumers
    (subgraphs included); returns how many were dropped. The tracer folds ``Transpose(weight)`` once per call
    site, so a module called more than once (Zamba2's shared blocks) would otherwise hold one copy of its
    matrices per call in the graph, and in ONNX Runtime's or TensorRT's memory, even where the file stores the
    bytes once. Graph inputs and outputs are left alone. The first initializer (in graph order) of equal ones
    is kept. Candidates are found by :meth:`_Bits.key` (dtype, shape, sampled elements) and confirmed by an
    exact comparison of their bytes: no tensor is copied or hashed whole. ``pages`` (the export's
    :class:`~m2export.models.checkpoint.MappedWeights`): each tensor's checkpoint pages are released once sampled
    or compared (one sampled element maps a whole page-cache folio, up to 2 MB: sampling a just-written 130m
    checkpoint mapped 0.48 GB of it)."""
    import onnx_ir as ir

    seen: dict[tuple, list] = {}
    slots: dict[tuple, object] = {}
    dropped = 0
    for name, v in list(model.graph.initializers.items()):
        t = v.const_value
        if t is None or v.is_graph_input() or v.is_graph_output():
            continue
        if isinstance(t, ir.ExternalTensor):
            # already in an external-data file (a second flavour's graph after the first was saved): the same
            # slot is the same bytes, so no byte is read back (reading maps and touches the whole tensor, which
            # made a three-flavour Zamba2 export peak at 2x its weights); different slots are left apart (in
            # SharedWeights' file equal contents share one slot, so nothing is missed there)
            key = (str(t.path), t.offset, t.length, t.dtype, tuple(t.shape))
            keep = slots.setdefault(key, v)
        else:
            bits = _Bits(t)
            same = seen.setdefault(bits.key(), [])
            keep = next((k for k, kb in same if kb.equals(bits)), None)
            if pages is not None:
                pages.release(bits.view)
                for _, kb in same:  # compared (a whole read when the samples matched)
                    pages.release(kb.view)
            if keep is None:
                same.append((v, bits))
                keep = v
            del bits, same
        if keep is not v:
            v.replace_all_uses_with(keep)
            del model.graph.initializers[name]
            dropped += 1
    del seen, slots
    _release_mapped(model)
    return dropped


def _release_mapped(model) -> None:
    """Close the file mappings that reading external initializers opened (each maps the whole file)."""
    import onnx_ir as ir

    for v in model.graph.initializers.values():
        if isinstance(v.const_value, ir.ExternalTensor):
            try:
                v.const_value.release()
            except BufferError:  # an array over the mapping is still alive somewhere: leave it to the GC
                pass


def _save(model, path: Path, weights: SharedWeights) -> list[str]:
    """Save an onnx_ir Model with its weights in the shared file (equal initializers merged first). Returns
    the external-data files it uses."""
    import onnx_ir as ir

    _merge_equal_initializers(model, weights.pages)
    used = weights.externalize(model)
    _merge_equal_initializers(model, weights.pages)  # an in-memory tensor equal to one already stored now shares its slot
    ir.save(model, path)
    return [weights.name] if used else []


def _check(path: Path) -> None:
    import onnx

    try:
        onnx.checker.check_model(str(path), full_check=True)
    except onnx.checker.ValidationError as e:
        raise ExportError(f"{path.name}: onnx.checker rejected the exported graph: {str(e).splitlines()[0]}") from e


def _rename_dims(model, io: GraphIO) -> None:
    """Give graph inputs/outputs the symbolic dim names of :class:`GraphIO`."""
    import onnx_ir as ir

    specs = {t.name: t.shape for t in (*io.inputs, *io.outputs)}
    for v in list(model.graph.inputs) + list(model.graph.outputs):
        want = specs.get(v.name)
        if want is None or v.shape is None:
            continue
        dims = [d if isinstance(d, int) else ir.SymbolicDim(d) for d in want]
        if len(dims) == len(v.shape):
            v.shape = ir.Shape(dims)


def export_model(checkpoint: str | os.PathLike, outdir: str | os.PathLike, *, ssm_impl: str = PRIMARY_FLAVOUR,
                 dtype: str = "fp32", opset: int | None = None, force: bool = False, force_foreign: bool = False,
                 allow_nonfinite: bool = False, check: bool = True, progress: bool = False,
                 packed_prefill: bool = False) -> Manifest:
    """Export a Mamba-2 or hybrid checkpoint to one ONNX graph per flavour (serving prefill and decode) in ``outdir``.

    Args:
        checkpoint: checkpoint directory (config.json + weights) or weight file, mamba_ssm or HF format.
        outdir: output folder; layout in :mod:`m2export.exporter.manifest`.
        ssm_impl: graph flavour (m2export/names.py): "ssmscan" (one m2export::SSMScan custom-op node per
            layer + its model-local function), "std" (standard ops only), "native" (ONNX Runtime's own
            LinearAttention and CausalConvWithState kernels, opset 27: :mod:`m2export.exporter.native_ort`),
            "both" (ssmscan as model.onnx, std as model.std.onnx) or "all" (both, plus native as
            model.native.onnx); one weights file for all of them. The old spellings "plugin" and "onnx" are
            accepted with a DeprecationWarning. Every export also writes genai_config.json
            (:mod:`m2export.exporter.genai`) for onnxruntime-genai, and copies the checkpoint's tokenizer files.
        dtype: "fp32" | "fp16" | "bf16": weights and activations; scan internals and ssm states stay fp32.
        opset: default ONNX opset (default :attr:`GraphIO.DEFAULT_OPSET`).
        force: replace an existing non-empty ``outdir`` that m2export wrote (its manifest says so and it
            holds only m2export's files); the current directory is replaced in place (the folder kept).
            Never a symlink, a folder holding the checkpoint's files (through symlinks too) or holding the
            current directory, nor a non-empty mount point.
        force_foreign: with ``force``, replace ``outdir`` even if m2export did not write it (deletes it); never
            the current directory.
        allow_nonfinite: export NaN/Inf weights and (fp16/bf16) weights beyond the dtype's range; refused by
            default with the tensor, its first bad index and the value.
        check: run ``onnx.checker.check_model(full_check=True)`` on every written graph.
        progress: show a rich progress bar over the steps.
        packed_prefill: also write ``model.packed.onnx`` (:mod:`m2export.exporter.packed`): several sequences of
            different lengths prefilled in one call (tokens packed in a batch of one, ``cu_seqlens`` offsets,
            states per sequence), one ``m2export::SSMScanPacked`` node per layer; pure Mamba-2 models in
            fp32/fp16 only (ParameterError otherwise, before anything is exported).
    Returns:
        The :class:`Manifest` written to ``outdir/m2export.json``.
    Raises:
        UsageError: a bad ``ssm_impl``, ``dtype`` or ``opset`` (or native or ``packed_prefill`` with bf16).
        OutputFolderError: ``outdir`` is a file, not empty without ``force``, unsafe to replace (see ``force``),
            changed during the export, or not writable (full disk included).
        ExportError: the ONNX export itself failed (nothing is left behind).
        CheckpointError, ConfigError: the checkpoint cannot be loaded or its config is unsupported; a checkpoint
            file changed (written in place) during the export, which read it until the end (nothing is written).
        Interrupted: SIGINT/SIGTERM (exit 130/143 in the CLI); nothing is left, the previous export intact.
    """
    ssm_impl = canonical("flavour", ssm_impl)
    if ssm_impl not in SSM_IMPL_CHOICES:
        raise UsageError(f"`ssm_impl`: expected one of {list(SSM_IMPL_CHOICES)}, got {ssm_impl!r}")
    if dtype not in DTYPES:
        raise UsageError(f"`dtype`: expected one of {list(DTYPES)}, got {dtype!r}")
    opset = GraphIO.DEFAULT_OPSET if opset is None else int(opset)
    import onnx

    from m2export.exporter.configs import MIN_OPSET

    if not MIN_OPSET <= opset <= onnx.defs.onnx_opset_version():
        raise UsageError(f"`opset` {opset}: m2export needs {MIN_OPSET} <= opset <= {onnx.defs.onnx_opset_version()} "
                         f"(the newest this onnx {onnx.__version__} knows)", hint="omit `opset` for the default")
    impls = list(GROUPS.get(ssm_impl, [ssm_impl]))
    if "native" in impls and dtype == "bf16":
        raise UsageError(f"`ssm_impl` {ssm_impl!r} with bf16: the native flavour targets ONNX Runtime's CPU "
                         "kernels, which have no bf16 (MatMul, Conv, LinearAttention)",
                         hint="export fp32 or fp16 for the native flavour, or `ssm_impl` 'both' for bf16")
    if packed_prefill:  # its dtype rule holds whatever the checkpoint: refused before loading it
        from m2export.exporter.build import BUILT_DTYPES

        if torch_dtype(DTYPES[dtype]) not in BUILT_DTYPES:
            raise UsageError(f"`packed_prefill` with {dtype}: the packed prefill graph is built in fp32 or fp16 "
                             "only",
                             hint="export fp32 or fp16 for model.packed.onnx, or drop `packed_prefill` for bf16")
    n_steps = 1 + 2 + (len(impls) + int(packed_prefill)) * (1 + int(check)) + 1
    bar = _Progress(progress, n_steps)
    from m2export.models.checkpoint import checkpoint_files, file_stamps, unchanged_since

    sources = checkpoint_files(checkpoint)
    stamps = file_stamps(sources)  # before the load: the weights are read from their mappings until the end
    with _paths.staged_output(outdir, force=force, force_foreign=force_foreign, owned=foreign_reason,
                              protect=sources) as tmp, bar, console.quiet_third_party(loggers=True), \
            contextlib.ExitStack() as held:
        from m2export.models.checkpoint import load_checkpoint

        bar.step(f"loading {checkpoint}")
        # mapped: the weights leave resident memory once checked, and again as each is written; each file under
        # a read lease, given up when this block ends (a truncation meanwhile: CheckpointError, no SIGBUS)
        ck = load_checkpoint(checkpoint, dtype=torch_dtype(DTYPES[dtype]), allow_nonfinite=allow_nonfinite,
                             mapped=True)
        if ck.pages is not None:
            held.callback(ck.pages.close)
        if packed_prefill:
            from m2export.exporter.packed import check_packable

            check_packable(ck.model)
        graphs: list[GraphEntry] = []
        io = GraphIO.for_model(ck.spec, dtype)
        bar.step("building the graph")
        model = _export_step(ck.model, io, opset)
        _rename_dims(model, io)
        bar.step("attaching the SSMScan function")
        _attach_function(model, opset)
        if ck.pages is not None:
            ck.pages.release_all()  # what building the graph read (one traced layer kind, constants folded)
        weights = SharedWeights(tmp, pages=ck.pages)
        try:
            # ssmscan and native (a copy) first: inlining the std flavour mutates the model in place
            for impl in sorted(impls, key=("ssmscan", "native", "std").index):
                fname = graph_file(impl, impl == impls[0])
                bar.step(f"saving {fname}")
                if impl == "std":
                    _inline(model)
                    if opset >= RMS_NORMALIZATION_OPSET:
                        rms_normalization(model)
                graph_io = GraphIO.for_model(ck.spec, dtype, flavour=impl)  # the flavour's state layouts
                data = _save(_native(model, ck.spec, graph_io) if impl == "native" else
                             _fused(model, ck.spec) if impl == "ssmscan" else model, tmp / fname, weights)
                if check:
                    bar.step(f"onnx.checker full check of {fname}")
                    _check(tmp / fname)
                graphs.append(GraphEntry(role=GRAPH_ROLE, ssm_impl=impl, file=fname, external_data=data,
                                         **graph_io.to_manifest()))
            if packed_prefill:
                graphs.append(_save_packed(ck.model, io, opset, tmp, weights, bar, check))
        finally:
            weights.close()
        del model
        tokenizer = [f for f in TOKENIZER_FILES if (Path(ck.path) / f).is_file()]  # copied by write_genai_files
        bar.step("writing manifest")
        manifest = Manifest(source_checkpoint=str(Path(checkpoint).resolve()), checkpoint_format=ck.format,
                            checkpoint_sha256=ck.sha256, config=_manifest_config(ck), dtype=dtype, opset=opset,
                            graphs=graphs, tool_versions=tool_versions(), tokenizer=tokenizer,
                            allow_nonfinite=bool(allow_nonfinite))
        manifest.files = aux_record(tmp, write_genai_files(tmp, manifest, checkpoint))  # ours: --force replaces them
        write_manifest(tmp, manifest)
        unchanged_since(stamps)
        if ck.pages is not None:
            ck.pages.check()
    log.debug("exported %s -> %s (%s)", checkpoint, outdir, ", ".join(g.file for g in graphs))
    return manifest


def _save_packed(torch_model, io: GraphIO, opset: int, tmp: Path, weights, bar, check: bool) -> GraphEntry:
    """Build, save (shared weights) and check the packed prefill graph; its manifest entry."""
    import onnx_ir as ir

    from m2export.exporter.packed import PACKED_FILE, PACKED_ROLE, build_packed
    from m2export.exporter.ssm_scan_op import ssm_scan_packed_function_proto

    bar.step(f"saving {PACKED_FILE}")
    model, pio = build_packed(torch_model, io, opset)
    _attach_function(model, opset)
    fn = ir.serde.deserialize_function(ssm_scan_packed_function_proto(opset))
    model.functions[fn.identifier()] = fn
    data = _save(model, tmp / PACKED_FILE, weights)
    if check:
        bar.step(f"onnx.checker full check of {PACKED_FILE}")
        _check(tmp / PACKED_FILE)
    return GraphEntry(role=PACKED_ROLE, ssm_impl=PRIMARY_FLAVOUR, file=PACKED_FILE, external_data=data,
                      **pio.to_manifest())


def base_graph(checkpoint: str | os.PathLike, *, dtype: str = "fp32", opset: int | None = None):
    """The onnx_ir model every flavour of an export is made from (SSMScan nodes + their function, the conv and the
    gated norms as standard ops; weights in memory): what :func:`export_model` saves as the ssmscan flavour before
    :func:`~m2export.exporter.fused_ops.fuse_ops`, and what the native and std flavours rewrite. For tests of those
    rewrites."""
    from m2export.models.checkpoint import load_checkpoint

    opset = GraphIO.DEFAULT_OPSET if opset is None else int(opset)
    ck = load_checkpoint(checkpoint, dtype=torch_dtype(DTYPES[dtype]))
    io = GraphIO.for_model(ck.spec, dtype)
    model = _export_step(ck.model, io, opset)
    _rename_dims(model, io)
    _attach_function(model, opset)
    return model


def _fused(model, spec):
    """The ssmscan-flavour copy of ``model`` (:func:`~m2export.exporter.fused_ops.fuse_ops`): each Mamba layer's conv
    as one ``m2export::CausalConv1d`` node and its gated RMSNorm as one ``m2export::GatedRMSNorm``, where the
    graph has the pattern (a layer that does not keeps its standard ops: the graph stays correct)."""
    from m2export.exporter.fused_ops import fuse_ops

    out, n_conv, n_norm = fuse_ops(model)
    log.debug("ssmscan flavour: %d CausalConv1d, %d GatedRMSNorm nodes for %d Mamba layers", n_conv, n_norm,
              len(spec.mamba_layers))
    return out


def _native(model, spec, io):
    """The native-flavour copy of ``model`` (:func:`to_native_ort`) with the state layouts of ``io`` (the native
    flavour's GraphIO): every Mamba mixer of ``spec`` must have the same number of heads (LinearAttention's
    ``q_num_heads`` attribute lives in the shared function body)."""
    heads = {spec.layers[i].mamba.nheads for i in spec.mamba_layers}
    if len(heads) != 1:
        raise ParameterError(f"`ssm_impl` native: the Mamba layers have different head counts {sorted(heads)}; "
                             "the native flavour needs one", hint="export the ssmscan or std flavour")
    n_conv = sum(1 for i in spec.mamba_layers if spec.layers[i].mamba.d_conv > 1)  # d_conv 1: no conv state
    return to_native_ort(model, heads.pop(), len(spec.mamba_layers), _inline, io, n_conv)


def _manifest_config(ck) -> dict[str, Any]:
    """What m2export.json records of the model: Mamba2Config.to_dict() for Mamba-2 checkpoints, the
    checkpoint's own config.json (non-finite floats decoded) for hybrid families, re-read by
    :meth:`Manifest.model_config`."""
    import json

    from m2export.models.families import decode_hf_floats

    if ck.config is not None:
        return ck.config.to_dict()
    return decode_hf_floats(json.loads((Path(ck.path) / "config.json").read_text()))


#: third-party loggers that narrate every pass at INFO (and torch.onnx warns about torchvision) during export
def _export_step(model, io, opset):
    """One torch.onnx export, its failures turned into ExportError (kept as a seam for failure tests)."""
    try:
        prog = _trace(model, io, opset)
    except ExportError:
        raise
    except Exception as e:  # torch.export / onnx conversion raise many types
        if _paths.interrupted():  # a fallback caught the Interrupted our signal handler raised: re-raise it
            raise Interrupted(_paths.interrupted()) from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExportError(f"torch.onnx export of the graph failed: "
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
            elif issubclass(exc[0], M2ExportError):  # bad input: its error line alone (it names the file/field)
                if self._p.console.is_terminal:
                    self._p.live.transient = True  # the bar is erased
                else:
                    self._p.console.quiet = True  # a log: the bar's final state is not printed
            self._p.__exit__(*exc)
