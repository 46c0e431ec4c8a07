"""Small frictions of issue 17 item 6: a tolerance before OUTDIR no longer swallows it, unknown flags show the
verb's usage, results on stdout and progress/logs on stderr, -v shows export's steps, the 'wrote' line
names every file with its size, generate with 0 new tokens says so (no 'nan tokens/s'), a folder without
config.json says so, and build --skip-if-unavailable tolerates a missing TensorRT without an error line."""

from __future__ import annotations

import pytest

from m2export.backends import tensorrt_unavailable_reason
from m2export.cli.main import main


def test_tolerance_before_outdir(tiny_out, tmp_path, capsys):
    rc = main(["check", "--atol", "1e-3", "--atol", "logits:2e-3,present_ssm_state.*:1e-3", str(tiny_out),
               "--shapes", "1x3", "--decode-steps", "0", "--report-dir", str(tmp_path), "-q"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    import json

    rep = json.loads((tmp_path / "check_report.json").read_text())
    assert rep["atol"][""] == 1e-3 and rep["atol"]["logits"] == 2e-3 and rep["atol"]["present_ssm_state.0"] == 1e-3


def test_unknown_flag_names_the_verbs_help(tiny_out, capsys):
    with pytest.raises(SystemExit) as e:
        main(["check", str(tiny_out), "--no-such-flag"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith("error: unrecognized arguments: --no-such-flag\nhint: ") and "'m2export check --help'" in err


def test_export_results_on_stdout_steps_with_v(tiny_ck, tmp_path, capsys, caplog):
    assert main(["export", str(tiny_ck), "-o", str(tmp_path / "o"), "--no-check", "-v", "--ssm-impl", "both"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"wrote {tmp_path / 'o'}: model.onnx (") and (" kB)" in out or " MB)" in out), out
    assert out.count("model.onnx.data") == 1, out  # both graphs use the one weights file: listed once
    assert "m2export.json" in out and "wrote" not in err
    assert "export: building the graph" in caplog.text and "done in" in caplog.text  # -v: m2export's debug log


@pytest.mark.parametrize("impl,says", [("native", "(dtype fp32, opset 27)\n"),
                                       ("all", "(dtype fp32, opset 18, model.native.onnx opset 27)\n"),
                                       ("std", "(dtype fp32, opset 18)\n")])
def test_export_line_states_each_graphs_opset(impl, says, tiny_ck, tmp_path, capsys):
    """The native flavour is built at opset 27 whatever --opset: the 'wrote' line says so (it said 'opset 18' for a
    native-only export, whose model.onnx imports ai.onnx 27), and it agrees with the graph files."""
    import onnx

    out = tmp_path / impl
    assert main(["export", str(tiny_ck), "-o", str(out), "--no-check", "--ssm-impl", impl]) == 0
    stdout = capsys.readouterr().out
    assert stdout.endswith(says), stdout
    native = out / ("model.onnx" if impl == "native" else "model.native.onnx")
    if impl != "std":
        opset = {o.domain: o.version for o in onnx.load(native, load_external_data=False).opset_import}[""]
        assert f"opset {opset}" in stdout and opset == 27


def test_opset_with_the_native_flavour_says_it_does_not_apply(tiny_ck, tmp_path, capsys):
    """--opset N with the native flavour: a note on stderr says native stays at opset 27 (--opset was silently
    ignored for it); the other flavours take N; no note without --opset or without native."""
    import onnx

    out = tmp_path / "all"
    assert main(["export", str(tiny_ck), "-o", str(out), "--no-check", "--ssm-impl", "all", "--opset", "20"]) == 0
    stdout, err = capsys.readouterr()
    assert "note: --opset 20 applies to the ssmscan and std flavours; the native flavour is built at opset 27" in err
    assert "note" not in stdout and stdout.endswith("(dtype fp32, opset 20, model.native.onnx opset 27)\n"), stdout
    imports = {f: {o.domain: o.version for o in onnx.load(out / f, load_external_data=False).opset_import}[""]
               for f in ("model.onnx", "model.std.onnx", "model.native.onnx")}
    assert imports == {"model.onnx": 20, "model.std.onnx": 20, "model.native.onnx": 27}
    assert main(["export", str(tiny_ck), "-o", str(tmp_path / "b"), "--no-check", "--ssm-impl", "both", "--opset",
                 "20", "-q"]) == 0
    assert main(["export", str(tiny_ck), "-o", str(tmp_path / "n"), "--no-check", "--ssm-impl", "native", "-q"]) == 0
    assert "note" not in capsys.readouterr().err


def test_generate_zero_new_tokens(tiny_out, capsys):
    assert main(["generate", str(tiny_out), "--prompt", "ab", "--max-new-tokens", "0"]) == 0
    out, err = capsys.readouterr()
    assert out == "ab\n" and "nan" not in err and "0 new tokens" in err and "no decode step to time" in err


def test_folder_without_config_json(tmp_path, capsys):
    (tmp_path / "docs").mkdir()
    assert main(["export", str(tmp_path / "docs"), "-o", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert "docs/config.json: missing" in err and "no weights" not in err


@pytest.mark.skipif(tensorrt_unavailable_reason() is None, reason="TensorRT is usable here: nothing to skip")
def test_build_skip_if_unavailable(tiny_out, tmp_path, capsys):
    from tests.check.exports import copy_export

    out = copy_export(tiny_out, tmp_path / "o")
    assert main(["build", str(out), "--skip-if-unavailable"]) == 0
    cap = capsys.readouterr()
    assert cap.err.startswith("build skipped (--skip-if-unavailable): ") and "error:" not in cap.err
    assert not list(out.glob("*.plan"))
    assert main(["build", str(out)]) == 4  # without the flag: the exit-4 error, as before


def test_inspect_lists_external_data_with_sizes(tiny_out, tmp_path, capsys):
    """The weights live in one external-data file shared by the graphs: inspect names the file, its size and
    the graphs that use it (the file replaced here by a 1.5 MB one)."""
    from m2export.exporter.manifest import read_manifest
    from tests.check.exports import copy_export

    out = copy_export(tiny_out, tmp_path / "o")
    m = read_manifest(out)
    assert all(g.external_data == ["model.onnx.data"] for g in m.graphs)
    (out / "model.onnx.data").write_bytes(b"\0" * 1_500_000)
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "  model.onnx.data weights, 1.5 MB, stored once for model.onnx, model.std.onnx" in text, text


def test_export_line_names_every_file_it_wrote(tiny_ck, tmp_path, capsys):
    """The 'wrote' line named the graphs, the weights and m2export.json but not genai_config.json, which every
    export writes too: now every file of the folder is on it (with its size)."""
    out = tmp_path / "o"
    assert main(["export", str(tiny_ck), "-o", str(out), "--no-check"]) == 0
    line = capsys.readouterr().out
    assert "genai_config.json (" in line, line
    for f in out.iterdir():
        assert f.name in line, (f.name, line)


def test_packed_prefill_with_bf16_is_one_usage_line_before_the_checkpoint_is_read(tiny_ck, tmp_path, capsys):
    """--dtype bf16 --packed-prefill contradict each other whatever the checkpoint: exit 2 naming both flags,
    before loading (a missing checkpoint does not change it), nothing written. It was exit 1 after loading, with
    a message that called a pure Mamba-2 model's layers 'attention, MLP, MoE, shared blocks or multipliers'."""
    for ck in (tiny_ck, tmp_path / "no-such-checkpoint"):
        out = tmp_path / "o"
        assert main(["export", str(ck), "-o", str(out), "--dtype", "bf16", "--packed-prefill"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --packed-prefill with bf16: ") and "fp32 or fp16" in err, err
        assert "attention" not in err and "loading" not in err and not out.exists()


def test_generate_on_a_folder_that_is_neither_export_nor_checkpoint(tmp_path, capsys):
    """A folder with neither m2export.json nor config.json was taken for a checkpoint ('config.json: missing;
    ... is not a checkpoint directory'), which misleads whoever meant an export: the error names both."""
    d = tmp_path / "docs"
    d.mkdir()
    (d / "readme.txt").write_text("hi")
    assert main(["generate", str(d), "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[0] == (f"error: {d}: neither an m2export output folder (no m2export.json) nor a "
                                   "checkpoint (no config.json)"), err
    assert err.splitlines()[1].startswith("hint: ") and len(err.splitlines()) == 2


def test_inspect_sizes_agree_with_the_export_line(tiny_out, capsys):
    """inspect printed a 48 kB graph as '0.0 MB' where export's line says '48.4 kB': both use human_bytes now."""
    from m2export.check.console import human_bytes

    assert main(["inspect", str(tiny_out)]) == 0
    text = capsys.readouterr().out
    assert "0.0 MB" not in text, text
    size = (tiny_out / "model.onnx").stat().st_size
    assert any(line.lstrip().startswith("model.onnx ") and human_bytes(size) in line for line in text.splitlines())
    assert main(["inspect", str(tiny_out / "model.onnx")]) == 0
    assert f"{human_bytes(size)}, dtype float32" in capsys.readouterr().out


def test_ctrl_c_outside_an_output_says_error_and_the_signal(monkeypatch, tiny_out, capsys):
    """Ctrl-C outside an output being written (check, generate, a random-checkpoint model being built) printed a
    bare 'interrupted'; export's says 'error: interrupted by SIGINT; ...': the same wording, exit 130."""
    import m2export.cli.inspect as verb

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(verb, "run", interrupted)
    assert main(["inspect", str(tiny_out)]) == 130
    assert capsys.readouterr().err == "error: interrupted by SIGINT\n"


def test_random_checkpoint_shows_its_steps_and_refuses_the_folder_first(tmp_path, capsys, monkeypatch):
    """random-checkpoint printed nothing for the ~15 s of a 130m preset, and built and initialised the whole model
    before refusing a non-empty output folder: now a progress bar on stderr (result alone on stdout; -q: nothing
    on stderr), and the folder is refused before the model is built."""
    from m2export.models import checkpoint
    from m2export.models.checkpoint import RANDOM_CHECKPOINT_STEPS, random_checkpoint

    steps = []
    random_checkpoint(tmp_path / "lib", d_model=32, n_layer=1, vocab_size=64, progress=steps.append)
    assert steps == ["building the model", "initialising the weights", f"writing {tmp_path / 'lib'}"]
    assert len(steps) == RANDOM_CHECKPOINT_STEPS
    shape = ["--d-model", "32", "--n-layer", "1", "--vocab-size", "64"]
    assert main(["random-checkpoint", *shape, "-o", str(tmp_path / "a")]) == 0
    out, err = capsys.readouterr()
    assert out == f"wrote {tmp_path / 'a'}\n" and "random-checkpoint" in err and "3/3" in err and "done" in err, err
    assert main(["random-checkpoint", *shape, "-o", str(tmp_path / "b"), "-q"]) == 0
    assert capsys.readouterr() == ("", "")

    def never(*a, **k):
        raise AssertionError("the model was built before the output folder was checked")

    monkeypatch.setattr(checkpoint, "Mamba2LMHeadModel", never)
    monkeypatch.setattr(checkpoint, "HybridLM", never)
    for argv in (shape, ["--preset", "tiny-bamba"]):
        assert main(["random-checkpoint", *argv, "-o", str(tmp_path / "a")]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: {tmp_path / 'a'}: exists and is not empty\n"), err  # the error line alone


def test_light_verbs_do_not_import_torch_or_onnx(tmp_path):
    """Importing m2export.exporter.configs (MANIFEST_FILE) ran m2export/exporter/__init__.py, which imported the
    exporter, hence torch, onnx and onnxscript: 'build' took 7-8 s (loaded 2-core machine) to say that TensorRT
    is not installed, and inspect or a wrong path in check/generate 4-6 s. In a fresh interpreter: none of them
    imports torch now, and the package's public names still resolve."""
    import subprocess
    import sys

    code = ("import sys\nfrom m2export.cli.main import main\n"
            "for argv in (['build', sys.argv[1], '--skip-if-unavailable'], ['check', sys.argv[1]],"
            " ['generate', sys.argv[1], '--prompt', 'x'], ['inspect', sys.argv[1]]):\n"
            "    main(argv)\n"
            "print(sorted(m for m in ('torch', 'onnxscript') if m in sys.modules))\n"
            "import m2export.exporter as E\n"
            "print(E.export_model.__module__, E.OrtModel.__name__, E.ort_generate_greedy.__name__)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "missing")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["[]", "m2export.exporter.export OrtModel ort_generate_greedy"], r.stdout


def test_damaged_weights_file_is_one_error_without_onnxruntimes_own_log(tiny_out, tmp_path, capfd):
    """generate on an export whose model.onnx.data was cut short printed ONNX Runtime's own coloured error log
    (C++ source paths) to stderr before m2export's error line saying the same, and the prompt without a newline
    to stdout: now the error and the hint only, stdout empty."""
    from tests.check.exports import copy_export

    out = copy_export(tiny_out, tmp_path / "o")
    data = out / "model.onnx.data"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 3])
    capfd.readouterr()
    assert main(["generate", str(out), "--prompt", "x", "--max-new-tokens", "2"]) == 1
    stdout, err = capfd.readouterr()  # the file descriptors: ORT logs from C++
    assert stdout == "", stdout  # the prompt is echoed once the prefill has run (it was, before the error line)
    lines = err.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"error: {out / 'model.onnx'}: model.onnx.data is truncated (")
    assert lines[1].startswith("hint: "), err


def test_export_refusing_its_input_prints_the_error_alone(tmp_path, capsys):
    """A checkpoint refused while loading (a missing path, no weight file) printed the progress bar's last state
    ('export ... 0/6 loading ...') above the error line on stderr: now the error and its hint alone (on a terminal
    the bar is erased). An interrupt keeps the bar, which says which step was cut."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"d_model": 8, "n_layer": 1, "vocab_size": 8, "ssm_cfg": {"layer": "Mamba2"}}')
    for ck, says in ((tmp_path / "missing", "no such file or directory"), (bad, "no weights found")):
        assert main(["export", str(ck), "-o", str(tmp_path / "o")]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err.splitlines()[0], err
        assert all(line.startswith(("error: ", "hint: ")) for line in err.splitlines()), err


def test_quiet_check_against_transformers_prints_nothing_but_the_verdict(tmp_path):
    """-q is "only errors": transformers' "Loading weights" progress bar and its warnings (a kernel it falls back
    from) were printed by ``check -q --reference transformers`` (found by a new-user tryout). In a fresh process,
    so that transformers is imported by the verb itself, as for a user."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.models.hf_checkpoints import make

    ck, _ = make("granitemoehybrid", tmp_path / "ck")
    out = tmp_path / "out"
    assert main(["export", str(ck), "-o", str(out), "-q"]) == 0
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS")}
    args = ["check", str(out), "--reference", "transformers", "--shapes", "1x4", "--decode-steps", "1",
            "--report-dir", str(tmp_path / "rep")]
    loud = subprocess.run([sys.executable, "-m", "m2export.cli.main", *args], capture_output=True, text=True,
                          env=dict(env, PYTHONPATH=str(repo)), timeout=300)
    assert loud.returncode == 0, loud.stderr[-2000:]
    assert "Loading weights" in loud.stderr, "transformers printed no progress bar without -q: this test shows nothing"
    r = subprocess.run([sys.executable, "-m", "m2export.cli.main", *args, "-q"], capture_output=True, text=True,
                       env=dict(env, PYTHONPATH=str(repo)), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr == "", r.stderr[-2000:]


@pytest.mark.parametrize("what", ["text_file", "empty_folder"])
def test_export_of_something_that_is_no_checkpoint_says_what_one_is(tmp_path, capsys, what):
    """'m2export export README.md -o out/y' was 'error: README.md: not a checkpoint weight file (...)' without the
    'hint:' line every other error has: the hint says what a checkpoint folder holds and how to make one."""
    src = tmp_path / ("README.md" if what == "text_file" else "empty")
    src.write_text("# hi\n") if what == "text_file" else src.mkdir()
    assert main(["export", str(src), "-o", str(tmp_path / "y")]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"error: {src}"), lines
    assert lines[1].startswith("hint: pass a checkpoint folder (mamba_ssm or HF format): config.json and the weights"), lines
    assert "'m2export random-checkpoint --preset tiny-mamba2 -o DIR'" in lines[1]
    assert not (tmp_path / "y").exists()
