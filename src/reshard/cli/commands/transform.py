"""``reshard transform SRC DST``: move a checkpoint to another parallel layout (and ``plan``'s flags).

``plan`` is the same command stopped before the first byte, so both take the flags that shape the
plan (``add_plan_flags``); ``transform`` adds how the run executes and what outputs hold. The
source and destination are positional, as for ``convert``, ``unify`` and ``split``; ``--src`` /
``--dst`` and MindFormers' ``--src_ckpt_dir`` ... spellings still work. MindFormers' own tool's
flags (``--src_checkpoint`` ...) hand the run to ``reshard.cli.commands.transform_ckpt``.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from reshard.cli import calls
from reshard.cli.commands import transform_ckpt
from reshard.cli.flags import (
    DestinationFlags,
    KeyFlags,
    OutputFlags,
    ReadFlags,
    RunFlags,
    WriteFlags,
    add_json,
    flag,
    section,
)
from reshard.cli.parsing import IntermixedParser
from reshard.cli.report import Printing, finish
from reshard.cli.strategies import add_ranks, add_strategy, source_strategy
from reshard.cli.tensor_flags import TensorFlags, input_paths
from reshard.cli.values import no_path
from reshard.errors import UsageError
from reshard.ops.options import format_choices

NAME = "transform"
KEYS = KeyFlags()
READ = ReadFlags(KEYS, iteration="", iteration_renamed=())  # --iteration is the output's here
OUTPUT = OutputFlags(
    formats=format_choices(NAME),
    format_help="ckpt or safetensors rank folders, checkpoint2: a MindFormers 2.x Checkpoint 2.0, or dcp: a "
    "PyTorch Distributed Checkpoint (default: the source's format)",
    prefix=True,
    checkpoint2=True,
    dcp_ranks=True,
)
DESTINATION = DestinationFlags("replace files in a non-empty destination")
WRITE = WriteFlags(KEYS)
RUN = RunFlags()
TENSORS = TensorFlags()


def add_places(p: argparse.ArgumentParser) -> None:
    """``SRC DST`` (or ``--src``/``--dst``, MindFormers' ``--src_ckpt_dir``/``--dst_ckpt_dir``), the strategies."""
    p.add_argument("src_path", nargs="?", metavar="SRC", help="rank_<r> folders or a full file (or --src SRC)")
    p.add_argument("dst_path", nargs="?", metavar="DST", help="output folder (or --dst DST)")
    flags = [
        flag(
            section(p, "input"),
            "--src",
            legacy=["--src_ckpt_dir", "--src-ckpt-dir"],
            dest="src",
            help="the source, as SRC",
        ),
        flag(
            section(p, "output"),
            "--dst",
            legacy=["--dst_ckpt_dir", "--dst-ckpt-dir"],
            dest="dst",
            help="the output folder, as DST",
        ),
    ]
    for action in flags:  # SRC DST is the documented form: the usage line shows it alone
        action.out_of_usage = True  # type: ignore[attr-defined]
    add_strategy(
        p,
        "--src-strategy",
        legacy=["--src_ckpt_strategy", "--src-ckpt-strategy"],
        dest="src_strategy",
        help="source strategy file or folder of per-stage files (None: full weights)",
    )
    add_strategy(
        p,
        "--dst-strategy",
        legacy=["--dst_ckpt_strategy", "--dst-ckpt-strategy"],
        dest="dst_strategy",
        help="destination strategy file or folder (None: full weights)",
    )
    add_ranks(p)
    p.__class__ = IntermixedParser  # SRC and DST may follow the flags


def add_plan_flags(p: argparse.ArgumentParser, keys: KeyFlags, read: ReadFlags) -> None:
    """What shapes the plan: places, strategies, ranks, the output spec, the source, names and dtypes."""
    add_places(p)
    read.add(p)
    OUTPUT.add(p)
    add_json(p)
    TENSORS.add(p)
    keys.add(p)


def add(sub: Any) -> None:
    p = sub.add_parser(NAME, help="move a checkpoint to another parallel layout")
    add_plan_flags(p, KEYS, READ)
    transform_ckpt.add_flags(p)
    DESTINATION.add(p)
    WRITE.add(p)
    RUN.add(p)
    p.set_defaults(func=run, reads=("src_path", "src"))  # read ahead while starting (reshard.readahead)


def places(args: argparse.Namespace, command: str) -> tuple[str, str]:
    """The source and destination, given as ``SRC DST`` or with ``--src``/``--dst`` (once each)."""
    src, dst = args.src_path or args.src, args.dst_path or args.dst
    if args.src_path and args.src and args.src_path != args.src:
        raise UsageError(f"two sources: {args.src_path} and --src {args.src} (give SRC once)")
    if args.dst_path and args.dst and args.dst_path != args.dst:
        raise UsageError(f"two destinations: {args.dst_path} and --dst {args.dst} (give DST once)")
    if not src:
        raise UsageError(f"give the source: reshard {command} SRC DST")
    if not dst:
        raise UsageError(f"give the destination: reshard {command} SRC DST")
    args.src, args.dst = src, dst  # what MindFormers' tool mode refuses beside its own flags
    return src, dst


def run(args: argparse.Namespace) -> None:
    if transform_ckpt.asked(args):  # MindFormers' transform_checkpoint.py flags
        return transform_ckpt.run(args)
    src, dst = places(args, NAME)
    run_options = RUN.options(args, dry_run=args.dry_run)
    read = READ.options(args)
    planned_from, run_options = _source_from_nodes(src, run_options, read)
    if planned_from != src:
        read = dataclasses.replace(read, verify_crc=False)
    destination = DESTINATION.options(args)
    report, tensors, hf = call_transform(
        args, src, planned_from, read=read, destination=destination, write=WRITE.options(args), run=run_options
    )
    how = Printing(args.quiet, args.json, destination.dry_run, hf, tensors, args.started)
    finish(report, how, dst)


def call_transform(
    args: argparse.Namespace,
    src: str,
    planned_from: str,
    *,
    read: Any,
    destination: Any,
    write: Any,
    run: Any,
) -> tuple[Any, Any, bool]:
    """The ``api.transform`` call ``transform`` and ``plan`` both make: (its report, the tensor flags, ``--hf``?).

    ``src`` is the user's source (its strategy and the paths no output may touch); ``planned_from`` is
    what is planned from (the source, or ``--placement``'s header-only copy of it).
    """
    src_strategy = source_strategy(src, args.src_strategy, "--src-strategy", args.quiet)
    output = OUTPUT.options(args)
    hf = output.format == "hf"
    inputs = input_paths(src, args.src_strategy, args.dst_strategy)
    tensors = TENSORS.build(args, inputs, args.overwrite, hf, OUTPUT.keep_training_state(args))
    report = calls.api.transform(
        planned_from,
        args.dst,
        src_strategy,
        no_path(args.dst_strategy),
        ranks=args.ranks,
        output=output,
        destination=destination,
        tensors=tensors.options,
        read=read,
        write=write,
        run=run,
    )
    return report, tensors, hf


def _source_from_nodes(src: str, run_options: Any, read: Any) -> tuple[str, Any]:
    """``--placement``: plan from a header-only copy of the source made from the nodes (none need be here)."""
    from reshard.execute.options import RayOptions

    if not isinstance(run_options, RayOptions) or run_options.placement is None:
        return src, run_options
    from reshard.execute.ray import source_from_nodes  # only for a Ray run: a local one never imports it

    return source_from_nodes(src, run_options, read)


__all__ = ["add", "add_places", "add_plan_flags", "call_transform", "places", "run"]
