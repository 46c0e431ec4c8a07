"""Build TensorRT engines from an m2export output folder (``m2export build``).

Pipeline, with Polygraphy's TensorRT backend: :class:`~m2export.trt.loader.NetworkFromOnnxPathWithPlugin`
(strongly typed network, SSMScan plugin in JIT or AOT mode) -> ``CreateConfig`` (one optimization profile
per role: ``prefill`` over batch_size/sequence_length/past_sequence_length, ``decode`` with
sequence_length 1; timing cache, workspace limit, builder optimization level) -> ``EngineBytesFromNetwork``.
One graph gives one engine (``model.plan``) whose weights serve both profiles; it is written only once it
has built, then ``m2export.json`` gains its :class:`~m2export.exporter.manifest.EngineEntry` (profiles in
``profile_roles`` order). At run time a context per profile shares the engine
(:func:`m2export.check.runners.trt_runners`).

Decode in the one engine: the JIT plugin dispatches at run time (sequence length 1 runs the decode-step
kernel), but an AOT plugin layer embeds one kernel for every profile, chosen from the network's shapes, and
with the dynamic sequence_length that is the chunked scan: the AOT step kernel (chosen for a constant
sequence length 1) is not reached from this engine. Not run anywhere (no TensorRT here).

Precision comes from the ONNX graph's dtypes, never from builder flags: TensorRT 10 networks are created
``STRONGLY_TYPED`` (where FP16/BF16 builder flags are refused), TensorRT 11 networks are always strongly
typed (the flags are gone). The engine therefore runs in the dtype the model was exported in.

Everything before :func:`require_tensorrt` is plain Python (paths, profiles, precision), so a machine
without TensorRT fails early with the install hint and writes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from m2export import backends
from m2export._paths import atomic_file
from m2export.errors import (BackendUnavailable, BuildError, ExportFolderError, M2ExportError,
                             RuntimeLoadError, UsageError)
from m2export.exporter.configs import BATCH, MANIFEST_FILE, PAST_SEQ, PREFILL_FILE, SEQ, TIMING_CACHE_FILE
from m2export.exporter.manifest import (REEXPORT_HINT, EngineEntry, Manifest, aux_record, read_manifest,
                                       refuse_unowned, write_manifest)
from m2export.exporter.packed import NSEQ, PACKED_ROLE, TOKENS
from m2export.names import DEFAULT_PROFILE

log = logging.getLogger(__name__)

BATCH_SYMBOL, SEQ_SYMBOL, PAST_SYMBOL = BATCH, SEQ, PAST_SEQ
_ONNX_FLOAT = {1: "fp32", 10: "fp16", 16: "bf16"}  # onnx.TensorProto FLOAT, FLOAT16, BFLOAT16


@dataclass(frozen=True)
class ShapeRange:
    """min <= opt <= max of one dynamic dimension (min 0 allowed where ``allow_zero``: past_sequence_length)."""

    min: int
    opt: int
    max: int
    allow_zero: bool = False

    def __post_init__(self):
        lo = 0 if self.allow_zero else 1
        if not (lo <= self.min <= self.opt <= self.max):
            raise UsageError(f"shape range: expected {lo} <= min <= opt <= max, got min={self.min}, "
                             f"opt={self.opt}, max={self.max}")


#: the optimization profile of ``m2export build`` unless told otherwise (batch_size, sequence_length)
DEFAULT_BATCH = ShapeRange(*DEFAULT_PROFILE["batch"])
DEFAULT_SEQ = ShapeRange(*DEFAULT_PROFILE["seq"])


def past_range(seq: ShapeRange) -> ShapeRange:
    """Default profile of past_sequence_length (KV caches): 0 (a fresh sequence) .. seq.max, opt seq.opt."""
    return ShapeRange(0, seq.opt, seq.max, allow_zero=True)


@dataclass(frozen=True)
class BuildTarget:
    """One graph to build into one engine: ``roles`` its optimization profiles (prefill, decode), ``onnx``
    path, ``plan`` path to write."""

    roles: tuple[str, ...]
    onnx: Path
    plan: Path

    @property
    def role(self) -> str:
        return "+".join(self.roles)


@dataclass
class BuildResult:
    outdir: Path
    engines: list[EngineEntry] = field(default_factory=list)
    manifest_updated: bool = False


def plan_name(onnx_file: str | Path, roles: Sequence[str] = ("prefill", "decode")) -> str:
    """model.onnx -> model.plan, model.std.onnx -> model.std.plan; a decode-only engine (``roles`` ("decode",))
    gets its own file, model.decode.plan, beside the prefill (+ decode) engine."""
    name = Path(onnx_file).name
    stem = name[:-5] if name.endswith(".onnx") else name
    return stem + (".decode" if tuple(roles) == ("decode",) else "") + ".plan"


def pinned_input_shapes(inputs: dict[str, list[int | str]], roles: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """Network input shapes to fix at build time: for a decode-only engine, every input with a
    ``sequence_length`` axis gets it as the constant 1 (other symbolic axes -1: still dynamic), so shape
    inference hands the SSMScan plugin a constant seqlen 1 and the AOT plugin embeds the decode-step kernel
    instead of the chunked scan. Empty for engines with a prefill profile (their seqlen is dynamic)."""
    if tuple(roles) != ("decode",):
        return {}
    return {name: tuple(1 if d == SEQ_SYMBOL else d if isinstance(d, int) and d > 0 else -1 for d in dims)
            for name, dims in inputs.items() if SEQ_SYMBOL in dims}


def resolve_targets(path: str | Path, roles: Sequence[str] = ("prefill", "decode")) -> tuple[Path, Manifest | None,
                                                                                          list[BuildTarget]]:
    """What to build for ``path``: an OUTDIR (its manifest's primary graph) or one ``.onnx``; ``roles`` are the
    engine's optimization profiles.

    Raises:
        ExportFolderError: the path does not exist, is neither an OUTDIR nor an ONNX file, or the graph is missing.
    """
    p = Path(path)
    roles = tuple(roles)
    if p.is_dir():
        manifest = read_manifest(p, consistent=False)
        g = manifest.graph("prefill")
        targets = [BuildTarget(roles, p / g.file, p / plan_name(g.file, roles))]
        if "prefill" in roles:  # the packed prefill graph (export --packed-prefill): its own engine
            targets += [BuildTarget((PACKED_ROLE,), p / pg.file, p / plan_name(pg.file, (PACKED_ROLE,)))
                        for pg in manifest.graphs if pg.role == PACKED_ROLE]
        for t in targets:
            if not t.onnx.is_file():
                raise ExportFolderError(f"{t.onnx}: listed in {MANIFEST_FILE} but missing", hint=REEXPORT_HINT)
        return p, manifest, targets
    if p.is_file() and p.suffix == ".onnx":
        outdir = p.parent
        manifest = read_manifest(outdir, consistent=False) if (outdir / MANIFEST_FILE).is_file() else None
        return outdir, manifest, [BuildTarget(roles, p, outdir / plan_name(p.name, roles))]
    if not p.exists():
        raise ExportFolderError(f"{p}: no such file or directory",
                                hint=f"pass an OUTDIR written by 'm2export export' or its {PREFILL_FILE}")
    raise ExportFolderError(f"{p}: expected an m2export output folder or an .onnx file")


def onnx_inputs(onnx_path: str | Path) -> dict[str, list[int | str]]:
    """Graph input name -> dims (int, or the symbol name of a dynamic dim); weights are not loaded."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    init = {i.name for i in model.graph.initializer}
    out = {}
    for vi in model.graph.input:
        if vi.name in init:
            continue
        dims = []
        for d in vi.type.tensor_type.shape.dim:
            dims.append(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?"))
        out[vi.name] = dims
    return out


def onnx_precision(onnx_path: str | Path) -> str:
    """fp32 | fp16 | bf16: the most common float type of the graph's initializers (the weights)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    counts = Counter(_ONNX_FLOAT[i.data_type] for i in model.graph.initializer if i.data_type in _ONNX_FLOAT)
    if not counts:
        return "fp32"
    # ignore the fp32 parameters every export keeps (A_log, D, dt_bias, norms) when a lower one is present
    low = {k: v for k, v in counts.items() if k != "fp32"}
    return max(low, key=low.get) if low else "fp32"


def graph_profile(inputs: dict[str, list[int | str]], role: str, batch: ShapeRange,
                  seq: ShapeRange, past: ShapeRange | None = None) -> dict[str, dict[str, list[int]]]:
    """One optimization profile: input name -> {"min","opt","max": shape}.

    ``batch_size`` takes ``batch``; ``sequence_length`` takes ``seq`` (fixed to 1 in the decode profile);
    ``past_sequence_length`` (KV caches) takes ``past`` (default :func:`past_range` of ``seq``); fixed dims
    stay. The packed prefill graph's axes: ``num_sequences`` takes ``batch`` (``num_sequences + 1``, the
    cu_seqlens length, one more), ``total_tokens`` takes ``seq``. Any other symbolic dim is an error.
    """
    past = past or past_range(seq)
    prof: dict[str, dict[str, list[int]]] = {}
    for name, dims in inputs.items():
        shapes: dict[str, list[int]] = {"min": [], "opt": [], "max": []}
        for d in dims:
            if isinstance(d, int) and d >= 0:  # 0: the conv state of a d_conv 1 mixer (no columns)
                rng = ShapeRange(d, d, d, allow_zero=True)
            elif d == BATCH_SYMBOL:
                rng = batch
            elif d == SEQ_SYMBOL:
                rng = ShapeRange(1, 1, 1) if role == "decode" else seq
            elif d == PAST_SYMBOL:
                rng = past
            elif d == NSEQ:
                rng = batch
            elif d == f"{NSEQ} + 1":
                rng = ShapeRange(batch.min + 1, batch.opt + 1, batch.max + 1)
            elif d == TOKENS:
                rng = seq
            else:
                raise BuildError(f"input {name!r} has dynamic dimension {d!r}; m2export build knows only "
                                 f"{BATCH_SYMBOL!r}, {SEQ_SYMBOL!r} and {PAST_SYMBOL!r}",
                                 hint="export the graph with 'm2export export' (it names the dynamic axes)")
            for k in shapes:
                shapes[k].append(getattr(rng, k))
        prof[name] = shapes
    return prof


def parse_size(text: str) -> int:
    """Bytes from ``4G``, ``512M``, ``1024K``, ``2GiB`` or a plain integer."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if m is None:
        raise UsageError(f"`workspace`: expected e.g. 4G, 512M or a number of bytes, got {text!r}")
    mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * mult)


def check_kernel_support(manifest: Manifest | None) -> None:
    """The cuTile SSD kernel behind the plugin serves every Mamba layer's headdim and d_state.

    Checked before building, from the manifest's model description (Mamba2Config, or the hybrid's ModelSpec:
    each Mamba layer), so an unsupported model fails with a plain message naming the layer and the size
    instead of an exception inside TensorRT's plugin callback (the kernels' own check,
    :func:`m2export.kernels._host.check_supported`, decides).
    """
    if manifest is None or not manifest.config:
        return
    from m2export.contract import SSMScanProblem
    from m2export.errors import ContractError
    from m2export.kernels._host import check_supported
    spec = manifest.model_spec()
    seen = set()
    for i in spec.mamba_layers:
        m = spec.layers[i].mamba
        key = (m.nheads, m.headdim, m.ngroups, m.d_state)
        if key in seen:
            continue
        seen.add(key)
        try:
            check_supported(SSMScanProblem(1, 1, *key))
        except ContractError as e:
            raise BackendUnavailable(
                f"the SSMScan plugin's cuTile kernel cannot run Mamba layer {i}: {e.raw_message}",
                hint="build the std flavour (standard ops, no plugin): m2export export ... --ssm-impl both, then "
                     "m2export build OUTDIR/model.std.onnx") from None


def require_tensorrt():
    """``tensorrt`` for building (no GPU check: :func:`require_gpu` names the device), or BackendUnavailable
    (exit 4) with the install hint; the check is :func:`m2export.backends.tensorrt_unavailable_reason`."""
    return backends.require_tensorrt("build engines", need_gpu=False)


def require_gpu() -> tuple[str, str]:
    """(GPU name, compute capability "9.0") of the build device, or BackendUnavailable."""
    from m2export.plugins import _cuda

    if _cuda.device_count() < 1:
        raise BackendUnavailable("no CUDA GPU found: TensorRT builds engines on the GPU they are for",
                                 hint="run m2export build on the target machine (check nvidia-smi)")
    cc = _cuda.compute_capability()
    return _cuda.device_name(), f"{cc[0]}.{cc[1]}"


def _require_plugin(plugin: str) -> None:
    from m2export import plugins

    try:
        got = plugins.register()
    except BackendUnavailable:
        raise
    except Exception as e:
        raise BackendUnavailable(f"the m2export::SSMScan TensorRT plugin could not be registered: "
                                 f"{type(e).__name__}: {e}", hint="run with -v for the traceback") from e
    if plugin == "aot" and not got.get("aot"):
        import tensorrt as trt

        raise BackendUnavailable(f"TensorRT {trt.__version__} has no AOT Python plugins (tensorrt.plugin.aot_impl)",
                                 hint="use `plugin='jit'`, or install a newer TensorRT")


def trt_profiles(profiles: Sequence[dict]) -> list:
    """Polygraphy ``Profile`` objects for profile dicts (input name -> {"min","opt","max": shape}), in order."""
    from polygraphy.backend.trt import Profile

    out = []
    for profile in profiles:
        prof = Profile()
        for name, s in profile.items():
            prof.add(name, min=s["min"], opt=s["opt"], max=s["max"])
        out.append(prof)
    return out


def build_engine_bytes(target: BuildTarget, *, plugin_mode: str | None, profiles: Sequence[dict],
                       workspace: int | None, opt_level: int | None, timing_cache: Path | None) -> bytes:
    """Serialized engine of one graph with one optimization profile per role (Polygraphy's CreateConfig +
    EngineBytesFromNetwork)."""
    import tensorrt as trt
    from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork

    from m2export.trt.loader import NetworkFromOnnxPathWithPlugin

    config = CreateConfig(
        profiles=trt_profiles(profiles),
        load_timing_cache=str(timing_cache) if timing_cache is not None and timing_cache.is_file() else None,
        builder_optimization_level=opt_level,
        memory_pool_limits={trt.MemoryPoolType.WORKSPACE: workspace} if workspace else None,
    )
    from polygraphy.exception import PolygraphyException

    from m2export.plugins.ssm_scan_trt import take_plugin_errors

    network = NetworkFromOnnxPathWithPlugin(target.onnx, plugin_mode=plugin_mode,
                                            input_shapes=pinned_input_shapes(onnx_inputs(target.onnx), target.roles))
    t0 = time.perf_counter()
    take_plugin_errors()
    try:
        engine = EngineBytesFromNetwork(network, config=config,
                                        save_timing_cache=str(timing_cache) if timing_cache is not None else None)()
    except PolygraphyException as e:
        engine, failure = None, str(e)
    else:
        failure = "no engine returned"
    if engine is None:
        errors = take_plugin_errors()
        if errors and isinstance(errors[0], M2ExportError):
            raise errors[0]
        cause = f" (the SSMScan plugin raised {type(errors[0]).__name__}: {errors[0]})" if errors else ""
        raise BuildError(f"TensorRT failed to build an engine from {target.onnx}: {failure}{cause}",
                         hint="rerun with -v for TensorRT's log")
    log.info("built %s engine from %s in %.1fs (%.1f MB)", target.role, target.onnx.name,
             time.perf_counter() - t0, len(engine) / 1e6)
    return bytes(engine)


def build_engines(path: str | Path, *, plugin: str = "jit", batch: ShapeRange = DEFAULT_BATCH,
                  seq: ShapeRange = DEFAULT_SEQ, roles: Sequence[str] = ("prefill", "decode"),
                  workspace: int | None = None, opt_level: int | None = None,
                  timing_cache: str | Path | None | bool = True,
                  aot_ptx_isa: tuple[int, int] | None = None) -> BuildResult:
    """Build TensorRT engines for the graphs of ``path`` (an OUTDIR or one ``.onnx`` file).

    Args:
        path: OUTDIR written by ``m2export export`` (its primary model.onnx), or one .onnx.
        plugin: "jit" (the plugin calls the cuTile kernel from Python at run time: the runtime needs
            Python, torch, cuda.tile and ``import m2export.plugins``) or "aot" (the PTX is embedded in the
            engine: any TensorRT runtime, trtexec and C++ included, runs it without Python).
        batch, seq: the optimization profile of ``batch_size`` and ``sequence_length`` (seq is 1 in decode).
        roles: which graphs of an OUTDIR to build.
        workspace: builder workspace limit in bytes (None: TensorRT's default, the device memory).
        opt_level: builder optimization level 0..5 (None: TensorRT's default, 3).
        timing_cache: True (the cache m2export.json records from the last build while it exists, else
            OUTDIR/.timing.cache; reused and updated), a path (created if need be; recorded in m2export.json, so that
            the next build reuses it), or None/False (none). Replaced whole once every engine has built.
        aot_ptx_isa: explicit PTX ISA for the AOT kernel's header (see ``m2export build --aot-ptx-isa``).

    Returns:
        BuildResult: the written engines (also recorded in ``m2export.json`` when the folder has one).

    Raises:
        BackendUnavailable: no TensorRT (with the install command), no GPU, no plugin, no AOT support.
        UsageError: a bad ``plugin`` or ``opt_level``.
        ExportFolderError: a bad path or a missing graph.
        BuildError: an unparsable graph (naming the failing node), an engine build failure.
    """
    if plugin not in ("jit", "aot"):
        raise UsageError(f"`plugin`: expected 'jit' or 'aot', got {plugin!r}")
    if opt_level is not None and not 0 <= opt_level <= 5:
        raise UsageError(f"`opt_level`: expected 0..5, got {opt_level}")
    outdir, manifest, targets = resolve_targets(path, roles)
    if plugin == "aot" and any(t.roles == (PACKED_ROLE,) for t in targets):
        # SSMScanPacked has a JIT implementation only: say so rather than build it in another mode
        log.warning("build: %s not built: the SSMScanPacked plugin has no AOT implementation; build it with "
                    "`--plugin jit`", ", ".join(t.onnx.name for t in targets if t.roles == (PACKED_ROLE,)))
        targets = [t for t in targets if t.roles != (PACKED_ROLE,)]
    _refuse_unlisted_engines(outdir, manifest, targets)  # before the build; again before the engines are written
    profiles = {t.onnx: [graph_profile(onnx_inputs(t.onnx), r, batch, seq) for r in t.roles] for t in targets}
    from m2export.trt.loader import count_ssm_scan_nodes

    uses_plugin = {t.onnx: count_ssm_scan_nodes(t.onnx) > 0 for t in targets}
    cache = _timing_cache(timing_cache, outdir, manifest)

    trt = require_tensorrt()
    gpu, cc = require_gpu()
    if any(uses_plugin.values()):
        check_kernel_support(manifest)
        _require_plugin(plugin)
        from m2export.plugins import ssm_scan_trt

        ssm_scan_trt.configure_aot(ptx_isa=aot_ptx_isa)

    built: list[tuple[BuildTarget, bytes, EngineEntry]] = []
    with _private_copy(cache) as work_cache:  # the cache is replaced whole once every engine has built
        for t in targets:
            mode = plugin if uses_plugin[t.onnx] else None
            engine = build_engine_bytes(t, plugin_mode=mode, profiles=profiles[t.onnx], workspace=workspace,
                                        opt_level=opt_level, timing_cache=work_cache)
            precision = manifest.dtype if manifest is not None else onnx_precision(t.onnx)
            built.append((t, engine, EngineEntry(
                role=t.role, file=t.plan.name, onnx_file=t.onnx.name, tensorrt_version=str(trt.__version__), gpu=gpu,
                compute_capability=cc, plugin_mode=mode or "none", profiles=profiles[t.onnx], precision=precision,
                profile_roles=list(t.roles))))

        result = BuildResult(outdir)
        _refuse_unlisted_engines(outdir, manifest, targets)
        for t, engine, entry in built:
            with atomic_file(t.plan) as tmp:
                tmp.write_bytes(engine)
            result.engines.append(entry)
            log.info("wrote %s", t.plan)
        if work_cache is not None and work_cache.is_file():
            os.replace(work_cache, cache)
    if manifest is not None:
        files_built = {e.file for e in result.engines}
        manifest.engines = [e for e in manifest.engines if e.file not in files_built] + result.engines
        if cache is not None and cache.is_file():
            inside = cache.resolve().parent == outdir.resolve()
            manifest.timing_cache = cache.name if inside else str(cache.resolve())  # the next build reuses it
            if inside and cache.name == TIMING_CACHE_FILE:  # ours: `export --force` may replace it
                manifest.files = {**manifest.files, **aux_record(outdir, [TIMING_CACHE_FILE])}
        write_manifest(outdir, manifest)
        result.manifest_updated = True
    return result


def _refuse_unlisted_engines(outdir: Path, manifest: Manifest | None, targets: Sequence[BuildTarget]) -> None:
    """An engine file of OUTDIR that m2export.json does not list (a user's own model.plan, one copied in from
    elsewhere) is never replaced: OutputFolderError, in export --force's words (a lone .onnx without a manifest has
    no record to tell: its engine is replaced as before)."""
    if manifest is None:
        return
    listed = {e.file for e in manifest.engines}
    refuse_unowned(outdir, [t.plan.name for t in targets if t.plan.name not in listed], writer="build",
                   what="engines", hint="move it away (m2export.json does not list it), or build in a copy of the folder")


def _timing_cache(timing_cache: str | Path | None | bool, outdir: Path, manifest: Manifest | None) -> Path | None:
    """The timing cache of a build: ``timing_cache`` True is the one the manifest records from the last build (a
    ``--timing-cache`` elsewhere) while it exists, else OUTDIR/.timing.cache; a path is that file; None/False none."""
    if timing_cache is True:
        recorded = manifest.timing_cache_path(outdir) if manifest is not None else None
        return recorded if recorded is not None and recorded.is_file() else outdir / TIMING_CACHE_FILE
    return Path(timing_cache) if timing_cache else None


@contextlib.contextmanager
def _private_copy(cache: Path | None):
    """A copy of ``cache`` (if it exists) in a new private folder beside it, for the builder to read and update:
    Polygraphy rewrites the file it saves to in place and leaves ``<file>.lock`` beside it, so the real cache is
    replaced whole (``os.replace``, by the caller) only once every engine has built, and no lock file lands in OUTDIR
    or the user's folder. The private folder is removed on the way out. Yields None for no cache.

    Raises:
        OutputFolderError: the cache's folder cannot be created or written (the OS's reason named).
    """
    import shutil
    import tempfile

    from m2export.errors import OutputFolderError

    if cache is None:
        yield None
        return
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".m2export-timing-", dir=cache.parent))
        if cache.is_file():
            shutil.copy2(cache, work / cache.name)
    except OSError as e:
        raise OutputFolderError(f"`timing_cache` {cache}: cannot write there ({e.strerror or e})",
                                hint="pass a writable path as `timing_cache`") from None
    try:
        yield work / cache.name
    finally:
        shutil.rmtree(work, ignore_errors=True)


def trtexec_command(outdir: str | Path, role: str = "prefill", *, batch: int = 1, seq: int = 128) -> str:
    """A ``trtexec --loadEngine`` command running OUTDIR's engine on its ``role`` profile at (batch, seq).

    Every dynamic input needs a shape (``input_ids`` and each layer's states share ``batch_size``; KV caches
    get past_sequence_length ``seq`` in decode, 0 in prefill). Only AOT engines run in trtexec: a JIT engine
    calls back into Python, which trtexec does not have.
    """
    outdir = Path(outdir)
    manifest = read_manifest(outdir, consistent=False)
    engine = manifest.engine(role)
    if engine is None:
        raise ExportFolderError(f"{outdir}: no {role} engine in {MANIFEST_FILE}", hint=f"run 'm2export build {outdir}'")
    if engine.plugin_mode == "jit":
        raise BuildError(f"{outdir / engine.file} was built with the JIT plugin: trtexec cannot run it "
                         "(the plugin calls back into Python)", hint="rebuild it with `plugin='aot'`")
    g = next(g for g in manifest.graphs if g.file == engine.onnx_file)
    axes = {BATCH_SYMBOL: batch, SEQ_SYMBOL: 1 if role == "decode" else seq,
            PAST_SYMBOL: seq if role == "decode" else 0}
    shapes = []
    for name, dims in onnx_inputs(outdir / g.file).items():
        concrete = [axes.get(d, d) for d in dims]
        shapes.append(f"{name}:{'x'.join(str(d) for d in concrete)}")
    profile = f" --profile={engine.profile_index(role)}" if len(engine.profile_roles) > 1 else ""
    return f"trtexec --loadEngine={outdir / engine.file}{profile} --shapes={','.join(shapes)}"


def load_engine(plan: str | Path, *, register_plugin: bool = True) -> Any:
    """Deserialize ``plan`` (registering the SSMScan plugin first, which JIT engines need)."""
    trt = backends.require_tensorrt("load a TensorRT engine", need_gpu=False)
    if register_plugin:
        from m2export import plugins

        plugins.register()
    from polygraphy.backend.trt import util as trt_util

    runtime = trt.Runtime(trt_util.get_trt_logger())
    engine = runtime.deserialize_cuda_engine(Path(plan).read_bytes())
    if engine is None:
        raise RuntimeLoadError(f"{plan}: TensorRT could not deserialize the engine",
                               hint="engines are specific to the TensorRT version and GPU they were built with")
    return engine
