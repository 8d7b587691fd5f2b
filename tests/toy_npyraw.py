"""A toy byte format, "npyraw", added from outside reshard through ``formats.registry.register``.

File 1 of 3 of the toy-format test (``tests/test_toy_format.py``): the format module. An ``.npyraw``
file is an 8-byte little-endian header length, a JSON header (``{"tensors": [{"name", "dtype",
"shape", "offset", "nbytes"}, ...], "metadata": {...}}``, space-padded to 8 bytes) and then every
tensor's raw little-endian C-order bytes at its offset after the header. It holds no strings and is
never encrypted: it exists to show that a format is one object of the ``Format`` protocol.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from reshard import dtypes
from reshard.errors import FormatError, UnsupportedError
from reshard.formats.base import (
    ByteLayout,
    TensorEntry,
    TensorIndex,
    TensorSpec,
    fill_from_values,
    map_file,
    write_file,
)

NAME = "npyraw"
_LEN = 8
_ALIGN = 8


class NpyRaw:
    """The npyraw format: ``formats.protocol.Format``."""

    name = NAME
    suffixes: tuple[str, ...] = (".npyraw",)
    encrypts = False

    def read(
        self, path: str, *, verify_crc: bool = True, dec_key: bytes | None = None, dec_mode: str = "AES-GCM"
    ) -> TensorIndex:
        buffer, closer, size = map_file(path)
        try:
            if size < _LEN:
                raise FormatError("shorter than its header length", path)
            (length,) = struct.unpack("<Q", bytes(buffer[:_LEN]))
            if _LEN + length > size:
                raise FormatError(f"header of {length} bytes runs past the end of the file", path)
            header = json.loads(bytes(buffer[_LEN : _LEN + length]))
            start = _LEN + length
            entries = {}
            for t in header["tensors"]:
                begin, nbytes = start + int(t["offset"]), int(t["nbytes"])
                if begin + nbytes > size:
                    raise FormatError(f"tensor {t['name']!r} runs past the end of the file", path)
                dtype = dtypes.from_ms_name(t["dtype"], path)
                entries[t["name"]] = TensorEntry(t["name"], dtype, tuple(t["shape"]), ((begin, nbytes),))
        except BaseException:
            closer()
            raise
        return TensorIndex(path, NAME, buffer, entries, dict(header.get("metadata", {})), closer, file_backed=True)

    def layout(self, specs: Sequence[TensorSpec], metadata: Mapping[str, str], chunk_bytes: int) -> ByteLayout:
        rows: list[dict[str, Any]] = []
        offset = 0
        for spec in specs:
            if spec.dtype is dtypes.STR:
                raise UnsupportedError(f"npyraw holds no strings ({spec.name!r} is one)")
            rows.append({"name": spec.name, "dtype": spec.dtype.ms_name, "shape": list(spec.shape)})
            rows[-1].update(offset=offset, nbytes=spec.nbytes)
            offset += spec.nbytes
        text = json.dumps({"tensors": rows, "metadata": dict(metadata)}).encode()
        text += b" " * (-len(text) % _ALIGN)
        start = _LEN + len(text)
        placements = {r["name"]: ((start + r["offset"], r["nbytes"]),) for r in rows}
        framing = ((0, struct.pack("<Q", len(text)) + text),)
        return ByteLayout(start + offset, framing, placements, tuple(placements))

    def finish(self, fd: int, layout: ByteLayout, write_crc: bool) -> None:
        return None  # no trailer

    def write_encrypted(
        self, path: str, layout: ByteLayout, fill: Callable[[int, ByteLayout], None], key: bytes, mode: str
    ) -> None:
        raise UnsupportedError("npyraw files are never encrypted", path)


NPYRAW = NpyRaw()


def save(path: str | os.PathLike[str], values: Mapping[str, np.ndarray]) -> None:
    """Write ``values`` as one npyraw file (through the format's own layout)."""
    specs = [TensorSpec.of(name, value) for name, value in values.items()]
    write_file(path, NPYRAW.layout(specs, {}, 0), fill_from_values(dict(values)))
