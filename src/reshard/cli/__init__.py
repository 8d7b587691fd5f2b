"""The ``reshard`` command: process control and exit codes (the commands are ``reshard.cli.commands``).

Every user-facing failure is a ``ReshardError``: it becomes one line on stderr and exit code 2.
Anything else is a bug; it is still reported as one line, with exit code 3 (set ``RESHARD_DEBUG=1``
for the traceback) so scripts never parse a Python stack. Exit codes: 0 done, 1 ``verify`` found
a difference, 2 bad input or usage, 3 internal error, 128+signal interrupted (130 Ctrl-C, 143
SIGTERM, 129 SIGHUP; ``--resume`` continues); output cut short by its
reader (``reshard inspect --json | head``) ends quietly with 141, as ``cat`` killed by SIGPIPE does.
``transform`` accepts MindFormers' ``transform_ckpt.py`` flags verbatim (``--src_ckpt_strategy`` ...)
as well as hyphenated forms.

Keys never appear on the command line (shell history, ``ps``): ``--dec-key-file``/``--enc-key-file``
name a file, ``--dec-key-env``/``--enc-key-env`` an environment variable holding hex (``--key-format``
says how to read a key file whose text is also a valid raw key).

The package: ``parser`` builds the command line from one module per command (``commands/``); the
flag groups (``flags``, ``tensor_flags``, ``strategies``) add their flags and build the options
objects; ``calls`` is the one place that calls ``reshard.api``; ``report`` prints a run's result,
``progress`` its progress; ``help`` is what the command teaches about itself. This module imports
only the standard library, ``reshard.interrupts``, ``reshard.readahead`` and ``cli.early`` at start:
the sources the words name are read ahead first (``early``), then the parser and everything under
it are imported by ``main``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

# numpy's OpenBLAS starts a spinning thread per core at import; reshard never multiplies matrices,
# and on a 2-core box those threads took 6.6% of a transform's CPU (perf). The command sets this
# before numpy loads (a value the user set wins); library users keep their own setting.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from reshard import interrupts, readahead
from reshard.cli import early
from reshard.cli.exits import EXIT_BROKEN_PIPE, EXIT_BUG, EXIT_CODES, EXIT_USAGE
from reshard.errors import ReshardError
from reshard.interrupts import Signalled

TYPE_CHECKING = False  # not ``typing.TYPE_CHECKING``: this module loads before the read-ahead starts
if TYPE_CHECKING:
    import argparse


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command in this process (``reshard.entry.main`` is the one that starts a process)."""
    try:
        with interrupts.handling():
            return _main(argv)
    except BrokenPipeError:
        return _quiet_broken_pipe()


def _main(argv: Sequence[str] | None) -> int:
    words = _join_dash_values(sys.argv[1:] if argv is None else argv)
    if words in (["--version"], ["-V"]):  # answered before the parser and its commands are imported
        from reshard import __version__

        print(f"reshard {__version__}")
        return 0
    named = early.sources(words)  # the disk reads the sources while the parser is built (cli.early)
    readahead.start(named, small=early.strategies(words) if named else ())
    from reshard.cli import help as cli_help
    from reshard.cli.flags import print_renamed
    from reshard.cli.parser import build_parser

    parser = build_parser()
    cli_help.check_argv(parser, words)  # no command: the overview; a misspelling: "did you mean"
    interrupts.reached("parse")
    args = parser.parse_args(words)
    if (reads := _read_ahead(args)) != named:  # the words were not what they seemed: read what is read
        readahead.start(reads, small=_strategies(args))  # the disk reads the sources while the run imports and plans
    try:
        args.started = time.monotonic()
        print_renamed(args, args.quiet)
        status = _run(args)
        sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
    except BrokenPipeError:
        raise
    except ReshardError as exc:
        print(f"reshard: error: {_error_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        return interrupted(exc)
    except Exception as exc:  # a bug: still one line, unless debugging
        if os.environ.get("RESHARD_DEBUG"):
            raise
        from reshard.text import one_line

        print(
            f"reshard: internal error: {type(exc).__name__}: {one_line(str(exc))} "
            "(RESHARD_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return EXIT_BUG
    return status if isinstance(status, int) else 0


def _read_ahead(args: argparse.Namespace) -> list[str]:
    """The sources a command reads whole (its ``reads`` names), read ahead unless the run reads only some
    destination ranks' share (``--ranks``) or runs on a cluster (``--executor ray``)."""
    if getattr(args, "ranks", None) or getattr(args, "executor", None) == "ray":
        return []
    return [value for name in getattr(args, "reads", ()) if isinstance(value := getattr(args, name, None), str)]


def _strategies(args: argparse.Namespace) -> list[object]:
    """The strategies the parsed command names (read whole by its planner)."""
    return [value for name in ("src_strategy", "dst_strategy", "strategy") if (value := getattr(args, name, None))]


def _run(args: object) -> object:
    from reshard.cli import flags, progress

    progress.reset()
    flags.assumed_keys().clear()
    if vars(args).get("own_console"):  # inspect and demo print through rich consoles of their own
        progress.rich_raises_broken_pipe()
    try:
        return args.func(args)  # type: ignore[attr-defined]
    finally:
        progress.stop_all()


def interrupted(exc: KeyboardInterrupt, finished: bool = False) -> int:
    """The one line an interrupted command prints, and its exit code (128 + signal, as Unix tools).

    ``finished``: the signal came after the command had done its work (``reshard.entry``).
    """
    from reshard.manifest import PROGRESS_ATTRIBUTE

    signum = interrupts.signal_of(exc)
    progress = getattr(exc, PROGRESS_ATTRIBUTE, None)
    if progress is None:
        progress = interrupts.completed_run()  # a signal after the run committed, while reporting or exiting
    if (said := interrupts.explained(exc)) is not None and not finished:
        detail = said  # the operation knows better than its last run's count (auto-transform)
    elif progress is None:
        detail = "the command had finished" if finished else "no output file was written"
    elif progress.complete:
        detail = (
            f"{progress.completed} of {progress.total} files completed; "
            "the output is complete (--resume has nothing to do)"
        )
    elif progress.resumable:
        detail = (
            f"{progress.completed} of {progress.total} files completed; run the same command with --resume to continue"
        )
    else:
        detail = (
            f"{progress.completed} of {progress.total} files completed; without a manifest (--no-manifest) "
            "--resume cannot tell them apart: run the command again"
        )
    print(interrupts.line(signum, detail), file=sys.stderr)
    return 128 + signum


def _quiet_broken_pipe() -> int:
    """The reader of stdout went away (``| head``): say nothing, exit like a tool killed by SIGPIPE.

    stdout now points at /dev/null, so the interpreter's last flush cannot fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return EXIT_BROKEN_PIPE


_VALUE_FLAGS = ("--file-suffix", "--file_suffix")  # values such as -1_4 start with a dash


def _join_dash_values(argv: Sequence[str]) -> list[str]:
    """``--file-suffix -1_4`` -> ``--file-suffix=-1_4``: argparse would take ``-1_4`` for a flag."""
    out: list[str] = []
    items = list(argv)
    i = 0
    while i < len(items):
        if items[i] in _VALUE_FLAGS and i + 1 < len(items) and items[i + 1].startswith("-"):
            out.append(f"{items[i]}={items[i + 1]}")
            i += 2
            continue
        out.append(items[i])
        i += 1
    return out


def _error_line(exc: ReshardError) -> str:
    from reshard.cli.flags import assumed_keys
    from reshard.errors import CryptoError
    from reshard.text import one_line

    text = one_line(str(exc))
    if isinstance(exc, CryptoError) and assumed_keys():
        text += f" ({'; '.join(assumed_keys())})"
    return text


def build_parser() -> argparse.ArgumentParser:
    """The ``reshard`` parser (``reshard.cli.parser.build_parser``)."""
    from reshard.cli.parser import build_parser as build

    return build()


__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_BUG",
    "EXIT_CODES",
    "EXIT_USAGE",
    "Signalled",
    "build_parser",
    "interrupted",
    "main",
]
