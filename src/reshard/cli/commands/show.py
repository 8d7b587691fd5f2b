"""``reshard show SOURCE [PARAM]``: draw how a parameter's full tensor is split among ranks."""

from __future__ import annotations

import argparse
from typing import Any

from reshard.cli.flags import DestinationFlags, KeyFlags, ReadFlags, flag, say_notes, section
from reshard.cli.parsing import IntermixedParser
from reshard.cli.strategies import add_strategy, source_strategy
from reshard.cli.tensor_flags import check_side_file, input_paths

NAME = "show"
KEYS = KeyFlags(write=False)
READ = ReadFlags(KEYS, files=False, crc=False)
DESTINATION = DestinationFlags("replace an existing --output file", run=False)


def add(sub: Any) -> None:
    p = sub.add_parser(NAME, help="draw how a parameter's full tensor is split among ranks (SVG/PNG and text)")
    p.add_argument("source", help="a strategy file or folder, rank folders (with --strategy), or a Checkpoint 2.0")
    p.add_argument("param", nargs="?", help="the parameter to draw (default: the first of each distinct layout)")
    flag(
        section(p, "output"),
        "-o",
        "--output",
        metavar="FILE",
        help="write the picture here (.svg, or .png with matplotlib)",
    )
    add_strategy(p, "--strategy", help="the strategy of rank folders (a Checkpoint 2.0 carries its own)")
    DESTINATION.add(p)
    READ.add(p)
    KEYS.add(p)
    p.set_defaults(func=run, quiet=False)
    p.__class__ = IntermixedParser  # PARAM may follow the flags: show SRC --strategy S PARAM


def run(args: argparse.Namespace) -> None:
    """Draw how parameters are split among ranks (``-o``), and print it as rank grids."""
    from reshard import picture

    if args.output:
        picture.check_output(args.output)  # a bad name fails before anything is read
        check_side_file(args.output, "picture (--output)", input_paths(args.source, args.strategy), args.overwrite)
    strategy = source_strategy(args.source, args.strategy, "--strategy", args.quiet)  # as transform finds it
    notes: list[str] = []
    views = picture.source_views(args.source, strategy, READ.options(args), notes)
    names, note = picture.choose_params(views, args.param)
    say_notes(notes, args.quiet)
    scene = picture.param_scene(views, names, note)
    if args.output:
        picture.write(scene, args.output)
    print("\n".join(picture.scene_text(scene)))
    if args.output:
        print(f"wrote {args.output}")


__all__ = ["add", "run"]
