"""One tiny byte-level checkpoint and its export (both flavours), shared by tests/check and tests/cli.

Made once per test session under pytest's base temp dir (both conftests call :func:`tiny_export`), so
the ~10 s export is paid once. Sizes: d_model 64, 2 layers, vocab 256 (bytes), d_state 16, headdim 16
(8 heads), ngroups 2, chunk_size 16: the default check sizes then cover 1 token, a partial chunk,
one chunk, one chunk + 1 and two chunks + 3.
"""

from __future__ import annotations

import shutil
from pathlib import Path

TINY = dict(d_model=64, n_layer=2, vocab_size=256, d_state=16, headdim=16, ngroups=2, chunk_size=16)


def tiny_checkpoint(tmp_path_factory) -> Path:
    from m2export.models.checkpoint import random_checkpoint

    d = tmp_path_factory.getbasetemp() / "m2check_tiny_ck"
    if not (d / "config.json").is_file():
        random_checkpoint(d, seed=3, **TINY)
    return d


def tiny_export(tmp_path_factory) -> Path:
    """OUTDIR of the tiny checkpoint exported with ssm_impl="both" (model.onnx ssmscan, model.std.onnx std)."""
    from m2export.exporter import export_model

    d = tmp_path_factory.getbasetemp() / "m2check_tiny_export"
    if not (d / "m2export.json").is_file():
        export_model(tiny_checkpoint(tmp_path_factory), d, ssm_impl="both", force=True)
    return d


def tiny_export_bf16(tmp_path_factory) -> Path:
    """The tiny checkpoint exported in bf16 (both flavours): ONNX Runtime's CPU provider cannot run it."""
    from m2export.exporter import export_model

    d = tmp_path_factory.getbasetemp() / "m2check_tiny_export_bf16"
    if not (d / "m2export.json").is_file():
        export_model(tiny_checkpoint(tmp_path_factory), d, ssm_impl="both", dtype="bf16", force=True)
    return d


def copy_export(src: Path, dst: Path) -> Path:
    """A private copy of an export to tamper with (the manifest's checkpoint path stays valid)."""
    shutil.copytree(src, dst)
    for f in dst.glob("check_*"):
        f.unlink()
    return dst


def record_engine(out: Path, profiles: list[dict], *, role: str = "prefill", file: str = "model.plan", gpu: str = "H200",
                  precision: str = "fp32", payload: bytes | None = b"stand-in", onnx_file: str | None = None):
    """List an engine for ``file`` in out/m2export.json as ``m2export build`` records one (TensorRT
    10.9, sm 9.0, jit plugin, its optimisation ``profiles``) and write ``payload`` as the engine file
    (None: no file); ``onnx_file`` default: ``file`` with .onnx. A stand-in for tests of the manifest plumbing:
    no TensorRT involved."""
    from m2export.exporter.manifest import EngineEntry, read_manifest, write_manifest

    entry = EngineEntry(role, file, onnx_file or file.replace(".plan", ".onnx"), "10.9", gpu, "9.0", "jit", profiles, precision,
                        profile_roles=role.split("+"))
    m = read_manifest(out)
    m.engines.append(entry)
    write_manifest(out, m)
    if payload is not None:
        (out / file).write_bytes(payload)
    return entry


def set_ssm_scan_attribute(onnx_path: Path, name: str, value) -> int:
    """Rewrite attribute ``name`` of every m2export::SSMScan node; returns how many nodes changed."""
    import onnx

    m = onnx.load(str(onnx_path))
    n = 0
    for node in m.graph.node:
        if node.op_type == "SSMScan" and node.domain == "m2export":
            for a in node.attribute:
                if a.name == name:
                    a.CopyFrom(onnx.helper.make_attribute(name, value))
                    n += 1
    onnx.save(m, str(onnx_path))
    return n


def scale_initializer(onnx_path: Path, name: str, factor: float) -> None:
    """Multiply weight initializer ``name`` by ``factor`` in place."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(onnx_path))
    for i, t in enumerate(m.graph.initializer):
        if t.name == name:
            arr = numpy_helper.to_array(t)
            scaled = (arr.astype("float32") * factor).astype(arr.dtype)  # keeps fp16/bf16 initializers' dtype
            m.graph.initializer[i].CopyFrom(numpy_helper.from_array(scaled, name))
            break
    else:
        raise KeyError(f"{onnx_path.name}: no initializer {name!r}")
    onnx.save(m, str(onnx_path))


def change_external_weight(onnx_path: Path, name: str, change) -> Path:
    """Change the external-data initializer ``name`` of ``onnx_path`` where it is stored: ``change(values)`` edits
    the flat numpy view of its bytes in place in its data file (``model.onnx.data``, which every graph of the
    folder reads; the graph itself is unchanged). Returns the data file."""
    import numpy as np
    import onnx
    from onnx import helper

    m = onnx.load(str(onnx_path), load_external_data=False)
    t = next((t for t in m.graph.initializer if t.name == name), None)
    if t is None or t.data_location != onnx.TensorProto.EXTERNAL:
        raise KeyError(f"{onnx_path.name}: no external initializer {name!r}")
    info = {e.key: e.value for e in t.external_data}
    data = onnx_path.parent / info["location"]
    dt = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
    raw = np.memmap(data, dtype=np.uint8, mode="r+", offset=int(info.get("offset", 0)), shape=(int(info["length"]),))
    change(raw.view(dt))
    raw.flush()
    del raw
    return data


def zero_graph_input(onnx_path: Path, input_name: str, op_type: str) -> int:
    """Make the graph ignore input ``input_name``: its ``op_type`` consumers read ``Sub(x, x)`` (zeros of the
    same shape and dtype) instead, in the main graph and in If branches (which read outer values by name: the
    SSMScan body's chunked scan is the else branch of If(seqlen == 1)). Returns how many node inputs were rewired."""
    import onnx
    from onnx import helper

    m = onnx.load(str(onnx_path))
    zeros = f"{input_name}__zeroed"
    n = 0

    def walk(nodes):
        for node in nodes:
            yield node
            for a in node.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    yield from walk(a.g.node)

    for node in walk(m.graph.node):
        if node.op_type == op_type:
            for k, x in enumerate(node.input):
                if x == input_name:
                    node.input[k] = zeros
                    n += 1
    if n:
        m.graph.node.insert(0, helper.make_node("Sub", [input_name, input_name], [zeros], name=zeros))
    onnx.save(m, str(onnx_path))
    return n


def quiet_single_threaded():
    """Polygraphy's logger to errors only; torch on one thread for these tiny models (with other work on
    the 2 cores, two torch threads make a 3 ms decode step take ~200 ms). Restored afterwards."""
    import torch

    from m2export.check.console import quiet_polygraphy

    quiet_polygraphy()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
