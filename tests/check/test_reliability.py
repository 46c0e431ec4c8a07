"""Issue 13, items 1-2: check exercises the whole vocabulary and never counts NaN as agreement; generate
refuses non-finite logits (naming the step and the runtime) instead of turning them into token 0."""

from __future__ import annotations

import numpy as np
import pytest

from m2export.check.compare import _greedy_update, run_check
from m2export.errors import M2ExportError
from m2export.generate import generate, sample_next
from tests.check.exports import copy_export, scale_initializer

VOCAB = dict(d_model=32, n_layer=1, vocab_size=2000, d_state=16, headdim=16, chunk_size=8, tie_embeddings=False)


@pytest.fixture(scope="module")
def wide_export(tmp_path_factory):
    """A 2000-token (untied) checkpoint and its export: the byte corpus alone reaches ids 0-255 only."""
    from m2export.exporter import export_model
    from m2export.models.checkpoint import random_checkpoint

    d = tmp_path_factory.mktemp("wide")
    ck = random_checkpoint(d / "ck", seed=5, **VOCAB)
    export_model(ck, d / "out")
    return d / "out"


def set_embedding_row(onnx_path, row: int, value: float) -> None:
    """Set row ``row`` of the graph's embedding initializer (the (vocab, d_model) Gather table) to ``value``."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(onnx_path))
    for i, t in enumerate(m.graph.initializer):
        arr = numpy_helper.to_array(t)
        if arr.ndim == 2 and arr.shape[0] == 2000 and "embedding" in t.name:
            arr = arr.copy()
            arr[row] = value
            m.graph.initializer[i].CopyFrom(numpy_helper.from_array(arr, t.name))
            break
    else:
        raise KeyError("no embedding initializer")
    onnx.save(m, str(onnx_path))


@pytest.mark.parametrize("value", [float("nan"), 1e5])
def test_check_exercises_every_embedding_row(wide_export, tmp_path, value):
    out = copy_export(wide_export, tmp_path / "out")
    set_embedding_row(out / "model.onnx", 1500, value)
    report = run_check(out, decode_steps=0)
    assert not report.passed
    bad = [r for r in report.rows if not r.passed]
    assert bad and all("vocab" in " ".join(r.failed_iterations) for r in bad), [
        (r.output, r.failed_iterations) for r in bad]
    assert "every token id 0..1999" in report.vocab_coverage


def test_untampered_wide_export_passes_with_full_coverage(wide_export, tmp_path):
    out = copy_export(wide_export, tmp_path / "out")
    report = run_check(out, decode_steps=2)
    assert report.passed, report.failures()
    assert report.vocab_coverage.startswith("every token id 0..1999 fed at least once")


def test_greedy_never_agrees_on_nan():
    g = {"agree": 0, "total": 0, "ties": 0, "mismatches": []}
    nan = np.full((2, 10), np.nan, dtype=np.float32)
    _greedy_update(g, 3, nan, nan.copy(), atol=1e-3)
    assert g["agree"] == 0 and len(g["mismatches"]) == 2
    assert "non-finite logits (runtime and reference)" in g["mismatches"][0]["where"]


def test_check_runs_a_one_token_vocabulary(tmp_path):
    """vocab_size 1 (mamba_ssm format, padded to 16; the graph's logits are the one real token): check passes
    (was an IndexError in the greedy top-2 margin, exit 70), generate repeats token 0."""
    from m2export.exporter import export_model
    from m2export.models.checkpoint import random_checkpoint

    ck = random_checkpoint(tmp_path / "ck", seed=3, d_model=16, n_layer=1, vocab_size=1, d_state=8, headdim=8,
                           chunk_size=4)
    export_model(ck, tmp_path / "out")
    report = run_check(tmp_path / "out", shapes=[(1, 1), (2, 5)], decode_steps=2, report_dir=tmp_path / "rep")
    assert report.passed, report.failures()
    g = {"agree": 0, "total": 0, "ties": 0, "mismatches": []}
    one = np.zeros((2, 1), np.float32)
    _greedy_update(g, 1, one, one.copy(), atol=1e-3)
    assert (g["agree"], g["total"], g["mismatches"]) == (2, 2, [])
    assert generate(tmp_path / "out", [0], runtime="onnxrt", max_new_tokens=3).new_ids == [0, 0, 0]


def test_export_with_non_finite_weights_is_checked_not_refused(tmp_path):
    """An export made with ``allow_nonfinite`` (--allow-non-finite-weights) records it; check and generate
    --runtime torch load the reference with the same weights (they refused the export's own checkpoint with
    'has a non-finite value ... export it anyway with --allow-non-finite-weights', exit 1): check fails on the
    non-finite outputs (exit 3's report) and torch generate refuses the NaN logits like onnxrt does."""
    from safetensors.torch import load_file, save_file

    from m2export.exporter import export_model
    from m2export.exporter.manifest import read_manifest
    from m2export.models.checkpoint import random_checkpoint

    ck = random_checkpoint(tmp_path / "ck", seed=4, d_model=16, n_layer=1, vocab_size=32, d_state=8, headdim=8,
                           chunk_size=4)
    sd = load_file(ck / "model.safetensors")
    sd["backbone.layers.0.mixer.out_proj.weight"][0, 0] = float("nan")
    save_file(sd, ck / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(M2ExportError, match="non-finite value"):
        export_model(ck, tmp_path / "refused")
    export_model(ck, tmp_path / "out", allow_nonfinite=True)
    assert read_manifest(tmp_path / "out").allow_nonfinite
    report = run_check(tmp_path / "out", shapes=[(1, 3)], decode_steps=1, report_dir=tmp_path / "rep")
    assert not report.passed and "non-finite" in str(report.failures())
    for runtime in ("torch", "onnxrt"):
        with pytest.raises(M2ExportError, match="non-finite logits"):
            generate(tmp_path / "out", [1, 2], runtime=runtime, max_new_tokens=2)


def test_generate_refuses_non_finite_logits(tiny_out, tmp_path, monkeypatch):
    from m2export.generate import open_runtime

    out = copy_export(tiny_out, tmp_path / "out")
    # one graph serves prefill and decode: make only its decode steps (sequence_length 1) return NaN logits
    s = open_runtime(out, "onnxrt")
    runner_cls, orig = type(s.prefill), type(s.prefill).infer

    def infer(self, feed, *args, **kwargs):
        outs = orig(self, feed, *args, **kwargs)
        if feed["input_ids"].shape[1] == 1:
            outs = dict(outs, logits=np.full_like(np.asarray(outs["logits"]), np.nan))
        return outs

    monkeypatch.setattr(runner_cls, "infer", infer)
    with pytest.raises(M2ExportError, match=r"non-finite logits \(NaN/inf\) after decode step 1") as e:
        generate(out, list(b"def "), runtime="onnxrt", max_new_tokens=4, session=s)
    assert "onnxrt" in str(e.value)
    monkeypatch.setattr(runner_cls, "infer", orig)
    scale_initializer(out / "model.onnx", _embedding_name(out / "model.onnx"), float("nan"))
    with pytest.raises(M2ExportError, match=r"non-finite logits \(NaN/inf\) after the prefill"):
        generate(out, list(b"def "), runtime="onnxrt", max_new_tokens=4)


def _embedding_name(path) -> str:
    import onnx

    m = onnx.load(str(path))
    # the tied embedding: (vocab, d_model), or stored once as the head's (d_model, vocab) (a built graph)
    return next(t.name for t in m.graph.initializer if len(t.dims) == 2 and 256 in t.dims)


def test_tiny_temperature_samples_the_argmax():
    x = np.array([0.5, 3.0, -1.0, 2.9])
    assert sample_next(x, temperature=5e-324, top_k=0, rng=np.random.default_rng(0)) == 1
