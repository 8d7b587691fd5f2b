"""``unify``: N rank shards merged into full tensors, as MindSpore's ``unified_safetensors`` writes them.

The output is ``part<j>.safetensors`` + ``param_name_map.json`` (+ ``hyper_param.safetensors``),
packed as MindSpore packs them (``UnifyOptions``: its ``file_suffix``, ``choice_func``,
``split_dst_file`` and folder listing order), or Hugging Face shards and their index
(``OutputSpec(format="hf")``). The map of ``tensors.names`` is applied to the full tensors after
planning, before Hugging Face shards are packed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from typing import cast

from reshard import arguments
from reshard.arguments import StrPath
from reshard.errors import LayoutError, UsageError
from reshard.execute.options import RunOptions, WriteOptions
from reshard.formats import rank_dirs
from reshard.formats.strategy import StrategyFile
from reshard.ops import checkpoint2 as _cp2
from reshard.ops import dcp_output
from reshard.ops.arguments import check_option_types, strategy_argument
from reshard.ops.options import WRITES, Destination, OutputSpec, TensorOptions, UnifyOptions, output_format, shard_bytes
from reshard.ops.pending import PendingCheck, its_error_first
from reshard.ops.run import Report, Target, run_plan
from reshard.ops.tensors import Inputs, TensorPipeline, check_copies, plan_tensors, training_state_note
from reshard.ops.transform import transform  # the one planner of DCP outputs
from reshard.plan import Plan, SourceFile, plan_unify, plan_unify_hf
from reshard.sources import (
    CHECKPOINT2,
    CHUNKED,
    RANK_FOLDERS,
    OpenedChunks,
    ReadOptions,
    identify,
    open_strategy,
    rank_sources,
    resolve,
)
from reshard.sources.registry import is_chunked

FORMATS = WRITES["unify"]


def unify(
    src: StrPath,
    strategy: StrPath | StrategyFile | None,
    dst: StrPath,
    *,
    parts: UnifyOptions | None = None,
    output: OutputSpec | None = None,
    destination: Destination | None = None,
    tensors: TensorOptions | None = None,
    read: ReadOptions | None = None,
    write: WriteOptions | None = None,
    run: RunOptions | None = None,
) -> Report:
    """Merge N rank shards into full tensors: ``part<j>.safetensors`` + ``param_name_map.json``.

    Parts are packed from the rank folders in rank order; ``UnifyOptions(mindspore_order=True)`` uses
    the folder listing order as MindSpore does (same packing and index order as its output).
    ``OutputSpec(format="hf")`` writes Hugging Face shards (``model-00001-of-0000N.safetensors`` of at
    most ``max_shard_size``, default ``5GB``) and ``model.safetensors.index.json`` instead (one
    ``model.safetensors`` when everything fits); ``hyper_param.safetensors`` is written as usual.

    Args:
        src: The folder of ``rank_<r>`` folders holding ``.safetensors`` files, a MindFormers
            Checkpoint 2.0 (its root or an ``iteration_*`` folder; ``read.iteration`` picks one), a
            PyTorch DCP folder or a Megatron-core torch_dist one (its layouts are its chunks: ``strategy`` None);
            every path argument is a ``str`` or an ``os.PathLike`` (``pathlib.Path``).
        strategy: Their strategy, a path (file or folder of per-stage files) or a ``StrategyFile``
            (None for a Checkpoint 2.0: its layouts are in its ``metadata.json``).
        dst: The output folder.
        parts: MindSpore's packing choices (``UnifyOptions``: ``file_suffix``, ``choice_func``,
            ``split_dst_file``, ``mindspore_order``). None: ``UnifyOptions()``.
        output: ``OutputSpec``: None or ``format="safetensors"`` (the parts), or ``format="hf"`` with
            its ``max_shard_size``.
        destination: How ``dst`` is treated (``Destination``: overwrite, resume, dry run, manifest).
        tensors: Filters, maps (applied to the full tensors), dequantize/quantize and casts
            (``TensorOptions``). None: every tensor as it is.
        read: How sources are read (``ReadOptions``: which file of a rank folder, iteration).
        write: What the outputs' bytes hold (``WriteOptions``: checksum).
        run: How the run executes (``RunOptions``; a ``RayOptions`` runs on Ray). None: ``RunOptions()``.

    Returns:
        A ``Report``: the plan, notes (files passed over), the files a resumed run kept and the
        name report.

    Raises:
        UsageError: ``src`` is not rank folders of ``.safetensors`` files, ``split_dst_file`` with
            Hugging Face output, an output format unify does not write, write options that do not fit
            the outputs, a refused destination, or a model config the full tensors' shapes contradict.
        LayoutError: The strategy does not fit the tensors, or describes fewer ranks than there are
            rank folders.
        FormatError: A strategy or source file that cannot be read, is truncated or is not what it claims.
        IntegrityError: Copies of one slice the strategy calls replicas hold different bytes.
        UnsupportedError: A source holds entries reshard deliberately does not handle.
        ReshardError: An output, the journal or the manifest cannot be written (a full disk, say).

    Example:
        from reshard import api
        api.unify("demo/st_8ranks", "demo/strategy_8", "unified")
    """
    src, dst, strategy = arguments.path(src, "src"), arguments.path(dst, "dst"), strategy_argument(strategy, "strategy")
    check_option_types(
        parts=parts, output=output, destination=destination, tensors=tensors, read=read, write=write, run=run
    )
    how = parts or UnifyOptions()
    fmt = output_format(output, FORMATS, "unify")
    dcp_output.check_iteration(output, "--output-format")  # --dcp-ranks, --dst-iteration: DCP outputs only
    dcp_output.check_options(output, write)
    if fmt in dcp_output.FORMATS:
        assert output is not None
        return _as_dcp(src, strategy, dst, how, output, destination, tensors, read, write, run)
    notes: list[str] = []
    pipeline = TensorPipeline(tensors, src)
    shard_size = shard_bytes(output)
    if shard_size is not None and how.split_dst_file:
        raise UsageError("split_dst_file (--split) does not apply to Hugging Face output")
    if is_chunked(identify(src, (RANK_FOLDERS, CHECKPOINT2, *CHUNKED))):
        from reshard.ops import chunked  # the DCP readers load for a chunked source only

        chunked.check_run(run)
        plan, pending = _chunked_plan(src, strategy, dst, how, shard_size, pipeline, read, notes), None
    else:
        plan, pending = _sharded_plan(src, strategy, dst, how, shard_size, pipeline, read, notes)
    with its_error_first(pending):
        pipeline.check_config(plan_tensors(plan))
        plan = pipeline.finish(plan, notes, read)
    return run_plan(plan, Target(dst, [src]), destination, read, write, run, notes, pipeline.report, pending)


def _as_dcp(
    src: str,
    strategy: str | StrategyFile | None,
    dst: str,
    how: UnifyOptions,
    output: OutputSpec,
    destination: Destination | None,
    tensors: TensorOptions | None,
    read: ReadOptions | None,
    write: WriteOptions | None,
    run: RunOptions | None,
) -> Report:
    """The full tensors as a DCP (or torch_dist) checkpoint: the transform to no destination strategy,
    each tensor whole, dim 0 cut in ``output.dcp_ranks`` data files (default 1). The part packing of
    ``UnifyOptions`` has no DCP form and is refused, but ``file_suffix``, which picks the source files."""
    if how.split_dst_file or how.choice_func is not None:
        what = "split_dst_file (--split)" if how.split_dst_file else "choice_func"
        raise UsageError(f"{what} packs safetensors parts: a {output.format} output has none")
    if how.file_suffix is not None:
        read = replace(read or ReadOptions(), file_suffix=how.file_suffix)
    whole = replace(output, dcp_ranks=output.dcp_ranks or 1)
    return transform(src, dst, strategy, None, output=whole, destination=destination, tensors=tensors, read=read,
                     write=write, run=run)  # fmt: skip


def _sharded_plan(
    src: str,
    strategy: str | StrategyFile | None,
    dst: str,
    how: UnifyOptions,
    shard_size: int | None,
    pipeline: TensorPipeline,
    read: ReadOptions | None,
    notes: list[str],
) -> tuple[Plan, PendingCheck | None]:
    """Rank folders or a Checkpoint 2.0 and their strategy, unified; and the replica check, running."""
    sources, sf = _sources(src, strategy, how, read, notes)
    inputs = pipeline.apply(Inputs(sources, table=sf), notes)
    # each FP8 scale laid out as its weight (a StrategyFile stays one: dataclasses.replace)
    sources, sf = inputs.files, cast(StrategyFile, inputs.table or sf)

    def mapped(whole: Plan) -> Plan:
        return pipeline.after(whole, inputs, full=True)

    if shard_size is not None:  # mapped before the shards are packed
        plan = plan_unify_hf(sources, sf, dst, how.choice_func, shard_size, mapped)
        training_state_note(plan, notes)
    else:
        plan = mapped(plan_unify(sources, sf, dst, how.choice_func, how.split_dst_file))
    return plan, check_copies(sources, sf, read)


def _chunked_plan(
    src: str,
    strategy: str | StrategyFile | None,
    dst: str,
    how: UnifyOptions,
    shard_size: int | None,
    pipeline: TensorPipeline,
    read: ReadOptions | None,
    notes: list[str],
) -> Plan:
    """A PyTorch DCP folder unified: its global tensors (``ops.chunked``), in parts or Hugging Face shards."""
    from reshard.ops import chunked

    kind = resolve(src, CHUNKED, strategy=strategy, flag="strategy")  # its layouts are its .metadata's chunks
    if how.split_dst_file:
        raise UsageError("split_dst_file (--split) is not supported for a PyTorch DCP source", src)
    opened = kind.open(src, read, notes)
    assert isinstance(opened, OpenedChunks)
    files, mapping = chunked.virtual_model(opened)
    inputs = pipeline.apply(Inputs(files, mapping), notes, whole=True)
    files, mapping = inputs.files, inputs.mapping or {}
    if shard_size is not None:
        plan, output = chunked.full_plan(files, mapping, dst, shard_size)
        training_state_note(plan, notes)
    else:
        plan, output = chunked.parts_plan(files, mapping, dst, how.choice_func), "a unified model"
    chunked.values_note(opened, notes, output)
    return pipeline.resourced(inputs.resolve(plan), opened)


def _sources(
    src: str, strategy: str | StrategyFile | None, how: UnifyOptions, read: ReadOptions | None, notes: list[str]
) -> tuple[dict[int, SourceFile], StrategyFile]:
    """The rank sources and their strategy (a Checkpoint 2.0's from its metadata.json)."""
    sf: StrategyFile | None
    kind = resolve(src, (RANK_FOLDERS, CHECKPOINT2), strategy=strategy, read=read)
    if kind is CHECKPOINT2:
        sources, sf = _cp2.virtual_ranks(src, read, notes)
    else:
        _refuse_ckpt_ranks(src)
        _, sources = rank_sources(src, "safetensors", None, how.file_suffix, read, notes, how.mindspore_order)
        sf = open_strategy(strategy, notes)
    if sf is None:
        raise UsageError("unify needs the source strategy")
    _check_unify_ranks(src, sources, sf, notes)
    return sources, sf


def _refuse_ckpt_ranks(src_dir: str) -> None:
    """unify reads safetensors: rank folders of .ckpt files get the two ways forward, not "missing"."""
    dirs = rank_dirs.rank_dirs(src_dir) if os.path.isdir(src_dir) else {}
    folders = list(dirs.values())
    if (
        folders
        and not any(rank_dirs.files_in(d, "safetensors") for d in folders)
        and any(rank_dirs.files_in(d, "ckpt") for d in folders)
    ):
        raise UsageError(
            "the rank folders hold .ckpt files and unify reads .safetensors: convert them first "
            "(reshard convert SRC ST_DIR --to safetensors), or get a full .ckpt with reshard transform "
            "--src SRC --src-strategy S --dst OUT",
            src_dir,
        )


def _check_unify_ranks(src_dir: str, sources: Mapping[int, SourceFile], sf: StrategyFile, notes: list[str]) -> None:
    """Rank folders beyond the strategy's ranks mean the strategy belongs to another job, unless it is
    the first pipeline stage's file of this job, which MindSpore unifies (that stage's parameters)."""
    from reshard.layout import STAGE_SEPARATOR, device_num, stage_count
    from reshard.plan.agree import first_stage_alone

    expected = device_num(sf) * stage_count(sf)
    beyond = sorted(r for r in sources if r >= expected)
    if not beyond:
        return
    if first_stage_alone(sources, sf, sf.stage):
        notes.append(
            f"the strategy is one pipeline stage's (ranks 0..{expected - 1} of {len(sources)} rank folders): "
            "only that stage's parameters are unified, as MindSpore does; give every stage's strategy files "
            "(their folder or the merged file) for the whole model"
        )
        return
    if sf.stage and not any(STAGE_SEPARATOR in name for name in sf.layouts):
        raise LayoutError(
            f"the strategy is pipeline stage {sf.stage}'s alone, but a stage's strategy names no ranks and is "
            f"read as ranks 0..{expected - 1}, another stage's (MindSpore would unify them wrongly); give every "
            "stage's strategy files (their folder or the merged file)",
            sf.path,
        )
    raise LayoutError(
        f"the strategy describes {expected} rank(s) (0..{expected - 1}) but the checkpoint "
        f"{src_dir} has {len(sources)} rank folders; is it the strategy of this job?",
        sf.path,
    )


__all__ = ["FORMATS", "unify"]
