"""One vocabulary (m2export/names.py): the same runtime and flavour names in every verb and in the library;
the old spellings (runtime 'ort', flavours 'plugin'/'onnx') are still accepted, with a deprecation note."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest

from m2export import names
from m2export.cli.main import main


def test_names_and_aliases_do_not_overlap():
    assert set(names.RUNTIMES) == {"torch", "onnxrt", "onnx-reference", "trt"}
    assert set(names.FLAVOURS) == {"ssmscan", "std", "native"} and names.PRIMARY_FLAVOUR in names.FLAVOURS
    for kind, table in names.ALIASES.items():
        current = set(names.RUNTIMES) if kind == "runtime" else set(names.FLAVOURS) | set(names.GROUPS)
        assert not set(table) & current and set(table.values()) <= current


@pytest.mark.parametrize("verb", ["export", "check", "generate"])
def test_help_lists_only_the_current_names(verb, capsys):
    with pytest.raises(SystemExit):
        main([verb, "--help"])
    out = capsys.readouterr().out
    if verb in ("check", "generate"):
        assert "onnxrt" in out and "{torch,ort," not in out and ",ort," not in out
    if verb in ("export", "generate"):
        assert "ssmscan" in out and "{plugin,onnx" not in out


def test_generate_runtime_ort_is_an_alias_with_a_note(tiny_out, capsys):
    assert main(["generate", str(tiny_out), "--prompt", "de", "--max-new-tokens", "4", "--runtime", "onnxrt"]) == 0
    new = capsys.readouterr()
    assert main(["generate", str(tiny_out), "--prompt", "de", "--max-new-tokens", "4", "--runtime", "ort"]) == 0
    old = capsys.readouterr()
    assert old.out == new.out
    assert "note: --runtime ort is deprecated; use --runtime onnxrt" in old.err
    assert "deprecated" not in new.err
    assert new.err.startswith("onnxrt (model.onnx): prefill")


def test_library_runtime_alias_warns(tiny_out):
    from m2export.generate import generate

    ref = generate(tiny_out, [100, 101], runtime="onnxrt", max_new_tokens=3)
    with pytest.warns(DeprecationWarning, match="runtime 'ort' is deprecated; use 'onnxrt'"):
        old = generate(tiny_out, [100, 101], runtime="ort", max_new_tokens=3)
    assert old.new_ids == ref.new_ids and old.runtime == ref.runtime == "onnxrt (model.onnx)"


def test_check_runtime_ort_is_an_alias(tiny_out, tmp_path, capsys):
    rc = main(["check", str(tiny_out), "--runtime", "ort", "--shapes", "1x3", "--decode-steps", "0",
               "--report-dir", str(tmp_path)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "note: --runtime ort is deprecated; use --runtime onnxrt" in cap.err
    report = json.loads((tmp_path / "check_report.json").read_text())
    assert [r["name"].split(":")[0] for r in report["runners"][1:]] == ["onnxrt", "onnxrt"]


@pytest.mark.parametrize("old,new", [("plugin", "ssmscan"), ("onnx", "std")])
def test_export_flavour_aliases(old, new, tiny_ck, tmp_path, capsys):
    out = tmp_path / old
    assert main(["export", str(tiny_ck), "-o", str(out), "--ssm-impl", old, "--no-check", "-q"]) == 0
    assert f"note: --ssm-impl {old} is deprecated; use --ssm-impl {new}" in capsys.readouterr().err
    m = json.loads((out / "m2export.json").read_text())
    assert {g["ssm_impl"] for g in m["graphs"]} == {new}


def test_manifest_with_old_flavour_names_reads_as_new(tiny_out, tmp_path, capsys):
    """An export written before the rename (ssm_impl plugin/onnx in m2export.json) still works everywhere."""
    from m2export.exporter.manifest import read_manifest

    out = tmp_path / "old"
    shutil.copytree(tiny_out, out)
    m = json.loads((out / "m2export.json").read_text())
    for g in m["graphs"]:
        g["ssm_impl"] = {"ssmscan": "plugin", "std": "onnx"}[g["ssm_impl"]]
    (out / "m2export.json").write_text(json.dumps(m))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reading an old manifest is not the user's deprecated call
        man = read_manifest(out)
    assert sorted(g.ssm_impl for g in man.graphs) == ["ssmscan", "std"]
    assert man.graph("prefill", "std").file == "model.std.onnx"
    assert main(["generate", str(out), "--prompt", "x", "--max-new-tokens", "2", "--ssm-impl", "std", "-q"]) == 0
    capsys.readouterr()


def test_one_tensorrt_install_hint_everywhere():
    """Every TensorRT hint in the code is the one in m2export/backends.py."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "m2export"
    hits = [p for p in root.rglob("*.py") if "pypi.nvidia.com" in p.read_text()]
    assert [p.name for p in hits] == ["backends.py"]
