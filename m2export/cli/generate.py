"""``m2export generate``: continue a prompt with an export (or the PyTorch reference)."""

from __future__ import annotations

HELP = "generate text from a prompt with the exported graphs (onnxrt), engines (trt) or PyTorch (torch)"
DESCRIPTION = """Continue a prompt: the prefill graph reads it, the decode graph then produces one token per step,
feeding its present_*_state outputs back as past_*_state inputs. Greedy by default; --temperature > 0
samples (optionally among the --top-k largest logits, reproducibly with --seed).

Byte-level models (vocab_size 256, like the bundled stdlib model) take --prompt as text; other
vocabularies need --tokenizer tokenizer.json (the 'tokenizers' package) or --prompt-ids.
The text goes to stdout; the speed line (prefill time, decode tokens/s) to stderr.

SOURCE is an OUTDIR written by 'm2export export'; with --runtime torch it may also be a checkpoint.

exit codes: 0 ok; 1 missing folder/graph, a checkpoint given to onnxrt/trt, a bad prompt (e.g. an id
outside the vocabulary, an empty prompt, or --prompt bytes that are not UTF-8), a damaged m2export.json, or
--runtime trt with TensorRT usable but no engines built; 2 a flag's value malformed or out of range
(--max-new-tokens -1, --prompt-ids 1,x), or contradicting flags (--ssm-impl with --runtime torch or trt); 4 --runtime trt where TensorRT is not usable (not installed, or no CUDA GPU), whether or not
engines exist: checked after SOURCE itself, before the engines (the same rule as 'm2export check'),
or onnxrt on a bf16 export (no bf16 on ONNX Runtime's CPU: use --runtime onnx-reference); 141 stdout
closed by its reader (e.g. | head -c 100): generation stops there.

examples:
  m2export generate out/tiny --prompt 'def parse_args(' --max-new-tokens 20
  m2export generate out/tiny --prompt 'import os' --runtime torch
  m2export generate ckpt/tiny --runtime torch --prompt 'class '
  m2export generate out/tiny --prompt 'for ' --temperature 0.8 --top-k 40 --seed 1
  m2export generate out/tiny --prompt-ids 100,101,102 --max-new-tokens 8 --ids

(other vocabularies: --tokenizer tokenizer.json, with the 'tokenizers' package)
"""


def add_arguments(p):
    from m2export import names
    from m2export.cli.argtypes import non_negative_float, non_negative_int

    g = p.add_argument_group("Required arguments")
    g.add_argument("source", metavar="SOURCE", help="export OUTDIR (or a checkpoint, with --runtime torch)")
    g = p.add_argument_group("Prompt")
    x = g.add_mutually_exclusive_group(required=True)
    x.add_argument("--prompt", metavar="TEXT", help="prompt text")
    x.add_argument("--prompt-ids", metavar="ID,ID,...",
                   help="prompt as comma-separated token ids, each in [0, vocab_size)")
    g.add_argument("--tokenizer", metavar="FILE", help="tokenizers JSON for vocabularies other than bytes (default: "
                   "the tokenizer.json export copied from the checkpoint, if it had one)")
    g = p.add_argument_group("Runtime")
    g.add_argument("--runtime", choices=list(names.RUNTIMES), type=names.cli_type("runtime", "--runtime"),
                   default=None, help="default: onnxrt for an OUTDIR, torch for a checkpoint; onnx-reference runs "
                        "the graphs in ONNX's reference evaluator (any dtype, bf16 included; slow)")
    g.add_argument("--ssm-impl", choices=list(names.FLAVOURS), type=names.cli_type("flavour", "--ssm-impl"),
                   default=None, help="onnxrt/onnx-reference: which graph flavour, ssmscan (SSMScan custom op), std "
                        "(standard ops) or native (ONNX Runtime's fused kernels) (default: the primary model.onnx)")
    g = p.add_argument_group("Decoding")
    g.add_argument("--max-new-tokens", type=non_negative_int, default=64, metavar="N", help="(default: %(default)s)")
    g.add_argument("--temperature", type=non_negative_float, default=0.0, metavar="T",
                   help="0 = greedy, > 0 samples (default: %(default)s)")
    g.add_argument("--top-k", type=non_negative_int, default=0, metavar="K",
                   help="sample among the k largest logits; 0 = all (default: %(default)s)")
    g.add_argument("--seed", type=non_negative_int, default=0, metavar="N", help="sampling seed (default: %(default)s)")
    g.add_argument("--ids", action="store_true", help="also print the new token ids")


def run(args) -> int:
    import codecs
    import math
    import sys
    from pathlib import Path

    from m2export.check.console import quiet_polygraphy
    from m2export.errors import UsageError
    from m2export.exporter.configs import MANIFEST_FILE
    from m2export.generate import ByteTokenizer, check_prompt_ids, choose_tokenizer, generate, open_runtime

    quiet_polygraphy(args.verbose)
    if args.top_k and args.temperature <= 0:  # greedy decoding: the top-k filter never applies
        print(f"note: --top-k {args.top_k} has no effect with greedy decoding (--temperature 0, the default); "
              "pass --temperature T > 0 to sample among the top-k", file=sys.stderr)
    if args.prompt_ids is not None:  # its syntax first: a malformed value is exit 2 before anything is read
        from m2export.cli.argtypes import comma_items

        # an empty one is an empty prompt, refused as --prompt '' is (check_prompt_ids, exit 1)
        items = comma_items(args.prompt_ids, "--prompt-ids") if args.prompt_ids.strip() else []
        try:
            ids = [int(v) for v in items]
        except ValueError:
            raise UsageError(f"--prompt-ids {args.prompt_ids!r}: expected comma-separated integers") from None
    src = Path(args.source)
    if args.runtime is None and src.is_dir() and not (src / MANIFEST_FILE).is_file() \
            and not (src / "config.json").is_file():  # neither kind: say so, not just "not a checkpoint"
        from m2export.errors import ExportFolderError

        raise ExportFolderError(f"{src}: neither an m2export output folder (no {MANIFEST_FILE}) nor a checkpoint "
                                "(no config.json)",
                                hint="pass an OUTDIR written by 'm2export export' (or a checkpoint, for --runtime "
                                     "torch)")
    runtime = args.runtime or ("onnxrt" if (src / MANIFEST_FILE).is_file() or not src.exists() else "torch")
    if args.ssm_impl is not None and runtime in ("torch", "trt"):  # it picks an ONNX graph: contradictory here
        raise UsageError(f"--ssm-impl {args.ssm_impl} picks the ONNX graph of --runtime onnxrt or onnx-reference; "
                         f"--runtime {runtime} runs " + ("the PyTorch model" if runtime == "torch" else
                                                         "the TensorRT engines"),
                         hint="drop --ssm-impl, or pass --runtime onnxrt")
    session = open_runtime(src, runtime, ssm_impl=args.ssm_impl)
    tok = None
    tok_file = args.tokenizer or session.tokenizer_file  # the export's own tokenizer.json unless --tokenizer
    if args.prompt_ids is not None:
        if tok_file or session.cfg.vocab_size == 256:
            tok = choose_tokenizer(session.cfg.vocab_size, tok_file)
    else:
        tok = choose_tokenizer(session.cfg.vocab_size, tok_file)
        ids = tok.encode(args.prompt)
    check_prompt_ids(ids, session.cfg.vocab_size, param="prompt_ids" if args.prompt_ids is not None else None)
    if isinstance(tok, ByteTokenizer):  # stream bytes as they come, decoding UTF-8 incrementally
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # the prompt is echoed once the prefill has run: a graph that fails to load or run leaves stdout empty
        # (it held the prompt without a newline before the error line)
        prompt = [bytes(ids)]

        def echo_prompt() -> None:
            if prompt:
                sys.stdout.write(dec.decode(prompt.pop()))

        def on_token(t: int) -> None:
            echo_prompt()
            sys.stdout.write(dec.decode(bytes([t])))
            sys.stdout.flush()
    else:  # the results are written at the end (decoded whole, or the ids): the pipe is watched meanwhile
        reader_gone = getattr(sys.stdout, "raise_if_reader_gone", None)  # main()'s guard (absent: not run by main)

        def on_token(t: int) -> None:
            if reader_gone is not None:
                reader_gone()
    res = generate(src, ids, runtime=runtime, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, seed=args.seed, session=session, on_token=on_token)
    if isinstance(tok, ByteTokenizer):
        echo_prompt()  # (no new token: not echoed yet)
        sys.stdout.write(dec.decode(b"", final=True) + "\n")
    elif tok is not None:
        sys.stdout.write(tok.decode(res.prompt_ids + res.new_ids) + "\n")
    else:
        sys.stdout.write(" ".join(str(i) for i in res.new_ids) + "\n")
    if args.ids and tok is not None:
        sys.stdout.write("new ids: " + " ".join(str(i) for i in res.new_ids) + "\n")
    sys.stdout.flush()
    if not args.quiet:
        mode = "greedy" if args.temperature <= 0 else f"temperature {args.temperature:g}" + (
            f", top-k {args.top_k}" if args.top_k else "") + f", seed {args.seed}"
        speed = (f"decode {res.tokens_per_s:.1f} tokens/s" if math.isfinite(res.tokens_per_s)
                 else "no decode step to time")  # 0 or 1 new tokens: the prefill made the only one
        print(f"{res.runtime}: prefill {_count(len(res.prompt_ids), 'token')} in {res.prefill_s * 1e3:.1f} ms; "
              f"{_count(len(res.new_ids), 'new token')} ({mode}), {speed}", file=sys.stderr)
    return 0


def _count(n: int, noun: str) -> str:
    """``1 token``, ``2 tokens``, ``0 tokens``."""
    return f"{n} {noun}" + ("" if n == 1 else "s")
