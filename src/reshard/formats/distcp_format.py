"""A PyTorch DCP data file (``__<rank>_<k>.distcp``) as a ``formats.protocol.Format``.

Why a format of its own: the executors write every output through ``registry.get(file.format)``'s
``layout`` and ``finish``, so a plan that writes a DCP checkpoint is plain ``FilePlan`` s of format
``"distcp"`` whose tensors are the chunks (``reshard.plan.dcp``), and every executor, the journal,
``--resume`` and the manifest handle them as any other output. A chunk's tensor name says what the
layout needs besides its dtype and shape: ``dcp.chunk_name(fqn, offsets)``. ``layout`` lays the
chunks out as torch.save archives (``dcp.distcp_layout``, every byte position fixed before any data)
and ``finish`` patches each archive's CRC-32s once its data is in place (always: they are part of
the ZIP records, not an optional trailer). The ``.metadata`` that makes the files a checkpoint is
written by the plan as its last output, after every data file.

Reading is indexing a data file by its folder's ``.metadata`` (``dcp.open_distcp``: each chunk a
zero-copy tensor named ``chunk_name(fqn, offsets)``, whichever serialization holds it), so the
executors (local and Ray) read chunk bytes as they read any checkpoint's. Encryption: DCP has none
(refused).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from reshard.errors import UnsupportedError, UsageError
from reshard.formats import dcp
from reshard.formats.base import ByteLayout, Segment, TensorIndex, TensorSpec
from reshard.text import indefinite

NAME = "distcp"


@dataclass(frozen=True)
class DistcpByteLayout(ByteLayout):
    """A ``ByteLayout`` that also knows where each archive's CRC-32 fields are (``finish`` fills them)."""

    crc_fields: tuple[tuple[Segment, tuple[int, ...]], ...] = ()

    def sealed(self) -> tuple[Segment, ...]:
        return tuple((p, CRC_BYTES) for _, positions in self.crc_fields for p in positions)

    def seal(self, fd: int, name: str) -> tuple[Segment, ...]:
        """The CRC-32 of chunk ``name``'s archive (its one data segment), in its two ZIP records."""
        by_data = _crc_positions(self)
        written: list[Segment] = []
        for segment in self.placements[name]:
            positions = by_data.get(segment, ())
            dcp.patch_crc(fd, segment, positions)
            written += [(p, CRC_BYTES) for p in positions]
        return tuple(written)


CRC_BYTES = 4  # a ZIP CRC-32 field


def _crc_positions(layout: DistcpByteLayout) -> dict[Segment, tuple[int, ...]]:
    """Each archive's data segment -> its CRC-32 positions, made once per layout (kept on it)."""
    made: dict[Segment, tuple[int, ...]] | None = layout.__dict__.get("_crc_by_data")
    if made is None:
        made = dict(layout.crc_fields)
        object.__setattr__(layout, "_crc_by_data", made)
    return made


def parse_chunk_name(name: str) -> tuple[str, tuple[int, ...]]:
    """``fqn@o0,o1,...`` (``dcp.chunk_name``) -> (fqn, offsets); a name without ``@`` is refused."""
    fqn, at, text = name.rpartition("@")
    if not at:
        raise UsageError(f"{name!r} is not a DCP chunk name (fqn@offsets)")
    try:
        offsets = tuple(int(v) for v in text.split(",")) if text else ()
    except ValueError:
        raise UsageError(f"{name!r} is not a DCP chunk name (fqn@offsets)") from None
    return fqn, offsets


def chunk_spec(spec: TensorSpec) -> dcp.ChunkSpec:
    """The chunk a planned tensor is: its fqn and offsets from its name, its sizes from its shape."""
    fqn, offsets = parse_chunk_name(spec.name)
    if len(offsets) != len(spec.shape):
        raise UsageError(f"chunk {spec.name!r}: {len(offsets)} offsets for {indefinite(len(spec.shape))}-dim shape")
    reach = tuple(o + s for o, s in zip(offsets, spec.shape, strict=True))  # the global shape is the metadata's
    return dcp.ChunkSpec(fqn, spec.dtype, reach, offsets, tuple(spec.shape))


class DistcpFormat:
    """``.distcp`` data files in torch's ``torch_save`` serialization; no encryption."""

    name = NAME
    suffixes: tuple[str, ...] = (dcp.DATA_SUFFIX,)
    encrypts = False

    def read(
        self, path: str, *, verify_crc: bool = True, dec_key: bytes | None = None, dec_mode: str = "AES-GCM"
    ) -> TensorIndex:
        return dcp.open_distcp(path)  # chunks named dcp.chunk_name, found through the folder's .metadata

    def layout(self, specs: Sequence[TensorSpec], metadata: Mapping[str, str], chunk_bytes: int) -> ByteLayout:
        planned = dcp.distcp_layout("data.distcp", [chunk_spec(s) for s in specs])
        lay = planned.layout
        return DistcpByteLayout(lay.size, lay.framing, lay.placements, lay.order, planned.crc_fields)

    def finish(self, fd: int, layout: ByteLayout, write_crc: bool) -> None:
        """Nothing left: the executor sealed each archive (its CRC-32s) as its chunk was written."""
        if not isinstance(layout, DistcpByteLayout):
            raise UsageError("a .distcp file is finished from its own layout")

    def write_encrypted(
        self, path: str, layout: ByteLayout, fill: Callable[[int, ByteLayout], None], key: bytes, mode: str
    ) -> None:
        raise UnsupportedError("PyTorch DCP checkpoints cannot be encrypted", path)


DISTCP = DistcpFormat()

__all__ = ["DISTCP", "NAME", "DistcpByteLayout", "DistcpFormat", "chunk_spec", "parse_chunk_name"]
