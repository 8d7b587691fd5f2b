"""``reshard auto-transform CHECKPOINT``: at job start, convert once for all ranks into a shared cache.

Prints the path rank ``--rank-id`` loads on stdout, notes on stderr (``reshard.auto``).
"""

from __future__ import annotations

import argparse
from typing import Any

from reshard.cli.flags import OutputFlags, add_quiet, flag, say_notes, section
from reshard.cli.strategies import add_strategy
from reshard.cli.tensor_flags import TensorFlags, input_paths
from reshard.cli.values import positive_int, rank_list, rank_number
from reshard.ops.options import format_choices

NAME = "auto-transform"
OUTPUT = OutputFlags(formats=format_choices(NAME), format_help="default: the source's", hf=False)
TENSORS = TensorFlags(dtypes=False)


def add(sub: Any) -> None:
    p = sub.add_parser(
        NAME, help="at job start: convert once for all ranks into a shared cache, print the file this rank loads"
    )
    p.add_argument("checkpoint", help="any source transform reads (full model, rank folders, unify output, HF, ...)")
    add_strategy(p, "--dst-strategy", required=True, help="the job's strategy file or folder (waited for)")
    add_strategy(p, "--src-strategy", help="source strategy (default: MindFormers' strategy folder, for rank folders)")
    g = section(p, "layout")
    flag(g, "--rank-id", required=True, type=rank_number, help="this caller's destination rank")
    flag(
        g,
        "--world-size",
        type=positive_int,
        help="the job's rank count: wait until the strategy files describe this many ranks",
    )
    flag(g, "--local-ranks", type=rank_list, help="this node's ranks (e.g. 0-7), converted together")
    g = section(p, "output")
    flag(
        g,
        "--cache-dir",
        help="cache folder shared by all callers (default: $RESHARD_CACHE, else ~/.cache/reshard/transformed)",
    )
    flag(g, "--max-cache-bytes", help="evict the oldest unused entries beyond this size (e.g. 500GB)")
    OUTPUT.add(p)
    flag(section(p, "run"), "--timeout", type=float, help="seconds to wait for the strategy files (default 3600)")
    add_quiet(p, "no notes on stderr")
    TENSORS.add(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from reshard.auto import auto_transform

    tensors = TENSORS.build(args, input_paths(args.checkpoint, args.src_strategy, args.dst_strategy), False)
    named = {} if tensors.options.names is None else {"names": tensors.options.names}
    path = auto_transform(
        args.checkpoint,
        args.dst_strategy,
        args.rank_id,
        src_strategy=args.src_strategy,
        cache_dir=args.cache_dir,
        world_size=args.world_size,
        output_format=OUTPUT.options(args).format,
        timeout=args.timeout,
        local_ranks=args.local_ranks,
        max_cache_bytes=args.max_cache_bytes,
        on_note=lambda note: say_notes([note], args.quiet),
        **named,
    )
    print(path)


__all__ = ["add", "run"]
