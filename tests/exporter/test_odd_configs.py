"""Valid but unusual transformers configs through every graph flavour (found by the "breaker" tryout).

A transformers 5.24 ``Mamba2`` checkpoint with ``conv_kernel=1`` (d_conv 1: the conv is a per-channel scale, the
conv state has zero columns). transformers and m2export's PyTorch model run it; the graphs must too: logits vs
transformers within rel-L2 1e-5, a (batch, conv_dim, 0) conv state in and out, prefill + decode + prefill equal to one
prefill, greedy tokens equal to transformers', ``m2export check`` passing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from m2export.exporter import OrtModel, export_model
from m2export.exporter.manifest import read_manifest
from tests.helpers import assert_close
from tests.models.hf_checkpoints import hf_greedy, hf_logits, make

pytest.importorskip("onnxruntime")

REL = 1e-5


@pytest.fixture(scope="module")
def d_conv_1(tmp_path_factory):
    root = tmp_path_factory.mktemp("d_conv_1")
    ck, hf = make("mamba2", root / "ck", conv_kernel=1)
    out = root / "out"
    export_model(ck, out, ssm_impl="all", packed_prefill=True)
    return ck, hf, out


def _ids(b, L, seed):
    return torch.randint(0, 64, (b, L), generator=torch.Generator().manual_seed(seed))


def test_d_conv_1_graphs_match_transformers(d_conv_1):
    ck, hf, out = d_conv_1
    assert sorted(read_manifest(out).ssm_impls()) == ["native", "ssmscan", "std"]
    for impl in read_manifest(out).ssm_impls():
        om = OrtModel(out, impl)
        for b, L in [(1, 1), (2, 8), (2, 17)]:
            ids = _ids(b, L, L)
            got = om.run(ids.numpy())
            for s in om.io.states:
                if s.kind == "conv_state":  # (batch, conv_dim 96, 0) in the flavour's layout, as the I/O declares it
                    want = (b, *s.present.shape[1:])
                    assert 0 in want and sorted(want[1:]) == [0, 96] and got[s.present.name].shape == want, \
                        f"{impl} {s.present.name}: {got[s.present.name].shape}, expected {want}"
            ref = hf_logits(hf, ids)
            assert_close(f"d_conv 1 {impl} B{b} L{L}", ref, torch.from_numpy(got["logits"].astype(np.float32)), rel=REL)
        ids = _ids(2, 13, 3).numpy()
        full = om.run(ids)
        a = om.run(ids[:, :5])
        b_ = om.run(ids[:, 5:6], om.io.next_past(a), decode=True)
        c = om.run(ids[:, 6:], om.io.next_past(b_))
        split = np.concatenate([x["logits"] for x in (a, b_, c)], axis=1)
        assert_close(f"d_conv 1 {impl} split", torch.from_numpy(full["logits"]), torch.from_numpy(split), rel=REL)
        prompt = _ids(1, 6, 4)
        assert (om.generate_greedy(prompt.numpy(), 8) == hf_greedy(hf, prompt, 8).numpy()).all(), impl


def test_d_conv_1_check_and_generate(d_conv_1, tmp_path):
    from m2export.check.compare import run_check
    from m2export.generate import generate

    ck, hf, out = d_conv_1
    report = run_check(out, shapes=[(1, 1), (2, 9)], decode_steps=2, report_dir=tmp_path / "rep")
    assert report.passed, report.failures()
    prompt = _ids(1, 5, 7)
    res = generate(out, prompt[0].tolist(), runtime="onnxrt", max_new_tokens=6)
    assert res.new_ids == hf_greedy(hf, prompt, 6)[0].tolist()
