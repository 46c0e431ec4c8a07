"""Mamba-2 language-model configuration, with readers for the two checkpoint formats.

Field names follow mamba_ssm (``mamba_ssm/models/config_mamba.py`` and
``mamba_ssm/modules/mamba2.py::Mamba2.__init__``). Every field m2export does not implement
is rejected with :class:`~m2export.errors.ConfigError` rather than silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from m2export.errors import MISSING_FIELD_HINT, ConfigError
from m2export.models.spec import LayerSpec, MambaSpec, ModelSpec


@dataclass(frozen=True)
class Mamba2Config:
    """A Mamba-2 LM. Derived: ``d_inner = expand * d_model``, ``nheads = d_inner // headdim``,
    ``conv_dim = d_inner + 2 * ngroups * d_state``, ``vocab_size_padded``."""

    d_model: int
    n_layer: int
    vocab_size: int
    d_state: int = 128
    d_conv: int = 4
    expand: int = 2
    headdim: int = 64
    ngroups: int = 1
    chunk_size: int = 256
    dt_limit: tuple[float, float] = (0.0, math.inf)
    pad_vocab_size_multiple: int = 16
    tie_embeddings: bool = True
    residual_in_fp32: bool = True
    norm_epsilon: float = 1e-5
    conv_bias: bool = True
    bias: bool = False
    rmsnorm: bool = True
    norm_before_gate: bool = False
    #: eps of the gated RMSNorm in each mixer: 1e-5 in mamba_ssm (fixed), layer_norm_epsilon in HF transformers
    gated_norm_epsilon: float = 1e-5

    def __post_init__(self):
        for f in ("d_model", "n_layer", "vocab_size", "d_state", "d_conv", "expand", "headdim", "ngroups",
                  "chunk_size", "pad_vocab_size_multiple"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"config field {f!r}: expected a positive integer, got {v!r}")
        for f in ("tie_embeddings", "residual_in_fp32", "conv_bias", "bias", "rmsnorm", "norm_before_gate"):
            v = getattr(self, f)
            if not isinstance(v, bool):
                raise ConfigError(f"config field {f!r}: expected true or false, got {v!r}")
        for f in ("norm_epsilon", "gated_norm_epsilon"):
            v = getattr(self, f)
            if not _is_real(v) or not (0.0 < v < 1.0):
                raise ConfigError(f"config field {f!r}: expected a number in (0, 1), got {v!r}")
        lim = self.dt_limit
        if not (isinstance(lim, (tuple, list)) and len(lim) == 2 and all(_is_real(v) for v in lim)):
            raise ConfigError(f"config field 'dt_limit': expected [min, max] (two numbers), got {lim!r}")
        object.__setattr__(self, "dt_limit", (float(lim[0]), float(lim[1])))
        if self.d_inner % self.headdim:
            raise ConfigError(f"config: d_inner = expand*d_model = {self.d_inner} is not divisible by "
                              f"headdim = {self.headdim}",
                              hint="headdim must divide expand*d_model: change d_model, expand or headdim")
        if self.nheads % self.ngroups:
            raise ConfigError(f"config: nheads = {self.nheads} is not divisible by ngroups = {self.ngroups}",
                              hint="ngroups must divide nheads = expand*d_model/headdim: change ngroups or the sizes")
        lo, hi = self.dt_limit
        if not (0.0 <= lo <= hi):
            raise ConfigError(f"config field 'dt_limit': expected 0 <= min <= max, got {self.dt_limit}")
        if not self.rmsnorm:
            raise ConfigError("config field 'rmsnorm': only rmsnorm=True (gated RMSNorm) is supported")
        if self.norm_before_gate:
            raise ConfigError("config field 'norm_before_gate': only False (Mamba-2 default) is supported")

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def nheads(self) -> int:
        return self.d_inner // self.headdim

    @property
    def conv_dim(self) -> int:
        return self.mamba_spec.conv_dim

    @property
    def d_in_proj(self) -> int:
        return self.mamba_spec.d_in_proj

    @property
    def vocab_size_padded(self) -> int:
        m = self.pad_vocab_size_multiple
        return -(-self.vocab_size // m) * m

    @property
    def mamba_spec(self) -> MambaSpec:
        """The mixer of every layer (mamba_ssm ``Mamba2`` with these fields)."""
        return MambaSpec(d_model=self.d_model, nheads=self.nheads, headdim=self.headdim, d_state=self.d_state,
                         ngroups=self.ngroups, d_conv=self.d_conv, chunk_size=self.chunk_size, dt_limit=self.dt_limit,
                         conv_bias=self.conv_bias, bias=self.bias, gated_norm_epsilon=self.gated_norm_epsilon)

    def to_spec(self) -> ModelSpec:
        """This model as a layer stack: n_layer pure Mamba-2 layers (family "mamba2")."""
        layer = LayerSpec(mixer=self.mamba_spec, norm_epsilon=self.norm_epsilon)
        return ModelSpec(family="mamba2", d_model=self.d_model, vocab_size=self.vocab_size,
                         layers=(layer,) * self.n_layer, norm_epsilon=self.norm_epsilon,
                         tie_embeddings=self.tie_embeddings, residual_in_fp32=self.residual_in_fp32,
                         pad_vocab_size_multiple=self.pad_vocab_size_multiple)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["dt_limit"] = [self.dt_limit[0], self.dt_limit[1] if math.isfinite(self.dt_limit[1]) else "inf"]
        return d

    # ------------------------------------------------------------------ mamba_ssm config.json
    def to_mamba_ssm_json(self) -> dict[str, Any]:
        """config.json in the state-spaces/mamba format (MambaConfig with ssm_cfg).

        Raises:
            ConfigError: ``gated_norm_epsilon`` is not 1e-5 (mamba_ssm fixes it; save in the 'hf' format).
        """
        if self.gated_norm_epsilon != 1e-5:
            raise ConfigError(f"gated_norm_epsilon={self.gated_norm_epsilon} cannot be stored in the mamba_ssm "
                              "format (it fixes 1e-5); save in the 'hf' format")
        ssm_cfg = {"layer": "Mamba2", "d_state": self.d_state, "d_conv": self.d_conv, "expand": self.expand,
                   "headdim": self.headdim, "ngroups": self.ngroups, "chunk_size": self.chunk_size,
                   "rmsnorm": self.rmsnorm, "norm_before_gate": self.norm_before_gate,
                   "conv_bias": self.conv_bias, "bias": self.bias}
        if self.dt_limit != (0.0, math.inf):
            ssm_cfg["dt_limit"] = list(self.dt_limit)
        return {"d_model": self.d_model, "d_intermediate": 0, "n_layer": self.n_layer, "vocab_size": self.vocab_size,
                "ssm_cfg": ssm_cfg, "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True,
                "residual_in_fp32": self.residual_in_fp32, "fused_add_norm": True,
                "pad_vocab_size_multiple": self.pad_vocab_size_multiple, "tie_embeddings": self.tie_embeddings}

    @classmethod
    def from_mamba_ssm_json(cls, cfg: dict[str, Any], source: str = "config.json") -> "Mamba2Config":
        """Read a state-spaces/mamba ``config.json`` (every ssm_cfg field honoured or rejected).

        Raises:
            ConfigError: naming ``source`` and the offending field.
        """
        top_known = {"d_model", "d_intermediate", "n_layer", "vocab_size", "ssm_cfg", "attn_layer_idx", "attn_cfg",
                     "rms_norm", "residual_in_fp32", "fused_add_norm", "pad_vocab_size_multiple",
                     "tie_embeddings", "norm_epsilon"}
        _reject_unknown(cfg, top_known, source)
        for req in ("d_model", "n_layer", "vocab_size"):
            if req not in cfg:
                raise ConfigError(f"{source}: missing required field {req!r}", hint=MISSING_FIELD_HINT)
        if cfg.get("d_intermediate", 0) != 0:
            raise ConfigError(f"{source}: field 'd_intermediate'={cfg['d_intermediate']!r} (MLP blocks) is not "
                              "supported; expected 0")
        if cfg.get("attn_layer_idx"):
            raise ConfigError(f"{source}: field 'attn_layer_idx'={cfg['attn_layer_idx']!r} (hybrid attention "
                              "layers) is not supported; expected []")
        if cfg.get("rms_norm", True) is not True:
            raise ConfigError(f"{source}: field 'rms_norm'={cfg['rms_norm']!r} is not supported; expected true "
                              "(LayerNorm models are not supported)")
        ssm_raw = cfg.get("ssm_cfg") or {}
        if not isinstance(ssm_raw, dict):
            raise ConfigError(f"{source}: field 'ssm_cfg': expected an object, got {ssm_raw!r}")
        ssm = dict(ssm_raw)
        layer = ssm.pop("layer", "Mamba1")
        if layer != "Mamba2":
            raise ConfigError(f"{source}: ssm_cfg.layer={layer!r} is not supported; expected 'Mamba2'")
        ssm_known = {"d_state", "d_conv", "expand", "headdim", "ngroups", "chunk_size", "dt_limit", "rmsnorm",
                     "norm_before_gate", "conv_bias", "bias", "A_init_range", "dt_min", "dt_max", "dt_init_floor",
                     "D_has_hdim", "d_ssm", "conv_init", "learnable_init_states", "activation"}
        _reject_unknown(ssm, ssm_known, source + ": ssm_cfg")
        if ssm.pop("D_has_hdim", False):
            raise ConfigError(f"{source}: ssm_cfg.D_has_hdim=True is not supported")
        if ssm.pop("learnable_init_states", False):
            raise ConfigError(f"{source}: ssm_cfg.learnable_init_states=True is not supported")
        if ssm.pop("activation", "swish") not in ("swish", "silu"):
            raise ConfigError(f"{source}: ssm_cfg.activation must be 'swish'/'silu'")
        d_ssm = ssm.pop("d_ssm", None)
        for k in ("A_init_range", "dt_min", "dt_max", "dt_init_floor", "conv_init"):  # init-only fields
            ssm.pop(k, None)
        dt_limit = ssm.pop("dt_limit", (0.0, math.inf))
        if not (isinstance(dt_limit, (list, tuple)) and len(dt_limit) == 2 and all(_is_real(v) for v in dt_limit)):
            raise ConfigError(f"{source}: ssm_cfg.dt_limit: expected [min, max] (two numbers), got {dt_limit!r}")
        conf = _with_source(source, lambda: cls(
            d_model=cfg["d_model"], n_layer=cfg["n_layer"], vocab_size=cfg["vocab_size"], dt_limit=tuple(dt_limit),
            pad_vocab_size_multiple=cfg.get("pad_vocab_size_multiple", 8),
            tie_embeddings=cfg.get("tie_embeddings", True), residual_in_fp32=cfg.get("residual_in_fp32", True),
            norm_epsilon=cfg.get("norm_epsilon", 1e-5), **ssm))
        if d_ssm is not None and d_ssm != conf.d_inner:
            raise ConfigError(f"{source}: ssm_cfg.d_ssm={d_ssm!r} != d_inner={conf.d_inner} (partial SSM with "
                              "MLP channels) is not supported")
        return conf

    # ------------------------------------------------------------------ HF transformers Mamba2Config
    def to_hf_json(self) -> dict[str, Any]:
        """config.json in the HF transformers ``Mamba2Config`` format.

        Raises:
            ConfigError: norm_epsilon != gated_norm_epsilon (HF uses one layer_norm_epsilon for both).
        """
        if self.norm_epsilon != self.gated_norm_epsilon:
            raise ConfigError(f"norm_epsilon={self.norm_epsilon} != gated_norm_epsilon={self.gated_norm_epsilon} "
                              "cannot be stored in the HF format (one layer_norm_epsilon)")
        return {"model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"],
                "vocab_size": self.vocab_size_padded, "hidden_size": self.d_model, "state_size": self.d_state,
                "num_hidden_layers": self.n_layer, "layer_norm_epsilon": self.norm_epsilon, "expand": self.expand,
                "conv_kernel": self.d_conv, "n_groups": self.ngroups, "num_heads": self.nheads,
                "head_dim": self.headdim, "use_bias": self.bias, "use_conv_bias": self.conv_bias,
                "chunk_size": self.chunk_size, "residual_in_fp32": self.residual_in_fp32,
                "tie_word_embeddings": self.tie_embeddings, "rms_norm": True, "norm_before_gate": False,
                "time_step_limit": [self.dt_limit[0], self.dt_limit[1] if math.isfinite(self.dt_limit[1]) else
                                    float("inf")], "hidden_act": "silu"}

    @classmethod
    def from_hf_json(cls, cfg: dict[str, Any], source: str = "config.json") -> "Mamba2Config":
        """Read an HF transformers ``Mamba2Config`` dict.

        Raises:
            ConfigError: naming ``source`` and the offending field.
        """
        for req in ("hidden_size", "num_hidden_layers", "vocab_size"):
            if req not in cfg:
                raise ConfigError(f"{source}: missing required field {req!r}", hint=MISSING_FIELD_HINT)
        if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ConfigError(f"{source}: hidden_act={cfg['hidden_act']!r} is not supported; expected 'silu'")
        if cfg.get("rms_norm", True) is not True:
            raise ConfigError(f"{source}: rms_norm=False is not supported")
        if cfg.get("norm_before_gate", False):
            raise ConfigError(f"{source}: norm_before_gate=True is not supported")
        limit = cfg.get("time_step_limit", (0.0, math.inf))
        if not (isinstance(limit, (list, tuple)) and len(limit) == 2 and all(_is_real(v) for v in limit)):
            raise ConfigError(f"{source}: time_step_limit: expected [min, max] (two numbers), got {limit!r}")
        eps = cfg.get("layer_norm_epsilon", 1e-5)
        # defaults are those of transformers' Mamba2Config (tie_word_embeddings=False there)
        conf = _with_source(source, lambda: cls(
            d_model=cfg["hidden_size"], n_layer=cfg["num_hidden_layers"], vocab_size=cfg["vocab_size"],
            d_state=cfg.get("state_size", 128), d_conv=cfg.get("conv_kernel", 4), expand=cfg.get("expand", 2),
            headdim=cfg.get("head_dim", 64), ngroups=cfg.get("n_groups", 1), chunk_size=cfg.get("chunk_size", 256),
            dt_limit=tuple(limit), pad_vocab_size_multiple=1, tie_embeddings=cfg.get("tie_word_embeddings", False),
            residual_in_fp32=cfg.get("residual_in_fp32", True), norm_epsilon=eps, gated_norm_epsilon=eps,
            conv_bias=cfg.get("use_conv_bias", True), bias=cfg.get("use_bias", False)), _HF_NAMES)
        if "num_heads" in cfg and cfg["num_heads"] != conf.nheads:
            raise ConfigError(f"{source}: num_heads={cfg['num_heads']} but expand*hidden_size/head_dim = "
                              f"{conf.nheads}")
        _check_hf_keys(cfg, conf, source)
        return conf


#: keys of transformers 5.24's ``Mamba2Config`` that :meth:`Mamba2Config.from_hf_json` reads
_HF_READ = frozenset({"hidden_size", "num_hidden_layers", "vocab_size", "state_size", "conv_kernel", "expand",
                      "head_dim", "n_groups", "chunk_size", "time_step_limit", "tie_word_embeddings",
                      "residual_in_fp32", "layer_norm_epsilon", "use_conv_bias", "use_bias", "num_heads",
                      "hidden_act", "rms_norm", "norm_before_gate"})

#: mamba_ssm (and Mamba2Config) names next to the HF key transformers reads instead, with the value
#: m2export took for that HF key; transformers ignores the mamba_ssm name, so it must agree
_MAMBA_SSM_TWINS = {"d_state": ("state_size", "d_state"), "d_conv": ("conv_kernel", "d_conv"),
                    "headdim": ("head_dim", "headdim"), "ngroups": ("n_groups", "ngroups"),
                    "nheads": ("num_heads", "nheads"), "n_layer": ("num_hidden_layers", "n_layer"),
                    "dt_limit": ("time_step_limit", "dt_limit"), "tie_embeddings": ("tie_word_embeddings",
                                                                                     "tie_embeddings"),
                    "norm_epsilon": ("layer_norm_epsilon", "norm_epsilon"), "conv_bias": ("use_conv_bias",
                                                                                           "conv_bias"),
                    "bias": ("use_bias", "bias")}


#: Mamba2Config field -> the HF key from_hf_json reads it from (errors name the file's key)
_HF_NAMES = {attr: hf_key for hf_key, attr in _MAMBA_SSM_TWINS.values()} | {
    "d_model": "hidden_size", "vocab_size": "vocab_size", "expand": "expand", "chunk_size": "chunk_size",
    "residual_in_fp32": "residual_in_fp32", "gated_norm_epsilon": "layer_norm_epsilon"}


def _check_hf_keys(cfg: dict[str, Any], conf: "Mamba2Config", source: str) -> None:
    """Refuse keys of an HF Mamba2 config.json that :meth:`Mamba2Config.from_hf_json` did not read.

    A mamba_ssm name (``d_state``) next to, or instead of, the HF one (``state_size``) is an error
    unless it agrees with the value used: transformers reads only the HF key, so a different value is
    a config that means two things (the HF key's default counts when the HF key is absent). Any
    other unknown key is refused by name (it might change the model).
    """
    from m2export.models.families import HARMLESS_KEYS  # families imports nothing of this module

    for twin, (hf_key, attr) in _MAMBA_SSM_TWINS.items():
        if twin not in cfg:
            continue
        used, v = getattr(conf, attr), cfg[twin]
        if not _same(v, used):
            given = f"{hf_key!r}={cfg[hf_key]!r}" if hf_key in cfg else f"{hf_key!r} (absent: its default {used!r})"
            raise ConfigError(f"{source}: conflicting {twin!r}={v!r} and {given}; transformers reads only "
                              f"{hf_key!r} (the mamba_ssm name {twin!r} is ignored there)",
                              hint=f"remove {twin!r} or make it equal to {hf_key!r}")
    unknown = sorted(set(cfg) - _HF_READ - HARMLESS_KEYS - set(_MAMBA_SSM_TWINS))
    if unknown:
        guessed = "" if "model_type" in cfg else " (it has no model_type: read as one because of its hidden_size)"
        raise ConfigError(f"{source}: unsupported field(s) {unknown} for an HF Mamba2 config{guessed}: m2export "
                          "does not know what they do to the model, so it will not guess (remove them if they are "
                          "only metadata)")


def _same(v: Any, used: Any) -> bool:
    """Does JSON value ``v`` say ``used`` (a config value: int, float, bool or a tuple of numbers)?"""
    if isinstance(used, tuple):
        return isinstance(v, (list, tuple)) and len(v) == len(used) and all(map(_same, v, used))
    if isinstance(used, bool) or isinstance(v, bool):
        return v is used
    return _is_real(v) and v == used


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def _with_source(source: str, make, names: dict[str, str] | None = None):
    """Call ``make()``; prefix a ConfigError (or the TypeError of an unknown keyword) with ``source``. ``names``:
    the file's own key for a Mamba2Config field (HF ``hidden_size`` for ``d_model``), named in the message too."""
    try:
        return make()
    except ConfigError as e:
        msg = e.raw_message
        for attr, key in (names or {}).items():
            if msg.startswith(f"config field {attr!r}"):
                msg = f"field {key!r}" + (f" (m2export's {attr!r})" if key != attr else "") + \
                    msg[len(f"config field {attr!r}"):]
                break
        raise ConfigError(f"{source}: {msg}", hint=e.raw_hint) from None
    except TypeError as e:
        raise ConfigError(f"{source}: {e}") from None


def _reject_unknown(d: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"{where}: unsupported field(s) {unknown}; m2export understands {sorted(known)}")


#: Shapes of the published mamba2 checkpoints (state-spaces/mamba2-*), for random-weight generation, and one
#: test shape (``tiny-mamba2``: no published model; two layers, ngroups 2, chunks shorter than a typical prompt).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny-mamba2": dict(d_model=64, n_layer=2, vocab_size=256, d_state=16, headdim=16, ngroups=2, chunk_size=16),
    "mamba2-130m": dict(d_model=768, n_layer=24, vocab_size=50277),
    "mamba2-370m": dict(d_model=1024, n_layer=48, vocab_size=50277),
    "mamba2-780m": dict(d_model=1536, n_layer=48, vocab_size=50277),
    "mamba2-1.3b": dict(d_model=2048, n_layer=48, vocab_size=50277),
    "mamba2-2.7b": dict(d_model=2560, n_layer=64, vocab_size=50277),
}
