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


@pytest.mark.parametrize("name,params", [("falcon-h1-0.5b", 521_411_104), ("granite-4.0-h-1b", 1_461_538_368),
                                         ("zamba2-7b", 7_356_749_648), ("falcon-h1-7b", 7_585_513_568),
                                         ("zamba2-2.7b", 2_662_214_560)])
def test_part2_presets_match_transformers_parameter_count(name, params):
    """Presets found in public config copies: m2export's model and transformers' (built from the same
    config.json on the meta device) have the same parameter total, the one the sources cite."""
    import transformers

    spec = _spec(name)
    fam, cfg = preset_config(name)
    with torch.device("meta"):
        ours = sum(p.numel() for p in HybridLM(spec).parameters())
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    theirs = sum(p.numel() for p in {id(p): p for p in hf.parameters()}.values())
    assert ours == theirs == params
    if name == "falcon-h1-0.5b":
        mb, at = spec.layers[0].mamba, spec.layers[0].attention_in()
        assert (mb.nheads, mb.headdim, mb.d_inner, mb.d_state, at.num_heads, at.num_kv_heads, at.head_dim,
                at.rope.theta) == (24, 64, 1536, 128, 8, 2, 64, 1e11)
    elif name == "granite-4.0-h-1b":
        assert spec.attention_layers == (5, 15, 25, 35) and spec.layers[0].mamba.nheads == 48
    elif name == "zamba2-2.7b":
        assert (len(spec.shared_blocks), spec.layers[0].mamba.nheads, spec.layers[0].mamba.headdim) == (2, 80, 64)
    elif name == "zamba2-7b":
        assert (spec.n_layer, len(spec.shared_blocks), spec.layers[0].mamba.nheads, spec.layers[0].mamba.ngroups) \
            == (81, 2, 112, 2)
        assert spec.attention_layers == (6,) + tuple(range(11, 78, 6))  # 13 hybrid layers


def test_unavailable_preset_refused_by_name(tmp_path, monkeypatch):
    """A preset whose config was not found is refused with its reason (none is left today: a stand-in)."""
    monkeypatch.setitem(UNAVAILABLE, "some-hybrid-1b", "its config.json was not found")
    with pytest.raises(ConfigError, match=r"preset 'some-hybrid-1b' is not available: its config.json was not"):
        random_checkpoint(tmp_path / "x", preset="some-hybrid-1b")


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
    assert main(["random-checkpoint", "--preset", "tiny-bamba", "--d-model", "8", "-o", str(tmp_path / "x")]) == 2
    assert "applies to Mamba-2 shapes only" in capsys.readouterr().err
