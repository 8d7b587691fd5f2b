"""The text of a training run's tracker file, the one reader for both kinds of run folder.

MindFormers 2.x Checkpoint 2.0 and Megatron-LM both name their latest save in a one-line
``latest_checkpointed_iteration.txt``; each format decides what the line may hold (a number; a
number or ``release``), and both read the line here, so an unreadable tracker is one error.
"""

from __future__ import annotations

from reshard.errors import FormatError


def read_tracker_text(path: str) -> str:
    """The tracker's stripped text.

    Raises:
        FormatError: The file cannot be read or is not UTF-8.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise FormatError(f"cannot read the tracker: {exc}", path) from None


__all__ = ["read_tracker_text"]
