"""Exported prefill/decode graphs of tiny random checkpoints: structure, manifest, ORT vs PyTorch, generation.

Both flavours (ssmscan: SSMScan node + local function; std: standard ops). Exports trace at batch 2,
seq 7; every run below uses other sizes (dynamic axes). Tolerances (rel-L2 of logits / states vs the
PyTorch model of the same checkpoint): fp32 1e-5; fp16 vs the fp32 model 1e-2; bf16 (ONNX reference
evaluator, since ORT CPU has no bf16 kernels) vs the bf16 PyTorch model 3e-2.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from m2export.contract import SSMScanAttrs
from m2export.exporter import OrtModel, ort_generate_greedy
from m2export.exporter.configs import GraphIO
from m2export.exporter.manifest import read_manifest
from m2export.models.checkpoint import load_checkpoint
from tests.helpers import assert_close, assert_cumsum_trt_safe

pytest.importorskip("onnxruntime")

FP32_REL = 1e-5
CHUNK = 8
# (batch, seqlen): none equals the export example (2, 7)
PREFILL_CASES = {"L1": (1, 1), "L_lt_chunk": (1, 5), "L_eq_chunk": (1, CHUNK), "L_k_chunk_plus_1": (1, 2 * CHUNK + 1),
                 "B3_L25": (3, 3 * CHUNK + 1)}
IMPLS = ["ssmscan", "std", "native"]


def _model(ck, dtype=None):
    return load_checkpoint(ck, dtype=dtype).model


def _ids(batch, seqlen, seed=0, vocab=100):
    return torch.randint(0, vocab, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


def _compare(name, ref, out: dict, rel, io: GraphIO):
    """``out`` (a graph's outputs, states in its flavour's layout: ``io``) vs the PyTorch model's ``ref``."""
    assert_close(f"{name} logits", ref.logits.float(), torch.from_numpy(out["logits"].astype(np.float32)), rel=rel)
    for i, (c, s) in enumerate(zip(ref.conv_states, ref.ssm_states)):
        ssm, conv = (f"present_{k}_state.{i}" for k in ("ssm", "conv"))
        assert out[ssm].dtype == np.float32
        assert_close(f"{name} ssm_state.{i}", s, torch.from_numpy(io.state(ssm).to_model_layout(out[ssm])), rel=rel)
        assert_close(f"{name} conv_state.{i}", c.float(),
                     torch.from_numpy(io.state(conv).to_model_layout(out[conv]).astype(np.float32)), rel=rel)


# ------------------------------------------------------------------ structure and manifest
def test_plugin_graph_structure(export_fp32_both, tiny_g2):
    m = read_manifest(export_fp32_both)
    cfg = m.model_config()
    want_attrs = {**SSMScanAttrs(chunk_size=cfg.chunk_size, dt_min=cfg.dt_limit[0], dt_max=cfg.dt_limit[1])
                  .onnx_attributes(), "plugin_namespace": "m2export", "plugin_version": "1"}
    for g in [m.graph("prefill", "ssmscan")]:
        assert m.graph("decode", "ssmscan") is g  # one graph serves both
        model = onnx.load(export_fp32_both / g.file)
        scans = [n for n in model.graph.node if n.op_type == "SSMScan"]
        assert len(scans) == cfg.n_layer
        for n in scans:
            assert n.domain == "m2export"
            assert {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} == {
                k: (v.encode() if isinstance(v, str) else v) for k, v in want_attrs.items()}
            assert len(n.input) == 8 and len(n.output) == 2 and all(n.input)
        assert {(o.domain, o.version) for o in model.opset_import} >= {("", m.opset), ("m2export", 1)}
        assert [(f.domain, f.name) for f in model.functions] == [
            ("m2export", "SSMScan"), ("m2export", "CausalConv1d"), ("m2export", "GatedRMSNorm")]
        assert not [n for n in model.graph.node if n.domain not in ("", "m2export")]
        # issue 18: each layer's conv and gated norm are one custom node each, nothing of them left as standard ops
        convs = [n for n in model.graph.node if n.op_type == "CausalConv1d"]
        norms = [n for n in model.graph.node if n.op_type == "GatedRMSNorm"]
        assert len(convs) == len(norms) == cfg.n_layer and {n.domain for n in convs + norms} == {"m2export"}
        assert not [n for n in model.graph.node if n.op_type in ("Conv", "Sigmoid")]
        outputs = {o.name for o in model.graph.output}
        for n in convs:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            assert attrs == {"activation": b"silu", "plugin_namespace": b"m2export", "plugin_version": b"1"}
            assert len(n.input) == 4 and all(n.input) and n.input[3].startswith("past_conv_state.")
            assert n.output[1] in outputs and n.output[1].startswith("present_conv_state.")
        for n in norms:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            assert attrs == {"group_size": cfg.d_inner // cfg.ngroups, "eps": pytest.approx(1e-5),
                             "norm_before_gate": int(cfg.norm_before_gate), "plugin_namespace": b"m2export",
                             "plugin_version": b"1"}


def test_onnx_graph_structure(export_fp32_both):
    m = read_manifest(export_fp32_both)
    for g in [m.graph("prefill", "std")]:
        model = onnx.load(export_fp32_both / g.file)
        assert not model.functions
        assert {o.domain for o in model.opset_import} == {""}
        assert not [n for n in model.graph.node if n.domain not in ("", "ai.onnx")]
        assert [n.op_type for n in model.graph.node].count("Conv") == m.model_config().n_layer  # the conv as it was
        assert_cumsum_trt_safe(model.graph.node, model.graph.initializer)
        assert not [n for n in model.graph.node if n.op_type in ("Softplus", "Loop", "Scan", "CastLike")]


def test_native_graph_structure(export_fp32_both):
    """native flavour: ORT's contrib kernels; per layer one CausalConvWithState for any number of tokens
    (channels-first between the two Transposes of the activations, on the conv states in the model's layout:
    no Transpose of a state; its own SiLU, not the traced x * Sigmoid(x) ORT would fuse into the less accurate
    QuickGelu) and one LinearAttention (q = C per group, inverse GQA; k = B tiled to heads: no Expand),
    each reading past_*_state.{i} and writing present_*_state.{i} themselves (the graph's ssm states are its
    (batch, nheads, d_state, headdim) state: no Transpose); no If, no Conv; the norms as
    RMSNormalization / SkipSimplifiedLayerNormalization (nothing of the traced RMSNorm left); constant reshapes,
    no shape arithmetic at the top level (a decode token runs none); no SSMScan, Loop or Scan."""
    import onnx_ir as ir

    from m2export.exporter.ssm_scan_op import NATIVE_OPSETS, ORT_DOMAIN

    m = read_manifest(export_fp32_both)
    cfg = m.model_config()
    model = onnx.load(export_fp32_both / m.graph("prefill", "native").file)
    assert m.graph("decode", "native") is m.graph("prefill", "native")
    assert not model.functions
    assert {o.domain: o.version for o in model.opset_import} == NATIVE_OPSETS
    nodes = list(ir.traversal.RecursiveGraphIterator(ir.serde.deserialize_model(model).graph))
    ops = [n.op_type for n in nodes]
    top = [n.op_type for n in model.graph.node]
    assert len(ops) == len(top)  # no subgraphs
    assert top.count("CausalConvWithState") == top.count("LinearAttention") == cfg.n_layer
    assert not {"If", "Conv"} & set(top)
    for i in range(cfg.n_layer):
        (la,) = [n for n in model.graph.node if f"past_ssm_state.{i}" in n.input]
        assert la.op_type == "LinearAttention" and list(la.input).index(f"past_ssm_state.{i}") == 3
        assert list(la.output) == [la.output[0], f"present_ssm_state.{i}"]
        (cc,) = [n for n in model.graph.node if f"past_conv_state.{i}" in n.input]
        assert cc.op_type == "CausalConvWithState" and list(cc.input).index(f"past_conv_state.{i}") == 3
        assert list(cc.output) == [cc.output[0], f"present_conv_state.{i}"]
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(model.graph.input) + list(model.graph.output)}
    assert dims["past_ssm_state.0"] == dims["present_ssm_state.1"] == ["batch_size", cfg.nheads, cfg.d_state,
                                                                        cfg.headdim]
    # the conv states in the model's layout, as the channels-first CausalConvWithState keeps them
    assert dims["past_conv_state.1"] == dims["present_conv_state.0"] == ["batch_size", cfg.conv_dim, cfg.d_conv - 1]
    assert {n.domain for n in nodes if n.op_type in ("LinearAttention", "CausalConvWithState")} == {ORT_DOMAIN}
    # pre-norms and gated norms (ngroups 2: the core on (b, L, g, d/g), weight after) and norm_f
    assert top.count("RMSNormalization") + top.count("SkipSimplifiedLayerNormalization") == 2 * cfg.n_layer + 1
    assert top.count("SkipSimplifiedLayerNormalization") == cfg.n_layer  # layers 1.. and norm_f on residual sums
    assert not {"SSMScan", "Loop", "Scan", "CastLike", "Pow", "ReduceMean", "Sqrt", "Reciprocal"} & set(ops)
    assert not {"Concat", "Squeeze", "Slice", "Shape"} & set(top)
    # the conv's input and output per layer, and lm_head's W^T when tied
    assert top.count("Transpose") == 2 * cfg.n_layer + (1 if cfg.tie_embeddings else 0)
    assert "Expand" not in top and top.count("Tile") == cfg.n_layer  # B to heads; C read per group
    for n in nodes:
        if n.op_type == "LinearAttention":
            attrs = {k: a.value for k, a in n.attributes.items()}
            assert attrs["update_rule"] == "gated" and attrs["scale"] == 1.0
            assert (attrs["q_num_heads"], attrs["kv_num_heads"]) == (cfg.ngroups, cfg.nheads)
        if n.op_type == "CausalConvWithState":
            assert "channels_last" not in n.attributes and n.attributes["activation"].value == "silu"


def test_native_flavour_rejects_bf16(tiny_g2, tmp_path):
    from m2export.errors import ParameterError
    from m2export.exporter import export_model

    with pytest.raises(ParameterError, match="no bf16") as e:
        export_model(tiny_g2, tmp_path / "o", ssm_impl="native", dtype="bf16")
    assert "'both'" in e.value.hint and not (tmp_path / "o").exists()


def test_io_names_shapes_and_manifest(export_fp32_both, tiny_g2):
    m = read_manifest(export_fp32_both)
    cfg = m.model_config()
    assert {(g.role, g.ssm_impl, g.file) for g in m.graphs} == {
        ("prefill+decode", "ssmscan", "model.onnx"), ("prefill+decode", "std", "model.std.onnx"),
        ("prefill+decode", "native", "model.native.onnx")}
    assert m.dtype == "fp32" and m.opset == GraphIO.DEFAULT_OPSET
    assert m.checkpoint_sha256 == load_checkpoint(tiny_g2).sha256
    assert {"torch", "onnx", "onnxscript", "onnxruntime", "m2export"} <= set(m.tool_versions)
    for g in m.graphs:
        io = GraphIO.for_model(cfg, "fp32", flavour=g.ssm_impl)
        assert g.io() == io  # the manifest records the one description (the flavour's state layouts)
        layouts = {st["kind"]: st["layout"] for st in g.states}
        assert layouts["ssm_state"] == (["batch_size", "nheads", "d_state", "headdim"] if g.ssm_impl == "native"
                                        else ["batch_size", "nheads", "headdim", "d_state"])
        assert layouts["conv_state"] == ["batch_size", "conv_dim", "d_conv - 1"]  # every flavour: the model's
        model = onnx.load(export_fp32_both / g.file)
        dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
                for v in list(model.graph.input) + list(model.graph.output)}
        assert [v.name for v in model.graph.input] == io.input_names()
        assert [v.name for v in model.graph.output] == io.output_names()
        assert dims == {t.name: list(t.shape) for t in (*io.inputs, *io.outputs)}
        elem = {v.name: onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name
                for v in list(model.graph.input) + list(model.graph.output)}
        assert elem == {t.name: t.dtype for t in (*io.inputs, *io.outputs)}
        assert g.inputs["past_ssm_state.0"]["dtype"] == "float32" and g.inputs["past_conv_state.0"]["dtype"] == "float32"
        assert [(st.layer, st.kind) for st in io.states] == [(i, k) for i in range(cfg.n_layer)
                                                             for k in ("conv_state", "ssm_state")]


# ------------------------------------------------------------------ ORT vs PyTorch, fp32
@pytest.mark.parametrize("case", list(PREFILL_CASES))
@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_fp32(export_fp32_both, tiny_g2, impl, case):
    om = OrtModel(export_fp32_both, impl)
    ids = _ids(*PREFILL_CASES[case], seed=len(case))
    with torch.no_grad():
        ref = _model(tiny_g2)(ids)
    _compare(f"{impl} {case}", ref, om.run(ids.numpy()), FP32_REL, om.io)


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_g1_dt_limit_cli_export(export_fp32_g1_cli, tiny_g1, impl):
    """G=1, dt_limit set, untied lm_head, HF-format checkpoint, exported through the CLI."""
    om = OrtModel(export_fp32_g1_cli, impl)
    model = _model(tiny_g1)
    assert model.cfg.dt_limit == (0.002, 0.08) and not model.cfg.tie_embeddings
    for b, L in [(1, 1), (2, 3 * CHUNK + 1)]:
        ids = _ids(b, L, seed=L)
        with torch.no_grad():
            ref = model(ids)
        _compare(f"G1 {impl} B{b} L{L}", ref, om.run(ids.numpy()), FP32_REL, om.io)


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_prefill_and_decode_continue_states(export_fp32_both, tiny_g2, impl):
    """prefill(10) -> prefill(9, states) -> decode x2 in ORT == one PyTorch prefill over all 21 tokens."""
    om = OrtModel(export_fp32_both, impl)
    ids = _ids(2, 21, seed=4)
    with torch.no_grad():
        ref = _model(tiny_g2)(ids)
    a = om.run(ids[:, :10].numpy())
    b = om.run(ids[:, 10:19].numpy(), om.io.next_past(a))
    c = om.run(ids[:, 19:20].numpy(), om.io.next_past(b), decode=True)
    d = om.run(ids[:, 20:21].numpy(), om.io.next_past(c), decode=True)
    got = np.concatenate([a["logits"], b["logits"], c["logits"], d["logits"]], axis=1)
    assert_close(f"{impl} chunked logits", ref.logits, torch.from_numpy(got), rel=FP32_REL)
    assert_close(f"{impl} final ssm_state.1", ref.ssm_states[1],
                 torch.from_numpy(om.io.state("present_ssm_state.1").to_model_layout(d["present_ssm_state.1"])),
                 rel=FP32_REL)


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_generation_matches_torch(export_fp32_both, tiny_g2, impl):
    """Prefill + decode greedy generation in ORT == PyTorch greedy generation, token for token."""
    ids = _ids(2, 13, seed=9)
    model = _model(tiny_g2)
    with torch.no_grad():
        ref = model.generate_greedy(ids, 24)
    toks, logits = ort_generate_greedy(export_fp32_both, ids, 24, ssm_impl=impl, return_logits=True)
    assert toks.shape == (2, 24) and toks.dtype == np.int64
    assert (torch.from_numpy(toks) == ref).all(), f"{impl}: ORT {toks.tolist()} != torch {ref.tolist()}"
    # the logits each token was picked from, recomputed in torch over the whole sequence
    with torch.no_grad():
        full = model(torch.cat([ids, ref[:, :-1]], dim=1)).logits[:, ids.shape[1] - 1:]
    assert_close(f"{impl} generation logits", full, torch.from_numpy(logits), rel=FP32_REL)


@pytest.fixture(scope="module")
def native_rect(tmp_path_factory):
    """A checkpoint whose ssm states are not square (headdim 8, d_state 16: 16 heads, ngroups 2) and its ssmscan +
    native export: a state read or written in the wrong layout fails on its shape, not only on its values."""
    from m2export.exporter import export_model
    from m2export.models.checkpoint import random_checkpoint

    d = tmp_path_factory.mktemp("rect")
    ck = random_checkpoint(d / "ck", d_model=64, n_layer=2, vocab_size=100, d_state=16, headdim=8, chunk_size=8,
                           ngroups=2, seed=5)
    export_model(ck, d / "out", ssm_impl="all")
    return ck, d / "out"


def test_native_state_layout_rect(native_rect):
    """The native graph's ssm state I/O is (batch, nheads, d_state, headdim) = (b, 16, 16, 8) in the graph and in
    m2export.json, the ssmscan graph's (b, 16, 8, 16); a prefill of 7, another of 6 through the states and 2 decode
    tokens equal PyTorch's one 15-token run (logits and every state, through ``to_model_layout``); the same
    states fed to both flavours (each in its layout) give the same outputs."""
    from m2export.inspect import describe, format_text

    ck, out = native_rect
    m = read_manifest(out)
    text = format_text(describe(out))
    for impl, layout, conv in (("ssmscan", "headdim, d_state", "conv_dim, d_conv - 1"),
                               ("std", "headdim, d_state", "conv_dim, d_conv - 1"),
                               ("native", "d_state, headdim", "conv_dim, d_conv - 1")):
        line = text.splitlines().index(next(x for x in text.splitlines() if f"ssm_impl={impl} " in x))
        near = "\n".join(text.splitlines()[line:line + 3])
        assert f"ssm_state  layout [batch_size, nheads, {layout}]" in near
        assert f"conv_state layout [batch_size, {conv}]" in near
    conv_dim = 128 + 2 * 2 * 16  # d_inner + 2 ngroups d_state
    want = {"native": (["batch_size", 16, 16, 8], ["batch_size", conv_dim, 3]),
            "ssmscan": (["batch_size", 16, 8, 16], ["batch_size", conv_dim, 3])}
    for impl, (shape, conv) in want.items():
        g = m.graph("prefill", impl)
        assert g.inputs["past_ssm_state.1"]["shape"] == g.outputs["present_ssm_state.0"]["shape"] == shape
        assert g.inputs["past_conv_state.0"]["shape"] == g.outputs["present_conv_state.1"]["shape"] == conv
        model = onnx.load(out / g.file)
        dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
                for v in list(model.graph.input) + list(model.graph.output)}
        assert dims["past_ssm_state.1"] == dims["present_ssm_state.0"] == shape
        assert dims["past_conv_state.0"] == dims["present_conv_state.1"] == conv
    model = _model(ck)
    ids = _ids(3, 15, seed=6)
    with torch.no_grad():
        ref = model(ids)
    om = OrtModel(out, "native")
    a = om.run(ids[:, :7].numpy())
    b = om.run(ids[:, 7:13].numpy(), om.io.next_past(a))
    c = om.run(ids[:, 13:14].numpy(), om.io.next_past(b), decode=True)
    d = om.run(ids[:, 14:15].numpy(), om.io.next_past(c), decode=True)
    got = np.concatenate([a["logits"], b["logits"], c["logits"], d["logits"]], axis=1)
    _compare("native rect", ref, {**d, "logits": got}, FP32_REL, om.io)  # logits of all 15, final states
    # the ssmscan graph's states after 9 tokens continue in the native graph once put in its layout
    sm = OrtModel(out, "ssmscan")
    first = sm.run(ids[:, :9].numpy())
    x = om.run(ids[:, 9:12].numpy(), {s.past.name: s.to_graph_layout(first[s.present.name]) for s in om.io.states})
    y = sm.run(ids[:, 9:12].numpy(), sm.io.next_past(first))
    for s in om.io.states:
        np.testing.assert_allclose(s.to_model_layout(x[s.present.name]), y[s.present.name], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(x["logits"], y["logits"], rtol=1e-4, atol=1e-5)


def test_native_rect_greedy_generate_and_check(native_rect, tmp_path):
    """Greedy generation from the native graph == PyTorch, also through ``m2export.generate`` (its zero states
    come from the graph's recorded layout); ``m2export check`` of both flavours passes with continued feeds (the
    reference's non-zero states go into the native graph transposed, its presents come back transposed) and a
    decode sequence."""
    from m2export.check.compare import run_check
    from m2export.generate import generate

    ck, out = native_rect
    model = _model(ck)
    ids = _ids(2, 9, seed=8)
    with torch.no_grad():
        ref = model.generate_greedy(ids, 12)
    toks = ort_generate_greedy(out, ids, 12, ssm_impl="native")
    assert (torch.from_numpy(toks) == ref).all(), f"native: ORT {toks.tolist()} != torch {ref.tolist()}"
    res = generate(out, ids[0].tolist(), max_new_tokens=12, ssm_impl="native")
    assert res.new_ids == ref[0].tolist()
    report = run_check(out, shapes=[(1, 5), (2, 9)], decode_steps=3, report_dir=tmp_path / "rep")
    assert report.passed, report.failures()
    assert report.past_len > 0 and {r.runner for r in report.rows} >= {"onnxrt:model.native.onnx"}
    assert all(g["passed"] for g in report.greedy.values())


# ------------------------------------------------------------------ fp16 / bf16
@pytest.mark.parametrize("impl", IMPLS)
def test_fp16_export(export_fp16_both, tiny_g2, impl):
    """fp16 weights/activations, fp32 ssm states; vs the fp32 PyTorch model within rel-L2 1e-2."""
    om = OrtModel(export_fp16_both, impl)
    m32 = _model(tiny_g2)
    for b, L in [(1, 1), (3, 2 * CHUNK + 1)]:
        ids = _ids(b, L, seed=L)
        with torch.no_grad():
            ref = m32(ids)
        out = om.run(ids.numpy())
        assert out["logits"].dtype == np.float16 and out["present_conv_state.0"].dtype == np.float16
        _compare(f"fp16 {impl} B{b} L{L}", ref, out, 1e-2, om.io)
    toks = om.generate_greedy(_ids(1, 9, seed=2).numpy(), 8)
    assert toks.shape == (1, 8)


def test_bf16_export(export_bf16_both, tiny_g2):
    """bf16 graphs: typed bf16 with fp32 ssm states; ORT CPU refuses clearly; the ONNX reference evaluator runs them."""
    from m2export.errors import BackendUnavailable

    m = read_manifest(export_bf16_both)
    with pytest.raises(BackendUnavailable, match="bf16 export does not run on ONNX Runtime's CPUExecutionProvider"):
        OrtModel(export_bf16_both)
    m16 = _model(tiny_g2, torch.bfloat16)
    ids = _ids(2, 2 * CHUNK + 1, seed=3)
    with torch.no_grad():
        ref = m16(ids)
    for impl in ("ssmscan", "std"):  # native is fp32/fp16 only (test_native_flavour_rejects_bf16)
        model = onnx.load(export_bf16_both / m.graph("prefill", impl).file)
        types = {v.name: v.type.tensor_type.elem_type for v in list(model.graph.input) + list(model.graph.output)}
        assert types["logits"] == onnx.TensorProto.BFLOAT16 and types["past_conv_state.0"] == onnx.TensorProto.BFLOAT16
        assert types["past_ssm_state.0"] == types["present_ssm_state.1"] == onnx.TensorProto.FLOAT
        ops = [n.op_type for n in model.graph.node]  # the traced bf16 conv (a float32 island) is fused too
        assert ops.count("CausalConv1d") == ops.count("GatedRMSNorm") == (m16.cfg.n_layer if impl == "ssmscan" else 0)
        om = OrtModel(export_bf16_both, impl, providers=["onnx.reference"])
        _compare(f"bf16 {impl}", ref, om.run(ids.numpy()), 3e-2, om.io)
    toks = ort_generate_greedy(export_bf16_both, ids[:1, :9], 4, providers=["onnx.reference"])
    assert toks.shape == (1, 4)


# ------------------------------------------------------------------ failures and errors
def test_failed_export_leaves_nothing(tiny_g2, tmp_path, monkeypatch):
    """A failure after the first graph was written removes the temp folder and leaves OUTDIR untouched."""
    import m2export.exporter.export as ex
    from m2export.errors import ExportError

    calls = []

    def failing_check(path):
        calls.append(Path(path).name)
        raise ExportError("injected failure")

    monkeypatch.setattr(ex, "_check", failing_check)
    out = tmp_path / "sub" / "out"
    with pytest.raises(ExportError, match="injected"):
        ex.export_model(tiny_g2, out, ssm_impl="std")
    assert calls == ["model.onnx"]
    assert not out.exists() and not (tmp_path / "sub").exists()  # the parent it created is removed too
    # with --force over an existing export: the old content survives a failed re-export; a failure inside
    # torch.onnx.export becomes a one-line ExportError
    out.mkdir(parents=True)
    (out / "keep.txt").write_text("old")

    def failing_trace(*a, **k):
        raise RuntimeError("boom in torch.export")

    monkeypatch.setattr(ex, "_trace", failing_trace)
    with pytest.raises(ExportError, match="torch.onnx export of the graph failed: RuntimeError: boom in torch.export"):
        ex.export_model(tiny_g2, out, force=True, force_foreign=True)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and sorted(p.name for p in out.parent.iterdir()) == ["out"]


def test_unsupported_config_field(tiny_g2, tmp_path, capsys):
    import json

    from m2export.cli.main import main

    ck = tmp_path / "ck"
    shutil.copytree(tiny_g2, ck)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["ssm_cfg"]["D_has_hdim"] = True
    (ck / "config.json").write_text(json.dumps(cfg))
    assert main(["export", str(ck), "-o", str(tmp_path / "out")]) == 1
    assert "D_has_hdim" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_existing_outdir_without_force(tiny_g2, tmp_path, capsys):
    """The library's hint names its parameter (force=True), the CLI's the flag (--force): neither leaks the other."""
    from m2export.cli.main import main
    from m2export.errors import OutputFolderError
    from m2export.exporter import export_model

    (tmp_path / "x.txt").write_text("")
    with pytest.raises(OutputFolderError, match="exists and is not empty") as e:
        export_model(tiny_g2, tmp_path)
    assert "force=True" in e.value.hint and "--force" not in e.value.hint
    assert main(["export", str(tiny_g2), "-o", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    # a folder m2export did not write: the first hint already names --force-foreign (--force alone is refused too)
    assert "m2export did not write it" in err and "pass --force with --force-foreign to delete its" in err, err
    assert "force=True" not in err and "`" not in err
    (tmp_path / "x.txt").unlink()
    assert main(["export", str(tiny_g2), "-o", str(tmp_path / "own"), "-q"]) == 0
    assert main(["export", str(tiny_g2), "-o", str(tmp_path / "own")]) == 1  # m2export's own: --force will do
    err = capsys.readouterr().err
    assert "hint: pass --force to replace it, or choose another output folder (--output)" in err, err


def test_bad_arguments_and_unwritable(tiny_g2, tmp_path):
    from m2export.errors import OutputFolderError, ParameterError
    from m2export.exporter import export_model

    with pytest.raises(ParameterError, match="ssm_impl"):
        export_model(tiny_g2, tmp_path / "a", ssm_impl="trt")
    with pytest.raises(ParameterError, match="dtype"):
        export_model(tiny_g2, tmp_path / "a", dtype="int8")
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputFolderError, match="not a directory"):
        export_model(tiny_g2, tmp_path / "file")
    with pytest.raises(OutputFolderError, match="file is not a directory"):
        export_model(tiny_g2, tmp_path / "file" / "out")
    with pytest.raises(OutputFolderError, match="holds the checkpoint"):
        export_model(tiny_g2, Path(tiny_g2).parent, force=True)


def test_cli_errors(tiny_g2, tmp_path, capsys):
    from m2export.cli.main import main

    (tmp_path / "x.txt").write_text("")
    assert main(["export", str(tiny_g2), "-o", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "exists and is not empty" in err and "hint:" in err and "--force" in err
    assert main(["export", str(tmp_path / "no_such_ckpt"), "-o", str(tmp_path / "new")]) == 1
    assert "no such file or directory" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_weights_stored_once(export_fp32_both, tiny_g2):
    """Every flavour references one model.onnx.data holding every parameter once; the graphs hold no weights."""
    m = read_manifest(export_fp32_both)
    n_params = sum(p.numel() for p in _model(tiny_g2).parameters())
    data = export_fp32_both / "model.onnx.data"
    assert sorted(p.name for p in export_fp32_both.iterdir() if p.name.endswith((".onnx", ".data"))) == [
        "model.native.onnx", "model.onnx", "model.onnx.data", "model.std.onnx"]
    # fp32: 4 bytes a parameter (the tied embedding once), plus 64-byte alignment; small tensors (norm
    # weights, A_log, ...) stay inline
    assert _model(tiny_g2).cfg.tie_embeddings
    assert 4 * (n_params - 2000) <= data.stat().st_size <= 4 * n_params + 64 * 64
    spans = {}
    for g in m.graphs:
        assert g.external_data == ["model.onnx.data"]
        proto = onnx.load(export_fp32_both / g.file, load_external_data=False)
        ext = {t.name: {e.key: e.value for e in t.external_data} for t in proto.graph.initializer
               if t.data_location == onnx.TensorProto.EXTERNAL}
        assert {v["location"] for v in ext.values()} == {"model.onnx.data"}
        spans[g.file] = {(v["offset"], v["length"]) for v in ext.values()}
        inline = [t for t in proto.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
        assert all(len(t.raw_data) < 1024 for t in inline), [t.name for t in inline if len(t.raw_data) >= 1024]
    assert spans["model.onnx"] == spans["model.std.onnx"] == spans["model.native.onnx"]  # the same bytes, not a copy


def test_opset_20_export_runs(tiny_g2, tmp_path):
    """A non-default opset: recorded in the manifest and the graph; ORT == PyTorch."""
    import m2export.exporter.export as ex

    out = tmp_path / "op20"
    m = ex.export_model(tiny_g2, out, ssm_impl="std", opset=20)
    assert m.opset == 20 and {(o.domain, o.version) for o in onnx.load(out / "model.onnx").opset_import} == {("", 20)}
    ids = _ids(2, 11, seed=1)
    with torch.no_grad():
        ref = _model(tiny_g2)(ids)
    om = OrtModel(out)
    _compare("opset 20", ref, om.run(ids.numpy()), FP32_REL, om.io)


def test_old_two_graph_export_refused(export_fp32_both, tmp_path):
    """A version-1 folder (decode.onnx beside model.onnx, weights in each) is refused with a re-export hint."""
    import json

    from m2export.errors import ExportFolderError

    d = tmp_path / "old"
    d.mkdir()
    j = json.loads((export_fp32_both / "m2export.json").read_text())
    j["manifest_version"] = 1
    (d / "m2export.json").write_text(json.dumps(j))
    with pytest.raises(ExportFolderError, match="older m2export") as e:
        read_manifest(d)
    assert "re-export" in e.value.hint


def test_progress_bar_steps(capsys):
    """The rich progress bar counts the steps and ends at 'done' (the CLI shows it unless -q)."""
    from m2export.exporter.export import _Progress

    with _Progress(True, 3) as bar:
        for what in ("loading", "tracing", "saving"):
            bar.step(what)
        assert bar._p.tasks[0].completed == 2 and bar._p.tasks[0].description == "saving"
    assert bar._p.tasks[0].completed == 3 and bar._p.tasks[0].description == "done"
    with _Progress(False, 3) as quiet:
        quiet.step("x")
    assert quiet._p is None
