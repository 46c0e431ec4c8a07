"""What the command line says: help texts that state measured or checkable facts, and messages read as sentences
(plurals, no dangling separators, aligned columns, the hint that fits the folder)."""

from __future__ import annotations

import re

import pytest

from m2export.cli.main import main


def _help(verb: str, capsys) -> str:
    with pytest.raises(SystemExit):
        main([verb, "--help"])
    return capsys.readouterr().out


def test_native_flavour_help_says_any_number_of_tokens(capsys):
    """export --help said CausalConvWithState 'for one token'; the native graph has one per layer for any length
    (m2export/exporter/native_ort.py: fuse_causal_conv), and so does ONNX's opset-27 op it mirrors."""
    text = " ".join(_help("export", capsys).split())
    native = text[text.index("native ONNX Runtime's fused kernels"):text.index("both ssmscan as model.onnx")]
    assert "for any number of tokens" in native and "one token" not in native, native
    for op in ("LinearAttention", "CausalConvWithState", "SkipSimplifiedLayerNormalization"):
        assert op in native


def test_every_random_checkpoint_option_has_help(capsys):
    """--format had no help text: every option of random-checkpoint says what it does."""
    from m2export.cli.main import build_parser

    import argparse

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["random-checkpoint"]
    bare = [a.option_strings[-1] for a in sub._actions if a.option_strings and not a.help
            and a.dest not in {"d_model", "n_layer", "vocab_size", "d_state", "headdim", "ngroups", "expand",
                               "d_conv", "chunk_size"}]  # the shape flags: their group's title says it
    assert bare == []


def test_tiny_mamba2_preset_is_a_pure_mamba2_checkpoint(tmp_path):
    from m2export.models.checkpoint import load_checkpoint

    assert main(["random-checkpoint", "--preset", "tiny-mamba2", "-o", str(tmp_path / "ck"), "-q"]) == 0
    ck = load_checkpoint(tmp_path / "ck")
    assert ck.format == "mamba_ssm" and ck.config.n_layer == 2 and ck.config.ngroups == 2
    assert main(["random-checkpoint", "--preset", "tiny-mamba2", "--format", "hf", "-o", str(tmp_path / "hf"),
                 "-q"]) == 0
    assert load_checkpoint(tmp_path / "hf").format == "hf"


def test_random_checkpoint_help_says_what_init_hybrids_get(capsys):
    """'mamba_ssm init' alone was wrong for hybrids: the help names the init of the layers mamba_ssm has none for."""
    text = " ".join(_help("random-checkpoint", capsys).split())
    assert "mamba_ssm's" in text and "attention, MLPs, MoE experts" in text and "PyTorch's default" in text


@pytest.mark.parametrize("source", [["--preset", "tiny-bamba"], ["--config", "CONFIG"]])
def test_format_with_a_family_format_is_refused(source, tmp_path, capsys):
    """--format was silently ignored for hybrid presets and --config; now a usage error naming both flags."""
    if source[1] == "CONFIG":
        assert main(["random-checkpoint", "--preset", "tiny-bamba", "-o", str(tmp_path / "b"), "-q"]) == 0
        source = ["--config", str(tmp_path / "b" / "config.json")]
    assert main(["random-checkpoint", *source, "--format", "mamba_ssm", "-o", str(tmp_path / "x"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --format mamba_ssm applies to Mamba-2 shapes only; " + source[0]), err
    assert not (tmp_path / "x").exists()


def test_generate_counts_read_as_words(tiny_out, capsys):
    """'prefill 1 tokens ... 1 new tokens': the timing line's counts agree with their nouns."""
    assert main(["generate", str(tiny_out), "--prompt", "d", "--max-new-tokens", "1"]) == 0
    err = capsys.readouterr().err
    assert "prefill 1 token in " in err and "; 1 new token (greedy)" in err, err
    assert main(["generate", str(tiny_out), "--prompt", "de", "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "prefill 2 tokens in " in err and "; 2 new tokens (greedy)" in err, err


def test_inspect_columns_line_up_with_long_graph_names(tiny_ck, tmp_path, capsys):
    """model.native.onnx and model.packed.onnx (17 characters) pushed their rows' columns right of the others'
    (the name column was 16 wide): every file row of the listing starts its second column at one place, and so
    does each later column of the graph rows."""
    out = tmp_path / "all"
    assert main(["export", str(tiny_ck), "-o", str(out), "--ssm-impl", "all", "--packed-prefill", "-q"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if re.match(r"  model\.\S+ ", line) and not line.endswith(":")]  # not "  model.onnx inputs:"
    assert {r.split()[0] for r in rows} >= {"model.onnx", "model.std.onnx", "model.native.onnx",
                                           "model.packed.onnx", "model.onnx.data"}
    assert len({re.match(r"  \S+ +", r).end() for r in rows}) == 1, rows
    graphs = [r for r in rows if "ssm_impl=" in r]
    assert len({r.index("ssm_impl=") for r in graphs}) == 1, graphs
    assert len({re.search(r"ssm_impl=\S+ +", r).end() for r in graphs}) == 1, graphs


def test_inspect_of_a_foreign_graph_does_not_say_re_export(tmp_path, capsys):
    """A graph m2export did not make, whose external-data file is gone: the warning says so and to restore the
    file; 're-export it (m2export export ...)' fits only m2export's own graphs."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [w])
    m = helper.make_model(g, producer_name="someone-else")
    onnx.save_model(m, tmp_path / "theirs.onnx", save_as_external_data=True, location="theirs.bin", size_threshold=0)
    (tmp_path / "theirs.bin").unlink()
    assert main(["inspect", str(tmp_path / "theirs.onnx")]) == 0
    err = capsys.readouterr().err
    assert "theirs.bin is missing" in err and "not m2export" in err and "re-export" not in err, err


_INTERRUPT_TORCH_IMPORT = r"""
import importlib.abc, sys

class Interrupt(importlib.abc.MetaPathFinder):
    # Ctrl-C in the middle of 'import torch': after torch._subclasses.fake_tensor registered its atexit
    # hook (which logs 'FakeTensor cache stats' at INFO), before torch configured its loggers
    def find_spec(self, name, path=None, target=None):
        if hasattr(sys.modules.get("torch._subclasses.fake_tensor"), "dump_cache_stats") and name.startswith("torch"):
            sys.meta_path.remove(self)
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, Interrupt())
sys.argv = ["m2export", "random-checkpoint", "--preset", "tiny-mamba2", "-o", sys.argv[1]]
from m2export.cli.main import console_main
console_main()
"""


def test_ctrl_c_during_the_torch_import_is_one_line(tmp_path):
    """SIGINT while torch was being imported: exit 130 and the one error line; torch's atexit hook printed
    'FakeTensor cache stats: cache_hits: 0 ...' after it (m2export's INFO log level let it through)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _INTERRUPT_TORCH_IMPORT, str(tmp_path / "ck")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 130, r.stderr[-2000:]
    assert r.stderr == "error: interrupted by SIGINT\n" and r.stdout == "", r.stderr[-2000:]
    assert not (tmp_path / "ck").exists()


def test_packed_refusal_says_the_rule_once_then_each_obstacle_once(tmp_path, capsys):
    """Bamba (an MLP in every layer, attention in layer 1) read 'layers 0, 1, 2: an MLP; layer 1: attention mixer':
    now the rule once, then the mixer, then what follows it, each with its layers."""
    assert main(["random-checkpoint", "--preset", "tiny-bamba", "-o", str(tmp_path / "ck"), "-q"]) == 0
    assert main(["export", str(tmp_path / "ck"), "-o", str(tmp_path / "out"), "--packed-prefill"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: packed prefill: built only for pure Mamba-2 models in fp32 or fp16 (")
    assert err[0].endswith("; this model has an attention mixer in layer 1; an MLP after the mixer in layers 0, 1, 2")
    assert err[1:] == ["hint: export without --packed-prefill"]


@pytest.mark.parametrize("columns", [160, 200])
def test_check_titles_are_not_padded_and_sequence_is_its_own_line(columns, tiny_out, tmp_path, capsys, monkeypatch):
    """The wide table's title was padded with spaces to the table's width ('prefill: each runtime vs torch' + ~80
    spaces), and 'inputs: ...; sequence: prompt N + K decode steps' wrapped after its '; ' on a 160-column
    terminal: the title is its own line, and so is the sequence."""
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["check", str(tiny_out), "--shapes", "1x3,2x17", "--decode-steps", "2", "--report-dir",
                 str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "prefill: each runtime vs torch" in lines and "sequence: each runtime vs torch" in lines, lines
    assert any(ln.startswith("sequence: prompt ") and ln.endswith(" + 2 decode steps") for ln in lines), lines
    inputs = next(ln for ln in lines if ln.startswith("inputs: "))
    assert "sequence" not in inputs and not inputs.rstrip().endswith(";"), inputs
