"""Planning micro-benchmark: ``plan_transform`` for 1 000 parameters x 1 024 destination ranks.

    python3 bench/plan_bench.py                  # table on stdout
    python3 bench/plan_bench.py --pp 4 --json    # 4 pipeline stages of 256 ranks, JSON line
    python3 bench/plan_bench.py --profile        # + cProfile top entries of one planning run

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
  plan objects: the slice algebra's share.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import time
from typing import Any

from reshard import dtypes, layout
from reshard.formats.strategy import StrategyFile, make_strategy
from reshard.layout import ParamLayout, layout_map
from reshard.plan import SourceFile, SourceTensor, plan_transform
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


def _layout(dev: tuple[int, int], tmap: tuple[int, ...], ndim: int) -> ParamLayout:
    dp, mp = dev
    sharded = dp > 1 and ndim == 2  # optimizer shards over data parallel, as reshard.synthetic does
    return ParamLayout(dev, tmap, mp if sharded else 0, dp if sharded else 0)


def build(params: int, dst_ranks: int, pp: int) -> tuple[dict[int, SourceFile], StrategyFile, StrategyFile]:
    """Sources (slice shapes only), the source strategy and the merged destination strategy."""
    specs = llama_params(params)
    src_layouts = {name: _layout(SRC_DEV, tmap, len(shape)) for name, shape, tmap in specs}
    per_stage = dst_ranks // pp
    dst_dev = (per_stage // DST_MP, DST_MP)
    dst_layouts: dict[str, ParamLayout] = {}
    for i, (name, shape, tmap) in enumerate(specs):
        stage = i * pp // len(specs)
        key = f"{stage}-{name}" if pp > 1 else name
        dst_layouts[key] = _layout(dst_dev, tmap, len(shape))
    sources = {}
    for rank in range(SRC_DEV[0] * SRC_DEV[1]):
        tensors = {}
        for name, shape, _ in specs:
            sl = layout.slice_shape(src_layouts[name], shape)
            nbytes = dtypes.BFLOAT16.itemsize
            for d in sl:
                nbytes *= d
            tensors[name] = SourceTensor(dtypes.BFLOAT16, sl, nbytes)
        sources[rank] = SourceFile(f"/nonexistent/rank_{rank}/checkpoint_{rank}.ckpt", rank, tensors)
    return sources, make_strategy(src_layouts), make_strategy(dst_layouts)


def time_plan(params: int, dst_ranks: int, pp: int) -> dict[str, Any]:
    sources, src, dst = build(params, dst_ranks, pp)
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
    }


def time_layout(params: int, dst_ranks: int, pp: int) -> dict[str, Any]:
    """The layout-engine calls of ``plan_transform`` for the same job, and nothing else."""
    sources, src, dst = build(params, dst_ranks, pp)
    shapes = {name: t.shape for name, t in sources[0].tensors.items()}
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


def profile_plan(params: int, dst_ranks: int, pp: int) -> str:
    """cProfile of one ``plan_transform`` + ``summary()`` (cold caches): top entries by own and by cumulative time."""
    sources, src, dst = build(params, dst_ranks, pp)
    profiler = cProfile.Profile()
    profiler.enable()
    plan_transform(sources, src, dst, "/nonexistent/out", "checkpoint_", "ckpt").summary()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(PROFILE_TOP)
    stats.sort_stats("cumulative").print_stats(PROFILE_TOP)
    return text.getvalue()


MODES = {"plan": time_plan, "layout": time_layout}


def _fresh(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one timing in a new interpreter (empty layout caches)."""
    argv = [
        sys.executable,
        os.path.abspath(__file__),
        "--one",
        mode,
        "--params",
        str(args.params),
        "--ranks",
        str(args.ranks),
        "--pp",
        str(args.pp),
    ]
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
    plans = _timings("plan", args)
    layouts = _timings("layout", args)
    best = min(p["seconds"] for p in plans)
    result: dict[str, Any] = {
        "params": args.params,
        "dst_ranks": args.ranks,
        "pp": args.pp,
        "src_ranks": SRC_DEV[0] * SRC_DEV[1],
        "repeat": len(plans),
        "plan_seconds": best,
        "plan_runs": [p["seconds"] for p in plans],
        "validate_seconds": min(p["validate_seconds"] for p in plans),
        "materialise_seconds": min(p["materialise_seconds"] for p in plans),
        "layout_seconds": min(x["seconds"] for x in layouts),
        "layout_runs": [x["seconds"] for x in layouts],
        "tensors": plans[0]["tensors"],
        "copies": plans[0]["copies"],
        "outputs": plans[0]["outputs"],
        "pieces": layouts[0]["pieces"],
        "target_seconds": SLOW_SECONDS,
    }
    if args.profile or best > SLOW_SECONDS:
        ranks = args.ranks if args.profile else max(DST_MP * args.pp, args.ranks // PROFILE_SHRINK)
        result["profile_ranks"] = ranks
        result["profile"] = profile_plan(args.params, ranks, args.pp)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/plan_bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=1000)
    p.add_argument("--ranks", type=int, default=1024, help="destination ranks in total (multiple of 16 x pp)")
    p.add_argument("--pp", type=int, default=1, help="destination pipeline stages")
    p.add_argument("--repeat", type=int, default=3, help="fresh-process runs per timing; the best counts")
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile one full-size planning run (a slow plan is profiled anyway, on ranks / 8)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON line instead of text")
    p.add_argument("--one", choices=sorted(MODES), help=argparse.SUPPRESS)  # internal: one fresh-process timing
    args = p.parse_args(argv)
    if args.ranks % (DST_MP * args.pp) or args.params < 1:
        p.error(f"--ranks must be a multiple of {DST_MP} x --pp, --params positive")
    if args.one:
        print(json.dumps(MODES[args.one](args.params, args.ranks, args.pp)))
        return 0
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"plan_transform, {args.params} parameters x {args.ranks} destination ranks ({args.pp} stage(s)), "
        f"source {result['src_ranks']} ranks: {result['tensors']:,} tensor plans, {result['copies']:,} copies"
    )
    print(
        f"  plan_transform + summary(): best {result['plan_seconds']:.3f} s of {result['repeat']} "
        f"({', '.join(f'{s:.3f}' for s in result['plan_runs'])}); target < {SLOW_SECONDS:g} s"
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
    if "profile" in result:
        print(f"cProfile of plan_transform with {result['profile_ranks']} destination ranks:")
        print(result["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
