"""Planning at scale: a scaled-down 600B-class job (both sides large, pipeline stages, optimizer
shards) plans in well under its time budget, and one destination rank's plan (``--ranks R``, what
one node plans) is exactly that rank's part of the full plan.

The full-size measurement (4 096 -> 1 024 ranks, 5 000 parameters) is ``bench/plan_bench.py``'s
(docs/benchmarks.md); these tests keep its scaled-down shape fast and its plans unchanged.
Everything is in memory, no files, except the bench smoke tests (subprocesses).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reshard import dtypes, layout
from reshard.formats.strategy import StrategyFile
from reshard.plan import Plan, SourceFile, SourceTensor, TransformPlanner, plan_transform
from reshard.plan.model import SourcePaths, TensorPlan
from reshard.plan.validate import validate_plan
from reshard.synthetic import ModelShape, stage_strategies

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))
try:
    import plan_bench
finally:
    sys.path.remove(str(BENCH))

SCALED_BUDGET_SECONDS = 10.0  # generous: ~0.2 s here on an idle core


def scaled_job() -> tuple[dict[int, SourceFile], StrategyFile, StrategyFile]:
    """256 source ranks (4 stages of dp8 x mp8) -> 64 destination ranks (2 stages of dp4 x mp8),
    200 parameters, optimizer shards over all of dp on both sides."""
    return plan_bench.build(200, 64, 2, src=plan_bench.Side(256, 4, 8, -1), dst_mp=8, dst_opt=-1)


def resolved(plan: Plan, tensors: Iterator[TensorPlan] | tuple[TensorPlan, ...]) -> list[tuple[Any, ...]]:
    """A file's tensors with source indices replaced by paths (two plans intern sources differently)."""
    return [
        (
            t.name,
            t.dtype,
            t.shape,
            t.nbytes,
            tuple(
                (plan.sources[c.source], c.tensor, c.src_start, c.dst_start, c.lengths, c.whole_source)
                for c in t.copies
            ),
        )
        for t in tensors
    ]


def test_scaled_down_job_plans_in_time_and_validates() -> None:
    sources, src, dst = scaled_job()
    start = time.perf_counter()
    plan = plan_transform(sources, src, dst, "/nonexistent/out", "checkpoint_", "ckpt")
    summary = plan.summary()
    seconds = time.perf_counter() - start
    assert seconds < SCALED_BUDGET_SECONDS, f"planning took {seconds:.2f} s"
    assert summary["outputs"] == 64
    assert summary["tensors"] == 64 * 100  # each destination stage holds half of the 200 parameters
    validate_plan(plan)


@pytest.mark.parametrize("rank", [0, 13, 37, 63])
def test_one_rank_plan_is_that_ranks_part_of_the_full_plan(rank: int) -> None:
    sources, src, dst = scaled_job()
    full = plan_transform(sources, src, dst, "/nonexistent/out", "checkpoint_", "ckpt")
    one = plan_transform(sources, src, dst, "/nonexistent/out", "checkpoint_", "ckpt", ranks=[rank])
    (f,) = one.files
    g = full.files[rank]
    assert (f.path, f.format, f.rank, f.metadata) == (g.path, g.format, g.rank, g.metadata)
    assert resolved(one, tuple(f.tensors)) == resolved(full, tuple(g.tensors))
    assert f.tensors.stats == g.tensors.stats
    # only the files this rank reads are in the one-rank plan
    assert set(one.sources) == {one.sources[c.source] for t in f.tensors for c in t.copies}
    validate_plan(one)


@pytest.mark.parametrize("rank", [5, 40])
def test_bulk_path_equals_the_reference_loop_at_scale(rank: int) -> None:
    sources, src, dst = scaled_job()
    plan = plan_transform(sources, src, dst, "/nonexistent/out", "checkpoint_", "ckpt", ranks=[rank])
    interned = SourcePaths()
    reference = TransformPlanner(sources, src, dst).plan_rank(rank, interned)
    ref_plan = Plan("transform", tuple(interned.paths), ())
    assert resolved(plan, tuple(plan.files[0].tensors)) == resolved(ref_plan, reference)


def _synthetic_sources(shape: ModelShape, stages: list[StrategyFile], per_stage: int) -> dict[int, SourceFile]:
    fulls = shape.params()
    sources = {}
    for rank in range(per_stage * len(stages)):
        tensors = {}
        for name, p in stages[rank // per_stage].layouts.items():
            sl = layout.slice_shape(p, fulls[name][0])
            tensors[name] = SourceTensor(dtypes.FLOAT32, sl, 4 * math.prod(sl))
        sources[rank] = SourceFile(f"/nonexistent/rank_{rank}/c.ckpt", rank, tensors)
    return sources


def _merged(stages: list[StrategyFile]) -> StrategyFile:
    from reshard.formats.strategy import make_strategy

    return make_strategy({f"{s}-{n}": p for s, sf in enumerate(stages) for n, p in sf.layouts.items()})


def test_one_rank_plan_with_a_parameter_shared_by_stages() -> None:
    """The tied embedding lives in both end stages with different layouts: the rank-aware layout map
    differs per destination stage, and a one-rank plan still equals its part of the full plan."""
    shape = ModelShape(vocab=64, hidden=32, ffn=64, layers=4)
    src_stages = stage_strategies(shape, 2, 2, 2, True, optimizer=False)
    dst_stages = stage_strategies(shape, 1, 4, 2, False, optimizer=False)
    sources = _synthetic_sources(shape, src_stages, 4)
    src, dst = _merged(src_stages), _merged(dst_stages)
    full = plan_transform(sources, src, dst, "/nonexistent/out", "checkpoint_", "ckpt")
    for rank in range(8):
        one = plan_transform(sources, src, dst, "/nonexistent/out", "checkpoint_", "ckpt", ranks=[rank])
        assert resolved(one, tuple(one.files[0].tensors)) == resolved(full, tuple(full.files[rank].tensors))
    emb = "model.tok_embeddings.embedding_weight"
    assert layout.layout_map(dst, 0)[emb].layout != layout.layout_map(dst, 4)[emb].layout


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env, check=False
    )


def test_plan_bench_both_sides_large_and_one_rank() -> None:
    proc = _run(
        [
            str(BENCH / "plan_bench.py"),
            *("--params", "40", "--src-ranks", "64", "--src-pp", "2", "--src-mp", "4"),
            *("--ranks", "32", "--pp", "2", "--dst-mp", "4", "--one-rank", "17", "--repeat", "1", "--json"),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["src_ranks"] == 64 and result["src_pp"] == 2 and result["src_opt_size"] == 8
    assert result["dst_ranks"] == 32 and result["pp"] == 2 and result["dst_opt_size"] == 4
    assert result["sources"] == 64 and result["tensors"] == 32 * 20
    assert result["one_rank_tensors"] == 20 and 0 < result["one_rank_seconds"] < result["plan_seconds"] + 5


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--src-ranks", "60", "--src-mp", "8"], "source: ranks must be a positive multiple"),
        (["--ranks", "32", "--dst-opt", "3"], "destination: the optimizer shard size must divide"),
        (["--one-rank", "5000"], "--one-rank must be a destination rank"),
        (["--only-one-rank"], "--only-one-rank needs --one-rank"),
    ],
)
def test_plan_bench_refuses_bad_flags(flags: list[str], message: str) -> None:
    proc = _run([str(BENCH / "plan_bench.py"), *flags])
    assert proc.returncode == 2 and message in proc.stderr and not proc.stdout
