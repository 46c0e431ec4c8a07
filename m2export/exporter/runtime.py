"""Running an export folder in ONNX Runtime: sessions, zero states, prefill, greedy generation.

Used by the exporter's tests, ``m2export check``/``generate`` and the benchmarks. Works on the
manifest only (graph names, dtypes and shapes come from m2export.json), never on a torch model.

bfloat16: ONNX Runtime's CPU execution provider has no bfloat16 kernels for the ops these graphs use
(ORT 1.32: "Could not find an implementation for MatMul(13)"), so a bf16 export cannot be run on CPU;
:func:`ort_session` raises :class:`~m2export.errors.BackendUnavailable` saying so instead of failing deep
inside ORT. ``providers=["onnx.reference"]`` runs any export (bf16 included) with ONNX's Python reference
evaluator instead: slow, for tiny models and tests.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from m2export.errors import BackendUnavailable
from m2export.exporter.manifest import Manifest, read_manifest

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


def zero_states(manifest: Manifest, batch: int, role: str = "prefill", ssm_impl: str | None = None) -> dict[str, Any]:
    """Zero ``past_*`` inputs (a fresh sequence) of the graph ``role`` for ``batch`` sequences."""
    g = manifest.graph(role, ssm_impl)
    out = {}
    for name, spec in g.inputs.items():
        if name == "input_ids":
            continue
        shape = [batch if isinstance(d, str) else int(d) for d in spec["shape"]]
        out[name] = np.zeros(shape, dtype=NP_DTYPES[spec["dtype"]])
    return out


def _present_to_past(outputs: dict[str, Any]) -> dict[str, Any]:
    return {k.replace("present_", "past_", 1): v for k, v in outputs.items() if k.startswith("present_")}


class OrtModel:
    """Prefill + decode sessions of one export folder and flavour (``ssm_impl`` None: the primary one)."""

    def __init__(self, outdir: str | os.PathLike, ssm_impl: str | None = None, *,
                 providers: Sequence[str] | None = None, threads: int | None = None):
        self.outdir = Path(outdir)
        self.manifest = read_manifest(self.outdir)
        self.prefill_entry = self.manifest.graph("prefill", ssm_impl)
        self.decode_entry = self.manifest.graph("decode", ssm_impl)
        self.ssm_impl = self.prefill_entry.ssm_impl
        d = self.manifest.dtype
        self.prefill = ort_session(self.outdir / self.prefill_entry.file, providers=providers, threads=threads, dtype=d)
        self.decode = ort_session(self.outdir / self.decode_entry.file, providers=providers, threads=threads, dtype=d)

    def run(self, input_ids, past: dict[str, Any] | None = None, *, decode: bool = False) -> dict[str, Any]:
        """One graph call; returns name -> numpy array for logits and every present state."""
        ids = np.asarray(input_ids, dtype=np.int64)
        sess, entry = (self.decode, self.decode_entry) if decode else (self.prefill, self.prefill_entry)
        feeds = {"input_ids": ids}
        feeds.update(past if past is not None else zero_states(self.manifest, ids.shape[0], entry.role, entry.ssm_impl))
        names = list(entry.outputs)
        return dict(zip(names, sess.run(names, feeds)))

    def generate_greedy(self, input_ids, max_new_tokens: int, *, return_logits: bool = False):
        """Greedy continuation: prefill, then ``max_new_tokens - 1`` decode steps (like the torch model)."""
        ids = np.asarray(input_ids, dtype=np.int64)
        out = self.run(ids)
        logits = [out["logits"][:, -1]]
        nxt = out["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)
        tokens = []
        for _ in range(max_new_tokens):
            tokens.append(nxt)
            if len(tokens) == max_new_tokens:
                break
            out = self.run(nxt, _present_to_past(out), decode=True)
            logits.append(out["logits"][:, -1])
            nxt = out["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)
        toks = np.concatenate(tokens, axis=1) if tokens else np.zeros((ids.shape[0], 0), np.int64)
        return (toks, np.stack(logits[: len(tokens)], axis=1)) if return_logits else toks


def ort_generate_greedy(outdir: str | os.PathLike, input_ids, max_new_tokens: int, ssm_impl: str | None = None, *,
                        return_logits: bool = False, providers: Sequence[str] | None = None):
    """Greedy generation with the export in ``outdir`` in ONNX Runtime (CPU unless ``providers``).

    Args:
        input_ids: (batch, seqlen) int (numpy, list or torch tensor).
        ssm_impl: "ssmscan" | "std" | None (the primary flavour of the export).
        return_logits: also return the (batch, max_new_tokens, vocab_padded) logits each token was chosen from.
    Returns:
        (batch, max_new_tokens) int64 numpy array of new tokens (same convention as
        ``Mamba2LMHeadModel.generate_greedy``), or ``(tokens, logits)``.
    Raises:
        ExportFolderError: ``outdir`` is not an export folder or lacks the flavour.
        BackendUnavailable: a bf16 export on the CPU provider.
    """
    if hasattr(input_ids, "detach"):
        input_ids = input_ids.detach().cpu().numpy()
    return OrtModel(outdir, ssm_impl, providers=providers).generate_greedy(
        input_ids, max_new_tokens, return_logits=return_logits)
