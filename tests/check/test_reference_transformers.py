"""``m2export check --reference transformers``: transformers' model gives the reference logits.

Tiny checkpoints written by transformers (tests/models/hf_checkpoints.py). What is shown:

* the reference's logits are transformers' own (bit-equal to a plain ``model(input_ids)`` forward) for a fresh
  feed, for a feed continuing states the reference returned (transformers' full forward over the whole
  window) and along a decode loop; a feed continuing unknown states is refused;
* where transformers differs from mamba_ssm (a dt clamp at time_step_min in prefill: Zamba2, and Nemotron-H up
  to transformers 5.24; a full-width gated norm with ngroups 2) the reference follows mamba_ssm and says so,
  and where it does not (Nemotron-H in 5.25) changes nothing and says nothing;
* a check of a hybrid export against it passes, and it catches an export whose model disagrees with
  transformers where the default (m2export PyTorch) reference cannot: the export and the m2export reference
  both built with a full-width gated norm (ngroups 2).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from m2export.check.compare import run_check
from m2export.check.runners import (ModelFromCheckpoint, ModelFromTransformers, TokenHistory, TransformersRunner,
                                    follow_mamba_ssm_)
from m2export.errors import CheckpointError, RuntimeLoadError
from m2export.exporter import export_model
from m2export.exporter.configs import GraphIO
from m2export.models.checkpoint import load_checkpoint
from tests.helpers import assert_close
from tests.models.hf_checkpoints import hf_logits, make

SHAPES = [(1, 5), (2, 9)]


def _ids(vocab, b, L, seed):
    return torch.randint(0, vocab, (b, L), generator=torch.Generator().manual_seed(seed))


def test_reference_logits_are_transformers_fresh_continued_and_decoded(tmp_path):
    ck, hf = make("granitemoehybrid", tmp_path / "ck")
    ref = ModelFromTransformers(ck, ModelFromCheckpoint(ck))
    io = GraphIO.for_model(load_checkpoint(ck).spec, "fp32")
    ids = _ids(hf.config.vocab_size, 2, 12, seed=1).numpy()
    with TransformersRunner(ref) as r:
        rhf = r.ref.hf  # transformers' model as loaded from the checkpoint (the same weights as ``hf``)

        def want(n):
            return hf_logits(rhf, torch.from_numpy(ids[:, :n])).numpy()

        assert_close("loaded vs in-memory transformers model", hf_logits(hf, torch.from_numpy(ids)),
                     torch.from_numpy(want(12)), rel=1e-6)
        a = r.infer({"input_ids": ids[:, :7], **io.zero_feeds(2, np.dtype)})
        assert np.array_equal(a["logits"], want(7)), "fresh feed: not transformers' logits"
        b = r.infer({"input_ids": ids[:, 7:11], **io.next_past(a)})  # continues a's states
        assert np.array_equal(b["logits"], want(11)[:, 7:]), "continued feed: not transformers' full forward"
        c = r.infer({"input_ids": ids[:, 11:12], **io.next_past(b)})  # a decode step
        assert np.array_equal(c["logits"], want(12)[:, 11:]), "decode step: not transformers' full forward"
        # the states are m2export's PyTorch model's (transformers does not expose them in this layout)
        m = load_checkpoint(ck).model.eval()
        with torch.no_grad():
            _, presents = m.forward_states(torch.from_numpy(ids[:, :7]), [torch.from_numpy(v) for v in
                                                                          io.zero_feeds(2, np.dtype).values()])
        for s, t in zip(io.states, presents):
            assert np.array_equal(a[s.present.name], t.numpy()), s.present.name
        stray = io.next_past(a)
        stray[io.states[0].past.name] = stray[io.states[0].past.name] + 1e-3
        with pytest.raises(RuntimeLoadError, match="continues states this reference did not produce"):
            r.infer({"input_ids": ids[:, 7:8], **stray})


def test_token_history_fresh_and_unknown():
    h = TokenHistory(limit=2)
    z = [np.zeros((2, 3, 4), np.float32), np.zeros((2, 1, 0, 8), np.float32)]
    assert h.lookup(z, 2).shape == (2, 0)
    x = [np.ones((2, 3, 4), np.float32)]
    assert h.lookup(x, 2) is None
    h.record(x, np.arange(6).reshape(2, 3))
    assert h.lookup([np.ones((2, 3, 4), np.float32)], 2).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert h.lookup([np.ones((2, 3, 4), np.float64)], 2) is None  # dtype is part of the fingerprint
    for k in range(2):
        h.record([np.full((1,), k + 5.0)], np.zeros((1, 1)))
    assert h.lookup(x, 2) is None  # the oldest entry dropped at the limit


def _clamps_at_time_step_min(name: str) -> bool:
    """Whether transformers' prefill clamps dt at time_step_min for case ``name``: Zamba2 in 5.24 and 5.25,
    Nemotron-H up to 5.24 (5.25's mixer takes the config's time_step_limit, as mamba_ssm)."""
    import transformers
    from packaging.version import Version

    return name.startswith("zamba2") or Version(transformers.__version__) < Version("5.25")


@pytest.mark.parametrize("name", ["nemotron_h", "zamba2"])
def test_follows_mamba_ssm_where_transformers_differs(tmp_path, name):
    """time_step_min 0.5: where transformers' prefill clamps dt there, its logits differ from m2export's model
    (the premise, measured) and the reference lifts the clamp and says so; where it does not (Nemotron-H from
    transformers 5.25), its logits already equal m2export's and the reference changes nothing and says nothing.
    Which of the two holds is pinned per version, so neither branch can pass in place of the other."""
    ck, hf = make(name, tmp_path / "ck", time_step_min=0.5)
    m = load_checkpoint(ck).model.eval()
    ids = _ids(hf.config.vocab_size, 2, 11, seed=4)
    with torch.no_grad():
        ours = m(ids).logits.float()
    raw = hf_logits(hf, ids)
    loaded = ModelFromTransformers(ck, ModelFromCheckpoint(ck))()
    limits = {tuple(float(v) for v in mod.time_step_limit) for mod in loaded.hf.modules()
              if hasattr(mod, "time_step_limit")}
    assert limits == {(0.0, float("inf"))}, limits  # the checkpoint's (default) limit in every mixer, after
    if _clamps_at_time_step_min(name):
        assert (raw - ours).abs().max() > 1e-3, "premise: the clamp should matter for this checkpoint"
        assert len(loaded.notes) == 1 and "dt limit (0.5, inf)" in loaded.notes[0], loaded.notes
    else:
        assert_close(f"{name}: transformers (no clamp) vs m2export", ours, raw, rel=2e-5)
        assert loaded.notes == [], loaded.notes  # nothing to lift
    assert_close(f"{name} without the clamp", ours, hf_logits(loaded.hf, ids), rel=2e-5)


def test_full_width_gated_norm_is_made_per_group(tmp_path):
    """transformers releases before the per-group norm normalised over all d_inner channels for ngroups > 1;
    simulated on 5.24's modules (group_size set to d_inner): the reference restores the per-group norm."""
    ck, hf = make("bamba", tmp_path / "ck")  # ngroups 2
    spec = load_checkpoint(ck).spec
    norms = [mod for mod in hf.modules() if type(mod).__name__.endswith("RMSNormGated")]
    assert norms and all(n.group_size == spec.layers[spec.mamba_layers[0]].mamba.norm_group_size for n in norms)
    ids = _ids(hf.config.vocab_size, 1, 9, seed=2)
    good = hf_logits(hf, ids)
    assert follow_mamba_ssm_(hf, spec) == []  # transformers 5.24 and 5.25: already per group
    for n in norms:
        n.group_size = n.weight.shape[0]
    assert (hf_logits(hf, ids) - good).abs().max() > 1e-4, "premise: a full-width norm changes the logits"
    notes = follow_mamba_ssm_(hf, spec)
    assert len(notes) == 1 and f"{len(norms)} mixer(s)" in notes[0]
    assert torch.equal(hf_logits(hf, ids), good)


def test_check_of_a_hybrid_export_against_transformers(tmp_path):
    ck, hf = make("nemotron_h", tmp_path / "ck")
    out = tmp_path / "out"
    export_model(ck, out, ssm_impl="both")
    report = run_check(out, shapes=SHAPES, decode_steps=3, report_dir=tmp_path / "rep", reference="transformers")
    assert report.passed, report.failures()
    assert report.reference == "transformers" and report.runners[0]["name"] == "transformers"
    assert "NemotronHForCausalLM" in report.runners[0]["detail"]
    assert "states from m2export's PyTorch model" in report.runners[0]["detail"]
    assert {r.section for r in report.rows} == {"prefill", "sequence"}
    assert {g["total"] for g in report.greedy.values()} == {2 * 4}
    assert "m2export's PyTorch model" in (tmp_path / "rep" / "check_report.md").read_text()


def test_transformers_reference_catches_what_the_torch_reference_cannot(tmp_path, monkeypatch):
    """An export made by a model with a full-width gated norm (ngroups 2): the default reference shares the bug
    and passes; transformers' (per-group) logits fail it, named."""
    from m2export.models import mamba2

    ck, _ = make("granitemoehybrid", tmp_path / "ck")  # ngroups 2
    original = mamba2.RMSNormGated.forward

    def full_width(self, x, z):
        saved, self.group_size = self.group_size, x.shape[-1]
        try:
            return original(self, x, z)
        finally:
            self.group_size = saved

    monkeypatch.setattr(mamba2.RMSNormGated, "forward", full_width)
    out = tmp_path / "out"
    export_model(ck, out)
    assert run_check(out, shapes=SHAPES, decode_steps=2, report_dir=tmp_path / "a").passed
    bad = run_check(out, shapes=SHAPES, decode_steps=2, report_dir=tmp_path / "b", reference="transformers")
    assert not bad.passed
    failed = {r.output for r in bad.rows if not r.passed}
    assert "logits" in failed and not any(n.startswith("present") for n in failed), failed


def test_mamba_ssm_checkpoint_is_refused(tmp_path):
    from m2export.models.checkpoint import random_checkpoint

    ck = random_checkpoint(tmp_path / "ck", d_model=32, n_layer=1, vocab_size=64, d_state=8, headdim=8,
                           chunk_size=8)
    with pytest.raises(CheckpointError, match="needs an HF-format checkpoint"):
        ModelFromTransformers(ck, ModelFromCheckpoint(ck))()


def test_cli_reference_flag(tmp_path, capsys):
    from m2export.cli.main import main
    from m2export.models.checkpoint import random_checkpoint

    ck = random_checkpoint(tmp_path / "ck", d_model=32, n_layer=1, vocab_size=64, d_state=8, headdim=8,
                           chunk_size=8)
    export_model(ck, tmp_path / "out")
    rc = main(["check", str(tmp_path / "out"), "--reference", "transformers", "--shapes", "1x3", "-q"])
    err = capsys.readouterr().err
    assert rc == 1 and "needs an HF-format checkpoint" in err and "Traceback" not in err, err
    with pytest.raises(SystemExit) as e:
        main(["check", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--reference {torch,transformers}" in text and "stay compared against m2export's PyTorch model" in text
