"""Mamba-2 in plain PyTorch: the reference model every export is compared against.

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

from m2export.kernels.ssd.naive import ssm_scan_chunked
from m2export.models.config import Mamba2Config

ScanFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""Signature of an SSMScan implementation: ``fn(x, dt, A, B, C, D, dt_bias, initial_state, *, chunk_size,
dt_softplus, dt_limit) -> (y, final_state)`` (see m2export.contract)."""


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32, returned in ``out_dtype`` (default weight dtype)."""

    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return y.to(out_dtype or self.weight.dtype)


class RMSNormGated(nn.Module):
    """Gated RMSNorm of mamba_ssm (norm_before_gate=False), normalised per group of ``group_size`` channels:

        y = rmsnorm_per_group(x * silu(z)) * weight

    Source: mamba_ssm/ops/triton/layernorm_gated.py (``rmsnorm_fn`` with group_size = d_inner // ngroups).
    HF transformers' MambaRMSNormGated normalises over all channels, which equals this only for ngroups=1.
    """

    def __init__(self, d: int, group_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps, self.group_size = eps, group_size
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float() * F.silu(z.float())
        shp = xf.shape
        g = xf.reshape(*shp[:-1], shp[-1] // self.group_size, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return (g.reshape(shp) * self.weight.float()).to(x.dtype)


class Mamba2Mixer(nn.Module):
    """One Mamba-2 mixer (mamba_ssm ``Mamba2`` with d_mlp = 0). ``scan_fn`` is the SSMScan implementation."""

    def __init__(self, cfg: Mamba2Config, layer_idx: int):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        self.in_proj = nn.Linear(cfg.d_model, cfg.d_in_proj, bias=cfg.bias)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.d_conv, groups=cfg.conv_dim, bias=cfg.conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(cfg.nheads))
        self.A_log = nn.Parameter(torch.zeros(cfg.nheads))
        self.D = nn.Parameter(torch.ones(cfg.nheads))
        self.norm = RMSNormGated(cfg.d_inner, group_size=cfg.d_inner // cfg.ngroups, eps=cfg.gated_norm_epsilon)
        self.out_proj = nn.Linear(cfg.d_inner, cfg.d_model, bias=cfg.bias)
        self.scan_fn: ScanFn = ssm_scan_chunked

    def forward(self, u: torch.Tensor, conv_state: torch.Tensor | None = None,
                ssm_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """u: (batch, seqlen, d_model). Returns (out (batch, seqlen, d_model), conv_state, ssm_state)."""
        cfg = self.cfg
        batch, seqlen, _ = u.shape
        zxbcdt = self.in_proj(u)
        z, xBC, dt = torch.split(zxbcdt, [cfg.d_inner, cfg.conv_dim, cfg.nheads], dim=-1)
        xBC = xBC.transpose(1, 2)  # (batch, conv_dim, seqlen)
        if conv_state is None:
            conv_state = xBC.new_zeros(batch, cfg.conv_dim, cfg.d_conv - 1)
        xpad = torch.cat([conv_state.to(xBC.dtype), xBC], dim=2)  # (batch, conv_dim, d_conv - 1 + seqlen)
        new_conv_state = xpad[:, :, xpad.shape[2] - (cfg.d_conv - 1):]
        xBC = F.silu(F.conv1d(xpad, self.conv1d.weight, self.conv1d.bias, groups=cfg.conv_dim)).transpose(1, 2)
        x, B, C = torch.split(xBC, [cfg.d_inner, cfg.ngroups * cfg.d_state, cfg.ngroups * cfg.d_state], dim=-1)
        A = -torch.exp(self.A_log.float())  # fp32: A_log in bf16 would lose the decay's precision
        y, new_ssm_state = self.scan_fn(
            x.reshape(batch, seqlen, cfg.nheads, cfg.headdim), dt,
            A, B.reshape(batch, seqlen, cfg.ngroups, cfg.d_state), C.reshape(batch, seqlen, cfg.ngroups, cfg.d_state),
            self.D.float(), self.dt_bias.float(), None if ssm_state is None else ssm_state.float(),
            chunk_size=cfg.chunk_size, dt_softplus=True, dt_limit=cfg.dt_limit)
        y = self.norm(y.reshape(batch, seqlen, cfg.d_inner), z)
        return self.out_proj(y), new_conv_state, new_ssm_state


class Block(nn.Module):
    """Pre-norm residual block: residual += hidden; hidden = mixer(norm(residual))."""

    def __init__(self, cfg: Mamba2Config, layer_idx: int):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_epsilon)
        self.mixer = Mamba2Mixer(cfg, layer_idx)
        self.residual_in_fp32 = cfg.residual_in_fp32

    def forward(self, hidden, residual, conv_state=None, ssm_state=None):
        residual = hidden if residual is None else residual + hidden
        if self.residual_in_fp32:
            residual = residual.float()
        hidden = self.norm(residual, out_dtype=self.norm.weight.dtype)
        hidden, conv_state, ssm_state = self.mixer(hidden, conv_state, ssm_state)
        return hidden, residual, conv_state, ssm_state


class Mamba2Output(NamedTuple):
    """logits (batch, seqlen, vocab_size_padded) in the model dtype; per-layer conv_states and ssm_states."""

    logits: torch.Tensor
    conv_states: list[torch.Tensor]
    ssm_states: list[torch.Tensor]


class Mamba2LMHeadModel(nn.Module):
    """Mamba-2 language model (mamba_ssm ``MambaLMHeadModel`` with Mamba2 mixers, no attention/MLP layers)."""

    def __init__(self, cfg: Mamba2Config):
        super().__init__()
        self.cfg = cfg
        self.backbone = nn.Module()
        self.backbone.embedding = nn.Embedding(cfg.vocab_size_padded, cfg.d_model)
        self.backbone.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.backbone.norm_f = RMSNorm(cfg.d_model, eps=cfg.norm_epsilon)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size_padded, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.backbone.embedding.weight

    @property
    def mixers(self) -> list[Mamba2Mixer]:
        return [blk.mixer for blk in self.backbone.layers]

    def forward(self, input_ids: torch.Tensor, conv_states: list[torch.Tensor] | None = None,
                ssm_states: list[torch.Tensor] | None = None) -> Mamba2Output:
        """Prefill (or continue) over ``input_ids`` (batch, seqlen) int64.

        Args:
            conv_states: per layer (batch, conv_dim, d_conv - 1), or None for a fresh sequence.
            ssm_states: per layer (batch, nheads, headdim, d_state) fp32, or None.
        Returns:
            Mamba2Output(logits, conv_states, ssm_states) after the last token.
        """
        hidden = self.backbone.embedding(input_ids)
        residual = None
        new_conv, new_ssm = [], []
        for i, blk in enumerate(self.backbone.layers):
            hidden, residual, cs, ss = blk(hidden, residual,
                                           None if conv_states is None else conv_states[i],
                                           None if ssm_states is None else ssm_states[i])
            new_conv.append(cs)
            new_ssm.append(ss)
        residual = hidden if residual is None else residual + hidden
        hidden = self.backbone.norm_f(residual, out_dtype=self.lm_head.weight.dtype)
        return Mamba2Output(self.lm_head(hidden), new_conv, new_ssm)

    def step(self, input_ids: torch.Tensor, conv_states: list[torch.Tensor],
             ssm_states: list[torch.Tensor]) -> Mamba2Output:
        """One decode step: ``input_ids`` (batch, 1); same as :meth:`forward` with seqlen 1 and states."""
        if input_ids.dim() != 2 or input_ids.shape[1] != 1:
            raise ValueError(f"step: input_ids must be (batch, 1), got {tuple(input_ids.shape)}")
        return self.forward(input_ids, conv_states, ssm_states)

    @torch.no_grad()
    def generate_greedy(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy continuation: returns (batch, max_new_tokens) int64 new token ids."""
        out = self.forward(input_ids)
        tokens = []
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(max_new_tokens):
            tokens.append(nxt)
            if len(tokens) == max_new_tokens:
                break
            out = self.step(nxt, out.conv_states, out.ssm_states)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        return torch.cat(tokens, dim=1) if tokens else input_ids.new_zeros(input_ids.shape[0], 0)


@torch.no_grad()
def init_weights_(model: Mamba2LMHeadModel, seed: int = 0, *, dt_min: float = 1e-3, dt_max: float = 0.1,
                  dt_init_floor: float = 1e-4, A_init_range: tuple[float, float] = (1.0, 16.0)) -> Mamba2LMHeadModel:
    """Random initialisation following mamba_ssm (Mamba2.__init__ and mixer_seq_simple._init_weights).

    A_log = log(U[A_init_range]); dt = exp(U[log dt_min, log dt_max]) floored at dt_init_floor and
    dt_bias = dt + log(-expm1(-dt)) (inverse softplus); D = 1; embedding N(0, 0.02); Linear/conv1d
    PyTorch defaults; out_proj rescaled by 1/sqrt(n_layer) (GPT-2 prenorm-residual scheme).
    """
    cfg = model.cfg
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            bound = 1.0 / math.sqrt(p.shape[1] * (p.shape[2] if p.dim() > 2 else 1))
            p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)
        elif name.endswith("bias"):
            p.zero_()
    nn.init.normal_(model.backbone.embedding.weight, std=0.02, generator=gen)
    for m in model.mixers:
        dt = torch.exp(torch.rand(cfg.nheads, generator=gen) * (math.log(dt_max) - math.log(dt_min))
                       + math.log(dt_min)).clamp(min=dt_init_floor)
        m.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        lo, hi = A_init_range
        m.A_log.copy_(torch.log(torch.empty(cfg.nheads).uniform_(lo, hi, generator=gen)))
        m.D.fill_(1.0)
        m.out_proj.weight.div_(math.sqrt(cfg.n_layer))
        m.norm.weight.fill_(1.0)
    for blk in model.backbone.layers:
        blk.norm.weight.fill_(1.0)
    model.backbone.norm_f.weight.fill_(1.0)
    return model
