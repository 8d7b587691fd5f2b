"""Replicas hold the same bytes: a cheap sample of every redundant copy compared before any output is in place.

The layout says which ranks of a pipeline stage hold the same slice of a parameter (data-parallel
copies, and every rank of a dimension the tensor map leaves unsplit); a transform reads one of
them (MindSpore's rule, docs/formats.md §3.5) and never looks at the others. Headers cannot tell a
copy that differs (a rank file of another job with the same shapes, a stale file from an earlier
save), so ``reshard.plan.agree``'s header checks pass and the output silently takes whichever
copy the rule picks. This module compares the copies' bytes, sampled:

* a slice of at most ``3 * SAMPLE_BYTES`` (12 KiB) bytes is compared whole;
* a larger one by its first, middle and last ``SAMPLE_BYTES`` (4 KiB) block.

So each replica tensor costs at most 12 KiB read and hashed, whatever its size; a copy that
differs anywhere in those blocks (another job's weights differ everywhere) is caught, one that
differs only elsewhere is not (docs/checks.md, "What no check can catch"). Optimizer-sharded
states are not replicas (each rank holds another box), and entries the strategy does not lay
out (``global_step``, learning-rate scalars, which may differ per rank) are not compared.

Sampling reads tensor data, so it lives here, with the readers, and not in ``reshard.plan``:
each source file is opened once more (its header; an encrypted one is decrypted again), a few
files at a time on threads, with its crc trailer not checked again (planning did); the blocks of
a plain file are read with ``pread`` (a memory map's fault reads ahead far more). Only a digest
of the first holder's blocks is kept per slice, so memory stays small. Re-reading the headers is
most of the cost: on an 8-rank 1.9 GB job (dp4 x mp2, 1 401 copies) the check takes 0.34 s and
reads 17 MiB, where planning takes 0.1-0.2 s and the transform to a full model about 6 s.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from reshard import layout, readahead
from reshard.errors import IntegrityError, ReshardError
from reshard.formats import uncached
from reshard.formats.base import TensorIndex, segment_pieces
from reshard.layout import Box, LayoutTable, ParamLayout
from reshard.plan import SourceFile
from reshard.plan.agree import describe, stage_tables
from reshard.sources.files import INDEX_THREADS, open_checkpoint
from reshard.sources.options import ReadOptions

SAMPLE_BYTES = 4096  # one sampled block; a slice of at most three blocks is compared whole

Block = tuple[int, int]  # (start, stop) byte offsets inside a tensor's data


@dataclass(frozen=True)
class Sampled:
    """What ``check_replicas`` compared: replica tensors (copies beyond the first) and bytes read."""

    tensors: int = 0
    bytes_read: int = 0


@dataclass(frozen=True)
class _Slice:
    """One slice of a parameter in one stage: every rank holding it must hold the same bytes."""

    stage: int
    name: str
    slice_id: int  # ranks the layout gives one box of the global tensor share it


@dataclass(frozen=True)
class _First:
    """The first holder of a slice: its rank and the digest of each sampled block."""

    rank: int
    nbytes: int
    digests: tuple[tuple[Block, bytes], ...]


def sample_blocks(nbytes: int) -> tuple[Block, ...]:
    """The byte ranges of a tensor's data that are compared (see the module docstring)."""
    if nbytes <= 3 * SAMPLE_BYTES:
        return ((0, nbytes),)
    middle = (nbytes - SAMPLE_BYTES) // 2
    return ((0, SAMPLE_BYTES), (middle, middle + SAMPLE_BYTES), (nbytes - SAMPLE_BYTES, nbytes))


def sampled_ranges(segments: tuple[tuple[int, int], ...], nbytes: int) -> list[tuple[int, int]]:
    """The file byte ranges ``(offset, length)`` the check reads of a tensor stored in ``segments``."""
    return [piece for block in sample_blocks(nbytes) for piece in _pieces(segments, block)]


def check_replicas(
    files: Mapping[int, SourceFile],
    strategy: LayoutTable,
    options: ReadOptions | None = None,
    *,
    options_for: Callable[[str], ReadOptions | None] | None = None,
    absent: Collection[str] = (),
) -> Sampled:
    """Refuse rank files whose copies of one slice hold different bytes (an ``IntegrityError``).

    ``files`` are the rank files a plan reads from ``strategy`` (narrowed by filters: only kept
    tensors are compared); ranks beyond the strategy's stages, tensors the strategy does not lay
    out and slices held by one rank are passed over. ``options`` opens every file
    (``options_for``, when given, says per file). Copies in ``absent`` files (a Checkpoint 2.0 opened
    for some destination ranks: files not here) are passed over.
    """
    copies = sorted(
        ((rank, key) for key, ranks in _holders(files, strategy).items() if len(ranks) > 1 for rank in ranks),
        key=lambda item: item[0],
    )
    by_path: dict[str, list[tuple[_Slice, int]]] = {}  # each file once, in rank order
    gone = set(absent)
    for rank, key in copies:
        path = files[rank].path_of(key.name)
        if path not in gone:
            by_path.setdefault(path, []).append((key, rank))
    first: dict[_Slice, _First] = {}
    tensors = read = 0
    layouts = stage_tables(strategy)
    paths = list(by_path)

    import xxhash  # the manifest's checksum library (hashlib would load OpenSSL for these few KiB)

    new_digest = xxhash.xxh3_128  # imported here, on the calling thread, not first on the pool's

    def sampled(path: str) -> list[tuple[_Slice, _First]]:
        given = options_for(path) if options_for is not None else options
        return _file_samples(path, by_path[path], given, new_digest)

    # the start-up read-ahead's bulk waits: these small reads go first (a cold bf16 merge's check: 72 -> 9-16 ms)
    with readahead.paused(), ThreadPoolExecutor(INDEX_THREADS, thread_name_prefix="reshard-replicas") as pool:
        for start in range(0, len(paths), 2 * INDEX_THREADS):  # a window of files at once: memory stays small
            window = paths[start : start + 2 * INDEX_THREADS]
            for path, samples in zip(window, pool.map(sampled, window), strict=True):
                for key, mine in samples:
                    read += sum(stop - begin for (begin, stop), _ in mine.digests)
                    seen = first.setdefault(key, mine)
                    if seen is not mine:
                        tensors += 1
                        _compare(key, seen, mine, layouts[key.stage][key.name], path)
    return Sampled(tensors, read)


def _holders(files: Mapping[int, SourceFile], strategy: LayoutTable) -> dict[_Slice, list[int]]:
    """Each slice of each stage's parameters -> the ranks (in order) holding it.

    One derivation of the ranks' boxes per stage and parameter (``_Groups``), then one dict lookup
    per tensor: 1 000 parameters x 1 024 ranks take about a second.
    """
    per_stage = layout.device_num(strategy)
    tables = stage_tables(strategy)
    seen: dict[int, dict[str, _Groups | None]] = {}
    for rank in sorted(files):
        stage = rank // per_stage
        table = tables.get(stage)
        if table is None:
            continue
        local = rank % per_stage
        groups = seen.setdefault(stage, {})
        for name, t in files[rank].tensors.items():
            g = groups.get(name, _UNSEEN)
            if g is _UNSEEN:
                p = table.get(name)
                g = groups[name] = _Groups.of(p, t.shape) if p is not None else None
            if g is not None and local < len(g.ids) and g.shape == t.shape:
                g.ranks[g.ids[local]].append(rank)
    return {
        _Slice(stage, name, gid): ranks
        for stage, groups in seen.items()
        for name, g in groups.items()
        if g is not None
        for gid, ranks in enumerate(g.ranks)
    }


@dataclass
class _Groups:
    """One parameter of one stage: each local rank's slice (ranks with one box share an id)."""

    shape: tuple[int, ...]
    ids: tuple[int, ...]  # local rank -> slice id
    ranks: list[list[int]]  # slice id -> the ranks holding it

    @staticmethod
    def of(p: ParamLayout, shape: tuple[int, ...]) -> _Groups | None:
        """None: the layout does not fit the slice (``reshard.plan.agree`` words that)."""
        try:
            boxes = layout.rank_boxes(p, layout.full_shape(p, shape))
        except ReshardError:
            return None
        first: dict[Box, int] = {}
        ids = tuple(first.setdefault(box, len(first)) for box in boxes)
        return _Groups(shape, ids, [[] for _ in first])


_UNSEEN = _Groups((), (), [])


def _file_samples(
    path: str, items: list[tuple[_Slice, int]], options: ReadOptions | None, new_digest: Callable[[], Any]
) -> list[tuple[_Slice, _First]]:
    """The samples of one file's copies (opened without checking its crc trailer: planning did)."""
    with open_checkpoint(path, replace(options or ReadOptions(), verify_crc=False)) as index:
        fd = os.open(path, os.O_RDONLY) if index.file_backed else None
        try:
            if fd is not None and uncached.left_none():  # hinted blocks would stay cached
                uncached.read_nothing_ahead(fd)
            elif fd is not None:
                _hint(fd, index, items)
            return [(key, _sample(index, fd, key.name, rank, new_digest)) for key, rank in items]
        finally:
            if fd is not None:
                os.close(fd)


def _hint(fd: int, index: TensorIndex, items: list[tuple[_Slice, int]]) -> None:
    """Ask for every block of the file at once (``WILLNEED``), then read them one by one: on a cold
    cache the reads then wait on one round of the disk, not one round each (the bench's unify of 8
    rank files, cold: the check took 0.088-0.096 s, now 0.023-0.031 s, before the copy could start).
    Only where small reads go through the page cache anyway (``uncached.left_none`` false): hinted
    blocks stay cached, islands in the bytes the copy reads next; uncached, the blocks are read one
    by one through a descriptor that reads nothing ahead (the same unify's check, cold: 17-29 ms, hinted
    14-32 ms)."""
    for key, _ in items:
        entry = index.entries.get(key.name)
        for offset, length in sampled_ranges(entry.segments, entry.nbytes) if entry is not None else ():
            try:
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
            except (OSError, AttributeError):  # a hint: the reads below read all the same
                return


def _sample(index: TensorIndex, fd: int | None, name: str, rank: int, new_digest: Callable[[], Any]) -> _First:
    """Rank ``rank``'s copy of tensor ``name``: its size and the digest (``new_digest``) of each sampled block.

    A file-backed index is read with ``pread`` (a memory map's fault would read ahead far more
    than the 4 KiB wanted); decrypted bytes from their buffer.
    """
    entry = index.entries.get(name)
    if entry is None:  # the header read while planning had it: the file changed since
        raise IntegrityError(f"{name}: no longer in the file (it changed while reshard read it)", index.path)
    view = memoryview(index.buffer)
    out = []
    for block in sample_blocks(entry.nbytes):
        digest = new_digest()
        for offset, length in _pieces(entry.segments, block):
            digest.update(uncached.read(fd, length, offset) if fd is not None else view[offset : offset + length])
        out.append((block, digest.digest()))
    return _First(rank, entry.nbytes, tuple(out))


def _pieces(segments: tuple[tuple[int, int], ...], block: Block) -> Iterator[tuple[int, int]]:
    return segment_pieces(segments, block[0], block[1] - block[0])


def _compare(key: _Slice, seen: _First, mine: _First, p: ParamLayout, path: str) -> None:
    copies = f"the strategy's layout ({describe(p)}) makes them copies of one slice (stage {key.stage})"
    if mine.nbytes != seen.nbytes:  # another dtype (casting planned both as one)
        raise IntegrityError(
            f"{key.name}: rank {mine.rank} holds {mine.nbytes} bytes, rank {seen.rank} {seen.nbytes}, but {copies}",
            path,
        )
    for (block, ours), (_, theirs) in zip(mine.digests, seen.digests, strict=True):
        if ours != theirs:
            raise IntegrityError(
                f"{key.name}: ranks {seen.rank} and {mine.rank} hold different bytes at offset {block[0]}..{block[1]} "
                f"of their slice, but {copies}: is one of the rank files stale or another job's?",
                path,
            )


__all__ = [
    "SAMPLE_BYTES",
    "Sampled",
    "check_replicas",
    "sample_blocks",
    "sampled_ranges",
]
