"""``reshard rank-list RANK``: which source ranks (or, with ``--files``, files) one destination rank reads."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from reshard.cli import calls
from reshard.cli.flags import ReadFlags, add_json, flag, say_notes, section
from reshard.cli.strategies import add_strategy, source_strategy
from reshard.cli.values import no_path, rank_number
from reshard.errors import UsageError

NAME = "rank-list"
READ = ReadFlags(None, files=False, crc=False)


def add(sub: Any) -> None:
    p = sub.add_parser(NAME, help="source ranks a destination rank needs")
    p.add_argument("rank", type=rank_number, help="a destination rank")
    add_strategy(
        p,
        "--src-strategy",
        legacy=["--src_ckpt_strategy"],
        dest="src_strategy",
        help="source strategy (default: MindFormers' output/strategy folder; None: full weights)",
    )
    add_strategy(
        p,
        "--dst-strategy",
        legacy=["--dst_ckpt_strategy"],
        dest="dst_strategy",
        help="destination strategy (None or none given: one full model, rank 0)",
    )
    flag(
        section(p, "input"), "--src", help="the source checkpoint: a MindFormers Checkpoint 2.0 needs no --src-strategy"
    )
    flag(
        section(p, "output"), "--files", action="store_true", help="print the source files the rank reads (needs --src)"
    )
    add_json(p, "print the result as one JSON record on stdout (a list)")
    READ.add(p)
    p.set_defaults(func=run, quiet=False)


def run(args: argparse.Namespace) -> None:
    from reshard.formats.strategy import load_strategy
    from reshard.layout import device_num, stage_count

    notes: list[str] = []
    dst = no_path(args.dst_strategy)
    dst_sf = load_strategy(dst) if dst is not None else None
    if dst_sf is not None:
        notes.extend(dst_sf.notes)
    total = device_num(dst_sf) * stage_count(dst_sf) if dst_sf is not None else 1
    if args.rank >= total:
        where = (
            f"the destination strategy has {total} ranks (0..{total - 1})"
            if dst_sf is not None
            else "without a destination strategy the destination is one full model, rank 0"
        )
        raise UsageError(f"destination rank {args.rank} out of range: {where}", dst)
    if args.files:
        _print_rank_files(args, dst_sf, notes)
        return
    ranks = calls.needed_ranks(args.rank, _source_layouts(args, notes), dst_sf, notes)
    say_notes(notes, args.quiet)
    ranks = sorted(int(r) for r in ranks)  # MindSpore's list order carries no meaning; a person reads 0 1 2
    print(json.dumps(ranks) if args.json else " ".join(str(r) for r in ranks))


def _source_layouts(args: argparse.Namespace, notes: list[str]) -> Any:
    """The source layouts: ``--src-strategy``, or a MindFormers Checkpoint 2.0's metadata.json (``--src``)."""
    if args.src is None:
        if args.read_iteration is not None:
            raise UsageError("--src-iteration applies to a MindFormers Checkpoint 2.0 given with --src")
        return source_strategy(None, args.src_strategy, "--src-strategy", args.quiet)
    from reshard.sources import CHECKPOINT2, resolve

    read = READ.options(args)
    kind = resolve(args.src, strategy=args.src_strategy, read=read, full_takes_strategy=True)
    if kind.traits.owns_layouts is None:
        return source_strategy(args.src, args.src_strategy, "--src-strategy", args.quiet)
    if kind is CHECKPOINT2:  # the layouts are metadata.json's: a copy for some ranks will do
        return CHECKPOINT2.open(args.src, read, notes, partial=True).strategy
    return kind.open(args.src, read, notes).strategy


def _print_rank_files(args: argparse.Namespace, dst_sf: Any, notes: list[str]) -> None:
    """The files destination ``args.rank`` reads: the sources of its plan and, for a Checkpoint 2.0,
    the texts a transform reads beside them (nothing is written)."""
    if args.src is None:
        raise UsageError("--files needs the source (--src)")
    read = READ.options(args)
    report = calls.plan_ranks(args.src, no_path(args.src_strategy), dst_sf, args.rank, read)
    say_notes([*notes, *_reading_notes(report.notes)], args.quiet)
    sources = report.plan.sources
    texts = _texts(args.src, read)  # named as the sources are: absolute when they are
    if sources and all(os.path.isabs(p) for p in sources):
        texts = [os.path.abspath(t) for t in texts]
    files = sorted({*sources, *texts})
    print(json.dumps(files) if args.json else "\n".join(files))


def _texts(src: str, read: Any) -> list[str]:
    """What a transform reads beside the tensor files: a Checkpoint 2.0's tracker (a root's),
    ``metadata.json`` and ``common.json`` (carried over into a Checkpoint 2.0 output); a PyTorch DCP
    folder's ``.metadata``; a torch_dist checkpoint's tracker, ``metadata.json``, ``common.pt`` and
    ``.metadata``; none for other sources."""
    from reshard.sources import CHECKPOINT2, DCP, MEGATRON, resolve

    kind = resolve(src, read=read)
    if kind is CHECKPOINT2:
        from reshard.sources.checkpoint2 import text_files

        return text_files(src, read)
    if kind is MEGATRON:
        from reshard.sources.megatron import side_files

        return side_files(src, read)
    if kind is DCP:
        from reshard.formats.dcp import METADATA_NAME

        return [os.path.join(src, METADATA_NAME)]
    return []


def _reading_notes(notes: list[str]) -> list[str]:
    """The plan's notes but what an output would not hold (a DCP source's non-tensor values): the plan
    only names the files the rank reads, and nothing is written."""
    if not notes:
        return notes
    from reshard.ops.chunked import VALUES_NOT_CARRIED

    return [n for n in notes if VALUES_NOT_CARRIED not in n]


__all__ = ["add", "run"]
