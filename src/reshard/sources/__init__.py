"""Source discovery: what a path is (the registry) and the planning facts of what it holds.

Layer 4 of reshard: below the executors and the operations, above the plans and the formats.
``registry.identify`` answers "what is this path?" for every operation (transform, unify, split,
convert, inspect, verify), and ``registry.resolve`` adds every refusal a kind's ``Traits`` decide
(a strategy for a kind that carries its layouts, an iteration for one without); the kinds live one
family per module (``rank_folders``, ``full_model``, ``checkpoint2``, ``dcp``, ``strategy``) and open to
typed records (``kind.OpenedRanks``, ``kind.OpenedModel``, ``kind.OpenedChunks`` for a PyTorch DCP
folder's chunk boxes, ``kind.OpenedStrategy``); ``files`` opens one
checkpoint through ``formats.registry``; ``options`` holds ``ReadOptions``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reshard import lazy

if TYPE_CHECKING:  # where each name lives: a type checker imports them; at run time reshard.lazy reads this
    from reshard.sources.checkpoint2 import CHECKPOINT2
    from reshard.sources.dcp import DCP
    from reshard.sources.files import has_crc_trailer, indexed, open_checkpoint, source_file, source_files
    from reshard.sources.full_model import (
        ENCRYPTED_CKPT,
        FULL_FILE,
        HUGGING_FACE,
        HYPER_NAME,
        UNIFIED,
        config_path,
        full_model_file,
        hf_model,
        is_encrypted,
        model_folder,
    )
    from reshard.sources.kind import (
        FULL,
        SHARDED,
        AnyKind,
        Kind,
        Opened,
        OpenedChunks,
        OpenedModel,
        OpenedRanks,
        OpenedStrategy,
        StrategyKind,
        Traits,
    )
    from reshard.sources.megatron import MEGATRON
    from reshard.sources.options import ReadOptions, source_choice
    from reshard.sources.rank_folders import ONE_RANK_FOLDER, RANK_FOLDERS, chosen_names, rank_sources, rank_subfolders
    from reshard.sources.registry import (
        ANY_CHECKPOINT,
        CHECKPOINTS,
        CHUNKED,
        FULL_MODELS,
        KINDS,
        SHARDED_JOBS,
        identify,
        is_chunked,
        is_hf_model,
        is_sharded,
        kind_of,
        open_source,
        open_strategy,
        resolve,
        unified_index,
    )
    from reshard.sources.strategy import STRATEGY, is_strategy_file

__getattr__, __dir__ = lazy.exports(globals())  # each name's module, from the block above, loads on first use

__all__ = [
    "ANY_CHECKPOINT",
    "CHECKPOINT2",
    "CHECKPOINTS",
    "CHUNKED",
    "DCP",
    "ENCRYPTED_CKPT",
    "FULL",
    "FULL_FILE",
    "FULL_MODELS",
    "HUGGING_FACE",
    "HYPER_NAME",
    "KINDS",
    "MEGATRON",
    "ONE_RANK_FOLDER",
    "RANK_FOLDERS",
    "SHARDED",
    "SHARDED_JOBS",
    "STRATEGY",
    "UNIFIED",
    "AnyKind",
    "Kind",
    "Opened",
    "OpenedChunks",
    "OpenedModel",
    "OpenedRanks",
    "OpenedStrategy",
    "ReadOptions",
    "StrategyKind",
    "Traits",
    "chosen_names",
    "config_path",
    "full_model_file",
    "has_crc_trailer",
    "hf_model",
    "identify",
    "indexed",
    "is_chunked",
    "is_encrypted",
    "is_hf_model",
    "is_sharded",
    "is_strategy_file",
    "kind_of",
    "model_folder",
    "open_checkpoint",
    "open_source",
    "open_strategy",
    "rank_sources",
    "rank_subfolders",
    "resolve",
    "source_choice",
    "source_file",
    "source_files",
    "unified_index",
]
