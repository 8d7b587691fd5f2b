"""``reshard transform`` with MindFormers' TransformCkpt flags, through the CLI: the protocol around
the conversion (markers, reruns, which invocation converts what) and bad input. The trees themselves
are compared with MindFormers' own tool in tests/test_mf_tool_transform_oracle.py."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from reshard import api
from reshard.formats.ckpt import save_ckpt
from reshard.synthetic import ModelShape, full_model, stage_strategies, write_stage_strategies


def cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RANK_")}
    return subprocess.run(
        [sys.executable, "-m", "reshard.cli", "transform", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**base, **(env or {})},
        timeout=timeout,
    )


def tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mf_tool_cli")
    shape = ModelShape(vocab=32, hidden=16, ffn=32, layers=2)
    model = full_model(shape)
    save_ckpt(root / "full" / "m.ckpt", model)
    write_stage_strategies(str(root / "strategy_4"), stage_strategies(shape, dp=1, mp=2, pp=2, opt_shard=False), 2)
    write_stage_strategies(str(root / "strategy_2"), stage_strategies(shape, dp=1, mp=2, pp=1, opt_shard=False), 2)
    api.transform(
        str(root / "full" / "m.ckpt"),
        str(root / "ranks4"),
        None,
        str(root / "strategy_4"),
        destination=api.Destination(manifest=False),
    )
    return root


BASE = ["--src_checkpoint", "ranks4", "--dst_checkpoint_dir", "out", "--src_strategy", "strategy_4",
        "--dst_strategy", "strategy_2"]  # fmt: skip


def test_output_layout_and_rerun(job: Path) -> None:
    out = job / "out"
    proc = cli(*BASE, cwd=job)
    assert proc.returncode == 0, proc.stderr
    first = tree(out)
    assert sorted(first) == [
        "ranks4/rank_0/checkpoint_0.ckpt",
        "ranks4/rank_1/checkpoint_1.ckpt",
        "ranks4/transform_succeed_rank_0.txt",
    ]
    assert proc.stdout.startswith("wrote 3 files") and str(out / "ranks4") in proc.stdout
    assert not (job / "strategy_4" / "merged_ckpt_strategy.ckpt").exists()  # inputs untouched
    # a rerun replaces the earlier run's output (MindFormers' tool remakes the folder): same tree
    (out / "ranks4" / "rank_5").mkdir()
    (out / "ranks4" / "rank_5" / "checkpoint_5.ckpt").write_bytes(b"stale")
    (out / "ranks4" / "transform_failed_rank_3.txt").write_text("old")
    proc = cli(*BASE, cwd=job)
    assert proc.returncode == 0, proc.stderr
    assert tree(out) == first


def test_a_foreign_file_in_the_output_folder_is_refused(job: Path) -> None:
    out = job / "out_foreign"
    assert cli(*BASE[:2], "--dst_checkpoint_dir", "out_foreign", *BASE[4:], cwd=job).returncode == 0
    notes = out / "ranks4" / "rank_0" / "notes.txt"
    notes.write_text("mine")
    before = tree(out)
    proc = cli(*BASE[:2], "--dst_checkpoint_dir", "out_foreign", *BASE[4:], cwd=job)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "notes.txt" in proc.stderr, proc.stderr
    assert tree(out) == before


def test_a_rank_that_does_not_convert_waits_for_the_markers(job: Path) -> None:
    """--world_size 2: rank 0 converts everything; rank 1 returns once rank 0's marker is there."""
    out = job / "out_wait"
    flags = [*BASE[:2], "--dst_checkpoint_dir", "out_wait", *BASE[4:], "--world_size", "2"]
    waiting = subprocess.Popen(
        [sys.executable, "-m", "reshard.cli", "transform", *flags, "--rank_id", "1"],
        cwd=job, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(1.5)
    assert waiting.poll() is None  # still waiting: nothing converted rank 0's share yet
    (out / "ranks4").mkdir(parents=True, exist_ok=True)
    proc = cli(*flags, "--rank_id", "0", cwd=job)
    assert proc.returncode == 0, proc.stderr
    _, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 0, err
    assert "waiting for 1 more transform_succeed_rank_<r>.txt" in err
    assert sorted(tree(out)) == [
        "ranks4/rank_0/checkpoint_0.ckpt",
        "ranks4/rank_1/checkpoint_1.ckpt",
        "ranks4/transform_succeed_rank_0.txt",
    ]


def test_a_failure_marker_ends_the_wait(job: Path) -> None:
    model_dir = job / "out_failed" / "ranks4"
    model_dir.mkdir(parents=True)
    timer = threading.Timer(1.0, lambda: (model_dir / "transform_failed_rank_0.txt").write_text("boom"))
    timer.start()
    proc = cli(*BASE[:2], "--dst_checkpoint_dir", "out_failed", *BASE[4:], "--world_size", "2", "--rank_id", "1",
               cwd=job)  # fmt: skip
    timer.join()
    assert proc.returncode == 2, proc.stderr  # (a waiting note before it when the marker came late)
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("reshard: error: ") and "failed on another rank" in last
    assert "transform_failed_rank_0.txt" in last


def test_rank_id_zero_defers_to_rank_id_variable(job: Path) -> None:
    """As in the tool, --rank_id 0 (its default) means the RANK_ID variable; --world_size 2 -P 2 by rank."""
    flags = [*BASE[:2], "--dst_checkpoint_dir", "out_env", *BASE[4:], "--world_size", "2",
             "--transform_process_num", "2"]  # fmt: skip
    model_dir = job / "out_env" / "ranks4"
    model_dir.mkdir(parents=True)
    (model_dir / "transform_succeed_rank_0.txt").write_text("")  # rank 0's share, as if done
    proc = cli(*flags, cwd=job, env={"RANK_ID": "1"})
    assert proc.returncode == 0, proc.stderr
    assert sorted(tree(job / "out_env")) == [
        "ranks4/rank_1/checkpoint_1.ckpt",
        "ranks4/transform_succeed_rank_0.txt",
        "ranks4/transform_succeed_rank_1.txt",
    ]


def test_transform_by_rank_takes_any_value_as_true(job: Path) -> None:
    proc = cli(*BASE[:2], "--dst_checkpoint_dir", "out_bool", *BASE[4:], "--world_size", "2",
               "--transform_by_rank", "False", "--transform_process_num", "1", cwd=job)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "--transform_by_rank False means True" in proc.stderr
    # by rank, rank 0 converts ranks 0 .. world_size/process_num - 1: both destination ranks
    assert sorted(tree(job / "out_bool"))[:2] == ["ranks4/rank_0/checkpoint_0.ckpt", "ranks4/rank_1/checkpoint_1.ckpt"]


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--src_checkpoint", "missing", "--dst_strategy", "strategy_2"], "not found"),
        (["--src_checkpoint", "strategy_2/ckpt_strategy_rank_0.ckpt.txt"], "not found"),
        (["--src_checkpoint", "full/notes.txt", "--dst_strategy", "strategy_2"], "folder or a .ckpt file"),
        (["--src_checkpoint", "empty", "--dst_strategy", "strategy_2"], "no rank_0 folder"),
        (["--src_checkpoint", "gap", "--src_strategy", "strategy_4", "--dst_strategy", "strategy_2"],
         "rank_1 folder is missing"),
        (["--src_checkpoint", "ranks4", "--dst_strategy", "strategy_2"], "no --src_strategy"),
        (["--src_checkpoint", "full/m.ckpt"], "cannot both be None"),
        (["--src_checkpoint", "ranks4", "--src_strategy", "nope", "--dst_strategy", "strategy_2"], "not found"),
        ([*BASE, "--transform_process_num", "0"], "at least 1"),
        ([*BASE, "--world_size", "4", "--transform_process_num", "3"], "does not divide"),
        ([*BASE, "--rank_id", "-1"], "count from 0"),
        ([*BASE, "--prefix", "../x"], "path separator"),
        ([*BASE, "--src", "ranks4"], "does not combine"),
        ([*BASE, "--ranks", "0"], "does not combine"),
        ([*BASE, "--output-format", "safetensors"], ".ckpt"),
        (["--dst_checkpoint_dir", "out", "--world_size", "2"], "--src_checkpoint"),
        # DST/<name> would be the source itself (the tool deletes it): refused
        (["--src_checkpoint", "ranks4", "--dst_checkpoint_dir", ".", "--src_strategy", "strategy_4",
          "--dst_strategy", "strategy_2"], "overlap"),
        (["--src_checkpoint", "ranks4", "--dst_checkpoint_dir", "ranks4/..", "--src_strategy", "strategy_4",
          "--dst_strategy", "strategy_2"], "overlap"),
        # DST/strategy_2 would be the destination strategy folder
        (["--src_checkpoint", "full/strategy_2.ckpt", "--dst_checkpoint_dir", ".", "--dst_strategy",
          "strategy_2"], "overlap"),
    ],
)  # fmt: skip
def test_bad_input(job: Path, flags: list[str], fragment: str) -> None:
    (job / "empty").mkdir(exist_ok=True)
    (job / "full" / "notes.txt").write_text("x")
    (job / "full" / "strategy_2.ckpt").write_bytes((job / "full" / "m.ckpt").read_bytes())
    for rank in (0, 2):
        (job / "gap" / f"rank_{rank}").mkdir(parents=True, exist_ok=True)
    before = tree(job)
    proc = cli(*flags, cwd=job)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and fragment in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert tree(job) == before  # nothing written
    assert not (job / "transformed_checkpoint").exists()
