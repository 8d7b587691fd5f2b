"""reshard against MindFormers 2.1.0 on Checkpoint 2.0 (issue 11's oracle tests), through the CLI.

(a) A tree MindFormers itself wrote (8 ranks, dp2 x tp4, AdamW states) -> reshard to 4 ranks, to a
    full model and to Hugging Face; every tensor must equal the full tensor's slice and, per rank,
    what MindFormers' own loader gives that rank of the same 4-rank strategy. Its balanced
    (redundancy-removed, file numbers not ranks) and two-stage pipeline trees -> a full model.
(b) A Checkpoint 2.0 that reshard writes (from rank folders + strategy, and from a full model)
    loaded by MindFormers' own loader into another layout equals the source tensors.

The MindFormers side runs in the oracle venv through tests/mindformers_oracle.py: one subprocess
saves the tree and loads it into the 4-rank strategy (module fixture); each (b) test runs one more.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from reshard.formats.ckpt import read_ckpt
from reshard.formats.safetensors import read_safetensors, save_safetensors
from reshard.formats.strategy import make_strategy, write_strategy
from reshard.layout import ParamLayout
from reshard.layout.algebra import rank_box
from tests.mindformers_oracle import (
    DEFAULT_LAYOUTS,
    SaveOptions,
    dp_tp_layouts,
    load_job,
    local_slice,
    mindformers_load_many,
    optimizer_specs,
    pipeline_layouts,
    pipeline_sparse_layouts,
    plan_save,
    read_loaded,
    run_jobs,
    strategy_layouts,
)

pytestmark = pytest.mark.oracle

WEIGHTS = {  # the tiny network's parameters as strategy layouts: (dp, tp) = device axes (1, 0)
    "embedding.word_embeddings.weight": (0, -1),
    "decoder.layers.0.linear_proj.weight": (-1, 0),
    "decoder.layers.0.linear_fc1.weight": ((1, 0), -1),
    "decoder.layers.0.dp_split.weight": (1, -1),
    "decoder.layers.0.input_layernorm.weight": (-1,),
    "decoder.layers.0.mask": (-1, 0),
    "decoder.layers.0.position_ids": (0,),
}
TRAINABLE = [n for n, s in DEFAULT_LAYOUTS.items() if s.trainable]


def strategy(dev: tuple[int, int]) -> dict[str, ParamLayout]:
    """Every parameter and its AdamW states on a ``dev`` = (dp, tp) device matrix."""
    layouts = {name: ParamLayout(dev, tensor_map) for name, tensor_map in WEIGHTS.items()}
    for name in TRAINABLE:
        layouts[f"adam_m.{name}"] = layouts[f"adam_v.{name}"] = layouts[name]
    return layouts


S8, S4 = strategy((2, 4)), strategy((2, 2))


def reshard(*args: str | Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "reshard.cli", *map(str, args), "-q"],
        capture_output=True,
        text=True,
        env={**os.environ},
    )
    assert proc.returncode == 0, proc.stderr


def same(got: np.ndarray, want: np.ndarray) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


def box_of(full: np.ndarray, layout: ParamLayout | None, rank: int) -> np.ndarray:
    if layout is None:
        return full
    return full[tuple(slice(a, b) for a, b in rank_box(layout, full.shape, rank))]


def read_tensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of every checkpoint file directly in ``folder`` (names must not repeat)."""
    tensors: dict[str, np.ndarray] = {}
    for path in sorted(folder.iterdir()):
        if path.suffix not in (".safetensors", ".ckpt"):
            continue
        reader = read_safetensors if path.suffix == ".safetensors" else read_ckpt
        with reader(path) as index:
            for name in index:
                assert name not in tensors, (path, name)
                tensors[name] = np.array(index.array(name))
    return tensors


def write_strategy_file(path: Path, layouts: dict[str, ParamLayout]) -> Path:
    write_strategy(path, make_strategy(layouts))
    return path


def dtype_name(array: np.ndarray) -> str:
    return "bfloat16" if array.dtype == ml_dtypes.bfloat16 else str(array.dtype)


@pytest.fixture(scope="module")
def mf(tmp_path_factory: pytest.TempPathFactory, oracle: Any) -> dict[str, Any]:
    """MindFormers saves the 8-rank tree and loads it into the 4-rank strategy, in one subprocess."""
    root = tmp_path_factory.mktemp("mf_cp2")
    work = root / "work"
    work.mkdir()
    save, full = plan_save(root / "cp2", DEFAULT_LAYOUTS, work, SaveOptions(ranks=8))
    s4 = write_strategy_file(root / "s4.ckpt", S4)
    s8 = write_strategy_file(root / "s8.ckpt", S8)
    tensors = {n: (a.shape, dtype_name(a)) for n, a in full.items()}
    dst = strategy_layouts(s4, tensors)
    loads = [load_job(root / "cp2", dst, r, 4, work / f"mf4_{r}.npz") for r in range(4)]
    how_b = SaveOptions(seed=1, pipeline=True, remove_redundancy=True)
    balanced, full_b = plan_save(root / "balanced", pipeline_sparse_layouts(), work, how_b)
    pipeline, full_p = plan_save(root / "pipeline", pipeline_layouts(), work, SaveOptions(seed=2, pipeline=True))
    saves = [save, balanced, pipeline]
    results = run_jobs([*saves, *loads])
    mf4 = {
        r: read_loaded(Path(job["out"]), res)
        for r, (job, res) in enumerate(zip(loads, results[len(saves) :], strict=True))
    }
    others = {"balanced": full_b, "pipeline": full_p}
    return {"root": root, "cp2": root / "cp2", "full": full, "s4": s4, "s8": s8, "mf4": mf4, "others": others}


def test_mindformers_8_ranks_to_4_ranks(mf: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "out4"
    reshard("transform", "--src", mf["cp2"], "--dst", out, "--dst-strategy", mf["s4"], "--output-format", "safetensors")
    for rank in range(4):
        ours = read_tensors(out / f"rank_{rank}")
        assert set(ours) == set(mf["full"])
        for name, full in mf["full"].items():
            assert same(ours[name], box_of(full, S4.get(name), rank)), (rank, name)
            assert same(ours[name], mf["mf4"][rank][name]), (rank, name)


def test_mindformers_8_ranks_to_full(mf: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "full"
    reshard("unify", mf["cp2"], out)
    ours = read_tensors(out)
    assert set(ours) == set(mf["full"])
    for name, full in mf["full"].items():
        assert same(ours[name], full), name


@pytest.mark.parametrize("tree", ["balanced", "pipeline"])
def test_mindformers_balanced_and_pipeline_trees_to_full(mf: dict[str, Any], tmp_path: Path, tree: str) -> None:
    """Balanced (two stages): opt-0000002-0000004 is rank 4's file, only storage_data says so."""
    out = tmp_path / "full"
    reshard("unify", mf["root"] / tree, out)
    ours = read_tensors(out)
    assert set(ours) == set(mf["others"][tree])
    for name, full in mf["others"][tree].items():
        assert same(ours[name], full), name


def test_mindformers_8_ranks_iteration_folder_to_full(mf: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "full"
    reshard("transform", "--src", mf["cp2"] / "iteration_00000010", "--dst", out, "--output-format", "safetensors")
    ours = read_tensors(out / "rank_0")
    for name, full in mf["full"].items():
        assert same(ours[name], full), name


def test_mindformers_8_ranks_to_hugging_face(mf: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "hf"
    reshard("transform", "--src", mf["cp2"], "--dst", out, "--hf", "--keep-training-state")
    ours = read_tensors(out)
    assert set(DEFAULT_LAYOUTS) <= set(ours) <= set(mf["full"])
    for name, tensor in ours.items():
        assert same(tensor, mf["full"][name]), name


def _mindformers_loads_equal_source(
    cp2: Path, full: dict[str, np.ndarray], dp_tp: tuple[int, int], ranks: tuple[int, ...]
) -> None:
    """MindFormers loads ``cp2`` into a dp x tp job; the given ranks' tensors equal the source's slices."""
    world = dp_tp[0] * dp_tp[1]
    dst = {**dp_tp_layouts(*dp_tp), **optimizer_specs(dp_tp_layouts(*dp_tp))}
    dst = {name: spec for name, spec in dst.items() if name in full}
    loaded = mindformers_load_many(cp2, dst, ranks, world)
    for rank in ranks:
        assert set(loaded[rank]) == set(dst)
        for name, spec in dst.items():
            assert same(loaded[rank][name], local_slice(full[name], spec, rank, world)), (rank, name)


def test_reshard_writes_checkpoint2_from_rank_folders(mf: dict[str, Any], tmp_path: Path) -> None:
    source = tmp_path / "full.safetensors"
    save_safetensors(source, mf["full"])
    ranks = tmp_path / "ranks8"
    reshard("transform", "--src", source, "--dst", ranks, "--dst-strategy", mf["s8"], "--output-format", "safetensors")
    cp2 = tmp_path / "cp2"
    reshard("transform", "--src", ranks, "--src-strategy", mf["s8"], "--dst", cp2,
            "--dst-strategy", mf["s4"], "--output-format", "checkpoint2")  # fmt: skip
    assert (cp2 / "latest_checkpointed_iteration.txt").exists()
    _mindformers_loads_equal_source(cp2, mf["full"], (2, 4), (0, 3, 5, 6))  # written for 4 ranks, loaded by 8


def test_reshard_writes_checkpoint2_from_a_full_model(mf: dict[str, Any], tmp_path: Path) -> None:
    source = tmp_path / "full.safetensors"
    save_safetensors(source, mf["full"])
    cp2 = tmp_path / "cp2"
    reshard("transform", "--src", source, "--dst", cp2, "--dst-strategy", mf["s8"], "--output-format", "checkpoint2")
    _mindformers_loads_equal_source(cp2, mf["full"], (2, 2), (0, 1, 2, 3))  # written for 8 ranks, loaded by 4


def test_reshard_checkpoint2_to_checkpoint2_8_to_4(mf: dict[str, Any], tmp_path: Path) -> None:
    """MindFormers' tree -> reshard's 4-rank Checkpoint 2.0 -> MindFormers loads it: the full tensors."""
    cp2 = tmp_path / "cp2_4"
    reshard("transform", "--src", mf["cp2"], "--dst", cp2, "--dst-strategy", mf["s4"], "--output-format", "checkpoint2")
    _mindformers_loads_equal_source(cp2, mf["full"], (2, 4), (1, 2, 4, 7))  # 8 -> 4 -> loaded by 8
