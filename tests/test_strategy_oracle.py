"""Strategy files against MindSpore 2.10: it reads what we write, merges as we do, maps as we do.

Two oracle calls (MindSpore's import costs ~1.5 s each), each batching many cases:

1. files written by us are read by ``ms.build_searched_strategy`` / ``node_strategy_pb2`` with the
   same content; the same message built with MindSpore's pb2 classes has our bytes; and
   ``_convert_to_list`` / ``_extract_pipeline_stage_num`` / ``_get_device_num_from_strategy`` agree
   with ``layout_map`` / ``stage_count`` / ``device_num`` on random pipeline strategies.
2. ``ms.merge_pipeline_strategys`` on directories of our per-stage files. MindSpore merges in glob
   (directory listing) order, which the filesystem decides, while we sort; so the oracle reports the
   order its glob saw and we compare its bytes with ``merge_strategy_files`` run in that same order.
   Our sorted-order merge must then read back, through MindSpore, to the same layout map as ours.
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path
from typing import Any

import pytest

from reshard.errors import LayoutError
from reshard.formats.strategy import (
    StrategyFile,
    encode_strategy,
    make_strategy,
    merge_pipeline_strategies,
    merge_strategy_files,
    read_strategy,
    write_strategy,
)
from reshard.layout import ParamLayout, device_num, layout_map, stage_count

pytestmark = pytest.mark.oracle

DEV_MATRICES = [(2,), (4,), (2, 2), (2, 1, 2), (8,), (1,), (4, 2)]
PARAMS = ["emb", "w0", "w1", "norm.gamma", "head", "adam_m.w0"]


# ------------------------------------------------------------------ case generation


def random_layout(rng: random.Random, dev: tuple[int, ...], list_map: bool) -> ParamLayout:
    values = list(range(-1, len(dev)))
    ndim = rng.randint(1, 3)
    if list_map:
        tmap: tuple = tuple(
            tuple(rng.sample(values[1:] or [0], rng.randint(1, min(2, len(dev))))) if rng.random() < 0.6 else -1
            for _ in range(ndim)
        )
        if not any(isinstance(e, tuple) for e in tmap):
            tmap = ((0,), *tmap[1:])
    else:
        tmap = tuple(rng.choice(values) for _ in range(ndim))
    return ParamLayout(
        dev_matrix=dev,
        tensor_map=tmap,
        opt_shard_step=rng.choice([0, 0, 1, 2, 4]),
        opt_shard_size=rng.choice([0, 0, 2, -1]),
        field=rng.choice([0, 0, 0, 2]),
        split_shape=rng.choice([(), (), (1, 3)]),
        indices_offset=rng.choice([(), (), (0, 1)]),
    )


def random_pipeline(rng: random.Random, list_maps: bool) -> dict[str, ParamLayout]:
    """A merged-style layout dict: random stages, shared names, odd orders, unprefixed names."""
    stages = rng.randint(1, 4)
    dev_of_stage = [rng.choice(DEV_MATRICES) for _ in range(stages)]
    items: list[tuple[str, ParamLayout]] = []
    for stage in range(stages):
        for name in rng.sample(PARAMS, rng.randint(1, 4)):
            dev = dev_of_stage[stage] if rng.random() < 0.85 else rng.choice(DEV_MATRICES)
            lay = random_layout(rng, dev, list_maps and rng.random() < 0.4)
            items.append((f"{stage}-{name}" if stage or rng.random() < 0.8 else name, lay))
    if rng.random() < 0.3:  # an unprefixed duplicate of a stage-0 name
        items.append((rng.choice(PARAMS), random_layout(rng, dev_of_stage[0], False)))
    rng.shuffle(items)
    return dict(items)


def ms_list(staged: Any) -> list:
    """Our StagedLayout as MindSpore's 7-element ``_convert_to_list`` entry."""
    lay = staged.layout
    tmap = [list(e) for e in lay.tensor_map] if lay.is_list_map else list(lay.tensor_map)
    return [
        list(lay.dev_matrix),
        tmap,
        list(lay.split_shape),
        lay.field,
        lay.opt_shard_step,
        lay.opt_shard_size,
        list(staged.stages),
    ]


def layout_record(lay: ParamLayout) -> dict:
    """What MindSpore's ``build_searched_strategy`` should report for a layout written by us."""
    if lay.is_list_map:
        tmaps = [list(e) if isinstance(e, tuple) else [e] for e in lay.tensor_map]
        tmaps += [[]] if len(tmaps) == 1 else []
    else:
        tmaps = [list(lay.tensor_map)]
    return {
        "dev": [list(lay.dev_matrix)],
        "tmaps": tmaps,
        "split": [list(lay.split_shape)],
        "offset": [list(lay.indices_offset)],
        "field": lay.field,
        "step": lay.opt_shard_step,
        "size": lay.opt_shard_size,
    }


def describe(sf: StrategyFile) -> dict:
    """Plain-JSON content of a strategy file, from which the oracle builds MindSpore's message."""
    return {
        "current_stage": sf.current_stage,
        "ops": [[op.node_name, op.stage, op.strategies] for op in sf.strategy_items],
        "layouts": [[name, layout_record(lay)] for name, lay in sf.layouts.items()],
    }


# ------------------------------------------------------------------ oracle call 1: read, bytes, layout map

ORACLE_READ = """
from mindspore.train.node_strategy_pb2 import ParallelStrategyMap
from mindspore.parallel._parallel_serialization import (
    _build_searched_strategy, _convert_to_list, _extract_pipeline_stage_num, _get_device_num_from_strategy)

def record(pl):
    return {"dev": [list(d.dim) for d in pl.dev_matrix], "tmaps": [list(t.dim) for t in pl.tensor_map],
            "split": [list(s.dim) for s in pl.param_split_shape], "offset": [list(s.dim) for s in pl.indices_offset],
            "field": pl.field, "step": pl.opt_weight_shard_step, "size": pl.opt_weight_shard_size}

def build(desc):
    m = ParallelStrategyMap()
    m.current_stage = desc["current_stage"]
    for name, stage, strategies in desc["ops"]:
        it = m.parallel_strategy_item.add()
        it.node_name = name
        it.parallel_strategys.stage = stage
        for s in strategies:
            it.parallel_strategys.parallel_strategy.add().dim.extend(s)
    for name, rec in desc["layouts"]:
        it = m.parallel_layout_item.add()
        it.param_name = name
        pl = it.parallel_layouts
        for key, field in (("dev", pl.dev_matrix), ("tmaps", pl.tensor_map), ("split", pl.param_split_shape),
                           ("offset", pl.indices_offset)):
            for dims in rec[key]:
                field.add().dim.extend(dims)
        pl.field, pl.opt_weight_shard_step, pl.opt_weight_shard_size = rec["field"], rec["step"], rec["size"]
    return m.SerializeToString().hex()

def attempt(fn, *a):
    try:
        return fn(*a)
    except Exception as e:
        return "error"

res = {"read": [], "bytes": [], "convert": []}
for path in ARGS["read"]:
    entry = {"layouts": [[k, record(v)] for k, v in ms.build_searched_strategy(path).items()]}
    if not path.endswith(".json"):
        m = ParallelStrategyMap()
        m.ParseFromString(open(path, "rb").read())
        entry["current_stage"] = m.current_stage
        entry["ops"] = [[i.node_name, i.parallel_strategys.stage,
                         [list(s.dim) for s in i.parallel_strategys.parallel_strategy]]
                        for i in m.parallel_strategy_item]
    res["read"].append(entry)
res["bytes"] = [build(desc) for desc in ARGS["bytes"]]
for path, ranks in ARGS["convert"]:
    strategy = _build_searched_strategy(path)
    maps = [list(_convert_to_list(strategy, r).items()) for r in ranks]
    res["convert"].append([maps, attempt(_extract_pipeline_stage_num, path),
                           attempt(lambda p: int(_get_device_num_from_strategy(p)), path)])
out(res)
"""


def test_mindspore_reads_what_we_write(oracle, tmp_path: Path) -> None:
    rng = random.Random(20240611)
    handmade = {
        "p1_stage0": make_strategy({"emb": ParamLayout((2,), (0, -1)), "w0": ParamLayout((2,), (-1, 0))}),
        "list_maps": make_strategy(
            {
                "w": ParamLayout((2, 2, 2), ((2, 1), -1)),
                "b": ParamLayout((2, 2), ((1, 0),)),  # 1-D: extra empty TensorMap
                "c": ParamLayout((4,), ((0,), (-1,))),
                "d": ParamLayout((2, 2), (1, ((0,)))),
            },
            stage=2,
            ops={"Default/MatMul-op0": [[2, 1], [1, 4]], "Default/Add-op1": [[2, 2]], "empty": []},
        ),
        "opt_and_split": make_strategy(
            {
                "w": ParamLayout((2, 2, 2), (0, 1), opt_shard_step=4, opt_shard_size=2),
                "x": ParamLayout((8,), (-1, -1), opt_shard_step=1, opt_shard_size=-1),
                "s": ParamLayout((2,), (0,), field=2, split_shape=(1, 3), indices_offset=(0, 1)),
                "scalar": ParamLayout((2,), ()),
            },
            stage=1,
            current_stage=7,
            tensor_shapes={"w": (8, 8)},
        ),
    }
    for i in range(12):
        handmade[f"random{i}"] = make_strategy(
            {p: random_layout(rng, rng.choice(DEV_MATRICES), i % 2 == 0 and rng.random() < 0.4) for p in PARAMS},
            stage=rng.randint(0, 5),
            current_stage=rng.randint(0, 3),
        )
    read_paths, expected_read = [], []
    for key, sf in handmade.items():
        exts = ["ckpt"] if any(lay.is_list_map for lay in sf.layouts.values()) else ["ckpt", "json"]
        for ext in exts:
            path = tmp_path / f"{key}.{ext}"
            write_strategy(path, sf)
            read_paths.append(str(path))
            expected_read.append((ext, sf))

    convert_cases, ours = [], []
    for i in range(60):
        layouts = random_pipeline(rng, list_maps=i % 2 == 0)
        sf = make_strategy(layouts)
        ext = "ckpt" if i % 3 else "json"
        if ext == "json" and any(lay.is_list_map for lay in layouts.values()):
            ext = "ckpt"
        path = tmp_path / f"pipe{i}.{ext}"
        write_strategy(path, sf)
        n = max(math.prod(lay.dev_matrix) for lay in layouts.values())
        ranks = [None, 0, *rng.sample(range(1, 5 * n + 8), 5)]
        convert_cases.append([str(path), ranks])
        ours.append((read_strategy(path), ranks))

    res = oracle(
        ORACLE_READ,
        {"read": read_paths, "bytes": [describe(sf) for sf in handmade.values()], "convert": convert_cases},
    )

    for (ext, sf), got in zip(expected_read, res["read"], strict=True):
        assert got["layouts"] == [[k, layout_record(v)] for k, v in sf.layouts.items()]
        if ext == "ckpt":
            assert got["current_stage"] == sf.current_stage
            assert got["ops"] == [[op.node_name, op.stage, op.strategies] for op in sf.strategy_items]
    assert len(res["read"]) == len(read_paths) >= 20

    for sf, hex_bytes in zip(handmade.values(), res["bytes"], strict=True):
        assert encode_strategy(sf).hex() == hex_bytes

    compared = 0
    for (sf, ranks), (maps, ms_stages, ms_devices) in zip(ours, res["convert"], strict=True):
        for rank, ms_map in zip(ranks, maps, strict=True):
            assert [[k, ms_list(v)] for k, v in layout_map(sf, rank).items()] == ms_map, (sf.path, rank)
            compared += 1
        if ms_stages == "error":
            with pytest.raises(LayoutError):
                stage_count(sf)
        else:
            assert stage_count(sf) == ms_stages
        assert device_num(sf) == ms_devices
    assert compared == 60 * 7


# ------------------------------------------------------------------ oracle call 2: merge

ORACLE_MERGE = """
import glob
from mindspore.parallel._parallel_serialization import _build_searched_strategy, _convert_to_list
res = []
for src, dst, ours in ARGS:
    ext = ".json" if dst.endswith(".json") else ".ckpt"
    order = [os.path.basename(p) for p in glob.glob(os.path.join(src, "*" + ext))]
    ms.merge_pipeline_strategys(src, dst)
    data = open(dst, "rb").read()
    ours_map = [list(_convert_to_list(_build_searched_strategy(ours), r).items()) for r in (None, 0, 5)]
    res.append([order, data.hex(), ours_map])
out(res)
"""


def stage_file(layouts: dict[str, ParamLayout], stage: int, **kw: Any) -> StrategyFile:
    return make_strategy(layouts, stage=stage, **kw)


def merge_cases() -> dict[str, dict[str, StrategyFile]]:
    rng = random.Random(7)
    emb = [
        ParamLayout((2,), (0, -1)),
        ParamLayout((2,), (-1, 0)),
        ParamLayout((2, 2), (1, 0)),
        ParamLayout((4,), (-1, 0)),
    ]
    cases: dict[str, dict[str, StrategyFile]] = {}
    for ext in ("ckpt", "json"):
        cases[f"p1_{ext}"] = {
            f"stage0.{ext}": stage_file({"emb": emb[0], "w0": ParamLayout((2,), (-1, 0))}, 0),
            f"stage1.{ext}": stage_file({"emb": emb[1], "w1": ParamLayout((2,), (0, -1))}, 1),
        }
        four = {}
        for stage in range(4):
            layouts = {f"layer{stage}.w": random_layout(rng, (2, 2), ext == "ckpt" and stage == 2)}
            if stage in (0, 3):
                layouts = {"emb": emb[stage], **layouts}
            ops = {f"op{stage}": [[2, 1]], "shared_op": [[stage + 1]]}
            shapes = {"emb": (16, 8)} if ext == "json" else None
            four[f"s{stage}_{rng.randint(0, 999)}.{ext}"] = stage_file(layouts, stage, ops=ops, tensor_shapes=shapes)
        first = next(iter(four))
        four[f"copy_of_{first}"] = four[first]  # byte-identical duplicate
        four[f"zz_late_stage1.{ext}"] = stage_file({"late": ParamLayout((4,), (0,))}, 1)  # same stage again
        cases[f"four_{ext}"] = four
    return cases


def test_merge_matches_mindspore(oracle, tmp_path: Path) -> None:
    cases = merge_cases()
    args, ours_files = [], []
    for key, files in cases.items():
        src = tmp_path / key
        src.mkdir()
        for name, sf in files.items():
            write_strategy(src / name, sf)
        ext = ".json" if key.endswith("json") else ".ckpt"
        ours = merge_pipeline_strategies(src, tmp_path / "ours" / f"{key}{ext}")
        ours_files.append(read_strategy(ours))
        args.append([str(src), str(tmp_path / "ms" / f"{key}{ext}"), ours])

    res = oracle(ORACLE_MERGE, args)

    for (src, _, _), ours_sf, (order, ms_hex, ms_maps) in zip(args, ours_files, res, strict=True):
        fmt, data = merge_strategy_files([os.path.join(src, name) for name in order])
        assert data.hex() == ms_hex, src
        assert fmt == ours_sf.format
        # our sorted-order merge, as MindSpore maps it, equals our own layout map
        for rank, ms_map in zip((None, 0, 5), ms_maps, strict=True):
            assert [[k, ms_list(v)] for k, v in layout_map(ours_sf, rank).items()] == ms_map

    # the shared embedding kept one layout per stage; the duplicate and the late stage-1 file are skipped
    four = next(sf for sf in ours_files if sf.format == "protobuf" and "0-emb" in sf.layouts and "3-emb" in sf.layouts)
    assert [n for n in four.layouts if n.endswith("emb")] == ["0-emb", "3-emb"]
    assert "1-late" not in four.layouts
    assert len(four.strategy_items) == 8
