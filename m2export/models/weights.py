"""Checkpoint tensor names of each family, mapped onto :class:`~m2export.models.mamba2.HybridLM`'s names.

Zamba2 stores each shared block (and the adapters of every call of it) under the first hybrid layer that calls
it; copies under later callers are checked equal to it at load (``WeightPlan.copies``).

:func:`plan_weights` turns the names in a checkpoint into a plan: internal name -> the checkpoint tensor(s)
it comes from (one tensor, or one per expert stacked along a new first axis: Nemotron-H stores experts as
``experts.{e}.up_proj.weight``), before any tensor is read, so shapes can be checked against the config
first. Names follow what transformers 5.24 ``save_pretrained`` writes (the hub layout) and, where they
differ, transformers' in-memory names (``model.`` instead of ``backbone.`` for Nemotron-H, 3-D
``experts.gate_up_proj`` for Granite).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

from m2export.models.spec import MLPSpec, ModelSpec

log = logging.getLogger(__name__)


@dataclass
class Source:
    """Where one internal tensor comes from: ``keys[0]``, or ``keys`` stacked on a new axis 0 (experts)."""

    keys: list[str]
    stacked: bool = False


@dataclass
class WeightPlan:
    """internal name -> :class:`Source`; ``ignored``: checkpoint tensors deliberately not loaded (e.g. MTP
    layers); ``unmapped``: checkpoint tensors no rule claims (an error for the loader)."""

    sources: dict[str, Source] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    unmapped: list[str] = field(default_factory=list)
    #: checkpoint tensor -> the internal tensor it must equal (a tied copy of a shared block, Zamba2)
    copies: dict[str, str] = field(default_factory=dict)


_L = r"(?P<i>\d+)"

# (pattern, replacement) pairs, tried in order, full match; "{e}" in a replacement marks a stacked expert tensor
_NEMOTRON_H = [
    (r"(?:backbone|model)\.embeddings\.weight", "backbone.embedding.weight"),
    (r"(?:backbone|model)\.norm_f\.weight", "backbone.norm_f.weight"),
    (rf"(?:backbone|model)\.layers\.{_L}\.norm\.weight", "backbone.layers.{i}.norm.weight"),
    (rf"(?:backbone|model)\.layers\.{_L}\.mixer\.experts\.(?P<e>\d+)\.up_proj\.weight",
     "backbone.layers.{i}.mixer.experts_in{e}"),
    (rf"(?:backbone|model)\.layers\.{_L}\.mixer\.experts\.(?P<e>\d+)\.down_proj\.weight",
     "backbone.layers.{i}.mixer.experts_out{e}"),
    (rf"(?:backbone|model)\.layers\.{_L}\.mixer\.experts\.up_proj", "backbone.layers.{i}.mixer.experts_in"),
    (rf"(?:backbone|model)\.layers\.{_L}\.mixer\.experts\.down_proj", "backbone.layers.{i}.mixer.experts_out"),
    (rf"(?:backbone|model)\.layers\.{_L}\.mixer\.gate\.(?P<p>weight|e_score_correction_bias)",
     "backbone.layers.{i}.mixer.router.{p}"),
    (rf"(?:backbone|model)\.layers\.{_L}\.mixer\.shared_experts\.(?P<p>.+)", "backbone.layers.{i}.mixer.shared.{p}"),
    (rf"(?:backbone|model)\.layers\.{_L}\.mixer\.fc1_latent_proj\.(?P<p>.+)",
     "backbone.layers.{i}.mixer.latent_in.{p}"),
    (rf"(?:backbone|model)\.layers\.{_L}\.mixer\.fc2_latent_proj\.(?P<p>.+)",
     "backbone.layers.{i}.mixer.latent_out.{p}"),
    (rf"(?:backbone|model)\.layers\.{_L}\.mixer\.(?P<p>.+)", "backbone.layers.{i}.mixer.{p}"),
    (r"lm_head\.weight", "lm_head.weight"),
]
_NEMOTRON_H_IGNORED = re.compile(r"mtp\..*")

_GRANITE = [
    (r"model\.embed_tokens\.weight", "backbone.embedding.weight"),
    (r"model\.norm\.weight", "backbone.norm_f.weight"),
    (rf"model\.layers\.{_L}\.input_layernorm\.weight", "backbone.layers.{i}.norm.weight"),
    (rf"model\.layers\.{_L}\.post_attention_layernorm\.weight", "backbone.layers.{i}.ffn_norm.weight"),
    (rf"model\.layers\.{_L}\.(?:mamba|self_attn)\.(?P<p>.+)", "backbone.layers.{i}.mixer.{p}"),
    (rf"model\.layers\.{_L}\.block_sparse_moe\.(?:input_linear\.weight|experts\.gate_up_proj)",
     "backbone.layers.{i}.ffn.experts_in"),
    (rf"model\.layers\.{_L}\.block_sparse_moe\.(?:output_linear\.weight|experts\.down_proj)",
     "backbone.layers.{i}.ffn.experts_out"),
    (rf"model\.layers\.{_L}\.block_sparse_moe\.router\.(?:layer\.)?weight", "backbone.layers.{i}.ffn.router.weight"),
    (rf"model\.layers\.{_L}\.shared_mlp\.input_linear\.(?P<p>weight|bias)",
     "backbone.layers.{i}.ffn.{shared}gate_up_proj.{p}"),
    (rf"model\.layers\.{_L}\.shared_mlp\.output_linear\.(?P<p>weight|bias)",
     "backbone.layers.{i}.ffn.{shared}down_proj.{p}"),
    (r"lm_head\.weight", "lm_head.weight"),
]

_BAMBA = [
    (r"model\.embed_tokens\.weight", "backbone.embedding.weight"),
    (r"model\.final_layernorm\.weight", "backbone.norm_f.weight"),
    (rf"model\.layers\.{_L}\.input_layernorm\.weight", "backbone.layers.{i}.norm.weight"),
    (rf"model\.layers\.{_L}\.pre_ff_layernorm\.weight", "backbone.layers.{i}.ffn_norm.weight"),
    (rf"model\.layers\.{_L}\.(?:mamba|self_attn)\.(?P<p>.+)", "backbone.layers.{i}.mixer.{p}"),
    (rf"model\.layers\.{_L}\.feed_forward\.(?P<p>.+)", "backbone.layers.{i}.ffn.{p}"),
    (r"lm_head\.weight", "lm_head.weight"),
]

_FALCON_H1 = [
    (r"model\.embed_tokens\.weight", "backbone.embedding.weight"),
    (r"model\.final_layernorm\.weight", "backbone.norm_f.weight"),
    (rf"model\.layers\.{_L}\.input_layernorm\.weight", "backbone.layers.{i}.norm.weight"),
    (rf"model\.layers\.{_L}\.pre_ff_layernorm\.weight", "backbone.layers.{i}.ffn_norm.weight"),
    (rf"model\.layers\.{_L}\.mamba\.(?P<p>.+)", "backbone.layers.{i}.mixer.mamba.{p}"),
    (rf"model\.layers\.{_L}\.self_attn\.(?P<p>.+)", "backbone.layers.{i}.mixer.attention.{p}"),
    (rf"model\.layers\.{_L}\.feed_forward\.(?P<p>.+)", "backbone.layers.{i}.ffn.{p}"),
    (r"lm_head\.weight", "lm_head.weight"),
]


def _zamba2_block(g: dict, spec: ModelSpec) -> str | None:
    """Zamba2 stores shared block k under the first hybrid layer that calls it; later copies (tied) are
    ignored. -> the internal prefix of the block, or None for a tied copy."""
    hybrid = [i for i, L in enumerate(spec.layers) if L.shared is not None]
    i = int(g["i"])
    if i not in hybrid:
        return "not-a-hybrid-layer"  # unexpected: reported by the loader
    k = spec.layers[i].shared.block
    return f"backbone.shared_blocks.{k}" if hybrid.index(i) == k else None


def _zamba2_owner(g: dict, spec: ModelSpec) -> int:
    """The layer that stores the shared block layer g["i"] calls (its first caller)."""
    hybrid = [i for i, L in enumerate(spec.layers) if L.shared is not None]
    return hybrid[spec.layers[int(g["i"])].shared.block]


def _zamba2_adapter(g: dict, spec: ModelSpec) -> str | None:
    """Adapter list entry c of a block belongs to hybrid call c, i.e. to the c-th hybrid layer (taken from the
    block's first caller; the other callers' lists are tied copies: None)."""
    if _zamba2_block(g, spec) is None:
        return None
    hybrid = [i for i, L in enumerate(spec.layers) if L.shared is not None]
    c = int(g["c"])
    return f"backbone.layers.{hybrid[c] if c < len(hybrid) else 'no-such-call'}.adapters"


_ZAMBA2 = [
    (r"model\.embed_tokens\.weight", "backbone.embedding.weight"),
    (r"model\.final_layernorm\.weight", "backbone.norm_f.weight"),
    (rf"model\.layers\.{_L}\.(?:mamba_decoder\.)?input_layernorm\.weight", "backbone.layers.{i}.norm.weight"),
    (rf"model\.layers\.{_L}\.(?:mamba_decoder\.)?mamba\.(?P<p>.+)", "backbone.layers.{i}.mixer.{p}"),
    (rf"model\.layers\.{_L}\.linear\.weight", "backbone.layers.{i}.shared_proj.weight"),
    (rf"model\.layers\.{_L}\.shared_transformer\.self_attn\.linear_(?P<x>[qkv])_adapter_list\.(?P<c>\d+)\."
     r"(?P<j>[01])\.weight", (_zamba2_adapter, ".{x}.{j}.weight")),
    (rf"model\.layers\.{_L}\.shared_transformer\.feed_forward\.gate_up_proj_adapter_list\.(?P<c>\d+)\."
     r"(?P<j>[01])\.weight", (_zamba2_adapter, ".gate_up.{j}.weight")),
    (rf"model\.layers\.{_L}\.shared_transformer\.input_layernorm\.weight", (_zamba2_block, ".norm.weight")),
    (rf"model\.layers\.{_L}\.shared_transformer\.pre_ff_layernorm\.weight", (_zamba2_block, ".ffn_norm.weight")),
    (rf"model\.layers\.{_L}\.shared_transformer\.self_attn\.(?P<p>[qkvo]_proj\.weight)",
     (_zamba2_block, ".attention.{p}")),
    (rf"model\.layers\.{_L}\.shared_transformer\.feed_forward\.(?P<p>(?:gate_up|down)_proj\.(?:weight|bias))",
     (_zamba2_block, ".mlp.{p}")),
    (r"lm_head\.weight", "lm_head.weight"),
]

_MAMBA2 = [  # HF Mamba2ForCausalLM; mamba_ssm names are the internal names already
    (r"backbone\.embeddings\.weight", "backbone.embedding.weight"),
]

RULES = {"nemotron_h": _NEMOTRON_H, "granitemoehybrid": _GRANITE, "bamba": _BAMBA, "falcon_h1": _FALCON_H1,
         "zamba2": _ZAMBA2, "mamba2": _MAMBA2, "mamba_ssm": []}
_IGNORED = {"nemotron_h": _NEMOTRON_H_IGNORED}
_COMPILED = {fam: [(re.compile(p), r) for p, r in rules] for fam, rules in RULES.items()}


def plan_weights(family: str, spec: ModelSpec, names: list[str]) -> WeightPlan:
    """Map checkpoint tensor ``names`` of ``family`` onto internal names (see the module docstring).

    Names no rule matches are kept as they are (they are then either internal names already, or unexpected).
    """
    plan = WeightPlan()
    stacks: dict[str, dict[int, str]] = {}
    ignored = _IGNORED.get(family)
    for name in names:
        if ignored is not None and ignored.fullmatch(name):
            plan.ignored.append(name)
            continue
        target = name
        for pat, rep in _COMPILED[family]:
            m = pat.fullmatch(name)
            if m is None:
                continue
            g = m.groupdict()
            if isinstance(rep, tuple):  # (prefix function of (groups, spec), suffix template)
                prefix = rep[0](g, spec)
                if prefix is None:  # a copy of a shared block in a later caller: must equal the stored one
                    owner = dict(g, i=str(_zamba2_owner(g, spec)))
                    plan.copies[name] = rep[0](owner, spec) + rep[1].format(**owner)
                    target = None
                else:
                    target = prefix + rep[1].format(**g)
                break
            shared = ""
            if "{shared}" in rep:  # Granite: the shared MLP is ffn.shared under MoE, ffn itself when dense
                shared = "" if isinstance(spec.layers[int(g["i"])].ffn, MLPSpec) else "shared."
            if "{e}" in rep:
                base = rep.replace("{e}", "").format(i=g["i"])
                stacks.setdefault(base, {})[int(g["e"])] = name
                target = None
            else:
                target = rep.format(shared=shared, **{k: v for k, v in g.items() if k != "e"})
            break
        if target is not None:
            if target in plan.sources:
                plan.unmapped.append(name)  # two checkpoint names for one tensor: reported as unexpected
            else:
                plan.sources[target] = Source([name])
    for base, by_e in stacks.items():
        keys = [by_e[e] for e in sorted(by_e)]
        if sorted(by_e) != list(range(len(by_e))):
            plan.unmapped.extend(keys)  # a gap in the expert numbering: the shape check names the tensor
            continue
        plan.sources[base] = Source(keys, stacked=True)
    if plan.ignored:
        log.info("ignoring %d tensor(s) not used for inference (e.g. %s)", len(plan.ignored), plan.ignored[0])
    return plan


# internal name -> checkpoint name, per family: (pattern, replacement); "{kind}" = mamba|self_attn (Granite, Bamba)
_TO_HF = {
    "nemotron_h": [
        (r"backbone\.embedding\.weight", "backbone.embeddings.weight"),
        (rf"backbone\.layers\.{_L}\.mixer\.router\.(?P<p>.+)", "backbone.layers.{i}.mixer.gate.{p}"),
        (rf"backbone\.layers\.{_L}\.mixer\.shared\.(?P<p>.+)", "backbone.layers.{i}.mixer.shared_experts.{p}"),
        (rf"backbone\.layers\.{_L}\.mixer\.latent_in\.(?P<p>.+)", "backbone.layers.{i}.mixer.fc1_latent_proj.{p}"),
        (rf"backbone\.layers\.{_L}\.mixer\.latent_out\.(?P<p>.+)", "backbone.layers.{i}.mixer.fc2_latent_proj.{p}"),
        (rf"backbone\.layers\.{_L}\.mixer\.experts_in", "backbone.layers.{i}.mixer.experts.{e}.up_proj.weight"),
        (rf"backbone\.layers\.{_L}\.mixer\.experts_out", "backbone.layers.{i}.mixer.experts.{e}.down_proj.weight"),
    ],
    "granitemoehybrid": [
        (r"backbone\.embedding\.weight", "model.embed_tokens.weight"),
        (r"backbone\.norm_f\.weight", "model.norm.weight"),
        (rf"backbone\.layers\.{_L}\.norm\.weight", "model.layers.{i}.input_layernorm.weight"),
        (rf"backbone\.layers\.{_L}\.ffn_norm\.weight", "model.layers.{i}.post_attention_layernorm.weight"),
        (rf"backbone\.layers\.{_L}\.mixer\.(?P<p>.+)", "model.layers.{i}.{kind}.{p}"),
        (rf"backbone\.layers\.{_L}\.ffn\.experts_in", "model.layers.{i}.block_sparse_moe.input_linear.weight"),
        (rf"backbone\.layers\.{_L}\.ffn\.experts_out", "model.layers.{i}.block_sparse_moe.output_linear.weight"),
        (rf"backbone\.layers\.{_L}\.ffn\.router\.weight", "model.layers.{i}.block_sparse_moe.router.layer.weight"),
        (rf"backbone\.layers\.{_L}\.ffn\.(?:shared\.)?gate_up_proj\.(?P<p>.+)",
         "model.layers.{i}.shared_mlp.input_linear.{p}"),
        (rf"backbone\.layers\.{_L}\.ffn\.(?:shared\.)?down_proj\.(?P<p>.+)",
         "model.layers.{i}.shared_mlp.output_linear.{p}"),
    ],
    "falcon_h1": [
        (r"backbone\.embedding\.weight", "model.embed_tokens.weight"),
        (r"backbone\.norm_f\.weight", "model.final_layernorm.weight"),
        (rf"backbone\.layers\.{_L}\.norm\.weight", "model.layers.{i}.input_layernorm.weight"),
        (rf"backbone\.layers\.{_L}\.ffn_norm\.weight", "model.layers.{i}.pre_ff_layernorm.weight"),
        (rf"backbone\.layers\.{_L}\.mixer\.mamba\.(?P<p>.+)", "model.layers.{i}.mamba.{p}"),
        (rf"backbone\.layers\.{_L}\.mixer\.attention\.(?P<p>.+)", "model.layers.{i}.self_attn.{p}"),
        (rf"backbone\.layers\.{_L}\.ffn\.(?P<p>.+)", "model.layers.{i}.feed_forward.{p}"),
    ],
    "zamba2": [
        (r"backbone\.embedding\.weight", "model.embed_tokens.weight"),
        (r"backbone\.norm_f\.weight", "model.final_layernorm.weight"),
        (rf"backbone\.layers\.{_L}\.norm\.weight", "model.layers.{i}.{mamba_decoder}input_layernorm.weight"),
        (rf"backbone\.layers\.{_L}\.mixer\.(?P<p>.+)", "model.layers.{i}.{mamba_decoder}mamba.{p}"),
        (rf"backbone\.layers\.{_L}\.shared_proj\.weight", "model.layers.{i}.linear.weight"),
        (rf"backbone\.layers\.{_L}\.adapters\.(?P<x>[qkv])\.(?P<j>[01])\.weight",
         "model.layers.{owner}.shared_transformer.self_attn.linear_{x}_adapter_list.{c}.{j}.weight"),
        (rf"backbone\.layers\.{_L}\.adapters\.gate_up\.(?P<j>[01])\.weight",
         "model.layers.{owner}.shared_transformer.feed_forward.gate_up_proj_adapter_list.{c}.{j}.weight"),
        (r"backbone\.shared_blocks\.(?P<k>\d+)\.norm\.weight",
         "model.layers.{first}.shared_transformer.input_layernorm.weight"),
        (r"backbone\.shared_blocks\.(?P<k>\d+)\.ffn_norm\.weight",
         "model.layers.{first}.shared_transformer.pre_ff_layernorm.weight"),
        (r"backbone\.shared_blocks\.(?P<k>\d+)\.attention\.(?P<p>.+)",
         "model.layers.{first}.shared_transformer.self_attn.{p}"),
        (r"backbone\.shared_blocks\.(?P<k>\d+)\.mlp\.(?P<p>.+)",
         "model.layers.{first}.shared_transformer.feed_forward.{p}"),
    ],
    "bamba": [
        (r"backbone\.embedding\.weight", "model.embed_tokens.weight"),
        (r"backbone\.norm_f\.weight", "model.final_layernorm.weight"),
        (rf"backbone\.layers\.{_L}\.norm\.weight", "model.layers.{i}.input_layernorm.weight"),
        (rf"backbone\.layers\.{_L}\.ffn_norm\.weight", "model.layers.{i}.pre_ff_layernorm.weight"),
        (rf"backbone\.layers\.{_L}\.mixer\.(?P<p>.+)", "model.layers.{i}.{kind}.{p}"),
        (rf"backbone\.layers\.{_L}\.ffn\.(?P<p>.+)", "model.layers.{i}.feed_forward.{p}"),
    ],
}


def to_checkpoint_names(family: str, spec: ModelSpec, state_dict: dict) -> dict:
    """The inverse of :func:`plan_weights`: internal state dict -> tensors under ``family``'s checkpoint names
    (stacked experts split into one tensor per expert where the family stores them so). Names no rule
    matches are kept. Used to write random checkpoints that transformers loads."""
    from m2export.models.spec import MambaSpec

    rules = [(re.compile(p), r) for p, r in _TO_HF.get(family, [])]
    out = {}
    for name, t in state_dict.items():
        for pat, rep in rules:
            m = pat.fullmatch(name)
            if m is None:
                continue
            g = dict(m.groupdict())
            if "{kind}" in rep:
                g["kind"] = "mamba" if isinstance(spec.layers[int(g["i"])].mixer, MambaSpec) else "self_attn"
            if family == "zamba2":
                hybrid = [j for j, L in enumerate(spec.layers) if L.shared is not None]
                if "i" in g:
                    i = int(g["i"])
                    g["mamba_decoder"] = "mamba_decoder." if i in hybrid else ""
                    if i in hybrid:  # this call's adapters live in its block's first caller, at the call index
                        c = hybrid.index(i)
                        g["c"], g["owner"] = c, hybrid[spec.layers[i].shared.block]
                if "k" in g:
                    g["first"] = hybrid[int(g["k"])]
            if "{e}" in rep:
                for e in range(t.shape[0]):
                    out[rep.format(e=e, **g)] = t[e].clone()  # own storage: safetensors refuses views
            else:
                out[rep.format(**g)] = t
            break
        else:
            out[name] = t
    return out
