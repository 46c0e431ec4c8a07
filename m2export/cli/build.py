"""``m2export build``: TensorRT engines from an export folder."""

from __future__ import annotations

HELP = "build the TensorRT engine (model.plan) from an export folder"
DESCRIPTION = """Build one TensorRT engine from the ONNX graph of an export folder with Polygraphy's TensorRT
backend: a prefill and a decode optimization profile sharing the weights (batch and sequence length ranges
below; sequence length 1 in the decode profile; KV caches' past_sequence_length 0..--max-seq), a strongly
typed network (precision = the ONNX dtypes), the m2export::SSMScan plugin registered first. Writes
OUTDIR/model.plan and records it (TensorRT version, GPU, profiles, plugin mode) in OUTDIR/m2export.json. Needs TensorRT >= 10.7 and an NVIDIA GPU;
engines are specific to that GPU architecture and TensorRT version.

plugin modes:
  jit  the plugin runs the cuTile kernel from Python at inference time: the runtime needs Python, torch,
       cuda-tile and 'import m2export.plugins' before deserializing (m2export check/generate do this)
  aot  the cuTile kernel is compiled to PTX for this GPU and embedded in the engine: any TensorRT runtime
       (trtexec, C++) runs it, no Python and no plugin library needed

exit codes: 0 engines written; 1 a bad path or graph (a missing or unreadable .onnx), a failed build, or an
engine file in OUTDIR that m2export.json does not list (never replaced: a user's own model.plan);
2 a flag's value malformed or out of range (--min-batch 0, --min-seq > --max-seq, --workspace lots); 4 TensorRT is not installed (checked before any graph is read), no CUDA GPU, or the
SSMScan plugin cannot be registered.

examples:
  m2export build out/tiny --skip-if-unavailable   # where TensorRT may be missing: a note and exit 0 instead of 4
  m2export build out/tiny        # needs TensorRT and an NVIDIA GPU (exit 4 without)
  m2export build out/tiny --plugin aot --max-batch 16 --max-seq 4096   # needs TensorRT and a GPU
  m2export build out/tiny-fp16/model.std.onnx --opt-batch 8 --workspace 8G --opt-level 5   # needs TensorRT and a GPU
"""


def add_arguments(p):
    from m2export.cli.argtypes import positive_int
    from m2export.names import DEFAULT_PROFILE

    p.add_argument("path", metavar="OUTDIR|MODEL.onnx", help="export folder, or one of its .onnx graphs")
    p.add_argument("--plugin", choices=["jit", "aot"], default="jit", help="SSMScan plugin mode (default: jit)")
    p.add_argument("--role", choices=["prefill", "decode", "both"], default="both",
                   help="optimization profiles of the one engine (default: both: a prefill and a decode profile "
                        "sharing the weights, model.plan); decode: a decode-only engine model.decode.plan with "
                        "sequence_length the constant 1 (with --plugin aot it embeds the decode-step kernel), used "
                        "for decode steps beside model.plan")
    p.add_argument("--skip-if-unavailable", action="store_true",
                   help="without TensorRT or a GPU, say so and exit 0 instead of exit 4 (scripts that run anywhere)")
    g = p.add_argument_group("Optimization profile")
    for dim, (lo, opt, hi) in DEFAULT_PROFILE.items():
        what = "batch size" if dim == "batch" else ("sequence length (prefill profile; KV caches' "
                                                    "past_sequence_length spans 0..max)")
        g.add_argument(f"--min-{dim}", type=positive_int, default=lo, metavar="N", help=f"smallest {what} (default: {lo})")
        g.add_argument(f"--opt-{dim}", type=positive_int, default=opt, metavar="N", help=f"{what} TensorRT tunes for (default: {opt})")
        g.add_argument(f"--max-{dim}", type=positive_int, default=hi, metavar="N", help=f"largest {what} (default: {hi})")
    g = p.add_argument_group("Builder")
    g.add_argument("--workspace", help="workspace memory limit, e.g. 4G (default: TensorRT's, the device memory)")
    g.add_argument("--opt-level", type=int, choices=range(6), metavar="0-5",
                   help="builder optimization level (default: TensorRT's, 3)")
    g.add_argument("--timing-cache", metavar="FILE",
                   help="timing cache to reuse and update, recorded in m2export.json (default: the one it records "
                        "from the last build, else OUTDIR/.timing.cache); a file outside OUTDIR is never deleted by "
                        "'export --force', one inside it under another name is refused by it")
    g.add_argument("--no-timing-cache", action="store_true", help="build without a timing cache")
    g.add_argument("--aot-ptx-isa", metavar="MAJOR.MINOR",
                   help="rewrite the AOT kernel's PTX ISA header (for a driver older than cuda-tile's toolkit; "
                        "only if 'm2export check' then passes)")


def run(args) -> int:
    from m2export.errors import BackendUnavailable, UsageError
    from m2export.inspect import load_onnx_structure
    from m2export.trt.build import (build_engines, parse_size, require_gpu, require_tensorrt,
                                    resolve_targets)

    isa = None
    if args.aot_ptx_isa:
        try:
            major, minor = (int(v) for v in args.aot_ptx_isa.split("."))
        except ValueError:
            raise UsageError(f"--aot-ptx-isa: expected MAJOR.MINOR such as 9.0, got {args.aot_ptx_isa!r}") from None
        isa = (major, minor)
    cache = False if args.no_timing_cache else (args.timing_cache or True)
    roles = ("prefill", "decode") if args.role == "both" else (args.role,)
    batch, seq = (_flag_range(args, dim) for dim in ("batch", "seq"))
    workspace = parse_size(args.workspace) if args.workspace else None
    # order of the errors: the path (exit 1), then TensorRT (exit 4) before any graph is parsed, then the
    # graphs themselves (exit 1: a corrupt .onnx is a clean error, not a protobuf traceback)
    _, _, targets = resolve_targets(args.path, roles)
    try:
        require_tensorrt()
        if args.skip_if_unavailable:
            require_gpu()
    except BackendUnavailable as e:
        if not args.skip_if_unavailable:
            raise
        import sys

        print(f"build skipped (--skip-if-unavailable): {e}", file=sys.stderr)  # a note, not an error: exit 0
        return 0
    for t in targets:
        load_onnx_structure(t.onnx)
    result = build_engines(args.path, plugin=args.plugin, batch=batch, seq=seq, roles=roles, workspace=workspace,
                           opt_level=args.opt_level, timing_cache=cache, aot_ptx_isa=isa)
    from m2export.check.console import write_stdout

    if not args.quiet:  # results on stdout
        for e in result.engines:
            write_stdout(f"wrote {result.outdir / e.file}: {e.role} engine, TensorRT {e.tensorrt_version}, {e.gpu} "
                         f"(sm {e.compute_capability}), plugin {e.plugin_mode}\n")
        if result.manifest_updated:
            write_stdout(f"updated {result.outdir}/m2export.json\n")
    return 0


def _flag_range(args, dim: str):
    """The ShapeRange of --min-DIM/--opt-DIM/--max-DIM; its refusal names those flags and the values given."""
    from m2export.errors import ParameterError, UsageError
    from m2export.names import DEFAULT_PROFILE
    from m2export.trt.build import ShapeRange

    flags = [f"--{k}-{dim}" for k in ("min", "opt", "max")]
    values = [getattr(args, f"{k}_{dim}") for k in ("min", "opt", "max")]
    try:
        return ShapeRange(*values)
    except ParameterError:
        raise UsageError(f"{', '.join(f'{f} {v}' for f, v in zip(flags, values))}: expected 1 <= "
                         f"{' <= '.join(flags)}", hint=f"the defaults are {'/'.join(map(str, DEFAULT_PROFILE[dim]))}"
                         "; give the ones you change consistent with them") from None

