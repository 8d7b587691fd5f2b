"""The MindFormers 2.1.0 oracle harness itself (tests/mindformers_oracle.py).

One MindFormers subprocess for the whole file (module fixture): it saves an 8-rank Checkpoint 2.0
(dp2 x tp4, optimizer) and a single-card one with MindFormers' own ``save_checkpoint``, then loads
them with MindFormers' own ``load_checkpoint`` into a 4-rank layout, a strategy file's layout and a
single card. Every loaded tensor must equal the numpy slice of the full tensor. The tree tests pin
what MindFormers 2.1.0 writes (docs/formats.md, last section).
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from reshard.formats.safetensors import read_safetensors
from reshard.formats.strategy import make_strategy, write_strategy
from reshard.layout import ParamLayout
from reshard.layout.algebra import rank_box
from tests.mindformers_oracle import (
    DEFAULT_LAYOUTS,
    NONE,
    ParamSpec,
    SaveOptions,
    dp_tp_layouts,
    full_layouts,
    load_job,
    local_slice,
    optimizer_specs,
    pipeline_layouts,
    plan_save,
    read_loaded,
    run_jobs,
    sparse_optimizer_layouts,
    spec_from_strategy,
    strategy_layouts,
)

ITERATION = 10
# A job whose layernorm is float32 while the checkpoint's is bfloat16 (MindSpore would cast it).
WRONG_DTYPE = {"decoder.layers.0.input_layernorm.weight": ParamSpec((8,), "float32", (NONE,), (2, 2))}
# The pipeline save's tensors (two stages of 4 ranks) loaded by a 4-rank job replicating them all.
PIPE_DST = {
    n: ParamSpec(s.shape, s.dtype, (NONE,) * len(s.shape) if s.shape else None, (2, 2))
    for n, s in {**pipeline_layouts(), **optimizer_specs(pipeline_layouts())}.items()
}
DST4 = {**dp_tp_layouts(2, 2), **optimizer_specs(dp_tp_layouts(2, 2))}
# A destination strategy (reshard writes it): 4 devices, the tensor maps counted from the right.
STRATEGY4 = {
    "embedding.word_embeddings.weight": ParamLayout((4,), (-1, 0)),
    "decoder.layers.0.linear_proj.weight": ParamLayout((2, 2), (1, 0)),
    "decoder.layers.0.linear_fc1.weight": ParamLayout((2, 2), ((0, 1), -1)),
    "decoder.layers.0.dp_split.weight": ParamLayout((4,), (-1, -1)),
    "decoder.layers.0.input_layernorm.weight": ParamLayout((4,), (0,)),
    "decoder.layers.0.mask": ParamLayout((2, 2), (0, 1)),
    "decoder.layers.0.position_ids": ParamLayout((4,), (-1,)),
}


def same(got: np.ndarray, want: np.ndarray) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


@pytest.fixture(scope="module")
def mf(tmp_path_factory: pytest.TempPathFactory, oracle: Any) -> dict[str, Any]:
    """Everything MindFormers does for this file, in one subprocess."""
    root = tmp_path_factory.mktemp("mf")
    work = root / "work"
    work.mkdir()
    save8, full8 = plan_save(root / "cp2-8", DEFAULT_LAYOUTS, work, SaveOptions(ranks=8, iteration=ITERATION))
    save1, full1 = plan_save(root / "cp2-1", full_layouts(DEFAULT_LAYOUTS), work, SaveOptions(ranks=1, seed=1))
    balanced, full_b = plan_save(
        root / "cp2-b", sparse_optimizer_layouts(), work, SaveOptions(ranks=8, seed=2, remove_redundancy=True)
    )
    pipeline, full_p = plan_save(root / "cp2-p", pipeline_layouts(), work, SaveOptions(ranks=8, seed=3, pipeline=True))
    strategy = root / "dst_strategy.ckpt"
    write_strategy(strategy, make_strategy(STRATEGY4))
    tensors = {n: (a.shape, "bfloat16" if a.dtype == ml_dtypes.bfloat16 else str(a.dtype)) for n, a in full8.items()}
    dst_strategy = strategy_layouts(strategy, tensors)
    loads = {
        **{("8to4", r): load_job(root / "cp2-8", DST4, r, 4, work / f"8to4_{r}.npz") for r in range(4)},
        **{("8toS", r): load_job(root / "cp2-8", dst_strategy, r, 4, work / f"8toS_{r}.npz") for r in range(4)},
        ("1to1", 0): load_job(root / "cp2-1", {**full_layouts(DST4)}, 0, 1, work / "1to1.npz"),
        ("1to4", 2): load_job(root / "cp2-1", DST4, 2, 4, work / "1to4.npz"),
        ("8to1", 0): load_job(root / "cp2-8" / "iteration_00000010", full_layouts(DST4), 0, 1, work / "8to1.npz"),
        **{("bto4", r): load_job(root / "cp2-b", _only(DST4, full_b), r, 4, work / f"bto4_{r}.npz") for r in range(4)},
        **{("pto4", r): load_job(root / "cp2-p", PIPE_DST, r, 4, work / f"pto4_{r}.npz") for r in (0, 3)},
        ("wrong", 0): load_job(root / "cp2-8", WRONG_DTYPE, 0, 4, work / "wrong.npz"),
    }
    saves = [save8, save1, balanced, pipeline]
    results = run_jobs([*saves, *loads.values()])
    outcome = dict(zip(loads, results[len(saves) :], strict=True))
    wrong = outcome.pop(("wrong", 0))
    loaded = {key: read_loaded(Path(loads[key]["out"]), res) for key, res in outcome.items()}
    fulls = {"8": full8, "1": full1, "b": full_b, "p": full_p}
    return {"root": root, "full8": full8, "full1": full1, "fulls": fulls, "loaded": loaded, "wrong": wrong}


def _only(specs: dict[str, ParamSpec], full: dict[str, np.ndarray]) -> dict[str, ParamSpec]:
    return {n: s for n, s in specs.items() if n in full}


pytestmark = pytest.mark.oracle


def test_mindformers_loads_its_8_ranks_into_4_ranks(mf: dict[str, Any]) -> None:
    for rank in range(4):
        got = mf["loaded"][("8to4", rank)]
        assert set(got) == set(DST4)
        for name, spec in DST4.items():
            assert same(got[name], local_slice(mf["full8"][name], spec, rank, 4)), (rank, name)


def test_mindformers_loads_into_a_strategy_files_layout(mf: dict[str, Any]) -> None:
    """The strategy's layouts (converted to MindSpore Layouts) equal reshard's own rank boxes."""
    for rank in range(4):
        got = mf["loaded"][("8toS", rank)]
        for name, layout in STRATEGY4.items():
            full = mf["full8"][name]
            box = rank_box(layout, full.shape, rank)
            assert same(got[name], full[tuple(slice(a, b) for a, b in box)]), (rank, name)
            for state in ("adam_m.", "adam_v."):
                if state + name in got:
                    moment = mf["full8"][state + name]
                    assert same(got[state + name], moment[tuple(slice(a, b) for a, b in box)])
        assert same(got["global_step"], np.array([ITERATION], np.int32))


def test_single_card_round_trip(mf: dict[str, Any]) -> None:
    full = mf["full1"]
    got = mf["loaded"][("1to1", 0)]
    assert set(got) == set(full)
    for name in full:
        assert same(got[name], full[name]), name
    quarter = mf["loaded"][("1to4", 2)]
    for name, spec in DST4.items():
        assert same(quarter[name], local_slice(full[name], spec, 2, 4)), name


def test_8_ranks_load_onto_one_card(mf: dict[str, Any]) -> None:
    got = mf["loaded"][("8to1", 0)]
    for name, want in mf["full8"].items():
        assert same(got[name], want), name


def test_balanced_save_loads_back(mf: dict[str, Any]) -> None:
    full = mf["fulls"]["b"]
    for rank in range(4):
        for name, spec in _only(DST4, full).items():
            assert same(mf["loaded"][("bto4", rank)][name], local_slice(full[name], spec, rank, 4)), (rank, name)
    iteration = mf["root"] / "cp2-b" / "iteration_00000010"
    opt_files = sorted(p.name for p in iteration.glob("opt-*"))
    assert opt_files == [f"opt-{k:07d}-0000004.safetensors" for k in range(4)]  # 4 optimizer slices, 4 files
    meta = json.loads((iteration / "metadata.json").read_text())
    assert all(len(records) == 1 for records in meta["storage_data"].values())


def test_pipeline_save_loads_back(mf: dict[str, Any]) -> None:
    full = mf["fulls"]["p"]
    for rank in (0, 3):
        for name in PIPE_DST:
            assert same(mf["loaded"][("pto4", rank)][name], full[name]), (rank, name)
    meta = json.loads((mf["root"] / "cp2-p" / "iteration_00000010" / "metadata.json").read_text())
    layout = meta["state_dict_metadata"]["decoder.final_layernorm.weight"]["layout"]
    assert layout["rank_list"] == [4, 5, 6, 7]


def test_a_load_that_mindformers_would_cast_fails(mf: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match=r"input_layernorm\.weight: MindFormers resharded"):
        read_loaded(tmp_path / "unused.npz", mf["wrong"])


def test_8_rank_tree_as_mindformers_writes_it(mf: dict[str, Any]) -> None:
    root: Path = mf["root"] / "cp2-8"
    iteration = root / "iteration_00000010"
    assert (root / "latest_checkpointed_iteration.txt").read_bytes() == b"10"
    names = sorted(p.name for p in iteration.iterdir())
    ranks = [f"{r:07d}-0000008.safetensors" for r in range(8)]
    assert names == sorted(
        ["common.json", "metadata.json"] + [f"model-{r}" for r in ranks] + [f"opt-{r}" for r in ranks]
    )
    assert stat.S_IMODE(iteration.stat().st_mode) == 0o750
    assert stat.S_IMODE((iteration / "model-0000000-0000008.safetensors").stat().st_mode) == 0o400
    assert stat.S_IMODE((iteration / "metadata.json").stat().st_mode) == 0o640
    common = json.loads((iteration / "common.json").read_text())
    assert list(common) == ["epoch_num", "step_num", "global_step", "loss_scale", "global_batch_size",
                            "consumed_samples", "ckpt_status"]  # fmt: skip
    model = read_safetensors(iteration / "model-0000005-0000008.safetensors")
    assert model.metadata == {"format": "ms"}
    assert set(model.entries) == set(DEFAULT_LAYOUTS)
    opt = read_safetensors(iteration / "opt-0000005-0000008.safetensors")
    assert set(opt.entries) == set(optimizer_specs(DEFAULT_LAYOUTS))


def test_8_rank_metadata_as_mindformers_writes_it(mf: dict[str, Any]) -> None:
    meta = json.loads((mf["root"] / "cp2-8" / "iteration_00000010" / "metadata.json").read_text())
    assert list(meta) == ["state_dict_metadata", "storage_data"]
    tensors = meta["state_dict_metadata"]
    assert list(tensors) == list(DEFAULT_LAYOUTS) + list(optimizer_specs(DEFAULT_LAYOUTS))
    fc1 = tensors["decoder.layers.0.linear_fc1.weight"]
    assert fc1["layout"] == {"device_matrix": [2, 4], "tensor_map": [[1, 0], -1], "interleaved_parallel": False,
                             "alias_name": ["dp", "tp"], "rank_list": list(range(8))}  # fmt: skip
    assert fc1["axis_fragmentations"] == [8, 1]
    assert [c["global_offset"] for c in fc1["chunk"]] == [[i] for i in range(8)]
    emb = tensors["embedding.word_embeddings.weight"]
    assert emb["properties"] == {"dtype": "Float32", "replica_id": [0, 0, 0, 0, 1, 1, 1, 1],
                                 "allow_shape_mismatch": False, "allow_to_save": True}  # fmt: skip
    dtypes = {n: t["properties"]["dtype"] for n, t in tensors.items()}
    assert dtypes["decoder.layers.0.input_layernorm.weight"] == "BFloat16"
    assert dtypes["adam_m.decoder.layers.0.input_layernorm.weight"] == "Float32"
    assert dtypes["decoder.layers.0.mask"] == "Bool"
    assert dtypes["decoder.layers.0.position_ids"] == "Int32"
    assert tensors["global_step"]["layout"] is None
    assert tensors["learning_rate"]["global_shape"] == []
    records = meta["storage_data"]["('embedding.word_embeddings.weight', (1,))"]
    assert records == [
        {"file_name": "model-0000001-0000008.safetensors", "storage_rank": 1, "rank_group": [1, 5]},
        {"file_name": "model-0000005-0000008.safetensors", "storage_rank": 5, "rank_group": [1, 5]},
    ]
    assert meta["storage_data"]["('adam_v.decoder.layers.0.dp_split.weight', (1,))"][0] == {
        "file_name": "opt-0000004-0000008.safetensors", "storage_rank": 4, "rank_group": [4, 5, 6, 7]}  # fmt: skip


def test_single_card_tree_has_no_metadata(mf: dict[str, Any]) -> None:
    iteration = mf["root"] / "cp2-1" / "iteration_00000010"
    assert sorted(p.name for p in iteration.iterdir()) == [
        "common.json", "model-0000000-0000001.safetensors", "opt-0000000-0000001.safetensors"]  # fmt: skip


# Host-side pieces (no MindFormers)


@pytest.mark.parametrize(
    ("layout", "shape"),
    [
        (ParamLayout((2, 4), (0, -1)), (16, 8)),
        (ParamLayout((2, 4), (-1, 1)), (8, 6)),
        (ParamLayout((2, 4), ((1, 0), -1)), (16, 8)),
        (ParamLayout((2, 4), ((0, 1), -1)), (16, 8)),
        (ParamLayout((2, 2, 2), (2, -1, 0)), (4, 3, 6)),
        (ParamLayout((8,), (-1,)), (5,)),
    ],
)
def test_strategy_layout_conversion_matches_reshards_boxes(layout: ParamLayout, shape: tuple[int, ...]) -> None:
    full = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    spec = spec_from_strategy(layout.dev_matrix, layout.tensor_map, shape, "int32")
    for rank in range(int(np.prod(layout.dev_matrix))):
        box = rank_box(layout, shape, rank)
        assert same(
            local_slice(full, spec, rank, int(np.prod(layout.dev_matrix))), full[tuple(slice(a, b) for a, b in box)]
        )


def test_spec_from_strategy_names_axes_from_the_left() -> None:
    spec = spec_from_strategy((2, 4), ((1, 0), -1), (16, 8), "float32")
    assert spec == ParamSpec((16, 8), "float32", (("a0", "a1"), NONE), (2, 4), ("a0", "a1"))
    assert spec_from_strategy((2, 4), (), (), "float32").tensor_map is None  # MindFormers needs no layout for 0-d
