"""``reshard verify A B``: whether two checkpoints hold the same full tensors (exit 0 same, 1 differ).

Each side in any form reshard reads; ``--a-strategy`` / ``--b-strategy`` are the strategies of
rank folders on side A / B. The crc flag is ``--no-check-crc`` as on every command
(``--no-crc-check`` still works, with a note).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from reshard.cli import progress
from reshard.cli.flags import KeyFlags, ReadFlags, add_json, add_progress, add_quiet, flag, say_notes, section
from reshard.cli.strategies import add_strategy, source_strategy
from reshard.cli.tensor_flags import TensorFlags
from reshard.cli.values import memory_size

NAME = "verify"
KEYS = KeyFlags(write=False)
READ = ReadFlags(KEYS, iteration=" (on either side)", crc_renamed=["--no-crc-check"])
TENSORS = TensorFlags(names=False, dtypes=False, verb="compare only", drop="leave out")


def add(sub: Any) -> None:
    p = sub.add_parser(NAME, help="compare the full tensors of two checkpoints (exit 0 same, 1 differ)")
    p.add_argument("a", help="checkpoint file, unified folder, or rank_<r> folder tree (with --a-strategy)")
    p.add_argument("b", help="the other side, in any of those forms and either format")
    add_strategy(p, "--a-strategy", legacy=["--a_strategy"], help="strategy file or folder of side A's rank folders")
    add_strategy(p, "--b-strategy", legacy=["--b_strategy"], help="strategy file or folder of side B's rank folders")
    g = section(p, "output")
    flag(g, "--atol", type=float, default=0.0, help="count values within this absolute difference as equal")
    flag(g, "--all", action="store_true", help="list every tensor, matching ones too (default: only those that differ)")
    add_json(p, "print the result as one JSON record on stdout (every tensor compared)")
    flag(
        section(p, "run"),
        "--max-memory",
        legacy=["--max_memory"],
        type=memory_size,
        default=256 * 1024**2,
        help="bound on the tensor blocks compared at once, e.g. 256M (K/M/G and KiB/MiB/GiB are "
        "binary, KB/MB/GB decimal)",
    )
    add_quiet(p)
    add_progress(p, "bytes compared and ETA")
    READ.add(p)
    KEYS.add(p)
    g = section(p, "names and dtypes")
    flag(
        g,
        "--dtype",
        metavar="DTYPE",
        help="read floating tensors of both sides as bf16, fp16 or fp32 before comparing them exactly "
        "(checks an output written with --dtype against its source)",
    )
    flag(
        g,
        "--dequantize",
        metavar="DTYPE",
        help="read FP8 block pairs and MXFP4 pairs of both sides as bf16, fp16 or fp32 (checks an output "
        "written with --dequantize against its quantized source)",
    )
    flag(
        g,
        "--block-size",
        metavar="RxC",
        help="the FP8 block of --dequantize, e.g. 128x128 (default: each side's config.json "
        "quantization_config.weight_block_size; a DCP folder torch saved has none)",
    )
    TENSORS.add(p)
    p.set_defaults(func=run, reads=("a", "b"))  # read ahead while starting (reshard.readahead)


def run(args: argparse.Namespace) -> int:
    from reshard import verify
    from reshard.plan.quantized import Precision, parse_block

    a_strategy = source_strategy(args.a, args.a_strategy, "--a-strategy", args.quiet)
    b_strategy = source_strategy(args.b, args.b_strategy, "--b-strategy", args.quiet)
    read = READ.options(args)
    report = verify.verify(
        args.a,
        args.b,
        a_strategy=a_strategy,
        b_strategy=b_strategy,
        read=read,
        atol=args.atol,
        max_memory=args.max_memory,
        dtype=args.dtype,
        names=TENSORS.name_filter(args),
        dequantize=Precision(args.dequantize, parse_block(args.block_size) if args.block_size else None),
        **progress.hooks(args.progress, args.quiet, "comparing"),
    )
    progress.end()
    say_notes(report.notes, args.quiet)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        verify.print_report(report, progress.console(), all_rows=args.all)
    return 0 if report.ok else verify.EXIT_DIFFER


__all__ = ["add", "run"]
