"""transform --output-format checkpoint2: the tree, metadata.json, tensors, pipeline, optimizer shards."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest

from reshard import api
from reshard.layout.slices import model_parallel
from tests.cp2_write_helpers import (
    DEV,
    DP,
    EMB,
    FC1,
    NORM,
    POS,
    PROJ,
    block,
    full_tensors,
    layouts,
    metadata,
    read_dir,
    with_states,
    write_job,
)

IT = "iteration_00000012"


def _write(tmp_path: Any, **kwargs: Any) -> tuple[str, dict[str, str]]:
    job = write_job(str(tmp_path / "job"), **{k: kwargs.pop(k) for k in ("stages", "optimizer") if k in kwargs})
    out = str(tmp_path / "out")
    output = api.OutputSpec(format="checkpoint2", iteration=12, **kwargs)  # common, prefix, optimizer_prefixes
    api.transform(job["full"], out, None, job["strategy"], output=output)
    return out, job


def test_tree_files_and_order_of_texts(tmp_path: Any) -> None:
    out, job = _write(tmp_path)
    names = sorted(os.listdir(os.path.join(out, IT)))
    models = [f"model-{r:07d}-0000008.safetensors" for r in range(8)]
    opts = [f"opt-{r:07d}-0000008.safetensors" for r in range(8)]
    assert names == sorted(["common.json", "metadata.json", *models, *opts])
    with open(os.path.join(out, "latest_checkpointed_iteration.txt"), encoding="utf-8") as fh:
        assert fh.read() == "12"  # no newline, as MindFormers writes it
    plan = api.transform(
        job["full"],
        out + "2",
        None,
        job["strategy"],
        output=api.OutputSpec(format="checkpoint2"),
        destination=api.Destination(dry_run=True),
    ).plan
    assert [os.path.basename(t.path) for t in plan.texts] == [
        "metadata.json",
        "common.json",
        "latest_checkpointed_iteration.txt",
    ]
    assert all(f.format == "safetensors" and dict(f.metadata) == {"format": "ms"} for f in plan.files)


def test_model_and_optimizer_split_by_name(tmp_path: Any) -> None:
    out, _ = _write(tmp_path)
    files = read_dir(os.path.join(out, IT))
    model = set(files["model-0000003-0000008.safetensors"])
    opt = set(files["opt-0000003-0000008.safetensors"])
    assert model == {EMB, PROJ, FC1, DP, NORM, POS}
    assert opt == {f"{p}{n}" for p in ("adam_m.", "adam_v.") for n in (EMB, PROJ, FC1, DP, NORM)} | {
        "global_step",
        "learning_rate",
    }


def test_weights_only_has_no_opt_files(tmp_path: Any) -> None:
    out, _ = _write(tmp_path, optimizer=False)
    assert not [n for n in os.listdir(os.path.join(out, IT)) if n.startswith("opt-")]


def test_tensors_equal_numpy_slices(tmp_path: Any) -> None:
    out, _ = _write(tmp_path)
    full = full_tensors()
    lays = with_states(layouts())
    files = read_dir(os.path.join(out, IT))
    for rank in range(8):
        held = {**files[f"model-{rank:07d}-0000008.safetensors"], **files[f"opt-{rank:07d}-0000008.safetensors"]}
        for name, array in held.items():
            expected = block(full[name], lays.get(name), rank)
            assert array.dtype == expected.dtype and np.array_equal(array, expected), (rank, name)


def test_metadata_json_exact(tmp_path: Any) -> None:
    out, _ = _write(tmp_path, optimizer=False)
    with open(os.path.join(out, IT, "metadata.json"), encoding="utf-8") as fh:
        text = fh.read()
    meta = json.loads(text)
    assert text == json.dumps(meta, ensure_ascii=False, separators=(",", ":"))  # compact, as MindFormers writes it
    assert list(meta) == ["state_dict_metadata", "storage_data"]
    sd = meta["state_dict_metadata"]
    assert list(sd) == [EMB, PROJ, FC1, DP, NORM, POS]
    layout = {"device_matrix": [2, 4], "interleaved_parallel": False, "alias_name": ["axis1", "axis0"]}
    ranks = list(range(8))

    def lay(tmap: list[Any]) -> dict[str, Any]:
        # key order matters: MindFormers unpacks .values()
        return {
            "device_matrix": [2, 4],
            "tensor_map": tmap,
            "interleaved_parallel": False,
            "alias_name": ["axis1", "axis0"],
            "rank_list": ranks,
        }

    props = {"allow_shape_mismatch": False, "allow_to_save": True}
    assert sd[EMB] == {
        "properties": {"dtype": "Float32", "replica_id": [0, 0, 0, 0, 1, 1, 1, 1], **props},
        "global_shape": [16, 8],
        "axis_fragmentations": [4, 1],
        "layout": lay([0, -1]),
        "chunk": [{"global_offset": [i], "local_shape": [4, 8]} for i in range(4)],
    }
    assert list(sd[EMB]["layout"]) == ["device_matrix", "tensor_map", "interleaved_parallel", "alias_name", "rank_list"]
    assert list(sd[EMB]["properties"]) == ["dtype", "replica_id", "allow_shape_mismatch", "allow_to_save"]
    assert sd[FC1] == {  # a dimension split over both axes: a nested tensor map, dp the major axis
        "properties": {"dtype": "Float32", "replica_id": [0] * 8, **props},
        "global_shape": [16, 8],
        "axis_fragmentations": [8, 1],
        "layout": lay([[1, 0], -1]),
        "chunk": [{"global_offset": [i], "local_shape": [2, 8]} for i in range(8)],
    }
    assert sd[NORM] == {  # replicated bf16
        "properties": {"dtype": "BFloat16", "replica_id": list(range(8)), **props},
        "global_shape": [8],
        "axis_fragmentations": [1],
        "layout": lay([-1]),
        "chunk": [{"global_offset": [0], "local_shape": [8]}],
    }
    assert sd[DP]["axis_fragmentations"] == [2, 1] and sd[DP]["properties"]["replica_id"] == [0, 1, 2, 3] * 2
    assert [c["global_offset"] for c in sd[DP]["chunk"]] == [[0], [1]]
    assert sd[POS] == {  # in no strategy: a full tensor on every rank
        "properties": {"dtype": "Int32", "replica_id": 0, **props},
        "global_shape": [8],
        "axis_fragmentations": [1],
        "layout": None,
        "chunk": [{"global_offset": [0], "local_shape": [8]}],
    }
    assert layout.items() <= sd[PROJ]["layout"].items()
    st = meta["storage_data"]
    model = "model-{:07d}-0000008.safetensors".format
    assert st[f"('{EMB}', (1,))"] == [
        {"file_name": model(1), "storage_rank": 1, "rank_group": [1, 5]},
        {"file_name": model(5), "storage_rank": 5, "rank_group": [1, 5]},
    ]
    assert st[f"('{FC1}', (6,))"] == [{"file_name": model(6), "storage_rank": 6, "rank_group": [6]}]
    assert st[f"('{NORM}', (0,))"] == [{"file_name": model(r), "storage_rank": r, "rank_group": ranks} for r in ranks]
    assert st[f"('{DP}', (1,))"][0] == {"file_name": model(4), "storage_rank": 4, "rank_group": [4, 5, 6, 7]}
    # keys in first-appearance order over ranks: rank 0's slices, then rank 1's new ones ...
    assert list(st)[:6] == [f"('{n}', (0,))" for n in (EMB, PROJ, FC1, DP, NORM, POS)]
    assert list(st)[6:9] == [f"('{EMB}', (1,))", f"('{PROJ}', (1,))", f"('{FC1}', (1,))"]


def test_optimizer_states_in_opt_files_in_metadata(tmp_path: Any) -> None:
    out, _ = _write(tmp_path)
    meta = metadata(os.path.join(out, IT))
    st = meta["storage_data"]
    assert st[f"('adam_m.{EMB}', (2,))"][0]["file_name"] == "opt-0000002-0000008.safetensors"
    assert meta["state_dict_metadata"]["global_step"]["layout"] is None
    assert st["('global_step', (0,))"][7] == {
        "file_name": "opt-0000007-0000008.safetensors",
        "storage_rank": 7,
        "rank_group": list(range(8)),
    }


def test_common_json(tmp_path: Any) -> None:
    out, _ = _write(tmp_path, common={"global_step": 12, "loss_scale": 1024.0, "ckpt_status": 0})
    with open(os.path.join(out, IT, "common.json"), encoding="utf-8") as fh:
        text = fh.read()
    assert text == json.dumps(
        {
            "epoch_num": None,
            "step_num": None,
            "global_step": 12,
            "loss_scale": 1024.0,
            "global_batch_size": None,
            "consumed_samples": None,
            "ckpt_status": 0,
        },
        indent=4,
    )


def test_prefix_is_mindformers_user_prefix(tmp_path: Any) -> None:
    out, _ = _write(tmp_path, prefix="llama")
    names = os.listdir(os.path.join(out, IT))
    assert "llama-model-0000000-0000008.safetensors" in names and "llama-opt-0000007-0000008.safetensors" in names
    st = metadata(os.path.join(out, IT))["storage_data"]
    assert st[f"('{EMB}', (0,))"][0]["file_name"] == "llama-model-0000000-0000008.safetensors"


def test_extra_optimizer_prefix(tmp_path: Any) -> None:
    out, _ = _write(tmp_path, optimizer=False, optimizer_prefixes=["decoder.layers.0.position"])
    files = read_dir(os.path.join(out, IT))
    assert set(files["opt-0000000-0000008.safetensors"]) == {POS}
    assert POS not in files["model-0000000-0000008.safetensors"]


def test_single_card_form(tmp_path: Any) -> None:
    job = write_job(str(tmp_path / "job"))
    out = str(tmp_path / "out")
    api.transform(job["full"], out, None, None, output=api.OutputSpec(format="checkpoint2"))
    folder = os.path.join(out, "iteration_00000000")  # the documented default iteration
    assert sorted(os.listdir(folder)) == [
        "common.json",
        "model-0000000-0000001.safetensors",
        "opt-0000000-0000001.safetensors",
    ]
    files = read_dir(folder)
    full = full_tensors()
    for name, array in {
        **files["model-0000000-0000001.safetensors"],
        **files["opt-0000000-0000001.safetensors"],
    }.items():
        assert np.array_equal(array, full[name])


def test_two_stage_pipeline_with_tied_embedding(tmp_path: Any) -> None:
    dev = (1, 2)
    lay = layouts(dev)
    stage0 = {EMB: lay[EMB], PROJ: lay[PROJ], NORM: lay[NORM]}
    stage1 = {FC1: lay[FC1], DP: lay[DP], EMB: lay[EMB]}  # the embedding is tied to the last stage
    out, _ = _write(tmp_path, stages=[stage0, stage1], optimizer=False)
    folder = os.path.join(out, IT)
    files = read_dir(folder)
    assert set(files) == {f"model-{r:07d}-0000004.safetensors" for r in range(4)}
    assert set(files["model-0000000-0000004.safetensors"]) == {EMB, PROJ, NORM, POS}
    assert set(files["model-0000002-0000004.safetensors"]) == {FC1, DP, POS}  # the tied copy is written once
    sd = metadata(folder)["state_dict_metadata"]
    assert sd[EMB]["layout"]["rank_list"] == [0, 1]
    assert sd[FC1]["layout"]["rank_list"] == [2, 3]
    st = metadata(folder)["storage_data"]
    assert st[f"('{FC1}', (1,))"] == [
        {"file_name": "model-0000003-0000004.safetensors", "storage_rank": 3, "rank_group": [3]}
    ]
    assert [r["storage_rank"] for r in st[f"('{POS}', (0,))"]] == [0, 1, 2, 3]
    full = full_tensors(False)
    assert np.array_equal(files["model-0000003-0000004.safetensors"][FC1], block(full[FC1], lay[FC1], 1))


def test_optimizer_shard_is_dropped(tmp_path: Any) -> None:
    lays = with_states(layouts(opt=True))
    job = write_job(str(tmp_path / "job"), stages=[lays])
    out = str(tmp_path / "out")
    report = api.transform(
        job["full"], out, None, job["strategy"], output=api.OutputSpec(format="checkpoint2", iteration=12)
    )
    assert any("model-parallel slice" in n for n in report.notes)
    files = read_dir(os.path.join(out, IT))
    full = full_tensors()
    for rank in (0, 5):
        got = files[f"model-{rank:07d}-0000008.safetensors"][EMB]
        assert np.array_equal(got, block(full[EMB], model_parallel(lays[EMB]), rank))
        assert got.shape == (4, 8)  # the model-parallel slice, not the optimizer shard (2, 8)
    sd = metadata(os.path.join(out, IT))["state_dict_metadata"]
    assert sd[EMB]["axis_fragmentations"] == [4, 1] and sd[f"adam_v.{EMB}"]["chunk"][0]["local_shape"] == [4, 8]


def test_from_rank_folders_with_strategy(tmp_path: Any) -> None:
    """rank folders + strategy (8 ranks) -> Checkpoint 2.0 on 4 ranks (another layout)."""
    job = write_job(str(tmp_path / "job"))
    ranks8 = str(tmp_path / "ranks8")
    api.transform(job["full"], ranks8, None, job["strategy"], output=api.OutputSpec(format="safetensors"))
    job4 = write_job(str(tmp_path / "job4"), stages=[with_states(layouts((2, 2)))])
    out = str(tmp_path / "out")
    api.transform(
        ranks8, out, job["strategy"], job4["strategy"], output=api.OutputSpec(format="checkpoint2", iteration=12)
    )
    files = read_dir(os.path.join(out, IT))
    full, lays = full_tensors(), with_states(layouts((2, 2)))
    for rank in range(4):
        for name, array in files[f"opt-{rank:07d}-0000004.safetensors"].items():
            assert np.array_equal(array, block(full[name], lays.get(name), rank))
    assert metadata(os.path.join(out, IT))["state_dict_metadata"][EMB]["layout"]["device_matrix"] == [2, 2]


def test_dev_matrix_is_kept_as_the_strategy_says() -> None:
    assert layouts()[EMB].dev_matrix == DEV


@pytest.mark.parametrize("hf_source", [True])
def test_from_hugging_face_folder(tmp_path: Any, hf_source: bool) -> None:
    job = write_job(str(tmp_path / "job"), optimizer=False)
    hf = str(tmp_path / "hf")
    api.convert(job["full"], hf, api.OutputSpec(format="hf", max_shard_size="300B"))
    assert "model.safetensors.index.json" in os.listdir(hf)
    out = str(tmp_path / "out")
    api.transform(hf, out, None, job["strategy"], output=api.OutputSpec(format="checkpoint2", iteration=12))
    files = read_dir(os.path.join(out, IT))
    full, lays = full_tensors(False), layouts()
    for rank in range(8):
        for name, array in files[f"model-{rank:07d}-0000008.safetensors"].items():
            assert np.array_equal(array, block(full[name], lays.get(name), rank))
    assert metadata(os.path.join(out, IT))["state_dict_metadata"][EMB]["layout"]["rank_list"] == list(range(8))


def test_from_a_unify_output(tmp_path: Any) -> None:
    """``unify --hf`` output (the unify output transform reads) -> Checkpoint 2.0."""
    job = write_job(str(tmp_path / "job"))
    ranks8 = str(tmp_path / "ranks8")
    api.transform(job["full"], ranks8, None, job["strategy"], output=api.OutputSpec(format="safetensors"))
    unified = str(tmp_path / "unified")
    api.unify(ranks8, job["strategy"], unified, output=api.OutputSpec(format="hf", max_shard_size="2KB"))
    out = str(tmp_path / "out")
    api.transform(unified, out, None, job["strategy"], output=api.OutputSpec(format="checkpoint2", iteration=12))
    files = read_dir(os.path.join(out, IT))
    full, lays = full_tensors(), with_states(layouts())
    seen = set()
    for rank in range(8):
        for kind in ("model", "opt"):
            for name, array in files[f"{kind}-{rank:07d}-0000008.safetensors"].items():
                assert np.array_equal(array, block(full[name], lays.get(name), rank)), (rank, name)
                seen.add(name)
    assert seen == set(full)


def test_states_missing_from_the_destination_strategy_take_their_parameters_layout(tmp_path: Any) -> None:
    """An inference strategy (no adam_m./adam_v. entries): the states are laid out like their parameter."""
    job = write_job(str(tmp_path / "job"))  # the 8-rank strategy has the states
    ranks8 = str(tmp_path / "ranks8")
    api.transform(job["full"], ranks8, None, job["strategy"], output=api.OutputSpec(format="safetensors"))
    bare = write_job(str(tmp_path / "bare"), stages=[layouts((2, 2))], optimizer=False)["strategy"]
    out = str(tmp_path / "out")
    report = api.transform(
        ranks8, out, job["strategy"], bare, output=api.OutputSpec(format="checkpoint2", iteration=12)
    )
    assert any("training state" in n and "parameter's" in n for n in report.notes), report.notes
    files = read_dir(os.path.join(out, IT))
    full, lays = full_tensors(), with_states(layouts((2, 2)))
    for rank in range(4):
        for name, array in files[f"opt-{rank:07d}-0000004.safetensors"].items():
            assert np.array_equal(array, block(full[name], lays.get(name), rank)), (rank, name)
    sd = metadata(os.path.join(out, IT))["state_dict_metadata"]
    assert sd[f"adam_m.{EMB}"]["layout"] == sd[EMB]["layout"] and sd["global_step"]["layout"] is None


def test_a_split_weight_without_destination_layout_is_refused(tmp_path: Any) -> None:
    from reshard.errors import UnsupportedError

    job = write_job(str(tmp_path / "job"), optimizer=False)
    ranks8 = str(tmp_path / "ranks8")
    api.transform(job["full"], ranks8, None, job["strategy"], output=api.OutputSpec(format="safetensors"))
    partial = {n: p for n, p in layouts().items() if n != PROJ}
    other = write_job(str(tmp_path / "other"), stages=[partial], optimizer=False)["strategy"]
    out = str(tmp_path / "out")
    with pytest.raises(UnsupportedError, match="split by the source strategy"):
        api.transform(ranks8, out, job["strategy"], other, output=api.OutputSpec(format="checkpoint2"))
    assert not os.path.exists(out)
