"""Running an export: sessions, feeds and the one decode loop, for every runtime.

Everything that runs a model call by call goes through here: ``m2export check`` (PyTorch reference, ONNX
Runtime, ONNX's reference evaluator, TensorRT, all as Polygraphy runners), ``m2export generate``, the tests
and the benchmarks.

* :class:`Decoder`: the graph I/O (:class:`~m2export.exporter.configs.GraphIO`) plus a prefill and a decode
  callable ``infer(feed_dict) -> outputs`` (an activated Polygraphy runner's ``infer``, or
  :class:`SessionInfer` over an ONNX Runtime session). It builds the zero feeds, feeds each call's
  ``present`` outputs back as the next call's ``past`` inputs, and runs :meth:`Decoder.run_sequence`, the
  only prefill-then-decode loop in m2export (the next token is chosen by a callback: greedy, sampled, or
  forced to a reference's token).
* :class:`OrtModel`, :func:`ort_generate_greedy`: an export folder in ONNX Runtime (works on the manifest
  only, never on a torch model).

bfloat16: ONNX Runtime's CPU execution provider has no bfloat16 kernels for the ops these graphs use
(ORT 1.32: "Could not find an implementation for MatMul(13)"), so a bf16 export cannot be run on CPU;
:func:`ort_session` raises :class:`~m2export.errors.BackendUnavailable` saying so instead of failing deep
inside ORT. ``providers=["onnx.reference"]`` runs any export (bf16 included) with ONNX's Python reference
evaluator instead: slow, for tiny models and tests.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from m2export.errors import BackendUnavailable, ParameterError
from m2export.exporter.configs import GraphIO
from m2export.exporter.manifest import read_manifest

REFERENCE_PROVIDER = "onnx.reference"


def _np_dtypes() -> dict[str, Any]:
    out = {"float32": np.float32, "float16": np.float16, "int64": np.int64}
    try:
        import ml_dtypes  # a dependency of onnx

        out["bfloat16"] = ml_dtypes.bfloat16
    except ImportError:  # pragma: no cover
        pass
    return out


NP_DTYPES = _np_dtypes()


def numpy_dtype(onnx_dtype: str, *, bf16_as_float32: bool = False):
    """numpy dtype of an ONNX dtype name (int64, float32, float16, bfloat16).

    ``bf16_as_float32``: bfloat16 tensors travel as float32 (Polygraphy's runners have no numpy bfloat16;
    the bf16 runners cast at their boundary); otherwise ml_dtypes' bfloat16 (ONNX Runtime, reference evaluator).
    """
    if onnx_dtype == "bfloat16" and bf16_as_float32:
        return np.float32
    return NP_DTYPES[onnx_dtype]


def feed_dtype_of(onnx_dtype: str):
    """:func:`numpy_dtype` for Polygraphy feed dicts (bf16 carried as float32)."""
    return numpy_dtype(onnx_dtype, bf16_as_float32=True)


class ReferenceSession:
    """``onnx.reference.ReferenceEvaluator`` behind the ``InferenceSession.run(names, feeds)`` interface."""

    def __init__(self, path: str | os.PathLike):
        import onnx
        from onnx.reference import ReferenceEvaluator

        model = onnx.load(str(path))
        self._outputs = [o.name for o in model.graph.output]
        self._ev = ReferenceEvaluator(model)

    def run(self, names, feeds):
        outs = dict(zip(self._outputs, self._ev.run(None, feeds)))
        return [outs[n] for n in (names or self._outputs)]


def ort_session(path: str | os.PathLike, *, providers: Sequence[str] | None = None, threads: int | None = None,
                dtype: str | None = None):
    """An ``onnxruntime.InferenceSession`` (CPU by default) for an exported graph file.

    ``dtype`` (the export's fp32|fp16|bf16, if known) lets bf16-on-CPU fail early with a clear error.
    ``providers=["onnx.reference"]``: a :class:`ReferenceSession` (ONNX's Python reference evaluator).
    """
    providers = list(providers or ["CPUExecutionProvider"])
    if providers == [REFERENCE_PROVIDER]:
        return ReferenceSession(path)
    import onnxruntime as ort

    if dtype == "bf16" and providers == ["CPUExecutionProvider"]:
        raise BackendUnavailable(
            f"{Path(path).name}: a bf16 export does not run on ONNX Runtime's CPUExecutionProvider (no bfloat16 "
            "MatMul/Conv kernels)", hint="run bf16 graphs with TensorRT or ORT's CUDA provider, with "
            f"providers=['{REFERENCE_PROVIDER}'] (slow, tiny models), or export with `dtype='fp16'`")
    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), sess_options=so, providers=providers)


class SessionInfer:
    """``infer(feed_dict) -> OrderedDict`` over a session with ``run(names, feeds)`` (ORT or reference)."""

    def __init__(self, session, output_names: Sequence[str]):
        self.session, self.output_names = session, list(output_names)

    def infer(self, feed_dict: Mapping[str, Any]) -> "OrderedDict[str, Any]":
        return OrderedDict(zip(self.output_names, self.session.run(self.output_names, dict(feed_dict))))


@dataclass
class Step:
    """One call of :meth:`Decoder.run_sequence`: ``index`` 0 is the prefill, k > 0 the k-th decode step.
    ``next_tokens`` (batch,) int64: the tokens chosen after it (None after the last call)."""

    index: int
    outputs: "OrderedDict[str, Any]"
    seconds: float
    next_tokens: np.ndarray | None = None


@dataclass
class Decoder:
    """Run one model (any runtime) call by call through its graph I/O.

    Args:
        io: the graph I/O (prefill form: ``sequence_length`` dynamic).
        prefill: ``infer(feed_dict) -> outputs`` for prompts.
        decode: the same for one-token steps (default: ``prefill``, one graph serving both).
        np_dtype: ONNX dtype name -> numpy dtype of the feeds this runtime takes (default ml_dtypes'
            bfloat16; :func:`feed_dtype_of` for Polygraphy runners).
    """

    io: GraphIO
    prefill: Callable[[Mapping[str, Any]], Mapping[str, Any]]
    decode: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None
    np_dtype: Callable[[str], Any] = field(default=numpy_dtype)
    last_seconds: float = field(default=0.0, init=False)

    def zero_feeds(self, batch: int) -> "OrderedDict[str, Any]":
        """Fresh-sequence ``past`` inputs for ``batch`` sequences (see :meth:`GraphIO.zero_feeds`)."""
        return self.io.zero_feeds(batch, self.np_dtype)

    def feeds(self, input_ids, past: Mapping[str, Any] | None = None) -> "OrderedDict[str, Any]":
        """The full feed dict for ``input_ids`` (batch, seqlen) continuing ``past`` (None: a fresh sequence).

        Raises:
            ParameterError: ``input_ids`` is not 2-D or has seqlen 0 (every call needs a token: the module
                docstring of :mod:`m2export.exporter.configs`).
        """
        ids = np.ascontiguousarray(np.asarray(input_ids, dtype=np.int64))
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ParameterError(f"`input_ids` of shape {ids.shape}: expected (batch, sequence_length) with "
                                 "sequence_length >= 1 (an empty prompt has no token to continue from)")
        feed: OrderedDict[str, Any] = OrderedDict(input_ids=ids)
        feed.update(past if past is not None else self.zero_feeds(ids.shape[0]))
        return feed

    def call(self, input_ids, past: Mapping[str, Any] | None = None, *, decode: bool = False) -> "OrderedDict[str, Any]":
        """One call; returns own copies of the outputs (runners may reuse their buffers). The runtime's own
        time for it (feeds built, copies made outside) is left in :attr:`last_seconds`."""
        fn = (self.decode or self.prefill) if decode else self.prefill
        feed = self.feeds(input_ids, past)
        t0 = time.perf_counter()
        out = fn(feed)
        self.last_seconds = time.perf_counter() - t0
        return OrderedDict((k, np.array(v, copy=True)) for k, v in out.items())

    def run_sequence(self, prompt, steps: int,
                     choose: Callable[[int, np.ndarray], np.ndarray] | None = None) -> Iterator[Step]:
        """Prefill ``prompt`` (batch, seqlen), then ``steps`` decode steps, each fed the previous call's states.

        ``choose(index, last_logits)`` returns the (batch,) tokens to feed after call ``index``, from that call's
        last-position logits (batch, vocab_size) as float32; default greedy (argmax). Yields a
        :class:`Step` per call (``steps + 1`` in all), its ``next_tokens`` set unless it is the last.
        """
        choose = choose or (lambda k, logits: logits.argmax(-1))
        step = Step(0, self.call(prompt), self.last_seconds)
        for k in range(1, steps + 1):
            last = np.asarray(step.outputs["logits"], dtype=np.float32)[:, -1]
            step.next_tokens = np.asarray(choose(k - 1, last), dtype=np.int64).reshape(-1)
            yield step
            out = self.call(step.next_tokens[:, None], self.io.next_past(step.outputs, copy=False), decode=True)
            step = Step(k, out, self.last_seconds)
        yield step

    def generate_greedy(self, input_ids, max_new_tokens: int, *, return_logits: bool = False):
        """Greedy continuation: (batch, max_new_tokens) int64 new tokens (and the logits each was chosen from).

        Prefill, then ``max_new_tokens - 1`` decode steps; token k is the argmax of call k's last logits.
        """
        ids = np.asarray(input_ids, dtype=np.int64)
        if max_new_tokens <= 0:
            toks = np.zeros((ids.shape[0], 0), np.int64)
            return (toks, np.zeros((ids.shape[0], 0, self.io.outputs[0].shape[-1]), np.float32)) \
                if return_logits else toks
        tokens, logits = [], []
        for st in self.run_sequence(ids, max_new_tokens - 1):
            last = np.asarray(st.outputs["logits"], dtype=np.float32)[:, -1]
            logits.append(last)
            tokens.append(st.next_tokens if st.next_tokens is not None else last.argmax(-1))
        toks = np.stack(tokens, axis=1).astype(np.int64)
        return (toks, np.stack(logits, axis=1)) if return_logits else toks


class OrtModel(Decoder):
    """The session of one export folder and flavour (``ssm_impl`` None: the primary one), prefill and decode."""

    def __init__(self, outdir: str | os.PathLike, ssm_impl: str | None = None, *,
                 providers: Sequence[str] | None = None, threads: int | None = None):
        self.outdir = Path(outdir)
        self.manifest = read_manifest(self.outdir)
        self.entry = self.manifest.graph("prefill", ssm_impl)
        self.ssm_impl = self.entry.ssm_impl
        io = self.entry.io()
        sess = ort_session(self.outdir / self.entry.file, providers=providers, threads=threads,
                           dtype=self.manifest.dtype)
        super().__init__(io, SessionInfer(sess, io.output_names()).infer)

    def run(self, input_ids, past: dict[str, Any] | None = None, *, decode: bool = False) -> dict[str, Any]:
        """One graph call; returns name -> numpy array for logits and every present state."""
        return self.call(input_ids, past, decode=decode)


def ort_generate_greedy(outdir: str | os.PathLike, input_ids, max_new_tokens: int, ssm_impl: str | None = None, *,
                        return_logits: bool = False, providers: Sequence[str] | None = None):
    """Greedy generation with the export in ``outdir`` in ONNX Runtime (CPU unless ``providers``).

    Args:
        input_ids: (batch, seqlen) int (numpy, list or torch tensor).
        ssm_impl: "ssmscan" | "std" | None (the primary flavour of the export).
        return_logits: also return the (batch, max_new_tokens, vocab_size) logits each token was chosen from.
    Returns:
        (batch, max_new_tokens) int64 numpy array of new tokens, or ``(tokens, logits)``.
    Raises:
        ExportFolderError: ``outdir`` is not an export folder or lacks the flavour.
        BackendUnavailable: a bf16 export on the CPU provider.
    """
    if hasattr(input_ids, "detach"):
        input_ids = input_ids.detach().cpu().numpy()
    return OrtModel(outdir, ssm_impl, providers=providers).generate_greedy(
        input_ids, max_new_tokens, return_logits=return_logits)
