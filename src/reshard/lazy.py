"""Lazy re-exports: a package names what its modules define, and imports a module on a name's first use.

Why: ``reshard.plan`` and ``reshard.sources`` gather every planner and every kind of source under
one name, so that callers write ``from reshard.plan import plan_convert``. Imported eagerly, that
one line loaded every planner, every source kind's reader, protobuf and the PyTorch DCP readers,
about 0.03 s of a 0.9 s convert that needs none of them. With ``exports`` the package's
``__getattr__`` imports only the module that holds the name asked for, and keeps the value in the
package, so later lookups are ordinary attribute reads.

One list says where each name lives: the package's ``if TYPE_CHECKING:`` block of ``from
<package>.<module> import <names>`` lines, which a type checker reads as the package's imports and
which ``homes`` reads (once, on the first name asked for) as the map of name to module. So the
lazy package is written like an eager one whose imports are indented under ``TYPE_CHECKING``.
``tests/test_startup.py`` checks which modules a run loads, ``tests/test_lazy_exports.py`` that
every exported name is its module's object.
"""

from __future__ import annotations

import ast
import functools
import importlib
from collections.abc import Callable
from typing import Any


@functools.cache
def homes(path: str, package: str) -> dict[str, tuple[str, str]]:
    """Name -> (module relative to ``package``, its name there) for each name the file at ``path``
    imports from its own modules inside ``if TYPE_CHECKING:`` (``import X as Y`` exports Y)."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    where: dict[str, tuple[str, str]] = {}
    for node in tree.body:
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            continue
        for item in node.body:
            if isinstance(item, ast.ImportFrom) and item.level == 0 and (item.module or "").startswith(package + "."):
                module = (item.module or "")[len(package) + 1 :]
                where.update({alias.asname or alias.name: (module, alias.name) for alias in item.names})
    return where


def exports(
    namespace: dict[str, Any], within: str | None = None
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the package whose globals are ``namespace`` (``globals()``); or
    for a module (``reshard.api``) that exports names of modules ``within`` a package of its choice.

    Returns:
        The module-level ``__getattr__`` (a name's module, found by ``homes``, imported on its first use;
        the value kept in the package; AttributeError for a name the package does not export) and
        ``__dir__`` (the exported names too).
    """
    package: str = namespace["__name__"]
    path: str = namespace["__file__"]
    prefix = within or package

    def getattr_(name: str) -> object:
        home = homes(path, prefix).get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, original = home
        value = getattr(importlib.import_module(f"{prefix}.{module}"), original)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *homes(path, prefix)})

    return getattr_, dir_


__all__ = ["exports", "homes"]
