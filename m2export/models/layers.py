"""Attention (explicit KV cache), MLP and MoE blocks of the hybrid models, in plain PyTorch.

Each module is built from its spec in :mod:`m2export.models.spec` and follows the transformers 5.24 code of
the families that use it (``transformers/models/{nemotron_h,granitemoehybrid,bamba}/modeling_*.py``); the
Mamba-2 mixer and the norms live in :mod:`m2export.models.mamba2`.

Internal parameter names (checkpoint names are mapped onto them in :mod:`m2export.models.weights`):
attention ``q_proj, k_proj, v_proj, o_proj``; MLP ``gate_proj, up_proj, down_proj`` (``gate_up_proj`` when
fused, gate rows first); MoE ``router.weight`` (n_experts, d_model) [+ ``router.e_score_correction_bias``],
``experts_in`` (n_experts, d_expert or 2 * d_expert, d_expert_in), ``experts_out`` (n_experts, d_expert_in,
d_expert), ``latent_in``/``latent_out`` (moe_latent_size), ``shared`` (an MLP).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from m2export.models.spec import AttentionSpec, MLPSpec, MoESpec, SharedBlockSpec


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """relu2 = relu(x)**2 (Nemotron-H ``ReLUSquaredActivation``), silu, gelu (exact erf form, HF ``gelu``)."""
    if name == "relu2":
        return torch.square(F.relu(x))
    if name == "silu":
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)
    raise ValueError(f"unknown activation {name!r}")


def rope_cos_sin(rotary_dim: int, theta: float, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin of shape (len(positions), rotary_dim), computed in fp32 and cast to ``dtype`` (HF default RoPE:
    ``inv_freq = 1 / theta ** (arange(0, rotary_dim, 2) / rotary_dim)``, frequencies repeated twice)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device)
                                / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (batch, heads, seq, head_dim): rotate the first cos.shape[-1] channels (rotate_half layout)."""
    rd = cos.shape[-1]
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
    rot = torch.cat([-x2, x1], dim=-1)
    out = xr * cos + rot * sin
    return torch.cat([out, xp], dim=-1) if xp.shape[-1] else out


class Attention(nn.Module):
    """Causal GQA self-attention over past + new tokens with an explicit KV cache.

    forward(x (batch, seqlen, d_in), past_key, past_value (batch, num_kv_heads, past_len, head_dim))
    -> (out (batch, seqlen, d_out), key, value (batch, num_kv_heads, past_len + seqlen, head_dim)).
    New token i sits at position past_len + i and sees cache positions <= its own. The cache holds keys after
    RoPE and key_multiplier. Scores in the model dtype, softmax in float32 (HF eager attention).
    """

    def __init__(self, spec: AttentionSpec):
        super().__init__()
        self.spec = spec
        s = spec
        self.q_proj = nn.Linear(s.d_in, s.num_heads * s.head_dim, bias=s.qkv_bias)
        self.k_proj = nn.Linear(s.d_in, s.num_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.v_proj = nn.Linear(s.d_in, s.num_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.d_out, bias=s.o_bias)

    def forward(self, x: torch.Tensor, past_key: torch.Tensor, past_value: torch.Tensor,
                adapters: "Adapters | None" = None):
        """``adapters``: a call site's q/k/v adapters (Zamba2), each added to its projection."""
        s = self.spec
        b, L, _ = x.shape
        if s.in_multiplier != 1.0:
            x = x * s.in_multiplier
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if adapters is not None and adapters.q is not None:
            q, k, v = q + adapters.q(x), k + adapters.k(x), v + adapters.v(x)
        q = q.view(b, L, s.num_heads, s.head_dim).transpose(1, 2)
        k = k.view(b, L, s.num_kv_heads, s.head_dim).transpose(1, 2)
        v = v.view(b, L, s.num_kv_heads, s.head_dim).transpose(1, 2)
        if s.key_multiplier != 1.0:
            k = k * s.key_multiplier
        past_len = past_key.shape[2]
        if s.rope is not None:
            pos = torch.arange(L, device=x.device) + past_len
            cos, sin = rope_cos_sin(s.rope.rotary_dim, s.rope.theta, pos, q.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        key = torch.cat([past_key.to(k.dtype), k], dim=2)
        value = torch.cat([past_value.to(v.dtype), v], dim=2)
        rep = s.num_heads // s.num_kv_heads
        kk, vv = key, value
        if rep > 1:
            S = key.shape[2]
            kk = key[:, :, None].expand(b, s.num_kv_heads, rep, S, s.head_dim).reshape(b, s.num_heads, S, s.head_dim)
            vv = value[:, :, None].expand(b, s.num_kv_heads, rep, S, s.head_dim).reshape(b, s.num_heads, S,
                                                                                         s.head_dim)
        scores = torch.matmul(q, kk.transpose(2, 3)) * s.scale  # (b, heads, L, past_len + L)
        i = torch.arange(L, device=x.device)[:, None] + past_len
        j = torch.arange(key.shape[2], device=x.device)[None, :]
        scores = scores.float().masked_fill(j > i, float("-inf"))  # mask before exp; the diagonal is never masked
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out = torch.matmul(probs, vv).transpose(1, 2).reshape(b, L, s.num_heads * s.head_dim)
        out = self.o_proj(out)
        if s.out_multiplier != 1.0:
            out = out * s.out_multiplier
        return out, key, value


class MLP(nn.Module):
    """gated: ``down(act(gate(x)) * up(x))``; not gated: ``down(act(up(x)))`` (shapes (..., d_model))."""

    def __init__(self, spec: MLPSpec):
        super().__init__()
        self.spec = s = spec
        if s.fused_gate_up:
            self.gate_up_proj = nn.Linear(s.d_model, 2 * s.d_ff, bias=s.bias)
        else:
            if s.gated:
                self.gate_proj = nn.Linear(s.d_model, s.d_ff, bias=s.bias)
            self.up_proj = nn.Linear(s.d_model, s.d_ff, bias=s.bias)
        self.down_proj = nn.Linear(s.d_ff, s.d_model, bias=s.bias)

    def forward(self, x: torch.Tensor, gate_up_adapter: nn.Module | None = None) -> torch.Tensor:
        """``gate_up_adapter``: a call site's adapter added to the fused gate_up projection (Zamba2)."""
        s = self.spec
        if s.fused_gate_up:
            gu = self.gate_up_proj(x)
            if gate_up_adapter is not None:
                gu = gu + gate_up_adapter(x)
            g, u = gu.chunk(2, dim=-1)
        elif s.gated:
            g, u = self.gate_proj(x), self.up_proj(x)
        else:
            return self.down_proj(activation(s.act, self.up_proj(x))) * s.down_multiplier
        if s.gate_multiplier != 1.0:
            g = g * s.gate_multiplier
        out = self.down_proj(activation(s.act, g) * u)
        return out * s.down_multiplier if s.down_multiplier != 1.0 else out


class LowRank(nn.Module):
    """``up(down(x))``, no bias: a call site's adapter of a shared block (Zamba2; parameters ``0.weight``
    (rank, d_in) and ``1.weight`` (d_out, rank), the layout of HF's nn.Sequential)."""

    def __init__(self, d_in: int, rank: int, d_out: int):
        super().__init__()
        self.add_module("0", nn.Linear(d_in, rank, bias=False))
        self.add_module("1", nn.Linear(rank, d_out, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._modules["1"](self._modules["0"](x))


class Adapters(nn.Module):
    """One call site's adapters of a shared block: ``q``, ``k``, ``v`` (attention) and ``gate_up`` (MLP),
    each a :class:`LowRank` or None."""

    def __init__(self, d_attn_in: int, q_out: int, kv_out: int, d_mlp_in: int, gate_up_out: int, rank: int,
                 attention: bool, mlp: bool):
        super().__init__()
        self.q = LowRank(d_attn_in, rank, q_out) if attention else None
        self.k = LowRank(d_attn_in, rank, kv_out) if attention else None
        self.v = LowRank(d_attn_in, rank, kv_out) if attention else None
        self.gate_up = LowRank(d_mlp_in, rank, gate_up_out) if mlp else None


class Router(nn.Module):
    """Top-k routing of :class:`~m2export.models.spec.MoESpec` (see there for both rules), in float32 for
    every model dtype: the loader keeps ``weight`` float32, and a model cast afterwards (``.half()``) still
    routes in float32."""

    def __init__(self, spec: MoESpec):
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.zeros(spec.n_experts, spec.d_model))
        if spec.score_correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(spec.n_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (tokens, d_model) -> (weights (tokens, top_k) float32, expert indices (tokens, top_k) int64)."""
        s = self.spec
        logits = F.linear(x.float(), self.weight.float())  # float32 whatever the model dtype (MoESpec)
        if s.routing == "softmax_topk":
            top, idx = logits.topk(s.top_k, dim=-1)
            return torch.softmax(top, dim=-1), idx
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float() if s.score_correction_bias else scores
        T = choice.shape[0]
        if s.n_group > 1:
            per = s.n_experts // s.n_group
            group_scores = choice.view(T, s.n_group, per).topk(2, dim=-1).values.sum(-1)
            gidx = group_scores.topk(s.topk_group, dim=-1).indices
            gmask = torch.zeros_like(group_scores).scatter(1, gidx, 1.0)
            emask = gmask[:, :, None].expand(T, s.n_group, per).reshape(T, s.n_experts)
            choice = choice.masked_fill(emask == 0, float("-inf"))
        idx = choice.topk(s.top_k, dim=-1).indices
        return self.weights_for(logits, idx), idx

    def weights_for(self, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The routing weights (tokens, top_k) float32 of experts ``idx`` given the router's float32 ``logits``
        (tokens, n_experts): what :meth:`forward` returns beside its own choice (``check`` also asks for another
        choice's, m2export.check.routing)."""
        s = self.spec
        if s.routing == "softmax_topk":
            return torch.softmax(logits.gather(1, idx), dim=-1)
        w = logits.sigmoid().gather(1, idx)
        if s.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * s.routed_scaling_factor


class MoE(nn.Module):
    """Routed experts + optional shared MLP: x (batch, seqlen, d_model) -> same shape.

    ``impl`` chooses how the experts run, all with the same result up to summation order:
    ``"loop"`` (eager default: each expert on its own tokens, like transformers), ``"dense"`` (every expert on
    every token, weighted by the sparse top-k weights: static shapes, exact, for small expert counts) and
    ``"gather"`` (each token's top-k expert weights gathered: static shapes, memory tokens*top_k*expert size).
    """

    IMPLS = ("loop", "dense", "gather")

    def __init__(self, spec: MoESpec):
        super().__init__()
        self.spec = s = spec
        self.impl = "loop"
        self.router = Router(spec)
        d_in = s.d_expert_in
        self.experts_in = nn.Parameter(torch.zeros(s.n_experts, (2 if s.gated else 1) * s.d_expert, d_in))
        self.experts_out = nn.Parameter(torch.zeros(s.n_experts, d_in, s.d_expert))
        if s.latent_size is not None:
            self.latent_in = nn.Linear(s.d_model, s.latent_size, bias=s.bias)
            self.latent_out = nn.Linear(s.latent_size, s.d_model, bias=s.bias)
        self.shared = MLP(s.shared) if s.shared is not None else None

    def _expert_act(self, h: torch.Tensor) -> torch.Tensor:
        s = self.spec
        if s.gated:
            g, u = h.chunk(2, dim=-1)
            return activation(s.act, g) * u
        return activation(s.act, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        w, idx = self.router(flat)  # (T, k) float32, int64
        xin = self.latent_in(flat) if s.latent_size is not None else flat
        if self.impl == "loop":
            out = torch.zeros(xin.shape, dtype=torch.float32, device=x.device)
            for e in torch.unique(idx).tolist():
                tok, slot = torch.where(idx == e)
                h = self._expert_act(F.linear(xin[tok], self.experts_in[e]))
                y = F.linear(h, self.experts_out[e])
                out.index_add_(0, tok, y.float() * w[tok, slot, None])
        elif self.impl == "dense":
            dense_w = torch.zeros(flat.shape[0], s.n_experts, dtype=torch.float32, device=x.device).scatter(1, idx, w)
            h = self._expert_act(torch.einsum("td,eid->tei", xin, self.experts_in))
            y = torch.einsum("tei,edi->ted", h, self.experts_out)
            out = (y.float() * dense_w[:, :, None]).sum(1)
        elif self.impl == "gather":
            h = self._expert_act(torch.einsum("td,tkid->tki", xin, self.experts_in[idx]))
            y = torch.einsum("tki,tkdi->tkd", h, self.experts_out[idx])
            out = (y.float() * w[:, :, None]).sum(1)
        else:
            raise ValueError(f"MoE.impl must be one of {self.IMPLS}, got {self.impl!r}")
        out = out.to(x.dtype)
        if s.latent_size is not None:
            out = self.latent_out(out)
        out = out.reshape(shape)
        if self.shared is not None:
            out = out + self.shared(x)
        return out


class SharedBlock(nn.Module):
    """A Zamba2 shared transformer block (:class:`~m2export.models.spec.SharedBlockSpec`), weights stored once:
    ``forward(h, emb, past_key, past_value, adapters)`` -> (out (batch, seqlen, d_model), key, value)."""

    def __init__(self, spec: SharedBlockSpec):
        super().__init__()
        from m2export.models.mamba2 import RMSNorm

        self.spec = spec
        self.norm = RMSNorm(spec.attention.d_in, eps=spec.norm_epsilon)
        self.attention = Attention(spec.attention)
        self.ffn_norm = RMSNorm(spec.mlp.d_model, eps=spec.norm_epsilon)
        self.mlp = MLP(spec.mlp)

    def adapters(self) -> Adapters | None:
        """A new call site's adapters for this block (None without adapter_rank)."""
        s = self.spec
        if s.adapter_rank is None:
            return None
        a = s.attention
        return Adapters(a.d_in, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, s.mlp.d_model,
                        2 * s.mlp.d_ff, s.adapter_rank, s.attention_adapter, s.mlp_adapter)

    def forward(self, h, emb, past_key, past_value, adapters: Adapters | None = None):
        x = self.norm(torch.cat([h, emb.to(h.dtype)], dim=-1), out_dtype=self.norm.weight.dtype)
        a, key, value = self.attention(x, past_key, past_value, adapters)
        y = self.ffn_norm(a, out_dtype=self.ffn_norm.weight.dtype)
        return self.mlp(y, adapters.gate_up if adapters is not None else None), key, value
