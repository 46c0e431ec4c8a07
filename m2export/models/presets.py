"""Random-checkpoint presets of the hybrid families: the HF ``config.json`` of each published model, with
where every number comes from.

Each :class:`HybridPreset` holds the config.json m2export writes (read back through the family's strict
reader, so it must be complete), ``sources`` (the public files the numbers were taken from, with commits)
and ``unverified``: the keys whose published value was NOT found in the stored public material; their value
is the transformers 5.24 config-class default and is flagged wherever the preset is used. A preset whose
shape could not be established at all is in :data:`UNAVAILABLE` with the reason, and refused by name:
write such a model from its real config.json instead (``random-checkpoint --config``).

Mamba-2 presets (state-spaces/mamba2-*) stay in :data:`m2export.models.config.PRESETS`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

_MB = "NVIDIA-NeMo/Megatron-Bridge@067f987df03b"  # fetched snapshot (2026-08-22)
_MB_OLD = "NVIDIA-NeMo/Megatron-Bridge@ebdef7c11b"
_TF = "transformers 5.24.0"

_NEMOTRON_H_ARCH = {"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"]}
_GRANITE_ARCH = {"model_type": "granitemoehybrid", "architectures": ["GraniteMoeHybridForCausalLM"]}
_BAMBA_ARCH = {"model_type": "bamba", "architectures": ["BambaForCausalLM"]}
_FALCON_ARCH = {"model_type": "falcon_h1", "architectures": ["FalconH1ForCausalLM"]}
_ZAMBA2_ARCH = {"model_type": "zamba2", "architectures": ["Zamba2ForCausalLM"]}


@dataclass(frozen=True)
class HybridPreset:
    """``config``: the HF config.json written; ``sources``: where its numbers come from; ``unverified``:
    keys whose published value was not found (transformers default used, see the module docstring)."""

    family: str
    config: dict[str, Any]
    sources: tuple[str, ...]
    unverified: tuple[str, ...] = field(default=())


HYBRID_PRESETS: dict[str, HybridPreset] = {
    # nvidia/Nemotron-H-8B-Base-8K: its config.json as quoted (whole) in Megatron-Bridge's bridge test
    "nemotron-h-8b": HybridPreset("nemotron_h", {
        **_NEMOTRON_H_ARCH, "vocab_size": 131072, "hidden_size": 4096, "num_hidden_layers": 52,
        "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "num_attention_heads": 32, "num_key_value_heads": 8, "attention_head_dim": 128, "attention_bias": False,
        "intermediate_size": 21504, "mlp_hidden_act": "relu2", "hidden_act": "relu2", "mlp_bias": False,
        "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4,
        "chunk_size": 128, "expand": 2, "mamba_hidden_act": "silu", "mamba_proj_bias": False, "use_bias": False,
        "use_conv_bias": True, "layer_norm_epsilon": 1e-5, "rms_norm_eps": 1e-5, "residual_in_fp32": False,
        "tie_word_embeddings": False}, sources=(
        f"{_MB_OLD}:tests/unit_tests/models/nemotronh/test_nemotron_h_bridge.py (nemotronh_8b_config_dict, the "
        "hub config.json of nvidia/Nemotron-H-8B-Base-8K, transformers_version 4.48.0.dev0)",
        f"{_MB}:docs/models/nemotron/nemotronh.md ('Nemotron H 8B Specifications': same numbers)",
        "check: the model built from it has 8,100,852,736 parameters, the total a public architecture analysis of "
        "Nemotron-H-8B-Base-8K found by the search tool reports")),
    # NVIDIA-Nemotron-Nano-9B-v2: Megatron-Bridge's pretraining recipe and model doc
    "nemotron-nano-9b-v2": HybridPreset("nemotron_h", {
        **_NEMOTRON_H_ARCH, "vocab_size": 131072, "hidden_size": 4480, "num_hidden_layers": 56,
        "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
        "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 15680,
        "mlp_hidden_act": "relu2", "mamba_num_heads": 128, "mamba_head_dim": 80, "n_groups": 8,
        "ssm_state_size": 128, "conv_kernel": 4, "chunk_size": 128, "use_conv_bias": True, "use_bias": False,
        "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False}, sources=(
        f"{_MB}:src/megatron/bridge/recipes/nemotronh/h100/nemotron_nano_v2.py "
        "(nemotron_nano_9b_v2_pretrain_2gpu_h100_bf16_config: pattern, 56 layers, hidden 4480, mamba 128 x 80, "
        "state 128, ffn 15680, 40 heads, 8 query groups, kv_channels 128, mamba_num_groups 8, squared relu)",
        f"{_MB}:docs/models/nemotron/nemotronh.md ('Nemotron Nano 9B v2 Specifications': vocab 131,072)"),
        unverified=("conv_kernel", "chunk_size", "use_conv_bias", "use_bias", "layer_norm_epsilon",
                    "tie_word_embeddings", "time_step_limit")),
    # NVIDIA-Nemotron-3-Nano-30B-A3B: Megatron-Bridge's recipe; the rest as in copies of its hub config.json
    "nemotron-3-nano-30b-a3b": HybridPreset("nemotron_h", {
        **_NEMOTRON_H_ARCH, "vocab_size": 131072, "hidden_size": 2688, "num_hidden_layers": 52,
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "mlp_hidden_act": "relu2",
        "mamba_num_heads": 64, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4,
        "chunk_size": 128, "use_conv_bias": True, "use_bias": False, "n_routed_experts": 128,
        "num_experts_per_tok": 6, "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712,
        "n_shared_experts": 1, "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "intermediate_size": 1856, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False}, sources=(
        f"{_MB}:src/megatron/bridge/recipes/nemotronh/h100/nemotron_3_nano.py (pattern, 52 layers, hidden 2688, "
        "mamba 64 x 64, state 128, 32 heads, 2 query groups, kv_channels 128, 128 experts of 1856, shared 3712, "
        "top-6, scaling 2.5, 1 router group, mamba_num_groups 8)",
        "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 config.json as quoted in public test fixtures found by the "
        "search tool (vocab 131072, norm_topk_prob true, chunk_size 128, conv_kernel 4, layer_norm_epsilon 1e-5, "
        "n_shared_experts 1; no moe_latent_size); no citable file path in the stored index")),
    # IBM Granite-4.0-H-Small: the fields quoted from its config.json; the Mamba head layout was not found
    "granite-4.0-h-small": HybridPreset("granitemoehybrid", {
        **_GRANITE_ARCH, "vocab_size": 100352, "hidden_size": 4096, "num_hidden_layers": 40,
        "layer_types": ["attention" if i % 10 == 9 else "mamba" for i in range(40)], "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_local_experts": 72, "num_experts_per_tok": 10, "intermediate_size": 768,
        "shared_intermediate_size": 1536, "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_expand": 2,
        "mamba_n_heads": 128, "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_chunk_size": 256,
        "position_embedding_type": "nope", "embedding_multiplier": 1.0, "residual_multiplier": 1.0,
        "attention_multiplier": 1.0, "logits_scaling": 1.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
        sources=("ibm-granite/granite-4.0-h-small config.json fields quoted in a public architecture write-up found "
                 "by the search tool (hidden 4096, 40 layers, 32/8 heads, 72 experts top-10, intermediate 768, "
                 "shared 1536, mamba_d_state 128, d_conv 4, expand 2, tied, vocab 100352; layer_types 36 mamba + "
                 "4 attention)",
                 "IBM's Granite 4.0 announcement as reported in public articles: 9 Mamba-2 blocks per attention "
                 "block, no positional encoding"),
        unverified=("layer_types (which 4 layers attend: every 10th assumed)", "mamba_n_heads", "mamba_d_head",
                    "mamba_n_groups", "mamba_chunk_size", "embedding_multiplier", "residual_multiplier",
                    "attention_multiplier", "logits_scaling", "rms_norm_eps")),
    # IBM Bamba-9B: a few fields quoted from its config.json; the rest transformers' BambaConfig defaults, which
    # its docstring calls "similar to ibm-fms/Bamba-9.8b-2.2T-hf"
    "bamba-9b": HybridPreset("bamba", {
        **_BAMBA_ARCH, "vocab_size": 128000, "hidden_size": 4096, "num_hidden_layers": 32,
        "attn_layer_indices": [9, 18, 27], "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 14336, "mamba_d_state": 128, "mamba_n_heads": 128, "mamba_d_head": 64,
        "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5},
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False}, sources=(
        "ibm-ai-platform/Bamba-9B config.json fields quoted in public test fixtures found by the search tool "
        "(32 layers, 32 heads, hidden 4096, mamba_d_state 128, attn_layer_indices [9, 18, 27])",
        f"{_TF} BambaConfig defaults (auto_docstring checkpoint ibm-fms/Bamba-9.8b-2.2T-hf) for the rest"),
        unverified=("vocab_size", "num_key_value_heads", "intermediate_size", "mamba_n_heads", "mamba_d_head",
                    "mamba_n_groups", "mamba_chunk_size", "rope_parameters", "rms_norm_eps")),
    # TII Falcon-H1-7B: fields of its config.json quoted in a public sizing test; the rest unverified
    "falcon-h1-7b": HybridPreset("falcon_h1", {
        **_FALCON_ARCH, "vocab_size": 128000, "hidden_size": 3072, "num_hidden_layers": 44, "num_attention_heads": 12,
        "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 14336, "mamba_d_ssm": 3072,
        "mamba_n_heads": 24, "mamba_d_head": 128, "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_conv": 4,
        "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_rms_norm": False, "mamba_norm_before_gate": True,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "tie_word_embeddings": False},
        sources=("Falcon-H1-7B-Instruct config.json fields quoted in a public context-sizing test found by the search "
                 "tool (44 layers, 12/2 heads, head_dim 128, hidden 3072, mamba_d_head 128, mamba_d_ssm 3072, "
                 "d_state 256, 1 group, 24 Mamba heads, d_conv 4, expand 2)",
                 f"{_TF} FalconH1Config defaults for the rest"),
        unverified=("vocab_size", "intermediate_size", "mamba_chunk_size", "mamba_rms_norm", "mamba_norm_before_gate",
                    "rope_parameters", "every muP multiplier (1.0 used)", "tie_word_embeddings")),
    # Zyphra Zamba2-2.7B: 54 layers (45 mamba + 9 hybrid), hidden 2560, 32 heads, d_state 64 from its config.json
    # as quoted in public test fixtures; the rest transformers' Zamba2Config defaults (checkpoint Zyphra/Zamba2-2.7B)
    "zamba2-2.7b": HybridPreset("zamba2", {
        **_ZAMBA2_ARCH, "vocab_size": 32000, "hidden_size": 2560, "num_hidden_layers": 54,
        "layers_block_type": (["mamba"] + (["mamba"] * 5 + ["hybrid"]) * 7 + ["mamba"] * 4 + ["hybrid"]
                              + ["mamba"] * 3 + ["hybrid"] + ["mamba"] * 2),
        "num_attention_heads": 32, "num_key_value_heads": 32, "mamba_d_state": 64, "mamba_d_conv": 4,
        "mamba_expand": 2, "mamba_ngroups": 1, "n_mamba_heads": 8, "chunk_size": 256, "intermediate_size": 10240,
        "num_mem_blocks": 1, "use_shared_attention_adapter": False, "adapter_rank": 128, "use_mem_rope": False,
        "tie_word_embeddings": True},
        sources=("Zyphra/Zamba2-2.7B config.json fields quoted in public test fixtures found by the search tool "
                 "(54 layers: 45 mamba + 9 hybrid, hidden 2560, 32 heads, mamba_d_state 64)",
                 f"{_TF} Zamba2Config defaults (auto_docstring checkpoint Zyphra/Zamba2-2.7B): the layer pattern "
                 "(45 + 9, as quoted) and every other field"),
        unverified=("n_mamba_heads (transformers' 8 gives Mamba head dim 640)", "num_mem_blocks",
                    "use_shared_attention_adapter", "adapter_rank", "use_mem_rope", "intermediate_size (4 * hidden)",
                    "vocab_size", "chunk_size", "mamba_ngroups")),
    "tiny-falcon-h1": HybridPreset("falcon_h1", {
        **_FALCON_ARCH, "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "mamba_d_ssm": 80, "mamba_n_heads": 8,
        "mamba_d_head": 10, "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_chunk_size": 16, "mamba_rms_norm": True,
        "mamba_norm_before_gate": False, "projectors_bias": True, "ssm_multipliers": [0.5, 1.5, 0.75, 1.25, 0.8],
        "ssm_in_multiplier": 1.3, "ssm_out_multiplier": 0.7, "attention_in_multiplier": 0.9,
        "attention_out_multiplier": 1.1, "key_multiplier": 0.6, "mlp_multipliers": [1.2, 0.8],
        "embedding_multiplier": 2.0, "lm_head_multiplier": 0.5}, sources=("test shape",)),
    "tiny-zamba2": HybridPreset("zamba2", {
        **_ZAMBA2_ARCH, "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 5,
        "layers_block_type": ["hybrid", "mamba", "hybrid", "mamba", "hybrid"], "num_attention_heads": 4,
        "n_mamba_heads": 8, "mamba_d_state": 16, "mamba_ngroups": 2, "chunk_size": 16, "num_mem_blocks": 2,
        "use_shared_attention_adapter": True, "adapter_rank": 8, "use_mem_rope": True, "intermediate_size": 96,
        "tie_word_embeddings": True}, sources=("test shape",)),
    # test shapes (no published model): every case of the part-1 issue in a few hundred KB
    "tiny-nemotron-h": HybridPreset("nemotron_h", {
        **_NEMOTRON_H_ARCH, "vocab_size": 256, "hidden_size": 64, "layers_block_type":
            ["full_attention", "moe", "linear_attention", "mlp", "linear_attention", "moe"],
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
        "mamba_num_heads": 6, "mamba_head_dim": 10, "n_groups": 2, "ssm_state_size": 16, "chunk_size": 16,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 48, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.5},
        sources=("test shape",)),
    "tiny-granite-4.0-h": HybridPreset("granitemoehybrid", {
        **_GRANITE_ARCH, "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4,
        "layer_types": ["attention", "mamba", "mamba", "attention"], "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 32, "shared_intermediate_size": 48, "num_local_experts": 4,
        "num_experts_per_tok": 2, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 16,
        "mamba_chunk_size": 16, "position_embedding_type": "rope", "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22, "attention_multiplier": 0.0625, "logits_scaling": 4.0,
        "tie_word_embeddings": True}, sources=("test shape",)),
    "tiny-bamba": HybridPreset("bamba", {
        **_BAMBA_ARCH, "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 3, "attn_layer_indices": [1],
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "mamba_n_heads": 8,
        "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_chunk_size": 16}, sources=("test shape",)),
}

#: presets the issues ask for whose shape could not be established from stored public material
UNAVAILABLE: dict[str, str] = {
    "falcon-h1-0.5b": "only part of tiiuae/Falcon-H1-0.5B's shape was found (a public reproduction protocol records "
                      "36 hybrid layers, hidden 1024, KV 2 x 64, conv_state 1792 channels, ssm_state 24 x 64 x 128, "
                      "i.e. mamba_d_ssm 1536 in 1 group); its MLP width, vocabulary and attention heads were not, and "
                      "transformers' defaults for them would make a 2.19B-parameter model: m2export does not guess",
    "zamba2-7b": "no copy of Zyphra/Zamba2-7B's config.json (hidden size, layer pattern, Mamba heads, memory blocks) "
                 "was found in the stored public material, so m2export does not guess it",
    "granite-4.0-h-1b": "no copy of ibm-granite/granite-4.0-h-1b's config.json (hidden size, layer count, Mamba "
                        "heads, layer types) was found in the stored public material, so m2export does not guess it",
}


def preset_config(name: str) -> tuple[str, dict[str, Any]]:
    """(family, config.json dict) of hybrid preset ``name``; logs a warning naming its unverified fields.

    Raises:
        ConfigError: ``name`` is unavailable (with why) or unknown (with the list).
    """
    from m2export.errors import ConfigError

    if name in UNAVAILABLE:
        raise ConfigError(f"preset {name!r} is not available: {UNAVAILABLE[name]}",
                          hint="download the model's config.json and pass it as `config_json`")
    if name not in HYBRID_PRESETS:
        raise ConfigError(f"unknown preset {name!r}; expected one of {sorted(HYBRID_PRESETS)}")
    p = HYBRID_PRESETS[name]
    if p.unverified:
        log.warning("preset %s: published value not found for %s; transformers' default used", name,
                    ", ".join(p.unverified))
    return p.family, dict(p.config)
