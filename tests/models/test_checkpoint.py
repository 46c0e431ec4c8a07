"""Checkpoint loading: both formats round-trip; each malformed input raises a named error."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from m2export.errors import CheckpointError, ConfigError, OutputFolderError
from m2export.models.checkpoint import load_checkpoint, random_checkpoint, read_config

TINY = dict(d_model=64, n_layer=2, vocab_size=100, d_state=16, headdim=16, ngroups=2, chunk_size=8,
            dt_limit=(0.001, 0.5))


@pytest.mark.parametrize("fmt", ["mamba_ssm", "hf"])
def test_roundtrip(tmp_path, fmt):
    path = random_checkpoint(tmp_path / fmt, format=fmt, seed=0, **TINY)
    ck = load_checkpoint(path)
    assert ck.format == fmt
    assert ck.config.ngroups == 2 and ck.config.dt_limit == (0.001, 0.5) and ck.config.chunk_size == 8
    again = load_checkpoint(path / "model.safetensors")  # a weight-file path works too
    ids = torch.randint(0, 100, (1, 9))
    with torch.no_grad():
        assert torch.equal(ck.model(ids).logits, again.model(ids).logits)
    assert ck.sha256 == again.sha256 and len(ck.sha256) == 64


def test_formats_give_same_model(tmp_path):
    a = load_checkpoint(random_checkpoint(tmp_path / "a", format="mamba_ssm", seed=5, **TINY)).model
    b = load_checkpoint(random_checkpoint(tmp_path / "b", format="hf", seed=5, **TINY)).model
    ids = torch.randint(0, 100, (2, 7))
    with torch.no_grad():  # mamba_ssm's logits stop at vocab_size; HF's vocab_size is the padded row count
        la, lb = a(ids).logits, b(ids).logits
    assert la.shape[-1] == 100 and lb.shape[-1] == 112 and torch.equal(la, lb[..., :100])


def test_pytorch_model_bin(tmp_path):
    path = random_checkpoint(tmp_path / "c", seed=1, **TINY)
    sd = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    torch.save(sd, path / "pytorch_model.bin")
    assert load_checkpoint(path).config.n_layer == 2


def _ckpt(tmp_path):
    return random_checkpoint(tmp_path / "ck", seed=2, **TINY)


def _edit_config(path, fn):
    """Rewrite path/config.json with ``fn(cfg)`` applied to its parsed contents."""
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def _tampered_ckpt(tmp_path, edit):
    """A saved checkpoint whose state dict was changed by ``edit(sd)`` before writing it back."""
    path = _ckpt(tmp_path)
    sd = load_file(str(path / "model.safetensors"))
    edit(sd)
    save_file(sd, str(path / "model.safetensors"))
    return path


def test_missing_tensor(tmp_path):
    path = _tampered_ckpt(tmp_path, lambda sd: sd.pop("backbone.layers.1.mixer.A_log"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) \['backbone.layers.1.mixer.A_log'\]"):
        load_checkpoint(path)


def test_extra_tensor(tmp_path):
    path = _tampered_ckpt(tmp_path, lambda sd: sd.update({"backbone.layers.2.mixer.D": torch.ones(8)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*backbone.layers.2.mixer.D"):
        load_checkpoint(path)


def test_misshaped_tensor(tmp_path):
    path = _tampered_ckpt(tmp_path, lambda sd: sd.update({"backbone.layers.0.mixer.dt_bias": torch.ones(5)}))
    want = r"'backbone.layers.0.mixer.dt_bias' has shape \(5,\), expected \(8,\)"
    with pytest.raises(CheckpointError, match=want) as e:
        load_checkpoint(path)
    assert e.value.hint and "describe different models" in e.value.hint


def test_malformed_json(tmp_path):
    path = _ckpt(tmp_path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json: malformed JSON"):
        load_checkpoint(path)


def test_unknown_layer_type(tmp_path):
    path = _ckpt(tmp_path)
    _edit_config(path, lambda c: c["ssm_cfg"].__setitem__("layer", "Mamba1"))
    with pytest.raises(ConfigError, match=r"ssm_cfg.layer='Mamba1' is not supported"):
        load_checkpoint(path)


def test_unknown_ssm_cfg_field_is_rejected_not_ignored(tmp_path):
    path = _ckpt(tmp_path)
    _edit_config(path, lambda c: c["ssm_cfg"].__setitem__("mystery", 3))
    with pytest.raises(ConfigError, match=r"unsupported field\(s\) \['mystery'\]"):
        read_config(path)


def test_every_ssm_cfg_field_is_honoured(tmp_path):
    path = _ckpt(tmp_path)
    _edit_config(path, lambda c: c["ssm_cfg"].update(d_state=8, headdim=8, ngroups=4, chunk_size=32, expand=1, d_conv=3,
                                                      dt_limit=[0.01, 0.2]))
    c, fmt = read_config(path)
    assert (c.d_state, c.headdim, c.ngroups, c.chunk_size, c.expand, c.d_conv, c.dt_limit) == \
        (8, 8, 4, 32, 1, 3, (0.01, 0.2))


def test_missing_paths(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or directory"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()  # a folder without config.json says so (was: "no weights found")
    with pytest.raises(CheckpointError, match="empty/config.json: missing; .* is not a checkpoint directory"):
        load_checkpoint(tmp_path / "empty")
    path = _ckpt(tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: missing"):
        load_checkpoint(path)


def test_corrupt_weights(tmp_path):
    path = _ckpt(tmp_path)
    (path / "model.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(CheckpointError, match="cannot read tensors") as e:
        load_checkpoint(path)
    assert e.value.hint and "damaged, cut short" in e.value.hint  # one line + hint (README trial: there was none)


@pytest.mark.parametrize("field,value,match", [
    ("tie_embeddings", "false", r"'tie_embeddings': expected true or false, got 'false'"),
    ("residual_in_fp32", "no", r"'residual_in_fp32': expected true or false"),
    ("norm_epsilon", "x", r"'norm_epsilon': expected a number in \(0, 1\)"),
    ("norm_epsilon", -1, r"'norm_epsilon': expected a number in \(0, 1\), got -1"),
    ("rms_norm", 1, r"'rms_norm'=1 is not supported"),
    ("ssm_cfg", "Mamba2", r"'ssm_cfg': expected an object"),
])
def test_config_field_types_are_checked(tmp_path, field, value, match):
    path = _ckpt(tmp_path)
    _edit_config(path, lambda c: c.__setitem__(field, value))
    with pytest.raises(ConfigError, match=match) as e:
        read_config(path)
    assert "config.json" in str(e.value)


@pytest.mark.parametrize("field,value,match", [
    ("hidden_size", 32.0, r"field 'hidden_size' \(m2export's 'd_model'\): expected a positive integer, got 32.0"),
    ("n_groups", True, r"field 'n_groups' \(m2export's 'ngroups'\): expected a positive integer, got True"),
    ("layer_norm_epsilon", 0, r"field 'layer_norm_epsilon' \(m2export's 'norm_epsilon'\): expected a number"),
    ("time_step_limit", [0.5, 0.1], r"field 'time_step_limit' \(m2export's 'dt_limit'\): expected 0 <= min <= max"),
    ("chunk_size", 0, r"config.json: field 'chunk_size': expected a positive integer, got 0"),
])
def test_hf_config_errors_name_the_files_own_key(tmp_path, field, value, match):
    """An HF Mamba2 config.json's bad value is named by the key the file has ('hidden_size'), not only by m2export's
    field name ('d_model', which the file does not contain)."""
    path = random_checkpoint(tmp_path / "ck", seed=2, format="hf", **TINY)
    _edit_config(path, lambda c: c.__setitem__(field, value))
    with pytest.raises(ConfigError, match=match):
        read_config(path)


@pytest.mark.parametrize("value", ["01", [0, 1, 2], {"a": 1}, [0, "x"]])
def test_malformed_dt_limit(tmp_path, value):
    path = _ckpt(tmp_path)
    _edit_config(path, lambda c: c["ssm_cfg"].__setitem__("dt_limit", value))
    with pytest.raises(ConfigError, match=r"config.json: ssm_cfg.dt_limit: expected \[min, max\]"):
        read_config(path)


def test_hf_defaults_follow_transformers(tmp_path):
    """HF Mamba2Config defaults tie_word_embeddings to False; layer_norm_epsilon also sets the gated norm's eps."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency")
    fields = dict(TINY, tie_embeddings=False)
    path = random_checkpoint(tmp_path / "hf", format="hf", seed=3, **fields)

    def edit(c):
        del c["tie_word_embeddings"]
        c["layer_norm_epsilon"] = 0.1
    _edit_config(path, edit)
    ours = load_checkpoint(path)
    assert ours.config.tie_embeddings is False and ours.config.gated_norm_epsilon == 0.1
    hf = transformers.Mamba2ForCausalLM.from_pretrained(str(path)).eval()
    ids = torch.randint(0, 100, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, out = hf(ids).logits, ours.model(ids).logits
    assert (ref - out).abs().max() < 1e-4 * ref.abs().max()


def _sharded(tmp_path):
    path = _ckpt(tmp_path)
    sd = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    keys = sorted(sd)
    half = len(keys) // 2
    save_file({k: sd[k] for k in keys[:half]}, str(path / "model-00001-of-00002.safetensors"))
    save_file({k: sd[k] for k in keys[half:]}, str(path / "model-00002-of-00002.safetensors"))
    wm = {k: ("model-00001-of-00002.safetensors" if i < half else "model-00002-of-00002.safetensors")
          for i, k in enumerate(keys)}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return path, sd, wm


def test_sharded_index_is_followed(tmp_path):
    path, sd, wm = _sharded(tmp_path)
    ck = load_checkpoint(path)
    assert torch.equal(ck.model.state_dict()["backbone.layers.1.mixer.A_log"], sd["backbone.layers.1.mixer.A_log"])
    # a stale copy of a tensor in the other shard must not win over the shard the index names
    k = "backbone.layers.0.mixer.A_log"
    other = next(f for f in set(wm.values()) if f != wm[k])
    part = load_file(str(path / other))
    part[k] = torch.full_like(sd[k], 5.0)
    save_file(part, str(path / other))
    assert torch.equal(load_checkpoint(path).model.state_dict()[k], sd[k])


@pytest.mark.parametrize("weight_map,match", [
    (["a", "b"], "'weight_map' must map tensor names"),
    ({"x": 3}, "'weight_map' must map tensor names"),
    ({"x": "../elsewhere/model.safetensors"}, "outside the checkpoint directory"),
])
def test_malformed_index(tmp_path, weight_map, match):
    path, _, _ = _sharded(tmp_path)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path)


# ------------------------------------------------------------------------------------------ writing (issue 13, item 9)
@pytest.mark.parametrize("how", ["random_checkpoint", "save_checkpoint"])
def test_writing_never_deletes_a_users_folder(tmp_path, how):
    from m2export.models.checkpoint import save_checkpoint

    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    model = load_checkpoint(_ckpt(tmp_path)).model

    def write(**kw):
        if how == "random_checkpoint":
            return random_checkpoint(out, seed=1, **TINY, **kw)
        return save_checkpoint(model, out, **kw)
    with pytest.raises(OutputFolderError, match="exists and is not empty"):
        write()
    with pytest.raises(OutputFolderError, match="did not write \\(thesis.tex\\)"):
        write(force=True)
    assert (out / "thesis.tex").read_text() == "years of work"
    write(force=True, force_foreign=True)  # explicit: replaced
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    write(force=True)  # now m2export's own: --force is enough
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "mine"]


@pytest.mark.parametrize("fmt,tie", [("mamba_ssm", True), ("hf", True), ("hf", False)])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_streamed_safetensors_match_the_state_dict(tmp_path, fmt, tie, dtype):
    """The tensor-by-tensor writer produces a file safetensors reads back bit-exactly (names, dtypes, shapes)."""
    from safetensors import safe_open

    path = random_checkpoint(tmp_path / "ck", format=fmt, seed=4, dtype=dtype, **{**TINY, "tie_embeddings": tie})
    sd = load_file(str(path / "model.safetensors"))
    ref = init_reference(fmt, tie, dtype)
    assert sorted(sd) == sorted(ref)
    for k, v in ref.items():
        assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt", "written_by": "m2export"}


def init_reference(fmt, tie, dtype):
    """The state dict random_checkpoint(seed=4) must have written, built the plain way."""
    from m2export.models.config import Mamba2Config
    from m2export.models.mamba2 import Mamba2LMHeadModel, init_weights_

    m = init_weights_(Mamba2LMHeadModel(Mamba2Config(**{**TINY, "tie_embeddings": tie})), seed=4)
    sd = {k: (v.to(dtype) if dtype else v).clone() for k, v in m.state_dict().items()}
    for k in ("backbone.embedding.weight", "lm_head.weight"):  # vocab 100 stored as 112 rows, the padding zeros
        assert sd[k].shape[0] == 100
        sd[k] = torch.cat([sd[k], sd[k].new_zeros(12, sd[k].shape[1])])
    if tie:
        sd.pop("lm_head.weight")
    if fmt == "hf":
        sd["backbone.embeddings.weight"] = sd.pop("backbone.embedding.weight")
        if tie:
            sd["lm_head.weight"] = sd["backbone.embeddings.weight"]
    return sd


# ------------------------------------------------------------------------------------------ issue 13: items 3, 4, 12
@pytest.mark.parametrize("value,dtype,match", [
    (float("nan"), None, r"'backbone.embedding.weight' has a non-finite value at index \[77, 3\]: nan"),
    (float("-inf"), None, r"non-finite value at index \[77, 3\]: -inf"),
    (1e5, torch.float16, r"outside the fp16 range \(\|x\| <= 65504\) at index \[77, 3\]: 100000.0"),
])
def test_non_finite_and_out_of_range_weights_are_refused(tmp_path, value, dtype, match):
    path = _tampered_ckpt(tmp_path, lambda sd: sd["backbone.embedding.weight"].__setitem__((77, 3), value))
    with pytest.raises(CheckpointError, match=match) as e:
        load_checkpoint(path, dtype=dtype)
    assert "allow_nonfinite=True" in e.value.hint
    ck = load_checkpoint(path, dtype=dtype, allow_nonfinite=True)  # explicitly allowed
    assert not torch.isfinite(ck.model.backbone.embedding.weight[77, 3])
    if dtype is not None:
        load_checkpoint(path) if value == 1e5 else None  # in range for fp32: accepted


@pytest.mark.parametrize("mapped", [False, True])
def test_an_a_log_whose_a_overflows_float32_is_refused(tmp_path, mapped):
    """A_log = 89 is finite, but A = -exp(A_log) is -inf in float32 (the export bakes A so): the ssmscan/std
    graphs gave all-NaN logits and the export exited 0. Refused like a NaN weight, naming the tensor, index and
    value; 88.7 (A finite) loads; allow_nonfinite lets it through and the reference then names the layer."""
    from m2export.errors import ContractError
    from m2export.models.checkpoint import A_LOG_MAX

    assert 88.72 < A_LOG_MAX < 88.73 and math.isfinite(-math.exp(A_LOG_MAX))
    name = "backbone.layers.1.mixer.A_log"

    def put(v):
        return lambda sd: sd[name].__setitem__(2, v)

    path = _tampered_ckpt(tmp_path / "a", put(89.0))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, mapped=mapped)
    assert str(e.value) == (f"{path / 'model.safetensors'}: tensor {name!r} has a value at index [2]: 89.0 whose "
                            "A = -exp(A_log) is -inf in float32; expected A_log <= 88.7228 (A finite)")
    assert "allow_nonfinite=True" in e.value.hint
    ck = load_checkpoint(path, allow_nonfinite=True)
    with pytest.raises(ContractError, match=r"^layer 1's mixer: A: expected A <= 0 and finite"):
        ck.model(torch.tensor([[1, 2, 3]]))
    ok = load_checkpoint(_tampered_ckpt(tmp_path / "b", put(88.7)), mapped=mapped)
    assert torch.isfinite(-torch.exp(ok.model.backbone.layers[1].mixer.A_log.float())).all()
    if ok.pages is not None:  # give the read leases up now, not when the garbage collector finds the model
        ok.pages.close()


def test_large_finite_weights_whose_sum_overflows_are_accepted(tmp_path):
    """The load's finiteness check proves most tensors finite by one float32 sum; a tensor of large finite
    values whose sum overflows to inf must still be accepted (exact check), and a NaN next to them refused."""
    big = torch.finfo(torch.float32).max / 2

    def fill(sd):
        sd["backbone.embedding.weight"][:4] = big

    path = _tampered_ckpt(tmp_path / "a", fill)
    ck = load_checkpoint(path)
    assert torch.isinf(ck.model.backbone.embedding.weight.sum())  # the premise: the sum overflows
    assert float(ck.model.backbone.embedding.weight[0, 0]) == big

    def fill_nan(sd):
        fill(sd)
        sd["backbone.embedding.weight"][9, 2] = float("nan")

    with pytest.raises(CheckpointError, match=r"non-finite value at index \[9, 2\]: nan"):
        load_checkpoint(_tampered_ckpt(tmp_path / "b", fill_nan))
    with pytest.raises(CheckpointError, match=r"outside the fp16 range .* at index \[0, 0\]"):
        load_checkpoint(path, dtype=torch.float16)


@pytest.mark.parametrize("field,value,match", [
    ("n_layer", 10**6, r"n_layer=1000000 but the weight files hold layers 0..1 \(2 of them\)"),
    ("d_model", 10**9, r"config.json declares sizes no model can have"),
])
def test_huge_declared_sizes_fail_before_building(tmp_path, field, value, match):
    import resource
    import time

    path = _ckpt(tmp_path)
    _edit_config(path, lambda c: c.__setitem__(field, value))
    if field == "d_model":  # keep d_inner divisible by headdim and nheads by ngroups
        _edit_config(path, lambda c: c["ssm_cfg"].update(headdim=16))
    rss0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path)
    assert time.perf_counter() - t0 < 30
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 200 * 1024  # KiB: nothing of that size built


def test_distinct_lm_head_under_tied_embeddings_is_refused(tmp_path):
    path = _tampered_ckpt(tmp_path, lambda sd: sd.update({"lm_head.weight": sd["backbone.embedding.weight"] + 1}))
    with pytest.raises(CheckpointError, match=r"'lm_head.weight' differs from the embedding, but config.json ties"):
        load_checkpoint(path)


@pytest.mark.parametrize("kind", ["sparse", "meta"])
def test_sparse_or_meta_tensors_in_a_bin_are_refused(tmp_path, kind):
    path = _ckpt(tmp_path)
    sd = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    k = "backbone.layers.0.mixer.D"
    sd[k] = sd[k].to_sparse() if kind == "sparse" else torch.empty(sd[k].shape, device="meta")
    torch.save(sd, path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=rf"'{k}' is a .*{'sparse' if kind == 'sparse' else 'meta'}"):
        load_checkpoint(path)


# ------------------------------------------------------------------------------------------ issue 13: items 4, 13
@pytest.mark.parametrize("where", ["top", "ssm_cfg"])
def test_duplicate_json_keys_are_refused(tmp_path, where):
    """json keeps the last of two equal keys without a word: a config.json with "d_state" twice means two things."""
    path = _ckpt(tmp_path)
    text = (path / "config.json").read_text()
    if where == "top":
        text = text.replace('"n_layer": 2', '"n_layer": 2, "n_layer": 3', 1)
        key = "n_layer"
    else:
        text = text.replace('"d_state": 16', '"d_state": 16, "d_state": 999', 1)
        key = "d_state"
    assert text.count(f'"{key}"') == 2
    (path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=rf"ck/config.json: duplicate key '{key}'"):
        read_config(path)


def test_duplicate_keys_in_a_shard_index_are_refused(tmp_path):
    path, _, wm = _sharded(tmp_path)
    k = sorted(wm)[0]
    other = next(f for f in set(wm.values()) if f != wm[k])
    text = json.dumps({"weight_map": wm})
    text = text.replace(f'"{k}": "{wm[k]}"', f'"{k}": "{wm[k]}", "{k}": "{other}"', 1)
    (path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError, match=rf"index.json: malformed safetensors index \(DuplicateKeyError: "
                                              rf"duplicate key '{k}'"):
        load_checkpoint(path)


def _hf_ckpt(tmp_path, **fields):
    return random_checkpoint(tmp_path / "hf", format="hf", seed=2, **{**TINY, **fields})


@pytest.mark.parametrize("extra,match", [
    ({"d_state": 999}, r"conflicting 'd_state'=999 and 'state_size'=16; transformers reads only 'state_size'"),
    ({"ngroups": 1}, r"conflicting 'ngroups'=1 and 'n_groups'=2"),
    ({"tie_embeddings": False}, r"conflicting 'tie_embeddings'=False and 'tie_word_embeddings'=True"),
    ({"dt_limit": [0, 1]}, r"conflicting 'dt_limit'=\[0, 1\] and 'time_step_limit'=\[0.001, 0.5\]"),
    ({"intermediate_size": 256}, r"unsupported field\(s\) \['intermediate_size'\] for an HF Mamba2 config"),
])
def test_hf_config_keys_that_transformers_ignores_or_m2export_does_not_know(tmp_path, extra, match):
    """The HF reader read its keys and ignored the rest: d_state 999 next to state_size 16 exported a d_state-16
    model without a word (issue 13, item 4)."""
    path = _hf_ckpt(tmp_path)
    _edit_config(path, lambda c: c.update(extra))
    with pytest.raises(ConfigError, match=match) as e:
        read_config(path)
    assert "hf/config.json" in str(e.value)


def test_hf_mamba_ssm_name_absent_hf_key_compares_with_the_default(tmp_path):
    path = _hf_ckpt(tmp_path)

    def edit(c):
        del c["conv_kernel"]  # transformers' default: 4
        c["d_conv"] = 3
    _edit_config(path, edit)
    with pytest.raises(ConfigError, match=r"conflicting 'd_conv'=3 and 'conv_kernel' \(absent: its default 4\)"):
        read_config(path)
    _edit_config(path, lambda c: c.update(d_conv=4, d_state=16, headdim=16))  # agreeing twins are harmless
    assert read_config(path)[0].d_conv == 4


def test_hf_config_of_transformers_itself_is_read():
    """Every key transformers 5.24 writes for a Mamba2ForCausalLM is known (the strict reader refuses none)."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency")
    from m2export.models.config import Mamba2Config

    c = transformers.Mamba2Config(hidden_size=64, num_hidden_layers=2, vocab_size=112, state_size=16, head_dim=16,
                                  n_groups=2, num_heads=8, chunk_size=8)
    ours = Mamba2Config.from_hf_json(c.to_dict(), "transformers")  # every attribute, not only the non-defaults
    assert (ours.d_model, ours.d_state, ours.ngroups, ours.nheads) == (64, 16, 2, 8)


def test_hf_mamba1_config_without_model_type_is_not_read_as_mamba2(tmp_path):
    """A transformers MambaConfig (Mamba-1) with model_type removed reached the Mamba-2 reader, which
    ignored its Mamba-1 keys (issue 13, item 13)."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency")
    raw = transformers.MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=100).to_dict()
    raw.pop("model_type")
    raw.pop("architectures", None)
    path = _hf_ckpt(tmp_path)
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"unsupported field\(s\) \[.*'intermediate_size'.*\] for an HF Mamba2"):
        load_checkpoint(path)


def test_distinct_lm_head_under_tied_hf_embeddings_is_refused(tmp_path):
    path = _hf_ckpt(tmp_path)  # tie_embeddings=True: lm_head.weight is stored, equal to the embedding
    sd = load_file(str(path / "model.safetensors"))
    sd["lm_head.weight"] = sd["backbone.embeddings.weight"].clone()
    sd["lm_head.weight"][5, 1] += 1
    save_file(sd, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'lm_head.weight' differs from the embedding, but config.json ties"):
        load_checkpoint(path)


class _NotATensor:
    pass


def test_bin_with_code_never_advises_weights_only_false(tmp_path):
    """torch's error says to re-run with weights_only=False (runs the file's code): never shown (issue 13, item 13)."""
    path = _ckpt(tmp_path)
    sd = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    torch.save({**sd, "extra": _NotATensor()}, path / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    msg = str(e.value) + (e.value.hint or "")
    assert re.search(r"pytorch_model.bin: cannot read tensors: not a plain state dict \(Unsupported global: GLOBAL "
                     r"\S*test_checkpoint._NotATensor was not an allowed global by default\); m2export reads", msg)
    assert "weights_only=False" not in msg and "weights_only` set to `False" not in msg and "\x1b[" not in msg
    assert "\n" not in str(e.value)


def test_empty_weight_map_is_named(tmp_path):
    """An empty index printed 'error: : missing tensor(s) ...' (no file named; issue 13, item 13)."""
    path, _, _ = _sharded(tmp_path)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(CheckpointError, match=r"ck/model.safetensors.index.json: 'weight_map' is empty"):
        load_checkpoint(path)


def test_an_a_log_that_overflows_once_rounded_to_fp16_is_refused(tmp_path):
    """A_log 88.72 is under A_LOG_MAX, but an fp16 export rounds it to 88.75, whose A is -inf in float32 (the
    breaker's repro: NaN logits in the ssmscan/std fp16 graphs at L not a multiple of the chunk, exit 0): refused
    for fp16 naming the rounded value; fp32 and bf16 (88.72 -> 88.5) load it."""
    name = "backbone.layers.1.mixer.A_log"
    path = _tampered_ckpt(tmp_path, lambda sd: sd[name].__setitem__(2, 88.72))
    assert torch.tensor(88.72).half().item() == 88.75 and torch.tensor(88.72).bfloat16().item() == 88.5
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, dtype=torch.float16)
    assert str(e.value).endswith(f"tensor {name!r} has a value at index [2]: 88.72000122070312 (as fp16: 88.75) "
                                 "whose A = -exp(A_log) is -inf in float32; expected A_log <= 88.7228 (A finite) "
                                 "once rounded to the export dtype")
    for dtype in (None, torch.bfloat16):
        load_checkpoint(path, dtype=dtype)


@pytest.mark.parametrize("tie,stored", [(False, torch.float32), (True, torch.float32), (False, torch.bfloat16)])
def test_saving_a_loaded_padded_vocabulary_keeps_its_padding_rows(tmp_path, tie, stored):
    """vocab_size 100 stored as 112 rows whose last 12 are the user's (not zeros): load + save_checkpoint gives every
    tensor back bit for bit (bf16: loaded as float32, saved as bf16), and format='hf', where those rows are tokens
    (its vocab_size is 112), gets them too. save_checkpoint wrote zero rows there, the user's rows lost."""
    from safetensors import safe_open

    from m2export.models.checkpoint import bit_equal, save_checkpoint

    ck = random_checkpoint(tmp_path / "ck", format="mamba_ssm", seed=2, dtype=stored,
                           **{**TINY, "tie_embeddings": tie})
    f = ck / "model.safetensors"
    with safe_open(str(f), "pt") as fh:
        meta = fh.metadata()
    sd = load_file(f)
    g = torch.Generator().manual_seed(7)
    for k in ("backbone.embedding.weight", "lm_head.weight"):
        if k in sd:
            assert sd[k].shape[0] == 112 and not sd[k][100:].any()
            sd[k][100:] = torch.randn(12, sd[k].shape[1], generator=g).to(stored)
    save_file(sd, f, metadata=meta)
    for mapped in (False, True):  # read, or views of the file's mapping (the export's load)
        model = load_checkpoint(ck, mapped=mapped).model
        assert model.backbone.embedding.weight.shape[0] == 100  # the model still holds only the real rows
        again = load_file(save_checkpoint(model, tmp_path / f"again{mapped}", dtype=stored) / "model.safetensors")
        assert sorted(again) == sorted(sd)
        for k in sd:
            assert bit_equal(again[k], sd[k]), (k, mapped)
    hf = load_file(save_checkpoint(model, tmp_path / "hf", format="hf", dtype=stored) / "model.safetensors")
    assert bit_equal(hf["backbone.embeddings.weight"], sd["backbone.embedding.weight"])
    assert bit_equal(hf["lm_head.weight"], sd["backbone.embedding.weight" if tie else "lm_head.weight"])
