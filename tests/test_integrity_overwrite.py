"""``--overwrite`` with fewer ranks leaves a destination the next command reads right: the earlier
run's outputs (as its manifest lists them) in rank folders beyond the new layout go, with their
emptied folders; a checkpoint reshard did not write there is refused (exit 2, naming it) before
anything is written; nothing reshard did not write is ever deleted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from reshard import manifest
from tests.trust_helpers import make_job, run_cli, tree


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_job(str(tmp_path_factory.mktemp("ow")))


def _to(job: dict[str, str], dst: str, strategy: str | None, *flags: str) -> None:
    args = ["transform", "--src", job["full"], "--dst", dst, *flags]
    proc = run_cli(*args, *(["--dst-strategy", strategy] if strategy else []))
    assert proc.returncode == 0, proc.stderr


def _ranks(dst: str) -> list[str]:
    return sorted(n for n in os.listdir(dst) if n.startswith("rank_"))


def _reads_back_as_full(job: dict[str, str], dst: str, strategy: str | None, tmp_path) -> None:
    """The next command sees exactly the new output: verify against the full model."""
    args = ["verify", dst, job["full"], *(["--a-strategy", strategy] if strategy else [])]
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_fewer_ranks_remove_the_earlier_runs_rank_folders(job: dict[str, str], tmp_path) -> None:
    dst = str(tmp_path / "out")
    _to(job, dst, job["s8"])
    assert len(_ranks(dst)) == 8
    _to(job, dst, job["s4"], "--overwrite")
    assert _ranks(dst) == [f"rank_{r}" for r in range(4)]
    listed = sorted(o["path"] for o in manifest.read_manifest(dst)["outputs"])
    assert listed == [f"rank_{r}/checkpoint_{r}.ckpt" for r in range(4)]
    _reads_back_as_full(job, dst, job["s4"], tmp_path)
    proc = run_cli("transform", "--src", job["r8"], "--src-strategy", job["s8"], "--dst", dst, "--overwrite")
    assert proc.returncode == 0, proc.stderr  # down to one full rank
    assert _ranks(dst) == ["rank_0"]
    _reads_back_as_full(job, os.path.join(dst, "rank_0", "checkpoint_0.ckpt"), None, tmp_path)


def test_a_foreign_checkpoint_in_the_way_is_refused_before_writing(job: dict[str, str], tmp_path) -> None:
    dst = str(tmp_path / "out")
    _to(job, dst, job["s8"])
    foreign = Path(dst, "rank_7", "mine.ckpt")
    foreign.write_bytes(b"not reshard's")
    before = tree(dst)
    proc = run_cli("transform", "--src", job["full"], "--dst", dst, "--dst-strategy", job["s4"], "--overwrite")
    assert proc.returncode == 2, proc.stderr
    assert str(foreign) in proc.stderr and "reshard did not write this checkpoint" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert tree(dst) == before  # nothing written, nothing removed


def test_a_foreign_checkpoint_in_a_rank_folder_this_run_writes_is_refused(job: dict[str, str], tmp_path) -> None:
    dst = str(tmp_path / "out")
    _to(job, dst, job["s4"])
    Path(dst, "rank_0", "other.safetensors").write_bytes(b"x")
    proc = run_cli("transform", "--src", job["full"], "--dst", dst, "--dst-strategy", job["s4"], "--overwrite")
    assert proc.returncode == 2 and "rank_0/other.safetensors" in proc.stderr, proc.stderr


def test_other_files_stay_and_do_not_confuse(job: dict[str, str], tmp_path) -> None:
    """A file of the user's in a rank folder the new layout no longer has would leave that folder
    behind, and the next read would take it for a rank: refused, naming it, nothing touched."""
    dst = str(tmp_path / "out")
    _to(job, dst, job["s8"])
    notes = Path(dst, "rank_6", "notes.txt")
    notes.write_text("mine")
    before = sorted(str(p.relative_to(dst)) for p in Path(dst).rglob("*"))
    proc = run_cli("transform", "--src", job["full"], "--dst", dst, "--dst-strategy", job["s4"], "--overwrite")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "notes.txt" in proc.stderr and "rank_6/ would stay" in proc.stderr, proc.stderr
    assert sorted(str(p.relative_to(dst)) for p in Path(dst).rglob("*")) == before
    assert notes.read_text() == "mine"  # never deleted
    notes.unlink()  # moved away: now the overwrite goes through
    _to(job, dst, job["s4"], "--overwrite")
    assert _ranks(dst) == [f"rank_{r}" for r in range(4)]
    _reads_back_as_full(job, dst, job["s4"], tmp_path)

    Path(dst, "rank_0", "notes.txt").write_text("mine")  # beside a rank this run writes: harmless, kept
    _to(job, dst, job["s4"], "--overwrite")
    assert Path(dst, "rank_0", "notes.txt").read_text() == "mine"
    _reads_back_as_full(job, dst, job["s4"], tmp_path)


def test_an_earlier_prefix_in_a_rank_folder_is_replaced(job: dict[str, str], tmp_path) -> None:
    dst = str(tmp_path / "out")
    _to(job, dst, job["s4"], "--prefix", "old_")
    _to(job, dst, job["s4"], "--overwrite")
    for r in range(4):
        assert os.listdir(os.path.join(dst, f"rank_{r}")) == [f"checkpoint_{r}.ckpt"]
    _reads_back_as_full(job, dst, job["s4"], tmp_path)


def test_another_nodes_ranks_are_left_alone(job: dict[str, str], tmp_path) -> None:
    """``--ranks`` shares of one layout, written one after the other into one folder."""
    dst = str(tmp_path / "out")
    _to(job, dst, job["s8"], "--ranks", "0-3")
    _to(job, dst, job["s8"], "--ranks", "4-7", "--overwrite")
    assert _ranks(dst) == [f"rank_{r}" for r in range(8)]
    _reads_back_as_full(job, dst, job["s8"], tmp_path)


def test_split_with_fewer_ranks(job: dict[str, str], tmp_path) -> None:
    unified = str(tmp_path / "u")
    assert run_cli("unify", job["r8st"], unified, "--src-strategy", job["s8"]).returncode == 0
    dst = str(tmp_path / "out")
    assert run_cli("split", unified, dst, "--dst-strategy", job["s8"]).returncode == 0
    proc = run_cli("split", unified, dst, "--dst-strategy", job["s4"], "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert _ranks(dst) == [f"rank_{r}" for r in range(4)]
