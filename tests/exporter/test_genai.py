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
