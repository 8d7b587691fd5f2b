"""The one error family of reshard.

Every failure the user can cause (bad files, bad layouts, bad arguments) is a ``ReshardError``;
the CLI prints ``str(error)`` as a single line and exits with code 2. Anything else escaping is
a bug. Messages name the file (when there is one) and what is wrong, in that order.
"""

from __future__ import annotations

import os


class ReshardError(Exception):
    """Base class: a problem with the user's input or environment, reported as one line."""

    exit_code = 2

    def __init__(self, message: str, path: str | os.PathLike[str] | None = None) -> None:
        self.path = _path_text(path)
        self.detail = message
        super().__init__(f"{self.path}: {message}" if self.path else message)


def _path_text(path: object) -> str | None:
    """The path a message names: a ``str`` or ``os.PathLike`` (bytes decoded), anything else as ``str()``,
    so that building the error for a wrong argument (``api.transform(123, ...)``) never raises instead."""
    if path is None:
        return None
    if isinstance(path, (str, bytes, os.PathLike)):
        return os.fsdecode(path)
    return str(path)


class FormatError(ReshardError):
    """A file is truncated, corrupted, foreign, or lies about its sizes."""


class UnsupportedError(ReshardError):
    """Valid input that reshard deliberately does not handle (e.g. MapTensor entries)."""


class LayoutError(ReshardError):
    """A strategy/layout that does not fit the tensors or the rank count."""


class UsageError(ReshardError):
    """Wrong arguments: missing paths, conflicting options, refused destinations."""


class MissingTensorError(UsageError, KeyError):
    """A tensor name a checkpoint does not hold (``TensorIndex.array("no.such")``).

    Also a ``KeyError``, as a mapping's missing key is, so ``except KeyError`` around a lookup keeps
    working; its text is the one line (``KeyError`` alone would print the message quoted).
    """

    def __str__(self) -> str:
        return Exception.__str__(self)


class IntegrityError(ReshardError):
    """A checksum (crc trailer, manifest hash) does not match."""


class CryptoError(ReshardError):
    """Decryption failed: wrong key, wrong mode, or a tampered record."""


__all__ = [
    "CryptoError",
    "FormatError",
    "IntegrityError",
    "LayoutError",
    "MissingTensorError",
    "ReshardError",
    "UnsupportedError",
    "UsageError",
]
