"""The native Python API: one function per operation, each "plan, then execute".

Every operation first builds a :class:`~reshard.plan.Plan` from file headers and strategies (so
``Destination(dry_run=True)`` returns it without writing a byte), then runs it through the one run
path (``reshard.ops.run``): the destination is checked before anything is written (it may not lie
inside a source, and a non-empty one is refused unless ``Destination(overwrite=True)``, which
replaces the files the plan writes and removes an earlier run's outputs that a layout with fewer
ranks no longer has, or ``resume=True``, which continues an interrupted run); the run holds the
destination's lock (``reshard.lock``), journals its outputs and writes ``reshard-manifest.json`` last
(``reshard.manifest``); a run that fails removes what it created.

This module is the documented façade; each operation lives in its own module of ``reshard.ops``
(``transform``, ``by_rank``, ``unify``, ``split``, ``convert``, ``recrypt``). They take the same
keyword-only option values, one per concern, none of them required:

* ``output=OutputSpec(...)``: what is written (``ckpt``, ``safetensors``, ``hf``, ``checkpoint2``; the
  file prefix, the Hugging Face shard size, a Checkpoint 2.0's iteration and ``common.json``);
* ``destination=Destination(...)``: overwrite, resume, dry run, manifest;
* ``tensors=TensorOptions(...)``: filters and model maps, dequantize/quantize, dtype casts;
* ``read=ReadOptions(...)`` (how sources are found and opened), ``write=WriteOptions(...)`` (what the
  outputs' bytes hold: crc trailer, encryption, checksum) and ``run=RunOptions(...)`` (threads,
  memory bound, progress; ``RayOptions`` runs on Ray).

What a source path is (rank folders, a full file, a unified or Hugging Face model, a strategy) is
asked of the source registry, ``reshard.sources``; its discovery functions (``ReadOptions``,
``open_checkpoint``, ``unified_index`` ...) are re-exported here, where the README shows them.

Example:
    from reshard import api
    api.transform("demo/ckpt_8ranks", "ckpt_4ranks", "demo/strategy_8", "demo/strategy_4",
                  destination=api.Destination(overwrite=True))
    api.transform("demo/ckpt_8ranks", "hf", "demo/strategy_8", None, output=api.OutputSpec(format="hf"))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reshard import lazy

if TYPE_CHECKING:  # where each name lives: a type checker imports them; at run time reshard.lazy reads this
    from reshard.destination import check_destination
    from reshard.execute.options import RunOptions, WriteOptions
    from reshard.ops.by_rank import needed_ranks, transform_by_rank
    from reshard.ops.convert import convert
    from reshard.ops.options import Destination, OutputSpec, TensorOptions, UnifyOptions
    from reshard.ops.pairs import convert_targets, holds_only_ckpt
    from reshard.ops.recrypt import recrypt
    from reshard.ops.run import Report, execute, superseded
    from reshard.ops.split import split
    from reshard.ops.transform import transform
    from reshard.ops.unify import unify
    from reshard.sources import (
        HYPER_NAME,
        ReadOptions,
        full_model_file,
        has_crc_trailer,
        hf_model,
        is_hf_model,
        model_folder,
        open_checkpoint,
        rank_sources,
        source_file,
        unified_index,
    )

# A name is imported from its module (the ``TYPE_CHECKING`` block above says which) when first read
# (``reshard.lazy``), so a process pays only for the operations it runs: ``reshard transform`` used to
# load every operation's modules (by-rank, unify, split, convert, recrypt ...) through this façade,
# ~20 ms of a cold merge's critical path before its first planned read.
__getattr__, __dir__ = lazy.exports(globals(), within="reshard")


# The operations, their option values, and the source discovery names the README shows (defined in
# reshard.sources).
__all__ = [
    "HYPER_NAME",
    "Destination",
    "OutputSpec",
    "ReadOptions",
    "Report",
    "RunOptions",
    "TensorOptions",
    "UnifyOptions",
    "WriteOptions",
    "check_destination",
    "convert",
    "convert_targets",
    "execute",
    "full_model_file",
    "has_crc_trailer",
    "hf_model",
    "holds_only_ckpt",
    "is_hf_model",
    "model_folder",
    "needed_ranks",
    "open_checkpoint",
    "rank_sources",
    "recrypt",
    "source_file",
    "split",
    "superseded",
    "transform",
    "transform_by_rank",
    "unified_index",
    "unify",
]
