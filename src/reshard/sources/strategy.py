"""Strategy files and folders as a source kind: what ``inspect`` shows and ``--strategy`` names.

A strategy file is MindSpore's ``ParallelStrategyMap`` protobuf (a ``.ckpt`` like the checkpoints)
or its JSON form; a folder of per-stage files is merged in memory. Telling a protobuf strategy
from a checkpoint costs one byte: a strategy starts with ``current_stage`` (field 1, varint), a
checkpoint with a length-delimited record.
"""

from __future__ import annotations

import os

from reshard.errors import ReshardError
from reshard.formats.hf_index import INDEX_NAME
from reshard.formats.strategy import JSON_SUFFIX, PROTOBUF_SUFFIX, load_strategy, read_strategy
from reshard.sources.kind import STRATEGY as HOLDS_STRATEGY
from reshard.sources.kind import OpenedStrategy, Traits
from reshard.sources.options import ReadOptions

STRATEGY_FIRST_BYTE = 0x08  # ParallelStrategyMap starts with current_stage (field 1, varint)
NAME_MAP = "param_name_map.json"  # unify's index: JSON that is not a strategy
_INDEX_NAMES = (NAME_MAP, INDEX_NAME)


def is_strategy_file(path: str) -> bool:
    """A strategy file (``.json`` other than the model indexes, or a protobuf ``.ckpt``)?

    Decided by the name and the first byte, so a multi-GB ``.ckpt`` is never read; a ``.ckpt``
    starting like a strategy that does not parse as one is a checkpoint (its reader reports it).
    """
    if not os.path.isfile(path):
        return False
    if path.endswith(JSON_SUFFIX):
        return os.path.basename(path) not in _INDEX_NAMES
    if not path.endswith(PROTOBUF_SUFFIX):
        return False
    with open(path, "rb") as fh:
        first = fh.read(1)
    if first != bytes([STRATEGY_FIRST_BYTE]):
        return False
    try:
        read_strategy(path)
    except ReshardError:  # not a strategy after all: report it as a checkpoint problem
        return False
    return True


def folder_files(folder: str) -> list[str]:
    """The visible regular files directly in ``folder``, sorted by name."""
    try:
        names = sorted(n for n in os.listdir(folder) if not n.startswith("."))
    except OSError:
        return []
    return [os.path.join(folder, n) for n in names if os.path.isfile(os.path.join(folder, n))]


class Strategy:
    """A strategy file, or a folder holding strategy files and no checkpoint."""

    name = "a strategy file or folder"
    looks_for = "a strategy file (.ckpt protobuf or .json) or a folder of them"
    traits = Traits(HOLDS_STRATEGY)

    def detect(self, path: str) -> bool:
        if not os.path.isdir(path):
            return is_strategy_file(path)
        files = [f for f in folder_files(path) if f.endswith((PROTOBUF_SUFFIX, ".safetensors", JSON_SUFFIX))]
        strategies = [f for f in files if is_strategy_file(f)]
        checkpoints = [f for f in files if not f.endswith(JSON_SUFFIX) and f not in strategies]
        return bool(strategies) and not checkpoints

    def open(self, path: str, options: ReadOptions | None, notes: list[str]) -> OpenedStrategy:
        sf = load_strategy(path)
        notes.extend(sf.notes)
        return OpenedStrategy(self.name, path, sf)


STRATEGY = Strategy()

__all__ = ["NAME_MAP", "STRATEGY", "STRATEGY_FIRST_BYTE", "folder_files", "is_strategy_file"]
