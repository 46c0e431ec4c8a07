"""Bad input through the CLI (issue 13, items 12 and 13): each case gives one ``error:`` line (plus an
optional ``hint:``) and an exit code of the table in m2export/errors.py, never a traceback (each was exit 70
with one, or a misleading message, on the code before these tests)."""

from __future__ import annotations

import pytest

from m2export.cli.main import main
from m2export.errors import ExitCode
from tests.check.exports import copy_export


def _one_error(capsys, expected: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and expected in lines[0], err
    return lines[0]


@pytest.mark.parametrize("which", ["input", "output"])
@pytest.mark.parametrize("target", ["outdir", "graph"])
def test_inspect_graph_with_an_unknown_elem_type(tiny_out, tmp_path, capsys, which, target):
    import onnx

    out = copy_export(tiny_out, tmp_path / "out")
    m = onnx.load(str(out / "model.onnx"), load_external_data=False)
    vi = (m.graph.input if which == "input" else m.graph.output)[0]
    vi.type.tensor_type.elem_type = 77
    onnx.save(m, str(out / "model.onnx"))
    rc = main(["inspect", str(out if target == "outdir" else out / "model.onnx")])
    line = _one_error(capsys, f"model.onnx: {which} {vi.name!r} has elem_type 77, which is no tensor type of ONNX's")
    assert rc == ExitCode.USER_ERROR, line


def _tampered_manifest(tiny_out, tmp_path, edit):
    import json

    out = copy_export(tiny_out, tmp_path / "out")
    m = json.loads((out / "m2export.json").read_text())
    edit(m)
    (out / "m2export.json").write_text(json.dumps(m))
    return out


def _set_config(key, value):
    def edit(m):
        if value is KeyError:
            del m["config"][key]
        else:
            m["config"][key] = value
    return edit


@pytest.mark.parametrize("edit,expected", [
    (lambda m: m.update(config=None), "m2export.json: 'config': expected an object, got None"),
    (_set_config("d_model", KeyError), "m2export.json: 'config' describes no model: Mamba2Config.__init__() "
                                       "missing 1 required positional argument: 'd_model'"),
    (_set_config("dt_limit", "abc"), "m2export.json: 'config' describes no model: config field 'dt_limit': "
                                     "expected [min, max] (two numbers), got 'abc'"),
    (_set_config("n_layer", 3), "m2export.json: graph model.onnx's recorded inputs disagree with 'config' "
                                "(n_layer etc.) and 'dtype' 'fp32': lacks ['past_conv_state.2', 'past_ssm_state.2']"),
    (lambda m: m.update(dtype="fp16"), "graph model.onnx's recorded inputs disagree with 'config' (n_layer etc.) "
                                       "and 'dtype' 'fp16': 'past_conv_state.0' is float32, expected float16"),
    (lambda m: m.update(dtype="int8"), "m2export.json: 'dtype': expected one of ['fp32', 'fp16', 'bf16'], got 'int8'"),
    (lambda m: m["graphs"][0]["states"][1].update(layout=["batch_size", "nheads", "d_state", "d_inner"]),
     "m2export.json: graph model.onnx's state past_ssm_state.0: 'layout' ['batch_size', 'nheads', 'd_state', "
     "'d_inner'] does not order the axes ['batch_size', 'nheads', 'headdim', 'd_state']"),
    (lambda m: m["graphs"][0].update(file=None), "malformed manifest (ValueError: graph 0: file None is not the name "
                                                 "of a file in the output folder)"),
    (lambda m: m["graphs"][0].update(file="../elsewhere/model.onnx"), "graph 0: file '../elsewhere/model.onnx' is "
                                                                       "not the name of a file in the output folder"),
    (lambda m: m["graphs"][0].update(external_data=["/etc/passwd"]), "graph 0: file '/etc/passwd' is not the name"),
    # accepted before (exit 0): a manifest from a future m2export, an opset that is no integer
    (lambda m: m.update(manifest_version=999), "out/m2export.json: 'manifest_version': 999 is newer than this "
                                                "m2export reads (expected 2)"),
    (lambda m: m.update(manifest_version="2"), "out/m2export.json: 'manifest_version': expected the integer 2, "
                                                "got '2'"),
    (lambda m: m.update(opset="18"), "out/m2export.json: 'opset': expected an integer >= 18, got '18'"),
    (lambda m: m.update(opset=7), "out/m2export.json: 'opset': expected an integer >= 18, got 7"),
], ids=["config-null", "no-d_model", "dt_limit-abc", "n_layer", "dtype-label", "dtype-unknown", "state-layout",
        "file-null", "file-outside", "data-outside", "version-999", "version-str", "opset-str", "opset-7"])
@pytest.mark.parametrize("verb", ["inspect", "generate", "check"])
def test_tampered_manifest(tiny_out, tmp_path, capsys, edit, expected, verb):
    """Each was a traceback (exit 70: TypeError, ValueError, Polygraphy's "Extra inputs") or, for inspect, a
    description of a model the graphs are not."""
    out = _tampered_manifest(tiny_out, tmp_path, edit)
    extra = {"generate": ["--prompt", "ab", "--max-new-tokens", "2"], "check": ["--report-dir", str(tmp_path)],
             "inspect": []}[verb]
    rc = main([verb, str(out), *extra])
    _one_error(capsys, expected)
    assert rc == ExitCode.USER_ERROR


@pytest.mark.parametrize("verb", ["generate", "check"])
def test_swapped_graph_files(tiny_out, tmp_path, capsys, verb):
    """model.onnx (ssmscan) and model.std.onnx swapped: both ran, as the flavour the other one is (exit 0)."""
    out = copy_export(tiny_out, tmp_path / "out")
    (out / "model.onnx").rename(out / "x")
    (out / "model.std.onnx").rename(out / "model.onnx")
    (out / "x").rename(out / "model.std.onnx")
    extra = ["--prompt", "ab", "--max-new-tokens", "2"] if verb == "generate" else ["--report-dir", str(tmp_path)]
    rc = main([verb, str(out), *extra])
    _one_error(capsys, "model.onnx: m2export.json lists it as the ssmscan flavour, but it has 0 SSMScan node(s)")
    assert rc == ExitCode.USER_ERROR


def test_check_shapes_beyond_memory(tiny_out, tmp_path, capsys):
    """--shapes 99999999999x1 was numpy's MemoryError (exit 70) after the reference was loaded."""
    rc = main(["check", str(tiny_out), "--shapes", "1x1,99999999999x1", "--report-dir", str(tmp_path)])
    line = _one_error(capsys, "error: --shapes 99999999999x1: one input's logits alone are 102400.0 GB (batch x "
                              "seqlen x vocabulary 256 x 4 bytes")
    assert "more than this machine's" in line and rc == ExitCode.USER_ERROR


def test_check_with_a_missing_checkpoint_names_the_flag(tiny_out, tmp_path, capsys):
    """--checkpoint /nonexistent said "(from m2export.json)" (issue 13, item 13)."""
    missing = tmp_path / "nonexistent"
    rc = main(["check", str(tiny_out), "--checkpoint", str(missing), "--report-dir", str(tmp_path)])
    line = _one_error(capsys, f"error: --checkpoint {missing}: no such file or directory")
    assert "m2export.json" not in line and rc == ExitCode.USER_ERROR


def test_generate_with_a_prompt_that_is_not_utf8(tiny_out, capsys):
    """A non-UTF-8 argument (Python keeps the byte 0xff as the lone surrogate U+DCFF) was UnicodeEncodeError."""
    import os

    prompt = os.fsdecode(b"a\xffb")
    rc = main(["generate", str(tiny_out), "--prompt", prompt, "--max-new-tokens", "2"])
    _one_error(capsys, "error: --prompt: not UTF-8 text (byte 0xff at offset 1)")
    assert rc == ExitCode.USER_ERROR


@pytest.mark.parametrize("verb", ["inspect", "check"])
def test_manifest_nested_too_deeply(tiny_out, tmp_path, capsys, verb):
    """An m2export.json of 100,000 nested arrays was json's RecursionError (exit 70)."""
    out = copy_export(tiny_out, tmp_path / "out")
    (out / "m2export.json").write_text("[" * 100_000 + "]" * 100_000)
    rc = main([verb, str(out), *(["--report-dir", str(tmp_path)] if verb == "check" else [])])
    _one_error(capsys, "m2export.json: malformed manifest (ValueError: nested too deeply to parse")
    assert rc == ExitCode.USER_ERROR


def test_export_of_a_config_nested_too_deeply(tmp_path, capsys):
    """A config.json of 100,000 nested arrays was json's RecursionError (exit 70)."""
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    (ck / "model.safetensors").write_bytes(b"")
    rc = main(["export", str(ck), "-o", str(tmp_path / "out"), "-q"])
    _one_error(capsys, "ck/config.json: malformed JSON: nested too deeply to parse")
    assert rc == ExitCode.USER_ERROR and not (tmp_path / "out").exists()


def test_check_with_an_empty_weights_file(tiny_out, tmp_path, capsys):
    """model.onnx.data emptied (0 bytes) was numpy's 'cannot mmap an empty file' (exit 70) in the check's
    shared weights, before ONNX Runtime could say what is wrong; now the graph's check says it first."""
    out = copy_export(tiny_out, tmp_path / "out")
    (out / "model.onnx.data").write_bytes(b"")
    rc = main(["check", str(out), "--report-dir", str(tmp_path)])
    _one_error(capsys, "model.onnx: model.onnx.data is truncated (0 bytes; the graph reads ")
    assert rc == ExitCode.USER_ERROR


@pytest.mark.parametrize("damage", ["truncated", "empty-object"])
def test_damaged_manifest_says_so_and_its_hint_works(tiny_ck, tiny_out, tmp_path, capsys, damage):
    """A truncated m2export.json (or '{}') named the re-export with --force, which then refused the folder ("has no
    m2export manifest"); '{}' read as a version-1 manifest ("written by an older m2export"). Found by a new-user
    tryout. Now: malformed, a hint naming --force --force-foreign, export --force says the manifest is damaged, and
    following the hint re-exports."""
    out = copy_export(tiny_out, tmp_path / "out")
    f = out / "m2export.json"
    f.write_text(f.read_text()[:20] if damage == "truncated" else "{}")
    assert main(["check", str(out), "--report-dir", str(tmp_path)]) == ExitCode.USER_ERROR
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if ln.startswith("error:"))
    assert "malformed manifest" in line and "older m2export" not in line, err
    if damage == "empty-object":
        assert "no 'manifest_version' field" in line, err
    hint = next(ln for ln in err.splitlines() if ln.startswith("hint:"))
    assert "--force --force-foreign" in hint, err
    assert main(["export", str(tiny_ck), "-o", str(out), "--force", "-q"]) == ExitCode.USER_ERROR
    assert "m2export.json is damaged" in capsys.readouterr().err
    assert main(["export", str(tiny_ck), "-o", str(out), "--force", "--force-foreign", "-q"]) == 0
    assert main(["check", str(out), "--report-dir", str(tmp_path), "-q"]) == 0


@pytest.mark.parametrize("case", ["malformed-json", "missing-field", "no-weights", "check-nonexistent"])
def test_input_errors_are_one_line_and_a_hint(tmp_path, capsys, case):
    """Each printed its error line alone (no hint); no weights listed WEIGHT_FILES as a Python list
    (['model.safetensors', ...]); 'm2export check nope' said "not a directory" of a path that does not exist."""
    import json

    from m2export.models.checkpoint import random_checkpoint

    ck = random_checkpoint(tmp_path / "ck", d_model=32, n_layer=1, vocab_size=64, d_state=16, headdim=16)
    cfg = ck / "config.json"
    if case == "malformed-json":
        cfg.write_text('{"d_model": 32,\n')
        want = f"error: {cfg}: malformed JSON: "
    elif case == "missing-field":
        c = json.loads(cfg.read_text())
        del c["n_layer"]
        cfg.write_text(json.dumps(c))
        want = f"error: {cfg}: missing required field 'n_layer'"
    elif case == "no-weights":
        (ck / "model.safetensors").unlink()
        want = (f"error: {ck}: no weights found (expected model.safetensors, model.safetensors.index.json or "
                "pytorch_model.bin beside config.json)")
    else:
        want = f"error: {tmp_path / 'nope'}: does not exist"
    args = ["check", str(tmp_path / "nope")] if case == "check-nonexistent" else \
        ["export", str(ck), "-o", str(tmp_path / "out"), "-q"]
    assert main(args) == ExitCode.USER_ERROR
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(want) and lines[1].startswith("hint: "), lines
    assert "[" not in lines[0] and "Traceback" not in lines[0], lines


ORT_ARENA = ("[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running MatMul node. Status Message: "
             "bfc_arena.cc:360 Failed to allocate memory for requested buffer of size 1074004224")
ORT_BAD_ALLOC = ("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while running Where node. "
                 "Name:'' Status Message: std::bad_alloc")


TORCH_CPU = ("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: you tried to "
             "allocate 4000000000000 bytes. Error code 12 (Cannot allocate memory)")
TORCH_WIN = "[enforce fail at alloc_cpu.cpp:72] data. DefaultCPUAllocator: not enough memory: you tried to allocate 8 bytes."


@pytest.mark.parametrize("kind,msg,said", [("Fail", ORT_ARENA, "ONNX Runtime could not allocate a buffer of 1.07 GB"),
                                           ("RuntimeException", ORT_BAD_ALLOC,
                                            "ONNX Runtime could not allocate memory (std::bad_alloc)"),
                                           ("wrapped", ORT_ARENA, "ONNX Runtime could not allocate a buffer of 1.07 GB"),
                                           ("torch", TORCH_CPU, "PyTorch could not allocate 4000.00 GB"),
                                           ("torch", TORCH_WIN, "PyTorch could not allocate 0.00 GB")])
def test_runtime_out_of_memory_is_one_line(kind, msg, said, tiny_out, monkeypatch, capsys):
    """ONNX Runtime's allocation failures (a 65,536-token prompt or --shapes 1x65536 under a 6 GB limit: its arena's
    'Failed to allocate memory', a kernel's std::bad_alloc) were 'internal error ... this is a bug' with ORT's
    traceback, exit 70; they are out of memory like numpy's MemoryError: one line + hint, exit 1. Any other ORT
    failure is still exit 70."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors

    import m2export.generate as G

    def boom(*a, **k):
        if kind == "torch":  # torch's CPU allocator: a plain RuntimeError (check's reference prefill: exit 70)
            raise RuntimeError(msg)
        err = getattr(ort_errors, "Fail" if kind == "wrapped" else kind)(msg)
        if kind == "wrapped":  # as a runner would re-raise it
            raise RuntimeError("the prefill failed") from err
        raise err

    monkeypatch.setattr(G, "generate", boom)
    rc = main(["generate", str(tiny_out), "--prompt-ids", "1,2", "--ids"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == ExitCode.USER_ERROR and len(lines) == 2 and "Traceback" not in err, err
    assert lines[0] == f"error: out of memory in 'm2export generate': {said}", err
    monkeypatch.setattr(G, "generate", lambda *a, **k: (_ for _ in ()).throw(ort_errors.Fail("some other failure")))
    assert main(["generate", str(tiny_out), "--prompt-ids", "1,2", "--ids"]) == ExitCode.INTERNAL


@pytest.mark.parametrize("argv", [["export", "{ck}", "-o", "{p}"], ["check", "{p}"], ["inspect", "{p}"],
                                  ["generate", "{p}", "--prompt-ids", "1"], ["check", "{out}", "--report-dir", "{p}"]])
@pytest.mark.parametrize("kind", ["too_long", "loop"])
def test_unusable_paths_are_one_line(argv, kind, tiny_ck, tiny_out, tmp_path, capsys):
    """A path the OS cannot look at (a 300-character name: ENAMETOOLONG; a symbolic link pointing at itself, which
    Path.resolve reports as RuntimeError 'Symlink loop') was 'internal error ... this is a bug', exit 70, from export
    -o, check/inspect/generate SOURCE and check --report-dir: now one line naming the path, exit 1."""
    if kind == "loop":
        p = tmp_path / "loopy"
        p.symlink_to("loopy")
        p = p / "sub" if argv[0] == "export" else p
    else:
        p = tmp_path / ("x" * 300)
    args = [a.format(ck=tiny_ck, out=tiny_out, p=p) for a in argv]
    rc = main(args)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == ExitCode.USER_ERROR and "Traceback" not in err, err
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), err
    if kind == "too_long":
        assert "File name too long" in lines[0] and "(3" in lines[0], err  # the name shortened, its length given


def _scan_bound_seqlen(cfg) -> int:
    """A seqlen whose logits fit this machine's memory 3 times but whose ONNX scan body (its (nchunks + 1)^2 decay
    matrices, ChunkedBodySizes) does not (bisected on the estimate)."""
    import os

    from m2export.exporter.ssm_scan_op import ChunkedBodySizes

    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    lo, hi = 2, 1 << 40
    while hi - lo > 1:
        mid = (lo + hi) // 2
        fits = ChunkedBodySizes.of(1, mid, cfg.nheads, cfg.headdim, cfg.d_state, cfg.chunk_size).peak \
            + 3 * mid * cfg.vocab_size * 4 <= memory
        lo, hi = (mid, hi) if fits else (lo, mid)
    if 3 * hi * cfg.vocab_size * 4 > memory:
        pytest.skip("on this machine the logits alone exceed memory first")
    return hi


def test_check_shape_whose_scan_body_exceeds_memory(tiny_out, tmp_path, capsys):
    """A long sequence whose logits fit but whose ONNX scan body's (nchunks + 1)^2 decay matrices do not: the
    memory pre-check counted only the logits, so the check started (and ONNX Runtime or the OOM killer ended it).
    Now one line naming the shape, what it needs and what is expected, exit 1, before the reference loads."""
    from m2export.exporter.manifest import read_manifest

    s = _scan_bound_seqlen(read_manifest(tiny_out).model_config())
    rc = main(["check", str(tiny_out), "--shapes", f"1x1,1x{s}", "--report-dir", str(tmp_path)])
    line = _one_error(capsys, f"error: --shapes 1x{s}: needs about ")
    assert "for one layer's ONNX scan body ((nchunks + 1)^2 decay matrices for" in line, line
    assert "expected at most this machine's" in line and rc == ExitCode.USER_ERROR, line
    assert not (tmp_path / "check_report.json").exists()


def test_export_refuses_an_a_log_whose_a_overflows(tiny_ck, tmp_path, capsys):
    """A_log 89 (A = -exp(89) = -inf in float32): was exit 0 and graphs whose ssmscan/std logits were all NaN."""
    import shutil

    from safetensors.torch import load_file, save_file

    ck = tmp_path / "ck"
    shutil.copytree(tiny_ck, ck)
    sd = load_file(ck / "model.safetensors")
    sd["backbone.layers.0.mixer.A_log"][0] = 89.0
    save_file(sd, ck / "model.safetensors", metadata={"format": "pt"})
    rc = main(["export", str(ck), "-o", str(tmp_path / "out"), "-q"])
    line = _one_error(capsys, "tensor 'backbone.layers.0.mixer.A_log' has a value at index [0]: 89.0 whose "
                              "A = -exp(A_log) is -inf in float32; expected A_log <= 88.7228")
    assert rc == ExitCode.USER_ERROR and str(ck / "model.safetensors") in line, line
    assert not (tmp_path / "out").exists()


def test_check_refuses_a_chunk_size_whose_continued_prefix_exceeds_memory(tmp_path, capsys):
    """Continued inputs follow a reference prefill of chunk_size + 3 tokens whatever --shapes says: with chunk_size
    10^6 its within-chunk matrices (10^12 elements per head) made torch's allocator raise, a traceback and exit 70.
    Now refused before anything runs, one line naming chunk_size, exit 1."""
    from m2export.exporter import export_model
    from m2export.models.checkpoint import random_checkpoint

    ck = random_checkpoint(tmp_path / "ck", seed=4, d_model=16, n_layer=1, vocab_size=32, d_state=8, headdim=8,
                           chunk_size=10 ** 6)
    export_model(ck, tmp_path / "out", check=False)
    rc = main(["check", str(tmp_path / "out"), "--shapes", "1x5", "--decode-steps", "0", "--report-dir",
               str(tmp_path / "rep")])
    line = _one_error(capsys, "error: a continued input of batch 1 needs the reference to prefill 1000003 "
                              "tokens first (chunk_size 1000000 + 3: its states come out of a chunk boundary), about ")
    assert "expected at most this machine's" in line and rc == ExitCode.USER_ERROR, line
    assert not (tmp_path / "rep" / "check_report.json").exists()
