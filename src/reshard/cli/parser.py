"""The ``reshard`` parser: one subparser per command module, then the help taught to all of them.

Each module of ``reshard.cli.commands`` adds its own subparser (``add``) and runs it (``run``, set
as ``func``); this module only holds the order of the commands in ``reshard --help``. A new
command is a module there and one line in ``COMMANDS``.
"""

from __future__ import annotations

import argparse

from reshard import __version__
from reshard.cli import help as cli_help
from reshard.cli.commands import (
    auto_transform,
    convert,
    demo,
    inspect_command,
    merge_strategies,
    plan,
    rank_list,
    show,
    split,
    transform,
    unify,
    verify,
)
from reshard.cli.exits import EXIT_CODES
from reshard.cli.parsing import Parser

# In the order ``reshard --help`` and the overview list them.
COMMANDS = (
    demo,
    inspect_command,
    convert,
    merge_strategies,
    transform,
    plan,
    show,
    unify,
    split,
    verify,
    auto_transform,
    rank_list,
)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: ``reshard [-V] COMMAND ...`` with every command's flags and help."""
    parser = Parser(
        prog="reshard",
        description="Convert, merge, split and reshard MindSpore and PyTorch DCP checkpoints.",
        epilog=EXIT_CODES,
    )
    parser.add_argument(
        "-V", "--version", action="version", version=f"reshard {__version__}", help="print the version and exit"
    )
    parser.set_defaults(quiet=False)  # commands without --quiet print their notes
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS:
        command.add(sub)
    for command_parser in sub.choices.values():
        command_parser.epilog = command_parser.epilog or EXIT_CODES
    cli_help.teach(parser, EXIT_CODES)  # descriptions, examples, defaults of every subcommand
    return parser


__all__ = ["COMMANDS", "build_parser"]
