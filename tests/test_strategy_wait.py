"""``reshard.strategy_wait``: when a destination strategy folder is complete, and what a wait line says.

A folder is complete once its files describe every rank of the world: one complete file of each
pipeline stage (the ranks of a stage write the same layouts), whether the job left one file per
rank or one per stage. What is missing is said as the stage whose file is not there yet.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from reshard.errors import LayoutError, UsageError
from reshard.formats.strategy import encode_strategy, load_strategy, merge_pipeline_strategies, write_strategy
from reshard.strategy_wait import StrategyWait, ranks_of, wait_for_strategy
from reshard.synthetic import ModelShape, stage_strategies

SHAPE = ModelShape(vocab=64, hidden=32, ffn=64, layers=4)
STAGES = stage_strategies(SHAPE, dp=2, mp=2, pp=2, opt_shard=False)  # 4 ranks a stage, 2 stages


def _write(folder: Path, name: str, stage: int, old: bool = True) -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / name
    write_strategy(path, STAGES[stage])
    if old:  # written by an earlier start: settled
        then = time.time() - 60
        os.utime(path, (then, then))
    return path


def test_one_file_per_stage_is_complete_at_once(tmp_path: Path) -> None:
    _write(tmp_path, "ckpt_strategy_rank_0.ckpt", 0)
    _write(tmp_path, "ckpt_strategy_rank_4.ckpt", 1)
    sf = StrategyWait(str(tmp_path), 8, settle=0.5).poll()
    assert sf is not None and ranks_of(sf) == 8
    assert encode_strategy(sf) == encode_strategy(load_strategy(tmp_path))  # as every other command merges it


def test_any_rank_of_a_stage_will_do_and_files_named_otherwise_too(tmp_path: Path) -> None:
    ranks = tmp_path / "ranks"
    _write(ranks, "ckpt_strategy_rank_2.ckpt", 0)
    _write(ranks, "ckpt_strategy_rank_7.ckpt", 1)
    (ranks / "ckpt_strategy_rank_1.ckpt").write_bytes(b"\x08")  # being written, of a stage already there
    assert StrategyWait(str(ranks), 8, settle=0.5).poll() is not None
    named = tmp_path / "named"
    _write(named, "stage_0.ckpt", 0)
    _write(named, "stage_1.ckpt", 1)
    assert StrategyWait(str(named), 8, settle=0.5).poll() is not None
    alone = tmp_path / "alone"  # nothing but a merged file: that file, as load_strategy reads it
    alone.mkdir()
    merge_pipeline_strategies(named, alone / "merged_ckpt_strategy.ckpt")
    then = time.time() - 60
    os.utime(alone / "merged_ckpt_strategy.ckpt", (then, then))
    sf = StrategyWait(str(alone), 8, settle=0.5).poll()
    assert sf is not None and encode_strategy(sf) == encode_strategy(load_strategy(named))


def test_a_missing_stage_is_named_by_its_stage_and_ranks(tmp_path: Path) -> None:
    _write(tmp_path, "ckpt_strategy_rank_0.ckpt", 0)
    watch = StrategyWait(str(tmp_path), 8, settle=0.5)
    assert watch.poll() is None
    where = f"ckpt_strategy_rank_<r>.ckpt in {tmp_path}"
    assert (
        watch.missing
        == f"no strategy file yet of pipeline stage 1 of 2 (the file of any one of its ranks 4-7: {where})"
    )
    (tmp_path / "ckpt_strategy_rank_5.ckpt").write_bytes(b"\x08")  # half written, of the missing stage
    (tmp_path / "ckpt_strategy_rank_9.ckpt").write_bytes(b"\x08")  # beyond the world: not read
    assert watch.poll() is None and watch.missing.endswith("; still being written: rank 5")
    bigger = StrategyWait(str(tmp_path), 16, settle=0.5)  # 4 stages of 4 ranks
    assert bigger.poll() is None
    assert bigger.missing.startswith(
        "no strategy file yet of pipeline stages 1-3 of 4 (each stage's file of any one of its ranks 4-7, 8-11, 12-15:"
    )
    with pytest.raises(UsageError, match=r"timed out after 0 s .*: no strategy file yet of pipeline stage 1 of 2"):
        wait_for_strategy(str(tmp_path), 8, 0, lambda _line: None)


def test_a_folder_that_cannot_describe_the_world_is_refused(tmp_path: Path) -> None:
    _write(tmp_path, "ckpt_strategy_rank_0.ckpt", 0)
    with pytest.raises(LayoutError, match="pipeline stages of 4 ranks"):
        StrategyWait(str(tmp_path), 6, settle=0.5).poll()  # 4 does not divide 6
    _write(tmp_path, "ckpt_strategy_rank_1.ckpt", 1)  # stage 1 where a world of 4 has one stage
    with pytest.raises(LayoutError, match="world size 4 makes 1 pipeline stage, but this file is of stage 1"):
        StrategyWait(str(tmp_path), 4, settle=0.5).poll()
