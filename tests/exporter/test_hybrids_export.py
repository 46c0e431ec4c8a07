"""Hybrid exports (Nemotron-H with MoE, Granite 4.0-H, Bamba) against transformers, both graph flavours.

Each family's tiny checkpoint is written by transformers itself (tests/models/hf_checkpoints.py: random
non-default A_log/dt_bias/D/norms; attention first or MoE first, GQA, ngroups 2, head dim 10, MoE top-2 of 4
with a shared expert, RoPE / partial RoPE / none) and exported once (``--ssm-impl both``, fp32). Bounds:
logits rel-L2 vs transformers' fp32 model 1e-5 (observed ~4e-7); 32 greedy tokens after the prompt equal
to transformers' greedy decoding; a prefill split through the state I/O equal to one prefill (1e-5).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from m2export.exporter import OrtModel, export_model
from m2export.exporter.manifest import read_manifest
from tests.helpers import assert_close
from tests.models.hf_checkpoints import hf_greedy, hf_logits, make

pytest.importorskip("onnxruntime")

FAMILIES = ["nemotron_h", "granitemoehybrid", "bamba"]
IMPLS = ["ssmscan", "std"]
REL = 1e-5


@pytest.fixture(scope="module", params=FAMILIES)
def exported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    ck, hf = make(request.param, root / "ck")
    (ck / "tokenizer.json").write_text("{}")  # a stand-in: export copies it (generate's default tokenizer)
    out = root / "out"
    export_model(ck, out, ssm_impl="both")
    return request.param, ck, hf, out


def _ids(hf, batch, L, seed):
    return torch.randint(0, hf.config.vocab_size, (batch, L), generator=torch.Generator().manual_seed(seed))


def test_graph_io_has_kv_caches_and_mamba_states(exported):
    name, ck, hf, out = exported
    m = read_manifest(out)
    io = m.graph("prefill").io()
    spec = m.model_config()
    assert [(s.layer, s.kind) for s in io.states] == [(s.layer, s.kind) for s in spec.states()]
    attn = spec.attention_layers[0]
    k = io.input(f"past_key_values.{attn}.key")
    assert k.shape[0] == "batch_size" and k.shape[2] == "past_sequence_length"
    assert io.output(f"present.{attn}.value").shape[2] == "past_sequence_length + sequence_length"
    model = onnx.load(out / "model.onnx", load_external_data=False)
    assert [v.name for v in model.graph.input] == io.input_names()
    assert [v.name for v in model.graph.output] == io.output_names()
    assert (out / "tokenizer.json").is_file() and m.tokenizer == ["tokenizer.json"]


@pytest.mark.parametrize("impl", IMPLS)
def test_logits_match_transformers(exported, impl):
    name, ck, hf, out = exported
    om = OrtModel(out, impl)
    for b, L in [(1, 1), (2, 13)]:
        ids = _ids(hf, b, L, seed=L)
        ref = hf_logits(hf, ids)
        got = torch.from_numpy(om.run(ids.numpy())["logits"][..., :ref.shape[-1]].astype(np.float32))
        assert_close(f"{name} {impl} B{b} L{L} logits", ref, got, rel=REL)


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_32_tokens_equal_transformers(exported, impl):
    name, ck, hf, out = exported
    ids = _ids(hf, 1, 9, seed=3)
    want = hf_greedy(hf, ids, 32).numpy()
    got = OrtModel(out, impl).generate_greedy(ids.numpy(), 32)
    assert (got == want).all(), f"{name} {impl}: ORT {got.tolist()} != transformers {want.tolist()}"


@pytest.mark.parametrize("impl", IMPLS)
def test_continuation_through_state_io(exported, impl):
    """prefill(7) -> prefill(6, past) -> 2 decode steps == one prefill over 15 tokens (KV caches grow 7, 13, 14)."""
    name, ck, hf, out = exported
    om = OrtModel(out, impl)
    ids = _ids(hf, 2, 15, seed=5).numpy()
    full = om.run(ids)
    a = om.run(ids[:, :7])
    b = om.run(ids[:, 7:13], om.io.next_past(a))
    c = om.run(ids[:, 13:14], om.io.next_past(b))
    d = om.run(ids[:, 14:15], om.io.next_past(c))
    got = np.concatenate([x["logits"] for x in (a, b, c, d)], axis=1)
    assert_close(f"{name} {impl} split logits", torch.from_numpy(full["logits"]), torch.from_numpy(got), rel=REL)
    for s in om.io.states:
        assert_close(f"{name} {impl} {s.present.name}", torch.from_numpy(full[s.present.name].astype(np.float32)),
                     torch.from_numpy(d[s.present.name].astype(np.float32)), rel=REL)
        if s.kind in ("key", "value"):
            assert d[s.present.name].shape[2] == 15


def test_check_and_generate_run_hybrids(exported, tmp_path):
    """m2export check (PyTorch reference vs both ORT flavours, fresh and continued feeds, decode sequence) passes;
    generate (ORT, greedy) continues the prompt as transformers does, with the tokenizer the export copied."""
    from m2export.check.compare import run_check
    from m2export.generate import generate, open_runtime

    name, ck, hf, out = exported
    report = run_check(out, shapes=[(1, 5), (2, 9)], decode_steps=3, report_dir=tmp_path / "rep")
    assert report.passed, report.failures()
    assert {r.output for r in report.rows} >= {"logits", *[s.present.name for s in read_manifest(out).graph(
        "prefill").io().states]}
    assert [r["name"] for r in report.runners] == ["torch", "onnxrt:model.onnx", "onnxrt:model.std.onnx"]
    prompt = _ids(hf, 1, 6, seed=8)
    res = generate(out, prompt[0].tolist(), runtime="onnxrt", max_new_tokens=8)
    assert res.new_ids == hf_greedy(hf, prompt, 8)[0].tolist()
    assert open_runtime(out, "onnxrt").tokenizer_file == out / "tokenizer.json"


def test_fp16_hybrid_export(tmp_path):
    """fp16 graphs of a hybrid (Bamba: attention with partial RoPE, GQA, SwiGLU): KV caches and conv states fp16,
    ssm states fp32; logits within rel-L2 1e-2 of transformers' fp32 model. (Granite's softmax-top-k router
    feeds fp16 activations to its fp32 weight in the PyTorch model itself: not exportable in fp16 yet.)"""
    ck, hf = make("bamba", tmp_path / "ck")
    out = tmp_path / "out16"
    export_model(ck, out, dtype="fp16")
    om = OrtModel(out)
    io = om.io
    assert {s.kind: s.past.dtype for s in io.states} == {"conv_state": "float16", "ssm_state": "float32",
                                                         "key": "float16", "value": "float16"}
    ids = _ids(hf, 2, 11, seed=2)
    got = om.run(ids.numpy())
    assert got["logits"].dtype == np.float16 and got["present.0.key"].dtype == np.float16
    ref = hf_logits(hf, ids)
    assert_close("bamba fp16 logits", ref, torch.from_numpy(got["logits"][..., :ref.shape[-1]].astype(np.float32)),
                 rel=1e-2)
