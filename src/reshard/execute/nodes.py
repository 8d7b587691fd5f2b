"""Which node holds which source file, which node writes each output, and the bytes that cross nodes.

Without a shared disk every node holds some source files on its own disk. Before any byte moves,
this module turns a plan and that placement into a ``Schedule`` (plain data, no Ray):

* **Writers.** Each output file is written by the node holding most of its input bytes (ties: the
  node named first in sorted order), unless the placement names a writer for its rank.
* **What crosses.** For every writer node and every source file it does not hold, the source's
  *file byte ranges* its outputs read: each copy's box becomes the byte runs it covers in the
  source tensor (``box_runs``), mapped to file offsets through the tensor's segments, and the runs
  of all the node's outputs are merged. A byte two outputs of one node need is listed once, so each
  needed source byte crosses to each node that needs it exactly once: the schedule's
  ``cross_node_bytes`` is the minimum for the placement and the writer choice. Bytes a writer's
  own disk holds never travel.
* **Readers.** Each such fetch is served by a node holding the file (the least loaded one when
  several hold copies).

Header facts (tensor shapes and segments) come from the node that holds each file
(``SourceFacts``), so this needs no file itself. The placement format is documented in
docs/formats.md §15.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from reshard.dtypes import DType
from reshard.errors import UnsupportedError, UsageError
from reshard.formats.base import segment_pieces
from reshard.plan import Copy, FilePlan, Plan
from reshard.plan.model import read_bytes
from reshard.sources import ReadOptions, open_checkpoint

Run = tuple[int, int]  # (offset, length) in bytes


@dataclass(frozen=True)
class TensorFacts:
    """One source tensor as a reader on its node sees it: shape, item size, file segments."""

    shape: tuple[int, ...]
    dtype: DType
    itemsize: int  # 1 for strings (their bytes are copied whole)
    segments: tuple[Run, ...]


@dataclass(frozen=True)
class SourceFacts:
    """What a node reports of one source file it holds: its size and its tensors' facts."""

    size: int
    tensors: Mapping[str, TensorFacts]

    def identity(self) -> tuple[object, ...]:
        """What two nodes' copies of a file must share to be the same file."""
        return (self.size, tuple(sorted((n, t.shape, t.dtype.ms_name, t.segments) for n, t in self.tensors.items())))


@dataclass(frozen=True)
class Placement:
    """Which files each node holds (path prefixes), and writers named per destination rank."""

    holders: Mapping[str, tuple[str, ...]]  # node name -> files or folders it holds
    writers: Mapping[int, str] = field(default_factory=dict)  # destination rank -> node name

    def nodes_holding(self, path: str) -> list[str]:
        """The nodes whose listed files or folders contain ``path``, sorted."""
        full = os.path.abspath(path)
        return sorted(
            node
            for node, roots in self.holders.items()
            if any(full == r or full.startswith(r.rstrip(os.sep) + os.sep) for r in roots)
        )


def source_facts(path: str, read: ReadOptions | None = None) -> SourceFacts:
    """Size and tensor facts of one source file (its header only; no crc check: planning did it).

    Raises:
        UnsupportedError: An encrypted ``.ckpt``: its records decrypt whole, so it has no byte
            ranges to fetch (the driver-shipped ``--no-shared-disk`` mode reads it).
    """
    opened = replace(read, verify_crc=False) if read is not None else ReadOptions(verify_crc=False)
    with open_checkpoint(path, opened) as index:
        if not index.file_backed:
            raise UnsupportedError(
                "an encrypted source cannot be read in byte ranges on its node; "
                "run with --no-shared-disk and no --placement (whole files through the driver)",
                path,
            )
        tensors = {
            name: TensorFacts(e.shape, e.dtype, 1 if e.is_string else e.dtype.itemsize, e.segments)
            for name, e in index.entries.items()
        }
        return SourceFacts(os.path.getsize(path), tensors)


def load_placement(path: str) -> Placement:
    """Read a placement file: ``{"nodes": {NODE: [PATH, ...]}, "writers": {RANK: NODE}}``.

    ``NODE`` is a Ray node id, a node's IP address, or a custom resource exactly one node has.
    ``PATH`` is a source file or a folder holding source files, as the plan names them.

    Raises:
        UsageError: The file cannot be read, is not JSON, or does not have that shape (one line).
    """
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise UsageError(f"cannot read the placement file: {exc.strerror or exc}", path) from None
    except ValueError as exc:
        raise UsageError(f"the placement file is not JSON ({exc.msg}, line {exc.lineno})", path) from None  # type: ignore[attr-defined]
    return placement_from_json(data, path)


def placement_from_json(data: object, where: str | None = None) -> Placement:
    """A ``Placement`` from the parsed JSON of a placement file (see ``load_placement``)."""
    shape = 'expected {"nodes": {NODE: [PATH, ...]}, "writers": {RANK: NODE}}'
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), dict) or set(data) - {"nodes", "writers"}:
        raise UsageError(f"not a placement: {shape}", where)
    holders: dict[str, tuple[str, ...]] = {}
    for node, paths in data["nodes"].items():
        if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
            raise UsageError(f"placement: node {node!r} must list paths (strings)", where)
        holders[str(node)] = tuple(os.path.abspath(p) for p in paths)
    writers: dict[int, str] = {}
    for rank, node in (data.get("writers") or {}).items():
        if not str(rank).isdigit() or not isinstance(node, str):
            raise UsageError(f"placement: writers maps a destination rank to a node, not {rank!r}: {node!r}", where)
        writers[int(rank)] = node
    return Placement(holders, writers)


def box_runs(shape: tuple[int, ...], itemsize: int, start: tuple[int, ...], lengths: tuple[int, ...]) -> list[Run]:
    """The tensor byte runs (C order) a box covers: one run per row of its non-full leading dims."""
    if not shape:
        return [(0, itemsize)]
    if any(n == 0 for n in lengths):
        return []
    k = len(shape) - 1
    while k > 0 and lengths[k] == shape[k]:
        k -= 1  # dims after k are full: each run spans lengths[k] of dim k and all after
    strides = [itemsize * math.prod(shape[i + 1 :]) for i in range(len(shape))]
    run = lengths[k] * strides[k]
    offsets = [start[k] * strides[k] + sum(s * st for s, st in zip(start[:k], strides[:k], strict=True))]
    for i in range(k):  # every combination of the outer indices
        offsets = [o + j * strides[i] for o in offsets for j in range(lengths[i])]
    return [(o, run) for o in sorted(offsets)]


def file_runs(tensor: TensorFacts, copy: Copy) -> list[Run]:
    """The file byte ranges one copy reads from its source tensor."""
    if copy.whole_source or not tensor.shape:
        return [r for r in tensor.segments if r[1]]
    runs: list[Run] = []
    shape = copy.src_view or tensor.shape
    for offset, length in box_runs(shape, tensor.itemsize, copy.src_start, copy.src_lengths):
        runs.extend(segment_pieces(tensor.segments, offset, length))
    return runs


def merge_runs(runs: Sequence[Run]) -> list[Run]:
    """Sorted runs with overlapping or touching ones joined (each byte listed once)."""
    merged: list[list[int]] = []
    for offset, length in sorted(runs):
        if merged and offset <= merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], offset + length - merged[-1][0])
        else:
            merged.append([offset, length])
    return [(o, n) for o, n in merged]


@dataclass(frozen=True)
class Fetch:
    """Byte ranges of one source file that one writer node needs from the node ``reader``."""

    source: int  # index into plan.sources
    reader: str  # the node that reads them (holds the file)
    runs: tuple[Run, ...]

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.runs)


@dataclass(frozen=True)
class Schedule:
    """Where every output is written and which source bytes travel to it (plain data)."""

    writers: tuple[str, ...]  # per plan.files index: the node writing it
    fetches: Mapping[str, tuple[Fetch, ...]]  # writer node -> what it fetches from other nodes
    local_sources: Mapping[str, tuple[int, ...]]  # writer node -> sources it reads from its own disk

    @property
    def cross_node_bytes(self) -> int:
        """Source bytes that cross nodes: the minimum for this placement and these writers."""
        return sum(f.nbytes for fs in self.fetches.values() for f in fs)

    def nodes_used(self) -> set[str]:
        """The nodes that get a task (writers, and readers of bytes another node needs)."""
        return set(self.writers) | {f.reader for fs in self.fetches.values() for f in fs}

    def summary(self, names: Mapping[str, str] | None = None) -> str:
        """One line: bytes across nodes, and the outputs each node writes."""
        from reshard.text import format_size

        label = (names or {}).get
        counts: dict[str, int] = {}
        for w in self.writers:
            counts[w] = counts.get(w, 0) + 1
        per_node = ", ".join(f"{label(n) or n}: {c}" for n, c in sorted(counts.items()))
        return (
            f"bytes across nodes: {self.cross_node_bytes} ({format_size(self.cross_node_bytes)}, "
            f"the minimum for this placement); outputs per node: {per_node}"
        )


def schedule(
    plan: Plan,
    holders: Mapping[int, Sequence[str]],
    facts: Mapping[int, SourceFacts],
    writers: Mapping[int, str] | None = None,
) -> Schedule:
    """Choose each output's writer node and what crosses to it.

    Args:
        plan: The plan to run.
        holders: Per index of ``plan.sources`` that a copy reads: the nodes holding that file.
        facts: Per such index: the file's size and tensors (from a node holding it).
        writers: Destination rank -> the node that must write it (the rest: most input bytes).

    Returns:
        The ``Schedule``.

    Raises:
        UsageError: A source no node holds.
    """
    for f in plan.files:
        for t in f.tensors:
            for c in t.copies:
                if not holders.get(c.source):
                    raise UsageError("no node holds this source file", plan.sources[c.source])
    chosen = tuple(_writer(f, holders, (writers or {}).get(f.rank) if f.rank is not None else None) for f in plan.files)
    needs: dict[tuple[str, int], list[Run]] = {}
    local: dict[str, set[int]] = {}
    for f, node in zip(plan.files, chosen, strict=True):
        for t in f.tensors:
            for c in t.copies:
                if node in holders[c.source]:
                    local.setdefault(node, set()).add(c.source)
                else:
                    needs.setdefault((node, c.source), []).extend(file_runs(facts[c.source].tensors[c.tensor], c))
    load: dict[str, int] = {}
    fetches: dict[str, list[Fetch]] = {}
    for (node, source), runs in sorted(needs.items()):
        merged = tuple(merge_runs(runs))
        reader = min(sorted(holders[source]), key=lambda n: load.get(n, 0))
        fetch = Fetch(source, reader, merged)
        load[reader] = load.get(reader, 0) + fetch.nbytes
        fetches.setdefault(node, []).append(fetch)
    return Schedule(
        chosen,
        {n: tuple(fs) for n, fs in fetches.items()},
        {n: tuple(sorted(s)) for n, s in local.items()},
    )


def planned_schedule(plan: Plan, placement: Placement, read: ReadOptions | None = None) -> Schedule:
    """The schedule a placement file gives, from the headers this machine reads (``reshard plan``).

    Nodes keep the names the placement file gives them; no cluster is asked.

    Raises:
        UsageError: A source no node of the placement holds.
    """
    needed = sorted({c.source for f in plan.files for t in f.tensors for c in t.copies})
    holders = {i: placement.nodes_holding(plan.sources[i]) for i in needed}
    facts = {i: source_facts(plan.sources[i], read) for i in needed if holders[i]}
    return schedule(plan, holders, facts, placement.writers)


def _writer(file: FilePlan, holders: Mapping[int, Sequence[str]], named: str | None) -> str:
    """The node named for this output, else the one holding most of its input bytes."""
    if named is not None:
        return named
    weight: dict[str, int] = {}
    for t in file.tensors:
        for c in t.copies:
            nbytes = read_bytes(t.dtype, t.shape, math.prod(c.lengths), t.nbytes)
            for node in holders[c.source]:
                weight[node] = weight.get(node, 0) + nbytes
    return min(sorted(weight), key=lambda n: -weight[n])


__all__ = [
    "Fetch",
    "Placement",
    "Run",
    "Schedule",
    "SourceFacts",
    "TensorFacts",
    "box_runs",
    "file_runs",
    "load_placement",
    "merge_runs",
    "placement_from_json",
    "planned_schedule",
    "schedule",
    "source_facts",
]
