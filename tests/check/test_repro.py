"""The export folder travels (m2export/check/repro.py): after 'm2export check', the printed Polygraphy commands
run inside a moved copy of the folder with m2export made unimportable (no checkpoint, no torch model), on the
saved inputs against the saved PyTorch outputs; the TensorRT commands (trtexec, polygraphy --trt) parse."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from m2export.check.compare import run_check
from m2export.check.repro import INPUTS_FILE, REFERENCE_FILE, RecordingLoader
from m2export.exporter.manifest import read_manifest
from tests.check.exports import copy_export, record_engine

QUICK = dict(shapes=[(1, 5), (2, 17)], decode_steps=0)


@pytest.fixture(scope="module")
def moved(tiny_out, tmp_path_factory):
    """A checked export (reports in the folder itself), then moved: the original path is gone."""
    base = tmp_path_factory.mktemp("travel")
    out = copy_export(tiny_out, base / "out")
    report = run_check(out, **QUICK)
    dest = base / "elsewhere" / "copy"
    dest.parent.mkdir()
    shutil.move(str(out), dest)
    return report, dest


def _blocked_env(tmp_path: Path) -> dict:
    """An environment where 'import m2export' fails: Polygraphy alone must do."""
    stub = tmp_path / "block"
    stub.mkdir(exist_ok=True)
    (stub / "m2export.py").write_text("raise ImportError('m2export is not installed on this machine')\n")
    env = dict(os.environ, PYTHONPATH=str(stub), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return env


def test_polygraphy_commands_run_in_a_moved_copy_without_m2export(moved, tmp_path):
    report, dest = moved
    assert report.passed and report.commands_dir == str(Path(report.outdir))
    labels = report.saved["labels"]
    # the four corpus feeds, then the vocabulary sweep (every token id at least once: issue 13 item 1)
    assert labels[:4] == ["1x5", "1x5 after 19", "2x17", "2x17 after 19"]
    assert len(labels) > 4 and all(label.startswith("vocab sweep ") for label in labels[4:])
    assert report.saved["feeds"] == len(labels)
    passed = f"Passed: {len(labels)}/{len(labels)} iterations"
    assert [shlex.split(c)[2] for c in report.polygraphy_commands] == ["model.onnx", "model.std.onnx"]
    env = _blocked_env(tmp_path)
    for cmd in report.polygraphy_commands:
        r = subprocess.run(cmd, shell=True, cwd=dest, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert passed in r.stdout and "vs. torch" in r.stdout  # the PyTorch reference itself
    # the data-loader script reads the JSON next to itself: it works from any directory
    cmd = shlex.split(report.polygraphy_commands[1])
    i = cmd.index("--load-inputs")
    cmd[i:i + 2] = ["--data-loader-script", f"{dest / 'check_data_loader.py'}:load_data"]
    cmd[2] = str(dest / cmd[2])
    cmd[cmd.index("--load-outputs") + 1] = str(dest / REFERENCE_FILE)
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and passed in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def test_saved_inputs_are_the_compared_feeds(moved, tiny_out, tiny_ck):
    from polygraphy.json import load_json

    from m2export.check.data import TokenDataLoader
    from m2export.check.runners import ModelFromCheckpoint

    report, dest = moved
    feeds = load_json(str(dest / INPUTS_FILE))
    m = read_manifest(tiny_out)
    ours = list(TokenDataLoader(m.model_config(), m.dtype, [tuple(s) for s in report.shapes],
                                reference=ModelFromCheckpoint(tiny_ck), past_len=report.past_len))
    assert len(feeds) == len(ours) == report.saved["feeds"] > 4  # corpus feeds + vocabulary sweep
    for a, b in zip(feeds, ours):
        assert list(a) == list(b) and all(np.array_equal(a[k], b[k]) for k in a)
    assert feeds[1]["past_ssm_state.0"].any() and not feeds[0]["past_ssm_state.0"].any()
    text = (dest / "check_data_loader.py").read_text()
    assert "m2export" not in text.split('"""', 2)[2] and str(tiny_ck) not in text  # no checkpoint, no m2export


def _shape_map(text: str) -> dict[str, list[int]]:
    out = {}
    for item in text.split(","):
        name, dims = item.rsplit(":", 1)
        out[name] = [int(d) for d in dims.split("x")]
    return out


def test_tensorrt_commands_parse(moved):
    """Without TensorRT: the trtexec and 'polygraphy run --trt' commands name files of the folder and a
    profile for every graph input (fixed dims as in the graph, min <= opt <= max)."""
    import onnx
    from polygraphy.tools.args import util as args_util

    report, dest = moved
    trtexec = [shlex.split(c) for c in report.tensorrt_commands if c.startswith("trtexec")]
    pgr = [shlex.split(c) for c in report.tensorrt_commands if c.startswith("polygraphy")]
    assert len(trtexec) == len(pgr) == 1  # the std flavour: the SSMScan graph needs the plugin (the note says so)
    assert "--plugin aot" in report.tensorrt_note
    args = dict(a[2:].split("=", 1) for a in trtexec[0][1:])
    graph = onnx.load(str(dest / args["onnx"]), load_external_data=False)
    dims = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in graph.graph.input}
    shapes = {k: _shape_map(args[k]) for k in ("minShapes", "optShapes", "maxShapes")}
    for name, want in dims.items():
        lo, opt, hi = (shapes[k][name] for k in ("minShapes", "optShapes", "maxShapes"))
        assert len(lo) == len(want)
        for d, a, b, c in zip(want, lo, opt, hi):
            assert a <= b <= c and (isinstance(d, str) or a == b == c == d), (name, d, a, b, c)
    assert args["saveEngine"] == "model.std.plan"
    argv = pgr[0]
    assert argv[2] == args["onnx"] and (dest / argv[argv.index("--load-inputs") + 1]).is_file()
    for flag, key in (("--trt-min-shapes", "minShapes"), ("--trt-opt-shapes", "optShapes"),
                      ("--trt-max-shapes", "maxShapes")):
        i = argv.index(flag) + 1
        vals = []
        while not argv[i].startswith("--"):
            vals.append(argv[i])
            i += 1
        meta = args_util.parse_meta(vals, includes_dtype=False)
        assert {n: list(m.shape) for n, m in meta.items()} == shapes[key]


def test_aot_engine_commands(tiny_out, tmp_path):
    """An AOT engine recorded in m2export.json gets 'polygraphy run --model-type engine' and 'trtexec
    --loadEngine' with its profile's opt shapes; a JIT engine gets the note instead."""
    out = copy_export(tiny_out, tmp_path / "o")
    prof = {"input_ids": {"min": [1, 1], "opt": [2, 16], "max": [2, 33]}}
    entry = record_engine(out, [prof])
    m = read_manifest(out)
    m.engines[0].plugin_mode = "aot"
    from m2export.check.repro import reproduction_commands, ssmscan_build_note
    from m2export.exporter.manifest import write_manifest

    write_manifest(out, m)
    cmds = reproduction_commands(out, read_manifest(out), out, {"": 1e-4}, {"": 1e-3})["tensorrt"]
    assert f"polygraphy run {entry.file} --model-type engine --trt --load-inputs {INPUTS_FILE}" in " ".join(cmds)
    assert f"trtexec --loadEngine={entry.file} --shapes=input_ids:2x16" in cmds
    m.engines[0].plugin_mode = "jit"
    assert "--runtime trt" in ssmscan_build_note(m)


def test_recording_loader_keeps_a_prefix_within_budget():
    feeds = [{"x": np.zeros((n, 1000), np.float32)} for n in (1, 2, 4, 8)]  # 4 kB, 8 kB, 16 kB, 32 kB
    rec = RecordingLoader(feeds, budget=40_000)
    for k, f in enumerate(rec):
        rec.record_outputs(k, {"y": f["x"]})
    assert rec.saved() == 2 and [f["x"].shape[0] for f in rec.feeds[:2]] == [1, 2]
    rec = RecordingLoader(feeds, budget=1)
    for k, f in enumerate(rec):
        rec.record_outputs(k, {"y": f["x"]})
    assert rec.saved() == 1  # the first feed is always kept


def test_native_graph_left_out_is_said(tiny_ck, tmp_path, capsys):
    """A native-flavour graph gets no polygraphy command (its states are not in the saved feeds' layout): the console
    and check_report.md say so and name it, instead of printing nothing (a native-only export printed no
    'reproduce' section at all and no reason)."""
    from m2export.cli.main import main

    out = tmp_path / "native"
    assert main(["export", str(tiny_ck), "-o", str(out), "--ssm-impl", "native", "-q"]) == 0
    capsys.readouterr()
    assert main(["check", str(out), "--shapes", "1x3", "--decode-steps", "1"]) == 0
    stdout = capsys.readouterr().out
    note = ("no polygraphy command for model.onnx: its states are in ONNX Runtime's own layouts, not the saved "
            "feeds'")
    assert "note: " + note in " ".join(stdout.split()), stdout
    assert "polygraphy run" not in stdout
    assert "Note: " + note in (out / "check_report.md").read_text()
