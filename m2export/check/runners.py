"""Polygraphy runners and loaders for the three runtimes ``m2export check`` compares.

* :class:`TorchRunner`: the PyTorch reference (:class:`m2export.models.mamba2.Mamba2LMHeadModel`,
  fp32, scan ``m2export.kernels.ssd.naive.ssm_scan_chunked``) behind the same feed-dict interface
  as the exported graphs: ``input_ids`` + every ``past`` state in, ``logits`` + every ``present`` state
  out (names, dtypes and pairing from :class:`m2export.exporter.configs.GraphIO`). Polygraphy's own ``PytRunner`` predates
  ``BaseRunner``'s metadata checks, so we subclass ``BaseRunner`` and fill in only the ``*_impl``.
* :class:`TransformersRunner` (``check --reference transformers``): transformers' own model of an HF-format
  checkpoint (:class:`ModelFromTransformers`) gives the logits; the ``present_*`` states come from
  m2export's PyTorch model (transformers' cache objects do not hold them in the graphs' layout, and their
  decode path is not what an export computes). transformers is never fed a cache: every call is answered
  with one full forward over the sequence's tokens so far (prompt + tokens fed since), found from the
  ``past`` feeds (:class:`TokenHistory`), so no cache mapping is involved.
* ONNX Runtime: Polygraphy's ``OnnxrtRunner`` on a ``SessionFromOnnx`` (CPU provider), one per
  graph flavour present in OUTDIR (:func:`onnxrt_runner`).
* ONNX's reference evaluator: :class:`OnnxReferenceRunner`, for bf16 exports (no bf16 on ORT's CPU
  provider) or on request; slow, complete.
* TensorRT: Polygraphy's ``TrtRunner`` on ``EngineFromBytes`` (:func:`trt_runner`), only where
  ``tensorrt`` imports; ``m2export.plugins`` is imported first so the SSMScan plugin is registered.

Loaders follow Polygraphy's lazy ``XFromY`` convention: constructing one stores configuration,
calling it does the work (:class:`ModelFromCheckpoint`).
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from polygraphy import util as pg_util
from polygraphy.backend.base import BaseLoader, BaseRunner
from polygraphy.common import TensorMetadata

from m2export import backends
from m2export.errors import BackendUnavailable, CheckpointError, RuntimeLoadError
from m2export.exporter.configs import DTYPES, GraphIO
from m2export.exporter.manifest import REEXPORT_HINT
from m2export.exporter.runtime import feed_dtype_of

ROLES = ("prefill", "decode")
log = logging.getLogger(__name__)


class ModelFromCheckpoint(BaseLoader):
    """Lazy loader: ``ModelFromCheckpoint(path)()`` -> :class:`m2export.models.checkpoint.LoadedCheckpoint` (fp32).

    Args:
        checkpoint: checkpoint directory or weight file.
        expected_sha256: when given (the manifest's ``checkpoint_sha256``), a checkpoint whose files hash
            differently raises :class:`CheckpointError`: comparing an export against other weights
            proves nothing.
        share: ``load_checkpoint``'s ``share`` (the check passes :class:`~m2export.check.weights.ExportWeights`:
            tensors bit-equal to the export's mapped weights become views of them; the rest stay the
            checkpoint's; ``LoadedCheckpoint.shared`` says which).
        allow_nonfinite: ``load_checkpoint``'s (the manifest's ``allow_nonfinite``: an export made with
            ``--allow-non-finite-weights`` is compared with the same weights, NaN/Inf included).
    """

    def __init__(self, checkpoint: str | Path, *, expected_sha256: str | None = None, kernel_backend: str = "torch",
                 share=None, allow_nonfinite: bool = False):
        self.checkpoint = Path(checkpoint)
        self.allow_nonfinite = allow_nonfinite
        self.expected_sha256 = expected_sha256
        self.kernel_backend = kernel_backend  # "cutile": the model on the GPU, its Mamba layers on the cuTile kernels
        self.share = share
        self._cache: dict = {}  # loaded once, shared by the prefill and decode runners

    def call_impl(self):
        if "ck" in self._cache:
            return self._cache["ck"]
        import torch

        from m2export.models.checkpoint import load_checkpoint

        ck = load_checkpoint(self.checkpoint, dtype=torch.float32, share=self.share,
                             allow_nonfinite=self.allow_nonfinite)
        if self.expected_sha256 and ck.sha256 != self.expected_sha256:
            raise CheckpointError(
                f"{self.checkpoint}: sha256 {ck.sha256[:12]}... differs from the exported checkpoint's "
                f"{self.expected_sha256[:12]}... (m2export.json)",
                hint="pass the checkpoint the export was made from (`checkpoint`), or re-export")
        ck.model.eval()
        if self.kernel_backend != "torch":  # HybridLM.set_kernel_backend checks it (BackendUnavailable, one line)
            ck.model.cuda().set_kernel_backend(self.kernel_backend)
        self._cache["ck"] = ck
        return ck

    def release(self) -> None:
        """Forget the loaded checkpoint (its memory is freed once no runner holds it); a later call loads again."""
        self._cache.clear()


class TorchRunner(BaseRunner):
    """Runs the PyTorch reference model on exported-graph feed dicts.

    Args:
        model: a :class:`LoadedCheckpoint`, a ``Mamba2LMHeadModel``, or a loader returning either
            (e.g. :class:`ModelFromCheckpoint`). Run in fp32 whatever the export dtype.
        role: "prefill" (``input_ids`` (batch, sequence_length)) or "decode" (``input_ids`` (batch, 1)).
        dtype: export dtype ("fp32" | "fp16" | "bf16"): the model-dtype inputs and outputs (logits, conv
            states, KV caches) are rounded to it, so outputs compare like for like with the graph's; bf16
            travels as float32 (:func:`~m2export.exporter.runtime.feed_dtype_of`).
        name: runner name in reports (default "torch").

    Outputs: ``OrderedDict`` in graph order (:class:`GraphIO` of the model in ``dtype``): ``logits`` (batch,
    seqlen, vocab_size), then every ``present`` state.
    """

    def __init__(self, model, *, role: str = "prefill", dtype: str = "fp32", name: str | None = None):
        super().__init__(name=name or "torch", prefix="torch-runner")
        if role not in ROLES:
            raise ValueError(f"role: expected one of {ROLES}, got {role!r}")
        self._model = model
        self.role, self.dtype = role, dtype
        self._io_dtype = feed_dtype_of(DTYPES[dtype])

    def activate_impl(self):
        import torch

        m, _ = pg_util.invoke_if_callable(self._model)
        self.model = getattr(m, "model", m)  # LoadedCheckpoint -> Mamba2LMHeadModel
        self.model = self.model.float().eval()
        self.cfg = self.model.spec  # the layer-stack description (every family)
        self.io = GraphIO.for_model(self.cfg, self.dtype, decode=self.role == "decode")
        self._torch = torch

    def get_input_metadata_impl(self):
        meta = TensorMetadata()
        for t in self.io.inputs:
            meta.add(t.name, dtype=feed_dtype_of(t.dtype), shape=list(t.shape))
        return meta

    def infer_impl(self, feed_dict):
        from m2export.exporter.export import flat_forward

        torch = self._torch
        dev = self.model.lm_head.weight.device  # the GPU with the cuTile kernel backend, else the CPU
        ids = torch.as_tensor(np.asarray(feed_dict["input_ids"]), dtype=torch.int64).to(dev)
        past = [torch.as_tensor(np.asarray(feed_dict[s.past.name])).float().to(dev) for s in self.io.states]
        start = time.perf_counter()
        with torch.inference_mode():  # no autograd graph, no saved activations
            logits, presents = flat_forward(self.model, ids, past)
            del ids, past
            self.inference_time = time.perf_counter() - start
            res: OrderedDict[str, np.ndarray] = OrderedDict(logits=self._model_dtype(logits))
            del logits
            for s, t in zip(self.io.states, presents):
                res[s.present.name] = (_own_numpy(t.float().cpu(), np.float32) if s.present.dtype == "float32"
                                       else self._model_dtype(t))
        return res

    def _model_dtype(self, t) -> np.ndarray:
        """An fp32 result rounded to the export dtype, as a numpy array of :func:`feed_dtype_of`: what a graph
        computing exactly in that dtype would return (bf16 rounded, then carried as float32)."""
        if self.dtype == "bf16":
            t = t.to(self._torch.bfloat16)
        return _own_numpy(t.float().cpu(), self._io_dtype)  # .cpu(): no copy for a CPU tensor

    def deactivate_impl(self):
        del self.model, self.cfg, self.io, self._torch


def _own_numpy(t, dtype) -> np.ndarray:
    """A CPU tensor as a numpy array of ``dtype`` holding only its own elements: the tensor's memory itself when
    it is contiguous, already ``dtype`` and the whole of its storage (no copy: the logits of a long input are
    hundreds of MB), else a compact copy (a view would keep a larger buffer alive)."""
    a = t.detach().numpy()
    if a.dtype == dtype and t.is_contiguous() and t.untyped_storage().nbytes() == a.nbytes:
        return a
    return a.astype(dtype)


class OnnxReferenceRunner(BaseRunner):
    """Runs an exported graph with ONNX's Python reference evaluator (``onnx.reference.ReferenceEvaluator``).

    Slow but complete: it runs every dtype, bf16 included, where ONNX Runtime's CPU provider has no bf16
    kernels. bf16 tensors cross the runner's boundary as float32 (Polygraphy has no numpy bfloat16): inputs
    are cast to the graph's bfloat16 (``ml_dtypes``), bfloat16 outputs are returned as float32 (exact).

    Args:
        onnx_path: the graph (model-local functions such as SSMScan's are evaluated too).
        name: runner name in reports (default "onnx-reference:<file>").
    """

    def __init__(self, onnx_path: str | Path, *, name: str | None = None):
        p = Path(onnx_path)
        super().__init__(name=name or f"onnx-reference:{p.name}", prefix="onnx-reference-runner")
        self.path = p

    def activate_impl(self):
        import onnx
        from onnx import helper
        from onnx.reference import ReferenceEvaluator

        try:
            model = onnx.load(str(self.path))
        except Exception as e:  # protobuf DecodeError, missing external data, ...
            raise _unloadable(self.path, "ONNX cannot load the graph", e) from None
        self._graph_dtypes = {v.name: helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)
                              for v in model.graph.input}
        self._dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
                      for v in model.graph.input}
        self._outputs = [o.name for o in model.graph.output]
        self.evaluator = ReferenceEvaluator(model)

    def get_input_metadata_impl(self):
        meta = TensorMetadata()
        for name, dt in self._graph_dtypes.items():
            meta.add(name, dtype=np.float32 if dt.name == "bfloat16" else dt, shape=self._dims[name])
        return meta

    def infer_impl(self, feed_dict):
        feed = {k: np.asarray(v).astype(self._graph_dtypes[k]) for k, v in feed_dict.items()}
        start = time.perf_counter()
        with np.errstate(all="ignore"):  # overflow to inf/NaN shows up in the comparison, named, not as warnings
            outs = self.evaluator.run(None, feed)
        self.inference_time = time.perf_counter() - start
        return OrderedDict((n, np.ascontiguousarray(o, dtype=np.float32 if o.dtype.name == "bfloat16" else o.dtype))
                           for n, o in zip(self._outputs, outs))

    def deactivate_impl(self):
        del self.evaluator, self._graph_dtypes, self._dims, self._outputs


def _unloadable(path: Path, what: str, e: Exception) -> RuntimeLoadError:
    first = (str(e).strip().splitlines() or [""])[0]
    return RuntimeLoadError(f"{path}: {what} ({type(e).__name__}: {first})".replace(": )", ")"),
                            hint=f"the file is damaged or not an m2export graph: {REEXPORT_HINT}")


class SharedInitializers:
    """The external-data initializers of an export's graphs, memory-mapped once and handed to every ONNX Runtime
    session of the check (``SessionOptions.add_initializer``), so the weights are in memory once, as page-cache
    pages of ``model.onnx.data``, however many graph flavours are compared.

    Without it every session reads (or maps) the data file for itself and, with its default MatMul prepacking,
    keeps a private packed copy of every weight: two flavours of a 130m export were 1.1 GB of private memory
    for 0.52 GB of weights (benchmarks/RESULTS.md, issue 17). Sessions built with these initializers run with
    prepacking off (``session.disable_prepacking``): the packed copy is what this avoids.

    Only initializers whose external location resolves to a file next to (or under) the graph's folder, with an
    offset and length inside that file and a dtype numpy knows, are shared; anything else is left to ONNX
    Runtime, which loads (or refuses) it as usual. Arrays are read-only views of ``numpy.memmap`` files.
    :meth:`release` drops them (call it after the sessions that use them are gone).
    """

    def __init__(self):
        self._maps: dict[Path, np.ndarray] = {}
        self._arrays: dict[tuple, np.ndarray] = {}
        self._values: dict[tuple, Any] = {}
        self._file_of: dict[int, Path] = {}

    def files(self) -> list[Path]:
        """The data files mapped so far (by :meth:`arrays`)."""
        return list(self._maps)

    def file_of(self, arr: np.ndarray) -> Path | None:
        """The data file an array of :meth:`arrays` is a view of."""
        return self._file_of.get(id(arr))

    def arrays(self, onnx_path: Path) -> dict[str, np.ndarray]:
        """Initializer name -> read-only array (a view of the mapped file) for every shareable external
        initializer of the graph (none for a graph ONNX cannot parse: ONNX Runtime's own load reports it)."""
        import onnx
        from onnx import helper

        try:
            model = onnx.load(str(onnx_path), load_external_data=False)
        except Exception:  # a damaged graph: ONNX Runtime's own load reports it (RuntimeLoadError)
            return {}
        base = onnx_path.parent.resolve()
        out = {}
        for t in model.graph.initializer:
            if t.data_location != onnx.TensorProto.EXTERNAL:
                continue
            info = {e.key: e.value for e in t.external_data}
            try:
                file = (base / info["location"]).resolve()
                offset, length = int(info.get("offset", 0)), int(info["length"])
                dt = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
            except (KeyError, ValueError, TypeError):
                continue
            n = int(np.prod(t.dims, dtype=np.int64)) if len(t.dims) else 1
            if not file.is_relative_to(base) or not file.is_file() or dt.kind not in "fiub" or n * dt.itemsize != length:
                continue
            key = (file, offset, length, dt.str, tuple(t.dims))
            if key not in self._arrays:
                data = self._maps.get(file)
                if data is None:
                    try:
                        data = self._maps[file] = np.memmap(file, dtype=np.uint8, mode="r")
                    except (ValueError, OSError):  # empty ('cannot mmap an empty file') or unreadable: ORT's
                        continue  # own load of the graph reports it (RuntimeLoadError)
                if offset < 0 or offset + length > data.size:
                    continue
                self._arrays[key] = np.frombuffer(data, dtype=dt, count=n, offset=offset).reshape(tuple(t.dims))
                self._file_of[id(self._arrays[key])] = file
            out[t.name] = self._arrays[key]
        return out

    def for_graph(self, onnx_path: Path) -> list[tuple[str, Any]]:
        """(initializer name, ``onnxruntime.OrtValue``) for every shareable external initializer of the graph."""
        import onnxruntime as ort

        out = []
        for name, arr in self.arrays(onnx_path).items():
            key = id(arr)
            if key not in self._values:
                self._values[key] = (arr, ort.OrtValue.ortvalue_from_numpy(arr))
            out.append((name, self._values[key][1]))
        return out

    def release(self) -> None:
        self._values.clear()
        self._file_of.clear()
        self._arrays.clear()
        self._maps.clear()


class _CpuSessionFromOnnx(BaseLoader):
    """An ``onnxruntime.InferenceSession`` on the CPU provider, as Polygraphy's ``SessionFromOnnx(path,
    providers=["cpu"])`` builds it (intra- and inter-op threads = usable CPUs); a graph ONNX Runtime cannot load
    (corrupt file, unknown op, ...) becomes a :class:`RuntimeLoadError` naming the file instead of ORT's
    traceback.

    With ``shared`` (:class:`SharedInitializers`), built to hold as little of its own as it can: the weights are
    ``shared``'s mapped pages (MatMul prepacking off: it would copy them), constant folding is off (it wrote a
    transposed copy of weights used through Transpose nodes: 150 MB per 130m session; ORT's Transpose+MatMul
    fusion reads them in place instead; prefill speed unchanged, measured), and no CPU arena: every tensor of
    a run is allocated from and freed to the process's heap, which the check trims after each compared input
    (:func:`m2export.check.compare.release_freed_memory`). An arena keeps the regions it grew to (a shared,
    shrinking one still ~0.45 GB after each 130m prefill of 2x257 tokens, whose chunks the run's outputs held
    when it shrank); without it the peak of a reference + two-session round on 130m was 1.34-1.45 GB against
    1.61-1.77 GB (2x257, 1x512, 2x257 inputs, CPU here, benchmarks/RESULTS.md). The price is CPU: without an
    arena ONNX Runtime's memory pattern (one planned block for a run's intermediates) is allocated and
    page-faulted anew every run: 557k minor faults, +13% user and +3.3 s sys CPU over three 2x257 runs of a 130m
    session. Turning the pattern off too halves that (+3% user, +1.4 s sys) but raised the peak of the same round
    by ~0.2 GB (1.63 vs 1.43-1.45 GB at 2x257), so it stays on (CPU here, load 6).
    """

    def __init__(self, path: Path, shared: SharedInitializers | None = None):
        self.path = path
        self.shared = shared

    def call_impl(self):
        import os

        import onnxruntime as ort

        try:
            options = ort.SessionOptions()
            threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
            options.intra_op_num_threads = options.inter_op_num_threads = threads
            # fatal only: ORT's own error log (C++ paths, colour codes) repeated, on stderr, the failure that the
            # exception below reports as m2export's one error line (a truncated model.onnx.data in generate)
            options.log_severity_level = 4
            extra = {}
            if self.shared is not None:
                options.add_session_config_entry("session.disable_prepacking", "1")
                options.enable_cpu_mem_arena = False
                for name, value in self.shared.for_graph(self.path):
                    options.add_initializer(name, value)
                extra["disabled_optimizers"] = ["ConstantFolding"]
            return ort.InferenceSession(str(self.path), sess_options=options, providers=["CPUExecutionProvider"],
                                        **extra)
        except Exception as e:
            if not type(e).__module__.startswith("onnxruntime"):
                raise
            raise _unloadable(self.path, "ONNX Runtime cannot load the graph", e) from None


def onnxrt_runner(onnx_path: str | Path, *, name: str | None = None, shared: SharedInitializers | None = None):
    """Polygraphy ``OnnxrtRunner`` on an ONNX Runtime CPU session of ``onnx_path`` (:class:`_CpuSessionFromOnnx`).

    The path (not bytes) is passed so external-data files next to the graph are found; ``shared``: the
    :class:`SharedInitializers` of the folder, so several sessions hold its weights once. A graph ONNX Runtime
    cannot load raises :class:`RuntimeLoadError` (exit 1) when the runner is activated.
    """
    from polygraphy.backend.onnxrt import OnnxrtRunner

    p = Path(onnx_path)
    return OnnxrtRunner(_CpuSessionFromOnnx(p, shared), name=name or f"onnxrt:{p.name}")


class EngineOnce(BaseLoader):
    """Lazy loader that deserialises one engine file once and hands the same ``ICudaEngine`` to every runner
    (the prefill and the decode profile's runner share the engine, so its weights are on the GPU once)."""

    def __init__(self, engine_path: str | Path):
        self.path = Path(engine_path)
        self._engine = None

    def call_impl(self):
        if self._engine is None:
            from polygraphy.backend.common import BytesFromPath
            from polygraphy.backend.trt import EngineFromBytes

            self._engine = EngineFromBytes(BytesFromPath(str(self.path)))()
        return self._engine


def trt_runner(engine_path: str | Path, *, name: str | None = None, profile: int | None = None,
               engine: EngineOnce | None = None):
    """Polygraphy ``TrtRunner`` on the engine at ``engine_path``, using optimization profile ``profile``.

    ``engine``: an :class:`EngineOnce` to share with another runner (e.g. the decode profile's). Registers the
    m2export::SSMScan plugin first (``m2export.plugins.register()``), so the engine can be deserialised.

    Raises:
        BackendUnavailable: ``tensorrt`` is not installed or the plugin cannot be registered (exit code 4).
    """
    backends.require_tensorrt("run TensorRT engines")
    from polygraphy.backend.trt import TrtRunner

    from m2export import plugins

    plugins.register()  # the SSMScan plugin must be registered before the engine is deserialised
    p = Path(engine_path)
    return TrtRunner(engine or EngineOnce(p), name=name or f"trt:{p.name}", optimization_profile=profile)


def trt_runners(outdir: Path, entry, decode_entry=None) -> tuple[object, object | None]:
    """(prefill runner, decode runner or None) of an engine entry of m2export.json: one shared engine, the
    runners on its "prefill" and "decode" optimization profiles (decode None: the engine has no decode
    profile, and its prefill profile serves decode steps too). ``decode_entry``: a separate decode-only
    engine (``model.decode.plan``, seqlen the constant 1) whose runner serves the decode steps instead."""
    shared = EngineOnce(outdir / entry.file)
    pre = trt_runner(outdir / entry.file, name=f"trt:{entry.file}:prefill", profile=entry.profile_index("prefill"),
                     engine=shared)
    dec = None
    if decode_entry is not None and decode_entry.file != entry.file:
        dec = trt_runner(outdir / decode_entry.file, name=f"trt:{decode_entry.file}:decode", profile=0)
    elif "decode" in entry.profile_roles:
        dec = trt_runner(outdir / entry.file, name=f"trt:{entry.file}:decode", profile=entry.profile_index("decode"),
                         engine=shared)
    return pre, dec


# ----------------------------------------------------------------------------------------------- transformers
#: the values of ``m2export check --reference``: the reference every runtime is compared with
REFERENCES = {"torch": "m2export's PyTorch model (fp32)",
              "transformers": "transformers' model of an HF-format checkpoint (fp32) for the logits; states from "
                              "m2export's PyTorch model"}


class TokenHistory:
    """Which tokens produced a set of ``past`` feeds: fingerprint of the state arrays -> (batch, n) token ids.

    A runner that answers from full forwards (:class:`TransformersRunner`) records the tokens behind every set
    of ``present`` outputs it returns; a later feed whose ``past`` arrays are byte-for-byte those outputs (the
    decode loop feeds them back, the data loader's continued feeds are made from them) continues that
    sequence. All-zero past states with empty KV caches are a fresh sequence. Bounded (oldest dropped).
    """

    def __init__(self, limit: int = 256):
        self.limit = limit
        self._map: OrderedDict[bytes, np.ndarray] = OrderedDict()

    @staticmethod
    def fingerprint(arrays) -> bytes:
        import hashlib

        h = hashlib.blake2b(digest_size=20)
        for a in arrays:
            a = np.ascontiguousarray(a)
            h.update(f"{a.dtype.str}{a.shape}".encode())
            h.update(a.tobytes())
        return h.digest()

    def record(self, arrays, tokens: np.ndarray) -> None:
        key = self.fingerprint(arrays)
        self._map[key] = np.array(tokens, dtype=np.int64, copy=True)
        self._map.move_to_end(key)
        while len(self._map) > self.limit:
            self._map.popitem(last=False)

    def lookup(self, arrays, batch: int) -> np.ndarray | None:
        """The tokens behind ``arrays``: (batch, n) (n = 0 for a fresh sequence), or None when unknown."""
        arrays = [np.asarray(a) for a in arrays]
        got = self._map.get(self.fingerprint(arrays))
        if got is not None:
            return got
        if all(not a.any() for a in arrays):
            return np.zeros((batch, 0), np.int64)
        return None


@dataclass
class TransformersReference:
    """What :class:`ModelFromTransformers` loads: ``hf`` (transformers' ``*ForCausalLM``, fp32, eval), ``model``
    (m2export's PyTorch model of the same checkpoint, for the states), the :class:`TokenHistory` shared by
    every runner over it, and ``notes``: where the transformers model was changed to follow mamba_ssm."""

    hf: Any
    model: Any
    ck: Any
    history: TokenHistory
    notes: list[str]

    @property
    def spec(self):
        return self.ck.spec


class ModelFromTransformers(BaseLoader):
    """Lazy loader: ``ModelFromTransformers(path)()`` -> :class:`TransformersReference` (loaded once).

    Where transformers is known to differ from the checkpoint's own code (mamba_ssm), the reference follows
    mamba_ssm, and each change is one line of :attr:`TransformersReference.notes` (shown in the report):

    * dt clamped at ``time_step_min`` (an initialisation bound) in transformers' chunked prefill path only
      (``self.time_step_limit = (config.time_step_min, inf)``: Zamba2 in transformers 5.24 and 5.25, Nemotron-H
      in 5.24; Nemotron-H in 5.25 uses the config's ``time_step_limit``, as mamba_ssm does): found by the
      mixers' ``time_step_limit`` being (time_step_min, inf) and not the checkpoint's dt limit, whatever the
      family or version; those mixers get the config's ``time_step_limit`` (default (0, inf)), as mamba_ssm (and
      transformers' own decode step) use. A transformers that does not clamp is left as it is, with no note.
    * Gated RMSNorm with ngroups > 1 (Mamba2, Granite 4.0-H, Bamba): mamba_ssm normalises per group of
      d_inner / ngroups channels; transformers releases before the per-group ``MambaRMSNormGated`` normalised
      over all d_inner channels. A gated norm whose ``group_size`` is not d_inner / ngroups, or that has no
      group size at all, is made to normalise per group (transformers 5.24 and 5.25 already do: no change, no note).

    Args:
        checkpoint: an HF-format checkpoint directory (config.json with ``model_type``; safetensors).
        m2export_reference: the :class:`ModelFromCheckpoint` of the same checkpoint (its sha256 check applies).
    Raises (when called):
        CheckpointError: a mamba_ssm-format checkpoint (transformers has no loader for it), or transformers'
            vocabulary differs from the checkpoint's embedding; BackendUnavailable: transformers not installed.
    """

    def __init__(self, checkpoint: str | Path, m2export_reference: ModelFromCheckpoint):
        self.checkpoint = Path(checkpoint)
        self.m2export_reference = m2export_reference
        self._cache: dict = {}

    def call_impl(self) -> TransformersReference:
        if "ref" in self._cache:
            return self._cache["ref"]
        ck = self.m2export_reference()
        if ck.format == "mamba_ssm":
            raise CheckpointError(f"{self.checkpoint}: `reference` transformers needs an HF-format checkpoint; this "
                                  "one is in the state-spaces/mamba_ssm layout (config.json with d_model/ssm_cfg), "
                                  "which transformers does not load", hint="use the default reference (torch)")
        try:
            import torch
            import transformers
        except ImportError as e:
            raise BackendUnavailable(f"`reference` transformers: transformers is not installed ({e})",
                                     hint="pip install transformers (it comes with m2export's test extra)") from None
        try:
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(ck.path), dtype=torch.float32)
        except Exception as e:  # transformers raises many types for a config or weights it cannot use
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise CheckpointError(f"{ck.path}: transformers {transformers.__version__} cannot load the checkpoint "
                                  f"({type(e).__name__}: {first})", hint="use the default reference (torch)") from None
        hf = hf.float().eval()
        spec = ck.spec
        width = hf.get_output_embeddings().weight.shape[0]
        if width != spec.vocab_size:
            raise CheckpointError(f"{ck.path}: transformers' lm_head has {width} rows, m2export's model "
                                  f"{spec.vocab_size}: the logits cannot be compared")
        notes = follow_mamba_ssm_(hf, spec)
        ref = TransformersReference(hf=hf, model=ck.model, ck=ck, history=TokenHistory(), notes=notes)
        self._cache["ref"] = ref
        return ref

    def release(self) -> None:
        """Forget both loaded models (see :meth:`ModelFromCheckpoint.release`)."""
        self._cache.clear()
        self.m2export_reference.release()


def follow_mamba_ssm_(hf, spec) -> list[str]:
    """Change ``hf`` (a transformers model of ``spec``) in place where transformers differs from mamba_ssm (see
    :class:`ModelFromTransformers`); returns one note per kind of change made (none: nothing differed)."""
    import types

    notes = []
    mamba = [spec.layers[i].mamba for i in spec.mamba_layers]
    if not mamba:
        return notes
    dt_limit = mamba[0].dt_limit
    # transformers' clamp at the initialisation bound: a mixer whose prefill limit is (time_step_min, inf)
    # where the checkpoint's limit is another (any other limit of transformers' is left alone: it would be a
    # difference of m2export's config reading, for the comparison to show)
    step_min = getattr(hf.config, "time_step_min", None)
    bound = None if step_min is None else (float(step_min), math.inf)
    clamped = [m for m in hf.modules() if bound is not None and bound != dt_limit
               and isinstance(getattr(m, "time_step_limit", None), (tuple, list)) and len(m.time_step_limit) == 2
               and tuple(float(v) for v in m.time_step_limit) == bound]
    for m in clamped:
        m.time_step_limit = dt_limit
    if clamped:
        notes.append(f"dt limit {bound} (time_step_min) of transformers' prefill path set to the config's "
                     f"{dt_limit} in {len(clamped)} mixer(s), as mamba_ssm and transformers' decode step apply it")
    want = mamba[0].norm_group_size
    fixed = 0
    for m in hf.modules():
        if not type(m).__name__.endswith("RMSNormGated") or m.weight.shape[0] % want:
            continue
        d = m.weight.shape[0]
        if hasattr(m, "n_groups"):  # Falcon-H1's norm: groups given by count
            if m.n_groups != d // want:
                m.n_groups, fixed = d // want, fixed + 1
        elif hasattr(m, "group_size"):
            if m.group_size != want:
                m.group_size, fixed = want, fixed + 1
        elif d != want:  # a full-width gated norm without a group size (older transformers)
            m.forward, fixed = types.MethodType(_per_group_gated_norm(want), m), fixed + 1
    if fixed:
        notes.append(f"gated RMSNorm of {fixed} mixer(s) normalised per group of {want} channels (mamba_ssm), "
                     "where this transformers normalised over all d_inner channels")
    return notes


def _per_group_gated_norm(group_size: int):
    """forward(hidden_states, gate=None) of mamba_ssm's RMSNormGated (norm after the gate), per group."""

    def forward(self, hidden_states, gate=None):
        import torch
        import torch.nn.functional as F

        dtype = hidden_states.dtype
        x = hidden_states.float()
        if gate is not None:
            x = x * F.silu(gate.float())
        g = x.reshape(*x.shape[:-1], -1, group_size)
        eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
        return (self.weight.float() * g.reshape(x.shape)).to(dtype)

    return forward


class TransformersRunner(TorchRunner):
    """``check --reference transformers``: logits from transformers, states from m2export's PyTorch model.

    Each call: the tokens so far are found from the ``past`` feeds (:class:`TokenHistory`; a feed whose
    states no call of a runner over the same :class:`ModelFromTransformers` returned, and that is not a fresh
    sequence, is refused), transformers runs one full forward (no cache) over them + ``input_ids``, and the
    last ``sequence_length`` positions are the ``logits`` output (rounded to the export dtype as
    :class:`TorchRunner`'s are). Every ``present`` state is m2export's PyTorch model's, as with the torch
    reference. Slower than the torch reference: a decode step re-reads the whole sequence.

    Args: as :class:`TorchRunner`, with ``model`` a :class:`ModelFromTransformers` (or what it returns).
    """

    def __init__(self, model, *, role: str = "prefill", dtype: str = "fp32", name: str | None = None):
        super().__init__(model, role=role, dtype=dtype, name=name or "transformers")

    def activate_impl(self):
        super().activate_impl()
        self.ref, _ = pg_util.invoke_if_callable(self._model)

    def infer_impl(self, feed_dict):
        torch = self._torch
        ids = np.asarray(feed_dict["input_ids"], dtype=np.int64)
        past = [feed_dict[s.past.name] for s in self.io.states]
        before = self.ref.history.lookup(past, ids.shape[0])
        if before is None or before.shape[0] != ids.shape[0]:
            raise RuntimeLoadError("transformers reference: a feed continues states this reference did not produce "
                                   "(transformers takes tokens, not m2export's states)",
                                   hint="feed states the reference returned, or use the default reference (torch)")
        res = super().infer_impl(feed_dict)
        tokens = np.concatenate([before, ids], axis=1)
        start = time.perf_counter()
        with torch.inference_mode():
            logits = self.ref.hf(input_ids=torch.from_numpy(tokens), use_cache=False).logits[:, -ids.shape[1]:]
            self.inference_time += time.perf_counter() - start
            res["logits"] = self._model_dtype(logits.float())
            del logits
        self.ref.history.record([res[s.present.name] for s in self.io.states], tokens)
        return res

    def deactivate_impl(self):
        super().deactivate_impl()
        del self.ref


class ModelLayoutStates(BaseRunner):
    """``runner`` (an exported graph's) seen with its states in the model's layout: the one place the check turns
    a flavour's state layout (:attr:`~m2export.exporter.configs.StateIO.layout`, e.g. the native flavour's
    ssm_state (batch, nheads, d_state, headdim)) into the PyTorch reference's, so feeds and outputs compare name by
    name. ``past`` feeds are transposed into the graph's layout, ``present`` outputs back (one transpose each,
    of the states only); everything else passes through. ``io``: the graph's GraphIO (its manifest entry's)."""

    def __init__(self, runner, io):
        super().__init__(name=runner.name, prefix="model-layout-runner")
        self.runner = runner
        self._past = {s.past.name: s for s in io.states if s.perm is not None}
        self._present = {s.present.name: s for s in io.states if s.perm is not None}

    def activate_impl(self):
        self.runner.activate()

    def get_input_metadata_impl(self):
        meta = TensorMetadata()
        for name, (dtype, shape) in self.runner.get_input_metadata(use_numpy_dtypes=False).items():
            s = self._past.get(name)
            if s is not None and shape is not None:
                shape = [shape[i] for i in np.argsort(s.perm)]
            meta.add(name, dtype=dtype, shape=shape)
        return meta

    def infer_impl(self, feed_dict):
        feed = OrderedDict((k, self._past[k].to_graph_layout(np.asarray(v)) if k in self._past else v)
                           for k, v in feed_dict.items())
        out = self.runner.infer(feed, check_inputs=False)
        self.inference_time = self.runner.last_inference_time()
        return OrderedDict((k, self._present[k].to_model_layout(v) if k in self._present else v)
                           for k, v in out.items())

    def deactivate_impl(self):
        self.runner.deactivate()


def reference_runner(reference, *, role: str = "prefill", dtype: str = "fp32", name: str | None = None):
    """The runner of a check reference: :class:`TransformersRunner` over a :class:`ModelFromTransformers`,
    else :class:`TorchRunner`."""
    cls = TransformersRunner if isinstance(reference, (ModelFromTransformers, TransformersReference)) else TorchRunner
    return cls(reference, role=role, dtype=dtype, name=name)
