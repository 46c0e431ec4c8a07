"""Typed description of a Mamba-2 language model or hybrid: one stack of layers.

Every family m2export loads (state-spaces/mamba_ssm and HF ``mamba2``, ``nemotron_h``, ``granitemoehybrid``,
``bamba``, ``falcon_h1``, ``zamba2``) is read into one :class:`ModelSpec`. The PyTorch reference
(:class:`m2export.models.hybrid.HybridLM`) is built from it, and the exporter derives the graph inputs and
outputs from :meth:`ModelSpec.states` without restating any of it.

API (the names other modules build on)::

    ModelSpec(family, d_model, vocab_size, layers, norm_epsilon, tie_embeddings, residual_in_fp32=False,
              embedding_multiplier=1.0, logits_multiplier=1.0, shared_blocks=(), pad_vocab_size_multiple=1)
        .vocab_size_padded -> int                 # a checkpoint's embedding/lm_head rows (the model: vocab_size)
        shared_blocks: tuple[SharedBlockSpec, ...]   # Zamba2: stored once, called by layers with ``shared``
        .n_layer -> int
        .states() -> tuple[StateSpec, ...]        # the flat runtime-state order of HybridLM.forward
        .layer_states(i) -> tuple[StateSpec, ...]
        .mamba_layers / .attention_layers -> tuple[int, ...]
    LayerSpec(mixer, ffn=None, norm_epsilon=1e-5, residual_multiplier=1.0, shared=None)
        mixer: MambaSpec | AttentionSpec | MLPSpec | MoESpec | ParallelSpec (Falcon-H1: attention + Mamba)
        ffn: MLPSpec | MoESpec | None;  shared: SharedCallSpec(block) | None (Zamba2)
        .mamba -> MambaSpec | None;  .attention_in(shared_blocks) -> AttentionSpec | None  (its stateful parts)
        .state_specs(i, shared_blocks) -> tuple[StateSpec, ...]
    StateSpec(layer, kind, shape, dtype)
        kind: "conv_state" | "ssm_state" | "key" | "value"
        shape: ints and the symbols BATCH ("batch_size") and PAST ("past_sequence_length")
        dtype: "model" (the model's dtype) | "float32"

Per layer, in this order (:meth:`LayerSpec.state_kinds`): a Mamba-2 mixer carries
``conv_state`` (batch, conv_dim, d_conv - 1) in the model dtype and ``ssm_state`` (batch, nheads, headdim,
d_state) in float32; an attention carries ``key`` and ``value`` (batch, num_kv_heads, past_sequence_length,
head_dim) in the model dtype (after RoPE: the cache holds rotated keys, as HF's DynamicCache does). A layer
with both (Falcon-H1's parallel mixer, Zamba2's hybrid layer) lists the Mamba states first.

Field names follow mamba_ssm for the Mamba mixer (d_model, d_state, d_conv, headdim, nheads, ngroups,
chunk_size, dt_limit) and HF for attention/MLP/MoE (num_heads, num_kv_heads, head_dim, d_ff, n_experts, top_k).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Union

from m2export.errors import ConfigError

#: symbolic axes of :attr:`StateSpec.shape`
BATCH = "batch_size"
PAST = "past_sequence_length"


def _pos_int(where: str, **vals) -> None:
    for k, v in vals.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{where}: {k} must be a positive integer, got {v!r}")


def _real(where: str, **vals) -> None:
    for k, v in vals.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ConfigError(f"{where}: {k} must be a finite number, got {v!r}")


@dataclass(frozen=True)
class MambaSpec:
    """One Mamba-2 mixer (mamba_ssm ``Mamba2`` with d_mlp = 0).

    ``d_inner = nheads * headdim`` (it need not equal expand * d_model: Nemotron Nano-9B-v2 has
    128 x 80 = 10240 at d_model 4480). in_proj output order [z (d_inner), xBC (conv_dim), dt (nheads)] with
    ``conv_dim = d_inner + 2 * ngroups * d_state``.

    ``norm``: ``"gated_rms"`` = RMSNorm over groups of ``norm_group_size`` channels of y * silu(z)
    (``norm_before_gate`` False, mamba_ssm ``RMSNormGated``) or of rmsnorm(y) * silu(z) (True);
    ``"gate"`` = y * silu(z) without a norm (Falcon-H1 mamba_rms_norm = false).
    ``zxbcdt_multipliers``: Falcon-H1's muP scales of the [z, x, B, C, dt] slices of the in_proj output
    (None = all 1); ``in_multiplier``/``out_multiplier`` scale the mixer's input and output.
    """

    d_model: int
    nheads: int
    headdim: int
    d_state: int
    ngroups: int = 1
    d_conv: int = 4
    chunk_size: int = 256
    dt_limit: tuple[float, float] = (0.0, math.inf)
    conv_bias: bool = True
    bias: bool = False
    out_bias: bool | None = None  # out_proj bias; None: same as ``bias`` (Falcon-H1: projectors_bias)
    norm: str = "gated_rms"
    norm_group_size: int | None = None  # None: d_inner // ngroups
    norm_before_gate: bool = False
    gated_norm_epsilon: float = 1e-5
    zxbcdt_multipliers: tuple[float, float, float, float, float] | None = None
    in_multiplier: float = 1.0
    out_multiplier: float = 1.0

    def __post_init__(self):
        w = "Mamba-2 mixer"
        _pos_int(w, d_model=self.d_model, nheads=self.nheads, headdim=self.headdim, d_state=self.d_state,
                 ngroups=self.ngroups, d_conv=self.d_conv, chunk_size=self.chunk_size)
        if self.nheads % self.ngroups:
            raise ConfigError(f"{w}: nheads = {self.nheads} is not divisible by ngroups = {self.ngroups}")
        lo, hi = (float(v) for v in self.dt_limit)
        if not (0.0 <= lo <= hi):
            raise ConfigError(f"{w}: dt_limit must satisfy 0 <= min <= max, got {self.dt_limit}")
        object.__setattr__(self, "dt_limit", (lo, hi))
        if self.norm not in ("gated_rms", "gate"):
            raise ConfigError(f"{w}: norm must be 'gated_rms' or 'gate', got {self.norm!r}")
        if self.norm_group_size is None:
            object.__setattr__(self, "norm_group_size", self.d_inner // self.ngroups)
        if self.d_inner % self.norm_group_size:
            raise ConfigError(f"{w}: norm group size {self.norm_group_size} does not divide d_inner {self.d_inner}")
        if self.zxbcdt_multipliers is not None:
            if len(self.zxbcdt_multipliers) != 5:
                raise ConfigError(f"{w}: expected 5 multipliers for [z, x, B, C, dt], got {self.zxbcdt_multipliers}")
            object.__setattr__(self, "zxbcdt_multipliers", tuple(float(v) for v in self.zxbcdt_multipliers))
        _real(w, in_multiplier=self.in_multiplier, out_multiplier=self.out_multiplier,
              gated_norm_epsilon=self.gated_norm_epsilon)

    @property
    def d_inner(self) -> int:
        return self.nheads * self.headdim

    @property
    def out_proj_bias(self) -> bool:
        return self.bias if self.out_bias is None else self.out_bias

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.ngroups * self.d_state

    @property
    def d_in_proj(self) -> int:
        return 2 * self.d_inner + 2 * self.ngroups * self.d_state + self.nheads


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding (HF "default" rope_type): ``inv_freq = 1 / theta ** (arange(0, rotary_dim, 2) / rotary_dim)``,
    applied to the first ``rotary_dim`` channels of each head with HF's rotate_half layout; the rest pass."""

    theta: float
    rotary_dim: int

    def __post_init__(self):
        _real("RoPE", theta=self.theta)
        _pos_int("RoPE", rotary_dim=self.rotary_dim)
        if self.rotary_dim % 2:
            raise ConfigError(f"RoPE: rotary_dim must be even, got {self.rotary_dim}")


@dataclass(frozen=True)
class AttentionSpec:
    """Causal self-attention with GQA and an explicit KV cache.

    q/k/v/o projections ``d_in -> num_heads*head_dim`` (q), ``num_kv_heads*head_dim`` (k, v),
    ``num_heads*head_dim -> d_out`` (o); ``scale`` multiplies q.k (HF ``scaling``: head_dim ** -0.5, or
    Granite's attention_multiplier). ``rope`` None = no positional encoding (Nemotron-H).
    ``key_multiplier`` scales k before it is cached (Falcon-H1). ``d_in``/``d_out`` default to d_model.
    """

    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float | None = None  # None: head_dim ** -0.5
    rope: RopeSpec | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    key_multiplier: float = 1.0
    in_multiplier: float = 1.0
    out_multiplier: float = 1.0
    d_in: int | None = None
    d_out: int | None = None

    def __post_init__(self):
        w = "attention"
        _pos_int(w, d_model=self.d_model, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                 head_dim=self.head_dim)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{w}: num_heads = {self.num_heads} is not divisible by num_kv_heads = "
                              f"{self.num_kv_heads}")
        if self.scale is None:
            object.__setattr__(self, "scale", self.head_dim ** -0.5)
        if self.d_in is None:
            object.__setattr__(self, "d_in", self.d_model)
        if self.d_out is None:
            object.__setattr__(self, "d_out", self.d_model)
        _real(w, scale=self.scale, key_multiplier=self.key_multiplier, in_multiplier=self.in_multiplier,
              out_multiplier=self.out_multiplier)
        if self.rope is not None and self.rope.rotary_dim > self.head_dim:
            raise ConfigError(f"{w}: rotary_dim {self.rope.rotary_dim} > head_dim {self.head_dim}")


#: activations of MLP / expert blocks: relu2 = relu(x)**2 (Nemotron-H), silu, gelu (tanh approximation off)
ACTIVATIONS = ("relu2", "silu", "gelu")


@dataclass(frozen=True)
class MLPSpec:
    """Feed-forward block. gated: ``down(act(gate(x)) * up(x))`` (SwiGLU for act silu); else ``down(act(up(x)))``.

    ``fused_gate_up``: gate and up are one Linear of 2 * d_ff outputs, gate first (Granite ``input_linear``).
    ``gate_multiplier``/``down_multiplier``: Falcon-H1's mlp_multipliers (gate output, down output).
    """

    d_model: int
    d_ff: int
    act: str = "silu"
    gated: bool = True
    bias: bool = False
    fused_gate_up: bool = False
    gate_multiplier: float = 1.0
    down_multiplier: float = 1.0

    def __post_init__(self):
        _pos_int("MLP", d_model=self.d_model, d_ff=self.d_ff)
        if self.act not in ACTIVATIONS:
            raise ConfigError(f"MLP: activation {self.act!r} is not supported; expected one of {ACTIVATIONS}")
        if self.fused_gate_up and not self.gated:
            raise ConfigError("MLP: fused_gate_up needs gated=True")


@dataclass(frozen=True)
class MoESpec:
    """Routed experts (+ optional shared MLP), top-k per token.

    routing ``"softmax_topk"`` (Granite): top-k of the router logits, softmax over those k.
    routing ``"sigmoid_grouped"`` (Nemotron-H, DeepSeek-V3 style): scores = sigmoid(logits); choice by
    scores + e_score_correction_bias, restricted to the ``topk_group`` best of ``n_group`` groups (group score =
    sum of its top-2); weights = chosen scores, divided by their sum when ``norm_topk_prob``, times
    ``routed_scaling_factor``. Router math in float32.
    Experts: ``gated`` (act(gate) * up, Granite) or not (act(up), Nemotron-H) of width ``d_expert``, on the
    ``latent_size``-wide projection of the input when set (Nemotron-H moe_latent_size).
    ``shared``: an MLP added to the routed output (its input is the block input).
    """

    d_model: int
    n_experts: int
    top_k: int
    d_expert: int
    act: str = "silu"
    gated: bool = True
    routing: str = "softmax_topk"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    score_correction_bias: bool = False
    latent_size: int | None = None
    bias: bool = False
    shared: MLPSpec | None = None

    def __post_init__(self):
        w = "MoE"
        _pos_int(w, d_model=self.d_model, n_experts=self.n_experts, top_k=self.top_k, d_expert=self.d_expert,
                 n_group=self.n_group, topk_group=self.topk_group)
        if self.top_k > self.n_experts:
            raise ConfigError(f"{w}: top_k = {self.top_k} > n_experts = {self.n_experts}")
        if self.routing not in ("softmax_topk", "sigmoid_grouped"):
            raise ConfigError(f"{w}: routing {self.routing!r} is not supported")
        if self.act not in ACTIVATIONS:
            raise ConfigError(f"{w}: activation {self.act!r} is not supported; expected one of {ACTIVATIONS}")
        if self.n_experts % self.n_group or self.topk_group > self.n_group:
            raise ConfigError(f"{w}: n_group = {self.n_group} must divide n_experts = {self.n_experts} and be "
                              f">= topk_group = {self.topk_group}")
        if self.routing == "sigmoid_grouped" and self.n_experts // self.n_group < 2:
            raise ConfigError(f"{w}: grouped routing needs >= 2 experts per group (group score = top-2 sum)")
        if self.top_k > (self.n_experts // self.n_group) * self.topk_group:
            raise ConfigError(f"{w}: top_k = {self.top_k} exceeds the experts of the {self.topk_group} chosen groups")
        if self.latent_size is not None:
            _pos_int(w, latent_size=self.latent_size)
        _real(w, routed_scaling_factor=self.routed_scaling_factor)

    @property
    def d_expert_in(self) -> int:
        return self.latent_size if self.latent_size is not None else self.d_model


@dataclass(frozen=True)
class ParallelSpec:
    """Attention and a Mamba-2 mixer on the same normed input, outputs summed (Falcon-H1)."""

    attention: AttentionSpec
    mamba: MambaSpec


@dataclass(frozen=True)
class SharedCallSpec:
    """Layer ``layer`` calls shared transformer block ``block`` (Zamba2: call c of the model uses block
    c % num_mem_blocks, "ABAB"); the call site owns its LoRA-style adapters and its output Linear
    (d_model -> d_model, no bias)."""

    block: int


@dataclass(frozen=True)
class SharedBlockSpec:
    """A transformer block whose weights are shared by several layers (Zamba2 ``num_mem_blocks``), stored once:
    ``x = norm(concat(h, embeddings))`` (2 * d_model wide), ``a = attention(x)`` (d_in 2 * d_model, d_out
    d_model), ``out = mlp(ffn_norm(a))``, no residual inside. Per call site, when ``adapter_rank`` is set:
    rank-``adapter_rank`` adapters ``up(down(x))`` added to q, k, v (``attention_adapter``) and to the MLP's
    fused gate_up projection (``mlp_adapter``)."""

    attention: AttentionSpec
    mlp: MLPSpec
    norm_epsilon: float = 1e-5
    adapter_rank: int | None = None
    attention_adapter: bool = False
    mlp_adapter: bool = False

    def __post_init__(self):
        if (self.attention_adapter or self.mlp_adapter) and self.adapter_rank is None:
            raise ConfigError("shared block: adapters need adapter_rank")
        if self.adapter_rank is not None:
            _pos_int("shared block", adapter_rank=self.adapter_rank)


Mixer = Union[MambaSpec, AttentionSpec, MLPSpec, MoESpec, ParallelSpec]
FFN = Union[MLPSpec, MoESpec]

STATE_KINDS = ("conv_state", "ssm_state", "key", "value")


@dataclass(frozen=True)
class StateSpec:
    """One runtime-state tensor of layer ``layer``; see the module docstring for shapes and dtypes."""

    layer: int
    kind: str
    shape: tuple[int | str, ...]
    dtype: str  # "model" | "float32"


@dataclass(frozen=True)
class LayerSpec:
    """``h = h + residual_multiplier * mixer(norm(h))``, then, if ``ffn``, ``h = h + residual_multiplier *
    ffn(ffn_norm(h))``. Norms are RMSNorm with ``norm_epsilon``. ``shared`` (Zamba2's hybrid layer):
    ``t = shared_proj(block(h, embeddings))`` first, and the mixer reads ``norm(h + t)`` (the residual stays h)."""

    mixer: Mixer
    ffn: FFN | None = None
    norm_epsilon: float = 1e-5
    residual_multiplier: float = 1.0
    shared: SharedCallSpec | None = None

    @property
    def mamba(self) -> MambaSpec | None:
        m = self.mixer
        return m if isinstance(m, MambaSpec) else m.mamba if isinstance(m, ParallelSpec) else None

    def attention_in(self, shared_blocks: tuple[SharedBlockSpec, ...] = ()) -> AttentionSpec | None:
        m = self.mixer
        if isinstance(m, AttentionSpec):
            return m
        if isinstance(m, ParallelSpec):
            return m.attention
        if self.shared is not None:
            return shared_blocks[self.shared.block].attention
        return None

    def state_specs(self, layer: int, shared_blocks: tuple[SharedBlockSpec, ...] = ()) -> tuple[StateSpec, ...]:
        out = []
        mb = self.mamba
        if mb is not None:
            out.append(StateSpec(layer, "conv_state", (BATCH, mb.conv_dim, mb.d_conv - 1), "model"))
            out.append(StateSpec(layer, "ssm_state", (BATCH, mb.nheads, mb.headdim, mb.d_state), "float32"))
        at = self.attention_in(shared_blocks)
        if at is not None:
            shp = (BATCH, at.num_kv_heads, PAST, at.head_dim)
            out.append(StateSpec(layer, "key", shp, "model"))
            out.append(StateSpec(layer, "value", shp, "model"))
        return tuple(out)


@dataclass(frozen=True)
class ModelSpec:
    """A language model: embedding (x embedding_multiplier), ``layers``, final RMSNorm, lm_head
    (x logits_multiplier; Granite's 1/logits_scaling). ``vocab_size``: the token ids and the logits' width.
    ``pad_vocab_size_multiple``: a checkpoint's embedding and lm_head weights have :attr:`vocab_size_padded` rows
    (mamba_ssm rounds vocab_size up to a multiple of it); the rows past ``vocab_size`` are never read (mamba_ssm's
    own generation slices its logits to ``vocab_size``): HybridLM holds ``vocab_size`` rows, the checkpoint loader
    keeps the others aside (``HybridLM.vocab_padding``) and save_checkpoint writes them back (zero rows for a model
    that has none).
    ``residual_in_fp32``: the residual stream is kept in float32 (mamba_ssm)."""

    family: str
    d_model: int
    vocab_size: int
    layers: tuple[LayerSpec, ...]
    norm_epsilon: float = 1e-5
    tie_embeddings: bool = False
    residual_in_fp32: bool = False
    embedding_multiplier: float = 1.0
    logits_multiplier: float = 1.0
    shared_blocks: tuple[SharedBlockSpec, ...] = field(default=())
    pad_vocab_size_multiple: int = 1

    def __post_init__(self):
        _pos_int(self.family, d_model=self.d_model, vocab_size=self.vocab_size,
                 pad_vocab_size_multiple=self.pad_vocab_size_multiple)
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise ConfigError(f"{self.family}: the model has no layers")
        _real(self.family, embedding_multiplier=self.embedding_multiplier, logits_multiplier=self.logits_multiplier)

    @property
    def n_layer(self) -> int:
        return len(self.layers)

    @property
    def vocab_size_padded(self) -> int:
        """A checkpoint's embedding and lm_head row count: ``vocab_size`` rounded up to a multiple of
        ``pad_vocab_size_multiple`` (as :attr:`m2export.models.config.Mamba2Config.vocab_size_padded`)."""
        m = self.pad_vocab_size_multiple
        return -(-self.vocab_size // m) * m

    def layer_states(self, i: int) -> tuple[StateSpec, ...]:
        return self.layers[i].state_specs(i, self.shared_blocks)

    def states(self) -> tuple[StateSpec, ...]:
        """Every runtime state, layer by layer: the order of ``past``/``present`` in HybridLM.forward."""
        return tuple(s for i in range(self.n_layer) for s in self.layer_states(i))

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        return tuple(i for i, L in enumerate(self.layers) if L.mamba is not None)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, L in enumerate(self.layers) if L.attention_in(self.shared_blocks) is not None)
