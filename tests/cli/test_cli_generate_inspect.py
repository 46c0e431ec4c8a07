"""`m2export generate` and `m2export inspect` through the CLI entry point, and --help on every verb."""

from __future__ import annotations

import json

import pytest

from m2export.cli.main import main
from tests.check.exports import copy_export, record_engine
from tests.helpers import assert_usage_error


@pytest.mark.parametrize("verb", ["check", "generate", "inspect"])
def test_help_has_examples(verb, capsys):
    with pytest.raises(SystemExit) as e:
        main([verb, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "examples:" in out and f"m2export {verb} " in out and "exit codes:" in out
    assert "--verbose" in out and "--quiet" in out


def test_generate_ort_equals_torch(tiny_out, capsys):
    texts = {}
    for rt in ("onnxrt", "torch"):
        assert main(["generate", str(tiny_out), "--prompt", "import os\n", "--max-new-tokens", "16",
                     "--runtime", rt, "--ids"]) == 0
        out, err = capsys.readouterr()
        assert out.startswith("import os\n")
        assert "tokens/s" in err and "greedy" in err
        texts[rt] = out
    assert texts["onnxrt"] == texts["torch"]
    assert len(texts["onnxrt"].splitlines()[-1].split()) == 2 + 16  # "new ids:" + 16 ids


def test_generate_checkpoint_default_torch_and_ids(tiny_ck, capsys):
    assert main(["generate", str(tiny_ck), "--prompt-ids", "100,101,102", "--max-new-tokens", "3", "-q",
                 "--temperature", "0.7", "--top-k", "5", "--seed", "1"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def") and err == ""


@pytest.mark.parametrize("case", ["missing_dir", "wrong_file", "graph_default_runtime", "ort_on_checkpoint", "bad_ids"])
def test_generate_errors(case, tiny_out, tiny_ck, tmp_path, capsys):
    args, code, msg = ["generate"], 1, None
    if case == "missing_dir":
        args += [str(tmp_path / "nope"), "--prompt", "x"]
        msg = "nope: no such file or directory"
    elif case == "wrong_file":
        args += [str(tiny_out / "model.onnx"), "--prompt", "x", "--runtime", "onnxrt"]
        msg = f"model.onnx: a file of the export folder {tiny_out}"
    elif case == "graph_default_runtime":  # a graph of an export, no --runtime: it was taken for a checkpoint file
        args += [str(tiny_out / "model.onnx"), "--prompt", "x"]
        msg = f"model.onnx: a file of the export folder {tiny_out}; generate reads the folder"
    elif case == "ort_on_checkpoint":
        args += [str(tiny_ck), "--prompt", "x", "--runtime", "onnxrt"]
        msg = "not an m2export output folder (no m2export.json)"
    else:
        args += [str(tiny_out), "--prompt-ids", "1,x"]
        msg, code = "--prompt-ids '1,x': expected comma-separated integers", 2  # malformed: a usage error
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == code and err.startswith("error: ") and msg in err.splitlines()[0], err
    assert "Traceback" not in err


def test_generate_trt_engine_listed_without_tensorrt(tiny_out, tmp_path, capsys):
    from m2export.backends import tensorrt_available

    if tensorrt_available():
        pytest.skip("TensorRT is installed here: the exit-4 path needs it absent")
    d = copy_export(tiny_out, tmp_path / "o")
    record_engine(d, [], role="prefill+decode", file="model.plan", payload=b"x")
    assert main(["generate", str(d), "--prompt", "x", "--runtime", "trt"]) == 4
    assert capsys.readouterr().err.startswith("error: TensorRT is not installed")


@pytest.mark.parametrize("verb", ["check", "generate"])
@pytest.mark.parametrize("why", ["TensorRT not installed", "no CUDA GPU", None])
def test_trt_runtime_exit_codes_one_rule(verb, why, tiny_out, monkeypatch, capsys):
    """check and generate --runtime trt on a folder without engines follow one rule: TensorRT unusable here
    -> exit 4 (before anything about the engines); TensorRT usable but no engines -> exit 1."""
    from m2export import backends

    monkeypatch.setattr(backends, "tensorrt_unavailable_reason", lambda **kw: why)
    extra = ["--prompt", "x"] if verb == "generate" else ["--shapes", "1x3", "--decode-steps", "0"]
    rc = main([verb, str(tiny_out), "--runtime", "trt", *extra])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    if why is None:
        assert rc == 1, err
        assert lines[0].startswith("error: ") and "no TensorRT engines" in lines[0]
        assert "m2export build OUTDIR" in lines[1]
    else:
        assert rc == 4, err
        expected = ("TensorRT is not installed; cannot " if why == "TensorRT not installed"
                    else "cannot ")
        assert lines[0].startswith("error: " + expected), lines[0]
        assert why == "TensorRT not installed" or lines[0].endswith("here: no CUDA GPU")
    assert "Traceback" not in err


@pytest.mark.parametrize("verb", ["check", "generate"])
def test_help_states_the_trt_exit_code_rule(verb, capsys):
    with pytest.raises(SystemExit):
        main([verb, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "4 --runtime trt where TensorRT is not usable (not installed, or no CUDA GPU), whether or not engines exist" in out
    assert "--runtime trt with TensorRT usable but no engines built" in out


def test_inspect_outdir_onnx_plan(tiny_out, tmp_path, capsys):
    assert main(["inspect", str(tiny_out)]) == 0
    out = capsys.readouterr().out
    assert "m2export output folder, dtype fp32, opset 18" in out
    assert "model.std.onnx  prefill+decode ssm_impl=std" in out and "0 SSMScan" in out
    assert "model.onnx.data weights" in out and "stored once for model.onnx, model.std.onnx" in out
    assert "2 x chunk_size=16, dt_max=inf, dt_min=0.0, dt_softplus=1" in out
    assert "past_ssm_state.0         float32  [batch_size, 8, 16, 16]" in out
    assert out.count("    ssm_state  layout [batch_size, nheads, headdim, d_state]") == 2  # per graph
    assert "engines: none" in out

    assert main(["inspect", str(tiny_out / "model.onnx"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["opsets"] == {"ai.onnx": 18, "m2export": 1}
    assert info["inputs"][0] == {"name": "input_ids", "dtype": "int64", "shape": ["batch_size", "sequence_length"]}
    assert [n["attributes"]["dt_softplus"] for n in info["ssm_scan_nodes"]] == [1, 1]
    assert info["functions"][0]["name"] == "SSMScan"

    d = copy_export(tiny_out, tmp_path / "o")
    record_engine(d, [{"input_ids": {"min": [1, 1], "opt": [1, 64], "max": [4, 512]}}], gpu="NVIDIA H200",
                  precision="fp16", payload=b"x")
    assert main(["inspect", str(d / "model.plan")]) == 0
    out = capsys.readouterr().out
    assert "built from model.onnx (prefill), precision fp16" in out and "'max': [4, 512]" in out
    from m2export.backends import tensorrt_available

    if not tensorrt_available():
        assert "TensorRT not installed: TensorRT (and a GPU) are needed to read the engine itself" in out


@pytest.mark.parametrize("case", ["missing", "wrong_file", "not_outdir", "corrupt_onnx", "missing_engine"])
def test_inspect_errors(case, tiny_out, tiny_ck, tmp_path, capsys):
    target, msg = {
        "missing": (tmp_path / "nope", "nope: no such file or directory"),
        "wrong_file": (tiny_out / "m2export.json", "not an ONNX graph (.onnx), a TensorRT engine (.plan) or an OUTDIR"),
        "not_outdir": (tiny_ck, "not an m2export output folder (no m2export.json)"),
        "corrupt_onnx": (tmp_path / "bad.onnx", "bad.onnx: not a readable ONNX model"),
        "missing_engine": (tiny_out / "model.plan", "model.plan: no such file or directory"),
    }[case]
    if case == "corrupt_onnx":
        target.write_bytes(b"garbage")
    rc = main(["inspect", str(target)])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("error: ") and msg in err.splitlines()[0], err
    assert "hint: " in err and "Traceback" not in err


@pytest.mark.parametrize("ids,bad", [("300,5", "300"), ("-1", "-1"), ("5,256,-7", "256, -7")])
def test_generate_prompt_ids_outside_vocab(tiny_out, capsys, ids, bad):
    """Ids are checked against the vocabulary before anything is decoded or streamed (was: ValueError from
    bytes(), exit 70)."""
    rc = main(["generate", str(tiny_out), "--prompt-ids", ids, "--max-new-tokens", "1"])
    out, err = capsys.readouterr()
    assert rc == 1, err
    assert err.splitlines()[0] == f"error: --prompt-ids: token id(s) {bad} outside the vocabulary: ids must be in [0, 256)"
    assert out == "" and "Traceback" not in err


@pytest.mark.parametrize("args,msg", [(["--temperature", "-1"], "argument --temperature: -1: expected a finite number >= 0"),
                                      (["--temperature", "nan"], "argument --temperature: nan: expected a finite number"),
                                      (["--top-k", "-5"], "argument --top-k: -5: expected an integer >= 0"),
                                      (["--seed", "-1"], "argument --seed: -1: expected an integer >= 0"),
                                      (["--max-new-tokens", "-2"], "argument --max-new-tokens: -2: expected an integer")])
def test_generate_bad_sampling_numbers_are_usage_errors(tiny_out, capsys, args, msg):
    assert_usage_error(["generate", str(tiny_out), "--prompt", "x", *args], msg, capsys)


def test_generate_top_k_without_temperature_says_it_is_greedy(tiny_out, capsys):
    """--top-k alone decodes greedily (as before), and a note on stderr says the filter had no effect (it was
    silently ignored); stdout holds the text alone. --temperature > 0 with --top-k: no note."""
    assert main(["generate", str(tiny_out), "--prompt", "def ", "--max-new-tokens", "3", "--top-k", "5"]) == 0
    out, err = capsys.readouterr()
    assert "note: --top-k 5 has no effect with greedy decoding" in err and "(greedy)" in err and "note" not in out
    assert main(["generate", str(tiny_out), "--prompt", "def ", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out == out  # the same greedy tokens
    assert main(["generate", str(tiny_out), "--prompt", "def ", "--max-new-tokens", "3", "--top-k", "5",
                 "--temperature", "0.5"]) == 0
    assert "no effect" not in capsys.readouterr().err


@pytest.mark.parametrize("impl,says", [("native", "dtype fp32, opset 27\n"),
                                       ("all", "dtype fp32, opset 18, model.native.onnx opset 27\n")])
def test_inspect_header_gives_the_native_graphs_opset(impl, says, tiny_ck, tmp_path, capsys):
    """The folder line of inspect names the opset the graphs import: a native-only folder's model.onnx imports
    ai.onnx 27 (the header said 'opset 18', the manifest's requested default)."""
    out = tmp_path / impl
    assert main(["export", str(tiny_ck), "-o", str(out), "--no-check", "--ssm-impl", impl, "-q"]) == 0
    assert main(["inspect", str(out)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == f"{out}: m2export output folder, {says.strip()}", first


@pytest.mark.parametrize("installed", [True, False])
def test_generate_missing_tokenizer_file_is_named_first(installed, tiny_out, tmp_path, monkeypatch, capsys):
    """--tokenizer with a path that does not exist: 'no such file', whether or not the tokenizers package is there
    (without it the error was 'the tokenizers package is not installed', and after installing it, the next error)."""
    import sys

    if not installed:
        monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails
    missing = tmp_path / "nosuch.json"
    rc = main(["generate", str(tiny_out), "--prompt", "a", "--tokenizer", str(missing)])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith(f"error: --tokenizer {missing}: no such file"), err


def test_generate_library_rejects_bad_sampling(tiny_out):
    """The library names its parameters (top_k), not the CLI's flags (--top-k)."""
    from m2export.errors import ParameterError
    from m2export.generate import generate

    for kw, msg in ((dict(temperature=-1.0), "temperature -1.0"), (dict(top_k=-5), "top_k -5"),
                    (dict(seed=-1), "seed -1")):
        with pytest.raises(ParameterError, match=msg) as e:
            generate(tiny_out, [1, 2], max_new_tokens=1, **kw)
        assert "--" not in str(e.value)


@pytest.mark.parametrize("verb,runtime,what", [("check", None, "ONNX Runtime cannot load the graph (InvalidProtobuf"),
                                               ("generate", "onnxrt", "ONNX Runtime cannot load the graph (InvalidProtobuf"),
                                               ("generate", "onnx-reference", "ONNX cannot load the graph (DecodeError")])
def test_corrupt_graph_is_a_clean_error(verb, runtime, what, tiny_out, tmp_path, capsys):
    """A damaged model.onnx: one error line naming the file (exit 1), as in inspect/build, not ORT's or
    protobuf's traceback (exit 70)."""
    d = copy_export(tiny_out, tmp_path / "o")
    (d / "model.onnx").write_bytes(b"garbage")
    args = ([verb, str(d), "-q", "--shapes", "1x3", "--decode-steps", "0"] if verb == "check" else
            [verb, str(d), "-q", "--prompt", "x", "--runtime", runtime])
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 1, err
    lines = err.strip().splitlines()
    assert lines[0].startswith(f"error: {d / 'model.onnx'}: {what}") and lines[1].startswith("hint: ")
    assert "Traceback" not in err


@pytest.mark.parametrize("what,said", [("dir", "is a directory"), ("/dev/null", "is not a regular file"),
                                       ("missing", "no such file")])
@pytest.mark.parametrize("use", ["check --text", "generate --tokenizer"])
def test_input_file_flags_say_what_the_path_is(use, what, said, tiny_out, tmp_path, capsys):
    """--text / --tokenizer naming a directory or a device said 'no such file' (it exists); now what it is."""
    path = {"dir": str(tmp_path), "/dev/null": "/dev/null", "missing": str(tmp_path / "nope.txt")}[what]
    v, flag = use.split()
    args = ([v, str(tiny_out), "-q", "--shapes", "1x3", flag, path] if v == "check" else
            [v, str(tiny_out), "-q", "--prompt", "x", flag, path])
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith(f"error: {flag} {path}: {said}"), err


@pytest.mark.parametrize("verb", ["check", "generate", "inspect", "inspect-file"])
def test_empty_graph_file_is_named_empty(verb, tiny_out, tmp_path, capsys):
    """A 0-byte model.onnx (a copy cut short, a full disk) parses as an empty ModelProto: inspect listed it with no
    inputs and exit 0, check/generate said 'its inputs differ from those m2export.json records'. Now one line
    saying it is empty, exit 1, from every verb."""
    d = copy_export(tiny_out, tmp_path / "o")
    (d / "model.onnx").write_bytes(b"")
    args = {"check": ["check", str(d), "-q", "--shapes", "1x3", "--decode-steps", "0"],
            "generate": ["generate", str(d), "-q", "--prompt", "x"], "inspect": ["inspect", str(d)],
            "inspect-file": ["inspect", str(d / "model.onnx")]}[verb]
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 1, err
    lines = err.strip().splitlines()
    assert lines[0].startswith(f"error: {d / 'model.onnx'}: ") and "empty (0 bytes)" in lines[0], err
    assert len(lines) == 2 and lines[1].startswith("hint: ") and "Traceback" not in err


def test_inspect_names_a_truncated_or_missing_weights_file(tiny_out, tmp_path, capsys):
    """A model.onnx.data cut short (a copy interrupted, a full disk) is marked in the listing and named in one
    warning line on stderr, for the folder and for the graph file; a sound export has no warning."""
    assert main(["inspect", str(tiny_out)]) == 0
    assert "warning" not in capsys.readouterr().err
    d = copy_export(tiny_out, tmp_path / "o")
    data = d / "model.onnx.data"
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size // 3)
    assert main(["inspect", str(d)]) == 0
    cap = capsys.readouterr()
    assert "TRUNCATED: the graphs read" in cap.out
    assert cap.err.startswith("warning: model.onnx.data is truncated (") and cap.err.count("\n") == 1
    assert main(["inspect", str(d / "model.onnx")]) == 0
    cap = capsys.readouterr()
    assert "TRUNCATED: the graph reads" in cap.out and "warning: model.onnx.data is truncated" in cap.err
    data.unlink()
    assert main(["inspect", str(d)]) == 0
    assert "warning: model.onnx.data is missing" in capsys.readouterr().err


def test_missing_flavour_hint_names_that_flavour(tiny_out, capsys):
    """A graph flavour the folder lacks: the hint names that flavour (it said "--ssm-impl both", which a both
    export already has), and the folder's graphs are listed in words, not as a Python list of tuples."""
    assert main(["generate", str(tiny_out), "--prompt", "x", "--ssm-impl", "native"]) == 1
    err = capsys.readouterr().err
    first, hint = err.splitlines()[0], err.splitlines()[1]
    assert "no prefill graph with ssm_impl=native" in first and "[(" not in first, err
    assert "native" in hint and "both" not in hint, err


def test_inspect_names_the_packed_scan_op():
    """A packed-prefill graph's scan nodes are SSMScanPacked, and inspect says so (it labelled them SSMScan)."""
    from m2export.contract import OP_DOMAIN, PACKED_OP_NAME
    from m2export.inspect import _scan_lines

    packed = [{"name": f"n{i}", "op": PACKED_OP_NAME, "attributes": {"chunk_size": 64}} for i in range(2)]
    assert _scan_lines(packed, "")[0] == f"{PACKED_OP_NAME} nodes ({OP_DOMAIN}::{PACKED_OP_NAME}): 2"
    assert _scan_lines([dict(packed[0], op="SSMScan")], "")[0] == f"SSMScan nodes ({OP_DOMAIN}::SSMScan): 1"


@pytest.mark.parametrize("verb", ["generate", "check"])
@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_truncated_or_missing_weights_file_is_one_line(tiny_out, tmp_path, capsys, verb, damage):
    """A model.onnx.data cut short (or gone): one error line naming the graph, the weights file, its size and the
    bytes the graph's external-data references read, then a re-export hint; exit 1. It was ONNX Runtime's first
    line, ~600 characters of C++ signature and initializer offsets."""
    d = copy_export(tiny_out, tmp_path / "o")
    data = d / "model.onnx.data"
    size = data.stat().st_size
    if damage == "truncated":
        with open(data, "r+b") as f:
            f.truncate(size // 3)
    else:
        data.unlink()
    args = (["generate", str(d), "--prompt", "ab", "--max-new-tokens", "2"] if verb == "generate"
            else ["check", str(d), "--report-dir", str(tmp_path / "rep"), "--shapes", "1x3", "--decode-steps", "0"])
    assert main([*args, "-q"]) == 1
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in cap.err and cap.out == "", cap.err
    what = (f"model.onnx.data is truncated ({size // 3:,} bytes; the graph reads {size:,})" if damage == "truncated"
            else "model.onnx.data is missing")
    assert lines[0] == f"error: {d / 'model.onnx'}: {what}", lines[0]
    assert lines[1].startswith("hint: ") and "re-export" in lines[1] and "--force" in lines[1]


@pytest.mark.parametrize("runtime", ["torch", "trt"])
def test_generate_ssm_impl_with_a_graphless_runtime_is_a_usage_error(runtime, tiny_out, capsys):
    """--ssm-impl picks an ONNX graph; with --runtime torch it was silently ignored (the PyTorch model ran and the
    speed line said 'torch'), with trt too. Contradictory flags: exit 2 naming --ssm-impl, before any file is read."""
    rc = main(["generate", str(tiny_out), "--prompt-ids", "1,2", "--ids", "--runtime", runtime, "--ssm-impl", "std"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and lines[0].startswith("error: --ssm-impl std picks the ONNX graph"), err
    assert f"--runtime {runtime} runs" in lines[0] and lines[1].startswith("hint: ") and len(lines) == 2, err


@pytest.mark.parametrize("location", ["../../../etc/passwd", "elsewhere.data"])
@pytest.mark.parametrize("use", ["check", "generate"])
def test_graph_reading_weights_from_an_unlisted_file_is_refused(use, location, tiny_out, tmp_path, capsys):
    """A model.onnx whose external-data location was edited (outside the folder, or another file in it) was
    reported as '<that file> is truncated (N bytes; the graph reads M)' after stat-ing it; now refused by name
    before any runtime reads it: one line, exit 1."""
    import onnx

    d = copy_export(tiny_out, tmp_path / "o")
    m = onnx.load(d / "model.onnx", load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = location
    onnx.save(m, d / "model.onnx")
    (d / "elsewhere.data").write_bytes(b"\0" * 16)
    args = ([use, str(d), "-q", "--shapes", "1x3", "--decode-steps", "0"] if use == "check" else
            [use, str(d), "-q", "--prompt-ids", "1", "--ids"])
    rc = main(args)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 2 and "Traceback" not in err, err
    assert lines[0] == (f"error: {d / 'model.onnx'}: reads weights from [{location!r}], not from the file(s) "
                        "m2export.json lists for it (model.onnx.data): not the graph exported under this name"), err


def test_inspect_warns_of_a_graph_reading_an_unlisted_weights_file(tiny_out, tmp_path, capsys):
    """inspect OUTDIR (informational, exit 0) warns of a graph whose external-data locations are not the file
    m2export.json lists for it, as it warns of a missing or truncated one."""
    import onnx

    d = copy_export(tiny_out, tmp_path / "o")
    m = onnx.load(d / "model.onnx", load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../../../etc/passwd"
    onnx.save(m, d / "model.onnx")
    assert main(["inspect", str(d)]) == 0
    err = capsys.readouterr().err
    assert ("warning: model.onnx reads weights from ['../../../etc/passwd'], not from the file(s) m2export.json lists "
            "for it: this export is damaged") in err, err
    assert main(["inspect", str(tiny_out)]) == 0 and "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("ids,pos", [("1,,2", 2), ("1,2,", 3), (",1", 1)])
def test_generate_prompt_ids_empty_item_is_refused(tmp_path, capsys, ids, pos):
    """``1,,2`` was read as ``1,2``: an empty item is refused (exit 2) before the source is read."""
    rc = main(["generate", str(tmp_path / "nope"), "--prompt-ids", ids])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[0] == f"error: --prompt-ids {ids!r}: empty item at position {pos}", err


def test_generate_torch_on_an_export_whose_checkpoint_moved(tiny_ck, tmp_path, capsys):
    """--runtime torch on an export folder runs the checkpoint m2export.json records; once that is gone the error
    says the path came from the manifest and what to pass instead (it printed the bare path with a generic 'pass a
    checkpoint directory' hint: README trial 2026-12-04). Exit 1; the default runtime still runs the graphs."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(tiny_ck, ck)
    out = tmp_path / "out"
    assert main(["export", str(ck), "-o", str(out), "--ssm-impl", "std", "-q"]) == 0
    shutil.rmtree(ck)
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "x", "--runtime", "torch"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"error: {out}: its checkpoint {ck} (from m2export.json) does not exist; runtime torch runs the " \
                     "PyTorch model from the checkpoint", err
    assert err[1].startswith("hint: pass the checkpoint folder itself instead of the export folder") and len(err) == 2
    assert main(["generate", str(out), "--prompt", "x", "--max-new-tokens", "2", "-q"]) == 0
