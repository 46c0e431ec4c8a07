"""The one description of the exported graphs' inputs and outputs (optimum's OnnxConfig idea).

Everything that feeds, reads or builds an exported graph takes its names, symbolic shapes, dtypes, the
past -> present pairing and the zero (fresh-sequence) feeds from :class:`GraphIO`; nothing re-derives
them from names. :class:`GraphIO` is built from the model's per-layer runtime-state description
(:func:`model_states`) and the export dtype, and is stored in / read back from ``m2export.json``
(:meth:`GraphIO.to_manifest`, :meth:`GraphIO.from_manifest`).

Names (the interface users see in ONNX Runtime / TensorRT), per layer i:

===============  =================================  ==================================  ============================
state            input                              output                              dtype
===============  =================================  ==================================  ============================
Mamba conv       ``past_conv_state.{i}``            ``present_conv_state.{i}``          model dtype
Mamba SSM        ``past_ssm_state.{i}``             ``present_ssm_state.{i}``           float32 (whatever --dtype)
attention key    ``past_key_values.{i}.key``        ``present.{i}.key``                 model dtype
attention value  ``past_key_values.{i}.value``      ``present.{i}.value``               model dtype
===============  =================================  ==================================  ============================

Each state's axis order in a graph is its ``layout`` (:data:`STATE_AXES` names the model's, which the PyTorch
reference, the SSMScan contract and the ssmscan/std flavours (and TensorRT) use; :data:`STATE_LAYOUTS` the
flavours that differ): the native flavour keeps ``ssm_state`` as (batch_size, nheads, d_state, headdim), the
state layout of ONNX Runtime's LinearAttention, so its one-token step yields y without another pass over the
state (its ``conv_state`` is the model's, as the channels-first CausalConvWithState keeps it). Runtimes pass states through by name; anything comparing a graph's states with the model's goes through
:meth:`StateIO.to_model_layout` / :meth:`StateIO.to_graph_layout`.

Attention names and axes follow optimum (``OnnxConfigWithPast.add_past_key_values``): the key/value caches
are (batch_size, num_key_value_heads, past_sequence_length, head_dim) in and
(batch_size, num_key_value_heads, past_sequence_length + sequence_length, head_dim) out. Mamba states have
no sequence axis. ``input_ids`` is (batch_size, sequence_length) int64; ``logits`` (batch_size,
sequence_length, vocab_size) in the model dtype. A fresh sequence feeds zeros (KV caches with
past_sequence_length 0).

sequence_length >= 1: an empty prompt has no token to continue from, and m2export's runners
(:class:`~m2export.exporter.runtime.Decoder`: generate, check, OrtModel), ``m2export generate`` and
onnxruntime-genai ("input_ids is empty") refuse it with one line. In ONNX Runtime the std and native graphs
fail on sequence_length 0 (ORT's ``Conv`` has no empty output; padding it would slow every call's conv), while
the ssmscan and packed graphs return empty logits and the states unchanged.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from m2export.names import FLAVOURS

PREFILL_FILE = "model.onnx"
#: the one external-data file every graph of an export folder keeps its weights in
WEIGHTS_FILE = "model.onnx.data"
#: role of the one graph per flavour: prefill, and decode at sequence_length 1
GRAPH_ROLE = "prefill+decode"
MANIFEST_FILE = "m2export.json"
#: the lowest default-domain ONNX opset m2export exports (and reads back from a manifest)
MIN_OPSET = 18
#: TensorRT timing cache ``m2export build`` reuses and updates in OUTDIR (by default)
TIMING_CACHE_FILE = ".timing.cache"
SSM_IMPLS = tuple(FLAVOURS)  # graph flavours ("ssmscan", "std", "native"): m2export/names.py
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}

BATCH = "batch_size"
SEQ = "sequence_length"
PAST_SEQ = "past_sequence_length"
TOTAL_SEQ = "past_sequence_length + sequence_length"
#: the symbolic axes a graph input may carry (``m2export build`` profiles exactly these)
INPUT_AXES = (BATCH, SEQ, PAST_SEQ)

#: :attr:`StateSpec.dtype` of a state in the export dtype (the other value is "float32")
MODEL_DTYPE = "model"


@dataclass(frozen=True)
class StateSpec:
    """One runtime-state tensor of one layer, as the model describes it (the fields of
    ``m2export.models.spec.StateSpec``).

    ``kind``: "conv_state" | "ssm_state" | "key" | "value" (names in the module docstring). ``shape``: ints
    and the axis names :data:`BATCH` and :data:`PAST_SEQ` (the axis that grows by ``sequence_length`` per
    call: KV caches). ``dtype``: "model" (the export dtype) or "float32" (whatever the export dtype: Mamba
    ssm_state).
    """

    layer: int
    kind: str
    shape: tuple[int | str, ...]
    dtype: str


#: kind -> (input name, output name) templates
STATE_NAMES: dict[str, tuple[str, str]] = {
    "conv_state": ("past_conv_state.{i}", "present_conv_state.{i}"),
    "ssm_state": ("past_ssm_state.{i}", "present_ssm_state.{i}"),
    "key": ("past_key_values.{i}.key", "present.{i}.key"),
    "value": ("past_key_values.{i}.value", "present.{i}.value"),
}


#: the axes of each state kind in the model's layout (the order of :attr:`StateSpec.shape`: the PyTorch model's,
#: the SSMScan contract's), by name; m2export.json records each graph's order of them (:attr:`StateIO.layout`)
STATE_AXES: dict[str, tuple[str, ...]] = {
    "conv_state": (BATCH, "conv_dim", "d_conv - 1"),
    "ssm_state": (BATCH, "nheads", "headdim", "d_state"),
    "key": (BATCH, "num_key_value_heads", PAST_SEQ, "head_dim"),
    "value": (BATCH, "num_key_value_heads", PAST_SEQ, "head_dim"),
}
#: flavour -> state kind -> that state's axes in the flavour's graph I/O, where they differ from
#: :data:`STATE_AXES`: the native flavour keeps its states as ONNX Runtime's kernels do
#: (m2export/exporter/native_ort.py): ssm_state as LinearAttention's (b, h, d_k, d_v) state with d_k = d_state,
#: d_v = headdim (a decode token transposes no state; conv_state stays the model's (b, conv_dim, d_conv - 1), as
#: the channels-first CausalConvWithState reads and writes it); every other flavour (ssmscan, std, and TensorRT's
#: engines, built from ssmscan) keeps the model's layout
STATE_LAYOUTS: dict[str, dict[str, tuple[str, ...]]] = {
    "native": {"ssm_state": (BATCH, "nheads", "d_state", "headdim")},
}


def _mamba2_states(cfg) -> list[StateSpec]:
    """Runtime states of a pure Mamba-2 config without a layer-stack description: per layer conv_state
    (batch, conv_dim, d_conv - 1) in the model dtype, ssm_state (batch, nheads, headdim, d_state) float32
    (m2export/models/mamba2.py)."""
    return [st for i in range(cfg.n_layer) for st in (
        StateSpec(i, "conv_state", (BATCH, cfg.conv_dim, cfg.d_conv - 1), MODEL_DTYPE),
        StateSpec(i, "ssm_state", (BATCH, cfg.nheads, cfg.headdim, cfg.d_state), "float32"))]


def model_states(cfg) -> list:
    """Every runtime state of the model ``cfg`` describes, layer by layer, in the flat order of the model's
    ``forward_states(input_ids, past)``: a layer-stack description (``ModelSpec.states()``, or a config's
    ``to_spec()``) answers for itself; a plain Mamba-2 config has conv_state and ssm_state per layer."""
    if callable(getattr(cfg, "states", None)):
        return list(cfg.states())
    if callable(getattr(cfg, "to_spec", None)):
        return list(cfg.to_spec().states())
    return _mamba2_states(cfg)


@dataclass(frozen=True)
class TensorIO:
    """One graph input or output: ``name``, symbolic ``shape`` (ints and axis names), ONNX ``dtype`` name."""

    name: str
    shape: tuple[int | str, ...]
    dtype: str  # int64 | float32 | float16 | bfloat16

    def concrete(self, **axes: int) -> tuple[int, ...]:
        """The shape with every axis name replaced by its value (``batch_size=2, past_sequence_length=0``;
        a sum of axis names, as in the KV-cache outputs, is evaluated)."""
        key = {BATCH: "batch_size", SEQ: "sequence_length", PAST_SEQ: "past_sequence_length"}
        out = []
        for d in self.shape:
            if isinstance(d, int):
                out.append(d)
                continue
            total = 0
            for term in d.split("+"):
                term = term.strip()
                if key.get(term) not in axes:
                    raise KeyError(f"{self.name}: axis {term!r} needs a value")
                total += int(axes[key[term]])
            out.append(total)
        return tuple(out)


@dataclass(frozen=True)
class StateIO:
    """One per-layer state: the ``past`` input that the ``present`` output of the previous call feeds.

    ``layout``: the names of :data:`STATE_AXES` ``[kind]`` in the order the graph's ``past``/``present`` tensors
    have them (their shapes are in that order); None for a kind without named axes (the model's order).
    """

    layer: int
    kind: str
    past: TensorIO
    present: TensorIO
    layout: tuple[str, ...] | None = None

    @property
    def perm(self) -> tuple[int, ...] | None:
        """The graph tensor's axes as positions in the model's layout (``graph = model.transpose(perm)``); None when
        the graph keeps the model's layout."""
        model = STATE_AXES.get(self.kind)
        if self.layout is None or model is None or tuple(self.layout) == model:
            return None
        return tuple(model.index(a) for a in self.layout)

    def to_graph_layout(self, array):
        """A state array in the model's layout (the PyTorch reference's) -> this graph's (numpy, C-contiguous);
        ``array`` itself when the layouts agree."""
        import numpy as np

        p = self.perm
        return array if p is None else np.ascontiguousarray(np.transpose(array, p))

    def to_model_layout(self, array):
        """This graph's state array -> the model's layout (numpy, C-contiguous); ``array`` itself when they agree."""
        import numpy as np

        p = self.perm
        return array if p is None else np.ascontiguousarray(np.transpose(array, np.argsort(p)))


@dataclass(frozen=True)
class GraphIO:
    """Inputs, outputs and state pairing of the exported graph of one model in one dtype.

    Build with :meth:`for_model` (exporter, PyTorch reference) or :meth:`from_manifest` (anything that only
    has an export folder). ``decode`` graphs have ``sequence_length`` fixed to 1.
    """

    inputs: tuple[TensorIO, ...]
    outputs: tuple[TensorIO, ...]
    states: tuple[StateIO, ...]

    #: default ONNX opset: 18 is the first where the dynamo exporter's default decompositions and
    #: ``onnxscript`` agree and that TensorRT 10.x parses fully; the SSMScan domain is version 1
    DEFAULT_OPSET = 18
    #: validation tolerances (atol) of logits vs PyTorch fp32, per export dtype
    ATOL: tuple[tuple[str, float], ...] = (("fp32", 1e-4), ("fp16", 5e-2), ("bf16", 1e-1))

    @classmethod
    def for_model(cls, cfg, dtype: str = "fp32", *, decode: bool = False, flavour: str | None = None) -> "GraphIO":
        """The I/O of ``cfg``'s graph exported in ``dtype`` ("fp32" | "fp16" | "bf16"); ``flavour`` (m2export/names.py)
        picks its state layouts (:data:`STATE_LAYOUTS`; None: the model's layout, as the PyTorch reference has it).
        Raises ValueError for an unknown dtype or flavour."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {list(DTYPES)}, got {dtype!r}")
        if flavour is not None and flavour not in SSM_IMPLS:
            raise ValueError(f"flavour: expected one of {list(SSM_IMPLS)} or None, got {flavour!r}")
        layouts = STATE_LAYOUTS.get(flavour, {})
        model_dt = DTYPES[dtype]
        seq = 1 if decode else SEQ
        states = []
        for s in model_states(cfg):
            past_name, present_name = (t.format(i=s.layer) for t in STATE_NAMES[s.kind])
            dt = "float32" if s.dtype == "float32" else model_dt
            model_axes = STATE_AXES.get(s.kind)
            layout = layouts.get(s.kind, model_axes)
            shape = tuple(s.shape) if layout == model_axes else tuple(s.shape[model_axes.index(a)] for a in layout)
            present = tuple((TOTAL_SEQ if not decode else f"{PAST_SEQ} + 1") if d == PAST_SEQ else d
                            for d in shape)
            states.append(StateIO(s.layer, s.kind, TensorIO(past_name, shape, dt),
                                  TensorIO(present_name, present, dt), layout))
        vocab = cfg.vocab_size  # the true vocabulary (Mamba2Config and ModelSpec alike), not the padded rows
        ins = (TensorIO("input_ids", (BATCH, seq), "int64"), *(s.past for s in states))
        outs = (TensorIO("logits", (BATCH, seq, vocab), model_dt), *(s.present for s in states))
        return cls(ins, outs, tuple(states))

    # ------------------------------------------------------------------ lookups
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def input(self, name: str) -> TensorIO:
        for t in self.inputs:
            if t.name == name:
                return t
        raise KeyError(name)

    def output(self, name: str) -> TensorIO:
        for t in self.outputs:
            if t.name == name:
                return t
        raise KeyError(name)

    @property
    def n_layer(self) -> int:
        return 1 + max((s.layer for s in self.states), default=-1)

    # ------------------------------------------------------------------ feeds
    def zero_feeds(self, batch: int, np_dtype: Callable[[str], Any]) -> "OrderedDict[str, Any]":
        """Fresh-sequence ``past`` feeds for ``batch`` sequences: zeros (KV caches with past length 0).

        ``np_dtype`` maps an ONNX dtype name to the numpy dtype the runtime takes (see
        :func:`m2export.exporter.runtime.numpy_dtype`: bfloat16 as ml_dtypes' type, or float32 for runners
        that carry bf16 as float32).
        """
        import numpy as np

        return OrderedDict((s.past.name, np.zeros(s.past.concrete(batch_size=batch, past_sequence_length=0),
                                                  dtype=np_dtype(s.past.dtype))) for s in self.states)

    def state(self, name: str) -> StateIO:
        """The state whose ``past`` or ``present`` is called ``name``. Raises KeyError."""
        for s in self.states:
            if name in (s.past.name, s.present.name):
                return s
        raise KeyError(name)

    def next_past(self, outputs: Mapping[str, Any], copy: bool = True) -> "OrderedDict[str, Any]":
        """The ``past`` feeds that continue a sequence after a call that returned ``outputs``."""
        import numpy as np

        return OrderedDict((s.past.name, np.array(outputs[s.present.name], copy=True) if copy
                            else outputs[s.present.name]) for s in self.states)

    # ------------------------------------------------------------------ manifest
    def to_manifest(self) -> dict[str, Any]:
        """JSON form stored per graph in m2export.json: inputs/outputs name -> {dtype, shape}, and the states
        (layer, kind, past and present names, and the layout: the state's axis names in the graph's order)."""
        return {"inputs": {t.name: {"dtype": t.dtype, "shape": list(t.shape)} for t in self.inputs},
                "outputs": {t.name: {"dtype": t.dtype, "shape": list(t.shape)} for t in self.outputs},
                "states": [{"layer": s.layer, "kind": s.kind, "past": s.past.name, "present": s.present.name,
                            **({"layout": list(s.layout)} if s.layout is not None else {})} for s in self.states]}

    @classmethod
    def from_manifest(cls, inputs: Mapping[str, Any], outputs: Mapping[str, Any],
                      states: list[Mapping[str, Any]]) -> "GraphIO":
        """Inverse of :meth:`to_manifest`; a state without a ``layout`` (m2export.json written before the field)
        has the model's (:data:`STATE_AXES`), as every graph then had."""
        ins = {k: TensorIO(k, tuple(v["shape"]), v["dtype"]) for k, v in inputs.items()}
        outs = {k: TensorIO(k, tuple(v["shape"]), v["dtype"]) for k, v in outputs.items()}
        st = tuple(StateIO(int(s["layer"]), s["kind"], ins[s["past"]], outs[s["present"]],
                           tuple(s["layout"]) if s.get("layout") is not None else STATE_AXES.get(s["kind"]))
                   for s in states)
        return cls(tuple(ins.values()), tuple(outs.values()), st)

