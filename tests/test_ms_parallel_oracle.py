"""``reshard.mindspore.parallel`` against MindSpore 2.10's ``mindspore.parallel``: same names and
signatures, same files (byte-identical), same returned values, and an error exactly where MindSpore
raises one.

One oracle call (module fixture ``world``) runs every MindSpore side on inputs written here with
numpy; each test runs the same call through reshard and compares. Arrays cross the process boundary
as ``.npz`` files (bf16 as float32 plus a flag).
"""

from __future__ import annotations

import hashlib
import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import reshard.mindspore
import reshard.mindspore.parallel as rmp
from reshard import api, demo, dtypes
from reshard.errors import ReshardError, UnsupportedError
from reshard.formats.ckpt import save_ckpt
from reshard.formats.strategy import make_strategy, message_classes, write_strategy
from reshard.layout import ParamLayout as L
from reshard.layout import slice_shape
from tests.msjobs import assert_same_tree

pytestmark = pytest.mark.oracle

# What mindspore.parallel exports but reshard deliberately leaves out: they configure a running job.
NOT_MIRRORED = {
    "Layout",
    "get_algo_parameters",
    "parameter_broadcast",
    "reset_algo_parameters",
    "set_algo_parameters",
    "shard",
}
# Its other public names (dir()): submodules reshard has no counterpart of, or whose functions are its own.
NOT_MIRRORED_MODULES = {
    "algo_parameter_config",
    "checkpoint_convert",
    "checkpoint_transform",
    "data_access_adapter",
    "function",
    "nn",
    "transform_safetensors",
}

ORACLE_SCRIPT = r"""
import glob, hashlib, inspect
import mindspore.parallel as mp
from mindspore.train import node_strategy_pb2

def bare(function):
    sig = inspect.signature(function)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))

def tensor_rows(loaded):
    rows = []
    for k, v in loaded.items():
        if isinstance(v, str):
            rows.append([k, "str", [], v])
        else:
            a = v.asnumpy()
            rows.append([k, str(v.dtype), list(a.shape), hashlib.sha256(a.tobytes()).hexdigest()])
    return rows

def plain(value):
    return [int(v) for v in value] if isinstance(value, list) else value

def attempt(call):
    try:
        return {"ok": call()}
    except BaseException as exc:
        return {"error": type(exc).__name__ + ": " + str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__}

def parameters(spec):
    z = np.load(spec["npz"])
    out = []
    for i, name in enumerate(spec["names"]):
        t = ms.Tensor(z[f"s{i}"])
        if spec["bf16"]:
            t = t.astype(ms.bfloat16)
        out.append(ms.Parameter(t, name=name))
    return out

def merge(case):
    slices = parameters(case)
    if case["container"] == "tuple":
        slices = tuple(slices)
    strategy = ms.build_searched_strategy(case["strategy"]) if case["strategy"] else None
    merged = ms.merge_sliced_parameter(slices, strategy)
    a = merged.asnumpy()
    np.save(case["out"], a)
    return [merged.name, str(merged.dtype), list(a.shape)]

results = {}
results["all"] = list(mp.__all__)
results["dir"] = [n for n in dir(mp) if not n.startswith("_")]
results["signatures"] = {n: bare(getattr(mp, n)) for n in mp.__all__ if callable(getattr(mp, n))}
results["same_as_top"] = {n: getattr(ms, n, None) is getattr(mp, n) for n in mp.__all__}

for job in ARGS["jobs"]:
    op, kw = job["op"], dict(job["kwargs"])
    if "checkpoint_files_map" in kw:
        kw["checkpoint_files_map"] = {int(k): v for k, v in kw["checkpoint_files_map"].items()}
    results[job["id"]] = attempt(lambda: plain(getattr(mp, op)(**kw)))

for case in ARGS["merge"]:
    results["merge:" + case["id"]] = attempt(lambda: merge(case))

for case in ARGS["segmented"]:
    kw = dict(case["kwargs"])
    if "keep" in case:
        keep = set(case["keep"])
        kw["choice_func"] = lambda n: n in keep
    if "dec_key" in kw:
        kw["dec_key"] = bytes.fromhex(kw["dec_key"])
    results["segmented:" + case["id"]] = attempt(lambda: tensor_rows(mp.load_segmented_checkpoints(**kw)))

for path in ARGS["group_files_ms"]:
    ranks, items = ARGS["group_files_ms"][path]
    group_map = node_strategy_pb2.ParallelGroupMap()
    group_map.ckpt_restore_rank_list.dim.extend(ranks)
    for name, group in items:
        item = group_map.parallel_group_item.add()
        item.group_name = name
        item.parallel_group_ranks.dim.extend(group)
    with open(path, "wb") as f:
        f.write(group_map.SerializeToString())
for path in ARGS["group_reads"]:
    results["group:" + path] = attempt(lambda: [int(r) for r in mp.restore_group_info_list(path)])
out(results)
"""


# --------------------------------------------------------------------------------------------
# inputs

RNG = np.random.default_rng(11)
MODEL = {
    "emb": RNG.standard_normal((8, 8)).astype(np.float32),
    "w": RNG.standard_normal((8, 4)).astype(np.float32),
    "h": RNG.standard_normal((8, 16)).astype(np.float16),
    "v": RNG.standard_normal(16).astype(ml_dtypes.bfloat16),
    "global_step": np.array([42], np.int64),
}
SRC = {"emb": L((2, 2), (-1, -1)), "w": L((2, 2), (1, -1)), "h": L((2, 2), (-1, 0)), "v": L((2, 2), (0,))}
DST = {"emb": L((2,), (0, -1)), "w": L((2,), (-1, 0)), "h": L((2,), (0, -1)), "v": L((2,), (-1,))}

# merge_sliced_parameter: the layouts of one strategy file (name -> layout, full shape or slice shapes)
MERGE_LAYOUTS: dict[str, tuple[L, tuple[int, ...]]] = {
    "rows": (L((2, 2), (1, -1)), (8, 4)),
    "cols": (L((2, 2), (-1, 0)), (8, 4)),
    "both": (L((2, 2), (0, 1)), (8, 8)),
    "rep": (L((2, 2), (-1, -1)), (4, 2)),  # four different "copies": the last rank's wins
    "half_rep": (L((2, 2), (0,)), (6,)),
    "three": (L((2, 2, 2), (2, 0, -1)), (4, 6, 2)),
    "field": (L((2, 2), (-1, -1), field=3), (6, 2)),
    "uneven": (L((4,), (0, -1), split_shape=(3, 1, 2, 2)), (8, 4)),
    "uneven_wrong": (L((4,), (0, -1), split_shape=(3, 1, 2)), (8, 4)),
    "long_map": (L((2,), (0, -1, -1)), (4, 2)),  # a tensor map longer than the slices' dims
    "bf": (L((2,), (0,)), (8,)),
}


def _slice_shapes(name: str) -> list[tuple[int, ...]]:
    layout, full = MERGE_LAYOUTS[name]
    if layout.split_shape:
        return [(rows, *full[1:]) for rows in (3, 1, 2, 2)]
    if name == "field":
        return [full] * layout.device_num
    if name == "long_map":
        return [(2, 2)] * layout.device_num
    return [slice_shape(layout, full)] * layout.device_num


def _random_slices(shapes: list[tuple[int, ...]], dtype: Any = np.float32) -> list[np.ndarray]:
    return [
        RNG.standard_normal(s).astype(dtype) if dtype != np.int32 else RNG.integers(-9, 9, s, np.int32) for s in shapes
    ]


def _merge_cases() -> dict[str, dict[str, Any]]:
    """id -> {names, arrays, strategy (bool), bf16, container}."""
    cases: dict[str, dict[str, Any]] = {}
    for name in MERGE_LAYOUTS:
        bf16 = name == "bf"
        arrays = _random_slices(_slice_shapes(name))
        if bf16:
            arrays = [a.astype(ml_dtypes.bfloat16) for a in arrays]
        cases[f"strategy_{name}"] = {"names": [name] * len(arrays), "arrays": arrays, "strategy": True}
    cases["plain_uneven_rows"] = {"names": ["t"] * 3, "arrays": _random_slices([(2, 3), (1, 3), (4, 3)])}
    cases["plain_1d_f16"] = {"names": ["t"] * 2, "arrays": _random_slices([(5,), (3,)], np.float16)}
    cases["plain_int32"] = {"names": ["t"] * 2, "arrays": _random_slices([(2, 2), (2, 2)], np.int32)}
    bf = [a.astype(ml_dtypes.bfloat16) for a in _random_slices([(2, 3), (2, 3)])]
    cases["plain_bf16"] = {"names": ["t"] * 2, "arrays": bf}
    # bad input: MindSpore raises, so must reshard
    cases["names_differ"] = {"names": ["t", "u"], "arrays": _random_slices([(2, 3), (2, 3)])}
    cases["shapes_differ"] = {"names": ["t", "t"], "arrays": _random_slices([(2, 3), (2, 4)])}
    cases["ndim_differ"] = {"names": ["t", "t"], "arrays": _random_slices([(2, 3), (2, 3, 1)])}
    cases["scalars"] = {"names": ["t", "t"], "arrays": _random_slices([(), ()])}
    cases["tuple"] = {"names": ["t", "t"], "arrays": _random_slices([(2,), (2,)]), "container": "tuple"}
    cases["empty"] = {"names": [], "arrays": []}
    cases["count_wrong"] = {"names": ["rows"] * 3, "arrays": _random_slices([(4, 2)] * 3), "strategy": True}
    cases["missing_key"] = {"names": ["nope"] * 4, "arrays": _random_slices([(4, 2)] * 4), "strategy": True}
    cases["uneven_no_split"] = {
        "names": ["rows"] * 4,
        "arrays": _random_slices([(4, 2), (4, 2), (3, 2), (4, 2)]),
        "strategy": True,
    }
    cases["uneven_split_mismatch"] = {
        "names": ["uneven"] * 4,
        "arrays": _random_slices([(3, 4), (2, 4), (2, 4), (1, 4)]),
        "strategy": True,
    }
    return cases


MERGE_CASES = _merge_cases()

KEY = bytes(range(16))


def _segments(root: str) -> dict[str, str]:
    """Folders of ``.ckpt`` segments: overlapping names, a string, files that are not ``*.ckpt``."""
    seg = os.path.join(root, "segments")
    save_ckpt(os.path.join(seg, "part_a.ckpt"), {"a": MODEL["w"], "b": MODEL["h"], "note": "first"})
    save_ckpt(os.path.join(seg, "part_b.ckpt"), {"c": MODEL["v"], "a": MODEL["emb"]})
    save_ckpt(os.path.join(seg, "part_c.ckpt"), {"adam_m.a": MODEL["w"] * 2, "global_step": MODEL["global_step"]})
    save_ckpt(os.path.join(seg, ".hidden.ckpt"), {"hidden": MODEL["w"]})  # glob skips hidden files
    with open(os.path.join(seg, "README.txt"), "w") as fh:
        fh.write("not a checkpoint\n")
    enc = os.path.join(root, "encrypted")
    save_ckpt(os.path.join(enc, "p0.ckpt"), {"x": MODEL["w"]}, enc_key=KEY)
    save_ckpt(os.path.join(enc, "p1.ckpt"), {"y": MODEL["h"]}, enc_key=KEY)
    empty = os.path.join(root, "no_ckpt")
    os.makedirs(empty)
    with open(os.path.join(empty, "x.safetensors"), "wb") as fh:
        fh.write(b"")
    return {"segments": seg, "encrypted": enc, "no_ckpt": empty}


def _segment_cases(folders: Mapping[str, str], root: str) -> list[dict[str, Any]]:
    seg = folders["segments"]
    return [
        {"id": "plain", "kwargs": {"ckpt_file_dir": seg}},
        {"id": "specify", "kwargs": {"ckpt_file_dir": seg, "specify_prefix": ["a", "c"]}},
        {"id": "filter", "kwargs": {"ckpt_file_dir": seg, "filter_prefix": "adam_"}},
        {"id": "choice", "kwargs": {"ckpt_file_dir": seg}, "keep": ["a", "c", "global_step", "note"]},
        {"id": "nothing_left_in_one", "kwargs": {"ckpt_file_dir": seg, "specify_prefix": "b"}},
        {"id": "encrypted", "kwargs": {"ckpt_file_dir": folders["encrypted"], "dec_key": KEY.hex()}},
        {
            "id": "encrypted_cbc",
            "kwargs": {"ckpt_file_dir": folders["encrypted"], "dec_key": KEY.hex(), "dec_mode": "AES-CBC"},
        },
        {"id": "no_ckpt", "kwargs": {"ckpt_file_dir": folders["no_ckpt"]}},
        {"id": "missing", "kwargs": {"ckpt_file_dir": os.path.join(root, "missing")}},
        {"id": "a_file", "kwargs": {"ckpt_file_dir": os.path.join(seg, "part_a.ckpt")}},
    ]


def _group_files(root: str) -> tuple[dict[str, Any], list[str]]:
    """Group information files: written by MindSpore's classes, by reshard's, and bad ones."""
    by_ms = {
        os.path.join(root, "group_ms.pb"): [[0, 2, 4, 6], [["hccl_world_group", [0, 1, 2, 3, 4, 5, 6, 7]]]],
        os.path.join(root, "group_ms_no_list.pb"): [[], [["g", [0, 1]]]],
    }
    group_map: Any = message_classes()["ParallelGroupMap"]()
    group_map.ckpt_restore_rank_list.dim.extend([5, 1, 3])
    item = group_map.parallel_group_item.add()
    item.group_name = "tp-2"
    item.parallel_group_ranks.dim.extend([1, 3])
    ours = os.path.join(root, "group_reshard.pb")
    with open(ours, "wb") as fh:
        fh.write(group_map.SerializeToString())
    garbage = os.path.join(root, "group_garbage.pb")
    with open(garbage, "wb") as fh:
        fh.write(b"\xff\xff\xff\xff")
    empty = os.path.join(root, "group_empty.pb")
    open(empty, "wb").close()
    reads = [*by_ms, ours, garbage, empty, os.path.join(root, "group_missing.pb")]
    return by_ms, reads


def _encode_merge(root: str, strategy: str) -> list[dict[str, Any]]:
    encoded = []
    for case_id, case in MERGE_CASES.items():
        arrays = case["arrays"]
        bf16 = bool(arrays) and arrays[0].dtype == ml_dtypes.bfloat16
        npz = os.path.join(root, "merge", f"{case_id}.npz")
        os.makedirs(os.path.dirname(npz), exist_ok=True)
        np.savez(npz, **{f"s{i}": a.astype(np.float32) if bf16 else a for i, a in enumerate(arrays)})
        encoded.append(
            {
                "id": case_id,
                "names": case["names"],
                "npz": npz,
                "bf16": bf16,
                "strategy": strategy if case.get("strategy") else None,
                "container": case.get("container", "list"),
                "out": os.path.join(root, "merge", f"{case_id}.ms.npy"),
            }
        )
    return encoded


def _convert_jobs(root: str) -> list[dict[str, Any]]:
    src, dst = os.path.join(root, "src.ckpt"), os.path.join(root, "dst.ckpt")
    write_strategy(src, make_strategy(SRC))
    write_strategy(dst, make_strategy(DST))
    save_ckpt(os.path.join(root, "full", "model.ckpt"), MODEL)
    api.transform(os.path.join(root, "full"), os.path.join(root, "ranks"), None, src)
    api.convert(os.path.join(root, "ranks"), os.path.join(root, "ranks_st"), "safetensors")
    jobs: list[dict[str, Any]] = []
    for fmt_id, folder, out_fmt in (("ckpt", "ranks", "ckpt"), ("st", "ranks_st", "safetensors")):
        kwargs = {
            "src_checkpoints_dir": os.path.join(root, folder),
            "dst_checkpoints_dir": os.path.join(root, "ms", f"convert_{fmt_id}"),
            "ckpt_prefix": "converted_",
            "src_strategy_file": src,
            "dst_strategy_file": dst,
            "process_num": 2,
            "output_format": out_fmt,
        }
        jobs.append({"id": f"convert_{fmt_id}", "op": "convert_checkpoints", "kwargs": kwargs})
    for rank in range(2):
        kw = {"rank_id": rank, "src_strategy_file": src, "dst_strategy_file": dst}
        jobs.append({"id": f"rank_list_{rank}", "op": "rank_list_for_convert", "kwargs": kw})
        jobs.append({"id": f"rank_list_transform_{rank}", "op": "rank_list_for_transform", "kwargs": kw})
    jobs.append({"id": "rank_list_full", "op": "rank_list_for_convert", "kwargs": {"rank_id": 0}})
    jobs.append({"id": "rank_list_out_of_range", "op": "rank_list_for_convert",
                 "kwargs": {"rank_id": 2, "src_strategy_file": src, "dst_strategy_file": dst}})  # fmt: skip
    by_rank = []
    for rank in range(2):
        os.makedirs(os.path.join(root, "ms", "by_rank", f"rank_{rank}"))  # MindSpore does not create it
        needed = rmp.rank_list_for_convert(rank, src, dst)  # checked against MindSpore's list separately
        by_rank.append(
            {
                "id": f"by_rank_{rank}",
                "op": "convert_checkpoint_by_rank",
                "kwargs": {
                    "rank_id": rank,
                    "checkpoint_files_map": {str(r): _rank_file(root, r) for r in needed},
                    "save_checkpoint_file_name": os.path.join(root, "ms", "by_rank", f"rank_{rank}", f"c{rank}.ckpt"),
                    "src_strategy_file": src,
                    "dst_strategy_file": dst,
                },
            }
        )
    jobs += by_rank
    bad = {"src_checkpoints_dir": os.path.join(root, "missing"), "dst_checkpoints_dir": os.path.join(root, "x"),
           "ckpt_prefix": "c", "src_strategy_file": src, "dst_strategy_file": dst}  # fmt: skip
    jobs.append({"id": "convert_missing_src", "op": "convert_checkpoints", "kwargs": bad})
    bad_name = {**by_rank[0]["kwargs"], "save_checkpoint_file_name": os.path.join(root, "ms", "bad.safetensors")}
    jobs.append({"id": "by_rank_bad_name", "op": "convert_checkpoint_by_rank", "kwargs": bad_name})
    return jobs


def _rank_file(root: str, rank: int) -> str:
    folder = os.path.join(root, "ranks", f"rank_{rank}")
    return os.path.join(folder, sorted(os.listdir(folder))[0])


@pytest.fixture(scope="module")
def world(oracle: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("ms_parallel"))
    merge_strategy = os.path.join(root, "merge_strategy.ckpt")
    write_strategy(merge_strategy, make_strategy({name: layout for name, (layout, _) in MERGE_LAYOUTS.items()}))
    folders = _segments(root)
    by_ms, reads = _group_files(root)
    args = {
        "jobs": _convert_jobs(root),
        "merge": _encode_merge(root, merge_strategy),
        "segmented": _segment_cases(folders, root),
        "group_files_ms": by_ms,
        "group_reads": reads,
    }
    results = oracle(ORACLE_SCRIPT, args)
    return {"root": root, "args": args, "results": results, "merge_strategy": merge_strategy}


def _ours(call: Callable[[], Any]) -> dict[str, Any]:
    try:
        return {"ok": call()}
    except ReshardError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _assert_same_outcome(ours: dict[str, Any], theirs: dict[str, Any], what: str) -> None:
    assert ("error" in ours) == ("error" in theirs), f"{what}: reshard {ours}, MindSpore {theirs}"


# --------------------------------------------------------------------------------------------
# names and signatures


def _bare_signature(function: Callable[..., Any]) -> str:
    sig = inspect.signature(function)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def test_every_checkpoint_function_of_mindspore_parallel_is_mirrored(world: dict[str, Any]) -> None:
    theirs = set(world["results"]["all"])
    assert set(rmp.__all__) == theirs - NOT_MIRRORED
    assert theirs >= NOT_MIRRORED, "a name reshard leaves out is gone from MindSpore: update NOT_MIRRORED"
    public = set(world["results"]["dir"]) - {"absolute_import"}  # a __future__ feature, not an API
    assert public == set(rmp.__all__) | NOT_MIRRORED | NOT_MIRRORED_MODULES
    for name in NOT_MIRRORED | NOT_MIRRORED_MODULES:  # each says it is not supported, and what instead
        with pytest.raises(UnsupportedError, match=f"mindspore.parallel.{name} is not supported by reshard"):
            getattr(rmp, name)


@pytest.mark.parametrize("name", rmp.__all__)
def test_signature_is_mindspores(world: dict[str, Any], name: str) -> None:
    assert _bare_signature(getattr(rmp, name)) == world["results"]["signatures"][name]


@pytest.mark.parametrize("name", rmp.__all__)
def test_shared_with_the_top_level_exactly_where_mindspore_shares(world: dict[str, Any], name: str) -> None:
    """``mindspore.parallel.X is mindspore.X`` exactly when ``reshard.mindspore.parallel.X is reshard.mindspore.X``."""
    ours = getattr(reshard.mindspore, name, None) is getattr(rmp, name)
    assert ours == world["results"]["same_as_top"][name]


# --------------------------------------------------------------------------------------------
# convert_checkpoints, convert_checkpoint_by_rank, rank_list_for_convert


def _job(world: dict[str, Any], job_id: str) -> dict[str, Any]:
    return next(j for j in world["args"]["jobs"] if j["id"] == job_id)


def _ours_dir(world: dict[str, Any], path: str) -> str:
    return path.replace(os.path.join(world["root"], "ms"), os.path.join(world["root"], "ours"))


@pytest.mark.parametrize("fmt_id", ["ckpt", "st"])
def test_convert_checkpoints_writes_mindspores_bytes(world: dict[str, Any], fmt_id: str) -> None:
    job = _job(world, f"convert_{fmt_id}")
    assert world["results"][job["id"]] == {"ok": None}
    kwargs = dict(job["kwargs"])
    kwargs["dst_checkpoints_dir"] = _ours_dir(world, kwargs["dst_checkpoints_dir"])
    rmp.convert_checkpoints(**kwargs)
    assert_same_tree(kwargs["dst_checkpoints_dir"], job["kwargs"]["dst_checkpoints_dir"])


@pytest.mark.parametrize("rank", [0, 1])
def test_convert_checkpoint_by_rank_writes_mindspores_bytes(world: dict[str, Any], rank: int) -> None:
    job = _job(world, f"by_rank_{rank}")
    assert world["results"][job["id"]] == {"ok": None}
    kwargs = dict(job["kwargs"])
    kwargs["checkpoint_files_map"] = {int(k): v for k, v in kwargs["checkpoint_files_map"].items()}
    theirs = kwargs["save_checkpoint_file_name"]
    kwargs["save_checkpoint_file_name"] = _ours_dir(world, theirs)
    rmp.convert_checkpoint_by_rank(**kwargs)
    with open(theirs, "rb") as a, open(kwargs["save_checkpoint_file_name"], "rb") as b:
        assert hashlib.sha256(a.read()).digest() == hashlib.sha256(b.read()).digest()


@pytest.mark.parametrize("job_id", ["rank_list_0", "rank_list_1", "rank_list_full", "rank_list_out_of_range"])
def test_rank_list_for_convert_is_mindspores(world: dict[str, Any], job_id: str) -> None:
    job = _job(world, job_id)
    ours = _ours(lambda: rmp.rank_list_for_convert(**job["kwargs"]))
    theirs = world["results"][job_id]
    _assert_same_outcome(ours, theirs, job_id)
    assert ours.get("ok") == theirs.get("ok")
    if job_id in ("rank_list_0", "rank_list_1"):
        assert theirs == world["results"][job_id.replace("list_", "list_transform_")]


@pytest.mark.parametrize("job_id", ["convert_missing_src", "by_rank_bad_name"])
def test_convert_bad_input_fails_where_mindspore_fails(world: dict[str, Any], job_id: str) -> None:
    job = _job(world, job_id)
    kwargs = dict(job["kwargs"])
    if "checkpoint_files_map" in kwargs:
        kwargs["checkpoint_files_map"] = {int(k): v for k, v in kwargs["checkpoint_files_map"].items()}
        kwargs["save_checkpoint_file_name"] = _ours_dir(world, kwargs["save_checkpoint_file_name"])
    ours = _ours(lambda: getattr(rmp, job["op"])(**kwargs))
    assert "error" in world["results"][job_id] and "error" in ours, (ours, world["results"][job_id])


# --------------------------------------------------------------------------------------------
# merge_sliced_parameter


def _our_merge(world: dict[str, Any], case_id: str) -> Any:
    case = MERGE_CASES[case_id]
    slices: Any = [reshard.mindspore.Parameter(a, n) for a, n in zip(case["arrays"], case["names"], strict=True)]
    if case.get("container") == "tuple":
        slices = tuple(slices)
    strategy = reshard.mindspore.build_searched_strategy(world["merge_strategy"]) if case.get("strategy") else None
    return rmp.merge_sliced_parameter(slices, strategy)


@pytest.mark.parametrize("case_id", sorted(MERGE_CASES))
def test_merge_sliced_parameter_is_mindspores(world: dict[str, Any], case_id: str) -> None:
    theirs = world["results"][f"merge:{case_id}"]
    ours = _ours(lambda: _our_merge(world, case_id))
    _assert_same_outcome(ours, theirs, case_id)
    if "error" in theirs:
        return
    merged = ours["ok"]
    name, dtype, shape = theirs["ok"]
    assert (merged.name, dtypes.from_numpy(merged.dtype).ms_name, list(merged.shape)) == (name, dtype, shape)
    expected = np.load(os.path.join(world["root"], "merge", f"{case_id}.ms.npy"))
    assert merged.asnumpy().dtype == expected.dtype
    assert np.array_equal(merged.asnumpy(), expected)


def test_merge_accepts_mindspore_like_parameters() -> None:
    """Any object with ``.name`` and ``.data`` (``data.asnumpy()``) works, a MindSpore Parameter too."""

    class Tensorish:
        def __init__(self, a: np.ndarray) -> None:
            self.a = a

        def asnumpy(self) -> np.ndarray:
            return self.a

    class Foreign:
        def __init__(self, a: np.ndarray, name: str) -> None:
            self.name, self.data, self.requires_grad, self.layerwise_parallel = name, Tensorish(a), False, True

    merged = rmp.merge_sliced_parameter([Foreign(np.ones((1, 2)), "p"), Foreign(np.zeros((2, 2)), "p")])
    assert merged.shape == (3, 2) and merged.name == "p"
    assert (merged.requires_grad, merged.layerwise_parallel) == (False, True)


# --------------------------------------------------------------------------------------------
# load_segmented_checkpoints


def _rows(loaded: Mapping[str, Any]) -> list[list[Any]]:
    rows: list[list[Any]] = []
    for name, value in loaded.items():
        if isinstance(value, str):
            rows.append([name, "str", [], value])
        else:
            kind = dtypes.from_numpy(value.dtype).ms_name
            rows.append([name, kind, list(value.shape), hashlib.sha256(value.tobytes()).hexdigest()])
    return rows


@pytest.mark.parametrize("case_id", ["plain", "specify", "filter", "choice", "nothing_left_in_one", "encrypted",
                                     "encrypted_cbc", "no_ckpt", "missing", "a_file"])  # fmt: skip
def test_load_segmented_checkpoints_is_mindspores(world: dict[str, Any], case_id: str) -> None:
    case = next(c for c in world["args"]["segmented"] if c["id"] == case_id)
    kwargs = dict(case["kwargs"])
    if "keep" in case:
        keep = set(case["keep"])
        kwargs["choice_func"] = lambda n: n in keep
    if "dec_key" in kwargs:
        kwargs["dec_key"] = bytes.fromhex(kwargs["dec_key"])
    theirs = world["results"][f"segmented:{case_id}"]
    ours = _ours(lambda: _rows(rmp.load_segmented_checkpoints(**kwargs)))
    _assert_same_outcome(ours, theirs, case_id)
    assert ours.get("ok") == theirs.get("ok")  # same names, order, dtypes, shapes and bytes


# --------------------------------------------------------------------------------------------
# restore_group_info_list


def test_restore_group_info_list_is_mindspores(world: dict[str, Any]) -> None:
    for path in world["args"]["group_reads"]:
        theirs = world["results"][f"group:{path}"]
        ours = _ours(lambda: rmp.restore_group_info_list(path))  # noqa: B023 - called at once
        _assert_same_outcome(ours, theirs, os.path.basename(path))
        assert ours.get("ok") == theirs.get("ok"), os.path.basename(path)
    assert world["results"][f"group:{world['root']}/group_ms.pb"] == {"ok": [0, 2, 4, 6]}


# --------------------------------------------------------------------------------------------
# the switch with one import: one script, run by MindSpore and by reshard on the demo's files

SWITCH_SCRIPT = """
import os
import numpy as np
from mindspore.parallel import (build_searched_strategy, convert_checkpoint_by_rank, convert_checkpoints,
                                load_segmented_checkpoints, merge_sliced_parameter, rank_list_for_convert)
from mindspore import Parameter, load_checkpoint

src, dst = "demo/merged/src_strategy.ckpt", "demo/merged/dst_strategy.ckpt"
convert_checkpoints("demo/ckpt_8ranks", "out/converted", "checkpoint_", src, dst)
lists = []
for rank in range(4):
    ranks = rank_list_for_convert(rank, src, dst)
    lists.append([int(r) for r in ranks])
    os.makedirs(f"out/by_rank/rank_{rank}", exist_ok=True)
    files = {r: f"demo/ckpt_8ranks/rank_{r}/checkpoint_{r}.ckpt" for r in ranks}
    convert_checkpoint_by_rank(rank, files, f"out/by_rank/rank_{rank}/checkpoint_{rank}.ckpt", src, dst)
stage0 = build_searched_strategy("demo/strategy_8/ckpt_strategy_rank_0.ckpt")
for name in ("model.layers.0.attention_norm.weight", "model.layers.0.attention.wq.weight"):
    slices = [Parameter(load_checkpoint(f"demo/ckpt_8ranks/rank_{r}/checkpoint_{r}.ckpt")[name], name)
              for r in range(4)]
    np.save(f"out/{name}.npy", merge_sliced_parameter(slices, stage0).asnumpy())
loaded = load_segmented_checkpoints("out/converted/rank_0")
with open("out/summary.txt", "w") as f:
    f.write(repr(lists) + "\\n" + repr(sorted(loaded)) + "\\n")
"""


def test_one_script_switches_with_one_import(
    oracle: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A script using mindspore.parallel (and mindspore's Parameter / load_checkpoint) writes the same
    files when its imports name reshard.mindspore instead: converted folders, by-rank files, merged
    parameters and the loaded names, byte for byte."""
    root = tmp_path_factory.mktemp("switch")
    demo.main(str(root / "demo"))
    for side in ("ms", "rs"):
        os.makedirs(root / side / "out")
        os.symlink(root / "demo", root / side / "demo")
    oracle(f"os.chdir({str(root / 'ms')!r})\n" + SWITCH_SCRIPT)
    ours = SWITCH_SCRIPT.replace("from mindspore", "from reshard.mindspore")  # the only change
    assert ours.count("reshard.mindspore") == 2
    monkeypatch.chdir(root / "rs")
    exec(compile(ours, "<switched script>", "exec"), {})
    assert_same_tree(str(root / "rs" / "out"), str(root / "ms" / "out"))
