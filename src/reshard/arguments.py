"""Arguments of the Python API checked where they come in: one ``UsageError`` naming the argument.

Why: the operations hand their arguments down through several layers, and a value of the wrong type
used to surface far from the call as an internal ``AttributeError`` or ``TypeError`` (``'PosixPath'
object has no attribute 'endswith'``, ``'int' object is not iterable``). Every public function and
every option value calls these first, so a ``pathlib.Path`` is taken wherever a path is, and anything
else is refused in one line saying what the argument takes. They sit in layer 0 so that the source
discovery functions (layer 4), the option values (layers 4 to 6) and the operations word them alike;
``ops.arguments`` adds the operations' option keywords. A value is never printed whole: only numbers,
booleans and (shortened) strings are shown, never bytes or a mapping's values, which may hold a key.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable
from typing import TypeAlias

from reshard.errors import UsageError

StrPath: TypeAlias = "str | os.PathLike[str]"  # what a path argument of the Python API takes
SHOWN = 40  # characters of a refused string shown in the message


def describe(value: object, show: bool = True) -> str:
    """How a refused value is named: ``int 0``, ``str '2'``, ``bool True``; other types (and any value with
    ``show=False``: a key given as a str) by their type's name only."""
    kind = type(value).__name__
    if show and isinstance(value, (bool, numbers.Number)):
        return f"{kind} {value!r}"
    if show and isinstance(value, str):
        shown = value if len(value) <= SHOWN else value[: SHOWN - 3] + "..."
        return f"str {shown!r}"
    return f"an {kind}" if kind[:1].lower() in "aeiou" else f"a {kind}"


def path(value: object, name: str) -> str:
    """``value`` as a ``str`` path: a ``str`` as it is, an ``os.PathLike`` (``pathlib.Path``) by ``os.fspath``.

    Raises:
        UsageError: Anything else (an int, bytes, None where a path is required), naming ``name``.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, os.PathLike):
        text = os.fspath(value)
        return text if isinstance(text, str) else os.fsdecode(text)
    raise UsageError(f"{name} must be a path (a str or os.PathLike such as pathlib.Path), not {describe(value)}")


def optional_path(value: object, name: str) -> str | None:
    """``path``, or None for None."""
    return None if value is None else path(value, name)


def whole(value: object, name: str, minimum: int | None = 0) -> int:
    """``value`` as an ``int`` of at least ``minimum`` (any integral number but a bool; None: no bound,
    where the range is checked later by what uses the value, with its own words).

    Raises:
        UsageError: Not a whole number (a str, a float, a bool), or one below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        bound = f" (at least {minimum})" if minimum is not None else ""
        raise UsageError(f"{name} must be a whole number{bound}, not {describe(value)}")
    if minimum is not None and value < minimum:
        raise UsageError(f"{name} must be at least {minimum}, not {value}")
    return int(value)


def optional_whole(value: object, name: str, minimum: int | None = 0) -> int | None:
    """``whole``, or None for None."""
    return None if value is None else whole(value, name, minimum)


def ranks(value: object, name: str = "ranks") -> list[int] | None:
    """Destination ranks: an iterable of whole numbers >= 0, none named twice (None: every rank).

    Raises:
        UsageError: A single number or a string instead of an iterable, an element that is no whole
            number >= 0, or a rank given twice (it would plan the same output file twice).
    """
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise UsageError(
            f"{name} must be an iterable of rank numbers (ints >= 0) such as [0, 1], not {describe(value)}"
        )
    wanted: list[int] = []
    for rank in value:
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 0:
            raise UsageError(f"{name} must hold rank numbers (ints >= 0), not {describe(rank)}")
        wanted.append(int(rank))
    seen: set[int] = set()
    repeated: set[int] = set()
    for r in wanted:  # one pass: a list of 4 096 ranks, not 4 096 scans of it
        (repeated if r in seen else seen).add(r)
    twice = sorted(repeated)
    if twice:
        raise UsageError(f"{name} names rank {', '.join(map(str, twice))} more than once")
    return wanted


def flag(value: object, name: str) -> bool:
    """``value`` when it is a bool.

    Raises:
        UsageError: Anything else (``"yes"``, ``1``): a truthy string would turn an option on unasked.
    """
    if not isinstance(value, bool):
        raise UsageError(f"{name} must be True or False, not {describe(value)}")
    return value


def optional_text(value: object, name: str) -> str | None:
    """``value`` when it is a str or None.

    Raises:
        UsageError: Anything else.
    """
    if value is not None and not isinstance(value, str):
        raise UsageError(f"{name} must be a str or None, not {describe(value)}")
    return value


def hook(value: object, name: str) -> None:
    """Refuse a hook that is neither callable nor None (it would fail inside a worker thread).

    Raises:
        UsageError: Anything else.
    """
    if value is not None and not callable(value):
        raise UsageError(f"{name} must be a function or None, not {describe(value)}")


__all__ = [
    "StrPath",
    "describe",
    "flag",
    "hook",
    "optional_path",
    "optional_text",
    "optional_whole",
    "path",
    "ranks",
    "whole",
]
