"""``reshard unify SRC DST``: merge rank shards into full safetensors parts (or Hugging Face shards).

The source strategy is ``--src-strategy`` (``--strategy`` still works, with a note: in ``split``
the same word meant the destination's); a MindFormers Checkpoint 2.0 carries its own layouts.
"""

from __future__ import annotations

import argparse
from typing import Any

from reshard.cli import calls
from reshard.cli.flags import DestinationFlags, OutputFlags, ReadFlags, RunFlags, WriteFlags, add_json, flag, section
from reshard.cli.report import Printing, finish
from reshard.cli.strategies import add_strategy, carries_layouts, source_strategy
from reshard.cli.tensor_flags import TensorFlags, input_paths
from reshard.cli.values import part_group
from reshard.errors import UsageError
from reshard.ops.options import format_choices

NAME = "unify"
READ = ReadFlags(None, src_format=False)
OUTPUT = OutputFlags(
    formats=format_choices(NAME),
    format_help="what to write: safetensors parts (default), or the full tensors as a PyTorch DCP or "
    "Megatron-core torch_dist checkpoint (--dcp-ranks data files, default 1)",
    dcp_ranks=True,
    iteration=True,
)
DESTINATION = DestinationFlags("replace the files this run writes in a non-empty destination")
WRITE = WriteFlags(None)
RUN = RunFlags()
TENSORS = TensorFlags()


def add(sub: Any) -> None:
    p = sub.add_parser(NAME, help="merge rank shards into full safetensors parts + param_name_map.json")
    p.add_argument(
        "src",
        help="folder of rank_<r> folders (safetensors), a MindFormers Checkpoint 2.0, a PyTorch DCP folder or a "
        "Megatron-core torch_dist checkpoint",
    )
    p.add_argument("dst", help="output folder")
    add_strategy(
        p,
        "--src-strategy",
        renamed=["--strategy"],
        dest="strategy",
        help="source strategy file or folder (default: where MindFormers keeps it; none for a Checkpoint 2.0)",
    )
    READ.add(p)
    flag(section(p, "output"), "--split", type=part_group, help="produce only part group i of n, as i/n (1 <= i <= n)")
    OUTPUT.add(p)
    add_json(p)
    DESTINATION.add(p)
    WRITE.add(p)
    RUN.add(p)
    TENSORS.add(p)
    p.set_defaults(func=run, reads=("src",))  # read ahead while starting (reshard.readahead)


def run(args: argparse.Namespace) -> None:
    split = args.split or ()
    strategy = source_strategy(args.src, args.strategy, "--src-strategy", args.quiet)
    if strategy is None and not carries_layouts(args.src):  # a Checkpoint 2.0's metadata.json, a DCP .metadata
        from reshard.sources import CHECKPOINT2, CHUNKED, RANK_FOLDERS, identify

        identify(args.src, (RANK_FOLDERS, CHECKPOINT2, *CHUNKED))  # what the path is first (api.unify's words)
        raise UsageError("unify needs the strategy of the rank folders: give --src-strategy", args.src)
    read, write = READ.options(args), WRITE.options(args)
    destination = DESTINATION.options(args)
    run_options = RUN.options(args, destination.dry_run)
    output = OUTPUT.options(args)
    # an empty part group is refused before anything is written (a DCP output has no parts: api.unify says so)
    if (
        split
        and output.format not in ("dcp", "torch_dist")
        and not destination.dry_run
        and not calls.unify_groups(args.src, strategy, args.dst, split, read).plan.files
    ):
        raise UsageError(
            f"--split {split[0]}/{split[1]}: that part group is empty (this model fills fewer "
            f"than {split[1]} part files; use a smaller n)"
        )
    hf = output.format == "hf"
    tensors = TENSORS.build(
        args, input_paths(args.src, args.strategy), args.overwrite, hf, OUTPUT.keep_training_state(args)
    )
    report = calls.unify(
        args.src,
        strategy,
        args.dst,
        split=split,
        output=output,
        destination=destination,
        tensors=tensors.options,
        read=read,
        write=write,
        run=run_options,
    )
    finish(report, Printing(args.quiet, args.json, destination.dry_run, hf, tensors, args.started), args.dst)


__all__ = ["add", "run"]
