"""C library functions through ``ctypes``, typed once: the few calls Python's ``os`` does not offer.

``pagecache`` maps a source it never touches and asks ``mincore`` which of its pages are cached;
``gather`` writes a column split's row runs with one ``pwritev`` of a vector it builds at C speed,
and maps their pages in with ``madvise``. Both import this module on first use, so ``ctypes``
loads only for a run that needs them.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any


@functools.cache
def _library() -> Any:
    """The process's C library (None where there is none to ask, as on Windows)."""
    try:
        return ctypes.CDLL(None, use_errno=True)
    except (OSError, TypeError):
        return None


def function(name: str, argtypes: list[Any], restype: Any) -> Any:
    """libc's ``name`` with its argument and result types set (errno kept for ``ctypes.get_errno``),
    or None where the C library has no such function."""
    library = _library()
    found = getattr(library, name, None) if library is not None else None
    if found is None:
        return None
    found.argtypes = argtypes
    found.restype = restype
    return found


__all__ = ["function"]
