"""Naming rules: which tensors a run keeps, what they are called, and how fused tensors map.

Pure data and pure functions over names and shapes (layer 1: no numpy, no files' bytes), so the
planners compose them onto box copies and the executors stream them like any other copy:

* ``filters`` — ``NameFilter``: ``--include``/``--exclude`` globs, ``--weights-only``;
* ``ops`` — the tensor-surgery vocabulary (``Rename``, ``Transpose``, ``Split``, ``Join``, ``Stack``,
  ``Unstack``),
  a ``ModelMap`` (ordered ops + model config) and ``apply`` (input catalogue -> output tensors as
  pieces of input tensors);
* ``expr`` — sizes as arithmetic over the model config; ``config`` — reading that config
  (``config.json`` or a MindFormers YAML);
* ``rules`` — ``--rename`` rules files (JSON or YAML; renames, and any operation with ``op:``);
* ``options`` — ``NameOptions``, what an operation's ``names=`` takes;
* ``report`` — the name report, ``--strict`` and the "map for another model family" guard.

Every name is importable from ``reshard.naming`` itself, and loads its module on first use
(``reshard.lazy``): a run with no filter, map or preset loads none of the surgery vocabulary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reshard import lazy

if TYPE_CHECKING:  # where each name lives: a type checker imports them; at run time reshard.lazy reads this
    from reshard.naming.config import flatten, load_config
    from reshard.naming.expr import Size, evaluate
    from reshard.naming.filters import EXCLUDE, INCLUDE, NameFilter, name_filter
    from reshard.naming.ops import (
        Applied,
        Derived,
        Join,
        ModelMap,
        Op,
        Piece,
        Rename,
        Split,
        Stack,
        TensorInfo,
        Transpose,
        Unstack,
    )
    from reshard.naming.options import NameOptions
    from reshard.naming.report import FOREIGN_FAMILY_THRESHOLD, NameReport, check_family, check_strict
    from reshard.naming.rules import load_rules, parse_map, parse_rules
    from reshard.naming.stages import apply

__all__ = [
    "EXCLUDE",
    "FOREIGN_FAMILY_THRESHOLD",
    "INCLUDE",
    "Applied",
    "Derived",
    "Join",
    "ModelMap",
    "NameFilter",
    "NameOptions",
    "NameReport",
    "Op",
    "Piece",
    "Rename",
    "Size",
    "Split",
    "Stack",
    "TensorInfo",
    "Transpose",
    "Unstack",
    "apply",
    "check_family",
    "check_strict",
    "evaluate",
    "flatten",
    "load_config",
    "load_rules",
    "name_filter",
    "parse_map",
    "parse_rules",
]

__getattr__, __dir__ = lazy.exports(globals())  # each name's module, from the block above, loads on first use
