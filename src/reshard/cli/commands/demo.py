"""``reshard demo``: build the embedded 8-rank example and show what reshard does with it."""

from __future__ import annotations

import argparse
from typing import Any

from reshard.cli.flags import flag, section

NAME = "demo"


def add(sub: Any) -> None:
    p = sub.add_parser(NAME, help="build an 8-rank example model and show what reshard does")
    flag(
        section(p, "output"),
        "--dir",
        help="a new or empty folder to keep the demo's files in (default: a temporary one)",
    )
    p.set_defaults(func=run, own_console=True)  # it prints through rich consoles of its own


def run(args: argparse.Namespace) -> None:
    from reshard import demo

    demo.main(args.dir)


__all__ = ["add", "run"]
