"""Every call the command makes into ``reshard.api``, taking the option objects its flag groups build.

Why one module: the operations take these objects (``output=OutputSpec``,
``destination=Destination``, ``tensors=TensorOptions``, issue 20), and the few places where a
command's flags say more than one object can (convert's ``--to ckpt`` with ``--hf``) are decided
here. A call the flags map one to one (``transform``, ``split``) is made as ``calls.api.transform``:
the command's flag groups build exactly the objects the api takes.

``reshard.api`` imports each name from its module when it is first read, so a command loads only
the operation it runs, and every module the command imports at start is numpy-free: ``reshard
--version`` and every ``--help`` never load numpy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from reshard import api
from reshard.errors import UsageError
from reshard.ops.options import Destination, OutputSpec, TensorOptions

if TYPE_CHECKING:
    from reshard.execute.options import RunOptions, WriteOptions
    from reshard.sources.options import ReadOptions


def plan_ranks(src: str, src_strategy: Any, dst_strategy: Any, rank: int, read: ReadOptions) -> api.Report:
    """The plan of destination ``rank`` alone (``rank-list --files``): nothing is written."""
    dry = Destination(dry_run=True)
    return api.transform(src, "", src_strategy, dst_strategy, ranks=[rank], destination=dry, read=read)


def unify(
    src: str,
    strategy: Any,
    dst: str,
    *,
    split: tuple[int, int] | tuple[()],
    output: OutputSpec,
    destination: Destination,
    tensors: TensorOptions,
    read: ReadOptions,
    write: WriteOptions | None,
    run: RunOptions | None,
) -> api.Report:
    return api.unify(
        src,
        strategy,
        dst,
        parts=api.UnifyOptions(split_dst_file=split),
        output=output,
        destination=destination,
        tensors=tensors,
        read=read,
        write=write,
        run=run,
    )


def unify_groups(src: str, strategy: Any, dst: str, split: tuple[int, int], read: ReadOptions) -> api.Report:
    """The plan of one part group of a unify (to refuse an empty one before anything is written)."""
    parts, dry = api.UnifyOptions(split_dst_file=split), Destination(dry_run=True)
    return api.unify(src, strategy, dst, parts=parts, destination=dry, read=read)


def convert(
    src: str,
    dst: str,
    to: str,
    *,
    name_map: Mapping[str, str] | None,
    file_regex: str | None,
    output: OutputSpec,
    destination: Destination,
    tensors: TensorOptions,
    read: ReadOptions,
    write: WriteOptions,
    run: RunOptions,
) -> api.Report:
    """``to``: convert's ``--to`` (``output.format`` is ``hf`` with ``--hf``, else ``to``).

    Raises:
        UsageError: ``--hf`` with ``--to ckpt`` (Hugging Face shards are safetensors).
    """
    if output.format == "hf" and to != "safetensors":
        raise UsageError("Hugging Face output converts one full .ckpt file to safetensors", src)
    return api.convert(
        src,
        dst,
        output,
        name_map=name_map,
        file_regex=file_regex,
        destination=destination,
        tensors=tensors,
        read=read,
        write=write,
        run=run,
    )


def needed_ranks(rank: int, source: Any, dst_strategy: Any, notes: list[str]) -> list[int]:
    return list(api.needed_ranks(rank, source, dst_strategy, notes))


__all__ = ["api", "convert", "needed_ranks", "plan_ranks", "unify", "unify_groups"]
