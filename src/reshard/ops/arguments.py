"""The operations' option keywords, each checked for its type where an operation is called.

Why: ``api.transform(..., write={"enc_key": key})``, ``destination=True`` or ``run=WriteOptions()`` used
to travel down to the manifest or the run path and fail there as an internal ``AttributeError`` or
``TypeError``. Each keyword takes exactly one type, the one the command's flag group builds (``output=``
an ``OutputSpec``, never a format string: ``convert``'s positional ``to`` is the one place a format is
a plain string), and ``check_option_types`` refuses anything else in one line naming the keyword, the type it
takes and, for a value of another group, the keyword it belongs to. The values' own fields are checked
where the option types live (their ``__post_init__``), paths and rank lists by ``reshard.arguments``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from reshard import arguments
from reshard.errors import UsageError
from reshard.execute.options import RunOptions, WriteOptions
from reshard.formats.strategy import StrategyFile
from reshard.ops.options import Destination, OutputSpec, TensorOptions, UnifyOptions
from reshard.sources import ReadOptions

# keyword -> (the type it takes, how a user writes one)
KEYWORDS: dict[str, tuple[type, str]] = {
    "output": (OutputSpec, "api.OutputSpec"),
    "destination": (Destination, "api.Destination"),
    "tensors": (TensorOptions, "api.TensorOptions"),
    "parts": (UnifyOptions, "api.UnifyOptions"),
    "read": (ReadOptions, "api.ReadOptions"),
    "write": (WriteOptions, "WriteOptions"),
    "run": (RunOptions, "RunOptions"),
}
# where the types the API does not re-export come from, said in the refusal
HOMES = {
    "WriteOptions": "reshard.execute.options",
    "RunOptions": "reshard.execute.options; RayOptions runs on Ray",
}


def check_option_types(**given: object) -> None:
    """Refuse an option keyword given a value of another type; None (the default) is always fine.

    Raises:
        UsageError: ``<keyword>= takes <Type>(...), not <what was given>``, with the fix: the keyword a
            value of another group belongs to, or the call a mapping or format string stands for.
    """
    for keyword, value in given.items():
        expected, spelled = KEYWORDS[keyword]
        if value is not None and not isinstance(value, expected):
            raise UsageError(_refusal(keyword, value, spelled))


def _refusal(keyword: str, value: object, spelled: str) -> str:
    home = HOMES.get(spelled)
    head = f"{keyword}= takes {spelled}(...){f' (from {home})' if home else ''}, not {arguments.describe(value)}"
    belongs = [k for k, (cls, _) in KEYWORDS.items() if isinstance(value, cls)]
    if belongs:
        return f"{head}: give it as {belongs[0]}="
    if isinstance(value, Mapping):  # the field names only: a value may be a key
        fields = ", ".join(f"{k}=..." for k in list(value)[:4] if isinstance(k, str))
        return f"{head}: use {keyword}={spelled}({fields})"
    if keyword == "output" and isinstance(value, str):
        return f"{head}: use output=api.OutputSpec(format={value!r})"
    if keyword == "destination" and isinstance(value, bool):
        return f"{head}: use destination=api.Destination(overwrite=True), say"
    return head


def strategy_argument(value: object, name: str) -> str | StrategyFile | None:
    """A strategy argument: a path (``str`` or ``os.PathLike``, made a ``str``), a loaded ``StrategyFile``, or None.

    Raises:
        UsageError: Anything else, naming ``name``.
    """
    if value is None or isinstance(value, (str, StrategyFile)):
        return value
    if isinstance(value, os.PathLike):
        return arguments.path(value, name)
    raise UsageError(
        f"{name} must be a strategy path (a str or os.PathLike), a StrategyFile or None, "
        f"not {arguments.describe(value)}"
    )


__all__ = ["KEYWORDS", "check_option_types", "strategy_argument"]
