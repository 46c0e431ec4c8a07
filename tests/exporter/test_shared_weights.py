"""Zamba2's shared transformer blocks are stored once in the exported graph (issue 12): one initializer per
shared weight, used by every call site, and the weights file holds its bytes once.

The checkpoint (tests/models/hf_checkpoints.py, case ``zamba2``) has two shared blocks called ABA by layers 0, 2
and 4, so block 0 serves two call sites. The tracer folds ``Transpose(weight)`` once per call site; without
the exporter's merge each call would hold its own copy of block 0's matrices in the graph (and in ONNX Runtime's
or TensorRT's memory) even though the file could store the bytes once.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from m2export.exporter import OrtModel, export_model
from m2export.exporter.manifest import read_manifest
from m2export.models.checkpoint import load_checkpoint
from tests.helpers import assert_close
from tests.models.hf_checkpoints import hf_logits, make

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def zamba2_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("zamba2")
    ck, hf = make("zamba2", root / "ck")
    out = root / "out"
    export_model(ck, out, ssm_impl="both")
    return ck, hf, out


def _digest(a: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(a).tobytes(), digest_size=20).digest()


def _graphs(out):
    return [out / g.file for g in read_manifest(out).graphs]


def test_each_shared_weight_is_one_initializer_used_by_every_call_site(zamba2_export):
    ck, _, out = zamba2_export
    model = load_checkpoint(ck).model
    blocks = model.backbone.shared_blocks
    calls = collections.Counter(L.spec.shared.block for L in model.backbone.layers if L.spec.shared)
    assert calls == {0: 2, 1: 1}  # the premise: block 0 serves two call sites
    for path in _graphs(out):
        g = onnx.load(str(path)).graph  # with the external data: contents are compared
        inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
        by_content = collections.defaultdict(list)
        for name, a in inits.items():
            by_content[(a.dtype.str, a.shape, _digest(a))].append(name)
        dups = [names for names in by_content.values() if len(names) > 1]
        assert not dups, f"{path.name}: initializers with equal contents {dups[:3]}"
        uses = collections.Counter(i for n in g.node for i in n.input)
        for b, block in enumerate(blocks):
            for pname, p in block.named_parameters():
                if p.dim() != 2:
                    continue
                w = p.detach().numpy()
                holders = [n for n, a in inits.items() if a.shape in (w.shape, w.T.shape)
                           and (np.array_equal(a, w) or np.array_equal(a, w.T))]
                assert len(holders) == 1, f"{path.name}: block {b} {pname} is held by {holders}"
                assert uses[holders[0]] >= calls[b], \
                    f"{path.name}: block {b} {pname} ({holders[0]}) has {uses[holders[0]]} uses, {calls[b]} calls"


def test_weights_file_holds_the_shared_blocks_once(zamba2_export):
    ck, _, out = zamba2_export
    model = load_checkpoint(ck).model
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    block0 = sum(p.numel() * p.element_size() for p in model.backbone.shared_blocks[0].parameters())
    (data,) = {f for g in read_manifest(out).graphs for f in g.external_data}
    size = (out / data).stat().st_size
    n_inits = max(len(onnx.load(str(p), load_external_data=False).graph.initializer) for p in _graphs(out))
    # every weight once (plus 64-byte alignment); a second copy of block 0 would add its 73 KB
    assert size <= params + 64 * n_inits < params + block0, (size, params, block0)


@pytest.mark.parametrize("impl", ["ssmscan", "std"])
def test_the_merged_graph_still_matches_transformers(zamba2_export, impl):
    _, hf, out = zamba2_export
    ids = torch.randint(0, hf.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(5))
    got = OrtModel(out, impl).run(ids.numpy())["logits"]
    ref = hf_logits(hf, ids)
    assert_close(f"zamba2 {impl} logits", ref, torch.from_numpy(got[..., :ref.shape[-1]].astype(np.float32)),
                 rel=1e-5)
