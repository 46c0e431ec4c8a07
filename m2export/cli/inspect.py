"""``m2export inspect``: what is inside an export folder, an ONNX graph or a TensorRT engine."""

from __future__ import annotations

HELP = "show what is inside an OUTDIR, a .onnx graph or a .plan engine (IO, SSMScan nodes, dtype, profiles)"
DESCRIPTION = """Show the contents of:

  OUTDIR       the manifest (checkpoint, hash, config, dtype, opset), every graph and engine it lists
  model.onnx   inputs/outputs with dtypes and shapes, opsets/domains, SSMScan nodes with their
               attributes, model-local functions, op counts, parameters (external data is not loaded)
  model.plan   what m2export.json records about the engine (precision, GPU, profiles); with TensorRT
               installed also the engine's IO tensors and optimisation profiles

exit codes: 0 ok; 1 missing path, or a file that is none of the above. A graph, engine or weights file the
manifest lists but that is missing, or an external-data file shorter than its graphs read (truncated), is
marked in the listing and named in a warning line on stderr (exit 0: inspect describes; check verifies).

examples:
  m2export inspect out/tiny
  m2export inspect out/tiny/model.onnx
  m2export inspect out/tiny --json
  m2export inspect out/tiny/model.plan      # after 'm2export build out/tiny' (needs TensorRT): exit 1 without the engine
"""


def add_arguments(p):
    g = p.add_argument_group("Required arguments")
    g.add_argument("path", metavar="OUTDIR|model.onnx|model.plan", help="what to inspect")
    g = p.add_argument_group("Output")
    g.add_argument("--json", action="store_true", help="print the full description as JSON")


def run(args) -> int:
    import json

    from m2export.check.console import write_stdout
    from m2export.inspect import describe, format_text

    import sys

    from m2export.inspect import damaged_files

    info = describe(args.path)
    write_stdout((json.dumps(info, indent=2, default=str) if args.json else format_text(info)) + "\n")
    ours = info["kind"] != "onnx" or info["producer"].split(" ")[0] == "m2export"
    for what in damaged_files(info):
        if ours:
            print(f"warning: {what}: this export is damaged; re-export it (m2export export ... --force)",
                  file=sys.stderr)
        else:  # a graph m2export did not make: re-exporting is not the way to repair it
            print(f"warning: {what}: this graph (producer {info['producer'] or 'not recorded'}, not m2export) "
                  "cannot run without it; restore the file from wherever the graph came from", file=sys.stderr)
    return 0
