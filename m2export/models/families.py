"""Which model family a ``config.json`` describes, and its :class:`~m2export.models.spec.ModelSpec`.

Detection (:func:`detect_family`): the state-spaces/mamba_ssm layout (``d_model`` + ``ssm_cfg``), else HF's
``model_type`` (or, without one, ``architectures``). Supported: :data:`SUPPORTED`. Any other model_type
(llama, mamba, jamba, ...) is refused by name with that list.

Each family's reader (:data:`READERS`) takes the dims from the family's own fields, as transformers 5.24's
``<Family>Config`` and modeling code use them (``transformers/models/<family>/``), and is strict: a key it
does not know, or a known key with a value whose math it does not implement, is a :class:`ConfigError` naming
the key. Keys that only affect training, initialisation, generation defaults or token ids are listed in
:data:`HARMLESS_KEYS` or per family.

Decisions where the checkpoint's own code and transformers differ, or transformers is ambiguous:

* Nemotron-H: transformers 5.24 clamps dt at ``time_step_min`` (an initialisation bound) in the chunked
  prefill only (``self.time_step_limit = (config.time_step_min, inf)``); m2export uses the config's
  ``time_step_limit`` (default (0, inf)), as mamba_ssm, vLLM and transformers 5.25 do. The two agree whenever
  softplus(dt + dt_bias) >= time_step_min.
* Nemotron-H: ``residual_in_fp32`` is honoured (transformers ignores it; it matters in fp16/bf16 only).
* Nemotron-H: ``attention_bias: true`` is refused (transformers builds the projections without bias anyway).
* Zamba2: transformers (5.24 and 5.25) clamps dt at ``time_step_min`` in prefill as 5.24 does for Nemotron-H;
  Zamba2's config has no ``time_step_limit``, and m2export uses (0, inf) (mamba_ssm's default).
* Zamba2: ``kv_channels`` and ``num_query_groups`` (set but unused by transformers) must equal what it derives
  (hidden_size // heads, heads); ``head_dim`` is an alias of ``attention_head_dim``; Zyphra's pre-transformers
  key names (``ffn_hidden_size``, ``state_size``, ``lora_rank``, ...: :data:`_ZAMBA2_LEGACY`) are refused with
  their current names, since transformers ignores them and would build other shapes.
* Falcon-H1: an absent ``mamba_d_ssm`` means 1024 (``FalconH1Config``'s default), not mamba_expand * hidden_size
  (that is what null means); the error says which applied.
* Gated RMSNorm is per group (group size d_inner / ngroups) in every family, as in mamba_ssm
  (``layernorm_gated.py``) and in transformers 5.24 (which normalises per group in all of these families).
* The SSM state is float32 whatever ``mamba_ssm_cache_dtype`` says.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

from m2export.errors import MISSING_FIELD_HINT, ConfigError
import dataclasses

from m2export.models.spec import (AttentionSpec, LayerSpec, MambaSpec, MLPSpec, ModelSpec, MoESpec, ParallelSpec,
                                  RopeSpec, SharedBlockSpec, SharedCallSpec)

log = logging.getLogger(__name__)

#: families m2export reads: "mamba_ssm" is the state-spaces layout, the rest are HF model_type values
SUPPORTED = ("mamba_ssm", "mamba2", "nemotron_h", "granitemoehybrid", "bamba", "falcon_h1", "zamba2")
_ARCHITECTURES = {"Mamba2ForCausalLM": "mamba2", "NemotronHForCausalLM": "nemotron_h",
                  "GraniteMoeHybridForCausalLM": "granitemoehybrid", "BambaForCausalLM": "bamba",
                  "FalconH1ForCausalLM": "falcon_h1", "Zamba2ForCausalLM": "zamba2"}

#: PreTrainedConfig keys with no effect on the forward pass (token ids, training, bookkeeping)
HARMLESS_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "auto_map",
    "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "initializer_range", "output_router_logits", "router_aux_loss_coef", "attention_dropout", "hidden_dropout",
    "max_position_embeddings", "num_logits_to_keep", "return_dict", "output_hidden_states", "output_attentions",
    "torchscript", "use_bfloat16", "tf_legacy_loss", "pruned_heads", "chunk_size_feed_forward",
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "cross_attention_hidden_size", "id2label",
    "label2id", "problem_type", "tokenizer_class", "prefix", "task_specific_params", "finetuning_task",
    "z_loss_coefficient", "_attn_implementation", "_attn_implementation_autoset", "use_mamba_kernels",
    "rescale_prenorm_residual", "time_step_min", "time_step_max", "time_step_floor", "time_step_rank",
})

_FLOAT_TAG = "__float__"
_FLOAT_TAG_VALUES = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def decode_hf_floats(obj: Any) -> Any:
    """Undo transformers' JSON encoding of non-finite floats: ``{"__float__": "Infinity"}`` -> inf.

    Same rule as ``PreTrainedConfig._decode_special_floats`` (transformers 5.x): a dict whose only key is
    ``__float__`` with a value in Infinity / -Infinity / NaN becomes that float; everything else is kept.
    """
    if isinstance(obj, dict):
        if set(obj) == {_FLOAT_TAG} and isinstance(obj[_FLOAT_TAG], str) and obj[_FLOAT_TAG] in _FLOAT_TAG_VALUES:
            return _FLOAT_TAG_VALUES[obj[_FLOAT_TAG]]
        return {k: decode_hf_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_hf_floats(v) for v in obj]
    return obj


def detect_family(raw: dict[str, Any], source: str = "config.json") -> str:
    """The family of a parsed config.json: one of :data:`SUPPORTED`.

    Raises:
        ConfigError: an unsupported model_type/architecture (named, with the supported list), or no way to tell.
    """
    if "d_model" in raw or "ssm_cfg" in raw:
        return "mamba_ssm"
    mt = raw.get("model_type")
    if mt is None:
        archs = raw.get("architectures") or []
        known = [_ARCHITECTURES[a] for a in archs if isinstance(a, str) and a in _ARCHITECTURES]
        if known:
            return known[0]
        if archs:
            raise ConfigError(f"{source}: architectures {archs} are not supported; m2export reads "
                              f"{sorted(_ARCHITECTURES)} (model_type {list(SUPPORTED[1:])}) and the mamba_ssm layout")
        if "hidden_size" in raw:  # an old HF Mamba2 config without model_type (the reader checks its fields)
            return "mamba2"
        raise ConfigError(f"{source}: cannot tell the model family: no 'model_type', 'architectures' or "
                          "mamba_ssm 'd_model'+'ssm_cfg'")
    if mt not in SUPPORTED[1:]:
        raise ConfigError(f"{source}: model_type {mt!r} is not supported; m2export reads model_type "
                          f"{list(SUPPORTED[1:])} and the mamba_ssm layout (d_model + ssm_cfg)")
    return mt


class FieldReader:
    """Reads a config dict key by key; :meth:`finish` rejects every key nobody read.

    ``source`` prefixes every error. ``aliases`` maps legacy key -> current key (both given and different:
    a conflict error naming both).
    """

    def __init__(self, raw: dict[str, Any], source: str, harmless: frozenset[str] | set[str] = frozenset(),
                 aliases: dict[str, str] | None = None):
        self.raw, self.source = dict(raw), source
        self.used: set[str] = set(HARMLESS_KEYS) | set(harmless)
        for old, new in (aliases or {}).items():
            if old in self.raw:
                if new in self.raw and self.raw[new] != self.raw[old]:
                    raise ConfigError(f"{source}: conflicting {old!r}={self.raw[old]!r} and {new!r}="
                                      f"{self.raw[new]!r} (the same field under its legacy and current name)")
                self.raw.setdefault(new, self.raw[old])
                self.used.add(old)

    def error(self, msg: str, hint: str | None = None) -> ConfigError:
        return ConfigError(f"{self.source}: {msg}", hint=hint)

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def get(self, key: str, default: Any = None, kind: type | tuple[type, ...] | None = None) -> Any:
        self.used.add(key)
        v = self.raw.get(key)
        if v is None:
            return default
        if kind is not None:
            ok = isinstance(v, kind) and not (isinstance(v, bool) and bool not in (kind if isinstance(kind, tuple)
                                                                                     else (kind,)))
            if not ok:
                names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
                raise self.error(f"field {key!r}: expected {names}, got {v!r}")
        return v

    def int(self, key: str, default: Any = None) -> int:
        v = self.get(key, default, int)
        if v is None:
            raise self.error(f"missing required field {key!r}", hint=MISSING_FIELD_HINT)
        if v < 0:
            raise self.error(f"field {key!r}: expected a non-negative integer, got {v!r}")
        return v

    def dim(self, key: str, default: Any = None) -> int:
        """A size or count that must be >= 1 (named in the error, before any spec sees it)."""
        v = self.int(key, default)
        if v < 1:
            raise self.error(f"field {key!r}: expected a positive integer, got {v!r}")
        return v

    def float(self, key: str, default: float | None = None) -> float:
        v = self.get(key, default, (int, float))
        if v is None:
            raise self.error(f"missing required field {key!r}", hint=MISSING_FIELD_HINT)
        if not math.isfinite(v):
            raise self.error(f"field {key!r}: expected a finite number, got {v!r}")
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        return self.get(key, default, bool)

    def eps(self, key: str, default: float) -> float:
        """A norm epsilon: a finite number >= 0 (a negative one makes x / sqrt(mean(x^2) + eps) NaN)."""
        v = self.float(key, default)
        if v < 0:
            raise self.error(f"field {key!r}: expected a norm epsilon >= 0, got {v!r}")
        return v

    def numbers(self, key: str, n: int, default: list[float], what: str) -> list[float]:
        """A list of exactly ``n`` finite numbers (``what`` names its entries in the error)."""
        v = self.get(key, default, list)
        if len(v) != n or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                                  for x in v):
            raise self.error(f"field {key!r}: expected {n} finite numbers ({what}), got {v!r}")
        return [float(x) for x in v]

    def divides(self, part_key: str, part: int, whole_key: str, whole: int) -> None:
        """``part`` (from ``part_key``) must be positive and divide ``whole`` (from ``whole_key``)."""
        if part < 1 or whole % part:
            raise self.error(f"{part_key}={part} does not divide {whole_key}={whole}")

    def expect(self, key: str, allowed: tuple, default: Any = None, why: str = "") -> Any:
        """The value of ``key`` (or ``default``); an error unless it is one of ``allowed``."""
        v = self.get(key, default)
        if v not in allowed:
            raise self.error(f"field {key!r}={v!r} is not supported; expected {' or '.join(map(repr, allowed))}"
                             + (f" ({why})" if why else ""))
        return v

    def dt_limit(self, key: str = "time_step_limit") -> tuple[float, float]:
        v = self.get(key, (0.0, math.inf))
        if not (isinstance(v, (list, tuple)) and len(v) == 2 and
                all(isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x) for x in v)):
            raise self.error(f"field {key!r}: expected [min, max] (two numbers), got {v!r}")
        return float(v[0]), float(v[1])

    def known(self, *keys: str) -> None:
        """Mark ``keys`` as understood without reading them (the family's fields of a block type the model
        does not use: they change nothing)."""
        self.used.update(keys)

    def finish(self) -> None:
        unknown = sorted(k for k in self.raw if k not in self.used)
        if unknown:
            raise self.error(f"unsupported field(s) {unknown}: m2export does not know what they do to the "
                             "model, so it will not guess (remove them if they are only metadata)")


_LAYER_NAMES = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention",
                "full_attention": "attention", "mlp": "mlp", "moe": "moe"}
_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def _layer_kinds(r: FieldReader, key: str, allowed: tuple[str, ...]) -> list[str] | None:
    """``key``'s layer-type list mapped to mamba/attention/mlp/moe (legacy and transformers-5 names)."""
    v = r.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(t, str) for t in v):
        raise r.error(f"field {key!r}: expected a list of layer-type names, got {v!r}")
    out = []
    for i, t in enumerate(v):
        kind = _LAYER_NAMES.get(t)
        if kind not in allowed:
            names = sorted(n for n, k in _LAYER_NAMES.items() if k in allowed)
            raise r.error(f"field {key!r}[{i}] = {t!r} is not a supported layer type; expected one of {names}")
        out.append(kind)
    return out


def _check_n_layers(r: FieldReader, kinds: list[str], where: str) -> None:
    n = r.get("num_hidden_layers", None, int)
    if n is not None and n != len(kinds):
        raise r.error(f"num_hidden_layers={n} conflicts with {where} ({len(kinds)} layers)")
    if not kinds:
        raise r.error(f"{where} lists no layers")


def _rope(r: FieldReader, head_dim: int, partial_default: float | None) -> RopeSpec:
    """RoPE from ``rope_parameters`` (transformers 5) or legacy ``rope_theta``/``rope_scaling``."""
    params = r.get("rope_parameters", {}, dict)
    legacy_theta = r.get("rope_theta", None, (int, float))
    scaling = r.get("rope_scaling", None, dict)
    if scaling:
        params = {**scaling, **params}
    known = {"rope_theta", "rope_type", "partial_rotary_factor", "type"}
    extra = sorted(set(params) - known)
    if extra:
        raise r.error(f"rope_parameters {extra} are not supported (only the default RoPE: rope_theta, "
                      "partial_rotary_factor)")
    rtype = params.get("rope_type", params.get("type", "default"))
    if rtype != "default":
        raise r.error(f"rope_parameters.rope_type={rtype!r} is not supported; expected 'default'")
    theta = params.get("rope_theta", legacy_theta)
    if legacy_theta is not None and theta != legacy_theta:
        raise r.error(f"conflicting rope_theta={legacy_theta} and rope_parameters.rope_theta={theta}")
    if theta is None:
        theta = 10000.0
    factor = params.get("partial_rotary_factor", r.get("partial_rotary_factor", None, (int, float)))
    if partial_default is None:  # the family's HF code ignores partial_rotary_factor
        if factor not in (None, 1, 1.0):
            raise r.error(f"partial_rotary_factor={factor} is not supported for this family (its transformers "
                          "code rotates the whole head)")
        factor = 1.0
    else:
        if factor is None:
            factor = partial_default
        if factor != partial_default:
            raise r.error(f"partial_rotary_factor={factor} is not supported; transformers fixes it to "
                          f"{partial_default} for this family")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise r.error(f"rope_theta: expected a positive number, got {theta!r}")
    return RopeSpec(theta=float(theta), rotary_dim=int(head_dim * factor))


def _attention(r: FieldReader, d_model: int, *, scale: float | None, rope: bool | float | None,
               qkv_bias: bool, o_bias: bool, kv_default: int | None = None,
               head_dim_default: int | None = None) -> AttentionSpec:
    """``rope``: False = none, True = full head, a float = partial (Bamba). Absent num_key_value_heads:
    ``kv_default`` (the family config's default; None = num_attention_heads); null: num_attention_heads.
    Absent head_dim: ``head_dim_default`` or hidden_size // num_attention_heads."""
    nh = r.dim("num_attention_heads")
    kvh = r.get("num_key_value_heads", None, int)
    if kvh is None:
        kvh = kv_default if "num_key_value_heads" not in r.raw and kv_default is not None else nh
    r.divides("num_key_value_heads", kvh, "num_attention_heads", nh)
    hd = r.get("head_dim", head_dim_default, int)
    if hd is None:
        if d_model % nh:
            raise r.error(f"hidden_size={d_model} is not divisible by num_attention_heads={nh}; give head_dim")
        hd = d_model // nh
    rope_spec = None
    if rope is not False:
        rope_spec = _rope(r, hd, None if rope is True else float(rope))
    return AttentionSpec(d_model=d_model, num_heads=nh, num_kv_heads=kvh, head_dim=hd, scale=scale,
                         rope=rope_spec, qkv_bias=qkv_bias, o_bias=o_bias)


def _no_sliding_window(r: FieldReader) -> None:
    if r.get("sliding_window") is not None:
        raise r.error(f"sliding_window={r.raw['sliding_window']!r} is not supported (full causal attention only)")


def _no_quantization(r: FieldReader) -> None:
    if r.has("quantization_config"):
        raise r.error("quantization_config: quantized checkpoints are not supported (m2export loads float weights)")


def _with(r: FieldReader, make: Callable[[], Any]) -> Any:
    try:
        return make()
    except ConfigError as e:
        msg = str(e) if str(e).startswith(f"{r.source}: ") else f"{r.source}: {e}"  # r.error's are prefixed
        raise ConfigError(msg, hint=e.hint) from None


def _mamba_from_granite_like(r: FieldReader, d_model: int, eps: float) -> MambaSpec:
    """Granite 4.0-H / Bamba mamba_* fields (mamba_d_head 'auto' = mamba_expand * hidden // mamba_n_heads)."""
    nheads = r.int("mamba_n_heads", 128)
    expand = r.int("mamba_expand", 2)
    hd = r.get("mamba_d_head", "auto")
    if hd == "auto":
        if (expand * d_model) % nheads:
            raise r.error(f"mamba_n_heads={nheads} does not divide mamba_expand * hidden_size = {expand * d_model}")
        hd = expand * d_model // nheads
    if not isinstance(hd, int) or isinstance(hd, bool) or hd < 1:
        raise r.error(f"field 'mamba_d_head': expected a positive integer or 'auto', got {hd!r}")
    if hd * nheads != expand * d_model:
        raise r.error(f"mamba_d_head * mamba_n_heads = {hd * nheads} conflicts with mamba_expand * hidden_size = "
                      f"{expand * d_model} (transformers requires them equal)")
    return _with(r, lambda: MambaSpec(
        d_model=d_model, nheads=nheads, headdim=hd, d_state=r.int("mamba_d_state", 256),
        ngroups=r.int("mamba_n_groups", 1), d_conv=r.int("mamba_d_conv", 4),
        chunk_size=r.int("mamba_chunk_size", 256), dt_limit=r.dt_limit(), conv_bias=r.bool("mamba_conv_bias", True),
        bias=r.bool("mamba_proj_bias", False), gated_norm_epsilon=eps))


# ---------------------------------------------------------------------------------------------------- Nemotron-H
_NEMOTRON_ALIASES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
                     "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max",
                     "mamba_dt_limit": "time_step_limit", "mamba_dt_init_floor": "time_step_floor",
                     "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size",
                     "num_local_experts": "n_routed_experts", "attention_head_dim": "head_dim"}


def read_nemotron_h(raw: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """NVIDIA Nemotron-H / Nemotron Nano v2 / Nemotron 3 (``NemotronHConfig``, transformers 5.24).

    Layers from ``layers_block_type`` (or its alias ``layer_types``; names mamba/linear_attention, attention/
    full_attention, mlp, moe) or the legacy ``hybrid_override_pattern`` (M Mamba, * attention, - MLP, E MoE);
    each layer is ``h + mixer(norm(h))``. Mamba: d_inner = mamba_num_heads * mamba_head_dim; attention
    without positional encoding; MLP relu2 non-gated; MoE sigmoid-grouped routing + one shared expert.
    MTP layers (num_nextn_predict_layers > 0) are ignored, with a log line.

    Fields transformers 5.24's ``modeling_nemotron_h.py`` never reads are ignored as it ignores them (its
    ``save_pretrained`` writes some whatever the model is): ``mamba_proj_bias`` (in_proj/out_proj take
    ``use_bias``), ``attention_bias`` (q/k/v/o have no bias), ``residual_in_fp32`` (the residual stream stays in
    the model dtype) and ``tie_word_embeddings`` (``_tied_weights_keys`` is empty: lm_head.weight is always its
    own tensor, so a checkpoint without one is refused as missing it).
    """
    r = FieldReader(raw, source, harmless={"expand", "moe_shared_expert_overlap", "mamba_ssm_cache_dtype",
                                           "mtp_layers_block_type", "mtp_hybrid_override_pattern",
                                           # transformers' Nemotron-H attention has no RoPE: these change nothing
                                           "rope_theta", "partial_rotary_factor",
                                           # never read by transformers 5.24's Nemotron-H (see above)
                                           "mamba_proj_bias", "attention_bias", "residual_in_fp32",
                                           "tie_word_embeddings"},
                    aliases=_NEMOTRON_ALIASES)
    _no_quantization(r)
    lists = [(k, _layer_kinds(r, k, ("mamba", "attention", "mlp", "moe"))) for k in ("layers_block_type",
                                                                                      "layer_types")]
    pattern = r.get("hybrid_override_pattern", None, str)
    if pattern is not None:
        bad = sorted(set(pattern) - set(_PATTERN))
        if bad:
            raise r.error(f"hybrid_override_pattern {pattern!r} has unknown symbol(s) {bad}; expected M * - E")
        lists.append(("hybrid_override_pattern", [_PATTERN[c] for c in pattern]))
    lists = [(k, v) for k, v in lists if v is not None]
    if not lists:
        raise r.error("missing the layer types: expected 'layers_block_type' or 'hybrid_override_pattern'")
    where, kinds = lists[0]
    for k, v in lists[1:]:
        if v != kinds:
            raise r.error(f"{k} conflicts with {where} (they give different layer types)")
    _check_n_layers(r, kinds, where)
    n_mtp = r.int("num_nextn_predict_layers", 0)
    if n_mtp:
        log.info("%s: ignoring %d multi-token-prediction layer(s) (num_nextn_predict_layers): not used for "
                 "next-token inference", source, n_mtp)

    d = r.int("hidden_size")
    eps = r.eps("layer_norm_epsilon", 1e-5)
    for twin in ("rms_norm_eps", "norm_eps"):  # in NVIDIA's configs; transformers reads layer_norm_epsilon only
        if r.has(twin) and r.float(twin) != eps:
            raise r.error(f"{twin}={r.raw[twin]} conflicts with layer_norm_epsilon={eps} (transformers uses the "
                          "latter for every norm)")
    if r.has("hidden_act") and r.get("hidden_act") != r.raw.get("mlp_hidden_act", "relu2"):
        raise r.error(f"hidden_act={r.raw['hidden_act']!r} conflicts with mlp_hidden_act="
                      f"{r.raw.get('mlp_hidden_act', 'relu2')!r} (transformers uses the latter)")
    if "mamba" in kinds:
        r.expect("mamba_hidden_act", ("silu", "swish"), "silu")
        use_bias = r.bool("use_bias", False)
        mamba = _with(r, lambda: MambaSpec(
            d_model=d, nheads=r.int("mamba_num_heads", 128), headdim=r.int("mamba_head_dim", 64),
            d_state=r.int("ssm_state_size", 128), ngroups=r.int("n_groups", 8), d_conv=r.int("conv_kernel", 4),
            chunk_size=r.int("chunk_size", 128), dt_limit=r.dt_limit(), conv_bias=r.bool("use_conv_bias", True),
            bias=use_bias, gated_norm_epsilon=eps))
    act = r.expect("mlp_hidden_act", ("relu2",), "relu2") if ("mlp" in kinds or "moe" in kinds) else None
    mlp_bias = r.bool("mlp_bias", False)
    if "attention" in kinds:
        _no_sliding_window(r)
        attn = _with(r, lambda: _attention(r, d, scale=None, rope=False, qkv_bias=False, o_bias=False,
                                           kv_default=8, head_dim_default=128))
    if "mlp" in kinds:
        mlp = _with(r, lambda: MLPSpec(d_model=d, d_ff=r.int("intermediate_size", 21504), act=act, gated=False,
                                       bias=mlp_bias))
    if "moe" in kinds:
        n_shared = r.int("n_shared_experts", 1)
        if n_shared != 1:
            raise r.error(f"n_shared_experts={n_shared} is not supported; expected 1 (transformers builds one "
                          "shared MLP of moe_shared_expert_intermediate_size)")
        latent = r.get("moe_latent_size", None, int)
        moe = _with(r, lambda: MoESpec(
            d_model=d, n_experts=r.int("n_routed_experts", 8), top_k=r.int("num_experts_per_tok", 2),
            d_expert=r.int("moe_intermediate_size", 7688), act=act, gated=False, routing="sigmoid_grouped",
            n_group=r.int("n_group", 1), topk_group=r.int("topk_group", 1), norm_topk_prob=r.bool("norm_topk_prob",
                                                                                                  True),
            routed_scaling_factor=r.float("routed_scaling_factor", 1.0), score_correction_bias=True,
            latent_size=latent, bias=mlp_bias,
            shared=MLPSpec(d_model=d, d_ff=r.int("moe_shared_expert_intermediate_size", 7688), act=act,
                           gated=False, bias=mlp_bias)))
    by_kind = {"mamba": lambda: mamba, "attention": lambda: attn, "mlp": lambda: mlp, "moe": lambda: moe}
    layers = tuple(LayerSpec(mixer=by_kind[k](), norm_epsilon=eps) for k in kinds)
    r.known("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel", "chunk_size",
            "time_step_limit", "use_conv_bias", "use_bias", "mamba_hidden_act", "mlp_hidden_act",
            "num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window",
            "intermediate_size", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
            "moe_shared_expert_intermediate_size", "moe_latent_size", "n_shared_experts", "routed_scaling_factor",
            "n_group", "topk_group", "norm_topk_prob")
    spec = _with(r, lambda: ModelSpec(
        family="nemotron_h", d_model=d, vocab_size=r.int("vocab_size", 131072), layers=layers, norm_epsilon=eps))
    r.finish()
    return spec


# ---------------------------------------------------------------------------------------------------- Granite 4.0-H
def read_granitemoehybrid(raw: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """IBM Granite 4.0-H (``GraniteMoeHybridConfig``, transformers 5.24).

    Each layer: ``h + residual_multiplier * mixer(input_layernorm(h))`` with mixer Mamba-2 or attention
    (``layer_types``), then ``h + residual_multiplier * (moe(x) + shared_mlp(x))``, x = post_attention_layernorm(h)
    (shared MLP alone when num_local_experts = 0). Embeddings x embedding_multiplier; attention scale =
    attention_multiplier; RoPE only when position_embedding_type == "rope"; logits / logits_scaling.
    """
    r = FieldReader(raw, source, aliases={"layers_block_type": "layer_types"})
    _no_quantization(r)
    d = r.int("hidden_size")
    eps = r.eps("rms_norm_eps", 1e-6)
    kinds = _layer_kinds(r, "layer_types", ("mamba", "attention"))
    if kinds is None:
        kinds = ["mamba"] * r.int("num_hidden_layers", 32)
    _check_n_layers(r, kinds, "layer_types")
    r.expect("hidden_act", ("silu",), "silu")
    r.expect("normalization_function", ("rmsnorm",), "rmsnorm")
    if "mamba" in kinds:
        mamba = _mamba_from_granite_like(r, d, eps)
    pos = r.expect("position_embedding_type", (None, "rope", "nope"), None)
    if "attention" in kinds:
        _no_sliding_window(r)
        bias = r.bool("attention_bias", False)
        attn = _with(r, lambda: _attention(r, d, scale=r.float("attention_multiplier", 1.0), rope=pos == "rope",
                                           qkv_bias=bias, o_bias=bias))
    n_exp = r.int("num_local_experts", 8)
    shared = _with(r, lambda: MLPSpec(d_model=d, d_ff=r.int("shared_intermediate_size", 1024), act="silu",
                                      gated=True, fused_gate_up=True))
    if n_exp:
        ffn = _with(r, lambda: MoESpec(d_model=d, n_experts=n_exp, top_k=r.int("num_experts_per_tok", 2),
                                       d_expert=r.int("intermediate_size", 11008), act="silu", gated=True,
                                       routing="softmax_topk", shared=shared))
    else:
        ffn = shared
    res = r.float("residual_multiplier", 1.0)
    layers = tuple(LayerSpec(mixer=mamba if k == "mamba" else attn, ffn=ffn, norm_epsilon=eps,
                             residual_multiplier=res) for k in kinds)
    r.known("mamba_n_heads", "mamba_expand", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv",
            "mamba_chunk_size", "time_step_limit", "mamba_conv_bias", "mamba_proj_bias", "num_attention_heads",
            "num_key_value_heads", "head_dim", "attention_bias", "attention_multiplier", "sliding_window",
            "rope_parameters", "rope_theta", "rope_scaling", "partial_rotary_factor", "num_experts_per_tok",
            "intermediate_size")
    scaling = r.float("logits_scaling", 1.0)
    if scaling == 0:
        raise r.error("logits_scaling=0: logits are divided by it")
    spec = _with(r, lambda: ModelSpec(
        family="granitemoehybrid", d_model=d, vocab_size=r.int("vocab_size", 32000), layers=layers, norm_epsilon=eps,
        tie_embeddings=r.bool("tie_word_embeddings", False), embedding_multiplier=r.float("embedding_multiplier", 1.0),
        logits_multiplier=1.0 / scaling))
    r.finish()
    return spec


# ---------------------------------------------------------------------------------------------------- Bamba
def read_bamba(raw: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """IBM Bamba (``BambaConfig``, transformers 5.24): attention at ``attn_layer_indices``, Mamba-2 elsewhere;
    each layer ``h + mixer(input_layernorm(h))`` then ``h + swiglu(pre_ff_layernorm(h))``; RoPE on half of
    each head (partial_rotary_factor 0.5, which transformers fixes for Bamba)."""
    r = FieldReader(raw, source)
    _no_quantization(r)
    d = r.int("hidden_size")
    eps = r.eps("rms_norm_eps", 1e-5)
    n = r.int("num_hidden_layers", 32)
    idx = r.get("attn_layer_indices", [], list)
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in idx):
        raise r.error(f"attn_layer_indices={idx!r}: expected layer indices in [0, {n})")
    kinds = ["attention" if i in idx else "mamba" for i in range(n)]
    for key in ("layers_block_type", "layer_types"):
        listed = _layer_kinds(r, key, ("mamba", "attention"))
        if listed is not None and listed != kinds:
            raise r.error(f"{key} conflicts with attn_layer_indices/num_hidden_layers")
    r.expect("hidden_act", ("silu",), "silu")
    if "mamba" in kinds:
        mamba = _mamba_from_granite_like(r, d, eps)
    if "attention" in kinds:
        _no_sliding_window(r)
        bias = r.bool("attention_bias", False)
        attn = _with(r, lambda: _attention(r, d, scale=None, rope=0.5, qkv_bias=bias, o_bias=bias, kv_default=8))
    ffn = _with(r, lambda: MLPSpec(d_model=d, d_ff=r.int("intermediate_size", 14336), act="silu", gated=True,
                                   bias=r.bool("mlp_bias", False)))
    layers = tuple(LayerSpec(mixer=mamba if k == "mamba" else attn, ffn=ffn, norm_epsilon=eps) for k in kinds)
    r.known("mamba_n_heads", "mamba_expand", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv",
            "mamba_chunk_size", "time_step_limit", "mamba_conv_bias", "mamba_proj_bias", "num_attention_heads",
            "num_key_value_heads", "head_dim", "attention_bias", "sliding_window", "rope_parameters", "rope_theta",
            "rope_scaling", "partial_rotary_factor")
    spec = _with(r, lambda: ModelSpec(family="bamba", d_model=d, vocab_size=r.int("vocab_size", 128000),
                                      layers=layers, norm_epsilon=eps,
                                      tie_embeddings=r.bool("tie_word_embeddings", False)))
    r.finish()
    return spec


# ---------------------------------------------------------------------------------------------------- Falcon-H1
def read_falcon_h1(raw: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """TII Falcon-H1 (``FalconH1Config``, transformers 5.24): every layer runs attention (RoPE, GQA) and a
    Mamba-2 mixer in parallel on ``input_layernorm(h)`` and adds both to h, then a SwiGLU MLP on
    ``pre_ff_layernorm(h)``. muP multipliers: ``ssm_multipliers`` [z, x, B, C, dt] on the in_proj output,
    ``ssm_in_multiplier``/``ssm_out_multiplier``, ``attention_in_multiplier``/``attention_out_multiplier``,
    ``key_multiplier``, ``mlp_multipliers`` [gate, down], ``embedding_multiplier``, ``lm_head_multiplier``.
    d_inner = ``mamba_d_ssm`` (null: mamba_expand * hidden_size); ``mamba_rms_norm`` true = gated RMSNorm per
    group (``mamba_norm_before_gate`` chooses the order), false = y * silu(z); in_proj bias ``mamba_proj_bias``,
    out_proj bias ``projectors_bias``.
    """
    r = FieldReader(raw, source, harmless={"mlp_expansion_factor"})
    _no_quantization(r)
    d = r.dim("hidden_size")
    eps = r.eps("rms_norm_eps", 1e-5)
    n = r.dim("num_hidden_layers", 32)
    for key in ("layers_block_type", "layer_types"):
        v = r.get(key)
        if v is not None and v != ["hybrid"] * n:
            raise r.error(f"{key}={v!r}: every Falcon-H1 layer is 'hybrid' (attention and Mamba in parallel)")
    if r.get("attn_layer_indices") is not None:
        raise r.error("attn_layer_indices is not supported (every Falcon-H1 layer has attention)")
    if r.get("mamba_use_mlp", True) is not True:
        raise r.error("mamba_use_mlp=false is not supported (transformers' Falcon-H1 always has the MLP)")
    r.expect("hidden_act", ("silu",), "silu")
    expand = r.dim("mamba_expand", 2)
    absent = "mamba_d_ssm" not in r.raw
    d_ssm = 1024 if absent else r.get("mamba_d_ssm", None, int)  # FalconH1Config's default is 1024, not null
    if d_ssm is None:
        d_ssm = expand * d
    width = ("mamba_d_ssm (absent: transformers' default 1024)" if absent else
             "mamba_d_ssm" if r.raw["mamba_d_ssm"] is not None else "mamba_expand * hidden_size (mamba_d_ssm null)")
    nheads = r.dim("mamba_n_heads", 128)
    hd = r.get("mamba_d_head", "auto")
    if hd == "auto":
        r.divides("mamba_n_heads", nheads, f"the SSM width {width}", d_ssm)
        hd = d_ssm // nheads
    if not isinstance(hd, int) or isinstance(hd, bool) or hd * nheads != d_ssm:
        raise r.error(f"mamba_d_head={hd!r} * mamba_n_heads={nheads} conflicts with the SSM width {d_ssm} = "
                      f"{width} (transformers requires them equal)")
    r.divides("mamba_n_groups", r.dim("mamba_n_groups", 1), "mamba_n_heads", nheads)
    mults = r.numbers("ssm_multipliers", 5, [1.0] * 5, "the z, x, B, C, dt slices")
    mlp_m = r.numbers("mlp_multipliers", 2, [1.0, 1.0], "gate, down")
    rms = r.bool("mamba_rms_norm", False)
    mamba = _with(r, lambda: MambaSpec(
        d_model=d, nheads=nheads, headdim=hd, d_state=r.dim("mamba_d_state", 256), ngroups=r.dim("mamba_n_groups", 1),
        d_conv=r.dim("mamba_d_conv", 4), chunk_size=r.dim("mamba_chunk_size", 256), dt_limit=r.dt_limit(),
        conv_bias=r.bool("mamba_conv_bias", True), bias=r.bool("mamba_proj_bias", False),
        out_bias=r.bool("projectors_bias", False), norm="gated_rms" if rms else "gate",
        norm_before_gate=r.bool("mamba_norm_before_gate", True), gated_norm_epsilon=eps,
        zxbcdt_multipliers=tuple(mults), in_multiplier=r.float("ssm_in_multiplier", 1.0),
        out_multiplier=r.float("ssm_out_multiplier", 1.0)))
    _no_sliding_window(r)
    bias = r.bool("attention_bias", False)
    attn = _with(r, lambda: dataclasses.replace(
        _attention(r, d, scale=None, rope=True, qkv_bias=bias, o_bias=bias, kv_default=8),
        key_multiplier=r.float("key_multiplier", 1.0), in_multiplier=r.float("attention_in_multiplier", 1.0),
        out_multiplier=r.float("attention_out_multiplier", 1.0)))
    mlp = _with(r, lambda: MLPSpec(d_model=d, d_ff=r.dim("intermediate_size", 14336), act="silu", gated=True,
                                   bias=r.bool("mlp_bias", False), gate_multiplier=float(mlp_m[0]),
                                   down_multiplier=float(mlp_m[1])))
    layer = LayerSpec(mixer=ParallelSpec(attention=attn, mamba=mamba), ffn=mlp, norm_epsilon=eps)
    spec = _with(r, lambda: ModelSpec(
        family="falcon_h1", d_model=d, vocab_size=r.dim("vocab_size", 128000), layers=(layer,) * n,
        norm_epsilon=eps, tie_embeddings=r.bool("tie_word_embeddings", False),
        embedding_multiplier=r.float("embedding_multiplier", 1.0), logits_multiplier=r.float("lm_head_multiplier",
                                                                                            1.0)))
    r.finish()
    return spec


# ---------------------------------------------------------------------------------------------------- Zamba2
def read_zamba2(raw: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """Zyphra Zamba2 (``Zamba2Config``, transformers 5.24): Mamba-2 layers; the ``hybrid`` ones (in
    ``layers_block_type``) first run shared transformer block (call c uses block c % num_mem_blocks) on
    ``concat(h, embeddings)`` (attention_hidden_size = 2 * hidden_size, head_dim = 2 * hidden_size / heads,
    scale (head_dim / 2) ** -0.5, RoPE when ``use_mem_rope``), project it back with a per-layer Linear and
    feed ``norm(h + that)`` to the layer's mixer. Per call: q/k/v adapters (``use_shared_attention_adapter``)
    and gate_up adapters (always, in transformers) of rank ``adapter_rank``. MLP: gelu-gated, fused gate_up.
    """
    r = FieldReader(raw, source, harmless={"use_mem_eff_path", "hybrid_layer_ids", "ft_lora", "use_long_context"},
                    aliases={"head_dim": "attention_head_dim"})  # Zamba2Config.attribute_map
    _no_quantization(r)
    legacy = sorted(k for k in _ZAMBA2_LEGACY if k in r.raw)
    if legacy:
        raise r.error("Zyphra's pre-transformers key names " + ", ".join(f"{k} (now {_ZAMBA2_LEGACY[k]})"
                                                                          for k in legacy)
                      + ": transformers 5.24 ignores them and would build other shapes; use the checkpoint's "
                      "current config.json or rename the keys")
    _no_sliding_window(r)
    d = r.dim("hidden_size")
    eps = r.eps("rms_norm_eps", 1e-5)
    kinds = _layer_kinds_zamba2(r)
    if r.get("use_long_context", False):
        raise r.error("use_long_context=true is not supported (it rescales rope_theta)")
    if r.get("use_shared_mlp_adapter", True) is not True:
        raise r.error("use_shared_mlp_adapter=false is not supported (transformers always builds the MLP adapters)")
    if r.get("use_conv_bias", True) is not True:
        raise r.error("use_conv_bias=false is not supported (transformers' Zamba2 conv always has a bias)")
    hybrid = [i for i, k in enumerate(kinds) if k == "hybrid"]
    listed = r.raw.get("hybrid_layer_ids")
    if listed is not None and listed != hybrid:
        raise r.error(f"hybrid_layer_ids={listed} conflicts with layers_block_type (hybrid at {hybrid})")
    expand = r.dim("mamba_expand", 2)
    nheads = r.dim("n_mamba_heads", 8)
    r.divides("n_mamba_heads", nheads, "mamba_expand * hidden_size", expand * d)
    r.divides("mamba_ngroups", r.dim("mamba_ngroups", 1), "n_mamba_heads", nheads)
    _derived(r, "mamba_headdim", expand * d // nheads)
    bias = r.bool("add_bias_linear", False)
    mamba = _with(r, lambda: MambaSpec(
        d_model=d, nheads=nheads, headdim=expand * d // nheads, d_state=r.dim("mamba_d_state", 64),
        ngroups=r.dim("mamba_ngroups", 1), d_conv=r.dim("mamba_d_conv", 4), chunk_size=r.dim("chunk_size", 256),
        conv_bias=True, bias=bias, gated_norm_epsilon=1e-5))
    r.expect("hidden_act", ("gelu",), "gelu", why="the only activation m2export implements for Zamba2's MLP")
    nh = r.dim("num_attention_heads", 32)
    r.divides("num_attention_heads", nh, "attention_hidden_size = 2 * hidden_size", 2 * d)
    hd = 2 * d // nh
    _derived(r, "attention_hidden_size", 2 * d)
    _derived(r, "attention_head_dim", hd)
    _derived(r, "kv_channels", d // nh)  # transformers 5.24 sets both (unused) in Zamba2Config.__post_init__
    _derived(r, "num_query_groups", nh)  # (Zyphra's GQA field; transformers' is num_key_value_heads)
    kvh = r.get("num_key_value_heads", None, int) or nh
    r.divides("num_key_value_heads", kvh, "num_attention_heads", nh)
    if r.get("use_shared_attention_adapter", False) and kvh != nh:
        raise r.error(f"num_key_value_heads={kvh} != num_attention_heads={nh} with use_shared_attention_adapter: "
                      "transformers' k/v adapters are attention_hidden_size wide, so it supports no GQA there")
    rope = _rope(r, hd, None) if r.bool("use_mem_rope", False) else None
    attn = _with(r, lambda: AttentionSpec(d_model=d, num_heads=nh, num_kv_heads=kvh, head_dim=hd,
                                          scale=(hd / 2) ** -0.5, rope=rope, d_in=2 * d, d_out=d))
    mlp = _with(r, lambda: MLPSpec(d_model=d, d_ff=r.get("intermediate_size", None, int) or 4 * d, act="gelu",
                                   gated=True, bias=bias, fused_gate_up=True))
    n_blocks = r.dim("num_mem_blocks", 1)
    rank = r.dim("adapter_rank", 128)
    block = _with(r, lambda: SharedBlockSpec(attention=attn, mlp=mlp, norm_epsilon=eps, adapter_rank=rank,
                                             attention_adapter=r.bool("use_shared_attention_adapter", False),
                                             mlp_adapter=True))
    call = {layer: c for c, layer in enumerate(hybrid)}
    layers = tuple(LayerSpec(mixer=mamba, norm_epsilon=eps,
                             shared=SharedCallSpec(block=call[i] % n_blocks) if i in call else None)
                   for i in range(len(kinds)))
    # blocks that have a caller: transformers builds (and saves) min(num_mem_blocks, hybrid layers) of them
    r.known("rope_parameters", "rope_theta", "rope_scaling", "partial_rotary_factor", "time_step_limit")
    if r.has("time_step_limit"):
        raise r.error("time_step_limit is not a Zamba2 field (transformers ignores it); remove it")
    spec = _with(r, lambda: ModelSpec(
        family="zamba2", d_model=d, vocab_size=r.dim("vocab_size", 32000), layers=layers, norm_epsilon=eps,
        tie_embeddings=r.bool("tie_word_embeddings", True), shared_blocks=(block,) * min(n_blocks, len(hybrid))))
    r.finish()
    return spec


#: Zamba2 config keys of Zyphra's own (pre-transformers) code -> the Zamba2Config key that replaced them
_ZAMBA2_LEGACY = {"ffn_hidden_size": "intermediate_size", "state_size": "mamba_d_state",
                  "expansion_factor": "mamba_expand", "conv_dimension": "mamba_d_conv", "lora_rank": "adapter_rank",
                  "use_shared_attention_lora": "use_shared_attention_adapter",
                  "use_shared_block_lora": "the MLP adapters, always built", "gated_linear_unit": "always gated"}


def _layer_kinds_zamba2(r: FieldReader) -> list[str]:
    v = r.get("layers_block_type") if r.has("layers_block_type") else r.get("layer_types")
    r.known("layer_types", "layers_block_type")
    if v is None:  # transformers' default pattern (Zamba2-2.7B's)
        v = (["mamba"] + (["mamba"] * 5 + ["hybrid"]) * 7 + ["mamba"] * 4 + ["hybrid"] + ["mamba"] * 3
             + ["hybrid"] + ["mamba"] * 2)
    if not isinstance(v, list) or not all(t in ("mamba", "linear_attention", "hybrid") for t in v):
        raise r.error(f"layers_block_type={v!r}: expected a list of 'mamba'/'linear_attention'/'hybrid'")
    kinds = ["hybrid" if t == "hybrid" else "mamba" for t in v]
    _check_n_layers(r, kinds, "layers_block_type")
    return kinds


def _derived(r: FieldReader, key: str, value: int) -> None:
    """A config key transformers derives from others: if present it must agree."""
    v = r.get(key)
    if v is not None and v != value:
        raise r.error(f"{key}={v!r} conflicts with the value the other fields give ({value})")


#: HF hybrid family -> reader of its config.json (mamba2 / mamba_ssm go through Mamba2Config)
READERS: dict[str, Callable[[dict[str, Any], str], ModelSpec]] = {
    "nemotron_h": read_nemotron_h, "granitemoehybrid": read_granitemoehybrid, "bamba": read_bamba,
    "falcon_h1": read_falcon_h1, "zamba2": read_zamba2}
