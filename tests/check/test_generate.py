"""m2export.generate: ORT greedy == torch greedy (both flavours), sampling, tokenizers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from m2export.errors import BackendUnavailable, ExportFolderError, M2ExportError
from m2export.generate import ByteTokenizer, choose_tokenizer, generate, open_runtime, sample_next
from m2export.models.checkpoint import load_checkpoint

PROMPT = list(b"def main(argv):\n    ")


@pytest.mark.parametrize("ssm_impl", ["ssmscan", "std"])
def test_ort_greedy_equals_torch_greedy(tiny_out, tiny_ck, ssm_impl):
    n = 24
    ort = generate(tiny_out, PROMPT, runtime="onnxrt", ssm_impl=ssm_impl, max_new_tokens=n)
    pt = generate(tiny_out, PROMPT, runtime="torch", max_new_tokens=n)
    ref = load_checkpoint(tiny_ck).model.generate_greedy(torch.tensor([PROMPT]), n)[0].tolist()
    assert ort.new_ids == pt.new_ids == ref
    assert len(ort.new_ids) == n and ort.tokens_per_s > 0 and ort.prefill_s > 0
    from m2export.exporter import ort_generate_greedy  # the exporter's own loop agrees too

    exp = ort_generate_greedy(tiny_out, np.array([PROMPT]), n, ssm_impl=ssm_impl)
    assert np.asarray(exp).reshape(-1)[-n:].tolist() == ref


def test_torch_from_checkpoint_and_sampling(tiny_ck, tiny_out):
    s = open_runtime(tiny_ck, "torch")
    greedy = generate(tiny_ck, PROMPT, runtime="torch", max_new_tokens=8, session=s)
    top1 = generate(tiny_ck, PROMPT, runtime="torch", max_new_tokens=8, temperature=1.0, top_k=1, session=s)
    assert top1.new_ids == greedy.new_ids  # top-k 1 is greedy
    a = generate(tiny_out, PROMPT, runtime="onnxrt", max_new_tokens=12, temperature=1.5, seed=7)
    b = generate(tiny_out, PROMPT, runtime="onnxrt", max_new_tokens=12, temperature=1.5, seed=7)
    assert a.new_ids == b.new_ids  # seeded
    assert generate(tiny_out, PROMPT, runtime="onnxrt", max_new_tokens=0).new_ids == []


def test_sample_next():
    rng = np.random.default_rng(0)
    logits = np.array([0.0, 5.0, 4.9, -3.0])
    assert sample_next(logits, temperature=0, top_k=0, rng=rng) == 1
    draws = {sample_next(logits, temperature=1.0, top_k=2, rng=rng) for _ in range(200)}
    assert draws == {1, 2}  # only the two largest survive top-k 2


def test_tokenizers():
    t = ByteTokenizer()
    assert t.decode(t.encode("héllo")) == "héllo"
    assert isinstance(choose_tokenizer(256, None), ByteTokenizer)
    with pytest.raises(M2ExportError, match="not 256 bytes"):
        choose_tokenizer(50277, None)
    with pytest.raises(M2ExportError, match="no such file"):
        choose_tokenizer(50277, "/nonexistent/tokenizer.json")


def test_tokenizer_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = tokenizers.Tokenizer(WordLevel({"[UNK]": 0, "def": 1, "main": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    t = choose_tokenizer(3, tmp_path / "tokenizer.json")
    assert t.encode("def main") == [1, 2] and t.decode([1, 2]) == "def main"


def test_errors(tiny_out, tiny_ck, tmp_path, monkeypatch):
    from m2export import backends

    with pytest.raises(ExportFolderError, match="no such file or directory"):
        open_runtime(tmp_path / "missing", "onnxrt")
    with pytest.raises(ExportFolderError, match="not an m2export output folder"):
        open_runtime(tiny_ck, "onnxrt")
    # no engines: exit 4 while TensorRT is unusable (checked first), exit 1 once it is usable
    with monkeypatch.context() as mp:
        mp.setattr(backends, "tensorrt_unavailable_reason", lambda **kw: "no CUDA GPU")
        with pytest.raises(BackendUnavailable, match="cannot run TensorRT engines here: no CUDA GPU"):
            open_runtime(tiny_out, "trt")
        mp.setattr(backends, "tensorrt_unavailable_reason", lambda **kw: None)
        with pytest.raises(ExportFolderError, match="no TensorRT engines"):
            open_runtime(tiny_out, "trt")
    with pytest.raises(M2ExportError, match="outside the vocabulary"):
        generate(tiny_out, [300], runtime="onnxrt", max_new_tokens=1)
    with pytest.raises(M2ExportError, match="empty prompt"):
        generate(tiny_out, [], runtime="onnxrt", max_new_tokens=1)
    from m2export.backends import tensorrt_available

    if not tensorrt_available():
        from m2export.check.runners import trt_runner

        with pytest.raises(BackendUnavailable, match="TensorRT is not installed"):
            trt_runner(tmp_path / "model.plan")


def test_bf16_generate(tiny_out_bf16):
    """bf16: ORT refuses (exit-4 error, with the alternative); ONNX's reference evaluator runs it."""
    with pytest.raises(BackendUnavailable, match="bf16 export cannot run on ONNX Runtime"):
        open_runtime(tiny_out_bf16, "onnxrt")
    res = generate(tiny_out_bf16, PROMPT, runtime="onnx-reference", max_new_tokens=6)
    assert len(res.new_ids) == 6 and all(0 <= t < 256 for t in res.new_ids)
