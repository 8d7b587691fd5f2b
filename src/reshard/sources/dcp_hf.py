"""A DCP checkpoint saved by torch's ``HuggingFaceStorageWriter(save_distributed=True)``: its chunks as
``OpenedChunks``, read from the safetensors headers alone.

Why a reader of its own: that writer leaves no ``.metadata``. Each rank writes
``shard-<rank+1>-model-<i>-of-<n>.safetensors`` holding its chunk of each tensor under the tensor's
own name, and the chunk's place in ``__metadata__["DCP_SHARDING_INFO"]`` (``{fqn: {"saved_offsets":
[...]}}``); torch's ``consolidate_safetensors_files`` merges such a folder into full tensors. The
global shape is what the chunks reach (the largest ``offset + size`` on each axis, as torch's
consolidation takes it), and the chunks must tile it (``dcp.check_chunks``). Every operation then
plans it as any DCP folder (``ops.chunked``), reading the chunk bytes as safetensors tensors.
"""

from __future__ import annotations

import json
import os
import re

from reshard.errors import FormatError
from reshard.formats import dcp
from reshard.formats.safetensors import read_safetensors
from reshard.layout.chunks import ChunkedTensor
from reshard.sources.kind import OpenedChunks

SHARDING_KEY = "DCP_SHARDING_INFO"
_SHARD = re.compile(r"shard-(\d+)-model-\d+-of-\d+\.safetensors")


def shard_files(path: str) -> list[str]:
    """The writer's shard files in folder ``path`` (names only), in name order; empty when it has a ``.metadata``."""
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, dcp.METADATA_NAME)):
        return []
    return sorted(n for n in os.listdir(path) if _SHARD.fullmatch(n))


def _offsets(info: object, fqn: str, ndim: int, path: str) -> tuple[int, ...]:
    entry = info.get(fqn) if isinstance(info, dict) else None
    offsets = entry.get("saved_offsets") if isinstance(entry, dict) else None
    if (
        not isinstance(offsets, list)
        or len(offsets) != ndim
        or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
    ):
        raise FormatError(f"{SHARDING_KEY} gives tensor {fqn!r} no {ndim} saved offsets", path)
    return tuple(offsets)


def _read_shard(path: str) -> list[tuple[str, object, tuple[int, ...], tuple[int, ...]]]:
    """(fqn, dtype, offsets, sizes) of each chunk in one shard file."""
    with read_safetensors(path) as index:
        try:
            info = json.loads(index.metadata[SHARDING_KEY])
        except (KeyError, ValueError):
            raise FormatError(f"no readable {SHARDING_KEY} in the safetensors metadata", path) from None
        return [(n, e.dtype, _offsets(info, n, len(e.shape), path), e.shape) for n, e in index.entries.items()]


def open_hf_shards(path: str, kind: str) -> OpenedChunks:
    """Every tensor of the folder's shard files as a ``ChunkedTensor`` (no tensor data is read).

    Raises:
        FormatError: A shard without its sharding metadata, a tensor with two dtypes, chunks that do
            not tile their tensor.
    """
    folder = os.path.abspath(path)
    files = tuple(os.path.join(folder, n) for n in shard_files(path))
    gathered: dict[str, list[tuple[object, tuple[int, ...], tuple[int, ...], str]]] = {}
    for file in files:
        for fqn, dtype, offsets, sizes in _read_shard(file):
            gathered.setdefault(fqn, []).append((dtype, offsets, sizes, file))
    tensors: dict[str, ChunkedTensor] = {}
    for fqn, chunks in gathered.items():
        dtype = chunks[0][0]
        if any(c[0] is not dtype for c in chunks):
            raise FormatError(f"tensor {fqn!r} is saved with two dtypes", path)
        shape = tuple(max(o[d] + s[d] for _, o, s, _ in chunks) for d in range(len(chunks[0][1])))
        records = tuple(dcp.Chunk(fqn, o, s, os.path.basename(f), 0, 0) for _, o, s, f in chunks)
        dcp.check_chunks(dcp.TensorMeta(fqn, dtype, shape, records), path)  # type: ignore[arg-type]
        boxes = tuple(tuple((a, a + n) for a, n in zip(o, s, strict=True)) for _, o, s, _ in chunks)
        tensors[fqn] = ChunkedTensor(fqn, shape, dtype, boxes, tuple(f for *_, f in chunks))  # type: ignore[arg-type]
    saved_by = {f: int(_SHARD.fullmatch(os.path.basename(f)).group(1)) - 1 for f in files}  # type: ignore[union-attr]
    return OpenedChunks(kind, path, "safetensors", tensors, files, saved_by)


__all__ = ["SHARDING_KEY", "open_hf_shards", "shard_files"]
