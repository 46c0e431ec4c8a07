"""TorchRunner (a Polygraphy BaseRunner over the PyTorch reference), the token data loader, tolerances."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from m2export.check.compare import parse_tolerances, run_check
from m2export.check.data import (TokenDataLoader, byte_tokens, check_shapes, default_shapes, parse_shapes, stdlib_corpus,
                                 token_windows)
from m2export.check.runners import ModelFromCheckpoint, TorchRunner
from m2export.errors import CheckpointError, M2ExportError
from m2export.exporter.configs import GraphIO
from m2export.models.checkpoint import load_checkpoint


def test_torch_runner_matches_model_and_names(tiny_ck):
    ck = load_checkpoint(tiny_ck)
    cfg = ck.config
    loader = TokenDataLoader(cfg, "fp32", [(2, 19)], seed=1)
    feed = next(iter(loader))
    with TorchRunner(ModelFromCheckpoint(tiny_ck), role="prefill") as r:
        meta = r.get_input_metadata(use_numpy_dtypes=False)
        assert list(meta) == GraphIO.for_model(cfg).input_names()
        out = r.infer(feed)
    assert list(out) == GraphIO.for_model(cfg).output_names()
    ref = ck.model(torch.from_numpy(feed["input_ids"]))
    np.testing.assert_array_equal(out["logits"], ref.logits.detach().numpy())
    np.testing.assert_array_equal(out["present_ssm_state.1"], ref.ssm_states[1].detach().numpy())
    assert out["logits"].shape == (2, 19, cfg.vocab_size)  # not the padded lm_head rows (112)


def test_torch_runner_decode_continues_prefill(tiny_ck):
    """prefill(N) then decode(1) with the returned states == prefill(N + 1) (last position)."""
    ck = load_checkpoint(tiny_ck)
    feed = next(iter(TokenDataLoader(ck.config, "fp32", [(1, 9)], seed=2)))
    with TorchRunner(ck, role="prefill") as pre, TorchRunner(ck, role="decode") as dec:
        a = pre.infer({**feed, "input_ids": feed["input_ids"][:, :8]})
        step = {"input_ids": feed["input_ids"][:, 8:]}
        step.update(GraphIO.for_model(ck.config).next_past(a))
        b = dec.infer(step)
        full = pre.infer(feed)
    np.testing.assert_allclose(b["logits"][:, -1], full["logits"][:, -1], atol=1e-5)


def test_base_runner_checks_feed_dict(tiny_ck):
    """Polygraphy's BaseRunner.infer checks names/dtypes against get_input_metadata_impl."""
    from polygraphy.exception import PolygraphyException

    ck = load_checkpoint(tiny_ck)
    feed = next(iter(TokenDataLoader(ck.config, "fp32", [(1, 4)])))
    feed["input_ids"] = feed["input_ids"].astype(np.int32)
    with TorchRunner(ck) as r, pytest.raises(PolygraphyException, match="input_ids"):
        r.infer(feed)


def test_reference_hash_mismatch(tiny_ck):
    with pytest.raises(CheckpointError, match="differs from the exported checkpoint"):
        ModelFromCheckpoint(tiny_ck, expected_sha256="0" * 64)()


def test_data_loader_real_tokens_deterministic(tiny_ck):
    cfg = load_checkpoint(tiny_ck).config
    shapes = default_shapes(cfg)
    assert shapes == [(1, 1), (3, 7), (1, 16), (2, 17), (1, 35)]  # 1 token .. two chunks + 3 (chunk_size 16)
    a = list(TokenDataLoader(cfg, "fp32", shapes, seed=5))
    b = list(TokenDataLoader(cfg, "fp32", shapes, seed=5))
    corpus = stdlib_corpus()
    for fa, fb, (bs, s) in zip(a, b, shapes):
        assert fa["input_ids"].shape == (bs, s) and fa["input_ids"].dtype == np.int64
        np.testing.assert_array_equal(fa["input_ids"], fb["input_ids"])
        assert bytes(fa["input_ids"][0].astype(np.uint8)) in corpus  # a real window of the corpus
        assert not fa["past_ssm_state.0"].any() and fa["past_ssm_state.0"].dtype == np.float32
        assert fa["past_conv_state.1"].shape == (bs, cfg.conv_dim, cfg.d_conv - 1)
    assert b"def " in corpus and len(corpus) > 100_000



def test_data_loader_continued_feeds_carry_reference_states(tiny_ck):
    """With the reference, every size is fed fresh and then continued: the continued feed's past states are
    the reference's states after the preceding tokens (non-zero), so prefill(past) + prefill(feed) reproduces
    one prefill over the whole window."""
    ck = load_checkpoint(tiny_ck)
    cfg = ck.config
    shapes = [(1, 5), (2, 17)]
    loader = TokenDataLoader(cfg, "fp32", shapes, seed=4, reference=ck, vocab_sweep=False)
    feeds = list(loader)
    assert len(loader) == len(feeds) == 4 and loader.past_len == cfg.chunk_size + 3
    assert loader.labels == ["1x5", "1x5 after 19", "2x17", "2x17 after 19"]
    # the loader says which feeds continue (the check's progress read it from "after" in the label)
    assert [f.continues for f in loader.feeds] == [False, True, False, True]
    fresh = list(TokenDataLoader(cfg, "fp32", shapes, seed=4, vocab_sweep=False))  # the fresh feeds are unchanged
    for a, b in zip(feeds[::2], fresh):
        assert all(np.array_equal(a[k], b[k]) for k in b)
    corpus = stdlib_corpus()
    for feed, (bs, s) in zip(feeds[1::2], shapes):
        assert list(feed) == GraphIO.for_model(cfg).input_names()
        assert feed["input_ids"].shape == (bs, s)
        for i in range(cfg.n_layer):
            assert np.all(np.abs(feed[f"past_ssm_state.{i}"]).max(axis=(1, 2, 3)) > 1e-3)
            assert np.all(np.abs(feed[f"past_conv_state.{i}"]).max(axis=(1, 2)) > 1e-3)
            assert feed[f"past_conv_state.{i}"].dtype == np.float32
        assert bytes(feed["input_ids"][0].astype(np.uint8)) in corpus
    # the states are the reference's: continuing from them == one prefill over prefix + window
    feed = feeds[3]
    n = cfg.n_layer
    with torch.no_grad():
        cont = ck.model(torch.from_numpy(feed["input_ids"]),
                        [torch.from_numpy(feed[f"past_conv_state.{i}"]) for i in range(n)],
                        [torch.from_numpy(feed[f"past_ssm_state.{i}"]) for i in range(n)])
    prefix_len = loader.past_len
    rng = np.random.default_rng([4, 1])  # the continued windows' stream (see TokenDataLoader.__iter__)
    toks = byte_tokens(stdlib_corpus(), cfg.vocab_size)
    token_windows(toks, 1, prefix_len + 5, rng)
    whole = token_windows(toks, 2, prefix_len + 17, rng)
    np.testing.assert_array_equal(whole[:, prefix_len:], feed["input_ids"])
    with torch.no_grad():
        full = ck.model(torch.from_numpy(whole))
    np.testing.assert_allclose(cont.logits.numpy(), full.logits[:, prefix_len:].numpy(), atol=1e-4)
    np.testing.assert_allclose(cont.ssm_states[1].numpy(), full.ssm_states[1].numpy(), atol=1e-4)

@pytest.mark.parametrize("bad", [(1, 0), (0, 4), (2, -1), (1.5, 2), (1, 2, 3)])
def test_run_check_refuses_an_empty_prompt_or_batch_in_one_line(tiny_out, tmp_path, bad):
    """An empty prompt (sequence_length 0) or batch given to the library's ``run_check`` is refused by name before
    anything runs: the graphs cannot refuse it themselves (ONNX Runtime fails inside a kernel) and the reference
    stopped with torch's conv error (sequence_length 0) or numpy's "need at least one array to stack" (batch 0)."""
    with pytest.raises(M2ExportError, match=r"shapes`?: bad item .*expected BATCHxSEQLEN with positive integers"):
        run_check(tiny_out, shapes=[(1, 4), bad], report_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()
    assert check_shapes([(1, 1), [2, 64]]) == [(1, 1), (2, 64)]


def test_parse_shapes_and_tolerances():
    assert parse_shapes("1x1, 2X64") == [(1, 1), (2, 64)]
    with pytest.raises(M2ExportError, match="bad item '2x'"):
        parse_shapes("1x1,2x")
    names = ["logits", "present_conv_state.0", "present_ssm_state.0", "present_ssm_state.1"]
    t = parse_tolerances(["1e-3", "logits:0.5", "present_ssm_state.*:2e-2"], {"": 1e-4}, names, "--atol")
    assert t == {"": 1e-3, "logits": 0.5, "present_ssm_state.0": 2e-2, "present_ssm_state.1": 2e-2}
    with pytest.raises(M2ExportError, match="no output named 'logit'"):
        parse_tolerances(["logit:1"], {"": 1e-4}, names, "--atol")
    with pytest.raises(M2ExportError, match="expected VALUE or NAME:VALUE"):
        parse_tolerances(["logits:abc"], {"": 1e-4}, names, "--rtol")


def test_onnxrt_sessions_on_shared_weights_have_no_arena_and_match(tiny_out, tiny_ck):
    """A session on SharedInitializers (the check's) runs without ONNX Runtime's CPU arena (its tensors come from
    and go back to the heap the check trims) and returns exactly what a plain session (generate's) returns."""
    from m2export.check.runners import SharedInitializers, onnxrt_runner

    cfg = load_checkpoint(tiny_ck).config
    feed = next(iter(TokenDataLoader(cfg, "fp32", [(2, 21)], seed=3)))
    shared = SharedInitializers()
    try:
        with onnxrt_runner(tiny_out / "model.onnx", shared=shared) as a, onnxrt_runner(tiny_out / "model.onnx") as b:
            assert not a.sess.get_session_options().enable_cpu_mem_arena
            assert b.sess.get_session_options().enable_cpu_mem_arena
            got, want = a.infer(feed), b.infer(feed)
    finally:
        shared.release()
    assert list(got) == list(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


def test_torch_outputs_own_their_memory():
    """The reference's outputs: a whole tensor of the right dtype is handed over without a copy (a long input's
    logits are hundreds of MB); a view is copied compactly (it would keep its larger buffer alive)."""
    from m2export.check.runners import _own_numpy

    t = torch.arange(24.0).reshape(2, 3, 4)
    whole = _own_numpy(t, np.float32)
    assert np.shares_memory(whole, t.numpy()) and whole.dtype == np.float32
    view = _own_numpy(t[:, -1], np.float32)
    assert not np.shares_memory(view, t.numpy()) and view.flags.c_contiguous and view.nbytes == 2 * 4 * 4
    np.testing.assert_array_equal(view, t[:, -1].numpy())
    half = _own_numpy(t, np.float16)
    assert half.dtype == np.float16 and not np.shares_memory(half, t.numpy())
