"""``m2export::SSMScanPacked`` (packed variable-length prefill, issue 14) in ONNX Runtime vs the float64 oracle.

The model-local function (the chunked SSD over sequence-local chunks, no Loop) and its inlined, plugin-free
form, on packs of 1, 2 and 7 sequences (lengths 1, 63, 64, 65, 500, 2048: a boundary inside a chunk, one on a
chunk edge), an empty sequence, per-sequence initial states, ngroups 2, non-default attributes (chunk size, no
softplus, a dt clamp: referenced in the body), dt*A summing to -4,000 per 256 tokens, fp16 and bf16, and
offsets that break the contract (NaN in every output element).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from m2export import contract
from m2export.contract import SSMScanAttrs
from m2export.exporter.ssm_scan_op import ssm_scan_packed_node_model
from m2export.kernels.ssd.packed import ssm_scan_packed_recurrent
from tests.helpers import assert_close, assert_cumsum_trt_safe, packed_large_decay_case, stable_seed
from tests.kernels.test_ssd_packed import PACKS, _packed_inputs

ort = pytest.importorskip("onnxruntime")

REL = {"float32": 2e-5, "float16": 5e-3}


def _session(model: onnx.ModelProto):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _feeds(inp: dict, cu: torch.Tensor) -> dict:
    return {n: (cu if n == "cu_seqlens" else inp[n]).numpy() for n in contract.PACKED_INPUT_NAMES}


@pytest.mark.parametrize("inline", [False, True], ids=["function", "inlined"])
@pytest.mark.parametrize("pack", PACKS, ids=[c[0] for c in PACKS])
def test_packed_body_matches_the_oracle(pack, inline):
    name, lengths = pack
    model = ssm_scan_packed_node_model(SSMScanAttrs(chunk_size=64), inline=inline)
    onnx.checker.check_model(model, full_check=True)
    if inline:
        assert not any(n.domain == contract.OP_DOMAIN for n in model.graph.node)
    p, inp, cu = _packed_inputs(lengths, "float32", seed=stable_seed(name, "onnx"))
    ref = ssm_scan_packed_recurrent(**inp, cu_seqlens=cu)
    y, fs = _session(model).run(list(contract.PACKED_OUTPUT_NAMES), _feeds(inp, cu))
    assert y.shape == tuple(ref.y.shape) and fs.shape == (len(lengths), p.nheads, p.headdim, p.d_state)
    assert_close(f"{name} y", ref.y, torch.from_numpy(y), rel=REL["float32"])
    assert_close(f"{name} final_state", ref.final_state, torch.from_numpy(fs), rel=REL["float32"])
    for s, n in enumerate(lengths):  # an empty sequence hands its initial state through unchanged
        if n == 0:
            assert np.array_equal(fs[s], inp["initial_state"][s].numpy())


def test_attributes_reach_the_inner_scan():
    """chunk_size 16 (boundaries inside chunks), dt_softplus 0 and a dt clamp: the oracle with the same settings;
    the same inputs without the clamp differ (so the attributes were not dropped)."""
    attrs = SSMScanAttrs(chunk_size=16, dt_softplus=False, dt_min=0.05, dt_max=0.3)
    p, inp, cu = _packed_inputs([20, 1, 37], "float32", seed=11)
    inp["dt"] = inp["dt"].abs() + 0.01
    ref = ssm_scan_packed_recurrent(**inp, cu_seqlens=cu, dt_softplus=False, dt_limit=(0.05, 0.3))
    other = ssm_scan_packed_recurrent(**inp, cu_seqlens=cu, dt_softplus=False)
    y, fs = _session(ssm_scan_packed_node_model(attrs)).run(None, _feeds(inp, cu))
    assert_close("y", ref.y, torch.from_numpy(y), rel=2e-5)
    assert_close("final_state", ref.final_state, torch.from_numpy(fs), rel=2e-5)
    assert (ref.y - other.y).norm() / ref.y.norm() > 1e-2


def test_packed_fp16_graph():
    p, inp, cu = _packed_inputs([63, 65, 3], "float16", seed=12)
    ref = ssm_scan_packed_recurrent(**inp, cu_seqlens=cu)
    y, fs = _session(ssm_scan_packed_node_model(SSMScanAttrs(chunk_size=64), dtype="float16")).run(
        None, _feeds(inp, cu))
    assert y.dtype == np.float16 and fs.dtype == np.float32
    assert_close("fp16 y", ref.y, torch.from_numpy(y.astype(np.float32)), rel=REL["float16"])
    assert_close("fp16 final_state", ref.final_state, torch.from_numpy(fs), rel=REL["float16"])


def test_packed_contract_is_the_unpacked_one_plus_offsets():
    assert contract.PACKED_INPUT_NAMES == contract.INPUT_NAMES + ("cu_seqlens",)
    assert contract.PACKED_INPUTS[7].dims[0] == "nseq" and not contract.PACKED_INPUTS[7].optional
    assert contract.PACKED_OUTPUTS[1].dims[0] == "nseq"
    assert contract.packed_output_shapes((1, 300, 8, 64), (1, 300, 2, 128), (4,))[1] == (3, 8, 64, 128)


@pytest.mark.parametrize("inline", [False, True], ids=["function", "inlined"])
def test_no_sequences_gives_final_state_of_its_declared_shape(inline):
    """cu_seqlens [0] (no sequences, no tokens): final_state is (0, nheads, headdim, d_state) as declared (the
    Loop's scan output of zero iterations was (0, 0, 0, 0)) and y is (1, 0, nheads, headdim)."""
    model = ssm_scan_packed_node_model(SSMScanAttrs(chunk_size=64), inline=inline)
    p, inp, _ = _packed_inputs([3], "float32", seed=5)
    feeds = {n: inp[n].numpy() for n in contract.PACKED_INPUT_NAMES[:-1]}
    for n in ("x", "dt", "B", "C"):
        feeds[n] = feeds[n][:, :0]
    feeds["initial_state"] = feeds["initial_state"][:0]
    feeds["cu_seqlens"] = np.zeros(1, np.int32)
    y, fs = _session(model).run(list(contract.PACKED_OUTPUT_NAMES), feeds)
    assert y.shape == (1, 0, p.nheads, p.headdim)
    assert fs.shape == (0, p.nheads, p.headdim, p.d_state)


def test_packed_body_has_no_loop_and_trt_safe_cumsums():
    model = ssm_scan_packed_node_model(SSMScanAttrs(chunk_size=64), inline=True)
    ops = {n.op_type for n in model.graph.node}
    assert not ops & {"Loop", "Scan", "If"}, ops
    assert_cumsum_trt_safe(model.graph.node)


def test_packed_large_decay_sums():
    """dt*A summing to about -4,000 per 256 tokens (issue 16) with boundaries inside chunks: segment sums from
    their own terms, within 5e-6 of the float64 oracle (a difference of cumulative sums misses by 3e-5 .. 1e-4)."""
    inp, cu = packed_large_decay_case()
    ref = ssm_scan_packed_recurrent(**inp, cu_seqlens=cu)
    y, fs = _session(ssm_scan_packed_node_model(SSMScanAttrs(chunk_size=256))).run(None, _feeds(inp, cu))
    assert np.isfinite(y).all() and np.isfinite(fs).all()
    assert_close("y", ref.y, torch.from_numpy(y), rel=5e-6)
    assert_close("final_state", ref.final_state, torch.from_numpy(fs), rel=5e-6)


def test_packed_bf16_graph():
    """bf16 x/dt/B/C (fp32 inside); ONNX Runtime's CPU provider runs the body (Casts only touch bf16)."""
    p, inp, cu = _packed_inputs([63, 65, 1], "bfloat16", seed=13)
    ref = ssm_scan_packed_recurrent(**inp, cu_seqlens=cu)
    model = ssm_scan_packed_node_model(SSMScanAttrs(chunk_size=64), dtype="bfloat16")
    # y leaves as bf16; a Cast to float32 after the node hands it to numpy (which has no bf16)
    model.graph.node[0].output[0] = "y_bf16"
    model.graph.node.append(onnx.helper.make_node("Cast", ["y_bf16"], ["y"], to=onnx.TensorProto.FLOAT))
    model.graph.output[0].type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    feeds = {n: (cu if n == "cu_seqlens" else inp[n]) for n in contract.PACKED_INPUT_NAMES}
    try:
        sess = _session(model)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"ONNX Runtime cannot load a bf16 graph here: {e}")
    ort_feeds = {}
    for n, t in feeds.items():
        if t.dtype == torch.bfloat16:
            ort_feeds[n] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                t.view(torch.int16).numpy(), onnx.TensorProto.BFLOAT16)
        else:
            ort_feeds[n] = ort.OrtValue.ortvalue_from_numpy(t.numpy())
    io = sess.io_binding()
    for n, v in ort_feeds.items():
        io.bind_ortvalue_input(n, v)
    for n in contract.PACKED_OUTPUT_NAMES:
        io.bind_output(n)
    sess.run_with_iobinding(io)
    y_ov, fs_ov = io.get_outputs()
    y = torch.from_numpy(y_ov.numpy())
    assert_close("bf16 y", ref.y, y, rel=2e-2)
    assert_close("bf16 final_state", ref.final_state, torch.from_numpy(fs_ov.numpy()), rel=2e-2)


#: offsets on 10 tokens that break the contract: decreasing, not from 0, past the end, short of the end
BAD_CU = [[0, -1, 10], [2, 5, 10], [0, 5, 12], [0, 5, 8], [0, 7, 3, 10], [0, 0]]


@pytest.mark.parametrize("cu", BAD_CU, ids=[str(c) for c in BAD_CU])
def test_bad_offsets_give_nan_everywhere(cu):
    """The body clamps its indices (so it runs) and poisons: every element of y and final_state is NaN."""
    p, inp, _ = _packed_inputs([10], "float32", seed=14)
    feeds = {n: inp[n].numpy() for n in contract.PACKED_INPUT_NAMES[:-1]}
    feeds["initial_state"] = np.random.default_rng(0).standard_normal(
        (len(cu) - 1, p.nheads, p.headdim, p.d_state)).astype(np.float32)
    feeds["cu_seqlens"] = np.array(cu, np.int32)
    try:
        y, fs = _session(ssm_scan_packed_node_model(SSMScanAttrs(chunk_size=4))).run(None, feeds)
    except Exception as e:  # ORT's own refusal (an index out of range) is also never an answer
        assert "ONNXRuntimeError" in str(e) or "onnxruntime" in type(e).__module__
        return
    assert np.isnan(y).all() and np.isnan(fs).all(), cu


@pytest.mark.parametrize("Q,lens,want", [
    (64, [128, 128, 128, 128], 64),  # no padding at Q
    (64, [32] * 16, 32),  # Q pads to twice the tokens; Q/2 none
    (64, [1000, 8, 8, 8], 32),  # Q pads 19%, Q/2 9%
    (256, [32] * 16, 32),  # down three halvings
    (64, [5] * 16, 16),  # nothing within 1/8: the last candidate (never below 16)
    (8, [3, 3, 3], 8),  # Q below 16 stays
    (64, [], 64),  # no tokens
], ids=["aligned", "16x32", "1000+3x8", "Q256_16x32", "floor16", "small_Q", "empty"])
def test_packed_chunk_length_choice(Q, lens, want):
    from m2export.exporter.ssm_scan_op import _Body, _packed_chunk_len

    b = _Body()
    out = _packed_chunk_len(b, "Q", "lens", "L")
    b.nodes.append(onnx.helper.make_node("Identity", [out], ["chosen"]))
    i64 = onnx.TensorProto.INT64
    g = onnx.helper.make_graph(b.nodes, "choice", [onnx.helper.make_tensor_value_info(n, i64, [None])
                                                   for n in ("Q", "lens", "L")],
                               [onnx.helper.make_tensor_value_info("chosen", i64, [1])])
    m = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 18)])
    m.ir_version = 10
    (got,) = _session(m).run(None, {"Q": np.array([Q]), "lens": np.array(lens, np.int64),
                                    "L": np.array([sum(lens)])})
    assert got.tolist() == [want]


@pytest.mark.parametrize("lengths", [[32] * 6 + [5, 70], [20] * 12 + [1]], ids=["halved_to_32", "down_to_16"])
def test_packs_of_short_sequences_with_a_smaller_chunk(lengths):
    """Packs where the body halves its chunk length (sequences shorter than chunk_size 64) vs the oracle."""
    p, inp, cu = _packed_inputs(lengths, "float32", seed=stable_seed("short", str(lengths)))
    ref = ssm_scan_packed_recurrent(**inp, cu_seqlens=cu)
    y, fs = _session(ssm_scan_packed_node_model(SSMScanAttrs(chunk_size=64))).run(None, _feeds(inp, cu))
    assert_close("y", ref.y, torch.from_numpy(y), rel=REL["float32"])
    assert_close("final_state", ref.final_state, torch.from_numpy(fs), rel=REL["float32"])


@pytest.mark.parametrize("inline", [False, True], ids=["function", "inlined"])
def test_packed_decay_overflowing_to_minus_inf(inline):
    """dt*A = -inf in float32 on some steps of head 0 (A -1e30, dt 1e10): exactly the float64 decay to 0, never
    NaN (the packed body shares the unpacked one's floor of dt*A)."""
    p, inp, cu = _packed_inputs([20, 1, 37], "float32", seed=13)
    inp["A"][0] = -1e30
    inp["dt"][:, ::3, 0] = 1e10
    ref = ssm_scan_packed_recurrent(**inp, cu_seqlens=cu)
    y, fs = _session(ssm_scan_packed_node_model(SSMScanAttrs(chunk_size=16), inline=inline)).run(
        None, _feeds(inp, cu))
    assert np.isfinite(y).all() and np.isfinite(fs).all()
    assert_close("y", ref.y, torch.from_numpy(y), rel=2e-5)
    assert_close("final_state", ref.final_state, torch.from_numpy(fs), rel=2e-5)
