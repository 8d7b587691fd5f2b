"""Lazy re-exports: a package names what its modules define, and imports a module on a name's first use.

Why: ``reshard.plan`` and ``reshard.sources`` gather every planner and every kind of source under
one name, so that callers write ``from reshard.plan import plan_convert``. Imported eagerly, that
one line loaded every planner, every source kind's reader, protobuf and the PyTorch DCP readers,
about 0.08 s of a 1 s convert that needs none of them. With ``exports`` the package's
``__getattr__`` imports only the module that holds the name asked for, and keeps the value in the
package, so later lookups are ordinary attribute reads. A type checker still sees every name: the
package imports them under ``if TYPE_CHECKING:``. ``tests/test_startup.py`` checks which modules a
run loads.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def exports(
    package: str, homes: Mapping[str, tuple[str, ...]], namespace: dict[str, Any]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose names live in its modules as ``homes`` says.

    Args:
        package: The package's dotted name (``__name__``).
        homes: Module (relative to the package, "model") -> the names it defines that the package exports.
        namespace: The package's globals (``globals()``): a name imported once is kept there.

    Returns:
        The module-level ``__getattr__`` (a name's module imported on its first use; AttributeError
        for a name the package does not export) and ``__dir__`` (the exported names too).
    """
    where = {name: module for module, names in homes.items() for name in names}

    def getattr_(name: str) -> object:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *where})

    return getattr_, dir_


__all__ = ["exports"]
