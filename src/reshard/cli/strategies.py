"""The layout flags (strategies, ranks) and how a command finds a source's strategy when given none.

One spelling per side: a command that moves a checkpoint from a source to a destination names
``--src-strategy`` and ``--dst-strategy`` (``transform``, ``plan``, ``unify``, ``split``,
``rank-list``, ``auto-transform``); ``--strategy`` is left to the commands that look at one
checkpoint (``inspect``, ``show``), where it cannot mean the other side; ``verify``'s two sides are
``--a-strategy`` and ``--b-strategy``, after its A and B. ``unify --strategy`` and
``split --strategy`` (one meant the source, the other the destination) still work, with a note.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from reshard.cli.flags import flag, say_notes, section
from reshard.cli.values import no_path, rank_list


def add_strategy(
    parser: argparse.ArgumentParser,
    *names: str,
    help: str,
    legacy: Sequence[str] = (),
    renamed: Sequence[str] = (),
    **kwargs: Any,
) -> argparse.Action:
    """A strategy flag in the help's layout section."""
    return flag(section(parser, "layout"), *names, legacy=legacy, renamed=renamed, help=help, **kwargs)


def add_ranks(parser: argparse.ArgumentParser, help: str = "only these destination ranks, e.g. 0,1,4-7") -> None:
    flag(section(parser, "layout"), "--ranks", type=rank_list, help=help)


def source_strategy(checkpoint: str | None, given: str | None, flag_name: str, quiet: bool) -> str | None:
    """The source strategy given, else for several rank folders (or, without a checkpoint, always) the
    folder where MindFormers keeps it (``reshard.sources.conventions``), said in a note."""
    from reshard.sources.conventions import find_source_strategy, needs_strategy

    if given is not None:
        return no_path(given)
    if checkpoint is not None and not needs_strategy(checkpoint):
        return None
    notes: list[str] = []
    found = find_source_strategy(checkpoint, flag_name, notes)
    say_notes(notes, quiet)
    return found


def is_checkpoint2(path: str) -> bool:
    from reshard.sources import CHECKPOINT2, kind_of

    return kind_of(path) is CHECKPOINT2


def carries_layouts(path: str) -> bool:
    """A source whose kind keeps its own layouts (a Checkpoint 2.0's metadata.json, a DCP .metadata)."""
    from reshard.sources import kind_of

    kind = kind_of(path)
    return kind is not None and kind.traits.owns_layouts is not None


__all__ = ["add_ranks", "add_strategy", "carries_layouts", "is_checkpoint2", "source_strategy"]
