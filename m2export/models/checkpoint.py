"""Loading and saving Mamba-2 checkpoints (two formats) and hybrid checkpoints (HF families).

* ``mamba_ssm``: state-spaces/mamba ``MambaLMHeadModel.save_pretrained`` — ``config.json`` with
  ``d_model, n_layer, vocab_size, ssm_cfg{...}``; tensors ``backbone.embedding.weight``,
  ``backbone.layers.N.{norm,mixer.*}``, ``backbone.norm_f.weight``, ``lm_head.weight``.
* ``hf``: HF transformers ``Mamba2ForCausalLM`` — ``config.json`` of ``Mamba2Config``; tensors
  ``backbone.embeddings.weight`` (plural), otherwise the same names.

* HF hybrids: ``nemotron_h``, ``granitemoehybrid``, ``bamba``, ``falcon_h1``, ``zamba2`` (config readers in
  :mod:`m2export.models.families`, tensor names in :mod:`m2export.models.weights`).

Weights come from ``model.safetensors`` (preferred), a sharded ``model.safetensors.index.json``,
or ``pytorch_model.bin``. The format/family is detected from ``config.json``
(:func:`m2export.models.families.detect_family`); HF's ``{"__float__": "Infinity"}`` is read as inf.
Every declared tensor shape is checked against the weight files' headers before the model is built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pickle
import re
import stat
import struct
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from m2export import _paths
from m2export.errors import CheckpointError, ConfigError, InternalError
from m2export.models.config import PRESETS, Mamba2Config
from m2export.models.families import READERS, decode_hf_floats, detect_family
from m2export.models.mamba2 import HybridLM, Mamba2LMHeadModel, Router, init_weights_
from m2export.models.spec import ModelSpec
from m2export.models.weights import plan_weights, to_checkpoint_names

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


@dataclass
class LoadedCheckpoint:
    """A loaded model with where it came from. ``sha256`` hashes config.json and every weight file.

    ``format``: "mamba_ssm" | "hf" (a Mamba-2 model: ``model`` is a :class:`Mamba2LMHeadModel`, ``config``
    its :class:`Mamba2Config`) or a hybrid family ("nemotron_h", "granitemoehybrid", "bamba", "falcon_h1",
    "zamba2": ``model`` is a
    :class:`HybridLM`, ``config`` None). ``spec`` is the layer-stack description of every model.
    """

    model: HybridLM
    config: Mamba2Config | None
    format: str
    path: Path
    files: list[Path]
    sha256: str
    spec: ModelSpec | None = None
    #: state-dict name -> where the tensor's memory is, for the tensors ``load_checkpoint(share=...)`` took from
    #: elsewhere (bit-equal to the checkpoint's, checked); every other tensor is the checkpoint's own
    shared: dict[str, str] = dataclasses.field(default_factory=dict)
    #: the read-only mappings the model's tensors are views of (``load_checkpoint(mapped=True)``), else None
    pages: "MappedWeights | None" = None

    def __post_init__(self):
        if self.spec is None:
            self.spec = self.model.spec


def detect_format(cfg: dict, source: str = "config.json") -> str:
    """'mamba_ssm' (d_model/ssm_cfg), 'hf' (HF Mamba2) or a hybrid family name (see
    :func:`m2export.models.families.detect_family`, which refuses unsupported model types by name)."""
    fam = detect_family(cfg, source)
    return "hf" if fam == "mamba2" else fam


#: what a checkpoint is, for a path that is none (a file of another kind, a folder without config.json)
_NO_CHECKPOINT_HINT = ("pass a checkpoint folder (mamba_ssm or HF format): config.json and the weights, model.safetensors "
                       "(or model.safetensors.index.json and its shards) or pytorch_model.bin; 'm2export "
                       "random-checkpoint --preset tiny-mamba2 -o DIR' writes one to try")


def _resolve(path: str | os.PathLike) -> tuple[Path, list[Path], Path | None]:
    """(directory, weight files, sharded index or None) for a checkpoint directory or a weight file path."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory",
                              hint="pass a checkpoint directory (config.json + model.safetensors) or a weight file")
    if p.is_file():
        if p.name == "config.json":
            p = p.parent
        else:
            if p.suffix not in (".safetensors", ".bin", ".pt", ".json"):
                raise CheckpointError(f"{p}: not a checkpoint weight file (expected .safetensors, .bin or "
                                      "a .safetensors.index.json)", hint=_NO_CHECKPOINT_HINT)
            return (p.parent, _index_files(p), p) if p.name.endswith(".index.json") else (p.parent, [p], None)
    if not (p / "config.json").is_file():  # say what is missing first: a folder without it is no checkpoint
        raise CheckpointError(f"{p / 'config.json'}: missing; {p} is not a checkpoint directory",
                              hint=_NO_CHECKPOINT_HINT)
    for name in WEIGHT_FILES:
        f = p / name
        if f.is_file():
            return (p, _index_files(f), f) if name.endswith(".index.json") else (p, [f], None)
    raise CheckpointError(f"{p}: no weights found (expected {', '.join(WEIGHT_FILES[:-1])} or {WEIGHT_FILES[-1]} "
                          "beside config.json)", hint="pass the checkpoint folder that holds the weights, or a "
                                                     "weight file")


def _index_files(index: Path) -> list[Path]:
    return sorted({index.parent / f for f in _weight_map(index).values()})


def _weight_map(index: Path) -> dict[str, str]:
    """tensor name -> shard file name of a ``*.safetensors.index.json``, validated.

    Raises:
        CheckpointError: malformed index, or a shard outside the checkpoint directory.
    """
    try:
        wm = _paths.loads_json(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: malformed safetensors index ({type(e).__name__}: {e})") from None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names (strings)")
    if not wm:
        raise CheckpointError(f"{index}: 'weight_map' is empty: the index lists no tensors (and so no shard files)")
    root = index.parent.resolve()
    for shard in set(wm.values()):
        if (root / shard).resolve().parent != root:
            raise CheckpointError(f"{index}: shard {shard!r} is outside the checkpoint directory {root}")
    return wm


def _read_json(f: Path) -> dict:
    if not f.is_file():
        raise CheckpointError(f"{f}: missing (every checkpoint needs its config.json)")
    try:
        cfg = _paths.loads_json(f.read_text())
    except _paths.DuplicateKeyError as e:
        raise ConfigError(f"{f}: {e}") from None
    except ValueError as e:  # UnicodeDecodeError included
        raise CheckpointError(f"{f}: malformed JSON: {e}",
                              hint="fix the file: it must be one JSON object (as transformers' save_pretrained or "
                                   "mamba_ssm writes it)") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{f}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def read_config_json(path: str | os.PathLike) -> dict:
    """A config.json file parsed (HF's non-finite float encoding decoded). Raises CheckpointError naming it."""
    return decode_hf_floats(_read_json(Path(path)))


def read_config(path: str | os.PathLike) -> tuple[Mamba2Config | ModelSpec, str]:
    """(config, format) of a checkpoint directory or weight file path: a :class:`Mamba2Config` for the
    Mamba-2 formats, the :class:`ModelSpec` for a hybrid family (format = its model_type)."""
    cfg, spec, fmt = _config_in(_resolve(path)[0])
    return (cfg if cfg is not None else spec), fmt


def read_spec(path: str | os.PathLike) -> tuple[ModelSpec, str]:
    """(layer-stack description, format) of any supported checkpoint (directory or weight file path)."""
    _, spec, fmt = _config_in(_resolve(path)[0])
    return spec, fmt


def _config_in(d: Path) -> tuple[Mamba2Config | None, ModelSpec, str]:
    raw = read_config_json(d / "config.json")
    src = str(d / "config.json")
    fmt = detect_format(raw, src)
    try:
        if fmt in READERS:
            return None, READERS[fmt](raw, src), fmt
        cfg = Mamba2Config.from_mamba_ssm_json(raw, src) if fmt == "mamba_ssm" else Mamba2Config.from_hf_json(raw, src)
    except TypeError as e:  # a field of the wrong JSON type reaching the dataclass
        raise ConfigError(f"{src}: {e}") from None
    return cfg, cfg.to_spec(), fmt


def _unpickling_reason(e: Exception) -> str:
    """The cause in torch's weights-only UnpicklingError, without its advice (which says to re-run with
    weights_only=False: arbitrary code execution) and ANSI codes: "Unsupported global: GLOBAL
    __main__.Evil was not an allowed global by default"."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    m = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\. Please use|\n\n|$)", text, re.S)
    if m:
        reason = m.group(1)
    elif "weights_only" in text or not text.strip():  # another wording of the advice: show none of it
        reason = "it needs more than tensors to unpickle"
    else:  # the plain unpickler's own one-liner ("invalid load key, 'g'.")
        reason = text.strip().splitlines()[0]
    return f"not a plain state dict ({' '.join(reason.split()).rstrip('.')})"


def _read_tensors(files: list[Path], weight_map: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of ``files``; with a sharded index, each tensor from the shard the index names.

    Raises:
        CheckpointError: unreadable file, a tensor the index names missing from its shard, or a tensor
            present in two files (ambiguous).
    """
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{f}: weight file listed but missing")
        try:
            if f.suffix == ".safetensors":
                from safetensors.torch import load_file
                part = load_file(str(f))
            else:
                part = torch.load(str(f), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:  # torch's text advises weights_only=False (running the file's code)
            raise CheckpointError(f"{f}: cannot read tensors: {_unpickling_reason(e)}; m2export reads .bin files "
                                  "as plain tensors only (torch.load with weights_only=True) and never runs code "
                                  "from a checkpoint",
                                  hint="save the weights as model.safetensors with the code that wrote the file, "
                                       "if you trust it") from None
        except Exception as e:  # safetensors/pickle raise many types on corrupt input
            raise CheckpointError(f"{f}: cannot read tensors ({type(e).__name__}: {e})", hint=READ_HINT) from None
        if not isinstance(part, dict):
            raise CheckpointError(f"{f}: expected a state dict (name -> tensor), got {type(part).__name__}")
        for k, v in part.items():
            if weight_map is not None:
                if weight_map.get(k) != f.name:
                    continue  # the index assigns this tensor to another shard (or to none)
            elif k in out:
                raise CheckpointError(f"tensor {k!r} is in both {origin[k]} and {f}: ambiguous checkpoint")
            if not isinstance(v, torch.Tensor):
                raise CheckpointError(f"{f}: entry {k!r} is a {type(v).__name__}, expected a tensor")
            if v.is_meta or v.layout != torch.strided:
                raise CheckpointError(f"{f}: tensor {k!r} is a {'meta' if v.is_meta else str(v.layout)} tensor; "
                                      "expected a dense tensor with data")
            out[k], origin[k] = v, f
    if weight_map is not None:
        lost = sorted(k for k, shard in weight_map.items() if k not in out)
        if lost:
            raise CheckpointError(f"tensor(s) {lost[:8]} listed in the index are missing from their shard(s)")
    return out


def _sha256(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            for blk in iter(lambda: fh.read(1 << 20), b""):
                h.update(blk)
    return h.hexdigest()


def _tensor_shapes(files: list[Path], weight_map: dict[str, str] | None
                   ) -> tuple[dict[str, tuple[tuple[int, ...], bool]], dict[str, torch.Tensor] | None]:
    """name -> (shape, is_float) of every tensor, from the safetensors headers (nothing else is read); for
    ``.bin`` files the tensors themselves (returned too, so they are read once)."""
    if all(f.suffix == ".safetensors" for f in files):
        from safetensors import safe_open

        out: dict[str, tuple[tuple[int, ...], bool]] = {}
        origin: dict[str, Path] = {}
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: weight file listed but missing")
            try:
                with safe_open(str(f), "pt") as fh:
                    for k in fh.keys():
                        if weight_map is not None and weight_map.get(k) != f.name:
                            continue
                        if k in out:
                            raise CheckpointError(f"tensor {k!r} is in both {origin[k]} and {f}: ambiguous checkpoint")
                        sl = fh.get_slice(k)
                        out[k], origin[k] = (tuple(sl.get_shape()), sl.get_dtype() in _FLOAT_ST), f
            except CheckpointError:
                raise
            except Exception as e:  # safetensors raises several types on corrupt input
                raise CheckpointError(f"{f}: cannot read tensors ({type(e).__name__}: {e})", hint=READ_HINT) from None
        if weight_map is not None:
            lost = sorted(k for k in weight_map if k not in out)
            if lost:
                raise CheckpointError(f"tensor(s) {lost[:8]} listed in the index are missing from their shard(s)")
        return out, None
    sd = _read_tensors(files, weight_map)
    return {k: (tuple(v.shape), v.is_floating_point()) for k, v in sd.items()}, sd


_FLOAT_ST = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


def load_checkpoint(path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                    allow_nonfinite: bool = False, share=None, mapped: bool = False) -> LoadedCheckpoint:
    """Load a Mamba-2 or hybrid checkpoint (directory or weight-file path), format/family auto-detected.

    Every tensor name and size config.json declares is checked against the weight files (their safetensors
    headers) before the model is built or any tensor data is read (a config claiming n_layer=10**6 or
    d_model=10**9 is an error, not an out-of-memory).

    Args:
        path: checkpoint directory, its config.json, or a weight file next to config.json.
        dtype: build the model in this dtype (default float32). MoE routers stay float32 and route in
            float32 (transformers keeps Nemotron-H's so, ``_keep_in_fp32_modules_strict``; its Granite router
            computes the logits in the model dtype, m2export in float32: closer to the float32 routing).
        allow_nonfinite: accept NaN/Inf weights and, for fp16/bf16 ``dtype``, values beyond that dtype's
            range (which the cast would turn into inf); refused by default (:func:`check_weights`).
        share: where equal tensors may already be in memory (``m2export check``: the export's memory-mapped
            weights, which ONNX Runtime uses): called as ``share(name, tensor)`` for every tensor of the model
            (state-dict name, the checkpoint's tensor in the model's dtype), it yields ``(candidate, label)``
            pairs; the first candidate of the same shape and dtype whose bits equal the checkpoint tensor's
            (checked here, every element: :func:`bit_equal`) replaces it, and ``label`` goes to
            :attr:`LoadedCheckpoint.shared`; a tensor without one stays the checkpoint's. Either way the model
            computes with exactly the checkpoint's values. With ``share``, safetensors files are read one tensor
            at a time into the process's own memory (:class:`_TensorsOnDisk`), not mapped whole, so a replaced
            tensor's checkpoint copy is gone once replaced (a mapping would keep every page read resident).
        mapped: (without ``share``) the tensors are views of read-only mappings of the safetensors files
            (:class:`MappedWeights`, :attr:`LoadedCheckpoint.pages`), whose pages are dropped from the process's
            resident memory after each tensor is checked and converted, and again whenever the caller is done
            with a tensor (``ck.pages.release(t)``; the export, as it writes each weight): a loaded model then
            keeps none of its weights resident, where safetensors' mapping keeps every page read. A write to
            such a tensor is a segmentation fault, not a silent change: for readers only. Files that are not
            plain safetensors (or hold a tensor not aligned to its element size) are read as without it.
    Returns:
        LoadedCheckpoint with the model in eval mode.
    Raises:
        CheckpointError: missing/malformed file, missing/unexpected/mis-shaped tensor (named, with
            expected and found shapes), tied embeddings with a different lm_head.weight, fewer layers
            in the files than config.json declares or sizes no model can have (before anything is built),
            sparse/meta tensors, a non-finite or out-of-range weight (named, with its first index and value).
        ConfigError: unsupported model type or unsupported/malformed config field (named).
    """
    d, files, index = _resolve(path)
    cfg, spec, fmt = _config_in(d)
    wm = _weight_map(index) if index is not None else None
    shapes, sd = _tensor_shapes(files, wm)
    family = "mamba2" if fmt == "hf" else fmt
    plan = plan_weights(family, spec, sorted(shapes))
    where = ", ".join(str(f) for f in files)
    _check_layer_count(shapes, spec.n_layer, where)
    try:  # shapes only: no memory, whatever config.json claims; the same meta model receives the tensors below
        model = _meta_model(spec, cfg, dtype)
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        for k in VOCAB_ROWS:  # stored with the padding rows (mamba_ssm), which the model does not hold
            if k in expected:
                expected[k] = (spec.vocab_size_padded, *expected[k][1:])
    except (RuntimeError, OverflowError) as e:
        raise CheckpointError(f"{where}: config.json declares sizes no model can have ({str(e).splitlines()[0]})",
                              hint="compare its d_model/hidden_size, d_state, vocab_size with the weight files") \
            from None
    tied_head = None
    if spec.tie_embeddings:
        expected.pop("lm_head.weight", None)
        src = plan.sources.pop("lm_head.weight", None)
        tied_head = src.keys[0] if src is not None else None
    what = f"a {fmt} model with {spec.n_layer} layers" if cfg is None else f"a {fmt} Mamba-2 with n_layer={cfg.n_layer}"
    missing = sorted(set(expected) - set(plan.sources))
    extra = sorted(plan.unmapped + [src.keys[0] for k, src in plan.sources.items() if k not in expected])
    if missing:
        raise CheckpointError(f"{where}: missing tensor(s) {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                              f"for {what}")
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor(s) {extra[:8]}{' ...' if len(extra) > 8 else ''} "
                              f"(config.json describes {what})")
    for k, shape in expected.items():
        src = plan.sources[k]
        found = [shapes[n][0] for n in src.keys]
        got = (len(found),) + found[0] if src.stacked else found[0]
        if got != shape or (src.stacked and len(set(found)) != 1):
            shown = src.keys[0] if not src.stacked else f"{src.keys[0]} (x{len(src.keys)} experts)"
            raise CheckpointError(f"{where}: tensor {shown!r} has shape {got if not src.stacked else found}, "
                                  f"expected {shape} from config.json",
                                  hint="config.json and the weights describe different models: use the config.json "
                                       "saved with these weights")
        for n in src.keys:
            if not shapes[n][1]:
                raise CheckpointError(f"{where}: tensor {n!r} is not floating-point, expected a float dtype")
    if tied_head is not None and shapes[tied_head][0] != expected["backbone.embedding.weight"]:
        raise CheckpointError(f"{where}: tensor {tied_head!r} has shape {shapes[tied_head][0]}, but the "
                              "embeddings are tied (tie_word_embeddings/tie_embeddings)")
    if sd is None and share is not None:
        sd = _TensorsOnDisk.of(files, wm)
        if sd is not None and not allow_nonfinite:
            sd.check = (dtype, where)  # every tensor checked as it is read (each is read at least once below)
    pages = None
    if sd is None and share is None and mapped:
        got = MappedWeights.of(files, wm)
        if got is not None:
            pages, sd = got
        else:  # no lease (or not plain safetensors): read, never map, so a truncated file is an error, not a SIGBUS
            sd = _TensorsOnDisk.of(files, wm)
            if sd is not None and not allow_nonfinite:
                sd.check = (dtype, where)
    if sd is None:
        sd = _read_tensors(files, wm)
    try:  # a failed load gives its leases up at once (the writer waiting for one goes on)
        if not allow_nonfinite and not isinstance(sd, _TensorsOnDisk):
            if pages is None:
                check_weights(sd, dtype, where)
            else:  # one tensor resident at a time
                for k, v in sd.items():
                    check_weights({k: v}, dtype, where)
                    pages.release(v)
        for m in model.modules():
            if isinstance(m, Router):
                m.float()
        if tied_head is not None:
            emb = sd[plan.sources["backbone.embedding.weight"].keys[0]]
            if not torch.equal(sd[tied_head].to(emb.dtype), emb):
                raise CheckpointError(f"{where}: tensor {tied_head!r} differs from the embedding, but config.json ties "
                                      "them (tie_word_embeddings/tie_embeddings): which one is meant is unclear",
                                      hint="set tie_word_embeddings to false if the checkpoint has its own lm_head")
        params = dict(model.state_dict())
        later = set(plan.copies) | {plan.sources[i].keys[0] for i in plan.copies.values() if i in plan.sources}
        uses: dict[str, int] = {}
        for src in plan.sources.values():
            for n in src.keys:
                uses[n] = uses.get(n, 0) + 1
        new: dict[str, torch.Tensor] = {}
        shared: dict[str, str] = {}
        padding: dict[str, torch.Tensor] = {}
        for k, src in plan.sources.items():
            t = torch.stack([sd[n] for n in src.keys]) if src.stacked else sd[src.keys[0]]
            if k in VOCAB_ROWS:
                if t.shape[0] > spec.vocab_size:  # a few rows, copied: kept only for save_checkpoint to write back
                    padding[k] = t[spec.vocab_size:].clone()
                t = t[:spec.vocab_size]  # a view: the padding rows are never read (no logits, no token ids)
            new[k] = t.to(params[k].dtype)  # the checkpoint's own tensor when the dtype matches (no copy)
            del t
            if share is not None:
                for cand, label in share(k, new[k]):
                    if cand.shape == new[k].shape and cand.dtype == new[k].dtype and bit_equal(cand, new[k]):
                        new[k], shared[k] = cand, label
                        break
            for n in src.keys:  # a read tensor converted or stacked is dropped once nothing else reads it
                if pages is not None:
                    pages.release(sd[n])  # converted or stacked: read; kept: touched by the checks above at most
                uses[n] -= 1
                if not uses[n] and n not in later:
                    del sd[n]
        _assign_state(model, new)
        model.vocab_padding = padding
        for copy, internal in plan.copies.items():  # Zamba2: later callers' copies of a shared block
            ref = plan.sources[internal].keys[0] if internal in plan.sources else None
            if ref is None or sd[copy].shape != sd[ref].shape or not torch.equal(sd[copy], sd[ref]):
                raise CheckpointError(f"{where}: tensor {copy!r} differs from {ref!r}, its shared block's stored copy: "
                                      "the blocks are not shared (transformers 5.24 unties Zamba2's shared blocks when "
                                      "tie_word_embeddings is false), which m2export does not support")
        model.eval()
        if pages is not None:
            pages.release_all()  # the tied-head and shared-copy comparisons read tensors again
        return LoadedCheckpoint(model, cfg, fmt, d, files, _sha256([d / "config.json", *files]), spec, shared, pages)
    except BaseException:
        if pages is not None:
            pages.close()
        raise


#: the tensors of vocab_size_padded rows in a checkpoint, of which the model holds the first vocab_size
VOCAB_ROWS = ("backbone.embedding.weight", "lm_head.weight")


def bit_equal(a: torch.Tensor, b: torch.Tensor, slice_elements: int = 1 << 22) -> bool:
    """Whether two tensors of one shape and dtype hold the same bits in every element (NaN payloads, the sign
    of zero included: stricter than ``torch.equal``), compared in slices along the first axis of at most
    ``slice_elements`` elements (strided views such as a transposed one are read in place, no whole copy)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    if a.dim() == 0:
        a, b = a.reshape(1), b.reshape(1)
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
    if as_int is not None and a.dtype != torch.bool:  # compare bits, not values (-0.0 == 0.0, NaN != NaN)
        a, b = a.view(as_int), b.view(as_int)
    rows = max(1, slice_elements // (a.numel() // a.shape[0]))
    return all(torch.equal(a[i:i + rows], b[i:i + rows]) for i in range(0, a.shape[0], rows))


#: tensors of at least this many bytes are read by :class:`_TensorsOnDisk` into their own anonymous mapping: glibc
#: keeps freed heap blocks below its (dynamic, up to 32 MB) mmap threshold, which after a 130m model's load were
#: 0.24 GB of memory the process held and no tensor used (CPU here)
_OWN_MAPPING_BYTES = 1 << 20
#: safetensors dtype names :class:`_TensorsOnDisk` reads (anything else: the file is read by safetensors)
_ST_READ = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
            "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
            "BOOL": torch.bool}


class _TensorsOnDisk(dict):
    """name -> tensor of safetensors files, each tensor read from its file (plain reads, the process's own
    memory) every time it is looked up, never kept: the form of the state dict that ``load_checkpoint(share=...)``
    needs, where a tensor replaced by an equal one elsewhere must leave nothing resident behind (safetensors'
    ``load_file`` maps the whole file, and the mapping keeps every page read resident while any tensor of it
    lives). The dict's values are (file, dtype, shape, start, end) of the data; ``[]`` reads, and with
    :attr:`check` = (dtype, where) refuses a tensor :func:`check_weights` refuses as it reads it (so the tensors
    are not read once more just for that check)."""

    check: tuple[torch.dtype | None, str] | None = None

    @classmethod
    def of(cls, files: list[Path], weight_map: dict[str, str] | None) -> "_TensorsOnDisk | None":
        """The tensors of ``files`` (only the ones ``weight_map`` assigns to each shard), or None where a file is
        not plain little-endian safetensors of :data:`_ST_READ` dtypes with consistent offsets (the caller then
        reads it with safetensors, which reports what is wrong). Names are checked unique by the caller."""
        import sys

        if sys.byteorder != "little" or not all(f.suffix == ".safetensors" for f in files):
            return None
        out = cls()
        for f in files:
            try:
                size = f.stat().st_size
                with open(f, "rb") as fh:
                    (n,) = struct.unpack("<Q", fh.read(8))
                    if n > size - 8:
                        return None
                    header = json.loads(fh.read(n))
            except (OSError, ValueError, struct.error):
                return None
            base = 8 + n
            for k, v in header.items():
                if k == "__metadata__" or (weight_map is not None and weight_map.get(k) != f.name):
                    continue
                try:
                    dt, shape, (start, end) = _ST_READ[v["dtype"]], tuple(int(x) for x in v["shape"]), v["data_offsets"]
                    start, end = base + int(start), base + int(end)
                except (KeyError, TypeError, ValueError):
                    return None
                numel = 1
                for x in shape:
                    numel *= x
                if end - start != numel * torch.empty((), dtype=dt).element_size() or start < base or end > size:
                    return None
                dict.__setitem__(out, k, (f, dt, shape, start, end))
        return out

    def __getitem__(self, k: str) -> torch.Tensor:
        f, dt, shape, start, end = dict.__getitem__(self, k)
        if end - start >= _OWN_MAPPING_BYTES:  # its own anonymous mapping: unmapped as soon as the tensor is freed
            import mmap
            import warnings

            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*not writable|.*non-writable")
                t = torch.frombuffer(mmap.mmap(-1, end - start), dtype=dt).reshape(shape)
        else:
            t = torch.empty(shape, dtype=dt)
        if end > start:
            buf = t.reshape(-1).view(torch.uint8).numpy()
            with open(f, "rb") as fh:
                fh.seek(start)
                got = fh.readinto(memoryview(buf))
            if got != end - start:
                raise CheckpointError(f"{f}: tensor {k!r} is truncated ({got} of {end - start} bytes)")
        if self.check is not None:
            check_weights({k: t}, *self.check)
        return t

    def items(self):
        return ((k, self[k]) for k in self.keys())

    def values(self):
        return (self[k] for k in self.keys())


class MappedWeights:
    """Read-only mappings of a checkpoint's safetensors files (``mmap.ACCESS_READ``: PROT_READ, MAP_SHARED)
    whose tensors a model's parameters are views of (``load_checkpoint(mapped=True)``), each file guarded by a
    read lease, and :meth:`release`, which drops a tensor's pages from the process's resident memory
    (``madvise(MADV_DONTNEED)``).

    Why mappings: a file mapping keeps every page read resident while it lives, so once an export has checked and
    written every weight, its RSS holds the whole file (the 130m export: 0.67 of its 0.96 GiB peak, the rest
    torch, onnx and the graph). Releasing a page of a read-only shared file mapping loses nothing: no page of
    it can differ from the file, the page stays in the page cache, and the next read faults it back in with
    the file's bytes. Where the platform has no ``MADV_DONTNEED`` (not Linux), :meth:`release` does nothing.

    Why leases: a read of a mapped page past the end of a file truncated meanwhile (a checkpoint saved again into
    the same folder: ``open(f, 'wb')``) is a SIGBUS, which kills the process; Python cannot catch it. Each file
    is opened once more and holds a read lease (``fcntl(F_SETLEASE, F_RDLCK)``, Linux, fcntl(2) "Leases"): any
    other open of it for writing or truncation, by any process, waits until this process gives the lease up
    (at most /proc/sys/fs/lease-break-time, 45 s by default) while SIGIO tells it so. The SIGIO handler
    (:func:`_on_lease_break`) records the file and raises CheckpointError naming it (outside a critical
    section of :mod:`m2export._paths`); :meth:`release` and :meth:`check` raise it again should a caller have
    swallowed it; :meth:`close` gives the leases up, after which the writer goes on. A file whose lease cannot
    be taken (another user's file without CAP_LEASE, a file system without leases such as NFS, a file open for
    writing, not Linux, not the main thread) is not mapped: :meth:`of` returns None and the loader reads the
    tensors into the process's own memory (a truncated file is then a CheckpointError at the read).
    """

    def __init__(self):
        #: (first address, end address, mapping) of each file
        self._maps: list[tuple[int, int, object]] = []
        #: (path, fd holding the read lease) of each file
        self._leases: list[tuple[Path, int]] = []
        #: the file whose lease another open broke (the export must not go on reading), else None
        self.broken: Path | None = None

    @classmethod
    def of(cls, files: list[Path], weight_map: dict[str, str] | None
           ) -> "tuple[MappedWeights, dict[str, torch.Tensor]] | None":
        """(mappings, name -> tensor view) for ``files`` (the tensors ``weight_map`` assigns to each shard), or
        None where :meth:`_TensorsOnDisk.of` refuses a file, a tensor's offset is not a multiple of its
        element size, or a file's read lease cannot be taken (the caller then reads the files as before).
        Raises CheckpointError if a file is shorter than its header says once its lease is held."""
        import mmap
        import warnings

        import numpy as np

        self = cls()
        try:
            for f in files:
                if not self._lease(f):
                    self.close()
                    return None
            where = _TensorsOnDisk.of(files, weight_map)  # the headers, read once every lease is held
            if where is None:
                self.close()
                return None
            entries = list(dict.items(where))  # (file, dtype, shape, start, end); dict's items: no reading
            if any(end > start and start % torch.empty((), dtype=dt).element_size()
                   for _, (_, dt, _, start, end) in entries):
                self.close()
                return None
            need = {f: 8 for f in files}
            for _, (f, _, _, _, end) in entries:
                need[f] = max(need[f], end)
            out, maps = {}, {}
            for f, fd in self._leases:
                st, now = os.fstat(fd), os.stat(f)
                if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino) or st.st_size < need[f]:
                    raise CheckpointError(f"{f}: {'replaced' if st.st_ino != now.st_ino else 'truncated'} while it "
                                          f"was being loaded ({st.st_size} bytes, its header needs {need[f]})",
                                          hint="load it again once it is no longer being written")
                mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
                lo = int(np.frombuffer(mm, dtype=np.uint8).ctypes.data)
                self._maps.append((lo, lo + len(mm), mm))
                maps[f] = mm
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*not writable|.*non-writable")
                for k, (f, dt, shape, start, end) in entries:
                    size = torch.empty((), dtype=dt).element_size()
                    out[k] = torch.frombuffer(maps[f], dtype=dt, count=(end - start) // size,
                                              offset=start).reshape(shape) if end > start else torch.empty(shape,
                                                                                                            dtype=dt)
        except BaseException:
            self.close()
            raise
        self.check()
        return self, out

    def _lease(self, f: Path) -> bool:
        """Open ``f`` read-only and take a read lease on it (kept in :attr:`_leases`); False where none can be
        had (the fd is closed again)."""
        import threading

        fcntl = _fcntl()
        if fcntl is None or threading.current_thread() is not threading.main_thread():
            return False
        try:
            fd = os.open(f, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return False
        _watch(self)  # the handler first: SIGIO's default action ends the process
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        except OSError:  # EACCES (not the owner), EAGAIN (open for writing), EINVAL (no leases there)
            os.close(fd)
            return False
        self._leases.append((Path(f), fd))
        return True

    def _breaking(self) -> Path | None:
        """The first file whose lease is being broken (``F_GETLEASE`` answers ``F_UNLCK`` then), else None."""
        fcntl = _fcntl()
        for f, fd in self._leases:
            try:
                if fcntl.fcntl(fd, fcntl.F_GETLEASE) != fcntl.F_RDLCK:
                    return f
            except OSError:
                return f
        return None

    def error(self) -> CheckpointError:
        """The error for :attr:`broken`."""
        return CheckpointError(f"{self.broken}: changed while it was being exported (opened for writing or "
                               "truncated by a process): the export would read a changing file; nothing was "
                               "written", hint="export again once the checkpoint is no longer being written")

    def check(self) -> None:
        """Raise :meth:`error` if another open broke a lease (the export must stop reading the files)."""
        if self.broken is not None:
            raise self.error()

    def close(self) -> None:
        """Give the leases up (a writer waiting for them goes on; the tensors, still views of the mappings, are
        no longer guarded). Idempotent."""
        leases, self._leases = self._leases, []
        fcntl = _fcntl()
        for _, fd in leases:
            with contextlib.suppress(OSError):  # the mapping holds a dup of the fd: closing ours keeps the lease
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
            with contextlib.suppress(OSError):
                os.close(fd)
        _unwatch(self)

    def __del__(self):
        self.close()

    def release(self, a) -> int:
        """Drop the pages under ``a`` (a torch tensor or numpy array, or a view of one: its whole storage or
        byte extent) from resident memory where they are pages of these mappings; returns the bytes released
        (0 for memory of anything else). Whole pages: a neighbour tensor's share of an edge page is released
        too (it is read back from the file when next used)."""
        import mmap

        import numpy as np

        try:
            from numpy.lib.array_utils import byte_bounds  # numpy >= 2
        except ImportError:
            byte_bounds = np.byte_bounds
        self.check()
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if advice is None or not self._maps:
            return 0
        if isinstance(a, torch.Tensor):
            s = a.untyped_storage()
            lo, hi = s.data_ptr(), s.data_ptr() + s.nbytes()
        else:
            lo, hi = byte_bounds(np.asarray(a))
        done = 0
        for first, end, mm in self._maps:
            a0, a1 = max(lo, first), min(hi, end)
            if a0 >= a1:
                continue
            off = (a0 - first) // mmap.PAGESIZE * mmap.PAGESIZE
            n = min(end - first, -(-(a1 - first) // mmap.PAGESIZE) * mmap.PAGESIZE) - off
            mm.madvise(advice, off, n)
            done += n
        return done

    def release_all(self) -> int:
        """:meth:`release` every page of every mapping; returns the bytes released."""
        import mmap

        advice = getattr(mmap, "MADV_DONTNEED", None)
        if advice is None:
            return 0
        for _, _, mm in self._maps:
            mm.madvise(advice)
        return sum(end - first for first, end, _ in self._maps)


def _fcntl():
    """The fcntl module where it has file leases (Linux), else None."""
    try:
        import fcntl
    except ImportError:
        return None
    return fcntl if hasattr(fcntl, "F_SETLEASE") and hasattr(fcntl, "F_GETLEASE") else None


#: the MappedWeights holding leases, and the SIGIO handler in force before :func:`_on_lease_break` was installed
_watched: "weakref.WeakSet[MappedWeights]" = weakref.WeakSet()
_sigio_before: list = []


def _watch(mw: MappedWeights) -> None:
    """Install :func:`_on_lease_break` for SIGIO (main thread) while any MappedWeights holds a lease."""
    import signal

    _watched.add(mw)
    if not _sigio_before:
        _sigio_before.append(signal.signal(signal.SIGIO, _on_lease_break))


def _unwatch(mw: MappedWeights) -> None:
    import signal
    import threading

    _watched.discard(mw)
    if not _watched and _sigio_before and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGIO, _sigio_before.pop())


def _on_lease_break(signum, frame) -> None:
    """SIGIO: if another open is breaking one of our leases, record the file and raise CheckpointError (deferred
    to the next :meth:`MappedWeights.check` or :meth:`~MappedWeights.release` inside a critical section of
    :mod:`m2export._paths`); any other SIGIO goes to the handler in force before."""
    for mw in list(_watched):
        f = mw._breaking()
        if f is not None:
            if mw.broken is None:
                mw.broken = f
            if not _paths._holding:
                raise mw.error()
            return
    before = _sigio_before[0] if _sigio_before else None
    if callable(before):
        before(signum, frame)


def _assign_state(model: HybridLM, tensors: dict[str, torch.Tensor]) -> None:
    """Make ``tensors`` (state-dict name -> tensor) the parameters and buffers of a model built on the meta
    device, keeping its aliases (a tied lm_head stays the embedding's parameter): each group of aliased
    entries needs one of its names in ``tensors``."""
    groups: dict[int, list[str]] = {}
    for k, v in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(v), []).append(k)
    alias = {}
    for names in groups.values():
        given = [k for k in names if k in tensors]
        if not given:
            raise InternalError(f"no checkpoint tensor for {names[0]!r}")
        alias.update((k, given[0]) for k in names)
    model.load_state_dict({k: tensors[a] for k, a in alias.items()}, strict=True, assign=True)
    for k, a in alias.items():
        if k != a:
            mod, _, name = k.rpartition(".")
            src, _, src_name = a.rpartition(".")
            setattr(model.get_submodule(mod), name, getattr(model.get_submodule(src), src_name))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise InternalError(f"tensors {left[:4]} were not loaded from the checkpoint (still on the meta device)")


def _build(spec: ModelSpec, cfg: Mamba2Config | None) -> HybridLM:
    return Mamba2LMHeadModel(cfg) if cfg is not None else HybridLM(spec)


#: the in-place initialisers of ``torch.nn.init`` that module constructors call (``reset_parameters``)
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                   "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                   "sparse_")


def _meta_model(spec: ModelSpec, cfg: Mamba2Config | None, dtype: torch.dtype | None) -> HybridLM:
    """The model on the meta device in ``dtype`` (no memory, no float32 copy of a large model: 2.7B would be
    10.8 GB), its parameters left uninitialised: the checkpoint's tensors replace them (:func:`_assign_state`).

    The ``torch.nn.init`` functions are no-ops while it is built: on the meta device they have nothing to fill,
    yet ``normal_`` runs torch's Python reference decomposition, whose first call imports ``torch._dynamo``
    (~2 s of CPU, measured on the 130m export; issue 16 item 5)."""
    import torch.nn.init as init

    saved = {n: getattr(init, n) for n in _INIT_FUNCTIONS if hasattr(init, n)}
    try:
        for n in saved:
            setattr(init, n, lambda tensor, *a, **k: tensor)
        with torch.device("meta"):
            return _built_in(dtype, lambda: _build(spec, cfg))
    finally:
        for n, f in saved.items():
            setattr(init, n, f)


def _check_layer_count(names, n_layer: int, where: str) -> None:
    """Every layer 0..n_layer-1 config.json declares has tensors (``*.layers.N.*`` names; checked before
    even a meta model is built: n_layer=10**6 would take minutes and gigabytes); extra layers are reported
    by the name/shape check."""
    import re

    found = {int(m.group(1)) for k in names if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", k))}
    if found and not set(range(n_layer)) <= found:
        have = f"layers {min(found)}..{max(found)} ({len(found)} of them)"
        raise CheckpointError(f"{where}: config.json says n_layer={n_layer} but the weight files hold {have}")


_NARROW = {torch.float16: "fp16", torch.bfloat16: "bf16"}


#: the largest ``A_log`` whose ``A = -exp(A_log)`` is finite in float32 (about 88.72): the export bakes A in
#: float32 (exporter/build.py) and the model computes it so (models/mamba2.py); above it A is -inf, and the
#: chunked scans' (ssmscan, std) segment sums subtract -inf from -inf: NaN logits
#: the hint of a weight file that cannot be parsed (truncated, damaged, or not the format its name says)
READ_HINT = ("the file is damaged, cut short or not the format its name says (a partial download?): fetch or save "
             "it again")
A_LOG_MAX = math.log(torch.finfo(torch.float32).max)


def check_weights(sd: dict[str, torch.Tensor], dtype: torch.dtype | None, where: str) -> None:
    """Refuse NaN/Inf weights, an ``A_log`` whose ``A = -exp(A_log)`` overflows float32 to -inf (a tensor named
    ``...A_log``, every family's name for it: > :data:`A_LOG_MAX`, after rounding to an fp16/bf16 ``dtype``), and,
    for an fp16/bf16 ``dtype``, values whose cast overflows to inf.

    Raises:
        CheckpointError: naming the tensor, its first bad index and the value.
    """
    for k, v in sd.items():
        if k.rsplit(".", 1)[-1] == "A_log" and v.is_floating_point():
            # as the export holds it: an fp16/bf16 export rounds A_log to its dtype first (88.72 -> 88.75 in fp16)
            narrow = dtype in _NARROW and v.dtype != dtype
            held = v.to(dtype) if narrow else v
            with torch.no_grad():
                over = torch.isinf(torch.exp(held.float())) & torch.isfinite(v)  # the export's own op; NaN/inf: below
            if bool(over.any()):
                idx = [int(i) for i in over.nonzero()[0]]
                rounded = f" (as {_NARROW[dtype]}: {held[tuple(idx)].item()!r})" if narrow else ""
                raise CheckpointError(f"{where}: tensor {k!r} has a value at index {idx}: {v[tuple(idx)].item()!r}"
                                      f"{rounded} whose A = -exp(A_log) is -inf in float32; expected A_log <= "
                                      f"{A_LOG_MAX:.4f} (A finite)" + (" once rounded to the export dtype" if narrow else ""),
                                      hint="fix the checkpoint (or export it anyway with `allow_nonfinite=True`)")
        if _weights_ok(v, dtype):
            continue
        bad = ~torch.isfinite(v)
        what = "a non-finite value"
        if not bad.any() and dtype in _NARROW and v.dtype != dtype:
            lim = torch.finfo(dtype).max
            bad = v.abs() > lim
            what = f"a value outside the {_NARROW[dtype]} range (|x| <= {lim:.6g})"
        if bad.any():
            idx = [int(i) for i in bad.nonzero()[0]]
            raise CheckpointError(f"{where}: tensor {k!r} has {what} at index {idx}: {v[tuple(idx)].item()!r}",
                                  hint="fix the checkpoint (or export it anyway with `allow_nonfinite=True`)")


def _weights_ok(v: torch.Tensor, dtype: torch.dtype | None) -> bool:
    """Reductions that prove ``v`` passes :func:`check_weights` (False: look closer, element by element).

    Narrowing to fp16/bf16: ``max |v|`` (``vector_norm`` of order inf; a NaN or inf propagates) within the
    target range. Otherwise the sum, accumulated in float32 (float64 for float64): a NaN or an inf element
    makes it non-finite, so a finite sum means every element is finite (a non-finite sum of finite values,
    an overflow, is left to the exact check). Both read the tensor once, without the boolean mask per element
    (``isfinite`` + ``any``, 3-4x slower here), in slices of :data:`_CHECK_SLICE` elements: ``sum(dtype=float32)``
    of a whole fp16 tensor makes a float32 copy of it first (a 1 GB embedding: 2 GB more peak memory)."""
    if not v.is_floating_point() or v.numel() == 0:
        return False
    flat = v.reshape(-1)
    parts = (flat[i:i + _CHECK_SLICE] for i in range(0, flat.numel(), _CHECK_SLICE))
    if dtype in _NARROW and v.dtype != dtype:
        lim = torch.finfo(dtype).max
        return all(bool(torch.linalg.vector_norm(p, float("inf")) <= lim) for p in parts)
    acc = torch.float64 if v.dtype == torch.float64 else torch.float32
    return all(bool(torch.isfinite(p.sum(dtype=acc))) for p in parts)


#: elements per slice in :func:`_weights_ok` (64 MB of float32 temporaries at most)
_CHECK_SLICE = 1 << 24


#: safetensors metadata key/value that marks a checkpoint m2export wrote (``--force`` may replace its folder)
WRITTEN_BY = ("written_by", "m2export")
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32"}


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The paths a checkpoint consists of (its folder, config.json, index, weight files), for protection
    against deletion: callers resolve each through its symlinks. Never raises (a checkpoint that cannot be
    resolved yields just ``path``: loading it reports the problem)."""
    out = [Path(path)]
    try:
        d, files, index = _resolve(path)
    except (CheckpointError, OSError):
        return out
    return out + [d, d / "config.json", *([index] if index is not None else []), *files]


def file_stamps(paths) -> dict[Path, tuple[int, int, int]]:
    """(inode, size, mtime in ns) of each regular file among ``paths`` (through symlinks), for
    :func:`unchanged_since`; a path that is no regular file is left out."""
    out = {}
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            out[Path(p)] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def unchanged_since(stamps: dict[Path, tuple[int, int, int]]) -> None:
    """Raise CheckpointError if a file of ``stamps`` (:func:`file_stamps`) was replaced, resized or written since.

    Why: an export reads the weights from read-only mappings of the files until it has written the last graph
    (:class:`MappedWeights`), so a checkpoint written in place meanwhile (a same-size rewrite: ``open(f, 'r+b')``)
    would give an export mixing old and new weights under the old file's sha256. (Where the files are mapped
    under read leases, such a write or a truncation is refused as it starts: :class:`MappedWeights`; this check
    covers the files read without one, and a file replaced by a rename.)
    """
    now = file_stamps(stamps)
    for p, was in stamps.items():
        if now.get(p) != was:
            raise CheckpointError(f"{p}: changed while it was being exported (written, resized or replaced): the "
                                  "export would mix its old and new weights; nothing was written",
                                  hint="export again once the checkpoint is no longer being written")


def checkpoint_foreign_reason(folder: str | os.PathLike) -> str | None:
    """None if ``folder`` is a checkpoint :func:`save_checkpoint` wrote (config.json + model.safetensors with
    the :data:`WRITTEN_BY` mark, nothing else), else why not."""
    d = Path(folder)
    other = sorted(p.name for p in d.iterdir() if p.name not in ("config.json", "model.safetensors")
                   and not p.name.startswith(".m2export"))
    from m2export.exporter.configs import MANIFEST_FILE  # (a light module: names only)

    if MANIFEST_FILE in other:  # an export folder: its files are m2export's, but not a checkpoint's
        return f"is an m2export export folder ({MANIFEST_FILE}), not a checkpoint"
    if other:
        return f"holds file(s) m2export did not write ({_paths.name_listing(other)})"
    try:
        from safetensors import safe_open

        with safe_open(str(d / "model.safetensors"), "pt") as f:
            meta = f.metadata() or {}
    except Exception:  # missing or unreadable: not ours
        meta = {}
    if meta.get(WRITTEN_BY[0]) != WRITTEN_BY[1]:
        return "is not a checkpoint m2export wrote (no m2export mark in model.safetensors)"
    return None


def _write_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str],
                       dtype: torch.dtype | None) -> None:
    """Write ``tensors`` in the safetensors format (https://github.com/huggingface/safetensors, "Format":
    8-byte little-endian header size, JSON header of dtype/shape/data_offsets, raw little-endian data),
    one tensor at a time: no copy of the whole state dict (``safetensors.torch.save_file`` makes one)."""
    import sys

    if sys.byteorder != "little":
        raise CheckpointError("writing safetensors needs a little-endian machine")
    header: dict = {"__metadata__": metadata}
    off = 0
    for k, t in tensors.items():
        dt = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
        n = t.numel() * torch.empty((), dtype=dt).element_size()
        header[k] = {"dtype": _ST_DTYPES[dt], "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(h)))
        fh.write(h)
        for k, t in tensors.items():
            t = t.detach()
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            fh.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        fh.flush()
        os.fsync(fh.fileno())


def save_checkpoint(model: HybridLM, outdir: str | os.PathLike, *, format: str = "mamba_ssm",
                    dtype: torch.dtype | None = None, force: bool = False, force_foreign: bool = False,
                    config_json: dict | None = None) -> Path:
    """Write config.json + model.safetensors in ``format``; returns the directory.

    ``format``: 'mamba_ssm' or 'hf' for a :class:`Mamba2LMHeadModel`; a hybrid family (a key of
    :data:`m2export.models.families.READERS`) for a :class:`HybridLM`, whose HF ``config_json`` must be given
    (a spec is not turned back into a config.json) and whose tensors get the family's checkpoint names
    (transformers loads the result).

    Written through :func:`m2export._paths.staged_output` (a temporary sibling swapped in: no half-written
    checkpoint, the previous one intact on failure), tensor by tensor (no copy of the state dict).

    A padded vocabulary (mamba_ssm's ``pad_vocab_size_multiple``): the embedding and lm_head get
    vocab_size_padded rows, those past vocab_size from ``model.vocab_padding`` (a loaded checkpoint's own rows,
    so load + save in the file's dtype gives its tensors back bit for bit), else zeros. ``format='hf'`` has no
    padding: its config.json's vocab_size is vocab_size_padded, and those rows are tokens there.

    Args:
        force: replace a non-empty ``outdir`` holding a checkpoint m2export wrote.
        force_foreign: with ``force``, replace it even if m2export did not write it (deletes its contents).
    Raises:
        OutputFolderError: ``outdir`` refused (non-empty without ``force``, not m2export's, a symlink, holds
            the current directory) or not writable (full disk included). Interrupted: SIGINT/SIGTERM.
    """
    hybrid = format in READERS
    if not hybrid and format not in ("mamba_ssm", "hf"):
        raise ValueError(f"format must be 'mamba_ssm', 'hf' or one of {sorted(READERS)}, got {format!r}")
    if hybrid and config_json is None:
        raise ValueError(f"format {format!r}: give config_json (the HF config.json of the model)")
    spec = model.spec
    sd = dict(model.state_dict())
    if spec.tie_embeddings:
        sd.pop("lm_head.weight", None)
    pad = spec.vocab_size_padded - spec.vocab_size
    for k in VOCAB_ROWS if pad else ():  # the rows the format's vocab_size_padded asks for: the loaded ones, or zeros
        if k in sd:
            rows = getattr(model, "vocab_padding", {}).get(k)
            if rows is None or tuple(rows.shape) != (pad, *sd[k].shape[1:]):
                rows = sd[k].new_zeros(pad, *sd[k].shape[1:])
            sd[k] = torch.cat([sd[k].detach(), rows.to(sd[k].dtype)])
    if hybrid:
        sd = to_checkpoint_names(format, spec, sd)
        conf = config_json
    elif format == "hf":
        cfg = model.cfg
        sd = {("backbone.embeddings.weight" if k == "backbone.embedding.weight" else k): v for k, v in sd.items()}
        if cfg.tie_embeddings:
            sd["lm_head.weight"] = sd["backbone.embeddings.weight"]  # written twice (the writer copies nothing)
        conf = cfg.to_hf_json()
    else:
        conf = model.cfg.to_mamba_ssm_json()
    with _paths.staged_output(outdir, force=force, force_foreign=force_foreign,
                              owned=checkpoint_foreign_reason) as tmp:
        (tmp / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
        _write_safetensors(sd, tmp / "model.safetensors", {"format": "pt", WRITTEN_BY[0]: WRITTEN_BY[1]}, dtype)
    return Path(outdir).absolute()


#: how many times :func:`random_checkpoint` calls its ``progress`` (one per step)
RANDOM_CHECKPOINT_STEPS = 3


def random_checkpoint(outdir: str | os.PathLike, *, preset: str | None = None, format: str = "mamba_ssm",
                      seed: int = 0, dtype: torch.dtype | None = None, force: bool = False,
                      force_foreign: bool = False, config_json: dict | None = None, config_source: str | None = None,
                      progress=None, **overrides) -> Path:
    """Write a randomly initialised checkpoint (mamba_ssm init, see :func:`init_weights_`).

    Args:
        preset: a key of :data:`m2export.models.config.PRESETS` (e.g. 'mamba2-130m') or of
            :data:`m2export.models.presets.HYBRID_PRESETS` (e.g. 'nemotron-h-8b'), or None to give
            d_model/n_layer/vocab_size in ``overrides`` (or a ``config_json``).
        config_json: a parsed HF config.json (any supported family) to write random weights for; ``format``
            is then the family's own.
        config_source: where ``config_json`` came from (a path), named by its errors (default: "config").
        overrides: any :class:`Mamba2Config` field (Mamba-2 presets); config.json keys (hybrid presets).
        force, force_foreign: as in :func:`save_checkpoint` (a non-empty ``outdir`` is refused by default).
        progress: called with each step's description before it runs (:data:`RANDOM_CHECKPOINT_STEPS` of them:
            building the model, initialising its weights, writing the files), or None.
    Raises:
        ConfigError: unknown/unavailable preset, or a config the family reader refuses.
    """
    from m2export.models.presets import HYBRID_PRESETS, UNAVAILABLE, preset_config

    step = progress or (lambda what: None)
    # refuse the output folder before the model is built (tens of seconds for a full-size preset)
    _paths.check_target(Path(outdir).absolute(), force=force, force_foreign=force_foreign, protect=(),
                        owned=checkpoint_foreign_reason)
    if config_json is None and preset is not None and (preset in HYBRID_PRESETS or preset in UNAVAILABLE):
        _, config_json = preset_config(preset)
        config_json.update(overrides)
        overrides = {}
    if config_json is not None:
        raw = decode_hf_floats(dict(config_json))
        source = f"preset {preset}" if preset else (config_source or "config")
        fam = detect_format(raw, source)
        if fam in READERS:
            spec = READERS[fam](raw, source)
            _check_fits_memory(spec, None, dtype)
            step("building the model")
            model = _built_in(dtype, lambda: HybridLM(spec))
            step("initialising the weights")
            init_weights_(model, seed=seed)
            step(f"writing {outdir}")
            return save_checkpoint(model, outdir, format=fam, dtype=dtype, force=force, force_foreign=force_foreign,
                                   config_json=config_json)
        cfg = Mamba2Config.from_mamba_ssm_json(raw) if fam == "mamba_ssm" else Mamba2Config.from_hf_json(raw)
        fields, format = dataclasses.asdict(cfg), fam
    else:
        if preset is not None and preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; expected one of "
                              f"{sorted(PRESETS) + sorted(HYBRID_PRESETS)}")
        fields = dict(PRESETS[preset]) if preset else {}
    fields.update(overrides)
    cfg = Mamba2Config(**fields)
    _check_fits_memory(None, cfg, dtype)
    step("building the model")
    model = Mamba2LMHeadModel(cfg)
    step("initialising the weights")
    init_weights_(model, seed=seed)
    step(f"writing {outdir}")
    return save_checkpoint(model, outdir, format=format, dtype=dtype, force=force, force_foreign=force_foreign)


def _check_fits_memory(spec: ModelSpec | None, cfg: Mamba2Config | None, dtype: torch.dtype | None) -> None:
    """Refuse (ParameterError) a random checkpoint whose weights alone exceed this machine's physical memory
    (counted on the meta device, no memory used): they are built in memory before they are written, and such
    sizes were torch's allocation failure (exit 70) or, below the size of one allocation, the OOM killer."""
    from m2export.check.console import human_bytes
    from m2export.errors import ParameterError

    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX: nothing to compare with
        return
    meta = _meta_model(spec, cfg, dtype)
    tensors = {id(t): t for t in [*meta.parameters(), *meta.buffers()]}.values()  # tied weights once
    need = sum(t.numel() * t.element_size() for t in tensors)
    if need > memory:
        raise ParameterError(f"random checkpoint: its weights alone are {human_bytes(need)}, more than this "
                             f"machine's {human_bytes(memory)} of memory (they are built in memory, then written)",
                             hint="ask for a smaller shape (`d_model`, `n_layer`, `vocab_size`, ...) or a "
                                  "smaller `dtype`")


def _built_in(dtype: torch.dtype | None, make):
    """``make()`` with ``dtype`` as torch's default dtype (no float32 copy of a large model)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype or torch.float32)
    try:
        return make()
    finally:
        torch.set_default_dtype(prev)
