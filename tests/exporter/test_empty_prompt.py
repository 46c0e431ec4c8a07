"""An empty prompt (input_ids of shape (batch, 0)): every m2export entry point refuses it with one line, and so does
onnxruntime-genai; the ssmscan and packed graphs themselves return empty logits and the states unchanged (the std
and native ones fail in ONNX Runtime's Conv: m2export/exporter/configs.py)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from m2export.cli.main import main
from m2export.errors import ExitCode, ParameterError
from m2export.exporter import OrtModel, export_model


@pytest.mark.parametrize("impl", ["ssmscan", "std", "native"])
def test_runners_refuse_an_empty_prompt(export_fp32_both, impl):
    """OrtModel / Decoder (under generate and check): one line naming input_ids, whatever the flavour (the std and
    native graphs failed inside ONNX Runtime: 'Non-zero status code returned while running Conv node ... Invalid
    input shape: {3}'; the ssmscan one answered)."""
    m = OrtModel(export_fp32_both, impl)
    with pytest.raises(ParameterError) as e:
        m.run(np.zeros((2, 0), np.int64))
    assert str(e.value) == ("input_ids of shape (2, 0): expected (batch, sequence_length) with sequence_length >= 1 "
                            "(an empty prompt has no token to continue from)")
    assert m.run(np.zeros((2, 1), np.int64))["logits"].shape[:2] == (2, 1)  # one token is fine


@pytest.mark.parametrize("prompt", [["--prompt", ""], ["--prompt-ids", ""]])
def test_generate_refuses_an_empty_prompt(tiny_out, capsys, prompt):
    rc = main(["generate", str(tiny_out), *prompt, "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert rc == ExitCode.USER_ERROR and err.splitlines()[0] == "error: empty prompt: give at least one token", err
    assert out == "" and "Traceback" not in err


def test_genai_refuses_an_empty_prompt(export_fp32_both):
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is a test-only dependency")
    model = og.Model(str(export_fp32_both))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=8, do_sample=False)
    gen = og.Generator(model, params)
    with pytest.raises(RuntimeError, match="^input_ids is empty$"):
        gen.append_tokens([])


def _feeds(sess, ids, rng):
    feeds = {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = ids
        elif i.name == "cu_seqlens":
            feeds[i.name] = np.zeros(3, np.int32)  # two sequences of no token
        else:
            feeds[i.name] = rng.standard_normal([2 if isinstance(d, str) else d for d in i.shape]).astype(np.float32)
    return feeds


def test_ssmscan_and_packed_graphs_pass_the_states_through(tiny_g2, tmp_path):
    """The graphs as any ONNX Runtime user runs them: sequence_length 0 (packed: total_tokens 0 over two sequences)
    gives empty logits and every present state equal to its past state, bit for bit."""
    out = tmp_path / "out"
    export_model(tiny_g2, out, ssm_impl="ssmscan", packed_prefill=True)
    rng = np.random.default_rng(0)
    for graph, ids in (("model.onnx", np.zeros((2, 0), np.int64)), ("model.packed.onnx", np.zeros((1, 0), np.int64))):
        sess = ort.InferenceSession(str(out / graph), providers=["CPUExecutionProvider"])
        feeds = _feeds(sess, ids, rng)
        res = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        assert res["logits"].shape[:2] == ids.shape, graph
        past = {k: v for k, v in feeds.items() if k.startswith("past_")}
        assert past and all(np.array_equal(res["present_" + k[len("past_"):]], v) for k, v in past.items()), graph
