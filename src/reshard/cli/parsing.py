"""argparse as the command wants it: a usage error is one line and exit code 2; flags and
positionals in any order where a command has optional positionals."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from reshard.cli.exits import EXIT_USAGE


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``reshard: error: ...``) and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        where = "" if self.prog == "reshard" else f"{self.prog}: "  # "reshard: error: reshard: ..." says it twice
        print(f"reshard: error: {where}{message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


class IntermixedParser(Parser):
    """A subcommand whose optional positionals may come after its flags (argparse before 3.12 takes
    ``[PARAM]`` with the first positionals and then refuses it as unrecognized)."""

    _inside = False

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self._inside:
            return super().parse_known_args(args, namespace)
        self._inside = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inside = False


__all__ = ["IntermixedParser", "Parser"]
