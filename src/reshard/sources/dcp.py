"""A PyTorch Distributed Checkpoint (DCP) folder as a source kind: ``.metadata`` + ``__<r>_<k>.distcp``.

``detect`` looks at names only (a ``.metadata`` file beside at least one ``.distcp`` file); ``open``
reads ``.metadata`` alone (``reshard.formats.dcp.read_dcp_metadata``: the allowlisting unpickler and
every check of the chunks against their tensors and the files), never the data files, so planning
stays a matter of headers however many ranks saved. The facts are made from each tensor's
``ChunkTable`` (no ``Chunk`` record per chunk), chunks of one shape sharing one ``SourceTensor``.

``DCP.open`` gives ``OpenedChunks``: every tensor as a ``ChunkedTensor`` (``chunked_tensors``), the
data files, the non-tensor values as byte ranges. ``open_dcp`` gives the older per-chunk facts:
every chunk is a tensor of its own, named ``chunk_name(fqn, offsets)`` (a box of
the global tensor ``fqn``; ``DcpSource.metadata`` says which box), with its dtype and the chunk's
shape. ``files`` holds one ``SourceFile`` per data file, ``ranks`` one virtual ``SourceFile`` per
saving rank ``r`` (its chunks, ``homes`` naming each one's ``__<r>_<k>.distcp``), ``weight_map`` the
data file of every chunk. Non-tensor values (opaque ``torch.save`` bytes) are not tensors to plan:
they are listed in ``DcpSource.metadata.byte_items`` for an operation to carry byte for byte. Reading
the chunks' bytes needs the DCP reader (``reshard.formats.dcp.index_distcp``), not ``open_checkpoint``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

from reshard.formats import dcp
from reshard.layout import Box
from reshard.layout.chunks import ChunkedTensor
from reshard.plan import SourceFile, SourceTensor
from reshard.sources.dcp_hf import open_hf_shards, shard_files
from reshard.sources.kind import SHARDED, ByteValue, OpenedChunks, Traits
from reshard.sources.options import ReadOptions

DISTCP = "distcp"  # the data files' byte format (formats.registry)
_DATA_FILE = re.compile(r"__(\d+)_(\d+)\.distcp")


def is_dcp_folder(path: str) -> bool:
    """A folder holding ``.metadata`` and at least one ``.distcp`` file (names only)."""
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, dcp.METADATA_NAME)):
        return False
    return any(name.endswith(dcp.DATA_SUFFIX) for name in os.listdir(path))


def is_unfinished_dcp(path: str) -> bool:
    """A folder holding ``.distcp`` data files but no ``.metadata`` (names only): a save torch never
    finished (it writes ``.metadata`` last) or a partial copy of one; no kind reads it."""
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, dcp.METADATA_NAME)):
        return False
    return any(name.endswith(dcp.DATA_SUFFIX) for name in os.listdir(path))


@dataclass(frozen=True)
class DcpSource:
    """What ``open_dcp`` read: the checked metadata, and the planning facts of its chunks."""

    metadata: dcp.DcpMetadata
    files: dict[str, SourceFile]  # data file (relative path) -> its chunks
    ranks: dict[int, SourceFile]  # saving rank -> its chunks (a virtual file over its data files)


def saving_rank(relative_path: str, default: int = 0) -> int:
    """The rank ``r`` of a data file named ``__<r>_<k>.distcp`` (``default`` for other names)."""
    match = _DATA_FILE.fullmatch(os.path.basename(relative_path))
    return int(match.group(1)) if match else default


def open_dcp(path: str) -> DcpSource:
    """Read a DCP folder's ``.metadata`` and lay out its chunks as planning facts (no data file is read).

    Built from each tensor's ``ChunkTable`` with no ``Chunk`` record made; chunks of one shape share
    one ``SourceTensor`` (a checkpoint of many ranks has millions of chunks but few chunk shapes)."""
    with dcp.collector_paused():
        return _open_dcp(path)


def _open_dcp(path: str) -> DcpSource:
    meta = dcp.read_dcp_metadata(path)
    folder = os.path.abspath(path)
    files = {rel: SourceFile(os.path.join(folder, rel), saving_rank(rel), {}) for rel in meta.files}
    homes: dict[int, dict[str, str]] = {}
    rank_tensors: dict[int, dict[str, SourceTensor]] = {}
    for tensor in meta.tensors.values():
        table = tensor.table
        shared: dict[tuple[int, ...], SourceTensor] = {}
        itemsize = tensor.dtype.itemsize
        targets = []
        for rel in table.files:
            home = files[rel]
            targets.append(
                (home.tensors, rank_tensors.setdefault(home.rank, {}), homes.setdefault(home.rank, {}), home.path)
            )
        prefix = f"{tensor.fqn}@"
        for offsets, sizes, file_id in zip(
            table.offsets.tolist(), map(tuple, table.sizes.tolist()), table.file_ids.tolist(), strict=True
        ):
            facts = shared.get(sizes)
            if facts is None:
                facts = shared[sizes] = SourceTensor(tensor.dtype, sizes, math.prod(sizes) * itemsize)
            name = prefix + ",".join(map(str, offsets))  # dcp.chunk_name(tensor.fqn, offsets)
            in_file, in_rank, home_of, home_path = targets[file_id]
            in_file[name] = facts
            in_rank[name] = facts
            home_of[name] = home_path
    ranks = {
        rank: SourceFile(next(iter(homes[rank].values())), rank, rank_tensors[rank], homes=homes[rank])
        for rank in sorted(rank_tensors)
    }
    return DcpSource(meta, files, ranks)


class ChunkNames(Sequence[str]):
    """The index names of a tensor's chunks (``dcp.chunk_name(fqn, offsets)``), made when asked for: a
    checkpoint of 5 000 tensors on 4 096 ranks has 20 million, and a plan names only those it reads."""

    def __init__(self, fqn: str, boxes: Sequence[Box]) -> None:
        self.fqn = fqn
        self.boxes = boxes

    def __len__(self) -> int:
        return len(self.boxes)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[str, ...]: ...
    def __getitem__(self, index: int | slice) -> str | tuple[str, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(len(self))[index])
        return dcp.chunk_name(self.fqn, [a for a, _ in self.boxes[index]])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))


def chunked_tensors(meta: dcp.DcpMetadata) -> dict[str, ChunkedTensor]:
    """Every tensor of a checked ``.metadata`` as a ``ChunkedTensor``: chunk ``k`` is box ``k`` of the
    global tensor, held by tensor ``chunk_name(fqn, offsets)`` of its data file (an absolute path).

    Tensors with one chunking share one tuple of boxes and one tuple of files (a checkpoint of many
    ranks has thousands of tensors, few chunkings), so ``plan.boxes`` indexes each chunking once."""
    import numpy as np  # the metadata's columns are numpy already

    folder = os.path.abspath(meta.folder)
    boxes_of: dict[tuple[bytes, bytes], tuple[Box, ...]] = {}
    files_of: dict[tuple[tuple[str, ...], bytes], tuple[str, ...]] = {}
    out: dict[str, ChunkedTensor] = {}
    with dcp.collector_paused():
        for tensor in meta.tensors.values():
            table = tensor.table
            key = (table.offsets.tobytes() + bytes([table.offsets.shape[1]]), table.sizes.tobytes())
            boxes = boxes_of.get(key)
            if boxes is None:  # each chunk's ((start, stop) per dim): made from the columns at once
                nested = np.stack((table.offsets, table.offsets + table.sizes), axis=2).tolist()
                boxes = boxes_of[key] = tuple([tuple(map(tuple, box)) for box in nested])
            file_key = (table.files, table.file_ids.tobytes())
            files = files_of.get(file_key)
            if files is None:
                paths = [os.path.join(folder, rel) for rel in table.files]
                files = files_of[file_key] = tuple(paths[i] for i in table.file_ids.tolist())
            names = ChunkNames(tensor.fqn, boxes)
            out[tensor.fqn] = ChunkedTensor(tensor.fqn, tensor.shape, tensor.dtype, boxes, files, names)
    return out


class DcpFolder:
    """A PyTorch DCP checkpoint folder (torchtitan, FSDP2, veRL, Megatron-core's torch_dist data).

    It carries its layouts (each chunk's box in ``.metadata``), so a strategy given with it is refused;
    ``open`` hands back ``OpenedChunks``, planned from the chunk boxes (``plan.boxes``)."""

    name = "a PyTorch DCP checkpoint"
    looks_for = (
        "a PyTorch DCP folder (.metadata and __<rank>_<k>.distcp files, or the shard-<r>-model-<i>-of-<n>"
        ".safetensors files of torch's HuggingFaceStorageWriter)"
    )
    traits = Traits(holds=SHARDED, owns_layouts=".metadata")

    def detect(self, path: str) -> bool:
        return is_dcp_folder(path) or bool(shard_files(path))

    def open(self, path: str, options: ReadOptions | None, notes: list[str]) -> OpenedChunks:
        if shard_files(path):  # HuggingFaceStorageWriter's shards: no .metadata, their headers say it
            return open_hf_shards(path, self.name)
        meta = dcp.read_dcp_metadata(path)
        folder = os.path.abspath(path)
        values = {
            fqn: ByteValue(fqn, os.path.join(folder, item.file), item.offset, item.length)
            for fqn, item in meta.byte_items.items()
        }
        files = tuple(os.path.join(folder, rel) for rel in meta.files)
        saved_by = {p: saving_rank(rel) for p, rel in zip(files, meta.files, strict=True)}
        return OpenedChunks(self.name, path, DISTCP, chunked_tensors(meta), files, saved_by, values)


DCP = DcpFolder()

__all__ = [
    "DCP",
    "ChunkNames",
    "DcpFolder",
    "DcpSource",
    "chunked_tensors",
    "is_dcp_folder",
    "is_unfinished_dcp",
    "open_dcp",
    "saving_rank",
]
