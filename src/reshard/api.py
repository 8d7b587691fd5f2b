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
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from reshard import lock as _lock
from reshard import manifest as _manifest
from reshard.errors import FormatError, LayoutError, UsageError
from reshard.execute.options import RunOptions, WriteOptions
from reshard.formats import hf_index, layout_dir
from reshard.formats.base import TensorIndex
from reshard.formats.ckpt import probe_ckpt, read_ckpt
from reshard.formats.safetensors import read_safetensors
from reshard.formats.strategy import StrategyFile, load_strategy
from reshard.plan import (
    ChoiceFunc,
    Plan,
    SourceFile,
    SourceTensor,
    hf_sharded,
    plan_convert,
    plan_split,
    plan_transform,
    plan_transform_by_rank,
    plan_transform_full,
    plan_unify,
    plan_unify_hf,
)
from reshard.text import parse_size

INDEX_THREADS = 8  # source files indexed at once while planning (the scans wait on the disk)


@dataclass(frozen=True)
class ReadOptions:
    """How to find and open source checkpoints (which file of a rank folder, decryption, crc checking).

    ``crc_check=True`` (the default) verifies the crc trailer of every plain ``.ckpt`` source that
    has one, on every read path, while planning (one extra read of the file, which also warms the
    page cache for the copy); files without a trailer are accepted, as MindSpore does.
    ``crc_check=False`` skips it (``--no-check-crc``). When a rank folder holds several
    checkpoints, ``file_suffix`` takes the one whose name ends in it (MindSpore's ``file_suffix``
    rule), ``pick`` chooses by ``"last-name"`` or ``"newest"`` (mtime; default: MindSpore's rule for
    the format), and ``src_format`` reads ``"ckpt"`` or ``"safetensors"`` files when the folders
    hold both.
    """

    dec_key: bytes | None = field(default=None, repr=False)  # never printed
    dec_mode: str = "AES-GCM"
    crc_check: bool = True
    file_suffix: str | None = None
    pick: str | None = None
    src_format: str | None = None


@dataclass
class Report:
    """What an operation did: its plan, and notes for the user (e.g. files passed over)."""

    plan: Plan
    notes: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # outputs of an interrupted run that resume kept


def open_checkpoint(path: str, options: ReadOptions | None = None) -> TensorIndex:
    """Index a ``.ckpt`` or ``.safetensors`` file (zero-copy views over a memory map)."""
    options = options or ReadOptions()
    fmt = layout_dir.detect_format(path)
    if not os.path.isfile(path):
        raise UsageError("no such file", path)
    if fmt == "ckpt":
        crc = options.crc_check and has_crc_trailer(path)
        return read_ckpt(path, crc_check=crc, dec_key=options.dec_key, dec_mode=options.dec_mode)
    return read_safetensors(path)


def has_crc_trailer(path: str) -> bool:
    """True when a plain (unencrypted) ``.ckpt`` ends with MindSpore's crc trailer (spec 1.6)."""
    try:
        return probe_ckpt(path).crc_trailer
    except OSError:
        return False  # read_ckpt reports the problem


def source_file(path: str, rank: int = 0, options: ReadOptions | None = None) -> SourceFile:
    """Header facts of one checkpoint (dtypes, shapes, metadata) for planning."""
    with open_checkpoint(path, options) as index:
        tensors = {name: SourceTensor(e.dtype, e.shape, e.nbytes) for name, e in index.entries.items()}
        strings = {name: str(index.value(name)) for name, e in index.entries.items() if e.is_string}
        return SourceFile(path, rank, tensors, dict(index.metadata), strings)


def rank_sources(
    model_dir: str,
    fmt: str | None = None,
    rule: str | None = None,
    file_suffix: str | None = None,
    options: ReadOptions | None = None,
    notes: list[str] | None = None,
    listing_order: bool = False,
) -> tuple[str, dict[int, SourceFile]]:
    """The chosen checkpoint of every ``rank_<r>`` folder, as planning facts.

    ``fmt``, ``rule`` and ``file_suffix`` default to ``options``' ``src_format``, ``pick`` and
    ``file_suffix``; a note names the file used, the rule that chose it and the files passed over.
    """
    fmt, rule, file_suffix = _source_choice(fmt, rule, file_suffix, options)
    folder_check(model_dir)
    fmt, chosen = layout_dir.collect_rank_files(model_dir, fmt, rule, file_suffix, listing_order)
    rule = rule or ("name" if fmt == "ckpt" else "numbers")
    if notes is not None:
        for picked in chosen.values():
            if picked.ignored:
                ignored = ", ".join(os.path.basename(p) for p in picked.ignored)
                why = f"the one ending in {file_suffix}" if file_suffix else layout_dir.RULE_TEXT[rule]
                notes.append(f"rank {picked.rank}: using {os.path.basename(picked.path)} ({why}), ignoring {ignored}")
    return fmt, _source_files({r: p.path for r, p in chosen.items()}, options)


def _source_choice(
    fmt: str | None, rule: str | None, file_suffix: str | None, options: ReadOptions | None
) -> tuple[str | None, str | None, str | None]:
    """The format, pick rule and file suffix asked for, by argument or else by ``options``."""
    if options is None:
        return fmt, rule, file_suffix
    if options.src_format is not None:
        if options.src_format not in layout_dir.FORMATS:
            raise UsageError(f"unknown source format {options.src_format!r} (choose ckpt or safetensors)")
        if fmt is not None and fmt != options.src_format:
            raise UsageError(f"this operation reads .{fmt} files; the source format {options.src_format} "
                             "does not apply")
    if options.pick is not None and options.pick not in layout_dir.PICKS:
        raise UsageError(f"unknown pick rule {options.pick!r} (choose {' or '.join(layout_dir.PICKS)})")
    return (fmt or options.src_format, rule or layout_dir.PICKS.get(options.pick or ""),
            file_suffix or options.file_suffix)


def folder_check(model_dir: str) -> None:
    """A rank folder given where its parent belongs, or an empty ``rank_<r>`` folder: said plainly."""
    name = os.path.basename(os.path.normpath(model_dir))
    if os.path.isdir(model_dir) and name.startswith("rank_") and not layout_dir.rank_dirs(model_dir):
        parent = os.path.dirname(os.path.normpath(model_dir)) or "."
        raise UsageError(f"this is one rank's folder; give the folder holding the rank_<r> folders ({parent})",
                         model_dir)
    if not os.path.isdir(model_dir):
        return
    for rank, folder in layout_dir.rank_dirs(model_dir).items():
        if not any(layout_dir.files_in(folder, f) for f in layout_dir.FORMATS):
            raise UsageError(f"rank {rank}'s folder is empty (no .ckpt or .safetensors file)", folder)


def _source_files(paths: Mapping[int, str], options: ReadOptions | None) -> dict[int, SourceFile]:
    """Planning facts of every rank's file, indexed on several threads.

    A ``.ckpt`` index waits on the disk, not the CPU (one small ``pread`` per record, GIL
    released), so overlapping the files hides most of the latency on a cold cache. Errors are
    raised in rank order, as a sequential scan would.
    """
    items = list(paths.items())
    if len(items) <= 1:
        return {r: source_file(path, r, options) for r, path in items}
    with ThreadPoolExecutor(min(INDEX_THREADS, len(items)), thread_name_prefix="reshard-index") as pool:
        facts = list(pool.map(lambda item: source_file(item[1], item[0], options), items))
    return {r: f for (r, _), f in zip(items, facts, strict=True)}


def _strategy(value: str | StrategyFile | None, notes: list[str] | None = None) -> StrategyFile | None:
    """The strategy a path names; its loading notes (a merged file passed over) go to ``notes``."""
    if value is None or isinstance(value, StrategyFile):
        return value
    sf = load_strategy(value)
    if notes is not None:
        notes.extend(sf.notes)
    return sf


def _sources_for(src: str, options: ReadOptions | None, notes: list[str]) -> tuple[str, dict[int, SourceFile]]:
    """A full checkpoint (a file, or a folder holding just one) is rank 0 of a one-rank job; a
    folder otherwise holds rank_<r> folders."""
    single = full_model_file(src)
    if single is not None:
        return layout_dir.detect_format(single), {0: source_file(single, 0, options)}
    return rank_sources(src, options=options, notes=notes)


def full_model_file(path: str) -> str | None:
    """The one checkpoint file ``path`` stands for: the file itself, or the only ``.ckpt`` /
    ``.safetensors`` file of a folder without ``rank_<r>`` folders (``full/model.ckpt``'s folder);
    None otherwise."""
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path) or layout_dir.rank_dirs(path):
        return None
    found = [f for fmt in layout_dir.FORMATS for f in layout_dir.files_in(path, fmt)]
    return found[0] if len(found) == 1 else None


def check_destination(dst: str, sources: Sequence[str], overwrite: bool, resume: bool = False) -> None:
    """Refuse a destination inside a source folder, or a non-empty one without ``overwrite``/``resume``."""
    dst_abs = os.path.realpath(dst)
    for src in sources:
        src_abs = os.path.realpath(src)
        folder = src_abs if os.path.isdir(src_abs) else os.path.dirname(src_abs)
        if os.path.isdir(src_abs) and (dst_abs == folder or dst_abs.startswith(folder + os.sep)):
            raise UsageError(f"destination lies inside the source folder {src}", dst)
    if os.path.isfile(dst):
        raise UsageError("destination exists and is a file", dst)
    if os.path.isdir(dst) and not os.access(dst, os.W_OK):
        raise UsageError("destination folder is read-only", dst)
    holder = _lock.is_held(dst) if os.path.isdir(dst) else None
    if holder is not None:
        raise UsageError(f"{_lock.describe(holder)} is writing into this destination; wait for it to finish or "
                         "stop it", dst)
    if os.path.isdir(dst) and _entries(dst) and not (overwrite or resume):
        if _manifest.has_unfinished_run(dst):
            raise UsageError("destination holds an unfinished run (use --resume to continue it)", dst)
        raise UsageError("destination is not empty (use --overwrite to replace the files this run writes)", dst)


def _entries(folder: str) -> list[str]:
    """What a folder holds, without a lock file a killed run left (it is no output)."""
    return [name for name in os.listdir(folder) if name != _lock.LOCK_NAME]


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
    Returns the outputs kept from an interrupted earlier run (``resume``). ``executor="ray"`` (or
    ``run`` being a ``reshard.execute.ray.RayOptions``) runs the output files as Ray tasks.
    ``remove`` lists an earlier run's outputs to delete once the destination is locked
    (``superseded``).
    """
    opened = replace(read, crc_check=False) if read is not None else None
    from reshard.execute import ray as ray_executor  # light: Ray itself is imported only when used

    if executor not in ("local", "ray"):
        raise UsageError(f"unknown executor {executor!r} (choose local or ray)")
    if executor == "ray" or isinstance(run, ray_executor.RayOptions):
        return ray_executor.run_recorded(plan, opened, write, run, root, resume=resume, manifest=manifest,
                                         remove=remove)
    return _manifest.run_recorded(plan, lambda path: open_checkpoint(path, opened), write, run, root,
                                  resume=resume, manifest=manifest, remove=remove)


def superseded(dst: str, plan: Plan, dst_strategy: StrategyFile | None, overwrite: bool, manifest: bool) -> list[str]:
    """With ``overwrite``: an earlier run's rank outputs in ``dst`` that this plan's layout no longer
    has (``manifest.superseded_outputs``; a foreign checkpoint in the way is a ``UsageError``).

    Only runs that keep reshard's records (``manifest=True``) clean up after an earlier record; a
    run without one (``--no-manifest``, the MindSpore drop-in) replaces same-named files only, as
    MindSpore does.
    """
    if not (overwrite and manifest) or not any(f.rank is not None for f in plan.files):
        return []
    from reshard.formats.strategy import device_num, stage_count

    total = device_num(dst_strategy) * stage_count(dst_strategy) if dst_strategy is not None else 1
    return _manifest.superseded_outputs(dst, plan, total)


def transform(
    src: str,
    dst_dir: str,
    src_strategy: str | StrategyFile | None = None,
    dst_strategy: str | StrategyFile | None = None,
    *,
    prefix: str = "checkpoint_",
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
) -> Report:
    """Move a distributed (or full) checkpoint to another layout: full->N, N->M, N->full.

    ``src`` is a folder of ``rank_<r>`` folders, one full checkpoint file, or a Hugging Face
    sharded model (its folder or its ``model.safetensors.index.json``); for a full model
    ``src_strategy`` must be None. Strategies may be files or folders of per-stage files (merged
    in memory). ``ranks`` restricts the output to some destination ranks (multi-node runs).
    ``hf=True`` writes the full model (no ``dst_strategy``) as Hugging Face shards of at most
    ``max_shard_size`` (default ``5GB``) plus ``model.safetensors.index.json`` into ``dst_dir``.
    """
    layout_dir.check_prefix(prefix)  # before anything is read: output names never leave the destination
    notes: list[str] = []
    shard_size = _shard_size(hf, max_shard_size)
    if shard_size is not None and (dst_strategy is not None or output_format == "ckpt"):
        raise UsageError("Hugging Face output is a full safetensors model: give no destination strategy and no "
                         "ckpt output format")
    if is_hf_model(src):
        if src_strategy is not None:
            raise UsageError("a Hugging Face model is a full model: give no source strategy", src)
        files, mapping, hyper = unified_index(src)
        if hyper is not None:  # unify --hf keeps them beside the shards; a full model holds them
            files[HYPER_NAME] = hyper
            mapping = {**mapping, **{n: HYPER_NAME for n in hyper.tensors if n not in mapping}}
        plan = plan_transform_full(files, mapping, _strategy(dst_strategy, notes), dst_dir, prefix,
                                   output_format or "safetensors", ranks)
    else:
        if src_strategy is not None:  # a rank_<r> folder with the job's strategy: its parent was meant
            folder_check(src)
        fmt, sources = _sources_for(src, read, notes)
        src_sf, dst_sf = _strategy(src_strategy, notes), _strategy(dst_strategy, notes)
        if src_sf is None and len(sources) > 1:
            raise UsageError("several rank folders but no source strategy (--src-strategy, src_strategy in Python)",
                             src)
        plan = plan_transform(sources, src_sf, dst_sf, dst_dir, prefix, output_format or fmt, ranks)
    if shard_size is not None:
        plan = hf_sharded(plan, dst_dir, shard_size)
    kept: list[str] = []
    if not dry_run:
        check_destination(dst_dir, [model_folder(src)], overwrite, resume)
        remove = superseded(dst_dir, plan, _strategy(dst_strategy), overwrite, manifest)
        kept = _kept_note(execute(plan, read=read, write=write, run=run, root=dst_dir, resume=resume,
                                  manifest=manifest, remove=remove), notes)
    return Report(plan, notes, kept)


def _shard_size(hf: bool, max_shard_size: int | str | None) -> int | None:
    """The Hugging Face shard size in bytes, or None without ``hf``."""
    if not hf:
        if max_shard_size is not None:
            raise UsageError("a maximum shard size needs Hugging Face output (--hf)")
        return None
    return parse_size(hf_index.DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size, "the shard size")


def _kept_note(kept: list[str], notes: list[str]) -> list[str]:
    if kept:
        notes.append(f"resume: kept {len(kept)} finished file(s) of the interrupted run")
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

    The manifest goes next to ``out_file``.
    """
    sources = {int(r): source_file(p, int(r), read) for r, p in files_map.items()}
    plan = plan_transform_by_rank(rank, sources, out_file, _strategy(src_strategy), _strategy(dst_strategy))
    if not dry_run:
        execute(plan, read=read, write=write, run=run, manifest=manifest)
    return Report(plan, [])


def needed_ranks(
    rank_id: int, src_strategy: str | StrategyFile | None, dst_strategy: str | StrategyFile | None = None,
    notes: list[str] | None = None,
) -> list[int]:
    """Source ranks whose files destination ``rank_id`` needs (MindSpore's ``rank_list_for_transform``).

    Notes on loading the strategies (a merged file passed over) go to ``notes`` when given.
    """
    from reshard import layout
    from reshard.formats.strategy import layout_map

    src_sf, dst_sf = _strategy(src_strategy, notes), _strategy(dst_strategy, notes)
    if src_sf is None:
        return [0]
    dst_map = layout_map(dst_sf, rank_id) if dst_sf is not None else None
    return layout.rank_list_for_transform(rank_id, layout_map(src_sf), dst_map)


def unify(
    src_dir: str,
    src_strategy: str | StrategyFile,
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
) -> Report:
    """Merge N rank shards into full tensors: ``part<j>.safetensors`` + ``param_name_map.json``.

    Parts are packed from the rank folders in rank order; ``mindspore_order=True`` uses the
    folder listing order as MindSpore does (same packing and index order as its output).
    ``hf=True`` writes Hugging Face shards (``model-00001-of-0000N.safetensors`` of at most
    ``max_shard_size``, default ``5GB``) and ``model.safetensors.index.json`` instead (one
    ``model.safetensors`` when everything fits); ``hyper_param.safetensors`` is written as usual.
    """
    notes: list[str] = []
    shard_size = _shard_size(hf, max_shard_size)
    if shard_size is not None and split_dst_file:
        raise UsageError("split_dst_file (--split) does not apply to Hugging Face output")
    _refuse_ckpt_ranks(src_dir)
    _, sources = rank_sources(src_dir, "safetensors", None, file_suffix, read, notes, mindspore_order)
    sf = _strategy(src_strategy, notes)
    if sf is None:
        raise UsageError("unify needs the source strategy")
    _check_unify_ranks(src_dir, sources, sf)
    if shard_size is not None:
        plan = plan_unify_hf(sources, sf, dst_dir, choice_func, shard_size)
    else:
        plan = plan_unify(sources, sf, dst_dir, choice_func, split_dst_file)
    kept: list[str] = []
    if not dry_run:
        check_destination(dst_dir, [src_dir], overwrite, resume)
        kept = _kept_note(execute(plan, read=read, write=write, run=run, root=dst_dir, resume=resume,
                                  manifest=manifest), notes)
    return Report(plan, notes, kept)


def _refuse_ckpt_ranks(src_dir: str) -> None:
    """unify reads safetensors: rank folders of .ckpt files get the two ways forward, not "missing"."""
    dirs = layout_dir.rank_dirs(src_dir) if os.path.isdir(src_dir) else {}
    folders = list(dirs.values())
    if folders and not any(layout_dir.files_in(d, "safetensors") for d in folders) and any(
            layout_dir.files_in(d, "ckpt") for d in folders):
        raise UsageError("the rank folders hold .ckpt files and unify reads .safetensors: convert them first "
                         "(reshard convert SRC ST_DIR --to safetensors), or get a full .ckpt with reshard transform "
                         "--src SRC --src-strategy S --dst OUT", src_dir)


def _check_unify_ranks(src_dir: str, sources: Mapping[int, SourceFile], sf: StrategyFile) -> None:
    """Rank folders beyond the strategy's ranks mean the strategy belongs to another job."""
    from reshard.formats.strategy import device_num, stage_count

    expected = device_num(sf) * stage_count(sf)
    beyond = sorted(r for r in sources if r >= expected)
    if beyond:
        raise LayoutError(f"the strategy describes {expected} rank(s) (0..{expected - 1}) but the checkpoint "
                          f"{src_dir} has {len(sources)} rank folders; is it the strategy of this job?",
                          sf.path)


HYPER_NAME = "hyper_param.safetensors"  # unify's file of the parameters outside the strategy


def unified_index(
    unified_dir: str, name_map: Mapping[str, str] | None = None
) -> tuple[dict[str, SourceFile], dict[str, str], SourceFile | None]:
    """The files of a full model, the name -> file map, and ``hyper_param.safetensors``.

    ``unified_dir`` is a unified folder (``part<j>.safetensors`` + ``param_name_map.json``), a
    Hugging Face folder (``model.safetensors.index.json`` + shards) or that index file itself: both
    indexes are read by ``hf_index.read_weight_map``; the Hugging Face one is also checked against
    its shards (``hf_model``). A folder with a single ``.safetensors`` file (besides
    ``hyper_param.safetensors``) needs no index: its keys, translated back through the inverted
    ``name_map``, are the names.
    """
    index = hf_index.find_index(unified_dir)
    if index is not None:
        return hf_model(index)
    if not os.path.isdir(unified_dir):
        raise UsageError("not a folder", unified_dir)
    if layout_dir.rank_dirs(unified_dir):
        raise UsageError("this folder holds rank_<r> folders, not a unified model: unify them first (reshard unify "
                         "SRC UNIFIED --strategy S), or reshard them directly (reshard transform)", unified_dir)
    names = sorted(n for n in os.listdir(unified_dir) if n.endswith(".safetensors"))
    if not names:
        raise UsageError("no .safetensors files", unified_dir)
    index_path = os.path.join(unified_dir, "param_name_map.json")
    models = [n for n in names if n != HYPER_NAME] or names
    if len(names) == 1 or (len(models) == 1 and not os.path.isfile(index_path)):
        (only,) = models
        files = {only: source_file(os.path.join(unified_dir, only))}
        hyper = source_file(os.path.join(unified_dir, HYPER_NAME)) if HYPER_NAME in names and only != HYPER_NAME \
            else None
        inverse = {v: k for k, v in (name_map or {}).items()}
        return files, {inverse.get(k, k): only for k in files[only].tensors}, hyper
    if not os.path.isfile(index_path):
        raise UsageError("several .safetensors files but no param_name_map.json", unified_dir)
    files = {n: source_file(os.path.join(unified_dir, n)) for n in names}
    hyper = files.pop(HYPER_NAME, None)
    return files, hf_index.read_weight_map(index_path, strict=False), hyper


def hf_model(index_path: str) -> tuple[dict[str, SourceFile], dict[str, str], SourceFile | None]:
    """``unified_index`` of a Hugging Face index: its shards (by file name), its weight map, and a
    ``hyper_param.safetensors`` beside it that the index does not name (``unify --hf`` writes one).

    Refused, each with one line naming the file: a shard the index names but the folder lacks, a
    name the weight map assigns to a shard that does not hold it, a tensor held by two shards.
    """
    mapping = hf_index.read_weight_map(index_path)
    folder = os.path.dirname(os.path.abspath(index_path))
    index_name = os.path.basename(index_path)
    files: dict[str, SourceFile] = {}
    for shard in sorted(set(mapping.values())):  # model-00001-of-... first
        path = os.path.join(folder, shard)
        if not shard.endswith(".safetensors"):
            raise FormatError(f"the weight_map names {shard!r}, which is not a .safetensors shard", index_path)
        if not os.path.isfile(path):
            raise UsageError(f"shard named by {index_name} is missing", path)
        files[shard] = source_file(path)
    holder: dict[str, str] = {}
    for shard, sf in files.items():
        for name in sf.tensors:
            if name in holder:
                raise FormatError(f"tensor {name!r} is in two shards: {holder[name]} and {shard}", index_path)
            holder[name] = shard
    for name, shard in mapping.items():
        if name not in files[shard].tensors:
            raise FormatError(f"{index_name} lists {name!r} in this shard, but it is not there", files[shard].path)
    hyper_path = os.path.join(folder, HYPER_NAME)
    hyper = source_file(hyper_path) if HYPER_NAME not in files and os.path.isfile(hyper_path) else None
    return files, mapping, hyper


def is_hf_model(path: str) -> bool:
    """A Hugging Face model: an index file, a folder holding one, or a folder (without ``rank_<r>``
    folders) holding ``model.safetensors``, the single-shard form."""
    if hf_index.find_index(path) is not None:
        return True
    return (os.path.isdir(path) and os.path.isfile(os.path.join(path, hf_index.SINGLE_NAME))
            and not layout_dir.rank_dirs(path))


def model_folder(path: str) -> str:
    """The folder a full-model input stands for (an index file stands for its folder)."""
    return os.path.dirname(os.path.abspath(path)) if hf_index.is_index_file(path) else path


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
) -> Report:
    """Slice a unified (full) model into ``dst_dir/rank_<r>/net.<fmt>`` for a target strategy.

    ``unified_dir`` may also be a Hugging Face sharded model (its folder or its index file).
    """
    files, mapping, hyper = unified_index(unified_dir, name_map)
    notes: list[str] = []
    sf = _strategy(dst_strategy, notes)
    if sf is None:
        raise UsageError("split needs the destination strategy")
    plan = plan_split(files, mapping, hyper, sf, dst_dir, output_format, ranks, name_map)
    kept: list[str] = []
    if not dry_run:
        check_destination(dst_dir, [model_folder(unified_dir)], overwrite, resume)
        remove = superseded(dst_dir, plan, sf, overwrite, manifest)
        kept = _kept_note(execute(plan, write=write, run=run, root=dst_dir, resume=resume, manifest=manifest,
                                  remove=remove), notes)
    return Report(plan, notes, kept)


def convert_targets(src: str, dst: str | None, to: str, file_regex: str | None = None,
                    choose: ReadOptions | None = None, notes: list[str] | None = None) -> list[tuple[str, str]]:
    """(input, output) pairs of a convert: a file, or every matching file of the ``rank*`` folders.

    With ``choose.file_suffix`` or ``choose.pick``, one file per rank folder (a note names it)."""
    import re

    src_ext = ".ckpt" if to == "safetensors" else ".safetensors"
    dst_ext = "." + to
    pattern = re.compile(file_regex) if file_regex else None
    if os.path.isfile(src):
        if not src.endswith(src_ext):
            raise UsageError(f"expected a {src_ext} file", src)
        if pattern and not pattern.findall(src):
            return []
        out_dir = dst or os.path.dirname(os.path.abspath(src))
        return [(src, os.path.join(out_dir, os.path.basename(src).replace(src_ext, dst_ext)))]
    if not os.path.isdir(src):
        raise UsageError("no such file or folder", src)
    pairs = []
    subdirs = sorted(d for d in os.listdir(src) if d.startswith("rank") and os.path.isdir(os.path.join(src, d)))
    if not subdirs:
        raise UsageError("no rank* sub-folders", src)
    for sub in subdirs:
        folder = os.path.join(src, sub)
        names = _chosen_names(folder, src_ext[1:], choose, notes) if choose else sorted(os.listdir(folder))
        for name in names:
            if name.endswith(src_ext) and (pattern is None or pattern.search(name)):
                out_dir = os.path.join(dst, sub) if dst else folder
                pairs.append((os.path.join(folder, name), os.path.join(out_dir, name.replace(src_ext, dst_ext))))
    return pairs


def _chosen_names(folder: str, fmt: str, choose: ReadOptions, notes: list[str] | None) -> list[str]:
    """Every file name of ``folder``, or only the one ``choose`` picks (``--file-suffix``/``--pick``)."""
    if not (choose.file_suffix or choose.pick):
        return sorted(os.listdir(folder))
    _, rule, suffix = _source_choice(None, None, None, choose)
    files = layout_dir.files_in(folder, fmt)
    if not files and not suffix:
        return []
    chosen = layout_dir.choose_file(folder, files, fmt, rule or "name", suffix)
    ignored = [os.path.basename(p) for p in files if p != chosen]
    if ignored and notes is not None:
        why = f"the one ending in {suffix}" if suffix else layout_dir.RULE_TEXT[rule or "name"]
        notes.append(f"{os.path.basename(folder)}: using {os.path.basename(chosen)} ({why}), ignoring "
                     f"{', '.join(ignored)}")
    return [os.path.basename(chosen)]


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
) -> Report:
    """Convert ``.ckpt`` <-> ``.safetensors`` for one file or a folder of ``rank*`` folders.

    Without ``dst`` the outputs go next to the inputs (as MindSpore does) and the manifest into
    the source folder (the file's folder for one file); then existing outputs are refused unless
    ``overwrite``/``resume``. ``hf=True`` converts one full ``.ckpt`` file into Hugging Face
    shards (at most ``max_shard_size``, default ``5GB``) + ``model.safetensors.index.json``.
    ``.ckpt`` sources with ``to="ckpt"`` are re-written into ``dst``: encrypted with ``write.enc_key``
    (after decrypting with ``read.dec_key`` when given) or decrypted (only ``read.dec_key``); with
    neither key there is nothing to do, a usage error. A folder without ``rank*`` folders that holds
    one checkpoint file stands for that file.
    """
    if to not in layout_dir.FORMATS:
        raise UsageError(f"--to must be ckpt or safetensors, not {to!r}")
    shard_size = _shard_size(hf, max_shard_size)
    src = _convert_source(src)
    if to == "ckpt" and shard_size is None and holds_only_ckpt(src):
        return recrypt(src, dst, file_regex=file_regex, read=read, write=write, run=run, dry_run=dry_run,
                       overwrite=overwrite, resume=resume, manifest=manifest)
    if shard_size is not None and (to != "safetensors" or not os.path.isfile(src)):
        raise UsageError("Hugging Face output converts one full .ckpt file to safetensors", src)
    notes: list[str] = []
    pairs = convert_targets(src, dst, to, file_regex, read, notes)
    plan = plan_convert([(source_file(i, 0, read), o, to) for i, o in pairs], name_map)
    if shard_size is not None:
        out_dir = os.path.dirname(pairs[0][1]) if pairs else (dst or os.path.dirname(os.path.abspath(src)))
        plan = hf_sharded(plan, out_dir, shard_size)
    kept: list[str] = []
    if not dry_run:
        root = dst if dst else (src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src)))
        if dst:
            check_destination(dst, [src], overwrite, resume)
        elif not (overwrite or resume):
            existing = [p for p in [f.path for f in plan.files] + [t.path for t in plan.texts] if os.path.exists(p)]
            if existing:
                raise UsageError("output exists (use --overwrite to replace it)", existing[0])
        kept = _kept_note(execute(plan, read=read, write=write, run=run, root=root, resume=resume,
                                  manifest=manifest), notes)
    return Report(plan, notes, kept)


def _convert_source(src: str) -> str:
    """A folder without ``rank*`` folders that holds one checkpoint file converts that file."""
    if not os.path.isdir(src) or any(d.startswith("rank") and os.path.isdir(os.path.join(src, d))
                                     for d in os.listdir(src)):
        return src
    return full_model_file(src) or src


def holds_only_ckpt(src: str) -> bool:
    """A ``.ckpt`` file, or ``rank*`` folders holding ``.ckpt`` files and no ``.safetensors`` file."""
    if os.path.isfile(src):
        return src.endswith(".ckpt")
    if not os.path.isdir(src):
        return False
    folders = [os.path.join(src, d) for d in os.listdir(src)
               if d.startswith("rank") and os.path.isdir(os.path.join(src, d))]
    return (any(layout_dir.files_in(f, "ckpt") for f in folders)
            and not any(layout_dir.files_in(f, "safetensors") for f in folders))


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
    """``.ckpt`` to ``.ckpt`` in one step: a file or ``rank*`` folders re-written into ``dst`` (same
    names), encrypted with ``write.enc_key``/``enc_mode`` after decrypting with ``read.dec_key`` when
    given, or decrypted when only ``read.dec_key`` is given. The inputs are never replaced."""
    out_dir = _recrypt_destination(src, dst, read, write)
    # the .ckpt inputs a conversion to safetensors would read, each written under its own name
    pairs = [(i, os.path.join(os.path.dirname(o), os.path.basename(i)))
             for i, o in convert_targets(src, out_dir, "safetensors", file_regex)]
    _check_not_inputs(pairs)
    plan = plan_convert([(source_file(i, 0, read), o, "ckpt") for i, o in pairs])
    notes: list[str] = []
    kept: list[str] = []
    if not dry_run:
        check_destination(out_dir, [src], overwrite, resume)
        kept = _kept_note(execute(plan, read=read, write=write, run=run, root=out_dir, resume=resume,
                                  manifest=manifest), notes)
    return Report(plan, notes, kept)


def _recrypt_destination(src: str, dst: str | None, read: ReadOptions | None, write: WriteOptions | None) -> str:
    """The output folder of a re-encryption, which needs a key and an output folder."""
    if (read is None or read.dec_key is None) and (write is None or write.enc_key is None):
        raise UsageError("the source is already .ckpt and no key was given: nothing to do (give --enc-key-file/"
                         "--enc-key-env to encrypt, --dec-key-file/--dec-key-env to decrypt)", src)
    if not dst:
        raise UsageError("re-encrypting writes new files: give an output folder (the input is never replaced)",
                         src)
    return dst


def _check_not_inputs(pairs: Sequence[tuple[str, str]]) -> None:
    """An output may never be one of the inputs (re-encrypting into the source's own folder)."""
    inputs = {os.path.realpath(i) for i, _ in pairs}
    for _, out in pairs:
        if os.path.realpath(out) in inputs:
            raise UsageError("the output would replace an input file; choose another output folder", out)


ProgressFn = Callable[[int], None]
