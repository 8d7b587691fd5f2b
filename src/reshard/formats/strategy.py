"""Strategy files (protobuf ``.ckpt`` and ``.json``) -> per-parameter layouts.

A strategy file records, per parameter, how it is sharded (docs/formats.md §2.1-§2.4). This module reads and
writes both on-disk forms, merges per-pipeline-stage files the way ``merge_pipeline_strategys`` does
(docs/formats.md §2.5) and builds the layout types of ``reshard.layout`` from them; what a file's layout items
mean (the name -> layout map MindSpore's ``_convert_to_list`` builds, stage and device counts) is
answered there, on any ``LayoutTable``, which ``StrategyFile`` is.

Why it is built this way:

* **No generated code.** The protobuf classes of ``node_strategy.proto`` are built at import time
  from a ``FileDescriptorProto`` written out below (field numbers and labels exactly as docs/formats.md §2.1) in
  a *private* descriptor pool, so they never clash with another copy of the same proto (e.g.
  MindSpore's own ``node_strategy_pb2``) in the same process. Serialization then comes from the same
  protobuf runtime MindSpore uses, which is what makes our bytes identical to theirs.
* **Two levels.** Merging works on the raw messages / raw JSON dicts, so unknown protobuf fields and
  extra JSON keys (``tensor_shape``, ``zzz``...) pass through untouched and the merged file is byte-
  (protobuf) or text- (JSON) identical to MindSpore's. Everything else works on the plain
  ``StrategyFile`` dataclass, which holds only what converters need.
* **Tensor maps as stored.** One ``TensorMap`` gives a flat tuple of ints; several give a tuple of
  tuples with empty ones dropped, exactly like ``_convert_to_list``. An entry with a single device
  axis stays a 1-tuple ``(v,)`` (the layout engine treats it like ``v``); we do not normalise it, so a
  read/write round trip reproduces the file.
* **Safer than MindSpore, never different on valid input.** Candidates are merged in sorted name
  order (MindSpore uses directory order, which is filesystem dependent), the destination file is
  never merged into itself, nothing is deleted, output appears atomically, and the inputs MindSpore
  mishandles (parameter names containing ``-``, mixed ``.ckpt``/``.json`` folders, empty files) get
  one clear error instead of a corrupted merge.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reshard.errors import FormatError, LayoutError, ReshardError, UnsupportedError, UsageError
from reshard.formats.base import write_whole
from reshard.formats.strategy_proto import PACKAGE, SCHEMA, WIRE_LIMIT, WireError, decode
from reshard.layout import STAGE_SEPARATOR, ParamLayout, TensorMapEntry
from reshard.text import first_line

if TYPE_CHECKING:
    from google.protobuf import descriptor_pb2
    from google.protobuf.message import Message

# --------------------------------------------------------------------------------------------
# Constants

PROTOBUF = "protobuf"
JSON = "json"
FORMATS = (PROTOBUF, JSON)
JSON_SUFFIX = ".json"  # MindSpore: a strategy file is JSON iff its name ends with ".json"
PROTOBUF_SUFFIX = ".ckpt"  # merge candidates: glob("*.ckpt") and glob("*.json") (docs/formats.md §2.5)

# The C++ writer stores a save counter, not a stage, in ``current_stage`` (docs/formats.md §2.2): 1 for a fresh
# save. ``merge_pipeline_strategys`` stores 1 in merged files.
FRESH_CURRENT_STAGE = 1
MERGED_CURRENT_STAGE = 1

# Merged files name each layout item "<stage>-<param>" (docs/formats.md §2.5; reshard.layout.STAGE_SEPARATOR).
_MERGED_NAME = re.compile(r"[0-9]+-[^-]+")

# Hand-built strategy files need at least one ``parallel_strategy_item``: it is the only place a
# file records its pipeline stage, and merging refuses files without one. One placeholder operator
# with a trivial strategy carries the stage.
DEFAULT_OP_NAME = "reshard_stage_marker"
DEFAULT_OP_STRATEGY: tuple[tuple[int, ...], ...] = ((1,),)

# --------------------------------------------------------------------------------------------
# Protobuf classes, built at runtime from the schema in ``formats.strategy_proto`` (docs/formats.md §2.1).
# protobuf is imported when the first class is built: reading a strategy file of up to ``WIRE_LIMIT``
# bytes (``strategy_proto.decode``), a convert or a JSON strategy never loads it. The schema names
# protobuf's label and type enums, resolved then.

_PROTO_FILE = "node_strategy.proto"
# A checkpoint's weights start with its first record (field 1, length-delimited): a strategy file never
# does (its field 1 is a number), so a file that starts so and fails to parse gets a hint.
_CHECKPOINT_START = b"\x0a"


def _file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    from google.protobuf import descriptor_pb2

    field_proto = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name=_PROTO_FILE, package=PACKAGE, syntax="proto2")
    for msg_name, fields in SCHEMA.items():
        msg = fdp.message_type.add(name=msg_name)
        for name, number, label, ftype, type_name in fields:
            fd = msg.field.add(
                name=name, number=number, label=getattr(field_proto, label), type=getattr(field_proto, ftype)
            )
            if type_name is not None:
                fd.type_name = f".{PACKAGE}.{type_name}"
    return fdp


@functools.cache
def message_classes() -> dict[str, type[Message]]:
    """The ``node_strategy.proto`` message classes, from a private descriptor pool."""
    from google.protobuf import descriptor_pool, message_factory

    pool = descriptor_pool.DescriptorPool()
    pool.Add(_file_descriptor())
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}")) for name in SCHEMA}


def _new_map() -> Any:
    return message_classes()["ParallelStrategyMap"]()


# --------------------------------------------------------------------------------------------
# Data classes


@dataclass
class StrategyItem:
    """One ``parallel_strategy_item``: an operator, its pipeline stage and its input strategies."""

    node_name: str
    stage: int
    strategies: list[list[int]] = field(default_factory=list)


@dataclass
class StrategyFile:
    """The parts of a strategy file converters use (a ``reshard.layout.LayoutTable``).

    ``layouts`` keeps the parameter names as stored (``"0-emb"`` in merged files) in file order; a
    name stored twice keeps its first position and its last layout (a dict, as MindSpore builds it).
    ``tensor_shapes`` holds JSON ``tensor_shape`` values when present; nothing interprets them.
    """

    path: str | None
    format: str  # PROTOBUF | JSON
    current_stage: int
    strategy_items: list[StrategyItem]
    layouts: dict[str, ParamLayout]
    tensor_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list, compare=False)  # for the user, e.g. files passed over

    @property
    def stage(self) -> int | None:
        """The file's pipeline stage: the stage of its first strategy item (None if it has none)."""
        return self.strategy_items[0].stage if self.strategy_items else None


def make_strategy(
    layouts: Mapping[str, ParamLayout],
    stage: int = 0,
    ops: Mapping[str, Sequence[Sequence[int]]] | None = None,
    current_stage: int = FRESH_CURRENT_STAGE,
    tensor_shapes: Mapping[str, Sequence[int]] | None = None,
) -> StrategyFile:
    """A strategy file from plain Python, e.g. for hand-built test or demo strategies.

    ``ops`` maps operator names to their input strategies (all in ``stage``); by default one
    placeholder operator records the stage so that the file can be merged.
    """
    op_map = ops if ops is not None else {DEFAULT_OP_NAME: DEFAULT_OP_STRATEGY}
    items = [StrategyItem(name, stage, [list(s) for s in strategy]) for name, strategy in op_map.items()]
    shapes = {k: tuple(v) for k, v in (tensor_shapes or {}).items()}
    return StrategyFile(None, PROTOBUF, current_stage, items, dict(layouts), shapes)


# --------------------------------------------------------------------------------------------
# Reading


def format_of(path: str | os.PathLike[str]) -> str:
    """``json`` if the file name ends with ``.json`` (as MindSpore decides), else ``protobuf``."""
    return JSON if os.fspath(path).endswith(JSON_SUFFIX) else PROTOBUF


def read_strategy(path: str | os.PathLike[str]) -> StrategyFile:
    """Read a strategy file (JSON by extension, else protobuf)."""
    path = os.fspath(path)
    data = _read_bytes(path)
    if format_of(path) == JSON:
        return _from_json(_parse_json(data, path), path)
    try:
        return _from_message(_read_message(data, path), path)
    except FormatError as exc:
        if not data.startswith(_CHECKPOINT_START):
            raise
        hint = "it looks like a checkpoint's weights (.ckpt), not its strategy"
        raise FormatError(f"{exc.detail}; {hint}", path) from None


def _read_message(data: bytes, path: str) -> Any:
    """The strategy message to read from: decoded without the protobuf runtime up to ``WIRE_LIMIT``
    bytes (``formats.strategy_proto``), by the runtime past it."""
    if len(data) > WIRE_LIMIT:
        return _parse_message(data, path)
    try:
        return decode(data)
    except WireError as exc:
        raise FormatError(f"not a protobuf strategy file ({exc})", path) from None


def _read_bytes(path: str) -> bytes:
    if os.path.isdir(path):
        raise UsageError("is a directory, expected a strategy file", path)
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise FormatError(f"cannot read strategy file: {exc.strerror}", path) from None


def _parse_message(data: bytes, path: str) -> Any:
    msg = _new_map()
    try:
        msg.ParseFromString(data)
    except Exception as exc:  # DecodeError, or runtime-specific errors on garbage
        raise FormatError(f"not a protobuf strategy file ({first_line(exc)})", path) from None
    if not msg.IsInitialized():  # the upb runtime parses messages that lack required fields
        missing = ", ".join(msg.FindInitializationErrors()[:3])
        raise FormatError(f"not a protobuf strategy file (missing required fields: {missing})", path)
    return msg


def _parse_json(data: bytes, path: str) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatError(f"not a JSON strategy file ({first_line(exc)})", path) from None
    if not isinstance(obj, dict):
        raise FormatError("JSON strategy file must hold an object", path)
    return obj


def _from_message(msg: Any, path: str | None) -> StrategyFile:
    items = [
        StrategyItem(
            _text(it.node_name, "operator name", path),
            it.parallel_strategys.stage,
            [list(ps.dim) for ps in it.parallel_strategys.parallel_strategy],
        )
        for it in msg.parallel_strategy_item
    ]
    layouts: dict[str, ParamLayout] = {}
    for item in msg.parallel_layout_item:
        name = _text(item.param_name, "parameter name", path)
        layouts[name] = _layout_from_message(name, item.parallel_layouts, path)
    return StrategyFile(path, PROTOBUF, msg.current_stage, items, layouts)


def _text(value: str | bytes, what: str, path: str | None) -> str:
    """proto2 strings that are not UTF-8 come back from the runtime as bytes: a corrupt file."""
    if isinstance(value, bytes):
        raise FormatError(f"{what} {value!r} is not valid UTF-8", path)
    return value


def _layout_from_message(name: str, pl: Any, path: str | None) -> ParamLayout:
    if not pl.dev_matrix:
        raise FormatError(f"parameter {name!r} has no dev_matrix", path)
    maps = pl.tensor_map
    # Layout-API list maps have one TensorMap per dim; empty ones (1-D padding) are dropped (2.4).
    tensor_map: tuple[TensorMapEntry, ...] = (
        tuple(maps[0].dim) if len(maps) == 1 else tuple(tuple(tm.dim) for tm in maps if len(tm.dim))
    )
    return ParamLayout(
        dev_matrix=tuple(pl.dev_matrix[0].dim),
        tensor_map=tensor_map,
        opt_shard_step=pl.opt_weight_shard_step,
        opt_shard_size=pl.opt_weight_shard_size,
        field=pl.field,
        split_shape=tuple(pl.param_split_shape[0].dim) if pl.param_split_shape else (),
        indices_offset=tuple(pl.indices_offset[0].dim) if pl.indices_offset else (),
    )


def _from_json(obj: Mapping[str, Any], path: str | None) -> StrategyFile:
    current = obj.get("current_stage", 0)
    _check_int(current, "current_stage", path)
    ops = obj.get("parallel_strategy_item", {})
    if not isinstance(ops, dict):
        raise FormatError("parallel_strategy_item must be an object", path)
    items = [_json_op(name, value, path) for name, value in ops.items()]
    if "parallel_layout_item" not in obj:
        raise FormatError("missing parallel_layout_item", path)
    raw_layouts = obj["parallel_layout_item"]
    if not isinstance(raw_layouts, dict):
        raise FormatError("parallel_layout_item must be an object", path)
    layouts: dict[str, ParamLayout] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, value in raw_layouts.items():
        layouts[name] = _json_layout(name, value, path)
        if isinstance(value, dict) and "tensor_shape" in value:
            shapes[name] = _int_tuple(value["tensor_shape"], f"{name}.tensor_shape", path)
    return StrategyFile(path, JSON, current, items, layouts, shapes)


def _json_op(name: str, value: Any, path: str | None) -> StrategyItem:
    if not isinstance(value, dict) or "stage" not in value:
        raise FormatError(f"strategy item {name!r} has no stage", path)
    _check_int(value["stage"], f"{name}.stage", path)
    strategies = value.get("parallel_strategy", [])
    if not isinstance(strategies, list):
        raise FormatError(f"{name}.parallel_strategy must be a list of lists of ints", path)
    rows = [list(_int_tuple(s, f"{name}.parallel_strategy", path)) for s in strategies]
    return StrategyItem(name, value["stage"], rows)


_JSON_REQUIRED = ("dev_matrix", "tensor_map", "field", "opt_weight_shard_step", "opt_weight_shard_size")


def _json_layout(name: str, value: Any, path: str | None) -> ParamLayout:
    if not isinstance(value, dict):
        raise FormatError(f"layout of {name!r} must be an object", path)
    for key in _JSON_REQUIRED:
        if key not in value:
            raise FormatError(f"layout of {name!r} has no {key}", path)
    for key in ("field", "opt_weight_shard_step", "opt_weight_shard_size"):
        _check_int(value[key], f"{name}.{key}", path)
    tmap = value["tensor_map"]
    if isinstance(tmap, list) and any(isinstance(v, list) for v in tmap):
        raise FormatError(f"{name}.tensor_map: JSON strategy files hold flat tensor maps only", path)
    return ParamLayout(
        dev_matrix=_int_tuple(value["dev_matrix"], f"{name}.dev_matrix", path),
        tensor_map=_int_tuple(tmap, f"{name}.tensor_map", path),
        opt_shard_step=value["opt_weight_shard_step"],
        opt_shard_size=value["opt_weight_shard_size"],
        field=value["field"],
        split_shape=_int_tuple(value.get("param_split_shape", []), f"{name}.param_split_shape", path),
        indices_offset=_int_tuple(value.get("indices_offset", []), f"{name}.indices_offset", path),
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(value: Any, what: str, path: str | None) -> None:
    if not _is_int(value):
        raise FormatError(f"{what} must be an integer, got {value!r}", path)


def _int_tuple(value: Any, what: str, path: str | None) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise FormatError(f"{what} must be a list of integers, got {value!r}", path)
    return tuple(value)


# --------------------------------------------------------------------------------------------
# Writing


def encode_strategy(sf: StrategyFile, format: str = PROTOBUF) -> bytes:
    """The bytes of a strategy file: protobuf as MindSpore's pb2 classes, JSON as ``json.dump``."""
    if format == PROTOBUF:
        return _to_message(sf).SerializeToString()
    if format == JSON:
        return json.dumps(_to_json(sf)).encode("ascii")
    raise UsageError(f"unknown strategy format {format!r} (expected one of {', '.join(FORMATS)})")


def write_strategy(path: str | os.PathLike[str], sf: StrategyFile, format: str | None = None) -> None:
    """Write ``sf`` atomically; the format follows the file extension unless given."""
    path = os.fspath(path)
    _write_bytes(path, encode_strategy(sf, format or format_of(path)))


def _write_bytes(path: str, data: bytes) -> None:
    if os.path.isdir(path):
        raise UsageError("is a directory, cannot write a strategy file here", path)
    try:
        write_whole(path, data)
    except OSError as exc:
        raise UsageError(f"cannot write strategy file: {exc.strerror}", path) from None


def _to_message(sf: StrategyFile) -> Any:
    msg = _new_map()
    try:
        msg.current_stage = sf.current_stage
        for op in sf.strategy_items:
            item = msg.parallel_strategy_item.add()
            item.node_name = op.node_name
            item.parallel_strategys.stage = op.stage
            for strategy in op.strategies:
                item.parallel_strategys.parallel_strategy.add().dim.extend(strategy)
        for name, layout in sf.layouts.items():
            item = msg.parallel_layout_item.add()
            item.param_name = name
            _fill_layouts(item.parallel_layouts, name, layout, sf.path)
    except (ValueError, TypeError) as exc:
        raise LayoutError(f"cannot store strategy: {first_line(exc)}", sf.path) from None
    return msg


def _fill_layouts(pl: Any, name: str, layout: ParamLayout, path: str | None) -> None:
    pl.dev_matrix.add().dim.extend(layout.dev_matrix)
    for dims in _tensor_map_messages(name, layout, path):
        pl.tensor_map.add().dim.extend(dims)
    pl.param_split_shape.add().dim.extend(layout.split_shape)
    pl.indices_offset.add().dim.extend(layout.indices_offset)
    pl.field = layout.field
    pl.opt_weight_shard_step = layout.opt_shard_step
    pl.opt_weight_shard_size = layout.opt_shard_size


def _tensor_map_messages(name: str, layout: ParamLayout, path: str | None) -> list[list[int]]:
    """One TensorMap for flat maps; one per dim for list maps, plus an empty one for 1-D (2.2)."""
    if not layout.is_list_map:
        return [list(layout.tensor_map)]  # type: ignore[arg-type]
    dims = [list(e) if isinstance(e, tuple) else [e] for e in layout.tensor_map]
    if any(not d for d in dims):
        raise LayoutError(f"parameter {name!r}: a list tensor map entry is empty", path)
    if len(dims) == 1:
        dims.append([])
    return dims


def _to_json(sf: StrategyFile) -> dict[str, Any]:
    ops = {
        op.node_name: {"stage": op.stage, "parallel_strategy": [list(s) for s in op.strategies]}
        for op in sf.strategy_items
    }
    layouts: dict[str, Any] = {}
    for name, layout in sf.layouts.items():
        if layout.is_list_map:
            raise UnsupportedError(
                f"parameter {name!r} has a list tensor map, which JSON strategy files cannot hold;"
                " write a protobuf (.ckpt) strategy file instead",
                sf.path,
            )
        entry: dict[str, Any] = {"dev_matrix": list(layout.dev_matrix), "tensor_map": list(layout.tensor_map)}
        if name in sf.tensor_shapes:
            entry["tensor_shape"] = list(sf.tensor_shapes[name])
        entry.update(
            field=layout.field,
            opt_weight_shard_step=layout.opt_shard_step,
            opt_weight_shard_size=layout.opt_shard_size,
        )
        if layout.split_shape or layout.indices_offset:
            entry.update(param_split_shape=list(layout.split_shape), indices_offset=list(layout.indices_offset))
        layouts[name] = entry
    return {"current_stage": sf.current_stage, "parallel_strategy_item": ops, "parallel_layout_item": layouts}


# --------------------------------------------------------------------------------------------
# Merging pipeline stages (docs/formats.md §2.5)


def find_strategy_files(directory: str | os.PathLike[str], exclude: str | os.PathLike[str] | None = None) -> list[str]:
    """The per-stage strategy files a merge of ``directory`` considers, sorted by name.

    Like MindSpore: every regular ``*.ckpt`` and ``*.json`` file directly in the directory (no hidden
    files), all of one kind. Unlike MindSpore (directory order), the order is sorted, and ``exclude``
    (the merge destination) is left out.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise UsageError("strategy directory does not exist or is not a directory", directory)
    try:
        names = sorted(os.listdir(directory))
    except OSError as exc:
        raise UsageError(f"cannot list strategy directory: {exc.strerror}", directory) from None
    files = [
        os.path.join(directory, n)
        for n in names
        if not n.startswith(".")
        and n.endswith((PROTOBUF_SUFFIX, JSON_SUFFIX))
        and os.path.isfile(os.path.join(directory, n))
    ]
    if exclude is not None:
        files = [f for f in files if not _same_file(f, os.fspath(exclude))]
    if not files:
        raise UsageError("no strategy files (*.ckpt or *.json) to merge", directory)
    kinds = {format_of(f) for f in files}
    if len(kinds) > 1:
        raise UsageError("strategy files must be all .ckpt or all .json, found both", directory)
    return files


def _same_file(a: str, b: str) -> bool:
    if os.path.abspath(a) == os.path.abspath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def merge_strategy_files(paths: Sequence[str | os.PathLike[str]]) -> tuple[str, bytes]:
    """Merge per-stage files in the given order: ``(format, bytes of the merged file)``.

    The bytes equal what ``merge_pipeline_strategys`` writes when its glob yields this order.
    """
    files = [os.fspath(p) for p in paths]
    if not files:
        raise UsageError("no strategy files to merge")
    fmt = _merge_format(files)
    if fmt == PROTOBUF:
        return fmt, _merge_messages(files).SerializeToString()
    return fmt, json.dumps(_merge_json(files)).encode("ascii")


def merge_pipeline_strategies(
    src_dir: str | os.PathLike[str], dst_file: str | os.PathLike[str], notes: list[str] | None = None
) -> str:
    """``merge_pipeline_strategys`` (docs/formats.md §2.5): merge every per-stage file of ``src_dir`` into ``dst_file``.

    Same output as MindSpore for the same candidate order: per file, byte-identical copies are
    skipped, the first file of each stage wins, layout items become ``"<stage>-<name>"``. Different
    on purpose: candidates are taken in sorted name order (MindSpore: directory order), ``dst_file``
    is never a candidate, an already merged file beside the per-stage files (MindFormers'
    ``merged_ckpt_strategy.ckpt``) is passed over (said in ``notes``), every other candidate (even
    one skipped for its stage) must have names without ``-``, an empty folder is an error (MindSpore
    writes an empty merge), nothing is deleted, the parent directory gets normal permissions and the
    file appears atomically. The destination must have the sources' kind (``.json`` for JSON
    sources, anything else for protobuf) so that it can be read back. Returns the destination path.
    """
    dst = os.fspath(dst_file)
    files, merged = _per_stage_files(find_strategy_files(src_dir, exclude=dst))
    fmt, data = merge_strategy_files(files)
    if format_of(dst) != fmt:
        want = "end with .json" if fmt == JSON else "not end with .json"
        raise UsageError(f"the merged {fmt} strategy file name must {want}", dst)
    _write_bytes(dst, data)
    if notes is not None:
        notes.extend(_ignored_notes(merged))
    return dst


def load_strategy(path_or_dir: str | os.PathLike[str]) -> StrategyFile:
    """A strategy file, or a directory of per-stage files merged in memory (nothing is written).

    A directory may also hold an already merged file (MindFormers leaves ``merged_ckpt_strategy.ckpt``
    in ``output/strategy``; ``merge-strategies`` into the folder puts one there): the per-stage files
    are used and ``notes`` says which merged file was ignored. A directory holding nothing but one
    merged file is that file. Nothing is ever deleted.
    """
    path = os.fspath(path_or_dir)
    if not os.path.isdir(path):
        return read_strategy(path)
    candidates = find_strategy_files(path)
    if len(candidates) == 1 and is_merged_file(candidates[0]):  # nothing but one merged file
        return read_strategy(candidates[0])
    files, merged = _per_stage_files(candidates)
    if _merge_format(files) == PROTOBUF:
        sf = _from_message(_merge_messages(files), path)
    else:
        sf = _from_json(_merge_json(files), path)
    sf.notes.extend(_ignored_notes(merged))
    return sf


def merge_in_memory(paths: Sequence[str | os.PathLike[str]], origin: str) -> StrategyFile:
    """Per-stage files merged in the given order into a ``StrategyFile`` (nothing is written).

    As ``load_strategy`` merges a folder, but of exactly these files (``auto_transform`` takes the
    files of the ranks it waited for, not whatever else a folder holds); ``origin`` names the result.
    """
    files = [os.fspath(p) for p in paths]
    if not files:
        raise UsageError("no strategy files to merge", origin)
    if _merge_format(files) == PROTOBUF:
        return _from_message(_merge_messages(files), origin)
    return _from_json(_merge_json(files), origin)


def _per_stage_files(candidates: list[str]) -> tuple[list[str], list[str]]:
    """The files to merge and the already merged files passed over.

    When every candidate is merged they are all returned to merge, so the merge refuses them.
    """
    merged = [f for f in candidates if is_merged_file(f)]
    per_stage = [f for f in candidates if f not in merged]
    return (per_stage, merged) if per_stage else (candidates, [])


def _ignored_notes(merged: Sequence[str]) -> list[str]:
    return [f"ignored {os.path.basename(f)}: the per-stage files were used" for f in merged]


def is_merged_file(path: str) -> bool:
    """Whether a strategy file is already merged: every layout name is ``<stage>-<name>``.

    A file that does not parse counts as not merged, so that the merge reports its problem.
    """
    try:
        names = list(read_strategy(path).layouts)
    except ReshardError:
        return False
    return bool(names) and all(_MERGED_NAME.fullmatch(n) is not None for n in names)


def _merge_format(files: Sequence[str]) -> str:
    kinds = {format_of(f) for f in files}
    if len(kinds) > 1:
        raise UsageError("strategy files must be all .ckpt or all .json, found both", os.path.dirname(files[0]))
    return kinds.pop()


def _merge_messages(files: Sequence[str]) -> Any:
    import hashlib  # OpenSSL: only a merge of per-stage files pays for it

    merged = _new_map()
    merged.current_stage = MERGED_CURRENT_STAGE
    seen_bytes: set[bytes] = set()
    seen_stages: set[int] = set()
    for path in files:
        data = _read_bytes(path)
        digest = hashlib.sha256(data).digest()
        if digest in seen_bytes:  # byte-identical copy of a file already merged
            continue
        seen_bytes.add(digest)
        msg = _parse_message(data, path)
        if not msg.parallel_strategy_item or not msg.parallel_layout_item:
            raise FormatError("strategy file is empty (no strategy items or no layout items)", path)
        _from_message(msg, path)  # validates every layout before anything is merged
        for item in msg.parallel_layout_item:  # checked even in skipped files: order-independent
            _check_unprefixed(item.param_name, path)
        stage = msg.parallel_strategy_item[0].parallel_strategys.stage
        if stage in seen_stages:  # first file of a stage wins
            continue
        seen_stages.add(stage)
        merged.parallel_strategy_item.extend(msg.parallel_strategy_item)
        for item in msg.parallel_layout_item:
            renamed = merged.parallel_layout_item.add()
            renamed.CopyFrom(item)
            renamed.param_name = f"{stage}{STAGE_SEPARATOR}{item.param_name}"
    return merged


def _merge_json(files: Sequence[str]) -> dict[str, Any]:
    ops: dict[str, Any] = {}
    layouts: dict[str, Any] = {}
    seen_stages: set[int] = set()
    for path in files:
        obj = _parse_json(_read_bytes(path), path)
        sf = _from_json(obj, path)  # validates every field before anything is merged
        if not sf.strategy_items or not sf.layouts:
            raise FormatError("strategy file is empty (no strategy items or no layout items)", path)
        for name in sf.layouts:  # checked even in skipped files: order-independent
            _check_unprefixed(name, path)
        stage = sf.strategy_items[0].stage
        if stage in seen_stages:  # first file of a stage wins
            continue
        seen_stages.add(stage)
        ops.update(obj["parallel_strategy_item"])  # same op names across stages overwrite (2.5)
        for name, value in obj["parallel_layout_item"].items():
            layouts[f"{stage}{STAGE_SEPARATOR}{name}"] = value
    return {
        "current_stage": MERGED_CURRENT_STAGE,
        "parallel_strategy_item": ops,
        "parallel_layout_item": layouts,
    }


def _check_unprefixed(name: str, path: str) -> None:
    if STAGE_SEPARATOR in name:
        raise FormatError(
            f"parameter name {name!r} contains '-': either the file is already merged or the name cannot"
            " survive a merge (MindSpore splits merged names at '-')",
            path,
        )


__all__ = [
    "DEFAULT_OP_NAME",
    "DEFAULT_OP_STRATEGY",
    "FORMATS",
    "FRESH_CURRENT_STAGE",
    "JSON",
    "JSON_SUFFIX",
    "MERGED_CURRENT_STAGE",
    "PROTOBUF",
    "PROTOBUF_SUFFIX",
    "StrategyFile",
    "StrategyItem",
    "encode_strategy",
    "find_strategy_files",
    "format_of",
    "is_merged_file",
    "load_strategy",
    "make_strategy",
    "merge_in_memory",
    "merge_pipeline_strategies",
    "merge_strategy_files",
    "message_classes",
    "read_strategy",
    "write_strategy",
]
