"""Where MindFormers keeps a distributed checkpoint's strategy files, for commands given none.

A MindFormers training job writes its checkpoints to ``<output>/checkpoint/rank_<r>/`` and the
strategy files of its ranks to ``<output>/strategy/``, where ``<output>`` is ``./output`` under the
working directory (or the ``LOCAL_DEFAULT_PATH`` variable). Its loader, asked to reshard rank folders
without ``src_strategy_path_or_dir``, takes the ``strategy`` folder beside the checkpoint folder
(docs/formats.md §11.1). reshard looks in the same places, in this order, and says which it used:

1. ``strategy/`` beside the checkpoint folder (the loader's rule);
2. ``<output>/strategy``: ``$LOCAL_DEFAULT_PATH/strategy``, else ``./output/strategy`` (where a job run
   from the working directory saved them).

A place counts only when it is a folder holding strategy files (``*.ckpt`` / ``*.json``).
"""

from __future__ import annotations

import os

from reshard.errors import ReshardError, UsageError
from reshard.formats import rank_dirs
from reshard.formats.strategy import find_strategy_files

STRATEGY_FOLDER = "strategy"
OUTPUT_VARIABLE = "LOCAL_DEFAULT_PATH"  # MindFormers' output root, default ./output
DEFAULT_OUTPUT = "./output"


def strategy_places(checkpoint: str | None) -> list[tuple[str, str]]:
    """``[(folder, why)]``: the places MindFormers keeps strategy files, in the order they are tried."""
    places = []
    if checkpoint is not None:
        parent = os.path.dirname(os.path.abspath(checkpoint.rstrip(os.sep) or os.sep))
        places.append((os.path.join(parent, STRATEGY_FOLDER), "the strategy folder beside the checkpoint folder"))
    output = os.path.expanduser(os.environ.get(OUTPUT_VARIABLE, DEFAULT_OUTPUT))
    why = (
        f"MindFormers' output folder (${OUTPUT_VARIABLE})"
        if OUTPUT_VARIABLE in os.environ
        else "MindFormers' output folder"
    )
    places.append((os.path.abspath(os.path.join(output, STRATEGY_FOLDER)), why))
    unique: list[tuple[str, str]] = []
    for folder, reason in places:
        if all(os.path.realpath(folder) != os.path.realpath(seen) for seen, _ in unique):
            unique.append((folder, reason))
    return unique


def _holds_strategies(folder: str) -> bool:
    if not os.path.isdir(folder):
        return False
    try:
        return bool(find_strategy_files(folder))
    except ReshardError:
        return False


def needs_strategy(checkpoint: str) -> bool:
    """Whether ``checkpoint`` is a folder of several ``rank_<r>`` folders (a sliced model)."""
    return os.path.isdir(checkpoint) and len(rank_dirs.rank_dirs(checkpoint)) > 1


def find_source_strategy(checkpoint: str | None, flag: str, notes: list[str]) -> str:
    """The strategy folder MindFormers would use for ``checkpoint``; a note says which and why.

    Raises:
        UsageError: None of the places holds strategy files (the message names them and ``flag``).
    """
    places = strategy_places(checkpoint)
    for folder, why in places:
        if _holds_strategies(folder):
            notes.append(f"no {flag} given: using {folder} ({why}, where MindFormers keeps strategy files)")
            return folder
    looked = " and ".join(folder for folder, _ in places)
    what = "several rank folders but no source strategy" if checkpoint is not None else "no source strategy"
    raise UsageError(f"{what}: give {flag} (no strategy files in {looked})", checkpoint)


__all__ = ["OUTPUT_VARIABLE", "STRATEGY_FOLDER", "find_source_strategy", "needs_strategy", "strategy_places"]
