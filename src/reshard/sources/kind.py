"""What a kind of source is: a name, a cheap ``detect``, an ``open``, and what it hands back.

Every kind returns the same :class:`Opened` record, so an operation asks the registry what a path
is and reads the facts it needs (ranks, a full model's files, or a strategy) without branching on
five different return shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from reshard.formats.strategy import StrategyFile
from reshard.plan import SourceFile
from reshard.sources.options import ReadOptions


@dataclass
class Opened:
    """The planning facts of one source path.

    ``ranks``: checkpoints by rank (a full checkpoint file is rank 0 of a one-rank job).
    ``files``/``weight_map``/``hyper``: a full model's files by name, which file holds each tensor,
    and unify's ``hyper_param.safetensors`` (unified folders and Hugging Face models); ``keyed``
    when the weight map is a single file's own keys.
    ``strategy``: a strategy file or folder.
    """

    kind: str
    path: str
    fmt: str | None = None
    ranks: dict[int, SourceFile] = field(default_factory=dict)
    files: dict[str, SourceFile] = field(default_factory=dict)
    weight_map: dict[str, str] = field(default_factory=dict)
    hyper: SourceFile | None = None
    strategy: StrategyFile | None = None
    keyed: bool = False  # the weight map is the file's own keys (no index names the tensors)


class Kind(Protocol):
    """One kind of path reshard reads.

    ``name`` says what it is in error messages, with its article ("a unified model", "rank
    folders"); ``looks_for`` what ``detect`` looks for ("a folder of rank_<r> folders");
    ``detect(path)`` is cheap (names, a few header bytes, never a whole checkpoint) and is asked
    only of paths that exist; ``open`` returns the
    planning facts, with notes for the user (files passed over) appended to ``notes``.
    """

    name: str
    looks_for: str

    def detect(self, path: str) -> bool: ...

    def open(self, path: str, options: ReadOptions | None, notes: list[str]) -> Opened: ...


__all__ = ["Kind", "Opened"]
