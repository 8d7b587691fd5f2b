"""``save_checkpoint`` and ``load_checkpoint`` of ``reshard.mindspore``: numpy values in, numpy values out.

The two functions every MindSpore script calls, with MindSpore's file names, bytes and argument
rules (docs/formats.md §1.5, §1.9-§1.11), and no network: a dict of numpy arrays is saved, and a
load returns one. They are apart from the conversions (``dropin``) because they need none of the
planning machinery: ``ms.save_checkpoint`` loads numpy and the two readers, nothing else.
"""

from __future__ import annotations

import os
import warnings
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from reshard.errors import FormatError, IntegrityError, UnsupportedError, UsageError
from reshard.formats.base import TensorIndex
from reshard.formats.ckpt import probe_ckpt, read_ckpt, save_ckpt
from reshard.formats.safetensors import read_safetensors, save_safetensors
from reshard.mindspore.arguments import DEFAULT_ENC_MODE, as_bool, as_callable, as_format, as_path

# save_checkpoint stores python ints as Int64 scalars; larger ones crash MindSpore's Tensor().
_INT64 = np.iinfo(np.int64)
# Metadata keys of MindSpore's safetensors files (docs/formats.md §1.11).
META_FORMAT = ("format", "ms")
META_REMOVE_REDUNDANCY = "remove_redundancy"
META_CRC = "crc_num"

SaveValue = np.ndarray | str
LoadedValue = np.ndarray | str

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
    path = as_path(name, "ckpt_file_name")
    if not path.endswith(fmt):  # MindSpore's test: "xckpt" keeps its name, "x.CKPT" gets ".ckpt"
        path = f"{path}.{fmt}"
    if os.path.isdir(path):
        raise UsageError("ckpt_file_name is a directory, it must be a file name", path)
    return path


def _check_save_kwargs(fmt: str, enc_key: Any, enc_mode: Any, kwargs: dict[str, Any]) -> bool | None:
    """The keyword arguments MindSpore reads from ``**kwargs``; returns ``remove_redundancy``."""
    remove_redundancy = kwargs.pop("remove_redundancy", None)
    if remove_redundancy is not None:
        as_bool(remove_redundancy, "remove_redundancy")
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
    fmt = as_format(format)
    as_bool(integrated_save, "integrated_save")
    if not isinstance(async_save, (bool, str)):
        raise UsageError(f"async_save must be a bool or str, got {type(async_save).__name__}")
    as_bool(crc_check, "crc_check")
    choice = as_callable(choice_func, "choice_func")
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
    fmt = as_format(format)
    path = as_path(ckpt_file_name, "ckpt_file_name")
    for what, value in (("crc_check", crc_check), ("remove_redundancy", remove_redundancy)):
        as_bool(value, what)
    if not path.endswith(fmt):
        raise UsageError(f"the checkpoint file name must end with the format {fmt!r}", path)
    if not os.path.isfile(path):
        raise UsageError("checkpoint file does not exist", path)
    keep = _selector(_prefixes(specify_prefix), _prefixes(filter_prefix), as_callable(choice_func, "choice_func"))
    with _open_for_load(path, fmt, dec_key, dec_mode, crc_check) as index:
        names = sorted(index.entries) if fmt == "safetensors" else list(index.entries)
        result = {name: _loaded(index, name) for name in names if keep(name)}
    if not result:
        raise UsageError("no parameters left after specify_prefix / filter_prefix / choice_func", path)
    return result


__all__ = [
    "META_CRC",
    "META_FORMAT",
    "META_REMOVE_REDUNDANCY",
    "LoadedValue",
    "SaveValue",
    "load_checkpoint",
    "save_checkpoint",
]
