"""``reshard transform`` with MindFormers' TransformCkpt flags against MindFormers 2.1.0's own tool.

Each case runs ``python .../mindformers/tools/ckpt_transform/transform_checkpoint.py FLAGS`` in the
oracle venv (in a scratch working directory: the tool writes ``./output/log`` there) and
``reshard transform FLAGS`` on the same inputs, and compares the two destination trees: the same
files (checkpoints and ``transform_succeed_rank_<r>.txt`` / ``transform_failed_rank_<r>.txt``
markers), byte for byte. Every flag combination below runs on CPU; the tool needs no device.

Inputs: a synthetic 8-rank job (dp2 x mp2 x pp2 with optimizer shards) saved from a full model,
its per-stage strategy folders and merged strategy files, and a 4-rank destination (dp1 mp2 pp2).
Each side gets its own copy of the inputs, because the tool writes ``merged_ckpt_strategy.ckpt``
into a strategy folder it is given (reshard never writes into its inputs).
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from reshard import api
from reshard.formats.ckpt import save_ckpt
from reshard.formats.strategy import merge_pipeline_strategies
from reshard.synthetic import ModelShape, full_model, stage_strategies, write_stage_strategies
from tests.oracle import oracle_python

pytestmark = pytest.mark.oracle

TOOL_ENV = {"GLOG_v": "3", "PYTHONWARNINGS": "ignore"}


def tool_script() -> str:
    venv = Path(oracle_python()).parent.parent
    found = glob.glob(str(venv / "lib" / "python*" / "site-packages" / "mindformers" / "tools" / "ckpt_transform"
                          / "transform_checkpoint.py"))  # fmt: skip
    assert found, "MindFormers 2.1.0 is not installed in the oracle venv (scripts/oracle_env.sh)"
    return found[0]


def _env(rank_env: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "RANK_", "MA_"))}
    env.update(TOOL_ENV)
    if rank_env is not None:
        env["RANK_ID"] = rank_env
    return env


def start_tool(flags: list[str], cwd: Path, rank_env: str | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [oracle_python(), tool_script(), *flags],
        cwd=cwd,
        env=_env(rank_env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def start_reshard(flags: list[str], cwd: Path, rank_env: str | None = None) -> subprocess.Popen[str]:
    """reshard's invocation; ``rank_env`` is ignored (reshard takes the rank from --rank_id)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK_", "MA_"))}
    return subprocess.Popen(
        [sys.executable, "-m", "reshard.cli", "transform", *flags],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 600) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out or "", err or ""


def tree(root: Path) -> dict[str, str]:
    """Every file below ``root`` (relative path -> sha256), nothing excluded."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            found[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The inputs, once: ``ckpt_8ranks``, ``strategy_8``/``strategy_4`` folders, merged files, a full model."""
    root = tmp_path_factory.mktemp("mf_tool_job")
    shape = ModelShape(vocab=64, hidden=32, ffn=64, layers=2)
    model = full_model(shape)
    save_ckpt(root / "full" / "llama.ckpt", model)
    save_ckpt(root / "fulls" / "small.v1.ckpt", {k: v for k, v in list(model.items())[:6]})
    save_ckpt(root / "fulls" / "other.ckpt", {k: v for k, v in list(model.items())[6:12]})
    write_stage_strategies(str(root / "strategy_8"), stage_strategies(shape, dp=2, mp=2, pp=2, opt_shard=True), 4)
    write_stage_strategies(str(root / "strategy_4"), stage_strategies(shape, dp=1, mp=2, pp=2, opt_shard=False), 2)
    (root / "merged").mkdir()
    merge_pipeline_strategies(str(root / "strategy_8"), str(root / "merged" / "s8.ckpt"))
    merge_pipeline_strategies(str(root / "strategy_4"), str(root / "merged" / "s4.ckpt"))
    api.transform(
        str(root / "full" / "llama.ckpt"),
        str(root / "ckpt_8ranks"),
        None,
        str(root / "merged" / "s8.ckpt"),
        destination=api.Destination(manifest=False),
    )
    return root


def sides(job: Path, tmp_path: Path) -> tuple[Path, Path]:
    """Two private copies of the inputs: ``theirs`` for MindFormers, ``ours`` for reshard."""
    pair = []
    for name in ("theirs", "ours"):
        side = tmp_path / name
        shutil.copytree(job, side, symlinks=True)
        pair.append(side)
    return pair[0], pair[1]


def run_both(job: Path, tmp_path: Path, flags: list[str]) -> tuple[Path, Path, tuple[int, str, str]]:
    theirs, ours = sides(job, tmp_path)
    mf = finish(start_tool(flags, theirs))
    assert mf[0] == 0, mf[1][-3000:]
    mine = finish(start_reshard(flags, ours))
    assert mine[0] == 0, mine[2]
    return theirs, ours, mine


def assert_same_output(theirs: Path, ours: Path, dst: str = "out") -> None:
    a, b = tree(theirs / dst), tree(ours / dst)
    assert sorted(a) == sorted(b), f"file lists differ:\nMindFormers {sorted(a)}\nreshard     {sorted(b)}"
    assert a == b, [k for k in a if a[k] != b[k]]


FLAGS_8_TO_4 = ["--src_checkpoint", "ckpt_8ranks", "--dst_checkpoint_dir", "out"]


def test_rank_folders_with_merged_strategies(job: Path, tmp_path: Path) -> None:
    flags = [*FLAGS_8_TO_4, "--src_strategy", "merged/s8.ckpt", "--dst_strategy", "merged/s4.ckpt"]
    theirs, ours, (_, out, _) = run_both(job, tmp_path, flags)
    assert_same_output(theirs, ours)
    files = tree(ours / "out")
    assert "ckpt_8ranks/transform_succeed_rank_0.txt" in files
    assert {f"ckpt_8ranks/rank_{r}/checkpoint_{r}.ckpt" for r in range(4)} <= set(files)
    assert (ours / "out" / "ckpt_8ranks" / "transform_succeed_rank_0.txt").read_bytes() == b""
    assert out.startswith("wrote ")


def test_strategy_folders_are_merged_without_writing_into_them(job: Path, tmp_path: Path) -> None:
    flags = [*FLAGS_8_TO_4, "--src_strategy", "strategy_8", "--dst_strategy", "strategy_4", "--prefix", "llama_"]
    theirs, ours, _ = run_both(job, tmp_path, flags)
    assert_same_output(theirs, ours)
    assert (theirs / "strategy_8" / "merged_ckpt_strategy.ckpt").exists()  # MindFormers writes into its input
    assert tree(ours / "strategy_8") == tree(job / "strategy_8")  # reshard does not
    assert tree(ours / "strategy_4") == tree(job / "strategy_4")


def test_single_file_source(job: Path, tmp_path: Path) -> None:
    flags = ["--src_checkpoint", "full/llama.ckpt", "--dst_checkpoint_dir", "out", "--dst_strategy", "merged/s4.ckpt"]
    theirs, ours, _ = run_both(job, tmp_path, flags)
    assert_same_output(theirs, ours)
    assert (ours / "out" / "llama" / "rank_3" / "checkpoint_3.ckpt").is_file()


def test_folder_of_ckpt_files_is_one_model_per_file(job: Path, tmp_path: Path) -> None:
    flags = ["--src_checkpoint", "fulls", "--dst_checkpoint_dir", "out", "--dst_strategy", "merged/s4.ckpt"]
    theirs, ours, _ = run_both(job, tmp_path, flags)
    assert_same_output(theirs, ours)
    assert sorted(os.listdir(ours / "out")) == ["other", "small"]  # the name up to its first dot


def test_by_rank_in_one_invocation(job: Path, tmp_path: Path) -> None:
    flags = [*FLAGS_8_TO_4, "--src_strategy", "merged/s8.ckpt", "--dst_strategy", "merged/s4.ckpt",
             "--world_size", "4", "--transform_by_rank", "True"]  # fmt: skip
    theirs, ours, _ = run_both(job, tmp_path, flags)
    assert_same_output(theirs, ours)


def test_to_full_weights_and_default_destination(job: Path, tmp_path: Path) -> None:
    """No --dst_checkpoint_dir: ./transformed_checkpoint; no --dst_strategy: one full model."""
    flags = ["--src_checkpoint", "ckpt_8ranks", "--src_strategy", "merged/s8.ckpt"]
    theirs, ours, _ = run_both(job, tmp_path, flags)
    assert_same_output(theirs, ours, "transformed_checkpoint")


Starter = Callable[[list[str], Path, "str | None"], "subprocess.Popen[str]"]


def _split(job_side: Path, flags: list[str], start: Starter) -> list[tuple[int, str, str]]:
    """Rank 0's invocation first (it clears the output folder), rank 1's once that folder exists.
    MindFormers' tool also gets RANK_ID: it decides which rank clears the folder by it."""
    first = start([*flags, "--rank_id", "0"], job_side, "0")
    model_dir = job_side / "out" / "ckpt_8ranks"
    deadline = time.monotonic() + 300
    while not model_dir.is_dir() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    second = start([*flags, "--rank_id", "1"], job_side, "1")
    return [finish(second), finish(first)]


def test_two_invocations_split_the_ranks(job: Path, tmp_path: Path) -> None:
    """--world_size 2 --transform_process_num 2: rank 0 converts destination rank 0, rank 1 rank 1;
    each writes its marker and returns once both markers are there."""
    flags = [*FLAGS_8_TO_4, "--src_strategy", "merged/s8.ckpt", "--dst_strategy", "merged/s4.ckpt",
             "--world_size", "2", "--transform_process_num", "2"]  # fmt: skip
    theirs, ours = sides(job, tmp_path)
    for code, out, _ in _split(theirs, flags, start_tool):
        assert code == 0, out[-3000:]
    for code, _, err in _split(ours, flags, start_reshard):
        assert code == 0, err
    assert_same_output(theirs, ours)
    assert sorted(tree(ours / "out")) == [
        "ckpt_8ranks/rank_0/checkpoint_0.ckpt",
        "ckpt_8ranks/rank_1/checkpoint_1.ckpt",
        "ckpt_8ranks/transform_succeed_rank_0.txt",
        "ckpt_8ranks/transform_succeed_rank_1.txt",
    ]


def test_a_failed_conversion_leaves_the_failure_marker(job: Path, tmp_path: Path) -> None:
    """By rank with --world_size 8 into a 4-rank strategy: ranks 0-3 are written, rank 4 fails; both
    tools leave transform_failed_rank_0.txt (with their own error text) and exit non-zero."""
    flags = [*FLAGS_8_TO_4, "--src_strategy", "merged/s8.ckpt", "--dst_strategy", "merged/s4.ckpt",
             "--world_size", "8", "--transform_by_rank", "1"]  # fmt: skip
    theirs, ours = sides(job, tmp_path)
    mf = finish(start_tool(flags, theirs))
    code, _, err = finish(start_reshard(flags, ours))
    assert mf[0] != 0 and code == 2 and err.count("\n") == 1, err
    a, b = tree(theirs / "out"), tree(ours / "out")
    assert sorted(a) == sorted(b) and "ckpt_8ranks/transform_failed_rank_0.txt" in b
    assert {k: v for k, v in a.items() if k.endswith(".ckpt")} == {k: v for k, v in b.items() if k.endswith(".ckpt")}
    message = (ours / "out" / "ckpt_8ranks" / "transform_failed_rank_0.txt").read_text()
    assert message and "\n" not in message and message in err
