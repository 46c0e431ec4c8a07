"""Mamba-2 and its hybrids in plain PyTorch: the reference model every export is compared against.

:class:`HybridLM` runs any :class:`~m2export.models.spec.ModelSpec` (Mamba-2 mixers, attention with a KV
cache, MLP, MoE; the blocks other than the mixer are in :mod:`m2export.models.layers`) through one call,
``forward_states(input_ids, past) -> (logits, present)``; :class:`Mamba2LMHeadModel` is its pure-Mamba
case with the per-layer ``conv_states``/``ssm_states`` API. The Mamba-2 mixer:

Follows mamba_ssm/modules/mamba2.py (``Mamba2``) and mamba_ssm/models/mixer_seq_simple.py
(``MambaLMHeadModel``): parameter names are identical, so state-spaces checkpoints load
without renaming. Layout of the input projection (one Linear, output order)::

    zxbcdt = in_proj(u)                     # (batch, seqlen, d_in_proj)
    z, xBC, dt = split [d_inner, conv_dim, nheads]
    xBC = silu(causal depthwise conv1d(xBC))    # conv_dim = d_inner + 2 * ngroups * d_state
    x, B, C = split xBC [d_inner, ngroups*d_state, ngroups*d_state]

Runtime state per layer: ``conv_state`` (batch, conv_dim, d_conv - 1), the last d_conv-1
inputs of the conv, in the model dtype; ``ssm_state`` (batch, nheads, headdim, d_state) fp32.
A prefill with states is a continuation: prefill(N) then step x M equals prefill(N + M).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from m2export.errors import ContractError
from m2export.kernels.ssd.naive import ssm_scan_chunked
from m2export.models.config import Mamba2Config
from m2export.models.layers import MLP, Attention, MoE, Router, SharedBlock
from m2export.models.spec import (BATCH, PAST, AttentionSpec, LayerSpec, MambaSpec, MLPSpec, ModelSpec, MoESpec,
                                  ParallelSpec)


def _compute(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the dtype the norms, gates, ``A`` and the residual stream are computed in: float32, or float64
    for a float64 tensor (a float64 model is a float64 forward throughout: with a float64 scan, e.g.
    :func:`~m2export.kernels.ssd.naive.ssm_scan_recurrent`, no op rounds to float32)."""
    return t if t.dtype == torch.float64 else t.float()


ScanFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""Signature of an SSMScan implementation: ``fn(x, dt, A, B, C, D, dt_bias, initial_state, *, chunk_size,
dt_softplus, dt_limit) -> (y, final_state)`` (see m2export.contract)."""


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 (float64 for a float64 ``x``), returned in
    ``out_dtype`` (default weight dtype)."""

    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        xf = _compute(x)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(xf.dtype)
        return y.to(out_dtype or self.weight.dtype)


class RMSNormGated(nn.Module):
    """Gated RMSNorm of mamba_ssm, normalised per group of ``group_size`` channels:

        norm_before_gate=False:  y = rmsnorm_per_group(x * silu(z)) * weight
        norm_before_gate=True:   y = rmsnorm_per_group(x) * weight * silu(z)

    Source: mamba_ssm/ops/triton/layernorm_gated.py (``rmsnorm_fn`` with group_size = d_inner // ngroups);
    transformers 5.24 normalises per group too (``MambaRMSNormGated(group_size=...)``; older releases
    normalised over all channels, which equals this only for ngroups=1).
    """

    def __init__(self, d: int, group_size: int, eps: float = 1e-5, norm_before_gate: bool = False):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = _compute(x) if self.norm_before_gate else _compute(x) * F.silu(_compute(z))
        shp = xf.shape
        g = xf.reshape(*shp[:-1], shp[-1] // self.group_size, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        y = g.reshape(shp) * self.weight.to(xf.dtype)
        if self.norm_before_gate:
            y = y * F.silu(_compute(z))
        return y.to(x.dtype)


class Mamba2Mixer(nn.Module):
    """One Mamba-2 mixer (mamba_ssm ``Mamba2`` with d_mlp = 0). ``scan_fn`` is the SSMScan implementation.

    Built from a :class:`~m2export.models.spec.MambaSpec` (a :class:`Mamba2Config` is accepted and means its
    ``mamba_spec``). Any headdim works (80 included): the torch scan has no tile constraint.
    """

    def __init__(self, spec: MambaSpec | Mamba2Config, layer_idx: int):
        super().__init__()
        if isinstance(spec, Mamba2Config):
            spec = spec.mamba_spec
        self.cfg = self.spec = spec
        self.layer_idx = layer_idx
        s = spec
        self.in_proj = nn.Linear(s.d_model, s.d_in_proj, bias=s.bias)
        self.conv1d = nn.Conv1d(s.conv_dim, s.conv_dim, s.d_conv, groups=s.conv_dim, bias=s.conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(s.nheads))
        self.A_log = nn.Parameter(torch.zeros(s.nheads))
        self.D = nn.Parameter(torch.ones(s.nheads))
        if s.norm == "gated_rms":
            self.norm = RMSNormGated(s.d_inner, group_size=s.norm_group_size, eps=s.gated_norm_epsilon,
                                     norm_before_gate=s.norm_before_gate)
        self.out_proj = nn.Linear(s.d_inner, s.d_model, bias=s.out_proj_bias)
        self.scan_fn: ScanFn = ssm_scan_chunked
        #: "torch" (PyTorch ops, ``scan_fn``) or "cutile" (the cuTile conv, scan and gated-norm kernels); set
        #: through :meth:`HybridLM.set_kernel_backend`, the one place that checks it
        self.kernel_backend = "torch"

    def forward(self, u: torch.Tensor, conv_state: torch.Tensor | None = None,
                ssm_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """u: (batch, seqlen, d_model). Returns (out (batch, seqlen, d_model), conv_state, ssm_state)."""
        s = self.spec
        batch, seqlen, _ = u.shape
        if s.in_multiplier != 1.0:
            u = u * s.in_multiplier
        zxbcdt = self.in_proj(u)
        if s.zxbcdt_multipliers is not None:  # Falcon-H1 muP: one scale per slice [z, x, B, C, dt]
            gs = s.ngroups * s.d_state
            sizes = [s.d_inner, s.d_inner, gs, gs, s.nheads]
            scale = torch.cat([torch.full((n,), m, dtype=zxbcdt.dtype, device=zxbcdt.device)
                               for n, m in zip(sizes, s.zxbcdt_multipliers)])
            zxbcdt = zxbcdt * scale
        z, xBC, dt = torch.split(zxbcdt, [s.d_inner, s.conv_dim, s.nheads], dim=-1)
        cutile = self.kernel_backend == "cutile"
        if cutile:
            xBC, new_conv_state = self._conv_cutile(xBC, conv_state)
        else:
            xBC = xBC.transpose(1, 2)  # (batch, conv_dim, seqlen)
            if conv_state is None:
                conv_state = xBC.new_zeros(batch, s.conv_dim, s.d_conv - 1)
            xpad = torch.cat([conv_state.to(xBC.dtype), xBC], dim=2)  # (batch, conv_dim, d_conv - 1 + seqlen)
            new_conv_state = xpad[:, :, xpad.shape[2] - (s.d_conv - 1):]
            xBC = F.silu(F.conv1d(xpad, self.conv1d.weight, self.conv1d.bias, groups=s.conv_dim)).transpose(1, 2)
        x, B, C = torch.split(xBC, [s.d_inner, s.ngroups * s.d_state, s.ngroups * s.d_state], dim=-1)
        A = -torch.exp(_compute(self.A_log))  # fp32 (or float64): A_log in bf16 would lose the decay's precision
        try:
            y, new_ssm_state = (_cutile_scan if cutile else self.scan_fn)(
                x.reshape(batch, seqlen, s.nheads, s.headdim), dt,
                A, B.reshape(batch, seqlen, s.ngroups, s.d_state), C.reshape(batch, seqlen, s.ngroups, s.d_state),
                _compute(self.D), _compute(self.dt_bias), None if ssm_state is None else _compute(ssm_state),
                chunk_size=s.chunk_size, dt_softplus=True, dt_limit=s.dt_limit)
        except ContractError as e:  # e.g. an A_log loaded with allow_nonfinite: say which layer's
            raise ContractError(f"layer {self.layer_idx}'s mixer: {e.raw_message}", hint=e.raw_hint) from None
        y = y.reshape(batch, seqlen, s.d_inner)
        if s.norm == "gated_rms" and cutile:
            from m2export.kernels.gated_norm import gated_rmsnorm

            n = self.norm
            y = gated_rmsnorm(y, z, n.weight.to(y.dtype), group_size=n.group_size, eps=n.eps,
                              norm_before_gate=n.norm_before_gate, backend="cutile")
        elif s.norm == "gated_rms":
            y = self.norm(y, z)
        else:  # "gate": y * silu(z), no norm (Falcon-H1 mamba_rms_norm = false)
            y = (_compute(y) * F.silu(_compute(z))).to(y.dtype)
        out = self.out_proj(y)
        if s.out_multiplier != 1.0:
            out = out * s.out_multiplier
        return out, new_conv_state, new_ssm_state

    def _conv_cutile(self, xBC: torch.Tensor, conv_state: torch.Tensor | None):
        """The conv + SiLU on the cuTile kernels: ``xBC`` (batch, seqlen, conv_dim) channels last (a slice of the
        in_proj output) -> (y (batch, seqlen, conv_dim), new conv_state); one token is the update kernel on a copy
        of ``conv_state`` (the caller's state is not modified), longer inputs the prefill kernels."""
        from m2export.kernels.conv1d import causal_conv1d, conv_update

        w = self.conv1d.weight[:, 0, :]
        b = self.conv1d.bias
        if conv_state is not None:
            conv_state = conv_state.to(xBC.dtype)
        if xBC.shape[1] == 1 and conv_state is not None:
            new = conv_state.clone(memory_format=torch.contiguous_format)
            y, _ = conv_update(xBC[:, 0], new, w, b, activation="silu", backend="cutile")
            return y[:, None], new
        y, new = causal_conv1d(xBC, w, b, conv_state, activation="silu", backend="cutile")
        return y, new


def _cutile_scan(x, dt, A, B, C, D=None, dt_bias=None, initial_state=None, *, chunk_size, dt_softplus, dt_limit):
    """:func:`m2export.kernels.ssd.ssm_scan` with ``backend="cutile"`` (a :data:`ScanFn`)."""
    from m2export.kernels.ssd import ssm_scan

    res = ssm_scan(x, dt, A, B, C, D, dt_bias, initial_state, chunk_size=chunk_size, dt_softplus=dt_softplus,
                   dt_limit=dt_limit, backend="cutile")
    return res.y, res.final_state


class ParallelMixer(nn.Module):
    """Falcon-H1: ``attention(x) + mamba(x)`` on the same normed input (each applies its own multipliers)."""

    def __init__(self, spec: ParallelSpec, layer_idx: int):
        super().__init__()
        self.attention = Attention(spec.attention)
        self.mamba = Mamba2Mixer(spec.mamba, layer_idx)

    def forward(self, x, conv_state, ssm_state, key, value):
        m, conv_state, ssm_state = self.mamba(x, conv_state, ssm_state)
        a, key, value = self.attention(x, key, value)
        return a + m, conv_state, ssm_state, key, value


def _build_block(spec, layer_idx: int) -> nn.Module:
    if isinstance(spec, MambaSpec):
        return Mamba2Mixer(spec, layer_idx)
    if isinstance(spec, AttentionSpec):
        return Attention(spec)
    if isinstance(spec, MLPSpec):
        return MLP(spec)
    if isinstance(spec, MoESpec):
        return MoE(spec)
    if isinstance(spec, ParallelSpec):
        return ParallelMixer(spec, layer_idx)
    raise TypeError(f"no module for {type(spec).__name__}")


class Layer(nn.Module):
    """One :class:`~m2export.models.spec.LayerSpec`: ``h += r * mixer(norm(h))``; ``h += r * ffn(ffn_norm(h))``.

    ``forward(h, states)``: ``states`` are this layer's runtime states in :meth:`LayerSpec.state_specs` order;
    returns (h, new states). The residual stream h stays in its dtype (float32 under residual_in_fp32);
    norms hand the blocks the model dtype.
    """

    def __init__(self, spec: LayerSpec, d_model: int, layer_idx: int, shared_blocks: list[SharedBlock] = ()):
        super().__init__()
        self.spec = spec
        self.norm = RMSNorm(d_model, eps=spec.norm_epsilon)
        self.mixer = _build_block(spec.mixer, layer_idx)
        if spec.ffn is not None:
            self.ffn_norm = RMSNorm(d_model, eps=spec.norm_epsilon)
            self.ffn = _build_block(spec.ffn, layer_idx)
        if spec.shared is not None:  # the block itself lives in HybridLM.backbone.shared_blocks (stored once)
            self.shared_proj = nn.Linear(d_model, d_model, bias=False)
            self.adapters = shared_blocks[spec.shared.block].adapters()

    def forward(self, h: torch.Tensor, states: list[torch.Tensor], emb: torch.Tensor | None = None,
                shared_blocks: nn.ModuleList | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``emb``: the embeddings of the tokens (Zamba2's shared blocks read them); ``shared_blocks``: the
        model's shared blocks."""
        spec = self.spec
        x_in, shared_new = h, []
        if spec.shared is not None:  # Zamba2: states are [conv, ssm, key, value]; the block's KV come last
            t, k, v = shared_blocks[spec.shared.block](h, emb, states[2], states[3], self.adapters)
            x_in, shared_new, states = h + self.shared_proj(t), [k, v], states[:2]
        x = self.norm(x_in, out_dtype=self.norm.weight.dtype)
        m = spec.mixer
        if isinstance(m, MambaSpec):
            y, cs, ss = self.mixer(x, states[0], states[1])
            new = [cs, ss]
        elif isinstance(m, AttentionSpec):
            y, k, v = self.mixer(x, states[0], states[1])
            new = [k, v]
        elif isinstance(m, ParallelSpec):
            y, cs, ss, k, v = self.mixer(x, *states)
            new = [cs, ss, k, v]
        else:
            y, new = self.mixer(x), []
        new = new + shared_new
        h = h + (y * spec.residual_multiplier if spec.residual_multiplier != 1.0 else y)
        if spec.ffn is not None:
            y = self.ffn(self.ffn_norm(h, out_dtype=self.ffn_norm.weight.dtype))
            h = h + (y * spec.residual_multiplier if spec.residual_multiplier != 1.0 else y)
        return h, new


class HybridOutput(NamedTuple):
    """logits (batch, seqlen, vocab_size) in the model dtype; states: the runtime states after the last token,
    flat, in :meth:`ModelSpec.states` order."""

    logits: torch.Tensor
    states: list[torch.Tensor]


class HybridLM(nn.Module):
    """A language model built from a :class:`~m2export.models.spec.ModelSpec` (any supported family).

    Module tree (the names the weights are loaded under): ``backbone.embedding``, ``backbone.layers.{i}``
    (:class:`Layer`: ``norm``, ``mixer``, ``ffn_norm``, ``ffn``), ``backbone.norm_f``, ``lm_head``
    (the embedding's weight when tied), ``backbone.shared_blocks.{k}`` (Zamba2: stored once, called from the
    layers with ``shared``; each such layer owns ``shared_proj`` and ``adapters``). A pure-Mamba spec gives
    exactly mamba_ssm's ``MambaLMHeadModel`` names.

    The uniform call every family shares (and one tracing wrapper serves)::

        logits, present = model.forward_states(input_ids, past)

    ``input_ids`` (batch, seqlen) int64; ``past`` the flat state list of :meth:`ModelSpec.states` (shapes and
    dtypes there; ``None`` = a fresh sequence, i.e. :meth:`zero_states`). ``present`` continues it:
    ``forward_states(ids[:, :N])`` then ``forward_states(ids[:, N:], present)`` equals
    ``forward_states(ids)`` on the last M logits.

    ``vocab_padding``: the rows past ``vocab_size`` of a loaded checkpoint's vocab_size_padded-row embedding and
    lm_head (name -> (vocab_size_padded - vocab_size, d_model) tensor, the file's dtype), which the model never
    reads; kept aside by the loader so that :func:`~m2export.models.checkpoint.save_checkpoint` writes them back
    unchanged. Empty for a model built here (save_checkpoint then writes zero rows).
    """

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.vocab_padding: dict[str, torch.Tensor] = {}
        self.backbone = nn.Module()
        self.backbone.embedding = nn.Embedding(spec.vocab_size, spec.d_model)  # not the padding rows
        if spec.shared_blocks:
            self.backbone.shared_blocks = nn.ModuleList(SharedBlock(b) for b in spec.shared_blocks)
        shared = list(self.backbone.shared_blocks) if spec.shared_blocks else []
        self.backbone.layers = nn.ModuleList(Layer(L, spec.d_model, i, shared) for i, L in enumerate(spec.layers))
        self.backbone.norm_f = RMSNorm(spec.d_model, eps=spec.norm_epsilon)
        self.lm_head = nn.Linear(spec.d_model, spec.vocab_size, bias=False)
        if spec.tie_embeddings:
            self.lm_head.weight = self.backbone.embedding.weight
        self._n_states = [len(spec.layer_states(i)) for i in range(spec.n_layer)]

    def set_kernel_backend(self, backend: str) -> "HybridLM":
        """Run every Mamba-2 mixer's conv + SiLU, scan and gated RMSNorm on ``backend`` (returns ``self``).

        ``"torch"`` (the default): PyTorch ops and each mixer's ``scan_fn``, on any device. ``"cutile"``: the cuTile
        kernels (:func:`m2export.kernels.conv1d.causal_conv1d` / ``conv_update`` at one token,
        :func:`m2export.kernels.ssd.ssm_scan`, :func:`m2export.kernels.gated_norm.gated_rmsnorm`), never a silent
        fallback: the model must be on a CUDA device with cuda.tile importable. The rest of the model (projections,
        attention, MLP) stays PyTorch. The headdim/d_state limits of the scan kernel are checked at the first call.

        Raises:
            ContractError: an unknown backend.
            BackendUnavailable: "cutile" without a CUDA device, without cuda.tile, or with the model off CUDA.
        """
        from m2export.errors import ContractError
        from m2export.kernels._host import BACKENDS, require_cuda_tile

        if backend not in BACKENDS:
            raise ContractError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        if backend == "cutile":
            require_cuda_tile({"the model's weights": self.lm_head.weight})
        for m in self.mixers:
            m.kernel_backend = backend
        return self

    @property
    def kernel_backend(self) -> str:
        """The mixers' backend (:meth:`set_kernel_backend`); "torch" for a model without Mamba layers."""
        got = {m.kernel_backend for m in self.mixers} or {"torch"}
        if len(got) != 1:
            raise ValueError(f"mixers run on different backends {sorted(got)}; use set_kernel_backend")
        return got.pop()

    @property
    def mixers(self) -> list[Mamba2Mixer]:
        """Every Mamba-2 mixer, in layer order (what the export patcher swaps ``scan_fn`` on)."""
        return [m for m in self.modules() if isinstance(m, Mamba2Mixer)]

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def zero_states(self, batch: int, *, past_len: int = 0, device: torch.device | str | None = None
                    ) -> list[torch.Tensor]:
        """The states of an empty sequence: zeros (attention caches with ``past_len`` positions, default 0)."""
        out = []
        for st in self.spec.states():
            shape = tuple(batch if d == BATCH else past_len if d == PAST else d for d in st.shape)
            out.append(torch.zeros(shape, dtype=torch.float32 if st.dtype == "float32" else self.dtype,
                                   device=device if device is not None else self.lm_head.weight.device))
        return out

    def forward_states(self, input_ids: torch.Tensor, past: list[torch.Tensor] | None = None) -> HybridOutput:
        """See the class docstring. Raises ValueError on a past list of the wrong length."""
        if past is None:
            past = self.zero_states(input_ids.shape[0])
        if len(past) != sum(self._n_states):
            raise ValueError(f"past: expected {sum(self._n_states)} state tensors (ModelSpec.states()), "
                             f"got {len(past)}")
        h, emb = self.embed(input_ids)
        shared = self.backbone.shared_blocks if self.spec.shared_blocks else None
        present: list[torch.Tensor] = []
        pos = 0
        for layer, n in zip(self.backbone.layers, self._n_states):
            h, new = layer(h, list(past[pos:pos + n]), emb, shared)
            present.extend(new)
            pos += n
        logits = self.head(h)
        return HybridOutput(logits, present)

    def embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, emb)`` of ``input_ids`` (batch, seqlen) int64: the residual stream entering layer 0 (float32
        under ``residual_in_fp32``, else the model dtype) and the scaled embeddings (Zamba2's shared blocks read
        them), both (batch, seqlen, d_model). :meth:`forward_states` is ``head(layers(embed(input_ids)))``."""
        h = self.backbone.embedding(input_ids)
        if self.spec.embedding_multiplier != 1.0:
            h = h * self.spec.embedding_multiplier
        return (_compute(h) if self.spec.residual_in_fp32 else h), h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seqlen, vocab_size) in the model dtype of the last layer's residual stream ``h``."""
        logits = self.lm_head(self.backbone.norm_f(h, out_dtype=self.lm_head.weight.dtype))
        if self.spec.logits_multiplier != 1.0:
            logits = logits * self.spec.logits_multiplier
        return logits

    def forward(self, input_ids: torch.Tensor, past: list[torch.Tensor] | None = None) -> HybridOutput:
        return self.forward_states(input_ids, past)

    @torch.no_grad()
    def generate_greedy(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy continuation through the state list: returns (batch, max_new_tokens) int64 new token ids."""
        out = self.forward_states(input_ids)
        tokens = []
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(max_new_tokens):
            tokens.append(nxt)
            if len(tokens) == max_new_tokens:
                break
            out = self.forward_states(nxt, out.states)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        return torch.cat(tokens, dim=1) if tokens else input_ids.new_zeros(input_ids.shape[0], 0)


class Mamba2Output(NamedTuple):
    """logits (batch, seqlen, vocab_size) in the model dtype; per-layer conv_states and ssm_states."""

    logits: torch.Tensor
    conv_states: list[torch.Tensor]
    ssm_states: list[torch.Tensor]


class Mamba2LMHeadModel(HybridLM):
    """Mamba-2 language model (mamba_ssm ``MambaLMHeadModel`` with Mamba2 mixers, no attention/MLP layers):
    the pure-Mamba case of :class:`HybridLM`, with the per-layer conv/ssm state lists of its own API."""

    def __init__(self, cfg: Mamba2Config):
        super().__init__(cfg.to_spec())
        self.cfg = cfg

    def forward(self, input_ids: torch.Tensor, conv_states: list[torch.Tensor] | None = None,
                ssm_states: list[torch.Tensor] | None = None) -> Mamba2Output:
        """Prefill (or continue) over ``input_ids`` (batch, seqlen) int64.

        Args:
            conv_states: per layer (batch, conv_dim, d_conv - 1), or None for a fresh sequence.
            ssm_states: per layer (batch, nheads, headdim, d_state) fp32, or None.
        Returns:
            Mamba2Output(logits, conv_states, ssm_states) after the last token.
        """
        if conv_states is None and ssm_states is None:
            past = None
        else:
            zero = self.zero_states(input_ids.shape[0])
            conv = conv_states if conv_states is not None else zero[0::2]
            ssm = ssm_states if ssm_states is not None else zero[1::2]
            past = [t for pair in zip(conv, ssm) for t in pair]
        out = self.forward_states(input_ids, past)
        return Mamba2Output(out.logits, out.states[0::2], out.states[1::2])

    def step(self, input_ids: torch.Tensor, conv_states: list[torch.Tensor],
             ssm_states: list[torch.Tensor]) -> Mamba2Output:
        """One decode step: ``input_ids`` (batch, 1); same as :meth:`forward` with seqlen 1 and states."""
        if input_ids.dim() != 2 or input_ids.shape[1] != 1:
            raise ValueError(f"step: input_ids must be (batch, 1), got {tuple(input_ids.shape)}")
        return self.forward(input_ids, conv_states, ssm_states)


@torch.no_grad()
def init_weights_(model: HybridLM, seed: int = 0, *, dt_min: float = 1e-3, dt_max: float = 0.1,
                  dt_init_floor: float = 1e-4, A_init_range: tuple[float, float] = (1.0, 16.0)) -> HybridLM:
    """Random initialisation following mamba_ssm (Mamba2.__init__ and mixer_seq_simple._init_weights).

    A_log = log(U[A_init_range]); dt = exp(U[log dt_min, log dt_max]) floored at dt_init_floor and
    dt_bias = dt + log(-expm1(-dt)) (inverse softplus); D = 1; embedding N(0, 0.02); Linear/conv1d
    weights and biases PyTorch's defaults (uniform +-1/sqrt(fan_in), fan_in of the layer's weight: d_conv for
    the depthwise conv1d); stacked expert weights the same per expert; router N(0, 0.02) with zero
    score-correction bias; every mixer's out_proj rescaled by 1/sqrt(n_layer) (GPT-2 prenorm-residual
    scheme); norms 1.

    Biases are random, not zero (mamba_ssm zeroes its Linear biases): a random checkpoint exercises every
    parameter, and a zero bias would hide a graph that drops or misplaces one. They are drawn last, so every
    other draw is that of earlier releases (for a pure-Mamba model); all of it is deterministic per ``seed``.
    """
    n_layer = model.spec.n_layer
    gen = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    biases = []  # (bias, its weight's fan_in)
    for name, p in params.items():
        if name.endswith(("experts_in", "experts_out")):
            bound = 1.0 / math.sqrt(p.shape[2])
            p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)
        elif p.dim() >= 2:
            bound = 1.0 / math.sqrt(p.shape[1] * (p.shape[2] if p.dim() > 2 else 1))
            p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)
        elif name.endswith(".bias"):
            w = params[name[:-len("bias")] + "weight"]
            biases.append((p, w.shape[1] * (w.shape[2] if w.dim() > 2 else 1)))
    nn.init.normal_(model.backbone.embedding.weight, std=0.02, generator=gen)
    for m in model.mixers:
        nh = m.spec.nheads
        dt = torch.exp(torch.rand(nh, generator=gen) * (math.log(dt_max) - math.log(dt_min))
                       + math.log(dt_min)).clamp(min=dt_init_floor)
        m.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        lo, hi = A_init_range
        m.A_log.copy_(torch.log(torch.empty(nh).uniform_(lo, hi, generator=gen)))
        m.D.fill_(1.0)
        m.out_proj.weight.div_(math.sqrt(n_layer))
        if hasattr(m, "norm"):
            m.norm.weight.fill_(1.0)
    for mod in model.modules():
        if isinstance(mod, Router):
            nn.init.normal_(mod.weight, std=0.02, generator=gen)
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.zero_()
        if isinstance(mod, RMSNorm) and mod is not None:
            mod.weight.fill_(1.0)
    for p, fan_in in biases:  # last: the draws above stay those of earlier releases
        p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) / math.sqrt(fan_in))
    return model
