"""The byte formats reshard reads and writes, and the one answer to "which format is this file?".

The list of formats is kept here and nowhere else: the readers (``sources.files``), the executors
(``execute.local``, and through it Ray's), the rank-folder rules (``rank_dirs``) and the command's
choices (``names()``) all ask this module. A name or a file this module does not know is a
``UsageError``, never a silent default.

This module is numpy-free (the command's parser and ``--help`` import it): a built-in format's
object is imported on first use, while its name and suffixes are known at once.

Adding a format: write its module under ``reshard/formats/`` with one object implementing
``formats.protocol.Format`` and call ``register(that_object)`` (a built-in gets one line in
``_BUILTIN`` instead). A ``register`` call holds in the process that makes it: Ray's workers know a
format that is built in, or registered by a module they import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from reshard.errors import UsageError
from reshard.formats.protocol import Format


def _ckpt() -> Format:
    from reshard.formats.ckpt import CKPT

    return CKPT


def _safetensors() -> Format:
    from reshard.formats.safetensors import SAFETENSORS

    return SAFETENSORS


def _distcp() -> Format:
    from reshard.formats.distcp_format import DISTCP

    return DISTCP


@dataclass
class _Entry:
    name: str
    suffixes: tuple[str, ...]
    load: Callable[[], Format]
    loaded: Format | None = None


# Built-in formats, in the order their names are listed (the order of "not a .ckpt or .safetensors file").
_BUILTIN = (
    _Entry("ckpt", (".ckpt",), _ckpt),
    _Entry("safetensors", (".safetensors",), _safetensors),
)
_ENTRIES: dict[str, _Entry] = {e.name: e for e in _BUILTIN}
# Formats only written so far: ``get`` knows them (the executors write them), but no reader, rank-folder rule or
# choice list sees them (a PyTorch DCP folder's ``.distcp`` data files, issue 21: its reading side joins later).
_WRITTEN_ONLY: dict[str, _Entry] = {"distcp": _Entry("distcp", (".distcp",), _distcp)}


def register(fmt: Format) -> None:
    """Add a byte format (its name and suffixes must be new): every reader, executor and rank-folder
    rule then knows it. A format registered twice under one name replaces the first (tests re-register)."""
    taken = {s: e.name for e in _ENTRIES.values() if e.name != fmt.name for s in e.suffixes}
    clash = next((s for s in fmt.suffixes if s in taken), None)
    if clash is not None:
        raise UsageError(f"format {fmt.name!r}: the suffix {clash} is already {taken[clash]}'s")
    if not fmt.suffixes or not all(s.startswith(".") for s in fmt.suffixes):
        raise UsageError(f"format {fmt.name!r}: suffixes must start with a dot, got {fmt.suffixes!r}")
    _ENTRIES[fmt.name] = _Entry(fmt.name, tuple(fmt.suffixes), lambda: fmt, fmt)


def unregister(name: str) -> None:
    """Remove a format added by ``register`` (the built-ins stay)."""
    if name in {e.name for e in _BUILTIN}:
        raise UsageError(f"{name} is a built-in format")
    _ENTRIES.pop(name, None)


def names() -> tuple[str, ...]:
    """Every format's name, built-ins first (the CLI's ``--output-format`` choices)."""
    return tuple(_ENTRIES)


def suffixes() -> tuple[str, ...]:
    """Every suffix of every format (``(".ckpt", ".safetensors")``)."""
    return tuple(s for e in _ENTRIES.values() for s in e.suffixes)


def suffix(name: str) -> str:
    """The suffix outputs of format ``name`` get (``".ckpt"``)."""
    return _entry(name).suffixes[0]


def listed(joiner: str = "or") -> str:
    """The suffixes as a person reads them: ``.ckpt or .safetensors``."""
    found = suffixes()
    return found[0] if len(found) == 1 else f"{', '.join(found[:-1])} {joiner} {found[-1]}"


def is_known(name: str) -> bool:
    return name in _ENTRIES


def check(name: str, what: str = "format") -> str:
    """``name`` when it is a known format; a ``UsageError`` naming the choices otherwise."""
    if name not in _ENTRIES:
        raise UsageError(f"unknown {what} {name!r} (choose {' or '.join(names())})")
    return name


def get(name: str) -> Format:
    """The format object called ``name`` (imported on first use)."""
    entry = _entry(name)
    if entry.loaded is None:
        entry.loaded = entry.load()
    return entry.loaded


def format_of(path: str) -> str | None:
    """The name of the format whose suffix ``path`` ends in (None: no format's)."""
    return next((e.name for e in _ENTRIES.values() if path.endswith(e.suffixes)), None)


def detect(path: str) -> str:
    """The format of ``path`` by its name; a ``UsageError`` for a file no format claims."""
    found = format_of(path)
    if found is None:
        raise UsageError(f"not a {listed()} file", path)
    return found


def _entry(name: str) -> _Entry:
    entry = _ENTRIES.get(name) or _WRITTEN_ONLY.get(name)
    if entry is None:
        check(name)
    assert entry is not None
    return entry


__all__ = [
    "check",
    "detect",
    "format_of",
    "get",
    "is_known",
    "listed",
    "names",
    "register",
    "suffix",
    "suffixes",
    "unregister",
]
