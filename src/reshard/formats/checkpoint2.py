"""MindFormers 2.x "Checkpoint 2.0": its file names and the text files that describe a save.

A Checkpoint 2.0 (docs/formats.md §10) is ``ROOT/iteration_{n:08d}/`` holding per rank
``[prefix-]model-{rank:07d}-{world:07d}.safetensors`` and ``[prefix-]opt-…`` (MindSpore
safetensors), ``metadata.json`` (every tensor's layout and which file holds which block),
``common.json`` (training counters), and ``ROOT/latest_checkpointed_iteration.txt``, the tracker
MindFormers writes last as its completion marker. This module knows those names and writes the
three texts exactly as MindFormers 2.1.0 does (key order, separators, indentation), from plain
values: what each rank holds is decided by ``reshard.plan.checkpoint2``; the slice ids come from
``reshard.layout.slices``.

Reading (docs/formats.md §13): ``metadata.json`` parsed into small frozen values, strictly (every
malformed piece is one line naming the file and the tensor); ``storage_data`` keys are parsed with
``ast.literal_eval`` (a literal, never code); the tracker and ``iteration_*`` folders resolved.
What a rank holds and the cross-check against the headers is ``reshard.sources.checkpoint2``.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reshard import dtypes
from reshard.dtypes import DType
from reshard.errors import FormatError, ReshardError, UnsupportedError, UsageError
from reshard.formats.tracker import read_tracker_text
from reshard.layout import Box, ParamLayout
from reshard.layout.slices import alias_names, axis_fragmentations, replica_ids, slice_ids
from reshard.layout.types import TensorMapEntry
from reshard.text import indefinite

CHECKPOINT2 = "checkpoint2"  # the output format's name (``--output-format checkpoint2``)
TRACKER_NAME = "latest_checkpointed_iteration.txt"
METADATA_NAME = "metadata.json"
COMMON_NAME = "common.json"
MODEL = "model"
OPTIMIZER = "opt"
DEFAULT_ITERATION = 0

# common.json's keys in MindFormers' order (its ``CommonInfo`` dataclass) and the types each takes.
COMMON_KEYS: tuple[str, ...] = (
    "epoch_num",
    "step_num",
    "global_step",
    "loss_scale",
    "global_batch_size",
    "consumed_samples",
    "ckpt_status",
)
_FLOAT_KEYS = frozenset({"loss_scale"})


def iteration_dir(root: str, iteration: int) -> str:
    """``ROOT/iteration_{n:08d}``."""
    return os.path.join(root, f"iteration_{iteration:08d}")


def file_name(kind: str, rank: int, world: int, prefix: str = "") -> str:
    """``[prefix-]{kind}-{rank:07d}-{world:07d}.safetensors`` (``kind``: ``model`` or ``opt``)."""
    head = f"{prefix}-" if prefix else ""
    return f"{head}{kind}-{rank:07d}-{world:07d}.safetensors"


def check_iteration(iteration: object) -> int:
    """``iteration`` as a non-negative int, or ``UsageError``."""
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise UsageError(f"the iteration must be a non-negative integer, not {iteration!r}")
    return iteration


def tracker_text(iteration: int) -> str:
    """The tracker's content: the iteration number, no newline (as MindFormers writes it)."""
    return str(iteration)


def check_common(common: Mapping[str, object] | None, source: str | None = None) -> dict[str, object]:
    """``common.json``'s values: the seven keys in MindFormers' order, None where not given.

    Args:
        common: Given values (None: all unknown). Keys outside the seven are refused (MindFormers'
            loader would fail on them); integers for the counters, a number for ``loss_scale``.
        source: The file the values were read from (``--common-json FILE``): the refusal names it.

    Returns:
        The complete mapping, in order.

    Raises:
        UsageError: An unknown key or a value of the wrong type.

    Example:
        from reshard.formats.checkpoint2 import check_common
        assert check_common({"global_step": 10})["global_step"] == 10
    """
    given = dict(common or {})
    unknown = ", ".join(sorted(set(given) - set(COMMON_KEYS)))
    if unknown:
        what = (
            f"common.json has no key(s) {unknown}"
            if source is None
            else f"holds key(s) {unknown}, which common.json does not have"
        )
        raise UsageError(f"{what} (MindFormers knows {', '.join(COMMON_KEYS)})", source)
    for key, value in given.items():
        if value is None:
            continue
        number = (int, float) if key in _FLOAT_KEYS else (int,)
        if isinstance(value, bool) or not isinstance(value, number):
            kind = "a number" if key in _FLOAT_KEYS else "an integer"
            whose = "common.json's " if source is None else ""
            raise UsageError(f"{whose}{key} must be {kind} or null, not {value!r}", source)
    return {key: given.get(key) for key in COMMON_KEYS}


def common_text(common: Mapping[str, object] | None) -> str:
    """``common.json`` as MindFormers writes it (``json.dumps(..., indent=4)``, no newline at the end)."""
    return json.dumps(check_common(common), ensure_ascii=False, indent=4)


# --------------------------------------------------------------------------------------------
# metadata.json


@dataclass(frozen=True)
class TensorFacts:
    """One tensor of the checkpoint: dtype, global shape, and its layout over ``rank_list`` (None: full)."""

    dtype: DType
    global_shape: tuple[int, ...]
    layout: ParamLayout | None
    rank_list: tuple[int, ...] = (0,)

    @functools.cached_property
    def _ids(self) -> tuple[int, ...]:
        return slice_ids(self.layout) if self.layout is not None else ()

    def slice_of(self, rank: int) -> int:
        """The slice id of global ``rank``'s block (0 for a full tensor)."""
        if self.layout is None:
            return 0
        position = rank - self.rank_list[0]  # a layout's rank list is its stage's consecutive ranks
        if not 0 <= position < len(self.rank_list) or self.rank_list[position] != rank:
            position = self.rank_list.index(rank)
        return self._ids[position]

    @functools.cached_property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of one rank's block."""
        if self.layout is None:
            return self.global_shape
        return tuple(s // k for s, k in zip(self.global_shape, axis_fragmentations(self.layout), strict=True))


def layout_json(layout: ParamLayout, rank_list: Sequence[int]) -> dict[str, Any]:
    """MindSpore's ``Layout.to_dict()`` of ``layout`` over ``rank_list``, keys in its order.

    The order matters: MindFormers' ``_deserialize_sharded_tensor_layout`` unpacks ``.values()``.
    Alias names are ``alias_names``'s (a strategy file carries none). A dimension split over several
    axes is a list; a one-axis list (how a Layout-API strategy file stores every dimension) is
    written as that one number, as ``Layout.to_dict()`` writes a plain alias.
    """
    tensor_map = [(e[0] if len(e) == 1 else list(e)) if isinstance(e, tuple) else e for e in layout.tensor_map]
    return {
        "device_matrix": list(layout.dev_matrix),
        "tensor_map": tensor_map,
        "interleaved_parallel": False,
        "alias_name": list(alias_names(layout.dev_matrix)),
        "rank_list": list(rank_list),
    }


def shard_key(name: str, slice_id: int) -> str:
    """``storage_data``'s key: the Python repr of ``(name, (slice_id,))`` (``get_sharded_tensor_shard_id``)."""
    return str((name, (slice_id,)))


def metadata_text(
    facts: Mapping[str, TensorFacts],
    holdings: Sequence[tuple[int, Sequence[str]]],
    file_of: Mapping[tuple[int, str], str],
) -> str:
    """``metadata.json`` for the given tensors as MindFormers 2.1.0's ``save_metadata`` writes it.

    Args:
        facts: Every tensor's facts, by name.
        holdings: Per rank, in rank order, the names its files hold, in its order.
        file_of: (rank, name) -> the file name holding it.

    Returns:
        The compact JSON text: ``state_dict_metadata`` (tensors in first-appearance order over
        ranks, each chunk once) then ``storage_data`` (one key per (name, slice), every holding
        rank in order, ``rank_group`` the ranks holding that slice).

    Example:
        from reshard import dtypes
        from reshard.formats.checkpoint2 import TensorFacts, metadata_text
        facts = {"w": TensorFacts(dtypes.FLOAT32, (4,), None)}
        text = metadata_text(facts, [(0, ["w"])], {(0, "w"): "model-0000000-0000001.safetensors"})
    """
    groups: dict[tuple[str, int], list[int]] = {}
    slices = [[facts[name].slice_of(rank) for name in names] for rank, names in holdings]
    for (rank, names), ids in zip(holdings, slices, strict=True):
        for name, slice_id in zip(names, ids, strict=True):
            groups.setdefault((name, slice_id), []).append(rank)
    state: dict[str, Any] = {}
    chunks: dict[str, set[int]] = {}
    storage: dict[str, list[dict[str, Any]]] = {}
    for (rank, names), ids in zip(holdings, slices, strict=True):
        for name, slice_id in zip(names, ids, strict=True):
            f = facts[name]
            entry = state.get(name)
            if entry is None:
                entry = state[name] = _tensor_entry(f)
                chunks[name] = set()
            if slice_id not in chunks[name]:
                chunks[name].add(slice_id)
                entry["chunk"].append({"global_offset": [slice_id], "local_shape": list(f.local_shape)})
            record = {"file_name": file_of[(rank, name)], "storage_rank": rank, "rank_group": groups[(name, slice_id)]}
            storage.setdefault(shard_key(name, slice_id), []).append(record)
    return json.dumps(
        {"state_dict_metadata": state, "storage_data": storage}, ensure_ascii=False, separators=(",", ":")
    )


def _tensor_entry(f: TensorFacts) -> dict[str, Any]:
    layout = f.layout
    return {
        "properties": {
            "dtype": f.dtype.ms_name,
            "replica_id": list(replica_ids(layout)) if layout is not None else 0,
            "allow_shape_mismatch": False,
            "allow_to_save": True,
        },
        "global_shape": list(f.global_shape),
        "axis_fragmentations": list(axis_fragmentations(layout)) if layout is not None else [1] * len(f.global_shape),
        "layout": layout_json(layout, f.rank_list) if layout is not None else None,
        "chunk": [],
    }


def global_shape(layout: ParamLayout | None, local: Sequence[int]) -> tuple[int, ...]:
    """The full shape of a tensor whose rank block is ``local`` under ``layout`` (None: ``local``)."""
    if layout is None:
        return tuple(local)
    return tuple(s * k for s, k in zip(local, axis_fragmentations(layout), strict=True))


# --------------------------------------------------------------------------------------------
# reading

ITERATION_PREFIX = "iteration_"
_ITERATION = re.compile(r"iteration_(\d{8,})")
_FILE = re.compile(r"(?:(?P<prefix>.+)-)?(?P<type>model|opt)-(?P<number>\d{7,})-(?P<world>\d{7,})\.safetensors")


def iteration_folder_name(iteration: int) -> str:
    """``iteration_00000010`` for 10 (MindFormers' ``f"iteration_{n:08d}"``)."""
    return f"{ITERATION_PREFIX}{iteration:08d}"


@dataclass(frozen=True)
class FileName:
    """The parts of a ``[prefix-]{model|opt}-{number:07d}-{world:07d}.safetensors`` name."""

    prefix: str | None
    type: str  # MODEL | OPTIMIZER
    number: int
    world: int


def parse_file_name(name: str) -> FileName | None:
    """The parts of a Checkpoint 2.0 tensor file name (None: not one)."""
    m = _FILE.fullmatch(name)
    if m is None:
        return None
    return FileName(m.group("prefix"), m.group("type"), int(m.group("number")), int(m.group("world")))


# --------------------------------------------------------------------------------------------
# finding the iteration folder


def is_iteration_folder(path: str) -> bool:
    """An ``iteration_<digits>`` folder holding ``metadata.json`` or a Checkpoint 2.0 tensor file."""
    if not os.path.isdir(path) or _ITERATION.fullmatch(os.path.basename(os.path.normpath(path))) is None:
        return False
    names = _listing(path)
    return METADATA_NAME in names or any(parse_file_name(n) is not None for n in names)


def is_root(path: str) -> bool:
    """A folder holding the tracker, or ``iteration_*`` folders and nothing that is a rank folder."""
    if not os.path.isdir(path):
        return False
    if os.path.isfile(os.path.join(path, TRACKER_NAME)):
        return True
    return any(is_iteration_folder(os.path.join(path, n)) for n in _listing(path) if _ITERATION.fullmatch(n))


def iteration_of(folder: str) -> int | None:
    """The iteration number in an ``iteration_*`` folder's name (None: not one)."""
    m = _ITERATION.fullmatch(os.path.basename(os.path.normpath(folder)))
    return int(m.group(1)) if m else None


def read_tracker(root: str) -> int:
    """The iteration the tracker names; a tracker that is not a non-negative integer is a FormatError."""
    path = os.path.join(root, TRACKER_NAME)
    text = read_tracker_text(path)
    if not text.isdigit():
        raise FormatError(f"the tracker holds {text[:40]!r}, not an iteration number", path)
    return int(text)


def resolve_iteration(path: str, iteration: int | None = None) -> str:
    """The iteration folder ``path`` stands for.

    An ``iteration_*`` folder is itself (an explicit ``iteration`` must then be its own); a root
    goes to ``iteration`` when given, else to the one its tracker names, else (no tracker) to its
    only ``iteration_*`` folder.

    Raises:
        UsageError: The iteration asked for or named by the tracker is missing, or a root without
            a tracker holds several iterations and none was chosen.
        FormatError: The tracker is not an iteration number.
    """
    if iteration is not None and iteration < 0:
        raise UsageError(f"iteration {iteration} is negative")
    own = iteration_of(path)
    if own is not None and is_iteration_folder(path):
        if iteration is not None and iteration != own:
            raise UsageError(f"this is iteration {own}'s folder; --src-iteration {iteration} names another", path)
        return path
    if iteration is not None:
        folder = os.path.join(path, iteration_folder_name(iteration))
        if not os.path.isdir(folder):
            raise UsageError(f"no iteration {iteration} here ({os.path.basename(folder)} is missing)", path)
        return folder
    tracker = os.path.join(path, TRACKER_NAME)
    if os.path.isfile(tracker):
        named = read_tracker(path)
        folder = os.path.join(path, iteration_folder_name(named))
        if not os.path.isdir(folder):
            raise UsageError(f"names iteration {named} but {os.path.basename(folder)} is missing", tracker)
        return folder
    found = sorted(n for n in _listing(path) if _ITERATION.fullmatch(n) and os.path.isdir(os.path.join(path, n)))
    if len(found) != 1:
        raise UsageError(
            f"no {TRACKER_NAME} and {len(found)} iteration folders: choose one with --src-iteration N", path
        )
    return os.path.join(path, found[0])


def _listing(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


# --------------------------------------------------------------------------------------------
# metadata.json


@dataclass(frozen=True)
class Layout:
    """One tensor's ``layout`` (MindSpore's ``Layout.to_dict()``); ``tensor_map`` keeps nested lists as tuples."""

    device_matrix: tuple[int, ...]
    tensor_map: tuple[TensorMapEntry, ...]
    alias_name: tuple[str, ...]
    rank_list: tuple[int, ...]
    interleaved_parallel: bool = False

    def param_layout(self) -> ParamLayout:
        """The same layout as a strategy file's ``ParamLayout`` (list maps: every entry a tuple)."""
        if any(isinstance(e, tuple) for e in self.tensor_map):
            entries: tuple[TensorMapEntry, ...] = tuple(e if isinstance(e, tuple) else (e,) for e in self.tensor_map)
            return ParamLayout(self.device_matrix, entries)
        return ParamLayout(self.device_matrix, self.tensor_map)


@dataclass(frozen=True)
class Chunk:
    """One distinct slice: its slice id in the grid of ``axis_fragmentations`` and its shape."""

    slice_id: int
    local_shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorMeta:
    """One entry of ``state_dict_metadata``."""

    name: str
    dtype: DType
    replica_id: tuple[int, ...]
    global_shape: tuple[int, ...]
    axis_fragmentations: tuple[int, ...]
    layout: Layout | None
    chunks: tuple[Chunk, ...]

    def chunk(self, slice_id: int) -> Chunk | None:
        """The chunk of ``slice_id`` (None: the tensor has none)."""
        return self._by_slice.get(slice_id)

    @functools.cached_property
    def _by_slice(self) -> dict[int, Chunk]:
        return {c.slice_id: c for c in self.chunks}


@dataclass(frozen=True)
class StorageRecord:
    """One file holding a slice: its name, the rank that wrote it, and the ranks holding that slice."""

    file_name: str
    storage_rank: int
    rank_group: tuple[int, ...]


@dataclass(frozen=True)
class Metadata:
    """A parsed ``metadata.json``: tensors by name (file order) and storage records by (name, slice id)."""

    path: str
    tensors: Mapping[str, TensorMeta]
    storage: Mapping[tuple[str, int], tuple[StorageRecord, ...]]

    def file_names(self) -> list[str]:
        """Every file ``storage_data`` names, sorted."""
        return sorted({r.file_name for records in self.storage.values() for r in records})


def read_metadata(path: str) -> Metadata:
    """Parse and validate ``metadata.json``.

    Raises:
        FormatError: Not JSON, a missing key, a value of the wrong type, or facts that contradict
            each other (a chunk outside the grid, a shape the fragmentation does not divide, chunks
            that are not the blocks the layout gives its ranks or leave a gap (``_check_tiling``), a
            slice with no storage record, one file holding two slices of a tensor); the message
            names the file and the tensor.
        UnsupportedError: A layout with ``interleaved_parallel: true``.
    """
    try:
        with open(path, "rb") as fh:
            raw = json.loads(fh.read())
    except OSError as exc:
        raise FormatError(f"cannot read: {exc.strerror}", path) from None
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"not valid JSON ({str(exc).splitlines()[0]})", path) from None
    top = _obj(raw, METADATA_NAME, path)
    tensors_raw = _obj(_key(top, "state_dict_metadata", METADATA_NAME, path), "state_dict_metadata", path)
    storage_raw = _obj(_key(top, "storage_data", METADATA_NAME, path), "storage_data", path)
    tensors = {name: _tensor(name, value, path) for name, value in tensors_raw.items()}
    storage = _storage(storage_raw, tensors, path)
    return Metadata(path, tensors, storage)


def _tensor(name: str, raw: Any, path: str) -> TensorMeta:
    where = f"tensor {name!r}"
    obj = _obj(raw, where, path)
    props = _obj(_key(obj, "properties", where, path), f"{where} properties", path)
    dtype_name = _key(props, "dtype", where, path)
    if not isinstance(dtype_name, str):
        raise FormatError(f"{where}: dtype is not a string", path)
    dtype = dtypes.from_ms_name(dtype_name, path)
    replica = _ints(props.get("replica_id", []), f"{where} replica_id", path, allow_int=True)
    shape = _ints(_key(obj, "global_shape", where, path), f"{where} global_shape", path)
    frags = _ints(_key(obj, "axis_fragmentations", where, path), f"{where} axis_fragmentations", path)
    if len(frags) != len(shape) or any(f < 1 for f in frags):
        raise FormatError(f"{where}: axis_fragmentations {list(frags)} do not fit global_shape {list(shape)}", path)
    if any(s % f for s, f in zip(shape, frags, strict=True)):
        raise FormatError(f"{where}: global_shape {list(shape)} is not divisible by {list(frags)}", path)
    layout_raw = _key(obj, "layout", where, path)
    layout = None if layout_raw is None else _layout(layout_raw, len(shape), where, path)
    chunk_list = _key(obj, "chunk", where, path)
    if not isinstance(chunk_list, list) or not chunk_list:
        raise FormatError(f"{where}: chunk is not a non-empty list", path)
    chunks = tuple(_chunk(c, shape, frags, where, path) for c in chunk_list)
    if len({c.slice_id for c in chunks}) != len(chunks):
        raise FormatError(f"{where}: two chunks with the same slice id", path)
    _check_tiling(layout, shape, frags, chunks, where, path)
    if layout is not None and replica and len(replica) != len(layout.rank_list):
        raise FormatError(f"{where}: replica_id has {len(replica)} entries for {len(layout.rank_list)} ranks", path)
    return TensorMeta(name, dtype, replica, shape, frags, layout, chunks)


def _check_tiling(
    layout: Layout | None,
    shape: tuple[int, ...],
    frags: tuple[int, ...],
    chunks: Sequence[Chunk],
    where: str,
    path: str,
) -> None:
    """A tensor's chunks are exactly the blocks its layout gives its ranks (docs/formats.md §13.4).

    Each chunk is one cell of the ``axis_fragmentations`` grid (``_chunk``) and no two share a cell;
    so the chunks tile the global shape exactly (no gap, no overlap) when every cell is one, and
    they are the layout's blocks when the grid is the layout's: ``axis_fragmentations`` as the
    layout splits each dimension, all ones for a tensor without a layout (whole on every rank).
    Anything else would be planned from blocks that are not the tensor's.
    """
    if layout is None:
        expected, whose = (1,) * len(shape), "it has no layout (whole on every rank), so"
    else:
        expected, whose = _layout_fragmentations(layout, where, path), f"its layout {_describe(layout)} gives"
    if frags != expected:
        raise FormatError(f"{where}: axis_fragmentations are {list(frags)}, but {whose} {list(expected)}", path)
    cells = math.prod(frags)
    if len(chunks) != cells:
        ids = {c.slice_id for c in chunks}
        gap = next(i for i in range(cells) if i not in ids)
        box = [list(b) for b in chunk_box(Chunk(gap, chunks[0].local_shape), frags)]
        raise FormatError(
            f"{where}: its {len(chunks)} chunk(s) leave a gap in global_shape {list(shape)}: none is slice {gap} "
            f"(elements {box}) of the {cells} that axis_fragmentations {list(frags)} make",
            path,
        )


@functools.lru_cache(maxsize=4096)
def _fragmentations(layout: ParamLayout) -> tuple[int, ...]:
    return axis_fragmentations(layout)


def _layout_fragmentations(layout: Layout, where: str, path: str) -> tuple[int, ...]:
    """The blocks per dimension ``layout`` splits a tensor into; a layout MindSpore would refuse is a FormatError."""
    try:
        return _fragmentations(layout.param_layout())
    except ReshardError as exc:
        raise FormatError(f"{where}: layout {_describe(layout)}: {exc.detail}", path) from None


def _describe(layout: Layout) -> str:
    tensor_map = [list(e) if isinstance(e, tuple) else e for e in layout.tensor_map]
    return f"(device_matrix {list(layout.device_matrix)}, tensor_map {tensor_map})"


def _layout(raw: Any, ndim: int, where: str, path: str) -> Layout:
    obj = _obj(raw, f"{where} layout", path)
    dev = _ints(_key(obj, "device_matrix", where, path), f"{where} device_matrix", path)
    tmap_raw = _key(obj, "tensor_map", where, path)
    if not isinstance(tmap_raw, list):
        raise FormatError(f"{where}: tensor_map is not a list", path)
    tmap = tuple(_map_entry(e, len(dev), where, path) for e in tmap_raw)
    if len(tmap) != ndim:
        raise FormatError(f"{where}: tensor_map has {len(tmap)} entries for {indefinite(ndim)}-D tensor", path)
    alias = obj.get("alias_name", [])
    if not isinstance(alias, list) or not all(isinstance(a, str) for a in alias):
        raise FormatError(f"{where}: alias_name is not a list of strings", path)
    ranks = _ints(_key(obj, "rank_list", where, path), f"{where} rank_list", path)
    interleaved = obj.get("interleaved_parallel", False)
    if not isinstance(interleaved, bool):
        raise FormatError(f"{where}: interleaved_parallel is not true or false", path)
    if interleaved:
        raise UnsupportedError(
            f"{where}: interleaved_parallel layouts (virtual device axes) have no strategy-file equivalent", path
        )
    if any(d < 1 for d in dev) or len(ranks) != math.prod(dev):
        raise FormatError(f"{where}: rank_list has {len(ranks)} ranks for device_matrix {list(dev)}", path)
    if len(set(ranks)) != len(ranks) or any(r < 0 for r in ranks):
        raise FormatError(f"{where}: rank_list repeats a rank or holds a negative one", path)
    return Layout(dev, tmap, tuple(alias), ranks, interleaved)


def _map_entry(raw: Any, axes: int, where: str, path: str) -> TensorMapEntry:
    values = raw if isinstance(raw, list) else [raw]
    if not values or not all(_is_int(v) and -1 <= v < axes for v in values):
        raise FormatError(f"{where}: tensor_map entry {raw!r} is not a device axis in -1..{axes - 1}", path)
    return tuple(values) if isinstance(raw, list) else int(raw)


def _chunk(raw: Any, shape: tuple[int, ...], frags: tuple[int, ...], where: str, path: str) -> Chunk:
    obj = _obj(raw, f"{where} chunk", path)
    offset = _ints(_key(obj, "global_offset", f"{where} chunk", path), f"{where} global_offset", path)
    local = _ints(_key(obj, "local_shape", f"{where} chunk", path), f"{where} local_shape", path)
    if len(offset) != 1 or not 0 <= offset[0] < math.prod(frags):
        raise FormatError(f"{where}: global_offset {list(offset)} is not a slice id in 0..{math.prod(frags) - 1}", path)
    expected = tuple(s // f for s, f in zip(shape, frags, strict=True))
    if local != expected:
        raise FormatError(
            f"{where}: chunk {offset[0]} has local_shape {list(local)}; global_shape {list(shape)} "
            f"over {list(frags)} gives {list(expected)}",
            path,
        )
    return Chunk(offset[0], local)


def _storage(
    raw: Mapping[str, Any], tensors: Mapping[str, TensorMeta], path: str
) -> dict[tuple[str, int], tuple[StorageRecord, ...]]:
    out: dict[tuple[str, int], tuple[StorageRecord, ...]] = {}
    held: dict[tuple[str, str], int] = {}  # (tensor, file) -> the slice stored there
    for key, value in raw.items():
        name, slice_id = parse_shard_key(key, path)
        where = f"storage_data[{key}]"
        if name not in tensors:
            raise FormatError(f"{where}: tensor {name!r} is not in state_dict_metadata", path)
        if tensors[name].chunk(slice_id) is None:
            raise FormatError(f"{where}: tensor {name!r} has no chunk {slice_id}", path)
        if not isinstance(value, list) or not value:
            raise FormatError(f"{where} is not a non-empty list", path)
        records = out[(name, slice_id)] = tuple(_record(r, where, path) for r in value)
        for r in records:  # a file holds one tensor of a name: one slice of it
            other = held.setdefault((name, r.file_name), slice_id)
            if other != slice_id:
                raise FormatError(
                    f"{where}: {r.file_name} holds one {name!r}, but storage_data stores slices {other} and "
                    f"{slice_id} of it there",
                    path,
                )
    for meta in tensors.values():
        missing = [c.slice_id for c in meta.chunks if (meta.name, c.slice_id) not in out]
        if missing:
            raise FormatError(f"tensor {meta.name!r}: slice {missing[0]} has no storage_data record", path)
    return out


def _record(raw: Any, where: str, path: str) -> StorageRecord:
    obj = _obj(raw, where, path)
    name = _key(obj, "file_name", where, path)
    if not isinstance(name, str) or not name or os.sep in name or name in (".", ".."):
        raise FormatError(f"{where}: file_name {name!r} is not a file name", path)
    rank = _key(obj, "storage_rank", where, path)
    if not _is_int(rank) or rank < 0:
        raise FormatError(f"{where}: storage_rank {rank!r} is not a rank", path)
    group = _ints(obj.get("rank_group", [rank]), f"{where} rank_group", path)
    return StorageRecord(name, int(rank), group)


def parse_shard_key(key: str, path: str) -> tuple[str, int]:
    """``"('w', (3,))"`` -> ``("w", 3)``, by ``ast.literal_eval`` (a literal, never code)."""
    try:
        value = ast.literal_eval(key)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise FormatError(f"storage_data key {key[:80]!r} is not ('name', (slice_id,))", path) from None
    ok = (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], str)
        and isinstance(value[1], tuple)
        and len(value[1]) == 1
        and _is_int(value[1][0])
        and value[1][0] >= 0
    )
    if not ok:
        raise FormatError(f"storage_data key {key[:80]!r} is not ('name', (slice_id,))", path)
    return value[0], int(value[1][0])


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _obj(raw: Any, what: str, path: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise FormatError(f"{what} is not a JSON object", path)
    return raw


def _key(obj: Mapping[str, Any], key: str, where: str, path: str) -> Any:
    if key not in obj:
        raise FormatError(f"{where}: missing {key!r}", path)
    return obj[key]


def _ints(raw: Any, what: str, path: str, allow_int: bool = False) -> tuple[int, ...]:
    if allow_int and _is_int(raw):
        return (int(raw),)
    if not isinstance(raw, list) or not all(_is_int(v) for v in raw):
        raise FormatError(f"{what} is not a list of integers", path)
    if any(v < 0 for v in raw):
        raise FormatError(f"{what} holds a negative number", path)
    return tuple(raw)


# --------------------------------------------------------------------------------------------
# slice ids and boxes


def slice_coordinate(slice_id: int, fragmentations: Sequence[int]) -> tuple[int, ...]:
    """The grid coordinate of ``slice_id`` in ``fragmentations`` (row-major, last dim fastest)."""
    coord = []
    for f in reversed(fragmentations):
        coord.append(slice_id % f)
        slice_id //= f
    return tuple(reversed(coord))


def slice_id_of(coordinate: Sequence[int], fragmentations: Sequence[int]) -> int:
    """The row-major slice id of a grid coordinate (``slice_coordinate``'s inverse)."""
    sid = 0
    for c, f in zip(coordinate, fragmentations, strict=True):
        sid = sid * f + c
    return sid


def chunk_box(chunk: Chunk, fragmentations: Sequence[int]) -> Box:
    """The element box of the full tensor a chunk holds."""
    coord = slice_coordinate(chunk.slice_id, fragmentations)
    return tuple((c * n, (c + 1) * n) for c, n in zip(coord, chunk.local_shape, strict=True))


def slice_id_of_box(box: Box, fragmentations: Sequence[int]) -> int | None:
    """The slice id of an element box that is one cell of the grid (None: it is not)."""
    coord = []
    for (a, b), f in zip(box, fragmentations, strict=True):
        n = b - a
        if n <= 0 or a % n:
            return None
        coord.append(a // n)
        if coord[-1] >= f:
            return None
    return slice_id_of(coord, fragmentations)


# --------------------------------------------------------------------------------------------
# common.json


def read_common(folder: str) -> dict[str, Any] | None:
    """``common.json`` of an iteration folder (None: there is none); malformed -> FormatError."""
    path = os.path.join(folder, COMMON_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as fh:
            value = json.loads(fh.read())
    except OSError as exc:
        raise FormatError(f"cannot read: {exc.strerror}", path) from None
    except ValueError as exc:
        raise FormatError(f"not valid JSON ({str(exc).splitlines()[0]})", path) from None
    if not isinstance(value, dict):
        raise FormatError("is not a JSON object", path)
    return value


__all__ = [
    "CHECKPOINT2",
    "COMMON_KEYS",
    "COMMON_NAME",
    "DEFAULT_ITERATION",
    "ITERATION_PREFIX",
    "METADATA_NAME",
    "MODEL",
    "OPTIMIZER",
    "TRACKER_NAME",
    "Chunk",
    "FileName",
    "Layout",
    "Metadata",
    "StorageRecord",
    "TensorFacts",
    "TensorMeta",
    "check_common",
    "check_iteration",
    "chunk_box",
    "common_text",
    "file_name",
    "global_shape",
    "is_iteration_folder",
    "is_root",
    "iteration_dir",
    "iteration_folder_name",
    "iteration_of",
    "layout_json",
    "metadata_text",
    "parse_file_name",
    "parse_shard_key",
    "read_common",
    "read_metadata",
    "read_tracker",
    "resolve_iteration",
    "shard_key",
    "slice_coordinate",
    "slice_id_of",
    "slice_id_of_box",
    "tracker_text",
]
