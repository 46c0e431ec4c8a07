"""onnxruntime-genai (CPU) generates from an export folder with the genai_config.json the exporter writes.

Greedy tokens from ``onnxruntime_genai`` must equal m2export's PyTorch model (bundled byte-level checkpoint)
and transformers' own ``generate`` (a tiny checkpoint written by transformers), token for token, up to
the configured end-of-text id (genai stops there; the references are cut at the same place).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from m2export.exporter import export_model
from m2export.exporter.genai import GENAI_CONFIG_FILE, GENAI_MODEL_TYPE
from m2export.models.checkpoint import load_checkpoint

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is a test-only dependency (the test extra)")

BUNDLED = Path(__file__).resolve().parents[2] / "samples" / "checkpoints" / "stdlib-byte-mamba2"


def genai_greedy(outdir: Path, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation of ``prompt`` by onnxruntime-genai from ``outdir`` (at most ``n`` new tokens)."""
    model = og.Model(str(outdir))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + n, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    out = []
    while not gen.is_done() and len(out) < n:
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return out


def _cut_at_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.fixture(scope="module")
def bundled_export(tmp_path_factory):
    out = tmp_path_factory.mktemp("genai") / "stdlib"
    export_model(BUNDLED, out, ssm_impl="all")
    return out


def test_config_names_the_graph_states(bundled_export):
    cfg = json.loads((bundled_export / GENAI_CONFIG_FILE).read_text())
    dec = cfg["model"]["decoder"]
    n = load_checkpoint(BUNDLED).config.n_layer
    assert cfg["model"]["type"] == GENAI_MODEL_TYPE and dec["filename"] == "model.native.onnx"
    assert dec["inputs"] == {"input_ids": "input_ids", "past_conv_names": "past_conv_state.%d",
                             "past_recurrent_names": "past_ssm_state.%d"}
    assert dec["outputs"] == {"logits": "logits", "present_conv_names": "present_conv_state.%d",
                              "present_recurrent_names": "present_ssm_state.%d"}
    assert dec["state_groups"] == [{"kind": "fixed_conv", "layer_ids": list(range(n))},
                                   {"kind": "fixed_recurrent", "layer_ids": list(range(n))}]


def test_bundled_checkpoint_greedy_equals_pytorch(bundled_export):
    model = load_checkpoint(BUNDLED).model.eval()
    prompt = list(b"import os\ndef ")
    ref = model.generate_greedy(torch.tensor([prompt]), 40)[0].tolist()
    eos = json.loads((bundled_export / GENAI_CONFIG_FILE).read_text())["model"]["eos_token_id"]
    got = genai_greedy(bundled_export, prompt, 40)
    assert got == _cut_at_eos(ref, eos), f"genai {bytes(got)!r} != torch {bytes(ref)!r}"
    assert len(got) >= 20, "the byte model should not stop at once"


@pytest.mark.parametrize("ssm_impl", ["native", "ssmscan"])
def test_tiny_transformers_checkpoint_greedy_equals_transformers(tmp_path, ssm_impl):
    from tests.models.hf_checkpoints import hf_greedy, make

    ck, hf = make("mamba2", tmp_path / "ck", seed=3)
    out = tmp_path / "out"
    export_model(ck, out, ssm_impl=ssm_impl)
    prompt = [5, 17, 3, 42, 8, 9, 33]
    ref = hf_greedy(hf, torch.tensor([prompt]), 16)[0].tolist()
    eos = json.loads((out / GENAI_CONFIG_FILE).read_text())["model"]["eos_token_id"]
    got = genai_greedy(out, prompt, 16)
    assert got == _cut_at_eos(ref, eos), f"{ssm_impl}: genai {got} != transformers {ref}"
    assert np.asarray(got).size > 0


def _padded_checkpoint(tmp_path: Path, tie: bool) -> Path:
    """A mamba_ssm checkpoint, vocab_size 100 stored as 112 rows, whose padding rows would win every argmax
    (rows 100+2j, 101+2j = +-50 x row j: one of them scores 50 |logit_j|) if any runtime read them."""
    from safetensors.torch import load_file, save_file

    from m2export.models.checkpoint import random_checkpoint

    src = random_checkpoint(tmp_path / "rand", d_model=64, n_layer=2, vocab_size=100, d_state=16, headdim=16,
                            chunk_size=8, seed=4, tie_embeddings=tie)
    sd = load_file(str(src / "model.safetensors"))
    for k in ("backbone.embedding.weight", "lm_head.weight"):
        if k in sd:
            W = sd[k]
            assert W.shape[0] == 112 and not W[100:].any()  # save_checkpoint writes zero padding rows
            for j in range(6):
                W[100 + 2 * j], W[101 + 2 * j] = 50 * W[j], -50 * W[j]
    out = tmp_path / "padded"
    out.mkdir()
    (out / "config.json").write_text((src / "config.json").read_text())
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    assert (load_checkpoint(out).model.backbone.embedding.weight.shape[0]) == 100  # the loader drops them
    return out


@pytest.mark.parametrize("tie", [True, False])
def test_padded_vocabulary_never_yields_a_padding_row(tmp_path, tie):
    """mamba_ssm pads the lm_head to pad_vocab_size_multiple rows and slices its logits to vocab_size; the export's
    logits are vocab_size wide (every graph), genai_config says vocab_size, and genai (greedy and hot sampling)
    never yields an id >= vocab_size; greedy equals m2export generate's; m2export check passes."""
    import onnx

    from m2export.cli.main import main
    from m2export.generate import generate

    ck = _padded_checkpoint(tmp_path, tie)
    out = tmp_path / "out"
    export_model(ck, out, ssm_impl="all")
    assert json.loads((out / GENAI_CONFIG_FILE).read_text())["model"]["vocab_size"] == 100
    graphs = sorted(out.glob("*.onnx"))
    assert len(graphs) >= 3
    for g in graphs:
        dims = onnx.load(str(g), load_external_data=False).graph.output[0].type.tensor_type.shape.dim
        assert dims[-1].dim_value == 100, g.name
    prompt = [1, 2, 3]
    ref = generate(out, prompt, max_new_tokens=24).new_ids
    eos = json.loads((out / GENAI_CONFIG_FILE).read_text())["model"]["eos_token_id"]
    assert genai_greedy(out, prompt, 24) == _cut_at_eos(ref, eos) and max(ref) < 100
    model = og.Model(str(out))
    seen = []
    for seed in range(20):  # genai stops at eos: seeds until enough tokens are seen
        if len(seen) > 300:
            break
        p = og.GeneratorParams(model)
        p.set_search_options(max_length=120, do_sample=True, temperature=5.0, top_k=100, random_seed=seed)  # all ids
        gen = og.Generator(model, p)
        gen.append_tokens(np.array(prompt, np.int32))
        while not gen.is_done():
            gen.generate_next_token()
        seen += list(gen.get_sequence(0))[len(prompt):]
    assert len(seen) > 300 and max(seen) < 100 and len(set(seen)) > 50
    assert main(["check", str(out), "--checkpoint", str(ck), "--report-dir", str(tmp_path / "rep")]) == 0


def test_generate_refuses_logits_wider_than_the_vocabulary(tmp_path):
    """An export whose logits are wider than its config's vocab_size (what an older m2export wrote for a padded
    vocabulary) is refused by generate with one line, not sampled from (the padding ids are not tokens)."""
    import dataclasses

    from m2export.errors import ExportFolderError
    from m2export.generate import generate, open_runtime

    ck = _padded_checkpoint(tmp_path, True)
    out = tmp_path / "out"
    export_model(ck, out, ssm_impl="ssmscan")
    s = open_runtime(out, "onnxrt")
    s.cfg = dataclasses.replace(s.cfg, vocab_size=90)  # the logits stay 100 wide: as an old 112-wide export
    with pytest.raises(ExportFolderError, match=r"logits are 100 wide but the model has vocab_size 90"):
        generate(out, [1, 2], max_new_tokens=3, session=s)
