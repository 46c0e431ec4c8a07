"""``genai_config.json`` for onnxruntime-genai, so ``onnxruntime_genai.Model(OUTDIR)`` generates from an export.

onnxruntime-genai (0.18) runs one decoder session for prefill and decode and carries per-layer states
by name templates (``%d`` = layer index) from its config:

* ``model.decoder.inputs.past_conv_names`` / ``outputs.present_conv_names``: the conv states,
  ``past_recurrent_names`` / ``present_recurrent_names``: the ssm states (read from the graph's I/O,
  e.g. ``past_conv_state.%d`` / ``present_conv_state.%d``), and ``past_key_names`` / ``past_value_names``
  with their present names for attention KV caches when the graph has them (hybrids);
* ``model.decoder.state_groups``: ``{"kind": "fixed_conv" | "fixed_recurrent", "layer_ids": [...]}`` naming
  the layers that have each state (state groups of kind ``"fixed"`` are rejected by 0.18);
* ``model.type``: ``"granitemoehybrid"``, genai's Mamba-2 (+ attention) family; genai 0.18 rejects
  ``"mamba2"`` ("Unsupported model_type"). Checked with genai 0.18.0 on CPU (``tests/exporter/test_genai.py``),
  hybrids included (``tests/exporter/test_hybrids_export.py``: Nemotron-H, Granite 4.0-H, Bamba, Falcon-H1, Zamba2;
  genai takes KV caches on a subset of the layers, e.g. Zamba2's hybrid layers, and Mamba states on another).

Sources: onnxruntime-genai ``src/python/py/models/builders/base.py`` (``make_genai_config``,
``make_decoder_state_groups``) and its config parser's error messages. The config points at the
prefill graph of the native flavour when the export has it (ONNX Runtime's own kernels), else at the primary
``model.onnx``. Tokenizer files of the checkpoint, when it has them, are copied next to the config.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any


GENAI_CONFIG_FILE = "genai_config.json"
#: genai's model type used for Mamba-2 and its attention hybrids (see the module docstring)
GENAI_MODEL_TYPE = "granitemoehybrid"
#: files onnxruntime-genai's tokenizer (onnxruntime-extensions) reads, copied when the checkpoint has them
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json")
#: graph state name (kind + index) -> genai config keys of its input and output templates
_STATE_KEYS = {"conv_state": ("past_conv_names", "present_conv_names", "fixed_conv"),
               "ssm_state": ("past_recurrent_names", "present_recurrent_names", "fixed_recurrent"),
               "key": ("past_key_names", "present_key_names", None),
               "value": ("past_value_names", "present_value_names", None)}
_INDEXED = re.compile(r"^(.*?)(\d+)(.*)$")


def _templates(names: list[str]) -> dict[str, tuple[str, list[int]]]:
    """``past_conv_state.3`` ... -> {"conv_state": ("past_conv_state.%d", [layer ids])} for known state kinds."""
    out: dict[str, tuple[str, list[int]]] = {}
    for name in names:
        m = _INDEXED.match(name)
        if not m:
            continue
        head, idx, tail = m.groups()
        template = f"{head}%d{tail}"
        kind = next((k for k in _STATE_KEYS if (head + tail).rstrip(".").endswith(k)), None)
        if kind is None:
            continue
        prev = out.setdefault(kind, (template, []))
        if prev[0] != template:
            raise ValueError(f"{name}: state names of kind {kind} follow two templates ({prev[0]}, {template})")
        prev[1].append(int(idx))
    return out


def genai_config(manifest, graph, *, checkpoint_config: dict[str, Any] | None = None,
                 context_length: int = 4096) -> dict[str, Any]:
    """The genai_config.json dict for ``graph`` (a manifest GraphEntry with dynamic sequence length).

    Token ids (bos/eos/pad) come from the checkpoint's config.json when it has them, else 0 (the
    end-of-text id of the GPT-NeoX tokenizer Mamba-2 checkpoints use; NUL for byte vocabularies).
    Raises ValueError when the graph's state names do not pair up past -> present.
    """
    ck = checkpoint_config or {}
    ins, outs = _templates(list(graph.inputs)), _templates(list(graph.outputs))
    if set(ins) != set(outs) or any(sorted(ins[k][1]) != sorted(outs[k][1]) for k in ins):
        raise ValueError(f"{graph.file}: past states {sorted(ins)} do not pair with present states {sorted(outs)}")
    inputs: dict[str, Any] = {"input_ids": "input_ids"}
    outputs: dict[str, Any] = {"logits": "logits"}
    groups = []
    for kind, (past_key, present_key, group) in _STATE_KEYS.items():
        if kind not in ins:
            continue
        inputs[past_key], outputs[present_key] = ins[kind][0], outs[kind][0]
        if group:
            groups.append({"kind": group, "layer_ids": sorted(ins[kind][1])})

    spec = manifest.model_spec()
    vocab = spec.vocab_size  # the logits' width (the lm_head's padding rows are not in the graph)
    at = next((spec.layers[i].attention_in(spec.shared_blocks) for i in spec.attention_layers), None)
    mb = spec.layers[spec.mamba_layers[0]].mamba if spec.mamba_layers else None

    def token(name):
        v = ck.get(name)
        v = v[0] if isinstance(v, list) and v else v
        return int(v) if isinstance(v, int) and 0 <= v < vocab else 0

    # attention geometry from the attention layers when the model has them, else the Mamba heads
    attn_heads = at.num_heads if at is not None else mb.nheads
    kv_heads = at.num_kv_heads if at is not None else attn_heads
    head_size = at.head_dim if at is not None else mb.headdim
    return {
        "model": {
            "bos_token_id": token("bos_token_id"),
            "context_length": context_length,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": graph.file,
                "head_size": head_size,
                "hidden_size": spec.d_model,
                "inputs": inputs,
                "outputs": outputs,
                "num_attention_heads": attn_heads,
                "num_hidden_layers": spec.n_layer,
                "num_key_value_heads": kv_heads,
                "state_groups": groups,
            },
            "eos_token_id": token("eos_token_id"),
            "pad_token_id": token("pad_token_id"),
            "type": GENAI_MODEL_TYPE,
            "vocab_size": vocab,
        },
        "search": {"diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
                   "max_length": context_length, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
                   "num_return_sequences": 1, "past_present_share_buffer": False, "repetition_penalty": 1.0,
                   "temperature": 1.0, "top_k": 1, "top_p": 1.0},
    }


def write_genai_files(outdir: str | Path, manifest, checkpoint_dir: str | Path | None) -> list[str]:
    """Write OUTDIR/genai_config.json and copy the checkpoint's tokenizer files; returns the file names written.

    The decoder is the native flavour's prefill graph when the export has one, else the primary prefill graph.
    """
    out = Path(outdir)
    impls = manifest.ssm_impls()
    graph = manifest.graph("prefill", "native" if "native" in impls else None)
    ck_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
    if ck_dir is not None and ck_dir.is_file():
        ck_dir = ck_dir.parent
    ck_cfg = {}
    if ck_dir is not None and (ck_dir / "config.json").is_file():
        try:
            ck_cfg = json.loads((ck_dir / "config.json").read_text())
        except ValueError:
            ck_cfg = {}
    written = [GENAI_CONFIG_FILE]
    (out / GENAI_CONFIG_FILE).write_text(json.dumps(genai_config(manifest, graph, checkpoint_config=ck_cfg),
                                                    indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if ck_dir is not None and (ck_dir / name).is_file():
            shutil.copyfile(ck_dir / name, out / name)
            written.append(name)
    return written
