"""MindFormers 2.x "Checkpoint 2.0" as a source kind: a root (tracker + ``iteration_*``) or one iteration folder.

The layouts come from ``metadata.json``, so no strategy flag is needed: ``open`` synthesizes a
strategy from them (``StrategyFile``, one pipeline stage per block of world ranks a layout's
``rank_list`` covers) and hands out one *virtual* ``SourceFile`` per rank of the layout: that
rank's slice of every tensor, each under its plain name, with ``homes`` naming the file that
holds it (``model-…`` or ``opt-…``, and in redundancy-removed saves another rank's file: the
``storage_data`` records are the only way to find a slice). The existing planners then work
unchanged. A folder without ``metadata.json`` (a single-card job) is one full model.

Everything is cross-checked before a plan exists (docs/formats.md §13): every file ``storage_data``
names is present (opened for some destination ranks, ``partial``: every file a plan of them reads),
every stored slice has the local shape and dtype ``metadata.json`` gives it, and every rank's box
under its layout is one of the tensor's chunks. Optimizer states are in ``metadata.json`` as
MindFormers saves them (``complete_optimizer_layout_index``); a state found in a rank's own file
but missing from it is given its parameter's layout, as MindFormers' loader does
(``complete_optimizer_sharded_tensor``), when its shape is the parameter's slice.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reshard.errors import FormatError, ReshardError, UnsupportedError, UsageError
from reshard.formats import checkpoint2 as cp2
from reshard.formats.base import JOURNAL_NAME
from reshard.formats.strategy import StrategyFile, make_strategy
from reshard.layout import ParamLayout
from reshard.layout.algebra import rank_boxes
from reshard.plan import SourceFile, SourceTensor
from reshard.sources.files import source_files
from reshard.sources.kind import SHARDED, OpenedModel, OpenedRanks, Traits
from reshard.sources.options import ReadOptions
from reshard.text import indefinite

FMT = "safetensors"


@dataclass(frozen=True)
class Iteration:
    """What ``read_iteration`` found: the folder, its metadata (None: single card) and its files' headers."""

    folder: str
    metadata: cp2.Metadata | None
    headers: Mapping[str, SourceFile]  # file name -> header facts
    common: dict[str, Any] | None
    absent: frozenset[str] = frozenset()  # files metadata.json names that are not here (``partial``)


def iteration_folder(path: str, options: ReadOptions | None, notes: list[str] | None = None) -> str:
    """The iteration folder ``path`` stands for (``ReadOptions.iteration`` picks another than the tracker's)."""
    iteration = options.iteration if options is not None else None
    folder = cp2.resolve_iteration(path, iteration)
    if notes is not None and os.path.normpath(folder) != os.path.normpath(path):
        if iteration is not None:
            why = "the iteration asked for"
        elif os.path.isfile(os.path.join(path, cp2.TRACKER_NAME)):
            why = f"{cp2.TRACKER_NAME} names it"
        else:
            why = f"the only iteration; no {cp2.TRACKER_NAME} (MindFormers writes it last): the save may be unfinished"
        notes.append(f"using {os.path.basename(folder)} ({why})")
    return folder


def text_files(path: str, options: ReadOptions | None) -> list[str]:
    """The text files a read of the Checkpoint 2.0 ``path`` opens beside its tensor files: the tracker
    (``path`` a root that has one, no iteration asked for), and the iteration folder's ``metadata.json``
    and ``common.json`` when present (``rank-list --files``: a copy for some destination ranks needs them too)."""
    iteration = options.iteration if options is not None else None
    folder = cp2.resolve_iteration(path, iteration)
    tracker = os.path.join(path, cp2.TRACKER_NAME)
    followed = iteration is None and os.path.normpath(folder) != os.path.normpath(path)
    found = [tracker] if followed and os.path.isfile(tracker) else []
    texts = (os.path.join(folder, n) for n in (cp2.METADATA_NAME, cp2.COMMON_NAME))
    return found + [t for t in texts if os.path.isfile(t)]


def tensor_files(folder: str) -> list[str]:
    """The Checkpoint 2.0 tensor files of an iteration folder, by name; two worlds' files refused."""
    names = sorted(n for n in os.listdir(folder) if cp2.parse_file_name(n) is not None)
    worlds: dict[
        tuple[str | None, str], dict[int, str]
    ] = {}  # a redundancy-removed save counts model and opt files apart
    for n in names:
        parsed = cp2.parse_file_name(n)
        assert parsed is not None
        worlds.setdefault((parsed.prefix, parsed.type), {}).setdefault(parsed.world, n)
    for found in worlds.values():
        if len(found) > 1:
            (w1, f1), (w2, f2) = sorted(found.items())[:2]
            raise FormatError(
                f"files of two jobs are mixed here: {f1} (of {w1} files) and {f2} (of {w2}); keep one job's files",
                folder,
            )
    return names


def read_iteration(
    path: str, options: ReadOptions | None, notes: list[str] | None = None, *, partial: bool = False
) -> Iteration:
    """The iteration's metadata and the headers of every tensor file, cross-checked.

    ``partial``: a file ``metadata.json`` names may be absent (a node holding the files some
    destination ranks read: ``transform --ranks``); it is listed in ``Iteration.absent``, and a plan
    that reads it is refused (``ops.checkpoint2.check_present``). Otherwise an absent file is a
    ``FormatError``.
    """
    folder = iteration_folder(path, options, notes)
    names = tensor_files(folder)
    meta_path = os.path.join(folder, cp2.METADATA_NAME)
    md = cp2.read_metadata(meta_path) if os.path.isfile(meta_path) else None
    common = cp2.read_common(folder)
    status = common.get("ckpt_status") if common is not None else None
    if notes is not None and status not in (None, 0):
        notes.append(f"{os.path.join(folder, cp2.COMMON_NAME)}: ckpt_status is {status!r} (0 is a healthy checkpoint)")
    absent: frozenset[str] = frozenset()
    if md is None:
        if not names:
            raise FormatError("no metadata.json and no model-/opt- .safetensors files", folder)
        world = cp2.parse_file_name(names[0])
        if world is not None and world.world > 1:
            raise FormatError(_no_metadata(folder, world.world), folder)
    else:
        named = md.file_names()
        absent = frozenset(n for n in named if not os.path.isfile(os.path.join(folder, n)))
        if absent and not partial:
            raise _missing(absent, folder)
        names = sorted((set(names) | set(named)) - absent)
    facts = source_files({i: os.path.join(folder, n) for i, n in enumerate(names)}, options)
    headers = {names[i]: f for i, f in facts.items()}
    if md is not None:
        _cross_check(md, headers, folder)
    return Iteration(folder, md, headers, common, absent)


def _missing(absent: frozenset[str], folder: str) -> FormatError:
    """The refusal of files ``metadata.json`` names that are not here, when every file is read."""
    more = f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""
    return FormatError(
        f"{min(absent)}, named in metadata.json storage_data, is missing{more} (with --ranks, only the files "
        "those destination ranks read are needed)",
        folder,
    )


def _no_metadata(folder: str, world: int) -> str:
    """Why a folder of several ranks' files has no ``metadata.json``: a reshard run not finished yet
    (its journal is in the destination, the root or the folder itself), or a save that lacks it."""
    for where in (folder, os.path.dirname(os.path.normpath(folder))):
        journal = os.path.join(where, JOURNAL_NAME)
        if os.path.isfile(journal):
            return (
                f"metadata.json is not written yet: these are the files of an unfinished reshard run ({journal} "
                "is its journal); finish it by running the command that wrote them again with --resume"
            )
    return f"metadata.json is missing (the files are of {indefinite(world)}-rank job)"


def _cross_check(md: cp2.Metadata, headers: Mapping[str, SourceFile], folder: str) -> None:
    """Every stored slice has the local shape and dtype ``metadata.json`` gives it."""
    for (name, slice_id), records in md.storage.items():
        meta = md.tensors[name]
        chunk = meta.chunk(slice_id)
        assert chunk is not None
        for record in records:
            if record.file_name not in headers:  # absent: read for some ranks only (read_iteration)
                continue
            t = headers[record.file_name].tensors.get(name)
            if t is not None and t.shape == chunk.local_shape and t.dtype is meta.dtype:
                continue
            path = os.path.join(folder, record.file_name)
            if t is None:
                raise FormatError(f"holds no {name!r}, which metadata.json stores in it (slice {slice_id})", path)
            if t.shape != chunk.local_shape:
                raise FormatError(
                    f"{name!r} has shape {list(t.shape)}; metadata.json gives slice {slice_id} "
                    f"{list(chunk.local_shape)}",
                    path,
                )
            if t.dtype != meta.dtype:
                raise FormatError(f"{name!r} is {t.dtype.ms_name}; metadata.json says {meta.dtype.ms_name}", path)


# --------------------------------------------------------------------------------------------
# the virtual ranks and the strategy


@dataclass
class _Placed:
    """One tensor with a layout: its strategy layout, its pipeline stage, and its ranks' inner indexes."""

    meta: cp2.TensorMeta
    layout: ParamLayout
    stage: int
    inner: Mapping[int, int]  # world rank -> index in rank_list (one dict per distinct rank_list)


def _place(md: cp2.Metadata) -> tuple[dict[str, _Placed], int]:
    """Each laid-out tensor's stage (the block of world ranks its ``rank_list`` covers) and the ranks per stage."""
    placed: dict[str, _Placed] = {}
    inners: dict[tuple[int, ...], dict[int, int]] = {}
    per_stage: int | None = None
    for name, meta in md.tensors.items():
        if meta.layout is None:
            continue
        ranks = meta.layout.rank_list
        n = len(ranks)
        first = min(ranks)
        if sorted(ranks) != list(range(first, first + n)) or first % n:
            raise UnsupportedError(
                f"tensor {name!r}: rank_list {_short(ranks)} is not one aligned block of ranks (a pipeline stage)",
                md.path,
            )
        if per_stage is not None and n != per_stage:
            raise UnsupportedError(
                f"tensor {name!r}: {n} ranks in its layout, others have {per_stage}; stages of different sizes",
                md.path,
            )
        per_stage = n
        inner = inners.get(ranks)
        if inner is None:
            inner = inners[ranks] = {r: i for i, r in enumerate(ranks)}
        placed[name] = _Placed(meta, meta.layout.param_layout(), first // n, inner)
    return placed, per_stage or 1


def _short(ranks: Sequence[int]) -> str:
    return str(list(ranks)) if len(ranks) <= 8 else f"[{', '.join(map(str, ranks[:8]))}, ...]"


def _pick(records: Sequence[cp2.StorageRecord], rank: int, absent: frozenset[str]) -> cp2.StorageRecord:
    """MindFormers' choice: the record this rank wrote, else one whose group holds it, else any (same slice);
    among the records whose file is here, when some are ``absent``."""
    if absent:
        here = [r for r in records if r.file_name not in absent]
        records = here or records
    for r in records:
        if r.storage_rank == rank:
            return r
    for r in records:
        if rank in r.rank_group:
            return r
    return records[0]


def _virtual_ranks(
    it: Iteration, md: cp2.Metadata, placed: Mapping[str, _Placed], world: int, folder: str
) -> dict[int, SourceFile]:
    """Each rank's slice of every tensor, and (lazily) the file holding it.

    A rank's tensors (dtype, local shape: metadata.json's, equal to the headers' after
    ``_cross_check``) are shared by every rank holding the same names, in metadata.json's order;
    which file holds a slice is worked out when a plan asks (``_Homes``), so opening a job of
    1 000 tensors × 1 024 ranks does not resolve a million storage records up front.
    """
    classes: dict[tuple[object, ...], tuple[int, ...]] = {}
    slices: dict[str, tuple[Mapping[int, int] | None, Sequence[int]]] = {}
    members: dict[int, list[str]] = {r: [] for r in range(world)}
    held: dict[str, SourceTensor] = {}
    for name, meta in md.tensors.items():
        p = placed.get(name)
        if p is None:  # whole on every rank
            slices[name] = (None, (meta.chunks[0].slice_id,))
            holders: Sequence[int] = range(world)
        else:
            key = (p.layout, meta.global_shape, meta.axis_fragmentations)
            if key not in classes:
                classes[key] = _slice_ids(meta, p.layout, md.path)
            slices[name] = (p.inner, classes[key])
            holders = list(p.inner)
        local = meta.chunks[0].local_shape
        held[name] = SourceTensor(meta.dtype, local, math.prod(local) * meta.dtype.itemsize)
        for r in holders:
            members[r].append(name)
    shared: dict[tuple[str, ...], dict[str, SourceTensor]] = {}
    ranks: dict[int, SourceFile] = {}
    for r in range(world):
        names = tuple(members[r])
        tensors = shared.get(names)
        if tensors is None:
            tensors = shared[names] = {n: held[n] for n in names}
        homes = _Homes(r, tensors, slices, md, folder, it.absent)
        ranks[r] = SourceFile(os.path.join(folder, f"rank {r}"), r, tensors, {"format": "ms"}, homes=homes)
    return ranks


class _Homes(Mapping[str, str]):
    """Tensor name -> the file holding one rank's slice, resolved through ``storage_data`` on access."""

    def __init__(
        self,
        rank: int,
        names: Mapping[str, object],
        slices: Mapping[str, tuple[Mapping[int, int] | None, Sequence[int]]],
        md: cp2.Metadata,
        folder: str,
        absent: frozenset[str],
    ) -> None:
        self.rank, self.names, self.slices, self.md, self.folder = rank, names, slices, md, folder
        self.absent = absent
        self.extra: dict[str, str] = {}  # tensors of the rank's own files that metadata.json does not list
        self.resolved: dict[str, str] = {}

    def __getitem__(self, name: str) -> str:
        hit = self.resolved.get(name) or self.extra.get(name)
        if hit is not None:
            return hit
        if name not in self.names:
            raise KeyError(name)
        inner, sids = self.slices[name]
        sid = sids[inner[self.rank]] if inner is not None else sids[0]
        record = _pick(self.md.storage[(name, sid)], self.rank, self.absent)
        path = self.resolved[name] = os.path.join(self.folder, record.file_name)
        return path

    def __iter__(self) -> Iterator[str]:
        return iter({**dict.fromkeys(self.names), **dict.fromkeys(self.extra)})

    def __len__(self) -> int:
        return len(self.names) + sum(1 for n in self.extra if n not in self.names)


def _slice_ids(meta: cp2.TensorMeta, layout: ParamLayout, where: str) -> tuple[int, ...]:
    """The slice id of each rank of the layout (index in ``rank_list``): its box under the layout is that chunk."""
    out = []
    for inner, box in enumerate(rank_boxes(layout, meta.global_shape)):
        found = cp2.slice_id_of_box(box, meta.axis_fragmentations)
        chunk = meta.chunk(found) if found is not None else None
        if found is None or chunk is None or cp2.chunk_box(chunk, meta.axis_fragmentations) != box:
            rank = meta.layout.rank_list[inner] if meta.layout is not None else inner
            raise FormatError(
                f"tensor {meta.name!r}: its layout gives rank {rank} the box {[list(b) for b in box]}, "
                "which is none of its chunks",
                where,
            )
        out.append(found)
    return tuple(out)


def _own_extras(
    it: Iteration, md: cp2.Metadata, placed: dict[str, _Placed], ranks: dict[int, SourceFile], world: int
) -> list[str]:
    """Tensors of a rank's own files (numbered by rank) that ``metadata.json`` does not list.

    An optimizer state whose parameter is listed and whose shape is the parameter's slice on that
    rank takes the parameter's layout (MindFormers' ``complete_optimizer_sharded_tensor``); any
    other is that rank's own tensor, copied whole like a parameter outside a strategy.
    """
    extras: list[str] = []
    for file_name, facts in it.headers.items():
        parsed = cp2.parse_file_name(file_name)
        if parsed is None or parsed.world != world or parsed.number not in ranks:
            continue
        vrank = ranks[parsed.number]
        for name, t in facts.tensors.items():
            if name in md.tensors or name in vrank.tensors:
                continue
            base = _base_name(name, md.tensors)
            same_slice = base is not None and base in vrank.tensors and vrank.tensors[base].shape == t.shape
            if same_slice and name not in placed and base in placed:
                b = placed[base]
                placed[name] = dataclasses.replace(b, meta=dataclasses.replace(b.meta, name=name))
            if name not in vrank.tensors:
                vrank.tensors = {**vrank.tensors, name: t}  # the dict is shared with other ranks
            homes = vrank.homes
            assert isinstance(homes, _Homes)
            homes.extra[name] = os.path.join(it.folder, file_name)
            if name not in extras:
                extras.append(name)
    return extras


def _base_name(name: str, names: Mapping[str, object]) -> str | None:
    """``adam_m.w`` -> ``w`` when ``w`` is listed (every dot boundary tried, as MindFormers does)."""
    dot = name.find(".")
    while dot != -1:
        if name[dot + 1 :] in names:
            return name[dot + 1 :]
        dot = name.find(".", dot + 1)
    return None


def _strategy(placed: Mapping[str, _Placed], stages: int, path: str) -> StrategyFile:
    layouts = {(f"{p.stage}-{name}" if stages > 1 else name): p.layout for name, p in placed.items()}
    return dataclasses.replace(make_strategy(layouts), path=path)


def _single_card(it: Iteration, path: str, kind: str) -> OpenedModel:
    """No metadata.json (or no layout at all): one full model, its files by name, and rank 0 of a one-rank job."""
    tensors: dict[str, SourceTensor] = {}
    homes: dict[str, str] = {}
    weight_map: dict[str, str] = {}
    for file_name, facts in it.headers.items():
        for name, t in facts.tensors.items():
            if name in tensors:
                raise FormatError(f"{name!r} is also in {os.path.basename(homes[name])}", facts.path)
            tensors[name], homes[name], weight_map[name] = t, facts.path, file_name
    rank0 = SourceFile(os.path.join(it.folder, "rank 0"), 0, tensors, {"format": "ms"}, homes=homes)
    return OpenedModel(kind, path, FMT, dict(it.headers), weight_map, ranks={0: rank0}, keyed=True)


def open_checkpoint2(
    path: str,
    options: ReadOptions | None,
    notes: list[str],
    kind: str,
    it: Iteration | None = None,
    *,
    partial: bool = False,
) -> OpenedRanks | OpenedModel:
    """The planning facts of a Checkpoint 2.0 root or iteration folder (module docstring); ``it``:
    what ``read_iteration`` already read of it (None: read now); ``partial``: files ``metadata.json``
    names may be absent (``read_iteration``), listed in ``OpenedRanks.absent`` as paths."""
    it = it if it is not None else read_iteration(path, options, notes, partial=partial)
    md = it.metadata
    if md is None:
        return _single_card(it, path, kind)
    placed, per_stage = _place(md)
    if not placed:
        if it.absent:  # one full model: every file is read
            raise _missing(it.absent, it.folder)
        return _single_card(it, path, kind)
    stages = max(p.stage for p in placed.values()) + 1
    present = {p.stage for p in placed.values()}
    if present != set(range(stages)):
        missing = sorted(set(range(stages)) - present)
        raise UnsupportedError(f"no tensor is laid out on pipeline stage {missing[0]} of {stages}", md.path)
    world = stages * per_stage
    try:
        ranks = _virtual_ranks(it, md, placed, world, it.folder)
    except ReshardError as exc:
        if exc.path == md.path:
            raise
        raise FormatError(exc.detail, md.path) from None
    extras = _own_extras(it, md, placed, ranks, world)
    if extras and it.absent:
        raise UsageError(
            f"{len(extras)} tensor(s) of the rank files are not listed in metadata.json (e.g. {extras[0]!r}), so what "
            f"the {len(it.absent)} file(s) not here hold (e.g. {min(it.absent)}) cannot be known: copy them too",
            md.path,
        )
    if extras:
        notes.append(f"{md.path}: {len(extras)} tensor(s) of the rank files are not listed, e.g. {extras[0]!r}")
    absent = tuple(os.path.join(it.folder, n) for n in sorted(it.absent))
    return OpenedRanks(kind, path, FMT, ranks, _strategy(placed, stages, md.path), absent)


def check_iteration(src: str, kind: Any, read: ReadOptions | None) -> None:
    """An iteration (``ReadOptions.iteration``) is asked only of a kind that has iterations
    (``Traits.iterations``: a MindFormers Checkpoint 2.0, a Megatron-LM run folder). ``sources.resolve`` calls it.

    ``kind`` is the source's kind, or a sequence of the kinds of every source read with ``read``
    (``verify`` reads two); a ``UsageError`` naming ``src`` when none has iterations.
    """
    kinds = list(kind) if isinstance(kind, (list, tuple)) else [kind]
    if read is not None and read.iteration is not None and not any(k.traits.iterations for k in kinds):
        what = getattr(kinds[0], "name", "another kind of checkpoint") if kinds else "another kind of checkpoint"
        only = "a MindFormers Checkpoint 2.0 or a Megatron-LM run folder only"
        raise UsageError(f"an iteration ({read.iteration}) applies to {only}; this is {what}", src)


class Checkpoint2:
    """A MindFormers Checkpoint 2.0: a root holding ``latest_checkpointed_iteration.txt`` and
    ``iteration_*`` folders, or one ``iteration_*`` folder."""

    name = "a MindFormers Checkpoint 2.0"
    looks_for = "a MindFormers Checkpoint 2.0 (latest_checkpointed_iteration.txt or an iteration_* folder)"
    traits = Traits(SHARDED, owns_layouts="metadata.json", iterations=True)  # one card: a full model

    def detect(self, path: str) -> bool:
        return cp2.is_iteration_folder(path) or cp2.is_root(path)

    def open(
        self, path: str, options: ReadOptions | None, notes: list[str], *, partial: bool = False
    ) -> OpenedRanks | OpenedModel:
        """``partial``: for some destination ranks only, files they do not read may be absent (``read_iteration``)."""
        return open_checkpoint2(path, options, notes, self.name, partial=partial)


CHECKPOINT2 = Checkpoint2()

__all__ = [
    "CHECKPOINT2",
    "Iteration",
    "check_iteration",
    "iteration_folder",
    "open_checkpoint2",
    "read_iteration",
    "tensor_files",
    "text_files",
]
