"""Every call the command makes into ``reshard.api``, taking the option objects its flag groups build.

Why one module: the operations are moving to these objects (``output=OutputSpec``,
``destination=Destination``, ``tensors=TensorOptions``, issue 20); until ``reshard.api`` takes
them, the functions here unpack them into its keywords (``OutputSpec(format="hf",
max_shard_size=s)`` is ``hf=True, max_shard_size=s``), so the rest of the CLI never spells an api
keyword and the change lands in this one file.

``reshard.api`` is loaded on its first use (``_loaded_on_first_use``): every module the command
imports at start is numpy-free, so ``reshard --version`` and every ``--help`` never load numpy.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

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


def _output(output: OutputSpec) -> dict[str, Any]:
    """``hf`` and ``max_shard_size`` of today's keywords (``format="hf"``: Hugging Face shards)."""
    return {"hf": output.format == "hf", "max_shard_size": output.max_shard_size}


def _destination(destination: Destination) -> dict[str, Any]:
    return {
        "overwrite": destination.overwrite,
        "resume": destination.resume,
        "dry_run": destination.dry_run,
        "manifest": destination.manifest,
    }


def _tensors(tensors: TensorOptions) -> dict[str, Any]:
    named = {} if tensors.names is None else {"names": tensors.names}
    return {**named, "dtype": tensors.dtype, "dtype_all": tensors.dtype_all, "precision": tensors.precision}


def transform(
    src: str,
    dst: str,
    src_strategy: Any,
    dst_strategy: Any,
    *,
    ranks: Sequence[int] | None,
    output: OutputSpec,
    destination: Destination,
    tensors: TensorOptions,
    read: ReadOptions,
    write: WriteOptions | None,
    run: RunOptions | None,
) -> api.Report:
    fmt = None if output.format == "hf" else output.format
    return api.transform(
        src,
        dst,
        src_strategy,
        dst_strategy,
        prefix=output.prefix,
        output_format=fmt,
        ranks=ranks,
        read=read,
        write=write,
        run=run,
        iteration=output.iteration,
        common=output.common,
        optimizer_prefixes=tuple(output.optimizer_prefixes),
        **_destination(destination),
        **_output(output),
        **_tensors(tensors),
    )


def plan_ranks(src: str, src_strategy: Any, dst_strategy: Any, rank: int, read: ReadOptions) -> api.Report:
    """The plan of destination ``rank`` alone (``rank-list --files``): nothing is written."""
    return api.transform(src, "", src_strategy, dst_strategy, ranks=[rank], read=read, dry_run=True)


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
        split_dst_file=split,
        read=read,
        write=write,
        run=run,
        **_destination(destination),
        **_output(output),
        **_tensors(tensors),
    )


def unify_groups(src: str, strategy: Any, dst: str, split: tuple[int, int], read: ReadOptions) -> api.Report:
    """The plan of one part group of a unify (to refuse an empty one before anything is written)."""
    return api.unify(src, strategy, dst, split_dst_file=split, read=read, dry_run=True)


def split(
    src: str,
    strategy: Any,
    dst: str,
    *,
    ranks: Sequence[int] | None,
    name_map: Mapping[str, str] | None,
    output: OutputSpec,
    destination: Destination,
    tensors: TensorOptions,
    write: WriteOptions,
    run: RunOptions,
) -> api.Report:
    return api.split(
        src,
        strategy,
        dst,
        ranks=ranks,
        output_format=output.format or "safetensors",
        name_map=name_map,
        write=write,
        run=run,
        **_destination(destination),
        **_tensors(tensors),
    )


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
    """``to``: convert's ``--to`` (``output.format`` is ``hf`` with ``--hf``, else ``to``)."""
    return api.convert(
        src,
        dst,
        to,
        name_map=name_map,
        file_regex=file_regex,
        read=read,
        write=write,
        run=run,
        **_destination(destination),
        **_output(output),
        **_tensors(tensors),
    )


def needed_ranks(rank: int, source: Any, dst_strategy: Any, notes: list[str]) -> list[int]:
    return list(api.needed_ranks(rank, source, dst_strategy, notes))


__all__ = ["convert", "needed_ranks", "plan_ranks", "split", "transform", "unify", "unify_groups"]
