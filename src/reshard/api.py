"""The native Python API: one function per operation, each "plan, then execute".

Every operation first builds a :class:`~reshard.plan.Plan` from file headers and strategies (so
``dry_run=True`` returns it without writing a byte), then runs it with the local executor.
Paths are checked before anything is written: the destination may not lie inside a source
folder, and an existing non-empty destination is refused unless ``overwrite=True`` (then the
files the plan writes are replaced, and an earlier run's outputs that a layout with fewer ranks
no longer has are removed as its manifest lists them; nothing reshard did not write is deleted)
or ``resume=True`` (continue an interrupted run). A run holds the destination's lock
(``reshard.lock``) while it writes. Each run journals its outputs and writes ``reshard-manifest.json`` last
(``manifest=True``, see ``reshard.manifest``); a run that fails removes what it created.

Options come in three keyword-only groups, one per concern: ``read=ReadOptions`` (how sources are
found and opened), ``write=WriteOptions`` (what the outputs' bytes hold: crc trailer, encryption,
checksum) and ``run=RunOptions`` (threads, memory bound, progress; ``RayOptions`` runs on Ray).
What a source path is (rank folders, a full file, a unified or Hugging Face model, a strategy)
is asked of the source registry, ``reshard.sources``; its discovery functions (``ReadOptions``,
``open_checkpoint``, ``unified_index`` ...) are re-exported here, where the README shows them.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar, cast

from reshard import destination as _destination
from reshard import manifest as _manifest
from reshard import statenames
from reshard.errors import LayoutError, ReshardError, UnsupportedError, UsageError
from reshard.execute.options import RunOptions, WriteOptions
from reshard.formats import checkpoint2, hf_index, layout_dir
from reshard.formats.strategy import StrategyFile
from reshard.layout import LayoutTable, split_stage_name
from reshard.layout.slices import CompletedTable, ModelParallelTable, has_optimizer_shard
from reshard.naming import NameOptions, NameReport
from reshard.plan import (
    ChoiceFunc,
    Plan,
    SourceFile,
    hf_sharded,
    plan_convert,
    plan_split,
    plan_transform,
    plan_transform_by_rank,
    plan_transform_full,
    plan_unify,
    plan_unify_hf,
)
from reshard.plan.cast import cast_files, cast_rule
from reshard.plan.checkpoint2 import plan_checkpoint2
from reshard.plan.quantized import (
    Dequantizer,
    Pair,
    Precision,
    block_of_slices,
    full_pairs,
    paired_layouts,
    sharded_pairs,
)
from reshard.plan.surgery import MAPPED_SOURCE, NameRun
from reshard.sources import (
    CHECKPOINT2,
    CHECKPOINTS,
    ENCRYPTED_CKPT,
    FULL_FILE,
    HUGGING_FACE,
    HYPER_NAME,
    ONE_RANK_FOLDER,
    RANK_FOLDERS,
    UNIFIED,
    Kind,
    Opened,
    ReadOptions,
    chosen_names,
    full_model_file,
    has_crc_trailer,
    hf_model,
    identify,
    is_hf_model,
    kind_of,
    model_folder,
    open_checkpoint,
    rank_sources,
    rank_subfolders,
    source_file,
    unified_index,
)
from reshard.sources import strategy as _strategy
from reshard.sources.checkpoint2 import check_iteration, iteration_folder
from reshard.text import parse_size

check_destination = _destination.check_destination  # the one place destinations are checked


@dataclass
class Report:
    """What an operation did: its plan, and notes for the user (e.g. files passed over)."""

    plan: Plan
    notes: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # outputs of an interrupted run that resume kept
    names: NameReport | None = None  # what filters and maps did to names (None: no filter, no map)


def execute(
    plan: Plan,
    *,
    read: ReadOptions | None = None,
    write: WriteOptions | None = None,
    run: RunOptions | None = None,
    root: str | None = None,
    resume: bool = False,
    manifest: bool = True,
    executor: str = "local",
    remove: Sequence[str] = (),
) -> list[str]:
    """Run ``plan`` into ``root`` (default: the folder holding its outputs) with journal and manifest.

    Sources' crc trailers were checked while planning, so the executor does not read them again.
    ``executor="ray"`` (or ``run`` being a ``reshard.execute.ray.RayOptions``) runs the output files
    as Ray tasks. ``remove`` lists an earlier run's outputs to delete once the destination is locked
    (``superseded``). The destination is not checked here: call ``check_destination`` first.

    Args:
        plan: The plan to run, as an operation's ``dry_run=True`` report holds it.
        read: How sources are found and opened (decryption key, crc checking, which file of a rank
            folder). None: ``ReadOptions()``, crc trailers checked, no key.
        write: What the outputs hold (``WriteOptions``: crc trailer, encryption, checksum). None: the
            defaults (no crc trailer, no encryption, BLAKE3 in the manifest).
        run: How the run executes (``RunOptions``: workers, memory bound, progress hooks; a
            ``RayOptions`` runs on Ray). None: ``RunOptions()``.
        root: The folder that gets the lock, journal and manifest (None: the common folder of the
            plan's outputs).
        resume: Continue an interrupted run into the same destination, keeping its finished files.
        manifest: Journal the outputs and write ``reshard-manifest.json`` last (False: neither, as
            the MindSpore drop-in does).
        executor: ``"local"`` (threads on this machine) or ``"ray"``.
        remove: Outputs of an earlier run to delete under the lock (default: none).

    Returns:
        The outputs kept from an interrupted earlier run (``resume``); empty otherwise.

    Raises:
        UsageError: An unknown ``executor``, a destination another run holds or that cannot be created,
            write options that do not fit the outputs (a crc trailer with encryption, encrypted
            safetensors), or ``resume`` without ``manifest``.
        PlanError: The plan fails validation (not a ReshardError: a bug, nothing is written).
        FormatError: A strategy path that cannot be read, or a source or strategy file that is
            truncated, corrupted or not what it claims.
        CryptoError: An encrypted source does not decrypt with ``read.dec_key`` / ``dec_mode``.
        IntegrityError: A source's crc trailer does not match its content.
        UnsupportedError: A source holds entries reshard deliberately does not handle (``MapTensor``).
        ReshardError: An output, the journal or the manifest cannot be written (a full disk, say).

    Example:
        from reshard import api
        report = api.transform("demo/ckpt_8ranks", "out_4ranks", "demo/strategy_8", "demo/strategy_4", dry_run=True)
        api.execute(report.plan, root="out_4ranks")
    """
    opened = replace(read, verify_crc=False) if read is not None else None
    from reshard.execute import ray as ray_executor  # light: Ray itself is imported only when used

    if executor not in ("local", "ray"):
        raise UsageError(f"unknown executor {executor!r} (choose local or ray)")
    if executor == "ray" or isinstance(run, ray_executor.RayOptions):
        if plan.quantized:
            raise UnsupportedError("--dequantize runs on the local executor only (not on Ray yet)")
        run = run or ray_executor.RayOptions()
        if getattr(run, "shared_disk", True):  # without one, each node writes to its own disk: this one cannot say
            _destination.check_free_space(plan, root or _manifest.common_root(plan), resume)
        return _manifest.run_recorded(
            plan,
            ray_executor.NO_OPENER,
            write,
            run,
            root,
            resume=resume,
            manifest=manifest,
            runner=ray_executor.runner(opened, run),
            remove=remove,
        )
    _destination.check_free_space(plan, root or _manifest.common_root(plan), resume)
    return _manifest.run_recorded(
        plan,
        lambda path: open_checkpoint(path, opened),
        write,
        run,
        root,
        resume=resume,
        manifest=manifest,
        remove=remove,
    )


def _dequantizer(precision: Precision | None, src: str) -> Dequantizer | None:
    """The run's dequantization (None without one), with the block size of the source's config.json."""
    if precision is None or not precision.active:
        return precision.dequantizer(None) if precision is not None else None
    return precision.dequantizer(_config_beside(src))


def _config_beside(src: str) -> dict[str, object] | None:
    """The ``config.json`` beside a source (a Hugging Face folder's own), or None: the block size
    of its quantized weights."""
    import json

    folder = model_folder(src)
    folder = folder if os.path.isdir(folder) else os.path.dirname(os.path.abspath(folder))
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {path}: {e}") from None
    return doc if isinstance(doc, dict) else None


TableT = TypeVar("TableT", bound=LayoutTable)


def _paired(
    table: TableT | None,
    pairs: dict[str, Pair],
    precision: Precision | None,
    src: str,
    side: str,
    notes: list[str],
    ranks: Mapping[int, SourceFile] | None = None,
    ranks_table: LayoutTable | None = None,
) -> TableT | None:
    """``table`` laying out each FP8 weight's block scale as the weight (``plan.quantized.paired_layouts``);
    the block size given, else in config.json, else shown by the slices of ``ranks`` (cut by ``ranks_table``)."""
    seen = functools.partial(block_of_slices, ranks, ranks_table) if ranks is not None else None
    block = functools.partial((precision or Precision()).pair_block, functools.partial(_config_beside, src), seen)
    # A StrategyFile stays one (dataclasses.replace); another table becomes a PairedTable of the same layouts.
    return cast("TableT | None", paired_layouts(table, pairs, block, side, notes))


def _dequantized(
    sources: dict[int, SourceFile], dequantizer: Dequantizer | None, table: LayoutTable | None = None
) -> dict[int, SourceFile]:
    return dequantizer.ranks(sources, table) if dequantizer is not None else sources


def _with_dequantized(
    plan: Plan, dequantizer: Dequantizer | None, notes: list[str], read: ReadOptions | None = None
) -> Plan:
    """``plan`` carrying what its dequantized tensors are read from (a note says how many).

    Raises:
        UsageError: A NaN or infinite block scale (read now: planning refuses it, nothing is written).
    """
    if dequantizer is None:
        return plan
    from reshard.execute import dequant

    note = dequantizer.note()
    if note is not None:
        notes.append(note)
    plan = dequantizer.attach(plan)
    opened = replace(read, verify_crc=False) if read is not None else None
    dequant.check_scales(plan, lambda path: open_checkpoint(path, opened))
    return plan


def superseded(dst: str, plan: Plan, dst_strategy: StrategyFile | None, overwrite: bool, manifest: bool) -> list[str]:
    """An earlier run's outputs in ``dst`` that this plan's layout no longer has.

    With ``overwrite``: an earlier run's rank outputs that the new layout does not write (for
    example ``rank_7`` after 8 → 4 ranks), as ``manifest.superseded_outputs`` finds them from the
    earlier run's manifest. Only runs that keep reshard's records (``manifest=True``) clean up after
    an earlier record; a run without one (``--no-manifest``, the MindSpore drop-in) replaces
    same-named files only, as MindSpore does.

    Args:
        dst: The destination folder.
        plan: The plan about to run into ``dst``.
        dst_strategy: The destination strategy (None: a full model, one rank).
        overwrite: Whether the run overwrites; without it nothing is superseded.
        manifest: Whether the run keeps reshard's records; without them nothing is superseded.

    Returns:
        The paths to remove (``execute``'s ``remove``); empty when there is nothing to clean up.

    Raises:
        UsageError: A checkpoint reshard did not write is in the way.

    Example:
        from reshard import api
        from reshard.formats.strategy import load_strategy
        report = api.transform("demo/ckpt_8ranks", "demo/ckpt_4ranks", "demo/strategy_8", "demo/strategy_4",
                               dry_run=True)
        stale = api.superseded("demo/ckpt_4ranks", report.plan, load_strategy("demo/strategy_4"), True, True)
    """
    if not (overwrite and manifest) or not any(f.rank is not None for f in plan.files):
        return []
    from reshard.layout import device_num, stage_count

    total = device_num(dst_strategy) * stage_count(dst_strategy) if dst_strategy is not None else 1
    return _manifest.superseded_outputs(dst, plan, total)


def transform(
    src: str,
    dst_dir: str,
    src_strategy: str | StrategyFile | None = None,
    dst_strategy: str | StrategyFile | None = None,
    *,
    prefix: str | None = None,
    output_format: str | None = None,
    ranks: Sequence[int] | None = None,
    read: ReadOptions | None = None,
    write: WriteOptions | None = None,
    run: RunOptions | None = None,
    overwrite: bool = False,
    dry_run: bool = False,
    resume: bool = False,
    manifest: bool = True,
    hf: bool = False,
    max_shard_size: int | str | None = None,
    iteration: int | None = None,
    common: Mapping[str, object] | None = None,
    optimizer_prefixes: Sequence[str] = (),
    names: NameOptions | None = None,
    dtype: str | None = None,
    dtype_all: bool = False,
    precision: Precision | None = None,
) -> Report:
    """Move a distributed (or full) checkpoint to another layout: full->N, N->M, N->full.

    ``src`` is a folder of ``rank_<r>`` folders, one full checkpoint file, a Hugging Face
    sharded model (its folder or its ``model.safetensors.index.json``), or a MindFormers
    Checkpoint 2.0 (its root or an ``iteration_*`` folder; ``read.iteration`` picks another than
    the tracker's); for a full model and a Checkpoint 2.0 (whose layouts are in its
    ``metadata.json``) ``src_strategy`` must be None. Strategies may be files or folders of per-stage files (merged
    in memory). ``ranks`` restricts the output to some destination ranks (multi-node runs).
    ``hf=True`` writes the full model (no ``dst_strategy``) as Hugging Face shards of at most
    ``max_shard_size`` (default ``5GB``) plus ``model.safetensors.index.json`` into ``dst_dir``.
    ``output_format="checkpoint2"`` writes a MindFormers 2.x Checkpoint 2.0 into ``dst_dir``
    (``iteration_{n:08d}/`` with ``model-``/``opt-`` files per rank, ``metadata.json``,
    ``common.json``, and ``latest_checkpointed_iteration.txt`` last; docs/formats.md §10).

    Args:
        src: The source checkpoint (rank folders, a full file, a Hugging Face model).
        dst_dir: The destination folder: ``rank_<r>/{prefix}<r>.<fmt>`` per destination rank.
        src_strategy: The source's strategy, a path or a loaded ``StrategyFile`` (None: ``src`` is a
            full model).
        dst_strategy: The destination strategy (None: one full model in ``rank_0``).
        prefix: The output file name prefix (None: ``"checkpoint_"``; for Checkpoint 2.0 none, else
            MindFormers' ``<prefix>-model-…``); it may not leave ``dst_dir``.
        output_format: ``"ckpt"``, ``"safetensors"`` or ``"checkpoint2"`` (None: the source's format;
            safetensors from a Hugging Face model).
        ranks: Only these destination ranks (None: all).
        read: How sources are found and opened (decryption key, crc checking, which file of a rank
            folder). None: ``ReadOptions()``, crc trailers checked, no key.
        write: What the outputs hold (``WriteOptions``: crc trailer, encryption, checksum). None: the
            defaults (no crc trailer, no encryption, BLAKE3 in the manifest).
        run: How the run executes (``RunOptions``: workers, memory bound, progress hooks; a
            ``RayOptions`` runs on Ray). None: ``RunOptions()``.
        overwrite: Replace the files this run writes in a non-empty ``dst_dir`` (and remove an earlier
            run's outputs the new layout no longer has). False: a non-empty destination is refused.
        dry_run: Plan only: the sources' headers are read, the destination is not checked and nothing
            is written; the report holds the plan.
        resume: Continue an interrupted run into the same destination, keeping its finished files.
        manifest: Journal the outputs and write ``reshard-manifest.json`` last (False: neither, as
            the MindSpore drop-in does).
        hf: Write Hugging Face shards plus ``model.safetensors.index.json`` (False: not). Every tensor
            the filters keep goes in (the CLI's ``--hf`` keeps weights only: ``NameOptions`` with
            ``weights_only``); a note says when training state does.
        max_shard_size: Largest Hugging Face shard, bytes or a size such as ``"2GB"``; only with
            ``hf`` (None: ``5GB``).
        iteration: Checkpoint 2.0 only: the iteration number (None: the source's, when it is a
            Checkpoint 2.0; else 0).
        common: Checkpoint 2.0 only: ``common.json``'s values (``epoch_num``, ``step_num``,
            ``global_step``, ``loss_scale``, ``global_batch_size``, ``consumed_samples``,
            ``ckpt_status``; a Checkpoint 2.0 source's own values are carried over where not
            given; otherwise None or a missing key: null).
        optimizer_prefixes: Checkpoint 2.0 only: name prefixes that go to the ``opt-`` files besides
            ``reshard.statenames``' defaults (and that ``dtype`` leaves alone).
        dtype: Cast floating model weights to ``"bf16"``, ``"fp16"`` or ``"fp32"`` while copying (None:
            keep every dtype). Integers, bools, strings, float8 and 0-d scalars are never cast; a
            finite value that would overflow to infinity is a ``UsageError`` (docs/formats.md §16).
        dtype_all: With ``dtype``: cast training state (optimizer moments, ``reshard.statenames``)
            too (False: it keeps its dtype).
        names: Which tensors to keep and what to call them (``NameOptions``: include/exclude globs on
            the source's own names, weights only, a ``ModelMap`` of renames and tensor surgery,
            strict). None: every tensor, names kept. Surgery (split, join, stack) needs full tensors
            on one side: a full source, or no destination strategy.
        precision: Block-scaled low precision (``Precision``): ``dequantize="bf16"`` turns every FP8
            block pair and MXFP4 pair into one tensor of that dtype while copying, the scales
            consumed (docs/low-precision.md). None: pairs are copied as they are.

    Returns:
        A ``Report``: the plan, notes for the user (files passed over, merged strategy files ignored),
        the files a resumed run kept, and the name report (``names``).

    Raises:
        UsageError: A missing or unrecognised source, several rank folders without ``src_strategy``,
            a strategy for a full model, an unsafe ``prefix``, conflicting Hugging Face options, a
            missing source rank, write options that do not fit the outputs (see ``execute``), or a
            refused destination (see ``check_destination``), or a model config (``names.config``,
            a preset's, a Hugging Face source's ``config.json``) that the full tensors' shapes contradict.
        LayoutError: A strategy does not fit the tensors or the rank count.
        FormatError: A strategy path that cannot be read, or a source or strategy file that is
            truncated, corrupted or not what it claims.
        CryptoError: An encrypted source does not decrypt with ``read.dec_key`` / ``dec_mode``.
        IntegrityError: A source's crc trailer does not match its content, or copies of one
            slice the strategy calls replicas hold different bytes (sampled, ``reshard.sources.replicas``).
        UnsupportedError: A source holds entries reshard deliberately does not handle (``MapTensor``).
        ReshardError: An output, the journal or the manifest cannot be written (a full disk, say).

    Example:
        from reshard import api
        report = api.transform("demo/ckpt_8ranks", "ckpt_4ranks", "demo/strategy_8", "demo/strategy_4")
        full = api.transform("demo/ckpt_4ranks", "full", "demo/strategy_4", None, output_format="safetensors")
        mf2 = api.transform("demo/ckpt_8ranks", "mf2", "demo/strategy_8", "demo/strategy_4",
                            output_format="checkpoint2", iteration=100, common={"global_step": 100})
        from reshard.naming import NameFilter, NameOptions
        weights = api.transform("demo/ckpt_8ranks", "weights", "demo/strategy_8", None,
                                names=NameOptions(NameFilter(weights_only=True)))
        hf_bf16 = api.transform("demo/ckpt_8ranks", "hf_bf16", "demo/strategy_8", None, hf=True, dtype="bf16")
    """
    cp2_out = output_format == checkpoint2.CHECKPOINT2
    _check_checkpoint2_options(cp2_out, hf, max_shard_size, iteration, common, optimizer_prefixes)
    naming = NameRun(names)
    _refuse_checkpoint2_map(cp2_out, naming)
    prefix = prefix if prefix is not None else ("" if cp2_out else "checkpoint_")
    layout_dir.check_prefix(prefix)  # before anything is read: output names never leave the destination
    notes: list[str] = []
    shard_size = _shard_size(hf, max_shard_size)
    if shard_size is not None and (dst_strategy is not None or output_format == "ckpt"):
        raise UsageError(
            "Hugging Face output is a full safetensors model: give no destination strategy and no ckpt output format"
        )
    kind = identify(src, _transform_kinds(src, src_strategy))
    check_iteration(src, kind, read)
    if kind is CHECKPOINT2:
        _checkpoint2_strategy(src, src_strategy, None)  # refused before any file is read
    dst_sf = _strategy(dst_strategy, notes)
    plan_dst: LayoutTable | None = dst_sf
    rule = statenames.DEFAULT.with_prefixes(optimizer_prefixes)
    cast = cast_rule(dtype, dtype_all, optimizer_prefixes)
    dequantizer = _dequantizer(precision, src)
    if dequantizer is not None:
        dequantizer.defer(naming.model_map is not None)  # --quantize: DeepSeek's rule on the map's outputs
    if cp2_out:
        _check_checkpoint2_write(write)
        output_format = "safetensors"
    src_sf: StrategyFile | None = None
    everyone: Plan | None = None
    if kind in (HUGGING_FACE, UNIFIED):
        if src_strategy is not None:
            raise UsageError(f"{kind.name} is a full model: give no source strategy", src)
        files, mapping, hyper = unified_index(src)
        if hyper is not None:  # unify --hf keeps them beside the shards; a full model holds them
            files[HYPER_NAME] = hyper
            mapping = {**mapping, **{n: HYPER_NAME for n in hyper.tensors if n not in mapping}}
        files, mapping, _ = naming.narrow_full(files, mapping)
        if dequantizer is not None:
            files, mapping = dequantizer.full(files, mapping)
        files = cast_files(files, cast, notes)
        model = naming.mapped_model(files, mapping)  # a preset for another family is refused first
        naming.check_config(_full_tensors(files.values()), _source_config(src, kind))
        if model is not None:
            files, mapping = {MAPPED_SOURCE: model.source}, model.name_to_file
        if cp2_out:
            plan_dst = _checkpoint2_destination(dst_sf, list(mapping), rule, notes)
        pairs = full_pairs({n: files[f].tensors[n] for n, f in mapping.items()})
        plan_dst = _paired(plan_dst, pairs, precision, src, "destination", notes)
        plan = plan_transform_full(files, mapping, plan_dst, dst_dir, prefix, output_format or "safetensors", ranks)
        plan = model.resolve(plan) if model is not None else plan
        if cp2_out:
            everyone = _everyone(
                ranks, lambda: plan_transform_full(files, mapping, plan_dst, dst_dir, "", "safetensors")
            )
    else:
        opened = kind.open(src, read, notes)
        src_sf = (
            _checkpoint2_strategy(src, src_strategy, opened) if kind is CHECKPOINT2 else _strategy(src_strategy, notes)
        )
        narrowed, stored_sf = naming.narrow(opened.ranks), src_sf
        src_sf = _paired(src_sf, sharded_pairs(narrowed, src_sf), precision, src, "source", notes, narrowed, src_sf)
        fmt, sources = opened.fmt or "ckpt", cast_files(_dequantized(narrowed, dequantizer, src_sf), cast, notes)
        if src_sf is None and len(sources) > 1:
            raise UsageError(
                "several rank folders but no source strategy (--src-strategy, src_strategy in Python)", src
            )
        if cp2_out:
            held = list(dict.fromkeys(n for f in sources.values() for n in f.tensors))
            plan_dst = _checkpoint2_destination(dst_sf, held, rule, notes)
        read_sources, model = sources, naming.mapped_file(sources) if src_sf is None else None
        if src_sf is None:  # one full file
            naming.check_config(_full_tensors(sources.values()))
        if model is not None:  # one full file: the map first, so a destination strategy slices its outputs
            sources = {r: replace(model.source, rank=r) for r in sources}
        pairs = (
            sharded_pairs(sources, src_sf) if src_sf is not None else full_pairs(next(iter(sources.values())).tensors)
        )
        plan_dst = _paired(plan_dst, pairs, precision, src, "destination", notes, narrowed, stored_sf)
        plan = plan_transform(sources, src_sf, plan_dst, dst_dir, prefix, output_format or fmt, ranks)
        _check_copies(read_sources, src_sf, read)
        if model is not None:
            plan = model.resolve(plan)
        plan = naming.after(plan, list(read_sources.values()), full=plan_dst is None)
        if cp2_out:
            everyone = _everyone(ranks, lambda: plan_transform(sources, src_sf, plan_dst, dst_dir, "", "safetensors"))
    if cp2_out:
        if kind is CHECKPOINT2:  # the source's own iteration and common.json carry over unless given
            iteration, common = _carried_over(src, read, iteration, common, notes)
        plan = _checkpoint2_plan(plan, src_sf, plan_dst, dst_dir, iteration, common, prefix, rule, everyone, notes)
    if plan_dst is None and not cp2_out:  # a full model out: its tensors are whole
        naming.check_config(_plan_tensors(plan))
    plan = dequantizer.planned(plan, plan_dst is None) if dequantizer is not None else plan
    if shard_size is not None:
        plan = hf_sharded(plan, dst_dir, shard_size)
        _training_state_note(plan, notes)
    plan = _with_dequantized(plan, dequantizer, notes, read)
    kept: list[str] = []
    if not dry_run:
        check_destination(dst_dir, [model_folder(src), *_strategy_paths(src_strategy, dst_strategy)], overwrite, resume)
        if cp2_out:
            remove = _checkpoint2_superseded(dst_dir, plan, overwrite, resume)
        else:
            remove = superseded(dst_dir, plan, dst_sf, overwrite, manifest)
        kept = _kept_note(
            execute(
                plan, read=read, write=write, run=run, root=dst_dir, resume=resume, manifest=manifest, remove=remove
            ),
            notes,
        )
    return Report(plan, notes, kept, naming.report if naming.active else None)


def _strategy_paths(*strategies: object) -> list[str]:
    """The strategies given as paths (a run reads them: a destination must not replace them)."""
    return [os.fspath(s) for s in strategies if isinstance(s, str | os.PathLike)]


def _check_copies(sources: Mapping[int, SourceFile], sf: LayoutTable | None, read: ReadOptions | None) -> None:
    """The copies of a slice the source strategy calls replicas hold the same bytes (sampled:
    ``reshard.sources.replicas``), checked once a plan is made from them, before any byte is written."""
    if sf is not None:
        from reshard.sources.replicas import check_replicas

        check_replicas(sources, sf, read)


def _full_tensors(files: Iterable[SourceFile]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a full model's tensors, for ``NameRun.check_config`` (read only with a config)."""
    return ((name, t.shape) for f in files for name, t in f.tensors.items())


def _plan_tensors(plan: Plan) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a plan's output tensors (whole tensors when it writes a full model)."""
    return ((t.name, t.shape) for f in plan.files for t in f.tensors)


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


def _refuse_checkpoint2_map(cp2_out: bool, naming: NameRun) -> None:
    """Checkpoint 2.0 output places tensors by the strategy's names: filters fit, maps do not (yet)."""
    if cp2_out and naming.model_map is not None:
        raise UnsupportedError(
            "renames and tensor surgery are not supported with Checkpoint 2.0 output; write safetensors or ckpt"
        )


def _check_checkpoint2_options(
    cp2_out: bool,
    hf: bool,
    max_shard_size: int | str | None,
    iteration: object,
    common: Mapping[str, object] | None,
    optimizer_prefixes: Sequence[str],
) -> None:
    """Checkpoint 2.0 options only with Checkpoint 2.0 output, and no Hugging Face output with it."""
    if not cp2_out:
        given = [n for n, v in (("iteration", iteration), ("common", common)) if v is not None]
        given += ["optimizer prefixes"] if optimizer_prefixes else []
        if given:
            raise UsageError(f"{' and '.join(given)} only apply to --output-format checkpoint2")
        return
    if hf or max_shard_size is not None:
        raise UsageError("a Checkpoint 2.0 is not a Hugging Face model: give --hf or --output-format checkpoint2")
    if iteration is not None:
        checkpoint2.check_iteration(iteration)
    checkpoint2.check_common(common)
    for p in optimizer_prefixes:
        if not isinstance(p, str) or not p:
            raise UsageError(f"an optimizer prefix must be a non-empty string, not {p!r}")


def _check_checkpoint2_write(write: WriteOptions | None) -> None:
    """Checkpoint 2.0 files are safetensors: no crc trailer, no encryption (both .ckpt features)."""
    if write is not None and write.write_crc:
        raise UsageError("a crc trailer is a .ckpt feature; Checkpoint 2.0 files are safetensors")
    if write is not None and write.enc_key is not None:
        raise UsageError("only .ckpt outputs can be encrypted; Checkpoint 2.0 files are safetensors")


def _checkpoint2_destination(
    dst_sf: StrategyFile | None, names: Sequence[str], rule: statenames.StateNames, notes: list[str]
) -> LayoutTable | None:
    """The destination strategy a Checkpoint 2.0 is planned with: without optimizer shards, and
    with a layout for each training state of ``names`` it lacks, taken from its parameter's."""
    if dst_sf is None:
        return None
    sharded = list(dict.fromkeys(split_stage_name(n)[1] for n, p in dst_sf.layouts.items() if has_optimizer_shard(p)))
    if sharded:
        notes.append(
            f"the destination strategy shards {len(sharded)} parameter(s) for the optimizer (e.g. {sharded[0]!r}); "
            "a Checkpoint 2.0 layout cannot say so, so each rank holds its model-parallel slice, as "
            "MindFormers' loader expects (docs/formats.md §10.3)"
        )
    completed = CompletedTable(dst_sf, tuple(n for n in names if rule.is_state(n)))
    added = list(dict.fromkeys(split_stage_name(k)[1] for k in completed.layouts if k not in dst_sf.layouts))
    if added:
        notes.append(
            f"the destination strategy has no layout for {len(added)} training state(s) (e.g. {added[0]!r}); "
            "each takes its parameter's, as MindFormers does (docs/formats.md §10.3)"
        )
    return ModelParallelTable(completed)


def _everyone(ranks: Sequence[int] | None, plan_all: Callable[[], Plan]) -> Plan | None:
    """With ``--ranks`` including rank 0: the plan of every rank, which ``metadata.json`` describes."""
    if ranks is None or 0 not in ranks:
        return None
    try:
        return plan_all()
    except ReshardError as exc:
        raise UsageError(
            "the run that writes rank 0 of a Checkpoint 2.0 also writes metadata.json, which lists every "
            f"rank's files, so it needs every source rank: {exc.detail}",
            exc.path,
        ) from None


def _carried_over(
    src: str, read: ReadOptions | None, iteration: int | None, common: Mapping[str, object] | None, notes: list[str]
) -> tuple[int | None, dict[str, object]]:
    """A Checkpoint 2.0 written from a Checkpoint 2.0: its iteration number (unless given) and the
    values of its ``common.json`` (each one given overrides), so a moved training run resumes at the
    same step with the same loss scale and sample count (docs/formats.md §10)."""
    folder = iteration_folder(src, read)
    if iteration is None:
        iteration = checkpoint2.iteration_of(folder)
    source = {k: v for k, v in (checkpoint2.read_common(folder) or {}).items() if k in checkpoint2.COMMON_KEYS}
    carried = sorted(k for k, v in source.items() if v is not None and k not in (common or {}))
    if carried:
        notes.append(f"common.json: {', '.join(carried)} carried over from the source")
    return iteration, {**source, **(common or {})}


def _checkpoint2_plan(
    plan: Plan,
    src_sf: LayoutTable | None,
    dst: LayoutTable | None,
    dst_dir: str,
    iteration: int | None,
    common: Mapping[str, object] | None,
    prefix: str,
    rule: statenames.StateNames,
    everyone: Plan | None,
    notes: list[str],
) -> Plan:
    number = iteration if iteration is not None else checkpoint2.DEFAULT_ITERATION
    out = plan_checkpoint2(
        plan, src_sf, dst, dst_dir, iteration=number, common=common, prefix=prefix, state_names=rule, everyone=everyone
    )
    tracker = os.path.join(dst_dir, checkpoint2.TRACKER_NAME)
    if tracker not in {t.path for t in out.texts}:
        notes.append(
            f"{checkpoint2.TRACKER_NAME} (MindFormers' completion marker) is written only by a run that writes "
            f"every rank: once all ranks are written, put {number} in it, or load "
            f"{checkpoint2.iteration_dir(dst_dir, number)} directly"
        )
    return out


def _checkpoint2_superseded(dst: str, plan: Plan, overwrite: bool, resume: bool) -> list[str]:
    """What a Checkpoint 2.0 run into ``dst`` removes once it holds the lock.

    The tracker goes first (``overwrite`` or ``resume``): a checkpoint never looks complete while
    its files are being replaced. With ``overwrite``, files an earlier reshard run wrote into the
    iteration folder that this run does not write (another world size's) go too; a tensor file,
    ``metadata.json`` or ``common.json`` reshard did not write is refused: MindFormers would read
    it as part of this checkpoint.
    """
    if not os.path.isdir(dst) or not (overwrite or resume):
        return []
    tracker = os.path.join(dst, checkpoint2.TRACKER_NAME)
    doomed = [tracker] if os.path.isfile(tracker) else []
    if not overwrite:
        return doomed
    ours = {os.path.abspath(p) for p in [f.path for f in plan.files] + [t.path for t in plan.texts]}
    listed = {os.path.normpath(os.path.join(os.path.abspath(dst), rel)) for rel in _manifest.previous_outputs(dst)}
    for folder in sorted({os.path.dirname(os.path.abspath(f.path)) for f in plan.files}):
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
            path = os.path.join(folder, name)
            if path in ours or not os.path.isfile(path):
                continue
            if path in listed:
                doomed.append(path)
            elif name.endswith(".safetensors") or name in (checkpoint2.METADATA_NAME, checkpoint2.COMMON_NAME):
                raise UsageError(
                    "reshard did not write this, and MindFormers would read it as part of this checkpoint; "
                    "move it away, or choose another destination or --iteration",
                    path,
                )
    return doomed


def _transform_kinds(src: str, src_strategy: object) -> tuple[Kind, ...]:
    """What transform reads: rank folders, a MindFormers Checkpoint 2.0, a full checkpoint, a unify
    output, a Hugging Face model; one rank's folder only as the full checkpoint it holds, and never
    with a source strategy (its parent was meant)."""
    kinds: tuple[Kind, ...] = (HUGGING_FACE, UNIFIED, RANK_FOLDERS, CHECKPOINT2, ENCRYPTED_CKPT, FULL_FILE)
    if src_strategy is None and full_model_file(src) is not None:
        kinds += (ONE_RANK_FOLDER,)
    return kinds


def _checkpoint2_strategy(src: str, src_strategy: object, opened: Opened | None) -> StrategyFile | None:
    """A Checkpoint 2.0's layouts come from its metadata.json (docs/formats.md §13): no strategy is taken."""
    if src_strategy is not None:
        raise UsageError(
            "a MindFormers Checkpoint 2.0 carries its layouts in metadata.json: give no source strategy", src
        )
    return opened.strategy if opened is not None else None


def _shard_size(hf: bool, max_shard_size: int | str | None) -> int | None:
    """The Hugging Face shard size in bytes, or None without ``hf``."""
    if not hf:
        if max_shard_size is not None:
            raise UsageError("a maximum shard size needs Hugging Face output (--hf)")
        return None
    return parse_size(hf_index.DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size, "the shard size")


def _training_state_note(plan: Plan, notes: list[str]) -> None:
    """A Hugging Face folder is what ``transformers`` loads (weights only): say when training state goes in."""
    state = sorted({t.name for f in plan.files for t in f.tensors if statenames.DEFAULT.is_state(t.name)})
    if state:
        shown = ", ".join(state[:3]) + (", ..." if len(state) > 3 else "")
        notes.append(
            f"the Hugging Face output holds {len(state)} training-state tensor(s) beside the weights ({shown}); "
            "transformers loads model weights only"
        )


def _kept_note(kept: list[str], notes: list[str]) -> list[str]:
    if kept:
        notes.append(f"resume: kept {len(kept)} finished file(s) of the earlier run (verified against its journal)")
    return kept


def transform_by_rank(
    rank: int,
    files_map: Mapping[int, str],
    out_file: str,
    src_strategy: str | StrategyFile | None = None,
    dst_strategy: str | StrategyFile | None = None,
    *,
    read: ReadOptions | None = None,
    write: WriteOptions | None = None,
    run: RunOptions | None = None,
    dry_run: bool = False,
    manifest: bool = True,
) -> Report:
    """Write only destination ``rank``'s file from ``{source rank: file}`` (multi-node building block).

    The manifest goes next to ``out_file``. ``files_map`` needs the source ranks ``needed_ranks``
    names, and no others.

    Args:
        rank: The destination rank to write.
        files_map: Source rank -> its checkpoint file.
        out_file: The output file; its extension (``.ckpt`` / ``.safetensors``) is the format.
        src_strategy: The source strategy, a path or a ``StrategyFile`` (None: the source is a full
            model).
        dst_strategy: The destination strategy (None: a full model).
        read: How sources are found and opened (decryption key, crc checking, which file of a rank
            folder). None: ``ReadOptions()``, crc trailers checked, no key.
        write: What the outputs hold (``WriteOptions``: crc trailer, encryption, checksum). None: the
            defaults (no crc trailer, no encryption, BLAKE3 in the manifest).
        run: How the run executes (``RunOptions``: workers, memory bound, progress hooks; a
            ``RayOptions`` runs on Ray). None: ``RunOptions()``.
        dry_run: Plan only: the sources' headers are read, the destination is not checked and nothing
            is written; the report holds the plan.
        manifest: Journal the outputs and write ``reshard-manifest.json`` last (False: neither, as
            the MindSpore drop-in does).

    Returns:
        A ``Report`` holding the plan (no notes).

    Raises:
        UsageError: A missing source file, a needed source rank missing from ``files_map``, an
            ``out_file`` that is a source or lies in a source folder, or write options that do not
            fit the output (see ``execute``).
        LayoutError: ``rank`` or the tensors do not fit the strategies.
        FormatError: A strategy path that cannot be read, or a source or strategy file that is
            truncated, corrupted or not what it claims.
        CryptoError: An encrypted source does not decrypt with ``read.dec_key`` / ``dec_mode``.
        IntegrityError: A source's crc trailer does not match its content, or copies of one
            slice the strategy calls replicas hold different bytes (sampled, ``reshard.sources.replicas``).
        UnsupportedError: A source holds entries reshard deliberately does not handle (``MapTensor``).
        ReshardError: An output, the journal or the manifest cannot be written (a full disk, say).

    Example:
        from reshard import api
        needed = api.needed_ranks(0, "demo/strategy_8", "demo/strategy_4")
        files = {r: f"demo/ckpt_8ranks/rank_{r}/checkpoint_{r}.ckpt" for r in needed}
        api.transform_by_rank(0, files, "out/checkpoint_0.ckpt", "demo/strategy_8", "demo/strategy_4")
    """
    sources = {int(r): source_file(p, int(r), read) for r, p in files_map.items()}
    src_sf = _strategy(src_strategy)
    plan = plan_transform_by_rank(rank, sources, out_file, src_sf, _strategy(dst_strategy))
    _check_copies(sources, src_sf, read)
    if not dry_run:
        strategies = _strategy_paths(src_strategy, dst_strategy)
        _destination.check_not_source(out_file, [*files_map.values(), *strategies], "output file")
        execute(plan, read=read, write=write, run=run, manifest=manifest)
    return Report(plan, [])


def needed_ranks(
    rank_id: int,
    src_strategy: str | StrategyFile | None,
    dst_strategy: str | StrategyFile | None = None,
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

    src_sf, dst_sf = _strategy(src_strategy, notes), _strategy(dst_strategy, notes)
    if src_sf is None:
        return [0]
    dst_map = layout_map(dst_sf, rank_id) if dst_sf is not None else None
    return layout.rank_list_for_transform(rank_id, layout_map(src_sf), dst_map)


def unify(
    src_dir: str,
    src_strategy: str | StrategyFile | None,
    dst_dir: str,
    *,
    file_suffix: str | None = None,
    choice_func: ChoiceFunc | None = None,
    split_dst_file: tuple[int, int] | tuple[()] = (),
    read: ReadOptions | None = None,
    write: WriteOptions | None = None,
    run: RunOptions | None = None,
    overwrite: bool = False,
    dry_run: bool = False,
    mindspore_order: bool = False,
    resume: bool = False,
    manifest: bool = True,
    hf: bool = False,
    max_shard_size: int | str | None = None,
    names: NameOptions | None = None,
    dtype: str | None = None,
    dtype_all: bool = False,
    precision: Precision | None = None,
) -> Report:
    """Merge N rank shards into full tensors: ``part<j>.safetensors`` + ``param_name_map.json``.

    Parts are packed from the rank folders in rank order; ``mindspore_order=True`` uses the
    folder listing order as MindSpore does (same packing and index order as its output).
    ``hf=True`` writes Hugging Face shards (``model-00001-of-0000N.safetensors`` of at most
    ``max_shard_size``, default ``5GB``) and ``model.safetensors.index.json`` instead (one
    ``model.safetensors`` when everything fits); ``hyper_param.safetensors`` is written as usual.

    Args:
        src_dir: The folder of ``rank_<r>`` folders holding ``.safetensors`` files, or a MindFormers
            Checkpoint 2.0 (its root or an ``iteration_*`` folder; ``read.iteration`` picks one).
        src_strategy: Their strategy, a path (file or folder of per-stage files) or a ``StrategyFile``
            (None for a Checkpoint 2.0: its layouts are in its ``metadata.json``).
        dst_dir: The output folder.
        file_suffix: Read the file of each rank folder whose name ends with this (None: MindSpore's
            rule for choosing one).
        choice_func: MindSpore's ``choice_func(name)``: False moves a parameter to
            ``hyper_param.safetensors``, a str renames it (None: every parameter kept as named).
        split_dst_file: ``(index, count)``: write only part ``index`` of ``count`` (default ``()``: all).
        read: How sources are found and opened (decryption key, crc checking, which file of a rank
            folder). None: ``ReadOptions()``, crc trailers checked, no key.
        write: What the outputs hold (``WriteOptions``: crc trailer, encryption, checksum). None: the
            defaults (no crc trailer, no encryption, BLAKE3 in the manifest).
        run: How the run executes (``RunOptions``: workers, memory bound, progress hooks; a
            ``RayOptions`` runs on Ray). None: ``RunOptions()``.
        overwrite: Replace the files this run writes in a non-empty ``dst_dir`` (and remove an earlier
            run's outputs the new layout no longer has). False: a non-empty destination is refused.
        dry_run: Plan only: the sources' headers are read, the destination is not checked and nothing
            is written; the report holds the plan.
        mindspore_order: Pack in the folder listing order, as MindSpore (False: rank order).
        resume: Continue an interrupted run into the same destination, keeping its finished files.
        manifest: Journal the outputs and write ``reshard-manifest.json`` last (False: neither, as
            the MindSpore drop-in does).
        hf: Write Hugging Face shards plus ``model.safetensors.index.json`` (False: not). Every tensor
            the filters keep goes in (the CLI's ``--hf`` keeps weights only: ``NameOptions`` with
            ``weights_only``); a note says when training state does.
        max_shard_size: Largest Hugging Face shard, bytes or a size such as ``"2GB"``; only with
            ``hf`` (None: ``5GB``).
        names: Which tensors to keep and what to call them (``NameOptions``; None: all, names
            kept). A map is applied to the full tensors; with ``hf`` the index names the outputs.
        dtype: Cast floating model weights to ``"bf16"``, ``"fp16"`` or ``"fp32"`` while copying (None:
            keep every dtype). Integers, bools, strings, float8 and 0-d scalars are never cast; a
            finite value that would overflow to infinity is a ``UsageError`` (docs/formats.md §16).
        dtype_all: With ``dtype``: cast training state (optimizer moments, ``reshard.statenames``)
            too (False: it keeps its dtype).
        precision: Block-scaled low precision (``Precision``): ``dequantize="bf16"`` turns every FP8
            block pair and MXFP4 pair into one tensor of that dtype while copying, the scales
            consumed (docs/low-precision.md). None: pairs are copied as they are.

    Returns:
        A ``Report``: the plan, notes (files passed over), the files a resumed run kept and the
        name report.

    Raises:
        UsageError: ``src_dir`` is not rank folders of ``.safetensors`` files, ``split_dst_file``
            with ``hf``, write options that do not fit the outputs (see ``execute``), a refused
            destination (see ``check_destination``), or a model config (``names``) that the full
            tensors' shapes contradict.
        LayoutError: The strategy does not fit the tensors, or describes fewer ranks than there are
            rank folders.
        FormatError: A strategy path that cannot be read, or a source or strategy file that is
            truncated, corrupted or not what it claims.
        IntegrityError: Copies of one slice the strategy calls replicas hold different bytes.
        UnsupportedError: A source holds entries reshard deliberately does not handle.
        ReshardError: An output, the journal or the manifest cannot be written (a full disk, say).

    Example:
        from reshard import api
        api.unify("demo/st_8ranks", "demo/strategy_8", "unified")
    """
    notes: list[str] = []
    cast = cast_rule(dtype, dtype_all)
    shard_size = _shard_size(hf, max_shard_size)
    if shard_size is not None and split_dst_file:
        raise UsageError("split_dst_file (--split) does not apply to Hugging Face output")
    sf: StrategyFile | None
    kind = identify(src_dir, (RANK_FOLDERS, CHECKPOINT2))
    check_iteration(src_dir, kind, read)
    if kind is CHECKPOINT2:
        sources, sf = _checkpoint2_ranks(src_dir, src_strategy, read, notes)
    else:
        _refuse_ckpt_ranks(src_dir)
        _, sources = rank_sources(src_dir, "safetensors", None, file_suffix, read, notes, mindspore_order)
        sf = _strategy(src_strategy, notes)
    if sf is None:
        raise UsageError("unify needs the source strategy")
    _check_unify_ranks(src_dir, sources, sf, notes)
    naming = NameRun(names)
    dequantizer = _dequantizer(precision, src_dir)
    narrowed_ranks = naming.narrow(sources)
    sf = _paired(sf, sharded_pairs(narrowed_ranks, sf), precision, src_dir, "source", notes, narrowed_ranks, sf) or sf
    sources = cast_files(_dequantized(narrowed_ranks, dequantizer, sf), cast, notes)
    narrowed = list(sources.values())

    def mapped(whole: Plan) -> Plan:
        return naming.after(whole, narrowed, full=True)

    if shard_size is not None:  # mapped before the shards are packed
        plan = plan_unify_hf(sources, sf, dst_dir, choice_func, shard_size, mapped)
        _training_state_note(plan, notes)
    else:
        plan = mapped(plan_unify(sources, sf, dst_dir, choice_func, split_dst_file))
    _check_copies(sources, sf, read)
    naming.check_config(_plan_tensors(plan))
    plan = _with_dequantized(plan, dequantizer, notes, read)
    kept: list[str] = []
    if not dry_run:
        check_destination(dst_dir, [src_dir], overwrite, resume)
        kept = _kept_note(
            execute(plan, read=read, write=write, run=run, root=dst_dir, resume=resume, manifest=manifest), notes
        )
    return Report(plan, notes, kept, naming.report if naming.active else None)


def _checkpoint2_ranks(
    src: str, src_strategy: object, read: ReadOptions | None, notes: list[str]
) -> tuple[dict[int, SourceFile], StrategyFile]:
    """A Checkpoint 2.0's virtual ranks and the strategy its metadata.json gives (a single card: one device)."""
    from reshard.formats.strategy import make_strategy
    from reshard.layout import ParamLayout

    opened = CHECKPOINT2.open(src, read, notes)
    sf = _checkpoint2_strategy(src, src_strategy, opened)
    if sf is None:  # a single card: every tensor whole on one device
        tensors = opened.ranks[0].tensors
        sf = make_strategy({n: ParamLayout((1,), (-1,) * len(t.shape)) for n, t in tensors.items() if t.shape})
    return opened.ranks, sf


def _refuse_ckpt_ranks(src_dir: str) -> None:
    """unify reads safetensors: rank folders of .ckpt files get the two ways forward, not "missing"."""
    dirs = layout_dir.rank_dirs(src_dir) if os.path.isdir(src_dir) else {}
    folders = list(dirs.values())
    if (
        folders
        and not any(layout_dir.files_in(d, "safetensors") for d in folders)
        and any(layout_dir.files_in(d, "ckpt") for d in folders)
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


def split(
    unified_dir: str,
    dst_strategy: str | StrategyFile,
    dst_dir: str,
    *,
    ranks: Sequence[int] | None = None,
    output_format: str = "safetensors",
    name_map: Mapping[str, str] | None = None,
    write: WriteOptions | None = None,
    run: RunOptions | None = None,
    overwrite: bool = False,
    dry_run: bool = False,
    resume: bool = False,
    manifest: bool = True,
    names: NameOptions | None = None,
    dtype: str | None = None,
    dtype_all: bool = False,
    precision: Precision | None = None,
) -> Report:
    """Slice a unified (full) model into ``dst_dir/rank_<r>/net.<fmt>`` for a target strategy.

    ``unified_dir`` may also be a Hugging Face sharded model (its folder or its index file) or one
    full checkpoint.

    Args:
        unified_dir: The unified folder (``part<j>.safetensors`` + ``param_name_map.json``), a
            Hugging Face model or a full checkpoint.
        dst_strategy: The destination strategy, a path or a ``StrategyFile``.
        dst_dir: The output folder.
        ranks: Only these destination ranks (None: all).
        output_format: ``"safetensors"`` (default) or ``"ckpt"``.
        name_map: Output name -> name in the unified model (None: names kept).
        write: What the outputs hold (``WriteOptions``: crc trailer, encryption, checksum). None: the
            defaults (no crc trailer, no encryption, BLAKE3 in the manifest).
        run: How the run executes (``RunOptions``: workers, memory bound, progress hooks; a
            ``RayOptions`` runs on Ray). None: ``RunOptions()``.
        overwrite: Replace the files this run writes in a non-empty ``dst_dir`` (and remove an earlier
            run's outputs the new layout no longer has). False: a non-empty destination is refused.
        dry_run: Plan only: the sources' headers are read, the destination is not checked and nothing
            is written; the report holds the plan.
        resume: Continue an interrupted run into the same destination, keeping its finished files.
        manifest: Journal the outputs and write ``reshard-manifest.json`` last (False: neither, as
            the MindSpore drop-in does).
        names: Which tensors to keep and what to call them (``NameOptions``; None: all, names
            kept). A map is applied to the full model first, so the strategy names its outputs.
        dtype: Cast floating model weights to ``"bf16"``, ``"fp16"`` or ``"fp32"`` while copying (None:
            keep every dtype). Integers, bools, strings, float8 and 0-d scalars are never cast; a
            finite value that would overflow to infinity is a ``UsageError`` (docs/formats.md §16).
        dtype_all: With ``dtype``: cast training state (optimizer moments, ``reshard.statenames``)
            too (False: it keeps its dtype).
        precision: Block-scaled low precision (``Precision``): ``dequantize="bf16"`` turns every FP8
            block pair and MXFP4 pair into one tensor of that dtype while copying, the scales
            consumed (docs/low-precision.md). None: pairs are copied as they are.

    Returns:
        A ``Report``: the plan, notes, the files a resumed run kept and the name report.

    Raises:
        UsageError: ``unified_dir`` is not a full model, write options that do not fit the outputs
            (see ``execute``), or a refused destination (see ``check_destination``).
        LayoutError: The strategy does not fit the tensors.
        FormatError: A strategy path that cannot be read, or a source or strategy file that is
            truncated, corrupted or not what it claims.
        IntegrityError: A full ``.ckpt`` source's crc trailer does not match.
        ReshardError: An output, the journal or the manifest cannot be written (a full disk, say).

    Example:
        from reshard import api
        api.unify("demo/st_8ranks", "demo/strategy_8", "unified")
        api.split("unified", "demo/strategy_4", "st_4ranks", ranks=[0, 1])
    """
    cast = cast_rule(dtype, dtype_all)
    files, mapping, hyper = unified_index(unified_dir, name_map)
    notes: list[str] = []
    sf = _strategy(dst_strategy, notes)
    if sf is None:
        raise UsageError("split needs the destination strategy")
    naming = NameRun(names)
    files, mapping, hyper = naming.narrow_full(files, mapping, hyper)
    dequantizer = _dequantizer(precision, unified_dir)
    if dequantizer is not None:
        files, mapping = dequantizer.full(files, mapping)
    files = cast_files(files, cast, notes)
    if hyper is not None:
        hyper = cast_files({0: hyper}, cast)[0]
    model = naming.mapped_model(files, mapping)
    naming.check_config(_full_tensors(files.values()))
    if model is not None:
        files, mapping = {MAPPED_SOURCE: model.source}, model.name_to_file
    pairs = full_pairs({n: files[f].tensors[n] for n, f in mapping.items()})
    paired = _paired(sf, pairs, precision, unified_dir, "destination", notes) or sf
    plan = plan_split(files, mapping, hyper, paired, dst_dir, output_format, ranks, name_map)
    plan = model.resolve(plan) if model is not None else plan
    plan = _with_dequantized(plan, dequantizer, notes)
    kept: list[str] = []
    if not dry_run:
        check_destination(dst_dir, [model_folder(unified_dir)], overwrite, resume)
        remove = superseded(dst_dir, plan, sf, overwrite, manifest)
        kept = _kept_note(
            execute(plan, write=write, run=run, root=dst_dir, resume=resume, manifest=manifest, remove=remove), notes
        )
    return Report(plan, notes, kept, naming.report if naming.active else None)


def convert_targets(
    src: str,
    dst: str | None,
    to: str,
    file_regex: str | None = None,
    choose: ReadOptions | None = None,
    notes: list[str] | None = None,
) -> list[tuple[str, str]]:
    """The (input, output) pairs of a convert: a file, or every matching file of the ``rank*`` folders.

    With ``choose.file_suffix`` or ``choose.pick``, one file per rank folder (a note names it).

    Args:
        src: A checkpoint file, or a folder of ``rank*`` folders.
        dst: The output folder (None: next to the inputs).
        to: The output format, ``"ckpt"`` or ``"safetensors"``.
        file_regex: Only inputs whose name matches (None: all).
        choose: Read options choosing one file per rank folder (None: every file).
        notes: A list the notes are appended to (None: dropped).

    Returns:
        The pairs, in rank folder order; empty when ``file_regex`` matches nothing.

    Raises:
        UsageError: A missing source, or a file of the wrong extension.

    Example:
        from reshard import api
        pairs = api.convert_targets("demo/ckpt_8ranks", "st_8ranks", "safetensors")
    """
    import re

    src_ext = ".ckpt" if to == "safetensors" else ".safetensors"
    dst_ext = "." + to
    pattern = re.compile(file_regex) if file_regex else None
    if identify(src, CHECKPOINTS) is not RANK_FOLDERS:
        src = full_model_file(src) or src
        if not src.endswith(src_ext):
            raise UsageError(f"expected a {src_ext} file", src)
        if pattern and not pattern.findall(src):
            return []
        out_dir = dst or os.path.dirname(os.path.abspath(src))
        return [(src, os.path.join(out_dir, os.path.basename(src).replace(src_ext, dst_ext)))]
    pairs = []
    for sub in rank_subfolders(src):
        folder = os.path.join(src, sub)
        names = chosen_names(folder, src_ext[1:], choose, notes) if choose else sorted(os.listdir(folder))
        for name in names:
            if name.endswith(src_ext) and (pattern is None or pattern.search(name)):
                out_dir = os.path.join(dst, sub) if dst else folder
                pairs.append((os.path.join(folder, name), os.path.join(out_dir, name.replace(src_ext, dst_ext))))
    return pairs


def convert(
    src: str,
    dst: str | None,
    to: str,
    *,
    name_map: Mapping[str, str] | None = None,
    file_regex: str | None = None,
    read: ReadOptions | None = None,
    write: WriteOptions | None = None,
    run: RunOptions | None = None,
    dry_run: bool = False,
    overwrite: bool = False,
    resume: bool = False,
    manifest: bool = True,
    hf: bool = False,
    max_shard_size: int | str | None = None,
    names: NameOptions | None = None,
    dtype: str | None = None,
    dtype_all: bool = False,
    precision: Precision | None = None,
) -> Report:
    """Convert ``.ckpt`` <-> ``.safetensors`` for one file or a folder of ``rank*`` folders.

    Without ``dst`` one file's output goes next to it (as MindSpore does) and the manifest into its
    folder; existing outputs are then refused unless ``overwrite``/``resume``. ``rank*`` folders
    without ``dst`` are refused unless ``manifest=False`` (the MindSpore drop-in: outputs beside
    the inputs, no manifest), since the run would write inside its source. ``hf=True`` converts
    one full ``.ckpt`` file into Hugging Face shards (at most ``max_shard_size``, default ``5GB``)
    + ``model.safetensors.index.json``.
    ``.ckpt`` sources with ``to="ckpt"`` are re-written into ``dst`` (``recrypt``): encrypted with
    ``write.enc_key`` (after decrypting with ``read.dec_key`` when given) or decrypted (only
    ``read.dec_key``); with neither key there is nothing to do, a usage error. A folder without
    ``rank*`` folders that holds one checkpoint file stands for that file.

    Args:
        src: A checkpoint file, or a folder of ``rank*`` folders.
        dst: The output folder (None: next to the inputs; rank folders only with ``manifest=False``).
        to: The output format, ``"ckpt"`` or ``"safetensors"``.
        name_map: Output name -> source name (None: names kept).
        file_regex: Only inputs whose name matches (None: all).
        read: How sources are found and opened (decryption key, crc checking, which file of a rank
            folder). None: ``ReadOptions()``, crc trailers checked, no key.
        write: What the outputs hold (``WriteOptions``: crc trailer, encryption, checksum). None: the
            defaults (no crc trailer, no encryption, BLAKE3 in the manifest).
        run: How the run executes (``RunOptions``: workers, memory bound, progress hooks; a
            ``RayOptions`` runs on Ray). None: ``RunOptions()``.
        dry_run: Plan only: the sources' headers are read, the destination is not checked and nothing
            is written; the report holds the plan.
        overwrite: Replace existing outputs (False: refused).
        resume: Continue an interrupted run into the same destination, keeping its finished files.
        manifest: Journal the outputs and write ``reshard-manifest.json`` last (False: neither, as
            the MindSpore drop-in does).
        hf: Write Hugging Face shards plus ``model.safetensors.index.json`` (False: not). Every tensor
            the filters keep goes in (the CLI's ``--hf`` keeps weights only: ``NameOptions`` with
            ``weights_only``); a note says when training state does.
        max_shard_size: Largest Hugging Face shard, bytes or a size such as ``"2GB"``; only with
            ``hf`` (None: ``5GB``).
        names: Which tensors to keep and what to call them (``NameOptions``; None: all, names
            kept); tensor surgery only for one full file.
        dtype: Cast floating model weights to ``"bf16"``, ``"fp16"`` or ``"fp32"`` while copying (None:
            keep every dtype). Integers, bools, strings, float8 and 0-d scalars are never cast; a
            finite value that would overflow to infinity is a ``UsageError`` (docs/formats.md §16).
        dtype_all: With ``dtype``: cast training state (optimizer moments, ``reshard.statenames``)
            too (False: it keeps its dtype).
        precision: Block-scaled low precision (``Precision``): ``dequantize="bf16"`` turns every FP8
            block pair and MXFP4 pair into one tensor of that dtype while copying, the scales
            consumed (docs/low-precision.md). None: pairs are copied as they are.

    Returns:
        A ``Report``: the plan, notes (files passed over), the files a resumed run kept and the
        name report.

    Raises:
        UsageError: A bad ``to``, a missing source, an existing output or refused destination, a
            ``.ckpt`` to ``.ckpt`` conversion without a key, Hugging Face output from anything but
            one ``.ckpt`` file, or write options that do not fit the outputs (see ``execute``).
        FormatError: A strategy path that cannot be read, or a source or strategy file that is
            truncated, corrupted or not what it claims.
        CryptoError: An encrypted source does not decrypt with ``read.dec_key`` / ``dec_mode``.
        IntegrityError: A source's crc trailer does not match its content.
        UnsupportedError: A source holds entries reshard deliberately does not handle (``MapTensor``).
        ReshardError: An output, the journal or the manifest cannot be written (a full disk, say).

    Example:
        from reshard import api
        api.convert("demo/ckpt_8ranks", "st_8ranks", "safetensors")
        api.convert("demo/full/model.ckpt", "hf", "safetensors", hf=True, max_shard_size="4MB")
    """
    if to not in layout_dir.FORMATS:
        raise UsageError(f"--to must be ckpt or safetensors, not {to!r}")
    shard_size = _shard_size(hf, max_shard_size)
    cast = cast_rule(dtype, dtype_all)
    given, src = src, _convert_source(src)
    naming = NameRun(names)
    dequantizer = _dequantizer(precision, src)
    if to == "ckpt" and shard_size is None and holds_only_ckpt(src):
        if naming.active or dequantizer is not None:
            raise UsageError("filters and renames apply when converting between ckpt and safetensors, not to recrypt")
        if cast is not None:
            raise UsageError(
                "convert --to ckpt re-writes .ckpt files byte for byte (keys only); to cast a .ckpt use "
                "transform with no strategies (one full file) or convert it to safetensors",
                src,
            )
        return recrypt(
            src,
            dst,
            file_regex=file_regex,
            read=read,
            write=write,
            run=run,
            dry_run=dry_run,
            overwrite=overwrite,
            resume=resume,
            manifest=manifest,
        )
    if shard_size is not None and (to != "safetensors" or not os.path.isfile(src)):
        raise UsageError("Hugging Face output converts one full .ckpt file to safetensors", src)
    notes: list[str] = []
    pairs = convert_targets(src, dst, to, file_regex, read, notes)
    opened = naming.narrow({k: source_file(i, 0, read) for k, (i, _) in enumerate(pairs)})
    inputs = cast_files(_dequantized(opened, dequantizer), cast, notes)
    plan = plan_convert([(inputs[k], o, to) for k, (_, o) in enumerate(pairs)], name_map)
    plan = naming.after(plan, list(inputs.values()), full=len(pairs) == 1)  # another family is refused first
    naming.check_config(_full_tensors(inputs.values()))
    if shard_size is not None:
        out_dir = os.path.dirname(pairs[0][1]) if pairs else (dst or os.path.dirname(os.path.abspath(src)))
        plan = hf_sharded(plan, out_dir, shard_size)
        _training_state_note(plan, notes)
    plan = _with_dequantized(plan, dequantizer, notes, read)
    kept: list[str] = []
    if not dry_run:
        root = dst if dst else (src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src)))
        if dst:
            check_destination(dst, [given, src], overwrite, resume)
        elif os.path.isdir(src) and manifest:
            raise UsageError(
                "give a destination folder: without one the outputs would go into the source's rank folders "
                "(only the MindSpore drop-in, which keeps no manifest, writes there, as MindSpore does)",
                src,
            )
        elif not (overwrite or resume):
            existing = [p for p in [f.path for f in plan.files] + [t.path for t in plan.texts] if os.path.exists(p)]
            if existing:
                raise UsageError("output exists (use --overwrite to replace it)", existing[0])
        kept = _kept_note(
            execute(plan, read=read, write=write, run=run, root=root, resume=resume, manifest=manifest), notes
        )
    return Report(plan, notes, kept, naming.report if naming.active else None)


def _convert_source(src: str) -> str:
    """What convert reads: ``rank*`` folders as they are, or the one checkpoint file ``src`` stands
    for (a file, or a folder holding just one: a ``rank_<r>`` folder, ``model.safetensors``'s folder)."""
    if os.path.exists(src) and kind_of(src) is CHECKPOINT2:
        raise UsageError(
            "this is a MindFormers Checkpoint 2.0 (safetensors, resharded by its metadata.json): get .ckpt or "
            "rank folders with reshard transform --src SRC --dst OUT --output-format ckpt [--dst-strategy S]",
            src,
        )
    single = full_model_file(src)
    kinds: tuple[Kind, ...] = (RANK_FOLDERS, ENCRYPTED_CKPT, FULL_FILE)
    if single is not None and os.path.isdir(src):
        kinds += (ONE_RANK_FOLDER, HUGGING_FACE)
    kind = identify(src, kinds)
    return src if kind is RANK_FOLDERS else single or src


def holds_only_ckpt(src: str) -> bool:
    """Whether ``src`` is a ``.ckpt`` file, or ``rank*`` folders holding ``.ckpt`` files and no ``.safetensors``.

    Args:
        src: A path (it need not exist).

    Returns:
        True for a ``.ckpt`` file or such folders; False otherwise, a missing path included.

    Raises:
        OSError: A folder that cannot be listed (no ReshardError: a missing path is just False).

    Example:
        from reshard import api
        assert api.holds_only_ckpt("demo/ckpt_8ranks") and not api.holds_only_ckpt("demo/st_8ranks")
    """
    if os.path.isfile(src):
        return src.endswith(".ckpt")
    if not os.path.isdir(src):
        return False
    folders = [os.path.join(src, d) for d in rank_subfolders(src)]
    return any(layout_dir.files_in(f, "ckpt") for f in folders) and not any(
        layout_dir.files_in(f, "safetensors") for f in folders
    )


def recrypt(
    src: str,
    dst: str | None,
    *,
    file_regex: str | None = None,
    read: ReadOptions | None = None,
    write: WriteOptions | None = None,
    run: RunOptions | None = None,
    dry_run: bool = False,
    overwrite: bool = False,
    resume: bool = False,
    manifest: bool = True,
) -> Report:
    """Re-write ``.ckpt`` files as ``.ckpt``: encrypt, decrypt, or change the key.

    A file or ``rank*`` folders are re-written into ``dst`` under the same names: encrypted with
    ``write.enc_key`` / ``enc_mode`` after decrypting with ``read.dec_key`` when given, or
    decrypted when only ``read.dec_key`` is given. The inputs are never replaced.

    Args:
        src: A ``.ckpt`` file, or a folder of ``rank*`` folders of ``.ckpt`` files.
        dst: The output folder (required: the inputs are never replaced).
        file_regex: Only inputs whose name matches (None: all).
        read: How sources are found and opened (decryption key, crc checking, which file of a rank
            folder). None: ``ReadOptions()``, crc trailers checked, no key.
        write: What the outputs hold (``WriteOptions``: crc trailer, encryption, checksum). None: the
            defaults (no crc trailer, no encryption, BLAKE3 in the manifest).
        run: How the run executes (``RunOptions``: workers, memory bound, progress hooks; a
            ``RayOptions`` runs on Ray). None: ``RunOptions()``.
        dry_run: Plan only: the sources' headers are read, the destination is not checked and nothing
            is written; the report holds the plan.
        overwrite: Replace existing outputs (False: a non-empty ``dst`` is refused).
        resume: Continue an interrupted run into the same destination, keeping its finished files.
        manifest: Journal the outputs and write ``reshard-manifest.json`` last (False: neither, as
            the MindSpore drop-in does).

    Returns:
        A ``Report``: the plan, notes and the files a resumed run kept.

    Raises:
        UsageError: No key at all, no ``dst``, an output that would replace an input, a bad key or
            mode, ``write.write_crc`` with encryption, or a refused destination (see
            ``check_destination``).
        FormatError: A strategy path that cannot be read, or a source or strategy file that is
            truncated, corrupted or not what it claims.
        CryptoError: An encrypted source does not decrypt with ``read.dec_key`` / ``dec_mode``.
        IntegrityError: A source's crc trailer does not match its content.
        UnsupportedError: A source holds entries reshard deliberately does not handle (``MapTensor``).
        ReshardError: An output, the journal or the manifest cannot be written (a full disk, say).

    Example:
        from reshard import api
        from reshard.execute.options import WriteOptions
        key = bytes(range(16))
        api.recrypt("demo/full/model.ckpt", "enc", write=WriteOptions(enc_key=key, enc_mode="AES-GCM"))
        api.recrypt("enc/model.ckpt", "plain", read=api.ReadOptions(dec_key=key))
    """
    out_dir = _recrypt_destination(src, dst, read, write)
    # the .ckpt inputs a conversion to safetensors would read, each written under its own name
    pairs = [
        (i, os.path.join(os.path.dirname(o), os.path.basename(i)))
        for i, o in convert_targets(src, out_dir, "safetensors", file_regex)
    ]
    _check_not_inputs(pairs)
    plan = plan_convert([(source_file(i, 0, read), o, "ckpt") for i, o in pairs])
    notes: list[str] = []
    kept: list[str] = []
    if not dry_run:
        check_destination(out_dir, [src], overwrite, resume)
        kept = _kept_note(
            execute(plan, read=read, write=write, run=run, root=out_dir, resume=resume, manifest=manifest), notes
        )
    return Report(plan, notes, kept)


def _recrypt_destination(src: str, dst: str | None, read: ReadOptions | None, write: WriteOptions | None) -> str:
    """The output folder of a re-encryption, which needs a key and an output folder."""
    if (read is None or read.dec_key is None) and (write is None or write.enc_key is None):
        raise UsageError(
            "the source is already .ckpt and no key was given: nothing to do (give --enc-key-file/"
            "--enc-key-env to encrypt, --dec-key-file/--dec-key-env to decrypt)",
            src,
        )
    if not dst:
        raise UsageError("re-encrypting writes new files: give an output folder (the input is never replaced)", src)
    return dst


def _check_not_inputs(pairs: Sequence[tuple[str, str]]) -> None:
    """An output may never be one of the inputs (re-encrypting into the source's own folder)."""
    inputs = {os.path.realpath(i) for i, _ in pairs}
    for _, out in pairs:
        if os.path.realpath(out) in inputs:
            raise UsageError("the output would replace an input file; choose another output folder", out)


# The operations, and the source discovery names the README shows (defined in reshard.sources).
__all__ = [
    "HYPER_NAME",
    "ReadOptions",
    # the operations
    "Report",
    "check_destination",
    "convert",
    "convert_targets",
    "execute",
    "full_model_file",
    "has_crc_trailer",
    "hf_model",
    "holds_only_ckpt",
    "is_hf_model",
    "model_folder",
    "needed_ranks",
    "open_checkpoint",
    "rank_sources",
    "recrypt",
    "source_file",
    "split",
    "superseded",
    "transform",
    "transform_by_rank",
    "unified_index",
    "unify",
]
