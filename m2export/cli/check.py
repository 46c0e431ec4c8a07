"""``m2export check``: accuracy of an export against the PyTorch reference, with Polygraphy."""

from __future__ import annotations

import argparse

HELP = "compare an export (ONNX Runtime, TensorRT) with the PyTorch reference on real token sequences"
DESCRIPTION = """Run the same inputs through the PyTorch reference model (fp32), ONNX Runtime (every graph flavour
in OUTDIR) and TensorRT (the engines, when built and TensorRT is installed; otherwise a "skipped" line),
and compare every output with Polygraphy's elementwise rule (SimpleCompareFunc, per-output atol/rtol; large
outputs are compared in slices as each runtime returns them, then dropped).

Inputs are real byte-level token sequences (--text FILE, default: the Python stdlib's own sources) at
several batch x seqlen sizes, each fed twice to the prefill graph: as a fresh sequence (zero past
states) and as a continued one, whose past_conv_state/past_ssm_state inputs are the PyTorch reference's
own states after the chunk_size + 3 tokens that precede the window in the text (every runtime gets the
same feeds; a graph that ignores its past states fails). An export with model.packed.onnx (--packed-prefill)
also runs one packed call of six sequences of different lengths (boundaries inside a chunk and on chunk edges, a
one-token and an empty one, fresh and continued states per sequence) against the reference on each sequence
alone (section "packed", ONNX Runtime). Then a sequence check: a prompt through the
prefill graph, then --decode-steps steps through the decode graph with each runtime feeding its own
states back; greedy tokens must agree with the reference (numerical ties excepted).

After the corpus windows comes a vocabulary sweep: every token id 0..vocab_size-1 fed once, in a seeded order,
as fresh sequences of 1 x L tokens (L as large as keeps one input's fp32 logits under 64 MiB: 333 tokens on a
50k vocabulary, so 151 more inputs), because a corpus reaches few ids (a byte corpus: 0-255) and an embedding
row no input reaches is never compared. On a large vocabulary it is most of the run (the mamba2-130m preset:
about 25 minutes on 2 CPU cores); --no-vocab-sweep skips it, and the report says which ids were fed.

An element fails when its absolute error > atol AND its relative error > rtol. Defaults by export
dtype (m2export.check.tolerances):
@DEFAULT_TOLERANCES@
Override with --atol/--rtol VALUE (the default) or NAME:VALUE (one output; NAME may be a glob like
'present_ssm_state.*'); one default and one NAME:VALUE per output at most.

Writes OUTDIR/check_report.json (every output of every runtime), check_report.md, check_errors.png
(error histogram, when matplotlib is installed: pip install 'm2export[plot]') and check_data_loader.py (the same inputs for
'polygraphy run --data-loader-script'; the equivalent polygraphy commands are printed). It replaces
only the reports it wrote (OUTDIR: m2export.json records them; another --report-dir: check_reports_written.json
there): a file of one of those names that it did not write, or one edited since, is refused (exit 1) before anything
runs, as 'export --force' refuses it; --force replaces it anyway.

exit codes: 0 all comparisons passed; 3 an output is out of tolerance (the failing outputs are named);
1 OUTDIR, a graph, an engine listed in m2export.json or the reference checkpoint is missing (or its hash
differs from the export's), an --atol/--rtol NAME that matches no output or an output given two NAME:VALUE
values (logits:1e-3,logits:1; a glob and a name count twice), a file of a report's name in the
report folder that m2export did not write (without --force), or --runtime trt with TensorRT
usable but no engines built; 2 a flag's value malformed or out of range (--shapes 2x0, --atol -1, --rtol inf,
--decode-steps -1), or flags that contradict each other; 4 --runtime trt where TensorRT is not usable (not
installed, or no CUDA GPU), whether or not engines exist: checked after OUTDIR itself, before the
engines (the same rule as 'm2export generate').

--reference transformers (HF-format checkpoints: mamba2, nemotron_h, granitemoehybrid, bamba, falcon_h1,
zamba2): the logits are compared with transformers' own model of the checkpoint (fp32), the one its authors
validated, instead of m2export's PyTorch model. transformers' cache objects are not mapped: every reference
call is one full forward over the sequence's tokens so far (prompt + tokens fed since), so a decode step is
compared with transformers' full forward over prompt + steps. The present_* states (conv/ssm states, KV
caches), which transformers does not expose in the graphs' layout, stay compared against m2export's PyTorch
model. Where transformers differs from mamba_ssm, the reference follows mamba_ssm and the report says so:
Nemotron-H and Zamba2 clamp dt at time_step_min in transformers' prefill path only (lifted to the config's
time_step_limit); a gated RMSNorm over all d_inner channels for ngroups > 1 (Mamba2, Granite 4.0-H, Bamba in
transformers releases before the per-group norm) is normalised per group. Slower than the default.

bf16 exports: ONNX Runtime's CPU provider has no bf16 kernels, so their graphs are run with ONNX's
reference evaluator (onnx-reference) instead, and the reference's outputs are rounded to bf16.

examples:
  m2export check out/tiny
  m2export check out/tiny --shapes 1x1,2x40 --decode-steps 16
  m2export check out/tiny-fp16 --atol logits:0.1 --rtol 0.02
  m2export check out/tiny --runtime trt      # needs TensorRT and an NVIDIA GPU: exit 4 without (not a "skipped" line)
  m2export check out/tiny --checkpoint ckpt/tiny   # where the reference is now, if it moved
  m2export check out/tiny-hf --reference transformers   # needs transformers (pip install transformers): its logits
"""


TOLERANCES_TOKEN = "@DEFAULT_TOLERANCES@"
PARAM_FLAGS = {"max_seqlen": "--max-seq-len"}  # run_check's parameter -> this verb's flag, where the names differ


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Fills the default-tolerance table into the description when --help is printed (from
    m2export.check.tolerances, the table the check uses), so building the parser stays cheap."""

    def _format_text(self, text):
        if TOLERANCES_TOKEN in text:
            from m2export.check.tolerances import defaults_table

            text = text.replace(TOLERANCES_TOKEN, defaults_table())
        return super()._format_text(text)


def add_arguments(p):
    from m2export import names
    from m2export.cli.argtypes import non_negative_int, positive_int

    p.formatter_class = _HelpFormatter
    g = p.add_argument_group("Required arguments")
    g.add_argument("outdir", metavar="OUTDIR", help="folder written by 'm2export export' (m2export.json + graphs)")
    g = p.add_argument_group("Reference and runtimes")
    g.add_argument("--checkpoint", metavar="PATH",
                   help="reference checkpoint (default: the one recorded in m2export.json; hashes must match)")
    g.add_argument("--reference", choices=["torch", "transformers"], default="torch",
                   help="what every runtime is compared with: torch (m2export's PyTorch model, the default) or "
                        "transformers (its model of an HF-format checkpoint gives the logits; states stay "
                        "compared against m2export's PyTorch model)")
    g.add_argument("--reference-backend", choices=["torch", "cutile"], default="torch",
                   help="kernels of the PyTorch reference: torch (PyTorch ops on the CPU, the default) or cutile "
                        "(the model on the GPU, its Mamba layers' conv, scan and gated norm on the cuTile kernels; "
                        "needs CUDA and cuda.tile)")
    g.add_argument("--runtime", dest="runtimes", action="append", choices=[r for r in names.RUNTIMES if r != names.REFERENCE_RUNTIME],
                   type=names.cli_type("runtime", "--runtime"),
                   help="runtime(s) to compare with the reference (repeatable; default: onnxrt, and trt when "
                        "engines and TensorRT exist; naming trt makes its absence an error). onnx-reference: "
                        "ONNX's Python reference evaluator (slow; used instead of onnxrt for bf16 exports)")
    g = p.add_argument_group("Inputs")
    g.add_argument("--text", metavar="FILE", help="corpus for the token sequences (default: Python stdlib sources)")
    g.add_argument("--shapes", metavar="BxS,...",
                   help="prefill batch x seqlen sizes, e.g. 1x1,2x64 (default: engine profile min/opt/max, else "
                        "1 token, a partial chunk, one chunk, one chunk + 1, two chunks + 3)")
    g.add_argument("--max-seq-len", type=positive_int, default=512, metavar="N", help="cap on the default sizes (default: %(default)s)")
    g.add_argument("--decode-steps", type=non_negative_int, default=8, metavar="N",
                   help="decode steps in the sequence check; 0 skips it (default: %(default)s)")
    g.add_argument("--prompt-len", type=positive_int, default=None, metavar="N", help="prompt length of the sequence check "
                   "(default: chunk_size // 2 + 5)")
    g.add_argument("--no-vocab-sweep", action="store_false", dest="vocab_sweep",
                   help="skip the vocabulary sweep (the report then says which token ids were fed); on a 50k "
                        "vocabulary it is most of the check's time")
    g.add_argument("--seed", type=non_negative_int, default=0, metavar="N",
                   help="where the windows are cut from the corpus (default: %(default)s)")
    g = p.add_argument_group("Tolerances")
    # one value per flag (repeatable, or comma-separated): a list-valued flag would swallow OUTDIR after it
    g.add_argument("--atol", action="append", metavar="[NAME:]VALUE[,...]",
                   help="absolute tolerance: VALUE (the default) or NAME:VALUE; repeat or comma-separate")
    g.add_argument("--rtol", action="append", metavar="[NAME:]VALUE[,...]",
                   help="relative tolerance: VALUE (the default) or NAME:VALUE; repeat or comma-separate")
    g = p.add_argument_group("Output")
    g.add_argument("--report-dir", metavar="DIR", help="where the reports go (default: OUTDIR); same-named files "
                   "there that m2export did not write are refused (exit 1)")
    g.add_argument("--force", action="store_true",
                   help="replace same-named files in the report folder even if m2export did not write them")


def run(args) -> int:
    import time

    from m2export.check.compare import REPORT_JSON, REPORT_MD, RUNTIMES, run_check
    from m2export.check.console import progress_bars, quiet_polygraphy
    from m2export.check.data import parse_shapes
    from m2export.check.report import reference_label
    from m2export.errors import ToleranceError

    t0 = time.perf_counter()
    quiet_polygraphy(args.verbose)
    shapes = parse_shapes(args.shapes) if args.shapes is not None else None  # '' is refused, not the defaults
    runtimes = tuple(args.runtimes) if args.runtimes else RUNTIMES
    with progress_bars(not args.quiet, "check") as prog:
        report = run_check(args.outdir, checkpoint=args.checkpoint, atol=_split(args.atol, "--atol"),
                           rtol=_split(args.rtol, "--rtol"),
                           shapes=shapes,
                           decode_steps=args.decode_steps, prompt_len=args.prompt_len, text=args.text,
                           seed=args.seed, runtimes=runtimes, require_trt="trt" in (args.runtimes or ()),
                           report_dir=args.report_dir, max_seqlen=args.max_seq_len, progress=prog,
                           polygraphy_log=args.verbose > 1, reference=args.reference,
                           reference_backend=args.reference_backend, force=args.force,
                           vocab_sweep=args.vocab_sweep)
    report_dir = args.report_dir or args.outdir
    if not args.quiet:
        _print_report(report, report_dir, REPORT_JSON, REPORT_MD)
    elapsed = time.perf_counter() - t0
    ref = f"vs {reference_label(report)}"  # -q prints this line alone: it still says what the export was compared with
    if report.passed:
        print(f"PASSED | m2export check {args.outdir} | {ref} | {elapsed:.1f}s | exit 0")
        return 0
    print(f"FAILED | m2export check {args.outdir} | {ref} | {elapsed:.1f}s | exit 3")
    fails = report.failures()
    hint = (f"details per output in {report_dir}/{REPORT_MD}; widen --atol/--rtol NAME:VALUE only if the error is "
            "expected (e.g. fp16)")
    if report.all_failures_are_routing_flips():
        hint = (f"every failure is a token that the runtime routed to other MoE experts than the reference where "
                f"their scores nearly tie (listed in {report_dir}/{REPORT_MD}; the reference routed so matches): "
                f"what {report.dtype} rounding of the router's input does, though a graph that misroutes only near "
                "ties would look the same; a wider --atol would also hide real errors")
    raise ToleranceError(f"accuracy check failed: {len(fails)} comparison(s) out of tolerance: " + "; ".join(fails[:4])
                         + (f"; ... (all in {report_dir}/{REPORT_MD})" if len(fails) > 4 else ""), hint=hint)


def _split(values: list[str] | None, flag: str) -> list[str] | None:
    """``--atol a,b --atol c`` -> ``[a, b, c]``; an empty item (``a,,b``) is refused (UsageError, exit 2)."""
    from m2export.cli.argtypes import comma_items

    return None if values is None else [v for item in values for v in comma_items(item, flag)]


def _print_report(report, report_dir, json_name, md_name) -> None:
    """The console report on stdout: rich wraps prose at the terminal width (``COLUMNS`` when set; 160
    when stdout is a pipe or file), :func:`m2export.check.report.print_console` picks the layout."""
    import os
    import sys

    from rich.console import Console

    from m2export.check.report import print_console

    width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160
    print_console(report, report_dir, Console(highlight=False, width=width), json_name=json_name, md_name=md_name)
