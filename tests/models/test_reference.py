"""The float64 forward (m2export/models/reference.py): every op in float64, the scan the float64 recurrence.

What each test would catch: the norms computed in float32 inside a float64 model (their error, ~1e-8, is far
above float64's 1e-16), a float32 ``A``/``D``/``dt_bias`` or scan input (the oracle used to take fp32 inputs
only), and a float64 forward that is not self-consistent at float64 precision (a prefill split through the
states equal to one call within 1e-12; any float32 rounding on the way gives ~1e-7).
"""

from __future__ import annotations

import pytest
import torch

from m2export.models.mamba2 import RMSNorm, RMSNormGated


def _rms64(x, w, eps, group):
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    return (g / torch.sqrt((g * g).mean(-1, keepdim=True) + eps)).reshape(x.shape) * w


@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_norms_compute_in_float64_for_float64_inputs(norm_before_gate):
    gen = torch.Generator().manual_seed(0)
    x, z = (torch.randn(2, 7, 48, dtype=torch.float64, generator=gen) for _ in range(2))
    n = RMSNorm(48, eps=1e-5).double()
    n.weight.data = torch.rand(48, dtype=torch.float64, generator=gen) + 0.5
    got = n(x, out_dtype=torch.float64)
    assert got.dtype == torch.float64
    assert (got - _rms64(x, n.weight, 1e-5, 48)).abs().max() < 1e-14
    g = RMSNormGated(48, group_size=12, eps=1e-6, norm_before_gate=norm_before_gate).double()
    g.weight.data = n.weight.data.clone()
    silu = z / (1 + torch.exp(-z))
    ref = _rms64(x, g.weight, 1e-6, 12) * silu if norm_before_gate else _rms64(x * silu, g.weight, 1e-6, 12)
    got = g(x, z)
    assert got.dtype == torch.float64 and (got - ref).abs().max() < 1e-14
    # float32 inputs still compute in float32 (the model's own semantics are unchanged)
    assert g(x.float(), z.float()).dtype == torch.float32


def test_oracle_takes_float64_inputs_unrounded():
    from m2export.errors import ContractError
    from m2export.kernels.ssd.naive import ssm_scan_recurrent

    gen = torch.Generator().manual_seed(1)
    b, L, h, p, g, n = 2, 9, 4, 8, 2, 16
    x = torch.randn(b, L, h, p, dtype=torch.float64, generator=gen)
    dt = torch.randn(b, L, h, dtype=torch.float64, generator=gen)
    B, C = (torch.randn(b, L, g, n, dtype=torch.float64, generator=gen) for _ in range(2))
    A = -torch.rand(h, dtype=torch.float64, generator=gen) - 0.1
    D, bias = torch.randn(h, dtype=torch.float64, generator=gen), torch.randn(h, dtype=torch.float64, generator=gen)
    s0 = torch.randn(b, h, p, n, dtype=torch.float64, generator=gen)
    y, s = ssm_scan_recurrent(x, dt, A, B, C, D, bias, s0)
    # by hand, one step at a time in float64
    delta = torch.nn.functional.softplus(dt + bias)
    Bh, Ch = B.repeat_interleave(h // g, 2), C.repeat_interleave(h // g, 2)
    st = s0.clone()
    for t in range(L):
        st = torch.exp(delta[:, t] * A)[..., None, None] * st \
            + (delta[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]
        yt = torch.einsum("bhpn,bhn->bhp", st, Ch[:, t]) + D[:, None] * x[:, t]
        assert (y[:, t] - yt).abs().max() < 1e-12
    assert (s - st).abs().max() < 1e-12
    # rounding the inputs to float32 changes the answer far above float64's precision: nothing was rounded
    y32 = ssm_scan_recurrent(x.float(), dt.float(), A.float(), B.float(), C.float(), D.float(), bias.float(),
                             s0.float())[0]
    assert (y32 - y).abs().max() > 1e-9
    with pytest.raises(ContractError, match="x"):  # shapes are still checked
        ssm_scan_recurrent(x[..., :-1, :], dt, A, B, C, D, bias, s0)


def test_float64_model_is_float64_throughout(tmp_path):
    from m2export.models.checkpoint import load_checkpoint, random_checkpoint
    from m2export.models.reference import float64_model

    ck = tmp_path / "ck"
    random_checkpoint(ck, seed=5, d_model=64, n_layer=2, vocab_size=97, d_state=16, headdim=16, ngroups=2,
                      chunk_size=8)
    model = float64_model(ck)
    seen = []
    for m in model.mixers:
        inner = m.scan_fn

        def spy(*a, _inner=inner, **k):
            seen.append({t.dtype for t in a[:7] if t is not None})
            return _inner(*a, **k)

        m.scan_fn = spy
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits
        first = model.forward_states(ids[:, :8])
        rest = model.forward_states(ids[:, 8:], list(first.states))
        lg32 = load_checkpoint(ck).model.eval()(ids).logits
    assert seen and all(s == {torch.float64} for s in seen)  # x, dt, A, B, C, D, dt_bias
    assert full.dtype == torch.float64
    split = torch.cat([first.logits, rest.logits], dim=1)
    assert (split - full).abs().max() / full.abs().max() < 1e-12
    err = ((lg32.double() - full).norm() / full.norm()).item()
    assert 1e-9 < err < 1e-4, err  # the float32 model: its own rounding, nothing more
