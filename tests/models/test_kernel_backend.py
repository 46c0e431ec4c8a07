"""The PyTorch model's kernel backend (issue 18 item 4): ``HybridLM.set_kernel_backend``.

CPU: "torch" is today's model bit for bit (and never touches the kernel entry points); "cutile" without CUDA or
cuda.tile is one clean BackendUnavailable; the cutile branch's argument mapping (conv weights and state, the
one-token update, the scan's inputs, the norm's group size and order) checked on the CPU by pointing the kernels'
entry points at their torch backends. GPU-marked (run by the lead on the H200): logits with the cuTile kernels vs
the torch model in fp32 on the CPU, on the bundled checkpoint and a tiny hybrid (Bamba: attention + Mamba), fp32 and
bf16, prefill and prefill + one-token steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from m2export.errors import BackendUnavailable, ContractError
from m2export.models.checkpoint import load_checkpoint, random_checkpoint
from tests.helpers import assert_close, kernel_entry_points, requires_cutile

BUNDLED = Path(__file__).resolve().parents[2] / "samples" / "checkpoints" / "stdlib-byte-mamba2"


def _ids(vocab, batch=2, L=37, seed=0):
    return torch.randint(0, vocab, (batch, L), generator=torch.Generator().manual_seed(seed))


def _logits_and_split(model, ids, n_prefill):
    """Logits of one prefill, and of a prefill of ``n_prefill`` tokens then one-token steps through the states."""
    with torch.no_grad():
        full = model.forward_states(ids)
        out = model.forward_states(ids[:, :n_prefill])
        pieces, past = [out.logits], out.states
        for t in range(n_prefill, ids.shape[1]):
            o = model.forward_states(ids[:, t:t + 1], past)
            pieces.append(o.logits)
            past = o.states
    return full, torch.cat(pieces, dim=1), past


def test_torch_backend_is_the_model_bit_for_bit(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("backend='torch' called a kernel entry point")

    for mod, name in kernel_entry_points():
        monkeypatch.setattr(mod, name, refuse)
    plain = load_checkpoint(BUNDLED).model.eval()
    chosen = load_checkpoint(BUNDLED).model.eval()
    assert chosen.kernel_backend == "torch"
    chosen.mixers[0].kernel_backend = "cutile"  # switched away and back: the choice is all there is
    assert chosen.set_kernel_backend("torch") is chosen and chosen.kernel_backend == "torch"
    ids = _ids(256)
    a, b = plain.forward_states(ids), chosen.forward_states(ids)
    assert torch.equal(a.logits, b.logits) and all(torch.equal(x, y) for x, y in zip(a.states, b.states))


def test_cutile_backend_without_cuda_is_one_clean_error():
    model = load_checkpoint(BUNDLED).model
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the error path is the CPU one")
    with pytest.raises(BackendUnavailable) as e:
        model.set_kernel_backend("cutile")
    msg = str(e.value)
    assert "\n" not in msg and 'backend="cutile"' in msg and e.value.hint
    assert model.kernel_backend == "torch"  # nothing changed
    with pytest.raises(ContractError, match="backend: expected one of"):
        model.set_kernel_backend("triton")
    model.mixers[0].kernel_backend = "cutile"  # forced past the check: the kernels refuse, no silent fallback
    with pytest.raises(BackendUnavailable):
        model.forward_states(_ids(256, L=3))


@pytest.mark.parametrize("ck", ["bundled", "g3_nobias"])
def test_cutile_branch_plumbing_on_cpu(ck, kernels_on_torch, tmp_path):
    if ck == "bundled":
        path, vocab = BUNDLED, 256
    else:
        path, vocab = random_checkpoint(tmp_path / "ck", seed=4, d_model=48, n_layer=2, vocab_size=60, d_state=8,
                                        headdim=8, chunk_size=8, ngroups=3, conv_bias=False), 60
    ref = load_checkpoint(path).model.eval()
    model = load_checkpoint(path).model.eval()
    for m in model.mixers:  # as set_kernel_backend("cutile") does, without its CUDA check
        m.kernel_backend = "cutile"
    ids = _ids(vocab, L=21, seed=3)
    want, want_split, want_past = _logits_and_split(ref, ids, 9)
    got, got_split, got_past = _logits_and_split(model, ids, 9)
    assert set(kernels_on_torch) == {"causal_conv1d", "conv_update", "ssm_scan", "gated_rmsnorm"}
    assert kernels_on_torch.count("conv_update") == 12 * len(model.mixers)  # every one-token step: the update
    assert_close("logits", want.logits, got.logits, rel=1e-5)
    assert_close("split logits", want_split, got_split, rel=1e-5)
    for i, (a, b) in enumerate(zip(want_past, got_past)):
        assert_close(f"state {i}", a.float(), b.float(), rel=1e-5)


# ----------------------------------------------------------------------------- GPU (the lead runs these on the H200)
def _gpu_cases(tmp_path_factory):
    from tests.models.hf_checkpoints import make

    root = tmp_path_factory.mktemp("bamba")
    ck, _ = make("bamba", root / "ck", mamba_d_state=32)  # head dim 16, d_state 32: sizes the scan kernel serves
    return {"bundled": (BUNDLED, 256), "bamba": (ck, 96)}


@pytest.mark.gpu
@requires_cutile
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["bundled", "bamba"])
def test_cutile_model_logits_vs_torch_fp32(case, dtype, tmp_path_factory):
    """Logits and states of the model on the cuTile kernels (GPU) vs the torch model in fp32 (CPU): a fresh prefill
    of 300 tokens (several kernel chunks) and a prefill of 200 + 6 one-token steps. Bounds (rel-L2): fp32 2e-4 (the
    scan kernel's own bound vs float64); bf16 3e-2 (bf16 activations and weights vs an fp32 model)."""
    path, vocab = _gpu_cases(tmp_path_factory)[case]
    ref = load_checkpoint(path, dtype=torch.float32).model.eval()
    model = load_checkpoint(path, dtype=getattr(torch, dtype)).model.eval().cuda().set_kernel_backend("cutile")
    rel = {"float32": 2e-4, "bfloat16": 3e-2}[dtype]
    ids = _ids(vocab, batch=3, L=300, seed=11)
    with torch.no_grad():
        want = ref.forward_states(ids)
        got = model.forward_states(ids.cuda())
    assert_close(f"{case} {dtype} logits", want.logits, got.logits.float().cpu(), rel=rel)
    ids = ids[:, :206]
    want_full, _, want_past = _logits_and_split(ref, ids, 200)
    got_full, got_split, got_past = _logits_and_split(model, ids.cuda(), 200)
    assert_close(f"{case} {dtype} split logits", want_full.logits, got_split.float().cpu(), rel=rel)
    for i, (a, b) in enumerate(zip(want_past, got_past)):
        assert_close(f"{case} {dtype} state {i}", a.float(), b.float().cpu(), rel=rel)
