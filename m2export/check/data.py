"""Inputs for accuracy checks: real byte-level token sequences, fresh and continued.

:class:`TokenDataLoader` is a Polygraphy data loader (an iterable of feed dicts, see
``polygraphy.comparator.DataLoader``): every feed dict holds ``input_ids`` (batch, seqlen) int64
taken from a text corpus, plus every ``past`` state input, with the names and dtypes of the exported graphs
(:class:`m2export.exporter.configs.GraphIO`). The past states are zeros (a fresh sequence) and, when the
loader is given the PyTorch reference, also the reference's own states after the text that precedes the
window in the corpus (a continued sequence): realistic non-zero states, so a prefill graph that ignores
its ``past`` inputs cannot pass.

The default corpus is the Python standard library's own ``.py`` sources: real, varied text that
is on every machine, and the domain of the bundled stdlib byte model.
"""

from __future__ import annotations

import contextlib
import sysconfig
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from m2export._paths import not_a_file
from m2export.errors import M2ExportError, ParameterError, UsageError
from m2export.exporter.configs import DTYPES, GraphIO
from m2export.exporter.runtime import feed_dtype_of
from m2export.models.config import Mamba2Config

DEFAULT_CORPUS_BYTES = 1 << 20  # 1 MiB of stdlib sources is plenty of distinct windows
#: the logits of one vocabulary-sweep feed stay below this many bytes (fp32): 333 tokens of a 50k vocabulary
SWEEP_LOGITS_BYTES = 64 << 20


@lru_cache(maxsize=4)
def stdlib_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES) -> bytes:
    """The first ``max_bytes`` of the stdlib's top-level ``*.py`` files, in sorted file-name order.

    Deterministic for one Python version; files are separated by a blank line.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    out, n = [], 0
    for f in sorted(root.glob("*.py")):
        try:
            b = f.read_bytes()
        except OSError:
            continue
        out.append(b + b"\n\n")
        n += len(b) + 2
        if n >= max_bytes:
            break
    if not out:
        raise M2ExportError(f"no Python sources found under {root} for the default corpus",
                            hint="pass a text file as `text`")
    return b"".join(out)[:max_bytes]


def read_corpus(text_file: str | Path | None) -> bytes:
    """The bytes of ``text_file``, or :func:`stdlib_corpus` when None.

    Raises:
        ParameterError: the file is missing or shorter than 2 bytes.
    """
    if text_file is None:
        return stdlib_corpus()
    p = Path(text_file)
    if not p.is_file():
        raise ParameterError(f"`text` {p}: {not_a_file(p)}", hint="pass a UTF-8 text file, or omit `text` for the "
                             "default corpus (the Python stdlib sources)")
    data = p.read_bytes()
    if len(data) < 2:
        raise ParameterError(f"`text` {p}: only {len(data)} bytes; need at least 2")
    return data


def chunk_size_of(cfg) -> int:
    """The scan chunk size of a model description: Mamba2Config.chunk_size, or the first Mamba layer's of a
    layer stack (a stack without Mamba layers: 64, only for choosing check sizes)."""
    c = getattr(cfg, "chunk_size", None)
    if c:
        return int(c)
    return next((L.mamba.chunk_size for L in getattr(cfg, "layers", ()) if L.mamba is not None), 64)


def byte_tokens(data: bytes, vocab_size: int) -> np.ndarray:
    """Byte-level token ids (int64); bytes >= vocab_size (only for vocabularies < 256) wrap around."""
    ids = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
    return ids % vocab_size if vocab_size < 256 else ids


def token_windows(tokens: np.ndarray, batch: int, seqlen: int, rng: np.random.Generator) -> np.ndarray:
    """(batch, seqlen) int64 windows at random offsets of ``tokens`` (repeated if it is too short)."""
    if len(tokens) < seqlen + 1:
        tokens = np.tile(tokens, -(-(seqlen + 1) // len(tokens)))
    starts = rng.integers(0, len(tokens) - seqlen, size=batch)
    return np.stack([tokens[s:s + seqlen] for s in starts]).astype(np.int64)


def default_shapes(cfg: Mamba2Config, max_seqlen: int = 512) -> list[tuple[int, int]]:
    """(batch, seqlen) pairs across the range that matters for a chunked scan.

    One token, a partial chunk, exactly one chunk, one chunk + 1 and two chunks plus a remainder;
    batch 1..3, the larger batches on the shorter sequences (logits are batch x seqlen x vocab: on a
    50k vocabulary every token costs 200 kB per runtime). Capped at ``max_seqlen``.
    """
    c = chunk_size_of(cfg)
    cand = [(1, 1), (3, max(2, c // 2 - 1)), (1, c), (2, c + 1), (1, 2 * c + 3)]
    out = []
    for b, s in cand:
        s = min(s, max_seqlen)
        if (b, s) not in out:
            out.append((b, s))
    return out


def parse_shapes(spec: str) -> list[tuple[int, int]]:
    """'1x1,2x64' -> [(1, 1), (2, 64)].

    Raises:
        UsageError: a malformed item, named; an empty ``spec`` (no size is not "the default sizes").
    """
    if not spec.strip():
        raise UsageError(f"`shapes` {spec!r}: empty value; {_SHAPES_EXPECTED}", hint="leave `shapes` out for the "
                                                                                   "default sizes")
    out = []
    for item in spec.split(","):
        item = item.strip()
        try:
            b, s = (int(v) for v in item.lower().split("x"))
            if b < 1 or s < 1:
                raise ValueError
        except ValueError:
            raise UsageError(f"`shapes`: bad item {item!r}; {_SHAPES_EXPECTED}") from None
        out.append((b, s))
    return out


_SHAPES_EXPECTED = "expected BATCHxSEQLEN with positive integers, e.g. 1x1,2x64"


def check_shapes(shapes: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """``shapes`` (the library's (batch, seqlen) pairs) as a list of int pairs, each >= 1.

    Every graph call needs a token (an empty prompt has none to continue from; the graphs cannot refuse it
    themselves, ONNX Runtime fails inside a kernel), and a batch of 0 has nothing to compare.

    Raises:
        UsageError: an item that is not two integers >= 1, named; no item at all (``[]`` is not "the default
            sizes": those are ``None``).
    """
    if not len(shapes):
        raise UsageError(f"`shapes` {shapes!r}: no size; {_SHAPES_EXPECTED}", hint="pass None for the default sizes")
    out = []
    for item in shapes:
        try:
            b, s = (int(v) for v in item)
            ok = b >= 1 and s >= 1 and (b, s) == tuple(item)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise UsageError(f"`shapes`: bad item {item!r}; {_SHAPES_EXPECTED}")
        out.append((b, s))
    return out


def _scan_shapes(cfg) -> list[tuple[int, int, int, int]]:
    """(nheads, headdim, d_state, chunk_size) of each distinct Mamba mixer of a model description."""
    if getattr(cfg, "chunk_size", None):
        return [(cfg.nheads, cfg.headdim, cfg.d_state, cfg.chunk_size)]
    return sorted({(L.mamba.nheads, L.mamba.headdim, L.mamba.d_state, L.mamba.chunk_size)
                   for L in getattr(cfg, "layers", ()) if L.mamba is not None})


def _check_shapes_fit(shapes: Sequence[tuple[int, int]], vocab: int, copies: int = 3, *, cfg=None,
                      onnx_scan: bool = False, past_len: int | None = None) -> None:
    """Refuse a (batch, seqlen) that needs more than this machine's physical memory: a ParameterError naming the
    shape instead of a MemoryError (or the OOM killer) inside numpy or ONNX Runtime.

    What is counted: the fp32 logits, held ``copies`` times (the reference's, a runtime's, the comparison's), and,
    with ``onnx_scan`` (an ONNX Runtime graph whose SSMScan runs the chunked body: the ssmscan or std flavour), the
    largest working set of one layer's scan body (:class:`~m2export.exporter.ssm_scan_op.ChunkedBodySizes`: its
    (nchunks + 1)^2 decay matrices grow with the square of seqlen) for each Mamba mixer shape of ``cfg``. With
    ``past_len`` (the shapes are also fed continued: the reference first prefills ``past_len`` tokens per row,
    :func:`default_past_len` = chunk_size + 3, whatever the shapes), that prefill too: its logits and one layer's
    chunked scan (the same estimate: its within-chunk matrices grow with the square of chunk_size).
    """
    import os

    from m2export.check.console import human_bytes

    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX: nothing to compare with
        return
    from m2export.exporter.ssm_scan_op import ChunkedBodySizes

    hint = "ask for smaller shapes, e.g. `shapes=1x1,2x64`"
    for b, s in shapes:
        need = b * s * vocab * 4
        if need * copies > memory:
            raise ParameterError(f"`shapes` {b}x{s}: one input's logits alone are {human_bytes(need)} (batch x "
                                 f"seqlen x vocabulary {vocab} x 4 bytes, held {copies} times during the "
                                 f"comparison), more than this machine's {human_bytes(memory)} of memory", hint=hint)
        if not onnx_scan or s < 2 or cfg is None:  # one token: the body's recurrence step, no chunk matrices
            continue
        for nheads, headdim, d_state, chunk in _scan_shapes(cfg):
            body = ChunkedBodySizes.of(b, s, nheads, headdim, d_state, chunk).peak
            if need * copies + body > memory:
                q = max(1, min(chunk, s))
                raise ParameterError(
                    f"`shapes` {b}x{s}: needs about {human_bytes(need * copies + body)}: its logits "
                    f"{human_bytes(need)} x {copies} plus {human_bytes(body)} for one layer's ONNX scan body "
                    f"((nchunks + 1)^2 decay matrices for {-(-s // q)} chunks of {q} tokens x {nheads} heads, "
                    f"batch {b}); expected at most this machine's {human_bytes(memory)} of memory", hint=hint)
    # then the reference's prefill before each continued input (its own length, not the shapes')
    for b in sorted({b for b, _ in shapes}) if past_len and cfg is not None else ():
        pre = b * past_len * vocab * 4
        for nheads, headdim, d_state, chunk in _scan_shapes(cfg):
            scan = ChunkedBodySizes.of(b, past_len, nheads, headdim, d_state, chunk).peak
            if pre * copies + scan > memory:
                why = (f"chunk_size {chunk} + 3: its states come out of a chunk boundary" if past_len == chunk + 3
                       else f"`past_len`; chunk_size {chunk}")
                raise ParameterError(
                    f"a continued input of batch {b} needs the reference to prefill {past_len} tokens first "
                    f"({why}), about {human_bytes(pre * copies + scan)} (its logits {human_bytes(pre)} x {copies} "
                    f"and one layer's chunked scan, {min(chunk, past_len)}^2 within-chunk matrices x {nheads} "
                    f"heads); expected at most this machine's {human_bytes(memory)} of memory",
                    hint=f"chunk_size {chunk} (the export's config) is too large to check on this machine; check on "
                         "one with more memory, or export with a smaller chunk_size" if scan > pre * copies else hint)


@dataclass(frozen=True)
class FeedInfo:
    """One feed of a :class:`TokenDataLoader`, in iteration order: its ``label`` ("2x17", "2x17 after 19",
    "vocab sweep 1/3 (1x333)") and whether it ``continues`` a sequence (its past states are the reference's own,
    which the reference computes while the loader makes the feed)."""

    label: str
    continues: bool = False


class TokenDataLoader:
    """Polygraphy data loader: real tokens per (batch, seqlen) in ``shapes``, fresh and (optionally) continued.

    Args:
        cfg: the model configuration (state shapes, vocabulary size).
        dtype: export dtype ("fp32" | "fp16" | "bf16"): dtypes of the model-dtype states (bf16 as float32).
        shapes: (batch, seqlen) per feed dict.
        corpus: text bytes to cut windows from (default :func:`stdlib_corpus`).
        seed: window offsets; the same seed gives the same feeds.
        reference: the PyTorch reference (what :class:`~m2export.check.runners.TorchRunner` accepts, e.g. a
            :class:`~m2export.check.runners.ModelFromCheckpoint`). When given, every shape is fed twice: first
            fresh (zero past states), then continuing a sequence: a window of ``past_len + seqlen`` tokens is
            cut from the corpus, the reference prefills its first ``past_len`` tokens from zero states, and
            the feed is the last ``seqlen`` tokens with the reference's ``present_*`` states as ``past_*``
            (conv states rounded to the export dtype, as a runtime feeding its own states back would get).
        past_len: tokens before a continued window (default :func:`default_past_len`).
        vocab_sweep: after the corpus feeds, feed every token id 0..vocab_size-1 at least once
            (:func:`vocab_sweep_windows`: a seeded permutation cut into (1, L) windows, fresh states), so every
            embedding row is exercised (a byte corpus reaches ids 0-255 only); every lm_head row is compared
            in every feed anyway (the whole logits). :attr:`coverage` states what was fed.
        onnx_scan: the feeds go to an ONNX Runtime graph whose scan runs the chunked SSMScan body (the ssmscan or
            std flavour): its working set counts in the memory check of ``shapes``.

    Raises:
        ParameterError: a shape whose logits (and ``onnx_scan``'s scan body, and with ``reference`` the prefill of
            ``past_len`` tokens) need more than this machine's memory.

    Iterating twice yields the same feed dicts (a fresh generator each time), so the loader can be
    shared by runners and by the Polygraphy data-loader script ``m2export check`` writes.
    :attr:`feeds` describes each feed (:class:`FeedInfo`), :attr:`labels` names them ("2x17"; "2x17 after 19" for a
    continued one).
    """

    def __init__(self, cfg: Mamba2Config, dtype: str, shapes: Sequence[tuple[int, int]], *,
                 corpus: bytes | None = None, seed: int = 0, reference=None, past_len: int | None = None,
                 vocab_sweep: bool = True, onnx_scan: bool = False):
        self.cfg, self.dtype, self.shapes, self.seed = cfg, dtype, list(shapes), seed
        self.sweep = vocab_sweep_windows(cfg, seed) if vocab_sweep else []
        self.tokens = byte_tokens(corpus if corpus is not None else stdlib_corpus(), cfg.vocab_size)
        if dtype not in DTYPES:
            raise M2ExportError(f"dtype {dtype!r}: expected one of {list(DTYPES)}")
        self.io = GraphIO.for_model(cfg, dtype)
        self.reference = reference
        self.past_len = int(past_len) if past_len is not None else default_past_len(cfg)
        if self.past_len < 1:
            raise ParameterError(f"`past_len` {self.past_len}: expected >= 1")
        _check_shapes_fit(self.shapes, self.io.outputs[0].shape[-1], cfg=cfg, onnx_scan=onnx_scan,
                          past_len=self.past_len if reference is not None else None)

    @property
    def feeds(self) -> list[FeedInfo]:
        """One :class:`FeedInfo` per feed dict, in iteration order."""
        out = []
        for b, s in self.shapes:
            out.append(FeedInfo(f"{b}x{s}"))
            if self.reference is not None:
                out.append(FeedInfo(f"{b}x{s} after {self.past_len}", continues=True))
        n = len(self.sweep)
        return out + [FeedInfo(f"vocab sweep {i + 1}/{n} (1x{w.shape[1]})") for i, w in enumerate(self.sweep)]

    @property
    def labels(self) -> list[str]:
        """One label per feed dict, in iteration order."""
        return [f.label for f in self.feeds]

    @property
    def coverage(self) -> str:
        """Which token ids the feeds hold, in words (for the report)."""
        v = self.cfg.vocab_size
        distinct = len(np.unique(self.tokens))
        if self.sweep:
            return (f"every token id 0..{v - 1} fed at least once: a vocabulary sweep of {len(self.sweep)} input(s) "
                    f"(1 x up to {max(w.shape[1] for w in self.sweep)} tokens; {v} tokens in all, zero past states) "
                    f"after the corpus windows, so that every embedding row is exercised (the corpus holds {distinct} distinct "
                    f"of {v} ids); every lm_head row compared in every input")
        return (f"only the ids of the corpus windows (the corpus holds {distinct} distinct of {v} ids; no "
                "vocabulary sweep): embedding rows of other ids are not exercised")

    def __len__(self) -> int:
        return len(self.shapes) * (1 if self.reference is None else 2) + len(self.sweep)

    def __iter__(self) -> Iterator["OrderedDict[str, np.ndarray]"]:
        rng = np.random.default_rng(self.seed)
        cont_rng = np.random.default_rng([self.seed, 1])  # continued windows: their own stream
        with contextlib.ExitStack() as stack:
            ref = None
            if self.reference is not None:
                from m2export.check.runners import reference_runner

                ref = stack.enter_context(reference_runner(self.reference, role="prefill", dtype=self.dtype,
                                                      name="torch:past-states"))
            for batch, seqlen in self.shapes:
                feed: OrderedDict[str, np.ndarray] = OrderedDict(
                    input_ids=token_windows(self.tokens, batch, seqlen, rng))
                feed.update(self.io.zero_feeds(batch, feed_dtype_of))
                yield feed
                if ref is not None:
                    yield continued_feed(ref, self.io,
                                         token_windows(self.tokens, batch, self.past_len + seqlen, cont_rng),
                                         self.past_len)
            for ids in self.sweep:
                feed = OrderedDict(input_ids=ids)
                feed.update(self.io.zero_feeds(1, feed_dtype_of))
                yield feed


def vocab_sweep_windows(cfg: Mamba2Config, seed: int, logits_bytes: int = SWEEP_LOGITS_BYTES) -> list[np.ndarray]:
    """A seeded permutation of every token id 0..vocab_size-1 cut into (1, L) int64 windows, L as large as
    keeps one feed's fp32 logits (L x vocab_size x 4 bytes) under ``logits_bytes`` (at least 16)."""
    ids = np.random.default_rng([seed, 2]).permutation(cfg.vocab_size).astype(np.int64)
    L = max(16, min(cfg.vocab_size, logits_bytes // (4 * cfg.vocab_size)))
    return [np.ascontiguousarray(ids[None, i:i + L]) for i in range(0, len(ids), L)]


def default_past_len(cfg: Mamba2Config) -> int:
    """Tokens the reference reads before a continued window: one chunk + 3, so its states come out of
    a chunk boundary and a partial chunk."""
    return chunk_size_of(cfg) + 3


def continued_feed(reference_runner, io: GraphIO, window: np.ndarray, past_len: int) -> "OrderedDict[str, np.ndarray]":
    """Feed dict for ``window[:, past_len:]`` continuing ``window[:, :past_len]``: the past states are what
    the (active) reference prefill runner returns for the first ``past_len`` tokens from zero states."""
    pre = OrderedDict(input_ids=np.ascontiguousarray(window[:, :past_len]))
    pre.update(io.zero_feeds(window.shape[0], feed_dtype_of))
    feed: OrderedDict[str, np.ndarray] = OrderedDict(input_ids=np.ascontiguousarray(window[:, past_len:]))
    feed.update(io.next_past(reference_runner.infer(pre)))
    return feed
