"""``reshard plan SRC DST``: what a transform would read and write, without writing anything.

The flags that shape a transform's plan (``transform.add_plan_flags``) and nothing about running
it; ``--picture`` draws which source ranks feed which destination ranks, and ``--placement FILE``
says which bytes would cross nodes.
"""

from __future__ import annotations

import argparse
from typing import Any

from reshard.cli.commands.transform import add_plan_flags, call_transform, places
from reshard.cli.flags import DestinationFlags, KeyFlags, ReadFlags, add_placement, flag, section
from reshard.cli.report import Printing, finish
from reshard.cli.tensor_flags import check_side_file, input_paths
from reshard.errors import UsageError

NAME = "plan"
KEYS = KeyFlags(write=False)
READ = ReadFlags(KEYS, iteration="", iteration_renamed=())
DESTINATION = DestinationFlags("replace an existing --picture or --names-report file", run=False)


def add(sub: Any) -> None:
    p = sub.add_parser(NAME, help="print the transform plan without writing anything")
    add_plan_flags(p, KEYS, READ)
    add_placement(p, "print the bytes that would cross nodes: ")
    flag(
        section(p, "output"),
        "--picture",
        metavar="FILE",
        help="also draw which source ranks feed which destination ranks, with bytes (.svg, or .png with matplotlib)",
    )
    DESTINATION.add(p)
    p.set_defaults(func=run, quiet=False)


def run(args: argparse.Namespace) -> None:
    src, dst = places(args, NAME)
    inputs = input_paths(src, args.src_strategy, args.dst_strategy)
    if args.picture:
        from reshard import picture

        picture.check_output(args.picture)  # a bad picture name fails before planning
        check_side_file(args.picture, "picture (--picture)", inputs, args.overwrite)
    placement = _load_placement(args.placement) if args.placement else None  # a bad file fails before planning
    read = READ.options(args)
    destination = DESTINATION.options(args, dry_run=True)
    report, tensors, hf = call_transform(args, src, src, read=read, destination=destination, write=None, run=None)
    crossing = _planned_nodes(report, placement, read) if placement is not None else None  # before any output
    finish(report, Printing(args.quiet, args.json, True, hf, tensors, args.started), dst)
    if args.picture:
        _plan_picture(report, args.picture)
    if crossing is not None:
        print(crossing)


def _plan_picture(report: Any, path: str) -> None:
    """``reshard plan --picture FILE``: the plan's source -> destination bytes, drawn and printed."""
    from reshard import picture

    matrix = picture.plan_matrix(report.plan)
    title = f"plan: {len(matrix.sources)} sources -> {len(matrix.destinations)} destinations, bytes read"
    picture.write(picture.matrix_scene(matrix, title), path)
    print("\n".join(picture.matrix_text(matrix)))
    print(f"wrote {path}")


def _load_placement(path: str) -> Any:
    """``--placement FILE`` read and checked (a missing, non-JSON or misshapen file: one line, nothing printed)."""
    from reshard.execute.nodes import load_placement

    if path == "auto":  # execute.ray_nodes.AUTO (that module loads numpy)
        raise UsageError(
            "reshard plan --placement takes a placement file: auto asks the nodes of a running cluster, "
            "which plan does not use (transform --executor ray --placement auto does)"
        )
    return load_placement(path)


def _planned_nodes(report: Any, placement: Any, read: Any) -> str:
    """``reshard plan --placement FILE``: the bytes that would cross nodes (a source no node of the
    placement holds is refused here, before the plan is printed)."""
    from reshard.execute.nodes import planned_schedule

    return str(planned_schedule(report.plan, placement, read).summary())


__all__ = ["add", "run"]
