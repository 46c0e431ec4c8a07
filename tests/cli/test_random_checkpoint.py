"""m2export random-checkpoint: writes a loadable checkpoint; never replaces a non-empty folder without --force,
nor one m2export did not write without --force-foreign."""

from m2export.cli.main import main
from m2export.models.checkpoint import load_checkpoint

ARGS = ["random-checkpoint", "--d-model", "64", "--n-layer", "2", "--vocab-size", "256", "--ngroups", "2",
        "--d-state", "16", "--headdim", "16", "-q"]


def test_writes_loadable_checkpoint(tmp_path):
    assert main(ARGS + ["-o", str(tmp_path / "ck"), "--format", "hf"]) == 0
    ck = load_checkpoint(tmp_path / "ck")
    assert ck.format == "hf" and ck.config.ngroups == 2 and ck.config.vocab_size_padded == 256


def test_refuses_non_empty_dir_without_force(tmp_path, capsys):
    keep = tmp_path / "ck" / "keep.txt"
    keep.parent.mkdir()
    keep.write_text("precious")
    assert main(ARGS + ["-o", str(tmp_path / "ck")]) == 1
    assert "exists and is not empty" in capsys.readouterr().err
    assert keep.read_text() == "precious"
    assert main(ARGS + ["-o", str(tmp_path / "ck"), "--force"]) == 1  # not m2export's folder
    assert "m2export did not write (keep.txt)" in capsys.readouterr().err
    assert keep.read_text() == "precious"
    assert main(ARGS + ["-o", str(tmp_path / "ck"), "--force-foreign"]) == 1  # half the switch: says so
    assert "--force-foreign replaces a folder only together with --force" in capsys.readouterr().err
    assert keep.read_text() == "precious"
    assert main(ARGS + ["-o", str(tmp_path / "ck"), "--force", "--force-foreign"]) == 0
    assert not keep.exists() and (tmp_path / "ck" / "model.safetensors").is_file()
    assert main(ARGS + ["-o", str(tmp_path / "ck"), "--force"]) == 0  # m2export's own now


def test_needs_preset_or_shape(tmp_path, capsys):
    assert main(["random-checkpoint", "-o", str(tmp_path / "x"), "--d-model", "64"]) == 2  # flags missing: usage
    assert "--preset or all of" in capsys.readouterr().err


def test_never_replaces_the_current_directory(tmp_path, monkeypatch, capsys):
    (tmp_path / "keep.txt").write_text("precious")
    monkeypatch.chdir(tmp_path)
    assert main(ARGS + ["-o", ".", "--force"]) == 1
    assert "current directory" in capsys.readouterr().err
    assert (tmp_path / "keep.txt").read_text() == "precious"


def test_output_is_a_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert main(ARGS + ["-o", str(tmp_path / "afile"), "--force"]) == 1
    assert "not a directory" in capsys.readouterr().err


def test_config_errors_name_the_file(tmp_path, capsys):
    """--config FILE with a JSON that is no model config (here an export's m2export.json-like dict): the one error
    line names FILE (it said 'config: cannot tell the model family')."""
    import json

    bad = tmp_path / "m2export.json"
    bad.write_text(json.dumps({"manifest_version": 3, "graphs": []}))
    assert main(["random-checkpoint", "--config", str(bad), "-o", str(tmp_path / "ck"), "-q"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}: cannot tell the model family"), err
    assert not (tmp_path / "ck").exists() and "Traceback" not in err


def test_every_parameter_is_random_and_deterministic_per_seed(tmp_path):
    """No parameter is all zeros (the conv1d bias was: a zero bias hides a graph that drops it); the biases are
    PyTorch's default U(+-1/sqrt(fan_in)), fan_in d_conv for the depthwise conv; the same --seed writes the
    same tensors, another seed others."""
    import math

    import torch

    def write(name, seed, *extra):
        assert main(ARGS + ["-o", str(tmp_path / name), "--seed", str(seed), *extra]) == 0
        return dict(load_checkpoint(tmp_path / name).model.named_parameters())

    a, again, other = write("a", 3), write("a2", 3), write("b", 4)
    assert [n for n, p in a.items() if not p.detach().abs().sum() > 0] == []
    for n, p in a.items():
        assert torch.equal(p, again[n]), n
    bias = a["backbone.layers.0.mixer.conv1d.bias"]
    assert bias.abs().max() <= 1 / math.sqrt(4) and bias.std() > 0.1  # d_conv 4: U(-0.5, 0.5) has std 0.29
    assert not torch.equal(bias, other["backbone.layers.0.mixer.conv1d.bias"])


def test_hybrid_presets_have_no_zero_parameter(tmp_path):
    """Every family's random checkpoint, its Linear biases included where the family has them (Falcon-H1's
    out_proj), exercises every parameter."""
    for preset in ("tiny-falcon-h1", "tiny-nemotron-h", "tiny-zamba2"):
        assert main(["random-checkpoint", "--preset", preset, "-o", str(tmp_path / preset), "-q"]) == 0
        params = load_checkpoint(tmp_path / preset).model.named_parameters()
        assert [n for n, p in params if not p.detach().abs().sum() > 0] == [], preset


def test_weights_beyond_memory_are_one_line_before_anything_is_built(tmp_path, capsys):
    """d_model 2**20 (53 TB of fp32 weights): torch's 'DefaultCPUAllocator: can't allocate memory' (exit 70) after
    the model began to be built; sizes each below one allocation's limit ran into the OOM killer instead. Now
    refused from the meta-device count, nothing written; a hybrid config.json the same way."""
    import json

    from m2export.models.presets import preset_config

    out = tmp_path / "ck"
    assert main(["random-checkpoint", "--d-model", str(2 ** 20), "--n-layer", "2", "--vocab-size", "256", "-q",
                 "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("error: random checkpoint: its weights alone are 53054.8 GB"), err
    assert "more than this machine's" in err and not out.exists()
    _, cfg = preset_config("tiny-bamba")
    cfg.update(hidden_size=2 ** 20, mamba_n_heads=2 ** 17, intermediate_size=2 ** 22)
    (tmp_path / "big.json").write_text(json.dumps(cfg))
    assert main(["random-checkpoint", "--config", str(tmp_path / "big.json"), "-q", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error: random checkpoint: its weights alone are" in err and not out.exists()


def test_tiny_preset_sizes_in_help_and_readme_are_measured(tmp_path):
    """'random-checkpoint --help' states each test shape's size (it said '0.3 to 1.5 MB' where README said the hybrids
    are '0.6-1.4 MB'), every tiny preset: each is the written folder's size in fp32 to 0.1 MB, and README's hybrid range is theirs."""
    import re
    from pathlib import Path

    from m2export.cli import random_checkpoint as verb

    help_text = " ".join(verb.DESCRIPTION.split())
    stated = dict(re.findall(r"(tiny-[a-z0-9.-]+) \((\d+\.\d) MB", help_text))
    from m2export.models.config import PRESETS
    from m2export.models.presets import HYBRID_PRESETS

    assert sorted(stated) == sorted(n for n in [*PRESETS, *HYBRID_PRESETS] if n.startswith("tiny-")), stated
    for name, mb in stated.items():
        assert main(["random-checkpoint", "--preset", name, "-o", str(tmp_path / name), "-q"]) == 0
        size = sum(f.stat().st_size for f in (tmp_path / name).iterdir())
        assert f"{size / 1e6:.1f}" == mb, (name, size)
    hybrids = sorted(float(v) for k, v in stated.items() if k != "tiny-mamba2")
    readme = " ".join((Path(__file__).parents[2] / "README.md").read_text().split())
    assert f"(HF format, {hybrids[0]}-{hybrids[-1]} MB)" in readme
    assert f"(mamba_ssm format, {stated['tiny-mamba2']} MB)" in readme
    assert f"a hybrid test shape ({stated['tiny-zamba2']} MB)" in readme


def test_force_says_which_kind_of_folder_it_refuses(tmp_path, capsys):
    """--force over the other verb's output names what the folder is (an export folder is not a checkpoint, a
    checkpoint folder not an export) instead of 'files m2export did not write', which m2export did write; a long
    list of foreign names says how many there are. Nothing is replaced."""
    ck, ex, many = tmp_path / "ck", tmp_path / "ex", tmp_path / "many"
    assert main(ARGS + ["-o", str(ck)]) == 0
    assert main(["export", str(ck), "-o", str(ex), "--ssm-impl", "std", "-q"]) == 0
    before = sorted(p.name for p in ex.iterdir())
    capsys.readouterr()
    assert main(ARGS + ["-o", str(ex), "--force"]) == 1
    err = capsys.readouterr().err
    assert f"error: {ex}: is an m2export export folder (m2export.json), not a checkpoint;" in err, err
    assert sorted(p.name for p in ex.iterdir()) == before
    ck2 = tmp_path / "ck2"
    assert main(ARGS + ["-o", str(ck2)]) == 0
    capsys.readouterr()
    assert main(["export", str(ck), "-o", str(ck2), "--force", "-q"]) == 1
    err = capsys.readouterr().err
    assert (f"error: {ck2}: is a checkpoint folder (config.json + model.safetensors, no m2export.json), not an "
            "m2export export;") in err, err
    assert sorted(p.name for p in ck2.iterdir()) == ["config.json", "model.safetensors"]
    many.mkdir()
    for i in range(11):
        (many / f"f{i:02d}").write_text("mine")
    assert main(ARGS + ["-o", str(many), "--force"]) == 1
    err = capsys.readouterr().err
    assert "did not write (f00, f01, f02, f03, f04, ... (11 in all))" in err, err
    assert len(list(many.iterdir())) == 11
