"""GraphIO (the one description of graph I/O) and Decoder (the one prefill-then-decode loop), without a model.

A stand-in layer stack (one Mamba layer, one attention layer) exercises the KV-cache names and axes;
a numpy "model" whose state is the running token sum (Mamba-like, fixed size) and the token history
(KV-like, growing) checks that run_sequence feeds every present back as the matching past.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from m2export.exporter.configs import BATCH, PAST_SEQ, GraphIO, StateSpec
from m2export.exporter.runtime import Decoder, feed_dtype_of, numpy_dtype
from m2export.models.config import Mamba2Config

VOCAB = 16


class _Stack:
    """What a layer-stack description offers the exporter: ``states()`` and ``vocab_size`` (the logits' width)."""

    vocab_size = VOCAB

    def states(self):
        return (StateSpec(0, "conv_state", (BATCH, 6, 3), "model"), StateSpec(0, "ssm_state", (BATCH, 2, 4, 8), "float32"),
                StateSpec(1, "key", (BATCH, 2, PAST_SEQ, 4), "model"), StateSpec(1, "value", (BATCH, 2, PAST_SEQ, 4), "model"))


def test_names_axes_dtypes_of_a_hybrid_stack():
    io = GraphIO.for_model(_Stack(), "fp16")
    assert io.input_names() == ["input_ids", "past_conv_state.0", "past_ssm_state.0", "past_key_values.1.key",
                                "past_key_values.1.value"]
    assert io.output_names() == ["logits", "present_conv_state.0", "present_ssm_state.0", "present.1.key",
                                 "present.1.value"]
    assert io.input("past_key_values.1.key").shape == ("batch_size", 2, "past_sequence_length", 4)
    assert io.output("present.1.value").shape == ("batch_size", 2, "past_sequence_length + sequence_length", 4)
    assert io.output("logits").shape == ("batch_size", "sequence_length", VOCAB)
    assert {t.name: t.dtype for t in io.inputs} == {
        "input_ids": "int64", "past_conv_state.0": "float16", "past_ssm_state.0": "float32",
        "past_key_values.1.key": "float16", "past_key_values.1.value": "float16"}
    assert [(s.layer, s.kind, s.past.name, s.present.name) for s in io.states][2] == (
        1, "key", "past_key_values.1.key", "present.1.key")
    assert io.output("present.1.key").concrete(batch_size=3, past_sequence_length=5, sequence_length=2) == (3, 2, 7, 4)
    with pytest.raises(KeyError, match="sequence_length"):
        io.output("present.1.key").concrete(batch_size=3, past_sequence_length=5)


def test_zero_feeds_and_manifest_round_trip():
    io = GraphIO.for_model(_Stack(), "bf16")
    z = io.zero_feeds(2, numpy_dtype)
    assert z["past_key_values.1.key"].shape == (2, 2, 0, 4)  # a fresh sequence has no past tokens
    assert z["past_conv_state.0"].dtype.name == "bfloat16" and z["past_ssm_state.0"].dtype == np.float32
    assert io.zero_feeds(1, feed_dtype_of)["past_conv_state.0"].dtype == np.float32  # bf16 carried as float32
    j = io.to_manifest()
    assert GraphIO.from_manifest(j["inputs"], j["outputs"], j["states"]) == io


def test_pure_mamba2_config():
    cfg = Mamba2Config(d_model=32, n_layer=3, vocab_size=50, d_state=8, headdim=16, ngroups=2, chunk_size=8)
    io = GraphIO.for_model(cfg, "fp32", decode=True)
    assert io.input("input_ids").shape == ("batch_size", 1)
    assert [s.kind for s in io.states] == ["conv_state", "ssm_state"] * 3
    assert io.input("past_conv_state.2").shape == ("batch_size", cfg.conv_dim, cfg.d_conv - 1)
    assert io.input("past_ssm_state.1").shape == ("batch_size", cfg.nheads, cfg.headdim, cfg.d_state)
    assert cfg.vocab_size_padded == 64  # the lm_head's rows; the logits have the true vocabulary's width
    assert io.output("logits").shape == ("batch_size", 1, cfg.vocab_size)


def test_state_layout_per_flavour():
    """The native flavour's ssm_state is (batch, nheads, d_state, headdim) (ORT LinearAttention's), its conv_state
    the model's; ssmscan and std keep the model's (batch, nheads, headdim, d_state), as does no flavour; the manifest records the layout per
    state and reads it back; an entry without one (written before the field) has the model's."""
    cfg = Mamba2Config(d_model=32, n_layer=2, vocab_size=50, d_state=8, headdim=16, ngroups=2, chunk_size=8)
    model = ("batch_size", cfg.nheads, cfg.headdim, cfg.d_state)
    for flavour in (None, "ssmscan", "std"):
        io = GraphIO.for_model(cfg, "fp32", flavour=flavour)
        assert io.input("past_ssm_state.1").shape == io.output("present_ssm_state.1").shape == model
        assert all(s.perm is None for s in io.states)
    io = GraphIO.for_model(cfg, "fp16", flavour="native")
    ssm = io.state("present_ssm_state.1")
    assert ssm is io.state("past_ssm_state.1") and ssm.kind == "ssm_state"
    assert ssm.layout == ("batch_size", "nheads", "d_state", "headdim") and ssm.perm == (0, 1, 3, 2)
    assert ssm.past.shape == ssm.present.shape == ("batch_size", cfg.nheads, cfg.d_state, cfg.headdim)
    conv = io.state("past_conv_state.0")  # the model's, as the channels-first CausalConvWithState keeps it
    assert conv.layout == ("batch_size", "conv_dim", "d_conv - 1") and conv.perm is None
    assert conv.past.shape == conv.present.shape == ("batch_size", cfg.conv_dim, cfg.d_conv - 1)
    assert io.zero_feeds(3, numpy_dtype)["past_ssm_state.0"].shape == (3, cfg.nheads, cfg.d_state, cfg.headdim)
    a = np.random.default_rng(0).standard_normal((3, *model[1:])).astype(np.float32)
    g = ssm.to_graph_layout(a)
    assert g.shape == (3, cfg.nheads, cfg.d_state, cfg.headdim) and g.flags.c_contiguous
    np.testing.assert_array_equal(g[1, 2, 5, 7], a[1, 2, 7, 5])
    np.testing.assert_array_equal(ssm.to_model_layout(g), a)
    c = a[:, :, :, 0]
    np.testing.assert_array_equal(conv.to_model_layout(conv.to_graph_layout(c)), c)
    model_conv = GraphIO.for_model(cfg, "fp16").state("past_conv_state.0")
    assert model_conv.to_graph_layout(c) is c and model_conv.to_model_layout(c) is c
    j = io.to_manifest()
    rec = {s["past"]: s["layout"] for s in j["states"]}
    assert rec["past_ssm_state.0"] == ["batch_size", "nheads", "d_state", "headdim"]
    assert rec["past_conv_state.0"] == ["batch_size", "conv_dim", "d_conv - 1"]
    assert GraphIO.from_manifest(j["inputs"], j["outputs"], j["states"]) == io
    old = GraphIO.for_model(cfg, "fp32").to_manifest()
    for st in old["states"]:
        del st["layout"]
    assert GraphIO.from_manifest(old["inputs"], old["outputs"], old["states"]) == GraphIO.for_model(cfg, "fp32")
    with pytest.raises(ValueError, match="flavour"):
        GraphIO.for_model(cfg, "fp32", flavour="trt")


def _toy_infer(feed):
    """Logits one-hot at (sum of all tokens so far + number of past tokens) % VOCAB; states: the running
    sum (ssm_state[..., 0, 0, 0]) and the token history (key[:, 0, :, 0])."""
    ids = feed["input_ids"]
    b, L = ids.shape
    key = np.concatenate([feed["past_key_values.1.key"], np.zeros((b, 2, L, 4), np.float16)], axis=2)
    key[:, 0, key.shape[2] - L:, 0] = ids
    ssm = feed["past_ssm_state.0"].copy()
    logits = np.zeros((b, L, VOCAB), np.float16)
    for t in range(L):
        ssm[:, 0, 0, 0] += ids[:, t]
        past = key.shape[2] - L + t
        logits[np.arange(b), t, ((ssm[:, 0, 0, 0] + past) % VOCAB).astype(int)] = 1
    return OrderedDict([("logits", logits), ("present_conv_state.0", feed["past_conv_state.0"] + 1),
                        ("present_ssm_state.0", ssm), ("present.1.key", key), ("present.1.value", key.copy())])


def test_run_sequence_feeds_presents_back():
    io = GraphIO.for_model(_Stack(), "fp16")
    calls = []

    def decode(feed):
        calls.append({k: v.shape for k, v in feed.items()})
        return _toy_infer(feed)

    dec = Decoder(io, _toy_infer, decode)
    prompt = np.array([[1, 2, 3], [4, 5, 6]])
    steps = list(dec.run_sequence(prompt, 4))
    assert [s.index for s in steps] == [0, 1, 2, 3, 4] and steps[-1].next_tokens is None
    assert calls[-1]["past_key_values.1.key"] == (2, 2, 6, 4) and calls[-1]["input_ids"] == (2, 1)
    assert (steps[-1].outputs["present_conv_state.0"] == 5).all()  # +1 per call, fed back each time
    # greedy over the toy model == recomputing each token from the full history
    hist = prompt.tolist()
    for st in steps[:-1]:
        for b in range(2):
            assert st.next_tokens[b] == (sum(hist[b]) + len(hist[b]) - 1) % VOCAB
            hist[b].append(int(st.next_tokens[b]))
    np.testing.assert_array_equal(steps[-1].outputs["present.1.key"][:, 0, :, 0], np.array(hist)[:, :7])
    toks = dec.generate_greedy(prompt, 4)
    np.testing.assert_array_equal(toks, np.array(hist)[:, 3:7])


def test_run_sequence_choose_callback_and_one_graph():
    io = GraphIO.for_model(_Stack(), "fp16")
    dec = Decoder(io, _toy_infer)  # no decode callable: the prefill one serves decode steps
    seen = []
    forced = [np.array([7, 7]), np.array([0, 1])]
    for st in dec.run_sequence(np.array([[1], [2]]), 2, lambda k, last: (seen.append(last.shape), forced[k])[1]):
        pass
    assert seen == [(2, VOCAB), (2, VOCAB)]
    np.testing.assert_array_equal(st.outputs["present.1.key"][:, 0, :, 0], [[1, 7, 0], [2, 7, 1]])
