"""A Checkpoint 2.0 resharded into a Checkpoint 2.0 keeps its iteration and its common.json values."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from reshard.formats.safetensors import read_safetensors
from reshard.formats.strategy import make_strategy, write_strategy
from reshard.layout import ParamLayout
from tests import checkpoint2_fixtures as fx
from tests.trust_helpers import run_cli

COMMON = {"epoch_num": 2, "step_num": 30, "global_step": 130, "loss_scale": 1024.0, "ckpt_status": 0}


def _four_rows(tmp: Path, full: dict[str, np.ndarray]) -> str:
    layouts = {
        name: ParamLayout((4,), ((0,) if a.shape[0] % 4 == 0 else (-1,)) + (-1,) * (a.ndim - 1))
        for name, a in full.items()
        if a.ndim
    }
    path = str(tmp / "s4.ckpt")
    write_strategy(path, make_strategy(layouts))
    return path


def test_iteration_and_common_json_carried_over(tmp_path: Path) -> None:
    src = tmp_path / "src"
    full = fx.write_checkpoint2(str(src), fx.dp2_tp4_params(), 8, iteration=130, common=COMMON)
    out = tmp_path / "out"
    proc = run_cli(
        "transform", "--src", str(src), "--dst", str(out), "--dst-strategy", _four_rows(tmp_path, full),
        "--output-format", "checkpoint2", "--common-json", str(_given(tmp_path, {"consumed_samples": 4160})),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "130"
    common = json.loads((out / "iteration_00000130" / "common.json").read_text())
    assert common == {
        "epoch_num": 2,
        "step_num": 30,
        "global_step": 130,
        "loss_scale": 1024.0,
        "global_batch_size": None,
        "consumed_samples": 4160,
        "ckpt_status": 0,
    }
    assert "common.json: ckpt_status, epoch_num, global_step, loss_scale, step_num carried over" in proc.stderr
    with read_safetensors(str(out / "iteration_00000130" / "model-0000001-0000004.safetensors")) as index:
        name = next(n for n, a in full.items() if a.ndim and a.shape[0] % 4 == 0 and n in index.entries)
        rows = full[name].shape[0] // 4
        assert np.array_equal(index.array(name), full[name][rows : 2 * rows])


def test_given_iteration_and_values_win(tmp_path: Path) -> None:
    src = tmp_path / "src"
    full = fx.write_checkpoint2(str(src), fx.dp2_tp4_params(), 8, iteration=130, common=COMMON)
    out = tmp_path / "out"
    proc = run_cli(
        "transform", "--src", str(src), "--dst", str(out), "--dst-strategy", _four_rows(tmp_path, full),
        "--output-format", "checkpoint2", "--dst-iteration", "7", "--common-json",
        str(_given(tmp_path, {"global_step": 7, "ckpt_status": None})),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "7"
    common = json.loads((out / "iteration_00000007" / "common.json").read_text())
    assert common["global_step"] == 7 and common["ckpt_status"] is None and common["epoch_num"] == 2


def _given(tmp: Path, values: dict[str, object]) -> Path:
    path = tmp / "given.json"
    path.write_text(json.dumps(values))
    return path
