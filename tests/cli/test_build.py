"""``m2export build`` (m2export/cli/build.py, m2export/trt/).

CPU: argument handling, optimization profiles, precision from ONNX dtypes, network flags for TensorRT 10
and 11, parser-error messages, and -- where TensorRT is not installed -- exit code 4 with the install
hint and nothing written.
TensorRT (marked ``trt``; skipped with "TensorRT not installed"): build a tiny random model's engines
in both plugin modes, run them, compare with PyTorch; an AOT engine runs in a process that never
imports m2export.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from m2export.cli.main import main
from m2export.errors import BackendUnavailable, BuildError, ExportFolderError, ParameterError
from m2export.exporter.manifest import EngineEntry, GraphEntry, Manifest, read_manifest, write_manifest
from m2export.trt import build as B
from m2export.trt.loader import count_ssm_scan_nodes, format_parser_errors, network_flags

try:
    import tensorrt  # noqa: F401

    HAVE_TRT = True
except ImportError:
    HAVE_TRT = False


def _graph(path: Path, *, dtype=TensorProto.FLOAT, nodes: int = 1) -> None:
    """A small ONNX graph with the exporter's input names (a Mamba layer's states and an attention layer's KV
    cache) and ``nodes`` SSMScan nodes (not runnable)."""
    seq = "sequence_length"
    kv = ["batch_size", 2, "past_sequence_length", 16]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", seq]),
              helper.make_tensor_value_info("past_conv_state.0", dtype, ["batch_size", 192, 3]),
              helper.make_tensor_value_info("past_ssm_state.0", TensorProto.FLOAT, ["batch_size", 4, 32, 32]),
              helper.make_tensor_value_info("past_key_values.1.key", dtype, kv),
              helper.make_tensor_value_info("past_key_values.1.value", dtype, kv)]
    outputs = [helper.make_tensor_value_info("logits", dtype, ["batch_size", seq, 256])]
    body = [helper.make_node("SSMScan", [f"i{k}" for k in range(8)], [f"y{j}", f"s{j}"], domain="m2export",
                             plugin_namespace="m2export", plugin_version="1", chunk_size=256, dt_softplus=1,
                             dt_min=0.0, dt_max=float("inf")) for j in range(nodes)]
    weights = [helper.make_tensor("w", dtype, [2, 2], [0.0] * 4), helper.make_tensor("A_log", TensorProto.FLOAT,
                                                                                     [4], [0.0] * 4)]
    g = helper.make_graph(body, "g", inputs, outputs, initializer=weights)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("m2export", 1)]),
              str(path))


def make_outdir(tmp: Path, dtype: str = "fp32") -> Path:
    out = tmp / "out"
    out.mkdir()
    tp = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}[dtype]
    _graph(out / "model.onnx", dtype=tp, nodes=2)
    _graph(out / "model.std.onnx", dtype=tp, nodes=0)
    graphs = [GraphEntry(role="prefill+decode", ssm_impl=i, file=f, inputs={}, outputs={})
              for i, f in (("ssmscan", "model.onnx"), ("std", "model.std.onnx"))]
    write_manifest(out, Manifest(source_checkpoint="ck", checkpoint_format="mamba_ssm", checkpoint_sha256="0",
                                 config={}, dtype=dtype, opset=18, graphs=graphs, tool_versions={}))
    return out


def _listing(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------- without TensorRT
@pytest.mark.skipif(HAVE_TRT, reason="TensorRT is installed here")
@pytest.mark.parametrize("plugin", ["jit", "aot"])
def test_build_without_tensorrt_exits_4_with_hint_and_writes_nothing(tmp_path, capsys, plugin):
    out = make_outdir(tmp_path)
    before = _listing(tmp_path)
    rc = main(["build", str(out), "--plugin", plugin])
    err = capsys.readouterr().err
    assert rc == 4, err
    assert "error: TensorRT is not installed" in err
    assert "hint: pip install --extra-index-url https://pypi.nvidia.com tensorrt-cu12" in err
    assert "tensorrt-cu13" in err
    assert _listing(tmp_path) == before  # no plan, no timing cache, manifest untouched
    rc = main(["build", str(out / "model.std.onnx")])
    assert rc == 4 and _listing(tmp_path) == before


@pytest.mark.skipif(HAVE_TRT, reason="TensorRT is installed here")
def test_build_corrupt_onnx_without_tensorrt_exits_4(tmp_path, capsys):
    """Without TensorRT nothing is parsed: a corrupt model.onnx still gives exit 4 'TensorRT is not installed'
    (was: protobuf DecodeError, exit 70)."""
    out = make_outdir(tmp_path)
    (out / "model.onnx").write_bytes(b"garbage")
    rc = main(["build", str(out)])
    err = capsys.readouterr().err
    assert rc == 4, err
    assert err.startswith("error: TensorRT is not installed") and "Traceback" not in err


def test_build_corrupt_onnx_with_tensorrt_is_a_clean_error(tmp_path, capsys, monkeypatch):
    """With TensorRT (stood in for here: the graphs are read before it is used), a corrupt model.onnx is one
    error line naming the file (exit 1), as in 'm2export inspect'; nothing is written."""
    out = make_outdir(tmp_path)
    (out / "model.onnx").write_bytes(b"garbage")
    before = _listing(tmp_path)
    monkeypatch.setattr(B, "require_tensorrt", lambda: None)
    monkeypatch.setattr(B, "build_engines", lambda *a, **k: pytest.fail("build_engines reached"))
    rc = main(["build", str(out)])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert err.startswith(f"error: {out / 'model.onnx'}: not a readable ONNX model (DecodeError")
    assert "hint: " in err and "Traceback" not in err and _listing(tmp_path) == before

def test_build_bad_paths(tmp_path, capsys):
    assert main(["build", str(tmp_path / "missing")]) == 1
    assert "no such file or directory" in capsys.readouterr().err
    (tmp_path / "x.txt").write_text("")
    assert main(["build", str(tmp_path / "x.txt")]) == 1
    assert "expected an m2export output folder or an .onnx file" in capsys.readouterr().err
    assert main(["build", str(tmp_path)]) == 1  # a folder without m2export.json
    assert "m2export.json: missing" in capsys.readouterr().err


# ----------------------------------------------------------------------------- plain functions
def test_resolve_targets(tmp_path):
    out = make_outdir(tmp_path)
    outdir, manifest, targets = B.resolve_targets(out)
    assert outdir == out and manifest is not None
    # one graph -> one engine with a prefill and a decode profile
    assert [(t.roles, t.onnx.name, t.plan.name) for t in targets] == [(("prefill", "decode"), "model.onnx",
                                                                       "model.plan")]
    _, _, (t,) = B.resolve_targets(out / "model.std.onnx")
    assert (t.role, t.plan) == ("prefill+decode", out / "model.std.plan")
    _, _, (t,) = B.resolve_targets(out, roles=("decode",))
    assert t.roles == ("decode",) and t.plan.name == "model.decode.plan"  # beside model.plan, not over it
    _, _, (t,) = B.resolve_targets(out, roles=("prefill",))
    assert t.plan.name == "model.plan"
    (out / "model.onnx").unlink()
    with pytest.raises(ExportFolderError, match="listed in m2export.json but missing"):
        B.resolve_targets(out)
    assert B.plan_name("model.std.onnx") == "model.std.plan"


def test_decode_only_engine_pins_sequence_length():
    """A decode-only engine fixes sequence_length to 1 in the network (so the AOT plugin sees a constant seqlen
    and embeds the decode-step kernel); batch and past_sequence_length stay dynamic; other engines pin nothing."""
    from m2export.trt.loader import pin_input_shapes

    inputs = {"input_ids": ["batch_size", "sequence_length"], "past_ssm_state.0": ["batch_size", 4, 8, 16],
              "past_key_values.1.key": ["batch_size", 2, "past_sequence_length", 8]}
    assert B.pinned_input_shapes(inputs, ("decode",)) == {"input_ids": (-1, 1)}
    assert B.pinned_input_shapes(inputs, ("prefill", "decode")) == {} == B.pinned_input_shapes(inputs, ("prefill",))

    class Tensor:
        def __init__(self, name):
            self.name, self.shape = name, (-1, -1)

    class Network:  # the two members of tensorrt.INetworkDefinition that pin_input_shapes uses
        def __init__(self, names):
            self._t = [Tensor(n) for n in names]
            self.num_inputs = len(self._t)

        def get_input(self, i):
            return self._t[i]

    net = Network(list(inputs))
    pin_input_shapes(net, {"input_ids": (-1, 1)})
    assert [t.shape for t in net._t] == [(-1, 1), (-1, -1), (-1, -1)]
    with pytest.raises(BuildError, match="cannot fix the shape of input 'ids'"):
        pin_input_shapes(net, {"ids": (-1, 1)})


def test_manifest_prefers_the_decode_only_engine(tmp_path):
    """With model.plan (prefill + decode profiles) and model.decode.plan, decode steps use the latter."""
    out = make_outdir(tmp_path)
    m = read_manifest(out, consistent=False)  # a stand-in manifest: no model config
    both = EngineEntry(role="prefill+decode", file="model.plan", onnx_file="model.onnx", tensorrt_version="10.9",
                       gpu="H200", compute_capability="9.0", plugin_mode="aot", profiles=[{}, {}], precision="fp32",
                       profile_roles=["prefill", "decode"])
    dec = EngineEntry(role="decode", file="model.decode.plan", onnx_file="model.onnx", tensorrt_version="10.9",
                      gpu="H200", compute_capability="9.0", plugin_mode="aot", profiles=[{}], precision="fp32",
                      profile_roles=["decode"])
    m.engines = [both, dec]
    assert m.engine("prefill") is both and m.engine("decode") is dec
    m.engines = [both]
    assert m.engine("decode") is both


def test_graph_profiles(tmp_path):
    out = make_outdir(tmp_path)
    batch, seq = B.ShapeRange(1, 2, 8), B.ShapeRange(1, 64, 512)
    pre = B.graph_profile(B.onnx_inputs(out / "model.onnx"), "prefill", batch, seq)
    assert pre["input_ids"] == {"min": [1, 1], "opt": [2, 64], "max": [8, 512]}
    assert pre["past_ssm_state.0"] == {"min": [1, 4, 32, 32], "opt": [2, 4, 32, 32], "max": [8, 4, 32, 32]}
    # KV caches: past_sequence_length 0 (a fresh sequence) .. seq.max in both profiles
    assert pre["past_key_values.1.key"] == {"min": [1, 2, 0, 16], "opt": [2, 2, 64, 16], "max": [8, 2, 512, 16]}
    dec = B.graph_profile(B.onnx_inputs(out / "model.onnx"), "decode", batch, seq)
    assert dec["input_ids"] == {"min": [1, 1], "opt": [2, 1], "max": [8, 1]}
    assert dec["past_key_values.1.value"]["max"] == [8, 2, 512, 16]
    past = B.ShapeRange(0, 100, 300, allow_zero=True)
    assert B.graph_profile(B.onnx_inputs(out / "model.onnx"), "decode", batch, seq, past)[
        "past_key_values.1.key"]["opt"] == [2, 2, 100, 16]
    with pytest.raises(BuildError, match="dynamic dimension 'n'"):
        B.graph_profile({"x": ["batch_size", "n"]}, "prefill", batch, seq)
    # a fixed 0 (the conv state of a d_conv 1 mixer, no columns) is a fixed size, not a dynamic one
    assert B.graph_profile({"past_conv_state.0": ["batch_size", 96, 0]}, "prefill", batch, seq)[
        "past_conv_state.0"] == {"min": [1, 96, 0], "opt": [2, 96, 0], "max": [8, 96, 0]}
    with pytest.raises(ParameterError, match="min <= opt <= max"):
        B.ShapeRange(4, 2, 8)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_precision_from_onnx_dtypes(tmp_path, dtype):
    out = make_outdir(tmp_path, dtype)
    assert B.onnx_precision(out / "model.onnx") == dtype
    assert count_ssm_scan_nodes(out / "model.onnx") == 2


def test_kernel_support_checked_before_building(tmp_path):
    """Before any TensorRT call: every Mamba layer's headdim/d_state must be served by the cuTile kernel
    (m2export.kernels._host.check_supported decides), for Mamba-2 configs and hybrid specs alike."""
    from m2export.kernels._host import check_supported
    from m2export.models.config import Mamba2Config
    from m2export.models.presets import preset_config

    out = make_outdir(tmp_path)
    m = read_manifest(out, consistent=False)  # a stand-in manifest: no model config
    B.check_kernel_support(m)  # no config recorded: nothing to check
    m.config = Mamba2Config(d_model=128, n_layer=2, vocab_size=256, headdim=64, d_state=128).to_dict()
    B.check_kernel_support(m)
    m.config = Mamba2Config(d_model=160, n_layer=2, vocab_size=256, headdim=80, d_state=128).to_dict()
    B.check_kernel_support(m)  # Nemotron-Nano's head dim: served (masked/split tiles)
    m.config = Mamba2Config(d_model=144, n_layer=2, vocab_size=256, headdim=72, d_state=128).to_dict()
    with pytest.raises(BackendUnavailable, match=r"cannot run Mamba layer 0: headdim: .*got 72") as e:
        B.check_kernel_support(m)
    assert "model.std.onnx" in e.value.hint
    # a hybrid: the sizes come from its Mamba layers (Nemotron-H: mamba_head_dim), not from config keys
    family, cfg = preset_config("tiny-nemotron-h")
    m.checkpoint_format, m.config = family, dict(cfg, mamba_head_dim=72, mamba_num_heads=2)
    with pytest.raises(BackendUnavailable, match=r"cannot run Mamba layer 2: headdim: .*got 72"):
        B.check_kernel_support(m)
    m.config = dict(cfg, mamba_head_dim=64, ssm_state_size=128, mamba_num_heads=2, n_groups=1)
    check_supported(m.model_config().layers[2].mamba)  # the kernels' own check agrees
    B.check_kernel_support(m)


def test_parse_size():
    assert B.parse_size("4G") == 4 << 30 and B.parse_size("512M") == 512 << 20 and B.parse_size("2GiB") == 2 << 30
    assert B.parse_size("1000") == 1000 and B.parse_size("1.5K") == 1536
    with pytest.raises(ParameterError, match="expected e.g. 4G"):
        B.parse_size("lots")


def test_trtexec_command_for_aot_engines_only(tmp_path):
    from m2export.exporter.manifest import EngineEntry

    out = make_outdir(tmp_path)
    m = read_manifest(out, consistent=False)  # a stand-in manifest: no model config
    entry = dict(tensorrt_version="10.13.0", gpu="H200", compute_capability="9.0", profiles=[{}, {}],
                 precision="fp32", profile_roles=["prefill", "decode"])
    m.engines = [EngineEntry(role="prefill+decode", file="model.plan", onnx_file="model.onnx", plugin_mode="aot",
                             **entry)]
    write_manifest(out, m)
    cmd = B.trtexec_command(out, "prefill", batch=2, seq=64)
    assert cmd == (f"trtexec --loadEngine={out / 'model.plan'} --profile=0 --shapes=input_ids:2x64,"
                   "past_conv_state.0:2x192x3,past_ssm_state.0:2x4x32x32,past_key_values.1.key:2x2x0x16,"
                   "past_key_values.1.value:2x2x0x16")
    cmd = B.trtexec_command(out, "decode", batch=2, seq=64)
    assert cmd == (f"trtexec --loadEngine={out / 'model.plan'} --profile=1 --shapes=input_ids:2x1,"
                   "past_conv_state.0:2x192x3,past_ssm_state.0:2x4x32x32,past_key_values.1.key:2x2x64x16,"
                   "past_key_values.1.value:2x2x64x16")
    m.engines[0].plugin_mode = "jit"
    write_manifest(out, m)
    with pytest.raises(BuildError, match="trtexec cannot run it"):
        B.trtexec_command(out, "decode")


def _fake_trt(version: str, *, aot: bool = True):
    names = dict(STRONGLY_TYPED=0, PREFER_JIT_PYTHON_PLUGINS=1, PREFER_AOT_PYTHON_PLUGINS=2)
    if not aot:
        names = dict(STRONGLY_TYPED=0)
    return SimpleNamespace(__version__=version, NetworkDefinitionCreationFlag=SimpleNamespace(**names))


def test_network_flags_tensorrt_10_and_11():
    # TensorRT 10: strongly typed must be asked for (precision = ONNX dtypes, no FP16/BF16 builder flags)
    assert network_flags(_fake_trt("10.13.0"), "jit") == (1 << 0) | (1 << 1)
    assert network_flags(_fake_trt("10.13.0"), "aot") == (1 << 0) | (1 << 2)
    assert network_flags(_fake_trt("10.13.0"), None) == 1 << 0
    # TensorRT 11: always strongly typed, the deprecated flag is not passed
    assert network_flags(_fake_trt("11.1.0"), "aot") == 1 << 2
    # a TensorRT without AOT Python plugins
    assert network_flags(_fake_trt("10.8.0", aot=False), "jit") == 1 << 0
    with pytest.raises(BackendUnavailable, match="no AOT Python plugins"):
        network_flags(_fake_trt("10.8.0", aot=False), "aot")


def test_parser_errors_name_the_node():
    class Err:
        def __init__(self, node, name, op, desc):
            self._n, self._name, self._op, self._d = node, name, op, desc

        def node(self):
            return self._n

        def node_name(self):
            return self._name

        def node_operator(self):
            return self._op

        def desc(self):
            return self._d

    errs = [Err(17, "/layers.0/mixer/SSMScan", "SSMScan", "Plugin not found")]
    parser = SimpleNamespace(num_errors=1, get_error=lambda i: errs[i])
    msg = format_parser_errors(parser, "out/model.onnx")
    assert msg == ("TensorRT cannot parse out/model.onnx: node '/layers.0/mixer/SSMScan' (op SSMScan): "
                   "Plugin not found")


# ----------------------------------------------------------------------------- with TensorRT
trt_only = pytest.mark.skipif(not HAVE_TRT, reason="TensorRT not installed")
TOL = {"fp32": 2e-3, "bf16": 6e-2}


BUNDLED = Path(__file__).resolve().parents[2] / "samples" / "checkpoints" / "stdlib-byte-mamba2"


@pytest.fixture(scope="module")
def tiny_exports(tmp_path_factory):
    """The bundled sample checkpoint (else a random 2-layer Mamba-2, headdim 32, d_state 32, 2 groups),
    exported in fp32 and bf16."""
    from m2export.exporter.export import export_model
    from m2export.models.checkpoint import random_checkpoint

    root = tmp_path_factory.mktemp("build")
    ck = BUNDLED if BUNDLED.is_dir() else random_checkpoint(
        root / "ck", d_model=64, n_layer=2, vocab_size=256, d_state=32, headdim=32, ngroups=2, seed=1)
    outs = {}
    for dt in TOL:
        export_model(ck, root / f"out-{dt}", dtype=dt, check=False)
        outs[dt] = root / f"out-{dt}"
    return ck, outs


@pytest.mark.trt
@trt_only
@pytest.mark.parametrize("dtype", sorted(TOL))
@pytest.mark.parametrize("plugin", ["jit", "aot"])
def test_build_run_and_compare_with_pytorch(tiny_exports, plugin, dtype):
    from polygraphy.comparator import Comparator

    from m2export.check.runners import ModelFromCheckpoint, TorchRunner, trt_runners
    from m2export.exporter.runtime import feed_dtype_of

    ck, outs = tiny_exports
    out = outs[dtype]
    res = B.build_engines(out, plugin=plugin, batch=B.ShapeRange(1, 2, 4), seq=B.ShapeRange(1, 64, 256))
    m = read_manifest(out, consistent=False)  # a stand-in manifest: no model config
    assert [(e.role, e.file, e.profile_roles, e.plugin_mode) for e in m.engines] == [
        ("prefill+decode", "model.plan", ["prefill", "decode"], plugin)]
    pre_runner, dec_runner = trt_runners(out, m.engines[0])
    assert all((out / e.file).is_file() for e in res.engines) and (out / B.TIMING_CACHE_FILE).is_file()
    assert {e.precision for e in m.engines} == {dtype}
    cfg = m.model_config()
    rng = np.random.default_rng(0)
    feed = {"input_ids": rng.integers(0, cfg.vocab_size, (2, 37)).astype(np.int64), **m.graph("prefill").io().zero_feeds(2, feed_dtype_of)}
    model = ModelFromCheckpoint(ck)
    results = Comparator.run([TorchRunner(model, role="prefill", dtype=dtype), pre_runner],
                             data_loader=[feed])
    (_, (ref,)), (_, (got,)) = results.items()
    for name in ref:
        err = np.abs(ref[name].astype(np.float64) - got[name].astype(np.float64)).max()
        scale = max(1.0, np.abs(ref[name].astype(np.float64)).max())
        assert err <= TOL[dtype] * scale, f"prefill {name}: max-abs {err:.3e}"
    step = {"input_ids": rng.integers(0, cfg.vocab_size, (2, 1)).astype(np.int64),
            **m.graph("prefill").io().next_past(ref)}
    results = Comparator.run([TorchRunner(model, role="decode", dtype=dtype), dec_runner],
                             data_loader=[step])
    (_, (ref,)), (_, (got,)) = results.items()
    for name in ref:
        err = np.abs(ref[name].astype(np.float64) - got[name].astype(np.float64)).max()
        assert err <= TOL[dtype] * max(1.0, np.abs(ref[name]).max()), f"decode {name}: max-abs {err:.3e}"


@pytest.mark.trt
@trt_only
def test_aot_engine_runs_without_python_plugin(tiny_exports, tmp_path):
    """An AOT engine deserializes and runs in a process that never imports m2export (trtexec's situation)."""
    _, outs = tiny_exports
    out = outs["fp32"]
    B.build_engines(out, plugin="aot", roles=("prefill",), batch=B.ShapeRange(1, 1, 2), seq=B.ShapeRange(1, 8, 32))
    script = textwrap.dedent(f"""
        import sys, numpy as np, tensorrt as trt
        from polygraphy.backend.common import BytesFromPath
        from polygraphy.backend.trt import EngineFromBytes, TrtRunner
        assert "m2export" not in sys.modules
        with TrtRunner(EngineFromBytes(BytesFromPath({str(out / 'model.plan')!r}))) as r:
            feed = {{n: np.zeros([1 if d < 0 else d for d in m.shape], dtype=m.dtype)
                    for n, m in r.get_input_metadata().items()}}
            feed["input_ids"] = np.ones((1, 8), dtype=np.int64)
            out = r.infer(feed)
        assert "m2export" not in sys.modules and np.isfinite(out["logits"]).all()
        print("ok", out["logits"].shape)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


@pytest.mark.trt
@trt_only
def test_build_json_records_engines(tiny_exports):
    _, outs = tiny_exports
    out = outs["fp32"]
    B.build_engines(out, plugin="jit", batch=B.ShapeRange(1, 1, 2), seq=B.ShapeRange(1, 16, 64))
    data = json.loads((out / "m2export.json").read_text())
    (e,) = data["engines"]
    assert e["profile_roles"] == ["prefill", "decode"] and e["file"] == "model.plan"
    assert e["profiles"][1]["input_ids"]["max"] == [2, 1]
    assert e["profiles"][0]["input_ids"]["max"] == [2, 64]
    assert e["tensorrt_version"] and e["gpu"] and e["compute_capability"]


def test_packed_prefill_graph_gets_its_own_engine(tmp_path, caplog):
    """export --packed-prefill: build makes model.packed.plan (one profile: num_sequences from the batch range,
    cu_seqlens one longer, total_tokens from the sequence range) beside model.plan; the SSMScanPacked plugin is
    JIT-only, so --plugin aot leaves it out with a warning naming the flag instead of building it otherwise."""
    import logging

    from m2export.exporter import export_model
    from m2export.exporter.packed import PACKED_ROLE

    out = tmp_path / "out"
    export_model(Path(__file__).resolve().parents[2] / "samples" / "checkpoints" / "stdlib-byte-mamba2", out,
                 packed_prefill=True)
    _, _, targets = B.resolve_targets(out)
    assert [(t.roles, t.onnx.name, t.plan.name) for t in targets] == [
        (("prefill", "decode"), "model.onnx", "model.plan"), ((PACKED_ROLE,), "model.packed.onnx", "model.packed.plan")]
    assert [t.onnx.name for t in B.resolve_targets(out, roles=("decode",))[2]] == ["model.onnx"]
    batch, seq = B.ShapeRange(1, 4, 16), B.ShapeRange(1, 256, 4096)
    prof = B.graph_profile(B.onnx_inputs(out / "model.packed.onnx"), PACKED_ROLE, batch, seq)
    assert prof["input_ids"] == {"min": [1, 1], "opt": [1, 256], "max": [1, 4096]}
    assert prof["cu_seqlens"] == {"min": [2], "opt": [5], "max": [17]}
    assert prof["past_ssm_state.0"]["max"][0] == 16 and prof["past_conv_state.0"]["opt"][0] == 4
    with caplog.at_level(logging.WARNING), pytest.raises(BackendUnavailable):
        B.build_engines(out, plugin="aot")  # no TensorRT here: the target list is decided before that
    assert "model.packed.onnx not built: the SSMScanPacked plugin has no AOT implementation" in caplog.text
    caplog.clear()
    with pytest.raises(BackendUnavailable):
        B.build_engines(out, plugin="jit")
    assert "not built" not in caplog.text


def test_build_records_the_timing_cache_it_writes_into_outdir(tmp_path, monkeypatch):
    """OUTDIR/.timing.cache, written by build, is recorded with its sha256 in the manifest's ``files`` (so that
    ``export --force`` may replace it, and only while its content is what build wrote). TensorRT and the GPU are
    stood in for: the builder writes the cache and returns engine bytes."""
    import m2export.trt.loader as L
    from m2export.exporter.manifest import file_sha256, foreign_reason

    out = make_outdir(tmp_path)
    monkeypatch.setattr(B, "require_tensorrt", lambda: SimpleNamespace(__version__="10.0"))
    monkeypatch.setattr(B, "require_gpu", lambda: ("H200", "9.0"))
    monkeypatch.setattr(L, "count_ssm_scan_nodes", lambda path: 0)

    def fake_build(t, *, timing_cache, **k):
        Path(timing_cache).write_bytes(b"cache of " + t.onnx.name.encode())
        return b"engine"
    monkeypatch.setattr(B, "build_engine_bytes", fake_build)
    B.build_engines(out, roles=("prefill", "decode"))
    m = read_manifest(out, consistent=False)
    assert m.files == {B.TIMING_CACHE_FILE: file_sha256(out / B.TIMING_CACHE_FILE)}
    assert foreign_reason(out) is None
    (out / B.TIMING_CACHE_FILE).write_bytes(b"changed")
    assert foreign_reason(out) == f"holds file(s) changed since m2export wrote them ({B.TIMING_CACHE_FILE})"


@pytest.mark.parametrize("args,first", [
    (["--min-batch", "4", "--max-batch", "2"],
     "error: --min-batch 4, --opt-batch 1, --max-batch 2: expected 1 <= --min-batch <= --opt-batch <= --max-batch"),
    (["--min-seq", "8", "--opt-seq", "4"], "error: --min-seq 8, --opt-seq 4, --max-seq 2048: expected 1 <= --min-seq "
                                           "<= --opt-seq <= --max-seq"),
])
def test_bad_profile_flags_are_named(args, first, tmp_path, capsys):
    """An inconsistent --min/--opt/--max-batch or -seq: one line naming the flags and the values (it said 'shape range:
    expected 1 <= min <= opt <= max, got ...' without a flag), a hint with the defaults; before any path is read."""
    rc = main(["build", str(tmp_path / "nothing_read"), *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and lines[0] == first, lines  # a usage error (ExitCode.USAGE), as argparse's
    assert lines[1].startswith("hint: the defaults are ") and len(lines) == 2


def _stand_in_builder(monkeypatch, seen: list | None = None):
    """TensorRT and the GPU stood in for: the builder reads and extends the timing cache it is given (as Polygraphy
    does: it combines the file's previous content with the new timings) and returns engine bytes."""
    import m2export.trt.loader as L

    monkeypatch.setattr(B, "require_tensorrt", lambda: SimpleNamespace(__version__="10.0"))
    monkeypatch.setattr(B, "require_gpu", lambda: ("H200", "9.0"))
    monkeypatch.setattr(L, "count_ssm_scan_nodes", lambda path: 0)

    def fake_build(t, *, timing_cache, **k):
        old = Path(timing_cache).read_bytes() if Path(timing_cache).is_file() else b""
        if seen is not None:
            seen.append(old)
        Path(timing_cache).write_bytes(old + b"+" + t.onnx.name.encode())
        return b"engine"
    monkeypatch.setattr(B, "build_engine_bytes", fake_build)


def test_custom_timing_cache_is_recorded_reused_and_never_deleted_by_force(tmp_path, monkeypatch):
    """build --timing-cache PATH outside OUTDIR: m2export.json records its absolute path, so a later plain build
    reuses (and updates) it; build wrote it atomically (nothing else beside it, no Polygraphy lock file in either
    folder); export --force over the folder leaves it alone (it is outside: only OUTDIR is replaced)."""
    out = make_outdir(tmp_path)
    seen: list[bytes] = []
    _stand_in_builder(monkeypatch, seen)
    caches = tmp_path / "caches"
    caches.mkdir()
    cache = caches / "h200.cache"
    cache.write_bytes(b"earlier")
    assert main(["build", str(out), "--timing-cache", str(cache), "-q"]) == 0
    assert seen == [b"earlier"] and cache.read_bytes() == b"earlier+model.onnx"
    m = read_manifest(out, consistent=False)
    assert m.timing_cache == str(cache.resolve()) and m.files == {}
    assert sorted(p.name for p in caches.iterdir()) == ["h200.cache"]
    assert not (out / B.TIMING_CACHE_FILE).exists() and not any(p.name.endswith(".lock") for p in out.iterdir())
    assert main(["build", str(out), "-q"]) == 0  # the recorded cache, not OUTDIR/.timing.cache
    assert seen[-1] == b"earlier+model.onnx" and not (out / B.TIMING_CACHE_FILE).exists()
    from m2export.exporter.manifest import foreign_reason

    assert foreign_reason(out) is None  # the cache outside is no file of OUTDIR's: --force may replace OUTDIR
    ck = tmp_path / "ck"
    assert main(["random-checkpoint", "-o", str(ck), "--d-model", "32", "--n-layer", "1", "--vocab-size", "256",
                 "--d-state", "16", "--headdim", "16", "--chunk-size", "16", "-q"]) == 0
    assert main(["export", str(ck), "-o", str(out), "--force", "--no-check", "-q"]) == 0
    assert cache.read_bytes() == b"earlier+model.onnx+model.onnx"


def test_custom_timing_cache_inside_outdir_is_the_users(tmp_path, monkeypatch, capsys):
    """--timing-cache OUTDIR/mine.cache is recorded by its name, reused by the next build, and, not being a file
    m2export records a sha256 for, never deleted by export --force (refused, naming it)."""
    out = make_outdir(tmp_path)
    _stand_in_builder(monkeypatch)
    assert main(["build", str(out), "--timing-cache", str(out / "mine.cache"), "-q"]) == 0
    assert read_manifest(out, consistent=False).timing_cache == "mine.cache"
    assert main(["build", str(out), "-q"]) == 0
    assert (out / "mine.cache").read_bytes() == b"+model.onnx+model.onnx" and not (out / B.TIMING_CACHE_FILE).exists()
    from m2export.exporter.manifest import foreign_reason

    assert foreign_reason(out) == "holds file(s) m2export did not write (mine.cache)"


def test_recorded_timing_cache_gone_falls_back_to_outdir(tmp_path, monkeypatch):
    """A recorded cache that no longer exists (the folder copied to another machine): the build uses
    OUTDIR/.timing.cache rather than create a file at the old path, and records that one."""
    out = make_outdir(tmp_path)
    _stand_in_builder(monkeypatch)
    gone = tmp_path / "elsewhere" / "x.cache"
    assert main(["build", str(out), "--timing-cache", str(gone), "-q"]) == 0
    gone.unlink()
    assert main(["build", str(out), "-q"]) == 0
    assert not gone.exists() and (out / B.TIMING_CACHE_FILE).read_bytes() == b"+model.onnx"
    m = read_manifest(out, consistent=False)
    assert m.timing_cache == B.TIMING_CACHE_FILE and B.TIMING_CACHE_FILE in m.files


@pytest.mark.parametrize("when", ["before", "during"])
def test_build_never_replaces_an_engine_file_it_did_not_write(tmp_path, monkeypatch, capsys, when):
    """A model.plan in OUTDIR that m2export.json does not list (a user's own engine; one built elsewhere and copied
    in) is not replaced by build, by export --force's rule: one line naming it, exit 1, the file kept and nothing
    recorded; checked before the (long) build and again right before the engine is written."""
    out = make_outdir(tmp_path)
    _stand_in_builder(monkeypatch)
    if when == "before":
        (out / "model.plan").write_bytes(b"mine")
    else:
        real = B.build_engine_bytes

        def meanwhile(*a, **k):
            (out / "model.plan").write_bytes(b"mine")
            return real(*a, **k)
        monkeypatch.setattr(B, "build_engine_bytes", meanwhile)
    assert main(["build", str(out), "-q"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == f"error: {out}: holds file(s) m2export did not write (model.plan); build replaces only the " \
                       "engines it wrote", lines
    assert len(lines) == 2 and lines[1].startswith("hint: ")
    assert (out / "model.plan").read_bytes() == b"mine" and read_manifest(out, consistent=False).engines == []
