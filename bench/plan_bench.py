"""Planning micro-benchmark: ``plan_transform`` for 1 000 parameters x 1 024 destination ranks.

    python3 bench/plan_bench.py                  # table on stdout
    python3 bench/plan_bench.py --pp 4 --json    # 4 pipeline stages of 256 ranks, JSON line
    python3 bench/plan_bench.py --profile        # + cProfile top entries of one planning run
    python3 bench/plan_bench.py --params 5000 --src-ranks 4096 --src-pp 16 --src-mp 8 \
        --ranks 1024 --pp 8 --dst-mp 8 --one-rank 517   # a 600B-class job, both sides large, + one rank

Both sides are dp x mp per stage with ``--*-pp`` stages (parameter i in stage i * pp // count);
``--src-opt`` / ``--dst-opt`` set the optimizer shard size over dp (-1: all of dp, 0: none).
``--one-rank R`` also times ``plan_transform(..., ranks=[R])``: what ``--ranks R`` and one node pay.

Everything is built in memory, no files: strategies with ``make_strategy`` / ``ParamLayout``
(LLaMA-7B-like shapes; source 8 ranks dp2 x mp4 with optimizer shards, destination dp64 x mp16 per
stage with optimizer shards over dp, ``--pp`` stages), sources as ``reshard.plan.SourceFile``
objects holding each rank's slice shapes. By default every destination rank holds all 1 000
parameters (one stage: the most work, 1 024 000 tensor plans).

Each timing runs in a fresh process, because the layout engine memoises per (layout, shape) pair
and a warm second call would time dictionary lookups. Timings:

* ``plan``: ``plan_transform`` end to end plus ``Plan.summary()`` (what ``reshard plan`` /
  ``transform`` pay before IO: every rank is planned and checked against the source files' shapes);
* ``validate`` (same process, after ``plan``): ``validate_plan``, which every run does before
  writing (once per layout class and destination rank, nothing built); reported, not part of the target;
* ``materialise`` (same process, after ``validate``): building every output's ``TensorPlan`` objects,
  which transform plans leave to the executor, one file at a time; reported, not part of the target;
* ``layout``: only the calls the planner makes into ``reshard.layout`` for the same job
  (``rank_list_for_transform`` per rank; ``full_shape`` per distinct source layout and slice shape;
  ``rank_boxes`` and ``transfer_table`` per distinct layout pair and full shape), without building
  plan objects: the slice algebra's share;
* ``boxes`` (the DCP-like row): ``plan_boxes`` + ``summary()`` for the same parameters held as
  ``--src-ranks`` uneven ``torch.chunk`` shards of dim 0 each (FSDP's layout: shard ``r`` of every
  parameter in file ``__<r>_0.distcp``), planned into ``--ranks`` such shards (FSDP to a smaller
  world: each output meets a few source shards, most of them only partly), one output file per
  destination shard; then
  ``validate_plan`` and building one output's ``TensorPlan`` objects. ``--no-boxes`` skips it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import pstats
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import versions  # bench/ is on sys.path: this file runs as a script

from reshard import dtypes, layout
from reshard.formats.strategy import StrategyFile, make_strategy
from reshard.layout import ParamLayout, layout_map
from reshard.layout.chunks import ChunkedTensor, even_boxes
from reshard.plan import SourceFile, SourceTensor, plan_transform
from reshard.plan.boxes import OutputFile, Target, plan_boxes
from reshard.plan.validate import validate_plan
from reshard.synthetic import COLUMN, REPLICATED_1D, ROW

HIDDEN, FFN, VOCAB = 4096, 11264, 32768  # LLaMA-7B-like; divisible by every split below
SRC_DEV = (2, 4)  # dp, mp of the 8-rank source
DST_MP = 16  # model parallel of the destination; dp = ranks per stage / DST_MP
SLOW_SECONDS = 1.0  # the target; a slower plan is profiled
NO_REPEAT_SECONDS = 10.0  # a run this slow is not repeated (its best-of-N would add minutes, not insight)
PROFILE_TOP = 15
PROFILE_SHRINK = 8  # an automatic profile plans ranks / 8 (same per-rank work, cProfile is ~3x slower)


def llama_params(count: int) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """``count`` (name, full shape, tensor map) of a LLaMA-like stack, embedding first."""
    out = [("model.tok_embeddings.embedding_weight", (VOCAB, HIDDEN), COLUMN)]
    layer = 0
    while len(out) < count:
        p = f"model.layers.{layer}."
        out += [(p + "attention_norm.weight", (HIDDEN,), REPLICATED_1D)]
        out += [(p + f"attention.{w}.weight", (HIDDEN, HIDDEN), COLUMN) for w in ("wq", "wk", "wv")]
        out += [(p + "attention.wo.weight", (HIDDEN, HIDDEN), ROW), (p + "ffn_norm.weight", (HIDDEN,), REPLICATED_1D)]
        out += [(p + f"feed_forward.{w}.weight", (FFN, HIDDEN), COLUMN) for w in ("w1", "w3")]
        out += [(p + "feed_forward.w2.weight", (HIDDEN, FFN), ROW)]
        layer += 1
    return out[:count]


@dataclass(frozen=True)
class Side:
    """One side of the job: ranks in total, pipeline stages, model parallel, optimizer shard size."""

    ranks: int
    pp: int
    mp: int
    opt: int  # optimizer shard size over data parallel; -1: all of dp (the default), 0: none

    @property
    def per_stage(self) -> int:
        return self.ranks // self.pp

    @property
    def dev(self) -> tuple[int, int]:
        return self.per_stage // self.mp, self.mp

    @property
    def opt_size(self) -> int:
        return self.dev[0] if self.opt < 0 else self.opt

    def check(self, what: str) -> str | None:
        """Why this side cannot be built, or None."""
        if self.ranks < 1 or self.pp < 1 or self.mp < 1 or self.ranks % (self.pp * self.mp):
            return f"{what}: ranks must be a positive multiple of stages x model parallel"
        if self.opt > 0 and self.dev[0] % self.opt:
            return f"{what}: the optimizer shard size must divide data parallel ({self.dev[0]})"
        return None


SRC_DEFAULT = Side(SRC_DEV[0] * SRC_DEV[1], 1, SRC_DEV[1], -1)


def _layout(side: Side, tmap: tuple[int, ...], ndim: int) -> ParamLayout:
    mp = side.dev[1]
    size = side.opt_size
    sharded = size > 1 and ndim == 2  # optimizer shards over data parallel, as reshard.synthetic does
    return ParamLayout(side.dev, tmap, mp if sharded else 0, size if sharded else 0)


def _table(specs: list[tuple[str, tuple[int, ...], tuple[int, ...]]], side: Side) -> dict[str, ParamLayout]:
    """The strategy's layout items: parameter i in stage i * pp // count, ``"<stage>-<name>"`` when staged."""
    out: dict[str, ParamLayout] = {}
    for i, (name, shape, tmap) in enumerate(specs):
        stage = i * side.pp // len(specs)
        out[f"{stage}-{name}" if side.pp > 1 else name] = _layout(side, tmap, len(shape))
    return out


def build(
    params: int, dst_ranks: int, pp: int, *, src: Side = SRC_DEFAULT, dst_mp: int = DST_MP, dst_opt: int = -1
) -> tuple[dict[int, SourceFile], StrategyFile, StrategyFile]:
    """Sources (slice shapes only), the source strategy and the merged destination strategy.

    Every source rank of a stage holds the same slice shapes (uniform layouts), so the ranks of a
    stage share one tensor table: 4 096 source files cost one table per stage, not a million entries.
    """
    specs = llama_params(params)
    dst = Side(dst_ranks, pp, dst_mp, dst_opt)
    src_items, dst_items = _table(specs, src), _table(specs, dst)
    per_stage_tables: list[dict[str, SourceTensor]] = []
    for stage in range(src.pp):
        tensors = {}
        for i, (name, shape, tmap) in enumerate(specs):
            if i * src.pp // len(specs) != stage:
                continue
            sl = layout.slice_shape(_layout(src, tmap, len(shape)), shape)
            tensors[name] = SourceTensor(dtypes.BFLOAT16, sl, dtypes.BFLOAT16.itemsize * math.prod(sl))
        per_stage_tables.append(tensors)
    sources = {
        rank: SourceFile(
            f"/nonexistent/rank_{rank}/checkpoint_{rank}.ckpt", rank, per_stage_tables[rank // src.per_stage]
        )
        for rank in range(src.ranks)
    }
    return sources, make_strategy(src_items), make_strategy(dst_items)


def build_for(args: argparse.Namespace, dst_ranks: int | None = None) -> tuple[dict[int, SourceFile], Any, Any]:
    """``build`` for the command line's job (``dst_ranks``: fewer destination ranks, for a profile)."""
    src = Side(args.src_ranks, args.src_pp, args.src_mp, args.src_opt)
    ranks = args.ranks if dst_ranks is None else dst_ranks
    return build(args.params, ranks, args.pp, src=src, dst_mp=args.dst_mp, dst_opt=args.dst_opt)


def time_plan(args: argparse.Namespace) -> dict[str, Any]:
    sources, src, dst = build_for(args)
    start = time.perf_counter()
    plan = plan_transform(sources, src, dst, "/nonexistent/out", "checkpoint_", "ckpt")
    s = plan.summary()
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    validate_plan(plan)
    validate = time.perf_counter() - start
    start = time.perf_counter()
    built = sum(len(tuple(f.tensors)) for f in plan.files)
    materialise = time.perf_counter() - start
    assert built == s["tensors"]
    return {
        "seconds": seconds,
        "validate_seconds": validate,
        "materialise_seconds": materialise,
        "tensors": s["tensors"],
        "copies": s["copies"],
        "outputs": s["outputs"],
        "sources": len(plan.sources),
    }


def time_one_rank(args: argparse.Namespace) -> dict[str, Any]:
    """What ``--ranks R`` (one node, one rank) pays: the plan of destination rank ``--one-rank`` alone,
    then validating it and building its ``TensorPlan`` objects (what the executor then does)."""
    sources, src, dst = build_for(args)
    start = time.perf_counter()
    plan = plan_transform(sources, src, dst, "/nonexistent/out", "checkpoint_", "ckpt", ranks=[args.one_rank])
    s = plan.summary()
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    validate_plan(plan)
    built = len(tuple(plan.files[0].tensors))
    rest = time.perf_counter() - start
    return {
        "seconds": seconds,
        "validate_build_seconds": rest,
        "tensors": built,
        "sources": len(plan.sources),
        "copies": s["copies"],
    }


def time_layout(args: argparse.Namespace) -> dict[str, Any]:
    """The layout-engine calls of ``plan_transform`` for the same job, and nothing else."""
    sources, src, dst = build_for(args)
    shapes = {name: t.shape for f in sources.values() for name, t in f.tensors.items()}
    pp, dst_ranks = args.pp, args.ranks
    start = time.perf_counter()
    src_map = layout_map(src)
    per_stage = dst_ranks // pp
    fulls: dict[tuple[ParamLayout, tuple[int, ...]], tuple[int, ...]] = {}
    tables: dict[tuple[ParamLayout, ParamLayout, tuple[int, ...]], tuple[tuple[layout.Piece, ...], ...]] = {}
    for stage in range(pp):
        dst_map = layout_map(dst, stage * per_stage)
        names = [n for n, item in dst_map.items() if stage in item.stages]
        for rank in range(stage * per_stage, (stage + 1) * per_stage):
            layout.rank_list_for_transform(rank, src_map, dst_map)
        for name in names:
            src_p, dst_p = src_map[name].layout, dst_map[name].layout
            full = fulls.get((src_p, shapes[name]))
            if full is None:
                full = fulls[(src_p, shapes[name])] = layout.full_shape(src_p, shapes[name])
            if (src_p, dst_p, full) not in tables:
                layout.rank_boxes(dst_p, full)
                tables[(src_p, dst_p, full)] = layout.transfer_table(src_p, dst_p, full, any_device_num=True)
                layout.rank_boxes(src_p, full)
    pieces = sum(len(p) for table in tables.values() for p in table)
    return {"seconds": time.perf_counter() - start, "pieces": pieces}


def build_boxes(params: int, chunks: int, outputs: int) -> tuple[list[ChunkedTensor], list[OutputFile], list[Target]]:
    """The DCP-like job: every parameter in ``chunks`` dim-0 shards (one per source file), into ``outputs`` such.

    Parameters of one shape share their box tuples (``even_boxes`` returns shared ones) and every
    parameter shares the tuple of source files, as a reader interning its metadata would.
    """
    files = tuple(f"/nonexistent/dcp/__{r}_0.distcp" for r in range(chunks))
    sources, targets = [], []
    for name, shape, _ in llama_params(params):
        sources.append(ChunkedTensor(name, shape, dtypes.BFLOAT16, even_boxes(shape, 0, chunks), files))
        targets.append(Target(name, even_boxes(shape, 0, outputs)))
    out = [OutputFile(f"/nonexistent/out/rank_{r}/model.safetensors", "safetensors", rank=r) for r in range(outputs)]
    return sources, out, targets


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` and the seconds it took."""
    start = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - start


def time_boxes(args: argparse.Namespace) -> dict[str, Any]:
    (sources, out, targets), built = _timed(build_boxes, args.params, args.src_ranks, args.ranks)
    (plan, s), seconds = _timed(lambda: (p := plan_boxes(sources, out, targets, "reshard"), p.summary()))
    _, validate = _timed(validate_plan, plan)
    one, materialise = _timed(lambda: len(tuple(plan.files[0].tensors)))
    assert one == args.params
    return {
        "seconds": seconds,
        "build_seconds": built,
        "validate_seconds": validate,
        "materialise_one_seconds": materialise,
        "tensors": s["tensors"],
        "copies": s["copies"],
        "outputs": s["outputs"],
        "sources": len(plan.sources),
    }


def profile_plan(args: argparse.Namespace, dst_ranks: int) -> str:
    """cProfile of one ``plan_transform`` + ``summary()`` (cold caches): top entries by own and by cumulative time."""
    sources, src, dst = build_for(args, dst_ranks)
    profiler = cProfile.Profile()
    profiler.enable()
    plan_transform(sources, src, dst, "/nonexistent/out", "checkpoint_", "ckpt").summary()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(PROFILE_TOP)
    stats.sort_stats("cumulative").print_stats(PROFILE_TOP)
    return text.getvalue()


MODES = {"plan": time_plan, "layout": time_layout, "one_rank": time_one_rank, "boxes": time_boxes}
JOB_FLAGS = ("params", "ranks", "pp", "dst_mp", "dst_opt", "src_ranks", "src_pp", "src_mp", "src_opt", "one_rank")


def _fresh(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one timing in a new interpreter (empty layout caches)."""
    argv = [sys.executable, os.path.abspath(__file__), "--one", mode]
    for flag in JOB_FLAGS:
        value = getattr(args, flag)
        if value is not None:
            argv += ["--" + flag.replace("_", "-"), str(value)]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"plan_bench: {mode} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _timings(mode: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    runs = [_fresh(mode, args)]
    while len(runs) < args.repeat and runs[0]["seconds"] < NO_REPEAT_SECONDS:
        runs.append(_fresh(mode, args))
    return runs


def run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "params": args.params,
        "dst_ranks": args.ranks,
        "pp": args.pp,
        "dst_mp": args.dst_mp,
        "dst_opt_size": Side(args.ranks, args.pp, args.dst_mp, args.dst_opt).opt_size,
        "src_ranks": args.src_ranks,
        "src_pp": args.src_pp,
        "src_mp": args.src_mp,
        "src_opt_size": Side(args.src_ranks, args.src_pp, args.src_mp, args.src_opt).opt_size,
        "target_seconds": SLOW_SECONDS,
    }
    if args.one_rank is not None:
        ones = _timings("one_rank", args)
        result.update(
            one_rank=args.one_rank,
            one_rank_seconds=min(o["seconds"] for o in ones),
            one_rank_runs=[o["seconds"] for o in ones],
            one_rank_validate_build_seconds=min(o["validate_build_seconds"] for o in ones),
            one_rank_tensors=ones[0]["tensors"],
            one_rank_copies=ones[0]["copies"],
            one_rank_sources=ones[0]["sources"],
        )
        if args.only_one_rank:
            return result
    plans = _timings("plan", args)
    layouts = _timings("layout", args)
    best = min(p["seconds"] for p in plans)
    result.update(
        repeat=len(plans),
        plan_seconds=best,
        plan_runs=[p["seconds"] for p in plans],
        validate_seconds=min(p["validate_seconds"] for p in plans),
        materialise_seconds=min(p["materialise_seconds"] for p in plans),
        layout_seconds=min(x["seconds"] for x in layouts),
        layout_runs=[x["seconds"] for x in layouts],
        tensors=plans[0]["tensors"],
        copies=plans[0]["copies"],
        outputs=plans[0]["outputs"],
        sources=plans[0]["sources"],
        pieces=layouts[0]["pieces"],
    )
    if not args.no_boxes:
        boxes = _timings("boxes", args)
        result.update(
            boxes_seconds=min(b["seconds"] for b in boxes),
            boxes_runs=[b["seconds"] for b in boxes],
            boxes_build_seconds=min(b["build_seconds"] for b in boxes),
            boxes_validate_seconds=min(b["validate_seconds"] for b in boxes),
            boxes_materialise_one_seconds=min(b["materialise_one_seconds"] for b in boxes),
            boxes_tensors=boxes[0]["tensors"],
            boxes_copies=boxes[0]["copies"],
            boxes_sources=boxes[0]["sources"],
        )
    if args.profile or best > SLOW_SECONDS:
        per_stage = args.dst_mp * args.pp
        ranks = args.ranks if args.profile else max(per_stage, args.ranks // PROFILE_SHRINK // per_stage * per_stage)
        result["profile_ranks"] = ranks
        result["profile"] = profile_plan(args, ranks)
    return result


def _print(args: argparse.Namespace, result: dict[str, Any]) -> None:
    job = (
        f"{args.params} parameters, source {args.src_ranks} ranks ({args.src_pp} stage(s), mp {args.src_mp}, "
        f"optimizer shards of {result['src_opt_size']}) -> destination {args.ranks} ranks ({args.pp} stage(s), "
        f"mp {args.dst_mp}, optimizer shards of {result['dst_opt_size']})"
    )
    print(f"plan_transform, {job}")
    if "one_rank_seconds" in result:
        print(
            f"  one destination rank ({args.one_rank}; --ranks {args.one_rank}): "
            f"best {result['one_rank_seconds'] * 1e3:.1f} ms "
            f"of {len(result['one_rank_runs'])} ({', '.join(f'{s * 1e3:.1f}' for s in result['one_rank_runs'])} ms): "
            f"{result['one_rank_tensors']:,} tensors, {result['one_rank_copies']:,} copies from "
            f"{result['one_rank_sources']:,} source files; validating and building its TensorPlans: "
            f"{result['one_rank_validate_build_seconds'] * 1e3:.1f} ms"
        )
    if "plan_seconds" not in result:
        return
    print(
        f"  every rank: {result['tensors']:,} tensor plans, {result['copies']:,} copies, "
        f"{result['sources']:,} source files"
    )
    print(
        f"  plan_transform + summary(): best {result['plan_seconds']:.3f} s of {result['repeat']} "
        f"({', '.join(f'{s:.3f}' for s in result['plan_runs'])})"
    )
    print(f"  validate_plan (what every run checks before writing): best {result['validate_seconds']:.3f} s")
    print(
        f"  building every TensorPlan afterwards (executors do it file by file): "
        f"best {result['materialise_seconds']:.3f} s"
    )
    print(
        f"  layout engine alone: best {result['layout_seconds']:.3f} s "
        f"({result['pieces']:,} transfer pieces in distinct tables)"
    )
    if "boxes_seconds" in result:
        print(
            f"plan_boxes, DCP-like: {args.params} parameters in {args.src_ranks} uneven dim-0 chunks each -> "
            f"{args.ranks} chunks: {result['boxes_tensors']:,} tensor plans, {result['boxes_copies']:,} copies, "
            f"{result['boxes_sources']:,} source files"
        )
        print(
            f"  plan_boxes + summary(): best {result['boxes_seconds']:.3f} s of {len(result['boxes_runs'])} "
            f"({', '.join(f'{s:.3f}' for s in result['boxes_runs'])}); building the ChunkedTensors "
            f"{result['boxes_build_seconds']:.3f} s, validate_plan {result['boxes_validate_seconds']:.3f} s, "
            f"one output's TensorPlans {result['boxes_materialise_one_seconds']:.3f} s"
        )
    if "profile" in result:
        print(f"cProfile of plan_transform with {result['profile_ranks']} destination ranks:")
        print(result["profile"])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/plan_bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=1000)
    p.add_argument("--ranks", type=int, default=1024, help="destination ranks in total (multiple of --dst-mp x --pp)")
    p.add_argument("--pp", type=int, default=1, help="destination pipeline stages")
    p.add_argument("--dst-mp", type=int, default=DST_MP, help="destination model parallel")
    p.add_argument(
        "--dst-opt", type=int, default=-1, help="destination optimizer shard size (-1: all of data parallel, 0: none)"
    )
    p.add_argument("--src-ranks", type=int, default=SRC_DEFAULT.ranks, help="source ranks in total")
    p.add_argument("--src-pp", type=int, default=SRC_DEFAULT.pp, help="source pipeline stages")
    p.add_argument("--src-mp", type=int, default=SRC_DEFAULT.mp, help="source model parallel")
    p.add_argument("--src-opt", type=int, default=-1, help="source optimizer shard size (-1: all of dp, 0: none)")
    p.add_argument("--one-rank", type=int, help="also time planning this destination rank alone (--ranks R)")
    p.add_argument("--only-one-rank", action="store_true", help="with --one-rank: time nothing else")
    p.add_argument("--repeat", type=int, default=3, help="fresh-process runs per timing; the best counts")
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile one full-size planning run (a slow plan is profiled anyway, on ranks / 8)",
    )
    p.add_argument("--no-boxes", action="store_true", help="skip the plan_boxes (DCP-like) row")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of text")
    p.add_argument("--one", choices=sorted(MODES), help=argparse.SUPPRESS)  # internal: one fresh-process timing
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    for side, what in (
        (Side(args.ranks, args.pp, args.dst_mp, args.dst_opt), "destination"),
        (Side(args.src_ranks, args.src_pp, args.src_mp, args.src_opt), "source"),
    ):
        problem = side.check(what)
        if problem:
            p.error(problem)
    if args.params < max(args.pp, args.src_pp):
        p.error("--params must be at least the number of stages of either side")
    if args.one_rank is not None and not 0 <= args.one_rank < args.ranks:
        p.error("--one-rank must be a destination rank")
    if args.only_one_rank and args.one_rank is None:
        p.error("--only-one-rank needs --one-rank")
    if args.one:
        print(json.dumps(MODES[args.one](args)))
        return 0
    result = run(args)
    result["versions"] = versions.dependency_versions()
    if args.json:
        print(json.dumps(result))
    else:
        _print(args, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
