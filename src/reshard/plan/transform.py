"""The transform planner: N ranks of one layout to M ranks of another, in bulk.

``plan_transform`` is what every transform runs: per destination rank a template lookup and the
shared per-class tables of ``reshard.plan.bulk``, files built lazily (``RankTensors``). Whenever
anything is off for a rank it is planned again by the reference loop
(``reshard.plan.transform_reference.TransformPlanner.plan_rank``), which raises the exact error a
user should see; the tests check that both give equal plans.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from reshard.errors import LayoutError, ReshardError, UsageError
from reshard.formats import rank_dirs
from reshard.layout import LayoutTable, ParamLayout, StagedLayout
from reshard.plan.bulk import FEW_RANKS_SHARE, BuiltFiles, RankTensors, Tables, Template, rank_tensors
from reshard.plan.model import FilePlan, Plan, Role, SourceFile, SourcePaths, output_metadata, wanted_ranks
from reshard.plan.transform_reference import StageCut, TransformPlanner

# --------------------------------------------------------------------------------------------
# transform (docs/formats.md §3.6, §3.9, §4.2)

# A parameter's memo in a destination stage: its role and, to transform, (src layout, dst layout, src devices).
_Decision = tuple[Role, ParamLayout | None, ParamLayout | None, int]


class _BulkPlanner:
    """``plan_transform``'s fast path over a ``TransformPlanner``: same plans, built from tables.

    Per destination rank it only looks up a template (by load order and stage), one ``RankShare``
    per class and the source files not yet checked; ``TensorPlan`` objects are left to
    ``RankTensors``. Whenever anything is wrong the rank is planned again by the reference path
    (``TransformPlanner.plan_rank``), which raises the exact error a user should see, naming the
    parameter and the strategy file; the fast path's own errors are only a signal.
    """

    def __init__(self, planner: TransformPlanner, few: bool = False) -> None:
        self.planner = planner
        self.sources = SourcePaths()
        self.tables = Tables(few)
        self.built = BuiltFiles()
        self._templates: dict[tuple[tuple[int, ...], int, bool], Template] = {}
        self._stages: dict[int, tuple[dict[str, _Decision], StageCut, dict[str, StagedLayout] | None]] = {}

    def rank(self, rank: int) -> RankTensors:
        p = self.planner
        order = p.needed(rank)
        missing = [r for r in order if r not in p.files]
        if missing:
            raise UsageError(
                f"destination rank {rank} needs the checkpoint of source rank(s) "
                f"{', '.join(map(str, sorted(missing)))}, which is missing"
            )
        beyond = rank in p.beyond
        try:
            template = self._template(tuple(order), rank // p.n_dst, beyond)
            return rank_tensors(template, rank % p.n_dst, beyond, self.sources, self.built)
        except ReshardError:
            p.plan_rank(rank, SourcePaths(), order)  # raises the precise, blamed error
            raise

    def _template(self, order: tuple[int, ...], stage: int, beyond: bool) -> Template:
        hit = self._templates.get((order, stage, beyond))
        if hit is None:
            hit = self._templates[(order, stage, beyond)] = self._build_template(order, stage, beyond)
        return hit

    def _build_template(self, order: tuple[int, ...], stage: int, beyond: bool) -> Template:
        """``plan_rank``'s loop over parameters, minus everything that depends on the rank."""
        p = self.planner
        holders = p.holders(order, beyond)
        decisions, cut, dst_map = self._stage(stage)
        template = Template()
        tables = self.tables
        for name, by_key in holders.items():
            decision = decisions.get(name)
            if decision is None:
                decision = decisions[name] = self._decide(name, cut, dst_map)
            role, src_p, dst_p, device_n = decision
            if role is Role.SKIP:
                continue
            if role is Role.WHOLE:
                template.deferred.append((name, by_key))
                continue
            template.device_n = device_n
            first = next(iter(by_key.values())).tensors[name]
            template.add(tables.get(src_p, dst_p, tables.full(src_p, first.shape)), name, name, first.dtype, by_key)
        if template.device_n is None:
            raise LayoutError("no parameter to transform")
        template.finish()
        return template

    def _stage(self, stage: int) -> tuple[dict[str, _Decision], StageCut, dict[str, StagedLayout] | None]:
        """A destination stage's cut and layout map, and a memo of what ``plan_rank`` does with each name."""
        hit = self._stages.get(stage)
        if hit is None:
            p = self.planner
            rank = stage * p.n_dst
            hit = self._stages[stage] = ({}, p.stage_cut(rank), p.dst_map(rank))
        return hit

    def _decide(self, name: str, cut: StageCut, dst_map: dict[str, StagedLayout] | None) -> _Decision:
        role = cut.role(name)
        if role is not Role.TRANSFORM:
            return role, None, None, 0
        src_p, dst_p = self.planner.layouts(name, dst_map)
        return role, src_p, dst_p, src_p.device_num if src_p is not None else 1


def plan_transform(
    sources: Mapping[int, SourceFile],
    src: LayoutTable | None,
    dst: LayoutTable | None,
    dst_dir: str,
    prefix: str,
    output_format: str,
    ranks: Sequence[int] | None = None,
) -> Plan:
    """Plan a transform of a distributed (or full) checkpoint into ``dst_dir/rank_<r>/``."""
    planner = TransformPlanner(sources, src, dst)
    wanted = wanted_ranks(ranks, planner.dst_total)
    if ranks is None:
        planner.check_rank_count()
    else:
        planner.check_needed_present(wanted)
    planner.check_agreement()
    bulk = _BulkPlanner(planner, few=ranks is not None and len(wanted) * FEW_RANKS_SHARE <= planner.n_dst)
    meta = output_metadata(output_format)
    files = []
    for rank in wanted:
        path = rank_dirs.rank_output(dst_dir, rank, prefix, output_format)
        files.append(FilePlan(path, output_format, bulk.rank(rank), meta, rank))
    read = tuple(bulk.sources.paths)
    keep = () if ranks is None else tuple(planner.stage_representatives(wanted, read))
    plan = Plan("transform", read + keep, tuple(files))
    if planner.stood_in:
        planner.check_reads(plan.sources, ((f.rank, f.tensors) for f in plan.files))
    return plan


__all__ = ["plan_transform"]
