"""fp32 scan accuracy where in-chunk sums of dt*A reach thousands (issue 16): PyTorch model and both ORT flavours.

Checkpoint: HF ``Mamba2ForCausalLM`` with transformers' own init (``tests.helpers.hf_init_checkpoint``,
shape "large-dt-small": d_model 256, 2 layers, 16 heads, chunk 256, initializer_range 0.3), where dt
reaches ~16 and in-chunk running sums of dt*A ~-3,600, like the 130m shape with the default init.
Reference: the same checkpoint in transformers, float64. Measured on this checkpoint (L = 512): segment
sums as ``cs_i - cs_j`` (before) gave logits 3.3e-5 and a 300 + 212 split 1.1e-4 (logits) / 1.2e-4
(ssm_state); summed from their own terms (now) 2.4e-6 and 4e-7 / 3e-10; transformers' fp32: 2.2e-6.
Bounds: logits 1e-5 vs float64 (the 130m goal is 5e-5; this model is 2 layers, not 24), split 5e-5.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from m2export.exporter import OrtModel
from m2export.models.checkpoint import load_checkpoint
from tests.helpers import hf_init_checkpoint, rel_l2, run_named, scan_stats

transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency")
pytest.importorskip("onnxruntime")

L, SPLIT = 512, 300
LOGITS_VS_FP64 = 1e-5
SPLIT_BOUND = 5e-5


@pytest.fixture(scope="module")
def large_dt_ck(tmp_path_factory):
    return hf_init_checkpoint(tmp_path_factory.mktemp("ck") / "hf_large_dt", "large-dt-small")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (1, L), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def fp64_logits(large_dt_ck, ids):
    hf = transformers.Mamba2ForCausalLM.from_pretrained(str(large_dt_ck), dtype=torch.float64).eval()
    with torch.no_grad():
        return hf(ids).logits


@pytest.fixture(scope="module")
def large_dt_export(tmp_path_factory, large_dt_ck):
    from m2export.exporter import export_model

    out = tmp_path_factory.mktemp("exp") / "large_dt"
    export_model(large_dt_ck, out, ssm_impl="all")
    return out


def _assert_split_equal(full: dict, second: dict) -> None:
    """The issue's metrics: logits max-abs over max |logits| (positions after the split), each state's rel-L2."""
    lf = full["logits"][:, SPLIT:].astype(np.float64)
    err = np.abs(lf - second["logits"]).max() / np.abs(lf).max()
    assert err <= SPLIT_BOUND, f"split logits: max-abs/max|logits| {err:.3e} (bound {SPLIT_BOUND:.0e})"
    for k in full:
        if k.startswith("present_"):
            e = rel_l2(torch.from_numpy(full[k]), torch.from_numpy(second[k]))
            assert e <= SPLIT_BOUND, f"split {k}: rel-L2 {e:.3e} (bound {SPLIT_BOUND:.0e})"


def test_checkpoint_is_in_the_large_sum_regime(large_dt_ck, ids):
    """Guards the test's premise: dt > 8 and in-chunk sums of dt*A below -3,000 occur."""
    dt_max, cs_min, _ = scan_stats(load_checkpoint(large_dt_ck).model.eval(), ids)
    assert dt_max > 8 and cs_min < -3000, (dt_max, cs_min)


def test_torch_model_vs_float64(large_dt_ck, ids, fp64_logits):
    model = load_checkpoint(large_dt_ck).model.eval()
    out, _ = run_named(model, ids)
    e = rel_l2(fp64_logits, torch.from_numpy(out["logits"]))
    assert e <= LOGITS_VS_FP64, f"logits vs transformers float64: rel-L2 {e:.3e} (bound {LOGITS_VS_FP64:.0e})"


def test_torch_split_prefill_equals_unsplit(large_dt_ck, ids):
    model = load_checkpoint(large_dt_ck).model.eval()
    full, _ = run_named(model, ids)
    _, past = run_named(model, ids[:, :SPLIT])
    second, _ = run_named(model, ids[:, SPLIT:], past)
    _assert_split_equal(full, second)


@pytest.mark.parametrize("impl", ["ssmscan", "std", "native"])
def test_ort_vs_float64_and_split(large_dt_export, ids, fp64_logits, impl):
    """Each flavour vs float64 at L=512 and split at 300 through its state I/O (the native flavour's ssm states in
    its (b, h, d_state, headdim) layout: passed through by name, as a runtime does); the native flavour's final
    states also equal the ssmscan flavour's once in the model's layout."""
    m = OrtModel(large_dt_export, impl)
    full = m.run(ids.numpy())
    e = rel_l2(fp64_logits, torch.from_numpy(full["logits"]))
    assert e <= LOGITS_VS_FP64, f"{impl}: logits vs transformers float64: rel-L2 {e:.3e} (bound {LOGITS_VS_FP64:.0e})"
    first = m.run(ids[:, :SPLIT].numpy())
    second = m.run(ids[:, SPLIT:].numpy(), {k.replace("present_", "past_"): v for k, v in first.items()
                                            if k.startswith("present_")})
    _assert_split_equal(full, second)
    if impl == "native":
        ref = OrtModel(large_dt_export, "ssmscan").run(ids.numpy())
        for s in m.io.states:
            e = rel_l2(torch.from_numpy(ref[s.present.name]), torch.from_numpy(s.to_model_layout(full[s.present.name])))
            assert e <= SPLIT_BOUND, f"native {s.present.name} vs ssmscan: rel-L2 {e:.3e}"
