"""The command line's own rules, over every verb: long options only by their full names (no argparse prefix
abbreviations); a flag's value malformed or out of range is exit 2 (ExitCode.USAGE) with one error line naming the
flag, whether argparse or the library refuses it."""

from __future__ import annotations

import argparse

import pytest

from m2export.cli.main import VERBS, build_parser, main
from m2export.errors import ExitCode


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_parser_refuses_abbreviations():
    parser = build_parser()
    subs = _subparsers(parser)
    assert set(subs) == set(VERBS)
    assert [v for v, p in {"m2export": parser, **subs}.items() if p.allow_abbrev] == []


# per verb, the prefix of one of its long options (a value-taking one where the verb has one), after what else
# the verb requires; no file is read: unknown arguments are refused before the verb runs
ABBREVIATED = {
    "export": (["CK", "-o", "OUT"], ["--ssm", "std"]),
    "build": (["OUT"], ["--plug", "aot"]),
    "check": (["OUT"], ["--decode", "2"]),
    "generate": (["OUT", "--prompt", "a"], ["--max-new", "3"]),
    "inspect": (["OUT"], ["--js"]),
    "random-checkpoint": (["-o", "OUT"], ["--d-mod", "64"]),
}


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_an_abbreviated_option_is_an_unknown_one(verb, tmp_path, capsys):
    """``--ssm std`` is not ``--ssm-impl std`` (argparse took any unique prefix): exit 2, the prefix named."""
    required, abbreviated = ABBREVIATED[verb]
    with pytest.raises(SystemExit) as e:
        main([verb, *(str(tmp_path / a) if a in ("CK", "OUT") else a for a in required), *abbreviated])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip().splitlines()[0] == f"error: unrecognized arguments: {' '.join(abbreviated)}", err


def test_a_refused_command_line_is_one_error_line_and_a_hint(capsys):
    """A typo'd flag printed the verb's 6-line usage block and "m2export export: error: ..."; now one error line and a
    hint naming the closest option (exit 2). Bare 'm2export' printed the whole help to stdout with exit 2; now, as
    argparse does for a missing required argument, stderr only (exit 2 kept: ExitCode.USAGE, a bad command line)."""
    with pytest.raises(SystemExit) as e:
        main(["export", "CK", "-o", "OUT", "--forc"])
    out, err = capsys.readouterr()
    assert e.value.code == ExitCode.USAGE and out == ""
    assert err.splitlines() == ["error: unrecognized arguments: --forc",
                                "hint: did you mean --force? 'm2export export --help' lists the options"], err
    with pytest.raises(SystemExit) as e:
        main([])
    out, err = capsys.readouterr()
    assert e.value.code == ExitCode.USAGE and out == "", out
    lines = err.splitlines()
    assert len(lines) == 2 and lines[0] == f"error: no VERB given; expected one of {', '.join(VERBS)}", err
    assert lines[1].startswith("hint: 'm2export --help'"), err
    with pytest.raises(SystemExit) as e:
        main(["expor"])
    lines = capsys.readouterr().err.splitlines()
    assert e.value.code == ExitCode.USAGE and len(lines) == 2 and "invalid choice: 'expor'" in lines[0], lines


def test_top_level_abbreviation_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--vers"])  # --version
    assert e.value.code == 2 and "unrecognized arguments: --vers" in capsys.readouterr().err


# verb -> (argv with CK/OUT/EXPORT placeholders, what the one error line says); EXPORT is a real export folder (the
# check happens after it is read), CK and OUT paths that need not exist (the check comes before any file is read)
BAD_VALUES = {
    "export": [(["CK", "-o", "OUT", "--opset", "5"], "--opset 5: m2export needs 18 <= opset <="),
               (["CK", "-o", "OUT", "--opset", "x"], "argument --opset: invalid int value: 'x'"),
               (["CK", "-o", "OUT", "--ssm-impl", "native", "--dtype", "bf16"], "--ssm-impl 'native' with bf16:")],
    "build": [(["OUT", "--min-batch", "0"], "argument --min-batch: 0: expected an integer >= 1"),
              (["OUT", "--min-seq", "8", "--opt-seq", "4"], "--min-seq 8, --opt-seq 4, --max-seq 2048: expected 1 <="),
              (["OUT", "--workspace", "lots"], "--workspace: expected e.g. 4G, 512M or a number of bytes, got 'lots'"),
              (["OUT", "--aot-ptx-isa", "x"], "--aot-ptx-isa: expected MAJOR.MINOR such as 9.0, got 'x'"),
              (["OUT", "--opt-level", "9"], "argument --opt-level: invalid choice: 9")],
    "check": [(["OUT", "--shapes", "2x0"], "--shapes: bad item '2x0'; expected BATCHxSEQLEN with positive integers"),
              (["OUT", "--decode-steps", "-1"], "argument --decode-steps: -1: expected an integer >= 0"),
              (["OUT", "--reference-backend", "cutile", "--reference", "transformers"],
               "--reference-backend 'cutile' runs m2export's PyTorch model; --reference is 'transformers'"),
              (["EXPORT", "--atol", "-1"], "--atol '-1': -1 is negative; expected a finite number >= 0"),
              (["EXPORT", "--rtol", "logits:x"], "--rtol 'logits:x': expected VALUE or NAME:VALUE")],
    "generate": [(["OUT", "--prompt", "a", "--max-new-tokens", "-1"], "argument --max-new-tokens: -1: expected an "
                                                                      "integer >= 0"),
                 (["OUT", "--prompt", "a", "--temperature", "nan"], "argument --temperature: nan: expected a finite"),
                 (["OUT", "--prompt-ids", "1,x"], "--prompt-ids '1,x': expected comma-separated integers")],
    "inspect": [(["OUT", "--json=3"], "argument --json: ignored explicit argument '3'")],
    "random-checkpoint": [(["-o", "OUT", "--d-model", "0", "--n-layer", "1", "--vocab-size", "8"],
                           "argument --d-model: 0: expected an integer >= 1"),
                          (["-o", "OUT", "--preset", "mamba2-130m", "--seed", "-1"],
                           "argument --seed: -1: expected an integer >= 0"),
                          (["-o", "OUT", "--d-model", "64", "--n-layer", "1", "--vocab-size", "8", "--headdim", "7"],
                           "config: d_inner = expand*d_model = 128 is not divisible by headdim = 7"),
                          (["-o", "OUT", "--preset", "mamba2-130m", "--config", "CK"], "give --preset or --config, "
                                                                                       "not both"),
                          (["-o", "OUT", "--d-model", "64"], "give --preset or all of --d-model, --n-layer, "
                                                             "--vocab-size")],
}


@pytest.mark.parametrize("verb,argv,said", [(v, a, s) for v, cases in BAD_VALUES.items() for a, s in cases],
                         ids=lambda x: x if isinstance(x, str) and x in VERBS else None)
def test_a_bad_value_is_exit_2_with_one_line_naming_the_flag(verb, argv, said, tiny_out, tmp_path, capsys):
    """Every verb: out-of-range and malformed values (build's --min-batch 0 and --workspace lots, export's --opset
    5, check's --shapes 2x0, generate's --prompt-ids 1,x were exit 1, argparse's refusals exit 2) are exit 2; one
    'error:' line that names the flag and nothing written."""
    where = {"CK": str(tmp_path / "ck"), "OUT": str(tmp_path / "out"), "EXPORT": str(tiny_out)}
    try:
        rc = main([verb, *(where.get(a, a) for a in argv)])
    except SystemExit as e:  # argparse's own refusal
        rc = e.code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert rc == ExitCode.USAGE, err
    assert len(lines) == 1 and said in lines[0] and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
