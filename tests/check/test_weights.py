"""One copy of the weights for the PyTorch reference and ONNX Runtime (m2export/check/weights.py, load_checkpoint's
``share``): the reference's tensors are views of the export's mapped weights only where they are bit-equal to the
checkpoint's, so an export weight that differs from the checkpoint still fails the check."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from m2export.check.compare import run_check
from m2export.check.runners import ModelFromCheckpoint, SharedInitializers
from m2export.check.weights import ExportWeights
from m2export.models import checkpoint as ckmod
from m2export.models.checkpoint import bit_equal, load_checkpoint, random_checkpoint
from tests.check.exports import TINY, change_external_weight, copy_export

QUICK = dict(shapes=[(1, 5), (2, 17)], decode_steps=2)


def _graphs(out):
    return [out / "model.onnx", out / "model.std.onnx"]


def _state(model):
    return {k: v for k, v in model.state_dict().items()}


def _inside(t: torch.Tensor, arrays) -> bool:
    """Whether the tensor's memory lies inside one of the (mapped) arrays."""
    p = t.data_ptr()
    return any(a.ctypes.data <= p < a.ctypes.data + a.nbytes for a in arrays)


def test_reference_tensors_are_the_export_pages_and_the_checkpoint_bits(tiny_out, tiny_ck):
    """Every projection, conv weight and the (tied) embedding of the reference is a view of model.onnx.data, the
    very arrays ONNX Runtime gets, and every tensor of the model holds the checkpoint's bits (the plain load's)."""
    shared = SharedInitializers()
    weights = ExportWeights(shared, _graphs(tiny_out))
    ck = ModelFromCheckpoint(tiny_ck, share=weights)()
    plain = load_checkpoint(tiny_ck, dtype=torch.float32)
    got, want = _state(ck.model), _state(plain.model)
    assert got.keys() == want.keys()
    assert all(bit_equal(got[k], want[k]) for k in want)
    mapped = list(shared.arrays(tiny_out / "model.onnx").values())
    for k in ("backbone.embedding.weight", "backbone.layers.0.mixer.in_proj.weight",
              "backbone.layers.1.mixer.out_proj.weight", "backbone.layers.1.mixer.conv1d.weight"):
        assert k in ck.shared and _inside(got[k], mapped), k
    assert ck.model.lm_head.weight is ck.model.backbone.embedding.weight  # tied: still one parameter
    assert "(transposed)" in ck.shared["backbone.layers.0.mixer.in_proj.weight"]
    s = ExportWeights.summary(ck.model, ck.shared)
    assert s["shared_bytes"] > 0.95 * (s["shared_bytes"] + s["own_bytes"])
    assert set(s["own"]) == {k for k in got if k not in ck.shared and k != "lm_head.weight"}


def test_export_weight_differing_from_checkpoint_still_fails(tiny_out, tmp_path):
    """An out_proj scaled in model.onnx.data itself (the file the reference would share): the reference keeps the
    checkpoint's tensor for it (named in the report), both ONNX Runtime flavours compute with the export's, and the
    check fails as it did before any sharing."""
    out = copy_export(tiny_out, tmp_path / "out")
    change_external_weight(out / "model.onnx", "layers.1/out_proj.weight_t", lambda v: v.__imul__(1.5))
    report = run_check(out, report_dir=tmp_path / "rep", **QUICK)
    assert not report.passed
    assert "backbone.layers.1.mixer.out_proj.weight" in report.reference_weights["own"]
    assert "backbone.layers.0.mixer.out_proj.weight" not in report.reference_weights["own"]
    failed = {(r.runner, r.output) for r in report.rows if not r.passed}
    assert {("onnxrt:model.onnx", "logits"), ("onnxrt:model.std.onnx", "logits")} <= failed
    md = (tmp_path / "rep" / "check_report.md").read_text()
    assert "reference weights:" in md and "backbone.layers.1.mixer.out_proj.weight" in md


def test_one_differing_element_is_caught_by_the_full_comparison(tiny_out, tmp_path, monkeypatch):
    """One element of an out_proj changed in model.onnx.data, at a position the sampled pre-filter does not read
    (logical [0, 1]: stored transposed, flat index 64): the element-by-element comparison at load keeps the
    checkpoint's tensor and the check fails; with that comparison patched out, the reference takes the export's
    changed tensor and the same check passes (so the comparison, not the sampling, is what keeps the failure)."""
    out = copy_export(tiny_out, tmp_path / "out")

    def poke(v):
        v[64] += 50.0

    change_external_weight(out / "model.onnx", "layers.1/out_proj.weight_t", poke)
    report = run_check(out, report_dir=tmp_path / "rep", **QUICK)
    assert not report.passed and "backbone.layers.1.mixer.out_proj.weight" in report.reference_weights["own"]
    assert any(r.output == "logits" and not r.passed for r in report.rows)

    monkeypatch.setattr(ckmod, "bit_equal", lambda a, b: True)  # sharing that trusts the samples alone
    unchecked = run_check(out, report_dir=tmp_path / "rep2", **QUICK)
    assert "backbone.layers.1.mixer.out_proj.weight" not in unchecked.reference_weights["own"]
    assert unchecked.passed, unchecked.failures()


def test_check_report_states_the_sharing(tiny_out, tmp_path):
    report = run_check(tiny_out, report_dir=tmp_path, **QUICK)
    assert report.passed, report.failures()
    w = report.reference_weights
    assert w["shared_tensors"] >= 7 and w["own_bytes"] < 0.05 * w["shared_bytes"]
    assert "views of the export's weights, each checked bit-equal" in report.weights_note()
    assert report.to_dict()["reference_weights"] == w


def test_changed_weight_file_is_reported(tiny_out, tmp_path):
    out = copy_export(tiny_out, tmp_path / "out")
    weights = ExportWeights(SharedInitializers(), _graphs(out))
    assert weights.unchanged() == []
    st = os.stat(out / "model.onnx.data")
    os.utime(out / "model.onnx.data", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert weights.unchanged() == [str((out / "model.onnx.data").resolve())]


def test_bit_equal_is_exact_and_reads_strided_views():
    a = torch.randn(37, 23)
    assert bit_equal(a, a.clone()) and bit_equal(a.T.contiguous(), a.T) and bit_equal(a, a.T.contiguous().T)
    b = a.clone()
    b[36, 22] = torch.nextafter(b[36, 22], torch.tensor(math.inf))
    assert not bit_equal(a, b) and not bit_equal(a.T, b.T, slice_elements=5)
    z = torch.zeros(4)
    assert torch.equal(z, -z) and not bit_equal(z, -z)  # the sign of zero counts
    n = torch.full((3,), float("nan"))
    assert bit_equal(n, n.clone())  # the same NaN bits are equal (torch.equal says no)
    assert not bit_equal(a, a[:, :22]) and not bit_equal(a, a.double())
    assert bit_equal(torch.tensor(2.0), torch.tensor(2.0)) and bit_equal(torch.empty(0, 3), torch.empty(0, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_read_equals_safetensors(tmp_path, dtype):
    """With ``share``, load_checkpoint reads each tensor with plain reads (no mapping kept): the same model as
    safetensors' own reader gives, for fp32 and bf16 checkpoints (loaded as float32), nothing shared."""
    ck = random_checkpoint(tmp_path / "ck", seed=5, dtype=dtype, **TINY)
    offered = []
    streamed = load_checkpoint(ck, dtype=torch.float32, share=lambda k, t: iter(offered.append(k) or ()))
    plain = load_checkpoint(ck, dtype=torch.float32)
    got, want = _state(streamed.model), _state(plain.model)
    assert all(bit_equal(got[k], want[k]) for k in want) and not streamed.shared
    assert set(offered) == set(want) - {"lm_head.weight"}
    big = got["backbone.embedding.weight"]
    assert big.dtype == torch.float32 and np.isfinite(big.numpy()).all()


def test_streamed_read_refuses_non_finite_weights_as_before(tmp_path):
    """check_weights still sees every tensor on the streamed path: a NaN weight is refused, named."""
    from safetensors.torch import load_file, save_file

    ck = random_checkpoint(tmp_path / "ck", seed=5, **TINY)
    sd = load_file(str(ck / "model.safetensors"))
    sd = {k: v.clone() for k, v in sd.items()}
    sd["backbone.layers.1.mixer.in_proj.weight"][3, 4] = float("nan")
    save_file(sd, str(ck / "model.safetensors"), metadata={"format": "pt"})
    for share in (None, lambda k, t: iter(())):
        with pytest.raises(ckmod.CheckpointError, match=r"in_proj.weight.*non-finite value at index \[3, 4\]"):
            load_checkpoint(ck, dtype=torch.float32, share=share)


@pytest.mark.parametrize("tie", [True, False])
def test_a_padded_vocabulary_shares_its_embedding(tmp_path, tie):
    """A mamba_ssm checkpoint's vocab_size 100 stored as 112 rows: the model holds the first 100 (the loader's
    view), the export stores those, so the reference's embedding and lm_head are still the export's pages."""
    from m2export.exporter import export_model

    ck = random_checkpoint(tmp_path / "ck", d_model=32, n_layer=1, vocab_size=100, d_state=8, headdim=16,
                           chunk_size=8, seed=3, tie_embeddings=tie)
    out = tmp_path / "out"
    export_model(ck, out, ssm_impl="both")
    shared = SharedInitializers()
    got = ModelFromCheckpoint(ck, share=ExportWeights(shared, _graphs(out)))()
    plain = load_checkpoint(ck, dtype=torch.float32)
    mapped = list(shared.arrays(out / "model.onnx").values())
    for k in ("backbone.embedding.weight", "lm_head.weight"):
        t = got.model.state_dict()[k]
        assert t.shape == (100, 32) and bit_equal(t, plain.model.state_dict()[k]), k
        assert (k in got.shared or tie) and _inside(t, mapped), k
