"""The values flags take, read by argparse: rank lists, part groups, sizes, whole numbers.

Each function turns one command-line word into a value or raises ``argparse.ArgumentTypeError``,
which the parser prints as one line with exit code 2 before anything is read. Why refuse rather
than guess: a rank list with a typo writes the wrong files, which is worse than a one-line error.
"""

from __future__ import annotations

import argparse

from reshard.errors import UsageError
from reshard.text import parse_size


def memory_size(text: str) -> int:
    """``--max-memory``: a size as ``text.parse_size`` reads it (``512M``, ``2GiB``, ``2GB``)."""
    try:
        return parse_size(text, "the memory bound")
    except UsageError as exc:
        raise argparse.ArgumentTypeError(exc.detail) from None


def whole_number(text: str, minimum: int, what: str, too_small: str) -> int:
    """``text`` as an int of at least ``minimum``; else argparse's one-line error."""
    try:
        value = int(text)
    except ValueError:
        article = "an" if what[:1] in ("a", "e", "i", "o", "u") else "a"
        raise argparse.ArgumentTypeError(f"not {article} {what}: {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{text!r}: {too_small}")
    return value


def rank_number(text: str) -> int:
    return whole_number(text, 0, "rank", "ranks count from 0")


def positive_int(text: str) -> int:
    return whole_number(text, 1, "whole number", "must be at least 1")


def output_iteration(text: str) -> int:
    """``--dst-iteration``: a Checkpoint 2.0 output's iteration."""
    return whole_number(text, 0, "iteration number", "iterations count from 0")


def source_iteration(text: str) -> int:
    """``--src-iteration``: which iteration of a Checkpoint 2.0 source is read."""
    return whole_number(text, 0, "iteration number", "an iteration is 0 or more")


def rank_list(text: str) -> list[int]:
    """``0,1,4-7``: ranks in the order given. A reversed range, an empty list or a rank named twice is
    refused: each is a typo more often than not, and a run that writes the wrong set of files is worse
    than a one-line error (a duplicate would also plan the same output file twice)."""
    ranks: list[int] = []
    hint = "(try 0,1,4-7)"
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                first, last = (int(x) for x in part.split("-"))
                if first > last:
                    raise argparse.ArgumentTypeError(f"{text!r}: range {part} runs backwards (write {last}-{first})")
                ranks.extend(range(first, last + 1))
            elif part:
                ranks.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a rank list: {text!r} {hint}") from None
    if not ranks:
        raise argparse.ArgumentTypeError(f"{text!r} names no rank {hint}")
    twice = sorted({r for r in ranks if ranks.count(r) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{text!r} names rank {', '.join(map(str, twice))} more than once")
    return ranks


def part_group(text: str) -> tuple[int, int]:
    """``i/n``: part group i of n, 1 <= i <= n."""
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a part group: {text!r} (write i/n, e.g. 1/2)") from None
    if not 1 <= index <= count:
        raise argparse.ArgumentTypeError(f"{text!r}: i/n needs 1 <= i <= n")
    return index, count


def no_path(value: str | None) -> str | None:
    """MindFormers' ``None`` (and an empty value) for "no strategy": full weights."""
    return None if value in (None, "", "None", "none") else value


__all__ = [
    "memory_size",
    "no_path",
    "output_iteration",
    "part_group",
    "positive_int",
    "rank_list",
    "rank_number",
    "source_iteration",
    "whole_number",
]
