"""The packed prefill graph (``export --packed-prefill``, m2export/exporter/packed.py; issue 14) in ONNX Runtime.

Each pack (1, 2 and 7 sequences of lengths 1, 63, 64, 65, 500, 2048, a boundary inside the bundled model's
64-token chunk and one on its edge, an empty sequence) runs as one call with random per-sequence past states,
and every sequence's logits and present states are compared with the PyTorch model run on that sequence alone
from the same states (fp32: rel-L2 <= 2e-5 per state, logits max-abs <= 2e-5 of max |logits|; fp16 graph vs the
fp32 model: 2e-2). An empty sequence must return its states unchanged (bit for bit). Also: the weights are stored
once (the packed graph references model.onnx.data, which grows only by the conv taps), ``m2export check`` and
``inspect`` accept the folder, and a hybrid (attention layers) is refused with one line naming the layers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from m2export.errors import ParameterError
from m2export.exporter import export_model
from m2export.exporter.manifest import read_manifest
from m2export.exporter.packed import NSEQ, PACKED_FILE, PACKED_ROLE
from m2export.models.checkpoint import load_checkpoint
from tests.helpers import rel_l2, run_named, stable_seed
from tests.kernels.test_ssd_packed import PACKS

ort = pytest.importorskip("onnxruntime")

BUNDLED = Path(__file__).resolve().parents[2] / "samples" / "checkpoints" / "stdlib-byte-mamba2"
_OUT: dict = {}


def _export(dtype: str, tmp_path_factory) -> Path:
    if dtype not in _OUT:
        out = tmp_path_factory.mktemp(f"packed_{dtype}") / "out"
        export_model(BUNDLED, out, dtype=dtype, packed_prefill=True)
        _OUT[dtype] = out
    return _OUT[dtype]


def _run_pack(out: Path, lengths, seed: int):
    sess = ort.InferenceSession(str(out / PACKED_FILE), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, 256, n) for n in lengths]
    feeds = {"input_ids": np.concatenate(seqs)[None].astype(np.int64),
             "cu_seqlens": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)}
    for i in sess.get_inputs()[2:]:
        shape = [len(lengths) if d == NSEQ else d for d in i.shape]
        dt = np.float16 if "float16" in i.type else np.float32
        feeds[i.name] = (rng.standard_normal(shape) * 0.5).astype(dt)
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    return seqs, feeds, outs


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("pack", PACKS, ids=[c[0] for c in PACKS])
def test_packed_prefill_equals_each_sequence_alone(pack, dtype, tmp_path_factory):
    name, lengths = pack
    out = _export(dtype, tmp_path_factory)
    model = load_checkpoint(BUNDLED).model.eval()  # the fp32 reference
    n_layer = len(model.backbone.layers)
    seqs, feeds, outs = _run_pack(out, lengths, stable_seed("packed_export", name, dtype))
    tol = 2e-5 if dtype == "fp32" else 2e-2
    assert outs["logits"].shape[:2] == (1, sum(lengths))
    off = 0
    for j, (n, ids) in enumerate(zip(lengths, seqs)):
        keys = [f"{k}_state.{i}" for i in range(n_layer) for k in ("conv", "ssm")]
        if n == 0:  # an empty sequence keeps its states, bit for bit
            for k in keys:
                assert np.array_equal(outs[f"present_{k}"][j], feeds[f"past_{k}"][j]), k
            continue
        past = ([torch.from_numpy(feeds[f"past_conv_state.{i}"][j:j + 1]).float() for i in range(n_layer)],
                [torch.from_numpy(feeds[f"past_ssm_state.{i}"][j:j + 1]).float() for i in range(n_layer)])
        ref, _ = run_named(model, torch.from_numpy(ids[None]), past)
        got = outs["logits"][0, off:off + n].astype(np.float32)
        err = np.abs(ref["logits"][0] - got).max() / np.abs(ref["logits"]).max()
        assert err <= tol, f"sequence {j} (length {n}): logits max-abs {err:.2e} > {tol}"
        for k in keys:
            e = rel_l2(torch.from_numpy(ref[f"present_{k}"][0]), torch.from_numpy(outs[f"present_{k}"][j]).float())
            assert e <= tol, f"sequence {j} (length {n}): present_{k} rel-L2 {e:.2e} > {tol}"
        off += n


def test_weights_stored_once_and_the_folder_checks(tmp_path_factory, tmp_path, capsys):
    from m2export.cli.main import main

    out = _export("fp32", tmp_path_factory)
    m = read_manifest(out)
    (packed,) = [g for g in m.graphs if g.role == PACKED_ROLE]
    assert packed.file == PACKED_FILE and packed.external_data == ["model.onnx.data"]
    assert packed.io().input("cu_seqlens").dtype == "int32"
    assert m.graph("prefill").file == "model.onnx"  # the regular graph is still the prefill+decode one
    plain = tmp_path / "plain"
    export_model(BUNDLED, plain)
    grown = (out / "model.onnx.data").stat().st_size - (plain / "model.onnx.data").stat().st_size
    layers = load_checkpoint(BUNDLED).model.backbone.layers
    taps = sum(layer.mixer.spec.d_conv * layer.mixer.spec.conv_dim * 4 for layer in layers)
    assert 0 <= grown <= taps + 4096  # only the packed conv's float32 taps (and alignment)
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    assert "model.packed.onnx packed-prefill" in capsys.readouterr().out
    assert main(["check", str(out)]) == 0


def test_hybrid_is_refused_before_anything_is_written(tmp_path, capsys):
    from m2export.cli.main import main
    from tests.models.hf_checkpoints import make

    ck, _ = make("granitemoehybrid", tmp_path / "ck")
    # what is in the way, grouped and in words (it was "layers [0, 1, 2, 3] (attention, MLP, MoE, shared blocks or
    # multipliers...)", which said neither which layer had what nor that the multipliers were the model's)
    # then "layers 0, 3: attention mixer; layers 0, 1, 2, 3: an MoE": neither why a part blocks packing nor which
    # part of a layer it is; now the rule once, then each thing in the way once, with its layers
    with pytest.raises(ParameterError, match=r"packed prefill: built only for pure Mamba-2 models in fp32 or fp16 "
                       r"\(every layer a Mamba-2 mixer alone, no multipliers: .*\); this model has an embedding "
                       r"multiplier \(3\); a logits multiplier \(0.4\); an attention mixer in layers 0, 3; "
                       r"an MoE after the mixer in layers 0, 1, 2, 3; muP multipliers on "
                       r"the layer in layers 0, 1, 2, 3$") as e:
        export_model(ck, tmp_path / "out", packed_prefill=True)
    assert "[" not in str(e.value)
    assert not (tmp_path / "out").exists()
    capsys.readouterr()
    assert main(["export", str(ck), "-o", str(tmp_path / "out2"), "--packed-prefill", "-q"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("error: packed prefill: built only for pure Mamba-2 models") and "Traceback" not in "".join(err)
    assert err[1] == "hint: export without --packed-prefill", err
    assert not (tmp_path / "out2").exists()


#: cu_seqlens the contract forbids (m2export/contract.py: from 0, non-decreasing, last = total tokens), on 10
#: tokens: a decreasing offset that still covers every token ([0, -1, 10] ran to finite outputs: sequence 1 read
#: "token -1"), not from 0, past the end, short of the end, decreasing inside
BAD_CU = [[0, -1, 10], [2, 5, 10], [0, 5, 12], [0, 5, 8], [0, 7, 3, 10], [0, 11, 10]]


@pytest.mark.parametrize("cu", BAD_CU, ids=[str(c) for c in BAD_CU])
def test_bad_cu_seqlens_never_give_finite_outputs(cu, tmp_path_factory):
    """An invalid cu_seqlens either fails in ONNX Runtime or NaN-poisons every output (logits and every present
    state), so a server can never continue a sequence from states computed on the wrong tokens."""
    out = _export("fp32", tmp_path_factory)
    sess = ort.InferenceSession(str(out / PACKED_FILE), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(stable_seed("packed_bad_cu", str(cu)))
    feeds = {"input_ids": rng.integers(0, 256, (1, 10)).astype(np.int64), "cu_seqlens": np.array(cu, np.int32)}
    for i in sess.get_inputs()[2:]:
        feeds[i.name] = rng.standard_normal([len(cu) - 1 if d == NSEQ else d for d in i.shape]).astype(np.float32)
    try:
        outs = sess.run(None, feeds)
    except Exception as e:  # ORT's own refusal (an index out of range, a broadcast)
        assert "ONNXRuntimeError" in str(e) or "onnxruntime" in type(e).__module__
        return
    for o, v in zip(sess.get_outputs(), outs):
        assert np.isnan(v).all(), f"cu_seqlens {cu}: {o.name} has finite values"


def test_std_export_with_packed_graph_checks(tmp_path, capsys):
    """--ssm-impl std --packed-prefill: the packed graph (ssm_impl ssmscan in the manifest) is no flavour of the
    prefill graph; check refused the folder ('no prefill graph with ssm_impl=ssmscan', exit 1)."""
    from m2export.cli.main import main

    out = tmp_path / "out"
    m = export_model(BUNDLED, out, ssm_impl="std", packed_prefill=True)
    assert m.ssm_impls() == ["std"]
    capsys.readouterr()
    assert main(["check", str(out), "-q", "--shapes", "1x5", "--decode-steps", "1"]) == 0, capsys.readouterr().err


def _ancestors(producer: dict, value: str) -> set:
    """Indices of the nodes ``value`` is computed from (``producer``: value name -> (index, node))."""
    seen, todo = set(), [value]
    while todo:
        k_node = producer.get(todo.pop())
        if k_node is None or k_node[0] in seen:
            continue
        seen.add(k_node[0])
        todo.extend(i for i in k_node[1].input if i)
    return seen


def test_output_only_branches_hold_nothing_bigger_than_their_output(tmp_path_factory):
    """ONNX Runtime's default order runs the nodes that only a present state needs after the logits, so whatever
    such a branch reads from the logits' path stays alive through every later layer. Each such value must be no
    bigger than the present state it makes: on a 130m-shaped pack of 774 tokens the SSMScanPacked body's state
    sources (nseq + NL rows of headdim x d_state per head) and the conv's rows (states + tokens) held 24 x 32 MB
    until the end of the run (benchmarks/RESULTS.md). Sizes measured by running the inlined graph on a pack."""
    import onnx
    import onnx.inliner

    out = _export("fp32", tmp_path_factory)
    model = onnx.inliner.inline_local_functions(onnx.load(str(out / PACKED_FILE)))
    graph = model.graph
    producer = {o: (k, n) for k, n in enumerate(graph.node) for o in n.output if o}
    declared = {o.name for o in graph.output}
    graph.output.extend(onnx.ValueInfoProto(name=v) for v in producer if v not in declared)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    lengths = [63, 1, 64, 0, 65, 5]  # boundaries inside, on and past the 64-token chunk, an empty sequence
    rng = np.random.default_rng(stable_seed("packed_late_branches"))
    feeds = {"input_ids": rng.integers(0, 256, (1, sum(lengths))).astype(np.int64),
             "cu_seqlens": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)}
    for i in sess.get_inputs()[2:]:
        feeds[i.name] = rng.standard_normal([len(lengths) if d == NSEQ else d for d in i.shape]).astype(np.float32)
    nbytes = {o.name: v.nbytes for o, v in zip(sess.get_outputs(), sess.run(None, feeds))}
    main = _ancestors(producer, "logits")
    late_reads = 0
    for o in declared - {"logits"}:
        for k in _ancestors(producer, o) - main:
            for v in graph.node[k].input:
                if v in producer and producer[v][0] in main:
                    late_reads += 1
                    assert nbytes[v] <= nbytes[o], (f"{o}: its branch after the logits reads {v} "
                                                    f"({graph.node[producer[v][0]].op_type}, {nbytes[v]} bytes; "
                                                    f"the output is {nbytes[o]})")
    assert late_reads >= 2 * 4  # each layer's two states read something of the main path (the test sees them)


def test_logits_are_the_heads_matmul_itself(tmp_path_factory):
    """The NaN poison of invalid offsets sits on the head's input (test_bad_cu_seqlens_never_give_finite_outputs
    checks it still NaNs every logit), so the logits are never copied by a Where: one vocabulary-sized tensor at the
    run's peak instead of two (130m, 774 tokens: 156 MB each)."""
    import onnx

    graph = onnx.load(str(_export("fp32", tmp_path_factory) / PACKED_FILE), load_external_data=False).graph
    node = next(n for n in graph.node if "logits" in n.output)
    assert node.op_type == "MatMul", f"logits come from a {node.op_type}"
