"""A node without a shared disk needs only the files ``rank-list R --files`` lists, not every
rank MindSpore's needed list names (its redundant copies): the plan stands in for the others and
proves it reads none of them. Each single-rank run on such a partial copy writes the very bytes
of a run over every rank; a plan that would read an absent rank still names it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from reshard import api
from tests.test_promises_recipes import demo, full_run, needed, one_error, rank_file  # noqa: F401
from tests.trust_helpers import run_cli as run


def copy_list(demo: dict[str, str], rank: int) -> list[str]:  # noqa: F811
    proc = run(
        "rank-list", str(rank), "--src", demo["r8"], "--src-strategy", demo["s8"], "--dst-strategy", demo["s4"],
        "--files", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def partial_copy(files: list[str], node: Path) -> None:
    for f in files:
        folder = node / Path(f).parent.name
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, folder)


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_the_files_rank_list_names_are_enough(
    demo: dict[str, str],  # noqa: F811
    full_run: str,  # noqa: F811
    tmp_path: Path,
    rank: int,
) -> None:
    files = copy_list(demo, rank)
    assert len(files) < len(needed(demo, rank)) or rank >= 2  # fewer than MindSpore's list where copies repeat
    node = tmp_path / "node"
    partial_copy(files, node)
    out = tmp_path / "out"
    args = ["--src", str(node), "--dst", str(out), "--src-strategy", demo["s8"], "--dst-strategy", demo["s4"]]
    proc = run("transform", *args, "--ranks", str(rank), "-q")
    assert proc.returncode == 0, proc.stderr
    assert Path(rank_file(str(out), rank)).read_bytes() == Path(rank_file(full_run, rank)).read_bytes()


def test_a_partial_copy_plans_what_the_whole_tree_plans(demo: dict[str, str], tmp_path: Path) -> None:  # noqa: F811
    node = tmp_path / "node"
    partial_copy(copy_list(demo, 0), node)
    whole = api.transform(
        demo["r8"], str(tmp_path / "a"), demo["s8"], demo["s4"], ranks=[0], destination=api.Destination(dry_run=True)
    ).plan
    part = api.transform(
        str(node), str(tmp_path / "a"), demo["s8"], demo["s4"], ranks=[0], destination=api.Destination(dry_run=True)
    ).plan

    def relative(plan: object) -> str:
        text = json.dumps(plan.to_json())  # type: ignore[attr-defined]
        return text.replace(demo["r8"], "SRC").replace(str(node), "SRC")

    assert relative(part) == relative(whole)


def test_dropping_a_listed_file_names_it(demo: dict[str, str], tmp_path: Path) -> None:  # noqa: F811
    files = copy_list(demo, 0)
    node = tmp_path / "node"
    partial_copy(files[1:], node)
    gone = Path(files[0]).parent.name
    out = tmp_path / "out"
    args = ["--src", str(node), "--dst", str(out), "--src-strategy", demo["s8"], "--dst-strategy", demo["s4"]]
    line = one_error(run("transform", *args, "--ranks", "0"))
    assert f"{gone} is missing" in line, line
    assert not out.exists()


def test_a_stage_whose_files_differ_is_not_stood_in(demo: dict[str, str], tmp_path: Path) -> None:  # noqa: F811
    """Present files of one stage with different names (a save without redundant copies, say): an
    absent rank of that stage is not stood in for, and the run names it."""
    files = copy_list(demo, 0)
    node = tmp_path / "node"
    partial_copy(files, node)
    assert sorted(p.name for p in node.iterdir()) == ["rank_0", "rank_2", "rank_4"]
    (node / "rank_5").mkdir()
    shutil.copy(rank_file(demo["r8"], 0), node / "rank_5" / "checkpoint_5.ckpt")  # a stage-0 file's names
    out = tmp_path / "out"
    args = ["--src", str(node), "--dst", str(out), "--src-strategy", demo["s8"], "--dst-strategy", demo["s4"]]
    line = one_error(run("transform", *args, "--ranks", "0"))
    assert f"rank 6 is needed by destination rank 0 but {node}/rank_6 is missing" in line, line
    assert not out.exists()
