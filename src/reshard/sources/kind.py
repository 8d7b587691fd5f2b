"""What a kind of source is: a name, what it can do (``Traits``), a cheap ``detect``, an ``open``, and
the typed record ``open`` hands back.

A kind says as data what every face used to re-decide for itself: whether it holds a sharded job,
a full model or a strategy; whether it carries its own layouts (a strategy given with it is
refused); whether it has iterations to pick from; whether its files are encrypted.
``sources.resolve`` reads these traits and raises every "give no strategy" / "an iteration applies
to ..." refusal in one place.

A checkpoint kind's ``open`` returns one of two records, so a caller matches on what it got
instead of probing a union's empty fields: ``OpenedRanks`` (a job's ranks, and the layouts when the
kind carries them) or ``OpenedModel`` (a full model: its files and which file holds each tensor).
A kind whose shards are not MindSpore layouts (a PyTorch DCP folder: arbitrary boxes of each global
tensor, several per file) returns ``OpenedChunks``: every tensor as a ``layout.chunks.ChunkedTensor``,
planned from its chunk boxes (``plan.boxes``), never through a strategy.
The strategy kind (``StrategyKind``) is not a checkpoint: its ``open`` gives ``OpenedStrategy``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Protocol

from reshard.formats.strategy import StrategyFile
from reshard.layout.chunks import ChunkedTensor
from reshard.plan import SourceFile
from reshard.sources.options import ReadOptions

SHARDED = "sharded"  # the ranks of a distributed job
FULL = "full"  # one model, each tensor whole
STRATEGY = "strategy"  # layouts only, no tensor


@dataclass(frozen=True)
class Traits:
    """What a kind is, as data (``Kind.traits``).

    ``holds``: ``SHARDED``, ``FULL`` or ``STRATEGY``. ``owns_layouts``: where the kind keeps its
    layouts (``"metadata.json"``), so a strategy given with it is refused; None: the layouts come
    from a strategy. ``whole``: a full model by construction (a Hugging Face model, a unify output):
    a source strategy cannot describe it (a single checkpoint file can be rank 0 of a one-rank job,
    so it is not ``whole``). ``iterations``: a root of several saves, one picked by
    ``ReadOptions.iteration``. ``encrypted``: its files are read with ``ReadOptions.dec_key``.
    """

    holds: str
    owns_layouts: str | None = None
    whole: bool = False
    iterations: bool = False
    encrypted: bool = False


@dataclass(frozen=True)
class OpenedRanks:
    """A job's ranks: ``ranks`` (rank -> header facts) and, when the kind carries its layouts, ``strategy``.

    ``fmt`` is the byte format of the files (``formats.registry``). ``absent``: files the kind names
    that are not there, opened for some destination ranks only (a Checkpoint 2.0's ``partial``): a
    plan reading one of them is refused.
    """

    kind: str
    path: str
    fmt: str
    ranks: dict[int, SourceFile]
    strategy: StrategyFile | None = None
    absent: tuple[str, ...] = ()


@dataclass(frozen=True)
class OpenedModel:
    """A full model: its ``files`` by name, ``weight_map`` (tensor -> file name), and unify's
    ``hyper_param.safetensors`` (``hyper``).

    ``ranks`` is the model as rank 0 of a one-rank job when the operations that read ranks can take
    it so (one file, or one virtual file whose tensors name their own files); empty for a model that
    is planned by its weight map (a Hugging Face or unified folder). ``keyed``: the weight map is the
    files' own keys (no index names the tensors).
    """

    kind: str
    path: str
    fmt: str
    files: dict[str, SourceFile]
    weight_map: dict[str, str]
    ranks: dict[int, SourceFile] = field(default_factory=dict)
    hyper: SourceFile | None = None
    keyed: bool = False

    @property
    def strategy(self) -> None:
        """A full model carries no layouts (the same question ``OpenedRanks.strategy`` answers)."""
        return None


@dataclass(frozen=True)
class ByteValue:
    """A non-tensor value of a chunked source: opaque bytes at ``offset`` of data file ``file`` (never unpickled)."""

    name: str
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class OpenedChunks:
    """A source whose tensors are chunk boxes of global tensors (a PyTorch DCP folder).

    ``tensors``: name -> ``ChunkedTensor`` (its chunks held by the data files, each by its own
    tensor name there); ``files``: the data files (absolute paths) in order, with the rank that
    saved each (``saved_by``); ``values``: the non-tensor entries, carried as bytes where an output
    can hold them. ``fmt`` is the data files' byte format (``formats.registry``).
    """

    kind: str
    path: str
    fmt: str
    tensors: dict[str, ChunkedTensor]
    files: tuple[str, ...]
    saved_by: dict[str, int]
    values: dict[str, ByteValue] = field(default_factory=dict)

    @property
    def strategy(self) -> None:
        """Its layouts are its chunks, no strategy's (the question ``OpenedRanks.strategy`` answers)."""
        return None


@dataclass(frozen=True)
class OpenedStrategy:
    """A strategy file or folder: its layouts."""

    kind: str
    path: str
    strategy: StrategyFile


Opened = OpenedRanks | OpenedModel | OpenedChunks  # what opening a checkpoint gives


class Kind(Protocol):
    """One kind of checkpoint reshard reads.

    ``name`` says what it is in error messages, with its article ("a unified model", "rank
    folders"); ``looks_for`` what ``detect`` looks for ("a folder of rank_<r> folders");
    ``traits`` what it can do; ``detect(path)`` is cheap (names, a few header bytes, never a whole
    checkpoint) and is asked only of paths that exist; ``open`` returns the planning facts, with
    notes for the user (files passed over) appended to ``notes``.
    """

    name: str
    looks_for: str
    traits: Traits

    def detect(self, path: str) -> bool: ...

    def open(self, path: str, options: ReadOptions | None, notes: list[str]) -> Opened: ...


class StrategyKind(Protocol):
    """A kind of path that holds layouts only (a strategy file or folder): ``Kind``'s members, and an
    ``open`` that gives the layouts."""

    name: str
    looks_for: str
    traits: Traits

    def detect(self, path: str) -> bool: ...

    def open(self, path: str, options: ReadOptions | None, notes: list[str]) -> OpenedStrategy: ...


AnyKind = Kind | StrategyKind  # every kind the registry detects


def single_file_model(kind: str, path: str, fmt: str, facts: SourceFile) -> OpenedModel:
    """One checkpoint file as a full model: its own keys name the tensors, and it is rank 0."""
    file = os.path.basename(facts.path)
    return OpenedModel(kind, path, fmt, {file: facts}, dict.fromkeys(facts.tensors, file), ranks={0: facts}, keyed=True)


__all__ = [
    "FULL",
    "SHARDED",
    "STRATEGY",
    "AnyKind",
    "ByteValue",
    "Kind",
    "Opened",
    "OpenedChunks",
    "OpenedModel",
    "OpenedRanks",
    "OpenedStrategy",
    "StrategyKind",
    "Traits",
    "single_file_model",
]
