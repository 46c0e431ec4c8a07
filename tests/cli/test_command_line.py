"""The command line's own rules, over every verb: long options only by their full names (no argparse prefix
abbreviations)."""

from __future__ import annotations

import argparse

import pytest

from m2export.cli.main import VERBS, build_parser, main


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
    assert e.value.code == 2 and err.startswith(f"usage: m2export {verb} "), err
    assert err.strip().splitlines()[-1].endswith(f"error: unrecognized arguments: {' '.join(abbreviated)}"), err


def test_top_level_abbreviation_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--vers"])  # --version
    assert e.value.code == 2 and "unrecognized arguments: --vers" in capsys.readouterr().err
