"""The command's exit codes, in one place: every module of the CLI and its help page say the same.

0 done, 1 ``verify`` found a difference, 2 bad input or usage (a ``ReshardError``, or argparse),
3 internal error (a bug, still one line), 128 + signal interrupted, 141 stdout closed by its reader.
"""

from __future__ import annotations

EXIT_USAGE = 2
EXIT_BUG = 3
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what the shell reports for `cat big | head`
EXIT_CODES = (
    "exit codes: 0 done, 1 verify found a difference, 2 bad input or usage, 3 internal error, "
    "128+signal interrupted (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP), 141 output closed by its reader "
    "(e.g. | head)"
)

__all__ = ["EXIT_BROKEN_PIPE", "EXIT_BUG", "EXIT_CODES", "EXIT_USAGE"]
