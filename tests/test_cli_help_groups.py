"""Every command's ``--help``: every flag explained, in its section, old spellings accepted out of sight.

The flags come from the flag groups of ``reshard.cli.flags`` (issue 20): each group puts its
flags in one section of the help (input, output, layout, names and dtypes, run, keys); spellings
kept for compatibility (MindFormers' and MindSpore's underscores, renamed flags) parse but are
not shown, and a renamed one says its new name in one note on stderr.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from reshard import cli
from reshard.cli import flags
from reshard.cli import help as cli_help

PARSER = cli.build_parser()
COMMANDS = cli_help.subcommands(PARSER)

# The sections each command's help has (at least these).
SECTIONS = {
    "transform": {"input", "output", "layout", "names and dtypes", "run", "keys"},
    "plan": {"input", "output", "layout", "names and dtypes", "run", "keys"},
    "convert": {"input", "output", "names and dtypes", "run", "keys"},
    "unify": {"input", "output", "layout", "names and dtypes", "run"},
    "split": {"output", "layout", "names and dtypes", "run", "keys"},
    "verify": {"input", "output", "layout", "names and dtypes", "run", "keys"},
    "inspect": {"input", "output", "layout", "keys"},
    "show": {"input", "output", "layout", "keys"},
    "rank-list": {"input", "output", "layout"},
    "auto-transform": {"output", "layout", "names and dtypes", "run"},
}


def _sections(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    return {group.title or "": list(group._group_actions) for group in parser._action_groups}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_flag_has_a_help_string(name: str) -> None:
    for action in COMMANDS[name]._actions:
        if action.help is argparse.SUPPRESS:
            assert isinstance(action, flags._Alias) or "--check-crc" in action.option_strings, action.option_strings
            continue
        assert action.help and action.help.strip(), f"{name}: {action.option_strings or action.dest} has no help"


@pytest.mark.parametrize("name", sorted(SECTIONS))
def test_flags_sit_in_the_sections(name: str) -> None:
    found = {title for title, actions in _sections(COMMANDS[name]).items() if actions}
    assert SECTIONS[name] <= found, (name, found)
    text = COMMANDS[name].format_help()
    for title in SECTIONS[name]:
        assert f"\n{title}:\n" in text, (name, title)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_runs_and_hides_old_spellings(name: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "reshard.cli", name, "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    usage = proc.stdout.split("\n\n")[0]
    flags_text = proc.stdout.split("examples (after")[0]  # an example may use MindFormers' spellings verbatim
    for hidden in ("--iteration ", "--src_ckpt_dir", "--no-crc-check", "--dry_run", "--max_memory", "--file_suffix"):
        assert hidden not in flags_text, (name, hidden)
    assert "--src_checkpoint" not in usage  # MindFormers' tool's flags: in their own section only
    if name in ("transform", "plan"):
        assert usage.rstrip().endswith("[SRC] [DST]"), usage


RENAMED = [
    (["unify", "s", "d", "--strategy", "x"], "strategy", "x", "--strategy is now --src-strategy"),
    (["split", "s", "d", "--strategy", "x"], "strategy", "x", "--strategy is now --dst-strategy"),
    (["inspect", "p", "--iteration", "3"], "read_iteration", 3, "--iteration is now --src-iteration"),
    (["show", "p", "--iteration", "3"], "read_iteration", 3, "--iteration is now --src-iteration"),
    (["rank-list", "0", "--iteration", "3"], "read_iteration", 3, "--iteration is now --src-iteration"),
    (["verify", "a", "b", "--iteration", "3"], "read_iteration", 3, "--iteration is now --src-iteration"),
    (["verify", "a", "b", "--no-crc-check"], "check_crc", False, "--no-crc-check is now --no-check-crc"),
    (["transform", "s", "d", "--iteration", "3"], "iteration", 3, "--iteration is now --dst-iteration"),
    (["plan", "s", "d", "--iteration", "3"], "iteration", 3, "--iteration is now --dst-iteration"),
]


@pytest.mark.parametrize(("argv", "dest", "value", "note"), RENAMED, ids=[" ".join(r[0]) for r in RENAMED])
def test_renamed_spellings_still_work_with_a_note(
    argv: list[str], dest: str, value: object, note: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = PARSER.parse_args(argv)
    assert vars(args)[dest] == value
    flags.print_renamed(args, quiet=False)
    assert capsys.readouterr().err == f"reshard: note: {note}\n"
    flags.print_renamed(args, quiet=True)
    assert capsys.readouterr().err == ""


LEGACY = [
    ["transform", "--src_ckpt_dir", "s", "--dst_ckpt_dir", "d", "--src_ckpt_strategy", "a", "--output_format", "ckpt"],
    ["transform", "--src", "s", "--dst", "d", "--dst-ckpt-strategy", "b", "--max_memory", "1G", "--dry_run"],
    ["transform", "--src_checkpoint", "s", "--dst_checkpoint_dir", "d", "--src_strategy", "a", "--rank_id", "0"],
    ["verify", "a", "b", "--a_strategy", "x", "--no_check_crc", "--max_memory", "1G"],
    ["convert", "s", "--to", "ckpt", "--file_name_regex", "x", "--name_map", "m.json"],
]


@pytest.mark.parametrize("argv", LEGACY, ids=[" ".join(a[:2]) for a in LEGACY])
def test_mindformers_spellings_are_silent(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    args = PARSER.parse_args(argv)
    flags.print_renamed(args, quiet=False)
    assert capsys.readouterr().err == ""


def test_transform_takes_src_and_dst_as_positionals_or_flags() -> None:
    from reshard.cli.commands import transform

    for argv in (
        ["transform", "a", "b", "--src-strategy", "s"],
        ["transform", "--src-strategy", "s", "a", "b"],
        ["transform", "--src", "a", "--dst", "b"],
        ["transform", "a", "--dst", "b"],
    ):
        assert transform.places(PARSER.parse_args(argv), "transform") == ("a", "b"), argv


def test_transform_refuses_two_sources(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["transform", "a", "b", "--src", "c"]) == 2
    assert capsys.readouterr().err == "reshard: error: two sources: a and --src c (give SRC once)\n"
    assert cli.main(["transform", "--src-strategy", "s"]) == 2
    assert capsys.readouterr().err == "reshard: error: give the source: reshard transform SRC DST\n"
