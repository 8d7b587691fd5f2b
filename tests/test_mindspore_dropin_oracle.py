"""``reshard.mindspore`` against MindSpore 2.10: same calls, same file names, byte-identical files.

One oracle call (module fixture ``world``) runs every MindSpore side of every case on inputs written
here with numpy; each test then runs the same calls through ``reshard.mindspore`` and compares.
Chained cases (full -> A -> B -> full, A -> safetensors -> unified -> split) run on each side's own
outputs, so an early mismatch shows up in the first test that compares it.

Arguments that cannot cross the process boundary are encoded: arrays go through ``.npz`` files
(bf16 as float32 plus a flag, rebuilt with ``astype(bfloat16)`` on MindSpore's side), a
``choice_func`` is ``{"keep": [names]}`` or ``{"map": {name: bool | str}}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from reshard import dtypes
from reshard import mindspore as rms
from reshard.formats.ckpt import save_ckpt
from reshard.formats.safetensors import read_safetensors, save_safetensors
from reshard.formats.strategy import make_strategy, write_strategy
from reshard.layout import ParamLayout as L
from tests.msjobs import assert_same_tree, tree_files

pytestmark = pytest.mark.oracle

# --------------------------------------------------------------------------------------------
# the MindSpore side

ORACLE_SCRIPT = r"""
import hashlib
import mindspore.parallel  # noqa: registers the parallel helpers

def choice(spec):
    if spec is None:
        return None
    if "keep" in spec:
        keep = set(spec["keep"])
        return lambda n: n in keep
    table = spec["map"]
    return lambda n: table.get(n, True)

def values(spec, mode):
    z = np.load(spec["npz"])
    out = []
    for name in spec["order"]:
        if name in spec["strings"]:
            out.append((name, spec["strings"][name]))
            continue
        a = z[spec["keys"][name]]
        if name in spec["bf16"]:
            t = ms.Tensor(a, ms.float32).astype(ms.bfloat16)
            out.append((name, ms.Parameter(t, name=name) if mode == "dict" else t))
        else:
            out.append((name, a if mode == "dict" else ms.Tensor(a)))
    return out

def describe(loaded):
    rows = []
    for k, v in loaded.items():
        if isinstance(v, str):
            rows.append([k, "str", [], v])
        else:
            a = v.asnumpy()
            rows.append([k, str(v.dtype), list(a.shape), hashlib.sha256(a.tobytes()).hexdigest()])
    return rows

def run(job):
    op = job["op"]
    kw = dict(job.get("kwargs", {}))
    if "choice_func" in kw:
        kw["choice_func"] = choice(kw["choice_func"])
    if op == "save":
        items = values(job["values"], job["mode"])
        obj = dict(items) if job["mode"] == "dict" else [{"name": n, "data": d} for n, d in items]
        if "append_dict" in kw:
            app = {}
            for k, v in kw["append_dict"].items():
                app[k] = ms.Tensor(np.load(v["npy"])) if isinstance(v, dict) else v
            kw["append_dict"] = app
        ms.save_checkpoint(obj, job["path"], **kw)
        return None
    if op == "load":
        return describe(ms.load_checkpoint(job["path"], **kw))
    if op == "rank_list":
        return [int(r) for r in ms.rank_list_for_transform(**kw)]
    if op == "bss":
        return {k: v.SerializeToString().hex() for k, v in ms.build_searched_strategy(kw["strategy_filename"]).items()}
    if op == "by_rank":
        kw["checkpoint_files_map"] = {int(k): v for k, v in kw["checkpoint_files_map"]}
        ms.transform_checkpoint_by_rank(**kw)
        return None
    if op == "load_distributed":
        ms.load_distributed_checkpoint(None, format="safetensors", **kw)
        return None
    getattr(ms, op)(**kw)
    return None

results = {}
for job in ARGS["jobs"]:
    try:
        results[job["id"]] = {"ok": run(job)}
    except BaseException as exc:
        results[job["id"]] = {"error": type(exc).__name__ + ": " + str(exc).splitlines()[0][:300]}
out(results)
"""


# --------------------------------------------------------------------------------------------
# inputs


def _rng_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "emb": rng.standard_normal((8, 8)).astype(np.float32),
        "w": rng.standard_normal((8, 4)).astype(np.float32),
        "h": rng.standard_normal((8, 16)).astype(np.float16),
        "i": rng.integers(-1000, 1000, (8, 8)).astype(np.int32),
        "v": rng.standard_normal(16).astype(ml_dtypes.bfloat16),
        "global_step": np.array([42], np.int64),
        "learning_rate": np.array(0.25, np.float32),
    }


MODEL = _rng_arrays()

A = {"w": L((2, 2), (1, -1)), "h": L((2, 2), (-1, 0)), "i": L((2, 2), (0, 1)), "v": L((2, 2), (0,)),
     "emb": L((2, 2), (-1, -1))}  # fmt: skip
B = {"w": L((2,), (-1, 0)), "h": L((2,), (0, -1)), "i": L((2,), (-1, -1)), "v": L((2,), (-1,)), "emb": L((2,), (0, -1))}
PP = [  # two pipeline stages of two devices; "emb" is shared with a different layout per stage
    {"emb": L((2,), (0, -1)), "w": L((2,), (-1, 0)), "v": L((2,), (0,))},
    {"emb": L((2,), (-1, 0)), "h": L((2,), (0, -1)), "i": L((2,), (-1, 0))},
]
D = {"emb": L((4,), (0, -1)), "w": L((4,), (-1, 0)), "v": L((4,), (0,)), "h": L((4,), (-1, 0)), "i": L((4,), (0, -1))}


@dataclass
class SaveCase:
    id: str
    values: dict[str, Any]
    name: str = "model"
    mode: str = "dict"
    kwargs: dict[str, Any] = field(default_factory=dict)
    append: dict[str, Any] = field(default_factory=dict)

    @property
    def fmt(self) -> str:
        return self.kwargs.get("format", "ckpt")


def _mixed() -> dict[str, Any]:
    rng = np.random.default_rng(3)
    return {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "f16": rng.standard_normal(7).astype(np.float16),
        "bf16": rng.standard_normal((2, 3)).astype(ml_dtypes.bfloat16),
        "f64": rng.standard_normal(2),
        "i8": np.array([-128, 0, 127], np.int8),
        "u8": np.array([0, 255], np.uint8),
        "i16": np.array([[-3, 4]], np.int16),
        "u16": np.array([65535], np.uint16),
        "i32": np.arange(6, dtype=np.int32).reshape(2, 3),
        "u32": np.array([7], np.uint32),
        "i64": np.array([-(2**40)], np.int64),
        "u64": np.array([2**63], np.uint64),
        "bool": np.array([True, False, True]),
        "scalar": np.array(1.5, np.float32),
        "transposed": np.arange(12, dtype=np.float32).reshape(3, 4).T,
        "model.layer.0.weight": np.ones((2, 2), np.float32),
    }


def _save_cases() -> list[SaveCase]:
    mixed = _mixed()
    tensors_only = {k: v for k, v in mixed.items()}
    with_str = {**mixed, "note": "héllo wörld"}
    append = {"epoch_num": 3, "step_num": 2**40, "lr": 0.1, "loss_scale": 1024.0, "flag": True, "off": False,
              "tag": "run-7", "arr": np.arange(5, dtype=np.int16)}  # fmt: skip
    no_half = {k: v for k, v in mixed.items() if k not in ("f16", "bf16")}
    numeric_append = {k: v for k, v in append.items() if not isinstance(v, str)}
    keep = {"keep": ["f32", "bf16", "i64", "model.layer.0.weight"]}
    return [
        SaveCase("dict_all_dtypes", with_str),
        SaveCase("list_form", tensors_only, mode="list"),
        SaveCase("append_dict", {"w": mixed["f32"]}, append=append),
        SaveCase("choice_func", mixed, kwargs={"choice_func": keep}, append={"epoch_num": 1}),
        SaveCase("crc", with_str, kwargs={"crc_check": True}, append={"epoch_num": 1}),
        SaveCase("name_with_ext", {"w": mixed["f32"]}, name="model.ckpt"),
        SaveCase("name_xckpt", {"w": mixed["f32"]}, name="modelckpt"),
        SaveCase("name_upper", {"w": mixed["f32"]}, name="model.CKPT"),
        SaveCase("st_dict", tensors_only, kwargs={"format": "safetensors"}),
        SaveCase("st_list_append_choice", tensors_only, mode="list", append=numeric_append,
                 kwargs={"format": "safetensors", "choice_func": keep}),
        SaveCase("st_remove_redundancy", tensors_only, kwargs={"format": "safetensors", "remove_redundancy": True}),
        # MindSpore's crc cannot take float16/bfloat16 arrays ("cannot include dtype 'E' in a buffer"); ours can
        SaveCase("st_crc", no_half, kwargs={"format": "safetensors", "crc_check": True}),
        SaveCase("st_rr_false_crc", {"w": mixed["f32"]},
                 kwargs={"format": "safetensors", "remove_redundancy": False, "crc_check": True}),
        SaveCase("st_all_filtered", tensors_only, kwargs={"format": "safetensors", "choice_func": {"keep": []}}),
        SaveCase("st_name_xsafetensors", {"w": mixed["f32"]}, name="xsafetensors", kwargs={"format": "safetensors"}),
    ]  # fmt: skip


SAVE_CASES = _save_cases()


def _encode_values(values: Mapping[str, Any], npz: str) -> dict[str, Any]:
    arrays, keys, bf16, strings = {}, {}, [], {}
    for i, (name, value) in enumerate(values.items()):
        if isinstance(value, str):
            strings[name] = value
            continue
        keys[name] = f"v{i}"
        if value.dtype == ml_dtypes.bfloat16:
            bf16.append(name)
            value = value.astype(np.float32)
        arrays[f"v{i}"] = np.asarray(value, order="C")
    np.savez(npz, **arrays)
    return {"npz": npz, "order": list(values), "keys": keys, "bf16": bf16, "strings": strings}


def _encode_append(append: Mapping[str, Any], folder: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in append.items():
        if isinstance(value, np.ndarray):
            path = os.path.join(folder, f"append_{name}.npy")
            np.save(path, value)
            out[name] = {"npy": path}
        else:
            out[name] = value
    return out


def _choice(spec: Mapping[str, Any] | None) -> Callable[[str], Any] | None:
    if spec is None:
        return None
    if "keep" in spec:
        keep = set(spec["keep"])
        return lambda n: n in keep
    table = dict(spec["map"])
    return lambda n: table.get(n, True)


LOAD_CASES: list[tuple[str, str, dict[str, Any]]] = [  # (id, save case whose file is loaded, kwargs)
    ("plain", "dict_all_dtypes", {}),
    ("specify_str", "dict_all_dtypes", {"specify_prefix": "f"}),
    ("specify_list", "dict_all_dtypes", {"specify_prefix": ["i", "model."]}),
    ("filter_tuple", "dict_all_dtypes", {"filter_prefix": ("u", "b")}),
    ("specify_and_filter", "dict_all_dtypes", {"specify_prefix": "i", "filter_prefix": "i6"}),
    ("prefix_beats_choice", "dict_all_dtypes", {"specify_prefix": "u", "choice_func": {"keep": ["f32"]}}),
    ("choice", "dict_all_dtypes", {"choice_func": {"keep": ["note", "bf16", "scalar"]}}),
    ("crc_ok", "crc", {"crc_check": True}),
    ("append", "append_dict", {}),
    ("xckpt_name", "name_xckpt", {}),
    ("st_plain", "st_dict", {"format": "safetensors"}),
    ("st_choice", "st_dict", {"format": "safetensors", "choice_func": {"keep": ["i8", "f16"]}}),
    ("st_crc", "st_crc", {"format": "safetensors", "crc_check": True}),
    ("st_append", "st_list_append_choice", {"format": "safetensors", "remove_redundancy": True}),
]


@dataclass
class World:
    root: str
    ms: dict[str, Any]  # job id -> {"ok": result} | {"error": message}
    save_paths: dict[str, tuple[str, str]] = field(default_factory=dict)  # case -> (ms path, rs path)

    def p(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def ok(self, job: str) -> Any:
        result = self.ms[job]
        assert "error" not in result, f"MindSpore failed on {job}: {result['error']}"
        return result["ok"]


def _write_inputs(root: str) -> None:
    inp = os.path.join(root, "in")
    save_ckpt(os.path.join(inp, "full", "rank_0", "model.ckpt"), MODEL)
    os.makedirs(os.path.join(inp, "strategy", "pp"), exist_ok=True)
    os.makedirs(os.path.join(inp, "strategy", "pp_json"), exist_ok=True)
    write_strategy(os.path.join(inp, "strategy", "a.ckpt"), make_strategy(A))
    write_strategy(os.path.join(inp, "strategy", "a.json"), make_strategy(A))
    write_strategy(os.path.join(inp, "strategy", "b.ckpt"), make_strategy(B))
    write_strategy(os.path.join(inp, "strategy", "d.ckpt"), make_strategy(D))
    for stage, layouts in enumerate(PP):
        write_strategy(os.path.join(inp, "strategy", "pp", f"stage{stage}.ckpt"), make_strategy(layouts, stage=stage))
        write_strategy(
            os.path.join(inp, "strategy", "pp_json", f"stage{stage}.json"), make_strategy(layouts, stage=stage)
        )
    # converter inputs: rank_0, rank_1, rankx (any rank* folder), other (ignored); two files each
    rng = np.random.default_rng(11)
    for folder in ("rank_0", "rank_1", "rankx", "other"):
        values = {
            "w": rng.standard_normal((4, 2)).astype(np.float32),
            "b": rng.standard_normal(3).astype(np.float16),
            "v": rng.standard_normal(4).astype(ml_dtypes.bfloat16),
            "step": np.array([3], np.int32),
        }
        save_ckpt(os.path.join(inp, "conv", folder, f"net_{folder}.ckpt"), values)
        save_ckpt(os.path.join(inp, "conv", folder, "opt.ckpt.ckpt"), {"m": values["w"] * 2, "z": values["b"]})
    _write_hf_unified(root)
    save_ckpt(os.path.join(inp, "single.ckpt"), {"z": np.arange(6, dtype=np.float32), "a": np.ones(2, np.int8)})


HF_NAMES = {"w": "model.w.weight", "h": "model.h.weight", "emb": "embed_tokens"}  # strategy name -> file key


def _write_hf_unified(root: str) -> None:
    """Unified folders as MindFormers builds them for HF weights: file keys differ from strategy names."""
    renamed = {HF_NAMES.get(k, k): v for k, v in MODEL.items() if k not in ("global_step", "learning_rate")}
    parts = {"part0.safetensors": ("model.w.weight", "embed_tokens", "v"), "part1.safetensors": ("model.h.weight", "i")}
    inverse = {v: k for k, v in HF_NAMES.items()}
    folder = os.path.join(root, "in", "hf_index")
    weight_map = {}
    for part, keys in parts.items():
        save_safetensors(os.path.join(folder, part), {k: renamed[k] for k in keys}, {"format": "ms"})
        weight_map.update({inverse.get(k, k): part for k in keys})
    with open(os.path.join(folder, "param_name_map.json"), "w") as fh:
        json.dump({"weight_map": weight_map}, fh)
    save_safetensors(os.path.join(root, "in", "hf_single", "model.safetensors"), renamed, {"format": "ms"})


def _strategy(root: str, name: str) -> str:
    return os.path.join(root, "in", "strategy", name)


def _side(root: str, side: str, *parts: str) -> str:
    return os.path.join(root, side, *parts)


def _save_jobs(root: str) -> list[dict[str, Any]]:
    jobs = []
    for case in SAVE_CASES:
        folder = os.path.join(root, "in", "save", case.id)
        os.makedirs(folder, exist_ok=True)
        kwargs = dict(case.kwargs)
        if case.append:
            kwargs["append_dict"] = _encode_append(case.append, folder)
        jobs.append(
            {
                "id": f"save:{case.id}",
                "op": "save",
                "mode": case.mode,
                "kwargs": kwargs,
                "values": _encode_values(case.values, os.path.join(folder, "values.npz")),
                "path": _side(root, "ms", "save", case.id, case.name),
            }
        )
    return jobs


def _load_jobs(root: str) -> list[dict[str, Any]]:
    jobs = []
    for case_id, save_id, kwargs in LOAD_CASES:
        case = next(c for c in SAVE_CASES if c.id == save_id)
        path = _saved_file(root, "ms", case)
        jobs.append({"id": f"load:{case_id}", "op": "load", "path": path, "kwargs": kwargs})
    return jobs


def _saved_file(root: str, side: str, case: SaveCase) -> str:
    name = case.name if case.name.endswith(case.fmt) else f"{case.name}.{case.fmt}"
    return _side(root, side, "save", case.id, name)


def _convert_jobs(root: str, side: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(id, function, kwargs) of the converter cases for one side."""
    conv, out = os.path.join(root, "in", "conv"), _side(root, side, "conv")
    return [
        ("c2s_dir", "ckpt_to_safetensors", {"file_path": conv, "save_path": f"{out}/c2s_dir"}),
        ("c2s_dir_regex_map", "ckpt_to_safetensors",
         {"file_path": conv, "save_path": f"{out}/c2s_regex", "file_name_regex": "net", "name_map": {"w": "model.w"},
          "processes_num": 2}),
        ("c2s_inplace", "ckpt_to_safetensors", {"file_path": f"{out}/inplace"}),
        ("c2s_file", "ckpt_to_safetensors", {"file_path": os.path.join(root, "in", "single.ckpt"),
                                             "save_path": f"{out}/c2s_file", "file_name_regex": r"sing\w+"}),
        ("s2c_dir", "safetensors_to_ckpt", {"file_path": f"{out}/c2s_dir", "save_path": f"{out}/s2c_dir",
                                            "name_map": {"b": "bias"}}),
        ("s2c_file", "safetensors_to_ckpt", {"file_path": f"{out}/c2s_file/single.safetensors",
                                             "save_path": f"{out}/s2c_file"}),
    ]  # fmt: skip


def _transform_jobs(root: str, side: str) -> list[tuple[str, str, dict[str, Any]]]:
    t = _side(root, side, "tr")
    full = os.path.join(root, "in", "full")
    a, b, d = _strategy(root, "a.ckpt"), _strategy(root, "b.ckpt"), _strategy(root, "d.ckpt")
    pp = _side(root, side, "strategy", "pp_merged.ckpt")
    stage = [os.path.join(root, "in", "strategy", "pp", f"stage{s}.ckpt") for s in range(2)]
    return [
        ("merge_pp", "merge_pipeline_strategys",
         {"src_strategy_dirs": os.path.join(root, "in", "strategy", "pp"), "dst_strategy_file": pp}),
        ("merge_pp_json", "merge_pipeline_strategys",
         {"src_strategy_dirs": os.path.join(root, "in", "strategy", "pp_json"),
          "dst_strategy_file": _side(root, side, "strategy", "merged.json")}),
        ("full_to_a", "transform_checkpoints",
         {"src_checkpoints_dir": full, "dst_checkpoints_dir": f"{t}/a", "ckpt_prefix": "checkpoint_",
          "src_strategy_file": None, "dst_strategy_file": a}),
        ("a_to_b", "transform_checkpoints",
         {"src_checkpoints_dir": f"{t}/a", "dst_checkpoints_dir": f"{t}/b", "ckpt_prefix": "net_",
          "src_strategy_file": a, "dst_strategy_file": b, "process_num": 2}),
        ("b_to_full", "transform_checkpoints",
         {"src_checkpoints_dir": f"{t}/b", "dst_checkpoints_dir": f"{t}/full", "ckpt_prefix": "full_",
          "src_strategy_file": b, "dst_strategy_file": None}),
        ("full_to_pp", "transform_checkpoints",
         {"src_checkpoints_dir": full, "dst_checkpoints_dir": f"{t}/pp", "ckpt_prefix": "checkpoint_",
          "src_strategy_file": None, "dst_strategy_file": pp}),
        ("pp_to_b", "transform_checkpoints",
         {"src_checkpoints_dir": f"{t}/pp", "dst_checkpoints_dir": f"{t}/pp_b", "ckpt_prefix": "checkpoint_",
          "src_strategy_file": pp, "dst_strategy_file": b}),
        ("by_stage_0", "transform_checkpoints",
         {"src_checkpoints_dir": f"{t}/pp", "dst_checkpoints_dir": f"{t}/by_stage", "ckpt_prefix": "part_",
          "src_strategy_file": stage[0], "dst_strategy_file": d}),
        ("by_stage_1", "transform_checkpoints",
         {"src_checkpoints_dir": f"{t}/pp", "dst_checkpoints_dir": f"{t}/by_stage", "ckpt_prefix": "part_",
          "src_strategy_file": stage[1], "dst_strategy_file": d}),
        ("a_to_st", "ckpt_to_safetensors", {"file_path": f"{t}/a", "save_path": f"{t}/a_st"}),
        ("st_a_to_b_st", "transform_checkpoints",
         {"src_checkpoints_dir": f"{t}/a_st", "dst_checkpoints_dir": f"{t}/b_st", "ckpt_prefix": "net_",
          "src_strategy_file": a, "dst_strategy_file": b, "output_format": "safetensors"}),
        ("st_a_to_b_ckpt", "transform_checkpoints",
         {"src_checkpoints_dir": f"{t}/a_st", "dst_checkpoints_dir": f"{t}/b_st_ckpt", "ckpt_prefix": "net_",
          "src_strategy_file": a, "dst_strategy_file": b}),
        ("pp_to_st", "ckpt_to_safetensors", {"file_path": f"{t}/pp", "save_path": f"{t}/pp_st"}),
    ]  # fmt: skip


def _unify_jobs(root: str, side: str) -> list[tuple[str, str, dict[str, Any]]]:
    t, u = _side(root, side, "tr"), _side(root, side, "uni")
    a, b = _strategy(root, "a.ckpt"), _strategy(root, "b.ckpt")
    pp = _side(root, side, "strategy", "pp_merged.ckpt")
    rename = {"map": {"i": False, "w": "model.w_renamed", "v": "model.v"}}
    return [
        ("unify", "unified_safetensors", {"src_dir": f"{t}/a_st", "src_strategy_file": a, "dst_dir": f"{u}/u1"}),
        ("unify_choice", "unified_safetensors",
         {"src_dir": f"{t}/a_st", "src_strategy_file": a, "dst_dir": f"{u}/u2", "choice_func": rename}),
        ("unify_split_1", "unified_safetensors",
         {"src_dir": f"{t}/a_st", "src_strategy_file": a, "dst_dir": f"{u}/u3", "split_dst_file": (1, 2)}),
        ("unify_split_2", "unified_safetensors",
         {"src_dir": f"{t}/a_st", "src_strategy_file": a, "dst_dir": f"{u}/u4", "split_dst_file": (2, 2),
          "max_process_num": 2}),
        ("unify_pp", "unified_safetensors", {"src_dir": f"{t}/pp_st", "src_strategy_file": pp, "dst_dir": f"{u}/u5"}),
        ("split_all", "load_distributed",
         {"predict_strategy": b, "unified_safetensors_dir": f"{u}/u1", "dst_safetensors_dir": f"{u}/split_all"}),
        ("split_rank_ckpt", "load_distributed",
         {"predict_strategy": a, "unified_safetensors_dir": f"{u}/u1", "dst_safetensors_dir": f"{u}/split_r2",
          "rank_id": 2, "output_format": "ckpt"}),
        ("split_pp", "load_distributed",
         {"predict_strategy": pp, "unified_safetensors_dir": f"{u}/u5", "dst_safetensors_dir": f"{u}/split_pp",
          "max_process_num": 2}),
        ("split_hf_index", "load_distributed",
         {"predict_strategy": b, "unified_safetensors_dir": os.path.join(root, "in", "hf_index"),
          "dst_safetensors_dir": f"{u}/split_hf_index", "name_map": HF_NAMES}),
        ("split_hf_single", "load_distributed",
         {"predict_strategy": a, "unified_safetensors_dir": os.path.join(root, "in", "hf_single"),
          "dst_safetensors_dir": f"{u}/split_hf_single", "name_map": HF_NAMES, "rank_id": 1, "output_format": "ckpt"}),
        ("split_name_map", "load_distributed",
         {"predict_strategy": b, "unified_safetensors_dir": f"{u}/u2", "dst_safetensors_dir": f"{u}/split_map",
          "name_map": {"w": "model.w_renamed", "v": "model.v"}}),
    ]  # fmt: skip


def _rank_list_cases(root: str) -> list[tuple[str, int, str | None, str | None]]:
    a, b, d = _strategy(root, "a.ckpt"), _strategy(root, "b.ckpt"), _strategy(root, "d.ckpt")
    pp = _side(root, "ms", "strategy", "pp_merged.ckpt")  # MindSpore's merge: the input both sides read
    aj = _strategy(root, "a.json")
    cases: list[tuple[str, int, str | None, str | None]] = []
    for name, src, dst, ranks in (
        ("a_b", a, b, 2),
        ("b_a", b, a, 4),
        ("a_none", a, None, 4),
        ("none_b", None, b, 2),
        ("pp_b", pp, b, 2),
        ("b_pp", b, pp, 4),
        ("pp_d", pp, d, 4),
        ("d_pp", d, pp, 4),
        ("pp_none", pp, None, 2),
        ("json_b", aj, b, 2),
        ("pp_pp", pp, pp, 4),
    ):
        cases += [(f"{name}@{r}", r, src, dst) for r in range(ranks)]
    return cases  # fmt: skip


def _by_rank_cases(root: str, side: str) -> list[tuple[str, dict[str, Any]]]:
    t = _side(root, side, "tr")
    a, b = _strategy(root, "a.ckpt"), _strategy(root, "b.ckpt")
    pp = _side(root, side, "strategy", "pp_merged.ckpt")
    cases = []
    for rank, order in ((0, [3, 2, 1, 0]), (1, [0, 1, 2, 3])):
        files = [[r, f"{t}/a/rank_{r}/checkpoint_{r}.ckpt"] for r in order]
        cases.append(
            (
                f"a_b_{rank}",
                {
                    "rank_id": rank,
                    "checkpoint_files_map": files,
                    "save_checkpoint_file_name": f"{t}/by_rank/a_b_{rank}.ckpt",
                    "src_strategy_file": a,
                    "dst_strategy_file": b,
                },
            )
        )
    for rank in range(4):
        files = [[r, f"{t}/pp/rank_{r}/checkpoint_{r}.ckpt"] for r in (3, 2, 1, 0)]
        cases.append(
            (
                f"pp_a_{rank}",
                {
                    "rank_id": rank,
                    "checkpoint_files_map": files,
                    "save_checkpoint_file_name": f"{t}/by_rank/pp_a_{rank}.ckpt",
                    "src_strategy_file": pp,
                    "dst_strategy_file": a,
                },
            )
        )
    files = [[r, f"{t}/b/rank_{r}/net_{r}.ckpt"] for r in (0, 1)]
    cases.append(
        (
            "b_full",
            {
                "rank_id": 0,
                "checkpoint_files_map": files,
                "save_checkpoint_file_name": f"{t}/by_rank/b_full.ckpt",
                "src_strategy_file": b,
            },
        )
    )
    return cases  # fmt: skip


STRATEGY_FILES = ("a.ckpt", "a.json", "pp/stage1.ckpt", "pp_json/stage0.json")


def _all_jobs(root: str) -> list[dict[str, Any]]:
    jobs = _save_jobs(root) + _load_jobs(root)
    for group in (_convert_jobs, _transform_jobs, _unify_jobs):
        jobs += [{"id": f"call:{i}", "op": op, "kwargs": kw} for i, op, kw in group(root, "ms")]
    jobs += [{"id": f"by_rank:{i}", "op": "by_rank", "kwargs": kw} for i, kw in _by_rank_cases(root, "ms")]
    jobs += [{"id": f"rank_list:{i}", "op": "rank_list",
              "kwargs": {"rank_id": r, "src_strategy_file": s, "dst_strategy_file": d}}
             for i, r, s, d in _rank_list_cases(root)]  # fmt: skip
    jobs += [{"id": f"bss:{name}", "op": "bss", "kwargs": {"strategy_filename": _strategy(root, name)}}
             for name in STRATEGY_FILES]  # fmt: skip
    jobs.append(
        {
            "id": "bss:merged",
            "op": "bss",
            "kwargs": {"strategy_filename": _side(root, "ms", "strategy", "pp_merged.ckpt")},
        }
    )
    return jobs


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, oracle: Callable[..., Any]) -> World:
    root = str(tmp_path_factory.mktemp("dropin"))
    _write_inputs(root)
    for side in ("ms", "rs"):
        shutil.copytree(os.path.join(root, "in", "conv"), _side(root, side, "conv", "inplace"))  # converted in place
        os.makedirs(_side(root, side, "tr", "by_rank"))  # MindSpore creates neither of these folders
        for case in SAVE_CASES:
            os.makedirs(_side(root, side, "save", case.id))
    return World(root, oracle(ORACLE_SCRIPT, {"jobs": _all_jobs(root)}))


Group = Callable[[str, str], list[tuple[str, str, dict[str, Any]]]]


def _ids(group: Group) -> list[str]:
    return [case_id for case_id, _, _ in group("/ids", "rs")]


def _run_ours(world: World, group: Group) -> dict[str, str | None]:
    """Our side of a chained group, in order: case id -> None or the error it raised."""
    errors: dict[str, str | None] = {}
    for case_id, name, kwargs in group(world.root, "rs"):
        try:
            _call(name, kwargs)
            errors[case_id] = None
        except Exception as exc:  # reported by the case's own test
            errors[case_id] = f"{type(exc).__name__}: {exc}"
    return errors


@pytest.fixture(scope="module")
def converted(world: World) -> dict[str, str | None]:
    return _run_ours(world, _convert_jobs)


@pytest.fixture(scope="module")
def transformed(world: World) -> dict[str, str | None]:
    return _run_ours(world, _transform_jobs)


@pytest.fixture(scope="module")
def unified(world: World, transformed: dict[str, str | None]) -> dict[str, str | None]:
    return _run_ours(world, _unify_jobs)


def _kwargs(world: World, group: Group, case_id: str) -> dict[str, Any]:
    return next(kw for i, _, kw in group(world.root, "rs") if i == case_id)


EXPECTED_ERRORS = {"unify_split_2"}  # both refuse: (2, 2) selects none of a one-part model


def _check_case(world: World, errors: Mapping[str, str | None], case_id: str) -> None:
    if case_id in EXPECTED_ERRORS:
        assert "error" in world.ms[f"call:{case_id}"], f"MindSpore accepted {case_id}"
        assert (errors[case_id] or "").startswith("UsageError"), f"reshard on {case_id}: {errors[case_id]}"
        return
    world.ok(f"call:{case_id}")
    assert errors[case_id] is None, f"reshard failed on {case_id}: {errors[case_id]}"


# --------------------------------------------------------------------------------------------
# our side


def _call(name: str, kwargs: Mapping[str, Any]) -> None:
    kw = dict(kwargs)
    if "choice_func" in kw:
        kw["choice_func"] = _choice(kw["choice_func"])
    if name == "load_distributed":
        rms.load_distributed_checkpoint(None, format="safetensors", **kw)
    else:
        getattr(rms, name)(**kw)


def _tree(world: World, *parts: str) -> tuple[str, str]:
    return world.p("rs", *parts), world.p("ms", *parts)


def _header(path: str) -> tuple[int, dict[str, Any], bytes]:
    with open(path, "rb") as fh:
        data = fh.read()
    size = int.from_bytes(data[:8], "little")
    return size, json.loads(data[8 : 8 + size]), data[8 + size :]


def _describe(loaded: Mapping[str, Any]) -> list[list[Any]]:
    rows = []
    for name, value in loaded.items():
        if isinstance(value, str):
            rows.append([name, "str", [], value])
        else:
            ms_name = dtypes.from_numpy(value.dtype).ms_name
            rows.append([name, ms_name, list(value.shape), hashlib.sha256(value.tobytes()).hexdigest()])
    return rows


# --------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("case", SAVE_CASES, ids=[c.id for c in SAVE_CASES])
def test_save_checkpoint_same_name_and_bytes(world: World, case: SaveCase) -> None:
    world.ok(f"save:{case.id}")
    values = case.values
    obj: Any = dict(values) if case.mode == "dict" else [{"name": n, "data": v} for n, v in values.items()]
    kwargs = dict(case.kwargs)
    if "choice_func" in kwargs:
        kwargs["choice_func"] = _choice(kwargs["choice_func"])
    rms.save_checkpoint(obj, world.p("rs", "save", case.id, case.name), append_dict=case.append or None, **kwargs)
    ours, theirs = _tree(world, "save", case.id)
    names = sorted(tree_files(theirs))
    assert sorted(tree_files(ours)) == names
    (name,) = names
    a, b = os.path.join(ours, name), os.path.join(theirs, name)
    if case.fmt == "safetensors":
        # MindSpore's safetensors library writes metadata keys in hash-map order: compare parsed headers
        # (same length, same entries and offsets) and the data bytes.
        assert _header(a) == _header(b)
    else:
        with open(a, "rb") as fa, open(b, "rb") as fb:
            assert fa.read() == fb.read()


@pytest.mark.parametrize("case", LOAD_CASES, ids=[c[0] for c in LOAD_CASES])
def test_load_checkpoint_same_arrays_and_order(world: World, case: tuple[str, str, dict[str, Any]]) -> None:
    case_id, save_id, kwargs = case
    expected = world.ok(f"load:{case_id}")
    save_case = next(c for c in SAVE_CASES if c.id == save_id)
    kw = dict(kwargs)
    if "choice_func" in kw:
        kw["choice_func"] = _choice(kw["choice_func"])
    loaded = rms.load_checkpoint(_saved_file(world.root, "ms", save_case), **kw)
    assert _describe(loaded) == expected
    assert all(isinstance(v, str) or (v.flags.owndata and v.flags.writeable) for v in loaded.values())


CONVERT_OUTPUT = {"c2s_dir": "c2s_dir", "c2s_dir_regex_map": "c2s_regex", "c2s_inplace": "inplace",
                  "c2s_file": "c2s_file", "s2c_dir": "s2c_dir", "s2c_file": "s2c_file"}  # fmt: skip


@pytest.mark.parametrize("case_id", _ids(_convert_jobs))
def test_converters_same_trees(world: World, converted: dict[str, str | None], case_id: str) -> None:
    _check_case(world, converted, case_id)
    assert_same_tree(*_tree(world, "conv", CONVERT_OUTPUT[case_id]))
    if case_id == "c2s_dir":
        assert sorted(os.listdir(world.p("rs", "conv", "c2s_dir"))) == ["rank_0", "rank_1", "rankx"]


@pytest.mark.parametrize("case_id", _ids(_transform_jobs))
def test_merges_and_transforms_same_trees(world: World, transformed: dict[str, str | None], case_id: str) -> None:
    _check_case(world, transformed, case_id)
    kwargs = _kwargs(world, _transform_jobs, case_id)
    if case_id == "merge_pp":
        _compare_merged(world, kwargs["dst_strategy_file"])
    elif case_id == "merge_pp_json":
        with open(kwargs["dst_strategy_file"], "rb") as fa, open(world.p("ms", "strategy", "merged.json"), "rb") as fb:
            assert fa.read() == fb.read()
    else:
        dst = kwargs.get("dst_checkpoints_dir") or kwargs["save_path"]
        assert_same_tree(dst, dst.replace(world.p("rs"), world.p("ms"), 1))
    if case_id == "by_stage_1":
        assert sorted(tree_files(world.p("rs", "tr", "by_stage"))) == [
            f"rank_{k}/part_{k}_part{s}.ckpt" for k in range(4) for s in range(2)
        ]


def _compare_merged(world: World, ours: str) -> None:
    """MindSpore merges in glob (listing) order, and so does the drop-in: same bytes."""
    with open(ours, "rb") as fa, open(world.p("ms", "strategy", "pp_merged.ckpt"), "rb") as fb:
        assert fa.read() == fb.read()


def test_transform_checkpoint_by_rank_same_files(world: World, transformed: dict[str, str | None]) -> None:
    for case_id, kwargs in _by_rank_cases(world.root, "rs"):
        world.ok(f"by_rank:{case_id}")
        kw = dict(kwargs)
        kw["checkpoint_files_map"] = {int(r): p for r, p in kw["checkpoint_files_map"]}
        rms.transform_checkpoint_by_rank(**kw)
    assert_same_tree(*_tree(world, "tr", "by_rank"))


@pytest.mark.parametrize("case_id", _ids(_unify_jobs))
def test_unified_and_load_distributed_same_trees(world: World, unified: dict[str, str | None], case_id: str) -> None:
    _check_case(world, unified, case_id)
    if case_id in EXPECTED_ERRORS:
        return
    kwargs = _kwargs(world, _unify_jobs, case_id)
    dst = kwargs.get("dst_dir") or kwargs["dst_safetensors_dir"]
    assert_same_tree(dst, dst.replace(world.p("rs"), world.p("ms"), 1))


def test_load_distributed_return_param_dict_equals_mindspore_file(world: World) -> None:
    """Framework-free load of one rank equals the file MindSpore's save mode writes for that rank."""
    world.ok("call:split_all")
    for rank in range(2):
        loaded = rms.load_distributed_checkpoint(
            None, predict_strategy=_strategy(world.root, "b.ckpt"), format="safetensors",
            unified_safetensors_dir=world.p("ms", "uni", "u1"), rank_id=rank, return_param_dict=True,
        )  # fmt: skip
        with read_safetensors(world.p("ms", "uni", "split_all", f"rank_{rank}", "net.safetensors")) as index:
            expected = {name: index.array(name) for name in sorted(index.entries)}
            assert sorted(loaded) == list(expected)  # the dict keeps strategy order; the file is sorted
            for name, value in expected.items():
                assert loaded[name].dtype == value.dtype and np.array_equal(loaded[name], value), name


def test_rank_list_for_transform_same_lists(world: World) -> None:
    mismatches = []
    for case_id, rank, src, dst in _rank_list_cases(world.root):
        expected = world.ok(f"rank_list:{case_id}")
        got = rms.rank_list_for_transform(rank, src, dst)
        assert all(type(r) is int for r in got)
        if got != expected:
            mismatches.append((case_id, got, expected))
    assert not mismatches


@pytest.mark.parametrize("name", [*STRATEGY_FILES, "merged"])
def test_build_searched_strategy_same_messages(world: World, name: str) -> None:
    expected = world.ok(f"bss:{name}")
    path = world.p("ms", "strategy", "pp_merged.ckpt") if name == "merged" else _strategy(world.root, name)
    got = rms.build_searched_strategy(path)
    assert list(got) == list(expected)
    assert {k: v.SerializeToString().hex() for k, v in got.items()} == expected
    assert all(type(v).__name__ == "ParallelLayouts" for v in got.values())


def test_hand_built_layouts_cover_the_model() -> None:
    assert set(A) == set(B) == set(D) == {n for n in MODEL if n not in ("global_step", "learning_rate")}
    assert set(PP[0]) | set(PP[1]) == set(A)
