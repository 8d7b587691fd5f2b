"""The ``distcp`` byte format: one data file of a PyTorch DCP folder (``__<rank>_<k>.distcp``).

Reading a ``.distcp`` file is indexing it by its folder's ``.metadata`` (``formats.dcp.open_distcp``):
each chunk is a zero-copy tensor named ``chunk_name(fqn, offsets)``, whichever serialization
(torch.save ZIP members or safetensors blobs) holds it. Registering it as a format is what lets the
executors (local and Ray: they open every source through ``formats.registry``) read chunk bytes as
they read any checkpoint's. Writing ``.distcp`` files belongs to ``--output-format dcp`` (a DCP
folder with its ``.metadata``), not to a single file of this format, so the writer steps refuse.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from reshard.errors import UnsupportedError
from reshard.formats.base import ByteLayout, TensorIndex, TensorSpec
from reshard.formats.protocol import Fill

_NO_WRITE = "writing .distcp files: use --output-format dcp"


class DistcpFormat:
    """The data files of a DCP checkpoint, read through their folder's ``.metadata``."""

    name: str = "distcp"
    suffixes: tuple[str, ...] = (".distcp",)
    encrypts: bool = False

    def read(
        self, path: str, *, verify_crc: bool = True, dec_key: bytes | None = None, dec_mode: str = "AES-GCM"
    ) -> TensorIndex:
        from reshard.formats.dcp import open_distcp

        return open_distcp(path)

    def layout(self, specs: Sequence[TensorSpec], metadata: Mapping[str, str], chunk_bytes: int) -> ByteLayout:
        raise UnsupportedError(_NO_WRITE)

    def finish(self, fd: int, layout: ByteLayout, write_crc: bool) -> None:
        raise UnsupportedError(_NO_WRITE)

    def write_encrypted(self, path: str, layout: ByteLayout, fill: Fill, key: bytes, mode: str) -> None:
        raise UnsupportedError(_NO_WRITE)


DISTCP = DistcpFormat()

__all__ = ["DISTCP", "DistcpFormat"]
