"""The ssmscan flavour with m2export::CausalConv1d and m2export::GatedRMSNorm (issue 18 item 3b) on the variants the
shared fixtures do not cover: a conv without bias, ngroups 1 and 3, fp16.

Each tiny checkpoint is exported with ``ssm_impl="both"``; the ssmscan graph must hold one node of each op per layer
and match the PyTorch model (fp32 rel-L2 1e-5; fp16 vs the fp32 model 1e-2), at L=1 (the one-token update), a
prefill and a prefill continued through the state I/O; the std graph has no node of the m2export domain and
matches the ssmscan one.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from m2export.exporter import OrtModel, export_model
from m2export.models.checkpoint import load_checkpoint, random_checkpoint
from tests.helpers import assert_close

pytest.importorskip("onnxruntime")

TINY = dict(d_model=48, n_layer=2, vocab_size=60, d_state=8, headdim=8, chunk_size=8)
VARIANTS = {
    "g3": dict(ngroups=3),  # norm_before_gate: only Falcon-H1 has it (test_hybrids_export.py)
    "no_conv_bias_g1": dict(ngroups=1, conv_bias=False),
    "fp16_g2": dict(ngroups=2, dtype="fp16"),
}
_DONE: dict = {}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    name = request.param
    if name not in _DONE:
        kw = dict(VARIANTS[name])
        dtype = kw.pop("dtype", "fp32")
        root = tmp_path_factory.mktemp(name)
        ck = random_checkpoint(root / "ck", seed=7, **TINY, **kw)
        export_model(ck, root / "out", ssm_impl="both", dtype=dtype)
        _DONE[name] = (name, ck, root / "out", dtype)
    return _DONE[name]


def test_structure(variant):
    name, ck, out, dtype = variant
    cfg = load_checkpoint(ck).model.cfg
    ssm = onnx.load(out / "model.onnx", load_external_data=False)
    ops = [n.op_type for n in ssm.graph.node]
    assert ops.count("CausalConv1d") == ops.count("GatedRMSNorm") == cfg.n_layer
    assert "Conv" not in ops and "ReduceMean" in ops  # the pre-norms stay standard ops
    for n in ssm.graph.node:
        if n.op_type == "GatedRMSNorm":
            a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
            assert a["group_size"] == cfg.d_inner // cfg.ngroups and a["norm_before_gate"] == int(cfg.norm_before_gate)
    std = onnx.load(out / "model.std.onnx", load_external_data=False)
    assert not std.functions and not [n for n in std.graph.node if n.domain == "m2export"]


def test_matches_torch(variant):
    name, ck, out, dtype = variant
    model = load_checkpoint(ck).model
    rel = 1e-5 if dtype == "fp32" else 1e-2
    ids = torch.randint(0, TINY["vocab_size"], (2, 21), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids)
    for impl in ("ssmscan", "std"):
        om = OrtModel(out, impl)
        full = om.run(ids.numpy())
        assert_close(f"{name} {impl} logits", ref.logits, torch.from_numpy(full["logits"].astype(np.float32)), rel=rel)
        for i, c in enumerate(ref.conv_states):
            assert_close(f"{name} {impl} conv_state.{i}", c.float(),
                         torch.from_numpy(full[f"present_conv_state.{i}"].astype(np.float32)), rel=rel)
        a = om.run(ids[:, :9].numpy())  # prefill, then 2 (< d_conv) more, then one-token steps
        b = om.run(ids[:, 9:11].numpy(), om.io.next_past(a))
        steps, past = [], om.io.next_past(b)
        for t in range(11, 21):
            o = om.run(ids[:, t:t + 1].numpy(), past, decode=True)
            steps.append(o["logits"])
            past = om.io.next_past(o)
        got = np.concatenate([a["logits"], b["logits"], *steps], axis=1).astype(np.float32)
        assert_close(f"{name} {impl} split logits", ref.logits, torch.from_numpy(got), rel=rel)
        assert_close(f"{name} {impl} final conv_state.1", ref.conv_states[1].float(),
                     torch.from_numpy(o["present_conv_state.1"].astype(np.float32)), rel=rel)


def test_norm_before_gate_falcon_h1(tmp_path):
    """Falcon-H1 with the gated RMSNorm normalising before the gate (its traced layers): GatedRMSNorm with
    norm_before_gate 1 in the ssmscan graph; both graphs match the PyTorch model at a prefill and one step."""
    from tests.models.hf_checkpoints import make

    ck, _ = make("falcon_h1_norm_before_gate", tmp_path / "ck")
    export_model(ck, tmp_path / "out", ssm_impl="both")
    ssm = onnx.load(tmp_path / "out" / "model.onnx", load_external_data=False)
    norms = [n for n in ssm.graph.node if n.op_type == "GatedRMSNorm"]
    model = load_checkpoint(ck).model
    assert len(norms) == len(model.spec.mamba_layers) > 0
    assert {onnx.helper.get_attribute_value(a) for n in norms for a in n.attribute if a.name == "norm_before_gate"} == {1}
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(ids).logits
    for impl in ("ssmscan", "std"):
        om = OrtModel(tmp_path / "out", impl)
        a = om.run(ids[:, :11].numpy())
        b = om.run(ids[:, 11:].numpy(), om.io.next_past(a), decode=True)
        got = np.concatenate([a["logits"], b["logits"]], axis=1)
        assert_close(f"falcon_h1 norm_before_gate {impl}", ref, torch.from_numpy(got), rel=1e-5)



def test_loader_expects_a_plugin_layer_per_m2export_node(variant):
    """m2export.trt.loader.count_plugin_nodes: what a parsed TensorRT network must hold as plugin layers (SSMScan,
    CausalConv1d, GatedRMSNorm per layer of the ssmscan graph; none in std)."""
    from m2export.trt.loader import count_plugin_nodes

    name, ck, out, dtype = variant
    n = load_checkpoint(ck).model.cfg.n_layer
    assert count_plugin_nodes(out / "model.onnx") == 3 * n and count_plugin_nodes(out / "model.std.onnx") == 0


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_std_flavour_uses_rms_normalization_at_opset_23(dtype, tmp_path):
    """At opset 23 the std graph's RMSNorms (pre-norms, per-group gated norms, norm_f) are standard RMSNormalization
    nodes, nothing of the Pow/ReduceMean core left; the graph still matches PyTorch (prefill and a decode step); the
    ssmscan graph is as at opset 18 (its gated norms are GatedRMSNorm nodes)."""
    ck = random_checkpoint(tmp_path / "ck", seed=9, **TINY, ngroups=2)
    export_model(ck, tmp_path / "out", ssm_impl="both", dtype=dtype, opset=23)
    cfg = load_checkpoint(ck).model.cfg
    std = onnx.load(tmp_path / "out" / "model.std.onnx", load_external_data=False)
    ops = [n.op_type for n in std.graph.node]
    assert ops.count("RMSNormalization") == 2 * cfg.n_layer + 1
    assert not {"Pow", "ReduceMean", "Sqrt", "Reciprocal"} & set(ops) and {o.domain for o in std.opset_import} == {""}
    ssm = [n.op_type for n in onnx.load(tmp_path / "out" / "model.onnx", load_external_data=False).graph.node]
    assert ssm.count("GatedRMSNorm") == cfg.n_layer and "RMSNormalization" not in ssm
    model = load_checkpoint(ck).model
    ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids).logits
    rel = 1e-5 if dtype == "fp32" else 1e-2
    for impl in ("std", "ssmscan"):
        om = OrtModel(tmp_path / "out", impl)
        a = om.run(ids[:, :11].numpy())
        b = om.run(ids[:, 11:].numpy(), om.io.next_past(a), decode=True)
        got = np.concatenate([a["logits"], b["logits"]], axis=1).astype(np.float32)
        assert_close(f"opset 23 {impl} {dtype}", ref, torch.from_numpy(got), rel=rel)
