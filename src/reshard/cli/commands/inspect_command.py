"""``reshard inspect PATH``: what a checkpoint, a rank folder tree, a Checkpoint 2.0 or a strategy holds.

(The module's name keeps it from reading as the standard library's ``inspect``.)
"""

from __future__ import annotations

import argparse
from typing import Any

from reshard.cli.flags import KeyFlags, ReadFlags, add_json, flag, section
from reshard.cli.strategies import add_strategy

NAME = "inspect"
KEYS = KeyFlags(write=False)
READ = ReadFlags(KEYS, files=False, crc=False)


def add(sub: Any) -> None:
    p = sub.add_parser(NAME, help="summary of a checkpoint, a rank folder tree or a strategy file")
    p.add_argument("path", help="a checkpoint file, rank_<r> folders, a Checkpoint 2.0, or a strategy file or folder")
    add_strategy(p, "--strategy", help="strategy file or folder, to show full shapes and layouts")
    flag(
        section(p, "output"),
        "--params",
        action="store_true",
        help="also list every parameter (one table, names never cut)",
    )
    add_json(p, "print one JSON record on stdout: the summary and every tensor")
    READ.add(p)
    KEYS.add(p)
    p.set_defaults(func=run, own_console=True)  # it prints through rich consoles of its own


def run(args: argparse.Namespace) -> None:
    from reshard import inspection as inspect_mod

    inspect_mod.main(args.path, as_json=args.json, strategy=args.strategy, read=READ.options(args), params=args.params)


__all__ = ["add", "run"]
