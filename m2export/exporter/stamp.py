"""The export graph of an n-layer model composed from pieces: built directly where m2export has a builder
(:mod:`m2export.exporter.build`: the embedding, Mamba-2 layers, final norm and head; a pure Mamba-2 model is
built entirely and nothing is traced), else each distinct layer kind traced once and stamped per layer.

``torch.onnx.export`` of a whole 24-layer mamba2-130m spent ~88% of the export in torch.export's tracing
and decompositions (cProfile, benchmarks/RESULTS.md "export speed"), once per layer although the layers
differ only in their weights. Here the model is traced in pieces that share its modules (no weight copies),
each with the dynamic axes of :class:`~m2export.exporter.configs.GraphIO`:

* ``embed``: ``input_ids -> (h, emb)`` (:meth:`HybridLM.embed`);
* one trace per distinct layer kind: ``(h, [emb], *past states) -> (h, *present states)``
  (:meth:`Layer.forward`), two layers being of one kind when their :class:`~m2export.models.spec.LayerSpec`,
  their parameter and buffer names, shapes and dtypes and the aliasing among them are equal;
* ``head``: ``h -> logits`` (:meth:`HybridLM.head`).

:func:`trace_stamped` then builds one onnx_ir graph with the inputs and outputs of ``GraphIO``: the embed
nodes, every layer's kind's nodes cloned with that layer's own weights (the same torch tensors the full
trace would reference) and the head nodes. The composition computes what ``HybridLM.forward_states`` does
(it is ``head(layers(embed(ids)))``), so the graph is the full trace's up to value names; the exporter's
optimisation passes then run on the whole graph as before (only when something was traced: built pieces have
nothing to fold). Built pieces take the composed graph's values in place of the traced pieces' inputs and
register the model's tensors under the same names (one initializer per tensor, aliases included).
"""

from __future__ import annotations

import torch

from m2export.exporter.configs import BATCH, PAST_SEQ, SEQ, GraphIO


class CannotStamp(Exception):
    """The model does not have the embed / layers / head structure stamping needs (fall back to one trace)."""


class _Embed(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model.embed(input_ids)


class _Head(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, h):
        return self.model.head(h)


class _LayerStep(torch.nn.Module):
    """One layer as a traceable module: ``forward(h, emb, states) -> (h, *new states)``."""

    def __init__(self, layer, shared_blocks):
        super().__init__()
        self.layer = layer
        self.shared = shared_blocks  # None, or the model's shared blocks (Zamba2)

    def forward(self, h, emb, states: list):
        h, new = self.layer(h, list(states), emb, self.shared)
        return (h, *new)


def _tensors(module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` by its relative name, aliases included."""
    return {**dict(module.named_parameters(remove_duplicate=False)),
            **dict(module.named_buffers(remove_duplicate=False))}


def initializer_names(model) -> dict[int, str]:
    """id(tensor) -> its initializer name in a whole-model trace: the wrapper's ``model.`` prefix and, for aliases
    (a tied lm_head), the last name, as torch.export keeps it."""
    return {id(t): "model." + n for n, t in _tensors(model).items()}


def model_builder(graph, names: dict[int, str], inits: dict):
    """A :class:`~m2export.exporter.build.Builder` appending to ``graph`` (an onnx_ir Graph).

    ``weight(t)`` is the initializer of model tensor ``t``, named ``names[id(t)]`` (:func:`initializer_names`);
    ``derived(key, make, name)`` the initializer of a value computed from model tensors (``make()`` -> numpy array,
    called once per ``key``). ``inits`` (key -> initializer value) is shared with the caller's other initializers,
    so each tensor or derived value becomes one initializer of the graph.
    """
    import onnx_ir as ir

    from m2export.exporter import build

    def derived(key, make, name):
        if key not in inits:
            a = make()
            nv = ir.Value(name=name, shape=ir.Shape(a.shape), type=ir.TensorType(ir.DataType.from_numpy(a.dtype)),
                          const_value=ir.Tensor(a, name=name))
            graph.register_initializer(nv)
            inits[key] = nv
        return inits[key]

    return build.Builder(graph, lambda t: derived(id(t), lambda: t.detach().numpy(), names[id(t)]), derived)


def _kind_key(step: _LayerStep) -> tuple:
    tensors = _tensors(step)
    first: dict[int, int] = {}
    alias = tuple(first.setdefault(id(t), k) for k, t in enumerate(tensors.values()))
    return (repr(step.layer.spec), tuple((n, tuple(t.shape), t.dtype) for n, t in tensors.items()), alias)


def trace_stamped(model, io: GraphIO, opset: int, trace_module, *, build_pieces: bool = True):
    """The export graph of ``model`` (an onnx_ir Model, no optimisation run yet) from one trace per piece.

    Pieces with a builder (:mod:`m2export.exporter.build`: the embedding, Mamba-2 layers, the final norm and
    head in float32/float16) are built node by node instead of traced; ``trace_module`` is called only for
    the others (a pure Mamba-2 model calls it never, and torch.export is not touched).

    Args:
        model: a :class:`~m2export.models.mamba2.HybridLM` (``embed``, ``backbone.layers``, ``head``).
        io: its graph I/O; the composed graph's inputs and outputs carry exactly its names, in its order.
        opset: default ONNX opset of the traces.
        trace_module: ``trace_module(module, args, dynamic_shapes, input_names, output_names, opset)`` ->
            onnx_ir Model (one ``torch.onnx.export``, the exporter's settings and patches applied).
        build_pieces: False traces every piece (the tests compare both ways).
    Returns:
        ``(model_ir, traced)``: the composed onnx_ir Model and the number of pieces traced.
    Raises:
        CannotStamp: ``model`` lacks ``embed``/``head`` or a piece's graph has a subgraph attribute.
    """
    import onnx_ir as ir

    from m2export.exporter import build

    if not all(callable(getattr(model, a, None)) for a in ("embed", "head")) or not hasattr(model, "backbone"):
        raise CannotStamp("the model has no embed/head split")
    layers = list(model.backbone.layers)
    shared = model.backbone.shared_blocks if model.spec.shared_blocks else None
    n_states = [len(model.spec.layer_states(i)) for i in range(len(layers))]
    starts = [sum(n_states[:i]) for i in range(len(layers))]
    steps = [_LayerStep(layer, shared) for layer in layers]
    built = {"embed": build.can_build_embed(model), "head": build.can_build_head(model),
             **{i: build.can_build_layer(model, i) for i in range(len(layers))}}
    built = {k: v and build_pieces for k, v in built.items()}

    # ---------------------------------------------------------------- trace what has no builder
    pieces = {}
    if not all(built.values()):
        pieces = _trace_pieces(model, io, opset, trace_module, steps, built, n_states, starts)
    kind_of = pieces.pop("kind_of", None)

    # ---------------------------------------------------------------- compose
    names = initializer_names(model)
    base = pieces["embed"] if "embed" in pieces else build.new_model(opset)
    graph = base.graph
    inits: dict[object, ir.Value] = {}

    def init_value(v, tensor, key, name):
        if key not in inits:
            nv = ir.Value(name=name, shape=v.shape, type=v.type,
                          const_value=type(v.const_value)(tensor, name=name) if tensor is not None else v.const_value)
            graph.register_initializer(nv)
            inits[key] = nv
        return inits[key]

    builder = model_builder(graph, names, inits)

    def clone(piece, vmap, prefix, owner=None):
        """Append ``piece``'s nodes to ``graph``; ``vmap`` maps its inputs; initializers are ``owner``'s tensors."""
        own = _tensors(owner) if owner is not None else {}
        for name, v in piece.graph.initializers.items():
            t = own.get(name)
            if t is not None:
                vmap[v] = init_value(v, t, id(t), names.get(id(t), prefix + name))
            elif isinstance(getattr(v.const_value, "raw", None), torch.Tensor) and id(v.const_value.raw) in names:
                t = v.const_value.raw
                vmap[v] = init_value(v, t, id(t), names[id(t)])
            else:  # a constant of the code (same in every layer of the kind)
                vmap[v] = init_value(v, None, (id(piece), name), prefix + name)
        for node in piece.graph:
            if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
                raise CannotStamp(f"{node.op_type} node with a subgraph")
            new = ir.Node(node.domain, node.op_type, [None if x is None else vmap[x] for x in node.inputs],
                          attributes=list(node.attributes.values()), overload=node.overload,
                          num_outputs=len(node.outputs), version=node.version,
                          name=prefix + (node.name or ""), metadata_props=dict(node.metadata_props))
            for o, no in zip(node.outputs, new.outputs):
                no.name, no.type = prefix + (o.name or ""), o.type
                no.shape = o.shape.copy() if o.shape is not None else None
                vmap[o] = no
            graph.append(new)
        return [vmap[o] for o in piece.graph.outputs]

    if "embed" in pieces:  # the traced embed piece is the base graph: rename its initializers to the model's names
        for name, v in list(graph.initializers.items()):
            t = getattr(v.const_value, "raw", None)
            if isinstance(t, torch.Tensor) and id(t) in names:
                graph.initializers.pop(name)
                v.name = names[id(t)]
                graph.register_initializer(v)
                inits[id(t)] = v
        h, emb = graph.outputs[0], graph.outputs[1]
        graph.outputs.clear()
    else:
        ids = build.graph_input(io.input("input_ids"))
        graph.inputs.append(ids)
        h, emb = build.embed(builder, model, ids)
    presents: list[ir.Value] = []
    for i, step in enumerate(steps):
        layer_io = io.states[starts[i]:starts[i] + n_states[i]]
        if built[i]:
            past = [build.graph_input(s.past) for s in layer_io]
            graph.inputs.extend(past)
            h, new = build.mamba_layer(builder, step.layer, h, past, f"layers.{i}/")
        else:
            rep = kind_of[i]
            piece = pieces[rep]
            by_name = {v.name: v for v in piece.graph.inputs}
            vmap = {by_name[n]: v for n, v in (("h", h), ("emb", emb)) if n in by_name}
            rep_states = io.states[starts[rep]:starts[rep] + n_states[rep]]
            for s, r in zip(layer_io, rep_states):
                src = by_name.get(r.past.name)
                if src is None:
                    raise CannotStamp(f"the trace dropped the unused input {r.past.name}")
                pv = ir.Value(name=s.past.name, type=src.type,
                              shape=src.shape.copy() if src.shape is not None else None)
                graph.inputs.append(pv)
                vmap[src] = pv
            h, *new = clone(piece, vmap, f"layers.{i}/", owner=step)
        for s, v in zip(layer_io, new):
            if v.producer() is None or v in presents or v in graph.inputs:  # a state passed through unchanged
                ident = ir.node("Identity", [v])
                graph.append(ident)
                v = ident.outputs[0]
            v.name = s.present.name
            presents.append(v)
    if built["head"]:
        logits = build.head(builder, model, h)
    else:
        (logits,) = clone(pieces["head"], {pieces["head"].graph.inputs[0]: h}, "head/")
    logits.name = "logits"
    graph.outputs.extend([logits, *presents])
    for p in pieces.values():
        for k, ver in p.opset_imports.items():
            base.opset_imports.setdefault(k, ver)
    want = io.output_names()
    if [v.name for v in graph.outputs] != want or [v.name for v in graph.inputs] != io.input_names():
        raise CannotStamp("composed graph I/O differs from GraphIO")
    traced = len(pieces)
    return base, traced


def _trace_pieces(model, io, opset, trace_module, steps, built, n_states, starts) -> dict:
    """The traced pieces of the pieces without a builder: "embed", "head", one per distinct layer kind (keyed
    by its first layer's index), and "kind_of" (layer index -> that key, or None for built layers)."""
    from m2export.exporter.export import EXAMPLE_BATCH, EXAMPLE_PAST, EXAMPLE_SEQ, torch_dtype

    dims = {BATCH: torch.export.Dim(BATCH, min=1, max=1 << 16),
            SEQ: torch.export.Dim(SEQ, min=1, max=1 << 20),
            PAST_SEQ: torch.export.Dim("past_sequence_length", min=0, max=1 << 20)}

    def dyn(shape):
        return {k: dims[d] for k, d in enumerate(shape) if isinstance(d, str)}

    ids = torch.zeros(EXAMPLE_BATCH, EXAMPLE_SEQ, dtype=torch.long)
    with torch.no_grad():
        h0, emb0 = model.embed(ids)
    h0, emb0 = h0.clone(), emb0.clone()  # distinct tensors: torch.export would merge aliased inputs into one
    hshape = io.input("input_ids").shape + (h0.shape[-1],)
    pieces: dict = {}
    if not built["embed"]:
        pieces["embed"] = trace_module(_Embed(model), (ids,), {"input_ids": dyn(io.input("input_ids").shape)},
                                       ["input_ids"], ["h", "emb"], opset)
    if not built["head"]:
        pieces["head"] = trace_module(_Head(model), (h0,), {"h": dyn(hshape)}, ["h"], ["logits"], opset)
    kind_of: list[int | None] = []
    reps: dict[tuple, int] = {}
    for i, step in enumerate(steps):
        if built[i]:
            kind_of.append(None)
            continue
        rep = reps.setdefault(_kind_key(step), i)
        kind_of.append(rep)
        if rep != i:
            continue
        st = io.states[starts[i]:starts[i] + n_states[i]]
        states = [torch.zeros(s.past.concrete(batch_size=EXAMPLE_BATCH, past_sequence_length=EXAMPLE_PAST),
                              dtype=torch_dtype(s.past.dtype)) for s in st]
        pieces[i] = trace_module(step, (h0, emb0, states),
                                 {"h": dyn(hshape), "emb": dyn(hshape), "states": [dyn(s.past.shape) for s in st]},
                                 ["h", "emb", *(s.past.name for s in st)],
                                 ["h_out", *(s.present.name for s in st)], opset)
    pieces["kind_of"] = kind_of
    return pieces
