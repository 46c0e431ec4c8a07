"""Tiny random checkpoints written by transformers itself (``XConfig(...)``, ``XForCausalLM(cfg).save_pretrained``),
for comparing m2export's models and exports with transformers. Shared by tests/models and the export tests.

Every maker gives the Mamba parameters A_log, dt_bias, D and every norm weight random non-default values
(transformers initialises them to constants), so a test cannot pass by accident of the defaults, and keeps
softplus(dt + dt_bias) well above 1e-3 (transformers' Zamba2, and Nemotron-H up to 5.24, clamp dt at
time_step_min in prefill only; see m2export.models.families).

``make(name, dir)`` -> (checkpoint dir, the transformers model in eval mode, float32). Names: :data:`CASES`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

#: case name -> (transformers config class name, model class name, config kwargs)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # Nemotron-H: pattern starts with attention then MoE; ngroups 2; head dim 10 (not a power of two);
    # d_inner = 6*10 = 60 != expand*hidden = 64; MoE top-2 of 4 in 2 groups + shared expert; GQA 4/2
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        vocab_size=96, hidden_size=32, layers_block_type=["full_attention", "moe", "linear_attention", "mlp",
                                                          "linear_attention", "moe"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=40, mamba_num_heads=6,
        mamba_head_dim=10, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=8, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, n_group=2,
        topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.5, use_conv_bias=True, tie_word_embeddings=False,
        layer_norm_epsilon=1e-5)),
    # legacy hybrid_override_pattern, MoE first, latent MoE projection, MLP bias
    "nemotron_h_latent": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        vocab_size=80, hidden_size=24, hybrid_override_pattern="EM*M", num_attention_heads=2,
        num_key_value_heads=1, head_dim=12, intermediate_size=32, mamba_num_heads=4, mamba_head_dim=12, n_groups=1,
        ssm_state_size=16, chunk_size=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
        moe_shared_expert_intermediate_size=12, moe_latent_size=16, n_group=1, topk_group=1, mlp_bias=True,
        norm_topk_prob=False)),
    # Nemotron-H with the fields transformers 5.24 writes but never reads: in_proj/out_proj biases from use_bias
    # (save_pretrained writes mamba_proj_bias false anyway), attention_bias and residual_in_fp32 true (ignored),
    # tie_word_embeddings true (not tied: lm_head.weight is its own tensor); MLP bias too
    "nemotron_h_bias": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        vocab_size=64, hidden_size=32, layers_block_type=["mamba", "attention", "mlp", "mamba"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, mamba_num_heads=4, mamba_head_dim=16, n_groups=1,
        ssm_state_size=8, chunk_size=8, intermediate_size=32, use_bias=True, mlp_bias=True, attention_bias=True,
        residual_in_fp32=True, tie_word_embeddings=True)),
    # Granite 4.0-H: attention first, RoPE, all multipliers non-unit, MoE top-2 of 4 + shared MLP, ngroups 2
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=4,
        layer_types=["full_attention", "mamba", "mamba", "attention"], num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=16, shared_intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
        mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=8,
        position_embedding_type="rope", embedding_multiplier=3.0, residual_multiplier=0.5,
        attention_multiplier=0.2, logits_scaling=2.5, tie_word_embeddings=True)),
    # Granite dense (num_local_experts 0), no positional encoding, untied
    "granitemoehybrid_dense": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
        num_attention_heads=4, num_key_value_heads=4, intermediate_size=16, shared_intermediate_size=40,
        num_local_experts=0, mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=8,
        position_embedding_type=None, embedding_multiplier=2.0, residual_multiplier=0.7, attention_multiplier=0.1,
        logits_scaling=3.0, tie_word_embeddings=False)),
    # Bamba: attention at 0 and 2, partial RoPE, SwiGLU, ngroups 2
    "bamba": ("BambaConfig", "BambaForCausalLM", dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=3, attn_layer_indices=[0, 2], num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=8, mamba_chunk_size=8, tie_word_embeddings=False)),
    # Falcon-H1: gated RMSNorm per group (2 groups) normalised after the gate, every bias on, non-unit muP
    # multipliers, mamba_d_ssm 48 != expand*hidden 64, Mamba head dim 12, GQA 4/2 with head dim 8
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=40, mamba_d_ssm=48, mamba_n_heads=4, mamba_d_head=12, mamba_n_groups=2,
        mamba_d_state=8, mamba_chunk_size=8, mamba_rms_norm=True, mamba_norm_before_gate=False,
        mamba_proj_bias=True, projectors_bias=True, attention_bias=True, mlp_bias=True,
        ssm_multipliers=[0.5, 1.5, 0.75, 1.25, 0.8], ssm_in_multiplier=1.3, ssm_out_multiplier=0.7,
        attention_in_multiplier=0.9, attention_out_multiplier=1.1, key_multiplier=0.6, mlp_multipliers=[1.2, 0.8],
        embedding_multiplier=2.0, lm_head_multiplier=0.5, rope_parameters={"rope_theta": 1e5, "rope_type": "default"},
        tie_word_embeddings=False)),
    # Falcon-H1 as above but the gated RMSNorm normalises before the gate (mamba_norm_before_gate true);
    # attention head_dim 12 != hidden_size / heads = 8 (Falcon-H1-0.5B: 64 != 128)
    "falcon_h1_norm_before_gate": ("FalconH1Config", "FalconH1ForCausalLM", dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=12, intermediate_size=40, mamba_d_ssm=48, mamba_n_heads=4, mamba_d_head=12, mamba_n_groups=2,
        mamba_d_state=8, mamba_chunk_size=8, mamba_rms_norm=True, mamba_norm_before_gate=True,
        ssm_multipliers=[1.5, 0.5, 1.25, 0.75, 1.2], ssm_in_multiplier=0.8, ssm_out_multiplier=1.4,
        attention_in_multiplier=1.2, attention_out_multiplier=0.9, key_multiplier=1.3, mlp_multipliers=[0.7, 1.3],
        embedding_multiplier=0.5, lm_head_multiplier=2.0, tie_word_embeddings=False)),
    # Falcon-H1 without the gated norm (y * silu(z)), norm-before-gate default, no conv bias, tied embeddings
    "falcon_h1_nonorm": ("FalconH1Config", "FalconH1ForCausalLM", dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=48, mamba_d_ssm=64, mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=16,
        mamba_chunk_size=8, mamba_rms_norm=False, mamba_conv_bias=False, ssm_multipliers=[1.0, 2.0, 0.5, 0.5, 1.5],
        tie_word_embeddings=True)),
    # Zamba2: two shared blocks called ABA (first layer hybrid), attention adapters, RoPE, ngroups 2
    "zamba2": ("Zamba2Config", "Zamba2ForCausalLM", dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=5, layers_block_type=["hybrid", "mamba", "hybrid",
                                                                               "mamba", "hybrid"],
        num_attention_heads=4, num_key_value_heads=4, n_mamba_heads=4, mamba_d_state=8, mamba_ngroups=2,
        chunk_size=8, num_mem_blocks=2, use_shared_attention_adapter=True, adapter_rank=4, use_mem_rope=True,
        intermediate_size=40, tie_word_embeddings=True)),  # false unties the shared blocks in transformers 5.24
    # Zamba2: one shared block, no attention adapters (the MLP ones are always there), no RoPE, GQA 2/1, tied,
    # add_bias_linear (in_proj, out_proj, gate_up, down), mamba_expand 3
    "zamba2_plain": ("Zamba2Config", "Zamba2ForCausalLM", dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        num_attention_heads=2, num_key_value_heads=1, n_mamba_heads=8, mamba_expand=3, mamba_d_state=8,
        chunk_size=8, num_mem_blocks=1, use_shared_attention_adapter=False, adapter_rank=8, use_mem_rope=False,
        add_bias_linear=True)),
    # plain Mamba-2 saved by transformers 5 (time_step_limit written as {"__float__": "Infinity"}), ngroups 2
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, n_groups=2, state_size=8,
        chunk_size=8, tie_word_embeddings=False)),
}


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Non-default values for what transformers initialises to constants: A_log, dt_bias, D, every norm
    weight, MoE score-correction biases; plus larger embeddings so the logits are far from uniform."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            p.copy_(torch.log(torch.empty(p.shape).uniform_(0.5, 8.0, generator=g)))
        elif leaf == "dt_bias":
            p.copy_(torch.empty(p.shape).uniform_(-1.0, 1.5, generator=g))
        elif leaf == "D":
            p.copy_(torch.empty(p.shape).uniform_(0.5, 2.0, generator=g))
        elif "norm" in name and leaf == "weight":
            p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=g))
        elif p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 / math.sqrt(p.shape[-1])))
        elif leaf == "bias":
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)


def make(name: str, outdir: str | Path, seed: int = 0, **overrides) -> tuple[Path, torch.nn.Module]:
    """Write case ``name`` (with config ``overrides``) to ``outdir`` with transformers; returns (dir, model)."""
    import transformers

    cfg_cls, model_cls, kwargs = CASES[name]
    cfg = getattr(transformers, cfg_cls)(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).float().eval()
    randomize_(model, seed)
    out = Path(outdir)
    model.save_pretrained(out)
    return out, model


@torch.no_grad()
def hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits (batch, seqlen, vocab) of one full forward, float32."""
    return model(input_ids=ids, use_cache=False).logits.float()


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, ids: torch.Tensor, n: int) -> torch.Tensor:
    """transformers' ``generate`` (greedy, exactly n new tokens, its own cache): (batch, n) new ids."""
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, num_beams=1, pad_token_id=0, eos_token_id=None)
    return out[:, ids.shape[1]:]



#: what transformers 5.25's ``generate`` raises for a model whose first block keeps no cache (Nemotron-H with
#: pattern "EM*M": MoE first): its ``Cache.get_seq_length()`` asks layer 0, a ``DummyLayer`` without that
#: method; 5.24 skipped to the first layer that keeps a cache. A transformers bug (reproduced with
#: transformers alone: NemotronHForCausalLM(NemotronHConfig(hybrid_override_pattern="EM*M")).generate(...))
GENERATE_DUMMY_LAYER_BUG = "'DummyLayer' object has no attribute 'get_seq_length'"


@torch.no_grad()
def hf_greedy_uncached(model: torch.nn.Module, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy tokens from transformers' full forward without its cache (one forward over the whole sequence per
    token): (batch, n) new ids. The oracle where ``generate`` is broken (:data:`GENERATE_DUMMY_LAYER_BUG`)."""
    seq = ids
    for _ in range(n):
        nxt = hf_logits(model, seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    return seq[:, ids.shape[1]:]
