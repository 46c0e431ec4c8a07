"""The PyTorch Mamba-2: logits vs HF transformers (ngroups=1), per-group gated norm, prefill+step == prefill."""

from __future__ import annotations

import pytest
import torch

from m2export.models.checkpoint import load_checkpoint, random_checkpoint
from m2export.models.config import Mamba2Config
from m2export.models.mamba2 import Mamba2LMHeadModel, RMSNormGated, init_weights_
from tests.helpers import assert_close

TINY = dict(d_model=64, n_layer=2, vocab_size=100, d_state=16, headdim=16, chunk_size=8)


def test_logits_match_hf_transformers(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency")
    path = random_checkpoint(tmp_path / "hf", format="hf", seed=1, **TINY)
    ours = load_checkpoint(path).model
    hf = transformers.Mamba2ForCausalLM.from_pretrained(str(path)).eval()
    ids = torch.randint(0, 100, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close("logits", hf(ids).logits, ours(ids).logits, rel=1e-5)


def test_grouped_norm_is_per_group():
    torch.manual_seed(0)
    d, groups = 32, 4
    norm = RMSNormGated(d, group_size=d // groups)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, z = torch.randn(2, 5, d), torch.randn(2, 5, d)
    g = x * torch.nn.functional.silu(z)
    direct = torch.cat([gi / gi.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt() for gi in g.split(d // groups, -1)], -1)
    assert_close("gated_norm", direct * norm.weight, norm(x, z), rel=1e-6)
    whole = g / g.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt() * norm.weight
    assert (whole - norm(x, z)).abs().max() > 1e-3, "per-group and whole-vector norms should differ"


@pytest.mark.parametrize("ngroups", [1, 2])
@pytest.mark.parametrize("n_prefill", [1, 2, 3, 9])
def test_prefill_then_steps_equals_long_prefill(ngroups, n_prefill):
    cfg = Mamba2Config(**dict(TINY, ngroups=ngroups))
    model = init_weights_(Mamba2LMHeadModel(cfg), seed=2).eval()
    ids = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(n_prefill))
    with torch.no_grad():
        full = model(ids)
        out = model(ids[:, :n_prefill])
        logits = [out.logits]
        for t in range(n_prefill, ids.shape[1]):
            out = model.step(ids[:, t:t + 1], out.conv_states, out.ssm_states)
            logits.append(out.logits)
    assert_close("logits", full.logits, torch.cat(logits, 1), rel=1e-5)
    for i in range(cfg.n_layer):
        assert_close(f"conv_state.{i}", full.conv_states[i], out.conv_states[i], rel=1e-6)
        assert_close(f"ssm_state.{i}", full.ssm_states[i], out.ssm_states[i], rel=1e-5)
    assert out.conv_states[0].shape == (2, cfg.conv_dim, cfg.d_conv - 1)
    assert out.ssm_states[0].shape == (2, cfg.nheads, cfg.headdim, cfg.d_state)
    assert out.ssm_states[0].dtype == torch.float32


def test_bf16_model_runs_with_fp32_states():
    cfg = Mamba2Config(**TINY)
    model = init_weights_(Mamba2LMHeadModel(cfg), seed=3).eval()
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids)
        out = model.to(torch.bfloat16)(ids)
    assert out.logits.dtype == torch.bfloat16 and out.ssm_states[0].dtype == torch.float32
    assert_close("logits", ref.logits, out.logits, rel=5e-2)


def test_mamba_ssm_init_ranges():
    cfg = Mamba2Config(**dict(TINY, n_layer=3))
    model = init_weights_(Mamba2LMHeadModel(cfg), seed=4)
    for m in model.mixers:
        A = torch.exp(m.A_log)
        assert ((A >= 1) & (A <= 16)).all()
        dt = torch.nn.functional.softplus(m.dt_bias)
        assert ((dt >= 1e-3 * 0.999) & (dt <= 0.1 * 1.001)).all()
        assert (m.D == 1).all()


@pytest.mark.parametrize("kw, hint", [(dict(headdim=7), "headdim must divide expand*d_model"),
                                      (dict(ngroups=3), "ngroups must divide nheads")])
def test_indivisible_sizes_are_one_line_and_a_hint(kw, hint):
    """A config whose sizes do not divide gets the error line and a hint saying which sizes to change (it had no
    hint: README trial 2026-12-04)."""
    from m2export.errors import ConfigError

    with pytest.raises(ConfigError, match="is not divisible by") as e:
        Mamba2Config(**dict(TINY, **kw))
    assert e.value.hint and e.value.hint.startswith(hint)
