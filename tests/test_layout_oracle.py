"""The layout engine against MindSpore 2.10 (batched: one oracle call per aspect, hundreds of cases).

* flat-layout construction vs ``_construct_tensor_layout_for_opt_shard[_by_layout]`` + ``_expand_layout``;
* ``needed_ranks`` vs ``mindspore.parallel._tensor._get_needed_rank_list_by_layouts`` for every rank;
* ``rank_list_for_transform`` vs ``ms.rank_list_for_transform`` on random (pipelined) strategy files
  written in the oracle process with ``node_strategy_pb2``;
* boxes vs the slices ``ms.transform_checkpoints`` cuts from a full checkpoint;
* the copy-selection rule: source ranks tagged with their rank id, resharded by MindSpore, must
  show in every destination element the source rank ``transfer_pieces`` chose;
* ``redundancy_groups`` vs ``get_parameter_redundancy``.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import numpy as np
import pytest

from reshard.errors import LayoutError, ReshardError
from reshard.layout import (
    FlatLayout,
    ParamLayout,
    flat_layout,
    full_shape,
    needed_ranks,
    normalize_device_num,
    opt_shard_size,
    rank_box,
    rank_list_for_transform,
    redundancy_groups,
    slice_shape,
    tensor_strategy,
    transfer_pieces,
)
from tests.test_layout import layout_map, parts, random_dev, random_layout

pytestmark = pytest.mark.oracle

# Oracle-side helper: a strategy file from JSON layout items, built with MindSpore's own pb2.
WRITE_STRATEGY = """
from mindspore.train import node_strategy_pb2 as spb

def write_strategy(path, items, stage=0):
    m = spb.ParallelStrategyMap()
    m.current_stage = 1
    op = m.parallel_strategy_item.add()
    op.node_name = "op"
    op.parallel_strategys.stage = stage
    op.parallel_strategys.parallel_strategy.add().dim.extend([1])
    for d in items:
        li = m.parallel_layout_item.add()
        li.param_name = d["name"]
        pl = li.parallel_layouts
        pl.dev_matrix.add().dim.extend(d["dev"])
        tm = d["tmap"]
        if any(isinstance(e, list) for e in tm):
            for e in tm:
                pl.tensor_map.add().dim.extend(e)
            if len(tm) == 1:
                pl.tensor_map.add()
        else:
            pl.tensor_map.add().dim.extend(tm)
        pl.param_split_shape.add()
        pl.indices_offset.add()
        pl.field = 0
        pl.opt_weight_shard_step = d["step"]
        pl.opt_weight_shard_size = d["size"]
    with open(path, "wb") as f:
        f.write(m.SerializeToString())

def save_full(path, params):
    ms.save_checkpoint([{"name": p["name"], "data": ms.Tensor(np.arange(int(np.prod(p["shape"])),
                        dtype=np.float32).reshape(p["shape"]))} for p in params], path)

def read_ckpt(path):
    return {k: v.asnumpy().astype(np.int64).ravel().tolist() for k, v in ms.load_checkpoint(path).items()}
"""


def item(name: str, p: ParamLayout) -> dict[str, Any]:
    tmap = [list(e) if isinstance(e, tuple) else e for e in p.tensor_map]
    return {"name": name, "dev": list(p.dev_matrix), "tmap": tmap, "step": p.opt_shard_step, "size": p.opt_shard_size}


def flat_json(f: FlatLayout) -> list[list[int]]:
    return [list(f.dev), list(f.tmap), list(f.shape)]


def full_values(shape: tuple[int, ...]) -> np.ndarray:
    return np.arange(math.prod(shape), dtype=np.int64).reshape(shape)


def cut(full: np.ndarray, box: tuple[tuple[int, int], ...]) -> np.ndarray:
    return full[tuple(slice(lo, hi) for lo, hi in box)]


# --------------------------------------------------------------------------------------------
# flat-layout construction


def test_flat_construction_matches_mindspore(oracle) -> None:
    rng = random.Random(11)
    cases: list[tuple[ParamLayout, tuple[int, ...]]] = []
    while len(cases) < 700:
        p = random_layout(rng, opt=True)
        if len(cases) % 2:  # arbitrary (often invalid) steps and sizes
            p = dataclasses.replace(
                p, opt_shard_step=rng.choice([1, 2, 3, 4, 6, 8]), opt_shard_size=rng.choice([1, 2, 3, 4, 6, -1])
            )
        shape = tuple(math.prod(tensor_strategy(p)) * rng.randint(1, 2) * k for k in parts(p))
        cases.append((p, shape))
    payload = [[*item("x", p).values(), list(shape), p.is_list_map, opt_shard_size(p)] for p, shape in cases]
    got = oracle(
        """
from mindspore.parallel import _tensor as T
res = []
for _, dev, tm, step, size, shape, lm, resolved in ARGS:
    try:
        if resolved == 0:
            r = T._expand_layout(dev, tm, shape) if lm else (dev, tm, shape)
        elif lm:
            r = T._expand_layout(*T._construct_tensor_layout_for_opt_shard_by_layout(dev, tm, step, resolved, shape))
        else:
            r = T._construct_tensor_layout_for_opt_shard(dev, tm, step, resolved, shape)
        res.append([[int(x) for x in part] for part in r])
    except Exception as e:
        res.append(repr(e)[:200])
out(res)
""",
        payload,
    )
    matched = 0
    for (p, shape), theirs in zip(cases, got, strict=True):
        try:
            ours: Any = flat_json(flat_layout(p, shape))
        except LayoutError:
            ours = None
        if isinstance(theirs, str) or not _consistent(p, shape, theirs):
            # MindSpore refuses, or builds a layout whose device count or slice size contradicts the
            # file (its converter then fails or misplaces data): we must refuse.
            assert ours is None, (p, shape, theirs, ours)
        else:
            assert ours == theirs, (p, shape, theirs)
            matched += 1
    print(f"flat construction: {matched} layouts equal, {len(cases) - matched} refused by both")
    assert matched > 400


def _consistent(p: ParamLayout, shape: tuple[int, ...], flat: list[list[int]]) -> bool:
    dev, tmap, fshape = flat
    n = len(dev)
    splits = math.prod(dev[n - 1 - v] for v in tmap if v != -1)
    size = max(p.opt_shard_size if p.opt_shard_size > 0 else (opt_shard_size(p) or 1), 1)
    expected = math.prod(shape) // (math.prod(tensor_strategy(p)) * size)
    return math.prod(dev) == p.device_num and math.prod(fshape) // splits == expected


# --------------------------------------------------------------------------------------------
# needed ranks


def _factorize(rng: random.Random, n: int) -> list[int]:
    return random_dev(rng, n)


def _adversarial_flat(rng: random.Random, devices: int, elements: int) -> FlatLayout:
    dev = _factorize(rng, devices)
    shape = _factorize(rng, elements)
    n = len(dev)
    tmap = [-1] * len(shape)
    for j in rng.sample(range(n), n):
        free = [t for t in range(len(shape)) if tmap[t] == -1 and shape[t] % dev[j] == 0]
        if free and rng.random() < 0.7:
            tmap[rng.choice(free)] = n - 1 - j
    return FlatLayout(tuple(dev), tuple(tmap), tuple(shape))


def needed_cases(rng: random.Random, count: int) -> list[tuple[FlatLayout, FlatLayout]]:
    """Half from real layout pairs (opt shards, list maps, count changes), half adversarial flat pairs."""
    cases: list[tuple[FlatLayout, FlatLayout]] = []
    while len(cases) < count:
        if len(cases) % 2:
            n = rng.choice([4, 6, 8, 12, 16, 24, 30])
            m = n * rng.choice([1, 2, 3, 5, 6])
            f = _adversarial_flat(rng, n, m)
            t = _adversarial_flat(rng, n, m) if rng.random() < 0.6 else _adversarial_flat(rng, n, math.prod(f.shape))
            if math.prod(t.shape) != math.prod(f.shape):
                continue
            cases.append((f, t))
            continue
        ndim = rng.randint(1, 3)
        a, b = random_layout(rng, ndim), random_layout(rng, ndim)
        shape = [math.lcm(x, y) * rng.randint(1, 2) for x, y in zip(parts(a), parts(b), strict=True)]
        try:
            cases.append(normalize_device_num(flat_layout(a, shape), flat_layout(b, shape)))
        except LayoutError:
            continue
    return cases


def test_needed_ranks_match_mindspore(oracle) -> None:
    cases = needed_cases(random.Random(5), 360)
    got = oracle(
        """
from mindspore.parallel._tensor import _get_needed_rank_list_by_layouts as needed
def one(f, t, n, r):
    try:
        return sorted(int(x) for x in needed(tuple(f), tuple(t), list(range(n)), r))
    except Exception as e:  # ranks beyond the devices: an error unless nothing must move
        return "ERR " + str(e)[:80]
res = []
for f, t in ARGS:
    n = int(np.prod(f[0]))
    res.append([one(f, t, n, r) for r in [*range(n), n, 2 * n + 1]])
out(res)
""",
        [[flat_json(f), flat_json(t)] for f, t in cases],
    )
    ranks = beyond = 0
    for (f, t), theirs in zip(cases, got, strict=True):
        n = f.device_num
        assert [needed_ranks(f, t, r) for r in range(n)] == theirs[:n], (f, t)
        ranks += n
        for r, their in zip((n, 2 * n + 1), theirs[n:], strict=True):
            if isinstance(their, str):
                with pytest.raises(LayoutError, match="outside"):
                    needed_ranks(f, t, r)
            else:
                assert needed_ranks(f, t, r) == their == [r]
                beyond += 1
    print(f"needed ranks: {len(cases)} layout pairs, {ranks} ranks equal, {beyond} beyond-range no-op ranks")
    assert ranks > 3000 and beyond > 20


# --------------------------------------------------------------------------------------------
# rank_list_for_transform


def _strategy(rng: random.Random, devices: int, stages: int, names: list[str]) -> dict[str, ParamLayout]:
    """A merged-style strategy: every name in one or more stages ('<stage>-name' when pipelined)."""
    ndims = {name: rng.randint(1, 3) for name in names}
    homes = {name: set(rng.sample(range(stages), rng.choice([1, 1, 1, 2]) if stages > 1 else 1)) for name in names}
    for stage in range(stages):  # every stage holds something (MindSpore needs stages 0..k-1)
        if not any(stage in h for h in homes.values()):
            homes[rng.choice(names)].add(stage)
    out: dict[str, ParamLayout] = {}
    for stage in range(stages):
        for name in names:
            if stage in homes[name]:
                key = f"{stage}-{name}" if stages > 1 else name
                out[key] = random_layout(rng, ndims[name], devices=devices)
    return out


def rank_list_cases(rng: random.Random, count: int) -> list[dict[str, Any]]:
    cases = []
    while len(cases) < count:
        n_src = rng.choice([1, 2, 3, 4, 6, 8])
        names = [f"p{i}" for i in range(rng.randint(1, 4))]
        src = _strategy(rng, n_src, rng.choice([1, 1, 2, 3]), names)
        if not src or len({k.split("-")[-1] for k in src}) != len(names):
            continue
        dst = None
        if rng.random() < 0.8:
            n_dst = rng.choice([d for d in (1, 2, 3, 4, 6, 8, 12) if max(d, n_src) % min(d, n_src) == 0])
            kept = [n for n in names if rng.random() < 0.85] or names[:1]
            dst = _strategy(rng, n_dst, rng.choice([1, 1, 2]), kept)
            dst = _same_ndims(src, dst)
            if dst is None:
                continue
        total = (next(iter(dst.values())).device_num * _stage_count(dst)) if dst else 2
        cases.append({"src": src, "dst": dst, "ranks": list(range(total))})
    return cases


def _stage_count(items: dict[str, ParamLayout]) -> int:
    return 1 + max((int(k.split("-")[0]) if "-" in k else 0) for k in items)


def _same_ndims(src: dict[str, ParamLayout], dst: dict[str, ParamLayout]) -> dict[str, ParamLayout] | None:
    ndim = {k.split("-")[-1]: len(p.tensor_map) for k, p in src.items()}
    if any(len(p.tensor_map) != ndim[k.split("-")[-1]] for k, p in dst.items()):
        return None
    return dst


def test_rank_list_for_transform_matches_mindspore(oracle, tmp_path) -> None:
    rng = random.Random(3)
    cases = [c for c in rank_list_cases(rng, 170)]
    payload = []
    for i, case in enumerate(cases):
        payload.append(
            {
                "src": [item(k, p) for k, p in case["src"].items()],
                "dst": [item(k, p) for k, p in case["dst"].items()] if case["dst"] else None,
                "ranks": case["ranks"],
                "dir": str(tmp_path / f"c{i}"),
            }
        )
    got = oracle(
        WRITE_STRATEGY
        + """
res = []
for case in ARGS:
    os.makedirs(case["dir"])
    src = os.path.join(case["dir"], "src.ckpt")
    write_strategy(src, case["src"])
    dst = None
    if case["dst"] is not None:
        dst = os.path.join(case["dir"], "dst.ckpt")
        write_strategy(dst, case["dst"])
    row = []
    for r in case["ranks"]:
        try:
            row.append([int(x) for x in ms.rank_list_for_transform(r, src, dst)])
        except Exception as e:
            row.append("ERR " + repr(e)[:200])
    res.append(row)
out(res)
""",
        payload,
    )
    compared = errors = 0
    for case, theirs in zip(cases, got, strict=True):
        for rank, their in zip(case["ranks"], theirs, strict=True):
            dst = layout_map(case["dst"], rank) if case["dst"] else None
            try:
                ours: Any = rank_list_for_transform(rank, layout_map(case["src"]), dst)
            except ReshardError as exc:
                ours = f"ERR {exc}"
            if isinstance(their, str):
                assert isinstance(ours, str), (case, rank, their, ours)
                errors += 1
            else:
                assert ours == their, (case, rank)
                compared += 1
    print(f"rank_list_for_transform: {compared} rank lists equal over {len(cases)} strategy pairs, {errors} errors")
    assert compared > 500 and errors == 0


# --------------------------------------------------------------------------------------------
# slices cut from a full checkpoint


def simple_path_layout(rng: random.Random, devices: int) -> ParamLayout | None:
    """Optimizer shard on the simple path: only the outermost dev dim repeated, or all of them."""
    dev = [d for d in random_dev(rng, devices) if d > 1]
    if len(dev) < 2:
        return None
    if rng.random() < 0.3:  # unsharded tensor, every dev dim repeated; groups of consecutive ranks
        size = rng.choice([d for d in range(2, devices + 1) if devices % d == 0])
        return ParamLayout(tuple(dev), (-1,) * rng.randint(1, 2), 1, size)
    n = len(dev)
    values = list(range(n - 1))  # every dev dim but the outermost, in any tensor-dim order
    rng.shuffle(values)
    size = rng.choice([d for d in range(2, dev[0] + 1) if dev[0] % d == 0] + [-1])
    return ParamLayout(tuple(dev), tuple(values), math.prod(dev[1:]), size)


def slice_cases(rng: random.Random) -> list[dict[str, Any]]:
    cases = []
    for n in (1, 2, 3, 4, 6, 8, 12, 16):
        params: dict[str, tuple[ParamLayout, tuple[int, ...]]] = {}
        while len(params) < 20:
            p = random_layout(rng, opt=len(params) % 2 == 0, list_map=len(params) % 3 == 0 or None, devices=n)
            if len(params) % 4 == 1:
                p = simple_path_layout(rng, n) or p
            params[f"w{len(params)}"] = (p, full_shape(p, [rng.randint(1, 2) for _ in p.tensor_map]))
        cases.append({"n": n, "params": params})
    return cases


def test_slices_from_full_match_mindspore(oracle, tmp_path) -> None:
    cases = slice_cases(random.Random(17))
    payload = [
        {
            "dir": str(tmp_path / f"n{case['n']}"),
            "n": case["n"],
            "params": [{**item(k, p), "shape": list(s)} for k, (p, s) in case["params"].items()],
        }
        for case in cases
    ]
    got = oracle(
        WRITE_STRATEGY
        + """
res = []
for case in ARGS:
    d = case["dir"]
    os.makedirs(d + "/src/rank_0")
    save_full(d + "/src/rank_0/full.ckpt", case["params"])
    write_strategy(d + "/dst.ckpt", case["params"])
    ms.transform_checkpoints(d + "/src", d + "/out", "c", None, d + "/dst.ckpt")
    res.append([read_ckpt(f"{d}/out/rank_{r}/c{r}.ckpt") for r in range(case["n"])])
out(res)
""",
        payload,
    )
    slices = opt_simple = quirk = opt_helper = lists = auto = 0
    for case, per_rank in zip(cases, got, strict=True):
        for name, (p, shape) in case["params"].items():
            full = full_values(shape)
            for r in range(case["n"]):
                expected = cut(full, rank_box(p, shape, r))
                assert list(expected.shape) == list(slice_shape(p, shape))
                assert per_rank[r][name] == expected.ravel().tolist(), (p, shape, r)
                slices += 1
            opt_simple += bool(opt_shard_size(p)) and _simple_path(p)
            quirk += bool(opt_shard_size(p)) and _simple_path(p) and _moves_mp_blocks(p, shape)
            opt_helper += bool(opt_shard_size(p)) and not _simple_path(p)
            lists += p.is_list_map
            auto += p.opt_shard_size == -1
    kinds = f"{opt_simple} simple-path ({quirk} re-ordering mp blocks), {opt_helper} helper-path, "
    kinds += f"{lists} list-map, {auto} size -1 params"
    print(f"slices: {slices} equal ({kinds})")
    assert slices > 1000 and opt_simple > 3 and quirk > 0 and opt_helper > 3 and lists > 10 and auto > 2


def _moves_mp_blocks(p: ParamLayout, shape: tuple[int, ...]) -> bool:
    """docs/formats.md §7.5: a rank's optimizer shard lies outside its own model-parallel block."""
    plain = dataclasses.replace(p, opt_shard_step=0, opt_shard_size=0)
    for r in range(p.device_num):
        outer = rank_box(plain, shape, r)
        if any(not (o0 <= lo and hi <= o1) for (lo, hi), (o0, o1) in zip(rank_box(p, shape, r), outer, strict=True)):
            return True
    return False


def _simple_path(p: ParamLayout) -> bool:
    n = len(p.dev_matrix)
    used = {n - 1 - v for e in p.tensor_map for v in (e if isinstance(e, tuple) else (e,)) if v != -1}
    rep = [j for j in range(n) if j not in used and p.dev_matrix[j] > 1]
    return not p.is_list_map and (rep == [0] or len(rep) == n)


# --------------------------------------------------------------------------------------------
# copy selection: which source rank supplies every destination element

TAG = 1 << 16  # full values stay below this; value // TAG = source rank (float32 exact below 2**24)

COPY_PAIRS = ((4, 4), (8, 4), (4, 8), (2, 8), (8, 2), (6, 3), (3, 6), (6, 6), (12, 4), (4, None), (8, None), (6, None))


def copy_cases(rng: random.Random) -> list[dict[str, Any]]:
    cases = []
    for n_src, n_dst in COPY_PAIRS:
        params = {}
        while len(params) < 10:
            ndim = rng.randint(1, 3)
            src = random_layout(rng, ndim, devices=n_src)
            dst = random_layout(rng, ndim, devices=n_dst) if n_dst else None
            b = parts(dst) if dst else [1] * ndim
            shape = tuple(math.lcm(x, y) * rng.randint(1, 2) for x, y in zip(parts(src), b, strict=True))
            if math.prod(shape) < TAG:
                params[f"w{len(params)}"] = (src, dst, shape)
        cases.append({"n_src": n_src, "n_dst": n_dst, "params": params})
    return cases


def test_copy_selection_matches_mindspore(oracle, tmp_path) -> None:
    cases = copy_cases(random.Random(23))
    payload = []
    for i, case in enumerate(cases):
        ps = case["params"]
        payload.append(
            {
                "dir": str(tmp_path / f"c{i}"),
                "n_src": case["n_src"],
                "n_out": case["n_dst"] or 1,
                "full": [{"name": k, "shape": list(s)} for k, (_, _, s) in ps.items()],
                "src": [item(k, a) for k, (a, _, _) in ps.items()],
                "dst": [item(k, b) for k, (_, b, _) in ps.items()] if case["n_dst"] else None,
            }
        )
    got = oracle(
        WRITE_STRATEGY
        + f"\nTAG = {TAG}\n"
        + """
res = []
for case in ARGS:
    d = case["dir"]
    os.makedirs(d + "/full/rank_0")
    save_full(d + "/full/rank_0/full.ckpt", case["full"])
    write_strategy(d + "/src.ckpt", case["src"])
    ms.transform_checkpoints(d + "/full", d + "/plain", "a", None, d + "/src.ckpt")
    for r in range(case["n_src"]):   # make redundant copies distinguishable: add rank * TAG
        loaded = ms.load_checkpoint(f"{d}/plain/rank_{r}/a{r}.ckpt")
        os.makedirs(f"{d}/tagged/rank_{r}")
        ms.save_checkpoint([{"name": k, "data": ms.Tensor(v.asnumpy() + np.float32(r * TAG))}
                            for k, v in loaded.items()], f"{d}/tagged/rank_{r}/t.ckpt")
    dst = None
    if case["dst"] is not None:
        dst = d + "/dst.ckpt"
        write_strategy(dst, case["dst"])
    ms.transform_checkpoints(d + "/tagged", d + "/out", "o", d + "/src.ckpt", dst)
    res.append([read_ckpt(f"{d}/out/rank_{r}/o{r}.ckpt") for r in range(case["n_out"])])
out(res)
""",
        payload,
    )
    elements = mixed = not_lowest = 0
    for case, per_rank in zip(cases, got, strict=True):
        for name, (src, dst, shape) in case["params"].items():
            full = full_values(shape)
            for r in range(case["n_dst"] or 1):
                box = rank_box(dst, shape, r) if dst else tuple((0, s) for s in shape)
                theirs = np.array(per_rank[r][name], dtype=np.int64).reshape([hi - lo for lo, hi in box])
                assert np.array_equal(theirs % TAG, cut(full, box)), (src, dst, shape, r)
                chosen = np.full(theirs.shape, -1, dtype=np.int64)
                pieces = transfer_pieces(src, dst, shape, r)
                for s, piece in pieces:
                    chosen[tuple(slice(lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(piece, box, strict=True))] = s
                assert np.array_equal(theirs // TAG, chosen), (src, dst, shape, r)
                elements += chosen.size
                mixed += len(np.unique(chosen)) > 1
                not_lowest += any(s != _lowest_holder(src, shape, piece) for s, piece in pieces)
    print(f"copy selection: {elements} elements, {mixed} mixed-source slices, {not_lowest} not from the lowest copy")
    assert elements > 2000 and mixed > 20 and not_lowest > 20


def _lowest_holder(src: ParamLayout, shape: tuple[int, ...], piece: tuple[tuple[int, int], ...]) -> int:
    for k in range(src.device_num):
        held = rank_box(src, shape, k)
        if all(h0 <= lo and hi <= h1 for (lo, hi), (h0, h1) in zip(piece, held, strict=True)):
            return k
    raise AssertionError("no holder")


# --------------------------------------------------------------------------------------------
# get_parameter_redundancy


def test_redundancy_groups_match_mindspore(oracle, tmp_path) -> None:
    rng = random.Random(29)
    layouts: dict[str, ParamLayout] = {}
    while len(layouts) < 150:
        p = random_layout(rng, opt=len(layouts) % 2 == 0)
        if len(layouts) % 5 == 0:  # sizes that do not divide the groups: silently dropped
            p = dataclasses.replace(p, opt_shard_step=rng.choice([1, 2]), opt_shard_size=rng.choice([2, 3, -1]))
        layouts[f"p{len(layouts)}"] = p
    path = str(tmp_path / "red.ckpt")
    got = oracle(
        WRITE_STRATEGY
        + """
from mindspore.train._utils import get_parameter_redundancy
write_strategy(ARGS["path"], ARGS["items"])
res = {}
for initial in (0, 16):
    for k, groups in get_parameter_redundancy(ARGS["path"], initial).items():
        res[f"{initial}:{k}"] = [[int(r) for r in g] for g in groups]
out(res)
""",
        {"path": path, "items": [item(k, p) for k, p in layouts.items()]},
    )
    for initial in (0, 16):
        for name, p in layouts.items():
            ours = [list(g) for g in redundancy_groups(p, initial)]
            assert ours == got[f"{initial}:{name}"], (p, initial)
    dropped = sum(not got[f"0:{k}"] for k in layouts)
    print(f"redundancy: {2 * len(layouts)} group lists equal ({dropped} layouts with every group dropped)")
