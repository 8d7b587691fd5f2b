"""``reshard merge-strategies SRC DST``: the per-stage strategy files of a pipelined job as one file."""

from __future__ import annotations

import argparse
import os
from typing import Any

from reshard.cli.flags import DestinationFlags, say_notes
from reshard.cli.tensor_flags import check_side_file

NAME = "merge-strategies"
DESTINATION = DestinationFlags("replace an existing file at DST", run=False)


def add(sub: Any) -> None:
    p = sub.add_parser(NAME, help="merge per-stage strategy files into one")
    p.add_argument("src", help="folder of per-stage strategy files")
    p.add_argument("dst", help="merged strategy file to write (a new file, or --overwrite)")
    DESTINATION.add(p)
    p.set_defaults(func=run, quiet=False)


def run(args: argparse.Namespace) -> None:
    from reshard.formats.strategy import find_strategy_files, is_merged_file, merge_pipeline_strategies

    # As MindSpore's merge_pipeline_strategys: the merged file may go into the folder of the
    # per-stage files (readers pass over it there, with a note), but never onto one of them.
    candidates = find_strategy_files(args.src) if os.path.isdir(args.src) else [args.src]
    stages = [f for f in candidates if not is_merged_file(f)]  # an earlier merged file may be replaced
    check_side_file(args.dst, "merged strategy", stages, args.overwrite, make_folder=True)
    notes: list[str] = []
    out = merge_pipeline_strategies(args.src, args.dst, notes)
    say_notes(notes, args.quiet)
    print(f"wrote {out}")


__all__ = ["add", "run"]
