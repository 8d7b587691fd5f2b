"""The drop-in's argument checks: MindSpore's TypeError/ValueError become one-line UsageErrors.

Every function of ``reshard.mindspore`` checks its arguments as MindSpore does, before any file is
read, and says what was wrong in one line (``reshard.errors``). The checks are shared by the save
and load functions (``saveload``) and the conversions (``dropin``), so they live here; the module
imports nothing of reshard but its errors at start (``import reshard.mindspore`` loads no numpy, and a
whole-model function starts reading its source before the planners load: docs/architecture.md,
Start-up).
"""

from __future__ import annotations

import operator
import os
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from reshard.errors import UsageError

if TYPE_CHECKING:
    from reshard.execute.options import RunOptions
    from reshard.formats.strategy import StrategyFile

FORMATS = ("ckpt", "safetensors")
DEFAULT_ENC_MODE = "AES-GCM"
DEFAULT_MAX_PROCESS_NUM = 64
# MindSpore writes only the checkpoints: no reshard-manifest.json in the drop-in's output folders.
WRITE_MANIFEST = False
# MindSpore's _check_path_safe rejects these in ckpt_prefix (docs/formats.md §3.9); we add path separators,
# which MindSpore lets escape the destination folder (a prefix "/x" writes "/x0.ckpt").
_UNSAFE_PREFIX_PARTS = ("..", "//", "~", "./.", "/", "\\", "\x00")
_BLANK = re.compile(r"^\s*$")
# --------------------------------------------------------------------------------------------
# argument checks (MindSpore's TypeError/ValueError become one-line UsageErrors)


def as_bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise UsageError(f"{what} must be True or False, got {value!r}")
    return value


def as_int(value: Any, what: str, minimum: int | None = None) -> int:
    if isinstance(value, (bool, str)):
        raise UsageError(f"{what} must be an int, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise UsageError(f"{what} must be an int, got {value!r}") from None
    if minimum is not None and number < minimum:
        raise UsageError(f"{what} must be >= {minimum}, got {number}")
    return number


def as_path(value: Any, what: str) -> str:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise UsageError(f"{what} must be a non-empty path string, got {value!r}")
    return value


def optional_path(value: Any, what: str) -> str | None:
    return None if value is None else as_path(value, what)


def as_callable(value: Any, what: str) -> Callable[[str], Any] | None:
    if value is not None and not callable(value):
        raise UsageError(f"{what} must be callable or None, got {type(value).__name__}")
    return value


def as_format(value: Any, what: str = "format") -> str:
    if value not in FORMATS:
        raise UsageError(f"{what} must be 'ckpt' or 'safetensors', got {value!r}")
    return value


def as_name_map(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise UsageError(f"name_map must be a dict, got {type(value).__name__}")
    return dict(value)


def workers(value: Any, what: str) -> RunOptions:
    """Run options for a MindSpore process count: checked, then left to reshard's own default.

    ``process_num`` and friends size MindSpore's pools of loader *processes* (default 1 or 64); they
    say nothing about how many IO threads reshard should keep busy. Taking them as a thread count
    ran MindSpore's default ``process_num=1`` on one thread, slower than the CLI on the same job; the
    drop-in runs at the CLI's speed whatever the count (``options.default_workers()``).
    """
    as_int(value, what, minimum=1)
    from reshard.execute.options import RunOptions  # here, not at start: a drop-in call reads ahead first

    return RunOptions()


def strategy_path(value: Any, what: str) -> str:
    path = as_path(value, what)
    if not os.path.isfile(path):
        raise UsageError(f"{what}: no such strategy file", path)
    if os.path.getsize(path) == 0:
        raise UsageError(f"{what}: the strategy file is empty", path)
    return path


def optional_strategy(value: Any, what: str) -> StrategyFile | None:
    from reshard.formats.strategy import read_strategy

    return None if value is None else read_strategy(strategy_path(value, what))


def check_prefix(prefix: Any) -> str:
    """MindSpore's ``_check_path_safe`` for ``ckpt_prefix``, plus path separators."""
    if not isinstance(prefix, str):
        raise UsageError(f"ckpt_prefix must be a str, got {type(prefix).__name__}")
    if _BLANK.match(prefix):
        raise UsageError("ckpt_prefix must not be empty or blank")
    for part in _UNSAFE_PREFIX_PARTS:
        if part in prefix:
            raise UsageError(f"ckpt_prefix {prefix!r} contains {part!r}, which is not safe in a file name")
    return prefix


def rank_bound(src: StrategyFile | None, dst: StrategyFile | None) -> int | None:
    """Number of valid destination ranks: all stages of ``dst``, else the devices of ``src``."""
    from reshard.layout import device_num, stage_count

    if dst is not None:
        return device_num(dst) * stage_count(dst)
    if src is not None:
        return device_num(src)
    return None


def as_rank(value: Any, bound: int | None) -> int:
    rank = as_int(value, "rank_id", minimum=0)
    if bound is not None and rank >= bound:
        raise UsageError(f"rank_id {rank} is out of range: the strategy has ranks 0..{bound - 1}")
    return rank


__all__ = [
    "DEFAULT_ENC_MODE",
    "DEFAULT_MAX_PROCESS_NUM",
    "FORMATS",
    "WRITE_MANIFEST",
    "as_bool",
    "as_callable",
    "as_format",
    "as_int",
    "as_name_map",
    "as_path",
    "as_rank",
    "check_prefix",
    "optional_path",
    "optional_strategy",
    "rank_bound",
    "strategy_path",
    "workers",
]
