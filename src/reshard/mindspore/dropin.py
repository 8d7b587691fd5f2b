"""The top-level drop-in functions of ``reshard.mindspore`` (``mindspore.save_checkpoint`` and friends).

``reshard.mindspore`` re-exports every name of ``__all__`` here, and ``reshard.mindspore.parallel``
re-exports the ones ``mindspore.parallel`` shares with ``mindspore``; they live in their own module
so both faces import them without importing each other. The package docstring of
``reshard.mindspore`` says how the drop-in is built and lists the deliberate differences from
MindSpore 2.10.
"""

from __future__ import annotations

import operator
import os
import re
import warnings
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from reshard import api, dtypes
from reshard.errors import FormatError, IntegrityError, LayoutError, UnsupportedError, UsageError
from reshard.execute import assemble
from reshard.execute.options import RunOptions
from reshard.formats import layout_dir
from reshard.formats.base import TensorIndex, decode_string, write_whole
from reshard.formats.ckpt import probe_ckpt, read_ckpt, save_ckpt
from reshard.formats.safetensors import read_safetensors, save_safetensors
from reshard.formats.strategy import (
    JSON,
    PROTOBUF,
    StrategyFile,
    encode_strategy,
    find_strategy_files,
    format_of,
    merge_strategy_files,
    message_classes,
    read_strategy,
)
from reshard.layout import device_num, layout_map, stage_count
from reshard.plan import REDUNDANT_STATE_PREFIXES, FilePlan, Plan, plan_split, plan_transform_by_rank

FORMATS = ("ckpt", "safetensors")
DEFAULT_ENC_MODE = "AES-GCM"
DEFAULT_MAX_PROCESS_NUM = 64
# MindSpore writes only the checkpoints: no reshard-manifest.json in the drop-in's output folders.
WRITE_MANIFEST = False
# MindSpore's _check_path_safe rejects these in ckpt_prefix (docs/formats.md §3.9); we add path separators,
# which MindSpore lets escape the destination folder (a prefix "/x" writes "/x0.ckpt").
_UNSAFE_PREFIX_PARTS = ("..", "//", "~", "./.", "/", "\\", "\x00")
_BLANK = re.compile(r"^\s*$")
# save_checkpoint stores python ints as Int64 scalars; larger ones crash MindSpore's Tensor().
_INT64 = np.iinfo(np.int64)
# Metadata keys of MindSpore's safetensors files (docs/formats.md §1.11).
META_FORMAT = ("format", "ms")
META_REMOVE_REDUNDANCY = "remove_redundancy"
META_CRC = "crc_num"

SaveValue = np.ndarray | str
LoadedValue = np.ndarray | str


# --------------------------------------------------------------------------------------------
# argument checks (MindSpore's TypeError/ValueError become one-line UsageErrors)


def _bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise UsageError(f"{what} must be True or False, got {value!r}")
    return value


def _int(value: Any, what: str, minimum: int | None = None) -> int:
    if isinstance(value, (bool, str)):
        raise UsageError(f"{what} must be an int, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise UsageError(f"{what} must be an int, got {value!r}") from None
    if minimum is not None and number < minimum:
        raise UsageError(f"{what} must be >= {minimum}, got {number}")
    return number


def _path(value: Any, what: str) -> str:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise UsageError(f"{what} must be a non-empty path string, got {value!r}")
    return value


def _optional_path(value: Any, what: str) -> str | None:
    return None if value is None else _path(value, what)


def _callable(value: Any, what: str) -> Callable[[str], Any] | None:
    if value is not None and not callable(value):
        raise UsageError(f"{what} must be callable or None, got {type(value).__name__}")
    return value


def _format(value: Any, what: str = "format") -> str:
    if value not in FORMATS:
        raise UsageError(f"{what} must be 'ckpt' or 'safetensors', got {value!r}")
    return value


def _name_map(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise UsageError(f"name_map must be a dict, got {type(value).__name__}")
    return dict(value)


def _workers(value: Any, what: str) -> RunOptions:
    """Run options for a MindSpore process count: checked, then left to reshard's own default.

    ``process_num`` and friends size MindSpore's pools of loader *processes* (default 1 or 64); they
    say nothing about how many IO threads reshard should keep busy. Taking them as a thread count
    ran MindSpore's default ``process_num=1`` on one thread, slower than the CLI on the same job; the
    drop-in runs at the CLI's speed whatever the count (``options.default_workers()``).
    """
    _int(value, what, minimum=1)
    return RunOptions()


def _strategy_file(value: Any, what: str) -> str:
    path = _path(value, what)
    if not os.path.isfile(path):
        raise UsageError(f"{what}: no such strategy file", path)
    if os.path.getsize(path) == 0:
        raise UsageError(f"{what}: the strategy file is empty", path)
    return path


def _optional_strategy(value: Any, what: str) -> StrategyFile | None:
    return None if value is None else read_strategy(_strategy_file(value, what))


def _check_prefix(prefix: Any) -> str:
    """MindSpore's ``_check_path_safe`` for ``ckpt_prefix``, plus path separators."""
    if not isinstance(prefix, str):
        raise UsageError(f"ckpt_prefix must be a str, got {type(prefix).__name__}")
    if _BLANK.match(prefix):
        raise UsageError("ckpt_prefix must not be empty or blank")
    for part in _UNSAFE_PREFIX_PARTS:
        if part in prefix:
            raise UsageError(f"ckpt_prefix {prefix!r} contains {part!r}, which is not safe in a file name")
    return prefix


def _rank_bound(src: StrategyFile | None, dst: StrategyFile | None) -> int | None:
    """Number of valid destination ranks: all stages of ``dst``, else the devices of ``src``."""
    if dst is not None:
        return device_num(dst) * stage_count(dst)
    if src is not None:
        return device_num(src)
    return None


def _rank(value: Any, bound: int | None) -> int:
    rank = _int(value, "rank_id", minimum=0)
    if bound is not None and rank >= bound:
        raise UsageError(f"rank_id {rank} is out of range: the strategy has ranks 0..{bound - 1}")
    return rank


# --------------------------------------------------------------------------------------------
# save_checkpoint (docs/formats.md §1.5, §1.10, §1.11)


def _save_items(save_obj: Any) -> list[tuple[str, Any]]:
    if isinstance(save_obj, Mapping):
        return list(save_obj.items())
    if isinstance(save_obj, list):
        items = []
        for entry in save_obj:
            if not isinstance(entry, Mapping) or "name" not in entry or "data" not in entry:
                raise UsageError("save_obj as a list must hold dicts with the keys 'name' and 'data'")
            items.append((entry["name"], entry["data"]))
        return items
    kind = type(save_obj).__name__
    if kind == "Cell" or hasattr(save_obj, "parameters_and_names"):
        raise UnsupportedError("reshard has no networks; pass a dict name -> numpy array instead of a Cell")
    raise UsageError(f"save_obj must be a dict or a list of {{'name', 'data'}} dicts, got {kind}")


def _save_value(name: Any, value: Any) -> SaveValue:
    if not isinstance(name, str):
        raise UsageError(f"parameter names must be str, got {name!r}")
    if isinstance(value, str):
        return value
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if not isinstance(value, np.ndarray):
        raise UsageError(f"parameter {name!r}: value must be a numpy array or str, got {type(value).__name__}")
    return value


def _append_value(name: Any, value: Any) -> SaveValue:
    """MindSpore's append_dict conversions: bool -> Bool, int -> Int64, float -> Float32 (0-d)."""
    if not isinstance(name, str):
        raise UsageError(f"append_dict keys must be str, got {name!r}")
    if isinstance(value, bool):
        return np.array(value, dtype=np.bool_)
    if isinstance(value, int):
        if not _INT64.min <= value <= _INT64.max:
            raise UsageError(f"append_dict[{name!r}] = {value} does not fit in Int64")
        return np.array(value, dtype=np.int64)
    if isinstance(value, float):  # also np.float64, a float subclass (MindSpore: Float32 too)
        return np.array(value, dtype=np.float32)
    if isinstance(value, (str, np.ndarray)):
        return value
    raise UsageError(
        f"append_dict[{name!r}] must be int, float, bool, str or a numpy array, got {type(value).__name__}"
    )


def _save_name(name: Any, fmt: str) -> str:
    path = _path(name, "ckpt_file_name")
    if not path.endswith(fmt):  # MindSpore's test: "xckpt" keeps its name, "x.CKPT" gets ".ckpt"
        path = f"{path}.{fmt}"
    if os.path.isdir(path):
        raise UsageError("ckpt_file_name is a directory, it must be a file name", path)
    return path


def _check_save_kwargs(fmt: str, enc_key: Any, enc_mode: Any, kwargs: dict[str, Any]) -> bool | None:
    """The keyword arguments MindSpore reads from ``**kwargs``; returns ``remove_redundancy``."""
    remove_redundancy = kwargs.pop("remove_redundancy", None)
    if remove_redundancy is not None:
        _bool(remove_redundancy, "remove_redundancy")
    incremental = kwargs.pop("incremental", False)
    global_step_num = kwargs.pop("global_step_num", None)
    for key in kwargs:
        warnings.warn(f"save_checkpoint: unknown keyword argument {key!r} ignored", stacklevel=3)
    if enc_key is not None and not isinstance(enc_key, bytes):
        raise UsageError(f"enc_key must be bytes or None, got {type(enc_key).__name__}")
    if not isinstance(enc_mode, str):
        raise UsageError(f"enc_mode must be a str, got {enc_mode!r}")
    if fmt == "safetensors":
        for what, value, default in (
            ("enc_key", enc_key, None),
            ("enc_mode", enc_mode, DEFAULT_ENC_MODE),
            ("incremental", incremental, False),
            ("global_step_num", global_step_num, None),
        ):
            if value != default:
                raise UsageError(f"with format='safetensors', {what} must keep its default {default!r}")
    elif incremental:
        raise UnsupportedError("incremental saves of MapParameters are not supported")
    return remove_redundancy


def save_checkpoint(
    save_obj: Mapping[str, Any] | list[Mapping[str, Any]],
    ckpt_file_name: str,
    integrated_save: bool = True,
    async_save: bool | str = False,
    append_dict: Mapping[str, Any] | None = None,
    enc_key: bytes | None = None,
    enc_mode: str = DEFAULT_ENC_MODE,
    choice_func: Callable[[str], Any] | None = None,
    crc_check: bool = False,
    format: str = "ckpt",
    **kwargs: Any,
) -> None:
    """``mindspore.save_checkpoint`` for numpy values: the same file name and bytes.

    ``save_obj`` is a dict ``name -> numpy array | str`` or a list of ``{"name": ..., "data": array}``;
    ``choice_func(name)`` keeps a ``save_obj`` entry when truthy (``append_dict`` entries are always
    kept, as in MindSpore). ``append_dict`` values: ``bool`` -> Bool, ``int`` -> Int64, ``float`` ->
    Float32 (all 0-d), ``str``, numpy arrays as they are. The extension ``.ckpt`` / ``.safetensors``
    is appended unless the name already ends with the format string. ``integrated_save`` and
    ``async_save`` are accepted for compatibility; the file is always written synchronously.

    Args:
        save_obj: The values: a dict ``name -> numpy array | str`` or a list of
            ``{"name": ..., "data": ...}`` dicts (a network is not accepted).
        ckpt_file_name: The output file name; ``.<format>`` is appended unless it ends with the format.
        integrated_save: Checked to be a bool, otherwise ignored (default True).
        async_save: A bool or str, checked, otherwise ignored (default False: the write is synchronous
            anyway).
        append_dict: Extra values saved after ``save_obj``, converted as above (None: none).
        enc_key: Encrypt the ``.ckpt`` with this key (None: not encrypted; only for ``format="ckpt"``).
        enc_mode: ``"AES-GCM"`` (default), ``"AES-CBC"`` or ``"SM4-CBC"``; used with ``enc_key``.
        choice_func: Keep a ``save_obj`` entry when ``choice_func(name)`` is truthy (None: keep all).
        crc_check: Write MindSpore's crc (a ``.ckpt`` trailer, or ``crc_num`` in the safetensors
            metadata); default False.
        format: ``"ckpt"`` (default) or ``"safetensors"``.
        **kwargs: ``remove_redundancy`` (a bool, recorded in the safetensors metadata),
            ``incremental`` and ``global_step_num`` as MindSpore reads them; other keywords are ignored
            with a warning.

    Returns:
        None; the file is written atomically (temporary name, then rename).

    Raises:
        UsageError: An argument of the wrong type or value, a file name that is a folder, a name
            saved twice, an int outside Int64, a str for a safetensors file, encryption options with
            ``format="safetensors"``, ``crc_check`` together with ``enc_key``, a bad key length or mode.
        UnsupportedError: A network as ``save_obj``, or ``incremental=True``.

    Example:
        import numpy as np
        from reshard import mindspore as ms
        ms.save_checkpoint({"w": np.ones((2, 3), np.float32)}, "net.ckpt", append_dict={"epoch": 3})
        ms.save_checkpoint({"w": np.ones((2, 3), np.float32)}, "net", format="safetensors", crc_check=True)
    """
    fmt = _format(format)
    _bool(integrated_save, "integrated_save")
    if not isinstance(async_save, (bool, str)):
        raise UsageError(f"async_save must be a bool or str, got {type(async_save).__name__}")
    _bool(crc_check, "crc_check")
    choice = _callable(choice_func, "choice_func")
    remove_redundancy = _check_save_kwargs(fmt, enc_key, enc_mode, dict(kwargs))
    path = _save_name(ckpt_file_name, fmt)
    items = [(n, _save_value(n, v)) for n, v in _save_items(save_obj) if choice is None or choice(n)]
    if append_dict is not None:
        if not isinstance(append_dict, Mapping):
            raise UsageError(f"append_dict must be a dict, got {type(append_dict).__name__}")
        items += [(n, _append_value(n, v)) for n, v in append_dict.items()]
    _check_unique(items, path)
    if fmt == "ckpt":
        save_ckpt(path, items, write_crc=crc_check, enc_key=enc_key, enc_mode=enc_mode)
    else:
        _save_safetensors(path, items, remove_redundancy, write_crc=crc_check)


def _check_unique(items: Sequence[tuple[str, SaveValue]], path: str) -> None:
    seen: set[str] = set()
    for name, _ in items:
        if name in seen:
            raise UsageError(f"parameter {name!r} appears twice (save_obj and append_dict?)", path)
        seen.add(name)


def _save_safetensors(
    path: str, items: Sequence[tuple[str, SaveValue]], remove_redundancy: bool | None, *, write_crc: bool
) -> None:
    """docs/formats.md §1.11: metadata ``{"format": "ms"}`` (+ remove_redundancy, + crc over sorted names)."""
    tensors: dict[str, np.ndarray] = {}
    for name, value in items:
        if isinstance(value, str):
            raise UsageError(f"parameter {name!r} is a str; safetensors files cannot hold strings", path)
        tensors[name] = np.asarray(value, order="C")  # keeps 0-d (ascontiguousarray makes it 1-d)
    if not tensors:
        save_safetensors(path, {}, None)  # MindSpore writes an empty dict without metadata
        return
    meta = dict([META_FORMAT])
    if remove_redundancy is not None:
        meta[META_REMOVE_REDUNDANCY] = str(remove_redundancy)
    if write_crc:
        meta[META_CRC] = str(_tensor_crc(sorted(tensors.items())))
    save_safetensors(path, tensors, meta)


def _tensor_crc(items: Iterable[tuple[str, np.ndarray]]) -> int:
    """MindSpore's safetensors crc: crc32 over ``name.encode()`` then the raw bytes, per tensor."""
    crc = 0
    for name, array in items:
        crc = zlib.crc32(name.encode("utf-8"), crc)
        crc = zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data, crc)
    return crc


# --------------------------------------------------------------------------------------------
# load_checkpoint (docs/formats.md §1.9, §1.11)


def _prefixes(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = (value,)
    elif isinstance(value, (list, tuple)):
        if not value:
            raise UsageError("specify_prefix / filter_prefix must not be an empty list or tuple")
    else:
        raise UsageError(
            f"specify_prefix / filter_prefix must be a str or a list/tuple of str, got {type(value).__name__}"
        )
    for item in value:
        if not isinstance(item, str):
            raise UsageError(f"specify_prefix / filter_prefix entries must be str, got {item!r}")
        if not item:
            raise UsageError("specify_prefix / filter_prefix must not contain ''")
    return tuple(value)


def _selector(
    specify: tuple[str, ...] | None, filtered: tuple[str, ...] | None, choice: Callable[[str], Any] | None
) -> Callable[[str], bool]:
    """MindSpore's rule: prefixes when any is given (choice_func then ignored), else choice_func."""
    if specify is not None or filtered is not None:
        return lambda name: (
            (specify is None or name.startswith(specify)) and not (filtered is not None and name.startswith(filtered))
        )
    if choice is not None:
        return lambda name: bool(choice(name))
    return lambda name: True


def _ckpt_kind(path: str) -> str:
    """``encrypted``, ``crc`` (plain, ends with ``crc_num`` + 10 digits) or ``plain``."""
    try:
        probe = probe_ckpt(path)
    except OSError as exc:
        raise UsageError(f"cannot read: {exc.strerror}", path) from None
    return "encrypted" if probe.cipher is not None else "crc" if probe.crc_trailer else "plain"


def _open_for_load(path: str, fmt: str, dec_key: Any, dec_mode: Any, verify_crc: bool) -> TensorIndex:
    if fmt == "safetensors":
        if dec_key is not None:
            raise UsageError("with format='safetensors', dec_key must be None", path)
        index = read_safetensors(path)
        if verify_crc and META_CRC in index.metadata:
            _check_safetensors_crc(index)
        return index
    if dec_key is not None and not isinstance(dec_key, bytes):
        raise UsageError(f"dec_key must be bytes or None, got {type(dec_key).__name__}")
    kind = _ckpt_kind(path)
    if verify_crc and kind != "crc":  # MindSpore only warns; encrypted files never carry a real crc
        warnings.warn(f"{path}: crc_check=True but the file has no crc trailer ({kind}); not checked", stacklevel=3)
        verify_crc = False
    return read_ckpt(path, verify_crc=verify_crc, dec_key=dec_key, dec_mode=dec_mode)


def _check_safetensors_crc(index: TensorIndex) -> None:
    try:
        stored = int(index.metadata[META_CRC])
    except ValueError:
        raise FormatError(f"metadata crc_num {index.metadata[META_CRC]!r} is not a number", index.path) from None
    actual = _tensor_crc((name, index.array(name)) for name in sorted(index.entries))
    if stored != actual:
        raise IntegrityError(f"crc mismatch: metadata says {stored}, content has {actual}", index.path)


def _loaded(index: TensorIndex, name: str) -> LoadedValue:
    value = index.value(name)
    return value if isinstance(value, str) else np.array(value)  # an owned copy: the map closes


def load_checkpoint(
    ckpt_file_name: str,
    net: Any = None,
    strict_load: bool = False,
    filter_prefix: str | Sequence[str] | None = None,
    dec_key: bytes | None = None,
    dec_mode: str = DEFAULT_ENC_MODE,
    specify_prefix: str | Sequence[str] | None = None,
    choice_func: Callable[[str], Any] | None = None,
    crc_check: bool = False,
    remove_redundancy: bool = False,
    format: str = "ckpt",
) -> dict[str, LoadedValue]:
    """``mindspore.load_checkpoint`` without a network: ``{name: numpy array | str}``.

    Order as MindSpore: file order for ``.ckpt``, sorted names for ``.safetensors``. A name is
    kept if it starts with one of ``specify_prefix`` and with none of ``filter_prefix``; only when
    both are None, ``choice_func(name)`` (truthy) decides. ``strict_load`` and
    ``remove_redundancy`` only matter when loading into a network (MindSpore ignores the first and
    checks the type of the second here; so do we).

    Args:
        ckpt_file_name: The checkpoint file; it must end with ``format``.
        net: Must be None (there are no networks without MindSpore).
        strict_load: Ignored, as MindSpore does without a network (default False).
        filter_prefix: A str or list of str: names starting with one are left out (None: none).
        dec_key: Decrypt an encrypted ``.ckpt`` with this key (None: not encrypted).
        dec_mode: The mode of ``dec_key``: ``"AES-GCM"`` (default), ``"AES-CBC"`` or ``"SM4-CBC"``.
        specify_prefix: A str or list of str: only names starting with one are kept (None: all).
        choice_func: Without prefixes, keep a name when ``choice_func(name)`` is truthy (None: all).
        crc_check: Check the crc (trailer or metadata) when the file has one; a ``.ckpt`` without a
            trailer only warns, as in MindSpore (default False).
        remove_redundancy: Checked to be a bool, otherwise ignored (default False).
        format: ``"ckpt"`` (default) or ``"safetensors"``.

    Returns:
        ``{name: numpy array | str}``, owned copies (the file is closed).

    Raises:
        UsageError: A wrong argument type, a name not ending with ``format``, a missing file,
            ``dec_key`` with safetensors, or no parameter left after the filters.
        UnsupportedError: A network given as ``net``, or a file with entries reshard does not handle.
        FormatError: The file is truncated, corrupted or not what its extension says.
        CryptoError: The file does not decrypt with ``dec_key`` / ``dec_mode``, or ``dec_key`` was given
            for a file that is not encrypted.
        IntegrityError: ``crc_check=True`` and the crc does not match.

    Example:
        from reshard import mindspore as ms
        params = ms.load_checkpoint("demo/full/model.ckpt")
        weights = ms.load_checkpoint("demo/full/model.ckpt", filter_prefix=("adam_m.", "adam_v."))
    """
    if net is not None:
        raise UnsupportedError("reshard has no networks; pass net=None and load the returned arrays")
    fmt = _format(format)
    path = _path(ckpt_file_name, "ckpt_file_name")
    for what, value in (("crc_check", crc_check), ("remove_redundancy", remove_redundancy)):
        _bool(value, what)
    if not path.endswith(fmt):
        raise UsageError(f"the checkpoint file name must end with the format {fmt!r}", path)
    if not os.path.isfile(path):
        raise UsageError("checkpoint file does not exist", path)
    keep = _selector(_prefixes(specify_prefix), _prefixes(filter_prefix), _callable(choice_func, "choice_func"))
    with _open_for_load(path, fmt, dec_key, dec_mode, crc_check) as index:
        names = sorted(index.entries) if fmt == "safetensors" else list(index.entries)
        result = {name: _loaded(index, name) for name in names if keep(name)}
    if not result:
        raise UsageError("no parameters left after specify_prefix / filter_prefix / choice_func", path)
    return result


# --------------------------------------------------------------------------------------------
# ckpt_to_safetensors / safetensors_to_ckpt (docs/formats.md §5)


def _convert(to: str, file_path: Any, save_path: Any, name_map: Any, file_name_regex: Any, processes_num: Any) -> None:
    src = _path(file_path, "file_path")
    dst = _optional_path(save_path, "save_path")
    if dst is not None and os.path.splitext(dst)[1]:
        raise UsageError("save_path must be a directory (no file extension)", dst)
    names = _name_map(name_map)
    if file_name_regex is not None:
        if not isinstance(file_name_regex, str):
            raise UsageError(f"file_name_regex must be a str, got {type(file_name_regex).__name__}")
        try:
            pattern = re.compile(file_name_regex)
        except re.error as exc:
            raise UsageError(f"file_name_regex {file_name_regex!r} is not a valid regular expression: {exc}") from None
        if os.path.isfile(src) and not pattern.findall(src):
            raise UsageError(f"the input file does not match file_name_regex {file_name_regex!r}", src)
    run = _workers(processes_num, "processes_num")
    if not os.path.exists(src):
        raise UsageError("file_path does not exist", src)
    api.convert(
        src,
        dst,
        to,
        name_map=names,
        file_regex=file_name_regex,
        run=run,
        destination=api.Destination(manifest=WRITE_MANIFEST),
    )


def ckpt_to_safetensors(
    file_path: str,
    save_path: str | None = None,
    name_map: Mapping[str, str] | None = None,
    file_name_regex: str | None = None,
    processes_num: int = 1,
) -> None:
    """``mindspore.ckpt_to_safetensors``: a ``.ckpt`` file, or every ``.ckpt`` of the ``rank*`` folders.

    Outputs replace every ``.ckpt`` in the file name by ``.safetensors`` and go to ``save_path``
    (same ``rank*`` sub-folder names) or next to the inputs. ``processes_num`` is checked (an int
    >= 1) but does not size reshard's IO threads.

    Args:
        file_path: A ``.ckpt`` file, or a folder of ``rank*`` folders.
        save_path: The output folder (None: next to the inputs); not a file name.
        name_map: Output name -> name in the checkpoint (None: names kept).
        file_name_regex: Only inputs whose name matches (None: all).
        processes_num: An int >= 1, checked for compatibility; it does not size reshard's IO threads (the
            CLI's default worker count is used).

    Returns:
        None.

    Raises:
        UsageError: A wrong argument, a ``save_path`` with a file extension, an invalid or
            non-matching ``file_name_regex``, a missing ``file_path``, or outputs that exist already.
        FormatError: A source or strategy file is truncated, corrupted or not what it claims.
        IntegrityError: A ``.ckpt`` source's crc trailer does not match its content.
        UnsupportedError: A source holds entries reshard deliberately does not handle (``MapTensor``).
        ReshardError: An output cannot be written (a full disk, say); what the run wrote is removed.

    Example:
        from reshard import mindspore as ms
        ms.ckpt_to_safetensors("demo/ckpt_8ranks", "st_8ranks")
        ms.ckpt_to_safetensors("demo/full/model.ckpt", "full_st")
    """
    _convert("safetensors", file_path, save_path, name_map, file_name_regex, processes_num)


def safetensors_to_ckpt(
    file_path: str,
    save_path: str | None = None,
    name_map: Mapping[str, str] | None = None,
    file_name_regex: str | None = None,
    processes_num: int = 1,
) -> None:
    """``mindspore.safetensors_to_ckpt``: the mirror of ``ckpt_to_safetensors`` (parameters sorted).

    Args:
        file_path: A ``.safetensors`` file, or a folder of ``rank*`` folders.
        save_path: The output folder (None: next to the inputs); not a file name.
        name_map: Output name -> name in the checkpoint (None: names kept).
        file_name_regex: Only inputs whose name matches (None: all).
        processes_num: An int >= 1, checked for compatibility; it does not size reshard's IO threads (the
            CLI's default worker count is used).

    Returns:
        None.

    Raises:
        UsageError: A wrong argument, a ``save_path`` with a file extension, an invalid or
            non-matching ``file_name_regex``, a missing ``file_path``, or outputs that exist already.
        FormatError: A source file is truncated, corrupted or not what it claims.
        UnsupportedError: A source holds entries reshard deliberately does not handle.

    Example:
        from reshard import mindspore as ms
        ms.safetensors_to_ckpt("demo/st_8ranks", "ckpt_8ranks")
    """
    _convert("ckpt", file_path, save_path, name_map, file_name_regex, processes_num)


# --------------------------------------------------------------------------------------------
# strategy files (docs/formats.md §2.4, §2.5, §3.7)


def merge_pipeline_strategys(src_strategy_dirs: str, dst_strategy_file: str) -> None:
    """``mindspore.merge_pipeline_strategys``: merge the per-stage files of a folder (docs/formats.md §2.5).

    Files are merged in the folder's listing order, as MindSpore's ``glob`` does (the order decides
    the item order of the merged file and, for JSON, which stage's operator entries win).

    Args:
        src_strategy_dirs: The folder of per-stage strategy files (``.ckpt`` protobuf or ``.json``).
        dst_strategy_file: The merged file; it ends with ``.json`` exactly when the sources are JSON.

    Returns:
        None; the merged file is written atomically.

    Raises:
        UsageError: ``src_strategy_dirs`` is not a folder or holds no strategy files,
            ``dst_strategy_file`` is a folder or has the wrong extension, a file cannot be written,
            or a per-stage file's parameter names hold ``-``.
        FormatError: A strategy file cannot be parsed, or the files mix formats.

    Example:
        from reshard import mindspore as ms
        ms.merge_pipeline_strategys("demo/strategy_8", "merged/src_strategy.ckpt")
    """
    src = _path(src_strategy_dirs, "src_strategy_dirs")
    if not os.path.isdir(src):
        raise UsageError("src_strategy_dirs is not a directory", src)
    dst = _path(dst_strategy_file, "dst_strategy_file")
    if os.path.isdir(dst):
        raise UsageError("dst_strategy_file is a directory", dst)
    files = find_strategy_files(src, exclude=dst)  # validated candidates (sorted)
    listing = {name: i for i, name in enumerate(os.listdir(src))}
    files.sort(key=lambda f: listing.get(os.path.basename(f), len(listing)))
    fmt, data = merge_strategy_files(files)
    if format_of(dst) != fmt:
        raise UsageError(f"the merged {fmt} strategy file must {'' if fmt == JSON else 'not '}end with .json", dst)
    _write_plain(dst, data)


def _write_plain(path: str, data: bytes) -> None:
    """Atomically, with the permissions of a plain ``open(path, "wb")``."""
    try:
        write_whole(path, data)
    except OSError as exc:
        raise UsageError(f"cannot write: {exc.strerror}", path) from None


def build_searched_strategy(strategy_filename: str) -> dict[str, Any]:
    """``mindspore.build_searched_strategy``: ``{name: ParallelLayouts message}`` as MindSpore builds it.

    Protobuf files give their stored messages; JSON files one message per layout (one DevMatrix,
    TensorMap, ParamSplitShape and IndicesOffset), as MindSpore converts them. The messages come
    from reshard's own ``node_strategy.proto`` classes (same fields, same bytes).

    Args:
        strategy_filename: A strategy file (protobuf ``.ckpt`` or ``.json``; merged or one stage).

    Returns:
        ``{parameter name: ParallelLayouts}`` protobuf messages, in the file's order.

    Raises:
        UsageError: No such file, or an empty one.
        FormatError: The file cannot be parsed as a strategy.
        LayoutError: A JSON file's layout cannot be stored as a protobuf message (an empty tensor map entry).

    Example:
        from reshard import mindspore as ms
        layouts = ms.build_searched_strategy("demo/merged/src_strategy.ckpt")
        dev_matrix = list(next(iter(layouts.values())).dev_matrix[0].dim)
    """
    path = _strategy_file(strategy_filename, "strategy_filename")
    sf = read_strategy(path)  # validates and gives one-line errors
    if format_of(path) == PROTOBUF:
        with open(path, "rb") as fh:
            data = fh.read()
    else:
        data = encode_strategy(sf, PROTOBUF)
    message: Any = message_classes()["ParallelStrategyMap"]()  # built at run time: no static attributes
    message.ParseFromString(data)
    return {item.param_name: item.parallel_layouts for item in message.parallel_layout_item}


def rank_list_for_transform(
    rank_id: int, src_strategy_file: str | None = None, dst_strategy_file: str | None = None
) -> list[int]:
    """``mindspore.rank_list_for_transform``: source ranks destination ``rank_id`` needs, descending.

    Args:
        rank_id: The destination rank (an int >= 0, within the destination strategy's ranks).
        src_strategy_file: The source strategy file (None: a full model, so ``[0]``).
        dst_strategy_file: The destination strategy file (None: a full model).

    Returns:
        The source ranks, descending (MindSpore's order).

    Raises:
        UsageError: A bad ``rank_id`` or one out of range, or a missing or empty strategy file.
        FormatError: A strategy file cannot be parsed.
        LayoutError: The two strategies' layouts do not fit each other.

    Example:
        from reshard import mindspore as ms
        ranks = ms.rank_list_for_transform(0, "demo/merged/src_strategy.ckpt", "demo/merged/dst_strategy.ckpt")
    """
    _int(rank_id, "rank_id", minimum=0)
    if src_strategy_file is None:
        return [0]
    src = _optional_strategy(src_strategy_file, "src_strategy_file")
    dst = _optional_strategy(dst_strategy_file, "dst_strategy_file")
    rank = _rank(rank_id, _rank_bound(src, dst))
    return [int(r) for r in api.needed_ranks(rank, src, dst)]


# --------------------------------------------------------------------------------------------
# transform_checkpoints / transform_checkpoint_by_rank (docs/formats.md §3.8, §3.9, §4.2)


def _model_names(sf: StrategyFile) -> set[str]:
    """The strategy's parameter names without optimizer states (``accu_grads``/``adam_v``/``adam_m`` prefixes)."""
    return {n for n in layout_map(sf) if not n.startswith(REDUNDANT_STATE_PREFIXES)}


def _is_by_stage(src: StrategyFile | None, dst: StrategyFile | None) -> bool:
    """MindSpore's by-stage test: two single-stage strategies whose names, optimizer states left
    out on *both* sides, are a strict subset (source) of the destination's. A destination that
    only adds optimizer states is the all-stage mode (``{prefix}{r}.ckpt``)."""
    if src is None or dst is None or stage_count(src) != 1 or stage_count(dst) != 1:
        return False
    return _model_names(src) < _model_names(dst)


def _plan_by_stage(src_dir: str, dst_dir: str, prefix: str, src: StrategyFile, dst: StrategyFile) -> list[Plan]:
    """``_transform_checkpoint_by_stage``: one pipeline stage's ranks -> ``{prefix}{k}_part{stage}.ckpt``.

    The source strategy is one stage of a pipelined job; its ranks are the folders
    ``rank_{stage * n_src + i}`` (local rank ``i``). Every destination rank gets that stage's
    parameters; sources are read in descending rank order, as in the all-stage mode.
    """
    from reshard.sources.replicas import check_replicas

    stage = src.stage or 0
    n_src = device_num(src)
    _, chosen = layout_dir.collect_rank_files(src_dir, "ckpt")
    wanted = range(stage * n_src, (stage + 1) * n_src)
    missing = [r for r in wanted if r not in chosen]
    if missing:
        raise UsageError(f"stage {stage} needs the checkpoints of ranks {missing}, which are missing", src_dir)
    sources = {r - stage * n_src: api.source_file(chosen[r].path, r) for r in reversed(wanted)}
    check_replicas(sources, src)  # the copies the layout calls replicas hold the same bytes
    total = device_num(dst) * stage_count(dst)
    return [
        plan_transform_by_rank(
            rank, sources, layout_dir.rank_output(dst_dir, rank, prefix, "ckpt", part=stage), src, dst
        )
        for rank in range(total)
    ]


def _source_format(src_dir: str) -> str:
    if not os.path.isdir(src_dir):
        raise UsageError("src_checkpoints_dir does not exist or is not a directory", src_dir)
    fmt, chosen = layout_dir.collect_rank_files(src_dir)
    if not chosen:
        raise UsageError("src_checkpoints_dir holds no checkpoints in rank_<r> folders", src_dir)
    return fmt


def transform_checkpoints(
    src_checkpoints_dir: str,
    dst_checkpoints_dir: str,
    ckpt_prefix: str,
    src_strategy_file: str | None = None,
    dst_strategy_file: str | None = None,
    process_num: int = 1,
    output_format: str = "ckpt",
) -> None:
    """``mindspore.transform_checkpoints``: ``dst/rank_<r>/{ckpt_prefix}{r}.{fmt}`` for every destination rank.

    ``.ckpt`` sources allow only ``output_format="ckpt"``; ``.safetensors`` sources either. Two
    single-stage strategies where the source's names are a strict subset of the destination's
    select MindSpore's by-stage mode (``{prefix}{r}_part{stage}.ckpt``). Existing files of the same
    names are replaced (MindSpore writes into an existing folder too); nothing else is touched.

    Args:
        src_checkpoints_dir: The folder of ``rank_<r>`` folders.
        dst_checkpoints_dir: The output folder (created if missing).
        ckpt_prefix: The output file name prefix; no path separators, ``..`` or blanks.
        src_strategy_file: The source's (merged) strategy file (None: the source is one full model
            in ``rank_0``).
        dst_strategy_file: The destination strategy file (None: one full model).
        process_num: An int >= 1, checked for compatibility; it does not size reshard's IO threads (the
            CLI's default worker count is used).
        output_format: ``"ckpt"`` (default) or ``"safetensors"``.

    Returns:
        None.

    Raises:
        UsageError: A wrong argument, an unsafe prefix, a source folder without rank folders, several
            rank folders without ``src_strategy_file``, safetensors output from ``.ckpt`` sources, a
            missing source rank, or a destination inside the source or held by another run.
        LayoutError: Both strategies None, or a strategy that does not fit the tensors.
        FormatError: A source or strategy file is truncated, corrupted or not what it claims.
        IntegrityError: A ``.ckpt`` source's crc trailer does not match its content.
        UnsupportedError: A source holds entries reshard deliberately does not handle (``MapTensor``).
        ReshardError: An output cannot be written (a full disk, say); what the run wrote is removed.

    Example:
        from reshard import mindspore as ms
        ms.transform_checkpoints("demo/ckpt_8ranks", "ckpt_4ranks", "checkpoint_",
                                 "demo/merged/src_strategy.ckpt", "demo/merged/dst_strategy.ckpt")
    """
    src_dir = _path(src_checkpoints_dir, "src_checkpoints_dir")
    dst_dir = _path(dst_checkpoints_dir, "dst_checkpoints_dir")
    prefix = _check_prefix(ckpt_prefix)
    out_fmt = _format(output_format, "output_format")
    run = _workers(process_num, "process_num")
    fmt = _source_format(src_dir)
    if fmt == "ckpt" and out_fmt == "safetensors":
        raise UsageError("output_format='safetensors' needs .safetensors sources; this folder holds .ckpt", src_dir)
    src = _optional_strategy(src_strategy_file, "src_strategy_file")
    dst = _optional_strategy(dst_strategy_file, "dst_strategy_file")
    if src is None and len(layout_dir.rank_dirs(src_dir)) > 1:
        raise UsageError(
            "src_strategy_file is None but src_checkpoints_dir holds several rank folders: pass their "
            "strategy as src_strategy_file",
            src_dir,
        )
    if fmt == "ckpt" and _is_by_stage(src, dst):
        assert src is not None and dst is not None
        plans = _plan_by_stage(src_dir, dst_dir, prefix, src, dst)  # every plan before any write
        api.check_destination(dst_dir, [src_dir], overwrite=True)
        for plan in plans:
            api.execute(plan, run=run, root=dst_dir, manifest=WRITE_MANIFEST)
        return
    _refuse_no_strategy(src, dst)
    api.transform(
        src_dir,
        dst_dir,
        src,
        dst,
        run=run,
        output=api.OutputSpec(prefix=prefix, format=out_fmt),
        destination=api.Destination(overwrite=True, manifest=WRITE_MANIFEST),
    )


def transform_checkpoint_by_rank(
    rank_id: int,
    checkpoint_files_map: Mapping[int, str],
    save_checkpoint_file_name: str,
    src_strategy_file: str | None = None,
    dst_strategy_file: str | None = None,
) -> None:
    """``mindspore.transform_checkpoint_by_rank``: write destination ``rank_id``'s ``.ckpt`` only.

    ``checkpoint_files_map`` maps source ranks (ints) to their ``.ckpt`` files; files are read in
    the map's order, as MindSpore does.

    Args:
        rank_id: The destination rank (an int >= 0, within the destination strategy's ranks).
        checkpoint_files_map: Source rank -> its ``.ckpt`` file (the ranks
            ``rank_list_for_transform`` names).
        save_checkpoint_file_name: The output file; it must end with ``.ckpt``.
        src_strategy_file: The source strategy file (None: a full model).
        dst_strategy_file: The destination strategy file (None: a full model).

    Returns:
        None.

    Raises:
        UsageError: A wrong argument, a missing source file or strategy file, an output name not
            ending with ``.ckpt``, ``rank_id`` out of range, or a needed source rank not in the map.
        LayoutError: Both strategies None, or a strategy that does not fit the tensors.
        FormatError: A source or strategy file is truncated, corrupted or not what it claims.
        IntegrityError: A ``.ckpt`` source's crc trailer does not match its content.
        UnsupportedError: A source holds entries reshard deliberately does not handle (``MapTensor``).
        ReshardError: An output cannot be written (a full disk, say); what the run wrote is removed.

    Example:
        from reshard import mindspore as ms
        src, dst = "demo/merged/src_strategy.ckpt", "demo/merged/dst_strategy.ckpt"
        ranks = ms.rank_list_for_transform(0, src, dst)
        files = {r: f"demo/ckpt_8ranks/rank_{r}/checkpoint_{r}.ckpt" for r in ranks}
        ms.transform_checkpoint_by_rank(0, files, "rank_0/checkpoint_0.ckpt", src, dst)
    """
    if not isinstance(checkpoint_files_map, Mapping):
        raise UsageError(f"checkpoint_files_map must be a dict, got {type(checkpoint_files_map).__name__}")
    files: dict[int, str] = {}
    for key, value in checkpoint_files_map.items():
        rank = _int(key, "checkpoint_files_map keys (source ranks)", minimum=0)
        path = _path(value, f"checkpoint_files_map[{rank}]")
        if not os.path.isfile(path):
            raise UsageError(f"checkpoint file of source rank {rank} does not exist", path)
        files[rank] = path
    out = _path(save_checkpoint_file_name, "save_checkpoint_file_name")
    if not out.endswith(".ckpt"):
        raise UsageError("save_checkpoint_file_name must end with .ckpt", out)
    src = _optional_strategy(src_strategy_file, "src_strategy_file")
    dst = _optional_strategy(dst_strategy_file, "dst_strategy_file")
    _refuse_no_strategy(src, dst)
    rank = _rank(rank_id, _rank_bound(None, dst))
    api.transform_by_rank(rank, files, out, src, dst, destination=api.Destination(manifest=WRITE_MANIFEST))


def _refuse_no_strategy(src: StrategyFile | None, dst: StrategyFile | None) -> None:
    """MindSpore refuses a transform without any strategy (reshard's own transform copies the model)."""
    if src is None and dst is None:
        raise LayoutError(
            "none of the checkpoint's parameters is in the source or destination strategy (both strategies are None)"
        )


# --------------------------------------------------------------------------------------------
# unified_safetensors / load_distributed_checkpoint (docs/formats.md §4.1, §4.3)


def _split_dst_file(value: Any) -> tuple[int, int] | tuple[()]:
    if value is None or (isinstance(value, (tuple, list)) and len(value) == 0):
        return ()
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise UsageError(f"split_dst_file must be () or (index, count), got {value!r}")
    index = _int(value[0], "split_dst_file index", minimum=1)
    count = _int(value[1], "split_dst_file count", minimum=1)
    if index > count:
        raise UsageError(f"split_dst_file index {index} is larger than the count {count}")
    return index, count


def unified_safetensors(
    src_dir: str,
    src_strategy_file: str,
    dst_dir: str,
    merge_with_redundancy: bool = True,
    file_suffix: str | None = None,
    max_process_num: int = DEFAULT_MAX_PROCESS_NUM,
    choice_func: Callable[[str], bool | str] | None = None,
    split_dst_file: tuple[int, int] | tuple[()] = (),
) -> None:
    """``mindspore.unified_safetensors``: full tensors in ``part<j>.safetensors`` + index + hyper params.

    ``choice_func(name)`` returning False moves a parameter to ``hyper_param.safetensors``, a str
    renames it (MindSpore's rules, docs/formats.md §4.1). Sources saved without redundant copies
    (``remove_redundancy=True``) work whatever ``merge_with_redundancy`` says: a slice missing from
    one rank is read from another rank of its redundancy group.

    Args:
        src_dir: The folder of ``rank_<r>`` folders holding ``.safetensors`` files.
        src_strategy_file: Their (merged) strategy file.
        dst_dir: The output folder: ``part<j>.safetensors``, ``param_name_map.json`` and
            ``hyper_param.safetensors``.
        merge_with_redundancy: Checked to be a bool; either value works (default True).
        file_suffix: Read the file of each rank folder whose name ends with this (None: MindSpore's
            rule for choosing one).
        max_process_num: An int >= 1, checked for compatibility; it does not size reshard's IO
            threads (default 64).
        choice_func: False moves a parameter to ``hyper_param.safetensors``, a str renames it (None:
            every parameter kept as named).
        split_dst_file: ``(index, count)``: write only part ``index`` of ``count`` (default ``()``: all).

    Returns:
        None.

    Raises:
        UsageError: A wrong argument, ``src_dir`` a file or not rank folders of ``.safetensors``,
            a missing or empty strategy file, a ``split_dst_file`` that selects no part, or a
            destination inside the source or held by another run.
        LayoutError: The strategy does not fit the tensors or the rank folders.
        FormatError: A source or strategy file is truncated, corrupted or not what it claims.
        UnsupportedError: A source holds entries reshard deliberately does not handle.
        ReshardError: An output cannot be written (a full disk, say); what the run wrote is removed.

    Example:
        from reshard import mindspore as ms
        ms.unified_safetensors("demo/st_8ranks", "demo/merged/src_strategy.ckpt", "unified")
    """
    src = _path(src_dir, "src_dir")
    if os.path.isfile(src):
        raise UsageError("src_dir must be a folder of rank_<r> folders, not a file", src)
    strategy = _strategy_file(src_strategy_file, "src_strategy_file")
    dst = _path(dst_dir, "dst_dir")
    _bool(merge_with_redundancy, "merge_with_redundancy")
    if file_suffix is not None and not isinstance(file_suffix, str):
        raise UsageError(f"file_suffix must be a str or None, got {file_suffix!r}")
    run = _workers(max_process_num, "max_process_num")
    choice = _callable(choice_func, "choice_func")
    split = _split_dst_file(split_dst_file)
    report = api.unify(
        src,
        strategy,
        dst,
        file_suffix=file_suffix,
        choice_func=choice,
        split_dst_file=split,
        mindspore_order=True,  # folder listing order decides bin packing ties and the index order
        dry_run=True,
    )
    if split and not report.plan.files and not report.plan.texts:
        raise UsageError(f"split_dst_file {split} selects none of the model's parts (MindSpore fails here too)")
    api.check_destination(dst, [src], overwrite=True)
    api.execute(report.plan, run=run, root=dst, manifest=WRITE_MANIFEST)


_UNUSED_DST = "__reshard_not_written__"  # plan paths of return_param_dict: never written


def _materialize(plan: Plan, file: FilePlan) -> dict[str, LoadedValue]:
    """The tensors of one planned file as owned numpy arrays (no file written)."""
    opened: dict[int, TensorIndex] = {}

    def source_array(source: int, tensor: str) -> np.ndarray:
        return _index(opened, plan, source).array(tensor)

    try:
        result: dict[str, LoadedValue] = {}
        for t in file.tensors:
            if t.literal is not None and t.dtype is dtypes.STR:
                result[t.name] = decode_string(t.literal)
            elif t.dtype is dtypes.STR:
                c = t.copies[0]
                result[t.name] = str(_index(opened, plan, c.source).value(c.tensor))
            else:
                result[t.name] = assemble.full_tensor(t, source_array)
        return result
    finally:
        for index in opened.values():
            index.close()


def _index(opened: dict[int, TensorIndex], plan: Plan, source: int) -> TensorIndex:
    if source not in opened:
        opened[source] = api.open_checkpoint(plan.sources[source])
    return opened[source]


def _check_legacy_arguments(
    checkpoint_filenames: Any, train_strategy_filename: Any, strict_load: Any, dec_key: Any, dec_mode: Any
) -> None:
    for what, value in (
        ("checkpoint_filenames", checkpoint_filenames),
        ("train_strategy_filename", train_strategy_filename),
        ("dec_key", dec_key),
    ):
        if value is not None:
            raise UsageError(f"{what} must be None with format='safetensors'")
    if strict_load is not False or dec_mode != DEFAULT_ENC_MODE:
        raise UsageError("strict_load and dec_mode must keep their defaults with format='safetensors'")


def load_distributed_checkpoint(
    network: Any,
    checkpoint_filenames: Sequence[str] | None = None,
    predict_strategy: str | None = None,
    train_strategy_filename: str | None = None,
    strict_load: bool = False,
    dec_key: bytes | None = None,
    dec_mode: str = DEFAULT_ENC_MODE,
    format: str = "ckpt",
    unified_safetensors_dir: str | None = None,
    dst_safetensors_dir: str | None = None,
    rank_id: int | None = None,
    output_format: str = "safetensors",
    name_map: Mapping[str, str] | None = None,
    max_process_num: int = DEFAULT_MAX_PROCESS_NUM,
    return_param_dict: bool = False,
) -> dict[str, LoadedValue] | None:
    """``mindspore.load_distributed_checkpoint`` without a network (docs/formats.md §4.3).

    Save mode (``network=None``, ``format="safetensors"``): slice the unified model of
    ``unified_safetensors_dir`` for ``predict_strategy`` into ``dst_safetensors_dir/rank_<r>/net.<fmt>``
    for ``rank_id`` or every rank. With ``return_param_dict=True`` and a ``rank_id`` the rank's
    tensors are returned as ``{name: numpy array}`` (sorted names) — a framework-free load; files
    are then only written if ``dst_safetensors_dir`` is given.

    Args:
        network: Must be None (there are no networks without MindSpore).
        checkpoint_filenames: Must be None (the legacy ``.ckpt`` path is not supported).
        predict_strategy: The destination strategy file (required).
        train_strategy_filename: Must be None.
        strict_load: Must keep its default False.
        dec_key: Must be None.
        dec_mode: Must keep its default ``"AES-GCM"``.
        format: Must be ``"safetensors"`` (the default ``"ckpt"`` is refused).
        unified_safetensors_dir: The unified model (``unified_safetensors``'s output, or a Hugging
            Face model); required.
        dst_safetensors_dir: The output folder (None: nothing written; then ``return_param_dict``).
        rank_id: Only this destination rank (None: every rank).
        output_format: ``"safetensors"`` (default) or ``"ckpt"``.
        name_map: Output name -> name in the unified model (None: names kept).
        max_process_num: An int >= 1, checked for compatibility; it does not size reshard's IO
            threads (default 64).
        return_param_dict: Return ``rank_id``'s tensors instead of (or besides) writing them.

    Returns:
        ``{name: numpy array | str}`` of ``rank_id`` with ``return_param_dict=True``; None otherwise.

    Raises:
        UnsupportedError: A network, ``format="ckpt"``, or a missing or non-path ``predict_strategy``.
        UsageError: A legacy argument not at its default, no ``unified_safetensors_dir``, a wrong
            argument, ``rank_id`` out of range, ``return_param_dict`` without ``rank_id``, no
            ``dst_safetensors_dir`` without ``return_param_dict``, or a refused destination.
        LayoutError: The strategy does not fit the tensors.
        FormatError: A unified file or the strategy is truncated, corrupted or not what it claims.

    Example:
        from reshard import mindspore as ms
        ms.unified_safetensors("demo/st_8ranks", "demo/merged/src_strategy.ckpt", "unified")
        params = ms.load_distributed_checkpoint(None, predict_strategy="demo/merged/dst_strategy.ckpt",
                                                format="safetensors", unified_safetensors_dir="unified",
                                                rank_id=0, return_param_dict=True)
    """
    if network is not None:
        raise UnsupportedError(
            "reshard has no networks; pass network=None with dst_safetensors_dir "
            "(or return_param_dict=True and rank_id) and load the arrays yourself"
        )
    if format != "safetensors":
        raise UnsupportedError(
            "only format='safetensors' is supported: the legacy .ckpt path needs a network "
            "and a communication context; use transform_checkpoints instead"
        )
    _check_legacy_arguments(checkpoint_filenames, train_strategy_filename, strict_load, dec_key, dec_mode)
    if unified_safetensors_dir is None:
        raise UsageError("unified_safetensors_dir is required with format='safetensors'")
    unified = _path(unified_safetensors_dir, "unified_safetensors_dir")
    out_fmt = _format(output_format, "output_format")
    names = _name_map(name_map)
    run = _workers(max_process_num, "max_process_num")
    _bool(return_param_dict, "return_param_dict")
    if predict_strategy is None:
        raise UnsupportedError("predict_strategy is required: give the destination strategy file")
    if not isinstance(predict_strategy, (str, os.PathLike)):
        raise UnsupportedError("predict_strategy must be a strategy file path (layout dicts are not supported)")
    strategy = read_strategy(_strategy_file(predict_strategy, "predict_strategy"))
    rank = None if rank_id is None else _rank(rank_id, _rank_bound(None, strategy))
    dst = _optional_path(dst_safetensors_dir, "dst_safetensors_dir")
    ranks = None if rank is None else [rank]
    if return_param_dict and rank is None:
        raise UsageError("return_param_dict=True needs rank_id: the tensors of which rank?")
    if not return_param_dict and dst is None:
        raise UsageError("dst_safetensors_dir is required when network is None")
    plan = _split_plan(unified, strategy, dst or os.path.join(unified, _UNUSED_DST), ranks, out_fmt, names)
    if dst is not None:
        api.check_destination(dst, [unified], overwrite=True)
        api.execute(plan, run=run, root=dst, manifest=WRITE_MANIFEST)
    return _materialize(plan, plan.files[0]) if return_param_dict else None


def _split_plan(
    unified: str,
    strategy: StrategyFile,
    dst: str,
    ranks: Sequence[int] | None,
    output_format: str,
    name_map: Mapping[str, str] | None,
) -> Plan:
    """``plan_split`` over the unified folder (MindSpore's name lookup and dict order are in the plan)."""
    files, index, hyper = api.unified_index(unified, name_map)
    return plan_split(files, index, hyper, strategy, dst, output_format, ranks, name_map)


__all__ = [
    "build_searched_strategy",
    "ckpt_to_safetensors",
    "load_checkpoint",
    "load_distributed_checkpoint",
    "merge_pipeline_strategys",
    "rank_list_for_transform",
    "safetensors_to_ckpt",
    "save_checkpoint",
    "transform_checkpoint_by_rank",
    "transform_checkpoints",
    "unified_safetensors",
]
