"""The packed prefill graph (``model.packed.onnx``): several sequences of different lengths in one call.

Continuous-batching servers (vLLM, TensorRT-LLM) prefill the new requests of a step as one packed batch: their
tokens concatenated along the sequence axis of a batch of one, with ``cu_seqlens`` (int32, ``num_sequences + 1``
offsets, ``cu_seqlens[0] = 0``, non-decreasing, last = total tokens) marking where each sequence starts. Each
sequence continues its own states, exactly as if it ran alone through ``model.onnx``::

    inputs:  input_ids (1, total_tokens) int64, cu_seqlens (num_sequences + 1,) int32,
             past_conv_state.{i} (num_sequences, conv_dim, d_conv - 1), past_ssm_state.{i} (num_sequences, nheads,
             headdim, d_state) per Mamba layer (dtypes as in model.onnx)
    outputs: logits (1, total_tokens, vocab), present_conv_state.{i}, present_ssm_state.{i} per sequence

Per layer, the depthwise conv reads each token's d_conv window from its own sequence, reaching back into that
sequence's ``past_conv_state`` at its start (never into the previous sequence's tokens): one ``Gather`` of the
windows from ``[all conv states; all tokens]`` with indices computed once from ``cu_seqlens`` for every layer,
then the taps summed in float32. The scan is one ``m2export::SSMScanPacked`` node (contract:
:data:`m2export.contract.PACKED_INPUTS`; its model-local function runs one SSMScan per sequence; the TensorRT
plugin runs the cuTile kernel). An empty sequence (two equal offsets) passes its states through unchanged.
A ``cu_seqlens`` that breaks the contract (not from 0, decreasing, last != total tokens) either fails in the
runtime (an index out of range) or makes every output NaN (:meth:`Packing.poison`, and the SSMScanPacked body's
own poison): never finite values. NaN is only the graph's signal: every host-side entry point of m2export that
feeds this graph builds or checks its feed with :func:`packed_feed` / :func:`check_packed_feed`, which refuse such
offsets with one line (:class:`~m2export.errors.ContractError`) before anything runs.

Only models whose every layer is a built Mamba-2 layer (pure Mamba-2, fp32/fp16): attention layers would need
per-sequence KV caches (varlen attention), which this graph does not build; such a model is refused by name.
"""

from __future__ import annotations

import numpy as np

from m2export import contract
from m2export.errors import ParameterError
from m2export.exporter.configs import BATCH, GraphIO, StateIO, TensorIO

#: the manifest role and file of the packed prefill graph (m2export.json ``graphs``)
PACKED_ROLE = "packed-prefill"
PACKED_FILE = "model.packed.onnx"
#: symbolic dims of the packed graph's I/O
NSEQ = "num_sequences"
TOKENS = "total_tokens"


def packed_io(io: GraphIO) -> GraphIO:
    """The packed graph's I/O from the regular graph's ``io``: ``input_ids``/``logits`` over (1, total_tokens),
    ``cu_seqlens`` after ``input_ids``, every state's batch axis per sequence (``num_sequences``)."""

    def per_seq(t: TensorIO) -> TensorIO:
        return TensorIO(t.name, tuple(NSEQ if d == BATCH else d for d in t.shape), t.dtype)

    states = tuple(StateIO(s.layer, s.kind, per_seq(s.past), per_seq(s.present), s.layout) for s in io.states)
    ids, logits = io.input("input_ids"), io.output("logits")
    ins = (TensorIO(ids.name, (1, TOKENS), ids.dtype),
           TensorIO(contract.CU_SEQLENS.name, (f"{NSEQ} + 1",), contract.CU_SEQLENS.dtype),
           *(s.past for s in states))
    outs = (TensorIO(logits.name, (1, TOKENS, logits.shape[2]), logits.dtype), *(s.present for s in states))
    return GraphIO(ins, outs, states)


def check_packed_feed(feed, io: GraphIO) -> None:
    """Refuse a feed of the packed graph (``io``: its :func:`packed_io`) whose ``input_ids`` is not (1, total_tokens),
    whose ``cu_seqlens`` is not int32 offsets from 0, non-decreasing, ending at total_tokens
    (:func:`m2export.contract.check_cu_seqlens`), or whose ``past_*`` states do not hold one row per sequence.

    Raises:
        ContractError: one line naming the input, what was expected and what was given.
    """
    from m2export.errors import ContractError

    ids, cu = np.asarray(feed["input_ids"]), np.asarray(feed[contract.CU_SEQLENS.name])
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise ContractError(f"input_ids: the packed graph expects shape (1, total_tokens), got {tuple(ids.shape)}")
    if cu.ndim != 1 or cu.shape[0] < 1 or cu.dtype != np.int32:
        raise ContractError(f"cu_seqlens: expected a 1-D int32 array of num_sequences + 1 offsets, got {cu.dtype} "
                            f"{tuple(cu.shape)}")
    contract.check_cu_seqlens(cu.tolist(), int(ids.shape[1]))
    nseq = cu.shape[0] - 1
    for s in io.states:
        rows = np.shape(feed[s.past.name])[0]
        if rows != nseq:
            raise ContractError(f"{s.past.name}: expected one row per sequence ({nseq}, from cu_seqlens), got {rows}")


def packed_feed(sequences, pasts, io: GraphIO) -> dict:
    """The packed graph's feed for ``sequences`` (1-D int64 token arrays, any lengths, empty allowed), each
    continuing its ``pasts`` entry (a mapping ``past_*`` name -> that sequence's state, batch 1): ``input_ids``
    (1, total_tokens), ``cu_seqlens`` int32 (num_sequences + 1), every state stacked along its batch axis.
    ``io``: the packed graph's :func:`packed_io`. Checked with :func:`check_packed_feed`.
    """
    if len(sequences) != len(pasts) or not sequences:
        from m2export.errors import ContractError

        raise ContractError(f"packed feed: expected one past-state set per sequence and >= 1 sequence, got "
                            f"{len(sequences)} sequences and {len(pasts)} state sets")
    lengths = [len(q) for q in sequences]
    feed = {"input_ids": np.concatenate([np.asarray(q, np.int64) for q in sequences])[None],
            contract.CU_SEQLENS.name: np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)}
    for s in io.states:
        feed[s.past.name] = np.concatenate([np.asarray(p[s.past.name]) for p in pasts], axis=0)
    check_packed_feed(feed, io)
    return feed


#: each kind of non-Mamba mixer in words (a key: the mixer spec's class less "Spec")
_MIXER_WORDS = {"attention": "an attention mixer", "parallel": "attention in parallel with the Mamba mixer",
                "mlp": "an MLP block instead of a Mamba mixer", "moe": "an MoE block instead of a Mamba mixer"}


def _unpackable_parts(model, i: int) -> list[tuple[int, str]]:
    """What keeps layer ``i`` out of the packed graph: (order, phrase) each, order 0 the mixer, 1 what follows it,
    2 a shared block, 3 multipliers ([] if it is a plain Mamba-2 layer)."""
    from m2export.models.spec import MambaSpec

    spec = model.spec.layers[i]
    m = spec.mixer
    parts = []
    if not isinstance(m, MambaSpec):
        kind = type(m).__name__.removesuffix("Spec").lower()
        parts.append((0, _MIXER_WORDS.get(kind, f"a {kind} mixer instead of a Mamba mixer")))
    if spec.ffn is not None:
        ffn = "an MLP" if type(spec.ffn).__name__ == "MLPSpec" else "an MoE"
        parts.append((1, f"{ffn} after the mixer"))
    if spec.shared is not None:
        parts.append((2, "a shared block"))
    if spec.residual_multiplier != 1.0 or (isinstance(m, MambaSpec) and (
            m.in_multiplier != 1.0 or m.out_multiplier != 1.0 or m.zxbcdt_multipliers is not None)):
        parts.append((3, "muP multipliers on the layer"))
    return parts


def check_packable(model) -> None:
    """Raise ParameterError unless every piece of ``model`` has a builder and every layer is a Mamba-2 layer.

    The message says once what the packed graph is built for, then each thing in the way once with the layers
    that have it: "...; this model has an attention mixer in layer 1; an MLP after the mixer in layers 0, 1, 2"."""
    from m2export.exporter import build

    why = []
    if model.dtype not in build.BUILT_DTYPES:
        why.append(f"dtype {str(model.dtype).removeprefix('torch.')}")
    if model.spec.embedding_multiplier != 1.0:
        why.append(f"an embedding multiplier ({model.spec.embedding_multiplier:g})")
    if model.spec.logits_multiplier != 1.0:
        why.append(f"a logits multiplier ({model.spec.logits_multiplier:g})")
    groups: dict[tuple[int, str], list[int]] = {}
    for i in range(len(model.backbone.layers)):
        for part in _unpackable_parts(model, i):
            groups.setdefault(part, []).append(i)
    for (_, part), layers in sorted(groups.items(), key=lambda kv: kv[0][0]):  # mixers first, then what follows
        shown = ", ".join(map(str, layers[:6])) + (", ..." if len(layers) > 6 else "")
        why.append(f"{part} in layer{'s' if len(layers) > 1 else ''} {shown}")
    if why:
        raise ParameterError("packed prefill: built only for pure Mamba-2 models in fp32 or fp16 (every layer a "
                             "Mamba-2 mixer alone, no multipliers: attention, MLP, MoE and shared blocks have no "
                             "packed builder); this model has " + "; ".join(why),
                             hint="export without `packed_prefill`")


class Packing:
    """The shared values of one packed graph: ``cu_seqlens`` and, per d_conv, the conv's gather indices.

    ``conv(b, mixer, xBC, past_conv_state, prefix)`` is :func:`m2export.exporter.build._conv`'s packed twin:
    ``(xBC_conv (1, total_tokens, conv_dim), present_conv_state (num_sequences, conv_dim, d_conv - 1))``.
    """

    def __init__(self, b, input_ids, cu_seqlens):
        ir = _ir()
        self.cu_seqlens, self.nseq_dim = cu_seqlens, ir.SymbolicDim(NSEQ)
        i64 = ir.DataType.INT64
        S, T = ir.SymbolicDim(NSEQ), ir.SymbolicDim(TOKENS)
        big = np.array([np.iinfo(np.int64).max], np.int64)
        cu = b.op("Cast", [cu_seqlens], {"to": int(i64)}, name="packed/cu64", shape=[ir.SymbolicDim(f"{NSEQ} + 1")],
                  dtype=i64)
        self.starts = b.op("Slice", [cu, b.const(np.array([0], np.int64)), b.const(np.array([-1], np.int64))],
                           name="packed/starts", shape=[S], dtype=i64)
        self.ends = b.op("Slice", [cu, b.const(np.array([1], np.int64)), b.const(big)], name="packed/ends", shape=[S],
                         dtype=i64)
        n_tok = b.op("Shape", [input_ids], {"start": 1, "end": 2}, name="packed/n_tokens", shape=[1], dtype=i64)
        n_seq = b.op("Shape", [self.ends], name="packed/n_seq", shape=[1], dtype=i64)
        one, zero = b.const(np.int64(1)), b.const(np.int64(0))
        self.n_seq, self.n_tok = n_seq, n_tok
        self.t = b.op("Range", [zero, b.op("Squeeze", [n_tok], name="packed/n_tokens_scalar", shape=[], dtype=i64), one],
                      name="packed/t", shape=[T], dtype=i64)
        self.s = b.op("Range", [zero, b.op("Squeeze", [n_seq], name="packed/n_seq_scalar", shape=[], dtype=i64), one],
                      name="packed/s", shape=[S], dtype=i64)
        # sequence of each token: how many sequences end at or before it (empty sequences end where they start)
        ge = b.op("GreaterOrEqual", [self._unsq(b, self.t, 1, "packed/t_col", [T, 1]),
                                     self._unsq(b, self.ends, 0, "packed/ends_row", [1, S])],
                  name="packed/t_ge_end", shape=[T, S], dtype=ir.DataType.BOOL)
        self.seq = b.op("ReduceSum", [b.op("Cast", [ge], {"to": int(i64)}, name="packed/t_ge_end64", shape=[T, S],
                                           dtype=i64), b.const(np.array([1], np.int64))], {"keepdims": 0},
                        name="packed/seq_of_token", shape=[T], dtype=i64)
        self.start_of_token = b.op("Gather", [self.starts, self.seq], {"axis": 0}, name="packed/start_of_token",
                                   shape=[T], dtype=i64)
        self._idx: dict[int, tuple] = {}
        # the contract's offsets (from 0, non-decreasing, last = total tokens), as one (1,) bool for poison()
        b_ = ir.DataType.BOOL
        first = b.op("Slice", [cu, b.const(np.array([0], np.int64)), b.const(np.array([1], np.int64))],
                     name="packed/cu_first", shape=[1], dtype=i64)
        last = b.op("Slice", [cu, b.const(np.array([-1], np.int64)), b.const(big)], name="packed/cu_last", shape=[1],
                    dtype=i64)
        drops = b.op("ReduceSum", [b.op("Cast", [b.op("Less", [self.ends, self.starts], name="packed/cu_drop",
                                                      shape=[S], dtype=b_)], {"to": int(i64)},
                                        name="packed/cu_drop64", shape=[S], dtype=i64),
                                   b.const(np.array([0], np.int64))], {"keepdims": 1},
                     name="packed/cu_drops", shape=[1], dtype=i64)
        self.valid = b.op("And", [b.op("And", [
            b.op("Equal", [first, b.const(np.array([0], np.int64))], name="packed/cu_from_0", shape=[1], dtype=b_),
            b.op("Equal", [last, n_tok], name="packed/cu_to_total", shape=[1], dtype=b_)],
            name="packed/cu_ends_ok", shape=[1], dtype=b_),
            b.op("Equal", [drops, b.const(np.array([0], np.int64))], name="packed/cu_nondecreasing", shape=[1],
                 dtype=b_)], name="packed/cu_valid", shape=[1], dtype=b_)

    def poison(self, b, v, name: str):
        """``v`` where ``cu_seqlens`` keeps the contract, else NaN everywhere (an invalid pack's logits and states
        are never finite values computed on the wrong tokens; ONNX has no assertion to refuse it)."""
        nan = b.const(np.array(np.nan, dtype=v.dtype.numpy()))
        v.name = f"{name}.unchecked"  # the caller gives the checked value v's name (a graph output's)
        return b.op("Where", [self.valid, v, nan], name=name, shape=list(v.shape), dtype=v.dtype)

    @staticmethod
    def _unsq(b, v, axis: int, name: str, shape):
        return b.op("Unsqueeze", [v, b.const(np.array([axis], np.int64))], name=name, shape=shape, dtype=v.dtype)

    def _window_index(self, b, pos, start, seq, k: int, name: str, shape):
        """Rows of ``[conv states (num_sequences * k rows); tokens]`` for token positions ``pos`` of sequences
        ``seq`` starting at ``start``: a position before its sequence's start reads that sequence's conv state."""
        ir = _ir()
        i64 = ir.DataType.INT64
        rel = b.op("Sub", [pos, start], name=f"{name}.rel", shape=shape, dtype=i64)
        in_state = b.op("Less", [rel, b.const(np.int64(0))], name=f"{name}.in_state", shape=shape,
                        dtype=ir.DataType.BOOL)
        state_row = b.op("Add", [b.op("Mul", [seq, b.const(np.int64(k))], name=f"{name}.seq_k", shape=list(seq.shape),
                                      dtype=i64),
                                 b.op("Add", [rel, b.const(np.int64(k))], name=f"{name}.rel_k", shape=shape, dtype=i64)],
                         name=f"{name}.state_row", shape=shape, dtype=i64)
        n_state_rows = b.op("Mul", [self.n_seq, b.const(np.array([k], np.int64))], name=f"{name}.n_state_rows",
                            shape=[1], dtype=i64)
        token_row = b.op("Add", [pos, n_state_rows], name=f"{name}.token_row", shape=shape, dtype=i64)
        return b.op("Where", [in_state, state_row, token_row], name=name, shape=shape, dtype=i64)

    def _indices(self, b, d_conv: int):
        if d_conv not in self._idx:
            ir = _ir()
            k = d_conv - 1
            T, S = ir.SymbolicDim(TOKENS), ir.SymbolicDim(NSEQ)
            i64 = ir.DataType.INT64
            p = f"packed/k{d_conv}"
            # token t's window: positions t - k .. t
            pos = b.op("Add", [self._unsq(b, self.t, 1, f"{p}/t_col", [T, 1]),
                               b.const(np.arange(-k, 1, dtype=np.int64)[None, :])],
                       name=f"{p}/win_pos", shape=[T, d_conv], dtype=i64)
            win = self._window_index(b, pos, self._unsq(b, self.start_of_token, 1, f"{p}/start_col", [T, 1]),
                                     self._unsq(b, self.seq, 1, f"{p}/seq_col", [T, 1]), k, f"{p}/win_rows",
                                     [T, d_conv])
            # sequence s's final conv state: positions end - k .. end - 1
            fpos = b.op("Add", [self._unsq(b, self.ends, 1, f"{p}/end_col", [S, 1]),
                                b.const(np.arange(-k, 0, dtype=np.int64)[None, :])],
                        name=f"{p}/final_pos", shape=[S, k], dtype=i64)
            fin = self._window_index(b, fpos, self._unsq(b, self.starts, 1, f"{p}/fstart_col", [S, 1]),
                                     self._unsq(b, self.s, 1, f"{p}/s_col", [S, 1]), k, f"{p}/final_rows", [S, k])
            flat = lambda v, what: b.op("Reshape", [v, b.const(np.array([-1], np.int64))],  # noqa: E731
                                        name=f"{p}/{what}_flat", shape=[ir.SymbolicDim(f"{what}_rows")], dtype=i64)
            rows = b.op("Concat", [flat(win, "win"), flat(fin, "final")], {"axis": 0}, name=f"{p}/rows",
                        shape=[ir.SymbolicDim(f"{TOKENS} * {d_conv} + {NSEQ} * {k}")], dtype=i64)
            mul = lambda v, c, what: b.op("Mul", [v, b.const(np.array([c], np.int64))], name=f"{p}/{what}",  # noqa: E731
                                          shape=[1], dtype=i64)
            split = b.op("Concat", [mul(self.n_tok, d_conv, "n_win_rows"), mul(self.n_seq, k, "n_final_rows")],
                         {"axis": 0}, name=f"{p}/split", shape=[2], dtype=i64)
            self._idx[d_conv] = (rows, split)
        return self._idx[d_conv]

    def conv(self, b, mixer, xBC, past_conv_state, p: str):
        ir = _ir()
        s = mixer.spec
        K, C, k = s.d_conv, s.conv_dim, s.d_conv - 1
        f32 = ir.DataType.FLOAT
        dt = xBC.dtype
        T, S = ir.SymbolicDim(TOKENS), ir.SymbolicDim(NSEQ)
        rows, split = self._indices(b, K)
        i64 = ir.DataType.INT64

        def rows_shape(n, kk, what):  # (n, kk, C): n a (1,) int64 value; a 0 stays 0 (allowzero below)
            return b.op("Concat", [n, b.const(np.array([kk, C], np.int64))], {"axis": 0}, name=f"{p}{what}_shape",
                        shape=[3], dtype=i64)

        st = b.op("Transpose", [b.cast(past_conv_state, dt, f"{p}past_conv")], {"perm": [0, 2, 1]},
                  name=f"{p}past_conv_rows", shape=[S, k, C], dtype=dt)
        st = b.op("Reshape", [st, b.const(np.array([-1, C], np.int64))], name=f"{p}past_conv_flat",
                  shape=[ir.SymbolicDim(f"{NSEQ} * {k}"), C], dtype=dt)
        tok = b.op("Reshape", [xBC, b.const(np.array([-1, C], np.int64))], name=f"{p}xBC_rows", shape=[T, C], dtype=dt)
        ext = b.op("Concat", [st, tok], {"axis": 0}, name=f"{p}conv_rows",
                   shape=[ir.SymbolicDim(f"{NSEQ} * {k} + {TOKENS}"), C], dtype=dt)
        # every token's window and every sequence's final conv state in one Gather, split at once: a Gather of the
        # final rows apart would keep ext alive until the present_conv_state branch runs, which ONNX Runtime's
        # default order puts after the logits (every layer's ext at once)
        gathered = b.op("Gather", [ext, rows], {"axis": 0}, name=f"{p}conv_gathered",
                        shape=[ir.SymbolicDim(f"{TOKENS} * {K} + {NSEQ} * {k}"), C], dtype=dt)
        win_rows, fin_rows = b.op("Split", [gathered, split], {"axis": 0}, name=f"{p}conv_split",
                                  shape=[[ir.SymbolicDim(f"{TOKENS} * {K}"), C], [ir.SymbolicDim(f"{NSEQ} * {k}"), C]],
                                  dtype=[dt, dt], outputs=2)
        windows = b.op("Reshape", [b.cast(win_rows, f32, f"{p}conv_windows_float"),
                                   rows_shape(self.n_tok, K, "conv_windows")], {"allowzero": 1},
                       name=f"{p}conv_windows", shape=[T, K, C], dtype=f32)
        conv = mixer.conv1d
        taps = b.derived(("packed_conv_taps", id(conv.weight)),
                         lambda: conv.weight.detach().float().reshape(C, K).T.contiguous().numpy(), f"{p}conv_taps")
        acc = b.op("ReduceSum", [b.op("Mul", [windows, taps], name=f"{p}conv_products", shape=[T, K, C], dtype=f32),
                                 b.const(np.array([1], np.int64))], {"keepdims": 0}, name=f"{p}conv1d", shape=[T, C],
                   dtype=f32)
        if conv.bias is not None:
            acc = b.op("Add", [acc, b.float_weight(conv.bias, f"{p}conv_bias_float")], name=f"{p}conv1d_bias",
                       shape=[T, C], dtype=f32)
        c = b.cast(b.silu(acc, f"{p}conv_silu"), dt, f"{p}conv_out")
        ct = b.op("Unsqueeze", [c, b.const(np.array([0], np.int64))], name=f"{p}xBC_conv", shape=[1, T, C], dtype=dt)
        present = b.op("Reshape", [fin_rows, rows_shape(self.n_seq, k, "final_conv_rows")], {"allowzero": 1},
                       name=f"{p}final_conv_rows", shape=[S, k, C], dtype=dt)
        present = b.op("Transpose", [present], {"perm": [0, 2, 1]}, name=f"{p}present_conv_state", shape=[S, C, k],
                       dtype=dt)
        return ct, present


def _ir():
    import onnx_ir as ir

    return ir


def build_packed(model, io: GraphIO, opset: int):
    """The packed prefill graph of ``model`` (onnx_ir Model; SSMScanPacked nodes, no functions attached yet).

    ``io``: the regular graph's :class:`GraphIO` (the packed one is :func:`packed_io` of it). Initializers carry
    the regular graph's names (``model.<parameter>``), so the shared weights file stores them once.
    Raises ParameterError for a model :func:`check_packable` refuses.
    """
    from m2export.exporter import build
    from m2export.exporter.stamp import initializer_names, model_builder

    check_packable(model)
    pio = packed_io(io)
    out = build.new_model(opset)
    graph = out.graph
    b = model_builder(graph, initializer_names(model), {})
    ids = build.graph_input(pio.input("input_ids"))
    cu = build.graph_input(pio.input(contract.CU_SEQLENS.name))
    graph.inputs.extend([ids, cu])
    packing = Packing(b, ids, cu)
    h, _ = build.embed(b, model, ids)
    presents = []
    for i, layer in enumerate(model.backbone.layers):
        layer_io = [s for s in pio.states if s.layer == i]
        past = [build.graph_input(s.past) for s in layer_io]
        graph.inputs.extend(past)
        h, new = build.mamba_layer(b, layer, h, past, f"layers.{i}/", packing=packing)
        for s, v in zip(layer_io, new):
            v = packing.poison(b, v, f"layers.{i}/{s.kind}_checked")
            v.name = s.present.name
            presents.append(v)
    # the poison on the head's input (h: NaN rows give NaN logits everywhere), not on the logits: a Where on the
    # logits is a second vocabulary-sized tensor beside them at the run's peak
    logits = build.head(b, model, packing.poison(b, h, "head/h_checked"))
    logits.name = "logits"
    graph.outputs.extend([logits, *presents])
    if [v.name for v in graph.inputs] != pio.input_names() or [v.name for v in graph.outputs] != pio.output_names():
        from m2export.errors import InternalError

        raise InternalError("packed graph I/O differs from its GraphIO")
    return out, pio


__all__ = ["PACKED_FILE", "PACKED_ROLE", "NSEQ", "TOKENS", "Packing", "build_packed", "check_packable",
           "check_packed_feed", "packed_feed", "packed_io"]
