"""The vocabulary the CLI and the library share: runtimes, graph flavours, TensorRT plugin modes.

One set of names, spelled the same in every verb, in ``m2export.json``, in reports and in the docs:

* **runtimes** (``check --runtime``, ``generate --runtime``): ``torch`` (the PyTorch reference),
  ``onnxrt`` (ONNX Runtime, CPU provider; Polygraphy's name), ``onnx-reference`` (ONNX's Python
  reference evaluator), ``trt`` (TensorRT engines).
* **graph flavours** (``export --ssm-impl``, ``generate --ssm-impl``; the ``ssm_impl`` field of
  ``m2export.json``): ``ssmscan`` (one ``m2export::SSMScan`` custom-op node per layer, with a model-local
  ONNX function holding its semantics: ``model.onnx``) and ``std`` (standard ONNX ops only, no custom
  domain: ``model.std.onnx``) and ``native`` (ONNX Runtime's fused kernels: ``com.microsoft``
  ``LinearAttention``, ``CausalConvWithState``, RMSNorm ops; opset 27: ``model.native.onnx``). All are ONNX graphs; ``both``
  exports ssmscan and std, ``all`` the three.
* **TensorRT plugin modes** (``build --plugin``): ``jit`` (the kernel runs from Python) and ``aot``
  (the kernel is embedded in the engine as PTX). "plugin" names only this.

Old spellings (``ort``; flavours ``plugin`` and ``onnx``) are accepted until :data:`ALIASES_REMOVED_IN`
with a deprecation note (:func:`canonical`); manifests written with them are read as the new names.
"""

from __future__ import annotations

import warnings

RUNTIMES = {
    "torch": "PyTorch reference (fp32)",
    "onnxrt": "ONNX Runtime, CPU provider",
    "onnx-reference": "ONNX's Python reference evaluator (any dtype, bf16 included; slow)",
    "trt": "TensorRT engines (needs TensorRT and an NVIDIA GPU)",
}
FLAVOURS = {
    "ssmscan": "one m2export::SSMScan custom-op node per layer + its model-local ONNX function",
    "std": "standard ONNX ops only (no custom domain)",
    "native": "ONNX Runtime's fused kernels (com.microsoft LinearAttention, CausalConvWithState, RMSNorm)",
}
REFERENCE_RUNTIME = "torch"  # what check compares every other runtime with
BOTH = "both"
ALL = "all"
#: the flavours each group name exports, primary (model.onnx) first
GROUPS = {BOTH: ("ssmscan", "std"), ALL: ("ssmscan", "std", "native")}
PLUGIN_MODES = {
    "jit": "the plugin runs the cuTile kernel from Python at inference time",
    "aot": "the cuTile kernel is compiled to PTX and embedded in the engine",
}

#: the primary flavour (model.onnx); the other one gets a ``.std.onnx`` suffix
PRIMARY_FLAVOUR = "ssmscan"
#: file-name infix of the std flavour's graphs (model.std.onnx)
STD_SUFFIX = ".std"
#: file-name infix of each non-primary flavour's graphs (model.std.onnx, model.native.onnx)
FLAVOUR_SUFFIX = {"std": STD_SUFFIX, "native": ".native"}

#: the optimization profile (min, opt, max) of ``m2export build`` unless told otherwise, per dynamic axis
#: (batch_size, sequence_length); here so the CLI's --help needs no heavy import
DEFAULT_PROFILE = {"batch": (1, 1, 8), "seq": (1, 128, 2048)}

#: old spelling -> name, per kind; accepted (with a note) until ALIASES_REMOVED_IN
ALIASES = {
    "runtime": {"ort": "onnxrt"},
    "flavour": {"plugin": "ssmscan", "onnx": "std"},
}
ALIASES_REMOVED_IN = "0.3"

_KNOWN = {"runtime": set(RUNTIMES), "flavour": set(FLAVOURS) | set(GROUPS)}


def deprecation_note(kind: str, old: str, new: str, *, flag: str | None = None) -> str:
    what = f"{flag} {old}" if flag else f"{kind} {old!r}"
    use = f"{flag} {new}" if flag else repr(new)
    return f"note: {what} is deprecated; use {use} (the old name is accepted until m2export {ALIASES_REMOVED_IN})"


def canonical(kind: str, value: str | None, *, warn: bool = True) -> str | None:
    """``value`` in the current vocabulary: an old spelling becomes its new name (with a
    ``DeprecationWarning`` when ``warn``); anything else (None included) is returned unchanged."""
    if value is None:
        return None
    new = ALIASES[kind].get(value)
    if new is None:
        return value
    if warn:
        warnings.warn(deprecation_note(kind, value, new), DeprecationWarning, stacklevel=3)
    return new


def cli_type(kind: str, flag: str):
    """argparse ``type=`` for ``flag``: old spellings become the new names with a note on stderr; use
    with ``choices`` = the new names (so ``--help`` lists only those)."""
    import sys

    def convert(text: str) -> str:
        new = ALIASES[kind].get(text)
        if new is None:
            return text
        print(deprecation_note(kind, text, new, flag=flag), file=sys.stderr)
        return new

    convert.__name__ = kind  # argparse names the type in its 'invalid ... value' message
    return convert
