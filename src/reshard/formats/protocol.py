"""What a byte format is: one object with a name, its file suffixes, a reader and a streaming writer.

Every place that reads or writes checkpoint bytes asks ``formats.registry`` for the format of a
file and then calls these methods, so a new byte format is one module with one such object and one
``registry.register`` call; nothing branches on a format's name. The reader hands out a
``TensorIndex`` (zero-copy segments over a memory map); the writer is two steps so that an executor
never holds an output whole: ``layout`` computes every framing byte and where each tensor's bytes
go from the specs alone, then the executor fills the tensor bytes in place and the format's
``finish`` step (a trailer) runs last.

The Hugging Face layout is not a format here: it is safetensors files plus an index JSON (a file
layout, like MindSpore's ``rank_<r>`` folders), so it lives in ``hf_index`` and the planners; its
bytes are safetensors bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # numpy-free at run time: the registry (and the command's --help) import this module
    from reshard.formats.base import ByteLayout, TensorIndex, TensorSpec

Fill = Callable[[int, "ByteLayout"], None]  # puts tensor bytes into the open output (fd) at the layout's places


class Format(Protocol):
    """One byte format of checkpoint files.

    ``name`` is what plans, options and the CLI call it (``"ckpt"``); ``suffixes`` the file name
    endings that are this format, the first one naming outputs (``(".ckpt",)``). ``encrypts``: its
    outputs can be encrypted (``write_encrypted``); the others refuse a key before any byte is
    written.
    """

    name: str
    suffixes: tuple[str, ...]
    encrypts: bool

    def read(
        self, path: str, *, verify_crc: bool = True, dec_key: bytes | None = None, dec_mode: str = "AES-GCM"
    ) -> TensorIndex:
        """The file's tensor index. ``verify_crc``: check the integrity data the file carries, if any;
        ``dec_key``/``dec_mode``: decrypt it (formats that cannot be encrypted never are)."""
        ...

    def layout(self, specs: Sequence[TensorSpec], metadata: Mapping[str, str], chunk_bytes: int) -> ByteLayout:
        """Every byte position of an output holding ``specs`` (in this order where the format keeps
        order), its ``metadata`` where the format stores any, large tensors in ``chunk_bytes`` pieces
        where the format chunks them."""
        ...

    def finish(self, fd: int, layout: ByteLayout, write_crc: bool) -> None:
        """After the tensor bytes are in place: a trailer (``write_crc``: MindSpore's crc), or nothing."""
        ...

    def write_encrypted(self, path: str, layout: ByteLayout, fill: Fill, key: bytes, mode: str) -> None:
        """Write ``layout`` to ``path`` encrypted with ``key``, atomically (only when ``encrypts``)."""
        ...


__all__ = ["Fill", "Format"]
