"""``reshard split SRC DST --dst-strategy S``: slice a full model into per-rank files for a strategy.

The destination strategy is ``--dst-strategy`` (``--strategy`` still works, with a note: in
``unify`` the same word meant the source's).
"""

from __future__ import annotations

import argparse
from typing import Any

from reshard.cli import calls
from reshard.cli.commands.convert import load_name_map
from reshard.cli.flags import DestinationFlags, KeyFlags, OutputFlags, RunFlags, WriteFlags, add_json, flag, section
from reshard.cli.report import Printing, finish
from reshard.cli.strategies import add_ranks, add_strategy
from reshard.cli.tensor_flags import TensorFlags, input_paths
from reshard.errors import UsageError
from reshard.ops.options import format_choices

NAME = "split"
KEYS = KeyFlags(read=False)
OUTPUT = OutputFlags(
    formats=format_choices(NAME),
    default="safetensors",
    format_help="the format of the rank files (dcp: a PyTorch Distributed Checkpoint of the strategy's rank boxes)",
    hf=False,
    iteration=True,
)
DESTINATION = DestinationFlags("replace the files this run writes in a non-empty destination")
WRITE = WriteFlags(KEYS)
RUN = RunFlags()
TENSORS = TensorFlags()


def add(sub: Any) -> None:
    p = sub.add_parser(NAME, help="slice a unified model into per-rank files for a strategy")
    p.add_argument("src", help="unified folder (part files + param_name_map.json)")
    p.add_argument("dst", help="output folder")
    add_strategy(
        p,
        "--dst-strategy",
        renamed=["--strategy"],
        dest="strategy",
        help="destination strategy file or folder (required)",
    )
    add_ranks(p, "only the files of these destination ranks, e.g. 0,1,4-7 (default: every rank)")
    OUTPUT.add(p)
    flag(
        section(p, "names and dtypes"),
        "--name-map",
        legacy=["--name_map"],
        help="JSON file: strategy name -> unified name",
    )
    add_json(p)
    DESTINATION.add(p)
    WRITE.add(p)
    RUN.add(p)
    KEYS.add(p)
    TENSORS.add(p)
    p.set_defaults(func=run, reads=("src",))  # read ahead while starting (reshard.readahead)


def run(args: argparse.Namespace) -> None:
    if args.strategy is None:
        raise UsageError("split needs the destination strategy: give --dst-strategy")
    name_map = load_name_map(args.name_map) if args.name_map else None
    write = WRITE.options(args)
    destination = DESTINATION.options(args)
    run_options = RUN.options(args, destination.dry_run)
    tensors = TENSORS.build(args, input_paths(args.src, args.strategy), args.overwrite)
    report = calls.api.split(
        args.src,
        args.strategy,
        args.dst,
        ranks=args.ranks,
        name_map=name_map,
        output=OUTPUT.options(args),
        destination=destination,
        tensors=tensors.options,
        write=write,
        run=run_options,
    )
    finish(report, Printing(args.quiet, args.json, destination.dry_run, False, tensors, args.started), args.dst)


__all__ = ["add", "run"]
