"""The packed section of ``m2export check``: ``model.packed.onnx`` (``export --packed-prefill``) against the reference.

One packed call of several sequences of different lengths, each continuing its own states, compared with the
PyTorch reference run on each sequence alone from the same states (batch 1): the reference's logits laid end to
end along the token axis and its present states stacked per sequence are what the packed graph must return, so
one pack checks every output of the graph with the same per-output tolerances as the prefill section.

The pack (:func:`pack_lengths`) puts a sequence boundary inside the model's first chunk, one on a chunk edge and
one more on the next edge, has a one-token and an empty sequence (whose states must come back unchanged), and
alternates fresh sequences (zero states) with continued ones, whose past states are the reference's own after
``chunk_size + 3`` other tokens of the corpus, different per sequence: a graph that mixes up the sequences'
states, reads a neighbour's tokens in its conv window or leaks state across a boundary fails.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from pathlib import Path

import numpy as np

from m2export.check.data import chunk_size_of, default_past_len, token_windows
from m2export.exporter.packed import PACKED_ROLE, packed_feed
from m2export.exporter.runtime import feed_dtype_of

SECTION = "packed"


def pack_lengths(cfg, max_seqlen: int = 512) -> list[int]:
    """Sequence lengths of the check's pack, from the model's chunk size ``Q``: ``[Q - 1, 1, Q, 0, Q + 1, 5]``
    (offsets 0, Q-1 (inside chunk 0), Q (a chunk edge), 2Q (an edge), 2Q (an empty sequence), 3Q+1), each capped at
    ``max_seqlen``."""
    q = chunk_size_of(cfg)
    return [min(n, max_seqlen) for n in (max(q - 1, 1), 1, q, 0, q + 1, 5)]


def packed_entry(manifest):
    """The manifest's packed prefill graph entry, or None."""
    return next((g for g in manifest.graphs if g.role == PACKED_ROLE), None)


def pack_label(lengths: list[int]) -> str:
    return f"{len(lengths)} seqs ({', '.join(map(str, lengths))}), {sum(lengths)} tokens"


def _pack_inputs(ref, io, tokens: np.ndarray, lengths: list[int], seed: int):
    """(sequences, per-sequence past feeds): even-numbered sequences fresh, odd-numbered ones continuing
    ``default_past_len`` tokens run through the (active) reference ``ref`` from zero states."""
    rng = np.random.default_rng([seed, 3])
    past_len = default_past_len(ref.cfg)
    seqs, pasts = [], []
    for k, n in enumerate(lengths):
        window = token_windows(tokens, 1, past_len + n, rng)[0]
        zero = io.zero_feeds(1, feed_dtype_of)
        if k % 2:
            pre = OrderedDict(input_ids=np.ascontiguousarray(window[None, :past_len]))
            pre.update(zero)
            pasts.append(io.next_past(ref.infer(pre)))
        else:
            pasts.append(zero)
        seqs.append(np.ascontiguousarray(window[past_len:]))
    return seqs, pasts


def reference_outputs(ref, io, seqs, pasts) -> "OrderedDict[str, np.ndarray]":
    """The outputs the packed graph must give: the reference on each sequence alone from its past states, logits
    concatenated along tokens, present states stacked per sequence (an empty sequence: its past states)."""
    logits, presents = [], {s.present.name: [] for s in io.states}
    for ids, past in zip(seqs, pasts):
        if len(ids) == 0:
            for s in io.states:
                presents[s.present.name].append(np.asarray(past[s.past.name]))
            continue
        feed = OrderedDict(input_ids=ids[None])
        feed.update(past)
        out = ref.infer(feed)
        logits.append(out["logits"])
        for s in io.states:
            presents[s.present.name].append(out[s.present.name])
    res = OrderedDict(logits=np.concatenate(logits, axis=1))
    res.update((k, np.concatenate(v, axis=0)) for k, v in presents.items())
    return res


def packed_section(outdir: Path, manifest, reference, compare_func, *, tokens: np.ndarray, seed: int, dtype: str,
                   max_seqlen: int, runner_factory, doing=lambda what: None) -> tuple[OrderedDict, str, str] | None:
    """Run the pack through the reference and ``model.packed.onnx``; None when the export has no packed graph.

    ``runner_factory(path, name)``: the ONNX runtime's runner for the graph (the check's ONNX Runtime runner).
    ``doing(what)`` is told each step as it starts (progress).
    Returns ({(runtime runner name, reference runner name): [match]} as :func:`~m2export.check.compare._rows`
    reads it, the pack's label, the runtime's name).

    Raises:
        ContractError: the pack's feed breaks the packed graph's input contract (never for the check's own pack).
    """
    from polygraphy.comparator.data_loader import coerce_feed_dict
    from polygraphy.comparator.struct import IterationResult

    from m2export.check.compare import _graph_path
    from m2export.check.runners import reference_runner

    entry = packed_entry(manifest)
    if entry is None:
        return None
    path = _graph_path(outdir, entry.file, "packed prefill graph")
    lengths = pack_lengths(manifest.model_config(), max_seqlen)
    pio = entry.io()
    name = f"onnxrt:{path.name}"
    with contextlib.ExitStack() as stack:
        ref = stack.enter_context(reference_runner(reference, role="prefill", dtype=dtype, name="torch:per-sequence"))
        doing(f"reference: past states and outputs of {len(lengths)} sequences, each alone")
        seqs, pasts = _pack_inputs(ref, ref.io, tokens, lengths, seed)
        want = reference_outputs(ref, ref.io, seqs, pasts)
        feed = packed_feed(seqs, pasts, pio)
        doing(f"onnxrt/packed: {path.name}, one call")
        rt = stack.enter_context(runner_factory(path, name))
        got = rt.infer(feed_dict=coerce_feed_dict(feed, rt.get_input_metadata(use_numpy_dtypes=False)))
        match = compare_func(IterationResult(outputs=got, runtime=rt.last_inference_time(), runner_name=name),
                             IterationResult(outputs=want, runtime=0.0, runner_name=ref.name))
        ref_name = ref.name
    return OrderedDict({(name, ref_name): [match]}), pack_label(lengths), name


__all__ = ["SECTION", "pack_label", "pack_lengths", "packed_entry", "packed_section", "reference_outputs"]
