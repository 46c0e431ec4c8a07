"""MoE routing flips: a failed prefill comparison of a model with MoE layers, explained (or not) by a top-k routing
decision that was a near tie.

The exported graph routes as the reference does (:class:`~m2export.models.layers.Router`: float32 router weight,
logits, sigmoid/softmax, groups and top-k on the block's input cast to float32), but a reduced-precision graph
(fp16, bf16) computes that input from its own rounded activations and weights, the reference from float32 ones.
Where two experts' (or two expert groups') scores nearly tie, the graph can pick the runner-up: that token gets
other experts' output, an error of the order of the logits themselves, while every other token agrees
(tiny-nemotron-h seed 0, fp16, ONNX Runtime CPU: token 14 of row 0 of the fresh 2x17 input, layer 5's group scores
0.9850068 vs 0.9850014, logits max abs 0.89; the reference routed the graph's way: 2.2e-3).

:func:`diagnose` asks the reference itself, never the graph (any runtime, TensorRT too): at the first token whose
logits fail it tries that token's routing decisions (every MoE layer) nearest to a tie first, each flipped to its
runner-up in a rerun of the reference on the same feed, and keeps a flip only if that token then passes with
nothing before it in its row failing; then on to the next failing token (at most :data:`MAX_FLIPS` flips and
:data:`MAX_RERUNS` reruns; only margins within :data:`NEAR_TIE` of the dtype). The failure is *explained* only when
the reference so rerouted passes every output of that feed at the same tolerances. Nothing passes for it: the
comparison stays a failure, and the report names each flipped token, its experts and its margin. A graph that
misroutes only at near ties would look the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

#: at most this many routing decisions flipped per failed feed, and this many reruns of the reference tried
MAX_FLIPS = 4
MAX_RERUNS = 8
#: largest relative score margin (hi - lo) / max(|hi|, |lo|) counted as a near tie, per export dtype: 4 epsilons of
#: fp16 / bf16 (9.8e-4 / 7.8e-3), and for fp32 what summation order can move a score; a decision farther apart is
#: never flipped, and the failure stays unexplained. The margin of each flip is reported (tiny-nemotron-h: 5.4e-6)
NEAR_TIE = {"fp32": 1e-5, "fp16": 4e-3, "bf16": 3e-2}


@dataclass
class Flip:
    """One routing decision of the reference flipped to its runner-up."""

    layer: str  # the MoE block's module name, e.g. "layers.5.mixer"
    batch: int
    position: int
    kind: str  # "expert" (the k-th and (k+1)-th experts) or "group" (the chosen groups' last and the next group)
    reference: list[int]  # the experts the reference chose (sorted)
    flipped: list[int]  # the runner-up choice (sorted)
    scores: list[float]  # the two tied scores, the reference's winner first (float32 router scores)
    margin: float  # relative: (hi - lo) / max(|hi|, |lo|)

    def describe(self) -> str:
        hi, lo = self.scores
        return (f"{self.layer} (batch {self.batch}, position {self.position}): experts {self.reference} -> "
                f"{self.flipped} ({self.kind} scores {hi:.7g} vs {lo:.7g}, relative margin {self.margin:.1e})")


@dataclass
class Diagnosis:
    """What :func:`diagnose` found for one failed feed of one runtime."""

    runner: str
    feed: str  # the feed's label, e.g. "2x17"
    explained: bool
    flips: list[Flip] = field(default_factory=list)
    max_abs: float = float("nan")  # the logits' max abs error against the rerouted reference
    reason: str = ""  # why not explained

    def describe(self) -> str:
        if self.explained:
            n = len(self.flips)
            return (f"{self.feed} {self.runner}: explained by {n} MoE routing flip{'s' * (n != 1)} at a near tie: "
                    + "; ".join(f.describe() for f in self.flips)
                    + f"; the reference routed so matches every output (logits max abs {self.max_abs:.2e})")
        return f"{self.feed} {self.runner}: not explained by an MoE routing flip: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def moe_routers(model) -> list[tuple[str, Any]]:
    """(MoE block name, its Router) of every MoE layer of ``model``, in forward order."""
    from m2export.models.layers import Router

    return [(name.removesuffix(".router"), m) for name, m in model.named_modules() if isinstance(m, Router)]


def runner_up(spec, logits, bias=None) -> tuple[str, list[int], list[int], float, float] | None:
    """The nearest other routing decision of one token: (kind, chosen experts, runner-up experts, hi, lo), hi/lo the
    two scores whose order decides between them; None where there is no other choice. ``logits``: the token's
    float32 router logits (n_experts,), numpy; ``bias``: e_score_correction_bias or None. Follows
    :class:`~m2export.models.layers.Router` (MoESpec's rules); ties are broken by the lower index."""
    k = spec.top_k
    logits = np.asarray(logits, dtype=np.float32)
    if spec.routing == "softmax_topk":
        order = np.argsort(-logits, kind="stable")
        if len(order) <= k:
            return None
        return ("expert", sorted(order[:k].tolist()), sorted(order[:k - 1].tolist() + [int(order[k])]),
                float(logits[order[k - 1]]), float(logits[order[k]]))
    choice = np.float32(1) / (np.float32(1) + np.exp(-logits))
    if bias is not None:
        choice = choice + np.asarray(bias, dtype=np.float32)
    G, per = spec.n_group, spec.n_experts // spec.n_group

    def experts_in(groups) -> np.ndarray:
        allowed = np.full_like(choice, -np.inf)
        for g in groups:
            allowed[g * per:(g + 1) * per] = choice[g * per:(g + 1) * per]
        return allowed

    def top(allowed) -> np.ndarray:
        return np.argsort(-allowed, kind="stable")

    cands = []
    groups = list(range(G))
    if G > 1:
        gscore = np.sort(choice.reshape(G, per), axis=1)[:, ::-1][:, :2].sum(1)
        gorder = np.argsort(-gscore, kind="stable")
        groups = gorder[:spec.topk_group].tolist()
        if spec.topk_group < G:
            alt_groups = groups[:-1] + [int(gorder[spec.topk_group])]
            cands.append(("group", top(experts_in(alt_groups))[:k].tolist(),
                          float(gscore[gorder[spec.topk_group - 1]]), float(gscore[gorder[spec.topk_group]])))
    allowed = experts_in(groups)
    order = top(allowed)
    chosen = order[:k].tolist()
    if len(groups) * per > k:
        cands.append(("expert", chosen[:-1] + [int(order[k])], float(allowed[order[k - 1]]),
                      float(allowed[order[k]])))
    if not cands:
        return None
    kind, alt, hi, lo = min(cands, key=lambda c: _margin(c[2], c[3]))
    return kind, sorted(chosen), sorted(alt), hi, lo


def _margin(hi: float, lo: float) -> float:
    scale = max(abs(hi), abs(lo))
    return (hi - lo) / scale if scale > 0 else 0.0


def _failing_tokens(out: np.ndarray, ref: np.ndarray, atol: float, rtol: float) -> np.ndarray:
    """(batch, seqlen) bool: a logit of that token fails the elementwise rule (abs > atol and rel > rtol, NaN fails)."""
    a, b = out.astype(np.float64), ref.astype(np.float64)
    absd = np.abs(a - b)
    reld = absd / np.where(b == 0, 1e-9, np.abs(b))
    bad = (np.isnan(absd) | (absd > atol)) & (np.isnan(reld) | (reld > rtol))
    return bad.reshape(bad.shape[0], bad.shape[1], -1).any(-1)


def diagnose(model, rerun: Callable[[], Any], runtime_it, compare, *, runner: str, feed: str, dtype: str,
             atol: float, rtol: float, max_flips: int = MAX_FLIPS) -> Diagnosis | None:
    """Explain a failed prefill feed by routing flips (module docstring); None for a model without MoE layers.

    Args:
        model: the reference's model (its Routers get forward hooks while this runs; removed after).
        rerun: runs the reference on the failed feed, returning its outputs (Polygraphy IterationResult).
        runtime_it: the runtime's outputs of that feed (IterationResult, ``logits`` (batch, seqlen, vocab)).
        compare: the check's compare function, ``compare(runtime_it, reference_it)`` -> {output: result}.
        atol, rtol: the logits' tolerances (to find the first failing token).
    """
    import torch
    import torch.nn.functional as F

    routers = moe_routers(model)
    if not routers:
        return None
    seqlen = int(np.asarray(runtime_it["logits"]).shape[1])
    forced: dict[str, dict[int, list[int]]] = {}
    seen: dict[str, np.ndarray] = {}  # the last run's float32 router logits (tokens, n_experts) per MoE block

    def hook_for(name):
        def hook(mod, args, out):
            logits = F.linear(args[0].float(), mod.weight.float())
            seen[name] = logits.detach().cpu().numpy()
            if name not in forced:
                return None
            idx = out[1].clone()
            for tok, alt in forced[name].items():
                idx[tok] = torch.as_tensor(alt, dtype=idx.dtype, device=idx.device)
            return mod.weights_for(logits, idx), idx
        return hook

    handles = [r.register_forward_hook(hook_for(name)) for name, r in routers]
    flips: list[Flip] = []
    diag = Diagnosis(runner=runner, feed=feed, explained=False)
    limit = NEAR_TIE.get(dtype, NEAR_TIE["fp32"])
    out_logits = np.asarray(runtime_it["logits"])

    def run():
        ref = rerun()
        return ref, dict(seen), _failing_tokens(out_logits, np.asarray(ref["logits"]), atol, rtol)

    try:
        ref, now, bad = run()
        reruns = 0
        while bad.any():
            b, t = (int(v) for v in min(zip(*np.nonzero(bad)), key=lambda bt: (bt[1], bt[0])))
            tok, where = b * seqlen + t, f"batch {b}, position {t}"
            cands = []
            for name, r in routers:
                if tok in forced.get(name, {}) or name not in now:
                    continue
                bias = getattr(r, "e_score_correction_bias", None)
                got = runner_up(r.spec, now[name][tok], None if bias is None else bias.detach().cpu().numpy())
                if got is not None:
                    cands.append((_margin(*got[3:]), name, got))
            cands.sort(key=lambda c: c[0])
            near = [c for c in cands if c[0] <= limit]
            if not near:
                diag.reason = (f"no near tie at the first failing token ({where})" + (
                    f": its closest routing decision, {cands[0][1]} {cands[0][2][0]} scores {cands[0][2][3]:.7g} vs "
                    f"{cands[0][2][4]:.7g}, has relative margin {cands[0][0]:.1e} > {limit:.0e}" if cands else ""))
                break
            if len(flips) == max_flips:
                diag.reason = f"more than {max_flips} near-tie routing flips would be needed"
                break
            fixed = False
            for m, name, (kind, chosen, alt, hi, lo) in near:
                if reruns == MAX_RERUNS:
                    break
                forced.setdefault(name, {})[tok] = alt
                new_ref, new_now, new_bad = run()
                reruns += 1
                if not new_bad[b, :t + 1].any():  # that token passes now, and nothing before it in its row broke
                    flips.append(Flip(name, b, t, kind, chosen, alt, [hi, lo], m))
                    ref, now, bad, fixed = new_ref, new_now, new_bad, True
                    break
                del forced[name][tok]
            if not fixed:
                diag.reason = (f"no near-tie routing flip at the first failing token ({where}) makes it pass "
                               f"({len(near)} near tie(s) there, {reruns} reruns of the reference)")
                break
        else:
            failed = [name for name, res in compare(runtime_it, ref).items() if not bool(res)]
            if not flips:
                diag.reason = "the logits pass when the reference is rerun on this input"
            elif failed:
                diag.reason = f"with {len(flips)} flip(s) the logits match but {', '.join(failed[:3])} still fail"
            else:
                diag.explained = True
                diag.max_abs = float(np.nanmax(np.abs(out_logits.astype(np.float64)
                                                      - np.asarray(ref["logits"], dtype=np.float64))))
    finally:
        for h in handles:
            h.remove()
    diag.flips = flips
    return diag
