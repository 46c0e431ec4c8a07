"""What is inside an export: OUTDIR (manifest + graphs + engines), one ONNX graph, or one TensorRT engine.

:func:`describe` returns a JSON-able dict; :func:`format_text` renders it for the console. ONNX graphs
are read without their external data (only the structure is needed). Engines are deserialised only
where TensorRT is installed; otherwise the manifest's record of the engine is shown.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from m2export.contract import OP_DOMAIN, OP_NAME, PACKED_OP_NAME
from m2export import backends
from m2export.check.console import human_bytes
from m2export.errors import ExportFolderError, RuntimeLoadError
from m2export.exporter.configs import MANIFEST_FILE
from m2export.exporter.manifest import REEXPORT_HINT


def describe(path: str | Path) -> dict[str, Any]:
    """Describe ``path``: an OUTDIR, a ``.onnx`` graph, or a ``.plan``/``.engine`` TensorRT engine.

    Raises:
        ExportFolderError: path missing, a folder without m2export.json, or a file that is neither.
    """
    p = Path(path)
    if not p.exists():
        raise ExportFolderError(f"{p}: no such file or directory",
                                hint="pass an OUTDIR written by 'm2export export', a .onnx graph or a .plan engine")
    if p.is_dir():
        if not (p / MANIFEST_FILE).is_file():
            raise ExportFolderError(f"{p}: not an m2export output folder (no {MANIFEST_FILE})",
                                    hint="create one with 'm2export export CHECKPOINT -o OUTDIR'")
        return describe_outdir(p)
    if p.suffix == ".onnx":
        return describe_onnx(p)
    if p.suffix in (".plan", ".engine"):
        return describe_engine(p)
    raise ExportFolderError(f"{p}: not an ONNX graph (.onnx), a TensorRT engine (.plan) or an OUTDIR",
                            hint="pass an OUTDIR written by 'm2export export', a .onnx graph or a .plan engine")


def _dims(type_proto) -> list[Any]:
    t = type_proto.tensor_type
    if not t.HasField("shape"):
        return ["?"]
    return [d.dim_param if d.dim_param else (d.dim_value if d.HasField("dim_value") else "?") for d in t.shape.dim]


def load_onnx_structure(path: str | Path):
    """``onnx.load`` of the graph without its external data (structure only).

    Raises:
        ExportFolderError: the file cannot be read or is not an ONNX model (protobuf DecodeError and friends; a
            message without a graph, such as an empty file, which protobuf parses as an empty ModelProto).
    """
    import onnx

    p = Path(path)
    try:
        m = onnx.load(str(p), load_external_data=False)
    except Exception as e:  # protobuf DecodeError and friends
        raise ExportFolderError(f"{p}: not a readable ONNX model ({type(e).__name__}: {e})".rstrip(": "),
                                hint=REEXPORT_HINT) from None
    if not m.HasField("graph"):
        what = "it is empty (0 bytes)" if p.stat().st_size == 0 else "it has no graph"
        raise ExportFolderError(f"{p}: not an ONNX model: {what}", hint=REEXPORT_HINT)
    return m


def describe_onnx(path: str | Path) -> dict[str, Any]:
    """Inputs/outputs (dtype, shape), opsets, op counts, SSMScan (and SSMScanPacked) nodes with attributes, local
    functions."""
    from onnx import __version__ as onnx_version
    from onnx import helper

    p = Path(path)
    m = load_onnx_structure(p)

    def dtype(v, kind: str) -> str:
        t = v.type.tensor_type.elem_type
        if not t:
            return "?"
        try:
            return helper.tensor_dtype_to_np_dtype(t).name
        except KeyError:  # a number no TensorProto.DataType has (a damaged or hand-edited graph)
            raise ExportFolderError(f"{p}: {kind} {v.name!r} has elem_type {t}, which is no tensor type of "
                                    f"ONNX's TensorProto.DataType (onnx {onnx_version})", hint=REEXPORT_HINT) from None

    def io(vs, kind: str):
        return [{"name": v.name, "dtype": dtype(v, kind), "shape": _dims(v.type)} for v in vs]

    def attr(a):
        v = helper.get_attribute_value(a)
        return v.decode() if isinstance(v, bytes) else v

    scans = [{"name": n.name, "op": n.op_type, "inputs": list(n.input), "outputs": list(n.output),
              "attributes": {a.name: attr(a) for a in n.attribute}}
             for n in m.graph.node if n.op_type in (OP_NAME, PACKED_OP_NAME) and n.domain == OP_DOMAIN]
    for sc in scans:  # the contract, not just the names: chunk_size 0, plugin_version "2" ... are errors
        from m2export.contract import SSMScanAttrs
        from m2export.errors import ContractError

        try:
            SSMScanAttrs.from_onnx_attributes(sc["attributes"])
        except ContractError as e:
            raise ContractError(f"{p}: SSMScan node {sc['name']!r}: {e}") from None
        except (TypeError, ValueError) as e:  # e.g. a graph-typed attribute
            raise ContractError(f"{p}: SSMScan node {sc['name']!r}: malformed attribute ({e})") from None
    n_params = 0
    for init in m.graph.initializer:
        k = 1
        for d in init.dims:
            k *= d
        n_params += k
    outputs = io(m.graph.output, "output")
    logits = next((o for o in outputs if o["name"] == "logits"), None)
    return {
        "kind": "onnx", "path": str(p), "bytes": p.stat().st_size,
        "ir_version": m.ir_version, "producer": f"{m.producer_name} {m.producer_version}".strip(),
        "opsets": {(o.domain or "ai.onnx"): o.version for o in m.opset_import},
        "dtype": logits["dtype"] if logits else None,
        "inputs": io(m.graph.input, "input"), "outputs": outputs,
        "nodes": len(m.graph.node), "op_types": dict(Counter(n.op_type for n in m.graph.node).most_common()),
        "ssm_scan_nodes": scans,
        "functions": [{"domain": f.domain, "name": f.name, "nodes": len(f.node),
                       "attributes": list(f.attribute) + [a.name for a in f.attribute_proto]} for f in m.functions],
        "initializers": len(m.graph.initializer), "parameters": n_params,
        "external_data": sorted({e.value for t in m.graph.initializer for e in t.external_data
                                 if e.key == "location"}),
        "external_data_extent": external_data_extent(m),
    }


def external_data_extent(m) -> dict[str, int]:
    """Per external-data file a graph reads (its ``location``): the byte just past the last tensor it reads
    there (max of ``offset + length`` over the initializers stored in that file). A file shorter than this is
    truncated: ONNX Runtime refuses the graph (or, through an mmap, would read past the end)."""
    extent: dict[str, int] = {}
    for t in m.graph.initializer:
        e = {x.key: x.value for x in t.external_data}
        if "location" in e:
            end = int(e.get("offset", 0)) + int(e.get("length", 0))
            extent[e["location"]] = max(extent.get(e["location"], 0), end)
    return extent


def truncated(size: int | None, needed: int | None) -> bool:
    """True when an external-data file of ``size`` bytes is shorter than the ``needed`` bytes its graphs read."""
    return size is not None and needed is not None and size < needed


def check_graph_file(path: str | Path, entry) -> dict[str, Any] | None:
    """:func:`describe_onnx` of ``path``, checked against its manifest entry (a
    :class:`~m2export.exporter.manifest.GraphEntry`): the same input and output names and dtypes, and
    SSMScan nodes exactly when the entry's flavour is ssmscan, and every external-data file it reads there in full
    (:func:`damaged_files`). None for a file that cannot be read at all: the runtime that loads it names the cause
    (ORT's or protobuf's error, as before).

    Raises:
        ExportFolderError: the file is not the graph m2export.json lists under that name (two flavours'
            files swapped, or another export's graph copied in), naming the file and the difference; or its
            weights file (model.onnx.data) is missing or shorter than the graph's external-data references read
            (a copy cut short, a full disk), naming its size and the bytes expected.
        ContractError: an SSMScan node breaks the contract (from :func:`describe_onnx`).
    """
    from m2export.errors import ContractError, M2ExportError

    p = Path(path)
    if p.is_file() and p.stat().st_size == 0:  # parses as an empty model: 'inputs differ' would mislead
        raise ExportFolderError(f"{p}: is empty (0 bytes): a copy cut short or a full disk?", hint=REEXPORT_HINT)
    try:
        info = describe_onnx(p)
    except ContractError:
        raise
    except M2ExportError:  # unreadable (not ONNX, truncated): left to the runtime's own message
        return None
    for kind in ("inputs", "outputs"):
        got = {t["name"]: t["dtype"] for t in info[kind]}
        want = {k: v.get("dtype") for k, v in getattr(entry, kind).items()}
        if got != want:
            diff = sorted(set(got) ^ set(want)) or sorted(k for k in got if got[k] != want[k])
            raise ExportFolderError(f"{p}: its {kind} differ from those {MANIFEST_FILE} records for it "
                                    f"(first differences: {diff[:4]}): not the graph exported under this name",
                                    hint=REEXPORT_HINT)
    n_scan = len(info["ssm_scan_nodes"])
    if (n_scan > 0) != (entry.ssm_impl == "ssmscan"):
        raise ExportFolderError(f"{p}: {MANIFEST_FILE} lists it as the {entry.ssm_impl} flavour, but it has "
                                f"{n_scan} SSMScan node(s): a graph file of another flavour under this name?",
                                hint=REEXPORT_HINT)
    unlisted = sorted(set(info["external_data"]) - set(entry.external_data))
    if unlisted:  # e.g. a location edited to ../../etc/passwd: never 'truncated', never read
        raise ExportFolderError(f"{p}: reads weights from {unlisted[:3]}, not from the file(s) {MANIFEST_FILE} lists "
                                f"for it ({', '.join(entry.external_data) or 'none'}): not the graph exported under "
                                "this name", hint=REEXPORT_HINT)
    damaged = damaged_files(info)
    if damaged:  # ONNX Runtime's own refusal was one ~600-character line of C++ signature and initializer offsets
        raise ExportFolderError(f"{p}: {'; '.join(damaged)}",
                                hint=f"its weights file was cut short or removed (a copy, a full disk): {REEXPORT_HINT}")
    return info


def _manifest_near(p: Path):
    from m2export.exporter.manifest import read_manifest

    if (p.parent / MANIFEST_FILE).is_file():
        return read_manifest(p.parent)
    return None


def describe_engine(path: str | Path) -> dict[str, Any]:
    """What the manifest records about the engine, plus its IO and profiles when TensorRT is installed."""
    from dataclasses import asdict

    p = Path(path)
    out: dict[str, Any] = {"kind": "engine", "path": str(p), "bytes": p.stat().st_size}
    m = _manifest_near(p)
    entry = next((e for e in m.engines if e.file == p.name), None) if m else None
    out["manifest"] = asdict(entry) if entry else None
    if m is None:
        out["manifest_note"] = f"no {MANIFEST_FILE} next to the engine"
    elif entry is None:
        out["manifest_note"] = f"{MANIFEST_FILE} does not list {p.name} (built outside 'm2export build'?)"
    why = backends.tensorrt_unavailable_reason()
    if why:
        out["tensorrt"] = f"{why}: TensorRT (and a GPU) are needed to read the engine itself (IO tensors, profiles)"
        return out
    import tensorrt as trt

    from m2export import plugins

    plugins.register()  # the SSMScan plugin must be registered before deserialising

    logger = trt.Logger(trt.Logger.ERROR)
    engine = trt.Runtime(logger).deserialize_cuda_engine(p.read_bytes())
    if engine is None:
        raise RuntimeLoadError(f"{p}: TensorRT {trt.__version__} cannot deserialise this engine (built with another "
                               "TensorRT version or GPU, or not an engine)", hint="rebuild with 'm2export build OUTDIR'")
    tensors = []
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        tensors.append({"name": name, "mode": engine.get_tensor_mode(name).name,
                        "dtype": str(engine.get_tensor_dtype(name)), "shape": list(engine.get_tensor_shape(name))})
    profiles = []
    for k in range(engine.num_optimization_profiles):
        prof = {}
        for t in tensors:
            if t["mode"] == "INPUT" and -1 in t["shape"]:
                mn, opt, mx = engine.get_tensor_profile_shape(t["name"], k)
                prof[t["name"]] = {"min": list(mn), "opt": list(opt), "max": list(mx)}
        profiles.append(prof)
    out["tensorrt"] = trt.__version__
    out["io_tensors"] = tensors
    out["profiles"] = profiles
    return out


def describe_outdir(path: str | Path) -> dict[str, Any]:
    """Manifest summary plus :func:`describe_onnx` of every graph; missing files are flagged."""
    from dataclasses import asdict

    from m2export.exporter.manifest import read_manifest

    d = Path(path)
    m = read_manifest(d)
    c = m.config
    graphs = []
    for g in m.graphs:
        f = d / g.file
        entry: dict[str, Any] = {"role": g.role, "ssm_impl": g.ssm_impl, "file": g.file, "present": f.is_file(),
                                 "external_data": [{"file": x, "bytes": (d / x).stat().st_size if (d / x).is_file()
                                                    else None} for x in g.external_data],
                                 # each state kind's axis order in this graph (m2export.json's per-state layout)
                                 "state_layouts": {s.kind: list(s.layout) for s in g.io().states
                                                   if s.layout is not None}}
        extent: dict[str, int] = {}
        if f.is_file():
            info = describe_onnx(f)
            entry.update({k: info[k] for k in ("bytes", "opsets", "nodes", "ssm_scan_nodes", "functions",
                                                "parameters", "inputs", "outputs")})
            entry["reads"] = info["external_data"]  # the locations the graph file itself names
            extent = info["external_data_extent"]
        for x in entry["external_data"]:
            x["needed_bytes"] = extent.get(x["file"])
        graphs.append(entry)
    engines = [{**asdict(e), "present": (d / e.file).is_file()} for e in m.engines]
    data: dict[str, dict[str, Any]] = {}
    for g in m.graphs:
        for name in g.external_data:
            f = d / name
            entry = data.setdefault(name, {"file": name, "present": f.is_file(),
                                           "bytes": f.stat().st_size if f.is_file() else 0, "graphs": []})
            entry["graphs"].append(g.file)
    for g in graphs:
        for x in g["external_data"]:
            e = data[x["file"]]
            if x["needed_bytes"] is not None:
                e["needed_bytes"] = max(e.get("needed_bytes") or 0, x["needed_bytes"])
    for e in data.values():
        e.setdefault("needed_bytes", None)
        e["truncated"] = e["present"] and truncated(e["bytes"], e["needed_bytes"])
    return {"kind": "outdir", "path": str(d), "source_checkpoint": m.source_checkpoint,
            "checkpoint_format": m.checkpoint_format, "checkpoint_sha256": m.checkpoint_sha256,
            "dtype": m.dtype, "opset": m.opset, "config": c, "tool_versions": m.tool_versions,
            "graphs": graphs, "external_data": list(data.values()), "engines": engines,
            "disk_bytes": sum(f.stat().st_size for f in d.iterdir() if f.is_file())}


def damaged_files(info: dict[str, Any]) -> list[str]:
    """What :func:`describe` found missing or truncated, one phrase per file (empty for a sound export or file)."""
    out: list[str] = []
    if info.get("kind") == "outdir":
        out += [f"{g['file']} is missing" for g in info["graphs"] if not g["present"]]
        for g in info["graphs"]:
            unlisted = sorted(set(g.get("reads", [])) - {x["file"] for x in g["external_data"]})
            if unlisted:
                out.append(f"{g['file']} reads weights from {unlisted[:3]}, not from the file(s) {MANIFEST_FILE} lists "
                           "for it")
        out += [f"{x['file']} is missing" for x in info["external_data"] if not x["present"]]
        out += [f"{x['file']} is truncated ({x['bytes']:,} bytes; the graphs read {x['needed_bytes']:,})"
                for x in info["external_data"] if x.get("truncated")]
        out += [f"{e['file']} is missing" for e in info["engines"] if not e["present"]]
    elif info.get("kind") == "onnx":
        d = Path(info["path"]).parent
        for x, need in info["external_data_extent"].items():
            f = d / x
            if not f.is_file():
                out.append(f"{x} is missing")
            elif truncated(f.stat().st_size, need):
                out.append(f"{x} is truncated ({f.stat().st_size:,} bytes; the graph reads {need:,})")
    return out


# ----------------------------------------------------------------------------------------------- text
def _shape(s) -> str:
    return "[" + ", ".join(str(x) for x in s) + "]"


def _io_lines(ios: list[dict], indent: str, limit: int = 6) -> list[str]:
    """IO lines; per-layer state tensors beyond the first layer are summarised."""
    out, hidden = [], 0
    for v in ios:
        name = v["name"]
        if "_state." in name and not name.endswith(".0"):
            hidden += 1
            continue
        out.append(f"{indent}{name:<24} {v['dtype']:<8} {_shape(v['shape'])}")
    if hidden:
        out.append(f"{indent}... and {hidden} more per-layer state tensors (same dtype/shape as layer 0)")
    return out


def _scan_op(scans: list[dict]) -> str:
    """The op name(s) of a graph's scan nodes: SSMScan, or SSMScanPacked in a packed-prefill graph."""
    return "/".join(sorted({s.get("op", OP_NAME) for s in scans})) or OP_NAME


def _scan_lines(scans: list[dict], indent: str) -> list[str]:
    if not scans:
        return [f"{indent}SSMScan nodes: none (standard ONNX ops only)"]
    attrs = [tuple(sorted(s["attributes"].items())) for s in scans]
    op = _scan_op(scans)
    out = [f"{indent}{op} nodes ({OP_DOMAIN}::{op}): {len(scans)}"]
    for a, n in Counter(attrs).items():
        out.append(f"{indent}  {n} x " + ", ".join(f"{k}={v}" for k, v in a))
    return out


def format_text(info: dict[str, Any]) -> str:
    """Console rendering of :func:`describe`'s dict."""
    L: list[str] = []
    if info["kind"] == "onnx":
        L.append(f"{info['path']}: ONNX IR {info['ir_version']}, producer {info['producer']}, "
                 f"{human_bytes(info['bytes'])}, dtype {info['dtype']}")
        L.append("  opsets: " + ", ".join(f"{k} {v}" for k, v in info["opsets"].items()))
        L.append("  inputs:")
        L += _io_lines(info["inputs"], "    ")
        L.append("  outputs:")
        L += _io_lines(info["outputs"], "    ")
        L += _scan_lines(info["ssm_scan_nodes"], "  ")
        for f in info["functions"]:
            L.append(f"  local function {f['domain']}::{f['name']} ({f['nodes']} nodes; attributes "
                     f"{', '.join(f['attributes'])})")
        top = ", ".join(f"{k} {v}" for k, v in list(info["op_types"].items())[:8])
        L.append(f"  {info['nodes']} nodes ({top}{', ...' if len(info['op_types']) > 8 else ''}); "
                 f"{info['initializers']} initializers, {info['parameters']:,} parameters"
                 + (f"; external data {', '.join(info['external_data'])}" if info["external_data"] else ""))
        for x in info["external_data"]:
            p = Path(info["path"]).parent / x
            need = info["external_data_extent"].get(x)
            size = p.stat().st_size if p.is_file() else None
            L.append(f"  external data {x}: " + ("MISSING" if size is None else human_bytes(size))
                     + (f" TRUNCATED: the graph reads {need:,} bytes, the file has {size:,}"
                        if truncated(size, need) else ""))
    elif info["kind"] == "engine":
        L.append(f"{info['path']}: TensorRT engine, {human_bytes(info['bytes'])}")
        e = info.get("manifest")
        if e:
            L.append(f"  built from {e['onnx_file']} ({e['role']}), precision {e['precision']}, TensorRT "
                     f"{e['tensorrt_version']}, {e['gpu']} (sm {e['compute_capability']}), plugin {e['plugin_mode']}")
            for k, prof in enumerate(e["profiles"]):
                L.append(f"  profile {k}: {prof}")
        else:
            L.append(f"  {info.get('manifest_note', '')}")
        if "io_tensors" in info:
            for t in info["io_tensors"]:
                if "_state." in t["name"] and not t["name"].endswith(".0"):
                    continue
                L.append(f"    {t['mode'].lower():<6} {t['name']:<24} {t['dtype']:<14} {_shape(t['shape'])}")
            for k, prof in enumerate(info["profiles"]):
                L.append(f"  engine profile {k}: " + "; ".join(
                    f"{n} min {_shape(v['min'])} opt {_shape(v['opt'])} max {_shape(v['max'])}"
                    for n, v in prof.items() if n == "input_ids" or n.endswith(".0")))
        else:
            L.append(f"  TensorRT: {info['tensorrt']}")
    else:
        c = info["config"]
        L.append(f"{info['path']}: m2export output folder, dtype {info['dtype']}, {_folder_opsets(info)}")
        L.append(f"  checkpoint: {info['source_checkpoint']} ({info['checkpoint_format']}, sha256 "
                 f"{info['checkpoint_sha256'][:12]}...)")
        L.append("  model: " + ", ".join(f"{k}={c[k]}" for k in ("d_model", "n_layer", "vocab_size", "d_state",
                                                                 "headdim", "ngroups", "expand", "d_conv",
                                                                 "chunk_size") if k in c))
        # one column width per field over every row that has it (model.native.onnx, model.packed.onnx and
        # model.decode.plan are longer than model.onnx.data; packed-prefill / prefill+decode longer than prefill)
        fw = max((len(x["file"]) for x in [*info["graphs"], *info.get("external_data", []), *info["engines"]]),
                 default=0)
        rw = max((len(x["role"]) for x in [*info["graphs"], *info["engines"]]), default=0)
        iw = max((len(g["ssm_impl"]) for g in info["graphs"]), default=0)
        for g in info["graphs"]:
            if not g["present"]:
                L.append(f"  {g['file']:<{fw}} {g['role']:<{rw}} ssm_impl={g['ssm_impl']:<{iw}} MISSING")
                continue
            n_scan = len(g["ssm_scan_nodes"])
            L.append(f"  {g['file']:<{fw}} {g['role']:<{rw}} ssm_impl={g['ssm_impl']:<{iw}} "
                     f"{human_bytes(g['bytes'])}, {g['nodes']} nodes, {n_scan} {_scan_op(g['ssm_scan_nodes'])}, opsets "
                     + ", ".join(f"{k} {v}" for k, v in g["opsets"].items()))
            for kind, axes in g.get("state_layouts", {}).items():
                L.append(f"    {kind:<10} layout {_shape(axes)}")
        for x in info.get("external_data", []):
            L.append(f"  {x['file']:<{fw}} weights, {human_bytes(x['bytes'])}, stored once for "
                     + ", ".join(x["graphs"]) + ("" if x["present"] else " MISSING")
                     + (f" TRUNCATED: the graphs read {x['needed_bytes']:,} bytes, the file has {x['bytes']:,}"
                        if x.get("truncated") else ""))
        L.append(f"  on disk: {human_bytes(info['disk_bytes'])} in all")
        first = next((g for g in info["graphs"] if g["present"]), None)
        if first:
            L.append(f"  {first['file']} inputs:")
            L += _io_lines(first["inputs"], "    ")
            L.append(f"  {first['file']} outputs:")
            L += _io_lines(first["outputs"], "    ")
            scan_graph = next((g for g in info["graphs"] if g["present"] and g["ssm_scan_nodes"]), None)
            if scan_graph:
                L += _scan_lines(scan_graph["ssm_scan_nodes"], "  ")
        if info["engines"]:
            for e in info["engines"]:
                L.append(f"  {e['file']:<{fw}} {e['role']:<{rw}} TensorRT {e['tensorrt_version']}, {e['precision']}, "
                         f"{e['gpu']}" + ("" if e["present"] else " MISSING"))
                for k, prof in enumerate(e["profiles"]):
                    L.append(f"    profile {k}: {prof}")
        else:
            L.append("  engines: none (build with 'm2export build OUTDIR' on a GPU machine with TensorRT)")
    return "\n".join(L)


__all__ = ["describe", "describe_onnx", "describe_engine", "describe_outdir", "format_text"]


def _folder_opsets(info: dict) -> str:
    """``opset N``: the manifest's default-domain opset, with the graphs that import another one (the native
    flavour's 27) named; only that other opset when every present graph imports it."""
    other = {g["file"]: g["opsets"].get("ai.onnx") for g in info["graphs"] if g.get("present") and "opsets" in g}
    other = {f: v for f, v in other.items() if v is not None and v != info["opset"]}
    present = [g for g in info["graphs"] if g.get("present")]
    if other and len(other) == len(present) and len(set(other.values())) == 1:
        return f"opset {next(iter(other.values()))}"
    return f"opset {info['opset']}" + "".join(f", {f} opset {v}" for f, v in other.items())

