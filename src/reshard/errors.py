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
        self.path = os.fspath(path) if path is not None else None
        self.detail = message
        super().__init__(f"{self.path}: {message}" if self.path else message)


class FormatError(ReshardError):
    """A file is truncated, corrupted, foreign, or lies about its sizes."""


class UnsupportedError(ReshardError):
    """Valid input that reshard deliberately does not handle (e.g. MapTensor entries)."""


class LayoutError(ReshardError):
    """A strategy/layout that does not fit the tensors or the rank count."""


class UsageError(ReshardError):
    """Wrong arguments: missing paths, conflicting options, refused destinations."""


class IntegrityError(ReshardError):
    """A checksum (crc trailer, manifest hash) does not match."""


class CryptoError(ReshardError):
    """Decryption failed: wrong key, wrong mode, or a tampered record."""


__all__ = [
    "CryptoError",
    "FormatError",
    "IntegrityError",
    "LayoutError",
    "ReshardError",
    "UnsupportedError",
    "UsageError",
]
