"""``m2export.json``: what an export (and later ``build``) wrote into OUTDIR.

The manifest is the one source of truth about an output folder; ``check``, ``generate``,
``inspect`` and ``build`` read it with :func:`read_manifest` and find graphs with
:meth:`Manifest.graph`. Layout of OUTDIR::

    m2export.json            this manifest
    model.onnx               primary flavour (``ssm_impl`` of the export; ssmscan by default): one graph for
                             prefill and decode (sequence_length 1 is a decode step)
    model.std.onnx           the std (standard-op) flavour beside the primary one (--ssm-impl both/all; a std-only
                             export names its graph model.onnx)
    model.native.onnx        the native flavour (ONNX Runtime's own kernels) beside the primary one (--ssm-impl
                             all; a native-only export names its graph model.onnx)
    model.onnx.data          the weights, once, referenced by every graph of the folder (external data)
    genai_config.json        onnxruntime-genai's config (+ the checkpoint's tokenizer files, when it has them)
    model.plan               TensorRT engine written by ``m2export build``: one engine, one optimization
                             profile per role (prefill, decode) (+ .timing.cache)
    check_report.json ...    ``m2export check``'s reports (:data:`CHECK_REPORT_FILES`)

Graph flavours are named as in :mod:`m2export.names`; a manifest written with the old names
(``plugin``/``onnx``) is read with the new ones. :func:`foreign_reason` tells a folder m2export wrote
(``export --force`` may replace it) from any other; the manifest's ``files`` records the sha256 of each auxiliary
file (genai_config.json, tokenizer copies, check reports, .timing.cache) as m2export wrote it, so that a user's
file of the same name, or one edited since, is never taken for m2export's. Version 1 folders (separate decode.onnx graphs, weights
stored in every graph) are refused with a re-export hint.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from m2export._paths import loads_json, name_listing
from m2export.errors import ExportFolderError, OutputFolderError
from m2export.exporter.configs import MANIFEST_FILE, SSM_IMPLS, TIMING_CACHE_FILE
from m2export.exporter.genai import GENAI_CONFIG_FILE, TOKENIZER_FILES
from m2export.models.config import Mamba2Config
from m2export.names import canonical

MANIFEST_VERSION = 2
ROLES = ("prefill", "decode")
#: what ``m2export check`` writes into OUTDIR: report JSON, report markdown, error histogram, data-loader script,
#: saved inputs and reference outputs (m2export/check/repro.py)
CHECK_REPORT_FILES = ("check_report.json", "check_report.md", "check_errors.png", "check_data_loader.py",
                      "check_inputs.json", "check_reference_outputs.json")
#: the auxiliary files m2export writes into OUTDIR (besides its manifest and the graph, weight and engine files the
#: manifest lists): export's genai_config.json and
#: tokenizer copies, check's reports, build's timing cache. Each is recorded with its sha256 in the manifest's
#: ``files`` when written (:func:`record_files`); ``export --force`` replaces one only while its content is that.
AUX_FILES = (TIMING_CACHE_FILE, *CHECK_REPORT_FILES, GENAI_CONFIG_FILE, *TOKENIZER_FILES)


def _has_role(entry_role: str, role: str) -> bool:
    """A graph/engine entry's role is "prefill", "decode" or both joined by "+" (one graph serving both)."""
    return role in entry_role.split("+")


@dataclass
class GraphEntry:
    """One ONNX graph: ``role`` "prefill+decode" (one graph serves both), ``ssm_impl`` (the flavour) ssmscan|std|native,
    ``file`` relative to OUTDIR, ``external_data``: the weight files it references (``model.onnx.data``, shared),
    ``inputs``/``outputs``: name -> {"dtype": str, "shape": [int | symbol]}; ``states``: per-layer state
    pairs {"layer", "kind", "past", "present", "layout"} (``layout``: the state's axis names in this graph's
    order, :data:`~m2export.exporter.configs.STATE_LAYOUTS`; the JSON form of
    :class:`~m2export.exporter.configs.GraphIO`, read back with :meth:`io`)."""

    role: str
    ssm_impl: str
    file: str
    inputs: dict[str, dict[str, Any]]
    outputs: dict[str, dict[str, Any]]
    external_data: list[str] = field(default_factory=list)
    states: list[dict[str, Any]] = field(default_factory=list)

    def io(self):
        """This graph's :class:`~m2export.exporter.configs.GraphIO`."""
        from m2export.exporter.configs import GraphIO

        return GraphIO.from_manifest(self.inputs, self.outputs, self.states)

    def serves(self, role: str) -> bool:
        """True if this graph serves ``role`` ("prefill" or "decode")."""
        return _has_role(self.role, role)


@dataclass
class EngineEntry:
    """One TensorRT engine written by ``m2export build``: ``profiles[k]`` is the optimization profile for
    ``profile_roles[k]`` (one engine, one profile per role: the weights are in it once)."""

    role: str
    file: str
    onnx_file: str
    tensorrt_version: str
    gpu: str
    compute_capability: str
    plugin_mode: str  # jit | aot
    profiles: list[dict[str, Any]]
    precision: str
    profile_roles: list[str] = field(default_factory=lambda: ["prefill"])

    def profile_index(self, role: str) -> int:
        """Index of the optimization profile that serves ``role``."""
        return self.profile_roles.index(role) if role in self.profile_roles else 0

    def serves(self, role: str) -> bool:
        """True if this engine has a profile for ``role`` ("prefill" or "decode")."""
        return _has_role(self.role, role)

    def profile(self, role: str) -> dict[str, Any]:
        return self.profiles[self.profile_index(role)] if self.profiles else {}


@dataclass
class Manifest:
    source_checkpoint: str
    checkpoint_format: str
    checkpoint_sha256: str
    config: dict[str, Any]
    dtype: str  # fp32 | fp16 | bf16
    opset: int
    graphs: list[GraphEntry]
    tool_versions: dict[str, str]
    engines: list[EngineEntry] = field(default_factory=list)
    manifest_version: int = MANIFEST_VERSION
    #: tokenizer files copied from the checkpoint folder (genai.TOKENIZER_FILES that were there)
    tokenizer: list[str] = field(default_factory=list)
    #: the auxiliary files (:data:`AUX_FILES`) m2export wrote into OUTDIR: name -> sha256 (hex) of the content it
    #: wrote, so that ``export --force`` never deletes a user's file of the same name (:func:`foreign_reason`)
    files: dict[str, str] = field(default_factory=dict)
    #: the TensorRT timing cache the last ``m2export build`` reused and updated, which the next build reuses by
    #: default: a file name in OUTDIR (``.timing.cache``, recorded in ``files`` too; or a ``--timing-cache`` given
    #: there under another name, the user's) or the absolute path of a ``--timing-cache`` outside OUTDIR (never
    #: touched by ``export --force``, which replaces OUTDIR only); "" before any build with one
    timing_cache: str = ""
    #: the export was made with ``--allow-non-finite-weights`` (NaN/Inf weights, or beyond the fp16/bf16 range,
    #: accepted): ``check`` and ``generate --runtime torch`` load the reference checkpoint the same way, so the
    #: comparison shows what the weights do instead of refusing the export's own checkpoint
    allow_nonfinite: bool = False

    def timing_cache_path(self, outdir: str | Path) -> Path | None:
        """The recorded :attr:`timing_cache` as a path (None when none is recorded)."""
        return (Path(outdir) / self.timing_cache) if self.timing_cache else None

    def model_config(self):
        """The model description: a :class:`Mamba2Config` (mamba_ssm / HF Mamba-2 exports) or, for a hybrid
        family (``checkpoint_format`` nemotron_h, granitemoehybrid, bamba), the
        :class:`~m2export.models.spec.ModelSpec` read again from the recorded config.json."""
        from m2export.models.families import READERS

        if self.checkpoint_format in READERS:
            return READERS[self.checkpoint_format](dict(self.config), MANIFEST_FILE)
        c = dict(self.config)
        lim = c.get("dt_limit")
        if isinstance(lim, list) and len(lim) == 2:  # written as [min, max] with "inf" for an unbounded max
            c["dt_limit"] = tuple(math.inf if v == "inf" else v for v in lim)
        return Mamba2Config(**c)  # every field's type and range checked there (ConfigError naming it)

    def model_spec(self):
        """The model as a layer stack (:class:`~m2export.models.spec.ModelSpec`), for Mamba-2 and hybrid exports alike."""
        from m2export.models.spec import ModelSpec

        cfg = self.model_config()
        return cfg if isinstance(cfg, ModelSpec) else cfg.to_spec()

    def graph(self, role: str, ssm_impl: str | None = None) -> GraphEntry:
        """The graph of ``role``; ``ssm_impl`` None means the primary one (model.onnx)."""
        ssm_impl = canonical("flavour", ssm_impl)
        for g in self.graphs:
            if _has_role(g.role, role) and (ssm_impl is None or g.ssm_impl == ssm_impl):
                return g
        have = ", ".join(f"{g.role} {g.ssm_impl}" for g in self.graphs) or "no graphs"
        raise ExportFolderError(f"{MANIFEST_FILE}: no {role} graph" + (f" with ssm_impl={ssm_impl}" if ssm_impl else "")
                                + f"; the export has: {have}",
                                hint=f"re-export with that flavour (`ssm_impl='{ssm_impl}'`, or 'all' for every flavour)"
                                if ssm_impl else "re-export the checkpoint into this folder")

    def ssm_impls(self) -> list[str]:
        """The flavours of the prefill graph (sorted): the packed prefill graph, whose entry says ssmscan whatever
        the export's flavours are, is none of them."""
        return sorted({g.ssm_impl for g in self.graphs if _has_role(g.role, "prefill")})

    def engine(self, role: str) -> EngineEntry | None:
        """The engine serving ``role``: one built for that role alone (e.g. ``model.decode.plan``) first,
        else one with a profile for it (``model.plan``, prefill + decode), else None."""
        own = [e for e in self.engines if e.role == role]
        return own[0] if own else next((e for e in self.engines if _has_role(e.role, role)), None)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str | Path = MANIFEST_FILE) -> "Manifest":
        """The manifest of the JSON object ``d`` (read from ``source``, named in errors).

        Raises:
            ExportFolderError: ``manifest_version`` is not an integer, is 1 (two graphs, weights twice: it must be
                re-exported) or newer than :data:`MANIFEST_VERSION`; ``opset`` is not an integer >= MIN_OPSET.
            ValueError, TypeError, KeyError: another malformed field (:func:`read_manifest` names the file).
        """
        from m2export.exporter.configs import MIN_OPSET

        d = dict(d)
        if "manifest_version" not in d:  # every m2export manifest, version 1 included, records it
            raise ValueError("no 'manifest_version' field")
        version = d["manifest_version"]
        if not _is_int(version):
            raise ExportFolderError(f"{source}: 'manifest_version': expected the integer {MANIFEST_VERSION}, got "
                                    f"{version!r}", hint=REEXPORT_HINT)
        if version < MANIFEST_VERSION:
            raise ExportFolderError(f"{source}: written by an older m2export (manifest version "
                                    f"{version}: separate prefill/decode graphs, weights stored "
                                    "in each); this version runs one graph with the weights stored once",
                                    hint=REEXPORT_HINT)
        if version > MANIFEST_VERSION:
            raise ExportFolderError(f"{source}: 'manifest_version': {version} is newer than this m2export reads "
                                    f"(expected {MANIFEST_VERSION})",
                                    hint="use the m2export that wrote it (upgrade), or " + REEXPORT_HINT)
        opset = d.get("opset")
        if not _is_int(opset) or opset < MIN_OPSET:
            raise ExportFolderError(f"{source}: 'opset': expected an integer >= {MIN_OPSET}, got {opset!r}",
                                    hint=REEXPORT_HINT)
        d["graphs"] = [GraphEntry(**g) for g in d.get("graphs", [])]
        for g in d["graphs"]:  # manifests from before the names of m2export/names.py
            g.ssm_impl = canonical("flavour", g.ssm_impl, warn=False)
        d["engines"] = [EngineEntry(**e) for e in d.get("engines", [])]
        for i, g in enumerate(d["graphs"]):
            if not isinstance(g.external_data, list):
                raise ValueError(f"graph {i}: 'external_data' {g.external_data!r} is not a list of file names")
            for name in (g.file, *g.external_data):
                _file_name(name, f"graph {i}")
        for i, e in enumerate(d["engines"]):
            for name in (e.file, e.onnx_file):
                _file_name(name, f"engine {i}")
        _check_files_record(d.get("files", {}))
        cache = d.get("timing_cache", "")
        if not isinstance(cache, str):
            raise ValueError(f"'timing_cache' {cache!r} is not a path")
        if cache and not Path(cache).is_absolute():
            _file_name(cache, "'timing_cache'")
        if not isinstance(d.get("allow_nonfinite", False), bool):
            raise ValueError(f"'allow_nonfinite' {d['allow_nonfinite']!r} is not true or false")
        return cls(**d)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_files_record(files) -> None:
    """``files`` is {name in :data:`AUX_FILES`: 64 hex digits} (ValueError otherwise)."""
    if not isinstance(files, dict):
        raise ValueError(f"'files' {files!r} is not an object of file name -> sha256")
    for name, digest in files.items():
        if name not in AUX_FILES:
            raise ValueError(f"'files': {name!r} is not an auxiliary file m2export writes ({', '.join(AUX_FILES)})")
        if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
            raise ValueError(f"'files': {name!r}: {digest!r} is not a sha256 (64 lowercase hex digits)")


def file_sha256(path: str | Path) -> str:
    """The sha256 (hex) of the file ``path``. Raises OSError."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def aux_record(outdir: str | Path, names) -> dict[str, str]:
    """{name: sha256} of each ``names`` file in OUTDIR (the ``files`` entries for what m2export just wrote)."""
    return {n: file_sha256(Path(outdir) / n) for n in names}


def record_files(outdir: str | Path, names) -> None:
    """Record OUTDIR's ``names`` (auxiliary files m2export has just written there) with their sha256 in the
    manifest's ``files``; the manifest is otherwise kept as it is (read as JSON, rewritten atomically). A folder
    without a readable manifest is left alone (nothing to record in). Raises OSError."""
    from m2export._paths import atomic_write_text

    f = Path(outdir) / MANIFEST_FILE
    try:
        raw = loads_json(f.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(raw, dict):
        return
    files = raw.get("files") if isinstance(raw.get("files"), dict) else {}
    raw["files"] = {**files, **aux_record(outdir, names)}
    atomic_write_text(f, json.dumps(raw, indent=2, default=str) + "\n")


def _file_name(name, what: str) -> None:
    """Refuse (ValueError) a file name of the manifest that is not a plain name of a file in OUTDIR (m2export
    writes every graph, weight and engine file there): ``None``, a path such as ``../x`` or ``/etc/passwd``."""
    if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name or "\\" in name:
        raise ValueError(f"{what}: file {name!r} is not the name of a file in the output folder")


#: the remedy for a damaged or incomplete export folder
REEXPORT_HINT = "re-export with 'm2export export CHECKPOINT -o OUTDIR --force'"
#: the remedy when the manifest itself is unreadable: nothing then shows m2export wrote the folder, so --force
#: alone refuses it (:func:`foreign_reason`)
DAMAGED_MANIFEST_HINT = ("look at what OUTDIR holds, then re-export with 'm2export export CHECKPOINT -o OUTDIR --force "
                         "--force-foreign' (a damaged manifest no longer shows that m2export wrote the folder)")


def read_manifest(outdir: str | Path, *, consistent: bool = True) -> Manifest:
    """Read OUTDIR/m2export.json.

    Args:
        consistent: also check that ``config`` describes a model and every graph entry records that model's
            inputs/outputs in ``dtype`` (:func:`_check_consistent`); ``m2export build``, which only needs the
            graph files and tolerates a manifest without a model config, passes False.
    Raises:
        ExportFolderError: OUTDIR or the manifest is missing, malformed or (``consistent``) inconsistent
            (named, with a hint to run export).
    """
    d = Path(outdir)
    if not d.is_dir():
        raise ExportFolderError(f"{d}: {'not a directory' if os.path.lexists(d) else 'does not exist'}",
                                hint="pass the OUTDIR written by 'm2export export'")
    f = d / MANIFEST_FILE
    if not f.is_file():
        raise ExportFolderError(f"{f}: missing; {d} is not an m2export output folder",
                                hint="create one with 'm2export export CHECKPOINT -o OUTDIR'")
    try:
        raw = loads_json(f.read_text())
        if not isinstance(raw, dict):
            raise ValueError(f"expected a JSON object, got {type(raw).__name__}")
        m = Manifest.from_dict(raw, source=f)
    except (ValueError, TypeError, KeyError) as e:
        raise ExportFolderError(f"{f}: malformed manifest ({type(e).__name__}: {e})",
                                hint=DAMAGED_MANIFEST_HINT) from None
    if consistent:
        _check_consistent(m, f)
    return m


def _check_consistent(m: Manifest, f: Path) -> None:
    """The manifest agrees with itself: ``config`` describes a model, ``dtype`` is a known label, and every
    graph entry records the inputs/outputs (names, dtypes) of that model exported in that dtype
    (:meth:`GraphIO.for_model`). A hand-edited or damaged m2export.json (``config: null``, no ``d_model``,
    ``dt_limit: "abc"``, ``n_layer`` or ``dtype`` changed) is one ExportFolderError naming the field.
    """
    from m2export.errors import M2ExportError
    from m2export.exporter.configs import DTYPES, GraphIO

    if not isinstance(m.config, dict):
        raise ExportFolderError(f"{f}: 'config': expected an object, got {m.config!r}", hint=REEXPORT_HINT)
    if m.dtype not in DTYPES:
        raise ExportFolderError(f"{f}: 'dtype': expected one of {list(DTYPES)}, got {m.dtype!r}", hint=REEXPORT_HINT)
    try:
        cfg = m.model_config()
    except M2ExportError as e:
        raise ExportFolderError(f"{f}: 'config' describes no model: {e.raw_message}", hint=REEXPORT_HINT) from None
    except (TypeError, ValueError, KeyError) as e:  # a field missing or unknown (Mamba2Config's TypeError)
        raise ExportFolderError(f"{f}: 'config' describes no model: {e}", hint=REEXPORT_HINT) from None
    from m2export.exporter.packed import PACKED_ROLE, packed_io

    for g in m.graphs:
        regular = GraphIO.for_model(cfg, m.dtype, flavour=g.ssm_impl if g.ssm_impl in SSM_IMPLS else None)
        want = packed_io(regular) if g.role == PACKED_ROLE else regular
        _check_layouts(g, want, f)
        for kind, expected, got in (("input", want.inputs, g.inputs), ("output", want.outputs, g.outputs)):
            exp = {t.name: t.dtype for t in expected}
            rec = {k: (v.get("dtype") if isinstance(v, dict) else None) for k, v in (got or {}).items()}
            if exp != rec:
                missing, extra = sorted(set(exp) - set(rec)), sorted(set(rec) - set(exp))
                typed = sorted(k for k in set(exp) & set(rec) if exp[k] != rec[k])
                what = "; ".join(x for x in (
                    f"lacks {missing}" if missing else "", f"has unexpected {extra}" if extra else "",
                    ", ".join(f"{k!r} is {rec[k]}, expected {exp[k]}" for k in typed)) if x)
                raise ExportFolderError(f"{f}: graph {g.file}'s recorded {kind}s disagree with 'config' "
                                        f"(n_layer etc.) and 'dtype' {m.dtype!r}: {what}", hint=REEXPORT_HINT)


def _check_layouts(g: GraphEntry, want, f: Path) -> None:
    """Every state of ``g`` recorded with a ``layout`` that orders its kind's axes (:data:`STATE_AXES`) and a past
    shape that is the model's state shape in that order (``want``: the model's GraphIO for this flavour; an entry
    written before the layout field has the model's layout, as its graph then had)."""
    from m2export.exporter.configs import STATE_AXES

    model = {s.past.name: s for s in want.states}
    for st in g.states if isinstance(g.states, list) else []:
        name, layout = (st.get("past"), st.get("layout")) if isinstance(st, dict) else (None, None)
        w = model.get(name)
        if w is None or layout is None:
            continue  # names are checked below
        axes = STATE_AXES.get(w.kind)
        if axes is None or not isinstance(layout, list) or sorted(map(str, layout)) != sorted(axes):
            raise ExportFolderError(f"{f}: graph {g.file}'s state {name}: 'layout' {layout!r} does not order the "
                                    f"axes {list(axes or [])}", hint=REEXPORT_HINT)
        shape = [w.past.shape[w.layout.index(a)] if w.layout else None for a in layout]
        rec = (g.inputs.get(name) or {}).get("shape") if isinstance(g.inputs, dict) else None
        if rec is not None and list(rec) != shape:
            raise ExportFolderError(f"{f}: graph {g.file}'s input {name}: shape {rec} is not the state in its "
                                    f"recorded layout {layout} ({shape})", hint=REEXPORT_HINT)


def write_manifest(outdir: str | Path, manifest: Manifest) -> Path:
    """Write OUTDIR/m2export.json atomically (temp file + fsync + rename). Raises OSError."""
    from m2export._paths import atomic_write_text

    return atomic_write_text(Path(outdir) / MANIFEST_FILE, manifest.to_json())


def foreign_reason(folder: str | Path) -> str | None:
    """None if ``folder`` is an m2export output folder holding only what m2export writes, else why not.

    m2export's: a readable manifest (``manifest_version`` and ``graphs``), and every entry is one of the graph,
    external-data and engine files its ``graphs`` and ``engines`` list, or an auxiliary file (:data:`AUX_FILES`)
    whose content is the one the manifest's ``files`` records. A name alone makes nothing m2export's: a user's own
    ``check_report.md``, ``tokenizer.json``, ``model.plan`` or ``model.std.onnx`` that the manifest does not list (or
    records with other content) is not. The listed graphs, weights and engines are taken by name (not hashed: that
    would read gigabytes of weights on every ``--force``).
    """
    d = Path(folder)
    if (d / MANIFEST_FILE).is_file() and not (d / MANIFEST_FILE).is_symlink():
        damaged = (f"its {MANIFEST_FILE} is damaged (unreadable, or without 'manifest_version' and 'graphs'): "
                   "nothing shows m2export wrote it")
    else:
        damaged = f"has no m2export manifest ({MANIFEST_FILE}): m2export did not write it"
        if (d / "config.json").is_file() and (d / "model.safetensors").is_file():
            damaged = (f"is a checkpoint folder (config.json + model.safetensors, no {MANIFEST_FILE}), not an m2export "
                       "export")
    try:
        raw = loads_json((d / MANIFEST_FILE).read_text())
        ok = isinstance(raw, dict) and "manifest_version" in raw and isinstance(raw.get("graphs"), list)
    except (OSError, ValueError):
        ok = False
    if not ok:
        return damaged
    listed = {MANIFEST_FILE}  # and what its graph and engine entries name; nothing by its name alone
    for g in raw["graphs"] + list(raw.get("engines") or []):
        if isinstance(g, dict):
            listed |= {str(g.get("file"))} | {str(x) for x in g.get("external_data") or []}
    return _unowned_reason(d, raw, [p.name for p in d.iterdir()
                                    if p.name not in listed and not p.name.startswith(".m2export")])


def _unowned_reason(d: Path, raw: dict, names) -> str | None:
    """Why the entries ``names`` of folder ``d`` are not all m2export's by the manifest ``raw`` (None if they are):
    an auxiliary file (:data:`AUX_FILES`) is m2export's only while its content has the sha256 ``raw['files']``
    records for it; any other name is not (the caller leaves out the graph, weight and engine files it owns)."""
    recorded = raw.get("files") if isinstance(raw.get("files"), dict) else {}
    other, changed = [], []
    for name in sorted(names):
        p = d / name
        if name in AUX_FILES and name in recorded:
            try:
                same = p.is_file() and not p.is_symlink() and file_sha256(p) == recorded[name]
            except OSError:
                same = False
            if not same:
                changed.append(name)
        else:
            other.append(name)

    why = []
    if other:
        why.append(f"holds file(s) m2export did not write ({name_listing(other)})"
                   + (f" (its {MANIFEST_FILE}, from an older m2export, records none of the auxiliary files it wrote)"
                      if "files" not in raw and set(other) & set(AUX_FILES) else ""))
    if changed:
        why.append(f"holds file(s) changed since m2export wrote them ({name_listing(changed)})")
    return "; ".join(why) or None


def refuse_unowned(outdir: str | Path, names, *, writer: str, what: str, hint: str) -> None:
    """Before m2export replaces any of the files ``names`` in OUTDIR (``check``'s reports, ``build``'s engines not
    listed in the manifest): each one there must be m2export's by the rule of ``export --force``
    (:func:`foreign_reason`: an auxiliary file whose content is the one the manifest's ``files`` records; any other
    name the caller passes is not), so that a user's file of that name, or one edited since m2export wrote it, is
    never destroyed.

    Raises:
        OutputFolderError: one is not (exit 1): ``OUTDIR: holds file(s) m2export did not write (...); WRITER replaces
            only the WHAT it wrote``, with ``hint``.
    """
    d = Path(outdir)
    present = [n for n in names if os.path.lexists(d / n)]
    if not present:
        return
    try:
        raw = loads_json((d / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        raw = {}
    why = _unowned_reason(d, raw if isinstance(raw, dict) else {}, present)
    if why:
        raise OutputFolderError(f"{d}: {why}; {writer} replaces only the {what} it wrote", hint=hint)
