"""MindSpore's by-stage transform: one pipeline stage's ranks -> ``{prefix}{k}_part{stage}.ckpt``.

``mindspore.transform_checkpoints`` (docs/formats.md §3.8) switches to this mode when both strategies
are single-stage and the source's parameter names (optimizer states left out on both sides) are a strict subset of the
destination's: the source is one stage of a pipelined job, and every destination rank gets that
stage's parameters in a ``_part{stage}`` file. Planning it is the by-rank planner once per
destination rank over that stage's source ranks; this module decides the mode and the ranks, the
drop-in opens the files and runs the plans.
"""

from __future__ import annotations

from reshard.errors import UsageError
from reshard.formats import rank_dirs
from reshard.layout import LayoutTable, device_num, layout_map, stage_count
from reshard.plan.model import Plan, SourceFile
from reshard.plan.transform import plan_transform_by_rank
from reshard.plan.unify import REDUNDANT_STATE_PREFIXES


def _model_names(sf: LayoutTable) -> set[str]:
    """The strategy's parameter names without optimizer states (``accu_grads``/``adam_v``/``adam_m`` prefixes)."""
    return {n for n in layout_map(sf) if not n.startswith(REDUNDANT_STATE_PREFIXES)}


def is_by_stage(src: LayoutTable | None, dst: LayoutTable | None) -> bool:
    """MindSpore's by-stage test: two single-stage strategies whose names, optimizer states left
    out on *both* sides, are a strict subset (source) of the destination's. A destination that
    only adds optimizer states is the all-stage mode (``{prefix}{r}.ckpt``)."""
    if src is None or dst is None or stage_count(src) != 1 or stage_count(dst) != 1:
        return False
    return _model_names(src) < _model_names(dst)


def stage_files(src_dir: str, src: LayoutTable) -> dict[int, tuple[int, str]]:
    """The stage's source files, local rank ``i`` -> (``stage * n + i``, the ``.ckpt`` of that rank's
    folder), in descending rank order (as the all-stage mode reads them).

    Raises:
        UsageError: A rank folder of the stage holds no checkpoint.
    """
    stage = getattr(src, "stage", None) or 0
    n_src = device_num(src)
    _, chosen = rank_dirs.collect_rank_files(src_dir, "ckpt")
    wanted = range(stage * n_src, (stage + 1) * n_src)
    missing = [r for r in wanted if r not in chosen]
    if missing:
        raise UsageError(f"stage {stage} needs the checkpoints of ranks {missing}, which are missing", src_dir)
    return {r - stage * n_src: (r, chosen[r].path) for r in reversed(wanted)}


def plan_by_stage(
    sources: dict[int, SourceFile], src: LayoutTable, dst: LayoutTable, dst_dir: str, prefix: str
) -> list[Plan]:
    """One plan per destination rank: that rank's ``{prefix}{rank}_part{stage}.ckpt`` from ``sources``."""
    stage = getattr(src, "stage", None) or 0
    total = device_num(dst) * stage_count(dst)
    return [
        plan_transform_by_rank(
            rank, sources, rank_dirs.rank_output(dst_dir, rank, prefix, "ckpt", part=stage), src, dst
        )
        for rank in range(total)
    ]


__all__ = ["is_by_stage", "plan_by_stage", "stage_files"]
