"""Reading MindFormers Checkpoint 2.0 everywhere reshard takes a source: results against numpy slicing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from reshard import api
from reshard.formats.safetensors import read_safetensors
from reshard.formats.strategy import make_strategy, write_strategy
from reshard.layout import ParamLayout
from reshard.sources import CHECKPOINT2, ReadOptions, identify, open_source
from tests import checkpoint2_fixtures as fx
from tests.trust_helpers import run_cli, snapshot


def _rank_file(root: Path, rank: int) -> dict[str, np.ndarray]:
    index = read_safetensors(str(root / f"rank_{rank}" / f"checkpoint_{rank}.safetensors"))
    return {name: index.array(name).copy() for name in index.entries}


def _row_split_strategy(full: dict[str, np.ndarray], n: int) -> tuple[object, dict[str, ParamLayout]]:
    layouts = {
        name: ParamLayout((n,), ((0,) if a.shape and a.shape[0] % n == 0 else (-1,)) + (-1,) * (a.ndim - 1))
        for name, a in full.items()
        if a.ndim
    }
    return make_strategy(layouts), layouts


def _expected_rows(a: np.ndarray, k: int, n: int) -> np.ndarray:
    return a[k * a.shape[0] // n : (k + 1) * a.shape[0] // n] if a.shape[0] % n == 0 else a


@pytest.fixture(scope="module")
def dp2tp4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    root = tmp_path_factory.mktemp("cp2") / "checkpoint"
    return root, fx.write_checkpoint2(str(root), fx.dp2_tp4_params(), 8)


def test_detected_as_checkpoint2_root_and_iteration_folder(dp2tp4: tuple[Path, dict]) -> None:
    root, _ = dp2tp4
    assert identify(str(root)) is CHECKPOINT2
    assert identify(str(root / "iteration_00000010")) is CHECKPOINT2
    opened = open_source(str(root))
    assert sorted(opened.ranks) == list(range(8))
    assert opened.strategy is not None and opened.strategy.path == str(root / "iteration_00000010" / "metadata.json")
    # a rank's slices live in its model- and opt- files
    homes = {os.path.basename(p) for p in opened.ranks[5].homes.values()}
    assert homes == {"model-0000005-0000008.safetensors", "opt-0000005-0000008.safetensors"}


def test_transform_to_full_equals_the_tensors(dp2tp4: tuple[Path, dict], tmp_path: Path) -> None:
    root, full = dp2tp4
    proc = run_cli("transform", "--src", str(root), "--dst", str(tmp_path / "full"), "--output-format", "safetensors")
    assert proc.returncode == 0, proc.stderr
    assert "using iteration_00000010 (latest_checkpointed_iteration.txt names it)" in proc.stderr
    got = _rank_file(tmp_path / "full", 0)
    assert sorted(got) == sorted(full)
    for name, a in full.items():
        assert got[name].dtype == a.dtype and np.array_equal(got[name], a), name


def test_transform_to_four_ranks_with_a_strategy(dp2tp4: tuple[Path, dict], tmp_path: Path) -> None:
    root, full = dp2tp4
    sf, _ = _row_split_strategy(full, 4)
    write_strategy(str(tmp_path / "s4.ckpt"), sf)  # type: ignore[arg-type]
    out = tmp_path / "r4"
    proc = run_cli(
        "transform", "--src", str(root / "iteration_00000010"), "--dst", str(out), "--dst-strategy",
        str(tmp_path / "s4.ckpt"), "--output-format", "ckpt",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    from reshard.formats.ckpt import read_ckpt

    for k in range(4):
        with read_ckpt(str(out / f"rank_{k}" / f"checkpoint_{k}.ckpt")) as index:
            for name, a in full.items():
                assert np.array_equal(index.array(name), _expected_rows(a, k, 4)), (k, name)


def test_unify_needs_no_strategy_and_gives_full_tensors(dp2tp4: tuple[Path, dict], tmp_path: Path) -> None:
    root, full = dp2tp4
    proc = run_cli("unify", str(root), str(tmp_path / "u"))
    assert proc.returncode == 0, proc.stderr
    _, mapping, hyper = api.unified_index(str(tmp_path / "u"))
    everything = {**mapping, **({n: "hyper" for n in hyper.tensors} if hyper else {})}
    assert sorted(everything) == sorted(full)
    for name, file in mapping.items():
        with read_safetensors(str(tmp_path / "u" / file)) as index:
            assert np.array_equal(index.array(name), full[name]), name
    # and the unify output verifies against the checkpoint
    proc = run_cli("verify", str(root), str(tmp_path / "u"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_verify_tells_a_changed_tensor(dp2tp4: tuple[Path, dict], tmp_path: Path) -> None:
    root, _ = dp2tp4
    other = tmp_path / "other"
    fx.write_checkpoint2(str(other), fx.dp2_tp4_params(), 8, seed=1)
    assert run_cli("verify", str(root), str(root / "iteration_00000010")).returncode == 0
    proc = run_cli("verify", str(root), str(other))
    assert proc.returncode == 1


def test_pipeline_stages_from_rank_lists(tmp_path: Path) -> None:
    root = tmp_path / "pp"
    full = fx.write_checkpoint2(str(root), fx.pipeline_params(), 8)
    opened = open_source(str(root))
    assert opened.strategy is not None
    assert {n.split("-", 1)[0] for n in opened.strategy.layouts} == {"0", "1"}
    assert "decoder.layers.1.mlp.linear_fc1.weight" not in opened.ranks[0].tensors
    api.transform(str(root), str(tmp_path / "full"), None, None, output=api.OutputSpec(format="safetensors"))
    got = _rank_file(tmp_path / "full", 0)
    for name, a in full.items():
        assert np.array_equal(got[name], a), name
    # to 2 ranks of one stage
    sf, _ = _row_split_strategy(full, 2)
    api.transform(str(root), str(tmp_path / "r2"), None, sf, output=api.OutputSpec(format="safetensors"))
    for k in range(2):
        got = _rank_file(tmp_path / "r2", k)
        for name, a in full.items():
            assert np.array_equal(got[name], _expected_rows(a, k, 2)), (k, name)


def test_redundancy_removed_save_found_through_storage_data(tmp_path: Path) -> None:
    root = tmp_path / "balanced"
    params = [p for p in fx.dp2_tp4_params() if "fc1" not in p.name]  # every slice held by two ranks
    full = fx.write_checkpoint2(str(root), params, 8, remove_redundancy=True)
    names = sorted(os.listdir(root / "iteration_00000010"))
    assert "model-0000000-0000004.safetensors" in names  # file numbers do not follow ranks
    opened = open_source(str(root))
    assert os.path.basename(opened.ranks[0].path_of("embedding.word_embeddings.weight")) == (
        "model-0000000-0000004.safetensors"
    )
    api.transform(str(root), str(tmp_path / "full"), None, None, output=api.OutputSpec(format="safetensors"))
    got = _rank_file(tmp_path / "full", 0)
    for name, a in full.items():
        assert np.array_equal(got[name], a), name


def test_single_card_is_a_full_model(tmp_path: Path) -> None:
    root = tmp_path / "one"
    full = fx.write_checkpoint2(str(root), fx.single_card_params(), 1)
    assert not os.path.exists(root / "iteration_00000010" / "metadata.json")
    opened = open_source(str(root))
    assert sorted(opened.weight_map) == sorted(full) and opened.strategy is None
    sf, _ = _row_split_strategy(full, 4)
    api.transform(str(root), str(tmp_path / "r4"), None, sf, output=api.OutputSpec(format="safetensors"))
    for k in range(4):
        got = _rank_file(tmp_path / "r4", k)
        for name, a in full.items():
            assert np.array_equal(got[name], _expected_rows(a, k, 4)), (k, name)
    api.unify(str(root), None, str(tmp_path / "u"))
    assert run_cli("verify", str(root), str(tmp_path / "u")).returncode == 0
    assert run_cli("verify", str(root), str(tmp_path / "r4"), "--b-strategy", "x").returncode == 2


def test_iteration_flags_pick_another_iteration(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    first = fx.write_checkpoint2(str(root), fx.single_card_params(), 1, iteration=5, seed=3)
    fx.write_checkpoint2(str(root), fx.single_card_params(), 1, iteration=10, seed=4)
    proc = run_cli(
        "transform", "--src", str(root), "--src-iteration", "5", "--dst", str(tmp_path / "o"),
        "--output-format", "safetensors",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    got = _rank_file(tmp_path / "o", 0)
    assert all(np.array_equal(got[n], a) for n, a in first.items())
    proc = run_cli("inspect", str(root), "--src-iteration", "5", "--json")
    assert json.loads(proc.stdout)["iteration_folder"].endswith("iteration_00000005")
    opened = open_source(str(root), options=ReadOptions(iteration=5))
    assert "iteration_00000005" in next(iter(opened.files.values())).path


def test_inspect_shows_layouts_dtypes_files_and_common(dp2tp4: tuple[Path, dict]) -> None:
    root, _ = dp2tp4
    proc = run_cli("inspect", str(root), "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["kind"] == "checkpoint2" and info["ranks"] == 8
    rows = {r["name"]: r for r in info["tensors"]}
    fc1 = rows["decoder.layers.0.mlp.linear_fc1.weight"]
    assert fc1["shape"] == [32, 6] and fc1["layout"]["tensor_map"] == [[1, 0], -1] and fc1["chunks"] == 8
    assert rows["decoder.layers.0.input_layernorm.weight"]["dtype"] == "BFloat16"
    assert rows["global_step"]["layout"] is None
    assert info["common"] == fx.COMMON
    assert len(info["files"]) == 16
    text = run_cli("inspect", str(root))
    assert text.returncode == 0 and "common.json: epoch_num=1" in text.stdout


def test_ranks_read_only_the_files_they_need(dp2tp4: tuple[Path, dict], tmp_path: Path) -> None:
    root, full = dp2tp4
    layouts = {n: ParamLayout((2, 4), (1,) + (-1,) * (a.ndim - 1)) for n, a in full.items() if a.shape[0] % 2 == 0}
    write_strategy(str(tmp_path / "s.ckpt"), make_strategy(layouts))
    # dp2 x tp4 -> row split in 2: rank 0 holds rows of the first half only
    report = api.transform(
        str(root),
        str(tmp_path / "o"),
        None,
        str(tmp_path / "s.ckpt"),
        ranks=[0],
        output=api.OutputSpec(format="safetensors"),
    )
    read = {os.path.basename(p) for p in report.plan.sources}
    assert read and len(read) < 16
    proc = run_cli("rank-list", "0", "--src", str(root), "--dst-strategy", str(tmp_path / "s.ckpt"), "--files")
    assert proc.returncode == 0, proc.stderr
    texts = {"metadata.json", "common.json", "latest_checkpointed_iteration.txt"}  # read beside the tensor files
    assert {os.path.basename(p) for p in proc.stdout.split()} == read | texts
    proc = run_cli("rank-list", "0", "--src", str(root), "--dst-strategy", str(tmp_path / "s.ckpt"))
    assert proc.returncode == 0, proc.stderr
    ranks = [int(r) for r in proc.stdout.split()]
    assert ranks and all(0 <= r < 8 for r in ranks)
    got = _rank_file(tmp_path / "o", 0)
    for name, a in full.items():
        exp = a[: a.shape[0] // 2] if name in layouts else a
        assert np.array_equal(got[name], exp), name


def test_optimizer_state_missing_from_metadata_takes_its_parameters_layout(tmp_path: Path) -> None:
    """As MindFormers' complete_optimizer_sharded_tensor: adam_v.<w> in the rank files, not in metadata.json."""
    root = tmp_path / "ck"
    params = fx.dp2_tp4_params()
    full = fx.write_checkpoint2(str(root), params, 8)
    meta_path = root / "iteration_00000010" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    del meta["state_dict_metadata"]["adam_v.decoder.layers.0.mlp.linear_fc1.weight"]
    meta["storage_data"] = {k: v for k, v in meta["storage_data"].items() if "adam_v." not in k}
    meta_path.write_text(json.dumps(meta, separators=(",", ":")))
    notes: list[str] = []
    opened = open_source(str(root), notes=notes)
    assert opened.strategy is not None and "adam_v.decoder.layers.0.mlp.linear_fc1.weight" in opened.strategy.layouts
    assert any("not listed" in n for n in notes)
    api.transform(str(root), str(tmp_path / "full"), None, None, output=api.OutputSpec(format="safetensors"))
    got = _rank_file(tmp_path / "full", 0)
    name = "adam_v.decoder.layers.0.mlp.linear_fc1.weight"
    assert np.array_equal(got[name], full[name])


def test_convert_is_refused_with_the_way_forward(dp2tp4: tuple[Path, dict], tmp_path: Path) -> None:
    root, _ = dp2tp4
    before = snapshot(str(root))
    proc = run_cli("convert", str(root), str(tmp_path / "c"), "--to", "ckpt")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "reshard transform" in proc.stderr
    assert not (tmp_path / "c").exists() and snapshot(str(root)) == before


def test_plain_rank_folders_plan_unchanged(tmp_path: Path) -> None:
    """A plain SourceFile has no homes: every copy reads its own path."""
    from tests.trust_helpers import make_job

    job = make_job(str(tmp_path / "job"))
    report = api.transform(
        job["r8"], str(tmp_path / "o"), job["s8"], job["s4"], destination=api.Destination(dry_run=True)
    )
    assert all(p.startswith(job["r8"]) and os.path.isfile(p) for p in report.plan.sources)


def test_split_and_hugging_face_export(dp2tp4: tuple[Path, dict], tmp_path: Path) -> None:
    root, full = dp2tp4
    proc = run_cli("transform", "--src", str(root), "--dst", str(tmp_path / "hf"), "--hf", "--keep-training-state")
    assert proc.returncode == 0, proc.stderr
    with read_safetensors(str(tmp_path / "hf" / "model.safetensors")) as index:
        assert all(np.array_equal(index.array(n), a) for n, a in full.items())
    # split takes a single card as a full model; several ranks are refused with the way forward
    one = tmp_path / "one"
    single = fx.write_checkpoint2(str(one), fx.single_card_params(), 1)
    sf, _ = _row_split_strategy(single, 2)
    write_strategy(str(tmp_path / "s2.ckpt"), sf)  # type: ignore[arg-type]
    proc = run_cli("split", str(one), str(tmp_path / "split"), "--dst-strategy", str(tmp_path / "s2.ckpt"))
    assert proc.returncode == 0, proc.stderr
    for k in range(2):
        got = _rank_file_named(tmp_path / "split" / f"rank_{k}")
        assert all(np.array_equal(got[n], _expected_rows(a, k, 2)) for n, a in single.items())
    proc = run_cli("split", str(root), str(tmp_path / "split8"), "--dst-strategy", str(tmp_path / "s2.ckpt"))
    assert proc.returncode == 2 and "not a full model: unify it first" in proc.stderr
    assert not (tmp_path / "split8").exists()


def _rank_file_named(folder: Path) -> dict[str, np.ndarray]:
    (name,) = [n for n in os.listdir(folder) if n.endswith(".safetensors")]
    with read_safetensors(str(folder / name)) as index:
        return {n: index.array(n).copy() for n in index.entries}
