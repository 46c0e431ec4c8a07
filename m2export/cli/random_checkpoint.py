"""``m2export random-checkpoint``: write a randomly initialised Mamba-2 checkpoint."""

from __future__ import annotations

HELP = "write a checkpoint of random weights (mamba_ssm's init for the Mamba layers) of a preset or custom shape"
DESCRIPTION = """Write config.json + model.safetensors of a randomly initialised model, for testing exports at any
size; such checkpoints are generated on demand, never committed. Every model, hybrids included, gets one init
(m2export.models.mamba2.init_weights_): the Mamba layers mamba_ssm's (A_log ~ log U[1,16], dt_bias = the inverse
softplus of a log-uniform dt in [1e-3, 0.1], D = 1, out_proj scaled by 1/sqrt(n_layer)); every other weight
(attention, MLPs, MoE experts, shared blocks, conv1d) PyTorch's default U(+-1/sqrt(fan_in)), the embedding and
MoE routers N(0, 0.02) (their score-correction bias 0), norms 1, every other bias random (not zero, as
mamba_ssm's are). Deterministic per --seed.

examples:
  m2export random-checkpoint --preset tiny-mamba2 -o ckpt/tiny-mamba2
  m2export random-checkpoint --d-model 64 --n-layer 2 --vocab-size 256 --ngroups 2 --chunk-size 16 -o ckpt/tiny
  m2export random-checkpoint --d-model 64 --n-layer 2 --vocab-size 256 --format hf -o ckpt/tiny-hf
  m2export random-checkpoint --config ckpt/tiny-hf/config.json -o ckpt/same-shape
  m2export random-checkpoint --preset tiny-nemotron-h -o ckpt/tiny-nemotron-h

Test shapes (no published model; the written folder's size in fp32): tiny-mamba2 (0.3 MB; pure Mamba-2, 2 layers,
ngroups 2, mamba_ssm format), tiny-nemotron-h (0.6 MB; attention, MoE, MLP and Mamba layers), tiny-granite-4.0-h
(1.0 MB), tiny-bamba (0.6 MB), tiny-falcon-h1 (0.8 MB; muP multipliers), tiny-zamba2 (1.4 MB; shared blocks,
adapters).
Published shapes: --preset mamba2-130m -o ckpt/m2-130m (0.5 GB of fp32 weights), --preset nemotron-nano-9b-v2
--dtype bf16 (a 9B hybrid). Hybrid presets (Nemotron-H, Granite 4.0-H, Bamba, ...) write the family's HF format; the
numbers' sources, and the fields whose published value was not found (a warning names them), are in
m2export/models/presets.py.
"""

PARAM_FLAGS = {"outdir": "--output", "config_json": "--config"}  # random_checkpoint's parameter -> this verb's flag


def add_arguments(p):
    from m2export.cli.argtypes import non_negative_int, positive_int
    from m2export.models.config import PRESETS
    from m2export.models.presets import HYBRID_PRESETS, UNAVAILABLE

    p.add_argument("-o", "--output", required=True, help="output directory (must be empty or absent)")
    p.add_argument("--force", action="store_true",
                   help="replace OUTPUT if it holds a checkpoint m2export wrote (anything else is refused)")
    p.add_argument("--force-foreign", action="store_true",
                   help="with --force, replace OUTPUT even if m2export did not write it (its contents are deleted)")
    p.add_argument("--preset", choices=sorted(PRESETS) + sorted(HYBRID_PRESETS) + sorted(UNAVAILABLE),
                   help="published model shape (hybrid presets: m2export.models.presets, with their sources)")
    p.add_argument("--config", metavar="CONFIG_JSON",
                   help="write random weights for this config.json (any supported family) instead of a preset")
    p.add_argument("--format", choices=["mamba_ssm", "hf"], default=None,
                   help="file format of a Mamba-2 shape (a Mamba-2 --preset or the shape flags): mamba_ssm "
                        "(state-spaces/mamba's config.json and tensor names) or hf (transformers' Mamba2) (default: "
                        "mamba_ssm); hybrid presets and --config write their family's own format")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="fp32", help="stored tensor dtype")
    p.add_argument("--seed", type=non_negative_int, default=0, metavar="N", help="(default: %(default)s)")
    g = p.add_argument_group("Shape (override the preset)")
    for f in ("d-model", "n-layer", "vocab-size", "d-state", "headdim", "ngroups", "expand", "d-conv", "chunk-size"):
        g.add_argument(f"--{f}", type=positive_int, metavar="N")


def run(args) -> int:
    import torch

    from m2export.errors import ConfigError, UsageError
    from m2export.models.checkpoint import random_checkpoint

    fields = {k: getattr(args, k) for k in ("d_model", "n_layer", "vocab_size", "d_state", "headdim", "ngroups",
                                            "expand", "d_conv", "chunk_size") if getattr(args, k) is not None}
    from m2export.models.presets import HYBRID_PRESETS, UNAVAILABLE

    # the command line's own contradictions first (exit 2, before --config is read)
    hybrid = args.config is not None or args.preset in HYBRID_PRESETS or args.preset in UNAVAILABLE
    if hybrid and fields:
        raise UsageError(f"--{sorted(fields)[0].replace('_', '-')} applies to Mamba-2 shapes only; edit the "
                         "config.json of a hybrid instead (--config)")
    if args.preset is not None and args.config is not None:
        raise UsageError("give --preset or --config, not both")
    if hybrid and args.format is not None:
        raise UsageError(f"--format {args.format} applies to Mamba-2 shapes only; "
                         + ("--config" if args.config is not None else f"--preset {args.preset}")
                         + " writes its family's own format", hint="drop --format")
    if not hybrid and args.preset is None and not {"d_model", "n_layer", "vocab_size"} <= set(fields):
        raise UsageError("give --preset or all of --d-model, --n-layer, --vocab-size (or --config CONFIG_JSON)")
    config_json = None
    if args.config is not None:
        from m2export.models.checkpoint import read_config_json

        config_json = read_config_json(args.config)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from m2export.models.checkpoint import RANDOM_CHECKPOINT_STEPS

    # the steps on stderr (a full-size preset takes tens of seconds on a CPU), the result on stdout
    # (started by the first step: a refused config or output folder is its error line alone)
    bar = Progress(TextColumn("[bold]random-checkpoint[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.description}"), console=Console(stderr=True), disable=args.quiet)
    task = bar.add_task("starting", total=RANDOM_CHECKPOINT_STEPS)

    def step(what: str) -> None:
        first = bar.tasks[0].description == "starting"
        if not first:
            bar.advance(task)
        bar.update(task, description=what)
        if first:
            bar.start()
    try:
        out = random_checkpoint(args.output, preset=args.preset, format=args.format or "mamba_ssm", seed=args.seed, dtype=dtype,
                                force=args.force, force_foreign=args.force_foreign, config_json=config_json,
                                config_source=args.config, progress=step, **fields)
        bar.update(task, completed=RANDOM_CHECKPOINT_STEPS, description="done")
    except ConfigError as e:
        if hybrid:  # a config.json's (or a hybrid preset's) own fields: bad input, exit 1
            raise
        # a Mamba-2 shape is the flags' (and --preset's): values that contradict each other are a usage error
        raise UsageError(e.raw_message, hint="the shape flags (--d-model, --expand, --headdim, --ngroups, ...) and "
                                             "--preset must describe one Mamba-2 model") from None
    finally:
        if bar.live.is_started:  # (stop() on a bar never started prints an empty line)
            bar.stop()
    if not args.quiet:  # the result on stdout
        from m2export.check.console import write_stdout

        write_stdout(f"wrote {out}\n")
    return 0
