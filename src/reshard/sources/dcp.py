"""A PyTorch Distributed Checkpoint (DCP) folder as a source kind: ``.metadata`` + ``__<r>_<k>.distcp``.

``detect`` looks at names only (a ``.metadata`` file beside at least one ``.distcp`` file); ``open``
reads ``.metadata`` alone (``reshard.formats.dcp.read_dcp_metadata``: the allowlisting unpickler and
every check of the chunks against their tensors and the files), never the data files, so planning
stays a matter of headers however many ranks saved. The facts are made from each tensor's
``ChunkTable`` (no ``Chunk`` record per chunk), chunks of one shape sharing one ``SourceTensor``.

The planning facts: every chunk is a tensor of its own, named ``chunk_name(fqn, offsets)`` (a box of
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
from dataclasses import dataclass

from reshard.formats import dcp
from reshard.plan import SourceFile, SourceTensor
from reshard.sources.kind import SHARDED, OpenedModel, Traits
from reshard.sources.options import ReadOptions

_DATA_FILE = re.compile(r"__(\d+)_(\d+)\.distcp")


def is_dcp_folder(path: str) -> bool:
    """A folder holding ``.metadata`` and at least one ``.distcp`` file (names only)."""
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, dcp.METADATA_NAME)):
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


class DcpFolder:
    """A PyTorch DCP checkpoint folder (torchtitan, FSDP2, veRL, Megatron-core's torch_dist data)."""

    name = "a PyTorch DCP checkpoint"
    looks_for = "a PyTorch DCP folder (.metadata and __<rank>_<k>.distcp files)"
    traits = Traits(holds=SHARDED, owns_layouts=".metadata")

    def detect(self, path: str) -> bool:
        return is_dcp_folder(path)

    def open(self, path: str, options: ReadOptions | None, notes: list[str]) -> OpenedModel:
        source = open_dcp(path)
        if source.metadata.byte_items:
            notes.append(
                f"{len(source.metadata.byte_items)} non-tensor values (opaque torch.save bytes) are not tensors"
            )
        weight_map = {name: rel for rel, facts in source.files.items() for name in facts.tensors}
        return OpenedModel(self.name, path, dcp.FORMAT, source.files, weight_map, ranks=source.ranks)


DCP = DcpFolder()

__all__ = ["DCP", "DcpFolder", "DcpSource", "is_dcp_folder", "open_dcp", "saving_rank"]
