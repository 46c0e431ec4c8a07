"""Checkpoint tensor names of each family, mapped onto :class:`~m2export.models.mamba2.HybridLM`'s names.

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

_MAMBA2 = [  # HF Mamba2ForCausalLM; mamba_ssm names are the internal names already
    (r"backbone\.embeddings\.weight", "backbone.embedding.weight"),
]

RULES = {"nemotron_h": _NEMOTRON_H, "granitemoehybrid": _GRANITE, "bamba": _BAMBA, "mamba2": _MAMBA2,
         "mamba_ssm": []}
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
            g = m.groupdict()
            kind = ""
            if "{kind}" in rep:
                kind = "mamba" if isinstance(spec.layers[int(g["i"])].mixer, MambaSpec) else "self_attn"
            if "{e}" in rep:
                for e in range(t.shape[0]):
                    out[rep.format(e=e, kind=kind, **g)] = t[e].clone()  # own storage: safetensors refuses views
            else:
                out[rep.format(kind=kind, **g)] = t
            break
        else:
            out[name] = t
    return out
