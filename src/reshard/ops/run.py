"""The one run path every operation ends with: destination check, lock, superseded outputs, execute, manifest.

An operation plans first (file headers and strategies only) and then hands the plan here. Before
this module the tail "check the destination, work out what an ``--overwrite`` removes, execute
under the lock and journal, note what a ``--resume`` kept, build the report" was written five
times in ``api`` and three more in the MindSpore drop-in, each with its own small differences.
Now an operation says only *where* it writes (a ``Target``: the folder that gets the lock and
manifest, the paths it reads, and, where it differs, its own destination check and what an
overwrite supersedes) and *how* it treats the destination (``Destination``); ``run_plan`` does the
rest. The lock, journal, manifest and roll-back themselves are ``manifest.run_recorded``'s.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from reshard import arguments
from reshard import destination as _destination
from reshard import manifest as _manifest
from reshard.arguments import StrPath
from reshard.errors import UsageError
from reshard.execute.options import RayOptions, RunOptions, WriteOptions
from reshard.formats.strategy import StrategyFile
from reshard.naming import NameReport
from reshard.ops.arguments import check_option_types
from reshard.ops.options import Destination
from reshard.ops.pending import PendingCheck, beside_the_copy, its_error_first
from reshard.plan import Plan
from reshard.sources import ReadOptions, open_checkpoint


@dataclass
class Report:
    """What an operation did: its plan, and notes for the user (e.g. files passed over)."""

    plan: Plan
    notes: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # outputs of an interrupted run that resume kept
    names: NameReport | None = None  # what filters and maps did to names (None: no filter, no map)
    finished: list[str] = field(default_factory=list)  # finishing files a resume wrote itself (finished_with)


@dataclass(frozen=True)
class Target:
    """Where a run writes, and what its destination check is.

    ``root``: the folder that gets the lock, journal and manifest (None: the common folder of the
    plan's outputs). ``sources``: the paths the run reads (a destination must not be, lie in or hold
    one). ``output_file``: a run writing one file (``transform_by_rank``) checks that file against
    the sources instead of a folder. ``check``: an operation's own destination check instead of
    both (``convert`` without a destination). ``superseded(plan)``: an earlier run's outputs an
    overwrite removes once the destination is locked.
    """

    root: str | None
    sources: Sequence[str] = ()
    output_file: str | None = None
    check: Callable[[], None] | None = None
    superseded: Callable[[Plan], list[str]] | None = None


def run_plan(
    plan: Plan,
    target: Target,
    destination: Destination | None,
    read: ReadOptions | None,
    write: WriteOptions | None,
    run: RunOptions | None,
    notes: list[str],
    names: NameReport | None = None,
    pending: PendingCheck | None = None,
) -> Report:
    """Run ``plan`` into ``target`` (nothing with ``destination.dry_run``) and report it.

    ``pending``: a check of the inputs not yet run (``ops.pending``): beside a copy into one file it
    runs while the copy does, and the output waits for it; otherwise it runs first. Its error comes
    first either way.

    Raises:
        UsageError: A refused destination (``reshard.destination``), and everything ``execute`` raises.
    """
    where = destination or Destination()
    if pending is not None and (where.dry_run or not beside_the_copy(plan)):
        pending.wait()  # before the copy, as a check always ran
        pending = None
    if where.dry_run:
        return Report(plan, notes, [], names)
    with its_error_first(pending):
        kept = run_plans([plan], target, where, read, write, pending.gated(run) if pending is not None else run)
    if pending is not None:
        pending.wait()  # a run that renamed nothing into place (resumed, kept every output) still hears it
    finished = finished_with(plan, target.root, kept)
    return Report(plan, notes, kept_note(kept, notes, finished), names, finished)


def run_plans(
    plans: Sequence[Plan],
    target: Target,
    destination: Destination,
    read: ReadOptions | None = None,
    write: WriteOptions | None = None,
    run: RunOptions | None = None,
) -> list[str]:
    """Check ``target`` once, then run each plan into it: the outputs a resumed run kept."""
    if target.check is not None:
        target.check()
    elif target.output_file is not None:
        _destination.check_not_source(target.output_file, target.sources, "output file")
    else:
        assert target.root is not None, "a folder target names its folder"
        _destination.check_destination(target.root, target.sources, destination.overwrite, destination.resume)
    kept: list[str] = []
    for plan in plans:
        remove = target.superseded(plan) if target.superseded is not None else []
        kept += execute(
            plan,
            read=read,
            write=write,
            run=run,
            root=target.root,
            resume=destination.resume,
            manifest=destination.manifest,
            remove=remove,
        )
    return kept


def kept_note(kept: list[str], notes: list[str], finished: Sequence[str] = ()) -> list[str]:
    """``kept``, with a note when a resumed run kept finished files, naming the finishing files it
    wrote itself (``finished_with``): a resume that wrote only those did not have nothing to do."""
    if kept:
        wrote = f"; finished it with {', '.join(finished)}" if finished else ""
        notes.append(f"resume: kept {len(kept)} finished file(s) of the earlier run (verified){wrote}")
    return kept


def finished_with(plan: Plan, root: str | None, kept: Sequence[str]) -> list[str]:
    """The finishing files (``plan.texts``: indexes, ``.metadata``, markers) a resumed run wrote: those
    it did not keep (``manifest.run_recorded``), relative to ``root``; none when it kept nothing."""
    if not kept:
        return []
    base, done = os.path.abspath(root or _manifest.common_root(plan)), set(kept)
    return [rel for rel in (_manifest.relative(t.path, base) for t in plan.texts) if rel not in done]


def execute(
    plan: Plan,
    *,
    read: ReadOptions | None = None,
    write: WriteOptions | None = None,
    run: RunOptions | None = None,
    root: StrPath | None = None,
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
        plan: The plan to run, as an operation's dry-run report holds it.
        read: How sources are found and opened (decryption key, crc checking, which file of a rank
            folder). None: ``ReadOptions()``, crc trailers checked, no key.
        write: What the outputs hold (``WriteOptions``: crc trailer, encryption, checksum). None: the
            defaults (no crc trailer, no encryption, XXH128 in the manifest).
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
        report = api.transform("demo/ckpt_8ranks", "out_4ranks", "demo/strategy_8", "demo/strategy_4",
                               destination=api.Destination(dry_run=True))
        api.execute(report.plan, root="out_4ranks")
    """
    root = arguments.optional_path(root, "root")
    check_option_types(read=read, write=write, run=run)
    opened = replace(read, verify_crc=False) if read is not None else None
    if executor not in ("local", "ray"):
        raise UsageError(f"unknown executor {executor!r} (choose local or ray)")
    if executor == "ray" or isinstance(run, RayOptions):
        # imported here: a local run loads neither the Ray executor nor Ray (about 0.1 s of start-up)
        from reshard.execute import ray as ray_executor

        run = run or RayOptions()
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


def superseded(
    dst: StrPath, plan: Plan, dst_strategy: StrategyFile | None, overwrite: bool, manifest: bool
) -> list[str]:
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
                               destination=api.Destination(dry_run=True))
        stale = api.superseded("demo/ckpt_4ranks", report.plan, load_strategy("demo/strategy_4"), True, True)
    """
    dst = arguments.path(dst, "dst")
    if not (overwrite and manifest) or not any(f.rank is not None for f in plan.files):
        return []
    from reshard.layout import device_num, stage_count

    total = device_num(dst_strategy) * stage_count(dst_strategy) if dst_strategy is not None else 1
    return _manifest.superseded_outputs(dst, plan, total)


def strategy_paths(*strategies: object) -> list[str]:
    """The strategies given as paths (a run reads them: a destination must not replace them)."""
    return [os.fspath(s) for s in strategies if isinstance(s, str | os.PathLike)]


def folder_superseded(
    dst: str, dst_strategy: StrategyFile | None, destination: Destination
) -> Callable[[Plan], list[str]]:
    """``Target.superseded`` of a run into rank folders of ``dst`` laid out by ``dst_strategy``."""
    return lambda plan: superseded(dst, plan, dst_strategy, destination.overwrite, destination.manifest)


__all__ = [
    "Report",
    "Target",
    "execute",
    "finished_with",
    "folder_superseded",
    "kept_note",
    "run_plan",
    "run_plans",
    "strategy_paths",
    "superseded",
]
