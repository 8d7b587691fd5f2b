"""What only Checkpoint 2.0 outputs and sources add to an operation (docs/formats.md §10, §13).

A MindFormers 2.x Checkpoint 2.0 is planned like any rank folders (its ``metadata.json`` compiles
to a strategy and virtual rank sources in ``sources/checkpoint2.py``); what is left for the
operations is here, so ``transform`` and ``unify`` say "Checkpoint 2.0" in a few calls instead of
branching on it at every step: its options (iteration, ``common.json``, optimizer prefixes), the
destination strategy it is planned with (no optimizer shards, a layout for each training state),
the run that writes ``metadata.json`` (it needs every rank's plan), what it carries over from a
Checkpoint 2.0 source, and what an ``--overwrite`` into it removes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

from reshard import manifest as _manifest
from reshard import statenames
from reshard.errors import ReshardError, UnsupportedError, UsageError
from reshard.execute.options import WriteOptions
from reshard.formats import checkpoint2
from reshard.formats.strategy import StrategyFile
from reshard.layout import LayoutTable, split_stage_name
from reshard.layout.slices import CompletedTable, ModelParallelTable, has_optimizer_shard
from reshard.naming import NameOptions
from reshard.ops.options import OutputSpec
from reshard.plan import Plan, SourceFile
from reshard.plan.checkpoint2 import plan_checkpoint2
from reshard.sources import CHECKPOINT2, Kind, Opened, ReadOptions
from reshard.sources.checkpoint2 import iteration_folder


def refuse_map(cp2_out: bool, names: NameOptions | None) -> None:
    """Checkpoint 2.0 output places tensors by the strategy's names: filters fit, maps do not (yet)."""
    if cp2_out and names is not None and names.model_map is not None:
        raise UnsupportedError(
            "renames and tensor surgery are not supported with Checkpoint 2.0 output; write safetensors or ckpt"
        )


def check_options(output: OutputSpec) -> None:
    """Checkpoint 2.0 options only with Checkpoint 2.0 output, and no Hugging Face output with it."""
    cp2_out = output.format == checkpoint2.CHECKPOINT2
    iteration, common, optimizer_prefixes = output.iteration, output.common, output.optimizer_prefixes
    if not cp2_out:
        # torch_dist's iteration: a Megatron-LM run folder (ops.dcp_output)
        if iteration is not None and output.format != "torch_dist":
            raise UsageError(
                "--dst-iteration applies to --output-format checkpoint2 or torch_dist only, not to "
                f"{output.format or 'the default output format'}"
            )
        given = [n for n, v in (("--common-json", common is not None), ("--optimizer-prefix", optimizer_prefixes)) if v]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise UsageError(f"{' and '.join(given)} {verb} to --output-format checkpoint2 only")
        return
    if output.max_shard_size is not None:
        raise UsageError("a Checkpoint 2.0 is not a Hugging Face model: give --hf or --output-format checkpoint2")
    if iteration is not None:
        checkpoint2.check_iteration(iteration)
    checkpoint2.check_common(common)
    for p in optimizer_prefixes:
        if not isinstance(p, str) or not p:
            raise UsageError(f"an optimizer prefix must be a non-empty string, not {p!r}")


def check_write(write: WriteOptions | None) -> None:
    """Checkpoint 2.0 files are safetensors: no crc trailer, no encryption (both .ckpt features)."""
    if write is not None and write.write_crc:
        raise UsageError("a crc trailer is a .ckpt feature; Checkpoint 2.0 files are safetensors")
    if write is not None and write.enc_key is not None:
        raise UsageError("only .ckpt outputs can be encrypted; Checkpoint 2.0 files are safetensors")


def destination_table(
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


def everyone(ranks: Sequence[int] | None, plan_all: Callable[[], Plan]) -> Plan | None:
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


def carried_over(
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


def checkpoint2_plan(
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
    if iteration is None:  # neither given nor carried over from a Checkpoint 2.0 source: say which, and how to choose
        notes.append(
            f"the Checkpoint 2.0 is iteration {number} ({os.path.basename(checkpoint2.iteration_dir(dst_dir, number))}"
            f"), the default for a source that has no iteration; --dst-iteration N (OutputSpec(iteration=N) in "
            "Python) chooses another"
        )
    tracker = os.path.join(dst_dir, checkpoint2.TRACKER_NAME)
    if tracker not in {t.path for t in out.texts}:
        notes.append(
            f"{checkpoint2.TRACKER_NAME} (MindFormers' completion marker) is written only by a run that writes "
            f"every rank: once all ranks are written, put {number} in it, or load "
            f"{checkpoint2.iteration_dir(dst_dir, number)} directly"
        )
    return out


def superseded(dst: str, plan: Plan, overwrite: bool, resume: bool) -> list[str]:
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


def open_source(kind: Kind, src: str, read: ReadOptions | None, notes: list[str], ranks: object) -> Opened:
    """``kind.open``, but a Checkpoint 2.0 written for some destination ranks (``ranks`` not None) needs
    only the files those read: others ``metadata.json`` names may be absent (``OpenedRanks.absent``;
    ``check_present`` refuses a plan that reads one), as rank folders need only the ranks read."""
    if kind is CHECKPOINT2 and ranks is not None:
        return CHECKPOINT2.open(src, read, notes, partial=True)
    return kind.open(src, read, notes)


def check_present(plan: Plan, absent: Sequence[str]) -> None:
    """Refuse a plan that reads a file that is not here (``open_source``), naming the file and the first
    destination rank that reads it, before anything is written."""
    gone = set(absent)
    missing = {i for i, p in enumerate(plan.sources) if p in gone}
    if not missing:
        return
    for f in plan.files:
        for t in f.tensors:
            hit = next((c.source for c in t.copies if c.source in missing), None)
            if hit is not None:
                rank = f.rank if f.rank is not None else 0
                raise UsageError(
                    f"{os.path.basename(plan.sources[hit])}, named in metadata.json storage_data, is missing, and "
                    f"destination rank {rank} reads {t.name!r} from it: copy it too (`reshard rank-list {rank} "
                    "--files` on the whole checkpoint lists every file the rank reads)",
                    os.path.dirname(plan.sources[hit]),
                )
    first = plan.sources[min(missing)]
    raise UsageError(
        f"{os.path.basename(first)}, named in metadata.json storage_data, is missing", os.path.dirname(first)
    )


def strategy_of(opened: Opened | None) -> StrategyFile | None:
    """A Checkpoint 2.0's layouts come from its metadata.json (docs/formats.md §13); a strategy given
    with it was refused by ``sources.resolve``."""
    return opened.strategy if opened is not None else None


def virtual_ranks(src: str, read: ReadOptions | None, notes: list[str]) -> tuple[dict[int, SourceFile], StrategyFile]:
    """A Checkpoint 2.0's virtual ranks and the strategy its metadata.json gives (a single card: one device)."""
    from reshard.formats.strategy import make_strategy
    from reshard.layout import ParamLayout

    opened = CHECKPOINT2.open(src, read, notes)
    sf = strategy_of(opened)
    if sf is None:  # a single card: every tensor whole on one device
        tensors = opened.ranks[0].tensors
        sf = make_strategy({n: ParamLayout((1,), (-1,) * len(t.shape)) for n, t in tensors.items() if t.shape})
    return opened.ranks, sf


__all__ = [
    "carried_over",
    "check_options",
    "check_present",
    "check_write",
    "checkpoint2_plan",
    "destination_table",
    "everyone",
    "open_source",
    "refuse_map",
    "strategy_of",
    "superseded",
    "virtual_ranks",
]
