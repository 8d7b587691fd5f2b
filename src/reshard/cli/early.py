"""The sources a command line names, read off the words before the parser exists.

Why: the read-ahead (``reshard.readahead``) pays only while the disk would otherwise wait, and the
parser takes 40 ms to build (its flag modules import the naming rules, the checksum pool and the
Hugging Face presets): started after ``parse_args``, the first hint reached the disk 73 ms after
the process began. Started from these words, 35 ms after it, the cold transform 8->4 of the bench's
model took 1.042 s against 1.096 s, unify 1.120 against 1.164 s, merge 1.098 against 1.117 s (median
of 6, interleaved, inputs evicted; ``cp -r`` 0.959 s): the hinted bytes are in before the planner's
own header reads start, so those no longer queue behind them (docs/benchmarks.md).

Only the unambiguous forms are read: the word right after the command when it is not a flag (the
first positional argument, always the source: ``transform SRC DST``, ``unify SRC DST``), both words
for ``verify A B``, and ``--src X`` / ``--src=X`` for ``transform``. Anything else (a flag before the
source, MindFormers' ``--src_checkpoint`` spellings) gives nothing here, and the command reads ahead
after parsing, as before. So do the runs that must not read ahead at all: ``--ranks`` or
``--rank_id`` (a share of the ranks), ``--executor`` (a cluster), ``--help``, each also abbreviated
as argparse allows. ``reshard.cli`` checks the parsed arguments afterwards: when they name other
sources than these words, it reads those ahead too (a wrong guess costs a bounded hint, never a
write).

Standard library only: this runs before any of reshard's heavy imports.
"""

from __future__ import annotations

from collections.abc import Sequence

# command -> how many leading positional arguments are sources
POSITIONAL_SOURCES = {"transform": 1, "unify": 1, "split": 1, "convert": 1, "verify": 2}
SOURCE_FLAG = {"transform": "--src"}  # the commands whose source also has a flag
STRATEGY_FLAGS = ("--src-strategy", "--dst-strategy")
# Flags that make a run read ahead nothing, or not the whole source (see reshard.cli._read_ahead), also
# as argparse's abbreviations (``--execu ray``); MindFormers' ``--rank_id`` too.
NO_READ_AHEAD = ("--ranks", "--rank_id", "--executor", "--help")


def sources(words: Sequence[str]) -> list[str]:
    """The source paths ``words`` (the command's arguments, the command first) surely name; [] if unsure."""
    if not words or words[0] not in POSITIONAL_SOURCES:
        return []
    args = list(words[1:])
    if any(_stops(word) for word in args):
        return []
    flag = SOURCE_FLAG.get(words[0])
    if flag is not None:
        given = [
            _flag_value(args, i, flag) for i, word in enumerate(args) if word == flag or word.startswith(flag + "=")
        ]
        if given:
            return [given[0]] if len(given) == 1 and given[0] else []
    count = POSITIONAL_SOURCES[words[0]]
    leading = args[:count]
    if len(leading) < count or any(word.startswith("-") or not word for word in leading):
        return []
    return leading


def strategies(words: Sequence[str]) -> list[str]:
    """The strategy paths ``words`` name with ``--src-strategy`` / ``--dst-strategy`` (or ``=``) for a
    command that reads its sources whole: the planner reads each in one go, so they are read ahead
    first (``readahead.start``'s ``small``)."""
    if not words or words[0] not in POSITIONAL_SOURCES or any(_stops(word) for word in words[1:]):
        return []
    args = list(words[1:])
    return [
        value
        for flag in STRATEGY_FLAGS
        for i, word in enumerate(args)
        if (word == flag or word.startswith(flag + "=")) and (value := _flag_value(args, i, flag))
    ]


def _stops(word: str) -> bool:
    """Whether ``word`` is (an abbreviation of) a flag that stops reading ahead."""
    name = word.split("=", 1)[0]
    if name == "-h":
        return True
    return len(name) > 2 and name.startswith("--") and any(flag.startswith(name) for flag in NO_READ_AHEAD)


def _flag_value(args: list[str], i: int, flag: str) -> str:
    if args[i] != flag:
        return args[i][len(flag) + 1 :]
    return args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("-") else ""


__all__ = ["NO_READ_AHEAD", "POSITIONAL_SOURCES", "SOURCE_FLAG", "STRATEGY_FLAGS", "sources", "strategies"]
