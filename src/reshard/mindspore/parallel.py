"""``mindspore.parallel``'s checkpoint functions, so a script switches with one import.

``from mindspore.parallel import transform_checkpoints`` becomes
``from reshard.mindspore.parallel import transform_checkpoints``; every function keeps MindSpore
2.10's name, parameters, defaults, output names and bytes (checked against MindSpore by
``tests/test_ms_parallel_oracle.py``). What is mirrored is everything MindSpore 2.10 defines in its
checkpoint modules (``mindspore.parallel.checkpoint_transform``, ``checkpoint_convert``,
``transform_safetensors``; docs/formats.md §9 lists them and what each needs):

* the functions ``mindspore.parallel`` shares with ``mindspore`` are the same objects as
  ``reshard.mindspore``'s, as in MindSpore (``transform_checkpoints``, ``load_distributed_checkpoint``,
  ``merge_sliced_parameter``, ...);
* ``convert_checkpoints``, ``convert_checkpoint_by_rank`` and ``rank_list_for_convert`` are
  MindSpore 2.10's newer names of ``transform_checkpoints``, ``transform_checkpoint_by_rank`` and
  ``rank_list_for_transform``: same arguments, same outputs (MindSpore's versions only call those);
* ``merge_sliced_parameter`` takes and returns ``reshard.mindspore.Parameter`` objects (a name and
  a numpy array; any object with ``.name`` and ``.data`` is accepted, a MindSpore ``Parameter``
  too) and reads the ``ParallelLayouts`` messages ``build_searched_strategy`` returns; bf16 slices
  merge to float32, as in MindSpore (docs/formats.md §3.4, §3.10, §9.3);
* ``load_segmented_checkpoints`` returns what ``load_checkpoint`` returns, ``{name: numpy array |
  str}``, merged over the folder's ``*.ckpt`` files in the order MindSpore's ``glob`` lists them
  (docs/formats.md §9.2);
* ``restore_group_info_list`` reads a group information file (``ParallelGroupMap``, docs/formats.md
  §2.1, §9.4);
* ``sync_pipeline_shared_parameters`` (a compiled network exchanging tensors between devices) and
  ``set_op_strategy_config`` (the auto-parallel context of a running job) raise ``UnsupportedError``.

The rest of ``mindspore.parallel`` (``shard``, ``Layout``, ``parameter_broadcast``,
``set_algo_parameters`` / ``get_algo_parameters`` / ``reset_algo_parameters``, the submodules
``nn``, ``function``, ...) configures or runs a parallel job and has no file to work on; it is not
provided. Reading one of those names, ``from reshard.mindspore.parallel import shard`` included,
raises ``UnsupportedError`` saying so and what reshard offers instead (``_NOT_PROVIDED``, through the
module's ``__getattr__``, PEP 562): Python passes an exception other than ``AttributeError`` from
it through a from-import as it is, where a missing name would give a bare ``ImportError``. A name
MindSpore does not have either still raises ``AttributeError``. The price: ``hasattr(module,
"shard")`` raises too rather than answer False; ``dir()`` does not list these names.
"""

from __future__ import annotations

import glob
import inspect
import os
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import numpy as np

from reshard import dtypes
from reshard.errors import FormatError, LayoutError, UnsupportedError, UsageError
from reshard.formats.strategy import message_classes
from reshard.layout import ParamLayout, tensor_strategy
from reshard.mindspore.arguments import DEFAULT_ENC_MODE
from reshard.mindspore.dropin import (
    build_searched_strategy,
    load_distributed_checkpoint,
    merge_pipeline_strategys,
    rank_list_for_transform,
    transform_checkpoint_by_rank,
    transform_checkpoints,
    unified_safetensors,
)
from reshard.mindspore.parameter import Parameter
from reshard.mindspore.saveload import LoadedValue, load_checkpoint

# --------------------------------------------------------------------------------------------
# the newer names (mindspore.parallel.checkpoint_convert)


def rank_list_for_convert(
    rank_id: int, src_strategy_file: str | None = None, dst_strategy_file: str | None = None
) -> list[int]:
    return rank_list_for_transform(rank_id, src_strategy_file, dst_strategy_file)


def convert_checkpoint_by_rank(
    rank_id: int,
    checkpoint_files_map: Mapping[int, str],
    save_checkpoint_file_name: str,
    src_strategy_file: str | None = None,
    dst_strategy_file: str | None = None,
) -> None:
    transform_checkpoint_by_rank(
        rank_id, checkpoint_files_map, save_checkpoint_file_name, src_strategy_file, dst_strategy_file
    )


def convert_checkpoints(
    src_checkpoints_dir: str,
    dst_checkpoints_dir: str,
    ckpt_prefix: str,
    src_strategy_file: str | None = None,
    dst_strategy_file: str | None = None,
    process_num: int = 1,
    output_format: str = "ckpt",
) -> None:
    transform_checkpoints(
        src_checkpoints_dir,
        dst_checkpoints_dir,
        ckpt_prefix,
        src_strategy_file,
        dst_strategy_file,
        process_num,
        output_format,
    )


def _renamed(original: Any, title: str, example: str) -> str:
    """``original``'s docstring for the same function under MindSpore 2.x's newer name: the first
    line replaced by ``title`` and the Example by ``example`` (Args, Returns and Raises are the
    same, so they are written once, on the drop-in)."""
    doc = inspect.cleandoc(original.__doc__ or "")
    body = doc.split("\n", 1)[1]
    body = body[: body.index("Example:")] + "Example:\n" + textwrap.indent(textwrap.dedent(example).strip(), "    ")
    return f"{title}\n{body}\n"


rank_list_for_convert.__doc__ = _renamed(
    rank_list_for_transform,
    "``mindspore.parallel.rank_list_for_convert``: ``rank_list_for_transform`` under its newer name.",
    """
    from reshard.mindspore.parallel import rank_list_for_convert
    ranks = rank_list_for_convert(0, "demo/merged/src_strategy.ckpt", "demo/merged/dst_strategy.ckpt")
    """,
)
convert_checkpoint_by_rank.__doc__ = _renamed(
    transform_checkpoint_by_rank,
    "``mindspore.parallel.convert_checkpoint_by_rank``: ``transform_checkpoint_by_rank`` under its newer name.",
    """
    from reshard.mindspore.parallel import convert_checkpoint_by_rank, rank_list_for_convert
    src, dst = "demo/merged/src_strategy.ckpt", "demo/merged/dst_strategy.ckpt"
    files = {r: f"demo/ckpt_8ranks/rank_{r}/checkpoint_{r}.ckpt" for r in rank_list_for_convert(0, src, dst)}
    convert_checkpoint_by_rank(0, files, "rank_0/checkpoint_0.ckpt", src, dst)
    """,
)
convert_checkpoints.__doc__ = _renamed(
    transform_checkpoints,
    "``mindspore.parallel.convert_checkpoints``: ``transform_checkpoints`` under its newer name.",
    """
    from reshard.mindspore.parallel import convert_checkpoints
    convert_checkpoints("demo/ckpt_8ranks", "ckpt_4ranks", "checkpoint_",
                        "demo/merged/src_strategy.ckpt", "demo/merged/dst_strategy.ckpt")
    """,
)


# --------------------------------------------------------------------------------------------
# load_segmented_checkpoints


def load_segmented_checkpoints(
    ckpt_file_dir: str,
    net: Any = None,
    strict_load: bool = False,
    filter_prefix: str | Sequence[str] | None = None,
    dec_key: bytes | None = None,
    dec_mode: str = DEFAULT_ENC_MODE,
    specify_prefix: str | Sequence[str] | None = None,
    choice_func: Callable[[str], Any] | None = None,
) -> dict[str, LoadedValue]:
    """``mindspore.load_segmented_checkpoints``: every ``*.ckpt`` of a folder loaded into one dict.

    Each file is loaded by ``load_checkpoint`` with the same filters and key, in the order
    MindSpore's ``glob`` lists the folder (hidden files left out); a name in several files keeps
    its first position and the last file's value, as MindSpore's ``dict.update`` does. A folder
    without ``.ckpt`` files gives ``{}``, as in MindSpore.

    Args:
        ckpt_file_dir: The folder of ``.ckpt`` segments (other files are ignored).
        net: Must be None (there are no networks without MindSpore).
        strict_load: Ignored, as MindSpore does without a network (default False).
        filter_prefix: A str or list of str: names starting with one are left out (None: none).
        dec_key: Decrypt encrypted segments with this key (None: not encrypted).
        dec_mode: The mode of ``dec_key``: ``"AES-GCM"`` (default), ``"AES-CBC"`` or ``"SM4-CBC"``.
        specify_prefix: A str or list of str: only names starting with one are kept (None: all).
        choice_func: Without prefixes, keep a name when ``choice_func(name)`` is truthy (None: all).

    Returns:
        ``{name: numpy array | str}``, owned copies (every file is closed).

    Raises:
        UsageError: ``ckpt_file_dir`` is not a folder, a wrong argument, or a segment with no
            parameter left after the filters.
        UnsupportedError: A network given as ``net``, or a segment with entries reshard does not handle.
        FormatError: A segment is truncated, corrupted or not a ``.ckpt``.
        CryptoError: A segment does not decrypt with ``dec_key`` / ``dec_mode``.

    Example:
        from reshard.mindspore.parallel import load_segmented_checkpoints
        params = load_segmented_checkpoints("demo/ckpt_8ranks/rank_0")
    """
    if net is not None:
        raise UnsupportedError("reshard has no networks; pass net=None and load the returned arrays")
    if isinstance(ckpt_file_dir, os.PathLike):
        ckpt_file_dir = os.fspath(ckpt_file_dir)
    if not isinstance(ckpt_file_dir, str):
        raise UsageError(f"ckpt_file_dir must be a str, got {type(ckpt_file_dir).__name__}")
    if not os.path.isdir(ckpt_file_dir):
        raise UsageError("ckpt_file_dir does not exist or is not a directory", ckpt_file_dir or ".")
    result: dict[str, LoadedValue] = {}
    for path in glob.glob(os.path.join(glob.escape(ckpt_file_dir), "*.ckpt")):
        loaded = load_checkpoint(
            path,
            None,
            strict_load,
            filter_prefix,
            dec_key,
            dec_mode,
            specify_prefix,
            choice_func,
        )
        result.update(loaded)
    return result


# --------------------------------------------------------------------------------------------
# merge_sliced_parameter (docs/formats.md §3.1, §3.4, §3.10, §9.3)


def _slices(sliced_parameters: Any) -> list[tuple[str, np.ndarray, Any]]:
    """``(name, array, parameter)`` of every slice: reshard Parameters or anything with ``.name`` and ``.data``."""
    if not isinstance(sliced_parameters, list):
        raise UsageError(f"sliced_parameters must be a list, got {type(sliced_parameters).__name__}")
    if not sliced_parameters:
        raise UsageError("sliced_parameters must not be empty")
    slices = []
    for index, parameter in enumerate(sliced_parameters):
        name = getattr(parameter, "name", None)
        array = _slice_array(getattr(parameter, "data", None))
        if not isinstance(name, str) or array is None:
            raise UsageError(
                f"sliced_parameters[{index}] must be a Parameter (a name and a numpy array), got "
                f"{type(parameter).__name__}; wrap arrays as reshard.mindspore.Parameter(array, name)"
            )
        slices.append((name, array, parameter))
    return slices


def _slice_array(data: Any) -> np.ndarray | None:
    """A slice's ``data`` as a numpy array: the array itself, or ``data.asnumpy()`` (a MindSpore Tensor)."""
    if isinstance(data, np.ndarray):
        return data
    asnumpy = getattr(data, "asnumpy", None)
    result = asnumpy() if callable(asnumpy) else None
    return result if isinstance(result, np.ndarray) else None


def _check_alike(slices: list[tuple[str, np.ndarray, Any]]) -> None:
    """MindSpore's rule: one name, one number of dims, one shape but for dim 0."""
    name, first, _ = slices[0]
    for index, (other, array, _) in enumerate(slices):
        if other != name or array.ndim != first.ndim or array.shape[1:] != first.shape[1:]:
            raise UsageError(
                "sliced_parameters must share the name, the number of dims and the shape but for dim 0: "
                f"expected {name}, {first.ndim}, {first.shape[1:]}, got {other}, {array.ndim}, "
                f"{array.shape[1:]} at index {index}"
            )


def _widened(array: np.ndarray) -> np.ndarray:
    """MindSpore merges bf16 slices as float32 (it casts them before ``asnumpy``)."""
    return array.astype(np.float32) if array.dtype.name == dtypes.BFLOAT16.numpy_name else array


def _strategy_fields(layout: Any, name: str) -> tuple[list[int], list[int], list[int], int]:
    """``(dev_matrix, tensor_map, param_split_shape, field)``: the first entry of each, as MindSpore reads them."""
    try:
        dev = [int(d) for d in layout.dev_matrix[0].dim]
        tmap = [int(v) for v in layout.tensor_map[0].dim]
        split = [int(v) for v in layout.param_split_shape[0].dim]
        field = int(layout.field)
    except (AttributeError, IndexError, TypeError, ValueError):
        raise UsageError(
            f"strategy[{name!r}] is not a ParallelLayouts message (one DevMatrix, TensorMap and "
            "ParamSplitShape, as build_searched_strategy returns)"
        ) from None
    return dev, tmap, split, field


def _block(rank: int, dev: Sequence[int], tmap: Sequence[int]) -> tuple[int, ...]:
    """The block of each tensor dim rank ``rank`` holds (docs/formats.md §3.1)."""
    n = len(dev)
    coords, rest = [0] * n, rank
    for j in reversed(range(n)):
        coords[j], rest = rest % dev[j], rest // dev[j]
    return tuple(0 if v == -1 else coords[n - 1 - v] for v in tmap)


def _join_blocks(blocks: dict[tuple[int, ...], np.ndarray], counts: Sequence[int]) -> np.ndarray:
    """Concatenate the grid of blocks, the last tensor dim first, as MindSpore does."""
    grid = [blocks[key] for key in np.ndindex(*counts)]
    for axis in reversed(range(len(counts))):
        n = counts[axis]
        if n > 1:
            grid = [np.concatenate(grid[i : i + n], axis=axis) for i in range(0, len(grid), n)]
    return grid[0]


def _merge_with_field(arrays: list[np.ndarray], field: int) -> np.ndarray:
    """``field > 0`` (sparse embeddings): per column, each rank's rows interleaved per field (§3.4)."""
    count, rows = len(arrays), arrays[0].shape[0]
    if arrays[0].ndim != 2 or rows % field:
        raise LayoutError(f"field {field} needs 2-D slices whose rows it divides, got shape {arrays[0].shape}")
    stacked = np.stack(arrays).reshape(count, field, rows // field, arrays[0].shape[1])
    return np.ascontiguousarray(stacked.transpose(1, 0, 2, 3)).reshape(count * rows, arrays[0].shape[1])


def _merge_with_strategy(arrays: list[np.ndarray], layout: Any, name: str, is_even: bool) -> np.ndarray:
    dev, tmap, split, field = _strategy_fields(layout, name)
    count = int(np.prod(dev, dtype=np.int64))
    if len(arrays) != count:
        raise LayoutError(f"{name}: the strategy has {count} devices, but {len(arrays)} slices were given")
    if not split and not is_even:
        raise LayoutError(f"{name}: the slices' shapes differ, but the strategy splits evenly")
    if not split and field > 0:
        return _merge_with_field(arrays, field)
    counts = tensor_strategy(ParamLayout(tuple(dev), tuple(tmap)))
    if len(counts) > arrays[0].ndim and any(n > 1 for n in counts[arrays[0].ndim :]):
        raise LayoutError(f"{name}: the tensor map has {len(counts)} dims, the slices {arrays[0].ndim}")
    if split and len(split) != int(np.prod(counts, dtype=np.int64)):
        raise LayoutError(f"{name}: param_split_shape has {len(split)} entries, the layout {np.prod(counts)} slices")
    blocks: dict[tuple[int, ...], np.ndarray] = {}
    for rank, array in enumerate(arrays):
        key = _block(rank, dev, tmap)
        index = int(np.ravel_multi_index(key, counts)) if counts else 0
        if split and array.shape[0] != split[index]:
            raise LayoutError(f"{name}: slice {index} should have {split[index]} rows, got {array.shape[0]}")
        blocks[key] = array  # a later rank holding the same block wins, as in MindSpore
    return _join_blocks(blocks, counts)


def merge_sliced_parameter(sliced_parameters: list[Any], strategy: Mapping[str, Any] | None = None) -> Parameter:
    """``mindspore.merge_sliced_parameter``: one full ``Parameter`` from its slices in rank order.

    Without a strategy the slices are concatenated along dim 0. With one (``build_searched_strategy``'s
    dict, looked up by the slices' name) every rank's slice is put at its block of the layout's
    first device matrix and tensor map (a later rank holding the same block wins), honouring
    ``field`` and an uneven ``param_split_shape`` as MindSpore does (docs/formats.md §3.10). BFloat16
    slices come back as float32, as in MindSpore; ``requires_grad`` and ``layerwise_parallel`` are
    the first slice's.

    Args:
        sliced_parameters: The slices in rank order: ``reshard.mindspore.Parameter`` objects (or any
            objects with a ``name`` and a numpy ``data`` or ``data.asnumpy()``), sharing the name and
            every dim but dim 0.
        strategy: ``{parameter name: ParallelLayouts}`` as ``build_searched_strategy`` returns (None or
            empty: concatenate along dim 0).

    Returns:
        A ``reshard.mindspore.Parameter`` with the slices' name and the merged numpy array.

    Raises:
        UsageError: ``sliced_parameters`` not a non-empty list of Parameters, slices that differ in
            name or in a dim but dim 0, scalar slices, a ``strategy`` that is not a dict of layouts, or
            a name missing from it.
        LayoutError: The number of slices is not the layout's device count, or their shapes do not
            fit the layout (uneven without ``param_split_shape``, a wrong split size).

    Example:
        import numpy as np
        from reshard.mindspore import Parameter, build_searched_strategy, load_checkpoint
        from reshard.mindspore.parallel import merge_sliced_parameter
        rows = [Parameter(np.full((2, 3), r, np.float32), "embedding_table") for r in range(4)]
        table = merge_sliced_parameter(rows).asnumpy()  # (8, 3): concatenated along dim 0
        stage0 = build_searched_strategy("demo/strategy_8/ckpt_strategy_rank_0.ckpt")
        name = "model.layers.0.attention_norm.weight"  # replicated on stage 0's 4 ranks
        slices = [Parameter(load_checkpoint(f"demo/ckpt_8ranks/rank_{r}/checkpoint_{r}.ckpt")[name], name)
                  for r in range(4)]
        merged = merge_sliced_parameter(slices, stage0)
    """
    slices = _slices(sliced_parameters)
    if strategy and not isinstance(strategy, Mapping):
        raise UsageError(f"strategy must be a dict, got {type(strategy).__name__}")
    _check_alike(slices)
    name, first_array, first = slices[0]
    if first_array.ndim == 0:
        raise UsageError(f"{name}: scalar slices cannot be merged (MindSpore fails to concatenate them too)")
    arrays = [_widened(array) for _, array, _ in slices]
    if not strategy:
        merged = np.concatenate(arrays)
    else:
        if name not in strategy:
            raise UsageError(f"the parameter name {name!r} is not a key of strategy")
        is_even = all(array.shape == first_array.shape for _, array, _ in slices)
        merged = _merge_with_strategy(arrays, strategy[name], name, is_even)
    requires_grad = getattr(first, "requires_grad", True)
    layerwise_parallel = getattr(first, "layerwise_parallel", False)
    return Parameter(merged, name, bool(requires_grad), bool(layerwise_parallel))


# --------------------------------------------------------------------------------------------
# group information files (docs/formats.md §2.1)


def restore_group_info_list(group_info_file_name: str) -> list[int]:
    """``mindspore.restore_group_info_list``: the ``ckpt_restore_rank_list`` of a group information file.

    MindSpore writes this file (a ``ParallelGroupMap`` protobuf) where the environment variable
    ``GROUP_INFO_FILE`` points during a parallel job.

    Args:
        group_info_file_name: The group information file.

    Returns:
        The rank list, in the file's order (``[]`` for a file without one, as MindSpore returns).

    Raises:
        UsageError: ``group_info_file_name`` is not a str, or names no file or an empty one.
        FormatError: The file is not a ``ParallelGroupMap`` message.

    Example:
        from reshard.formats.strategy import message_classes
        from reshard.mindspore.parallel import restore_group_info_list
        group_map = message_classes()["ParallelGroupMap"]()
        group_map.ckpt_restore_rank_list.dim.extend([0, 2, 4, 6])
        with open("group_info.pb", "wb") as f:
            f.write(group_map.SerializeToString())
        ranks = restore_group_info_list("group_info.pb")
    """
    if not isinstance(group_info_file_name, str):
        raise UsageError(f"group_info_file_name must be a str, got {type(group_info_file_name).__name__}")
    path = group_info_file_name
    if not os.path.isfile(path):
        raise UsageError("no such group information file", path or ".")
    if os.path.getsize(path) == 0:
        raise UsageError("the group information file is empty", path)
    with open(path, "rb") as fh:
        data = fh.read()
    message: Any = message_classes()["ParallelGroupMap"]()
    try:
        message.ParseFromString(data)
    except Exception:  # protobuf's DecodeError, or an error of the C runtime
        raise FormatError("not a group information file (ParallelGroupMap)", path) from None
    # MindSpore's "has no restore rank list" check tests the message, which is always truthy: a file
    # without ranks gives [] there, and so here.
    return [int(r) for r in message.ckpt_restore_rank_list.dim]


# --------------------------------------------------------------------------------------------
# what needs a running job


def sync_pipeline_shared_parameters(net: Any) -> None:
    """``mindspore.sync_pipeline_shared_parameters``: not available, it needs a compiled network on devices.

    MindSpore sends each pipeline-shared parameter (a tied embedding, say) from the stage that
    holds it to the other stage with ``Send``/``Receive`` operators; there is no file to work on.

    Args:
        net: The inference network (anything: the call always raises).

    Returns:
        Nothing; it always raises.

    Raises:
        UnsupportedError: Always.

    Example:
        from reshard.errors import UnsupportedError
        from reshard.mindspore.parallel import sync_pipeline_shared_parameters
        try:
            sync_pipeline_shared_parameters(None)
        except UnsupportedError as exc:
            reason = str(exc)
    """
    raise UnsupportedError(
        "sync_pipeline_shared_parameters needs a compiled network exchanging tensors between devices; "
        "reshard has no networks (transform checkpoints offline instead: transform_checkpoints)"
    )


def set_op_strategy_config(mode: str = "SAVE", path: str = "") -> None:
    """``mindspore.parallel.set_op_strategy_config``: not available, it configures a running auto-parallel job.

    Args:
        mode: ``"SAVE"`` or ``"LOAD"`` in MindSpore (anything here: the call always raises).
        path: The operator strategy ``.json`` file in MindSpore (anything here).

    Returns:
        Nothing; it always raises.

    Raises:
        UnsupportedError: Always.

    Example:
        from reshard.errors import UnsupportedError
        from reshard.mindspore.parallel import set_op_strategy_config
        try:
            set_op_strategy_config("SAVE", "/tmp/op_strategy.json")
        except UnsupportedError as exc:
            reason = str(exc)
    """
    raise UnsupportedError(
        "set_op_strategy_config sets the sharding-propagation context of a running MindSpore job; "
        "reshard has no parallel context"
    )


# --------------------------------------------------------------------------------------------
# the rest of mindspore.parallel (MindSpore 2.10's dir(mindspore.parallel)): not provided

_NO_JOB = "configures a running MindSpore parallel job"
_CHECKPOINT_FUNCTIONS = (
    "reshard.mindspore.parallel has no submodules: import its checkpoint functions from it directly "
    "(from reshard.mindspore.parallel import transform_checkpoints)"
)
# name -> (what it is in MindSpore, what reshard offers instead or why there is nothing)
_NOT_PROVIDED: dict[str, tuple[str, str]] = {
    "shard": (
        "sets the sharding strategy of a Cell or function in a running MindSpore job",
        "reshard reads the layouts a job saved in its strategy file (build_searched_strategy; "
        "`reshard show CKPT PARAM --strategy FILE` draws one)",
    ),
    "Layout": (
        "describes a device matrix for shard() in a running MindSpore job",
        "reshard reads layouts from strategy files (build_searched_strategy) and Checkpoint 2.0 metadata",
    ),
    "parameter_broadcast": (
        "broadcasts a network's parameters between data-parallel ranks of a running job",
        "reshard writes every rank's checkpoint offline instead (transform_checkpoints, load_distributed_checkpoint)",
    ),
    "set_algo_parameters": (_NO_JOB + " (the sharding-propagation search)", "reshard has no parallel context"),
    "get_algo_parameters": (_NO_JOB + " (the sharding-propagation search)", "reshard has no parallel context"),
    "reset_algo_parameters": (_NO_JOB + " (the sharding-propagation search)", "reshard has no parallel context"),
    "algo_parameter_config": (
        "is the module of set_algo_parameters, which " + _NO_JOB,
        "reshard has no parallel context",
    ),
    "nn": ("wraps networks for parallel training (PipelineCell, GradAccumulation, ...)", "reshard has no networks"),
    "function": (
        "redistributes tensors inside a running network (mindspore.parallel.function.reshard)",
        "reshard transforms checkpoint files offline (transform_checkpoints)",
    ),
    "data_access_adapter": ("holds MindSpore's internal file-access adapters", "reshard reads files itself"),
    "checkpoint_transform": ("is the module of the checkpoint functions", _CHECKPOINT_FUNCTIONS),
    "checkpoint_convert": ("is the module of convert_checkpoints", _CHECKPOINT_FUNCTIONS),
    "transform_safetensors": ("is the module of unified_safetensors", _CHECKPOINT_FUNCTIONS),
}


def __getattr__(name: str) -> NoReturn:
    """A name of ``mindspore.parallel`` reshard does not provide: ``UnsupportedError`` saying what instead.

    Raises:
        UnsupportedError: ``name`` is one of MindSpore's (``_NOT_PROVIDED``).
        AttributeError: Any other name.
    """
    if name in _NOT_PROVIDED:
        what, instead = _NOT_PROVIDED[name]
        raise UnsupportedError(f"mindspore.parallel.{name} is not supported by reshard: it {what}; {instead}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "build_searched_strategy",
    "convert_checkpoint_by_rank",
    "convert_checkpoints",
    "load_distributed_checkpoint",
    "load_segmented_checkpoints",
    "merge_pipeline_strategys",
    "merge_sliced_parameter",
    "rank_list_for_convert",
    "rank_list_for_transform",
    "restore_group_info_list",
    "set_op_strategy_config",
    "sync_pipeline_shared_parameters",
    "transform_checkpoint_by_rank",
    "transform_checkpoints",
    "unified_safetensors",
]
