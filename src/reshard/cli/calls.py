"""Every call the command makes into ``reshard.api``, taking the option objects its flag groups build.

Why one module: the operations take these objects (``output=OutputSpec``,
``destination=Destination``, ``tensors=TensorOptions``, issue 20), and the few places where a
command's flags say more than one object can (convert's ``--to ckpt`` with ``--hf``) are decided
here. A call the flags map one to one (``transform``, ``split``) is made as ``calls.api.transform``:
the command's flag groups build exactly the objects the api takes.

``reshard.api`` is loaded on its first use (``_loaded_on_first_use``): every module the command
imports at start is numpy-free, so ``reshard --version`` and every ``--help`` never load numpy.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

from reshard.errors import UsageError
from reshard.ops.options import Destination, OutputSpec, TensorOptions

if TYPE_CHECKING:
    from reshard import api
    from reshard.execute.options import RunOptions, WriteOptions
    from reshard.sources.options import ReadOptions


def _loaded_on_first_use(name: str) -> ModuleType:
    """Module ``name``, executed when one of its attributes is first read (``importlib.util.LazyLoader``).

    The module is registered as a normal import would be, so ``import reshard.api`` elsewhere gets
    the same object.
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ImportError(f"no module named {name!r}")
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    setattr(sys.modules[parent], child, module)
    spec.loader.exec_module(module)
    return module


if not TYPE_CHECKING:
    api = _loaded_on_first_use("reshard.api")


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
