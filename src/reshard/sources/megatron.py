"""A Megatron-core ``torch_dist`` checkpoint as a source kind: a DCP folder with ``metadata.json`` and ``common.pt``.

Its tensors are the DCP folder's (``sources.dcp``: ``.metadata`` read alone, the data files only when
an operation copies bytes), so it opens as ``OpenedChunks`` and every operation that reads a DCP
folder reads it. Megatron-core keys are module paths; a transformer block's layers are one tensor
with a leading layer axis (``decoder.layers.self_attention.linear_qkv.weight`` of shape ``(L, ...)``,
each pipeline stage saving a range of it), read as what they are: one global tensor, planned and
sliced along that axis like any other. ``common.pt`` is never unpickled; an output of the same
format carries it byte for byte (``common_file``).

A Megatron-LM run folder (``latest_checkpointed_iteration.txt`` beside ``iter_<7 digits>/``) stands
for the save its tracker names; ``ReadOptions.iteration`` picks another. Megatron-LM's tracker has
the name MindFormers' Checkpoint 2.0 uses, so this kind is asked before that one: a folder holding
``iter_*`` save folders (and no ``iteration_*`` one) is Megatron's.

``detect`` looks at names only: a folder holding ``metadata.json`` beside ``common.pt`` or
``.metadata`` (a save folder), or a run folder as above. ``open`` then checks ``metadata.json``
(another sharded backend than torch_dist is refused, as "not supported") and that ``common.pt`` exists.
"""

from __future__ import annotations

import dataclasses
import os

from reshard.errors import FormatError, UsageError
from reshard.formats import dcp, megatron
from reshard.sources.dcp import DcpFolder
from reshard.sources.kind import SHARDED, OpenedChunks, Traits
from reshard.sources.options import ReadOptions


def is_save_folder(path: str) -> bool:
    """A folder holding ``metadata.json`` beside ``common.pt`` or a DCP ``.metadata`` (names only)."""
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, megatron.CONFIG_NAME)):
        return False
    return any(os.path.isfile(os.path.join(path, n)) for n in (megatron.COMMON_NAME, dcp.METADATA_NAME))


def is_run_folder(path: str) -> bool:
    """A Megatron-LM run folder: ``iter_*`` / ``release`` save folders (the tracker may name one), none
    of MindFormers' ``iteration_*``."""
    if not os.path.isdir(path) or is_save_folder(path):
        return False
    saves = megatron.iteration_folders(path)
    if not saves:
        return False
    return not any(n.startswith("iteration_") for n in os.listdir(path))


def save_folder(path: str, options: ReadOptions | None) -> str:
    """The save folder ``path`` stands for: itself, or a run folder's (the iteration asked for, else the tracker's).

    Raises:
        UsageError: An iteration for one save folder, or one the run folder does not hold.
    """
    iteration = options.iteration if options is not None else None
    if is_run_folder(path):
        return megatron.resolve_iteration(path, iteration)
    if iteration is not None:
        raise UsageError(
            f"an iteration ({iteration}) picks a save of a Megatron-LM run folder; this is one save folder "
            "(give the folder holding it and latest_checkpointed_iteration.txt)",
            path,
        )
    return path


def common_file(folder: str) -> str:
    """The ``common.pt`` of a save folder, which must exist (Megatron's load reads it first).

    Raises:
        FormatError: It is missing.
    """
    path = os.path.join(folder, megatron.COMMON_NAME)
    if not os.path.isfile(path):
        raise FormatError(f"no {megatron.COMMON_NAME}: a Megatron-core torch_dist checkpoint has one", folder)
    return path


class MegatronFolder(DcpFolder):
    """A Megatron-core ``torch_dist`` save folder, or a Megatron-LM run folder of them."""

    name = "a Megatron-core torch_dist checkpoint"
    looks_for = (
        "a Megatron-core torch_dist folder (metadata.json, common.pt, .metadata) or a Megatron-LM run folder "
        "(latest_checkpointed_iteration.txt, iter_<7 digits>/)"
    )
    traits = Traits(holds=SHARDED, owns_layouts=".metadata", iterations=True)

    def detect(self, path: str) -> bool:
        return is_save_folder(path) or is_run_folder(path)

    def open(self, path: str, options: ReadOptions | None, notes: list[str]) -> OpenedChunks:
        folder = save_folder(path, options)
        if os.path.normpath(folder) != os.path.normpath(path):
            notes.append(f"reading {os.path.basename(folder)} of the Megatron-LM run folder {path}")
        megatron.read_config(folder)
        common_file(folder)
        return dataclasses.replace(super().open(folder, options, notes), kind=self.name, path=folder)


MEGATRON = MegatronFolder()


def side_files(path: str, options: ReadOptions | None) -> list[str]:
    """The files a read of the torch_dist checkpoint ``path`` opens beside its ``.distcp`` data: the run
    folder's tracker (no iteration asked for), and the save folder's ``metadata.json``, ``common.pt`` and
    ``.metadata`` (``rank-list --files``: a copy for some destination ranks needs them too)."""
    folder = save_folder(path, options)
    tracker = os.path.join(path, megatron.TRACKER_NAME)
    followed = (options is None or options.iteration is None) and os.path.normpath(folder) != os.path.normpath(path)
    found = [tracker] if followed and os.path.isfile(tracker) else []
    names = (megatron.CONFIG_NAME, megatron.COMMON_NAME, dcp.METADATA_NAME)
    return found + [p for p in (os.path.join(folder, n) for n in names) if os.path.isfile(p)]


__all__ = [
    "MEGATRON",
    "MegatronFolder",
    "common_file",
    "is_run_folder",
    "is_save_folder",
    "save_folder",
    "side_files",
]
