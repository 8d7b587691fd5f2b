"""``transform_by_rank``: one destination rank's file from the source files it needs (multi-node building block).

A job spread over nodes has each node write its own destination ranks; ``needed_ranks`` says which
source ranks' files one destination rank reads (MindSpore's ``rank_list_for_transform``), and
``transform_by_rank`` writes that rank's file from exactly those. It runs through the one run path
with a single output file as its target, checked against every path it reads.

Block-scaled pairs (an FP8 ``X.weight`` beside its ``X.weight_scale_inv``) are laid out as the whole
transform lays them out (``TensorPipeline.paired``): each scale takes its weight's layout counted in
blocks on both strategies, so one rank's scale is sliced by the same blocks as its weight, and a cut
off the block grid is refused before anything is written.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import cast

from reshard import arguments
from reshard.arguments import StrPath
from reshard.errors import UsageError
from reshard.execute.options import RunOptions, WriteOptions
from reshard.formats.strategy import StrategyFile
from reshard.ops.arguments import check_option_types, strategy_argument
from reshard.ops.options import Destination
from reshard.ops.run import Report, Target, run_plan, strategy_paths
from reshard.ops.tensors import Inputs, TensorPipeline, check_copies
from reshard.plan import plan_transform_by_rank
from reshard.plan.model import SourceFile
from reshard.plan.quantized_view import quantized_names
from reshard.sources import ReadOptions, open_strategy, source_files


def transform_by_rank(
    rank: int,
    files_map: Mapping[int, StrPath],
    out_file: StrPath,
    src_strategy: StrPath | StrategyFile | None = None,
    dst_strategy: StrPath | StrategyFile | None = None,
    *,
    destination: Destination | None = None,
    read: ReadOptions | None = None,
    write: WriteOptions | None = None,
    run: RunOptions | None = None,
) -> Report:
    """Write only destination ``rank``'s file from ``{source rank: file}`` (multi-node building block).

    The manifest goes next to ``out_file``. ``files_map`` needs the source ranks ``needed_ranks``
    names, and no others.

    Args:
        rank: The destination rank to write.
        files_map: Source rank -> its checkpoint file (a ``str`` or ``os.PathLike``, as every path here).
        out_file: The output file; its extension (``.ckpt`` / ``.safetensors``) is the format.
        src_strategy: The source strategy, a path or a ``StrategyFile`` (None: the source is a full
            model).
        dst_strategy: The destination strategy (None: a full model).
        destination: ``Destination``: ``dry_run`` plans only, ``manifest=False`` writes no journal nor
            manifest (as the MindSpore drop-in). None: ``Destination()``.
        read: How sources are read (``ReadOptions``: decryption, crc checking). None: ``ReadOptions()``.
        write: What the output's bytes hold (``WriteOptions``: crc trailer, encryption, checksum).
        run: How the run executes (``RunOptions``; a ``RayOptions`` runs on Ray). None: ``RunOptions()``.

    Returns:
        A ``Report`` holding the plan (no notes).

    Raises:
        UsageError: A missing source file, a needed source rank missing from ``files_map``, an
            ``out_file`` that is a source or lies in a source folder, or write options that do not
            fit the output (see ``execute``).
        LayoutError: ``rank`` or the tensors do not fit the strategies.
        FormatError: A strategy or source file that cannot be read, is truncated or is not what it claims.
        CryptoError: An encrypted source does not decrypt with ``read.dec_key`` / ``dec_mode``.
        IntegrityError: A crc trailer does not match, or copies the strategy calls replicas differ.
        UnsupportedError: A source holds entries reshard deliberately does not handle (``MapTensor``).
        ReshardError: An output, the journal or the manifest cannot be written (a full disk, say).

    Example:
        from reshard import api
        needed = api.needed_ranks(0, "demo/strategy_8", "demo/strategy_4")
        files = {r: f"demo/ckpt_8ranks/rank_{r}/checkpoint_{r}.ckpt" for r in needed}
        api.transform_by_rank(0, files, "out/checkpoint_0.ckpt", "demo/strategy_8", "demo/strategy_4")
    """
    rank, files, out_file = arguments.whole(rank, "rank"), _files_map(files_map), arguments.path(out_file, "out_file")
    src_strategy = strategy_argument(src_strategy, "src_strategy")
    dst_strategy = strategy_argument(dst_strategy, "dst_strategy")
    check_option_types(destination=destination, read=read, write=write, run=run)
    sources = source_files(files, read)
    src_sf, dst_sf = open_strategy(src_strategy), open_strategy(dst_strategy)
    if quantized_names(list(sources.values())):
        src_sf, dst_sf = _paired(sources, src_sf, dst_sf, next(iter(files.values())))
    plan = plan_transform_by_rank(rank, sources, out_file, src_sf, dst_sf)
    pending = check_copies(sources, src_sf, read)
    reads = [*files.values(), *strategy_paths(src_strategy, dst_strategy)]
    target = Target(None, reads, output_file=out_file)
    return run_plan(plan, target, destination, read, write, run, [], pending=pending)


def _files_map(files_map: object) -> dict[int, str]:
    """``{source rank: file}`` with ranks as ints and files as ``str`` paths.

    Raises:
        UsageError: Not a mapping, a rank that is no whole number >= 0, or a file that is no path.
    """
    if not isinstance(files_map, Mapping):
        raise UsageError(f"files_map must be a dict of source rank -> file, not {arguments.describe(files_map)}")
    return {
        arguments.whole(r, "a files_map rank"): arguments.path(p, f"files_map[{r!r}]") for r, p in files_map.items()
    }


def _paired(
    sources: Mapping[int, SourceFile], src: StrategyFile | None, dst: StrategyFile | None, a_source: str
) -> tuple[StrategyFile | None, StrategyFile | None]:
    """Both strategies with each FP8 block scale laid out as its weight (the block size: config.json
    beside the source files, else what their slices show).

    Raises:
        UsageError: A cut off the block grid, a block size unknown for a cut weight, a scale laid out apart.
    """
    pipeline = TensorPipeline(None, os.path.dirname(os.path.abspath(a_source)))
    inputs = pipeline.apply(Inputs(dict(sources), table=src), [])
    paired_src = cast("StrategyFile | None", inputs.table)
    return paired_src, pipeline.paired_destination(dst, inputs, [])


def needed_ranks(
    rank_id: int,
    src_strategy: StrPath | StrategyFile | None,
    dst_strategy: StrPath | StrategyFile | None = None,
    notes: list[str] | None = None,
) -> list[int]:
    """Source ranks whose files destination ``rank_id`` needs (MindSpore's ``rank_list_for_transform``).

    Notes on loading the strategies (a merged file passed over) go to ``notes`` when given.

    Args:
        rank_id: The destination rank.
        src_strategy: The source strategy, a path or a ``StrategyFile`` (None: a full model, so ``[0]``).
        dst_strategy: The destination strategy (None: a full model).
        notes: A list the loading notes are appended to (None: dropped).

    Returns:
        The source ranks, in MindSpore's order (descending).

    Raises:
        FormatError: A strategy path that cannot be read (missing, say) or parsed.
        LayoutError: ``rank_id`` is not a rank of the strategies, or the layouts do not fit.

    Example:
        from reshard import api
        ranks = api.needed_ranks(0, "demo/strategy_8", "demo/strategy_4")
    """
    from reshard import layout
    from reshard.layout import layout_map

    rank_id = arguments.whole(rank_id, "rank_id")
    src_sf = open_strategy(strategy_argument(src_strategy, "src_strategy"), notes)
    dst_sf = open_strategy(strategy_argument(dst_strategy, "dst_strategy"), notes)
    if src_sf is None:
        return [0]
    dst_map = layout_map(dst_sf, rank_id) if dst_sf is not None else None
    return layout.rank_list_for_transform(rank_id, layout_map(src_sf), dst_map)


__all__ = ["needed_ranks", "transform_by_rank"]
