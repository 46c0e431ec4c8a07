"""``m2export random-checkpoint``: write a randomly initialised Mamba-2 checkpoint."""

from __future__ import annotations

HELP = "write a randomly initialised checkpoint (mamba_ssm init) of a preset or custom shape"
DESCRIPTION = """Write config.json + model.safetensors of a randomly initialised Mamba-2 (mamba_ssm's init:
A_log ~ log U[1,16], dt_bias = inverse-softplus of log-uniform dt in [1e-3, 0.1]). For testing exports
at full size; such checkpoints are generated on demand, never committed.

examples:
  m2export random-checkpoint --preset mamba2-130m -o /tmp/m2-130m
  m2export random-checkpoint --d-model 256 --n-layer 4 --vocab-size 256 --ngroups 2 --format hf -o /tmp/tiny
"""


def add_arguments(p):
    from m2export.models.config import PRESETS

    p.add_argument("-o", "--output", required=True, help="output directory (must be empty or absent)")
    p.add_argument("--force", action="store_true", help="replace OUTPUT if it exists and is not empty")
    p.add_argument("--preset", choices=sorted(PRESETS), help="published model shape")
    p.add_argument("--format", choices=["mamba_ssm", "hf"], default="mamba_ssm")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="fp32", help="stored tensor dtype")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("Shape (override the preset)")
    for f in ("d-model", "n-layer", "vocab-size", "d-state", "headdim", "ngroups", "expand", "d-conv", "chunk-size"):
        g.add_argument(f"--{f}", type=int)


def run(args) -> int:
    import logging

    import torch

    from m2export.errors import ConfigError, OutputFolderError
    from m2export.models.checkpoint import random_checkpoint

    fields = {k: getattr(args, k) for k in ("d_model", "n_layer", "vocab_size", "d_state", "headdim", "ngroups",
                                            "expand", "d_conv", "chunk_size") if getattr(args, k) is not None}
    if args.preset is None and not {"d_model", "n_layer", "vocab_size"} <= set(fields):
        raise ConfigError("give --preset or all of --d-model, --n-layer, --vocab-size")
    from pathlib import Path

    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise OutputFolderError(f"{out}: exists and is not a directory", hint="choose another -o")
    if out.exists() and not args.force and any(out.iterdir()):
        raise OutputFolderError(f"{out}: exists and is not empty", hint="pass --force to replace it, or choose another -o")
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    try:
        out = random_checkpoint(out, preset=args.preset, format=args.format, seed=args.seed, dtype=dtype, **fields)
    except OSError as e:
        raise OutputFolderError(f"{out}: cannot write the checkpoint ({e.strerror or e})",
                                hint="choose a writable -o") from None
    logging.getLogger("m2export").info("wrote %s", out)
    return 0
