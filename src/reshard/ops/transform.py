"""``transform``: a distributed (or full) checkpoint to another layout, full -> N, N -> M, N -> full.

Two planning paths, chosen by what the source is: a full model (a Hugging Face folder, unify's
output) is planned from its name -> file map, everything else (rank folders, one full file, a
Checkpoint 2.0) from rank sources and the source strategy. Both run the one tensor pipeline
(``ops.tensors``) before planning, and end alike: a Checkpoint 2.0 output is regrouped
(``ops.checkpoint2``), a Hugging Face output sharded, and the plan handed to the one run path
(``ops.run``). The context both paths share is a ``_Job``, so no helper takes a dozen arguments.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from reshard import arguments, statenames
from reshard.arguments import StrPath
from reshard.errors import UsageError
from reshard.execute.options import RunOptions, WriteOptions
from reshard.formats import checkpoint2, rank_dirs
from reshard.formats.strategy import StrategyFile
from reshard.layout import LayoutTable
from reshard.ops import checkpoint2 as _cp2
from reshard.ops import dcp_output
from reshard.ops.arguments import check_option_types, strategy_argument
from reshard.ops.options import WRITES, Destination, OutputSpec, TensorOptions, output_format, shard_bytes
from reshard.ops.pending import PendingCheck, its_error_first
from reshard.ops.run import Report, Target, folder_superseded, run_plan, strategy_paths
from reshard.ops.tensors import Inputs, TensorPipeline, check_copies, plan_tensors, training_state_note
from reshard.plan import Plan, SourceFile, hf_sharded, plan_transform, plan_transform_full
from reshard.sources import (
    CHECKPOINT2,
    ENCRYPTED_CKPT,
    FULL_FILE,
    HUGGING_FACE,
    HYPER_NAME,
    ONE_RANK_FOLDER,
    RANK_FOLDERS,
    UNIFIED,
    Kind,
    OpenedChunks,
    OpenedRanks,
    ReadOptions,
    full_model_file,
    model_folder,
    open_strategy,
    resolve,
    unified_index,
)
from reshard.sources import megatron as megatron_source
from reshard.sources.megatron import MEGATRON
from reshard.sources.registry import CHUNKED, is_chunked

FORMATS = WRITES["transform"]


@dataclass
class _Job:
    """What both planning paths of one transform share."""

    src: str
    dst: str
    ranks: Sequence[int] | None
    fmt: str | None  # the files' byte format (None: the source's)
    cp2_out: bool
    prefix: str
    read: ReadOptions | None
    notes: list[str]
    dst_sf: StrategyFile | None
    plan_dst: LayoutTable | None
    rule: statenames.StateNames
    pipeline: TensorPipeline
    kind: Kind
    shard_size: int | None  # Hugging Face output's shard size (None: not Hugging Face)
    dcp_out: bool = False  # a PyTorch DCP checkpoint: full tensors planned, then re-cut as chunks
    out_format: str | None = None  # the output format asked for (None: the source's)
    carried: dcp_output.Carried | None = None  # what a chunked source hands a torch_dist output
    chunks: OpenedChunks | None = None  # a DCP source to a DCP output: planned from its boxes in _finish
    copies: PendingCheck | None = None  # the replica check, running beside the copy (ops.pending)


def transform(
    src: StrPath,
    dst: StrPath,
    src_strategy: StrPath | StrategyFile | None = None,
    dst_strategy: StrPath | StrategyFile | None = None,
    *,
    ranks: Sequence[int] | None = None,
    output: OutputSpec | None = None,
    destination: Destination | None = None,
    tensors: TensorOptions | None = None,
    read: ReadOptions | None = None,
    write: WriteOptions | None = None,
    run: RunOptions | None = None,
) -> Report:
    """Move a distributed (or full) checkpoint to another layout: full->N, N->M, N->full.

    ``src`` is a folder of ``rank_<r>`` folders, one full checkpoint file, a Hugging Face sharded
    model (its folder or its index), a MindFormers Checkpoint 2.0 (its root or an ``iteration_*``
    folder; ``read.iteration`` picks another than the tracker's), a PyTorch DCP folder, or a
    Megatron-core torch_dist one (a save folder, or a Megatron-LM run folder: ``read.iteration`` picks
    an ``iter_*``); for a full model, a Checkpoint 2.0 (whose layouts are in its ``metadata.json``) and
    a DCP or torch_dist folder (in its ``.metadata``) ``src_strategy`` must be None. Strategies may be
    files or folders of per-stage files (merged in memory). ``OutputSpec(format="hf")`` writes the full
    model (no ``dst_strategy``) as Hugging Face shards plus ``model.safetensors.index.json``;
    ``format="checkpoint2"`` a Checkpoint 2.0 (``iteration_{n:08d}/``, ``metadata.json``,
    ``common.json``, the tracker last; docs/formats.md §10); ``format="dcp"`` a PyTorch DCP checkpoint
    (``__<r>_0.distcp`` files, ``.metadata`` last: rank folders' own slices as chunks, a ``dst_strategy``'s
    rank boxes, or ``OutputSpec.dcp_ranks`` even row parts; docs/pytorch.md); ``format="torch_dist"``
    Megatron-core's (the same, then ``common.pt``, the source's non-tensor values, ``.metadata`` and
    ``metadata.json``; ``OutputSpec.iteration``: a Megatron-LM run folder, ``iter_{n:07d}/`` and its tracker).

    Args:
        src: The source checkpoint (rank folders, a full file, a Hugging Face model, a Checkpoint 2.0); every
            path argument is a ``str`` or an ``os.PathLike`` (``pathlib.Path``).
        dst: The destination folder: ``rank_<r>/{prefix}<r>.<fmt>`` per destination rank.
        src_strategy: The source's strategy, a path or a loaded ``StrategyFile`` (None: a full model).
        dst_strategy: The destination strategy (None: one full model in ``rank_0``).
        ranks: Only these destination ranks, an iterable of ints >= 0 (None: all; multi-node runs).
        output: What to write (``OutputSpec``: ``ckpt``, ``safetensors``, ``hf``, ``checkpoint2`` or ``dcp``; None:
            the source's format, safetensors from a Hugging Face model; prefix, default ``"checkpoint_"``;
            shard size; a Checkpoint 2.0's iteration, ``common.json`` values and optimizer prefixes).
        destination: How ``dst`` is treated (``Destination``: overwrite, resume, dry run, manifest).
            None: a non-empty ``dst`` is refused, a manifest is written.
        tensors: What happens to tensors on the way (``TensorOptions``: filters and maps, dequantize or
            quantize, dtype casts). None: every tensor as it is.
        read: How sources are read (``ReadOptions``: decryption, crc checking, which file of a rank
            folder, a Checkpoint 2.0's iteration). None: ``ReadOptions()``.
        write: What the outputs' bytes hold (``WriteOptions``: crc trailer, encryption, checksum).
        run: How the run executes (``RunOptions``; a ``RayOptions`` runs on Ray). None: ``RunOptions()``.

    Returns:
        A ``Report``: the plan, notes for the user (files passed over, merged strategy files ignored),
        the files a resumed run kept, and the name report (``tensors.names``).

    Raises:
        UsageError: A missing or unrecognised source, several rank folders without ``src_strategy``, a
            strategy for a full model, an unsafe prefix, an unknown or conflicting output format or
            option, a missing source rank, write options that do not fit the outputs, a refused
            destination, or a model config the full tensors' shapes contradict.
        LayoutError: A strategy does not fit the tensors or the rank count.
        FormatError: A strategy or source file that cannot be read, is truncated or is not what it claims.
        CryptoError: An encrypted source does not decrypt with ``read.dec_key`` / ``dec_mode``.
        IntegrityError: A crc trailer does not match, or copies the strategy calls replicas differ.
        UnsupportedError: A source holds entries reshard deliberately does not handle (``MapTensor``).
        ReshardError: An output, the journal or the manifest cannot be written (a full disk, say).

    Example:
        from reshard import api
        report = api.transform("demo/ckpt_8ranks", "ckpt_4ranks", "demo/strategy_8", "demo/strategy_4")
        full = api.transform("demo/ckpt_4ranks", "full", "demo/strategy_4", None,
                             output=api.OutputSpec(format="safetensors"))
        mf2 = api.transform("demo/ckpt_8ranks", "mf2", "demo/strategy_8", "demo/strategy_4",
                            output=api.OutputSpec(format="checkpoint2", iteration=100, common={"global_step": 100}))
        hf_bf16 = api.transform("demo/ckpt_8ranks", "hf_bf16", "demo/strategy_8", None,
                                output=api.OutputSpec(format="hf"), tensors=api.TensorOptions(dtype="bf16"))
    """
    src, dst, ranks = arguments.path(src, "src"), arguments.path(dst, "dst"), arguments.ranks(ranks)
    src_strategy = strategy_argument(src_strategy, "src_strategy")
    dst_strategy = strategy_argument(dst_strategy, "dst_strategy")
    check_option_types(output=output, destination=destination, tensors=tensors, read=read, write=write, run=run)
    out, where = output or OutputSpec(), destination or Destination()
    dcp_output.check_options(out, write, strategy_given=dst_strategy is not None)
    job = _job(src, dst, src_strategy, dst_strategy, ranks, out, tensors, read)
    if job.cp2_out:
        _cp2.check_write(write)
    if job.kind in (HUGGING_FACE, UNIFIED):
        plan, src_sf, everyone = _plan_full(job, src_strategy)
    elif is_chunked(job.kind):
        from reshard.ops import chunked  # the DCP readers load for a chunked source only

        chunked.check_run(run)
        plan, src_sf, everyone = _plan_chunked(job)
    else:
        plan, src_sf, everyone = _plan_sharded(job, src_strategy)
    with its_error_first(job.copies):
        plan = _finish(job, plan, src_sf, everyone, out)
        target = _target(job, src, dst, src_strategy, dst_strategy, out, where)
    return run_plan(plan, target, where, read, write, run, job.notes, job.pipeline.report, job.copies)


def _job(
    src: str,
    dst: str,
    src_strategy: object,
    dst_strategy: str | StrategyFile | None,
    ranks: Sequence[int] | None,
    out: OutputSpec,
    tensors: TensorOptions | None,
    read: ReadOptions | None,
) -> _Job:
    """The run's context, every option checked before a checkpoint file is read."""
    fmt = output_format(out, FORMATS, "transform")
    cp2_out = fmt == checkpoint2.CHECKPOINT2
    _cp2.check_options(out)
    _cp2.refuse_map(cp2_out, tensors.names if tensors is not None else None)
    prefix = out.prefix if out.prefix is not None else ("" if cp2_out else "checkpoint_")
    rank_dirs.check_prefix(prefix)  # before anything is read: output names never leave the destination
    notes: list[str] = []
    shard_size = shard_bytes(out)
    if shard_size is not None and dst_strategy is not None:
        raise UsageError(
            "Hugging Face output is a full safetensors model: give no destination strategy and no ckpt output format"
        )
    # every "give no strategy" / "an iteration applies to ..." refusal, before any file is read
    kind = resolve(src, _kinds(src, src_strategy), strategy=src_strategy, read=read)
    dst_sf = open_strategy(dst_strategy, notes)
    rule = statenames.DEFAULT.with_prefixes(out.optimizer_prefixes)
    pipeline = TensorPipeline(tensors, src, out.optimizer_prefixes)
    pipeline.defer_quantize()  # --quantize: DeepSeek's rule on the map's outputs
    dcp_out = fmt in dcp_output.FORMATS
    if dcp_out and ranks is not None:
        raise UsageError("a DCP checkpoint is written whole: give no destination ranks")
    files_fmt = "safetensors" if cp2_out or dcp_out else None if fmt == "hf" else fmt
    plan_dst = None if dcp_out else dst_sf  # DCP: the full tensors, cut into chunks once planned
    return _Job(
        src, dst, ranks, files_fmt, cp2_out, prefix, read, notes, dst_sf, plan_dst, rule, pipeline, kind, shard_size,
        dcp_out, fmt,
    )  # fmt: skip


def _plan_chunked(job: _Job) -> tuple[Plan, None, Plan | None]:
    """A chunked source's plan (a PyTorch DCP folder): planned as the full model of its global
    tensors, then read from the chunks (``ops.chunked``)."""
    from reshard.ops import chunked

    opened = job.kind.open(job.src, job.read, job.notes)
    assert isinstance(opened, OpenedChunks)
    job.carried = _carried(job, opened)  # a DCP or torch_dist output carries the values
    if job.cp2_out or job.shard_size is not None:
        output = "a Checkpoint 2.0 output" if job.cp2_out else "a Hugging Face output"
    else:
        output = "a .ckpt output" if job.fmt == "ckpt" else "a safetensors output"
    if job.carried is None:
        chunked.values_note(opened, job.notes, output)
    files, mapping = chunked.virtual_model(opened)
    plan, _, everyone = _plan_full(job, None, (files, mapping, None))
    if job.dcp_out and everyone is None and job.pipeline.dequantizer is None:
        job.chunks = opened  # chunk boxes to chunk boxes: planned at once in _finish (chunked.boxed_dcp)
        return plan, None, None
    resourced = job.pipeline.resourced
    return resourced(plan, opened), None, resourced(everyone, opened) if everyone else None


def _plan_full(
    job: _Job,
    src_strategy: object,
    model: tuple[dict[str, SourceFile], dict[str, str], SourceFile | None] | None = None,
) -> tuple[Plan, None, Plan | None]:
    """A full model's plan (a Hugging Face folder, unify's output), from its name -> file map
    (``model``: the files, map and hyper-parameter file of a virtual full model instead)."""
    files, mapping, hyper = unified_index(job.src) if model is None else model  # a strategy: refused by resolve
    if hyper is not None:  # unify --hf keeps them beside the shards; a full model holds them
        files[HYPER_NAME] = hyper
        mapping = {**mapping, **{n: HYPER_NAME for n in hyper.tensors if n not in mapping}}
    inputs = job.pipeline.apply(Inputs(files, mapping), job.notes, whole=True, also=_source_config(job.src, job.kind))
    files, mapping = inputs.files, inputs.mapping or {}
    if job.cp2_out:
        job.plan_dst = _cp2.destination_table(job.dst_sf, list(mapping), job.rule, job.notes)
    _pair_destination(job, inputs)
    fmt = job.fmt or "safetensors"
    plan = inputs.resolve(plan_transform_full(files, mapping, job.plan_dst, job.dst, job.prefix, fmt, job.ranks))
    everyone = None
    if job.cp2_out:
        everyone = _cp2.everyone(
            job.ranks, lambda: plan_transform_full(files, mapping, job.plan_dst, job.dst, "", "safetensors")
        )
    return plan, None, everyone


def _target(
    job: _Job,
    src: str,
    dst: str,
    src_strategy: str | StrategyFile | None,
    dst_strategy: str | StrategyFile | None,
    out: OutputSpec,
    where: Destination,
) -> Target:
    """Where the plan goes, what it reads, and what of an earlier run there it replaces."""
    sources = [model_folder(src), *strategy_paths(src_strategy, dst_strategy)]
    if job.cp2_out:
        return Target(dst, sources, superseded=lambda p: _cp2.superseded(dst, p, where.overwrite, where.resume))
    if job.dcp_out:
        save = dcp_output.save_folder(dst, out)
        return Target(dst, sources, superseded=dcp_output.superseded(save, where.overwrite, where.resume))
    return Target(dst, sources, superseded=folder_superseded(dst, job.dst_sf, where))


def _pair_destination(job: _Job, inputs: Inputs) -> None:
    """The destination strategy with each FP8 scale laid out as its weight: the planned one, or (a DCP output,
    planned whole and cut into chunks afterwards) the one the chunks are cut by."""
    job.plan_dst = job.pipeline.paired_destination(job.plan_dst, inputs, job.notes)
    if job.dcp_out:
        job.dst_sf = job.pipeline.paired_destination(job.dst_sf, inputs, job.notes)


def _plan_sharded(job: _Job, src_strategy: str | StrategyFile | None) -> tuple[Plan, StrategyFile | None, Plan | None]:
    """The plan from rank sources (rank folders, one full file, a Checkpoint 2.0) and their strategy."""
    opened = _cp2.open_source(job.kind, job.src, job.read, job.notes, job.ranks)  # --ranks: only the files read
    assert not isinstance(opened, OpenedChunks)  # a chunked source is planned by _plan_chunked
    src_sf = opened.strategy if job.kind.traits.owns_layouts else open_strategy(src_strategy, job.notes)
    if src_sf is None and len(opened.ranks) > 1:
        raise UsageError(
            "several rank folders but no source strategy (--src-strategy, src_strategy in Python)", job.src
        )
    # one full file: the map first, so a destination strategy slices its outputs
    inputs = job.pipeline.apply(Inputs(opened.ranks, table=src_sf), job.notes, whole=src_sf is None)
    # the strategy with each FP8 scale laid out as its weight (a StrategyFile stays one: dataclasses.replace)
    sources, src_sf = inputs.files, cast("StrategyFile | None", inputs.table)
    if job.cp2_out:
        held = list(dict.fromkeys(n for f in sources.values() for n in f.tensors))
        job.plan_dst = _cp2.destination_table(job.dst_sf, held, job.rule, job.notes)
    _pair_destination(job, inputs)
    fmt = job.fmt or opened.fmt or "ckpt"
    plan = plan_transform(sources, src_sf, job.plan_dst, job.dst, job.prefix, fmt, job.ranks)
    absent = opened.absent if isinstance(opened, OpenedRanks) else ()
    job.copies = check_copies(inputs.read or {}, src_sf, job.read, absent)
    with its_error_first(job.copies):
        plan = job.pipeline.after(inputs.resolve(plan), inputs, full=job.plan_dst is None)
        _cp2.check_present(plan, absent)
        everyone = None
        if job.cp2_out:
            everyone = _cp2.everyone(
                job.ranks, lambda: plan_transform(sources, src_sf, job.plan_dst, job.dst, "", "safetensors")
            )
    return plan, src_sf, everyone


def _finish(job: _Job, plan: Plan, src_sf: LayoutTable | None, everyone: Plan | None, out: OutputSpec) -> Plan:
    """The plan as written: regrouped as a Checkpoint 2.0, checked against the config, sharded for Hugging Face."""
    if job.cp2_out:
        iteration, common = out.iteration, out.common
        if job.kind is CHECKPOINT2:  # the source's own iteration and common.json carry over unless given
            iteration, common = _cp2.carried_over(job.src, job.read, iteration, common, job.notes)
        plan = _cp2.checkpoint2_plan(
            plan, src_sf, job.plan_dst, job.dst, iteration, common, job.prefix, job.rule, everyone, job.notes
        )
    if job.plan_dst is None and not job.cp2_out:  # a full model out: its tensors are whole
        job.pipeline.check_config(plan_tensors(plan))
    plan = job.pipeline.planned(plan, job.plan_dst is None)
    if job.shard_size is not None:
        plan = hf_sharded(plan, job.dst, job.shard_size)
        training_state_note(plan, job.notes)
    plan = job.pipeline.finish(plan, job.notes, job.read)
    if job.dcp_out:
        how = dcp_output.chunking(out, job.dst_sf, sharded=job.kind in (RANK_FOLDERS, CHECKPOINT2))
        how = job.pipeline.dcp_pairs(plan, how)  # FP8 weights cut in whole block rows
        config = job.pipeline.dcp_config(plan, job.notes)
        plan = dcp_output.as_dcp(plan, job.dst, how, job.notes, out, job.carried, job.chunks, config)
    return plan


def _carried(job: _Job, opened: OpenedChunks) -> dcp_output.Carried | None:
    """What a chunked source hands a DCP or torch_dist output: its non-tensor values and (a torch_dist source
    into a torch_dist output) its ``common.pt``; None for another output. ``--weights-only`` carries neither
    the training-state values (``rng_state``, the distributed optimizer's objects: ``statenames``) nor
    ``common.pt`` (the iteration, the optimizer's param groups, the scheduler; a pickle reshard never opens):
    megatron's empty one instead."""
    if not job.dcp_out:
        return None
    kept = job.pipeline.naming.options.filter
    if not kept.weights_only:
        common = megatron_source.common_file(opened.path) if job.kind is MEGATRON else None
        return dcp_output.Carried(common, opened.values)
    values = {name: v for name, v in opened.values.items() if not kept.state.is_state(name)}
    dropped = sorted(set(opened.values) - set(values))
    if dropped:
        job.notes.append(f"--weights-only: {len(dropped)} training-state values not carried ({', '.join(dropped[:3])}"
                         f"{', ...' if len(dropped) > 3 else ''})")  # fmt: skip
    if job.kind is MEGATRON and job.out_format == dcp_output.TORCH_DIST:
        job.notes.append("--weights-only: the source's common.pt (iteration, optimizer param groups) not carried")
    return dcp_output.Carried(None, values)


def _source_config(src: str, kind: Kind) -> tuple[dict[str, object], str] | None:
    """A Hugging Face folder's own ``config.json`` and its path (None: another kind, none, or one
    that does not parse: ``transformers`` words that)."""
    if kind is not HUGGING_FACE:
        return None
    path = os.path.join(src if os.path.isdir(src) else os.path.dirname(src), "config.json")
    if not os.path.isfile(path):
        return None
    from reshard.naming.config import load_config

    try:
        return load_config(path), path
    except UsageError:
        return None


def _kinds(src: str, src_strategy: object) -> tuple[Kind, ...]:
    """What transform reads: rank folders, a MindFormers Checkpoint 2.0, a PyTorch DCP folder, a full
    checkpoint, a unify output, a Hugging Face model; one rank's folder only as the full checkpoint it holds, and never
    with a source strategy (its parent was meant)."""
    kinds: tuple[Kind, ...] = (HUGGING_FACE, UNIFIED, RANK_FOLDERS, CHECKPOINT2, *CHUNKED, ENCRYPTED_CKPT, FULL_FILE)
    if src_strategy is None and full_model_file(src) is not None:
        kinds += (ONE_RANK_FOLDER,)
    return kinds


__all__ = ["FORMATS", "transform"]
