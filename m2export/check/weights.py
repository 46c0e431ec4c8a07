"""One copy of the weights for the PyTorch reference and ONNX Runtime: the export's memory-mapped arrays.

``m2export check`` hands ONNX Runtime the export's external initializers as read-only views of the memory-mapped
``model.onnx.data`` (:class:`~m2export.check.runners.SharedInitializers`). :class:`ExportWeights` offers the
same arrays to the reference's checkpoint loader (``load_checkpoint(share=...)``): for every tensor of the
PyTorch model it proposes export arrays of the same dtype and shape, or of the shape with the last two axes
swapped (the built graphs store the projections transposed: ``layers.N/in_proj.weight_t``, ``lm_head.weight_t``;
the reference then uses a transposed view, which ``F.linear`` and ``F.embedding`` read in place), which agree
with the checkpoint's tensor at a few sampled elements. The loader takes the first candidate whose bits equal
the checkpoint tensor's in every element (:func:`m2export.models.checkpoint.bit_equal`) and keeps the
checkpoint's own tensor otherwise.

What this keeps of the check's guarantee: the reference computes with exactly the checkpoint's values (a shared
tensor is bit-equal to the checkpoint's, checked element by element at load; the checkpoint itself is the one
the export was made from, by its sha256). An export weight that differs from the checkpoint's is simply not
shared: the reference keeps the checkpoint's tensor, the runtimes compute with the export's, and the comparison
fails as it did before any sharing; the report names the tensors that were not shared
(:meth:`ExportWeights.summary`). Matching is by content, not by name, so it needs no map of the exporter's
initializer names (equal tensors stored once under one name, ``model.onnx.data`` deduplicates, match too). The
mapped files must not change while the check runs (both sides read them): :meth:`ExportWeights.unchanged` says
whether they did.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Iterator

import numpy as np

#: elements of a tensor sampled before the full comparison (evenly spaced, first and last included)
SAMPLES = 64

_TORCH_OF_NUMPY = {"float32": "float32", "float16": "float16", "float64": "float64"}


class ExportWeights:
    """Candidate views of an export's weights for :func:`~m2export.models.checkpoint.load_checkpoint`'s ``share``.

    Args:
        shared: the check's :class:`~m2export.check.runners.SharedInitializers` (the arrays ONNX Runtime gets).
        graphs: the export's ONNX files whose external initializers are offered.

    Calling it as ``weights(name, tensor)`` yields ``(torch view, label)`` pairs; the torch views are read-only
    (a write to one would fault, never change a weight silently). :meth:`summary` describes, after the load,
    which tensors the reference shares (``LoadedCheckpoint.shared``).
    """

    def __init__(self, shared, graphs: list[Path]):
        self._index: dict[tuple, list[tuple[np.ndarray, str, bool]]] = {}
        self._files: dict[Path, tuple[int, int, int]] = {}
        seen: set[int] = set()
        for g in graphs:
            for name, arr in shared.arrays(Path(g)).items():
                if id(arr) in seen or arr.dtype.name not in _TORCH_OF_NUMPY:
                    continue
                seen.add(id(arr))
                file = shared.file_of(arr)
                label = f"{file.name if file else 'export'}:{name}"
                self._index.setdefault((arr.dtype.str, arr.shape), []).append((arr, label, False))
                if arr.ndim >= 2 and arr.shape[-1] != arr.shape[-2]:
                    swapped = arr.shape[:-2] + (arr.shape[-1], arr.shape[-2])
                    self._index.setdefault((arr.dtype.str, swapped), []).append((arr, label + " (transposed)", True))
        for file in shared.files():
            st = os.stat(file)
            self._files[file] = (st.st_ino, st.st_size, st.st_mtime_ns)

    def __call__(self, name: str, tensor) -> Iterator[tuple[object, str]]:
        import torch

        if tensor.dtype not in (torch.float32, torch.float16, torch.float64):
            return
        np_dtype = np.dtype(str(tensor.dtype).removeprefix("torch."))
        cands = self._index.get((np_dtype.str, tuple(tensor.shape)), [])
        if not cands:
            return
        flat = tensor.reshape(-1)
        n = flat.numel()
        idx = np.unique(np.linspace(0, n - 1, num=min(n, SAMPLES)).astype(np.int64))
        want = flat[torch.from_numpy(idx)].numpy().view(f"u{np_dtype.itemsize}")
        where = np.unravel_index(idx, tuple(tensor.shape))
        for arr, label, transposed in cands:
            logical = arr.swapaxes(-1, -2) if transposed else arr
            if not np.array_equal(np.ascontiguousarray(logical[where]).view(want.dtype), want):
                continue
            with warnings.catch_warnings():  # read-only mapped pages: the reference never writes its weights
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                view = torch.from_numpy(arr)
            yield (view.transpose(-1, -2) if transposed else view), label

    def unchanged(self) -> list[str]:
        """The mapped weight files that changed (inode, size or modification time) since they were indexed."""
        changed = []
        for file, was in self._files.items():
            try:
                st = os.stat(file)
                now = (st.st_ino, st.st_size, st.st_mtime_ns)
            except OSError:
                now = None
            if now != was:
                changed.append(str(file))
        return changed

    @staticmethod
    def summary(model, shared: dict[str, str]) -> dict:
        """What the reference's tensors are: {"shared_tensors", "shared_bytes", "own_tensors", "own_bytes",
        "own": [names of the tensors that are the checkpoint's own copy, largest first]} for the model's
        state dict (aliases counted once) and the loader's ``shared`` (name -> label)."""
        out = {"shared_tensors": 0, "shared_bytes": 0, "own_tensors": 0, "own_bytes": 0, "own": []}
        own = []
        seen: set[int] = set()
        for k, t in model.state_dict(keep_vars=True).items():
            if id(t) in seen:
                continue
            seen.add(id(t))
            nbytes = t.numel() * t.element_size()
            kind = "shared" if k in shared else "own"
            out[f"{kind}_tensors"] += 1
            out[f"{kind}_bytes"] += nbytes
            if kind == "own":
                own.append((nbytes, k))
        out["own"] = [k for _, k in sorted(own, key=lambda x: (-x[0], x[1]))]
        return out
