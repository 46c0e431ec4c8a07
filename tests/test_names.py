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


def test_old_names_are_accepted_with_a_note(tiny_ck, tiny_out, tmp_path, capsys):
    """The one test of the deprecated spellings (every other test uses the current names): each alias becomes its
    new name, with a note on stderr on the command line and a DeprecationWarning in the library; end to end, an
    old runtime name (generate, CLI and library) and an old flavour name (export) do what the new ones do."""
    from m2export.generate import generate

    for kind, table in names.ALIASES.items():
        for old, new in table.items():
            assert names.cli_type(kind, "--flag")(old) == new
            assert f"note: --flag {old} is deprecated; use --flag {new}" in capsys.readouterr().err
            with pytest.warns(DeprecationWarning, match=f"{kind} {old!r} is deprecated; use {new!r}"):
                assert names.canonical(kind, old) == new
    argv = ["generate", str(tiny_out), "--prompt", "de", "--max-new-tokens", "4", "--runtime"]
    assert main(argv + ["onnxrt"]) == 0
    current = capsys.readouterr()
    assert main(argv + ["ort"]) == 0
    old = capsys.readouterr()
    assert old.out == current.out and "deprecated" not in current.err
    assert "note: --runtime ort is deprecated; use --runtime onnxrt" in old.err
    assert current.err.startswith("onnxrt (model.onnx): prefill")
    ref = generate(tiny_out, [100, 101], runtime="onnxrt", max_new_tokens=3)
    with pytest.warns(DeprecationWarning, match="runtime 'ort' is deprecated; use 'onnxrt'"):
        res = generate(tiny_out, [100, 101], runtime="ort", max_new_tokens=3)
    assert res.new_ids == ref.new_ids and res.runtime == ref.runtime == "onnxrt (model.onnx)"
    out = tmp_path / "old_flavour"
    assert main(["export", str(tiny_ck), "-o", str(out), "--ssm-impl", "onnx", "--no-check", "-q"]) == 0
    assert "note: --ssm-impl onnx is deprecated; use --ssm-impl std" in capsys.readouterr().err
    assert {g["ssm_impl"] for g in json.loads((out / "m2export.json").read_text())["graphs"]} == {"std"}


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


def test_readme_vocabulary_names_every_flavour_and_its_graph_files():
    """README's "One vocabulary" paragraph names every --ssm-impl choice (it omitted native and all) and, for each,
    the graph files an export writes (graph_file: the first flavour is model.onnx, the others get their infix)."""
    from pathlib import Path

    from m2export.exporter.export import SSM_IMPL_CHOICES, graph_file

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    para = " ".join(readme.split("One vocabulary", 1)[1].split("\n\n", 1)[0].split())
    for choice in SSM_IMPL_CHOICES:
        assert f"`{choice}`" in para, choice
        impls = names.GROUPS.get(choice, (choice,))
        files = " + ".join(f"`{graph_file(i, i == impls[0])}`" + (f" ({i})" if len(impls) > 1 and k == 0 else "")
                           for k, i in enumerate(impls))
        assert files in para, (choice, files)
