"""run_check: passes on a correct export (both ORT flavours), fails on tampered graphs and names the outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from m2export.check.compare import REPORT_JSON, REPORT_MD, run_check
from m2export.errors import BackendUnavailable, CheckpointError, ExportFolderError
from m2export.exporter.manifest import read_manifest
from tests.check.exports import copy_export, record_engine, scale_initializer, set_ssm_scan_attribute, zero_graph_input

QUICK = dict(shapes=[(1, 5), (2, 17)], decode_steps=3)  # partial chunk and chunk + 1 (chunk_size 16)


@pytest.fixture(scope="module")
def passing_report(tiny_out, tmp_path_factory):
    rep = tmp_path_factory.mktemp("rep")
    return run_check(tiny_out, report_dir=rep), rep


def test_check_passes_both_flavours(passing_report, tiny_out):
    report, rep = passing_report
    assert report.passed, report.failures()
    names = [r["name"] for r in report.runners]
    assert names == ["torch", "onnxrt:model.onnx", "onnxrt:model.std.onnx"]
    outputs = ["logits", "present_conv_state.0", "present_ssm_state.0", "present_conv_state.1", "present_ssm_state.1"]
    # 5 default sizes, each fresh and continued, + 1 vocabulary-sweep feed; sequence: prefill + 8 decode steps
    assert report.vocab_coverage.startswith("every token id 0..255 fed at least once")
    for section, iters in (("prefill", 11), ("sequence", 9)):
        for runner in names[1:]:
            rows = [r for r in report.rows if r.section == section and r.runner.split("+")[0] == runner.split("+")[0]]
            assert [r.output for r in rows] == outputs
            assert all(r.iterations == iters and r.passed and r.max_abs < 1e-4 for r in rows)
    assert all(g["passed"] and g["agree"] + g["ties"] == g["total"] == 18 for g in report.greedy.values())
    assert any("TensorRT" in s and "skipped" in s for s in report.skipped)
    data = json.loads((rep / REPORT_JSON).read_text())
    assert data["passed"] is True and len(data["rows"]) == 2 * 2 * len(outputs)
    md = (rep / REPORT_MD).read_text()
    assert md.startswith("# m2export check: PASSED") and "polygraphy run" in md
    assert report.histogram is None and "matplotlib" in report.histogram_note or Path(report.histogram).is_file()


def test_polygraphy_commands_run(passing_report):
    """The printed `polygraphy run` commands are real: run from the report folder (--report-dir apart from
    OUTDIR: graph paths relative to it), each ORT flavour against the saved PyTorch outputs."""
    report, rep = passing_report
    assert len(report.polygraphy_commands) == 2 and report.commands_dir == str(rep)
    assert "--load-inputs check_inputs.json" in report.polygraphy_commands[0]
    bindir = Path(sys.executable).parent
    for cmd in report.polygraphy_commands:
        r = subprocess.run(f"{bindir}/{cmd}", shell=True, cwd=rep, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert "PASSED" in r.stdout and "vs. torch" in r.stdout



def test_data_loader_script_feeds_continued_states(passing_report, tiny_out, tiny_ck):
    """check_data_loader.py yields the very feeds the check compared (all of them fit the saved budget for
    this tiny model): every size fresh, then continued with the reference's non-zero states."""
    import importlib.util

    import numpy as np

    from m2export.check.data import TokenDataLoader
    from m2export.check.runners import ModelFromCheckpoint

    report, rep = passing_report
    spec = importlib.util.spec_from_file_location("check_data_loader", rep / "check_data_loader.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    feeds = list(mod.load_data())
    m = read_manifest(tiny_out)
    ours = list(TokenDataLoader(m.model_config(), m.dtype, [tuple(s) for s in report.shapes],
                                reference=ModelFromCheckpoint(tiny_ck), past_len=report.past_len))
    n = 2 * len(report.shapes)  # fresh + continued per size, then the vocabulary sweep (every id 0..255)
    assert len(feeds) == len(ours) == n + 1 and report.past_len > 0
    for a, b in zip(feeds, ours):
        assert list(a) == list(b) and all(np.array_equal(a[k], b[k]) for k in a)
    assert sorted(feeds[n]["input_ids"].ravel().tolist()) == list(range(256))
    feeds = feeds[:n]
    assert all(f["past_ssm_state.0"].any() and f["past_conv_state.1"].any() for f in feeds[1::2])
    assert not any(f["past_ssm_state.0"].any() for f in feeds[::2])
    assert "continued after" in (rep / REPORT_MD).read_text()

def test_tampered_ssm_scan_attribute_fails(tiny_out, tmp_path):
    """dt_softplus=0 on the SSMScan nodes of model.onnx: that flavour fails, the untouched one passes."""
    out = copy_export(tiny_out, tmp_path / "tampered")
    assert set_ssm_scan_attribute(out / "model.onnx", "dt_softplus", 0) == 2
    report = run_check(out, **QUICK)
    assert not report.passed
    bad = {(r.runner, r.output) for r in report.rows if not r.passed and r.section == "prefill"}
    assert ("onnxrt:model.onnx", "present_ssm_state.0") in bad and ("onnxrt:model.onnx", "logits") in bad
    assert not any(r.runner.startswith("onnxrt:model.std.onnx") for r in report.rows if not r.passed)
    assert any("present_ssm_state.0" in f for f in report.failures())
    md = (out / REPORT_MD).read_text()
    assert md.startswith("# m2export check: FAILED") and "onnxrt:model.onnx: present_ssm_state.0" in md


def test_tampered_weight_fails_only_downstream_outputs(tiny_out, tmp_path):
    """conv1d weight of layer 1 scaled in model.std.onnx: layer 1's ssm state and the logits fail; the conv
    states (the conv's raw inputs) and layer 0 (upstream of the change) pass, and the ssmscan flavour passes."""
    out = copy_export(tiny_out, tmp_path / "tampered_w")
    scale_initializer(out / "model.std.onnx", "model.backbone.layers.1.mixer.conv1d.weight", 1.1)
    report = run_check(out, **QUICK)
    bad = sorted({(r.runner, r.output) for r in report.rows if not r.passed and r.section == "prefill"})
    assert bad == [("onnxrt:model.std.onnx", "logits"), ("onnxrt:model.std.onnx", "present_ssm_state.1")]
    assert all(r.passed for r in report.rows if r.runner.startswith("onnxrt:model.onnx"))
    assert all(r.passed for r in report.rows if r.output in ("present_conv_state.0", "present_ssm_state.0"))
    assert "prefill onnxrt:model.std.onnx: logits" in " ".join(report.failures())


def test_missing_reference_and_engine(tiny_out, tmp_path):
    out = copy_export(tiny_out, tmp_path / "o")
    with pytest.raises(CheckpointError, match="checkpoint .*nowhere: no such file or directory"):  # the caller's
        run_check(out, checkpoint=tmp_path / "nowhere", **QUICK)
    import json

    m = json.loads((out / "m2export.json").read_text())
    (out / "m2export.json").write_text(json.dumps({**m, "source_checkpoint": str(tmp_path / "gone")}))
    with pytest.raises(CheckpointError, match=r"reference checkpoint .*gone \(from m2export.json\) does not exist"):
        run_check(out, **QUICK)
    (out / "m2export.json").write_text(json.dumps(m))
    entry = record_engine(out, [{"input_ids": {"min": [1, 1], "opt": [2, 64], "max": [4, 256]}}], payload=None)
    with pytest.raises(ExportFolderError, match="model.plan: prefill TensorRT engine listed in m2export.json is missing"):
        run_check(out, **QUICK)
    (out / "model.plan").write_bytes(b"not an engine")
    report = run_check(out, **QUICK)  # TensorRT absent here: skipped with a reason, ORT still checked
    assert report.passed
    assert any("skipped: TensorRT not installed" in s for s in report.skipped)
    with pytest.raises(BackendUnavailable, match="TensorRT is not installed"):
        run_check(out, require_trt=True, **QUICK)
    assert read_manifest(out).engines[0].file == "model.plan"
    assert asdict(entry)["profiles"]


def test_engine_profile_sizes_used(tiny_out, tmp_path):
    """With engines recorded, the prefill sizes are the profile's min/opt/max."""
    out = copy_export(tiny_out, tmp_path / "o")
    record_engine(out, [{"input_ids": {"min": [1, 1], "opt": [2, 20], "max": [3, 40]}}], payload=b"x")
    report = run_check(out, decode_steps=0)
    assert report.shapes == [[1, 1], [2, 20], [3, 40]] and report.passed


def test_histogram_png(tmp_path):
    """The optional PNG (matplotlib); without matplotlib the report says it was skipped and why."""
    import numpy as np

    from m2export.check.compare import _histogram

    hist = {"onnxrt:model.onnx | logits": [np.array([1e-7, 2e-6, 0.0])]}
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert _histogram(hist, tmp_path / "h.png") == (None, "skipped: matplotlib not installed "
                                                              "(pip install 'm2export[plot]')")
        return
    path, note = _histogram(hist, tmp_path / "h.png")
    assert note == "" and (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"


def test_engine_wiring_with_stand_in_runner(tiny_out, tmp_path, monkeypatch):
    """Wiring only, no TensorRT anywhere: with engines in the manifest and TensorRT 'available', check adds
    a trt runtime for model.plan (a prefill and a decode profile) to both sections. The stand-in runner is
    ONNX Runtime on the matching .onnx file, renamed; it proves the plumbing, not any TensorRT result."""
    import m2export.check.compare as cmp
    from m2export import backends
    from m2export.check.runners import onnxrt_runner

    out = copy_export(tiny_out, tmp_path / "o")
    prof = {"input_ids": {"min": [1, 1], "opt": [2, 16], "max": [2, 33]}}
    dec = {"input_ids": {"min": [1, 1], "opt": [2, 1], "max": [2, 1]}}
    record_engine(out, [prof, dec], role="prefill+decode", file="model.plan")
    monkeypatch.setattr(backends, "tensorrt_unavailable_reason", lambda **kw: None)
    profiles = []

    def stand_in(outdir, entry, decode_entry=None):
        profiles.extend([entry.profile_index("prefill"), entry.profile_index("decode")])
        return tuple(onnxrt_runner(Path(outdir) / entry.onnx_file, name=f"trt:{entry.file}:{r}") for r in
                     ("prefill", "decode"))

    monkeypatch.setattr(cmp, "trt_runners", stand_in)
    report = run_check(out, runtimes=("trt",), decode_steps=2)
    assert [r["name"] for r in report.runners] == ["torch", "trt:model.plan"] and profiles == [0, 1]
    assert report.shapes == [[1, 1], [2, 16], [2, 33]]  # the profile's min/opt/max
    assert {r.section for r in report.rows} == {"prefill", "sequence"} and report.passed
    assert "--runtime trt" in report.tensorrt_note  # a JIT engine needs m2export: no m2export-free command


def test_engine_wiring_with_a_decode_only_engine(tiny_out, tmp_path, monkeypatch):
    """With model.plan and a decode-only model.decode.plan (m2export build --role decode), check runs prefill
    on the first and the decode steps on the second. Stand-in runners as above: plumbing only."""
    import m2export.check.compare as cmp
    from m2export import backends
    from m2export.check.runners import onnxrt_runner

    out = copy_export(tiny_out, tmp_path / "o")
    prof = {"input_ids": {"min": [1, 1], "opt": [2, 16], "max": [2, 33]}}
    dec = {"input_ids": {"min": [1, 1], "opt": [2, 1], "max": [2, 1]}}
    record_engine(out, [prof, dec], role="prefill+decode", file="model.plan")
    record_engine(out, [dec], role="decode", file="model.decode.plan", onnx_file="model.onnx")
    monkeypatch.setattr(backends, "tensorrt_unavailable_reason", lambda **kw: None)
    seen = []

    def stand_in(outdir, entry, decode_entry=None):
        seen.append((entry.file, decode_entry.file if decode_entry is not None else None))
        return (onnxrt_runner(Path(outdir) / entry.onnx_file, name=f"trt:{entry.file}:prefill"),
                onnxrt_runner(Path(outdir) / decode_entry.onnx_file, name=f"trt:{decode_entry.file}:decode"))

    monkeypatch.setattr(cmp, "trt_runners", stand_in)
    report = run_check(out, runtimes=("trt",), decode_steps=2)
    assert seen == [("model.plan", "model.decode.plan")]
    assert [r["name"] for r in report.runners] == ["torch", "trt:model.plan+model.decode.plan"] and report.passed


def test_bf16_export_checked_with_onnx_reference(tiny_out_bf16, tmp_path):
    """bf16: ORT's CPU provider has no bf16 kernels, so both flavours run in ONNX's reference evaluator,
    against the fp32 reference rounded to bf16; a tampered bf16 graph still fails."""
    report = run_check(tiny_out_bf16, report_dir=tmp_path / "rep", **QUICK)
    assert report.passed, report.failures()
    assert [r["name"] for r in report.runners][1:] == ["onnx-reference:model.onnx", "onnx-reference:model.std.onnx"]
    assert any(s.startswith("ONNX Runtime: skipped: bf16 export") for s in report.skipped)
    assert report.atol[""] == 0.1 and report.polygraphy_commands == []
    logits = next(r for r in report.rows if r.output == "logits" and r.section == "prefill")
    assert 0 < logits.max_abs < 0.05  # bf16 rounding, well inside atol 0.1
    # the tamper must move outputs past bf16's atol 0.1: this tiny random model's SSM states stay far below
    # 0.1, so SSMScan tampers (dt_softplus=0 since the dt_min clamp, ignored past states) are within
    # tolerance here; a 1.5x lm_head moves the logits by ~0.35
    out = copy_export(tiny_out_bf16, tmp_path / "t")
    scale_initializer(out / "model.onnx", "model.lm_head.weight", 1.5)
    bad = run_check(out, **QUICK)
    assert not bad.passed and any("prefill onnx-reference:model.onnx: logits" in f for f in bad.failures())
    assert all(r.passed for r in bad.rows if r.runner.startswith("onnx-reference:model.std.onnx"))


@pytest.mark.parametrize("graph,state,op_type", [("model.onnx", "past_ssm_state", "SSMScan"),
                                                  ("model.std.onnx", "past_ssm_state", "Reshape"),
                                                  ("model.onnx", "past_conv_state", "CausalConv1d")])
def test_prefill_graph_ignoring_past_states_fails(tiny_out, tmp_path, graph, state, op_type):
    """A prefill graph that ignores its past states (SSMScan's initial_state or the conv's past inputs
    replaced by zeros) must fail: the prefill section also continues sequences, with the reference's
    states after a preceding text chunk as past states."""
    out = copy_export(tiny_out, tmp_path / "t")
    assert zero_graph_input(out / graph, f"{state}.0", op_type) == 1
    assert zero_graph_input(out / graph, f"{state}.1", op_type) == 1
    report = run_check(out, shapes=[(1, 5), (2, 17)], decode_steps=0)
    assert not report.passed
    bad = {(r.runner, r.output) for r in report.rows if not r.passed}
    runner = f"onnxrt:{graph}"
    assert {(runner, "logits"), (runner, "present_ssm_state.0"), (runner, "present_ssm_state.1")} <= bad
    if state == "past_conv_state":
        assert (runner, "present_conv_state.1") in bad  # layer 1's conv inputs come out of the wrong layer 0
    assert all(r.runner == runner for r in report.rows if not r.passed)
    failed = {it for r in report.rows if not r.passed for it in r.failed_iterations}
    assert failed and all("after" in it for it in failed)  # fresh sequences (zero past states) still pass


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE")
def test_report_on_a_full_disk_keeps_the_previous_one(tmp_path):
    """Reports are written atomically: a file-size limit (EFBIG, as a full disk's ENOSPC) leaves the old report."""
    prev = tmp_path / REPORT_JSON
    prev.write_text('{"previous": true}\n')
    code = f"""
import resource, signal
from m2export.check.compare import CheckReport
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
r = CheckReport(outdir="o", dtype="fp32", reference="torch", runners=[], skipped=["x" * 100] * 100, shapes=[],
                decode_steps=0, prompt_len=0, atol={{}}, rtol={{}}, rows=[], greedy={{}})
try:
    r.write_json(__import__("pathlib").Path({str(prev)!r}))
except OSError as e:
    print("errno", e.errno)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "errno 27" in r.stdout, r.stdout + r.stderr  # EFBIG
    assert prev.read_text() == '{"previous": true}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == [REPORT_JSON]
