"""The top-level drop-in functions of ``reshard.mindspore`` (``mindspore.save_checkpoint`` and friends).

``reshard.mindspore`` re-exports every name of ``__all__`` here, and ``reshard.mindspore.parallel``
re-exports the ones ``mindspore.parallel`` shares with ``mindspore``; they live in their own module
so both faces import them without importing each other. The package docstring of
``reshard.mindspore`` says how the drop-in is built and lists the deliberate differences from
MindSpore 2.10.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from reshard import readahead
from reshard.errors import LayoutError, UnsupportedError, UsageError
from reshard.mindspore.arguments import (
    DEFAULT_ENC_MODE,
    DEFAULT_MAX_PROCESS_NUM,
    WRITE_MANIFEST,
    as_bool,
    as_callable,
    as_format,
    as_int,
    as_name_map,
    as_path,
    as_rank,
    check_prefix,
    optional_path,
    optional_strategy,
    rank_bound,
    strategy_path,
    workers,
)

if TYPE_CHECKING:
    from reshard.execute.options import RunOptions
    from reshard.formats.strategy import StrategyFile
    from reshard.mindspore.saveload import LoadedValue  # numpy arrays: loaded with the first values returned
    from reshard.ops.options import Destination
    from reshard.plan import Plan


def _replacing() -> Destination:
    """MindSpore writes into an existing folder, replacing same-named files, and keeps no records."""
    from reshard.ops.options import Destination

    return Destination(overwrite=True, manifest=WRITE_MANIFEST)


# --------------------------------------------------------------------------------------------
# ckpt_to_safetensors / safetensors_to_ckpt (docs/formats.md §5)


def _convert(to: str, file_path: Any, save_path: Any, name_map: Any, file_name_regex: Any, processes_num: Any) -> None:
    src = as_path(file_path, "file_path")
    dst = optional_path(save_path, "save_path")
    if dst is not None and os.path.splitext(dst)[1]:
        raise UsageError("save_path must be a directory (no file extension)", dst)
    names = as_name_map(name_map)
    if file_name_regex is not None:
        if not isinstance(file_name_regex, str):
            raise UsageError(f"file_name_regex must be a str, got {type(file_name_regex).__name__}")
        try:
            pattern = re.compile(file_name_regex)
        except re.error as exc:
            raise UsageError(f"file_name_regex {file_name_regex!r} is not a valid regular expression: {exc}") from None
        if os.path.isfile(src) and not pattern.findall(src):
            raise UsageError(f"the input file does not match file_name_regex {file_name_regex!r}", src)
    as_int(processes_num, "processes_num", minimum=1)
    if not os.path.exists(src):
        raise UsageError("file_path does not exist", src)
    readahead.start([src])  # the disk reads the sources while the run imports and plans
    run = workers(processes_num, "processes_num")
    from reshard import api
    from reshard.ops.options import Destination

    api.convert(
        src,
        dst,
        to,
        name_map=names,
        file_regex=file_name_regex,
        run=run,
        destination=Destination(manifest=WRITE_MANIFEST),
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
    src = as_path(src_strategy_dirs, "src_strategy_dirs")
    if not os.path.isdir(src):
        raise UsageError("src_strategy_dirs is not a directory", src)
    dst = as_path(dst_strategy_file, "dst_strategy_file")
    if os.path.isdir(dst):
        raise UsageError("dst_strategy_file is a directory", dst)
    from reshard.formats.strategy import JSON, find_strategy_files, format_of, merge_strategy_files

    files = find_strategy_files(src, exclude=dst)  # validated candidates (sorted)
    listing = {name: i for i, name in enumerate(os.listdir(src))}
    files.sort(key=lambda f: listing.get(os.path.basename(f), len(listing)))
    fmt, data = merge_strategy_files(files)
    if format_of(dst) != fmt:
        raise UsageError(f"the merged {fmt} strategy file must {'' if fmt == JSON else 'not '}end with .json", dst)
    _write_plain(dst, data)


def _write_plain(path: str, data: bytes) -> None:
    """Atomically, with the permissions of a plain ``open(path, "wb")``."""
    from reshard.formats.base import write_whole

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
    from reshard.formats.strategy import PROTOBUF, encode_strategy, format_of, message_classes, read_strategy

    path = strategy_path(strategy_filename, "strategy_filename")
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
    as_int(rank_id, "rank_id", minimum=0)
    if src_strategy_file is None:
        return [0]
    src = optional_strategy(src_strategy_file, "src_strategy_file")
    dst = optional_strategy(dst_strategy_file, "dst_strategy_file")
    rank = as_rank(rank_id, rank_bound(src, dst))
    from reshard.ops.by_rank import needed_ranks

    return [int(r) for r in needed_ranks(rank, src, dst)]


# --------------------------------------------------------------------------------------------
# transform_checkpoints / transform_checkpoint_by_rank (docs/formats.md §3.8, §3.9, §4.2)


def _source_format(src_dir: str) -> str:
    from reshard.formats import rank_dirs

    if not os.path.isdir(src_dir):
        raise UsageError("src_checkpoints_dir does not exist or is not a directory", src_dir)
    fmt, chosen = rank_dirs.collect_rank_files(src_dir)
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
    src_dir = as_path(src_checkpoints_dir, "src_checkpoints_dir")
    dst_dir = as_path(dst_checkpoints_dir, "dst_checkpoints_dir")
    prefix = check_prefix(ckpt_prefix)
    out_fmt = as_format(output_format, "output_format")
    as_int(process_num, "process_num", minimum=1)
    readahead.start([src_dir], small=(src_strategy_file, dst_strategy_file))  # the disk works while the run plans
    run = workers(process_num, "process_num")
    fmt = _source_format(src_dir)
    from reshard.formats import rank_dirs
    from reshard.ops.options import OutputSpec
    from reshard.plan.by_stage import is_by_stage

    if fmt == "ckpt" and out_fmt == "safetensors":
        raise UsageError("output_format='safetensors' needs .safetensors sources; this folder holds .ckpt", src_dir)
    src = optional_strategy(src_strategy_file, "src_strategy_file")
    dst = optional_strategy(dst_strategy_file, "dst_strategy_file")
    if src is None and len(rank_dirs.rank_dirs(src_dir)) > 1:
        raise UsageError(
            "src_strategy_file is None but src_checkpoints_dir holds several rank folders: pass their "
            "strategy as src_strategy_file",
            src_dir,
        )
    if fmt == "ckpt" and is_by_stage(src, dst):
        assert src is not None and dst is not None
        _run_by_stage(src_dir, dst_dir, prefix, (src, dst), run)
        return
    _refuse_no_strategy(src, dst)
    from reshard import api

    api.transform(
        src_dir,
        dst_dir,
        src,
        dst,
        run=run,
        output=OutputSpec(prefix=prefix, format=out_fmt),
        destination=_replacing(),
    )


def _run_by_stage(
    src_dir: str, dst_dir: str, prefix: str, strategies: tuple[StrategyFile, StrategyFile], run: RunOptions
) -> None:
    """MindSpore's by-stage mode (``plan.by_stage``): every plan made before any write, then run."""
    from reshard.ops.run import Target, run_plans
    from reshard.plan.by_stage import plan_by_stage, stage_files
    from reshard.sources import indexed
    from reshard.sources.replicas import check_replicas

    src, dst = strategies
    files = stage_files(src_dir, src)
    sources = dict(zip(files, indexed([(path, r) for r, path in files.values()], None), strict=True))
    check_replicas(sources, src)  # the copies the layout calls replicas hold the same bytes
    plans = plan_by_stage(sources, src, dst, dst_dir, prefix)
    run_plans(plans, Target(dst_dir, [src_dir]), _replacing(), run=run)


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
        rank = as_int(key, "checkpoint_files_map keys (source ranks)", minimum=0)
        path = as_path(value, f"checkpoint_files_map[{rank}]")
        if not os.path.isfile(path):
            raise UsageError(f"checkpoint file of source rank {rank} does not exist", path)
        files[rank] = path
    out = as_path(save_checkpoint_file_name, "save_checkpoint_file_name")
    if not out.endswith(".ckpt"):
        raise UsageError("save_checkpoint_file_name must end with .ckpt", out)
    src = optional_strategy(src_strategy_file, "src_strategy_file")
    dst = optional_strategy(dst_strategy_file, "dst_strategy_file")
    _refuse_no_strategy(src, dst)
    rank = as_rank(rank_id, rank_bound(None, dst))
    from reshard.ops.by_rank import transform_by_rank
    from reshard.ops.options import Destination

    transform_by_rank(rank, files, out, src, dst, destination=Destination(manifest=WRITE_MANIFEST))


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
    index = as_int(value[0], "split_dst_file index", minimum=1)
    count = as_int(value[1], "split_dst_file count", minimum=1)
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
    src = as_path(src_dir, "src_dir")
    if os.path.isfile(src):
        raise UsageError("src_dir must be a folder of rank_<r> folders, not a file", src)
    readahead.start([src], small=(src_strategy_file,))  # the disk reads the sources while the run imports and plans
    strategy = strategy_path(src_strategy_file, "src_strategy_file")
    dst = as_path(dst_dir, "dst_dir")
    as_bool(merge_with_redundancy, "merge_with_redundancy")
    if file_suffix is not None and not isinstance(file_suffix, str):
        raise UsageError(f"file_suffix must be a str or None, got {file_suffix!r}")
    run = workers(max_process_num, "max_process_num")
    choice = as_callable(choice_func, "choice_func")
    split = _split_dst_file(split_dst_file)
    from reshard import api
    from reshard.ops.run import Target, run_plans

    # the folder listing order decides bin packing ties and the index order
    parts = api.UnifyOptions(file_suffix, choice, split, mindspore_order=True)
    report = api.unify(src, strategy, dst, parts=parts, destination=api.Destination(dry_run=True))
    if split and not report.plan.files and not report.plan.texts:
        raise UsageError(f"split_dst_file {split} selects none of the model's parts (MindSpore fails here too)")
    run_plans([report.plan], Target(dst, [src]), _replacing(), run=run)


_UNUSED_DST = "__reshard_not_written__"  # plan paths of return_param_dict: never written


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
    unified = as_path(unified_safetensors_dir, "unified_safetensors_dir")
    if rank_id is None and dst_safetensors_dir is not None:  # every rank: the whole model is read
        readahead.start([unified], small=(predict_strategy,))  # the disk reads it while the run imports and plans
    out_fmt = as_format(output_format, "output_format")
    names = as_name_map(name_map)
    run = workers(max_process_num, "max_process_num")
    as_bool(return_param_dict, "return_param_dict")
    if predict_strategy is None:
        raise UnsupportedError("predict_strategy is required: give the destination strategy file")
    if not isinstance(predict_strategy, (str, os.PathLike)):
        raise UnsupportedError("predict_strategy must be a strategy file path (layout dicts are not supported)")
    from reshard.formats.strategy import read_strategy

    strategy = read_strategy(strategy_path(predict_strategy, "predict_strategy"))
    rank = None if rank_id is None else as_rank(rank_id, rank_bound(None, strategy))
    dst = optional_path(dst_safetensors_dir, "dst_safetensors_dir")
    ranks = None if rank is None else [rank]
    if return_param_dict and rank is None:
        raise UsageError("return_param_dict=True needs rank_id: the tensors of which rank?")
    if not return_param_dict and dst is None:
        raise UsageError("dst_safetensors_dir is required when network is None")
    plan = _split_plan(unified, strategy, dst or os.path.join(unified, _UNUSED_DST), ranks, out_fmt, names)
    if dst is not None:
        from reshard.ops.run import Target, run_plans

        run_plans([plan], Target(dst, [unified]), _replacing(), run=run)
    if not return_param_dict:
        return None
    from reshard.execute.memory import materialize  # the in-memory executor: no file written

    return materialize(plan, plan.files[0])


def _split_plan(
    unified: str,
    strategy: StrategyFile,
    dst: str,
    ranks: Sequence[int] | None,
    output_format: str,
    name_map: Mapping[str, str] | None,
) -> Plan:
    """``plan_split`` over the unified folder (MindSpore's name lookup and dict order are in the plan)."""
    from reshard.plan import plan_split
    from reshard.sources import unified_index

    files, index, hyper = unified_index(unified, name_map)
    return plan_split(files, index, hyper, strategy, dst, output_format, ranks, name_map)


__all__ = [
    "build_searched_strategy",
    "ckpt_to_safetensors",
    "load_distributed_checkpoint",
    "merge_pipeline_strategys",
    "rank_list_for_transform",
    "safetensors_to_ckpt",
    "transform_checkpoint_by_rank",
    "transform_checkpoints",
    "unified_safetensors",
]
