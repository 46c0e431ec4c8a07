"""``m2export export``: a Mamba-2 or hybrid checkpoint -> one ONNX graph per flavour + m2export.json."""

from __future__ import annotations

HELP = "export a checkpoint to ONNX (one graph for prefill and decode; SSMScan custom-op or standard-op flavour)"
DESCRIPTION = """Export a Mamba-2 checkpoint (mamba_ssm or HF transformers format) or a hybrid (Nemotron-H,
Granite 4.0-H, Bamba, Falcon-H1, Zamba2) to ONNX:

  OUTDIR/model.onnx       input_ids [batch_size, sequence_length] + past states -> logits + present states;
                          prefill, and decode with sequence_length 1 (sequence_length >= 1: an empty prompt
                          is refused; m2export/exporter/configs.py says how each runtime does it)
  OUTDIR/model.onnx.data  the weights, stored once for every graph of the folder
  OUTDIR/m2export.json    manifest: checkpoint hash, config, dtype, flavour, input/output names and shapes, versions
  OUTDIR/*.std.onnx       the std flavour as well, with --ssm-impl both or all
  OUTDIR/*.native.onnx    the native flavour as well, with --ssm-impl all
  OUTDIR/model.packed.onnx  with --packed-prefill: several sequences prefilled in one call (input_ids
                          [1, total_tokens], cu_seqlens [num_sequences + 1] int32 offsets, states per sequence);
                          pure Mamba-2 models only
  OUTDIR/genai_config.json  onnxruntime-genai's config, and the checkpoint's tokenizer files (generate uses
                          tokenizer.json)

The graph takes every Mamba layer's past_conv_state.{i} / past_ssm_state.{i} and every attention layer's
past_key_values.{i}.key / .value (batch_size, kv heads, past_sequence_length, head_dim); zeros (KV caches
of length 0) start a fresh sequence. It returns present_conv_state.{i} / present_ssm_state.{i} /
present.{i}.key / .value. ssm states are float32 whatever --dtype.

graph flavours (all are ONNX graphs; --ssm-impl picks):
  ssmscan  (default) one m2export::SSMScan custom-op node per layer carrying plugin_namespace/plugin_version
           (TensorRT picks the m2export plugin) plus a model-local ONNX function with the reference semantics
           (ONNX Runtime runs it as is)
  std      standard ONNX ops only (no custom domain): any runtime, no plugin
  native   ONNX Runtime's fused kernels (com.microsoft LinearAttention and CausalConvWithState, one each
           per layer for any number of tokens, RMSNormalization, SkipSimplifiedLayerNormalization; opset 27;
           ONNX Runtime >= 1.32); fp32/fp16
  both     ssmscan as model.onnx and std as model.std.onnx (one weights file)
  all      both, plus native as model.native.onnx
  (the old names 'plugin' and 'onnx' are accepted until m2export 0.3, with a note)

--dtype bf16 graphs do not run in ONNX Runtime's CPU provider (it has no bf16 MatMul/Conv); build them
  with TensorRT, or export fp16 for ORT on CPU.

examples:
  m2export export ckpt/tiny -o out/tiny
  m2export export ckpt/tiny -o out/tiny-fp16 --dtype fp16 --ssm-impl both
  m2export export ckpt/tiny-hf -o out/tiny-hf        # an HF-format checkpoint (check --reference transformers)
"""


PARAM_FLAGS = {"outdir": "--output"}  # export_model's parameter -> this verb's flag, where the names differ


def add_arguments(p):
    from m2export import names

    g = p.add_argument_group("Required arguments")
    g.add_argument("checkpoint", help="checkpoint directory (config.json + weights) or weight file")
    g.add_argument("-o", "--output", required=True, metavar="OUTDIR", help="output folder (must be empty or new)")
    g = p.add_argument_group("Optional arguments")
    choices = [*names.FLAVOURS, *names.GROUPS]
    g.add_argument("--ssm-impl", choices=choices, type=names.cli_type("flavour", "--ssm-impl"),
                   default=names.PRIMARY_FLAVOUR, metavar="{" + ",".join(choices) + "}",
                   help="graph flavour: SSMScan custom-op node + local function (ssmscan), standard ops (std), ONNX "
                        "Runtime's native kernels (native), ssmscan+std (both) or all three (default: %(default)s)")
    g.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="fp32",
                   help="weights and activations; scan internals and ssm states stay fp32 (default: %(default)s)")
    g.add_argument("--opset", type=int, default=None, help="default-domain ONNX opset (default: 18)")
    g.add_argument("--force", action="store_true",
                   help="replace a non-empty OUTDIR that m2export wrote (its m2export.json says so, and it holds only "
                        "m2export's files: the graphs, weights and engines m2export.json lists, genai_config.json, "
                        "check reports etc. only with the content it records for them); anything else is refused "
                        "(a model.plan it does not list too)")
    g.add_argument("--force-foreign", action="store_true",
                   help="with --force, replace OUTDIR even if m2export did not write it (its contents are deleted)")
    g.add_argument("--allow-non-finite-weights", action="store_true", dest="allow_nonfinite",
                   help="export NaN/Inf weights, and weights beyond the fp16/bf16 range for --dtype fp16/bf16 "
                        "(refused by default)")
    g.add_argument("--no-check", action="store_true", help="skip onnx.checker full check of the written graphs")
    g.add_argument("--packed-prefill", action="store_true",
                   help="also write model.packed.onnx: variable-length sequences packed in one prefill call "
                        "(cu_seqlens, states per sequence; SSMScanPacked nodes); pure Mamba-2 models only")


def run(args) -> int:
    from pathlib import Path

    from m2export.check.console import human_bytes, write_stdout
    from m2export.exporter import export_model

    from m2export.exporter.ssm_scan_op import NATIVE_OPSET
    from m2export.names import GROUPS

    if args.opset is not None and args.opset != NATIVE_OPSET and "native" in GROUPS.get(args.ssm_impl, (args.ssm_impl,)):
        import sys

        print(f"note: --opset {args.opset} applies to the ssmscan and std flavours; the native flavour is built at "
              f"opset {NATIVE_OPSET} (ONNX Runtime's fused kernels need it)", file=sys.stderr)
    m = export_model(args.checkpoint, args.output, ssm_impl=args.ssm_impl, dtype=args.dtype, opset=args.opset,
                     force=args.force, force_foreign=args.force_foreign,
                     allow_nonfinite=args.allow_nonfinite, check=not args.no_check, progress=not args.quiet,
                     packed_prefill=args.packed_prefill)
    out = Path(args.output)
    files = []
    names = dict.fromkeys(f for g in m.graphs for f in (g.file, *g.external_data))  # a shared weights file once
    for f in names:  # each graph with its external-data files, and their sizes
        p = out / f
        files.append(f"{f} ({human_bytes(p.stat().st_size)})" if p.is_file() else f)
    from m2export.exporter.genai import GENAI_CONFIG_FILE

    # onnxruntime-genai's config and the tokenizer files copied next to it are written by every export too
    files += [f"{f} ({human_bytes((out / f).stat().st_size)})" for f in (GENAI_CONFIG_FILE, *m.tokenizer)
              if (out / f).is_file()]
    if not args.quiet:
        native = [g.file for g in m.graphs if g.ssm_impl == "native"]  # built at NATIVE_OPSET whatever --opset
        opsets = (f"opset {NATIVE_OPSET}" if len(native) == len(m.graphs) else
                  f"opset {m.opset}" + "".join(f", {f} opset {NATIVE_OPSET}" for f in native))
        write_stdout(f"wrote {args.output}: {', '.join(files)}, m2export.json (dtype {m.dtype}, {opsets})\n")
    return 0
