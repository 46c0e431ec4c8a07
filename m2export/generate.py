"""Text generation with an export (ONNX Runtime, TensorRT) or the PyTorch reference.

All three runtimes are driven through the same Polygraphy runners as ``m2export check``
(:mod:`m2export.check.runners`) and the same loop (:meth:`m2export.exporter.runtime.Decoder.run_sequence`):
the prefill graph consumes the prompt, then the decode graph runs one token at a time, each call's
``present`` states fed back as the next call's ``past`` states.

Tokens are bytes for byte-level models (vocab_size 256, e.g. the bundled stdlib model); a
``tokenizers`` JSON file can be given for other vocabularies, or raw token ids.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from m2export._paths import not_a_file
from m2export import backends, names
from m2export.errors import (BackendUnavailable, CheckpointError, ExportFolderError, M2ExportError, ParameterError,
                             UsageError)

RUNTIMES = tuple(names.RUNTIMES)  # torch, onnxrt, onnx-reference, trt (m2export/names.py)


# ----------------------------------------------------------------------------------------------- tokenizers
def utf8_prompt(text: str) -> bytes:
    """``text`` as UTF-8 bytes.

    Raises:
        ParameterError: ``text`` holds bytes that are not UTF-8 (a command-line argument that was not: Python
            keeps them as lone surrogates, see ``os.fsencode``), naming the first bad byte and its offset.
    """
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raw = os.fsencode(text)  # the bytes as they were given
        try:
            raw.decode("utf-8")
            where = ""
        except UnicodeDecodeError as e:
            where = f" (byte 0x{raw[e.start]:02x} at offset {e.start})"
        raise ParameterError(f"`prompt`: not UTF-8 text{where}",
                             hint="pass UTF-8 text, or the token ids themselves as `prompt_ids`") from None


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; decoding replaces invalid UTF-8 sequences."""

    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(utf8_prompt(text))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class FileTokenizer:
    """A HF ``tokenizers`` JSON file (tokenizer.json)."""

    def __init__(self, path: str | Path):
        p = Path(path)
        if not p.is_file():  # before the package: a mistyped path is the first thing to fix
            raise ParameterError(f"`tokenizer` {p}: {not_a_file(p)}", hint="pass a tokenizers JSON file (tokenizer.json)")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise M2ExportError(f"`tokenizer` {path}: the 'tokenizers' package is not installed",
                                hint="pip install tokenizers, or pass token ids (`prompt_ids`)") from None
        try:
            self.tok = Tokenizer.from_file(str(p))
        except Exception as e:  # tokenizers raises a bare Exception subclass on malformed files
            raise ParameterError(f"`tokenizer` {p}: not a tokenizers JSON file ({e})") from None
        self.name = p.name

    def encode(self, text: str) -> list[int]:
        utf8_prompt(text)
        return list(self.tok.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids])


def choose_tokenizer(vocab_size: int, tokenizer_file: str | Path | None):
    """The tokenizer for a model: the file when given, else bytes when the vocabulary has 256 entries.

    Raises:
        ParameterError: no tokenizer file and vocab_size != 256 (pass a tokenizer or token ids).
    """
    if tokenizer_file:
        return FileTokenizer(tokenizer_file)
    if vocab_size == 256:
        return ByteTokenizer()
    raise ParameterError(f"the model's vocabulary has {vocab_size} tokens, not 256 bytes: text needs a tokenizer",
                         hint="pass a tokenizer.json (`tokenizer`; needs the 'tokenizers' package), or token ids "
                              "(`prompt_ids`)")


# ----------------------------------------------------------------------------------------------- runtimes
@dataclass
class _Session:
    runtime: str
    label: str
    prefill: Any
    decode: Any
    cfg: Any
    dtype: str
    #: the export's (or checkpoint's) tokenizer.json, if it has one: generate's default tokenizer
    tokenizer_file: Path | None = None
    #: the graph's I/O (its manifest entry's: state layouts included); None: the model's (torch, TensorRT)
    io: Any = None


def open_runtime(source: str | Path, runtime: str, *, ssm_impl: str | None = None) -> _Session:
    """Prefill and decode runners of ``runtime`` for ``source`` (an export OUTDIR, or a checkpoint for torch);
    decode None: the prefill runner serves decode steps (one graph; a TensorRT engine's decode profile is used
    where the engine has one).

    Raises:
        ExportFolderError: OUTDIR/graph/engine missing; CheckpointError: bad checkpoint;
        BackendUnavailable: trt where TensorRT is not usable (not installed, no CUDA GPU): exit 4, checked
            before the engines (as in ``m2export check``); with TensorRT usable, missing engines are an
            ExportFolderError (exit 1).
    """
    from m2export.check import runners
    from m2export.check.runners import ModelFromCheckpoint, OnnxReferenceRunner, TorchRunner, onnxrt_runner
    from m2export.exporter.configs import MANIFEST_FILE
    from m2export.exporter.manifest import REEXPORT_HINT, read_manifest

    runtime = names.canonical("runtime", runtime)
    if runtime not in RUNTIMES:
        raise UsageError(f"`runtime` {runtime!r}: expected one of {list(RUNTIMES)}")
    src = Path(source)
    if not src.exists():
        raise ExportFolderError(f"{src}: no such file or directory",
                                hint="pass an OUTDIR written by 'm2export export' (or a checkpoint with "
                                     "`runtime='torch'`)")
    if src.is_file() and (src.parent / MANIFEST_FILE).is_file():  # model.onnx, model.plan ... of an export
        raise ExportFolderError(f"{src}: a file of the export folder {src.parent}; generate reads the folder "
                                f"(its {MANIFEST_FILE} names the graphs)",
                                hint=f"pass {src.parent} (`ssm_impl` picks the graph flavour)")
    is_outdir = src.is_dir() and (src / MANIFEST_FILE).is_file()
    if runtime == "torch":
        if is_outdir:
            m = read_manifest(src)
            if not Path(m.source_checkpoint).exists():  # the manifest's path, not one the user typed: say so
                raise CheckpointError(f"{src}: its checkpoint {m.source_checkpoint} (from {MANIFEST_FILE}) does not "
                                      "exist; runtime torch runs the PyTorch model from the checkpoint",
                                      hint="pass the checkpoint folder itself instead of the export folder, or run "
                                           "the export's graphs (runtime onnxrt, the default for an export folder)")
            ck = ModelFromCheckpoint(m.source_checkpoint, expected_sha256=m.checkpoint_sha256 or None,
                                     allow_nonfinite=m.allow_nonfinite)
            label = f"torch ({m.source_checkpoint})"
        else:
            ck = ModelFromCheckpoint(src)
            label = f"torch ({src})"
        loaded = ck()
        tok = loaded.path / "tokenizer.json"
        return _Session("torch", label, TorchRunner(ck, role="prefill"), None,
                        loaded.config if loaded.config is not None else loaded.spec, "fp32",
                        tok if tok.is_file() else None)
    if not is_outdir:
        raise ExportFolderError(f"{src}: not an m2export output folder (no {MANIFEST_FILE})",
                                hint=f"`runtime='{runtime}'` needs an OUTDIR from 'm2export export'; a checkpoint "
                                     "works with `runtime='torch'`")
    m = read_manifest(src)
    cfg = m.model_config()
    tok = src / "tokenizer.json" if "tokenizer.json" in m.tokenizer and (src / "tokenizer.json").is_file() else None
    if runtime in ("onnxrt", "onnx-reference"):
        if runtime == "onnxrt" and m.dtype == "bf16":
            raise BackendUnavailable("a bf16 export cannot run on ONNX Runtime's CPU provider (no bfloat16 "
                                     "MatMul/Conv kernels)",
                                     hint="use `runtime='onnx-reference'` (ONNX's reference evaluator, slow), trt "
                                          "on a GPU, or export with `dtype='fp16'`")
        entry = m.graph("prefill", ssm_impl)
        f = src / entry.file
        if not f.is_file():
            raise ExportFolderError(f"{f}: graph listed in {MANIFEST_FILE} is missing", hint=REEXPORT_HINT)
        from m2export.inspect import check_graph_file

        check_graph_file(f, entry)  # the file is the graph the manifest describes (not a swapped flavour)
        if runtime == "onnx-reference":
            return _Session(runtime, f"onnx-reference ({f.name})", OnnxReferenceRunner(f), None, cfg, m.dtype, tok,
                            entry.io())
        return _Session("onnxrt", f"onnxrt ({f.name})", onnxrt_runner(f), None, cfg, m.dtype, tok, entry.io())
    why = backends.tensorrt_unavailable_reason()
    if why:  # exit 4 before anything about the engines (one rule with check)
        raise backends.tensorrt_unavailable_error(why, "run TensorRT engines")
    engine = m.engine("prefill")
    if engine is None:
        raise ExportFolderError(f"{src}: no TensorRT engines (model.plan) in {MANIFEST_FILE}",
                                hint="build it with 'm2export build OUTDIR' on a machine with a GPU and TensorRT")
    if not (src / engine.file).is_file():
        raise ExportFolderError(f"{src / engine.file}: engine listed in {MANIFEST_FILE} is missing",
                                hint="rebuild with 'm2export build OUTDIR'")
    dec_e = m.engine("decode")
    if dec_e is not None and dec_e.file != engine.file and not (src / dec_e.file).is_file():
        raise ExportFolderError(f"{src / dec_e.file}: engine listed in {MANIFEST_FILE} is missing",
                                hint="rebuild with 'm2export build OUTDIR --role decode'")
    pre, dec = runners.trt_runners(src, engine, dec_e)
    files = engine.file + (f" + {dec_e.file}" if dec_e is not None and dec_e.file != engine.file else "")
    return _Session("trt", f"trt ({files}, profiles {'+'.join(engine.profile_roles)})", pre, dec, cfg, m.dtype,
                    tok)


# ----------------------------------------------------------------------------------------------- generation
@dataclass
class GenerationResult:
    runtime: str
    prompt_ids: list[int]
    new_ids: list[int]
    prefill_s: float
    decode_s: float
    text: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of decoding (tokens after the first, which the prefill produced)."""
        n = len(self.new_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else float("nan")


def sample_next(logits: np.ndarray, *, temperature: float, top_k: int, rng: np.random.Generator) -> int:
    """Greedy (temperature <= 0) or temperature / top-k sampling from one row of logits."""
    x = np.asarray(logits, dtype=np.float64)
    if temperature <= 0:
        return int(x.argmax())
    x = (x - x.max()) / temperature  # shifted first: a tiny temperature (5e-324) gives 0 and -inf, never inf - inf
    if 0 < top_k < len(x):
        kth = np.partition(x, -top_k)[-top_k]
        x = np.where(x >= kth, x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    return int(rng.choice(len(p), p=p))


def check_prompt_ids(ids: Sequence[int], vocab_size: int, *, param: str | None = None) -> None:
    """Every prompt token id must be in ``[0, vocab_size)``.

    Raises:
        ParameterError: an empty prompt, or ids outside the vocabulary (the first few named; the message
            starts with ``param`` when given).
    """
    if not ids:
        raise ParameterError("empty prompt: give at least one token", hint="pass a `prompt` or `prompt_ids`")
    bad = [int(i) for i in ids if not 0 <= int(i) < vocab_size]
    if bad:
        raise ParameterError(f"{'`' + param + '`: ' if param else ''}token id(s) {', '.join(map(str, bad[:5]))}"
                            f"{' ...' if len(bad) > 5 else ''} outside the vocabulary: ids must be in [0, {vocab_size})",
                            hint=f"the model has {vocab_size} tokens" + (" (bytes 0..255)" if vocab_size == 256 else ""))


def generate(source: str | Path, prompt_ids: Sequence[int], *, runtime: str = "onnxrt", max_new_tokens: int = 64,
             temperature: float = 0.0, top_k: int = 0, seed: int = 0, ssm_impl: str | None = None,
             session: _Session | None = None, on_token: Callable[[int], None] | None = None) -> GenerationResult:
    """Continue ``prompt_ids`` by ``max_new_tokens`` tokens with one runtime (batch 1).

    Args:
        source: export OUTDIR (any runtime) or checkpoint (``runtime="torch"``).
        prompt_ids: at least one token id < vocab_size.
        runtime: "torch" | "onnxrt" | "onnx-reference" (ONNX's reference evaluator: any dtype, slow) | "trt"
            (m2export/names.py; the old "ort" is accepted with a DeprecationWarning).
        temperature: 0 (default) is greedy; > 0 samples from softmax(logits / temperature).
        top_k: sample only among the k largest logits (0: all).
        seed: sampling seed.
        ssm_impl: graph flavour for the ONNX runtimes ("ssmscan" | "std"; default the primary model.onnx).
        session: runners from :func:`open_runtime` to reuse (``source``/``runtime``/``ssm_impl`` then unused).
        on_token: called with each new token id as soon as it is chosen (for streaming output).

    Returns:
        GenerationResult (new token ids, prefill and decode times).
    """
    if max_new_tokens < 0:
        raise UsageError(f"`max_new_tokens` {max_new_tokens}: expected >= 0")
    if not (np.isfinite(temperature) and temperature >= 0):
        raise UsageError(f"`temperature` {temperature}: expected a finite number >= 0 (0 is greedy)")
    if top_k < 0:
        raise UsageError(f"`top_k` {top_k}: expected >= 0 (0: all tokens)")
    if seed < 0:
        raise UsageError(f"`seed` {seed}: expected >= 0")
    s = session or open_runtime(source, names.canonical("runtime", runtime), ssm_impl=ssm_impl)
    cfg = s.cfg
    ids = [int(i) for i in prompt_ids]
    check_prompt_ids(ids, cfg.vocab_size)
    from m2export.exporter.configs import GraphIO
    from m2export.exporter.runtime import Decoder, feed_dtype_of

    rng = np.random.default_rng(seed)
    new: list[int] = []

    def choose(k: int, last: np.ndarray) -> np.ndarray:
        logits = last[0]
        if logits.shape[-1] != cfg.vocab_size:  # the graphs' logits are vocab_size wide (GraphIO.for_model)
            raise ExportFolderError(f"{s.label}: the logits are {logits.shape[-1]} wide but the model has vocab_size "
                                    f"{cfg.vocab_size} (an export by an older m2export of a padded vocabulary)",
                                    hint="export the checkpoint again")
        if not np.isfinite(logits).all():  # argmax/softmax would turn NaN into token 0
            step = "the prefill" if k == 0 else f"decode step {k}"
            raise M2ExportError(f"{s.label}: non-finite logits (NaN/inf) after {step}; no token can be chosen",
                                hint="compare the export with its checkpoint: m2export check OUTDIR")
        new.append(sample_next(logits, temperature=temperature, top_k=top_k, rng=rng))
        if on_token is not None:
            on_token(new[-1])
        return np.asarray([new[-1]], dtype=np.int64)

    one_graph = s.decode is None or s.decode is s.prefill
    with s.prefill as pre, (contextlib.nullcontext(None) if one_graph else s.decode) as dec:
        runner = Decoder(s.io or GraphIO.for_model(cfg, s.dtype), pre.infer, None if dec is None else dec.infer,
                         np_dtype=feed_dtype_of)
        runner.call([ids[:1]])  # untimed warm-up: first runs pay one-off allocations
        runner.call([ids[:1]], decode=True)
        prefill_s = decode_s = 0.0
        if max_new_tokens > 0:
            for st in runner.run_sequence([ids], max_new_tokens - 1, choose):
                if st.index == 0:
                    prefill_s = st.seconds
                else:
                    decode_s += st.seconds
            choose(max_new_tokens - 1, np.asarray(st.outputs["logits"], dtype=np.float32)[:, -1])
        else:
            runner.call([ids])
            prefill_s = runner.last_seconds
    return GenerationResult(s.label, ids, new, prefill_s, decode_s,
                            settings={"temperature": temperature, "top_k": top_k, "seed": seed,
                                      "max_new_tokens": max_new_tokens})
