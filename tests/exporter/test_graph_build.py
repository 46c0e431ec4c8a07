"""Graph pieces built without tracing (m2export/exporter/build.py) vs the traced graph and vs PyTorch.

Every variant of the Mamba-2 layer the model description allows is built and traced from one random model
(tied / untied embeddings, ngroups 1 and 2, a norm group smaller than the groups, norm before / after the gate,
the plain gate, in_proj / out_proj biases, no conv bias, a dt_limit, the residual in float32 or the model
dtype), in float32 and float16. Both graphs run in ONNX Runtime on fresh random inputs and random initial
states (prefill L=1, L < chunk, L = 2 chunks + 1, batch 2) and through the state I/O (a prefill, then decode
tokens fed back), and are compared with each other and with the PyTorch model; the std and native flavours
made from the built graph are compared with PyTorch too. The one difference between built and traced graphs
is ``A = -exp(A_log)``: built with torch's exp (the PyTorch model's value), folded by onnxscript with numpy's,
which can differ in the last bit, hence a tolerance instead of equality.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from m2export.exporter import export as E
from m2export.exporter.configs import GraphIO
from m2export.exporter.native_ort import to_native_ort
from m2export.exporter.ssm_scan_op import _elem_type
from m2export.models.mamba2 import HybridLM, init_weights_
from m2export.models.spec import LayerSpec, MambaSpec, ModelSpec
from tests.helpers import rel_l2

ort = pytest.importorskip("onnxruntime")

OPSET = GraphIO.DEFAULT_OPSET
CHUNK = 8
VOCAB = 96
#: name -> (MambaSpec fields, ModelSpec fields)
VARIANTS = {
    "g2_tied": (dict(ngroups=2), dict(tie_embeddings=True, residual_in_fp32=True)),
    "g1_untied_dtlimit_biases": (dict(ngroups=1, bias=True, out_bias=True, conv_bias=False, dt_limit=(0.002, 0.08)),
                                 dict(tie_embeddings=False, residual_in_fp32=True)),
    "g2_norm_before_gate_residual_model_dtype": (dict(ngroups=2, norm_before_gate=True, d_state=8),  # 8 != headdim
                                                 dict(tie_embeddings=False, residual_in_fp32=False)),
    "g1_norm_groups_4": (dict(ngroups=1, norm_group_size=32), dict(tie_embeddings=True, residual_in_fp32=True)),
    "g2_gate_no_norm": (dict(ngroups=2, norm="gate"), dict(tie_embeddings=True, residual_in_fp32=False)),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
#: rel-L2 bounds: built vs traced graph (the A rounding above), ORT vs PyTorch (fp16: ORT's fp16 kernels
#: round differently from PyTorch's CPU ones)
VS_TRACED = {"fp32": 1e-6, "fp16": 2e-3}
VS_TORCH = {"fp32": 1e-5, "fp16": 1e-2}


def _model(name: str, dtype: str) -> HybridLM:
    mamba_kw, model_kw = VARIANTS[name]
    mixer = MambaSpec(**{"d_model": 64, "nheads": 8, "headdim": 16, "d_state": 16, "chunk_size": CHUNK, **mamba_kw})
    spec = ModelSpec("mamba2", 64, VOCAB, (LayerSpec(mixer=mixer), LayerSpec(mixer=mixer)), **model_kw)
    torch.manual_seed(0)
    model = init_weights_(HybridLM(spec), seed=7)
    with torch.no_grad():  # non-default norm weights and biases (init leaves ones / zeros)
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith("norm_f.weight") or n.endswith(".bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model.to(DTYPES[dtype]).eval()


def _session(model_ir):
    import onnx_ir as ir

    return ort.InferenceSession(ir.serde.serialize_model(model_ir).SerializeToString(),
                                providers=["CPUExecutionProvider"])


def _graphs(model, dtype):
    io = GraphIO.for_model(model.spec, dtype)
    out = {}
    for how, build_pieces in (("built", True), ("traced", False)):
        g = E._trace(model, io, OPSET, build_pieces=build_pieces)
        E._rename_dims(g, io)
        E._attach_function(g, OPSET)
        out[how] = g
    return io, out


def _feeds(io, ids, states):
    return {"input_ids": ids.numpy(), **{s.past.name: t.numpy() for s, t in zip(io.states, states)}}


def _random_states(io, batch, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s.past.concrete(batch_size=batch, past_sequence_length=0), generator=g)
            .to({"float32": torch.float32, "float16": torch.float16}[s.past.dtype]) for s in io.states]


def _check(name, ref: list[torch.Tensor], out: list[np.ndarray], rel: float, io) -> None:
    for n, r, o in zip(io.output_names(), ref, out):
        err = rel_l2(r.float(), torch.from_numpy(o.astype(np.float32)))
        assert np.isfinite(o).all() and err <= rel, f"{name} {n}: rel-L2 {err:.3g} > {rel:g}"


@pytest.fixture(scope="module", params=[(v, d) for v in VARIANTS for d in DTYPES], ids=lambda p: f"{p[0]}-{p[1]}")
def variant(request):
    name, dtype = request.param
    model = _model(name, dtype)
    io, graphs = _graphs(model, dtype)
    return name, dtype, model, io, graphs


@pytest.mark.parametrize("batch,seqlen", [(2, 1), (2, 5), (2, 2 * CHUNK + 1)],
                         ids=["L1", "L_lt_chunk", "L_2chunks_plus_1"])
def test_built_equals_traced_and_pytorch(variant, batch, seqlen):
    name, dtype, model, io, graphs = variant
    ids = torch.randint(0, VOCAB, (batch, seqlen), generator=torch.Generator().manual_seed(seqlen))
    states = _random_states(io, batch, seed=seqlen + 1)
    with torch.no_grad():
        ref = model.forward_states(ids, [t.clone() for t in states])
    ref = [ref.logits, *ref.states]
    built, traced = (_session(graphs[k]).run(None, _feeds(io, ids, states)) for k in ("built", "traced"))
    _check(f"{name} {dtype} built vs traced", [torch.from_numpy(t.astype(np.float32)) for t in traced], built,
           VS_TRACED[dtype], io)
    _check(f"{name} {dtype} built vs PyTorch", ref, built, VS_TORCH[dtype], io)
    _check(f"{name} {dtype} traced vs PyTorch", ref, traced, VS_TORCH[dtype], io)


@pytest.mark.parametrize("flavour", ["ssmscan", "std", "native"])
def test_built_flavours_decode_through_states(variant, flavour):
    """A prefill of 5 tokens then 3 decode tokens fed back through the state I/O equal PyTorch's one
    8-token run, in every flavour made from the built graph (the states in the flavour's layout: random past
    states go in through :meth:`StateIO.to_graph_layout`, the presents come back through ``to_model_layout``)."""
    name, dtype, model, io, graphs = variant
    g = graphs["built"]
    gio = GraphIO.for_model(model.spec, dtype, flavour=flavour)
    if flavour == "std":
        g = g.clone()
        E._inline(g)
    elif flavour == "native":
        g = to_native_ort(g, model.spec.layers[0].mixer.nheads, len(model.spec.layers), E._inline, gio)
    sess = _session(g)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    states = _random_states(io, 2, seed=4)
    with torch.no_grad():
        ref = model.forward_states(ids, [t.clone() for t in states])
    feeds = {"input_ids": ids[:, :5].numpy(), **{s.past.name: s.to_graph_layout(t.numpy())
                                                 for s, t in zip(gio.states, states)}}
    logits = []
    for t in range(5, 9):
        out = dict(zip(gio.output_names(), sess.run(None, feeds)))
        logits.append(out["logits"][:, -1])
        if t == 8:
            break
        feeds = {"input_ids": ids[:, t:t + 1].numpy(), **gio.next_past(out)}
    got = [np.stack(logits, 1), *(s.to_model_layout(out[s.present.name]) for s in gio.states)]
    want = [ref.logits[:, 4:], *ref.states]
    _check(f"{name} {dtype} {flavour} decode", want, got, VS_TORCH[dtype], io)


def test_built_graph_structure(variant):
    """No traced leftovers: no shape arithmetic, one SSMScan and one Conv per layer, the tied embedding stored
    once, graph I/O exactly GraphIO's (names, dtypes, symbolic axes)."""
    name, dtype, model, io, graphs = variant
    g = graphs["built"]
    ops = [n.op_type for n in g.graph]
    assert ops.count("SSMScan") == ops.count("Conv") == len(model.spec.layers)
    assert not {"Shape", "Squeeze", "Unsqueeze", "Constant"} & set(ops)
    for v, t in zip([*g.graph.inputs, *g.graph.outputs], [*io.inputs, *io.outputs], strict=True):
        assert v.name == t.name and int(v.dtype) == _elem_type(t.dtype)
        assert [d if isinstance(d, int) else d.value for d in v.shape] == list(t.shape)
    weights = [v for v in g.graph.initializers.values() if len(v.shape) == 2 and VOCAB in v.shape]
    assert len(weights) == (1 if model.spec.tie_embeddings else 2)  # a tied matrix once: the head's (d_model, vocab)


def test_pure_mamba2_export_never_traces(tmp_path):
    """A pure Mamba-2 export (a fresh interpreter) imports neither torch._dynamo nor torch.onnx nor onnxscript."""
    from m2export.models.checkpoint import random_checkpoint

    ck = random_checkpoint(tmp_path / "ck", d_model=64, n_layer=2, vocab_size=100, d_state=16, headdim=16,
                           chunk_size=8, ngroups=2)
    code = ("import sys; from m2export.exporter import export_model; "
            f"export_model({str(ck)!r}, {str(tmp_path / 'out')!r}); "
            "print(sorted(m for m in sys.modules if m.split('.')[:2] in (['torch', '_dynamo'], ['torch', 'onnx']) "
            "or m.split('.')[0] == 'onnxscript'))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "[]", res.stdout[-2000:]
    assert (tmp_path / "out" / "model.onnx").is_file()
