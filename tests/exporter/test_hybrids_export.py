"""Hybrid exports against transformers, every graph flavour: part 1 (Nemotron-H with MoE, Granite 4.0-H, Bamba)
and part 2 (Falcon-H1: attention + Mamba in parallel with muP multipliers; Zamba2: shared blocks with adapters).

Each family's tiny checkpoint is written by transformers itself (tests/models/hf_checkpoints.py: random
non-default A_log/dt_bias/D/norms; attention first or MoE first, GQA, ngroups 2, head dim 10, MoE top-2 of 4
with a shared expert, RoPE / partial RoPE / none; Falcon-H1 with every muP multiplier non-unit, gated RMSNorm
per group (``falcon_h1``) and none (``falcon_h1_nonorm``); Zamba2 with two shared blocks called ABA, attention
adapters and RoPE) and exported once in fp32 (``--ssm-impl both``; ``all`` for the part-2 families, adding
the native flavour). Bounds: logits rel-L2 vs transformers' fp32 model 1e-5 (observed ~4e-7 to 1e-6); 32
greedy tokens after the prompt equal to transformers' greedy decoding; a prefill split through the state I/O
equal to one prefill (1e-5). KV caches exist only for the layers with attention (every Falcon-H1 layer, the
hybrid layers of Zamba2).
(Zamba2's shared blocks stored once: tests/exporter/test_shared_weights.py.)
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from m2export.exporter import OrtModel, export_model
from m2export.exporter.manifest import read_manifest
from m2export.models.checkpoint import load_checkpoint
from tests.helpers import assert_close
from tests.models.hf_checkpoints import hf_greedy, hf_logits, make

pytest.importorskip("onnxruntime")

PART1 = ["nemotron_h", "nemotron_h_bias", "granitemoehybrid", "bamba"]
PART2 = ["falcon_h1", "falcon_h1_nonorm", "zamba2"]
FAMILIES = PART1 + PART2
REL = 1e-5
_EXPORTS: dict = {}


def _export(name: str, tmp_path_factory):
    """The fp32 export of case ``name`` (made once per session): (name, checkpoint, transformers model, OUTDIR)."""
    if name not in _EXPORTS:
        root = tmp_path_factory.mktemp(name)
        ck, hf = make(name, root / "ck")
        (ck / "tokenizer.json").write_text("{}")  # a stand-in: export copies it (generate's default tokenizer)
        out = root / "out"
        export_model(ck, out, ssm_impl="all" if name in PART2 else "both")
        _EXPORTS[name] = (name, ck, hf, out)
    return _EXPORTS[name]


@pytest.fixture(scope="module", params=FAMILIES)
def exported(request, tmp_path_factory):
    return _export(request.param, tmp_path_factory)


def _impls(out):
    return read_manifest(out).ssm_impls()


def _ids(hf, batch, L, seed):
    return torch.randint(0, hf.config.vocab_size, (batch, L), generator=torch.Generator().manual_seed(seed))


def test_graph_io_has_kv_caches_and_mamba_states(exported):
    name, ck, hf, out = exported
    m = read_manifest(out)
    io = m.graph("prefill").io()
    spec = m.model_config()
    assert [(s.layer, s.kind) for s in io.states] == [(s.layer, s.kind) for s in spec.states()]
    kv_layers = sorted({s.layer for s in io.states if s.kind == "key"})
    assert kv_layers == list(spec.attention_layers)  # KV caches only where a layer has attention
    if name.startswith("falcon_h1"):
        assert kv_layers == list(range(spec.n_layer))  # every Falcon-H1 layer runs attention beside Mamba
    else:
        assert len(kv_layers) < spec.n_layer
    assert sorted({s.layer for s in io.states if s.kind == "ssm_state"}) == list(spec.mamba_layers)
    attn = spec.attention_layers[0]
    k = io.input(f"past_key_values.{attn}.key")
    assert k.shape[0] == "batch_size" and k.shape[2] == "past_sequence_length"
    assert io.output(f"present.{attn}.value").shape[2] == "past_sequence_length + sequence_length"
    model = onnx.load(out / "model.onnx", load_external_data=False)
    assert [v.name for v in model.graph.input] == io.input_names()
    assert [v.name for v in model.graph.output] == io.output_names()
    assert (out / "tokenizer.json").is_file() and m.tokenizer == ["tokenizer.json"]


def test_ssmscan_graph_has_the_fused_nodes(exported):
    """Issue 18: every Mamba layer's conv is one m2export::CausalConv1d and every gated RMSNorm one
    m2export::GatedRMSNorm in the ssmscan graph (built and traced layers alike); the std graph has no node of the
    custom domain."""
    name, ck, hf, out = exported
    spec = read_manifest(out).model_config()
    ops = [n.op_type for n in onnx.load(out / "model.onnx", load_external_data=False).graph.node]
    gated = [i for i in spec.mamba_layers if spec.layers[i].mamba.norm == "gated_rms"]
    assert ops.count("CausalConv1d") == ops.count("SSMScan") == len(spec.mamba_layers)
    assert ops.count("GatedRMSNorm") == len(gated) and (name != "falcon_h1_nonorm" or not gated)
    assert "Conv" not in ops
    std = onnx.load(out / "model.std.onnx", load_external_data=False)
    assert not [n for n in _all_nodes(std) if n.domain == "m2export"] and not std.functions


def test_traced_nodes_name_no_absolute_paths(exported):
    """The stack traces torch.onnx records on traced nodes (attention, MLP, MoE pieces) name source files
    relative to the checkout or site-packages: no directory of the exporting machine travels with the export."""
    from pathlib import Path

    import m2export
    from m2export.exporter.export import STACK_TRACE_KEY

    _, _, _, out = exported
    checkout = str(Path(m2export.__file__).resolve().parents[1])
    traces = [p.value for f in sorted(out.glob("*.onnx")) for n in _all_nodes(onnx.load(f, load_external_data=False))
              for p in n.metadata_props if p.key == STACK_TRACE_KEY]
    assert traces, "no traced node kept its stack trace (the test would check nothing)"
    assert not [t for t in traces if checkout in t or 'File "/' in t]
    assert any('File "m2export/' in t for t in traces)


def _all_nodes(model):
    def walk(graph):
        for n in graph.node:
            yield n
            for a in n.attribute:
                for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    yield from walk(g)
    yield from walk(model.graph)
    for f in model.functions:
        for n in f.node:
            yield n


def test_logits_match_transformers(exported):
    name, ck, hf, out = exported
    assert sorted(_impls(out)) == sorted(["ssmscan", "std", "native"] if name in PART2 else ["ssmscan", "std"])
    for impl in _impls(out):
        om = OrtModel(out, impl)
        for b, L in [(1, 1), (2, 13)]:
            ids = _ids(hf, b, L, seed=L)
            ref = hf_logits(hf, ids)
            got = torch.from_numpy(om.run(ids.numpy())["logits"].astype(np.float32))
            assert_close(f"{name} {impl} B{b} L{L} logits", ref, got, rel=REL)


def test_greedy_32_tokens_equal_transformers(exported):
    name, ck, hf, out = exported
    ids = _ids(hf, 1, 9, seed=3)
    want = hf_greedy(hf, ids, 32).numpy()
    for impl in _impls(out):
        got = OrtModel(out, impl).generate_greedy(ids.numpy(), 32)
        assert (got == want).all(), f"{name} {impl}: ORT {got.tolist()} != transformers {want.tolist()}"


def test_continuation_through_state_io(exported):
    """prefill(7) -> prefill(6, past) -> 2 decode steps == one prefill over 15 tokens (KV caches grow 7, 13, 14)."""
    name, ck, hf, out = exported
    for impl in _impls(out):
        _continuation(name, OrtModel(out, impl), hf, impl)


def _continuation(name, om, hf, impl):
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
    """m2export check (every ORT flavour vs the reference, fresh and continued feeds, decode sequence) passes: the
    part-1 families against the PyTorch reference, the part-2 ones against transformers (--reference
    transformers); generate (ORT, greedy) continues the prompt as transformers does, with the tokenizer the
    export copied."""
    from m2export.check.compare import run_check
    from m2export.generate import generate, open_runtime

    name, ck, hf, out = exported
    reference = "transformers" if name in PART2 else "torch"
    report = run_check(out, shapes=[(1, 5), (2, 9)], decode_steps=3, report_dir=tmp_path / "rep", reference=reference)
    assert report.passed, report.failures()
    assert {r.output for r in report.rows} >= {"logits", *[s.present.name for s in read_manifest(out).graph(
        "prefill").io().states]}
    files = ["model.std.onnx"] + (["model.native.onnx"] if name in PART2 else [])
    got = [r["name"] for r in report.runners]
    assert got[:2] == [reference, "onnxrt:model.onnx"] and sorted(got[2:]) == sorted(f"onnxrt:{f}" for f in files)
    prompt = _ids(hf, 1, 6, seed=8)
    res = generate(out, prompt[0].tolist(), runtime="onnxrt", max_new_tokens=8)
    assert res.new_ids == hf_greedy(hf, prompt, 8)[0].tolist()
    assert open_runtime(out, "onnxrt").tokenizer_file == out / "tokenizer.json"


def test_onnxruntime_genai_greedy_equals_transformers(exported):
    """onnxruntime-genai 0.18 runs every hybrid export from the genai_config.json the exporter writes (model type
    granitemoehybrid, conv/recurrent state groups of the Mamba layers, KV names of the attention layers; the
    native flavour's graph for the part-2 families): 24 greedy tokens == transformers' generate (up to genai's
    end-of-text id, where it stops)."""
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is a test-only dependency (the test extra)")
    import json

    from m2export.exporter.genai import GENAI_CONFIG_FILE

    name, ck, hf, out = exported
    cfg = json.loads((out / GENAI_CONFIG_FILE).read_text())["model"]
    assert cfg["decoder"]["filename"] == ("model.native.onnx" if name in PART2 else "model.onnx")
    assert cfg["decoder"]["inputs"]["past_key_names"] == "past_key_values.%d.key"
    prompt = _ids(hf, 1, 7, seed=6)[0].tolist()
    want = hf_greedy(hf, torch.tensor([prompt]), 24)[0].tolist()
    eos = cfg["eos_token_id"]
    want = want[: want.index(eos) + 1] if eos in want else want
    model = og.Model(str(out))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + 24, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    got = []
    while not gen.is_done() and len(got) < 24:
        gen.generate_next_token()
        got.append(int(gen.get_next_tokens()[0]))
    assert got == want and got, f"{name}: genai {got} != transformers {want}"


@pytest.mark.parametrize("name", FAMILIES)
def test_fp16_hybrid_export(tmp_path, name):
    """fp16 graphs of a hybrid (Bamba: attention with partial RoPE, GQA, SwiGLU; Falcon-H1: parallel attention +
    Mamba with muP multipliers; Zamba2: shared blocks): KV caches and conv states fp16, ssm states fp32; logits
    within rel-L2 1e-2 of transformers' fp32 model, fresh and continued through the state I/O. Every family,
    Nemotron-H and Granite (MoE routers kept in fp32) included."""
    ck, hf = make(name, tmp_path / "ck")
    out = tmp_path / "out16"
    export_model(ck, out, dtype="fp16")
    om = OrtModel(out)
    io = om.io
    assert {s.kind: s.past.dtype for s in io.states} == {"conv_state": "float16", "ssm_state": "float32",
                                                         "key": "float16", "value": "float16"}
    ids = _ids(hf, 2, 11, seed=2)
    got = om.run(ids.numpy())
    key = f"present.{read_manifest(out).model_config().attention_layers[0]}.key"
    assert got["logits"].dtype == np.float16 and got[key].dtype == np.float16
    ref = hf_logits(hf, ids)
    assert_close(f"{name} fp16 logits", ref,
                 torch.from_numpy(got["logits"][..., :ref.shape[-1]].astype(np.float32)), rel=1e-2)
    a = om.run(ids.numpy()[:, :6])
    b = om.run(ids.numpy()[:, 6:], io.next_past(a))
    assert_close(f"{name} fp16 continued logits", ref[:, 6:],
                 torch.from_numpy(b["logits"][..., :ref.shape[-1]].astype(np.float32)), rel=1e-2)


@pytest.mark.parametrize("name", ["falcon_h1", "zamba2"])
def test_bf16_hybrid_export(tmp_path, name):
    """bf16 graphs of Falcon-H1 and Zamba2 (ONNX's reference evaluator: ORT's CPU provider has no bf16 kernels):
    KV caches and conv states bf16, ssm states fp32; logits within rel-L2 3e-2 of m2export's bf16 PyTorch model
    (the bound of the Mamba-2 bf16 test); a decode step continues the prefill."""
    ck, hf = make(name, tmp_path / "ck")
    out = tmp_path / "out_bf16"
    export_model(ck, out, dtype="bf16")
    om = OrtModel(out, providers=["onnx.reference"])
    assert {s.kind: s.past.dtype for s in om.io.states} == {"conv_state": "bfloat16", "ssm_state": "float32",
                                                            "key": "bfloat16", "value": "bfloat16"}
    ids = _ids(hf, 2, 11, seed=2)
    m16 = load_checkpoint(ck, dtype=torch.bfloat16).model.eval()
    with torch.no_grad():
        ref = m16(ids).logits.float()
    a = om.run(ids.numpy()[:, :10])
    b = om.run(ids.numpy()[:, 10:], om.io.next_past(a), decode=True)
    got = np.concatenate([a["logits"], b["logits"]], axis=1).astype(np.float32)
    assert_close(f"{name} bf16 logits (prefill 10 + 1 decode step)", ref, torch.from_numpy(got), rel=3e-2)
