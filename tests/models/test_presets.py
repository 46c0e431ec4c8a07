"""Hybrid random-checkpoint presets: every config is complete for its family's strict reader, the shapes are
the published ones, and tiny presets are written so that transformers loads them and agrees with m2export."""

from __future__ import annotations

import json

import pytest
import torch

from m2export.cli.main import main
from m2export.errors import ConfigError
from m2export.models.checkpoint import load_checkpoint, random_checkpoint
from m2export.models.families import READERS
from m2export.models.mamba2 import HybridLM
from m2export.models.presets import HYBRID_PRESETS, UNAVAILABLE, preset_config


pytestmark = pytest.mark.usefixtures("single_threaded_torch")  # tiny models: see tests/conftest.py


def _spec(name):
    fam, cfg = preset_config(name)
    return READERS[fam](cfg, name)


@pytest.mark.parametrize("name", sorted(HYBRID_PRESETS))
def test_preset_config_is_complete_and_cited(name):
    spec = _spec(name)
    assert spec.n_layer > 0 and spec.states()
    assert HYBRID_PRESETS[name].sources, "every preset says where its numbers come from"


def test_published_shapes():
    with torch.device("meta"):
        n8b = sum(p.numel() for p in HybridLM(_spec("nemotron-h-8b")).parameters())
    assert n8b == 8_100_852_736  # the published parameter total of Nemotron-H-8B-Base-8K
    nano = _spec("nemotron-nano-9b-v2")
    mb = nano.layers[0].mamba
    assert (mb.headdim, mb.nheads, mb.d_inner, nano.d_model * 2) == (80, 128, 10240, 8960)  # d_inner != expand*d
    moe = _spec("nemotron-3-nano-30b-a3b").layers[1].mixer
    assert (moe.n_experts, moe.top_k, moe.routed_scaling_factor, moe.shared.d_ff) == (128, 6, 2.5, 3712)
    assert _spec("bamba-9b").attention_layers == (9, 18, 27)
    f7 = _spec("falcon-h1-7b")
    mb, at = f7.layers[0].mamba, f7.layers[0].attention_in()
    assert (f7.n_layer, mb.nheads, mb.headdim, mb.d_state, at.num_heads, at.num_kv_heads, at.head_dim) == \
        (44, 24, 128, 256, 12, 2, 128)
    z = _spec("zamba2-2.7b")
    assert (z.n_layer, len(z.attention_layers), z.d_model) == (54, 9, 2560)


def test_unavailable_preset_refused_by_name(tmp_path):
    name = next(iter(UNAVAILABLE))
    with pytest.raises(ConfigError, match=rf"preset '{name}' is not available"):
        random_checkpoint(tmp_path / "x", preset=name)


@pytest.mark.parametrize("name", [n for n in sorted(HYBRID_PRESETS) if n.startswith("tiny-")])
def test_tiny_preset_loads_in_transformers_and_agrees(tmp_path, name):
    import transformers

    path = random_checkpoint(tmp_path / name, preset=name, seed=3)
    ours = load_checkpoint(path).model
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for m in hf.modules():  # transformers' Nemotron-H clamps dt at time_step_min in prefill; m2export follows
        if hasattr(m, "time_step_limit"):  # the config's time_step_limit (see m2export.models.families): the
            m.time_step_limit = (0.0, float("inf"))  # mamba_ssm init puts dt near 1e-3, where this shows (2e-4)
    ids = torch.randint(0, ours.spec.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        err = (ours.forward_states(ids).logits - hf(input_ids=ids, use_cache=False).logits.float()).abs().max()
    assert err <= 2e-5


def test_cli_config_option_and_refusals(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(HYBRID_PRESETS["tiny-bamba"].config))
    assert main(["random-checkpoint", "--config", str(cfg), "-o", str(tmp_path / "ck"), "-q"]) == 0
    assert load_checkpoint(tmp_path / "ck").format == "bamba"
    assert main(["random-checkpoint", "--preset", "tiny-bamba", "--d-model", "8", "-o", str(tmp_path / "x")]) == 1
    assert "applies to Mamba-2 shapes only" in capsys.readouterr().err
