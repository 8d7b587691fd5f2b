"""The plan's data model: plain, frozen values that say where every output byte comes from.

Every planner of this package produces these and every executor consumes them, so they hold
nothing but data (no file handles, no layouts): a plan can be printed, compared, pickled to
another machine and checked (``reshard.plan.validate``) without touching a file. Like
torch.distributed.checkpoint's ``ReadItem``, a ``Copy`` is three tuples: the box start inside the
source tensor, the box start inside the destination tensor, and the box lengths.

The inputs of planning live here too: ``SourceFile`` / ``SourceTensor`` (what planning needs from
a file's header), and the small helpers every planner shares: interning source paths
(``SourcePaths``), a tensor copied whole or assembled from boxes, the ``Role`` of a parameter in a
destination file, and the destination ranks and metadata of an output.
"""

from __future__ import annotations

import abc
import functools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import overload

from reshard import dtypes
from reshard.dtypes import DType
from reshard.errors import UsageError
from reshard.layout import Box

SCALE_INV = "_scale_inv"  # an FP8 weight's block scale beside it: X -> X_scale_inv (X.weight -> X.weight_scale_inv)


@dataclass(frozen=True)
class Copy:
    """Copy one box: ``lengths`` elements per dim from ``src_start`` in the source tensor to ``dst_start``."""

    source: int  # index into Plan.sources
    tensor: str  # tensor name inside that source file
    src_start: tuple[int, ...]
    dst_start: tuple[int, ...]
    lengths: tuple[int, ...]
    whole_source: bool = False  # the box is the entire source tensor
    # The C-order shape the source tensor is viewed as before the box is taken (None: its own
    # shape). Free on a memory map; model maps use it where stacking changes the number of dims.
    src_view: tuple[int, ...] | None = None
    # Axes permutation: destination axis j is source axis src_perm[j] (numpy's transpose); then
    # ``src_start`` is in source axis order and ``lengths``/``dst_start`` in destination order.
    src_perm: tuple[int, ...] | None = None

    @property
    def src_lengths(self) -> tuple[int, ...]:
        """The box's lengths in the source's axis order."""
        if self.src_perm is None:
            return self.lengths
        out = [0] * len(self.lengths)
        for j, axis in enumerate(self.src_perm):
            out[axis] = self.lengths[j]
        return tuple(out)


@dataclass(frozen=True)
class TensorPlan:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    copies: tuple[Copy, ...]
    nbytes: int
    literal: bytes | None = None  # content given in the plan itself (strings restored from metadata)

    @property
    def whole_copy(self) -> bool:
        """True when the tensor is one source tensor copied unchanged (also strings, scalars)."""
        if len(self.copies) != 1:
            return False
        c = self.copies[0]
        return c.whole_source and c.src_view is None and c.src_perm is None and c.lengths == self.shape

    @property
    def bytes_read(self) -> int:
        return read_bytes(self.dtype, self.shape, sum(math.prod(c.lengths) for c in self.copies), self.nbytes)


def read_bytes(dtype: DType, shape: tuple[int, ...], elements: int, nbytes: int) -> int:
    """Bytes a tensor reads from its sources: ``elements`` copied (strings count 1 a character)."""
    if not shape:
        return nbytes
    return elements * (dtype.itemsize if dtype is not dtypes.STR else 1)


@dataclass(frozen=True)
class FileStats:
    """Totals of one output file's tensors (lazy files answer them without building any tensor)."""

    tensors: int
    copies: int
    bytes_read: int
    bytes_written: int
    largest_tensor: int

    @staticmethod
    def of(tensors: Sequence[TensorPlan]) -> FileStats:
        if isinstance(tensors, LazyTensors):
            return tensors.stats
        copies = read = written = largest = 0
        for t in tensors:
            copies += len(t.copies)
            read += t.bytes_read
            written += t.nbytes
            largest = max(largest, t.nbytes)
        return FileStats(len(tensors), copies, read, written, largest)


class LazyTensors(Sequence[TensorPlan]):
    """The tensors of one output, built on access; their totals are known without building them.

    ``reshard.plan.bulk.RankTensors`` (transform and split outputs built from shared per-class
    tables), ``reshard.plan.boxes.BoxTensors`` (outputs of a plan from chunk boxes) and
    ``reshard.plan.checkpoint2.SelectedTensors`` (a Checkpoint 2.0 rank's model or optimizer part
    of one) are the kinds. A subclass says how many tensors it has, builds them
    (``materialise``) and totals them (``stats``); indexing, iterating, comparing, hashing and
    pickling (as the plain tuple, so a plan sent to another machine needs no planner) are the same
    for every kind and live here.
    """

    @property
    @abc.abstractmethod
    def stats(self) -> FileStats: ...

    @abc.abstractmethod
    def materialise(self) -> tuple[TensorPlan, ...]: ...

    @overload
    def __getitem__(self, index: int) -> TensorPlan: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[TensorPlan, ...]: ...
    def __getitem__(self, index: int | slice) -> TensorPlan | tuple[TensorPlan, ...]:
        return self.materialise()[index]

    def __iter__(self) -> Iterator[TensorPlan]:
        return iter(self.materialise())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyTensors | tuple):
            return self.materialise() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.materialise())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} tensors)"

    def __reduce__(self) -> tuple[type, tuple[tuple[TensorPlan, ...]]]:
        return tuple, (self.materialise(),)


@dataclass(frozen=True)
class FilePlan:
    """One output file. ``tensors`` is a tuple, or (transform plans) a ``LazyTensors`` sequence that
    builds its ``TensorPlan`` objects on access: iterate it, index it, take its ``len``."""

    path: str
    format: str
    tensors: Sequence[TensorPlan]
    metadata: tuple[tuple[str, str], ...] = ()
    rank: int | None = None

    @property
    def stats(self) -> FileStats:
        return FileStats.of(self.tensors)

    @property
    def nbytes(self) -> int:
        return self.stats.bytes_written

    @property
    def copy_count(self) -> int:
        """Number of copies of all tensors (without building them, for lazy files)."""
        return self.stats.copies


@dataclass(frozen=True)
class TextOutput:
    """A small file a plan writes after its tensor files, in order: text (index JSON, manifests) or
    bytes (a PyTorch DCP ``.metadata``, whose presence marks the checkpoint complete)."""

    path: str
    text: str | bytes


@dataclass(frozen=True)
class QuantizedSource:
    """One tensor a plan reads dequantized: the file and name its copies read, and the stored pair.

    ``path``/``name``: what the plan's copies name (the values' file; ``X.weight`` or ``P``).
    ``weight``: the stored values in ``path``; ``scale`` in ``scale_path``. ``block``: FP8 ``(b0, b1)``;
    MXFP4 ``(32,)``.
    """

    path: str
    name: str
    kind: str  # FP8_BLOCK | MXFP4
    weight: str
    scale_path: str
    scale: str
    block: tuple[int, ...]
    target: str | None = None  # safetensors code of the dtype --dequantize writes (None: --quantize)
    # --quantize after a model map: the weight is this planned tensor (its copies read the files
    # ``assembled_sources`` names by index), not a stored one; ``path`` is then its first source's.
    assembled: TensorPlan | None = None
    assembled_sources: tuple[str, ...] = ()
    # A chunked source's pair (a PyTorch DCP folder): ``assembled`` is the stored weight, ``scale_assembled``
    # its stored scale, both read from their chunks (in ``assembled_sources``), ``path`` a chunk file of the
    # weight (its copies' source), ``scale_path`` one of the scale.
    scale_assembled: TensorPlan | None = None


@dataclass(frozen=True)
class Plan:
    operation: str
    sources: tuple[str, ...]
    files: tuple[FilePlan, ...]
    texts: tuple[TextOutput, ...] = ()
    # Tensors the copies read dequantized (``--dequantize``, reshard.plan.quantized): keyed by
    # (source path, tensor name), so re-interning the sources keeps them valid.
    quantized: tuple[QuantizedSource, ...] = ()

    @functools.cached_property
    def quantized_by_copy(self) -> dict[tuple[str, str], QuantizedSource]:
        """``quantized`` by the (source path, tensor name) a copy reads: made once per plan, since the
        executor asks for every output tensor (a dict per tensor was 4 ms a tensor at 45 000 pairs)."""
        return {(q.path, q.name): q for q in self.quantized}

    def computed_reads(self, t: TensorPlan) -> list[QuantizedSource]:
        """The computed tensors (``--dequantize``/``--quantize``) the copies of ``t`` read, in copy order."""
        made = self.quantized_by_copy
        return [q for c in t.copies if (q := made.get((self.sources[c.source], c.tensor))) is not None]

    @property
    def bytes_written(self) -> int:
        return sum(f.stats.bytes_written for f in self.files)

    @property
    def bytes_read(self) -> int:
        return sum(f.stats.bytes_read for f in self.files)

    @property
    def largest_tensor(self) -> int:
        return max((f.stats.largest_tensor for f in self.files), default=0)

    def summary(self) -> dict[str, object]:
        stats = [f.stats for f in self.files]
        return {
            "operation": self.operation,
            "sources": len(self.sources),
            "outputs": len(self.files),
            "tensors": sum(s.tensors for s in stats),
            "copies": sum(s.copies for s in stats),
            "bytes_read": sum(s.bytes_read for s in stats),
            "bytes_written": sum(s.bytes_written for s in stats),
            "largest_tensor": max((s.largest_tensor for s in stats), default=0),
        }

    def to_json(self) -> dict[str, object]:
        return {
            **self.summary(),
            "source_files": list(self.sources),
            "files": [
                {
                    "path": f.path,
                    "format": f.format,
                    "rank": f.rank,
                    "bytes": f.nbytes,
                    "tensors": [
                        {
                            "name": t.name,
                            "dtype": t.dtype.ms_name,
                            "shape": list(t.shape),
                            "copies": [
                                [
                                    self.sources[c.source],
                                    c.tensor,
                                    list(c.src_start),
                                    list(c.dst_start),
                                    list(c.lengths),
                                    *(
                                        [list(c.src_view) if c.src_view else None, list(c.src_perm)]
                                        if c.src_perm is not None
                                        else [list(c.src_view)]
                                        if c.src_view is not None
                                        else []
                                    ),
                                ]
                                for c in t.copies
                            ],
                        }
                        for t in f.tensors
                    ],
                }
                for f in self.files
            ],
            "texts": [t.path for t in self.texts],
            **({"quantized": [_quantized_json(q) for q in self.quantized]} if self.quantized else {}),
        }


def _quantized_json(q: QuantizedSource) -> dict[str, object]:
    """How a plan's tensor is computed while copying (``--dequantize``/``--quantize``), for ``reshard plan --json``."""
    return {
        "tensor": q.name,
        "file": q.path,
        "kind": q.kind,
        "values": q.weight,
        "scale": q.scale,
        "scale_file": q.scale_path,
        "block": list(q.block),
        **({"values_from": _chunk_files(q, q.assembled)} if q.assembled is not None else {}),
        **({"scale_from": _chunk_files(q, q.scale_assembled)} if q.scale_assembled is not None else {}),
    }


def _chunk_files(q: QuantizedSource, t: TensorPlan) -> list[str]:
    """The files an assembled weight or scale of ``q`` is read from, in order."""
    return list(dict.fromkeys(q.assembled_sources[c.source] for c in t.copies))


# --------------------------------------------------------------------------------------------
# planning inputs


@dataclass(frozen=True)
class SourceTensor:
    dtype: DType
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class SourceFile:
    """What planning needs from one source file: its tensors' dtypes and shapes, in file order.

    A *virtual* source file (one rank of a Checkpoint 2.0, whose slices live in several files)
    names each tensor's file in ``homes``; ``path_of(name)`` is the file a copy of that tensor
    reads (``path`` for every tensor of a plain file, whose ``homes`` is empty).
    """

    path: str
    rank: int
    tensors: dict[str, SourceTensor]
    metadata: dict[str, str] = field(default_factory=dict)
    strings: dict[str, str] = field(default_factory=dict)  # values of string entries (small)
    homes: Mapping[str, str] = field(default_factory=dict)  # tensor name -> the file holding it (virtual files)

    def path_of(self, name: str) -> str:
        """The file holding tensor ``name``."""
        return self.homes.get(name, self.path) if self.homes else self.path


class SourcePaths:
    """Interns source paths into the plan's ``sources`` tuple (``ids``: path -> index)."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.ids: dict[str, int] = {}

    def id(self, path: str) -> int:
        if path not in self.ids:
            self.ids[path] = len(self.paths)
            self.paths.append(path)
        return self.ids[path]


class Role(Enum):
    """What a destination file does with one parameter (``reshard.plan.transform_reference.StageCut.role``)."""

    SKIP = "skip"  # not in this file (another pipeline stage's)
    WHOLE = "whole"  # copied whole from one source file (in only one of the two strategies)
    TRANSFORM = "transform"  # resliced from its source layout to its destination layout


# --------------------------------------------------------------------------------------------
# shared helpers


def whole_tensor(sources: SourcePaths, src: SourceFile, name: str, out_name: str | None = None) -> TensorPlan:
    """``src``'s tensor ``name`` copied unchanged (as ``out_name``)."""
    return whole_tensor_at(sources.id(src.path_of(name)), src, name, out_name)


def whole_tensor_at(source: int, src: SourceFile, name: str, out_name: str | None = None) -> TensorPlan:
    """``src``'s tensor ``name`` copied unchanged; ``source`` is the index of ``src`` in the plan."""
    t = src.tensors[name]
    zeros = (0,) * len(t.shape)
    copy = Copy(source, name, zeros, zeros, t.shape, whole_source=True)
    return TensorPlan(out_name or name, t.dtype, t.shape, (copy,), t.nbytes)


def box_start(box: Box) -> tuple[int, ...]:
    return tuple(a for a, _ in box)


def assembled(
    sources: SourcePaths,
    name: str,
    out_name: str,
    pieces: Iterable[tuple[SourceFile, Box, Box]],
    dst_box: Box,
    dtype: DType,
) -> TensorPlan:
    """A tensor assembled from (source file, box held by that file, piece box) triples."""
    dst_origin = box_start(dst_box)
    copies = []
    for src, held, piece in pieces:
        held_origin = box_start(held)
        lengths = tuple(b - a for a, b in piece)
        copies.append(
            Copy(
                sources.id(src.path_of(name)),
                name,
                tuple(a - o for (a, _), o in zip(piece, held_origin, strict=True)),
                tuple(a - o for (a, _), o in zip(piece, dst_origin, strict=True)),
                lengths,
                whole_source=lengths == src.tensors[name].shape,
            )
        )
    shape = tuple(b - a for a, b in dst_box)
    return TensorPlan(out_name, dtype, shape, tuple(copies), math.prod(shape) * dtype.itemsize)


def wanted_ranks(ranks: Sequence[int] | None, total: int) -> list[int]:
    """The destination ranks to plan (all by default); any outside ``0..total-1`` is a usage error."""
    wanted = list(range(total)) if ranks is None else list(ranks)
    bad = [r for r in wanted if not 0 <= r < total]
    if bad:
        raise UsageError(f"destination rank(s) {bad} out of range 0..{total - 1}")
    return wanted


def output_metadata(fmt: str) -> tuple[tuple[str, str], ...]:
    """The metadata MindSpore writes into an output of format ``fmt`` (safetensors: ``format: ms``)."""
    return (("format", "ms"),) if fmt == "safetensors" else ()


def rank_ranges(ranks: Sequence[int]) -> str:
    """``0-3,5`` style text for a sorted rank list."""
    parts: list[str] = []
    for r in ranks:
        if parts and parts[-1].split("-")[-1] == str(r - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{r}"
        else:
            parts.append(str(r))
    return ",".join(parts)


__all__ = [
    "SCALE_INV",
    "Copy",
    "FilePlan",
    "FileStats",
    "LazyTensors",
    "Plan",
    "QuantizedSource",
    "Role",
    "SourceFile",
    "SourcePaths",
    "SourceTensor",
    "TensorPlan",
    "TextOutput",
    "assembled",
    "box_start",
    "output_metadata",
    "rank_ranges",
    "read_bytes",
    "wanted_ranks",
    "whole_tensor",
    "whole_tensor_at",
]
