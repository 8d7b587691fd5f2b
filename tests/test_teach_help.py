"""The command teaches itself: every subcommand's help has a description, examples and defaults, the
examples parse with their own parser and run as written on the demo's files, ``--version`` / ``-V``
print the package version, ``reshard`` alone prints an overview, and a misspelled command or flag is
one line naming the nearest real one (exit 2, nothing written)."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import secrets
import shlex
from pathlib import Path

import pytest

from reshard import __version__, cli
from reshard.cli import help as cli_help
from tests.trust_helpers import run_cli

ROOT = Path(__file__).resolve().parent.parent

# Subcommands allowed to have no examples yet. Empty: every subcommand teaches by example.
ALLOWED_WITHOUT_EXAMPLES: frozenset[str] = frozenset()


def _commands() -> dict[str, argparse.ArgumentParser]:
    return cli_help.subcommands(cli.build_parser())


COMMANDS = sorted(_commands())
EXAMPLES = [(name, i) for name in sorted(cli_help.EXAMPLES) for i in range(len(cli_help.EXAMPLES[name]))]


def _words(command: str) -> list[str]:
    words = shlex.split(command)
    assert words[0] == "reshard", command
    return words[1:]


# ------------------------------------------------------------------------------------ help pages


def test_every_subcommand_is_known_to_the_tables() -> None:
    assert set(COMMANDS) >= ALLOWED_WITHOUT_EXAMPLES, "the allowlist names a command that does not exist"
    assert set(cli_help.EXAMPLES) <= set(COMMANDS), "examples for a command that does not exist"
    assert set(cli_help.DESCRIPTIONS) <= set(COMMANDS), "a description for a command that does not exist"


@pytest.mark.parametrize("name", COMMANDS)
def test_help_has_a_description_and_examples(name: str) -> None:
    sub = _commands()[name]
    assert sub.description and "\n" not in sub.description, f"{name}: no one-line description"
    examples = cli_help.EXAMPLES.get(name, ())
    if name not in ALLOWED_WITHOUT_EXAMPLES:
        assert len(examples) >= 2, f"{name}: give two or three examples in reshard.cli.help.EXAMPLES"
    page = sub.format_help()
    assert sub.description.split()[0] in page and "examples" in page
    for example in examples:
        assert example.command in page and example.says in page


@pytest.mark.parametrize(("name", "index"), EXAMPLES)
def test_every_example_parses_with_its_subcommand(name: str, index: int) -> None:
    """Each example names its own subcommand, and every flag in it is one that subcommand has."""
    parser = cli.build_parser()
    words = _words(cli_help.EXAMPLES[name][index].command)
    assert words[0] == name
    try:
        cli_help.check_argv(parser, words)
        args = parser.parse_args(words)
    except SystemExit as exc:  # pragma: no cover - the failure message says which example
        pytest.fail(f"{cli_help.EXAMPLES[name][index].command!r} does not parse (exit {exc.code})")
    assert args.command == name


def test_the_overview_example_parses() -> None:
    parser = cli.build_parser()
    for line in cli_help.OVERVIEW_EXAMPLE:
        cli_help.check_argv(parser, _words(line))
        parser.parse_args(_words(line))


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``reshard demo --dir demo``, the command every example assumes was run."""
    root = tmp_path_factory.mktemp("teach-demo")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert cli.main(["demo", "--dir", "demo"]) == 0
    finally:
        os.chdir(cwd)
    return root / "demo"


@pytest.mark.parametrize(("name", "index"), EXAMPLES)
def test_every_example_runs_on_the_demo(
    name: str, index: int, demo_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    command = cli_help.EXAMPLES[name][index].command
    if command == "reshard demo --dir demo":  # what the demo_root fixture ran
        return
    (tmp_path / "demo").symlink_to(demo_root)
    (tmp_path / "weights.key").write_text(secrets.token_hex(32) + "\n")  # the key the examples name
    monkeypatch.chdir(tmp_path)
    assert cli.main(_words(command)) == 0, command


def test_help_pages_show_defaults_once() -> None:
    verify = run_cli("verify", "--help")
    transform = run_cli("transform", "--help")
    assert verify.returncode == 0 and transform.returncode == 0
    page = " ".join(verify.stdout.split())
    assert "(default: 0.0)" in page  # --atol
    assert "(default: 256M)" in page  # --max-memory, as a size
    assert "(default: None)" not in page and "(default: False)" not in page
    flat = " ".join(transform.stdout.split())
    assert "(default: local)" in flat  # --executor
    assert "(default: 1G)" in flat  # --max-memory
    workers = transform.stdout.split("\n  --workers WORKERS", 1)[1].split("\n  --max-memory", 1)[0]
    assert workers.count("default") == 1, workers  # its help says the default; nothing appended
    assert "examples (after `reshard demo --dir demo`):" in transform.stdout


# ------------------------------------------------------------------------------------ version, overview


def test_version_comes_from_the_package_metadata() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^version = "(.*)"$', pyproject, re.M)[1] == __version__  # type: ignore[index]
    try:
        installed = importlib.metadata.version("reshard")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a checkout run without installing
        installed = __version__
    assert installed == __version__
    for flag in ("--version", "-V"):
        proc = run_cli(flag)
        assert proc.returncode == 0 and proc.stdout == f"reshard {__version__}\n" and proc.stderr == ""


def test_no_arguments_prints_the_overview(tmp_path: Path) -> None:
    proc = run_cli(cwd=str(tmp_path))
    assert proc.returncode == 2 and proc.stderr == ""
    for name in COMMANDS:
        assert re.search(rf"^  {re.escape(name)} ", proc.stdout, re.M), name
    assert "reshard demo --dir demo" in proc.stdout and "--help" in proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_help_command_prints_a_commands_help() -> None:
    proc = run_cli("help", "verify")
    assert proc.returncode == 0 and proc.stdout == run_cli("verify", "--help").stdout
    top = run_cli("help")
    assert top.returncode == 0 and top.stdout.startswith("usage: reshard")


# ------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["transfrom", "--src", "x"], "reshard: error: unknown command 'transfrom' (did you mean transform?)"),
        (["verfy", "a", "b"], "reshard: error: unknown command 'verfy' (did you mean verify?)"),
        (["frobnicate"], "reshard: error: unknown command 'frobnicate' (see reshard --help)"),
        (["transform", "--srcc", "x"], "reshard transform: unknown flag --srcc (did you mean --src?)"),
        (["transform", "--src", "in", "--dts", "out"], "reshard transform: unknown flag --dts (did you mean --dst?)"),
        (["convert", "x.ckpt", "--too", "safetensors"], "reshard convert: unknown flag --too (did you mean --to?)"),
        (["verify", "a", "b", "--a-strategyy=s"], "reshard verify: unknown flag --a-strategyy (did you mean"),
        (["rank-list", "0", "--fils"], "reshard rank-list: unknown flag --fils (did you mean --files?)"),
        (["plan", "--resume"], "reshard plan: unknown flag --resume (a flag of convert, split, transform, unify)"),
        (["help", "transfrom"], "reshard: error: help: unknown command 'transfrom' (did you mean transform?)"),
        (["--verison"], "reshard: error: unknown flag --verison (did you mean --version?)"),
        (["demo", "--zzz"], "reshard demo: unknown flag --zzz (see reshard demo --help)"),
        (["transform", "a", "b", "-hf"], "reshard transform: unknown flag -hf (did you mean --hf?)"),  # not -h f
        (["transform", "-src=a", "b"], "reshard transform: unknown flag -src (did you mean --src?)"),
        # the command's own flag with `_` for `-` comes before "a flag of transform"
        (["auto-transform", "c", "--rank_id", "0"], "unknown flag --rank_id (did you mean --rank-id?)"),
        (["auto-transform", "c", "--world_size", "4"], "unknown flag --world_size (did you mean --world-size?)"),
        (["auto-transform", "c", "--rank-idd", "0"], "unknown flag --rank-idd (did you mean --rank-id?)"),
        (["split", "a", "b", "--rank_id", "0"], "reshard split: unknown flag --rank_id (a flag of transform)"),
        # a typo in MindFormers' `_` style is matched against the hidden `_` spellings too
        (
            ["transform", "--dst_ckpt_stratgy", "s"],
            "unknown flag --dst_ckpt_stratgy (did you mean --dst_ckpt_strategy?)",
        ),
    ],
)
def test_misspellings_are_one_line_with_a_suggestion(tmp_path: Path, argv: list[str], expected: str) -> None:
    proc = run_cli(*argv, cwd=str(tmp_path))
    assert proc.returncode == 2, proc
    assert proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("reshard: error: ") and expected in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_an_unknown_flag_is_named_before_a_missing_required_one(tmp_path: Path) -> None:
    """``--too`` for ``--to``: the typo is what to fix, not "--to is required"."""
    proc = run_cli("convert", "x.ckpt", "--too", "safetensors", cwd=str(tmp_path))
    assert "required" not in proc.stderr and "--too" in proc.stderr


def test_what_argparse_accepts_is_not_called_unknown() -> None:
    """Abbreviations, ``--flag=value``, negative numbers and values after ``--`` pass through to argparse."""
    parser = cli.build_parser()
    for argv in (
        ["verify", "a", "b", "--al"],  # --all, abbreviated
        ["verify", "a", "b", "--atol=-1"],
        ["verify", "a", "b", "--atol", "-0.5"],
        ["verify", "a", "b", "--atol", "-1e-3"],
        ["transform", "--file-suffix=-1_4", "--src", "x"],
        ["inspect", "--", "-odd-name.ckpt"],
        ["verify", "a", "b", "-q"],
    ):
        cli_help.check_argv(parser, argv)  # raises SystemExit on a false alarm


def test_own_spellings_come_first_and_underscore_typos_see_the_hidden_underscore_flags() -> None:
    parser = argparse.ArgumentParser(prog="reshard x")
    parser.add_argument("--rank-id", help="shown")
    parser.add_argument("--dst-strategy", help="shown")
    parser.add_argument("--dst_ckpt_strategy", help=argparse.SUPPRESS)  # MindFormers' spelling, hidden
    parser.add_argument("--dst-ckpt-strategy", help=argparse.SUPPRESS)
    own = cli_help._own_spelling
    assert own("--rank_id", parser) == "--rank-id"  # `_` for `-`: the shown spelling
    assert own("--rank-idd", parser) == "--rank-id"  # one slip
    assert own("--ranks", parser) is None  # not that near: another command's --ranks is named instead
    assert own("--dst_ckpt_stratgy", parser) == "--dst_ckpt_strategy"  # in the style it was typed
    assert own("--dst-ckpt-stratgy", parser) == "--dst-ckpt-strategy"
    assert "--dst_ckpt_strategy" in cli_help._suggestable("--dst_x", parser)
    assert "--dst_ckpt_strategy" not in cli_help._suggestable("--dst-x", parser)
