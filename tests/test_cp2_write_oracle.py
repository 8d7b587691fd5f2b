"""Oracle: MindFormers 2.1.0 itself reads the Checkpoint 2.0 reshard writes.

Two questions, answered in the oracle venv (MindSpore 2.10 + MindFormers 2.1.0, a subprocess run in
a temporary working directory, since MindFormers logs to ./output/log):

* Does reshard write ``metadata.json`` byte for byte as MindFormers' own ``save_metadata`` does for
  the same layouts? MindFormers builds it from ``mindspore.parallel.Layout`` objects (with
  reshard's alias names) through its own slice-id and storage code.
* Does MindFormers' loader (``get_checkpoint_path`` -> ``get_metadata_of_checkpoint`` ->
  ``ReshardLoader``) load reshard's tree into another layout with the original tensors? This goes
  through ``load_metadata`` and ``_deserialize_sharded_tensor_layout``, so reshard's layout dicts
  and alias names must be ones ``mindspore.parallel.Layout`` accepts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from reshard import api
from reshard.layout import ParamLayout
from reshard.layout.slices import alias_names, model_parallel
from reshard.statenames import DEFAULT
from tests.cp2_write_helpers import EMB, FC1, NORM, PROJ, block, full_tensors, layouts, with_states, write_job

pytestmark = pytest.mark.oracle

SCRIPT = """
import importlib, tempfile
os.chdir(ARGS["cwd"])
from mindspore.common import dtype as mstype
from mindspore.parallel import Layout
import mindformers.checkpoint.layout_adapter as mf_layout_adapter
import mindformers.checkpoint.metadata as mf_metadata
import mindformers.checkpoint.sharded_tensor as mf_sharded
import mindformers.checkpoint.checkpoint as mf_ckpt
from mindformers.checkpoint.reshard import ReshardLoader

mf_layout_adapter.LayoutAdapter.is_pynative_mode = staticmethod(lambda: False)
MODULES = ["mindformers.tools.utils", "mindformers.checkpoint.checkpoint", "mindformers.checkpoint.sharded_tensor",
           "mindformers.checkpoint.metadata", "mindformers.checkpoint.utils", "mindformers.checkpoint.reshard"]
DTYPES = {"Float32": mstype.float32, "BFloat16": mstype.bfloat16, "Int32": mstype.int32}


def set_rank(rank, world):
    for name in MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "get_real_rank"):
            module.get_real_rank = lambda rank=rank: rank
        if hasattr(module, "get_real_group_size"):
            module.get_real_group_size = lambda world=world: world
    mf_metadata.get_group_size = lambda world=world: world


def layout_of(spec):
    if spec["layout"] is None:
        return None
    dev, tmap, aliases, ranks = spec["layout"]
    def alias(v):
        return "None" if v == -1 else aliases[len(dev) - 1 - v]
    entries = [tuple(alias(v) for v in e) if isinstance(e, list) else alias(e) for e in tmap]
    return Layout(tuple(dev), tuple(aliases), ranks)(*entries)


def metadata_job(job):
    world = job["world"]
    set_rank(0, world)
    info = {}
    for rank, names in enumerate(job["holdings"]):
        info[rank] = {n: [layout_of(job["specs"][n]), DTYPES[job["specs"][n]["dtype"]],
                          tuple(job["specs"][n]["shape"])] for n in names}
    metas = mf_sharded._build_all_sharded_tensor_from_global_layout(info)
    mappings = mf_metadata.get_total_params_file_mapping_info(metas, job["prefix"], set(job["model_keys"]))
    path = os.path.join(tempfile.mkdtemp(dir="."), "metadata.json")
    mf_metadata.save_metadata(metas, mappings, path)
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def load_job(job):
    world = job["world"]
    root = mf_ckpt.get_checkpoint_path(job["src"])
    src_metas, mappings = mf_metadata.get_metadata_of_checkpoint(root)
    loaded = {}
    for rank in range(world):
        set_rank(rank, world)
        infos = {n: [layout_of(s), DTYPES[s["dtype"]], tuple(s["shape"])] for n, s in job["specs"].items()}
        dst = mf_sharded.get_sharded_tensor_from_strategy_metadata(infos, rank)
        state = ReshardLoader(root, dst, src_metas, mappings).load()
        arrays = {}
        for name, value in state.items():
            arrays[name] = (value.astype(mstype.float32) if value.dtype == mstype.bfloat16 else value).asnumpy()
        np.savez(os.path.join(job["out"], f"rank_{rank}.npz"), **arrays)
        loaded[rank] = sorted(state)
    return {"root": root, "loaded": loaded}


out([metadata_job(j) if j["op"] == "metadata" else load_job(j) for j in ARGS["jobs"]])
"""


def spec(p: ParamLayout | None, array: np.ndarray, dtype: str, ranks: Sequence[int]) -> dict[str, Any]:
    """A tensor for the script: its layout as MindSpore Layout terms, dtype name and global shape."""
    lay = None
    if p is not None:
        p = model_parallel(p)
        tmap = [
            list(e) if isinstance(e, tuple) and len(e) > 1 else (e[0] if isinstance(e, tuple) else e)
            for e in p.tensor_map
        ]
        lay = [list(p.dev_matrix), tmap, list(alias_names(p.dev_matrix)), list(ranks)]
    return {"layout": lay, "dtype": dtype, "shape": list(array.shape)}


def dtype_name(array: np.ndarray) -> str:
    return {"float32": "Float32", "bfloat16": "BFloat16", "int32": "Int32"}[str(array.dtype)]


def specs_for(lays: Mapping[str, ParamLayout], full: Mapping[str, np.ndarray], ranks: Sequence[int]) -> dict[str, Any]:
    return {n: spec(lays.get(n), a, dtype_name(a), ranks) for n, a in full.items()}


def _metadata_case(root: str, optimizer: bool) -> tuple[dict[str, Any], str]:
    """MindFormers' job and the metadata.json reshard writes for an 8-rank layout."""
    job = write_job(os.path.join(root, "job"), optimizer=optimizer)
    out = os.path.join(root, "out")
    api.transform(
        job["full"], out, None, job["strategy"], output=api.OutputSpec(format="checkpoint2", iteration=3, prefix="p")
    )
    full = full_tensors(optimizer)
    lays = with_states(layouts()) if optimizer else layouts()
    # every rank holds every tensor: reshard's file order is the strategy's tensors, then the rest
    names = [n for n in full if n in lays] + [n for n in full if n not in lays]
    args = {
        "op": "metadata",
        "world": 8,
        "holdings": [names] * 8,
        "specs": specs_for(lays, full, range(8)),
        "model_keys": [n for n in names if not DEFAULT.is_state(n)],
        "prefix": "p",
    }
    return args, os.path.join(out, "iteration_00000003", "metadata.json")


def _pipeline_metadata_case(root: str) -> tuple[dict[str, Any], str]:
    lay = layouts((1, 2))
    stage0 = {EMB: lay[EMB], PROJ: lay[PROJ], NORM: lay[NORM]}
    stage1 = {FC1: lay[FC1], EMB: lay[EMB]}
    job = write_job(os.path.join(root, "job"), stages=[stage0, stage1], optimizer=False)
    out = os.path.join(root, "out")
    api.transform(job["full"], out, None, job["strategy"], output=api.OutputSpec(format="checkpoint2", iteration=3))
    full = full_tensors(False)
    elsewhere = [n for n in full if n not in stage0 and n not in stage1]  # in no strategy: whole, on every rank
    s0 = [n for n in full if n in stage0] + elsewhere
    s1 = [n for n in full if n in stage1 and n != EMB] + elsewhere  # the tied embedding: its lowest stage only
    specs = specs_for({**stage1, **stage0}, full, (0, 1))
    specs[FC1] = spec(lay[FC1], full[FC1], "Float32", (2, 3))
    args = {"op": "metadata", "world": 4, "holdings": [s0, s0, s1, s1], "specs": specs, "model_keys": list(full)}
    args["prefix"] = None
    return args, os.path.join(out, "iteration_00000003", "metadata.json")


def _load_args(root: str, src: str, lays: Mapping[str, ParamLayout], world: int) -> dict[str, Any]:
    loaded = os.path.join(root, "loaded")
    os.makedirs(loaded)
    specs = specs_for(lays, full_tensors(), range(world))
    return {"op": "load", "src": src, "world": world, "specs": specs, "out": loaded, "lays": lays}


def _rank_folders_load_case(root: str) -> dict[str, Any]:
    """8-rank rank folders + strategy -> reshard Checkpoint 2.0 -> MindFormers loads it on dp2 x tp2."""
    job = write_job(os.path.join(root, "job"))
    ranks8 = os.path.join(root, "ranks8")
    api.transform(job["full"], ranks8, None, job["strategy"], output=api.OutputSpec(format="ckpt"))
    out = os.path.join(root, "out")
    api.transform(
        ranks8, out, job["strategy"], job["strategy"], output=api.OutputSpec(format="checkpoint2", iteration=9)
    )
    return _load_args(root, out, with_states(layouts((2, 2))), 4)


def _optimizer_shards_load_case(root: str) -> dict[str, Any]:
    """A full model -> reshard Checkpoint 2.0 on an optimizer-sharded strategy -> MindFormers loads it on tp4."""
    job = write_job(os.path.join(root, "job"), stages=[with_states(layouts(opt=True))])
    out = os.path.join(root, "out")
    api.transform(job["full"], out, None, job["strategy"], output=api.OutputSpec(format="checkpoint2", iteration=9))
    return _load_args(root, out, with_states(layouts((1, 4))), 4)


def _pipeline_load_case(root: str) -> dict[str, Any]:
    lay = layouts((1, 2))
    stage0 = {EMB: lay[EMB], PROJ: lay[PROJ], NORM: lay[NORM], FC1: lay[FC1]}
    stage1 = {n: lay[n] for n in lay if n not in stage0} | {EMB: lay[EMB]}
    job = write_job(os.path.join(root, "job"), stages=[with_states(stage0), with_states(stage1)])
    out = os.path.join(root, "out")
    api.transform(job["full"], out, None, job["strategy"], output=api.OutputSpec(format="checkpoint2", iteration=9))
    return _load_args(root, out, with_states(layouts((2, 2))), 4)


LOAD_CASES = {
    "rank folders": _rank_folders_load_case,
    "optimizer shards": _optimizer_shards_load_case,
    "pipeline": _pipeline_load_case,
}


@pytest.fixture(scope="module")
def mindformers_ran(oracle: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case's job run by MindFormers in one oracle process (importing it costs seconds; one
    process per case was most of this module's time). id -> (MindFormers' result, what to compare)."""
    root = str(tmp_path_factory.mktemp("cp2"))
    cases: dict[str, tuple[dict[str, Any], Any]] = {}
    for optimizer in (False, True):
        args, ours = _metadata_case(os.path.join(root, f"metadata-{optimizer}"), optimizer)
        cases[f"metadata-{optimizer}"] = (args, ours)
    args, ours = _pipeline_metadata_case(os.path.join(root, "metadata-pipeline"))
    cases["metadata-pipeline"] = (args, ours)
    for name, make in LOAD_CASES.items():
        args = make(os.path.join(root, name))
        cases[name] = ({k: v for k, v in args.items() if k != "lays"}, args)
    results = oracle(SCRIPT, {"cwd": root, "jobs": [job for job, _ in cases.values()]})
    return {name: (result, extra) for (name, (_, extra)), result in zip(cases.items(), results, strict=True)}


@pytest.mark.parametrize("case", ["metadata-False", "metadata-True", "metadata-pipeline"])
def test_metadata_json_is_byte_identical_to_mindformers(mindformers_ran: dict[str, Any], case: str) -> None:
    """Without and with optimizer states on 8 ranks, and a 2-stage pipeline (a tied embedding)."""
    theirs, ours = mindformers_ran[case]
    with open(ours, encoding="utf-8") as fh:
        assert fh.read() == theirs


@pytest.mark.parametrize("case", list(LOAD_CASES))
def test_mindformers_loads_reshard_output(mindformers_ran: dict[str, Any], case: str) -> None:
    """reshard's Checkpoint 2.0 (from rank folders, from a full model on optimizer shards, of a
    pipeline) as MindFormers' ReshardLoader loads it into another layout: every rank's blocks."""
    result, args = mindformers_ran[case]
    full, lays, world = full_tensors(), args["lays"], args["world"]
    assert result["root"].endswith("iteration_00000009")  # followed the tracker
    for rank in range(world):
        with np.load(os.path.join(args["out"], f"rank_{rank}.npz")) as data:
            arrays = {k: data[k] for k in data.files}
        assert sorted(arrays) == sorted(full)
        for name, array in arrays.items():
            expected = block(full[name], model_parallel(lays[name]) if name in lays else None, rank)
            assert np.array_equal(array, expected.astype(array.dtype)), (rank, name)
